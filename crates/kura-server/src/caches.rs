//! `/v1/caches`: saved contexts as resources (create, list, get, change TTL, delete), and
//! `POST /debug/clock`, which moves the cache clock forward when the server runs with `--debug-clock`
//! (operator key only). The store's file I/O runs on the blocking pool, never on the async workers.
//!
//! Creating a context computes its KV at once (a one-token generation over its prompt), pins its blocks
//! until it expires and writes them through to the lower tiers; the reply reports how many tokens were
//! computed and how many were found cached already.

use axum::extract::State;
use axum::{Extension, Json};
use kura_engine::EngineEvent;
use serde_json::{json, Value};

use crate::body::{JsonBody, PathId};
use crate::caching::{self, context_tokens, parse_context_ttl, ContextKind, SavedContext};
use crate::error::ApiError;
use crate::output::Events;
use crate::types::RequestMessage;
use crate::{handlers, validate, AppState};
use kura_api::Tenant;

/// Default time to live of a saved context: one hour.
const DEFAULT_TTL_S: u64 = 3600;
/// Longest step of `POST /debug/clock`: ten years.
const MAX_CLOCK_STEP_S: u64 = 10 * 365 * 24 * 3600;
/// Furthest the cache clock may go (about 1,000 years of milliseconds): far from `u64::MAX`, so that
/// expiry times a year past it never saturate.
const MAX_CLOCK_MS: u64 = 1000 * 365 * 24 * 3600 * 1000;

/// The fields `POST /v1/caches` reads (`tools`, `cached_content` and `cache_salt` to refuse them by
/// name).
const CREATE_FIELDS: [&str; 8] = [
    "cache_salt",
    "cached_content",
    "display_name",
    "messages",
    "model",
    "prompt",
    "tools",
    "ttl",
];

pub async fn create(
    State(s): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    JsonBody(value): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let info = s.engine.info().clone();
    let o = value.as_object().expect("JsonBody is an object");
    // A field this route does not read is refused by name, as on the generation routes.
    kura_api::body::known_fields(o, &[&CREATE_FIELDS], "caches")?;
    // Fields of the generation routes that a context would otherwise drop without a word.
    for (field, why) in [
        (
            "tools",
            "tools are not saved with a context: send them with each request that uses it",
        ),
        (
            "cached_content",
            "a context cannot start from another saved context: save the whole text",
        ),
        (
            "cache_salt",
            "a saved context's KV belongs to its API key, not to a salt",
        ),
    ] {
        if o.get(field).is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid(why, Some(field)));
        }
    }
    if let Some(m) = o.get("model").filter(|v| !v.is_null()) {
        match m.as_str() {
            Some(m) => validate::check_model(m, &info.model_name)?,
            None => return Err(ApiError::invalid("model must be a string", Some("model"))),
        }
    }
    let kind = match (
        o.get("messages").filter(|v| !v.is_null()),
        o.get("prompt").filter(|v| !v.is_null()),
    ) {
        (Some(m), None) => {
            // Read as chat reads them, so that an error names the message and field (`messages[0].role`).
            #[derive(serde::Deserialize)]
            struct Messages {
                messages: Vec<RequestMessage>,
            }
            let Messages { messages } =
                kura_api::body::from_value(&serde_json::json!({ "messages": m }))
                    .map_err(|e| e.with_param("messages"))?;
            ContextKind::Messages {
                messages: validate::flatten_messages(&messages)?,
            }
        }
        (None, Some(Value::String(p))) if !p.is_empty() => ContextKind::Prompt { text: p.clone() },
        (None, Some(_)) => {
            return Err(ApiError::invalid(
                "prompt must be a non-empty string",
                Some("prompt"),
            ))
        }
        _ => {
            return Err(ApiError::invalid(
                "give exactly one of messages (chat messages) or prompt (text) to save",
                Some("messages"),
            ))
        }
    };
    let ttl_s = match o.get("ttl").filter(|v| !v.is_null()) {
        Some(v) => parse_context_ttl(v)?,
        None => DEFAULT_TTL_S,
    };
    let display_name = match o.get("display_name").filter(|v| !v.is_null()) {
        Some(Value::String(d)) if d.len() <= 128 => Some(d.clone()),
        Some(_) => {
            return Err(ApiError::invalid(
                "display_name must be a string of at most 128 bytes",
                Some("display_name"),
            ))
        }
        None => None,
    };
    drop(value);
    let engine = s.engine.clone();
    let kind_for_encode = kind.clone();
    let tokens = handlers::off_the_workers(move || {
        context_tokens(engine.codec().as_ref(), &kind_for_encode)
    })
    .await?;
    if tokens.is_empty() {
        return Err(ApiError::invalid(
            "the context to save has no tokens",
            Some("messages"),
        ));
    }
    let now = s.engine.cache_now_ms();
    let salt = kura_api::effective_salt(&tenant, None);
    let per_tenant = s.quotas.contexts;
    {
        let (store, salt) = (s.contexts.clone(), salt.clone());
        handlers::off_the_workers(move || {
            store.expire(now);
            store.check_room(&salt, per_tenant)
        })
        .await?;
    }
    let context = SavedContext::new(&info, salt, display_name, kind, tokens, now, ttl_s);
    let request = context.build_request();
    // Until the context is stored, any way out (an error, the client gone) releases its pin.
    let mut unpin = UnpinOnDrop(Some((
        s.engine.clone(),
        context.tenant.clone(),
        context.tokens.clone(),
    )));
    let (mut events, sender) = Events::new(1, 1);
    let guard = s.engine.submit(request, sender.sink(0))?;
    events.add_guard(guard);
    drop(sender);
    let usage = loop {
        match events.next().await {
            Some(EngineEvent::Done { usage }) => break usage,
            Some(EngineEvent::Failed(e)) => return Err(e.into()),
            Some(_) => {}
            None => {
                return Err(ApiError::Internal(
                    "the engine dropped the request without finishing it".into(),
                ))
            }
        }
    };
    {
        let (store, context) = (s.contexts.clone(), context.clone());
        handlers::off_the_workers(move || store.insert(context, per_tenant)).await?;
    }
    unpin.0 = None;
    tracing::info!(id = %context.id, tokens = context.tokens.len(), ttl_s, "saved context created");
    let mut body = context.to_json();
    body["usage"] = json!({
        "computed_tokens": usage.prompt_tokens.saturating_sub(usage.cached_tokens),
        "cached_tokens": usage.cached_tokens,
        "pinned_tokens": usage.cache_write_tokens.saturating_add(usage.cached_tokens)
            .min(usage.prompt_tokens),
    });
    Ok(Json(body))
}

/// Releases a context's pin when dropped while still armed.
struct UnpinOnDrop(Option<(kura_engine::EngineHandle, Option<String>, Vec<u32>)>);

impl Drop for UnpinOnDrop {
    fn drop(&mut self) {
        if let Some((engine, tenant, tokens)) = self.0.take() {
            engine.release_pin(tenant, tokens);
        }
    }
}

pub async fn list(State(s): State<AppState>, Extension(tenant): Extension<Tenant>) -> Json<Value> {
    let salt = kura_api::effective_salt(&tenant, None);
    let data: Vec<Value> = s
        .contexts
        .list(&salt, s.engine.cache_now_ms())
        .iter()
        .map(SavedContext::to_json)
        .collect();
    Json(json!({"object": "list", "data": data}))
}

pub async fn get(
    State(s): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    PathId(id): PathId,
) -> Result<Json<Value>, ApiError> {
    let salt = kura_api::effective_salt(&tenant, None);
    let c = s.contexts.get(&id, &salt, s.engine.cache_now_ms())?;
    Ok(Json(c.to_json()))
}

pub async fn patch(
    State(s): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    PathId(id): PathId,
    JsonBody(value): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let salt = kura_api::effective_salt(&tenant, None);
    let now = s.engine.cache_now_ms();
    let o = value.as_object().expect("JsonBody is an object");
    if let Some(other) = o.keys().find(|k| k.as_str() != "ttl") {
        return Err(ApiError::invalid(
            format!(
                "only ttl can be changed; {other} is fixed when the context is made (delete it and \
                 save it again)"
            ),
            None,
        ));
    }
    let Some(ttl) = value.get("ttl").filter(|v| !v.is_null()) else {
        return Err(ApiError::invalid(
            "give ttl, the context's new time to live from now",
            Some("ttl"),
        ));
    };
    let ttl_s = parse_context_ttl(ttl)?;
    let store = s.contexts.clone();
    let changed = handlers::off_the_workers(move || {
        store.set_expiry(
            &id,
            &salt,
            now,
            now.saturating_add(ttl_s.saturating_mul(1000)),
        )
    })
    .await?;
    let c = changed.context;
    // A shorter life takes effect at once: the old pin goes, the next use pins to the new expiry.
    // (So too when the change could not be synced: it is in effect.)
    s.engine.release_pin(c.tenant.clone(), c.tokens.clone());
    if let Some(e) = changed.not_durable {
        return Err(e);
    }
    Ok(Json(c.to_json()))
}

pub async fn delete(
    State(s): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    PathId(id): PathId,
) -> Result<Json<Value>, ApiError> {
    let salt = kura_api::effective_salt(&tenant, None);
    let (store, now) = (s.contexts.clone(), s.engine.cache_now_ms());
    let changed = handlers::off_the_workers(move || store.delete(&id, &salt, now)).await?;
    let c = changed.context;
    s.engine.release_pin(c.tenant.clone(), c.tokens.clone());
    if let Some(e) = changed.not_durable {
        return Err(e);
    }
    Ok(Json(
        json!({"id": c.id, "object": "cached_content.deleted", "deleted": true}),
    ))
}

/// `POST /debug/clock {"advance_s": N}`: moves the cache clock N seconds forward (pins and saved
/// contexts expire as if that time had passed). Only routed under `--debug-clock`.
pub async fn advance_clock(
    State(s): State<AppState>,
    JsonBody(value): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let Some(seconds) = value
        .get("advance_s")
        .and_then(Value::as_u64)
        .filter(|&n| n <= MAX_CLOCK_STEP_S)
    else {
        return Err(ApiError::invalid(
            format!("advance_s must be an integer number of seconds from 0 to {MAX_CLOCK_STEP_S}"),
            Some("advance_s"),
        ));
    };
    // The clock may never come near the end of its range, where expiry times would saturate.
    if s.engine.cache_now_ms() > MAX_CLOCK_MS - seconds * 1000 {
        return Err(ApiError::invalid(
            "the cache clock is as far forward as it may go",
            Some("advance_s"),
        ));
    }
    let now = s.engine.advance_cache_clock(seconds * 1000);
    let store = s.contexts.clone();
    handlers::off_the_workers(move || {
        store.expire(now);
        Ok(())
    })
    .await?;
    Ok(Json(json!({"now_ms": now})))
}

/// Tokens of a completions prompt after a saved context: for a text context, the two texts tokenized as
/// one (kept to the context's own tokens at the seam); for a messages context, the context's tokens
/// followed by the prompt's (without the tokens the tokenizer puts before any text, such as BOS).
pub fn completion_tokens(
    codec: &dyn kura_engine::TextCodec,
    context: &SavedContext,
    prompt: &str,
) -> Result<Vec<u32>, ApiError> {
    let encode = |t: &str| codec.encode(t).map_err(kura_api::validate::tokenize_error);
    match &context.kind {
        ContextKind::Prompt { text } => Ok(caching::join_prefix(
            &context.tokens,
            encode(&format!("{text}{prompt}"))?,
        )),
        ContextKind::Messages { .. } => {
            let lead = encode("")?.len();
            let own = encode(prompt)?;
            let mut tokens = context.tokens.clone();
            tokens.extend_from_slice(own.get(lead..).unwrap_or_default());
            Ok(tokens)
        }
    }
}
