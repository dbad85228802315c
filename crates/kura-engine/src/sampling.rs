//! Choosing the next token from logits: penalties, temperature, top-k, top-p, min-p, a seeded RNG per
//! request, and logprobs with top alternatives. (Stop strings are `kura-text`'s `StopChecker`.)
//!
//! Order of operations (that of vLLM and HF): penalties on the raw logits → greedy if temperature is 0 →
//! divide by temperature → top-k → softmax → top-p → min-p → draw. Logprobs are those of the unmodified
//! distribution (log-softmax of the raw logits), as the OpenAI API reports them.
//!
//! Every token of every sequence passes here, so a draw costs about one pass over its row of logits:
//! the passes run in vector lanes (`lanes`: the same bits on every CPU), a draw finds its token without
//! sorting the vocabulary (`Order`), and greedy decoding and top-k look at a span of logits one by one
//! only where its largest could win. `cargo bench -p kura-engine --bench sampling` times each mode.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

pub use kura_request::SamplingParams;

/// A token's logprob and the most likely alternatives at its position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// The sampled token and, when asked, its logprobs.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: Option<TokenLogprob>,
}

/// Per-request sampler: its parameters, its RNG and the counts of tokens seen so far.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Occurrences of each generated token, for presence/frequency penalties.
    generated: std::collections::HashMap<u32, u32>,
    /// Prompt and generated tokens, for the repetition penalty.
    seen: std::collections::HashSet<u32>,
    /// Tokens generated so far.
    produced: u32,
    /// Tokens not chosen while fewer than `held_until` are generated ([`Sampler::holding_back`]).
    held: Vec<u32>,
    held_until: u32,
    /// The last tokens generated, at most `tail_len`: the longest of `bad_words` less one (none
    /// without them).
    tail: std::collections::VecDeque<u32>,
    tail_len: usize,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let tail_len = params
            .bad_words
            .iter()
            .map(|w| w.len().saturating_sub(1))
            .max()
            .unwrap_or(0);
        Sampler {
            params,
            rng,
            generated: Default::default(),
            seen: prompt.iter().copied().collect(),
            produced: 0,
            held: Vec::new(),
            held_until: 0,
            tail: Default::default(),
            tail_len,
        }
    }

    /// This sampler, which does not choose any of `tokens` (a request's stop tokens) before it has
    /// recorded `min_tokens` tokens (vLLM's `min_tokens`), unless a grammar's mask allows nothing
    /// else. Logprobs stay those of the model's own distribution.
    pub fn holding_back(mut self, tokens: Vec<u32>, min_tokens: u32) -> Self {
        self.held = tokens;
        self.held_until = min_tokens;
        self
    }

    /// Whether the tokens held back are still kept from being chosen.
    fn holds_back(&self) -> bool {
        self.produced < self.held_until && !self.held.is_empty()
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from one row of logits and records it as generated.
    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        self.sample_allowed(logits, None)
    }

    /// [`Sampler::sample`] among the tokens `allowed` only (bit `id % 32` of word `id / 32`; a
    /// grammar's mask), when given: the others are out before any other step. Logprobs stay those of
    /// the model's own distribution. At least one token must be allowed.
    pub fn sample_allowed(&mut self, logits: &[f32], allowed: Option<&[u32]>) -> Sampled {
        let token = self.choose(logits, allowed);
        self.record(logits, token)
    }

    /// The token [`Sampler::sample_allowed`] picks (the RNG moves on), without recording it: a
    /// grammar may turn it down and ask again with a narrower mask; [`Sampler::record`] records the
    /// one taken.
    pub fn choose(&mut self, logits: &[f32], allowed: Option<&[u32]>) -> u32 {
        let p = &self.params;
        let penalized = p.repetition_penalty != 1.0
            || p.presence_penalty != 0.0
            || p.frequency_penalty != 0.0
            || !p.logit_bias.is_empty();
        let holds_back = self.holds_back();
        let only = &p.allowed_token_ids;
        let narrowed =
            allowed.is_some() || holds_back || !only.is_empty() || !p.bad_words.is_empty();
        let mut owned = Vec::new();
        if penalized || narrowed {
            owned = logits.to_vec();
        }
        let allows =
            |mask: &[u32], i: usize| mask.get(i / 32).is_some_and(|w| w >> (i % 32) & 1 == 1);
        if let Some(mask) = allowed {
            for (i, v) in owned.iter_mut().enumerate() {
                if !allows(mask, i) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        // The request's allowed tokens, unless the grammar allows none of them.
        let open = |v: &f32| *v > f32::NEG_INFINITY;
        if !only.is_empty()
            && only
                .iter()
                .any(|&t| owned.get(t as usize).is_some_and(open))
        {
            let mut kept = vec![f32::NEG_INFINITY; owned.len()];
            for &t in only {
                if let Some(v) = owned.get(t as usize) {
                    kept[t as usize] = *v;
                }
            }
            owned = kept;
        }
        // The tokens that would end a bad word, unless nothing else is left.
        if !p.bad_words.is_empty() {
            let ending = self.banned();
            let others = owned
                .iter()
                .enumerate()
                .any(|(i, v)| open(v) && ending.binary_search(&(i as u32)).is_err());
            if others {
                for &t in &ending {
                    if let Some(v) = owned.get_mut(t as usize) {
                        *v = f32::NEG_INFINITY;
                    }
                }
            }
        }
        // The stop tokens held back, unless nothing else is left (a grammar that may only end).
        let others = |owned: &[f32]| {
            let held = |i: usize| self.held.contains(&(i as u32));
            owned.iter().enumerate().any(|(i, v)| open(v) && !held(i))
        };
        if holds_back && others(&owned) {
            for &t in &self.held {
                if let Some(v) = owned.get_mut(t as usize) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        // The request's biases first (a masked-out token stays out), then the penalties.
        for &(t, b) in &p.logit_bias {
            if let Some(v) = owned.get_mut(t as usize) {
                *v += b;
            }
        }
        let penalized = penalized || narrowed;
        let l: &mut [f32] = &mut owned;
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen {
                if let Some(v) = l.get_mut(t as usize) {
                    *v = if *v > 0.0 {
                        *v / p.repetition_penalty
                    } else {
                        *v * p.repetition_penalty
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &n) in &self.generated {
                if let Some(v) = l.get_mut(t as usize) {
                    *v -= p.presence_penalty + p.frequency_penalty * n as f32;
                }
            }
        }
        let l: &[f32] = if penalized { l } else { logits };
        if p.temperature == 0.0 {
            argmax(l)
        } else {
            let u = self.rng.random::<f32>();
            draw(&self.params, l, u)
        }
    }

    /// Whether this sampler's token is the first largest raw logit ([`argmax`]) and it needs nothing
    /// else of the row: greedy, with no penalty, no bias and no logprobs. Such a sampler takes a token
    /// chosen where the logits are ([`Sampler::record_chosen`]); a grammar's mask is the caller's to
    /// check.
    pub fn argmax_only(&self) -> bool {
        let p = &self.params;
        !self.holds_back()
            && p.allowed_token_ids.is_empty()
            && p.bad_words.is_empty()
            && p.temperature == 0.0
            && p.repetition_penalty == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && p.logit_bias.is_empty()
            && p.logprobs.is_none()
    }

    /// Records `token` as generated (for the penalties), with its logprobs when asked.
    pub fn record(&mut self, logits: &[f32], token: u32) -> Sampled {
        let logprob = self.logprob(logits, token);
        self.record_sampled(Sampled { token, logprob })
    }

    /// `token`'s logprobs in `logits` when this sampler reports them ([`Sampler::record`] without
    /// recording: a batch's rows are scored at once, each recorded in turn).
    pub fn logprob(&self, logits: &[f32], token: u32) -> Option<TokenLogprob> {
        self.params
            .logprobs
            .map(|k| token_logprob(logits, token, k))
    }

    /// Records a token chosen and scored from a row ([`Sampler::choose`], [`Sampler::logprob`]) as
    /// generated, and gives it back.
    pub fn record_sampled(&mut self, sampled: Sampled) -> Sampled {
        self.count(sampled.token);
        sampled
    }

    /// Records `token`, the [`argmax`] of a row this sampler did not see, as generated: for a sampler
    /// that is [`Sampler::argmax_only`], what [`Sampler::sample`] of that row gives.
    pub fn record_chosen(&mut self, token: u32) -> Sampled {
        debug_assert!(
            self.argmax_only(),
            "a token chosen for a sampler that draws"
        );
        self.record_sampled(Sampled {
            token,
            logprob: None,
        })
    }

    fn count(&mut self, token: u32) {
        self.produced = self.produced.saturating_add(1);
        *self.generated.entry(token).or_insert(0) += 1;
        self.seen.insert(token);
        if self.tail_len > 0 {
            if self.tail.len() == self.tail_len {
                self.tail.pop_front();
            }
            self.tail.push_back(token);
        }
    }

    /// The tokens that would complete one of the request's bad words now, ascending: a one-token
    /// word's always, a longer word's last where the tokens generated so far end with the rest of it.
    fn banned(&self) -> Vec<u32> {
        let mut banned: Vec<u32> = self
            .params
            .bad_words
            .iter()
            .filter_map(|word| {
                let (&last, before) = word.split_last()?;
                let from = self.tail.len().checked_sub(before.len())?;
                self.tail.range(from..).eq(before).then_some(last)
            })
            .collect();
        banned.sort_unstable();
        banned.dedup();
        banned
    }
}

/// `token`'s log-probability in the model's distribution `logits` (logit − log Σ exp: no vector of
/// them is made), with the `k` most likely tokens' (most likely first).
pub fn token_logprob(logits: &[f32], token: u32, k: usize) -> TokenLogprob {
    let lse = log_sum_exp(logits);
    TokenLogprob {
        token,
        logprob: logits[token as usize] - lse,
        // The order of the logits is that of their log-probabilities.
        top: top_k_indices(logits, k)
            .into_iter()
            .map(|i| (i as u32, logits[i] - lse))
            .collect(),
    }
}

/// The token that the uniform draw `u` in [0, 1) picks: the softmax of `l / temperature` over the top-k
/// logits, cut to the nucleus (`top_p`) and to `min_p` of the most likely token, walked from the most
/// likely down.
///
/// The walk is that of a full sort of the candidates (most likely first, ties by index), without the
/// sort: [`Order`] finds the candidates in tiers of weight, and the position where a running sum of
/// weights crosses a target by halving the tier that holds it.
fn draw(p: &SamplingParams, l: &[f32], u: f32) -> u32 {
    let inv_t = 1.0 / p.temperature;
    let n = l.len();
    let k = if p.top_k == 0 { n } else { p.top_k.min(n) };
    // The top-k candidates (all of them without top-k).
    let topk: Option<Vec<usize>> = (k < n).then(|| top_k_indices(l, k));
    // Without top-k: the largest logit of each span, which the tiers' passes skip spans by.
    let span_max: Vec<f32> = match &topk {
        Some(_) => Vec::new(),
        None => l.chunks(SPAN).map(lanes::max).collect(),
    };
    let max = match &topk {
        Some(idx) => idx.iter().map(|&i| l[i]).fold(f32::NEG_INFINITY, f32::max),
        None => lanes::max(&span_max),
    };
    let each = Weigh {
        l,
        max,
        inv_t,
        table: None,
    };
    WEIGHTS.with(|table| {
        let mut table = table.borrow_mut();
        let (sum, w) = match &topk {
            Some(idx) => (idx.iter().map(|&i| each.weight(i)).sum(), each),
            None => {
                table.resize(n, 0.0);
                let sum = lanes::weights(l, max, inv_t, &mut table);
                let w = Weigh {
                    table: Some(&table[..]),
                    ..each
                };
                (sum, w)
            }
        };
        walk(p, u, w, sum, topk.as_deref(), &span_max)
    })
}

thread_local! {
    /// A draw's weights of every logit (no top-k), kept for the next draw on this thread.
    static WEIGHTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The rest of [`draw`]: the cuts and the walk over the candidates weighed by `w` (`sum` of all
/// their weights).
fn walk(
    p: &SamplingParams,
    u: f32,
    w: Weigh<'_>,
    sum: f32,
    topk: Option<&[usize]>,
    span_max: &[f32],
) -> u32 {
    let mut order = Order {
        w,
        topk,
        span_max,
        members: Vec::new(),
        tiers: Vec::new(),
    };
    // The survivors: the first `keep` of the order (`None`: every candidate).
    let mut keep: Option<usize> = None;
    if p.top_p < 1.0 {
        // The fewest most likely candidates whose probabilities reach top_p.
        keep = order.crossing(p.top_p * sum, true).map(|(j, _)| j + 1);
    }
    if p.min_p > 0.0 {
        // The most likely candidate has weight 1: the survivors weigh at least min_p (the first
        // always survives).
        let heavy = order.count_at_least(w.logit_of(p.min_p)).max(1);
        keep = Some(keep.map_or(heavy, |kp| kp.min(heavy)));
    }
    let total = match keep {
        Some(kp) => order.prefix_weight(kp),
        None => sum,
    };
    if let Some((_, token)) = order
        .crossing(u * total, false)
        .filter(|&(j, _)| keep.is_none_or(|kp| j < kp))
    {
        return token as u32;
    }
    // Rounding left the draw past the last survivor: the least likely one that can be drawn at all
    // (tokens a mask took out weigh nothing).
    order.last_drawable(keep) as u32
}

/// A draw's logits, the largest of its candidates and `1 / temperature`: each candidate's weight
/// (its probability times the sum of all weights) and the order of a full sort.
#[derive(Clone, Copy)]
struct Weigh<'a> {
    l: &'a [f32],
    max: f32,
    inv_t: f32,
    /// Every logit's weight, where the draw computed them all at once (no top-k).
    table: Option<&'a [f32]>,
}

impl Weigh<'_> {
    /// `exp((l[i] − max) / temperature)`: 1 for the most likely candidate.
    fn weight(&self, i: usize) -> f32 {
        match self.table {
            Some(t) => t[i],
            None => lanes::exp((self.l[i] - self.max) * self.inv_t),
        }
    }

    /// Most likely first, ties by the lower index.
    fn cmp(&self, a: usize, b: usize) -> std::cmp::Ordering {
        self.l[b].total_cmp(&self.l[a]).then(a.cmp(&b))
    }

    /// The lowest logit of weight `b` or more.
    fn logit_of(&self, b: f32) -> f32 {
        if b == 0.0 {
            f32::NEG_INFINITY
        } else {
            self.max + b.ln() / self.inv_t
        }
    }
}

/// Tier bounds on the weight, from the top: [0.1, 1], [0.01, 0.1), … [1e-7, 1e-6), [1e-9, 1e-7),
/// [0, 1e-9): a decade each where a language model's row puts its mass (at temperature 1 hundreds of
/// tokens lie within a factor 1e-3 of the most likely and tens of thousands within 1e-6; SmolLM2
/// writing a story passes the first tier in 60 % of its draws and 1e-3 in 11 %).
const TIER_BOUNDS: [f32; 9] = [1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-9, 0.0];

/// A tier of fewer candidates than this is sorted and walked; a larger one is halved first.
const SORT_BELOW: usize = 32;

/// The candidates of a draw in the order of a full sort, found as the draw needs them: tier by tier
/// of weight ([`TIER_BOUNDS`], each tier one pass over the candidates, which skips the spans whose
/// largest logit is below it), and within a tier by halving it around its median
/// (`select_nth_unstable`) towards the position a running sum of weights crosses. Tiers follow each
/// other in the order, so the positions are those of a full sort; a running sum is taken in another
/// order than a sort's walk, so a crossing may move by a rounding step.
struct Order<'a> {
    w: Weigh<'a>,
    topk: Option<&'a [usize]>,
    span_max: &'a [f32],
    /// The candidates of the tiers found so far, tier after tier (within a tier, as the last
    /// selection left them).
    members: Vec<usize>,
    /// Per tier found: where its candidates end in `members`, and their total weight (in f64, as
    /// every running sum of weights here: tens of thousands of terms).
    tiers: Vec<(usize, f64)>,
}

impl Order<'_> {
    /// Finds the next tier; `false` once every tier is found.
    fn next_tier(&mut self) -> bool {
        let t = self.tiers.len();
        if t == TIER_BOUNDS.len() {
            return false;
        }
        let w = self.w;
        let lo = w.logit_of(TIER_BOUNDS[t]);
        let hi = if t == 0 {
            f32::INFINITY
        } else {
            w.logit_of(TIER_BOUNDS[t - 1])
        };
        let l = w.l;
        let in_tier = |v: f32| v >= lo && (t == 0 || v < hi);
        let start = self.members.len();
        match self.topk {
            Some(idx) => self
                .members
                .extend(idx.iter().copied().filter(|&i| in_tier(l[i]))),
            None => {
                for (s, values) in l.chunks(SPAN).enumerate() {
                    if self.span_max[s] < lo {
                        continue;
                    }
                    // Sixteen logits compared at once into a mask, whose bits are the members.
                    let chunks = values.chunks_exact(16);
                    let rest = chunks.remainder();
                    let mut at = s * SPAN;
                    for c in chunks {
                        let mut mask = 0u32;
                        for (j, &v) in c.iter().enumerate() {
                            mask |= u32::from(in_tier(v)) << j;
                        }
                        while mask != 0 {
                            self.members.push(at + mask.trailing_zeros() as usize);
                            mask &= mask - 1;
                        }
                        at += 16;
                    }
                    self.members
                        .extend((at..at + rest.len()).filter(|&i| in_tier(l[i])));
                }
            }
        }
        let mass = self.members[start..]
            .iter()
            .map(|&i| f64::from(w.weight(i)))
            .sum();
        self.tiers.push((self.members.len(), mass));
        true
    }

    /// Where tier `t`'s candidates begin in `members`.
    fn tier_start(&self, t: usize) -> usize {
        if t == 0 {
            0
        } else {
            self.tiers[t - 1].0
        }
    }

    /// The first position of the order (and its candidate) where the running sum of weights reaches
    /// `target` (`≥` when `at_least`, else `>`); `None` if every candidate's weight together does not.
    fn crossing(&mut self, target: f32, at_least: bool) -> Option<(usize, usize)> {
        let target = f64::from(target);
        let reached = |cum: f64| {
            if at_least {
                cum >= target
            } else {
                cum > target
            }
        };
        let mut cum = 0f64;
        let mut t = 0;
        loop {
            if t == self.tiers.len() && !self.next_tier() {
                return None;
            }
            let (end, mass) = self.tiers[t];
            if !reached(cum + mass) {
                cum += mass;
                t += 1;
                continue;
            }
            let start = self.tier_start(t);
            let w = self.w;
            let s = &mut self.members[start..end];
            let (mut lo, mut hi) = (0, s.len());
            while hi - lo > SORT_BELOW {
                let half = (hi - lo) / 2;
                s[lo..hi].select_nth_unstable_by(half, |a, b| w.cmp(*a, *b));
                let upper: f64 = s[lo..lo + half]
                    .iter()
                    .map(|&i| f64::from(w.weight(i)))
                    .sum();
                if reached(cum + upper) {
                    hi = lo + half;
                } else {
                    cum += upper;
                    lo += half;
                }
            }
            s[lo..hi].sort_by(|a, b| w.cmp(*a, *b));
            for (j, &i) in (lo..).zip(&s[lo..hi]) {
                cum += f64::from(w.weight(i));
                if reached(cum) {
                    return Some((start + j, i));
                }
            }
            // The tier's sum reached the target and its parts, added in another order, fell short
            // by a rounding step: its last candidate.
            return (lo < hi).then(|| (start + hi - 1, s[hi - 1]));
        }
    }

    /// The candidates whose logit is at least `floor`.
    fn count_at_least(&self, floor: f32) -> usize {
        let l = self.w.l;
        match self.topk {
            Some(idx) => idx.iter().filter(|&&i| l[i] >= floor).count(),
            None => l
                .chunks(SPAN)
                .zip(self.span_max)
                .filter(|(_, &m)| m >= floor)
                .map(|(values, _)| values.iter().filter(|&&v| v >= floor).count())
                .sum(),
        }
    }

    /// Finds tiers until one holds position `count - 1`, and puts that tier's candidates among the
    /// first `count` positions before its others; returns the tier, or `None` where there are fewer
    /// candidates than `count` (every tier found).
    fn cut(&mut self, count: usize) -> Option<usize> {
        let mut t = 0;
        loop {
            if t == self.tiers.len() && !self.next_tier() {
                return None;
            }
            let end = self.tiers[t].0;
            if end >= count {
                let start = self.tier_start(t);
                let w = self.w;
                let s = &mut self.members[start..end];
                let within = count - start;
                if within < s.len() {
                    s.select_nth_unstable_by(within, |a, b| w.cmp(*a, *b));
                }
                return Some(t);
            }
            t += 1;
        }
    }

    /// The candidates of the first `count` positions of the order (every candidate for `None`).
    fn prefix(&mut self, count: Option<usize>) -> Vec<usize> {
        let count = count.unwrap_or(usize::MAX);
        match self.cut(count) {
            Some(_) => self.members[..count].to_vec(),
            None => self.members.clone(),
        }
    }

    /// The total weight of the first `count` positions of the order.
    fn prefix_weight(&mut self, count: usize) -> f32 {
        let Some(t) = self.cut(count) else {
            return self.tiers.iter().map(|&(_, mass)| mass).sum::<f64>() as f32;
        };
        let before: f64 = self.tiers[..t].iter().map(|&(_, mass)| mass).sum();
        let (end, mass) = self.tiers[t];
        let part = if end == count {
            mass
        } else {
            let w = self.w;
            self.members[self.tier_start(t)..count]
                .iter()
                .map(|&i| f64::from(w.weight(i)))
                .sum()
        };
        (before + part) as f32
    }

    /// Of the first `count` positions (every candidate for `None`), the last in the order that weighs
    /// anything; the first if none does.
    fn last_drawable(&mut self, count: Option<usize>) -> usize {
        let w = self.w;
        let survivors = self.prefix(count);
        survivors
            .iter()
            .copied()
            .filter(|&i| w.weight(i) > 0.0)
            .max_by(|&a, &b| w.cmp(a, b))
            .or_else(|| survivors.iter().copied().min_by(|&a, &b| w.cmp(a, b)))
            .unwrap_or(0)
    }
}

/// Index of the largest logit (the first on ties; NaN is never the largest, unless it comes first):
/// what a walk that moves on to each strictly greater value finds. The largest of each span of
/// [`SPAN`] logits is found in lanes, then the first value equal to the largest in its span.
pub fn argmax(l: &[f32]) -> u32 {
    let Some(&first) = l.first() else {
        return 0;
    };
    if first.is_nan() {
        return 0;
    }
    let (mut best, mut span) = (first, 0);
    for (s, values) in l.chunks(SPAN).enumerate() {
        let m = lanes::max(values);
        if m > best {
            (best, span) = (m, s);
        }
    }
    // The first span that holds a value equal to `best` is `span` (an earlier one would have been
    // kept, as `best` moves on strictly greater values only).
    let start = span * SPAN;
    let at = l[start..]
        .iter()
        .position(|&v| v == best)
        .expect("the kept span holds its largest value");
    (start + at) as u32
}

/// Logits a span of the sampler's scans: the largest of a span decides whether its values are looked
/// at one by one.
const SPAN: usize = 256;

/// Logits a span of [`top_k_indices`]' pass: shorter than [`SPAN`], as a span whose largest value
/// passes the k-th best so far is looked at value by value.
const TOP_K_SPAN: usize = 64;

/// `log Σ exp(l)`, the terms in f32 and their sum in f64 (lane by lane, in one order on every
/// machine).
fn log_sum_exp(l: &[f32]) -> f32 {
    let max = lanes::max(l);
    lanes::sum_exp_f64(l, max, 1.0).ln() as f32 + max
}

/// The sampler's loops over a whole row of logits (a vocabulary, 50,000 to 250,000 values, every token
/// of every sequence): written lane by lane over [`lanes::LANES`] values so that the compiler makes
/// vector code of them for any x86-64 (or other) CPU, with the same operations in the same order on
/// every machine, so that a seed draws the same tokens everywhere. No libm call: [`lanes::exp`] is a
/// polynomial of multiplications and additions, and no multiply-add is fused, so the sums of
/// exponentials, compiled again for AVX2 and for AVX-512 (chosen at run time), give the bits of the
/// baseline build.
mod lanes {
    pub const LANES: usize = 16;

    /// The widest of the sums' builds this CPU runs.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Isa {
        Baseline,
        #[cfg(target_arch = "x86_64")]
        Avx2,
        #[cfg(target_arch = "x86_64")]
        Avx512,
    }

    /// The builds of the sums this CPU runs, the widest first.
    #[cfg(test)]
    pub fn isas() -> Vec<Isa> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                v.push(Isa::Avx2);
            }
        }
        v.push(Isa::Baseline);
        v
    }

    fn widest() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Isa::Avx2;
            }
        }
        Isa::Baseline
    }

    /// `pub fn $name(isa, args…)`: `$body` compiled for the build `isa` (baseline x86-64, or with AVX2
    /// or AVX-512 enabled: the same source and operations, so the same bits). Panics where the CPU lacks
    /// the build's features.
    macro_rules! builds {
        ($name:ident = $body:ident($($arg:ident: $ty:ty),*) -> $ret:ty) => {
            pub fn $name(isa: Isa, $($arg: $ty),*) -> $ret {
                match isa {
                    Isa::Baseline => $body($($arg),*),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => {
                        #[target_feature(enable = "avx2")]
                        unsafe fn avx2($($arg: $ty),*) -> $ret {
                            $body($($arg),*)
                        }
                        assert!(std::arch::is_x86_feature_detected!("avx2"));
                        // SAFETY: the CPU has AVX2 (asserted).
                        unsafe { avx2($($arg),*) }
                    }
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => {
                        #[target_feature(enable = "avx512f")]
                        unsafe fn avx512($($arg: $ty),*) -> $ret {
                            $body($($arg),*)
                        }
                        assert!(std::arch::is_x86_feature_detected!("avx512f"));
                        // SAFETY: the CPU has AVX-512 F (asserted).
                        unsafe { avx512($($arg),*) }
                    }
                }
            }
        };
    }

    builds!(max_in = max_body(l: &[f32]) -> f32);
    builds!(max_key_in = max_key_body(l: &[f32]) -> i32);
    builds!(weights_in = weights_body(l: &[f32], max: f32, inv_t: f32, out: &mut [f32]) -> f32);
    builds!(sum_exp_f64_in = sum_exp_f64_body(l: &[f32], max: f32, inv_t: f32) -> f64);

    /// `out[i] = exp((l[i] − max) · inv_t)` for every `i` (`out` at least as long as `l`), and their
    /// sum in f32, lane by lane, in the widest build this CPU runs.
    pub fn weights(l: &[f32], max: f32, inv_t: f32, out: &mut [f32]) -> f32 {
        weights_in(widest(), l, max, inv_t, out)
    }

    /// `Σ exp((v − max) · inv_t)` over `l`, the terms in f32, in the widest build this CPU runs.
    pub fn sum_exp_f64(l: &[f32], max: f32, inv_t: f32) -> f64 {
        sum_exp_f64_in(widest(), l, max, inv_t)
    }

    /// The largest value of `l` (NaN ignored; −∞ for none), in the widest build this CPU runs (the
    /// largest is the largest in any order).
    pub fn max(l: &[f32]) -> f32 {
        max_in(widest(), l)
    }

    /// The largest [`total_key`] of `l` (`i32::MIN` for none), in the widest build this CPU runs.
    pub fn max_key(l: &[f32]) -> i32 {
        max_key_in(widest(), l)
    }

    #[inline(always)]
    fn max_body(l: &[f32]) -> f32 {
        let mut m = [f32::NEG_INFINITY; LANES];
        let chunks = l.chunks_exact(LANES);
        let rest = chunks.remainder();
        for c in chunks {
            for j in 0..LANES {
                m[j] = if c[j] > m[j] { c[j] } else { m[j] };
            }
        }
        let mut best = f32::NEG_INFINITY;
        for &v in m.iter().chain(rest) {
            if v > best {
                best = v;
            }
        }
        best
    }

    /// `e^x` for `x ≤ 0` (and up to 88), within two units in the last place; 0 below −87.33, where
    /// the result would not be a normal number (a token a mask took out, at −∞, weighs exactly 0);
    /// `e^0 = 1` exactly. Cephes' `expf`: `x = n ln 2 + r`, `|r| ≤ ln 2 / 2`, a polynomial in `r`
    /// times `2^n`; `n` rounded by adding and subtracting `1.5 × 2^23`.
    #[inline(always)]
    pub fn exp(x: f32) -> f32 {
        const MAGIC: f32 = 12_582_912.0;
        let xc = x.clamp(-88.0, 88.0);
        let t = xc * std::f32::consts::LOG2_E + MAGIC;
        let n = t - MAGIC;
        let r = xc - n * 0.693_359_4 - n * -2.121_944_4e-4;
        let p = 1.987_569_1e-4;
        let p = p * r + 1.398_199_9e-3;
        let p = p * r + 8.333_452e-3;
        let p = p * r + 4.166_579_6e-2;
        let p = p * r + 1.666_666_5e-1;
        let p = p * r + 0.5;
        let e = p * (r * r) + r + 1.0;
        // `t`'s low bits hold `n` (within ±2^22 of the magic number's own).
        let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
        let scale = f32::from_bits((ni.wrapping_add(127) << 23) as u32);
        // NaN stays NaN (the clamp keeps it, and every step after).
        if x < -87.33 {
            0.0
        } else {
            e * scale
        }
    }

    #[inline(always)]
    fn weights_body(l: &[f32], max: f32, inv_t: f32, out: &mut [f32]) -> f32 {
        let out = &mut out[..l.len()];
        let mut acc = [0f32; LANES];
        let chunks = l.chunks_exact(LANES);
        let rest = chunks.remainder();
        let mut outs = out.chunks_exact_mut(LANES);
        for (c, o) in chunks.zip(&mut outs) {
            for j in 0..LANES {
                o[j] = exp((c[j] - max) * inv_t);
                acc[j] += o[j];
            }
        }
        let mut sum = 0f32;
        for a in acc {
            sum += a;
        }
        for (&v, o) in rest.iter().zip(outs.into_remainder()) {
            *o = exp((v - max) * inv_t);
            sum += *o;
        }
        sum
    }

    /// Lane by lane in f32 over blocks of [`super::SPAN`] values (16 terms a lane), each block's lanes
    /// then added in f64.
    #[inline(always)]
    fn sum_exp_f64_body(l: &[f32], max: f32, inv_t: f32) -> f64 {
        let mut acc = [0f64; LANES];
        let blocks = l.chunks_exact(super::SPAN);
        let tail = blocks.remainder();
        for block in blocks {
            let mut part = [0f32; LANES];
            for c in block.chunks_exact(LANES) {
                for j in 0..LANES {
                    part[j] += exp((c[j] - max) * inv_t);
                }
            }
            for j in 0..LANES {
                acc[j] += f64::from(part[j]);
            }
        }
        let chunks = tail.chunks_exact(LANES);
        let rest = chunks.remainder();
        for c in chunks {
            for j in 0..LANES {
                acc[j] += f64::from(exp((c[j] - max) * inv_t));
            }
        }
        let mut sum = 0f64;
        for a in acc {
            sum += a;
        }
        for &v in rest {
            sum += f64::from(exp((v - max) * inv_t));
        }
        sum
    }

    /// The key that orders values as `f32::total_cmp` does.
    #[inline(always)]
    pub fn total_key(v: f32) -> i32 {
        let bits = v.to_bits() as i32;
        bits ^ (((bits >> 31) as u32) >> 1) as i32
    }

    #[inline(always)]
    fn max_key_body(l: &[f32]) -> i32 {
        let mut m = [i32::MIN; LANES];
        let chunks = l.chunks_exact(LANES);
        let rest = chunks.remainder();
        for c in chunks {
            for j in 0..LANES {
                m[j] = m[j].max(total_key(c[j]));
            }
        }
        let mut best = i32::MIN;
        for k in m {
            best = best.max(k);
        }
        for &v in rest {
            best = best.max(total_key(v));
        }
        best
    }
}

/// Indices of the `k` largest values, largest first (ties by lower index).
pub fn top_k_indices(l: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(l.len());
    if k <= 64 {
        // One pass keeping the best k in order: most values lose to the k-th at once.
        let mut best: Vec<usize> = Vec::with_capacity(k + 1);
        for (s, values) in l.chunks(TOP_K_SPAN).enumerate() {
            // Once k are in, a span whose largest value does not pass the k-th is passed over whole
            // (its values would each lose to the k-th, which only rises).
            if best.len() == k
                && (k == 0 || lanes::max_key(values) <= lanes::total_key(l[best[k - 1]]))
            {
                continue;
            }
            for (i, &v) in (s * TOP_K_SPAN..).zip(values) {
                if best.len() == k {
                    // Ties go to the lower index, which is already in.
                    if k == 0 || v.total_cmp(&l[best[k - 1]]).is_le() {
                        continue;
                    }
                }
                let at = best.partition_point(|&j| l[j].total_cmp(&v).is_ge());
                best.insert(at, i);
                best.truncate(k);
            }
        }
        return best;
    }
    let mut idx: Vec<usize> = (0..l.len()).collect();
    let cmp = |a: &usize, b: &usize| l[*b].total_cmp(&l[*a]).then(a.cmp(b));
    if k < l.len() && k > 0 {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_tokens_are_held_back_until_min_tokens_unless_a_grammar_allows_nothing_else() {
        // Token 1 (the stop token) is the most likely at every step.
        let logits = [1.0f32, 3.0, 2.0, 0.5];
        let params = SamplingParams {
            logprobs: Some(1),
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(params.clone(), &[]).holding_back(vec![1, 3], 2);
        assert!(
            !s.argmax_only(),
            "a sampler holding tokens back needs the row"
        );
        let first = s.sample(&logits);
        assert_eq!(first.token, 2, "the best token not held back");
        // The logprobs are the model's own.
        assert_eq!(first.logprob.unwrap().logprob, 2.0 - log_sum_exp(&logits));
        // A grammar that allows a held token and a free one: the free one.
        let mut t = Sampler::new(params.clone(), &[]).holding_back(vec![1, 3], 2);
        assert_eq!(t.sample_allowed(&logits, Some(&[0b0110])).token, 2);
        // A grammar that allows only held tokens (it may only end) is followed.
        assert_eq!(s.sample_allowed(&logits, Some(&[0b1010])).token, 1);
        // Two tokens recorded: nothing is held back any more.
        assert_eq!(s.sample(&logits).token, 1);
        let greedy = Sampler::new(SamplingParams::greedy(), &[]).holding_back(vec![1], 1);
        assert!(!greedy.argmax_only());
        let mut greedy = greedy;
        assert_eq!(greedy.sample(&logits).token, 2);
        assert!(
            greedy.argmax_only(),
            "past min_tokens the device may choose again"
        );
        // Drawn: the held token never comes before min_tokens, whatever the draw.
        let drawn = SamplingParams {
            temperature: 1.0,
            seed: Some(3),
            ..SamplingParams::default()
        };
        for seed in 0..50 {
            let mut s = Sampler::new(
                SamplingParams {
                    seed: Some(seed),
                    ..drawn.clone()
                },
                &[],
            )
            .holding_back(vec![1], 5);
            for _ in 0..5 {
                assert_ne!(s.sample(&logits).token, 1);
            }
        }
        // With none held, min_tokens does nothing.
        let mut s = Sampler::new(params, &[]).holding_back(Vec::new(), 9);
        assert!(s.sample(&logits).token == 1);
    }

    #[test]
    fn bad_words_are_never_completed_unless_a_grammar_allows_nothing_else() {
        let logits = [1.0f32, 3.0, 2.0, 0.5, 2.5];
        let with = |bad_words: Vec<Vec<u32>>, temperature: f32, seed: u64| SamplingParams {
            temperature,
            bad_words,
            logprobs: Some(1),
            seed: Some(seed),
            ..SamplingParams::default()
        };
        // A one-token word is never chosen: greedy takes the next best.
        let mut s = Sampler::new(with(vec![vec![1]], 0.0, 0), &[]);
        assert!(!s.argmax_only(), "a sampler with bad words needs the row");
        let got = s.sample(&logits);
        assert_eq!(got.token, 4);
        // Logprobs stay the model's own.
        assert_eq!(got.logprob.unwrap().logprob, 2.5 - log_sum_exp(&logits));
        // A two-token word [4, 1]: 1 is banned right after 4 only.
        let mut s = Sampler::new(with(vec![vec![4, 1]], 0.0, 0), &[]);
        assert_eq!(s.record(&logits, 4).token, 4);
        assert_eq!(
            s.sample(&logits).token,
            4,
            "1 would complete the word after 4"
        );
        assert_eq!(s.sample(&logits).token, 4);
        assert_eq!(s.record(&logits, 2).token, 2);
        assert_eq!(s.sample(&logits).token, 1, "after 2, 1 completes nothing");
        // A three-token word needs its two first tokens last, in order; a one-token word beside it.
        let mut s = Sampler::new(with(vec![vec![2, 4, 1], vec![3]], 0.0, 0), &[]);
        for t in [4, 2] {
            s.record(&logits, t);
        }
        assert_eq!(s.sample(&logits).token, 1, "the tail is 4 2, not 2 4");
        for t in [2, 4] {
            s.record(&logits, t);
        }
        assert_eq!(
            s.sample(&logits).token,
            4,
            "the tail is 2 4: 1 would end the word"
        );
        // A grammar that allows only a word's end is followed (the output goes on).
        let mut s = Sampler::new(with(vec![vec![1]], 0.0, 0), &[]);
        assert_eq!(s.sample_allowed(&logits, Some(&[0b0001_0010])).token, 4);
        assert_eq!(s.sample_allowed(&logits, Some(&[0b0000_0010])).token, 1);
        // Drawn: the banned token never comes, whatever the draw.
        for seed in 0..50 {
            let mut s = Sampler::new(with(vec![vec![1], vec![4, 2]], 1.0, seed), &[]);
            let mut last = None;
            for _ in 0..8 {
                let t = s.sample(&logits).token;
                assert_ne!(t, 1);
                assert!(!(last == Some(4) && t == 2), "4 then 2 was written");
                last = Some(t);
            }
        }
        // An empty sequence is refused by the sampler's domain check.
        let e = with(vec![vec![]], 0.0, 0).validate().unwrap_err();
        assert!(e.contains("bad_words"), "{e}");
    }

    #[test]
    fn only_the_allowed_tokens_are_chosen_unless_a_grammar_allows_none_of_them() {
        let logits = [1.0f32, 3.0, 2.0, 0.5];
        let only = |ids: Vec<u32>, temperature: f32| SamplingParams {
            temperature,
            allowed_token_ids: ids,
            logprobs: Some(1),
            seed: Some(5),
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(only(vec![0, 3], 0.0), &[]);
        assert!(!s.argmax_only(), "a restricted sampler needs the row");
        let got = s.sample(&logits);
        assert_eq!(got.token, 0, "the best of the allowed");
        assert_eq!(
            got.logprob.unwrap().top[0].0,
            1,
            "logprobs stay the model's own"
        );
        for _ in 0..50 {
            let mut s = Sampler::new(only(vec![2, 3], 1.0), &[]);
            assert!([2, 3].contains(&s.sample(&logits).token));
        }
        // With a grammar: both hold where they share a token; the grammar alone where they do not.
        let mut s = Sampler::new(only(vec![0, 3], 0.0), &[]);
        assert_eq!(s.sample_allowed(&logits, Some(&[0b1110])).token, 3);
        assert_eq!(s.sample_allowed(&logits, Some(&[0b0110])).token, 1);
        // An id past the row is no token: the others still hold.
        let mut s = Sampler::new(only(vec![2, 99], 0.0), &[]);
        assert_eq!(s.sample(&logits).token, 2);
        // Held-back stop tokens among the allowed: the others first.
        let mut s = Sampler::new(only(vec![1, 3], 0.0), &[]).holding_back(vec![1], 1);
        assert_eq!(s.sample(&logits).token, 3);
        assert_eq!(s.sample(&logits).token, 1);
    }

    #[test]
    fn logit_bias_moves_the_choice_and_not_the_logprobs() {
        let logits = [1.0f32, 3.0, 2.0, 0.5];
        let biased = |bias: Vec<(u32, f32)>, temperature: f32| SamplingParams {
            temperature,
            logit_bias: bias,
            logprobs: Some(1),
            seed: Some(7),
            ..SamplingParams::default()
        };
        // Greedy: the bias decides, token 0 up by 2.5 beats token 1.
        let mut s = Sampler::new(biased(vec![(0, 2.5)], 0.0), &[]);
        assert!(!s.argmax_only(), "a biased sampler needs the row");
        let got = s.sample(&logits);
        assert_eq!(got.token, 0);
        // The logprob is the model's, not the biased one.
        let lse = log_sum_exp(&logits);
        let lp = got.logprob.unwrap();
        assert_eq!(lp.logprob, logits[0] - lse);
        assert_eq!(lp.top[0].0, 1, "the model's own most likely token");
        // -100 keeps a token out when others are near; a bias past the row's length is ignored.
        let mut s = Sampler::new(biased(vec![(1, -100.0), (9, 50.0)], 0.0), &[]);
        assert_eq!(s.sample(&logits).token, 2);
        // Drawn: +100 on one token takes every draw.
        let mut s = Sampler::new(biased(vec![(3, 100.0)], 1.0), &[]);
        for _ in 0..50 {
            assert_eq!(s.sample(&logits).token, 3);
        }
        // A grammar's mask still wins over a bias.
        let mut s = Sampler::new(biased(vec![(3, 100.0)], 0.0), &[]);
        let mask = [0b0100u32];
        assert_eq!(s.sample_allowed(&logits, Some(&mask)).token, 2);
        // Unbiased: the plain argmax, as a device would choose it.
        let plain = SamplingParams::greedy();
        assert!(Sampler::new(plain, &[]).argmax_only());
    }

    #[test]
    fn greedy_picks_argmax_and_reports_logprobs() {
        let mut s = Sampler::new(
            SamplingParams {
                logprobs: Some(2),
                ..SamplingParams::greedy()
            },
            &[],
        );
        let out = s.sample(&[0.0, 3.0, 1.0]);
        assert_eq!(out.token, 1);
        let lp = out.logprob.unwrap();
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        let total: f32 = [0.0f32, 3.0, 1.0].iter().map(|v| (v - 3.0f32).exp()).sum();
        assert!((lp.logprob + total.ln()).abs() < 1e-5);
    }

    #[test]
    fn a_mask_leaves_only_its_tokens_in_every_mode() {
        let logits: Vec<f32> = (0..70).map(|i| (i as f32 * 0.37).cos() * 4.0).collect();
        // Tokens 5, 40 and 66 only.
        let mut mask = vec![0u32; 3];
        for t in [5usize, 40, 66] {
            mask[t / 32] |= 1 << (t % 32);
        }
        let mut greedy = Sampler::new(SamplingParams::greedy(), &[]);
        let best = [5usize, 40, 66]
            .into_iter()
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap();
        assert_eq!(
            greedy.sample_allowed(&logits, Some(&mask)).token,
            best as u32
        );
        for params in [
            SamplingParams::default(),
            SamplingParams {
                temperature: 2.0,
                top_k: 3,
                top_p: 0.5,
                min_p: 0.1,
                repetition_penalty: 1.3,
                seed: Some(1),
                ..Default::default()
            },
        ] {
            let mut s = Sampler::new(params, &[5]);
            for _ in 0..200 {
                let t = s.sample_allowed(&logits, Some(&mask)).token;
                assert!([5, 40, 66].contains(&t), "{t}");
            }
        }
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
        let p = SamplingParams {
            temperature: 1.5,
            top_k: 3,
            seed: Some(7),
            ..Default::default()
        };
        let top3 = top_k_indices(&logits, 3);
        let run = || {
            let mut s = Sampler::new(p.clone(), &[]);
            (0..40).map(|_| s.sample(&logits).token).collect::<Vec<_>>()
        };
        let a = run();
        assert_eq!(a, run());
        assert!(a.iter().all(|t| top3.contains(&(*t as usize))));
        assert!(
            a.iter().collect::<std::collections::HashSet<_>>().len() > 1,
            "temperature 1.5 over 3 tokens varies"
        );
    }

    #[test]
    fn penalties_move_greedy_away_from_repeats() {
        let logits = [2.0f32, 1.9, 0.0];
        let mut s = Sampler::new(
            SamplingParams {
                presence_penalty: 0.5,
                ..SamplingParams::greedy()
            },
            &[],
        );
        assert_eq!(s.sample(&logits).token, 0);
        assert_eq!(
            s.sample(&logits).token,
            1,
            "token 0 now pays the presence penalty"
        );
        let mut r = Sampler::new(
            SamplingParams {
                repetition_penalty: 1.2,
                ..SamplingParams::greedy()
            },
            &[0],
        );
        assert_eq!(r.sample(&logits).token, 1, "2.0 / 1.2 < 1.9");
    }

    /// The draw as a sort of the whole candidate list walks it (the reference the chunked walk must
    /// agree with).
    fn draw_by_full_sort(p: &SamplingParams, l: &[f32], u: f32) -> u32 {
        let k = if p.top_k == 0 {
            l.len()
        } else {
            p.top_k.min(l.len())
        };
        let mut idx = top_k_indices(l, k);
        let max = l[idx[0]];
        let inv_t = 1.0 / p.temperature;
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|&i| lanes::exp((l[i] - max) * inv_t))
            .collect();
        // Summed in f64: the reference's own rounding should not be what decides a boundary.
        let sum = probs.iter().map(|&x| f64::from(x)).sum::<f64>() as f32;
        probs.iter_mut().for_each(|x| *x /= sum);
        if p.top_p < 1.0 {
            let mut acc = 0f64;
            let keep = probs
                .iter()
                .position(|pr| {
                    acc += f64::from(*pr);
                    acc >= f64::from(p.top_p)
                })
                .map_or(probs.len(), |j| j + 1);
            idx.truncate(keep);
            probs.truncate(keep);
        }
        if p.min_p > 0.0 {
            let floor = p.min_p * probs[0];
            let keep = probs.iter().take_while(|x| **x >= floor).count().max(1);
            idx.truncate(keep);
            probs.truncate(keep);
        }
        let total = probs.iter().map(|&x| f64::from(x)).sum::<f64>() as f32;
        let r = f64::from(u * total);
        let mut acc = 0f64;
        for (i, pr) in idx.iter().zip(&probs) {
            acc += f64::from(*pr);
            if acc > r {
                return *i as u32;
            }
        }
        idx[idx.len() - 1] as u32
    }

    #[test]
    fn the_chunked_walk_draws_what_a_full_sort_draws() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (mut same, mut total) = (0, 0);
        for case in 0..400 {
            let n = [50, 300, 2000, 49152][case % 4];
            // Peaked and flat distributions alike.
            let scale = [0.5f32, 3.0, 10.0][case % 3];
            let l: Vec<f32> = (0..n).map(|_| rng.random::<f32>() * scale).collect();
            let p = SamplingParams {
                temperature: [0.7, 1.0, 1.5][case % 3],
                top_k: [0, 0, 40, 1000][(case / 4) % 4],
                top_p: [1.0, 0.9, 0.5][(case / 3) % 3],
                min_p: [0.0, 0.0, 0.1][(case / 5) % 3],
                ..SamplingParams::default()
            };
            for _ in 0..5 {
                let u = rng.random::<f32>();
                total += 1;
                same += usize::from(draw(&p, &l, u) == draw_by_full_sort(&p, &l, u));
            }
        }
        // Sums taken in another order may move a boundary by one rounding step, nothing more (the
        // reference sums in f64 as the draw does: 2,000 of 2,000 agreed when this was written).
        assert!(same * 1000 >= total * 999, "{same} of {total}");
    }

    /// The walk [`argmax`] must agree with: on to each strictly greater value.
    fn argmax_by_walk(l: &[f32]) -> u32 {
        let mut best = 0;
        for (i, v) in l.iter().enumerate() {
            if *v > l[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_by_spans_equals_the_walk() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for case in 0..300 {
            let n = [1, 2, 15, 16, 17, 255, 256, 257, 1000, 49152][case % 10];
            // Few distinct values in some cases (ties across spans), and NaN, ±0 and ±∞ among them.
            let levels = [2u32, 50, u32::MAX][case % 3];
            let mut l: Vec<f32> = (0..n)
                .map(|_| (rng.random::<u32>() % levels) as f32 * 0.25 - 3.0)
                .collect();
            for _ in 0..case % 4 {
                let at = rng.random_range(0..n);
                l[at] =
                    [f32::NAN, 0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY][rng.random_range(0..5)];
            }
            assert_eq!(
                argmax(&l),
                argmax_by_walk(&l),
                "case {case}: {:?}",
                &l[..n.min(20)]
            );
        }
        for l in [
            vec![],
            vec![f32::NAN, 1.0],
            vec![1.0, f32::NAN, 2.0],
            vec![-0.0, 0.0],
            vec![0.0, -0.0],
            vec![f32::NEG_INFINITY; 300],
            vec![f32::NAN; 300],
        ] {
            assert_eq!(argmax(&l), argmax_by_walk(&l), "{:?}", &l[..l.len().min(4)]);
        }
        let mut late = vec![0f32; 49152];
        late[40_000] = 1.0;
        late[45_000] = 1.0;
        assert_eq!(argmax(&late), 40_000, "the first of two equal largest");
    }

    #[test]
    fn the_lanes_exp_is_close_to_exp_and_exact_where_it_must_be() {
        // Every 1/1024 from −90 to 10: within 2 units in the last place of the f64 exponential.
        let mut worst = 0f64;
        for i in -92_160..=10_240 {
            let x = i as f32 / 1024.0;
            let want = f64::from(x).exp();
            let got = f64::from(lanes::exp(x));
            if x < -87.33 {
                assert_eq!(got, 0.0, "{x}");
                continue;
            }
            let ulp = f64::from(f32::EPSILON) * want;
            worst = worst.max((got - want).abs() / ulp);
        }
        assert!(worst <= 2.0, "{worst} units in the last place");
        assert_eq!(lanes::exp(0.0), 1.0);
        assert_eq!(lanes::exp(-0.0), 1.0);
        assert_eq!(lanes::exp(f32::NEG_INFINITY), 0.0);
        assert!(lanes::exp(f32::NAN).is_nan());
    }

    #[test]
    fn every_build_of_the_sums_gives_the_baseline_bits() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        let isas = lanes::isas();
        eprintln!("builds run on this CPU: {isas:?}");
        for n in [0usize, 1, 7, 16, 33, 1000, 49152, 128_256] {
            let l: Vec<f32> = (0..n).map(|_| rng.random::<f32>() * 30.0 - 15.0).collect();
            let max = lanes::max(&l);
            for inv_t in [1.0f32, 1.25, 0.5, 10.0] {
                let mut base_w = vec![0f32; n];
                let base = lanes::weights_in(lanes::Isa::Baseline, &l, max, inv_t, &mut base_w);
                let base64 = lanes::sum_exp_f64_in(lanes::Isa::Baseline, &l, max, inv_t);
                for &isa in &isas {
                    let mut w = vec![0f32; n];
                    assert_eq!(
                        lanes::weights_in(isa, &l, max, inv_t, &mut w).to_bits(),
                        base.to_bits(),
                        "{isa:?} n {n}"
                    );
                    assert!(
                        w.iter()
                            .zip(&base_w)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa:?} n {n}"
                    );
                    assert!(
                        w.iter()
                            .zip(&l)
                            .all(|(&a, &v)| a == lanes::exp((v - max) * inv_t)),
                        "{isa:?} n {n}: each weight is the scalar exp's"
                    );
                    assert_eq!(lanes::max_in(isa, &l).to_bits(), max.to_bits());
                    assert_eq!(
                        lanes::max_key_in(isa, &l),
                        lanes::max_key_in(lanes::Isa::Baseline, &l)
                    );
                    assert_eq!(
                        lanes::sum_exp_f64_in(isa, &l, max, inv_t).to_bits(),
                        base64.to_bits(),
                        "{isa:?} n {n}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_lanes_sums_and_maxima_agree_with_plain_loops() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        for n in [0usize, 1, 15, 16, 17, 100, 4097, 49152] {
            let mut l: Vec<f32> = (0..n).map(|_| rng.random::<f32>() * 20.0 - 10.0).collect();
            if n > 3 {
                l[1] = f32::NAN;
                l[2] = f32::NEG_INFINITY;
            }
            let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(lanes::max(&l), max, "n {n}");
            let keys = l
                .iter()
                .map(|&v| lanes::total_key(v))
                .max()
                .unwrap_or(i32::MIN);
            assert_eq!(lanes::max_key(&l), keys, "n {n}");
            let clean: Vec<f32> = l.iter().copied().filter(|v| !v.is_nan()).collect();
            let want: f64 = clean
                .iter()
                .map(|&v| (f64::from(v - max) / 0.7).exp())
                .sum();
            let mut scratch = vec![0f32; clean.len()];
            let (got, got64) = (
                lanes::weights(&clean, max, 1.0 / 0.7, &mut scratch),
                lanes::sum_exp_f64(&clean, max, 1.0 / 0.7),
            );
            assert!(
                (f64::from(got) - want).abs() <= want * 1e-5 + 1e-30,
                "n {n}"
            );
            assert!((got64 - want).abs() <= want * 1e-6 + 1e-30, "n {n}");
        }
        // The key orders as `total_cmp` does.
        let vals = [
            f32::NEG_INFINITY,
            -1.0,
            -0.0,
            0.0,
            1e-40,
            1.0,
            f32::INFINITY,
            f32::NAN,
        ];
        for a in vals {
            for b in vals {
                assert_eq!(
                    lanes::total_key(a).cmp(&lanes::total_key(b)),
                    a.total_cmp(&b),
                    "{a} {b}"
                );
            }
        }
    }

    #[test]
    fn top_k_by_one_pass_equals_a_full_sort() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for case in 0..200 {
            let n = [1, 5, 64, 1000, 49152][case % 5];
            // Few distinct values in some cases, so that ties are common.
            let levels = [3u32, 1000, u32::MAX][case % 3];
            let l: Vec<f32> = (0..n)
                .map(|_| (rng.random::<u32>() % levels) as f32 * 0.5)
                .collect();
            for k in [0, 1, 2, 20, 64, 65, 200] {
                let mut full: Vec<usize> = (0..n).collect();
                full.sort_by(|a, b| l[*b].total_cmp(&l[*a]).then(a.cmp(b)));
                full.truncate(k.min(n));
                assert_eq!(top_k_indices(&l, k), full, "n {n} k {k}");
            }
        }
    }

    #[test]
    fn min_p_and_top_p_cut_the_tail() {
        let logits = [10.0f32, 0.0, 0.0, 0.0];
        for p in [
            SamplingParams {
                min_p: 0.1,
                seed: Some(1),
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.5,
                seed: Some(1),
                ..Default::default()
            },
        ] {
            let mut s = Sampler::new(p, &[]);
            assert!((0..50).all(|_| s.sample(&logits).token == 0));
        }
    }

    #[test]
    fn invalid_params_are_named() {
        assert!(SamplingParams {
            top_p: 0.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .contains("top_p"));
        assert!(SamplingParams {
            temperature: -1.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .contains("temperature"));
    }
}
