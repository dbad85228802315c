//! `POST /v1/messages`: Anthropic's Messages API over the same engine, with `cache_control`
//! breakpoints; `POST /v1/messages/count_tokens`: the length of the prompt it would compute.
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
use kura_api::anthropic::{
    anthropic_body, encode_messages, prepare, prepare_count, AnthropicError,
};
use kura_api::body;
use kura_api::tools::CallReader;
use kura_api::{effective_salt, ApiError, Tenant};
use kura_engine::{EngineEvent, FinishReason, GenerateRequest, PinSpec, Usage};
use serde_json::{json, Value};

use crate::output::{self, Events, ToolStream};
use crate::AppState;
use crate::{guided, handlers};
use kura_api::reasoning::ThinkSplit;

/// The Messages route: Anthropic-shaped errors around [`messages_inner`].
pub async fn messages(
    State(s): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Extension(arrival): Extension<output::Arrival>,
    req: Request,
) -> Response {
    match messages_inner(s, tenant, arrival, req).await {
        Ok(r) => r,
        Err(e) => AnthropicError(e).into_response(),
    }
}

async fn messages_inner(
    s: AppState,
    tenant: Tenant,
    arrival: output::Arrival,
    req: Request,
) -> Result<Response, ApiError> {
    let deadline = output::deadline(s.request_timeout, arrival);
    body::check_json_content_type(req.headers())?;
    let bytes = body::read_body(req, &s, s.body_timeout, s.max_body_bytes).await?;
    let value = body::parse_json_object(&bytes)?;
    drop(bytes);
    let info = s.engine.info().clone();
    let plan = prepare(&value, &info.model_name)?;
    drop(value);
    if plan.thinking.is_some() && !s.reasoning {
        return Err(ApiError::invalid(
            "thinking is not supported by this server: its model writes no reasoning apart from \
             its answer (a reasoning model's chat template spells <think>; see --reasoning-parser)",
            Some("thinking"),
        ));
    }
    let salt = effective_salt(&tenant, plan.cache_salt.clone());
    let saved = match &plan.cached_content {
        Some(id) => Some(crate::handlers::use_saved_context(&s, id, salt.clone()).await?),
        None => None,
    };
    let style = guided::tool_style(&s.engine);
    let guide = plan.guide.clone().map(|g| (g, "output_config"));
    let (engine, plan_for_encode) = (s.engine.clone(), plan.clone());
    let saved_for_encode = saved.clone();
    let (prompt_tokens, positions) = handlers::off_the_workers(move || {
        encode_messages(
            engine.codec().as_ref(),
            &plan_for_encode,
            saved_for_encode
                .as_ref()
                .map(|c| (&c.kind, c.tokens.as_slice())),
        )
    })
    .await?;
    let thinking = handlers::thinking_of(&s, s.engine.codec().as_ref(), &prompt_tokens);
    let constraint = guided::constraint(
        &s.engine,
        &s.guides,
        salt.clone(),
        guide,
        plan.tools.as_ref(),
        style,
        thinking,
        plan.thinking.map(|budget| (budget, "thinking")),
        deadline,
    )
    .await?;
    let now = s.engine.cache_now_ms();
    let mut pins: Vec<PinSpec> = positions
        .iter()
        .map(|&(tokens, ttl)| PinSpec {
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
    request.constraint = constraint;
    // The turns before a prefill: its open turn is the prompt's end, not history.
    if plan.closed_messages().iter().any(|m| m.role == "assistant") {
        request.history_tokens = handlers::history_of(
            s.engine.codec().clone(),
            plan.closed_messages().to_vec(),
            plan.tools.clone(),
            &request,
        )
        .await?;
    }
    let tools = plan.tools.as_ref().and_then(|t| t.reader(style.format));
    // A reasoning model's reasoning is read apart from its answer, and shown (as `thinking` blocks)
    // where the request enables thinking.
    let thinking = Thinking {
        read: thinking,
        shown: plan.thinking.is_some(),
    };
    output::before_deadline(deadline)?;
    let (mut events, sender) = Events::new(1, 1);
    let guard = s.engine.submit(request, sender.sink(0))?;
    events.add_guard(guard);
    drop(sender);
    let id = handlers::response_id("msg");
    if plan.stream {
        let body = stream(
            id,
            info.model_name.clone(),
            prompt_len,
            events,
            deadline,
            tools,
            thinking,
        );
        let mut response = Sse::new(body)
            .keep_alive(KeepAlive::default())
            .into_response();
        response
            .headers_mut()
            .insert("x-accel-buffering", HeaderValue::from_static("no"));
        return Ok(response);
    }
    let body = output::finish_before(
        deadline,
        collect(id, info.model_name.clone(), events, tools, thinking),
    )
    .await?;
    Ok((StatusCode::OK, Json(body)).into_response())
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": n}`, the length of the prompt `/v1/messages`
/// would compute for the same system prompt, messages and tools (its usage's three input counts add
/// up to it). Nothing runs on the engine and nothing is cached; errors in Anthropic's shape.
pub async fn count_tokens(State(s): State<AppState>, req: Request) -> Response {
    let count = async {
        body::check_json_content_type(req.headers())?;
        let bytes = body::read_body(req, &s, s.body_timeout, s.max_body_bytes).await?;
        let value = body::parse_json_object(&bytes)?;
        drop(bytes);
        let plan = prepare_count(&value, &s.engine.info().model_name)?;
        drop(value);
        let codec = s.engine.codec().clone();
        let (tokens, _) =
            handlers::off_the_workers(move || encode_messages(codec.as_ref(), &plan, None)).await?;
        Ok::<_, ApiError>(Json(json!({"input_tokens": tokens.len()})).into_response())
    };
    match count.await {
        Ok(r) => r,
        Err(e) => AnthropicError(e).into_response(),
    }
}

/// Anthropic's usage object of an engine usage.
pub fn usage_body(u: &Usage) -> Value {
    let read = u.cached_tokens.min(u.prompt_tokens);
    let created = u.cache_write_tokens.min(u.prompt_tokens - read);
    // The fields Anthropic's schema requires, null where this server has nothing to say (the cache
    // writes are not split by TTL; no server tools, one place, one tier).
    let mut b = json!({
        "input_tokens": u.prompt_tokens - read - created,
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": read,
        "cache_creation": null,
        "inference_geo": null,
        "output_tokens_details": null,
        "server_tool_use": null,
        "service_tier": "standard",
    });
    if let Some(m) = u.miss {
        b["cache_miss"] = json!(kura_api::types::CacheMissBody::from(m));
    }
    b
}

fn stop_reason(
    reason: Option<FinishReason>,
    stop_sequence: &Option<String>,
    made_calls: bool,
) -> &'static str {
    match (reason, stop_sequence) {
        (Some(FinishReason::Length), _) => "max_tokens",
        (_, Some(_)) => "stop_sequence",
        _ if made_calls => "tool_use",
        _ => "end_turn",
    }
}

/// The ids of a message's `tool_use` blocks start with this.
fn tool_ids(id: &str) -> String {
    format!("toolu_{id}")
}

/// A call's arguments as Anthropic's `input` (an object).
fn input_of(arguments: &str) -> Value {
    serde_json::from_str(arguments).unwrap_or_else(|_| json!({}))
}

/// How a reasoning model's reasoning is read: apart from the answer (`read`: whether the prompt
/// ends inside it, [`crate::output::ResponseMeta::reasoning`]), and `shown` as `thinking` blocks.
#[derive(Clone, Copy)]
struct Thinking {
    read: Option<bool>,
    shown: bool,
}

/// A thinking block of `text` (no signature: nothing here checks one sent back).
fn thinking_block(text: &str) -> Value {
    json!({"type": "thinking", "thinking": text, "signature": ""})
}

async fn collect(
    id: String,
    model: String,
    mut events: Events,
    tools: Option<CallReader>,
    thinking: Thinking,
) -> Result<Value, ApiError> {
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
            // Not asked of a chat: there is none.
            Some(EngineEvent::PromptLogprobs { .. } | EngineEvent::Prompted { .. }) => {}
            None => {
                return Err(ApiError::Internal(
                    "the engine dropped the request without finishing it".into(),
                ))
            }
        }
    };
    let (reasoning, text) = match thinking.read {
        Some(inside) => ThinkSplit::whole(&text, inside),
        None => (None, text),
    };
    let (content, calls) = match tools {
        Some(reader) => reader.parse(&text),
        None => (text, Vec::new()),
    };
    let mut blocks = Vec::new();
    if let Some(r) = reasoning.filter(|_| thinking.shown) {
        blocks.push(thinking_block(&r));
    }
    // (An empty text block where there is nothing else, as a stream opens one.)
    if !content.is_empty() || (calls.is_empty() && blocks.is_empty()) {
        blocks.push(json!({"type": "text", "text": content, "citations": null}));
    }
    let ids = tool_ids(&id);
    for (i, c) in calls.iter().enumerate() {
        blocks.push(
            json!({"type": "tool_use", "id": format!("{ids}-{i}"), "name": c.name,
                           "input": input_of(&c.arguments), "caller": {"type": "direct"}}),
        );
    }
    Ok(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop_reason(reason, &stop_sequence, !calls.is_empty()),
        "stop_sequence": stop_sequence,
        "stop_details": null,
        "container": null,
        "usage": usage_body(&usage),
    }))
}

fn event(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

/// Where a streamed message is: which content block is open.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Thinking,
    Text,
    Tool(usize),
}

/// The content blocks of a streamed message as they open, grow and close.
struct Blocks {
    /// Calls are read out of the text so (the text block then opens only for text).
    tools: Option<(CallReader, ToolStream)>,
    /// The reasoning read apart, and whether it is shown.
    think: Option<ThinkSplit>,
    show_thinking: bool,
    ids: String,
    open: Open,
    /// Index of the block open now (blocks are numbered from 0 as they open).
    index: usize,
    opened: usize,
    made_calls: bool,
}

impl Blocks {
    fn close(&mut self, queue: &mut std::collections::VecDeque<Event>) {
        if self.open != Open::None {
            queue.push_back(event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": self.index}),
            ));
            self.open = Open::None;
        }
    }

    fn start(&mut self, block: Value, open: Open, queue: &mut std::collections::VecDeque<Event>) {
        self.close(queue);
        self.index = self.opened;
        self.opened += 1;
        self.open = open;
        queue.push_back(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": self.index, "content_block": block}),
        ));
    }

    fn text(&mut self, text: String, queue: &mut std::collections::VecDeque<Event>) {
        if text.is_empty() {
            return;
        }
        if self.open != Open::Text {
            self.start(
                json!({"type": "text", "text": "", "citations": null}),
                Open::Text,
                queue,
            );
        }
        queue.push_back(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.index,
                   "delta": {"type": "text_delta", "text": text}}),
        ));
    }

    fn calls(
        &mut self,
        deltas: Vec<kura_api::types::ToolCallDelta>,
        queue: &mut std::collections::VecDeque<Event>,
    ) {
        for d in deltas {
            let call = d.index as usize;
            if let (Some(id), Some(name)) = (d.id, d.function.name) {
                self.start(
                    json!({"type": "tool_use", "id": id, "name": name, "input": {},
                           "caller": {"type": "direct"}}),
                    Open::Tool(call),
                    queue,
                );
            }
            if !d.function.arguments.is_empty() && self.open == Open::Tool(call) {
                queue.push_back(event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "input_json_delta",
                                     "partial_json": d.function.arguments}}),
                ));
            }
        }
    }

    fn thinking(&mut self, text: String, queue: &mut std::collections::VecDeque<Event>) {
        if text.is_empty() || !self.show_thinking {
            return;
        }
        if self.open != Open::Thinking {
            self.start(thinking_block(""), Open::Thinking, queue);
        }
        queue.push_back(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.index,
                   "delta": {"type": "thinking_delta", "thinking": text}}),
        ));
    }

    fn delta(&mut self, text: String, queue: &mut std::collections::VecDeque<Event>) {
        let text = match &mut self.think {
            Some(t) => {
                let split = t.push(&text);
                self.thinking(split.reasoning, queue);
                split.content
            }
            None => text,
        };
        self.answer(text, queue);
    }

    /// The answer's new text, its calls read out of it where the request has tools.
    fn answer(&mut self, text: String, queue: &mut std::collections::VecDeque<Event>) {
        match &mut self.tools {
            Some((reader, ts)) => {
                let (content, deltas) = ts.advance(&self.ids, reader, &text);
                self.text(content, queue);
                self.calls(deltas, queue);
            }
            None => self.text(text, queue),
        }
    }

    fn finish(&mut self, queue: &mut std::collections::VecDeque<Event>) {
        if let Some(split) = self.think.as_mut().map(ThinkSplit::finish) {
            self.thinking(split.reasoning, queue);
            self.answer(split.content, queue);
        }
        if let Some((reader, ts)) = &mut self.tools {
            let (content, deltas, made_calls) = ts.finish(&self.ids, reader);
            self.text(content, queue);
            self.calls(deltas, queue);
            // The stop reason is the finished reply's: calls that opened blocks while streaming but
            // do not read back as calls (one cut off at max_tokens) are not a `tool_use` stop.
            self.made_calls = made_calls;
        }
        if self.opened == 0 {
            self.start(
                json!({"type": "text", "text": "", "citations": null}),
                Open::Text,
                queue,
            );
        }
        self.close(queue);
    }
}

/// Anthropic's event sequence: `message_start`, `content_block_start`, `ping`, `content_block_delta`s,
/// `content_block_stop` (with tools: a text block while there is text, and a `tool_use` block per
/// call whose input arrives as `input_json_delta`s), `message_delta` (stop reason and the whole usage),
/// `message_stop`; an `error` event when the request fails midway. `message_start` waits for the
/// prompt to be computed, so that its usage splits the input into cache reads, cache writes and the
/// rest as Anthropic's does (the SSE keep-alive covers the wait).
fn stream(
    id: String,
    model: String,
    prompt_len: usize,
    events: Events,
    deadline: output::Deadline,
    tools: Option<CallReader>,
    thinking: Thinking,
) -> impl Stream<Item = Result<Event, Infallible>> {
    struct St {
        events: Events,
        queue: std::collections::VecDeque<Event>,
        blocks: Blocks,
        /// `message_start` is sent.
        started: bool,
        id: String,
        model: String,
        prompt_len: usize,
        done: bool,
        reason: Option<FinishReason>,
        stop_sequence: Option<String>,
        deadline: output::Deadline,
    }
    impl St {
        /// Sends `message_start` (once) with the prompt's usage, then the events that follow it
        /// before any content.
        fn start(&mut self, prompt: Option<&Usage>) {
            if self.started {
                return;
            }
            self.started = true;
            let fallback = Usage {
                prompt_tokens: u32::try_from(self.prompt_len).unwrap_or(u32::MAX),
                ..Usage::default()
            };
            let mut usage = usage_body(&Usage {
                completion_tokens: 0,
                ..*prompt.unwrap_or(&fallback)
            });
            // What is known at the start: the cache split; the miss comes with the whole usage.
            if let Some(u) = usage.as_object_mut() {
                u.remove("cache_miss");
            }
            self.queue.push_back(event(
                "message_start",
                json!({"type": "message_start", "message": {
                    "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "stop_details": null, "container": null, "usage": usage,
                }}),
            ));
            if self.blocks.tools.is_none() && self.blocks.think.is_none() {
                // Without tools or reasoning the one text block opens at once.
                self.blocks.start(
                    json!({"type": "text", "text": "", "citations": null}),
                    Open::Text,
                    &mut self.queue,
                );
            }
            self.queue.push_back(event("ping", json!({"type": "ping"})));
        }
    }
    let blocks = Blocks {
        tools: tools.map(|r| (r, ToolStream::default())),
        think: thinking.read.map(ThinkSplit::new),
        show_thinking: thinking.shown,
        ids: tool_ids(&id),
        open: Open::None,
        index: 0,
        opened: 0,
        made_calls: false,
    };
    let st = St {
        events,
        queue: std::collections::VecDeque::new(),
        blocks,
        started: false,
        id,
        model,
        prompt_len,
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
            let next = match output::next_before(&mut st.events, st.deadline).await {
                Ok(next) => next,
                Err(seconds) => {
                    // Dropping the stream state drops the guard: the request is cancelled.
                    let e = ApiError::Timeout { seconds };
                    st.queue.push_back(event("error", anthropic_body(&e)));
                    st.done = true;
                    continue;
                }
            };
            match next {
                Some(EngineEvent::Prompted { usage }) => st.start(Some(&usage)),
                Some(EngineEvent::Delta { text, .. }) => {
                    st.start(None);
                    st.blocks.delta(text, &mut st.queue);
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
                    st.start(Some(&usage));
                    st.blocks.finish(&mut st.queue);
                    let reason = stop_reason(st.reason, &st.stop_sequence, st.blocks.made_calls);
                    st.queue.push_back(event(
                        "message_delta",
                        json!({"type": "message_delta",
                               "delta": {"stop_reason": reason,
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
                Some(EngineEvent::PromptLogprobs { .. }) => {}
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
            miss: None,
        };
        let b = usage_body(&u);
        assert_eq!(b["input_tokens"], 20);
        assert_eq!(b["cache_read_input_tokens"], 32);
        assert_eq!(b["cache_creation_input_tokens"], 48);
        assert_eq!(b["output_tokens"], 5);
    }
}
