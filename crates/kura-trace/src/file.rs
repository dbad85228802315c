//! Reading request traces: Mooncake (JSON lines with prefix-block hash ids) and Azure LLM inference
//! (CSV of timestamp, context tokens, generated tokens).
//!
//! Mooncake lines are read by [`crate::mooncake::parse_line`] (one reading of the format and its bounds
//! for the simulator and the benchmark), every line by its bounded line reader.
//! A bad line is an error naming `file:line` and what was wrong with it; nothing is skipped silently.
//! Everything read is bounded: lines ([`MAX_LINE_BYTES`], no NUL bytes, UTF-8), token counts
//! ([`MAX_REQUEST_TOKENS`]), timestamps (2^53 ms; Azure years 1..=9999).
//! Cost: O(bytes read), one pass; reading stops after the requests asked for.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::mooncake::{self, LineError, ReadError};

/// Why a trace file could not be read: each names the file, and a bad line its number.
#[derive(Debug, Error)]
pub enum TraceFileError {
    #[error("{path}:{line}: {reason}", path = .path.display())]
    Line {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("trace {} holds no requests", .0.display())]
    Empty(PathBuf),
    #[error("reading trace {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Tokens per Mooncake hash id (the trace's block size).
pub const MOONCAKE_BLOCK_TOKENS: usize = mooncake::TRACE_BLOCK_TOKENS as usize;

/// A trace file's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
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

fn bad(path: &Path, line: usize, reason: impl Into<String>) -> TraceFileError {
    TraceFileError::Line {
        path: PathBuf::from(path),
        line,
        reason: reason.into(),
    }
}

/// Reads the first `max_requests` requests (all when `None`) of a trace file, a line at a time: the rest
/// of the file is not read, and no line may exceed [`MAX_LINE_BYTES`] or hold a NUL byte, so that a
/// wrong file (`/dev/zero`, a binary) fails at once instead of being read into memory whole.
pub fn read_trace(
    path: &Path,
    format: TraceFormat,
    max_requests: Option<usize>,
) -> Result<Vec<TraceRequest>, TraceFileError> {
    let io = |e| TraceFileError::Io {
        path: path.to_path_buf(),
        source: e,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut reader = std::io::BufReader::new(file);
    let mut parser = Parser::new(path, format, max_requests);
    let mut buf = Vec::new();
    let mut line_no = 0usize;
    while !parser.full() {
        line_no += 1;
        let more = mooncake::read_line_bounded(&mut reader, &mut buf).map_err(|e| match e {
            ReadError::Io(e) => io(e),
            ReadError::Line(problem) => bad(path, line_no, problem.to_string()),
        })?;
        if !more {
            break;
        }
        let line = std::str::from_utf8(&buf).map_err(|e| {
            bad(
                path,
                line_no,
                format!("not UTF-8 text (bad byte at offset {})", e.valid_up_to()),
            )
        })?;
        parser.line(line_no, line)?;
    }
    parser.finish()
}

/// Parses trace text; `path` only names the source in errors.
pub fn parse_trace(
    path: &Path,
    text: &str,
    format: TraceFormat,
    max_requests: Option<usize>,
) -> Result<Vec<TraceRequest>, TraceFileError> {
    let mut parser = Parser::new(path, format, max_requests);
    for (idx, line) in text.lines().enumerate() {
        if parser.full() {
            break;
        }
        if line.len() > MAX_LINE_BYTES {
            return Err(bad(path, idx + 1, LineError::TooLong.to_string()));
        }
        if line.contains('\0') {
            return Err(bad(path, idx + 1, LineError::Binary.to_string()));
        }
        parser.line(idx + 1, line)?;
    }
    parser.finish()
}

/// The longest line read (the Mooncake reader's limit: every trace reader shares it).
pub const MAX_LINE_BYTES: usize = mooncake::MAX_LINE_BYTES;
/// The most prompt or output tokens of one request (16 Mi; real traces stay below 200 K): the prompt
/// text of a request is built at its length.
pub const MAX_REQUEST_TOKENS: usize = mooncake::MAX_REQUEST_TOKENS as usize;

/// A token count from a trace, within [`MAX_REQUEST_TOKENS`].
fn tokens(path: &Path, line_no: usize, what: &str, n: usize) -> Result<usize, TraceFileError> {
    if n > MAX_REQUEST_TOKENS {
        return Err(bad(
            path,
            line_no,
            format!("{what} {n} exceeds the limit of {MAX_REQUEST_TOKENS} tokens"),
        ));
    }
    Ok(n)
}

/// Line-by-line parsing state: the format, the first arrival, the requests so far.
struct Parser<'a> {
    path: &'a Path,
    format: TraceFormat,
    limit: usize,
    first_s: Option<f64>,
    /// The latest line's time.
    last_s: Option<f64>,
    out: Vec<TraceRequest>,
}

impl<'a> Parser<'a> {
    fn new(path: &'a Path, format: TraceFormat, max_requests: Option<usize>) -> Self {
        Self {
            path,
            format,
            limit: max_requests.unwrap_or(usize::MAX),
            first_s: None,
            last_s: None,
            out: Vec::new(),
        }
    }

    fn full(&self) -> bool {
        self.out.len() >= self.limit
    }

    fn finish(self) -> Result<Vec<TraceRequest>, TraceFileError> {
        if self.out.is_empty() {
            return Err(TraceFileError::Empty(PathBuf::from(self.path)));
        }
        Ok(self.out)
    }

    /// The first request's time, after checking that `t` (this line's, in the file's unit) is not
    /// earlier than the line before's: a trace is replayed in its order, as the Mooncake reader
    /// refuses one that goes back.
    fn arrival(&mut self, line_no: usize, t: f64, field: &str) -> Result<f64, TraceFileError> {
        if let Some(prev) = self.last_s.filter(|prev| t < *prev) {
            return Err(bad(
                self.path,
                line_no,
                format!("{field} goes back in time ({t} after {prev} on an earlier line)"),
            ));
        }
        self.last_s = Some(t);
        Ok(*self.first_s.get_or_insert(t))
    }

    fn line(&mut self, line_no: usize, line: &str) -> Result<(), TraceFileError> {
        let path = self.path;
        let line = line.trim();
        if line.is_empty() {
            return Ok(());
        }
        match self.format {
            TraceFormat::Mooncake => {
                // The Mooncake parser: one reading of the format, its bounds and its messages.
                let m = mooncake::parse_line(line)
                    .map_err(|e| bad(path, line_no, format!("not a Mooncake record: {e}")))?;
                let ts = m.timestamp_ms() as f64;
                let t0 = self.arrival(line_no, ts, "timestamp")?;
                self.out.push(TraceRequest {
                    arrival_ms: ts - t0,
                    input_tokens: m.input_length() as usize,
                    output_tokens: m.output_length() as usize,
                    hash_ids: m.hash_ids().iter().map(|&h| u64::from(h)).collect(),
                });
            }
            TraceFormat::Azure => {
                if line_no == 1 && line.to_ascii_uppercase().starts_with("TIMESTAMP") {
                    return Ok(());
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
                        format!(
                            "timestamp `{ts}` is not YYYY-MM-DD HH:MM:SS[.frac] (years 1..=9999)"
                        ),
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
                let input_tokens = tokens(path, line_no, "ContextTokens", input_tokens)?;
                let output_tokens = tokens(path, line_no, "GeneratedTokens", output_tokens)?;
                let t0 = self.arrival(line_no, secs, "TIMESTAMP")?;
                self.out.push(TraceRequest {
                    arrival_ms: (secs - t0) * 1e3,
                    input_tokens,
                    output_tokens,
                    hash_ids: Vec::new(),
                });
            }
        }
        Ok(())
    }
}

/// Seconds since 1970-01-01 of `YYYY-MM-DD HH:MM:SS[.fraction]` (UTC assumed; only differences matter).
fn parse_azure_timestamp(ts: &str) -> Option<f64> {
    let (date, time) = ts.split_once([' ', 'T'])?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    // Years bounded so that the day arithmetic cannot overflow (and no trace predates the calendar).
    if d.next().is_some()
        || !(1..=9999).contains(&y)
        || !(1..=12).contains(&m)
        || !(1..=days_in_month(y, m)).contains(&day)
    {
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

/// Days in month `m` (1..=12) of year `y`, Gregorian.
fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if y % 4 == 0 && (y % 100 != 0 || y % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
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
        // A line earlier than the one before is refused, as the streaming reader refuses it.
        let back = format!(
            "{text}{{\"timestamp\": 300, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [0]}}\n"
        );
        let err = parse_trace(p(), &back, TraceFormat::Mooncake, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("t.jsonl:4") && err.contains("timestamp goes back in time"),
            "{err}"
        );
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
        assert!(parse_azure_timestamp("2024-02-29 00:00:00").is_some());
        for (line, why) in [
            ("2023-11-16 18:15:46,374", "expected 3 fields"),
            ("2023-13-16 18:15:46,374,4", "timestamp"),
            ("2023-11-16 18:15:46,many,4", "ContextTokens `many`"),
            ("2023-02-29 18:15:51,10,4", "timestamp `2023-02-29"),
            ("2023-11-31 18:15:51,10,4", "timestamp `2023-11-31"),
            ("2023-11-16 18:15:49.5,10,4", "TIMESTAMP goes back in time"),
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

    /// A file in a fresh temporary directory.
    fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kura-bench-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    #[test]
    fn binary_and_endless_lines_are_refused_while_reading() {
        // Zeros (what /dev/zero gives without end) were read whole, then reported as a bad record.
        let zeros = temp_file("zeros.jsonl", &vec![0u8; 3 << 20]);
        let err = read_trace(&zeros, TraceFormat::Mooncake, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.ends_with("zeros.jsonl:1: binary data (a NUL byte): not a Mooncake JSONL trace"),
            "{err}"
        );
        // 2 MiB of spaces were one blank line; now the line limit stops them.
        let spaces = temp_file("spaces.csv", &vec![b' '; 2 << 20]);
        let err = read_trace(&spaces, TraceFormat::Azure, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.ends_with(&format!(
                "spaces.csv:1: the line is longer than {MAX_LINE_BYTES} bytes (is this a Mooncake JSONL trace?)"
            )),
            "{err}"
        );
        let mut bytes = b"TIMESTAMP,ContextTokens,GeneratedTokens\n".to_vec();
        bytes.extend_from_slice(b"2023-11-16 18:15:46,374,44\n2023-11-16 18:15:47,3\xff4,44\n");
        let utf = temp_file("utf.csv", &bytes);
        let err = read_trace(&utf, TraceFormat::Azure, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.ends_with("utf.csv:3: not UTF-8 text (bad byte at offset 21)"),
            "{err}"
        );
        // Reading stops after the requests asked for: the bad line after them is never read.
        assert_eq!(
            read_trace(&utf, TraceFormat::Azure, Some(1)).unwrap().len(),
            1
        );
        let err = parse_trace(p(), "{\"timestamp\": \0}", TraceFormat::Mooncake, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("t.jsonl:1: binary data"), "{err}");
        std::fs::remove_dir_all(zeros.parent().unwrap()).unwrap();
    }

    #[test]
    fn every_number_of_a_line_is_bounded() {
        let mooncake = |ts: &str, input: u64, output: u64, ids: usize| {
            format!(
                "{{\"timestamp\": {ts}, \"input_length\": {input}, \"output_length\": {output}, \"hash_ids\": [{}]}}",
                vec!["0"; ids].join(",")
            )
        };
        let over = MAX_REQUEST_TOKENS as u64 + 1;
        for (line, why) in [
            (
                mooncake("0", over, 1, 32_769),
                "input_length 16777217 exceeds the limit",
            ),
            (
                mooncake("0", 1, over, 1),
                "output_length 16777217 exceeds the limit",
            ),
            // Timestamps are whole milliseconds up to 2^53.
            (mooncake("1e300", 1, 1, 1), "expected u64"),
            (mooncake("-1", 1, 1, 1), "expected u64"),
            (
                mooncake("9007199254740993", 1, 1, 1),
                "timestamp 9007199254740993 exceeds the limit",
            ),
        ] {
            let err = parse_trace(p(), &line, TraceFormat::Mooncake, None)
                .unwrap_err()
                .to_string();
            assert!(err.contains("t.jsonl:1: ") && err.contains(why), "{err}");
        }
        let ok = mooncake("9007199254740992", MAX_REQUEST_TOKENS as u64, 0, 32_768);
        assert!(parse_trace(p(), &ok, TraceFormat::Mooncake, None).is_ok());
        for (line, why) in [
            // The day arithmetic overflowed i64 (a panic) on this year.
            ("9000000000000000000-01-01 00:00:00,1,1", "timestamp"),
            ("0-01-01 00:00:00,1,1", "years 1..=9999"),
            (
                "2023-11-16 18:15:46,16777217,1",
                "ContextTokens 16777217 exceeds",
            ),
            (
                "2023-11-16 18:15:46,1,16777217",
                "GeneratedTokens 16777217 exceeds",
            ),
            ("2023-11-16 18:15:NaN,1,1", "timestamp"),
        ] {
            let err = parse_trace(Path::new("a.csv"), line, TraceFormat::Azure, None)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("a.csv:1: ") && err.contains(why),
                "{line}: {err}"
            );
        }
    }

    #[test]
    fn empty_trace_is_an_error_and_civil_days_match_known_dates() {
        assert!(matches!(
            parse_trace(p(), "\n", TraceFormat::Mooncake, None),
            Err(TraceFileError::Empty(_))
        ));
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(
            TraceFormat::infer(Path::new("x.csv")),
            Some(TraceFormat::Azure)
        );
    }
}
