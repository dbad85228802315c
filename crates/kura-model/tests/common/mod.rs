//! Helpers shared by the integration tests: the default model and a greedy generation loop.

#![allow(dead_code)]

use std::path::PathBuf;

use kura_kv::codec::KvDtype;
use kura_model::{Model, SoloRun};

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
        run.push(kura_model::sampling::argmax(logits.row(0)))
            .unwrap();
    }
    (run.tokens()[prompt.len()..].to_vec(), first_logits)
}
