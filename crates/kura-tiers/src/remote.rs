//! `RemoteWorker`: the bytes of the shared tier (L4) in Redis, on a thread of their own.
//!
//! A block is one Redis string: the same self-describing, checksummed record as a disk block file
//! ([`crate::disk::encode_record`]), under a key the caller chooses (Kura's engine uses
//! `kura:kv:{<cache key digest>}:<content name>`: the hash tag keeps a cache key's blocks on one Redis
//! Cluster shard, so that one `MGET` fetches a prompt's blocks). Writes are `SET … EX ttl`, pipelined in
//! batches; a fetch is one `MGET` of a prompt's leading blocks, verified in order and cut at the first
//! block missing or failing a check (a failing one is deleted and counted).
//!
//! Redis is a cache here, never a dependency: the engine never waits on this thread. Jobs are offered
//! with `try_*` and dropped (counted) when the queue is full; a connection failure answers fetches as
//! misses and drops writes until a reconnection, tried at most once a second, succeeds; every command has
//! a timeout. Costs: a write copies the record once into the job; a fetch moves each payload once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::disk::{decode_record, BlockRecord};
use crate::error::TierError;

/// Jobs that may wait for the thread.
const QUEUE: usize = 1024;
/// Writes sent in one pipeline.
const WRITE_BATCH: usize = 64;
/// Pause between reconnection attempts while Redis is unreachable.
const RECONNECT_EVERY: Duration = Duration::from_secs(1);

/// Where the shared tier lives and what its blocks are.
#[derive(Debug, Clone)]
pub struct RemoteSetup {
    /// `redis://HOST:PORT[/DB]`.
    pub url: String,
    /// Seconds a block lives in Redis after it is written.
    pub ttl_s: u64,
    /// The model and KV layout fingerprint every record must carry.
    pub fingerprint: u128,
    /// Bytes of a block's payload.
    pub payload_len: usize,
    /// Longest wait for a connection or a command.
    pub timeout: Duration,
}

/// A fetch answered: the verified payloads of the leading blocks found, in order.
#[derive(Debug)]
pub struct FetchDone {
    pub ticket: u64,
    pub payloads: Vec<Vec<u8>>,
}

/// What the shared tier did, for metrics.
#[derive(Debug, Default)]
pub struct RemoteStats {
    /// Blocks written.
    pub stores: AtomicU64,
    /// Fetches answered (hits or not).
    pub fetches: AtomicU64,
    /// Blocks fetched and verified.
    pub fetched_blocks: AtomicU64,
    /// Commands that failed (connection refused or lost, timeout, Redis error).
    pub errors: AtomicU64,
    /// Records that failed a check and were deleted.
    pub corrupt: AtomicU64,
    /// Jobs dropped because the queue was full or Redis unreachable.
    pub dropped: AtomicU64,
    /// 1 while connected.
    pub connected: AtomicU64,
}

enum Job {
    Put {
        key: String,
        record: Vec<u8>,
    },
    Fetch {
        ticket: u64,
        blocks: Vec<(String, BlockRecord)>,
    },
}

/// The shared tier's thread and its queues.
pub struct RemoteWorker {
    tx: Option<SyncSender<Job>>,
    done: Receiver<FetchDone>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<RemoteStats>,
}

impl std::fmt::Debug for RemoteWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteWorker").finish_non_exhaustive()
    }
}

impl RemoteWorker {
    /// Starts the thread. The URL is checked now; Redis itself may be down (it is tried when needed).
    pub fn start(setup: RemoteSetup) -> Result<Self, TierError> {
        let client = redis::Client::open(setup.url.as_str())
            .map_err(|e| TierError::BadConfig(format!("--kv-redis-url {:?}: {e}", setup.url)))?;
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let (done_tx, done) = mpsc::channel();
        let stats = Arc::new(RemoteStats::default());
        let mut thread = Thread {
            setup,
            client,
            conn: None,
            retry_at: Instant::now(),
            stats: stats.clone(),
            done: done_tx,
        };
        let handle = std::thread::Builder::new()
            .name("kura-kv-redis".into())
            .spawn(move || thread.run(rx))
            .map_err(|e| TierError::BadConfig(format!("cannot start the Redis thread: {e}")))?;
        Ok(Self {
            tx: Some(tx),
            done,
            thread: Some(handle),
            stats,
        })
    }

    pub fn stats(&self) -> &Arc<RemoteStats> {
        &self.stats
    }

    fn offer(&self, job: Job) -> bool {
        let Some(tx) = &self.tx else { return false };
        match tx.try_send(job) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Queues a write of `record` under `key`; `false` (dropped) when the queue is full.
    pub fn try_put(&self, key: String, record: Vec<u8>) -> bool {
        self.offer(Job::Put { key, record })
    }

    /// Queues a fetch of `blocks` (key, expected record), a prompt's leading blocks in order; its answer
    /// comes back from [`RemoteWorker::poll`] under `ticket`. `false` when the queue is full.
    pub fn try_fetch(&self, ticket: u64, blocks: Vec<(String, BlockRecord)>) -> bool {
        self.offer(Job::Fetch { ticket, blocks })
    }

    /// Fetches answered since the last call.
    pub fn poll(&self) -> Vec<FetchDone> {
        let mut out = Vec::new();
        loop {
            match self.done.try_recv() {
                Ok(d) => out.push(d),
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => return out,
            }
        }
    }
}

impl Drop for RemoteWorker {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it has run what was queued.
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Thread {
    setup: RemoteSetup,
    client: redis::Client,
    conn: Option<redis::Connection>,
    retry_at: Instant,
    stats: Arc<RemoteStats>,
    done: mpsc::Sender<FetchDone>,
}

impl Thread {
    fn run(&mut self, rx: Receiver<Job>) {
        while let Ok(first) = rx.recv() {
            let mut puts = Vec::new();
            let mut next = Some(first);
            while let Some(job) = next.take() {
                match job {
                    Job::Put { key, record } => puts.push((key, record)),
                    Job::Fetch { ticket, blocks } => {
                        self.write(std::mem::take(&mut puts));
                        let payloads = self.fetch(&blocks);
                        let _ = self.done.send(FetchDone { ticket, payloads });
                    }
                }
                if puts.len() >= WRITE_BATCH {
                    self.write(std::mem::take(&mut puts));
                }
                next = rx.try_recv().ok();
            }
            self.write(puts);
        }
    }

    /// The connection, connecting if none and the last failure is old enough.
    fn conn(&mut self) -> Option<&mut redis::Connection> {
        if self.conn.is_none() && Instant::now() >= self.retry_at {
            let timeout = self.setup.timeout;
            let conn = self
                .client
                .get_connection_with_timeout(timeout)
                .and_then(|c| {
                    c.set_read_timeout(Some(timeout))?;
                    c.set_write_timeout(Some(timeout))?;
                    Ok(c)
                });
            match conn {
                Ok(c) => {
                    tracing::info!(url = %self.setup.url, "Redis KV tier (L4): connected");
                    self.stats.connected.store(1, Ordering::Relaxed);
                    self.conn = Some(c);
                }
                Err(e) => self.failed(&e),
            }
        }
        self.conn.as_mut()
    }

    fn failed(&mut self, e: &redis::RedisError) {
        if self.conn.is_some() || self.stats.connected.load(Ordering::Relaxed) == 1 {
            tracing::warn!(url = %self.setup.url, error = %e,
                "Redis KV tier (L4) unavailable: serving from the local tiers, retrying every second");
        }
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        self.stats.connected.store(0, Ordering::Relaxed);
        self.conn = None;
        self.retry_at = Instant::now() + RECONNECT_EVERY;
    }

    fn write(&mut self, puts: Vec<(String, Vec<u8>)>) {
        if puts.is_empty() {
            return;
        }
        let ttl = self.setup.ttl_s;
        let n = puts.len() as u64;
        let Some(conn) = self.conn() else {
            self.stats.dropped.fetch_add(n, Ordering::Relaxed);
            return;
        };
        let mut pipe = redis::pipe();
        for (key, record) in &puts {
            pipe.cmd("SET")
                .arg(key)
                .arg(record.as_slice())
                .arg("EX")
                .arg(ttl)
                .ignore();
        }
        match pipe.query::<()>(conn) {
            Ok(()) => {
                self.stats.stores.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                self.stats.dropped.fetch_add(n, Ordering::Relaxed);
                self.failed(&e);
            }
        }
    }

    /// The verified payloads of the leading blocks found.
    fn fetch(&mut self, blocks: &[(String, BlockRecord)]) -> Vec<Vec<u8>> {
        self.stats.fetches.fetch_add(1, Ordering::Relaxed);
        if blocks.is_empty() {
            return Vec::new();
        }
        let (fingerprint, payload_len) = (self.setup.fingerprint, self.setup.payload_len);
        let Some(conn) = self.conn() else {
            return Vec::new();
        };
        let keys: Vec<&str> = blocks.iter().map(|(k, _)| k.as_str()).collect();
        let values: Vec<Option<Vec<u8>>> = match redis::cmd("MGET").arg(&keys).query(conn) {
            Ok(v) => v,
            Err(e) => {
                self.failed(&e);
                return Vec::new();
            }
        };
        let mut payloads = Vec::new();
        let mut corrupt = Vec::new();
        for ((key, expect), value) in blocks.iter().zip(values) {
            let Some(bytes) = value else { break };
            match decode_record(&bytes, fingerprint, payload_len, expect) {
                Ok(payload) => payloads.push(payload.to_vec()),
                Err(check) => {
                    tracing::warn!(key = %key, problem = %check, "Redis KV tier: a stored block failed its checks; deleting it");
                    corrupt.push(key.as_str());
                    break;
                }
            }
        }
        if !corrupt.is_empty() {
            self.stats
                .corrupt
                .fetch_add(corrupt.len() as u64, Ordering::Relaxed);
            if let Some(conn) = self.conn.as_mut() {
                let _ = redis::cmd("DEL").arg(&corrupt).query::<()>(conn);
            }
        }
        self.stats
            .fetched_blocks
            .fetch_add(payloads.len() as u64, Ordering::Relaxed);
        payloads
    }
}
