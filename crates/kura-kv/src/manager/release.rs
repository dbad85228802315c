//! Releasing blocks and taking them back: the release of a sequence's references, eviction of idle cached
//! blocks (hook, events, index and tree upkeep), and clearing the cache.
//!
//! Release is O(1) per block (an O(log n) heap push when a block becomes an eviction candidate); taking a
//! block is O(1) from the free list, O(log n) by eviction.

use super::KvCacheManager;
use crate::events::{EvictedBlock, KvEvent};
use crate::pool::{BlockId, NO_BLOCK, NO_WRITER};

impl KvCacheManager {
    /// Drops one reference to `b` held by sequence slot `holder`.
    pub(super) fn release_block(&mut self, b: BlockId, holder: u32) {
        let bs = self.config.block_size;
        let remaining = self.pool.decref(b);
        let m = &mut self.pool.meta[b as usize];
        m.last_used = self.clock.tick;
        if m.writer == holder {
            m.writer = NO_WRITER;
            if remaining > 0 && m.indexed && m.computed < m.filled {
                self.stats.withdrawn_blocks += 1;
            }
        }
        if remaining > 0 {
            return;
        }
        if m.indexed && usize::from(m.computed) == bs {
            if m.pin_count == 0 {
                self.evictor.num_idle += 1;
                self.evictor
                    .offer(&mut self.pool.meta, b, self.clock.now_ms);
            }
        } else if m.indexed {
            // Pending and abandoned: there is no KV to keep.
            assert!(m.pin_count == 0, "pending block {b} was pinned");
            if m.num_children > 0 {
                // Only after a failed load: its children (loaded) become unreachable orphans.
                self.index.orphan_children(&mut self.pool, b);
            }
            let parent = self.index.remove(&mut self.pool, b);
            self.free_to_pool(b);
            if parent != NO_BLOCK {
                self.evictor
                    .offer(&mut self.pool.meta, parent, self.clock.now_ms);
            }
        } else {
            self.free_to_pool(b);
        }
    }

    /// Returns unreferenced, unindexed block `b` to the free list, with its pages (hybrid pool).
    pub(super) fn free_to_pool(&mut self, b: BlockId) {
        self.free_block_pages(b);
        self.pool.push_free(b);
    }

    /// A block for a new owner, referenced once: from the free list, else by evicting the next candidate.
    pub(super) fn take_block(&mut self) -> BlockId {
        let b = match self.pool.pop_free() {
            Some(b) => b,
            None => {
                self.evictor.expire(&mut self.pool.meta, self.clock.now_ms);
                let b = self
                    .evictor
                    .pop(&mut self.pool.meta)
                    .expect("capacity was checked: an idle block must be evictable");
                self.demote(b);
                self.drop_cached(b);
                self.stats.evictions += 1;
                self.free_block_pages(b);
                self.pool.reset(b);
                b
            }
        };
        self.pool.incref(b);
        self.take_full_pages(b);
        b
    }

    /// Removes idle cached block `b` from the cache (hook, event, index, tree), leaving it unowned.
    pub(super) fn drop_cached(&mut self, b: BlockId) {
        let m = &self.pool.meta[b as usize];
        debug_assert!(m.is_idle(), "dropping block {b}, which is not idle");
        let now_ms = self.clock.now_ms;
        self.outbox.evict(|| EvictedBlock {
            block: b,
            hash: m.hash,
            parent_hash: (m.parent != NO_BLOCK).then_some(m.parent_hash),
            tokens: self.pool.tokens_of(b),
            priority: m.effective_priority(now_ms),
        });
        if m.announced {
            self.outbox.record(|| KvEvent::Removed {
                hash: m.hash,
                block: b,
            });
        }
        self.pool.meta[b as usize].announced = false;
        if self.pool.meta[b as usize].num_children > 0 {
            self.index.orphan_children(&mut self.pool, b);
        }
        let parent = self.index.remove(&mut self.pool, b);
        self.evictor.num_idle -= 1;
        if parent != NO_BLOCK {
            self.evictor
                .offer(&mut self.pool.meta, parent, self.clock.now_ms);
        }
    }

    pub(super) fn announce(&mut self, b: BlockId) {
        let m = &mut self.pool.meta[b as usize];
        if m.announced {
            return;
        }
        m.announced = true;
        let hits = m.hits;
        let m = &self.pool.meta[b as usize];
        self.outbox.record(|| {
            let parent = (m.parent != NO_BLOCK).then_some(m.parent_hash);
            KvEvent::Stored {
                hash: m.hash,
                parent,
                block: b,
                tokens: self.pool.tokens_of(b).to_vec(),
                key: parent.is_none().then(|| self.index.key(m.key_id).clone()),
            }
        });
        self.on_block_used(b, hits);
    }

    /// Drops every idle cached block (pinned and referenced ones stay). Returns how many were dropped.
    pub fn clear_cache(&mut self) -> usize {
        let events_before = self.outbox.mark();
        let mut dropped = 0;
        while let Some(b) = self.evictor.pop(&mut self.pool.meta) {
            self.drop_cached(b);
            self.free_to_pool(b);
            dropped += 1;
        }
        self.drop_idle_window_parts();
        if self.outbox.recording() && self.index.len() == 0 {
            self.outbox.clear_since(events_before);
        }
        dropped
    }
}
