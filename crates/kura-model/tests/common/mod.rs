//! Helpers shared by the integration tests: the default model and a greedy generation loop.

#![allow(dead_code)]

use std::path::PathBuf;

use kura_kv::codec::KvDtype;
use kura_model::{Model, SoloRun};
use serde_json::Value;

/// The default model, which CI fetches with scripts/fetch-model.sh before the tests.
pub fn default_model_path() -> PathBuf {
    let p = kura_model::default_model_path();
    assert!(
        p.exists(),
        "default model missing at {}: run scripts/fetch-model.sh (or set KURA_MODEL)",
        p.display()
    );
    p
}

pub fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

/// Greedy generation of `n` tokens; returns the new tokens and the logits of the prompt's last position.
pub fn greedy(
    model: &Model,
    prompt: &[u32],
    n: usize,
    block_size: usize,
    kv_cache: bool,
) -> (Vec<u32>, Vec<f32>) {
    let mut run = SoloRun::new(model, prompt, n, KvDtype::F32, block_size, kv_cache).unwrap();
    let mut first_logits = Vec::new();
    for i in 0..n {
        let logits = run.next_logits().unwrap();
        if i == 0 {
            first_logits = logits.row(0).to_vec();
        }
        run.push(kura_engine::sampling::argmax(logits.row(0)))
            .unwrap();
    }
    (run.tokens()[prompt.len()..].to_vec(), first_logits)
}

/// Golden vectors of `scripts/golden/*.py`: `tests/data/golden/<name>.json`.
pub fn golden(name: &str) -> Value {
    let path = golden_dir().join("golden").join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// Max abs difference between Kura's logits and the reference's, over what the golden file stores
/// (the full vector, or the top-64 and a strided sample).
pub fn logit_diff(ours: &[f32], want: &Value) -> f32 {
    assert_eq!(ours.len() as u64, want["vocab"].as_u64().unwrap());
    let mut max = 0f32;
    if let Some(full) = want.get("full") {
        for (a, b) in ours.iter().zip(floats(full)) {
            max = max.max((a - b).abs());
        }
    }
    for (i, v) in ids(&want["top_ids"])
        .into_iter()
        .zip(floats(&want["top_values"]))
    {
        max = max.max((ours[i as usize] - v).abs());
    }
    let stride = want["sample_stride"].as_u64().unwrap() as usize;
    for (k, v) in floats(&want["sample_values"]).into_iter().enumerate() {
        max = max.max((ours[k * stride] - v).abs());
    }
    let mean = ours.iter().map(|x| *x as f64).sum::<f64>() / ours.len() as f64;
    // The mean over the whole vector catches differences outside the stored entries.
    max = max.max((mean - want["mean"].as_f64().unwrap()).abs() as f32);
    max
}
