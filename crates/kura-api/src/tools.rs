//! Tool calling as requests spell it: OpenAI's `tools` / `tool_choice` / `parallel_tool_calls`, checked
//! into a [`ToolPlan`]; a conversation's tool turns (assistant `tool_calls`, `tool` results) written into
//! the prompt, by the model's own template where it has a tools section and by Kura's fallback format
//! ([`kura_guide::tools`]) otherwise.
//!
//! Tools are in the prompt whatever `tool_choice` says (also `none`), so the prompt, and the KV cached
//! for it, is the same from one call to the next. `required` and a named function constrain the output
//! to calls whose arguments are valid under the function's schema; `auto` leaves the model free and
//! reads calls out of what it wrote.

use std::collections::HashSet;

use kura_guide::tools::fallback_tool_response;
pub use kura_guide::tools::{CallReader, ParsedCall, ToolDef, ToolFormat};
pub use kura_guide::Guide;
use kura_request::{ChatMessage, TextCodec};
use serde_json::{json, Value};

use crate::error::ApiError;

/// What a request's `tool_choice` asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolPlan {
    pub tools: Vec<ToolDef>,
    pub choice: ToolChoice,
    /// More than one call per turn allowed (`parallel_tool_calls`, default true; never with OpenAI's
    /// named function, which is one call).
    pub parallel: bool,
}

impl ToolPlan {
    /// The tools the output is constrained to call (`required`: any; a named one: that one), or
    /// `None` when the output is free.
    pub fn constrained(&self) -> Option<Vec<ToolDef>> {
        match &self.choice {
            ToolChoice::None | ToolChoice::Auto => None,
            ToolChoice::Required => Some(self.tools.clone()),
            ToolChoice::Named(n) => Some(
                self.tools
                    .iter()
                    .filter(|t| &t.name == n)
                    .cloned()
                    .collect(),
            ),
        }
    }

    /// Whether the model may call the tools or answer (`auto`) and one of them is strict: its calls'
    /// arguments are then held to its schema ([`ToolFormat::call_or_text_grammar`]).
    pub fn strict_under_auto(&self) -> bool {
        self.choice == ToolChoice::Auto && self.tools.iter().any(|t| t.strict)
    }

    /// Whether the output follows a grammar of these tools from its first token (a forced call, or
    /// strict tools under `auto`): a turn that goes on from given text cannot take one.
    pub fn grammar_starts_turn(&self) -> bool {
        self.constrained().is_some() || self.strict_under_auto()
    }

    /// Whether calls are read out of the output (not with `none`).
    pub fn parses_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// How calls are read out of the output of a template writing them in `format` (none with
    /// `none`): calls of these tools alone, one a turn without `parallel`.
    pub fn reader(&self, format: ToolFormat) -> Option<CallReader> {
        self.parses_calls().then(|| {
            CallReader::new(
                format,
                self.tools.iter().map(|t| t.name.clone()),
                self.parallel,
            )
        })
    }

    /// The tools as OpenAI's `tools` array (what a template's tools section reads).
    pub fn openai_json(&self) -> Value {
        Value::Array(self.tools.iter().map(ToolDef::openai_json).collect())
    }
}

fn bad(msg: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::invalid(msg, Some(param))
}

/// OpenAI's function names: 1 to 64 letters, digits, `_` or `-`.
pub fn check_function_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// A tool's parameter schema: an object schema (`{"type": "object"}` when absent).
pub fn check_parameters(
    v: Option<&Value>,
    at: &str,
    param: &'static str,
) -> Result<Value, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(json!({"type": "object", "properties": {}})),
        Some(p @ Value::Object(map)) => {
            // A call's arguments are a JSON object: a schema of another type could never be met.
            let object = |t: &Value| t.as_str() == Some("object");
            match map.get("type") {
                None => Ok(p.clone()),
                Some(t) if object(t) || t.as_array().is_some_and(|a| a.iter().any(object)) => {
                    Ok(p.clone())
                }
                Some(t) => Err(bad(
                    format!(
                        "{at} must describe a JSON object (a call's arguments); its type is {t}"
                    ),
                    param,
                )),
            }
        }
        Some(_) => Err(bad(format!("{at} must be a JSON schema object"), param)),
    }
}

/// One of `tools`' names, for `tool_choice`; an unknown name is the client's error.
pub fn check_named(tools: &[ToolDef], name: &str, param: &'static str) -> Result<(), ApiError> {
    if tools.iter().any(|t| t.name == name) {
        Ok(())
    } else {
        let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
        Err(bad(
            format!(
                "tool_choice names the function {name:?}, which is not among the tools ({})",
                names.join(", ")
            ),
            param,
        ))
    }
}

/// Tool names must be unique: a call names its function.
pub fn check_unique(tools: &[ToolDef], param: &'static str) -> Result<(), ApiError> {
    let mut seen = HashSet::new();
    for t in tools {
        if !seen.insert(t.name.as_str()) {
            return Err(bad(
                format!(
                    "two tools are named {:?}; tool names must be unique",
                    t.name
                ),
                param,
            ));
        }
    }
    Ok(())
}

/// OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.
pub fn openai_tools(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    parallel: Option<bool>,
) -> Result<Option<ToolPlan>, ApiError> {
    let defs: Vec<ToolDef> = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, t)| openai_tool(i, t))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad("tools must be a list of tools", "tools")),
    };
    check_unique(&defs, "tools")?;
    let choice = match tool_choice {
        None | Some(Value::Null) => {
            if defs.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(
                    format!(
                        "tool_choice must be none, auto, required or a named function, got \
                         {other:?}"
                    ),
                    "tool_choice",
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = match (o.get("type").and_then(Value::as_str), o.get("function")) {
                (Some("function"), Some(f)) => f.get("name").and_then(Value::as_str),
                (Some(other), _) if other != "function" => {
                    return Err(bad(
                        format!(
                            "tool_choice of type {other:?} is not supported by this server; use \
                             none, auto, required or {{\"type\": \"function\", \"function\": \
                             {{\"name\": ..}}}}"
                        ),
                        "tool_choice",
                    ))
                }
                _ => None,
            };
            let Some(name) = name else {
                return Err(bad(
                    "tool_choice as an object must be {\"type\": \"function\", \"function\": \
                     {\"name\": ..}}",
                    "tool_choice",
                ));
            };
            ToolChoice::Named(name.to_string())
        }
        Some(_) => {
            return Err(bad(
                "tool_choice must be a string or an object",
                "tool_choice",
            ))
        }
    };
    match &choice {
        ToolChoice::Required | ToolChoice::Named(_) if defs.is_empty() => {
            return Err(bad(
                "tool_choice asks for a tool call but the request has no tools",
                "tool_choice",
            ))
        }
        ToolChoice::Named(n) => check_named(&defs, n, "tool_choice")?,
        _ => {}
    }
    if defs.is_empty() {
        return Ok(None);
    }
    // OpenAI's forced function is "exactly one call of that function", whatever
    // `parallel_tool_calls` says (as vLLM serves it too).
    let parallel = !matches!(choice, ToolChoice::Named(_)) && parallel.unwrap_or(true);
    Ok(Some(ToolPlan {
        tools: defs,
        choice,
        parallel,
    }))
}

fn openai_tool(i: usize, t: &Value) -> Result<ToolDef, ApiError> {
    const P: &str = "tools";
    let kind = t.get("type").and_then(Value::as_str);
    if kind != Some("function") {
        return Err(bad(
            format!(
                "tools[{i}].type must be \"function\" (the only kind this server runs), got {}",
                t.get("type")
                    .map_or("nothing".to_string(), Value::to_string)
            ),
            P,
        ));
    }
    let Some(f) = t.get("function").and_then(Value::as_object) else {
        return Err(bad(format!("tools[{i}] has no function object"), P));
    };
    let Some(name) = f.get("name").and_then(Value::as_str) else {
        return Err(bad(format!("tools[{i}].function has no name"), P));
    };
    if !check_function_name(name) {
        return Err(bad(
            format!(
                "tools[{i}].function.name must be 1 to 64 letters, digits, _ or -, got {name:?}"
            ),
            P,
        ));
    }
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d.clone()),
        Some(_) => {
            return Err(bad(
                format!("tools[{i}].function.description must be text"),
                P,
            ))
        }
    };
    let strict = match f.get("strict") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(bad(
                format!("tools[{i}].function.strict must be a boolean"),
                P,
            ))
        }
    };
    let parameters = check_parameters(
        f.get("parameters"),
        &format!("tools[{i}].function.parameters"),
        P,
    )?;
    Ok(ToolDef {
        name: name.to_string(),
        description,
        parameters,
        strict,
    })
}

/// A past call's arguments, given as JSON text: they must be a JSON object.
pub fn parse_arguments(text: &str, at: &str) -> Result<Value, ApiError> {
    match serde_json::from_str::<Value>(text) {
        Ok(v @ Value::Object(_)) => Ok(v),
        _ => Err(bad(
            format!("{at} must be a JSON object written as text, got {text:?}"),
            "messages",
        )),
    }
}

/// One call of an assistant turn, in the shape HF chat templates read (`arguments` an object), with the
/// arguments' text as it was generated or sent back (`raw_arguments`: what Kura's fallback writes into
/// the prompt; [`native_messages`] drops it). `arguments`: the text parsed, when the caller has it.
pub fn template_call(id: &str, name: &str, raw_arguments: &str, arguments: Option<Value>) -> Value {
    let arguments = arguments
        .unwrap_or_else(|| serde_json::from_str(raw_arguments).unwrap_or_else(|_| json!({})));
    json!({"id": id, "type": "function", "raw_arguments": raw_arguments,
           "function": {"name": name, "arguments": arguments}})
}

/// The calls of an assistant [`ChatMessage`] (as [`template_call`] wrote them), each with the
/// arguments' text as the client sent them back.
fn calls_of(m: &ChatMessage) -> Vec<ParsedCall> {
    let Some(Value::Array(calls)) = &m.tool_calls else {
        return Vec::new();
    };
    calls
        .iter()
        .filter_map(|c| {
            let f = c.get("function")?;
            let name = f.get("name")?.as_str()?.to_string();
            // The text as sent is kept beside the parsed object (see `raw_arguments`).
            let arguments = c
                .get("raw_arguments")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| f.get("arguments").map_or("{}".into(), Value::to_string));
            Some(ParsedCall { name, arguments })
        })
        .collect()
}

/// Checks the tool turns of a conversation: every `tool` message answers a call an earlier assistant
/// message made. Errors name chat's fields (`messages[i]`, `tool_call_id`).
pub fn check_tool_turns(messages: &[ChatMessage]) -> Result<(), ApiError> {
    check_tool_turns_named(
        messages,
        &TurnNames {
            item: &|i| format!("messages[{i}]"),
            id: "tool_call_id",
            call: "assistant message",
            param: "messages",
        },
    )
}

/// How an API names the parts of a conversation in [`check_tool_turns_named`]'s errors.
pub struct TurnNames<'a> {
    /// The request's name for message `i` (`messages[3]`, `input[5]`).
    pub item: &'a dyn Fn(usize) -> String,
    /// The field holding the id of the call a result answers.
    pub id: &'a str,
    /// What makes a call.
    pub call: &'a str,
    /// The parameter the error names.
    pub param: &'static str,
}

/// [`check_tool_turns`] with errors in another API's names (Responses: `input[i]`, `call_id`).
pub fn check_tool_turns_named(messages: &[ChatMessage], n: &TurnNames<'_>) -> Result<(), ApiError> {
    let mut called: HashSet<String> = HashSet::new();
    for (i, m) in messages.iter().enumerate() {
        if let Some(Value::Array(calls)) = &m.tool_calls {
            for c in calls {
                if let Some(id) = c.get("id").and_then(Value::as_str) {
                    called.insert(id.to_string());
                }
            }
        }
        if m.role == "tool" {
            match &m.tool_call_id {
                None => {
                    return Err(bad(
                        format!("{} has role tool but no {}", (n.item)(i), n.id),
                        n.param,
                    ))
                }
                Some(id) if !called.contains(id) => {
                    return Err(bad(
                        format!(
                            "{} answers {} {id:?}, which no earlier {} called",
                            (n.item)(i),
                            n.id,
                            n.call
                        ),
                        n.param,
                    ))
                }
                Some(_) => {}
            }
        }
    }
    Ok(())
}

/// A cache breakpoint in a conversation: (message index, byte offset in its content, what it carries).
/// [`END_OF_CONTENT`] as the offset: the end of the message as the prompt writes it.
pub type Breakpoint<T> = (usize, usize, T);

/// A breakpoint offset meaning "the end of the message as written" (after its calls).
pub const END_OF_CONTENT: usize = usize::MAX;

/// The messages as the prompt writes them, for a template with no tools section: the tools described
/// at the start of the system message (one is added when there is none; tools come first, as Anthropic
/// caches them: tools, then system, then messages), an assistant turn's calls written after its text as
/// the fallback format writes them, and each run of `tool` results one user turn of `<tool_response>`
/// blocks (templates that insist on alternating roles accept it).
pub fn fallback_messages(messages: Vec<ChatMessage>, tools: Option<&ToolPlan>) -> Vec<ChatMessage> {
    fallback_messages_marked::<()>(messages, tools, &[], &[]).0
}

/// [`fallback_messages`], with breakpoints moved to where their text went: `breakpoints` on the
/// messages, `tool_marks` after a tool's definition (tool index).
pub fn fallback_messages_marked<T: Copy>(
    messages: Vec<ChatMessage>,
    tools: Option<&ToolPlan>,
    breakpoints: &[Breakpoint<T>],
    tool_marks: &[(usize, T)],
) -> (Vec<ChatMessage>, Vec<Breakpoint<T>>) {
    // Per input message: its index in the output and where its content starts there.
    let mut place: Vec<(usize, usize)> = Vec::with_capacity(messages.len());
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    let mut marks = Vec::new();
    let mut messages = messages.into_iter().peekable();
    if let Some(plan) = tools {
        let (text, ends) = kura_guide::tools::fallback_system_text_marked(&plan.tools);
        for &(i, t) in tool_marks {
            if let Some(&end) = ends.get(i) {
                marks.push((0, end, t));
            }
        }
        match messages.peek() {
            Some(m) if m.role == "system" => {
                let m = messages.next().unwrap_or_default();
                let content = if m.content.is_empty() {
                    text
                } else {
                    format!("{text}\n\n{}", m.content)
                };
                place.push((0, content.len() - m.content.len()));
                out.push(ChatMessage::new("system", content));
            }
            _ => out.push(ChatMessage::new("system", text)),
        }
    }
    // Whether the last output message is a turn of tool results (the next result joins it).
    let mut results_turn = false;
    for m in messages {
        if m.role == "tool" {
            let open = "<tool_response>\n";
            let block = fallback_tool_response(&m.content);
            let last = out.len().saturating_sub(1);
            match out.last_mut() {
                Some(prev) if results_turn => {
                    prev.content.push('\n');
                    place.push((last, prev.content.len() + open.len()));
                    prev.content.push_str(&block);
                }
                _ => {
                    place.push((out.len(), open.len()));
                    out.push(ChatMessage::new("user", block));
                    results_turn = true;
                }
            }
            continue;
        }
        results_turn = false;
        place.push((out.len(), 0));
        let calls = calls_of(&m);
        if calls.is_empty() {
            out.push(ChatMessage::new(m.role, m.content));
        } else {
            let written = ToolFormat::Fallback.write_calls(&calls);
            let content = if m.content.is_empty() {
                written
            } else {
                format!("{}\n{written}", m.content)
            };
            out.push(ChatMessage::new(m.role, content));
        }
    }
    // Where each input message's written text ends in its output message.
    let ends: Vec<usize> = (0..place.len())
        .map(|i| {
            let (at, _) = place[i];
            match place.get(i + 1) {
                // The next input message shares the output message (tool results): this one ends
                // where the next block opens.
                Some(&(next_at, next_start)) if next_at == at => {
                    next_start - "<tool_response>\n".len() - 1
                }
                _ => out[at].content.len(),
            }
        })
        .collect();
    for &(i, offset, t) in breakpoints {
        let Some(&(at, start)) = place.get(i) else {
            continue;
        };
        let end = ends[i];
        let offset = if offset == END_OF_CONTENT {
            end
        } else {
            (start + offset).min(end)
        };
        marks.push((at, offset, t));
    }
    (out, marks)
}

/// How the served model's chat template writes tool calls, and whether it writes tools itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolStyle {
    pub format: ToolFormat,
    /// The template has a tools section: tools and tool turns are the template's to render.
    pub native: bool,
    /// The control token a call starts with where the vocabulary has one (Mistral's
    /// `[TOOL_CALLS]`): grammars let the model write it.
    pub call_token: Option<u32>,
}

impl ToolStyle {
    pub fn of(codec: &dyn TextCodec) -> Self {
        let source = codec.chat_template_source();
        let format = ToolFormat::detect(source);
        let call_token = format.call_tag().and_then(|tag| {
            match codec.encode_without_added(tag).ok()?.as_slice() {
                [id] if codec.is_special(*id) => Some(*id),
                _ => None,
            }
        });
        ToolStyle {
            format,
            native: format != ToolFormat::Fallback && source.contains("tools"),
            call_token,
        }
    }
}

/// A conversation's messages and breakpoints as the prompt writes them for `style`, and the tools the
/// template itself reads (a template with a tools section; its breakpoints on tools end with the first
/// message, where such templates write them).
pub fn prompt_messages<T: Copy>(
    messages: Vec<ChatMessage>,
    tools: Option<&ToolPlan>,
    style: ToolStyle,
    breakpoints: &[Breakpoint<T>],
    tool_marks: &[(usize, T)],
) -> (Vec<ChatMessage>, Vec<Breakpoint<T>>, Option<Value>) {
    if style.native {
        let messages = native_messages(messages);
        let mut marks: Vec<Breakpoint<T>> = tool_marks
            .iter()
            .map(|&(_, t)| (0, END_OF_CONTENT, t))
            .collect();
        marks.extend_from_slice(breakpoints);
        let marks = marks
            .into_iter()
            .map(|(i, o, t)| {
                let len = messages.get(i).map_or(0, |m| m.content.len());
                (i, o.min(len), t)
            })
            .collect();
        (messages, marks, tools.map(ToolPlan::openai_json))
    } else {
        let (messages, marks) = fallback_messages_marked(messages, tools, breakpoints, tool_marks);
        (messages, marks, None)
    }
}

/// The prompt tokens of a chat request's messages and tools, as the server computes them (and a
/// router, to find the prompt's blocks).
pub fn encode_chat_prompt(
    codec: &dyn TextCodec,
    messages: Vec<ChatMessage>,
    tools: Option<&ToolPlan>,
) -> Result<Vec<u32>, ApiError> {
    encode_chat_as(codec, messages, tools, false)
}

/// [`encode_chat_prompt`] of a conversation whose last message, an assistant's, the model continues
/// (vLLM's `continue_final_message`, Anthropic's prefill).
pub fn encode_chat_continuing(
    codec: &dyn TextCodec,
    messages: Vec<ChatMessage>,
    tools: Option<&ToolPlan>,
) -> Result<Vec<u32>, ApiError> {
    encode_chat_as(codec, messages, tools, true)
}

fn encode_chat_as(
    codec: &dyn TextCodec,
    messages: Vec<ChatMessage>,
    tools: Option<&ToolPlan>,
    continuing: bool,
) -> Result<Vec<u32>, ApiError> {
    let (messages, _, tools_json) =
        prompt_messages::<()>(messages, tools, ToolStyle::of(codec), &[], &[]);
    match (continuing, tools_json) {
        (true, tools) => codec.encode_chat_continuing(&messages, tools.as_ref()),
        (false, Some(t)) => codec.encode_chat_with_tools(&messages, &t),
        (false, None) => codec.encode_chat(&messages),
    }
    .map_err(crate::validate::template_error)
}

/// How many of `prompt`'s tokens hold the earlier turns of the conversation — every message up to
/// the last assistant turn — as [`encode_chat_prompt`] writes them (0 when there is no earlier turn).
/// A prompt that differs from the cached one inside them had its history written differently.
pub fn history_tokens(
    codec: &dyn TextCodec,
    messages: &[ChatMessage],
    tools: Option<&ToolPlan>,
    prompt: &[u32],
) -> usize {
    let Some(last) = messages.iter().rposition(|m| m.role == "assistant") else {
        return 0;
    };
    match encode_chat_prompt(codec, messages[..=last].to_vec(), tools) {
        Ok(history) => crate::cache_control::lcp(&history, prompt),
        Err(_) => 0,
    }
}

/// The messages for a template that has a tools section: as they are, less Kura's own bookkeeping.
pub fn native_messages(messages: Vec<ChatMessage>) -> Vec<ChatMessage> {
    messages
        .into_iter()
        .map(|mut m| {
            if let Some(Value::Array(calls)) = &mut m.tool_calls {
                for c in calls {
                    if let Some(o) = c.as_object_mut() {
                        o.remove("raw_arguments");
                    }
                }
            }
            m
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of one control token (id 7, `[TOOL_CALLS]` where `control`) and bytes otherwise,
    /// with a template of its own.
    struct Vocab {
        template: &'static str,
        control: bool,
    }

    impl TextCodec for Vocab {
        fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
            Ok(match text {
                "[TOOL_CALLS]" if self.control => vec![7],
                _ => text.bytes().map(|b| 256 + u32::from(b)).collect(),
            })
        }
        fn decode(&self, _: &[u32]) -> String {
            String::new()
        }
        fn token_bytes(&self, _: u32) -> Vec<u8> {
            Vec::new()
        }
        fn render_chat(&self, _: &[ChatMessage]) -> Result<String, String> {
            Err("none".into())
        }
        fn encode_chat(&self, _: &[ChatMessage]) -> Result<Vec<u32>, String> {
            Err("none".into())
        }
        fn chat_content_spans(
            &self,
            _: &str,
            _: usize,
            _: &[ChatMessage],
        ) -> Result<Vec<std::ops::Range<usize>>, String> {
            Ok(Vec::new())
        }
        fn encode_with_plain_spans(
            &self,
            text: &str,
            _: &[std::ops::Range<usize>],
        ) -> Result<Vec<u32>, String> {
            self.encode(text)
        }
        fn eos_token_ids(&self) -> &[u32] {
            &[0]
        }
        fn vocab_size(&self) -> usize {
            512
        }
        fn is_special(&self, id: u32) -> bool {
            id == 7
        }
        fn chat_template_source(&self) -> &str {
            self.template
        }
    }

    #[test]
    fn a_call_token_is_found_where_the_vocabulary_has_the_formats_control_token() {
        let mistral = "{% for tool in tools %}{% endfor %}[TOOL_CALLS]";
        let style = |template, control| ToolStyle::of(&Vocab { template, control });
        let s = style(mistral, true);
        assert_eq!((s.format, s.call_token), (ToolFormat::Mistral, Some(7)));
        // Spelt in ordinary tokens: no control token to let the model write.
        assert_eq!(style(mistral, false).call_token, None);
        // Hermes writes its tag as text: none either.
        let hermes = "{% if tools %}<tool_call>{% endif %}";
        assert_eq!(style(hermes, true).call_token, None);
    }

    fn plan(tools: Value, choice: Option<Value>) -> Result<Option<ToolPlan>, ApiError> {
        openai_tools(Some(&tools), choice.as_ref(), None)
    }

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
    }

    #[test]
    fn choices_read_and_constrain() {
        let p = plan(weather(), None).unwrap().unwrap();
        assert_eq!(p.choice, ToolChoice::Auto);
        assert!(p.constrained().is_none() && p.parallel);
        let p = plan(weather(), Some(json!("required"))).unwrap().unwrap();
        assert_eq!(p.constrained().unwrap().len(), 1);
        let p = plan(
            weather(),
            Some(json!({"type": "function", "function": {"name": "get_weather"}})),
        )
        .unwrap()
        .unwrap();
        assert_eq!(p.choice, ToolChoice::Named("get_weather".into()));
        assert!(openai_tools(None, Some(&json!("none")), None)
            .unwrap()
            .is_none());
    }

    #[test]
    fn bad_tools_are_named() {
        for (tools, choice, words) in [
            (
                json!([{"type": "function", "function": {}}]),
                None,
                "has no name",
            ),
            (
                json!([{"type": "function", "function": {"name": "a b"}}]),
                None,
                "1 to 64 letters",
            ),
            (
                json!([{"type": "web_search"}]),
                None,
                "must be \"function\"",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]),
                None,
                "JSON schema object",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
                None,
                "must describe a JSON object",
            ),
            (
                weather(),
                Some(json!({"type": "function", "function": {"name": "nope"}})),
                "not among",
            ),
            (json!([]), Some(json!("required")), "has no tools"),
            (weather(), Some(json!("sometimes")), "got \"sometimes\""),
            (
                json!([{"type": "function", "function": {"name": "f"}},
                       {"type": "function", "function": {"name": "f"}}]),
                None,
                "unique",
            ),
        ] {
            let e = plan(tools.clone(), choice).unwrap_err().to_string();
            assert!(e.contains(words), "{tools}: {e}");
        }
    }

    fn assistant_call(id: &str, name: &str, args: &str) -> ChatMessage {
        ChatMessage {
            role: "assistant".into(),
            content: String::new(),
            tool_calls: Some(json!([template_call(id, name, args, None)])),
            ..Default::default()
        }
    }

    fn tool_result(id: &str, text: &str) -> ChatMessage {
        ChatMessage {
            role: "tool".into(),
            content: text.into(),
            tool_call_id: Some(id.into()),
            ..Default::default()
        }
    }

    #[test]
    fn tool_results_must_answer_a_call() {
        let msgs = vec![
            ChatMessage::new("user", "hi"),
            assistant_call("c1", "f", "{}"),
            tool_result("c1", "ok"),
        ];
        assert!(check_tool_turns(&msgs).is_ok());
        let e = check_tool_turns(&[ChatMessage::new("user", "hi"), tool_result("c9", "x")])
            .unwrap_err();
        assert!(e.to_string().contains("no earlier assistant"), "{e}");
    }

    #[test]
    fn the_fallback_writes_calls_as_they_were_generated() {
        let p = plan(weather(), Some(json!("required"))).unwrap().unwrap();
        let args = r#"{"city": "Paris"}"#;
        let msgs = fallback_messages(
            vec![
                ChatMessage::new("user", "Weather?"),
                assistant_call("c1", "get_weather", args),
                tool_result("c1", "sunny"),
                tool_result("c1", "warm"),
            ],
            Some(&p),
        );
        assert_eq!(msgs[0].role, "system");
        assert!(msgs[0].content.contains("get_weather"));
        assert!(msgs
            .iter()
            .all(|m| m.tool_calls.is_none() && m.tool_call_id.is_none()));
        // The assistant turn holds exactly the text a constrained call generates.
        let generated = ToolFormat::Fallback.write_calls(&[ParsedCall {
            name: "get_weather".into(),
            arguments: args.into(),
        }]);
        assert_eq!(msgs[2].content, generated);
        // Both results in one user turn.
        assert_eq!(msgs.len(), 4);
        assert_eq!(msgs[3].role, "user");
        assert!(msgs[3].content.contains("sunny") && msgs[3].content.contains("warm"));
        assert!(msgs
            .iter()
            .all(|m| m.tool_calls.is_none() && m.tool_call_id.is_none()));
    }

    #[test]
    fn breakpoints_follow_their_text_into_the_fallback() {
        let p = plan(weather(), None).unwrap().unwrap();
        let msgs = vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Weather?"),
            assistant_call("c1", "get_weather", r#"{"city": "Oslo"}"#),
            tool_result("c1", "sunny"),
            tool_result("c1", "warm"),
        ];
        let (out, marks) = fallback_messages_marked(
            msgs,
            Some(&p),
            &[
                (0, 3, 'a'),
                (1, 8, 'b'),
                (2, END_OF_CONTENT, 'c'),
                (3, END_OF_CONTENT, 'd'),
                (4, 2, 'e'),
            ],
            &[(0, 't')],
        );
        let at = |m: (usize, usize, char)| &out[m.0].content[..m.1];
        // The tool's line ends with its definition; the system text comes after the tools.
        assert!(at(marks[0]).ends_with("}}"), "{:?}", at(marks[0]));
        assert!(!at(marks[0]).contains("Be brief"));
        assert!(at(marks[1]).ends_with("Be "), "{:?}", at(marks[1]));
        assert_eq!(at(marks[2]), "Weather?");
        assert!(at(marks[3]).ends_with("</tool_call>"));
        assert!(
            at(marks[4]).ends_with("sunny\n</tool_response>"),
            "{:?}",
            at(marks[4])
        );
        assert!(
            at(marks[5]).ends_with("<tool_response>\nwa"),
            "{:?}",
            at(marks[5])
        );
    }
}
