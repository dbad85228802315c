//! Draft tokens (speculative decoding): tokens appended to a sequence on trial, whose KV a step computes
//! beside the sequence's next token, and of which the sampler then keeps a leading part.
//!
//! A draft's slots are taken as any others ([`KvCacheManager::allocate_slots`]), but the blocks it fills
//! are not entered in the index, so that no other sequence finds or attaches them while their tokens
//! may still be taken back. [`KvCacheManager::settle_draft`] cuts the sequence back to the tokens kept
//! (the blocks past them go back to the free list, the last one kept is cut to its kept slots) and
//! enters the blocks the kept tokens filled, in order, as appending them would have. A sequence with a
//! draft is not forked; freed, it releases the draft's blocks with its others.
//!
//! O(blocks of the draft).

use super::{Allocation, KvCacheManager, SeqId};
use crate::error::KvError;

impl KvCacheManager {
    /// Appends `draft` to the sequence on trial: [`Self::allocate_slots`] without a hit, the blocks it
    /// fills kept out of the index until [`Self::settle_draft`]. `Ok(None)`, changing nothing, when the
    /// pool cannot supply the blocks. Refused for a hybrid pool (its sliding layers' pages would follow
    /// every block taken back) and while a draft is unsettled.
    pub fn allocate_draft_slots(
        &mut self,
        id: SeqId,
        draft: &[u32],
    ) -> Result<Option<Allocation>, KvError> {
        if self.pages.is_some() {
            return Err(KvError::Draft {
                seq: id,
                why: "a draft in a hybrid pool",
            });
        }
        let seq = self.seq_mut(id)?;
        if seq.draft_from.is_some() {
            return Err(KvError::Draft {
                seq: id,
                why: "a second draft before the first is settled",
            });
        }
        seq.draft_from = Some(seq.num_tokens);
        let alloc = self.allocate_slots(id, draft, None);
        if !matches!(alloc, Ok(Some(_))) {
            self.seq_mut(id)?.draft_from = None;
        }
        alloc
    }

    /// Keeps the first `keep` tokens of a sequence holding a draft (at least those before the draft, at
    /// most all of them) and ends the draft: the slots past `keep` are given back, and the blocks the
    /// kept tokens filled are entered in the index (announced where computed). A sequence without a
    /// draft is left as it is.
    pub fn settle_draft(&mut self, id: SeqId, keep: usize) -> Result<(), KvError> {
        let bs = self.config.block_size;
        let seq = self.seq(id)?;
        let Some(from) = seq.draft_from else {
            return Ok(());
        };
        if keep < from || keep > seq.num_tokens {
            return Err(KvError::DraftKeep {
                seq: id,
                keep,
                from,
                num_tokens: seq.num_tokens,
            });
        }
        self.clock.tick += 1;
        let kept_blocks = keep.div_ceil(bs);
        // Tail first, as a sequence is freed; none of these blocks is indexed, and none shared (a draft
        // writes only blocks its sequence took or copied for itself).
        while self.seq(id)?.table.len() > kept_blocks {
            let b = self
                .seq_mut(id)?
                .table
                .pop()
                .expect("the table is longer than the kept blocks");
            self.release_block(b, id.index);
            self.stats.block_ops += 1;
        }
        if keep % bs != 0 {
            let last = self.seq(id)?.table[kept_blocks - 1];
            let m = &mut self.pool.meta[last as usize];
            m.filled = m.filled.min((keep % bs) as u16);
            m.computed = m.computed.min(m.filled);
        }
        let seq = self.seq_mut(id)?;
        seq.num_tokens = keep;
        seq.num_computed = seq.num_computed.min(keep);
        seq.draft_from = None;
        // The blocks that filled from the draft's start on, in order, as appending would have entered them.
        for i in from / bs..keep / bs {
            self.index_full_block(id, i)?;
        }
        Ok(())
    }

    /// [`Self::settle_draft`], keeping the tokens of the draft that `tokens` (the sequence's tokens as
    /// its owner now has them, from the start) holds in the same places: the draft's leading tokens
    /// that the sampler drew as proposed. Returns the tokens kept.
    pub fn settle_draft_as(&mut self, id: SeqId, tokens: &[u32]) -> Result<usize, KvError> {
        let bs = self.config.block_size;
        let seq = self.seq(id)?;
        let Some(from) = seq.draft_from else {
            return Ok(seq.num_tokens);
        };
        let mut keep = from;
        while keep < seq.num_tokens
            && tokens.get(keep) == Some(&self.pool.tokens_of(seq.table[keep / bs])[keep % bs])
        {
            keep += 1;
        }
        self.settle_draft(id, keep)?;
        Ok(keep)
    }

    /// Where the sequence's unsettled draft starts, if it holds one.
    pub fn draft_from(&self, id: SeqId) -> Result<Option<usize>, KvError> {
        Ok(self.seq(id)?.draft_from)
    }
}
