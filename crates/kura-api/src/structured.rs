//! Structured outputs: the request fields that say what the output must be, checked into one
//! [`Guide`] (compiled by the server against the model's vocabulary).
//!
//! | field | output |
//! |---|---|
//! | `response_format: {"type": "text"}` | free text (the default) |
//! | `response_format: {"type": "json_object"}` | any JSON object |
//! | `response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` | JSON valid under `schema` |
//! | `structured_outputs: {"json" \| "regex" \| "choice" \| "grammar" \| "json_object"}` (vLLM's) | as named; `grammar` is Lark (llguidance's dialect) |
//! | `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM's older names) | as `structured_outputs` |
//!
//! At most one of them per request.

use kura_guide::Guide;
use serde_json::Value;

use crate::error::ApiError;
use crate::types::CommonParams;

fn bad(msg: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::invalid(msg, Some(param))
}

/// `response_format`.
fn response_format(v: &Value) -> Result<Option<Guide>, ApiError> {
    const P: &str = "response_format";
    let Some(obj) = v.as_object() else {
        return Err(bad("response_format must be an object with a type", P));
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Guide::JsonObject)),
        Some("json_schema") => {
            let Some(js) = obj.get("json_schema").and_then(Value::as_object) else {
                return Err(bad(
                    "response_format of type json_schema needs a json_schema object",
                    P,
                ));
            };
            if let Some(name) = js.get("name") {
                let ok = name.as_str().is_some_and(|n| {
                    !n.is_empty()
                        && n.len() <= 64
                        && n.chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                });
                if !ok {
                    return Err(bad(
                        "response_format.json_schema.name must be 1 to 64 letters, digits, _ or -",
                        P,
                    ));
                }
            }
            if js
                .get("strict")
                .is_some_and(|s| !s.is_boolean() && !s.is_null())
            {
                return Err(bad(
                    "response_format.json_schema.strict must be a boolean",
                    P,
                ));
            }
            match js.get("schema") {
                Some(s @ (Value::Object(_) | Value::Bool(true))) => {
                    Ok(Some(Guide::JsonSchema(s.clone())))
                }
                None => Ok(Some(Guide::JsonObject)),
                Some(_) => Err(bad(
                    "response_format.json_schema.schema must be an object",
                    P,
                )),
            }
        }
        Some(other) => Err(bad(
            format!("response_format.type must be text, json_object or json_schema, got {other:?}"),
            P,
        )),
        None => Err(bad("response_format needs a type", P)),
    }
}

/// One vLLM-style guide: `json` (a schema, as an object or as JSON text), `regex`, `choice`, `grammar`.
fn vllm_guide(kind: &str, v: &Value, param: &'static str) -> Result<Guide, ApiError> {
    match kind {
        "json" => match v {
            Value::Object(_) => Ok(Guide::JsonSchema(v.clone())),
            Value::String(s) => match serde_json::from_str::<Value>(s) {
                Ok(schema @ Value::Object(_)) => Ok(Guide::JsonSchema(schema)),
                _ => Err(bad(
                    format!("{param}: a JSON schema given as text must be a JSON object"),
                    param,
                )),
            },
            _ => Err(bad(format!("{param}: json must be a JSON schema"), param)),
        },
        "regex" => match v.as_str() {
            Some(rx) if !rx.is_empty() => Ok(Guide::Regex(rx.to_string())),
            _ => Err(bad(
                format!("{param}: regex must be a non-empty string"),
                param,
            )),
        },
        "choice" => match v.as_array() {
            Some(items) if !items.is_empty() => items
                .iter()
                .map(|i| i.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .filter(|c| c.iter().all(|s| !s.is_empty()))
                .map(Guide::Choice)
                .ok_or_else(|| {
                    bad(
                        format!("{param}: choice must be a list of non-empty strings"),
                        param,
                    )
                }),
            _ => Err(bad(
                format!("{param}: choice must be a non-empty list of strings"),
                param,
            )),
        },
        "grammar" => match v.as_str() {
            Some(g) if !g.trim().is_empty() => Ok(Guide::Lark(g.to_string())),
            _ => Err(bad(
                format!("{param}: grammar must be a Lark grammar (text)"),
                param,
            )),
        },
        "json_object" => match v {
            Value::Bool(true) => Ok(Guide::JsonObject),
            _ => Err(bad(format!("{param}: json_object must be true"), param)),
        },
        other => Err(bad(
            format!(
                "{param} has no {other:?}; this server takes json, regex, choice, grammar or \
                 json_object"
            ),
            param,
        )),
    }
}

/// The output guide a request asks for, if any, with the field that asked; an error names the field.
pub fn output_guide(c: &CommonParams) -> Result<Option<(Guide, &'static str)>, ApiError> {
    let mut found: Vec<(&'static str, Option<Guide>)> = Vec::new();
    if let Some(v) = &c.response_format {
        found.push(("response_format", response_format(v)?));
    }
    if let Some(v) = &c.structured_outputs {
        const P: &str = "structured_outputs";
        let Some(obj) = v.as_object() else {
            return Err(bad("structured_outputs must be an object", P));
        };
        let given: Vec<(&String, &Value)> = obj.iter().filter(|(_, v)| !v.is_null()).collect();
        match given.as_slice() {
            [(kind, value)] => found.push((P, Some(vllm_guide(kind, value, P)?))),
            [] => {}
            _ => {
                return Err(bad(
                    "structured_outputs must name exactly one of json, regex, choice, grammar, \
                     json_object",
                    P,
                ))
            }
        }
    }
    for (param, kind, value) in [
        ("guided_json", "json", &c.guided_json),
        ("guided_regex", "regex", &c.guided_regex),
        ("guided_choice", "choice", &c.guided_choice),
        ("guided_grammar", "grammar", &c.guided_grammar),
    ] {
        if let Some(v) = value {
            found.push((param, Some(vllm_guide(kind, v, param)?)));
        }
    }
    let mut guides = found.into_iter().filter(|(_, g)| g.is_some());
    let first = guides.next();
    if let Some((second, _)) = guides.next() {
        let (first, _) = first.unwrap_or(("", None));
        return Err(bad(
            format!("give at most one output format: {first} and {second} were both given"),
            second,
        ));
    }
    Ok(first.and_then(|(param, g)| g.map(|g| (g, param))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn guide(v: Value) -> Result<Option<Guide>, ApiError> {
        output_guide(&serde_json::from_value(v).unwrap()).map(|g| g.map(|(g, _)| g))
    }

    #[test]
    fn every_way_of_asking_reads() {
        assert_eq!(guide(json!({})).unwrap(), None);
        assert_eq!(
            guide(json!({"response_format": {"type": "text"}})).unwrap(),
            None
        );
        assert_eq!(
            guide(json!({"response_format": {"type": "json_object"}})).unwrap(),
            Some(Guide::JsonObject)
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            guide(json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": true}}}))
            .unwrap(),
            Some(Guide::JsonSchema(schema.clone()))
        );
        assert_eq!(
            guide(json!({"structured_outputs": {"regex": "[0-9]+"}})).unwrap(),
            Some(Guide::Regex("[0-9]+".into()))
        );
        assert_eq!(
            guide(json!({"guided_choice": ["yes", "no"]})).unwrap(),
            Some(Guide::Choice(vec!["yes".into(), "no".into()]))
        );
        assert_eq!(
            guide(json!({"guided_json": schema.to_string()})).unwrap(),
            Some(Guide::JsonSchema(schema))
        );
    }

    #[test]
    fn bad_formats_name_their_field() {
        for (body, param, words) in [
            (
                json!({"response_format": {"type": "yaml"}}),
                "response_format",
                "got \"yaml\"",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format",
                "needs a json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}),
                "response_format",
                "must be an object",
            ),
            (
                json!({"structured_outputs": {"xml": "x"}}),
                "structured_outputs",
                "has no \"xml\"",
            ),
            (json!({"guided_choice": []}), "guided_choice", "non-empty"),
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "guided_regex",
                "at most one",
            ),
        ] {
            match guide(body.clone()).unwrap_err() {
                ApiError::InvalidRequest {
                    message,
                    param: Some(p),
                    ..
                } => {
                    assert_eq!(p, param, "{body}");
                    assert!(message.contains(words), "{body}: {message}");
                }
                other => panic!("{body}: {other:?}"),
            }
        }
    }
}
