//! Memory read bandwidth of this machine, the numerator of the decode bound (bandwidth ÷ bytes of weights
//! per token): each thread sums its share of a 1 GiB buffer (far beyond the caches); best of 5 passes, for
//! 1 thread and for every core, or for the counts in `KURA_BANDWIDTH_THREADS` (for example "1 2 4 8").
//!
//! `cargo bench -p kura-model --bench bandwidth`; prints one line per thread count.

use std::time::Instant;

mod common;

const BYTES: usize = 1 << 30;

fn pass(buf: &[u64], threads: usize) -> f64 {
    let start = Instant::now();
    let sum = common::plain_read(buf, threads);
    let secs = start.elapsed().as_secs_f64();
    std::hint::black_box(sum);
    BYTES as f64 / secs / 1e9
}

fn main() {
    let buf: Vec<u64> = (0..BYTES / 8).map(|i| i as u64).collect();
    for threads in common::thread_counts() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        let best = pool.install(|| (0..5).map(|_| pass(&buf, threads)).fold(0f64, f64::max));
        println!("read bandwidth, {threads} thread(s): {best:.1} GB/s");
    }
}
