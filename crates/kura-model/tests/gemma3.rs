//! Gemma 3 270M (Q4_K_M GGUF, `$KURA_GEMMA_MODEL`, fetched by scripts/fetch-gemma.sh) against HF
//! transformers (float32, eager attention, the same GGUF dequantized) and the published Gemma 3 tokenizer:
//! token ids and the chat template exactly, last-position logits within [`LOGIT_TOL`] and 16 greedy tokens exactly, for a chat prompt, a
//! plain text and a 700-token prompt that outruns the 512-token window of the sliding layers. The vectors
//! come from scripts/golden/make_gemma3.py.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use common::{ids, logit_diff};
use kura_kv::codec::KvDtype;
use kura_model::{ChatMessage, LoadOptions, Model, SeqBatchItem, WeightsDtype};
use serde_json::Value;

/// f32 weights and f32 KV against the f32 reference: the logits (magnitudes up to ~30) agree to this
/// bound; the differences are f32 rounding of sums taken in another order over 18 layers.
const LOGIT_TOL: f32 = 2e-4;

/// The Gemma 3 GGUF. Its absence is a failure, not a skip: these tests are the runtime's only check of
/// the architecture on real weights.
fn gemma_path() -> PathBuf {
    let Some(p) = std::env::var_os("KURA_GEMMA_MODEL") else {
        panic!(
            "KURA_GEMMA_MODEL is not set: run `export KURA_GEMMA_MODEL=$(scripts/fetch-gemma.sh)` \
             (scripts/test.sh does)"
        );
    };
    let p = PathBuf::from(p);
    assert!(
        p.is_file(),
        "KURA_GEMMA_MODEL={} is not a file: run scripts/fetch-gemma.sh",
        p.display()
    );
    p
}

/// One f32 load shared by the tests of this file.
fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        Model::load_with(
            &gemma_path(),
            LoadOptions {
                weights_dtype: WeightsDtype::F32,
            },
        )
        .unwrap()
    })
}

fn golden() -> Value {
    common::golden("gemma3-270m")
}

#[test]
fn gemma3_reads_its_shape_from_the_gguf() {
    let c = model().config();
    assert_eq!(
        (
            c.num_layers(),
            c.hidden_size(),
            c.num_heads(),
            c.num_kv_heads(),
            c.head_dim()
        ),
        (18, 640, 4, 1, 256)
    );
    assert_eq!(c.vocab_size(), 262_144);
    // Every sixth layer attends to the whole context, the others to the last 512 tokens.
    let windows: Vec<Option<usize>> = (0..18).map(|i| c.layer_window(i)).collect();
    for (i, w) in windows.iter().enumerate() {
        let want = if i % 6 == 5 { None } else { Some(512) };
        assert_eq!(*w, want, "layer {i}");
    }
    assert_eq!(c.params.rope_theta, 1e6);
    assert_eq!(c.params.rope_theta_sliding, Some(10_000.0));
    // query_pre_attn_scalar is head_dim for this model: attention's own 1/√head_dim scale stands.
    assert_eq!(c.query_scale(), None);
    assert_eq!(c.embedding_scale(), Some((640f64).sqrt() as f32));
}

/// Token ids as the published tokenizer.json gives them (which transformers' tokenizer rebuilt from the
/// GGUF does not, on long runs of spaces: the golden file records where).
#[test]
fn gemma3_tokenizes_as_the_published_tokenizer() {
    let tok = model().tokenizer();
    let g = golden();
    for t in g["tokenization"].as_array().unwrap() {
        let text = t["text"].as_str().unwrap();
        let got = tok.encode(text, true).unwrap();
        assert_eq!(got, ids(&t["ids"]), "text {text:?}");
        // Decoding gives the text back, special-token markers included, after BOS.
        let back = tok.decode(&got, false).unwrap();
        assert_eq!(back.strip_prefix("<bos>"), Some(text), "round trip");
    }
    for case in g["cases"].as_array().unwrap() {
        if let Some(p) = case["prompt"].as_str() {
            assert_eq!(tok.encode(p, true).unwrap(), ids(&case["ids"]), "{p:?}");
        }
    }
    // Generation stops at the end of a turn and at EOS.
    let end_of_turn = tok.token_to_id("<end_of_turn>").unwrap();
    assert_eq!(end_of_turn, 106);
    assert!(tok.is_stop_token(end_of_turn));
    assert!(tok.is_stop_token(tok.eos_token_id.unwrap()));
    assert_eq!(tok.bos_token_id, Some(2));
}

#[test]
fn gemma3_chat_template_renders_as_transformers() {
    let m = model();
    let g = golden();
    // The GGUF carries no template: the Gemma 3 fallback is the template the reference rendered with.
    assert_eq!(
        kura_model::chat::GEMMA3,
        g["chat_template"].as_str().unwrap()
    );
    for t in g["chat_templates"].as_array().unwrap() {
        let messages: Vec<ChatMessage> = serde_json::from_value(t["messages"].clone()).unwrap();
        let text = m.chat_template().render(&messages, true).unwrap();
        assert_eq!(text, t["text"].as_str().unwrap());
        assert_eq!(m.encode_chat(&messages, true).unwrap(), ids(&t["ids"]));
    }
    let chat = &g["cases"].as_array().unwrap()[0];
    let messages: Vec<ChatMessage> = serde_json::from_value(chat["prompt"].clone()).unwrap();
    assert_eq!(m.encode_chat(&messages, true).unwrap(), ids(&chat["ids"]));
    // Roles that do not alternate are the template's error, not a panic.
    let bad = [ChatMessage::new("user", "a"), ChatMessage::new("user", "b")];
    let err = m
        .chat_template()
        .render(&bad, true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("Conversation roles must alternate"), "{err}");
}

#[test]
fn gemma3_f32_matches_transformers() {
    let m = model();
    let mut worst = 0f32;
    for case in golden()["cases"].as_array().unwrap() {
        let kind = case["kind"].as_str().unwrap();
        let prompt = ids(&case["ids"]);
        let want = ids(&case["greedy"]);
        let (got, logits) = common::greedy(m, &prompt, want.len(), 16, true);
        let diff = logit_diff(&logits, &case["logits"]);
        eprintln!(
            "gemma3 {kind}: prompt of {} tokens, max |Δlogit| = {diff:.2e}",
            prompt.len()
        );
        assert!(diff <= LOGIT_TOL, "{kind}: logits differ by {diff}");
        assert_eq!(got, want, "{kind}: greedy tokens");
        worst = worst.max(diff);
    }
    eprintln!("gemma3: worst max |Δlogit| = {worst:.2e} (bound {LOGIT_TOL:.0e})");
}

#[test]
fn gemma3_recompute_and_cached_kv_agree() {
    // Without a KV cache every step runs the whole sequence again (the reference's own method); the
    // greedy path is the same as through the cache.
    let m = model();
    let g = golden();
    let case = &g["cases"].as_array().unwrap()[1];
    let prompt = ids(&case["ids"]);
    let (got, _) = common::greedy(m, &prompt, 16, 16, false);
    assert_eq!(got, ids(&case["greedy"]));
}

#[test]
fn gemma3_bf16_greedy_matches_reference() {
    // Kura's default bf16 weights round the dequantized values, so only the greedy paths of the short
    // prompts are compared.
    let m = Model::load(&gemma_path()).unwrap();
    let g = golden();
    for case in g["cases"].as_array().unwrap().iter().take(2) {
        let want = ids(&case["greedy"]);
        let (got, _) = common::greedy(&m, &ids(&case["ids"]), want.len(), 16, true);
        assert_eq!(got, want, "{}: bf16 greedy", case["kind"]);
    }
}

#[test]
fn gemma3_chunked_and_batched_prefill_matches_reference() {
    // The 700-token prompt in chunks of 128 (chunks that straddle the 512-token window), with the plain
    // prompt batched beside its last chunk: each sequence's logits are the reference's.
    const BLOCK: usize = 16;
    const CHUNK: usize = 128;
    let m = model();
    let g = golden();
    let cases = g["cases"].as_array().unwrap();
    let (long, plain) = (ids(&cases[2]["ids"]), ids(&cases[1]["ids"]));
    let (a_blocks, b_blocks) = (long.len().div_ceil(BLOCK), plain.len().div_ceil(BLOCK));
    let layout = m.kv_layout(KvDtype::F32, BLOCK).unwrap();
    let mut kv = m.kv_storage(&layout, a_blocks + b_blocks).unwrap();
    let table_a: Vec<u32> = (0..a_blocks as u32).collect();
    let table_b: Vec<u32> = (a_blocks as u32..(a_blocks + b_blocks) as u32).collect();
    let mut start = 0;
    let logits = loop {
        let end = (start + CHUNK).min(long.len());
        let mut batch = vec![SeqBatchItem::new(&long[start..end], start, &table_a)];
        if end == long.len() {
            batch.push(SeqBatchItem::new(&plain, 0, &table_b));
        }
        let logits = m.forward(&batch, &mut kv).unwrap();
        if end == long.len() {
            break logits;
        }
        start = end;
    };
    for (row, case) in [(0, &cases[2]), (1, &cases[1])] {
        let diff = logit_diff(logits.row(row), &case["logits"]);
        eprintln!("gemma3 chunked {}: max |Δlogit| = {diff:.2e}", case["kind"]);
        assert!(
            diff <= LOGIT_TOL,
            "{}: logits differ by {diff}",
            case["kind"]
        );
    }
}
