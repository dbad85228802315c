//! The outcome of a replay, as a table for people and JSON for scripts.

use std::fmt;

use serde::Serialize;

/// What the cache did over a replay.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SimReport {
    pub policy: String,
    pub block_size: usize,
    /// The capacity asked for (with `infinite_capacity`, what the trace can occupy).
    pub capacity_blocks: u64,
    /// Blocks given to the cache manager: the capacity, or less when the trace could never fill it (a
    /// larger cache would not evict either, so the figures are the same).
    pub allocated_blocks: u64,
    pub infinite_capacity: bool,
    pub overlap: bool,
    pub requests: u64,
    /// Requests that could never fit (larger than the whole cache).
    pub rejected: u64,
    /// Requests whose output could not be allocated in full.
    pub output_short: u64,
    pub prompt_tokens: u64,
    pub hit_tokens: u64,
    /// Prompt blocks at the replay's block size, a partial last block counted as one.
    pub prompt_blocks: u64,
    /// Full blocks served from the cache.
    pub hit_blocks: u64,
    pub hit_ratio_tokens: f64,
    pub hit_ratio_blocks: f64,
    pub evictions: u64,
    pub partial_hits: u64,
    pub peak_used_blocks: u64,
    /// Requests that waited for blocks, and their mean wait on the trace's clock.
    pub delayed_requests: u64,
    pub mean_delay_ms: f64,
    /// Block operations of the manager: blocks looked up, allocated, attached and released.
    pub block_ops: u64,
    pub elapsed_s: f64,
    pub ops_per_sec: f64,
}

impl fmt::Display for SimReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let capacity = if self.infinite_capacity {
            format!("unbounded ({} blocks)", self.capacity_blocks)
        } else if self.allocated_blocks < self.capacity_blocks {
            format!(
                "{} blocks ({} tokens; the trace fills at most {}, never evicts)",
                self.capacity_blocks,
                self.capacity_blocks.saturating_mul(self.block_size as u64),
                self.allocated_blocks
            )
        } else {
            format!(
                "{} blocks ({} tokens)",
                self.capacity_blocks,
                self.capacity_blocks.saturating_mul(self.block_size as u64)
            )
        };
        let rows: [(&str, String); 14] = [
            ("policy", self.policy.clone()),
            ("block size", format!("{} tokens", self.block_size)),
            ("capacity", capacity),
            (
                "overlap",
                if self.overlap {
                    "trace clock"
                } else {
                    "none (freed at once)"
                }
                .into(),
            ),
            (
                "requests",
                format!(
                    "{} ({} rejected, {} output short)",
                    self.requests, self.rejected, self.output_short
                ),
            ),
            (
                "hit ratio, tokens",
                format!(
                    "{:.2} % ({} of {})",
                    100.0 * self.hit_ratio_tokens,
                    self.hit_tokens,
                    self.prompt_tokens
                ),
            ),
            (
                "hit ratio, blocks",
                format!(
                    "{:.2} % ({} of {})",
                    100.0 * self.hit_ratio_blocks,
                    self.hit_blocks,
                    self.prompt_blocks
                ),
            ),
            ("partial-block hits", self.partial_hits.to_string()),
            ("evictions", self.evictions.to_string()),
            ("peak used blocks", self.peak_used_blocks.to_string()),
            (
                "delayed requests",
                format!(
                    "{} (mean wait {:.0} ms)",
                    self.delayed_requests, self.mean_delay_ms
                ),
            ),
            ("block operations", self.block_ops.to_string()),
            ("replay time", format!("{:.3} s", self.elapsed_s)),
            ("block ops / s", format!("{:.0}", self.ops_per_sec)),
        ];
        for (name, value) in rows {
            writeln!(f, "{name:<20} {value}")?;
        }
        Ok(())
    }
}
