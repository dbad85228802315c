//! The block pool: a flat arena of fixed-size blocks addressed by integer ids, their metadata, the token ids
//! each block holds, reference counts and an O(1) free list.
//!
//! Design after vLLM v1's `block_pool.py` and mistral.rs' `block_pool.rs`, with arenas and integer ids instead
//! of objects (TGI's `radix.rs`): block `b`'s metadata is `meta[b]` and its tokens are
//! `tokens[b * block_size .. (b + 1) * block_size]`, so no block costs a heap allocation.
//!
//! A block is in exactly one of three places:
//! - the free list: no identity, no references (`ref_count == 0`, `!indexed`);
//! - referenced by one or more sequences (`ref_count > 0`), cached (`indexed`) or private;
//! - idle in the cache: `indexed`, `ref_count == 0`, fully computed; evictable unless pinned.
//!
//! The tree links (`parent`, `first_child`/`next_sibling`/`prev_sibling`, `num_children`) describe the prefix
//! tree of indexed blocks and are kept by `prefix`; the pool only stores them. All operations here are O(1).

use crate::error::KvError;
use crate::hash::BlockHash;

/// A block's index in the pool (and in the KV storage arena).
pub type BlockId = u32;

/// Sentinel: "no block" (a root block's parent, an empty child list).
pub const NO_BLOCK: BlockId = u32::MAX;
/// Sentinel parent of an indexed block whose parent was evicted before it (plain LRU only): the block is
/// unreachable by lookups until it is evicted or replaced.
pub const ORPHAN: BlockId = u32::MAX - 1;
/// Sentinel writer: nobody is computing this block (computed, or its writer was cancelled).
pub const NO_WRITER: u32 = u32::MAX;
/// Priority of a block without retention (TensorRT-LLM's default on its 0..=100 scale).
pub const DEFAULT_PRIORITY: u8 = 35;
/// The highest retention priority.
pub const MAX_PRIORITY: u8 = 100;

/// Everything the manager knows about one block besides its tokens.
///
/// Laid out by hand in two cache lines: the first holds what a lookup, an attach and a release read (the
/// hot path of a prefix hit touches no other line); the second, the tree links and LRU/retention times.
#[derive(Clone, Debug)]
#[repr(C, align(64))]
pub(crate) struct BlockMeta {
    // --- first cache line: lookup, attach, release ---
    /// Chained hash of this block; meaningful only while `indexed`.
    pub hash: BlockHash,
    /// Parent in the prefix tree: `NO_BLOCK` for a root, `ORPHAN` after the parent was evicted (plain LRU).
    pub parent: BlockId,
    /// Interned cache key of the sequence that filled this block.
    pub key_id: u32,
    /// Bumped every time the block loses its identity (evicted, withdrawn, freed), so that a prefix hit taken
    /// earlier can tell that the block it names is no longer the same content.
    pub identity: u32,
    /// Number of sequence block tables holding this block. Never negative by type; a decrement below zero
    /// is a bug and panics.
    pub ref_count: u32,
    /// Number of token ids written into the block (`filled <= block_size`).
    pub filled: u16,
    /// Number of leading tokens whose KV is present (`computed <= filled`).
    pub computed: u16,
    /// Entered in the prefix index (hittable).
    pub indexed: bool,
    /// A `Stored` event was emitted for it (so its removal must be announced too).
    pub announced: bool,
    /// Retention priority; the eviction order is by effective priority class first.
    pub priority: u8,
    /// Number of live pins; a pinned block is never evicted.
    pub pin_count: u32,
    /// Token of this block's live entry in the eviction heap; 0 = none. Stale heap entries carry another.
    pub heap_token: u64,
    /// Number of indexed children; a block with children is never evicted by leaf-first eviction.
    pub num_children: u32,
    /// Sequence slot computing the block's missing tokens, or `NO_WRITER`.
    pub writer: u32,
    // --- second cache line: tree links, times ---
    /// Hash of the parent block (the key hash for a root); meaningful only while `indexed`.
    pub parent_hash: BlockHash,
    /// Logical time of the last release; orders idle blocks for LRU.
    pub last_used: u64,
    /// Retention: `priority` applies while the manager's time (ms) is below this; 0 = no retention.
    pub retained_until_ms: u64,
    pub first_child: BlockId,
    pub next_sibling: BlockId,
    pub prev_sibling: BlockId,
    /// Links among indexed blocks with the same parent hash and first token (the candidates of a partial
    /// match; see `prefix`).
    pub next_in_group: BlockId,
    pub prev_in_group: BlockId,
    /// Times a lookup attached this block while it was cached (for write-through after N hits).
    pub hits: u32,
}

impl BlockMeta {
    fn empty() -> Self {
        Self {
            hash: BlockHash(0),
            parent_hash: BlockHash(0),
            last_used: 0,
            heap_token: 0,
            retained_until_ms: 0,
            ref_count: 0,
            pin_count: 0,
            parent: NO_BLOCK,
            first_child: NO_BLOCK,
            next_sibling: NO_BLOCK,
            prev_sibling: NO_BLOCK,
            next_in_group: NO_BLOCK,
            prev_in_group: NO_BLOCK,
            hits: 0,
            num_children: 0,
            key_id: 0,
            writer: NO_WRITER,
            identity: 0,
            filled: 0,
            computed: 0,
            priority: DEFAULT_PRIORITY,
            indexed: false,
            announced: false,
        }
    }

    /// The priority class the block is evicted in at time `now_ms`.
    pub fn effective_priority(&self, now_ms: u64) -> u8 {
        if self.retained_until_ms > now_ms {
            self.priority
        } else {
            DEFAULT_PRIORITY
        }
    }

    /// Cached, unreferenced and unpinned: counts as reclaimable capacity.
    pub fn is_idle(&self) -> bool {
        self.indexed && self.ref_count == 0 && self.pin_count == 0
    }
}

/// The arena of blocks.
#[derive(Debug)]
pub(crate) struct BlockPool {
    pub block_size: usize,
    pub meta: Vec<BlockMeta>,
    /// Token ids, `block_size` slots per block.
    pub tokens: Vec<u32>,
    /// Blocks with no identity and no references; popped and pushed at the end (O(1)).
    pub free: Vec<BlockId>,
    /// Blocks with `ref_count > 0`.
    pub num_referenced: u32,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks; panics where [`BlockPool::try_new`] fails (tests only).
    #[cfg(test)]
    pub fn new(num_blocks: u32, block_size: usize) -> Self {
        Self::try_new(num_blocks, block_size).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A pool of `num_blocks` free blocks, allocated fallibly: its metadata takes
    /// `num_blocks × (128 + 4 × block_size + 4)` bytes, and a count from outside (a simulator's capacity,
    /// a memory budget) must give an error, not abort the process, when that cannot be had.
    pub fn try_new(num_blocks: u32, block_size: usize) -> Result<Self, KvError> {
        let n = num_blocks as usize;
        let per_block = std::mem::size_of::<BlockMeta>()
            + block_size.saturating_mul(std::mem::size_of::<u32>())
            + std::mem::size_of::<BlockId>();
        let refuse = |why: String| {
            KvError::Config(format!(
                "cannot allocate the metadata of {num_blocks} blocks of {block_size} tokens \
                 ({} bytes): {why}",
                (n as u64).saturating_mul(per_block as u64)
            ))
        };
        let num_tokens = n
            .checked_mul(block_size)
            .ok_or_else(|| refuse("the token count overflows".into()))?;
        let mut meta = Vec::new();
        meta.try_reserve_exact(n)
            .map_err(|e| refuse(e.to_string()))?;
        meta.resize(n, BlockMeta::empty());
        let mut tokens = Vec::new();
        tokens
            .try_reserve_exact(num_tokens)
            .map_err(|e| refuse(e.to_string()))?;
        tokens.resize(num_tokens, 0);
        let mut free = Vec::new();
        free.try_reserve_exact(n)
            .map_err(|e| refuse(e.to_string()))?;
        // Reversed so that block 0 is handed out first (easier to read in tests and traces).
        free.extend((0..num_blocks).rev());
        Ok(Self {
            block_size,
            meta,
            tokens,
            free,
            num_referenced: 0,
        })
    }

    pub fn num_blocks(&self) -> u32 {
        self.meta.len() as u32
    }

    /// The token ids written into block `b`.
    pub fn tokens_of(&self, b: BlockId) -> &[u32] {
        let start = b as usize * self.block_size;
        &self.tokens[start..start + self.meta[b as usize].filled as usize]
    }

    /// All `block_size` token slots of block `b`.
    pub fn slots_mut(&mut self, b: BlockId) -> &mut [u32] {
        let start = b as usize * self.block_size;
        &mut self.tokens[start..start + self.block_size]
    }

    /// Copies the first `n` token ids of `src` into `dst` (the id side of a copy-on-write).
    pub fn copy_tokens(&mut self, src: BlockId, dst: BlockId, n: usize) {
        let bs = self.block_size;
        let (s, d) = (src as usize * bs, dst as usize * bs);
        self.tokens.copy_within(s..s + n, d);
    }

    /// Takes a block from the free list, resetting its state for a new owner.
    pub fn pop_free(&mut self) -> Option<BlockId> {
        let b = self.free.pop()?;
        self.reset(b);
        Some(b)
    }

    /// Returns an unreferenced, unindexed block to the free list.
    pub fn push_free(&mut self, b: BlockId) {
        let m = &mut self.meta[b as usize];
        assert!(
            m.ref_count == 0 && !m.indexed && m.pin_count == 0,
            "block {b} returned to the free list while referenced, pinned or indexed"
        );
        m.identity = m.identity.wrapping_add(1);
        m.heap_token = 0;
        self.free.push(b);
    }

    /// Clears a block taken for a new owner (from the free list or by eviction).
    pub fn reset(&mut self, b: BlockId) {
        let m = &mut self.meta[b as usize];
        let identity = m.identity;
        *m = BlockMeta::empty();
        m.identity = identity.wrapping_add(1);
    }

    /// Adds one reference; returns true if the block was idle before (so the caller updates idle counts).
    pub fn incref(&mut self, b: BlockId) -> bool {
        let m = &mut self.meta[b as usize];
        let was_idle = m.is_idle();
        if m.ref_count == 0 {
            self.num_referenced += 1;
        }
        m.ref_count += 1;
        // Its heap entry, if any, is now stale.
        m.heap_token = 0;
        was_idle
    }

    /// Drops one reference; returns the remaining count. Panics on a count that would go negative: that is a
    /// double free inside the manager, never a caller's input.
    pub fn decref(&mut self, b: BlockId) -> u32 {
        let m = &mut self.meta[b as usize];
        m.ref_count = m
            .ref_count
            .checked_sub(1)
            .unwrap_or_else(|| panic!("block {b}: reference count would go negative"));
        if m.ref_count == 0 {
            self.num_referenced -= 1;
        }
        m.ref_count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_fills_two_cache_lines_with_the_hot_fields_in_the_first() {
        assert_eq!(std::mem::size_of::<BlockMeta>(), 128);
        assert_eq!(std::mem::offset_of!(BlockMeta, parent_hash), 64);
    }

    #[test]
    fn free_list_hands_out_every_block_once() {
        let mut pool = BlockPool::new(4, 8);
        let mut got: Vec<_> = std::iter::from_fn(|| pool.pop_free()).collect();
        assert_eq!(got, vec![0, 1, 2, 3]);
        got.sort_unstable();
        got.dedup();
        assert_eq!(got.len(), 4);
        assert!(pool.pop_free().is_none());
        pool.push_free(2);
        assert_eq!(pool.pop_free(), Some(2));
    }

    #[test]
    fn identity_changes_when_a_block_is_reused() {
        let mut pool = BlockPool::new(1, 4);
        let b = pool.pop_free().unwrap();
        let id = pool.meta[b as usize].identity;
        pool.push_free(b);
        let b2 = pool.pop_free().unwrap();
        assert_eq!(b, b2);
        assert_ne!(pool.meta[b as usize].identity, id);
    }

    #[test]
    fn a_pool_the_allocator_refuses_is_an_error_not_an_abort() {
        // (2^32 - 3) × 1024 token slots: 16 TiB of u32, far more than any test machine (this aborted).
        let err = BlockPool::try_new(u32::MAX - 2, 1024).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("cannot allocate the metadata of 4294967293 blocks of 1024 tokens"),
            "{msg}"
        );
        assert_eq!(BlockPool::try_new(3, 16).unwrap().free.len(), 3);
    }

    #[test]
    #[should_panic(expected = "negative")]
    fn decref_below_zero_panics() {
        let mut pool = BlockPool::new(1, 4);
        let b = pool.pop_free().unwrap();
        pool.decref(b);
    }
}
