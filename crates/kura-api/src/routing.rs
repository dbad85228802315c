//! What a router in front of several servers needs from a request before it sends it on: the prompt's
//! tokens exactly as the server will compute them (same validation, chat template and tokenizer) and the
//! cache salt its blocks will be keyed under, so that it can look the prompt's blocks up in the KV
//! events the servers publish (`kura router`).

use kura_request::TextCodec;
use serde_json::Value;

use crate::anthropic;
use crate::error::ApiError;
use crate::keys::{effective_salt, Tenant};
use crate::validate::{self, tokenize_error, Ctx, PromptInput};

/// The generation routes a router forwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/chat/completions`
    ChatCompletions,
    /// `POST /v1/messages` (Anthropic)
    Messages,
    /// `POST /v1/messages/count_tokens` (Anthropic): a prompt's length, computed without the engine.
    MessagesCountTokens,
    /// `POST /v1/responses` (OpenAI's Responses API): a request that names a `previous_response_id`
    /// goes where that response is stored.
    Responses,
    /// `POST /v1/responses/input_tokens`: a Responses prompt's length, computed without the engine.
    ResponsesInputTokens,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Messages => "/v1/messages",
            Endpoint::MessagesCountTokens => "/v1/messages/count_tokens",
            Endpoint::Responses => "/v1/responses",
            Endpoint::ResponsesInputTokens => "/v1/responses/input_tokens",
        }
    }

    /// Whether the route answers in Anthropic's shape (its errors too).
    pub fn anthropic(self) -> bool {
        matches!(self, Endpoint::Messages | Endpoint::MessagesCountTokens)
    }

    /// Whether a request runs its prompt on the server (and so leaves its KV there): what a router
    /// places by the prompt's blocks. A token count computes nothing there.
    pub fn runs_prompt(self) -> bool {
        !matches!(
            self,
            Endpoint::MessagesCountTokens | Endpoint::ResponsesInputTokens
        )
    }

    /// Whether a request may continue a response stored on one server (`previous_response_id`).
    pub fn continues_responses(self) -> bool {
        matches!(self, Endpoint::Responses | Endpoint::ResponsesInputTokens)
    }
}

/// The `previous_response_id` a Responses body names, if it is one JSON object that names one (a body
/// the server refuses goes to a server anyway, which answers with its error).
pub fn previous_response_id(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Previous {
        previous_response_id: Option<String>,
    }
    serde_json::from_slice::<Previous>(body)
        .ok()?
        .previous_response_id
}

/// A request as the server will key its KV.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingPrompt {
    /// The prompt's tokens (the first prompt of a completions request with several).
    pub tokens: Vec<u32>,
    /// The engine's cache salt: the tenant and the request's `cache_salt`.
    pub cache_salt: Option<String>,
    /// OpenAI's `prompt_cache_key`: requests that share one should go to the same server.
    pub prompt_cache_key: Option<String>,
    /// Whether the response is a stream.
    pub stream: bool,
    /// Whether the prompt is scored (`echo` with `logprobs`, `prompt_logprobs`): a server computes it
    /// whole, reading nothing cached, so where its prefix is cached does not matter.
    pub scored: bool,
}

/// The prompt and cache salt of a request body (one JSON object) for `endpoint`, validated as the
/// server validates it. `tenant` is the tenant name of the key the request presents
/// ([`crate::TenantNamer::tenant_of_key`] with the fleet's secret) when the servers have keys (each key
/// is its own tenant); `None` when they have none. A saved context's tokens (`cached_content`) are not
/// known here: such a request is keyed by its own part.
pub fn routing_prompt(
    endpoint: Endpoint,
    value: &Value,
    served_model: &str,
    codec: &dyn TextCodec,
    tenant: Option<std::sync::Arc<str>>,
) -> Result<RoutingPrompt, ApiError> {
    let tenant = Tenant(tenant);
    // The router does not know the servers' scheduling policy; they check `priority` themselves.
    let ctx = Ctx {
        served_model,
        priority_scheduling: true,
    };
    let prompt_cache_key = value
        .get("prompt_cache_key")
        .and_then(Value::as_str)
        .map(str::to_string);
    let mut scored = false;
    let (tokens, salt, stream) = match endpoint {
        Endpoint::Completions => {
            let plan = validate::prepare_completion(value, ctx)?;
            scored = (plan.echo && plan.logprobs.is_some()) || plan.prompt_logprobs.is_some();
            let tokens = match plan.prompts.into_iter().next() {
                Some(PromptInput::Text(t)) => codec.encode(&t).map_err(tokenize_error)?,
                Some(PromptInput::Tokens(t)) => t,
                None => Vec::new(),
            };
            (tokens, plan.checked.cache_salt, plan.checked.stream)
        }
        Endpoint::ChatCompletions => {
            let plan = validate::prepare_chat(value, ctx)?;
            scored = plan.prompt_logprobs.is_some();
            let tokens =
                crate::tools::encode_chat_prompt(codec, plan.messages, plan.tools.as_ref())?;
            (tokens, plan.checked.cache_salt, plan.checked.stream)
        }
        Endpoint::Messages => {
            let plan = anthropic::prepare(value, served_model)?;
            let (tokens, _) = anthropic::encode_messages(codec, &plan, None)?;
            (tokens, plan.cache_salt, plan.stream)
        }
        Endpoint::MessagesCountTokens => {
            let plan = anthropic::prepare_count(value, served_model)?;
            let (tokens, _) = anthropic::encode_messages(codec, &plan, None)?;
            (tokens, plan.cache_salt, false)
        }
        Endpoint::Responses | Endpoint::ResponsesInputTokens => {
            let plan = match endpoint {
                Endpoint::Responses => crate::responses::prepare(value, ctx)?,
                _ => crate::responses::prepare_count(value, ctx)?,
            };
            // Continuing a stored response, the prompt starts with that response's conversation,
            // which only the server holding it knows: the request goes there, whatever its blocks.
            let tokens = match plan.previous_response_id {
                Some(_) => Vec::new(),
                None => {
                    let mut messages = Vec::with_capacity(plan.input.len() + 1);
                    if let Some(i) = plan.instructions {
                        messages.push(kura_request::ChatMessage::new("system", i));
                    }
                    messages.extend(plan.input);
                    crate::tools::encode_chat_prompt(codec, messages, plan.tools.as_ref())?
                }
            };
            (tokens, plan.checked.cache_salt, plan.checked.stream)
        }
    };
    Ok(RoutingPrompt {
        tokens,
        cache_salt: effective_salt(&tenant, salt),
        prompt_cache_key,
        stream,
        scored,
    })
}
