//! The cost model of one engine step, in place of the model's forward pass: a linear function of the
//! step's shape, fitted by least squares on steps timed with the real model (`kura sim --calibrate`).
//!
//! ```text
//!  step ms = base_ms + per_token_ms · Σ tokens + per_seq_ms · items
//!          + per_prefill_attention_ms · Σ_prefill tokens · (start + tokens / 2) / 10⁶
//!          + per_decode_context_ms · Σ_decode (start + 1 − shared) / 10⁶
//!          + per_shared_context_ms · Σ_decode shared / 10⁶
//! ```
//!
//! The token term is the weights' matrix products (proportional to the tokens of the step), the item term
//! the per-sequence work (logits of its last token, sampling, the engine's bookkeeping), the attention
//! terms the scores against the context, and the base the rest (one pass over the weights for a small
//! batch is in the base and the token term together). Attention is two terms because a prompt chunk reads
//! each K/V row once for all its tokens, while each decode token reads its whole context for itself: per
//! (token, position) pair, decode costs several times what prefill does. A decode token's context splits in
//! two: positions in blocks no earlier item of the step reads, and positions in blocks another item has
//! just read (a shared prefix), which the CPU's caches still hold and which cost less.
//!
//! On several threads the attention terms are scaled by how unevenly the runtime deals the step's
//! attention units to the threads (`kura_shape::attn_split::thread_shares`: threads × the busiest thread's
//! share ÷ all units, 1 for an even split). A lone decode token past 1,024 positions has a full and a
//! short segment per KV head, and one of two threads reads twice what the other does; a batch of 8 splits
//! evenly. A model without this scale under-predicted single-stream decode by a fifth.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::replay::SimError;

/// The largest cost coefficient taken, in milliseconds (a day): larger ones are a mistake in the file,
/// and would carry the simulated clock past what it can hold.
pub const MAX_COEFFICIENT_MS: f64 = 86_400_000.0;

/// A step's shape, as the cost model reads it: per item, the tokens computed, the position of the first
/// of them, and how many of its context positions lie in blocks an earlier item of the step also reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepItem {
    pub start: usize,
    pub tokens: usize,
    pub shared: usize,
}

impl StepItem {
    /// A decode step of `batch` sequences at `context`: the first reads its context alone, the others
    /// read again `shared` of those positions (a common prefix).
    pub fn decode_sharing(context: usize, shared: usize, batch: usize) -> Vec<StepItem> {
        let first = StepItem {
            start: context,
            tokens: 1,
            shared: 0,
        };
        let again = StepItem { shared, ..first };
        std::iter::once(first)
            .chain(std::iter::repeat_n(again, batch.saturating_sub(1)))
            .collect()
    }
}

/// The fitted coefficients, and where they were measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostModel {
    pub base_ms: f64,
    pub per_token_ms: f64,
    pub per_seq_ms: f64,
    /// Per million (token, context position) pairs of items of more than one token.
    pub per_prefill_attention_ms: f64,
    /// Per million context positions read by items of one token (decode steps), in blocks no earlier
    /// item of the step reads.
    pub per_decode_context_ms: f64,
    /// Per million context positions of decode steps in blocks an earlier item of the step read; absent:
    /// as `per_decode_context_ms` (a model calibrated without shared blocks).
    #[serde(default)]
    pub per_shared_context_ms: Option<f64>,
    /// The front end's time per prompt token (chat template and tokenizer), before a request reaches the
    /// scheduler; requests pass the front end one at a time.
    #[serde(default)]
    pub frontend_ms_per_token: f64,
    /// What was measured: model, threads, KV type, machine.
    #[serde(default)]
    pub measured_on: String,
    /// The threads the steps were timed on; absent (a model written before this field): 1, which
    /// leaves the attention terms unscaled.
    #[serde(default = "one")]
    pub threads: usize,
    /// The model's KV heads (attention units per context segment); absent: 1.
    #[serde(default = "one")]
    pub kv_heads: usize,
}

fn one() -> usize {
    1
}

/// Threads × the busiest thread's share ÷ all units of the step's attention (see the module text); 1
/// on one thread or for a step without attention.
pub fn attention_imbalance(items: &[StepItem], threads: usize, kv_heads: usize) -> f64 {
    if threads <= 1 {
        return 1.0;
    }
    let positions = items.iter().flat_map(|i| i.start..i.start + i.tokens);
    let shares = kura_shape::attn_split::thread_shares(positions, None, kv_heads.max(1), threads);
    let total: usize = shares.iter().sum();
    let busiest = shares.iter().copied().max().unwrap_or(0);
    if total == 0 {
        1.0
    } else {
        threads as f64 * busiest as f64 / total as f64
    }
}

/// Number of coefficients.
const N: usize = 6;

/// The features of a step timed on `threads` threads of a model with `kv_heads` KV heads, in the order of
/// the coefficients.
pub fn features(items: &[StepItem], threads: usize, kv_heads: usize) -> [f64; N] {
    let tokens: usize = items.iter().map(|i| i.tokens).sum();
    let prefill: f64 = items
        .iter()
        .filter(|i| i.tokens > 1)
        .map(|i| i.tokens as f64 * (i.start as f64 + i.tokens as f64 / 2.0))
        .sum();
    let decode = items.iter().filter(|i| i.tokens == 1);
    let shared: f64 = decode.clone().map(|i| i.shared.min(i.start) as f64).sum();
    let distinct: f64 = decode
        .map(|i| (i.start - i.shared.min(i.start)) as f64 + 1.0)
        .sum();
    let scale = attention_imbalance(items, threads, kv_heads);
    [
        1.0,
        tokens as f64,
        items.len() as f64,
        scale * prefill / 1e6,
        scale * distinct / 1e6,
        scale * shared / 1e6,
    ]
}

impl CostModel {
    /// Milliseconds a prompt of `tokens` spends in the front end.
    pub fn frontend_ms(&self, tokens: usize) -> f64 {
        self.frontend_ms_per_token * tokens as f64
    }

    /// Milliseconds of one step.
    pub fn step_ms(&self, items: &[StepItem]) -> f64 {
        let f = features(items, self.threads, self.kv_heads);
        let c = self.coefficients();
        (0..N).map(|k| f[k] * c[k]).sum::<f64>().max(0.0)
    }

    fn coefficients(&self) -> [f64; N] {
        [
            self.base_ms,
            self.per_token_ms,
            self.per_seq_ms,
            self.per_prefill_attention_ms,
            self.per_decode_context_ms,
            self.per_shared_context_ms
                .unwrap_or(self.per_decode_context_ms),
        ]
    }

    /// Least-squares fit of steps timed on `threads` threads of a model with `kv_heads` KV heads.
    /// Coefficients come out non-negative: a term that the fit drives below zero is dropped and the rest
    /// refitted.
    pub fn fit(
        samples: &[(Vec<StepItem>, f64)],
        threads: usize,
        kv_heads: usize,
        measured_on: String,
    ) -> Result<Self, SimError> {
        let rows: Vec<([f64; N], f64)> = samples
            .iter()
            .map(|(items, ms)| (features(items, threads, kv_heads), *ms))
            .collect();
        // A feature no sample exercises is left out (its coefficient 0), not a singular system.
        let mut active = [true; N];
        for (k, a) in active.iter_mut().enumerate().skip(1) {
            *a = rows.iter().any(|(f, _)| f[k] != 0.0);
        }
        loop {
            let c = least_squares(&rows, &active).ok_or_else(|| {
                SimError::Config(
                    "the timed steps do not determine the cost model (too few distinct shapes)"
                        .into(),
                )
            })?;
            // The base stays even if negative fits better: a step always costs something.
            match (1..N).find(|&k| active[k] && c[k] < 0.0) {
                Some(k) => active[k] = false,
                None => {
                    return Ok(Self {
                        base_ms: c[0].max(0.0),
                        per_token_ms: c[1],
                        per_seq_ms: c[2],
                        per_prefill_attention_ms: c[3],
                        per_decode_context_ms: c[4],
                        per_shared_context_ms: active[5].then_some(c[5]),
                        frontend_ms_per_token: 0.0,
                        measured_on,
                        threads,
                        kv_heads,
                    })
                }
            }
        }
    }

    /// Reads a cost model written by `kura sim --calibrate`: a regular file (a FIFO would block,
    /// `/dev/zero` never ends) of at most 1 MiB.
    pub fn load(path: &Path) -> Result<Self, SimError> {
        const MAX_BYTES: u64 = 1 << 20;
        let fail = |what: String| SimError::Config(format!("reading {}: {what}", path.display()));
        let text = kura_files::read_text(path, MAX_BYTES).map_err(|e| fail(e.to_string()))?;
        let model: CostModel = serde_json::from_str(&text).map_err(|e| {
            SimError::Config(format!("{} is not a cost model: {e}", path.display()))
        })?;
        model.validate().map_err(|e| match e {
            SimError::Config(m) => SimError::Config(format!("{}: {m}", path.display())),
            other => other,
        })?;
        Ok(model)
    }

    /// Checks every field: counts of at least 1, coefficients from 0 to [`MAX_COEFFICIENT_MS`].
    pub fn validate(&self) -> Result<(), SimError> {
        for (name, v) in [("threads", self.threads), ("kv_heads", self.kv_heads)] {
            if v == 0 {
                return Err(SimError::Config(format!(
                    "cost model {name} is 0: it counts at least 1"
                )));
            }
        }
        for (name, v) in [
            ("base_ms", self.base_ms),
            ("per_token_ms", self.per_token_ms),
            ("per_seq_ms", self.per_seq_ms),
            ("per_prefill_attention_ms", self.per_prefill_attention_ms),
            ("per_decode_context_ms", self.per_decode_context_ms),
            (
                "per_shared_context_ms",
                self.per_shared_context_ms.unwrap_or(0.0),
            ),
            ("frontend_ms_per_token", self.frontend_ms_per_token),
        ] {
            if !(v.is_finite() && (0.0..=MAX_COEFFICIENT_MS).contains(&v)) {
                return Err(SimError::Config(format!(
                    "cost model {name} is {v:?}: every coefficient is a number of milliseconds from 0 to \
                     {MAX_COEFFICIENT_MS:e} (a step of more than a day is no server's)"
                )));
            }
        }
        Ok(())
    }
}

/// Least squares of the relative error (each timed step weighs by its own time, so that a 10 ms decode
/// step is fitted as closely as a 1 s prefill): the normal equations over the active features, solved by
/// Gaussian elimination with partial pivoting; inactive coefficients are 0. `None` when singular.
fn least_squares(rows: &[([f64; N], f64)], active: &[bool; N]) -> Option<[f64; N]> {
    let idx: Vec<usize> = (0..N).filter(|&k| active[k]).collect();
    let n = idx.len();
    // Rows divided by their time: residuals become relative. Features scaled to unit size, so that
    // milliseconds per token and per million pairs condition the system alike.
    let weighted: Vec<(Vec<f64>, f64)> = rows
        .iter()
        .filter(|(_, y)| *y > 0.0)
        .map(|(f, y)| (idx.iter().map(|&k| f[k] / y).collect(), 1.0))
        .collect();
    let scale: Vec<f64> = (0..n)
        .map(|i| {
            weighted
                .iter()
                .map(|(f, _)| f[i].abs())
                .fold(0.0, f64::max)
                .max(1e-12)
        })
        .collect();
    let mut a = vec![vec![0.0; n + 1]; n];
    for (f, y) in &weighted {
        for (i, row) in a.iter_mut().enumerate() {
            let fi = f[i] / scale[i];
            for (j, cell) in row.iter_mut().take(n).enumerate() {
                *cell += fi * f[j] / scale[j];
            }
            row[n] += fi * y;
        }
    }
    for col in 0..n {
        let pivot = (col..n).max_by(|&x, &y| a[x][col].abs().total_cmp(&a[y][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        let pivot_row = a[col].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != col {
                let factor = row[col] / pivot_row[col];
                for (cell, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                    *cell -= factor * p;
                }
            }
        }
    }
    let mut c = [0.0; N];
    for (i, &k) in idx.iter().enumerate() {
        c[k] = a[i][n] / a[i][i] / scale[i];
    }
    Some(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(start: usize, tokens: usize) -> StepItem {
        StepItem {
            start,
            tokens,
            shared: 0,
        }
    }

    #[test]
    fn a_fit_recovers_the_coefficients_of_exact_samples() {
        let truth = CostModel {
            base_ms: 3.0,
            per_token_ms: 0.5,
            per_seq_ms: 0.25,
            per_prefill_attention_ms: 2.0,
            per_decode_context_ms: 7.0,
            per_shared_context_ms: Some(1.5),
            frontend_ms_per_token: 0.0,
            measured_on: String::new(),
            threads: 2,
            kv_heads: 3,
        };
        let shapes = vec![
            vec![item(0, 128)],
            vec![item(0, 512)],
            vec![item(1024, 256)],
            vec![item(100, 1); 8],
            vec![item(900, 1); 16],
            vec![item(0, 64), item(300, 1), item(400, 1)],
            vec![item(2000, 1); 4],
            // One item reads a 1,000-token prefix, three more read it again.
            StepItem::decode_sharing(1000, 992, 4),
            StepItem::decode_sharing(300, 288, 8),
        ];
        let samples: Vec<_> = shapes
            .into_iter()
            .map(|s| {
                let ms = truth.step_ms(&s);
                (s, ms)
            })
            .collect();
        let fitted = CostModel::fit(&samples, 2, 3, "test".into()).unwrap();
        for (a, b) in [
            (fitted.base_ms, truth.base_ms),
            (fitted.per_token_ms, truth.per_token_ms),
            (fitted.per_seq_ms, truth.per_seq_ms),
            (
                fitted.per_prefill_attention_ms,
                truth.per_prefill_attention_ms,
            ),
            (fitted.per_decode_context_ms, truth.per_decode_context_ms),
            (
                fitted.per_shared_context_ms.unwrap(),
                truth.per_shared_context_ms.unwrap(),
            ),
        ] {
            assert!((a - b).abs() < 1e-6, "{fitted:?}");
        }
    }

    #[test]
    fn a_term_that_would_be_negative_is_dropped() {
        // Times that fall with more sequences: the per-sequence term is dropped, not made negative.
        let samples = vec![
            (vec![item(0, 100)], 60.0),
            (vec![item(0, 50), item(0, 50)], 50.0),
            (vec![item(0, 200)], 110.0),
            (vec![item(0, 10)], 15.0),
        ];
        let fitted = CostModel::fit(&samples, 1, 1, String::new()).unwrap();
        assert_eq!(fitted.per_seq_ms, 0.0);
        assert!(fitted.validate().is_ok());
    }

    #[test]
    fn attention_on_two_threads_costs_what_its_busiest_thread_reads() {
        let model = |threads| CostModel {
            base_ms: 0.0,
            per_token_ms: 0.0,
            per_seq_ms: 0.0,
            per_prefill_attention_ms: 1000.0,
            per_decode_context_ms: 1000.0,
            per_shared_context_ms: None,
            frontend_ms_per_token: 0.0,
            measured_on: String::new(),
            threads,
            kv_heads: 3,
        };
        let (one, two) = (model(1), model(2));
        // A lone token at 1,100: per KV head a full segment and a short one; one thread takes two full
        // segments of the three.
        let lone = [item(1100, 1)];
        let ratio = two.step_ms(&lone) / one.step_ms(&lone);
        assert!(ratio > 1.2 && ratio < 1.35, "{ratio}");
        // Below one segment, three units on two threads: 2 : 1.
        let short = [item(500, 1)];
        let ratio = two.step_ms(&short) / one.step_ms(&short);
        assert!((ratio - 4.0 / 3.0).abs() < 1e-9, "{ratio}");
        // Eight tokens, and a long prompt, split evenly.
        for step in [vec![item(1100, 1); 8], vec![item(0, 1024)]] {
            let ratio = two.step_ms(&step) / one.step_ms(&step);
            assert!((1.0..1.05).contains(&ratio), "{ratio}");
        }
    }

    #[test]
    fn a_bad_cost_model_file_is_named() {
        let dir = std::env::temp_dir().join(format!("kura-cost-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cost.json");
        std::fs::write(&path, r#"{"base_ms": -1, "per_token_ms": 0, "per_seq_ms": 0, "per_prefill_attention_ms": 0, "per_decode_context_ms": 0}"#).unwrap();
        let err = CostModel::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("cost.json") && err.contains("base_ms"),
            "{err}"
        );
        std::fs::write(&path, r#"{"base_ms": 1, "per_token_ms": 0, "per_seq_ms": 0, "per_prefill_attention_ms": 0, "per_decode_context_ms": 0, "threads": 0}"#).unwrap();
        let err = CostModel::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("cost.json") && err.contains("threads"),
            "{err}"
        );
        std::fs::write(&path, "not json").unwrap();
        let err = CostModel::load(&path).unwrap_err().to_string();
        assert!(err.contains("is not a cost model"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
