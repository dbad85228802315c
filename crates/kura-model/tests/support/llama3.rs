//! A tiny HF checkpoint with a Llama-3-style tokenizer, built from the `tiny-llama` test checkpoint: its
//! weights and config, a byte-level BPE `tokenizer.json` whose post-processor adds `<|begin_of_text|>`
//! (as Llama 3's does), and a `tokenizer_config.json` whose chat template writes `{{ bos_token }}` (Llama
//! 3's own template). Shared by kura-model's and kura-engine's tests through `#[path]`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

pub const BOS: &str = "<|begin_of_text|>";
pub const BOS_ID: u32 = 261;
pub const EOT_ID: u32 = 264;

/// Llama 3's chat template (without the date and tool parts of 3.1).
pub const TEMPLATE: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/// Writes the checkpoint into a fresh folder `kura-test-<name>-<pid>` under the temp dir and returns it.
/// `tiny_llama` is kura-model's `tests/data/tiny-llama`.
pub fn write_checkpoint(tiny_llama: &Path, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kura-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(tiny_llama.join(f), dir.join(f)).unwrap();
    }
    let mut tok: Value =
        serde_json::from_str(&std::fs::read_to_string(tiny_llama.join("tokenizer.json")).unwrap())
            .unwrap();
    // Ids 261..=264 become Llama 3's special tokens (the model's vocabulary has 265 rows): the last
    // merge ("a n" → 261) and the three ChatML tokens make way.
    let specials = [
        (BOS_ID, BOS),
        (262, "<|start_header_id|>"),
        (263, "<|end_header_id|>"),
        (EOT_ID, "<|eot_id|>"),
    ];
    let model = &mut tok["model"];
    let merges = model["merges"].as_array_mut().unwrap();
    merges.retain(|m| m != &json!(["a", "n"]));
    let vocab = model["vocab"].as_object_mut().unwrap();
    vocab.retain(|_, id| id.as_u64().unwrap() < u64::from(BOS_ID));
    for (id, content) in specials {
        vocab.insert(content.into(), json!(id));
    }
    tok["added_tokens"] = specials
        .iter()
        .map(|&(id, content)| {
            json!({
                "id": id, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            })
        })
        .collect();
    tok["post_processor"] = json!({
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": BOS, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}}
        ],
        "pair": [
            {"SpecialToken": {"id": BOS, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": BOS, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}}
        ],
        "special_tokens": {BOS: {"id": BOS, "ids": [BOS_ID], "tokens": [BOS]}}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    let config = json!({
        "bos_token": BOS,
        "eos_token": "<|eot_id|>",
        "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}
