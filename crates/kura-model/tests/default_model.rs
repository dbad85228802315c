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
fn decode_gives_the_same_logits_when_products_redo_held_chunks() {
    // The redo form of the decode products (chunks computed into each thread's buffer and published by
    // whoever finishes first, as while a core is busy with another process) against chunks written in
    // place, on a team of three: every step's logits, bit for bit.
    for dtype in [WeightsDtype::Native, WeightsDtype::Bf16, WeightsDtype::F32] {
        redo_form_gives_the_same_logits(dtype);
    }
}

fn redo_form_gives_the_same_logits(dtype: WeightsDtype) {
    let model = model_in(dtype);
    let decode = || greedy_logits(&model, "A short story about a lighthouse keeper:", 12);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let in_place = pool.install(decode);
    let redone = pool.install(|| kura_model::kernels::team::with_redo_form(decode));
    assert_eq!(in_place.len(), 12);
    assert_same_bits(&in_place, &redone, &format!("{dtype:?}, the redo form"));
}

#[test]
fn every_team_size_gives_the_same_logits() {
    // A step's team size changes from one step to the next (fewer threads while a core is busy,
    // another size on trial for decode steps): the prefill and every decode step give the same bits
    // on teams of one to four.
    for dtype in [WeightsDtype::Native, WeightsDtype::Bf16, WeightsDtype::F32] {
        let model = model_in(dtype);
        let on = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| {
                    greedy_logits(
                        &model,
                        "The lighthouse keeper climbed the stairs at dusk and",
                        8,
                    )
                })
        };
        let one = on(1);
        assert_eq!(one.len(), 8);
        for threads in 2..=4 {
            assert_same_bits(&one, &on(threads), &format!("{dtype:?}, {threads} threads"));
        }
    }
}

/// The default model with its weights in `dtype`.
fn model_in(dtype: WeightsDtype) -> Model {
    Model::load_with(
        &common::default_model_path(),
        LoadOptions {
            weights_dtype: dtype,
        },
    )
    .unwrap()
}

/// The logits of `steps` greedy steps after `prompt` (f32 KV in blocks of 16): the prompt's last
/// token's, then each decoded token's.
fn greedy_logits(model: &Model, prompt: &str, steps: usize) -> Vec<Vec<f32>> {
    let prompt = model.tokenizer().encode(prompt, true).unwrap();
    let mut run = kura_model::SoloRun::new(
        model,
        &prompt,
        steps,
        kura_kv::codec::KvDtype::F32,
        16,
        true,
    )
    .unwrap();
    let mut all = Vec::new();
    for _ in 0..steps {
        let logits = run.next_logits().unwrap().row(0).to_vec();
        run.push(kura_engine::sampling::argmax(&logits)).unwrap();
        all.push(logits);
    }
    all
}

/// Asserts that every step's logits in `b` have the bits of `a`'s.
fn assert_same_bits(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: steps");
    for (step, (a, b)) in a.iter().zip(b).enumerate() {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{what}, step {step}: logits differ"
        );
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
