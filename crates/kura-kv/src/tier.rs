//! The lower tiers' bookkeeping: which blocks the host-memory tier (L2) and the disk tier (L3) hold, in
//! which slot, and which of them goes first when a tier is full. The bytes live elsewhere (the engine's
//! host arena and disk store); the manager decides every move and hands it to the engine as a
//! [`TierMove`], in an order that is correct when the moves run one after another before the step's
//! forward pass.
//!
//! ```text
//!   L1 (the pool attention reads)  ──evicted──▶  L2 (host arena)  ──evicted──▶  L3 (disk)  ──evicted──▶ gone
//!        ▲                                          │                              │
//!        └────────── a prefix hit loads ────────────┴──────────────────────────────┘
//! ```
//!
//! The tiers are inclusive: a block loaded back into L1 stays in L2 and L3, so that its next eviction
//! from L1 costs no copy, and L3 keeps what a restart should find. Each tier evicts leaves first (a block
//! whose child is in the same tier stays), lowest priority class first, then least recently used; a
//! block being loaded from a tier (`busy`) is never evicted from it. A tier keeps the priority class a
//! block had when it came down.
//!
//! Costs: lookup O(1) per block (one probe and one compare of the block's tokens); insert, touch and
//! evict O(log blocks in the tier).

use std::collections::{BTreeSet, HashMap};

use crate::hash::BlockHash;

/// A lower tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// L2: host memory that holds blocks at rest.
    Host = 0,
    /// L3: files on disk, kept across restarts.
    Disk = 1,
}

impl Tier {
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

/// When a block is copied down besides its eviction from L1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OffloadPolicy {
    /// Only on eviction (and, for the disk tier, on [`crate::KvCacheManager::flush_to_disk`]).
    #[default]
    WriteBack,
    /// Also as soon as a block has been hit `min_hits` times (0: as soon as it is computed), after
    /// Dynamo's frequency filter: blocks that are reused are the ones worth keeping below.
    WriteThrough { min_hits: u32 },
}

/// Sizes of the lower tiers in blocks (0: the tier is off) and the offload policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierConfig {
    pub host_blocks: u32,
    pub disk_blocks: u32,
    pub policy: OffloadPolicy,
}

impl TierConfig {
    pub fn enabled(&self) -> bool {
        self.host_blocks > 0 || self.disk_blocks > 0
    }
}

/// A block as the lower tiers know it, and as a disk record stores it: its chained hash, its parent's
/// hash (the cache key's digest for a first block), the digest of its cache key, and its tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierBlock {
    pub hash: BlockHash,
    pub parent_hash: BlockHash,
    pub key_digest: BlockHash,
    pub tokens: Vec<u32>,
}

/// One move of block bytes, decided by the manager and run by the engine in the order given, all before
/// the step's forward pass (a slot or block named by a later move may be one an earlier move read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TierMove {
    /// Copy the KV of L1 block `block` into host slot `slot`.
    Demote { block: u32, slot: u32 },
    /// Write host slot `slot` to disk as `record` (its bytes are taken now: a later move may reuse it).
    HostToDisk { slot: u32, record: TierBlock },
    /// Write L1 block `block` to disk as `record` (no host tier, or a flush).
    BlockToDisk { block: u32, record: TierBlock },
    /// Delete the disk copy of a block (the disk tier evicted it, or a load of it failed).
    DropDisk { hash: BlockHash },
    /// Copy host slot `slot` into L1 block `block`, then report the load done.
    LoadHost { slot: u32, block: u32 },
    /// Read `record` from disk into L1 block `block` (off the engine thread), then report the load done,
    /// failed if the stored block does not verify.
    LoadDisk { record: TierBlock, block: u32 },
}

#[derive(Debug)]
struct Entry {
    block: TierBlock,
    priority: u8,
    last_used: u64,
    /// Loads in flight from this entry.
    busy: u32,
    /// Its key in `candidates`, while it is one.
    candidate: Option<(u8, u64)>,
}

/// One tier's index: slot → block, hash → slot, leaf-first LRU order within priority classes.
#[derive(Debug)]
pub(crate) struct TierIndex {
    pub tier: Tier,
    slots: Vec<Option<Entry>>,
    free: Vec<u32>,
    map: HashMap<BlockHash, u32>,
    /// Parent hash → live entries of this tier with that parent (present or not).
    children: HashMap<BlockHash, u32>,
    candidates: BTreeSet<(u8, u64, u32)>,
    clock: u64,
}

/// What [`TierIndex::insert`] did.
#[derive(Debug)]
pub(crate) enum Inserted {
    /// In `slot`; `evicted` is the block that gave its slot up, if the tier was full.
    At {
        slot: u32,
        evicted: Option<TierBlock>,
    },
    /// The tier is full of blocks that may not be evicted now (busy, or parents of others).
    Full,
}

impl TierIndex {
    pub fn new(tier: Tier, capacity: u32) -> Self {
        Self {
            tier,
            slots: (0..capacity).map(|_| None).collect(),
            free: (0..capacity).rev().collect(),
            map: HashMap::new(),
            children: HashMap::new(),
            candidates: BTreeSet::new(),
            clock: 0,
        }
    }

    pub fn capacity(&self) -> u32 {
        self.slots.len() as u32
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn get(&self, hash: BlockHash) -> Option<u32> {
        self.map.get(&hash).copied()
    }

    pub fn block(&self, slot: u32) -> Option<&TierBlock> {
        self.slots
            .get(slot as usize)
            .and_then(|e| e.as_ref())
            .map(|e| &e.block)
    }

    /// The slot holding the verified continuation `hash` of `parent_hash` under `key_digest` with
    /// exactly `tokens`: a hash collision is a miss, never wrong KV.
    pub fn find(
        &self,
        hash: BlockHash,
        parent_hash: BlockHash,
        key_digest: BlockHash,
        tokens: &[u32],
    ) -> Option<u32> {
        let slot = self.get(hash)?;
        let b = self.block(slot)?;
        (b.parent_hash == parent_hash && b.key_digest == key_digest && b.tokens == tokens)
            .then_some(slot)
    }

    /// Every block held, with its slot (for checks and flushes).
    pub fn blocks(&self) -> impl Iterator<Item = (u32, &TierBlock)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(s, e)| e.as_ref().map(|e| (s as u32, &e.block)))
    }

    pub fn is_busy(&self, slot: u32) -> bool {
        self.slots[slot as usize]
            .as_ref()
            .is_some_and(|e| e.busy > 0)
    }

    /// Marks `slot` most recently used.
    pub fn touch(&mut self, slot: u32) {
        self.clock += 1;
        let clock = self.clock;
        if let Some(e) = self.slots[slot as usize].as_mut() {
            e.last_used = clock;
        }
        self.refresh(slot);
    }

    pub fn add_busy(&mut self, slot: u32) {
        if let Some(e) = self.slots[slot as usize].as_mut() {
            e.busy += 1;
        }
        self.refresh(slot);
    }

    pub fn drop_busy(&mut self, slot: u32) {
        if let Some(e) = self.slots[slot as usize].as_mut() {
            e.busy = e.busy.checked_sub(1).unwrap_or_else(|| {
                panic!("{:?} slot {slot}: load count would go negative", self.tier)
            });
        }
        self.refresh(slot);
    }

    /// Enters `block` (not present) with `priority`, evicting the first candidate when the tier is full.
    pub fn insert(&mut self, block: TierBlock, priority: u8) -> Inserted {
        debug_assert!(!self.map.contains_key(&block.hash));
        let (slot, evicted) = match self.free.pop() {
            Some(s) => (s, None),
            None => {
                let Some(&(_, _, victim)) = self.candidates.first() else {
                    return Inserted::Full;
                };
                let evicted = self.remove(victim);
                let slot = self.free.pop().expect("the victim's slot was just freed");
                debug_assert_eq!(slot, victim);
                (slot, Some(evicted))
            }
        };
        self.clock += 1;
        let hash = block.hash;
        let parent = block.parent_hash;
        self.slots[slot as usize] = Some(Entry {
            block,
            priority,
            last_used: self.clock,
            busy: 0,
            candidate: None,
        });
        self.map.insert(hash, slot);
        *self.children.entry(parent).or_insert(0) += 1;
        if let Some(p) = self.get(parent) {
            self.refresh(p); // no longer a leaf
        }
        self.refresh(slot);
        Inserted::At { slot, evicted }
    }

    /// Removes the block in `slot` (evicted, or found corrupt) and frees the slot.
    pub fn remove(&mut self, slot: u32) -> TierBlock {
        let e = self.slots[slot as usize]
            .take()
            .unwrap_or_else(|| panic!("{:?} slot {slot} removed while empty", self.tier));
        if let Some((p, t)) = e.candidate {
            self.candidates.remove(&(p, t, slot));
        }
        self.map.remove(&e.block.hash);
        let parent = e.block.parent_hash;
        if let Some(n) = self.children.get_mut(&parent) {
            *n -= 1;
            if *n == 0 {
                self.children.remove(&parent);
            }
        }
        if let Some(p) = self.get(parent) {
            self.refresh(p); // may have become a leaf
        }
        self.free.push(slot);
        e.block
    }

    /// Puts `slot` in or out of the candidates according to its state.
    fn refresh(&mut self, slot: u32) {
        let Some(e) = self.slots[slot as usize].as_mut() else {
            return;
        };
        if let Some((p, t)) = e.candidate.take() {
            self.candidates.remove(&(p, t, slot));
        }
        let leaf = !self.children.contains_key(&e.block.hash);
        if e.busy == 0 && leaf {
            e.candidate = Some((e.priority, e.last_used));
            self.candidates.insert((e.priority, e.last_used, slot));
        }
    }

    /// Checks the index's own bookkeeping (for the invariant tests).
    pub fn check(&self) -> Result<(), String> {
        let mut live = 0;
        let mut children: HashMap<BlockHash, u32> = HashMap::new();
        for (s, e) in self.slots.iter().enumerate() {
            let Some(e) = e else { continue };
            live += 1;
            if self.map.get(&e.block.hash) != Some(&(s as u32)) {
                return Err(format!("{:?} slot {s}: not indexed by its hash", self.tier));
            }
            *children.entry(e.block.parent_hash).or_insert(0) += 1;
        }
        if live != self.map.len() || live + self.free.len() != self.slots.len() {
            return Err(format!(
                "{:?}: {live} live slots, {} indexed, {} free, {} in all",
                self.tier,
                self.map.len(),
                self.free.len(),
                self.slots.len()
            ));
        }
        if children != self.children {
            return Err(format!("{:?}: child counts are off", self.tier));
        }
        for (s, e) in self.slots.iter().enumerate() {
            let Some(e) = e else { continue };
            let should = e.busy == 0 && !children.contains_key(&e.block.hash);
            if should != e.candidate.is_some() {
                return Err(format!(
                    "{:?} slot {s}: eviction candidate {} but should be {should}",
                    self.tier,
                    e.candidate.is_some()
                ));
            }
        }
        if self.candidates.len()
            != self
                .slots
                .iter()
                .flatten()
                .filter(|e| e.candidate.is_some())
                .count()
        {
            return Err(format!("{:?}: stale eviction candidates", self.tier));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(hash: u128, parent: u128) -> TierBlock {
        TierBlock {
            hash: BlockHash(hash),
            parent_hash: BlockHash(parent),
            key_digest: BlockHash(1),
            tokens: vec![hash as u32; 4],
        }
    }

    fn slot_of(i: Inserted) -> (u32, Option<TierBlock>) {
        match i {
            Inserted::At { slot, evicted } => (slot, evicted),
            Inserted::Full => panic!("tier full"),
        }
    }

    #[test]
    fn leaves_go_first_then_least_recently_used() {
        let mut t = TierIndex::new(Tier::Host, 3);
        let (a, _) = slot_of(t.insert(block(10, 1), 35));
        let (_b, _) = slot_of(t.insert(block(11, 10), 35)); // child of a: a is not a leaf
        let (c, _) = slot_of(t.insert(block(20, 1), 35));
        t.touch(c);
        // Candidates: 11 (older) and 20; a has a child.
        let (_, ev) = slot_of(t.insert(block(30, 1), 35));
        assert_eq!(ev.unwrap().hash, BlockHash(11));
        // Now a is a leaf again, and older than 20 and 30.
        let (_, ev) = slot_of(t.insert(block(40, 1), 35));
        assert_eq!(ev.unwrap().hash, BlockHash(10));
        assert!(t.get(BlockHash(10)).is_none() && t.get(BlockHash(20)).is_some());
        let _ = a;
        t.check().unwrap();
    }

    #[test]
    fn busy_and_higher_class_blocks_stay() {
        let mut t = TierIndex::new(Tier::Disk, 2);
        let (a, _) = slot_of(t.insert(block(10, 1), 35));
        let (b, _) = slot_of(t.insert(block(20, 1), 90));
        t.add_busy(a);
        let (_, ev) = slot_of(t.insert(block(30, 1), 35));
        assert_eq!(ev.unwrap().hash, BlockHash(20), "a is busy");
        let _ = b;
        // Now: a busy, 30 a candidate.
        t.add_busy(t.get(BlockHash(30)).unwrap());
        assert!(matches!(t.insert(block(40, 1), 35), Inserted::Full));
        t.drop_busy(a);
        let (_, ev) = slot_of(t.insert(block(40, 1), 35));
        assert_eq!(ev.unwrap().hash, BlockHash(10));
        t.check().unwrap();
    }

    #[test]
    fn find_verifies_parent_key_and_tokens() {
        let mut t = TierIndex::new(Tier::Host, 2);
        let (s, _) = slot_of(t.insert(block(10, 1), 35));
        let toks = vec![10u32; 4];
        assert_eq!(
            t.find(BlockHash(10), BlockHash(1), BlockHash(1), &toks),
            Some(s)
        );
        assert_eq!(
            t.find(BlockHash(10), BlockHash(2), BlockHash(1), &toks),
            None
        );
        assert_eq!(
            t.find(BlockHash(10), BlockHash(1), BlockHash(9), &toks),
            None
        );
        assert_eq!(
            t.find(BlockHash(10), BlockHash(1), BlockHash(1), &[10, 10, 10, 11]),
            None
        );
    }
}
