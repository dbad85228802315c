//! `kura-model` behind the engine's seams: [`ModelCodec`] (tokenizer and chat template) and
//! [`ModelExecutor`] (the forward pass over a [`KvStorage`] sized by the engine's pool).

use std::ops::Range;
use std::sync::Arc;

use kura_kv::storage::KvStorage;
use kura_model::{Model, ModelText, SeqBatchItem};

use crate::backend::{ChatMessage, Executor, SeqInput, TextCodec};

/// The served model's tokenizer and chat template (the weights are not needed: a router holds this
/// alone, from `kura_model::ModelText::load`).
pub struct ModelCodec {
    text: Arc<ModelText>,
}

impl ModelCodec {
    pub fn new(model: Arc<Model>) -> Self {
        Self::from_text(model.text().clone())
    }

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
}

/// The model's forward pass over the engine's KV storage.
pub struct ModelExecutor {
    model: Arc<Model>,
    storage: KvStorage,
}

impl ModelExecutor {
    pub fn new(model: Arc<Model>, storage: KvStorage) -> Self {
        Self { model, storage }
    }
}

impl Executor for ModelExecutor {
    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<Vec<Vec<f32>>, String> {
        let items: Vec<SeqBatchItem<'_>> = batch
            .iter()
            .map(|s| SeqBatchItem {
                tokens: s.tokens,
                start_pos: s.start_pos,
                block_table: s.block_table,
                layer_pages: s.layer_pages,
            })
            .collect();
        let logits = self
            .model
            .forward(&items, &mut self.storage)
            .map_err(|e| e.to_string())?;
        Ok((0..logits.num_rows())
            .map(|i| logits.row(i).to_vec())
            .collect())
    }

    fn copy_block_prefix(&mut self, src: u32, dst: u32, num_tokens: usize) {
        self.storage
            .copy_block_prefix(src as usize, dst as usize, num_tokens)
            .expect("the KV manager hands out block ids within the pool");
    }

    fn block_bytes(&self) -> usize {
        // The pool was allocated with this many bytes per block, so it fits in usize.
        self.storage.layout().bytes_per_block() as usize
    }

    fn export_block(&self, block: u32, out: &mut [u8]) {
        self.storage.export_block(block as usize, out).expect(
            "the KV manager hands out block ids within the pool, the tiers block-sized slots",
        );
    }

    fn import_block(&mut self, block: u32, bytes: &[u8]) {
        self.storage.import_block(block as usize, bytes).expect(
            "the KV manager hands out block ids within the pool, the tiers block-sized slots",
        );
    }
}
