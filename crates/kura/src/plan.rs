//! `kura plan`: reads a model (catalog name, HF `config.json` or directory, GGUF file), wires the flags into
//! `kura_plan::PlanRequest`, and prints the answer as a table or JSON.

use std::path::Path;

use anyhow::{bail, Context, Result};
use clap::Args;
use kura_kv::codec::KvDtype;
use kura_kv::units::{format_bytes, parse_bytes};
use kura_model::gguf::GgufFile;
use kura_plan::catalog::{self, find_gpu, find_model};
use kura_plan::spec::{GgufMetadata, ModelSpec};
use kura_plan::{Device, PlanReport, PlanRequest, WeightsDtype, DEFAULT_MAX_BATCHED_TOKENS};

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// A catalog name (see --list-models), an HF config.json or model directory, or a GGUF file.
    /// Default: Kura's default model file.
    #[arg(long, short)]
    model: Option<String>,
    /// Tokens per request (prompt + output). Default: the model's maximum context.
    #[arg(long)]
    context: Option<u64>,
    /// Concurrent requests to size for.
    #[arg(long, default_value_t = 1)]
    batch: u64,
    /// KV element format: f32, f16, bf16, fp8, int8, int4.
    #[arg(long, default_value = "f16")]
    kv_dtype: KvDtype,
    /// Weights format for the size estimate: f32, f16, bf16, fp8, int8, int4. Default: a GGUF file's exact
    /// tensor bytes, else bf16.
    #[arg(long, value_parser = parse_weights_dtype)]
    weights_dtype: Option<WeightsDtype>,
    /// Tensor-parallel ranks (KV heads are split across them).
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Pipeline-parallel stages (layers are split across them).
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Tokens per KV block (1..=1024).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// An accelerator of the catalog (see --list-gpus), for its memory.
    #[arg(long, conflicts_with = "memory")]
    gpu: Option<String>,
    /// Memory of one device, e.g. 24GiB or 80GB. Default: this machine's RAM (Kura runs on the CPU).
    #[arg(long, value_parser = parse_size)]
    memory: Option<u64>,
    /// Fraction of the memory Kura may use.
    #[arg(long, default_value_t = 0.9)]
    memory_utilization: f64,
    /// A KV budget given directly, as `kura serve --kv-cache-memory`: skips the memory arithmetic.
    #[arg(long, value_parser = parse_size)]
    kv_cache_memory: Option<u64>,
    /// Runtime overhead (default: 1 GiB on an accelerator, 256 MiB on the CPU).
    #[arg(long, value_parser = parse_size)]
    overhead: Option<u64>,
    /// Activation peak (default: estimated from the largest forward step; see README).
    #[arg(long, value_parser = parse_size)]
    activation: Option<u64>,
    /// Tokens of the largest forward step, for the activation estimate.
    #[arg(long, default_value_t = DEFAULT_MAX_BATCHED_TOKENS)]
    max_batched_tokens: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// List the model catalog and exit.
    #[arg(long)]
    list_models: bool,
    /// List the accelerator catalog and exit.
    #[arg(long)]
    list_gpus: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    parse_bytes(s).map_err(|e| e.to_string())
}

fn parse_weights_dtype(s: &str) -> Result<WeightsDtype, String> {
    s.parse()
}

/// A model read from wherever `--model` points, with its exact weight bytes when the files tell them.
struct LoadedSpec {
    spec: ModelSpec,
    weights_bytes: Option<u64>,
}

fn load_spec(model: &str) -> Result<LoadedSpec> {
    let path = Path::new(model);
    if path.is_dir() {
        let cfg = path.join("config.json");
        if !cfg.is_file() {
            bail!("{} is a directory without a config.json", path.display());
        }
        let mut loaded = load_config(&cfg)?;
        let mut total = 0u64;
        for entry in
            std::fs::read_dir(path).with_context(|| format!("reading {}", path.display()))?
        {
            let p = entry?.path();
            if p.extension().is_some_and(|e| e == "safetensors") {
                total += p.metadata()?.len();
            }
        }
        loaded.weights_bytes = (total > 0).then_some(total);
        return Ok(loaded);
    }
    if path.is_file() {
        let mut magic = Vec::with_capacity(4);
        use std::io::Read;
        std::fs::File::open(path)
            .with_context(|| format!("opening {}", path.display()))?
            .take(4)
            .read_to_end(&mut magic)
            .with_context(|| format!("reading {}", path.display()))?;
        // A `.gguf` name goes to the GGUF reader even when the magic is wrong, so that a truncated or
        // empty file is reported as the GGUF it was meant to be.
        let named_gguf = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        if magic.is_empty() && !named_gguf {
            bail!(
                "{} is empty: expected a GGUF file or an HF config.json",
                path.display()
            );
        }
        return if magic == b"GGUF" || named_gguf {
            load_gguf(path)
        } else {
            load_config(path)
        };
    }
    if model.ends_with(".json")
        || model.ends_with(".gguf")
        || model.starts_with('.')
        || model.starts_with('/')
    {
        bail!("no such file: {model}");
    }
    let entry = find_model(model)?;
    Ok(LoadedSpec {
        spec: entry.spec(),
        weights_bytes: None,
    })
}

fn load_config(path: &Path) -> Result<LoadedSpec> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let name = path
        .parent()
        .and_then(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let spec = ModelSpec::from_hf_config_str(&text, &name, &path.display().to_string())
        .with_context(|| format!("{}", path.display()))?;
    Ok(LoadedSpec {
        spec,
        weights_bytes: None,
    })
}

/// A GGUF file's shape through the shape reader the runtime uses (`ModelSpec::from_gguf`); a per-layer
/// array (layers of different widths) is sized by its largest element.
fn load_gguf(path: &Path) -> Result<LoadedSpec> {
    let file = GgufFile::open(path)?;
    let meta = &file.metadata;
    let arch = match meta.get("general.architecture") {
        Some(kura_model::gguf::Value::String(s)) => s.clone(),
        _ => bail!("GGUF has no general.architecture string"),
    };
    let number = |key: &str| -> Result<Option<u64>, String> {
        match meta.get(key) {
            None => Ok(None),
            Some(kura_model::gguf::Value::Array(a)) => {
                Ok(a.iter().filter_map(|v| v.as_u64()).max())
            }
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| format!("GGUF metadata '{key}' is not an unsigned integer")),
        }
    };
    let token_count = match meta.get("tokenizer.ggml.tokens") {
        Some(kura_model::gguf::Value::Array(tokens)) => Some(tokens.len()),
        _ => None,
    };
    // Tensors do not overlap inside the file, so these sums are bounded by its size; checked anyway.
    let params = file
        .tensors
        .values()
        .try_fold(0u64, |sum, t| sum.checked_add(t.n_elements() as u64))
        .context("GGUF tensor element counts overflow 64 bits")?;
    let name = match meta.get("general.name") {
        Some(kura_model::gguf::Value::String(s)) => s.clone(),
        _ => path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
    };
    let spec = ModelSpec::from_gguf(
        &GgufMetadata {
            arch: &arch,
            number: &number,
            token_count,
            has_output_weight: file.tensors.contains_key("output.weight"),
            num_parameters: Some(params),
        },
        &name,
        &path.display().to_string(),
    )
    .with_context(|| format!("GGUF metadata of {}", path.display()))?;
    let weights_bytes = file
        .tensors
        .values()
        .try_fold(0u64, |sum, t| sum.checked_add(t.n_bytes))
        .context("GGUF tensor sizes overflow 64 bits")?;
    Ok(LoadedSpec {
        spec,
        weights_bytes: Some(weights_bytes),
    })
}

pub fn run(args: PlanArgs) -> Result<()> {
    if args.list_models {
        println!("{:<26} {:>10}  source", "model", "params");
        for m in catalog::models() {
            println!(
                "{:<26} {:>9.2}B  {}",
                m.name,
                m.params as f64 / 1e9,
                m.source
            );
        }
        return Ok(());
    }
    if args.list_gpus {
        for g in catalog::gpus() {
            println!("{:<16} {}", g.name, format_bytes(g.memory_bytes));
        }
        return Ok(());
    }
    let model = match &args.model {
        Some(m) => m.clone(),
        None => kura_model::default_model_path().display().to_string(),
    };
    let loaded = load_spec(&model).with_context(|| format!("model '{model}'"))?;
    let mut req = PlanRequest::new(loaded.spec);
    req.weights_dtype = args.weights_dtype.unwrap_or(WeightsDtype::Bf16);
    req.weights_bytes = if args.weights_dtype.is_some() {
        None
    } else {
        loaded.weights_bytes
    };
    req.kv_dtype = args.kv_dtype;
    req.block_size_tokens = args.block_size;
    req.context = args.context;
    req.batch = args.batch;
    req.tp = args.tp;
    req.pp = args.pp;
    req.memory_utilization = args.memory_utilization;
    req.kv_cache_memory = args.kv_cache_memory;
    req.overhead_bytes = args.overhead;
    req.activation_bytes = args.activation;
    req.max_batched_tokens = args.max_batched_tokens;
    let mut memory_note = String::new();
    match (&args.gpu, args.memory) {
        (Some(name), _) => {
            let gpu = find_gpu(name)?;
            req.memory_bytes = Some(gpu.memory_bytes);
            req.device = Device::Accelerator;
            memory_note = format!(" ({})", gpu.name);
        }
        (None, Some(m)) => {
            req.memory_bytes = Some(m);
            req.device = Device::Cpu;
        }
        (None, None) => {
            req.device = Device::Cpu;
            if args.kv_cache_memory.is_none() {
                req.memory_bytes = Some(
                    crate::memory::total_memory_bytes()
                        .context("this machine's memory (give --memory)")?,
                );
                memory_note = " (this machine's RAM)".into();
            }
        }
    }
    let report = req.plan()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report, &memory_note);
    }
    Ok(())
}

fn print_table(r: &PlanReport, memory_note: &str) {
    let b = |v: u64| format!("{} ({v} B)", format_bytes(v));
    println!("Model           {}  [{}]", r.model, r.source);
    println!(
        "Shape           {} layers, {} KV heads × head dim {}, {}; {:.3} B params",
        r.num_layers,
        r.num_kv_heads,
        r.head_dim,
        r.attention,
        r.params as f64 / 1e9
    );
    println!(
        "KV format       {}, blocks of {} tokens, tp {} × pp {}",
        r.kv_dtype, r.block_size, r.tp, r.pp
    );
    println!();
    println!("KV per token    {}", b(r.kv_bytes_per_token));
    println!(
        "KV per request  {} at {} tokens",
        b(r.kv_bytes_per_request),
        r.context
    );
    println!(
        "KV for batch    {} for {} requests",
        b(r.kv_bytes_total),
        r.batch
    );
    println!();
    println!("Memory per device");
    if let (Some(mem), Some(util)) = (r.memory_bytes, r.memory_utilization) {
        let usable = (mem as f64 * util).floor() as u64;
        println!(
            "  memory               {:>12}{memory_note}",
            format_bytes(mem)
        );
        println!("  usable (× {util:.2})      {:>12}", format_bytes(usable));
        let exact = if r.weights_exact {
            "exact, from the file"
        } else {
            "params × bytes per weight"
        };
        println!(
            "  − weights            {:>12}  {exact}",
            format_bytes(r.weights_bytes)
        );
        println!(
            "  − runtime overhead   {:>12}  estimate (--overhead)",
            format_bytes(r.overhead_bytes)
        );
        println!(
            "  − activation peak    {:>12}  estimate (--activation)",
            format_bytes(r.activation_bytes)
        );
        if r.fits {
            println!(
                "  = KV budget          {:>12}",
                format_bytes(r.kv_budget_bytes)
            );
        } else {
            println!(
                "  = does not fit       short by {} ({} B): no KV budget",
                format_bytes(r.short_bytes),
                r.short_bytes
            );
        }
    } else {
        println!(
            "  KV budget            {:>12}  (--kv-cache-memory)",
            format_bytes(r.kv_budget_bytes)
        );
    }
    println!();
    println!("Capacity");
    println!(
        "  KV cache             {} blocks of {} tokens = {} tokens",
        r.num_blocks, r.block_size, r.max_tokens_in_pool
    );
    println!(
        "  max concurrency      {} requests of {} tokens",
        r.max_concurrency, r.context
    );
    println!(
        "  longest context      {} tokens for {} concurrent requests",
        r.max_context_for_batch, r.batch
    );
    for w in &r.warnings {
        println!("warning: {w}");
    }
}
