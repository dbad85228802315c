//! `kura serve`: loads the model, sizes the KV pool through `KvLayout` (the numbers `kura plan` prints for
//! the same inputs), starts the engine thread and serves the OpenAI-compatible API until Ctrl-C/SIGTERM.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use kura_engine::{start_engine, EngineConfig, ModelCodec, ModelExecutor};
use kura_kv::codec::KvDtype;
use kura_kv::plan::units::{format_bytes, parse_bytes};
use kura_kv::plan::DEFAULT_MAX_BATCHED_TOKENS;
use kura_kv::storage::KvStorage;
use kura_model::{LoadOptions, Model, WeightsDtype};
use kura_server::ServerConfig;

use crate::memory::{kv_budget_bytes, KvMemoryRequest};

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A GGUF file or an HF model directory. Default: Kura's default model (scripts/fetch-model.sh).
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// The model name clients send as `model`. Default: the file or directory name without extension.
    #[arg(long)]
    served_model_name: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Worker threads of the forward pass (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Tokens per KV block (1..=256).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV pool size: bytes (`512MiB`, `2GB`) or a share of the memory available once the model is loaded
    /// (`0.25`, `25%`); checked against MemAvailable, cgroup and rlimit limits, leaving 5 % (at least
    /// 256 MiB) for the rest of the server.
    #[arg(long, default_value = "1GiB")]
    kv_cache_memory: String,
    /// KV element format: bf16 (default, like the weights), f16 or f32 (twice the bytes). On a CPU with
    /// AVX-512 (AVX-512 BF16 for bf16 weights), a request served from cached blocks is bit-identical to a
    /// cold one in every format (seeded sampling included).
    #[arg(long, default_value = "bf16")]
    kv_dtype: KvDtype,
    /// Weights format of the forward pass: bf16 (default, faster) or f32.
    #[arg(long, default_value = "bf16")]
    weights_dtype: WeightsDtype,
    /// Most requests holding KV blocks at once.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Token budget of one engine step (prefill chunks plus decode tokens).
    #[arg(long, default_value_t = DEFAULT_MAX_BATCHED_TOKENS as usize)]
    max_num_batched_tokens: usize,
    /// Longest context (prompt + output) accepted. Default: the model's.
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Requests allowed to wait for their first step; beyond it new requests get 429.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// An accepted API key (repeatable). With keys, every request needs `Authorization: Bearer <key>`,
    /// and each key is its own tenant: tenants never share cached KV.
    #[arg(long = "api-key")]
    api_keys: Vec<String>,
    /// A file of API keys, one per line (blank lines and `#` comments ignored).
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// Disable prefix caching (every prompt is computed in full): for comparisons.
    #[arg(long)]
    no_prefix_cache: bool,
    /// Largest accepted request body, e.g. `8MiB`.
    #[arg(long, default_value = "8MiB")]
    max_body_size: String,
    /// Seconds in-flight requests may run after a shutdown signal before they are cancelled.
    #[arg(long, default_value_t = 30)]
    shutdown_grace_s: u64,
    /// Seconds a request may take from arrival to its last token before it is cancelled (504);
    /// 0 = no limit.
    #[arg(long, default_value_t = 0)]
    request_timeout_s: u64,
}

fn read_api_keys(args: &ServeArgs) -> Result<Vec<String>> {
    let mut keys: Vec<String> = args.api_keys.iter().map(|k| k.trim().to_string()).collect();
    if let Some(path) = &args.api_key_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading --api-key-file {}", path.display()))?;
        keys.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from),
        );
    }
    if keys.iter().any(|k| k.is_empty()) {
        bail!("an API key must not be empty");
    }
    Ok(keys)
}

pub fn run(args: ServeArgs) -> Result<()> {
    crate::setup::threads(args.threads)?;
    let api_keys = read_api_keys(&args)?;
    let max_body_bytes = parse_bytes(&args.max_body_size)
        .with_context(|| format!("--max-body-size {:?}", args.max_body_size))?;
    let kv_request = KvMemoryRequest::parse(&args.kv_cache_memory)?;
    // Checked before the model loads too, so that a size this machine cannot hold fails at once.
    kv_budget_bytes(kv_request, &args.kv_cache_memory)?;
    let path = crate::setup::model_path(args.model.as_ref())?;
    let load_start = Instant::now();
    let model = Arc::new(
        Model::load_with(
            &path,
            LoadOptions {
                weights_dtype: args.weights_dtype,
            },
        )
        .with_context(|| format!("loading the model {}", path.display()))?,
    );
    tracing::info!(
        model = %path.display(),
        load_ms = load_start.elapsed().as_millis() as u64,
        threads = kura_model::num_threads(),
        "model loaded"
    );
    let model_max = model.config().max_context;
    let max_model_len = match args.max_model_len {
        Some(0) => bail!("--max-model-len must be at least 1"),
        Some(n) if n > model_max => {
            bail!("--max-model-len {n} is longer than the model's context of {model_max} tokens")
        }
        Some(n) => n,
        None => model_max,
    };
    let layout = model
        .kv_layout(args.kv_dtype, args.block_size)
        .with_context(|| {
            format!(
                "KV layout for --block-size {} and --kv-dtype",
                args.block_size
            )
        })?;
    // Resolved after the weights are loaded: a share is a share of what they left (see `memory`).
    let budget = kv_budget_bytes(kv_request, &args.kv_cache_memory)?;
    let num_blocks = layout.num_blocks_for_budget(budget);
    if num_blocks == 0 {
        bail!(
            "--kv-cache-memory {} ({}) holds no KV block: one block of {} tokens takes {}; give at least that",
            args.kv_cache_memory,
            format_bytes(budget),
            args.block_size,
            format_bytes(layout.bytes_per_block())
        );
    }
    let concurrency = layout.max_concurrency(budget, max_model_len as u64);
    tracing::info!(
        "KV cache: {num_blocks} blocks of {} tokens = {} tokens, max concurrency for {max_model_len} tokens per request: {concurrency} ({} of {} KV, {} per token)",
        args.block_size,
        num_blocks * args.block_size as u64,
        format_bytes(num_blocks * layout.bytes_per_block()),
        args.kv_dtype.name(),
        format_bytes(layout.bytes_per_token()),
    );
    let storage =
        KvStorage::new(&layout, num_blocks as usize).context("allocating the KV cache")?;
    let model_name = args.served_model_name.clone().unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    let config = EngineConfig {
        model_fingerprint: format!("{model_name}/{}", args.kv_dtype.name()),
        model_name,
        max_model_len,
        block_size_tokens: args.block_size,
        num_blocks: num_blocks as usize,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_queue: args.max_queue,
        enable_prefix_caching: !args.no_prefix_cache,
    };
    let engine = start_engine(
        config,
        Box::new(ModelExecutor::new(model.clone(), storage)),
        Arc::new(ModelCodec::new(model)),
    )
    .context("starting the engine")?;
    if !api_keys.is_empty() {
        tracing::info!(
            keys = api_keys.len(),
            "API keys required; each key is its own cache tenant"
        );
    }
    let server_config = ServerConfig {
        api_keys,
        max_body_bytes: max_body_bytes as usize,
        shutdown_grace: Duration::from_secs(args.shutdown_grace_s),
        request_timeout: (args.request_timeout_s > 0)
            .then(|| Duration::from_secs(args.request_timeout_s)),
    };
    let addr = format!("{}:{}", args.host, args.port);
    let result = kura_server::serve_blocking(&addr, engine.clone(), server_config)
        .with_context(|| format!("serving HTTP on {addr}"));
    engine.stop();
    tracing::info!("stopped");
    result
}
