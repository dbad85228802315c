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

/// Most events one `event: kv` message of a server's `/v1/kv/events` carries: the server sends no more
/// in one, and a router reading them refuses a message that far exceeds it.
pub const KV_EVENTS_BATCH: usize = 256;

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
    // Nor whether they take a request's own chat template, which is not run here (a template is
    // code, and the router trusts no client's): such a request is routed by its salt and key alone.
    let ctx = Ctx {
        served_model,
        priority_scheduling: true,
        request_chat_templates: true,
    };
    // OpenAI's field, on OpenAI's routes only, whose validation below caps its length (the router keeps
    // it); Anthropic's routes have no such field, and a server ignores it there.
    let prompt_cache_key = match endpoint {
        Endpoint::Completions
        | Endpoint::ChatCompletions
        | Endpoint::Responses
        | Endpoint::ResponsesInputTokens => value
            .get("prompt_cache_key")
            .and_then(Value::as_str)
            .map(str::to_string),
        Endpoint::Messages | Endpoint::MessagesCountTokens => None,
    };
    let mut scored = false;
    let (tokens, salt, stream) = match endpoint {
        Endpoint::Completions => {
            let plan = validate::prepare_completion(value, ctx)?;
            scored = (plan.echo && plan.logprobs.is_some()) || plan.prompt_logprobs.is_some();
            let mut tokens = match plan.prompts.into_iter().next() {
                Some(PromptInput::Text(t)) => codec.encode(&t).map_err(tokenize_error)?,
                Some(PromptInput::Tokens(t)) => t,
                None => Vec::new(),
            };
            // A cut to a number of tokens, as the server cuts it (one to fit the context needs
            // the server's context length, which the router does not know: the whole prompt).
            plan.checked.truncate_prompt(&mut tokens, usize::MAX, 1);
            (tokens, plan.checked.cache_salt, plan.checked.stream)
        }
        Endpoint::ChatCompletions => {
            let plan = validate::prepare_chat(value, ctx)?;
            scored = plan.prompt_logprobs.is_some();
            let own = validate::request_codec(codec, None, plan.template_kwargs.as_ref())?
                .map(|(own, _)| own);
            let codec = own.as_deref().unwrap_or(codec);
            let mut tokens = match (plan.continue_final, &plan.chat_template) {
                (_, Some(_)) => Vec::new(),
                (true, None) => {
                    crate::tools::encode_chat_continuing(codec, plan.messages, plan.tools.as_ref())?
                }
                (false, None) => {
                    crate::tools::encode_chat_prompt(codec, plan.messages, plan.tools.as_ref())?
                }
            };
            plan.checked.truncate_prompt(&mut tokens, usize::MAX, 1);
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    use crate::test_codec::Bytes;

    fn key_of(endpoint: Endpoint, body: Value) -> Result<Option<String>, ApiError> {
        routing_prompt(endpoint, &body, "m", &Bytes, None).map(|p| p.prompt_cache_key)
    }

    #[test]
    fn a_request_s_own_chat_template_is_not_run_here() {
        // A template is code: such a request is routed by its salt and key alone (no prompt
        // tokens), whatever the template; the server takes or refuses it.
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "chat_template": "{% for i in range(10) %}{{ i }}{% endfor %}",
                          "prompt_cache_key": "k", "cache_salt": "s"});
        let p = routing_prompt(Endpoint::ChatCompletions, &body, "m", &Bytes, None).unwrap();
        assert!(p.tokens.is_empty());
        assert_eq!(p.prompt_cache_key.as_deref(), Some("k"));
        assert_eq!(p.cache_salt.as_deref(), Some("s"));
        let plain = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let p = routing_prompt(Endpoint::ChatCompletions, &plain, "m", &Bytes, None).unwrap();
        assert_eq!(p.tokens, b"hi".map(u32::from));
    }

    #[test]
    fn the_prompt_cache_key_is_read_on_openais_routes_only_and_never_past_its_bound() {
        let messages = json!([{"role": "user", "content": "hi"}]);
        let chat = |key: &str| json!({"model": "m", "messages": messages, "prompt_cache_key": key});
        assert_eq!(
            key_of(Endpoint::ChatCompletions, chat("k"))
                .unwrap()
                .as_deref(),
            Some("k")
        );
        let long = "x".repeat(validate::MAX_KEY_BYTES + 1);
        // OpenAI's routes refuse a key past the bound, as the servers do.
        assert!(key_of(Endpoint::ChatCompletions, chat(&long)).is_err());
        let completion = json!({"model": "m", "prompt": "hi", "prompt_cache_key": long});
        assert!(key_of(Endpoint::Completions, completion).is_err());
        // Anthropic's routes have no such field: the router keeps none, and refuses it by name as
        // the servers do.
        let body = json!({"model": "m", "max_tokens": 1, "messages": messages});
        assert_eq!(key_of(Endpoint::Messages, body).unwrap(), None);
        for key in ["k".to_string(), "y".repeat(8 << 20)] {
            let body = json!({"model": "m", "max_tokens": 1, "messages": messages,
                              "prompt_cache_key": key});
            let e = key_of(Endpoint::Messages, body).unwrap_err().to_string();
            assert!(
                e.starts_with("prompt_cache_key is not a field of messages"),
                "{e}"
            );
        }
    }
}
