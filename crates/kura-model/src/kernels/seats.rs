//! Where the compute pool's threads run, and whether another process shares their cores: what a
//! thread that has nothing to do reads to decide between spinning and giving its core away.
//!
//! A thread of a step ([`super::team`]) that waits spins, and between steps it stays awake a while
//! for the next one: on a core of its own that costs nothing, and it starts the next step at once. Two
//! cases make spinning a loss. Where a teammate runs on the same core (the scheduler may put two
//! threads of the pool on one core, as it does when another process keeps the other core busy), the
//! spinner takes the time of the teammate it waits for. And where this thread's core is shared with
//! another busy process while a teammate has a core to itself, the teammate can do the step's work at
//! full speed: this thread, staying awake beside the busy process, takes its chunks at half speed and
//! holds the team (beside one busy process on one of two cores, decode was up to 18 % slower than with
//! threads that slept between steps). In both cases the thread yields its core instead.
//!
//! Each thread of the pool, while it takes part in a step or waits for the next, has a seat: its CPU
//! (`sched_getcpu`, which reads a per-thread word the kernel keeps) and whether its core is shared,
//! from the share of the time it spent ready but not running (`/proc/thread-self/schedstat`'s second
//! field) over windows of [`WINDOW_NS`]. Above [`SHARED_ABOVE`] of a window the core counts as shared:
//! alone on its core a thread waits for nothing but the short work of the engine's own threads.
//! Where that file cannot be read the core is never counted as shared.

use std::sync::atomic::{AtomicU64, Ordering};

/// The least time over which a thread's share of waiting to run is measured.
pub const WINDOW_NS: u64 = 5_000_000;
/// The share of a window spent ready but not running above which a core counts as shared (a busy
/// process beside the thread takes about half).
pub const SHARED_ABOVE: f64 = 0.2;
/// Threads of the pool that have a seat (a pool larger than this seats its first threads only).
const SEATS: usize = 256;

/// Bit of a seat's word saying its core is shared with another busy process.
const SHARED: u64 = 1 << 32;

#[repr(align(64))]
struct Seat(AtomicU64);

/// Per thread of the pool (by its index in the pool): 0 while the thread takes no part in a step nor
/// waits for one (or sleeps), otherwise its CPU + 1 in the low 32 bits and [`SHARED`].
static SEATED: [Seat; SEATS] = [const { Seat(AtomicU64::new(0)) }; SEATS];

thread_local! {
    /// This thread's seat, while it has one.
    static MINE: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    /// This thread's share of waiting to run, measured.
    static WAITING: std::cell::RefCell<Waiting> = const { std::cell::RefCell::new(Waiting::new()) };
}

/// A thread's share of time spent ready but not running, measured over windows.
#[derive(Debug)]
struct Waiting {
    /// The thread's own statistics file, once opened (`Some(None)`: it cannot be).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    file: Option<Option<std::fs::File>>,
    /// When the window began (ns) and the thread's total waiting time then.
    began: Option<(u64, u64)>,
    /// Whether the last full window found the core shared.
    shared: bool,
}

impl Waiting {
    const fn new() -> Waiting {
        Waiting {
            file: None,
            began: None,
            shared: false,
        }
    }

    /// Takes the thread's total time spent waiting to run, `waited` ns, at `now` ns, and says whether
    /// the core is shared: as found by the last window of at least [`WINDOW_NS`].
    fn observe(&mut self, now: u64, waited: u64) -> bool {
        match self.began {
            Some((t0, w0)) if now >= t0 => {
                let span = now - t0;
                if span >= WINDOW_NS {
                    let share = waited.saturating_sub(w0) as f64 / span as f64;
                    self.shared = share > SHARED_ABOVE;
                    self.began = Some((now, waited));
                }
            }
            _ => self.began = Some((now, waited)),
        }
        self.shared
    }

    /// Whether the core is shared, reading the thread's statistics only once a window has passed.
    fn update(&mut self, now: u64) -> bool {
        if let Some((t0, _)) = self.began {
            if now.saturating_sub(t0) < WINDOW_NS {
                return self.shared;
            }
        }
        match self.waited() {
            Some(waited) => self.observe(now, waited),
            None => self.shared,
        }
    }

    /// The thread's total time spent waiting to run, from its statistics file (opened once).
    #[cfg(target_os = "linux")]
    fn waited(&mut self) -> Option<u64> {
        let file = self
            .file
            .get_or_insert_with(|| std::fs::File::open("/proc/thread-self/schedstat").ok());
        let mut buf = [0u8; 128];
        let n = std::os::unix::fs::FileExt::read_at(file.as_ref()?, &mut buf, 0).ok()?;
        waited_ns(&buf[..n])
    }

    #[cfg(not(target_os = "linux"))]
    fn waited(&mut self) -> Option<u64> {
        None
    }
}

/// The time a thread spent ready but not running, from its `schedstat` (`<ran> <waited> <slices>`,
/// nanoseconds), or `None` where the text is not of that form.
fn waited_ns(schedstat: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(schedstat).ok()?;
    let mut fields = text.split_whitespace();
    fields.next()?.parse::<u64>().ok()?;
    fields.next()?.parse().ok()
}

/// Nanoseconds since the first call in this process.
fn now_ns() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let ns = EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_nanos();
    u64::try_from(ns).unwrap_or(u64::MAX)
}

/// The CPU this thread runs on, + 1 (0 where unknown).
fn cpu() -> u64 {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: no arguments; reads the CPU number the kernel keeps for this thread.
        let c = unsafe { libc::sched_getcpu() };
        u64::try_from(c).map_or(0, |c| c + 1)
    }
    #[cfg(not(target_os = "linux"))]
    0
}

/// Gives this thread of the current pool a seat (a step's job, until [`leave`]): its CPU, and whether
/// its core is shared, measured once a window has passed. Threads outside a pool have none.
pub fn take() {
    let Some(i) = rayon::current_thread_index().filter(|&i| i < SEATS) else {
        return;
    };
    MINE.with(|m| m.set(Some(i)));
    let shared = WAITING.with(|w| w.borrow_mut().update(now_ns()));
    SEATED[i]
        .0
        .store(cpu() | if shared { SHARED } else { 0 }, Ordering::Relaxed);
}

/// Gives up this thread's seat (it goes back to the pool's idle loop).
pub fn leave() {
    if let Some(i) = MINE.with(|m| m.take()) {
        SEATED[i].0.store(0, Ordering::Relaxed);
    }
}

/// Marks this seated thread as running again (after a sleep, or to note a move to another CPU):
/// records its CPU.
pub fn here() {
    record_cpu(cpu());
}

/// Marks this seated thread as asleep: nobody should give way to it.
pub fn away() {
    record_cpu(0);
}

/// Records `cpu` (+ 1; 0 for none) in this thread's seat, if it has one, keeping whether it is shared.
fn record_cpu(cpu: u64) {
    if let Some(i) = MINE.with(|m| m.get()) {
        let word = &SEATED[i].0;
        let shared = word.load(Ordering::Relaxed) & SHARED;
        word.store(cpu | shared, Ordering::Relaxed);
    }
}

/// Why a thread gave its core away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// A teammate runs on the same CPU.
    SameCpu,
    /// Between steps, this thread's core is shared with another busy process and a teammate's is not.
    SharedCore,
}

/// Times a thread gave its core away, by [`Why`] (in that order), since the process started.
static GAVE_WAY: [AtomicU64; 2] = [const { AtomicU64::new(0) }; 2];

/// Times the pool's threads gave their cores away: to a teammate on the same CPU, and from a shared
/// core to a free teammate.
pub fn gave_way() -> (u64, u64) {
    (
        GAVE_WAY[0].load(Ordering::Relaxed),
        GAVE_WAY[1].load(Ordering::Relaxed),
    )
}

/// Gives this seated thread's core away (yields it, then records where the thread runs again) where
/// that beats spinning: a teammate runs on the same CPU, or, with `between_steps`, this thread's core
/// is shared with another busy process while a teammate's is not. Says whether it did.
pub fn give_way(between_steps: bool) -> bool {
    let Some(me) = MINE.with(|m| m.get()) else {
        return false;
    };
    let threads = rayon::current_num_threads().min(SEATS);
    let seats = (0..threads).map(|i| SEATED[i].0.load(Ordering::Relaxed));
    let mine = SEATED[me].0.load(Ordering::Relaxed);
    let Some(why) = should_give_way(me, mine, seats, between_steps) else {
        return false;
    };
    GAVE_WAY[why as usize].fetch_add(1, Ordering::Relaxed);
    std::thread::yield_now();
    here();
    true
}

/// [`give_way`] for the seat `me` whose word is `mine`, among the words of every seat.
fn should_give_way(
    me: usize,
    mine: u64,
    seats: impl Iterator<Item = u64>,
    between_steps: bool,
) -> Option<Why> {
    let cpu_of = |w: u64| w & (SHARED - 1);
    if cpu_of(mine) == 0 {
        return None;
    }
    let mut free_teammate = false;
    for (i, w) in seats.enumerate() {
        if i == me || cpu_of(w) == 0 {
            continue;
        }
        if cpu_of(w) == cpu_of(mine) {
            return Some(Why::SameCpu);
        }
        free_teammate |= w & SHARED == 0;
    }
    (between_steps && mine & SHARED != 0 && free_teammate).then_some(Why::SharedCore)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seat's word: on `cpu` (0-based), shared or not.
    fn seat(cpu: u64, shared: bool) -> u64 {
        (cpu + 1) | if shared { SHARED } else { 0 }
    }

    #[test]
    fn a_thread_gives_way_to_a_teammate_on_its_cpu_and_never_to_one_elsewhere() {
        let give = |seats: &[u64], me: usize, between| {
            should_give_way(me, seats[me], seats.iter().copied(), between)
        };
        let seats = [seat(0, false), seat(0, false), seat(1, false)];
        assert_eq!(give(&seats, 0, false), Some(Why::SameCpu));
        assert_eq!(give(&seats, 1, true), Some(Why::SameCpu));
        assert_eq!(give(&seats, 2, true), None);
        // A teammate asleep (no CPU) or without a seat takes nothing from this thread.
        let seats = [seat(0, false), seat(0, false) & SHARED, 0];
        assert_eq!(give(&seats, 0, true), None);
        // Nor does a thread whose own CPU is unknown give way.
        assert_eq!(give(&[0, seat(0, false)], 0, true), None);
    }

    #[test]
    fn a_thread_on_a_shared_core_gives_way_between_steps_only_to_a_teammate_with_a_core_of_its_own()
    {
        let give = |seats: &[u64], me: usize, between| {
            should_give_way(me, seats[me], seats.iter().copied(), between)
        };
        // One busy process on core 1: the thread there gives way between steps, the other does not.
        let one_busy = [seat(0, false), seat(1, true)];
        assert_eq!(give(&one_busy, 1, true), Some(Why::SharedCore));
        assert_eq!(give(&one_busy, 1, false), None);
        assert_eq!(give(&one_busy, 0, true), None);
        // Every core busy: nobody would do the work faster, nobody gives way.
        let all_busy = [seat(0, true), seat(1, true)];
        assert_eq!(give(&all_busy, 0, true), None);
        assert_eq!(give(&all_busy, 1, true), None);
        // A free teammate that is asleep is not waiting for the step.
        assert_eq!(give(&[0, seat(1, true)], 1, true), None);
    }

    #[test]
    fn a_core_is_shared_when_the_thread_waited_to_run_more_than_a_fifth_of_a_window() {
        let ms = 1_000_000;
        let mut w = Waiting::new();
        assert!(!w.observe(0, 0));
        // Within a window nothing changes, whatever the wait.
        assert!(!w.observe(WINDOW_NS / 2, WINDOW_NS / 2));
        // Half of a 6 ms window spent waiting: shared.
        assert!(w.observe(6 * ms, 3 * ms));
        // Then 0.5 ms of waiting in a 10 ms window: not shared.
        assert!(!w.observe(16 * ms, 3 * ms + ms / 2));
        assert!(!w.observe(26 * ms, 4 * ms));
        // A clock or counter that goes back starts a new window instead of dividing by it.
        assert!(!w.observe(20 * ms, 0));
        assert!(w.observe(30 * ms, 5 * ms));
    }

    #[test]
    fn the_waiting_time_is_the_second_field_of_schedstat_and_bad_text_is_none() {
        assert_eq!(waited_ns(b"1608101 4242 17\n"), Some(4242));
        assert_eq!(waited_ns(b"1608101\n"), None);
        assert_eq!(waited_ns(b"x 4242 17"), None);
        assert_eq!(waited_ns(b"1 -3 2"), None);
        assert_eq!(waited_ns(b""), None);
        assert_eq!(waited_ns(&[0xff, 0x20, 0x31]), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_threads_schedstat_reads_on_linux() {
        let text = std::fs::read("/proc/thread-self/schedstat")
            .expect("/proc/thread-self/schedstat is readable on Linux");
        assert!(waited_ns(&text).is_some(), "{text:?}");
    }
}
