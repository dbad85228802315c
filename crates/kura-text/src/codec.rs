//! [`ModelCodec`]: the real model's tokenizer and chat template behind `kura-request`'s [`TextCodec`]
//! seam (shared by every thread of a server or a router).

use std::ops::Range;
use std::sync::Arc;

use kura_request::{ChatMessage, TextCodec};

use crate::model_text::ModelText;

/// A model's tokenizer and chat template behind [`TextCodec`] (the weights are not needed: a router
/// holds this alone, from [`ModelText::load`]).
pub struct ModelCodec {
    text: Arc<ModelText>,
}

impl ModelCodec {
    pub fn from_text(text: Arc<ModelText>) -> Self {
        Self { text }
    }
}

impl TextCodec for ModelCodec {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.text
            .tokenizer
            .encode(text, true)
            .map_err(|e| e.to_string())
    }

    fn decode(&self, ids: &[u32]) -> String {
        // A decoding failure (an id the vocabulary lacks) shows as the replacement character rather
        // than failing a request that the model itself produced.
        self.text
            .tokenizer
            .decode(ids, true)
            .unwrap_or_else(|_| "\u{FFFD}".to_string())
    }

    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.text.tokenizer.token_bytes(id).unwrap_or_default()
    }

    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String> {
        self.text
            .chat_template
            .render(messages, true)
            .map_err(|e| e.to_string())
    }

    fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String> {
        self.text
            .chat_template
            .encode(&self.text.tokenizer, messages, true)
            .map_err(|e| e.to_string())
    }

    fn chat_content_spans(
        &self,
        text: &str,
        from: usize,
        messages: &[ChatMessage],
    ) -> Result<Vec<Range<usize>>, String> {
        let rendered = text
            .get(from..)
            .ok_or_else(|| format!("chat text starts at byte {from}, outside its text"))?;
        let spans = self
            .text
            .chat_template
            .content_spans(rendered, messages, true, &self.text.tokenizer)
            .map_err(|e| e.to_string())?;
        Ok(spans
            .into_iter()
            .map(|r| r.start + from..r.end + from)
            .collect())
    }

    fn encode_with_plain_spans(
        &self,
        text: &str,
        plain: &[Range<usize>],
    ) -> Result<Vec<u32>, String> {
        self.text
            .tokenizer
            .encode_with_plain_spans(text, plain, true)
            .map_err(|e| e.to_string())
    }

    fn eos_token_ids(&self) -> &[u32] {
        &self.text.tokenizer.stop_token_ids
    }

    fn vocab_size(&self) -> usize {
        self.text.vocab_size
    }

    fn is_special(&self, id: u32) -> bool {
        self.text.tokenizer.is_special(id)
    }

    fn chat_template_source(&self) -> &str {
        self.text.chat_template.source()
    }

    fn encode_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &serde_json::Value,
    ) -> Result<Vec<u32>, String> {
        self.text
            .chat_template
            .encode_with_tools(&self.text.tokenizer, messages, Some(tools), true)
            .map_err(|e| e.to_string())
    }
}
