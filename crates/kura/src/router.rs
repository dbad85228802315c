//! `kura router`: one OpenAI- and Anthropic-compatible endpoint over several `kura serve` replicas,
//! sending each request to the replica that holds its prefix (see kura-router).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use kura_engine::ModelCodec;
use kura_kv::units::{format_bytes, parse_bytes};
use kura_model::ModelText;
use kura_router::{Policy, RouterConfig};
use kura_server::ConnLimits;

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
    /// Milliseconds between health checks of each replica (50..=10000); a replica is drained after two
    /// failed checks or a refused connection.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(50..=10_000))]
    health_interval_ms: u64,
    /// Most requests tokenized at once, each on a thread of its own (2..=1024). Default: the cores.
    /// A request that finds every one busy for more than 50 ms is routed by load instead.
    #[arg(long, value_parser = clap::value_parser!(u64).range(2..=1024))]
    tokenizer_threads: Option<u64>,
    /// Largest accepted request body, e.g. `8MiB` (at most 1GiB); larger ones get 413 here and never
    /// reach a replica.
    #[arg(long, default_value = "8MiB")]
    max_body_size: String,
    /// Most open client connections. At the limit, the oldest connection without a request in flight
    /// is closed to admit a new one. Default: 4096, or less where the open-file limit is lower.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_connections: Option<u64>,
    /// Seconds a client has to send a request's head (request line and headers) (1..=3600).
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..=3600))]
    http_header_timeout_s: u64,
    /// Seconds a connection may stay open with no request in flight and nothing received (1..=3600).
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..=3600))]
    http_idle_timeout_s: u64,
    /// Seconds a client has to send a request's body once its head has arrived (408 after) (1..=3600).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    http_body_timeout_s: u64,
    /// Seconds a client may stop reading its response before its connection is closed (and its
    /// request cancelled at the replica) (1..=3600).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    stalled_client_timeout_s: u64,
    /// Seconds requests in flight may run after a shutdown signal before every connection is closed
    /// (0..=3600).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(0..=3600))]
    shutdown_grace_s: u64,
}

/// Largest `--max-body-size`.
const MAX_BODY_BYTES: u64 = 1 << 30;
/// Default `--max-connections`.
const DEFAULT_MAX_CONNECTIONS: u64 = 4096;
/// File descriptors kept free of connections (the tokenizer, logs, health checks, event streams).
const RESERVED_FDS: u64 = 64;

/// `--max-connections`, or the default bounded by the open-file limit, so that a flood meets the
/// connection cap (which evicts idle connections) before it meets `Too many open files`. Each client
/// connection may hold one connection to a replica: half of the room is theirs.
fn max_connections(given: Option<u64>, open_files: Option<u64>) -> Result<usize> {
    let room = open_files.map(|limit| limit.saturating_sub(RESERVED_FDS) / 2);
    let n = match (given, room) {
        (Some(n), Some(room)) if n > room => bail!(
            "--max-connections {n} is more than this process may open: its open-file limit leaves \
             room for {room} client connections (each may hold one to a replica); lower \
             --max-connections or raise the limit (ulimit -n)"
        ),
        (Some(n), _) => n,
        (None, Some(0)) => bail!(
            "the open-file limit (ulimit -n) leaves no room for connections; raise it above {}",
            RESERVED_FDS + 2
        ),
        (None, Some(room)) => DEFAULT_MAX_CONNECTIONS.min(room),
        (None, None) => DEFAULT_MAX_CONNECTIONS,
    };
    usize::try_from(n).context("--max-connections does not fit this platform")
}

/// The soft limit on open files (`/proc/self/limits`), where the platform says it.
fn open_file_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    crate::memory::soft_limit(&text, "Max open files")
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
    let max_body_bytes = parse_bytes(&args.max_body_size)
        .with_context(|| format!("--max-body-size {:?}", args.max_body_size))?;
    if max_body_bytes == 0 || max_body_bytes > MAX_BODY_BYTES {
        bail!(
            "--max-body-size {:?} must be between 1 byte and {}",
            args.max_body_size,
            format_bytes(MAX_BODY_BYTES)
        );
    }
    let max_connections = max_connections(args.max_connections, open_file_limit())?;
    let tokenizer_threads = match args.tokenizer_threads {
        Some(n) => usize::try_from(n).context("--tokenizer-threads")?,
        None => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
            .max(2),
    };
    let path = crate::setup::model_path(args.model.as_ref())?;
    let text = ModelText::load(&path)
        .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
    let codec = Arc::new(ModelCodec::from_text(Arc::new(text)));
    let config = RouterConfig {
        overlap_weight: args.overlap_weight,
        replica_admin_key: admin_key,
        fleet_secret: secret,
        api_keys,
        health_interval: Duration::from_millis(args.health_interval_ms),
        tokenizer_threads,
        max_body_bytes: usize::try_from(max_body_bytes).context("--max-body-size")?,
        body_timeout: Duration::from_secs(args.http_body_timeout_s),
        conn: ConnLimits {
            max_connections,
            header_timeout: Duration::from_secs(args.http_header_timeout_s),
            idle_timeout: Duration::from_secs(args.http_idle_timeout_s),
            write_stall_timeout: Duration::from_secs(args.stalled_client_timeout_s),
        },
        shutdown_grace: Duration::from_secs(args.shutdown_grace_s),
        ..RouterConfig::new(args.replicas, args.policy, codec)
    };
    let addr = format!("{}:{}", args.host, args.port);
    kura_router::serve_blocking(&addr, config).context("running the router")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_connections_leaves_room_for_a_replica_connection_each() {
        assert_eq!(max_connections(None, None).unwrap(), 4096);
        assert_eq!(max_connections(None, Some(20_000)).unwrap(), 4096);
        assert_eq!(max_connections(None, Some(1024)).unwrap(), 480);
        let e = max_connections(Some(481), Some(1024))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--max-connections 481") && e.contains("480"),
            "{e}"
        );
        assert_eq!(max_connections(Some(480), Some(1024)).unwrap(), 480);
        assert!(max_connections(None, Some(10)).is_err());
    }
}
