//! Engine events → OpenAI response bodies: collected into one response, or turned into SSE chunks as
//! they come. The two endpoints differ only in the JSON shape of a choice, so one [`Shape`] carries
//! the difference.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::Event;
use futures::Stream;
use kura_engine::{EngineEvent, FinishReason, RequestGuard, TokenLogprob, Usage};
use serde_json::{Map, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::ApiError;
use crate::types::*;

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Completion,
    Chat,
}

/// Identity fields every response and chunk repeats.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub shape: Shape,
    /// Whether the client asked for logprobs (an empty list is then still reported).
    pub logprobs: bool,
}

fn completion_logprobs(lps: &[TokenLogprob], offset: &mut usize) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for lp in lps {
        out.tokens.push(lp.sampled.text.clone());
        out.token_logprobs.push(lp.sampled.logprob);
        let mut top = Map::new();
        for c in &lp.top {
            top.insert(c.text.clone(), Value::from(c.logprob));
        }
        out.top_logprobs.push(top);
        out.text_offset.push(*offset);
        *offset += lp.sampled.text.len();
    }
    out
}

fn chat_logprobs(lps: &[TokenLogprob]) -> ChatLogprobs {
    ChatLogprobs {
        content: lps
            .iter()
            .map(|lp| ChatTokenLogprob {
                token: lp.sampled.text.clone(),
                logprob: lp.sampled.logprob,
                bytes: lp.sampled.text.as_bytes().to_vec(),
                top_logprobs: lp
                    .top
                    .iter()
                    .map(|c| TopLogprob {
                        token: c.text.clone(),
                        logprob: c.logprob,
                        bytes: c.text.as_bytes().to_vec(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

#[derive(Default)]
struct ChoiceAcc {
    text: String,
    logprobs: Vec<TokenLogprob>,
    finish: Option<FinishReason>,
}

/// Waits for the whole request and builds the non-streaming response body.
pub async fn collect(
    meta: &ResponseMeta,
    n: u32,
    mut rx: UnboundedReceiver<EngineEvent>,
    _guard: RequestGuard,
) -> Result<Value, ApiError> {
    let mut choices: Vec<ChoiceAcc> = (0..n).map(|_| ChoiceAcc::default()).collect();
    let usage = loop {
        let Some(event) = rx.recv().await else {
            return Err(ApiError::Internal(
                "the engine dropped the request without finishing it".into(),
            ));
        };
        match event {
            EngineEvent::Delta {
                choice,
                text,
                logprobs,
                ..
            } => {
                if let Some(c) = choices.get_mut(choice as usize) {
                    c.text.push_str(&text);
                    c.logprobs.extend(logprobs);
                }
            }
            EngineEvent::Finished { choice, reason } => {
                if let Some(c) = choices.get_mut(choice as usize) {
                    c.finish = Some(reason);
                }
            }
            EngineEvent::Done { usage } => break usage,
            EngineEvent::Failed(e) => return Err(e.into()),
        }
    };
    let usage = UsageBody::from(usage);
    let body = match meta.shape {
        Shape::Completion => serde_json::to_value(CompletionResponse {
            id: meta.id.clone(),
            object: "text_completion",
            created: meta.created,
            model: meta.model.clone(),
            choices: choices
                .into_iter()
                .enumerate()
                .map(|(i, c)| CompletionChoice {
                    index: i as u32,
                    logprobs: meta
                        .logprobs
                        .then(|| completion_logprobs(&c.logprobs, &mut 0)),
                    text: c.text,
                    finish_reason: c.finish.map(FinishReason::as_str),
                })
                .collect(),
            usage: Some(usage),
        }),
        Shape::Chat => serde_json::to_value(ChatCompletionResponse {
            id: meta.id.clone(),
            object: "chat.completion",
            created: meta.created,
            model: meta.model.clone(),
            choices: choices
                .into_iter()
                .enumerate()
                .map(|(i, c)| ChatChoice {
                    index: i as u32,
                    logprobs: meta.logprobs.then(|| chat_logprobs(&c.logprobs)),
                    message: ResponseMessage {
                        role: "assistant",
                        content: c.text,
                    },
                    finish_reason: c.finish.map(FinishReason::as_str),
                })
                .collect(),
            usage,
        }),
    };
    body.map_err(|e| ApiError::Internal(format!("serializing the response: {e}")))
}

/// State of one SSE stream; the guard inside cancels the request when the client goes away (axum
/// drops the stream).
struct SseState {
    meta: ResponseMeta,
    rx: UnboundedReceiver<EngineEvent>,
    _guard: RequestGuard,
    include_usage: bool,
    /// Per choice: bytes of text sent so far (completions' `text_offset`).
    offsets: Vec<usize>,
    queue: VecDeque<Event>,
    finished: bool,
    /// When the stream is cut with a timeout error (and the request cancelled), with the limit in s.
    deadline: Option<(tokio::time::Instant, u64)>,
}

impl SseState {
    fn chunk(
        &self,
        choice: u32,
        text: Option<String>,
        lps: &[TokenLogprob],
        offset: &mut usize,
        finish: Option<FinishReason>,
    ) -> Event {
        let finish_reason = finish.map(FinishReason::as_str);
        let value = match self.meta.shape {
            Shape::Completion => serde_json::to_string(&CompletionResponse {
                id: self.meta.id.clone(),
                object: "text_completion",
                created: self.meta.created,
                model: self.meta.model.clone(),
                choices: vec![CompletionChoice {
                    index: choice,
                    text: text.unwrap_or_default(),
                    logprobs: self.meta.logprobs.then(|| completion_logprobs(lps, offset)),
                    finish_reason,
                }],
                usage: None,
            }),
            Shape::Chat => serde_json::to_string(&ChatCompletionChunk {
                id: self.meta.id.clone(),
                object: "chat.completion.chunk",
                created: self.meta.created,
                model: self.meta.model.clone(),
                choices: vec![ChatChunkChoice {
                    index: choice,
                    delta: ChatDelta {
                        role: None,
                        content: text,
                    },
                    logprobs: (self.meta.logprobs && !lps.is_empty()).then(|| chat_logprobs(lps)),
                    finish_reason,
                }],
                usage: None,
            }),
        };
        Event::default().data(value.unwrap_or_default())
    }

    fn usage_chunk(&self, usage: Usage) -> Event {
        let usage = Some(UsageBody::from(usage));
        let value = match self.meta.shape {
            Shape::Completion => serde_json::to_string(&CompletionResponse {
                id: self.meta.id.clone(),
                object: "text_completion",
                created: self.meta.created,
                model: self.meta.model.clone(),
                choices: Vec::new(),
                usage,
            }),
            Shape::Chat => serde_json::to_string(&ChatCompletionChunk {
                id: self.meta.id.clone(),
                object: "chat.completion.chunk",
                created: self.meta.created,
                model: self.meta.model.clone(),
                choices: Vec::new(),
                usage,
            }),
        };
        Event::default().data(value.unwrap_or_default())
    }

    /// Turns one engine event into zero or more SSE events on the queue.
    fn push(&mut self, event: EngineEvent) {
        match event {
            EngineEvent::Delta {
                choice,
                text,
                logprobs,
                ..
            } => {
                if text.is_empty() && logprobs.is_empty() {
                    return;
                }
                let mut offset = self.offsets.get(choice as usize).copied().unwrap_or(0);
                let e = self.chunk(choice, Some(text), &logprobs, &mut offset, None);
                if let Some(o) = self.offsets.get_mut(choice as usize) {
                    *o = offset;
                }
                self.queue.push_back(e);
            }
            EngineEvent::Finished { choice, reason } => {
                let text = match self.meta.shape {
                    Shape::Completion => Some(String::new()),
                    Shape::Chat => None,
                };
                let e = self.chunk(choice, text, &[], &mut 0, Some(reason));
                self.queue.push_back(e);
            }
            EngineEvent::Done { usage } => {
                if self.include_usage {
                    let e = self.usage_chunk(usage);
                    self.queue.push_back(e);
                }
                self.queue.push_back(Event::default().data("[DONE]"));
                self.finished = true;
            }
            EngineEvent::Failed(e) => {
                let body = ApiError::from(e).body();
                self.queue
                    .push_back(Event::default().data(body.to_string()));
                self.queue.push_back(Event::default().data("[DONE]"));
                self.finished = true;
            }
        }
    }
}

/// The SSE event stream of a request. Chat streams open with one role chunk per choice, as OpenAI's.
pub fn sse_stream(
    meta: ResponseMeta,
    n: u32,
    include_usage: bool,
    rx: UnboundedReceiver<EngineEvent>,
    guard: RequestGuard,
    deadline: Option<(tokio::time::Instant, u64)>,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let mut state = SseState {
        meta,
        rx,
        _guard: guard,
        include_usage,
        offsets: vec![0; n as usize],
        queue: VecDeque::new(),
        finished: false,
        deadline,
    };
    if state.meta.shape == Shape::Chat {
        for choice in 0..n {
            let chunk = ChatCompletionChunk {
                id: state.meta.id.clone(),
                object: "chat.completion.chunk",
                created: state.meta.created,
                model: state.meta.model.clone(),
                choices: vec![ChatChunkChoice {
                    index: choice,
                    delta: ChatDelta {
                        role: Some("assistant"),
                        content: Some(String::new()),
                    },
                    logprobs: None,
                    finish_reason: None,
                }],
                usage: None,
            };
            let data = serde_json::to_string(&chunk).unwrap_or_default();
            state.queue.push_back(Event::default().data(data));
        }
    }
    futures::stream::unfold(state, |mut state| async move {
        loop {
            if let Some(e) = state.queue.pop_front() {
                return Some((Ok(e), state));
            }
            if state.finished {
                return None;
            }
            let next = match state.deadline {
                Some((at, seconds)) => match tokio::time::timeout_at(at, state.rx.recv()).await {
                    Ok(next) => next,
                    Err(_) => {
                        let body = ApiError::Timeout { seconds }.body();
                        state
                            .queue
                            .push_back(Event::default().data(body.to_string()));
                        state.queue.push_back(Event::default().data("[DONE]"));
                        state.finished = true;
                        continue;
                    }
                },
                None => state.rx.recv().await,
            };
            match next {
                Some(event) => state.push(event),
                None => {
                    let body = ApiError::Internal(
                        "the engine dropped the request without finishing it".into(),
                    )
                    .body();
                    state
                        .queue
                        .push_back(Event::default().data(body.to_string()));
                    state.finished = true;
                }
            }
        }
    })
}
