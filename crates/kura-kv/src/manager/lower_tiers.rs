//! The manager's book of the lower tiers: the host tier's (L2) and the disk tier's (L3) indexes (see
//! `tier`), the loads in flight from them into the pool with the loader's references, and the block
//! moves decided since the engine last drained them.
//!
//! [`LowerTiers`] owns that state and keeps it consistent: a block stored down enters the tiers'
//! indexes and its move is queued (a block a full host tier evicts spills to disk); a load marks its
//! tier slot busy until reported. The pool's side of each step (which blocks are evicted or used, which
//! pool block a load fills, its writer and references) is the manager's (`tier`), which calls this book
//! on lookups, at eviction and when a block is used, and passes the statistics to count in.
//!
//! Tier lookups and inserts are O(log blocks of the tier) each (see `tier`); loads are O(1) each.

use std::collections::HashMap;

use crate::error::KvError;
use crate::hash::BlockHash;
use crate::pool::{BlockId, BlockMeta, BlockPool, DEFAULT_PRIORITY};
use crate::prefix::{PrefixHit, PrefixIndex};
use crate::stats::{KvStats, TierUsage};
use crate::tier::{Inserted, Tier, TierBlock, TierConfig, TierIndex, TierMove};

/// Writer of a block being loaded from a tier (never a sequence slot).
pub(super) const LOADER: u32 = u32::MAX - 1;
/// Holder of a load group's references: never a block's writer.
pub(super) const LOAD_GROUP: u32 = u32::MAX - 2;

/// The references the loader holds for one allocation's loads.
#[derive(Debug)]
pub(super) struct LoadGroup {
    /// The sequence's blocks up to its last load, each referenced once by the loader.
    pub blocks: Vec<BlockId>,
    /// Loads of the group not reported yet.
    remaining: usize,
}

/// A block of the pool being loaded from a tier.
#[derive(Clone, Copy, Debug)]
struct Load {
    tier: Tier,
    slot: u32,
    group: u32,
}

/// A computed, cached pool block going down: made into a tier's record only when a tier takes it.
#[derive(Clone, Copy)]
pub(super) struct PoolBlock<'a> {
    pool: &'a BlockPool,
    index: &'a PrefixIndex,
    block: BlockId,
}

impl<'a> PoolBlock<'a> {
    pub fn new(pool: &'a BlockPool, index: &'a PrefixIndex, block: BlockId) -> Self {
        Self { pool, index, block }
    }

    fn hash(&self) -> BlockHash {
        self.pool.meta[self.block as usize].hash
    }

    /// The block's record as the tiers keep it.
    fn record(&self) -> TierBlock {
        let m = &self.pool.meta[self.block as usize];
        TierBlock {
            hash: m.hash,
            parent_hash: m.parent_hash,
            key_digest: self.index.key_hash(m.key_id),
            tokens: self.pool.tokens_of(self.block).to_vec(),
        }
    }
}

/// The lower tiers, as the manager keeps them.
#[derive(Debug)]
pub(super) struct LowerTiers {
    /// The host tier's (L2) and the disk tier's (L3) indexes, when configured.
    host: Option<TierIndex>,
    disk: Option<TierIndex>,
    /// Moves of block bytes decided since the last drain, in the order they must run.
    moves: Vec<TierMove>,
    /// Blocks of the pool being loaded from a tier.
    loads: HashMap<BlockId, Load>,
    /// The loader's references, per allocation that issued loads.
    load_groups: HashMap<u32, LoadGroup>,
    next_load_group: u32,
    /// Whether lookups may load from the host and the disk tier (the cost check's verdict).
    loadable: [bool; 2],
}

impl LowerTiers {
    pub fn new(config: &TierConfig) -> Self {
        Self {
            host: (config.host_blocks > 0).then(|| TierIndex::new(Tier::Host, config.host_blocks)),
            disk: (config.disk_blocks > 0).then(|| TierIndex::new(Tier::Disk, config.disk_blocks)),
            moves: Vec::new(),
            loads: HashMap::new(),
            load_groups: HashMap::new(),
            next_load_group: 0,
            loadable: [true; 2],
        }
    }

    /// Whether a host or a disk tier is configured.
    pub fn any(&self) -> bool {
        self.host.is_some() || self.disk.is_some()
    }

    pub fn has_host(&self) -> bool {
        self.host.is_some()
    }

    pub fn has_disk(&self) -> bool {
        self.disk.is_some()
    }

    fn index(&self, tier: Tier) -> Option<&TierIndex> {
        match tier {
            Tier::Host => self.host.as_ref(),
            Tier::Disk => self.disk.as_ref(),
        }
    }

    fn index_mut(&mut self, tier: Tier) -> Option<&mut TierIndex> {
        match tier {
            Tier::Host => self.host.as_mut(),
            Tier::Disk => self.disk.as_mut(),
        }
    }

    /// The slot of `tier` holding the verified continuation `hash` of `parent` under `key_digest` with
    /// exactly `tokens`.
    pub fn find_in(
        &self,
        tier: Tier,
        hash: BlockHash,
        parent: BlockHash,
        key_digest: BlockHash,
        tokens: &[u32],
    ) -> Option<u32> {
        self.index(tier)?.find(hash, parent, key_digest, tokens)
    }

    pub fn loadable(&self, tier: Tier) -> bool {
        self.loadable[tier as usize]
    }

    pub fn set_loadable(&mut self, tier: Tier, loadable: bool) {
        self.loadable[tier as usize] = loadable;
    }

    /// Checks that every lower-tier block of `h` is still where the lookup found it.
    pub fn validate(&self, h: &PrefixHit) -> Result<(), KvError> {
        for &(t, slot, hash) in &h.tier {
            let ok = self
                .index(t)
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

    /// Marks the lower-tier blocks of `h` (validated) busy, so that nothing stored down meanwhile evicts
    /// them.
    pub fn reserve(&mut self, h: &PrefixHit) {
        for &(t, slot, _) in &h.tier {
            self.index_mut(t).expect("validated").add_busy(slot);
        }
    }

    /// The record a (validated) tier slot holds.
    pub fn record(&self, tier: Tier, slot: u32) -> TierBlock {
        self.index(tier)
            .and_then(|ix| ix.block(slot))
            .expect("validated")
            .clone()
    }

    /// A new load group, for one allocation's loads.
    pub fn new_load_group(&mut self) -> u32 {
        let group = self.next_load_group;
        self.next_load_group = self.next_load_group.wrapping_add(1);
        group
    }

    /// Pool block `block` is to receive `record`, from `slot` of `tier` (reserved), in load group
    /// `group`: its load is queued.
    pub fn start_load(
        &mut self,
        block: BlockId,
        tier: Tier,
        slot: u32,
        group: u32,
        record: TierBlock,
        stats: &mut KvStats,
    ) {
        self.loads.insert(block, Load { tier, slot, group });
        match tier {
            Tier::Host => {
                stats.host_hit_blocks += 1;
                self.moves.push(TierMove::LoadHost { slot, block });
            }
            Tier::Disk => {
                stats.disk_hit_blocks += 1;
                self.moves.push(TierMove::LoadDisk { record, block });
            }
        }
    }

    /// The loader's references of group `group`, whose `loads` loads are under way: `blocks` (the caller
    /// took one reference on each).
    pub fn hold_group(&mut self, group: u32, blocks: Vec<BlockId>, loads: usize) {
        self.load_groups.insert(
            group,
            LoadGroup {
                blocks,
                remaining: loads,
            },
        );
    }

    /// Ends the load into pool block `block`; without `ok`, the stored copy could not be had (it failed
    /// a check, or the read failed) and is dropped from its tier (unless other loads read it): a disk
    /// block's file is deleted too ([`TierMove::DropDisk`]), since a file that failed with an I/O error
    /// is still there, and one that failed a check may not have been deleted, and either would hold
    /// disk space outside the tier's budget. Returns the load's group, for [`Self::load_done`].
    pub fn end_load(
        &mut self,
        block: BlockId,
        ok: bool,
        stats: &mut KvStats,
    ) -> Result<u32, KvError> {
        let load = self
            .loads
            .remove(&block)
            .ok_or(KvError::UnknownLoad(block))?;
        let ix = self
            .index_mut(load.tier)
            .expect("a load names a configured tier");
        ix.drop_busy(load.slot);
        if !ok {
            if !ix.is_busy(load.slot) {
                let dropped = ix.remove(load.slot);
                if load.tier == Tier::Disk {
                    self.moves.push(TierMove::DropDisk { hash: dropped.hash });
                }
            }
            stats.load_failures += 1;
        }
        Ok(load.group)
    }

    /// Counts a load of `group` done; returns the group when it was its last, for the caller to release
    /// the loader's references.
    pub fn load_done(&mut self, group: u32) -> Option<LoadGroup> {
        let g = self
            .load_groups
            .get_mut(&group)
            .expect("a load's group lives");
        g.remaining -= 1;
        if g.remaining > 0 {
            return None;
        }
        self.load_groups.remove(&group)
    }

    /// Number of blocks being loaded.
    pub fn num_loads(&self) -> usize {
        self.loads.len()
    }

    /// Whether pool block `b` is being loaded.
    pub fn is_loading(&self, b: BlockId) -> bool {
        self.loads.contains_key(&b)
    }

    /// Every reference the loader holds, one pool block each.
    pub fn loader_refs(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.load_groups
            .values()
            .flat_map(|g| g.blocks.iter().copied())
    }

    /// Copies pool block `src` into the host tier (`to_host`) and the disk tier (`to_disk`), where they
    /// exist and do not hold it already (a tier that holds it marks it used).
    pub fn store_down(
        &mut self,
        src: PoolBlock<'_>,
        priority: u8,
        to_host: bool,
        to_disk: bool,
        stats: &mut KvStats,
    ) {
        let host_slot = if to_host {
            self.store_host(src, priority, stats)
        } else {
            None
        };
        if to_disk && self.disk.is_some() {
            let record = src.record();
            if self.disk_insert(record.clone(), priority, stats) {
                self.moves.push(match host_slot {
                    Some(slot) => TierMove::HostToDisk { slot, record },
                    None => TierMove::BlockToDisk {
                        block: src.block,
                        record,
                    },
                });
            }
        }
    }

    /// The host slot holding pool block `src`, copying it in if needed; `None` without a host tier or
    /// when it is full of blocks being loaded.
    pub fn store_host(
        &mut self,
        src: PoolBlock<'_>,
        priority: u8,
        stats: &mut KvStats,
    ) -> Option<u32> {
        let host = self.host.as_mut()?;
        if let Some(slot) = host.get(src.hash()) {
            host.touch(slot);
            return Some(slot);
        }
        match host.insert(src.record(), priority) {
            Inserted::At { slot, evicted } => {
                if let Some(ev) = evicted {
                    stats.host_evictions += 1;
                    self.spill(slot, ev, priority, stats);
                }
                self.moves.push(TierMove::Demote {
                    block: src.block,
                    slot,
                });
                stats.host_stores += 1;
                Some(slot)
            }
            Inserted::Full => {
                stats.tier_full_drops += 1;
                None
            }
        }
    }

    /// A block evicted from host slot `slot` goes to disk (before the slot is reused).
    fn spill(&mut self, slot: u32, record: TierBlock, priority: u8, stats: &mut KvStats) {
        if self.disk_insert(record.clone(), priority, stats) {
            self.moves.push(TierMove::HostToDisk { slot, record });
        }
    }

    /// Enters `record` in the disk index, evicting as needed; false without a disk tier, when it holds
    /// the block already (marked used), or when it is full of blocks being loaded.
    fn disk_insert(&mut self, record: TierBlock, priority: u8, stats: &mut KvStats) -> bool {
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
                    stats.disk_evictions += 1;
                    self.moves.push(TierMove::DropDisk { hash: ev.hash });
                }
                stats.disk_stores += 1;
                true
            }
            Inserted::Full => {
                stats.tier_full_drops += 1;
                false
            }
        }
    }

    /// Whether there is a host tier and it lacks the block of `hash`.
    pub fn host_lacks(&self, hash: BlockHash) -> bool {
        self.host.as_ref().is_some_and(|h| h.get(hash).is_none())
    }

    /// Whether there is a disk tier and it lacks the block of `hash`.
    pub fn disk_lacks(&self, hash: BlockHash) -> bool {
        self.disk.as_ref().is_some_and(|d| d.get(hash).is_none())
    }

    /// Copies every block of the host tier that the disk tier lacks down to disk.
    pub fn flush_host_to_disk(&mut self, stats: &mut KvStats) {
        let Some(host) = self.host.as_ref() else {
            return;
        };
        let missing: Vec<(u32, TierBlock)> = host
            .blocks()
            .filter(|(_, b)| self.disk_lacks(b.hash))
            .map(|(s, b)| (s, b.clone()))
            .collect();
        for (slot, record) in missing {
            if self.disk_insert(record.clone(), DEFAULT_PRIORITY, stats) {
                self.moves.push(TierMove::HostToDisk { slot, record });
            }
        }
    }

    /// Enters the blocks found on disk at start (see `KvCacheManager::restore_disk`).
    pub fn restore_disk(
        &mut self,
        blocks: impl IntoIterator<Item = TierBlock>,
        stats: &mut KvStats,
    ) -> usize {
        let mut n = 0;
        for record in blocks {
            if self.disk.is_none() {
                self.moves.push(TierMove::DropDisk { hash: record.hash });
                continue;
            }
            let hash = record.hash;
            if self.disk_insert(record, DEFAULT_PRIORITY, stats) {
                n += 1;
            } else if self.disk_lacks(hash) {
                self.moves.push(TierMove::DropDisk { hash });
            }
        }
        // Restoring is not storing.
        stats.disk_stores -= n as u64;
        n
    }

    /// The block moves decided since the last call, in the order they must run.
    pub fn drain_moves(&mut self) -> std::vec::Drain<'_, TierMove> {
        self.moves.drain(..)
    }

    /// Blocks held by a tier (`None` when it is off).
    pub fn usage(&self, tier: Tier) -> Option<TierUsage> {
        self.index(tier).map(|ix| TierUsage {
            capacity_blocks: ix.capacity(),
            used_blocks: ix.len() as u32,
        })
    }

    /// Every block a tier holds, with its slot.
    pub fn blocks(&self, tier: Tier) -> Vec<(u32, TierBlock)> {
        self.index(tier)
            .map(|ix| ix.blocks().map(|(s, b)| (s, b.clone())).collect())
            .unwrap_or_default()
    }

    /// Whether a tier holds a block of this hash.
    pub fn has(&self, tier: Tier, hash: BlockHash) -> bool {
        self.index(tier).is_some_and(|ix| ix.get(hash).is_some())
    }

    /// Checks the tiers' indexes, and every load against its group, its pool block (`meta`) and its
    /// tier slot.
    pub fn check(&self, meta: &[BlockMeta]) -> Result<(), String> {
        for ix in [self.host.as_ref(), self.disk.as_ref()]
            .into_iter()
            .flatten()
        {
            ix.check()?;
        }
        for (&b, &Load { tier, slot, group }) in &self.loads {
            if !self
                .load_groups
                .get(&group)
                .is_some_and(|g| g.blocks.contains(&b))
            {
                return Err(format!("block {b} is loading outside its load group"));
            }
            let m = &meta[b as usize];
            if m.writer != LOADER || m.ref_count == 0 {
                return Err(format!(
                    "block {b} is loading but not held by its loader (writer {}, refs {})",
                    m.writer, m.ref_count
                ));
            }
            if !self.index(tier).is_some_and(|ix| ix.is_busy(slot)) {
                return Err(format!(
                    "block {b} loads from {tier:?} slot {slot}, which is not busy"
                ));
            }
        }
        Ok(())
    }
}
