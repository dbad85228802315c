//! Memory read bandwidth of this machine, the numerator of the decode bound (bandwidth ÷ bytes of weights
//! per token): each thread sums its share of a 1 GiB buffer (far beyond the caches); best of 5 passes, for
//! 1 thread and for every core, or for the counts in `KURA_BANDWIDTH_THREADS` (for example "1 2 4 8").
//!
//! `cargo bench -p kura-model --bench bandwidth`; prints one line per thread count.

use std::time::Instant;

use rayon::prelude::*;

const BYTES: usize = 1 << 30;

fn pass(buf: &[u64], threads: usize) -> f64 {
    let chunk = buf.len().div_ceil(threads);
    let start = Instant::now();
    let sum: u64 = buf
        .par_chunks(chunk)
        .map(|c| {
            // Eight independent sums so that the loop is bound by loads, not by one add chain.
            let mut acc = [0u64; 8];
            for w in c.chunks_exact(8) {
                for (a, v) in acc.iter_mut().zip(w) {
                    *a = a.wrapping_add(*v);
                }
            }
            acc.iter().fold(0u64, |s, a| s.wrapping_add(*a))
        })
        .reduce(|| 0, u64::wrapping_add);
    let secs = start.elapsed().as_secs_f64();
    std::hint::black_box(sum);
    BYTES as f64 / secs / 1e9
}

fn main() {
    let buf: Vec<u64> = (0..BYTES / 8).map(|i| i as u64).collect();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let counts: Vec<usize> = match std::env::var("KURA_BANDWIDTH_THREADS") {
        Ok(list) => list
            .split_whitespace()
            .map(|t| match t.parse::<usize>() {
                Ok(n) if n > 0 => n,
                _ => panic!("KURA_BANDWIDTH_THREADS: '{t}' is not a thread count of at least 1"),
            })
            .collect(),
        Err(_) if cores > 1 => vec![1, cores],
        Err(_) => vec![1],
    };
    for threads in counts {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        let best = pool.install(|| (0..5).map(|_| pass(&buf, threads)).fold(0f64, f64::max));
        println!("read bandwidth, {threads} thread(s): {best:.1} GB/s");
    }
}
