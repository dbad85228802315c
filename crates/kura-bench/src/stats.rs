//! Percentiles and per-point summaries.
//!
//! Percentiles interpolate linearly between the two nearest ranks (NumPy's default, the convention vLLM's
//! and SGLang's benchmark scripts report), so figures are comparable with theirs. O(n log n) per
//! distribution (one sort).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::report::RequestRecord;

/// The `q`-th percentile (`0 <= q <= 100`) of `sorted` (ascending, no NaN), or `None` when empty.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q.clamp(0.0, 100.0) / 100.0) * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let frac = rank - lo as f64;
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * frac)
}

/// Mean and percentiles of one distribution, in the unit of its field name.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Dist {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Dist {
    pub fn of(values: &[f64]) -> Option<Dist> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(Dist {
            count: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: percentile(&v, 50.0)?,
            p90: percentile(&v, 90.0)?,
            p99: percentile(&v, 99.0)?,
            max: *v.last()?,
        })
    }
}

/// The figures of one load point (one concurrency, one rate, one burst series, or one trace replay).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests sent.
    pub requests: usize,
    pub ok: usize,
    pub failed: usize,
    /// Failures by kind (`connect`, `timeout`, `http_500`, `malformed_stream`, `disconnected`, `server_error`).
    pub errors_by_kind: BTreeMap<String, usize>,
    /// Wall time from the first request sent to the last one finished.
    pub duration_s: f64,
    pub ttft_ms: Option<Dist>,
    /// Every gap between two consecutive streamed chunks, over all successful requests.
    pub itl_ms: Option<Dist>,
    /// Time per output token after the first: `(e2e - ttft) / (output_tokens - 1)`, one value per request.
    pub tpot_ms: Option<Dist>,
    pub e2e_ms: Option<Dist>,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// Output tokens of successful requests per second of `duration_s`.
    pub output_tok_per_s: f64,
    pub requests_per_s: f64,
    /// Summed `cached_tokens` over the requests whose server reported it.
    pub cached_tokens: Option<u64>,
    /// `cached_tokens / prompt_tokens` over the requests that reported both; `None` when none did.
    pub cached_token_ratio: Option<f64>,
}

impl Summary {
    pub fn of(records: &[RequestRecord]) -> Summary {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.error.is_none()).collect();
        let mut errors_by_kind = BTreeMap::new();
        for r in records {
            if let Some(e) = &r.error {
                *errors_by_kind.entry(e.kind.label()).or_insert(0) += 1;
            }
        }
        let start = records
            .iter()
            .map(|r| r.start_ms)
            .fold(f64::INFINITY, f64::min);
        let end = records
            .iter()
            .map(|r| r.start_ms + r.e2e_ms)
            .fold(f64::NEG_INFINITY, f64::max);
        let duration_s = if records.is_empty() {
            0.0
        } else {
            ((end - start) / 1000.0).max(0.0)
        };
        let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
        let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl_ms.iter().copied()).collect();
        let tpot: Vec<f64> = ok
            .iter()
            .filter(|r| r.output_tokens > 1)
            .filter_map(|r| Some((r.e2e_ms - r.ttft_ms?) / (r.output_tokens - 1) as f64))
            .collect();
        let e2e: Vec<f64> = ok.iter().map(|r| r.e2e_ms).collect();
        let output_tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
        let prompt_tokens: u64 = ok
            .iter()
            .map(|r| r.prompt_tokens.unwrap_or(r.prompt_tokens_sent))
            .sum();
        let reporting: Vec<(u64, u64)> = ok
            .iter()
            .filter_map(|r| Some((r.cached_tokens?, r.prompt_tokens?)))
            .collect();
        let (cached_tokens, cached_token_ratio) = if reporting.is_empty() {
            (None, None)
        } else {
            let cached: u64 = reporting.iter().map(|c| c.0).sum();
            let prompt: u64 = reporting.iter().map(|c| c.1).sum();
            let ratio = if prompt == 0 {
                0.0
            } else {
                cached as f64 / prompt as f64
            };
            (Some(cached), Some(ratio))
        };
        let per_s = |x: f64| {
            if duration_s > 0.0 {
                x / duration_s
            } else {
                0.0
            }
        };
        Summary {
            requests: records.len(),
            ok: ok.len(),
            failed: records.len() - ok.len(),
            errors_by_kind,
            duration_s,
            ttft_ms: Dist::of(&ttft),
            itl_ms: Dist::of(&itl),
            tpot_ms: Dist::of(&tpot),
            e2e_ms: Dist::of(&e2e),
            prompt_tokens,
            output_tokens,
            output_tok_per_s: per_s(output_tokens as f64),
            requests_per_s: per_s(ok.len() as f64),
            cached_tokens,
            cached_token_ratio,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{ErrorKind, RequestError};

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 50.0), Some(2.5));
        assert_eq!(percentile(&v, 100.0), Some(4.0));
        // numpy.percentile([1,2,3,4], 99) == 3.97
        assert!((percentile(&v, 99.0).unwrap() - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&[5.0], 99.0), Some(5.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn dist_ignores_non_finite_and_sorts() {
        let d = Dist::of(&[3.0, f64::NAN, 1.0, 2.0]).unwrap();
        assert_eq!((d.count, d.p50, d.max, d.mean), (3, 2.0, 3.0, 2.0));
        assert!(Dist::of(&[]).is_none());
    }

    fn rec(
        start_ms: f64,
        e2e_ms: f64,
        out: u64,
        cached: Option<u64>,
        error: Option<ErrorKind>,
    ) -> RequestRecord {
        RequestRecord {
            id: 0,
            session: 0,
            turn: 0,
            group: None,
            start_ms,
            prompt_tokens_sent: 100,
            prompt_tokens: Some(100),
            cached_tokens: cached,
            output_tokens: out,
            ttft_ms: Some(10.0),
            e2e_ms,
            itl_ms: vec![5.0; out.saturating_sub(1) as usize],
            error: error.map(|kind| RequestError {
                kind,
                message: "x".into(),
            }),
        }
    }

    #[test]
    fn summary_counts_failures_by_kind_and_cached_ratio() {
        let records = vec![
            rec(0.0, 1000.0, 11, Some(80), None),
            rec(500.0, 1500.0, 11, Some(0), None),
            rec(100.0, 50.0, 0, None, Some(ErrorKind::Http { status: 500 })),
            rec(100.0, 50.0, 0, None, Some(ErrorKind::Connect)),
        ];
        let s = Summary::of(&records);
        assert_eq!((s.requests, s.ok, s.failed), (4, 2, 2));
        assert_eq!(s.errors_by_kind.get("http_500"), Some(&1));
        assert_eq!(s.errors_by_kind.get("connect"), Some(&1));
        assert_eq!(s.duration_s, 2.0);
        assert_eq!(s.output_tokens, 22);
        assert_eq!(s.output_tok_per_s, 11.0);
        assert_eq!(s.cached_tokens, Some(80));
        assert_eq!(s.cached_token_ratio, Some(0.4));
        // (1000 - 10) / 10 and (1500 - 10) / 10.
        assert_eq!(s.tpot_ms.unwrap().p50, 124.0);
    }
}
