//! Request bodies of `/v1/responses`: the strict JSON reader and the whole reading of a Responses request
//! (input items, function tools, `text.format`, the refused fields), and the fallback rendering of its
//! tool turns. Errors are the expected outcome; nothing may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kura_api::fuzz_responses(data);
});
