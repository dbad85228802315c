//! `kura-metrics` — the metric types Kura's processes update, and the one writer of their `/metrics`
//! text (the Prometheus text exposition format, version 0.0.4):
//! - [`Counter`], [`Gauge`], [`Histogram`]: relaxed atomics, written by one thread (the engine loop) and
//!   read by any (a scrape). A scrape may see one metric a step ahead of another, never a torn value; an
//!   update costs one atomic add or store.
//! - [`Exposition`]: the text of a scrape. Every family is written through it, with its `# HELP` and
//!   `# TYPE` lines, its samples, and label values escaped as the format requires. `kura serve`'s engine
//!   (`kura_engine::EngineMetrics`) and `kura router` both render with it, so one scraper reads both.
//!
//! Standard library only.

mod exposition;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub use exposition::{Exposition, Kind, Value};

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
    /// Sets the count to a total kept elsewhere (a monotonic counter of the KV manager or the disk
    /// thread, mirrored here once per step).
    pub fn set_total(&self, n: u64) {
        self.0.store(n, Ordering::Relaxed);
    }
}

/// A value that goes up and down, stored as f64 bits.
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Ordering::Relaxed);
    }
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

/// Latency buckets in seconds (upper bounds, each bucket `le` its bound), from 1 ms to 5 min: the span
/// between a cached decode step and a long queued prefill on a CPU.
pub const LATENCY_BUCKETS_S: [f64; 18] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
    80.0, 300.0,
];

/// A histogram of durations over [`LATENCY_BUCKETS_S`], with the sum of the durations (in µs).
#[derive(Debug)]
pub struct Histogram {
    /// `counts[i]` = observations ≤ `LATENCY_BUCKETS_S[i]` and > the bucket before (not cumulative).
    counts: [AtomicU64; LATENCY_BUCKETS_S.len()],
    /// Observations above the last bound.
    overflow: AtomicU64,
    sum_us: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            overflow: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
        }
    }
}

/// What a scrape reads of a [`Histogram`]: the cumulative count at each bound, then the total.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// `(bound, observations ≤ bound)` for each of [`LATENCY_BUCKETS_S`].
    pub buckets: [(f64, u64); LATENCY_BUCKETS_S.len()],
    /// Every observation (the `+Inf` bucket).
    pub count: u64,
    /// The sum of the observations, in seconds.
    pub sum_s: f64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        match LATENCY_BUCKETS_S.iter().position(|&b| s <= b) {
            Some(i) => self.counts[i].fetch_add(1, Ordering::Relaxed),
            None => self.overflow.fetch_add(1, Ordering::Relaxed),
        };
        self.sum_us
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum::<u64>()
            + self.overflow.load(Ordering::Relaxed)
    }

    /// The cumulative buckets, count and sum, each bucket read once (so the buckets never decrease and
    /// the count is the last of them).
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut cumulative = 0;
        let buckets = std::array::from_fn(|i| {
            cumulative += self.counts[i].load(Ordering::Relaxed);
            (LATENCY_BUCKETS_S[i], cumulative)
        });
        let count = cumulative + self.overflow.load(Ordering::Relaxed);
        HistogramSnapshot {
            buckets,
            count,
            sum_s: self.sum_us.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_count_overflow() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(1)); // on a bound: that bucket, not the next
        h.observe(Duration::from_millis(30));
        h.observe(Duration::from_secs(1000));
        let s = h.snapshot();
        assert_eq!(s.buckets[0], (0.001, 2));
        assert_eq!(s.buckets[1], (0.0025, 2));
        assert_eq!(s.buckets[5], (0.05, 3));
        assert_eq!(s.buckets[17], (300.0, 3));
        assert_eq!(s.count, 4);
        assert_eq!(h.count(), 4);
        assert!((s.sum_s - 1000.0315).abs() < 1e-9, "{}", s.sum_s);
        assert!(s.buckets.windows(2).all(|w| w[0].1 <= w[1].1));
    }

    #[test]
    fn counters_add_and_mirror_and_gauges_hold_any_f64() {
        let c = Counter::default();
        c.add(3);
        c.add(4);
        assert_eq!(c.get(), 7);
        c.set_total(2);
        assert_eq!(c.get(), 2);
        let g = Gauge::default();
        assert_eq!(g.get(), 0.0);
        g.set(-0.375);
        assert_eq!(g.get(), -0.375);
    }
}
