//! The CPU runtime behind the engine's executor seam: [`ModelExecutor`] (the forward pass over a
//! [`KvStorage`] sized by the engine's pool). The tokenizer seam is `kura_text::ModelCodec`.

use std::sync::Arc;

use kura_engine::{check_tails, ExecError, Executor, Row, SeqInput, Want};
use kura_kv::storage::KvStorage;

use crate::{Model, SeqBatchItem};

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

fn batch_item<'a>(s: &SeqInput<'a>) -> SeqBatchItem<'a> {
    SeqBatchItem {
        tokens: s.tokens,
        start_pos: s.start_pos,
        block_table: s.block_table,
        layer_pages: s.layer_pages,
    }
}

impl Executor for ModelExecutor {
    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<Vec<Vec<f32>>, ExecError> {
        let items: Vec<SeqBatchItem<'_>> = batch.iter().map(batch_item).collect();
        let logits = self
            .model
            .forward(&items, &mut self.storage)
            .map_err(|e| ExecError::Step(e.to_string()))?;
        Ok((0..logits.num_rows())
            .map(|i| logits.row(i).to_vec())
            .collect())
    }

    fn forward_tails(
        &mut self,
        batch: &[SeqInput<'_>],
        wants: &[Want],
        tails: &[usize],
    ) -> Result<Vec<Vec<Row>>, ExecError> {
        use rayon::prelude::*;
        check_tails(batch, wants, tails)?;
        let items: Vec<SeqBatchItem<'_>> = batch.iter().map(batch_item).collect();
        let logits = self
            .model
            .forward_tails(&items, &mut self.storage, tails)
            .map_err(|e| ExecError::Step(e.to_string()))?;
        // Each row answered on the compute pool's threads (an argmax is a pass over the row).
        let want_of: Vec<Want> = wants
            .iter()
            .zip(tails)
            .flat_map(|(&w, &k)| std::iter::repeat_n(w, k))
            .collect();
        let rows: Vec<Row> = (0..logits.num_rows())
            .into_par_iter()
            .map(|i| Row::answering(want_of[i], logits.row(i).to_vec()))
            .collect();
        let mut rows = rows.into_iter();
        Ok(tails
            .iter()
            .map(|&k| rows.by_ref().take(k).collect())
            .collect())
    }

    fn forward_every_position(&mut self, item: SeqInput<'_>) -> Result<Vec<f32>, ExecError> {
        self.model
            .forward_every_position(&[batch_item(&item)], &mut self.storage)
            .map(|logits| logits.data)
            .map_err(|e| ExecError::Step(e.to_string()))
    }

    fn copy_block_prefix(
        &mut self,
        src: u32,
        dst: u32,
        num_tokens: usize,
    ) -> Result<(), ExecError> {
        self.storage
            .copy_block_prefix(src as usize, dst as usize, num_tokens)
            .map_err(|e| ExecError::Fatal(e.to_string()))
    }

    fn block_bytes(&self) -> usize {
        // The pool was allocated with this many bytes per block, so it fits in usize.
        self.storage.layout().bytes_per_block() as usize
    }

    fn export_block(&self, block: u32, out: &mut [u8]) -> Result<(), ExecError> {
        self.storage
            .export_block(block as usize, out)
            .map_err(|e| ExecError::Fatal(e.to_string()))
    }

    fn import_block(&mut self, block: u32, bytes: &[u8]) -> Result<(), ExecError> {
        self.storage
            .import_block(block as usize, bytes)
            .map_err(|e| ExecError::Fatal(e.to_string()))
    }
}
