//! [`EngineHandle`]: the thread-safe front door of the engine. Submitting checks everything that can be
//! checked without the scheduler (sizes against the context and the KV pool, queue length, shutdown)
//! and hands the request to the engine thread over a channel; the returned [`RequestGuard`] cancels the
//! request when dropped, so a caller that goes away (client disconnect, timeout) frees its KV blocks at
//! once without doing anything.
//!
//! The handle also tells whether the engine thread is alive: a panic in the engine (scheduler, kernel,
//! sink) is caught on its thread, recorded here, every request in it fails with
//! [`crate::RequestError::EngineFailed`], and later submits get [`SubmitError::EngineFailed`]. A server
//! learns of it by polling [`EngineHandle::is_alive`] or blocking in [`EngineHandle::wait_exit`].

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::backend::TextCodec;
use crate::kv_events::KvEventLog;
use crate::metrics::EngineMetrics;
use crate::request::{EventSink, GenerateRequest, SubmitError};
use kura_sched::SchedulingPolicy;

/// What the engine serves and how big it is; fixed at start.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    /// The model's name as clients address it (`model` in requests).
    pub model_name: String,
    /// Longest sequence (prompt + generation) the model accepts.
    pub max_model_len: usize,
    pub vocab_size: usize,
    pub block_size_tokens: usize,
    pub num_blocks: usize,
    /// Sliding layers paged apart (a hybrid pool): `num_blocks` is then its logical blocks, and its
    /// pages are what run out first.
    pub window: Option<kura_kv::WindowPool>,
    /// Longest waiting queue before new requests are refused.
    pub max_queue: usize,
    pub prefix_caching: bool,
    /// Whether requests' `priority` counts.
    pub scheduling_policy: SchedulingPolicy,
    /// How long a client may stop reading before its request is cancelled.
    pub stalled_client_timeout: Duration,
    /// The model and KV format's fingerprint (what saved contexts are checked against).
    pub model_fingerprint: String,
}

impl EngineInfo {
    /// The most tokens one sequence can hold in the pool (what submission lets through): its blocks,
    /// and on a hybrid pool the most blocks whose pages, with the window's parts, fit the arena.
    pub fn pool_tokens(&self) -> usize {
        let blocks = match &self.window {
            None => self.num_blocks,
            Some(w) => {
                // Pages grow with blocks: the largest count that fits, by bisection.
                let fits =
                    |b: usize| w.pages_to_hold(b, self.block_size_tokens) <= w.num_pages as usize;
                let (mut lo, mut hi) = (0usize, self.num_blocks);
                while lo < hi {
                    let mid = lo + (hi - lo).div_ceil(2);
                    if fits(mid) {
                        lo = mid;
                    } else {
                        hi = mid - 1;
                    }
                }
                lo
            }
        };
        blocks.saturating_mul(self.block_size_tokens)
    }
}

pub(crate) enum Command {
    Submit {
        id: u64,
        request: Box<GenerateRequest>,
        sink: Box<dyn EventSink>,
    },
    Cancel {
        id: u64,
    },
    /// Fail every request with `ShuttingDown` and refuse nothing new (the handle already does).
    AbortAll,
    /// The cache clock moved: release the pins that expired.
    ClockMoved,
    /// Release the pin of this prefix (a deleted saved context).
    Unpin {
        cache_salt: Option<String>,
        tokens: Vec<u32>,
    },
    /// Take a view of the pool for the operator console (the `limit` largest cached prefixes) and
    /// publish it in [`Shared::inspected`].
    Inspect {
        limit: usize,
    },
    /// Leave the loop; pending requests are failed first.
    Stop,
}

/// How the engine thread's loop ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineExit {
    /// [`EngineHandle::stop`], or every handle dropped.
    Stopped,
    /// The loop panicked; the panic's message. Every request in the engine was failed.
    Failed(String),
}

pub(crate) struct Shared {
    pub(crate) info: EngineInfo,
    pub(crate) metrics: Arc<EngineMetrics>,
    /// Requests submitted and not yet scheduled for the first time (the queue that `max_queue` bounds).
    pub(crate) queued: AtomicUsize,
    pub(crate) shutting_down: AtomicBool,
    /// Added to the wall clock to make the cache clock (see [`EngineHandle::cache_now_ms`]).
    clock_offset_ms: AtomicU64,
    next_id: AtomicU64,
    /// `Some` once the loop has ended; `exit_changed` wakes [`EngineHandle::wait_exit`].
    exit: Mutex<Option<EngineExit>>,
    exit_changed: Condvar,
    /// The pool's content events, when published.
    pub(crate) kv_events: Option<Arc<KvEventLog>>,
    /// The last view of the pool the engine thread took for [`EngineHandle::inspect`].
    pub(crate) inspected: Mutex<Option<Arc<crate::KvInspect>>>,
    /// Tenants' opaque labels in that view.
    pub(crate) labels: crate::inspect::Labels,
}

impl Shared {
    pub(crate) fn new(
        info: EngineInfo,
        metrics: Arc<EngineMetrics>,
        kv_events: Option<Arc<KvEventLog>>,
    ) -> Self {
        Self {
            info,
            metrics,
            queued: AtomicUsize::new(0),
            shutting_down: AtomicBool::new(false),
            clock_offset_ms: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            exit: Mutex::new(None),
            exit_changed: Condvar::new(),
            inspected: Mutex::new(None),
            labels: crate::inspect::Labels::default(),
            kv_events,
        }
    }

    /// The exit state; a poisoned lock still holds a valid `Option` (nothing panics while holding it).
    fn exit(&self) -> MutexGuard<'_, Option<EngineExit>> {
        self.exit.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records how the loop ended (the first record wins) and wakes every waiter.
    pub(crate) fn set_exit(&self, exit: EngineExit) {
        let mut state = self.exit();
        if state.is_none() {
            *state = Some(exit);
        }
        drop(state);
        self.exit_changed.notify_all();
    }

    /// Unix time in ms on the cache clock: the wall clock plus every advance made by
    /// [`EngineHandle::advance_cache_clock`].
    pub(crate) fn cache_now_ms(&self) -> u64 {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        wall.saturating_add(self.clock_offset_ms.load(Ordering::Relaxed))
    }

    pub(crate) fn failure(&self) -> Option<String> {
        match &*self.exit() {
            Some(EngineExit::Failed(reason)) => Some(reason.clone()),
            _ => None,
        }
    }
}

/// A cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    commands: Sender<Command>,
    shared: Arc<Shared>,
    codec: Arc<dyn TextCodec>,
    thread: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("info", &self.shared.info)
            .finish_non_exhaustive()
    }
}

impl EngineHandle {
    pub(crate) fn new(
        commands: Sender<Command>,
        shared: Arc<Shared>,
        codec: Arc<dyn TextCodec>,
        thread: JoinHandle<()>,
    ) -> Self {
        Self {
            commands,
            shared,
            codec,
            thread: Arc::new(Mutex::new(Some(thread))),
        }
    }

    pub fn info(&self) -> &EngineInfo {
        &self.shared.info
    }

    pub fn metrics(&self) -> &EngineMetrics {
        &self.shared.metrics
    }

    /// The pool's content events, when the engine publishes them (`EngineConfig::kv_events`).
    pub fn kv_events(&self) -> Option<&Arc<KvEventLog>> {
        self.shared.kv_events.as_ref()
    }

    pub fn codec(&self) -> &Arc<dyn TextCodec> {
        &self.codec
    }

    /// Unix time in ms on the cache clock, which times pinned prefixes and saved contexts: the wall clock
    /// plus every [`EngineHandle::advance_cache_clock`].
    pub fn cache_now_ms(&self) -> u64 {
        self.shared.cache_now_ms()
    }

    /// Moves the cache clock `ms` forward (never back), so that expiry can be tested without waiting;
    /// pins whose time has come are released at once. Returns the new time.
    pub fn advance_cache_clock(&self, ms: u64) -> u64 {
        let _ =
            self.shared
                .clock_offset_ms
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |o| {
                    Some(o.saturating_add(ms))
                });
        let _ = self.commands.send(Command::ClockMoved);
        self.shared.cache_now_ms()
    }

    /// Releases the pin of the prefix `tokens` of tenant `cache_salt`, if there is one (a saved context
    /// deleted before its expiry): its blocks become ordinary cached blocks.
    pub fn release_pin(&self, cache_salt: Option<String>, tokens: Vec<u32>) {
        let _ = self.commands.send(Command::Unpin { cache_salt, tokens });
    }

    /// The opaque label of the tenant of cache salt `salt`, as [`crate::PrefixView::tenant`] gives it:
    /// a keyed hash of the salt's tenant part, with a key drawn when the engine started.
    pub fn tenant_label(&self, salt: Option<&str>) -> String {
        self.shared.labels.of(salt)
    }

    /// What the pool holds ([`crate::KvInspect`], its `limit` largest cached prefixes), as the engine
    /// thread last took it. Each call asks for a new view, which the engine takes after its current step;
    /// the call does not wait for it unless the last view is older than `fresh` (the first call, or
    /// the first after a pause), and then at most `wait`. A long step (a large prefill) therefore
    /// delays the view, never the caller by more than `wait`. `None`: no view yet.
    pub fn inspect(
        &self,
        limit: usize,
        fresh: Duration,
        wait: Duration,
    ) -> Option<Arc<crate::KvInspect>> {
        let asked = Instant::now();
        let _ = self.commands.send(Command::Inspect { limit });
        let last = || {
            self.shared
                .inspected
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        };
        loop {
            let view = last();
            let recent = view
                .as_ref()
                .is_some_and(|v| asked.saturating_duration_since(v.taken_at) < fresh);
            if recent || asked.elapsed() >= wait {
                return view;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Requests waiting for their first step.
    pub fn queued(&self) -> usize {
        self.shared.queued.load(Ordering::Relaxed)
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shared.shutting_down.load(Ordering::Relaxed)
    }

    /// Whether the engine loop still runs (`false` after a failure, and after [`EngineHandle::stop`]).
    pub fn is_alive(&self) -> bool {
        self.shared.exit().is_none()
    }

    /// Why the engine died, if it did (the panic's message); `None` while it runs and after a normal stop.
    pub fn failure(&self) -> Option<String> {
        self.shared.failure()
    }

    /// Blocks until the engine loop has ended, or `timeout` (if any) has passed (`None`). A server calls
    /// this on a thread of its own to learn of an engine failure at once.
    pub fn wait_exit(&self, timeout: Option<Duration>) -> Option<EngineExit> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut state = self.shared.exit();
        loop {
            if let Some(exit) = &*state {
                return Some(exit.clone());
            }
            state = match deadline {
                None => self
                    .shared
                    .exit_changed
                    .wait(state)
                    .unwrap_or_else(|e| e.into_inner()),
                Some(deadline) => {
                    let left = deadline.checked_duration_since(Instant::now())?;
                    self.shared
                        .exit_changed
                        .wait_timeout(state, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }

    /// Checks `request` and queues it; its events go to `sink`. Dropping the guard cancels it.
    pub fn submit(
        &self,
        request: GenerateRequest,
        sink: impl EventSink,
    ) -> Result<RequestGuard, SubmitError> {
        if let Some(reason) = self.failure() {
            return Err(SubmitError::EngineFailed(reason));
        }
        if self.is_shutting_down() {
            return Err(SubmitError::ShuttingDown);
        }
        check_request(&self.shared.info, &request).inspect_err(|e| {
            if matches!(
                e,
                SubmitError::CannotFit { .. } | SubmitError::CannotFitPages { .. }
            ) {
                self.shared.metrics.requests_rejected_too_large.add(1);
            }
        })?;
        let max_queue = self.shared.info.max_queue;
        // Reserve a queue slot; a concurrent submit may race us past the limit by at most its own slot.
        let waiting = self.shared.queued.fetch_add(1, Ordering::Relaxed);
        if waiting >= max_queue {
            self.shared.queued.fetch_sub(1, Ordering::Relaxed);
            self.shared.metrics.requests_rejected_queue_full.add(1);
            return Err(SubmitError::QueueFull { waiting, max_queue });
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let command = Command::Submit {
            id,
            request: Box::new(request),
            sink: Box::new(sink),
        };
        if self.commands.send(command).is_err() {
            self.shared.queued.fetch_sub(1, Ordering::Relaxed);
            return Err(match self.failure() {
                Some(reason) => SubmitError::EngineFailed(reason),
                None => SubmitError::ShuttingDown,
            });
        }
        Ok(RequestGuard {
            id,
            commands: self.commands.clone(),
        })
    }

    /// Refuses new requests from now on; running ones continue.
    pub fn begin_shutdown(&self) {
        self.shared.shutting_down.store(true, Ordering::Relaxed);
    }

    /// Fails every queued and running request with `ShuttingDown`, freeing their blocks.
    pub fn abort_all(&self) {
        let _ = self.commands.send(Command::AbortAll);
    }

    /// Stops the engine thread (failing anything still in it) and waits for it to exit.
    pub fn stop(&self) {
        self.begin_shutdown();
        let _ = self.commands.send(Command::Stop);
        let thread = self.thread.lock().map(|mut t| t.take()).unwrap_or(None);
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }
}

/// The first of `ids` outside a vocabulary of `vocab_size` tokens.
fn outside_vocab(mut ids: impl Iterator<Item = u32>, vocab_size: usize) -> Option<u32> {
    ids.find(|&t| t as usize >= vocab_size)
}

/// Checks that hold for a request whatever else is running.
fn check_request(info: &EngineInfo, r: &GenerateRequest) -> Result<(), SubmitError> {
    if r.prompt_tokens.is_empty() {
        return Err(SubmitError::EmptyPrompt);
    }
    if r.n == 0 {
        return Err(SubmitError::ZeroChoices);
    }
    // The sampler's own domain (the HTTP API checks its narrower, OpenAI ranges first).
    r.sampling.validate().map_err(SubmitError::BadSampling)?;
    // Token ids the request names, each list against the vocabulary.
    let vocab_size = info.vocab_size;
    if let Some(token_id) = outside_vocab(r.prompt_tokens.iter().copied(), vocab_size) {
        return Err(SubmitError::TokenOutOfVocab {
            token_id,
            vocab_size,
        });
    }
    if let Some(token_id) = outside_vocab(r.sampling.logit_bias.iter().map(|b| b.0), vocab_size) {
        return Err(SubmitError::BiasOutOfVocab {
            token_id,
            vocab_size,
        });
    }
    if let Some(token_id) = outside_vocab(r.sampling.allowed_token_ids.iter().copied(), vocab_size)
    {
        return Err(SubmitError::AllowedOutOfVocab {
            token_id,
            vocab_size,
        });
    }
    let prompt_tokens = r.prompt_tokens.len();
    if prompt_tokens >= info.max_model_len {
        return Err(SubmitError::PromptTooLong {
            prompt_tokens,
            max_model_len: info.max_model_len,
            excess: prompt_tokens + 1 - info.max_model_len,
        });
    }
    let max_tokens = r.max_tokens as usize;
    let total = prompt_tokens + max_tokens;
    if total > info.max_model_len {
        return Err(SubmitError::ContextExceeded {
            prompt_tokens,
            max_tokens,
            max_model_len: info.max_model_len,
            excess: total - info.max_model_len,
        });
    }
    // One choice must fit in the pool on its own; choices beyond the first can wait or be preempted.
    // The last generated token never needs a slot (it is never fed back), hence `total - 1`.
    let needed_tokens = total - 1;
    let needed_blocks = needed_tokens.div_ceil(info.block_size_tokens);
    if needed_blocks > info.num_blocks {
        return Err(SubmitError::CannotFit {
            needed_tokens,
            needed_blocks,
            capacity_tokens: info.num_blocks * info.block_size_tokens,
            total_blocks: info.num_blocks,
        });
    }
    // A hybrid pool's logical blocks are its pages over the full-attention layers: a request within
    // them may still need more pages, with its window's parts of the sliding layers (what admission
    // asks for; it would wait for them for ever, and every request behind it).
    if let Some(w) = &info.window {
        let needed_pages = w.pages_to_hold(needed_blocks, info.block_size_tokens);
        if needed_pages > w.num_pages as usize {
            return Err(SubmitError::CannotFitPages {
                needed_tokens,
                needed_blocks,
                needed_pages,
                total_pages: w.num_pages as usize,
            });
        }
    }
    Ok(())
}

/// Cancels its request when dropped (no-op when the request already finished).
#[derive(Debug)]
pub struct RequestGuard {
    id: u64,
    commands: Sender<Command>,
}

impl RequestGuard {
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Cancel { id: self.id });
    }
}
