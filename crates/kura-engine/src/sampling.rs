//! Choosing the next token from logits: penalties, temperature, top-k, top-p, min-p, a seeded RNG per
//! request, and logprobs with top alternatives. (Stop strings are `kura-text`'s `StopChecker`.)
//!
//! Order of operations (that of vLLM and HF): penalties on the raw logits → greedy if temperature is 0 →
//! divide by temperature → top-k → softmax → top-p → min-p → draw. Logprobs are those of the unmodified
//! distribution (log-softmax of the raw logits), as the OpenAI API reports them. O(vocab log k) per token.

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
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Sampler {
            params,
            rng,
            generated: Default::default(),
            seen: prompt.iter().copied().collect(),
        }
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
        let penalized =
            p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        let mut owned = Vec::new();
        if penalized || allowed.is_some() {
            owned = logits.to_vec();
        }
        if let Some(mask) = allowed {
            for (i, v) in owned.iter_mut().enumerate() {
                if mask.get(i / 32).is_none_or(|w| w >> (i % 32) & 1 == 0) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        let penalized = penalized || allowed.is_some();
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

    /// Records `token` as generated (for the penalties), with its logprobs when asked.
    pub fn record(&mut self, logits: &[f32], token: u32) -> Sampled {
        *self.generated.entry(token).or_insert(0) += 1;
        self.seen.insert(token);
        // Log-probabilities of the model's distribution: logit − log Σ exp (no vector of them is made).
        let logprob = self.params.logprobs.map(|k| {
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
        });
        Sampled { token, logprob }
    }
}

/// The token that the uniform draw `u` in [0, 1) picks: the softmax of `l / temperature` over the top-k
/// logits, cut to the nucleus (`top_p`) and to `min_p` of the most likely token, walked from the most
/// likely down.
///
/// The walk visits candidates in tiers of weight (relative to the most likely: ≥ 1e-3, ≥ 1e-6, ≥ 1e-9,
/// the rest), each found by one pass and sorted alone; tiers follow each other in the global order, so
/// the walk is that of a full sort, and it rarely goes past the first tier.
fn draw(p: &SamplingParams, l: &[f32], u: f32) -> u32 {
    let inv_t = 1.0 / p.temperature;
    let n = l.len();
    let k = if p.top_k == 0 { n } else { p.top_k.min(n) };
    let cmp = |a: &usize, b: &usize| l[*b].total_cmp(&l[*a]).then(a.cmp(b));
    // The top-k candidates (all of them without top-k).
    let topk: Option<Vec<usize>> = (k < n).then(|| top_k_indices(l, k));
    let max = match &topk {
        Some(idx) => idx.iter().map(|&i| l[i]).fold(f32::NEG_INFINITY, f32::max),
        None => l.iter().copied().fold(f32::NEG_INFINITY, f32::max),
    };
    let weight = |i: usize| ((l[i] - max) * inv_t).exp();
    let sum: f32 = match &topk {
        Some(idx) => idx.iter().map(|&i| weight(i)).sum(),
        None => l.iter().map(|&v| ((v - max) * inv_t).exp()).sum(),
    };
    let prob = |i: usize| weight(i) / sum;
    // Tier bounds on the weight, from the top: [1e-3, 1], [1e-6, 1e-3), [1e-9, 1e-6), [0, 1e-9).
    const BOUNDS: [f32; 4] = [1e-3, 1e-6, 1e-9, 0.0];
    let mut order: Vec<usize> = Vec::new();
    let mut tiers = 0;
    let mut next_tier = |order: &mut Vec<usize>| -> bool {
        if tiers == BOUNDS.len() {
            return false;
        }
        let lo = BOUNDS[tiers];
        let hi = if tiers == 0 {
            f32::INFINITY
        } else {
            BOUNDS[tiers - 1]
        };
        tiers += 1;
        let start = order.len();
        // On the logits, without an exp: weight ≥ b ⟺ logit ≥ max + ln(b) · temperature.
        let at_least = |b: f32| {
            if b == 0.0 {
                f32::NEG_INFINITY
            } else {
                max + b.ln() / inv_t
            }
        };
        let (lo_logit, hi_logit) = (at_least(lo), at_least(hi));
        let in_tier = |i: usize| l[i] >= lo_logit && (hi == f32::INFINITY || l[i] < hi_logit);
        match &topk {
            Some(idx) => order.extend(idx.iter().copied().filter(|&i| in_tier(i))),
            None => order.extend((0..n).filter(|&i| in_tier(i))),
        }
        order[start..].sort_by(cmp);
        true
    };
    // Whether the order reaches position `j` (more tiers sorted as needed).
    let mut reach = |order: &mut Vec<usize>, j: usize| -> bool {
        while order.len() <= j {
            if !next_tier(order) {
                return false;
            }
        }
        true
    };
    // The survivors: a prefix of the order, `keep` long (`None`: every candidate).
    let mut keep: Option<usize> = None;
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut j = 0;
        while reach(&mut order, j) {
            acc += prob(order[j]);
            j += 1;
            if acc >= p.top_p {
                keep = Some(j);
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        // The most likely candidate has weight 1: the survivors weigh at least min_p.
        let mut j = 0;
        while keep.is_none_or(|kp| j < kp) && reach(&mut order, j) {
            if j > 0 && weight(order[j]) < p.min_p {
                keep = Some(j);
                break;
            }
            j += 1;
        }
    }
    let total: f32 = match keep {
        Some(kp) => order[..kp].iter().map(|&i| prob(i)).sum(),
        None => 1.0,
    };
    let mut r = u * total;
    let mut j = 0;
    while keep.is_none_or(|kp| j < kp) && reach(&mut order, j) {
        let pr = prob(order[j]);
        if r < pr {
            return order[j] as u32;
        }
        r -= pr;
        j += 1;
    }
    // Rounding left `r` past the last survivor: the least likely one that can be drawn at all (tokens
    // a mask took out weigh nothing).
    let last = keep.unwrap_or(order.len());
    order[..last]
        .iter()
        .rev()
        .find(|&&i| weight(i) > 0.0)
        .map_or(order[0], |&i| i) as u32
}

/// Index of the largest logit (the first on ties).
pub fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in l.iter().enumerate() {
        if *v > l[best] {
            best = i;
        }
    }
    best as u32
}

/// `log Σ exp(l)`, the terms in f32 and their sum in f64.
fn log_sum_exp(l: &[f32]) -> f32 {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = l.iter().map(|v| f64::from((v - max).exp())).sum();
    sum.ln() as f32 + max
}

/// Indices of the `k` largest values, largest first (ties by lower index).
pub fn top_k_indices(l: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(l.len());
    if k <= 64 {
        // One pass keeping the best k in order: most values lose to the k-th at once.
        let mut best: Vec<usize> = Vec::with_capacity(k + 1);
        for (i, &v) in l.iter().enumerate() {
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
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|&i| ((l[i] - max) / p.temperature).exp())
            .collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= sum);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = probs
                .iter()
                .position(|pr| {
                    acc += pr;
                    acc >= p.top_p
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
        let total: f32 = probs.iter().sum();
        let mut r = u * total;
        for (i, pr) in idx.iter().zip(&probs) {
            if r < *pr {
                return *i as u32;
            }
            r -= pr;
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
        // Sums taken in another order may move a boundary by one rounding step, nothing more.
        assert!(same * 1000 >= total * 995, "{same} of {total}");
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
