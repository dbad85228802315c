//! Trace parsing: the mapping to tokens, every field's bounds, and input that is not a trace at all.

use std::io::Read;

use super::*;

fn parse(text: &str) -> Result<Vec<TraceRequest>, TraceError> {
    parse_trace(text.as_bytes(), Path::new("t.jsonl"))
}

fn line(ts: u64, input: u64, output: u64, ids: &str) -> String {
    format!(
        "{{\"timestamp\": {ts}, \"input_length\": {input}, \"output_length\": {output}, \"hash_ids\": [{ids}]}}"
    )
}

#[test]
fn parses_requests_and_maps_ids_to_tokens() {
    let reqs = parse(
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 7]}\n\n\
         {\"timestamp\": 3, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\r\n",
    )
    .unwrap();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[1].timestamp_ms(), 3);
    let mut toks = Vec::new();
    reqs[0].prompt_tokens(&mut toks);
    assert_eq!(toks.len(), 600);
    assert_eq!(toks[511], 511);
    assert_eq!(toks[512], 7 * 512);
    assert_eq!(toks[599], 7 * 512 + 87);
}

#[test]
fn the_largest_hash_id_keeps_all_its_tokens() {
    // 8388607 × 512 + 512 is 2^32: the block's end overflowed u32 and its tokens were dropped.
    let reqs = parse(&line(0, 1000, 1, &format!("1, {MAX_HASH_ID}"))).unwrap();
    let mut toks = Vec::new();
    reqs[0].prompt_tokens(&mut toks);
    assert_eq!(toks.len(), 1000);
    assert_eq!(toks[512], MAX_HASH_ID * 512);
    assert_eq!(toks[999], MAX_HASH_ID * 512 + 487);
    let full = parse(&line(0, 512, 1, &MAX_HASH_ID.to_string())).unwrap();
    toks.clear();
    full[0].prompt_tokens(&mut toks);
    assert_eq!(toks.len(), 512);
    assert_eq!(toks[511], u32::MAX);
    let err = parse(&line(0, 512, 1, &(u64::from(MAX_HASH_ID) + 1).to_string())).unwrap_err();
    assert!(err.to_string().contains("exceeds 8388607"), "{err}");
}

#[test]
fn every_number_of_a_line_is_bounded() {
    let ids = |n: u64| vec!["0"; n.div_ceil(512) as usize].join(",");
    let max_tokens = u64::from(MAX_REQUEST_TOKENS);
    let cases = [
        (
            line(MAX_TIMESTAMP_MS + 1, 1, 1, "0"),
            "timestamp 9007199254740993 exceeds",
        ),
        (
            line(0, max_tokens + 1, 1, "0"),
            "input_length 16777217 exceeds",
        ),
        (
            line(0, 1, max_tokens + 1, "0"),
            "output_length 16777217 exceeds",
        ),
        (line(0, 1, 1, "4294967296"), "hash id 4294967296 exceeds"),
        (
            line(0, u64::MAX, 1, "0"),
            "input_length 18446744073709551615 exceeds",
        ),
        (line(0, 0, 1, ""), "input_length is 0"),
        (
            line(0, 513, 1, "0"),
            "1 hash_ids for input_length 513 (expected 2",
        ),
        (line(0, 1, 1, "-1"), "invalid value"),
        (line(0, 1, 1, "1.5"), "invalid type"),
        (line(0, 1, 1, "18446744073709551616"), ""),
        (
            "{\"timestamp\": -5, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}"
                .into(),
            "invalid value",
        ),
        (
            "{\"timestamp\": 1e400, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}"
                .into(),
            "",
        ),
        (
            format!(
                "{}, \"extra\": 1}}",
                line(0, 1, 1, "0").trim_end_matches('}')
            ),
            "unknown field",
        ),
    ];
    for (text, why) in cases {
        let err = parse(&text).unwrap_err().to_string();
        assert!(
            err.starts_with("t.jsonl:1: ") && err.contains(why),
            "{text} -> {err}"
        );
    }
    // The limits themselves are accepted.
    let at_limits = line(MAX_TIMESTAMP_MS, max_tokens, max_tokens, &ids(max_tokens));
    let req = parse_line(&at_limits).unwrap();
    assert_eq!(req.input_length(), MAX_REQUEST_TOKENS);
    assert_eq!(req.hash_ids().len(), 32_768);
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
    let err = parse(&format!(
        "{}\n\n{}\n",
        line(5, 1, 1, "0"),
        line(4, 1, 1, "0")
    ))
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "t.jsonl:3: timestamp 4 goes back in time (previous line: 5)"
    );
    assert!(matches!(parse(""), Err(TraceError::Empty { .. })));
    assert!(matches!(parse("\n \n"), Err(TraceError::Empty { .. })));
}

/// Counts the bytes taken from the inner reader.
struct Counting<R> {
    inner: R,
    taken: usize,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.taken += n;
        Ok(n)
    }
}

fn parse_counting(inner: impl Read) -> (Result<Vec<TraceRequest>, TraceError>, usize) {
    let mut counting = Counting { inner, taken: 0 };
    let result = parse_trace(
        std::io::BufReader::new(&mut counting),
        Path::new("/dev/zero"),
    );
    (result, counting.taken)
}

#[test]
fn binary_input_is_refused_at_its_first_buffer() {
    // /dev/zero: one endless line of NUL bytes was read whole (5 GB in 12 s) before this.
    let (result, taken) = parse_counting(std::io::repeat(0).take(64 * MAX_LINE_BYTES as u64));
    let err = result.unwrap_err();
    assert!(
        matches!(
            err,
            TraceError::BadLine {
                line: 1,
                problem: LineError::Binary,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "/dev/zero:1: binary data (a NUL byte): not a Mooncake JSONL trace"
    );
    assert!(taken <= 64 << 10, "read {taken} bytes before refusing");
    // A NUL after a good line names the line it is on.
    let text = format!("{}\n{{\"timestamp\": \0}}\n", line(0, 1, 1, "0"));
    let err = parse(&text).unwrap_err();
    assert!(matches!(
        err,
        TraceError::BadLine {
            line: 2,
            problem: LineError::Binary,
            ..
        }
    ));
    assert_eq!(parse_line("{\0}"), Err(LineError::Binary));
}

#[test]
fn an_endless_line_stops_at_the_line_limit() {
    let (result, taken) = parse_counting(std::io::repeat(b' ').take(64 * MAX_LINE_BYTES as u64));
    let err = result.unwrap_err();
    assert!(
        matches!(
            err,
            TraceError::BadLine {
                line: 1,
                problem: LineError::TooLong,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("longer than 1048576 bytes"),
        "{err}"
    );
    assert!(taken <= MAX_LINE_BYTES + (64 << 10), "read {taken} bytes");
    assert_eq!(
        parse_line(&" ".repeat(MAX_LINE_BYTES + 1)),
        Err(LineError::TooLong)
    );
}

#[test]
fn text_that_is_not_utf8_is_named() {
    let mut bytes = line(0, 1, 1, "0").into_bytes();
    bytes.extend_from_slice(b"\n{\"timestamp\xff\": 0}\n");
    let err = parse_trace(&bytes[..], Path::new("t.jsonl")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "t.jsonl:2: the line is not UTF-8 text (bad byte at offset 11)"
    );
}

#[test]
fn a_limit_stops_reading_before_later_lines() {
    let text = format!("{}\n{}\nnot json\n", line(0, 1, 1, "0"), line(1, 1, 1, "0"));
    let reqs = parse_trace_limited(text.as_bytes(), Path::new("t.jsonl"), Some(2)).unwrap();
    assert_eq!(reqs.len(), 2);
    assert!(parse(&text).is_err());
}

#[test]
fn odd_lines_are_errors_not_panics() {
    let deep = "[".repeat(100_000);
    for text in [
        "", " ", "{", "}", "[]", "null", "0", "\"s\"", "{\"timestamp\": 0}", &deep,
        "{\"timestamp\": 0, \"timestamp\": 1, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}",
    ] {
        assert!(parse_line(text).is_err(), "{text:.40}");
    }
}

#[test]
fn requests_built_in_code_are_checked_too() {
    assert!(TraceRequest::new(0, 512, 0, vec![MAX_HASH_ID]).is_ok());
    assert_eq!(
        TraceRequest::new(0, 512, 0, vec![MAX_HASH_ID + 1]),
        Err(LineError::HashIdTooLarge(u64::from(MAX_HASH_ID) + 1))
    );
    assert_eq!(
        TraceRequest::new(0, 0, 0, vec![]),
        Err(LineError::ZeroInput)
    );
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

#[test]
fn a_line_is_an_object_never_an_array_of_the_four_values() {
    // serde builds a struct from a sequence too: `[0, 600, 10, [0, 1]]` was read as a request.
    for text in ["[0, 600, 10, [0, 1]]", " [0,600,10,[0,1]]", "\"x\"", "7"] {
        let err = parse(text).unwrap_err().to_string();
        assert!(
            err.contains("t.jsonl:1") && err.contains("expected a JSON object"),
            "{text}: {err}"
        );
    }
}
