//! [`ModelCodec`]: the real model's tokenizer and chat template behind `kura-request`'s [`TextCodec`]
//! seam (shared by every thread of a server or a router).

use std::ops::Range;
use std::sync::Arc;

use kura_request::{ChatMessage, TextCodec, TEXT_OVER_CONTEXT};

use crate::chat::ChatTemplate;
use crate::model_text::ModelText;

/// A model's tokenizer and chat template behind [`TextCodec`] (the weights are not needed: a router
/// holds this alone, from [`ModelText::load`]).
pub struct ModelCodec {
    text: Arc<ModelText>,
    /// A chat template given in place of the model's own ([`ModelCodec::with_chat_template`]).
    template: Option<ChatTemplate>,
    /// The longest text encoded: `(bytes, the context it stands for, bytes a token covers at most)`.
    limit: Option<(usize, usize, usize)>,
}

/// How many times the longest token's bytes a token may cover of the text before encoding, in
/// [`ModelCodec::with_max_tokens`]'s bound: slack for normalizers that shorten text (NFKC's
/// ligatures), where each token's bytes are counted after them.
const NORMALIZER_SLACK: usize = 4;

impl ModelCodec {
    pub fn from_text(text: Arc<ModelText>) -> Self {
        Self {
            text,
            template: None,
            limit: None,
        }
    }

    /// Chats written by `source` (a Jinja chat template, as `tokenizer_config.json`'s) instead of the
    /// model's own template, with the model's BOS and EOS texts: an error naming what does not compile.
    pub fn with_chat_template(mut self, source: &str) -> crate::error::Result<Self> {
        self.template = Some(self.text.chat_template.with_source(source)?);
        Ok(self)
    }

    /// The chat template in use: the one given, else the model's.
    fn chat_template(&self) -> &ChatTemplate {
        self.template.as_ref().unwrap_or(&self.text.chat_template)
    }

    /// Refuses, before any tokenizing, a text (a prompt, or the messages of a chat) that could not
    /// fit in `max_tokens` tokens whatever it holds: more bytes than `max_tokens` tokens of the
    /// vocabulary's longest (× a slack for normalizers). Tokenizing costs several hundred bytes of
    /// memory per token for a moment: unbounded, an 8 MiB body of a million tokens held a gigabyte
    /// to be refused as too long. The engine still counts the tokens of every text that passes.
    pub fn with_max_tokens(mut self, max_tokens: usize) -> Self {
        let longest = (0..self.text.vocab_size as u32)
            .map(|id| self.text.tokenizer.token_bytes(id).map_or(0, |b| b.len()))
            .max()
            .unwrap_or(1)
            .max(1);
        let bytes = max_tokens
            .saturating_mul(longest)
            .saturating_mul(NORMALIZER_SLACK);
        self.limit = Some((bytes, max_tokens, longest));
        self
    }

    /// The chat text of `messages` (and `tools`) tokenized, its length checked first: the check's own
    /// message on a refusal (it starts with [`TEXT_OVER_CONTEXT`]). `continuing`: the last message is
    /// continued, not answered.
    fn encode_chat_checked(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        continuing: bool,
    ) -> Result<Vec<u32>, String> {
        let refused = std::cell::Cell::new(None);
        let check = |n| {
            self.check_len(n)
                .inspect_err(|e| refused.set(Some(e.clone())))
        };
        let (template, tokenizer) = (self.chat_template(), &self.text.tokenizer);
        match continuing {
            true => template.encode_continuing_checked(tokenizer, messages, tools, check),
            false => template.encode_checked(tokenizer, messages, tools, true, check),
        }
        .map_err(|e| refused.take().unwrap_or_else(|| e.to_string()))
    }

    /// The byte ranges of `text[from..]` (the chat text of `messages`, with `tools` or without) that
    /// hold the messages' contents, in `text`'s offsets.
    fn content_spans_of(
        &self,
        text: &str,
        from: usize,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
    ) -> Result<Vec<Range<usize>>, String> {
        let rendered = text
            .get(from..)
            .ok_or_else(|| format!("chat text starts at byte {from}, outside its text"))?;
        let spans = self
            .chat_template()
            .content_spans_with_tools(rendered, messages, tools, true, &self.text.tokenizer)
            .map_err(|e| e.to_string())?;
        Ok(spans
            .into_iter()
            .map(|r| r.start + from..r.end + from)
            .collect())
    }

    /// `text` tokenized once its length passed the bound, with the tokens the tokenizer adds (BOS) or
    /// without.
    fn encode_text(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        self.check_len(text.len())?;
        self.text
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| e.to_string())
    }

    /// The text of `bytes` bytes against [`ModelCodec::with_max_tokens`]'s bound.
    fn check_len(&self, bytes: usize) -> Result<(), String> {
        match self.limit {
            Some((max, tokens, longest)) if bytes > max => Err(format!(
                "{TEXT_OVER_CONTEXT}{bytes} bytes, where {tokens} tokens of at most {longest} bytes \
                 each (this model's longest) hold {max} at most, with room for normalization; \
                 shorten it"
            )),
            _ => Ok(()),
        }
    }
}

impl TextCodec for ModelCodec {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.encode_text(text, true)
    }

    fn encode_without_added(&self, text: &str) -> Result<Vec<u32>, String> {
        self.encode_text(text, false)
    }

    fn decode(&self, ids: &[u32]) -> String {
        // A decoding failure (an id the vocabulary lacks) shows as the replacement character rather
        // than failing a request that the model itself produced.
        self.text
            .tokenizer
            .decode(ids, true)
            .unwrap_or_else(|_| "\u{FFFD}".to_string())
    }

    fn decode_keeping_special(&self, ids: &[u32]) -> String {
        self.text
            .tokenizer
            .decode(ids, false)
            .unwrap_or_else(|_| "\u{FFFD}".to_string())
    }

    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.text.tokenizer.token_bytes(id).unwrap_or_default()
    }

    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String> {
        self.chat_template()
            .render(messages, true)
            .map_err(|e| e.to_string())
    }

    fn encode_chat_continuing(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
    ) -> Result<Vec<u32>, String> {
        self.encode_chat_checked(messages, tools, true)
    }

    fn render_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &serde_json::Value,
    ) -> Result<String, String> {
        self.chat_template()
            .render_with_tools(messages, Some(tools), true)
            .map_err(|e| e.to_string())
    }

    fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String> {
        self.encode_chat_checked(messages, None, false)
    }

    fn chat_content_spans(
        &self,
        text: &str,
        from: usize,
        messages: &[ChatMessage],
    ) -> Result<Vec<Range<usize>>, String> {
        self.content_spans_of(text, from, messages, None)
    }

    fn chat_content_spans_with_tools(
        &self,
        text: &str,
        from: usize,
        messages: &[ChatMessage],
        tools: &serde_json::Value,
    ) -> Result<Vec<Range<usize>>, String> {
        self.content_spans_of(text, from, messages, Some(tools))
    }

    fn encode_with_plain_spans(
        &self,
        text: &str,
        plain: &[Range<usize>],
    ) -> Result<Vec<u32>, String> {
        self.check_len(text.len())?;
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
        self.chat_template().source()
    }

    fn encode_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &serde_json::Value,
    ) -> Result<Vec<u32>, String> {
        self.encode_chat_checked(messages, Some(tools), false)
    }
    fn with_chat_template(&self, source: &str) -> Result<Arc<dyn TextCodec>, String> {
        let template = self
            .chat_template()
            .with_source(source)
            .map_err(|e| e.to_string())?;
        Ok(Arc::new(ModelCodec {
            text: self.text.clone(),
            template: Some(template),
            limit: self.limit,
        }))
    }

    fn with_template_kwargs(
        &self,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<(Arc<dyn TextCodec>, Vec<String>), String> {
        let (template, left_out) = self
            .chat_template()
            .with_vars(kwargs, &self.text.tokenizer)
            .map_err(|e| e.to_string())?;
        let codec = ModelCodec {
            text: self.text.clone(),
            template: Some(template),
            limit: self.limit,
        };
        Ok((Arc::new(codec), left_out))
    }
}
