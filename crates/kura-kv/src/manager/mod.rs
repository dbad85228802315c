//! The KV cache manager: the small, opaque API the scheduler uses (after vLLM v1's `KVCacheManager`), over
//! the block pool, the prefix index and the eviction order.
//!
//! One scheduler step, for a new request and then a decode step:
//!
//! ```
//! use kura_kv::{CacheKey, KvCacheConfig, KvCacheManager};
//!
//! let mut kv = KvCacheManager::new(KvCacheConfig::new(64, 16)).unwrap();
//! let key = CacheKey::new().with_salt("tenant-a");
//! let prompt: Vec<u32> = (0..40).collect();
//!
//! let seq = kv.add_sequence(&key);
//! // Keep at least one prompt token to compute: its logits give the first output token.
//! let hit = kv.find_cached_prefix(&prompt[..prompt.len() - 1], &key);
//! let new_tokens = &prompt[hit.num_cached_tokens()..];
//! let Some(alloc) = kv.allocate_slots(seq, new_tokens, Some(&hit)).unwrap() else {
//!     return; // out of blocks: a normal state; wait, or preempt someone and retry
//! };
//! for copy in &alloc.copies {
//!     // The engine copies KV tokens [0, copy.num_tokens) of block copy.src into block copy.dst
//!     // before the step's forward pass writes any KV.
//! }
//! let status = kv.pending_status(seq).unwrap();
//! assert_eq!(status.waiting_blocks, 0); // else: other requests are computing part of this prefix
//! let table: &[u32] = kv.block_table(seq).unwrap(); // the attention reads and writes these blocks
//! assert_eq!(table.len(), 3);
//! // ... forward pass over tokens [status.computed_tokens, status.computable_tokens) ...
//! kv.mark_computed(seq, prompt.len()).unwrap();
//!
//! // Decode: one slot for the sampled token, which is the next step's input.
//! kv.allocate_slots(seq, &[7], None).unwrap().expect("enough blocks");
//! kv.mark_computed(seq, prompt.len() + 1).unwrap();
//! kv.free(seq).unwrap(); // its full blocks stay cached until evicted
//!
//! let again = kv.find_cached_prefix(&prompt[..prompt.len() - 1], &key);
//! assert_eq!(again.num_cached_tokens(), 32); // the 2 full blocks; the third never filled, never cached
//! ```
//!
//! Sequences are identified by [`SeqId`]s handed out here. A sequence's tokens are appended by
//! [`KvCacheManager::allocate_slots`] (prompt tokens, then each step's input token) and its KV is declared
//! written by [`KvCacheManager::mark_computed`]. A full block is entered in the prefix index as soon as its
//! tokens are known, "pending" until computed, so that identical prompts arriving meanwhile attach to it
//! instead of computing it twice (early reuse).
//!
//! Cost: lookups are O(prompt blocks); allocation, release and fork are O(blocks touched); eviction is
//! O(log cached blocks).
//!
//! # Layout
//!
//! [`KvCacheManager`] owns the block pool, the prefix index and its hasher, the eviction order (which
//! also counts the idle cached blocks), its two clocks and the statistics; around them, one value per
//! concern, each owning its own state:
//! - the live sequences (`seqs`: `Sequences`, slots checked by generation, and spare block tables);
//! - the pins (`retain`: `Pins`; retention ranges live on their sequences);
//! - what it tells the outside world (`outbox`: `Outbox`, the event buffer and the eviction hook);
//! - the lower tiers (`lower_tiers`: `LowerTiers`, the host and disk tier indexes, the loads in flight
//!   and the block moves decided), which the manager calls on lookups, at eviction and when a block is
//!   used;
//! - the pages of a hybrid pool (`pages`: `HybridPages`, one arena shared by a page manager per
//!   attention kind, full attention and sliding window), which the manager calls as blocks are taken,
//!   referenced and freed.
//!
//! The manager's own steps are grouped by concern: `alloc` (attaching hits, appending tokens, indexing
//! full blocks), `release` (releasing references, eviction, announcements), `retain` (retention, pins,
//! the caller's clock), `tier` (the manager's side of the lower tiers), `window` (the hybrid pool: its
//! configuration and the manager's side of its pages) and `check` (consistency checks for the tests).

use crate::error::KvError;
use crate::events::{EvictionHook, KvEvent};
use crate::evict::{EvictionPolicy, Evictor};
use crate::hash::{BlockHasher, CacheKey};
use crate::pool::{BlockId, BlockPool, NO_WRITER, ORPHAN};
use crate::prefix::{PrefixHit, PrefixIndex};
use crate::stats::{KvStats, KvUsage};
use crate::tier::TierConfig;

pub use inspect::PrefixChain;
use lower_tiers::LowerTiers;
use outbox::Outbox;
use pages::HybridPages;
use retain::Pins;
use seqs::{Sequence, Sequences};
pub use window::{WindowPool, NO_PAGE};

pub use crate::layout::MAX_BLOCK_SIZE;

/// How the manager is built.
#[derive(Clone, Debug)]
pub struct KvCacheConfig {
    /// Blocks in the pool (the KV storage arena has as many).
    pub num_blocks: u32,
    /// Tokens per block, 1..=[`MAX_BLOCK_SIZE`].
    pub block_size: usize,
    /// When false: no lookup ever hits and nothing is entered in the index.
    pub enable_prefix_caching: bool,
    pub eviction_policy: EvictionPolicy,
    /// Hash seed; `None` draws a random one (the production choice).
    pub hash_seed: Option<u64>,
    /// Significant bits of block hashes, 1..=128. 128 in production; fewer only to force collisions in tests.
    pub hash_bits: u32,
    /// Buffer [`KvEvent`]s for [`KvCacheManager::drain_events`].
    pub record_events: bool,
    /// Lower tiers (host memory, disk) that evicted blocks go down to; off by default.
    pub tiers: TierConfig,
    /// Sliding layers paged apart (a hybrid pool, see the `window` module); `num_blocks` is then the
    /// number of logical blocks ([`WindowPool::logical_blocks`]) and pages are what run out.
    pub window: Option<WindowPool>,
}

impl KvCacheConfig {
    /// Prefix caching on, leaf-first LRU, random seed, full hashes, no event buffer.
    pub fn new(num_blocks: u32, block_size: usize) -> Self {
        Self {
            num_blocks,
            block_size,
            enable_prefix_caching: true,
            eviction_policy: EvictionPolicy::LeafLru,
            hash_seed: None,
            hash_bits: 128,
            record_events: false,
            tiers: TierConfig::default(),
            window: None,
        }
    }

    fn validate(&self) -> Result<(), KvError> {
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return Err(KvError::Config(format!(
                "block_size {} is outside 1..={MAX_BLOCK_SIZE}",
                self.block_size
            )));
        }
        if self.num_blocks == 0 || self.num_blocks >= ORPHAN {
            return Err(KvError::Config(format!(
                "num_blocks {} is outside 1..{ORPHAN}",
                self.num_blocks
            )));
        }
        if let Some(w) = &self.window {
            w.validate(self.block_size)?;
            if self.tiers.enabled() {
                return Err(KvError::Config(
                    "lower tiers (host, disk) are not available with sliding layers paged apart"
                        .into(),
                ));
            }
        }
        if self.hash_bits == 0 || self.hash_bits > 128 {
            return Err(KvError::Config(format!(
                "hash_bits {} is outside 1..=128",
                self.hash_bits
            )));
        }
        Ok(())
    }
}

/// A sequence known to the manager.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId {
    index: u32,
    generation: u32,
}

/// "Copy KV tokens `[0, num_tokens)` of block `src` into block `dst`": the engine executes these on the KV
/// storage before the step's forward pass writes any KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: BlockId,
    pub dst: BlockId,
    pub num_tokens: usize,
}

/// What an allocation asks of the engine.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allocation {
    /// Copies to execute before the forward pass (copy-on-write, partial reuse).
    pub copies: Vec<BlockCopy>,
    /// Blocks newly taken from the pool (the hit's blocks not counted).
    pub num_new_blocks: usize,
}

/// Which of a sequence's tokens have KV, which it must compute itself, and whether it waits for others.
///
/// ```text
///   tokens:  [0 ........ computed) [computed ..... computable) [computable ... num_tokens)
///             KV present             this sequence computes      being computed by others (wait)
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingStatus {
    pub computed_tokens: usize,
    pub computable_tokens: usize,
    pub num_tokens: usize,
    /// Blocks after `computable_tokens` that other sequences are still computing.
    pub waiting_blocks: usize,
}

/// Retention for the blocks covering tokens `[start, end)` of a sequence: evicted only after lower classes
/// while retained; back to the default class after `duration_ms` (forever when `None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetentionRange {
    pub start: usize,
    pub end: usize,
    /// 0..=100; the default class is 35.
    pub priority: u8,
    pub duration_ms: Option<u64>,
}

/// A pinned prefix (see [`KvCacheManager::pin_prefix`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PinId {
    index: u32,
    generation: u32,
}

/// The manager's two clocks.
#[derive(Debug, Default)]
struct Clock {
    /// Logical: one tick per allocation or release; orders LRU.
    tick: u64,
    /// The caller's time in ms (monotonic), for retention and pin expiry.
    now_ms: u64,
}

/// The KV cache manager. See the module documentation for the flow and the layout.
pub struct KvCacheManager {
    config: KvCacheConfig,
    pool: BlockPool,
    index: PrefixIndex,
    hasher: BlockHasher,
    /// The eviction order over the idle cached blocks, and their count.
    evictor: Evictor,
    seqs: Sequences,
    pins: Pins,
    clock: Clock,
    stats: KvStats,
    /// Buffered events and the eviction hook.
    outbox: Outbox,
    /// The host and disk tiers' bookkeeping (both off by default).
    tiers: LowerTiers,
    /// The pages of a hybrid pool.
    pages: Option<HybridPages>,
}

impl std::fmt::Debug for KvCacheManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCacheManager")
            .field("config", &self.config)
            .field("usage", &self.usage())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl KvCacheManager {
    pub fn new(config: KvCacheConfig) -> Result<Self, KvError> {
        config.validate()?;
        let seed = config.hash_seed.unwrap_or_else(BlockHasher::random_seed);
        let pages = match &config.window {
            Some(w) => Some(HybridPages::new(w, config.num_blocks)?),
            None => None,
        };
        Ok(Self {
            pages,
            pool: BlockPool::try_new(config.num_blocks, config.block_size)?,
            index: PrefixIndex::default(),
            evictor: Evictor::new(config.eviction_policy, config.num_blocks),
            hasher: BlockHasher::new(seed, config.hash_bits),
            seqs: Sequences::default(),
            pins: Pins::default(),
            clock: Clock::default(),
            stats: KvStats::default(),
            outbox: Outbox::new(config.record_events),
            tiers: LowerTiers::new(&config.tiers),
            config,
        })
    }

    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    /// Installs the receiver of evicted blocks (replacing any earlier one).
    pub fn set_eviction_hook(&mut self, hook: Box<dyn EvictionHook>) {
        self.outbox.set_hook(hook);
    }

    /// A new, empty sequence under `key`.
    pub fn add_sequence(&mut self, key: &CacheKey) -> SeqId {
        let key_id = self.index.intern(key, &mut self.hasher);
        let seq = Sequence {
            key_id,
            table: self.seqs.spare_table(),
            num_tokens: 0,
            num_computed: 0,
            last_hash: self.index.key_hash(key_id),
            chain_indexed: self.config.enable_prefix_caching,
            cacheable: true,
            retention: Vec::new(),
            win_from: 0,
            draft_from: None,
        };
        self.seqs.insert(seq)
    }

    fn seq(&self, id: SeqId) -> Result<&Sequence, KvError> {
        self.seqs.get(id)
    }

    fn seq_mut(&mut self, id: SeqId) -> Result<&mut Sequence, KvError> {
        self.seqs.get_mut(id)
    }

    /// Stops (or resumes) entering this sequence's new full blocks in the index, e.g. for output whose reuse
    /// is not expected.
    pub fn set_caching(&mut self, id: SeqId, cacheable: bool) -> Result<(), KvError> {
        self.seq_mut(id)?.cacheable = cacheable;
        Ok(())
    }

    /// The longest cached prefix of `tokens` under `key`: full blocks (some possibly still pending) and the
    /// matching tokens of one more cached block, reusable by copy. Pass the prompt minus its last token to
    /// always leave one token to compute.
    pub fn find_cached_prefix(&mut self, tokens: &[u32], key: &CacheKey) -> PrefixHit {
        let bs = self.config.block_size;
        self.stats.lookup_blocks += (tokens.len() / bs) as u64;
        let mut hit = PrefixHit {
            block_size: bs,
            queried_tokens: tokens.len(),
            ..PrefixHit::default()
        };
        if !self.config.enable_prefix_caching {
            return hit;
        }
        let Some(key_id) = self.index.key_id(key) else {
            return hit;
        };
        self.lookup_pool(key_id, tokens, &mut hit);
        self.fit_hit_to_window(&mut hit);
        self.lookup_tiers(key_id, tokens, &mut hit);
        hit
    }

    /// Takes the partly reused block out of `hit` (from [`Self::find_cached_prefix`]), cutting it back to
    /// the window as the lookup would have without it: its tokens are then computed instead of copied.
    /// The copy holds its source beside its destination, one block more than the sequence: a pool with
    /// room for the sequence but not for both admits it without. False when `hit` had none.
    pub fn drop_partial(&self, hit: &mut PrefixHit) -> bool {
        if hit.partial.take().is_none() {
            return false;
        }
        self.fit_hit_to_window(hit);
        true
    }

    /// The admission counters of a fresh sequence's hit, attached.
    fn count_admission(&mut self, hit: &PrefixHit) {
        let bs = self.config.block_size as u64;
        let s = &mut self.stats;
        s.prefix_query_tokens += hit.queried_tokens as u64;
        s.prefix_query_blocks += hit.queried_tokens as u64 / bs;
        s.prefix_hit_tokens += hit.num_cached_tokens() as u64;
        s.prefix_pending_hit_tokens += hit.num_pending_blocks() as u64 * bs;
        s.prefix_hit_blocks += hit.blocks.len() as u64;
        s.partial_hits += u64::from(hit.partial.is_some());
        s.host_refused_blocks += hit.refused[crate::Tier::Host as usize] as u64;
        s.disk_refused_blocks += hit.refused[crate::Tier::Disk as usize] as u64;
    }

    /// Appends `new_tokens` to the sequence, taking the blocks they need; for an empty sequence, `hit`
    /// (from [`Self::find_cached_prefix`] with the same key, with no allocation in between) first attaches
    /// its cached blocks, so that the sequence holds `hit` tokens followed by `new_tokens`.
    ///
    /// ```text
    ///  block_size 4, sequence of 6 tokens, 5 new:   |a b c d|e f . .|          (2 blocks)
    ///                                               |a b c d|e f g h|i j k .|  (1 new block)
    ///  if |e f . .| is shared with a fork, it is first copied (copy-on-write) into a fresh block.
    /// ```
    ///
    /// Returns `Ok(None)`, changing nothing, when the pool cannot supply the blocks (the scheduler waits or
    /// preempts); `Err` only for misuse (unknown sequence, stale or foreign hit).
    pub fn allocate_slots(
        &mut self,
        id: SeqId,
        new_tokens: &[u32],
        hit: Option<&PrefixHit>,
    ) -> Result<Option<Allocation>, KvError> {
        let bs = self.config.block_size;
        let seq = self.seq(id)?;
        let admission = hit.filter(|_| seq.num_tokens == 0);
        let hit = hit.filter(|h| !h.blocks.is_empty() || h.partial.is_some() || !h.tier.is_empty());
        if let Some(h) = hit {
            self.validate_hit(id, seq, h)?;
        }
        let seq = self.seq(id)?;
        // Blocks to take from the pool, and how many reclaimable blocks this call itself will pin down.
        let (held_blocks, len_before) = match hit {
            Some(h) => (h.blocks.len(), h.num_cached_tokens()),
            None => (seq.table.len(), seq.num_tokens),
        };
        let total_blocks = (len_before + new_tokens.len()).div_ceil(bs);
        let mut needed = total_blocks - held_blocks;
        // Hybrid pool: the window parts the sequence will hold when these tokens are in (new blocks
        // within the last window of its table), and copies' destinations, which take theirs at once.
        let final_window = total_blocks.saturating_sub(self.window_blocks());
        let mut window_parts = total_blocks - held_blocks.max(final_window).min(total_blocks);
        let mut pinned_down = 0u32;
        if let Some(h) = hit {
            for &(b, _) in &h.blocks {
                pinned_down += u32::from(self.pool.meta[b as usize].is_idle());
            }
            if let Some((src, _, _)) = h.partial {
                pinned_down += u32::from(self.pool.meta[src as usize].is_idle());
                window_parts += usize::from(held_blocks < final_window);
            }
        } else if len_before % bs != 0 && !new_tokens.is_empty() {
            let last = *seq.table.last().expect("a partial block exists");
            if self.pool.meta[last as usize].ref_count > 1 {
                needed += 1; // copy-on-write of the shared partial last block
                window_parts += 1;
            }
        }
        let available = self.pool.free.len() + (self.evictor.num_idle - pinned_down) as usize;
        if needed > available {
            return Ok(None);
        }
        if self.pages.is_some() {
            // The hit's idle parts in the next token's window gain a reference now; the new blocks'
            // parts are attached as the window reaches them, and the hit's are let go as it leaves
            // them (`mark_computed`): one window's parts at a time, never both sets whole.
            let (parts, src_part) = match hit {
                Some(h) => {
                    let (hit_parts, src_part) = self.hit_window_parts(h);
                    (
                        (hit_parts + window_parts).min(self.window_blocks()),
                        src_part,
                    )
                }
                None => (window_parts, 0),
            };
            let pages = self.pages_for_blocks(needed + pinned_down as usize, parts + src_part);
            if pages > self.reclaimable_pages() {
                return Ok(None);
            }
        }

        self.clock.tick += 1;
        let mut alloc = Allocation::default();
        if let Some(h) = hit {
            // The tier blocks first: attaching the pool's blocks may write through and evict below.
            self.reserve_tier(h);
            self.attach_hit(id, h, &mut alloc)?;
            self.attach_tier(id, h, &mut alloc)?;
        } else {
            self.copy_on_write_last(id, &mut alloc)?;
        }
        self.append_tokens(id, new_tokens, &mut alloc)?;
        self.stats.block_copies += alloc.copies.len() as u64;
        if let Some(h) = admission {
            self.count_admission(h);
        }
        Ok(Some(alloc))
    }

    /// Declares the KV of tokens `[0, upto)` of the sequence written (by this sequence, by a copy, or by the
    /// writers it waited for). Full blocks become hittable as computed; in a hybrid pool the sequence's
    /// window references on blocks no token from `upto` on reads are dropped.
    pub fn mark_computed(&mut self, id: SeqId, upto: usize) -> Result<(), KvError> {
        let bs = self.config.block_size;
        let seq = self.seq(id)?;
        if upto > seq.num_tokens {
            return Err(KvError::ComputedBeyondEnd {
                seq: id,
                upto,
                num_tokens: seq.num_tokens,
            });
        }
        let first = seq.num_computed / bs;
        let last = upto.div_ceil(bs);
        for i in first..last {
            let b = seq.table[i];
            let m = &self.pool.meta[b as usize];
            let want = (upto - i * bs).min(bs) as u16;
            if m.computed < want && m.writer != id.index && m.writer != NO_WRITER {
                return Err(KvError::NotWriter { seq: id, block: b });
            }
        }
        for i in first..last {
            let b = self.seq(id)?.table[i];
            let m = &mut self.pool.meta[b as usize];
            let want = (upto - i * bs).min(bs) as u16;
            if m.computed < want {
                m.computed = want;
                m.writer = id.index;
                if usize::from(want) == bs {
                    m.writer = NO_WRITER;
                    if m.indexed {
                        self.announce(b);
                    }
                }
            }
        }
        let seq = self.seq_mut(id)?;
        seq.num_computed = seq.num_computed.max(upto);
        let computed = seq.num_computed;
        self.release_window_behind(id, computed)
    }

    /// Where the sequence stands: which tokens have KV, which it must compute itself (claiming blocks whose
    /// writer was cancelled: "compute them yourself"), and how many blocks it waits for.
    pub fn pending_status(&mut self, id: SeqId) -> Result<PendingStatus, KvError> {
        let bs = self.config.block_size;
        let seq = self.seq(id)?;
        let n = seq.num_tokens;
        let mut p = seq.num_computed;
        let mut i = p / bs;
        while i < seq.table.len() {
            let m = &self.pool.meta[seq.table[i] as usize];
            let needed = (n - i * bs).min(bs);
            let have = usize::from(m.computed).min(needed);
            p = p.max(i * bs + have);
            if have < needed {
                break;
            }
            i += 1;
        }
        let computed = p;
        let mut computable = computed;
        let mut waiting = 0;
        let mut claims = Vec::new();
        for (j, &b) in seq.table.iter().enumerate().skip(i) {
            let m = &self.pool.meta[b as usize];
            let needed = (n - j * bs).min(bs);
            if usize::from(m.computed) >= needed {
                continue;
            }
            let own = m.writer == id.index || m.writer == NO_WRITER;
            if !own {
                waiting += 1;
            } else if waiting == 0 {
                if m.writer == NO_WRITER {
                    claims.push(b);
                }
                computable = j * bs + needed;
            }
        }
        for b in claims {
            self.pool.meta[b as usize].writer = id.index;
        }
        self.seq_mut(id)?.num_computed = computed;
        Ok(PendingStatus {
            computed_tokens: computed,
            computable_tokens: computable,
            num_tokens: n,
            waiting_blocks: waiting,
        })
    }

    /// Whether other sequences wait for blocks this one is computing: blocks it writes and has not
    /// computed that they hold too (attached as pending). A sequence that will not compute for a while
    /// (its client is behind) is better preempted then, leaving those blocks to them.
    pub fn is_waited_for(&self, id: SeqId) -> Result<bool, KvError> {
        let bs = self.config.block_size;
        let seq = self.seq(id)?;
        Ok(seq.table[seq.num_computed / bs..].iter().any(|&b| {
            let m = &self.pool.meta[b as usize];
            m.writer == id.index && m.computed < m.filled && m.ref_count > 1
        }))
    }

    /// A new sequence sharing all of this one's blocks (n > 1 samples, beams); a shared partially filled
    /// last block is copied by whichever sequence appends to it first. The sequence must be fully computed.
    pub fn fork(&mut self, id: SeqId) -> Result<SeqId, KvError> {
        if self.seq(id)?.draft_from.is_some() {
            return Err(KvError::Draft {
                seq: id,
                why: "a sequence holding a draft is forked",
            });
        }
        let status = self.pending_status(id)?;
        if status.computed_tokens < status.num_tokens {
            return Err(KvError::ForkUncomputed {
                seq: id,
                uncomputed: status.num_tokens - status.computed_tokens,
            });
        }
        let mut table = self.seqs.spare_table();
        let seq = self.seq(id)?;
        table.extend_from_slice(&seq.table);
        let child = Sequence {
            key_id: seq.key_id,
            table,
            num_tokens: seq.num_tokens,
            num_computed: seq.num_computed,
            last_hash: seq.last_hash,
            chain_indexed: seq.chain_indexed,
            cacheable: seq.cacheable,
            retention: seq.retention.clone(),
            win_from: seq.win_from,
            draft_from: None,
        };
        self.index.retain_key(child.key_id);
        for &b in &child.table {
            let was_idle = self.pool.incref(b);
            debug_assert!(!was_idle, "a referenced block cannot be idle");
        }
        let windowed: Vec<BlockId> = child.table[child.win_from.min(child.table.len())..].to_vec();
        for b in windowed {
            self.win_ref(b);
        }
        self.stats.block_ops += child.table.len() as u64;
        Ok(self.seqs.insert(child))
    }

    /// Releases the sequence: its computed full blocks stay cached (until evicted), the rest go back to the
    /// free list; blocks it was computing for others are withdrawn, and their waiters compute them.
    pub fn free(&mut self, id: SeqId) -> Result<(), KvError> {
        let seq = self.seqs.remove(id)?;
        self.clock.tick += 1;
        for &b in &seq.table[seq.win_from.min(seq.table.len())..] {
            self.win_unref(b);
        }
        // Tail first: a child is released before its parent, and under plain LRU the tail is evicted first.
        for &b in seq.table.iter().rev() {
            self.release_block(b, id.index);
        }
        self.stats.block_ops += seq.table.len() as u64;
        self.index.release_key(seq.key_id);
        self.seqs.recycle(seq.table);
        Ok(())
    }

    /// The sequence's block table: block `i` holds its tokens `[i * block_size, (i + 1) * block_size)`.
    pub fn block_table(&self, id: SeqId) -> Result<&[BlockId], KvError> {
        Ok(&self.seq(id)?.table)
    }

    /// Tokens the sequence holds (hit + appended).
    pub fn num_tokens(&self, id: SeqId) -> Result<usize, KvError> {
        Ok(self.seq(id)?.num_tokens)
    }

    /// Blocks that `num_new_tokens` more tokens would take from the pool for this sequence (copy-on-write
    /// included), for the scheduler's budget.
    pub fn blocks_needed(&self, id: SeqId, num_new_tokens: usize) -> Result<usize, KvError> {
        let bs = self.config.block_size;
        let seq = self.seq(id)?;
        let mut needed = (seq.num_tokens + num_new_tokens).div_ceil(bs) - seq.table.len();
        if seq.num_tokens % bs != 0 && num_new_tokens > 0 {
            let last = *seq.table.last().expect("a partial block exists");
            needed += usize::from(self.pool.meta[last as usize].ref_count > 1);
        }
        Ok(needed)
    }

    /// Blocks of [`Self::num_available_blocks`] that a fresh sequence takes when `hit` is attached to it
    /// and `num_new_tokens` are appended after it: its new blocks (blocks of lower tiers are loaded into
    /// new ones) plus the idle cached blocks of the hit, which it then references. Blocks of the hit that
    /// other sequences reference cost nothing. For admission control that reserves blocks ahead.
    pub fn blocks_to_take(&self, hit: &PrefixHit, num_new_tokens: usize) -> usize {
        let total = (hit.num_cached_tokens() + num_new_tokens).div_ceil(self.config.block_size);
        let idle = hit
            .blocks
            .iter()
            .filter(|&&(b, _)| self.pool.meta[b as usize].is_idle())
            .count();
        total - hit.blocks.len() + idle
    }

    /// Blocks obtainable now without touching referenced or pinned ones.
    pub fn num_available_blocks(&self) -> usize {
        self.pool.free.len() + self.evictor.num_idle as usize
    }

    /// Blocks on the free list, without evicting a cached one (what a draft may take).
    pub fn num_free_blocks(&self) -> usize {
        self.pool.free.len()
    }

    pub fn stats(&self) -> &KvStats {
        &self.stats
    }

    pub fn usage(&self) -> KvUsage {
        let total_blocks = self.pool.num_blocks();
        let free_blocks = self.pool.free.len() as u32;
        let used_blocks = self.pool.num_referenced;
        KvUsage {
            total_blocks,
            used_blocks,
            cached_idle_blocks: self.evictor.num_idle,
            // Neither referenced, nor reclaimable, nor free: cached and pinned.
            pinned_idle_blocks: total_blocks - free_blocks - used_blocks - self.evictor.num_idle,
            free_blocks,
        }
    }

    /// Buffered events since the last drain (empty unless `record_events`).
    pub fn drain_events(&mut self) -> std::vec::Drain<'_, KvEvent> {
        self.outbox.drain()
    }

    /// Number of distinct cache keys in use by sequences or cached blocks.
    pub fn num_cache_keys(&self) -> usize {
        self.index.num_keys()
    }

    /// Number of blocks in the prefix index.
    pub fn num_indexed_blocks(&self) -> usize {
        self.index.len()
    }
}

mod alloc;
mod check;
mod draft;
mod inspect;
mod lower_tiers;
mod outbox;
mod pages;
mod release;
mod retain;
mod seqs;
mod tier;
mod window;
