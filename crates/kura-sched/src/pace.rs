//! How long a step that carries decodes may take: the prompt tokens computed beside decoding sequences
//! are cut so that the step takes about a target time (Sarathi-Serve's token budget from a time between
//! tokens), instead of the whole `max_num_batched_tokens`. Without it, every decoding sequence waits for
//! a newcomer's whole prompt: on a CPU that prefills 1,000 tokens a second, a step of 8,192 prompt
//! tokens holds every stream's next token for eight seconds.
//!
//! A prompt token at position `p` is taken to cost `a + b · p / 1000` seconds (its products, and its
//! attention over the `p` tokens before it), so a chunk of `n` tokens from position `s` costs
//!
//! ```text
//!   n · (a + b · (s + (n − 1) / 2) / 1000)
//! ```
//!
//! and a step beside `k` decode tokens gets `target − k · decode_time` seconds of it ([`PrefillCap`]; at
//! least [`MIN_CHUNK`] tokens, so that a prompt always progresses). `a` and `b` are fitted by least
//! squares, with older steps weighing less, to the prompt's share of each step that computed at least
//! [`MIN_CHUNK`] prompt tokens (its time less its decodes' estimated time); `decode_time`, a decode
//! token's share of a step, is averaged over the steps that computed decodes only, and lowered where a
//! step with prompt tokens shows its decodes took less than half of it (so that a figure from a larger
//! batch, or a slower moment, cannot hold the cap at its floor while every step carries a prompt). With
//! one position per step the fit cannot tell `a` from `b`
//! and takes the plain rate (`b` = 0). Measured on the steps themselves, the cut finds its size on any
//! machine: a fixed cost per step that the fit does not see makes a capped step's measured cost per
//! token rise until the steps take the target (the cap's fixed point). The driver (the server's engine
//! on the wall clock, `kura sim` on its cost model) hands the scheduler the cap before each pass
//! ([`PrefillPace::plan`]) and reports each step's items and time ([`PrefillPace::observe_step`]).

use std::time::Duration;

use crate::{Item, Scheduler};

/// The fewest prompt tokens a step computes beside decodes, whatever the figures: a prompt always
/// progresses, and a step is not cut below where its own fixed cost dominates.
pub const MIN_CHUNK: usize = 64;

/// Prompt tokens per second assumed before the first step is measured.
pub const PRIOR_TOKENS_PER_S: f64 = 1_000.0;

/// Weight of a new sample in the running averages and the fit.
const WEIGHT: f64 = 0.2;

/// Largest token count a cap names: past any step's budget (and exact in an f64).
const MAX_TOKENS: f64 = (1u64 << 52) as f64;

/// What a step beside decodes may spend on prompt tokens: `room_s` seconds at `per_token_s +
/// per_token_context_s · position / 1000` seconds a token, and at least `min_tokens` tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillCap {
    pub room_s: f64,
    pub per_token_s: f64,
    pub per_token_context_s: f64,
    pub min_tokens: usize,
}

impl PrefillCap {
    /// A cap of `n` prompt tokens a step, wherever they lie (at least one).
    pub fn tokens(n: usize) -> Self {
        Self {
            room_s: n as f64,
            per_token_s: 1.0,
            per_token_context_s: 0.0,
            min_tokens: 1,
        }
    }

    /// Seconds that tokens `start..start + n` of a prompt take.
    pub fn cost(&self, start: usize, n: usize) -> f64 {
        if n == 0 {
            return 0.0;
        }
        let mid = start as f64 + (n as f64 - 1.0) / 2.0;
        n as f64 * (self.per_token_s + self.per_token_context_s * mid / 1000.0)
    }

    /// The most tokens from position `start` whose cost fits in `room` seconds.
    pub fn fit(&self, start: usize, room: f64) -> usize {
        if room.is_nan() || room <= 0.0 {
            return 0;
        }
        // n · (a + c · (s + (n − 1) / 2)) ≤ room with c = b / 1000: (c/2)·n² + (a + c·s − c/2)·n − room ≤ 0.
        let c = self.per_token_context_s / 1000.0;
        let lin = self.per_token_s + c * start as f64 - c / 2.0;
        let n = if c > 0.0 {
            // The root in the form that keeps its digits when c · room is small beside lin².
            let disc = (lin * lin + 2.0 * c * room).sqrt();
            if lin > 0.0 {
                2.0 * room / (lin + disc)
            } else {
                (disc - lin) / c
            }
        } else if lin > 0.0 {
            room / lin
        } else {
            MAX_TOKENS
        };
        let mut n = if n.is_finite() {
            n.clamp(0.0, MAX_TOKENS) as usize
        } else {
            MAX_TOKENS as usize
        };
        // The root's rounding: step back to a count that fits.
        while n > 0 && self.cost(start, n) > room {
            n -= 1;
        }
        n
    }
}

/// The measured figures behind the cap; see the module documentation.
#[derive(Debug, Clone)]
pub struct PrefillPace {
    target: Duration,
    /// The weighted sums of the fit: Σn², Σn·m, Σm², Σn·t, Σm·t, where a step's `n` is its prompt
    /// tokens, `m` their positions summed over 1000 and `t` the prompt's share of its time.
    sums: [f64; 5],
    fitted: bool,
    /// Seconds a decode token adds to a step; 0 until measured.
    decode_s: f64,
    decode_samples: u64,
}

impl PrefillPace {
    /// A pace for steps of about `target` while sequences decode.
    pub fn new(target: Duration) -> Self {
        Self {
            target,
            sums: [0.0; 5],
            fitted: false,
            decode_s: 0.0,
            decode_samples: 0,
        }
    }

    /// Hands `sched` the cap for its next pass, beside the sequences it decodes now; returns it.
    pub fn plan(&self, sched: &mut Scheduler) -> PrefillCap {
        let cap = self.cap(sched.num_decoding());
        sched.set_prefill_cap(Some(cap));
        cap
    }

    /// A planned step of `items` that took `elapsed`, reported before the items are to `sched`
    /// (while it still knows which were prompt tokens).
    pub fn observe_step(&mut self, sched: &Scheduler, items: &[Item], elapsed: Duration) {
        let mut prompt = Vec::new();
        let mut decode = 0;
        for it in items {
            let n = it.end - it.start;
            if sched.is_prefilling(it.seq) {
                prompt.push((it.start, n));
            } else {
                decode += n;
            }
        }
        self.observe(&prompt, decode, elapsed);
    }

    /// A forward step that computed the prompt chunks `prompt` (each its first position and its
    /// tokens) and `decode` decode tokens (a draft's check counts as decode) in `elapsed`.
    pub fn observe(&mut self, prompt: &[(usize, usize)], decode: usize, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        if !(secs.is_finite() && secs > 0.0) {
            return;
        }
        let n: usize = prompt.iter().map(|p| p.1).sum();
        if n == 0 {
            if decode > 0 {
                let per = secs / decode as f64;
                self.decode_s = if self.decode_samples == 0 {
                    per
                } else {
                    self.decode_s + WEIGHT * (per - self.decode_s)
                };
                self.decode_samples += 1;
            }
            return;
        }
        // A step with prompt tokens bounds its decodes' share: at most half of it.
        if decode > 0 && self.decode_s * decode as f64 > secs / 2.0 {
            self.decode_s = secs / (2.0 * decode as f64);
        }
        if n < MIN_CHUNK {
            return;
        }
        // The prompt's share: the step's time less what its decodes take (at least half of it).
        let t = secs - self.decode_s * decode as f64;
        let unit = PrefillCap {
            room_s: 0.0,
            per_token_s: 0.0,
            per_token_context_s: 1.0,
            min_tokens: 0,
        };
        let m: f64 = prompt.iter().map(|&(s, k)| unit.cost(s, k)).sum();
        let n = n as f64;
        let sample = [n * n, n * m, m * m, n * t, m * t];
        for (sum, x) in self.sums.iter_mut().zip(sample) {
            *sum = if self.fitted {
                *sum + WEIGHT * (x - *sum)
            } else {
                x
            };
        }
        self.fitted = true;
    }

    /// Seconds a prompt token costs: `(at position 0, per 1000 positions)`.
    pub fn per_token(&self) -> (f64, f64) {
        if !self.fitted {
            return (1.0 / PRIOR_TOKENS_PER_S, 0.0);
        }
        let [nn, nm, mm, nt, mt] = self.sums;
        let det = nn * mm - nm * nm;
        // Both terms where the steps tell them apart and both come out positive.
        if det > 1e-6 * nn * mm {
            let a = (nt * mm - mt * nm) / det;
            let b = (nn * mt - nm * nt) / det;
            if a > 0.0 && b > 0.0 {
                return (a, b);
            }
        }
        // Else the plain rate over the samples (nn > 0: every sample had tokens).
        (nt / nn, 0.0)
    }

    /// Seconds `decode` decode tokens take of a step (0 until one is measured).
    pub fn decode_seconds(&self, decode: usize) -> f64 {
        self.decode_s * decode as f64
    }

    /// What a step beside `decode` decode tokens may compute of prompts.
    pub fn cap(&self, decode: usize) -> PrefillCap {
        let (a, b) = self.per_token();
        PrefillCap {
            room_s: (self.target.as_secs_f64() - self.decode_seconds(decode)).max(0.0),
            per_token_s: a,
            per_token_context_s: b,
            min_tokens: MIN_CHUNK,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1e3)
    }

    #[test]
    fn a_cap_fits_the_most_tokens_whose_cost_fits_its_room() {
        let cap = PrefillCap {
            room_s: 0.25,
            per_token_s: 0.001,
            per_token_context_s: 0.0005,
            min_tokens: MIN_CHUNK,
        };
        for start in [0, 100, 1_000, 10_000, 100_000] {
            let n = cap.fit(start, cap.room_s);
            assert!(cap.cost(start, n) <= cap.room_s, "{start}: {n}");
            assert!(cap.cost(start, n + 1) > cap.room_s, "{start}: {n}");
        }
        // Farther into a prompt, fewer tokens fit.
        assert!(cap.fit(10_000, 0.25) < cap.fit(0, 0.25));
        assert_eq!(PrefillCap::tokens(5).fit(1_000_000, 5.0), 5);
        // A context term far below the token's own cost keeps the root's digits.
        let nearly_flat = PrefillCap {
            per_token_s: 0.0005,
            per_token_context_s: 1e-17,
            ..cap
        };
        for start in [0, 100_000] {
            let n = nearly_flat.fit(start, 0.2501);
            assert_eq!(n, 500, "{start}");
        }
        assert_eq!(cap.fit(0, 0.0), 0);
        assert_eq!(cap.fit(0, -1.0), 0);
        let free = PrefillCap {
            per_token_s: 0.0,
            per_token_context_s: 0.0,
            ..cap
        };
        assert_eq!(free.fit(0, 1.0) as f64, MAX_TOKENS);
    }

    #[test]
    fn the_cap_is_the_rate_over_the_target_less_the_decode_time() {
        let mut p = PrefillPace::new(ms(250.0));
        let first = |p: &PrefillPace, decode: usize| {
            let c = p.cap(decode);
            c.fit(0, c.room_s)
        };
        // Before anything is measured: the prior over the whole target.
        assert_eq!(first(&p, 8), 250);
        // 2,000 prompt tokens alone in 1 s at one position... (a single chunk: the plain rate).
        p.observe(&[(0, 2_000)], 0, ms(1_000.0));
        let (a, b) = p.per_token();
        assert!((a - 0.0005).abs() < 1e-12 && b == 0.0, "{a} {b}");
        assert_eq!(first(&p, 8), 500);
        // Decode-only steps of 8 tokens in 50 ms leave 200 ms of the target to prompts beside 8
        // decodes, 225 beside 4.
        p.observe(&[], 8, ms(50.0));
        assert_eq!(first(&p, 8), 400);
        assert_eq!(first(&p, 4), 450);
        // A target below the decodes' own time leaves no room (the scheduler's floor applies).
        let mut slow = PrefillPace::new(ms(20.0));
        slow.observe(&[], 64, ms(30.0));
        assert_eq!(slow.cap(64).room_s, 0.0);
        assert_eq!(slow.cap(64).min_tokens, MIN_CHUNK);
        // Fewer decodes than the figure was measured on leave room again.
        assert!(slow.cap(8).room_s > 0.0);
        // A step with prompt tokens whose decodes' estimate is more than half of it lowers the
        // estimate: a figure from a slow moment does not hold the cap at its floor.
        slow.observe(&[(0, 100)], 64, ms(20.0));
        assert!((slow.decode_seconds(64) - 0.010).abs() < 1e-12);
        assert!(slow.cap(64).room_s > 0.0);
        // Steps of too few prompt tokens, of no time or of no tokens say nothing.
        let before = p.per_token();
        p.observe(&[(0, MIN_CHUNK - 1)], 0, ms(1.0));
        p.observe(&[(0, 1_000)], 0, Duration::ZERO);
        p.observe(&[], 0, ms(5.0));
        assert_eq!(p.per_token(), before);
        assert!((p.decode_seconds(8) - 0.05).abs() < 1e-12);
    }

    #[test]
    fn chunks_at_several_positions_tell_the_cost_of_context_apart() {
        let (a, b) = (0.0006, 0.0004);
        let cost = PrefillCap {
            room_s: 0.0,
            per_token_s: a,
            per_token_context_s: b,
            min_tokens: 0,
        };
        let mut p = PrefillPace::new(ms(250.0));
        for start in [0, 300, 600, 900, 0, 300] {
            p.observe(
                &[(start, 300)],
                0,
                Duration::from_secs_f64(cost.cost(start, 300)),
            );
        }
        let (fa, fb) = p.per_token();
        assert!((fa - a).abs() < 1e-9 && (fb - b).abs() < 1e-9, "{fa} {fb}");
    }

    /// Steps on a machine whose prompt tokens cost more the farther into the prompt they lie, with a
    /// fixed 40 ms a step beside the decodes that the first, uncut steps hid: stepping through long
    /// prompts chunk by chunk, every step settles near the target.
    #[test]
    fn capped_steps_through_long_prompts_settle_at_the_target() {
        let (fixed, a, b, decode) = (0.040, 0.0005, 0.0001, 0.030);
        let machine = PrefillCap {
            room_s: 0.0,
            per_token_s: a,
            per_token_context_s: b,
            min_tokens: 0,
        };
        for target_ms in [150.0, 250.0, 1_000.0] {
            let mut p = PrefillPace::new(ms(target_ms));
            p.observe(
                &[(0, 4_096)],
                0,
                Duration::from_secs_f64(fixed + machine.cost(0, 4_096)),
            );
            p.observe(&[], 8, Duration::from_secs_f64(decode));
            let mut steps = Vec::new();
            for _prompt in 0..6 {
                let mut at = 0;
                while at < 4_000 {
                    let cap = p.cap(8);
                    let n = cap.fit(at, cap.room_s).max(cap.min_tokens).min(4_000 - at);
                    let took = decode + fixed + machine.cost(at, n);
                    p.observe(&[(at, n)], 8, Duration::from_secs_f64(took));
                    at += n;
                    steps.push((n, took));
                }
            }
            // After the first prompt, every step is within 10 % of the target, but a prompt's last
            // chunk (what was left of it), which is shorter.
            let target = target_ms / 1e3;
            let late = &steps[steps.len() / 2..];
            for &(n, took) in late {
                assert!(
                    took < 1.1 * target,
                    "target {target} s: a step of {n} tokens took {took} s: {late:?}"
                );
            }
            let short = late.iter().filter(|s| s.1 < 0.9 * target).count();
            assert!(short <= 3, "target {target}: {late:?}");
        }
    }
}
