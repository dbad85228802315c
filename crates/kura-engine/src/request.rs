//! What a caller hands the engine (a [`GenerateRequest`]) and what comes back (a stream of
//! [`EngineEvent`]s through an [`EventSink`]).
//!
//! The engine is synchronous and owns no async runtime: a caller (the HTTP server) gives it a sink, a
//! closure that forwards each event into whatever channel the caller reads. A sink that reports the
//! reader gone (`false`) cancels the request, exactly as dropping its [`crate::RequestGuard`] does.
//!
//! Output is bounded per request: a sink that says it is full ([`EventSink::is_full`]) gets no further
//! steps until it drains, and one that stays full longer than `EngineConfig::stalled_client_timeout` is
//! cancelled with [`RequestError::ClientStalled`].

use serde::Serialize;

/// How the next token is chosen: the model's own sampling parameters (temperature 0 is greedy; with a
/// seed, choice `i` of `n` uses `seed + i`; `logprobs: Some(k)` reports the sampled token's logprob and
/// the `k` most likely alternatives).
pub use kura_model::SamplingParams;

/// One generation request, already tokenized and validated by the caller.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_tokens: Vec<u32>,
    pub sampling: SamplingParams,
    /// Upper bound on generated tokens per choice.
    pub max_tokens: u32,
    /// Number of choices; choices 1.. fork the prompt's blocks of choice 0 instead of recomputing them.
    pub n: u32,
    /// Generation stops before any of these strings; the string itself is not returned.
    pub stop: Vec<String>,
    /// Generation also stops after any of these token ids (in addition to the model's end-of-sequence).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// Lower runs first (vLLM's convention); 0 is the default. Ties are served first come, first served.
    pub priority: i32,
    /// Requests share cached blocks only when their salts are equal (tenant isolation).
    pub cache_salt: Option<String>,
    /// Prefixes of the prompt to keep cached once it is computed (context caching): each is pinned in
    /// the pool until its expiry, or kept in the lower tiers when the pin budget is spent.
    pub pins: Vec<PinSpec>,
}

/// A prefix of a request's prompt to keep: the first `tokens` tokens (whole blocks of them), until
/// `expires_at_ms` on the engine's cache clock ([`crate::EngineHandle::cache_now_ms`]). Pinning a prefix
/// that is pinned already (same tenant, same tokens) refreshes its expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinSpec {
    pub tokens: usize,
    pub expires_at_ms: u64,
    /// Also write the prefix through to the lower tiers at once (kept across restarts on disk).
    pub persist: bool,
}

impl GenerateRequest {
    /// A greedy request with defaults for everything else; handy for tests and tools.
    pub fn greedy(prompt_tokens: Vec<u32>, max_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            sampling: SamplingParams::greedy(),
            max_tokens,
            n: 1,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            priority: 0,
            cache_salt: None,
            pins: Vec::new(),
        }
    }
}

/// Why a choice stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End-of-sequence token, stop token or stop string.
    Stop,
    /// `max_tokens` reached, or the model's context is full.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Log-probability of one candidate token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenCandidate {
    pub token_id: u32,
    /// The token decoded alone (U+FFFD where it holds part of a character).
    pub text: String,
    /// The token's own bytes ([`crate::TextCodec::token_bytes`]): what OpenAI's `bytes` field reports.
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// The sampled token's log-probability and the most likely alternatives at that position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub sampled: TokenCandidate,
    pub top: Vec<TokenCandidate>,
}

/// Token accounting of a whole request (all choices).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens whose KV came from the prefix cache (or from another request's blocks in flight)
    /// instead of being computed for this request.
    pub cached_tokens: u32,
    /// Prompt tokens of the request's pinned prefixes ([`GenerateRequest::pins`]) that it computed and
    /// wrote into the cache itself (Anthropic's `cache_creation_input_tokens`).
    pub cache_write_tokens: u32,
}

/// Everything the engine reports about a request, in order: any number of `Delta`s and one
/// `Finished` per choice, then one `Done` — or a single `Failed` at any point, after which nothing follows.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// New text of one choice. `text` may be empty while a multi-byte character or a possible stop
    /// string is still incomplete; `token_ids` then still lists the tokens.
    Delta {
        choice: u32,
        text: String,
        token_ids: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
    },
    Finished {
        choice: u32,
        reason: FinishReason,
        /// The stop string that ended the choice, if one did.
        stop_sequence: Option<String>,
    },
    Done {
        usage: Usage,
    },
    Failed(RequestError),
}

/// Why a running request ended without finishing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("the server is shutting down; the request was cancelled before it finished")]
    ShuttingDown,
    #[error("the model failed while running this request: {0}")]
    Model(String),
    /// The request's sink stayed full (its client stopped reading) for longer than the engine's
    /// `stalled_client_timeout`; the request was cancelled and its KV blocks freed.
    #[error(
        "the client stopped reading the response for {waited_ms} ms; the request was cancelled"
    )]
    ClientStalled { waited_ms: u64 },
    /// The engine thread died (a panic in the scheduler or a kernel); nothing more will run.
    #[error(
        "the engine failed and can serve no more requests; the server must be restarted ({0})"
    )]
    EngineFailed(String),
    #[error(
        "the request needs {needed_blocks} KV blocks at once but the pool has only {total_blocks}; \
         lower max_tokens or n, or raise --kv-cache-memory"
    )]
    CannotFit {
        needed_blocks: usize,
        total_blocks: usize,
    },
}

/// Where the engine sends a request's events. `send` returns `false` when the reader is gone, which
/// cancels the request. Any `FnMut(EngineEvent) -> bool` closure is a sink that is never full.
pub trait EventSink: Send + 'static {
    fn send(&mut self, event: EngineEvent) -> bool;

    /// Whether the reader is behind and the sink wants no more output for now. The engine checks it
    /// before each step: a full sink's request is not stepped (it keeps its KV blocks, and may still be
    /// preempted), and one full for longer than `EngineConfig::stalled_client_timeout` is cancelled
    /// with [`RequestError::ClientStalled`]. A bounded sink must keep headroom below its hard limit:
    /// the output of a step is made while the next one is computed, so the step that fills it and the one
    /// after may add up to four events per choice plus `Done`, and a cancellation sends one `Failed` to
    /// the full sink. `send` and `is_full` are called from the output stage's thread and the engine's
    /// thread respectively, never at once (the sink sits behind a lock).
    fn is_full(&self) -> bool {
        false
    }
}

impl<F> EventSink for F
where
    F: FnMut(EngineEvent) -> bool + Send + 'static,
{
    fn send(&mut self, event: EngineEvent) -> bool {
        self(event)
    }
}

/// Why the engine refused a request at the door. Each variant is the caller's to act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("n must be at least 1")]
    ZeroChoices,
    /// Sampling parameters outside the sampler's domain (the message names the parameter).
    #[error("{0}")]
    BadSampling(String),
    #[error("token id {token_id} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfVocab { token_id: u32, vocab_size: usize },
    #[error(
        "the prompt has {prompt_tokens} tokens but this model's maximum context length is \
         {max_model_len} tokens, at least one generated token included: {excess} tokens too many"
    )]
    PromptTooLong {
        prompt_tokens: usize,
        max_model_len: usize,
        excess: usize,
    },
    #[error(
        "this model's maximum context length is {max_model_len} tokens; the prompt has {prompt_tokens} \
         and max_tokens asks for {max_tokens} more, {excess} tokens too many"
    )]
    ContextExceeded {
        prompt_tokens: usize,
        max_tokens: usize,
        max_model_len: usize,
        excess: usize,
    },
    #[error(
        "the request needs {needed_tokens} tokens of KV cache ({needed_blocks} blocks) but the whole pool \
         holds {capacity_tokens} tokens ({total_blocks} blocks); lower max_tokens or n, or raise \
         --kv-cache-memory"
    )]
    CannotFit {
        needed_tokens: usize,
        needed_blocks: usize,
        capacity_tokens: usize,
        total_blocks: usize,
    },
    #[error("the queue is full ({waiting} requests waiting, limit {max_queue}); retry later")]
    QueueFull { waiting: usize, max_queue: usize },
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The engine thread died earlier (see [`crate::EngineHandle::failure`]).
    #[error(
        "the engine failed and can serve no more requests; the server must be restarted ({0})"
    )]
    EngineFailed(String),
}
