//! What the `bandwidth` and `products` benches share: the thread counts they measure and a plain read.

use rayon::prelude::*;

/// 1 thread and every core, or the counts in `KURA_BANDWIDTH_THREADS` (for example "1 2 4 8").
pub fn thread_counts() -> Vec<usize> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    match std::env::var("KURA_BANDWIDTH_THREADS") {
        Ok(list) => list
            .split_whitespace()
            .map(|t| match t.parse::<usize>() {
                Ok(n) if n > 0 => n,
                _ => panic!("KURA_BANDWIDTH_THREADS: '{t}' is not a thread count of at least 1"),
            })
            .collect(),
        Err(_) if cores > 1 => vec![1, cores],
        Err(_) => vec![1],
    }
}

/// Reads `buf` once on the current pool, each thread its `1 / threads` share with eight independent
/// sums (so that the loop is bound by loads, not by one add chain); returns the sum.
pub fn plain_read(buf: &[u64], threads: usize) -> u64 {
    buf.par_chunks(buf.len().div_ceil(threads))
        .map(|c| {
            let mut acc = [0u64; 8];
            for w in c.chunks_exact(8) {
                for (a, v) in acc.iter_mut().zip(w) {
                    *a = a.wrapping_add(*v);
                }
            }
            acc.iter().fold(0u64, |s, a| s.wrapping_add(*a))
        })
        .reduce(|| 0, u64::wrapping_add)
}
