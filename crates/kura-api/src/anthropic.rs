//! Anthropic's Messages API (`POST /v1/messages`) as Kura reads it: a request's `system` (a string or
//! text blocks) and `messages` (text blocks) become chat messages for the model's template, and each
//! `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` a breakpoint (a top-level one at the end
//! of the last message). Errors have Anthropic's shape, `{"type": "error", "error": {"type",
//! "message"}}` ([`AnthropicError`]). The route itself, which runs the request and reports Anthropic's
//! usage split, is `kura-server`'s.

use axum::response::{IntoResponse, Response};
use axum::Json;
use kura_request::SamplingParams;
use kura_request::{ChatMessage, TextCodec};
use serde_json::{json, Map, Value};

use crate::cache_control::{
    encode_with_breakpoints, encode_with_breakpoints_and_tools, CacheTtl, ContextKind,
    MAX_BREAKPOINTS,
};
use crate::error::ApiError;
use crate::tools::{
    check_function_name, check_named, check_parameters, check_tool_turns, check_unique,
    prompt_messages, template_call, Guide, ToolChoice, ToolDef, ToolPlan, ToolStyle,
    END_OF_CONTENT,
};
use crate::validate::template_error;
use kura_guide::tools::layout_json;

/// An error in Anthropic's shape.
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

/// Anthropic's error type of an [`ApiError`].
fn anthropic_kind(e: &ApiError) -> &'static str {
    match e.status().as_u16() {
        400 | 405 | 408 | 415 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        504 => "timeout_error",
        _ => "api_error",
    }
}

/// `{"type": "error", "error": {"type", "message"}}`.
pub fn anthropic_body(e: &ApiError) -> Value {
    json!({"type": "error", "error": {"type": anthropic_kind(e), "message": e.to_string()}})
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        let status = self.0.status();
        let body = anthropic_body(&self.0);
        // The OpenAI-shaped response carries the headers (Retry-After, WWW-Authenticate) and the log line.
        let mut response = self.0.into_response();
        let headers = std::mem::take(response.headers_mut());
        let mut out = (status, Json(body)).into_response();
        for (name, value) in headers.iter() {
            if name != axum::http::header::CONTENT_TYPE
                && name != axum::http::header::CONTENT_LENGTH
            {
                out.headers_mut().insert(name.clone(), value.clone());
            }
        }
        out
    }
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::invalid(message, None)
}

/// Anthropic's `thinking`: `{"type": "disabled"}` (or none), or `{"type": "enabled", "budget_tokens"}`
/// with a budget of at least 1,024 tokens and under `max_tokens`, as Anthropic's API checks it; the
/// budget when enabled.
fn thinking_of(v: Option<&Value>, max_tokens: u32) -> Result<Option<u32>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let Some(o) = v.as_object() else {
        return Err(invalid("thinking must be an object"));
    };
    match o.get("type").and_then(Value::as_str) {
        Some("disabled") if o.len() == 1 => Ok(None),
        Some("enabled") => {
            if let Some(k) = o.keys().find(|k| *k != "type" && *k != "budget_tokens") {
                return Err(invalid(format!("thinking.{k} is not a field of thinking")));
            }
            let under = match max_tokens {
                // A count (`count_tokens` has no max_tokens): the lower bound alone.
                u32::MAX => String::new(),
                m => format!(" and less than max_tokens ({m})"),
            };
            match o.get("budget_tokens").and_then(Value::as_i64) {
                Some(b) if b >= 1024 && b < i64::from(max_tokens) => Ok(Some(b as u32)),
                _ => Err(invalid(format!(
                    "thinking.budget_tokens must be an integer of at least 1024{under}, got {}",
                    o.get("budget_tokens").unwrap_or(&Value::Null)
                ))),
            }
        }
        _ => Err(invalid(
            "thinking must be {\"type\": \"disabled\"} or {\"type\": \"enabled\", \
             \"budget_tokens\": n}",
        )),
    }
}

/// A text block's text and breakpoint, checked. `at`: where the block is, for messages.
fn text_block(v: &Value, at: &str) -> Result<(String, Option<CacheTtl>), ApiError> {
    let Some(o) = v.as_object() else {
        return Err(invalid(format!("{at} must be an object (a content block)")));
    };
    match o.get("type").and_then(Value::as_str) {
        Some("text") => {}
        Some(other) => {
            return Err(invalid(format!(
                "{at}.type is {other:?}; this server accepts only text blocks"
            )))
        }
        None => return Err(invalid(format!("{at}.type is missing; give \"text\""))),
    }
    let Some(text) = o.get("text").and_then(Value::as_str) else {
        return Err(invalid(format!("{at}.text must be a string")));
    };
    let ttl = match o.get("cache_control") {
        None | Some(Value::Null) => None,
        Some(cc) => {
            if text.is_empty() {
                return Err(invalid(format!(
                    "{at}.cache_control is set on an empty text block; a breakpoint needs text \
                     before it"
                )));
            }
            Some(CacheTtl::parse_control(cc, &format!("{at}.cache_control"))?)
        }
    };
    Ok((text.to_string(), ttl))
}

/// Text blocks (or one string) → the message text and, per breakpoint, the byte offset inside that text
/// where it ends.
fn content_of(v: &Value, at: &str) -> Result<(String, Vec<(usize, CacheTtl)>), ApiError> {
    match v {
        Value::String(s) => Ok((s.clone(), Vec::new())),
        Value::Array(blocks) => {
            let mut text = String::new();
            let mut marks = Vec::new();
            for (j, b) in blocks.iter().enumerate() {
                let (t, ttl) = text_block(b, &format!("{at}[{j}]"))?;
                text.push_str(&t);
                if let Some(ttl) = ttl {
                    marks.push((text.len(), ttl));
                }
            }
            Ok((text, marks))
        }
        _ => Err(invalid(format!(
            "{at} must be a string or an array of content blocks"
        ))),
    }
}

/// A position (a tool's index, or a number of prompt tokens) with a breakpoint's TTL.
pub type TtlAt = (usize, CacheTtl);

/// A checked Messages request.
#[derive(Debug, Clone)]
pub struct MessagesPlan {
    pub messages: Vec<ChatMessage>,
    /// (message index, byte offset of the breakpoint in its content, TTL).
    pub breakpoints: Vec<(usize, usize, CacheTtl)>,
    pub max_tokens: u32,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    /// A saved context (`/v1/caches`) whose tokens start the prompt.
    pub cached_content: Option<String>,
    /// `cache_salt` (an extension, as on the OpenAI routes): requests share cached KV only with
    /// requests of the same salt.
    pub cache_salt: Option<String>,
    /// The request's tools, if it has any.
    pub tools: Option<ToolPlan>,
    /// Breakpoints after tool definitions: (tool index, TTL).
    pub tool_breakpoints: Vec<TtlAt>,
    /// `output_config.format`: JSON valid under this schema.
    pub guide: Option<Guide>,
    /// The last message is the assistant's, and the model goes on writing it (a prefill): the
    /// response holds what follows that text.
    pub prefill: bool,
    /// `thinking: {"type": "enabled", "budget_tokens"}`: the budget; a reasoning model's reasoning
    /// is answered as `thinking` blocks, closed once it has spent the budget (the server refuses it
    /// where the model does not reason). `None`: the reasoning is left out of the answer.
    pub thinking: Option<u32>,
}

impl MessagesPlan {
    /// The conversation's closed turns: the messages less a prefill.
    pub fn closed_messages(&self) -> &[ChatMessage] {
        let n = self.messages.len() - usize::from(self.prefill);
        &self.messages[..n]
    }
}

/// `output_config`: `format: {"type": "json_schema", "schema"}` (structured outputs); `effort` is
/// refused (this model has no reasoning mode).
fn output_config(o: &Map<String, Value>) -> Result<Option<Guide>, ApiError> {
    let Some(c) = o.get("output_config").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let Some(c) = c.as_object() else {
        return Err(invalid("output_config must be an object"));
    };
    if c.get("effort").is_some_and(|e| !e.is_null()) {
        return Err(invalid(
            "output_config.effort is not supported by this server (this model has no reasoning mode)",
        ));
    }
    if let Some(k) = c.keys().find(|k| *k != "effort" && *k != "format") {
        return Err(invalid(format!(
            "output_config has no field {k:?}; give format"
        )));
    }
    match c.get("format") {
        None | Some(Value::Null) => Ok(None),
        Some(f) => match (f.get("type").and_then(Value::as_str), f.get("schema")) {
            (Some("json_schema"), Some(schema @ Value::Object(_))) => {
                Ok(Some(Guide::JsonSchema(schema.clone())))
            }
            (Some("json_schema"), _) => Err(invalid(
                "output_config.format needs a schema (a JSON schema object)",
            )),
            _ => Err(invalid("output_config.format.type must be \"json_schema\"")),
        },
    }
}

/// Anthropic's `tools` and `tool_choice`.
fn anthropic_tools(o: &Map<String, Value>) -> Result<(Option<ToolPlan>, Vec<TtlAt>), ApiError> {
    const P: &str = "tools";
    let mut defs = Vec::new();
    let mut marks = Vec::new();
    match o.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(items)) => {
            for (i, t) in items.iter().enumerate() {
                let at = format!("tools[{i}]");
                let Some(t) = t.as_object() else {
                    return Err(invalid(format!("{at} must be an object (a tool)")));
                };
                if let Some(kind) = t
                    .get("type")
                    .and_then(Value::as_str)
                    .filter(|k| *k != "custom")
                {
                    return Err(invalid(format!(
                        "{at} is a server tool of type {kind:?}, which this server does not run; \
                         give custom tools (name, description, input_schema)"
                    )));
                }
                let Some(name) = t.get("name").and_then(Value::as_str) else {
                    return Err(invalid(format!("{at}.name is missing")));
                };
                if !check_function_name(name) {
                    return Err(invalid(format!(
                        "{at}.name must be 1 to 64 letters, digits, _ or -, got {name:?}"
                    )));
                }
                let description = match t.get("description") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(d)) => Some(d.clone()),
                    Some(_) => return Err(invalid(format!("{at}.description must be text"))),
                };
                if t.get("input_schema").is_none() {
                    return Err(invalid(format!(
                        "{at}.input_schema is missing (a JSON schema)"
                    )));
                }
                let parameters =
                    check_parameters(t.get("input_schema"), &format!("{at}.input_schema"), P)?;
                if let Some(cc) = t.get("cache_control").filter(|v| !v.is_null()) {
                    marks.push((
                        i,
                        CacheTtl::parse_control(cc, &format!("{at}.cache_control"))?,
                    ));
                }
                let strict = match t.get("strict") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(_) => return Err(invalid(format!("{at}.strict must be a boolean"))),
                };
                defs.push(ToolDef {
                    name: name.to_string(),
                    description,
                    parameters,
                    strict,
                });
            }
        }
        Some(_) => return Err(invalid("tools must be an array of tools")),
    }
    check_unique(&defs, P)?;
    let (choice, parallel) = match o.get("tool_choice") {
        None | Some(Value::Null) => (ToolChoice::Auto, true),
        Some(Value::Object(c)) => {
            let parallel = match c.get("disable_parallel_tool_use") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => !b,
                Some(_) => {
                    return Err(invalid(
                        "tool_choice.disable_parallel_tool_use must be a boolean",
                    ))
                }
            };
            let choice = match c.get("type").and_then(Value::as_str) {
                Some("auto") => ToolChoice::Auto,
                Some("any") => ToolChoice::Required,
                Some("none") => ToolChoice::None,
                Some("tool") => match c.get("name").and_then(Value::as_str) {
                    Some(n) => ToolChoice::Named(n.to_string()),
                    None => return Err(invalid("tool_choice of type tool needs a name")),
                },
                Some(other) => {
                    return Err(invalid(format!(
                        "tool_choice.type must be auto, any, tool or none, got {other:?}"
                    )))
                }
                None => return Err(invalid("tool_choice.type is missing")),
            };
            (choice, parallel)
        }
        Some(_) => return Err(invalid("tool_choice must be an object with a type")),
    };
    match &choice {
        ToolChoice::Required | ToolChoice::Named(_) if defs.is_empty() => {
            return Err(invalid(
                "tool_choice asks for a tool call but the request has no tools",
            ))
        }
        ToolChoice::Named(n) => check_named(&defs, n, "tool_choice")?,
        _ => {}
    }
    if defs.is_empty() {
        return Ok((None, marks));
    }
    Ok((
        Some(ToolPlan {
            tools: defs,
            choice,
            parallel,
        }),
        marks,
    ))
}

/// One message's content blocks: text (with breakpoints), an assistant's `tool_use` blocks, a user's
/// `tool_result` blocks. Pushes the chat messages it makes (tool results first, each its own `tool`
/// message, then the text) and their breakpoints.
fn push_message(
    role: &str,
    content: &Value,
    at: &str,
    messages: &mut Vec<ChatMessage>,
    breakpoints: &mut Vec<(usize, usize, CacheTtl)>,
) -> Result<(), ApiError> {
    let blocks = match content {
        Value::String(s) => {
            messages.push(ChatMessage::new(role, s.clone()));
            return Ok(());
        }
        Value::Array(blocks) => blocks,
        _ => {
            return Err(invalid(format!(
                "{at}.content must be a string or an array of content blocks"
            )))
        }
    };
    let mut text = String::new();
    let mut marks = Vec::new();
    let mut calls = Vec::new();
    let mut end_marks = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let bat = format!("{at}.content[{j}]");
        let kind = b.get("type").and_then(Value::as_str);
        let control = |b: &Value| -> Result<Option<CacheTtl>, ApiError> {
            match b.get("cache_control") {
                None | Some(Value::Null) => Ok(None),
                Some(cc) => CacheTtl::parse_control(cc, &format!("{bat}.cache_control")).map(Some),
            }
        };
        match (kind, role) {
            (Some("tool_use"), "assistant") => {
                let id = b
                    .get("id")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty());
                let name = b.get("name").and_then(Value::as_str);
                let (Some(id), Some(name)) = (id, name) else {
                    return Err(invalid(format!("{bat} (tool_use) needs an id and a name")));
                };
                let input = match b.get("input") {
                    Some(v @ Value::Object(_)) => v.clone(),
                    _ => return Err(invalid(format!("{bat}.input must be an object"))),
                };
                calls.push(template_call(id, name, &layout_json(&input), Some(input)));
                if let Some(ttl) = control(b)? {
                    end_marks.push(ttl);
                }
            }
            (Some("tool_result"), "user") => {
                let Some(id) = b.get("tool_use_id").and_then(Value::as_str) else {
                    return Err(invalid(format!("{bat} (tool_result) needs a tool_use_id")));
                };
                let (mut result, mut inner) = match b.get("content") {
                    None | Some(Value::Null) => (String::new(), Vec::new()),
                    Some(c) => content_of(c, &format!("{bat}.content"))?,
                };
                if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                    const ERROR: &str = "Error: ";
                    result = format!("{ERROR}{result}");
                    for (at, _) in &mut inner {
                        *at = at.saturating_add(ERROR.len());
                    }
                }
                if !text.is_empty() {
                    return Err(invalid(format!(
                        "{bat}: tool_result blocks must come before any text in a user message"
                    )));
                }
                messages.push(ChatMessage {
                    role: "tool".into(),
                    content: result,
                    tool_call_id: Some(id.to_string()),
                    ..Default::default()
                });
                // Breakpoints on the result's own blocks fall inside the tool message.
                let at = messages.len() - 1;
                breakpoints.extend(inner.into_iter().map(|(off, ttl)| (at, off, ttl)));
                if let Some(ttl) = control(b)? {
                    breakpoints.push((at, END_OF_CONTENT, ttl));
                }
            }
            // A reasoning model's earlier thinking, sent back as Anthropic's clients do: not
            // written into the prompt (reasoning models' templates leave out earlier turns').
            (Some(kind @ ("thinking" | "redacted_thinking")), "assistant") => {
                let field = match kind {
                    "thinking" => "thinking",
                    _ => "data",
                };
                if !b.get(field).is_some_and(Value::is_string) {
                    return Err(invalid(format!(
                        "{bat}.{field} must be a string ({kind} block)"
                    )));
                }
            }
            (Some("tool_use" | "tool_result"), _) => {
                return Err(invalid(format!(
                    "{bat}: {} blocks belong in {} messages",
                    kind.unwrap_or_default(),
                    if kind == Some("tool_use") {
                        "assistant"
                    } else {
                        "user"
                    }
                )))
            }
            _ => {
                let (t, ttl) = text_block(b, &bat)?;
                text.push_str(&t);
                if let Some(ttl) = ttl {
                    marks.push((text.len(), ttl));
                }
            }
        }
    }
    if text.is_empty() && calls.is_empty() && messages.last().is_some_and(|m| m.role == "tool") {
        return Ok(());
    }
    let index = messages.len();
    breakpoints.extend(marks.into_iter().map(|(off, ttl)| (index, off, ttl)));
    breakpoints.extend(
        end_marks
            .into_iter()
            .map(|ttl| (index, END_OF_CONTENT, ttl)),
    );
    messages.push(ChatMessage {
        role: role.into(),
        content: text,
        tool_calls: (!calls.is_empty()).then_some(Value::Array(calls)),
        ..Default::default()
    });
    Ok(())
}

/// The prompt tokens of a Messages request (tools and tool turns written for the model's template),
/// and per breakpoint the number of prompt tokens up to it, with its TTL. `saved`: a saved context
/// that starts the prompt.
pub fn encode_messages(
    codec: &dyn TextCodec,
    plan: &MessagesPlan,
    saved: Option<(&ContextKind, &[u32])>,
) -> Result<(Vec<u32>, Vec<TtlAt>), ApiError> {
    let (messages, marks, tools_json) = prompt_messages(
        plan.messages.clone(),
        plan.tools.as_ref(),
        ToolStyle::of(codec),
        &plan.breakpoints,
        &plan.tool_breakpoints,
    );
    if plan.prefill {
        return encode_prefilled(codec, messages, marks, tools_json.as_ref());
    }
    let (tokens, positions) =
        match tools_json {
            Some(_) if saved.is_some() => return Err(invalid(
                "cached_content cannot be combined with tools on this model: its chat template \
                 writes the tools itself, ahead of the saved context",
            )),
            // Breakpoints are placed in the text the template writes with the tools (a breakpoint on
            // the tools ends with the first message's content, where such templates write them).
            Some(tools) => encode_with_breakpoints_and_tools(codec, &messages, &marks, &tools)?,
            None => encode_with_breakpoints(codec, &messages, &marks, saved)?,
        };
    Ok((
        tokens,
        positions
            .into_iter()
            .zip(marks.iter().map(|&(_, _, ttl)| ttl))
            .filter_map(|(at, ttl)| Some((at?, ttl)))
            .collect(),
    ))
}

/// [`encode_messages`] of a request whose last message, an assistant's, the model continues: the
/// prompt ends inside that turn, after its text; breakpoints fall where they fall in the conversation
/// before it (one on the continued text itself is not placed).
fn encode_prefilled(
    codec: &dyn TextCodec,
    messages: Vec<ChatMessage>,
    marks: Vec<(usize, usize, CacheTtl)>,
    tools: Option<&Value>,
) -> Result<(Vec<u32>, Vec<TtlAt>), ApiError> {
    let tokens = codec
        .encode_chat_continuing(&messages, tools)
        .map_err(template_error)?;
    let before = messages.len().saturating_sub(1);
    let marks: Vec<_> = marks.into_iter().filter(|&(m, _, _)| m < before).collect();
    if marks.is_empty() {
        return Ok((tokens, Vec::new()));
    }
    let closed = &messages[..before];
    let (_, positions) = match tools {
        Some(t) => encode_with_breakpoints_and_tools(codec, closed, &marks, t)?,
        None => encode_with_breakpoints(codec, closed, &marks, None)?,
    };
    let n = tokens.len();
    Ok((
        tokens,
        positions
            .into_iter()
            .zip(marks.iter().map(|&(_, _, ttl)| ttl))
            .filter_map(|(at, ttl)| Some((at?.min(n), ttl)))
            .collect(),
    ))
}

fn number(o: &Map<String, Value>, name: &str) -> Result<Option<f64>, ApiError> {
    match o.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .map(Some)
            .ok_or_else(|| invalid(format!("{name} must be a number, got {v}"))),
    }
}

/// The fields of a `POST /v1/messages/count_tokens` request (Anthropic's schema allows no others).
pub const COUNT_FIELDS: [&str; 8] = [
    "cache_control",
    "messages",
    "model",
    "output_config",
    "system",
    "thinking",
    "tool_choice",
    "tools",
];

/// A `count_tokens` request, checked as [`prepare`] checks the same fields of a Messages request: its
/// plan's prompt ([`encode_messages`]) is the one `/v1/messages` would compute for them, whose usage
/// (`input_tokens` + `cache_creation_input_tokens` + `cache_read_input_tokens`) is its length. A field
/// of Messages that is not one of count_tokens' (`max_tokens`, `stream`, sampling) is refused by name.
pub fn prepare_count(value: &Value, served_model: &str) -> Result<MessagesPlan, ApiError> {
    let o = value.as_object().expect("parse_json_object gives objects");
    crate::body::only_fields(o, &COUNT_FIELDS, "count_tokens")?;
    let mut o = o.clone();
    // The prompt does not depend on the output's length: any valid one (the largest, so that a
    // thinking budget, which must be under it, is checked alone).
    o.insert("max_tokens".into(), json!(u32::MAX));
    prepare(&Value::Object(o), served_model)
}

/// The fields of a `POST /v1/messages` request: Anthropic's (its schema allows no others), its beta
/// fields (`mcp_servers` and `output_format`, refused by name below; `context_management`, which
/// Claude Code sends and which has nothing to clear here), and Kura's extensions. Any other is refused
/// by name, as Anthropic's API refuses it: a field sent in `extra_body` (`seed`, `logit_bias`) is not
/// dropped without a word.
pub const MESSAGE_FIELDS: [&str; 23] = [
    "cache_control",
    "cache_salt",
    "cached_content",
    "container",
    "context_management",
    "inference_geo",
    "max_tokens",
    "mcp_servers",
    "messages",
    "metadata",
    "model",
    "output_config",
    "output_format",
    "service_tier",
    "stop_sequences",
    "stream",
    "system",
    "temperature",
    "thinking",
    "tool_choice",
    "tools",
    "top_k",
    "top_p",
];

pub fn prepare(value: &Value, served_model: &str) -> Result<MessagesPlan, ApiError> {
    let o = value.as_object().expect("parse_json_object gives objects");
    crate::body::only_fields(o, &MESSAGE_FIELDS, "messages")?;
    if o.get("output_format").is_some_and(|v| !v.is_null()) {
        return Err(invalid(
            "output_format is the beta's name: give output_config.format (the same json_schema \
             format)",
        ));
    }
    // `context_management` (clearing old thinking blocks or tool results as a conversation grows)
    // is checked as an object and has no effect: the prompt is the messages as sent.
    if o.get("context_management")
        .is_some_and(|v| !v.is_null() && !v.is_object())
    {
        return Err(invalid("context_management must be an object"));
    }
    for unsupported in ["mcp_servers", "container"] {
        if o.get(unsupported).is_some_and(|v| !v.is_null()) {
            return Err(invalid(format!(
                "{unsupported} is not supported by this server"
            )));
        }
    }
    match o.get("model").and_then(Value::as_str) {
        Some(m) => crate::validate::check_model(m, served_model)?,
        None => return Err(invalid("model is required (a string)")),
    }
    let max_tokens = match o.get("max_tokens") {
        Some(v) => match v.as_i64() {
            Some(m) if m >= 1 && m <= i64::from(u32::MAX) => m as u32,
            _ => {
                return Err(invalid(format!(
                    "max_tokens must be an integer from 1 to {}, got {v}",
                    u32::MAX
                )))
            }
        },
        None => return Err(invalid("max_tokens is required")),
    };
    let thinking = thinking_of(o.get("thinking"), max_tokens)?;
    let mut messages = Vec::new();
    let mut breakpoints = Vec::new();
    match o.get("system") {
        None | Some(Value::Null) => {}
        Some(v) => {
            let (text, marks) = content_of(v, "system")?;
            for (at, ttl) in marks {
                breakpoints.push((0, at, ttl));
            }
            messages.push(ChatMessage::new("system", text));
        }
    }
    let Some(list) = o.get("messages").and_then(Value::as_array) else {
        return Err(invalid("messages is required (an array of messages)"));
    };
    if list.is_empty() {
        return Err(invalid("messages must contain at least one message"));
    }
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = match m.get("role") {
            Some(Value::String(r)) if r == "user" || r == "assistant" => r.as_str(),
            Some(r) if !r.is_null() => {
                let hint = match r.as_str() {
                    Some("system") => " (the system prompt goes in the top-level system field)",
                    Some("tool") => " (a tool's result goes in a user message's tool_result block)",
                    _ => "",
                };
                return Err(invalid(format!(
                    "{at}.role must be \"user\" or \"assistant\", got {r}{hint}"
                )));
            }
            _ => return Err(invalid(format!("{at}.role is missing"))),
        };
        let Some(content) = m.get("content") else {
            return Err(invalid(format!("{at}.content is missing")));
        };
        push_message(role, content, &at, &mut messages, &mut breakpoints)?;
    }
    if let Some(cc) = o.get("cache_control").filter(|v| !v.is_null()) {
        let ttl = CacheTtl::parse_control(cc, "cache_control")?;
        let last = messages.len() - 1;
        breakpoints.push((last, END_OF_CONTENT, ttl));
    }
    check_tool_turns(&messages)
        .map_err(|e| invalid(e.to_string().replace("tool_call_id", "tool_use_id")))?;
    // A last assistant message is a prefill: the model goes on from its text (an empty one is the
    // turn the generation prompt opens anyway).
    if messages
        .last()
        .is_some_and(|m| m.role == "assistant" && m.tool_calls.is_none() && m.content.is_empty())
    {
        messages.pop();
        breakpoints.retain(|&(m, _, _)| m < messages.len());
        if messages.is_empty() {
            return Err(invalid(
                "messages must hold more than an empty assistant message",
            ));
        }
    }
    let prefill = messages
        .last()
        .is_some_and(|m| m.role == "assistant" && m.tool_calls.is_none());
    if prefill
        && messages
            .last()
            .is_some_and(|m| m.content.ends_with(char::is_whitespace))
    {
        return Err(invalid(
            "final assistant content cannot end with trailing whitespace",
        ));
    }
    let (tools, tool_breakpoints) = anthropic_tools(o)?;
    let guide = output_config(o)?;
    if prefill && (guide.is_some() || tools.as_ref().is_some_and(ToolPlan::grammar_starts_turn)) {
        return Err(invalid(
            "a final assistant message (a prefill) cannot be combined with output_config.format, \
             tool_choice any or tool, or a strict tool: the output's grammar starts the turn",
        ));
    }
    if guide.is_some() && tools.as_ref().is_some_and(|t| t.constrained().is_some()) {
        return Err(invalid(
            "output_config.format cannot be combined with tool_choice any or tool: the output is \
             then the tool call",
        ));
    }
    if breakpoints.len() + tool_breakpoints.len() > MAX_BREAKPOINTS {
        return Err(invalid(format!(
            "a request may have at most {MAX_BREAKPOINTS} cache_control breakpoints, got {}",
            breakpoints.len() + tool_breakpoints.len()
        )));
    }
    let temperature = number(o, "temperature")?.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&temperature) {
        return Err(invalid(format!(
            "temperature must be between 0 and 1, got {temperature}"
        )));
    }
    let top_p = number(o, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(invalid(format!(
            "top_p must be greater than 0 and at most 1, got {top_p}"
        )));
    }
    let top_k = match o.get("top_k") {
        None | Some(Value::Null) => 0,
        Some(v) => match v.as_i64() {
            Some(k) if (0..=i64::from(u32::MAX)).contains(&k) => k as usize,
            _ => {
                return Err(invalid(format!(
                    "top_k must be an integer from 0 to {}, got {v}",
                    u32::MAX
                )))
            }
        },
    };
    let stop = match o.get("stop_sequences") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => {
            let mut out = Vec::new();
            for (i, s) in a.iter().enumerate() {
                match s.as_str() {
                    Some(s) if s.len() > crate::validate::MAX_STOP_BYTES => {
                        return Err(invalid(format!(
                            "stop_sequences[{i}] may be at most {} bytes, got {}",
                            crate::validate::MAX_STOP_BYTES,
                            s.len()
                        )))
                    }
                    Some(s) if !s.is_empty() => out.push(s.to_string()),
                    _ => {
                        return Err(invalid(format!(
                            "stop_sequences[{i}] must be a non-empty string"
                        )))
                    }
                }
            }
            if out.len() > crate::validate::MAX_STOP {
                return Err(invalid(format!(
                    "stop_sequences may hold at most {} strings, got {}",
                    crate::validate::MAX_STOP,
                    out.len()
                )));
            }
            out
        }
        Some(v) => {
            return Err(invalid(format!(
                "stop_sequences must be an array of strings, got {v}"
            )))
        }
    };
    let stream = match o.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(invalid(format!("stream must be a boolean, got {v}"))),
    };
    let cached_content = match o.get("cached_content") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => {
            return Err(invalid(format!(
                "cached_content must be the id of a saved context (a string), got {v}"
            )))
        }
    };
    // Ignored (one tier; no abuse monitoring here), but checked as Anthropic's API checks them.
    crate::responses::check_service_tier(o.get("service_tier"), &["auto", "standard_only"])?;
    match o.get("metadata") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => match m.get("user_id") {
            None | Some(Value::Null) => {}
            Some(Value::String(u)) if u.chars().count() <= 256 => {}
            Some(_) => {
                return Err(invalid(
                    "metadata.user_id must be a string of at most 256 characters",
                ))
            }
        },
        Some(v) => return Err(invalid(format!("metadata must be an object, got {v}"))),
    }
    let cache_salt = match o.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => {
            crate::validate::check_salt(s)?;
            Some(s.clone())
        }
        Some(v) => {
            return Err(ApiError::invalid(
                format!("cache_salt must be a string, got {v}"),
                Some("cache_salt"),
            ))
        }
    };
    // A saved context is owned, and its blocks salted, by its tenant alone (as on the OpenAI routes).
    if prefill && cached_content.is_some() {
        return Err(invalid(
            "cached_content cannot be combined with a final assistant message (a prefill)",
        ));
    }
    if cache_salt.is_some() && cached_content.is_some() {
        return Err(ApiError::invalid(
            "cache_salt cannot be combined with cached_content: a saved context's KV belongs to its \
             API key, not to a salt",
            Some("cache_salt"),
        ));
    }
    // As Anthropic's API: a turn that must call a tool cannot think first.
    if thinking.is_some()
        && tools
            .as_ref()
            .is_some_and(|t| matches!(t.choice, ToolChoice::Required | ToolChoice::Named(_)))
    {
        return Err(ApiError::invalid(
            "thinking may not be enabled when tool_choice forces a tool call (any or tool); use auto \
             or none",
            Some("thinking"),
        ));
    }
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k,
        ..SamplingParams::default()
    };
    Ok(MessagesPlan {
        messages,
        breakpoints,
        max_tokens,
        sampling,
        stop,
        stream,
        cached_content,
        cache_salt,
        tools,
        tool_breakpoints,
        guide,
        prefill,
        thinking,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(body: Value) -> Result<MessagesPlan, ApiError> {
        prepare(&body, "m")
    }

    #[test]
    fn breakpoints_inside_a_tool_results_blocks_are_placed_and_counted() {
        let body = |n: usize| {
            let blocks: Vec<Value> = (0..n)
                .map(|_| json!({"type": "text", "text": "sunny", "cache_control": {"type": "ephemeral"}}))
                .collect();
            json!({"model": "m", "max_tokens": 5, "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": true,
                                              "content": blocks}]}]})
        };
        let p = plan(body(1)).unwrap();
        let tool = p.messages.iter().position(|m| m.role == "tool").unwrap();
        assert_eq!(p.messages[tool].content, "Error: sunny");
        assert_eq!(
            p.breakpoints,
            vec![(tool, "Error: sunny".len(), CacheTtl::FiveMinutes)]
        );
        let e = plan(body(MAX_BREAKPOINTS + 1)).unwrap_err();
        assert!(e.to_string().contains("at most"), "{e}");
    }

    #[test]
    fn a_last_assistant_message_is_a_prefill() {
        let body = |last: Value| {
            json!({"model": "m", "max_tokens": 5, "messages": [
                {"role": "user", "content": "JSON please"}, {"role": "assistant", "content": last}]})
        };
        let p = plan(body(json!("{"))).unwrap();
        assert!(p.prefill);
        assert_eq!(p.closed_messages().len(), 1);
        assert_eq!(p.messages.last().unwrap().content, "{");
        // An empty one is the turn the generation prompt opens.
        let p = plan(body(json!(""))).unwrap();
        assert!(!p.prefill && p.messages.len() == 1);
        let e = plan(body(json!("{ "))).unwrap_err();
        assert!(e.to_string().contains("trailing whitespace"), "{e}");
        let mut b = body(json!("{"));
        b["output_config"] =
            json!({"format": {"type": "json_schema", "schema": {"type": "object"}}});
        let e = plan(b).unwrap_err();
        assert!(e.to_string().contains("prefill"), "{e}");
        let mut b = body(json!("{"));
        b["cached_content"] = json!("ctx");
        assert!(plan(b).unwrap_err().to_string().contains("prefill"));
        // A user message last: no prefill.
        let p = plan(json!({"model": "m", "max_tokens": 5,
                            "messages": [{"role": "user", "content": "Hi"}]}))
        .unwrap();
        assert!(!p.prefill);
    }

    #[test]
    fn a_messages_request_refuses_fields_outside_anthropics_schema_and_kuras_extensions() {
        let base = json!({"model": "m", "max_tokens": 1,
                          "messages": [{"role": "user", "content": "x"}]});
        assert!(prepare(&base, "m").is_ok());
        for extra in ["seed", "logit_bias", "temprature", "n"] {
            let mut b = base.clone();
            b[extra] = json!(1);
            let e = prepare(&b, "m").unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("{extra} is not a field of messages")),
                "{e}"
            );
        }
        // Kura's extensions are fields; so is Claude Code's context_management, without effect.
        let mut b = base.clone();
        b["cache_salt"] = json!("tenant-a");
        b["context_management"] =
            json!({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]});
        assert!(prepare(&b, "m").is_ok());
        let mut b = base.clone();
        b["output_format"] = json!({"type": "json_schema", "schema": {"type": "object"}});
        let e = prepare(&b, "m").unwrap_err().to_string();
        assert!(e.contains("output_config.format"), "{e}");
    }

    #[test]
    fn a_count_reads_the_prompt_fields_as_messages_does_and_refuses_the_rest() {
        let body = json!({
            "model": "m", "system": [{"type": "text", "text": "abc", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "w", "input_schema": {"type": "object"}}],
        });
        let count = prepare_count(&body, "m").unwrap();
        let mut with_max = body.clone();
        with_max["max_tokens"] = json!(8);
        let messages = plan(with_max).unwrap();
        assert_eq!(count.messages, messages.messages);
        assert_eq!(count.breakpoints, messages.breakpoints);
        assert_eq!(count.tools, messages.tools);
        for extra in ["max_tokens", "stream", "temperature", "cache_salt"] {
            let mut b = body.clone();
            b[extra] = json!(1);
            let e = prepare_count(&b, "m").unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("{extra} is not a field of count_tokens")),
                "{e}"
            );
        }
    }

    #[test]
    fn breakpoints_are_found_in_system_and_message_blocks() {
        let p = plan(json!({
            "model": "m", "max_tokens": 8,
            "system": [{"type": "text", "text": "abc", "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": "de"}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "q1", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                {"type": "text", "text": "q2"}]}],
        }))
        .unwrap();
        assert_eq!(p.messages[0].content, "abcde");
        assert_eq!(p.messages[1].content, "q1q2");
        assert_eq!(
            p.breakpoints,
            vec![(0, 3, CacheTtl::FiveMinutes), (1, 2, CacheTtl::OneHour)]
        );
    }

    #[test]
    fn thinking_disabled_is_what_the_server_does_anyway() {
        let body = |thinking: Value| {
            json!({"model": "m", "max_tokens": 1, "thinking": thinking,
                   "messages": [{"role": "user", "content": "x"}]})
        };
        assert_eq!(
            plan(body(json!({"type": "disabled"}))).unwrap().thinking,
            None
        );
        assert!(plan(body(json!({"type": "disabled", "budget_tokens": 5}))).is_err());
        // Enabled: read (the server refuses it where the model does not reason), the budget
        // checked as Anthropic checks it.
        let big = |thinking: Value| {
            json!({"model": "m", "max_tokens": 4096, "thinking": thinking,
                   "messages": [{"role": "user", "content": "x"}]})
        };
        assert_eq!(
            plan(big(json!({"type": "enabled", "budget_tokens": 1024})))
                .unwrap()
                .thinking,
            Some(1024)
        );
        // Counted as the request would be: the budget checked, with no max_tokens to be under.
        let count = |thinking: Value| {
            prepare_count(
                &json!({"model": "m", "thinking": thinking,
                        "messages": [{"role": "user", "content": "x"}]}),
                "m",
            )
        };
        assert!(count(json!({"type": "enabled", "budget_tokens": 2048})).is_ok());
        assert!(count(json!({"type": "enabled", "budget_tokens": 10})).is_err());
        for bad in [
            json!({"type": "enabled", "budget_tokens": 1023}),
            json!({"type": "enabled", "budget_tokens": 4096}),
            json!({"type": "enabled"}),
            json!({"type": "enabled", "budget_tokens": 2048, "effort": "high"}),
            json!({"type": "sometimes"}),
            json!("enabled"),
        ] {
            let e = plan(big(bad.clone())).unwrap_err().to_string();
            assert!(e.contains("thinking"), "{bad}: {e}");
        }
        // Thinking blocks sent back in an assistant turn are taken and left out of the prompt.
        let p = plan(json!({"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": ""},
                {"type": "text", "text": "y"}]},
            {"role": "user", "content": "z"}]}))
        .unwrap();
        assert_eq!(p.messages[1].content, "y");
        // A forced call cannot think first, as Anthropic's API has it.
        let forced = json!({"model": "m", "max_tokens": 4096,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "x"}]});
        let e = plan(forced).unwrap_err().to_string();
        assert!(e.contains("forces a tool call"), "{e}");
        // A thinking block's text must be text.
        let bad = json!({"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]},
            {"role": "user", "content": "z"}]});
        assert!(plan(bad)
            .unwrap_err()
            .to_string()
            .contains(".thinking must be a string"));
    }

    #[test]
    fn bad_requests_name_the_problem() {
        let cc = json!({"type": "ephemeral"});
        let block = json!({"type": "text", "text": "x", "cache_control": cc});
        let cases = [
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
                "max_tokens is required",
            ),
            (
                json!({"model": "other", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}),
                "does not exist",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": []}),
                "at least one message",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}),
                "top-level system",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
                "only text blocks",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [block, block, block, block, block]}]}),
                "at most 4",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}]}),
                "\"5m\" or \"1h\"",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]}]}),
                "ephemeral",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "", "cache_control": cc}]}]}),
                "empty text block",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]}),
                "temperature",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "thinking": {"type": "enabled"}, "messages": [{"role": "user", "content": "x"}]}),
                "thinking.budget_tokens must be",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "x"}]}),
                "input_schema is missing",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "tools": [{"type": "web_search_20250305", "name": "w"}], "messages": [{"role": "user", "content": "x"}]}),
                "server tool",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "x"}]}),
                "has no tools",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "4"}]}]}),
                "no earlier assistant",
            ),
        ];
        for (body, needle) in cases {
            match plan(body.clone()) {
                Ok(_) => panic!("accepted {body}"),
                Err(e) => assert!(e.to_string().contains(needle), "{e} (wanted {needle:?})"),
            }
        }
    }
}
