//! `DiskWorker`: one I/O thread that runs the disk tier's jobs in submission order, so that no caller ever
//! waits on the disk.
//!
//! ```text
//!  caller ── submit(job) ──▶ [ job queue, FIFO, unbounded ] ──▶ thread "kura-kv-disk" ──▶ DiskStore
//!  caller ◀── try_done / wait_done ── [ read completions ] ◀──────────┘
//! ```
//!
//! Writes and removes report nothing back: their failures are logged (`tracing::warn!`, naming the file) and
//! counted in [`DiskStats`]. Every read comes back as one [`ReadDone`] carrying the payload or the reason it
//! could not be had. Jobs run strictly in order, so a read submitted after a write of the same block sees
//! that write, and a read submitted after a remove finds the block missing.
//!
//! The queue is unbounded so that `submit` never blocks; callers bound it themselves with
//! [`DiskWorker::queued_jobs`] (every queued write holds its payload in memory).
//!
//! Costs: `submit` one channel send (no I/O, no lock); a read allocates one payload-sized buffer, which the
//! completion hands to the caller.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::disk::{BlockRecord, DiskStore};
use crate::error::ReadError;

/// One unit of work for the disk thread.
#[derive(Debug)]
pub enum DiskJob {
    /// Writes the block (replacing any file of the same hash). `payload` must be the store's payload size.
    Write { rec: BlockRecord, payload: Vec<u8> },
    /// Reads the block, verified against `rec`; the result comes back as a [`ReadDone`] with this `tag`.
    Read { rec: BlockRecord, tag: u64 },
    /// Deletes the block's file, if any.
    Remove { hash: u128 },
}

/// The outcome of a [`DiskJob::Read`].
#[derive(Debug)]
pub struct ReadDone {
    /// The tag the read was submitted with.
    pub tag: u64,
    /// The block read.
    pub hash: u128,
    /// The payload, or why it could not be read (a rejected file has been deleted).
    pub result: Result<Vec<u8>, ReadError>,
    /// Time the thread spent reading and verifying (waiting in the queue excluded).
    pub elapsed: Duration,
}

/// Counters of the jobs run so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskStats {
    /// Blocks written.
    pub writes: u64,
    /// Writes that failed (logged).
    pub write_errors: u64,
    /// Payload bytes written.
    pub write_bytes: u64,
    /// Reads that returned a verified payload.
    pub reads: u64,
    /// Reads that failed: file missing, rejected by a check (and deleted), or an I/O error.
    pub read_errors: u64,
    /// Removes done (including of files that did not exist).
    pub removes: u64,
    /// Removes that failed (logged).
    pub remove_errors: u64,
}

/// What the job queue carries.
enum Msg {
    Job(DiskJob),
    /// Answered when every job queued before it has run.
    Flush(Sender<()>),
}

/// State shared with the thread.
#[derive(Default)]
struct Shared {
    queued: AtomicUsize,
    writes: AtomicU64,
    write_errors: AtomicU64,
    write_bytes: AtomicU64,
    reads: AtomicU64,
    read_errors: AtomicU64,
    removes: AtomicU64,
    remove_errors: AtomicU64,
}

/// The disk tier's I/O thread and its queues. `Send + Sync`.
pub struct DiskWorker {
    /// `None` only while dropping.
    jobs: Option<Sender<Msg>>,
    done: Mutex<Receiver<ReadDone>>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl DiskWorker {
    /// Starts the thread, named `kura-kv-disk`, over `store`.
    ///
    /// # Panics
    /// If the operating system cannot start a thread, as `std::thread::spawn`.
    pub fn start(store: Arc<DiskStore>) -> DiskWorker {
        let (jobs, job_rx) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("kura-kv-disk".into())
            .spawn(move || run(&store, job_rx, done_tx, &thread_shared))
            .expect("cannot start the kura-kv-disk thread");
        DiskWorker {
            jobs: Some(jobs),
            done: Mutex::new(done),
            shared,
            thread: Some(thread),
        }
    }

    /// Queues `job`; never blocks.
    pub fn submit(&self, job: DiskJob) {
        self.shared.queued.fetch_add(1, Ordering::Relaxed);
        let sent = self.jobs.as_ref().map(|j| j.send(Msg::Job(job)));
        if !matches!(sent, Some(Ok(()))) {
            // Only if the thread died (a bug): the job is lost, which a cache survives.
            self.shared.queued.fetch_sub(1, Ordering::Relaxed);
            tracing::warn!("disk tier: the kura-kv-disk thread is gone; a job was dropped");
        }
    }

    /// Jobs submitted and not yet finished (the one running included).
    pub fn queued_jobs(&self) -> usize {
        self.shared.queued.load(Ordering::Relaxed)
    }

    /// The next read completion, if one is ready.
    pub fn try_done(&self) -> Option<ReadDone> {
        self.done_rx().try_recv().ok()
    }

    /// The next read completion, waiting at most `timeout` for one.
    pub fn wait_done(&self, timeout: Duration) -> Option<ReadDone> {
        self.done_rx().recv_timeout(timeout).ok()
    }

    /// Blocks until every job submitted before the call has run (their read completions are then ready).
    pub fn flush(&self) {
        let (ack, acked) = mpsc::channel();
        if let Some(jobs) = &self.jobs {
            if jobs.send(Msg::Flush(ack)).is_ok() {
                // An error means the thread is gone, so nothing is left to wait for.
                let _ = acked.recv();
            }
        }
    }

    /// The counters so far.
    pub fn stats(&self) -> DiskStats {
        let s = &self.shared;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DiskStats {
            writes: get(&s.writes),
            write_errors: get(&s.write_errors),
            write_bytes: get(&s.write_bytes),
            reads: get(&s.reads),
            read_errors: get(&s.read_errors),
            removes: get(&s.removes),
            remove_errors: get(&s.remove_errors),
        }
    }

    fn done_rx(&self) -> std::sync::MutexGuard<'_, Receiver<ReadDone>> {
        // A receiver cannot be left inconsistent by a panic elsewhere: ignore poisoning.
        self.done.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for DiskWorker {
    /// Runs the jobs still queued, then joins the thread.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::warn!("disk tier: the kura-kv-disk thread panicked");
            }
        }
    }
}

/// The thread's loop: runs jobs until every sender is gone.
fn run(store: &DiskStore, jobs: Receiver<Msg>, done: Sender<ReadDone>, shared: &Shared) {
    for msg in jobs {
        match msg {
            Msg::Flush(ack) => {
                let _ = ack.send(());
            }
            Msg::Job(job) => {
                run_job(store, job, &done, shared);
                shared.queued.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

fn run_job(store: &DiskStore, job: DiskJob, done: &Sender<ReadDone>, shared: &Shared) {
    match job {
        DiskJob::Write { rec, payload } => match store.write(&rec, &payload) {
            Ok(()) => {
                shared.writes.fetch_add(1, Ordering::Relaxed);
                shared
                    .write_bytes
                    .fetch_add(payload.len() as u64, Ordering::Relaxed);
            }
            Err(e) => {
                shared.write_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "disk tier: block write failed");
            }
        },
        DiskJob::Read { rec, tag } => {
            let started = Instant::now();
            let mut buf = vec![0u8; store.payload_len()];
            let result = store.read(&rec, &mut buf).map(|()| buf);
            match &result {
                Ok(_) => shared.reads.fetch_add(1, Ordering::Relaxed),
                Err(e) => {
                    if matches!(e, ReadError::Missing { .. }) {
                        tracing::debug!(error = %e, "disk tier: block read failed");
                    } else {
                        tracing::warn!(error = %e, "disk tier: block read failed");
                    }
                    shared.read_errors.fetch_add(1, Ordering::Relaxed)
                }
            };
            // The receiver lives as long as the worker, which joins this thread before dropping it.
            let _ = done.send(ReadDone {
                tag,
                hash: rec.hash,
                result,
                elapsed: started.elapsed(),
            });
        }
        DiskJob::Remove { hash } => match store.remove(hash) {
            Ok(()) => {
                shared.removes.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                shared.remove_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "disk tier: block remove failed");
            }
        },
    }
}
