//! Choosing a token from one row of logits, as each decode step of each sequence does: greedy,
//! temperature, top-k, top-p, min-p and logprobs, over the vocabularies of SmolLM2 (49,152) and
//! Llama 3 (128,256). The logits are drawn from a normal distribution, seeded, in two shapes: `peaked`
//! (deviation 2.5 and eight tokens 8 to 15 above the rest: most of the mass in a few tokens) and
//! `flat` (deviation 1.5 and no such tokens: the mass spread over thousands, as SmolLM2's rows are
//! when it writes a story at temperature 1, where a draw often goes past the first tiers). Neither is
//! a real model's row.
//!
//! `cargo bench -p kura-engine --bench sampling`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kura_engine::sampling::{Sampler, SamplingParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A row of `vocab` logits: Box–Muller normals (deviation 2.5 and eight tokens 8 to 15 above them
/// when `peaked`, else deviation 1.5).
pub fn logits(vocab: usize, seed: u64, peaked: bool) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let deviation = if peaked { 2.5 } else { 1.5 };
    let mut l: Vec<f32> = (0..vocab)
        .map(|_| {
            let (u, v): (f32, f32) = (rng.random::<f32>().max(1e-12), rng.random());
            deviation * (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
        })
        .collect();
    if peaked {
        for i in 0..8 {
            let at = rng.random_range(0..vocab);
            l[at] = 8.0 + i as f32;
        }
    }
    l
}

fn cases() -> Vec<(&'static str, SamplingParams)> {
    let t = |temperature: f32| SamplingParams {
        temperature,
        seed: Some(7),
        ..SamplingParams::greedy()
    };
    vec![
        ("greedy", SamplingParams::greedy()),
        (
            "greedy+logprobs5",
            SamplingParams {
                logprobs: Some(5),
                ..SamplingParams::greedy()
            },
        ),
        ("t1.0", t(1.0)),
        ("t0.8", t(0.8)),
        (
            "t0.8+top_k40",
            SamplingParams {
                top_k: 40,
                ..t(0.8)
            },
        ),
        (
            "t0.8+top_p0.95",
            SamplingParams {
                top_p: 0.95,
                ..t(0.8)
            },
        ),
        (
            "t0.8+min_p0.05",
            SamplingParams {
                min_p: 0.05,
                ..t(0.8)
            },
        ),
        (
            "t0.8+rep1.1",
            SamplingParams {
                repetition_penalty: 1.1,
                ..t(0.8)
            },
        ),
    ]
}

fn bench_sampling(c: &mut Criterion) {
    for (shape, peaked) in [("peaked", true), ("flat", false)] {
        let mut g = c.benchmark_group(format!("sample/{shape}"));
        bench_shape(&mut g, peaked);
        g.finish();
    }
}

fn bench_shape(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    peaked: bool,
) {
    for vocab in [49_152usize, 128_256] {
        let rows: Vec<Vec<f32>> = (0..8).map(|s| logits(vocab, s, peaked)).collect();
        let prompt: Vec<u32> = (0..200).map(|i| (i * 97 % vocab) as u32).collect();
        for (name, params) in cases() {
            // A request of 256 tokens at a time: the penalties' counts grow with its tokens.
            let mut sampler = Sampler::new(params.clone(), &prompt);
            let mut i = 0;
            g.bench_with_input(BenchmarkId::new(name, vocab), &vocab, |b, _| {
                b.iter(|| {
                    i += 1;
                    if i % 256 == 0 {
                        sampler = Sampler::new(params.clone(), &prompt);
                    }
                    black_box(sampler.sample(black_box(&rows[i % rows.len()])).token)
                })
            });
        }
    }
}

criterion_group!(benches, bench_sampling);
criterion_main!(benches);
