//! One parallel region per forward step: every thread of the pool runs the whole step, and each
//! operation is a deal of work items that the threads take in chunks as they come for more.
//!
//! Waking a thread pool costs microseconds; a decode step of a small model is a few hundred operations
//! of a few microseconds each, so waking the pool per operation (a `par_iter` per product) spends more
//! time starting work than doing it, and a second thread made decode slower. A region wakes the pool once
//! per step. A thread goes on to the next operation once every chunk of this one is done, whoever did
//! them: a thread that the scheduler has switched out (its core shared with another busy process) holds
//! nobody unless it holds a chunk, and when it comes back it finds the deals it missed done and catches
//! up. A thread that waits long for a chunk (its taker switched out) goes to sleep, and the chunk's
//! taker wakes it: a sleeper leaves its core to whatever else runs there (on Linux an idle core takes
//! the switched-out thread at once), where a thread that yielded waits its turn behind the other
//! processes, a time slice (milliseconds) each time. Where every core is busy there is no idle core to
//! take it: operations whose chunks may be done twice ([`Team::deal_staged`]: the decode products,
//! attention) then run in a redo form, in which a waiter does the held chunk itself and the taker's
//! late result is dropped.
//! A thread with nothing to do gives its core away rather than spin where spinning slows the team
//! ([`super::seats`]): to a teammate on the same CPU, and, between steps, from a core shared with a
//! busy process to a teammate that has a core of its own.
//!
//! Deals replace the barriers the threads met at between operations: there a thread switched out
//! anywhere held every other at the next barrier. [`Team::sync`], a barrier, remains for tests and
//! benchmarks that want every thread at one point.

use super::pace::PacedStep;
use super::{roster, seats};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The calling thread's place in a region.
pub struct Team<'a> {
    tid: usize,
    n: usize,
    barrier: Option<&'a SpinBarrier>,
    /// How many [`Team::deal`]s this thread has run in the region: every thread runs the same ones, so
    /// the count names the same deal on each.
    deals: std::cell::Cell<u64>,
}

impl<'a> Team<'a> {
    /// A team of one: every share is the whole, and `sync` does nothing.
    pub fn solo() -> Team<'static> {
        Team {
            tid: 0,
            n: 1,
            barrier: None,
            deals: std::cell::Cell::new(0),
        }
    }

    /// Member `tid` of a team of `n` threads that meet at `barrier`.
    fn member_of(tid: usize, n: usize, barrier: &'a SpinBarrier) -> Team<'a> {
        Team {
            tid,
            n,
            barrier: Some(barrier),
            deals: std::cell::Cell::new(0),
        }
    }

    pub fn index(&self) -> usize {
        self.tid
    }

    pub fn size(&self) -> usize {
        self.n
    }

    /// Runs `f` on chunks of `0..items` that together cover each item once, dealt to the threads as they
    /// come for more, and returns when every chunk is done (what each chunk wrote is then visible to
    /// this thread). A thread that runs slower (a shared memory bus, a neighbour on its core) takes
    /// fewer, and a thread that is not running when a deal starts (switched out by the scheduler) takes
    /// none: the others finish the deal without waiting for it. The chunks are contiguous and shrink as
    /// the items run out (a share of half of what is left, split among the threads), so most of a
    /// product streams in long runs. Which thread takes an item never changes what is computed for it.
    ///
    /// Every thread of the team calls the same deals in the same order, with the same `items`. A
    /// thread that comes late to a deal the others have finished finds no chunk left and goes on: it
    /// catches up with the team without holding it. Only a thread switched out while it holds a chunk
    /// holds the team, until it runs again; the others then sleep at the deal's end, and an idle
    /// core takes the switched-out thread (Linux moves a waiting thread to an idle core). A deal whose
    /// chunks may be done twice is [`Team::deal_staged`]'s.
    pub fn deal(&self, items: usize, f: impl FnMut(Range<usize>)) {
        self.deal_grain(items, 1, f);
    }

    /// [`Team::deal`] with chunks of `grain` items at least, but for the last.
    fn deal_grain(&self, items: usize, grain: usize, mut f: impl FnMut(Range<usize>)) {
        let Some(board) = self.barrier else {
            if items > 0 {
                f(0..items);
            }
            return;
        };
        self.run_deal(
            board,
            items,
            grain,
            |k, c, chunks, r| {
                f(r);
                board.mark_done(k, c, chunks);
            },
            false,
        );
    }

    /// [`Team::deal`] for an operation whose chunk `r` writes `out[span(r)]`, the whole of it and
    /// nothing else of `out`: `f(r, dest)` computes chunk `r` into `dest`, which holds what
    /// `out[span(r)]` held before the deal when `keep` (an operation that adds to `out`). Through
    /// [`Team::deal_staged`]: while recent steps have waited long, each chunk is computed into a
    /// thread's buffer and copied out by the first thread to finish it. Chunks take `grain` items at
    /// least ([`grain`]), but for the last, which takes what is left.
    ///
    /// # Safety
    /// As [`Team::deal_staged`]; the spans of distinct chunks lie inside `out` and do not overlap, and
    /// nothing else reads or writes `out[span(r)]` during the deal.
    pub unsafe fn deal_out(
        &self,
        items: usize,
        grain: usize,
        out: SharedMut<'_, f32>,
        keep: bool,
        span: impl Fn(Range<usize>) -> Range<usize>,
        mut f: impl FnMut(Range<usize>, &mut [f32]),
    ) {
        let mut stage = (
            0..0,
            OUT_BUFFER.with(|b| std::mem::take(&mut *b.borrow_mut())),
        );
        // SAFETY: the caller's guarantee, and the stage holds the chunk's span and values alone.
        unsafe {
            self.deal_staged(
                items,
                grain,
                &mut stage,
                |r, staged| {
                    let dest = span(r.clone());
                    let Some((at, buf)) = staged else {
                        // SAFETY: the chunk's span is its own, and nothing else touches it during
                        // the deal (the caller's guarantee).
                        return f(r, out.part_mut(dest));
                    };
                    assert!(
                        dest.start <= dest.end && dest.end <= out.len(),
                        "a chunk's span lies inside the output"
                    );
                    buf.clear();
                    if keep {
                        // SAFETY: in bounds (asserted). Until the chunk is done nobody writes these
                        // elements; a thread that finishes a chunk that another has done may read
                        // them while they are rewritten, and then drops what it computed (the
                        // caller's guarantee on `f`).
                        buf.extend_from_slice(std::slice::from_raw_parts(
                            out.ptr().add(dest.start),
                            dest.len(),
                        ));
                    } else {
                        buf.resize(dest.len(), 0.0);
                    }
                    f(r, buf);
                    *at = dest;
                },
                // SAFETY: the publisher of a chunk is one thread, once; the span is the chunk's alone.
                |(at, buf)| out.part_mut(at.clone()).copy_from_slice(buf),
            );
        }
        OUT_BUFFER.with(|b| *b.borrow_mut() = stage.1);
    }

    /// [`Team::deal`] for an operation whose chunks may be done twice. `f(r, None)` does chunk `r`,
    /// writing its results in place; `f(r, Some(stage))` computes them into `stage` (this thread's,
    /// reset by `f`) and writes nothing shared, and `publish(stage)` then writes them. While recent
    /// steps have waited long ([`REDO_WINDOW`]), every chunk goes through a stage: a thread that runs
    /// out of chunks while one is held by a thread that is not running (switched out by the scheduler,
    /// its core shared with a busy process) does that chunk again instead of waiting a time slice for
    /// its taker, and of the threads that computed a chunk the first to finish publishes it; the
    /// other's stage is dropped. Otherwise chunks write in place (a stage costs a copy and an atomic
    /// operation a chunk). Chunks take `grain` items at least, but for the last.
    ///
    /// # Safety
    /// Every thread of the team calls the same deals in the same order with the same arguments (each
    /// its own `stage`); `f` computes the same bits for a chunk on any thread, in place or staged; the
    /// writes of distinct chunks do not overlap, and nothing else reads or writes them during the deal.
    /// What `f` reads must stay readable until the region ends, and nothing it reads may decide an
    /// address or a loop's length unless nothing rewrites it before the region ends: a thread switched
    /// out in the middle of a chunk that another has since done finishes it later, while later deals
    /// may be rewriting what it reads (as a seqlock's reader, it then finds the chunk done and drops
    /// its stage).
    pub unsafe fn deal_staged<S>(
        &self,
        items: usize,
        grain: usize,
        stage: &mut S,
        mut f: impl FnMut(Range<usize>, Option<&mut S>),
        mut publish: impl FnMut(&S),
    ) {
        let Some(board) = self.barrier.filter(|b| b.redo) else {
            return self.deal_grain(items, grain, |r| f(r, None));
        };
        self.run_deal(
            board,
            items,
            grain,
            |k, c, chunks, r| {
                f(r, Some(&mut *stage));
                board.publish(k, c, chunks, || publish(stage));
            },
            true,
        );
    }

    /// A deal's claim loop: `chunk(k, c, chunks, r)` does chunk `c` (items `r`) of deal `k` of `chunks`
    /// and marks it done. With `redo`, a thread that runs out of chunks while one is not yet done does
    /// it again rather than sleep once it has spun its limit ([`SpinBarrier::wait_for`]).
    fn run_deal(
        &self,
        board: &SpinBarrier,
        items: usize,
        grain: usize,
        mut chunk: impl FnMut(u64, usize, usize, Range<usize>),
        redo: bool,
    ) {
        let k = self.deals.get() + 1;
        self.deals.set(k);
        let n = self.n;
        let chunks = chunk_count(items, n, grain);
        if chunks == 0 {
            return;
        }
        assert!(
            chunks <= board.states.len(),
            "a deal's chunks fit the board"
        );
        // Chunk `j` starts at `start`; a thread's chunks come in increasing order.
        let (mut j, mut start) = (0, 0);
        let mut pace = Redo::new(items, n, grain);
        loop {
            let w = board.claim.load(Ordering::Acquire);
            let c = match tag(w).cmp(&k) {
                // The team is past this deal: every chunk is done (a thread claims a chunk of the next
                // deal only once this one is done, and its claim is a release: what the chunks wrote is
                // visible here).
                std::cmp::Ordering::Greater => return,
                // The first thread to this deal: chunk 0.
                std::cmp::Ordering::Less => 0,
                std::cmp::Ordering::Equal => count(w),
            };
            if c >= chunks {
                break;
            }
            // Release as well: what this thread read before comes before the claim, so a claim that
            // succeeds means the deal was still open when it read (nothing a deal reads is written
            // before the deal is done).
            if board
                .claim
                .compare_exchange_weak(w, pack(k, c + 1), Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            while j < c {
                start += chunk_len(items - start, n, grain);
                j += 1;
            }
            let len = chunk_len(items - start, n, grain);
            if redo {
                let began = Instant::now();
                chunk(k, c, chunks, start..start + len);
                pace.took(len, began.elapsed());
            } else {
                chunk(k, c, chunks, start..start + len);
            }
        }
        if redo {
            board.wait_done(
                k,
                chunks,
                Some((
                    &mut |c| chunk(k, c, chunks, chunk_range(items, n, grain, c)),
                    pace,
                )),
            );
        } else {
            board.wait_done(k, chunks, None);
        }
    }

    /// Waits until every thread of the team has reached this point; what each wrote before is visible to
    /// all after.
    pub fn sync(&self) {
        if let Some(b) = self.barrier {
            b.wait();
        }
    }
}

/// Part `i` of `0..items` cut into `n` contiguous parts.
pub fn split(items: usize, n: usize, i: usize) -> Range<usize> {
    let (base, extra) = (items / n, items % n);
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// The least weight bytes a chunk of a decode product streams ([`grain`]). A chunk costs a claim (a
/// compare-and-swap on the deal's one claim word) and a mark (a store to the chunk's own cache line,
/// which every waiter reads): each a cache line passed between cores, a fraction of a microsecond that
/// a chunk of a few kilobytes does not earn back (a panel of 16 rows of the default model's 4-bit
/// matrices is 5 KB; with a chunk a panel the deal's last chunks were single panels). The guided
/// chunks (a `1 / (2n)` share of what is left) keep their sizes down to this one, so the last thread
/// to finish waits for at most one chunk of it. Measured on 2 threads (`docs/performance.md`).
pub const CHUNK_BYTES: usize = 16 * 1024;

/// The least items a chunk of a decode product takes where each item streams `item_bytes` of weights:
/// [`CHUNK_BYTES`] worth, or `KURA_CHUNK_BYTES` where that is set (a benchmark's way to compare grains;
/// 1 gives chunks of down to one item).
pub fn grain(item_bytes: usize) -> usize {
    grain_of(chunk_bytes(), item_bytes)
}

/// The least items of `item_bytes` each that make `chunk_bytes`, one at least.
fn grain_of(chunk_bytes: usize, item_bytes: usize) -> usize {
    chunk_bytes.div_ceil(item_bytes.max(1)).max(1)
}

fn chunk_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        let Some(v) = std::env::var_os("KURA_CHUNK_BYTES") else {
            return CHUNK_BYTES;
        };
        match v.to_str().map(str::parse::<usize>) {
            Some(Ok(bytes)) if bytes >= 1 => bytes,
            _ => {
                tracing::warn!(
                    "KURA_CHUNK_BYTES={v:?} is not a count of bytes of at least 1: the chunks of \
                     decode products keep {CHUNK_BYTES} bytes at least"
                );
                CHUNK_BYTES
            }
        }
    })
}

/// The length of [`Team::deal`]'s next chunk for `n` threads when `left` (≥ 1) items are left: a
/// `1 / (2n)` share (one at least), at least `grain` items, at most what is left.
fn chunk_len(left: usize, n: usize, grain: usize) -> usize {
    left.div_ceil(2 * n).max(grain).min(left)
}

/// How many chunks [`Team::deal`] cuts `items` into for `n` threads, chunks of `grain` items at least.
fn chunk_count(items: usize, n: usize, grain: usize) -> usize {
    let (mut start, mut chunks) = (0, 0);
    while start < items {
        start += chunk_len(items - start, n, grain);
        chunks += 1;
    }
    chunks
}

/// The items of chunk `c` of a deal of `items` for `n` threads, chunks of `grain` items at least.
fn chunk_range(items: usize, n: usize, grain: usize, c: usize) -> Range<usize> {
    let mut start = 0;
    for _ in 0..c {
        start += chunk_len(items - start, n, grain);
    }
    start..start + chunk_len(items - start, n, grain)
}

/// The most chunks a deal can have, per thread: each chunk but the last `2n` takes at least a `1 / (2n)`
/// share of what is left, so a deal of fewer than 2⁶⁴ items has fewer than `2n (ln 2⁶⁴ + 1) + 2n`.
const CHUNKS_PER_THREAD: usize = 2 * 47;

/// A board word: a deal's number in the high bits, a count of chunks in the low [`COUNT_BITS`].
const COUNT_BITS: u32 = 24;

fn pack(deal: u64, count: usize) -> u64 {
    (deal << COUNT_BITS) | count as u64
}

/// A chunk's state once a thread has begun to write it in deal `k` ([`SpinBarrier::publish`]).
fn writing(k: u64) -> u64 {
    2 * k
}

/// A chunk's state once it is done in deal `k`: later deals' states are greater.
fn done(k: u64) -> u64 {
    2 * k + 1
}

fn tag(w: u64) -> u64 {
    w >> COUNT_BITS
}

fn count(w: u64) -> usize {
    (w & ((1 << COUNT_BITS) - 1)) as usize
}

/// Tokens per work item of a panel kernel: all of them for small batches (up to `rows_only`: threads
/// split the rows, each weight read once); otherwise chunks of up to `chunk` tokens in whole register
/// tiles of `tile`, smaller when there are too few panels to give every thread several items.
pub fn chunk_tokens(
    t: usize,
    panels: usize,
    threads: usize,
    (rows_only, chunk, tile): (usize, usize, usize),
) -> usize {
    if t <= rows_only || threads <= 1 && t <= chunk {
        return t;
    }
    let want_chunks = (8 * threads).div_ceil(panels).max(t.div_ceil(chunk));
    t.div_ceil(want_chunks)
        .div_ceil(tile)
        .max(1)
        .saturating_mul(tile)
        .min(chunk)
}

thread_local! {
    /// The buffer this thread computes a staged chunk of [`Team::deal_out`] into.
    static OUT_BUFFER: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Whether this thread is running a region's closure: a region opened from inside one runs solo, as
    /// only some threads of the outer region would take part in it and the others would never arrive.
    static IN_REGION: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The payload of the panic a thread raises when another thread of its region panicked: it only wakes
/// the thread; the first real panic is the one handed to the caller.
struct Poisoned;

/// Runs `f` on every thread of the current rayon pool (on the calling thread alone when the pool has one
/// thread, or when called from inside a region) and returns when all are done.
///
/// On the global pool, once `set_threads` has built it, a step opened from outside the pool runs on as
/// many of its threads as [`super::roster`] says: fewer while a core is busy with something else.
pub fn run<F: Fn(&Team<'_>) + Sync>(f: F) {
    run_tokens(None, f);
}

/// [`run`] for a forward step of `tokens` new tokens: on the global pool a step of few tokens (decode)
/// runs on the team size that [`super::pace`] finds fastest.
pub fn run_step<F: Fn(&Team<'_>) + Sync>(tokens: usize, f: F) {
    run_tokens(Some(tokens), f);
}

fn run_tokens<F: Fn(&Team<'_>) + Sync>(tokens: Option<usize>, f: F) {
    let n = rayon::current_num_threads();
    if n <= 1 || IN_REGION.with(|r| r.get()) {
        f(&Team::solo());
        return;
    }
    if rayon::current_thread_index().is_none() {
        // The step's size is asked for under the lock that runs steps one at a time, so that steps
        // take their sizes (a trial's among them) in the order they run.
        let one_at_a_time = ADAPTIVE_STEP.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = roster::global_count(n, tokens) {
            step_on(n, count, tokens, &f);
            return;
        }
        drop(one_at_a_time);
    }
    let (barrier, waits) = step_board(n);
    let first_panic = std::sync::Mutex::new(None);
    rayon::broadcast(|ctx| {
        let team = Team::member_of(ctx.index(), ctx.num_threads(), &barrier);
        member(&team, &first_panic, &f);
    });
    after_step(waits);
    rethrow(first_panic);
}

/// A step runs [`Team::deal_staged`] in its redo form while at least [`REDO_LONG_STEPS`] of the last
/// `REDO_WINDOW` steps had a long wait (a thread held a chunk while switched out, as where another
/// process keeps a core busy: [`LONG_WAIT_NS`]). On a quiet machine the form costs a copy and an atomic
/// operation a chunk (about 0.7 µs a decode product at 2 threads with the weights in L2); there a long
/// wait comes once in hundreds of steps (a kernel thread, a neighbour's burst), and one alone does not
/// switch the form on.
const REDO_WINDOW: u32 = 16;
/// See [`REDO_WINDOW`].
const REDO_LONG_STEPS: u32 = 2;

/// The least time a waiting thread gives the taker of a chunk, once its spins have run out, before it
/// does the chunk again: a taker that is running finishes a decode chunk in microseconds, one that
/// was switched out comes back after a scheduler's turn (milliseconds).
const REDO_AFTER_NS: u64 = 50_000;

/// A wait this long (asleep) counts as long ([`LONG_WAITS`]): a chunk's taker was away from its core,
/// not merely slower.
const LONG_WAIT_NS: u64 = 200_000;

/// What a waiting thread does once its spins have run out.
enum Help {
    /// It did a chunk again: spin anew.
    Did,
    /// A chunk may be done again later: spin on.
    NotYet,
    /// Nothing to do: sleep.
    Sleep,
}

/// A thread's pace in a deal of the redo form: the items and time of the chunks it took, from which
/// how long another's chunk should take.
#[derive(Clone, Copy)]
struct Redo {
    /// The deal's items, team size and grain (to size a chunk).
    deal: (usize, usize, usize),
    items: usize,
    time: Duration,
}

impl Redo {
    /// No chunk taken yet in a deal of `items` for `n` threads, chunks of `grain` items at least.
    fn new(items: usize, n: usize, grain: usize) -> Redo {
        Redo {
            deal: (items, n, grain),
            items: 0,
            time: Duration::ZERO,
        }
    }

    fn took(&mut self, items: usize, time: Duration) {
        self.items += items;
        self.time += time;
    }

    /// How long to give the taker of chunk `c` before doing it again: twice what it should take at
    /// this thread's pace, [`REDO_AFTER_NS`] at least; four times that where this thread took none.
    fn patience(&self, c: usize) -> Duration {
        let least = Duration::from_nanos(REDO_AFTER_NS);
        if self.items == 0 {
            return 4 * least;
        }
        let (items, n, grain) = self.deal;
        let len = u32::try_from(chunk_range(items, n, grain, c).len()).unwrap_or(u32::MAX);
        let per_item = self.time / u32::try_from(self.items).unwrap_or(u32::MAX);
        (2 * per_item.saturating_mul(len)).max(least)
    }
}

/// Which of the latest steps had a long wait: bit `i` for the step `i` steps before the last.
static LONG_STEPS: AtomicU32 = AtomicU32::new(0);

/// Long waits (a chunk done again, or [`LONG_WAIT_NS`] asleep), in every region.
static LONG_WAITS: AtomicU64 = AtomicU64::new(0);

/// Regions running that use the redo form whatever the waits (tests).
static REDO_FORCED: AtomicUsize = AtomicUsize::new(0);

/// A step's board for `n` threads, in the redo form if recent steps waited long, and the count of long
/// waits before it ([`after_step`]).
fn step_board(n: usize) -> (SpinBarrier, u64) {
    let redo =
        redo_due(LONG_STEPS.load(Ordering::Relaxed)) || REDO_FORCED.load(Ordering::Relaxed) > 0;
    (
        SpinBarrier::with_redo(n, redo),
        LONG_WAITS.load(Ordering::Relaxed),
    )
}

/// Whether the next step runs in the redo form, given which of the latest steps had a long wait (bit
/// `i`: `i` steps before the last).
fn redo_due(long_steps: u32) -> bool {
    (long_steps & ((1 << REDO_WINDOW) - 1)).count_ones() >= REDO_LONG_STEPS
}

/// Records whether a wait was long during the step (the long waits now differ from `before`).
fn after_step(before: u64) {
    let long = u32::from(LONG_WAITS.load(Ordering::Relaxed) != before);
    let _ = LONG_STEPS.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |steps| {
        Some(steps << 1 | long)
    });
}

/// Runs `f` with every region's [`Team::deal_staged`] in its redo form (a chunk computed into a stage
/// and published by whoever finishes it first), whatever the waits: for tests, which check that both
/// forms give the same bits.
pub fn with_redo_form<R>(f: impl FnOnce() -> R) -> R {
    struct Forced;
    impl Drop for Forced {
        fn drop(&mut self) {
            REDO_FORCED.fetch_sub(1, Ordering::Relaxed);
        }
    }
    REDO_FORCED.fetch_add(1, Ordering::Relaxed);
    let _forced = Forced;
    f()
}

/// The first real panic of a region's threads, handed on to the caller.
type FirstPanic = Mutex<Option<Box<dyn std::any::Any + Send>>>;

/// Runs `f` as `team`'s member, marked as inside a region (a region opened inside it runs solo). A
/// thread that panics must not leave the others waiting at a barrier forever: it poisons the barrier,
/// they stop waiting, and the first real panic goes to the caller ([`rethrow`]).
fn member<F: Fn(&Team<'_>) + Sync>(team: &Team<'_>, first_panic: &FirstPanic, f: &F) {
    IN_REGION.with(|r| r.set(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(team)));
    IN_REGION.with(|r| r.set(false));
    if let Err(payload) = result {
        if let Some(barrier) = team.barrier {
            barrier.poison();
        }
        if !payload.is::<Poisoned>() {
            let mut first = first_panic.lock().unwrap_or_else(|e| e.into_inner());
            first.get_or_insert(payload);
        }
    }
}

/// Resumes the region's first real panic, if any, on the calling thread.
fn rethrow(first_panic: FirstPanic) {
    if let Some(payload) = first_panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
        std::panic::resume_unwind(payload);
    }
}

/// One step at a time on the global pool: a team's jobs are taken by whichever threads are free, so two
/// steps at once could each hold some of the threads and wait for the rest forever.
static ADAPTIVE_STEP: Mutex<()> = Mutex::new(());

/// A step on `count` threads of the current pool, as a step of the global pool's `n` threads runs
/// ([`step_on`]), for tests that choose its size.
#[cfg(test)]
fn run_adaptive<F: Fn(&Team<'_>) + Sync>(n: usize, count: usize, f: F) {
    let _one_at_a_time = ADAPTIVE_STEP.lock().unwrap_or_else(|e| e.into_inner());
    step_on(n, count, None, &f);
}

/// A step of `tokens` new tokens (where it is a forward step) on `count` of the global pool's `n`
/// threads (the calling thread alone for one), with [`ADAPTIVE_STEP`] held; the roster then hears how
/// long it took and whether its last member held it up ([`roster::held_up`]).
fn step_on<F: Fn(&Team<'_>) + Sync>(n: usize, count: usize, tokens: Option<usize>, f: &F) {
    let start = Instant::now();
    let held_up = run_on(count, f);
    let paced = tokens.map(|tokens| PacedStep {
        tokens,
        size: count,
        elapsed: start.elapsed(),
    });
    roster::global_after_step(n, paced, held_up);
}

/// Runs a step on `count` threads of the current pool (the calling thread alone for one) and says
/// whether its last member held it up.
fn run_on<F: Fn(&Team<'_>) + Sync>(count: usize, f: &F) -> bool {
    let first_panic = Mutex::new(None);
    if count <= 1 {
        // As a member, so that a region opened inside runs solo (it would wait for this step's lock).
        member(&Team::solo(), &first_panic, f);
        rethrow(first_panic);
        return false;
    }
    let (barrier, waits) = step_board(count);
    let slots = AtomicUsize::new(0);
    let start = Instant::now();
    // When the first and the last member left the step (ns from its start).
    let (first_out, last_out) = (AtomicU64::new(u64::MAX), AtomicU64::new(0));
    let take_part = || {
        let team = Team::member_of(slots.fetch_add(1, Ordering::Relaxed), count, &barrier);
        member(&team, &first_panic, f);
        let out = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        first_out.fetch_min(out, Ordering::Relaxed);
        last_out.fetch_max(out, Ordering::Relaxed);
    };
    // The jobs go to whichever threads come for them first: a thread whose core is busy comes last
    // and finds no work left.
    spawn_and_wait(count, &take_part);
    after_step(waits);
    rethrow(first_panic);
    let (first, last) = (
        first_out.load(Ordering::Relaxed),
        last_out.load(Ordering::Relaxed),
    );
    roster::held_up(
        Duration::from_nanos(last.saturating_sub(first)),
        Duration::from_nanos(last),
        count,
    )
}

/// Runs `job` on `count` jobs of the current pool, taken by whichever of its threads come first, and
/// returns once every one has run to its end. The calling thread (outside the pool) sleeps meanwhile
/// and is woken once, by the last job: a `rayon::scope` opened from outside the pool runs its body on
/// one of the pool's threads, which sleeps until the last job wakes it and then wakes the caller, two
/// wake-ups in a row, each a scheduler's turn late on a busy machine. From a thread of the pool, which
/// must run jobs while it waits (a job left in its own queue might never start otherwise), through
/// `rayon::scope`. `job` must not unwind (a region's member catches its panics).
fn spawn_and_wait(count: usize, job: &(dyn Fn() + Sync)) {
    if rayon::current_thread_index().is_some() {
        rayon::scope(|s| {
            for _ in 0..count {
                s.spawn(|_| job());
            }
        });
        return;
    }
    /// Jobs left, and whether the last has ended.
    struct Left {
        jobs: AtomicUsize,
        ended: Mutex<bool>,
        wake: Condvar,
    }
    let left = std::sync::Arc::new(Left {
        jobs: AtomicUsize::new(count),
        ended: Mutex::new(false),
        wake: Condvar::new(),
    });
    // SAFETY: this function returns only once every job has returned from `job` (each counts itself
    // out after the call, and the last wakes the wait below), so `job` and what it borrows outlive
    // every use; after counting itself out a job touches only its own `Arc` of `left`. A job that
    // unwound out of `job` would abort the process (rayon's handling of a panicking spawn) before it
    // could be counted out early.
    let job: &'static (dyn Fn() + Sync) = unsafe { std::mem::transmute(job) };
    let step = STEPS_SPAWNED.fetch_add(1, Ordering::Relaxed) + 1;
    for _ in 0..count {
        let left = std::sync::Arc::clone(&left);
        rayon::spawn(move || {
            seats::take();
            job();
            if left.jobs.fetch_sub(1, Ordering::AcqRel) == 1 {
                *left.ended.lock().unwrap_or_else(|e| e.into_inner()) = true;
                left.wake.notify_one();
            }
            // Awake a while for the next step: a thread of the pool that sleeps between steps is
            // woken for the next one, a scheduler's turn late where its core is shared. Yielding
            // where spinning would slow the step down ([`seats::give_way`]).
            let since = Instant::now();
            while STEPS_SPAWNED.load(Ordering::Relaxed) == step
                && since.elapsed() < Duration::from_nanos(LINGER_NS)
            {
                if !seats::give_way(true) {
                    for _ in 0..32 {
                        std::hint::spin_loop();
                    }
                }
            }
            seats::leave();
        });
    }
    let mut ended = left.ended.lock().unwrap_or_else(|e| e.into_inner());
    while !*ended {
        ended = left.wake.wait(ended).unwrap_or_else(|e| e.into_inner());
    }
}

/// Steps spawned by [`spawn_and_wait`].
static STEPS_SPAWNED: AtomicU64 = AtomicU64::new(0);

/// How long a member stays awake after its step for the next ([`spawn_and_wait`]): longer than the
/// caller's work between decode steps (sampling, tens of microseconds).
const LINGER_NS: u64 = 200_000;

/// What a team's threads share: the board of its deals (which chunk of which deal is claimed next, and
/// in which deal each chunk was last done) and a reusable barrier ([`Team::sync`]). Waiters spin
/// briefly, then sleep. Every word that one thread writes and others poll sits on a cache line of its
/// own.
pub struct SpinBarrier {
    n: usize,
    arrived: CacheLine<AtomicUsize>,
    generation: CacheLine<AtomicUsize>,
    sleepers: CacheLine<AtomicUsize>,
    /// The latest deal any thread has claimed a chunk of, and how many of its chunks are claimed
    /// ([`pack`]).
    claim: CacheLine<AtomicU64>,
    /// Per chunk: how far it has come in the latest deal that reached it ([`writing`], [`done`]).
    states: Box<[CacheLine<AtomicU64>]>,
    poisoned: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    /// Whether [`Team::deal_staged`] computes each chunk into a stage and publishes it, so that a
    /// waiting thread may do a held chunk again; otherwise its chunks write in place.
    redo: bool,
}

#[repr(align(64))]
struct CacheLine<T>(T);

impl<T> std::ops::Deref for CacheLine<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// The most spins (`pause`, tens of nanoseconds each) before a waiting thread sleeps: long enough to
/// cover the uneven shares of an operation on a quiet machine, short beside a time slice.
const MAX_SPINS: u32 = 20_000;
/// The fewest.
const MIN_SPINS: u32 = 64;

thread_local! {
    /// This thread's spins before it sleeps, adapted to how its waits end: halved after a wait that
    /// ended asleep, doubled after one that ended spinning. Where its peer runs on the same core (more
    /// threads than cores, other processes busy) spinning only delays the peer, and the limit falls to
    /// a few spins; on a quiet machine it stays high and threads seldom sleep.
    static SPIN_LIMIT: std::cell::Cell<u32> = const { std::cell::Cell::new(MAX_SPINS) };
}

impl SpinBarrier {
    pub fn new(n: usize) -> Self {
        Self::with_redo(n, false)
    }

    /// A board for `n` threads whose [`Team::deal_staged`]s run in the redo form or not.
    fn with_redo(n: usize, redo: bool) -> Self {
        SpinBarrier {
            redo,
            n,
            arrived: CacheLine(AtomicUsize::new(0)),
            generation: CacheLine(AtomicUsize::new(0)),
            sleepers: CacheLine(AtomicUsize::new(0)),
            claim: CacheLine(AtomicU64::new(0)),
            states: (0..CHUNKS_PER_THREAD * n.max(1))
                .map(|_| CacheLine(AtomicU64::new(0)))
                .collect(),
            poisoned: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        }
    }

    pub fn wait(&self) {
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            // Last to arrive: reset before releasing, so that no thread can arrive at the next use
            // before the count is back to zero.
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::SeqCst);
            // A sleeper counted itself before it looked at the generation (both SeqCst): either it sees
            // the new one, or it is counted here and woken.
            if self.sleepers.load(Ordering::SeqCst) > 0 {
                self.wake_all();
            }
            return;
        }
        self.wait_for(
            || self.generation.load(Ordering::SeqCst) != generation,
            || Help::Sleep,
        );
    }

    /// Marks chunk `c` of deal `k` (`chunks` chunks) done, and wakes the sleepers if the deal is.
    fn mark_done(&self, k: u64, c: usize, chunks: usize) {
        // Release: what the chunk wrote is visible to whoever sees the mark. SeqCst with the
        // sleepers' count: a sleeper counted itself before it looked at the marks, so either it sees
        // this one or it is counted here and woken once the deal is done.
        self.states[c].store(done(k), Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 && self.is_done(k, chunks, &mut 0) {
            self.wake_all();
        }
    }

    /// Whether every chunk of deal `k` is done; `from`: the chunks before it are known done, and it
    /// moves on past those found done.
    fn is_done(&self, k: u64, chunks: usize, from: &mut usize) -> bool {
        while *from < chunks && self.states[*from].load(Ordering::SeqCst) >= done(k) {
            *from += 1;
        }
        *from == chunks
    }

    /// Writes chunk `c` of deal `k` (`chunks` chunks) with `write` and marks it done, unless another
    /// thread has begun to (then returns without calling `write`): of the threads that computed the
    /// chunk, the first to come here writes it, once.
    fn publish(&self, k: u64, c: usize, chunks: usize, write: impl FnOnce()) {
        let state = &self.states[c];
        let now = state.load(Ordering::Acquire);
        if now >= writing(k)
            || state
                .compare_exchange(now, writing(k), Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        write();
        self.mark_done(k, c, chunks);
    }

    /// Waits until deal `k` (`chunks` chunks) is done. With `redo` (a function that does a chunk
    /// again, and this thread's time per item in its own chunks of the deal, if it took any), once it
    /// has spun its limit it does again a chunk that nobody has begun to write yet and whose taker has
    /// had twice the time it should take ([`REDO_AFTER_NS`] at least: a thread switched out is away
    /// a scheduler's turn, milliseconds), instead of sleeping; it sleeps once every chunk not done is
    /// being written.
    fn wait_done(&self, k: u64, chunks: usize, mut redo: Option<(&mut dyn FnMut(usize), Redo)>) {
        // The chunks before `from` are known done.
        let from = std::cell::Cell::new(0);
        // When the spins ran out.
        let mut spun: Option<Instant> = None;
        self.wait_for(
            || {
                let mut f = from.get();
                let done = self.is_done(k, chunks, &mut f);
                from.set(f);
                done
            },
            || {
                let Some((redo, pace)) = redo.as_mut() else {
                    return Help::Sleep;
                };
                let held = (from.get()..chunks)
                    .find(|&c| self.states[c].load(Ordering::Acquire) < writing(k));
                let Some(c) = held else {
                    return Help::Sleep;
                };
                let since = *spun.get_or_insert_with(Instant::now);
                if since.elapsed() < pace.patience(c) {
                    return Help::NotYet;
                }
                spun = None;
                redo(c);
                Help::Did
            },
        );
    }

    /// Spins until `ready` holds, for at most this thread's spin limit, then asks `help` to do some
    /// of the work waited for (when it did, the spinning starts over) and otherwise sleeps until a
    /// [`SpinBarrier::wake_all`] finds `ready` holds; adapts the limit to how the wait ended, and
    /// counts a wait that helped or slept [`LONG_WAIT_NS`] or more ([`LONG_WAITS`]). Resumes the
    /// region's panic if the barrier is poisoned meanwhile.
    fn wait_for(&self, ready: impl Fn() -> bool, mut help: impl FnMut() -> Help) {
        let limit = SPIN_LIMIT.with(|l| l.get());
        let (mut spins, mut slept, mut long) = (0u32, false, false);
        while !ready() {
            if self.poisoned.load(Ordering::Acquire) {
                std::panic::resume_unwind(Box::new(Poisoned));
            }
            if spins < limit {
                spins += 1;
                if spins % 64 == 1 {
                    // This thread may have moved since it last said where it runs; a teammate on
                    // its CPU is given the core rather than spun against.
                    seats::here();
                    if seats::give_way(false) {
                        continue;
                    }
                }
                std::hint::spin_loop();
                continue;
            }
            // Helping or sleeping: either way the wait outlasted the spins.
            slept = true;
            match help() {
                Help::Did => {
                    spins = 0;
                    long = true;
                }
                Help::NotYet => {
                    if !seats::give_way(false) {
                        std::hint::spin_loop();
                    }
                }
                Help::Sleep => {
                    let asleep = Instant::now();
                    seats::away();
                    self.sleep_until(&ready);
                    seats::here();
                    long |= asleep.elapsed() >= Duration::from_nanos(LONG_WAIT_NS);
                }
            }
        }
        if long {
            LONG_WAITS.fetch_add(1, Ordering::Relaxed);
        }
        // Halved after a wait that ended asleep, doubled after one that ended spinning.
        let next = if slept {
            (limit / 2).max(MIN_SPINS)
        } else {
            limit.saturating_mul(2).min(MAX_SPINS)
        };
        SPIN_LIMIT.with(|l| l.set(next));
    }

    /// Sleeps until `woken` holds or the barrier is poisoned.
    fn sleep_until(&self, woken: impl Fn() -> bool) {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        while !woken() && !self.poisoned.load(Ordering::SeqCst) {
            guard = self.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
        drop(guard);
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Wakes every sleeper. Taking the lock orders this after any sleeper's look at the generation
    /// under it: a sleeper that saw the old generation is already waiting, and is woken.
    fn wake_all(&self) {
        drop(self.lock.lock().unwrap_or_else(|e| e.into_inner()));
        self.wake.notify_all();
    }

    /// Marks the barrier poisoned (a thread of the region panicked) and wakes the waiters, which then
    /// stop waiting.
    fn poison(&self) {
        self.poisoned.store(true, Ordering::SeqCst);
        self.wake_all();
    }
}

/// A slice that the threads of a region write in disjoint parts; it borrows the slice for `'a`.
pub struct SharedMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

impl<T> Clone for SharedMut<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for SharedMut<'_, T> {}

// SAFETY: a SharedMut only hands out parts through `unsafe` methods whose callers guarantee that no two
// threads touch the same element between two barriers unless both only read.
unsafe impl<T: Send> Send for SharedMut<'_, T> {}
// SAFETY: as above; reading from several threads at once needs `T: Sync`.
unsafe impl<T: Send + Sync> Sync for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    pub fn new(s: &'a mut [T]) -> Self {
        SharedMut {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _borrow: std::marker::PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements `r`, to write.
    ///
    /// # Safety
    /// No other thread reads or writes any of them until the next barrier.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn part_mut(&self, r: Range<usize>) -> &'a mut [T] {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "part outside the slice"
        );
        // SAFETY: in bounds (asserted); exclusive by the caller's guarantee.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.end - r.start) }
    }

    /// The whole slice, to read.
    ///
    /// # Safety
    /// No thread writes any element until the next barrier.
    pub unsafe fn all(&self) -> &'a [T] {
        // SAFETY: by the caller's guarantee.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The raw pointer, for kernels that write scattered disjoint elements.
    pub fn ptr(&self) -> *mut T {
        self.ptr
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_item_once() {
        for items in 0..40 {
            for n in 1..6 {
                let mut seen = vec![0; items];
                for i in 0..n {
                    for j in split(items, n, i) {
                        seen[j] += 1;
                    }
                }
                assert!(seen.iter().all(|c| *c == 1), "items={items} n={n}");
            }
        }
    }

    /// A team of `threads` on a pool of its own.
    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool")
    }

    #[test]
    fn a_team_finishes_its_deals_without_a_thread_that_is_not_running() {
        // One member takes part in the first ten deals, then stays away (as if switched out) until the
        // others have finished every deal: they must not wait for it, and when it comes back it finds
        // nothing left and leaves.
        let sizes: Vec<usize> = (0..40).map(|r| 1 + (r * 37) % 101).collect();
        let seen: Vec<Vec<AtomicUsize>> = sizes
            .iter()
            .map(|&n| (0..n).map(|_| AtomicUsize::new(0)).collect())
            .collect();
        let late_took = AtomicUsize::new(0);
        let (finished, late_may_come) = std::sync::mpsc::channel();
        let late_may_come = Mutex::new(late_may_come);
        let others_waited = AtomicBool::new(false);
        pool(3).install(|| {
            run(|tm| {
                let late = tm.index() == 2;
                for (round, &n) in sizes.iter().enumerate() {
                    if late && round == 10 {
                        let waited = late_may_come
                            .lock()
                            .unwrap()
                            .recv_timeout(std::time::Duration::from_secs(60));
                        others_waited.store(waited.is_err(), Ordering::Relaxed);
                    }
                    tm.deal(n, |r| {
                        if late && round >= 10 {
                            late_took.fetch_add(r.len(), Ordering::Relaxed);
                        }
                        for i in r {
                            seen[round][i].fetch_add(1, Ordering::Relaxed);
                        }
                    });
                }
                if tm.index() == 0 {
                    finished.send(()).expect("the late member listens");
                }
            })
        });
        assert!(
            !others_waited.load(Ordering::Relaxed),
            "the team waited for its absent member"
        );
        assert_eq!(late_took.load(Ordering::Relaxed), 0);
        for (round, s) in seen.iter().enumerate() {
            assert!(
                s.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                "round {round}"
            );
        }
    }

    #[test]
    fn deal_out_writes_each_span_once_in_both_forms() {
        // Every round adds to each element once (`keep`) or overwrites it; in place and in the redo
        // form, on teams of 1 to 3, over sizes that cut into chunks of one to many elements.
        let sizes: Vec<usize> = (0..30).map(|r| (r * 53) % 97).collect();
        for threads in 1..=3 {
            for redo in [false, true] {
                for keep in [false, true] {
                    let mut out = vec![0f32; 200];
                    let shared = SharedMut::new(&mut out);
                    let rounds = || {
                        pool(threads).install(|| {
                            run(|tm| {
                                for (round, &n) in sizes.iter().enumerate() {
                                    // Element i of a round lies at 2i + 1: spans in steps of two.
                                    let span = |r: Range<usize>| 2 * r.start..2 * r.end;
                                    // SAFETY: every thread passes the same arguments; spans of
                                    // distinct chunks are disjoint and inside `out`; `f` reads
                                    // nothing that decides an address.
                                    unsafe {
                                        tm.deal_out(
                                            n,
                                            1 + round % 4,
                                            shared,
                                            keep,
                                            span,
                                            |r, dest| {
                                                assert_eq!(dest.len(), 2 * r.len());
                                                for (i, pair) in r.zip(dest.chunks_mut(2)) {
                                                    let v = (i + round) as f32;
                                                    pair[1] = if keep { pair[1] + v } else { v };
                                                }
                                            },
                                        )
                                    }
                                }
                            })
                        })
                    };
                    if redo {
                        with_redo_form(rounds);
                    } else {
                        rounds();
                    }
                    for i in 0..100 {
                        // What the rounds that reached element i wrote to it.
                        let mut wrote = sizes
                            .iter()
                            .enumerate()
                            .filter(|&(_, &n)| i < n)
                            .map(|(round, _)| (i + round) as f32);
                        let want: f32 = if keep {
                            wrote.sum()
                        } else {
                            wrote.next_back().unwrap_or(0.0)
                        };
                        let what = format!("threads={threads} redo={redo} keep={keep} i={i}");
                        assert_eq!(out[2 * i], 0.0, "{what}: a span's other elements kept");
                        assert_eq!(out[2 * i + 1], want, "{what}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_redo_form_runs_while_long_waits_recur_and_not_after_one() {
        // Steps one after another, each with a long wait or not: the form is on from the second long
        // wait within the window, and off once fewer than two of the window's steps had one.
        let run = |long: &[bool]| {
            let mut steps = 0u32;
            long.iter()
                .map(|&l| {
                    steps = steps << 1 | u32::from(l);
                    redo_due(steps)
                })
                .collect::<Vec<_>>()
        };
        // One long wait now and then (a quiet machine): never.
        let mut quiet = vec![false; 100];
        quiet[3] = true;
        quiet[3 + REDO_WINDOW as usize] = true;
        quiet[60] = true;
        assert!(run(&quiet).iter().all(|on| !on));
        // Long waits step after step (a busy core): from the second on, and for as long as two of
        // the window's steps had one.
        let mut busy = vec![true; 10];
        busy.extend([false; 20]);
        let on = run(&busy);
        assert_eq!(
            on[..10],
            [false, true, true, true, true, true, true, true, true, true]
        );
        // The last step whose window still holds the two last long waits (steps 8 and 9).
        let last_on = on.iter().rposition(|&o| o).unwrap();
        assert_eq!(last_on, 8 + REDO_WINDOW as usize - 1);
    }

    #[test]
    fn a_chunk_held_by_a_thread_that_is_not_running_is_done_again_and_its_late_result_dropped() {
        // Member 1 takes the deal's first chunk and stays in it (as if switched out) until member 0 has
        // finished the deal: member 0 must do that chunk itself rather than wait; what member 1 then
        // computes (here NaN, where it would be the same bits) must not reach `out`.
        let mut out = vec![1f32; 64];
        let shared = SharedMut::new(&mut out);
        let (finished, member_1_may_go) = std::sync::mpsc::channel();
        let member_1_may_go = Mutex::new(member_1_may_go);
        let holding = AtomicBool::new(false);
        let (member_0_waited, member_1_waited) = (AtomicBool::new(false), AtomicBool::new(false));
        let timeout = Duration::from_secs(20);
        with_redo_form(|| {
            pool(2).install(|| {
                run(|tm| {
                    if tm.index() == 0 {
                        let since = Instant::now();
                        while !holding.load(Ordering::Acquire) && since.elapsed() < timeout {
                            std::thread::yield_now();
                        }
                    }
                    let since = Instant::now();
                    // SAFETY: both threads pass the same arguments; a chunk's span is its items.
                    unsafe {
                        tm.deal_out(
                            64,
                            1,
                            shared,
                            true,
                            |r| r,
                            |_, dest| {
                                if tm.index() == 1 && !holding.swap(true, Ordering::AcqRel) {
                                    let waited =
                                        member_1_may_go.lock().unwrap().recv_timeout(timeout);
                                    member_1_waited.store(waited.is_err(), Ordering::Relaxed);
                                    dest.fill(f32::NAN);
                                    return;
                                }
                                for d in dest {
                                    *d += 1.0;
                                }
                            },
                        )
                    }
                    if tm.index() == 0 {
                        member_0_waited.store(since.elapsed() >= timeout, Ordering::Relaxed);
                        finished.send(()).expect("member 1 listens");
                    }
                })
            })
        });
        assert!(holding.load(Ordering::Relaxed), "member 1 took a chunk");
        assert!(
            !member_0_waited.load(Ordering::Relaxed) && !member_1_waited.load(Ordering::Relaxed),
            "member 0 waited for the chunk's taker"
        );
        assert!(out.iter().all(|v| *v == 2.0), "{out:?}");
    }

    /// Rounds on a team of 3 in which `write` fills `cells` cells with the round's number (and makes
    /// the writes visible: a barrier or a deal), after which every thread reads them all; how many
    /// reads saw a cell of another round.
    fn rounds_unseen(
        cells: usize,
        rounds: usize,
        write: impl Fn(&Team<'_>, SharedMut<'_, usize>, usize) + Sync,
    ) -> usize {
        let mut cells = vec![0usize; cells];
        let shared = SharedMut::new(&mut cells);
        let bad = AtomicUsize::new(0);
        pool(3).install(|| {
            run(|tm| {
                for round in 1..=rounds {
                    write(tm, shared, round);
                    // SAFETY: nobody writes until the next round, which every thread reaches only
                    // after the barrier below.
                    if unsafe { shared.all() }.iter().any(|c| *c != round) {
                        bad.fetch_add(1, Ordering::Relaxed);
                    }
                    tm.sync();
                }
            })
        });
        bad.into_inner()
    }

    #[test]
    fn what_a_deal_wrote_is_seen_by_every_thread_after_it() {
        let unseen = rounds_unseen(64, 300, |tm, shared, round| {
            tm.deal(64, |r| {
                // SAFETY: the dealt cells are this chunk's.
                unsafe { shared.part_mut(r) }.fill(round);
            })
        });
        assert_eq!(unseen, 0);
    }

    #[test]
    fn a_thread_asleep_at_the_end_of_a_deal_wakes_when_the_taker_of_a_chunk_panics() {
        let taken = AtomicBool::new(false);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool(2).install(|| {
                run(|tm| {
                    // Thread 1 takes the first chunk; thread 0 the other, then waits for the first.
                    while tm.index() == 0 && !taken.load(Ordering::Relaxed) {
                        std::thread::yield_now();
                    }
                    tm.deal(2, |_| {
                        if tm.index() == 1 {
                            taken.store(true, Ordering::Relaxed);
                            until_asleep(tm, 1);
                            panic!("member fails in a chunk");
                        }
                    });
                })
            })
        }));
        let payload = result.expect_err("the region must panic");
        assert_eq!(
            payload.downcast_ref::<&str>(),
            Some(&"member fails in a chunk")
        );
    }

    #[test]
    fn a_step_whose_last_member_comes_late_is_held_up() {
        // Member 1 stays in the step 100 ms longer than member 0, counted from when member 0 has
        // finished its part: the wait for it is longer than half of the step.
        let first_done = AtomicBool::new(false);
        let held_up = pool(2).install(|| {
            run_on(2, &|tm: &Team<'_>| {
                tm.deal(10, |_| {});
                if tm.index() == 0 {
                    first_done.store(true, Ordering::SeqCst);
                    return;
                }
                while !first_done.load(Ordering::SeqCst) {
                    std::thread::yield_now();
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            })
        });
        assert!(held_up);
    }

    #[test]
    fn deals_cover_every_item_once_in_every_round() {
        // Rounds of deals of varying sizes, a barrier between each, on teams of 1 to 4 threads: every
        // item of every round is run exactly once, by whichever thread takes it; in the even rounds
        // thread 0 is slowed (it sleeps after each chunk), and the others take more than their share.
        for threads in 1..=4 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("pool");
            let sizes: Vec<usize> = (0..60).map(|r| (r * 37) % 101).collect();
            let seen: Vec<Vec<AtomicUsize>> = sizes
                .iter()
                .map(|&n| (0..n).map(|_| AtomicUsize::new(0)).collect())
                .collect();
            let taken = [0, 1, 2, 3].map(|_| AtomicUsize::new(0));
            let slowed = AtomicUsize::new(0);
            pool.install(|| {
                run(|tm| {
                    for (round, &n) in sizes.iter().enumerate() {
                        tm.deal(n, |r| {
                            taken[tm.index()].fetch_add(r.len(), Ordering::Relaxed);
                            if tm.index() == 0 && round % 2 == 0 {
                                slowed.fetch_add(r.len(), Ordering::Relaxed);
                            }
                            for i in r {
                                seen[round][i].fetch_add(1, Ordering::Relaxed);
                            }
                            if tm.index() == 0 && round % 2 == 0 {
                                std::thread::sleep(std::time::Duration::from_millis(1));
                            }
                        });
                        tm.sync();
                    }
                })
            });
            for (round, s) in seen.iter().enumerate() {
                for (i, c) in s.iter().enumerate() {
                    assert_eq!(
                        c.load(Ordering::Relaxed),
                        1,
                        "threads={threads} round={round} item={i}"
                    );
                }
            }
            let total: usize = taken.iter().map(|t| t.load(Ordering::Relaxed)).sum();
            assert_eq!(total, sizes.iter().sum::<usize>());
            if threads > 1 {
                let even: usize = sizes.iter().step_by(2).sum();
                let slow = slowed.load(Ordering::Relaxed);
                assert!(
                    slow * threads < even,
                    "{threads} threads: the slowed thread took {slow} of {even} items"
                );
            }
        }
    }

    #[test]
    fn chunks_shrink_to_the_grain_and_cover_the_items() {
        for n in 1..=16 {
            for grain in [1usize, 2, 3, 7, 100] {
                for items in [1usize, 2, 3, 36, 60, 192, 3072] {
                    let (mut start, mut last, mut chunks) = (0, usize::MAX, 0);
                    while start < items {
                        let len = chunk_len(items - start, n, grain);
                        assert!(len >= 1 && len <= last && start + len <= items);
                        // A chunk shorter than the grain takes every item left.
                        assert!(len >= grain || start + len == items);
                        assert_eq!(chunk_range(items, n, grain, chunks), start..start + len);
                        (start, last, chunks) = (start + len, len, chunks + 1);
                    }
                    assert_eq!(start, items);
                    assert_eq!(chunks, chunk_count(items, n, grain));
                    assert!(chunks <= CHUNKS_PER_THREAD * n, "the chunks fit the board");
                    assert!(last <= grain, "the last chunks are of the grain or less");
                }
            }
        }
        // A grain of 16 KB of weights: a small model's 4-bit panels (5 KB) go four to a chunk, so 60 of
        // them make 9 chunks for 2 threads (1 a panel: 12) and 15 for 16 threads (46).
        assert_eq!(grain_of(CHUNK_BYTES, 5_184), 4);
        assert_eq!(grain_of(1, 5_184), 1);
        assert_eq!((chunk_count(60, 2, 1), chunk_count(60, 2, 4)), (12, 9));
        assert_eq!((chunk_count(60, 16, 1), chunk_count(60, 16, 4)), (46, 15));
    }

    #[test]
    fn barrier_orders_phases_across_threads() {
        // Each round every thread writes its own cell: after the barrier every thread must see every
        // write of the round.
        let unseen = rounds_unseen(3, 500, |tm, shared, round| {
            // SAFETY: each thread writes only its own cell between barriers.
            unsafe { shared.part_mut(tm.index()..tm.index() + 1)[0] = round };
            tm.sync();
        });
        assert_eq!(unseen, 0);
    }

    /// Waits (yielding) until `n` threads sleep at the team's barrier.
    fn until_asleep(tm: &Team<'_>, n: usize) {
        let b = tm.barrier.expect("a team of several threads");
        while b.sleepers.load(Ordering::SeqCst) < n {
            std::thread::yield_now();
        }
    }

    #[test]
    fn threads_that_fall_asleep_at_the_barrier_are_woken() {
        // One thread comes late to every barrier (descheduled, as on a busy machine): it arrives only
        // once the other two have spun out and sleep, and they must be woken with every write of the
        // round visible.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("pool");
        let mut cells = vec![0usize; 3];
        let shared = SharedMut::new(&mut cells);
        let bad = AtomicUsize::new(0);
        pool.install(|| {
            run(|tm| {
                for round in 1..=20 {
                    if tm.index() == round % 3 {
                        until_asleep(tm, 2);
                    }
                    // SAFETY: each thread writes only its own cell between barriers.
                    unsafe { shared.part_mut(tm.index()..tm.index() + 1)[0] = round };
                    tm.sync();
                    // SAFETY: nobody writes until the next barrier.
                    if unsafe { shared.all() }.iter().any(|c| *c != round) {
                        bad.fetch_add(1, Ordering::Relaxed);
                    }
                    tm.sync();
                }
            })
        });
        assert_eq!(bad.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_thread_asleep_at_the_barrier_wakes_when_another_panics() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                run(|tm| {
                    if tm.index() == 1 {
                        until_asleep(tm, 1);
                        panic!("late worker fails");
                    }
                    tm.sync();
                })
            })
        }));
        let payload = result.expect_err("the region must panic");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"late worker fails"));
    }

    #[test]
    fn a_panicking_thread_does_not_leave_the_others_waiting() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                run(|tm| {
                    if tm.index() == 1 {
                        panic!("worker fails");
                    }
                    tm.sync();
                })
            })
        }));
        // The caller gets the worker's own panic, not the one that woke the waiting thread.
        let payload = result.expect_err("the region must panic");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"worker fails"));
    }

    #[test]
    fn a_step_on_part_of_the_pool_runs_each_member_once_and_deals_every_item_once() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .expect("pool");
        for count in 1..=4 {
            let members = Mutex::new(Vec::new());
            let sizes: Vec<usize> = (0..30).map(|r| (r * 37) % 101).collect();
            let seen: Vec<Vec<AtomicUsize>> = sizes
                .iter()
                .map(|&n| (0..n).map(|_| AtomicUsize::new(0)).collect())
                .collect();
            pool.install(|| {
                run_adaptive(4, count, |tm| {
                    members.lock().unwrap().push((tm.index(), tm.size()));
                    for (round, &n) in sizes.iter().enumerate() {
                        tm.deal(n, |r| {
                            for i in r {
                                seen[round][i].fetch_add(1, Ordering::Relaxed);
                            }
                        });
                        tm.sync();
                    }
                })
            });
            let mut members = members.into_inner().unwrap();
            members.sort();
            assert_eq!(members, (0..count).map(|i| (i, count)).collect::<Vec<_>>());
            for (round, s) in seen.iter().enumerate() {
                assert!(
                    s.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                    "count {count} round {round}"
                );
            }
        }
    }

    #[test]
    fn a_panic_in_a_step_on_part_of_the_pool_reaches_the_caller() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("pool");
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                run_adaptive(3, 2, |tm| {
                    if tm.index() == 1 {
                        panic!("member fails");
                    }
                    tm.sync();
                })
            })
        }));
        let payload = result.expect_err("the step must panic");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"member fails"));
    }

    #[test]
    fn a_panic_in_a_step_opened_from_outside_the_pool_reaches_the_caller() {
        // A step opened from outside the pool, on the global pool: a member's panic wakes the others
        // and reaches the caller, and the pool runs steps after it.
        let n = rayon::current_num_threads();
        for round in 0..3 {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run_adaptive(n, n, |tm| {
                    if tm.index() + 1 == tm.size() {
                        panic!("member fails");
                    }
                    tm.sync();
                })
            }));
            let payload = result.expect_err("the step must panic");
            assert_eq!(
                payload.downcast_ref::<&str>(),
                Some(&"member fails"),
                "round {round}"
            );
        }
        let members = AtomicUsize::new(0);
        run_adaptive(n, n, |tm| {
            tm.sync();
            members.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(members.into_inner(), n);
    }

    #[test]
    fn steps_on_the_global_pool_from_several_threads_take_turns() {
        // A step's jobs go to whichever threads are free: two steps at once, each with some of the
        // threads, would wait for the rest forever. Opened from outside the pool, they take turns.
        let n = rayon::current_num_threads();
        let steps = std::sync::Arc::new(AtomicUsize::new(0));
        let (done, finished) = std::sync::mpsc::channel();
        for _ in 0..3 {
            let (steps, done) = (steps.clone(), done.clone());
            std::thread::spawn(move || {
                for _ in 0..50 {
                    run_adaptive(n, n, |tm| {
                        tm.sync();
                        if tm.index() == 0 {
                            steps.fetch_add(1, Ordering::Relaxed);
                        }
                        tm.sync();
                    });
                }
                done.send(()).expect("the test waits");
            });
        }
        for _ in 0..3 {
            finished
                .recv_timeout(std::time::Duration::from_secs(120))
                .expect("steps opened from several threads at once never finished");
        }
        assert_eq!(steps.load(Ordering::Relaxed), 150);
    }

    #[test]
    fn a_region_opened_inside_a_step_of_one_thread_runs_solo() {
        // The calling thread alone, outside any pool: a region it opens inside the step must not
        // wait for the step's own turn.
        let n = rayon::current_num_threads();
        let inner_sizes = Mutex::new(Vec::new());
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            s.spawn(|| {
                run_adaptive(n, 1, |tm| {
                    assert_eq!(tm.size(), 1);
                    run(|inner| inner_sizes.lock().unwrap().push(inner.size()));
                });
                done.send(()).expect("the test waits");
            });
            finished
                .recv_timeout(std::time::Duration::from_secs(120))
                .expect("a region inside a step of one thread never finished");
        });
        assert_eq!(*inner_sizes.lock().unwrap(), vec![1]);
        assert!(!IN_REGION.with(|r| r.get()));
    }

    /// The CPUs this process may run on.
    #[cfg(target_os = "linux")]
    fn allowed_cpus() -> Vec<usize> {
        // SAFETY: an all-zero set is a valid empty set, which the call fills.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: `set` is as large as the size given.
        assert_eq!(unsafe { libc::sched_getaffinity(0, size, &mut set) }, 0);
        let cpus = usize::try_from(libc::CPU_SETSIZE).expect("a count");
        // SAFETY: every CPU asked about is below the set's size.
        (0..cpus)
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
            .collect()
    }

    /// Runs the calling thread on `cpus` alone.
    #[cfg(target_os = "linux")]
    fn pin(cpus: &[usize]) {
        // SAFETY: an all-zero set is a valid empty set; each CPU added is one the process may use.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &c in cpus {
            unsafe { libc::CPU_SET(c, &mut set) };
        }
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: `set` is as large as the size given.
        assert_eq!(unsafe { libc::sched_setaffinity(0, size, &set) }, 0);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn members_give_their_core_to_a_teammate_on_it_and_leave_a_shared_core_to_a_free_teammate() {
        // Steps of two members opened from outside the global pool, whose members wait for each
        // other at the ends of deals and for the next step between steps.
        let cpus = allowed_cpus();
        let n = rayon::current_num_threads();
        assert!(
            cpus.len() >= 2 && n >= 2,
            "needs two CPUs and a pool of two threads: CPUs {cpus:?}, {n} threads"
        );
        // Puts the member of index `i` of a step on `at(i)`: the barrier makes them two threads.
        let place = |at: &(dyn Fn(usize) -> Vec<usize> + Sync)| {
            run_adaptive(n, 2, |tm| {
                pin(&at(tm.index()));
                tm.sync();
            })
        };
        let steps = |count: usize| {
            for _ in 0..count {
                run_adaptive(n, 2, |tm| {
                    for _ in 0..8 {
                        tm.deal(64, |r| {
                            for i in r {
                                let mut x = i as u64;
                                for _ in 0..400 {
                                    x = std::hint::black_box(
                                        x.wrapping_mul(6364136223846793005) + 1,
                                    );
                                }
                            }
                        });
                    }
                });
            }
        };
        // Both members on one CPU, as the scheduler may place them where another core is busy.
        place(&|_| vec![cpus[0]]);
        let before = seats::gave_way();
        steps(50);
        let same_cpu = seats::gave_way();
        // One member beside a busy thread, the other on a CPU of its own.
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let busy = {
            let (stop, cpu) = (stop.clone(), cpus[1]);
            std::thread::spawn(move || {
                pin(&[cpu]);
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        place(&|i| vec![cpus[i]]);
        steps(300);
        let shared_core = seats::gave_way();
        stop.store(true, Ordering::Relaxed);
        busy.join().expect("the busy thread");
        place(&|_| cpus.clone());
        assert!(
            same_cpu.0 > before.0,
            "no member gave its CPU to the other: {before:?} -> {same_cpu:?}"
        );
        assert!(
            shared_core.1 > same_cpu.1,
            "the member beside a busy thread never gave way: {same_cpu:?} -> {shared_core:?}"
        );
    }

    #[test]
    fn a_region_opened_inside_a_region_runs_solo() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        let inner_sizes = std::sync::Mutex::new(Vec::new());
        pool.install(|| {
            run(|tm| {
                if tm.index() == 0 {
                    // Only thread 0 opens it: were it a real region, thread 1 (waiting at the outer
                    // barrier below) would never join, and both would wait forever.
                    run(|inner| inner_sizes.lock().unwrap().push(inner.size()));
                }
                tm.sync();
            })
        });
        assert_eq!(*inner_sizes.lock().unwrap(), vec![1]);
    }
}
