//! Forward-pass throughput on the default model: prefill of 128 and 1,024 tokens, and one decode step for
//! batches of 1, 8 and 32 sequences (each with 128 tokens of context) and of 1 and 8 with 1,050. Thread
//! count: `RAYON_NUM_THREADS`. Weights: `KURA_BENCH_WEIGHTS=native|bf16|f32` (default native).
//!
//! `cargo bench -p kura-model --bench forward`; throughput is reported in tokens/s (elements).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kura_kv::codec::KvDtype;
use kura_kv::storage::KvStorage;
use kura_model::{LoadOptions, Model, SeqBatchItem, WeightsDtype};

const BLOCK: usize = 16;

fn bench(c: &mut Criterion) {
    let path = kura_model::default_model_path();
    let weights_dtype: WeightsDtype = std::env::var("KURA_BENCH_WEIGHTS")
        .as_deref()
        .unwrap_or("native")
        .parse()
        .expect("KURA_BENCH_WEIGHTS: native, bf16 or f32");
    let model = Model::load_with(&path, LoadOptions { weights_dtype })
        .expect("run scripts/fetch-model.sh first");
    let layout = model.kv_layout(KvDtype::F32, BLOCK).unwrap();
    let vocab = model.config().vocab_size() as u32;
    let tokens: Vec<u32> = (0..1024u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let threads = kura_model::num_threads();
    let mut g = c.benchmark_group(format!("forward/{weights_dtype:?}/{threads}t"));
    g.sample_size(10);

    for n in [128usize, 1024] {
        let blocks = n.div_ceil(BLOCK);
        let mut kv = KvStorage::new(&layout, blocks).unwrap();
        let table: Vec<u32> = (0..blocks as u32).collect();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(format!("prefill_{n}"), |b| {
            b.iter(|| {
                let item = SeqBatchItem {
                    tokens: &tokens[..n],
                    start_pos: 0,
                    block_table: &table,
                    layer_pages: &[],
                };
                model.forward(&[item], &mut kv).unwrap()
            })
        });
    }

    // 128 tokens of context (the names without a context), and 1,050: past one attention segment, where
    // a token's work is a full segment and a short one per KV head.
    let tokens: Vec<u32> = (0..1100u32).map(|i| (i * 7919 + 13) % vocab).collect();
    for (batch, ctx) in [
        (1usize, 128usize),
        (8, 128),
        (32, 128),
        (1, 1050),
        (8, 1050),
    ] {
        let per_seq = (ctx + 1).div_ceil(BLOCK);
        let mut kv = KvStorage::new(&layout, per_seq * batch).unwrap();
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
            .collect();
        // Fill each sequence's context once; the measured step decodes position `ctx` of every sequence.
        for t in &tables {
            model
                .forward(
                    &[SeqBatchItem {
                        tokens: &tokens[..ctx],
                        start_pos: 0,
                        block_table: t,
                        layer_pages: &[],
                    }],
                    &mut kv,
                )
                .unwrap();
        }
        g.throughput(Throughput::Elements(batch as u64));
        let name = match ctx {
            128 => format!("decode_batch_{batch}"),
            _ => format!("decode_batch_{batch}_ctx_{ctx}"),
        };
        g.bench_function(name, |b| {
            b.iter(|| {
                let items: Vec<SeqBatchItem<'_>> = tables
                    .iter()
                    .enumerate()
                    .map(|(s, t)| SeqBatchItem {
                        tokens: &tokens[ctx + s..ctx + s + 1],
                        start_pos: ctx,
                        block_table: t,
                        layer_pages: &[],
                    })
                    .collect();
                model.forward(&items, &mut kv).unwrap()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
