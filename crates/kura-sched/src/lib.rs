//! `kura-sched` — the scheduling decision of one engine step, as a [`Scheduler`] that owns the KV cache manager and
//! the sequences' tokens and knows nothing of models, threads or wall time: whoever drives it gives it
//! the time (`kura serve`'s engine loop the wall clock since start, `kura sim` the trace's clock), runs
//! the forward pass it plans (the real model, or a cost model) and reports back what was computed and
//! sampled. The same decisions follow from the same calls, so the simulator replays the server's
//! admission, chunked prefill, early reuse of pending blocks, preemption and priorities.
//!
//! [`Scheduler::schedule`] makes one pass over all sequences, best first:
//!
//! ```text
//!  order: effective priority (priority − age / PRIORITY_AGING_S), then running before waiting, then age
//!         (priority is a request's own under `SchedulingPolicy::Priority`, 0 for all under `Fcfs`)
//!  ┌────────────┬──────────────────────────────────────────────────────────────────────────────────┐
//!  │ running    │ slot for its newly sampled token; if the pool is empty, preempt the worst running │
//!  │            │ sequence after it in the order (or itself); then its next chunk within the budget │
//!  │ waiting    │ prefix lookup (cached and pending blocks), allocate the rest; if the pool is      │
//!  │            │ empty, preempt strictly worse running sequences; else stop admitting (FCFS),      │
//!  │            │ unless the pool could not hold it even empty: then it fails (CannotFit)           │
//!  └────────────┴──────────────────────────────────────────────────────────────────────────────────┘
//! ```
//!
//! A request marked blocked (its client is behind) is skipped: not admitted, not stepped; a running
//! sequence of it that others wait for (pending blocks they attached) is preempted, leaving the blocks
//! to them (except under guaranteed admission, which never preempts).
//!
//! Under [`AdmissionMode::Guaranteed`] a waiting request is admitted only when the blocks it will take
//! until every choice reaches its full length (prompt plus `max_tokens`: [`OutputLimit`]), less the
//! blocks of its prefix that running sequences already hold, fit in the available blocks (free plus
//! reclaimable cached) beyond what the running requests still have reserved
//! ([`Scheduler::reserved_blocks`]). A running sequence then always finds its next block, so nothing is
//! ever preempted, and admission never preempts either; a request whose choices at full length outgrow
//! the pool is refused ([`SchedEvent::CannotFit`]). The default [`AdmissionMode::MaxUtilization`]
//! admits on the prompt's blocks alone and preempts when the pool runs out.
//!
//! A preempted sequence's computed blocks stay cached; under [`PreemptionMode::Swap`] they are also
//! copied into the host tier first, so that its resumption loads them instead of recomputing what the
//! pool evicted meanwhile. Blocks found in a lower tier at admission are loads the sequence waits for,
//! like blocks another sequence is computing.
//!
//! A chunk is the range `[computed, computable)` that the KV manager reports, cut to the step's token
//! budget: tokens that another request is computing right now (pending blocks) are waited for, never
//! computed twice. Prefill chunks and decode tokens go into the same forward call; while a sequence
//! decodes, the prompt tokens of a step are also cut to the prefill cap ([`Scheduler::set_prefill_cap`],
//! sized by [`pace::PrefillPace`] to a time per step), so that decodes do not wait for whole prompts,
//! and no one is admitted past a prompt the cap holds back. Because effective
//! priority falls linearly with age for everyone alike, the order of two requests never flips, so
//! preemption cannot cycle, and a low-priority request eventually overtakes fresh higher-priority ones
//! (no starvation). Cost: O(sequences · log sequences) per step plus the KV manager's calls.
//!
//! What the pass did besides planning (admissions with their prefix hits, preemptions, a request that
//! can never fit) comes back as [`SchedEvent`]s in the [`Plan`], for the caller's metrics and clients.

pub mod pace;

use std::collections::HashMap;
use std::time::Duration;

use crate::pace::PrefillCap;

use kura_kv::{
    BlockCopy, BlockId, CacheKey, EvictionPolicy, KvCacheConfig, KvCacheManager, KvError, PinId,
    PrefixHit, SeqId, TierBlock, TierConfig, TierMove, WindowPool,
};

/// Whose order counts. Under `Fcfs` (the default) every request has priority 0, so requests run in
/// arrival order and none can preempt an older one; under `Priority` a request's `priority` field is
/// honoured (lower first) and may preempt others: give it only to trusted clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "snake_case")]
pub enum SchedulingPolicy {
    #[default]
    Fcfs,
    Priority,
}

impl SchedulingPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            SchedulingPolicy::Fcfs => "fcfs",
            SchedulingPolicy::Priority => "priority",
        }
    }
}

impl std::fmt::Display for SchedulingPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for SchedulingPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fcfs" => Ok(SchedulingPolicy::Fcfs),
            "priority" => Ok(SchedulingPolicy::Priority),
            other => Err(format!(
                "unknown scheduling policy '{other}' (expected fcfs or priority)"
            )),
        }
    }
}

/// What happens to a preempted sequence's computed blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "snake_case")]
pub enum PreemptionMode {
    /// They stay cached in the pool, where eviction may take them; what was evicted is recomputed on
    /// resumption.
    #[default]
    Recompute,
    /// They are also copied into the host tier (L2) before the pool may evict them, and loaded back on
    /// resumption instead of being recomputed (without a host tier this is `Recompute`).
    Swap,
}

impl PreemptionMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PreemptionMode::Recompute => "recompute",
            PreemptionMode::Swap => "swap",
        }
    }
}

/// When a waiting request may take KV blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum AdmissionMode {
    /// As soon as its prompt's blocks are free: running requests grow into the rest of the pool, and
    /// when it runs out the most recent one is preempted. The most requests at once.
    #[default]
    MaxUtilization,
    /// Only when the blocks of its whole length (prompt plus `max_tokens`, for every choice), less those
    /// it shares with running sequences, can be reserved on top of what the running requests still have
    /// reserved: an admitted request always finds its blocks and is never preempted; fewer requests run
    /// at once.
    Guaranteed,
}

impl AdmissionMode {
    pub fn as_str(self) -> &'static str {
        match self {
            AdmissionMode::MaxUtilization => "max-utilization",
            AdmissionMode::Guaranteed => "guaranteed",
        }
    }
}

impl std::fmt::Display for AdmissionMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How much a request may generate: what [`AdmissionMode::Guaranteed`] reserves blocks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputLimit {
    /// Tokens each choice generates at most (the caller cuts it to the context limit). The last one is
    /// never fed back, so a choice holds at most `prompt + max_tokens - 1` tokens of KV.
    pub max_tokens: usize,
    /// Choices of the request; they share the prompt's full blocks, each needs its own for the rest.
    pub n: usize,
}

/// A request's prompt being scored ([`Scheduler::score_prompt`]).
#[derive(Debug, Clone, Copy)]
struct Scoring {
    /// The most tokens one step computes of it.
    chunk: usize,
    /// Its first tokens that may be read from the cache ([`Scheduler::prompt_scored_to`]).
    reusable: usize,
}

/// Seconds of waiting that improve a request's effective priority by one level.
pub const PRIORITY_AGING_S: f64 = 10.0;

/// Key of a sequence (one choice of a request) in the scheduler; never reused.
pub type SeqKey = u64;

/// How the scheduler is sized and limited.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub block_size_tokens: usize,
    pub num_blocks: usize,
    /// Most sequences holding KV blocks at once.
    pub max_num_seqs: usize,
    /// Token budget of one step: prefill chunks plus decode tokens.
    pub max_num_batched_tokens: usize,
    pub enable_prefix_caching: bool,
    pub policy: SchedulingPolicy,
    pub eviction_policy: EvictionPolicy,
    /// Hash seed of the KV manager; `None` draws a random one (the production choice). A disk tier
    /// kept across restarts gives its own, so that its blocks are found again.
    pub hash_seed: Option<u64>,
    /// Lower tiers (sizes in blocks) that evicted blocks go down to; off by default.
    pub tiers: TierConfig,
    pub preemption: PreemptionMode,
    /// Whether admission reserves every block a request may need (no preemption) or not.
    pub admission: AdmissionMode,
    /// Sliding layers paged apart (a hybrid pool): `num_blocks` is then the number of logical blocks and
    /// the pages of the pool are what runs out.
    pub window: Option<WindowPool>,
    /// Record the KV manager's content events for [`Scheduler::take_kv_events`].
    pub record_kv_events: bool,
}

/// One sequence's share of a step: compute the KV of `tokens[start..end]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    pub seq: SeqKey,
    pub start: usize,
    pub end: usize,
}

/// What a scheduling pass did besides planning the step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchedEvent {
    /// A sequence got blocks. `first`: its request's first admission (a resumption after preemption is
    /// not); `cached_tokens` of its prompt were found cached (what its usage reports);
    /// `window_cut_blocks` more were in the pool but lacked their sliding window's part
    /// ([`kura_kv::PrefixHit::num_window_cut_blocks`]). The cache's own counters of admissions are
    /// [`kura_kv::KvStats`]'s.
    Admitted {
        seq: SeqKey,
        request: u64,
        first: bool,
        cached_tokens: usize,
        window_cut_blocks: usize,
    },
    /// A running sequence was sent back to the waiting queue to make room (its computed full blocks stay
    /// cached for its resumption; `swapped_blocks` of them were copied to the host tier, under
    /// [`PreemptionMode::Swap`]).
    Preempted {
        seq: SeqKey,
        request: u64,
        swapped_blocks: usize,
    },
    /// A request that can never fit (alone, it still runs out of blocks, or waiting, the pool could not
    /// hold it even empty) was removed.
    CannotFit {
        request: u64,
        needed_blocks: usize,
        total_blocks: usize,
    },
}

/// One step's plan: the block copies to run first, then one forward pass over `items`.
#[derive(Debug, Default)]
pub struct Plan {
    pub items: Vec<Item>,
    /// Block copies (copy-on-write, partial prefix reuse) to execute before the forward pass.
    pub copies: Vec<BlockCopy>,
    pub events: Vec<SchedEvent>,
    /// Running sequences that had nothing to compute because another sequence is computing blocks
    /// they reuse.
    pub pending_waits: u64,
    /// The sequence each of `copies` is for, while the pass plans.
    copy_owners: Vec<SeqKey>,
    /// A sequence running alone stepped back for room that pins hold: the pass admits no one else,
    /// so that nothing runs and the engine has a pin give way.
    waits_for_pins: bool,
}

impl Plan {
    /// Plans `copies` for sequence `owner`.
    fn add_copies(&mut self, owner: SeqKey, copies: Vec<BlockCopy>) {
        self.copy_owners
            .extend(std::iter::repeat_n(owner, copies.len()));
        self.copies.extend(copies);
    }
}

/// What [`Scheduler::computed`] learnt about a planned item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Computed {
    /// The item was prompt (or recomputed) tokens, not a decode step.
    pub prefill: bool,
    /// Every token of the sequence is computed: its last position's logits give the next token.
    pub complete: bool,
}

/// Scheduling state of one request (its choices share it).
#[derive(Debug)]
struct Request {
    key: CacheKey,
    priority: i32,
    arrival: Duration,
    admitted_once: bool,
    blocked: bool,
    prompt_len: usize,
    limit: OutputLimit,
    /// Choices that have a sequence so far (1, then `n` once forked).
    choices: usize,
    /// While its prompt is scored ([`Scheduler::score_prompt`]): the most tokens one step computes of
    /// it, and how many of its first tokens may be read from the cache (those whose positions are
    /// scored already).
    scoring: Option<Scoring>,
}

/// One choice of a request as the scheduler sees it.
#[derive(Debug)]
struct SeqState {
    request: u64,
    /// The KV sequence while this choice holds blocks (running); `None` while waiting or preempted.
    kv: Option<SeqId>,
    /// Prompt followed by every generated token. The KV of all but possibly the last are computed; when
    /// all are, the last position's logits give the next token.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Order of (re)admission; among equal priorities the most recent is preempted first.
    admitted_order: u64,
    /// Computing tokens that are not a single decode step (a prompt, or recomputation after preemption).
    prefilling: bool,
    /// Draft tokens at the end of `tokens`, on trial in this step ([`Scheduler::propose_draft`]).
    draft: usize,
}

#[derive(Debug, Clone, Copy)]
struct Candidate {
    priority: f64,
    waiting: bool,
    order: u64,
    seq: SeqKey,
}

enum Admit {
    Admitted,
    /// The pool cannot hold it now and nobody may be preempted for it.
    NoRoom,
    /// Its request was removed meanwhile.
    Gone,
}

/// The continuous-batching scheduler over one KV cache manager; see the module documentation.
pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvCacheManager,
    requests: HashMap<u64, Request>,
    seqs: HashMap<SeqKey, SeqState>,
    /// Sequences holding KV blocks.
    running: Vec<SeqKey>,
    /// Sequences without blocks: new, or preempted.
    waiting: Vec<SeqKey>,
    next_seq: SeqKey,
    next_order: u64,
    /// Drafts proposed for the next pass ([`Scheduler::propose_draft`]).
    proposals: HashMap<SeqKey, Vec<u32>>,
    /// What a step may compute of prompts while a sequence decodes ([`pace`]); `None`: the budget.
    prefill_cap: Option<PrefillCap>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Result<Self, KvError> {
        if config.max_num_seqs == 0 || config.max_num_batched_tokens == 0 {
            return Err(KvError::Config(format!(
                "max_num_seqs ({}) and max_num_batched_tokens ({}) must be at least 1",
                config.max_num_seqs, config.max_num_batched_tokens
            )));
        }
        let num_blocks = u32::try_from(config.num_blocks)
            .map_err(|_| KvError::Config(format!("{} KV blocks is too many", config.num_blocks)))?;
        let mut kv_config = KvCacheConfig::new(num_blocks, config.block_size_tokens);
        kv_config.enable_prefix_caching = config.enable_prefix_caching;
        kv_config.eviction_policy = config.eviction_policy;
        kv_config.hash_seed = config.hash_seed;
        kv_config.tiers = config.tiers;
        kv_config.window = config.window.clone();
        kv_config.record_events = config.record_kv_events;
        if config.window.is_some() && config.admission == AdmissionMode::Guaranteed {
            return Err(KvError::Config(
                "guaranteed admission counts whole blocks; with sliding layers paged apart use \
                 max-utilization"
                    .into(),
            ));
        }
        let kv = KvCacheManager::new(kv_config)?;
        Ok(Self {
            config,
            kv,
            requests: HashMap::new(),
            seqs: HashMap::new(),
            running: Vec::new(),
            waiting: Vec::new(),
            next_seq: 0,
            next_order: 0,
            proposals: HashMap::new(),
            prefill_cap: None,
        })
    }

    /// From the next pass on, a step that carries a decoding sequence computes only the prompt tokens
    /// (prompts and recomputation, every sequence's together) whose cost fits `cap`'s room, and at
    /// least its `min_tokens` (and one), so that the decodes' next tokens do not wait for whole
    /// prompts ([`pace::PrefillPace`] sizes it); `None`: only `max_num_batched_tokens` limits them. A
    /// step without decodes is never cut.
    pub fn set_prefill_cap(&mut self, cap: Option<PrefillCap>) {
        self.prefill_cap = cap;
    }

    /// Whether a sequence is computing its prompt (or recomputing after preemption) rather than
    /// decoding: what its planned item counts as ([`Computed::prefill`]) before the step is reported.
    pub fn is_prefilling(&self, seq: SeqKey) -> bool {
        self.seqs.get(&seq).is_some_and(|s| s.prefilling)
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The KV cache manager, for its usage and statistics.
    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    /// Whether prefix lookups may load blocks from `tier` (the engine's cost check; see
    /// [`KvCacheManager::set_tier_loadable`]).
    pub fn set_tier_loadable(&mut self, tier: kura_kv::Tier, loadable: bool) {
        self.kv.set_tier_loadable(tier, loadable);
    }

    /// Blocks of `tokens` (whole blocks) under `key` held in the pool or the lower tiers, from the first.
    pub fn held_prefix_blocks(&mut self, tokens: &[u32], key: &CacheKey) -> usize {
        self.kv.held_prefix_blocks(tokens, key)
    }

    /// See [`KvCacheManager::adoptable_prefix_blocks`].
    pub fn adoptable_prefix_blocks(&mut self, tokens: &[u32], key: &CacheKey) -> Option<usize> {
        self.kv.adoptable_prefix_blocks(tokens, key)
    }

    /// See [`KvCacheManager::begin_adoption`].
    pub fn begin_adoption(
        &mut self,
        tokens: &[u32],
        key: &CacheKey,
        held: usize,
    ) -> Result<Option<(kura_kv::SeqId, Vec<BlockId>)>, KvError> {
        self.kv.begin_adoption(tokens, key, held)
    }

    /// See [`KvCacheManager::finish_adoption`].
    pub fn finish_adoption(&mut self, id: kura_kv::SeqId) -> Result<(), KvError> {
        self.kv.finish_adoption(id)
    }

    /// The KV manager's content events since the last call (none unless `record_kv_events`).
    pub fn take_kv_events(&mut self) -> Vec<kura_kv::KvEvent> {
        self.kv.drain_events().collect()
    }

    /// Copies the pool's next evictions into the host tier ahead of need, keeping `reserve` blocks
    /// free or stored ([`KvCacheManager::store_ahead`]); the copies are among the next tier moves.
    /// Returns the blocks stored.
    pub fn store_ahead(&mut self, reserve: usize) -> usize {
        self.kv.store_ahead(reserve)
    }

    /// The block moves between the pool and the lower tiers decided since the last call, in the order
    /// they must run (before the next forward pass).
    pub fn take_tier_moves(&mut self) -> Vec<TierMove> {
        self.kv.drain_tier_moves().collect()
    }

    /// Reports a load from a lower tier done: `ok`, its KV is in place and its waiters go on; not `ok`,
    /// the stored copy failed its checks and the waiters compute the block themselves.
    pub fn complete_load(&mut self, block: BlockId, ok: bool) {
        if let Err(e) = self.kv.complete_load(block, ok) {
            panic!("a load the KV manager issued was reported unknown: {e}");
        }
    }

    /// Blocks being loaded from a lower tier.
    pub fn num_loads(&self) -> usize {
        self.kv.num_loads()
    }

    /// Writes every cached block not on disk yet to the disk tier (moves; for a clean shutdown).
    pub fn flush_to_disk(&mut self) {
        self.kv.flush_to_disk();
    }

    /// Enters the blocks a disk tier held at start (oldest first); returns how many it keeps.
    pub fn restore_disk(&mut self, blocks: Vec<TierBlock>) -> usize {
        self.kv.restore_disk(blocks)
    }

    /// Pins the computed cached prefix of `tokens` under `key` against eviction until [`Self::unpin`];
    /// returns the pin and the tokens it covers (whole blocks).
    pub fn pin_prefix(&mut self, tokens: &[u32], key: &CacheKey) -> (PinId, usize) {
        self.kv.pin_prefix(tokens, key, None)
    }

    /// Leaves `prompt` under `key` in the cache as a finished request would (its blocks computed, held
    /// by nobody), without running it: for warming a cache and for tests of what holds cached blocks.
    /// `Ok(false)` when the pool cannot hold it now.
    pub fn cache_prompt(&mut self, prompt: &[u32], key: &CacheKey) -> Result<bool, KvError> {
        let seq = self.kv.add_sequence(key);
        let hit = self.kv.find_cached_prefix(prompt, key);
        let allocated = self
            .kv
            .allocate_slots(seq, &prompt[hit.num_cached_tokens()..], Some(&hit))?
            .is_some();
        if allocated {
            self.kv.mark_computed(seq, prompt.len())?;
        }
        self.kv.free(seq)?;
        Ok(allocated)
    }

    /// Releases a pin (one already released is ignored).
    pub fn unpin(&mut self, pin: PinId) {
        let _ = self.kv.unpin(pin);
    }

    /// Copies the cached prefix of `tokens` under `key` into the lower tiers at `priority` (see
    /// [`KvCacheManager::store_prefix_down`]); returns the tokens covered.
    pub fn store_prefix_down(&mut self, tokens: &[u32], key: &CacheKey, priority: u8) -> usize {
        self.kv.store_prefix_down(tokens, key, priority)
    }

    /// Queues a request's first choice. `id` orders waiting requests (lower first among equals) and must
    /// be new; `arrival` is on the caller's clock, the one later given to [`Scheduler::schedule`]; `limit`
    /// is what guaranteed admission reserves for (the caller ends each choice within it).
    pub fn add_request(
        &mut self,
        id: u64,
        key: CacheKey,
        priority: i32,
        arrival: Duration,
        prompt: Vec<u32>,
        limit: OutputLimit,
    ) -> SeqKey {
        let priority = match self.config.policy {
            SchedulingPolicy::Fcfs => 0,
            SchedulingPolicy::Priority => priority,
        };
        self.requests.insert(
            id,
            Request {
                key,
                priority,
                arrival,
                admitted_once: false,
                blocked: false,
                prompt_len: prompt.len(),
                limit,
                choices: 1,
                scoring: None,
            },
        );
        let seq = self.next_seq;
        self.next_seq += 1;
        self.seqs.insert(
            seq,
            SeqState {
                request: id,
                kv: None,
                prompt_len: prompt.len(),
                tokens: prompt,
                admitted_order: 0,
                prefilling: true,
                draft: 0,
            },
        );
        self.waiting.push(seq);
        seq
    }

    /// Has a request's prompt computed whole, for the logits of every position (its prompt's
    /// log-probabilities): no cached or pending block of its prefix is read, and each step computes at
    /// most `max_chunk` tokens of it (what one step's logits of every position may take), until
    /// [`Scheduler::prompt_scored`]. Its own blocks are cached as any others.
    pub fn score_prompt(&mut self, id: u64, max_chunk: usize) {
        if let Some(r) = self.requests.get_mut(&id) {
            r.scoring = Some(Scoring {
                chunk: max_chunk.max(1),
                reusable: 0,
            });
        }
    }

    /// Tells the scheduler that the positions of a scored prompt's first `tokens` tokens are scored:
    /// a sequence of it admitted again (after a preemption) may read those tokens' cached blocks, and
    /// computes the rest.
    pub fn prompt_scored_to(&mut self, id: u64, tokens: usize) {
        if let Some(s) = self.requests.get_mut(&id).and_then(|r| r.scoring.as_mut()) {
            s.reusable = s.reusable.max(tokens);
        }
    }

    /// Ends [`Scheduler::score_prompt`]: the request's prompt is scored, and a sequence of it admitted
    /// again (after a preemption) reads its cached prefix as any other.
    pub fn prompt_scored(&mut self, id: u64) {
        if let Some(r) = self.requests.get_mut(&id) {
            r.scoring = None;
        }
    }

    /// Whether a request is skipped by the next passes (its client is behind). A running sequence keeps
    /// its blocks meanwhile.
    pub fn set_blocked(&mut self, id: u64, blocked: bool) {
        if let Some(r) = self.requests.get_mut(&id) {
            r.blocked = blocked;
        }
    }

    /// Frees every sequence of a request and forgets it; returns the keys it had.
    pub fn remove_request(&mut self, id: u64) -> Vec<SeqKey> {
        let keys: Vec<SeqKey> = self
            .seqs
            .iter()
            .filter(|(_, s)| s.request == id)
            .map(|(&k, _)| k)
            .collect();
        for &k in &keys {
            self.drop_seq(k);
        }
        self.requests.remove(&id);
        keys
    }

    fn drop_seq(&mut self, key: SeqKey) {
        if let Some(mut seq) = self.seqs.remove(&key) {
            // A draft's tokens drawn before the sequence ended keep their blocks cached, as one token a
            // step would have.
            Self::drop_draft(&mut self.kv, &mut seq);
            if let Some(id) = seq.kv {
                self.kv.free(id).expect("running sequence is known");
            }
        }
        self.running.retain(|&k| k != key);
        self.waiting.retain(|&k| k != key);
    }

    /// The request a sequence belongs to.
    pub fn request_of(&self, seq: SeqKey) -> Option<u64> {
        self.seqs.get(&seq).map(|s| s.request)
    }

    /// Prompt and generated tokens of a sequence (empty for an unknown one).
    pub fn tokens(&self, seq: SeqKey) -> &[u32] {
        self.seqs.get(&seq).map_or(&[], |s| &s.tokens)
    }

    /// Tokens generated so far by a sequence (a draft on trial is not among them).
    pub fn num_generated(&self, seq: SeqKey) -> usize {
        self.seqs
            .get(&seq)
            .map_or(0, |s| s.tokens.len() - s.prompt_len - s.draft)
    }

    /// Whether a sequence is running and decoding: its next step computes its last sampled token (the
    /// only sequences a draft is taken for).
    pub fn decoding(&self, seq: SeqKey) -> bool {
        self.seqs
            .get(&seq)
            .is_some_and(|s| s.kv.is_some() && !s.prefilling)
    }

    /// Proposes draft tokens to follow a decoding sequence's last token in the next pass (speculative
    /// decoding): the pass appends what fits of them (the step's token budget, free blocks; never
    /// preempting for them) and its item computes them beside the last token, whose logits and theirs
    /// the caller checks them against. After the step the caller takes the draft back
    /// ([`Scheduler::take_draft`]), pushes the tokens it samples, and settles the KV
    /// ([`Scheduler::settle_draft`]). A proposal the next pass does not use is dropped.
    pub fn propose_draft(&mut self, seq: SeqKey, draft: Vec<u32>) {
        if !draft.is_empty() && self.decoding(seq) {
            self.proposals.insert(seq, draft);
        }
    }

    /// Draft tokens a sequence holds on trial (at the end of [`Scheduler::tokens`]).
    pub fn num_draft(&self, seq: SeqKey) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.draft)
    }

    /// Takes a sequence's draft tokens off its tokens after the step that computed them (its KV keeps
    /// them until [`Scheduler::settle_draft`]); returns them.
    pub fn take_draft(&mut self, seq: SeqKey) -> Vec<u32> {
        let Some(s) = self.seqs.get_mut(&seq) else {
            return Vec::new();
        };
        let at = s.tokens.len() - s.draft;
        s.draft = 0;
        s.tokens.split_off(at)
    }

    /// Keeps the KV of the draft tokens that the sequence's tokens now hold in their places (those
    /// sampled equal to the draft, pushed since [`Scheduler::take_draft`]) and gives the rest back. A
    /// sequence without a draft is left as it is.
    pub fn settle_draft(&mut self, seq: SeqKey) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            Self::drop_draft(&mut self.kv, s);
        }
    }

    /// Takes a sequence's draft off its tokens (if a step has not taken it) and settles its KV: the
    /// draft's tokens the sequence's tokens hold in their places are kept, the rest given back.
    fn drop_draft(kv: &mut KvCacheManager, seq: &mut SeqState) {
        let firm = seq.tokens.len() - seq.draft;
        seq.tokens.truncate(firm);
        seq.draft = 0;
        if let Some(id) = seq.kv {
            kv.settle_draft_as(id, &seq.tokens)
                .expect("a running sequence is known");
        }
    }

    /// Appends what fits of a proposed draft to a decoding sequence that holds its slots for the pass:
    /// within `budget` tokens for its item, in free blocks beyond one for each running sequence after
    /// it in the pass (`rest`), which may need one for its next token: a draft never evicts a cached
    /// block nor makes another sequence wait.
    fn take_proposal(
        &mut self,
        key: SeqKey,
        id: SeqId,
        budget: usize,
        rest: &[Candidate],
        plan: &mut Plan,
    ) {
        let Some(mut draft) = self.proposals.remove(&key) else {
            return;
        };
        let Some(seq) = self.seqs.get(&key) else {
            return;
        };
        if seq.prefilling {
            return;
        }
        let status = self
            .kv
            .pending_status(id)
            .expect("running sequence is known");
        draft.truncate(budget.saturating_sub(status.num_tokens - status.computed_tokens));
        let later = rest.iter().filter(|c| !c.waiting).count();
        let room = self.kv.num_free_blocks().saturating_sub(later);
        while !draft.is_empty()
            && self
                .kv
                .blocks_needed(id, draft.len())
                .expect("running sequence is known")
                > room
        {
            draft.pop();
        }
        if draft.is_empty() {
            return;
        }
        if let Ok(Some(alloc)) = self.kv.allocate_draft_slots(id, &draft) {
            plan.add_copies(key, alloc.copies);
            let seq = self.seqs.get_mut(&key).expect("checked above");
            seq.draft = draft.len();
            seq.tokens.extend(draft);
        }
    }

    /// The blocks of a running sequence, in token order.
    pub fn block_table(&self, seq: SeqKey) -> &[BlockId] {
        let id = self.seqs[&seq].kv.expect("a planned sequence holds blocks");
        self.kv.block_table(id).expect("running sequence is known")
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Waiting sequences of requests admitted before (preempted, to be resumed).
    pub fn num_preempted_waiting(&self) -> usize {
        self.waiting
            .iter()
            .filter(|k| {
                self.seqs
                    .get(k)
                    .and_then(|s| self.requests.get(&s.request))
                    .is_some_and(|r| r.admitted_once)
            })
            .count()
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Whether a planned item reaches the end of its sequence's tokens: once computed, the sequence
    /// samples its next token from the item's logits.
    pub fn completes(&self, item: Item) -> bool {
        item.end >= self.tokens(item.seq).len()
    }

    /// Records that the forward pass computed a planned item's KV.
    pub fn computed(&mut self, item: Item) -> Computed {
        let complete = self.completes(item);
        let seq = self
            .seqs
            .get_mut(&item.seq)
            .expect("a planned sequence exists until its step is reported");
        let id = seq.kv.expect("a planned sequence holds blocks");
        self.kv
            .mark_computed(id, item.end)
            .expect("the scheduled range was computable");
        let prefill = seq.prefilling;
        if complete {
            seq.prefilling = false;
        }
        Computed { prefill, complete }
    }

    /// Appends a sampled token to a sequence; the next pass gives it a slot.
    pub fn push_token(&mut self, seq: SeqKey, token: u32) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.tokens.push(token);
        }
    }

    /// A new choice of `parent`'s request sharing its computed blocks (copy-on-write): for `n > 1`.
    pub fn fork(&mut self, parent: SeqKey) -> SeqKey {
        let p = &self.seqs[&parent];
        let id = p.kv.expect("a forked sequence holds blocks");
        let child_kv = self.kv.fork(id).expect("a computed sequence can be forked");
        let child = SeqState {
            request: p.request,
            kv: Some(child_kv),
            tokens: p.tokens.clone(),
            prompt_len: p.prompt_len,
            admitted_order: self.next_order,
            prefilling: false,
            draft: 0,
        };
        self.next_order += 1;
        if let Some(r) = self.requests.get_mut(&child.request) {
            r.choices += 1;
        }
        let key = self.next_seq;
        self.next_seq += 1;
        self.seqs.insert(key, child);
        self.running.push(key);
        key
    }

    /// A sequence is done: frees its blocks (its computed full blocks stay cached) and forgets it. Its
    /// request stays until [`Scheduler::remove_request`].
    pub fn finish(&mut self, seq: SeqKey) {
        self.drop_seq(seq);
    }

    fn effective_priority(&self, seq: SeqKey, now: Duration) -> f64 {
        let Some(r) = self
            .seqs
            .get(&seq)
            .and_then(|s| self.requests.get(&s.request))
        else {
            return f64::INFINITY;
        };
        f64::from(r.priority) - now.saturating_sub(r.arrival).as_secs_f64() / PRIORITY_AGING_S
    }

    /// Plans one step at time `now` (on the clock of the requests' arrivals).
    pub fn schedule(&mut self, now: Duration) -> Plan {
        self.kv
            .set_time_ms(u64::try_from(now.as_millis()).unwrap_or(u64::MAX));
        // A draft lives for one step: one its step did not settle (its item was not computed) is
        // dropped.
        for &key in &self.running {
            if let Some(seq) = self.seqs.get_mut(&key) {
                Self::drop_draft(&mut self.kv, seq);
            }
        }
        let mut plan = Plan::default();
        self.preempt_blocked_writers(&mut plan);
        let mut cands: Vec<Candidate> = self
            .running
            .iter()
            .map(|&k| (k, false))
            .chain(self.waiting.iter().map(|&k| (k, true)))
            .map(|(seq, waiting)| Candidate {
                priority: self.effective_priority(seq, now),
                waiting,
                order: if waiting {
                    self.seqs[&seq].request
                } else {
                    self.seqs[&seq].admitted_order
                },
                seq,
            })
            .collect();
        cands.sort_by(|a, b| {
            a.priority
                .total_cmp(&b.priority)
                .then(a.waiting.cmp(&b.waiting))
                .then(a.order.cmp(&b.order))
        });

        let mut budget = self.config.max_num_batched_tokens;
        // What the step may still spend on prompts beside its decodes: seconds of the cap's room, and
        // the prompt tokens planned so far (the cap's floor).
        let cap = self.prefill_cap.filter(|_| self.num_decoding() > 0);
        let mut prefill_room = cap.map_or(f64::INFINITY, |c| c.room_s);
        let mut prefill_planned = 0usize;
        let mut admitting = true;
        for i in 0..cands.len() {
            if budget == 0 {
                break;
            }
            let c = cands[i];
            let Some(seq) = self.seqs.get(&c.seq) else {
                continue;
            };
            // A client that is behind gets no output for now; a running sequence keeps its blocks
            // (and stays a possible victim for those after it).
            if self.requests.get(&seq.request).is_some_and(|r| r.blocked) {
                continue;
            }
            if c.waiting {
                // Admission's order stays FCFS: nobody is admitted past a prompt the cap holds back (no
                // token of a prompt fits the room left, and the floor is reached).
                if cap.is_some_and(|c| {
                    c.fit(0, prefill_room) == 0 && prefill_planned >= c.min_tokens.max(1)
                }) {
                    admitting = false;
                }
                if !admitting
                    || plan.waits_for_pins
                    || self.running.len() >= self.config.max_num_seqs
                {
                    continue;
                }
                match self.admit(c, &cands[i + 1..], &mut plan) {
                    Admit::Admitted => {}
                    Admit::NoRoom => {
                        admitting = false;
                        continue;
                    }
                    Admit::Gone => continue,
                }
            } else {
                // Preempted earlier in this pass as someone's victim.
                let Some(id) = seq.kv else { continue };
                if !self.grow(c.seq, id, &cands[i + 1..], &mut plan) {
                    continue;
                }
                self.take_proposal(c.seq, id, budget, &cands[i + 1..], &mut plan);
            }
            let seq = &self.seqs[&c.seq];
            let Some(id) = seq.kv else { continue };
            let status = match self.kv.pending_status(id) {
                Ok(s) => s,
                Err(e) => panic!("KV sequence of a running request is unknown: {e}"),
            };
            let start = status.computed_tokens;
            let most = match self.requests.get(&seq.request).and_then(|r| r.scoring) {
                Some(s) => budget.min(s.chunk),
                None => budget,
            };
            let prefilling = seq.prefilling;
            let most = match cap {
                Some(c) if prefilling => {
                    let floor = c.min_tokens.max(1).saturating_sub(prefill_planned);
                    most.min(c.fit(start, prefill_room).max(floor))
                }
                _ => most,
            };
            let end = status.computable_tokens.min(start.saturating_add(most));
            let end = if end > start {
                match self.fit_window(c.seq, id, start, end, &cands[i + 1..], &mut plan) {
                    Some(end) => end,
                    None => continue,
                }
            } else {
                end
            };
            if end > start {
                plan.items.push(Item {
                    seq: c.seq,
                    start,
                    end,
                });
                budget -= end - start;
                if let Some(c) = cap.filter(|_| prefilling) {
                    prefill_room -= c.cost(start, end - start);
                    prefill_planned += end - start;
                }
            } else if status.waiting_blocks > 0 {
                plan.pending_waits += 1;
            }
        }
        self.proposals.clear();
        // A copy for a sequence that the pass preempted or removed after planning it is dropped: its
        // destination went back to the pool, and a later admission may have taken it for other KV.
        let owners = std::mem::take(&mut plan.copy_owners);
        let copies = std::mem::take(&mut plan.copies);
        plan.copies = copies
            .into_iter()
            .zip(owners)
            .filter(|(_, key)| self.seqs.get(key).is_some_and(|s| s.kv.is_some()))
            .map(|(c, _)| c)
            .collect();
        plan
    }

    /// Preempts the running sequences of requests whose client is behind that others wait for (blocks
    /// they attached as pending, which the sequence was to compute). Not stepped, such a sequence could
    /// keep them waiting up to the engine's stalled-client timeout; preempted, it withdraws those blocks
    /// and the first of the others computes them. Its computed blocks stay cached for its return (a
    /// blocked request is not admitted again until its client catches up); one nobody waits for keeps
    /// its blocks. Not under [`AdmissionMode::Guaranteed`], which promises that an admitted request is
    /// never preempted (there the others wait for its client). O(running × blocks it has not computed).
    fn preempt_blocked_writers(&mut self, plan: &mut Plan) {
        if self.config.admission == AdmissionMode::Guaranteed {
            return;
        }
        let blocked: Vec<SeqKey> = self
            .running
            .iter()
            .copied()
            .filter(|k| {
                let seq = &self.seqs[k];
                self.requests.get(&seq.request).is_some_and(|r| r.blocked)
                    && seq.kv.is_some_and(|id| {
                        self.kv
                            .is_waited_for(id)
                            .expect("running sequence is known")
                    })
            })
            .collect();
        for key in blocked {
            self.preempt(key, plan);
        }
    }

    /// Running sequences that decode (hold blocks, have their prompt computed, and whose client is not
    /// behind): a step carries them, and while there is one the prefill cap applies.
    pub fn num_decoding(&self) -> usize {
        self.running
            .iter()
            .filter(|k| {
                self.seqs.get(k).is_some_and(|s| {
                    s.kv.is_some()
                        && !s.prefilling
                        && !self.requests.get(&s.request).is_some_and(|r| r.blocked)
                })
            })
            .count()
    }

    /// Gives a running sequence the slots of its tokens not yet in the KV sequence (the token sampled in
    /// the last step), preempting worse sequences (after it in `rest`) or itself when the pool is full.
    /// Returns whether it has them: when not, it was preempted, failed, or (alone) waits for room
    /// ([`Self::alone_out_of_room`]).
    fn grow(&mut self, key: SeqKey, id: SeqId, rest: &[Candidate], plan: &mut Plan) -> bool {
        loop {
            let kv_len = self.kv.num_tokens(id).expect("running sequence is known");
            let seq = &self.seqs[&key];
            if kv_len >= seq.tokens.len() {
                return true;
            }
            match self.kv.allocate_slots(id, &seq.tokens[kv_len..], None) {
                Ok(Some(alloc)) => {
                    plan.add_copies(key, alloc.copies);
                    return true;
                }
                Ok(None) => {}
                Err(e) => panic!("allocating slots of a running sequence: {e}"),
            }
            if let Some(victim) = self.pick_victim(rest, None) {
                self.preempt(victim, plan);
                continue;
            }
            if self.running.len() == 1 {
                // Alone and still out of blocks (admission checks make this rare: only when the pool
                // is smaller than one request's prompt plus output).
                self.alone_out_of_room(key, plan);
            } else {
                self.preempt(key, plan);
            }
            return false;
        }
    }

    /// Gives the sliding layers of a hybrid pool the pages for computing tokens `[start, end)` of the
    /// sequence, computing fewer tokens (down to one) when the pool is short, then preempting worse
    /// sequences (after it in `rest`), then itself. Returns the end that fits, or `None` when the
    /// sequence does not compute this step (preempted, or alone and unable to fit: see
    /// [`Self::alone_out_of_room`]).
    fn fit_window(
        &mut self,
        key: SeqKey,
        id: SeqId,
        start: usize,
        end: usize,
        rest: &[Candidate],
        plan: &mut Plan,
    ) -> Option<usize> {
        loop {
            let mut e = end;
            loop {
                match self.kv.prepare_window(id, start, e) {
                    Ok(true) => return Some(e),
                    Ok(false) if e > start + 1 => e = start + (e - start) / 2,
                    Ok(false) => break,
                    Err(err) => panic!("window pages of a running sequence: {err}"),
                }
            }
            if let Some(victim) = self.pick_victim(rest, None) {
                self.preempt(victim, plan);
                continue;
            }
            if self.running.len() == 1 && self.kv.page_usage().is_some() {
                // Alone, and not even one token's window fits.
                self.alone_out_of_room(key, plan);
            } else {
                // As `grow` does: it steps back for those before it. Keeping its pages and waiting
                // could wait for ever: a sequence before it may be waiting for its pending blocks
                // (a better priority attached to them, or an older request admitted again), and that
                // reader's window references keep those blocks' parts as it computes them, so that it
                // runs out. Preempted, it withdraws them and the reader computes them.
                self.preempt(key, plan);
            }
            return None;
        }
    }

    /// A sequence running alone that cannot get the room it needs: where loads from a lower tier are in
    /// flight it keeps its blocks and waits for them (the loader holds the blocks it loads into, a
    /// cancelled request's too, until its reads are reported: then they are the pool's again); where
    /// pins hold it ([`Self::pins_hold_room`]) it steps back to the queue and the pass admits no one
    /// else, so that with nothing running the engine has a pin give way; otherwise it can never fit and
    /// its request fails with `CannotFit`.
    fn alone_out_of_room(&mut self, key: SeqKey, plan: &mut Plan) {
        let seq = &self.seqs[&key];
        let (request, needed_blocks) =
            (seq.request, seq.tokens.len().div_ceil(self.kv.block_size()));
        if self.kv.num_loads() > 0 && self.kv.could_hold(needed_blocks) {
            // The engine waits on the loads when a pass plans nothing, and the next pass after they
            // land gives it the room (it comes first: it is running).
            return;
        }
        if self.pins_hold_room(needed_blocks) {
            plan.waits_for_pins = true;
            self.preempt(key, plan);
        } else {
            self.remove_request(request);
            plan.events.push(SchedEvent::CannotFit {
                request,
                needed_blocks,
                total_blocks: self.config.num_blocks,
            });
        }
    }

    /// Whether pinned blocks that no sequence uses hold room a sequence of `needed_blocks` blocks, alone
    /// and out of room, could have if they gave way: then it steps back to the queue rather than fail,
    /// and with nothing running the engine has a pin give way (one a pass, until it fits or no pin is
    /// left). A sequence the pool could not hold even empty ([`KvCacheManager::could_hold`]: in a
    /// hybrid pool its pages) fails instead, leaving the pins. The test is of the sequence's length
    /// now, not of its prompt plus `max_tokens`: its output may end sooner (an end token, a stop
    /// string; a chat's default `max_tokens` is the whole context), so a pin may give way to a request
    /// that then outgrows the pool anyway, one pin for each time it runs out of room.
    fn pins_hold_room(&self, needed_blocks: usize) -> bool {
        self.kv.usage().pinned_idle_blocks > 0 && self.kv.could_hold(needed_blocks)
    }

    /// The layer pages of a running sequence's blocks (see `KvCacheManager::layer_pages`), into `out`;
    /// false for a pool without sliding layers paged apart.
    pub fn layer_pages(&self, seq: SeqKey, out: &mut Vec<u32>) -> bool {
        let id = self.seqs[&seq].kv.expect("a planned sequence holds blocks");
        self.kv
            .layer_pages(id, out)
            .expect("running sequence is known")
    }

    /// The worst running sequence among `rest` that is strictly worse than `than` (any when `None`).
    fn pick_victim(&self, rest: &[Candidate], than: Option<f64>) -> Option<SeqKey> {
        rest.iter()
            .rev()
            .filter(|c| !c.waiting)
            .filter(|c| than.is_none_or(|p| c.priority > p))
            .find(|c| self.seqs.get(&c.seq).is_some_and(|s| s.kv.is_some()))
            .map(|c| c.seq)
    }

    /// Takes a waiting sequence into the running set: looks up its prefix (cached or pending blocks),
    /// allocates the rest, preempting strictly worse running sequences when needed. Under
    /// [`AdmissionMode::Guaranteed`] it first checks that the request's whole need can be reserved, and
    /// never preempts.
    fn admit(&mut self, c: Candidate, rest: &[Candidate], plan: &mut Plan) -> Admit {
        let guaranteed = self.config.admission == AdmissionMode::Guaranteed;
        loop {
            let Some(seq) = self.seqs.get(&c.seq) else {
                return Admit::Gone;
            };
            let Some(request) = self.requests.get(&seq.request) else {
                return Admit::Gone;
            };
            let id = self.kv.add_sequence(&request.key);
            // A prompt being scored needs every position's logits: it reads nothing cached past the
            // positions it has scored.
            let last = seq.tokens.len() - 1;
            let lookup = match request.scoring {
                Some(s) => &seq.tokens[..s.reusable.min(last)],
                None => &seq.tokens[..last],
            };
            let mut hit = self.kv.find_cached_prefix(lookup, &request.key);
            if guaranteed {
                let (need, alone) = self.admission_need(seq, request, &hit);
                let request_id = seq.request;
                if alone > self.config.num_blocks {
                    // Its choices at full length outgrow the whole pool: it could never be admitted.
                    self.kv.free(id).expect("fresh sequence is known");
                    self.remove_request(request_id);
                    plan.events.push(SchedEvent::CannotFit {
                        request: request_id,
                        needed_blocks: alone,
                        total_blocks: self.config.num_blocks,
                    });
                    return Admit::Gone;
                }
                let room = self
                    .kv
                    .num_available_blocks()
                    .saturating_sub(self.reserved_blocks());
                if need > room {
                    self.kv.free(id).expect("fresh sequence is known");
                    return Admit::NoRoom;
                }
            }
            let mut allocated =
                self.kv
                    .allocate_slots(id, &seq.tokens[hit.num_cached_tokens()..], Some(&hit));
            if matches!(allocated, Ok(None)) && self.kv.drop_partial(&mut hit) {
                // Copying a partly reused block holds its source beside the copy: rather than wait or
                // preempt for that one block (for ever, where the sequence fills the pool), its tokens
                // are computed.
                allocated =
                    self.kv
                        .allocate_slots(id, &seq.tokens[hit.num_cached_tokens()..], Some(&hit));
            }
            match allocated {
                Ok(Some(alloc)) => {
                    plan.add_copies(c.seq, alloc.copies);
                    self.on_admitted(c.seq, id, &hit, plan);
                    return Admit::Admitted;
                }
                Ok(None) => {
                    self.kv.free(id).expect("fresh sequence is known");
                }
                Err(e) => panic!("allocating a fresh sequence with its own hit: {e}"),
            }
            if guaranteed {
                return Admit::NoRoom;
            }
            match self.pick_victim(rest, Some(c.priority)) {
                Some(victim) => self.preempt(victim, plan),
                None => return self.no_room(c.seq, plan),
            }
        }
    }

    /// A waiting sequence the pool cannot hold now, with nobody to preempt for it: it waits for room
    /// (and stops admission behind it), unless the pool could not hold it even empty
    /// ([`KvCacheManager::could_hold`]; in a hybrid pool its pages, which run out before the block ids
    /// the submission checks): then it would wait for ever, and every request behind it too, so its
    /// request fails with `CannotFit`.
    fn no_room(&mut self, key: SeqKey, plan: &mut Plan) -> Admit {
        let seq = &self.seqs[&key];
        let (request, needed_blocks) =
            (seq.request, seq.tokens.len().div_ceil(self.kv.block_size()));
        if self.kv.could_hold(needed_blocks) {
            return Admit::NoRoom;
        }
        self.remove_request(request);
        plan.events.push(SchedEvent::CannotFit {
            request,
            needed_blocks,
            total_blocks: self.config.num_blocks,
        });
        Admit::Gone
    }

    /// Tokens of KV a choice of `r` holds at its full length: the prompt and every output token but the
    /// last (which is never fed back).
    fn full_slots(r: &Request) -> usize {
        (r.prompt_len + r.limit.max_tokens)
            .saturating_sub(1)
            .max(r.prompt_len)
    }

    /// Blocks that the choices of `r` not forked yet will take: each its own blocks at full length, all
    /// but the prompt's full blocks, which they share.
    fn unforked_blocks(&self, r: &Request) -> usize {
        let bs = self.kv.block_size();
        let own = Self::full_slots(r).div_ceil(bs) - r.prompt_len / bs;
        r.limit.n.saturating_sub(r.choices) * own
    }

    /// Blocks a running sequence will still take from the pool to reach its full length (copy-on-write
    /// of a shared last block included), plus those of its request's choices not forked yet.
    fn reservation(&self, key: SeqKey) -> usize {
        let Some(seq) = self.seqs.get(&key) else {
            return 0;
        };
        let (Some(id), Some(r)) = (seq.kv, self.requests.get(&seq.request)) else {
            return 0;
        };
        let held = self.kv.num_tokens(id).expect("running sequence is known");
        let full = Self::full_slots(r).max(seq.tokens.len());
        let own = self
            .kv
            .blocks_needed(id, full.saturating_sub(held))
            .expect("running sequence is known");
        // Before the fork a request has one sequence: its other choices are counted with it.
        own + self.unforked_blocks(r)
    }

    /// Blocks the running requests will still take from the pool to reach their full length (prompt plus
    /// `max_tokens` for every choice): what [`AdmissionMode::Guaranteed`] keeps for them. O(running).
    pub fn reserved_blocks(&self) -> usize {
        self.running.iter().map(|&k| self.reservation(k)).sum()
    }

    /// What admitting `seq` with `hit` takes from the available blocks, now and until every choice is at
    /// full length (blocks of the hit that running sequences hold cost nothing); and the blocks its
    /// request holds at full length with nothing shared.
    fn admission_need(&self, seq: &SeqState, r: &Request, hit: &PrefixHit) -> (usize, usize) {
        let bs = self.kv.block_size();
        let len = seq.tokens.len();
        let now = self.kv.blocks_to_take(hit, len - hit.num_cached_tokens());
        let full = Self::full_slots(r).max(len).div_ceil(bs);
        let others = self.unforked_blocks(r);
        (now + full - len.div_ceil(bs) + others, full + others)
    }

    fn on_admitted(&mut self, key: SeqKey, id: SeqId, hit: &PrefixHit, plan: &mut Plan) {
        let cached_tokens = hit.num_cached_tokens();
        let order = self.next_order;
        self.next_order += 1;
        let seq = self.seqs.get_mut(&key).expect("admitted sequence exists");
        seq.kv = Some(id);
        seq.admitted_order = order;
        seq.prefilling = true;
        let request_id = seq.request;
        self.waiting.retain(|&k| k != key);
        self.running.push(key);
        let request = self
            .requests
            .get_mut(&request_id)
            .expect("sequence's request exists");
        let first = !request.admitted_once;
        request.admitted_once = true;
        plan.events.push(SchedEvent::Admitted {
            seq: key,
            request: request_id,
            first,
            cached_tokens,
            window_cut_blocks: hit.num_window_cut_blocks(),
        });
    }

    /// Sends a running sequence back to the waiting queue. Its computed full blocks stay cached, so
    /// that its resumption finds them by prefix lookup and recomputes only what was evicted meanwhile.
    fn preempt(&mut self, key: SeqKey, plan: &mut Plan) {
        let Some(seq) = self.seqs.get_mut(&key) else {
            return;
        };
        let mut swapped_blocks = 0;
        Self::drop_draft(&mut self.kv, seq);
        if let Some(id) = seq.kv.take() {
            if self.config.preemption == PreemptionMode::Swap {
                swapped_blocks = self.kv.swap_out(id).expect("running sequence is known");
            }
            self.kv.free(id).expect("running sequence is known");
        }
        seq.prefilling = true;
        let request = seq.request;
        self.running.retain(|&k| k != key);
        self.waiting.push(key);
        plan.events.push(SchedEvent::Preempted {
            seq: key,
            request,
            swapped_blocks,
        });
    }
}
