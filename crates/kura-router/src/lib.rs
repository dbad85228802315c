//! `kura-router` — a front end over several `kura serve` replicas that sends each request to the
//! replica best placed to serve it (`kura router`).
//!
//! ```text
//!  client ──POST /v1/chat/completions──▶ router ──same request──▶ replica r (kura serve --kv-events)
//!                                          │  ▲
//!         tokens + cache salt (kura-api    │  │ GET /v1/kv/events: snapshot, then numbered
//!         routing, the model's tokenizer)  │  │ stored / removed / cleared (one follower per replica)
//!                                          ▼  │
//!                                  FleetIndex: which replica holds which leading blocks of the prompt
//! ```
//!
//! - `kura_fleet::index` ([`FleetIndex`]): the block index built from the replicas' events, naming blocks
//!   by content (`kura_fleet::ContentNamer`).
//! - `kura_fleet::policy` ([`Policy`]): `kv` (Dynamo's cost: `overlap_weight × blocks to prefill + blocks
//!   of work in flight`), `round-robin`, `least-load`; the fleet simulator replays the same decisions.
//! - [`proxy`]: the routes; the request is forwarded byte for byte and the response streamed back.
//! - [`responses`]: the Responses API's stored responses: a request naming one (`previous_response_id`,
//!   `GET`/`DELETE /v1/responses/{id}`) goes to the server holding it, learnt from the answers relayed
//!   or asked of the replicas.
//! - [`replica`]: each replica's health checks (every `health_interval`; down after two failures or a
//!   refused connection, and then no longer routed to and its blocks forgotten), its load from its
//!   metrics, and its event follower (resynchronizes from a snapshot on a gap).
//!
//! In front of the routes: `kura serve`'s connection layer (`kura_api::accept_loop`: a connection
//! cap that evicts the oldest idle connection, header, idle and write-stall timeouts, a hard close at
//! shutdown), then the API keys (a request without a valid one gets 401 before its body is read), then
//! the body limit and timeout (413, 408). Tokenization runs on the blocking pool, at most
//! `tokenizer_threads` requests at once; a request that finds every slot busy for longer than a short
//! wait is routed without its prompt's blocks (by load) rather than queued.

mod proxy;
mod replica;
mod responses;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use kura_api::{ConnLimits, Phase, TenantNamer};
use kura_fleet::ContentNamer;
use kura_kv::Secret;
use kura_metrics::{Exposition, Kind};
use kura_text::TextCodec;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

pub use kura_fleet::FleetIndex;
pub use kura_fleet::{choose, Candidate, Policy};
use replica::Replica;

/// How the router runs.
#[derive(Clone)]
pub struct RouterConfig {
    /// Base URLs of the replicas (`http://host:port`).
    pub replicas: Vec<String>,
    pub policy: Policy,
    /// Weight of a block to prefill against a block in use, in the `kv` cost.
    pub overlap_weight: f64,
    /// The replicas' operator key, presented to their `/v1/kv/events`.
    pub replica_admin_key: Option<String>,
    /// The fleet's secret: how replicas name blocks and tenants. Needed by the `kv` policy; without
    /// it the router reads no events and routes by load or in turn only.
    pub fleet_secret: Option<Secret>,
    /// Accepted client API keys (the replicas' tenant keys); empty: requests are forwarded with
    /// whatever key they carry, and the replicas check it.
    pub api_keys: Vec<String>,
    /// How often each replica's health and load are checked.
    pub health_interval: Duration,
    /// The served model's tokenizer and chat template, for `kv` routing.
    pub codec: Arc<dyn TextCodec>,
    /// Most requests tokenized at once (each on a thread of the blocking pool).
    pub tokenizer_threads: usize,
    /// Largest request body read (413 past it); nothing larger reaches a replica.
    pub max_body_bytes: usize,
    /// Longest time to receive a request's body once its head has arrived (408 past it).
    pub body_timeout: Duration,
    /// Connection cap and timeouts.
    pub conn: ConnLimits,
    /// After a shutdown signal, how long requests in flight may run before every connection closes.
    pub shutdown_grace: Duration,
    /// Answers carry `x-kura-replica`, the replica that served them (`--replica-header`; off by
    /// default: it tells every client where the others' requests went).
    pub replica_header: bool,
}

impl RouterConfig {
    /// A configuration over `replicas` with `kura serve`'s defaults for what the two share.
    pub fn new(replicas: Vec<String>, policy: Policy, codec: Arc<dyn TextCodec>) -> Self {
        Self {
            replicas,
            policy,
            overlap_weight: 1.0,
            replica_admin_key: None,
            fleet_secret: None,
            api_keys: Vec::new(),
            health_interval: Duration::from_millis(250),
            codec,
            tokenizer_threads: 2,
            max_body_bytes: 8 * 1024 * 1024,
            body_timeout: Duration::from_secs(30),
            conn: ConnLimits::default(),
            shutdown_grace: Duration::from_secs(30),
            replica_header: false,
        }
    }
}

impl std::fmt::Debug for RouterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterConfig")
            .field("replicas", &self.replicas)
            .field("policy", &self.policy)
            .field("overlap_weight", &self.overlap_weight)
            .field("health_interval", &self.health_interval)
            .field("api_keys", &self.api_keys.len())
            .field("tokenizer_threads", &self.tokenizer_threads)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("conn", &self.conn)
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
type ReplicaMetric = (&'static str, Kind, &'static str, fn(&Replica) -> u64);

/// The router's state, shared by its routes and its replica tasks.
pub(crate) struct Fleet {
    config: RouterConfig,
    replicas: Vec<Replica>,
    index: Mutex<FleetIndex>,
    /// The server process behind each replica's address, as its last KV snapshot named it
    /// (`instance`; `None` before one): which addresses are duplicates of others
    /// ([`Fleet::note_instance`]). Taken alone, never with another of the fleet's locks.
    instances: Mutex<Vec<Option<String>>>,
    turn: Mutex<usize>,
    /// Where each stored response lives (the Responses API's `previous_response_id`).
    homes: responses::Homes,
    /// `prompt_cache_key` → the replica its last request went to.
    affinity: Mutex<std::collections::HashMap<proxy::AffinityKey, usize>>,
    client: reqwest::Client,
    /// Names a request's blocks as the replicas do (with the fleet's secret); `None` without one.
    namer: Option<ContentNamer>,
    /// Names a request's tenant as the replicas do (with the fleet's secret).
    tenants: Option<TenantNamer>,
    /// One permit per request being tokenized.
    tokenizer: Arc<Semaphore>,
    retries: AtomicU64,
    unroutable: AtomicU64,
    unauthorized: AtomicU64,
    tokenized: AtomicU64,
    tokenizer_busy: AtomicU64,
    started: std::time::Instant,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks; a poisoned one still holds a consistent value.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A replica's base URL as the router writes it (`scheme://host:port`, lower case, the scheme's port
/// made explicit), from `http://HOST:PORT` or `https://HOST:PORT` with at most a trailing `/`. Anything
/// else is refused: a user and password (sent as Basic auth ahead of the client's key), a path, query or
/// fragment (the routes are appended to the URL, so the replica would answer 404 for ever).
fn replica_url(given: &str) -> Result<String, RouterError> {
    let bad = |why: &str| {
        RouterError::Config(format!(
            "replica URL {given:?} {why}: give http://HOST:PORT or https://HOST:PORT"
        ))
    };
    let parsed = reqwest::Url::parse(given).map_err(|e| bad(&format!("is not a URL ({e})")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(bad(&format!("has scheme {:?}", parsed.scheme())));
    }
    let Some(host) = parsed.host_str() else {
        return Err(bad("has no host"));
    };
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(bad("holds a user or password"));
    }
    if parsed.path() != "/" {
        return Err(bad(&format!("has a path ({})", parsed.path())));
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(bad("has a query or fragment"));
    }
    let port = parsed
        .port_or_known_default()
        .ok_or_else(|| bad("has no port"))?;
    Ok(format!("{}://{host}:{port}", parsed.scheme()))
}

impl Fleet {
    fn new(config: RouterConfig) -> Result<Self, RouterError> {
        if config.replicas.is_empty() {
            return Err(RouterError::Config(
                "give at least one --replica URL".into(),
            ));
        }
        let mut replicas = Vec::new();
        for given in &config.replicas {
            let url = replica_url(given)?;
            if replicas.iter().any(|r: &Replica| r.url == url) {
                return Err(RouterError::Config(format!(
                    "replica {given:?} is given twice (as {url})"
                )));
            }
            replicas.push(Replica::new(url));
        }
        if !(config.overlap_weight.is_finite() && config.overlap_weight >= 0.0) {
            return Err(RouterError::Config(format!(
                "overlap weight must be a finite number ≥ 0, got {}",
                config.overlap_weight
            )));
        }
        if config.policy == Policy::Kv && config.fleet_secret.is_none() {
            return Err(RouterError::Config(
                "--policy kv needs the fleet's secret (--fleet-secret-file or $KURA_FLEET_SECRET), \
                 the one the replicas were started with: it is how they name the blocks they announce"
                    .into(),
            ));
        }
        if config.policy == Policy::Kv && config.replica_admin_key.is_none() {
            return Err(RouterError::Config(
                "--policy kv reads the replicas' KV events, which need their operator key: give \
                 --replica-admin-key-file (or $KURA_ADMIN_API_KEY)"
                    .into(),
            ));
        }
        if config.api_keys.iter().any(|k| k.is_empty()) {
            return Err(RouterError::Config("an API key must not be empty".into()));
        }
        if config.tokenizer_threads == 0 || config.max_body_bytes == 0 {
            return Err(RouterError::Config(
                "the tokenizer threads and the body limit must be at least 1".into(),
            ));
        }
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .pool_idle_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| RouterError::Config(format!("HTTP client: {e}")))?;
        Ok(Self {
            index: Mutex::new(FleetIndex::new(replicas.len())),
            instances: Mutex::new(vec![None; replicas.len()]),
            replicas,
            turn: Mutex::new(0),
            affinity: Mutex::new(Default::default()),
            homes: responses::Homes::default(),
            client,
            namer: config.fleet_secret.as_ref().map(ContentNamer::new),
            tenants: config.fleet_secret.as_ref().map(TenantNamer::new),
            tokenizer: Arc::new(Semaphore::new(config.tokenizer_threads)),
            retries: AtomicU64::new(0),
            unroutable: AtomicU64::new(0),
            unauthorized: AtomicU64::new(0),
            tokenized: AtomicU64::new(0),
            tokenizer_busy: AtomicU64::new(0),
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
        let mut e = Exposition::new();
        let index = lock(&self.index);
        let per_replica: [ReplicaMetric; 12] = [
            (
                "kura_router:requests_total",
                Kind::Counter,
                "Requests sent to the replica.",
                |r| r.requests.load(Ordering::Relaxed),
            ),
            (
                "kura_router:request_failures_total",
                Kind::Counter,
                "Requests whose connection to the replica failed before an answer (retried elsewhere \
                 when the replica is down).",
                |r| r.failures.load(Ordering::Relaxed),
            ),
            (
                "kura_router:prompt_tokens_total",
                Kind::Counter,
                "Prompt tokens sent to the replica.",
                |r| r.prompt_tokens.load(Ordering::Relaxed),
            ),
            (
                "kura_router:predicted_cached_tokens_total",
                Kind::Counter,
                "Prompt tokens the index predicted the replica holds.",
                |r| r.predicted_cached.load(Ordering::Relaxed),
            ),
            (
                "kura_router:reported_cached_tokens_total",
                Kind::Counter,
                "Cached prompt tokens the replica reported in usage.",
                |r| r.reported_cached.load(Ordering::Relaxed),
            ),
            (
                "kura_router:replica_up",
                Kind::Gauge,
                "1 while the replica passes its health checks.",
                |r| u64::from(r.is_up()),
            ),
            (
                "kura_router:replica_duplicate",
                Kind::Gauge,
                "1 while an earlier --replica reaches the same server (the same instance): no requests \
                 go to this address.",
                |r| u64::from(r.is_duplicate()),
            ),
            (
                "kura_router:replica_mark_downs_total",
                Kind::Counter,
                "Times the replica was found down (a refused connection or failed health checks).",
                |r| r.mark_downs.load(Ordering::Relaxed),
            ),
            (
                "kura_router:in_flight",
                Kind::Gauge,
                "Requests this router has in flight at the replica.",
                |r| r.in_flight.load(Ordering::Relaxed),
            ),
            (
                "kura_router:replica_reported_load",
                Kind::Gauge,
                "Requests running and waiting, from the replica's metrics.",
                |r| r.reported_load.load(Ordering::Relaxed),
            ),
            (
                "kura_router:kv_snapshots_total",
                Kind::Counter,
                "KV snapshots taken from the replica (first sync and every resynchronization).",
                |r| r.snapshots.load(Ordering::Relaxed),
            ),
            (
                "kura_router:kv_event_gaps_total",
                Kind::Counter,
                "Gaps in the replica's KV events (each followed by a resynchronization).",
                |r| r.gaps.load(Ordering::Relaxed),
            ),
        ];
        for (name, kind, help, get) in per_replica {
            e.family(name, help, kind);
            for r in &self.replicas {
                e.sample(name, &[("replica", &r.url)], get(r));
            }
        }
        let name = "kura_router:indexed_blocks";
        e.family(name, "Blocks the index holds for the replica.", Kind::Gauge);
        for (i, r) in self.replicas.iter().enumerate() {
            e.sample(name, &[("replica", &r.url)], index.num_blocks(i));
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
            (
                "kura_router:unauthorized_total",
                "Requests refused (401) for want of a valid API key, before their body was read.",
                &self.unauthorized,
            ),
            (
                "kura_router:tokenized_requests_total",
                "Requests whose prompt the router tokenized to route it.",
                &self.tokenized,
            ),
            (
                "kura_router:tokenizer_busy_total",
                "Requests routed without their prompt's blocks because every tokenizer slot was busy.",
                &self.tokenizer_busy,
            ),
            (
                "kura_router:responses_routed_total",
                "Requests sent to the server holding the stored response they name (previous_response_id, GET and DELETE by id).",
                &self.homes.routed,
            ),
            (
                "kura_router:response_probes_total",
                "Replicas asked whether they hold a stored response the router had not seen.",
                &self.homes.probes,
            ),
        ] {
            e.counter(name, help, v.load(Ordering::Relaxed));
        }
        e.gauge(
            "kura_router:stored_responses_known",
            "Stored responses (Responses API) whose server the router knows.",
            self.homes.len() as u64,
        );
        e.finish()
    }
}

/// The router's routes over `fleet`.
fn app(fleet: Arc<Fleet>) -> axum::Router {
    let limit = fleet.config.max_body_bytes;
    let api = axum::Router::new()
        .route("/v1/chat/completions", post(proxy::chat_completions))
        .route("/v1/completions", post(proxy::completions))
        .route("/v1/messages", post(proxy::messages))
        .route("/v1/messages/count_tokens", post(proxy::count_tokens))
        .route("/v1/responses", post(proxy::responses))
        .route(
            "/v1/responses/input_tokens",
            post(proxy::responses_input_tokens),
        )
        .route(
            "/v1/responses/{id}",
            get(responses::get).delete(responses::delete),
        )
        .route("/v1/models", get(proxy::models))
        .route_layer(axum::middleware::from_fn_with_state(
            fleet.clone(),
            proxy::authenticate,
        ));
    axum::Router::new()
        .merge(api)
        .route("/health", get(proxy::health))
        .route("/metrics", get(proxy::metrics))
        .fallback(not_routed)
        .method_not_allowed_fallback(kura_api::error::method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(fleet)
}

/// A path the router does not route, as a JSON error that says which it does: saved contexts and
/// `/tokenize` keep state on one replica, so they are sent to it directly.
async fn not_routed(uri: axum::http::Uri) -> kura_api::ApiError {
    kura_api::ApiError::NotFound(format!(
        "{} on the router, which routes /v1/chat/completions, /v1/completions, /v1/messages, \
         /v1/messages/count_tokens, /v1/responses (with /v1/responses/input_tokens and \
         /v1/responses/{{id}}), /v1/models, /health and /metrics (send other routes to a replica)",
        uri.path()
    ))
}

/// Routes on `listener` until `shutdown` resolves; then refuses new connections, lets requests in
/// flight run for the shutdown grace, and closes every connection.
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
    let mut tasks: Vec<_> = (0..fleet.replicas.len())
        .map(|r| tokio::spawn(replica::check_health(fleet.clone(), r)))
        .collect();
    // Without the fleet's secret the replicas' block names mean nothing here: their events are not read.
    if fleet.namer.is_some() {
        tasks.extend(
            (0..fleet.replicas.len())
                .map(|r| tokio::spawn(replica::follow_events(fleet.clone(), r))),
        );
    }
    let (phase_tx, phase_rx) = watch::channel(Phase::Serving);
    let conn = fleet.config.conn.clone();
    let grace = fleet.config.shutdown_grace;
    let mut accept = tokio::spawn(kura_api::accept_loop(listener, app(fleet), conn, phase_rx));
    let ended = tokio::select! {
        _ = shutdown => false,
        _ = &mut accept => true,
    };
    let _ = phase_tx.send(Phase::Draining);
    if !ended && tokio::time::timeout(grace, &mut accept).await.is_err() {
        tracing::warn!("shutdown grace period over: closing every connection");
        let _ = phase_tx.send(Phase::Closed);
        let _ = accept.await;
    }
    for t in tasks {
        t.abort();
    }
    Ok(())
}

/// Runs [`run`] on its own runtime, bound to `addr`, until Ctrl-C or SIGTERM.
pub fn serve_blocking(addr: &str, config: RouterConfig) -> Result<(), RouterError> {
    // Tokenization holds one blocking thread per permit; a few more for the rest (name resolution).
    let blocking = config.tokenizer_threads.saturating_add(4);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(blocking)
        .thread_name("kura-router")
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        let listener = TcpListener::bind(addr).await?;
        run(listener, config, kura_api::shutdown_signal()).await
    });
    // A tokenization still running must not hold the process.
    runtime.shutdown_background();
    result
}
