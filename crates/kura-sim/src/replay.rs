//! The replay loop: every request of a trace looks up its prompt in the cache manager, allocates its blocks
//! (prompt, then output), holds them for its duration on the trace's clock, and frees them.
//!
//! ```text
//!  arrival ─► lookup ─► allocate prompt (hit blocks attached, the rest new) ─► allocate output ─► hold ─► free
//!                          │ not enough blocks: wait for the next release (FIFO); never fits: rejected
//! ```
//!
//! The duration comes from a cost model, not a model: uncached prompt tokens at `prefill_tokens_per_s`,
//! then `output_length` tokens at `decode_ms_per_token`. With `overlap: false` each request is freed at
//! once, which measures the cache alone (the way the trace's own hit ratios are computed). Output blocks
//! hold capacity while the request runs but are not entered in the index: their reuse shows in the trace
//! as the next turn's hash ids.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Instant;

use kura_kv::{CacheKey, EvictionPolicy, KvCacheConfig, KvCacheManager, KvError, SeqId};
use thiserror::Error;

use crate::report::SimReport;
use kura_trace::mooncake::{TraceRequest, TRACE_BLOCK_TOKENS};

/// The cache policy replayed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Policy {
    /// Leaf-first LRU within priority classes (Kura's default).
    LeafLru,
    /// Plain LRU over all idle blocks (vLLM's order): a parent may go before its children.
    Lru,
    /// No prefix caching.
    #[cfg_attr(feature = "clap", value(name = "none"))]
    NoCache,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::LeafLru => "leaf-lru",
            Policy::Lru => "lru",
            Policy::NoCache => "none",
        }
    }
}

/// What to replay and how.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub block_size: usize,
    /// Cache capacity in tokens (rounded down to whole blocks); `None`: enough never to evict.
    pub capacity_tokens: Option<u64>,
    pub policy: Policy,
    /// Hold each request's blocks for its duration (true) or free them at once (false).
    pub overlap: bool,
    pub prefill_tokens_per_s: f64,
    pub decode_ms_per_token: f64,
    pub hash_seed: u64,
}

impl SimConfig {
    /// Checks the settings on their own (before a trace is read); errors name the `kura sim` flag.
    pub fn validate(&self) -> Result<(), SimError> {
        let max_bs = kura_kv::manager::MAX_BLOCK_SIZE;
        if self.block_size == 0 || self.block_size > max_bs {
            return Err(SimError::Config(format!(
                "--block-size {} is outside 1..={max_bs}",
                self.block_size
            )));
        }
        if let Some(tokens) = self.capacity_tokens {
            if tokens < self.block_size as u64 {
                return Err(SimError::Config(format!(
                    "--capacity-tokens {tokens} holds no block of {} tokens: give at least {} \
                     (or leave it out for a cache that never evicts)",
                    self.block_size, self.block_size
                )));
            }
        }
        if !(self.prefill_tokens_per_s.is_finite() && self.prefill_tokens_per_s > 0.0) {
            return Err(SimError::Config(format!(
                "--prefill-tokens-per-s {} must be a positive, finite number of tokens per second",
                self.prefill_tokens_per_s
            )));
        }
        if !(self.decode_ms_per_token.is_finite() && self.decode_ms_per_token >= 0.0) {
            return Err(SimError::Config(format!(
                "--decode-ms-per-token {} must be a finite number of milliseconds, 0 or more \
                 (0: output takes no time)",
                self.decode_ms_per_token
            )));
        }
        Ok(())
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            capacity_tokens: None,
            policy: Policy::LeafLru,
            overlap: true,
            prefill_tokens_per_s: 10_000.0,
            decode_ms_per_token: 20.0,
            hash_seed: 0,
        }
    }
}

#[derive(Debug, Error)]
pub enum SimError {
    #[error("invalid simulation settings: {0}")]
    Config(String),
    #[error(transparent)]
    Kv(#[from] KvError),
}

/// Bytes the replay holds per block of the cache (the manager's block table, hash index and free
/// lists, and the replay's own): about 450 measured on x86-64 Linux, rounded up.
pub(crate) const BYTES_PER_BLOCK: u64 = 512;

/// Whether the bookkeeping of `blocks` blocks of `bs` tokens fits in `available` bytes (no check
/// where that is unknown).
fn check_memory(blocks: u64, bs: usize, available: Option<u64>) -> Result<(), SimError> {
    let Some(available) = available else {
        return Ok(());
    };
    let needed = blocks.saturating_mul(BYTES_PER_BLOCK);
    if needed <= available {
        return Ok(());
    }
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    Err(SimError::Config(format!(
        "this replay needs about {:.1} GiB of bookkeeping for {blocks} blocks of {bs} tokens, more \
         than the {:.1} GiB this machine has available: give a larger --block-size, a smaller \
         --capacity-tokens or fewer requests (--max-requests)",
        gib(needed),
        gib(available)
    )))
}

/// `MemAvailable` of `/proc/meminfo`, where there is one.
pub(crate) fn available_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// Blocks that make eviction impossible for this trace and configuration (an upper bound on what can be
/// cached plus what can be held at once).
fn unbounded_blocks(trace: &[TraceRequest], cfg: &SimConfig) -> u64 {
    let bs = cfg.block_size as u64;
    // Distinct id chains (prefixes of hash_ids), not distinct ids: a trace may reuse an id after different
    // prefixes, and the replay's blocks are keyed by the whole prefix. Nodes of the chains' trie.
    let mut chains: HashMap<(u64, u32), u64> = HashMap::new();
    for r in trace {
        let mut node = 0u64;
        for &h in r.hash_ids() {
            let next = chains.len() as u64 + 1;
            node = *chains.entry((node, h)).or_insert(next);
        }
    }
    // A full replay block is keyed by the chain of the 512-token block holding its last token: at most
    // 512/bs + 1 of them end in one chain block. Each request adds at most one partial block.
    let cached =
        chains.len() as u64 * (u64::from(TRACE_BLOCK_TOKENS) / bs + 2) + trace.len() as u64;
    let request_blocks = |r: &TraceRequest| {
        (u64::from(r.input_length()) + u64::from(r.output_length())).div_ceil(bs) + 1
    };
    let held = if cfg.overlap {
        // Peak of concurrently held blocks with no hits at all (hits only shorten requests).
        let mut ends: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
        let (mut now, mut peak) = (0u64, 0u64);
        for r in trace {
            while let Some(&Reverse((end, blocks))) = ends.peek() {
                if end > r.timestamp_ms() {
                    break;
                }
                ends.pop();
                now -= blocks;
            }
            let blocks = request_blocks(r);
            now += blocks;
            peak = peak.max(now);
            let end = r
                .timestamp_ms()
                .saturating_add(duration_ms(cfg, r.input_length() as usize, r))
                .saturating_add(1);
            ends.push(Reverse((end, blocks)));
        }
        peak
    } else {
        trace.iter().map(request_blocks).max().unwrap_or(0)
    };
    cached + held
}

fn duration_ms(cfg: &SimConfig, uncached_tokens: usize, r: &TraceRequest) -> u64 {
    let prefill = uncached_tokens as f64 / cfg.prefill_tokens_per_s * 1000.0;
    let decode = f64::from(r.output_length()) * cfg.decode_ms_per_token;
    // `as` saturates: an absurdly slow cost model gives u64::MAX, which the callers add saturating.
    (prefill + decode).ceil() as u64
}

/// Replays `trace` and reports what the cache did.
pub fn replay(trace: &[TraceRequest], cfg: &SimConfig) -> Result<SimReport, SimError> {
    replay_with_progress(trace, cfg, &mut |_, _| {})
}

/// [`replay`], calling `progress(requests replayed, trace length)` after each request.
pub fn replay_with_progress(
    trace: &[TraceRequest],
    cfg: &SimConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SimReport, SimError> {
    cfg.validate()?;
    if trace.is_empty() {
        return Err(SimError::Config(
            "the trace holds no request to replay".into(),
        ));
    }
    let bs = cfg.block_size;
    // What this trace can ever occupy: a larger cache never evicts either, so it is replayed with this
    // many blocks and gives the same figures without allocating the rest.
    let usable = unbounded_blocks(trace, cfg);
    let capacity_blocks = match cfg.capacity_tokens {
        Some(tokens) => tokens / bs as u64,
        None => usable,
    };
    let allocated = capacity_blocks.min(usable);
    // Refused before the manager allocates: the kernel lends memory it does not have, and the
    // process would grow until it is killed.
    check_memory(allocated, bs, available_memory_bytes())?;
    // The manager's block ids stop below its two sentinels (u32::MAX - 1 and u32::MAX).
    let max_blocks = u64::from(u32::MAX - 2);
    let num_blocks = u32::try_from(allocated)
        .ok()
        .filter(|&n| n > 0 && u64::from(n) <= max_blocks)
        .ok_or_else(|| {
            SimError::Config(format!(
                "this trace needs up to {allocated} blocks of {bs} tokens, more than the {max_blocks} \
                 the cache manager addresses: give a larger --block-size or a smaller --capacity-tokens"
            ))
        })?;
    let mut kv_cfg = KvCacheConfig::new(num_blocks, bs);
    kv_cfg.hash_seed = Some(cfg.hash_seed);
    kv_cfg.enable_prefix_caching = cfg.policy != Policy::NoCache;
    kv_cfg.eviction_policy = match cfg.policy {
        Policy::Lru => EvictionPolicy::PlainLru,
        Policy::LeafLru | Policy::NoCache => EvictionPolicy::LeafLru,
    };
    let mut kv = KvCacheManager::new(kv_cfg)?;
    let key = CacheKey::new();
    let max_output = trace.iter().map(|r| r.output_length()).max().unwrap_or(0) as usize;
    // Output token ids are never looked up (output blocks are not indexed); any value will do.
    let output = vec![u32::MAX; max_output];

    let mut report = SimReport {
        policy: cfg.policy.name().to_owned(),
        block_size: bs,
        capacity_blocks,
        allocated_blocks: u64::from(num_blocks),
        infinite_capacity: cfg.capacity_tokens.is_none(),
        overlap: cfg.overlap,
        ..SimReport::default()
    };
    let mut prompt = Vec::new();
    let mut running: BinaryHeap<Reverse<(u64, usize, SeqId)>> = BinaryHeap::new();
    let mut clock_ms = 0u64;
    let mut total_delay_ms = 0u64;
    let started = Instant::now();
    for (i, r) in trace.iter().enumerate() {
        progress(i, trace.len());
        prompt.clear();
        r.prompt_tokens(&mut prompt);
        clock_ms = clock_ms.max(r.timestamp_ms());
        release_until(&mut kv, &mut running, clock_ms)?;
        kv.set_time_ms(clock_ms);
        report.requests += 1;
        report.prompt_tokens += prompt.len() as u64;
        report.prompt_blocks += prompt.len().div_ceil(bs) as u64;

        let seq = kv.add_sequence(&key);
        let hit = kv.find_cached_prefix(&prompt, &key);
        let cached = hit.num_cached_tokens();
        let need_output = r.output_length() as usize;
        if (prompt.len() + need_output).div_ceil(bs) > num_blocks as usize {
            // Larger than the whole cache: it would never fit.
            kv.free(seq)?;
            report.rejected += 1;
            continue;
        }
        // Out of blocks: wait for the next release (FIFO); the hit stays valid, releases evict nothing.
        let mut prompt_done = false;
        loop {
            if !prompt_done {
                prompt_done = kv
                    .allocate_slots(seq, &prompt[cached..], Some(&hit))?
                    .is_some();
                if prompt_done {
                    kv.mark_computed(seq, prompt.len())?;
                    kv.set_caching(seq, false)?;
                }
            }
            if prompt_done
                && kv
                    .allocate_slots(seq, &output[..need_output], None)?
                    .is_some()
            {
                kv.mark_computed(seq, prompt.len() + need_output)?;
                break;
            }
            let Some(Reverse((end, _, done))) = running.pop() else {
                break;
            };
            clock_ms = clock_ms.max(end);
            kv.free(done)?;
            kv.set_time_ms(clock_ms);
        }
        if clock_ms > r.timestamp_ms() {
            report.delayed_requests += 1;
            total_delay_ms = total_delay_ms.saturating_add(clock_ms - r.timestamp_ms());
        }
        if !prompt_done {
            kv.free(seq)?;
            report.rejected += 1;
            continue;
        }
        if kv.num_tokens(seq)? < prompt.len() + need_output {
            report.output_short += 1;
        }
        report.peak_used_blocks = report
            .peak_used_blocks
            .max(u64::from(kv.usage().used_blocks));
        if cfg.overlap {
            let end = clock_ms.saturating_add(duration_ms(cfg, prompt.len() - cached, r));
            running.push(Reverse((end, i, seq)));
        } else {
            kv.free(seq)?;
        }
    }
    progress(trace.len(), trace.len());
    while let Some(Reverse((_, _, seq))) = running.pop() {
        kv.free(seq)?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let stats = kv.stats();
    report.hit_tokens = stats.prefix_hit_tokens;
    report.hit_blocks = stats.prefix_hit_blocks;
    report.evictions = stats.evictions;
    report.partial_hits = stats.partial_hits;
    report.block_ops = stats.block_ops + stats.lookup_blocks;
    report.elapsed_s = elapsed;
    report.ops_per_sec = report.block_ops as f64 / elapsed.max(1e-9);
    report.hit_ratio_tokens = ratio(report.hit_tokens, report.prompt_tokens);
    report.hit_ratio_blocks = ratio(report.hit_blocks, report.prompt_blocks);
    report.mean_delay_ms = if report.delayed_requests == 0 {
        0.0
    } else {
        total_delay_ms as f64 / report.delayed_requests as f64
    };
    Ok(report)
}

fn release_until(
    kv: &mut KvCacheManager,
    running: &mut BinaryHeap<Reverse<(u64, usize, SeqId)>>,
    now_ms: u64,
) -> Result<(), KvError> {
    while let Some(&Reverse((end, _, seq))) = running.peek() {
        if end > now_ms {
            break;
        }
        running.pop();
        kv.free(seq)?;
    }
    Ok(())
}

fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_larger_than_the_memory_available_is_refused_before_it_allocates() {
        let gib = 1u64 << 30;
        let err = check_memory(16_000_000, 1, Some(gib))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("about 7.6 GiB of bookkeeping for 16000000 blocks of 1 tokens")
                && err.contains("the 1.0 GiB this machine has available")
                && err.contains("--block-size"),
            "{err}"
        );
        assert!(check_memory(1_000_000, 16, Some(gib)).is_ok());
        assert!(check_memory(u64::MAX, 16, None).is_ok());
        // Read from this machine: a positive amount.
        assert!(available_memory_bytes().is_some_and(|b| b > 0));
    }
}
