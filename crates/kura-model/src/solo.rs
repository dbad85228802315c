//! One sequence run step by step on KV storage of its own, outside the engine: `kura generate` and the
//! model's tests. The first call computes the prompt in one forward call; each later call computes the
//! tokens pushed since, usually one. Without the KV cache every call computes the whole sequence again (to
//! measure what the cache saves, and to check that both give the same tokens).

use kura_kv::codec::KvDtype;
use kura_kv::storage::KvStorage;

use crate::error::{ModelError, Result};
use crate::model::{Logits, Model, SeqBatchItem};

pub struct SoloRun<'m> {
    model: &'m Model,
    kv: KvStorage,
    table: Vec<u32>,
    capacity: usize,
    tokens: Vec<u32>,
    /// Tokens whose K/V are in the storage.
    computed: usize,
    use_kv_cache: bool,
}

impl<'m> SoloRun<'m> {
    /// Storage for `prompt` and `max_new_tokens` more, in blocks of `block_size` tokens of `kv_dtype`.
    pub fn new(
        model: &'m Model,
        prompt: &[u32],
        max_new_tokens: usize,
        kv_dtype: KvDtype,
        block_size: usize,
        use_kv_cache: bool,
    ) -> Result<Self> {
        if prompt.is_empty() {
            return Err(ModelError::Config("the prompt holds no token".into()));
        }
        let capacity = prompt
            .len()
            .checked_add(max_new_tokens)
            .filter(|&n| n <= model.config().max_context)
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "a prompt of {} tokens and {max_new_tokens} more exceed the model's context of {}",
                    prompt.len(),
                    model.config().max_context
                ))
            })?;
        let layout = model.kv_layout(kv_dtype, block_size)?;
        let blocks = capacity.div_ceil(block_size);
        let kv = model.kv_storage(&layout, blocks)?;
        Ok(Self {
            model,
            kv,
            table: (0..blocks as u32).collect(),
            capacity,
            tokens: prompt.to_vec(),
            computed: 0,
            use_kv_cache,
        })
    }

    /// Computes the tokens not yet computed; returns the logits of the last position (one row).
    pub fn next_logits(&mut self) -> Result<Logits> {
        let start = if self.use_kv_cache { self.computed } else { 0 };
        let start = start.min(self.tokens.len() - 1);
        let logits = self.model.forward(
            &[SeqBatchItem {
                tokens: &self.tokens[start..],
                start_pos: start,
                block_table: &self.table,
            }],
            &mut self.kv,
        )?;
        self.computed = self.tokens.len();
        Ok(logits)
    }

    /// Appends a token (the one sampled from the last logits); the next call computes it.
    pub fn push(&mut self, token: u32) -> Result<()> {
        if self.tokens.len() >= self.capacity {
            return Err(ModelError::Config(format!(
                "the run holds {} tokens, as many as it was made for",
                self.capacity
            )));
        }
        self.tokens.push(token);
        Ok(())
    }

    /// The prompt and every token pushed since.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}
