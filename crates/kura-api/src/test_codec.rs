//! A codec for unit tests: bytes as tokens, a chat its contents one after another.

use std::ops::Range;

use kura_request::{ChatMessage, TextCodec};

/// Bytes as tokens; a chat is its contents one after another.
pub struct Bytes;

impl TextCodec for Bytes {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        Ok(text.bytes().map(u32::from).collect())
    }
    fn decode(&self, ids: &[u32]) -> String {
        ids.iter().map(|&i| char::from(i as u8)).collect()
    }
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        vec![id as u8]
    }
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String> {
        Ok(messages.iter().map(|m| m.content.as_str()).collect())
    }
    fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String> {
        self.encode(&self.render_chat(messages)?)
    }
    fn chat_content_spans(
        &self,
        _: &str,
        _: usize,
        _: &[ChatMessage],
    ) -> Result<Vec<Range<usize>>, String> {
        Ok(Vec::new())
    }
    fn encode_with_plain_spans(&self, text: &str, _: &[Range<usize>]) -> Result<Vec<u32>, String> {
        self.encode(text)
    }
    fn eos_token_ids(&self) -> &[u32] {
        &[0]
    }
    fn vocab_size(&self) -> usize {
        256
    }
}
