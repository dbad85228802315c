//! Chat templates: arbitrary messages through the real templates (the default model's, SmolLM2, and
//! ChatML), and arbitrary template sources (a hostile GGUF or `tokenizer_config.json` can carry any):
//! compiling and rendering must not panic, overflow the stack or run without end.
//!
//! Input: byte 0 holds flags (bit 0: `add_generation_prompt`; bits 1-2: which template: 0 SmolLM2,
//! 1 ChatML, 2 and 3 the first field of the input); the rest is split at NUL bytes into fields
//! (UTF-8, lossily), which are the template source (when it comes from the input), then BOS, EOS, then
//! (role, content) pairs.
#![no_main]

use kura_model::chat::CHATML;
use kura_model::{ChatMessage, ChatTemplate};
use libfuzzer_sys::fuzz_target;

/// `tokenizer.chat_template` of SmolLM2-135M-Instruct (the default model), read from its GGUF.
const SMOLLM2: &str = include_str!("../assets/smollm2-chat-template.jinja");

/// More messages than any test needs; keeps one input's work bounded.
const MAX_MESSAGES: usize = 64;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else { return };
    let mut fields = rest.split(|&b| b == 0).map(String::from_utf8_lossy);
    let add_generation_prompt = flags & 1 != 0;
    let source = match (flags >> 1) & 3 {
        0 => SMOLLM2.into(),
        1 => CHATML.into(),
        _ => fields.next().unwrap_or_default(),
    };
    let bos = fields.next().unwrap_or_default();
    let eos = fields.next().unwrap_or_default();
    let mut messages = Vec::new();
    while let (Some(role), Some(content)) = (fields.next(), fields.next()) {
        if messages.len() == MAX_MESSAGES {
            break;
        }
        messages.push(ChatMessage::new(role, content));
    }
    if let Ok(t) = ChatTemplate::new(&source, &bos, &eos) {
        let _ = t.render(&messages, add_generation_prompt);
    }
});
