//! `kura serve`: loads the model, sizes the KV pool through `KvLayout` (the numbers `kura plan` prints for
//! the same inputs), starts the engine thread and serves the OpenAI-compatible API until Ctrl-C/SIGTERM.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use kura_engine::{
    start_engine, AdmissionMode, DiskSetup, EngineConfig, EngineHandle, ModelCodec,
    SchedulingPolicy, TierSetup,
};
use kura_engine::{RemoteTierSetup, DEFAULT_MAX_BATCHED_TOKENS};
use kura_kv::codec::KvDtype;
use kura_kv::layout::KvLayout;
use kura_kv::units::{format_bytes, parse_bytes};
use kura_model::WeightsDtype;
use kura_server::caching::ContextStore;
use kura_server::ServerConfig;

use crate::memory::{check_fits_in_memory, kv_budget_bytes, KvMemoryRequest};
use crate::tiers::TierArgs;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A GGUF file or an HF model directory. Default: Kura's default model (scripts/fetch-model.sh).
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// A Jinja chat template file to write chats with instead of the model's own (HF's
    /// `chat_template`; e.g. one with a tools section, so that tools and calls are written the way the
    /// model was trained to read them). A router in front must be given the same file.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// The model name clients send as `model`. Default: the file or directory name without extension.
    #[arg(long)]
    served_model_name: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// TCP port; 0 picks a free one (the log says which).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Worker threads of the forward pass (default: one per physical core this process may use).
    #[arg(long)]
    threads: Option<usize>,
    /// Where the forward pass runs: `cpu` (default), or `cuda` / `cuda:N` (GPU N, Llama-family models,
    /// bf16, f32 or fp8 KV): the KV pool lives in device memory, and `--kv-cache-memory` is then device memory
    /// (a share is a share of what the weights and the activation buffers leave free).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Tokens per KV block (1..=1024).
    #[arg(long, default_value_t = 16, value_parser = crate::setup::block_size_arg)]
    block_size: usize,
    /// KV pool size: bytes (`512MiB`, `2GB`) or a share of the memory available once the model is loaded
    /// (`0.25`, `25%`); checked against MemAvailable, cgroup and rlimit limits, leaving 5 % (at least
    /// 256 MiB) for the rest of the server.
    #[arg(long, default_value = "1GiB")]
    kv_cache_memory: String,
    /// KV element format: bf16 (default), f16, f32 (twice the bytes), or quantised
    /// int8 and fp8 (e4m3) (about half of bf16's bytes) or int4 (about 2/7). A request served from
    /// cached blocks is bit-identical to a cold one in every format (seeded sampling included), in every
    /// weights format and on every CPU kernel path.
    #[arg(long, default_value = "bf16")]
    kv_dtype: KvDtype,
    /// Weights format of the forward pass: native (default: a GGUF's block formats kept packed and
    /// multiplied as integers, the fastest; a float checkpoint in bf16), bf16 or f32.
    #[arg(long, default_value = "native")]
    weights_dtype: WeightsDtype,
    /// Most requests holding KV blocks at once.
    #[arg(long, default_value_t = 64, value_parser = crate::setup::step_count_arg)]
    max_num_seqs: usize,
    /// Token budget of one engine step (prefill chunks plus decode tokens).
    #[arg(long, default_value_t = DEFAULT_MAX_BATCHED_TOKENS, value_parser = crate::setup::step_count_arg)]
    max_num_batched_tokens: usize,
    /// While requests decode, a step computes only as many prompt tokens as take about this many
    /// milliseconds at the prefill rate measured on the server's own steps (at least 64), so that a
    /// new prompt does not hold every stream's next token for its whole prefill; a long prompt then
    /// takes several steps. Steps without decodes still take up to --max-num-batched-tokens.
    /// 0: no cut (vLLM's behaviour).
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    prefill_step_ms: u64,
    /// Longest context (prompt + output) accepted. Default: the model's.
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Requests allowed to wait for their first step (at least 1); beyond it new requests get 429.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_queue: u64,
    /// Who runs first: `fcfs` (arrival order; a request that sets `priority` gets 400) or `priority`
    /// (a request's `priority` is honoured, lower first, and may preempt others: give it only to
    /// trusted clients).
    #[arg(long, value_enum, default_value_t = SchedulingPolicy::Fcfs)]
    scheduling_policy: SchedulingPolicy,
    /// Admission: `max-utilization` admits a request as soon as its prompt's KV blocks are free and,
    /// when the pool runs out, preempts the most recent request (recomputed or swapped back later);
    /// `guaranteed` admits a request only when KV blocks for its prompt plus `max_tokens` (for each of
    /// its `n` choices; a prefix that running requests hold is not counted again) can be reserved beside
    /// what running requests have reserved: it never preempts, and admits fewer requests at once (the
    /// others wait in the queue, FCFS).
    #[arg(long, value_enum, default_value_t = AdmissionMode::MaxUtilization)]
    scheduling: AdmissionMode,
    /// An accepted API key (repeatable). With keys, every request needs `Authorization: Bearer <key>`,
    /// and each key is its own tenant: tenants never share cached KV.
    #[arg(long = "api-key")]
    api_keys: Vec<String>,
    /// A file of API keys, one per line (blank lines and `#` comments ignored).
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// The operator's key (repeatable), for `/v1/kv/*` and `/debug/*`; tenant keys get 403 there, and
    /// without an operator key those routes are off. Prefer `--admin-api-key-file` or
    /// `$KURA_ADMIN_API_KEY`: argv is visible to every user of the machine.
    #[arg(long = "admin-api-key")]
    admin_api_keys: Vec<String>,
    /// A file of operator keys, one per line (blank lines and `#` comments ignored).
    #[arg(long)]
    admin_api_key_file: Option<PathBuf>,
    /// A file holding the fleet's secret (at least 32 characters, e.g. `openssl rand -hex 32`), shared
    /// by every replica and router of a fleet: it names blocks in KV events and in Redis, keys the
    /// MACs of Redis records, and keys tenant identities. Or `$KURA_FLEET_SECRET`. Needed by
    /// `--kv-events` and `--kv-redis-url`.
    #[arg(long, alias = "kv-redis-secret-file")]
    fleet_secret_file: Option<PathBuf>,
    /// Most saved contexts (`/v1/caches`) one API key may hold at once (1..=100000); past it, 429.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    max_contexts_per_tenant: u64,
    /// Most KV event streams open at once (1..=1024); past it, 429.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1024))]
    max_kv_event_streams: u64,
    /// Most log-probabilities that non-streamed responses in progress hold together (each holds its
    /// own until its request ends, a few hundred bytes apiece); past it, 429. One response holds at
    /// most 1,048,576, or this where lower (1..=1073741824).
    #[arg(long, default_value_t = kura_api::validate::DEFAULT_SERVER_HELD_LOGPROBS,
          value_parser = clap::value_parser!(u64).range(1..=1 << 30))]
    max_held_logprobs: u64,
    /// How chat answers of a reasoning model are read: `auto` (when the chat template spells
    /// `<think>`), `deepseek_r1` or `qwen3` (the text between `<think>` and `</think>` is the
    /// reasoning: chat's `reasoning_content`, a Responses `reasoning` item, a Messages `thinking`
    /// block), or `none` (the answer as written).
    #[arg(long, default_value = "auto", value_parser = clap::value_parser!(kura_server::ReasoningParser))]
    reasoning_parser: kura_server::ReasoningParser,
    /// Let a chat request bring its own Jinja chat template (vLLM's `chat_template` field and flag):
    /// the template runs on the server, within the renderer's limits on work and output. Off by
    /// default: such a request is refused, naming the field.
    #[arg(long)]
    trust_request_chat_template: bool,
    /// Disable prefix caching (every prompt is computed in full): for comparisons.
    #[arg(long)]
    no_prefix_cache: bool,
    /// Speculative decoding, as vLLM's `--speculative-config` spells it:
    /// `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}` drafts the next
    /// tokens of a sequence by looking up its final n-gram (`prompt_lookup_min`..=`prompt_lookup_max`
    /// tokens, the longest first) earlier in its prompt and output, and checks up to
    /// `num_speculative_tokens` of them in its next step. The output is what decoding one token a
    /// step gives, bit for bit (seeded sampling included); drafts only save steps where text repeats
    /// (quoting, editing, extraction). `disable_by_batch_size` N: no drafts in a step where N or more
    /// sequences decode. Off by default; not with the hybrid pool (`--no-hybrid-pool`).
    #[arg(long, value_parser = crate::speculative::parse_speculative_config)]
    speculative_config: Option<kura_engine::NgramDraft>,
    /// Give a model with sliding-window layers whole-model blocks (every layer holding the whole
    /// context) instead of the hybrid pool, whose sliding layers hold only their window: for
    /// comparisons.
    #[arg(long)]
    no_hybrid_pool: bool,
    /// Seconds a request may take from arrival to its last token before it is cancelled (504);
    /// 0 = no limit (at most a week).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=MAX_REQUEST_TIMEOUT_S))]
    request_timeout_s: u64,
    #[command(flatten)]
    http: crate::http_args::HttpArgs,
    /// Most of the KV pool that pinned prefixes may hold (cache_control breakpoints,
    /// prompt_cache_retention "24h", saved contexts): a share of the pool (`25%`, `0.25`) or bytes
    /// (`256MiB`). Pins past it are demoted to the host and disk tiers, never refused. Default: 25%.
    #[arg(long, default_value = "25%")]
    kv_pin_budget: String,
    /// Route `POST /debug/clock {"advance_s": N}`, which moves the cache clock forward so that pin and
    /// saved-context expiry can be tested without waiting. Not for production.
    #[arg(long)]
    debug_clock: bool,
    /// The console at `/console`: a page that shows the KV cache live (pool, tiers, prefixes, pins,
    /// requests) beside a chat playground, and its summary at `GET /v1/kv/summary`. With an operator
    /// key, for that key only; with API keys but no operator key, off. Default: on when listening on
    /// loopback (`--host 127.0.0.1`, `localhost`, `::1`), off otherwise.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    console: Option<bool>,
    /// Publish the KV pool's content (blocks stored, removed, cleared, named by keyed content names,
    /// without tokens) at `GET /v1/kv/events` (SSE, numbered) and `GET /v1/kv/snapshot`, for the
    /// operator key only, for `kura router --policy kv`. Needs an operator key and the fleet secret.
    #[arg(long)]
    kv_events: bool,
    /// Add each block's token ids to KV events and snapshots (for debugging a router: they reveal
    /// every tenant's prompts to the operator key).
    #[arg(long, requires = "kv_events")]
    kv_events_tokens: bool,
    /// Events the server keeps for streams that fall behind (1..=16777216); a stream further behind
    /// is told to resynchronize from a snapshot.
    #[arg(long, default_value_t = 65_536, value_parser = clap::value_parser!(u64).range(1..=16_777_216))]
    kv_events_buffer: u64,
    /// A shared KV tier in Redis (L4), `redis://[USER:PASSWORD@]HOST:PORT[/DB]`, or `rediss://…` for
    /// TLS: blocks computed here are written there, and a prompt's blocks missing here are fetched from
    /// there (written by any replica of the same model, KV format and fleet secret). Redis slow or down
    /// never fails a request: the blocks are recomputed. A URL with a password is better given with
    /// `--kv-redis-url-file` or `$KURA_KV_REDIS_URL`: argv is visible to every user of the machine.
    #[arg(long)]
    kv_redis_url: Option<String>,
    /// A file holding the Redis URL (its content, surrounding whitespace ignored), instead of
    /// `--kv-redis-url`.
    #[arg(long)]
    kv_redis_url_file: Option<PathBuf>,
    /// PEM file of the CA(s) that sign the Redis server's certificate, for a `rediss://` URL
    /// (default: the system's roots).
    #[arg(long)]
    kv_redis_ca_file: Option<PathBuf>,
    /// Seconds a block lives in Redis after it is written (1..=31536000).
    #[arg(long, default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..=31_536_000))]
    kv_redis_ttl_s: u64,
    /// Longest wait for Redis, per connection or command, in milliseconds (1..=10000).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    kv_redis_timeout_ms: u64,
    /// The tier cost check: `on` (default) loads a cached block from a lower tier (host memory, disk,
    /// Redis) only when its bytes at the tier's measured load bandwidth arrive sooner than the model
    /// prefills its tokens at the measured prefill rate, else recomputes it
    /// (`kura:kv_tier_recomputed_blocks_total`); `off` always loads. The start log names each tier's
    /// decision and figures.
    #[arg(long, value_enum, default_value_t = CostCheckArg::On)]
    tier_cost_check: CostCheckArg,
    #[command(flatten)]
    pub(crate) tiers: TierArgs,
}

/// `--tier-cost-check`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostCheckArg {
    On,
    Off,
}

impl ServeArgs {
    /// The fleet's secret: `--fleet-secret-file`, else `$KURA_FLEET_SECRET`, else none.
    pub fn fleet_secret(&self) -> Result<Option<kura_kv::Secret>> {
        crate::secrets::fleet_secret(self.fleet_secret_file.as_ref())
    }

    /// The tenants' keys: `--api-key` and the lines of `--api-key-file`.
    pub fn api_keys(&self) -> Result<Vec<String>> {
        crate::secrets::read_keys(&self.api_keys, self.api_key_file.as_ref(), "api-key")
    }
}

/// `--kv-pin-budget` in blocks of a pool of `num_blocks` blocks of `block_bytes` bytes.
fn pin_budget_blocks(text: &str, num_blocks: u64, block_bytes: u64) -> Result<usize> {
    let t = text.trim();
    let share = if let Some(p) = t.strip_suffix('%') {
        Some(p.trim().parse::<f64>().map(|x| x / 100.0))
    } else if t.contains('.') && !t.chars().any(|c| c.is_ascii_alphabetic()) {
        Some(t.parse::<f64>())
    } else {
        None
    };
    let blocks = match share {
        Some(Ok(x)) if (0.0..=1.0).contains(&x) => (num_blocks as f64 * x).floor() as u64,
        Some(_) => bail!(
            "--kv-pin-budget {text:?}: a share of the pool must be from 0% to 100% (or 0.0 to 1.0)"
        ),
        None => {
            let bytes = parse_bytes(t).with_context(|| {
                format!(
                    "--kv-pin-budget {text:?}: give a share of the pool (25%) or bytes (256MiB)"
                )
            })?;
            if bytes > 0 && bytes < block_bytes {
                bail!(
                    "--kv-pin-budget {text:?} is less than one KV block ({}): give at least that, or 0 \
                     to pin nothing",
                    format_bytes(block_bytes)
                );
            }
            (bytes / block_bytes.max(1)).min(num_blocks)
        }
    };
    usize::try_from(blocks).context("--kv-pin-budget does not fit this platform")
}

/// The identity of KV computed by this model in this format: the weights' digest, the compute format
/// and the KV layout (element format, block size, every layer's shape). Cached blocks of one
/// fingerprint are never served under another, in the pool or on disk.
///
/// It is the xxh3-128 of these bytes, fixed-width little-endian, so that it changes only when one of
/// them does (a compiler's or a dependency's formatting cannot move it):
///
/// ```text
/// 8 bytes   "kura-kv\0"
/// u32       encoding version, 5 (version 1 hashed Debug text; version 2's CPU forward pass took SiLU's
///           exponential from the C library, version 3's from its own polynomial: other bits; version
///           4 added the model's RoPE and norm parameters; version 5 the CPU's numerics)
/// u128      the weights' digest
/// u128      the digest of the model's RoPE and norm parameters
/// u32       compute format: f32 1, f16 2, bf16 3, fp8 4, int8 5, int4 6, native 7 (the CPU
///           runtime's weights), the CUDA executor 8 (its kernels round otherwise: a GPU's blocks
///           and a CPU's are never served for each other)
/// u128      the numerics of what computes it: on the CPU `kura_model::kernels::numerics`, its kernel
///           paths that compute other bits on other CPUs (the instruction set, VNNI, AVX-512 BF16,
///           each layer's attention kernel); on a GPU `kura_cuda::Device::numerics`, its kernels as
///           compiled there, the GPU and its multiprocessors, cuBLAS' version (a fleet's shared tier
///           never serves one machine's blocks to another that computes other bits)
/// ...       the layout, KvLayout::encode_for_fingerprint
/// u128      the digest of the KV encoding (the key offsets quantised formats subtract)
/// u32       int4 layouts only: 1, int4 keys scored as integer products with the quantised query
///           (on the CPU: other bits than the dequantised keys' f32 products before it; the CUDA pool
///           takes no int4); the other formats' fingerprints, and the blocks and saved contexts under
///           them, stay as they were
/// ```
///
/// A change of any of it makes blocks cached on disk under the old fingerprint foreign: the disk tier
/// deletes them at start and the server says so.
fn kv_fingerprint(
    weights: u128,
    params: u128,
    compute: Compute,
    layout: &KvLayout,
    encoding: u128,
) -> u128 {
    const VERSION: u32 = 5;
    let (compute, numerics): (u32, u128) = match compute {
        Compute::Cpu(WeightsDtype::F32, n) => (1, n),
        Compute::Cpu(WeightsDtype::F16, n) => (2, n),
        Compute::Cpu(WeightsDtype::Bf16, n) => (3, n),
        Compute::Cpu(WeightsDtype::Fp8, n) => (4, n),
        Compute::Cpu(WeightsDtype::Int8, n) => (5, n),
        Compute::Cpu(WeightsDtype::Int4, n) => (6, n),
        Compute::Cpu(WeightsDtype::Native, n) => (7, n),
        Compute::Cuda(n) => (8, n),
    };
    let mut bytes = Vec::with_capacity(128 + 32 * layout.layers.len());
    bytes.extend_from_slice(b"kura-kv\0");
    bytes.extend_from_slice(&VERSION.to_le_bytes());
    bytes.extend_from_slice(&weights.to_le_bytes());
    bytes.extend_from_slice(&params.to_le_bytes());
    bytes.extend_from_slice(&compute.to_le_bytes());
    bytes.extend_from_slice(&numerics.to_le_bytes());
    layout.encode_for_fingerprint(&mut bytes);
    bytes.extend_from_slice(&encoding.to_le_bytes());
    if layout.dtype == KvDtype::Int4 {
        bytes.extend_from_slice(&1u32.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_128(&bytes)
}

/// What computes the KV a server caches: the CPU runtime with its weights format on a CPU of the
/// numerics it names (`kura_model::kernels::numerics`: the kernel paths that compute other bits on other
/// CPUs), or the CUDA executor on a device of the numerics it names (`kura_cuda::Device::numerics`: its
/// kernels as compiled there, the device, cuBLAS' version).
#[derive(Debug, Clone, Copy)]
enum Compute {
    Cpu(WeightsDtype, u128),
    Cuda(u128),
}

/// Longest `--request-timeout-s`: a week.
const MAX_REQUEST_TIMEOUT_S: u64 = 7 * 24 * 3600;

/// `--served-model-name`, or the model file's stem.
fn served_model_name(given: Option<&str>, path: &std::path::Path) -> Result<String> {
    match given {
        Some(name) if name.trim().is_empty() => {
            bail!("--served-model-name must not be empty: clients send it as `model`")
        }
        Some(name) if name.chars().any(char::is_control) => {
            bail!("--served-model-name {name:?} contains control characters")
        }
        Some(name) => Ok(name.to_string()),
        None => Ok(path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .filter(|s| !s.trim().is_empty())
            .unwrap_or_else(|| "model".into())),
    }
}

/// Loads the model and starts the engine as `kura serve` would with these flags (also what `kura cache
/// build` computes saved contexts with, so that their blocks carry the same fingerprint).
pub fn start(args: &ServeArgs, fleet_secret: Option<&kura_kv::Secret>) -> Result<EngineHandle> {
    crate::setup::threads(args.threads)?;
    let needs_secret = |flag: &str| {
        fleet_secret.cloned().with_context(|| {
            format!(
                "{flag} needs the fleet's secret (--fleet-secret-file or ${}): it names blocks \
                 the same way on every replica and router, and keys what they share",
                crate::secrets::FLEET_SECRET_ENV
            )
        })
    };
    let kv_events = match args.kv_events {
        false => None,
        true => Some(kura_engine::KvEventsSetup {
            buffer: args.kv_events_buffer as usize,
            secret: needs_secret("--kv-events")?,
            debug_tokens: args.kv_events_tokens,
        }),
    };
    let redis_url = redis_url(args)?;
    let remote_secret = match &redis_url {
        Some(_) => Some(needs_secret("--kv-redis-url")?),
        None => None,
    };
    let tier_sizes = args.tiers.sizes()?;
    if args.no_prefix_cache && (tier_sizes.host_bytes > 0 || tier_sizes.disk.is_some()) {
        // Blocks go down a tier, and come back, by their place in the prefix cache.
        bail!(
            "--no-prefix-cache leaves the KV tiers nothing to hold (they keep the prefix cache's \
             blocks, and swap moves a sequence's blocks through them): drop --kv-host-memory and \
             --kv-disk-path, or --no-prefix-cache"
        );
    }
    let kv_request = KvMemoryRequest::parse(&args.kv_cache_memory)?;
    let device =
        kura_cuda::parse_device(&args.device).map_err(|e| anyhow::anyhow!("--device: {e}"))?;
    match device {
        // Checked before the model loads too, so that a size this machine cannot hold fails at once.
        None => kv_budget_bytes(kv_request, &args.kv_cache_memory).map(drop)?,
        Some(_) => {
            crate::gpu::check_weights(args.weights_dtype)?;
            crate::gpu::check_pool(args.kv_dtype, args.block_size)?;
        }
    }
    let path = crate::setup::model_path(args.model.as_ref())?;
    let load_start = Instant::now();
    // On a GPU: the file is opened once, its weights go to the device (then the activation buffers;
    // the pool takes its share of what they leave there), and nothing of the model is held on the
    // host but its config and text layer. On the CPU: the model.
    let (model, mut gpu, config, text) = match device {
        Some(ordinal) => {
            let parts = kura_model::ModelParts::open(&path)
                .with_context(|| format!("opening the model {}", path.display()))?;
            let setup = crate::gpu::GpuSetup::load(
                ordinal,
                &path,
                &parts,
                args.kv_dtype,
                args.block_size,
                args.max_num_batched_tokens,
                args.max_num_seqs,
            )?
            .checking_drafts(crate::gpu::drafts_of(args.speculative_config.as_ref()));
            (None, Some(setup), parts.config, Arc::new(parts.text))
        }
        None => {
            let model = Arc::new(crate::setup::load_model(&path, args.weights_dtype)?);
            let (config, text) = (model.config().clone(), model.text().clone());
            (Some(model), None, config, text)
        }
    };
    match &gpu {
        Some(g) => tracing::info!(
            model = %path.display(),
            load_ms = load_start.elapsed().as_millis() as u64,
            device = g.device_name(),
            "model loaded onto the GPU"
        ),
        None => tracing::info!(
            model = %path.display(),
            load_ms = load_start.elapsed().as_millis() as u64,
            threads = kura_model::num_threads(),
            kernels = %kura_model::kernels::paths(),
            "model loaded"
        ),
    }
    let model_max = config.max_context();
    let max_model_len = match args.max_model_len {
        Some(0) => bail!("--max-model-len must be at least 1"),
        Some(n) if n > model_max => {
            bail!("--max-model-len {n} is longer than the model's context of {model_max} tokens")
        }
        Some(n) => n,
        None => model_max,
    };
    let layout = config
        .kv_layout(args.kv_dtype, args.block_size)
        .with_context(|| {
            format!(
                "KV layout for --block-size {} and --kv-dtype",
                args.block_size
            )
        })?;
    // Resolved after the weights are loaded: a share is a share of what they left (see `memory`).
    // On a GPU the pool is planned from the device's total memory as `kura plan --gpu` plans it, then
    // checked against what is free there.
    let budget = match &gpu {
        Some(g) => g.pool(kv_request, &layout)?.budget_bytes,
        None => kv_budget_bytes(kv_request, &args.kv_cache_memory)?,
    };
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
    // A model with sliding layers gets the hybrid pool (its sliding layers paged apart, holding only
    // their window) unless lower tiers or guaranteed admission need whole blocks; `kura plan` decides
    // the same way (`hybrid_pool_for`) and prints the same figures.
    let whole_concurrency = layout
        .whole_model_pool()
        .max_concurrency(budget, max_model_len as u64);
    let tiers_on =
        tier_sizes.host_blocks(layout.bytes_per_block())? > 0 || tier_sizes.disk.is_some();
    // The GPU pool holds whole-model blocks only.
    let hybrid_allowed = !args.no_hybrid_pool && gpu.is_none();
    let window = kura_plan::hybrid_pool_for(
        &layout,
        budget,
        tiers_on,
        args.scheduling == AdmissionMode::Guaranteed,
    )
    .filter(|_| hybrid_allowed);
    let concurrency = match &window {
        Some(_) => layout.max_concurrency(budget, max_model_len as u64),
        None => whole_concurrency,
    };
    if let Some(w) = &window {
        tracing::info!(
            "KV cache: hybrid pool of {} pages (one layer of {} tokens, {} each): {} full-attention layers hold \
             every block, {} sliding layers only the {} blocks a {}-token window overlaps; max concurrency for \
             {max_model_len} tokens per request: {concurrency} (a whole-model pool: {whole_concurrency})",
            w.num_pages,
            args.block_size,
            format_bytes(layout.layer_bytes_per_block(0)),
            w.full_layers(),
            w.sliding_layers(),
            kura_kv::WindowPool::window_blocks(w.window_tokens, args.block_size),
            w.window_tokens,
        );
    } else if layout.has_sliding_window() {
        tracing::info!(
            "KV cache: whole-model blocks (--no-hybrid-pool, lower tiers or guaranteed admission need them, or the layers \
             differ in shape or window): sliding layers hold the whole context too"
        );
    }
    tracing::info!(
        "KV cache: {num_blocks} blocks of {} tokens = {} tokens, max concurrency for {max_model_len} tokens per request: {concurrency} ({} of {} KV, {} per token)",
        args.block_size,
        num_blocks * args.block_size as u64,
        format_bytes(num_blocks * layout.bytes_per_block()),
        args.kv_dtype.name(),
        format_bytes(layout.bytes_per_token()),
    );
    if args.kv_dtype.is_quantized() {
        let bf16_blocks = layout
            .with_dtype(KvDtype::Bf16)
            .num_blocks_for_budget(budget);
        tracing::info!(
            "KV cache in {}: {:.2}× the tokens bf16 would hold in the same {} ({} blocks instead of {bf16_blocks})",
            args.kv_dtype.name(),
            num_blocks as f64 / bf16_blocks.max(1) as f64,
            format_bytes(budget),
            num_blocks,
        );
    }
    // The weights' identity and what shapes stored KV beyond them: on the GPU nothing does (its fp8
    // scales each row as it comes, with no per-model key offsets; the compute format keeps its blocks
    // apart from the CPU's).
    let (weights_fingerprint, encoding_fingerprint) = match (&model, &gpu) {
        (Some(m), _) => (
            m.weights_fingerprint(),
            m.kv_encoding_fingerprint(args.kv_dtype)?,
        ),
        (None, Some(g)) => (g.weights_fingerprint(), 0),
        (None, None) => unreachable!("the model is loaded on the CPU or on a GPU"),
    };
    let gpu_numerics = gpu.as_ref().map(|g| g.numerics());
    let executor: Box<dyn kura_engine::Executor> = match (gpu.take(), &model) {
        (Some(g), _) => Box::new(g.executor(&layout, num_blocks as usize)?),
        (None, None) => unreachable!("the model is loaded on the CPU or on a GPU"),
        (None, Some(model)) => {
            let storage = match &window {
                Some(w) => model.kv_storage_paged(&layout, w.num_pages as usize),
                None => model.kv_storage(&layout, num_blocks as usize),
            }
            .context("allocating the KV cache")?;
            Box::new(kura_model::ModelExecutor::new(model.clone(), storage))
        }
    };
    let compute = match (&model, gpu_numerics) {
        (Some(m), _) => Compute::Cpu(m.weights_dtype(), kura_model::kernels::numerics(&layout)),
        (None, Some(numerics)) => Compute::Cuda(numerics),
        (None, None) => unreachable!("the model is loaded on the CPU or on a GPU"),
    };
    let fingerprint = kv_fingerprint(
        weights_fingerprint,
        config.kv_params_digest(),
        compute,
        &layout,
        encoding_fingerprint,
    );
    let host_blocks = tier_sizes.host_blocks(layout.bytes_per_block())?;
    // The pool is allocated by now: what remains must hold the host tier too.
    let host_bytes = u64::from(host_blocks) * layout.bytes_per_block();
    check_fits_in_memory("--kv-host-memory", &args.tiers.kv_host_memory, host_bytes)?;
    let tiers = TierSetup {
        host_blocks,
        disk: match &tier_sizes.disk {
            Some((dir, _)) => Some(DiskSetup {
                dir: dir.clone(),
                blocks: tier_sizes.disk_blocks(&layout)?,
                fingerprint,
            }),
            None => None,
        },
        policy: tier_sizes.policy,
        store_ahead: tier_sizes.store_ahead,
    };
    let model_name = served_model_name(args.served_model_name.as_deref(), &path)?;
    let pin_budget = pin_budget_blocks(&args.kv_pin_budget, num_blocks, layout.bytes_per_block())?;
    let config = EngineConfig {
        model_fingerprint: format!("{fingerprint:032x}"),
        tiers,
        preemption: tier_sizes.preemption,
        model_name,
        max_model_len,
        block_size_tokens: args.block_size,
        num_blocks: window
            .as_ref()
            .map_or(num_blocks as usize, |w| w.logical_blocks() as usize),
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_queue: args.max_queue as usize,
        enable_prefix_caching: !args.no_prefix_cache,
        scheduling_policy: args.scheduling_policy,
        stalled_client_timeout: Duration::from_secs(args.http.stalled_client_timeout_s),
        pin_budget_blocks: Some(pin_budget),
        admission: args.scheduling,
        window,
        kv_events,
        remote: match (redis_url, remote_secret) {
            (Some(url), Some(secret)) => Some(RemoteTierSetup {
                url,
                ttl_s: args.kv_redis_ttl_s,
                timeout: Duration::from_millis(args.kv_redis_timeout_ms),
                secret,
                ca_file: args.kv_redis_ca_file.clone(),
            }),
            _ => None,
        },
        speculative: args.speculative_config,
        prefill_step: (args.prefill_step_ms > 0)
            .then(|| Duration::from_millis(args.prefill_step_ms)),
        tier_cost: match args.tier_cost_check {
            CostCheckArg::On => kura_engine::TierCostCheck::Measured,
            CostCheckArg::Off => kura_engine::TierCostCheck::Off,
        },
        ..EngineConfig::default()
    };
    let codec = crate::setup::with_chat_template(
        ModelCodec::from_text(text).with_max_tokens(max_model_len),
        args.chat_template.as_ref(),
    )?;
    let engine = start_engine(config, executor, Arc::new(codec)).context("starting the engine")?;
    let admission = args.scheduling;
    match admission {
        AdmissionMode::Guaranteed => tracing::info!(
            "scheduling: {admission}: a request is admitted only when KV blocks for its prompt and max_tokens \
             (every choice) can be reserved; admitted requests are never preempted"
        ),
        AdmissionMode::MaxUtilization => tracing::info!(
            "scheduling: {admission}: requests are admitted on their prompt's KV blocks; when the pool runs \
             out the most recent is preempted ({})",
            tier_sizes.preemption.as_str()
        ),
    }
    match args.prefill_step_ms {
        0 => tracing::info!(
            "prefill beside decodes: no cut (--prefill-step-ms 0): a step takes up to {} tokens",
            args.max_num_batched_tokens
        ),
        ms => tracing::info!(
            "prefill beside decodes: steps of about {ms} ms (prompt tokens cut at the measured prefill \
             rate, kura:prefill_cap_tokens; --prefill-step-ms)"
        ),
    }
    Ok(engine)
}

/// The secret tenant names are keyed with: the fleet's (so that every replica and router of a fleet
/// names a key's tenant alike), else the server's own beside the disk tier's metadata (kept across
/// restarts), else one for this process only (nothing outlives it without a disk tier).
pub fn tenant_namer(
    args: &ServeArgs,
    fleet_secret: Option<&kura_kv::Secret>,
) -> Result<kura_api::TenantNamer> {
    let secret = match fleet_secret {
        Some(s) => s.clone(),
        None => match &args.tiers.kv_disk_path {
            Some(dir) => crate::secrets::server_secret(dir)?,
            None => kura_kv::Secret::random(),
        },
    };
    Ok(kura_api::TenantNamer::new(&secret))
}

/// Gives saved contexts owned by an API key's tenant name of earlier versions (an unkeyed digest) to its
/// keyed name.
fn migrate_context_owners(
    store: &ContextStore,
    api_keys: &[String],
    tenants: &kura_api::TenantNamer,
) -> Result<()> {
    let renames: Vec<(String, String)> = api_keys
        .iter()
        .map(|k| {
            (
                kura_api::legacy_tenant_of_key(k),
                tenants.tenant_of_key(k).to_string(),
            )
        })
        .collect();
    let moved = store
        .migrate_owners(&renames)
        .map_err(|e| anyhow::anyhow!("moving saved contexts to their keyed tenant names: {e}"))?;
    if moved > 0 {
        tracing::info!(
            contexts = moved,
            "saved contexts of earlier versions moved to their keyed tenant names"
        );
    }
    Ok(())
}

/// The saved contexts of the disk tier's directory (in memory only without one).
pub fn open_contexts(args: &ServeArgs) -> Result<Option<Arc<ContextStore>>> {
    let Some(dir) = &args.tiers.kv_disk_path else {
        return Ok(None);
    };
    let (store, warnings) = ContextStore::open(dir)
        .map_err(|e| anyhow::anyhow!("opening the saved contexts of --kv-disk-path: {e}"))?;
    for w in warnings {
        tracing::warn!("{w}");
    }
    tracing::info!(
        contexts = store.all().len(),
        "saved contexts found in {}",
        dir.display()
    );
    Ok(Some(Arc::new(store)))
}

pub fn run(args: ServeArgs) -> Result<()> {
    let api_keys = args.api_keys()?;
    let admin_keys =
        crate::secrets::admin_keys(&args.admin_api_keys, args.admin_api_key_file.as_ref())?;
    if args.kv_events && admin_keys.is_empty() {
        bail!(
            "--kv-events publishes the pool's content to the operator only: give an operator key \
             (--admin-api-key-file, --admin-api-key or ${})",
            crate::secrets::ADMIN_KEY_ENV
        );
    }
    if args.debug_clock && admin_keys.is_empty() {
        bail!("--debug-clock is an operator route: give an operator key (--admin-api-key-file)");
    }
    let loopback = matches!(
        args.host.as_str(),
        "127.0.0.1" | "localhost" | "::1" | "[::1]"
    );
    let console = match args.console {
        Some(true) if admin_keys.is_empty() && !api_keys.is_empty() => bail!(
            "--console shows every tenant's cache to the operator only: with API keys, give an \
             operator key (--admin-api-key-file, --admin-api-key or ${})",
            crate::secrets::ADMIN_KEY_ENV
        ),
        Some(on) => on,
        None => loopback && (api_keys.is_empty() || !admin_keys.is_empty()),
    };
    if admin_keys.iter().any(|k| api_keys.contains(k)) {
        bail!("an operator key is also a tenant's API key: give the operator a key of its own");
    }
    let http = args.http.limits(1)?;
    let fleet_secret = args.fleet_secret()?;
    let engine = start(&args, fleet_secret.as_ref())?;
    // After `start`, which checks the disk tier's flags before anything is written there.
    let tenants = tenant_namer(&args, fleet_secret.as_ref())?;
    let contexts = open_contexts(&args)?;
    if let Some(store) = &contexts {
        migrate_context_owners(store, &api_keys, &tenants)?;
    }
    if !api_keys.is_empty() {
        tracing::info!(
            keys = api_keys.len(),
            "API keys required; each key is its own cache tenant"
        );
    }
    if !admin_keys.is_empty() {
        tracing::info!(
            keys = admin_keys.len(),
            "operator key set: /v1/kv/* and /debug/* answer it only"
        );
    }
    let server_config = ServerConfig {
        api_keys,
        admin_keys,
        tenants,
        quotas: kura_server::TenantQuotas {
            contexts: args.max_contexts_per_tenant as usize,
            event_streams: args.max_kv_event_streams as usize,
        },
        max_body_bytes: http.max_body_bytes,
        body_timeout: http.body_timeout,
        shutdown_grace: http.shutdown_grace,
        request_timeout: (args.request_timeout_s > 0)
            .then(|| Duration::from_secs(args.request_timeout_s)),
        priority_scheduling: args.scheduling_policy == SchedulingPolicy::Priority,
        conn: http.conn,
        contexts,
        debug_clock: args.debug_clock,
        console,
        max_held_logprobs: args.max_held_logprobs,
        reasoning_parser: args.reasoning_parser,
        trust_request_chat_template: args.trust_request_chat_template,
    };
    let addr = format!("{}:{}", args.host, args.port);
    // Tokenizing a large prompt takes a core for a while: as many at once as there are cores (and at
    // least 2), so that tokenization cannot starve the forward pass of every core.
    let tokenizer_threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .max(2);
    crate::trim::start();
    let result =
        kura_server::serve_blocking(&addr, engine.clone(), server_config, tokenizer_threads)
            .with_context(|| format!("serving HTTP on {addr}"));
    engine.stop();
    tracing::info!("stopped");
    result
}

/// The environment variable that may hold the Redis URL instead of `--kv-redis-url`.
const REDIS_URL_ENV: &str = "KURA_KV_REDIS_URL";

/// The Redis URL of the shared KV tier: `--kv-redis-url`, the content of `--kv-redis-url-file`, or
/// `$KURA_KV_REDIS_URL` (empty counts as unset); more than one of them is an error naming them.
fn redis_url(args: &ServeArgs) -> Result<Option<String>> {
    let mut given: Vec<(String, String)> = Vec::new();
    if let Some(url) = &args.kv_redis_url {
        given.push(("--kv-redis-url".into(), url.trim().to_string()));
    }
    if let Some(path) = &args.kv_redis_url_file {
        let text = kura_files::read_text(path, crate::secrets::SECRET_FILE_MAX_BYTES)
            .with_context(|| format!("reading --kv-redis-url-file {}", path.display()))?;
        crate::secrets::warn_if_shared(path, "--kv-redis-url-file");
        if text.trim().is_empty() {
            bail!("--kv-redis-url-file {} is empty", path.display());
        }
        given.push((
            format!("--kv-redis-url-file {}", path.display()),
            text.trim().to_string(),
        ));
    }
    match std::env::var(REDIS_URL_ENV) {
        Ok(url) if !url.trim().is_empty() => {
            given.push((format!("${REDIS_URL_ENV}"), url.trim().to_string()))
        }
        Ok(_) | Err(std::env::VarError::NotPresent) => {}
        Err(std::env::VarError::NotUnicode(_)) => bail!("${REDIS_URL_ENV} is not UTF-8"),
    }
    if given.len() > 1 {
        let names: Vec<&str> = given.iter().map(|(name, _)| name.as_str()).collect();
        bail!(
            "the Redis URL is given by {}: give it once",
            names.join(" and ")
        );
    }
    let url = given.pop().map(|(_, url)| url);
    if url.is_none() {
        if let Some(path) = &args.kv_redis_ca_file {
            bail!(
                "--kv-redis-ca-file {} without a Redis URL (--kv-redis-url, --kv-redis-url-file or \
                 ${REDIS_URL_ENV})",
                path.display()
            );
        }
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn the_kv_fingerprint_is_a_fixed_byte_encoding() {
        // GOLDEN: a change of these constants means every disk tier and saved context written before
        // becomes foreign. Change them only with the encoding's version, or a marker of what changed
        // for one format (see kv_fingerprint).
        let layout = KvLayout::new(
            vec![
                kura_kv::layout::LayerKv::full(3, 64),
                kura_kv::layout::LayerKv {
                    kv_heads: 1,
                    head_dim: 256,
                    attention: kura_kv::layout::AttentionKind::SlidingWindow { window_tokens: 512 },
                },
            ],
            KvDtype::Int8,
            16,
        )
        .unwrap();
        let weights = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210;
        let encoding = 0x1111_2222_3333_4444_5555_6666_7777_8888;
        let native = Compute::Cpu(WeightsDtype::Native, 0x42);
        let params = 0x9999_aaaa_bbbb_cccc_dddd_eeee_ffff_0000;
        let f = kv_fingerprint(weights, params, native, &layout, encoding);
        assert_eq!(format!("{f:032x}"), "45259823656487160a0383a3ce4c2365");
        // Int4 KV: its integer-scored keys count too.
        let mut int4 = layout.clone();
        int4.dtype = KvDtype::Int4;
        let f4 = kv_fingerprint(weights, params, native, &int4, encoding);
        assert_eq!(format!("{f4:032x}"), "95d3b35888c586594cb0834684e26a05");
        // Each input counts.
        let others = [
            kv_fingerprint(weights + 1, params, native, &layout, encoding),
            kv_fingerprint(weights, params + 1, native, &layout, encoding),
            kv_fingerprint(
                weights,
                params,
                Compute::Cpu(WeightsDtype::Bf16, 0x42),
                &layout,
                encoding,
            ),
            kv_fingerprint(
                weights,
                params,
                Compute::Cpu(WeightsDtype::Native, 0x43),
                &layout,
                encoding,
            ),
            kv_fingerprint(weights, params, Compute::Cuda(1), &layout, encoding),
            kv_fingerprint(weights, params, Compute::Cuda(2), &layout, encoding),
            kv_fingerprint(weights, params, native, &layout, encoding + 1),
            kv_fingerprint(
                weights,
                params,
                native,
                &layout.with_dtype(KvDtype::Int4),
                encoding,
            ),
            kv_fingerprint(
                weights,
                params,
                native,
                &layout.with_block_size(32).unwrap(),
                encoding,
            ),
        ];
        for o in others {
            assert_ne!(o, f);
        }
    }

    #[test]
    fn the_pin_budget_is_a_share_or_bytes() {
        assert_eq!(pin_budget_blocks("25%", 100, 10).unwrap(), 25);
        assert_eq!(pin_budget_blocks("0.5", 100, 10).unwrap(), 50);
        assert_eq!(pin_budget_blocks("100B", 100, 10).unwrap(), 10);
        assert_eq!(pin_budget_blocks("1GiB", 100, 10).unwrap(), 100);
        assert_eq!(pin_budget_blocks("0%", 100, 10).unwrap(), 0);
        assert_eq!(pin_budget_blocks("0", 100, 10).unwrap(), 0);
        for bad in ["150%", "-1%", "1.5", "lots", "", "9B"] {
            let e = pin_budget_blocks(bad, 100, 10).unwrap_err();
            assert!(format!("{e:#}").contains("--kv-pin-budget"), "{bad}: {e:#}");
        }
    }

    #[test]
    fn plan_sizes_activations_with_the_servers_step_budget() {
        assert_eq!(
            kura_plan::DEFAULT_MAX_BATCHED_TOKENS,
            DEFAULT_MAX_BATCHED_TOKENS as u64
        );
    }

    #[test]
    fn the_served_model_name_must_say_something() {
        let p = Path::new("/m/model.gguf");
        assert!(served_model_name(Some(""), p).is_err());
        assert!(served_model_name(Some("  "), p).is_err());
        assert!(served_model_name(Some("a\nb"), p).is_err());
        assert_eq!(served_model_name(Some("x"), p).unwrap(), "x");
        assert_eq!(served_model_name(None, p).unwrap(), "model");
    }
}
