//! One parallel region per forward step: every thread of the pool runs the whole step, takes its share
//! of each operation, and meets the others at a spin barrier between operations.
//!
//! Waking a thread pool costs microseconds; a decode step of a small model is a few hundred operations
//! of a few microseconds each, so waking the pool per operation (a `par_iter` per product) spends more
//! time starting work than doing it, and a second thread made decode slower. A region wakes the pool once
//! per step; a barrier between operations costs a few hundred nanoseconds. A thread that waits long
//! (its peer descheduled on a busy machine) yields its core instead of spinning.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The calling thread's place in a region.
pub struct Team<'a> {
    tid: usize,
    n: usize,
    barrier: Option<&'a SpinBarrier>,
}

impl Team<'_> {
    /// A team of one: every share is the whole, and `sync` does nothing.
    pub fn solo() -> Team<'static> {
        Team {
            tid: 0,
            n: 1,
            barrier: None,
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

/// Runs `f` on every thread of the current rayon pool (on the calling thread alone when the pool has one
/// thread) and returns when all are done.
pub fn run<F: Fn(&Team<'_>) + Sync>(f: F) {
    let n = rayon::current_num_threads();
    if n <= 1 {
        f(&Team::solo());
        return;
    }
    let barrier = SpinBarrier::new(n);
    rayon::broadcast(|ctx| {
        let team = Team {
            tid: ctx.index(),
            n: ctx.num_threads(),
            barrier: Some(&barrier),
        };
        // A thread that panics must not leave the others waiting at a barrier forever: it poisons the
        // barrier, they panic in turn, and rayon hands the panic to the caller.
        if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&team))) {
            barrier.poisoned.store(true, Ordering::Release);
            std::panic::resume_unwind(panic);
        }
    });
}

/// A reusable barrier for a fixed number of threads that spins briefly, then yields.
pub struct SpinBarrier {
    n: usize,
    arrived: AtomicUsize,
    generation: AtomicUsize,
    poisoned: AtomicBool,
}

/// Spins before a waiting thread starts yielding its core.
const SPINS_BEFORE_YIELD: u32 = 1_000;

impl SpinBarrier {
    pub fn new(n: usize) -> Self {
        SpinBarrier {
            n,
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
        }
    }

    pub fn wait(&self) {
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            // Last to arrive: reset before releasing, so that no thread can arrive at the next use
            // before the count is back to zero.
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == generation {
            if self.poisoned.load(Ordering::Acquire) {
                panic!("another thread of the parallel region panicked");
            }
            if spins < SPINS_BEFORE_YIELD {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// A slice that the threads of a region write in disjoint parts.
#[derive(Clone, Copy)]
pub struct SharedMut<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: a SharedMut only hands out parts through `unsafe` methods whose callers guarantee that no two
// threads touch the same element between two barriers unless both only read.
unsafe impl<T: Send> Send for SharedMut<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub fn new(s: &mut [T]) -> Self {
        SharedMut {
            ptr: s.as_mut_ptr(),
            len: s.len(),
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
    /// No other thread reads or writes any of them until the next barrier; the slice this was made from
    /// outlives the use.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn part_mut(&self, r: Range<usize>) -> &mut [T] {
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
    /// No thread writes any element until the next barrier; the slice outlives the use.
    pub unsafe fn all(&self) -> &[T] {
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
        assert!(result.is_err());
    }
}
