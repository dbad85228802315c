//! One decode token's attention (by default SmolLM2-135M's shape: 9 query heads, 3 KV heads, head size
//! 64; KV in blocks of 16) over contexts of several lengths: medians of many calls, in nanoseconds per
//! context position of a KV head (its query heads' scores and weighted sum of V), with K and V warm in the
//! caches and cold (a 64 MiB read between calls evicts them, as a decode step's weights do). The units
//! (a KV head and a segment of 1,024 positions each) are dealt to the threads of rayon's pool, one per
//! core: `RAYON_NUM_THREADS=1` for a single thread's figures.
//!
//! `cargo bench -p kura-model --bench attention`; `KURA_ATTN_CONTEXTS` (default "130 300 1000 4000"),
//! `KURA_ATTN_DTYPE` (default bf16), `KURA_ATTN_SHAPE` (query heads, KV heads, head size; default
//! "9,3,64", SmolLM2's; Gemma 3 270M's is "4,1,256"). The kernel is this CPU's (`KURA_ISA=avx2` narrows
//! it). On a shared machine a neighbour on the same physical core can halve the figures for a while:
//! compare builds in runs interleaved with each other.

use std::time::Instant;

use kura_kv::codec::KvDtype;
use kura_kv::layout::KvLayout;
use kura_kv::storage::KvStorage;
use kura_model::kernels::attention::{attention_part, partials_len, AttnSeq, AttnShape};
use kura_model::kernels::matmul::{ActBuf, ActKind};
use kura_model::kernels::team::{self, SharedMut};

const BLOCK: usize = 16;

fn main() {
    let contexts: Vec<usize> = std::env::var("KURA_ATTN_CONTEXTS")
        .unwrap_or_else(|_| "130 300 1000 4000".into())
        .split_whitespace()
        .map(|s| s.parse().expect("KURA_ATTN_CONTEXTS: counts of positions"))
        .collect();
    let dtype: KvDtype = match std::env::var("KURA_ATTN_DTYPE") {
        Ok(d) => d
            .parse()
            .expect("KURA_ATTN_DTYPE: a KV format (bf16, f16, f32, int8, fp8, int4)"),
        Err(_) => KvDtype::Bf16,
    };
    let shape: Vec<usize> = std::env::var("KURA_ATTN_SHAPE")
        .unwrap_or_else(|_| "9,3,64".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .expect("KURA_ATTN_SHAPE: heads,kv_heads,head_dim")
        })
        .collect();
    let [heads, kv_heads, head_dim] = shape[..] else {
        panic!("KURA_ATTN_SHAPE: three counts, heads,kv_heads,head_dim");
    };
    assert!(
        kv_heads > 0 && head_dim > 0 && heads % kv_heads == 0,
        "KURA_ATTN_SHAPE: the query heads must be a multiple of the KV heads"
    );
    let evict: Vec<u64> = (0..(64 << 20) / 8).map(|i| i as u64).collect();
    for &ctx in &contexts {
        let past = ctx - 1;
        let layout = KvLayout::uniform(1, kv_heads, head_dim, dtype, BLOCK).unwrap();
        let blocks = ctx.div_ceil(BLOCK);
        let mut kv = KvStorage::new(&layout, blocks).unwrap();
        let table: Vec<u32> = (0..blocks as u32).collect();
        let val = |i: usize| ((i * 2654435761usize % 1000) as f32 / 500.0 - 1.0) * 2.0;
        for p in 0..ctx {
            let k: Vec<f32> = (0..kv_heads * head_dim).map(|i| val(p * 977 + i)).collect();
            let v: Vec<f32> = (0..kv_heads * head_dim)
                .map(|i| val(p * 131 + i + 7))
                .collect();
            kv.write_token(0, table[p / BLOCK] as usize, p % BLOCK, &k, &v);
        }
        let q: Vec<f32> = (0..heads * head_dim).map(|i| val(i * 31 + 5)).collect();
        let seqs = [AttnSeq {
            first_token: 0,
            n_tokens: 1,
            start_pos: past,
            block_table: &table,
        }];
        let shape = AttnShape {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            window: None,
        };
        let mut out = ActBuf::new(ActKind::F32, 1, heads * head_dim);
        let mut partials = vec![0f32; partials_len(&seqs, shape)];
        let mut run = || {
            let (o, parts) = (out.shared(), SharedMut::new(&mut partials));
            // SAFETY: one thread; nothing else uses `o` or `parts`.
            team::run(|tm| unsafe {
                attention_part(
                    tm,
                    &q,
                    heads * head_dim,
                    &seqs,
                    kv.layer(0),
                    shape,
                    parts,
                    o,
                )
            });
        };
        let reps = (2_000_000 / ctx).max(20);
        for _ in 0..10 {
            run();
        }
        // The median of `n` calls, each after `before` (untimed).
        let mut median = |n: usize, before: &dyn Fn()| {
            let mut times: Vec<f64> = (0..n)
                .map(|_| {
                    before();
                    let start = Instant::now();
                    run();
                    start.elapsed().as_secs_f64()
                })
                .collect();
            times.sort_by(f64::total_cmp);
            times[n / 2]
        };
        let warm = median(reps, &|| ());
        let cold = median((reps / 10).max(10), &|| {
            std::hint::black_box(evict.iter().fold(0u64, |a, x| a.wrapping_add(*x)));
        });
        let per = |s: f64| s * 1e9 / (ctx * kv_heads) as f64;
        println!(
            "context {ctx}: warm {:.1} µs ({:.1} ns a position of a KV head), cold {:.1} µs ({:.1} ns)",
            warm * 1e6,
            per(warm),
            cold * 1e6,
            per(cold)
        );
    }
}
