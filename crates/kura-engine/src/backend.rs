//! The two seams between the engine and a model: [`TextCodec`] (tokenizer and chat template, shared
//! with the HTTP threads; `kura-text`'s) and [`Executor`] (the forward pass over paged KV, owned by the
//! engine thread).
//!
//! The engine never looks inside a model: it hands the executor a batch of (new tokens, first position,
//! block table) and gets back, for each item's last position, what its sequence takes of it ([`Want`]:
//! nothing, the most likely token, or the row of logits). The engine links no model
//! runtime: `kura-model`'s `ModelExecutor` (the CPU forward pass) and `kura-cuda`'s `CudaExecutor`
//! implement [`Executor`]; tests adapt small deterministic models.

pub use kura_text::{ChatMessage, TextCodec};

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

impl<'a> SeqInput<'a> {
    /// An item over a pool addressed by block ids (no layer pages).
    pub fn new(tokens: &'a [u32], start_pos: usize, block_table: &'a [u32]) -> Self {
        SeqInput {
            tokens,
            start_pos,
            block_table,
            layer_pages: &[],
        }
    }
}

/// Why an [`Executor`] could not do what the engine asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExecError {
    /// This step cannot run as asked (a batch the executor refuses, device memory short for this
    /// step), and the executor is as it was: the engine fails the step's requests and goes on.
    #[error("{0}")]
    Step(String),
    /// The executor can no longer compute, or what its pool holds is no longer known (on a GPU, a fault
    /// that leaves the CUDA context unusable: an illegal address, a failed launch). The engine ends as
    /// after a panic in its loop: every request fails with the message, new ones are refused, and
    /// `kura serve` exits, so that whatever supervises it starts a fresh process instead of a server
    /// that fails every request while its health check says it is well. A block copy's error is taken
    /// as fatal whatever its kind: the engine's record of that block would no longer be true.
    #[error("{0}")]
    Fatal(String),
}

/// The payload with which the engine's loop unwinds after an executor error it cannot go on after
/// (an [`ExecError::Fatal`] of a step, any error of a block copy): the loop's catch handles it as a
/// panic (every request fails, new ones are refused, the failure is recorded), with the executor's
/// message and without a panic's report (`resume_unwind` skips the panic hook).
pub(crate) struct ExecutorFailed(pub String);

/// Ends the engine loop ([`ExecutorFailed`]) after the executor failed at `what` the engine asked for.
pub(crate) fn executor_failed(what: &str, e: &ExecError) -> ! {
    std::panic::resume_unwind(Box::new(ExecutorFailed(format!("{what}: {e}"))))
}

/// Ends the engine loop on an executor error ([`executor_failed`]).
pub(crate) trait OrEnd<T> {
    /// The value, or the end of the loop, naming `what` the engine asked for.
    fn or_end(self, what: &str) -> T;
}

impl<T> OrEnd<T> for Result<T, ExecError> {
    fn or_end(self, what: &str) -> T {
        self.unwrap_or_else(|e| executor_failed(what, &e))
    }
}

/// What the engine takes from an item's last position after a step ([`Executor::forward_rows`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Nothing: a prefill chunk with more of its prompt to compute before its first token.
    Nothing,
    /// The most likely token only, as [`crate::sampling::argmax`] finds it (the first on ties): a
    /// greedy sampler without penalties, logprobs or a grammar. An executor on an accelerator finds it
    /// there and copies back one id instead of a row of logits.
    Argmax,
    /// The whole row of logits: a sampler that draws, penalises, reports logprobs or follows a grammar.
    Logits,
}

impl Want {
    /// Whether `row` answers this: anything answers [`Want::Nothing`], a token or the row of logits
    /// [`Want::Argmax`], only the row of logits [`Want::Logits`]. The engine ends (as on a fatal
    /// executor error) on any other answer.
    pub fn answered_by(self, row: &Row) -> bool {
        matches!(
            (self, row),
            (Want::Nothing, _)
                | (Want::Argmax, Row::Token(_) | Row::Logits(_))
                | (Want::Logits, Row::Logits(_))
        )
    }
}

/// Why `rows` do not answer `wants`, item by item: a count that differs, or an answer that gives less
/// than asked ([`Want::answered_by`]).
pub(crate) fn unanswered(wants: &[Want], rows: &[Row]) -> Option<String> {
    if rows.len() != wants.len() {
        return Some(format!(
            "the executor answered {} of a step's {} items",
            rows.len(),
            wants.len()
        ));
    }
    let i = wants
        .iter()
        .zip(rows)
        .position(|(w, r)| !w.answered_by(r))?;
    Some(format!(
        "the executor answered item {i}'s {:?} with {:?}",
        wants[i], rows[i]
    ))
}

/// Why `tails` (rows per item, [`Executor::forward_tails`]) do not fit `batch` and `wants`.
pub fn check_tails(
    batch: &[SeqInput<'_>],
    wants: &[Want],
    tails: &[usize],
) -> Result<(), ExecError> {
    if wants.len() != batch.len() || tails.len() != batch.len() {
        return Err(ExecError::Step(format!(
            "{} answers and {} row counts asked of a step of {} items",
            wants.len(),
            tails.len(),
            batch.len()
        )));
    }
    if let Some(i) = (0..batch.len()).find(|&i| tails[i] == 0 || tails[i] > batch[i].tokens.len()) {
        return Err(ExecError::Step(format!(
            "{} rows asked of item {i} of {} tokens",
            tails[i],
            batch[i].tokens.len()
        )));
    }
    Ok(())
}

/// One item's answer to its [`Want`].
#[derive(Debug, Clone, PartialEq)]
pub enum Row {
    Nothing,
    Token(u32),
    Logits(Logits),
}

impl Row {
    /// The answer to `want` from the item's row of `logits`, computed on the host: what
    /// [`Executor::forward_rows`]'s default gives.
    pub fn answering(want: Want, logits: Vec<f32>) -> Row {
        match want {
            Want::Nothing => Row::Nothing,
            Want::Argmax => Row::Token(crate::sampling::argmax(&logits)),
            Want::Logits => Row::Logits(logits.into()),
        }
    }

    /// The row of logits, when it was asked for.
    pub fn logits(&self) -> Option<&[f32]> {
        match self {
            Row::Logits(l) => Some(l),
            Row::Nothing | Row::Token(_) => None,
        }
    }
}

/// Rows of logits in memory an executor keeps (on an accelerator, the page-locked host memory the
/// device copied a step's rows into), shared by that step's [`Logits`] without a copy.
pub trait HostRows: Send + Sync {
    fn values(&self) -> &[f32];
}

/// One item's row of logits: its own, or a range of rows shared with the others of its step
/// ([`HostRows`]): copying each row of a batch of 64 out of one buffer of 33 MB would take the engine
/// thread milliseconds a step. The executor that shares rows writes their buffer again only once the
/// engine has dropped them (an `Arc` no longer shared).
#[derive(Clone)]
pub struct Logits(Held);

#[derive(Clone)]
enum Held {
    Own(Vec<f32>),
    Shared(std::sync::Arc<dyn HostRows>, std::ops::Range<usize>),
}

impl Logits {
    /// Values `range` of `rows`. Fails where the range is not within them.
    pub fn shared(
        rows: std::sync::Arc<dyn HostRows>,
        range: std::ops::Range<usize>,
    ) -> Result<Self, ExecError> {
        if range.start > range.end || range.end > rows.values().len() {
            return Err(ExecError::Step(format!(
                "logits {range:?} of a buffer of {} values",
                rows.values().len()
            )));
        }
        Ok(Logits(Held::Shared(rows, range)))
    }
}

impl From<Vec<f32>> for Logits {
    fn from(v: Vec<f32>) -> Self {
        Logits(Held::Own(v))
    }
}

impl std::ops::Deref for Logits {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match &self.0 {
            Held::Own(v) => v,
            Held::Shared(rows, range) => &rows.values()[range.clone()],
        }
    }
}

impl PartialEq for Logits {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for Logits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Logits({} values)", self.len())
    }
}

/// The forward pass over paged KV, and the block copies that copy-on-write needs.
pub trait Executor: Send + 'static {
    /// Writes K/V of every item's tokens into its blocks and returns, per item, the logits of its last
    /// token (`vocab_size` values each).
    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<Vec<Vec<f32>>, ExecError>;
    /// [`Executor::forward`], answering each item as `wants` (one per item) asks: what the engine
    /// calls. The default computes every row's logits and answers on the host; an executor on an
    /// accelerator chooses greedy tokens on the device and copies back only the rows asked for (a
    /// batch of 64 greedy sequences of a 128,000-token vocabulary copies 256 bytes, not 33 MB). An
    /// answer may give more than asked, never less ([`Want::answered_by`]); a token given for
    /// [`Want::Argmax`] is the one [`crate::sampling::argmax`] finds in the row.
    fn forward_rows(
        &mut self,
        batch: &[SeqInput<'_>],
        wants: &[Want],
    ) -> Result<Vec<Row>, ExecError> {
        if wants.len() != batch.len() {
            return Err(ExecError::Step(format!(
                "{} answers asked of a step of {} items",
                wants.len(),
                batch.len()
            )));
        }
        use rayon::prelude::*;
        let rows = self.forward(batch)?;
        // The argmaxes of a batch at once, on the compute pool's threads (a pass over a row each).
        Ok(rows
            .into_par_iter()
            .zip(wants)
            .map(|(logits, &want)| Row::answering(want, logits))
            .collect())
    }
    /// [`Executor::forward_rows`], answering for item `i` its last `tails[i]` positions (at least 1:
    /// its last) as `wants[i]` asks, in position order: what checking a draft needs (speculative
    /// decoding, [`crate::NgramDraft`]: the draft's tokens sit at an item's end, and each position's
    /// logits give the token that follows it). Each row is the one [`Executor::forward_rows`] would
    /// give that position as an item's last (a step gives a token the same bits whatever else it
    /// computes). The default runs the items with one row through [`Executor::forward_rows`] and each
    /// other item through [`Executor::forward_every_position`]; an executor that can batches them.
    fn forward_tails(
        &mut self,
        batch: &[SeqInput<'_>],
        wants: &[Want],
        tails: &[usize],
    ) -> Result<Vec<Vec<Row>>, ExecError> {
        check_tails(batch, wants, tails)?;
        let lone: Vec<usize> = (0..batch.len()).filter(|&i| tails[i] <= 1).collect();
        let lone_batch: Vec<SeqInput<'_>> = lone.iter().map(|&i| batch[i]).collect();
        let lone_wants: Vec<Want> = lone.iter().map(|&i| wants[i]).collect();
        let mut lone_rows = if lone.is_empty() {
            Vec::new()
        } else {
            self.forward_rows(&lone_batch, &lone_wants)?
        }
        .into_iter();
        let mut out = Vec::with_capacity(batch.len());
        for (i, item) in batch.iter().enumerate() {
            if tails[i] <= 1 {
                let row = lone_rows.next().ok_or_else(|| {
                    ExecError::Fatal("the executor answered fewer items than asked".into())
                })?;
                out.push(vec![row]);
                continue;
            }
            let logits = self.forward_every_position(*item)?;
            let vocab = logits.len() / item.tokens.len().max(1);
            if vocab == 0 || logits.len() != vocab * item.tokens.len() {
                return Err(ExecError::Fatal(format!(
                    "{} logits for an item of {} tokens",
                    logits.len(),
                    item.tokens.len()
                )));
            }
            let first = item.tokens.len() - tails[i];
            out.push(
                logits[first * vocab..]
                    .chunks(vocab)
                    .map(|row| Row::answering(wants[i], row.to_vec()))
                    .collect(),
            );
        }
        Ok(out)
    }
    /// Writes K/V of one item's tokens, as [`Executor::forward`], and returns the logits of every one
    /// of them, `tokens × vocab_size` row by row: what scoring a prompt needs
    /// ([`crate::GenerateRequest::prompt_logprobs`]). The engine keeps such an item to a few thousand
    /// rows ([`crate::engine`]'s `SCORE_ROWS_BYTES`). An executor that cannot answers
    /// [`ExecError::Step`], and the request fails with its message.
    fn forward_every_position(&mut self, item: SeqInput<'_>) -> Result<Vec<f32>, ExecError> {
        let _ = item;
        Err(ExecError::Step(
            "this executor does not give every position's logits, which a prompt's \
             log-probabilities need"
                .into(),
        ))
    }
    /// Copies the K/V of the first `num_tokens` token slots of block `src` into block `dst`.
    fn copy_block_prefix(&mut self, src: u32, dst: u32, num_tokens: usize)
        -> Result<(), ExecError>;
    /// Bytes of one block's KV as [`Executor::export_block`] writes them; 0 (the default) for an executor
    /// that keeps no KV bytes the engine could move, which then refuses lower tiers at start.
    fn block_bytes(&self) -> usize {
        0
    }
    /// Copies block `block`'s KV into `out` (`block_bytes()` long): the one seam through which a block
    /// leaves the pool for a lower tier (on an accelerator, a device-to-host copy).
    fn export_block(&self, block: u32, out: &mut [u8]) -> Result<(), ExecError> {
        let _ = (block, out);
        Err(ExecError::Fatal(
            "export_block called on an executor whose block_bytes() is 0".into(),
        ))
    }
    /// Overwrites block `block`'s KV with `bytes`, as [`Executor::export_block`] wrote them.
    fn import_block(&mut self, block: u32, bytes: &[u8]) -> Result<(), ExecError> {
        let _ = (block, bytes);
        Err(ExecError::Fatal(
            "import_block called on an executor whose block_bytes() is 0".into(),
        ))
    }
    /// Starts overwriting block `block`'s KV with `bytes`, a slot of the host region offered to
    /// [`Executor::register_host_region`], without waiting for the copy, and returns `true`; or returns
    /// `false` (the default) where this executor copies synchronously only, and the engine calls
    /// [`Executor::import_block`] instead. Until [`Executor::imports_done`] reports the block, the engine
    /// schedules nothing that reads or writes it and nothing writes those bytes (the host slot stays
    /// reserved for the load): on an accelerator the copy runs beside the forward passes of requests
    /// that do not wait for it. An executor that overrides it overrides [`Executor::imports_done`] too:
    /// a started import that is never reported keeps its request (and a stop) waiting.
    fn start_import(&mut self, block: u32, bytes: &[u8]) -> Result<bool, ExecError> {
        let _ = (block, bytes);
        Ok(false)
    }
    /// Appends to `done` the blocks whose started imports have finished, in the order they were
    /// started, each with how long its copy took; when none has finished and some are under way, waits
    /// for one at most `wait`.
    fn imports_done(
        &mut self,
        wait: std::time::Duration,
        done: &mut Vec<(u32, std::time::Duration)>,
    ) -> Result<(), ExecError> {
        let _ = (wait, done);
        Ok(())
    }
    /// Whether the imports this executor starts are ordered before everything it does after them, layer
    /// by layer: a step whose block tables hold a block still being imported waits, on the device, for
    /// each layer's bytes of it before that layer's attention, so that earlier layers compute while later
    /// ones arrive; a block copy or export of such a block waits for all of it. The engine then takes a
    /// started import as landed at once and schedules the requests that want the block without waiting
    /// for the copy; [`Executor::imports_done`] still reports each import once, with its copy's time,
    /// for the tier cost check. The host slot is read until then, and written again only through
    /// [`Executor::start_export`], which the executor orders after the imports started before it: an
    /// executor that returns `true` here starts exports into every region it starts imports from (the
    /// engine's fallback, a synchronous [`Executor::export_block`] into the slot, would race the
    /// copy). The default is `false`: the engine waits for [`Executor::imports_done`].
    fn imports_ordered(&self) -> bool {
        false
    }
    /// Starts copying block `block`'s KV into `out`, a slot of the host region offered to
    /// [`Executor::register_host_region`], without waiting for the copy, and returns `true`; or returns
    /// `false` (the default) where this executor copies synchronously only, and the engine calls
    /// [`Executor::export_block`] instead. The executor orders whatever it is asked to do afterwards
    /// (a step that overwrites the block, a load of the same slot) after the copy; the engine reads
    /// `out` only after [`Executor::exports_fence`]. On an accelerator the host goes on at once (the
    /// engine schedules and uploads the next step while the copy runs); the next step's work on the
    /// device waits for the copy, since it may write the block.
    fn start_export(&mut self, block: u32, out: &mut [u8]) -> Result<bool, ExecError> {
        let _ = (block, out);
        Ok(false)
    }
    /// Waits until every export started by [`Executor::start_export`] has landed in host memory.
    fn exports_fence(&mut self) -> Result<(), ExecError> {
        Ok(())
    }
    /// Waits until the exports started into `slot` (a slot of the host region, as given to
    /// [`Executor::start_export`]) have landed in host memory; exports into other slots may go on.
    /// The default waits for every export ([`Executor::exports_fence`]).
    fn exports_fence_slot(&mut self, slot: &[u8]) -> Result<(), ExecError> {
        let _ = slot;
        self.exports_fence()
    }
    /// Offers the host tier's bytes, which blocks are exported to and imported from, to the executor
    /// before the first step. The region outlives the executor and never moves. An executor whose pool
    /// is on an accelerator may pin its pages, so that each block's copy runs at the bus's speed instead
    /// of being staged through a bounce buffer; it returns whether it did. The default does nothing.
    fn register_host_region(&mut self, region: &mut [u8]) -> bool {
        let _ = region;
        false
    }
}
