//! Decode speed per KV format on the default model, each format timed in the same run as bf16: a decode
//! step of 8 sequences with 4,096 tokens of context each (attention reads dominate: 8 × 4,096 × 22.5 KiB
//! of bf16 KV a step against 85 MiB of weights) and of 1 sequence with 512 (the weights dominate).
//!
//! The contexts are filled with pseudo-random K and V written straight into the blocks (the step reads
//! every position whatever the values, and a real prefill of 32,768 tokens per format would take
//! minutes). Formats are measured in turn, round after round, so that a noisy neighbour hits all of them
//! alike; the report gives each format's median step time and its speed-up over bf16.
//!
//! `cargo bench -p kura-model --bench kv_dtype` (threads: `RAYON_NUM_THREADS`; formats:
//! `KURA_BENCH_KV=bf16,int8,fp8,int4`; rounds: `KURA_BENCH_ROUNDS`, default 7; the batch of 8's context:
//! `KURA_BENCH_CTX`, default 4096).

use std::time::Instant;

use kura_kv::codec::KvDtype;
use kura_kv::storage::KvStorage;
use kura_model::{Model, SeqBatchItem};

const BLOCK: usize = 16;

struct Case {
    batch: usize,
    ctx: usize,
    steps: usize,
}

/// Storage of `batch` sequences of `ctx` tokens (and room for one more each), filled with pseudo-random
/// K and V, and each sequence's block table.
fn filled(model: &Model, dtype: KvDtype, case: &Case) -> (KvStorage, Vec<Vec<u32>>) {
    let per_seq = (case.ctx + 1).div_ceil(BLOCK);
    let layout = model.kv_layout(dtype, BLOCK).unwrap();
    let mut kv = model.kv_storage(&layout, per_seq * case.batch).unwrap();
    let tables: Vec<Vec<u32>> = (0..case.batch)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    let c = model.config();
    let width = c.num_kv_heads() * c.head_dim();
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
    };
    let (mut k, mut v) = (vec![0f32; width], vec![0f32; width]);
    for table in &tables {
        for pos in 0..case.ctx {
            for layer in 0..c.num_layers() {
                k.iter_mut().for_each(|e| *e = next());
                v.iter_mut().for_each(|e| *e = next());
                kv.write_token(layer, table[pos / BLOCK] as usize, pos % BLOCK, &k, &v);
            }
        }
    }
    (kv, tables)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let model =
        Model::load(&kura_model::default_model_path()).expect("run scripts/fetch-model.sh first");
    let formats: Vec<KvDtype> = std::env::var("KURA_BENCH_KV")
        .unwrap_or_else(|_| "bf16,int8,fp8,int4".into())
        .split(',')
        .map(|s| {
            s.parse()
                .expect("KURA_BENCH_KV: formats separated by commas")
        })
        .collect();
    let rounds: usize = std::env::var("KURA_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let threads = kura_model::num_threads();
    let vocab = model.config().vocab_size() as u32;
    for case in [
        Case {
            batch: 8,
            ctx: std::env::var("KURA_BENCH_CTX")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(4096),
            steps: 4,
        },
        Case {
            batch: 1,
            ctx: 512,
            steps: 20,
        },
    ] {
        let mut stores: Vec<_> = formats.iter().map(|&d| filled(&model, d, &case)).collect();
        let mut times = vec![Vec::new(); formats.len()];
        for _ in 0..rounds {
            for (f, (kv, tables)) in stores.iter_mut().enumerate() {
                let t = Instant::now();
                for step in 0..case.steps {
                    let toks: Vec<u32> = (0..case.batch as u32)
                        .map(|s| (s * 7919 + step as u32 * 31 + 13) % vocab)
                        .collect();
                    // Every step decodes position `ctx` again: the same reads, the same work.
                    let items: Vec<SeqBatchItem<'_>> = tables
                        .iter()
                        .zip(&toks)
                        .map(|(table, tok)| SeqBatchItem {
                            tokens: std::slice::from_ref(tok),
                            start_pos: case.ctx,
                            block_table: table,
                            layer_pages: &[],
                        })
                        .collect();
                    model.forward(&items, kv).unwrap();
                }
                times[f].push(t.elapsed().as_secs_f64() * 1e3 / case.steps as f64);
            }
        }
        let base = formats
            .iter()
            .position(|&d| d == KvDtype::Bf16)
            .map(|i| median(times[i].clone()));
        for (d, t) in formats.iter().zip(times) {
            let m = median(t);
            let speedup = base.map_or(String::new(), |b| format!("  {:.2}× bf16", b / m));
            println!(
                "decode batch {} ctx {} {} threads kv {:<5} median {:8.2} ms/step  {:7.1} tok/s{speedup}",
                case.batch,
                case.ctx,
                threads,
                d.name(),
                m,
                case.batch as f64 * 1e3 / m
            );
        }
    }
}
