//! `--speculative-config`: speculative decoding's settings as vLLM spells them, a JSON object.

use kura_engine::NgramDraft;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SpeculativeConfig {
    method: String,
    num_speculative_tokens: Option<usize>,
    prompt_lookup_min: Option<usize>,
    prompt_lookup_max: Option<usize>,
    disable_by_batch_size: Option<usize>,
}

/// Reads `--speculative-config`: `{"method": "ngram", "num_speculative_tokens": K}`, with
/// `prompt_lookup_min` and `prompt_lookup_max` (the n-grams looked up; as in vLLM, 5 and 5 when both
/// are left out, and one given sets the other) and `disable_by_batch_size` (no drafts in a step where
/// at least that many sequences decode).
pub fn parse_speculative_config(text: &str) -> Result<NgramDraft, String> {
    let c: SpeculativeConfig = serde_json::from_str(text).map_err(|e| {
        format!(
            "not a speculative configuration ({e}); expected for example \
             {{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}}"
        )
    })?;
    if c.method != "ngram" {
        return Err(format!(
            "method {:?} is not available: Kura drafts by n-gram lookup only (\"ngram\")",
            c.method
        ));
    }
    let num_tokens = c
        .num_speculative_tokens
        .ok_or("num_speculative_tokens is missing: how many draft tokens a step checks")?;
    let (min_n, max_n) = match (c.prompt_lookup_min, c.prompt_lookup_max) {
        (None, None) => (5, 5),
        (Some(n), None) | (None, Some(n)) => (n, n),
        (Some(min), Some(max)) => (min, max),
    };
    let draft = NgramDraft {
        num_tokens,
        min_n,
        max_n,
        disable_by_batch_size: c.disable_by_batch_size,
    };
    draft.check()?;
    Ok(draft)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_spellings_are_read_with_its_defaults() {
        let d = parse_speculative_config(
            r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}"#,
        )
        .unwrap();
        assert_eq!((d.num_tokens, d.min_n, d.max_n), (4, 3, 3));
        let d =
            parse_speculative_config(r#"{"method":"ngram","num_speculative_tokens":2}"#).unwrap();
        assert_eq!((d.min_n, d.max_n), (5, 5));
        let d = parse_speculative_config(
            r#"{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_min":1,"prompt_lookup_max":4}"#,
        )
        .unwrap();
        assert_eq!((d.min_n, d.max_n), (1, 4));
        assert_eq!(d.disable_by_batch_size, None);
        let d = parse_speculative_config(
            r#"{"method":"ngram","num_speculative_tokens":3,"disable_by_batch_size":8}"#,
        )
        .unwrap();
        assert_eq!(d.disable_by_batch_size, Some(8));
    }

    #[test]
    fn bad_configurations_name_what_is_wrong() {
        for (text, says) in [
            ("ngram", "not a speculative configuration"),
            (
                r#"{"method":"eagle","num_speculative_tokens":2}"#,
                "\"eagle\" is not available",
            ),
            (r#"{"method":"ngram"}"#, "num_speculative_tokens is missing"),
            (
                r#"{"method":"ngram","num_speculative_tokens":2,"disable_by_batch_size":1}"#,
                "disable_by_batch_size 1 must be at least 2",
            ),
            (
                r#"{"method":"ngram","num_speculative_tokens":2,"disable_by_batch_size":-3}"#,
                "not a speculative configuration",
            ),
            (
                r#"{"method":"ngram","num_speculative_tokens":0}"#,
                "num_speculative_tokens 0",
            ),
            (
                r#"{"method":"ngram","num_speculative_tokens":2,"draft":1}"#,
                "unknown field `draft`",
            ),
            (
                r#"{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_min":4,"prompt_lookup_max":2}"#,
                "prompt_lookup_min 4",
            ),
            (
                r#"{"method":"ngram","num_speculative_tokens":-1}"#,
                "not a speculative",
            ),
        ] {
            let e = parse_speculative_config(text).unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
