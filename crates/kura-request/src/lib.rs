//! `kura-request` — the engine's vocabulary, shared by the engine and the HTTP layer without either
//! linking the other's runtime: what a caller hands the engine (a [`GenerateRequest`] with its
//! [`SamplingParams`]) and what comes back (a stream of [`EngineEvent`]s through an [`EventSink`]); chat
//! [`ChatMessage`]s and the [`TextCodec`] seam through which the engine and the HTTP layer tokenize
//! (`kura-text` implements it for a real model).
//!
//! The engine is synchronous and owns no async runtime: a caller (the HTTP server) gives it a sink, a
//! closure that forwards each event into whatever channel the caller reads. A sink that reports the
//! reader gone (`false`) cancels the request, exactly as dropping its request guard (`kura_engine::RequestGuard`) does.
//!
//! Output is bounded per request: a sink that says it is full ([`EventSink::is_full`]) gets no further
//! steps until it drains, and one that stays full longer than `EngineConfig::stalled_client_timeout` is
//! cancelled with [`RequestError::ClientStalled`].

use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Separates a tenant's name from a request's own salt in a cache salt: the engine's pins hold a
/// tenant to the part before it.
pub const TENANT_SEPARATOR: char = '\u{1f}';

/// How a [`TextCodec`] error starts when the text is longer than the context could hold whatever it
/// says (refused before tokenizing): the HTTP layer answers it as `context_length_exceeded`.
pub const TEXT_OVER_CONTEXT: &str = "the text is longer than the context could hold: ";

/// The start of a codec's error about a request's chat template arguments (vLLM's
/// `chat_template_kwargs`, after the text layer's `chat template: `), so that the HTTP layer names
/// that field.
pub const TEMPLATE_ARGUMENTS: &str = "chat_template_kwargs";

/// How the next token is chosen (temperature 0 is greedy; with a seed, choice `i` of `n` uses
/// `seed + i`; `logprobs: Some(k)` reports the sampled token's logprob and the `k` most likely
/// alternatives).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1 = all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p × p(most likely)` (0 = none).
    pub min_p: f32,
    /// Divides positive (multiplies negative) logits of tokens already seen (1 = off).
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated (0 = off).
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of every token already generated (0 = off).
    pub frequency_penalty: f32,
    pub seed: Option<u64>,
    /// Return this many top alternatives with each token's logprob (`None` = no logprobs).
    pub logprobs: Option<usize>,
    /// Added to the logits of these tokens before one is chosen (OpenAI's `logit_bias`): (token,
    /// bias), tokens ascending and each once. Logprobs stay those of the model's own distribution.
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Only these tokens may be chosen (vLLM's `allowed_token_ids`), ascending and each once; empty:
    /// any. Where a grammar's mask allows none of them, the grammar's mask alone holds.
    #[serde(default)]
    pub allowed_token_ids: Vec<u32>,
    /// Token sequences never written (vLLM's `bad_words`, each word tokenized as it starts a text
    /// and after a space): a sequence's last token is not chosen where the tokens generated so far
    /// end with the others (a one-token word's never), unless a grammar's mask allows nothing else.
    /// Each sequence holds at least one token. Logprobs stay those of the model's own distribution.
    #[serde(default)]
    pub bad_words: Vec<Vec<u32>>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logprobs: None,
            logit_bias: Vec::new(),
            allowed_token_ids: Vec::new(),
            bad_words: Vec::new(),
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// Checks the ranges; the message names the parameter and the value given.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature must be ≥ 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        if !self.presence_penalty.is_finite() || !self.frequency_penalty.is_finite() {
            return Err("presence_penalty and frequency_penalty must be finite".into());
        }
        if let Some(&(token, bias)) = self.logit_bias.iter().find(|b| !b.1.is_finite()) {
            return Err(format!(
                "logit_bias of token {token} must be finite, got {bias}"
            ));
        }
        if let Some(w) = self.logit_bias.windows(2).find(|w| w[0].0 >= w[1].0) {
            return Err(format!(
                "logit_bias must list each token once, in ascending order: {} then {}",
                w[0].0, w[1].0
            ));
        }
        if self.bad_words.iter().any(Vec::is_empty) {
            return Err("bad_words must not hold an empty token sequence".into());
        }
        if let Some(w) = self.allowed_token_ids.windows(2).find(|w| w[0] >= w[1]) {
            return Err(format!(
                "allowed_token_ids must list each token once, in ascending order: {} then {}",
                w[0], w[1]
            ));
        }
        Ok(())
    }
}

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
    /// vLLM's `include_stop_str_in_output`: a stop string that ends a choice is part of its text.
    pub include_stop_str: bool,
    /// vLLM's `skip_special_tokens: false`: the text keeps the special tokens the choice wrote
    /// (except the stop token that ends it).
    pub keep_special_tokens: bool,
    /// vLLM's `min_tokens`: no choice ends on a stop token (end-of-sequence or one of
    /// `stop_token_ids`) or a stop string before it has this many tokens (0: none held back). A
    /// grammar that allows nothing but its end still ends.
    pub min_tokens: u32,
    /// Lower runs first (vLLM's convention); 0 is the default. Ties are served first come, first served.
    pub priority: i32,
    /// Requests share cached blocks only when their salts are equal (tenant isolation).
    pub cache_salt: Option<String>,
    /// Prefixes of the prompt to keep cached once it is computed (context caching): each is pinned in
    /// the pool until its expiry, or kept in the lower tiers when the pin budget is spent.
    pub pins: Vec<PinSpec>,
    /// What the choices may generate (structured outputs, constrained tool calls): each choice walks
    /// its own [`TokenConstraint`], started from this. `None`: any token.
    pub constraint: Option<Arc<dyn ConstraintSpec>>,
    /// Prompt tokens that hold the earlier turns of a conversation (0: none): a prompt that differs
    /// from the cached one inside them is a [`MissReason::TemplateRerendered`].
    pub history_tokens: usize,
    /// Score the prompt as well (OpenAI's `echo` with `logprobs`): the log-probability of each prompt
    /// token after the first, given the tokens before it, with this many most likely alternatives,
    /// sent as one [`EngineEvent::PromptLogprobs`] before the first token. Every position's logits
    /// are needed, so the prompt is computed whole: its cached prefix is not read
    /// ([`MissReason::PromptLogprobs`]). `None`: not scored.
    pub prompt_logprobs: Option<usize>,
}

/// A grammar the output must follow, ready to start (compiled once per request).
pub trait ConstraintSpec: Send + Sync + std::fmt::Debug {
    /// A fresh walker at the grammar's start, for one choice.
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String>;
    /// The request field the grammar came from (`response_format`, `tools`, …), named by an error
    /// the walk meets while generating.
    fn param(&self) -> Option<&'static str> {
        None
    }
}

/// One choice's walk through a grammar: which tokens may come next, and the token that came.
pub trait TokenConstraint: Send {
    /// The next token, which `sample` picks among the tokens a mask allows (bit `id % 32` of word
    /// `id / 32`; ids past the end are not allowed). End-of-sequence is allowed only where the grammar
    /// may end. `budget`: how many tokens the choice may still generate, this one included; near its
    /// end the walk may turn the sampled token down for one of the way that closes its grammar within
    /// the budget, and then take that way's tokens without sampling. An error (no token allowed, a
    /// broken grammar) ends the choice.
    fn choose(
        &mut self,
        budget: usize,
        sample: &mut dyn FnMut(&[u32]) -> u32,
    ) -> Result<u32, String>;
    /// Moves past `token`, which [`TokenConstraint::choose`] chose.
    fn accept(&mut self, token: u32) -> Result<(), String>;
    /// The grammar is complete and nothing but end-of-sequence may follow: the choice stops.
    fn is_done(&self) -> bool;
    /// The walk closed its grammar early because the budget ran short: the output is complete, but
    /// shorter than the model would have made it. [`TokenConstraint::is_done`] is true once closed,
    /// and the choice ends as `length`.
    fn closed_early(&self) -> bool {
        false
    }
    /// Whether the next token is the model's own, nothing masked (a walk that only counts, such as a
    /// reasoning budget's until it is spent): the engine may then choose it as it chooses where no
    /// walk is (the most likely token on the device, or drawn beside the batch's other rows) and
    /// hand it to [`TokenConstraint::accept`], without [`TokenConstraint::choose`].
    fn free_next(&self) -> bool {
        false
    }
}

/// A prefix of a request's prompt to keep: the first `tokens` tokens (whole blocks of them), until
/// `expires_at_ms` on the engine's cache clock (`kura_engine::EngineHandle::cache_now_ms`). Pinning a prefix
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
            include_stop_str: false,
            keep_special_tokens: false,
            min_tokens: 0,
            priority: 0,
            cache_salt: None,
            pins: Vec::new(),
            constraint: None,
            history_tokens: 0,
            prompt_logprobs: None,
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
    /// The token's own bytes ([`TextCodec::token_bytes`]): what OpenAI's `bytes` field reports.
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// The sampled token's log-probability and the most likely alternatives at that position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub sampled: TokenCandidate,
    pub top: Vec<TokenCandidate>,
}

/// A prompt's own log-probabilities ([`GenerateRequest::prompt_logprobs`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprobs {
    /// The first prompt token's text and bytes (no token comes before it to score it: its logprob is
    /// reported as none, and `logprob` here is 0).
    pub first: TokenCandidate,
    /// Each later prompt token's log-probability given the tokens before it, in order, with the most
    /// likely alternatives at its position.
    pub rest: Vec<TokenLogprob>,
    /// Each of `rest`'s tokens' rank in the vocabulary at its position: how many tokens are at least as
    /// likely, itself included (1: the most likely; two tied for the most likely are both 2), as vLLM
    /// counts it.
    pub ranks: Vec<u32>,
}

/// Why a prompt's cached part stopped where it did, when a longer one could have been cached: told to
/// the client with its usage, and counted by reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CacheMiss {
    pub reason: MissReason,
    /// The first prompt token that was not cached (`Diverged`, `TemplateRerendered`: the first token
    /// that differs from what this tenant had cached).
    pub at: u32,
}

/// The reasons a prompt's prefix was not cached further.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MissReason {
    /// No earlier request of this tenant (and salt) went further with this prefix.
    NeverSeen,
    /// This tenant had the next block of this prefix cached, and it was evicted since.
    Evicted,
    /// This tenant's longest earlier prompt with this prefix differs at token `at`, inside the next
    /// block: only whole blocks are cached.
    Diverged,
    /// As `Diverged`, at a token of an earlier turn of the conversation: the earlier turns were written
    /// differently from the cached ones (a template that re-renders history, or a client that edited it).
    TemplateRerendered,
    /// The same tenant had this prefix cached under another cache salt (`cache_salt`).
    SaltDiffers,
    /// The pool held the next blocks of this prefix, but no longer the part of them a sliding-window
    /// layer reads (a hybrid pool reclaims those first): the prefix is cut back to where the window
    /// can be served.
    WindowDropped,
    /// The request asked for its prompt's log-probabilities ([`GenerateRequest::prompt_logprobs`]):
    /// they need the logits of every prompt position, so no cached block was read.
    PromptLogprobs,
}

impl MissReason {
    pub const ALL: [MissReason; 7] = [
        MissReason::NeverSeen,
        MissReason::Evicted,
        MissReason::Diverged,
        MissReason::TemplateRerendered,
        MissReason::SaltDiffers,
        MissReason::WindowDropped,
        MissReason::PromptLogprobs,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            MissReason::NeverSeen => "never_seen",
            MissReason::Evicted => "evicted",
            MissReason::Diverged => "diverged",
            MissReason::TemplateRerendered => "template_rerendered",
            MissReason::SaltDiffers => "salt_differs",
            MissReason::WindowDropped => "window_dropped",
            MissReason::PromptLogprobs => "prompt_logprobs",
        }
    }
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
    /// Why the prompt was not cached further, when it could have been (`None`: it was cached as far
    /// as a prompt can be).
    pub miss: Option<CacheMiss>,
}

/// Everything the engine reports about a request, in order: its `PromptLogprobs` when asked, one
/// `Prompted` when its prompt is computed, any number of `Delta`s and one `Finished` per choice, then one `Done` — or a single `Failed` at any point, after which nothing follows.
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
    /// The prompt's side of the usage (`prompt_tokens`, `cached_tokens`, `cache_write_tokens`,
    /// `miss`; `completion_tokens` 0), once the prompt is computed and before the first `Delta`:
    /// the values `Done` reports for them, known before the first token is sent. (A caller that
    /// merges several requests' events tells the sum once all their prompts are computed: an earlier
    /// prompt's `Delta`s may come before it.)
    Prompted {
        usage: Usage,
    },
    Done {
        usage: Usage,
    },
    Failed(RequestError),
    /// The prompt's log-probabilities, when asked ([`GenerateRequest::prompt_logprobs`]), before any
    /// `Delta`. `prompt`: 0 from the engine; a caller that merges several requests' events numbers
    /// their prompts here.
    PromptLogprobs {
        prompt: u32,
        logprobs: Arc<PromptLogprobs>,
    },
}

/// Why a running request ended without finishing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("the server is shutting down; the request was cancelled before it finished")]
    ShuttingDown,
    #[error("the model failed while running this request: {0}")]
    Model(String),
    /// The request's grammar (structured output, constrained tool call) could not go on.
    #[error("the output's grammar could not go on: {message}")]
    Constraint {
        message: String,
        /// The request field the grammar came from ([`ConstraintSpec::param`]).
        param: Option<&'static str>,
    },
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
    /// The same in a pool whose sliding-window layers are paged apart (Gemma 3's), where pages of
    /// layers run out before block ids do.
    #[error(
        "the request needs {needed_pages} KV pages at once (its {needed_blocks} blocks' pages of the \
         full-attention layers and its window's of the sliding ones) but the pool has only \
         {total_pages}; lower max_tokens or n, or raise --kv-cache-memory"
    )]
    CannotFitPages {
        needed_blocks: usize,
        needed_pages: usize,
        total_pages: usize,
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
    #[error("logit_bias names token id {token_id}, outside the vocabulary of {vocab_size} tokens")]
    BiasOutOfVocab { token_id: u32, vocab_size: usize },
    #[error(
        "allowed_token_ids names token id {token_id}, outside the vocabulary of {vocab_size} tokens"
    )]
    AllowedOutOfVocab { token_id: u32, vocab_size: usize },
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
    /// The same in a pool whose sliding-window layers are paged apart (Gemma 3's): its blocks fit the
    /// pool's logical blocks, but their pages (every block's of the full-attention layers, the window's
    /// of the sliding ones) are more than the pool's.
    #[error(
        "the request needs {needed_tokens} tokens of KV cache: {needed_blocks} blocks, \
         {needed_pages} KV pages (every block's of the full-attention layers, its window's of the \
         sliding ones), but the whole pool holds {total_pages} pages; lower max_tokens or n, or raise \
         --kv-cache-memory"
    )]
    CannotFitPages {
        needed_tokens: usize,
        needed_blocks: usize,
        needed_pages: usize,
        total_pages: usize,
    },
    #[error("the queue is full ({waiting} requests waiting, limit {max_queue}); retry later")]
    QueueFull { waiting: usize, max_queue: usize },
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The engine thread died earlier (see `kura_engine::EngineHandle::failure`).
    #[error(
        "the engine failed and can serve no more requests; the server must be restarted ({0})"
    )]
    EngineFailed(String),
}

/// One OpenAI-style chat message, its content flattened to text. The tool fields reach chat templates
/// that have a tools section (HF's names: `tool_calls`, `tool_call_id`, `name`); absent otherwise.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls, as HF templates read them:
    /// `[{"id", "type": "function", "function": {"name", "arguments": {..}}}]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` turn: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A `tool` turn: the function that answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        }
    }
}

/// Tokenizer and chat template of the served model. Shared by every thread.
pub trait TextCodec: Send + Sync + 'static {
    /// Token ids of a raw prompt `text`, with the special tokens the tokenizer adds to a text (BOS where the
    /// model wants one); special-token markers in the text become their ids. Not for chat prompts: see
    /// [`TextCodec::encode_chat`].
    fn encode(&self, text: &str) -> Result<Vec<u32>, String>;
    /// [`TextCodec::encode`] without the tokens it adds (no BOS): the text's own tokens. Special-token
    /// markers in the text still become their ids. A codec that adds none answers as `encode`.
    fn encode_without_added(&self, text: &str) -> Result<Vec<u32>, String> {
        self.encode(text)
    }
    /// Text of `ids`, skipping special tokens. Incomplete UTF-8 at the end shows as U+FFFD.
    fn decode(&self, ids: &[u32]) -> String;
    /// [`TextCodec::decode`] with the special tokens' text kept (vLLM's `skip_special_tokens:
    /// false`). A codec without special tokens answers as `decode`.
    fn decode_keeping_special(&self, ids: &[u32]) -> String {
        self.decode(ids)
    }
    /// The token's own bytes (possibly part of a UTF-8 character; a special token's text), as logprobs
    /// report them. Unlike `decode(&[id])`, distinct tokens never collapse into U+FFFD. Empty for an id
    /// outside the vocabulary.
    fn token_bytes(&self, id: u32) -> Vec<u8>;
    /// The chat template applied to `messages`, ending with the assistant's generation prompt (text, for
    /// display; encode chat prompts with [`TextCodec::encode_chat`]).
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String>;
    /// Prompt tokens of `messages`: the rendered template tokenized with nothing added, because the
    /// template writes every special token itself (as HF's `apply_chat_template(tokenize=True)`).
    /// `encode(render_chat(..))` would add a second BOS for templates that write `bos_token` (Llama 3).
    /// Special tokens come only from the template: special-token text in a message's content is
    /// encoded as the text it is.
    fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String>;
    /// Byte ranges of `text` that hold the contents of `messages`, where `text[from..]` is
    /// `render_chat(messages)` (after a raw prompt `text[..from]`, or alone with `from` 0): the ranges
    /// that [`TextCodec::encode_with_plain_spans`] keeps free of special tokens. Empty when no content
    /// spells a special token; an error when a content that does cannot be placed in the text.
    fn chat_content_spans(
        &self,
        text: &str,
        from: usize,
        messages: &[ChatMessage],
    ) -> Result<Vec<Range<usize>>, String>;
    /// [`TextCodec::encode`], except that special-token text inside the byte ranges `plain` is encoded
    /// as the text it is: how chat text is encoded with [`TextCodec::encode`]'s added tokens (BOS),
    /// `plain` from [`TextCodec::chat_content_spans`]. With `plain` empty, exactly `encode(text)`.
    fn encode_with_plain_spans(
        &self,
        text: &str,
        plain: &[Range<usize>],
    ) -> Result<Vec<u32>, String>;
    /// Tokens that end generation unless the request ignores end-of-sequence.
    fn eos_token_ids(&self) -> &[u32];
    fn vocab_size(&self) -> usize;
    /// Whether `id` is a special (control) token: structured outputs never write one as text. (None,
    /// unless the codec says otherwise.)
    fn is_special(&self, id: u32) -> bool {
        let _ = id;
        false
    }
    /// The chat template's source (tool-call formats are recognised from it); empty for a codec whose
    /// template is not a Jinja text.
    fn chat_template_source(&self) -> &str {
        ""
    }
    /// [`TextCodec::encode_chat`] with the request's tool definitions (OpenAI's `tools` array) handed
    /// to the template as `tools`, for templates that have a tools section (a codec without one says
    /// so).
    fn encode_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &serde_json::Value,
    ) -> Result<Vec<u32>, String> {
        let _ = (messages, tools);
        Err("this model's chat template has no tools section".into())
    }
    /// Prompt tokens of `messages` whose last, an assistant's, the model goes on writing (an assistant
    /// prefill): the template's text without the generation prompt, cut after that message's content
    /// (as [`TextCodec::encode_chat`] tokenizes, `tools` handed to a template that writes them).
    fn encode_chat_continuing(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
    ) -> Result<Vec<u32>, String> {
        let _ = (messages, tools);
        Err("this model's chat template cannot continue an assistant message".into())
    }
    /// [`TextCodec::render_chat`] with the request's tool definitions handed to the template (the text
    /// [`TextCodec::encode_chat_with_tools`] tokenizes).
    fn render_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &serde_json::Value,
    ) -> Result<String, String> {
        let _ = (messages, tools);
        Err("this model's chat template has no tools section".into())
    }
    /// This codec with `kwargs` handed to its chat template beside the messages in every chat it
    /// writes (vLLM's `chat_template_kwargs`, such as Qwen3's `enable_thinking`), and the names left
    /// out because the template never reads them. An error names an argument the template cannot take
    /// (one the server sets itself, one spelling a special token).
    fn with_template_kwargs(
        &self,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<(Arc<dyn TextCodec>, Vec<String>), String> {
        let _ = kwargs;
        Err(format!(
            "{TEMPLATE_ARGUMENTS}: this model's chat template takes no arguments"
        ))
    }
    /// This codec with chats written by the Jinja template `source` instead of its own (vLLM's
    /// per-request `chat_template`), with the model's BOS and EOS texts. An error says why it does
    /// not compile.
    fn with_chat_template(&self, source: &str) -> Result<Arc<dyn TextCodec>, String> {
        let _ = source;
        Err("this model's codec takes no other chat template".into())
    }
    /// [`TextCodec::chat_content_spans`] of a text [`TextCodec::render_chat_with_tools`] wrote.
    fn chat_content_spans_with_tools(
        &self,
        text: &str,
        from: usize,
        messages: &[ChatMessage],
        tools: &serde_json::Value,
    ) -> Result<Vec<Range<usize>>, String> {
        let _ = (text, from, messages, tools);
        Err("this model's chat template has no tools section".into())
    }
}
