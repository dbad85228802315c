//! Trace readers (kura-trace): the Mooncake parser (and the prompt tokens it rebuilds from the hash ids)
//! and the trace-file reader's Mooncake and Azure CSV parsers, over arbitrary text.
#![no_main]

use std::path::Path;

use kura_trace::file::{parse_trace, TraceFormat};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The Mooncake reader reads lines from any reader (invalid UTF-8 is its error to report).
    if let Ok(reqs) = kura_trace::mooncake::parse_trace(data, Path::new("fuzz.jsonl")) {
        let mut tokens = Vec::new();
        for r in &reqs {
            tokens.clear();
            r.prompt_tokens(&mut tokens);
        }
    }
    let Ok(text) = std::str::from_utf8(data) else { return };
    let path = Path::new("fuzz.trace");
    let _ = parse_trace(path, text, TraceFormat::Mooncake, None);
    let _ = parse_trace(path, text, TraceFormat::Azure, None);
    let _ = parse_trace(path, text, TraceFormat::Mooncake, Some(1));
});
