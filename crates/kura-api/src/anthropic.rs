//! Anthropic's Messages API (`POST /v1/messages`) as Kura reads it: a request's `system` (a string or
//! text blocks) and `messages` (text blocks) become chat messages for the model's template, and each
//! `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` a breakpoint (a top-level one at the end
//! of the last message). Errors have Anthropic's shape, `{"type": "error", "error": {"type",
//! "message"}}` ([`AnthropicError`]). The route itself, which runs the request and reports Anthropic's
//! usage split, is `kura-server`'s.

use axum::response::{IntoResponse, Response};
use axum::Json;
use kura_request::ChatMessage;
use kura_request::SamplingParams;
use serde_json::{json, Map, Value};

use crate::cache_control::{CacheTtl, MAX_BREAKPOINTS};
use crate::error::ApiError;

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

/// A checked Messages request.
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

pub fn prepare(value: &Value, served_model: &str) -> Result<MessagesPlan, ApiError> {
    let o = value.as_object().expect("parse_json_object gives objects");
    for unsupported in [
        "tools",
        "tool_choice",
        "thinking",
        "mcp_servers",
        "container",
    ] {
        if o.get(unsupported).is_some_and(|v| !v.is_null()) {
            return Err(invalid(format!(
                "{unsupported} is not supported by this server (text generation only)"
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
        let role = m.get("role").and_then(Value::as_str);
        let role = match role {
            Some(r @ ("user" | "assistant")) => r,
            Some(r) => {
                return Err(invalid(format!(
                    "{at}.role must be \"user\" or \"assistant\", got {r:?} (the system prompt \
                     goes in the top-level system field)"
                )))
            }
            None => return Err(invalid(format!("{at}.role is missing"))),
        };
        let Some(content) = m.get("content") else {
            return Err(invalid(format!("{at}.content is missing")));
        };
        let (text, marks) = content_of(content, &format!("{at}.content"))?;
        let index = messages.len();
        for (off, ttl) in marks {
            breakpoints.push((index, off, ttl));
        }
        messages.push(ChatMessage::new(role, text));
    }
    if let Some(cc) = o.get("cache_control").filter(|v| !v.is_null()) {
        let ttl = CacheTtl::parse_control(cc, "cache_control")?;
        let last = messages.len() - 1;
        breakpoints.push((last, messages[last].content.len(), ttl));
    }
    if breakpoints.len() > MAX_BREAKPOINTS {
        return Err(invalid(format!(
            "a request may have at most {MAX_BREAKPOINTS} cache_control breakpoints, this one has {}",
            breakpoints.len()
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
                    "top_k must be a non-negative integer, got {v}"
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
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(body: Value) -> Result<MessagesPlan, ApiError> {
        prepare(&body, "m")
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
                json!({"model": "m", "max_tokens": 1, "tools": [], "messages": [{"role": "user", "content": "x"}]}),
                "tools is not supported",
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
