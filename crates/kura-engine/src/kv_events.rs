//! The pool's content as a numbered stream, for a router that sends requests to the replica holding
//! their prefix (as vLLM's KV events feed Dynamo's and llm-d's routers).
//!
//! The engine loop drains the KV manager's [`KvEvent`]s after every step and appends them here, each with
//! the next sequence number. Readers (the server's `/v1/kv/events` streams) take a [`KvSnapshot`] — every
//! block announced and not removed, with the sequence number it is current at — and then the events after
//! it from a ring of the last `capacity` events. A reader that falls further behind than the ring gets
//! [`Gap`] and starts again from a snapshot; a reader that sees a number skipped knows it missed one.
//!
//! Hashes are the replica's own (seeded per process); a block also carries its tokens, and a root block
//! the digest of its cache key ([`kura_kv::CacheKey::digest`], never the tenant's salt), so that a reader
//! can name blocks by content without knowing the seed.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use kura_kv::KvEvent;

/// One block in the pool, as announced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvBlockInfo {
    pub hash: u128,
    /// `None` for the first block of a sequence.
    pub parent: Option<u128>,
    pub tokens: Vec<u32>,
    /// For a root block, the digest of its cache key.
    pub key_digest: Option<u128>,
}

/// A change of the pool's content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvChange {
    Stored(Arc<KvBlockInfo>),
    Removed { hash: u128 },
    Cleared,
}

/// A change with its sequence number (1, 2, … for the life of the engine).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventRecord {
    pub seq: u64,
    pub change: KvChange,
}

/// Every block currently announced, as of event `seq` (0: before any event).
#[derive(Debug, Clone)]
pub struct KvSnapshot {
    pub seq: u64,
    pub blocks: Vec<Arc<KvBlockInfo>>,
}

/// A reader asked for events the ring no longer holds: it must start again from a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gap {
    /// The first event the reader needed.
    pub wanted: u64,
    /// The oldest event still held.
    pub oldest: u64,
}

#[derive(Debug, Default)]
struct State {
    last_seq: u64,
    ring: VecDeque<KvEventRecord>,
    blocks: HashMap<u128, Arc<KvBlockInfo>>,
}

/// The numbered event stream and the current set of blocks; shared by the engine loop (the writer) and
/// the server (readers).
#[derive(Debug)]
pub struct KvEventLog {
    capacity: usize,
    state: Mutex<State>,
}

impl KvEventLog {
    /// A log whose ring holds the last `capacity` events (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock; a poisoned one still holds a consistent state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends the manager's events, numbering them.
    pub(crate) fn publish(&self, events: impl IntoIterator<Item = KvEvent>) {
        let mut s = self.state();
        for event in events {
            let change = match event {
                KvEvent::Stored {
                    hash,
                    parent,
                    tokens,
                    key_digest,
                    ..
                } => {
                    let info = Arc::new(KvBlockInfo {
                        hash: hash.0,
                        parent: parent.map(|p| p.0),
                        tokens,
                        key_digest,
                    });
                    s.blocks.insert(hash.0, info.clone());
                    KvChange::Stored(info)
                }
                KvEvent::Removed { hash, .. } => {
                    s.blocks.remove(&hash.0);
                    KvChange::Removed { hash: hash.0 }
                }
                KvEvent::Cleared => {
                    s.blocks.clear();
                    KvChange::Cleared
                }
            };
            s.last_seq += 1;
            let seq = s.last_seq;
            if s.ring.len() == self.capacity {
                s.ring.pop_front();
            }
            s.ring.push_back(KvEventRecord { seq, change });
        }
    }

    /// Every block announced and not removed, and the last event it includes.
    pub fn snapshot(&self) -> KvSnapshot {
        let s = self.state();
        KvSnapshot {
            seq: s.last_seq,
            blocks: s.blocks.values().cloned().collect(),
        }
    }

    /// The number of the last event (0 before any).
    pub fn last_seq(&self) -> u64 {
        self.state().last_seq
    }

    /// Up to `max` events after event `after`, in order; [`Gap`] if the first of them has left the ring.
    pub fn since(&self, after: u64, max: usize) -> Result<Vec<KvEventRecord>, Gap> {
        let s = self.state();
        let wanted = after.saturating_add(1);
        let Some(oldest) = s.ring.front().map(|e| e.seq) else {
            return Ok(Vec::new());
        };
        if wanted > s.last_seq {
            return Ok(Vec::new());
        }
        if wanted < oldest {
            return Err(Gap { wanted, oldest });
        }
        // The ring holds consecutive numbers: the wanted event's place is its distance from the oldest.
        let skip = usize::try_from(wanted - oldest).unwrap_or(usize::MAX);
        Ok(s.ring.iter().skip(skip).take(max).cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kura_kv::BlockHash;

    fn stored(h: u128, parent: Option<u128>) -> KvEvent {
        KvEvent::Stored {
            hash: BlockHash(h),
            parent: parent.map(BlockHash),
            block: 0,
            tokens: vec![h as u32; 4],
            key_digest: parent.is_none().then_some(7),
        }
    }

    #[test]
    fn snapshot_and_events_agree_and_a_reader_behind_the_ring_gets_a_gap() {
        let log = KvEventLog::new(3);
        assert_eq!(log.since(0, 10), Ok(Vec::new()));
        log.publish([stored(1, None), stored(2, Some(1))]);
        let snap = log.snapshot();
        assert_eq!(snap.seq, 2);
        assert_eq!(snap.blocks.len(), 2);
        log.publish([KvEvent::Removed {
            hash: BlockHash(2),
            block: 0,
        }]);
        let after = log.since(snap.seq, 10).unwrap();
        assert_eq!(after.len(), 1);
        assert_eq!(after[0].seq, 3);
        assert_eq!(after[0].change, KvChange::Removed { hash: 2 });
        assert_eq!(log.snapshot().blocks.len(), 1);
        // Two more events push event 1 and 2 out of a ring of 3.
        log.publish([stored(3, None), KvEvent::Cleared]);
        assert_eq!(
            log.since(0, 10),
            Err(Gap {
                wanted: 1,
                oldest: 3
            })
        );
        let tail = log.since(2, 2).unwrap();
        assert_eq!(tail.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![3, 4]);
        assert_eq!(log.since(5, 10), Ok(Vec::new()));
        let snap = log.snapshot();
        assert_eq!((snap.seq, snap.blocks.len()), (5, 0));
    }
}
