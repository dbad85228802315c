//! The engine loop: one thread that owns the [`Scheduler`] (and through it the KV cache manager) and the
//! executor, takes commands from [`EngineHandle`]s, and repeats schedule → move blocks between the pool
//! and the lower tiers ([`crate::tiers`]) → copy blocks → forward → sample → hand token ids to the output
//! stage ([`crate::output`], a thread of its own that makes the text). It
//! gives the scheduler the wall clock since the engine started. It blocks when there is nothing to do. The
//! locks it takes: a request's sink (to ask whether its client is behind), the output stage's count of
//! handled messages (waiting on its condition variable, at most `OUTPUT_WAIT`, until the step before last
//! is delivered), the KV event log when KV events are on, the disk worker's completions, and the handle's
//! exit record once, at stop or failure.
//!
//! A panic anywhere in the loop (scheduler invariant, kernel, sink) is caught on the engine thread: it is
//! logged with its message, recorded in [`Shared`] (so that [`EngineHandle::is_alive`] turns false and
//! [`EngineHandle::wait_exit`] returns), every request in the engine fails with
//! [`RequestError::EngineFailed`], and the thread stays behind as a tombstone that fails every command
//! still arriving, so no request is left without an answer. The KV state is not trusted after a panic:
//! the tombstone touches only the sinks. An executor error the engine cannot go on after (a fatal
//! [`ExecError`] of a step, any error of a block copy) ends the loop the same way, with the executor's
//! message ([`crate::backend::ExecutorFailed`]); a step error that is not fatal fails that step's
//! requests only.

use std::any::Any;
use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kura_kv::{BlockCopy, CacheKey, EvictionPolicy, KvError, Tier, TierMove};
use rayon::prelude::*;

use crate::inspect::{self, TickTimes};
use crate::miss::SeenLog;
use crate::sampling::Sampled;
use crate::score::{score_chunk, PromptScores, SCORE_ROWS_BYTES};

use crate::backend::{
    executor_failed, unanswered, ExecError, Executor, ExecutorFailed, OrEnd, Row, SeqInput,
    TextCodec, Want,
};
use crate::cost::{CostModel, CostTier, TierCostCheck};
use crate::draft::NgramDraft;
use crate::handle::{Command, EngineExit, EngineHandle, EngineInfo, Shared};
use crate::kv_events::{KvEventLog, KvEventsSetup};
use crate::metrics::EngineMetrics;
use crate::output::{OutMsg, SinkSlot};
use crate::pins::PinTable;
use crate::remote::{Adoption, RemoteTier, RemoteTierSetup};
use crate::request::{CacheMiss, EngineEvent, FinishReason, MissReason, RequestError, Usage};
use crate::seq::{Group, Seq};
use crate::tiers::{LoadDone, TierIo, TierSetup};
use kura_sched::pace::PrefillPace;
use kura_sched::{
    AdmissionMode, Item, OutputLimit, Plan, PreemptionMode, SchedEvent, Scheduler, SchedulerConfig,
    SchedulingPolicy, SeqKey,
};

/// How the engine is sized and limited; resolved by the caller (pool size from `KvLayout`).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model_name: String,
    pub max_model_len: usize,
    pub block_size_tokens: usize,
    pub num_blocks: usize,
    /// Most sequences holding KV blocks at once.
    pub max_num_seqs: usize,
    /// Token budget of one step: prefill chunks plus decode tokens.
    pub max_num_batched_tokens: usize,
    /// Most requests waiting for their first step before new ones get `QueueFull`.
    pub max_queue: usize,
    pub enable_prefix_caching: bool,
    /// Extra identity of the cached KV (model and KV format), so that caches of different models or
    /// formats can never be confused by a later persistent tier.
    pub model_fingerprint: String,
    /// Whether requests' `priority` counts (default: no, first come first served).
    pub scheduling_policy: SchedulingPolicy,
    /// How long a request's sink may report itself full (a client that stopped reading) before the
    /// request is cancelled and its blocks freed. Measured on the engine loop's clock.
    pub stalled_client_timeout: Duration,
    /// Lower KV tiers (host memory, disk) below the pool; none by default.
    pub tiers: TierSetup,
    /// What preemption does with a sequence's blocks (swap needs a host tier).
    pub preemption: PreemptionMode,
    /// Most pool blocks that pinned prefixes may hold (`None`: a quarter of the pool); pins past it are
    /// demoted to the lower tiers, never refused.
    pub pin_budget_blocks: Option<usize>,
    /// Whether a request is admitted only with every block it may need reserved (never preempted).
    pub admission: AdmissionMode,
    /// Sliding layers paged apart (a hybrid pool, see `kura_kv::WindowPool`): `num_blocks` is then the
    /// number of logical blocks, and the executor's storage holds the pool's pages.
    pub window: Option<kura_kv::WindowPool>,
    /// Publish the pool's content as numbered events ([`crate::KvEventLog`]); `None`: no events.
    pub kv_events: Option<KvEventsSetup>,
    /// The shared tier in Redis (L4), if any.
    pub remote: Option<RemoteTierSetup>,
    /// Whether a block is loaded from a lower tier only when that is faster than recomputing it
    /// ([`crate::cost`]); off by default here, on (measured) in `kura serve`.
    pub tier_cost: TierCostCheck,
    /// The most bytes of logits one step brings back for a prompt being scored (its chunk's rows of
    /// every position): the chunk is cut to fit ([`crate::score`]).
    pub score_rows_bytes: usize,
    /// Speculative decoding by n-gram lookup ([`crate::NgramDraft`]); off by default. Not with a
    /// hybrid pool.
    pub speculative: Option<NgramDraft>,
    /// While a sequence decodes, a step computes only as many prompt tokens as take about this long
    /// at the measured prefill rate ([`kura_sched::pace`]), so that decodes do not wait for whole
    /// prompts; `None` (the default here; `kura serve` sets it): the step's token budget alone.
    pub prefill_step: Option<Duration>,
}

/// Tokens of the largest forward step by default (vLLM's chunked-prefill budget); `kura plan` sizes its
/// activation estimate with the same figure.
pub const DEFAULT_MAX_BATCHED_TOKENS: usize = 8192;

impl Default for EngineConfig {
    /// `kura serve`'s defaults for a small pool; callers set the pool and the model's limits.
    fn default() -> Self {
        Self {
            model_name: "model".into(),
            max_model_len: 2048,
            block_size_tokens: 16,
            num_blocks: 1024,
            max_num_seqs: 64,
            max_num_batched_tokens: DEFAULT_MAX_BATCHED_TOKENS,
            max_queue: 256,
            enable_prefix_caching: true,
            model_fingerprint: String::new(),
            scheduling_policy: SchedulingPolicy::default(),
            stalled_client_timeout: Duration::from_secs(30),
            tiers: TierSetup::default(),
            preemption: PreemptionMode::Recompute,
            pin_budget_blocks: None,
            admission: AdmissionMode::MaxUtilization,
            window: None,
            kv_events: None,
            remote: None,
            tier_cost: TierCostCheck::Off,
            score_rows_bytes: SCORE_ROWS_BYTES,
            speculative: None,
            prefill_step: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineStartError {
    #[error("invalid engine configuration: {0}")]
    Config(String),
    #[error("could not create the KV cache manager: {0}")]
    Kv(#[from] KvError),
    #[error("could not start the engine thread: {0}")]
    Thread(#[from] std::io::Error),
    #[error("could not open the lower KV tiers: {0}")]
    Tiers(String),
}

/// Starts the engine thread and returns its handle.
pub fn start_engine(
    config: EngineConfig,
    mut executor: Box<dyn Executor>,
    codec: Arc<dyn TextCodec>,
) -> Result<EngineHandle, EngineStartError> {
    if config.max_num_seqs == 0 || config.max_num_batched_tokens == 0 {
        return Err(EngineStartError::Config(format!(
            "max_num_seqs ({}) and max_num_batched_tokens ({}) must be at least 1",
            config.max_num_seqs, config.max_num_batched_tokens
        )));
    }
    if u32::try_from(config.num_blocks).is_err() {
        return Err(EngineStartError::Config(format!(
            "{} KV blocks is too many",
            config.num_blocks
        )));
    }
    if let Some(draft) = &config.speculative {
        draft.check().map_err(EngineStartError::Config)?;
        if config.window.is_some() {
            return Err(EngineStartError::Config(
                "speculative decoding takes draft tokens back, which the hybrid pool of \
                 sliding-window layers cannot (give --no-hybrid-pool, or leave speculative \
                 decoding off)"
                    .into(),
            ));
        }
    }
    let metrics = Arc::new(EngineMetrics::default());
    if let Some(draft) = &config.speculative {
        metrics
            .spec_positions
            .store(draft.num_tokens, std::sync::atomic::Ordering::Relaxed);
    }
    let remote = match &config.remote {
        None => None,
        Some(setup) => {
            let block_bytes = executor.block_bytes();
            if !config.enable_prefix_caching {
                return Err(EngineStartError::Config(
                    "the Redis tier shares cached prefixes: it needs prefix caching (drop \
                     --no-prefix-cache)"
                        .into(),
                ));
            }
            if block_bytes == 0 || config.window.is_some() {
                return Err(EngineStartError::Tiers(
                    "the Redis tier needs whole blocks whose bytes can leave the pool (not the hybrid \
                     pool of sliding-window layers)"
                        .into(),
                ));
            }
            let fingerprint = xxhash_rust::xxh3::xxh3_128(config.model_fingerprint.as_bytes());
            let tier = RemoteTier::open(setup, config.block_size_tokens, block_bytes, fingerprint)
                .map_err(EngineStartError::Tiers)?;
            tracing::info!(url = %kura_tiers::redact_url(&setup.url), ttl_s = setup.ttl_s, block_bytes, "KV tier L4: Redis");
            let _ = metrics.remote.set(tier.stats().clone());
            Some(tier)
        }
    };
    let tier_config = config.tiers.kv_config();
    // Start values of the tier cost check's bandwidths (a few block reads): only when it measures.
    let probe = config.tier_cost == TierCostCheck::Measured;
    let (mut tiers, restored) = if tier_config.enabled() {
        let block_bytes = executor.block_bytes();
        if block_bytes == 0 {
            return Err(EngineStartError::Tiers(
                "this executor keeps no KV bytes that could move to a lower tier".into(),
            ));
        }
        let (io, restored) = TierIo::open(&config.tiers, block_bytes, &metrics, probe)
            .map_err(EngineStartError::Tiers)?;
        (Some(io), restored)
    } else {
        (None, None)
    };
    let mut sched = Scheduler::new(SchedulerConfig {
        block_size_tokens: config.block_size_tokens,
        num_blocks: config.num_blocks,
        max_num_seqs: config.max_num_seqs,
        max_num_batched_tokens: config.max_num_batched_tokens,
        enable_prefix_caching: config.enable_prefix_caching,
        policy: config.scheduling_policy,
        eviction_policy: EvictionPolicy::LeafLru,
        // Blocks on disk are named by hashes of this seed: the same one after a restart finds them.
        hash_seed: restored.as_ref().map(|r| r.seed),
        tiers: tier_config,
        preemption: config.preemption,
        admission: config.admission,
        window: config.window.clone(),
        record_kv_events: config.kv_events.is_some() || config.remote.is_some(),
    })?;
    if let Some(r) = restored {
        let found = r.blocks.len();
        let kept = sched.restore_disk(r.blocks);
        tracing::info!(
            blocks_found = found,
            blocks_kept = kept,
            "disk KV tier: blocks from earlier runs are cached again"
        );
    }
    if let Some(io) = &tiers {
        let bs = config.block_size_tokens as u64;
        let host = u64::from(tier_config.host_blocks);
        let disk = u64::from(tier_config.disk_blocks);
        tracing::info!(
            "KV tiers: host (L2) {host} blocks = {} tokens, disk (L3) {disk} blocks = {} tokens, {} bytes per block, offload {:?}, preemption {}",
            host * bs,
            disk * bs,
            io.block_bytes(),
            config.tiers.policy,
            config.preemption.as_str(),
        );
    }
    let mut cost = CostModel::new(
        config.tier_cost,
        executor.block_bytes(),
        config.block_size_tokens,
    );
    if let Some(io) = &tiers {
        for &(tier, bytes, took) in &io.probes {
            cost.probe(tier.into(), bytes, took);
        }
    }
    for tier in [Tier::Host, Tier::Disk] {
        sched.set_tier_loadable(tier, cost.load(tier.into()));
    }
    if config.tier_cost != TierCostCheck::Off {
        let present = [
            (CostTier::Host, tier_config.host_blocks > 0),
            (CostTier::Disk, tier_config.disk_blocks > 0),
            (CostTier::Redis, remote.is_some()),
        ];
        for (tier, on) in present {
            if on {
                tracing::info!(
                    "tier cost check: {}: {}",
                    tier.as_str(),
                    cost.describe(tier)
                );
            }
        }
    }
    let info = EngineInfo {
        model_name: config.model_name.clone(),
        max_model_len: config.max_model_len,
        vocab_size: codec.vocab_size(),
        block_size_tokens: config.block_size_tokens,
        num_blocks: config.num_blocks,
        window: config.window.clone(),
        max_queue: config.max_queue,
        prefix_caching: config.enable_prefix_caching,
        scheduling_policy: config.scheduling_policy,
        stalled_client_timeout: config.stalled_client_timeout,
        model_fingerprint: config.model_fingerprint.clone(),
    };
    metrics.kv_blocks_total.set(config.num_blocks as f64);
    metrics
        .host
        .blocks_total
        .set(f64::from(tier_config.host_blocks));
    metrics
        .disk
        .blocks_total
        .set(f64::from(tier_config.disk_blocks));
    let pin_budget = config
        .pin_budget_blocks
        .unwrap_or(config.num_blocks / 4)
        .min(config.num_blocks);
    metrics.pin_budget_blocks.set(pin_budget as f64);
    let kv_events = config
        .kv_events
        .as_ref()
        .map(|k| Arc::new(KvEventLog::new(k)));
    let shared = Arc::new(Shared::new(info, metrics.clone(), kv_events));
    let (tx, rx) = mpsc::channel();
    let (out_tx, out_rx) = mpsc::channel();
    let (finished_tx, finished_rx) = mpsc::channel();
    let output_codec = codec.clone();
    let out_handled = crate::output::Handled::new();
    let handled = out_handled.clone();
    std::thread::Builder::new()
        .name("kura-output".into())
        .spawn(move || crate::output::run(out_rx, output_codec, finished_tx, handled))?;
    // The host tier offered to the executor last, when nothing can fail any more: the engine's core
    // drops the executor (which may have pinned it) before the arena.
    let mut pinned = false;
    if let Some(region) = tiers.as_mut().and_then(TierIo::host_region_mut) {
        let (bytes, t) = (region.len(), Instant::now());
        pinned = executor.register_host_region(region);
        if pinned {
            tracing::info!(
                bytes,
                ms = t.elapsed().as_millis() as u64,
                "host KV tier pinned for the executor's copies"
            );
        }
    }
    let store_ahead = store_ahead_blocks(&config, pinned && tiers.is_some());
    if store_ahead > 0 {
        tracing::info!(
            blocks = store_ahead,
            "the pool's next evictions are stored in the host tier ahead of need"
        );
    }
    let config_block_size = config.block_size_tokens;
    let pace = config.prefill_step.map(PrefillPace::new);
    let core = Core {
        out: Outbox {
            tx: out_tx,
            sent: 0,
            marks: [0, 0],
            handled: out_handled,
        },
        finished_choices: finished_rx,
        eos: codec.eos_token_ids().to_vec(),
        config,
        sched,
        executor,
        shared: shared.clone(),
        metrics,
        groups: HashMap::new(),
        seqs: HashMap::new(),
        started: Instant::now(),
        kv_evictions_seen: 0,
        tiers,
        loads_done: Vec::new(),
        loads_landed: false,
        pins: PinTable::new(pin_budget, config_block_size),
        remote,
        cost,
        pace,
        seen: SeenLog::default(),
        tick_times: TickTimes::default(),
        store_ahead,
    };
    let thread = std::thread::Builder::new()
        .name("kura-engine".into())
        .spawn(move || core.run(rx))?;
    Ok(EngineHandle::new(tx, shared, codec, thread))
}

/// The engine thread's state.
struct Core {
    config: EngineConfig,
    sched: Scheduler,
    executor: Box<dyn Executor>,
    shared: Arc<Shared>,
    /// To the output stage, which turns token ids into the requests' events.
    out: Outbox,
    /// Choices the output stage ended on a stop string.
    finished_choices: Receiver<(u64, u32)>,
    metrics: Arc<EngineMetrics>,
    groups: HashMap<u64, Group>,
    /// The output side of each choice the scheduler holds, by the scheduler's key.
    seqs: HashMap<SeqKey, Seq>,
    eos: Vec<u32>,
    started: Instant,
    kv_evictions_seen: u64,
    /// The lower tiers' bytes, when configured.
    tiers: Option<TierIo>,
    /// Loads finished and not yet reported to the scheduler (a buffer kept between steps).
    loads_done: Vec<LoadDone>,
    /// Whether loads were reported since the last scheduling pass: their waiters can run in the next
    /// one, which then follows at once rather than after an idle wait.
    loads_landed: bool,
    /// Pinned prefixes (context caching).
    pins: PinTable,
    /// The shared tier in Redis (L4), when configured.
    remote: Option<RemoteTier>,
    /// The tier cost check's rates and decisions.
    cost: CostModel,
    /// The prefill cap's figures, when steps beside decodes are paced.
    pace: Option<PrefillPace>,
    /// (KV manager tick, time) samples: the ages of [`inspect`]'s prefixes.
    tick_times: TickTimes,
    /// Recent sequences per cache salt, to tell why a prompt missed the cache.
    seen: SeenLog,
    /// Blocks kept free or stored ahead of their eviction ([`TierSetup::store_ahead`]); 0: off.
    store_ahead: usize,
}

/// The blocks [`TierSetup::store_ahead`] resolves to: as given, or where the executor's stores run
/// beside its steps (`async_stores`: it pinned the host tier) the blocks one step can take (its token
/// budget's blocks, and one more for each sequence a decode step may carry over a block boundary),
/// else none. Never more than the pool, nor half the host tier: blocks stored ahead that pushed one
/// another out of the host tier would be copied again at every step.
/// Records what a scored item's logits of every position (`logits`, rows of `vocab`) say of its
/// group's prompt, and gives back its last position's row (the next token's). An executor that gave
/// other than a row per position ends the engine, as a fatal executor error.
fn score_rows(
    groups: &mut HashMap<u64, Group>,
    group: Option<u64>,
    item: Item,
    mut logits: Vec<f32>,
    vocab: usize,
) -> Vec<f32> {
    let rows = item.end - item.start;
    if vocab == 0 || rows == 0 || logits.len() != rows.saturating_mul(vocab) {
        executor_failed(
            "a forward step",
            &ExecError::Fatal(format!(
                "the executor gave {} logits for {rows} positions of {vocab} tokens",
                logits.len()
            )),
        )
    }
    if let Some(group) = group.and_then(|g| groups.get_mut(&g)) {
        let prompt = &group.request.prompt_tokens;
        if let Some(scores) = group.scores.as_mut() {
            scores.record(prompt, item.start, &logits, vocab);
        }
    }
    logits.drain(..(rows - 1) * vocab);
    logits
}

fn store_ahead_blocks(config: &EngineConfig, async_stores: bool) -> usize {
    if config.tiers.host_blocks == 0 {
        return 0;
    }
    let blocks = match config.tiers.store_ahead {
        Some(n) => n as usize,
        None if async_stores => config
            .max_num_batched_tokens
            .div_ceil(config.block_size_tokens.max(1))
            .saturating_add(config.max_num_seqs),
        None => 0,
    };
    blocks
        .min(config.num_blocks)
        .min(config.tiers.host_blocks as usize / 2)
}

/// The engine's side of the output stage's channel, counting what it sent so that a step can wait for
/// the output of the step before last (see [`crate::output`]).
struct Outbox {
    tx: Sender<OutMsg>,
    sent: u64,
    /// Messages sent by the end of the step before last and of the last step.
    marks: [u64; 2],
    /// Messages the output stage has handled.
    handled: Arc<crate::output::Handled>,
}

/// Longest wait for the output stage before a step goes on regardless (a sink that blocks in `send`).
const OUTPUT_WAIT: Duration = Duration::from_secs(1);

impl Outbox {
    fn send(&mut self, msg: OutMsg) {
        if self.tx.send(msg).is_ok() {
            self.sent += 1;
        }
    }

    /// Waits until the output stage has handled the messages of the step before last.
    fn catch_up(&self) {
        self.wait_for(self.marks[0]);
    }

    /// Waits (at most `OUTPUT_WAIT`) until the output stage has handled `target` messages, blocked on
    /// the output stage's signal.
    fn wait_for(&self, target: u64) {
        self.handled.wait_for(target, OUTPUT_WAIT);
    }

    /// Waits until the output stage has handled everything sent.
    fn flush(&self) {
        self.wait_for(self.sent);
    }

    fn end_step(&mut self) {
        self.marks = [self.marks[1], self.sent];
    }
}

/// First wait of the engine loop when nothing can run; it doubles while nothing runs.
const MIN_IDLE_WAIT: Duration = Duration::from_millis(1);
/// Longest wait of an idle loop that still has requests (the delay before a drained client resumes).
const MAX_IDLE_WAIT: Duration = Duration::from_millis(50);
/// Longest wait for a disk read when nothing else can run (then commands are looked at again).
const LOAD_POLL: Duration = Duration::from_millis(2);

/// Whether a sequence's next token is chosen as where no walk is: it has none, or its walk only
/// counts ([`crate::TokenConstraint::free_next`]).
fn free_next(constraint: &Result<Option<Box<dyn crate::TokenConstraint>>, String>) -> bool {
    match constraint {
        Ok(None) => true,
        Ok(Some(c)) => c.free_next(),
        Err(_) => false,
    }
}

/// The text of a panic payload (`panic!` with a literal gives `&str`, with arguments `String`).
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// Why the engine loop ended, from the payload it unwound with: the executor's failure
/// ([`ExecutorFailed`]) or a panic's message.
fn failure_reason(payload: Box<dyn Any + Send>) -> String {
    match payload.downcast::<ExecutorFailed>() {
        Ok(failed) => format!("the executor failed at {}", failed.0),
        Err(payload) => format!(
            "engine thread panicked: {}",
            panic_message(payload.as_ref())
        ),
    }
}

impl Core {
    fn run(mut self, rx: Receiver<Command>) {
        match panic::catch_unwind(AssertUnwindSafe(|| self.serve(&rx))) {
            Ok(()) => {
                self.fail_all(RequestError::ShuttingDown);
                // The tiers' last moves call the executor: one that fails there ends the stop as a
                // failure with its message, not a silent unwind of this thread.
                let tiers = panic::catch_unwind(AssertUnwindSafe(|| self.shutdown_tiers()));
                self.update_gauges();
                // Every client has its last event before the exit is visible.
                self.out.flush();
                let exit = match tiers {
                    Ok(()) => EngineExit::Stopped,
                    Err(payload) => {
                        let reason = failure_reason(payload);
                        tracing::error!(error = %reason, "stopping the KV tiers failed");
                        EngineExit::Failed(reason)
                    }
                };
                self.shared.set_exit(exit);
            }
            Err(payload) => {
                let reason = failure_reason(payload);
                tracing::error!(
                    error = %reason,
                    "the engine failed; failing every request and refusing new ones"
                );
                // Counted first, so that the metrics are final when the failure is visible; then
                // recorded, so that a submit racing with the failure is refused at the door; then told.
                let groups = self.take_all_dead();
                self.shared.set_exit(EngineExit::Failed(reason.clone()));
                for id in groups {
                    let error = RequestError::EngineFailed(reason.clone());
                    self.out.send(OutMsg::Failed { id, error });
                }
                self.tombstone(&rx, &reason);
            }
        }
    }

    /// After a panic: takes every request out of the engine, counted as failed, without touching the KV
    /// manager (its state may be torn); the caller tells their clients.
    fn take_all_dead(&mut self) -> Vec<u64> {
        let groups: Vec<(u64, Group)> = self.groups.drain().collect();
        for (_, group) in &groups {
            if !group.admitted_once {
                self.shared.queued.fetch_sub(1, Ordering::Relaxed);
            }
            self.metrics.requests_failed.add(1);
        }
        self.seqs.clear();
        self.metrics.requests_running.set(0.0);
        self.metrics.requests_waiting.set(0.0);
        self.metrics.requests_preempted_waiting.set(0.0);
        groups.into_iter().map(|(id, _)| id).collect()
    }

    /// After a failure: answers every request still arriving (submitted before the failure was recorded)
    /// with the failure, until `stop` or until every handle and guard is gone.
    fn tombstone(&mut self, rx: &Receiver<Command>, reason: &str) {
        for command in rx.iter() {
            match command {
                Command::Submit { sink, .. } => {
                    self.shared.queued.fetch_sub(1, Ordering::Relaxed);
                    let error = RequestError::EngineFailed(reason.to_string());
                    self.metrics.requests_failed.add(1);
                    let slot = SinkSlot::new(sink);
                    let _ = panic::catch_unwind(AssertUnwindSafe(|| {
                        slot.send(EngineEvent::Failed(error));
                    }));
                }
                Command::Stop => break,
                Command::Cancel { .. }
                | Command::AbortAll
                | Command::ClockMoved
                | Command::Unpin { .. }
                | Command::Inspect { .. } => {}
            }
        }
    }

    /// The loop proper; returns on `Stop` or when every sender is gone.
    fn serve(&mut self, rx: &Receiver<Command>) {
        // What the start found (a disk tier's blocks and damaged files) is visible before any request.
        self.update_gauges();
        let mut idle_wait = MIN_IDLE_WAIT;
        'outer: loop {
            // Loads still in flight (of cancelled requests) hold blocks until they are reported.
            let parked = self.remote.as_ref().map_or(0, RemoteTier::num_parked);
            if self.sched.is_idle() && self.sched.num_loads() == 0 && parked == 0 {
                match rx.recv() {
                    Ok(c) => {
                        if !self.handle(c) {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
            while let Ok(c) = rx.try_recv() {
                if !self.handle(c) {
                    break 'outer;
                }
            }
            while let Ok((id, choice)) = self.finished_choices.try_recv() {
                self.finish_choice(id, choice);
            }
            if self.step() {
                idle_wait = MIN_IDLE_WAIT;
            } else if self.tiers.as_ref().is_some_and(|t| t.reads_in_flight() > 0) {
                // Waiting for blocks read from disk or copied from the host tier: wait on the loads,
                // not on commands (the loop looks at commands again right after).
                self.poll_loads(LOAD_POLL);
            } else {
                // Nothing could run (every request's client is behind, or waiting for blocks): wait for
                // a command rather than spin. Nothing signals a sink that drains, so the wait doubles up
                // to MAX_IDLE_WAIT: a drained client resumes within that, an idle loop costs nothing.
                let wait = if parked > 0 { MIN_IDLE_WAIT } else { idle_wait };
                idle_wait = (idle_wait * 2).min(MAX_IDLE_WAIT);
                match rx.recv_timeout(wait) {
                    Ok(c) => {
                        if !self.handle(c) {
                            break;
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
        }
    }

    /// Applies a command; `false` = leave the loop.
    fn handle(&mut self, command: Command) -> bool {
        match command {
            Command::Submit { id, request, sink } => {
                let n = request.n;
                let seq = Seq::new(id, 0, &request, &self.eos);
                let slot = SinkSlot::new(sink);
                self.out.send(OutMsg::Open {
                    id,
                    slot: slot.clone(),
                    stop: request.stop.clone(),
                    min_tokens: request.min_tokens,
                    include_stop_str: request.include_stop_str,
                    keep_special: request.keep_special_tokens,
                });
                let key = self.cache_key(&request.cache_salt);
                let scores = request
                    .prompt_logprobs
                    .map(|top| PromptScores::new(request.prompt_tokens.len(), top));
                let group = Group {
                    slot,
                    usage: Usage {
                        prompt_tokens: request.prompt_tokens.len() as u32,
                        ..Usage::default()
                    },
                    request: *request,
                    key,
                    arrival: Instant::now(),
                    forked: n <= 1,
                    live_choices: n,
                    admitted_once: false,
                    window_cut: false,
                    first_token_at: None,
                    full: false,
                    full_since: None,
                    reason: None,
                    prompt_computed: Default::default(),
                    scores,
                };
                // A prompt whose blocks may be in the Redis tier waits for its lookup first.
                let seq = match self.remote.as_mut() {
                    // A prompt being scored reads nothing cached: it does not wait for Redis.
                    Some(remote) if group.scores.is_none() => {
                        let sched = &mut self.sched;
                        let key = &group.key;
                        let load = self.cost.load(CostTier::Redis);
                        remote.park(id, seq, &group.request.prompt_tokens, key, load, |t| {
                            sched.adoptable_prefix_blocks(t, key)
                        })
                    }
                    _ => Some(seq),
                };
                self.groups.insert(id, group);
                if let Some(seq) = seq {
                    self.enqueue(id, seq);
                }
            }
            Command::Cancel { id } => {
                if let Some(remote) = self.remote.as_mut() {
                    remote.unpark(id);
                }
                if self.groups.contains_key(&id) {
                    self.metrics.requests_cancelled.add(1);
                    self.remove_group(id);
                    self.out.send(OutMsg::Forget { id });
                }
            }
            Command::AbortAll => self.fail_all(RequestError::ShuttingDown),
            Command::ClockMoved => self.expire_pins(),
            Command::Unpin { cache_salt, tokens } => {
                let key = self.cache_key(&cache_salt);
                if self.pins.release(&mut self.sched, &key, &tokens) {
                    self.update_pin_gauges();
                }
            }
            Command::Inspect { limit } => {
                let view = inspect::inspect(
                    self.sched.kv(),
                    limit,
                    &self.tick_times,
                    &self.shared.labels,
                    self.started,
                );
                *self
                    .shared
                    .inspected
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(view));
                return true;
            }
            Command::Stop => return false,
        }
        // A cancellation may leave the engine idle (it then blocks without stepping): publish now.
        self.update_gauges();
        true
    }

    /// Hands a submitted request (its group already recorded) to the scheduler.
    fn enqueue(&mut self, id: u64, seq: Seq) {
        let Some(group) = self.groups.get(&id) else {
            return;
        };
        let n = group.request.n;
        let seq_key = self.sched.add_request(
            id,
            group.key.clone(),
            group.request.priority,
            self.started.elapsed(),
            group.request.prompt_tokens.clone(),
            OutputLimit {
                // Generation also ends at the context limit.
                max_tokens: (group.request.max_tokens as usize).min(
                    self.config
                        .max_model_len
                        .saturating_sub(group.request.prompt_tokens.len()),
                ),
                n: n as usize,
            },
        );
        self.seqs.insert(seq_key, seq);
        if group.scores.is_some() {
            let chunk = score_chunk(self.config.score_rows_bytes, self.shared.info.vocab_size);
            self.sched.score_prompt(id, chunk);
            // A one-token prompt has nothing to score.
            self.send_scores_when_done(id);
        }
    }

    /// Sends a request's prompt scores once every prompt token has its score, and lets the scheduler
    /// read its cached prefix again (after a preemption).
    fn send_scores_when_done(&mut self, id: u64) {
        let Some(group) = self.groups.get_mut(&id) else {
            return;
        };
        let Some((rest, ranks)) = group.scores.as_mut().and_then(PromptScores::take) else {
            return;
        };
        group.scores = None;
        let first = group.request.prompt_tokens[0];
        self.sched.prompt_scored(id);
        self.out.send(OutMsg::PromptLogprobs {
            id,
            first,
            rest,
            ranks,
        });
    }

    /// Requests whose Redis lookup is answered (or given up): their blocks adopted, then scheduled.
    fn poll_remote(&mut self) {
        let Some(remote) = self.remote.as_mut() else {
            return;
        };
        let ready = remote.ready();
        for (bytes, took) in remote.samples.drain(..) {
            self.cost.observe_load(CostTier::Redis, bytes, took);
        }
        for (id, seq, adoption) in ready {
            if !self.groups.contains_key(&id) {
                continue;
            }
            if let Some(a) = adoption {
                self.adopt(a);
            }
            self.enqueue(id, seq);
        }
    }

    /// Enters blocks fetched from the Redis tier into the pool as cached blocks.
    fn adopt(&mut self, a: Adoption) {
        let (id, fresh) = match self.sched.begin_adoption(&a.tokens, &a.key, a.held) {
            Ok(Some(started)) => started,
            // The pool's part of the prefix changed meanwhile, or it has no room: the request computes.
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "adopting blocks from the Redis tier failed");
                return;
            }
        };
        // Blocks the allocation evicted are copied down before their bytes are overwritten.
        self.run_tier_moves();
        for (&block, payload) in fresh.iter().zip(&a.payloads) {
            self.executor
                .import_block(block, payload)
                .or_end("a load from the Redis tier");
        }
        if let Err(e) = self.sched.finish_adoption(id) {
            tracing::warn!(error = %e, "adopting blocks from the Redis tier failed");
            return;
        }
        self.metrics.remote_hit_blocks.add(fresh.len() as u64);
        if let Some(remote) = self.remote.as_mut() {
            remote.adopted(&a);
        }
    }

    /// The cache key of a tenant's blocks: the model's fingerprint and the tenant's salt.
    fn cache_key(&self, salt: &Option<String>) -> CacheKey {
        let key = CacheKey::new().with_model_fingerprint(self.config.model_fingerprint.clone());
        match salt {
            Some(salt) => key.with_salt(salt.clone()),
            None => key,
        }
    }

    /// Frees every sequence of the group and forgets it.
    fn remove_group(&mut self, group_id: u64) {
        self.sched.remove_request(group_id);
        // By their group, not by the keys the scheduler returns: it may have removed the request
        // itself already (one that can never fit) and name none, and a late finish of a sequence left
        // behind (a stop string the output stage saw a step behind) would find it without its group.
        self.seqs.retain(|_, s| s.group != group_id);
        if let Some(group) = self.groups.remove(&group_id) {
            if !group.admitted_once {
                self.shared.queued.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    fn fail_group(&mut self, group_id: u64, error: RequestError) {
        if self.groups.contains_key(&group_id) {
            tracing::warn!(request = group_id, %error, "request failed");
            self.metrics.requests_failed.add(1);
            self.out.send(OutMsg::Failed {
                id: group_id,
                error,
            });
        }
        self.remove_group(group_id);
    }

    fn fail_all(&mut self, error: RequestError) {
        let ids: Vec<u64> = self.groups.keys().copied().collect();
        for id in ids {
            if self.groups.contains_key(&id) {
                self.out.send(OutMsg::Failed {
                    id,
                    error: error.clone(),
                });
                self.metrics.requests_cancelled.add(1);
            }
            self.remove_group(id);
        }
    }

    /// One engine step; `false` when nothing could be scheduled and no load landed for the next pass.
    fn step(&mut self) -> bool {
        let started = Instant::now();
        self.tick_times.note(self.sched.kv().tick(), started);
        self.metrics.scheduler_passes.add(1);
        self.expire_pins();
        self.poll_remote();
        self.poll_loads(Duration::ZERO);
        self.out.catch_up();
        self.check_backlogs();
        // This pass sees every load reported so far.
        self.loads_landed = false;
        self.propose_drafts();
        if let Some(p) = &self.pace {
            let cap = p.plan(&mut self.sched);
            let first = cap.fit(0, cap.room_s).max(cap.min_tokens);
            let first = first.min(self.config.max_num_batched_tokens);
            self.metrics.prefill_cap_tokens.set(first as f64);
        }
        let mut plan = self.sched.schedule(self.started.elapsed());
        self.metrics.pending_waits.add(plan.pending_waits);
        for event in std::mem::take(&mut plan.events) {
            self.on_sched_event(event);
        }
        // The blocks announced so far (loads that landed, above) are read for the Redis tier now: the
        // pass may have evicted one of them, and a load or the forward pass would write other KV into
        // it before the end of the step.
        self.publish_kv_events();
        // Blocks the pass sent down are copied before anything (block copies, the forward pass)
        // writes the pool; a block copy whose source a load of the pass overwrites runs before it.
        self.run_tier_moves_around(&mut plan.copies);
        // The blocks the next pass may evict in place of those this one took: copied beside this
        // step's forward pass.
        self.store_ahead();
        let progressed = !plan.items.is_empty();
        let gave_way = !progressed
            && plan.pending_waits == 0
            && self.sched.num_running() == 0
            && self.sched.num_waiting() > 0
            && self.pins.give_way(&mut self.sched);
        if gave_way {
            // Nothing runs, and the queue's head waits for room that pinned blocks hold (a request of
            // more than the pool less the pins): a pin gives way, as it would for a new pin, and the
            // next pass tries again. Otherwise it would wait for the pin's expiry, up to a day, and
            // every request behind it too.
            self.metrics.pins_demoted.add(1);
            self.update_pin_gauges();
        }
        let mut forward = Duration::ZERO;
        if progressed {
            forward = self.execute(plan);
            // Write-through of blocks this step completed.
            self.run_tier_moves();
        } else {
            // Copies of sequences admitted this pass that wait for blocks still loading or being
            // computed: their destinations count the copied tokens as computed from now on.
            Self::run_copies(self.executor.as_mut(), &plan.copies);
        }
        self.cancel_closed();
        // Blocks this step left idle may be among the next evictions.
        self.store_ahead();
        self.update_gauges();
        self.publish_kv_events();
        self.out.end_step();
        if progressed {
            let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
            self.metrics.step_forward_us.add(micros(forward));
            self.metrics
                .step_other_us
                .add(micros(started.elapsed().saturating_sub(forward)));
        }
        // Loads that landed after the pass (synchronous host loads, or ordered ones, reported as they
        // start) let their requests run in the next, as blocks a pin gave back do.
        progressed || self.loads_landed || gave_way
    }

    /// Hands the KV manager's content events to the Redis tier (blocks to write) and to the event log.
    fn publish_kv_events(&mut self) {
        let events = self.sched.take_kv_events();
        if events.is_empty() {
            return;
        }
        if let Some(remote) = self.remote.as_mut() {
            let executor = &self.executor;
            let block_bytes = executor.block_bytes();
            remote.on_events(&events, |block| {
                let mut bytes = vec![0u8; block_bytes];
                executor
                    .export_block(block, &mut bytes)
                    .or_end("a store into the Redis tier");
                bytes
            });
        }
        if let Some(log) = &self.shared.kv_events {
            log.publish(events);
        }
    }

    /// Metrics and clients of what a scheduling pass did.
    fn on_sched_event(&mut self, event: SchedEvent) {
        match event {
            SchedEvent::Admitted {
                request,
                first,
                window_cut_blocks,
                ..
            } => {
                if !first {
                    return;
                }
                let group = self
                    .groups
                    .get_mut(&request)
                    .expect("admitted request's group exists");
                group.admitted_once = true;
                group.window_cut = window_cut_blocks > 0;
                self.shared.queued.fetch_sub(1, Ordering::Relaxed);
                self.metrics
                    .prompt_tokens
                    .add(group.request.prompt_tokens.len() as u64);
                self.metrics.queue_time.observe(group.arrival.elapsed());
            }
            SchedEvent::Preempted {
                seq,
                request,
                swapped_blocks,
            } => {
                self.metrics.preemptions.add(1);
                self.metrics.swapped_out_blocks.add(swapped_blocks as u64);
                // Its n-gram index waits with it no longer: built again when it decodes again.
                if let Some(s) = self.seqs.get_mut(&seq) {
                    s.ngrams = crate::NgramIndex::default();
                }
                tracing::debug!(seq, request, swapped_blocks, "preempted: out of KV blocks");
            }
            SchedEvent::CannotFit {
                request,
                needed_blocks,
                total_blocks,
            } => {
                let error = match self.sched.kv().pages_to_hold(needed_blocks) {
                    Some((needed_pages, total_pages)) => RequestError::CannotFitPages {
                        needed_blocks,
                        needed_pages,
                        total_pages,
                    },
                    None => RequestError::CannotFit {
                        needed_blocks,
                        total_blocks,
                    },
                };
                self.fail_group(request, error)
            }
        }
    }

    /// Runs the planned step; returns the time spent in the executor.
    fn execute(&mut self, plan: Plan) -> Duration {
        let forward_started = Instant::now();
        Self::run_copies(self.executor.as_mut(), &plan.copies);
        // A hybrid pool's layers address pages of their own.
        let pages: Vec<Vec<u32>> = plan
            .items
            .iter()
            .map(|it| {
                let mut out = Vec::new();
                self.sched.layer_pages(it.seq, &mut out);
                out
            })
            .collect();
        let batch: Vec<SeqInput<'_>> = plan
            .items
            .iter()
            .zip(&pages)
            .map(|(it, pages)| SeqInput {
                tokens: &self.sched.tokens(it.seq)[it.start..it.end],
                start_pos: it.start,
                block_table: self.sched.block_table(it.seq),
                layer_pages: pages,
            })
            .collect();
        let wants: Vec<Want> = plan.items.iter().map(|it| self.want(*it)).collect();
        // Rows of each item's last positions: a draft's, and the token before it (speculative decoding).
        let tails: Vec<usize> = plan
            .items
            .iter()
            .map(|it| match self.sched.num_draft(it.seq) {
                d if d > 0 && self.sched.completes(*it) => d + 1,
                _ => 1,
            })
            .collect();
        // Items of prompts being scored need every position's logits: each is its own call, after
        // the step's other items.
        let scored: Vec<bool> = plan.items.iter().map(|it| self.scores(*it)).collect();
        let (mut batch_rest, mut wants_rest, mut tails_rest) = (Vec::new(), Vec::new(), Vec::new());
        for (((input, want), &scored), &tail) in batch.iter().zip(&wants).zip(&scored).zip(&tails) {
            if !scored {
                batch_rest.push(*input);
                wants_rest.push(*want);
                tails_rest.push(tail);
            }
        }
        // Each item's rows before its last: a draft's, empty for the others (in the order of
        // `batch_rest`; none when no item checks a draft).
        let mut drafts_rows: Vec<Vec<Row>> = Vec::new();
        let result = if batch_rest.is_empty() {
            Ok(Vec::new())
        } else if tails_rest.iter().all(|&t| t == 1) {
            self.executor.forward_rows(&batch_rest, &wants_rest)
        } else {
            self.executor
                .forward_tails(&batch_rest, &wants_rest, &tails_rest)
                .and_then(|items| {
                    let mut last = Vec::with_capacity(items.len());
                    for ((mut rows, &tail), &want) in
                        items.into_iter().zip(&tails_rest).zip(&wants_rest)
                    {
                        if rows.len() != tail || !rows.iter().all(|r| want.answered_by(r)) {
                            return Err(ExecError::Fatal(format!(
                                "the executor answered an item's last {tail} positions' {want:?} \
                                 with {rows:?}"
                            )));
                        }
                        last.push(rows.pop().expect("a tail has a row"));
                        drafts_rows.push(rows);
                    }
                    Ok(last)
                })
        };
        // Each scored item's last row once its positions are scored (one item's logits held at a
        // time), or why its request fails.
        let vocab = self.shared.info.vocab_size;
        let mut every: Vec<Option<Result<Vec<f32>, String>>> = Vec::new();
        if result.is_ok() {
            for ((input, item), &scored) in batch.iter().zip(&plan.items).zip(&scored) {
                if !scored {
                    every.push(None);
                    continue;
                }
                let last = match self.executor.forward_every_position(*input) {
                    Ok(logits) => {
                        let group = self.seqs.get(&item.seq).map(|s| s.group);
                        Ok(score_rows(&mut self.groups, group, *item, logits, vocab))
                    }
                    Err(e @ ExecError::Fatal(_)) => executor_failed("a forward step", &e),
                    Err(ExecError::Step(e)) => Err(e),
                };
                every.push(Some(last));
            }
        }
        let forward = forward_started.elapsed();
        drop(batch);
        // A step that failed says nothing of what a step costs.
        if result.is_ok() {
            self.observe_prefill(&plan, forward);
        }
        self.metrics.steps.add(1);
        let rows = match result {
            Ok(rows) => {
                if let Some(why) = unanswered(&wants_rest, &rows) {
                    executor_failed("a forward step", &ExecError::Fatal(why))
                }
                rows
            }
            Err(e @ ExecError::Fatal(_)) => executor_failed("a forward step", &e),
            Err(ExecError::Step(e)) => {
                let mut groups: Vec<u64> = plan
                    .items
                    .iter()
                    .filter_map(|it| self.sched.request_of(it.seq))
                    .collect();
                groups.dedup();
                for g in groups {
                    self.fail_group(g, RequestError::Model(e.clone()));
                }
                return forward;
            }
        };
        // Every item's row, in the plan's order: the scored items' from their last position.
        let mut rows = rows.into_iter();
        let rows: Vec<Row> = plan
            .items
            .iter()
            .zip(&wants)
            .zip(every.into_iter().chain(std::iter::repeat_with(|| None)))
            .map(|((item, &want), every)| match every {
                None => rows.next().unwrap_or(Row::Nothing),
                Some(Ok(last)) => {
                    if let Some(g) = self.sched.request_of(item.seq) {
                        let scored = self.groups.get(&g).and_then(|g| g.scores.as_ref());
                        if let Some(tokens) = scored.map(PromptScores::scored_tokens) {
                            self.sched.prompt_scored_to(g, tokens);
                        }
                        self.send_scores_when_done(g);
                    }
                    match want {
                        Want::Nothing => Row::Nothing,
                        want => Row::answering(want, last),
                    }
                }
                Some(Err(e)) => {
                    if let Some(g) = self.sched.request_of(item.seq) {
                        self.fail_group(g, RequestError::Model(e));
                    }
                    Row::Nothing
                }
            })
            .collect();
        self.choose_batch(&plan.items, &rows);
        // Each item's rows before its last (a draft's check), in the plan's order less the scored items.
        let mut drafts_rows = drafts_rows.into_iter();
        for ((item, row), &scored) in plan.items.iter().zip(&rows).zip(&scored) {
            let before = match scored {
                false => drafts_rows.next().unwrap_or_default(),
                true => Vec::new(),
            };
            self.after_forward(*item, row, before);
        }
        forward
    }

    /// Whether a planned item computes positions of a prompt being scored.
    fn scores(&self, item: Item) -> bool {
        self.seqs
            .get(&item.seq)
            .and_then(|seq| self.groups.get(&seq.group))
            .is_some_and(|g| g.scores.is_some() && item.start + 1 < g.request.prompt_tokens.len())
    }

    /// What a planned item's step gives its sequence: nothing for a prefill chunk with more to come,
    /// the most likely token for a lone greedy choice that needs nothing else of its row, the row of
    /// logits otherwise (the first token of `n > 1` choices: each draws from the same row).
    fn want(&self, item: Item) -> Want {
        if !self.sched.completes(item) {
            return Want::Nothing;
        }
        let Some(seq) = self.seqs.get(&item.seq) else {
            return Want::Nothing; // its group failed: nothing is sampled
        };
        let Some(group) = self.groups.get(&seq.group) else {
            return Want::Nothing;
        };
        if group.request.max_tokens == 0 {
            return Want::Nothing; // a prompt scored only: its choices end without a token
        }
        let alone = group.forked || group.request.n <= 1;
        // A walk that only counts now may not after a draft's first token: a draft's rows are rows.
        let free = match &seq.constraint {
            Ok(None) => true,
            walk => free_next(walk) && self.sched.num_draft(item.seq) == 0,
        };
        if alone && free && seq.sampler.argmax_only() {
            Want::Argmax
        } else {
            Want::Logits
        }
    }

    /// Has the sampler of every sequence that samples from this step's logits, and follows no grammar,
    /// choose its token at once, on the compute pool's threads: a draw costs a pass or more over a row
    /// of logits (tens of microseconds for 50,000 tokens, more for 128,000), and a batch's draws one
    /// after another would hold the engine thread for most of a GPU's step. Each sampler draws as it
    /// would in turn (its own RNG, its counts unchanged until its token is recorded), so the tokens
    /// are those of drawing one by one. A first step of `n > 1` choices forks them later and draws
    /// those in turn.
    fn choose_batch(&mut self, items: &[Item], rows: &[Row]) {
        let logits: HashMap<SeqKey, &[f32]> = items
            .iter()
            .zip(rows)
            .filter(|(it, _)| self.sched.completes(**it) && self.sched.num_draft(it.seq) == 0)
            .filter_map(|(it, row)| Some((it.seq, row.logits()?)))
            .collect();
        if logits.len() < 2 {
            return;
        }
        let mut draws: Vec<(&mut Seq, &[f32])> = self
            .seqs
            .iter_mut()
            .filter(|(_, seq)| free_next(&seq.constraint))
            .filter_map(|(key, seq)| logits.get(key).map(|&row| (seq, row)))
            .collect();
        draws.par_iter_mut().for_each(|(seq, row)| {
            let token = seq.sampler.choose(row, None);
            let logprob = seq.sampler.logprob(row, token);
            seq.chosen = Some(Sampled { token, logprob });
        });
    }

    /// Records a planned item's step, and samples the next token of its sequence (its choices) where
    /// the item completes it. `before`: the rows of a draft's positions before the item's last
    /// (speculative decoding), empty otherwise.
    fn after_forward(&mut self, item: Item, row: &Row, before: Vec<Row>) {
        let Some(group_id) = self.seqs.get(&item.seq).map(|s| s.group) else {
            return; // its group failed earlier in this loop
        };
        let done = self.sched.computed(item);
        let group = self
            .groups
            .get_mut(&group_id)
            .expect("sequence's group exists");
        if done.prefill {
            self.metrics
                .prompt_tokens_computed
                .add((item.end - item.start) as u64);
            let prompt_len = group.request.prompt_tokens.len();
            if group.first_token_at.is_none() {
                group
                    .prompt_computed
                    .add(item.start.min(prompt_len), item.end.min(prompt_len));
            }
        }
        if !done.complete {
            return; // a prefill chunk: more to compute before sampling
        }
        if group.first_token_at.is_none() {
            // What the client is told was cached: every prompt token it did not compute itself (a block
            // whose load from a tier failed was computed, so it is not among them).
            let prompt_len = group.request.prompt_tokens.len();
            let cached = prompt_len.saturating_sub(group.prompt_computed.count());
            group.usage.cached_tokens = cached as u32;
            let salt = &group.request.cache_salt;
            let prompt = &group.request.prompt_tokens;
            group.usage.miss = if group.request.prompt_logprobs.is_some() {
                // Scored: it read nothing cached, whatever the cache held.
                Some(CacheMiss {
                    reason: MissReason::PromptLogprobs,
                    at: 0,
                })
            } else {
                self.seen.explain(
                    salt,
                    prompt,
                    cached,
                    self.config.block_size_tokens,
                    group.request.history_tokens,
                    group.window_cut,
                )
            };
            if let Some(m) = group.usage.miss {
                self.metrics.count_miss(m.reason);
            }
            self.seen.record(salt, prompt);
            if !group.request.pins.is_empty() {
                self.pin_prefixes(group_id);
            }
            if let Some(group) = self.groups.get(&group_id) {
                let usage = Usage {
                    completion_tokens: 0,
                    ..group.usage
                };
                self.out.send(OutMsg::Prompted {
                    id: group_id,
                    usage,
                });
            }
        }
        let group = self
            .groups
            .get_mut(&group_id)
            .expect("sequence's group exists");
        let mut choices = vec![item.seq];
        if !group.forked {
            // n > 1: the other choices share this prompt's blocks (forked, not recomputed) and sample
            // from the same logits with their own seeds.
            group.forked = true;
            for choice in 1..group.request.n {
                let key = self.sched.fork(item.seq);
                let seq = Seq::new(group_id, choice, &group.request, &self.eos);
                self.seqs.insert(key, seq);
                choices.push(key);
            }
        }
        for key in choices {
            // A choice that failed (its grammar could not go on) fails its whole request, the other
            // choices with it: they are gone and have nothing left to sample.
            if !self.seqs.contains_key(&key) {
                continue;
            }
            if before.is_empty() {
                self.sample(key, row);
            } else {
                self.check_draft(key, before.iter().chain([row]));
            }
        }
    }

    /// Samples a sequence's tokens from the rows of its draft's step, one position after another, as
    /// one step at a time would: the first row is its last token's, each next one a draft token's. It
    /// goes on while the token drawn is the draft's next (whose position's row then gives the token
    /// after it) and the sequence goes on; the KV of the draft tokens drawn is kept, the rest given back.
    fn check_draft<'r>(&mut self, key: SeqKey, rows: impl Iterator<Item = &'r Row>) {
        let draft = self.sched.take_draft(key);
        self.metrics.spec_drafts.add(1);
        self.metrics.spec_draft_tokens.add(draft.len() as u64);
        let mut accepted = 0;
        for (i, row) in rows.enumerate() {
            self.sample(key, row);
            if !self.seqs.contains_key(&key) {
                break; // it ended (or failed) on this token
            }
            match (draft.get(i), self.sched.tokens(key).last()) {
                (Some(d), Some(t)) if d == t => accepted += 1,
                _ => break,
            }
        }
        self.metrics.spec_accepted_tokens.add(accepted);
        for kept in self
            .metrics
            .spec_accepted_per_pos
            .iter()
            .take(accepted as usize)
        {
            kept.add(1);
        }
        if let (Some(seq), Some(config)) = (self.seqs.get_mut(&key), self.config.speculative) {
            seq.draft_room = Some(crate::next_draft_room(
                draft.len(),
                accepted as usize,
                config.num_tokens,
            ));
        }
        self.sched.settle_draft(key);
    }

    /// Proposes each decoding sequence's draft for the next pass (speculative decoding): within the
    /// tokens its request may still generate and the context, less the one its step samples anyway;
    /// none while at least `disable_by_batch_size` sequences decode.
    fn propose_drafts(&mut self) {
        let Some(draft) = self.config.speculative else {
            return;
        };
        let keys: Vec<SeqKey> = self
            .seqs
            .keys()
            .copied()
            .filter(|&k| self.sched.decoding(k))
            .collect();
        if !keys.is_empty() && !draft.drafts_at(keys.len()) {
            self.metrics.spec_paused_steps.add(1);
            return;
        }
        for key in keys {
            let Some(seq) = self.seqs.get_mut(&key) else {
                continue;
            };
            let Some(group) = self.groups.get(&seq.group) else {
                continue;
            };
            let tokens = self.sched.tokens(key);
            let by_max =
                (group.request.max_tokens as usize).saturating_sub(self.sched.num_generated(key));
            let by_context = self.config.max_model_len.saturating_sub(tokens.len());
            let most = by_max
                .min(by_context)
                .saturating_sub(1)
                .min(seq.draft_room.unwrap_or(draft.num_tokens));
            let proposal = draft.propose_indexed(&mut seq.ngrams, tokens, most);
            self.sched.propose_draft(key, proposal);
        }
    }

    /// Pins the prefixes a request asked to keep, now that its prompt is computed, and counts the
    /// tokens it wrote into the cache for them.
    fn pin_prefixes(&mut self, group_id: u64) {
        let Some(group) = self.groups.get_mut(&group_id) else {
            return;
        };
        // A prompt found whole in the cache still computes its last token (for its logits): that
        // block was cached all the same, so the cached count is taken to its block's end.
        let bs = self.config.block_size_tokens;
        let cached = (group.usage.cached_tokens as usize).div_ceil(bs) * bs;
        let mut written = 0usize;
        for &spec in &group.request.pins {
            let done = self.pins.pin(
                &mut self.sched,
                &group.key,
                &group.request.prompt_tokens,
                spec,
            );
            self.metrics.pins_demoted.add(done.demoted as u64);
            written = written.max(done.tokens.saturating_sub(cached));
        }
        group.usage.cache_write_tokens = u32::try_from(written).unwrap_or(u32::MAX);
        self.update_pin_gauges();
    }

    /// Releases the pins whose time has come on the cache clock.
    fn expire_pins(&mut self) {
        if self.pins.len() == 0 {
            return;
        }
        let expired = self
            .pins
            .expire(&mut self.sched, self.shared.cache_now_ms());
        if expired > 0 {
            self.metrics.pins_expired.add(expired as u64);
            self.update_pin_gauges();
        }
    }

    fn update_pin_gauges(&self) {
        self.metrics.pins.set(self.pins.len() as f64);
        self.metrics
            .pinned_blocks
            .set(self.pins.pinned_blocks() as f64);
    }

    /// Fails a group whose grammar could not go on, naming the field the grammar came from.
    fn fail_constraint(&mut self, group_id: u64, message: String) {
        let param = self.groups[&group_id]
            .request
            .constraint
            .as_ref()
            .and_then(|c| c.param());
        self.fail_group(group_id, RequestError::Constraint { message, param });
    }

    /// Samples the next token of one choice from its row (or takes the token chosen for it, [`Want`])
    /// and hands it to the output stage; ends the choice on a stop token, at `max_tokens` or at the
    /// context limit.
    fn sample(&mut self, key: SeqKey, row: &Row) {
        let now = Instant::now();
        let seq = self.seqs.get_mut(&key).expect("sampled sequence exists");
        let group_id = seq.group;
        let constrained = !matches!(seq.constraint, Ok(None));
        // Tokens this choice may still generate, this one included.
        let budget = {
            let group = &self.groups[&group_id];
            let by_max =
                (group.request.max_tokens as usize).saturating_sub(self.sched.num_generated(key));
            let by_context = self
                .config
                .max_model_len
                .saturating_sub(self.sched.tokens(key).len());
            by_max.min(by_context)
        };
        if budget == 0 {
            // `max_tokens` 0 (a prompt scored only): the choice ends without a token.
            let choice = seq.choice;
            self.out.send(OutMsg::Ended {
                id: group_id,
                choice,
                reason: FinishReason::Length,
            });
            self.finish_seq(key, FinishReason::Length);
            return;
        }
        let sampler = &mut seq.sampler;
        // (A token drawn beside the batch stands only where the walk, if any, still only counts.)
        let chosen = seq.chosen.take().filter(|_| free_next(&seq.constraint));
        let token = match (&mut seq.constraint, row) {
            (Err(e), _) => Err(e.clone()),
            (Ok(None), &Row::Token(t)) => Ok(t),
            (Ok(None), Row::Logits(l)) => Ok(chosen
                .as_ref()
                .map_or_else(|| sampler.choose(l, None), |c| c.token)),
            // A walk that only counts takes the token chosen as where no walk is.
            (Ok(Some(c)), &Row::Token(t)) if c.free_next() => Ok(t),
            (Ok(Some(c)), Row::Logits(l)) => match chosen.as_ref() {
                Some(drawn) => Ok(drawn.token),
                None => c.choose(budget, &mut |mask| sampler.choose(l, Some(mask))),
            },
            (Ok(_), _) => unreachable!("a sequence that samples was asked its row's logits"),
        };
        let token = match token {
            Ok(t) => t,
            Err(e) => {
                self.fail_constraint(group_id, e);
                return;
            }
        };
        let Sampled { token, logprob } = match (chosen, row.logits()) {
            // Chosen and scored beside the batch's other rows.
            (Some(c), _) => seq.sampler.record_sampled(c),
            (None, Some(l)) => seq.sampler.record(l, token),
            (None, None) => seq.sampler.record_chosen(token),
        };
        // A complete grammar ends the choice: `length` when it was closed early because the budget
        // ran short.
        let grammar_end = match &mut seq.constraint {
            Ok(Some(c)) => match c.accept(token) {
                Ok(()) if c.is_done() && c.closed_early() => Some(FinishReason::Length),
                Ok(()) if c.is_done() => Some(FinishReason::Stop),
                Ok(()) => None,
                Err(e) => {
                    self.fail_constraint(group_id, e);
                    return;
                }
            },
            _ => None,
        };
        let group = self
            .groups
            .get_mut(&group_id)
            .expect("sequence's group exists");
        let seq = self.seqs.get_mut(&key).expect("sampled sequence exists");
        self.metrics.generation_tokens.add(1);
        group.usage.completion_tokens += 1;
        match seq.last_token_at {
            Some(t) => self.metrics.itl.observe(now.saturating_duration_since(t)),
            None => {
                if group.first_token_at.is_none() {
                    group.first_token_at = Some(now);
                    self.metrics
                        .ttft
                        .observe(now.saturating_duration_since(group.arrival));
                }
            }
        }
        seq.last_token_at = Some(now);
        // Under a grammar, end-of-sequence comes only where the grammar may end: it ends the choice
        // even when the request ignores end-of-sequence.
        let stop_token =
            seq.stop_tokens.contains(&token) || (constrained && self.eos.contains(&token));
        let last = if stop_token {
            None
        } else if grammar_end.is_some() {
            grammar_end
        } else if budget <= 1 {
            // This was the last token `max_tokens` or the context allows.
            Some(FinishReason::Length)
        } else {
            None
        };
        let choice = seq.choice;
        self.out.send(OutMsg::Token {
            id: group_id,
            choice,
            token,
            logprob,
            stop_token,
            last,
        });
        if stop_token {
            self.finish_seq(key, FinishReason::Stop);
        } else {
            self.sched.push_token(key, token);
            if let Some(reason) = last {
                self.finish_seq(key, reason);
            }
        }
    }

    /// A choice the output stage ended on a stop string: its blocks are freed now.
    fn finish_choice(&mut self, group_id: u64, choice: u32) {
        let key = self
            .seqs
            .iter()
            .find(|(_, s)| s.group == group_id && s.choice == choice)
            .map(|(&k, _)| k);
        if let Some(key) = key {
            self.finish_seq(key, FinishReason::Stop);
        }
    }

    fn finish_seq(&mut self, key: SeqKey, reason: FinishReason) {
        let Some(seq) = self.seqs.remove(&key) else {
            return;
        };
        if seq.choice == 0 {
            // Its prompt and output, as the next turn of a conversation will find them cached.
            if let Some(group) = self.groups.get(&seq.group) {
                self.seen
                    .record(&group.request.cache_salt, self.sched.tokens(key));
            }
        }
        self.sched.finish(key);
        let Some(group) = self.groups.get_mut(&seq.group) else {
            // Its request failed or was cancelled meanwhile: nothing is left to tell.
            return;
        };
        group.live_choices -= 1;
        group.reason = Some(reason);
        if group.live_choices == 0 {
            let usage = group.usage;
            self.out.send(OutMsg::Done {
                id: seq.group,
                usage,
            });
            self.metrics.e2e.observe(group.arrival.elapsed());
            match reason {
                FinishReason::Stop => self.metrics.requests_finished_stop.add(1),
                FinishReason::Length => self.metrics.requests_finished_length.add(1),
            }
            self.groups.remove(&seq.group);
            // Its other choices (n > 1 not yet forked cannot remain: all choices are counted).
            let _ = self.sched.remove_request(seq.group);
        }
    }

    /// Notes which sinks are full (those groups are not stepped) and cancels the groups whose sink has
    /// been full for longer than `stalled_client_timeout`, freeing their blocks.
    fn check_backlogs(&mut self) {
        let now = Instant::now();
        let timeout = self.config.stalled_client_timeout;
        let mut stalled = Vec::new();
        for (&id, group) in &mut self.groups {
            group.full = group.slot.is_full();
            self.sched.set_blocked(id, group.full);
            if !group.full {
                group.full_since = None;
                continue;
            }
            let since = *group.full_since.get_or_insert(now);
            let waited = now.saturating_duration_since(since);
            if waited >= timeout {
                stalled.push((id, waited));
            }
        }
        for (id, waited) in stalled {
            let waited_ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX);
            tracing::warn!(
                request = id,
                waited_ms,
                "client stopped reading; request cancelled"
            );
            if self.groups.contains_key(&id) {
                self.out.send(OutMsg::Failed {
                    id,
                    error: RequestError::ClientStalled { waited_ms },
                });
            }
            self.metrics.requests_cancelled.add(1);
            self.metrics.requests_cancelled_stalled.add(1);
            self.remove_group(id);
        }
    }

    /// Cancels groups whose reader went away during this step.
    fn cancel_closed(&mut self) {
        let closed: Vec<u64> = self
            .groups
            .iter()
            .filter(|(_, g)| !g.slot.is_open())
            .map(|(&id, _)| id)
            .collect();
        for id in closed {
            self.metrics.requests_cancelled.add(1);
            self.remove_group(id);
            self.out.send(OutMsg::Forget { id });
        }
    }

    /// Copies the pool's next evictions into the host tier ahead of need ([`TierSetup::store_ahead`]),
    /// so that the pass which evicts them copies nothing and the step after it waits for no copy.
    fn store_ahead(&mut self) {
        if self.store_ahead > 0 && self.sched.store_ahead(self.store_ahead) > 0 {
            self.run_tier_moves();
        }
    }

    /// Runs the block moves the scheduler decided since the last call, and reports the loads they
    /// finished (host loads finish at once): [`Core::run_tier_moves_around`] with no copies.
    fn run_tier_moves(&mut self) {
        self.run_tier_moves_around(&mut Vec::new());
    }

    /// Runs the plan's block copies (copy-on-write of partial hits), in order.
    fn run_copies(executor: &mut dyn Executor, copies: &[BlockCopy]) {
        for c in copies {
            executor
                .copy_block_prefix(c.src, c.dst, c.num_tokens)
                .or_end("a copy-on-write block copy");
        }
    }

    /// The pass's tier moves, in order, and before each load from the host tier into a block that is
    /// the source of one of the pass's block copies (a partial hit's block, released once its copy was
    /// planned, then evicted and taken for the load by the same pass), the copies up to the last such,
    /// in order, taken out of `copies`. The other copies run with the step, after every move: a copy's
    /// destination was taken (and its old KV stored) before its source was released, so no store of
    /// the pass reads a destination after the copy writes it. Loads from disk and Redis land in a
    /// later pass.
    fn run_tier_moves_around(&mut self, copies: &mut Vec<BlockCopy>) {
        let Some(io) = self.tiers.as_mut() else {
            return;
        };
        let moves = self.sched.take_tier_moves();
        if moves.is_empty() {
            return;
        }
        let mut batch = Vec::with_capacity(moves.len());
        for m in moves {
            if let TierMove::LoadHost { block, .. } = m {
                // The copies up to the last that reads `block`, in the plan's order: a later copy may
                // write an earlier one's source (a block evicted and taken again as a destination).
                if let Some(last) = copies.iter().rposition(|c| c.src == block) {
                    io.run(
                        batch.drain(..),
                        self.executor.as_mut(),
                        &mut self.loads_done,
                    );
                    let early: Vec<BlockCopy> = copies.drain(..=last).collect();
                    Self::run_copies(self.executor.as_mut(), &early);
                }
            }
            batch.push(m);
        }
        io.run(batch, self.executor.as_mut(), &mut self.loads_done);
        self.report_loads();
    }

    /// Imports the disk reads that came back and the host copies that finished (waiting at most `wait`
    /// for one) and reports them.
    fn poll_loads(&mut self, wait: Duration) {
        let Some(io) = self.tiers.as_mut() else {
            return;
        };
        io.poll(self.executor.as_mut(), wait, &mut self.loads_done);
        self.report_loads();
    }

    /// A step that was mostly prefill (at least a block's worth of tokens, nine in ten of them in
    /// chunks longer than one token) is a sample of the prefill rate; every step (its prompt chunks,
    /// decode tokens and time) is one for the prefill cap's pace.
    fn observe_prefill(&mut self, plan: &Plan, forward: Duration) {
        let (mut all, mut prefill) = (0, 0);
        for it in &plan.items {
            let n = it.end - it.start;
            all += n;
            // A draft's check is a decode step, however many positions it computes.
            if n > 1 && self.sched.num_draft(it.seq) == 0 {
                prefill += n;
            }
        }
        if prefill >= self.config.block_size_tokens && prefill * 10 >= all * 9 {
            self.cost.observe_prefill(all, forward);
        }
        if let Some(p) = &mut self.pace {
            p.observe_step(&self.sched, &plan.items, forward);
        }
    }

    /// Hands the tier cost check's decisions to the KV manager and its figures to the metrics.
    fn update_cost(&mut self) {
        for tier in [Tier::Host, Tier::Disk] {
            let load = self.cost.load(tier.into());
            if self.sched.kv().tier_loadable(tier) != load {
                tracing::debug!(
                    "tier cost check: {}: {}",
                    tier.as_str(),
                    self.cost.describe(tier.into())
                );
                self.sched.set_tier_loadable(tier, load);
            }
        }
        let st = self.sched.kv().stats();
        let refused = [
            st.host_refused_blocks,
            st.disk_refused_blocks,
            self.remote.as_ref().map_or(0, |r| r.refused_blocks),
        ];
        for (tier, n) in CostTier::ALL.into_iter().zip(refused) {
            let m = &self.metrics.tier_cost[tier as usize];
            m.recomputed_blocks.set_total(n);
            m.load_bandwidth.set(self.cost.bandwidth(tier));
            m.load_chosen.set(f64::from(u8::from(self.cost.load(tier))));
        }
        self.metrics.prefill_tokens_per_s.set(self.cost.prefill());
    }

    fn report_loads(&mut self) {
        let block_bytes = self.executor.block_bytes();
        self.loads_landed |= !self.loads_done.is_empty();
        if let Some(io) = self.tiers.as_mut() {
            for took in io.take_copy_times() {
                self.cost.observe_load(Tier::Host.into(), block_bytes, took);
            }
        }
        for d in self.loads_done.drain(..) {
            self.sched.complete_load(d.block, d.ok);
            if let (true, Some(took)) = (d.ok, d.io) {
                self.cost.observe_load(d.tier.into(), block_bytes, took);
            }
            let m = match d.tier {
                Tier::Host => &self.metrics.host,
                Tier::Disk => &self.metrics.disk,
            };
            m.loads.add(1);
            if d.ok {
                m.loaded_bytes.add(block_bytes as u64);
            } else {
                m.load_failures.add(1);
            }
            m.load_latency.observe(d.elapsed);
        }
    }

    /// At a clean stop: every cached block not on disk yet is written there (what a restart should find),
    /// and the disk thread finishes its queue.
    fn shutdown_tiers(&mut self) {
        if self.tiers.is_none() {
            return;
        }
        // Reads still in flight belong to requests that are gone: let them land first.
        while self.tiers.as_ref().is_some_and(|t| t.reads_in_flight() > 0) {
            self.poll_loads(LOAD_POLL);
        }
        self.sched.flush_to_disk();
        self.run_tier_moves();
        if let Some(io) = &self.tiers {
            io.flush();
        }
    }

    fn update_gauges(&mut self) {
        self.update_cost();
        let usage = self.sched.kv().usage();
        let m = &self.metrics;
        m.kv_blocks_used.set(f64::from(usage.used_blocks));
        m.kv_blocks_cached.set(f64::from(
            usage.cached_idle_blocks + usage.pinned_idle_blocks,
        ));
        m.kv_usage_perc.set(usage.used_fraction());
        m.requests_running.set(self.sched.num_running() as f64);
        m.requests_waiting.set(self.sched.num_waiting() as f64);
        m.requests_preempted_waiting
            .set(self.sched.num_preempted_waiting() as f64);
        m.kv_reserved_blocks
            .set(self.sched.reserved_blocks() as f64);
        let st = self.sched.kv().stats();
        m.prefix_queries_tokens.set_total(st.prefix_query_tokens);
        m.prefix_hits_tokens.set_total(st.prefix_hit_tokens);
        m.prefix_pending_hit_tokens
            .set_total(st.prefix_pending_hit_tokens);
        let evictions = st.evictions;
        m.kv_evictions
            .add(evictions.saturating_sub(self.kv_evictions_seen));
        self.kv_evictions_seen = evictions;
        if let Some((total, free, idle)) = self.sched.kv().page_usage() {
            m.kv_pages_total.set(f64::from(total));
            m.kv_pages_free.set(f64::from(free));
            m.kv_pages_idle_window.set(f64::from(idle));
            m.kv_window_part_drops
                .set_total(self.sched.kv().stats().window_part_drops);
        }
        if let Some(io) = &self.tiers {
            let kv = self.sched.kv();
            let st = kv.stats();
            let block_bytes = io.block_bytes() as f64;
            for (tier, tm, hits, stores, evictions) in [
                (
                    Tier::Host,
                    &m.host,
                    st.host_hit_blocks,
                    st.host_stores,
                    st.host_evictions,
                ),
                (
                    Tier::Disk,
                    &m.disk,
                    st.disk_hit_blocks,
                    st.disk_stores,
                    st.disk_evictions,
                ),
            ] {
                let used = kv.tier_usage(tier).map_or(0, |u| u.used_blocks);
                tm.blocks_used.set(f64::from(used));
                tm.bytes_used.set(f64::from(used) * block_bytes);
                tm.hit_blocks.set_total(hits);
                tm.stores.set_total(stores);
                tm.stored_bytes
                    .set_total(stores.saturating_mul(io.block_bytes() as u64));
                tm.evictions.set_total(evictions);
            }
            m.tier_full_drops.set_total(st.tier_full_drops);
            m.host_stored_ahead.set_total(st.host_stored_ahead);
            m.evictions_copied.set_total(st.evictions_copied);
            m.tier_checksum_failures.set_total(io.corrupt_found);
            if let Some(d) = io.disk_stats() {
                m.disk_reads.set_total(d.reads + d.read_errors);
                m.disk_writes.set_total(d.writes);
                m.disk_write_errors.set_total(d.write_errors);
            }
            m.disk_queue.set(io.disk_queue() as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_ahead_blocks_default_to_one_steps_take_where_stores_run_beside_the_steps() {
        let mut c = EngineConfig {
            block_size_tokens: 16,
            num_blocks: 10_000,
            max_num_seqs: 64,
            max_num_batched_tokens: 8192,
            ..EngineConfig::default()
        };
        assert_eq!(store_ahead_blocks(&c, true), 0, "no host tier");
        c.tiers.host_blocks = 4096;
        assert_eq!(store_ahead_blocks(&c, true), 8192 / 16 + 64);
        assert_eq!(
            store_ahead_blocks(&c, false),
            0,
            "stores on the host's time"
        );
        c.tiers.store_ahead = Some(100);
        assert_eq!(store_ahead_blocks(&c, false), 100, "as given");
        c.tiers.store_ahead = Some(0);
        assert_eq!(store_ahead_blocks(&c, true), 0, "off");
        c.tiers.store_ahead = None;
        c.tiers.host_blocks = 200;
        assert_eq!(store_ahead_blocks(&c, true), 100, "half the host tier");
        c.tiers.host_blocks = 100_000;
        c.num_blocks = 50;
        assert_eq!(store_ahead_blocks(&c, true), 50, "the pool");
    }
}
