//! Reading request traces: Mooncake (JSON lines with prefix-block hash ids) and Azure LLM inference
//! (CSV of timestamp, context tokens, generated tokens).
//!
//! A bad line is an error naming `file:line` and what was wrong with it; nothing is skipped silently.
//! Cost: O(file size), one pass.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::BenchError;

/// Tokens per Mooncake hash id (the trace's block size).
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    Mooncake,
    Azure,
}

impl TraceFormat {
    /// From the file name: `.jsonl` is Mooncake, `.csv` Azure.
    pub fn infer(path: &Path) -> Option<TraceFormat> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("jsonl") | Some("json") => Some(TraceFormat::Mooncake),
            Some("csv") => Some(TraceFormat::Azure),
            _ => None,
        }
    }
}

/// One request of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    /// Arrival time after the trace's first request, in milliseconds.
    pub arrival_ms: f64,
    pub input_tokens: usize,
    pub output_tokens: usize,
    /// Mooncake only: one id per block of [`MOONCAKE_BLOCK_TOKENS`] prompt tokens; equal ids mean equal
    /// text up to and including that block. Empty for Azure (no prefix information).
    pub hash_ids: Vec<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MooncakeLine {
    timestamp: f64,
    input_length: usize,
    output_length: usize,
    hash_ids: Vec<u64>,
}

fn bad(path: &Path, line: usize, reason: impl Into<String>) -> BenchError {
    BenchError::TraceLine {
        path: PathBuf::from(path),
        line,
        reason: reason.into(),
    }
}

/// Reads the first `max_requests` requests (all when `None`) of a trace file.
pub fn read_trace(
    path: &Path,
    format: TraceFormat,
    max_requests: Option<usize>,
) -> Result<Vec<TraceRequest>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::Io {
        what: format!("reading trace {}", path.display()),
        source: e,
    })?;
    parse_trace(path, &text, format, max_requests)
}

/// Parses trace text; `path` only names the source in errors.
pub fn parse_trace(
    path: &Path,
    text: &str,
    format: TraceFormat,
    max_requests: Option<usize>,
) -> Result<Vec<TraceRequest>, BenchError> {
    let limit = max_requests.unwrap_or(usize::MAX);
    let mut out = Vec::new();
    let mut first_s: Option<f64> = None;
    for (idx, line) in text.lines().enumerate() {
        let line_no = idx + 1;
        if out.len() >= limit {
            break;
        }
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        match format {
            TraceFormat::Mooncake => {
                let m: MooncakeLine = serde_json::from_str(line)
                    .map_err(|e| bad(path, line_no, format!("not a Mooncake record ({e})")))?;
                if m.input_length == 0 {
                    return Err(bad(path, line_no, "input_length is 0"));
                }
                let needed = m.input_length.div_ceil(MOONCAKE_BLOCK_TOKENS);
                if m.hash_ids.len() != needed {
                    return Err(bad(
                        path,
                        line_no,
                        format!(
                            "{} hash_ids for input_length {} (expected {needed}, one per {MOONCAKE_BLOCK_TOKENS} tokens)",
                            m.hash_ids.len(),
                            m.input_length
                        ),
                    ));
                }
                if !m.timestamp.is_finite() || m.timestamp < 0.0 {
                    return Err(bad(
                        path,
                        line_no,
                        format!("timestamp {} is not a time", m.timestamp),
                    ));
                }
                let t0 = *first_s.get_or_insert(m.timestamp);
                out.push(TraceRequest {
                    arrival_ms: (m.timestamp - t0).max(0.0),
                    input_tokens: m.input_length,
                    output_tokens: m.output_length,
                    hash_ids: m.hash_ids,
                });
            }
            TraceFormat::Azure => {
                if idx == 0 && line.to_ascii_uppercase().starts_with("TIMESTAMP") {
                    continue;
                }
                let fields: Vec<&str> = line.split(',').map(str::trim).collect();
                let [ts, ctx, gen] = fields[..] else {
                    return Err(bad(
                        path,
                        line_no,
                        format!(
                            "expected 3 fields TIMESTAMP,ContextTokens,GeneratedTokens, found {}",
                            fields.len()
                        ),
                    ));
                };
                let secs = parse_azure_timestamp(ts).ok_or_else(|| {
                    bad(
                        path,
                        line_no,
                        format!("timestamp `{ts}` is not YYYY-MM-DD HH:MM:SS[.frac]"),
                    )
                })?;
                let input_tokens: usize = ctx.parse().map_err(|_| {
                    bad(
                        path,
                        line_no,
                        format!("ContextTokens `{ctx}` is not a count"),
                    )
                })?;
                let output_tokens: usize = gen.parse().map_err(|_| {
                    bad(
                        path,
                        line_no,
                        format!("GeneratedTokens `{gen}` is not a count"),
                    )
                })?;
                if input_tokens == 0 {
                    return Err(bad(path, line_no, "ContextTokens is 0"));
                }
                let t0 = *first_s.get_or_insert(secs);
                out.push(TraceRequest {
                    arrival_ms: ((secs - t0) * 1e3).max(0.0),
                    input_tokens,
                    output_tokens,
                    hash_ids: Vec::new(),
                });
            }
        }
    }
    if out.is_empty() {
        return Err(BenchError::EmptyTrace(PathBuf::from(path)));
    }
    Ok(out)
}

/// Seconds since 1970-01-01 of `YYYY-MM-DD HH:MM:SS[.fraction]` (UTC assumed; only differences matter).
fn parse_azure_timestamp(ts: &str) -> Option<f64> {
    let (date, time) = ts.split_once([' ', 'T'])?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    if d.next().is_some() || !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    let mut t = time.split(':');
    let (h, min, s) = (
        t.next()?.parse::<i64>().ok()?,
        t.next()?.parse::<i64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
    );
    if t.next().is_some()
        || !(0..24).contains(&h)
        || !(0..60).contains(&min)
        || !(0.0..61.0).contains(&s)
    {
        return None;
    }
    Some((days_from_civil(y, m, day) * 86_400 + h * 3_600 + min * 60) as f64 + s)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> &'static Path {
        Path::new("t.jsonl")
    }

    #[test]
    fn mooncake_lines_parse_with_relative_arrivals() {
        let text = "{\"timestamp\": 100, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n\n\
                    {\"timestamp\": 350, \"input_length\": 512, \"output_length\": 7, \"hash_ids\": [0]}\n";
        let reqs = parse_trace(p(), text, TraceFormat::Mooncake, None).unwrap();
        assert_eq!(reqs.len(), 2);
        assert_eq!(reqs[1].arrival_ms, 250.0);
        assert_eq!(reqs[0].hash_ids, [0, 1]);
        assert_eq!(
            parse_trace(p(), text, TraceFormat::Mooncake, Some(1))
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn mooncake_bad_lines_name_file_and_line() {
        let good =
            "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [3]}\n";
        let cases = [
            ("{\"timestamp\": 0, \"input_length\": 10", "not a Mooncake record"),
            ("{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 5, \"hash_ids\": [1]}", "expected 3"),
            ("{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 5, \"hash_ids\": []}", "input_length is 0"),
            ("{\"timestamp\": 0, \"input_length\": 10, \"output_length\": -1, \"hash_ids\": [1]}", "not a Mooncake record"),
        ];
        for (line, why) in cases {
            let err = parse_trace(p(), &format!("{good}{line}\n"), TraceFormat::Mooncake, None)
                .unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains("t.jsonl:2"), "{msg}");
            assert!(msg.contains(why), "{msg}");
        }
    }

    #[test]
    fn azure_csv_parses_and_reports_bad_lines() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16 18:15:46.6805900,374,44\n\
                    2023-11-16 18:15:50.9951690,396,109\n";
        let reqs = parse_trace(Path::new("a.csv"), text, TraceFormat::Azure, None).unwrap();
        assert_eq!(reqs.len(), 2);
        assert!(
            (reqs[1].arrival_ms - 4314.579).abs() < 1e-3,
            "{}",
            reqs[1].arrival_ms
        );
        assert_eq!((reqs[1].input_tokens, reqs[1].output_tokens), (396, 109));
        for (line, why) in [
            ("2023-11-16 18:15:46,374", "expected 3 fields"),
            ("2023-13-16 18:15:46,374,4", "timestamp"),
            ("2023-11-16 18:15:46,many,4", "ContextTokens `many`"),
        ] {
            let err = parse_trace(
                Path::new("a.csv"),
                &format!("{text}{line}\n"),
                TraceFormat::Azure,
                None,
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains("a.csv:4") && err.contains(why), "{err}");
        }
    }

    #[test]
    fn empty_trace_is_an_error_and_civil_days_match_known_dates() {
        assert!(matches!(
            parse_trace(p(), "\n", TraceFormat::Mooncake, None),
            Err(BenchError::EmptyTrace(_))
        ));
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(
            TraceFormat::infer(Path::new("x.csv")),
            Some(TraceFormat::Azure)
        );
    }
}
