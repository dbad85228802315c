//! Raw OpenAI request bodies → checked engine parameters. Every check names the parameter and the
//! value it got; nothing here panics on any input.

use kura_engine::{GenerateRequest, SamplingOptions};

use crate::error::ApiError;
use crate::types::{CommonParams, MessageContent, RequestMessage, Stop};

/// Most choices one request may ask for.
pub const MAX_N: i64 = 64;
/// Most stop strings per request.
pub const MAX_STOP: usize = 16;
/// Most alternatives reported per token (OpenAI's limit).
pub const MAX_LOGPROBS: i64 = 20;

/// Everything about a request except its prompt, checked.
#[derive(Debug, Clone)]
pub struct Checked {
    /// `None`: the caller picks a default once the prompt length is known.
    pub max_tokens: Option<u32>,
    pub n: u32,
    pub sampling: SamplingOptions,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub priority: i32,
    pub cache_salt: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
}

impl Checked {
    pub fn into_request(
        self,
        prompt_tokens: Vec<u32>,
        max_tokens: u32,
        logprobs: Option<u32>,
    ) -> GenerateRequest {
        GenerateRequest {
            prompt_tokens,
            sampling: self.sampling,
            max_tokens,
            n: self.n,
            stop: self.stop,
            stop_token_ids: self.stop_token_ids,
            ignore_eos: self.ignore_eos,
            priority: self.priority,
            cache_salt: self.cache_salt,
            logprobs,
        }
    }
}

fn in_range(
    name: &'static str,
    v: Option<f32>,
    lo: f32,
    hi: f32,
    default: f32,
) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && x >= lo && x <= hi => Ok(x),
        Some(x) => Err(ApiError::invalid(
            format!("{name} must be between {lo} and {hi}, got {x}"),
            Some(name),
        )),
    }
}

/// Checks the parameters both endpoints share. `served_model` is the only accepted `model`.
pub fn check_common(
    c: &CommonParams,
    served_model: &str,
    max_tokens: Option<i64>,
    max_tokens_name: &'static str,
) -> Result<Checked, ApiError> {
    if let Some(model) = &c.model {
        if model != served_model {
            return Err(ApiError::ModelNotFound {
                requested: model.clone(),
                served: served_model.to_string(),
            });
        }
    }
    let max_tokens = match max_tokens {
        None => None,
        Some(m) if (1..=u32::MAX as i64).contains(&m) => Some(m as u32),
        Some(m) => {
            return Err(ApiError::invalid(
                format!("{max_tokens_name} must be at least 1, got {m}"),
                Some(max_tokens_name),
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
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => None,
        Some(k) if (1..=u32::MAX as i64).contains(&k) => Some(k as u32),
        Some(k) => {
            return Err(ApiError::invalid(
                format!("top_k must be -1 or 0 (disabled) or at least 1, got {k}"),
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
    if c.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err(ApiError::invalid(
            "logit_bias is not supported by this server",
            Some("logit_bias"),
        ));
    }
    if let Some(salt) = &c.cache_salt {
        if salt.is_empty() {
            return Err(ApiError::invalid(
                "cache_salt must not be empty when given",
                Some("cache_salt"),
            ));
        }
    }
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
        n,
        sampling: SamplingOptions {
            temperature,
            top_p,
            top_k,
            min_p,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            // Negative seeds are valid in OpenAI's API; any 64-bit pattern is a fine seed.
            seed: c.seed.map(|s| s as u64),
        },
        stop,
        stop_token_ids: c.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: c.ignore_eos,
        priority: c.priority.unwrap_or(0),
        cache_salt: c.cache_salt.clone(),
        stream: c.stream,
        include_usage,
    })
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

/// Chat messages → (role, text) pairs for the template; only text content parts are accepted.
pub fn flatten_messages(
    messages: &[RequestMessage],
) -> Result<Vec<kura_engine::ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages must contain at least one message",
            Some("messages"),
        ));
    }
    messages
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
            let content = match &m.content {
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
            };
            // `developer` is OpenAI's newer name for `system`; chat templates know only the latter.
            let role = if m.role == "developer" {
                "system".to_string()
            } else {
                m.role.clone()
            };
            Ok(kura_engine::ChatMessage { role, content })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn common(json: &str) -> CommonParams {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn defaults_are_neutral() {
        let c = check_common(&common("{}"), "m", None, "max_tokens").unwrap();
        assert_eq!(c.n, 1);
        assert_eq!(c.sampling, SamplingOptions::default());
        assert!(c.max_tokens.is_none());
    }

    #[test]
    fn out_of_range_values_name_the_parameter() {
        for (body, param) in [
            (r#"{"temperature": 3}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_k": -5}"#, "top_k"),
            (r#"{"n": 0}"#, "n"),
            (r#"{"presence_penalty": -2.5}"#, "presence_penalty"),
            (r#"{"stop": [""]}"#, "stop"),
        ] {
            let e = check_common(&common(body), "m", None, "max_tokens").unwrap_err();
            match e {
                ApiError::InvalidRequest { param: Some(p), .. } => assert_eq!(p, param, "{body}"),
                other => panic!("{body}: {other:?}"),
            }
        }
        assert!(matches!(
            check_common(&common("{}"), "m", Some(0), "max_tokens"),
            Err(ApiError::InvalidRequest { .. })
        ));
        assert!(matches!(
            check_common(&common(r#"{"model": "x"}"#), "m", None, "max_tokens"),
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
