//! `kura-guide` — what a request's output must look like, as token masks: structured outputs (a JSON
//! schema, any JSON object, a regex, a Lark grammar, a choice of strings) and constrained tool calls,
//! compiled by llguidance over the served model's own vocabulary ([`Guides`]), and the tool-call text
//! formats of model families ([`tools`]).
//!
//! Compiling needs the `compile` feature (llguidance); the formats and request types do not, so a
//! front end (the router) parses requests without linking llguidance.
//!
//! A request's grammar is compiled once, when it arrives ([`Guides::compile`]: a grammar llguidance
//! refuses is the client's error, named); each choice then walks its own copy
//! ([`kura_request::TokenConstraint`]), one mask per sampled token, on the engine thread.

#[cfg(feature = "compile")]
mod compile;
pub mod tools;

#[cfg(feature = "compile")]
pub use compile::{Compiled, Guides};
use serde_json::{json, Value};

/// What a request's output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Guide {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under this schema (`json_schema`).
    JsonSchema(Value),
    /// Text matching this regex, whole.
    Regex(String),
    /// Text of this Lark grammar (llguidance's dialect: `%json {..}` embeds a schema).
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A reasoning model's reasoning, free text up to `</think>`, then `answer` (after white space):
    /// from the output's start when the prompt ends inside the reasoning (`open`), else after the
    /// `<think>` the output may start with (or `answer` at once), as vLLM starts an output's grammar
    /// after the reasoning. With a `budget`, the reasoning is closed once it has that many tokens.
    AfterThinking {
        open: bool,
        budget: Option<u32>,
        answer: Box<Guide>,
    },
}

/// What opens a reasoning model's reasoning.
pub const THINK_OPEN: &str = "<think>";
/// What closes it.
pub const THINK_CLOSE: &str = "</think>";

/// The most bytes of grammar source one request may give (a schema's JSON, a regex, a Lark grammar,
/// a choice's strings, the grammar of its tool calls): llguidance builds about twenty times a grammar's
/// source in memory before its own limits may refuse it.
pub const MAX_SOURCE_BYTES: usize = 1 << 20;

impl Guide {
    /// The bytes of this guide's source, as [`MAX_SOURCE_BYTES`] counts them.
    pub fn source_bytes(&self) -> usize {
        match self {
            Guide::JsonObject => 0,
            Guide::JsonSchema(schema) => serde_json::to_string(schema).map_or(0, |s| s.len()),
            Guide::Regex(s) | Guide::Lark(s) => s.len(),
            Guide::Choice(options) => options
                .iter()
                .fold(0usize, |n, o| n.saturating_add(o.len()).saturating_add(1)),
            Guide::AfterThinking { answer, .. } => answer.source_bytes(),
        }
    }

    /// This guide after a reasoning model's reasoning ([`Guide::AfterThinking`]) of at most `budget`
    /// tokens, where given.
    pub fn after_thinking(self, open: bool, budget: Option<u32>) -> Guide {
        Guide::AfterThinking {
            open,
            budget,
            answer: Box::new(self),
        }
    }
}

/// How JSON is written under a schema: one space after `:` and `,`, no other whitespace, so that a
/// model cannot spend its tokens on blanks and the text is the same each time (a tool call's text is
/// rendered back into the next turn's prompt as it was generated).
pub fn json_options() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `schema` with Kura's JSON layout ([`json_options`]) in llguidance's `x-guidance` key (a schema's own
/// `x-guidance` is replaced: the layout is the server's).
pub fn with_layout(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(map) = &mut schema {
        map.insert("x-guidance".into(), json_options());
    } else if let Value::Bool(true) = schema {
        schema = json!({"x-guidance": json_options()});
    }
    schema
}

/// A string as a Lark literal (JSON string syntax).
pub fn lark_literal(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// A regex that matches `s` literally.
pub fn regex_literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~ \t\n\r".contains(c) {
            match c {
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                _ => {
                    out.push('\\');
                    out.push(c);
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regex_literals_escape_what_a_regex_would_read() {
        assert_eq!(regex_literal("a.b"), "a\\.b");
        assert_eq!(regex_literal("x|y (z)"), "x\\|y\\ \\(z\\)");
        assert_eq!(regex_literal("line\nnext"), "line\\nnext");
    }

    #[test]
    fn a_guide_counts_the_bytes_of_its_source() {
        assert_eq!(Guide::Regex("[a-z]+".into()).source_bytes(), 6);
        assert_eq!(
            Guide::Choice(vec!["yes".into(), "no".into()]).source_bytes(),
            7
        );
        assert_eq!(
            Guide::JsonSchema(json!({"type": "integer"})).source_bytes(),
            18
        );
        assert_eq!(Guide::JsonObject.source_bytes(), 0);
    }

    #[test]
    fn the_layout_replaces_a_schemas_own() {
        let s =
            with_layout(&json!({"type": "string", "x-guidance": {"whitespace_flexible": true}}));
        assert_eq!(s["x-guidance"], json_options());
        assert_eq!(with_layout(&json!(true))["x-guidance"], json_options());
    }
}
