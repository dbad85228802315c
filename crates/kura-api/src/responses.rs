//! OpenAI's Responses API (`POST /v1/responses`) as Kura reads it: `input` (text, or items: messages,
//! `function_call`s and `function_call_output`s), `instructions`, function `tools`, `text.format` for
//! structured output, `previous_response_id` and `store`, checked into a [`ResponsesPlan`]. The route
//! itself (the stored responses, the output items, the event stream) is `kura-server`'s.
//!
//! Accepted and ignored, with the reason: `service_tier` (one tier here), `safety_identifier` and
//! `user` (logged at debug level only), `truncation: "disabled"` (the default: a prompt longer than the
//! context is an error), `include: []`, `reasoning: null`, `background: false`. Refused with a 400 naming
//! the field: `truncation: "auto"`, a non-empty `include`, `reasoning` effort, `background: true`,
//! `conversation`, `prompt` (templates), `max_tool_calls`, `top_logprobs`, `context_management`, tools
//! of any type but
//! `function`, and input items other than messages and function calls with their outputs. (All of
//! it is in docs/api-fields.md.)

use kura_request::ChatMessage;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::tools::{openai_tools, parse_arguments, template_call, Guide, ToolPlan};
use crate::types::CommonParams;
use crate::validate::{check_common, Checked, Ctx};

/// Most `metadata` pairs (OpenAI's limit).
pub const MAX_METADATA: usize = 16;
/// Longest `metadata` key and value, in characters (OpenAI's limits).
pub const MAX_METADATA_KEY: usize = 64;
pub const MAX_METADATA_VALUE: usize = 512;
/// Longest `safety_identifier`, in characters (OpenAI's limit).
pub const MAX_SAFETY_IDENTIFIER: usize = 64;
/// The `service_tier` values OpenAI's API takes; all are served alike here.
pub const SERVICE_TIERS: [&str; 5] = ["auto", "default", "flex", "scale", "priority"];

/// An ignored `service_tier` (one tier here) is still one of the API's values (`tiers`), as the API
/// itself would check.
pub fn check_service_tier(tier: Option<&Value>, tiers: &[&str]) -> Result<(), ApiError> {
    match tier {
        Some(t) if !t.is_null() && !t.as_str().is_some_and(|t| tiers.contains(&t)) => Err(bad(
            format!(
                "service_tier must be one of {} (this server has one tier), got {}",
                tiers.join(", "),
                truncated(&t.to_string(), 64)
            ),
            "service_tier",
        )),
        _ => Ok(()),
    }
}

/// `text` cut to its first `chars` characters, for an error message.
fn truncated(text: &str, chars: usize) -> String {
    match text.char_indices().nth(chars) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

/// A checked Responses request.
#[derive(Debug, Clone)]
pub struct ResponsesPlan {
    pub checked: Checked,
    /// Turns this request adds (after the previous response's conversation, if any).
    pub input: Vec<ChatMessage>,
    /// For each turn of `input`, the index of the `input` item it starts with (for errors).
    pub input_items: Vec<usize>,
    /// A system message put first (not carried to the next response, as OpenAI does).
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    /// Keep the response (and its conversation) for `GET` and for the next turn. Default true.
    pub store: bool,
    pub tools: Option<ToolPlan>,
    /// The request's own fields, echoed in the response object.
    pub echo: Map<String, Value>,
}

fn bad(msg: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::invalid(msg, Some(param))
}

/// Text of a message item's content: a string or `input_text`/`output_text` parts.
fn item_text(content: &Value, at: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => match p.get("text") {
                        Some(Value::String(t)) => text.push_str(t),
                        _ => return Err(bad(format!("{at}.content[{j}] has no text"), "input")),
                    },
                    Some(other) => {
                        return Err(bad(
                            format!(
                            "{at}.content[{j}] has type {other:?}; this model accepts only text \
                                 (input_text, output_text)"
                        ),
                            "input",
                        ))
                    }
                    None => return Err(bad(format!("{at}.content[{j}] has no type"), "input")),
                }
            }
            Ok(text)
        }
        _ => Err(bad(
            format!("{at}.content must be text or a list of content parts"),
            "input",
        )),
    }
}

fn str_field<'a>(o: &'a Value, name: &str, at: &str) -> Result<&'a str, ApiError> {
    o.get(name)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| bad(format!("{at}.{name} must be a non-empty string"), "input"))
}

/// `input` → chat messages: text is one user message; items are messages, an assistant's
/// `function_call`s (joined into one assistant turn) and `function_call_output`s (tool turns). With
/// each message, the index of the item it starts with.
pub fn input_messages(input: &Value) -> Result<(Vec<ChatMessage>, Vec<usize>), ApiError> {
    let items = match input {
        Value::String(s) => return Ok((vec![ChatMessage::new("user", s.clone())], vec![0])),
        Value::Array(items) if !items.is_empty() => items,
        Value::Array(_) => return Err(bad("input must not be empty", "input")),
        _ => return Err(bad("input must be text or a list of items", "input")),
    };
    let mut out: Vec<ChatMessage> = Vec::new();
    let mut starts: Vec<usize> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        if starts.len() < out.len() {
            starts.push(i - 1);
        }
        let at = format!("input[{i}]");
        let kind = item.get("type").and_then(Value::as_str);
        match kind {
            None | Some("message") => {
                let role = str_field(item, "role", &at)?;
                let role = match role {
                    "user" | "assistant" | "system" => role,
                    "developer" => "system",
                    other => {
                        return Err(bad(
                            format!(
                            "{at}.role must be user, assistant, system or developer, got {other:?}"
                        ),
                            "input",
                        ))
                    }
                };
                let Some(content) = item.get("content") else {
                    return Err(bad(format!("{at}.content is missing"), "input"));
                };
                out.push(ChatMessage::new(role, item_text(content, &at)?));
            }
            Some("function_call") => {
                let call_id = str_field(item, "call_id", &at)?;
                let name = str_field(item, "name", &at)?;
                let Some(arguments) = item.get("arguments").and_then(Value::as_str) else {
                    return Err(bad(
                        format!("{at}.arguments must be the call's arguments as JSON text"),
                        "input",
                    ));
                };
                let args = parse_arguments(arguments, &format!("{at}.arguments"))
                    .map_err(|e| bad(e.to_string(), "input"))?;
                let call = template_call(call_id, name, arguments, Some(args));
                // Calls join the assistant turn they follow (its text, or calls before them).
                match out.last_mut() {
                    Some(m) if m.role == "assistant" => match &mut m.tool_calls {
                        Some(Value::Array(calls)) => calls.push(call),
                        _ => m.tool_calls = Some(Value::Array(vec![call])),
                    },
                    _ => out.push(ChatMessage {
                        role: "assistant".into(),
                        tool_calls: Some(Value::Array(vec![call])),
                        ..Default::default()
                    }),
                }
            }
            Some("function_call_output") => {
                let call_id = str_field(item, "call_id", &at)?;
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Array(_)) => item_text(v, &at)?,
                    _ => return Err(bad(format!("{at}.output must be text"), "input")),
                };
                out.push(ChatMessage {
                    role: "tool".into(),
                    content: output,
                    tool_call_id: Some(call_id.to_string()),
                    ..Default::default()
                });
            }
            // A reasoning model's reasoning sent back (as a client replays a response's output):
            // not written into the prompt, as reasoning models' templates leave out earlier turns'.
            Some("reasoning") => {
                if let Some(c) = item.get("content").filter(|c| !c.is_null()) {
                    if !c.is_array() {
                        return Err(bad(
                            format!("{at}.content must be a list of reasoning_text parts"),
                            "input",
                        ));
                    }
                }
            }
            Some(other) => {
                return Err(bad(
                    format!(
                        "{at} has type {other:?}; this server takes message, function_call, \
                         function_call_output and reasoning items"
                    ),
                    "input",
                ))
            }
        }
    }
    if out.is_empty() {
        return Err(bad(
            "input holds no message, function_call or function_call_output item (reasoning items \
             are not written into the prompt)",
            "input",
        ));
    }
    if starts.len() < out.len() {
        starts.push(items.len() - 1);
    }
    Ok((out, starts))
}

/// Responses' flat function tools (`{"type": "function", "name", "description", "parameters"}`) in
/// chat's nested shape, for [`openai_tools`].
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let Some(items) = tools.as_array() else {
        return Err(bad("tools must be a list of tools", "tools"));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, t)| match t.get("type").and_then(Value::as_str) {
            Some("function") => {
                let mut f = t.clone();
                if let Some(o) = f.as_object_mut() {
                    o.remove("type");
                    strict_unless_said(o);
                }
                Ok(json!({"type": "function", "function": f}))
            }
            other => Err(bad(
                format!(
                    "tools[{i}] has type {}; this server runs function tools only",
                    other.map_or("nothing".into(), |o| format!("{o:?}"))
                ),
                "tools",
            )),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// A Responses function tool is strict unless it says otherwise (null too), as Responses' schema
/// defines `strict`.
fn strict_unless_said(tool: &mut Map<String, Value>) {
    if tool.get("strict").is_none_or(Value::is_null) {
        tool.insert("strict".into(), Value::Bool(true));
    }
}

/// Responses' `tool_choice` (`"auto"`, `"none"`, `"required"`, `{"type": "function", "name"}`) in
/// chat's shape.
fn chat_tool_choice(v: &Value) -> Value {
    match v {
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            match o.get("name") {
                Some(name) => json!({"type": "function", "function": {"name": name}}),
                None => v.clone(),
            }
        }
        other => other.clone(),
    }
}

/// The fields of a `POST /v1/responses/input_tokens` request (OpenAI's `TokenCountsBody`).
pub const COUNT_FIELDS: [&str; 11] = [
    "model",
    "input",
    "previous_response_id",
    "tools",
    "text",
    "reasoning",
    "truncation",
    "instructions",
    "conversation",
    "tool_choice",
    "parallel_tool_calls",
];

/// An `input_tokens` request, checked as [`prepare`] checks the same fields of a Responses request
/// (`model` may be left out: the served model): the prompt written from its plan is the one
/// `/v1/responses` would compute, whose `usage.input_tokens` is its length. A field of Responses that is
/// not one of input_tokens' (`max_output_tokens`, `stream`, sampling, `store`) is refused by name.
pub fn prepare_count(value: &Value, ctx: Ctx<'_>) -> Result<ResponsesPlan, ApiError> {
    let o = value.as_object().expect("parse_json_object gives objects");
    crate::body::only_fields(o, &COUNT_FIELDS, "input_tokens")?;
    let mut o = o.clone();
    if o.get("model").is_none_or(Value::is_null) {
        o.insert("model".into(), Value::String(ctx.served_model.to_string()));
    }
    prepare(&Value::Object(o), ctx)
}

/// Every field a `/v1/responses` body may hold: OpenAI's (honoured, ignored or refused by name
/// below), Kura's extensions, and chat's fields, which are refused by name (docs/api-fields.md).
pub const FIELDS: [&str; 56] = [
    "background",
    "bad_words",
    "cache_salt",
    "cached_content",
    "context_management",
    "conversation",
    "frequency_penalty",
    "guided_choice",
    "guided_grammar",
    "guided_json",
    "guided_regex",
    "ignore_eos",
    "include",
    "input",
    "instructions",
    "logit_bias",
    "logprobs",
    "max_completion_tokens",
    "max_output_tokens",
    "max_tokens",
    "max_tool_calls",
    "messages",
    "metadata",
    "min_p",
    "min_tokens",
    "model",
    "n",
    "parallel_tool_calls",
    "presence_penalty",
    "previous_response_id",
    "priority",
    "prompt",
    "prompt_cache_key",
    "prompt_cache_retention",
    "reasoning",
    "repetition_penalty",
    "response_format",
    "return_token_ids",
    "safety_identifier",
    "seed",
    "service_tier",
    "stop",
    "stop_token_ids",
    "store",
    "stream",
    "stream_options",
    "structured_outputs",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_k",
    "top_logprobs",
    "top_p",
    "truncation",
    "user",
];

/// Checks a `/v1/responses` body (already known to be one JSON object).
pub fn prepare(value: &Value, ctx: Ctx<'_>) -> Result<ResponsesPlan, ApiError> {
    let o = value.as_object().expect("parse_json_object gives objects");
    crate::body::known_fields(o, &[&FIELDS], "responses")?;
    let set = |name: &str| o.get(name).filter(|v| !v.is_null());
    for (name, why) in [
        ("conversation", "use previous_response_id"),
        ("prompt", "prompt templates are not stored here"),
        ("max_tool_calls", "it is not enforced here"),
        ("top_logprobs", "logprobs are on /v1/chat/completions"),
        ("context_management", "there is no server-side compaction"),
        ("messages", "the conversation is input, with instructions"),
        ("max_tokens", "the bound is max_output_tokens"),
        ("max_completion_tokens", "the bound is max_output_tokens"),
        (
            "n",
            "a response has one output; send the request again for another",
        ),
        ("logprobs", "logprobs are on /v1/chat/completions"),
        ("response_format", "the output's format is text.format"),
        ("structured_outputs", "the output's format is text.format"),
        ("guided_json", "the output's format is text.format"),
        ("guided_regex", "the output's format is text.format"),
        ("guided_choice", "the output's format is text.format"),
        ("guided_grammar", "the output's format is text.format"),
        (
            "return_token_ids",
            "token ids are on /v1/chat/completions and /v1/completions",
        ),
        (
            "cached_content",
            "saved contexts go with /v1/chat/completions, /v1/completions and /v1/messages; here \
             previous_response_id carries a conversation",
        ),
    ] {
        if set(name).is_some() {
            return Err(ApiError::invalid(
                format!("{name} is not supported by this server ({why})"),
                Some(name),
            ));
        }
    }
    if set("background").is_some_and(|v| v != &Value::Bool(false)) {
        return Err(bad(
            "background responses are not supported by this server",
            "background",
        ));
    }
    for (name, known) in [
        ("reasoning", &["effort", "summary", "generate_summary"][..]),
        ("text", &["format", "verbosity"][..]),
    ] {
        if let Some(v) = set(name) {
            let Some(o) = v.as_object() else {
                return Err(bad(format!("{name} must be an object, got {v}"), name));
            };
            if let Some(k) = o.keys().find(|k| !known.contains(&k.as_str())) {
                return Err(bad(
                    format!("{name} has no field {k:?} (it takes {})", known.join(", ")),
                    name,
                ));
            }
        }
    }
    if let Some(r) = set("reasoning") {
        if r.get("effort").is_some_and(|e| !e.is_null())
            || r.get("summary").is_some_and(|e| !e.is_null())
        {
            return Err(bad(
                "reasoning is not supported by this model (it has no reasoning mode)",
                "reasoning",
            ));
        }
    }
    match set("truncation").map(|t| t.as_str()) {
        None | Some(Some("disabled")) => {}
        Some(_) => {
            return Err(bad(
                "truncation must be \"disabled\" on this server: a prompt longer than the context \
                 is an error, never silently cut",
                "truncation",
            ))
        }
    }
    if set("include").is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(bad(
            "include is not supported by this server (give [] or nothing)",
            "include",
        ));
    }
    if let Some(m) = set("metadata") {
        match m.as_object() {
            Some(m) if m.len() <= MAX_METADATA && m.values().all(Value::is_string) => {
                // OpenAI's limits; a stored response keeps its metadata.
                let long = m.iter().find(|(k, v)| {
                    k.chars().count() > MAX_METADATA_KEY
                        || v.as_str()
                            .is_some_and(|v| v.chars().count() > MAX_METADATA_VALUE)
                });
                if let Some((k, _)) = long {
                    return Err(bad(
                        format!(
                            "metadata keys may be at most {MAX_METADATA_KEY} characters and values \
                             {MAX_METADATA_VALUE}; {:?} is longer",
                            truncated(k, 64)
                        ),
                        "metadata",
                    ));
                }
            }
            _ => {
                return Err(bad(
                    format!("metadata must be an object of at most {MAX_METADATA} string values"),
                    "metadata",
                ))
            }
        }
    }
    check_service_tier(set("service_tier"), &SERVICE_TIERS)?;
    if let Some(id) = set("safety_identifier") {
        if id
            .as_str()
            .is_none_or(|id| id.chars().count() > MAX_SAFETY_IDENTIFIER)
        {
            return Err(bad(
                format!("safety_identifier must be a string of at most {MAX_SAFETY_IDENTIFIER} characters"),
                "safety_identifier",
            ));
        }
    }
    // The sampling fields Responses shares with chat, under the chat names `check_common` reads.
    let mut common_json = Map::new();
    for name in [
        "model",
        "temperature",
        "top_p",
        "stream",
        "user",
        "prompt_cache_key",
        "prompt_cache_retention",
        "cache_salt",
        "seed",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        // vLLM's extensions, as on chat.
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
        "logit_bias",
        "priority",
        "bad_words",
    ] {
        if let Some(v) = set(name) {
            common_json.insert(name.into(), v.clone());
        }
    }
    // `text.format` is chat's `response_format`, flattened.
    if let Some(text) = set("text") {
        match text.get("format").filter(|f| !f.is_null()) {
            None => {}
            Some(f) if f.get("type").and_then(Value::as_str) == Some("json_schema") => {
                let mut js = f.clone();
                if let Some(o) = js.as_object_mut() {
                    o.remove("type");
                }
                common_json.insert(
                    "response_format".into(),
                    json!({"type": "json_schema", "json_schema": js}),
                );
            }
            Some(f) => {
                common_json.insert("response_format".into(), f.clone());
            }
        }
    }
    let common: CommonParams = crate::body::from_value(&Value::Object(common_json.clone()))?;
    let max_output = match set("max_output_tokens") {
        None => None,
        Some(v) => Some(v.as_i64().ok_or_else(|| {
            bad(
                format!("max_output_tokens must be an integer, got {v}"),
                "max_output_tokens",
            )
        })?),
    };
    let mut checked = check_common(&common, ctx, max_output, "max_output_tokens")
        .map_err(|e| e.rename_param("response_format", "text"))?;
    if let Some((g, _)) = checked.guide.take() {
        checked.guide = Some((g, "text"));
    }
    let Some(input) = set("input") else {
        return Err(bad("input is required (text or a list of items)", "input"));
    };
    let (input, input_items) = input_messages(input)?;
    let instructions = match set("instructions") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(bad("instructions must be text", "instructions")),
    };
    let tools = match set("tools") {
        None => None,
        Some(t) => Some(chat_tools(t)?),
    };
    let choice = set("tool_choice").map(chat_tool_choice);
    let parallel = match set("parallel_tool_calls") {
        None => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => {
            return Err(bad(
                "parallel_tool_calls must be a boolean",
                "parallel_tool_calls",
            ))
        }
    };
    let tools = openai_tools(tools.as_ref(), choice.as_ref(), parallel)?;
    let previous_response_id = match set("previous_response_id") {
        None => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => {
            return Err(bad(
                "previous_response_id must be a response id",
                "previous_response_id",
            ))
        }
    };
    let store = match set("store") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("store must be a boolean", "store")),
    };
    let mut echo = Map::new();
    if let Some(Value::Array(ts)) = set("tools") {
        // As the response object writes them: every function tool with its `strict` (true unless
        // it says otherwise, as Responses' schema defines it).
        let ts: Vec<Value> = ts
            .iter()
            .map(|t| {
                let mut t = t.clone();
                if let Some(o) = t.as_object_mut() {
                    strict_unless_said(o);
                    o.entry("parameters")
                        .or_insert(json!({"type": "object", "properties": {}}));
                }
                t
            })
            .collect();
        echo.insert("tools".into(), Value::Array(ts));
    }
    for name in [
        "temperature",
        "top_p",
        "max_output_tokens",
        "metadata",
        "parallel_tool_calls",
        "tool_choice",
        "text",
        "user",
        "prompt_cache_key",
        "service_tier",
    ] {
        if let Some(v) = set(name) {
            echo.insert(name.into(), v.clone());
        }
    }
    Ok(ResponsesPlan {
        checked,
        input,
        input_items,
        instructions,
        previous_response_id,
        store,
        tools,
        echo,
    })
}

impl ResponsesPlan {
    /// The guide the output follows, if any (for the server's compiler).
    pub fn guide(&self) -> Option<(Guide, &'static str)> {
        self.checked.guide.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTX: Ctx<'static> = Ctx {
        served_model: "m",
        priority_scheduling: false,
        request_chat_templates: false,
    };

    #[test]
    fn a_count_reads_the_prompt_fields_as_create_does_and_refuses_the_rest() {
        let v = json!({"input": "Hi", "instructions": "Be brief.",
                       "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}]});
        let count = prepare_count(&v, CTX).unwrap();
        let mut with_model = v.clone();
        with_model["model"] = json!("m");
        let create = prepare(&with_model, CTX).unwrap();
        assert_eq!(count.input, create.input);
        assert_eq!(count.instructions, create.instructions);
        assert_eq!(count.tools, create.tools);
        for extra in ["max_output_tokens", "stream", "store", "temperature"] {
            let mut v = v.clone();
            v[extra] = json!(1);
            let e = prepare_count(&v, CTX).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("{extra} is not a field of input_tokens")),
                "{e}"
            );
        }
        let mut other = v.clone();
        other["model"] = json!("other");
        assert_eq!(
            prepare_count(&other, CTX).unwrap_err().status().as_u16(),
            404
        );
    }

    #[test]
    fn items_become_turns() {
        let v = json!({"input": [
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{\"city\": \"Oslo\"}"},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ], "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
           "max_output_tokens": 20});
        let p = prepare(&v, CTX).unwrap();
        assert_eq!(p.input.len(), 4);
        assert_eq!(p.input[0].role, "system");
        assert_eq!(
            p.input[2]
                .tool_calls
                .as_ref()
                .unwrap()
                .as_array()
                .unwrap()
                .len(),
            2
        );
        assert_eq!(p.input[3].tool_call_id.as_deref(), Some("c1"));
        assert!(matches!(
            p.checked.guide,
            Some((Guide::JsonSchema(_), "text"))
        ));
        assert_eq!(p.checked.max_tokens, Some(20));
        assert!(p.store);
    }

    #[test]
    fn bounded_fields_are_taken_at_their_limits() {
        let body = json!({
            "input": "x",
            "metadata": {"k".repeat(64): "é".repeat(512)},
            "service_tier": "flex",
            "safety_identifier": "s".repeat(64),
        });
        let plan = prepare(&body, CTX).unwrap();
        assert_eq!(plan.echo["service_tier"], "flex");
    }

    #[test]
    fn vllms_sampling_extensions_are_taken_as_chat_takes_them() {
        let body = json!({"input": "x", "stop": ["\n\n", "END"], "stop_token_ids": [7],
                          "ignore_eos": true, "logit_bias": {"5": -100}, "priority": -3});
        let ctx = Ctx {
            priority_scheduling: true,
            ..CTX
        };
        let c = prepare(&body, ctx).unwrap().checked;
        assert_eq!(c.stop, ["\n\n", "END"]);
        assert_eq!(c.stop_token_ids, [7]);
        assert!(c.ignore_eos);
        assert_eq!(c.priority, -3);
        assert_eq!(c.sampling.logit_bias, [(5, -100.0)]);
    }

    #[test]
    fn unsupported_fields_are_refused_by_name() {
        for (body, param) in [
            (json!({"input": "x", "truncation": "auto"}), "truncation"),
            (json!({"input": "x", "background": true}), "background"),
            (json!({"input": "x", "text": "x"}), "text"),
            (json!({"input": "x", "text": {"fromat": {}}}), "text"),
            (json!({"input": "x", "reasoning": 5}), "reasoning"),
            (json!({"input": "x", "reasoning": {"a": 1}}), "reasoning"),
            (
                json!({"input": "x", "reasoning": {"effort": "high"}}),
                "reasoning",
            ),
            (
                json!({"input": "x", "include": ["file_search_call.results"]}),
                "include",
            ),
            (
                json!({"input": "x", "conversation": "conv_1"}),
                "conversation",
            ),
            (
                json!({"input": "x", "tools": [{"type": "web_search"}]}),
                "tools",
            ),
            (
                json!({"input": [{"type": "reasoning", "id": "r"}]}),
                "input",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "yaml"}}}),
                "text",
            ),
            (
                json!({"input": "x", "previous_response_id": 3}),
                "previous_response_id",
            ),
            (json!({}), "input"),
            // What a stored response keeps is bounded as OpenAI bounds it.
            (
                json!({"input": "x", "metadata": {"k": "v".repeat(513)}}),
                "metadata",
            ),
            (
                json!({"input": "x", "metadata": {"k".repeat(65): "v"}}),
                "metadata",
            ),
            (
                json!({"input": "x", "service_tier": "x".repeat(100_000)}),
                "service_tier",
            ),
            (json!({"input": "x", "service_tier": 1}), "service_tier"),
            (
                json!({"input": "x", "safety_identifier": "s".repeat(65)}),
                "safety_identifier",
            ),
            (json!({"input": "x", "user": "u".repeat(1025)}), "user"),
            (
                json!({"input": "x", "cache_salt": "s".repeat(1025)}),
                "cache_salt",
            ),
            // Chat's and completions' own fields, which a response has no place for, are named
            // rather than dropped.
            (json!({"input": "x", "n": 2}), "n"),
            (json!({"input": "x", "max_tokens": 5}), "max_tokens"),
            (json!({"input": "x", "logprobs": true}), "logprobs"),
            (json!({"input": "x", "guided_regex": "a+"}), "guided_regex"),
            (
                json!({"input": "x", "response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (
                json!({"input": "x", "return_token_ids": true}),
                "return_token_ids",
            ),
            (
                json!({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                                  "arguments": {"city": "Paris"}}]}),
                "input",
            ),
            (
                json!({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}),
                "input",
            ),
            (json!({"input": "x", "priority": 1}), "priority"),
        ] {
            match prepare(&body, CTX).unwrap_err() {
                ApiError::InvalidRequest { param: Some(p), .. } => assert_eq!(p, param, "{body}"),
                other => panic!("{body}: {other:?}"),
            }
        }
    }
}
