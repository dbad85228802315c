//! Mooncake-format traces: one JSON object a line with `timestamp` (ms), `input_length`, `output_length`
//! and `hash_ids` (one id per 512-token block of the prompt; equal ids mean an equal prefix up to and
//! including that block).
//!
//! The prompt's token ids are reconstructed from the hash ids: token `i` of a block with id `h` is
//! `h * 512 + i`, so that equal ids give equal tokens and different ids different tokens, at any block
//! size of the replay. A bad line is reported with its file and line number.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use thiserror::Error;

/// Tokens per hash id in Mooncake traces.
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// A trace that could not be read.
#[derive(Debug, Error)]
pub enum TraceError {
    #[error("cannot read trace {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    BadLine {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{path}: the trace holds no request")]
    Empty { path: PathBuf },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequest {
    timestamp: u64,
    input_length: u32,
    output_length: u32,
    hash_ids: Vec<u64>,
}

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    pub timestamp_ms: u64,
    pub input_length: u32,
    pub output_length: u32,
    pub hash_ids: Vec<u32>,
}

impl TraceRequest {
    /// Appends the prompt's token ids to `out`.
    pub fn prompt_tokens(&self, out: &mut Vec<u32>) {
        out.reserve(self.input_length as usize);
        let mut left = self.input_length;
        for &h in &self.hash_ids {
            let n = left.min(TRACE_BLOCK_TOKENS);
            let base = h * TRACE_BLOCK_TOKENS;
            out.extend(base..base + n);
            left -= n;
        }
    }
}

/// Reads a whole trace file.
pub fn load_trace(path: &Path) -> Result<Vec<TraceRequest>, TraceError> {
    let file = std::fs::File::open(path).map_err(|source| TraceError::Io {
        path: path.to_owned(),
        source,
    })?;
    parse_trace(std::io::BufReader::new(file), path)
}

/// Parses a trace from `reader`; `path` names it in errors.
pub fn parse_trace(reader: impl BufRead, path: &Path) -> Result<Vec<TraceRequest>, TraceError> {
    let max_id = u32::MAX / TRACE_BLOCK_TOKENS;
    let mut out = Vec::new();
    let mut last_ts = 0;
    for (i, line) in reader.lines().enumerate() {
        let line_no = i + 1;
        let bad = |message: String| TraceError::BadLine {
            path: path.to_owned(),
            line: line_no,
            message,
        };
        let line = line.map_err(|source| TraceError::Io {
            path: path.to_owned(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let raw: RawRequest = serde_json::from_str(&line).map_err(|e| bad(e.to_string()))?;
        let blocks = raw.input_length.div_ceil(TRACE_BLOCK_TOKENS) as usize;
        if raw.input_length == 0 {
            return Err(bad("input_length is 0".into()));
        }
        if raw.hash_ids.len() != blocks {
            return Err(bad(format!(
                "{} hash_ids for input_length {} (expected {blocks}: one per {TRACE_BLOCK_TOKENS}-token block)",
                raw.hash_ids.len(),
                raw.input_length
            )));
        }
        if raw.timestamp < last_ts {
            return Err(bad(format!(
                "timestamp {} goes back in time (previous line: {last_ts})",
                raw.timestamp
            )));
        }
        last_ts = raw.timestamp;
        let hash_ids = raw
            .hash_ids
            .iter()
            .map(|&h| {
                u32::try_from(h)
                    .ok()
                    .filter(|&h| h <= max_id)
                    .ok_or_else(|| bad(format!("hash id {h} exceeds {max_id}")))
            })
            .collect::<Result<_, _>>()?;
        out.push(TraceRequest {
            timestamp_ms: raw.timestamp,
            input_length: raw.input_length,
            output_length: raw.output_length,
            hash_ids,
        });
    }
    if out.is_empty() {
        return Err(TraceError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<TraceRequest>, TraceError> {
        parse_trace(text.as_bytes(), Path::new("t.jsonl"))
    }

    #[test]
    fn parses_requests_and_maps_ids_to_tokens() {
        let reqs = parse(
            "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 7]}\n\n\
             {\"timestamp\": 3, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\n",
        )
        .unwrap();
        assert_eq!(reqs.len(), 2);
        let mut toks = Vec::new();
        reqs[0].prompt_tokens(&mut toks);
        assert_eq!(toks.len(), 600);
        assert_eq!(toks[511], 511);
        assert_eq!(toks[512], 7 * 512);
        assert_eq!(toks[599], 7 * 512 + 87);
    }

    #[test]
    fn bad_lines_name_the_file_and_line() {
        let err = parse(
            "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\n\
             {\"timestamp\": 1, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0, 1]}\n",
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "t.jsonl:2: 2 hash_ids for input_length 10 (expected 1: one per 512-token block)"
        );
        let err = parse("{\"timestamp\": 0}\n").unwrap_err().to_string();
        assert!(err.starts_with("t.jsonl:1: missing field"), "{err}");
        let err = parse("not json\n").unwrap_err().to_string();
        assert!(err.starts_with("t.jsonl:1: "), "{err}");
        let err = parse(
            "{\"timestamp\": 5, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n\
             {\"timestamp\": 4, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n",
        )
        .unwrap_err();
        assert!(err
            .to_string()
            .starts_with("t.jsonl:2: timestamp 4 goes back"));
        assert!(matches!(parse(""), Err(TraceError::Empty { .. })));
        let huge = format!(
            "{{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [{}]}}",
            u64::from(u32::MAX)
        );
        assert!(parse(&huge).unwrap_err().to_string().contains("exceeds"));
    }

    #[test]
    fn a_missing_file_is_an_io_error_naming_it() {
        let err = load_trace(Path::new("/nonexistent/trace.jsonl")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot read trace /nonexistent/trace.jsonl"
        );
        assert!(
            std::error::Error::source(&err).is_some(),
            "the OS error stays in the chain"
        );
    }
}
