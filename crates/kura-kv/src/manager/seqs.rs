//! The live sequences: each in a slot whose generation changes when the sequence is freed, so that a
//! stale [`SeqId`] is an error rather than another sequence; and the block tables of freed sequences,
//! kept for reuse.
//!
//! Every operation is O(1), but for [`Sequences::iter`].

use super::{RetentionRange, SeqId};
use crate::error::KvError;
use crate::hash::BlockHash;
use crate::pool::BlockId;

/// A sequence known to the manager.
#[derive(Debug)]
pub(super) struct Sequence {
    pub key_id: u32,
    pub table: Vec<BlockId>,
    pub num_tokens: usize,
    /// Prefix of the tokens known to have KV (a lower bound; `pending_status` advances it).
    pub num_computed: usize,
    /// Hash of the last full block of `table` (the key hash before the first).
    pub last_hash: BlockHash,
    /// Every full block so far is indexed, so the next full one may be.
    pub chain_indexed: bool,
    /// New full blocks of this sequence are entered in the index.
    pub cacheable: bool,
    pub retention: Vec<RetentionRange>,
    /// First block of `table` this sequence holds a window reference on (hybrid pool; see the `window`
    /// module).
    pub win_from: usize,
    /// Where a draft's tokens start ([`super::KvCacheManager::allocate_draft_slots`]): the blocks that
    /// fill from here on are not entered in the index until the draft is settled.
    pub draft_from: Option<usize>,
}

#[derive(Debug, Default)]
struct SeqSlot {
    generation: u32,
    seq: Option<Sequence>,
}

/// The sequences, by [`SeqId`].
#[derive(Debug, Default)]
pub(super) struct Sequences {
    slots: Vec<SeqSlot>,
    /// Slots without a sequence, reused last freed first.
    free_slots: Vec<u32>,
    /// Empty block tables of freed sequences, for new ones.
    spare_tables: Vec<Vec<BlockId>>,
}

impl Sequences {
    /// An empty block table for a new sequence (a freed sequence's, when one is kept).
    pub fn spare_table(&mut self) -> Vec<BlockId> {
        self.spare_tables.pop().unwrap_or_default()
    }

    /// Enters `seq` in a free slot, or a new one.
    pub fn insert(&mut self, seq: Sequence) -> SeqId {
        let index = match self.free_slots.pop() {
            Some(i) => i,
            None => {
                self.slots.push(SeqSlot::default());
                (self.slots.len() - 1) as u32
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.seq = Some(seq);
        SeqId {
            index,
            generation: slot.generation,
        }
    }

    pub fn get(&self, id: SeqId) -> Result<&Sequence, KvError> {
        self.slots
            .get(id.index as usize)
            .filter(|s| s.generation == id.generation)
            .and_then(|s| s.seq.as_ref())
            .ok_or(KvError::UnknownSequence(id))
    }

    pub fn get_mut(&mut self, id: SeqId) -> Result<&mut Sequence, KvError> {
        self.slots
            .get_mut(id.index as usize)
            .filter(|s| s.generation == id.generation)
            .and_then(|s| s.seq.as_mut())
            .ok_or(KvError::UnknownSequence(id))
    }

    /// Takes the sequence out; its slot's generation changes, so that `id` is unknown from now on.
    pub fn remove(&mut self, id: SeqId) -> Result<Sequence, KvError> {
        self.get(id)?;
        let slot = &mut self.slots[id.index as usize];
        let seq = slot.seq.take().expect("checked above");
        slot.generation = slot.generation.wrapping_add(1);
        self.free_slots.push(id.index);
        Ok(seq)
    }

    /// Keeps a removed sequence's block table (emptied) for a later sequence.
    pub fn recycle(&mut self, mut table: Vec<BlockId>) {
        table.clear();
        self.spare_tables.push(table);
    }

    /// The live sequences with their slot index (a block's writer).
    pub fn iter(&self) -> impl Iterator<Item = (u32, &Sequence)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i as u32, s.seq.as_ref()?)))
    }
}
