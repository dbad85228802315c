//! The bookkeeping of host-tier stores (device → host copies on the store stream), apart from the
//! device's events (so that it is tested without a GPU): the stores that device work may still have to
//! wait for, numbered in the order the store stream runs them, each with the block it reads and its
//! event (`E`).
//!
//! Work on the device stream that writes a block (a step's new K/V, a block copy, a synchronous import)
//! must not overtake a store still reading it; work that writes other blocks need not wait. The stream
//! runs its copies in order, so waiting for store *k* is waiting for every store before it: a writer
//! waits for the newest store that reads one of its blocks, and from then on no device work waits for a
//! store up to *k*. The host is another matter: a wait on the device orders the device's later work, not
//! the host's reads, so before reading a stored slot the host waits for every store it has not seen
//! land itself, whether the device waited for them or not.
//!
//! A block is stored when the pool evicts it (and then handed to the owner that needed it), when a
//! sequence is swapped out (its blocks stay cached until evicted, tail first: the engine stores them in
//! that order, so the first block reused waits for one copy, not the whole sequence's), and on
//! write-through (a cached block that stays where it is): only the first kind is rewritten at once.

use std::collections::{HashMap, HashSet, VecDeque};

#[derive(Debug)]
pub(super) struct StoreOrder<E> {
    /// Stores the host has not seen land, oldest first: (number, block, the host address it copies
    /// to, event after the copy). A store the device stream has waited for stays here until then: the
    /// device's wait orders its own later work, not the host's reads.
    pending: VecDeque<(u64, u32, u64, E)>,
    /// The number the next store gets (from 1).
    next_seq: u64,
    /// Every store up to this number is ordered before the device stream's later work.
    device_through: u64,
    /// For each block of `pending`, the newest store reading it.
    newest: HashMap<u32, u64>,
}

impl<E> Default for StoreOrder<E> {
    fn default() -> Self {
        StoreOrder {
            pending: VecDeque::new(),
            next_seq: 1,
            device_through: 0,
            newest: HashMap::new(),
        }
    }
}

impl<E> StoreOrder<E> {
    /// A store of `block` into host address `host` was issued on the store stream, with `event`
    /// recorded after it: returns its number.
    pub fn started(&mut self, block: u32, host: u64, event: E) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.pending.push_back((seq, block, host, event));
        self.newest.insert(block, seq);
        seq
    }

    /// The newest store into host address `host` the host has not seen land (what a read of that
    /// slot waits for; the stores before it land first).
    pub fn newest_into(&self, host: u64) -> Option<u64> {
        self.pending.iter().rev().find(|p| p.2 == host).map(|p| p.0)
    }

    /// The newest store into any of host addresses `hosts` the host has not seen land (what a load of
    /// those slots waits for), in one pass over the pending stores whatever the number of slots.
    pub fn newest_into_any(&self, hosts: &[u64]) -> Option<u64> {
        let hosts: HashSet<u64> = hosts.iter().copied().collect();
        self.pending
            .iter()
            .rev()
            .find(|p| hosts.contains(&p.2))
            .map(|p| p.0)
    }

    /// The newest store not yet ordered before the device stream that reads one of `blocks` (what
    /// device work writing them waits for).
    pub fn newest_reading(&self, blocks: impl IntoIterator<Item = u32>) -> Option<u64> {
        if self.unordered() == 0 {
            return None;
        }
        blocks
            .into_iter()
            .filter_map(|b| self.newest.get(&b).copied())
            .filter(|s| *s > self.device_through)
            .max()
    }

    /// The event of store `seq`, while the host has not seen it land.
    pub fn event(&self, seq: u64) -> Option<&E> {
        let first = self.pending.front()?.0;
        let at = usize::try_from(seq.checked_sub(first)?).ok()?;
        self.pending.get(at).map(|p| &p.3)
    }

    /// The newest store the host has not seen land, and its event (what the host waits on to see every
    /// store land).
    pub fn newest(&self) -> Option<(u64, &E)> {
        self.pending.back().map(|p| (p.0, &p.3))
    }

    /// The oldest store the host has not seen land, and its event.
    pub fn oldest(&self) -> Option<(u64, &E)> {
        self.pending.front().map(|p| (p.0, &p.3))
    }

    /// The device stream waits for store `seq`, and so for every store before it: device work issued
    /// after this needs no wait for them.
    pub fn device_waited(&mut self, seq: u64) {
        self.device_through = self.device_through.max(seq);
    }

    /// The host saw store `seq` land, and so every store before it: neither the host nor the device
    /// waits for them again. Their events are dropped.
    pub fn landed_through(&mut self, seq: u64) {
        self.device_through = self.device_through.max(seq);
        while self.pending.front().is_some_and(|p| p.0 <= seq) {
            let (s, block, _, _) = self.pending.pop_front().expect("looked at");
            if self.newest.get(&block) == Some(&s) {
                self.newest.remove(&block);
            }
        }
    }

    /// Stores the host has not seen land.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// Stores the device stream has not waited for and the host has not seen land.
    pub fn unordered(&self) -> usize {
        self.pending.len() - self.pending.partition_point(|p| p.0 <= self.device_through)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A made-up host slot address for block `b`.
    fn host(b: u32) -> u64 {
        0x1000 * u64::from(b)
    }

    #[test]
    fn a_read_of_a_slot_waits_for_the_newest_store_into_it() {
        let mut o = StoreOrder::default();
        o.started(1, 0xa000, ());
        o.started(2, 0xb000, ());
        o.started(3, 0xa000, ());
        assert_eq!(o.newest_into(0xa000), Some(3));
        assert_eq!(o.newest_into(0xb000), Some(2));
        assert_eq!(o.newest_into(0xc000), None);
        assert_eq!(o.newest_into_any(&[0xb000, 0xc000]), Some(2));
        assert_eq!(o.newest_into_any(&[0xb000, 0xa000]), Some(3));
        assert_eq!(o.newest_into_any(&[0xc000]), None);
        o.landed_through(2);
        assert_eq!(o.newest_into(0xb000), None);
        assert_eq!(o.newest_into(0xa000), Some(3));
    }

    #[test]
    fn a_writer_waits_for_the_newest_store_of_its_blocks_and_no_other() {
        let mut o = StoreOrder::default();
        assert_eq!(o.newest_reading([1, 2]), None, "nothing stored");
        assert_eq!(o.started(4, host(4), 'a'), 1);
        assert_eq!(o.started(5, host(5), 'b'), 2);
        assert_eq!(o.started(6, host(6), 'c'), 3);
        // Blocks no store reads: no wait.
        assert_eq!(o.newest_reading([1, 2, 3]), None);
        assert_eq!(o.newest_reading([4]), Some(1));
        // Store 2 follows store 1 on the stream: waiting for it covers both.
        assert_eq!(o.newest_reading([4, 5]), Some(2));
        assert_eq!(o.event(2), Some(&'b'));
        o.device_waited(2);
        assert_eq!(o.newest_reading([4, 5]), None);
        assert_eq!(o.newest_reading([4, 5, 6]), Some(3));
        assert_eq!(o.unordered(), 1);
        // The host has not seen any land: it still waits for the newest, whose wait covers all.
        assert_eq!((o.len(), o.newest()), (3, Some((3, &'c'))));
        assert_eq!(o.oldest(), Some((1, &'a')));
        // An older wait than one already made changes nothing.
        o.device_waited(1);
        assert_eq!(o.unordered(), 1);
        o.landed_through(1);
        assert_eq!((o.len(), o.oldest()), (2, Some((2, &'b'))));
        assert_eq!(o.event(1), None, "dropped");
        assert_eq!(o.newest_reading([6]), Some(3));
        o.landed_through(3);
        assert_eq!(o.newest_reading([4, 5, 6]), None);
        assert_eq!((o.len(), o.unordered(), o.newest()), (0, 0, None));
    }

    #[test]
    fn a_store_the_device_waited_for_is_still_waited_for_by_the_host() {
        // The device's wait orders its own later work: the host, before it reads a stored slot, must
        // see the copy land itself.
        let mut o = StoreOrder::default();
        o.started(1, host(1), ());
        o.started(2, host(2), ());
        o.device_waited(2);
        assert_eq!(o.unordered(), 0);
        assert_eq!(o.newest_reading([1, 2]), None);
        assert_eq!(o.newest().map(|n| n.0), Some(2));
        o.landed_through(2);
        assert_eq!(o.newest(), None);
    }

    #[test]
    fn a_block_stored_twice_waits_for_its_newer_store() {
        let mut o = StoreOrder::default();
        o.started(7, host(7), ());
        o.started(8, host(8), ());
        o.started(7, host(7), ());
        assert_eq!(o.newest_reading([7]), Some(3));
        // The first store of 7 landed: its newer one still reads the block.
        o.landed_through(1);
        assert_eq!(o.newest_reading([7]), Some(3));
        assert_eq!(o.newest_reading([8]), Some(2));
        o.device_waited(3);
        assert_eq!(o.newest_reading([7, 8]), None);
        o.landed_through(3);
        assert_eq!(o.len(), 0);
    }

    #[test]
    fn every_store_a_writer_is_told_to_wait_for_has_its_event() {
        let mut o = StoreOrder::default();
        for round in 0..200u32 {
            let seq = o.started(round % 13, host(round % 13), round);
            assert_eq!(o.event(seq), Some(&round));
            if round % 7 == 0 {
                if let Some(s) = o.newest_reading([round % 5, round % 11]) {
                    assert!(o.event(s).is_some(), "round {round}: store {s}");
                    o.device_waited(s);
                }
            }
            if round % 17 == 0 {
                if let Some((s, _)) = o.oldest() {
                    o.landed_through(s);
                }
            }
            if let Some(s) = o.newest_reading(0..13) {
                assert!(o.event(s).is_some(), "round {round}: store {s}");
            }
            assert!(o.unordered() <= o.len());
        }
    }
}
