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
    let model = Model::load_with(
        &common::default_model_path(),
        LoadOptions {
            weights_dtype: dtype,
        },
    )
    .unwrap();
    let prompt = model
        .tokenizer()
        .encode("A short story about a lighthouse keeper:", true)
        .unwrap();
    let decode = || {
        let mut run =
            kura_model::SoloRun::new(&model, &prompt, 12, kura_kv::codec::KvDtype::F32, 16, true)
                .unwrap();
        let mut all = Vec::new();
        for _ in 0..12 {
            let logits = run.next_logits().unwrap().row(0).to_vec();
            run.push(kura_engine::sampling::argmax(&logits)).unwrap();
            all.push(logits);
        }
        all
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let in_place = pool.install(decode);
    let redone = pool.install(|| kura_model::kernels::team::with_redo_form(decode));
    assert_eq!(in_place.len(), 12);
    for (step, (a, b)) in in_place.iter().zip(&redone).enumerate() {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{dtype:?} step {step}: logits differ"
        );
    }
}

#[test]
fn every_team_size_gives_the_same_logits() {
    // A step's team size changes from one step to the next (fewer threads while a core is busy,
    // another size on trial for decode steps): the prefill and every decode step give the same bits
    // on teams of one to four.
    for dtype in [WeightsDtype::Native, WeightsDtype::Bf16, WeightsDtype::F32] {
        let model = Model::load_with(
            &common::default_model_path(),
            LoadOptions {
                weights_dtype: dtype,
            },
        )
        .unwrap();
        let prompt = model
            .tokenizer()
            .encode("The lighthouse keeper climbed the stairs at dusk and", true)
            .unwrap();
        let decode = || {
            let mut run = kura_model::SoloRun::new(
                &model,
                &prompt,
                8,
                kura_kv::codec::KvDtype::F32,
                16,
                true,
            )
            .unwrap();
            let mut all = Vec::new();
            for _ in 0..8 {
                let logits = run.next_logits().unwrap().row(0).to_vec();
                run.push(kura_engine::sampling::argmax(&logits)).unwrap();
                all.push(logits);
            }
            all
        };
        let on = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(decode)
        };
        let one = on(1);
        assert_eq!(one.len(), 8);
        for threads in 2..=4 {
            for (step, (a, b)) in one.iter().zip(&on(threads)).enumerate() {
                assert!(
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{dtype:?} step {step}: {threads} threads give other logits than one"
                );
            }
        }
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
