//! `kura router`: one OpenAI- and Anthropic-compatible endpoint over several `kura serve` replicas,
//! sending each request to the replica that holds its prefix (see kura-router).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use kura_router::{Policy, RouterConfig};
use kura_text::ModelCodec;
use kura_text::ModelText;

use crate::secrets::{fleet_secret, read_keys, ADMIN_KEY_ENV};

#[derive(Args, Debug)]
pub struct RouterArgs {
    /// A replica's base URL (`http://127.0.0.1:8001`); give one per replica. Replicas started with
    /// `--kv-events` are routed by their cache.
    #[arg(long = "replica", required = true)]
    replicas: Vec<String>,
    /// `kv`: lowest `overlap weight × blocks to prefill + active blocks` (needs the fleet's secret and
    /// the replicas' operator key); `round-robin`; `least-load`.
    #[arg(long, default_value = "kv")]
    policy: Policy,
    /// The model the replicas serve (GGUF file or HF directory), read for its tokenizer and chat
    /// template only. Default: Kura's default model (scripts/fetch-model.sh).
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// The chat template file the replicas were given (`kura serve --chat-template`), so that chats
    /// are tokenized here as they are there.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Weight of one block to prefill against one block in use in the `kv` cost (0..=1000).
    #[arg(long, default_value_t = 1.0)]
    overlap_weight: f64,
    /// A file holding the fleet's secret, the one every replica was started with (`kura serve
    /// --fleet-secret-file`): how replicas name the blocks they announce and their tenants. Or
    /// `$KURA_FLEET_SECRET`. Needed by `--policy kv`.
    #[arg(long)]
    fleet_secret_file: Option<PathBuf>,
    /// A file holding the replicas' operator key (`kura serve --admin-api-key-file`), presented to
    /// their `/v1/kv/events`. Or `$KURA_ADMIN_API_KEY`. Needed by `--policy kv`.
    #[arg(long)]
    replica_admin_key_file: Option<PathBuf>,
    /// The replicas' operator key itself. Prefer `--replica-admin-key-file` or `$KURA_ADMIN_API_KEY`:
    /// argv is visible to every user of the machine.
    #[arg(long)]
    replica_admin_key: Option<String>,
    /// An accepted API key (repeatable): the replicas' tenant keys. With keys, a request without one
    /// gets 401 here, before its body is read or tokenized. Without, requests are forwarded with
    /// whatever key they carry and the replicas check it.
    #[arg(long = "api-key")]
    api_keys: Vec<String>,
    /// A file of API keys, one per line (blank lines and `#` comments ignored).
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// Tell clients which replica served each answer (an `x-kura-replica` header: its number in
    /// `--replica` order), for debugging a fleet. Off by default: a client that sees where its own
    /// requests went learns where the others' went, and under `round-robin` how many they sent.
    #[arg(long)]
    replica_header: bool,
    /// Milliseconds between health checks of each replica (50..=10000); a replica is drained after two
    /// failed checks or a refused connection.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(50..=10_000))]
    health_interval_ms: u64,
    /// Most requests tokenized at once, each on a thread of its own (2..=1024). Default: the cores.
    /// A request that finds every one busy for more than 50 ms is routed by load instead.
    #[arg(long, value_parser = clap::value_parser!(u64).range(2..=1024))]
    tokenizer_threads: Option<u64>,
    #[command(flatten)]
    http: crate::http_args::HttpArgs,
}

/// The replicas' operator key: `--replica-admin-key-file`, `--replica-admin-key`, else
/// `$KURA_ADMIN_API_KEY`.
fn replica_admin_key(args: &RouterArgs) -> Result<Option<String>> {
    let keys = read_keys(
        args.replica_admin_key.as_slice(),
        args.replica_admin_key_file.as_ref(),
        "replica-admin-key",
    )?;
    if let Some(key) = keys.into_iter().next() {
        return Ok(Some(key));
    }
    match std::env::var(ADMIN_KEY_ENV) {
        Ok(key) if key.trim().is_empty() => bail!("${ADMIN_KEY_ENV} is set but empty"),
        Ok(key) => Ok(Some(key.trim().to_string())),
        Err(_) => Ok(None),
    }
}

pub fn run(args: RouterArgs) -> Result<()> {
    if !(0.0..=1000.0).contains(&args.overlap_weight) {
        bail!(
            "--overlap-weight must be from 0 to 1000, got {}",
            args.overlap_weight
        );
    }
    let secret = fleet_secret(args.fleet_secret_file.as_ref())?;
    let admin_key = replica_admin_key(&args)?;
    let api_keys = read_keys(&args.api_keys, args.api_key_file.as_ref(), "api-key")?;
    if admin_key.as_ref().is_some_and(|k| api_keys.contains(k)) {
        bail!("the replicas' operator key is also a tenant's API key: give the operator a key of its own");
    }
    // A client connection may hold one to a replica too.
    let http = args.http.limits(2)?;
    let tokenizer_threads = match args.tokenizer_threads {
        Some(n) => usize::try_from(n).context("--tokenizer-threads")?,
        None => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
            .max(2),
    };
    let path = crate::setup::model_path(args.model.as_ref())?;
    let (text, context) = ModelText::load_with_context(&path)
        .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
    // The replicas serve at most the model's context: a longer text is refused before tokenizing.
    let codec = crate::setup::with_chat_template(
        ModelCodec::from_text(Arc::new(text)),
        args.chat_template.as_ref(),
    )?;
    let codec = Arc::new(match context.and_then(|c| usize::try_from(c).ok()) {
        Some(c) => codec.with_max_tokens(c),
        None => codec,
    });
    let config = RouterConfig {
        overlap_weight: args.overlap_weight,
        replica_admin_key: admin_key,
        fleet_secret: secret,
        api_keys,
        health_interval: Duration::from_millis(args.health_interval_ms),
        tokenizer_threads,
        max_body_bytes: http.max_body_bytes,
        body_timeout: http.body_timeout,
        conn: http.conn,
        shutdown_grace: http.shutdown_grace,
        replica_header: args.replica_header,
        ..RouterConfig::new(args.replicas, args.policy, codec)
    };
    let addr = format!("{}:{}", args.host, args.port);
    crate::trim::start();
    kura_router::serve_blocking(&addr, config).context("running the router")?;
    Ok(())
}
