//! The HTTP side: one streamed completion, timed; the server's tokenizer; the checks made before a run.
//!
//! A request is timed from just before it is sent: TTFT is the arrival of the first chunk carrying text
//! (a reasoning model's reasoning counts: it is generated text), each inter-token latency (ITL) the
//! gap between two consecutive text chunks, E2E the end of the stream.
//! Servers that stream one token per chunk (llama.cpp, vLLM, Kura) give one gap per token; the output
//! token count comes from `usage.completion_tokens` when the server reports it (we ask for it with
//! `stream_options.include_usage`), else from the number of text chunks.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};

use crate::report::{ErrorKind, RequestError};
use crate::BenchError;
use kura_api::sse::{parse_chunk, snippet, Chunk, SseDecoder, Usage};

/// Which OpenAI endpoint the requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `POST /v1/chat/completions` with `messages` (the server applies its chat template).
    Chat,
    /// `POST /v1/completions` with the messages' contents joined into one `prompt`.
    Completions,
}

/// Where and how to send requests.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// Server root, e.g. `http://127.0.0.1:8080` (a trailing `/v1` is accepted and removed).
    pub base_url: String,
    pub api_key: Option<String>,
    pub model: String,
    pub api: Api,
    /// Send `ignore_eos: true` so that every request generates exactly `max_tokens` (llama.cpp, vLLM,
    /// SGLang and Kura accept it); without it output lengths depend on the model's choices.
    pub ignore_eos: bool,
    /// Sent as `temperature`: 0 decodes greedily (the same output on every run of a deterministic
    /// server); above 0 the server samples, which costs it more per token.
    pub temperature: f64,
    pub request_timeout: Duration,
}

impl Endpoint {
    pub fn normalize_base(url: &str) -> String {
        let trimmed = url.trim().trim_end_matches('/');
        trimmed.strip_suffix("/v1").unwrap_or(trimmed).to_string()
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base_url)
    }

    fn post(&self, http: &reqwest::Client, path: &str) -> reqwest::RequestBuilder {
        let req = http.post(self.url(path));
        match &self.api_key {
            Some(key) => req.bearer_auth(key),
            None => req,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    pub role: &'static str,
    pub content: String,
}

/// The timed result of one streamed request.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub ttft_ms: Option<f64>,
    pub e2e_ms: f64,
    pub itl_ms: Vec<f64>,
    pub output_tokens: u64,
    pub usage: Option<Usage>,
    /// The generated text (a multi-turn conversation sends it back as the assistant's turn).
    pub text: String,
    pub error: Option<RequestError>,
}

fn request_body(ep: &Endpoint, messages: &[Message], max_tokens: u32) -> Value {
    let mut body = match ep.api {
        Api::Chat => json!({ "model": ep.model, "messages": messages }),
        Api::Completions => {
            let prompt: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
            json!({ "model": ep.model, "prompt": prompt.join("\n\n") })
        }
    };
    let obj = body.as_object_mut().expect("json! object literal");
    obj.insert("max_tokens".into(), json!(max_tokens));
    obj.insert("temperature".into(), json!(ep.temperature));
    obj.insert("stream".into(), json!(true));
    obj.insert("stream_options".into(), json!({ "include_usage": true }));
    if ep.ignore_eos {
        obj.insert("ignore_eos".into(), json!(true));
    }
    body
}

fn path_of(api: Api) -> &'static str {
    match api {
        Api::Chat => "/v1/chat/completions",
        Api::Completions => "/v1/completions",
    }
}

/// The error and its causes on one line ("error sending request: … : Connection refused").
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = s.source();
    }
    parts.join(": ")
}

fn classify(e: &reqwest::Error) -> ErrorKind {
    if e.is_timeout() {
        ErrorKind::Timeout
    } else if e.is_connect() {
        ErrorKind::Connect
    } else {
        // Connected, then the connection closed or broke before a complete response.
        ErrorKind::Disconnected
    }
}

/// Sends one streamed completion and times it. Never fails: a failure is recorded in `Outcome::error`
/// with what was measured up to that point.
pub async fn stream_completion(
    http: &reqwest::Client,
    ep: &Endpoint,
    messages: &[Message],
    max_tokens: u32,
) -> Outcome {
    let start = Instant::now();
    let mut out = Outcome::default();
    let result = tokio::time::timeout(
        ep.request_timeout,
        stream_into(http, ep, messages, max_tokens, start, &mut out),
    )
    .await;
    let error = match result {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(_) => Some(RequestError {
            kind: ErrorKind::Timeout,
            message: format!(
                "no complete response within {:.0} s (--request-timeout-s)",
                ep.request_timeout.as_secs_f64()
            ),
        }),
    };
    out.e2e_ms = start.elapsed().as_secs_f64() * 1e3;
    out.error = error;
    // Without usage from the server, one text chunk counts as one token.
    out.output_tokens = out
        .usage
        .and_then(|u| u.completion_tokens)
        .unwrap_or((out.itl_ms.len() + usize::from(out.ttft_ms.is_some())) as u64);
    out
}

/// The most bytes of an error response kept (for its message).
const ERROR_BODY_BYTES: usize = 64 << 10;
/// The largest stream event taken: a completion chunk is a few hundred bytes.
const MAX_STREAM_EVENT_BYTES: usize = 16 << 20;
/// The most text kept of one response (a request's tokens are far fewer).
const MAX_RESPONSE_TEXT_BYTES: usize = 64 << 20;

/// The first `max` bytes of a response's body, as text (a server's error body may never end).
async fn body_head(response: reqwest::Response, max: usize) -> String {
    let mut head = Vec::new();
    let mut body = response.bytes_stream();
    while let Some(Ok(piece)) = body.next().await {
        head.extend_from_slice(&piece[..piece.len().min(max - head.len())]);
        if head.len() >= max {
            break;
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

async fn stream_into(
    http: &reqwest::Client,
    ep: &Endpoint,
    messages: &[Message],
    max_tokens: u32,
    start: Instant,
    out: &mut Outcome,
) -> Result<(), RequestError> {
    let path = path_of(ep.api);
    let response = ep
        .post(http, path)
        .json(&request_body(ep, messages, max_tokens))
        .send()
        .await
        .map_err(|e| RequestError {
            kind: classify(&e),
            message: format!("POST {}: {}", ep.url(path), error_chain(&e)),
        })?;
    let status = response.status();
    if !status.is_success() {
        let body = body_head(response, ERROR_BODY_BYTES).await;
        return Err(RequestError {
            kind: ErrorKind::Http {
                status: status.as_u16(),
            },
            message: format!("POST {path} answered {status}: {}", snippet(body.trim())),
        });
    }
    let malformed = |message: String| RequestError {
        kind: ErrorKind::MalformedStream,
        message,
    };
    if let Some(kind) = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.starts_with("text/event-stream"))
    {
        let kind = kind.to_string();
        let body = body_head(response, ERROR_BODY_BYTES).await;
        return Err(malformed(format!(
            "POST {path} answered {status} with {kind}, not an event stream: {}",
            snippet(body.trim())
        )));
    }
    let mut decoder = SseDecoder::with_limit(MAX_STREAM_EVENT_BYTES);
    let mut body = response.bytes_stream();
    let mut last_token: Option<Instant> = None;
    let mut done = false;
    let mut handle =
        |event: kura_api::sse::SseEvent, out: &mut Outcome| -> Result<bool, RequestError> {
            match parse_chunk(&event).map_err(malformed)? {
                Chunk::Done => Ok(true),
                Chunk::Error(message) => Err(RequestError {
                    kind: ErrorKind::ServerError,
                    message: format!("error event in stream: {message}"),
                }),
                Chunk::Delta {
                    text,
                    reasoning,
                    usage,
                    ..
                } => {
                    // A reasoning model's reasoning is generated tokens too (as vLLM's benchmark
                    // counts it); the answer alone is the turn sent back.
                    if !text.is_empty() || !reasoning.is_empty() {
                        let now = Instant::now();
                        match last_token {
                            None => out.ttft_ms = Some((now - start).as_secs_f64() * 1e3),
                            Some(prev) => out.itl_ms.push((now - prev).as_secs_f64() * 1e3),
                        }
                        last_token = Some(now);
                        if out.text.len().saturating_add(text.len()) > MAX_RESPONSE_TEXT_BYTES {
                            return Err(malformed(format!(
                                "the response's text passed {MAX_RESPONSE_TEXT_BYTES} bytes"
                            )));
                        }
                        out.text.push_str(&text);
                    }
                    if let Some(u) = usage {
                        out.usage = Some(u);
                    }
                    Ok(false)
                }
            }
        };
    while let Some(piece) = body.next().await {
        let piece = piece.map_err(|e| RequestError {
            kind: ErrorKind::Disconnected,
            message: format!(
                "stream broke after {} chunks: {}",
                out.itl_ms.len(),
                error_chain(&e)
            ),
        })?;
        for event in decoder.feed(&piece).map_err(|e| malformed(e.to_string()))? {
            if handle(event, out)? {
                done = true;
            }
        }
        if done {
            break;
        }
    }
    if !done {
        if let Some(event) = decoder.finish().map_err(|e| malformed(e.to_string()))? {
            done = handle(event, out)?;
        }
    }
    if !done {
        return Err(malformed(
            "stream ended without `data: [DONE]` (connection closed early?)".to_string(),
        ));
    }
    Ok(())
}

/// The model id to send: the first one `GET /v1/models` lists (asked with the run's key, within its
/// request timeout). A server that refuses the key is an error; one without the route gives `None`.
pub async fn discover_model(
    http: &reqwest::Client,
    ep: &Endpoint,
) -> Result<Option<String>, BenchError> {
    let mut req = http.get(ep.url("/v1/models")).timeout(ep.request_timeout);
    if let Some(key) = &ep.api_key {
        req = req.bearer_auth(key);
    }
    let response = req
        .send()
        .await
        .map_err(|e| unreachable(&ep.base_url, &e))?;
    let status = response.status();
    if matches!(status.as_u16(), 401 | 403) {
        return Err(BenchError::Config(format!(
            "GET {} answered {status}: give the server's key with --api-key",
            ep.url("/v1/models")
        )));
    }
    if !status.is_success() {
        return Ok(None);
    }
    let value: Value = response.json().await.unwrap_or(Value::Null);
    Ok(value
        .get("data")
        .and_then(Value::as_array)
        .and_then(|d| d.first())
        .and_then(|m| m.get("id"))
        .and_then(Value::as_str)
        .map(str::to_string))
}

pub(crate) fn unreachable(base_url: &str, e: &reqwest::Error) -> BenchError {
    BenchError::Unreachable {
        url: base_url.to_string(),
        detail: error_chain(e),
    }
}

/// Sends one tiny request before the run: an unreachable server ends the run here with a clear error; a
/// server that answers with an error is reported as a warning and the run goes on (its failures are counted).
pub async fn preflight(
    http: &reqwest::Client,
    ep: &Endpoint,
) -> Result<Option<String>, BenchError> {
    let messages = [Message {
        role: "user",
        content: "Say hello.".to_string(),
    }];
    let out = stream_completion(http, ep, &messages, 1).await;
    match out.error {
        None => Ok(None),
        Some(e) if e.kind == ErrorKind::Connect => Err(BenchError::Unreachable {
            url: ep.base_url.clone(),
            detail: e.message,
        }),
        Some(e) => Ok(Some(format!(
            "the first test request failed ({}): {}",
            e.kind.label(),
            e.message
        ))),
    }
}

/// How the server's `POST /tokenize` wants its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenizeField {
    /// Kura: `{"prompt": "..."}`.
    Prompt,
    /// llama.cpp: `{"content": "..."}`.
    Content,
}

/// The server's own tokenizer, reached over `POST /tokenize` (Kura and llama.cpp's server expose it).
#[derive(Debug, Clone)]
pub struct RemoteTokenizer {
    http: reqwest::Client,
    url: String,
    api_key: Option<String>,
    field: TokenizeField,
    timeout: std::time::Duration,
    /// Tokens the server adds to every text (BOS where the model wants one), taken off each count.
    lead: usize,
}

impl RemoteTokenizer {
    /// Finds the endpoint: `Err` with what each form of the request got when none counts tokens
    /// (lengths are then approximate).
    pub async fn probe(http: &reqwest::Client, ep: &Endpoint) -> Result<RemoteTokenizer, String> {
        let mut got = Vec::new();
        for field in [TokenizeField::Prompt, TokenizeField::Content] {
            let tok = RemoteTokenizer {
                http: http.clone(),
                url: ep.url("/tokenize"),
                api_key: ep.api_key.clone(),
                field,
                timeout: ep.request_timeout,
                lead: 0,
            };
            // llama.cpp answers a body without `content` with an empty list: only a non-empty answer counts.
            match tok.count("hello world").await {
                Ok(n) if n > 0 => {
                    // The text's own tokens: a piece's count must not hold a BOS that the joined
                    // prompt has once.
                    let lead = tok.count("").await.unwrap_or(0);
                    return Ok(RemoteTokenizer { lead, ..tok });
                }
                Ok(_) => got.push(format!("{field:?}: no tokens")),
                Err(e) => got.push(format!("{field:?}: {e}")),
            }
        }
        Err(got.join("; "))
    }

    /// The number of tokens of `text` alone: Kura's and vLLM's `prompt` (counted as a completion counts
    /// it, so with BOS where the model adds one, less the tokens an empty text gets), or llama.cpp's
    /// `content` with `add_special: false`.
    pub async fn count(&self, text: &str) -> Result<usize, BenchError> {
        let body = match self.field {
            TokenizeField::Prompt => json!({ "prompt": text }),
            TokenizeField::Content => json!({ "content": text, "add_special": false }),
        };
        let mut req = self.http.post(&self.url).json(&body).timeout(self.timeout);
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        let fail = |detail: String| BenchError::Tokenize {
            url: self.url.clone(),
            detail,
        };
        let response = req.send().await.map_err(|e| fail(error_chain(&e)))?;
        let status = response.status();
        if !status.is_success() {
            return Err(fail(format!("answered {status}")));
        }
        let value: Value = response.json().await.map_err(|e| fail(error_chain(&e)))?;
        value
            .get("tokens")
            .and_then(Value::as_array)
            .map(|tokens| tokens.len().saturating_sub(self.lead))
            .ok_or_else(|| {
                fail(format!(
                    "no `tokens` list in {}",
                    snippet(&value.to_string())
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_sends_the_runs_temperature_and_output_length() {
        let mut ep = Endpoint {
            base_url: "http://127.0.0.1:1".into(),
            api_key: None,
            model: "m".into(),
            api: Api::Chat,
            ignore_eos: true,
            temperature: 0.0,
            request_timeout: Duration::from_secs(1),
        };
        let messages = [Message {
            role: "user",
            content: "hi".into(),
        }];
        let greedy = request_body(&ep, &messages, 16);
        assert_eq!(greedy["temperature"], json!(0.0));
        assert_eq!(greedy["max_tokens"], json!(16));
        assert_eq!(greedy["ignore_eos"], json!(true));
        ep.temperature = 0.7;
        ep.api = Api::Completions;
        let sampled = request_body(&ep, &messages, 16);
        assert_eq!(sampled["temperature"], json!(0.7));
        assert_eq!(sampled["prompt"], json!("hi"));
    }
}
