//! Tool calls as text. Each model family writes its calls its own way; a [`ToolFormat`] knows one way:
//! the grammar that makes a model write a valid call ([`ToolFormat::call_grammar`]), how calls read
//! back from finished text ([`ToolFormat::parse`]) and from text still streaming
//! ([`ToolFormat::parse_partial`]), and how a past turn's calls are written back into a prompt
//! ([`ToolFormat::write_calls`]).
//!
//! | format | recognised by (chat template) | a call |
//! |---|---|---|
//! | Hermes (Qwen 2.5, Hermes, …) | `<tool_call>` | `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>` |
//! | Llama 3.1+ JSON | `<\|python_tag\|>` or `ipython` | `{"name": …, "parameters": {…}}` |
//! | Mistral | `[TOOL_CALLS]` | `[TOOL_CALLS][{"name": …, "arguments": {…}}]` |
//! | Kura's fallback (any other template) | — | as Hermes; tools described in the system message |
//!
//! Calls are written with one space after `:` and `,` (the layout of [`crate::json_options`]), so the
//! text a constrained call generated and the text written back for the next turn are the same bytes,
//! and the next turn's prompt reuses the cached KV of the previous one.

use serde_json::{json, Value};

use crate::lark_literal;

mod stream;
pub use stream::{CallView, PartialStream, PartialView};

/// How a model family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    Mistral,
    /// Templates with no tools section: tools are described in the system message (see
    /// [`fallback_system_text`]) and calls are written as Hermes writes them.
    Fallback,
}

/// One function a request offers.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDef {
    pub name: String,
    pub description: Option<String>,
    /// The arguments' JSON schema (an object schema; `{"type": "object"}` when none was given).
    pub parameters: Value,
    /// The arguments must be valid under `parameters` whenever the tool is called (OpenAI's and
    /// Anthropic's `strict`), also where the model may answer instead (`tool_choice: auto`).
    pub strict: bool,
}

impl ToolDef {
    /// OpenAI's shape: `{"type": "function", "function": {"name", "description", "parameters"}}`.
    pub fn openai_json(&self) -> Value {
        let mut f = json!({"name": self.name});
        if let Some(d) = &self.description {
            f["description"] = json!(d);
        }
        f["parameters"] = self.parameters.clone();
        json!({"type": "function", "function": f})
    }
}

/// A call read back from generated text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments, as the JSON text the model wrote.
    pub arguments: String,
}

/// What streamed text holds so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Partial {
    /// Text that is surely not part of a call (a possible start of one is held back).
    pub content: String,
    pub calls: Vec<PartialCall>,
}

/// A call still being written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PartialCall {
    /// Known once its string is closed.
    pub name: Option<String>,
    /// The arguments' text so far (only ever grows as text arrives).
    pub arguments: String,
}

/// How calls are read out of one request's output: the template's format, the names of the request's
/// tools, and whether a turn may make more than one call (`parallel_tool_calls`). A call of a name the
/// request did not offer is no call (a model asked for JSON may well write an object with a `"name"`):
/// it is dropped beside offered ones, and a reply with none is text, whole. Without `parallel`, a
/// turn's first call alone is its call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallReader {
    pub format: ToolFormat,
    names: std::sync::Arc<[String]>,
    pub parallel: bool,
}

impl CallReader {
    pub fn new(
        format: ToolFormat,
        names: impl IntoIterator<Item = String>,
        parallel: bool,
    ) -> Self {
        CallReader {
            format,
            names: names.into_iter().collect(),
            parallel,
        }
    }

    /// Whether the request offered a tool of this name.
    pub fn knows(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    /// The calls in finished text and the text around them ([`ToolFormat::parse`]): those of offered
    /// tools (without `parallel`, the first call, if it is one), each with its place among the
    /// reply's calls; with none, no calls and the text, whole.
    pub fn parse_indexed(&self, text: &str) -> (String, Vec<(usize, ParsedCall)>) {
        let (content, calls) = self.format.parse(text);
        let take = if self.parallel { calls.len() } else { 1 };
        let calls: Vec<(usize, ParsedCall)> = calls
            .into_iter()
            .enumerate()
            .take(take)
            .filter(|(_, c)| self.knows(&c.name))
            .collect();
        if calls.is_empty() {
            return (text.trim().to_string(), Vec::new());
        }
        (content, calls)
    }

    /// [`CallReader::parse_indexed`]'s content and calls.
    pub fn parse(&self, text: &str) -> (String, Vec<ParsedCall>) {
        let (content, calls) = self.parse_indexed(text);
        (content, calls.into_iter().map(|(_, c)| c).collect())
    }

    /// Whether streamed call `index` (its place among the reply's calls), named `name`, goes out as a
    /// call: an offered tool's, the first without `parallel`, and in the formats whose calls are bare
    /// JSON only once its arguments key is written (`keyed`), as [`CallReader::parse`] reads them.
    pub fn streams(&self, index: usize, name: &str, keyed: bool) -> bool {
        let bare = matches!(self.format, ToolFormat::Llama3Json | ToolFormat::Mistral);
        (self.parallel || index == 0) && self.knows(name) && (keyed || !bare)
    }
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_TAG: &str = "[TOOL_CALLS]";

impl ToolFormat {
    /// The format a chat template writes calls in (see the module's table).
    pub fn detect(template: &str) -> Self {
        if template.contains(HERMES_OPEN) {
            ToolFormat::Hermes
        } else if template.contains(MISTRAL_TAG) {
            ToolFormat::Mistral
        } else if template.contains(PYTHON_TAG) || template.contains("ipython") {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Fallback
        }
    }

    /// The text of the control token a call starts with, in the formats that have one a grammar
    /// may let the model write (Mistral's).
    pub fn call_tag(self) -> Option<&'static str> {
        (self == ToolFormat::Mistral).then_some(MISTRAL_TAG)
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3Json => "llama3_json",
            ToolFormat::Mistral => "mistral",
            ToolFormat::Fallback => "kura_fallback",
        }
    }

    /// The text of one call.
    fn call_prefix(self, name: &str) -> String {
        let name = serde_json::to_string(name).unwrap_or_default();
        match self {
            ToolFormat::Hermes | ToolFormat::Fallback => {
                format!("{HERMES_OPEN}\n{{\"name\": {name}, \"arguments\": ")
            }
            ToolFormat::Llama3Json => format!("{{\"name\": {name}, \"parameters\": "),
            ToolFormat::Mistral => format!("{{\"name\": {name}, \"arguments\": "),
        }
    }

    fn call_suffix(self) -> &'static str {
        match self {
            ToolFormat::Hermes | ToolFormat::Fallback => "}\n</tool_call>",
            ToolFormat::Llama3Json | ToolFormat::Mistral => "}",
        }
    }

    /// Between two calls.
    fn separator(self) -> &'static str {
        match self {
            ToolFormat::Hermes | ToolFormat::Fallback | ToolFormat::Llama3Json => "\n",
            ToolFormat::Mistral => ", ",
        }
    }

    /// Calls written as this format writes them (`arguments` as JSON text).
    pub fn write_calls(self, calls: &[ParsedCall]) -> String {
        let body: Vec<String> = calls
            .iter()
            .map(|c| {
                format!(
                    "{}{}{}",
                    self.call_prefix(&c.name),
                    c.arguments,
                    self.call_suffix()
                )
            })
            .collect();
        let body = body.join(self.separator());
        match self {
            ToolFormat::Mistral => format!("{MISTRAL_TAG}[{body}]"),
            _ => body,
        }
    }

    /// A Lark grammar whose every sentence is one call (or, with `parallel`, one or more) of one of
    /// `tools`, its arguments valid under the tool's schema. `tag`: the id of Mistral's
    /// `[TOOL_CALLS]`, a control token a grammar cannot write as text, where the vocabulary has it:
    /// the array may follow it (as the model writes calls) or stand alone, which [`ToolFormat::parse`]
    /// reads too. Other formats have no such token.
    pub fn call_grammar(self, tools: &[ToolDef], parallel: bool, tag: Option<u32>) -> String {
        let mut g = String::new();
        let calls = if parallel {
            format!("call ({} call)*", lark_literal(self.separator()))
        } else {
            "call".to_string()
        };
        match self {
            ToolFormat::Mistral => g.push_str(&format!(
                "start: {}\"[\" {calls} \"]\"\n",
                tag.map_or(String::new(), |t| format!("<[{t}]>? "))
            )),
            _ => g.push_str(&format!("start: {calls}\n")),
        }
        let alternatives: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
        g.push_str(&format!("call: {}\n", alternatives.join(" | ")));
        for (i, t) in tools.iter().enumerate() {
            let schema = crate::with_layout(&t.parameters);
            g.push_str(&format!(
                "call_{i}: {} %json {} {}\n",
                lark_literal(&self.call_prefix(&t.name)),
                schema,
                lark_literal(self.call_suffix())
            ));
        }
        g
    }

    /// A Lark grammar whose sentences are [`ToolFormat::call_grammar`]'s calls or, instead, one JSON
    /// value valid under `schema`: a request with tools the model may call (`tool_choice: auto`) and
    /// an output format its answer follows when it calls none. Where a call is itself bare JSON
    /// (Llama 3's object, Mistral's array) the call and the answer are one JSON schema, either of
    /// the two (llguidance cannot tell a literal call prefix from a JSON value that starts at the same
    /// byte); each schema joined so keeps its own `$ref`s, moved under the whole's `$defs`. `tag`:
    /// Mistral's call token, as in [`ToolFormat::call_grammar`] (an answer does not follow it).
    pub fn call_or_json_grammar(
        self,
        tools: &[ToolDef],
        parallel: bool,
        schema: &Value,
        tag: Option<u32>,
    ) -> String {
        let key = match self {
            ToolFormat::Llama3Json => "parameters",
            _ => "arguments",
        };
        if matches!(self, ToolFormat::Hermes | ToolFormat::Fallback) {
            let calls =
                self.call_grammar(tools, parallel, None)
                    .replacen("start:", "tool_calls:", 1);
            return format!(
                "start: tool_calls | answer\nanswer: %json {}\n{calls}",
                crate::with_layout(schema)
            );
        }
        // Every schema under `$defs`, by name; the calls' and the answer's refer to theirs.
        let mut defs = serde_json::Map::new();
        let mut nest = |name: String, schema: &Value| -> Value {
            defs.insert(name.clone(), moved_refs(schema, &name));
            json!({"$ref": format!("#/$defs/{name}")})
        };
        let calls: Vec<Value> = tools
            .iter()
            .enumerate()
            .map(|(i, t)| {
                json!({"type": "object",
                       "properties": {"name": {"const": t.name},
                                      key: nest(format!("kura_tool_{i}"), &t.parameters)},
                       "required": ["name", key], "additionalProperties": false})
            })
            .collect();
        let answer = nest("kura_answer".into(), schema);
        let whole = |any_of: Vec<Value>| {
            crate::with_layout(&json!({"$defs": defs.clone(), "anyOf": any_of}))
        };
        match self {
            ToolFormat::Llama3Json => {
                let mut first = calls;
                first.push(answer);
                let first = whole(first);
                if parallel {
                    // Later calls as `call_grammar` writes them, after the first value.
                    let rest = self.call_grammar(tools, true, None);
                    let rules = rest.split_once('\n').map_or("", |(_, r)| r);
                    format!(
                        "start: first ({} call)*\nfirst: %json {first}\n{rules}",
                        lark_literal(self.separator())
                    )
                } else {
                    format!("start: %json {first}\n")
                }
            }
            _ => {
                let mut array = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
                if !parallel {
                    array["maxItems"] = json!(1);
                }
                let either = whole(vec![array.clone(), answer]);
                match tag {
                    Some(t) => format!(
                        "start: <[{t}]> %json {} | %json {either}\n",
                        whole(vec![array])
                    ),
                    None => format!("start: %json {either}\n"),
                }
            }
        }
    }

    /// A Lark grammar for `tool_choice: auto` with strict tools: an answer with no call in it, or
    /// calls of `tools` as [`ToolFormat::call_grammar`] writes them, each strict tool's arguments
    /// valid under its schema (any JSON object for a tool that is not strict). Hermes's calls (and
    /// the fallback's) may follow text, which ends at the first call's tag; the bare-JSON formats'
    /// calls are the whole output, so an answer there does not start with what a call starts with
    /// (`{` for Llama 3, `[` for Mistral, after any white space). `tag`: Mistral's call token, as in
    /// [`ToolFormat::call_grammar`].
    pub fn call_or_text_grammar(
        self,
        tools: &[ToolDef],
        parallel: bool,
        tag: Option<u32>,
    ) -> String {
        let tools: Vec<ToolDef> = tools
            .iter()
            .map(|t| ToolDef {
                parameters: if t.strict {
                    t.parameters.clone()
                } else {
                    json!({"type": "object"})
                },
                ..t.clone()
            })
            .collect();
        let calls = self
            .call_grammar(&tools, parallel, tag)
            .replacen("start:", "tool_calls:", 1);
        match self {
            ToolFormat::Hermes | ToolFormat::Fallback => {
                // The text before the calls ends with the first call's tag (a lazy lexeme: at its
                // first occurrence); the first call goes on from there.
                let open = crate::regex_literal(HERMES_OPEN);
                let rest = if parallel {
                    format!(" ({} call)*", lark_literal(self.separator()))
                } else {
                    String::new()
                };
                let mut g = format!(
                    "start: ANSWER | before first{rest}\n\
                     ANSWER: /(.|\\n)*/ & ~/(.|\\n)*{open}(.|\\n)*/\n\
                     before[lazy]: /(.|\\n)*/ {}\n",
                    lark_literal(HERMES_OPEN)
                );
                let alternatives: Vec<String> =
                    (0..tools.len()).map(|i| format!("first_{i}")).collect();
                g.push_str(&format!("first: {}\n", alternatives.join(" | ")));
                for (i, t) in tools.iter().enumerate() {
                    let prefix = self.call_prefix(&t.name);
                    let prefix = prefix.strip_prefix(HERMES_OPEN).unwrap_or(&prefix);
                    g.push_str(&format!(
                        "first_{i}: {} %json {} {}\n",
                        lark_literal(prefix),
                        crate::with_layout(&t.parameters),
                        lark_literal(self.call_suffix())
                    ));
                }
                // `call` and its alternatives, for the calls after the first.
                let rules = calls.split_once('\n').map_or("", |(_, r)| r);
                g.push_str(rules);
                g
            }
            ToolFormat::Llama3Json | ToolFormat::Mistral => {
                // What `parse` reads as calls: after white space (any, as `trim` takes it) and the
                // format's tag written as text, an object or an array.
                let (tag, first) = match self {
                    ToolFormat::Llama3Json => (PYTHON_TAG, "\\{"),
                    _ => (MISTRAL_TAG, "\\["),
                };
                let tag = crate::regex_literal(tag);
                format!(
                    "start: ANSWER | tool_calls\n\
                     ANSWER: /(.|\\n)*/ & ~/\\s*({tag}\\s*)?{first}(.|\\n)*/\n{calls}"
                )
            }
        }
    }

    /// The calls in finished text, and the text around them (trimmed). Text that does not hold
    /// well-formed calls is content, whole.
    pub fn parse(self, text: &str) -> (String, Vec<ParsedCall>) {
        let whole = || (text.trim().to_string(), Vec::new());
        match self {
            ToolFormat::Hermes | ToolFormat::Fallback => {
                let mut content = String::new();
                let mut calls = Vec::new();
                let mut rest = text;
                while let Some(at) = rest.find(HERMES_OPEN) {
                    content.push_str(&rest[..at]);
                    let body = &rest[at + HERMES_OPEN.len()..];
                    let (inner, after, closed) = match body.find(HERMES_CLOSE) {
                        Some(end) => (&body[..end], &body[end + HERMES_CLOSE.len()..], true),
                        None => (body, "", false),
                    };
                    match call_object(inner.trim()) {
                        Some(c) => calls.push(c),
                        // A last call cut off (at max_tokens) is dropped; the calls before it stand.
                        None if !closed && !calls.is_empty() => {
                            rest = "";
                            break;
                        }
                        None => return whole(),
                    }
                    rest = after;
                }
                content.push_str(rest);
                (content.trim().to_string(), calls)
            }
            ToolFormat::Llama3Json => {
                let body = text.trim();
                let body = body.strip_prefix(PYTHON_TAG).unwrap_or(body).trim();
                if !body.starts_with('{') {
                    return whole();
                }
                let mut calls = Vec::new();
                for part in split_top_level(body, &['\n', ';']) {
                    match call_object(part.trim()).filter(|_| has_arguments(part.trim())) {
                        Some(c) => calls.push(c),
                        None if calls.is_empty() => return whole(),
                        // What follows the calls is not read (as a call cut off is dropped): the
                        // calls streamed stand.
                        None => break,
                    }
                }
                (String::new(), calls)
            }
            ToolFormat::Mistral => {
                let body = text.trim();
                let body = body.strip_prefix(MISTRAL_TAG).unwrap_or(body).trim();
                if !matches!(serde_json::from_str::<Value>(body), Ok(Value::Array(_))) {
                    return whole();
                }
                let items = &body[1..body.len() - 1];
                let mut calls = Vec::new();
                for part in split_top_level(items, &[',']) {
                    match call_object(part.trim()).filter(|_| has_arguments(part.trim())) {
                        Some(c) => calls.push(c),
                        None if calls.is_empty() => return whole(),
                        None => break,
                    }
                }
                (String::new(), calls)
            }
        }
    }

    /// What text still being generated holds so far: content up to a possible call, and each call's
    /// name and arguments as far as they are written.
    pub fn parse_partial(self, text: &str) -> Partial {
        match self {
            ToolFormat::Hermes | ToolFormat::Fallback => {
                let Some(first) = text.find(HERMES_OPEN) else {
                    return Partial {
                        content: hold_back(text, HERMES_OPEN).to_string(),
                        calls: Vec::new(),
                    };
                };
                let mut calls = Vec::new();
                let mut rest = &text[first..];
                while let Some(body) = rest.strip_prefix(HERMES_OPEN) {
                    let (inner, after) = match body.find(HERMES_CLOSE) {
                        Some(end) => (&body[..end], Some(&body[end + HERMES_CLOSE.len()..])),
                        None => (body, None),
                    };
                    calls.push(partial_call(inner));
                    match after {
                        Some(a) => match a.find(HERMES_OPEN) {
                            Some(at) => rest = &a[at..],
                            None => break,
                        },
                        None => break,
                    }
                }
                Partial {
                    content: text[..first].to_string(),
                    calls,
                }
            }
            ToolFormat::Llama3Json => {
                let body = text.trim_start();
                let body = body.strip_prefix(PYTHON_TAG).unwrap_or(body).trim_start();
                if body.is_empty() || PYTHON_TAG.starts_with(body) {
                    return Partial::default();
                }
                if !body.starts_with('{') {
                    return Partial {
                        content: text.to_string(),
                        calls: Vec::new(),
                    };
                }
                Partial {
                    content: String::new(),
                    calls: split_top_level(body, &['\n', ';'])
                        .into_iter()
                        .map(partial_call)
                        .collect(),
                }
            }
            ToolFormat::Mistral => {
                let body = text.trim_start();
                let body = body.strip_prefix(MISTRAL_TAG).unwrap_or(body).trim_start();
                if body.is_empty() || MISTRAL_TAG.starts_with(body) {
                    return Partial::default();
                }
                let Some(items) = body.strip_prefix('[') else {
                    return Partial {
                        content: text.to_string(),
                        calls: Vec::new(),
                    };
                };
                Partial {
                    content: String::new(),
                    calls: split_top_level(items, &[','])
                        .into_iter()
                        .filter(|p| p.trim_start().starts_with('{'))
                        .map(partial_call)
                        .collect(),
                }
            }
        }
    }
}

/// `text` less any end of it that could be the start of `marker`.
fn hold_back<'a>(text: &'a str, marker: &str) -> &'a str {
    for keep in (1..marker.len()).rev() {
        if text.ends_with(&marker[..keep]) {
            return &text[..text.len() - keep];
        }
    }
    text
}

/// Whether a finished object names its arguments (`arguments` or `parameters`): formats whose calls
/// are bare JSON (Llama 3's, Mistral's) are told from a JSON answer by this key as well as by the name.
fn has_arguments(text: &str) -> bool {
    top_level_fields(text)
        .iter()
        .any(|f| f.key == "arguments" || f.key == "parameters")
}

/// `schema` as it reads once moved to `#/$defs/<name>` of another document: each of its local
/// `$ref`s (`#…`) points into its new place.
fn moved_refs(schema: &Value, name: &str) -> Value {
    moved_refs_in(schema, name, true)
}

/// [`moved_refs`] of `v`: a schema (`schema`), or a map of names to schemas or a value.
fn moved_refs_in(v: &Value, name: &str, schema: bool) -> Value {
    match v {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let v = match (schema, k.as_str(), v) {
                        // In a schema these hold values, not schemas.
                        (true, "const" | "enum" | "default" | "examples", v) => v.clone(),
                        (true, "$ref", Value::String(r)) if r.starts_with('#') => {
                            let rest = r[1..].trim_end_matches('/');
                            Value::String(format!("#/$defs/{name}{rest}"))
                        }
                        // Maps of names to schemas: each value is a schema.
                        (
                            true,
                            "properties" | "patternProperties" | "$defs" | "definitions"
                            | "dependentSchemas",
                            Value::Object(m),
                        ) => Value::Object(
                            m.iter()
                                .map(|(n, s)| (n.clone(), moved_refs_in(s, name, true)))
                                .collect(),
                        ),
                        _ => moved_refs_in(v, name, true),
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(
            items
                .iter()
                .map(|v| moved_refs_in(v, name, schema))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// A finished call object: `{"name": "..", "arguments"|"parameters": {..} or "<json text>"}`.
fn call_object(text: &str) -> Option<ParsedCall> {
    let v: Value = serde_json::from_str(text).ok()?;
    let fields = top_level_fields(text);
    let raw = fields
        .iter()
        .find(|f| f.key == "arguments" || f.key == "parameters")
        .and_then(|f| f.end.map(|e| &text[f.start..e]));
    let mut call = call_value(&v)?;
    if let Some(raw) = raw {
        if raw.starts_with('{') {
            // The arguments exactly as written (the text the next turn writes back).
            call.arguments = raw.to_string();
        }
    }
    Some(call)
}

fn call_value(v: &Value) -> Option<ParsedCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None => "{}".to_string(),
        Some(Value::String(s)) => {
            // Arguments written as a JSON string that holds the object.
            serde_json::from_str::<Value>(s)
                .ok()?
                .is_object()
                .then(|| s.clone())?
        }
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(_) => return None,
    };
    Some(ParsedCall { name, arguments })
}

/// A call object still being written.
fn partial_call(text: &str) -> PartialCall {
    let text = text.trim_start();
    let mut call = PartialCall::default();
    for f in top_level_fields(text) {
        match f.key.as_str() {
            "name" => {
                if let Some(end) = f.end {
                    call.name = serde_json::from_str::<String>(&text[f.start..end]).ok();
                }
            }
            "arguments" | "parameters" => {
                let value = &text[f.start..f.end.unwrap_or(text.len())];
                call.arguments = match value.starts_with('"') {
                    // A JSON string holding the object: its text, once the string ended.
                    true => f
                        .end
                        .and_then(|_| serde_json::from_str::<String>(value).ok())
                        .unwrap_or_default(),
                    false => value.to_string(),
                };
            }
            _ => {}
        }
    }
    call
}

/// A key of an object and where its value lies (`end: None` while it is still being written).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Field {
    key: String,
    start: usize,
    end: Option<usize>,
}

/// The top-level fields of the JSON object `text` starts with, as far as the text goes.
fn top_level_fields(text: &str) -> Vec<Field> {
    let b = text.as_bytes();
    let mut fields = Vec::new();
    let Some(mut i) = b.iter().position(|&c| c == b'{').map(|p| p + 1) else {
        return fields;
    };
    let skip_ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    loop {
        skip_ws(&mut i);
        if i < b.len() && b[i] == b',' {
            i += 1;
            skip_ws(&mut i);
        }
        if i >= b.len() || b[i] != b'"' {
            return fields;
        }
        let Some(key_end) = string_end(b, i) else {
            return fields;
        };
        let key = serde_json::from_str::<String>(&text[i..key_end]).unwrap_or_default();
        i = key_end;
        skip_ws(&mut i);
        if i >= b.len() || b[i] != b':' {
            return fields;
        }
        i += 1;
        skip_ws(&mut i);
        if i >= b.len() {
            return fields;
        }
        let start = i;
        let end = value_end(b, i);
        fields.push(Field { key, start, end });
        match end {
            Some(e) => i = e,
            None => return fields,
        }
    }
}

/// The end (exclusive) of the JSON string starting at `b[i] == '"'`, if it is closed.
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    while j < b.len() {
        match b[j] {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
    None
}

/// The end (exclusive) of the JSON value starting at `b[i]`, if it is complete.
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match b[i] {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            let j = b[i..]
                .iter()
                .position(|&c| c == b',' || c == b'}' || c == b']' || c.is_ascii_whitespace())?;
            Some(i + j)
        }
    }
}

/// `text` cut at the separators that lie between top-level JSON values.
fn split_top_level<'a>(text: &'a str, separators: &[char]) -> Vec<&'a str> {
    let b = text.as_bytes();
    let mut parts = Vec::new();
    let mut from = 0;
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'{' || b[i] == b'[' {
            match value_end(b, i) {
                Some(e) => i = e,
                None => break,
            }
            continue;
        }
        if separators.contains(&(b[i] as char)) {
            if !text[from..i].trim().is_empty() {
                parts.push(&text[from..i]);
            }
            from = i + 1;
        }
        i += 1;
    }
    if !text[from..].trim().is_empty() {
        parts.push(&text[from..]);
    }
    parts
}

/// The system-message text that describes `tools` to a model whose template has no tools section
/// (Kura's fallback format): the tools as JSON, one per line, and how to call them.
pub fn fallback_system_text(tools: &[ToolDef]) -> String {
    fallback_system_text_marked(tools).0
}

/// [`fallback_system_text`] and, per tool, the byte offset where its line ends (a cache breakpoint
/// on a tool ends there).
pub fn fallback_system_text_marked(tools: &[ToolDef]) -> (String, Vec<usize>) {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query. The functions \
         are listed below as JSON, one per line:\n",
    );
    let mut ends = Vec::with_capacity(tools.len());
    for t in tools {
        s.push_str(&t.openai_json().to_string());
        ends.push(s.len());
        s.push('\n');
    }
    s.push_str(
        "\nTo call a function, write for each call:\n<tool_call>\n{\"name\": <function name>, \
         \"arguments\": <arguments as a JSON object>}\n</tool_call>",
    );
    (s, ends)
}

/// `v` as JSON text in Kura's layout (one space after `:` and `,`, nothing else): how a constrained
/// call writes its arguments, so that arguments given back as an object (Anthropic's `input`) are
/// written into the prompt as they were generated.
pub fn layout_json(v: &Value) -> String {
    let mut out = String::new();
    write_layout(v, &mut out);
    out
}

fn write_layout(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                write_layout(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_layout(v, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// A tool result as Kura's fallback format writes it into a user turn.
pub fn fallback_tool_response(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_takes_calls_of_the_offered_tools_only() {
        let reader = |format, parallel| CallReader::new(format, ["w".to_string()], parallel);
        // A JSON answer with a "name" is text, whole, in every format.
        let person = r#"{"name": "Alice", "age": 30}"#;
        for format in [ToolFormat::Llama3Json, ToolFormat::Hermes] {
            let text = match format {
                ToolFormat::Hermes => format!("<tool_call>\n{person}\n</tool_call>"),
                _ => person.to_string(),
            };
            assert_eq!(reader(format, true).parse(&text), (text.clone(), vec![]));
        }
        // A name offered, but no arguments key: a bare-JSON format's answer, not a call.
        let bare = r#"{"name": "w"}"#;
        assert_eq!(
            reader(ToolFormat::Llama3Json, true).parse(bare),
            (bare.to_string(), vec![])
        );
        assert_eq!(
            reader(ToolFormat::Mistral, true).parse(&format!("[{bare}]")),
            (format!("[{bare}]"), vec![])
        );
        // Two calls, one a turn: the first.
        let two = r#"{"name": "w", "parameters": {"city": "Oslo"}}
{"name": "w", "parameters": {"city": "Rome"}}"#;
        let (_, calls) = reader(ToolFormat::Llama3Json, false).parse(two);
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].arguments, r#"{"city": "Oslo"}"#);
        assert_eq!(reader(ToolFormat::Llama3Json, true).parse(two).1.len(), 2);
        // Streaming asks the same of each call as it is named.
        assert!(reader(ToolFormat::Hermes, false).streams(0, "w", false));
        assert!(!reader(ToolFormat::Hermes, false).streams(1, "w", true));
        assert!(!reader(ToolFormat::Hermes, true).streams(0, "Alice", true));
        assert!(!reader(ToolFormat::Llama3Json, true).streams(0, "w", false));
        assert!(reader(ToolFormat::Llama3Json, true).streams(0, "w", true));
        // An invented call beside an offered one: the offered one stands, at its place.
        let mixed = "<tool_call>\n{\"name\": \"x\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"w\", \"arguments\": {}}\n</tool_call>";
        let (_, calls) = reader(ToolFormat::Hermes, true).parse_indexed(mixed);
        assert_eq!(calls.len(), 1);
        assert_eq!((calls[0].0, calls[0].1.name.as_str()), (1, "w"));
        // One call a turn: the first, which is invented, so none.
        let (content, calls) = reader(ToolFormat::Hermes, false).parse(mixed);
        assert!(calls.is_empty() && content == mixed);
    }

    #[test]
    fn schemas_moved_under_defs_keep_their_references() {
        let schema = json!({"$defs": {"Example": {"type": "object"}, "enum": {"type": "string"}},
            "type": "object",
            "properties": {"examples": {"type": "array", "items": {"$ref": "#/$defs/Example"}},
                           "kind": {"$ref": "#/$defs/enum"}, "me": {"$ref": "#"}},
            "examples": [{"$ref": "#/not/a/schema"}]});
        let moved = moved_refs(&schema, "t");
        assert_eq!(
            moved["properties"]["examples"]["items"]["$ref"],
            "#/$defs/t/$defs/Example"
        );
        assert_eq!(moved["properties"]["kind"]["$ref"], "#/$defs/t/$defs/enum");
        assert_eq!(moved["properties"]["me"]["$ref"], "#/$defs/t");
        // A schema's examples are values: left as they are.
        assert_eq!(moved["examples"][0]["$ref"], "#/not/a/schema");
    }

    #[test]
    fn what_follows_bare_json_calls_is_not_read() {
        let text = "{\"name\": \"w\", \"parameters\": {}}\nLet me explain.";
        let (content, calls) = ToolFormat::Llama3Json.parse(text);
        assert_eq!((content.as_str(), calls.len()), ("", 1));
        // Text first: no call.
        let text = "Let me explain.\n{\"name\": \"w\", \"parameters\": {}}";
        assert!(ToolFormat::Llama3Json.parse(text).1.is_empty());
    }

    #[test]
    fn arguments_written_as_a_string_stream_as_the_object_they_hold() {
        let text = r#"<tool_call>
{"name": "w", "arguments": "{\"a\": 1}"}
</tool_call>"#;
        let (_, calls) = ToolFormat::Hermes.parse(text);
        assert_eq!(calls[0].arguments, r#"{"a": 1}"#);
        let mut stream = PartialStream::new(ToolFormat::Hermes);
        let mut last = String::new();
        for (i, c) in text.char_indices() {
            let view = stream.push(&text[i..i + c.len_utf8()]);
            if let Some(call) = view.calls.last() {
                // Nothing of the string before it ends, then the whole object: a prefix of the
                // finished call's arguments at every step.
                assert!(
                    calls[0].arguments.starts_with(call.arguments),
                    "{:?}",
                    call.arguments
                );
                last = call.arguments.to_string();
            }
            let partial = ToolFormat::Hermes.parse_partial(&text[..i + c.len_utf8()]);
            if let Some(call) = partial.calls.last() {
                assert!(
                    calls[0].arguments.starts_with(&call.arguments),
                    "{:?}",
                    call.arguments
                );
            }
        }
        assert_eq!(last, calls[0].arguments);
    }

    fn call(name: &str, args: &str) -> ParsedCall {
        ParsedCall {
            name: name.into(),
            arguments: args.into(),
        }
    }

    #[test]
    fn formats_are_recognised_from_templates() {
        assert_eq!(
            ToolFormat::detect("{% for tool in tools %}<tool_call>"),
            ToolFormat::Hermes
        );
        assert_eq!(
            ToolFormat::detect("[TOOL_CALLS] {{x}}"),
            ToolFormat::Mistral
        );
        assert_eq!(
            ToolFormat::detect("<|start_header_id|>ipython"),
            ToolFormat::Llama3Json
        );
        assert_eq!(ToolFormat::detect("<|im_start|>"), ToolFormat::Fallback);
    }

    #[test]
    fn written_calls_read_back_the_same_in_every_format() {
        let calls = vec![
            call("get_weather", r#"{"city": "Paris", "days": [1, 2]}"#),
            call("time", r#"{"tz": "a\"b}"}"#),
        ];
        for f in [
            ToolFormat::Hermes,
            ToolFormat::Llama3Json,
            ToolFormat::Mistral,
            ToolFormat::Fallback,
        ] {
            let text = f.write_calls(&calls);
            let (content, parsed) = f.parse(&text);
            assert_eq!(parsed, calls, "{f:?}: {text}");
            assert_eq!(content, "", "{f:?}");
            // Streamed a byte at a time, the partial reading only ever grows, and ends whole.
            let mut last = Partial::default();
            for end in (0..=text.len()).filter(|&e| text.is_char_boundary(e)) {
                let p = f.parse_partial(&text[..end]);
                assert!(p.content.starts_with(&last.content), "{f:?} at {end}");
                assert!(p.calls.len() >= last.calls.len(), "{f:?} at {end}");
                for (a, b) in last.calls.iter().zip(&p.calls) {
                    assert!(
                        b.arguments.starts_with(&a.arguments),
                        "{f:?} at {end}: {p:?}"
                    );
                    if a.name.is_some() {
                        assert_eq!(a.name, b.name);
                    }
                }
                last = p;
            }
            let names: Vec<_> = last.calls.iter().map(|c| c.name.clone().unwrap()).collect();
            assert_eq!(names, ["get_weather", "time"], "{f:?}");
            let args: Vec<_> = last.calls.iter().map(|c| c.arguments.clone()).collect();
            assert_eq!(
                args,
                [calls[0].arguments.clone(), calls[1].arguments.clone()]
            );
        }
    }

    #[test]
    fn text_around_hermes_calls_is_content_and_bad_calls_are_text() {
        let (content, calls) = ToolFormat::Hermes
            .parse("Let me look.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>");
        assert_eq!(content, "Let me look.");
        assert_eq!(calls, [call("f", "{}")]);
        // A call cut off after complete ones is dropped.
        let (content, calls) = ToolFormat::Hermes.parse(
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"na",
        );
        assert_eq!((content.as_str(), calls), ("", vec![call("f", "{}")]));
        let (content, calls) = ToolFormat::Hermes.parse("<tool_call>{\"name\": oops}</tool_call>");
        assert!(calls.is_empty());
        assert!(content.contains("oops"));
        // Arguments given as a JSON string, and Llama's `parameters`, both read.
        let (_, calls) = ToolFormat::Llama3Json
            .parse(r#"<|python_tag|>{"name": "f", "parameters": "{\"a\": 1}"}"#);
        assert_eq!(calls, [call("f", r#"{"a": 1}"#)]);
        // Plain prose is content for every format.
        for f in [ToolFormat::Llama3Json, ToolFormat::Mistral] {
            let (content, calls) = f.parse("Hello there");
            assert_eq!((content.as_str(), calls.len()), ("Hello there", 0));
        }
    }

    #[test]
    fn a_possible_start_of_a_call_is_held_back_while_streaming() {
        let p = ToolFormat::Hermes.parse_partial("Sure <tool_");
        assert_eq!(p.content, "Sure ");
        let p = ToolFormat::Hermes.parse_partial("Sure <b>");
        assert_eq!(p.content, "Sure <b>");
        let p = ToolFormat::Hermes.parse_partial("<tool_call>\n{\"name\": \"ge");
        assert_eq!(p.calls, [PartialCall::default()]);
    }

    #[test]
    fn the_layout_is_that_of_generated_calls() {
        let v: Value = serde_json::from_str(r#"{"a":[1,{"b":"x y"}],"c":null}"#).unwrap();
        assert_eq!(layout_json(&v), r#"{"a": [1, {"b": "x y"}], "c": null}"#);
    }

    #[test]
    fn grammars_name_every_tool() {
        let tools = vec![
            ToolDef {
                name: "a".into(),
                description: None,
                parameters: json!({"type": "object"}),
                strict: false,
            },
            ToolDef {
                name: "b".into(),
                description: Some("B".into()),
                parameters: json!({"type": "object", "properties": {"x": {"type": "integer"}}}),
                strict: true,
            },
        ];
        let g = ToolFormat::Hermes.call_grammar(&tools, true, None);
        assert!(g.contains("call_0") && g.contains("call_1"), "{g}");
        assert!(g.starts_with("start: call (\"\\n\" call)*"), "{g}");
        let g = ToolFormat::Mistral.call_grammar(&tools, false, None);
        assert!(g.starts_with("start: \"[\" call \"]\""), "{g}");
        let g = ToolFormat::Mistral.call_grammar(&tools, false, Some(9));
        assert!(g.starts_with("start: <[9]>? \"[\" call \"]\""), "{g}");
        assert!(fallback_system_text(&tools).contains("\"name\":\"b\""));
    }
}
