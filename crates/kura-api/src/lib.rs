//! `kura-api` — Kura's HTTP API as `kura serve`, `kura router` and `kura bench` share it, without the
//! engine or the model runtime:
//! - [`types`], [`validate`]: the OpenAI request and response bodies, and their validation into the
//!   engine's vocabulary (`kura-request`); [`anthropic`]: Anthropic's Messages API read the same way;
//! - [`responses`]: OpenAI's Responses API read the same way;
//! - [`structured`], [`tools`]: structured outputs and tool calling as requests spell them;
//!   [`reasoning`]: reasoning models' `<think>` text read apart from their answers;
//! - [`cache_control`]: context caching as requests spell it (TTLs, breakpoints, retention);
//! - [`routing`]: a request's prompt tokens and cache salt exactly as a server will key its KV (for a
//!   router);
//! - [`body`], [`error`]: bounded JSON bodies and errors that name the problem ([`ApiError`]);
//! - [`keys`]: API keys, tenants and their cache salts;
//! - [`conn`]: the connection layer both servers run on ([`accept_loop`]: a connection cap that evicts
//!   the oldest idle connection, header, idle and write-stall timeouts, a hard close at shutdown), and
//!   [`signal`];
//! - [`sse`]: the server-sent events decoder clients of the API use (the router, the load generator).

pub mod anthropic;
pub mod body;
pub mod cache_control;
pub mod conn;
pub mod error;
pub mod keys;
pub mod reasoning;
pub mod responses;
pub mod routing;
pub mod signal;
pub mod sse;
pub mod structured;
#[cfg(test)]
mod test_codec;
pub mod tools;
pub mod types;
pub mod validate;

pub use anthropic::AnthropicError;
pub use conn::{accept_loop, ConnLimits, Phase};
pub use error::ApiError;
pub use keys::{
    effective_salt, legacy_tenant_of_key, presented_keys, same_key, Tenant, TenantNamer,
};
pub use signal::shutdown_signal;

/// Parses and validates a request body exactly as the server does before tokenization (the chat route's
/// when `chat`, else the completions route's; `priority_scheduling` as `--scheduling-policy priority`
/// sets it), for fuzzing: it never panics, whatever the bytes.
pub fn fuzz_validate(chat: bool, priority_scheduling: bool, body: &[u8]) -> Result<(), ApiError> {
    let value = body::parse_json_object(body)?;
    let ctx = validate::Ctx {
        served_model: "model",
        priority_scheduling,
        request_chat_templates: false,
    };
    if chat {
        validate::prepare_chat(&value, ctx).map(drop)
    } else {
        validate::prepare_completion(&value, ctx).map(drop)
    }
}

/// Parses and reads a `/v1/responses` body exactly as the server does before tokenization (and the prompt
/// builder's fallback rendering of its turns), for fuzzing: it never panics, whatever the bytes.
pub fn fuzz_responses(body: &[u8]) -> Result<(), ApiError> {
    let value = body::parse_json_object(body)?;
    let ctx = validate::Ctx {
        served_model: "model",
        priority_scheduling: false,
        request_chat_templates: false,
    };
    // The same body read as a token count (`/v1/responses/input_tokens`), which refuses other fields.
    let _ = responses::prepare_count(&value, ctx);
    let plan = responses::prepare(&value, ctx)?;
    tools::check_tool_turns(&plan.input)?;
    let _ = tools::fallback_messages(plan.input, plan.tools.as_ref());
    Ok(())
}

/// Parses and reads a `/v1/messages` body exactly as the server does before tokenization, for fuzzing: it
/// never panics, whatever the bytes.
pub fn fuzz_messages(body: &[u8]) -> Result<(), ApiError> {
    let value = body::parse_json_object(body)?;
    // The same body read as a token count (`/v1/messages/count_tokens`), which refuses other fields.
    let _ = anthropic::prepare_count(&value, "model");
    anthropic::prepare(&value, "model").map(drop)
}
