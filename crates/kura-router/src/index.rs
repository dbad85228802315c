//! Which replica holds which blocks, built from the replicas' KV events (a snapshot, then numbered
//! changes), and how many leading blocks of a prompt each one holds.
//!
//! Replicas name blocks by hashes of their own seeds, so the index names them by content instead: a
//! root block is `chain(key digest, tokens)`, every other `chain(its parent's name, tokens)`, with the
//! router's own [`BlockHasher`]. A request's blocks get the same names from its tokens and the digest of
//! its cache key (salt and model fingerprint, as the replica builds it), so equal names mean equal
//! prefixes under equal keys. Deterministic and synchronous: the event followers and the simulator feed
//! it, the request path reads it.

use std::collections::{HashMap, HashSet};

use kura_kv::hash::BlockHasher;
use kura_kv::{BlockHash, CacheKey};

/// How long a block routed to a replica counts as held there without an event saying so.
pub const ROUTED_TTL_MS: u64 = 10_000;
/// Most routed names kept per replica before expired ones are dropped.
const MAX_ROUTED: usize = 1 << 20;

/// One block as a replica announced it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnouncedBlock {
    pub hash: u128,
    pub parent: Option<u128>,
    pub tokens: Vec<u32>,
    pub key_digest: Option<u128>,
}

/// A change in a replica's pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Stored(AnnouncedBlock),
    Removed { hash: u128 },
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
    /// The replica's hash → the block's name here.
    names: HashMap<u128, u128>,
    /// Names of the blocks the replica holds.
    held: HashSet<u128>,
    /// Names of blocks of prompts this router sent there, with the time sent (ms): held or being
    /// computed there, before the replica's events say so (a prompt's second request, sent while the
    /// first is still in prefill, goes where the first went).
    routed: HashMap<u128, u64>,
    /// The last event applied; `None` until a snapshot arrives.
    seq: Option<u64>,
}

/// The fleet's block index.
#[derive(Debug)]
pub struct FleetIndex {
    hasher: BlockHasher,
    replicas: Vec<ReplicaBlocks>,
}

impl FleetIndex {
    /// An index of `replicas` replicas, none synchronized yet.
    pub fn new(replicas: usize) -> Self {
        Self {
            hasher: BlockHasher::new(BlockHasher::random_seed(), 128),
            replicas: (0..replicas).map(|_| ReplicaBlocks::default()).collect(),
        }
    }

    fn name(&mut self, r: usize, b: &AnnouncedBlock) -> Option<u128> {
        let parent = match (b.parent, b.key_digest) {
            (Some(p), _) => *self.replicas[r].names.get(&p)?,
            (None, Some(key)) => key,
            (None, None) => return None,
        };
        Some(self.hasher.chain(BlockHash(parent), &b.tokens).0)
    }

    fn store(&mut self, r: usize, b: &AnnouncedBlock) {
        // A child announced before its parent (never, as replicas announce) or after it left cannot be
        // named: it is left out, and only a prefix through it is missed.
        if let Some(name) = self.name(r, b) {
            let rep = &mut self.replicas[r];
            rep.names.insert(b.hash, name);
            rep.held.insert(name);
        }
    }

    /// Replaces replica `r`'s blocks with a snapshot current at event `seq`.
    pub fn reset(&mut self, r: usize, seq: u64, blocks: &[AnnouncedBlock]) {
        self.replicas[r] = ReplicaBlocks {
            seq: Some(seq),
            ..ReplicaBlocks::default()
        };
        // Parents first (a block's name needs its parent's): breadth-first from the roots.
        let mut children: HashMap<u128, Vec<&AnnouncedBlock>> = HashMap::new();
        let mut next: Vec<&AnnouncedBlock> = Vec::new();
        for b in blocks {
            match b.parent {
                Some(p) => children.entry(p).or_default().push(b),
                None => next.push(b),
            }
        }
        while let Some(b) = next.pop() {
            self.store(r, b);
            if let Some(kids) = children.remove(&b.hash) {
                next.extend(kids);
            }
        }
    }

    /// Applies replica `r`'s event `seq`; an event that does not follow the last one applied is
    /// refused (the caller resynchronizes from a snapshot).
    pub fn apply(&mut self, r: usize, seq: u64, change: &Change) -> Result<(), OutOfOrder> {
        let expected = match self.replicas[r].seq {
            Some(last) => last + 1,
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
            Change::Stored(b) => self.store(r, b),
            Change::Removed { hash } => {
                let rep = &mut self.replicas[r];
                if let Some(name) = rep.names.remove(hash) {
                    rep.held.remove(&name);
                    rep.routed.remove(&name);
                }
            }
            Change::Cleared => {
                let rep = &mut self.replicas[r];
                rep.names.clear();
                rep.held.clear();
                rep.routed.clear();
            }
        }
        self.replicas[r].seq = Some(seq);
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

    /// The names of a prompt's full blocks under `key`, as [`FleetIndex::held_prefix`] takes them. The
    /// last token of a prompt is always computed, so a block that ends the prompt is not counted.
    pub fn prompt_names(&mut self, key: &CacheKey, tokens: &[u32], block_size: usize) -> Vec<u128> {
        let usable = tokens.len().saturating_sub(1);
        self.hasher
            .chain_blocks(BlockHash(key.digest()), &tokens[..usable], block_size)
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
    pub fn note_routed(&mut self, r: usize, names: &[u128], now_ms: u64) {
        let rep = &mut self.replicas[r];
        if rep.routed.len() + names.len() > MAX_ROUTED {
            rep.routed
                .retain(|_, &mut t| now_ms.saturating_sub(t) < ROUTED_TTL_MS);
        }
        for &n in names {
            rep.routed.insert(n, now_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 4;

    /// Blocks of `tokens` as a replica with its own hashes (`salt` makes them differ) announces them.
    fn announce(key: &CacheKey, tokens: &[u32], salt: u128) -> Vec<AnnouncedBlock> {
        let mut parent = None;
        tokens
            .chunks_exact(BS)
            .enumerate()
            .map(|(i, t)| {
                let hash = salt * 1000 + i as u128 + 1;
                let b = AnnouncedBlock {
                    hash,
                    parent,
                    tokens: t.to_vec(),
                    key_digest: parent.is_none().then(|| key.digest()),
                };
                parent = Some(hash);
                b
            })
            .collect()
    }

    #[test]
    fn a_prompt_finds_the_replica_holding_its_prefix_under_its_key_only() {
        let key = CacheKey::new().with_model_fingerprint("m");
        let other = CacheKey::new()
            .with_model_fingerprint("m")
            .with_salt("tenant");
        let doc: Vec<u32> = (0..16).collect();
        let mut index = FleetIndex::new(2);
        index.reset(0, 0, &[]);
        // Replica 1's snapshot lists the children before the root.
        let mut blocks = announce(&key, &doc[..12], 1);
        blocks.reverse();
        index.reset(1, 5, &blocks);
        assert_eq!(index.num_blocks(1), 3);
        let mut prompt = doc.clone();
        prompt.push(99);
        let names = index.prompt_names(&key, &prompt, BS);
        assert_eq!(names.len(), 4);
        assert_eq!(
            (
                index.held_prefix(0, &names, 0),
                index.held_prefix(1, &names, 0)
            ),
            (0, 3)
        );
        let theirs = index.prompt_names(&other, &prompt, BS);
        assert_eq!(index.held_prefix(1, &theirs, 0), 0);
        // A prompt that differs in its second block shares only the first.
        let mut fork = prompt.clone();
        fork[5] = 77;
        let names_fork = index.prompt_names(&key, &fork, BS);
        assert_eq!(index.held_prefix(1, &names_fork, 0), 1);

        // Events: replica 0 stores the first two blocks; replica 1 drops its last.
        for (i, b) in announce(&key, &doc[..8], 2).into_iter().enumerate() {
            index.apply(0, i as u64 + 1, &Change::Stored(b)).unwrap();
        }
        assert_eq!(index.held_prefix(0, &names, 0), 2);
        index.apply(1, 6, &Change::Removed { hash: 1003 }).unwrap();
        assert_eq!(index.held_prefix(1, &names, 0), 2);
        // A skipped number is refused and changes nothing.
        assert_eq!(
            index.apply(1, 8, &Change::Cleared),
            Err(OutOfOrder {
                expected: 7,
                got: 8
            })
        );
        assert_eq!(index.held_prefix(1, &names, 0), 2);
        index.apply(1, 7, &Change::Cleared).unwrap();
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
