//! Raw OpenAI request bodies → checked engine parameters. Every check names the parameter and the
//! value it got; nothing here panics on any input.

use std::sync::Arc;

use kura_request::{ChatMessage, TextCodec};
use kura_request::{GenerateRequest, SamplingParams};

use kura_guide::Guide;
use serde_json::Value;

use crate::body::from_value;
use crate::error::ApiError;
use crate::structured::output_guide;
use crate::tools::{check_tool_turns, openai_tools, parse_arguments, template_call, ToolPlan};
use crate::types::{
    ChatCompletionRequest, CommonParams, CompletionRequest, MessageContent, Prompt, RequestMessage,
    Stop,
};

/// Most choices one request may ask for.
pub const MAX_N: i64 = 64;
/// Most stop strings per request.
pub const MAX_STOP: usize = 16;
/// Longest stop string, in bytes: each is searched for in the text after every token of every choice.
pub const MAX_STOP_BYTES: usize = 4096;
/// Most `stop_token_ids` per request: each choice checks every sampled token against them.
pub const MAX_STOP_TOKEN_IDS: usize = 1024;
/// Most `bad_words` per request: each is tokenized twice, and each choice checks them before every
/// token it draws.
pub const MAX_BAD_WORDS: usize = 256;
/// Longest of `bad_words`, in bytes.
pub const MAX_BAD_WORD_BYTES: usize = 256;
/// Longest `cache_salt`, `prompt_cache_key` and `user`, in bytes: the salt is kept with the cache's
/// blocks (and a day with its pins) after the request ends.
pub const MAX_KEY_BYTES: usize = 1024;
/// A request's `cache_salt` (every route's): not empty, at most [`MAX_KEY_BYTES`], and without the
/// character that separates a tenant from its salt.
pub fn check_salt(salt: &str) -> Result<(), ApiError> {
    if salt.is_empty() {
        return Err(ApiError::invalid(
            "cache_salt must not be empty when given",
            Some("cache_salt"),
        ));
    }
    if salt.len() > MAX_KEY_BYTES {
        return Err(ApiError::invalid(
            format!("cache_salt must be at most {MAX_KEY_BYTES} bytes"),
            Some("cache_salt"),
        ));
    }
    // The engine reads a salt's tenant as what comes before this character (the server puts the
    // API key's tenant there): a salt holding it could pose as another tenant's.
    if salt.contains(kura_request::TENANT_SEPARATOR) {
        return Err(ApiError::invalid(
            "cache_salt must not contain the character U+001F",
            Some("cache_salt"),
        ));
    }
    Ok(())
}

/// Most alternatives reported per token (OpenAI's limit).
pub const MAX_LOGPROBS: i64 = 20;
/// Most prompts in one `/v1/completions` request, and most choices over all of them (prompts × n).
pub const MAX_PROMPTS: usize = 256;
/// Most log-probabilities (each sampled token's and its alternatives') a response that is not streamed
/// may hold: it is held whole until the request ends, a few hundred bytes a log-probability, where a
/// stream sends them as they come. Without a bound one request (64 choices, 20 alternatives, a long
/// context) could hold tens of GB.
pub const MAX_HELD_LOGPROBS: u64 = 1 << 20;
/// Default of the most log-probabilities all non-streamed responses in progress may hold together
/// (`kura serve --max-held-logprobs`): four requests at [`MAX_HELD_LOGPROBS`].
pub const DEFAULT_SERVER_HELD_LOGPROBS: u64 = 4 * MAX_HELD_LOGPROBS;

/// What validation needs to know about the server.
#[derive(Debug, Clone, Copy)]
pub struct Ctx<'a> {
    /// The only accepted `model`.
    pub served_model: &'a str,
    /// Whether `priority` is honoured (`--scheduling-policy priority`); otherwise a non-zero one is refused.
    pub priority_scheduling: bool,
    /// Whether a request may bring its own `chat_template` (`--trust-request-chat-template`).
    pub request_chat_templates: bool,
}

/// The most bytes of a request's own chat template (as of a `--chat-template` file).
pub const MAX_CHAT_TEMPLATE_BYTES: usize = 1 << 20;

/// A request's own chat template (vLLM's `chat_template`), checked: refused unless the server trusts
/// requests' templates, or when larger than [`MAX_CHAT_TEMPLATE_BYTES`].
pub fn request_chat_template(
    template: Option<String>,
    ctx: Ctx<'_>,
) -> Result<Option<String>, ApiError> {
    let Some(template) = template else {
        return Ok(None);
    };
    if !ctx.request_chat_templates {
        return Err(ApiError::invalid(
            "chat_template is not accepted by this server: a request's template runs on the server, \
             which takes one only when started with --trust-request-chat-template",
            Some("chat_template"),
        ));
    }
    if template.len() > MAX_CHAT_TEMPLATE_BYTES {
        return Err(ApiError::invalid(
            format!(
                "chat_template may be at most {MAX_CHAT_TEMPLATE_BYTES} bytes, got {}",
                template.len()
            ),
            Some("chat_template"),
        ));
    }
    if template.trim().is_empty() {
        return Err(ApiError::invalid(
            "chat_template must not be empty (leave it out for the model's own)",
            Some("chat_template"),
        ));
    }
    Ok(Some(template))
}

/// How a prompt is cut to its last tokens (vLLM's `truncate_prompt_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Truncate {
    /// To at most this many tokens.
    Last(u32),
    /// To as many as leave room in the context for `max_tokens` (the route's default where it has a
    /// fixed one; chat refuses it without `max_tokens`).
    Fit,
}

/// Everything about a request except its prompt, checked.
#[derive(Debug, Clone)]
pub struct Checked {
    /// `None`: the caller picks a default once the prompt length is known.
    pub max_tokens: Option<u32>,
    /// The field that gave `max_tokens` (`max_tokens` or `max_completion_tokens`), for errors.
    pub max_tokens_name: &'static str,
    pub n: u32,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// vLLM's `min_tokens` (0: none).
    pub min_tokens: u32,
    /// vLLM's `bad_words`, as sent (the server tokenizes them, [`bad_word_tokens`]).
    pub bad_words: Vec<String>,
    /// vLLM's `include_stop_str_in_output`.
    pub include_stop_str: bool,
    /// vLLM's `skip_special_tokens: false`.
    pub keep_special_tokens: bool,
    /// vLLM's `truncate_prompt_tokens`.
    pub truncate_prompt: Option<Truncate>,
    pub priority: i32,
    pub cache_salt: Option<String>,
    pub prompt_cache_retention: Option<String>,
    pub cached_content: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub return_token_ids: bool,
    /// What the output must be (structured outputs), compiled by the server, and the field that said so.
    pub guide: Option<(Guide, &'static str)>,
}

impl Checked {
    /// `tokens` cut to their last ones as `truncate_prompt_tokens` asks, for a context of `context`
    /// tokens and, without `max_tokens`, the route's `default_max_tokens`; as they are otherwise, or
    /// when already short enough. At least one token is kept (a context too small for the output is
    /// the engine's to refuse, naming `max_tokens`).
    pub fn truncate_prompt(&self, tokens: &mut Vec<u32>, context: usize, default_max_tokens: u32) {
        let keep = match self.truncate_prompt {
            None => return,
            Some(Truncate::Last(k)) => k as usize,
            Some(Truncate::Fit) => {
                let room = self.max_tokens.unwrap_or(default_max_tokens).max(1);
                context.saturating_sub(room as usize).max(1)
            }
        };
        if tokens.len() > keep {
            tokens.drain(..tokens.len() - keep);
        }
    }

    /// Refuses a `min_tokens` above the `max_tokens` the request runs with (the one asked, or the
    /// route's default once the prompt is known), as vLLM refuses it.
    pub fn check_min_tokens(&self, max_tokens: u32) -> Result<(), ApiError> {
        min_tokens_within(
            u64::from(self.min_tokens),
            max_tokens,
            self.max_tokens_name,
            self.max_tokens.is_none(),
        )
    }

    pub fn into_request(
        self,
        prompt_tokens: Vec<u32>,
        max_tokens: u32,
        logprobs: Option<u32>,
    ) -> GenerateRequest {
        GenerateRequest {
            prompt_tokens,
            sampling: SamplingParams {
                logprobs: logprobs.map(|k| k as usize),
                ..self.sampling
            },
            max_tokens,
            n: self.n,
            stop: self.stop,
            stop_token_ids: self.stop_token_ids,
            ignore_eos: self.ignore_eos,
            min_tokens: self.min_tokens,
            include_stop_str: self.include_stop_str,
            keep_special_tokens: self.keep_special_tokens,
            priority: self.priority,
            cache_salt: self.cache_salt,
            pins: Vec::new(),
            constraint: None,
            history_tokens: 0,
            prompt_logprobs: None,
        }
    }
}

/// Refuses a `min_tokens` above `max_tokens` (named `name`; `default`: the route's default, not
/// asked).
fn min_tokens_within(
    min_tokens: u64,
    max_tokens: u32,
    name: &str,
    default: bool,
) -> Result<(), ApiError> {
    if min_tokens <= u64::from(max_tokens) {
        return Ok(());
    }
    let how = match default {
        false => "",
        true => ", its default for this request",
    };
    Err(ApiError::invalid(
        format!("min_tokens must be at most {name} ({max_tokens}{how}), got {min_tokens}"),
        Some("min_tokens"),
    ))
}

/// OpenAI's `logit_bias`: token ids (the object's keys, in decimal) to biases from -100 to 100, as
/// (token, bias) in ascending order of token. Whether each id is in the vocabulary is the engine's
/// check (it knows the model).
fn logit_bias(m: Option<&serde_json::Map<String, Value>>) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(m) = m else {
        return Ok(Vec::new());
    };
    let bad = |message: String| ApiError::invalid(message, Some("logit_bias"));
    // A key is echoed in an error, at most this many characters of it.
    let shown = |k: &str| k.chars().take(24).collect::<String>();
    let mut out = Vec::with_capacity(m.len());
    for (k, v) in m {
        let token = Some(k)
            .filter(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|k| k.parse::<u32>().ok())
            .ok_or_else(|| {
                bad(format!(
                    "logit_bias keys are token ids (decimal integers); {:?} is not one",
                    shown(k)
                ))
            })?;
        let bias = v
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                bad(format!(
                    "logit_bias of token {token} must be a number from -100 to 100, got {}",
                    shown(&v.to_string())
                ))
            })?;
        out.push((token, bias as f32));
    }
    out.sort_by_key(|b| b.0);
    // "7" and "007" name the same token.
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(bad(format!("logit_bias names token {} twice", w[0].0)));
    }
    Ok(out)
}

fn in_range(
    name: &'static str,
    v: Option<f64>,
    lo: f64,
    hi: f64,
    default: f32,
) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && x >= lo && x <= hi => Ok(x as f32),
        Some(x) => Err(ApiError::invalid(
            format!("{name} must be between {lo} and {hi}, got {x}"),
            Some(name),
        )),
    }
}

/// A request's `model` must be the one served.
pub fn check_model(requested: &str, served: &str) -> Result<(), ApiError> {
    if requested == served {
        Ok(())
    } else {
        Err(ApiError::ModelNotFound {
            requested: requested.to_string(),
            served: served.to_string(),
        })
    }
}

/// Checks the parameters both endpoints share.
pub fn check_common(
    c: &CommonParams,
    ctx: Ctx<'_>,
    max_tokens: Option<i64>,
    max_tokens_name: &'static str,
) -> Result<Checked, ApiError> {
    if let Some(model) = &c.model {
        check_model(model, ctx.served_model)?;
    }
    let max_tokens = match max_tokens {
        None => None,
        Some(m) if (1..=u32::MAX as i64).contains(&m) => Some(m as u32),
        Some(m) if m < 1 => {
            return Err(ApiError::invalid(
                format!("{max_tokens_name} must be at least 1, got {m}"),
                Some(max_tokens_name),
            ))
        }
        Some(m) => {
            return Err(ApiError::invalid(
                format!(
                    "{max_tokens_name} must be at most {} (and prompt plus output must fit the \
                     model's context), got {m}",
                    u32::MAX
                ),
                Some(max_tokens_name),
            ))
        }
    };
    let min_tokens = match (c.min_tokens, max_tokens) {
        (None, _) => 0,
        (Some(m), _) if m < 0 => {
            return Err(ApiError::invalid(
                format!("min_tokens must be at least 0, got {m}"),
                Some("min_tokens"),
            ))
        }
        (Some(m), Some(max)) => {
            min_tokens_within(m as u64, max, max_tokens_name, false)?;
            m as u32
        }
        (Some(m), None) => u32::try_from(m).map_err(|_| {
            ApiError::invalid(
                format!("min_tokens must be at most {}, got {m}", u32::MAX),
                Some("min_tokens"),
            )
        })?,
    };
    let bad_words = c.bad_words.clone().unwrap_or_default();
    if bad_words.len() > MAX_BAD_WORDS {
        return Err(ApiError::invalid(
            format!(
                "at most {MAX_BAD_WORDS} bad_words are allowed, got {}",
                bad_words.len()
            ),
            Some("bad_words"),
        ));
    }
    if let Some(long) = bad_words.iter().find(|w| w.len() > MAX_BAD_WORD_BYTES) {
        return Err(ApiError::invalid(
            format!(
                "a bad word may be at most {MAX_BAD_WORD_BYTES} bytes, got one of {}",
                long.len()
            ),
            Some("bad_words"),
        ));
    }
    if bad_words.iter().any(|w| w.trim().is_empty()) {
        return Err(ApiError::invalid(
            "bad_words must not hold an empty or blank string",
            Some("bad_words"),
        ));
    }
    let truncate_prompt = match c.truncate_prompt_tokens {
        None => None,
        Some(-1) => Some(Truncate::Fit),
        Some(k) if k >= 1 => Some(Truncate::Last(u32::try_from(k).unwrap_or(u32::MAX))),
        Some(k) => {
            return Err(ApiError::invalid(
                format!(
                    "truncate_prompt_tokens must be at least 1 (or -1: as many as leave room for \
                     the output), got {k}"
                ),
                Some("truncate_prompt_tokens"),
            ))
        }
    };
    if truncate_prompt.is_some() && c.cached_content.is_some() {
        return Err(ApiError::invalid(
            "truncate_prompt_tokens cannot be combined with cached_content: the prompt starts with \
             the saved context, which a cut would leave out",
            Some("truncate_prompt_tokens"),
        ));
    }
    // (`cache_salt`'s length: `check_salt`, below.)
    for (name, value) in [("prompt_cache_key", &c.prompt_cache_key), ("user", &c.user)] {
        if value.as_ref().is_some_and(|k| k.len() > MAX_KEY_BYTES) {
            return Err(ApiError::invalid(
                format!("{name} must be at most {MAX_KEY_BYTES} bytes"),
                Some(name),
            ));
        }
    }
    let priority = match c.priority {
        None | Some(0) => 0,
        Some(p) if ctx.priority_scheduling => p,
        Some(p) => {
            return Err(ApiError::invalid(
                format!(
                    "priority is honoured only when the server runs with --scheduling-policy \
                     priority; this server schedules first come, first served (got priority {p})"
                ),
                Some("priority"),
            ))
        }
    };
    let n = match c.n {
        None => 1,
        Some(n) if (1..=MAX_N).contains(&n) => n as u32,
        Some(n) => {
            return Err(ApiError::invalid(
                format!("n must be between 1 and {MAX_N}, got {n}"),
                Some("n"),
            ))
        }
    };
    let temperature = in_range("temperature", c.temperature, 0.0, 2.0, 1.0)?;
    let top_p = in_range("top_p", c.top_p, 0.0, 1.0, 1.0)?;
    if top_p == 0.0 {
        return Err(ApiError::invalid(
            "top_p must be greater than 0, got 0",
            Some("top_p"),
        ));
    }
    // 0 keeps every token, as in the sampler.
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if (1..=u32::MAX as i64).contains(&k) => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(
                format!(
                    "top_k must be -1 or 0 (disabled), or from 1 to {}, got {k}",
                    u32::MAX
                ),
                Some("top_k"),
            ))
        }
    };
    let min_p = in_range("min_p", c.min_p, 0.0, 1.0, 0.0)?;
    let presence_penalty = in_range("presence_penalty", c.presence_penalty, -2.0, 2.0, 0.0)?;
    let frequency_penalty = in_range("frequency_penalty", c.frequency_penalty, -2.0, 2.0, 0.0)?;
    let repetition_penalty = in_range("repetition_penalty", c.repetition_penalty, 0.01, 10.0, 1.0)?;
    let stop = match &c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > MAX_STOP {
        return Err(ApiError::invalid(
            format!(
                "at most {MAX_STOP} stop strings are allowed, got {}",
                stop.len()
            ),
            Some("stop"),
        ));
    }
    if stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::invalid(
            "stop strings must not be empty",
            Some("stop"),
        ));
    }
    if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid(
            format!(
                "a stop string may be at most {MAX_STOP_BYTES} bytes, got one of {}",
                long.len()
            ),
            Some("stop"),
        ));
    }
    let stop_token_ids = c.stop_token_ids.clone().unwrap_or_default();
    if stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::invalid(
            format!(
                "at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {}",
                stop_token_ids.len()
            ),
            Some("stop_token_ids"),
        ));
    }
    let logit_bias = logit_bias(c.logit_bias.as_ref())?;
    // vLLM's `allowed_token_ids`: ascending, each once (the engine checks them against the vocabulary).
    let allowed_token_ids = match &c.allowed_token_ids {
        None => Vec::new(),
        Some(ids) if ids.is_empty() => {
            return Err(ApiError::invalid(
                "allowed_token_ids must name at least one token (leave it out to allow any)",
                Some("allowed_token_ids"),
            ))
        }
        Some(ids) => {
            let mut ids = ids.clone();
            ids.sort_unstable();
            ids.dedup();
            ids
        }
    };
    if let Some(salt) = &c.cache_salt {
        check_salt(salt)?;
    }
    let guide = output_guide(c)?;
    let include_usage = match &c.stream_options {
        Some(_) if !c.stream => {
            return Err(ApiError::invalid(
                "stream_options is only allowed when stream is true",
                Some("stream_options"),
            ));
        }
        Some(o) => o.include_usage,
        None => false,
    };
    Ok(Checked {
        max_tokens,
        max_tokens_name,
        n,
        sampling: SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            // Negative seeds are valid in OpenAI's API; any 64-bit pattern is a fine seed.
            seed: c.seed.map(|s| s as u64),
            // Set per request from the route's own logprob fields (`into_request`).
            logprobs: None,
            logit_bias,
            allowed_token_ids,
            // Tokenized by the server from `bad_words` ([`bad_word_tokens`]).
            bad_words: Vec::new(),
        },
        stop,
        stop_token_ids,
        ignore_eos: c.ignore_eos,
        min_tokens,
        bad_words,
        include_stop_str: c.include_stop_str_in_output,
        keep_special_tokens: c.skip_special_tokens == Some(false),
        truncate_prompt,
        priority,
        cache_salt: c.cache_salt.clone(),
        prompt_cache_retention: c.prompt_cache_retention.clone(),
        cached_content: c.cached_content.clone(),
        stream: c.stream,
        include_usage,
        return_token_ids: c.return_token_ids,
        guide,
    })
}

/// The log-probabilities a response over `choices` choices holds until its request ends:
/// `choices × max_tokens × (1 + alternatives)` when it is not streamed (`logprobs`: the alternatives a
/// token, `None` without log-probabilities), 0 otherwise.
pub fn held_logprobs(
    checked: &Checked,
    choices: usize,
    logprobs: Option<u32>,
    max_tokens: u32,
) -> u64 {
    match logprobs {
        Some(top) if !checked.stream => {
            logprobs_of(choices.max(1) as u64, top, u64::from(max_tokens))
        }
        _ => 0,
    }
}

/// The log-probabilities `copies` copies of `tokens` tokens' scores hold with `top` alternatives a
/// token: copies × tokens × (1 + top), saturating.
pub fn logprobs_of(copies: u64, top: u32, tokens: u64) -> u64 {
    copies
        .saturating_mul(1 + u64::from(top))
        .saturating_mul(tokens)
}

/// The `max_tokens` of a request over `choices` choices whose response, not streamed, holds
/// [`held_logprobs`] log-probabilities (`top_name`: the field that gave the alternatives). Past
/// `limit` (at most [`MAX_HELD_LOGPROBS`]; less where the server's own bound is lower) a `max_tokens`
/// the client gave is refused, naming what to lower; a default one (the context's room) is lowered to
/// fit, and the choices end with `length` there.
pub fn held_logprobs_max_tokens(
    checked: &Checked,
    choices: usize,
    logprobs: Option<u32>,
    top_name: &'static str,
    max_tokens: u32,
    limit: u64,
) -> Result<u32, ApiError> {
    // What one token of each choice holds: 0 streamed or without log-probabilities.
    let per_token = held_logprobs(checked, choices, logprobs, 1);
    let (Some(top), true) = (logprobs, per_token > 0) else {
        return Ok(max_tokens);
    };
    // 0 where a response's scored prompts took the whole bound: not even one token fits then.
    let limit = limit.min(MAX_HELD_LOGPROBS);
    if per_token > limit {
        // Not even one token fits: no max_tokens would do.
        return Err(ApiError::invalid(
            format!(
                "a response with log-probabilities that is not streamed holds at most {limit} of \
                 them on this server, and {choices} choice(s) × (1 + {top_name} {top}) = \
                 {per_token} a token is more; lower n or {top_name}, or stream the response"
            ),
            Some(top_name),
        ));
    }
    let most = limit / per_token;
    if u64::from(max_tokens) <= most {
        return Ok(max_tokens);
    }
    if checked.max_tokens.is_none() {
        return Ok(u32::try_from(most).unwrap_or(u32::MAX));
    }
    let name = checked.max_tokens_name;
    let held = per_token.saturating_mul(u64::from(max_tokens));
    Err(ApiError::invalid(
        format!(
            "a response with log-probabilities that is not streamed holds at most \
             {limit} of them: {choices} choice(s) × {name} {max_tokens} × (1 + \
             {top_name} {top}) = {held}; lower {name} (at most {most} here), n or {top_name}, or \
             stream the response"
        ),
        Some(name),
    ))
}

/// `logprobs` of `/v1/completions` (0..=20 alternatives) or `top_logprobs` of chat.
pub fn check_logprobs(name: &'static str, v: Option<i64>) -> Result<Option<u32>, ApiError> {
    match v {
        None => Ok(None),
        Some(k) if (0..=MAX_LOGPROBS).contains(&k) => Ok(Some(k as u32)),
        Some(k) => Err(ApiError::invalid(
            format!("{name} must be between 0 and {MAX_LOGPROBS}, got {k}"),
            Some(name),
        )),
    }
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// The text of a message's content: a string, or text parts joined.
fn content_text(i: usize, content: &Option<MessageContent>) -> Result<String, ApiError> {
    Ok(match content {
        None => String::new(),
        Some(MessageContent::Text(t)) => t.clone(),
        Some(MessageContent::Parts(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => text.push_str(t),
                    ("text", None) => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content[{j}] of type text has no text"),
                            Some("messages"),
                        ))
                    }
                    (other, _) => {
                        return Err(ApiError::invalid(
                            format!(
                                "messages[{i}].content[{j}] has type {other:?}; this model \
                                 accepts only text parts"
                            ),
                            Some("messages"),
                        ))
                    }
                }
            }
            text
        }
    })
}

/// Chat messages → the template's messages: text content (only text parts are accepted), an
/// assistant turn's tool calls (their arguments parsed, and kept as sent in `raw_arguments`), a `tool`
/// turn's call id and name. Tool turns must answer earlier calls.
pub fn flatten_messages(messages: &[RequestMessage]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages must contain at least one message",
            Some("messages"),
        ));
    }
    let out = messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::invalid(
                    format!(
                        "messages[{i}].role must be one of {}, got {:?}",
                        ROLES.join(", "),
                        m.role
                    ),
                    Some("messages"),
                ));
            }
            if m.content.is_none() && m.role != "assistant" {
                return Err(ApiError::invalid(
                    format!(
                        "messages[{i}].content is required for a {} message (only an assistant's \
                         may be absent, beside its tool_calls)",
                        m.role
                    ),
                    Some("messages"),
                ));
            }
            let content = content_text(i, &m.content)?;
            // `developer` is OpenAI's newer name for `system`; chat templates know only the latter.
            let role = if m.role == "developer" {
                "system".to_string()
            } else {
                m.role.clone()
            };
            let tool_calls = match &m.tool_calls {
                None => None,
                Some(_) if m.role != "assistant" => {
                    return Err(ApiError::invalid(
                        format!(
                            "messages[{i}] has tool_calls but only assistant messages make calls"
                        ),
                        Some("messages"),
                    ))
                }
                Some(calls) if calls.is_empty() => None,
                Some(calls) => {
                    let mut out = Vec::with_capacity(calls.len());
                    for (j, c) in calls.iter().enumerate() {
                        if c.kind.as_deref().is_some_and(|k| k != "function") {
                            return Err(ApiError::invalid(
                                format!("messages[{i}].tool_calls[{j}].type must be \"function\""),
                                Some("messages"),
                            ));
                        }
                        if c.id.is_empty() {
                            return Err(ApiError::invalid(
                                format!("messages[{i}].tool_calls[{j}].id must not be empty"),
                                Some("messages"),
                            ));
                        }
                        let args = parse_arguments(
                            &c.function.arguments,
                            &format!("messages[{i}].tool_calls[{j}].function.arguments"),
                        )?;
                        out.push(template_call(
                            &c.id,
                            &c.function.name,
                            &c.function.arguments,
                            Some(args),
                        ));
                    }
                    Some(Value::Array(out))
                }
            };
            let tool_call_id = match (&m.tool_call_id, m.role.as_str()) {
                (Some(id), "tool") => Some(id.clone()),
                (None, "tool") => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}] has role tool but no tool_call_id"),
                        Some("messages"),
                    ))
                }
                _ => None,
            };
            Ok(ChatMessage {
                role,
                content,
                tool_calls,
                tool_call_id,
                name: m.name.clone().filter(|_| m.role == "tool"),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    check_tool_turns(&out)?;
    Ok(out)
}

/// One prompt of a completions request, before tokenization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

/// A `/v1/completions` body, checked; only tokenization and the engine's own checks remain.
#[derive(Debug, Clone)]
pub struct CompletionPlan {
    pub checked: Checked,
    /// One or more prompts; each gets `n` choices, numbered prompt-major as OpenAI numbers them.
    pub prompts: Vec<PromptInput>,
    pub logprobs: Option<u32>,
    /// Each choice's text starts with its prompt (and, with `logprobs`, its log-probabilities with the
    /// prompt's: the first token's is `null`).
    pub echo: bool,
    /// vLLM's `prompt_logprobs`: the prompt's tokens scored, with this many alternatives each.
    pub prompt_logprobs: Option<u32>,
    pub user: Option<String>,
}

/// A `/v1/chat/completions` body, checked.
#[derive(Debug, Clone)]
pub struct ChatPlan {
    pub checked: Checked,
    pub messages: Vec<ChatMessage>,
    /// The request's tools, if it has any.
    pub tools: Option<ToolPlan>,
    pub logprobs: Option<u32>,
    /// vLLM's `prompt_logprobs`: the prompt's tokens scored, with this many alternatives each.
    pub prompt_logprobs: Option<u32>,
    pub user: Option<String>,
    /// vLLM's `continue_final_message`: the last message, an assistant's, is continued (the prompt
    /// ends inside its turn, after its text) rather than answered.
    pub continue_final: bool,
    /// vLLM's `chat_template_kwargs`: variables for the chat template (none when absent or empty).
    pub template_kwargs: Option<serde_json::Map<String, Value>>,
    /// vLLM's `chat_template`: the request's own template ([`request_chat_template`]).
    pub chat_template: Option<String>,
    /// vLLM's `documents` came as a field of their own (among `template_kwargs` now).
    pub documents: bool,
}

impl ChatPlan {
    /// The conversation's closed turns: the messages less one being continued.
    pub fn closed_messages(&self) -> &[ChatMessage] {
        let n = self.messages.len() - usize::from(self.continue_final);
        &self.messages[..n]
    }
}

/// Checks a completions body (already known to be one JSON object).
pub fn prepare_completion(
    value: &serde_json::Value,
    ctx: Ctx<'_>,
) -> Result<CompletionPlan, ApiError> {
    if let Some(o) = value.as_object() {
        crate::body::known_fields(
            o,
            &[
                crate::body::fields_of::<CommonParams>(),
                crate::body::fields_of::<CompletionRequest>(),
            ],
            "completions",
        )?;
    }
    let common: CommonParams = from_value(value)?;
    let req: CompletionRequest = from_value(value)?;
    // With `echo`, `max_tokens` 0 asks for the prompt alone (scored, with `logprobs`).
    let prompt_only = req.echo && common.max_tokens == Some(0);
    let max_tokens = if prompt_only { None } else { common.max_tokens };
    let mut checked = check_common(&common, ctx, max_tokens, "max_tokens")?;
    if prompt_only {
        checked.max_tokens = Some(0);
    }
    if req.echo && common.cached_content.is_some() {
        return Err(ApiError::invalid(
            "echo cannot be combined with cached_content: the prompt would start with a saved \
             context the request does not hold",
            Some("echo"),
        ));
    }
    if req.suffix.as_deref().is_some_and(|x| !x.is_empty()) {
        return Err(ApiError::invalid(
            "suffix is not supported by this server",
            Some("suffix"),
        ));
    }
    if let Some(b) = req.best_of {
        if b != i64::from(checked.n) {
            return Err(ApiError::invalid(
                format!(
                    "best_of must equal n ({}) on this server, got {b}",
                    checked.n
                ),
                Some("best_of"),
            ));
        }
    }
    let logprobs = check_logprobs("logprobs", req.logprobs)?;
    if req.echo && checked.truncate_prompt.is_some() {
        return Err(ApiError::invalid(
            "echo cannot be combined with truncate_prompt_tokens: the echoed prompt would not be \
             the prompt computed",
            Some("truncate_prompt_tokens"),
        ));
    }
    let prompts: Vec<PromptInput> = match req.prompt {
        Prompt::Text(t) => vec![PromptInput::Text(t)],
        Prompt::Tokens(t) if t.is_empty() => {
            return Err(ApiError::invalid(
                "prompt must not be empty",
                Some("prompt"),
            ))
        }
        Prompt::Tokens(t) => vec![PromptInput::Tokens(t)],
        Prompt::TextBatch(v) => v.into_iter().map(PromptInput::Text).collect(),
        Prompt::TokensBatch(v) => v.into_iter().map(PromptInput::Tokens).collect(),
    };
    let choices = prompts.len().saturating_mul(checked.n as usize);
    if choices > MAX_PROMPTS {
        return Err(ApiError::invalid(
            format!(
                "at most {MAX_PROMPTS} choices per request (prompts × n); got {} prompts × n {} = {choices}",
                prompts.len(),
                checked.n
            ),
            Some("prompt"),
        ));
    }
    let prompt_logprobs = check_prompt_logprobs(req.prompt_logprobs, &checked)?;
    Ok(CompletionPlan {
        checked,
        prompts,
        logprobs,
        echo: req.echo,
        prompt_logprobs,
        user: common.user,
    })
}

/// Fields of OpenAI's chat request that this server does not run, refused by name when set to
/// anything but their neutral value (docs/api-fields.md lists every field and what Kura does with it).
const CHAT_REFUSED: [(&str, &str); 8] = [
    ("audio", "this model writes text only"),
    (
        "modalities",
        "this model writes text only; give [\"text\"] or nothing",
    ),
    (
        "functions",
        "the legacy functions API is not served; use tools",
    ),
    (
        "function_call",
        "the legacy functions API is not served; use tool_choice",
    ),
    ("prediction", "predicted outputs are not served"),
    ("reasoning_effort", "this model has no reasoning mode"),
    ("web_search_options", "this server has no web search"),
    (
        "store",
        "chat completions are not stored here; use /v1/responses, which stores them",
    ),
];

/// Fields of OpenAI's chat request that are read and have no effect here (docs/api-fields.md says
/// why); `user` is read with the common fields.
const CHAT_IGNORED: [&str; 4] = ["metadata", "safety_identifier", "service_tier", "verbosity"];

/// Every field a chat completions body may hold: the common and the chat fields read, the ignored
/// and the refused ones.
fn check_chat_fields(value: &Value) -> Result<(), ApiError> {
    let Some(o) = value.as_object() else {
        return Ok(()); // the typed read names it
    };
    let refused: Vec<&str> = CHAT_REFUSED.iter().map(|(name, _)| *name).collect();
    crate::body::known_fields(
        o,
        &[
            crate::body::fields_of::<CommonParams>(),
            crate::body::fields_of::<ChatCompletionRequest>(),
            &CHAT_IGNORED,
            &refused,
        ],
        "chat completions",
    )
}

/// Refuses the fields of `refused` that `value` sets (to anything but null, false, an empty list, or
/// `["text"]` for `modalities`).
pub fn refuse_fields(value: &Value, refused: &[(&'static str, &str)]) -> Result<(), ApiError> {
    for &(name, why) in refused {
        let neutral = match value.get(name) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => true,
            Some(Value::Array(a)) => {
                a.is_empty() || (name == "modalities" && a.len() == 1 && a[0] == "text")
            }
            Some(_) => false,
        };
        if !neutral {
            return Err(ApiError::invalid(
                format!("{name} is not supported by this server: {why}"),
                Some(name),
            ));
        }
    }
    Ok(())
}

/// Checks a chat completions body (already known to be one JSON object).
pub fn prepare_chat(value: &serde_json::Value, ctx: Ctx<'_>) -> Result<ChatPlan, ApiError> {
    check_chat_fields(value)?;
    refuse_fields(value, &CHAT_REFUSED)?;
    crate::responses::check_service_tier(
        value.get("service_tier"),
        &crate::responses::SERVICE_TIERS,
    )?;
    let common: CommonParams = from_value(value)?;
    let req: ChatCompletionRequest = from_value(value)?;
    let checked = match req.max_completion_tokens {
        Some(m) => check_common(&common, ctx, Some(m), "max_completion_tokens")?,
        None => check_common(&common, ctx, common.max_tokens, "max_tokens")?,
    };
    let top = check_logprobs("top_logprobs", req.top_logprobs)?;
    let logprobs = match (req.logprobs, top) {
        (true, top) => Some(top.unwrap_or(0)),
        (false, None) => None,
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs requires logprobs to be true",
                Some("top_logprobs"),
            ))
        }
    };
    let messages = flatten_messages(&req.messages)?;
    let tools = openai_tools(
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
    )?;
    let prompt_logprobs = check_prompt_logprobs(req.prompt_logprobs, &checked)?;
    let continue_final = check_continue_final(&req, &messages, &checked, tools.as_ref())?;
    if checked.truncate_prompt == Some(Truncate::Fit) && checked.max_tokens.is_none() {
        return Err(ApiError::invalid(
            "truncate_prompt_tokens -1 needs max_completion_tokens (or max_tokens) on chat: the \
             prompt is cut to leave room for it",
            Some("truncate_prompt_tokens"),
        ));
    }
    if checked.keep_special_tokens && tools.is_some() {
        return Err(ApiError::invalid(
            "skip_special_tokens false cannot be combined with tools: calls are read from the text \
             the model writes with its special tokens skipped",
            Some("skip_special_tokens"),
        ));
    }
    Ok(ChatPlan {
        checked,
        messages,
        tools,
        logprobs,
        prompt_logprobs,
        user: common.user,
        continue_final,
        documents: req.documents.is_some(),
        template_kwargs: template_arguments(req.chat_template_kwargs, req.documents)?,
        chat_template: request_chat_template(req.chat_template, ctx)?,
    })
}

/// A chat request's template arguments: `chat_template_kwargs`, and vLLM's `documents` among them
/// (each document an object of strings); none when there are none.
pub fn template_arguments(
    kwargs: Option<serde_json::Map<String, Value>>,
    documents: Option<Vec<serde_json::Map<String, Value>>>,
) -> Result<Option<serde_json::Map<String, Value>>, ApiError> {
    let mut kwargs = kwargs.unwrap_or_default();
    if let Some(documents) = documents {
        if kwargs.contains_key("documents") {
            return Err(ApiError::invalid(
                "documents is given twice: as a field and in chat_template_kwargs; give one",
                Some("documents"),
            ));
        }
        if let Some((i, key)) = documents.iter().enumerate().find_map(|(i, d)| {
            d.iter()
                .find(|(_, v)| !v.is_string())
                .map(|(k, _)| (i, k.clone()))
        }) {
            return Err(ApiError::invalid(
                format!(
                    "documents[{i}].{key} must be a string (a document is an object of strings)"
                ),
                Some("documents"),
            ));
        }
        let list = documents.into_iter().map(Value::Object).collect();
        kwargs.insert("documents".into(), Value::Array(list));
    }
    Ok((!kwargs.is_empty()).then_some(kwargs))
}

/// vLLM's `continue_final_message` and `add_generation_prompt` as a chat request or `/tokenize`
/// gives them: whether the last message is continued. `add_generation_prompt: false` goes only with
/// it (a chat prompt otherwise ends with the assistant's turn opened), `true` never.
pub fn continues_final_message(
    continue_final_message: Option<bool>,
    add_generation_prompt: Option<bool>,
) -> Result<bool, ApiError> {
    let continued = continue_final_message == Some(true);
    match (continued, add_generation_prompt) {
        (true, Some(true)) => Err(ApiError::invalid(
            "continue_final_message cannot be combined with add_generation_prompt true: the \
             prompt ends inside the last message's turn",
            Some("add_generation_prompt"),
        )),
        (false, Some(false)) => Err(ApiError::invalid(
            "add_generation_prompt false is supported only with continue_final_message true: a \
             chat prompt ends with the assistant's turn opened",
            Some("add_generation_prompt"),
        )),
        _ => Ok(continued),
    }
}

/// vLLM's `continue_final_message` and `add_generation_prompt` of a chat request: whether the last
/// message is continued ([`continues_final_message`]). The message continued is an assistant's, with
/// text and no calls; nothing that starts the output's grammar or the prompt elsewhere goes with it.
fn check_continue_final(
    req: &ChatCompletionRequest,
    messages: &[ChatMessage],
    checked: &Checked,
    tools: Option<&ToolPlan>,
) -> Result<bool, ApiError> {
    const P: &str = "continue_final_message";
    if !continues_final_message(req.continue_final_message, req.add_generation_prompt)? {
        return Ok(false);
    }
    let last = messages.last();
    if !last
        .is_some_and(|m| m.role == "assistant" && m.tool_calls.is_none() && !m.content.is_empty())
    {
        return Err(ApiError::invalid(
            "continue_final_message needs a last message from the assistant, with text and no tool \
             calls",
            Some(P),
        ));
    }
    let why = if checked.guide.is_some() || tools.is_some_and(ToolPlan::grammar_starts_turn) {
        Some(
            "an output format, a forced tool call or a strict tool (the output's grammar starts \
             the turn)",
        )
    } else if checked.cached_content.is_some() {
        Some("cached_content")
    } else {
        None
    };
    match why {
        Some(what) => Err(ApiError::invalid(
            format!("continue_final_message cannot be combined with {what}"),
            Some(P),
        )),
        None => Ok(true),
    }
}

/// vLLM's `prompt_logprobs` (0..=20 alternatives), which a streamed response does not carry.
fn check_prompt_logprobs(v: Option<i64>, checked: &Checked) -> Result<Option<u32>, ApiError> {
    let k = check_logprobs("prompt_logprobs", v)?;
    if k.is_some() && checked.stream {
        return Err(ApiError::invalid(
            "prompt_logprobs are not streamed: ask without stream (or, on /v1/completions, stream \
             echo with logprobs, whose first chunk scores the prompt)",
            Some("prompt_logprobs"),
        ));
    }
    Ok(k)
}

/// A prompt the tokenizer refused, as the client's error.
/// The token sequences `words` (vLLM's `bad_words`) are written as: each word, its leading white
/// space left out, tokenized as a text's start and after a space (the second where it differs), with
/// nothing added (no BOS).
pub fn bad_word_tokens(codec: &dyn TextCodec, words: &[String]) -> Result<Vec<Vec<u32>>, ApiError> {
    let mut out: Vec<Vec<u32>> = Vec::new();
    for word in words {
        let word = word.trim_start();
        for text in [word.to_string(), format!(" {word}")] {
            let tokens = codec.encode_without_added(&text).map_err(|e| {
                ApiError::invalid(
                    format!("could not tokenize bad word {word:?}: {e}"),
                    Some("bad_words"),
                )
            })?;
            if !tokens.is_empty() && !out.contains(&tokens) {
                out.push(tokens);
            }
        }
    }
    Ok(out)
}

pub fn tokenize_error(e: String) -> ApiError {
    over_context(e, "prompt").unwrap_or_else(|e| {
        ApiError::invalid(
            format!("could not tokenize the prompt: {e}"),
            Some("prompt"),
        )
    })
}

/// The codec that writes a chat request's prompt: `codec` itself, or `codec` with the request's own
/// `chat_template` and its `chat_template_kwargs` ([`template_codec`]); and whether its template is
/// the request's own or reads any of the arguments.
pub fn chat_codec(
    codec: &Arc<dyn TextCodec>,
    template: Option<&str>,
    kwargs: Option<&serde_json::Map<String, Value>>,
) -> Result<(Arc<dyn TextCodec>, bool), ApiError> {
    Ok(match request_codec(codec.as_ref(), template, kwargs)? {
        Some((own, read)) => (own, read),
        None => (codec.clone(), false),
    })
}

/// A request's own codec, and whether its template is its own or reads its arguments.
pub type OwnCodec = (Arc<dyn TextCodec>, bool);

/// [`chat_codec`]'s own codec, when the request has a template or arguments of its own.
pub fn request_codec(
    codec: &dyn TextCodec,
    template: Option<&str>,
    kwargs: Option<&serde_json::Map<String, Value>>,
) -> Result<Option<OwnCodec>, ApiError> {
    let own = match template {
        Some(source) => Some(codec.with_chat_template(source).map_err(|e| {
            ApiError::invalid(
                format!("chat_template could not be compiled: {e}"),
                Some("chat_template"),
            )
        })?),
        None => None,
    };
    Ok(match (kwargs, own) {
        (Some(kwargs), own) => {
            let (c, read) = template_codec(own.as_deref().unwrap_or(codec), kwargs)?;
            Some((c, read || own.is_some()))
        }
        (None, Some(own)) => Some((own, true)),
        (None, None) => None,
    })
}

/// `codec` with `chat_template_kwargs` handed to its template, and whether the template reads any of
/// them; the names it does not read are left out (as vLLM leaves them out) and logged.
pub fn template_codec(
    codec: &dyn TextCodec,
    kwargs: &serde_json::Map<String, Value>,
) -> Result<(Arc<dyn TextCodec>, bool), ApiError> {
    let (codec, left_out) = codec.with_template_kwargs(kwargs).map_err(template_error)?;
    if !left_out.is_empty() {
        tracing::debug!(
            ?left_out,
            "chat_template_kwargs the chat template does not read"
        );
    }
    Ok((codec, left_out.len() < kwargs.len()))
}

/// An error about a chat request's template or its arguments, in the names the request used: the
/// request's own `chat_template` where that template failed to render (`own_template`), and vLLM's
/// `documents` where they came as a field of their own (`documents`).
pub fn request_template_error(e: ApiError, own_template: bool, documents: bool) -> ApiError {
    let text = e.to_string();
    let e = match own_template && text.starts_with("could not apply the chat template") {
        true => e.rename_param("messages", "chat_template"),
        false => e,
    };
    match documents && text.contains("chat_template_kwargs.documents") {
        true => e
            .rename_field("chat_template_kwargs.documents", "documents")
            .rename_param(kura_request::TEMPLATE_ARGUMENTS, "documents"),
        false => e,
    }
}

/// Messages the chat template refused, as the client's error.
pub fn template_error(e: String) -> ApiError {
    // The request's template arguments refused, or the template failing only with them: named.
    let own = e.strip_prefix("chat template: ").unwrap_or(&e);
    if own.starts_with(kura_request::TEMPLATE_ARGUMENTS) {
        return ApiError::invalid(own.to_string(), Some(kura_request::TEMPLATE_ARGUMENTS));
    }
    over_context(e, "messages").unwrap_or_else(|e| {
        ApiError::invalid(
            format!("could not apply the chat template: {e}"),
            Some("messages"),
        )
    })
}

/// A codec's refusal of a text longer than the context could hold
/// ([`kura_request::TEXT_OVER_CONTEXT`]), as `context_length_exceeded` naming `param`; any other
/// error back as it was.
fn over_context(e: String, param: &'static str) -> Result<ApiError, String> {
    if e.starts_with(kura_request::TEXT_OVER_CONTEXT) {
        Ok(ApiError::InvalidRequest {
            message: e,
            param: Some(param),
            code: Some("context_length_exceeded"),
        })
    } else {
        Err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn common(json: &str) -> CommonParams {
        serde_json::from_str(json).unwrap()
    }

    const CTX: Ctx<'static> = Ctx {
        served_model: "m",
        priority_scheduling: false,
        request_chat_templates: false,
    };

    fn param_of(e: ApiError) -> &'static str {
        match e {
            ApiError::InvalidRequest { param: Some(p), .. } => p,
            other => panic!("not a parameter error: {other:?}"),
        }
    }

    /// The fields docs/api-fields.md lists in its table for `endpoint` (a row may name several).
    fn documented(endpoint: &str) -> Vec<String> {
        let doc = include_str!("../../../docs/api-fields.md");
        let section = doc
            .split("\n## POST ")
            .find(|s| s.starts_with(&format!("{endpoint}\n")))
            .unwrap_or_else(|| panic!("no section for {endpoint}"));
        section
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .flat_map(|l| {
                let cell = format!("`{}", l.split(" |").next().unwrap_or(""));
                cell.split('`')
                    .skip(1)
                    .step_by(2)
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Kura's extensions on the OpenAI routes, as docs/api-fields.md names them.
    const EXTENSIONS: [&str; 20] = [
        "top_k",
        "min_p",
        "min_tokens",
        "include_stop_str_in_output",
        "allowed_token_ids",
        "truncate_prompt_tokens",
        "skip_special_tokens",
        "repetition_penalty",
        "stop_token_ids",
        "ignore_eos",
        "priority",
        "cache_salt",
        "cached_content",
        "return_token_ids",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "prompt_logprobs",
    ];

    #[test]
    fn every_documented_field_is_read_and_any_other_is_refused_by_name() {
        let doc = include_str!("../../../docs/api-fields.md");
        for name in EXTENSIONS {
            assert!(
                doc.contains(&format!("`{name}`")),
                "{name} is not documented"
            );
        }
        let chat = documented("/v1/chat/completions");
        assert!(chat.len() > 30, "{chat:?}");
        for name in chat.iter().map(String::as_str).chain(EXTENSIONS) {
            let body = serde_json::json!({ name: null });
            assert!(check_chat_fields(&body).is_ok(), "chat refuses {name}");
        }
        let completions = documented("/v1/completions");
        assert!(completions.len() > 15, "{completions:?}");
        for name in completions
            .iter()
            .map(String::as_str)
            .chain(EXTENSIONS)
            .chain(["response_format"])
        {
            let body = serde_json::json!({"model": "m", "prompt": "x", name: null});
            let e = prepare_completion(&body, CTX).err().map(|e| e.to_string());
            assert!(
                e.as_ref().is_none_or(|e| !e.contains("is not a field")),
                "completions refuses {name}: {e:?}"
            );
        }
        let responses = documented("/v1/responses");
        assert!(responses.len() > 40, "{responses:?}");
        for name in &responses {
            let body = serde_json::json!({"model": "m", "input": "x", name.as_str(): null});
            let e = crate::responses::prepare(&body, CTX)
                .err()
                .map(|e| e.to_string());
            assert!(
                e.as_ref().is_none_or(|e| !e.contains("is not a field")),
                "responses refuses {name}: {e:?}"
            );
        }
        let body = serde_json::json!({"model": "m", "input": "x", "chat_template_kwargs": {}});
        let e = crate::responses::prepare(&body, CTX)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.starts_with("chat_template_kwargs is not a field of responses"),
            "{e}"
        );
        // Chat's template arguments are chat's alone.
        let body = serde_json::json!({"model": "m", "prompt": "x", "chat_template_kwargs": {}});
        let e = prepare_completion(&body, CTX).unwrap_err().to_string();
        assert!(
            e.starts_with("chat_template_kwargs is not a field of completions"),
            "{e}"
        );
        // Another server's extension or a misspelt name: refused, named.
        for name in ["guided_decoding_backend", "max_token", "logits_processors"] {
            let body = serde_json::json!({"model": "m", "messages": [], name: 1});
            let e = check_chat_fields(&body).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("{name} is not a field of chat completions")),
                "{e}"
            );
            let body = serde_json::json!({"model": "m", "prompt": "x", name: 1});
            let e = prepare_completion(&body, CTX).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("{name} is not a field of completions")),
                "{e}"
            );
        }
    }

    #[test]
    fn min_tokens_is_bounded_by_the_max_tokens_the_request_runs_with() {
        let c = check_common(
            &common(r#"{"min_tokens": 20}"#),
            CTX,
            Some(10),
            "max_tokens",
        );
        let e = c.unwrap_err().to_string();
        assert!(
            e.contains("min_tokens must be at most max_tokens (10), got 20"),
            "{e}"
        );
        let e = check_common(&common(r#"{"min_tokens": -2}"#), CTX, None, "max_tokens");
        assert!(e.unwrap_err().to_string().contains("at least 0"));
        // Without max_tokens, the default the route picks once the prompt is known.
        let c = check_common(&common(r#"{"min_tokens": 20}"#), CTX, None, "max_tokens").unwrap();
        assert_eq!(c.min_tokens, 20);
        let e = c.check_min_tokens(16).unwrap_err().to_string();
        assert!(
            e.contains("at most max_tokens (16, its default for this request)"),
            "{e}"
        );
        assert!(c.check_min_tokens(20).is_ok());
        let r = c.into_request(vec![1], 20, None);
        assert_eq!(r.min_tokens, 20);
        // allowed_token_ids: sorted, each once; an empty list is refused.
        let c = check_common(
            &common(r#"{"allowed_token_ids": [9, 2, 9], "include_stop_str_in_output": true}"#),
            CTX,
            None,
            "max_tokens",
        )
        .unwrap();
        assert_eq!(c.sampling.allowed_token_ids, [2, 9]);
        assert!(c.include_stop_str);
        let e = check_common(
            &common(r#"{"allowed_token_ids": []}"#),
            CTX,
            None,
            "max_tokens",
        );
        assert!(e.unwrap_err().to_string().contains("at least one token"));
    }

    #[test]
    fn bad_words_are_bounded_and_never_blank() {
        let checked = |body: String| {
            check_common(&common(&body), CTX, None, "max_tokens").map_err(|e| e.to_string())
        };
        let c = checked(r#"{"bad_words": [" Paris", "the French"]}"#.into()).unwrap();
        assert_eq!(c.bad_words, [" Paris", "the French"]);
        let many = serde_json::to_string(&vec!["w"; MAX_BAD_WORDS + 1]).unwrap();
        let long = "x".repeat(MAX_BAD_WORD_BYTES + 1);
        for (body, says) in [
            (
                format!(r#"{{"bad_words": {many}}}"#),
                "at most 256 bad_words",
            ),
            (
                format!(r#"{{"bad_words": ["{long}"]}}"#),
                "at most 256 bytes",
            ),
            (r#"{"bad_words": ["ok", " \t"]}"#.into(), "empty or blank"),
        ] {
            let e = checked(body).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn truncate_prompt_tokens_keeps_the_last_tokens() {
        let checked = |body: &str, max: Option<i64>| {
            check_common(&common(body), CTX, max, "max_tokens").map_err(|e| e.to_string())
        };
        let mut t: Vec<u32> = (0..10).collect();
        checked(r#"{"truncate_prompt_tokens": 4}"#, None)
            .unwrap()
            .truncate_prompt(&mut t, 100, 16);
        assert_eq!(t, [6, 7, 8, 9]);
        // Shorter already, or past u32: as it is.
        for k in ["40", "99999999999"] {
            checked(&format!(r#"{{"truncate_prompt_tokens": {k}}}"#), None)
                .unwrap()
                .truncate_prompt(&mut t, 100, 16);
            assert_eq!(t, [6, 7, 8, 9]);
        }
        // -1: room for max_tokens in a context of 8, or for the route's default.
        let mut t: Vec<u32> = (0..10).collect();
        checked(r#"{"truncate_prompt_tokens": -1}"#, Some(3))
            .unwrap()
            .truncate_prompt(&mut t, 8, 16);
        assert_eq!(t, [5, 6, 7, 8, 9]);
        let mut t: Vec<u32> = (0..10).collect();
        checked(r#"{"truncate_prompt_tokens": -1}"#, None)
            .unwrap()
            .truncate_prompt(&mut t, 8, 6);
        assert_eq!(t, [8, 9]);
        // No room at all: one token kept, for the engine to refuse the output's length.
        let mut t: Vec<u32> = (0..10).collect();
        checked(r#"{"truncate_prompt_tokens": -1}"#, Some(50))
            .unwrap()
            .truncate_prompt(&mut t, 8, 16);
        assert_eq!(t, [9]);
        let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                      "truncate_prompt_tokens": -1});
        let e = prepare_chat(&body, CTX).unwrap_err().to_string();
        assert!(e.contains("needs max_completion_tokens"), "{e}");
        for (body, says) in [
            (r#"{"truncate_prompt_tokens": 0}"#, "at least 1"),
            (r#"{"truncate_prompt_tokens": -2}"#, "at least 1"),
            (
                r#"{"truncate_prompt_tokens": 5, "cached_content": "ctx_1"}"#,
                "cannot be combined with cached_content",
            ),
        ] {
            let e = checked(body, None).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
        let body = serde_json::json!({"model": "m", "prompt": "x", "echo": true, "truncate_prompt_tokens": 2});
        let e = prepare_completion(&body, CTX).unwrap_err().to_string();
        assert!(
            e.contains("echo cannot be combined with truncate_prompt_tokens"),
            "{e}"
        );
    }

    #[test]
    fn max_tokens_beyond_u32_says_at_most_not_at_least() {
        let e = check_common(&common("{}"), CTX, Some(1 << 32), "max_tokens").unwrap_err();
        assert!(e.to_string().contains("at most 4294967295"), "{e}");
        let e = check_common(&common("{}"), CTX, Some(-3), "max_tokens").unwrap_err();
        assert!(e.to_string().contains("at least 1"), "{e}");
    }

    #[test]
    fn priority_needs_the_priority_policy() {
        let e = check_common(&common(r#"{"priority": -5}"#), CTX, None, "max_tokens").unwrap_err();
        assert!(
            e.to_string().contains("--scheduling-policy priority"),
            "{e}"
        );
        assert_eq!(param_of(e), "priority");
        // Zero is the default and means nothing either way.
        assert!(check_common(&common(r#"{"priority": 0}"#), CTX, None, "max_tokens").is_ok());
        let ctx = Ctx {
            priority_scheduling: true,
            ..CTX
        };
        let c = check_common(&common(r#"{"priority": -5}"#), ctx, None, "max_tokens").unwrap();
        assert_eq!(c.priority, -5);
    }

    #[test]
    fn a_response_with_logprobs_that_is_not_streamed_holds_a_bounded_number() {
        // 64 choices × 20 alternatives: 1 + 20 log-probabilities a token each, 780 tokens fit.
        let chat = |extra: serde_json::Value| {
            let mut v = serde_json::json!({"messages": [{"role": "user", "content": "x"}], "n": 64,
                                           "logprobs": true, "top_logprobs": 20});
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            prepare_chat(&v, CTX).unwrap()
        };
        let held = |p: &ChatPlan, m: u32| {
            held_logprobs_max_tokens(
                &p.checked,
                64,
                p.logprobs,
                "top_logprobs",
                m,
                MAX_HELD_LOGPROBS,
            )
        };
        let given = chat(serde_json::json!({"max_completion_tokens": 1000}));
        let e = held(&given, 1000).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("max_completion_tokens 1000") && text.contains("at most 780 here"),
            "{text}"
        );
        assert_eq!(param_of(e), "max_completion_tokens");
        assert_eq!(held(&given, 780).unwrap(), 780);
        // The default (the context's room) is lowered to fit instead.
        let default = chat(serde_json::json!({}));
        assert_eq!(held(&default, 8000).unwrap(), 780);
        // Streamed, or without log-probabilities, nothing is held: nothing changes.
        let streamed = chat(serde_json::json!({"max_tokens": 1000, "stream": true}));
        assert_eq!(held(&streamed, 1000).unwrap(), 1000);
        assert_eq!(
            held_logprobs(&streamed.checked, 64, streamed.logprobs, 1000),
            0
        );
        let plain = serde_json::json!({"messages": [{"role": "user", "content": "x"}], "n": 64,
                                       "max_tokens": 8000});
        let plain = prepare_chat(&plain, CTX).unwrap();
        assert_eq!(
            held_logprobs_max_tokens(
                &plain.checked,
                64,
                plain.logprobs,
                "top_logprobs",
                8000,
                MAX_HELD_LOGPROBS
            )
            .unwrap(),
            8000
        );
        // Completions: prompts × n choices, `logprobs` alternatives.
        let v =
            serde_json::json!({"prompt": ["a", "b"], "n": 4, "logprobs": 5, "max_tokens": 30000});
        let plan = prepare_completion(&v, CTX).unwrap();
        let e = held_logprobs_max_tokens(
            &plan.checked,
            8,
            plan.logprobs,
            "logprobs",
            30000,
            MAX_HELD_LOGPROBS,
        )
        .unwrap_err();
        assert!(e.to_string().contains("(1 + logprobs 5)"), "{e}");
        assert_eq!(param_of(e), "max_tokens");
        // What the response holds: 8 choices × 100 tokens × (1 + 5); a server's lower bound applies.
        assert_eq!(held_logprobs(&plan.checked, 8, plan.logprobs, 100), 4800);
        assert_eq!(held_logprobs(&plan.checked, 8, None, 100), 0);
        let e = held_logprobs_max_tokens(&plan.checked, 8, plan.logprobs, "logprobs", 100, 4000)
            .unwrap_err();
        assert!(
            e.to_string().contains("at most 4000 of them")
                && e.to_string().contains("at most 83 here"),
            "{e}"
        );
        assert_eq!(
            held_logprobs_max_tokens(&plan.checked, 8, plan.logprobs, "logprobs", 83, 4000)
                .unwrap(),
            83
        );
        // Not one token fits (8 × 6 = 48 a token over a bound of 40): refused naming the alternatives,
        // whatever max_tokens.
        let e = held_logprobs_max_tokens(&plan.checked, 8, plan.logprobs, "logprobs", 1, 40)
            .unwrap_err();
        assert!(e.to_string().contains("48 a token is more"), "{e}");
        assert_eq!(param_of(e), "logprobs");
    }

    #[test]
    fn completions_take_a_batch_of_prompts() {
        let v = serde_json::json!({"prompt": ["a", "b", "c"], "n": 2});
        let plan = prepare_completion(&v, CTX).unwrap();
        assert_eq!(plan.prompts.len(), 3);
        assert_eq!(plan.prompts[1], PromptInput::Text("b".into()));
        let v = serde_json::json!({"prompt": [[1, 2], [3]]});
        let plan = prepare_completion(&v, CTX).unwrap();
        assert_eq!(plan.prompts[1], PromptInput::Tokens(vec![3]));
        let v = serde_json::json!({"prompt": []});
        assert_eq!(param_of(prepare_completion(&v, CTX).unwrap_err()), "prompt");
        let many: Vec<String> = (0..200).map(|i| i.to_string()).collect();
        let v = serde_json::json!({"prompt": many, "n": 2});
        let e = prepare_completion(&v, CTX).unwrap_err();
        assert!(e.to_string().contains("at most 256 choices"), "{e}");
    }

    #[test]
    fn strings_kept_or_searched_for_each_token_are_bounded() {
        let long = |n: usize| "z".repeat(n);
        let ids: Vec<u32> = (0..=MAX_STOP_TOKEN_IDS as u32).collect();
        for (body, param, words) in [
            (
                serde_json::json!({"stop": ["a", long(MAX_STOP_BYTES + 1)]}),
                "stop",
                "at most 4096 bytes, got one of 4097",
            ),
            (
                serde_json::json!({"stop_token_ids": ids}),
                "stop_token_ids",
                "at most 1024 stop_token_ids",
            ),
            (
                serde_json::json!({"cache_salt": long(1025)}),
                "cache_salt",
                "cache_salt must be at most 1024 bytes",
            ),
            (
                serde_json::json!({"user": long(1025)}),
                "user",
                "user must be at most 1024 bytes",
            ),
        ] {
            let text = body.to_string();
            let e = check_common(&common(&text), CTX, None, "max_tokens").unwrap_err();
            assert!(e.to_string().contains(words), "{e}");
            match e {
                ApiError::InvalidRequest { param: Some(p), .. } => assert_eq!(p, param),
                other => panic!("{other:?}"),
            }
        }
        // At the limits: accepted.
        let body = serde_json::json!({
            "stop": [long(MAX_STOP_BYTES)],
            "stop_token_ids": (0..MAX_STOP_TOKEN_IDS as u32).collect::<Vec<_>>(),
            "cache_salt": long(1024),
            "user": long(1024),
        });
        let c = check_common(&common(&body.to_string()), CTX, None, "max_tokens").unwrap();
        assert_eq!(c.stop_token_ids.len(), MAX_STOP_TOKEN_IDS);
    }

    #[test]
    fn defaults_are_neutral() {
        let c = check_common(&common("{}"), CTX, None, "max_tokens").unwrap();
        assert_eq!(c.n, 1);
        assert_eq!(c.sampling, SamplingParams::default());
        assert!(c.max_tokens.is_none());
    }

    #[test]
    fn logit_bias_is_read_as_ascending_token_ids_with_their_biases() {
        let c = check_common(
            &common(r#"{"logit_bias": {"50256": -100, "3": 100, "17": 0.5}}"#),
            CTX,
            None,
            "max_tokens",
        )
        .unwrap();
        assert_eq!(
            c.sampling.logit_bias,
            [(3, 100.0), (17, 0.5), (50256, -100.0)]
        );
        assert!(c.sampling.validate().is_ok());
        let none = check_common(&common(r#"{"logit_bias": {}}"#), CTX, None, "max_tokens").unwrap();
        assert_eq!(none.sampling, SamplingParams::default());
    }

    #[test]
    fn out_of_range_values_name_the_parameter() {
        for (body, param) in [
            (r#"{"temperature": 3}"#, "temperature"),
            // Just past the bound: an f32 would round it onto the bound.
            (r#"{"temperature": 2.0000001}"#, "temperature"),
            (r#"{"temperature": 1e39}"#, "temperature"),
            (r#"{"top_p": 1.00000001}"#, "top_p"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_k": -5}"#, "top_k"),
            (r#"{"n": 0}"#, "n"),
            (r#"{"presence_penalty": -2.5}"#, "presence_penalty"),
            (r#"{"stop": [""]}"#, "stop"),
            (r#"{"logit_bias": {"12": 101}}"#, "logit_bias"),
            (r#"{"logit_bias": {"12": "5"}}"#, "logit_bias"),
            (r#"{"logit_bias": {"-3": 5}}"#, "logit_bias"),
            (r#"{"logit_bias": {"a": 5}}"#, "logit_bias"),
            (r#"{"logit_bias": {"": 5}}"#, "logit_bias"),
            (r#"{"logit_bias": {"4294967296": 5}}"#, "logit_bias"),
            (r#"{"logit_bias": {"7": 1, "007": 2}}"#, "logit_bias"),
        ] {
            let e = check_common(&common(body), CTX, None, "max_tokens").unwrap_err();
            match e {
                ApiError::InvalidRequest { param: Some(p), .. } => assert_eq!(p, param, "{body}"),
                other => panic!("{body}: {other:?}"),
            }
        }
        assert!(matches!(
            check_common(&common("{}"), CTX, Some(0), "max_tokens"),
            Err(ApiError::InvalidRequest { .. })
        ));
        assert!(matches!(
            check_common(&common(r#"{"model": "x"}"#), CTX, None, "max_tokens"),
            Err(ApiError::ModelNotFound { .. })
        ));
    }

    #[test]
    fn developer_role_maps_to_system_and_parts_join() {
        let msgs: Vec<RequestMessage> = serde_json::from_str(
            r#"[{"role":"developer","content":"a"},{"role":"user","content":[{"type":"text","text":"b"},{"type":"text","text":"c"}]}]"#,
        )
        .unwrap();
        let flat = flatten_messages(&msgs).unwrap();
        assert_eq!(flat[0].role, "system");
        assert_eq!(flat[1].content, "bc");
    }
}
