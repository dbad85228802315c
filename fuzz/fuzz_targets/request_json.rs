//! Request bodies of `/v1/completions` and `/v1/chat/completions`: the strict JSON reader (one object,
//! nothing after it, no NUL) and the whole validation that turns a body into engine requests, under both
//! scheduling policies. Errors are the expected outcome; nothing may panic.
//!
//! Input: byte 0 picks the route (bit 0: chat) and the policy (bit 1: priority); the rest is the body.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, body)) = data.split_first() else { return };
    let _ = kura_api::fuzz_validate(flags & 1 != 0, flags & 2 != 0, body);
});
