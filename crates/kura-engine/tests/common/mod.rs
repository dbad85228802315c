//! A deterministic stand-in model for the engine tests: milliseconds per test, no download. Its next token
//! depends on every earlier token as read back through the block table and on the position, so any mix-up
//! of positions, block tables or copied blocks changes the output. A [`Control`] lets a test hold the
//! engine inside a chosen forward call (to submit something while a request is known to be running),
//! make a chosen call panic or return an error (a kernel fault, a refused batch), or make any of its
//! block copies fail ([`Op`]: a device fault during a copy).

#![allow(dead_code)]

use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use kura_engine::{
    start_engine, ChatMessage, EngineConfig, EngineEvent, EngineHandle, ExecError, Executor,
    GenerateRequest, RequestError, RequestGuard, Row, SeqInput, TextCodec, Usage, Want,
};

pub const VOCAB: usize = 64;
pub const BLOCK: usize = 4;
/// How long a test waits for the engine before it fails (a hang is a failure, not a timing check).
pub const PATIENCE: Duration = Duration::from_secs(30);

/// What one forward call contained: per item, (first position, number of tokens).
pub type Batch = Vec<(usize, usize)>;

#[derive(Default)]
struct ControlState {
    calls: usize,
    /// Calls for every position's logits (a prompt scored): each one's first position and tokens.
    every_position: Vec<(usize, usize)>,
    hold_at: Option<usize>,
    holding: bool,
    panic_at: Option<usize>,
    /// A forward call that returns this error instead of computing.
    fail_at: Option<(usize, ExecError)>,
    /// Executor calls that fail with a fatal error ([`Control::fail`]).
    failing: Vec<Op>,
    /// Bytes of the host region the engine offered ([`Executor::register_host_region`]).
    host_region: Option<usize>,
    /// Whether host-tier loads are copied asynchronously ([`Executor::start_import`]).
    async_imports: bool,
    /// Whether started imports are kept from finishing.
    imports_held: bool,
    /// Imports started so far.
    imports_started: usize,
    /// Whether started imports are ordered before every later call ([`Executor::imports_ordered`]).
    ordered_imports: bool,
    /// Started imports reported through [`Executor::imports_done`] so far.
    imports_reported: usize,
    /// Forward calls that read a block whose import had not been reported yet (ordered imports).
    steps_over_loads: usize,
    /// Whether exports into the host region are started and land at the next fence.
    async_exports: bool,
    /// Exports started so far.
    exports_started: usize,
    /// Fences of every export ([`Executor::exports_fence`]), and fences of one slot's that left
    /// exports into other slots copying ([`Executor::exports_fence_slot`]).
    whole_fences: usize,
    slot_fences_past_others: usize,
    /// What each forward call was asked to answer, item by item ([`Executor::forward_rows`]).
    wants: Vec<Vec<Want>>,
    /// Whether forward calls answer every item with its row of logits, whatever was asked.
    every_row: bool,
    /// Whether forward calls answer a row of logits asked for with its argmax only (a broken executor).
    short_answers: bool,
}

impl ControlState {
    /// The error call `op` returns now, if it fails.
    fn fault(&self, op: Op) -> Result<(), ExecError> {
        if self.failing.contains(&op) {
            return Err(ExecError::Fatal(op.fault()));
        }
        Ok(())
    }
}

/// An executor call other than the forward pass, which [`Control::fail`] makes fail as it would on a
/// faulted device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A block import, synchronous (`import_block`) or started (`start_import`).
    Import,
    /// A synchronous block export (`export_block`).
    Export,
    /// The start of an asynchronous export (`start_export`).
    StartExport,
    /// The wait for started exports (`exports_fence`).
    Fence,
    /// The report of finished started imports (`imports_done`, when some are in flight).
    ImportsDone,
    /// A copy-on-write block copy (`copy_block_prefix`).
    Copy,
}

impl Op {
    /// What the fault's message names.
    pub fn what(self) -> &'static str {
        match self {
            Op::Import => "a block import",
            Op::Export => "a block export",
            Op::StartExport => "a started block export",
            Op::Fence => "the exports' fence",
            Op::ImportsDone => "the imports' report",
            Op::Copy => "a block copy",
        }
    }

    /// The error the call returns once it fails.
    pub fn fault(self) -> String {
        format!("fake device fault in {}", self.what())
    }
}

/// Steers the fake model's forward calls (numbered from 1).
#[derive(Default)]
pub struct Control {
    state: Mutex<ControlState>,
    changed: Condvar,
}

impl Control {
    /// Forward call `call` panics.
    pub fn panic_at(&self, call: usize) {
        self.state.lock().unwrap().panic_at = Some(call);
    }

    /// Forward call `call` returns `error` instead of computing.
    pub fn fail_at(&self, call: usize, error: ExecError) {
        self.state.lock().unwrap().fail_at = Some((call, error));
    }

    /// From now on every block import fails with a fatal error, as a copy on a faulted device does.
    pub fn fail_imports(&self) {
        self.fail(Op::Import);
    }

    /// From now on every call `op` fails with a fatal error ([`Op::fault`]).
    pub fn fail(&self, op: Op) {
        self.state.lock().unwrap().failing.push(op);
    }

    /// The error call `op` returns now, if it fails.
    fn fault(&self, op: Op) -> Result<(), ExecError> {
        self.state.lock().unwrap().fault(op)
    }

    /// Forward call `call` waits (before computing) until [`Control::release`].
    pub fn hold_at(&self, call: usize) {
        self.state.lock().unwrap().hold_at = Some(call);
    }

    /// Blocks until the engine sits in the held call.
    pub fn wait_held(&self) {
        let state = self.state.lock().unwrap();
        let (state, timeout) = self
            .changed
            .wait_timeout_while(state, PATIENCE, |s| !s.holding)
            .unwrap();
        assert!(
            !timeout.timed_out(),
            "the engine never reached forward call {:?}",
            state.hold_at
        );
    }

    pub fn release(&self) {
        self.state.lock().unwrap().hold_at = None;
        self.changed.notify_all();
    }

    /// From now on host-tier loads are started and finish later, as an accelerator's copies do: their
    /// bytes land only when the engine is told they finished.
    pub fn async_imports(&self) {
        self.state.lock().unwrap().async_imports = true;
    }

    /// From now on host-tier loads are started and ordered before every later call, as an accelerator
    /// orders its steps after the copies on the device: a forward call lands the imports started before
    /// it, while [`Executor::imports_done`] reports them only when not held.
    pub fn ordered_imports(&self) {
        let mut state = self.state.lock().unwrap();
        state.async_imports = true;
        state.ordered_imports = true;
    }

    /// Started imports reported through [`Executor::imports_done`] so far.
    pub fn imports_reported(&self) -> usize {
        self.state.lock().unwrap().imports_reported
    }

    /// Forward calls that read a block whose ordered import had not been reported yet.
    pub fn steps_over_loads(&self) -> usize {
        self.state.lock().unwrap().steps_over_loads
    }

    /// Started imports do not finish until [`Control::release_imports`] (ordered ones: are not
    /// reported until then).
    pub fn hold_imports(&self) {
        self.state.lock().unwrap().imports_held = true;
    }

    pub fn release_imports(&self) {
        self.state.lock().unwrap().imports_held = false;
        self.changed.notify_all();
    }

    /// From now on exports into the host region are started and land only when the engine fences them
    /// (until then the slot holds other bytes), as an accelerator's copies on their own stream do.
    pub fn async_exports(&self) {
        self.state.lock().unwrap().async_exports = true;
    }

    /// Exports started asynchronously so far.
    pub fn exports_started(&self) -> usize {
        self.state.lock().unwrap().exports_started
    }

    /// Fences of every export so far, and fences of one slot's that left other slots' copying.
    pub fn fences(&self) -> (usize, usize) {
        let s = self.state.lock().unwrap();
        (s.whole_fences, s.slot_fences_past_others)
    }

    /// Blocks until at least `n` imports have been started asynchronously.
    pub fn wait_imports_started(&self, n: usize) {
        let state = self.state.lock().unwrap();
        let (state, timeout) = self
            .changed
            .wait_timeout_while(state, PATIENCE, |s| s.imports_started < n)
            .unwrap();
        assert!(
            !timeout.timed_out(),
            "only {} of {n} imports were started",
            state.imports_started
        );
    }

    /// Imports started asynchronously so far.
    pub fn imports_started(&self) -> usize {
        self.state.lock().unwrap().imports_started
    }

    /// Bytes of the host region the engine offered the model, if it offered one.
    pub fn host_region(&self) -> Option<usize> {
        self.state.lock().unwrap().host_region
    }

    /// What each forward call so far was asked to answer, item by item.
    pub fn wants(&self) -> Vec<Vec<Want>> {
        self.state.lock().unwrap().wants.clone()
    }

    /// From now on forward calls answer every item with its row of logits, as an executor without a
    /// way to choose tokens itself would (more than the engine asks).
    pub fn answer_every_row(&self) {
        self.state.lock().unwrap().every_row = true;
    }

    /// From now on forward calls answer a row of logits asked for with its argmax only, as a broken
    /// executor would.
    pub fn answer_short(&self) {
        self.state.lock().unwrap().short_answers = true;
    }

    /// Calls for every position's logits so far: each one's first position and tokens.
    pub fn every_position_calls(&self) -> Vec<(usize, usize)> {
        self.state.lock().unwrap().every_position.clone()
    }

    /// Forward calls so far.
    pub fn calls(&self) -> usize {
        self.state.lock().unwrap().calls
    }

    /// Counts a forward call; panics, or returns the error it was told to, where asked.
    fn enter(&self) -> Result<(), ExecError> {
        let mut state = self.state.lock().unwrap();
        state.calls += 1;
        let call = state.calls;
        if state.panic_at == Some(call) {
            drop(state);
            panic!("fake kernel fault in forward call {call}");
        }
        if let Some((at, error)) = &state.fail_at {
            if *at == call {
                return Err(error.clone());
            }
        }
        if state.hold_at == Some(call) {
            state.holding = true;
            self.changed.notify_all();
            let mut state = self
                .changed
                .wait_while(state, |s| s.hold_at == Some(call))
                .unwrap();
            state.holding = false;
        }
        Ok(())
    }
}

pub struct FakeModel {
    batches: Arc<Mutex<Vec<Batch>>>,
    control: Arc<Control>,
    /// The token written at each (block, slot), to check that reads see what was written.
    kv: Vec<Option<u32>>,
    /// Imports started and not finished: (block, where its bytes are read from, how many, or the bytes
    /// of a store into that slot still under way, which the load follows).
    in_flight: Vec<(u32, *const u8, usize, Option<Vec<u8>>)>,
    /// Exports started and not landed: (where in the host region, the block's bytes when started).
    stores: Vec<(*mut u8, Vec<u8>)>,
    /// Ordered imports landed by a later call and not reported yet.
    landed: Vec<u32>,
}

// SAFETY: the pointers in `stores` and `in_flight` address the engine's host region, which outlives the
// model and is used through them only on the engine thread that owns the model.
unsafe impl Send for FakeModel {}

impl FakeModel {
    /// The bytes a started import writes: what the last store started into its slot wrote, or the
    /// slot's bytes now, as a device reads them while it copies (a slot the engine reused meanwhile
    /// would show).
    fn import_bytes(at: *const u8, len: usize, stored: &Option<Vec<u8>>) -> Vec<u8> {
        stored.clone().unwrap_or_else(|| {
            // SAFETY: a slot of the engine's host region, which outlives the model; the engine keeps
            // it unwritten until this load is reported (or, ordered, writes it only through a store
            // started after the load, which the load precedes).
            unsafe { std::slice::from_raw_parts(at, len) }.to_vec()
        })
    }

    /// With ordered imports: lands every started import before the call that comes after it, and
    /// returns the blocks it landed.
    fn land_ordered(&mut self) -> Vec<u32> {
        if !self.control.state.lock().unwrap().ordered_imports {
            return Vec::new();
        }
        let mut blocks = Vec::new();
        for (block, at, len, stored) in std::mem::take(&mut self.in_flight) {
            let bytes = Self::import_bytes(at, len, &stored);
            self.write_block(block, &bytes);
            blocks.push(block);
        }
        self.landed.extend(&blocks);
        blocks
    }

    /// Overwrites block `block` with `bytes` as `export_block` wrote them.
    fn write_block(&mut self, block: u32, bytes: &[u8]) {
        for (i, b) in bytes.chunks_exact(5).enumerate() {
            let token = u32::from_le_bytes(b[1..].try_into().unwrap());
            self.kv[block as usize * BLOCK + i] = (b[0] == 1).then_some(token);
        }
    }

    /// Lands the started exports in host memory.
    fn land_stores(&mut self) {
        for (at, bytes) in self.stores.drain(..) {
            // SAFETY: see `stores`: a live slot of the host region, `bytes.len()` long.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), at, bytes.len()) };
        }
    }
}

impl FakeModel {
    /// Writes an item's tokens into its slots.
    fn write(&mut self, s: &SeqInput<'_>) {
        for (i, &t) in s.tokens.iter().enumerate() {
            let pos = s.start_pos + i;
            let slot = s.block_table[pos / BLOCK] as usize * BLOCK + pos % BLOCK;
            self.kv[slot] = Some(t);
        }
    }

    /// The logits at position `last` of an item's sequence ([`fake_logits`]), reading every earlier
    /// token back through the block table.
    fn logits_at(&self, s: &SeqInput<'_>, last: usize) -> Vec<f32> {
        let tokens: Vec<u32> = (0..=last)
            .map(|p| {
                let slot = s.block_table[p / BLOCK] as usize * BLOCK + p % BLOCK;
                self.kv[slot].expect("every earlier position was written")
            })
            .collect();
        fake_logits(&tokens)
    }
}

/// The fake model's logits after `tokens` ("attention": their sum): 1 at one token, below a half
/// elsewhere, in a pattern that moves with the sum and the position (so that each position's
/// log-probabilities differ, not only its most likely token).
pub fn fake_logits(tokens: &[u32]) -> Vec<f32> {
    let sum = tokens.iter().sum::<u32>() as usize;
    let last = tokens.len() - 1;
    let mut logits: Vec<f32> = (0..VOCAB)
        .map(|i| ((i * 13 + sum + last * 5) % 17) as f32 / 34.0)
        .collect();
    logits[(sum * 7 + last) % (VOCAB - 1) + 1] = 1.0;
    logits
}

impl Executor for FakeModel {
    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<Vec<Vec<f32>>, ExecError> {
        self.control.enter()?;
        self.land_ordered();
        if batch
            .iter()
            .any(|s| s.block_table.iter().any(|b| self.landed.contains(b)))
        {
            self.control.state.lock().unwrap().steps_over_loads += 1;
        }
        self.batches.lock().unwrap().push(
            batch
                .iter()
                .map(|s| (s.start_pos, s.tokens.len()))
                .collect(),
        );
        Ok(batch
            .iter()
            .map(|s| {
                self.write(s);
                self.logits_at(s, s.start_pos + s.tokens.len() - 1)
            })
            .collect())
    }

    /// Every position's row, as `forward` gives the last one's.
    fn forward_every_position(&mut self, item: SeqInput<'_>) -> Result<Vec<f32>, ExecError> {
        self.control.enter()?;
        self.land_ordered();
        self.batches
            .lock()
            .unwrap()
            .push(vec![(item.start_pos, item.tokens.len())]);
        self.control
            .state
            .lock()
            .unwrap()
            .every_position
            .push((item.start_pos, item.tokens.len()));
        self.write(&item);
        let positions = item.start_pos..item.start_pos + item.tokens.len();
        Ok(positions.flat_map(|p| self.logits_at(&item, p)).collect())
    }

    /// Answers as asked (a token is the argmax of its row, as a device finds it), or with every row.
    fn forward_rows(
        &mut self,
        batch: &[SeqInput<'_>],
        wants: &[Want],
    ) -> Result<Vec<Row>, ExecError> {
        let (every_row, short) = {
            let mut state = self.control.state.lock().unwrap();
            state.wants.push(wants.to_vec());
            (state.every_row, state.short_answers)
        };
        assert_eq!(wants.len(), batch.len(), "one answer asked per item");
        let rows = self.forward(batch)?;
        Ok(rows
            .into_iter()
            .zip(wants)
            .map(|(logits, &want)| match want {
                _ if every_row => Row::Logits(logits.into()),
                Want::Logits if short => Row::answering(Want::Argmax, logits),
                _ => Row::answering(want, logits),
            })
            .collect())
    }

    fn copy_block_prefix(
        &mut self,
        src: u32,
        dst: u32,
        num_tokens: usize,
    ) -> Result<(), ExecError> {
        self.control.fault(Op::Copy)?;
        self.land_ordered();
        for i in 0..num_tokens {
            self.kv[dst as usize * BLOCK + i] = self.kv[src as usize * BLOCK + i];
        }
        Ok(())
    }

    /// A slot as 5 bytes: written or not, then the token (little-endian).
    fn block_bytes(&self) -> usize {
        BLOCK * 5
    }

    fn export_block(&self, block: u32, out: &mut [u8]) -> Result<(), ExecError> {
        self.control.fault(Op::Export)?;
        // An ordered import of the block still under way comes first.
        if let Some((_, at, len, stored)) = self.in_flight.iter().rev().find(|f| f.0 == block) {
            if self.control.state.lock().unwrap().ordered_imports {
                out.copy_from_slice(&Self::import_bytes(*at, *len, stored));
                return Ok(());
            }
        }
        for (i, o) in out.chunks_exact_mut(5).enumerate() {
            let slot = self.kv[block as usize * BLOCK + i];
            o[0] = u8::from(slot.is_some());
            o[1..].copy_from_slice(&slot.unwrap_or(0).to_le_bytes());
        }
        Ok(())
    }

    fn import_block(&mut self, block: u32, bytes: &[u8]) -> Result<(), ExecError> {
        self.control.fault(Op::Import)?;
        self.land_ordered();
        self.write_block(block, bytes);
        Ok(())
    }

    fn start_export(&mut self, block: u32, out: &mut [u8]) -> Result<bool, ExecError> {
        {
            let mut state = self.control.state.lock().unwrap();
            if !state.async_exports {
                return Ok(false);
            }
            state.fault(Op::StartExport)?;
            state.exports_started += 1;
        }
        self.land_ordered();
        let mut bytes = vec![0u8; out.len()];
        self.export_block(block, &mut bytes)?;
        // Not there yet: whoever reads the slot before the fence reads these.
        out.fill(0xEE);
        self.stores.push((out.as_mut_ptr(), bytes));
        Ok(true)
    }

    fn exports_fence(&mut self) -> Result<(), ExecError> {
        self.control.fault(Op::Fence)?;
        self.control.state.lock().unwrap().whole_fences += 1;
        self.land_stores();
        Ok(())
    }

    fn exports_fence_slot(&mut self, slot: &[u8]) -> Result<(), ExecError> {
        self.control.fault(Op::Fence)?;
        // Only that slot's stores: an engine that reads another slot after fencing this one reads
        // the 0xEE of a store not landed.
        let at = slot.as_ptr();
        let (this, others): (Vec<_>, Vec<_>) = self
            .stores
            .drain(..)
            .partition(|(p, _)| std::ptr::eq(*p as *const u8, at));
        if !others.is_empty() {
            self.control.state.lock().unwrap().slot_fences_past_others += 1;
        }
        self.stores = others;
        for (p, bytes) in this {
            // SAFETY: see `stores`: a live slot of the host region, `bytes.len()` long.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) };
        }
        Ok(())
    }

    fn start_import(&mut self, block: u32, bytes: &[u8]) -> Result<bool, ExecError> {
        let mut state = self.control.state.lock().unwrap();
        if !state.async_imports {
            return Ok(false);
        }
        state.fault(Op::Import)?;
        state.imports_started += 1;
        drop(state);
        self.control.changed.notify_all();
        // One stream: a load of a slot reads what the last store started into it wrote
        // (`import_bytes`).
        let stored = self
            .stores
            .iter()
            .rev()
            .find(|(at, _)| std::ptr::eq(*at as *const u8, bytes.as_ptr()))
            .map(|(_, b)| b.clone());
        self.in_flight
            .push((block, bytes.as_ptr(), bytes.len(), stored));
        Ok(true)
    }

    fn imports_ordered(&self) -> bool {
        self.control.state.lock().unwrap().ordered_imports
    }

    fn imports_done(
        &mut self,
        wait: Duration,
        done: &mut Vec<(u32, Duration)>,
    ) -> Result<(), ExecError> {
        if self.in_flight.is_empty() && self.landed.is_empty() {
            return Ok(());
        }
        self.control.fault(Op::ImportsDone)?;
        let state = self.control.state.lock().unwrap();
        let (state, _) = self
            .control
            .changed
            .wait_timeout_while(state, wait, |s| s.imports_held)
            .unwrap();
        if state.imports_held {
            return Ok(());
        }
        drop(state);
        let landed = std::mem::take(&mut self.landed);
        let mut blocks = landed;
        for (block, at, len, stored) in std::mem::take(&mut self.in_flight) {
            let bytes = Self::import_bytes(at, len, &stored);
            self.write_block(block, &bytes);
            blocks.push(block);
        }
        self.control.state.lock().unwrap().imports_reported += blocks.len();
        done.extend(blocks.into_iter().map(|b| (b, Duration::from_micros(1))));
        Ok(())
    }

    /// Takes the region as an accelerator would (pinning it); the test reads its size back.
    fn register_host_region(&mut self, region: &mut [u8]) -> bool {
        self.control.state.lock().unwrap().host_region = Some(region.len());
        true
    }
}

/// One character per token; token 0 is end-of-sequence.
pub struct Letters;

impl TextCodec for Letters {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        Ok(text.bytes().map(|b| u32::from(b) % VOCAB as u32).collect())
    }
    fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&i| char::from(b'0' + (i % 64) as u8))
            .collect()
    }
    /// Deliberately not the decoded text (and not UTF-8), so that tests see which one the engine reports.
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        vec![0xFF, id as u8]
    }
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String> {
        Ok(messages.iter().map(|m| m.content.as_str()).collect())
    }
    fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String> {
        self.encode(&self.render_chat(messages)?)
    }
    /// No special tokens: nothing to keep apart.
    fn chat_content_spans(
        &self,
        _text: &str,
        _from: usize,
        _messages: &[ChatMessage],
    ) -> Result<Vec<std::ops::Range<usize>>, String> {
        Ok(Vec::new())
    }
    fn encode_with_plain_spans(
        &self,
        text: &str,
        _plain: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>, String> {
        self.encode(text)
    }
    fn eos_token_ids(&self) -> &[u32] {
        &[0]
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
}

pub fn config(num_blocks: usize, budget: usize, max_num_seqs: usize) -> EngineConfig {
    EngineConfig {
        model_name: "fake".into(),
        max_model_len: 4096,
        block_size_tokens: BLOCK,
        num_blocks,
        max_num_seqs,
        max_num_batched_tokens: budget,
        max_queue: 100,
        enable_prefix_caching: true,
        model_fingerprint: "fake".into(),
        ..EngineConfig::default()
    }
}

/// `c` with a Redis tier at `url` (TTL 600 s, 5 s timeout), its records keyed by `secret`.
pub fn with_remote(mut c: EngineConfig, url: &str, secret: &kura_kv::hash::Secret) -> EngineConfig {
    c.remote = Some(kura_engine::RemoteTierSetup {
        url: url.to_string(),
        ttl_s: 600,
        timeout: Duration::from_secs(5),
        secret: secret.clone(),
        ca_file: None,
    });
    c
}

/// The engine on the fake model, what its forward calls contained, and its control.
pub struct Fake {
    pub engine: EngineHandle,
    pub batches: Arc<Mutex<Vec<Batch>>>,
    pub control: Arc<Control>,
}

pub fn start(config: EngineConfig) -> Fake {
    try_start(config).unwrap()
}

/// [`start`], or why the engine refused to start.
pub fn try_start(config: EngineConfig) -> Result<Fake, kura_engine::EngineStartError> {
    let batches = Arc::new(Mutex::new(Vec::new()));
    let control = Arc::new(Control::default());
    let model = FakeModel {
        batches: batches.clone(),
        control: control.clone(),
        kv: vec![None; config.num_blocks * BLOCK],
        in_flight: Vec::new(),
        stores: Vec::new(),
        landed: Vec::new(),
    };
    let engine = start_engine(config, Box::new(model), Arc::new(Letters))?;
    Ok(Fake {
        engine,
        batches,
        control,
    })
}

pub fn engine(
    num_blocks: usize,
    budget: usize,
    max_num_seqs: usize,
) -> (EngineHandle, Arc<Mutex<Vec<Batch>>>) {
    let fake = start(config(num_blocks, budget, max_num_seqs));
    (fake.engine, fake.batches)
}

pub fn submit(e: &EngineHandle, r: GenerateRequest) -> (RequestGuard, Receiver<EngineEvent>) {
    let (tx, rx) = mpsc::channel();
    let guard = e.submit(r, move |ev| tx.send(ev).is_ok()).unwrap();
    (guard, rx)
}

/// How a request ended, with every token it produced.
#[derive(Debug)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    pub result: Result<Usage, RequestError>,
}

/// The next event after the prompt's usage (`Prompted`, told before the first token).
pub fn next_output(rx: &Receiver<EngineEvent>) -> EngineEvent {
    loop {
        match rx.recv_timeout(PATIENCE).expect("the engine answers") {
            EngineEvent::Prompted { .. } => {}
            event => return event,
        }
    }
}

/// Also checks the prompt's usage: told once (`Prompted`) before the first token, as `Done` tells it.
pub fn outcome(rx: &Receiver<EngineEvent>) -> Outcome {
    let mut tokens = Vec::new();
    let mut prompted: Option<Usage> = None;
    loop {
        match rx.recv_timeout(PATIENCE).expect("the engine answers") {
            EngineEvent::Prompted { usage } => {
                assert!(prompted.is_none(), "the prompt's usage is told once");
                assert_eq!(usage.completion_tokens, 0, "{usage:?}");
                prompted = Some(usage);
            }
            EngineEvent::Delta { token_ids, .. } => {
                assert!(
                    prompted.is_some(),
                    "the prompt's usage comes before its first token"
                );
                tokens.extend(token_ids)
            }
            EngineEvent::Finished { .. } | EngineEvent::PromptLogprobs { .. } => {}
            EngineEvent::Done { usage } => {
                let told = prompted.expect("the prompt's usage was told before Done");
                assert_eq!(
                    Usage {
                        completion_tokens: 0,
                        ..usage
                    },
                    told,
                    "Prompted and Done tell the same prompt usage"
                );
                return Outcome {
                    tokens,
                    result: Ok(usage),
                };
            }
            EngineEvent::Failed(e) => {
                return Outcome {
                    tokens,
                    result: Err(e),
                }
            }
        }
    }
}

/// The tokens and usage of a request that must succeed.
pub fn wait(rx: &Receiver<EngineEvent>) -> (Vec<u32>, Usage) {
    let o = outcome(rx);
    match o.result {
        Ok(usage) => (o.tokens, usage),
        Err(e) => panic!("request failed: {e}"),
    }
}

/// A greedy request that ignores end-of-sequence (so it runs exactly `max_tokens` steps).
pub fn request(prompt_len: u32, max_tokens: u32) -> GenerateRequest {
    let mut r = GenerateRequest::greedy((1..=prompt_len).map(|i| i % 60 + 1).collect(), max_tokens);
    r.ignore_eos = true;
    r
}

/// Like [`request`], with a prompt of its own for each `seed` (no prefix shared with other seeds).
pub fn distinct_request(seed: u32, prompt_len: u32, max_tokens: u32) -> GenerateRequest {
    let prompt = (0..prompt_len)
        .map(|i| (i * 7 + seed * 13) % 60 + 1)
        .collect();
    let mut r = GenerateRequest::greedy(prompt, max_tokens);
    r.ignore_eos = true;
    r
}

pub fn metric(e: &EngineHandle, name: &str) -> f64 {
    let text = e.metrics().render_prometheus();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

/// Waits until the engine thread has published its gauges with nothing running and no block held.
pub fn settle(e: &EngineHandle) {
    let deadline = std::time::Instant::now() + PATIENCE;
    while metric(e, "kura:num_requests_running") != 0.0
        || metric(e, "kura:num_requests_waiting") != 0.0
        || metric(e, "kura:kv_cache_blocks_used") != 0.0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the engine never went idle: {}",
            e.metrics().render_prometheus()
        );
        // Poll interval: the deadline only turns a hang into a failure.
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Prompts of four families: a family's 10-token stem cut inside its second or third block, then a tail of
/// its own, so that a revisit or a sibling hits the stem's last whole blocks and copies a block it shares
/// only in part.
pub fn stem_prompts() -> Vec<GenerateRequest> {
    let mut out = Vec::new();
    for family in 0..4u32 {
        let stem: Vec<u32> = (0..10).map(|i| (i * 5 + family * 11) % 60 + 1).collect();
        for (j, cut) in [5usize, 6, 7, 9].into_iter().enumerate() {
            let mut prompt = stem[..cut].to_vec();
            prompt
                .extend((0..3 + j as u32).map(|i| (i * 3 + family * 17 + j as u32 * 29) % 60 + 1));
            let mut r = GenerateRequest::greedy(prompt, 5);
            r.ignore_eos = true;
            out.push(r);
        }
    }
    out
}

/// Each request's tokens computed cold, one at a time, in a pool that holds them all.
pub fn cold_tokens(requests: &[GenerateRequest]) -> Vec<Vec<u32>> {
    let fake = start(config(256, 64, 8));
    let out = requests
        .iter()
        .map(|r| {
            let (_guard, rx) = submit(&fake.engine, r.clone());
            wait(&rx).0
        })
        .collect();
    fake.engine.stop();
    out
}

/// Sends `requests` to `e` in waves of `wave_size` at once, `rounds` times in a different order each
/// round, and checks that each gives its `cold` tokens.
pub fn run_in_waves(
    e: &EngineHandle,
    requests: &[GenerateRequest],
    cold: &[Vec<u32>],
    wave_size: usize,
    rounds: usize,
) {
    for round in 0..rounds {
        let order: Vec<usize> = (0..requests.len())
            .map(|i| (i * 5 + round * 3) % requests.len())
            .collect();
        for wave in order.chunks(wave_size) {
            let pending: Vec<_> = wave
                .iter()
                .map(|&i| (i, submit(e, requests[i].clone())))
                .collect();
            for (i, (_guard, rx)) in pending {
                assert_eq!(
                    wait(&rx).0,
                    cold[i],
                    "waves of {wave_size}, round {round}, request {i}"
                );
            }
        }
    }
}

/// A walk that only counts (as a reasoning budget's does until it is spent): it masks nothing, so
/// its tokens are chosen as where no walk is (on the device, or drawn beside the batch's other
/// rows), and handed to it.
#[derive(Debug)]
pub struct Counting;

impl kura_engine::ConstraintSpec for Counting {
    fn start(&self) -> Result<Box<dyn kura_engine::TokenConstraint>, String> {
        Ok(Box::new(CountingWalk(0, usize::MAX)))
    }
}

/// [`Counting`] for its first this many tokens only (as a budget that is spent): after them its
/// walk still masks nothing, but asks for each row.
#[derive(Debug)]
pub struct CountingFor(pub usize);

impl kura_engine::ConstraintSpec for CountingFor {
    fn start(&self) -> Result<Box<dyn kura_engine::TokenConstraint>, String> {
        Ok(Box::new(CountingWalk(0, self.0)))
    }
}

/// Tokens accepted, and for how many the walk only counts.
struct CountingWalk(usize, usize);

impl kura_engine::TokenConstraint for CountingWalk {
    fn choose(
        &mut self,
        _budget: usize,
        sample: &mut dyn FnMut(&[u32]) -> u32,
    ) -> Result<u32, String> {
        // Every token of any vocabulary up to 2^18 (bits past a vocabulary's end are not read).
        Ok(sample(&[u32::MAX; 1 << 13]))
    }
    fn accept(&mut self, _token: u32) -> Result<(), String> {
        self.0 += 1;
        Ok(())
    }
    fn is_done(&self) -> bool {
        false
    }
    fn free_next(&self) -> bool {
        self.0 < self.1
    }
}
