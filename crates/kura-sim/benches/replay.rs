//! Manager throughput in block operations per second over the Mooncake conversation trace (block size 16,
//! requests freed at once, a bounded cache so that eviction runs too).

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kura_sim::{replay, Policy, SimConfig};
use kura_trace::load_trace;

fn bench_replay(c: &mut Criterion) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/traces/mooncake_conversation_trace.jsonl");
    let mut trace = load_trace(&path).unwrap_or_else(|e| panic!("{e}"));
    trace.truncate(2000);
    let mut group = c.benchmark_group("mooncake_replay_2000");
    group.sample_size(10);
    for policy in [Policy::LeafLru, Policy::Lru] {
        let cfg = SimConfig {
            block_size: 16,
            capacity_tokens: Some(1 << 21),
            policy,
            overlap: false,
            ..SimConfig::default()
        };
        let ops = replay(&trace, &cfg).unwrap().block_ops;
        group.throughput(Throughput::Elements(ops));
        group.bench_function(policy.name(), |b| b.iter(|| replay(&trace, &cfg).unwrap()));
    }
    group.finish();
}

criterion_group!(benches, bench_replay);
criterion_main!(benches);
