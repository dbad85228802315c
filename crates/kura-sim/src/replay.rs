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
use std::collections::{BinaryHeap, HashSet};
use std::time::Instant;

use kura_kv::{CacheKey, EvictionPolicy, KvCacheConfig, KvCacheManager, KvError, SeqId};
use thiserror::Error;

use crate::report::SimReport;
use crate::trace::{TraceRequest, TRACE_BLOCK_TOKENS};

/// The cache policy replayed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Leaf-first LRU (Kura's default).
    LeafLru,
    /// Plain LRU over all idle blocks (vLLM's order), for comparison.
    Lru,
    /// Prefix caching off.
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

/// Blocks that make eviction impossible for this trace and configuration (an upper bound on what can be
/// cached plus what can be held at once).
fn unbounded_blocks(trace: &[TraceRequest], cfg: &SimConfig) -> u64 {
    let bs = cfg.block_size as u64;
    let distinct: HashSet<u32> = trace
        .iter()
        .flat_map(|r| r.hash_ids.iter().copied())
        .collect();
    // Each distinct 512-token block lies in at most 512/bs + 2 blocks of the replay.
    let cached = distinct.len() as u64 * (u64::from(TRACE_BLOCK_TOKENS) / bs + 2);
    let request_blocks = |r: &TraceRequest| {
        (u64::from(r.input_length) + u64::from(r.output_length)).div_ceil(bs) + 1
    };
    let held = if cfg.overlap {
        // Peak of concurrently held blocks with no hits at all (hits only shorten requests).
        let mut ends: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
        let (mut now, mut peak) = (0u64, 0u64);
        for r in trace {
            while let Some(&Reverse((end, blocks))) = ends.peek() {
                if end > r.timestamp_ms {
                    break;
                }
                ends.pop();
                now -= blocks;
            }
            let blocks = request_blocks(r);
            now += blocks;
            peak = peak.max(now);
            ends.push(Reverse((
                r.timestamp_ms + duration_ms(cfg, r.input_length as usize, r) + 1,
                blocks,
            )));
        }
        peak
    } else {
        trace.iter().map(request_blocks).max().unwrap_or(0)
    };
    cached + held
}

fn duration_ms(cfg: &SimConfig, uncached_tokens: usize, r: &TraceRequest) -> u64 {
    let prefill = uncached_tokens as f64 / cfg.prefill_tokens_per_s * 1000.0;
    let decode = f64::from(r.output_length) * cfg.decode_ms_per_token;
    (prefill + decode).ceil() as u64
}

/// Replays `trace` and reports what the cache did.
pub fn replay(trace: &[TraceRequest], cfg: &SimConfig) -> Result<SimReport, SimError> {
    if cfg.block_size == 0 || cfg.block_size > kura_kv::manager::MAX_BLOCK_SIZE {
        return Err(SimError::Config(format!(
            "--block-size {} is outside 1..={}",
            cfg.block_size,
            kura_kv::manager::MAX_BLOCK_SIZE
        )));
    }
    let rate_ok = cfg.prefill_tokens_per_s.is_finite() && cfg.prefill_tokens_per_s > 0.0;
    let decode_ok = cfg.decode_ms_per_token.is_finite() && cfg.decode_ms_per_token >= 0.0;
    if !rate_ok || !decode_ok {
        return Err(SimError::Config(format!(
            "prefill rate {} tokens/s must be positive and decode time {} ms/token not negative",
            cfg.prefill_tokens_per_s, cfg.decode_ms_per_token
        )));
    }
    let bs = cfg.block_size;
    let num_blocks = match cfg.capacity_tokens {
        Some(tokens) => tokens / bs as u64,
        None => unbounded_blocks(trace, cfg),
    };
    let num_blocks = u32::try_from(num_blocks)
        .ok()
        .filter(|&n| n > 0 && n < u32::MAX - 1)
        .ok_or_else(|| {
            SimError::Config(format!(
                "capacity of {num_blocks} blocks of {bs} tokens is outside 1..{}",
                u32::MAX - 1
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
    let max_output = trace.iter().map(|r| r.output_length).max().unwrap_or(0) as usize;
    // Output token ids are never looked up (output blocks are not indexed); any value will do.
    let output = vec![u32::MAX; max_output];

    let mut report = SimReport {
        policy: cfg.policy.name().to_owned(),
        block_size: bs,
        capacity_blocks: u64::from(num_blocks),
        infinite_capacity: cfg.capacity_tokens.is_none(),
        overlap: cfg.overlap,
        ..SimReport::default()
    };
    let mut prompt = Vec::new();
    let mut running: BinaryHeap<Reverse<(u64, u32, SeqId)>> = BinaryHeap::new();
    let mut clock_ms = 0u64;
    let mut total_delay_ms = 0u64;
    let started = Instant::now();
    for (i, r) in trace.iter().enumerate() {
        prompt.clear();
        r.prompt_tokens(&mut prompt);
        clock_ms = clock_ms.max(r.timestamp_ms);
        release_until(&mut kv, &mut running, clock_ms)?;
        kv.set_time_ms(clock_ms);
        report.requests += 1;
        report.prompt_tokens += prompt.len() as u64;
        report.prompt_blocks += prompt.len().div_ceil(bs) as u64;

        let seq = kv.add_sequence(&key);
        let hit = kv.find_cached_prefix(&prompt, &key);
        let cached = hit.num_cached_tokens();
        let need_output = r.output_length as usize;
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
        if clock_ms > r.timestamp_ms {
            report.delayed_requests += 1;
            total_delay_ms += clock_ms - r.timestamp_ms;
        }
        if !prompt_done {
            kv.free(seq)?;
            report.rejected += 1;
            continue;
        }
        report.hit_tokens += cached as u64;
        report.hit_blocks += hit.num_full_blocks() as u64;
        if kv.num_tokens(seq)? < prompt.len() + need_output {
            report.output_short += 1;
        }
        report.peak_used_blocks = report
            .peak_used_blocks
            .max(u64::from(kv.usage().used_blocks));
        if cfg.overlap {
            let end = clock_ms + duration_ms(cfg, prompt.len() - cached, r);
            running.push(Reverse((end, i as u32, seq)));
        } else {
            kv.free(seq)?;
        }
    }
    while let Some(Reverse((_, _, seq))) = running.pop() {
        kv.free(seq)?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let stats = kv.stats();
    report.evictions = stats.evictions;
    report.partial_hits = stats.partial_hits;
    report.block_ops = stats.block_ops + stats.prefix_query_blocks;
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
    running: &mut BinaryHeap<Reverse<(u64, u32, SeqId)>>,
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
