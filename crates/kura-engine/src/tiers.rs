//! The engine's side of the lower KV tiers: their bytes. The KV manager decides every move (which block
//! goes down, which is loaded back, which is dropped) and hands the moves over in order
//! ([`kura_kv::TierMove`]); this module carries them out over the executor's pool, the host arena (L2)
//! and the disk store (L3), and reports each load back when its bytes are in place.
//!
//! ```text
//!   scheduler pass ─▶ moves, in order ─▶ TierIo::run ─┬─ Demote / LoadHost: memcpy on the engine thread
//!                                                     ├─ HostToDisk / BlockToDisk / DropDisk: queued to the
//!                                                     │  disk thread (`kura-kv-disk`), never waited for
//!                                                     └─ LoadDisk: read queued; its completion, verified,
//!   next steps ◀─ complete_load(block, ok) ◀─ TierIo::poll ◀─┘  is imported into the block then
//! ```
//!
//! Moves run before the step's forward pass and block copies, in the order given: a block the pool hands
//! out again in the same pass is copied down before anything writes it. A block being loaded from disk is
//! held by the manager's loader until its completion is reported, so nothing else writes it meanwhile; the
//! requests that want it wait for it like for a block another request is computing (one read, any number
//! of waiters). A read that fails its checks (checksum, header, tokens, parent, key) is reported failed:
//! the manager drops the block from the tier and the waiters compute it.
//!
//! On an accelerator the host moves are copies the executor starts on a stream of its own: a store lands
//! before the engine reads its slot (a fence), a load is reported when it lands and waited for like a disk
//! read ([`Executor::start_import`]) — or, where the executor orders every later step after it layer by
//! layer ([`Executor::imports_ordered`]), reported at once, so that the request's forward pass computes
//! its first layers while the copies of the later ones are still under way.
//!
//! Costs: a host move is one block copy (`block_bytes`); a disk write copies the block once into the
//! queued job; a disk read one `block_bytes` buffer.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kura_kv::{BlockHash, OffloadPolicy, Tier, TierBlock, TierConfig, TierMove};
use kura_tiers::{BlockRecord, DiskJob, DiskStats, DiskStore, DiskWorker, HostArena, ReadError};

use crate::backend::{Executor, OrEnd};
use crate::metrics::EngineMetrics;

/// Bytes of block writes that may wait in the disk thread's queue before the engine waits for it.
const MAX_QUEUED_WRITE_BYTES: usize = 256 << 20;

/// The lower tiers `kura serve` was given (sizes in blocks; 0 host blocks and no disk: none).
#[derive(Debug, Clone, Default)]
pub struct TierSetup {
    /// Blocks of the host tier (L2); 0 = off.
    pub host_blocks: u32,
    /// The disk tier (L3), if any.
    pub disk: Option<DiskSetup>,
    pub policy: OffloadPolicy,
    /// Blocks of the pool kept free or already stored in the host tier ahead of their eviction
    /// (`KvCacheManager::store_ahead`), so that a step reusing an evicted block need not wait for its
    /// copy. `None`: the blocks one step can take where the executor's stores run beside its steps (it
    /// pinned the host tier), else none; `Some(0)`: off.
    pub store_ahead: Option<u32>,
}

impl TierSetup {
    /// The sizes and policy as the KV manager takes them.
    pub fn kv_config(&self) -> TierConfig {
        TierConfig {
            host_blocks: self.host_blocks,
            disk_blocks: self.disk.as_ref().map_or(0, |d| d.blocks),
            policy: self.policy,
        }
    }
}

/// Where the disk tier lives and what it may hold.
#[derive(Debug, Clone)]
pub struct DiskSetup {
    pub dir: PathBuf,
    /// Most blocks kept on disk (the budget holds across restarts: blocks found beyond it are dropped).
    pub blocks: u32,
    /// Identity of the model and KV format the blocks were computed with (weights digest, KV dtype and
    /// layout): a file of another fingerprint is never served, and is removed at start.
    pub fingerprint: u128,
}

/// What opening the tiers found: the hash seed the KV manager must use (so that blocks written before a
/// restart are found again) and the blocks on disk, oldest first.
#[derive(Debug)]
pub(crate) struct Restored {
    pub seed: u64,
    pub blocks: Vec<TierBlock>,
}

/// A load reported done: the block, whether its bytes are in place, its tier and how long it took.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LoadDone {
    pub block: u32,
    pub ok: bool,
    pub tier: Tier,
    /// From the load's move to its report, queueing included.
    pub elapsed: Duration,
    /// The load's own I/O: the host copy, or the disk thread's read of the file (the tier's bandwidth);
    /// `None` for a host load the executor orders before later steps ([`Executor::imports_ordered`]),
    /// reported when started: its copy's time comes later ([`TierIo::take_copy_times`]).
    pub io: Option<Duration>,
}

/// Block files read by the disk's start probe (fewer when fewer exist), and at most these bytes (the
/// host probe copies up to the bytes).
const PROBE_BLOCKS: usize = 16;
const PROBE_BYTES: usize = 64 << 20;

/// Loads timed at start, before any request: (tier, bytes, time).
pub(crate) type Probe = (Tier, usize, Duration);

/// The bytes of the lower tiers, owned by the engine thread.
pub(crate) struct TierIo {
    host: Option<HostArena>,
    disk: Option<DiskWorker>,
    block_bytes: usize,
    /// Disk reads in flight: pool block → when the read was queued.
    reads: HashMap<u32, Instant>,
    /// Host-tier loads the executor copies asynchronously ([`Executor::start_import`]), in flight: pool
    /// block → when the copy was started.
    host_loads: HashMap<u32, Instant>,
    /// Host-tier loads the executor orders before later steps ([`Executor::imports_ordered`]), reported
    /// as landed when started, whose copy times are still to come.
    ordered_loads: usize,
    /// Copy times of ordered host loads, for the tier cost check ([`TierIo::take_copy_times`]).
    copy_times: Vec<Duration>,
    /// Scratch for [`Executor::imports_done`].
    imported: Vec<(u32, Duration)>,
    /// Whether the executor has started exports asynchronously ([`Executor::start_export`]), which
    /// may still be copying into host slots: the engine fences a slot's before it reads or writes that
    /// slot itself.
    exports_pending: bool,
    /// Stored blocks found failing a check: at open, and by reads since (each file was deleted).
    pub corrupt_found: u64,
    /// The start probes' timings, for the tier cost check.
    pub probes: Vec<Probe>,
}

/// The manager's record of a block as the disk store names it (the move owned it: its tokens move too).
fn record(b: TierBlock) -> BlockRecord {
    BlockRecord {
        hash: b.hash.0,
        parent_hash: b.parent_hash.0,
        key_digest: b.key_digest.0,
        tokens: b.tokens,
    }
}

/// Times copies out of the host arena (a host load's work, less the executor's side): as many slots
/// as [`PROBE_BYTES`] holds (more than a CPU cache, so that the copy reads memory), written first (fresh
/// pages would read as the zero page) and copied twice, the second copy timed.
fn probe_host(arena: &mut HostArena, block_bytes: usize) -> Option<Probe> {
    let n = arena
        .num_slots()
        .min(PROBE_BYTES / block_bytes.max(1))
        .max(1)
        .min(arena.num_slots());
    if n == 0 || block_bytes == 0 {
        return None;
    }
    for s in 0..n as u32 {
        arena.slot_mut(s).fill(0x5a);
    }
    let mut out = vec![0u8; block_bytes];
    let mut copy = || {
        let t = Instant::now();
        for s in 0..n as u32 {
            out.copy_from_slice(arena.slot(s));
            std::hint::black_box(&out);
        }
        t.elapsed()
    };
    copy();
    Some((Tier::Host, n * block_bytes, copy()))
}

/// Times plain reads of the newest of the disk tier's block files, when there are some: their bytes
/// off the disk (or the page cache, which would serve loads too), without the checks a load runs on
/// them (CPU work on top) and without touching the files: a damaged one is still found, counted and
/// removed when a load reads it.
fn probe_disk(
    store: &DiskStore,
    blocks: &[(BlockRecord, std::time::SystemTime)],
    block_bytes: usize,
) -> Option<Probe> {
    let n = blocks
        .len()
        .min(PROBE_BLOCKS)
        .min(PROBE_BYTES / block_bytes.max(1));
    if n == 0 {
        return None;
    }
    let (mut bytes, mut took) = (0, Duration::ZERO);
    for (rec, _) in &blocks[blocks.len() - n..] {
        let t = Instant::now();
        if let Ok(b) = std::fs::read(store.path_of(rec.hash)) {
            took += t.elapsed();
            bytes += b.len();
        }
    }
    (bytes > 0).then_some((Tier::Disk, bytes, took))
}

impl TierIo {
    /// Allocates the host arena and opens the disk store (rebuilding its index from the files' headers;
    /// damaged and foreign files are removed and counted in the log line and the metrics). With `probe`,
    /// times a few host copies and disk reads for the tier cost check ([`TierIo::probes`]).
    pub fn open(
        setup: &TierSetup,
        block_bytes: usize,
        metrics: &EngineMetrics,
        probe: bool,
    ) -> Result<(TierIo, Option<Restored>), String> {
        let mut probes = Vec::new();
        let host = if setup.host_blocks > 0 {
            let mut arena = HostArena::new(setup.host_blocks as usize, block_bytes)
                .map_err(|e| format!("host KV tier: {e}"))?;
            if probe {
                probes.extend(probe_host(&mut arena, block_bytes));
            }
            Some(arena)
        } else {
            None
        };
        let mut restored = None;
        let mut corrupt_found = 0;
        let disk = match &setup.disk {
            Some(d) => {
                let (store, report) = DiskStore::open(&d.dir, d.fingerprint, block_bytes)
                    .map_err(|e| format!("disk KV tier: {e}"))?;
                tracing::info!(
                    dir = %d.dir.display(),
                    blocks_found = report.blocks.len(),
                    bytes_found = report.bytes,
                    removed_corrupt = report.removed_corrupt,
                    removed_foreign = report.removed_foreign,
                    removed_tmp = report.removed_tmp,
                    scan_ms = report.elapsed.as_millis() as u64,
                    "disk KV tier opened"
                );
                if report.removed_foreign > 0 {
                    tracing::warn!(
                        dir = %d.dir.display(),
                        removed_foreign = report.removed_foreign,
                        "disk KV tier: deleted {} block files of another KV fingerprint or of a lost \
                         hash seed: the model, its weights or compute format, the KV format, layout or \
                         block size, or Kura's KV encoding changed since they were written, or the \
                         directory's meta file kura-kv-disk was deleted; their blocks are computed \
                         again when needed",
                        report.removed_foreign
                    );
                }
                corrupt_found = report.removed_corrupt;
                probes.extend(
                    probe
                        .then(|| probe_disk(&store, &report.blocks, block_bytes))
                        .flatten(),
                );
                metrics.disk_removed_foreign.add(report.removed_foreign);
                restored = Some(Restored {
                    seed: store.seed(),
                    blocks: report
                        .blocks
                        .into_iter()
                        .map(|(r, _)| TierBlock {
                            hash: BlockHash(r.hash),
                            parent_hash: BlockHash(r.parent_hash),
                            key_digest: BlockHash(r.key_digest),
                            tokens: r.tokens,
                        })
                        .collect(),
                });
                Some(DiskWorker::start(Arc::new(store)))
            }
            None => None,
        };
        Ok((
            TierIo {
                host,
                disk,
                block_bytes,
                reads: HashMap::new(),
                host_loads: HashMap::new(),
                ordered_loads: 0,
                copy_times: Vec::new(),
                imported: Vec::new(),
                exports_pending: false,
                corrupt_found,
                probes,
            },
            restored,
        ))
    }

    /// Runs `moves` in order; loads from the host tier finish here and are pushed onto `done`.
    pub fn run(
        &mut self,
        moves: impl IntoIterator<Item = TierMove>,
        exec: &mut dyn Executor,
        done: &mut Vec<LoadDone>,
    ) {
        for m in moves {
            match m {
                TierMove::Demote { block, slot } => {
                    if exec
                        .start_export(block, self.host_mut().slot_mut(slot))
                        .or_end("a store into the host tier")
                    {
                        self.exports_pending = true;
                    } else {
                        // No earlier store may land on top of this one.
                        self.fence_slot(exec, slot);
                        exec.export_block(block, self.host_mut().slot_mut(slot))
                            .or_end("a store into the host tier");
                    }
                }
                TierMove::HostToDisk { slot, record: r } => {
                    // Only the stores into this slot: those into others (a swap-out's, the one the
                    // move before this started) go on while the engine works.
                    self.fence_slot(exec, slot);
                    let payload = self.host_mut().slot(slot).to_vec();
                    self.submit(DiskJob::Write {
                        rec: record(r),
                        payload,
                    });
                }
                TierMove::BlockToDisk { block, record: r } => {
                    let mut payload = vec![0u8; self.block_bytes];
                    exec.export_block(block, &mut payload)
                        .or_end("a store into the disk tier");
                    self.submit(DiskJob::Write {
                        rec: record(r),
                        payload,
                    });
                }
                TierMove::DropDisk { hash } => self.submit(DiskJob::Remove { hash: hash.0 }),
                TierMove::LoadHost { slot, block } => {
                    let started = Instant::now();
                    let host = self
                        .host
                        .as_ref()
                        .expect("the manager loads from the host tier only when it exists");
                    // A started import is ordered after the started exports by the executor.
                    if exec
                        .start_import(block, host.slot(slot))
                        .or_end("a load from the host tier")
                    {
                        if exec.imports_ordered() {
                            // Every later step, block copy and store is ordered after the copy (on
                            // an accelerator, layer by layer): the block counts as loaded now.
                            self.ordered_loads += 1;
                            done.push(LoadDone {
                                block,
                                ok: true,
                                tier: Tier::Host,
                                elapsed: started.elapsed(),
                                io: None,
                            });
                        } else {
                            self.host_loads.insert(block, started);
                        }
                        continue;
                    }
                    self.fence_slot(exec, slot);
                    let host = self.host.as_ref().expect("checked above");
                    exec.import_block(block, host.slot(slot))
                        .or_end("a load from the host tier");
                    let elapsed = started.elapsed();
                    done.push(LoadDone {
                        block,
                        ok: true,
                        tier: Tier::Host,
                        elapsed,
                        io: Some(elapsed),
                    });
                }
                TierMove::LoadDisk { record: r, block } => {
                    self.reads.insert(block, Instant::now());
                    self.submit(DiskJob::Read {
                        rec: record(r),
                        tag: u64::from(block),
                    });
                }
            }
        }
    }

    /// Reports the host copies the executor has finished, imports the disk reads that have come back
    /// (waiting at most `wait` for the first when some are in flight) and pushes them onto `done`.
    pub fn poll(&mut self, exec: &mut dyn Executor, wait: Duration, done: &mut Vec<LoadDone>) {
        if !self.host_loads.is_empty() || self.ordered_loads > 0 {
            // Waits on the host copies only when a request waits for them (ordered loads keep
            // nothing waiting) and no disk read could come back meanwhile.
            let host_wait = if self.reads.is_empty() && !self.host_loads.is_empty() {
                wait
            } else {
                Duration::ZERO
            };
            exec.imports_done(host_wait, &mut self.imported)
                .or_end("a load from the host tier");
            for (block, io) in self.imported.drain(..) {
                let Some(started) = self.host_loads.remove(&block) else {
                    // An ordered load, reported as landed when it started: only its time is new.
                    self.ordered_loads = self
                        .ordered_loads
                        .checked_sub(1)
                        .expect("the executor reports a started import once");
                    self.copy_times.push(io);
                    continue;
                };
                done.push(LoadDone {
                    block,
                    ok: true,
                    tier: Tier::Host,
                    elapsed: started.elapsed(),
                    io: Some(io),
                });
            }
        }
        let Some(disk) = &self.disk else { return };
        if self.reads.is_empty() {
            return;
        }
        let mut next = if wait.is_zero() {
            disk.try_done()
        } else {
            disk.wait_done(wait)
        };
        while let Some(read) = next {
            let block = u32::try_from(read.tag).expect("read tags are pool block ids");
            let queued = self
                .reads
                .remove(&block)
                .expect("a read completes once, for a block that was queued");
            let io = read.elapsed;
            let ok = match read.result {
                Ok(payload) => {
                    exec.import_block(block, &payload)
                        .or_end("a load from the disk tier");
                    true
                }
                Err(ReadError::Corrupt { .. }) => {
                    self.corrupt_found += 1;
                    false
                }
                Err(_) => false,
            };
            done.push(LoadDone {
                block,
                ok,
                tier: Tier::Disk,
                elapsed: queued.elapsed(),
                io: Some(io),
            });
            next = disk.try_done();
        }
    }

    /// The copy times of ordered host loads reported since the last call, for the tier cost check.
    pub fn take_copy_times(&mut self) -> std::vec::Drain<'_, Duration> {
        self.copy_times.drain(..)
    }

    /// Waits for the exports the executor may still be copying into host slot `slot` (those into
    /// other slots go on).
    fn fence_slot(&mut self, exec: &mut dyn Executor, slot: u32) {
        if self.exports_pending {
            let host = self
                .host
                .as_ref()
                .expect("exports go only into the host tier");
            exec.exports_fence_slot(host.slot(slot))
                .or_end("a store into the host tier");
        }
    }

    /// Bytes of one block in every tier.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Loads under way and not reported yet: disk reads, and host copies the executor runs
    /// asynchronously.
    pub fn reads_in_flight(&self) -> usize {
        self.reads.len() + self.host_loads.len()
    }

    /// The disk thread's counters (`None` without a disk tier).
    pub fn disk_stats(&self) -> Option<DiskStats> {
        self.disk.as_ref().map(|d| d.stats())
    }

    /// Disk jobs queued and not finished.
    pub fn disk_queue(&self) -> usize {
        self.disk.as_ref().map_or(0, |d| d.queued_jobs())
    }

    /// Waits until every disk job queued so far has run (shutdown, tests).
    pub fn flush(&self) {
        if let Some(d) = &self.disk {
            d.flush();
        }
    }

    /// The host arena's bytes, when there is a host tier ([`Executor::register_host_region`]).
    pub fn host_region_mut(&mut self) -> Option<&mut [u8]> {
        self.host.as_mut().map(HostArena::region_mut)
    }

    fn host_mut(&mut self) -> &mut HostArena {
        self.host
            .as_mut()
            .expect("the manager moves blocks through the host tier only when it exists")
    }

    fn submit(&self, job: DiskJob) {
        let disk = self
            .disk
            .as_ref()
            .expect("the manager moves blocks to disk only when the disk tier exists");
        if matches!(job, DiskJob::Write { .. }) {
            // Every queued write holds a block's bytes: past the bound, the engine waits for the disk
            // rather than grow without limit (or drop a block the manager counts as stored).
            let max_jobs = (MAX_QUEUED_WRITE_BYTES / self.block_bytes.max(1)).max(16);
            while disk.queued_jobs() >= max_jobs {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        disk.submit(job);
    }
}
