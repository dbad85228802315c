//! The steps of an allocation: checking a prefix hit, attaching its blocks (and copying a partly shared
//! one), copy-on-write of a shared partial last block, appending tokens, and entering newly full blocks in
//! the index (pending until computed, so that others can attach early).
//!
//! All O(blocks touched); entering a block costs one hash.

use super::{Allocation, KvCacheManager, SeqId, Sequence};
use crate::error::KvError;
use crate::pool::{NO_BLOCK, NO_WRITER, ORPHAN};
use crate::prefix::{Insert, PrefixHit};

impl KvCacheManager {
    pub(super) fn validate_hit(
        &self,
        id: SeqId,
        seq: &Sequence,
        h: &PrefixHit,
    ) -> Result<(), KvError> {
        if seq.num_tokens != 0 {
            return Err(KvError::HitOnNonEmptySequence {
                seq: id,
                num_tokens: seq.num_tokens,
            });
        }
        if h.key_id != Some(seq.key_id) || h.block_size != self.config.block_size {
            return Err(KvError::HitKeyMismatch { seq: id });
        }
        let partial = h.partial.map(|(b, identity, _)| (b, identity));
        for (b, identity) in h.blocks.iter().copied().chain(partial) {
            let m = &self.pool.meta[b as usize];
            if m.identity != identity || !m.indexed {
                return Err(KvError::StaleHit { block: b });
            }
        }
        self.validate_tier_hit(h)
    }

    pub(super) fn attach_hit(
        &mut self,
        id: SeqId,
        h: &PrefixHit,
        alloc: &mut Allocation,
    ) -> Result<(), KvError> {
        let bs = self.config.block_size;
        let retained = !self.seq(id)?.retention.is_empty();
        for (i, &(b, _)) in h.blocks.iter().enumerate() {
            if self.pool.incref(b) {
                self.evictor.num_idle -= 1;
            }
            let m = &mut self.pool.meta[b as usize];
            if usize::from(m.computed) < bs {
                self.stats.pending_waits += 1;
            } else {
                m.hits = m.hits.saturating_add(1);
                let hits = m.hits;
                self.on_block_used(b, hits);
            }
            if retained {
                self.apply_retention(id, i, b)?;
            }
        }
        self.stats.block_ops += h.blocks.len() as u64;
        let seq = self.seq_mut(id)?;
        seq.table.extend(h.block_ids());
        seq.num_tokens = h.blocks.len() * bs;
        seq.last_hash = h.last_hash;
        if h.num_pending == 0 {
            seq.num_computed = seq.num_tokens;
        }
        self.ref_hit_window(id, h)?;
        if let Some((src, _, n)) = h.partial {
            // Hold the source while taking the destination, so that this very allocation cannot evict it.
            if self.pool.incref(src) {
                self.evictor.num_idle -= 1;
            }
            self.win_ref(src);
            let dst = self.take_block();
            let index = h.blocks.len();
            self.new_block_window(dst, index, true);
            self.pool.copy_tokens(src, dst, n);
            let m = &mut self.pool.meta[dst as usize];
            m.filled = n as u16;
            m.computed = n as u16; // by the copy, which precedes the forward pass
            m.writer = id.index;
            self.push_copy(alloc, src, dst, n);
            self.win_unref(src);
            self.release_block(src, id.index);
            alloc.num_new_blocks += 1;
            self.apply_retention(id, index, dst)?;
            let seq = self.seq_mut(id)?;
            seq.table.push(dst);
            seq.num_tokens += n;
            if h.num_pending == 0 {
                seq.num_computed = seq.num_tokens;
            }
        }
        Ok(())
    }

    pub(super) fn copy_on_write_last(
        &mut self,
        id: SeqId,
        alloc: &mut Allocation,
    ) -> Result<(), KvError> {
        let bs = self.config.block_size;
        let seq = self.seq(id)?;
        let fill = seq.num_tokens % bs;
        let Some(&last) = seq.table.last() else {
            return Ok(());
        };
        if fill == 0 || self.pool.meta[last as usize].ref_count <= 1 {
            return Ok(());
        }
        let i = seq.table.len() - 1;
        let dst = self.take_block();
        self.new_block_window(dst, i, true);
        self.pool.copy_tokens(last, dst, fill);
        let computed = self.pool.meta[last as usize].computed;
        let m = &mut self.pool.meta[dst as usize];
        m.filled = fill as u16;
        m.computed = computed;
        m.writer = id.index;
        self.push_copy(alloc, last, dst, fill);
        if self.seq(id)?.win_from <= i {
            self.win_unref(last);
        }
        let remaining = self.pool.decref(last);
        debug_assert!(remaining > 0, "copy-on-write of an unshared block");
        let shared = &mut self.pool.meta[last as usize];
        if shared.writer == id.index {
            shared.writer = NO_WRITER;
        }
        let seq = self.seq_mut(id)?;
        seq.table[i] = dst;
        alloc.num_new_blocks += 1;
        self.apply_retention(id, i, dst)
    }

    pub(super) fn append_tokens(
        &mut self,
        id: SeqId,
        mut tokens: &[u32],
        alloc: &mut Allocation,
    ) -> Result<(), KvError> {
        let bs = self.config.block_size;
        let retained = !self.seq(id)?.retention.is_empty();
        while !tokens.is_empty() {
            let seq = self.seq(id)?;
            let fill = seq.num_tokens % bs;
            let block_index = seq.num_tokens / bs;
            let b = if fill == 0 {
                let b = self.take_block();
                self.new_block_window(b, block_index, false);
                self.seq_mut(id)?.table.push(b);
                alloc.num_new_blocks += 1;
                self.stats.block_ops += 1;
                if retained {
                    self.apply_retention(id, block_index, b)?;
                }
                b
            } else {
                seq.table[block_index]
            };
            let n = tokens.len().min(bs - fill);
            self.pool.slots_mut(b)[fill..fill + n].copy_from_slice(&tokens[..n]);
            let m = &mut self.pool.meta[b as usize];
            m.filled = (fill + n) as u16;
            m.writer = id.index;
            tokens = &tokens[n..];
            let seq = self.seq_mut(id)?;
            seq.num_tokens += n;
            if fill + n == bs && seq.draft_from.is_none() {
                self.index_full_block(id, block_index)?;
            }
        }
        Ok(())
    }

    /// Enters the sequence's newly full block `i` in the index (pending until computed).
    pub(super) fn index_full_block(&mut self, id: SeqId, i: usize) -> Result<(), KvError> {
        let seq = self.seq(id)?;
        if !seq.cacheable || !seq.chain_indexed {
            self.seq_mut(id)?.chain_indexed = false;
            return Ok(());
        }
        let b = seq.table[i];
        let parent = if i == 0 { NO_BLOCK } else { seq.table[i - 1] };
        let (parent_hash, key_id) = (seq.last_hash, seq.key_id);
        let hash = self.hasher.chain(parent_hash, self.pool.tokens_of(b));
        let mut outcome = self
            .index
            .insert(&mut self.pool, b, hash, parent_hash, parent, key_id);
        if let Insert::Occupied(other) = outcome {
            // An unreachable orphan (plain LRU) with the same identity is garbage: replace it.
            let o = &self.pool.meta[other as usize];
            if o.parent == ORPHAN && o.is_idle() && o.parent_hash == parent_hash {
                self.drop_cached(other);
                self.free_to_pool(other);
                outcome = self
                    .index
                    .insert(&mut self.pool, b, hash, parent_hash, parent, key_id);
            }
        }
        let seq = self.seq_mut(id)?;
        match outcome {
            Insert::Inserted => {
                seq.last_hash = hash;
                self.stats.blocks_indexed += 1;
                if usize::from(self.pool.meta[b as usize].computed) == self.config.block_size {
                    self.announce(b);
                }
            }
            Insert::Occupied(_) => {
                seq.chain_indexed = false;
                self.stats.index_conflicts += 1;
            }
        }
        Ok(())
    }
}
