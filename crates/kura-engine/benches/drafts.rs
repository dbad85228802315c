//! Speculative decoding's lookup, as each decoding sequence makes it before each step: the draft
//! found by scanning the sequence for its final n-gram (`NgramDraft::propose`) against the same draft
//! found through the sequence's n-gram index (`NgramDraft::propose_indexed`: the step's new token
//! indexed, then the lookups), and the index built whole for a sequence's first lookup. The tokens are
//! random over SmolLM2's vocabulary (49,152), so that the final n-gram seldom occurred before: the
//! scan reads the whole sequence, as it does for most sequences of natural text at most steps.
//!
//! `cargo bench -p kura-engine --bench drafts`

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kura_engine::{NgramDraft, NgramIndex};

fn random_tokens(len: usize, seed: u64) -> Vec<u32> {
    let mut x = seed;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 49_152) as u32
        })
        .collect()
}

fn lookups(c: &mut Criterion) {
    let mut group = c.benchmark_group("drafts");
    for (min_n, max_n) in [(5, 5), (2, 4)] {
        let d = NgramDraft {
            num_tokens: 4,
            min_n,
            max_n,
            disable_by_batch_size: None,
        };
        for len in [1024usize, 8192, 32768] {
            // Room for the tokens the indexed runs append, a step each.
            const STEPS: usize = 4096;
            let tokens = random_tokens(len + STEPS, 0x5eed);
            let name = |what: &str| BenchmarkId::new(format!("{what}/{min_n}-{max_n}"), len);
            group.bench_function(name("scan"), |b| {
                b.iter(|| d.propose(black_box(&tokens[..len]), 4))
            });
            group.bench_function(name("indexed step"), |b| {
                b.iter_custom(|iters| {
                    let (mut total, mut done) = (Duration::ZERO, 0u64);
                    while done < iters {
                        let mut index = NgramIndex::default();
                        d.propose_indexed(&mut index, &tokens[..len], 4);
                        let n = (iters - done).min(STEPS as u64) as usize;
                        let t = Instant::now();
                        for i in 1..=n {
                            black_box(d.propose_indexed(&mut index, &tokens[..len + i], 4));
                        }
                        total += t.elapsed();
                        done += n as u64;
                    }
                    total
                })
            });
            group.bench_function(name("index built"), |b| {
                b.iter(|| {
                    let mut index = NgramIndex::default();
                    d.propose_indexed(&mut index, black_box(&tokens[..len]), 4)
                })
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    targets = lookups
}
criterion_main!(benches);
