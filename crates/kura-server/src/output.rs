//! Engine events → OpenAI response bodies: collected into one response, or turned into SSE chunks as
//! they come. The two endpoints differ only in the JSON shape of a choice, so one [`Shape`] carries
//! the difference.
//!
//! A completions request with several prompts is one engine request per prompt; [`Events`] merges
//! their events into one stream, numbering choices prompt-major (prompt `i`'s choice `j` is
//! `i * n + j`, as OpenAI numbers them) and summing usage into one `Done`.
//!
//! The queue between the engine and the response is bounded in bytes: past [`MAX_BACKLOG_BYTES`] the
//! sink tells the engine it is full, and the engine stops generating for that request until the client
//! reads (and cancels it if the client never does).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::response::sse::Event;
use futures::Stream;
use kura_engine::{
    EngineEvent, EventSink, FinishReason, PromptLogprobs, RequestGuard, TokenLogprob, Usage,
};
use serde_json::{Map, Value};
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};

use kura_api::reasoning::{ThinkSplit, ThinkWhole};
use kura_api::tools::CallReader;
use kura_guide::tools::PartialStream;

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
    /// Whether each choice of a non-streamed response carries its generated tokens' ids.
    pub token_ids: bool,
    /// With `token_ids`: each prompt's tokens, which a completion choice (or a chat response) carries
    /// as vLLM's `prompt_token_ids`.
    pub prompt_token_ids: Vec<PromptTokenIds>,
    /// Tool calls are read out of each chat choice's text, so.
    pub tools: Option<CallReader>,
    /// Completions' `echo`: each prompt's text, which starts its choices' texts (and, with
    /// `logprobs`, its scores their log-probabilities).
    pub echo: Option<Arc<[String]>>,
    /// The alternatives a token the client asked for in `logprobs` / `top_logprobs` (a prompt scored
    /// for vLLM's `prompt_logprobs` may carry more, which the echo leaves out).
    pub top_logprobs: u32,
    /// vLLM's `prompt_logprobs`: each choice (completions) or the response (chat) carries its prompt's
    /// scores with this many alternatives a token.
    pub prompt_logprobs: Option<u32>,
    /// A chat answer's reasoning is read apart ([`ThinkSplit`]): `Some(true)` when the prompt ends
    /// inside it (the template opened `<think>`), `Some(false)` when the model may open it.
    pub reasoning: Option<bool>,
}

impl ResponseMeta {
    /// What the ids of choice `choice`'s calls start with (unique within the server's responses).
    fn call_ids(&self, choice: u32) -> String {
        format!("call-{}-{choice}", self.id)
    }
}

/// A chat choice's text read for tool calls: its content (`None` when it is calls alone), its calls
/// and its finish reason (`tool_calls` when it stopped after making calls).
fn read_calls(
    meta: &ResponseMeta,
    choice: u32,
    text: String,
    finish: Option<FinishReason>,
) -> (
    Option<String>,
    Option<Vec<ToolCallBody>>,
    Option<&'static str>,
) {
    let reason = finish.map(FinishReason::as_str);
    let Some(reader) = &meta.tools else {
        return (Some(text), None, reason);
    };
    let (content, calls) = reader.parse(&text);
    if calls.is_empty() {
        return (Some(text), None, reason);
    }
    let bodies = calls
        .into_iter()
        .enumerate()
        .map(|(i, c)| ToolCallBody {
            id: format!("{}-{i}", meta.call_ids(choice)),
            kind: "function",
            function: FunctionCallBody {
                name: c.name,
                arguments: c.arguments,
            },
        })
        .collect();
    let reason = match finish {
        Some(FinishReason::Stop) => Some("tool_calls"),
        other => other.map(FinishReason::as_str),
    };
    (
        (!content.is_empty()).then_some(content),
        Some(bodies),
        reason,
    )
}

/// What a streamed chat choice has sent of its content and calls so far.
#[derive(Default)]
pub(crate) struct ToolStream {
    /// The reply so far, parsed as it grows (made with the first piece, when the format is known):
    /// a piece costs about its own length, not the reply's.
    parse: Option<PartialStream>,
    content_sent: usize,
    /// Per call sent, in the order they went out (their `index`): whether its name went out, and how
    /// many bytes of its arguments.
    calls: Vec<(bool, usize)>,
    /// Per call of the reply, by its place there: which call sent it is (calls that are not sent,
    /// an invented tool's, have none, so those sent are numbered 0, 1, … as a whole response's).
    sent_as: Vec<Option<usize>>,
}

/// The `index` call `place` of the reply goes out as, given one when it has none yet.
fn sent_index(
    sent_as: &mut Vec<Option<usize>>,
    calls: &mut Vec<(bool, usize)>,
    place: usize,
) -> usize {
    if sent_as.len() <= place {
        sent_as.resize(place + 1, None);
    }
    *sent_as[place].get_or_insert_with(|| {
        calls.push((false, 0));
        calls.len() - 1
    })
}

impl ToolStream {
    /// The new content and call pieces once `text` is added; calls are named `{ids}-{i}`.
    pub(crate) fn advance(
        &mut self,
        ids: &str,
        reader: &CallReader,
        text: &str,
    ) -> (String, Vec<ToolCallDelta>) {
        let ToolStream {
            parse,
            content_sent,
            calls,
            sent_as,
        } = self;
        let view = parse
            .get_or_insert_with(|| PartialStream::new(reader.format))
            .push(text);
        let content = view
            .content
            .get(*content_sent..)
            .unwrap_or_default()
            .to_string();
        *content_sent = (*content_sent).max(view.content.len());
        let mut deltas = Vec::new();
        for (k, call) in view.calls.iter().enumerate() {
            // A call goes out once it names an offered tool (and, one call a turn, is the first);
            // a reply with no such call is text, sent whole when it ends.
            let place = view.first + k;
            if !call
                .name
                .is_some_and(|n| reader.streams(place, n, call.keyed))
            {
                continue;
            }
            let i = sent_index(sent_as, calls, place);
            push_call(calls, ids, i, call.name, call.arguments, &mut deltas);
        }
        (content, deltas)
    }

    /// The rest once the choice is finished: content held back, the calls' last pieces, and whether
    /// the choice made calls.
    pub(crate) fn finish(
        &mut self,
        ids: &str,
        reader: &CallReader,
    ) -> (String, Vec<ToolCallDelta>, bool) {
        let text = self.parse.as_ref().map_or("", PartialStream::text);
        let (_, parsed) = reader.parse_indexed(text);
        if parsed.is_empty() {
            let rest = text
                .get(self.content_sent..)
                .unwrap_or_default()
                .to_string();
            self.content_sent = text.len();
            return (rest, Vec::new(), false);
        }
        let mut deltas = Vec::new();
        for (place, c) in &parsed {
            let i = sent_index(&mut self.sent_as, &mut self.calls, *place);
            push_call(
                &mut self.calls,
                ids,
                i,
                Some(&c.name),
                &c.arguments,
                &mut deltas,
            );
        }
        (String::new(), deltas, true)
    }
}

/// Call `i`'s pieces not sent yet (`calls`: what went out of each): its name and id once, then what
/// its arguments gained.
fn push_call(
    calls: &mut Vec<(bool, usize)>,
    ids: &str,
    i: usize,
    name: Option<&str>,
    arguments: &str,
    deltas: &mut Vec<ToolCallDelta>,
) {
    if calls.len() <= i {
        calls.resize(i + 1, (false, 0));
    }
    let (named, sent) = &mut calls[i];
    if !*named {
        let Some(name) = name else {
            return;
        };
        deltas.push(ToolCallDelta {
            index: i as u32,
            id: Some(format!("{ids}-{i}")),
            kind: Some("function"),
            function: FunctionDelta {
                name: Some(name.to_string()),
                arguments: String::new(),
            },
        });
        *named = true;
    }
    if let Some(more) = arguments.get(*sent..).filter(|m| !m.is_empty()) {
        deltas.push(ToolCallDelta {
            index: i as u32,
            id: None,
            kind: None,
            function: FunctionDelta {
                name: None,
                arguments: more.to_string(),
            },
        });
        *sent = arguments.len();
    }
}

/// When a request's time is up (`--request-timeout`): the instant, and the limit in seconds.
pub(crate) type Deadline = Option<(tokio::time::Instant, u64)>;

/// When a request arrived (its head read, as it is authenticated): `--request-timeout` counts from it,
/// so a wait for a grammar compile's turn, the compile and tokenization are inside the limit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Arrival(pub(crate) tokio::time::Instant);

/// The deadline of a request that arrived at `arrival`.
pub(crate) fn deadline(timeout: Option<std::time::Duration>, arrival: Arrival) -> Deadline {
    timeout.and_then(|t| arrival.0.checked_add(t).map(|at| (at, t.as_secs())))
}

/// The next event of `events`, or `Err(seconds)` when the deadline passes first.
pub(crate) async fn next_before(
    events: &mut Events,
    deadline: Deadline,
) -> Result<Option<EngineEvent>, u64> {
    match deadline {
        Some((at, seconds)) => tokio::time::timeout_at(at, events.next())
            .await
            .map_err(|_| seconds),
        None => Ok(events.next().await),
    }
}

/// The timeout error where `deadline` has passed: a request whose compile or tokenization took its
/// time is not handed to the engine.
pub(crate) fn before_deadline(deadline: Deadline) -> Result<(), ApiError> {
    match deadline {
        Some((at, seconds)) if tokio::time::Instant::now() >= at => {
            Err(ApiError::Timeout { seconds })
        }
        _ => Ok(()),
    }
}

/// `body` done before the deadline, or the timeout error (the collecting future is then dropped with its
/// request guards: the requests are cancelled).
pub(crate) async fn finish_before<T>(
    deadline: Deadline,
    body: impl std::future::Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    match deadline {
        Some((at, seconds)) => tokio::time::timeout_at(at, body)
            .await
            .map_err(|_| ApiError::Timeout { seconds })?,
        None => body.await,
    }
}

/// Bytes of output a request may have queued for its client before the engine pauses it.
pub const MAX_BACKLOG_BYTES: usize = 4 << 20;

/// Roughly what an event will take once serialized; what the backlog counts.
fn event_bytes(event: &EngineEvent) -> usize {
    match event {
        EngineEvent::Delta { text, logprobs, .. } => 128 + text.len() + logprobs_bytes(logprobs),
        EngineEvent::PromptLogprobs { logprobs, .. } => 128 + logprobs_bytes(&logprobs.rest),
        _ => 128,
    }
}

/// Roughly what tokens' log-probabilities take once serialized.
fn logprobs_bytes(logprobs: &[TokenLogprob]) -> usize {
    logprobs
        .iter()
        .map(|lp| {
            // `bytes` is a JSON array: up to four characters a byte.
            let candidate = |c: &kura_engine::TokenCandidate| 64 + c.text.len() + 4 * c.bytes.len();
            candidate(&lp.sampled) + lp.top.iter().map(candidate).sum::<usize>()
        })
        .sum()
}

/// One prompt's sink: forwards events, tagged with the prompt, and counts the bytes not yet read.
struct PromptSink {
    prompt: u32,
    tx: UnboundedSender<(u32, EngineEvent)>,
    backlog: Arc<AtomicUsize>,
}

impl EventSink for PromptSink {
    fn send(&mut self, event: EngineEvent) -> bool {
        self.backlog
            .fetch_add(event_bytes(&event), Ordering::AcqRel);
        self.tx.send((self.prompt, event)).is_ok()
    }

    fn is_full(&self) -> bool {
        self.backlog.load(Ordering::Acquire) >= MAX_BACKLOG_BYTES
    }
}

/// The merged events of one API request (one engine request per prompt).
pub struct Events {
    rx: UnboundedReceiver<(u32, EngineEvent)>,
    guards: Vec<RequestGuard>,
    backlog: Arc<AtomicUsize>,
    /// Choices per prompt.
    n: u32,
    prompts: u32,
    prompts_done: u32,
    usage: Usage,
    /// Prompts computed so far, and their usage summed (what `Prompted` tells once all are).
    prompts_prompted: u32,
    prompted: Usage,
}

/// Adds one prompt's usage to the sum of a request's prompts; the first prompt's miss is told.
fn add_usage(sum: &mut Usage, usage: &Usage) {
    sum.prompt_tokens = sum.prompt_tokens.saturating_add(usage.prompt_tokens);
    sum.completion_tokens = sum
        .completion_tokens
        .saturating_add(usage.completion_tokens);
    sum.cached_tokens = sum.cached_tokens.saturating_add(usage.cached_tokens);
    sum.cache_write_tokens = sum
        .cache_write_tokens
        .saturating_add(usage.cache_write_tokens);
    sum.miss = sum.miss.or(usage.miss);
}

impl Events {
    /// A merged stream for `prompts` engine requests of `n` choices each; submit prompt `i` with
    /// [`EventsSender::sink`]`(i)` and hand its guard to [`Events::add_guard`].
    pub fn new(prompts: u32, n: u32) -> (Self, EventsSender) {
        let (tx, rx) = mpsc::unbounded_channel();
        let backlog = Arc::new(AtomicUsize::new(0));
        (
            Self {
                rx,
                guards: Vec::new(),
                backlog: backlog.clone(),
                n,
                prompts,
                prompts_done: 0,
                usage: Usage::default(),
                prompts_prompted: 0,
                prompted: Usage::default(),
            },
            EventsSender { tx, backlog },
        )
    }

    pub fn add_guard(&mut self, guard: RequestGuard) {
        self.guards.push(guard);
    }

    /// Choices over all prompts.
    pub fn total_choices(&self) -> u32 {
        self.prompts.saturating_mul(self.n)
    }

    /// The next event with choices renumbered; `Done` once every prompt is done (usage summed). `None`
    /// when an engine request ended without a last event (its sink was dropped).
    pub async fn next(&mut self) -> Option<EngineEvent> {
        loop {
            let (prompt, event) = self.rx.recv().await?;
            let size = event_bytes(&event);
            let _ = self
                .backlog
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                    Some(b.saturating_sub(size))
                });
            let base = prompt.saturating_mul(self.n);
            return Some(match event {
                EngineEvent::Delta {
                    choice,
                    text,
                    token_ids,
                    logprobs,
                } => EngineEvent::Delta {
                    choice: base.saturating_add(choice),
                    text,
                    token_ids,
                    logprobs,
                },
                EngineEvent::Finished {
                    choice,
                    reason,
                    stop_sequence,
                } => EngineEvent::Finished {
                    choice: base.saturating_add(choice),
                    reason,
                    stop_sequence,
                },
                EngineEvent::Prompted { usage } => {
                    add_usage(&mut self.prompted, &usage);
                    self.prompts_prompted += 1;
                    if self.prompts_prompted < self.prompts {
                        continue;
                    }
                    EngineEvent::Prompted {
                        usage: self.prompted,
                    }
                }
                EngineEvent::Done { usage } => {
                    add_usage(&mut self.usage, &usage);
                    self.prompts_done += 1;
                    if self.prompts_done < self.prompts {
                        continue;
                    }
                    EngineEvent::Done { usage: self.usage }
                }
                failed @ EngineEvent::Failed(_) => failed,
                EngineEvent::PromptLogprobs { logprobs, .. } => {
                    EngineEvent::PromptLogprobs { prompt, logprobs }
                }
            });
        }
    }
}

/// Makes the sinks of an [`Events`] stream.
pub struct EventsSender {
    tx: UnboundedSender<(u32, EngineEvent)>,
    backlog: Arc<AtomicUsize>,
}

impl EventsSender {
    pub fn sink(&self, prompt: u32) -> impl EventSink {
        PromptSink {
            prompt,
            tx: self.tx.clone(),
            backlog: self.backlog.clone(),
        }
    }
}

/// `x` as a JSON number written as the f32 it is (`-0.1`, as the typed fields beside it are written),
/// where `Value::from` would widen it to the f64 `-0.10000000149011612`; `null` when not finite, as
/// serde_json writes a non-finite float.
fn f32_number(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .ok()
        .and_then(serde_json::Number::from_f64)
        .map_or(Value::Null, Value::Number)
}

fn completion_logprobs(lps: &[TokenLogprob], offset: &mut usize) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for lp in lps {
        push_completion_logprob(&mut out, &lp.sampled.text, Some(lp), offset);
    }
    out
}

/// An echoed prompt's log-probabilities with `top` alternatives a token: its first token's `null`,
/// then the others'.
fn prompt_completion_logprobs(
    p: &PromptLogprobs,
    top: u32,
    offset: &mut usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    push_completion_logprob(&mut out, &p.first.text, None, offset);
    for lp in &p.rest {
        let mut lp = std::borrow::Cow::Borrowed(lp);
        if lp.top.len() > top as usize {
            lp.to_mut().top.truncate(top as usize);
        }
        push_completion_logprob(&mut out, &lp.sampled.text, Some(&lp), offset);
    }
    out
}

/// vLLM's `prompt_logprobs` of a prompt with `top` alternatives a token: `null` for the first token,
/// then `{token id: {"logprob", "rank", "decoded_token"}}` of the token (its rank in the vocabulary)
/// and of the most likely tokens (ranks 1..=`top`), the token once where it is one of them (with its
/// place among them).
fn vllm_prompt_logprobs(p: &PromptLogprobs, top: u32) -> PromptLogprobsBody {
    let entry = |logprob: f32, rank: u32, text: &str| {
        let mut e = Map::new();
        e.insert("logprob".into(), f32_number(logprob));
        e.insert("rank".into(), Value::from(rank));
        e.insert("decoded_token".into(), Value::from(text));
        Value::Object(e)
    };
    let rows = std::iter::once(None)
        .chain(p.rest.iter().zip(&p.ranks).map(|(lp, &rank)| {
            let mut m = Map::new();
            let s = &lp.sampled;
            m.insert(s.token_id.to_string(), entry(s.logprob, rank, &s.text));
            // The most likely last, as vLLM writes them: a token that is one of them is ranked by
            // its place among them (tied tokens in order of id).
            for (c, rank) in lp.top.iter().take(top as usize).zip(1..) {
                m.insert(c.token_id.to_string(), entry(c.logprob, rank, &c.text));
            }
            Some(m)
        }))
        .collect();
    PromptLogprobsBody(Arc::new(rows))
}

/// One token of legacy completions logprobs (`lp`: `None` for an echoed prompt's first token).
fn push_completion_logprob(
    out: &mut CompletionLogprobs,
    text: &str,
    lp: Option<&TokenLogprob>,
    offset: &mut usize,
) {
    out.tokens.push(text.to_owned());
    out.token_logprobs.push(lp.map(|lp| lp.sampled.logprob));
    // Legacy completions key alternatives by their text. Distinct tokens can decode to the same
    // text (or to the same replacement character); a later one then keys by its id, as vLLM's
    // `token_id:N` does, so that no alternative is lost.
    out.top_logprobs.push(lp.map(|lp| {
        let mut top = Map::new();
        for c in &lp.top {
            let key = if top.contains_key(&c.text) {
                format!("token_id:{}", c.token_id)
            } else {
                c.text.clone()
            };
            top.insert(key, f32_number(c.logprob));
        }
        top
    }));
    out.text_offset.push(*offset);
    *offset += text.len();
}

/// A completion choice's text and log-probabilities, its echoed prompt's first.
fn echoed_choice(
    meta: &ResponseMeta,
    prompt: usize,
    scores: Option<&PromptLogprobs>,
    text: String,
    lps: &[TokenLogprob],
) -> (String, Option<CompletionLogprobs>) {
    let echo = meta.echo.as_ref().and_then(|e| e.get(prompt));
    let logprobs = meta.logprobs.then(|| {
        let mut offset = 0;
        let mut out = match (echo, scores) {
            (Some(_), Some(p)) => prompt_completion_logprobs(p, meta.top_logprobs, &mut offset),
            _ => CompletionLogprobs::default(),
        };
        let more = completion_logprobs(lps, &mut offset);
        out.tokens.extend(more.tokens);
        out.token_logprobs.extend(more.token_logprobs);
        out.top_logprobs.extend(more.top_logprobs);
        out.text_offset.extend(more.text_offset);
        out
    });
    let text = match echo {
        Some(e) => format!("{e}{text}"),
        None => text,
    };
    (text, logprobs)
}

fn chat_logprobs(lps: &[TokenLogprob]) -> ChatLogprobs {
    ChatLogprobs {
        content: lps
            .iter()
            .map(|lp| ChatTokenLogprob {
                token: lp.sampled.text.clone(),
                logprob: lp.sampled.logprob,
                bytes: lp.sampled.bytes.clone(),
                top_logprobs: lp
                    .top
                    .iter()
                    .map(|c| TopLogprob {
                        token: c.text.clone(),
                        logprob: c.logprob,
                        bytes: c.bytes.clone(),
                    })
                    .collect(),
            })
            .collect(),
        refusal: None,
    }
}

#[derive(Default)]
struct ChoiceAcc {
    text: String,
    token_ids: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    finish: Option<FinishReason>,
    /// Where reasoning is read: the choice's text read apart as it comes (then `text` stays empty).
    thinking: Option<ThinkWhole>,
}

/// Waits for the whole request and builds the non-streaming response body, serialized (straight from
/// the typed response: a `Value` tree of a response with log-probabilities would take several times
/// its bytes).
pub async fn collect(meta: &ResponseMeta, mut events: Events) -> Result<Vec<u8>, ApiError> {
    let mut choices: Vec<ChoiceAcc> = (0..events.total_choices())
        .map(|_| ChoiceAcc {
            thinking: meta.reasoning.map(ThinkWhole::new),
            ..ChoiceAcc::default()
        })
        .collect();
    let mut prompt_scores: Vec<Option<Arc<PromptLogprobs>>> = vec![None; events.prompts as usize];
    // vLLM's `prompt_logprobs`, made once a prompt.
    let mut bodies: Vec<Option<PromptLogprobsBody>> = vec![None; events.prompts as usize];
    let n = events.n.max(1) as usize;
    let usage = loop {
        let Some(event) = events.next().await else {
            return Err(ApiError::Internal(
                "the engine dropped the request without finishing it".into(),
            ));
        };
        match event {
            EngineEvent::Delta {
                choice,
                text,
                token_ids,
                logprobs,
            } => {
                if let Some(c) = choices.get_mut(choice as usize) {
                    match &mut c.thinking {
                        Some(whole) => {
                            whole.push_token(&text);
                        }
                        None => c.text.push_str(&text),
                    }
                    c.token_ids.extend(token_ids);
                    c.logprobs.extend(logprobs);
                }
            }
            EngineEvent::Finished { choice, reason, .. } => {
                if let Some(c) = choices.get_mut(choice as usize) {
                    c.finish = Some(reason);
                }
            }
            EngineEvent::Done { usage } => break usage,
            EngineEvent::Failed(e) => return Err(e.into()),
            EngineEvent::Prompted { .. } => {}
            EngineEvent::PromptLogprobs { prompt, logprobs } => {
                if let (Some(top), Some(b)) =
                    (meta.prompt_logprobs, bodies.get_mut(prompt as usize))
                {
                    *b = Some(vllm_prompt_logprobs(&logprobs, top));
                }
                if let Some(p) = prompt_scores.get_mut(prompt as usize) {
                    *p = Some(logprobs);
                }
            }
        }
    };
    let reasoning_tokens = meta.reasoning.map(|_| {
        choices
            .iter()
            .filter_map(|c| c.thinking.as_ref().map(ThinkWhole::tokens))
            .fold(0u32, u32::saturating_add)
    });
    let usage = UsageBody::from(usage).with_reasoning(reasoning_tokens);
    let body = match meta.shape {
        Shape::Completion => serde_json::to_vec(&CompletionResponse {
            id: meta.id.clone(),
            object: "text_completion",
            created: meta.created,
            model: meta.model.clone(),
            choices: choices
                .into_iter()
                .enumerate()
                .map(|(i, c)| {
                    let prompt = i / n;
                    let scores = prompt_scores.get(prompt).and_then(Option::as_deref);
                    let (text, logprobs) = echoed_choice(meta, prompt, scores, c.text, &c.logprobs);
                    CompletionChoice {
                        index: i as u32,
                        logprobs,
                        text,
                        finish_reason: c.finish.map(FinishReason::as_str),
                        token_ids: meta.token_ids.then_some(c.token_ids),
                        prompt_token_ids: meta.prompt_token_ids.get(prompt).cloned(),
                        prompt_logprobs: bodies.get(prompt).cloned().flatten(),
                    }
                })
                .collect(),
            usage: Some(usage),
        }),
        Shape::Chat => serde_json::to_vec(&ChatCompletionResponse {
            id: meta.id.clone(),
            object: "chat.completion",
            created: meta.created,
            model: meta.model.clone(),
            choices: choices
                .into_iter()
                .enumerate()
                .map(|(i, c)| {
                    let (reasoning, text) = match c.thinking {
                        Some(mut whole) => {
                            whole.finish();
                            whole.into_parts()
                        }
                        None => (None, c.text),
                    };
                    let (mut content, tool_calls, finish_reason) =
                        read_calls(meta, i as u32, text, c.finish);
                    // A turn that only reasoned has no answer (`null`, as a turn of calls alone).
                    if reasoning.is_some() && content.as_deref() == Some("") {
                        content = None;
                    }
                    ChatChoice {
                        index: i as u32,
                        logprobs: meta.logprobs.then(|| chat_logprobs(&c.logprobs)),
                        message: ResponseMessage {
                            role: "assistant",
                            content,
                            refusal: None,
                            tool_calls,
                            reasoning_content: reasoning.clone(),
                            reasoning,
                        },
                        finish_reason,
                        token_ids: meta.token_ids.then_some(c.token_ids),
                    }
                })
                .collect(),
            usage,
            prompt_token_ids: meta.prompt_token_ids.first().cloned(),
            prompt_logprobs: bodies.first().cloned().flatten(),
        }),
    };
    body.map_err(|e| ApiError::Internal(format!("serializing the response: {e}")))
}

/// State of one SSE stream; the guard inside cancels the request when the client goes away (axum
/// drops the stream).
struct SseState {
    meta: ResponseMeta,
    events: Events,
    include_usage: bool,
    /// Per choice: bytes of text sent so far (completions' `text_offset`).
    offsets: Vec<usize>,
    /// Per chat choice, when calls are read out of the text.
    tool_streams: Vec<ToolStream>,
    /// Per chat choice, when its reasoning is read apart (`meta.reasoning`).
    thinks: Vec<ThinkSplit>,
    /// The reasoning tokens of all choices so far.
    reasoning_tokens: u32,
    queue: VecDeque<Event>,
    /// Echo chunks to write before anything in `queue`: (prompt, choice, the prompt's scores when
    /// reported).
    echoes: VecDeque<(u32, u32, Option<Arc<PromptLogprobs>>)>,
    finished: bool,
    /// When the stream is cut with a timeout error (and the request cancelled), with the limit in s.
    deadline: Deadline,
}

impl SseState {
    fn chunk(
        &self,
        choice: u32,
        text: Option<String>,
        lps: &[TokenLogprob],
        offset: &mut usize,
        finish_reason: Option<&'static str>,
    ) -> Event {
        self.chat_chunk(choice, text, None, None, lps, offset, finish_reason)
    }

    #[allow(clippy::too_many_arguments)]
    fn chat_chunk(
        &self,
        choice: u32,
        text: Option<String>,
        tool_calls: Option<Vec<ToolCallDelta>>,
        reasoning: Option<String>,
        lps: &[TokenLogprob],
        offset: &mut usize,
        finish_reason: Option<&'static str>,
    ) -> Event {
        let value = match self.meta.shape {
            Shape::Completion => {
                return self.completion_chunk(CompletionChoice {
                    index: choice,
                    text: text.unwrap_or_default(),
                    logprobs: self.meta.logprobs.then(|| completion_logprobs(lps, offset)),
                    finish_reason,
                    token_ids: None,
                    prompt_token_ids: None,
                    prompt_logprobs: None,
                })
            }
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
                        tool_calls,
                        reasoning_content: reasoning.clone(),
                        reasoning,
                    },
                    logprobs: (self.meta.logprobs && !lps.is_empty()).then(|| chat_logprobs(lps)),
                    finish_reason,
                }],
                usage: None,
            }),
        };
        Event::default().data(value.unwrap_or_default())
    }

    /// A completions chunk of one choice.
    fn completion_chunk(&self, choice: CompletionChoice) -> Event {
        let value = serde_json::to_string(&CompletionResponse {
            id: self.meta.id.clone(),
            object: "text_completion",
            created: self.meta.created,
            model: self.meta.model.clone(),
            choices: vec![choice],
            usage: None,
        });
        Event::default().data(value.unwrap_or_default())
    }

    /// Queues the chunks that open an echoing completion's choices of prompt `prompt`: its text, and
    /// with `logprobs` its scores. Each is written when it is next to go ([`SseState::next_echo`]):
    /// `n` choices of a long prompt's scores are one copy of them until then, not `n` chunks.
    fn push_echo(&mut self, prompt: u32, scores: Option<Arc<PromptLogprobs>>) {
        if self
            .meta
            .echo
            .as_ref()
            .and_then(|e| e.get(prompt as usize))
            .is_none()
        {
            return;
        }
        let scores = scores.filter(|_| self.meta.logprobs);
        // Where each choice's own text starts in its `text_offset`s: after the prompt's tokens.
        let offset = scores.as_ref().map_or(0, |p| {
            p.first.text.len() + p.rest.iter().map(|lp| lp.sampled.text.len()).sum::<usize>()
        });
        let n = self.events.n;
        for choice in prompt.saturating_mul(n)..prompt.saturating_add(1).saturating_mul(n) {
            if let Some(o) = self.offsets.get_mut(choice as usize) {
                *o = offset;
            }
            self.echoes.push_back((prompt, choice, scores.clone()));
        }
    }

    /// The next queued echo chunk ([`SseState::push_echo`]), written now.
    fn next_echo(&mut self) -> Option<Event> {
        let (prompt, choice, scores) = self.echoes.pop_front()?;
        let text = self.meta.echo.as_ref()?.get(prompt as usize)?.clone();
        let logprobs = scores
            .as_deref()
            .map(|p| prompt_completion_logprobs(p, self.meta.top_logprobs, &mut 0));
        Some(self.completion_chunk(CompletionChoice {
            index: choice,
            text,
            logprobs,
            finish_reason: None,
            token_ids: None,
            prompt_token_ids: None,
            prompt_logprobs: None,
        }))
    }

    /// The chunk of a choice's new text (`text`, an answer's once its reasoning is read apart:
    /// `split`), its calls read out of it where the request has tools, its reasoning's new piece and
    /// its tokens' log-probabilities; `None` when it would carry nothing.
    fn answer_chunk(
        &mut self,
        choice: u32,
        text: String,
        reasoning: Option<String>,
        split: bool,
        logprobs: &[TokenLogprob],
        offset: &mut usize,
    ) -> Option<Event> {
        let tools = match self.meta.shape {
            Shape::Chat => self.meta.tools.clone(),
            Shape::Completion => None,
        };
        let (content, calls) = match (&tools, self.tool_streams.get_mut(choice as usize)) {
            (Some(reader), Some(ts)) => {
                let ids = self.meta.call_ids(choice);
                let (content, calls) = ts.advance(&ids, reader, &text);
                (
                    (!content.is_empty()).then_some(content),
                    (!calls.is_empty()).then_some(calls),
                )
            }
            // Without tools or reasoning, every piece is sent as it is (an empty one too, beside
            // its log-probabilities).
            _ if !split => (Some(text), None),
            _ => ((!text.is_empty()).then_some(text), None),
        };
        if content.is_none() && calls.is_none() && reasoning.is_none() && logprobs.is_empty() {
            return None;
        }
        Some(self.chat_chunk(choice, content, calls, reasoning, logprobs, offset, None))
    }

    fn usage_chunk(&self, usage: Usage) -> Event {
        let reasoning_tokens = self.meta.reasoning.map(|_| self.reasoning_tokens);
        let usage = Some(UsageBody::from(usage).with_reasoning(reasoning_tokens));
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
        let tools = match self.meta.shape {
            Shape::Chat => self.meta.tools.clone(),
            Shape::Completion => None,
        };
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
                // A reasoning model's reasoning goes apart; the rest is the answer (or calls).
                let (reasoning, text, split) = match self.thinks.get_mut(choice as usize) {
                    Some(t) => {
                        let (s, tokens) = t.push_token(&text);
                        self.reasoning_tokens = self.reasoning_tokens.saturating_add(tokens);
                        (
                            (!s.reasoning.is_empty()).then_some(s.reasoning),
                            s.content,
                            true,
                        )
                    }
                    None => (None, text, false),
                };
                if let Some(e) =
                    self.answer_chunk(choice, text, reasoning, split, &logprobs, &mut offset)
                {
                    self.queue.push_back(e);
                }
                if let Some(o) = self.offsets.get_mut(choice as usize) {
                    *o = offset;
                }
            }
            EngineEvent::Finished { choice, reason, .. } => {
                let mut finish = reason.as_str();
                // What the reasoning's reader held back, now known.
                if let Some(t) = self.thinks.get_mut(choice as usize) {
                    let s = t.finish();
                    let reasoning = (!s.reasoning.is_empty()).then_some(s.reasoning);
                    if let Some(e) =
                        self.answer_chunk(choice, s.content, reasoning, true, &[], &mut 0)
                    {
                        self.queue.push_back(e);
                    }
                }
                if let (Some(reader), Some(ts)) =
                    (&tools, self.tool_streams.get_mut(choice as usize))
                {
                    let ids = self.meta.call_ids(choice);
                    let (content, calls, made_calls) = ts.finish(&ids, reader);
                    if made_calls && reason == FinishReason::Stop {
                        finish = "tool_calls";
                    }
                    if !content.is_empty() || !calls.is_empty() {
                        let content = (!content.is_empty()).then_some(content);
                        let calls = (!calls.is_empty()).then_some(calls);
                        let e = self.chat_chunk(choice, content, calls, None, &[], &mut 0, None);
                        self.queue.push_back(e);
                    }
                }
                let text = match self.meta.shape {
                    Shape::Completion => Some(String::new()),
                    Shape::Chat => None,
                };
                let e = self.chunk(choice, text, &[], &mut 0, Some(finish));
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
            // The usage comes whole at the end (`stream_options.include_usage`).
            EngineEvent::Prompted { .. } => {}
            EngineEvent::PromptLogprobs { prompt, logprobs } => {
                if self.meta.logprobs {
                    self.push_echo(prompt, Some(logprobs));
                }
            }
        }
    }
}

/// The SSE event stream of a request. Chat streams open with one role chunk per choice, as OpenAI's.
pub fn sse_stream(
    meta: ResponseMeta,
    include_usage: bool,
    events: Events,
    deadline: Deadline,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let n = events.total_choices();
    let thinks = match meta.reasoning {
        Some(inside) => (0..n).map(|_| ThinkSplit::new(inside)).collect(),
        None => Vec::new(),
    };
    let mut state = SseState {
        meta,
        events,
        include_usage,
        offsets: vec![0; n as usize],
        tool_streams: (0..n).map(|_| ToolStream::default()).collect(),
        thinks,
        reasoning_tokens: 0,
        queue: VecDeque::new(),
        echoes: VecDeque::new(),
        finished: false,
        deadline,
    };
    // An echo without log-probabilities opens each choice with its prompt at once; with them, when
    // the prompt is scored.
    if state.meta.echo.is_some() && !state.meta.logprobs {
        for prompt in 0..state.events.prompts {
            state.push_echo(prompt, None);
        }
    }
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
                        tool_calls: None,
                        reasoning: None,
                        reasoning_content: None,
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
            // A choice's echo goes before its first chunk: echoes go before anything queued.
            if let Some(e) = state.next_echo() {
                return Some((Ok(e), state));
            }
            if let Some(e) = state.queue.pop_front() {
                return Some((Ok(e), state));
            }
            if state.finished {
                return None;
            }
            let next = match next_before(&mut state.events, state.deadline).await {
                Ok(next) => next,
                Err(seconds) => {
                    let body = ApiError::Timeout { seconds }.body();
                    state
                        .queue
                        .push_back(Event::default().data(body.to_string()));
                    state.queue.push_back(Event::default().data("[DONE]"));
                    state.finished = true;
                    continue;
                }
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
