//! `kura plan`: reads a model (catalog name, HF `config.json` or directory, GGUF file), wires the flags into
//! `kura_plan::PlanRequest`, and prints the answer as a table or JSON. The lower KV tiers take `kura
//! serve`'s own flags ([`TierArgs`]) and are counted in blocks by the server's own code
//! ([`crate::tiers::TierSizes`]) over the planner's pool layout.

use std::path::Path;

use anyhow::{bail, Context, Result};
use clap::Args;
use kura_kv::codec::KvDtype;
use kura_kv::units::{format_bytes, parse_bytes};
use kura_model::gguf::GgufFile;
use kura_plan::catalog::{self, find_gpu, find_model};
use kura_plan::spec::{GgufMetadata, ModelSpec};
use kura_plan::{
    Device, DiskTier, LowerTiers, PlanReport, PlanRequest, Preemption, Scheduling, WeightsDtype,
    DEFAULT_MAX_BATCHED_TOKENS,
};

use crate::memory::KvMemoryRequest;
use crate::tiers::{TierArgs, TierSizes};
use kura_cuda::budget::{Dims, PoolPlan, PoolRequest};

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
    /// KV element format: f32, f16, bf16, fp8, int8 or int4 (the quantised ones as `kura serve` stores
    /// them: scales included). Default bf16, as `kura serve`.
    #[arg(long, default_value = "bf16")]
    kv_dtype: KvDtype,
    /// Weights format: native (default: as `kura serve` holds a GGUF's block formats, exactly; a float
    /// checkpoint as stored), or f32, f16, bf16, fp8, int8, int4 for an estimate from the parameters.
    #[arg(long, value_parser = parse_weights_dtype)]
    weights_dtype: Option<WeightsDtype>,
    /// Tensor-parallel ranks (KV heads are split across them).
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Pipeline-parallel stages (layers are split across them).
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Tokens per KV block (1..=1024).
    #[arg(long, default_value_t = 16, value_parser = crate::setup::block_size_arg)]
    block_size: usize,
    /// An accelerator of the catalog (see --list-gpus), for its memory. With a single-GPU model and flags
    /// `kura serve --device cuda` takes, the plan is that server's (its weights, measured CUDA context,
    /// activation buffers and reserve; the pool to the block).
    #[arg(long)]
    gpu: Option<String>,
    /// Memory of one device, e.g. 24GiB or 80GB. Default: this machine's RAM (Kura runs on the CPU). With
    /// --gpu: the device's memory as its driver reports it, in place of the catalog's.
    #[arg(long, value_parser = parse_size)]
    memory: Option<u64>,
    /// Fraction of the memory Kura may use.
    #[arg(long, default_value_t = 0.9)]
    memory_utilization: f64,
    /// A KV budget given directly, as `kura serve --kv-cache-memory`: skips the memory arithmetic. With
    /// --gpu also a share (`90%`, `0.9`) of what the weights, CUDA context, activation buffers and
    /// reserve leave, as `kura serve --device cuda` takes it.
    #[arg(long, value_parser = parse_kv_memory)]
    kv_cache_memory: Option<KvMemoryRequest>,
    /// Runtime overhead (default: 1 GiB on an accelerator, 256 MiB on the CPU).
    #[arg(long, value_parser = parse_size)]
    overhead: Option<u64>,
    /// Activation peak (default: estimated from the largest forward step; see docs/plan.md).
    #[arg(long, value_parser = parse_size)]
    activation: Option<u64>,
    /// Tokens of the largest forward step, for the activation estimate (`kura serve
    /// --max-num-batched-tokens`).
    #[arg(
        long,
        alias = "max-num-batched-tokens",
        default_value_t = DEFAULT_MAX_BATCHED_TOKENS,
        value_parser = clap::value_parser!(u64).range(1..=1 << 32)
    )]
    max_batched_tokens: u64,
    /// With --gpu: sequences of the largest forward step, as `kura serve --max-num-seqs` (the GPU's
    /// logits buffers are sized by it).
    #[arg(long, default_value_t = 64, value_parser = crate::setup::step_count_arg)]
    max_num_seqs: usize,
    /// With --gpu: as `kura serve --speculative-config` (the GPU's logits buffers hold a row for each
    /// draft token a step checks too; with `disable_by_batch_size` N, those of N − 1 sequences).
    #[arg(long, value_parser = crate::speculative::parse_speculative_config)]
    speculative_config: Option<kura_engine::NgramDraft>,
    /// Admission, as `kura serve --scheduling`: with `guaranteed` the plan also says how many requests
    /// of `--context` tokens are admitted at once with every KV block of their full length reserved.
    #[arg(long, value_enum, default_value_t = Scheduling::MaxUtilization)]
    scheduling: Scheduling,
    /// As `kura serve --no-hybrid-pool`: a model with sliding layers gets whole-model blocks.
    #[arg(long)]
    no_hybrid_pool: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// List the model catalog and exit.
    #[arg(long)]
    list_models: bool,
    /// List the accelerator catalog and exit.
    #[arg(long)]
    list_gpus: bool,
    /// The lower KV tiers, as `kura serve` takes them.
    #[command(flatten)]
    tiers: TierArgs,
}

fn parse_size(s: &str) -> Result<u64, String> {
    parse_bytes(s).map_err(|e| e.to_string())
}

fn parse_kv_memory(s: &str) -> Result<KvMemoryRequest, String> {
    KvMemoryRequest::parse(s).map_err(|e| format!("{e:#}"))
}

fn parse_weights_dtype(s: &str) -> Result<WeightsDtype, String> {
    s.parse()
}

/// A model read from wherever `--model` points, with its exact weight bytes when the files tell them.
struct LoadedSpec {
    spec: ModelSpec,
    weights_bytes: Option<u64>,
    /// The runtime's reading of the same file (a config or GGUF the runtime loads): what the GPU
    /// executor is sized by.
    runtime: Option<kura_model::ModelConfig>,
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
        runtime: None,
    })
}

fn load_config(path: &Path) -> Result<LoadedSpec> {
    let text = kura_files::read_text(path, kura_text::MODEL_JSON_MAX_BYTES)
        .with_context(|| format!("reading {}", path.display()))?;
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
        runtime: kura_model::ModelConfig::from_hf_json(&text).ok(),
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
    // What `kura serve --weights-dtype native` holds: the file's blocks packed for the kernels, or bf16
    // (sized from the parameter count) when its matrices are all float.
    let weights_bytes = kura_model::Model::native_weight_bytes(path)
        .with_context(|| format!("sizing the native weights of {}", path.display()))?
        .map(|b| b as u64);
    Ok(LoadedSpec {
        spec,
        weights_bytes,
        runtime: kura_model::ModelConfig::from_gguf(&file).ok(),
    })
}

/// The lower tiers of `sizes` in blocks of `layout` (one device's pool), counted as `kura serve` counts
/// them.
fn lower_tiers(sizes: &TierSizes, layout: &kura_kv::layout::KvLayout) -> Result<LowerTiers> {
    Ok(LowerTiers {
        host_memory_bytes: sizes.host_bytes,
        host_blocks: sizes.host_blocks(layout.bytes_per_block())?,
        disk: match &sizes.disk {
            Some((dir, bytes)) => Some(DiskTier {
                path: dir.display().to_string(),
                size_bytes: *bytes,
                block_file_bytes: crate::tiers::block_file_bytes(layout)?,
                blocks: sizes.disk_blocks(layout)?,
            }),
            None => None,
        },
        policy: sizes.policy,
        preemption: match sizes.preemption {
            kura_engine::PreemptionMode::Swap => Preemption::Swap,
            kura_engine::PreemptionMode::Recompute => Preemption::Recompute,
        },
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
    let (report, memory_note, cuda) = plan(&args)?;
    if args.json {
        let mut v = serde_json::to_value(&report)?;
        if let (Some(c), Some(obj)) = (&cuda, v.as_object_mut()) {
            obj.insert("cuda".into(), cuda_json(c));
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print_table(&report, &memory_note, cuda.as_ref());
    }
    Ok(())
}

/// The GPU executor's dimensions for `loaded`, or why `kura serve --device cuda` would not run it.
fn cuda_dims(loaded: &LoadedSpec) -> Result<Dims, String> {
    if let Some(cfg) = &loaded.runtime {
        kura_cuda::weights::check_supported(cfg).map_err(|e| e.to_string())?;
        return Ok(Dims::of(cfg));
    }
    let s = &loaded.spec;
    if s.moe.is_some() || s.mla.is_some() {
        return Err("mixture-of-experts and latent-attention models run on the CPU only".into());
    }
    if s.head_dim != 64 && s.head_dim != 128 {
        return Err(format!(
            "head_dim {}: the GPU kernels take 64 or 128",
            s.head_dim
        ));
    }
    if s.layer_attention.windows(2).any(|w| w[0] != w[1]) {
        return Err("layers with different attention windows run on the CPU only".into());
    }
    Ok(Dims {
        hidden: s.hidden_size,
        intermediate: s.intermediate_size,
        layers: s.num_layers,
        heads: s.num_heads,
        kv_heads: s.num_kv_heads,
        head_dim: s.head_dim,
        vocab: s.vocab_size,
        tied_embeddings: s.tied_embeddings,
        // A catalog entry does not say; the biases are 0.1 % of a layer's bytes where they exist.
        qkv_bias: false,
    })
}

/// Why `--gpu` gets the generic accelerator estimates instead of `kura serve --device cuda`'s memory,
/// or `None` when it gets the server's.
fn not_cuda(args: &PlanArgs, loaded: &LoadedSpec) -> Option<String> {
    if args.tp != 1 || args.pp != 1 {
        return Some("--tp/--pp: kura serve --device cuda runs on one GPU".into());
    }
    if args.overhead.is_some() || args.activation.is_some() {
        return Some("--overhead/--activation replace the server's own terms".into());
    }
    // The checks `kura serve --device cuda` makes of the same flags, in its words.
    let pool = crate::gpu::check_pool(args.kv_dtype, args.block_size);
    if let Err(e) = pool.and_then(|()| args.weights_dtype.map_or(Ok(()), crate::gpu::check_weights))
    {
        return Some(format!("{e:#}"));
    }
    cuda_dims(loaded).err()
}

/// The plan for `args`, a note on where the memory figure comes from, and with `--gpu` the pool `kura
/// serve --device cuda` plans with the same flags.
fn plan(args: &PlanArgs) -> Result<(PlanReport, String, Option<PoolPlan>)> {
    // The tier flags alone first, as `kura serve` checks them before it loads the model.
    let tier_sizes = args.tiers.sizes()?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => kura_model::default_model_path().display().to_string(),
    };
    let loaded = load_spec(&model).with_context(|| format!("model '{model}'"))?;
    let mut req = PlanRequest::new(loaded.spec.clone());
    req.weights_dtype = args.weights_dtype.unwrap_or(WeightsDtype::Native);
    req.weights_bytes = match req.weights_dtype {
        WeightsDtype::Native => loaded.weights_bytes,
        _ => None,
    };
    req.kv_dtype = args.kv_dtype;
    req.block_size_tokens = args.block_size;
    req.context = args.context;
    req.batch = args.batch;
    req.tp = args.tp;
    req.pp = args.pp;
    req.memory_utilization = args.memory_utilization;
    req.kv_cache_memory = match args.kv_cache_memory {
        None => None,
        Some(KvMemoryRequest::Bytes(b)) => Some(b),
        Some(KvMemoryRequest::Share(_)) if args.gpu.is_some() => None,
        Some(KvMemoryRequest::Share(f)) => bail!(
            "--kv-cache-memory {f}: a share is a share of a device's memory (give --gpu), or a size"
        ),
    };
    req.overhead_bytes = args.overhead;
    req.activation_bytes = args.activation;
    req.max_batched_tokens = args.max_batched_tokens;
    req.scheduling = args.scheduling;
    req.hybrid_pool = !args.no_hybrid_pool;
    let mut memory_note = String::new();
    let mut cuda = None;
    let mut extra_warning = None;
    match (&args.gpu, args.memory) {
        (Some(name), _) => {
            let gpu = find_gpu(name)?;
            let memory = args.memory.unwrap_or(gpu.memory_bytes);
            req.memory_bytes = Some(memory);
            req.device = Device::Accelerator;
            memory_note = match args.memory {
                Some(_) => format!(" ({}, --memory)", gpu.name),
                None => format!(" ({})", gpu.name),
            };
            let why = not_cuda(args, &loaded);
            if let Some(why) = &why {
                if matches!(args.kv_cache_memory, Some(KvMemoryRequest::Share(_))) {
                    bail!("--kv-cache-memory as a share needs the GPU executor's terms, but {why}");
                }
                extra_warning = Some(format!(
                    "not what kura serve --device cuda would hold ({why}): generic accelerator estimates"
                ));
            }
            if why.is_none() {
                let dims = cuda_dims(&loaded).map_err(anyhow::Error::msg)?;
                let request = match args.kv_cache_memory {
                    Some(r) => crate::gpu::pool_request(r),
                    None => PoolRequest::Utilization(args.memory_utilization),
                };
                let max_tokens = usize::try_from(args.max_batched_tokens).unwrap_or(usize::MAX);
                let drafts = crate::gpu::drafts_of(args.speculative_config.as_ref());
                let planned = crate::gpu::plan_pool(
                    &dims,
                    memory,
                    request,
                    max_tokens,
                    args.max_num_seqs,
                    drafts,
                    &req.pool_layout()?,
                );
                // The server's terms, so that the breakdown and a shortfall are the server's too.
                req.weights_bytes = Some(kura_cuda::budget::weight_bytes(&dims));
                req.overhead_bytes =
                    Some(kura_cuda::budget::CONTEXT_BYTES + kura_cuda::budget::DEVICE_RESERVE);
                req.activation_bytes = Some(kura_cuda::budget::step_activation_bytes(
                    &dims,
                    max_tokens,
                    args.max_num_seqs,
                    drafts,
                ));
                match planned {
                    Ok(p) => {
                        if !matches!(request, PoolRequest::Utilization(_)) {
                            req.kv_cache_memory = Some(p.budget_bytes);
                        }
                        cuda = Some(p);
                    }
                    // The planner reports a model that does not fit with its shortfall.
                    Err(_) if matches!(request, PoolRequest::Utilization(_)) => {}
                    Err(e) => bail!("kura serve --device cuda on {}: {e}", gpu.name),
                }
            }
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
    req.tiers = lower_tiers(&tier_sizes, &req.pool_layout()?)?;
    let mut report = req.plan()?;
    if let Some(note) = extra_warning {
        report.warnings.push(note);
    }
    if let Some(c) = &cuda {
        // One arithmetic: the planner's pool is the server's, block for block.
        if report.num_blocks != c.num_blocks {
            bail!(
                "internal: the planner's pool of {} blocks differs from the server's {}",
                report.num_blocks,
                c.num_blocks
            );
        }
    }
    Ok((report, memory_note, cuda))
}

fn cuda_json(c: &PoolPlan) -> serde_json::Value {
    let request = match c.request {
        PoolRequest::Bytes(b) => serde_json::json!({ "bytes": b }),
        PoolRequest::Share(f) => serde_json::json!({ "share": f }),
        PoolRequest::Utilization(u) => serde_json::json!({ "utilization": u }),
    };
    serde_json::json!({
        "total_bytes": c.total_bytes,
        "weights_bytes": c.weights_bytes,
        "context_bytes": c.context_bytes,
        "activation_bytes": c.activation_bytes,
        "reserve_bytes": c.reserve_bytes,
        "left_bytes": c.left_bytes,
        "request": request,
        "budget_bytes": c.budget_bytes,
        "block_bytes": c.block_bytes,
        "num_blocks": c.num_blocks,
        "max_num_batched_tokens": c.max_tokens,
        "max_num_seqs": c.max_seqs,
        "num_speculative_tokens": c.drafts.tokens,
        "drafting_seqs": c.drafts.seqs.min(c.max_seqs),
        "logits_rows": c.head_rows,
    })
}

fn print_table(r: &PlanReport, memory_note: &str, cuda: Option<&PoolPlan>) {
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
    if let Some(c) = cuda {
        print_cuda(c, memory_note);
    } else if let (Some(mem), Some(util)) = (r.memory_bytes, r.memory_utilization) {
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
        if r.kv_tiers.host_in_breakdown {
            println!(
                "  − host KV tier (L2)  {:>12}  --kv-host-memory: on the CPU the same RAM as the pool",
                format_bytes(r.kv_tiers.host_bytes)
            );
        }
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
    if let Some(h) = &r.hybrid_pool {
        println!(
            "  hybrid pool          {} pages of one layer ({} each): {} full-attention layers hold every block, \
             {} sliding layers at most {} blocks (window {}); {} pages a request (a whole-model pool holds {} \
             requests)",
            h.num_pages,
            format_bytes(h.page_bytes),
            h.full_layers,
            h.sliding_layers,
            h.window_blocks,
            h.window_tokens,
            h.pages_per_request,
            r.whole_model_max_concurrency
        );
    }
    println!(
        "  longest context      {} tokens for {} concurrent requests",
        r.max_context_for_batch, r.batch
    );
    if let Some(g) = &r.guaranteed_admission {
        println!(
            "  guaranteed admission {} requests of {} tokens at once (--scheduling guaranteed: {} blocks \
             reserved per request, none preempted)",
            g.max_concurrency, r.context, g.blocks_per_request
        );
    }
    println!();
    print_tiers(r);
    for w in &r.warnings {
        println!("warning: {w}");
    }
}

/// The device's memory as `kura serve --device cuda` plans it with the same flags.
fn print_cuda(c: &PoolPlan, memory_note: &str) {
    println!(
        "  memory               {:>12}{memory_note}, as kura serve --device cuda uses it",
        format_bytes(c.total_bytes)
    );
    if let PoolRequest::Utilization(u) = c.request {
        let usable = (c.total_bytes as f64 * u).floor() as u64;
        println!("  usable (× {u:.2})      {:>12}", format_bytes(usable));
    }
    println!(
        "  − weights            {:>12}  bf16 on the device (Q/K/V and gate/up fused), f32 norms",
        format_bytes(c.weights_bytes)
    );
    println!(
        "  − CUDA context, libs {:>12}  measured on an H100 with cuBLAS 13",
        format_bytes(c.context_bytes)
    );
    println!(
        "  − activation buffers {:>12}  the executor's, for steps of {} tokens over {} sequences{}",
        format_bytes(c.activation_bytes),
        c.max_tokens,
        c.max_seqs,
        kura_cuda::budget::drafts_note(c.drafts, c.max_seqs, c.head_rows)
    );
    println!(
        "  − reserve            {:>12}  attention partials, step metadata, cuBLAS",
        format_bytes(c.reserve_bytes)
    );
    println!("  = left               {:>12}", format_bytes(c.left_bytes));
    let asked = match c.request {
        PoolRequest::Bytes(b) => format!("--kv-cache-memory {}", format_bytes(b)),
        PoolRequest::Share(f) => format!("--kv-cache-memory {}% of what is left", f * 100.0),
        PoolRequest::Utilization(_) => "all that is left".into(),
    };
    println!(
        "  KV pool              {:>12}  {asked}: {} blocks",
        format_bytes(c.budget_bytes),
        c.num_blocks
    );
}

/// The lower KV tiers, as `kura serve` would hold them with the same flags.
fn print_tiers(r: &PlanReport) {
    let t = &r.kv_tiers;
    println!("Lower KV tiers (per device)");
    if t.host_blocks > 0 {
        println!(
            "  host (L2)            {} blocks = {} tokens, {} (--kv-host-memory {} in whole blocks)",
            t.host_blocks,
            t.host_tokens,
            format_bytes(t.host_bytes),
            format_bytes(t.host_memory_bytes)
        );
        let memory = if t.host_in_breakdown {
            "host memory on top of the KV pool; on this CPU build both are RAM (counted above)"
        } else if r.device == Device::Accelerator {
            "host memory on top of the KV pool, which is in the device's memory (not counted above)"
        } else {
            "host memory on top of the KV pool; on this CPU build both are RAM"
        };
        println!("                       {memory}");
    } else {
        println!("  host (L2)            off (--kv-host-memory SIZE)");
    }
    match &t.disk_path {
        Some(path) => {
            println!(
                "  disk (L3)            {} blocks = {} tokens, {} in {path} (--kv-disk-size {})",
                t.disk_blocks,
                t.disk_tokens,
                format_bytes(t.disk_bytes),
                format_bytes(t.disk_size_bytes)
            );
            println!(
                "                       one file per block: {} = a {}-byte header + the block's {}",
                format_bytes(t.disk_block_file_bytes),
                t.disk_block_file_bytes
                    .saturating_sub(r.bytes_per_block_per_device),
                format_bytes(r.bytes_per_block_per_device)
            );
        }
        None => println!("  disk (L3)            off (--kv-disk-path DIR)"),
    }
    match t.offload_min_hits {
        Some(n) => println!(
            "  offload policy       {} (after {n} hits)",
            t.offload_policy
        ),
        None => println!("  offload policy       {}", t.offload_policy),
    }
    println!("  preemption           {}", t.preemption_mode.as_str());
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use kura_kv::layout::KvLayout;

    #[derive(Parser)]
    struct PlanCli {
        #[command(flatten)]
        args: PlanArgs,
    }

    const LLAMA_8B: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":4096,
        "intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,
        "vocab_size":128256,"rms_norm_eps":1e-5,"rope_theta":500000.0,"max_position_embeddings":131072}"#;

    /// What `kura serve --device cuda` plans (`GpuSetup::pool`) on a device of `total` bytes with
    /// these flags: the runtime's config, the server's layout and `--kv-cache-memory` parser.
    fn serve_pool(
        config: &str,
        total: u64,
        kv: &str,
        tokens: usize,
        seqs: usize,
        drafts: kura_cuda::budget::Drafts,
    ) -> PoolPlan {
        let cfg = kura_model::ModelConfig::from_hf_json(config).unwrap();
        let layout = cfg.kv_layout(KvDtype::Bf16, 16).unwrap();
        let request = crate::gpu::pool_request(KvMemoryRequest::parse(kv).unwrap());
        crate::gpu::plan_pool(
            &Dims::of(&cfg),
            total,
            request,
            tokens,
            seqs,
            drafts,
            &layout,
        )
        .unwrap()
    }

    #[test]
    fn plan_gpu_and_serve_device_cuda_plan_the_same_pool_to_the_block() {
        let dir = std::env::temp_dir().join(format!("kura-plan-cuda-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), LLAMA_8B).unwrap();
        let model = dir.display().to_string();
        let h100 = find_gpu("H100").unwrap().memory_bytes;
        let mut by_drafts = Vec::new();
        for (kv, tokens, seqs, (drafts, paused_at)) in [
            ("90%", "8192", "64", (0, None)),
            ("1GiB", "8192", "64", (0, None)),
            ("0.5", "2048", "256", (0, None)),
            ("40GiB", "8192", "256", (0, None)),
            ("90%", "8192", "256", (0, None)),
            ("90%", "8192", "256", (4, None)),
            ("90%", "8192", "256", (4, Some(16))),
        ] {
            let mut flags = vec![
                "plan".to_string(),
                "--model".into(),
                model.clone(),
                "--gpu".into(),
                "H100".into(),
                "--kv-cache-memory".into(),
                kv.into(),
                "--max-num-batched-tokens".into(),
                tokens.into(),
                "--max-num-seqs".into(),
                seqs.into(),
            ];
            if drafts > 0 {
                let paused = paused_at.map_or(String::new(), |n| {
                    format!(r#","disable_by_batch_size":{n}"#)
                });
                flags.push("--speculative-config".into());
                flags.push(format!(
                    r#"{{"method":"ngram","num_speculative_tokens":{drafts}{paused}}}"#
                ));
            }
            let cli = PlanCli::parse_from(flags);
            let (report, _, cuda) = plan(&cli.args).unwrap();
            let serve = serve_pool(
                LLAMA_8B,
                h100,
                kv,
                tokens.parse().unwrap(),
                seqs.parse().unwrap(),
                kura_cuda::budget::Drafts::of(drafts, paused_at),
            );
            assert_eq!(
                report.num_blocks, serve.num_blocks,
                "{kv} {tokens} {seqs} {drafts}"
            );
            assert_eq!(cuda.as_ref(), Some(&serve), "{kv} {tokens} {seqs} {drafts}");
            if kv == "90%" && seqs == "256" {
                by_drafts.push(serve);
            }
        }
        // Drafts of 4 give 256 sequences 1,280 rows of logits: the pool gives up what they take; with
        // drafting paused at 16 decoding sequences, 15 draft at most: 256 + 60 rows.
        let [plain, drafting, paused] = &by_drafts[..] else {
            panic!("three plans: without drafts, with, and paused at a batch size")
        };
        assert_eq!(
            (plain.head_rows, drafting.head_rows, paused.head_rows),
            (256, 1280, 316)
        );
        assert!(drafting.activation_bytes > plain.activation_bytes + 1024 * 128_256 * 4);
        assert!(drafting.num_blocks < paused.num_blocks && paused.num_blocks < plain.num_blocks);
        // The plan's own question (no --kv-cache-memory): --memory-utilization of the device, with the
        // server's terms: weights as the GPU holds them, the measured context, the executor's buffers.
        let cli = PlanCli::parse_from(["plan", "--model", &model, "--gpu", "H100"]);
        let (report, _, cuda) = plan(&cli.args).unwrap();
        let cuda = cuda.unwrap();
        let d = Dims::of(&kura_model::ModelConfig::from_hf_json(LLAMA_8B).unwrap());
        assert_eq!(report.weights_bytes, kura_cuda::budget::weight_bytes(&d));
        assert_eq!(
            report.activation_bytes,
            kura_cuda::budget::activation_bytes(&d, 8192, 64)
        );
        assert_eq!(cuda.context_bytes, 600 << 20);
        assert_eq!(report.num_blocks, cuda.num_blocks);
        let usable = (h100 as f64 * 0.9).floor() as u64;
        assert_eq!(
            cuda.budget_bytes,
            usable
                - cuda.weights_bytes
                - cuda.context_bytes
                - cuda.activation_bytes
                - cuda.reserve_bytes
        );
        let on_h100 = |flag: &str, value: &str| {
            PlanCli::parse_from(["plan", "--model", &model, "--gpu", "H100", flag, value])
        };
        // What the server cannot hold is an error naming both sides, as the server's is.
        let cli = on_h100("--kv-cache-memory", "80GiB");
        let e = format!("{:#}", plan(&cli.args).unwrap_err());
        assert!(e.contains("are left of the device"), "{e}");
        // A block size the GPU pool does not hold is not planned as the server's, and says why.
        let cli = on_h100("--block-size", "512");
        let (report, _, cuda) = plan(&cli.args).unwrap();
        assert!(cuda.is_none());
        assert!(
            report
                .warnings
                .iter()
                .any(|w| w.contains("--block-size 512: the GPU pool holds blocks of 1 to 256")),
            "{:?}",
            report.warnings
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    /// `kura serve`'s tier flags alone, parsed by the same clap arguments as in `ServeArgs`.
    #[derive(Parser)]
    struct ServeTierCli {
        #[command(flatten)]
        tiers: TierArgs,
    }

    /// What `kura serve` computes for `flags` over the runtime's layout: the host tier's blocks, the
    /// disk tier's blocks and the preemption mode, by the calls `serve::run` makes.
    fn serve_tiers(flags: &[&str], layout: &KvLayout) -> Result<(u32, u32, &'static str)> {
        let cli =
            ServeTierCli::try_parse_from(std::iter::once("serve").chain(flags.iter().copied()))?;
        let sizes = cli.tiers.sizes()?;
        let host = sizes.host_blocks(layout.bytes_per_block())?;
        let disk = match &sizes.disk {
            Some(_) => sizes.disk_blocks(layout)?,
            None => 0,
        };
        Ok((host, disk, sizes.preemption.as_str()))
    }

    fn plan_of(flags: &[&str]) -> Result<PlanReport> {
        let cli = PlanCli::try_parse_from(std::iter::once("plan").chain(flags.iter().copied()))?;
        Ok(plan(&cli.args)?.0)
    }

    const CONFIGS: [(&str, &str); 3] = [
        (
            "llama",
            r#"{"model_type":"llama","hidden_size":576,"intermediate_size":1536,"num_hidden_layers":30,
                "num_attention_heads":9,"num_key_value_heads":3,"vocab_size":49152,
                "max_position_embeddings":8192}"#,
        ),
        (
            "mistral with a sliding window",
            r#"{"model_type":"mistral","hidden_size":256,"intermediate_size":512,"num_hidden_layers":4,
                "num_attention_heads":8,"num_key_value_heads":2,"vocab_size":1000,
                "max_position_embeddings":4096,"sliding_window":1024}"#,
        ),
        (
            "qwen2 with an explicit head_dim",
            r#"{"model_type":"qwen2","hidden_size":512,"intermediate_size":1024,"num_hidden_layers":6,
                "num_attention_heads":8,"num_key_value_heads":1,"head_dim":128,"vocab_size":1000,
                "max_position_embeddings":4096}"#,
        ),
    ];

    #[test]
    fn the_planners_tiers_are_the_servers_for_the_same_flags() {
        let dir = std::env::temp_dir().join(format!("kura-plan-tiers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let flag_sets: [&[&str]; 5] = [
            &[
                "--kv-host-memory",
                "256MiB",
                "--kv-disk-path",
                "/kv",
                "--kv-disk-size",
                "1GiB",
            ],
            &["--kv-host-memory", "1GB", "--preemption-mode", "recompute"],
            &[
                "--kv-disk-path",
                "/kv",
                "--kv-disk-size",
                "3GiB",
                "--kv-offload-policy",
                "write-through",
            ],
            &[
                "--kv-host-memory",
                "123456789",
                "--kv-disk-path",
                "/kv",
                "--kv-disk-size",
                "987654321",
            ],
            &[],
        ];
        for (what, text) in CONFIGS {
            let config = dir.join(format!("{}.json", what.replace(' ', "-")));
            std::fs::write(&config, text).unwrap();
            let runtime = kura_model::ModelConfig::from_hf_json(text).unwrap();
            for (dtype, block) in [(KvDtype::Bf16, 16), (KvDtype::F32, 16), (KvDtype::F16, 64)] {
                // The layout `kura serve` sizes its tiers with: the loaded model's.
                let layout = runtime.kv_layout(dtype, block).unwrap();
                for flags in flag_sets {
                    let (host, disk, preemption) = serve_tiers(flags, &layout).unwrap();
                    let block_s = block.to_string();
                    let mut args = vec![
                        "--model",
                        config.to_str().unwrap(),
                        "--kv-cache-memory",
                        "64MiB",
                    ];
                    args.extend(["--kv-dtype", dtype.name(), "--block-size", &block_s]);
                    args.extend(flags);
                    let t = plan_of(&args).unwrap().kv_tiers;
                    let case = format!("{what}, {dtype:?}, blocks of {block}, {flags:?}");
                    assert_eq!(t.host_blocks, u64::from(host), "{case}");
                    assert_eq!(
                        t.host_bytes,
                        u64::from(host) * layout.bytes_per_block(),
                        "{case}"
                    );
                    assert_eq!(t.host_tokens, u64::from(host) * block as u64, "{case}");
                    assert_eq!(t.disk_blocks, u64::from(disk), "{case}");
                    assert_eq!(t.disk_tokens, u64::from(disk) * block as u64, "{case}");
                    if disk > 0 {
                        let file =
                            kura_tiers::block_file_bytes(block, layout.bytes_per_block() as usize);
                        assert_eq!(t.disk_block_file_bytes, file, "{case}");
                        assert_eq!(t.disk_bytes, u64::from(disk) * file, "{case}");
                    }
                    assert_eq!(t.preemption_mode.as_str(), preemption, "{case}");
                }
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Every KV format, quantised ones included: the planner's bytes per token and blocks are the pool
    /// `kura serve` allocates for the same flags, byte for byte, and the quantised formats hold the
    /// tokens they promise against bf16 in the same memory.
    #[test]
    fn the_planners_blocks_are_the_storage_the_server_allocates() {
        let dir = std::env::temp_dir().join(format!("kura-plan-storage-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (what, text) in CONFIGS {
            let config = dir.join(format!("{}.json", what.replace(' ', "-")));
            std::fs::write(&config, text).unwrap();
            let runtime = kura_model::ModelConfig::from_hf_json(text).unwrap();
            let mut tokens = std::collections::HashMap::new();
            for dtype in KvDtype::ALL {
                let r = plan_of(&[
                    "--model",
                    config.to_str().unwrap(),
                    "--kv-cache-memory",
                    "64MiB",
                    "--kv-dtype",
                    dtype.name(),
                ])
                .unwrap();
                let layout = runtime.kv_layout(dtype, r.block_size).unwrap();
                // `serve::run`'s sizing of the pool, then the pool itself.
                let blocks = layout.num_blocks_for_budget(64 << 20);
                let storage = kura_kv::storage::KvStorage::new(&layout, blocks as usize).unwrap();
                let case = format!("{what}, {dtype}");
                assert_eq!(r.num_blocks, blocks, "{case}");
                assert_eq!(r.kv_bytes_per_token, layout.bytes_per_token(), "{case}");
                assert_eq!(storage.bytes(), blocks * layout.bytes_per_block(), "{case}");
                assert!(storage.bytes() <= 64 << 20, "{case}");
                assert_eq!(r.max_tokens_in_pool, blocks * r.block_size as u64, "{case}");
                tokens.insert(dtype, r.max_tokens_in_pool as f64);
            }
            // One f16 scale per vector costs 2 bytes: at head_dim 32 (the mistral config) int8 holds
            // 64 / 34 = 1.88× bf16; from head_dim 64 on the promised gains hold.
            if runtime.head_dim() < 64 {
                continue;
            }
            let gain = |d| tokens[&d] / tokens[&KvDtype::Bf16];
            assert!(
                gain(KvDtype::Int8) >= 1.9,
                "{what}: int8 {}",
                gain(KvDtype::Int8)
            );
            assert!(
                gain(KvDtype::Fp8) >= 1.9,
                "{what}: fp8 {}",
                gain(KvDtype::Fp8)
            );
            assert!(
                gain(KvDtype::Int4) >= 3.5,
                "{what}: int4 {}",
                gain(KvDtype::Int4)
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_tier_flags_get_the_servers_errors() {
        let layout = kura_model::ModelConfig::from_hf_json(CONFIGS[0].1)
            .unwrap()
            .kv_layout(KvDtype::Bf16, 16)
            .unwrap();
        for flags in [
            &["--kv-disk-path", "/kv", "--kv-disk-size", "0"][..],
            &["--kv-disk-path", "/kv", "--kv-disk-size", "100"],
            &["--kv-disk-path", ""],
            &["--preemption-mode", "swap"],
            &["--preemption-mode", "swap", "--kv-disk-path", "/kv"],
            &["--kv-offload-policy", "write-through"],
            &["--kv-host-memory", "lots"],
            &["--kv-host-memory", "15EiB"],
            &["--kv-host-memory", "100", "--preemption-mode", "swap"],
        ] {
            let serve = serve_tiers(flags, &layout).unwrap_err();
            let mut args = vec![
                "--model",
                "smollm2-135m",
                "--kv-cache-memory",
                "64MiB",
                "--kv-dtype",
                "bf16",
            ];
            args.extend(flags);
            let plan = plan_of(&args).unwrap_err();
            assert_eq!(format!("{plan:#}"), format!("{serve:#}"), "{flags:?}");
        }
    }
}
