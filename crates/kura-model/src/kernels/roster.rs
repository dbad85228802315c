//! How many of the compute pool's threads take part in a step: all of them, or fewer while a core is
//! taken by something else.
//!
//! A step's threads meet at hundreds of barriers, so a thread that shares its core with another busy
//! process holds every other thread at each one for as long as the scheduler keeps it off its core (a
//! tick, milliseconds). On 2 cores with a busy process on one of them, a team of 2 decoded more slowly
//! than 1 thread; a team that leaves one thread out runs at the speed of the free cores. Which thread
//! takes which share never changes a token's bits, so the team's size may change from one step to the
//! next.
//!
//! After each step every member says whether it was held up: it was switched out involuntarily and
//! waited on a run queue (Linux's `/proc/thread-self/schedstat`) for more than [`HELD_UP_NS`] and more
//! than an eighth of the step. After [`HELD_UP_STEPS`] held-up steps in a row the team shrinks by one;
//! after `wait` clean steps it grows by one again, `wait` doubling with each shrink (from
//! [`FIRST_WAIT`] to [`LONGEST_WAIT`]) and starting over once the whole team has run [`SETTLED`] clean
//! steps. One preemption (a kernel thread, a neighbour's burst) never shrinks the team; a busy core,
//! which holds its thread up at nearly every step, does within three.

use std::sync::Mutex;
use std::time::Instant;

/// Held-up steps in a row that shrink the team.
pub const HELD_UP_STEPS: usize = 3;
/// Clean steps before the first growth.
pub const FIRST_WAIT: usize = 4;
/// The most clean steps waited before growing.
pub const LONGEST_WAIT: usize = 256;
/// Clean steps of the whole team after which the wait starts over from [`FIRST_WAIT`].
pub const SETTLED: usize = 1024;
/// The least time on a run queue, in a step, that counts as being held up.
pub const HELD_UP_NS: u64 = 100_000;

/// The team size of one pool and what decides it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roster {
    /// Threads in the pool.
    pub threads: usize,
    /// Threads that take part in the next step, 1 to `threads`.
    pub count: usize,
    held_up: usize,
    clean: usize,
    wait: usize,
}

impl Roster {
    pub fn new(threads: usize) -> Roster {
        Roster {
            threads,
            count: threads.max(1),
            held_up: 0,
            clean: 0,
            wait: FIRST_WAIT,
        }
    }

    /// Takes the outcome of a step of `self.count` threads: whether any member was held up.
    pub fn after_step(&mut self, held_up: bool) {
        if held_up {
            self.clean = 0;
            self.held_up += 1;
            if self.held_up >= HELD_UP_STEPS && self.count > 1 {
                self.count -= 1;
                self.held_up = 0;
                self.wait = (self.wait * 2).min(LONGEST_WAIT);
                tracing::debug!(
                    threads = self.count,
                    "a compute thread was held up by a busy core; team shrinks"
                );
            }
            return;
        }
        self.held_up = 0;
        self.clean += 1;
        if self.count < self.threads && self.clean >= self.wait {
            self.count += 1;
            self.clean = 0;
            tracing::debug!(threads = self.count, "team grows");
        } else if self.count == self.threads && self.clean >= SETTLED {
            self.wait = FIRST_WAIT;
            self.clean = 0;
        }
    }
}

/// The global pool's roster, once [`enable`] has been called (by `set_threads`, which builds that pool):
/// the steps of pools built elsewhere (tests, benchmarks) keep every thread.
static GLOBAL: Mutex<Option<Roster>> = Mutex::new(None);

/// Lets the steps run on the global pool (`threads` threads) adapt their team size.
pub fn enable(threads: usize) {
    if Mark::now().is_some() {
        *GLOBAL.lock().unwrap_or_else(|e| e.into_inner()) = Some(Roster::new(threads));
    }
}

/// The team size for the next step on the global pool of `threads` threads, or `None` where the team
/// does not adapt (not enabled, or another pool).
pub fn global_count(threads: usize) -> Option<usize> {
    let roster = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    roster
        .as_ref()
        .filter(|r| r.threads == threads)
        .map(|r| r.count)
}

/// Records the outcome of a step run on the global pool.
pub fn global_after_step(threads: usize, held_up: bool) {
    let mut roster = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(r) = roster.as_mut().filter(|r| r.threads == threads) {
        r.after_step(held_up);
    }
}

/// What a thread's scheduler statistics were when it started its share of a step.
pub struct Mark {
    at: Instant,
    run_delay_ns: u64,
    involuntary: i64,
}

impl Mark {
    /// This thread's statistics now, or `None` where they cannot be read.
    pub fn now() -> Option<Mark> {
        let involuntary = involuntary_switches()?;
        Some(Mark {
            at: Instant::now(),
            run_delay_ns: run_delay_ns()?,
            involuntary,
        })
    }

    /// Whether this thread was held up since the mark: switched out involuntarily, and on a run queue
    /// for more than [`HELD_UP_NS`] and more than an eighth of the time since. The run queue's time is
    /// read only after an involuntary switch (a `getrusage`), as most steps have none.
    pub fn held_up(&self) -> bool {
        if involuntary_switches().is_none_or(|n| n == self.involuntary) {
            return false;
        }
        let Some(run_delay_ns) = run_delay_ns() else {
            return false;
        };
        let waited = run_delay_ns.saturating_sub(self.run_delay_ns);
        let elapsed = u64::try_from(self.at.elapsed().as_nanos()).unwrap_or(u64::MAX);
        waited > HELD_UP_NS && waited.saturating_mul(8) > elapsed
    }
}

/// This thread's time on a run queue (ns).
#[cfg(target_os = "linux")]
fn run_delay_ns() -> Option<u64> {
    use std::os::unix::fs::FileExt;
    thread_local! {
        /// This thread's schedstat, opened once: a read at offset 0 gives the figures of the moment.
        static SCHEDSTAT: Option<std::fs::File> =
            std::fs::File::open("/proc/thread-self/schedstat").ok();
    }
    // "<ns on the CPU> <ns on a run queue> <time slices>": three decimal u64s, well under 96 bytes.
    let mut buf = [0u8; 96];
    let len = SCHEDSTAT.with(|f| f.as_ref()?.read_at(&mut buf, 0).ok())?;
    let text = std::str::from_utf8(&buf[..len]).ok()?;
    text.split_whitespace().nth(1)?.parse().ok()
}

/// This thread's involuntary context switches.
#[cfg(target_os = "linux")]
fn involuntary_switches() -> Option<i64> {
    // SAFETY: getrusage writes a plain struct that is zeroed here first.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage of this thread.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) } != 0 {
        return None;
    }
    Some(usage.ru_nivcsw)
}

#[cfg(not(target_os = "linux"))]
fn run_delay_ns() -> Option<u64> {
    None
}

#[cfg(not(target_os = "linux"))]
fn involuntary_switches() -> Option<i64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `steps` steps, each held up or not.
    fn steps(r: &mut Roster, held_up: bool, steps: usize) {
        for _ in 0..steps {
            r.after_step(held_up);
        }
    }

    /// Clean steps until the team grows.
    fn clean_until_it_grows(r: &mut Roster) -> usize {
        let count = r.count;
        let mut clean = 0;
        while r.count == count {
            r.after_step(false);
            clean += 1;
        }
        clean
    }

    #[test]
    fn one_preemption_never_shrinks_the_team() {
        let mut r = Roster::new(4);
        for _ in 0..100 {
            steps(&mut r, true, HELD_UP_STEPS - 1);
            r.after_step(false);
        }
        assert_eq!(r.count, 4);
    }

    #[test]
    fn a_busy_core_shrinks_the_team_down_to_one_thread() {
        let mut r = Roster::new(3);
        steps(&mut r, true, HELD_UP_STEPS);
        assert_eq!(r.count, 2);
        steps(&mut r, true, 2 * HELD_UP_STEPS);
        assert_eq!(r.count, 1, "never fewer than one");
        steps(&mut r, true, 10 * HELD_UP_STEPS);
        assert_eq!(r.count, 1);
        // Two shrinks: the wait doubled twice.
        assert_eq!(clean_until_it_grows(&mut r), 4 * FIRST_WAIT);
        assert_eq!(r.count, 2);
    }

    #[test]
    fn the_wait_doubles_with_each_shrink_and_starts_over_once_settled() {
        let mut r = Roster::new(2);
        let mut waits = Vec::new();
        for _ in 0..8 {
            steps(&mut r, true, HELD_UP_STEPS);
            assert_eq!(r.count, 1);
            waits.push(clean_until_it_grows(&mut r));
        }
        assert_eq!(waits, [8, 16, 32, 64, 128, 256, 256, 256]);
        steps(&mut r, false, SETTLED);
        steps(&mut r, true, HELD_UP_STEPS);
        assert_eq!(clean_until_it_grows(&mut r), 2 * FIRST_WAIT);
    }

    #[test]
    fn a_pool_of_one_stays_one() {
        let mut r = Roster::new(1);
        for i in 0..50 {
            r.after_step(i % 2 == 0);
            assert_eq!(r.count, 1);
        }
    }

    /// Keeps the calling thread on one of the CPUs it may use.
    #[cfg(target_os = "linux")]
    fn pin_to_one_cpu() {
        // SAFETY: plain syscalls on a zeroed cpu_set_t of this thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(
                libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
                0
            );
            let cpu = (0..libc::CPU_SETSIZE as usize)
                .find(|&c| libc::CPU_ISSET(c, &set))
                .expect("a CPU this thread may use");
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut one);
            assert_eq!(
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one),
                0
            );
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_thread_that_shares_its_core_with_a_busy_one_is_held_up() {
        // This thread and a spinning one on the same CPU, both busy for 200 ms: the scheduler takes
        // turns between them, and each waits on the run queue about half of the time.
        let busy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        std::thread::scope(|s| {
            pin_to_one_cpu();
            let spinning = busy.clone();
            // A thread inherits its creator's affinity: the spinner shares this thread's CPU.
            s.spawn(move || {
                while spinning.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            });
            let mark = Mark::now().expect("Linux gives a thread's scheduler statistics");
            let start = Instant::now();
            while start.elapsed() < std::time::Duration::from_millis(200) {
                std::hint::spin_loop();
            }
            let held_up = mark.held_up();
            busy.store(false, std::sync::atomic::Ordering::Relaxed);
            assert!(
                held_up,
                "200 ms beside a busy thread on one CPU is being held up"
            );
        });
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_thread_that_only_sleeps_is_not_held_up() {
        // Sleeping is voluntary: it neither waits on a run queue nor counts as a preemption.
        let mark = Mark::now().expect("Linux gives a thread's scheduler statistics");
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert!(!mark.held_up());
    }
}
