//! `POST /v1/messages`: Anthropic's Messages API over the same engine, with `cache_control`
//! breakpoints.
//!
//! A request's `system` (a string or text blocks) and `messages` (text blocks) become chat messages for
//! the model's template. A block with `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` is a
//! breakpoint: the prompt's tokens up to the end of that block are pinned for the TTL once the prompt is
//! computed (the engine's [`kura_engine::PinSpec`]), and a later request with the same prefix refreshes
//! the pin. A top-level `cache_control` puts a breakpoint at the end of the last message. Usage reports
//! Anthropic's split: `cache_read_input_tokens` (prompt tokens served from the cache),
//! `cache_creation_input_tokens` (tokens of the breakpoints' prefixes this request computed and wrote)
//! and `input_tokens` (the rest), which add up to the prompt.
//!
//! Errors have Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, and so do the
//! error events of a stream.

use std::convert::Infallible;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures::Stream;
use kura_api::anthropic::{anthropic_body, prepare, AnthropicError};
use kura_api::body;
use kura_api::cache_control::encode_with_breakpoints;
use kura_api::{effective_salt, ApiError, Tenant};
use kura_engine::{EngineEvent, FinishReason, GenerateRequest, PinSpec, Usage};
use serde_json::{json, Value};

use crate::handlers;
use crate::output::Events;
use crate::AppState;

/// The Messages route: Anthropic-shaped errors around [`messages_inner`].
pub async fn messages(
    State(s): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    req: Request,
) -> Response {
    match messages_inner(s, tenant, req).await {
        Ok(r) => r,
        Err(e) => AnthropicError(e).into_response(),
    }
}

async fn messages_inner(s: AppState, tenant: Tenant, req: Request) -> Result<Response, ApiError> {
    body::check_json_content_type(req.headers())?;
    let bytes = body::read_body(req, &s, s.body_timeout, s.max_body_bytes).await?;
    let value = body::parse_json_object(&bytes)?;
    drop(bytes);
    let info = s.engine.info().clone();
    let plan = prepare(&value, &info.model_name)?;
    drop(value);
    let salt = effective_salt(&tenant, None);
    let saved = match &plan.cached_content {
        Some(id) => Some(s.contexts.use_context(id, &salt, &s.engine)?),
        None => None,
    };
    let (messages, breakpoints) = (plan.messages.clone(), plan.breakpoints.clone());
    let engine = s.engine.clone();
    let saved_for_encode = saved.clone();
    let (prompt_tokens, positions) = handlers::off_the_workers(move || {
        encode_with_breakpoints(
            engine.codec().as_ref(),
            &messages,
            &breakpoints,
            saved_for_encode
                .as_ref()
                .map(|c| (&c.kind, c.tokens.as_slice())),
        )
    })
    .await?;
    let now = s.engine.cache_now_ms();
    let mut pins: Vec<PinSpec> = positions
        .iter()
        .zip(&plan.breakpoints)
        .map(|(&tokens, &(_, _, ttl))| PinSpec {
            tokens,
            expires_at_ms: now.saturating_add(ttl.millis()),
            persist: false,
        })
        .collect();
    if let Some(ctx) = &saved {
        pins.push(ctx.pin_spec());
    }
    let prompt_len = prompt_tokens.len();
    let mut request = GenerateRequest::greedy(prompt_tokens, plan.max_tokens);
    request.sampling = plan.sampling.clone();
    request.stop = plan.stop.clone();
    request.cache_salt = salt;
    request.pins = pins;
    let (mut events, sender) = Events::new(1, 1);
    let guard = s.engine.submit(request, sender.sink(0))?;
    events.add_guard(guard);
    drop(sender);
    let id = handlers::response_id("msg");
    let deadline = s.request_timeout.and_then(|t| {
        tokio::time::Instant::now()
            .checked_add(t)
            .map(|at| (at, t.as_secs()))
    });
    if plan.stream {
        let body = stream(id, info.model_name.clone(), prompt_len, events, deadline);
        let mut response = Sse::new(body)
            .keep_alive(KeepAlive::default())
            .into_response();
        response
            .headers_mut()
            .insert("x-accel-buffering", HeaderValue::from_static("no"));
        return Ok(response);
    }
    let body = collect(id, info.model_name.clone(), events);
    let body = match deadline {
        Some((at, seconds)) => tokio::time::timeout_at(at, body)
            .await
            .map_err(|_| ApiError::Timeout { seconds })??,
        None => body.await?,
    };
    Ok((StatusCode::OK, Json(body)).into_response())
}

/// Anthropic's usage object of an engine usage.
pub fn usage_body(u: &Usage) -> Value {
    let read = u.cached_tokens.min(u.prompt_tokens);
    let created = u.cache_write_tokens.min(u.prompt_tokens - read);
    json!({
        "input_tokens": u.prompt_tokens - read - created,
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": read,
    })
}

fn stop_reason(reason: Option<FinishReason>, stop_sequence: &Option<String>) -> &'static str {
    match (reason, stop_sequence) {
        (Some(FinishReason::Length), _) => "max_tokens",
        (_, Some(_)) => "stop_sequence",
        _ => "end_turn",
    }
}

async fn collect(id: String, model: String, mut events: Events) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut reason = None;
    let mut stop_sequence = None;
    let usage = loop {
        match events.next().await {
            Some(EngineEvent::Delta { text: t, .. }) => text.push_str(&t),
            Some(EngineEvent::Finished {
                reason: r,
                stop_sequence: s,
                ..
            }) => {
                reason = Some(r);
                stop_sequence = s;
            }
            Some(EngineEvent::Done { usage }) => break usage,
            Some(EngineEvent::Failed(e)) => return Err(e.into()),
            None => {
                return Err(ApiError::Internal(
                    "the engine dropped the request without finishing it".into(),
                ))
            }
        }
    };
    Ok(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason(reason, &stop_sequence),
        "stop_sequence": stop_sequence,
        "usage": usage_body(&usage),
    }))
}

fn event(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

/// Anthropic's event sequence: `message_start`, `content_block_start`, `ping`, `content_block_delta`s,
/// `content_block_stop`, `message_delta` (stop reason and the whole usage), `message_stop`; an `error`
/// event when the request fails midway.
fn stream(
    id: String,
    model: String,
    prompt_len: usize,
    events: Events,
    deadline: Option<(tokio::time::Instant, u64)>,
) -> impl Stream<Item = Result<Event, Infallible>> {
    struct St {
        events: Events,
        queue: std::collections::VecDeque<Event>,
        done: bool,
        reason: Option<FinishReason>,
        stop_sequence: Option<String>,
        deadline: Option<(tokio::time::Instant, u64)>,
    }
    let mut queue = std::collections::VecDeque::new();
    queue.push_back(event(
        "message_start",
        json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            // The cache split is known once the prompt is computed: message_delta carries it.
            "usage": {"input_tokens": prompt_len, "output_tokens": 0,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        }}),
    ));
    queue.push_back(event(
        "content_block_start",
        json!({"type": "content_block_start", "index": 0,
               "content_block": {"type": "text", "text": ""}}),
    ));
    queue.push_back(event("ping", json!({"type": "ping"})));
    let st = St {
        events,
        queue,
        done: false,
        reason: None,
        stop_sequence: None,
        deadline,
    };
    futures::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.queue.pop_front() {
                return Some((Ok(e), st));
            }
            if st.done {
                return None;
            }
            let next = match st.deadline {
                Some((at, seconds)) => match tokio::time::timeout_at(at, st.events.next()).await {
                    Ok(next) => next,
                    Err(_) => {
                        // Dropping the stream state drops the guard: the request is cancelled.
                        let e = ApiError::Timeout { seconds };
                        st.queue.push_back(event("error", anthropic_body(&e)));
                        st.done = true;
                        continue;
                    }
                },
                None => st.events.next().await,
            };
            match next {
                Some(EngineEvent::Delta { text, .. }) => {
                    if !text.is_empty() {
                        st.queue.push_back(event(
                            "content_block_delta",
                            json!({"type": "content_block_delta", "index": 0,
                                   "delta": {"type": "text_delta", "text": text}}),
                        ));
                    }
                }
                Some(EngineEvent::Finished {
                    reason,
                    stop_sequence,
                    ..
                }) => {
                    st.reason = Some(reason);
                    st.stop_sequence = stop_sequence;
                }
                Some(EngineEvent::Done { usage }) => {
                    st.queue.push_back(event(
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": 0}),
                    ));
                    st.queue.push_back(event(
                        "message_delta",
                        json!({"type": "message_delta",
                               "delta": {"stop_reason": stop_reason(st.reason, &st.stop_sequence),
                                         "stop_sequence": st.stop_sequence},
                               "usage": usage_body(&usage)}),
                    ));
                    st.queue
                        .push_back(event("message_stop", json!({"type": "message_stop"})));
                    st.done = true;
                }
                Some(EngineEvent::Failed(e)) => {
                    st.queue
                        .push_back(event("error", anthropic_body(&ApiError::from(e))));
                    st.done = true;
                }
                None => {
                    let e = ApiError::Internal(
                        "the engine dropped the request without finishing it".into(),
                    );
                    st.queue.push_back(event("error", anthropic_body(&e)));
                    st.done = true;
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_adds_up_to_the_prompt() {
        let u = Usage {
            prompt_tokens: 100,
            completion_tokens: 5,
            cached_tokens: 32,
            cache_write_tokens: 48,
        };
        let b = usage_body(&u);
        assert_eq!(b["input_tokens"], 20);
        assert_eq!(b["cache_read_input_tokens"], 32);
        assert_eq!(b["cache_creation_input_tokens"], 48);
        assert_eq!(b["output_tokens"], 5);
    }
}
