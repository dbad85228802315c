//! The bookkeeping of ordered host-tier loads, apart from the device's events (so that it is tested
//! without a GPU): the loads queued and not issued, the issues in flight (numbered, oldest first, as the
//! load stream runs them), and for each block of an issue the device stream has not waited for, the
//! newest issue that writes it.
//!
//! The load stream runs issues in order: waiting for issue *k*'s layer *i* is waiting for every
//! earlier issue whole. So a step waits for the newest issue that writes one of its blocks, and once the
//! device waits for issue *k*, every block of issues up to *k* is ordered.

use std::collections::{HashMap, VecDeque};

/// How many consecutive layers of a block one copy of ordered loads takes: the fewest whose bytes
/// reach `min_bytes`, at least one and at most `layers` (each copy of a batch has a cost of its own,
/// [`crate::executor::LOAD_COPY_MIN_BYTES`]). A step waits for layer *i* through its group's copies:
/// larger groups overlap less of the loads with the step.
pub(super) fn layers_per_copy(layer_bytes: usize, layers: usize, min_bytes: usize) -> usize {
    let layers = layers.max(1);
    if layer_bytes == 0 {
        return layers;
    }
    min_bytes.div_ceil(layer_bytes).clamp(1, layers)
}

#[derive(Debug)]
pub(super) struct LoadOrder {
    /// Loads started and not issued, in order: (block, its slot's host address).
    queued: Vec<(u32, u64)>,
    /// Issues in flight, oldest first: (number, blocks).
    issues: VecDeque<(u64, Vec<u32>)>,
    /// The number the next issue gets (from 1).
    next_seq: u64,
    /// Blocks of issues the device stream does not wait for yet, with the newest issue writing each.
    unordered: HashMap<u32, u64>,
}

impl Default for LoadOrder {
    fn default() -> Self {
        LoadOrder {
            queued: Vec::new(),
            issues: VecDeque::new(),
            next_seq: 1,
            unordered: HashMap::new(),
        }
    }
}

impl LoadOrder {
    /// Queues a load of `block` from host address `host`. A block already queued must be issued first
    /// ([`LoadOrder::is_queued`]): the copies of one issue run in no fixed order among themselves.
    pub fn queue(&mut self, block: u32, host: u64) {
        debug_assert!(!self.is_queued(block), "block {block} is queued already");
        self.queued.push((block, host));
    }

    /// Whether any load is queued and not issued.
    pub fn has_queued(&self) -> bool {
        !self.queued.is_empty()
    }

    /// Whether a load into `block` is queued and not issued.
    pub fn is_queued(&self, block: u32) -> bool {
        self.queued.iter().any(|q| q.0 == block)
    }

    /// The host address a queued load into `block` reads, if one is queued.
    pub fn queued_host(&self, block: u32) -> Option<u64> {
        self.queued.iter().rev().find(|q| q.0 == block).map(|q| q.1)
    }

    /// Takes the queued loads as the next issue: its number and the loads in order; `None` when none is
    /// queued. Its blocks are unordered until the device waits for it or it lands.
    pub fn issue(&mut self) -> Option<(u64, Vec<(u32, u64)>)> {
        if self.queued.is_empty() {
            return None;
        }
        let loads = std::mem::take(&mut self.queued);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.unordered.extend(loads.iter().map(|q| (q.0, seq)));
        self.issues
            .push_back((seq, loads.iter().map(|q| q.0).collect()));
        Some((seq, loads))
    }

    /// The newest issue the device stream has not waited for that writes one of `blocks`.
    pub fn newest_writing(&self, blocks: impl IntoIterator<Item = u32>) -> Option<u64> {
        if self.unordered.is_empty() {
            return None;
        }
        blocks
            .into_iter()
            .filter_map(|b| self.unordered.get(&b).copied())
            .max()
    }

    /// Notes that the device stream waits for issue `seq`, and so for every issue before it.
    pub fn waited_for(&mut self, seq: u64) {
        self.unordered.retain(|_, s| *s > seq);
    }

    /// The oldest issue in flight (the next to land).
    pub fn oldest(&self) -> Option<u64> {
        self.issues.front().map(|i| i.0)
    }

    /// The oldest issue has landed: returns its blocks. From now on the device does nothing before them,
    /// but a block a newer issue writes again stays unordered until that one lands or is waited for.
    pub fn landed(&mut self) -> Option<Vec<u32>> {
        let (seq, blocks) = self.issues.pop_front()?;
        for b in &blocks {
            if self.unordered.get(b) == Some(&seq) {
                self.unordered.remove(b);
            }
        }
        Some(blocks)
    }

    /// Whether issue `seq` is in flight.
    pub fn in_flight(&self, seq: u64) -> bool {
        self.issues.iter().any(|i| i.0 == seq)
    }

    /// Whether no issue is in flight.
    pub fn is_idle(&self) -> bool {
        self.issues.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_takes_the_fewest_layers_that_reach_the_minimum() {
        // fp8 KV of a 16-token block in Llama-3.1-8B's shape: about 33 KB a layer, 32 layers.
        assert_eq!(layers_per_copy(33_280, 32, 128 << 10), 4);
        // bf16: 65,536 bytes a layer: two.
        assert_eq!(layers_per_copy(65_536, 32, 128 << 10), 2);
        assert_eq!(layers_per_copy(1 << 20, 32, 128 << 10), 1);
        // No minimum: a layer a copy; a minimum past the block: the whole block in one.
        assert_eq!(layers_per_copy(12_288, 30, 0), 1);
        assert_eq!(layers_per_copy(12_288, 30, 1 << 30), 30);
        assert_eq!(layers_per_copy(0, 30, 128 << 10), 30);
        assert_eq!(layers_per_copy(4096, 0, 128 << 10), 1);
    }

    #[test]
    fn a_step_waits_for_the_newest_issue_that_writes_one_of_its_blocks() {
        let mut o = LoadOrder::default();
        assert_eq!(o.issue(), None, "nothing queued, nothing issued");
        assert!(!o.has_queued());
        o.queue(4, 0x1000);
        o.queue(5, 0x2000);
        assert!(o.has_queued());
        assert_eq!(o.queued_host(5), Some(0x2000));
        assert_eq!(o.issue(), Some((1, vec![(4, 0x1000), (5, 0x2000)])));
        assert!(!o.has_queued());
        assert_eq!(o.queued_host(5), None);
        o.queue(9, 0x3000);
        let (two, _) = o.issue().unwrap();
        assert_eq!(two, 2);
        // Blocks no issue writes: no wait.
        assert_eq!(o.newest_writing([1, 2, 3]), None);
        assert_eq!(o.newest_writing([4]), Some(1));
        // Issue 2 follows issue 1 on the stream: waiting for it covers both.
        assert_eq!(o.newest_writing([4, 9]), Some(2));
        o.waited_for(2);
        assert_eq!(o.newest_writing([4, 5, 9]), None);
        // Still in flight (for their reports), though ordered.
        assert_eq!(o.oldest(), Some(1));
        assert_eq!(o.landed(), Some(vec![4, 5]));
        assert_eq!(o.landed(), Some(vec![9]));
        assert!(o.is_idle());
        assert_eq!(o.landed(), None);
    }

    #[test]
    fn waiting_for_an_older_issue_leaves_the_newer_ones_unordered() {
        let mut o = LoadOrder::default();
        o.queue(1, 0);
        o.issue();
        o.queue(2, 0);
        o.issue();
        o.waited_for(1);
        assert_eq!(o.newest_writing([1]), None);
        assert_eq!(o.newest_writing([1, 2]), Some(2));
    }

    #[test]
    fn a_block_loaded_again_stays_unordered_until_its_newest_load_lands() {
        let mut o = LoadOrder::default();
        o.queue(7, 0x10);
        o.issue();
        // Evicted, reused and loaded again before the first load landed.
        assert!(!o.is_queued(7));
        o.queue(7, 0x20);
        assert!(o.is_queued(7));
        o.issue();
        assert_eq!(o.newest_writing([7]), Some(2));
        // The first load lands: the second still writes the block.
        assert_eq!(o.landed(), Some(vec![7]));
        assert_eq!(o.newest_writing([7]), Some(2));
        assert!(o.in_flight(2) && !o.in_flight(1));
        assert_eq!(o.landed(), Some(vec![7]));
        assert_eq!(o.newest_writing([7]), None);
    }

    #[test]
    fn every_unordered_issue_is_in_flight() {
        // What the executor's event lookups rely on: an issue a step may be told to wait for has not
        // been reported (its events are still held).
        let mut o = LoadOrder::default();
        for round in 0..50u32 {
            o.queue(round % 7, u64::from(round));
            if round % 3 == 0 {
                o.issue();
            }
            if round % 5 == 0 {
                o.landed();
            }
            if round % 11 == 0 {
                if let Some(seq) = o.newest_writing(0..7) {
                    o.waited_for(seq);
                }
            }
            if o.is_queued((round + 1) % 7) {
                o.issue();
            }
            if let Some(seq) = o.newest_writing(0..7) {
                assert!(
                    o.in_flight(seq),
                    "round {round}: issue {seq} is waited for yet reported"
                );
            }
        }
    }
}
