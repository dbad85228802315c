//! Kura against HF transformers (float32, eager attention): last-position logits within 1e-3 and greedy
//! tokens exactly, for the default model and tiny random Llama (llama3 RoPE scaling), Qwen2 (QKV bias,
//! tied embeddings), Mistral (sliding window) and Gemma 3 checkpoints. The vectors come from
//! scripts/golden/make_golden.py and scripts/golden/make_gemma3.py (Gemma 3, whose real model is checked
//! in tests/gemma3.rs).

mod common;

use common::{golden, ids, logit_diff};
use kura_kv::codec::KvDtype;
use kura_model::{ChatMessage, LoadOptions, Model, SoloRun, WeightsDtype};
use serde_json::Value;

const LOGIT_TOL: f32 = 1e-3;
/// bf16 weights with bf16-rounded activations in decode (8-bit mantissas): logits of magnitude ~4.
const BF16_LOGIT_TOL: f32 = 5e-2;

/// Compares logits within `tol` and, when `exact_greedy`, the greedy continuation token for token.
fn check_cases(model: &Model, g: &Value, label: &str, tol: f32, exact_greedy: bool) -> f32 {
    check_cases_in_blocks(model, g, label, tol, exact_greedy, 16)
}

fn check_cases_in_blocks(
    model: &Model,
    g: &Value,
    label: &str,
    tol: f32,
    exact_greedy: bool,
    block_size: usize,
) -> f32 {
    let mut worst = 0f32;
    for case in g["cases"].as_array().unwrap() {
        let prompt = ids(&case["ids"]);
        let want = ids(&case["greedy"]);
        let (got, logits) = common::greedy(model, &prompt, want.len(), block_size, true);
        let diff = logit_diff(&logits, &case["logits"]);
        eprintln!(
            "{label}: prompt of {} tokens, max |Δlogit| = {diff:.2e}",
            prompt.len()
        );
        assert!(diff <= tol, "{label}: logits differ by {diff}");
        if exact_greedy {
            assert_eq!(got, want, "{label}: greedy tokens for prompt {prompt:?}");
        }
        worst = worst.max(diff);
    }
    worst
}

#[test]
fn tiny_models_match_transformers() {
    for name in ["llama", "qwen2", "mistral", "qwen2-swa"] {
        let dir = common::golden_dir().join(format!("tiny-{name}"));
        // The checkpoints are stored in bf16, so f32 and bf16 compute weights hold the same values; with
        // bf16 weights, decode may round activations to bf16 (vdpbf16ps), hence the looser bound, and
        // greedy paths of random weights (near-ties) are compared exactly only in f32.
        for (dtype, tol) in [
            (WeightsDtype::F32, LOGIT_TOL),
            (WeightsDtype::Bf16, BF16_LOGIT_TOL),
        ] {
            let model = Model::load_with(
                &dir,
                LoadOptions {
                    weights_dtype: dtype,
                },
            )
            .unwrap();
            let g = golden(&format!("tiny-{name}"));
            check_cases(
                &model,
                &g,
                &format!("tiny-{name} {dtype:?}"),
                tol,
                dtype == WeightsDtype::F32,
            );
            if model.config().sliding_window().is_some() {
                // Windowed models run on the hybrid pool; in blocks of 2 tokens a window of 8 spans 5
                // blocks, so the sliding layer's pages are given back as the sequences grow.
                check_cases_in_blocks(
                    &model,
                    &g,
                    &format!("tiny-{name} {dtype:?} hybrid pool, blocks of 2"),
                    tol,
                    dtype == WeightsDtype::F32,
                    2,
                );
                let prompt = ids(&g["cases"].as_array().unwrap()[0]["ids"]);
                let mut run = SoloRun::new(&model, &prompt, 24, KvDtype::F32, 2, true).unwrap();
                assert!(run.is_hybrid(), "tiny-{name} runs on a whole-model pool");
                for _ in 0..24 {
                    let next = kura_engine::sampling::argmax(run.next_logits().unwrap().row(0));
                    run.push(next).unwrap();
                }
                run.next_logits().unwrap();
                let layers = model.config().num_layers() as u32;
                let full = (0..layers as usize)
                    .filter(|&l| model.config().layer_window(l).is_none())
                    .count() as u32;
                let blocks = run.tokens().len().div_ceil(2) as u32;
                // Full layers hold every block; sliding ones at most the 5 blocks a window of 8 overlaps.
                assert!(
                    run.pages_in_use().unwrap() <= full * blocks + (layers - full) * 5,
                    "tiny-{name}: {:?} pages in use for {blocks} blocks",
                    run.pages_in_use()
                );
            }
            // The HF tokenizer.json path encodes as the reference did.
            let text_case = &g["cases"].as_array().unwrap()[2];
            let text = text_case["prompt"].as_str().unwrap();
            assert_eq!(
                model.tokenizer().encode(text, false).unwrap(),
                ids(&text_case["ids"])
            );
        }
    }
}

#[test]
fn tiny_gemma3_matches_transformers() {
    // HF names and `1 + w` norms, a window of 8 on three of four layers (prompts of 5 and 23 tokens),
    // query_pre_attn_scalar 24 with head_dim 16, linear RoPE scaling on the full-attention layer.
    let dir = common::golden_dir().join("tiny-gemma3");
    for (dtype, tol) in [
        (WeightsDtype::F32, LOGIT_TOL),
        (WeightsDtype::Bf16, BF16_LOGIT_TOL),
    ] {
        let model = Model::load_with(
            &dir,
            LoadOptions {
                weights_dtype: dtype,
            },
        )
        .unwrap();
        let c = model.config();
        assert_eq!(c.params.rope_linear_factor, Some(4.0));
        assert_eq!(c.params.rope_theta_sliding, Some(10_000.0));
        assert!(c.query_scale().is_some());
        check_cases(
            &model,
            &golden("tiny-gemma3"),
            &format!("tiny-gemma3 {dtype:?}"),
            tol,
            dtype == WeightsDtype::F32,
        );
    }
}

#[test]
fn default_model_matches_transformers_f32() {
    let model = Model::load_with(
        &common::default_model_path(),
        LoadOptions {
            weights_dtype: WeightsDtype::F32,
        },
    )
    .unwrap();
    let g = golden("default_model");
    // The text prompts tokenize as the reference tokenizer does.
    for case in g["cases"].as_array().unwrap() {
        if let Some(p) = case["prompt"].as_str() {
            assert_eq!(
                model.tokenizer().encode(p, true).unwrap(),
                ids(&case["ids"]),
                "prompt {p:?}"
            );
        }
    }
    check_cases(&model, &g, "SmolLM2 f32", LOGIT_TOL, true);
}

#[test]
fn default_model_chat_template_matches_reference_ids() {
    let model = Model::load(&common::default_model_path()).unwrap();
    for t in golden("default_model")["chat_templates"]
        .as_array()
        .unwrap()
    {
        let messages: Vec<ChatMessage> = serde_json::from_value(t["messages"].clone()).unwrap();
        let text = model.chat_template().render(&messages, true).unwrap();
        assert_eq!(text, t["text"].as_str().unwrap());
        assert_eq!(model.encode_chat(&messages, true).unwrap(), ids(&t["ids"]));
    }
}

#[test]
fn default_model_bf16_greedy_matches_reference() {
    // bf16 weights round the dequantized values, so only the greedy path is compared (first 8 tokens).
    let model = Model::load(&common::default_model_path()).unwrap();
    for case in golden("default_model")["cases"]
        .as_array()
        .unwrap()
        .iter()
        .take(2)
    {
        let want = ids(&case["greedy"]);
        let (got, _) = common::greedy(&model, &ids(&case["ids"]), 8, 16, true);
        assert_eq!(got, want[..8], "bf16 greedy");
    }
}
