//! Which replica holds which blocks, built from the replicas' KV events (a snapshot, then numbered
//! changes), and how many leading blocks of a prompt each one holds.
//!
//! Replicas announce blocks by keyed content names ([`ContentNamer`] with the fleet's secret): a
//! root block is named by its cache key, every other block by a MAC of its parent's name and its tokens.
//! The router names a request's blocks the same way from its tokens and its cache key (salt and model
//! fingerprint, as the replica builds it), so equal names mean equal prefixes under equal keys, and the
//! index is a set of names per replica. Deterministic and synchronous: the event followers feed it, the
//! request path reads it.

use std::collections::{HashMap, HashSet};

use kura_kv::CacheKey;

use crate::naming::ContentNamer;

/// How long a block routed to a replica counts as held there without an event saying so.
pub const ROUTED_TTL_MS: u64 = 10_000;
/// Most routed names kept per replica before expired ones are dropped.
const MAX_ROUTED: usize = 1 << 20;
/// Most blocks a replica is known to hold (8 Mi names, about 270 MB of index): past it, what a
/// replica reports storing is not recorded (a routing hint lost), so a replica that reports without
/// end cannot grow the router's memory without end.
pub const MAX_HELD: usize = 1 << 23;

/// A change in a replica's pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Stored { name: u128 },
    Removed { name: u128 },
    Cleared,
}

/// An event arrived out of order: the replica's index must be rebuilt from a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfOrder {
    pub expected: u64,
    pub got: u64,
}

#[derive(Debug, Default)]
struct ReplicaBlocks {
    /// Names of the blocks the replica holds.
    held: HashSet<u128>,
    /// Names of blocks of prompts this router sent there, with the time sent (ms): held or being
    /// computed there, before the replica's events say so (a prompt's second request, sent while the
    /// first is still in prefill, goes where the first went).
    routed: HashMap<u128, u64>,
    /// The last event applied; `None` until a snapshot arrives.
    seq: Option<u64>,
}

/// The names of a prompt's full blocks under `key`, as [`FleetIndex::held_prefix`] takes them. The last
/// token of a prompt is always computed, so a block that ends the prompt is not counted.
pub fn prompt_names(
    namer: &mut ContentNamer,
    key: &CacheKey,
    tokens: &[u32],
    block_size: usize,
) -> Vec<u128> {
    let usable = tokens.len().saturating_sub(1);
    namer.chain_blocks(key, &tokens[..usable], block_size)
}

/// The fleet's block index.
#[derive(Debug)]
pub struct FleetIndex {
    replicas: Vec<ReplicaBlocks>,
    /// [`MAX_HELD`] (smaller in tests).
    max_held: usize,
}

impl FleetIndex {
    /// An index of `replicas` replicas, none synchronized yet.
    pub fn new(replicas: usize) -> Self {
        Self {
            replicas: (0..replicas).map(|_| ReplicaBlocks::default()).collect(),
            max_held: MAX_HELD,
        }
    }

    /// Replaces replica `r`'s blocks with a snapshot of `names` current at event `seq`.
    pub fn reset(&mut self, r: usize, seq: u64, names: &[u128]) {
        self.replicas[r] = ReplicaBlocks {
            held: names.iter().copied().take(self.max_held).collect(),
            routed: HashMap::new(),
            seq: Some(seq),
        };
    }

    /// Applies replica `r`'s event `seq`; an event that does not follow the last one applied is
    /// refused (the caller resynchronizes from a snapshot).
    pub fn apply(&mut self, r: usize, seq: u64, change: &Change) -> Result<(), OutOfOrder> {
        let rep = &mut self.replicas[r];
        let expected = match rep.seq {
            Some(last) => last.checked_add(1).ok_or(OutOfOrder {
                expected: last,
                got: seq,
            })?,
            None => {
                return Err(OutOfOrder {
                    expected: 0,
                    got: seq,
                });
            }
        };
        if seq != expected {
            return Err(OutOfOrder { expected, got: seq });
        }
        match change {
            Change::Stored { name } => {
                if rep.held.len() < self.max_held {
                    rep.held.insert(*name);
                }
            }
            Change::Removed { name } => {
                rep.held.remove(name);
                rep.routed.remove(name);
            }
            Change::Cleared => {
                rep.held.clear();
                rep.routed.clear();
            }
        }
        rep.seq = Some(seq);
        Ok(())
    }

    /// Forgets replica `r`'s blocks until its next snapshot (it is down, or its stream broke).
    pub fn forget(&mut self, r: usize) {
        self.replicas[r] = ReplicaBlocks::default();
    }

    /// Whether replica `r`'s blocks are known (a snapshot arrived and nothing broke since).
    pub fn synced(&self, r: usize) -> bool {
        self.replicas[r].seq.is_some()
    }

    /// Blocks replica `r` holds.
    pub fn num_blocks(&self, r: usize) -> usize {
        self.replicas[r].held.len()
    }

    /// How many of `names` (a prompt's blocks, in order) replica `r` holds from the first on, counting
    /// blocks routed there within the last `ROUTED_TTL_MS` before `now_ms` as held.
    pub fn held_prefix(&self, r: usize, names: &[u128], now_ms: u64) -> usize {
        let rep = &self.replicas[r];
        let fresh = |n: &u128| {
            rep.routed
                .get(n)
                .is_some_and(|&t| now_ms.saturating_sub(t) < ROUTED_TTL_MS)
        };
        names
            .iter()
            .take_while(|n| rep.held.contains(n) || fresh(n))
            .count()
    }

    /// Records that a prompt of `names` was sent to replica `r` at `now_ms`.
    /// At most `MAX_ROUTED` routed blocks are kept a replica: past it the stale ones go, then, in a
    /// burst where fresh ones alone pass it, all of them (they are hints), and a prompt longer than
    /// the bound is noted by its first blocks.
    pub fn note_routed(&mut self, r: usize, names: &[u128], now_ms: u64) {
        let rep = &mut self.replicas[r];
        let names = &names[..names.len().min(MAX_ROUTED)];
        if rep.routed.len() + names.len() > MAX_ROUTED {
            rep.routed
                .retain(|_, &mut t| now_ms.saturating_sub(t) < ROUTED_TTL_MS);
            if rep.routed.len() + names.len() > MAX_ROUTED {
                rep.routed.clear();
            }
        }
        for &n in names {
            rep.routed.insert(n, now_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kura_kv::Secret;

    const BS: usize = 4;

    fn namer(text: &str) -> ContentNamer {
        ContentNamer::new(&Secret::from_text(text).unwrap())
    }

    const FLEET: &str = "a fleet secret of at least thirty-two characters";

    #[test]
    fn a_replica_reporting_blocks_without_end_is_recorded_up_to_the_bound() {
        let mut index = FleetIndex::new(1);
        index.max_held = 100;
        let names: Vec<u128> = (0..150).collect();
        index.reset(0, 0, &names);
        assert_eq!(index.num_blocks(0), 100);
        for seq in 1..=50u64 {
            let name = 1_000 + u128::from(seq);
            index.apply(0, seq, &Change::Stored { name }).unwrap();
        }
        assert_eq!(index.num_blocks(0), 100);
        // A removal makes room again.
        index.apply(0, 51, &Change::Removed { name: 0 }).unwrap();
        index.apply(0, 52, &Change::Stored { name: 7_000 }).unwrap();
        assert_eq!(index.held_prefix(0, &[7_000], 0), 1);
    }

    #[test]
    fn an_event_after_the_last_sequence_number_is_out_of_order_not_a_panic() {
        let mut index = FleetIndex::new(1);
        index.reset(0, u64::MAX, &[1, 2]);
        let e = index.apply(0, 0, &Change::Stored { name: 3 }).unwrap_err();
        assert_eq!(e.got, 0);
        assert_eq!(index.num_blocks(0), 2);
    }

    #[test]
    fn routed_blocks_stay_within_their_bound_in_a_burst() {
        let mut index = FleetIndex::new(1);
        // Two prompts of 600,000 blocks within the TTL, then one of more blocks than the bound.
        let burst: Vec<u128> = (0..600_000).collect();
        index.note_routed(0, &burst, 0);
        let more: Vec<u128> = (1_000_000..1_600_000).collect();
        index.note_routed(0, &more, 1);
        assert!(index.replicas[0].routed.len() <= MAX_ROUTED);
        assert_eq!(index.held_prefix(0, &more, 2), more.len());
        let huge: Vec<u128> = (2_000_000..2_000_000 + MAX_ROUTED as u128 + 5).collect();
        index.note_routed(0, &huge, 3);
        assert_eq!(index.replicas[0].routed.len(), MAX_ROUTED);
        assert_eq!(index.held_prefix(0, &huge, 4), MAX_ROUTED);
    }

    #[test]
    fn a_prompt_finds_the_replica_holding_its_prefix_under_its_key_only() {
        let key = CacheKey::new().with_model_fingerprint("m");
        let other = CacheKey::new()
            .with_model_fingerprint("m")
            .with_salt("tenant");
        let doc: Vec<u32> = (0..16).collect();
        // The replica names its blocks with the fleet's secret, as the router does.
        let mut replica = namer(FLEET);
        let mut router = namer(FLEET);
        let mut index = FleetIndex::new(2);
        index.reset(0, 0, &[]);
        let held = replica.chain_blocks(&key, &doc[..12], BS);
        index.reset(1, 5, &held);
        assert_eq!(index.num_blocks(1), 3);
        let mut prompt = doc.clone();
        prompt.push(99);
        let names = prompt_names(&mut router, &key, &prompt, BS);
        assert_eq!(names.len(), 4);
        assert_eq!(
            (
                index.held_prefix(0, &names, 0),
                index.held_prefix(1, &names, 0)
            ),
            (0, 3)
        );
        let theirs = prompt_names(&mut router, &other, &prompt, BS);
        assert_eq!(index.held_prefix(1, &theirs, 0), 0);
        // A router with another secret finds nothing.
        let stranger = prompt_names(&mut namer(&"x".repeat(40)), &key, &prompt, BS);
        assert_eq!(index.held_prefix(1, &stranger, 0), 0);
        // A prompt that differs in its second block shares only the first.
        let mut fork = prompt.clone();
        fork[5] = 77;
        let names_fork = prompt_names(&mut router, &key, &fork, BS);
        assert_eq!(index.held_prefix(1, &names_fork, 0), 1);
        // The last token is always computed: a prompt of exactly three blocks counts two.
        assert_eq!(prompt_names(&mut router, &key, &doc[..12], BS).len(), 2);

        // Events: replica 0 stores the first two blocks; replica 1 drops its last.
        for (i, name) in replica
            .chain_blocks(&key, &doc[..8], BS)
            .into_iter()
            .enumerate()
        {
            index
                .apply(0, i as u64 + 1, &Change::Stored { name })
                .unwrap();
        }
        assert_eq!(index.held_prefix(0, &names, 0), 2);
        index
            .apply(1, 6, &Change::Removed { name: held[2] })
            .unwrap();
        assert_eq!(index.held_prefix(1, &names, 0), 2);
        // A removal of the middle block cuts the prefix there.
        index
            .apply(1, 7, &Change::Removed { name: held[1] })
            .unwrap();
        assert_eq!(index.held_prefix(1, &names, 0), 1);
        // A skipped number is refused and changes nothing.
        assert_eq!(
            index.apply(1, 9, &Change::Cleared),
            Err(OutOfOrder {
                expected: 8,
                got: 9
            })
        );
        assert_eq!(index.held_prefix(1, &names, 0), 1);
        index.apply(1, 8, &Change::Cleared).unwrap();
        assert_eq!(index.num_blocks(1), 0);
        // A prompt routed to replica 1 counts as held there until its events come, or for ROUTED_TTL_MS.
        index.note_routed(1, &names, 1_000);
        assert_eq!(index.held_prefix(1, &names, 1_500), 4);
        assert_eq!(index.held_prefix(1, &names, 1_000 + ROUTED_TTL_MS), 0);
        index.forget(0);
        assert!(!index.synced(0));
        assert!(index.apply(0, 3, &Change::Cleared).is_err());
    }
}
