//! The manager's side of the lower tiers (see `tier`): looking a prompt up past the pool, attaching the
//! blocks found below as loads, sending evicted blocks down, write-through, swap, and the disk tier's
//! flush and restore.
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

use super::{Allocation, KvCacheManager, SeqId};
use crate::error::KvError;
use crate::hash::{BlockHash, CacheKey};
use crate::pool::{BlockId, DEFAULT_PRIORITY, NO_WRITER};
use crate::prefix::PrefixHit;
use crate::stats::TierUsage;
use crate::tier::{Inserted, OffloadPolicy, Tier, TierBlock, TierIndex, TierMove};

/// Writer of a block being loaded from a tier (never a sequence slot).
pub(crate) const LOADER: u32 = u32::MAX - 1;
/// Holder of a load group's references: never a block's writer.
const LOAD_GROUP: u32 = u32::MAX - 2;

/// The references the loader holds for one allocation's loads.
#[derive(Debug)]
pub(crate) struct LoadGroup {
    /// The sequence's blocks up to its last load, each referenced once by the loader.
    pub blocks: Vec<BlockId>,
    /// Loads of the group not reported yet.
    pub remaining: usize,
}

impl KvCacheManager {
    fn tier_index(&self, tier: Tier) -> Option<&TierIndex> {
        match tier {
            Tier::Host => self.host.as_ref(),
            Tier::Disk => self.disk.as_ref(),
        }
    }

    fn tier_index_mut(&mut self, tier: Tier) -> Option<&mut TierIndex> {
        match tier {
            Tier::Host => self.host.as_mut(),
            Tier::Disk => self.disk.as_mut(),
        }
    }

    /// Goes on past the pool's hit into the host tier, then the disk tier, block by block, each block
    /// verified against its parent's hash, the key's digest and its tokens.
    pub(super) fn lookup_tiers(&mut self, key_id: u32, tokens: &[u32], hit: &mut PrefixHit) {
        if self.host.is_none() && self.disk.is_none() {
            return;
        }
        let bs = self.config.block_size;
        let key_digest = self.index.key_hash(key_id);
        let mut parent = hit.last_hash;
        for chunk in tokens[hit.blocks.len() * bs..].chunks_exact(bs) {
            let h = self.hasher.chain(parent, chunk);
            let found = [Tier::Host, Tier::Disk].into_iter().find_map(|t| {
                let slot = self.tier_index(t)?.find(h, parent, key_digest, chunk)?;
                Some((t, slot))
            });
            let Some((t, slot)) = found else { break };
            hit.tier.push((t, slot, h));
            parent = h;
        }
        if !hit.tier.is_empty() {
            hit.partial = None; // a partial block would follow the last full one, which is below
        }
    }

    pub(super) fn validate_tier_hit(&self, h: &PrefixHit) -> Result<(), KvError> {
        for &(t, slot, hash) in &h.tier {
            let ok = self
                .tier_index(t)
                .and_then(|ix| ix.block(slot))
                .is_some_and(|b| b.hash == hash);
            if !ok {
                return Err(KvError::StaleTierHit {
                    tier: t.as_str(),
                    slot,
                });
            }
        }
        Ok(())
    }

    /// Marks the hit's lower-tier blocks busy, so that nothing this allocation sends down evicts them.
    pub(super) fn reserve_tier(&mut self, h: &PrefixHit) {
        for &(t, slot, _) in &h.tier {
            self.tier_index_mut(t).expect("validated").add_busy(slot);
        }
    }

    /// Attaches the hit's lower-tier blocks (reserved) as loads into fresh blocks of the sequence.
    pub(super) fn attach_tier(
        &mut self,
        id: SeqId,
        h: &PrefixHit,
        alloc: &mut Allocation,
    ) -> Result<(), KvError> {
        let group = self.next_load_group;
        self.next_load_group = self.next_load_group.wrapping_add(1);
        for &(t, slot, _) in &h.tier {
            let record = self
                .tier_index(t)
                .and_then(|ix| ix.block(slot))
                .expect("validated")
                .clone();
            let before = self.seq(id)?.table.len();
            self.append_tokens(id, &record.tokens, alloc)?;
            let b = self.seq(id)?.table[before];
            let m = &mut self.pool.meta[b as usize];
            m.writer = LOADER;
            self.loads.insert(b, (t, slot, group));
            match t {
                Tier::Host => {
                    self.stats.host_hit_blocks += 1;
                    self.moves.push(TierMove::LoadHost { slot, block: b });
                }
                Tier::Disk => {
                    self.stats.disk_hit_blocks += 1;
                    self.moves.push(TierMove::LoadDisk { record, block: b });
                }
            }
        }
        if !h.tier.is_empty() {
            let blocks = self.seq(id)?.table[..h.blocks.len() + h.tier.len()].to_vec();
            for &b in &blocks {
                let was_idle = self.pool.incref(b);
                debug_assert!(!was_idle, "the sequence holds it");
            }
            self.load_groups.insert(
                group,
                LoadGroup {
                    blocks,
                    remaining: h.tier.len(),
                },
            );
        }
        Ok(())
    }

    /// Reports a load issued by a [`TierMove::LoadHost`] or [`TierMove::LoadDisk`] as done: with
    /// `ok`, the block's KV is present (it becomes hittable and its waiters go on); without, the stored
    /// copy did not verify: it is dropped from its tier and the block's waiters compute it.
    pub fn complete_load(&mut self, block: BlockId, ok: bool) -> Result<(), KvError> {
        let (t, slot, group) = self
            .loads
            .remove(&block)
            .ok_or(KvError::UnknownLoad(block))?;
        let ix = self
            .tier_index_mut(t)
            .expect("a load names a configured tier");
        ix.drop_busy(slot);
        if !ok {
            if !ix.is_busy(slot) {
                ix.remove(slot);
            }
            self.stats.load_failures += 1;
        }
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
        let g = self
            .load_groups
            .get_mut(&group)
            .expect("a load's group lives");
        g.remaining -= 1;
        if g.remaining == 0 {
            let g = self.load_groups.remove(&group).expect("checked");
            self.clock += 1;
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
        self.loads.len()
    }

    /// The record of an indexed, computed pool block as the tiers keep it.
    fn record_of(&self, b: BlockId) -> TierBlock {
        let m = &self.pool.meta[b as usize];
        TierBlock {
            hash: m.hash,
            parent_hash: m.parent_hash,
            key_digest: self.index.key_hash(m.key_id),
            tokens: self.pool.tokens_of(b).to_vec(),
        }
    }

    fn is_full_cached(&self, b: BlockId) -> bool {
        let m = &self.pool.meta[b as usize];
        m.indexed && usize::from(m.computed) == self.config.block_size && m.writer == NO_WRITER
    }

    /// A pool block is being evicted: it goes down (copied before the block is reused): into the host
    /// tier when there is one (which passes it on to disk when it evicts it), else to disk.
    pub(super) fn demote(&mut self, b: BlockId) {
        if self.is_full_cached(b) {
            let priority = self.pool.meta[b as usize].effective_priority(self.now_ms);
            let host = self.host.is_some();
            self.store_down(b, priority, host, !host);
        }
    }

    /// Copies pool block `b` into the host tier (`to_host`) and the disk tier (`to_disk`), where they
    /// exist and do not hold it already (a tier that holds it marks it used).
    fn store_down(&mut self, b: BlockId, priority: u8, to_host: bool, to_disk: bool) {
        let host_slot = if to_host {
            self.host_store(b, priority)
        } else {
            None
        };
        if to_disk && self.disk.is_some() {
            let record = self.record_of(b);
            if self.disk_insert(record.clone(), priority) {
                self.moves.push(match host_slot {
                    Some(slot) => TierMove::HostToDisk { slot, record },
                    None => TierMove::BlockToDisk { block: b, record },
                });
            }
        }
    }

    /// The host slot holding pool block `b`, copying it in if needed; `None` without a host tier or when
    /// it is full of blocks being loaded.
    fn host_store(&mut self, b: BlockId, priority: u8) -> Option<u32> {
        let hash = self.pool.meta[b as usize].hash;
        let host = self.host.as_mut()?;
        if let Some(slot) = host.get(hash) {
            host.touch(slot);
            return Some(slot);
        }
        let record = self.record_of(b);
        match self.host.as_mut()?.insert(record, priority) {
            Inserted::At { slot, evicted } => {
                if let Some(ev) = evicted {
                    self.stats.host_evictions += 1;
                    self.spill(slot, ev, priority);
                }
                self.moves.push(TierMove::Demote { block: b, slot });
                self.stats.host_stores += 1;
                Some(slot)
            }
            Inserted::Full => {
                self.stats.tier_full_drops += 1;
                None
            }
        }
    }

    /// A block evicted from host slot `slot` goes to disk (before the slot is reused).
    fn spill(&mut self, slot: u32, record: TierBlock, priority: u8) {
        if self.disk_insert(record.clone(), priority) {
            self.moves.push(TierMove::HostToDisk { slot, record });
        }
    }

    /// Enters `record` in the disk index, evicting as needed; false without a disk tier, when it holds
    /// the block already (marked used), or when it is full of blocks being loaded.
    fn disk_insert(&mut self, record: TierBlock, priority: u8) -> bool {
        let Some(disk) = self.disk.as_mut() else {
            return false;
        };
        if let Some(s) = disk.get(record.hash) {
            disk.touch(s);
            return false;
        }
        match disk.insert(record, priority) {
            Inserted::At { evicted, .. } => {
                if let Some(ev) = evicted {
                    self.stats.disk_evictions += 1;
                    self.moves.push(TierMove::DropDisk { hash: ev.hash });
                }
                self.stats.disk_stores += 1;
                true
            }
            Inserted::Full => {
                self.stats.tier_full_drops += 1;
                false
            }
        }
    }

    /// Write-through of a block just hit (or just computed, for `min_hits` 0).
    pub(super) fn on_block_used(&mut self, b: BlockId, hits: u32) {
        let OffloadPolicy::WriteThrough { min_hits } = self.config.tiers.policy else {
            return;
        };
        if hits == min_hits && self.is_full_cached(b) {
            let priority = self.pool.meta[b as usize].effective_priority(self.now_ms);
            self.store_down(b, priority, true, true);
        }
    }

    /// Copies the computed cached full blocks of the prefix `tokens` under `key` into the host and disk
    /// tiers (where they exist and do not hold them already) at `priority`, so that the prefix outlives
    /// the pool: a pin demoted for lack of pin budget, a prompt kept for 24 h, a saved context. Returns
    /// the tokens covered (whole blocks, from the start of `tokens`, as far as the pool holds them).
    pub fn store_prefix_down(&mut self, tokens: &[u32], key: &CacheKey, priority: u8) -> usize {
        let blocks = self.cached_prefix_blocks(tokens, key);
        if self.host.is_some() || self.disk.is_some() {
            for &b in &blocks {
                self.store_down(b, priority, true, true);
            }
        }
        blocks.len() * self.config.block_size
    }

    /// Swap-out of a sequence about to be preempted: its computed, cached full blocks are copied into the
    /// host tier now, so that the pool may evict them while it waits. Returns the blocks copied or found.
    pub fn swap_out(&mut self, id: SeqId) -> Result<usize, KvError> {
        if self.host.is_none() {
            return Ok(0);
        }
        let table = self.seq(id)?.table.clone();
        let mut n = 0;
        for b in table {
            if self.is_full_cached(b) {
                let priority = self.pool.meta[b as usize].effective_priority(self.now_ms);
                n += usize::from(self.host_store(b, priority).is_some());
            }
        }
        Ok(n)
    }

    /// Write-back to disk of everything cached above it (every computed full block of the pool and of
    /// the host tier not on disk yet), for a clean shutdown: what a restart should find.
    pub fn flush_to_disk(&mut self) {
        if self.disk.is_none() {
            return;
        }
        if let Some(host) = self.host.as_ref() {
            let missing: Vec<(u32, TierBlock)> = host
                .blocks()
                .filter(|(_, b)| self.disk.as_ref().is_some_and(|d| d.get(b.hash).is_none()))
                .map(|(s, b)| (s, b.clone()))
                .collect();
            for (slot, record) in missing {
                if self.disk_insert(record.clone(), DEFAULT_PRIORITY) {
                    self.moves.push(TierMove::HostToDisk { slot, record });
                }
            }
        }
        for b in 0..self.pool.num_blocks() {
            if self.is_full_cached(b) {
                let hash = self.pool.meta[b as usize].hash;
                if self.disk.as_ref().is_some_and(|d| d.get(hash).is_none()) {
                    let record = self.record_of(b);
                    if self.disk_insert(record.clone(), DEFAULT_PRIORITY) {
                        self.moves.push(TierMove::BlockToDisk { block: b, record });
                    }
                }
            }
        }
    }

    /// Enters the blocks found on disk at start (oldest first, so that they are evicted first); blocks
    /// beyond the disk tier's size are dropped (a [`TierMove::DropDisk`] each). Returns how many were
    /// entered.
    pub fn restore_disk(&mut self, blocks: impl IntoIterator<Item = TierBlock>) -> usize {
        let mut n = 0;
        for record in blocks {
            if self.disk.is_none() {
                self.moves.push(TierMove::DropDisk { hash: record.hash });
                continue;
            }
            let hash = record.hash;
            if self.disk_insert(record, DEFAULT_PRIORITY) {
                n += 1;
            } else if self.disk.as_ref().is_some_and(|d| d.get(hash).is_none()) {
                self.moves.push(TierMove::DropDisk { hash });
            }
        }
        // Restoring is not storing.
        self.stats.disk_stores -= n as u64;
        n
    }

    /// The block moves decided since the last call, in the order they must run.
    pub fn drain_tier_moves(&mut self) -> std::vec::Drain<'_, TierMove> {
        self.moves.drain(..)
    }

    /// Blocks held by a lower tier (`None` when it is off).
    pub fn tier_usage(&self, tier: Tier) -> Option<TierUsage> {
        self.tier_index(tier).map(|ix| TierUsage {
            capacity_blocks: ix.capacity(),
            used_blocks: ix.len() as u32,
        })
    }

    /// Every block a lower tier holds, with its slot (for checks).
    pub fn tier_blocks(&self, tier: Tier) -> Vec<(u32, TierBlock)> {
        self.tier_index(tier)
            .map(|ix| ix.blocks().map(|(s, b)| (s, b.clone())).collect())
            .unwrap_or_default()
    }

    /// Whether a lower tier holds a block of this hash.
    pub fn tier_has(&self, tier: Tier, hash: BlockHash) -> bool {
        self.tier_index(tier)
            .is_some_and(|ix| ix.get(hash).is_some())
    }

    pub(super) fn check_tiers(&self) -> Result<(), String> {
        for ix in [self.host.as_ref(), self.disk.as_ref()]
            .into_iter()
            .flatten()
        {
            ix.check()?;
        }
        for (&b, &(t, slot, group)) in &self.loads {
            if !self
                .load_groups
                .get(&group)
                .is_some_and(|g| g.blocks.contains(&b))
            {
                return Err(format!("block {b} is loading outside its load group"));
            }
            let m = &self.pool.meta[b as usize];
            if m.writer != LOADER || m.ref_count == 0 {
                return Err(format!(
                    "block {b} is loading but not held by its loader (writer {}, refs {})",
                    m.writer, m.ref_count
                ));
            }
            if !self.tier_index(t).is_some_and(|ix| ix.is_busy(slot)) {
                return Err(format!(
                    "block {b} loads from {t:?} slot {slot}, which is not busy"
                ));
            }
        }
        Ok(())
    }

    /// Blocks of `tokens` (whole blocks) under `key` that the pool and the lower tiers hold, from the
    /// first on, pending ones included: what a remote fetch need not bring. Counts no admission.
    pub fn held_prefix_blocks(&mut self, tokens: &[u32], key: &CacheKey) -> usize {
        let saved = self.stats.clone();
        let hit = self.find_cached_prefix(tokens, key);
        self.stats = saved;
        hit.blocks.len() + hit.tier.len()
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
