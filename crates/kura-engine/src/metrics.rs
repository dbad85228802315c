//! The engine's counters, gauges and latency histograms, written by the engine thread and read by
//! `/metrics`. The types and the text writer are `kura-metrics`'s (relaxed atomics: a scrape may see one
//! counter a step ahead of another, never a torn value; one atomic add per update).

use std::sync::atomic::{AtomicU64, Ordering};

pub use kura_metrics::{Counter, Gauge, Histogram};
use kura_metrics::{Exposition, Kind};
use kura_request::MissReason;

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
    /// Speculative decoding: drafts checked, their tokens, and the tokens of them the sampler kept.
    pub spec_drafts: Counter,
    pub spec_draft_tokens: Counter,
    pub spec_accepted_tokens: Counter,
    /// Passes in which no sequence drafted because at least `disable_by_batch_size` decoded.
    pub spec_paused_steps: Counter,
    /// Draft tokens kept by their position in the draft (0: its first), for the first
    /// `spec_positions` positions (`num_speculative_tokens`; 0 without speculative decoding).
    pub spec_accepted_per_pos: [Counter; crate::draft::MAX_DRAFT_TOKENS],
    pub spec_positions: std::sync::atomic::AtomicUsize,
    // requests
    pub requests_finished_stop: Counter,
    pub requests_finished_length: Counter,
    /// Prompts not cached as far as they could have been, by [`MissReason`] (in `MissReason::ALL`'s
    /// order).
    pub cache_misses: [Counter; MissReason::ALL.len()],
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
    /// The tier cost check, per tier (host, disk, Redis: `CostTier`'s order): blocks it left to be
    /// recomputed, the load bandwidth it uses and its decision.
    pub tier_cost: [TierCostMetrics; 3],
    /// The prefill rate the tier cost check uses (tokens per second).
    pub prefill_tokens_per_s: Gauge,
    /// The prompt tokens a step beside decodes may compute (`EngineConfig::prefill_step`); 0: no cap.
    pub prefill_cap_tokens: Gauge,
    /// The lower tiers: host memory (L2) and disk (L3).
    pub host: TierMetrics,
    pub disk: TierMetrics,
    /// Blocks that could not go down because their tier was full of blocks being loaded.
    pub tier_full_drops: Counter,
    /// Blocks copied into the host tier ahead of their eviction from the pool (`--kv-store-ahead`).
    pub host_stored_ahead: Counter,
    /// Evictions from the pool that copied their block down as they evicted it (not stored ahead).
    pub evictions_copied: Counter,
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

/// A family with one series per lower tier: name, help, and the tier's metric.
type TierFamily<T> = (&'static str, &'static str, fn(&TierMetrics) -> &T);

/// What the tier cost check says about one tier.
#[derive(Debug, Default)]
pub struct TierCostMetrics {
    /// Prompt blocks found in the tier and recomputed because loading them was judged slower (Redis:
    /// blocks missing locally that were not looked up).
    pub recomputed_blocks: Counter,
    /// Load bandwidth, bytes per second (measured, or the start value).
    pub load_bandwidth: Gauge,
    /// 1 while the tier's blocks are loaded, 0 while they are recomputed.
    pub load_chosen: Gauge,
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
    /// Bytes of the loads that landed (into the pool) and of the stores (out of it): what crossed
    /// between the pool and this tier in each direction (on a GPU, over PCIe for the host tier).
    pub loaded_bytes: Counter,
    pub stored_bytes: Counter,
    /// Blocks evicted from this tier to make room.
    pub evictions: Counter,
}

impl EngineMetrics {
    /// The lower tiers' metrics, by the name their series carry (`tier="host"`, `tier="disk"`).
    pub fn tiers(&self) -> [(&'static str, &TierMetrics); 2] {
        [("host", &self.host), ("disk", &self.disk)]
    }

    /// Counts a prompt that missed the cache for `reason`.
    pub fn count_miss(&self, reason: MissReason) {
        if let Some(i) = MissReason::ALL.iter().position(|r| *r == reason) {
            self.cache_misses[i].add(1);
        }
    }

    /// Prometheus text exposition of every metric.
    pub fn render_prometheus(&self) -> String {
        let mut e = Exposition::with_capacity(16 * 1024);
        e.gauge(
            "kura:kv_cache_usage_perc",
            "Fraction of KV blocks referenced by live requests (1 = full).",
            self.kv_usage_perc.get(),
        );
        e.gauge(
            "kura:kv_cache_blocks_total",
            "KV blocks in the pool.",
            self.kv_blocks_total.get(),
        );
        e.gauge(
            "kura:kv_cache_blocks_used",
            "KV blocks referenced by live requests.",
            self.kv_blocks_used.get(),
        );
        e.gauge(
            "kura:kv_cache_blocks_cached",
            "Unreferenced KV blocks still holding a reusable cached prefix.",
            self.kv_blocks_cached.get(),
        );
        e.gauge(
            "kura:kv_pins",
            "Live pinned prefixes (cache_control breakpoints, prompt_cache_retention, saved contexts).",
            self.pins.get(),
        );
        e.gauge(
            "kura:kv_pinned_blocks",
            "KV blocks of the pool held by pinned prefixes.",
            self.pinned_blocks.get(),
        );
        e.gauge(
            "kura:kv_pin_budget_blocks",
            "Most KV blocks of the pool that pinned prefixes may hold (--kv-pin-budget).",
            self.pin_budget_blocks.get(),
        );
        e.counter(
            "kura:kv_pins_demoted_total",
            "Pinned prefixes moved out of the pool to the lower tiers because the pin budget was spent.",
            self.pins_demoted.get(),
        );
        e.counter(
            "kura:kv_pins_expired_total",
            "Pinned prefixes released because their time to live ended.",
            self.pins_expired.get(),
        );
        e.gauge(
            "kura:kv_reserved_blocks",
            "KV blocks running requests will still take to reach prompt + max_tokens (every choice).",
            self.kv_reserved_blocks.get(),
        );
        e.counter(
            "kura:prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            self.prefix_queries_tokens.get(),
        );
        e.counter(
            "kura:prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache (computed or still being computed).",
            self.prefix_hits_tokens.get(),
        );
        e.counter(
            "kura:prefix_cache_pending_hits_total",
            "Prompt tokens reused from blocks another request was still computing.",
            self.prefix_pending_hit_tokens.get(),
        );
        e.counter(
            "kura:prefix_cache_pending_waits_total",
            "Scheduler steps in which a request waited for another request's pending blocks.",
            self.pending_waits.get(),
        );
        e.counter(
            "kura:kv_cache_evictions_total",
            "Cached KV blocks evicted to make room.",
            self.kv_evictions.get(),
        );
        if self.kv_pages_total.get() > 0.0 {
            e.gauge(
                "kura:kv_pages_total",
                "Pages of the hybrid pool (one layer of one block each).",
                self.kv_pages_total.get(),
            );
            e.gauge(
                "kura:kv_pages_free",
                "Pages of the hybrid pool on its free list.",
                self.kv_pages_free.get(),
            );
            e.gauge(
                "kura:kv_pages_idle_window",
                "Pages of sliding layers kept for cached blocks no request reads now (reclaimed first).",
                self.kv_pages_idle_window.get(),
            );
            e.counter(
                "kura:kv_window_part_drops_total",
                "Sliding layers' pages of cached blocks dropped to make room.",
                self.kv_window_part_drops.get(),
            );
        }
        e.gauge(
            "kura:num_requests_running",
            "Requests scheduled (holding KV blocks).",
            self.requests_running.get(),
        );
        e.gauge(
            "kura:num_requests_waiting",
            "Requests queued, including preempted ones.",
            self.requests_waiting.get(),
        );
        e.gauge(
            "kura:num_requests_preempted_waiting",
            "Preempted requests waiting to resume.",
            self.requests_preempted_waiting.get(),
        );
        e.counter(
            "kura:num_preemptions_total",
            "Requests preempted because KV blocks ran out.",
            self.preemptions.get(),
        );
        e.counter(
            "kura:engine_steps_total",
            "Forward steps run by the engine.",
            self.steps.get(),
        );
        e.counter(
            "kura:engine_forward_seconds_total",
            "Time of the engine's steps in the forward pass and block copies.",
            self.step_forward_us.get() as f64 / 1e6,
        );
        e.counter(
            "kura:engine_step_other_seconds_total",
            "Time of the engine's steps outside the forward pass: scheduling, sampling, detokenization, \
             stop checks, logprob texts and emitting.",
            self.step_other_us.get() as f64 / 1e6,
        );
        e.counter(
            "kura:scheduler_passes_total",
            "Scheduling passes of the engine loop, idle ones (nothing could run) included.",
            self.scheduler_passes.get(),
        );
        e.counter(
            "kura:prompt_tokens_total",
            "Prompt tokens of admitted requests.",
            self.prompt_tokens.get(),
        );
        e.counter(
            "kura:prompt_tokens_computed_total",
            "Prompt tokens whose KV was computed (not reused); recomputation after preemption included.",
            self.prompt_tokens_computed.get(),
        );
        e.counter(
            "kura:generation_tokens_total",
            "Tokens generated.",
            self.generation_tokens.get(),
        );
        e.counter(
            "kura:spec_decode_num_drafts_total",
            "Drafts of speculative decoding checked by a forward step.",
            self.spec_drafts.get(),
        );
        e.counter(
            "kura:spec_decode_num_draft_tokens_total",
            "Draft tokens checked by a forward step.",
            self.spec_draft_tokens.get(),
        );
        e.counter(
            "kura:spec_decode_num_accepted_tokens_total",
            "Draft tokens the sampler drew as proposed, kept without a step of their own.",
            self.spec_accepted_tokens.get(),
        );
        let positions = self
            .spec_positions
            .load(Ordering::Relaxed)
            .min(self.spec_accepted_per_pos.len());
        if positions > 0 {
            let name = "kura:spec_decode_num_accepted_tokens_per_pos_total";
            e.family(
                name,
                "Draft tokens kept, by their position in their draft (0: a draft's first token).",
                Kind::Counter,
            );
            for (i, c) in self.spec_accepted_per_pos[..positions].iter().enumerate() {
                e.sample(name, &[("position", &i.to_string())], c.get());
            }
        }
        e.counter(
            "kura:spec_decode_paused_steps_total",
            "Passes in which no sequence drafted: at least disable_by_batch_size sequences decoded.",
            self.spec_paused_steps.get(),
        );
        let name = "kura:request_success_total";
        e.family(name, "Requests finished, by finish reason.", Kind::Counter);
        for (reason, c) in [
            ("stop", &self.requests_finished_stop),
            ("length", &self.requests_finished_length),
        ] {
            e.sample(name, &[("finished_reason", reason)], c.get());
        }
        let name = "kura:prefix_cache_misses_total";
        e.family(
            name,
            "Prompts not cached as far as they could have been, by why (never_seen, evicted, diverged, \
             template_rerendered, salt_differs).",
            Kind::Counter,
        );
        for (reason, c) in MissReason::ALL.iter().zip(&self.cache_misses) {
            e.sample(name, &[("reason", reason.as_str())], c.get());
        }
        e.counter(
            "kura:request_cancelled_total",
            "Requests cancelled before finishing (client gone, shutdown).",
            self.requests_cancelled.get(),
        );
        e.counter(
            "kura:request_cancelled_stalled_total",
            "Requests cancelled because their client stopped reading for longer than the stalled-client \
             timeout (also counted in kura:request_cancelled_total).",
            self.requests_cancelled_stalled.get(),
        );
        e.counter(
            "kura:request_failed_total",
            "Requests that failed in the engine.",
            self.requests_failed.get(),
        );
        let name = "kura:request_rejected_total";
        e.family(
            name,
            "Requests refused at admission, by reason.",
            Kind::Counter,
        );
        for (reason, c) in [
            ("queue_full", &self.requests_rejected_queue_full),
            ("cannot_fit", &self.requests_rejected_too_large),
        ] {
            e.sample(name, &[("reason", reason)], c.get());
        }
        e.histogram(
            "kura:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            &self.ttft,
        );
        e.histogram(
            "kura:inter_token_latency_seconds",
            "Time between consecutive generated tokens of a choice.",
            &self.itl,
        );
        e.histogram(
            "kura:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            &self.e2e,
        );
        e.histogram(
            "kura:request_queue_time_seconds",
            "Time from arrival to first scheduling.",
            &self.queue_time,
        );
        self.render_tiers(&mut e);
        e.finish()
    }

    fn render_tiers(&self, e: &mut Exposition) {
        let tiers = self.tiers();
        let gauges: [TierFamily<Gauge>; 3] = [
            (
                "kura:kv_tier_blocks_total",
                "Blocks a lower KV tier holds at most (0: off).",
                |m| &m.blocks_total,
            ),
            (
                "kura:kv_tier_blocks_used",
                "Blocks held by a lower KV tier.",
                |m| &m.blocks_used,
            ),
            (
                "kura:kv_tier_bytes_used",
                "KV bytes held by a lower KV tier.",
                |m| &m.bytes_used,
            ),
        ];
        for (name, help, gauge) in gauges {
            e.family(name, help, Kind::Gauge);
            for (tier, m) in tiers {
                e.sample(name, &[("tier", tier)], gauge(m).get());
            }
        }
        let counters: [TierFamily<Counter>; 7] = [
            (
                "kura:kv_tier_hit_blocks_total",
                "Prompt blocks found in a lower KV tier and loaded into the pool.",
                |m| &m.hit_blocks,
            ),
            (
                "kura:kv_tier_loads_total",
                "Loads from a lower KV tier into the pool finished.",
                |m| &m.loads,
            ),
            (
                "kura:kv_tier_load_failures_total",
                "Loads whose stored block failed its checks (recomputed instead).",
                |m| &m.load_failures,
            ),
            (
                "kura:kv_tier_stores_total",
                "Blocks stored into a lower KV tier (demotions, write-through, swap).",
                |m| &m.stores,
            ),
            (
                "kura:kv_tier_evictions_total",
                "Blocks evicted from a lower KV tier to make room.",
                |m| &m.evictions,
            ),
            (
                "kura:kv_tier_loaded_bytes_total",
                "Bytes loaded from a lower KV tier into the pool.",
                |m| &m.loaded_bytes,
            ),
            (
                "kura:kv_tier_stored_bytes_total",
                "Bytes stored from the pool into a lower KV tier.",
                |m| &m.stored_bytes,
            ),
        ];
        for (name, help, counter) in counters {
            e.family(name, help, Kind::Counter);
            for (tier, m) in tiers {
                e.sample(name, &[("tier", tier)], counter(m).get());
            }
        }
        let name = "kura:kv_tier_load_seconds";
        e.family(
            name,
            "Time of a block's load from a lower tier, queueing included.",
            Kind::Histogram,
        );
        for (tier, m) in tiers {
            e.histogram_series(name, &[("tier", tier)], &m.load_latency);
        }
        let cost = [("host", 0), ("disk", 1), ("redis", 2)];
        let name = "kura:kv_tier_recomputed_blocks_total";
        e.family(
            name,
            "Prompt blocks found in a lower KV tier and recomputed, because the tier cost check judged \
             recomputing them faster than loading (redis: blocks missing locally that were not looked up).",
            Kind::Counter,
        );
        for (tier, i) in cost {
            e.sample(
                name,
                &[("tier", tier)],
                self.tier_cost[i].recomputed_blocks.get(),
            );
        }
        let name = "kura:kv_tier_load_bandwidth_bytes_per_second";
        e.family(
            name,
            "A lower KV tier's load bandwidth as the tier cost check uses it (measured, or its start value).",
            Kind::Gauge,
        );
        for (tier, i) in cost {
            e.sample(
                name,
                &[("tier", tier)],
                self.tier_cost[i].load_bandwidth.get(),
            );
        }
        let name = "kura:kv_tier_load_chosen";
        e.family(
            name,
            "1 while the tier cost check loads a lower KV tier's blocks, 0 while it recomputes them.",
            Kind::Gauge,
        );
        for (tier, i) in cost {
            e.sample(name, &[("tier", tier)], self.tier_cost[i].load_chosen.get());
        }
        e.gauge(
            "kura:prefill_tokens_per_second",
            "Prefill rate the tier cost check compares the tiers with (tokens per second of forward steps that are mostly prefill).",
            self.prefill_tokens_per_s.get(),
        );
        e.gauge(
            "kura:prefill_cap_tokens",
            "Prompt tokens a step that carries decodes may compute, sized to --prefill-step-ms at the measured prefill rate (0: no cap).",
            self.prefill_cap_tokens.get(),
        );
        e.counter(
            "kura:kv_host_stored_ahead_blocks_total",
            "Blocks copied into the host KV tier ahead of their eviction from the pool (among the host tier's stores).",
            self.host_stored_ahead.get(),
        );
        e.counter(
            "kura:kv_evictions_copied_total",
            "Evictions from the KV pool that copied their block down to a lower tier as they evicted it (on a GPU, the step reusing the block waits for that copy); blocks stored ahead are evicted without one.",
            self.evictions_copied.get(),
        );
        e.counter(
            "kura:kv_tier_full_drops_total",
            "Blocks that could not go down because their tier was full of blocks being loaded.",
            self.tier_full_drops.get(),
        );
        e.counter(
            "kura:kv_tier_checksum_failures_total",
            "Stored KV blocks that failed a check (checksum, header, identity) and were removed, never served.",
            self.tier_checksum_failures.get(),
        );
        e.counter(
            "kura:kv_disk_removed_foreign_total",
            "Block files of another model or KV format removed when the disk tier was opened.",
            self.disk_removed_foreign.get(),
        );
        e.counter(
            "kura:kv_disk_reads_total",
            "Block files read from disk (one read serves every request waiting for the block).",
            self.disk_reads.get(),
        );
        e.counter(
            "kura:kv_disk_writes_total",
            "Block files written to disk.",
            self.disk_writes.get(),
        );
        e.counter(
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
            ("kura:kv_remote_dropped_total", "Redis writes or lookups dropped (queue full, Redis unreachable, a write refused with an error reply, a lookup past its wait).", live(|s| &s.dropped)),
        ] {
            e.counter(name, help, v);
        }
        e.gauge(
            "kura:kv_remote_connected",
            "1 while the Redis tier is connected.",
            live(|s| &s.connected),
        );
        e.counter(
            "kura:kv_swapped_out_blocks_total",
            "Blocks copied to the host tier when their request was preempted.",
            self.swapped_out_blocks.get(),
        );
        e.gauge(
            "kura:kv_disk_queue_jobs",
            "Jobs queued for the disk thread.",
            self.disk_queue.get(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn tier_series_are_labelled_and_hybrid_pages_appear_only_with_a_hybrid_pool() {
        let m = EngineMetrics::default();
        m.host.hit_blocks.add(5);
        m.disk.bytes_used.set(4096.0);
        m.disk.load_latency.observe(Duration::from_millis(3));
        let text = m.render_prometheus();
        assert!(text.contains("kura:kv_tier_hit_blocks_total{tier=\"host\"} 5\n"));
        assert!(text.contains("kura:kv_tier_bytes_used{tier=\"disk\"} 4096\n"));
        assert!(text.contains("kura:kv_tier_load_seconds_bucket{tier=\"disk\",le=\"0.005\"} 1\n"));
        assert!(text.contains("kura:kv_tier_load_seconds_count{tier=\"host\"} 0\n"));
        assert_eq!(
            text.matches("# TYPE kura:kv_tier_load_seconds histogram")
                .count(),
            1
        );
        assert!(!text.contains("kura:kv_pages_total"));
        m.kv_pages_total.set(64.0);
        assert!(m.render_prometheus().contains("kura:kv_pages_total 64\n"));
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
