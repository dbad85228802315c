//! The engine's side of the shared tier in Redis (L4): blocks computed here are written there, and a new
//! request whose prompt has blocks the pool and the local tiers lack looks them up there first.
//!
//! ```text
//!  Submit ─▶ held locally? ─ all, or some pending, loading or in a lower tier ──▶ scheduler
//!              │ the pool's computed blocks, then some missing: GETRANGE of the rest, pipelined
//!              │ (kura-kv-redis thread); the request waits
//!              ▼
//!   answer (or FETCH_WAIT passed) ─▶ leading verified blocks adopted into the pool ─▶ scheduler
//!   (KvCacheManager::begin_adoption; tier moves run; bytes imported; finish_adoption)
//!
//!  block computed (KvEvent::Stored) ─▶ exported, one record per block ─▶ SET … EX ttl (same thread)
//! ```
//!
//! Replicas hash blocks with seeds of their own, so the shared tier names a block by content with the
//! fleet's naming key ([`ContentNamer`]): a root is named by its cache key (the tenant's salt and the
//! model fingerprint), every other block by its parent's name and its tokens, and its Redis key is
//! `kura:kv:{<root name>}:<name>` (the hash tag keeps a key's blocks on one Redis Cluster shard). Without
//! the fleet secret nobody can compute the name a prompt's blocks will have. Each record carries the KV
//! fingerprint, its parent, its root name and its tokens, all checked on the way back, and a keyed MAC
//! over its Redis key and its bytes (kura-tiers), so that a record written without the fleet secret, or
//! copied under another name, is never adopted. The engine never waits on Redis: a lookup not answered within `FETCH_WAIT` is given up, and
//! Redis down means every lookup a miss at once.
//!
//! A block is written once per name while Redis can be expected to hold it: its name is marked when
//! its write is queued, for the tier's TTL from then (the key expires no sooner), and the mark is
//! taken back when the write is not queued (the queue full) or not stored (Redis unreachable, the
//! connection lost, an error reply: the Redis thread reports it). A block whose write failed, or whose
//! key has expired, is written again when the pool next announces it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kura_fleet::ContentNamer;
use kura_kv::{CacheKey, KvEvent, Secret};
use kura_tiers::{encode_record, BlockRecord, RemoteSetup, RemoteWorker};

use crate::seq::Seq;

/// Longest a request waits for its Redis lookup.
const FETCH_WAIT: Duration = Duration::from_millis(500);
/// Names of blocks written or found, remembered to skip writing them again (the lapsed ones dropped
/// when full, or all of them when most are live).
const MAX_WRITTEN: usize = 1 << 20;

/// The Redis tier `kura serve --kv-redis-url` was given. Its `Debug` hides the URL's user and password.
#[derive(Clone)]
pub struct RemoteTierSetup {
    /// `redis://…` or `rediss://…` (TLS), possibly with a user and password.
    pub url: String,
    /// Seconds a block lives in Redis after it is written.
    pub ttl_s: u64,
    /// Longest wait for a connection or a command.
    pub timeout: Duration,
    /// The fleet's secret: names records and keys their MACs.
    pub secret: Secret,
    /// PEM file of the CA(s) that sign the Redis server's certificate (`rediss://`); `None`: the
    /// system's roots.
    pub ca_file: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for RemoteTierSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTierSetup")
            .field("url", &kura_tiers::redact_url(&self.url))
            .field("ttl_s", &self.ttl_s)
            .field("timeout", &self.timeout)
            .field("secret", &self.secret)
            .field("ca_file", &self.ca_file)
            .finish()
    }
}

/// A request waiting for its Redis lookup.
pub(crate) struct Parked {
    pub seq: Seq,
    started: Instant,
    deadline: Instant,
    /// The prompt's whole blocks that the lookup covers, and how many of them were held locally.
    tokens: Vec<u32>,
    held: usize,
    key: CacheKey,
    /// The content names of those blocks.
    names: Vec<u128>,
}

/// Blocks to adopt into the pool: the prompt's leading tokens and the payloads after the held ones.
pub(crate) struct Adoption {
    pub tokens: Vec<u32>,
    pub key: CacheKey,
    pub held: usize,
    pub payloads: Vec<Vec<u8>>,
    /// Content names of the blocks of `tokens`.
    names: Vec<u128>,
}

pub(crate) struct RemoteTier {
    worker: RemoteWorker,
    namer: ContentNamer,
    block_size: usize,
    fingerprint: u128,
    /// This replica's block hash → (name, root name), for blocks in the pool.
    names: HashMap<u128, (u128, u128)>,
    /// Names written, being written or found, each with when its mark lapses (`None`: never, a TTL
    /// past what an `Instant` holds).
    written: HashMap<u128, Option<Instant>>,
    /// How long a mark lasts: the tier's TTL.
    mark_for: Duration,
    parked: HashMap<u64, Parked>,
    /// Blocks not looked up because the tier cost check judged recomputing them faster.
    pub refused_blocks: u64,
    /// Lookups answered with blocks since the last drain: (bytes, round trip), the tier's bandwidth.
    pub samples: Vec<(usize, Duration)>,
}

fn redis_key(root: u128, name: u128) -> String {
    format!("kura:kv:{{{root:032x}}}:{name:032x}")
}

impl RemoteTier {
    pub fn open(
        setup: &RemoteTierSetup,
        block_size: usize,
        block_bytes: usize,
        fingerprint: u128,
    ) -> Result<Self, String> {
        let worker = RemoteWorker::start(RemoteSetup {
            url: setup.url.clone(),
            ttl_s: setup.ttl_s,
            fingerprint,
            payload_len: block_bytes,
            timeout: setup.timeout,
            mac_key: setup.secret.derive(kura_tiers::RemoteSetup::MAC_PURPOSE),
            ca_file: setup.ca_file.clone(),
        })
        .map_err(|e| e.to_string())?;
        Ok(Self {
            worker,
            namer: ContentNamer::new(&setup.secret),
            block_size,
            fingerprint,
            names: HashMap::new(),
            written: HashMap::new(),
            mark_for: Duration::from_secs(setup.ttl_s),
            parked: HashMap::new(),
            refused_blocks: 0,
            samples: Vec::new(),
        })
    }

    /// Marks `name` written (or found) for the TTL from `now`; `false` when a mark of it has not
    /// lapsed (Redis may be expected to hold it, or its write is under way).
    fn remember_written(&mut self, name: u128, now: Instant) -> bool {
        let live = |until: &Option<Instant>| until.is_none_or(|t| now < t);
        if self.written.get(&name).is_some_and(live) {
            return false;
        }
        if self.written.len() >= MAX_WRITTEN {
            self.written.retain(|_, until| live(until));
            // Mostly live marks: dropping them all costs some writes again, and bounds the work.
            if self.written.len() >= MAX_WRITTEN / 4 * 3 {
                self.written.clear();
            }
        }
        self.written.insert(name, now.checked_add(self.mark_for));
        true
    }

    /// Writes the blocks the pool announced (once per name while the mark lasts), reading each one's
    /// bytes with `export`. The marks of writes the Redis thread reports as not stored are taken back
    /// first, so that those blocks are written again when announced.
    pub fn on_events(&mut self, events: &[KvEvent], mut export: impl FnMut(u32) -> Vec<u8>) {
        for name in self.worker.failed_puts() {
            self.written.remove(&name);
        }
        let now = Instant::now();
        for event in events {
            match event {
                KvEvent::Stored {
                    hash,
                    parent,
                    block,
                    tokens,
                    key,
                } => {
                    let (parent_name, key_digest) = match (parent, key) {
                        (Some(p), _) => match self.names.get(&p.0) {
                            Some(&(name, root)) => (name, root),
                            None => continue,
                        },
                        (None, Some(key)) => {
                            let root = self.namer.root(key);
                            (root, root)
                        }
                        (None, None) => continue,
                    };
                    let name = self.namer.chain(parent_name, tokens);
                    self.names.insert(hash.0, (name, key_digest));
                    if !self.remember_written(name, now) {
                        continue;
                    }
                    let record = BlockRecord {
                        hash: name,
                        parent_hash: parent_name,
                        key_digest,
                        tokens: tokens.clone(),
                    };
                    let bytes = encode_record(self.fingerprint, &record, &export(*block));
                    if !self
                        .worker
                        .try_put(name, redis_key(key_digest, name), bytes)
                    {
                        // The queue is full: not written, so not marked.
                        self.written.remove(&name);
                    }
                }
                KvEvent::Removed { hash, .. } => {
                    self.names.remove(&hash.0);
                }
                KvEvent::Cleared => self.names.clear(),
            }
        }
    }

    /// Starts the lookup of `prompt`'s blocks beyond the first `held` (of its whole blocks before its last
    /// token: the pool's computed ones, [`kura_kv::KvCacheManager::adoptable_prefix_blocks`]) and parks
    /// the request; gives `seq` back when there is nothing to look up, when `held` is `None` (part of
    /// the local prefix is pending, being loaded or in a lower tier: what the lookup brought could not
    /// be adopted after it, so it is not sent; the request loads or waits for that part and computes
    /// the rest), when the lookup could not be queued, or when `load` is false (the tier cost check
    /// judged recomputing the missing blocks faster: they are counted in `refused_blocks`).
    pub fn park(
        &mut self,
        id: u64,
        seq: Seq,
        prompt: &[u32],
        key: &CacheKey,
        load: bool,
        held: impl FnOnce(&[u32]) -> Option<usize>,
    ) -> Option<Seq> {
        let bs = self.block_size;
        let whole = prompt.len().saturating_sub(1) / bs * bs;
        if whole == 0 {
            return Some(seq);
        }
        let tokens = &prompt[..whole];
        let Some(held) = held(tokens) else {
            return Some(seq);
        };
        if held * bs >= whole {
            return Some(seq);
        }
        if !load {
            self.refused_blocks += (whole / bs - held) as u64;
            return Some(seq);
        }
        let key_digest = self.namer.root(key);
        let names = self.namer.chain_blocks(key, tokens, bs);
        let lookups = (held..names.len())
            .map(|i| {
                let record = BlockRecord {
                    hash: names[i],
                    parent_hash: if i == 0 { key_digest } else { names[i - 1] },
                    key_digest,
                    tokens: tokens[i * bs..(i + 1) * bs].to_vec(),
                };
                (redis_key(key_digest, names[i]), record)
            })
            .collect();
        let started = Instant::now();
        let deadline = started + FETCH_WAIT;
        // Past the deadline the Redis thread does not run the lookup: its answer would be ignored.
        if !self.worker.try_fetch(id, lookups, deadline) {
            return Some(seq);
        }
        self.parked.insert(
            id,
            Parked {
                seq,
                started,
                deadline,
                tokens: tokens.to_vec(),
                held,
                key: key.clone(),
                names,
            },
        );
        None
    }

    pub fn num_parked(&self) -> usize {
        self.parked.len()
    }

    /// Forgets a parked request (cancelled); its lookup's answer will be ignored.
    pub fn unpark(&mut self, id: u64) {
        self.parked.remove(&id);
    }

    /// Requests whose lookup is answered or given up: each with the blocks to adopt, if any.
    pub fn ready(&mut self) -> Vec<(u64, Seq, Option<Adoption>)> {
        let mut out = Vec::new();
        for done in self.worker.poll() {
            let Some(p) = self.parked.remove(&done.ticket) else {
                continue;
            };
            if !done.payloads.is_empty() {
                let bytes = done.payloads.iter().map(Vec::len).sum();
                self.samples.push((bytes, p.started.elapsed()));
            }
            let adoption = (!done.payloads.is_empty()).then(|| {
                let bs = self.block_size;
                let n = p.held + done.payloads.len();
                Adoption {
                    tokens: p.tokens[..n * bs].to_vec(),
                    key: p.key,
                    held: p.held,
                    payloads: done.payloads,
                    names: p.names[..n].to_vec(),
                }
            });
            out.push((done.ticket, p.seq, adoption));
        }
        let now = Instant::now();
        let late: Vec<u64> = self
            .parked
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in late {
            if let Some(p) = self.parked.remove(&id) {
                out.push((id, p.seq, None));
            }
        }
        out
    }

    /// Names of adopted blocks, so that announcing them does not write them back. (Their keys' TTLs
    /// ran from their writes, elsewhere: one that expires before its mark here lapses is written again
    /// once the mark has.)
    pub fn adopted(&mut self, a: &Adoption) {
        let now = Instant::now();
        for &name in &a.names {
            self.remember_written(name, now);
        }
    }

    /// The Redis thread's counters.
    pub fn stats(&self) -> &std::sync::Arc<kura_tiers::RemoteStats> {
        self.worker.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    /// A tier whose Redis is never there (nothing listens on port 1).
    fn unreachable(ttl_s: u64) -> RemoteTier {
        let setup = RemoteTierSetup {
            url: "redis://127.0.0.1:1".into(),
            ttl_s,
            timeout: Duration::from_millis(50),
            secret: Secret::random(),
            ca_file: None,
        };
        RemoteTier::open(&setup, 4, 64, 1).unwrap()
    }

    #[test]
    fn a_mark_lasts_the_ttl() {
        let mut tier = unreachable(600);
        let now = Instant::now();
        assert!(tier.remember_written(7, now));
        assert!(!tier.remember_written(7, now + Duration::from_secs(599)));
        // The key has expired by now: written again, and marked anew.
        assert!(tier.remember_written(7, now + Duration::from_secs(600)));
        assert!(!tier.remember_written(7, now + Duration::from_secs(1199)));
    }

    #[test]
    fn a_write_redis_did_not_store_is_offered_again_when_its_block_is_announced_again() {
        let mut tier = unreachable(600);
        let stored = KvEvent::Stored {
            hash: kura_kv::BlockHash(1),
            parent: None,
            block: 0,
            tokens: vec![1, 2, 3, 4],
            key: Some(CacheKey::new().with_salt("t")),
        };
        // How many times an announcement offers the block's bytes to be written.
        let announce = |tier: &mut RemoteTier| {
            let mut offered = 0;
            tier.on_events(std::slice::from_ref(&stored), |_| {
                offered += 1;
                vec![0; 64]
            });
            offered
        };
        assert_eq!(announce(&mut tier), 1);
        // The Redis thread reports the write not stored (the wait ends with its deadline only if it
        // never does). The next announcement takes the mark back and writes the block again (it
        // used to be marked written for good).
        assert!(
            tier.worker.wait_failed_put(Duration::from_secs(10)),
            "the write was reported not stored"
        );
        assert_eq!(announce(&mut tier), 1);
        assert!(tier.stats().dropped.load(Ordering::Relaxed) >= 1);
    }
}
