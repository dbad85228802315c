//! Server-sent events as OpenAI-compatible servers stream them, and the JSON chunks inside.
//!
//! The decoder is incremental: bytes arrive in arbitrary pieces (a line may be split across network reads,
//! several events may arrive in one read), and [`SseDecoder::feed`] returns every complete event so far.
//! An event is the `data:` lines before a blank line, joined with `\n` (the SSE specification);
//! `event:`, `id:`, `retry:` and comment lines (`:`) are read and, except `event: error`, ignored.
//! Cost: O(bytes) over the whole stream; a line is scanned once.

use serde_json::Value;

/// One complete server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field, if the server named one (OpenAI-compatible servers usually do not).
    pub event: Option<String>,
    /// The `data:` lines joined with `\n`.
    pub data: String,
}

/// Why a byte stream is not valid SSE.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    #[error("stream line is not UTF-8: {0}")]
    NotUtf8(String),
    #[error("a stream event is larger than the {0} bytes taken (a line that never ends?)")]
    TooLarge(usize),
}

/// The largest event [`SseDecoder::new`] takes: a completion chunk is a few hundred bytes; a KV
/// snapshot of a million blocks is about 40 MB.
pub const MAX_EVENT_BYTES: usize = 256 << 20;

#[derive(Debug)]
pub struct SseDecoder {
    /// Bytes after the last `\n` seen, waiting for the rest of their line.
    partial_line: Vec<u8>,
    event: Option<String>,
    data_lines: Vec<String>,
    /// Bytes held for the event being read (its lines so far and the partial line).
    held: usize,
    max_event_bytes: usize,
}

impl Default for SseDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl SseDecoder {
    /// A decoder of events up to [`MAX_EVENT_BYTES`].
    pub fn new() -> Self {
        Self::with_limit(MAX_EVENT_BYTES)
    }

    /// A decoder of events up to `max_event_bytes` (the bytes of their lines): a stream that sends a
    /// longer one (a line that never ends) is an error, not memory without end.
    pub fn with_limit(max_event_bytes: usize) -> Self {
        SseDecoder {
            partial_line: Vec::new(),
            event: None,
            data_lines: Vec::new(),
            held: 0,
            max_event_bytes,
        }
    }

    /// Feeds the next piece of the body; returns the events completed by it.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, SseError> {
        let mut events = Vec::new();
        let mut rest = bytes;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            self.hold(pos)?;
            self.partial_line.extend_from_slice(&rest[..pos]);
            rest = &rest[pos + 1..];
            let line = std::mem::take(&mut self.partial_line);
            if let Some(event) = self.line(&line)? {
                events.push(event);
            }
        }
        self.hold(rest.len())?;
        self.partial_line.extend_from_slice(rest);
        Ok(events)
    }

    /// Counts `bytes` more toward the event being read.
    fn hold(&mut self, bytes: usize) -> Result<(), SseError> {
        self.held = self.held.saturating_add(bytes);
        if self.held > self.max_event_bytes {
            return Err(SseError::TooLarge(self.max_event_bytes));
        }
        Ok(())
    }

    /// Ends the stream: an unterminated last line and an event not followed by a blank line still count
    /// (some servers close the connection right after the last `data:` line).
    pub fn finish(&mut self) -> Result<Option<SseEvent>, SseError> {
        if !self.partial_line.is_empty() {
            let line = std::mem::take(&mut self.partial_line);
            if let Some(event) = self.line(&line)? {
                return Ok(Some(event));
            }
        }
        Ok(self.dispatch())
    }

    fn line(&mut self, raw: &[u8]) -> Result<Option<SseEvent>, SseError> {
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        let line = std::str::from_utf8(raw).map_err(|_| {
            SseError::NotUtf8(String::from_utf8_lossy(raw).chars().take(80).collect())
        })?;
        if line.is_empty() {
            return Ok(self.dispatch());
        }
        if line.starts_with(':') {
            return Ok(None);
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "data" => self.data_lines.push(value.to_string()),
            "event" => self.event = Some(value.to_string()),
            _ => {}
        }
        Ok(None)
    }

    fn dispatch(&mut self) -> Option<SseEvent> {
        self.held = 0;
        if self.data_lines.is_empty() {
            self.event = None;
            return None;
        }
        let data = std::mem::take(&mut self.data_lines).join("\n");
        Some(SseEvent {
            event: self.event.take(),
            data,
        })
    }
}

/// What one `data:` payload of a completion stream says.
#[derive(Debug, Clone, PartialEq)]
pub enum Chunk {
    /// `[DONE]`: the stream is complete.
    Done,
    /// A JSON chunk. `text` is the new content (empty for role-only or usage-only chunks);
    /// `reasoning` a reasoning model's new reasoning (`delta.reasoning_content`, or vLLM's newer
    /// `delta.reasoning`).
    Delta {
        text: String,
        reasoning: String,
        finish_reason: Option<String>,
        usage: Option<Usage>,
    },
    /// The server reported an error inside the stream.
    Error(String),
}

/// Token counts the server reported for the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens` (OpenAI), or llama.cpp's `timings.cache_n` when the
    /// former is absent.
    pub cached_tokens: Option<u64>,
}

/// Parses one event of a `/v1/chat/completions` or `/v1/completions` stream.
/// A payload that is not JSON, or JSON without `choices`, `usage` or `error`, is an error naming it.
pub fn parse_chunk(event: &SseEvent) -> Result<Chunk, String> {
    let data = event.data.trim();
    if data == "[DONE]" {
        return Ok(Chunk::Done);
    }
    let value: Value = serde_json::from_str(data)
        .map_err(|e| format!("data is not JSON ({e}): {}", snippet(data)))?;
    if event.event.as_deref() == Some("error") || value.get("error").is_some() {
        let err = value.get("error").unwrap_or(&value);
        let message = err
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| err.to_string());
        return Ok(Chunk::Error(message));
    }
    let choices = value.get("choices").and_then(Value::as_array);
    let usage = parse_usage(&value);
    if choices.is_none() && usage.is_none() {
        return Err(format!(
            "chunk has neither choices nor usage: {}",
            snippet(data)
        ));
    }
    let mut text = String::new();
    let mut reasoning = String::new();
    let mut finish_reason = None;
    if let Some(first) = choices.and_then(|c| c.first()) {
        let delta = first.get("delta");
        if let Some(piece) = ["reasoning_content", "reasoning"]
            .iter()
            .find_map(|name| delta.and_then(|d| d.get(*name)).and_then(Value::as_str))
        {
            reasoning.push_str(piece);
        }
        // Chat streams put the text in delta.content, completion streams in text.
        let piece = first
            .get("delta")
            .and_then(|d| d.get("content"))
            .or_else(|| first.get("text"))
            .and_then(Value::as_str);
        if let Some(piece) = piece {
            text.push_str(piece);
        }
        finish_reason = first
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(str::to_string);
    }
    Ok(Chunk::Delta {
        text,
        reasoning,
        finish_reason,
        usage,
    })
}

fn parse_usage(value: &Value) -> Option<Usage> {
    let usage = value.get("usage").filter(|u| u.is_object());
    let cache_n = value
        .get("timings")
        .and_then(|t| t.get("cache_n"))
        .and_then(Value::as_u64);
    if usage.is_none() && cache_n.is_none() {
        return None;
    }
    let field = |name: &str| usage.and_then(|u| u.get(name)).and_then(Value::as_u64);
    let cached = usage
        .and_then(|u| u.get("prompt_tokens_details"))
        .and_then(|d| d.get("cached_tokens"))
        .and_then(Value::as_u64)
        .or(cache_n);
    Some(Usage {
        prompt_tokens: field("prompt_tokens"),
        completion_tokens: field("completion_tokens"),
        cached_tokens: cached,
    })
}

/// The start of `s`, for an error message about a body that could not be read.
pub fn snippet(s: &str) -> String {
    const MAX: usize = 160;
    if s.chars().count() <= MAX {
        s.to_string()
    } else {
        let head: String = s.chars().take(MAX).collect();
        format!("{head}…")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(pieces: &[&[u8]]) -> Vec<SseEvent> {
        let mut dec = SseDecoder::new();
        let mut out = Vec::new();
        for p in pieces {
            out.extend(dec.feed(p).unwrap());
        }
        out.extend(dec.finish().unwrap());
        out
    }

    #[test]
    fn events_split_across_reads_are_reassembled() {
        let body = b"data: {\"a\":1}\n\ndata: [DONE]\n\n";
        for split in 0..body.len() {
            let events = decode_all(&[&body[..split], &body[split..]]);
            let data: Vec<&str> = events.iter().map(|e| e.data.as_str()).collect();
            assert_eq!(data, ["{\"a\":1}", "[DONE]"], "split at {split}");
        }
    }

    #[test]
    fn crlf_comments_multiline_data_and_event_names() {
        let body = b": keep-alive\r\nevent: error\r\ndata: line1\r\ndata:line2\r\n\r\ndata: x";
        let events = decode_all(&[body]);
        assert_eq!(
            events,
            [
                SseEvent {
                    event: Some("error".into()),
                    data: "line1\nline2".into()
                },
                SseEvent {
                    event: None,
                    data: "x".into()
                }
            ]
        );
    }

    #[test]
    fn invalid_utf8_is_an_error() {
        let mut dec = SseDecoder::new();
        assert!(matches!(
            dec.feed(b"data: \xff\xfe\n"),
            Err(SseError::NotUtf8(_))
        ));
    }

    #[test]
    fn an_event_over_the_limit_is_an_error_whether_one_line_or_many() {
        // A line that never ends, fed in pieces.
        let mut dec = SseDecoder::with_limit(64);
        assert_eq!(dec.feed(&[b'a'; 40]), Ok(vec![]));
        assert_eq!(dec.feed(&[b'a'; 40]), Err(SseError::TooLarge(64)));
        // Many short data lines of one event.
        let mut dec = SseDecoder::with_limit(64);
        let lines = "data: 0123456789\n".repeat(8);
        assert_eq!(dec.feed(lines.as_bytes()), Err(SseError::TooLarge(64)));
        // Events under the limit, one after another, never add up.
        let mut dec = SseDecoder::with_limit(64);
        for _ in 0..100 {
            assert_eq!(
                dec.feed(b"data: 0123456789\n\n"),
                Ok(vec![ev("0123456789")])
            );
        }
    }

    fn ev(data: &str) -> SseEvent {
        SseEvent {
            event: None,
            data: data.into(),
        }
    }

    #[test]
    fn chat_delta_usage_and_cached_tokens() {
        let c = parse_chunk(&ev(
            r#"{"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}"#,
        ));
        assert_eq!(
            c.unwrap(),
            Chunk::Delta {
                text: "Hi".into(),
                reasoning: String::new(),
                finish_reason: None,
                usage: None
            }
        );
        // A reasoning model's reasoning, under either name (one piece, not both).
        for name in ["reasoning_content", "reasoning"] {
            let data = format!(r#"{{"choices":[{{"index":0,"delta":{{"{name}":"Hmm"}}}}]}}"#);
            let c = parse_chunk(&ev(&data)).unwrap();
            assert!(
                matches!(&c, Chunk::Delta { text, reasoning, .. } if text.is_empty() && reasoning == "Hmm"),
                "{c:?}"
            );
        }
        let both = r#"{"choices":[{"delta":{"reasoning":"Hmm","reasoning_content":"Hmm"}}]}"#;
        assert!(
            matches!(parse_chunk(&ev(both)).unwrap(), Chunk::Delta { reasoning, .. } if reasoning == "Hmm")
        );
        let c = parse_chunk(&ev(
            r#"{"choices":[],"usage":{"prompt_tokens":1050,"completion_tokens":64,"prompt_tokens_details":{"cached_tokens":1024}}}"#,
        ))
        .unwrap();
        let Chunk::Delta { usage: Some(u), .. } = c else {
            panic!("expected usage, got {c:?}")
        };
        assert_eq!(
            u,
            Usage {
                prompt_tokens: Some(1050),
                completion_tokens: Some(64),
                cached_tokens: Some(1024)
            }
        );
    }

    #[test]
    fn llama_cpp_timings_give_cached_tokens_when_usage_lacks_them() {
        let c = parse_chunk(&ev(
            r#"{"choices":[{"delta":{},"finish_reason":"length"}],"usage":{"prompt_tokens":10,"completion_tokens":4},"timings":{"cache_n":8}}"#,
        ))
        .unwrap();
        let Chunk::Delta {
            usage: Some(u),
            finish_reason,
            ..
        } = c
        else {
            panic!("expected usage")
        };
        assert_eq!(u.cached_tokens, Some(8));
        assert_eq!(finish_reason.as_deref(), Some("length"));
    }

    #[test]
    fn completion_text_done_error_and_malformed() {
        let c = parse_chunk(&ev(r#"{"choices":[{"text":" world"}]}"#)).unwrap();
        assert!(matches!(c, Chunk::Delta { ref text, .. } if text == " world"));
        assert_eq!(parse_chunk(&ev(" [DONE] ")).unwrap(), Chunk::Done);
        assert_eq!(
            parse_chunk(&ev(
                r#"{"error":{"message":"out of KV blocks","type":"server_error"}}"#
            ))
            .unwrap(),
            Chunk::Error("out of KV blocks".into())
        );
        assert!(parse_chunk(&ev("{not json"))
            .unwrap_err()
            .contains("not JSON"));
        assert!(parse_chunk(&ev(r#"{"id":"x"}"#))
            .unwrap_err()
            .contains("neither"));
    }
}
