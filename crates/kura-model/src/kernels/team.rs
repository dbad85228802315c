//! One parallel region per forward step: every thread of the pool runs the whole step, takes its share
//! of each operation, and meets the others at a spin barrier between operations.
//!
//! Waking a thread pool costs microseconds; a decode step of a small model is a few hundred operations
//! of a few microseconds each, so waking the pool per operation (a `par_iter` per product) spends more
//! time starting work than doing it, and a second thread made decode slower. A region wakes the pool once
//! per step; a barrier between operations costs a few hundred nanoseconds. A thread that waits long
//! (its peer descheduled on a busy machine) goes to sleep, and the last to arrive wakes it: a sleeper
//! leaves its core to whatever else runs there and, woken, gets it back at once, where a thread that
//! yielded waits its turn behind the other processes, a time slice (milliseconds) at every barrier.

use super::roster;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

/// The calling thread's place in a region.
pub struct Team<'a> {
    tid: usize,
    n: usize,
    barrier: Option<&'a SpinBarrier>,
    /// How many [`Team::deal`]s this thread has run in the region: every thread runs the same ones, so
    /// the count names the same deal on each.
    deals: std::cell::Cell<usize>,
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

    /// This thread's contiguous share of `0..items`: shares differ in size by at most one.
    pub fn range(&self, items: usize) -> Range<usize> {
        split(items, self.n, self.tid)
    }

    /// Runs `f` on chunks of `0..items` that together cover each item once, dealt to the threads as they
    /// come for more: a thread that runs slower (a shared memory bus, a neighbour on its core) takes
    /// fewer, and the team meets at the next barrier sooner than with fixed shares. The chunks are
    /// contiguous and shrink as the items run out (a share of half of what is left, split among the
    /// threads), so most of a product streams in long runs. Which thread takes an item never changes
    /// what is computed for it.
    ///
    /// Every thread of the team calls `deal` with the same `items`, and two deals are always separated
    /// by a barrier ([`Team::sync`]): a deal's counter is the one the deal before last used, and is
    /// cleared while the previous one is in use.
    pub fn deal(&self, items: usize, mut f: impl FnMut(Range<usize>)) {
        let Some(barrier) = self.barrier else {
            if items > 0 {
                f(0..items);
            }
            return;
        };
        let k = self.deals.get();
        self.deals.set(k + 1);
        if self.tid == 0 {
            // Last used by deal k − 1, which every thread finished before the barrier that ended it;
            // deal k + 1 starts after the barrier that ends this one.
            barrier.counters[(k + 1) % 2].store(0, Ordering::Relaxed);
        }
        let counter = &barrier.counters[k % 2];
        // Chunk `j` starts at `start`; a thread's chunks come in increasing order.
        let (mut j, mut start) = (0, 0);
        loop {
            let chunk = counter.fetch_add(1, Ordering::Relaxed);
            while j < chunk && start < items {
                start += chunk_len(items - start, self.n);
                j += 1;
            }
            if start >= items {
                break;
            }
            f(start..start + chunk_len(items - start, self.n));
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

/// The length of [`Team::deal`]'s next chunk for `n` threads when `left` items are left: a `1 / (2n)`
/// share, at least one.
fn chunk_len(left: usize, n: usize) -> usize {
    left.div_ceil(2 * n).max(1)
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
    let n = rayon::current_num_threads();
    if n <= 1 || IN_REGION.with(|r| r.get()) {
        f(&Team::solo());
        return;
    }
    if rayon::current_thread_index().is_none() {
        if let Some(count) = roster::global_count(n) {
            run_adaptive(n, count, f);
            return;
        }
    }
    let barrier = SpinBarrier::new(n);
    let first_panic = std::sync::Mutex::new(None);
    rayon::broadcast(|ctx| {
        let team = Team::member_of(ctx.index(), ctx.num_threads(), &barrier);
        member(&team, &first_panic, &f);
    });
    rethrow(first_panic);
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

/// A step on `count` of the global pool's `n` threads (the calling thread alone for one), which then
/// tell the roster whether any of them was held up.
fn run_adaptive<F: Fn(&Team<'_>) + Sync>(n: usize, count: usize, f: F) {
    let _one_at_a_time = ADAPTIVE_STEP.lock().unwrap_or_else(|e| e.into_inner());
    let held_up = AtomicBool::new(false);
    let note = |mark: Option<roster::Mark>| {
        if mark.is_some_and(|m| m.held_up()) {
            held_up.store(true, Ordering::Relaxed);
        }
    };
    let first_panic = Mutex::new(None);
    if count <= 1 {
        // As a member, so that a region opened inside runs solo (it would wait for this step's lock).
        let mark = roster::Mark::now();
        member(&Team::solo(), &first_panic, &f);
        note(mark);
    } else {
        let barrier = SpinBarrier::new(count);
        let slots = AtomicUsize::new(0);
        // The jobs go to whichever threads come for them first: a thread whose core is busy comes last
        // and finds none left.
        rayon::scope(|s| {
            for _ in 0..count {
                s.spawn(|_| {
                    let team =
                        Team::member_of(slots.fetch_add(1, Ordering::Relaxed), count, &barrier);
                    let mark = roster::Mark::now();
                    member(&team, &first_panic, &f);
                    note(mark);
                });
            }
        });
    }
    rethrow(first_panic);
    roster::global_after_step(n, held_up.load(Ordering::Relaxed));
}

/// A reusable barrier for a fixed number of threads that spins briefly, then sleeps. The counter that
/// arrivals write, the generation that waiters poll and the count of sleepers sit on separate cache
/// lines.
pub struct SpinBarrier {
    n: usize,
    arrived: CacheLine<AtomicUsize>,
    generation: CacheLine<AtomicUsize>,
    sleepers: CacheLine<AtomicUsize>,
    /// The next chunk of the current [`Team::deal`]s, by the deal's parity.
    counters: [CacheLine<AtomicUsize>; 2],
    poisoned: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
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
        SpinBarrier {
            n,
            arrived: CacheLine(AtomicUsize::new(0)),
            generation: CacheLine(AtomicUsize::new(0)),
            sleepers: CacheLine(AtomicUsize::new(0)),
            counters: [
                CacheLine(AtomicUsize::new(0)),
                CacheLine(AtomicUsize::new(0)),
            ],
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
        let limit = SPIN_LIMIT.with(|l| l.get());
        let mut spins = 0u32;
        let mut slept = false;
        while self.generation.load(Ordering::Acquire) == generation {
            if self.poisoned.load(Ordering::Acquire) {
                std::panic::resume_unwind(Box::new(Poisoned));
            }
            if spins < limit {
                spins += 1;
                std::hint::spin_loop();
            } else {
                self.sleep(generation);
                slept = true;
            }
        }
        let next = if slept {
            (limit / 2).max(MIN_SPINS)
        } else {
            limit.saturating_mul(2).min(MAX_SPINS)
        };
        SPIN_LIMIT.with(|l| l.set(next));
    }

    /// Sleeps until the generation moves on from `generation` or the barrier is poisoned.
    fn sleep(&self, generation: usize) {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        while self.generation.load(Ordering::SeqCst) == generation
            && !self.poisoned.load(Ordering::SeqCst)
        {
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
    fn chunks_shrink_to_one_and_cover_the_items() {
        for n in 1..=16 {
            for items in [1usize, 2, 3, 36, 60, 192, 3072] {
                let (mut start, mut last) = (0, usize::MAX);
                while start < items {
                    let len = chunk_len(items - start, n);
                    assert!(len >= 1 && len <= last && start + len <= items);
                    (start, last) = (start + len, len);
                }
                assert_eq!(start, items);
                assert_eq!(last, 1, "the last chunks are single items");
            }
        }
    }

    #[test]
    fn barrier_orders_phases_across_threads() {
        // Each round every thread writes its own cell, then reads all cells: after the barrier every
        // thread must see every write of the round.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("pool");
        let mut cells = vec![0usize; 3];
        let shared = SharedMut::new(&mut cells);
        let bad = AtomicUsize::new(0);
        pool.install(|| {
            run(|tm| {
                for round in 1..=500 {
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
