//! Native weights (`--weights-dtype native`): the default model's Q4_1 blocks multiplied as they are,
//! against llama.cpp on the same file (`scripts/golden/make_llamacpp.py`), and batch invariance.

mod common;

use kura_kv::codec::KvDtype;
use kura_model::{LoadOptions, Model, SeqBatchItem, SoloRun, WeightsDtype};
use serde_json::Value;

use common::{golden, ids};

fn native() -> Model {
    Model::load_with(
        &common::default_model_path(),
        LoadOptions {
            weights_dtype: WeightsDtype::Native,
        },
    )
    .unwrap()
}

fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v)) as f64;
    let sum: f64 = logits.iter().map(|v| (*v as f64 - max).exp()).sum();
    logits.iter().map(|v| *v as f64 - max - sum.ln()).collect()
}

/// How far a model's log-probabilities are from llama.cpp's.
struct Distance {
    /// Mean and largest difference over llama.cpp's top log-probabilities above −6.
    mean: f64,
    worst: f64,
    /// Steps whose argmax differs from llama.cpp's where llama.cpp's margin is clear (over 0.1 nats).
    wrong: Vec<String>,
}

/// Feeds each case's prompt and llama.cpp's greedy tokens one at a time, decoding as the server does.
fn compare(model: &Model, g: &Value) -> Distance {
    let (mut worst, mut wrong, mut sum, mut n) = (0f64, Vec::new(), 0f64, 0usize);
    for (c, case) in g["cases"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&case["prompt"]);
        let steps = case["steps"].as_array().unwrap();
        let mut run = SoloRun::new(model, &prompt, steps.len(), KvDtype::F32, 16, true).unwrap();
        for (s, step) in steps.iter().enumerate() {
            let logits = run.next_logits().unwrap();
            let lp = log_softmax(logits.row(0));
            let top = step["top"].as_array().unwrap();
            for t in top {
                let (id, want) = (t[0].as_u64().unwrap() as usize, t[1].as_f64().unwrap());
                if want > -6.0 {
                    let d = (lp[id] - want).abs();
                    worst = worst.max(d);
                    sum += d;
                    n += 1;
                }
            }
            let margin = top[0][1].as_f64().unwrap() - top[1][1].as_f64().unwrap();
            let ours = kura_engine::sampling::argmax(logits.row(0));
            let theirs = step["token"].as_u64().unwrap() as u32;
            if ours != theirs && margin > 0.1 {
                wrong.push(format!("case {c} step {s}: {ours} vs {theirs}"));
            }
            run.push(theirs).unwrap();
        }
    }
    Distance {
        mean: sum / n.max(1) as f64,
        worst,
        wrong,
    }
}

#[test]
fn native_weights_match_llama_cpp_on_the_same_file() {
    let g = golden("smollm2-q4_1-llamacpp");
    let model = native();
    assert_eq!(model.weights_dtype(), WeightsDtype::Native);
    let d = compare(&model, &g);
    let f32_model = Model::load_with(
        &common::default_model_path(),
        LoadOptions {
            weights_dtype: WeightsDtype::F32,
        },
    )
    .unwrap();
    let f = compare(&f32_model, &g);
    eprintln!(
        "from llama.cpp: native mean {:.4} worst {:.4}; f32 mean {:.4} worst {:.4}",
        d.mean, d.worst, f.mean, f.worst
    );
    assert!(d.wrong.is_empty(), "argmax differs: {:?}", d.wrong);
    // Both quantize activations to int8 per 32 columns, llama.cpp with f16 block scales and sums and
    // Kura with f32 ones, so each is a different draw of the same rounding noise: about as far from
    // the other as the f32 path (which llama.cpp's own F32 file matches) is from either.
    assert!(d.mean < 0.1, "mean difference {}", d.mean);
    assert!(d.worst < 0.75, "largest difference {}", d.worst);
    assert!(
        d.mean < 1.5 * f.mean,
        "native {} against f32 {}",
        d.mean,
        f.mean
    );
}

#[test]
fn native_weights_are_smaller_and_the_plan_sizes_them_exactly() {
    let model = native();
    let bf16 = Model::load(&common::default_model_path()).unwrap();
    // Q4_1 layers at 5 bits and the Q8_0 embedding at 9 bits, against 16 bits.
    let (n, b) = (
        model.weight_bytes_per_token(),
        bf16.weight_bytes_per_token(),
    );
    assert!(n * 5 / 2 < b, "native reads {n} bytes a token, bf16 {b}");
    assert_eq!(
        Model::native_weight_bytes(&common::default_model_path()).unwrap(),
        Some(model.weight_bytes_held())
    );
}

#[test]
fn a_token_decoded_alone_gets_the_bits_of_its_prefill() {
    let model = native();
    let prompt = model
        .tokenizer()
        .encode(
            "Kura keeps the file's blocks packed and multiplies them as integers.",
            false,
        )
        .unwrap();
    // One prefill of the whole prompt, every position's logits...
    let layout = model.kv_layout(KvDtype::F32, 16).unwrap();
    let blocks = prompt.len().div_ceil(16);
    let mut kv = model.kv_storage(&layout, blocks).unwrap();
    let table: Vec<u32> = (0..blocks as u32).collect();
    let every = model
        .forward_every_position(&[SeqBatchItem::new(&prompt, 0, &table)], &mut kv)
        .unwrap();
    // ...against a prefill of the first token and the others decoded one by one.
    let mut one = SoloRun::new(&model, &prompt[..1], prompt.len(), KvDtype::F32, 16, true).unwrap();
    for i in 0..prompt.len() {
        let logits = one.next_logits().unwrap();
        assert_eq!(logits.row(0), every.row(i), "position {i}");
        if i + 1 < prompt.len() {
            one.push(prompt[i + 1]).unwrap();
        }
    }
}

#[test]
fn a_quantized_model_whose_widths_the_kernels_do_not_take_computes_in_bf16() {
    // A tiny Llama with Q8_0 and Q4_1 matrices whose widths are not all whole blocks of 32.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/seeds/gguf/tiny-llama.gguf");
    let model = Model::load_with(
        &path,
        LoadOptions {
            weights_dtype: WeightsDtype::Native,
        },
    )
    .unwrap();
    assert_eq!(model.weights_dtype(), WeightsDtype::Bf16);
    assert_eq!(Model::native_weight_bytes(&path).unwrap(), None);
    let bf16 = Model::load(&path).unwrap();
    assert_eq!(model.weight_bytes_held(), bf16.weight_bytes_held());
}

#[test]
fn the_rows_of_a_drafts_positions_are_the_bits_of_their_prefill_beside_another_sequence() {
    // Speculative decoding checks a draft with the rows of an item's last positions
    // (`Model::forward_tails`): each must be the row that position gets in any other step.
    let model = native();
    let text = |s: &str| model.tokenizer().encode(s, false).unwrap();
    let a = text("Kura checks a draft of tokens in the step that computes the token before them.");
    let b = text("Another sequence shares the step.");
    let layout = model.kv_layout(KvDtype::F32, 16).unwrap();
    let blocks_a = a.len().div_ceil(16);
    let blocks_b = b.len().div_ceil(16);
    let mut kv = model.kv_storage(&layout, blocks_a + blocks_b).unwrap();
    let table_a: Vec<u32> = (0..blocks_a as u32).collect();
    let table_b: Vec<u32> = (blocks_a as u32..(blocks_a + blocks_b) as u32).collect();
    let every_a = model
        .forward_every_position(&[SeqBatchItem::new(&a, 0, &table_a)], &mut kv)
        .unwrap();
    let last_b = model
        .forward(&[SeqBatchItem::new(&b, 0, &table_b)], &mut kv)
        .unwrap();
    // Again: `a` up to its last 5 tokens, then those 5 (5 rows) beside all of `b` (its last row).
    let mut kv = model.kv_storage(&layout, blocks_a + blocks_b).unwrap();
    let cut = a.len() - 5;
    model
        .forward(&[SeqBatchItem::new(&a[..cut], 0, &table_a)], &mut kv)
        .unwrap();
    let rows = model
        .forward_tails(
            &[
                SeqBatchItem::new(&a[cut..], cut, &table_a),
                SeqBatchItem::new(&b, 0, &table_b),
            ],
            &mut kv,
            &[5, 1],
        )
        .unwrap();
    assert_eq!(rows.num_rows(), 6);
    for i in 0..5 {
        assert_eq!(rows.row(i), every_a.row(cut + i), "position {}", cut + i);
    }
    assert_eq!(rows.row(5), last_b.row(0));
    // More rows than an item's tokens, or a count per item missing, is refused.
    for tails in [&[6usize, 1][..], &[5], &[0, 1]] {
        let e = model
            .forward_tails(
                &[
                    SeqBatchItem::new(&a[cut..], cut, &table_a),
                    SeqBatchItem::new(&b, 0, &table_b),
                ],
                &mut kv,
                tails,
            )
            .unwrap_err();
        assert!(e.to_string().contains("row"), "{e}");
    }
}
