//! `kura-router` — a front end over several `kura serve` replicas that sends each request to the
//! replica best placed to serve it (`kura router`).
//!
//! ```text
//!  client ──POST /v1/chat/completions──▶ router ──same request──▶ replica r (kura serve --kv-events)
//!                                          │  ▲
//!         tokens + cache salt (kura-server │  │ GET /v1/kv/events: snapshot, then numbered
//!         routing, the model's tokenizer)  │  │ stored / removed / cleared (one follower per replica)
//!                                          ▼  │
//!                                  FleetIndex: which replica holds which leading blocks of the prompt
//! ```
//!
//! - [`index`]: the block index built from the replicas' events, naming blocks by content.
//! - [`policy`]: `kv` (Dynamo's cost: `overlap_weight × blocks to prefill + blocks of work in flight`),
//!   `round-robin`, `least-load`.
//! - [`proxy`]: the routes; the request is forwarded byte for byte and the response streamed back.
//! - [`replica`]: each replica's health checks (every `health_interval`; down after two failures or a
//!   refused connection, and then no longer routed to and its blocks forgotten), its load from its
//!   metrics, and its event follower (resynchronizes from a snapshot on a gap).

pub mod index;
/// The routing policies, shared with the fleet simulator (`kura_sim::routing`).
pub use kura_sim::routing as policy;
mod proxy;
mod replica;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use kura_engine::TextCodec;
use tokio::net::TcpListener;

pub use index::FleetIndex;
pub use policy::{choose, Candidate, Policy};
use replica::Replica;

/// How the router runs.
#[derive(Clone)]
pub struct RouterConfig {
    /// Base URLs of the replicas (`http://host:port`).
    pub replicas: Vec<String>,
    pub policy: Policy,
    /// Weight of a block to prefill against a block in use, in the `kv` cost.
    pub overlap_weight: f64,
    /// Key the router presents to the replicas' `/v1/kv/events` when they have API keys.
    pub replica_api_key: Option<String>,
    /// How often each replica's health and load are checked.
    pub health_interval: Duration,
    /// The served model's tokenizer and chat template, for `kv` routing.
    pub codec: Arc<dyn TextCodec>,
    /// Largest request body forwarded.
    pub max_body_bytes: usize,
}

impl std::fmt::Debug for RouterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterConfig")
            .field("replicas", &self.replicas)
            .field("policy", &self.policy)
            .field("overlap_weight", &self.overlap_weight)
            .field("health_interval", &self.health_interval)
            .finish_non_exhaustive()
    }
}

/// Why the router could not start.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("invalid router configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// A per-replica metric: name, type, help, and how to read it.
type ReplicaMetric = (
    &'static str,
    &'static str,
    &'static str,
    fn(&Replica) -> u64,
);

/// The router's state, shared by its routes and its replica tasks.
pub(crate) struct Fleet {
    config: RouterConfig,
    replicas: Vec<Replica>,
    index: Mutex<FleetIndex>,
    turn: Mutex<usize>,
    /// `prompt_cache_key` → the replica its last request went to.
    affinity: Mutex<std::collections::HashMap<String, usize>>,
    client: reqwest::Client,
    retries: AtomicU64,
    unroutable: AtomicU64,
    started: std::time::Instant,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks; a poisoned one still holds a consistent value.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Fleet {
    fn new(config: RouterConfig) -> Result<Self, RouterError> {
        if config.replicas.is_empty() {
            return Err(RouterError::Config(
                "give at least one --replica URL".into(),
            ));
        }
        let mut replicas = Vec::new();
        for url in &config.replicas {
            let url = url.trim_end_matches('/');
            let parsed = reqwest::Url::parse(url)
                .map_err(|e| RouterError::Config(format!("replica URL {url:?}: {e}")))?;
            if !matches!(parsed.scheme(), "http" | "https") || parsed.host().is_none() {
                return Err(RouterError::Config(format!(
                    "replica URL {url:?} must be http://HOST:PORT or https://HOST:PORT"
                )));
            }
            if replicas.iter().any(|r: &Replica| r.url == url) {
                return Err(RouterError::Config(format!("replica {url} is given twice")));
            }
            replicas.push(Replica::new(url.to_string()));
        }
        if !(config.overlap_weight.is_finite() && config.overlap_weight >= 0.0) {
            return Err(RouterError::Config(format!(
                "overlap weight must be a finite number ≥ 0, got {}",
                config.overlap_weight
            )));
        }
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .pool_idle_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| RouterError::Config(format!("HTTP client: {e}")))?;
        Ok(Self {
            index: Mutex::new(FleetIndex::new(replicas.len())),
            replicas,
            turn: Mutex::new(0),
            affinity: Mutex::new(Default::default()),
            client,
            retries: AtomicU64::new(0),
            unroutable: AtomicU64::new(0),
            started: std::time::Instant::now(),
            config,
        })
    }

    /// Milliseconds since the router started (the clock of the index's routed blocks).
    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Prometheus text of the router's own metrics.
    fn metrics_text(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let index = lock(&self.index);
        let per_replica: [ReplicaMetric; 10] = [
            (
                "kura_router:requests_total",
                "counter",
                "Requests sent to the replica.",
                |r| r.requests.load(Ordering::Relaxed),
            ),
            (
                "kura_router:request_failures_total",
                "counter",
                "Requests the replica could not take (connection failed; retried elsewhere).",
                |r| r.failures.load(Ordering::Relaxed),
            ),
            (
                "kura_router:prompt_tokens_total",
                "counter",
                "Prompt tokens sent to the replica.",
                |r| r.prompt_tokens.load(Ordering::Relaxed),
            ),
            (
                "kura_router:predicted_cached_tokens_total",
                "counter",
                "Prompt tokens the index predicted the replica holds.",
                |r| r.predicted_cached.load(Ordering::Relaxed),
            ),
            (
                "kura_router:reported_cached_tokens_total",
                "counter",
                "Cached prompt tokens the replica reported in usage.",
                |r| r.reported_cached.load(Ordering::Relaxed),
            ),
            (
                "kura_router:replica_up",
                "gauge",
                "1 while the replica passes its health checks.",
                |r| u64::from(r.is_up()),
            ),
            (
                "kura_router:in_flight",
                "gauge",
                "Requests this router has in flight at the replica.",
                |r| r.in_flight.load(Ordering::Relaxed),
            ),
            (
                "kura_router:replica_reported_load",
                "gauge",
                "Requests running and waiting, from the replica's metrics.",
                |r| r.reported_load.load(Ordering::Relaxed),
            ),
            (
                "kura_router:kv_snapshots_total",
                "counter",
                "KV snapshots taken from the replica (first sync and every resynchronization).",
                |r| r.snapshots.load(Ordering::Relaxed),
            ),
            (
                "kura_router:kv_event_gaps_total",
                "counter",
                "Gaps in the replica's KV events (each followed by a resynchronization).",
                |r| r.gaps.load(Ordering::Relaxed),
            ),
        ];
        for (name, kind, help, get) in per_replica {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for r in &self.replicas {
                let _ = writeln!(out, "{name}{{replica=\"{}\"}} {}", r.url, get(r));
            }
        }
        let name = "kura_router:indexed_blocks";
        let _ = writeln!(
            out,
            "# HELP {name} Blocks the index holds for the replica.\n# TYPE {name} gauge"
        );
        for (i, r) in self.replicas.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}{{replica=\"{}\"}} {}",
                r.url,
                index.num_blocks(i)
            );
        }
        for (name, help, v) in [
            (
                "kura_router:retries_total",
                "Requests sent again to another replica.",
                &self.retries,
            ),
            (
                "kura_router:unroutable_total",
                "Requests refused because no replica was up.",
                &self.unroutable,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
        out
    }
}

/// The router's routes over `fleet`.
fn app(fleet: Arc<Fleet>) -> axum::Router {
    let limit = fleet.config.max_body_bytes;
    axum::Router::new()
        .route("/v1/chat/completions", post(proxy::chat_completions))
        .route("/v1/completions", post(proxy::completions))
        .route("/v1/messages", post(proxy::messages))
        .route("/v1/models", get(proxy::models))
        .route("/health", get(proxy::health))
        .route("/metrics", get(proxy::metrics))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(fleet)
}

/// Routes on `listener` until `shutdown` resolves.
pub async fn run(
    listener: TcpListener,
    config: RouterConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    let fleet = Arc::new(Fleet::new(config)?);
    tracing::info!(
        "routing the OpenAI and Anthropic APIs on http://{}/v1 over {} replicas, policy {}",
        listener.local_addr()?,
        fleet.replicas.len(),
        fleet.config.policy.as_str()
    );
    let tasks: Vec<_> = (0..fleet.replicas.len())
        .flat_map(|r| {
            [
                tokio::spawn(replica::check_health(fleet.clone(), r)),
                tokio::spawn(replica::follow_events(fleet.clone(), r)),
            ]
        })
        .collect();
    let result = axum::serve(listener, app(fleet))
        .with_graceful_shutdown(shutdown)
        .await;
    for t in tasks {
        t.abort();
    }
    Ok(result?)
}

/// Runs [`run`] on its own runtime, bound to `addr`, until Ctrl-C or SIGTERM.
pub fn serve_blocking(addr: &str, config: RouterConfig) -> Result<(), RouterError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kura-router")
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let listener = TcpListener::bind(addr).await?;
        run(listener, config, shutdown_signal()).await
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
