//! GGUF metadata read as the keys of an HF config, so that one parser serves both; its errors name the
//! GGUF keys. The caller (kura-model's GGUF parser) supplies the values: it decides what a per-layer array
//! means (the planner takes its largest element, the runtime refuses it).

use serde_json::{json, Map, Value};

use crate::spec::{ModelSpec, SpecError};

/// What the shape reader needs of a GGUF file.
pub struct GgufMetadata<'a> {
    /// `general.architecture`.
    pub arch: &'a str,
    /// The value of a numeric key (full name, `llama.block_count`); `Ok(None)` when absent, an error
    /// naming the key when it has another type.
    pub number: &'a dyn Fn(&str) -> Result<Option<u64>, String>,
    /// Length of `tokenizer.ggml.tokens`, for files without `<arch>.vocab_size`.
    pub token_count: Option<usize>,
    /// Whether the file holds `output.weight` (else the output head is the tied embedding).
    pub has_output_weight: bool,
    /// Parameters, the sum of the tensors' element counts, when known.
    pub num_parameters: Option<u64>,
}

/// Each HF key and the GGUF key it is read from (after `<arch>.`).
pub const GGUF_TO_HF: &[(&str, &str)] = &[
    ("num_hidden_layers", "block_count"),
    ("hidden_size", "embedding_length"),
    ("num_attention_heads", "attention.head_count"),
    ("num_key_value_heads", "attention.head_count_kv"),
    ("head_dim", "attention.key_length"),
    ("intermediate_size", "feed_forward_length"),
    ("max_position_embeddings", "context_length"),
    ("vocab_size", "vocab_size"),
    ("sliding_window", "attention.sliding_window"),
    ("num_local_experts", "expert_count"),
    ("num_experts_per_tok", "expert_used_count"),
    ("moe_intermediate_size", "expert_feed_forward_length"),
    ("kv_lora_rank", "attention.kv_lora_rank"),
    ("qk_rope_head_dim", "rope.dimension_count"),
];

impl ModelSpec {
    /// The shape a GGUF's metadata describes. A GGUF's sliding window applies to every layer (llama.cpp
    /// reads it so), Qwen2's included.
    pub fn from_gguf(meta: &GgufMetadata<'_>, name: &str, source: &str) -> Result<Self, SpecError> {
        let arch = meta.arch;
        let mut cfg = Map::new();
        cfg.insert("model_type".into(), json!(arch));
        for (hf, gguf) in GGUF_TO_HF {
            let key = format!("{arch}.{gguf}");
            if let Some(v) = (meta.number)(&key).map_err(SpecError::Gguf)? {
                cfg.insert((*hf).into(), json!(v));
            }
        }
        if arch.starts_with("qwen") && cfg.contains_key("sliding_window") {
            cfg.insert("use_sliding_window".into(), json!(true));
            cfg.insert("max_window_layers".into(), json!(0));
        }
        if !cfg.contains_key("vocab_size") {
            if let Some(n) = meta.token_count {
                cfg.insert("vocab_size".into(), json!(n));
            }
        }
        cfg.insert("tie_word_embeddings".into(), json!(!meta.has_output_weight));
        if let Some(p) = meta.num_parameters {
            cfg.insert("num_parameters".into(), json!(p));
        }
        ModelSpec::from_hf_config(&Value::Object(cfg), name, source)
            .map_err(|e| gguf_error(e, arch))
    }
}

/// The error of the HF reader with its keys renamed to the GGUF keys they came from.
fn gguf_error(e: SpecError, arch: &str) -> SpecError {
    let mut msg = e.to_string();
    for (hf, gguf) in GGUF_TO_HF {
        msg = replace_word(&msg, hf, &format!("{arch}.{gguf}"));
    }
    if let Some(rest) = msg.strip_prefix("config: ") {
        msg = rest.to_string();
    } else if let Some(rest) = msg.strip_prefix("config ") {
        msg = rest.to_string();
    }
    SpecError::Gguf(format!("GGUF metadata: {msg}"))
}

/// `text` with every whole occurrence of the identifier `from` (not part of a longer identifier) replaced.
fn replace_word(text: &str, from: &str, to: &str) -> String {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.';
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(from) {
        let before = rest[..i].chars().next_back();
        let after = rest[i + from.len()..].chars().next();
        out.push_str(&rest[..i]);
        if before.is_some_and(ident) || after.is_some_and(ident) {
            out.push_str(from);
        } else {
            out.push_str(to);
        }
        rest = &rest[i + from.len()..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta<'a>(
        arch: &'a str,
        number: &'a dyn Fn(&str) -> Result<Option<u64>, String>,
    ) -> GgufMetadata<'a> {
        GgufMetadata {
            arch,
            number,
            token_count: Some(32),
            has_output_weight: false,
            num_parameters: None,
        }
    }

    #[test]
    fn gguf_keys_read_as_a_config_and_errors_name_them() {
        let llama = |k: &str| -> Result<Option<u64>, String> {
            Ok(match k {
                "llama.block_count" => Some(2),
                "llama.embedding_length" => Some(64),
                "llama.attention.head_count" => Some(4),
                "llama.attention.head_count_kv" => Some(2),
                "llama.feed_forward_length" => Some(128),
                "llama.context_length" => Some(256),
                _ => None,
            })
        };
        let spec = ModelSpec::from_gguf(&meta("llama", &llama), "m", "f.gguf").unwrap();
        assert_eq!(
            (
                spec.num_layers,
                spec.num_kv_heads,
                spec.head_dim,
                spec.vocab_size
            ),
            (2, 2, 16, 32)
        );
        assert!(spec.tied_embeddings);

        let bad = |k: &str| -> Result<Option<u64>, String> {
            Ok(match k {
                "llama.attention.head_count_kv" => Some(8),
                other => llama(other)?,
            })
        };
        let err = ModelSpec::from_gguf(&meta("llama", &bad), "m", "f.gguf")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "llama.attention.head_count_kv (8) exceeds llama.attention.head_count (4)"
            ),
            "{err}"
        );
        let missing = |k: &str| -> Result<Option<u64>, String> {
            if k == "llama.block_count" {
                Ok(None)
            } else {
                llama(k)
            }
        };
        let err = ModelSpec::from_gguf(&meta("llama", &missing), "m", "f.gguf")
            .unwrap_err()
            .to_string();
        assert!(err.contains("'llama.block_count'"), "{err}");
        let typed = |k: &str| -> Result<Option<u64>, String> {
            if k == "llama.block_count" {
                Err("llama.block_count is a string, not a number".into())
            } else {
                llama(k)
            }
        };
        let err = ModelSpec::from_gguf(&meta("llama", &typed), "m", "f.gguf")
            .unwrap_err()
            .to_string();
        assert!(err.contains("llama.block_count is a string"), "{err}");
    }

    #[test]
    fn whole_words_only() {
        assert_eq!(
            replace_word("head_dim and qk_rope_head_dim", "head_dim", "X"),
            "X and qk_rope_head_dim"
        );
    }
}
