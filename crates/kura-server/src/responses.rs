//! `POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`: OpenAI's Responses API
//! over the same engine (request reading is `kura_api::responses`); `POST /v1/responses/input_tokens`:
//! the length of the prompt a request would have.
//!
//! A stored response (`store`, the default) keeps its conversation — the turns before it, its input and
//! its output, without `instructions` — so that a request naming it as `previous_response_id` continues
//! from there; its prompt is pinned for [`STORED_PIN_MS`] and written through to the lower tiers (the
//! disk tier, when there is one), so the next turn's prefix is a cache hit. Stored responses belong to
//! the tenant that made them: another tenant's id is "not found", alike for `GET`, `DELETE` and
//! `previous_response_id`. They live in memory (at most [`MAX_STORED`], the oldest dropped first) and
//! not across restarts.
//!
//! Output items: a `message` with one `output_text` part when the model wrote text, and a
//! `function_call` per call (read out of the text as the chat route reads them). A response cut at
//! `max_output_tokens` is `incomplete`. Streams send the documented events in order, each with its
//! `sequence_number`: `response.created`, `response.in_progress`, then per item
//! `response.output_item.added`, (`response.content_part.added`, `response.output_text.delta`s,
//! `response.output_text.done`, `response.content_part.done` | `response.function_call_arguments.delta`s,
//! `response.function_call_arguments.done`), `response.output_item.done`, and last
//! `response.completed` (or `response.incomplete`).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures::Stream;
use kura_api::responses::{prepare, prepare_count, ResponsesPlan};
use kura_api::tools::{
    check_tool_turns_named, encode_chat_prompt, template_call, CallReader, TurnNames,
};
use kura_api::validate::bad_word_tokens;
use kura_api::{effective_salt, ApiError, Tenant};
use kura_engine::{ChatMessage, EngineEvent, FinishReason, PinSpec, Usage};
use serde_json::{json, Map, Value};

use crate::body::{JsonBody, PathId};
use crate::handlers::{history_of, off_the_workers, remaining_tokens, response_id};
use crate::output::{self, Events, ToolStream};
use crate::{guided, AppState};
use kura_api::reasoning::ThinkWhole;

/// Most responses kept at once (over all tenants); past it the oldest is dropped.
pub const MAX_STORED: usize = 10_000;
/// Most bytes the stored responses hold at once (their conversations and bodies, counted as JSON);
/// past it the oldest are dropped.
pub const MAX_STORED_BYTES: usize = 1 << 30;
/// How long a stored response's prompt stays pinned in the cache.
pub const STORED_PIN_MS: u64 = 3_600_000;

struct Stored {
    /// The tenant's cache salt (`None` without keys).
    owner: Option<String>,
    /// Every turn up to and including this response's output (no instructions).
    conversation: Vec<ChatMessage>,
    body: Value,
    /// What it holds, counted as JSON ([`Stored::new`]).
    bytes: usize,
}

impl Stored {
    fn new(owner: Option<String>, conversation: Vec<ChatMessage>, body: Value) -> Stored {
        let bytes = json_len(&conversation)
            .saturating_add(json_len(&body))
            .saturating_add(owner.as_ref().map_or(0, String::len));
        Stored {
            owner,
            conversation,
            body,
            bytes,
        }
    }
}

/// The length of `value` written as JSON, counted without writing it anywhere.
fn json_len(value: &impl serde::Serialize) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 = self.0.saturating_add(buf.len());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Serializing values that came from JSON cannot fail; a failure would count what was written.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// The stored responses by id, their ids oldest first, and the bytes they hold.
type Responses = (HashMap<String, Arc<Stored>>, VecDeque<String>, usize);

/// The stored responses, and those to be stored that are still being generated.
#[derive(Default)]
pub(crate) struct ResponseStore {
    inner: Mutex<Responses>,
    pending: Mutex<HashMap<String, Pending>>,
}

/// A response to be stored, still being generated: its owner, its body as `response.in_progress`
/// showed it, and whether its owner deleted it meanwhile (then it is not kept when it completes).
struct Pending {
    owner: Option<String>,
    body: Value,
    deleted: bool,
}

/// What a stored response's id finds.
enum Found {
    Done(Arc<Stored>),
    /// Its body while in progress.
    InProgress(Value),
}

/// A pending response's place in the store: dropped (a failure, a cancelled request, a client gone)
/// before [`ResponseStore::finish`], it takes the pending entry away.
struct PendingGuard {
    store: Arc<ResponseStore>,
    id: String,
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        let mut pending = self.store.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.remove(&self.id);
    }
}

impl ResponseStore {
    fn get(&self, id: &str, owner: &Option<String>) -> Option<Found> {
        {
            let pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(p) = pending.get(id).filter(|p| &p.owner == owner) {
                return (!p.deleted).then(|| Found::InProgress(p.body.clone()));
            }
        }
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .0
            .get(id)
            .filter(|s| &s.owner == owner)
            .cloned()
            .map(Found::Done)
    }

    /// Marks `id` as a response of `owner` to be stored once it completes (`body`: as it is now).
    fn begin(self: &Arc<Self>, id: &str, owner: Option<String>, body: Value) -> PendingGuard {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.insert(
            id.to_string(),
            Pending {
                owner,
                body,
                deleted: false,
            },
        );
        PendingGuard {
            store: self.clone(),
            id: id.to_string(),
        }
    }

    /// Keeps a completed response, unless its owner deleted it while it was generated.
    fn finish(&self, id: &str, stored: Stored) {
        let deleted = {
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            pending.remove(id).is_some_and(|p| p.deleted)
        };
        if !deleted {
            self.insert(id.to_string(), stored);
        }
    }

    /// Keeps `stored` under `id`, within [`MAX_STORED`] responses and [`MAX_STORED_BYTES`]: room is
    /// made by dropping the oldest, the tenant's own oldest first while it holds half of the store's
    /// responses or bytes or more, so that one tenant's flood does not push out everyone else's.
    fn insert(&self, id: String, stored: Stored) {
        self.insert_within(id, stored, MAX_STORED, MAX_STORED_BYTES);
    }

    fn insert_within(&self, id: String, stored: Stored, max_count: usize, max_bytes: usize) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (map, order, bytes) = &mut *inner;
        let owner = stored.owner.clone();
        let (mut own_count, mut own_bytes) = map
            .values()
            .filter(|s| s.owner == owner)
            .fold((0usize, 0usize), |(n, b), s| {
                (n + 1, b.saturating_add(s.bytes))
            });
        while !order.is_empty()
            && (map.len() >= max_count || bytes.saturating_add(stored.bytes) > max_bytes)
        {
            let own_first =
                own_count.saturating_mul(2) >= map.len() || own_bytes.saturating_mul(2) >= *bytes;
            let at = own_first
                .then(|| {
                    order
                        .iter()
                        .position(|x| map.get(x).is_some_and(|s| s.owner == owner))
                })
                .flatten()
                .unwrap_or(0);
            let Some(old) = order.remove(at) else { break };
            if let Some(s) = map.remove(&old) {
                *bytes = bytes.saturating_sub(s.bytes);
                if s.owner == owner {
                    own_count -= 1;
                    own_bytes = own_bytes.saturating_sub(s.bytes);
                }
            }
        }
        *bytes = bytes.saturating_add(stored.bytes);
        order.push_back(id.clone());
        if let Some(replaced) = map.insert(id, Arc::new(stored)) {
            *bytes = bytes.saturating_sub(replaced.bytes);
        }
    }

    fn remove(&self, id: &str, owner: &Option<String>) -> bool {
        {
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(p) = pending.get_mut(id).filter(|p| &p.owner == owner) {
                return !std::mem::replace(&mut p.deleted, true);
            }
        }
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (map, order, bytes) = &mut *inner;
        if map.get(id).is_some_and(|s| &s.owner == owner) {
            if let Some(s) = map.remove(id) {
                *bytes = bytes.saturating_sub(s.bytes);
            }
            order.retain(|x| x != id);
            true
        } else {
            false
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn not_found(id: &str) -> ApiError {
    ApiError::ResponseNotFound(id.to_string())
}

/// What a response is, apart from its output.
#[derive(Clone)]
struct Meta {
    id: String,
    created: u64,
    model: String,
    instructions: Option<String>,
    previous: Option<String>,
    store: bool,
    echo: Map<String, Value>,
    tools: Option<CallReader>,
    /// The reasoning is read apart ([`crate::output::ResponseMeta::reasoning`]).
    reasoning: Option<bool>,
}

impl Meta {
    /// The response object with `output`, `status` and `usage` (with the output's reasoning tokens).
    fn body(&self, status: &str, output: Vec<Value>, usage: Option<(&Usage, u32)>) -> Value {
        let mut b = json!({
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": null,
            "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { json!(null) },
            "model": self.model, "output": output, "instructions": self.instructions,
            "previous_response_id": self.previous, "store": self.store,
            "parallel_tool_calls": true, "tool_choice": "auto", "tools": [],
            "temperature": 1.0, "top_p": 1.0, "max_output_tokens": null, "metadata": {},
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "usage": usage.map(|(u, reasoning)| usage_body(u, reasoning)),
        });
        if let Some(o) = b.as_object_mut() {
            for (k, v) in &self.echo {
                o.insert(k.clone(), v.clone());
            }
            // Usage is there once the response is done (the schema has no null for it).
            if usage.is_none() {
                o.remove("usage");
            }
        }
        b
    }

    fn message_id(&self) -> String {
        format!("msg_{}", self.id)
    }

    fn call_ids(&self) -> String {
        format!("fc_{}", self.id)
    }

    fn reasoning_id(&self) -> String {
        format!("rs_{}", self.id)
    }
}

/// Responses' usage object; `reasoning_tokens`: those of the output's reasoning.
fn usage_body(u: &Usage, reasoning_tokens: u32) -> Value {
    let mut details = json!({"cached_tokens": u.cached_tokens});
    if let Some(m) = u.miss {
        details["cache_miss"] = json!(kura_api::types::CacheMissBody::from(m));
    }
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": details,
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": u.prompt_tokens.saturating_add(u.completion_tokens),
    })
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
}

/// A reasoning model's reasoning as an output item: its text whole (`content`), no summary.
fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [], "status": status,
           "content": [{"type": "reasoning_text", "text": text}]})
}

fn call_item(id: &str, name: &str, arguments: &str, status: &str) -> Value {
    // One id serves as the item's and the call's (what `function_call_output` answers).
    json!({"type": "function_call", "id": id, "call_id": id, "name": name, "arguments": arguments,
           "status": status})
}

/// A finished response's output items and the assistant turn they make; `incomplete` (cut at
/// `max_output_tokens`): its last item is `incomplete`, as OpenAI marks it.
fn output_of(
    meta: &Meta,
    reasoning: Option<String>,
    text: &str,
    incomplete: bool,
) -> (Vec<Value>, ChatMessage) {
    // A reasoning model's reasoning first, as its own item; the turn kept is the answer.
    let (content, calls) = match &meta.tools {
        Some(reader) => reader.parse(text),
        None => (text.to_string(), Vec::new()),
    };
    let content = if calls.is_empty() {
        text.to_string()
    } else {
        content
    };
    let mut items = Vec::new();
    if let Some(r) = &reasoning {
        items.push(reasoning_item(&meta.reasoning_id(), r, "completed"));
    }
    if !content.is_empty() || (calls.is_empty() && reasoning.is_none()) {
        items.push(message_item(&meta.message_id(), &content, "completed"));
    }
    let ids = meta.call_ids();
    let mut turn_calls = Vec::new();
    for (i, c) in calls.iter().enumerate() {
        let id = format!("{ids}-{i}");
        items.push(call_item(&id, &c.name, &c.arguments, "completed"));
        turn_calls.push(template_call(&id, &c.name, &c.arguments, None));
    }
    if let Some(last) = items.last_mut().filter(|_| incomplete) {
        last["status"] = json!("incomplete");
    }
    let turn = ChatMessage {
        role: "assistant".into(),
        content,
        tool_calls: (!turn_calls.is_empty()).then_some(Value::Array(turn_calls)),
        ..Default::default()
    };
    (items, turn)
}

/// An error of the engine or the chat encoding in the Responses API's names: `max_output_tokens`
/// for `max_tokens`, `input` for the prompt and the messages it became.
fn for_responses(e: ApiError) -> ApiError {
    e.rename_field("max_tokens", "max_output_tokens")
        .rename_param("prompt", "input")
        .rename_param("messages", "input")
}

/// The turns a response continues from (its previous response's conversation, then its `input`) and
/// the messages its prompt is written from (`instructions` first), the tool turns of `input` checked.
/// A previous response of another tenant is not found.
fn turns_of(
    s: &AppState,
    owner: &Option<String>,
    plan: &ResponsesPlan,
) -> Result<(Vec<ChatMessage>, Vec<ChatMessage>), ApiError> {
    let mut conversation = match &plan.previous_response_id {
        Some(id) => match s.responses.get(id, owner) {
            Some(Found::Done(prev)) => prev.conversation.clone(),
            Some(Found::InProgress(_)) => {
                return Err(ApiError::invalid(
                    format!(
                    "previous_response_id {id:?} is still in progress: continue from it once it \
                         has completed"
                ),
                    Some("previous_response_id"),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    format!("previous_response_id {id:?} was not found"),
                    Some("previous_response_id"),
                ))
            }
        },
        None => Vec::new(),
    };
    conversation.extend(plan.input.iter().cloned());
    let mut messages = Vec::with_capacity(conversation.len() + 1);
    if let Some(i) = &plan.instructions {
        messages.push(ChatMessage::new("system", i.clone()));
    }
    messages.extend(conversation.iter().cloned());
    // The previous response's turns were checked when it was made: only `input` can be wrong.
    let first_input = messages.len() - plan.input.len();
    check_tool_turns_named(
        &messages,
        &TurnNames {
            item: &|i| match i.checked_sub(first_input) {
                Some(k) => format!("input[{}]", plan.input_items[k]),
                None => "the previous response's conversation".into(),
            },
            id: "call_id",
            call: "function_call",
            param: "input",
        },
    )?;
    Ok((conversation, messages))
}

/// `POST /v1/responses/input_tokens`: `{"object": "response.input_tokens", "input_tokens": n}`, the
/// length of the prompt `/v1/responses` would compute for the same input, instructions, previous
/// response and tools (its `usage.input_tokens`). Nothing runs on the engine and nothing is cached.
pub async fn input_tokens(
    State(s): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    JsonBody(value): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let plan = prepare_count(&value, s.ctx())?;
    drop(value);
    let owner = effective_salt(&tenant, None);
    let (_, messages) = turns_of(&s, &owner, &plan)?;
    let (codec, tools) = (s.engine.codec().clone(), plan.tools);
    let tokens =
        off_the_workers(move || encode_chat_prompt(codec.as_ref(), messages, tools.as_ref()))
            .await
            .map_err(for_responses)?;
    Ok(Json(
        json!({"object": "response.input_tokens", "input_tokens": tokens.len()}),
    ))
}

pub async fn create(
    State(s): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Extension(arrival): Extension<output::Arrival>,
    JsonBody(value): JsonBody,
) -> Result<Response, ApiError> {
    let deadline = output::deadline(s.request_timeout, arrival);
    let info = s.engine.info().clone();
    let plan = prepare(&value, s.ctx())?;
    drop(value);
    let owner = effective_salt(&tenant, None);
    // The request's cache salt: its blocks' and its kept grammar's.
    let salt = effective_salt(&tenant, plan.checked.cache_salt.clone());
    let (conversation, messages) = turns_of(&s, &owner, &plan)?;
    let style = guided::tool_style(&s.engine);
    let (codec, tools) = (s.engine.codec().clone(), plan.tools.clone());
    let with_history = messages.iter().any(|m| m.role == "assistant");
    let conversation_sent = with_history.then(|| messages.clone());
    let prompt_tokens =
        off_the_workers(move || encode_chat_prompt(codec.as_ref(), messages, tools.as_ref()))
            .await
            .map_err(for_responses)?;
    let thinking = crate::handlers::thinking_of(&s, s.engine.codec().as_ref(), &prompt_tokens);
    let constraint = guided::constraint(
        &s.engine,
        &s.guides,
        salt.clone(),
        plan.guide(),
        plan.tools.as_ref(),
        style,
        thinking,
        None,
        deadline,
    )
    .await?;
    let max_tokens = plan
        .checked
        .max_tokens
        .unwrap_or_else(|| remaining_tokens(&s.engine, prompt_tokens.len()));
    if prompt_tokens.len() < crate::handlers::context_tokens(&s.engine) {
        plan.checked
            .check_min_tokens(max_tokens)
            .map_err(for_responses)?;
    }
    let now = s.engine.cache_now_ms();
    let retention = kura_api::cache_control::retention_pin(
        plan.checked.prompt_cache_retention.as_deref(),
        prompt_tokens.len(),
        now,
    )?;
    let prompt_len = prompt_tokens.len();
    let mut request = plan
        .checked
        .clone()
        .into_request(prompt_tokens, max_tokens, None);
    request.sampling.bad_words =
        bad_word_tokens(s.engine.codec().as_ref(), &plan.checked.bad_words)?;
    // The tenant's salt with the request's own, as its grammar was kept under.
    request.cache_salt = salt;
    request.pins.extend(retention);
    if plan.store {
        request.pins.push(PinSpec {
            tokens: prompt_len,
            expires_at_ms: now.saturating_add(STORED_PIN_MS),
            persist: true,
        });
    }
    request.constraint = constraint;
    if let Some(sent) = conversation_sent {
        request.history_tokens =
            history_of(s.engine.codec().clone(), sent, plan.tools.clone(), &request).await?;
    }
    let meta = Meta {
        id: format!("resp_{}", response_id("r").trim_start_matches("r-")),
        created: unix_now(),
        model: info.model_name.clone(),
        instructions: plan.instructions.clone(),
        previous: plan.previous_response_id.clone(),
        store: plan.store,
        echo: plan.echo.clone(),
        tools: plan.tools.as_ref().and_then(|t| t.reader(style.format)),
        reasoning: thinking,
    };
    output::before_deadline(deadline).map_err(for_responses)?;
    let (mut events, sender) = Events::new(1, 1);
    events.add_guard(
        s.engine
            .submit(request, sender.sink(0))
            .map_err(|e| for_responses(e.into()))?,
    );
    drop(sender);
    let keep = plan.store.then(|| {
        let guard = s.responses.begin(
            &meta.id,
            owner.clone(),
            meta.body("in_progress", Vec::new(), None),
        );
        (guard, owner, conversation)
    });
    if plan.checked.stream {
        let body = stream(meta, events, keep, deadline);
        return Ok(Sse::new(body)
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let body = output::finish_before(deadline, collect(meta, events, keep))
        .await
        .map_err(for_responses)?;
    Ok(Json(body).into_response())
}

/// Where a finished response is kept: its place in the store, its owner and the turns before its
/// output.
type Keep = Option<(PendingGuard, Option<String>, Vec<ChatMessage>)>;

fn keep_response(keep: Keep, turn: ChatMessage, body: &Value) {
    if let Some((guard, owner, mut conversation)) = keep {
        conversation.push(turn);
        guard
            .store
            .finish(&guard.id, Stored::new(owner, conversation, body.clone()));
    }
}

async fn collect(meta: Meta, mut events: Events, keep: Keep) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut reason = None;
    // Where reasoning is read, the output read apart as it comes (then `text` stays empty).
    let mut thinking = meta.reasoning.map(ThinkWhole::new);
    let usage = loop {
        match events.next().await {
            Some(EngineEvent::Delta { text: t, .. }) => match &mut thinking {
                Some(whole) => {
                    whole.push_token(&t);
                }
                None => text.push_str(&t),
            },
            Some(EngineEvent::Finished { reason: r, .. }) => reason = Some(r),
            Some(EngineEvent::Done { usage }) => break usage,
            Some(EngineEvent::Failed(e)) => return Err(e.into()),
            // Not asked of a response: there is none.
            Some(EngineEvent::PromptLogprobs { .. } | EngineEvent::Prompted { .. }) => {}
            None => {
                return Err(ApiError::Internal(
                    "the engine dropped the request without finishing it".into(),
                ))
            }
        }
    };
    let incomplete = reason == Some(FinishReason::Length);
    let reasoning_tokens = thinking.as_ref().map_or(0, ThinkWhole::tokens);
    let (reasoning, text) = match thinking {
        Some(mut whole) => {
            whole.finish();
            whole.into_parts()
        }
        None => (None, text),
    };
    let (items, turn) = output_of(&meta, reasoning, &text, incomplete);
    let status = if incomplete {
        "incomplete"
    } else {
        "completed"
    };
    let body = meta.body(status, items, Some((&usage, reasoning_tokens)));
    keep_response(keep, turn, &body);
    Ok(body)
}

/// The item open now in a streamed response.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Reasoning,
    Text,
    Call(usize),
}

struct St {
    meta: Meta,
    events: Events,
    keep: Keep,
    queue: VecDeque<Event>,
    seq: u64,
    done: bool,
    reason: Option<FinishReason>,
    tools: Option<ToolStream>,
    /// The reply read apart into reasoning and answer as it comes, where reasoning is read (then
    /// `reply` stays empty).
    think: Option<ThinkWhole>,
    open: Open,
    /// Output index of the open item; items are numbered as they open.
    index: usize,
    items: Vec<Value>,
    text: String,
    /// The whole reply so far, where no reasoning is read (the turn kept is read from it as a whole
    /// response reads it).
    reply: String,
    /// The status the item closed next is given (`incomplete` for the last of a response cut short).
    closing: &'static str,
    /// The open call: its id, name and arguments so far.
    call: (String, String, String),
    deadline: output::Deadline,
}

impl St {
    fn emit(&mut self, kind: &str, mut data: Value) {
        if let Some(o) = data.as_object_mut() {
            o.insert("type".into(), json!(kind));
            o.insert("sequence_number".into(), json!(self.seq));
        }
        self.seq += 1;
        self.queue
            .push_back(Event::default().event(kind).data(data.to_string()));
    }

    fn close(&mut self) {
        match self.open {
            Open::None => {}
            Open::Reasoning => {
                let id = self.meta.reasoning_id();
                // (One reasoning item, before the answer: the reasoning so far.)
                let text = self
                    .think
                    .as_ref()
                    .map_or_else(String::new, |t| t.reasoning().to_string());
                self.emit(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": self.index, "content_index": 0,
                           "text": text}),
                );
                self.emit(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": self.index, "content_index": 0,
                           "part": {"type": "reasoning_text", "text": text}}),
                );
                let item = reasoning_item(&id, &text, self.closing);
                self.emit(
                    "response.output_item.done",
                    json!({"output_index": self.index, "item": item}),
                );
                self.items.push(item);
            }
            Open::Text => {
                let id = self.meta.message_id();
                let text = std::mem::take(&mut self.text);
                let part =
                    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                self.emit(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": self.index,
                    "content_index": 0, "text": text, "logprobs": []}),
                );
                self.emit(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": self.index,
                    "content_index": 0, "part": part}),
                );
                let item = message_item(&id, &text, self.closing);
                self.emit(
                    "response.output_item.done",
                    json!({"output_index": self.index, "item": item}),
                );
                self.items.push(item);
            }
            Open::Call(_) => {
                let (id, name, args) = std::mem::take(&mut self.call);
                self.emit(
                    "response.function_call_arguments.done",
                    json!({"item_id": id,
                    "output_index": self.index, "name": name, "arguments": args}),
                );
                let item = call_item(&id, &name, &args, self.closing);
                self.emit(
                    "response.output_item.done",
                    json!({"output_index": self.index, "item": item}),
                );
                self.items.push(item);
            }
        }
        self.open = Open::None;
    }

    fn text(&mut self, text: String) {
        if text.is_empty() {
            return;
        }
        if self.open != Open::Text {
            self.close();
            self.index = self.items.len();
            self.open = Open::Text;
            let id = self.meta.message_id();
            self.emit(
                "response.output_item.added",
                json!({"output_index": self.index,
                "item": {"type": "message", "id": id, "status": "in_progress", "role": "assistant",
                         "content": []}}),
            );
            self.emit("response.content_part.added", json!({"item_id": id, "output_index": self.index,
                "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}));
        }
        self.text.push_str(&text);
        let id = self.meta.message_id();
        self.emit(
            "response.output_text.delta",
            json!({"item_id": id, "output_index": self.index,
            "content_index": 0, "delta": text, "logprobs": []}),
        );
    }

    fn reasoning(&mut self, text: String) {
        if text.is_empty() {
            return;
        }
        if self.open != Open::Reasoning {
            self.close();
            self.index = self.items.len();
            self.open = Open::Reasoning;
            let id = self.meta.reasoning_id();
            self.emit(
                "response.output_item.added",
                json!({"output_index": self.index,
                       "item": {"type": "reasoning", "id": id, "summary": [], "content": [],
                                "status": "in_progress"}}),
            );
            self.emit(
                "response.content_part.added",
                json!({"item_id": id, "output_index": self.index, "content_index": 0,
                       "part": {"type": "reasoning_text", "text": ""}}),
            );
        }
        let id = self.meta.reasoning_id();
        self.emit(
            "response.reasoning_text.delta",
            json!({"item_id": id, "output_index": self.index, "content_index": 0,
                   "delta": text}),
        );
    }

    fn calls(&mut self, deltas: Vec<kura_api::types::ToolCallDelta>) {
        for d in deltas {
            let call = d.index as usize;
            if let (Some(id), Some(name)) = (d.id, d.function.name) {
                self.close();
                self.index = self.items.len();
                self.open = Open::Call(call);
                self.call = (id.clone(), name.clone(), String::new());
                self.emit(
                    "response.output_item.added",
                    json!({"output_index": self.index,
                    "item": call_item(&id, &name, "", "in_progress")}),
                );
            }
            if !d.function.arguments.is_empty() && self.open == Open::Call(call) {
                self.call.2.push_str(&d.function.arguments);
                let id = self.call.0.clone();
                self.emit(
                    "response.function_call_arguments.delta",
                    json!({"item_id": id,
                    "output_index": self.index, "delta": d.function.arguments}),
                );
            }
        }
    }

    fn delta(&mut self, text: String) {
        let text = match self.think.as_mut().map(|t| t.push_token(&text)) {
            Some(split) => {
                self.reasoning(split.reasoning);
                split.content
            }
            None => {
                self.reply.push_str(&text);
                text
            }
        };
        self.answer(text);
    }

    /// The answer's new text, its calls read out of it where the request has tools.
    fn answer(&mut self, text: String) {
        match (&mut self.tools, &self.meta.tools) {
            (Some(ts), Some(reader)) => {
                let (content, deltas) = ts.advance(&self.meta.call_ids(), reader, &text);
                self.text(content);
                self.calls(deltas);
            }
            _ => self.text(text),
        }
    }

    fn finish(&mut self, usage: Usage) {
        if let Some(split) = self.think.as_mut().map(ThinkWhole::finish) {
            self.reasoning(split.reasoning);
            self.answer(split.content);
        }
        if let (Some(ts), Some(reader)) = (&mut self.tools, &self.meta.tools) {
            let (content, deltas, _) = ts.finish(&self.meta.call_ids(), reader);
            self.text(content);
            self.calls(deltas);
        }
        if self.items.is_empty() && self.open == Open::None {
            // No output at all: one empty message, as the whole response has.
            self.text.clear();
            self.open = Open::Text;
            self.index = 0;
            let id = self.meta.message_id();
            self.emit(
                "response.output_item.added",
                json!({"output_index": 0,
                "item": {"type": "message", "id": id, "status": "in_progress", "role": "assistant",
                         "content": []}}),
            );
            self.emit("response.content_part.added", json!({"item_id": id, "output_index": 0,
                "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}));
        }
        let incomplete = self.reason == Some(FinishReason::Length);
        if incomplete {
            self.closing = "incomplete";
        }
        self.close();
        let status = if incomplete {
            "incomplete"
        } else {
            "completed"
        };
        let reasoning_tokens = self.think.as_ref().map_or(0, ThinkWhole::tokens);
        let body = self
            .meta
            .body(status, self.items.clone(), Some((&usage, reasoning_tokens)));
        let kind = if incomplete {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.emit(kind, json!({"response": body}));
        // The turn as the whole response reads it (a call cut off while streaming is no call of it).
        let (reasoning, reply) = match self.think.take() {
            Some(whole) => whole.into_parts(),
            None => (None, std::mem::take(&mut self.reply)),
        };
        let (_, turn) = output_of(&self.meta, reasoning, &reply, incomplete);
        keep_response(self.keep.take(), turn, &body);
        self.done = true;
    }

    fn fail(&mut self, e: ApiError) {
        let body = self.meta.body("failed", Vec::new(), None);
        let mut body = body;
        body["error"] = json!({"code": e.code_or_type(), "message": e.to_string()});
        self.emit("response.failed", json!({"response": body}));
        self.done = true;
    }
}

fn stream(
    meta: Meta,
    events: Events,
    keep: Keep,
    deadline: output::Deadline,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let mut st = St {
        tools: meta.tools.as_ref().map(|_| ToolStream::default()),
        think: meta.reasoning.map(ThinkWhole::new),
        meta,
        events,
        keep,
        queue: VecDeque::new(),
        seq: 0,
        done: false,
        reason: None,
        open: Open::None,
        index: 0,
        items: Vec::new(),
        text: String::new(),
        reply: String::new(),
        closing: "completed",
        call: Default::default(),
        deadline,
    };
    let start = st.meta.body("in_progress", Vec::new(), None);
    st.emit("response.created", json!({"response": start.clone()}));
    st.emit("response.in_progress", json!({"response": start}));
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
                    st.fail(ApiError::Timeout { seconds });
                    continue;
                }
            };
            match next {
                Some(EngineEvent::Delta { text, .. }) => st.delta(text),
                Some(EngineEvent::Finished { reason, .. }) => st.reason = Some(reason),
                Some(EngineEvent::Done { usage }) => st.finish(usage),
                Some(EngineEvent::Failed(e)) => st.fail(for_responses(ApiError::from(e))),
                Some(EngineEvent::PromptLogprobs { .. } | EngineEvent::Prompted { .. }) => {}
                None => st.fail(ApiError::Internal(
                    "the engine dropped the request without finishing it".into(),
                )),
            }
        }
    })
}

pub async fn get(
    State(s): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    PathId(id): PathId,
) -> Result<Json<Value>, ApiError> {
    let owner = effective_salt(&tenant, None);
    match s.responses.get(&id, &owner) {
        Some(Found::Done(r)) => Ok(Json(r.body.clone())),
        Some(Found::InProgress(body)) => Ok(Json(body)),
        None => Err(not_found(&id)),
    }
}

pub async fn delete(
    State(s): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    PathId(id): PathId,
) -> Result<Json<Value>, ApiError> {
    let owner = effective_salt(&tenant, None);
    if s.responses.remove(&id, &owner) {
        Ok(Json(
            json!({"id": id, "object": "response", "deleted": true}),
        ))
    } else {
        Err(not_found(&id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(owner: &str, text_len: usize) -> Stored {
        Stored::new(
            Some(owner.to_string()),
            vec![ChatMessage::new("user", "x".repeat(text_len))],
            json!({"object": "response"}),
        )
    }

    fn ids_of(store: &ResponseStore, owner: &str) -> Vec<String> {
        let inner = store.inner.lock().unwrap();
        inner
            .1
            .iter()
            .filter(|id| inner.0[*id].owner.as_deref() == Some(owner))
            .cloned()
            .collect()
    }

    #[test]
    fn a_response_in_progress_is_found_deleted_or_dropped() {
        let store = Arc::new(ResponseStore::default());
        let (a, b) = (Some("a".to_string()), Some("b".to_string()));
        let found = |id: &str, owner: &Option<String>| match store.get(id, owner) {
            Some(Found::Done(_)) => "done",
            Some(Found::InProgress(_)) => "in progress",
            None => "none",
        };
        // Completed: kept.
        let guard = store.begin("r1", a.clone(), json!({"status": "in_progress"}));
        assert_eq!((found("r1", &a), found("r1", &b)), ("in progress", "none"));
        guard.store.finish("r1", stored("a", 10));
        drop(guard);
        assert_eq!(found("r1", &a), "done");
        // Deleted while in progress (by its owner only, once): not kept when it completes.
        let guard = store.begin("r2", a.clone(), json!({}));
        assert!(!store.remove("r2", &b));
        assert!(store.remove("r2", &a));
        assert!(!store.remove("r2", &a));
        assert_eq!(found("r2", &a), "none");
        guard.store.finish("r2", stored("a", 10));
        drop(guard);
        assert_eq!(found("r2", &a), "none");
        // Failed or cancelled (its guard dropped unfinished): gone.
        drop(store.begin("r3", a.clone(), json!({})));
        assert_eq!(found("r3", &a), "none");
        assert!(store.pending.lock().unwrap().is_empty());
    }

    #[test]
    fn the_store_keeps_within_its_count_and_bytes_and_a_flood_pushes_out_its_own_first() {
        let store = ResponseStore::default();
        let one = stored("a", 1000).bytes;
        assert!(one > 1000 && one < 1100, "{one}");
        // Within 10 responses and 10 KB: tenant b's two stay while tenant a floods.
        let (count, bytes) = (10, 10 * one);
        for i in 0..2 {
            store.insert_within(format!("b{i}"), stored("b", 1000), count, bytes);
        }
        for i in 0..50 {
            store.insert_within(format!("a{i}"), stored("a", 1000), count, bytes);
        }
        assert_eq!(ids_of(&store, "b"), ["b0", "b1"]);
        let a = ids_of(&store, "a");
        assert_eq!(a.len(), 8);
        assert_eq!(a.last().map(String::as_str), Some("a49"));
        // Bytes: one response of four times the size makes room by dropping a's oldest.
        store.insert_within("a-big".into(), stored("a", 4000), count, bytes);
        let inner = store.inner.lock().unwrap();
        assert!(inner.2 <= bytes, "{} > {bytes}", inner.2);
        assert_eq!(inner.2, inner.0.values().map(|s| s.bytes).sum::<usize>());
        drop(inner);
        assert_eq!(ids_of(&store, "b"), ["b0", "b1"]);
        // Removing gives its bytes back.
        assert!(store.remove("a-big", &Some("a".into())));
        let inner = store.inner.lock().unwrap();
        assert_eq!(inner.2, inner.0.values().map(|s| s.bytes).sum::<usize>());
    }

    #[test]
    fn alone_a_tenant_keeps_its_newest() {
        let store = ResponseStore::default();
        for i in 0..30 {
            store.insert_within(format!("r{i}"), stored("t", 10), 5, usize::MAX);
        }
        assert_eq!(ids_of(&store, "t"), ["r25", "r26", "r27", "r28", "r29"]);
    }
}
