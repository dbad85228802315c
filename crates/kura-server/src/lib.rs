//! `kura-server` — Kura's OpenAI-compatible HTTP API (axum + tokio) in front of a
//! [`kura_engine::EngineHandle`].
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE), `GET /v1/models`,
//! `POST /tokenize`, `GET /health`, `GET /metrics` (Prometheus text). Async lives here and nowhere
//! deeper: a handler validates and tokenizes, submits to the engine with a sink that forwards events
//! into a tokio channel, and either collects them or streams them. Dropping the response (client gone)
//! drops the engine's request guard, which frees the request's KV blocks at once.

mod error;
mod output;
mod types;
mod validate;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{header, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use kura_engine::{EngineHandle, GenerateRequest};
use serde::de::DeserializeOwned;
use tokio::net::TcpListener;

pub use error::ApiError;
use output::{ResponseMeta, Shape};
use types::*;

/// Server settings that are not the engine's.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Accepted bearer keys; empty = no authentication. Each key is its own tenant: requests of
    /// different keys never share cached KV blocks.
    pub api_keys: Vec<String>,
    /// Largest accepted request body; larger ones get 413.
    pub max_body_bytes: usize,
    /// After a shutdown signal, how long in-flight requests may run before they are cancelled.
    pub shutdown_grace: Duration,
    /// Longest a request may take from arrival to its last token; past it, it is cancelled (its KV
    /// blocks freed) and the client gets 504 (or an error event in a stream). `None`: no limit.
    pub request_timeout: Option<Duration>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            api_keys: Vec::new(),
            max_body_bytes: 8 * 1024 * 1024,
            shutdown_grace: Duration::from_secs(30),
            request_timeout: None,
        }
    }
}

#[derive(Clone)]
struct AppState {
    engine: EngineHandle,
    api_keys: Arc<Vec<String>>,
    max_body_bytes: usize,
    request_timeout: Option<Duration>,
    started: u64,
}

/// Which API key a request authenticated with (index into the configured keys), if keys are configured.
#[derive(Debug, Clone, Copy)]
struct Tenant(Option<usize>);

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The router of every route, with authentication and the body limit applied.
pub fn router(engine: EngineHandle, config: &ServerConfig) -> Router {
    let state = AppState {
        engine,
        api_keys: Arc::new(config.api_keys.clone()),
        max_body_bytes: config.max_body_bytes,
        request_timeout: config.request_timeout,
        started: unix_now(),
    };
    let api = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(config.max_body_bytes))
        .with_state(state)
}

/// Serves until `shutdown` resolves, then refuses new requests, gives in-flight ones
/// `config.shutdown_grace` to finish, cancels the rest and returns once every connection is closed.
pub async fn serve(
    listener: TcpListener,
    engine: EngineHandle,
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(engine.clone(), &config);
    let grace = config.shutdown_grace;
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown.await;
            tracing::info!(
                grace_s = grace.as_secs_f64(),
                "shutting down: refusing new requests, letting in-flight ones finish"
            );
            engine.begin_shutdown();
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                tracing::warn!("shutdown grace period over: cancelling the remaining requests");
                engine.abort_all();
            });
        })
        .await
}

/// Runs [`serve`] on its own tokio runtime, bound to `addr`, until Ctrl-C or SIGTERM.
pub fn serve_blocking(
    addr: &str,
    engine: EngineHandle,
    config: ServerConfig,
) -> std::io::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kura-http")
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let listener = TcpListener::bind(addr).await?;
        tracing::info!("serving the OpenAI API on http://{addr}/v1");
        serve(listener, engine, config, shutdown_signal()).await
    })
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
}

/// Constant-time comparison, so that response timing does not reveal how much of a key matched.
fn same_key(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

async fn authenticate(
    State(s): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let tenant = if s.api_keys.is_empty() {
        Tenant(None)
    } else {
        let presented = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, key) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then_some(key.trim())
            });
        match presented.and_then(|k| s.api_keys.iter().position(|x| same_key(x, k))) {
            Some(i) => Tenant(Some(i)),
            None => return Err(ApiError::Unauthorized),
        }
    };
    req.extensions_mut().insert(tenant);
    Ok(next.run(req).await)
}

/// A JSON body parsed with OpenAI-shaped errors: 413 past the limit, 400 naming the field otherwise.
struct JsonBody<T>(T);

/// Friendlier wording for the untagged unions, whose serde message names only the Rust type.
fn shape_hint(path: &str) -> Option<&'static str> {
    match path {
        "prompt" => Some(
            "prompt must be a string, an array of token ids, or a one-element array of either",
        ),
        "stop" => Some("stop must be a string or an array of strings"),
        p if p.starts_with("messages") && p.ends_with("content") => Some(
            "message content must be a string or an array of {\"type\": \"text\", \"text\": ...} parts",
        ),
        _ => None,
    }
}

/// serde names Rust types ("expected i64"); clients think in JSON types.
fn json_type_names(message: &str) -> String {
    let mut m = message.to_string();
    for (rust, json) in [
        ("expected i64", "expected an integer"),
        ("expected i32", "expected an integer"),
        ("expected u32", "expected a non-negative integer"),
        ("expected f32", "expected a number"),
        ("expected a sequence", "expected an array"),
        ("expected a boolean", "expected true or false"),
    ] {
        m = m.replace(rust, json);
    }
    m
}

fn parse_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    let message = match inner.classify() {
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
            format!("the request body is not valid JSON: {inner}")
        }
        _ if path == "." => format!("invalid request body: {inner}"),
        _ => match shape_hint(&path) {
            Some(hint) => format!("invalid value for `{path}`: {hint}"),
            None => format!(
                "invalid value for `{path}`: {}",
                json_type_names(&inner.to_string())
            ),
        },
    };
    ApiError::invalid(message, None)
}

fn from_value<T: DeserializeOwned>(value: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(parse_error)
}

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::BodyTooLarge {
                    limit_bytes: state.max_body_bytes,
                }
            } else {
                ApiError::invalid(
                    format!("could not read the request body: {}", rejection.body_text()),
                    None,
                )
            }
        })?;
        let mut de = serde_json::Deserializer::from_slice(&bytes);
        let value: serde_json::Value =
            serde_path_to_error::deserialize(&mut de).map_err(parse_error)?;
        if !value.is_object() {
            return Err(ApiError::invalid(
                "the request body must be a JSON object",
                None,
            ));
        }
        from_value(&value).map(JsonBody)
    }
}

/// A generation request body: the endpoint's own fields and the shared ones, from one JSON object.
struct ApiRequest<T> {
    common: CommonParams,
    own: T,
}

impl<T: DeserializeOwned> FromRequest<AppState> for ApiRequest<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let JsonBody(value) = JsonBody::<serde_json::Value>::from_request(req, state).await?;
        Ok(ApiRequest {
            common: from_value(&value)?,
            own: from_value(&value)?,
        })
    }
}

/// The engine's cache salt for a request: the tenant's key (when keys are configured) and the
/// request's own `cache_salt`, so that neither tenants nor salts ever share blocks.
fn effective_salt(tenant: Tenant, salt: Option<String>) -> Option<String> {
    match (tenant.0, salt) {
        (None, salt) => salt,
        (Some(t), None) => Some(format!("key{t}")),
        (Some(t), Some(s)) => Some(format!("key{t}\u{1f}{s}")),
    }
}

fn encode(engine: &EngineHandle, text: &str) -> Result<Vec<u32>, ApiError> {
    engine.codec().encode(text).map_err(|e| {
        ApiError::invalid(
            format!("could not tokenize the prompt: {e}"),
            Some("prompt"),
        )
    })
}

/// Default `max_tokens` when the client gives none: whatever fits in the context and in the pool.
fn remaining_tokens(engine: &EngineHandle, prompt_len: usize) -> u32 {
    let info = engine.info();
    let pool_tokens = info.num_blocks * info.block_size_tokens;
    let room = info
        .max_model_len
        .min(pool_tokens)
        .saturating_sub(prompt_len);
    room.clamp(1, u32::MAX as usize) as u32
}

async fn start(
    s: &AppState,
    request: GenerateRequest,
    meta: ResponseMeta,
    stream: bool,
    include_usage: bool,
) -> Result<Response, ApiError> {
    let n = request.n;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let guard = s
        .engine
        .submit(request, move |event| tx.send(event).is_ok())?;
    let deadline = s
        .request_timeout
        .map(|t| (tokio::time::Instant::now() + t, t.as_secs()));
    if stream {
        let events = output::sse_stream(meta, n, include_usage, rx, guard, deadline);
        Ok(Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response())
    } else {
        let body = output::collect(&meta, n, rx, guard);
        let body = match deadline {
            // On timeout the collecting future is dropped with the guard: the request is cancelled.
            Some((at, seconds)) => tokio::time::timeout_at(at, body)
                .await
                .map_err(|_| ApiError::Timeout { seconds })??,
            None => body.await?,
        };
        Ok(Json(body).into_response())
    }
}

fn response_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}-{:x}{nanos:08x}",
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

async fn completions(
    State(s): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    ApiRequest { common, own: req }: ApiRequest<CompletionRequest>,
) -> Result<Response, ApiError> {
    let model = s.engine.info().model_name.clone();
    let user = common.user.clone();
    let checked = validate::check_common(&common, &model, common.max_tokens, "max_tokens")?;
    if req.echo {
        return Err(ApiError::invalid(
            "echo is not supported by this server",
            Some("echo"),
        ));
    }
    if req.suffix.as_deref().is_some_and(|x| !x.is_empty()) {
        return Err(ApiError::invalid(
            "suffix is not supported by this server",
            Some("suffix"),
        ));
    }
    if let Some(b) = req.best_of {
        if b != checked.n as i64 {
            return Err(ApiError::invalid(
                format!(
                    "best_of must equal n ({}) on this server, got {b}",
                    checked.n
                ),
                Some("best_of"),
            ));
        }
    }
    let logprobs = validate::check_logprobs("logprobs", req.logprobs)?;
    let prompt_tokens = match req.prompt {
        Prompt::Text(t) => encode(&s.engine, &t)?,
        Prompt::Tokens(t) => t,
        Prompt::TextBatch(v) if v.len() == 1 => encode(&s.engine, &v[0])?,
        Prompt::TokensBatch(mut v) if v.len() == 1 => v.swap_remove(0),
        Prompt::TextBatch(v) => return Err(one_prompt(v.len())),
        Prompt::TokensBatch(v) => return Err(one_prompt(v.len())),
    };
    // OpenAI's default for the legacy endpoint.
    let max_tokens = checked.max_tokens.unwrap_or(16);
    let (stream, include_usage) = (checked.stream, checked.include_usage);
    let mut request = checked.into_request(prompt_tokens, max_tokens, logprobs);
    request.cache_salt = effective_salt(tenant, request.cache_salt);
    tracing::debug!(user = ?user, prompt_tokens = request.prompt_tokens.len(), max_tokens, "request");
    let meta = ResponseMeta {
        id: response_id("cmpl"),
        created: unix_now(),
        model,
        shape: Shape::Completion,
        logprobs: logprobs.is_some(),
    };
    start(&s, request, meta, stream, include_usage).await
}

fn one_prompt(got: usize) -> ApiError {
    ApiError::invalid(
        format!(
            "this server takes one prompt per request, got {got}; send them as separate requests"
        ),
        Some("prompt"),
    )
}

async fn chat_completions(
    State(s): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    ApiRequest { common, own: req }: ApiRequest<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let model = s.engine.info().model_name.clone();
    let user = common.user.clone();
    let checked = match req.max_completion_tokens {
        Some(m) => validate::check_common(&common, &model, Some(m), "max_completion_tokens")?,
        None => validate::check_common(&common, &model, common.max_tokens, "max_tokens")?,
    };
    let top = validate::check_logprobs("top_logprobs", req.top_logprobs)?;
    let logprobs = match (req.logprobs, top) {
        (true, top) => Some(top.unwrap_or(0)),
        (false, None) => None,
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs requires logprobs to be true",
                Some("top_logprobs"),
            ))
        }
    };
    let messages = validate::flatten_messages(&req.messages)?;
    let text = s.engine.codec().render_chat(&messages).map_err(|e| {
        ApiError::invalid(
            format!("could not apply the chat template: {e}"),
            Some("messages"),
        )
    })?;
    let prompt_tokens = encode(&s.engine, &text)?;
    let max_tokens = checked
        .max_tokens
        .unwrap_or_else(|| remaining_tokens(&s.engine, prompt_tokens.len()));
    let (stream, include_usage) = (checked.stream, checked.include_usage);
    let mut request = checked.into_request(prompt_tokens, max_tokens, logprobs);
    request.cache_salt = effective_salt(tenant, request.cache_salt);
    tracing::debug!(user = ?user, prompt_tokens = request.prompt_tokens.len(), max_tokens, "request");
    let meta = ResponseMeta {
        id: response_id("chatcmpl"),
        created: unix_now(),
        model,
        shape: Shape::Chat,
        logprobs: logprobs.is_some(),
    };
    start(&s, request, meta, stream, include_usage).await
}

async fn tokenize(
    State(s): State<AppState>,
    JsonBody(req): JsonBody<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let text = match (req.prompt, req.messages) {
        (Some(p), None) => p,
        (None, Some(m)) => {
            let messages = validate::flatten_messages(&m)?;
            s.engine.codec().render_chat(&messages).map_err(|e| {
                ApiError::invalid(
                    format!("could not apply the chat template: {e}"),
                    Some("messages"),
                )
            })?
        }
        _ => {
            return Err(ApiError::invalid(
                "give exactly one of prompt (a string) or messages",
                Some("prompt"),
            ))
        }
    };
    let tokens = encode(&s.engine, &text)?;
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        tokens,
        max_model_len: s.engine.info().max_model_len,
    }))
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

async fn health(State(s): State<AppState>) -> Response {
    if s.engine.is_shutting_down() {
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
        s.engine.metrics().render_prometheus(),
    )
        .into_response()
}

async fn method_not_allowed(method: axum::http::Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed(format!("{method} {}", uri.path()))
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::NotFound(uri.path().to_string())
}
