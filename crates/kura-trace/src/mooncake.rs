//! Mooncake-format traces: one JSON object a line with `timestamp` (ms), `input_length`, `output_length`
//! and `hash_ids` (one id per 512-token block of the prompt; equal ids mean an equal prefix up to and
//! including that block).
//!
//! The prompt's token ids are reconstructed from the hash ids: token `i` of a block with id `h` is
//! `h * 512 + i`, so that equal ids give equal tokens and different ids different tokens, at any block
//! size of the replay. Token ids are `u32`, so ids go up to [`MAX_HASH_ID`] (whose last token is
//! `u32::MAX`).
//!
//! Everything taken from a file is bounded before it is used: a line is at most [`MAX_LINE_BYTES`] (read
//! without ever holding more, so `/dev/zero` fails at once instead of filling memory), holds no NUL byte
//! and is UTF-8; lengths are at most [`MAX_REQUEST_TOKENS`], timestamps at most [`MAX_TIMESTAMP_MS`]. A
//! bad line is reported with its file and line number. [`parse_line`] checks one line on its own (the
//! fuzzing entry point); [`parse_trace`] adds what spans lines (timestamps never go back).

use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use thiserror::Error;

/// Tokens per hash id in Mooncake traces.
pub const TRACE_BLOCK_TOKENS: u32 = 512;
/// The largest hash id: its block's tokens `id * 512 ..= id * 512 + 511` still fit in `u32`.
pub const MAX_HASH_ID: u32 = u32::MAX / TRACE_BLOCK_TOKENS;
/// The longest line read (the real traces' lines are about 2 KiB).
pub const MAX_LINE_BYTES: usize = 1 << 20;
/// The largest `input_length` or `output_length` (16 Mi tokens; real traces stay below 200 K). It bounds
/// the token buffers a replay allocates for one request.
pub const MAX_REQUEST_TOKENS: u32 = 1 << 24;
/// The latest timestamp (2^53 ms, about 285,000 years): exact as a JSON number in any reader, and far from
/// overflowing when the replay adds request durations to it.
pub const MAX_TIMESTAMP_MS: u64 = 1 << 53;

/// What is wrong with one line of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LineError {
    /// Not a JSON object with exactly the four fields (serde's message, with its column).
    #[error("{0}")]
    Json(String),
    #[error("the line is longer than {MAX_LINE_BYTES} bytes (is this a Mooncake JSONL trace?)")]
    TooLong,
    #[error("binary data (a NUL byte): not a Mooncake JSONL trace")]
    Binary,
    #[error("the line is not UTF-8 text (bad byte at offset {offset})")]
    NotUtf8 { offset: usize },
    #[error("empty line")]
    Empty,
    #[error("input_length is 0")]
    ZeroInput,
    #[error("{field} {value} exceeds the limit of {max}")]
    TooLarge {
        field: &'static str,
        value: u64,
        max: u64,
    },
    #[error(
        "{got} hash_ids for input_length {input_length} (expected {expected}: one per {TRACE_BLOCK_TOKENS}-token block)"
    )]
    HashIdCount {
        got: usize,
        input_length: u32,
        expected: usize,
    },
    #[error("hash id {0} exceeds {MAX_HASH_ID} (its tokens, id × {TRACE_BLOCK_TOKENS} + slot, would not fit in 32 bits)")]
    HashIdTooLarge(u64),
    #[error("timestamp {timestamp} goes back in time (previous line: {previous})")]
    TimeGoesBack { timestamp: u64, previous: u64 },
}

/// A trace that could not be read.
#[derive(Debug, Error)]
pub enum TraceError {
    #[error("cannot read trace {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {problem}")]
    BadLine {
        path: PathBuf,
        line: usize,
        problem: LineError,
    },
    #[error("{path}: the trace holds no request")]
    Empty { path: PathBuf },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequest {
    timestamp: u64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// One request of a trace. Its fields are checked at construction ([`TraceRequest::new`]), so that the
/// token arithmetic of [`TraceRequest::prompt_tokens`] and of the replay cannot overflow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    timestamp_ms: u64,
    input_length: u32,
    output_length: u32,
    hash_ids: Vec<u32>,
}

fn bounded(field: &'static str, value: u64, max: u64) -> Result<u64, LineError> {
    if value > max {
        Err(LineError::TooLarge { field, value, max })
    } else {
        Ok(value)
    }
}

impl TraceRequest {
    /// A request, if its numbers are within the limits of this module and it has one hash id per
    /// 512-token block of its prompt.
    pub fn new(
        timestamp_ms: u64,
        input_length: u64,
        output_length: u64,
        hash_ids: Vec<u32>,
    ) -> Result<Self, LineError> {
        let max_tokens = u64::from(MAX_REQUEST_TOKENS);
        if input_length == 0 {
            return Err(LineError::ZeroInput);
        }
        let timestamp_ms = bounded("timestamp", timestamp_ms, MAX_TIMESTAMP_MS)?;
        // Both fit in u32: MAX_REQUEST_TOKENS does.
        let input_length = bounded("input_length", input_length, max_tokens)? as u32;
        let output_length = bounded("output_length", output_length, max_tokens)? as u32;
        let expected = input_length.div_ceil(TRACE_BLOCK_TOKENS) as usize;
        if hash_ids.len() != expected {
            return Err(LineError::HashIdCount {
                got: hash_ids.len(),
                input_length,
                expected,
            });
        }
        if let Some(&h) = hash_ids.iter().find(|&&h| h > MAX_HASH_ID) {
            return Err(LineError::HashIdTooLarge(u64::from(h)));
        }
        Ok(Self {
            timestamp_ms,
            input_length,
            output_length,
            hash_ids,
        })
    }

    /// Arrival time in milliseconds, at most [`MAX_TIMESTAMP_MS`].
    pub fn timestamp_ms(&self) -> u64 {
        self.timestamp_ms
    }

    /// Prompt tokens, 1..=[`MAX_REQUEST_TOKENS`].
    pub fn input_length(&self) -> u32 {
        self.input_length
    }

    /// Output tokens, 0..=[`MAX_REQUEST_TOKENS`].
    pub fn output_length(&self) -> u32 {
        self.output_length
    }

    /// One id per 512-token block of the prompt, each at most [`MAX_HASH_ID`].
    pub fn hash_ids(&self) -> &[u32] {
        &self.hash_ids
    }

    /// Appends the prompt's token ids to `out`.
    pub fn prompt_tokens(&self, out: &mut Vec<u32>) {
        out.reserve(self.input_length as usize);
        let mut left = self.input_length;
        for &h in &self.hash_ids {
            let n = left.min(TRACE_BLOCK_TOKENS);
            if n == 0 {
                break;
            }
            // h <= MAX_HASH_ID, so the last token, base + 511, fits in u32, but an exclusive end
            // (base + 512) would not for the largest id: hence the inclusive range.
            let base = h * TRACE_BLOCK_TOKENS;
            out.extend(base..=base + (n - 1));
            left -= n;
        }
    }
}

/// Parses one trace line on its own (no check that spans lines): the whole of what a line can be wrong
/// with, without panicking on any input.
pub fn parse_line(line: &str) -> Result<TraceRequest, LineError> {
    if line.len() > MAX_LINE_BYTES {
        return Err(LineError::TooLong);
    }
    if line.as_bytes().contains(&0) {
        return Err(LineError::Binary);
    }
    if line.trim().is_empty() {
        return Err(LineError::Empty);
    }
    // serde would also build the record from an array of four values: a line is an object.
    if !line.trim_start().starts_with('{') {
        return Err(LineError::Json(
            "expected a JSON object {\"timestamp\", \"input_length\", \"output_length\", \"hash_ids\"}"
                .into(),
        ));
    }
    let raw: RawRequest = serde_json::from_str(line).map_err(|e| LineError::Json(e.to_string()))?;
    let hash_ids = raw
        .hash_ids
        .iter()
        .map(|&h| {
            u32::try_from(h)
                .ok()
                .filter(|&h| h <= MAX_HASH_ID)
                .ok_or(LineError::HashIdTooLarge(h))
        })
        .collect::<Result<_, _>>()?;
    TraceRequest::new(raw.timestamp, raw.input_length, raw.output_length, hash_ids)
}

/// Reads a whole trace file.
pub fn load_trace(path: &Path) -> Result<Vec<TraceRequest>, TraceError> {
    load_trace_limited(path, None)
}

/// Reads the first `max_requests` requests of a trace file (all when `None`); the rest is not read.
pub fn load_trace_limited(
    path: &Path,
    max_requests: Option<usize>,
) -> Result<Vec<TraceRequest>, TraceError> {
    let file = std::fs::File::open(path).map_err(|source| TraceError::Io {
        path: path.to_owned(),
        source,
    })?;
    parse_trace_limited(std::io::BufReader::new(file), path, max_requests)
}

/// Parses a trace from `reader`; `path` names it in errors.
pub fn parse_trace(reader: impl BufRead, path: &Path) -> Result<Vec<TraceRequest>, TraceError> {
    parse_trace_limited(reader, path, None)
}

/// Parses the first `max_requests` requests (all when `None`) from `reader`; `path` names it in errors.
pub fn parse_trace_limited(
    mut reader: impl BufRead,
    path: &Path,
    max_requests: Option<usize>,
) -> Result<Vec<TraceRequest>, TraceError> {
    let limit = max_requests.unwrap_or(usize::MAX);
    let mut out = Vec::new();
    let mut last_ts = 0;
    let mut buf = Vec::new();
    let mut line_no = 0usize;
    while out.len() < limit {
        line_no += 1;
        let bad = |problem: LineError| TraceError::BadLine {
            path: path.to_owned(),
            line: line_no,
            problem,
        };
        let more = read_line_bounded(&mut reader, &mut buf).map_err(|e| match e {
            ReadError::Line(problem) => bad(problem),
            ReadError::Io(source) => TraceError::Io {
                path: path.to_owned(),
                source,
            },
        })?;
        if !more {
            break;
        }
        let line = std::str::from_utf8(&buf).map_err(|e| {
            bad(LineError::NotUtf8 {
                offset: e.valid_up_to(),
            })
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let req = parse_line(line).map_err(bad)?;
        if req.timestamp_ms < last_ts {
            return Err(bad(LineError::TimeGoesBack {
                timestamp: req.timestamp_ms,
                previous: last_ts,
            }));
        }
        last_ts = req.timestamp_ms;
        out.push(req);
    }
    if out.is_empty() {
        return Err(TraceError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(out)
}

/// Why [`read_line_bounded`] stopped: the line itself ([`LineError::TooLong`], [`LineError::Binary`]) or
/// the reader.
#[derive(Debug)]
pub enum ReadError {
    Line(LineError),
    Io(std::io::Error),
}

/// Reads one line into `buf` without its `\n` (and `\r`), never holding more than [`MAX_LINE_BYTES`]
/// and refusing a NUL byte as soon as it arrives. `Ok(false)` at the end of the input. Every trace reader
/// of Kura (this one and kura-bench's) reads its lines with it.
pub fn read_line_bounded(reader: &mut impl BufRead, buf: &mut Vec<u8>) -> Result<bool, ReadError> {
    buf.clear();
    let mut read_any = false;
    loop {
        let chunk = match reader.fill_buf() {
            Ok(chunk) => chunk,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ReadError::Io(e)),
        };
        if chunk.is_empty() {
            break;
        }
        read_any = true;
        let newline = chunk.iter().position(|&b| b == b'\n');
        let take = newline.unwrap_or(chunk.len());
        if chunk[..take].contains(&0) {
            return Err(ReadError::Line(LineError::Binary));
        }
        if buf.len() + take > MAX_LINE_BYTES {
            return Err(ReadError::Line(LineError::TooLong));
        }
        buf.extend_from_slice(&chunk[..take]);
        let consumed = take + usize::from(newline.is_some());
        reader.consume(consumed);
        if newline.is_some() {
            break;
        }
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(read_any)
}

#[cfg(test)]
mod tests;
