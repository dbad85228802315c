//! The prefix index: hash → block, plus the tree links (parent, children) of indexed blocks.
//!
//! ```text
//!   key "tenant-a"          key "tenant-b"        each block: hash = H(parent hash ‖ its tokens)
//!      │                        │                 a root's parent hash is its cache key's hash
//!    [b0]──────┐              [b7]
//!      │       │
//!    [b1]    [b4]   ← siblings: children of b0, linked first_child / next_sibling / prev_sibling
//!      │
//!    [b2]           ← a leaf: no indexed children; only leaves are evicted (see `evict`)
//! ```
//!
//! A lookup walks the prompt block by block, hashing each full block onto its parent's hash, and accepts a
//! hit only if the indexed block also has exactly these tokens, this parent block and this cache key: a hash
//! collision (forced in tests by narrowing the hash) is a miss, never wrong KV. After the last full hit, the
//! children of the last hit (or the key's roots) that start with the prompt's next token are scanned for the
//! longest common token prefix with the rest of the prompt: those tokens are reused by copying them into a
//! fresh block. Children are grouped by (parent hash, first token) for that, so that a parent with
//! thousands of children (a shared system prompt) costs a lookup nothing more.
//!
//! Cost: O(1) expected per full block (one hash, one probe, one compare of `block_size` tokens); the partial
//! scan is O(children of the last hit that share the next token).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::hash::{BlockHash, BlockHasher, CacheKey};
use crate::pool::{BlockId, BlockPool, NO_BLOCK, ORPHAN};
use crate::tier::Tier;

/// Hashes a key that is already a uniformly random 128-bit hash by folding it to 64 bits.
#[derive(Default)]
pub(crate) struct FoldHasher(u64);

impl Hasher for FoldHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = (v as u64) ^ ((v >> 64) as u64);
    }
}

type FoldMap<V> = HashMap<u128, V, BuildHasherDefault<FoldHasher>>;

/// An interned cache key.
#[derive(Debug)]
pub(crate) struct KeyEntry {
    pub key: CacheKey,
    pub hash: BlockHash,
    /// First root block (a block with no parent) of this key; the roots form a sibling list.
    pub first_root: BlockId,
    /// Live sequences plus indexed blocks under this key; the entry is dropped at zero.
    pub refs: u32,
}

/// The longest cached prefix of a prompt, as found by [`crate::KvCacheManager::find_cached_prefix`].
///
/// Opaque to the scheduler except for what its accessors say; pass it back to
/// [`crate::KvCacheManager::allocate_slots`] unchanged, before any other allocation.
#[derive(Clone, Debug, Default)]
pub struct PrefixHit {
    pub(crate) key_id: Option<u32>,
    pub(crate) block_size: usize,
    /// Full blocks matched, with the identity they had at lookup time.
    pub(crate) blocks: Vec<(BlockId, u32)>,
    /// Hash of the last matched full block (the key hash when none matched).
    pub(crate) last_hash: BlockHash,
    pub(crate) num_pending: usize,
    /// A cached block whose first `num_tokens` tokens equal the prompt's next tokens: (block, identity, n).
    pub(crate) partial: Option<(BlockId, u32, usize)>,
    /// Full blocks after `blocks` found in a lower tier: (tier, slot, hash). They are loaded into fresh
    /// blocks, which the sequence waits for as for pending ones.
    pub(crate) tier: Vec<(Tier, u32, BlockHash)>,
    /// Tokens looked up (the admission counters count them when the hit is attached).
    pub(crate) queried_tokens: usize,
    /// Full blocks the lookup matched in the pool past the hit, left out because their sliding
    /// layers' window parts were reclaimed (a hybrid pool).
    pub(crate) window_cut: usize,
    /// Full blocks after `tier` found in a lower tier whose loads the cost check refuses
    /// ([`crate::KvCacheManager::set_tier_loadable`]), by tier (host, disk): the lookup stopped at the
    /// first and they are computed again, as a miss.
    pub(crate) refused: [usize; 2],
}

impl PrefixHit {
    /// Tokens served from the cache: full blocks plus the partially reused block's matching tokens.
    pub fn num_cached_tokens(&self) -> usize {
        (self.blocks.len() + self.tier.len()) * self.block_size + self.partial_tokens()
    }

    /// Full blocks found in `tier` and left to be recomputed because the cost check refuses that tier's
    /// loads (the lookup stopped at the first of them).
    pub fn num_refused_tier_blocks(&self, tier: Tier) -> usize {
        self.refused[tier as usize]
    }

    /// Number of full blocks found in `tier` (to be loaded), after the blocks found in the pool.
    pub fn num_tier_blocks(&self, tier: Tier) -> usize {
        self.tier.iter().filter(|(t, _, _)| *t == tier).count()
    }

    /// Number of full blocks hit in the pool (those of lower tiers not counted).
    pub fn num_full_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Number of hit blocks whose KV another sequence is still computing (early reuse): the scheduler
    /// waits for them (see [`crate::KvCacheManager::pending_status`]) instead of computing them again.
    pub fn num_pending_blocks(&self) -> usize {
        self.num_pending
    }

    /// Tokens of a partly shared cached block that will be copied instead of recomputed.
    pub fn partial_tokens(&self) -> usize {
        self.partial.map_or(0, |(_, _, n)| n)
    }

    /// Blocks the pool held past the hit, left out because their window parts were reclaimed: the
    /// prompt missed them because of the sliding window, not because they were evicted.
    pub fn num_window_cut_blocks(&self) -> usize {
        self.window_cut
    }

    /// Block ids of the full blocks hit, in prompt order.
    pub fn block_ids(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.blocks.iter().map(|&(b, _)| b)
    }
}

/// The key of the group of children of `parent_hash` whose first token is `first`.
fn group_key(parent_hash: BlockHash, first: u32) -> u128 {
    parent_hash.0.rotate_left(17)
        ^ u128::from(first).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835)
}

/// The hash map and the key table.
#[derive(Debug, Default)]
pub(crate) struct PrefixIndex {
    map: FoldMap<BlockId>,
    /// Head of each (parent hash, first token) group; groups whose keys collide share a list, which is
    /// harmless since every candidate is verified.
    groups: FoldMap<BlockId>,
    keys: Vec<Option<KeyEntry>>,
    key_ids: HashMap<CacheKey, u32>,
    free_key_ids: Vec<u32>,
}

/// Outcome of entering a block in the index.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Insert {
    Inserted,
    /// The hash is taken by this other block (same content, or a collision); the new block stays private.
    Occupied(BlockId),
}

impl PrefixIndex {
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// The id of `key`, interning it and taking one reference.
    pub fn intern(&mut self, key: &CacheKey, hasher: &mut BlockHasher) -> u32 {
        if let Some(&id) = self.key_ids.get(key) {
            self.entry_mut(id).refs += 1;
            return id;
        }
        let entry = KeyEntry {
            key: key.clone(),
            hash: hasher.key_hash(key),
            first_root: NO_BLOCK,
            refs: 1,
        };
        let id = match self.free_key_ids.pop() {
            Some(id) => {
                self.keys[id as usize] = Some(entry);
                id
            }
            None => {
                self.keys.push(Some(entry));
                (self.keys.len() - 1) as u32
            }
        };
        self.key_ids.insert(key.clone(), id);
        id
    }

    /// The id of `key` if any sequence or block uses it.
    pub fn key_id(&self, key: &CacheKey) -> Option<u32> {
        self.key_ids.get(key).copied()
    }

    pub fn key(&self, id: u32) -> &CacheKey {
        &self.entry(id).key
    }

    pub fn key_hash(&self, id: u32) -> BlockHash {
        self.entry(id).hash
    }

    pub fn retain_key(&mut self, id: u32) {
        self.entry_mut(id).refs += 1;
    }

    pub fn release_key(&mut self, id: u32) {
        let e = self.entry_mut(id);
        e.refs -= 1;
        if e.refs == 0 {
            assert_eq!(e.first_root, NO_BLOCK, "key {id} released with roots left");
            let e = self.keys[id as usize].take().expect("checked above");
            self.key_ids.remove(&e.key);
            self.free_key_ids.push(id);
        }
    }

    pub fn num_keys(&self) -> usize {
        self.key_ids.len()
    }

    fn entry(&self, id: u32) -> &KeyEntry {
        self.keys[id as usize]
            .as_ref()
            .unwrap_or_else(|| panic!("cache key {id} used after release"))
    }

    fn entry_mut(&mut self, id: u32) -> &mut KeyEntry {
        self.keys[id as usize]
            .as_mut()
            .unwrap_or_else(|| panic!("cache key {id} used after release"))
    }

    /// The block indexed under `hash`, if any.
    pub fn get(&self, hash: BlockHash) -> Option<BlockId> {
        self.map.get(&hash.0).copied()
    }

    /// Enters full block `b` under `hash` as a child of `parent` (`NO_BLOCK` for a root of `key_id`).
    pub fn insert(
        &mut self,
        pool: &mut BlockPool,
        b: BlockId,
        hash: BlockHash,
        parent_hash: BlockHash,
        parent: BlockId,
        key_id: u32,
    ) -> Insert {
        use std::collections::hash_map::Entry;
        match self.map.entry(hash.0) {
            Entry::Occupied(e) => return Insert::Occupied(*e.get()),
            Entry::Vacant(e) => {
                e.insert(b);
            }
        }
        let head = if parent == NO_BLOCK {
            let e = self.entry_mut(key_id);
            std::mem::replace(&mut e.first_root, b)
        } else {
            let p = &mut pool.meta[parent as usize];
            debug_assert!(p.indexed, "parent {parent} of {b} is not indexed");
            p.num_children += 1;
            std::mem::replace(&mut p.first_child, b)
        };
        if head != NO_BLOCK {
            pool.meta[head as usize].prev_sibling = b;
        }
        let gk = group_key(parent_hash, pool.tokens_of(b)[0]);
        let group_head = self.groups.insert(gk, b).unwrap_or(NO_BLOCK);
        if group_head != NO_BLOCK {
            pool.meta[group_head as usize].prev_in_group = b;
        }
        let m = &mut pool.meta[b as usize];
        m.next_in_group = group_head;
        m.prev_in_group = NO_BLOCK;
        m.hash = hash;
        m.parent_hash = parent_hash;
        m.parent = parent;
        m.key_id = key_id;
        m.next_sibling = head;
        m.prev_sibling = NO_BLOCK;
        m.first_child = NO_BLOCK;
        m.num_children = 0;
        m.indexed = true;
        self.entry_mut(key_id).refs += 1;
        Insert::Inserted
    }

    /// Removes block `b` from the index and from its parent's child list. Returns its former parent
    /// (`NO_BLOCK` for a root or an orphan). Its own children must have been handled (none, or orphaned).
    pub fn remove(&mut self, pool: &mut BlockPool, b: BlockId) -> BlockId {
        let m = &pool.meta[b as usize];
        assert!(m.indexed, "block {b} removed from the index twice");
        assert_eq!(m.num_children, 0, "block {b} removed with children");
        let (hash, parent, prev, next, key_id) =
            (m.hash, m.parent, m.prev_sibling, m.next_sibling, m.key_id);
        let removed = self.map.remove(&hash.0);
        debug_assert_eq!(removed, Some(b));
        let (gprev, gnext) = (m.prev_in_group, m.next_in_group);
        let gk = group_key(m.parent_hash, pool.tokens_of(b)[0]);
        if gprev != NO_BLOCK {
            pool.meta[gprev as usize].next_in_group = gnext;
        } else if gnext != NO_BLOCK {
            self.groups.insert(gk, gnext);
        } else {
            self.groups.remove(&gk);
        }
        if gnext != NO_BLOCK {
            pool.meta[gnext as usize].prev_in_group = gprev;
        }
        if parent != ORPHAN {
            if prev != NO_BLOCK {
                pool.meta[prev as usize].next_sibling = next;
            } else if parent == NO_BLOCK {
                self.entry_mut(key_id).first_root = next;
            } else {
                pool.meta[parent as usize].first_child = next;
            }
            if next != NO_BLOCK {
                pool.meta[next as usize].prev_sibling = prev;
            }
            if parent != NO_BLOCK {
                pool.meta[parent as usize].num_children -= 1;
            }
        }
        let m = &mut pool.meta[b as usize];
        m.indexed = false;
        m.parent = NO_BLOCK;
        m.next_sibling = NO_BLOCK;
        m.prev_sibling = NO_BLOCK;
        self.release_key(key_id);
        if parent == ORPHAN {
            NO_BLOCK
        } else {
            parent
        }
    }

    /// Checks the partial-match groups: every indexed block is in exactly the group of its parent hash and
    /// first token, with consistent back links. For the invariant tests.
    pub fn check_groups(&self, pool: &BlockPool) -> Result<(), String> {
        let mut seen = 0;
        for (&gk, &head) in &self.groups {
            let mut prev = NO_BLOCK;
            let mut c = head;
            while c != NO_BLOCK {
                let m = &pool.meta[c as usize];
                if !m.indexed || m.prev_in_group != prev {
                    return Err(format!("block {c}: bad partial-match group links"));
                }
                if group_key(m.parent_hash, pool.tokens_of(c)[0]) != gk {
                    return Err(format!(
                        "block {c} is in another partial-match group than its own"
                    ));
                }
                seen += 1;
                prev = c;
                c = m.next_in_group;
            }
        }
        if seen != self.map.len() {
            return Err(format!(
                "{seen} blocks in partial-match groups, {} indexed",
                self.map.len()
            ));
        }
        Ok(())
    }

    /// Cuts every child of `b` loose (plain LRU evicting a parent): they become unreachable orphans.
    pub fn orphan_children(&mut self, pool: &mut BlockPool, b: BlockId) {
        let mut c = pool.meta[b as usize].first_child;
        while c != NO_BLOCK {
            let m = &mut pool.meta[c as usize];
            let next = m.next_sibling;
            m.parent = ORPHAN;
            m.next_sibling = NO_BLOCK;
            m.prev_sibling = NO_BLOCK;
            c = next;
        }
        let m = &mut pool.meta[b as usize];
        m.first_child = NO_BLOCK;
        m.num_children = 0;
    }

    /// Is `b` the verified cached continuation of `parent` (under `key_id`) with exactly `tokens`?
    fn verifies(
        pool: &BlockPool,
        b: BlockId,
        parent: BlockId,
        key_id: u32,
        tokens: &[u32],
    ) -> bool {
        let m = &pool.meta[b as usize];
        m.indexed && m.parent == parent && m.key_id == key_id && pool.tokens_of(b) == tokens
    }

    /// Finds the longest cached prefix of `tokens` under `key_id` into `hit` (which is cleared first).
    /// Only blocks `copyable` accepts are candidates for partial reuse (a hybrid pool copies a block's
    /// sliding layers too, so it needs them).
    pub fn lookup(
        &self,
        pool: &BlockPool,
        hasher: &mut BlockHasher,
        key_id: u32,
        tokens: &[u32],
        hit: &mut PrefixHit,
        copyable: impl Fn(BlockId) -> bool,
    ) {
        let bs = pool.block_size;
        hit.key_id = Some(key_id);
        hit.block_size = bs;
        hit.blocks.clear();
        hit.num_pending = 0;
        hit.partial = None;
        hit.tier.clear();
        let mut parent_hash = self.key_hash(key_id);
        let mut parent = NO_BLOCK;
        for chunk in tokens.chunks_exact(bs) {
            let h = hasher.chain(parent_hash, chunk);
            match self.map.get(&h.0) {
                Some(&b) if Self::verifies(pool, b, parent, key_id, chunk) => {
                    let m = &pool.meta[b as usize];
                    if usize::from(m.computed) < bs {
                        hit.num_pending += 1;
                    }
                    if hit.blocks.is_empty() {
                        hit.blocks.reserve(tokens.len() / bs);
                    }
                    hit.blocks.push((b, m.identity));
                    parent = b;
                    parent_hash = h;
                }
                _ => break,
            }
        }
        hit.last_hash = parent_hash;
        let rest = &tokens[hit.blocks.len() * bs..];
        if rest.is_empty() {
            return;
        }
        // Partial reuse: the child (or root) sharing the longest token prefix with the rest of the prompt;
        // only those starting with the rest's first token can share anything.
        let mut c = self
            .groups
            .get(&group_key(parent_hash, rest[0]))
            .copied()
            .unwrap_or(NO_BLOCK);
        let limit = rest.len().min(bs);
        let mut best: Option<(BlockId, usize)> = None;
        while c != NO_BLOCK {
            let m = &pool.meta[c as usize];
            // Only computed KV can be copied; a pending block's bytes are not there yet.
            if m.parent == parent
                && m.key_id == key_id
                && usize::from(m.computed) == bs
                && copyable(c)
            {
                let n = pool.tokens_of(c)[..limit]
                    .iter()
                    .zip(&rest[..limit])
                    .take_while(|(a, b)| a == b)
                    .count();
                if n > best.map_or(0, |(_, n)| n) {
                    best = Some((c, n));
                }
            }
            c = m.next_in_group;
        }
        hit.partial = best.map(|(b, n)| (b, pool.meta[b as usize].identity, n));
    }
}
