//! How many of the compute pool's threads take part in a step: all of them, or fewer while a core is
//! taken by something else.
//!
//! A step's work is dealt in chunks to whichever threads come for them ([`super::team`]), so a thread
//! that shares its core with a busy process holds the others during the step only while it holds a
//! chunk. It holds them at the step's end too: the step returns when every member has left it, and a
//! member that is off its core then is back only when the scheduler gives it a turn (a time slice,
//! milliseconds). Which thread takes which chunk never changes a token's
//! bits, so the team's size may change from one step to the next.
//!
//! A step was held up when its last member left it more than [`HELD_UP_NS`] after the first, and more
//! than the step's time divided by the team's size after it: the wait cost more than the member's share
//! of the work brought. With 16 threads, one whose core is busy costs more than it brings; with 2 on
//! two busy cores, each brings half of the work and the team keeps both. After [`HELD_UP_STEPS`]
//! held-up steps in a row the team shrinks by one; after `wait` clean steps it grows by one again,
//! `wait` doubling with each shrink (from [`FIRST_WAIT`] to [`LONGEST_WAIT`]) and starting over once
//! the whole team has run [`SETTLED`] clean steps. One preemption (a kernel thread, a neighbour's
//! burst) never shrinks the team; a busy core, which holds its thread up at most steps, does within
//! three.
//!
//! Steps of few tokens (decode) are also paced ([`super::pace`]): they read every weight for a handful of
//! tokens, so past some team size another thread adds no bandwidth, only one more member to deal to
//! and wait for, and a step can take longer on 16 threads than on 12. Now and then such a step runs
//! on a trial size, one step of the current size and one of the trial's in turn, and the trial's size
//! is kept where its steps were clearly faster; steps of more tokens (prefill, compute bound) keep
//! every thread the roster allows. The size never changes a token's bits.

use std::sync::Mutex;
use std::time::Duration;

use super::pace::{Pace, PaceReport, PacedStep, PACED_TOKENS};

/// Held-up steps in a row that shrink the team.
pub const HELD_UP_STEPS: usize = 3;
/// Clean steps before the first growth.
pub const FIRST_WAIT: usize = 4;
/// The most clean steps waited before growing.
pub const LONGEST_WAIT: usize = 256;
/// Clean steps of the whole team after which the wait starts over from [`FIRST_WAIT`].
pub const SETTLED: usize = 1024;
/// The least wait for a step's last member that counts as being held up.
pub const HELD_UP_NS: u64 = 100_000;

/// The team size of one pool and what decides it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roster {
    /// Threads in the pool.
    pub threads: usize,
    /// Threads that take part in the next step, 1 to `threads` (a paced step may take fewer).
    pub count: usize,
    held_up: usize,
    clean: usize,
    wait: usize,
    /// The team size of steps of few tokens, at most `count`.
    pub pace: Pace,
}

impl Roster {
    pub fn new(threads: usize) -> Roster {
        Roster {
            threads,
            count: threads.max(1),
            held_up: 0,
            clean: 0,
            wait: FIRST_WAIT,
            pace: Pace::new(threads.max(1)),
        }
    }

    /// The team size of the next step: `count`, or for a step of `tokens` new tokens, at most
    /// [`PACED_TOKENS`], the paced size (which may be a trial's).
    pub fn next_size(&mut self, tokens: Option<usize>) -> usize {
        match tokens {
            Some(t) if t <= PACED_TOKENS => self.pace.next_size(self.count),
            _ => self.count,
        }
    }

    /// Takes the outcome of a step: the size it ran on and how long it took, when it was paced
    /// ([`Roster::next_size`]), and whether a member held it up. A held-up step of fewer threads than
    /// the count counts as held up; a clean one says nothing of the threads it left out and does not
    /// bring one back.
    pub fn after_sized_step(&mut self, paced: Option<PacedStep>, held_up: bool) {
        if let Some(step) = paced.filter(|s| s.tokens <= PACED_TOKENS) {
            self.pace.after_step(step, held_up);
            if !held_up && step.size < self.count {
                self.held_up = 0;
                return;
            }
        }
        self.after_step(held_up);
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
    *GLOBAL.lock().unwrap_or_else(|e| e.into_inner()) = Some(Roster::new(threads));
}

/// The team size for the next step on the global pool of `threads` threads (of `tokens` new tokens,
/// when it is a forward step: [`Roster::next_size`]), or `None` where the team does not adapt (not
/// enabled, or another pool).
pub fn global_count(threads: usize, tokens: Option<usize>) -> Option<usize> {
    let mut roster = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    roster
        .as_mut()
        .filter(|r| r.threads == threads)
        .map(|r| r.next_size(tokens))
}

/// Records the outcome of a step run on the global pool ([`Roster::after_sized_step`]).
pub fn global_after_step(threads: usize, paced: Option<PacedStep>, held_up: bool) {
    let mut roster = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(r) = roster.as_mut().filter(|r| r.threads == threads) {
        r.after_sized_step(paced, held_up);
    }
}

/// Where the global pool's pacing stands: `None` before [`enable`].
pub fn global_pace() -> Option<PaceReport> {
    let roster = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    roster.as_ref().map(|r| r.pace.report())
}

/// Whether a step was held up by its last member: it left `tail` after the first, in a step of
/// `elapsed` (from its start to the last member's leaving) on `count` threads.
pub fn held_up(tail: Duration, elapsed: Duration, count: usize) -> bool {
    tail > Duration::from_nanos(HELD_UP_NS)
        && tail.saturating_mul(u32::try_from(count).unwrap_or(u32::MAX)) > elapsed
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
    fn clean_steps_of_fewer_threads_than_the_count_bring_none_back() {
        let mut r = Roster::new(4);
        steps(&mut r, true, HELD_UP_STEPS);
        assert_eq!(r.count, 3);
        // Decode steps paced on 2 threads, clean: the thread left out of the count stays out.
        let paced = |size| {
            Some(PacedStep {
                tokens: 1,
                size,
                elapsed: Duration::from_micros(500),
            })
        };
        for _ in 0..1_000 {
            r.after_sized_step(paced(2), false);
        }
        assert_eq!(r.count, 3);
        // Held up on 2 threads: counted.
        for _ in 0..HELD_UP_STEPS {
            r.after_sized_step(paced(2), true);
        }
        assert_eq!(r.count, 2);
        // Clean steps on the whole count bring threads back.
        r.after_sized_step(paced(2), false);
        for _ in 0..1_000 {
            r.after_sized_step(None, false);
        }
        assert_eq!(r.count, 4);
    }

    #[test]
    fn a_pool_of_one_stays_one() {
        let mut r = Roster::new(1);
        for i in 0..50 {
            r.after_step(i % 2 == 0);
            assert_eq!(r.count, 1);
        }
    }

    #[test]
    fn a_step_is_held_up_when_its_last_member_costs_more_than_its_share() {
        let ms = Duration::from_millis;
        // 16 threads, a 2 ms step that waited 1 ms for its last member: held up.
        assert!(held_up(ms(1), ms(2), 16));
        // 2 threads, a 7 ms step that waited 2 ms: the member brought more than it cost.
        assert!(!held_up(ms(2), ms(7), 2));
        assert!(held_up(ms(4), ms(7), 2));
        // Waits too short to be the scheduler's turn never count.
        assert!(!held_up(
            Duration::from_micros(50),
            Duration::from_micros(60),
            16
        ));
    }
}
