//! The pool's content as a numbered stream, for a router that sends requests to the replica holding
//! their prefix (as vLLM's KV events feed Dynamo's and llm-d's routers).
//!
//! The engine loop drains the KV manager's [`KvEvent`]s after every step and appends them here, each with
//! the next sequence number. Readers (the server's `/v1/kv/events` streams) take a [`KvSnapshot`] — every
//! block announced and not removed, with the sequence number it is current at — and then the events after
//! it from a ring of the last `capacity` events. A reader that falls further behind than the ring gets
//! [`Gap`] and starts again from a snapshot; a reader that sees a number skipped knows it missed one.
//!
//! Blocks are announced by keyed content names ([`ContentNamer`] with the fleet's secret), never by the
//! replica's own hashes, tokens or cache keys: a router that holds the fleet secret names a request's
//! blocks the same way from the tokens it computes, and a reader without it learns nothing of any
//! tenant's prompts. Token ids are added only when the operator asks for them (`debug_tokens`).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use kura_fleet::ContentNamer;
use kura_kv::{KvEvent, Secret};

/// How a server publishes its pool's content.
#[derive(Debug, Clone)]
pub struct KvEventsSetup {
    /// Events the ring holds (at least 1).
    pub buffer: usize,
    /// The fleet's secret, whose naming key names blocks.
    pub secret: Secret,
    /// Add each block's token ids (for debugging a router; they reveal prompts).
    pub debug_tokens: bool,
}

/// One block in the pool, as announced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvBlockInfo {
    /// The block's keyed content name.
    pub name: u128,
    /// Its token ids, only with `debug_tokens`.
    pub tokens: Option<Vec<u32>>,
}

/// A change of the pool's content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvChange {
    Stored(Arc<KvBlockInfo>),
    Removed { name: u128 },
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

#[derive(Debug)]
struct State {
    last_seq: u64,
    ring: VecDeque<KvEventRecord>,
    /// Blocks announced and not removed, by the replica's own hash.
    blocks: HashMap<u128, Arc<KvBlockInfo>>,
    namer: ContentNamer,
}

/// The numbered event stream and the current set of blocks; shared by the engine loop (the writer) and
/// the server (readers).
#[derive(Debug)]
pub struct KvEventLog {
    capacity: usize,
    debug_tokens: bool,
    state: Mutex<State>,
}

impl KvEventLog {
    /// A log whose ring holds the last `setup.buffer` events (at least 1).
    pub fn new(setup: &KvEventsSetup) -> Self {
        Self {
            capacity: setup.buffer.max(1),
            debug_tokens: setup.debug_tokens,
            state: Mutex::new(State {
                last_seq: 0,
                ring: VecDeque::new(),
                blocks: HashMap::new(),
                namer: ContentNamer::new(&setup.secret),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock; a poisoned one still holds a consistent state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends the manager's events, numbering them.
    pub(crate) fn publish(&self, events: impl IntoIterator<Item = KvEvent>) {
        let mut guard = self.state();
        let s = &mut *guard;
        for event in events {
            let change = match event {
                KvEvent::Stored {
                    hash,
                    parent,
                    tokens,
                    key,
                    ..
                } => {
                    let parent_name = match (parent, key) {
                        (Some(p), _) => s.blocks.get(&p.0).map(|b| b.name),
                        (None, Some(key)) => Some(s.namer.root(&key)),
                        (None, None) => None,
                    };
                    // A child whose parent is not announced (never, as the manager announces) cannot
                    // be named: it is left out, and a reader misses only the prefixes through it.
                    let Some(parent_name) = parent_name else {
                        continue;
                    };
                    let info = Arc::new(KvBlockInfo {
                        name: s.namer.chain(parent_name, &tokens),
                        tokens: self.debug_tokens.then_some(tokens),
                    });
                    s.blocks.insert(hash.0, info.clone());
                    KvChange::Stored(info)
                }
                KvEvent::Removed { hash, .. } => match s.blocks.remove(&hash.0) {
                    Some(b) => KvChange::Removed { name: b.name },
                    None => continue,
                },
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
    use kura_kv::{BlockHash, CacheKey};

    fn stored(h: u128, parent: Option<u128>) -> KvEvent {
        KvEvent::Stored {
            hash: BlockHash(h),
            parent: parent.map(BlockHash),
            block: 0,
            tokens: vec![h as u32; 4],
            key: parent
                .is_none()
                .then(|| CacheKey::new().with_salt("key-tenant")),
        }
    }

    fn log(buffer: usize, debug_tokens: bool) -> KvEventLog {
        KvEventLog::new(&KvEventsSetup {
            buffer,
            secret: Secret::from_text(&"f".repeat(32)).unwrap(),
            debug_tokens,
        })
    }

    #[test]
    fn blocks_are_announced_by_keyed_names_without_tokens() {
        let secret = Secret::from_text(&"f".repeat(32)).unwrap();
        let mut namer = ContentNamer::new(&secret);
        let key = CacheKey::new().with_salt("key-tenant");
        let names = namer.chain_blocks(&key, &[1, 1, 1, 1, 2, 2, 2, 2], 4);
        for debug_tokens in [false, true] {
            let log = log(8, debug_tokens);
            log.publish([stored(1, None), stored(2, Some(1))]);
            let mut snap: Vec<_> = log
                .snapshot()
                .blocks
                .iter()
                .map(|b| (**b).clone())
                .collect();
            snap.sort_by_key(|b| names.iter().position(|n| *n == b.name));
            let want: Vec<KvBlockInfo> = names
                .iter()
                .zip([1u32, 2])
                .map(|(&name, t)| KvBlockInfo {
                    name,
                    tokens: debug_tokens.then(|| vec![t; 4]),
                })
                .collect();
            assert_eq!(
                snap, want,
                "named as a router with the fleet secret names them"
            );
            log.publish([KvEvent::Removed {
                hash: BlockHash(2),
                block: 0,
            }]);
            assert_eq!(
                log.since(2, 1).unwrap()[0].change,
                KvChange::Removed { name: names[1] }
            );
        }
        // Another secret names the same blocks otherwise.
        let other = KvEventLog::new(&KvEventsSetup {
            buffer: 8,
            secret: Secret::from_text(&"g".repeat(32)).unwrap(),
            debug_tokens: false,
        });
        other.publish([stored(1, None)]);
        assert!(!names.contains(&other.snapshot().blocks[0].name));
    }

    #[test]
    fn snapshot_and_events_agree_and_a_reader_behind_the_ring_gets_a_gap() {
        let log = log(3, false);
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
        assert!(matches!(after[0].change, KvChange::Removed { .. }));
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
