//! The team size of steps of few tokens, found by timing them.
//!
//! A decode step reads every weight once for a handful of tokens: it is bound by the memory's
//! bandwidth, which a few cores already draw in full, while each thread added is one more member to
//! deal chunks to, one more cache line to poll, one more core that a step may wait for. Past some
//! team size a step takes no less time, and it can take more: on a 16-core CPU a decode step ran
//! slower on 16 threads than on 12. The size where a step is fastest depends on the CPU, the model,
//! the context and the neighbours, so it is measured, not computed.
//!
//! A paced step runs on [`Pace::size`] threads (at most the roster's count, which is fewer while a
//! core is busy: [`super::roster`]). Now and then, after [`FIRST_TRIAL_WAIT`] paced steps and then
//! twice as many after each trial that changed nothing (up to [`LONGEST_TRIAL_WAIT`]), a trial tries
//! another size, a quarter fewer threads or a quarter more: [`TRIAL_PAIRS`] pairs of consecutive
//! steps of the same tokens, one on each size, in turn first (a context that grows by a token a step
//! favours neither). The trial's size is kept when its step was the faster in [`TAKE_WINS`] pairs and
//! its steps took at least [`TAKE_PER_MILLE`] less time in all; a trial stops as soon as it has lost
//! too many pairs to be kept, or its size is a quarter slower or worse (on a 2-core machine a trial of
//! one thread then costs about one step's worth of one thread's time). A step that a busy core held
//! up says nothing about the size and ends the trial unjudged, as does a fall of the roster's count
//! or too few like pairs. A trial that is kept is followed soon by another in the same direction; one
//! that is not turns the next the other way and waits twice as long, as does an unjudged one. Which
//! thread computes what never changes a token's bits, so neither does the size.

use std::time::Duration;

/// Steps of at most this many new tokens are paced; longer ones (prefill, compute bound) run on every
/// thread the roster allows.
pub const PACED_TOKENS: usize = 16;
/// Paced steps before the first trial, and after a trial that changed the size.
pub const FIRST_TRIAL_WAIT: usize = 64;
/// The most paced steps between two trials.
pub const LONGEST_TRIAL_WAIT: usize = 8192;
/// Pairs of steps that judge a trial.
pub const TRIAL_PAIRS: usize = 8;
/// Pairs of a trial whose step on the trial's size must have taken less time than its step on the
/// current size for the trial's size to be kept: a step beside busy neighbours can take a third more
/// or less than the one before it, and a sum over a few pairs follows its worst outliers.
pub const TAKE_WINS: usize = 7;
/// A trial's size is kept when its steps took at least this much less time than the current size's
/// (per mille of the current size's).
pub const TAKE_PER_MILLE: u32 = 30;
/// Pairs after which a trial stops when its steps took [`GIVE_UP_PER_MILLE`] more time or worse.
pub const GIVE_UP_PAIRS: usize = 1;
/// See [`GIVE_UP_PAIRS`].
pub const GIVE_UP_PER_MILLE: u32 = 250;
/// The most steps a trial lasts: pairs of steps of unlike tokens (a server's batch changed) are not
/// compared, and a trial that has dropped four pairs ends unjudged.
const TRIAL_STEPS: usize = 2 * (TRIAL_PAIRS + 4);

/// A paced step's outcome: its new tokens, the team size it ran on, and its time from its start to
/// its last member's leaving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacedStep {
    pub tokens: usize,
    pub size: usize,
    pub elapsed: Duration,
}

/// Where the pacing of one pool stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PaceReport {
    /// Threads in the pool.
    pub threads: usize,
    /// The team size of paced steps outside trials.
    pub size: usize,
    /// Trials judged, and of those, the ones whose size was kept.
    pub trials: u64,
    pub changes: u64,
    /// Steps run on a trial's size, judged or not.
    pub trial_steps: u64,
}

/// The team size of paced steps of one pool, and its trials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pace {
    threads: usize,
    /// The team size of paced steps outside trials, 1 to `threads`.
    pub size: usize,
    /// Paced steps since the last trial, and how many to wait for the next.
    since: usize,
    wait: usize,
    /// Whether the next trial tries fewer threads (where both ways are open).
    down: bool,
    trial: Option<Trial>,
    trials: u64,
    changes: u64,
    trial_steps: u64,
}

/// A trial under way.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Trial {
    /// The size tried.
    size: usize,
    /// Steps run so far; step `2p + i` is the `i`th of pair `p`, and pair `p` runs the current size
    /// first where `p` is even, the trial's where it is odd.
    steps: usize,
    /// The first step of the pair under way: its tokens and time.
    first: Option<(usize, Duration)>,
    /// Pairs compared, those in which the trial's step took less time, and their summed times on the
    /// current size and on the trial's.
    pairs: usize,
    won: usize,
    current: Duration,
    tried: Duration,
}

impl Trial {
    /// Whether the next step runs the trial's size.
    fn runs_tried(&self) -> bool {
        let (pair, second) = (self.steps / 2, self.steps % 2 == 1);
        second == (pair % 2 == 0)
    }
}

/// How a trial ended.
enum Verdict {
    /// Its size took less time: kept.
    Kept,
    /// It did not: the size stays.
    Rejected,
    /// It could not be judged (a held-up step, too few like pairs, the roster's count fell).
    Unjudged,
}

impl Pace {
    /// Every thread of a pool of `threads`, no trial yet.
    pub fn new(threads: usize) -> Pace {
        let threads = threads.max(1);
        Pace {
            threads,
            size: threads,
            since: 0,
            wait: FIRST_TRIAL_WAIT,
            down: true,
            trial: None,
            trials: 0,
            changes: 0,
            trial_steps: 0,
        }
    }

    pub fn report(&self) -> PaceReport {
        PaceReport {
            threads: self.threads,
            size: self.size,
            trials: self.trials,
            changes: self.changes,
            trial_steps: self.trial_steps,
        }
    }

    /// The team size of the next paced step, where the roster allows `cap` threads: fewer than the
    /// paced size while a core is busy (then `cap`, and no trial: a busy core's waits would judge it).
    pub fn next_size(&mut self, cap: usize) -> usize {
        let cap = cap.clamp(1, self.threads);
        if cap < self.size {
            if self.trial.is_some() {
                self.end(Verdict::Unjudged);
            }
            return cap;
        }
        if self.trial.is_none() && self.since >= self.wait {
            match self.candidate(cap) {
                Some(size) => {
                    self.trial = Some(Trial {
                        size,
                        steps: 0,
                        first: None,
                        pairs: 0,
                        won: 0,
                        current: Duration::ZERO,
                        tried: Duration::ZERO,
                    })
                }
                // A pool of one thread: nothing to try.
                None => self.since = 0,
            }
        }
        match &self.trial {
            Some(t) if t.runs_tried() => t.size.min(cap),
            _ => self.size,
        }
    }

    /// The size a trial would try now: a quarter fewer threads or a quarter more (one at least), at
    /// most `cap`, the way [`Pace::down`] says where both are open.
    fn candidate(&self, cap: usize) -> Option<usize> {
        let step = (self.size / 4).max(1);
        let fewer = Some(self.size.saturating_sub(step)).filter(|&s| s >= 1);
        let more = Some((self.size + step).min(cap)).filter(|&s| s > self.size);
        if self.down {
            fewer.or(more)
        } else {
            more.or(fewer)
        }
    }

    /// Takes the outcome of a paced step (its size as [`Pace::next_size`] gave it), and whether a
    /// member held it up.
    pub fn after_step(&mut self, step: PacedStep, held_up: bool) {
        let Some(t) = self.trial.as_mut() else {
            self.since += 1;
            return;
        };
        let tried = t.runs_tried();
        let expected = if tried { t.size } else { self.size };
        self.trial_steps += u64::from(tried && step.size == t.size);
        if held_up || step.size != expected {
            return self.end(Verdict::Unjudged);
        }
        match t.first.take() {
            None => t.first = Some((step.tokens, step.elapsed)),
            // A pair of unlike steps (the batch changed) is not compared.
            Some((tokens, _)) if tokens != step.tokens => {}
            Some((_, first)) => {
                let (current, on_trial) = if tried {
                    (first, step.elapsed)
                } else {
                    (step.elapsed, first)
                };
                t.current += current;
                t.tried += on_trial;
                t.pairs += 1;
                t.won += usize::from(on_trial < current);
            }
        }
        t.steps += 1;
        if t.steps % 2 == 1 {
            return;
        }
        // A pair has ended.
        let per_mille = |d: Duration, m: u32| d.saturating_mul(m) / 1000;
        let lost = t.pairs - t.won;
        let verdict = if t.pairs >= TRIAL_PAIRS {
            if t.won >= TAKE_WINS && t.tried + per_mille(t.current, TAKE_PER_MILLE) <= t.current {
                Verdict::Kept
            } else {
                Verdict::Rejected
            }
        } else if lost > TRIAL_PAIRS - TAKE_WINS
            // Lost too many pairs to be kept, or far slower.
            || t.pairs >= GIVE_UP_PAIRS
                && t.tried >= t.current + per_mille(t.current, GIVE_UP_PER_MILLE)
        {
            Verdict::Rejected
        } else if t.steps >= TRIAL_STEPS {
            Verdict::Unjudged
        } else {
            return;
        };
        self.end(verdict);
    }

    /// Ends the trial under way with `verdict`.
    fn end(&mut self, verdict: Verdict) {
        let Some(t) = self.trial.take() else {
            return;
        };
        self.since = 0;
        // Whether this trial tried fewer threads (the way the next goes after a kept trial; the other
        // way after a rejected one).
        let fewer = t.size < self.size;
        match verdict {
            Verdict::Kept => {
                let gain = 100.0 * (1.0 - t.tried.as_secs_f64() / t.current.as_secs_f64());
                tracing::info!(
                    threads = t.size,
                    "steps of up to {PACED_TOKENS} tokens now run on {} of {} threads: {gain:.1} % \
                     less time than on {} in {} pairs of steps",
                    t.size,
                    self.threads,
                    self.size,
                    t.pairs
                );
                self.size = t.size;
                self.trials += 1;
                self.changes += 1;
                self.down = fewer;
                self.wait = FIRST_TRIAL_WAIT;
            }
            Verdict::Rejected => {
                self.trials += 1;
                self.down = !fewer;
                self.wait = (self.wait * 2).min(LONGEST_TRIAL_WAIT);
            }
            // Steps that could not judge it (a busy core, a batch that keeps changing) would likely
            // not judge the next either: it waits as long as after a rejected trial.
            Verdict::Unjudged => self.wait = (self.wait * 2).min(LONGEST_TRIAL_WAIT),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` paced steps of `tokens(i)` tokens each, step `i` on the size the pace gives taking
    /// `time(i, size)` µs, none held up; returns how many ran on each size.
    fn run(
        pace: &mut Pace,
        steps: usize,
        tokens: impl Fn(usize) -> usize,
        time: impl Fn(usize, usize) -> u64,
    ) -> Vec<usize> {
        let mut on = vec![0; pace.threads + 1];
        for i in 0..steps {
            let size = step(pace, pace.threads, tokens(i), |s| time(i, s));
            on[size] += 1;
        }
        on
    }

    /// One paced step of `tokens` tokens where the roster allows `cap` threads, taking `time(size)` µs
    /// on the size the pace gives, not held up; returns that size.
    fn step(pace: &mut Pace, cap: usize, tokens: usize, time: impl Fn(usize) -> u64) -> usize {
        let size = pace.next_size(cap);
        let elapsed = Duration::from_micros(time(size));
        pace.after_step(
            PacedStep {
                tokens,
                size,
                elapsed,
            },
            false,
        );
        size
    }

    /// A 16-thread decode step's time (µs) by team size, fastest on 12.
    fn sixteen_cores(size: usize) -> u64 {
        match size {
            12 => 450,
            11 => 470,
            13 => 600,
            9..=10 => 520,
            14 => 700,
            15 => 800,
            16 => 900,
            s => 1000 - 50 * s as u64,
        }
    }

    #[test]
    fn a_step_slower_on_every_thread_settles_on_the_fastest_size() {
        let mut pace = Pace::new(16);
        run(&mut pace, 2_000, |_| 1, |_, s| sixteen_cores(s));
        assert_eq!(pace.size, 12, "{pace:?}");
        // Settled: the trials that follow cost little.
        let on = run(&mut pace, 20_000, |_| 1, |_, s| sixteen_cores(s));
        assert_eq!(pace.size, 12, "{pace:?}");
        assert!(on[12] >= 20_000 * 99 / 100, "{on:?}");
        let report = pace.report();
        assert_eq!(report.changes, 1, "{report:?}");
        assert!(report.trials >= 4, "{report:?}");
    }

    #[test]
    fn where_every_thread_helps_the_pool_keeps_them_all_at_little_cost() {
        let mut pace = Pace::new(2);
        let on = run(&mut pace, 20_000, |_| 1, |_, s| 2_000 / s as u64);
        assert_eq!(pace.size, 2);
        // Each trial of one thread stops after its first pair, and trials grow rarer: at most
        // 0.1 % of the steps run on one thread.
        assert!(on[1] > 0 && on[1] <= 20_000 / 1000, "{on:?}");
        assert_eq!(pace.report().changes, 0);
        assert_eq!(pace.report().trial_steps, on[1] as u64);
    }

    #[test]
    fn a_pool_that_sped_up_goes_back_to_more_threads() {
        let mut pace = Pace::new(16);
        run(&mut pace, 2_000, |_| 1, |_, s| sixteen_cores(s));
        assert_eq!(pace.size, 12);
        // The neighbour that slowed the larger teams has gone: now every thread helps.
        run(&mut pace, 40_000, |_| 1, |_, s| 10_000 / s as u64);
        assert_eq!(pace.size, 16, "{pace:?}");
    }

    #[test]
    fn a_context_that_grows_favours_neither_size() {
        // Each step 4 % slower than the one before it: were the trial's step always first in its pair,
        // it would look 4 % faster than it is, and always second, 4 % slower. Run to the end of the
        // first trial (4 threads against 3).
        let steps = FIRST_TRIAL_WAIT + 2 * TRIAL_PAIRS;
        let drift = |i: usize| 1.04f64.powi(i as i32);
        // Equal sizes: not kept.
        let mut pace = Pace::new(4);
        run(&mut pace, steps, |_| 1, |i, _| (1_000.0 * drift(i)) as u64);
        assert_eq!((pace.size, pace.report().trials), (4, 1), "{pace:?}");
        // Three threads 5 % faster: kept.
        let mut pace = Pace::new(4);
        let faster = |s: usize| if s == 3 { 950.0 } else { 1_000.0 };
        run(
            &mut pace,
            steps,
            |_| 1,
            |i, s| (faster(s) * drift(i)) as u64,
        );
        assert_eq!((pace.size, pace.report().trials), (3, 1), "{pace:?}");
    }

    #[test]
    fn held_up_steps_unlike_pairs_and_a_busy_core_judge_nothing() {
        // Steps whose tokens change every step form no like pair.
        let mut pace = Pace::new(16);
        run(&mut pace, 2_000, |i| 1 + i % 2, |_, s| sixteen_cores(s));
        assert_eq!((pace.size, pace.report().trials), (16, 0));
        assert!(pace.report().trial_steps > 0);

        // A held-up step ends the trial unjudged.
        let mut pace = Pace::new(16);
        run(&mut pace, FIRST_TRIAL_WAIT, |_| 1, |_, s| sixteen_cores(s));
        let size = pace.next_size(16);
        assert!(pace.trial.is_some() && size == 16);
        let held = PacedStep {
            tokens: 1,
            size,
            elapsed: Duration::from_micros(900),
        };
        pace.after_step(held, true);
        assert!(pace.trial.is_none());
        assert_eq!((pace.size, pace.report().trials), (16, 0));

        // While the roster allows fewer threads than the paced size, steps run on those and no
        // trial starts.
        let mut pace = Pace::new(16);
        for _ in 0..1_000 {
            assert_eq!(step(&mut pace, 5, 1, sixteen_cores), 5);
        }
        assert_eq!((pace.size, pace.report().trial_steps), (16, 0));
    }

    #[test]
    fn noise_alone_seldom_changes_the_size() {
        // Two sizes equally fast, each step's time a third more or less at random (a busy neighbour):
        // of many trials, few keep the other size.
        let mut pace = Pace::new(2);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut noise = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            1_000 + seed % 667 - 333
        };
        // Trials as often as at the start, to judge many.
        let mut kept = 0;
        for _ in 0..400 {
            pace.wait = FIRST_TRIAL_WAIT;
            pace.since = pace.wait;
            let trials = pace.trials;
            let before = pace.size;
            while pace.trials == trials {
                let time = noise();
                step(&mut pace, 2, 1, |_| time);
            }
            kept += usize::from(pace.size != before);
        }
        assert!(kept <= 400 / 20, "{kept} of 400 trials changed the size");
    }

    #[test]
    fn a_kept_trial_is_followed_by_one_the_same_way_even_where_it_could_go_one_way_only() {
        // The next trial was to try more threads, but the pool has no more: it tries fewer, 3 of 4,
        // keeps them, and the trial after goes on to 2.
        let mut pace = Pace::new(4);
        pace.down = false;
        let time = |s: usize| [0, 900, 600, 800, 1_000][s];
        while pace.size == 4 {
            step(&mut pace, 4, 1, time);
        }
        assert_eq!(pace.size, 3);
        while pace.trial.is_none() {
            step(&mut pace, 4, 1, time);
        }
        assert_eq!(pace.trial.as_ref().map(|t| t.size), Some(2));
        while pace.size == 3 {
            step(&mut pace, 4, 1, time);
        }
        assert_eq!(pace.size, 2);
    }

    #[test]
    fn trials_that_cannot_be_judged_grow_rarer() {
        // A batch that changes every step: no pair is compared, every trial ends unjudged, and the
        // steps on a trial's size stay a small share.
        let mut pace = Pace::new(16);
        let on = run(&mut pace, 20_000, |i| 1 + i % 3, |_, s| sixteen_cores(s));
        assert_eq!((pace.size, pace.report().trials), (16, 0));
        assert!(on[16] >= 20_000 * 99 / 100, "{on:?}");

        // A roster that drops below the paced size during a trial ends it unjudged.
        let mut pace = Pace::new(16);
        while pace.trial.is_none() {
            step(&mut pace, 16, 1, sixteen_cores);
        }
        assert_eq!(step(&mut pace, 10, 1, sixteen_cores), 10);
        assert!(pace.trial.is_none());
        assert_eq!((pace.size, pace.report().trials), (16, 0));
    }

    #[test]
    fn a_pool_of_one_never_tries() {
        let mut pace = Pace::new(1);
        let on = run(&mut pace, 1_000, |_| 1, |_, _| 100);
        assert_eq!(on[1], 1_000);
        assert_eq!(pace.report().trial_steps, 0);
    }
}
