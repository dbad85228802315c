//! The manager's side of the lower tiers (see `tier`, and `LowerTiers` for their bookkeeping): looking a
//! prompt up past the pool, attaching the blocks found below as loads, sending evicted blocks down,
//! write-through, swap, the disk tier's flush and restore, and adopting blocks computed elsewhere.
//!
//! A load is a pending block whose writer is the loader: the block is taken from the pool, filled with
//! the tier's tokens and entered in the prefix index at once, so that every request wanting the same
//! prefix attaches to it and waits, as for a block another request is computing (one read, any number of
//! waiters). The loader holds a reference of its own on every block of the sequence up to the last one it
//! loads, until the last of those loads is reported done ([`KvCacheManager::complete_load`]): a cancelled
//! requester cannot free a block whose bytes are still arriving, and a block being loaded keeps its
//! ancestors (the pool's rule: a referenced block's parent is referenced, so that every idle block can be
//! evicted leaves first). A failed load leaves the block uncomputed without a writer: its waiters compute
//! it themselves.

use super::lower_tiers::{PoolBlock, LOADER, LOAD_GROUP};
use super::{Allocation, KvCacheManager, SeqId};
use crate::error::KvError;
use crate::evict::EvictionPolicy;
use crate::hash::{BlockHash, CacheKey};
use crate::pool::{BlockId, DEFAULT_PRIORITY, NO_BLOCK, NO_WRITER, ORPHAN};
use crate::prefix::PrefixHit;
use crate::stats::TierUsage;
use crate::tier::{OffloadPolicy, Tier, TierBlock, TierMove};

impl KvCacheManager {
    /// Goes on past the pool's hit into the host tier, then the disk tier, block by block, each block
    /// verified against its parent's hash, the key's digest and its tokens. A block is taken from the
    /// first tier holding it whose loads are allowed ([`Self::set_tier_loadable`]); at the first block
    /// that only refused tiers hold, the hit stops: that block and the ones found below after it are
    /// counted as refused (recomputed, as a miss).
    pub(super) fn lookup_tiers(&mut self, key_id: u32, tokens: &[u32], hit: &mut PrefixHit) {
        if !self.tiers.any() {
            return;
        }
        let bs = self.config.block_size;
        let key_digest = self.index.key_hash(key_id);
        let mut parent = hit.last_hash;
        let mut stopped = false;
        for chunk in tokens[hit.blocks.len() * bs..].chunks_exact(bs) {
            let h = self.hasher.chain(parent, chunk);
            let mut refused = None;
            let mut found = None;
            for t in [Tier::Host, Tier::Disk] {
                if let Some(slot) = self.tiers.find_in(t, h, parent, key_digest, chunk) {
                    if !stopped && self.tiers.loadable(t) {
                        found = Some((t, slot));
                        break;
                    }
                    refused = refused.or(Some(t));
                }
            }
            match (found, refused) {
                (Some((t, slot)), _) => hit.tier.push((t, slot, h)),
                (None, Some(t)) => {
                    hit.refused[t as usize] += 1;
                    stopped = true;
                }
                (None, None) => break,
            }
            parent = h;
        }
        if !hit.tier.is_empty() {
            hit.partial = None; // a partial block would follow the last full one, which is below
        }
    }

    /// Whether prefix lookups may load blocks from `tier` (the default), or must stop there and let the
    /// blocks be recomputed: the engine's cost check, which compares the tier's load bandwidth with the
    /// model's prefill rate. Counted in `KvStats::{host,disk}_refused_blocks`.
    pub fn set_tier_loadable(&mut self, tier: Tier, loadable: bool) {
        self.tiers.set_loadable(tier, loadable);
    }

    /// Whether prefix lookups may load blocks from `tier`.
    pub fn tier_loadable(&self, tier: Tier) -> bool {
        self.tiers.loadable(tier)
    }

    pub(super) fn validate_tier_hit(&self, h: &PrefixHit) -> Result<(), KvError> {
        self.tiers.validate(h)
    }

    /// Marks the hit's lower-tier blocks busy, so that nothing this allocation sends down evicts them.
    pub(super) fn reserve_tier(&mut self, h: &PrefixHit) {
        self.tiers.reserve(h);
    }

    /// Attaches the hit's lower-tier blocks (reserved) as loads into fresh blocks of the sequence.
    pub(super) fn attach_tier(
        &mut self,
        id: SeqId,
        h: &PrefixHit,
        alloc: &mut Allocation,
    ) -> Result<(), KvError> {
        let group = self.tiers.new_load_group();
        for &(t, slot, _) in &h.tier {
            let record = self.tiers.record(t, slot);
            let before = self.seq(id)?.table.len();
            self.append_tokens(id, &record.tokens, alloc)?;
            let b = self.seq(id)?.table[before];
            let m = &mut self.pool.meta[b as usize];
            m.writer = LOADER;
            self.tiers
                .start_load(b, t, slot, group, record, &mut self.stats);
        }
        if !h.tier.is_empty() {
            let blocks = self.seq(id)?.table[..h.blocks.len() + h.tier.len()].to_vec();
            for &b in &blocks {
                let was_idle = self.pool.incref(b);
                debug_assert!(!was_idle, "the sequence holds it");
            }
            self.tiers.hold_group(group, blocks, h.tier.len());
        }
        Ok(())
    }

    /// Reports a load issued by a [`TierMove::LoadHost`] or [`TierMove::LoadDisk`] as done: with
    /// `ok`, the block's KV is present (it becomes hittable and its waiters go on); without, the stored
    /// copy did not verify: it is dropped from its tier and the block's waiters compute it.
    pub fn complete_load(&mut self, block: BlockId, ok: bool) -> Result<(), KvError> {
        let group = self.tiers.end_load(block, ok, &mut self.stats)?;
        let bs = self.config.block_size;
        let m = &mut self.pool.meta[block as usize];
        debug_assert_eq!(m.writer, LOADER);
        m.writer = NO_WRITER;
        if ok {
            m.computed = bs as u16;
            if m.indexed {
                self.announce(block);
            }
        }
        if let Some(g) = self.tiers.load_done(group) {
            self.clock.tick += 1;
            // Tail first, as a sequence's release: children before their parents.
            // (As a holder that is never a writer: a block of the group may still be loading for
            // another group.)
            for &b in g.blocks.iter().rev() {
                self.release_block(b, LOAD_GROUP);
            }
        }
        Ok(())
    }

    /// Number of blocks being loaded from a tier.
    pub fn num_loads(&self) -> usize {
        self.tiers.num_loads()
    }

    fn is_full_cached(&self, b: BlockId) -> bool {
        let m = &self.pool.meta[b as usize];
        m.indexed && usize::from(m.computed) == self.config.block_size && m.writer == NO_WRITER
    }

    /// A pool block is being evicted: it goes down (copied before the block is reused): into the host
    /// tier when there is one (which passes it on to disk when it evicts it), else to disk.
    pub(super) fn demote(&mut self, b: BlockId) {
        if self.is_full_cached(b) {
            let priority = self.pool.meta[b as usize].effective_priority(self.clock.now_ms);
            let host = self.tiers.has_host();
            let stores = self.stats.host_stores + self.stats.disk_stores;
            self.store_down(b, priority, host, !host);
            if self.stats.host_stores + self.stats.disk_stores > stores {
                self.stats.evictions_copied += 1;
            }
        }
    }

    /// Copies pool block `b` into the host tier (`to_host`) and the disk tier (`to_disk`), where they
    /// exist and do not hold it already (a tier that holds it marks it used).
    fn store_down(&mut self, b: BlockId, priority: u8, to_host: bool, to_disk: bool) {
        let src = PoolBlock::new(&self.pool, &self.index, b);
        self.tiers
            .store_down(src, priority, to_host, to_disk, &mut self.stats);
    }

    /// Write-through of a block just hit (or just computed, for `min_hits` 0).
    pub(super) fn on_block_used(&mut self, b: BlockId, hits: u32) {
        let OffloadPolicy::WriteThrough { min_hits } = self.config.tiers.policy else {
            return;
        };
        if hits == min_hits && self.is_full_cached(b) {
            let priority = self.pool.meta[b as usize].effective_priority(self.clock.now_ms);
            self.store_down(b, priority, true, true);
        }
    }

    /// Copies the computed cached full blocks of the prefix `tokens` under `key` into the host and disk
    /// tiers (where they exist and do not hold them already) at `priority`, so that the prefix outlives
    /// the pool: a pin demoted for lack of pin budget, a prompt kept for 24 h, a saved context. Returns
    /// the tokens covered (whole blocks, from the start of `tokens`, as far as the pool holds them).
    pub fn store_prefix_down(&mut self, tokens: &[u32], key: &CacheKey, priority: u8) -> usize {
        let blocks = self.cached_prefix_blocks(tokens, key);
        if self.tiers.any() {
            for &b in &blocks {
                self.store_down(b, priority, true, true);
            }
        }
        blocks.len() * self.config.block_size
    }

    /// Swap-out of a sequence about to be preempted: its computed, cached full blocks are copied into the
    /// host tier now, so that the pool may evict them while it waits. Returns the blocks copied or found.
    ///
    /// The copies are asked for tail first, the order in which the pool evicts the freed sequence's
    /// blocks (leaves first): an executor that copies in order on a stream of its own, beside the steps
    /// (the GPU's), then holds back the step that reuses the first evicted block only for that block's
    /// copy, not for the whole sequence's.
    pub fn swap_out(&mut self, id: SeqId) -> Result<usize, KvError> {
        if !self.tiers.has_host() {
            return Ok(0);
        }
        let table = self.seq(id)?.table.clone();
        let mut n = 0;
        for b in table.into_iter().rev() {
            if self.is_full_cached(b) {
                let priority = self.pool.meta[b as usize].effective_priority(self.clock.now_ms);
                let src = PoolBlock::new(&self.pool, &self.index, b);
                n += usize::from(
                    self.tiers
                        .store_host(src, priority, &mut self.stats)
                        .is_some(),
                );
            }
        }
        Ok(n)
    }

    /// Keeps the pool's next evictions clean (write-back ahead of need): while fewer than `reserve`
    /// blocks are free, the idle cached blocks next in eviction order, up to `reserve` less the free
    /// ones, are copied into the host tier now where it does not hold them, so that the pass which
    /// evicts them later finds them stored and copies nothing. Where the executor's stores run beside
    /// its steps (a GPU's stream of stores), a step that reuses an evicted block then waits for no copy:
    /// the copies ran during the steps before. A block the pool keeps after all (hit again) keeps its
    /// host copy as well, as under write-through; a block already held is not marked used (the host
    /// tier's order stays that of real evictions). Returns the blocks stored; none without a host tier.
    ///
    /// The order is the evictor's: its present candidates, and under leaf-first eviction each one's
    /// chain of idle ancestors that no other cached block hangs from (they become candidates, tail
    /// first, as it goes). O(reserve log idle blocks).
    pub fn store_ahead(&mut self, reserve: usize) -> usize {
        if !self.tiers.has_host() {
            return 0;
        }
        let need = reserve.saturating_sub(self.pool.free.len());
        if need == 0 {
            return 0;
        }
        self.evictor.expire(&mut self.pool.meta, self.clock.now_ms);
        let mut leaves = Vec::new();
        self.evictor.peek(&self.pool.meta, need, &mut leaves);
        let leaf_first = self.config.eviction_policy == EvictionPolicy::LeafLru;
        let (mut seen, mut stored) = (0, 0);
        'leaves: for leaf in leaves {
            let mut b = leaf;
            loop {
                if seen == need {
                    break 'leaves;
                }
                seen += 1;
                let m = &self.pool.meta[b as usize];
                if self.is_full_cached(b) && self.tiers.host_lacks(m.hash) {
                    let priority = m.effective_priority(self.clock.now_ms);
                    let src = PoolBlock::new(&self.pool, &self.index, b);
                    if self
                        .tiers
                        .store_host(src, priority, &mut self.stats)
                        .is_none()
                    {
                        break 'leaves; // the host tier is full of blocks being loaded
                    }
                    stored += 1;
                }
                let parent = self.pool.meta[b as usize].parent;
                if !leaf_first || parent == NO_BLOCK || parent == ORPHAN {
                    continue 'leaves;
                }
                let p = &self.pool.meta[parent as usize];
                if !p.is_idle() || p.num_children != 1 {
                    continue 'leaves;
                }
                b = parent;
            }
        }
        self.stats.host_stored_ahead += stored as u64;
        stored
    }

    /// Write-back to disk of everything cached above it (every computed full block of the pool and of
    /// the host tier not on disk yet), for a clean shutdown: what a restart should find.
    pub fn flush_to_disk(&mut self) {
        if !self.tiers.has_disk() {
            return;
        }
        self.tiers.flush_host_to_disk(&mut self.stats);
        for b in 0..self.pool.num_blocks() {
            if self.is_full_cached(b) && self.tiers.disk_lacks(self.pool.meta[b as usize].hash) {
                self.store_down(b, DEFAULT_PRIORITY, false, true);
            }
        }
    }

    /// Enters the blocks found on disk at start (oldest first, so that they are evicted first); blocks
    /// beyond the disk tier's size are dropped (a [`TierMove::DropDisk`] each). Returns how many were
    /// entered.
    pub fn restore_disk(&mut self, blocks: impl IntoIterator<Item = TierBlock>) -> usize {
        self.tiers.restore_disk(blocks, &mut self.stats)
    }

    /// The block moves decided since the last call, in the order they must run.
    pub fn drain_tier_moves(&mut self) -> std::vec::Drain<'_, TierMove> {
        self.tiers.drain_moves()
    }

    /// Blocks held by a lower tier (`None` when it is off).
    pub fn tier_usage(&self, tier: Tier) -> Option<TierUsage> {
        self.tiers.usage(tier)
    }

    /// Every block a lower tier holds, with its slot (for checks).
    pub fn tier_blocks(&self, tier: Tier) -> Vec<(u32, TierBlock)> {
        self.tiers.blocks(tier)
    }

    /// Whether a lower tier holds a block of this hash.
    pub fn tier_has(&self, tier: Tier, hash: BlockHash) -> bool {
        self.tiers.has(tier, hash)
    }

    pub(super) fn check_tiers(&self) -> Result<(), String> {
        self.tiers.check(&self.pool.meta)
    }

    /// Blocks of `tokens` (whole blocks) under `key` that the pool and the lower tiers hold, from the
    /// first on, pending ones included: what a remote fetch need not bring. Counts no admission.
    pub fn held_prefix_blocks(&mut self, tokens: &[u32], key: &CacheKey) -> usize {
        let saved = self.stats.clone();
        let hit = self.find_cached_prefix(tokens, key);
        self.stats = saved;
        hit.blocks.len() + hit.tier.len()
    }

    /// The blocks of `tokens` (whole blocks) under `key` that the pool holds computed, from the first
    /// on, when they are the whole of what the pool and the lower tiers hold: the `held` that blocks
    /// computed elsewhere may be adopted after ([`Self::begin_adoption`]). `None` when part of that
    /// prefix is pending (being computed by a request), being loaded, or only in a lower tier: blocks
    /// fetched now could not be adopted after it; and in a hybrid pool, which adopts nothing. Counts no
    /// admission.
    pub fn adoptable_prefix_blocks(&mut self, tokens: &[u32], key: &CacheKey) -> Option<usize> {
        if self.pages.is_some() {
            return None;
        }
        let saved = self.stats.clone();
        let hit = self.find_cached_prefix(tokens, key);
        self.stats = saved;
        (hit.num_pending_blocks() == 0 && hit.tier.is_empty()).then_some(hit.blocks.len())
    }

    /// Starts adopting blocks computed elsewhere (the shared tier, L4): `tokens` (whole blocks) under
    /// `key`, of which the pool already holds the first `held` blocks, computed and idle or in use.
    /// Returns the sequence and the fresh blocks for `tokens[held × block_size..]` in order, whose bytes the
    /// caller writes before [`KvCacheManager::finish_adoption`] enters them as cached; `None` (nothing
    /// changed) when the pool's part of the prefix is not exactly `held` computed blocks any more, or
    /// when the pool has no room. Counts no admission.
    pub fn begin_adoption(
        &mut self,
        tokens: &[u32],
        key: &CacheKey,
        held: usize,
    ) -> Result<Option<(SeqId, Vec<BlockId>)>, KvError> {
        let bs = self.config.block_size;
        if self.pages.is_some() || tokens.len() % bs != 0 || held * bs >= tokens.len() {
            return Ok(None);
        }
        let saved = self.stats.clone();
        let mut hit = self.find_cached_prefix(tokens, key);
        // Exactly `held` computed pool blocks: a pending or loading block, one found below, or one more in
        // the pool has its own writer or is here already.
        if hit.blocks.len() != held || hit.num_pending_blocks() > 0 || !hit.tier.is_empty() {
            self.stats = saved;
            return Ok(None);
        }
        hit.partial = None;
        let id = self.add_sequence(key);
        let allocated = self.allocate_slots(id, &tokens[held * bs..], Some(&hit))?;
        self.stats = saved;
        if allocated.is_none() {
            self.free(id)?;
            return Ok(None);
        }
        let fresh = self.block_table(id)?[held..].to_vec();
        Ok(Some((id, fresh)))
    }

    /// Ends an adoption: the sequence's blocks are computed (their bytes are in place) and released as
    /// cached blocks, announced like blocks computed here.
    pub fn finish_adoption(&mut self, id: SeqId) -> Result<(), KvError> {
        let n = self.num_tokens(id)?;
        self.mark_computed(id, n)?;
        self.free(id)
    }
}
