//! `RemoteWorker`: the bytes of the shared tier (L4) in Redis, on a thread of their own.
//!
//! A block is one Redis string: the same self-describing, checksummed record as a disk block file
//! ([`crate::disk::encode_record`]), followed by a keyed MAC, under a key the caller chooses (Kura's
//! engine uses `kura:kv:{<root name>}:<content name>`: the hash tag keeps a cache key's blocks on one
//! Redis Cluster shard, so that one pipeline fetches a prompt's blocks). The stored value is
//!
//! ```text
//! record (encode_record, header_len + payload_len bytes) ‖ mac (32 bytes)
//! mac = BLAKE3-keyed(mac_key, "kura redis kv record v1\0" ‖ u64le(len(redis key)) ‖ redis key ‖ record)
//! ```
//!
//! `mac_key` is derived from the fleet's secret ([`RemoteSetup::MAC_PURPOSE`]). The record's own
//! checksums are unkeyed: they catch damage, not forgery. The MAC is what makes a value written by
//! anyone without the fleet's secret, or a valid value copied under another key, fail: the key is inside
//! it. It is checked (in constant time) before anything of the record is decoded.
//!
//! Writes are `SET … EX ttl`, pipelined in batches. A fetch is one pipeline of `GETRANGE key 0 N` for a
//! prompt's leading blocks, N being the exact length a valid value has: Redis never sends more than N + 1
//! bytes of a value, so a longer one is refused as wrong-sized without being read. The answers are
//! verified in order and cut at the first block missing or refused; a refused value (wrong type or size,
//! failed MAC: `rejected`; a good MAC but a failed record check: `corrupt`) is deleted and counted.
//!
//! `rediss://` URLs connect over TLS (rustls, ring), verifying the server against the system's roots or
//! the PEM file [`RemoteSetup::ca_file`]. The URL's user and password are never printed: logs and errors
//! show [`redact_url`]'s form.
//!
//! Redis is a cache here, never a dependency: the engine never waits on this thread. Jobs are offered
//! with `try_*` and dropped (counted) when the queue is full; a connection failure answers fetches as
//! misses and drops writes until a reconnection, tried at most once a second, succeeds; every command has
//! a timeout. A write that is not stored — dropped while Redis is unreachable, lost with the connection,
//! or answered with an error (`OOM` under `noeviction`, a read-only replica) — is reported back by its
//! tag ([`RemoteWorker::failed_puts`]), so that the caller may write it again later; an error reply
//! fails only its own write, not the connection. A fetch still queued when its caller's deadline has
//! passed is answered empty without being run. Costs: a write copies the record once into the job; a
//! fetch moves each payload once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use std::io::Write;
use std::path::PathBuf;

use redis::ConnectionLike;

use crate::disk::{block_file_bytes, decode_record, BlockRecord};
use crate::error::TierError;

/// Jobs that may wait for the thread.
const QUEUE: usize = 1024;
/// Writes sent in one pipeline.
const WRITE_BATCH: usize = 64;
/// Pause between reconnection attempts while Redis is unreachable.
const RECONNECT_EVERY: Duration = Duration::from_secs(1);

/// Bytes of the MAC that follows every record in Redis.
pub const MAC_LEN: usize = 32;
/// Domain tag at the start of every MAC's input.
const MAC_DOMAIN: &[u8] = b"kura redis kv record v1\0";

/// Where the shared tier lives and what its blocks are. Its `Debug` hides the URL's user and password
/// and the MAC key.
#[derive(Clone)]
pub struct RemoteSetup {
    /// `redis://[USER:PASSWORD@]HOST:PORT[/DB]`, or `rediss://…` for TLS.
    pub url: String,
    /// Seconds a block lives in Redis after it is written.
    pub ttl_s: u64,
    /// The model and KV layout fingerprint every record must carry.
    pub fingerprint: u128,
    /// Bytes of a block's payload.
    pub payload_len: usize,
    /// Longest wait for a connection or a command.
    pub timeout: Duration,
    /// Key of the records' MACs: the fleet secret's key for [`RemoteSetup::MAC_PURPOSE`].
    pub mac_key: [u8; 32],
    /// PEM file of the CA(s) that sign the Redis server's certificate (`rediss://` only); `None`: the
    /// system's roots.
    pub ca_file: Option<PathBuf>,
}

impl RemoteSetup {
    /// The purpose a fleet secret's key for record MACs is derived for.
    pub const MAC_PURPOSE: &'static str = "kura 2026 redis kv record mac";
}

impl std::fmt::Debug for RemoteSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteSetup")
            .field("url", &redact_url(&self.url))
            .field("ttl_s", &self.ttl_s)
            .field("fingerprint", &format_args!("{:032x}", self.fingerprint))
            .field("payload_len", &self.payload_len)
            .field("timeout", &self.timeout)
            .field("mac_key", &format_args!(".."))
            .field("ca_file", &self.ca_file)
            .finish()
    }
}

/// `url` fit to print: the user and password (everything between `://` and the last `@`) become `***`,
/// and so does every query parameter's value but `db` and `protocol` (a `redis+unix` URL may carry
/// `pass=`). Text that is not `SCHEME://…` shows as `<unparseable URL>`, or with everything before its
/// last `@` as `***`. Control characters become `?`. Never panics.
pub fn redact_url(url: &str) -> String {
    let clean = |s: &str| -> String {
        s.chars()
            .map(|c| if c.is_control() { '?' } else { c })
            .collect()
    };
    let scheme_ok = |scheme: &str| {
        let mut chars = scheme.chars();
        chars.next().is_some_and(|c| c.is_ascii_alphabetic())
            && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    };
    let Some((scheme, rest)) = url.split_once("://").filter(|(s, _)| scheme_ok(s)) else {
        return match url.rfind('@') {
            Some(at) => format!("***{}", clean(&url[at..])),
            None => "<unparseable URL>".to_string(),
        };
    };
    let mut out = format!("{scheme}://");
    let rest = match rest.rfind('@') {
        Some(at) => {
            out.push_str("***");
            &rest[at..]
        }
        None => rest,
    };
    let (before_fragment, fragment) = match rest.split_once('#') {
        Some((b, f)) => (b, Some(f)),
        None => (rest, None),
    };
    let (path, query) = match before_fragment.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (before_fragment, None),
    };
    out.push_str(path);
    if let Some(query) = query {
        out.push('?');
        let params: Vec<String> = query
            .split('&')
            .map(|param| match param.split_once('=') {
                Some((name, value)) if matches!(name, "db" | "protocol") => {
                    format!("{name}={value}")
                }
                Some((name, _)) => format!("{name}=***"),
                None => param.to_string(),
            })
            .collect();
        out.push_str(&params.join("&"));
    }
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(if fragment == "insecure" {
            fragment
        } else {
            "***"
        });
    }
    clean(&out)
}

fn mac_of(mac_key: &[u8; 32], redis_key: &str, record: &[u8]) -> blake3::Hash {
    let mut h = blake3::Hasher::new_keyed(mac_key);
    h.update(MAC_DOMAIN);
    h.update(&(redis_key.len() as u64).to_le_bytes());
    h.update(redis_key.as_bytes());
    h.update(record);
    h.finalize()
}

/// The MAC stored after `record` under `redis_key` (see the module doc for its input).
pub fn record_mac(mac_key: &[u8; 32], redis_key: &str, record: &[u8]) -> [u8; MAC_LEN] {
    *mac_of(mac_key, redis_key, record).as_bytes()
}

/// The record of a value read from `redis_key` (`record ‖ mac`), if its MAC is right; compared in
/// constant time. `None` for a value shorter than a MAC.
pub fn verify_value<'a>(mac_key: &[u8; 32], redis_key: &str, value: &'a [u8]) -> Option<&'a [u8]> {
    let split = value.len().checked_sub(MAC_LEN)?;
    let (record, mac) = value.split_at(split);
    let mac: &[u8; MAC_LEN] = mac.try_into().ok()?;
    // blake3::Hash's equality with a byte array is constant-time.
    (mac_of(mac_key, redis_key, record) == *mac).then_some(record)
}

/// A record and its MAC, sent as one Redis argument without copying them together first.
struct Sealed<'a> {
    record: &'a [u8],
    mac: [u8; MAC_LEN],
}

impl redis::ToRedisArgs for Sealed<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        let mut w = out.writer_for_next_arg();
        // Writing to the command's in-memory buffer cannot fail.
        let _ = w.write_all(self.record);
        let _ = w.write_all(&self.mac);
    }
}

/// The client for `setup`: its URL parsed, TLS set up for `rediss://` (with `ca_file`'s roots if given).
fn client(setup: &RemoteSetup, shown: &str) -> Result<redis::Client, TierError> {
    use redis::IntoConnectionInfo;
    let bad = |what: String| TierError::BadConfig(format!("--kv-redis-url {shown}: {what}"));
    let info = setup
        .url
        .as_str()
        .into_connection_info()
        .map_err(|e| bad(e.to_string()))?;
    let tls = match &info.addr {
        redis::ConnectionAddr::TcpTls { insecure, .. } => {
            if *insecure {
                return Err(bad("#insecure (no certificate verification) is not supported: give                      the CA that signs the server's certificate with --kv-redis-ca-file"
                    .into()));
            }
            // The process's rustls provider, unless one is installed already.
            let _ = rustls::crypto::ring::default_provider().install_default();
            true
        }
        redis::ConnectionAddr::Tcp(host, _) => {
            if !matches!(host.as_str(), "127.0.0.1" | "localhost" | "::1" | "[::1]") {
                tracing::warn!(url = %shown,
                    "Redis KV tier (L4) without TLS: records and the password cross the network in                      clear; use rediss://");
            }
            false
        }
        redis::ConnectionAddr::Unix(_) => false,
    };
    match &setup.ca_file {
        None => redis::Client::open(info).map_err(|e| bad(e.to_string())),
        Some(path) => {
            if !tls {
                return Err(TierError::BadConfig(format!(
                    "--kv-redis-ca-file {} is for a TLS connection, but --kv-redis-url {shown} is                      not rediss://",
                    path.display()
                )));
            }
            // A CA bundle is a few hundred KB at most; never a FIFO (the server would wait on it).
            let pem = kura_files::read(path, 16 << 20).map_err(|source| TierError::Io {
                op: "cannot read --kv-redis-ca-file",
                path: path.clone(),
                source,
            })?;
            if !pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
                return Err(TierError::BadConfig(format!(
                    "--kv-redis-ca-file {} holds no PEM certificate",
                    path.display()
                )));
            }
            let certs = redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem),
            };
            redis::Client::build_with_tls(info, certs).map_err(|e| {
                TierError::BadConfig(format!("--kv-redis-ca-file {}: {e}", path.display()))
            })
        }
    }
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
    /// Values refused before decoding, and deleted: a failed MAC (written without the fleet's key, or
    /// copied under another name), a size other than a valid value's, or not a string.
    pub rejected: AtomicU64,
    /// Values with a good MAC whose record then failed a check (another fingerprint, block or payload
    /// checksum), deleted.
    pub corrupt: AtomicU64,
    /// Jobs dropped because the queue was full or Redis unreachable, writes refused with an error
    /// reply, and fetches whose deadline passed before they ran.
    pub dropped: AtomicU64,
    /// 1 while connected.
    pub connected: AtomicU64,
}

enum Job {
    Put(Put),
    Fetch {
        ticket: u64,
        blocks: Vec<(String, BlockRecord)>,
        /// When the caller stops waiting for the answer: a fetch reached after it is not run.
        deadline: Instant,
    },
}

/// A write: its caller's tag (reported back if the write fails), the Redis key and the record.
struct Put {
    tag: u128,
    key: String,
    record: Vec<u8>,
}

/// The shared tier's thread and its queues.
pub struct RemoteWorker {
    tx: Option<SyncSender<Job>>,
    done: Receiver<FetchDone>,
    /// Tags of writes that were not stored.
    failed: Receiver<u128>,
    /// Tags taken off `failed` by [`RemoteWorker::wait_failed_put`], for the next `failed_puts`.
    waited: std::sync::Mutex<Vec<u128>>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<RemoteStats>,
}

impl std::fmt::Debug for RemoteWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteWorker").finish_non_exhaustive()
    }
}

impl RemoteWorker {
    /// Starts the thread. The URL and the CA file are checked now; Redis itself may be down (it is
    /// tried when needed).
    pub fn start(setup: RemoteSetup) -> Result<Self, TierError> {
        let shown_url = redact_url(&setup.url);
        let client = client(&setup, &shown_url)?;
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let (done_tx, done) = mpsc::channel();
        let (failed_tx, failed) = mpsc::channel();
        let stats = Arc::new(RemoteStats::default());
        let mut thread = Thread {
            setup,
            shown_url,
            client,
            conn: None,
            retry_at: Instant::now(),
            stats: stats.clone(),
            done: done_tx,
            failed: failed_tx,
            error_replies: false,
        };
        let handle = std::thread::Builder::new()
            .name("kura-kv-redis".into())
            .spawn(move || thread.run(rx))
            .map_err(|e| TierError::BadConfig(format!("cannot start the Redis thread: {e}")))?;
        Ok(Self {
            tx: Some(tx),
            done,
            waited: std::sync::Mutex::new(Vec::new()),
            failed,
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

    /// Queues a write of `record` under `key`; `false` (dropped) when the queue is full. If the write is
    /// queued but then not stored, `tag` comes back from [`RemoteWorker::failed_puts`].
    pub fn try_put(&self, tag: u128, key: String, record: Vec<u8>) -> bool {
        self.offer(Job::Put(Put { tag, key, record }))
    }

    /// Queues a fetch of `blocks` (key, expected record), a prompt's leading blocks in order; its answer
    /// comes back from [`RemoteWorker::poll`] under `ticket`: empty, without asking Redis, if the thread
    /// reaches it only after `deadline` (its caller has stopped waiting). `false` when the queue is full.
    pub fn try_fetch(
        &self,
        ticket: u64,
        blocks: Vec<(String, BlockRecord)>,
        deadline: Instant,
    ) -> bool {
        self.offer(Job::Fetch {
            ticket,
            blocks,
            deadline,
        })
    }

    /// Tags of the writes queued and then not stored (Redis unreachable, the connection lost, or an
    /// error reply) since the last call.
    pub fn failed_puts(&self) -> Vec<u128> {
        let mut tags = std::mem::take(&mut *self.waited.lock().unwrap_or_else(|p| p.into_inner()));
        tags.extend(self.failed.try_iter());
        tags
    }

    /// Waits up to `timeout` for the Redis thread to report a write not stored (kept for the next
    /// [`RemoteWorker::failed_puts`]); whether one came.
    pub fn wait_failed_put(&self, timeout: Duration) -> bool {
        match self.failed.recv_timeout(timeout) {
            Ok(tag) => {
                self.waited
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(tag);
                true
            }
            Err(_) => false,
        }
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
    /// The URL as logs show it.
    shown_url: String,
    client: redis::Client,
    conn: Option<redis::Connection>,
    retry_at: Instant,
    stats: Arc<RemoteStats>,
    done: mpsc::Sender<FetchDone>,
    failed: mpsc::Sender<u128>,
    /// Whether the last write pipeline had an error reply (logged once per run of them).
    error_replies: bool,
}

impl Thread {
    fn run(&mut self, rx: Receiver<Job>) {
        while let Ok(first) = rx.recv() {
            let mut puts = Vec::new();
            let mut next = Some(first);
            while let Some(job) = next.take() {
                match job {
                    Job::Put(put) => puts.push(put),
                    Job::Fetch {
                        ticket,
                        blocks,
                        deadline,
                    } => {
                        self.write(std::mem::take(&mut puts));
                        // Its caller has given up on it: its answer would be ignored.
                        let payloads = if Instant::now() >= deadline {
                            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                            Vec::new()
                        } else {
                            self.fetch(&blocks)
                        };
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
                    tracing::info!(url = %self.shown_url, "Redis KV tier (L4): connected");
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
            tracing::warn!(url = %self.shown_url, error = %e,
                "Redis KV tier (L4) unavailable: serving from the local tiers, retrying every second");
        }
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        self.stats.connected.store(0, Ordering::Relaxed);
        self.conn = None;
        self.retry_at = Instant::now() + RECONNECT_EVERY;
    }

    /// Reports writes that were not stored (their tags back to the caller).
    fn not_stored<'a>(&self, puts: impl IntoIterator<Item = &'a Put>) {
        for put in puts {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            // The receiver lives as long as the worker, which joins this thread before dropping it.
            let _ = self.failed.send(put.tag);
        }
    }

    fn write(&mut self, puts: Vec<Put>) {
        if puts.is_empty() {
            return;
        }
        let ttl = self.setup.ttl_s;
        let mac_key = self.setup.mac_key;
        let Some(conn) = self.conn() else {
            self.not_stored(&puts);
            return;
        };
        let mut pipe = redis::pipe();
        for put in &puts {
            let sealed = Sealed {
                record: &put.record,
                mac: record_mac(&mac_key, &put.key, &put.record),
            };
            pipe.cmd("SET").arg(&put.key).arg(sealed).arg("EX").arg(ttl);
        }
        // Read as raw replies, so that an error reply (OOM under `noeviction`, a read-only replica)
        // fails its own write and leaves the connection up.
        let replies = match conn.req_packed_commands(&pipe.get_packed_pipeline(), 0, puts.len()) {
            Ok(replies) => replies,
            Err(e) => {
                self.failed(&e);
                self.not_stored(&puts);
                return;
            }
        };
        let mut refused = Vec::new();
        let mut first_error = None;
        for (put, reply) in puts.iter().zip(&replies) {
            match reply {
                redis::Value::ServerError(e) => {
                    first_error.get_or_insert_with(|| e.clone());
                    refused.push(put);
                }
                _ => {
                    self.stats.stores.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        // Fewer replies than writes: the rest were not confirmed.
        refused.extend(puts.iter().skip(replies.len()));
        match &first_error {
            Some(e) if !self.error_replies => {
                tracing::warn!(url = %self.shown_url, code = %e.code(), refused = refused.len(),
                    "Redis KV tier (L4) refused writes (each is written again when its block is next computed or loaded)");
            }
            Some(e) => {
                tracing::debug!(code = %e.code(), refused = refused.len(), "Redis KV tier (L4) refused writes");
            }
            None => {}
        }
        self.error_replies = first_error.is_some();
        if !refused.is_empty() {
            self.stats
                .errors
                .fetch_add(refused.len() as u64, Ordering::Relaxed);
        }
        self.not_stored(refused);
    }

    /// The verified payloads of the leading blocks found.
    fn fetch(&mut self, blocks: &[(String, BlockRecord)]) -> Vec<Vec<u8>> {
        self.stats.fetches.fetch_add(1, Ordering::Relaxed);
        if blocks.is_empty() {
            return Vec::new();
        }
        let (fingerprint, payload_len) = (self.setup.fingerprint, self.setup.payload_len);
        let mac_key = self.setup.mac_key;
        // The exact length of each valid value. GETRANGE's end is inclusive: a longer value comes back
        // as `want + 1` bytes, the rest unread.
        let wants: Vec<usize> = blocks
            .iter()
            .map(|(_, rec)| {
                usize::try_from(block_file_bytes(rec.tokens.len(), payload_len))
                    .unwrap_or(usize::MAX - MAC_LEN)
                    + MAC_LEN
            })
            .collect();
        let mut pipe = redis::pipe();
        for ((key, _), want) in blocks.iter().zip(&wants) {
            pipe.cmd("GETRANGE").arg(key).arg(0).arg(*want);
        }
        let Some(conn) = self.conn() else {
            return Vec::new();
        };
        // Read as raw replies, so that one key holding another type (a server error reply) refuses
        // that block instead of failing the connection.
        let values = match conn.req_packed_commands(&pipe.get_packed_pipeline(), 0, blocks.len()) {
            Ok(v) => v,
            Err(e) => {
                self.failed(&e);
                return Vec::new();
            }
        };
        let mut payloads = Vec::new();
        let mut refused = None;
        for (((key, expect), want), value) in blocks.iter().zip(&wants).zip(values) {
            let bytes = match value {
                redis::Value::BulkString(b) => b,
                redis::Value::Nil => break,
                other => {
                    tracing::warn!(key = %key, reply = ?kind_of(&other),
                        "Redis KV tier: a stored block is not a string; deleting it");
                    refused = Some((key.as_str(), &self.stats.rejected));
                    break;
                }
            };
            // GETRANGE answers an empty string for a missing key.
            if bytes.is_empty() {
                break;
            }
            if bytes.len() != *want {
                let got = if bytes.len() > *want {
                    format!("more than {want}")
                } else {
                    bytes.len().to_string()
                };
                tracing::warn!(key = %key, bytes = %got, expected = want,
                    "Redis KV tier: a stored block has the wrong size; deleting it");
                refused = Some((key.as_str(), &self.stats.rejected));
                break;
            }
            let Some(record) = verify_value(&mac_key, key, &bytes) else {
                tracing::warn!(key = %key,
                    "Redis KV tier: a stored block failed its MAC (written without the fleet secret, \
                     or copied from another key); deleting it");
                refused = Some((key.as_str(), &self.stats.rejected));
                break;
            };
            match decode_record(record, fingerprint, payload_len, expect) {
                Ok(payload) => payloads.push(payload.to_vec()),
                Err(check) => {
                    tracing::warn!(key = %key, problem = %check, "Redis KV tier: a stored block failed its checks; deleting it");
                    refused = Some((key.as_str(), &self.stats.corrupt));
                    break;
                }
            }
        }
        if let Some((key, counter)) = refused {
            counter.fetch_add(1, Ordering::Relaxed);
            if let Some(conn) = self.conn.as_mut() {
                let _ = redis::cmd("DEL").arg(key).query::<()>(conn);
            }
        }
        self.stats
            .fetched_blocks
            .fetch_add(payloads.len() as u64, Ordering::Relaxed);
        payloads
    }
}

/// The kind of a Redis reply, for a log line (never its content).
fn kind_of(value: &redis::Value) -> &'static str {
    match value {
        redis::Value::ServerError(_) => "error",
        redis::Value::Int(_) => "integer",
        redis::Value::Array(_) | redis::Value::Set(_) | redis::Value::Map(_) => "aggregate",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: [u8; 32] = [7; 32];

    fn sealed(mac_key: &[u8; 32], redis_key: &str, record: &[u8]) -> Vec<u8> {
        let mut v = record.to_vec();
        v.extend_from_slice(&record_mac(mac_key, redis_key, record));
        v
    }

    #[test]
    fn a_value_verifies_under_its_key_and_mac_key_only() {
        let record = b"a record of some bytes".to_vec();
        let value = sealed(&KEY, "kura:kv:{r}:a", &record);
        assert_eq!(value.len(), record.len() + MAC_LEN);
        assert_eq!(
            verify_value(&KEY, "kura:kv:{r}:a", &value),
            Some(record.as_slice())
        );
        // Another MAC key (a writer without the fleet secret), another Redis key (a copy).
        assert_eq!(verify_value(&[8; 32], "kura:kv:{r}:a", &value), None);
        assert_eq!(verify_value(&KEY, "kura:kv:{r}:b", &value), None);
        // Any bit flipped, in the record or in the MAC.
        for i in 0..value.len() {
            let mut bad = value.clone();
            bad[i] ^= 0x10;
            assert_eq!(verify_value(&KEY, "kura:kv:{r}:a", &bad), None, "byte {i}");
        }
        // Truncated, extended, too short to hold a MAC.
        assert_eq!(
            verify_value(&KEY, "kura:kv:{r}:a", &value[..value.len() - 1]),
            None
        );
        let mut longer = value.clone();
        longer.push(0);
        assert_eq!(verify_value(&KEY, "kura:kv:{r}:a", &longer), None);
        assert_eq!(verify_value(&KEY, "kura:kv:{r}:a", &value[..10]), None);
        assert_eq!(verify_value(&KEY, "kura:kv:{r}:a", &[]), None);
    }

    #[test]
    fn the_key_is_length_prefixed_in_the_mac() {
        // Moving a byte between the key and the record changes the MAC.
        assert_ne!(record_mac(&KEY, "ab", b"cd"), record_mac(&KEY, "abc", b"d"));
        assert_ne!(record_mac(&KEY, "", b"abcd"), record_mac(&KEY, "a", b"bcd"));
        // The MAC is keyed BLAKE3 over the documented input.
        let mut input = MAC_DOMAIN.to_vec();
        input.extend_from_slice(&2u64.to_le_bytes());
        input.extend_from_slice(b"ab");
        input.extend_from_slice(b"cd");
        assert_eq!(
            record_mac(&KEY, "ab", b"cd"),
            *blake3::keyed_hash(&KEY, &input).as_bytes()
        );
    }

    #[test]
    fn redact_url_hides_user_and_password() {
        for (url, shown) in [
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
            ("redis://127.0.0.1:6379/2", "redis://127.0.0.1:6379/2"),
            ("redis://:hunter2@host:6379/0", "redis://***@host:6379/0"),
            (
                "rediss://default:hunter2@10.0.0.1:6380",
                "rediss://***@10.0.0.1:6380",
            ),
            ("redis://user@host", "redis://***@host"),
            // A password with reserved characters left unencoded.
            ("rediss://u:p@ss/w#rd@host:1/0", "rediss://***@host:1/0"),
            ("redis://u:p?a=b@host", "redis://***@host"),
            (
                "redis+unix:///tmp/r.sock?db=1&pass=hunter2&user=me",
                "redis+unix:///tmp/r.sock?db=1&pass=***&user=***",
            ),
            (
                "redis://host:1/0?protocol=resp3&password=hunter2",
                "redis://host:1/0?protocol=resp3&password=***",
            ),
            ("rediss://host:1#insecure", "rediss://host:1#insecure"),
            ("rediss://host:1#hunter2", "rediss://host:1#***"),
            ("redis://ü:hünter2@hôst", "redis://***@hôst"),
            ("redis://:pw@host\n:1", "redis://***@host?:1"),
            // Not URLs.
            ("hunter2", "<unparseable URL>"),
            ("", "<unparseable URL>"),
            ("://:hunter2@host", "***@host"),
            ("1redis://:hunter2@host", "***@host"),
            ("user:hunter2@host:6379", "***@host:6379"),
            ("redis:/:hunter2@host", "***@host"),
        ] {
            assert_eq!(redact_url(url), shown, "{url:?}");
            assert!(!redact_url(url).contains("hunter2"), "{url:?}");
        }
    }

    #[test]
    fn redact_url_never_panics() {
        // Every string of up to 5 characters from URL punctuation and multi-byte characters.
        let alphabet = [":", "/", "@", "?", "#", "&", "=", "a", "é", "\u{1F600}"];
        let mut stack = vec![String::new()];
        while let Some(s) = stack.pop() {
            let shown = redact_url(&s);
            if let Some(at) = s.rfind('@') {
                // Whatever came before the last `@` is hidden.
                let before = &s[..at];
                if before.contains('é') {
                    assert!(
                        !shown.contains('é') || s[at..].contains('é'),
                        "{s:?} → {shown:?}"
                    );
                }
            }
            if s.chars().count() < 5 {
                for c in alphabet {
                    stack.push(format!("{s}{c}"));
                }
            }
        }
    }

    #[test]
    fn setup_debug_hides_the_password_and_the_key() {
        let setup = RemoteSetup {
            url: "redis://:hunter2@host:1".into(),
            ttl_s: 1,
            fingerprint: 1,
            payload_len: 1,
            timeout: Duration::from_secs(1),
            mac_key: [0xab; 32],
            ca_file: None,
        };
        let shown = format!("{setup:?}");
        assert!(shown.contains("redis://***@host:1"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(!shown.contains("171"), "{shown}");
    }
}
