//! The two seams between the engine and a model: [`TextCodec`] (tokenizer and chat template, shared
//! with the HTTP threads) and [`Executor`] (the forward pass over paged KV, owned by the engine thread).
//!
//! The engine never looks inside a model: it hands the executor a batch of (new tokens, first position,
//! block table) and gets back the logits of each item's last position. [`crate::model_backend`] adapts
//! `kura-model` to these traits; tests adapt small deterministic models.

use std::ops::Range;

/// One chat message after the caller has flattened its content parts to text (the model's own type: one
/// definition from the HTTP layer to the template).
pub use kura_model::ChatMessage;

/// Tokenizer and chat template of the served model. Shared by every thread.
pub trait TextCodec: Send + Sync + 'static {
    /// Token ids of a raw prompt `text`, with the special tokens the tokenizer adds to a text (BOS where the
    /// model wants one); special-token markers in the text become their ids. Not for chat prompts: see
    /// [`TextCodec::encode_chat`].
    fn encode(&self, text: &str) -> Result<Vec<u32>, String>;
    /// Text of `ids`, skipping special tokens. Incomplete UTF-8 at the end shows as U+FFFD.
    fn decode(&self, ids: &[u32]) -> String;
    /// The token's own bytes (possibly part of a UTF-8 character; a special token's text), as logprobs
    /// report them. Unlike `decode(&[id])`, distinct tokens never collapse into U+FFFD. Empty for an id
    /// outside the vocabulary.
    fn token_bytes(&self, id: u32) -> Vec<u8>;
    /// The chat template applied to `messages`, ending with the assistant's generation prompt (text, for
    /// display; encode chat prompts with [`TextCodec::encode_chat`]).
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String>;
    /// Prompt tokens of `messages`: the rendered template tokenized with nothing added, because the
    /// template writes every special token itself (as HF's `apply_chat_template(tokenize=True)`).
    /// `encode(render_chat(..))` would add a second BOS for templates that write `bos_token` (Llama 3).
    /// Special tokens come only from the template: special-token text in a message's content is
    /// encoded as the text it is.
    fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String>;
    /// Byte ranges of `text` that hold the contents of `messages`, where `text[from..]` is
    /// `render_chat(messages)` (after a raw prompt `text[..from]`, or alone with `from` 0): the ranges
    /// that [`TextCodec::encode_with_plain_spans`] keeps free of special tokens. Empty when no content
    /// spells a special token; an error when a content that does cannot be placed in the text.
    fn chat_content_spans(
        &self,
        text: &str,
        from: usize,
        messages: &[ChatMessage],
    ) -> Result<Vec<Range<usize>>, String>;
    /// [`TextCodec::encode`], except that special-token text inside the byte ranges `plain` is encoded
    /// as the text it is: how chat text is encoded with [`TextCodec::encode`]'s added tokens (BOS),
    /// `plain` from [`TextCodec::chat_content_spans`]. With `plain` empty, exactly `encode(text)`.
    fn encode_with_plain_spans(
        &self,
        text: &str,
        plain: &[Range<usize>],
    ) -> Result<Vec<u32>, String>;
    /// Tokens that end generation unless the request ignores end-of-sequence.
    fn eos_token_ids(&self) -> &[u32];
    fn vocab_size(&self) -> usize;
}

/// One sequence's part of a forward step: `tokens` sit at positions `start_pos..start_pos + len`, and
/// `block_table` already covers every one of them.
#[derive(Debug, Clone, Copy)]
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub block_table: &'a [u32],
    /// A hybrid pool's pages per layer, layer-major (see `kura_model::SeqBatchItem::layer_pages`); empty
    /// for a pool addressed by block ids.
    pub layer_pages: &'a [u32],
}

/// The forward pass over paged KV, and the block copies that copy-on-write needs.
pub trait Executor: Send + 'static {
    /// Writes K/V of every item's tokens into its blocks and returns, per item, the logits of its last
    /// token (`vocab_size` values each).
    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<Vec<Vec<f32>>, String>;
    /// Copies the K/V of the first `num_tokens` token slots of block `src` into block `dst`.
    fn copy_block_prefix(&mut self, src: u32, dst: u32, num_tokens: usize);
    /// Bytes of one block's KV as [`Executor::export_block`] writes them; 0 (the default) for an executor
    /// that keeps no KV bytes the engine could move, which then refuses lower tiers at start.
    fn block_bytes(&self) -> usize {
        0
    }
    /// Copies block `block`'s KV into `out` (`block_bytes()` long): the one seam through which a block
    /// leaves the pool for a lower tier (on an accelerator, a device-to-host copy).
    fn export_block(&self, block: u32, out: &mut [u8]) {
        let _ = (block, out);
        unreachable!("export_block called on an executor whose block_bytes() is 0");
    }
    /// Overwrites block `block`'s KV with `bytes`, as [`Executor::export_block`] wrote them.
    fn import_block(&mut self, block: u32, bytes: &[u8]) {
        let _ = (block, bytes);
        unreachable!("import_block called on an executor whose block_bytes() is 0");
    }
}
