//! The scheduler's hot path on a 4,096-token prompt: prefix lookup (hashing included) + slot allocation,
//! and the release, at block sizes 16 and 64, with a full hit and with a miss.
//!
//! `lookup+allocate` times only `find_cached_prefix` + `allocate_slots` (the release runs untimed between
//! iterations); `lookup+allocate+free` times the whole cycle.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kura_kv::{CacheKey, KvCacheConfig, KvCacheManager};

const PROMPT_TOKENS: u32 = 4096;

fn manager(block_size: usize) -> KvCacheManager {
    // Room for the cached prompt plus a few misses before eviction kicks in.
    let blocks = 8 * PROMPT_TOKENS / block_size as u32;
    let mut cfg = KvCacheConfig::new(blocks, block_size);
    cfg.hash_seed = Some(1);
    KvCacheManager::new(cfg).unwrap()
}

/// One request: lookup, allocate (all of it, or the uncached rest), optionally timed apart from the free.
fn cycle(kv: &mut KvCacheManager, key: &CacheKey, prompt: &[u32]) -> Duration {
    let start = Instant::now();
    let seq = kv.add_sequence(key);
    let hit = kv.find_cached_prefix(prompt, key);
    let alloc = kv
        .allocate_slots(seq, &prompt[hit.num_cached_tokens()..], Some(&hit))
        .unwrap()
        .expect("enough blocks");
    black_box(&alloc);
    let elapsed = start.elapsed();
    kv.mark_computed(seq, prompt.len()).unwrap();
    kv.free(seq).unwrap();
    elapsed
}

fn bench_prompt(c: &mut Criterion) {
    let key = CacheKey::new();
    let mut group = c.benchmark_group("prompt_4096");
    group.throughput(Throughput::Elements(u64::from(PROMPT_TOKENS)));
    for block_size in [16usize, 64] {
        for hit in [true, false] {
            let label = format!("bs{block_size}/{}", if hit { "hit" } else { "miss" });
            let mut kv = manager(block_size);
            let mut prompt: Vec<u32> = (0..PROMPT_TOKENS).collect();
            cycle(&mut kv, &key, &prompt);
            let mut counter = 0u32;
            // A miss changes the first token: every block's chained hash differs.
            let mut next_prompt = move |prompt: &mut Vec<u32>| {
                if !hit {
                    counter += 1;
                    prompt[0] = 1_000_000 + counter;
                }
            };
            group.bench_function(BenchmarkId::new("lookup+allocate", &label), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        next_prompt(&mut prompt);
                        total += cycle(&mut kv, &key, &prompt);
                    }
                    total
                })
            });
            if hit {
                group.bench_function(BenchmarkId::new("lookup", &label), |b| {
                    b.iter(|| black_box(kv.find_cached_prefix(&prompt, &key)))
                });
            }
            group.bench_function(BenchmarkId::new("lookup+allocate+free", &label), |b| {
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    for _ in 0..iters {
                        next_prompt(&mut prompt);
                        cycle(&mut kv, &key, &prompt);
                    }
                    start.elapsed()
                })
            });
            kv.check_invariants().unwrap();
        }
    }
    group.finish();
}

criterion_group!(benches, bench_prompt);
criterion_main!(benches);
