//! Context caching as requests spell it: `cache_control` time to live ([`CacheTtl`]), a saved
//! context's TTL ([`parse_context_ttl`]), OpenAI's `prompt_cache_retention` ([`retention_pin`]) and where
//! each breakpoint falls in the prompt's tokens ([`encode_with_breakpoints`]). Saved contexts themselves
//! are `kura-server`'s.

use kura_request::PinSpec;
use kura_request::{ChatMessage, TextCodec};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::ApiError;
use crate::validate::{template_error, tokenize_error};

/// Anthropic's limit of `cache_control` breakpoints per request.
pub const MAX_BREAKPOINTS: usize = 4;

/// Longest time to live of a saved context.
pub const MAX_CONTEXT_TTL_S: u64 = 365 * 24 * 3600;

/// A `cache_control` time to live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheTtl {
    FiveMinutes,
    OneHour,
}

impl CacheTtl {
    pub fn millis(self) -> u64 {
        match self {
            CacheTtl::FiveMinutes => 5 * 60 * 1000,
            CacheTtl::OneHour => 60 * 60 * 1000,
        }
    }

    /// `{"type": "ephemeral", "ttl": "5m" | "1h"}` (ttl optional, 5 minutes by default).
    pub fn parse_control(v: &Value, at: &str) -> Result<Self, ApiError> {
        let Some(o) = v.as_object() else {
            return Err(ApiError::invalid(
                format!("{at} must be an object like {{\"type\": \"ephemeral\"}}"),
                None,
            ));
        };
        match o.get("type") {
            Some(Value::String(t)) if t == "ephemeral" => {}
            other => {
                let got = other.map_or_else(|| "nothing".to_string(), Value::to_string);
                return Err(ApiError::invalid(
                    format!("{at}.type must be \"ephemeral\", got {got}"),
                    None,
                ));
            }
        }
        match o.get("ttl") {
            None | Some(Value::Null) => Ok(CacheTtl::FiveMinutes),
            Some(Value::String(s)) if s == "5m" => Ok(CacheTtl::FiveMinutes),
            Some(Value::String(s)) if s == "1h" => Ok(CacheTtl::OneHour),
            Some(other) => Err(ApiError::invalid(
                format!("{at}.ttl must be \"5m\" or \"1h\", got {other}"),
                None,
            )),
        }
    }
}

/// A saved context's `ttl`: seconds as a number, or a string `"<n>s"`, `"<n>m"`, `"<n>h"`, `"<n>d"`;
/// 1 s to [`MAX_CONTEXT_TTL_S`].
pub fn parse_context_ttl(v: &Value) -> Result<u64, ApiError> {
    let bad = || {
        ApiError::invalid(
            format!(
                "ttl must be a number of seconds or a string like \"300s\", \"30m\", \"1h\" or \
                 \"7d\", from 1 second to {} days; got {v}",
                MAX_CONTEXT_TTL_S / 86400
            ),
            Some("ttl"),
        )
    };
    let seconds = match v {
        Value::Number(n) => n.as_u64().ok_or_else(bad)?,
        Value::String(s) => {
            if !s.is_ascii() || s.is_empty() {
                return Err(bad());
            }
            let (digits, unit) = s.split_at(s.len() - 1);
            let scale = match unit {
                "s" => 1,
                "m" => 60,
                "h" => 3600,
                "d" => 86400,
                _ => return Err(bad()),
            };
            let n: u64 = digits.parse().map_err(|_| bad())?;
            n.checked_mul(scale).ok_or_else(bad)?
        }
        _ => return Err(bad()),
    };
    if seconds == 0 || seconds > MAX_CONTEXT_TTL_S {
        return Err(bad());
    }
    Ok(seconds)
}

/// `prompt_cache_retention` of the OpenAI routes: `"in_memory"` (the default: ordinary prefix caching) or
/// `"24h"` (the whole prompt pinned for a day and written through to the lower tiers). Returns the pin
/// for a prompt of `len` tokens, if any.
pub fn retention_pin(
    v: Option<&str>,
    len: usize,
    now_ms: u64,
) -> Result<Option<PinSpec>, ApiError> {
    match v {
        None | Some("in_memory") | Some("in-memory") => Ok(None),
        Some("24h") => Ok(Some(PinSpec {
            tokens: len,
            expires_at_ms: now_ms.saturating_add(24 * 3600 * 1000),
            persist: true,
        })),
        Some(other) => Err(ApiError::invalid(
            format!("prompt_cache_retention must be \"in_memory\" or \"24h\", got {other:?}"),
            Some("prompt_cache_retention"),
        )),
    }
}

/// Length of the longest common prefix of `a` and `b`.
pub fn lcp(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// `full` with `prefix` as its start: `full` itself when it starts with `prefix` (the usual case), else
/// `prefix` followed by what `full` has after their common part (a tokenization that differs at the
/// seam must not cost the saved context its cache hit).
pub fn join_prefix(prefix: &[u32], full: Vec<u32>) -> Vec<u32> {
    let common = lcp(prefix, &full);
    if common == prefix.len() {
        return full;
    }
    let mut out = prefix.to_vec();
    out.extend_from_slice(&full[common..]);
    out
}

/// What a saved context holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContextKind {
    /// Chat messages: requests' own messages follow them in one chat template.
    Messages { messages: Vec<ChatMessage> },
    /// Raw text: requests' prompts (or rendered messages) follow it.
    Prompt { text: String },
}

/// The prompt tokens of `messages` (after a saved context — what it holds and its tokens — if any) and,
/// per breakpoint (message index, byte offset in its content), the number of prompt tokens up to it
/// (`None` for one that cannot be placed: at or past a message the template does not write as it is).
///
/// A breakpoint's position is found in the rendered template text (each message's content is searched
/// in order) and mapped to tokens as the longest common prefix of the whole prompt's tokens and those of
/// the text up to the breakpoint, so a token that straddles it is not counted.
pub fn encode_with_breakpoints(
    codec: &dyn TextCodec,
    messages: &[ChatMessage],
    breakpoints: &[(usize, usize, CacheTtl)],
    saved: Option<(&ContextKind, &[u32])>,
) -> Result<(Vec<u32>, Vec<Option<usize>>), ApiError> {
    encode_marked(codec, messages, breakpoints, saved, None)
}

/// [`encode_with_breakpoints`] for a template that writes the request's tools itself (OpenAI's
/// `tools` array handed to it), without a saved context: such a template writes the tools ahead of
/// any message, so a saved context's tokens would not start the prompt.
pub fn encode_with_breakpoints_and_tools(
    codec: &dyn TextCodec,
    messages: &[ChatMessage],
    breakpoints: &[(usize, usize, CacheTtl)],
    tools: &serde_json::Value,
) -> Result<(Vec<u32>, Vec<Option<usize>>), ApiError> {
    encode_marked(codec, messages, breakpoints, None, Some(tools))
}

fn encode_marked(
    codec: &dyn TextCodec,
    messages: &[ChatMessage],
    breakpoints: &[(usize, usize, CacheTtl)],
    saved: Option<(&ContextKind, &[u32])>,
    tools: Option<&serde_json::Value>,
) -> Result<(Vec<u32>, Vec<Option<usize>>), ApiError> {
    let (all, text_prefix, offset) = match saved.map(|(kind, _)| kind) {
        Some(ContextKind::Messages { messages: before }) => {
            let mut all = before.clone();
            all.extend_from_slice(messages);
            (all, None, before.len())
        }
        Some(ContextKind::Prompt { text }) => (messages.to_vec(), Some(text.as_str()), 0),
        None => (messages.to_vec(), None, 0),
    };
    let rendered = match tools {
        Some(t) => codec.render_chat_with_tools(&all, t),
        None => codec.render_chat(&all),
    }
    .map_err(template_error)?;
    // A prompt context's tokens are the plain tokenization of its text; a chat prompt's come from the
    // template. Breakpoints need the plain tokenization of the whole text too, and how many tokens
    // (BOS) plain encoding puts before the template's own.
    let (full_text, chat_tokens) = match text_prefix {
        Some(prefix) => (format!("{prefix}{rendered}"), None),
        None => {
            let tokens = match tools {
                Some(t) => codec.encode_chat_with_tools(&all, t),
                None => codec.encode_chat(&all),
            }
            .map_err(template_error)?;
            (rendered, Some(tokens))
        }
    };
    // The messages' contents in `full_text`, where special-token text stays text.
    let plain = if chat_tokens.is_none() || !breakpoints.is_empty() {
        let from = text_prefix.map_or(0, str::len);
        match tools {
            Some(t) => codec.chat_content_spans_with_tools(&full_text, from, &all, t),
            None => codec.chat_content_spans(&full_text, from, &all),
        }
        .map_err(template_error)?
    } else {
        Vec::new()
    };
    let whole = if chat_tokens.is_none() || !breakpoints.is_empty() {
        codec
            .encode_with_plain_spans(&full_text, &plain)
            .map_err(tokenize_error)?
    } else {
        Vec::new()
    };
    let bos_extra = chat_tokens
        .as_ref()
        .map_or(0, |t| whole.len().saturating_sub(t.len()));
    let tokens = chat_tokens.unwrap_or_else(|| whole.clone());
    let tokens = match saved {
        Some((_, saved_tokens)) => join_prefix(saved_tokens, tokens),
        None => tokens,
    };
    let mut positions = Vec::with_capacity(breakpoints.len());
    if !breakpoints.is_empty() {
        // Where each message's content starts in the text.
        let mut starts = Vec::with_capacity(all.len());
        let mut cursor = text_prefix.map_or(0, str::len);
        // Only the messages up to the last breakpoint's need placing.
        let needed = breakpoints
            .iter()
            .map(|&(m, _, _)| m + offset + 1)
            .max()
            .unwrap_or(0)
            .min(all.len());
        for (i, m) in all[..needed].iter().enumerate() {
            // Templates that trim a message's content (`| trim`) are matched on the trimmed text, and the
            // start is taken back by what was trimmed (a breakpoint then ends at most that much early).
            let trimmed = m.content.trim();
            let lead = m.content.len() - m.content.trim_start().len();
            let found = full_text[cursor..]
                .find(m.content.as_str())
                .map(|at| (cursor + at, cursor + at + m.content.len()))
                .or_else(|| {
                    full_text[cursor..].find(trimmed).map(|at| {
                        // The start is taken back by what was trimmed; the search goes on from the
                        // real end of the match.
                        let found_at = cursor + at;
                        (found_at.saturating_sub(lead), found_at + trimmed.len())
                    })
                });
            match found {
                Some((start, end)) => {
                    starts.push(start);
                    cursor = end;
                }
                None => {
                    // A breakpoint is a caching hint: those at or past a message the template does
                    // not write as it is (Llama 3's tool results, JSON-encoded) are not placed.
                    tracing::debug!(
                        message = i.saturating_sub(offset),
                        "a cache_control breakpoint at or past this message is not placed: the chat \
                         template does not write its text as it is"
                    );
                    break;
                }
            }
        }
        for &(message, at, _) in breakpoints {
            let Some(&start) = starts.get(message + offset) else {
                positions.push(None);
                continue;
            };
            let mut end = (start + at).min(full_text.len());
            while !full_text.is_char_boundary(end) {
                end -= 1;
            }
            let plain_part: Vec<_> = plain
                .iter()
                .filter(|r| r.start < end)
                .map(|r| r.start..r.end.min(end))
                .collect();
            let part = codec
                .encode_with_plain_spans(&full_text[..end], &plain_part)
                .map_err(tokenize_error)?;
            positions.push(Some(
                lcp(&part, &whole)
                    .saturating_sub(bos_extra)
                    .min(tokens.len()),
            ));
        }
    }
    Ok((tokens, positions))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_parse_as_documented() {
        for (v, s) in [
            (serde_json::json!(60), 60),
            (serde_json::json!("300s"), 300),
            (serde_json::json!("30m"), 1800),
            (serde_json::json!("1h"), 3600),
            (serde_json::json!("7d"), 7 * 86400),
        ] {
            assert_eq!(parse_context_ttl(&v).unwrap(), s, "{v}");
        }
        for v in [
            "0s",
            "1é",
            "é",
            "-1h",
            "1.5h",
            "h",
            "",
            "366d",
            "99999999999999999999d",
        ] {
            assert!(parse_context_ttl(&serde_json::json!(v)).is_err(), "{v}");
        }
        assert!(parse_context_ttl(&serde_json::json!(-5)).is_err());
        assert!(parse_context_ttl(&serde_json::json!(true)).is_err());
    }
}
