//! The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end.

mod common;

use kura_model::{LoadOptions, Model, WeightsDtype};

#[test]
fn capital_of_france_is_paris() {
    for dtype in [WeightsDtype::F32, WeightsDtype::Bf16] {
        let model = Model::load_with(
            &common::default_model_path(),
            LoadOptions {
                weights_dtype: dtype,
            },
        )
        .unwrap();
        let tok = model.tokenizer();
        let prompt = tok.encode("The capital of France is", true).unwrap();
        let (out, _) = common::greedy(&model, &prompt, 1, 16, true);
        assert_eq!(tok.decode(&out, false).unwrap(), " Paris", "{dtype:?}");
    }
}

#[test]
fn incremental_detokenization_streams_the_same_text() {
    let model = Model::load(&common::default_model_path()).unwrap();
    let tok = model.tokenizer();
    // Multi-byte characters split across byte-level tokens must be held back, never emitted broken.
    let text = "Héllo, wörld! 🙂 Ünïcode — ok? 日本語のテキスト";
    let ids = tok.encode(text, false).unwrap();
    let mut dec = kura_model::IncrementalDecoder::new();
    let mut streamed = String::new();
    for id in &ids {
        let piece = dec.push(tok, *id).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "broken character in {piece:?}");
        streamed.push_str(&piece);
    }
    streamed.push_str(&dec.flush(tok).unwrap());
    assert_eq!(streamed, text);
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}
