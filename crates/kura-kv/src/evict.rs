//! Eviction order: which idle cached block gives up its identity when a new block is needed.
//!
//! - [`EvictionPolicy::LeafLru`] (Kura's default, after TensorRT-LLM's dependency-aware eviction): only
//!   leaves of the prefix tree are candidates, so a parent is never evicted while a child stays cached
//!   (which would leave the child unreachable and its memory wasted).
//! - [`EvictionPolicy::PlainLru`] (vLLM v1's order, kept for comparison): any idle block; evicting a parent
//!   orphans its cached children.
//!
//! Among candidates the lowest effective priority class goes first, then the least recently released block
//! by the manager's logical clock, then the one released first. Retention raises a block's priority until
//! its expiry (milliseconds on the caller's clock, see `KvCacheManager::set_time_ms`); an expiry heap drops
//! it back to the default class when that time has come.
//!
//! Implementation: a binary min-heap with lazy deletion. A block carries the token of its one live entry;
//! any entry whose token differs, or whose block is no longer a candidate, is stale and skipped when popped.
//! Making a block a candidate is an O(log n) push (O(1) on average, since releases come in clock order);
//! taking a block out of the candidates (a hit) is O(1): its token is cleared. The heap is rebuilt from its
//! live entries when stale ones outnumber the blocks.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::pool::{BlockId, BlockMeta, DEFAULT_PRIORITY};

/// Which idle blocks may be evicted, and in what order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EvictionPolicy {
    /// Leaves only; LRU by logical clock within priority classes.
    #[default]
    LeafLru,
    /// Any idle block, LRU within priority classes (evicting a parent orphans its children).
    PlainLru,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    priority: u8,
    last_used: u64,
    token: u64,
    block: BlockId,
}

/// The idle cached blocks: how many there are, and which of them goes first.
#[derive(Debug)]
pub(crate) struct Evictor {
    pub policy: EvictionPolicy,
    /// Indexed, computed, unreferenced, unpinned blocks: all reclaimable by eviction (the candidates
    /// are those of them the policy allows now). Counted by the manager as blocks become idle and stop
    /// being idle.
    pub num_idle: u32,
    heap: BinaryHeap<Reverse<Entry>>,
    /// (retained until ms, block, identity) of blocks whose retention has not expired yet.
    expiries: BinaryHeap<Reverse<(u64, BlockId, u32)>>,
    next_token: u64,
    num_blocks: usize,
}

impl Evictor {
    pub fn new(policy: EvictionPolicy, num_blocks: u32) -> Self {
        Self {
            policy,
            num_idle: 0,
            heap: BinaryHeap::new(),
            expiries: BinaryHeap::new(),
            next_token: 1,
            num_blocks: num_blocks as usize,
        }
    }

    /// May this block be evicted now?
    pub fn is_candidate(&self, m: &BlockMeta) -> bool {
        m.is_idle()
            && match self.policy {
                EvictionPolicy::LeafLru => m.num_children == 0,
                EvictionPolicy::PlainLru => true,
            }
    }

    /// Enters `b` as a candidate (or re-enters it with its current priority and clock), if it is one.
    pub fn offer(&mut self, meta: &mut [BlockMeta], b: BlockId, now_ms: u64) {
        let m = &mut meta[b as usize];
        if !self.is_candidate(m) {
            return;
        }
        let token = self.next_token;
        self.next_token += 1;
        m.heap_token = token;
        self.heap.push(Reverse(Entry {
            priority: m.effective_priority(now_ms),
            last_used: m.last_used,
            token,
            block: b,
        }));
        if self.heap.len() > 2 * self.num_blocks + 1024 {
            self.compact(meta);
        }
    }

    /// Remembers that `b`'s retention ends at `until_ms` (so that its priority drops then).
    pub fn note_retention(&mut self, b: BlockId, identity: u32, until_ms: u64) {
        if until_ms != u64::MAX {
            self.expiries.push(Reverse((until_ms, b, identity)));
        }
    }

    /// Drops expired retentions to the default class, re-entering affected candidates.
    pub fn expire(&mut self, meta: &mut [BlockMeta], now_ms: u64) {
        while let Some(&Reverse((until, b, identity))) = self.expiries.peek() {
            if until > now_ms {
                break;
            }
            self.expiries.pop();
            let m = &mut meta[b as usize];
            if m.identity != identity || m.retained_until_ms != until {
                continue; // reused, or its retention was extended: a later entry covers it
            }
            m.retained_until_ms = 0;
            m.priority = DEFAULT_PRIORITY;
            if m.heap_token != 0 {
                self.offer(meta, b, now_ms);
            }
        }
    }

    /// Takes the next block to evict, or `None` if no block is a candidate.
    pub fn pop(&mut self, meta: &mut [BlockMeta]) -> Option<BlockId> {
        while let Some(Reverse(e)) = self.heap.pop() {
            let m = &mut meta[e.block as usize];
            if m.heap_token == e.token && self.is_candidate(m) {
                m.heap_token = 0;
                return Some(e.block);
            }
        }
        None
    }

    /// Appends the next `n` candidates (fewer where there are fewer) to `out`, in the order
    /// [`Evictor::pop`] would take them, and leaves them candidates; stale entries met on the way are
    /// dropped. O(n log entries). Under [`EvictionPolicy::LeafLru`] these are the present leaves only:
    /// a parent becomes a candidate once its last cached child has gone.
    pub fn peek(&mut self, meta: &[BlockMeta], n: usize, out: &mut Vec<BlockId>) {
        let mut live = Vec::with_capacity(n.min(self.heap.len()));
        while live.len() < n {
            let Some(Reverse(e)) = self.heap.pop() else {
                break;
            };
            let m = &meta[e.block as usize];
            if m.heap_token == e.token && self.is_candidate(m) {
                live.push(e);
            }
        }
        out.extend(live.iter().map(|e| e.block));
        self.heap.extend(live.into_iter().map(Reverse));
    }

    fn compact(&mut self, meta: &[BlockMeta]) {
        let entries = std::mem::take(&mut self.heap).into_vec();
        self.heap = entries
            .into_iter()
            .filter(|Reverse(e)| {
                let m = &meta[e.block as usize];
                m.heap_token == e.token && self.is_candidate(m)
            })
            .collect();
    }

    /// Number of entries held, stale ones included (for tests of the compaction bound).
    #[cfg(test)]
    pub fn heap_len(&self) -> usize {
        self.heap.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::BlockPool;

    fn idle_pool(n: u32) -> BlockPool {
        let mut pool = BlockPool::new(n, 4);
        for m in &mut pool.meta {
            m.indexed = true;
        }
        pool.free.clear();
        pool
    }

    #[test]
    fn lower_priority_then_older_goes_first() {
        let mut pool = idle_pool(3);
        let mut ev = Evictor::new(EvictionPolicy::LeafLru, 3);
        pool.meta[0].last_used = 5;
        pool.meta[1].last_used = 1;
        pool.meta[2].last_used = 0;
        pool.meta[2].priority = 90;
        pool.meta[2].retained_until_ms = 100;
        for b in 0..3 {
            ev.offer(&mut pool.meta, b, 0);
        }
        assert_eq!(ev.pop(&mut pool.meta), Some(1));
        assert_eq!(ev.pop(&mut pool.meta), Some(0));
        assert_eq!(ev.pop(&mut pool.meta), Some(2));
        assert_eq!(ev.pop(&mut pool.meta), None);
    }

    #[test]
    fn expired_retention_falls_back_to_the_default_class() {
        let mut pool = idle_pool(2);
        let mut ev = Evictor::new(EvictionPolicy::LeafLru, 2);
        pool.meta[0].last_used = 0;
        pool.meta[0].priority = 90;
        pool.meta[0].retained_until_ms = 10;
        ev.note_retention(0, pool.meta[0].identity, 10);
        pool.meta[1].last_used = 3;
        ev.offer(&mut pool.meta, 0, 0);
        ev.offer(&mut pool.meta, 1, 0);
        ev.expire(&mut pool.meta, 10);
        assert_eq!(
            ev.pop(&mut pool.meta),
            Some(0),
            "older once back in the default class"
        );
    }

    #[test]
    fn leaf_policy_skips_blocks_with_children_and_stale_entries() {
        let mut pool = idle_pool(2);
        let mut ev = Evictor::new(EvictionPolicy::LeafLru, 2);
        ev.offer(&mut pool.meta, 0, 0);
        ev.offer(&mut pool.meta, 1, 0);
        pool.meta[0].num_children = 1;
        pool.meta[1].ref_count = 1; // became referenced: not idle
        assert_eq!(ev.pop(&mut pool.meta), None);
    }

    #[test]
    fn peek_names_the_next_candidates_in_order_and_leaves_them() {
        let mut pool = idle_pool(5);
        let mut ev = Evictor::new(EvictionPolicy::LeafLru, 5);
        for (b, used) in [(0, 4), (1, 2), (2, 0), (3, 3), (4, 1)] {
            pool.meta[b as usize].last_used = used;
            ev.offer(&mut pool.meta, b, 0);
        }
        pool.meta[4].ref_count = 1; // no longer idle: its entry is stale
        let mut next = Vec::new();
        ev.peek(&pool.meta, 3, &mut next);
        assert_eq!(next, vec![2, 1, 3]);
        next.clear();
        ev.peek(&pool.meta, 10, &mut next);
        assert_eq!(next, vec![2, 1, 3, 0], "fewer than asked: every candidate");
        let popped: Vec<_> = std::iter::from_fn(|| ev.pop(&mut pool.meta)).collect();
        assert_eq!(popped, vec![2, 1, 3, 0], "peeking took nothing");
    }

    #[test]
    fn stale_entries_are_compacted() {
        let mut pool = idle_pool(4);
        let mut ev = Evictor::new(EvictionPolicy::PlainLru, 4);
        for round in 0..3000u64 {
            for b in 0..4 {
                pool.meta[b as usize].last_used = round;
                ev.offer(&mut pool.meta, b, 0);
            }
        }
        assert!(ev.heap_len() <= 2 * 4 + 1024);
        let mut got: Vec<_> = std::iter::from_fn(|| ev.pop(&mut pool.meta)).collect();
        got.sort_unstable();
        assert_eq!(got, vec![0, 1, 2, 3]);
    }
}
