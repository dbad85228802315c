//! Request bodies of `/v1/messages` (Anthropic): the strict JSON reader and the whole reading of a Messages
//! request (system and message blocks, `cache_control` breakpoints and their TTLs, sampling, stop
//! sequences, `cached_content`). Errors are the expected outcome; nothing may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kura_api::fuzz_messages(data);
});
