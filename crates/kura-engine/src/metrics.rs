//! The engine's counters, gauges and latency histograms, written by the engine thread and read by
//! `/metrics` (Prometheus text exposition format). Everything is a relaxed atomic: a scrape may see one
//! counter a step ahead of another, never a torn value. Cost per update: one atomic add.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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

/// Latency buckets in seconds, from 1 ms to 5 min (the span between a cached decode step and a long
/// queued prefill on a CPU).
const LATENCY_BUCKETS_S: [f64; 18] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
    80.0, 300.0,
];

/// A cumulative histogram of durations with fixed buckets.
#[derive(Debug)]
pub struct Histogram {
    /// `counts[i]` = observations ≤ `LATENCY_BUCKETS_S[i]` and > the bucket before (not cumulative).
    counts: [AtomicU64; LATENCY_BUCKETS_S.len()],
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

    pub fn count(&self) -> u64 {
        self.counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum::<u64>()
            + self.overflow.load(Ordering::Relaxed)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        self.render_series(out, name, "");
    }

    /// The histogram's lines, each with `labels` (`tier="host"`) besides `le`.
    fn render_series(&self, out: &mut String, name: &str, labels: &str) {
        let (sep, bare) = if labels.is_empty() {
            ("", String::new())
        } else {
            (",", format!("{{{labels}}}"))
        };
        let mut cumulative = 0;
        for (bound, c) in LATENCY_BUCKETS_S.iter().zip(&self.counts) {
            cumulative += c.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {cumulative}"
            );
        }
        cumulative += self.overflow.load(Ordering::Relaxed);
        let sum_s = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {cumulative}\n{name}_sum{bare} {sum_s}\n{name}_count{bare} {cumulative}"
        );
    }
}

/// Every metric the engine exports. Names follow vLLM's `vllm:` style under the `kura:` prefix.
#[derive(Debug, Default)]
pub struct EngineMetrics {
    // KV cache
    pub kv_blocks_total: Gauge,
    /// Blocks referenced by at least one live request.
    pub kv_blocks_used: Gauge,
    /// Unreferenced blocks that still hold a cached prefix (reusable until evicted).
    pub kv_blocks_cached: Gauge,
    /// Blocks running requests will still take to reach their full length (prompt plus `max_tokens`,
    /// every choice): what guaranteed admission keeps free for them.
    pub kv_reserved_blocks: Gauge,
    pub kv_usage_perc: Gauge,
    pub prefix_queries_tokens: Counter,
    pub prefix_hits_tokens: Counter,
    /// Hits on blocks another request was still computing: tokens that were waited for, not recomputed.
    pub prefix_pending_hit_tokens: Counter,
    /// Steps in which a request was held back waiting for another request's pending blocks.
    pub pending_waits: Counter,
    pub kv_evictions: Counter,
    /// A hybrid pool's pages (one layer of one block): all of them, free ones, and those held by idle
    /// window parts of cached blocks; 0 without a hybrid pool (then not exported).
    pub kv_pages_total: Gauge,
    pub kv_pages_free: Gauge,
    pub kv_pages_idle_window: Gauge,
    /// Window parts of cached blocks dropped to make room.
    pub kv_window_part_drops: Counter,
    // scheduling
    pub requests_running: Gauge,
    pub requests_waiting: Gauge,
    pub requests_preempted_waiting: Gauge,
    pub preemptions: Counter,
    pub steps: Counter,
    /// Scheduling passes of the engine loop, including those that found nothing to run (a loop that
    /// waits properly makes few of those).
    pub scheduler_passes: Counter,
    // tokens
    pub prompt_tokens: Counter,
    /// Prompt tokens whose K/V this engine actually computed (prompt minus cache hits and waits).
    pub prompt_tokens_computed: Counter,
    pub generation_tokens: Counter,
    // requests
    pub requests_finished_stop: Counter,
    pub requests_finished_length: Counter,
    pub requests_cancelled: Counter,
    /// Of `requests_cancelled`: those whose client stopped reading (sink full past the timeout).
    pub requests_cancelled_stalled: Counter,
    pub requests_failed: Counter,
    pub requests_rejected_queue_full: Counter,
    pub requests_rejected_too_large: Counter,
    // latency
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
    /// Time of the engine loop's steps inside the executor (block copies and the forward pass), µs.
    pub step_forward_us: Counter,
    /// Time of the engine loop's steps outside the executor (scheduling, sampling, detokenization, stop
    /// checks, logprob texts, emitting), µs.
    pub step_other_us: Counter,
    /// The lower tiers: host memory (L2) and disk (L3).
    pub host: TierMetrics,
    pub disk: TierMetrics,
    /// Blocks that could not go down because their tier was full of blocks being loaded.
    pub tier_full_drops: Counter,
    /// Stored blocks that failed a check when read (checksum, header, identity) or when the disk tier was
    /// opened; each was removed and never served.
    pub tier_checksum_failures: Counter,
    /// Intact block files of another model or KV format removed when the disk tier was opened.
    pub disk_removed_foreign: Counter,
    /// Block files read from disk (one read serves every request waiting for that block).
    pub disk_reads: Counter,
    pub disk_writes: Counter,
    pub disk_write_errors: Counter,
    /// Jobs queued for the disk thread.
    pub disk_queue: Gauge,
    /// Blocks copied to the host tier when their sequence was preempted (swap).
    pub swapped_out_blocks: Counter,
    /// The shared tier in Redis (L4): blocks fetched and adopted into the pool; and its thread's own
    /// counters (writes, fetches, failed commands, records that failed a check, jobs dropped, connection),
    /// read live at each scrape, since that thread works on while the engine loop idles.
    pub remote_hit_blocks: Counter,
    pub remote: std::sync::OnceLock<std::sync::Arc<kura_tiers::RemoteStats>>,
    /// Context caching: live pinned prefixes, the pool blocks they hold, and pins demoted to the lower
    /// tiers because the pin budget was spent.
    pub pins: Gauge,
    pub pinned_blocks: Gauge,
    pub pin_budget_blocks: Gauge,
    pub pins_demoted: Counter,
    pub pins_expired: Counter,
}

/// One lower tier's gauges and counters.
#[derive(Debug, Default)]
pub struct TierMetrics {
    pub blocks_total: Gauge,
    pub blocks_used: Gauge,
    pub bytes_used: Gauge,
    /// Full prompt blocks found in this tier (each loaded into the pool once per admission).
    pub hit_blocks: Counter,
    /// Loads into the pool finished (failed ones included).
    pub loads: Counter,
    /// Loads whose stored copy did not verify (the block was recomputed).
    pub load_failures: Counter,
    pub load_latency: Histogram,
    /// Blocks stored into this tier (demotions).
    pub stores: Counter,
    /// Blocks evicted from this tier to make room.
    pub evictions: Counter,
}

impl EngineMetrics {
    /// Prometheus text exposition of every metric.
    pub fn render_prometheus(&self) -> String {
        let mut out = String::with_capacity(8 * 1024);
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        gauge(
            &mut out,
            "kura:kv_cache_usage_perc",
            "Fraction of KV blocks referenced by live requests (1 = full).",
            self.kv_usage_perc.get(),
        );
        gauge(
            &mut out,
            "kura:kv_cache_blocks_total",
            "KV blocks in the pool.",
            self.kv_blocks_total.get(),
        );
        gauge(
            &mut out,
            "kura:kv_cache_blocks_used",
            "KV blocks referenced by live requests.",
            self.kv_blocks_used.get(),
        );
        gauge(
            &mut out,
            "kura:kv_cache_blocks_cached",
            "Unreferenced KV blocks still holding a reusable cached prefix.",
            self.kv_blocks_cached.get(),
        );
        gauge(
            &mut out,
            "kura:kv_pins",
            "Live pinned prefixes (cache_control breakpoints, prompt_cache_retention, saved contexts).",
            self.pins.get(),
        );
        gauge(
            &mut out,
            "kura:kv_pinned_blocks",
            "KV blocks of the pool held by pinned prefixes.",
            self.pinned_blocks.get(),
        );
        gauge(
            &mut out,
            "kura:kv_pin_budget_blocks",
            "Most KV blocks of the pool that pinned prefixes may hold (--kv-pin-budget).",
            self.pin_budget_blocks.get(),
        );
        counter(
            &mut out,
            "kura:kv_pins_demoted_total",
            "Pinned prefixes moved out of the pool to the lower tiers because the pin budget was spent.",
            self.pins_demoted.get(),
        );
        counter(
            &mut out,
            "kura:kv_pins_expired_total",
            "Pinned prefixes released because their time to live ended.",
            self.pins_expired.get(),
        );
        gauge(
            &mut out,
            "kura:kv_reserved_blocks",
            "KV blocks running requests will still take to reach prompt + max_tokens (every choice).",
            self.kv_reserved_blocks.get(),
        );
        counter(
            &mut out,
            "kura:prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            self.prefix_queries_tokens.get(),
        );
        counter(
            &mut out,
            "kura:prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache (computed or still being computed).",
            self.prefix_hits_tokens.get(),
        );
        counter(
            &mut out,
            "kura:prefix_cache_pending_hits_total",
            "Prompt tokens reused from blocks another request was still computing.",
            self.prefix_pending_hit_tokens.get(),
        );
        counter(
            &mut out,
            "kura:prefix_cache_pending_waits_total",
            "Scheduler steps in which a request waited for another request's pending blocks.",
            self.pending_waits.get(),
        );
        counter(
            &mut out,
            "kura:kv_cache_evictions_total",
            "Cached KV blocks evicted to make room.",
            self.kv_evictions.get(),
        );
        if self.kv_pages_total.get() > 0.0 {
            gauge(
                &mut out,
                "kura:kv_pages_total",
                "Pages of the hybrid pool (one layer of one block each).",
                self.kv_pages_total.get(),
            );
            gauge(
                &mut out,
                "kura:kv_pages_free",
                "Pages of the hybrid pool on its free list.",
                self.kv_pages_free.get(),
            );
            gauge(
                &mut out,
                "kura:kv_pages_idle_window",
                "Pages of sliding layers kept for cached blocks no request reads now (reclaimed first).",
                self.kv_pages_idle_window.get(),
            );
            counter(
                &mut out,
                "kura:kv_window_part_drops_total",
                "Sliding layers' pages of cached blocks dropped to make room.",
                self.kv_window_part_drops.get(),
            );
        }
        gauge(
            &mut out,
            "kura:num_requests_running",
            "Requests scheduled (holding KV blocks).",
            self.requests_running.get(),
        );
        gauge(
            &mut out,
            "kura:num_requests_waiting",
            "Requests queued, including preempted ones.",
            self.requests_waiting.get(),
        );
        gauge(
            &mut out,
            "kura:num_requests_preempted_waiting",
            "Preempted requests waiting to resume.",
            self.requests_preempted_waiting.get(),
        );
        counter(
            &mut out,
            "kura:num_preemptions_total",
            "Requests preempted because KV blocks ran out.",
            self.preemptions.get(),
        );
        counter(
            &mut out,
            "kura:engine_steps_total",
            "Forward steps run by the engine.",
            self.steps.get(),
        );
        let seconds = |out: &mut String, name: &str, help: &str, us: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                us as f64 / 1e6
            );
        };
        seconds(
            &mut out,
            "kura:engine_forward_seconds_total",
            "Time of the engine's steps in the forward pass and block copies.",
            self.step_forward_us.get(),
        );
        seconds(
            &mut out,
            "kura:engine_step_other_seconds_total",
            "Time of the engine's steps outside the forward pass: scheduling, sampling, detokenization, \
             stop checks, logprob texts and emitting.",
            self.step_other_us.get(),
        );
        counter(
            &mut out,
            "kura:scheduler_passes_total",
            "Scheduling passes of the engine loop, idle ones (nothing could run) included.",
            self.scheduler_passes.get(),
        );
        counter(
            &mut out,
            "kura:prompt_tokens_total",
            "Prompt tokens of admitted requests.",
            self.prompt_tokens.get(),
        );
        counter(
            &mut out,
            "kura:prompt_tokens_computed_total",
            "Prompt tokens whose KV was computed (not reused); recomputation after preemption included.",
            self.prompt_tokens_computed.get(),
        );
        counter(
            &mut out,
            "kura:generation_tokens_total",
            "Tokens generated.",
            self.generation_tokens.get(),
        );
        let _ = writeln!(
            out,
            "# HELP kura:request_success_total Requests finished, by finish reason.\n\
             # TYPE kura:request_success_total counter\n\
             kura:request_success_total{{finished_reason=\"stop\"}} {}\n\
             kura:request_success_total{{finished_reason=\"length\"}} {}",
            self.requests_finished_stop.get(),
            self.requests_finished_length.get()
        );
        counter(
            &mut out,
            "kura:request_cancelled_total",
            "Requests cancelled before finishing (client gone, shutdown).",
            self.requests_cancelled.get(),
        );
        counter(
            &mut out,
            "kura:request_cancelled_stalled_total",
            "Requests cancelled because their client stopped reading for longer than the stalled-client \
             timeout (also counted in kura:request_cancelled_total).",
            self.requests_cancelled_stalled.get(),
        );
        counter(
            &mut out,
            "kura:request_failed_total",
            "Requests that failed in the engine.",
            self.requests_failed.get(),
        );
        let _ = writeln!(
            out,
            "# HELP kura:request_rejected_total Requests refused at admission, by reason.\n\
             # TYPE kura:request_rejected_total counter\n\
             kura:request_rejected_total{{reason=\"queue_full\"}} {}\n\
             kura:request_rejected_total{{reason=\"cannot_fit\"}} {}",
            self.requests_rejected_queue_full.get(),
            self.requests_rejected_too_large.get()
        );
        self.ttft.render(
            &mut out,
            "kura:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
        );
        self.itl.render(
            &mut out,
            "kura:inter_token_latency_seconds",
            "Time between consecutive generated tokens of a choice.",
        );
        self.e2e.render(
            &mut out,
            "kura:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
        );
        self.queue_time.render(
            &mut out,
            "kura:request_queue_time_seconds",
            "Time from arrival to first scheduling.",
        );
        self.render_tiers(&mut out);
        out
    }

    fn render_tiers(&self, out: &mut String) {
        let tiers = [("host", &self.host), ("disk", &self.disk)];
        let family = |out: &mut String,
                      name: &str,
                      kind: &str,
                      help: &str,
                      v: &dyn Fn(&TierMetrics) -> f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (tier, m) in tiers {
                let _ = writeln!(out, "{name}{{tier=\"{tier}\"}} {}", v(m));
            }
        };
        family(
            out,
            "kura:kv_tier_blocks_total",
            "gauge",
            "Blocks a lower KV tier holds at most (0: off).",
            &|m| m.blocks_total.get(),
        );
        family(
            out,
            "kura:kv_tier_blocks_used",
            "gauge",
            "Blocks held by a lower KV tier.",
            &|m| m.blocks_used.get(),
        );
        family(
            out,
            "kura:kv_tier_bytes_used",
            "gauge",
            "KV bytes held by a lower KV tier.",
            &|m| m.bytes_used.get(),
        );
        family(
            out,
            "kura:kv_tier_hit_blocks_total",
            "counter",
            "Prompt blocks found in a lower KV tier and loaded into the pool.",
            &|m| m.hit_blocks.get() as f64,
        );
        family(
            out,
            "kura:kv_tier_loads_total",
            "counter",
            "Loads from a lower KV tier into the pool finished.",
            &|m| m.loads.get() as f64,
        );
        family(
            out,
            "kura:kv_tier_load_failures_total",
            "counter",
            "Loads whose stored block failed its checks (recomputed instead).",
            &|m| m.load_failures.get() as f64,
        );
        family(
            out,
            "kura:kv_tier_stores_total",
            "counter",
            "Blocks stored into a lower KV tier (demotions, write-through, swap).",
            &|m| m.stores.get() as f64,
        );
        family(
            out,
            "kura:kv_tier_evictions_total",
            "counter",
            "Blocks evicted from a lower KV tier to make room.",
            &|m| m.evictions.get() as f64,
        );
        let _ = writeln!(out, "# HELP kura:kv_tier_load_seconds Time of a block's load from a lower tier, queueing included.\n# TYPE kura:kv_tier_load_seconds histogram");
        for (tier, m) in tiers {
            m.load_latency.render_series(
                out,
                "kura:kv_tier_load_seconds",
                &format!("tier=\"{tier}\""),
            );
        }
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        counter(
            out,
            "kura:kv_tier_full_drops_total",
            "Blocks that could not go down because their tier was full of blocks being loaded.",
            self.tier_full_drops.get(),
        );
        counter(out, "kura:kv_tier_checksum_failures_total", "Stored KV blocks that failed a check (checksum, header, identity) and were removed, never served.", self.tier_checksum_failures.get());
        counter(
            out,
            "kura:kv_disk_removed_foreign_total",
            "Block files of another model or KV format removed when the disk tier was opened.",
            self.disk_removed_foreign.get(),
        );
        counter(
            out,
            "kura:kv_disk_reads_total",
            "Block files read from disk (one read serves every request waiting for the block).",
            self.disk_reads.get(),
        );
        counter(
            out,
            "kura:kv_disk_writes_total",
            "Block files written to disk.",
            self.disk_writes.get(),
        );
        counter(
            out,
            "kura:kv_disk_write_errors_total",
            "Block file writes that failed (logged).",
            self.disk_write_errors.get(),
        );
        let live = |f: fn(&kura_tiers::RemoteStats) -> &AtomicU64| {
            self.remote
                .get()
                .map_or(0, |s| f(s).load(Ordering::Relaxed))
        };
        for (name, help, v) in [
            ("kura:kv_remote_stores_total", "Blocks written to the Redis tier (L4).", live(|s| &s.stores)),
            ("kura:kv_remote_fetches_total", "Prompts looked up in the Redis tier.", live(|s| &s.fetches)),
            ("kura:kv_remote_hit_blocks_total", "Blocks fetched from the Redis tier, verified and adopted into the pool (not recomputed).", self.remote_hit_blocks.get()),
            ("kura:kv_remote_errors_total", "Redis commands that failed (unreachable, timeout, error); the request was served without the tier.", live(|s| &s.errors)),
            ("kura:kv_remote_corrupt_total", "Records in Redis that failed a check and were deleted, never served.", live(|s| &s.corrupt)),
            ("kura:kv_remote_rejected_total", "Records in Redis whose MAC failed (written without the fleet secret, or copied under another name): never served, deleted.", live(|s| &s.rejected)),
            ("kura:kv_remote_dropped_total", "Redis writes or lookups dropped (queue full or Redis unreachable).", live(|s| &s.dropped)),
        ] {
            counter(out, name, help, v);
        }
        let _ = writeln!(
            out,
            "# HELP kura:kv_remote_connected 1 while the Redis tier is connected.\n# TYPE kura:kv_remote_connected gauge\nkura:kv_remote_connected {}",
            live(|s| &s.connected)
        );
        counter(
            out,
            "kura:kv_swapped_out_blocks_total",
            "Blocks copied to the host tier when their request was preempted.",
            self.swapped_out_blocks.get(),
        );
        let _ = writeln!(out, "# HELP kura:kv_disk_queue_jobs Jobs queued for the disk thread.\n# TYPE kura:kv_disk_queue_jobs gauge\nkura:kv_disk_queue_jobs {}", self.disk_queue.get());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_count_overflow() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(30));
        h.observe(Duration::from_secs(1000));
        let mut out = String::new();
        h.render(&mut out, "x", "help");
        assert!(out.contains("x_bucket{le=\"0.001\"} 1\n"));
        assert!(out.contains("x_bucket{le=\"0.05\"} 2\n"));
        assert!(out.contains("x_bucket{le=\"300\"} 2\n"));
        assert!(out.contains("x_bucket{le=\"+Inf\"} 3\n"));
        assert!(out.contains("x_count 3\n"));
        assert_eq!(h.count(), 3);
    }

    #[test]
    fn exposition_names_the_documented_metrics() {
        let m = EngineMetrics::default();
        m.prefix_hits_tokens.add(32);
        m.kv_usage_perc.set(0.25);
        let text = m.render_prometheus();
        assert!(text.contains("kura:prefix_cache_hits_total 32\n"));
        assert!(text.contains("kura:kv_cache_usage_perc 0.25\n"));
        assert!(text.contains("# TYPE kura:time_to_first_token_seconds histogram"));
    }
}
