//! `kura-server` — `kura serve`'s HTTP server (axum + tokio, on `kura_api`'s connection layer) in front of
//! a [`kura_engine::EngineHandle`]: the routes, saved contexts ([`caching`]), the KV event stream and the
//! metrics page. What a request means (bodies, validation, errors, keys) is `kura-api`'s.
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE), `POST /v1/messages`
//! (Anthropic), `POST/GET /v1/caches`, `GET/PATCH/DELETE /v1/caches/{id}`, `GET /v1/models`,
//! `GET /v1/models/{model}`, `POST /v1/responses`, `GET/DELETE /v1/responses/{id}`,
//! `POST /tokenize` (tenant keys); `GET /v1/kv/snapshot`, `GET /v1/kv/events`, `POST /debug/clock`
//! (the operator key only, and routed only when there is one); `GET /health`, `GET /metrics`
//! (Prometheus text). Async lives here and nowhere deeper: a handler validates, tokenizes on the
//! blocking pool, submits to the engine with a sink that forwards events into a tokio channel, and
//! either collects them or streams them. Dropping the response (client gone, connection closed) drops
//! the engine's request guard, which frees the request's KV blocks at once.
//!
//! Life cycle ([`serve`]): serving → a shutdown signal or the engine's death → draining (no new
//! connections or requests; in-flight ones may finish for the grace period) → closed (every remaining
//! request cancelled, every connection closed) → return. The engine's death is an error, so that the
//! process exits non-zero and a supervisor restarts it.

mod body;
mod caches;
pub mod caching;
mod console;
mod guided;
mod handlers;
mod kv_events;
mod messages;
mod output;
mod responses;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kura_engine::EngineHandle;
use tokio::net::TcpListener;
use tokio::sync::watch;

// The API's bodies, validation, errors, keys and connection layer are `kura-api`'s.
/// The types of [`ServerConfig`]'s fields that are `kura-api`'s.
pub use kura_api::reasoning::ReasoningParser;
use kura_api::routing::Endpoint;
use kura_api::{
    accept_loop, error, presented_keys, same_key, shutdown_signal, types, validate, ApiError,
    Phase, Tenant,
};
pub use kura_api::{ConnLimits, TenantNamer};
use types::*;

/// Server settings that are not the engine's.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Accepted bearer keys; empty = no authentication. Each key is its own tenant: requests of
    /// different keys never share cached KV blocks.
    pub api_keys: Vec<String>,
    /// The operator's keys, for `/v1/kv/*` and `/debug/*` (tenant keys get 403 there); empty: those
    /// routes are off.
    pub admin_keys: Vec<String>,
    /// How API keys become tenant names (a keyed digest; the same secret names a key's tenant alike
    /// across restarts and across a fleet).
    pub tenants: TenantNamer,
    /// Limits each tenant has on its own, so that one cannot exhaust what another needs.
    pub quotas: TenantQuotas,
    /// Largest accepted request body; larger ones get 413.
    pub max_body_bytes: usize,
    /// Longest time to receive a whole request body once its head has arrived; slower ones get 408.
    pub body_timeout: Duration,
    /// After a shutdown signal, how long in-flight requests may run before they are cancelled.
    pub shutdown_grace: Duration,
    /// Longest a request may take from arrival to its last token; past it, it is cancelled (its KV
    /// blocks freed) and the client gets 504 (or an error event in a stream). `None`: no limit.
    pub request_timeout: Option<Duration>,
    /// Whether requests may set `priority` (`--scheduling-policy priority`).
    pub priority_scheduling: bool,
    /// Connection limits and timeouts.
    pub conn: ConnLimits,
    /// Saved contexts (`/v1/caches`); `None`: kept in memory only.
    pub contexts: Option<Arc<caching::ContextStore>>,
    /// Route `POST /debug/clock` (operator key only), which moves the cache clock forward (for tests of
    /// expiry).
    pub debug_clock: bool,
    /// Route the console (`/console` and `GET /v1/kv/summary`): behind the operator key when there is
    /// one, open when there are no keys at all, and never with tenant keys only.
    pub console: bool,
    /// Most log-probabilities all non-streamed responses in progress may hold together (each holds
    /// its own until its request ends); a request that would pass it gets 429, and one that needs more
    /// alone gets 400. At least 1.
    pub max_held_logprobs: u64,
    /// Whether chat answers are read for a reasoning model's `<think>` text
    /// (`--reasoning-parser`; by default when the chat template spells `<think>`).
    pub reasoning_parser: ReasoningParser,
    /// Whether a chat request may bring its own `chat_template` (`--trust-request-chat-template`).
    pub trust_request_chat_template: bool,
}

/// What each tenant may hold at once. (Pins need no quota: when the pin budget is full, the tenant
/// holding the most pinned blocks gives way, see `kura_engine`'s pins.)
#[derive(Debug, Clone)]
pub struct TenantQuotas {
    /// Saved contexts (`/v1/caches`) per tenant.
    pub contexts: usize,
    /// Open KV event streams (operator only; a cap, so that streams cannot fill the connection limit).
    pub event_streams: usize,
}

impl Default for TenantQuotas {
    fn default() -> Self {
        Self {
            contexts: 1000,
            event_streams: 16,
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            api_keys: Vec::new(),
            admin_keys: Vec::new(),
            tenants: TenantNamer::new(&kura_kv::Secret::random()),
            quotas: TenantQuotas::default(),
            max_body_bytes: 8 * 1024 * 1024,
            body_timeout: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(30),
            request_timeout: None,
            priority_scheduling: false,
            conn: ConnLimits::default(),
            contexts: None,
            debug_clock: false,
            console: false,
            max_held_logprobs: validate::DEFAULT_SERVER_HELD_LOGPROBS,
            reasoning_parser: ReasoningParser::Auto,
            trust_request_chat_template: false,
        }
    }
}

#[derive(Clone)]
struct AppState {
    engine: EngineHandle,
    /// Each accepted key with its tenant name (computed once, not per request).
    api_keys: Arc<Vec<(String, Arc<str>)>>,
    admin_keys: Arc<Vec<String>>,
    quotas: Arc<TenantQuotas>,
    /// Open KV event streams.
    event_streams: Arc<std::sync::atomic::AtomicUsize>,
    max_body_bytes: usize,
    body_timeout: Duration,
    request_timeout: Option<Duration>,
    priority_scheduling: bool,
    started: u64,
    contexts: Arc<caching::ContextStore>,
    /// This process's name in KV snapshots (a reader that sees it change knows the replica restarted).
    instance: Arc<str>,
    /// The model's vocabulary for structured outputs, built on first use.
    guides: guided::GuidesCell,
    /// Stored responses of `/v1/responses`.
    responses: Arc<responses::ResponseStore>,
    /// The log-probabilities non-streamed responses in progress hold ([`ServerConfig::max_held_logprobs`]
    /// permits; each such request holds its count until its response is built or it is dropped).
    held_logprobs: Arc<tokio::sync::Semaphore>,
    max_held_logprobs: u64,
    /// Whether chat answers are read for reasoning ([`ServerConfig::reasoning_parser`] with this
    /// model's chat template).
    reasoning: bool,
    request_chat_templates: bool,
}

impl AppState {
    /// The most log-probabilities one non-streamed response may hold here.
    fn held_logprobs_limit(&self) -> u64 {
        self.max_held_logprobs.min(validate::MAX_HELD_LOGPROBS)
    }

    fn ctx(&self) -> validate::Ctx<'_> {
        validate::Ctx {
            served_model: &self.engine.info().model_name,
            priority_scheduling: self.priority_scheduling,
            request_chat_templates: self.request_chat_templates,
        }
    }
}

/// The permits of the semaphore that bounds held log-probabilities: `max`, at least 1 and at most the
/// semaphore's own maximum (2^61 on 64-bit targets, 2^29 on 32-bit ones).
fn held_logprobs_permits(max: u64) -> usize {
    usize::try_from(max)
        .unwrap_or(usize::MAX)
        .clamp(1, tokio::sync::Semaphore::MAX_PERMITS)
}

/// A name for this process that a restart changes: its id and start time.
fn instance_name() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{:08x}-{nanos:x}", std::process::id())
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The router of every route, with authentication and the body limit applied.
pub fn router(engine: EngineHandle, config: &ServerConfig) -> Router {
    let held_permits = held_logprobs_permits(config.max_held_logprobs);
    let reasoning = config
        .reasoning_parser
        .reads(engine.codec().chat_template_source());
    if reasoning {
        tracing::info!(
            parser = ?config.reasoning_parser,
            "chat answers' <think> text is read as reasoning (--reasoning-parser none turns it off)"
        );
    }
    let state = AppState {
        engine,
        api_keys: Arc::new(
            config
                .api_keys
                .iter()
                .map(|k| (k.clone(), config.tenants.tenant_of_key(k)))
                .collect(),
        ),
        admin_keys: Arc::new(config.admin_keys.clone()),
        quotas: Arc::new(config.quotas.clone()),
        event_streams: Arc::default(),
        max_body_bytes: config.max_body_bytes,
        body_timeout: config.body_timeout,
        request_timeout: config.request_timeout,
        priority_scheduling: config.priority_scheduling,
        started: unix_now(),
        contexts: config
            .contexts
            .clone()
            .unwrap_or_else(|| Arc::new(caching::ContextStore::in_memory())),
        instance: instance_name().into(),
        guides: Arc::default(),
        responses: Arc::default(),
        held_logprobs: Arc::new(tokio::sync::Semaphore::new(held_permits)),
        max_held_logprobs: held_permits as u64,
        reasoning,
        request_chat_templates: config.trust_request_chat_template,
    };
    let api = Router::new()
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/chat/completions", post(handlers::chat_completions))
        .route("/v1/messages", post(messages::messages))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/input_tokens", post(responses::input_tokens))
        .route(
            "/v1/responses/{id}",
            get(responses::get).delete(responses::delete),
        )
        .route("/v1/caches", post(caches::create).get(caches::list))
        .route(
            "/v1/caches/{id}",
            get(caches::get).patch(caches::patch).delete(caches::delete),
        )
        .route("/v1/models", get(models))
        .route("/v1/models/{model}", get(model))
        .route("/tokenize", post(handlers::tokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate));
    // The console: for the operator key when there is one; open on a server without keys; off on a
    // server with tenant keys only.
    let console = Router::new()
        .route("/console", get(console::index))
        .route("/console/console.js", get(console::script))
        .route("/console/console.css", get(console::style))
        .route("/v1/kv/summary", get(console::summary));
    let console = match (
        config.console,
        config.admin_keys.is_empty(),
        config.api_keys.is_empty(),
    ) {
        (true, false, _) => Some(console.route_layer(middleware::from_fn_with_state(
            state.clone(),
            authorize_operator,
        ))),
        (true, true, true) => Some(console),
        _ => None,
    };
    // Operator routes: off without an operator key, and for the operator key only.
    let mut operator = Router::new();
    if !config.admin_keys.is_empty() {
        operator = operator
            .route("/v1/kv/snapshot", get(kv_events::snapshot))
            .route("/v1/kv/events", get(kv_events::events));
        if config.debug_clock {
            operator = operator.route("/debug/clock", post(caches::advance_clock));
        }
        operator = operator.route_layer(middleware::from_fn_with_state(
            state.clone(),
            authorize_operator,
        ));
    }
    let mut app = Router::new().merge(api).merge(operator);
    if let Some(console) = console {
        app = app.merge(console);
    }
    app.route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(kura_api::error::method_not_allowed)
        .layer(DefaultBodyLimit::max(config.max_body_bytes))
        .with_state(state)
}

/// Why [`serve`] returned with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("the inference engine failed: {0}")]
    EngineFailed(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Serves until `shutdown` resolves or the engine dies, then refuses new requests, gives in-flight
/// ones `config.shutdown_grace` to finish, cancels the rest, closes every connection and returns (an
/// error when the engine died).
pub async fn serve(
    listener: TcpListener,
    engine: EngineHandle,
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let app = router(engine.clone(), &config);
    // Saved contexts past their expiry are dropped, and their files removed, on the blocking pool.
    let expiry = config.contexts.clone().map(|store| {
        let engine = engine.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                let (store, now) = (store.clone(), engine.cache_now_ms());
                let _ = tokio::task::spawn_blocking(move || store.expire(now)).await;
            }
        })
    });
    let (phase_tx, phase_rx) = watch::channel(Phase::Serving);
    let accept = tokio::spawn(accept_loop(listener, app, config.conn.clone(), phase_rx));
    let died = {
        let engine = engine.clone();
        async move {
            // The engine thread marks its death in the handle; a look every 100 ms is one atomic load.
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                if let Some(message) = engine.failure() {
                    return Some(message);
                }
            }
        }
    };
    let failure = tokio::select! {
        _ = shutdown => None,
        failure = died => failure,
    };
    let grace = match &failure {
        Some(message) => {
            // Every request in flight has failed with the engine's message: a short grace lets their
            // answers (the error, a stream's error event) be written before the connections close,
            // where closing at once would reset them unanswered.
            tracing::error!(error = %message, "the engine failed: answering the requests in flight with its error, then exiting");
            config.shutdown_grace.min(ENGINE_FAILED_GRACE)
        }
        None => {
            tracing::info!(
                grace_s = config.shutdown_grace.as_secs_f64(),
                "shutting down: refusing new requests, letting in-flight ones finish"
            );
            config.shutdown_grace
        }
    };
    engine.begin_shutdown();
    let _ = phase_tx.send(Phase::Draining);
    let mut accept = accept;
    let drained = tokio::time::timeout(grace, &mut accept).await.is_ok();
    if !drained {
        tracing::warn!("shutdown grace period over: cancelling the remaining requests and closing every connection");
        engine.abort_all();
        let _ = phase_tx.send(Phase::Closed);
        let _ = accept.await;
    }
    if let Some(task) = expiry {
        task.abort();
    }
    match failure {
        Some(message) => Err(ServeError::EngineFailed(message)),
        None => Ok(()),
    }
}

/// Longest wait, once the engine has failed, for the answers of the requests in flight (each has failed
/// with the engine's message) before every connection is closed.
const ENGINE_FAILED_GRACE: Duration = Duration::from_secs(2);

/// Runs [`serve`] on its own tokio runtime, bound to `addr`, until Ctrl-C or SIGTERM (or the engine's
/// death). `blocking_threads` bounds the pool that tokenizes prompts.
pub fn serve_blocking(
    addr: &str,
    engine: EngineHandle,
    config: ServerConfig,
    blocking_threads: usize,
) -> Result<(), ServeError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(blocking_threads.max(1))
        .thread_name("kura-http")
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        let listener = TcpListener::bind(addr).await?;
        let bound = listener.local_addr()?;
        tracing::info!("serving the OpenAI API on http://{bound}/v1");
        serve(listener, engine, config, shutdown_signal()).await
    });
    // Tokenizer tasks still running on the blocking pool must not hold the process.
    runtime.shutdown_background();
    result
}

async fn authenticate(
    State(s): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let tenant = if s.api_keys.is_empty() {
        Tenant(None)
    } else {
        let [bearer, x_api_key] = presented_keys(req.headers());
        let known =
            |k: Option<&str>| k.and_then(|k| s.api_keys.iter().find(|(x, _)| same_key(x, k)));
        let found = known(bearer)
            .or_else(|| known(x_api_key))
            .map(|(_, tenant)| tenant.clone());
        match found {
            Some(tenant) => Tenant(Some(tenant)),
            None => {
                // The operator's key names no tenant: said so, rather than called invalid.
                let operator = [bearer, x_api_key]
                    .into_iter()
                    .flatten()
                    .any(|k| s.admin_keys.iter().any(|a| same_key(a, k)));
                let path = req.uri().path();
                let refused = if operator {
                    ApiError::TenantOnly(path.to_string())
                } else {
                    ApiError::Unauthorized
                };
                // Anthropic's routes answer in Anthropic's shape, their refusals too.
                let anthropic = [Endpoint::Messages, Endpoint::MessagesCountTokens]
                    .iter()
                    .any(|e| e.path() == path);
                if anthropic {
                    return Ok(kura_api::AnthropicError(refused).into_response());
                }
                return Err(refused);
            }
        }
    };
    req.extensions_mut().insert(tenant);
    req.extensions_mut()
        .insert(output::Arrival(tokio::time::Instant::now()));
    Ok(next.run(req).await)
}

/// Lets the operator's key through; a tenant's key gets 403, anything else 401.
async fn authorize_operator(
    State(s): State<AppState>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let presented = presented_keys(req.headers());
    let presents = |key: &String| presented.iter().flatten().any(|k| same_key(key, k));
    if s.admin_keys.iter().any(presents) {
        Ok(next.run(req).await)
    } else if s.api_keys.iter().any(|(key, _)| presents(key)) {
        Err(ApiError::Forbidden(req.uri().path().to_string()))
    } else {
        Err(ApiError::Unauthorized)
    }
}

async fn models(State(s): State<AppState>) -> Json<ModelList> {
    let info = s.engine.info();
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: info.model_name.clone(),
            object: "model",
            created: s.started,
            owned_by: "kura",
            max_model_len: info.max_model_len,
        }],
    })
}

/// `GET /v1/models/{model}`: the served model's card (what `client.models.retrieve()` reads).
async fn model(
    State(s): State<AppState>,
    crate::body::PathId(id): crate::body::PathId,
) -> Result<Json<ModelCard>, ApiError> {
    let info = s.engine.info();
    validate::check_model(&id, &info.model_name)?;
    Ok(Json(ModelCard {
        id: info.model_name.clone(),
        object: "model",
        created: s.started,
        owned_by: "kura",
        max_model_len: info.max_model_len,
    }))
}

async fn health(State(s): State<AppState>) -> Response {
    if let Some(message) = s.engine.failure() {
        ApiError::EngineFailed(message).into_response()
    } else if s.engine.is_shutting_down() {
        ApiError::ShuttingDown.into_response()
    } else {
        (StatusCode::OK, "ok\n").into_response()
    }
}

async fn metrics(State(s): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.engine.metrics().render_prometheus() + &s.guides.render_prometheus(),
    )
        .into_response()
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::NotFound(uri.path().to_string())
}
