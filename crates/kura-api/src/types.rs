//! OpenAI API request and response bodies, as JSON sees them. Requests are parsed leniently where
//! OpenAI's own schema is (string or array prompts, string or array stop, content parts) and checked
//! strictly in [`crate::validate`]. Unknown fields are ignored, as vLLM and SGLang do, so that clients
//! sending newer parameters still work.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `prompt` of `/v1/completions`: a string, token ids, or a one-element array of either.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    TextBatch(Vec<String>),
    TokensBatch(Vec<Vec<u32>>),
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields shared by both endpoints, parsed from the same JSON object as the endpoint's own fields
/// (two passes rather than `serde(flatten)`, which would lose the field names in type errors).
/// The sampling numbers are read as f64 and checked before they are narrowed to the engine's f32, so a
/// value just past a bound (`2.0000001`) is refused rather than rounded onto it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub n: Option<i64>,
    pub stop: Option<Stop>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    /// Kura extension (as vLLM's): lower runs first.
    pub priority: Option<i32>,
    /// Requests share cached KV only with requests of the same salt (vLLM's `cache_salt`).
    pub cache_salt: Option<String>,
    /// OpenAI's: `"in_memory"` (the default) or `"24h"` (the prompt is pinned for a day and written
    /// through to the lower tiers).
    pub prompt_cache_retention: Option<String>,
    /// OpenAI's routing hint; accepted (a fleet router may use it).
    pub prompt_cache_key: Option<String>,
    /// A saved context (`/v1/caches`) whose tokens start the prompt.
    pub cached_content: Option<String>,
    #[serde(default)]
    pub ignore_eos: bool,
    /// vLLM's: no choice ends on a stop token or stop string before it has this many tokens.
    pub min_tokens: Option<i64>,
    /// vLLM's: a stop string that ends a choice is part of its text.
    #[serde(default)]
    pub include_stop_str_in_output: bool,
    /// vLLM's: only these tokens may be chosen.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's: words (or phrases) the output never spells as the tokenizer writes them.
    pub bad_words: Option<Vec<String>>,
    /// vLLM's: `false` keeps the special tokens' text in the output (default `true`).
    pub skip_special_tokens: Option<bool>,
    /// vLLM's: the prompt is cut to its last this many tokens (-1: as many as leave room for the
    /// output).
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's extension: each choice of a non-streamed response also carries its generated tokens' ids
    /// (`token_ids`), so a client can continue from exactly those tokens.
    #[serde(default)]
    pub return_token_ids: bool,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Structured outputs ([`crate::structured`]).
    pub response_format: Option<Value>,
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Number of top logprobs per token (0..=20); `Some(0)` still reports the sampled token's.
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: bool,
    /// vLLM's extension: score the prompt's tokens too, with this many alternatives each.
    pub prompt_logprobs: Option<i64>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
}

/// Message content: a string or a list of typed parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RequestMessage {
    pub role: String,
    /// May be absent or null for assistant messages that carried only tool calls.
    pub content: Option<MessageContent>,
    /// An assistant turn's calls.
    pub tool_calls: Option<Vec<RequestToolCall>>,
    /// A `tool` turn: the call it answers.
    pub tool_call_id: Option<String>,
    /// The participant's name (OpenAI's `name`); for a `tool` turn, the function's.
    pub name: Option<String>,
    /// An assistant turn's refusal, as OpenAI sends it back (`null` when there was none).
    pub refusal: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RequestToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub function: RequestFunctionCall,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RequestFunctionCall {
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    pub messages: Vec<RequestMessage>,
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<i64>,
    /// vLLM's extension: score the prompt's tokens too, with this many alternatives each.
    pub prompt_logprobs: Option<i64>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// vLLM's: the last message, an assistant's, is continued rather than answered.
    pub continue_final_message: Option<bool>,
    /// vLLM's: only `true` (the default), or `false` beside `continue_final_message`.
    pub add_generation_prompt: Option<bool>,
    /// vLLM's: variables handed to the chat template beside the messages (`enable_thinking`).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// vLLM's: documents for a template that writes them (a RAG template), handed to it as
    /// `documents` (each an object of strings, such as `title` and `text`).
    pub documents: Option<Vec<serde_json::Map<String, Value>>>,
    /// vLLM's: a Jinja chat template for this request instead of the model's (only on a server
    /// started with `--trust-request-chat-template`).
    pub chat_template: Option<String>,
}

/// `POST /tokenize`: a prompt, or chat messages (with the tools the chat request would carry) as the
/// chat route writes them. Any other field is refused: a count must not leave out what the request
/// would have added.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<RequestMessage>>,
    pub tools: Option<Value>,
    /// vLLM's: with a prompt, whether the tokens a completion adds (BOS where the model wants one)
    /// are counted (default true). With messages only `false`: the chat template writes them.
    pub add_special_tokens: Option<bool>,
    /// vLLM's: with messages, `true` (the default), or `false` with `continue_final_message`.
    pub add_generation_prompt: Option<bool>,
    /// vLLM's: the last message, an assistant's, is continued (as the chat route's field).
    pub continue_final_message: Option<bool>,
    /// vLLM's: variables handed to the chat template (as the chat route's field).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// vLLM's: the request's own chat template (as the chat route's field).
    pub chat_template: Option<String>,
    /// vLLM's: documents for the chat template (as the chat route's field).
    pub documents: Option<Vec<serde_json::Map<String, Value>>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenizeResponse {
    pub tokens: Vec<u32>,
    pub count: usize,
    pub max_model_len: usize,
}

// ---------------------------------------------------------------------------------------------
// Responses

#[derive(Debug, Clone, Copy, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
    /// Prompt tokens this request computed for the prefixes it pinned (`prompt_cache_retention`,
    /// `cached_content`).
    pub cache_write_tokens: u32,
    /// Why the prompt was not cached further, when it could have been (Kura's extension).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_miss: Option<CacheMissBody>,
}

/// `{"reason": "never_seen" | "evicted" | "diverged" | "template_rerendered" | "salt_differs",
/// "at_token": N}`: the reason, and the first prompt token not served from the cache (for `diverged`
/// and `template_rerendered`, the first that differs from the cached sequence).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CacheMissBody {
    pub reason: &'static str,
    pub at_token: u32,
}

impl From<kura_request::CacheMiss> for CacheMissBody {
    fn from(m: kura_request::CacheMiss) -> Self {
        Self {
            reason: m.reason.as_str(),
            at_token: m.at,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct UsageBody {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
    /// Where a reasoning model's reasoning is read: how many of the completion's tokens it took.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Option<CompletionTokensDetails>,
}

/// OpenAI's `completion_tokens_details`: the completion's reasoning tokens.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CompletionTokensDetails {
    pub reasoning_tokens: u32,
}

impl From<kura_request::Usage> for UsageBody {
    fn from(u: kura_request::Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_tokens,
                cache_write_tokens: u.cache_write_tokens,
                cache_miss: u.miss.map(CacheMissBody::from),
            },
            completion_tokens_details: None,
        }
    }
}

impl UsageBody {
    /// This usage with the completion's reasoning tokens, where reasoning is read.
    pub fn with_reasoning(mut self, reasoning_tokens: Option<u32>) -> Self {
        self.completion_tokens_details =
            reasoning_tokens.map(|reasoning_tokens| CompletionTokensDetails { reasoning_tokens });
        self
    }
}

/// Legacy completions logprobs (parallel arrays). An echoed prompt's first token has `null` in
/// `token_logprobs` and `top_logprobs` (nothing before it scores it).
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<serde_json::Map<String, Value>>>,
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// With `return_token_ids`, in a non-streamed response.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// With `return_token_ids`, in a non-streamed response: the tokens of the choice's prompt.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<PromptTokenIds>,
    /// vLLM's `prompt_logprobs` ([`PromptLogprobsBody`]), when asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobsBody>,
}

/// A prompt's tokens (vLLM's `prompt_token_ids`), shared by the choices of one prompt.
#[derive(Debug, Clone)]
pub struct PromptTokenIds(pub std::sync::Arc<[u32]>);

impl Serialize for PromptTokenIds {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

/// vLLM's `prompt_logprobs` of a response: per prompt token, `null` for the first, then `{token id:
/// {"logprob", "rank", "decoded_token"}}` for the token itself and the most likely alternatives at its
/// position (the token once where it is one of them); shared by the choices of one prompt.
#[derive(Debug, Clone)]
pub struct PromptLogprobsBody(pub std::sync::Arc<Vec<Option<serde_json::Map<String, Value>>>>);

impl Serialize for PromptLogprobsBody {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageBody>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    /// Logprobs of a refusal: this server never refuses (always `null`, as OpenAI sends it).
    pub refusal: Option<Vec<ChatTokenLogprob>>,
}

/// A tool call the model made.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallBody {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCallBody,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionCallBody {
    pub name: String,
    /// JSON text.
    pub arguments: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ResponseMessage {
    pub role: &'static str,
    /// `null` when the turn is only tool calls.
    pub content: Option<String>,
    /// This server never refuses: always `null` (the field the spec requires).
    pub refusal: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallBody>>,
    /// A reasoning model's reasoning ([`crate::reasoning`]), under vLLM's two names: `reasoning`,
    /// and `reasoning_content` (DeepSeek's, which vLLM keeps beside it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// One piece of a streamed tool call: the first names it (`id`, `type`, `function.name`), later ones
/// add to its arguments.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ResponseMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// With `return_token_ids`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: UsageBody,
    /// With `return_token_ids`: the prompt's tokens (the chat template applied).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<PromptTokenIds>,
    /// vLLM's `prompt_logprobs` ([`PromptLogprobsBody`]), when asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobsBody>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
    /// A piece of a reasoning model's reasoning, under both names ([`ResponseMessage::reasoning`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    pub usage: Option<UsageBody>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}
