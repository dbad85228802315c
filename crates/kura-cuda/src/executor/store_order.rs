//! The bookkeeping of host-tier stores (device → host copies on the transfer stream), apart from the
//! device's events (so that it is tested without a GPU): the stores that device work may still have to
//! wait for, numbered in the order the transfer stream runs them, each with the block it reads and its
//! event (`E`).
//!
//! Work on the device stream that writes a block (a step's new K/V, a block copy, a synchronous import)
//! must not overtake a store still reading it; work that writes other blocks need not wait. The stream
//! runs its copies in order, so waiting for store *k* is waiting for every store before it: a writer
//! waits for the newest store that reads one of its blocks, and from then on no store up to *k* needs a
//! wait. A store the host has seen land needs none either.
//!
//! A block is stored when the pool evicts it (and then handed to the owner that needed it), when a
//! sequence is swapped out (its blocks stay cached until evicted, tail first: the engine stores them in
//! that order, so the first block reused waits for one copy, not the whole sequence's), and on
//! write-through (a cached block that stays where it is): only the first kind is rewritten at once.

use std::collections::{HashMap, VecDeque};

#[derive(Debug)]
pub(super) struct StoreOrder<E> {
    /// Stores neither waited for by the device stream nor seen landed by the host, oldest first:
    /// (number, block, event after the copy).
    pending: VecDeque<(u64, u32, E)>,
    /// The number the next store gets (from 1).
    next_seq: u64,
    /// For each block of `pending`, the newest store reading it.
    newest: HashMap<u32, u64>,
}

impl<E> Default for StoreOrder<E> {
    fn default() -> Self {
        StoreOrder {
            pending: VecDeque::new(),
            next_seq: 1,
            newest: HashMap::new(),
        }
    }
}

impl<E> StoreOrder<E> {
    /// A store of `block` was issued on the transfer stream, with `event` recorded after it: returns
    /// its number.
    pub fn started(&mut self, block: u32, event: E) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.pending.push_back((seq, block, event));
        self.newest.insert(block, seq);
        seq
    }

    /// The newest pending store that reads one of `blocks` (what work writing them waits for).
    pub fn newest_reading(&self, blocks: impl IntoIterator<Item = u32>) -> Option<u64> {
        if self.pending.is_empty() {
            return None;
        }
        blocks
            .into_iter()
            .filter_map(|b| self.newest.get(&b).copied())
            .max()
    }

    /// The event of pending store `seq`.
    pub fn event(&self, seq: u64) -> Option<&E> {
        let first = self.pending.front()?.0;
        let at = usize::try_from(seq.checked_sub(first)?).ok()?;
        self.pending.get(at).map(|p| &p.2)
    }

    /// The newest pending store's number and event (what the host waits on to see every store land).
    pub fn newest(&self) -> Option<(u64, &E)> {
        self.pending.back().map(|p| (p.0, &p.2))
    }

    /// The oldest pending store's event.
    pub fn oldest(&self) -> Option<&E> {
        self.pending.front().map(|p| &p.2)
    }

    /// Store `seq`, and so every store before it, needs no wait any more: the device stream waits for
    /// it, or the host saw it land. Their events are dropped.
    pub fn ordered_through(&mut self, seq: u64) {
        while self.pending.front().is_some_and(|p| p.0 <= seq) {
            let (s, block, _) = self.pending.pop_front().expect("looked at");
            if self.newest.get(&block) == Some(&s) {
                self.newest.remove(&block);
            }
        }
    }

    /// Stores pending.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// The oldest pending store's number.
    pub fn oldest_seq(&self) -> Option<u64> {
        self.pending.front().map(|p| p.0)
    }
}

/// The blocks a step writes: for each sequence, those holding its new tokens' positions
/// (`start_pos .. start_pos + tokens`, `block_size` slots a block), as its table names them.
pub(super) fn blocks_written<'a>(
    seqs: impl IntoIterator<Item = (usize, usize, &'a [u32])> + 'a,
    block_size: usize,
) -> impl Iterator<Item = u32> + 'a {
    seqs.into_iter().flat_map(move |(start, tokens, table)| {
        let first = start / block_size;
        let end = if tokens == 0 {
            first
        } else {
            (start + tokens).div_ceil(block_size)
        };
        table[first.min(table.len())..end.min(table.len())]
            .iter()
            .copied()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_writer_waits_for_the_newest_store_of_its_blocks_and_no_other() {
        let mut o = StoreOrder::default();
        assert_eq!(o.newest_reading([1, 2]), None, "nothing stored");
        assert_eq!(o.started(4, 'a'), 1);
        assert_eq!(o.started(5, 'b'), 2);
        assert_eq!(o.started(6, 'c'), 3);
        // Blocks no store reads: no wait.
        assert_eq!(o.newest_reading([1, 2, 3]), None);
        assert_eq!(o.newest_reading([4]), Some(1));
        // Store 2 follows store 1 on the stream: waiting for it covers both.
        assert_eq!(o.newest_reading([4, 5]), Some(2));
        assert_eq!(o.event(2), Some(&'b'));
        assert_eq!(o.newest(), Some((3, &'c')));
        o.ordered_through(2);
        assert_eq!(o.newest_reading([4, 5]), None);
        assert_eq!(o.event(1), None, "dropped");
        assert_eq!(o.newest_reading([4, 5, 6]), Some(3));
        assert_eq!(
            (o.len(), o.oldest_seq(), o.oldest()),
            (1, Some(3), Some(&'c'))
        );
        o.ordered_through(3);
        assert_eq!(o.newest_reading([6]), None);
        assert_eq!(o.newest(), None);
        assert_eq!(o.len(), 0);
    }

    #[test]
    fn a_block_stored_twice_waits_for_its_newer_store() {
        let mut o = StoreOrder::default();
        o.started(7, ());
        o.started(8, ());
        o.started(7, ());
        assert_eq!(o.newest_reading([7]), Some(3));
        // The first store of 7 is ordered: its newer one still reads the block.
        o.ordered_through(1);
        assert_eq!(o.newest_reading([7]), Some(3));
        assert_eq!(o.newest_reading([8]), Some(2));
        o.ordered_through(3);
        assert_eq!(o.newest_reading([7, 8]), None);
    }

    #[test]
    fn every_store_a_writer_is_told_to_wait_for_has_its_event() {
        let mut o = StoreOrder::default();
        for round in 0..200u32 {
            let seq = o.started(round % 13, round);
            assert_eq!(o.event(seq), Some(&round));
            if round % 7 == 0 {
                if let Some(s) = o.newest_reading([round % 5, round % 11]) {
                    assert!(o.event(s).is_some(), "round {round}: store {s}");
                    o.ordered_through(s);
                }
            }
            if round % 17 == 0 {
                if let Some(s) = o.oldest_seq() {
                    o.ordered_through(s);
                }
            }
            if let Some(s) = o.newest_reading(0..13) {
                assert!(o.event(s).is_some(), "round {round}: store {s}");
            }
        }
    }

    #[test]
    fn a_step_writes_the_blocks_of_its_new_positions() {
        let t = [10u32, 11, 12, 13];
        let table: &[u32] = &t;
        // 16 slots a block: a decode token at position 31 writes block 1; at 32, block 2.
        let w = |s: usize, n: usize| blocks_written([(s, n, table)], 16).collect::<Vec<_>>();
        assert_eq!(w(31, 1), [11]);
        assert_eq!(w(32, 1), [12]);
        // A prompt of 40 tokens after 8 cached: positions 8..48, blocks 0..3.
        assert_eq!(w(8, 40), [10, 11, 12]);
        assert_eq!(w(0, 64), [10, 11, 12, 13]);
        assert_eq!(w(5, 0), Vec::<u32>::new());
        // Several sequences.
        let other: &[u32] = &[20, 21];
        let both: Vec<u32> = blocks_written([(15, 2, table), (0, 3, other)], 16).collect();
        assert_eq!(both, [10, 11, 20]);
    }
}
