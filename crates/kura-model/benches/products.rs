//! The weight products of one batch-1 decode step alone, against the read bandwidth they are bound by:
//! the default model's shapes (SmolLM2-135M: 30 layers of 4-bit Q/K/V, O, gate/up and down panels, and
//! the 8-bit output head, 98 MB), seeded values, one parallel region, each product done before the next as
//! in the forward pass, and a plain read of as many bytes (eight sums per thread, as the `bandwidth`
//! bench) in the same run. Best of 20 steps, for 1 thread and for every core, or for the counts in
//! `KURA_BANDWIDTH_THREADS`.
//!
//! `cargo bench -p kura-model --bench products`; prints one line per thread count.
//!
//! With `KURA_PRODUCTS_IN_CACHE=1`, the kernels' own rate instead: a 4-bit matrix of the Q/K/V shape
//! (346 KB) and an 8-bit one of 320 rows (207 KB), each small enough for a core's L2, multiplied 500
//! times in one region (each done before the next); best of 20. Where this rate is not well above a core's
//! read bandwidth, the kernel, not memory, bounds decode.

use std::time::Instant;

use kura_model::kernels::qpacked::{matmul_part, quantize_act_row, PackedQ, QAct, QBits, QBLOCK};
use kura_model::kernels::team::{self, SharedMut};

mod common;

const HIDDEN: usize = 576;
const INTER: usize = 1536;
const QKV: usize = 960;
const LAYERS: usize = 30;
const VOCAB: usize = 49152;

fn matrix(rows: usize, cols: usize, bits: QBits, seed: u64) -> PackedQ {
    let mut s = seed;
    let mut next = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 33) as u32
    };
    PackedQ::build(rows, cols, bits, |_, row| {
        for u in row.u.iter_mut() {
            *u = (next() % (u32::from(bits.max_value()) + 1)) as u8;
        }
        for (sc, mn) in row.scale.iter_mut().zip(row.min.iter_mut()) {
            *sc = (next() % 1000) as f32 / 20000.0;
            *mn = ((next() % 1000) as f32 - 500.0) / 5000.0;
        }
    })
}

struct Act {
    q: Vec<i8>,
    ds: Vec<[f32; 2]>,
}

fn act(cols: usize) -> Act {
    let x: Vec<f32> = (0..cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    let mut q = vec![0i8; cols];
    let mut ds = vec![[0f32; 2]; cols / QBLOCK];
    quantize_act_row(&x, &mut q, &mut ds);
    Act { q, ds }
}

fn main() {
    if std::env::var_os("KURA_PRODUCTS_IN_CACHE").is_some() {
        in_cache();
        return;
    }
    let layers: Vec<[PackedQ; 4]> = (0..LAYERS as u64)
        .map(|l| {
            [
                matrix(QKV, HIDDEN, QBits::U4, 4 * l),
                matrix(HIDDEN, HIDDEN, QBits::U4, 4 * l + 1),
                matrix(2 * INTER, HIDDEN, QBits::U4, 4 * l + 2),
                matrix(HIDDEN, INTER, QBits::U4, 4 * l + 3),
            ]
        })
        .collect();
    let head = matrix(VOCAB, HIDDEN, QBits::U8, 7);
    let bytes: usize = layers
        .iter()
        .flat_map(|l| l.iter())
        .chain([&head])
        .map(PackedQ::bytes)
        .sum();
    let (xh, xi) = (act(HIDDEN), act(INTER));
    let (mut o_qkv, mut o_h, mut o_gu, mut o_head) = (
        vec![0f32; QKV],
        vec![0f32; HIDDEN],
        vec![0f32; 2 * INTER],
        vec![0f32; VOCAB],
    );
    let plain: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();

    for threads in common::thread_counts() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        let (mut best_step, mut best_read) = (f64::MAX, f64::MAX);
        for _ in 0..20 {
            let (s_qkv, s_h, s_gu, s_head) = (
                SharedMut::new(&mut o_qkv),
                SharedMut::new(&mut o_h),
                SharedMut::new(&mut o_gu),
                SharedMut::new(&mut o_head),
            );
            let start = Instant::now();
            pool.install(|| {
                team::run(|tm| {
                    for l in &layers {
                        for w in l {
                            let x = if w.cols == INTER { &xi } else { &xh };
                            let a = QAct { q: &x.q, ds: &x.ds };
                            let out = match w.rows {
                                QKV => s_qkv,
                                HIDDEN => s_h,
                                _ => s_gu,
                            };
                            // SAFETY: every thread passes the same arguments; the outputs are only
                            // written by the products, one at a time.
                            unsafe { matmul_part(tm, a, 1, w, out, false) };
                        }
                    }
                    let a = QAct {
                        q: &xh.q,
                        ds: &xh.ds,
                    };
                    // SAFETY: as above.
                    unsafe { matmul_part(tm, a, 1, &head, s_head, false) };
                });
            });
            best_step = best_step.min(start.elapsed().as_secs_f64());
            let start = Instant::now();
            let sum = pool.install(|| common::plain_read(&plain, threads));
            std::hint::black_box(sum);
            best_read = best_read.min(start.elapsed().as_secs_f64());
        }
        let gbs = |secs: f64| bytes as f64 / secs / 1e9;
        println!(
            "{threads} thread(s): products {:.2} ms ({:.1} GB/s), plain read {:.2} ms ({:.1} GB/s): {:.0} % of the read",
            best_step * 1e3,
            gbs(best_step),
            best_read * 1e3,
            gbs(best_read),
            100.0 * best_read / best_step
        );
    }
}

/// The 4-bit and 8-bit kernels on weights that stay in L2: see the module's doc.
fn in_cache() {
    const REPS: usize = 500;
    let four = matrix(QKV, HIDDEN, QBits::U4, 1);
    let eight = matrix(320, HIDDEN, QBits::U8, 2);
    let x = act(HIDDEN);
    let a = QAct { q: &x.q, ds: &x.ds };
    let mut out = vec![0f32; QKV];
    for threads in common::thread_counts() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        let rate = |w: &PackedQ, out: &mut [f32]| {
            let mut best = f64::MAX;
            for _ in 0..20 {
                let s_out = SharedMut::new(&mut out[..w.rows]);
                let start = Instant::now();
                pool.install(|| {
                    team::run(|tm| {
                        for _ in 0..REPS {
                            // SAFETY: every thread passes the same arguments; the output is only
                            // written by the products, one at a time.
                            unsafe { matmul_part(tm, a, 1, w, s_out, false) };
                        }
                    });
                });
                best = best.min(start.elapsed().as_secs_f64());
            }
            (REPS * w.bytes()) as f64 / best / 1e9
        };
        let (r4, r8) = (rate(&four, &mut out), rate(&eight, &mut out));
        println!(
            "{threads} thread(s), weights in L2: 4-bit {r4:.1} GB/s, 8-bit {r8:.1} GB/s ({:.1} and {:.1} µs a product)",
            four.bytes() as f64 / r4 / 1e3,
            eight.bytes() as f64 / r8 / 1e3
        );
    }
}
