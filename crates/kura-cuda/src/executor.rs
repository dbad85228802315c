//! [`CudaExecutor`]: the engine's [`Executor`] on a GPU. The KV pool is one device buffer of
//! `num_blocks` blocks laid out as the CPU pool exports them; a forward step packs the batch's tokens,
//! positions, write slots and block tables into one upload, then runs, per layer:
//!
//! ```text
//! x ─ rms_norm ─ ·Wqkvᵀ ─ rope_store (q; K, V into their blocks) ─ attention ─ ·Woᵀ (+= x)
//!   ─ rms_norm ─ ·W_gate_upᵀ ─ silu_mul ─ ·W_downᵀ (+= x)
//! ```
//!
//! and the output head on each sequence's last token. Attention takes two kernels: sequences with at
//! least [`PREFILL_MIN`] new tokens go through the tensor-core prefill kernel (tiles of 128 queries),
//! the others through the split-key kernel and its merge.

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use half::bf16;

use kura_checkpoint::config::rope_inv_freq;
use kura_checkpoint::{ModelConfig, ModelParts};
use kura_engine::{ExecError, Executor, HostRows, Logits, Row, SeqInput, Want};
use kura_kv::codec::KvDtype;

use crate::budget::{self, Dims, ACTIVATIONS};
use crate::device::{Arg, Device, PoolShape};
use crate::error::{CudaError, Result};
use crate::weights::DevWeights;

mod load_order;
mod store_order;
mod transfers;
mod tuning;
use transfers::HostLoads;
pub use tuning::{
    DecodeOptions, DecodeTuning, FormTiming, OptionTiming, PrefillTuning, Tuning, TUNE_TOKENS,
};

/// Sequences with at least this many new tokens take the prefill kernel.
pub const PREFILL_MIN: usize = 64;
/// Query rows of a prefill tile (`BR` in `kura.cu`).
const TILE: usize = 128;

/// The prefill attention kernels (`attn_prefill_*` in `kura.cu`), each over tiles of 128 query rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillKernel {
    /// 8 warps of 16 rows, a tile a block (the default).
    Narrow,
    /// 4 warps of 32 rows, the tile's queries in shared memory: each K and V fragment read from shared
    /// memory serves two row tiles. At a head size of 64 it gives `Narrow`'s bits; at 128 its key tiles
    /// are 32 keys, not 64, so its sums are rounded at other points.
    Wide,
    /// 4 warps of 16 rows, half a tile a block (two blocks a multiprocessor, each with its own key
    /// tiles and barriers): `Narrow`'s bits.
    Half,
    /// `Half` over `Wide`'s key tiles (32 keys at a head size of 128): 168 registers a thread, so three
    /// blocks share a multiprocessor on sm_90 (12 warps where the others have 8; two blocks on sm_80).
    /// `Wide`'s bits.
    Small,
    /// `Narrow` with three stages of K and V and one barrier a key tile (each tile's copy issued two
    /// tiles ahead of its products): `Narrow`'s bits. 102 KiB of shared memory at a head size of 128,
    /// more than a block may have on sm_86 and sm_89, where it is not loaded.
    Deep,
    /// `Half` with `Deep`'s three stages and one barrier: `Narrow`'s bits; two blocks share an sm_90
    /// multiprocessor (one on sm_80; not loaded on sm_86 and sm_89 at a head size of 128).
    HalfDeep,
    /// `Narrow` with its two products on Hopper's warpgroup instructions (`wgmma`, 8 and 4 of a
    /// warpgroup of 64 rows a key tile, reading K and V from shared memory, where each warp issued 64
    /// `mma.sync` and 32 `ldmatrix` for each); each warp keeps its rows, scores and softmax. The same
    /// products over the same k-steps in the same order: `Narrow`'s bits where the tensor cores round a
    /// warpgroup's k-step as they round `mma.sync`'s. Compute capability 9.0 only (the module is
    /// compiled for `sm_90a` there; elsewhere it is not loaded).
    Wg,
    /// `Half` on warpgroup products: a warpgroup a block, two blocks a multiprocessor. As `Wg`.
    HalfWg,
    /// `Wg` with each key tile's score product and softmax overlapping the value product of the tile
    /// before (FA3's overlap within a warpgroup: the tensor cores add P·V while the warp computes the
    /// next tile's exponentials), three stages of K and V (96 KiB at a head size of 128) and one
    /// barrier a key tile. `Wg`'s bits: the same products in the same order, each rescaling of the
    /// outputs between the same two.
    WgPipe,
    /// `HalfWg` with `WgPipe`'s overlap: two blocks a multiprocessor. As `WgPipe`.
    HalfWgPipe,
}

impl PrefillKernel {
    /// Every kernel, the default first.
    pub const ALL: [PrefillKernel; 10] = [
        Self::Narrow,
        Self::Wide,
        Self::Half,
        Self::Small,
        Self::Deep,
        Self::HalfDeep,
        Self::Wg,
        Self::HalfWg,
        Self::WgPipe,
        Self::HalfWgPipe,
    ];

    /// Its name in reports (`gpu-bench`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Narrow => "narrow",
            Self::Wide => "wide",
            Self::Half => "half",
            Self::Small => "small",
            Self::Deep => "deep",
            Self::HalfDeep => "halfdeep",
            Self::Wg => "wg",
            Self::HalfWg => "halfwg",
            Self::WgPipe => "wgpipe",
            Self::HalfWgPipe => "halfwgpipe",
        }
    }

    /// Whether its kernels exist only where the module is compiled for `sm_90a` (Hopper's warpgroup
    /// products).
    pub fn needs_sm90a(self) -> bool {
        matches!(
            self,
            Self::Wg | Self::HalfWg | Self::WgPipe | Self::HalfWgPipe
        )
    }

    /// Its kernel over a `kv` pool (`bf16`, `f32`, `fp8`) at head size `d`.
    pub fn kernel(self, kv: &str, d: usize) -> String {
        format!("attn_prefill_{}{kv}_{d}", self.prefix())
    }

    /// Keys of its key tiles at head size `d` (`BC`, or `WIDE_NK(d)` in `kura.cu`).
    pub(crate) fn keys(self, d: u32) -> u32 {
        match self {
            Self::Narrow
            | Self::Half
            | Self::Deep
            | Self::HalfDeep
            | Self::Wg
            | Self::HalfWg
            | Self::WgPipe
            | Self::HalfWgPipe => 64,
            Self::Wide | Self::Small if d > 64 => 32,
            Self::Wide | Self::Small => 64,
        }
    }

    /// Dynamic shared memory of its kernel at head size `d`: two stages (`Deep`, `HalfDeep`, `WgPipe`,
    /// `HalfWgPipe`: three) of K and V tiles of [`Self::keys`] rows of `d + 8` bf16 each (on warpgroup
    /// products: `d`, in core matrices), then (`Wide`) the tile's 128 query rows.
    pub(crate) fn shared_bytes(self, d: u32) -> u32 {
        let row = if self.needs_sm90a() {
            d * 2
        } else {
            (d + 8) * 2
        };
        let queries = if self == Self::Wide {
            TILE as u32 * row
        } else {
            0
        };
        let stages = match self {
            Self::Deep | Self::HalfDeep | Self::WgPipe | Self::HalfWgPipe => 3,
            _ => 2,
        };
        stages * 2 * self.keys(d) * row + queries
    }

    /// The part of its kernels' names after `attn_prefill_`.
    pub(crate) fn prefix(self) -> &'static str {
        match self {
            Self::Narrow => "",
            Self::Wide => "wide_",
            Self::Half => "half_",
            Self::Small => "small_",
            Self::Deep => "deep_",
            Self::HalfDeep => "halfdeep_",
            Self::Wg => "wg_",
            Self::HalfWg => "halfwg_",
            Self::WgPipe => "wgpipe_",
            Self::HalfWgPipe => "halfwgpipe_",
        }
    }

    fn threads(self) -> u32 {
        match self {
            Self::Narrow | Self::Deep | Self::Wg | Self::WgPipe => 256,
            Self::Wide
            | Self::Half
            | Self::Small
            | Self::HalfDeep
            | Self::HalfWg
            | Self::HalfWgPipe => 128,
        }
    }

    fn blocks_a_tile(self) -> usize {
        match self {
            Self::Narrow | Self::Wide | Self::Deep | Self::Wg | Self::WgPipe => 1,
            Self::Half | Self::Small | Self::HalfDeep | Self::HalfWg | Self::HalfWgPipe => 2,
        }
    }
}
/// Timing probes of the prefill attention (`attn_prefill_probe_*` in `kura.cu`, bf16 pools): the
/// `Narrow` kernel with one part left out, so that a device's profile says where its time goes (the
/// full kernel's time against each). Their outputs are not attention: only `gpu-bench` runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillProbe {
    /// Every key tile read from the first tile's shared-memory stage: no copy from the pool after it.
    NoLoad,
    /// No mask, maxima, exponentials or rescaling: the scores go to the second product as they are.
    NoSoftmax,
    /// The copies from the pool, their waits and the barriers alone.
    LoadOnly,
    /// The two products over the first tile's stage alone (neither copies nor softmax).
    MmaOnly,
}

impl PrefillProbe {
    pub const ALL: [PrefillProbe; 4] =
        [Self::NoLoad, Self::NoSoftmax, Self::LoadOnly, Self::MmaOnly];

    /// Its name in reports and in its kernels' names (`attn_prefill_probe_{name}_bf16_{d}`).
    pub fn name(self) -> &'static str {
        match self {
            Self::NoLoad => "noload",
            Self::NoSoftmax => "nosoftmax",
            Self::LoadOnly => "loadonly",
            Self::MmaOnly => "mmaonly",
        }
    }

    /// Its kernel at head size `d` (over a bf16 pool, the only one the probes are built for).
    pub(crate) fn kernel(self, d: usize) -> String {
        format!("attn_prefill_probe_{}_bf16_{d}", self.name())
    }
}

/// Keys of one split of the split-key kernel (`SPLIT` in `kura.cu`).
const SPLIT: usize = 128;
/// The most splits whose merge the split-key kernel's last block does itself in the fused decode path
/// ([`CudaExecutor::set_fused_decode`]): 4,096 keys.
const FUSED_MERGE_MAX_SPLITS: usize = 32;
/// Flags of the split-key kernel (`SPLIT_MERGE`, `SPLIT_PREFETCH` in `kura.cu`): its last block merges
/// the splits; each key's K and V rows are asked of L2 before they are read.
const SPLIT_MERGE: i32 = 1;
const SPLIT_PREFETCH: i32 = 2;

/// Logits of a row that one block of greedy sampling's first launch (`argmax_part`) reads: 32 blocks
/// for a 128,256-token vocabulary.
const ARGMAX_SEG: usize = 4096;

/// Segments of `ARGMAX_SEG` logits in a row of `vocab`.
fn argmax_segments(vocab: usize) -> usize {
    vocab.div_ceil(ARGMAX_SEG)
}

/// f32s of the attention partials that greedy sampling over `rows` rows of `vocab` logits takes: each
/// segment's largest and its index.
fn argmax_part_len(rows: usize, vocab: usize) -> usize {
    rows.saturating_mul(argmax_segments(vocab))
        .saturating_mul(2)
}

/// Per-step buffers, grown to the largest step seen.
struct Scratch {
    tokens: usize,
    rows: usize,
    x: CudaSlice<f32>,
    xn: CudaSlice<bf16>,
    qkv: CudaSlice<f32>,
    q: CudaSlice<bf16>,
    attn: CudaSlice<bf16>,
    gu: CudaSlice<f32>,
    act: CudaSlice<bf16>,
    /// RoPE cosines and sines of the step's tokens (`tokens × head_dim / 2`).
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    last: CudaSlice<bf16>,
    logits: CudaSlice<f32>,
    ids: CudaSlice<u32>,
    meta: CudaSlice<i32>,
    part: CudaSlice<f32>,
    /// Per (token of a wave, KV head): how many of the split-key kernel's blocks have written their
    /// partials, when the last one merges them ([`CudaExecutor::set_fused_decode`]). Zero between
    /// launches: the last block sets it back.
    arrive: CudaSlice<i32>,
    /// Every token's logits of a step that asks for them ([`CudaExecutor::forward_every_position`]).
    every: CudaSlice<f32>,
}

/// Grows `buf` to at least `n` elements, rounded up as [`budget::alloc_len`] rounds (its contents are
/// not kept).
fn ensure<T: DeviceRepr + ValidAsZeroBits>(
    dev: &Device,
    buf: &mut CudaSlice<T>,
    n: usize,
    what: &str,
) -> Result<()> {
    ensure_as(dev, buf, n, budget::alloc_len(n), what)
}

/// Makes `buf` `len` elements long when it holds fewer than `n` (its contents are not kept).
fn ensure_as<T: DeviceRepr + ValidAsZeroBits>(
    dev: &Device,
    buf: &mut CudaSlice<T>,
    n: usize,
    len: usize,
    what: &str,
) -> Result<()> {
    if buf.len() < n {
        // Free the old buffer before asking for the larger one.
        *buf = dev.alloc::<T>(1, what)?;
        *buf = dev.alloc::<T>(len, what)?;
    }
    Ok(())
}

impl Scratch {
    fn new(dev: &Device) -> Result<Self> {
        Ok(Scratch {
            tokens: 0,
            rows: 0,
            x: dev.alloc(1, "activations")?,
            xn: dev.alloc(1, "activations")?,
            qkv: dev.alloc(1, "activations")?,
            q: dev.alloc(1, "activations")?,
            attn: dev.alloc(1, "activations")?,
            gu: dev.alloc(1, "activations")?,
            act: dev.alloc(1, "activations")?,
            cos: dev.alloc(1, "activations")?,
            sin: dev.alloc(1, "activations")?,
            last: dev.alloc(1, "activations")?,
            logits: dev.alloc(1, "logits")?,
            ids: dev.alloc(1, "logits")?,
            meta: dev.alloc(1, "step metadata")?,
            part: dev.alloc(1, "attention partials")?,
            arrive: dev.alloc(1, "attention partials")?,
            every: dev.alloc(1, "logits")?,
        })
    }

    /// Makes room for steps of `t` new tokens over `n` sequences: each buffer of [`ACTIVATIONS`] grown
    /// for the next power of two of its rows, so that every smaller step fits too.
    fn grow(&mut self, dev: &Device, c: &ModelConfig, t: usize, n: usize) -> Result<()> {
        let d = Dims::of(c);
        let grown = budget::grow_step(self.tokens, self.rows, t, n);
        if (grown.tokens, grown.rows) != (self.tokens, self.rows) {
            // Until every buffer has grown, no step may count on the old sizes: an allocation that
            // fails leaves its buffer at one element, and the next step grows it again.
            (self.tokens, self.rows) = (0, 0);
        }
        for (which, rows) in grown.buffers() {
            match which {
                budget::X => ensure_buf(dev, &mut self.x, &d, which, rows)?,
                budget::XN => ensure_buf(dev, &mut self.xn, &d, which, rows)?,
                budget::QKV => ensure_buf(dev, &mut self.qkv, &d, which, rows)?,
                budget::Q => ensure_buf(dev, &mut self.q, &d, which, rows)?,
                budget::ATTN => ensure_buf(dev, &mut self.attn, &d, which, rows)?,
                budget::GU => ensure_buf(dev, &mut self.gu, &d, which, rows)?,
                budget::ACT => ensure_buf(dev, &mut self.act, &d, which, rows)?,
                budget::COS => ensure_buf(dev, &mut self.cos, &d, which, rows)?,
                budget::SIN => ensure_buf(dev, &mut self.sin, &d, which, rows)?,
                budget::LAST => ensure_buf(dev, &mut self.last, &d, which, rows)?,
                budget::LOGITS => ensure_buf(dev, &mut self.logits, &d, which, rows)?,
                budget::IDS => ensure_buf(dev, &mut self.ids, &d, which, rows)?,
                _ => unreachable!("ACTIVATIONS has {} buffers", ACTIVATIONS.len()),
            }
        }
        (self.tokens, self.rows) = (grown.tokens, grown.rows);
        Ok(())
    }
}

/// Grows buffer `which` of [`ACTIVATIONS`] for `rows` rows, to the length the table gives.
fn ensure_buf<T: DeviceRepr + ValidAsZeroBits>(
    dev: &Device,
    buf: &mut CudaSlice<T>,
    d: &Dims,
    which: usize,
    rows: usize,
) -> Result<()> {
    let b = &ACTIVATIONS[which];
    assert_eq!(
        std::mem::size_of::<T>(),
        b.elem_bytes,
        "the activation table's element size of {}",
        b.name
    );
    let what = if b.per == budget::Per::Seq && b.name != "last" {
        "logits"
    } else {
        "activations"
    };
    ensure(dev, buf, b.len(d, rows), what)
}

/// Host-side layout of a step, uploaded as one `i32` buffer (offsets in elements).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub meta: Vec<i32>,
    pub n_tokens: usize,
    pub n_seqs: usize,
    /// Rows the output head computes: one per sequence, or with tails ([`plan_tails`]) each sequence's
    /// last `tails[i]`. The per-sequence buffers (`last`, `logits`, `ids`) hold one row each.
    pub n_rows: usize,
    /// Offsets into `meta`.
    pub at_tokens: usize,
    pub at_pos: usize,
    pub at_slots: usize,
    pub at_tables: usize,
    pub at_last: usize,
    pub at_tok_info: usize,
    pub at_tiles: usize,
    /// Tokens of the split-key kernel, and its most splits.
    pub split_tokens: usize,
    pub max_splits: usize,
    /// Tiles of the prefill kernel.
    pub tiles: usize,
}

impl StepPlan {
    /// The pool block each new token's K and V are written to, in token order (a block once per token
    /// it receives): the blocks the step writes.
    pub fn blocks_written(&self) -> impl Iterator<Item = u32> + '_ {
        self.meta[self.at_slots..self.at_slots + 2 * self.n_tokens]
            .iter()
            .step_by(2)
            .map(|&b| b as u32)
    }
}

/// What the pool and model look like to [`plan_step`].
#[derive(Debug, Clone, Copy)]
pub struct StepLimits {
    pub block_size: usize,
    pub num_blocks: usize,
    pub vocab: usize,
    pub max_context: usize,
    pub window: Option<usize>,
    /// Sequences with at least this many new tokens take the prefill kernel ([`PREFILL_MIN`]).
    pub prefill_min: usize,
    /// The most new tokens of one step: the element-wise kernels index a step's rows with 32-bit
    /// integers (SiLU·mul: tokens × intermediate size).
    pub max_tokens: usize,
}

/// Checks a batch and lays out its metadata: every bad index is an error naming the sequence, never a
/// write outside the pool. The output head runs on each sequence's last token.
pub fn plan_step(batch: &[SeqInput<'_>], lim: StepLimits) -> Result<StepPlan> {
    plan_tails(batch, &vec![1; batch.len()], lim)
}

/// [`plan_step`], with the output head on the last `tails[i]` tokens of sequence `i` (at least 1, at
/// most its new tokens), in position order: the rows that check a draft (speculative decoding).
pub fn plan_tails(batch: &[SeqInput<'_>], tails: &[usize], lim: StepLimits) -> Result<StepPlan> {
    let bad = |m: String| Err(CudaError::Batch(m));
    if batch.is_empty() {
        return bad("the batch is empty".into());
    }
    if tails.len() != batch.len() {
        return bad(format!(
            "{} tails asked of a step of {} sequences",
            tails.len(),
            batch.len()
        ));
    }
    if let Some((i, (s, k))) = batch
        .iter()
        .zip(tails)
        .enumerate()
        .find(|(_, (s, &k))| !s.tokens.is_empty() && (k == 0 || k > s.tokens.len()))
    {
        return bad(format!(
            "sequence {i}: {k} rows of logits asked of its {} new tokens (1 to {0} may be)",
            s.tokens.len()
        ));
    }
    let bs = lim.block_size;
    let mut slots = std::collections::HashSet::new();
    for (i, s) in batch.iter().enumerate() {
        if s.tokens.is_empty() {
            return bad(format!("sequence {i} of the batch has no new tokens"));
        }
        if !s.layer_pages.is_empty() {
            return bad(format!(
                "sequence {i} comes with layer pages: the GPU pool holds whole-model blocks only"
            ));
        }
        let end = s.start_pos.saturating_add(s.tokens.len());
        if end > lim.max_context {
            return bad(format!(
                "sequence {i} reaches position {end}, beyond the model's context of {}",
                lim.max_context
            ));
        }
        let needed = end.div_ceil(bs);
        if s.block_table.len() < needed {
            return bad(format!(
                "sequence {i}: {} blocks of {bs} tokens cannot hold {end} positions",
                s.block_table.len()
            ));
        }
        if let Some(b) = s.block_table[..needed]
            .iter()
            .find(|b| **b as usize >= lim.num_blocks)
        {
            return bad(format!(
                "sequence {i}: block {b} is outside the pool of {} blocks",
                lim.num_blocks
            ));
        }
        if let Some(t) = s.tokens.iter().find(|t| **t as usize >= lim.vocab) {
            return bad(format!(
                "sequence {i}: token id {t} is outside the vocabulary of {}",
                lim.vocab
            ));
        }
        for p in s.start_pos..end {
            if !slots.insert((s.block_table[p / bs], p % bs)) {
                return bad(format!(
                    "sequence {i}: position {p} writes block {} slot {}, which another new token of the \
                     batch also writes",
                    s.block_table[p / bs],
                    p % bs
                ));
            }
        }
    }
    let t: usize = batch.iter().map(|s| s.tokens.len()).sum();
    if t > lim.max_tokens {
        return bad(format!(
            "a step of {t} new tokens is more than this model's kernels index (at most {})",
            lim.max_tokens
        ));
    }
    let table_len: usize = batch
        .iter()
        .map(|s| (s.start_pos + s.tokens.len()).div_ceil(bs))
        .sum();
    let mut tokens = Vec::with_capacity(t);
    let mut pos = Vec::with_capacity(t);
    let mut slot_block = Vec::with_capacity(2 * t);
    let mut tables = Vec::with_capacity(table_len);
    let n_rows: usize = tails.iter().sum();
    let mut last = Vec::with_capacity(n_rows);
    let mut tok_info = Vec::new();
    let mut tiles = Vec::new();
    let mut max_splits = 0;
    let mut row = 0usize;
    for (s, &tail) in batch.iter().zip(tails) {
        let n = s.tokens.len();
        let end = s.start_pos + n;
        let toff = tables.len();
        tables.extend(s.block_table[..end.div_ceil(bs)].iter().map(|b| *b as i32));
        for (i, tok) in s.tokens.iter().enumerate() {
            let position = s.start_pos + i;
            tokens.push(*tok as i32);
            pos.push(position as i32);
            slot_block.push(s.block_table[position / bs] as i32);
            slot_block.push((position % bs) as i32);
        }
        if n >= lim.prefill_min {
            for r0 in (0..n).step_by(TILE) {
                let rows = TILE.min(n - r0);
                tiles.extend([
                    (row + r0) as i32,
                    rows as i32,
                    (s.start_pos + r0) as i32,
                    toff as i32,
                ]);
            }
        } else {
            for i in 0..n {
                let qpos = s.start_pos + i;
                let lo = lim.window.map_or(0, |w| (qpos + 1).saturating_sub(w));
                max_splits = usize::max(max_splits, (qpos + 1 - lo).div_ceil(SPLIT));
                tok_info.extend([(row + i) as i32, qpos as i32, toff as i32, lo as i32]);
            }
        }
        row += n;
        last.extend((row - tail..row).map(|r| r as i32));
    }
    // Every offset but the tables' depends on the step's shape alone (a captured graph's arguments).
    let mut p = StepPlan {
        n_tokens: t,
        n_seqs: batch.len(),
        n_rows,
        at_tokens: 0,
        at_pos: t,
        at_slots: 2 * t,
        at_last: 4 * t,
        at_tok_info: 4 * t + n_rows,
        at_tiles: 4 * t + n_rows + tok_info.len(),
        at_tables: 4 * t + n_rows + tok_info.len() + tiles.len(),
        split_tokens: tok_info.len() / 4,
        // Rounded up to a power of two: fewer shapes for the graphs of decode steps (the extra splits
        // of a token are empty).
        max_splits: if max_splits == 0 {
            0
        } else {
            max_splits.next_power_of_two()
        },
        tiles: tiles.len() / 4,
        ..Default::default()
    };
    let mut meta = tokens;
    meta.extend(pos);
    meta.extend(slot_block);
    meta.extend(last);
    meta.extend(tok_info);
    meta.extend(tiles);
    meta.extend(tables);
    p.meta = meta;
    Ok(p)
}

/// The forward pass of a Llama-family model on a GPU, over a KV pool in device memory.
pub struct CudaExecutor {
    /// Copies between the pool and the host tier under way; declared first so that it is dropped
    /// (waiting for its copies) before the device unpins the host region they use.
    loads: Option<HostLoads>,
    /// Page-locked host memory that rows of logits the engine asks for land in
    /// ([`CudaExecutor::forward_rows`]): a copy from device memory into it runs at the bus's speed, into
    /// pageable memory at a fraction of it. Grown with the steps' rows; dropped before the device.
    host_logits: Option<std::sync::Arc<PinnedRows>>,
    dev: Device,
    cfg: ModelConfig,
    w: DevWeights,
    inv_freq: CudaSlice<f32>,
    pool: CudaSlice<u8>,
    shape: PoolShape,
    kv_dtype: KvDtype,
    num_blocks: usize,
    block_bytes: usize,
    s: Scratch,
    prefill_min: usize,
    /// Captured decode steps by shape (tokens, sequences, split tokens, splits).
    graphs: Graphs,
    use_graphs: bool,
    use_dependent: bool,
    /// Bytes the split-key kernel's partials may take at once ([`PART_CAP_BYTES`]).
    part_cap: usize,
    mask_all_tiles: bool,
    /// The prefill attention kernel ([`PrefillKernel`]).
    prefill_kernel: PrefillKernel,
    /// A timing probe in place of the prefill kernel ([`PrefillProbe`]; none by default).
    prefill_probe: Option<PrefillProbe>,
    /// Whether the split-key attention merges its splits itself and prefetches K and V
    /// ([`CudaExecutor::set_fused_decode`]).
    fused_attention: bool,
    /// The split-key kernel asks L2 for each key's K and V rows before reading them
    /// ([`CudaExecutor::set_split_prefetch`]; also part of the fused attention).
    split_prefetch: bool,
    /// Whether decode-sized steps' products norm their input themselves
    /// ([`CudaExecutor::set_fused_decode`]).
    fused_norm: bool,
    /// Whether host-tier loads are ordered layer by layer before later steps
    /// ([`Executor::imports_ordered`]; `transfers`), or whole-block copies the engine waits for.
    ordered_imports: bool,
    /// The fewest bytes one copy of ordered loads moves: a block's consecutive layers are copied
    /// together up to this ([`CudaExecutor::set_load_copy_min`]).
    load_copy_min: usize,
}

/// Page-locked host memory that a step's rows of logits land in, shared with the engine's [`Logits`]
/// of that step: written again only once the engine has dropped them (`Arc::get_mut`).
struct PinnedRows {
    buf: cudarc::driver::PinnedHostSlice<f32>,
    /// `buf`'s memory, taken once.
    at: *mut f32,
}

// SAFETY: `at` addresses `buf`'s memory, which lives as long as `buf` and is written only through
// `&mut PinnedRows`; reads through `&PinnedRows` see it whole.
unsafe impl Send for PinnedRows {}
unsafe impl Sync for PinnedRows {}

impl PinnedRows {
    /// `len` floats of page-locked memory: not write-combined (cudarc's default), since the host reads
    /// them.
    fn new(dev: &Device, len: usize) -> Result<Self> {
        // SAFETY: the memory is written by the copies of a step before any of it is read.
        let mut buf = unsafe { dev.ctx.alloc_pinned_with_flags::<f32>(len, 0) }?;
        let at = buf.as_mut_ptr()?;
        Ok(PinnedRows { buf, at })
    }

    fn values_mut(&mut self) -> &mut [f32] {
        // SAFETY: see the `Send` impl; `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.at, self.buf.len()) }
    }
}

impl HostRows for PinnedRows {
    fn values(&self) -> &[f32] {
        // SAFETY: see the `Send` impl.
        unsafe { std::slice::from_raw_parts(self.at, self.buf.len()) }
    }
}

/// Captured graphs by step shape.
#[derive(Default)]
struct Graphs(std::collections::HashMap<(usize, usize, usize, usize), cudarc::driver::CudaGraph>);

// SAFETY: a CUDA graph may be used from any thread when its uses are serialised (CUDA's graph thread
// safety rules); the executor uses its graphs only through `&mut self`.
unsafe impl Send for Graphs {}

impl std::ops::Deref for Graphs {
    type Target =
        std::collections::HashMap<(usize, usize, usize, usize), cudarc::driver::CudaGraph>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Graphs {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

/// The attention kernels' score scale at head size `d`, in base 2 (they exponentiate with `exp2`).
fn scale_log2(d: usize) -> f32 {
    (1.0 / (d as f32).sqrt()) * std::f32::consts::LOG2_E
}

/// Steps of at most this many new tokens (and no prefill tile) run as captured graphs.
const GRAPH_MAX_TOKENS: usize = 8;
/// Graphs kept at most (all dropped when full: shapes of a running server change slowly).
const MAX_GRAPHS: usize = 64;

impl std::fmt::Debug for CudaExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaExecutor({:?}, {} blocks of {} bytes)",
            self.dev, self.num_blocks, self.block_bytes
        )
    }
}

/// How a pool is asked for.
#[derive(Debug, Clone, Copy)]
pub struct PoolSpec {
    pub kv_dtype: KvDtype,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Activation buffers allocated before the pool, for steps of up to this many new tokens over
    /// this many sequences (0: grown at the first step that needs them).
    pub reserve_tokens: usize,
    pub reserve_seqs: usize,
}

impl PoolSpec {
    /// `num_blocks` blocks of `block_size` tokens in `kv_dtype`, activations grown as needed.
    pub fn new(kv_dtype: KvDtype, block_size: usize, num_blocks: usize) -> Self {
        PoolSpec {
            kv_dtype,
            block_size,
            num_blocks,
            reserve_tokens: 0,
            reserve_seqs: 0,
        }
    }
}

/// Bytes the split-key kernel's partials may take at once: a step with more split tokens than fit runs
/// that kernel and its merge in waves of tokens over the same buffer.
pub const PART_CAP_BYTES: usize = 64 << 20;

/// The fewest bytes one copy of ordered host-tier loads moves: a block's consecutive layers go in one
/// copy up to this, and each layer's event follows its group's copies. On an H200 each copy of a batch
/// cost about 0.8–1 µs whatever its size (61,890 copies of 12 KiB took 50 ms; 32,768 of 33 KiB, fp8 KV
/// of a 16-token block's layer in Llama-3.1-8B's shape, 33 ms where their bytes take 20 ms at the
/// measured 55 GB/s), so copies under about 64 KiB ran at the rate of copies, not of bytes; 128 KiB
/// takes 2.4 µs at 55 GB/s.
pub const LOAD_COPY_MIN_BYTES: usize = 128 << 10;

/// Split tokens per wave of the split-key kernel, each token's partials `heads × max_splits ×
/// (head_dim + 2)` f32: as many as `cap` bytes hold ([`PART_CAP_BYTES`]), at least one, at most
/// `split_tokens`.
pub fn split_wave(
    split_tokens: usize,
    heads: usize,
    max_splits: usize,
    head_dim: usize,
    cap: usize,
) -> usize {
    let per_token = heads * max_splits * (head_dim + 2) * 4;
    (cap / per_token.max(1)).clamp(1, split_tokens.max(1))
}

/// Bytes of one stored K or V row of `head_dim` elements in `dtype`: 2 or 4 a element, or for fp8 one
/// byte a element and an f16 scale per 64 (the CPU's fp8 layout's bytes).
fn row_bytes(dtype: KvDtype, head_dim: usize) -> usize {
    match dtype {
        KvDtype::F32 => 4 * head_dim,
        KvDtype::Fp8 => dtype.bytes_per_vector(head_dim),
        _ => 2 * head_dim,
    }
}

/// Bytes of one KV block of `cfg` in `dtype` (every layer's K and V).
pub fn block_bytes(cfg: &ModelConfig, dtype: KvDtype, block_size: usize) -> usize {
    cfg.num_layers() * 2 * cfg.num_kv_heads() * block_size * row_bytes(dtype, cfg.head_dim())
}

/// Most tokens a block of the GPU pool holds (the CPU's pool holds up to 1,024).
pub const MAX_BLOCK_SIZE: usize = 256;

/// Whether the GPU pool holds `dtype` in blocks of `block_size` tokens: blocks of 1 to
/// [`MAX_BLOCK_SIZE`] tokens; bf16 and f32 at any of those sizes, fp8 (its regions of payload rows
/// and scale rows kept 16-byte aligned) in blocks of a multiple of 8.
pub fn check_pool_format(dtype: KvDtype, block_size: usize) -> Result<()> {
    if !(1..=MAX_BLOCK_SIZE).contains(&block_size) {
        return Err(CudaError::Unsupported(format!(
            "blocks of {block_size} tokens: the GPU pool holds blocks of 1 to {MAX_BLOCK_SIZE} tokens"
        )));
    }
    match dtype {
        KvDtype::Bf16 | KvDtype::F32 => Ok(()),
        KvDtype::Fp8 if block_size.is_multiple_of(8) => Ok(()),
        KvDtype::Fp8 => Err(CudaError::Unsupported(format!(
            "fp8 KV on the GPU in blocks of {block_size} tokens: give a block size that is a multiple of 8"
        ))),
        other => Err(CudaError::Unsupported(format!(
            "KV dtype {}: the GPU pool holds bf16, f32 or fp8",
            other.name()
        ))),
    }
}

impl CudaExecutor {
    /// Loads the model at `path` onto `dev` and allocates its pool.
    pub fn load(dev: Device, path: &std::path::Path, pool: PoolSpec) -> Result<Self> {
        let parts = ModelParts::open(path)?;
        let w = DevWeights::load(&dev, parts.source.as_ref(), parts.naming, &parts.config)?;
        Self::new(dev, parts.config, w, pool)
    }

    /// An executor over weights already on `dev`.
    pub fn new(dev: Device, cfg: ModelConfig, w: DevWeights, pool: PoolSpec) -> Result<Self> {
        crate::weights::check_supported(&cfg)?;
        check_pool_format(pool.kv_dtype, pool.block_size)?;
        let block_bytes = block_bytes(&cfg, pool.kv_dtype, pool.block_size);
        let total =
            block_bytes
                .checked_mul(pool.num_blocks)
                .ok_or_else(|| CudaError::OutOfMemory {
                    what: "the KV pool".into(),
                    need: usize::MAX,
                    free: 0,
                })?;
        let mut scratch = Scratch::new(&dev)?;
        scratch.grow(&dev, &cfg, pool.reserve_tokens, pool.reserve_seqs)?;
        let pool_buf = dev.alloc::<u8>(total, "the KV pool")?;
        let inv = rope_inv_freq(&cfg);
        let mut inv_freq = dev.alloc::<f32>(inv.len(), "RoPE frequencies")?;
        dev.stream.memcpy_htod(&inv, &mut inv_freq)?;
        let shape = PoolShape {
            layers: cfg.num_layers() as i32,
            kv_heads: cfg.num_kv_heads() as i32,
            block_size: pool.block_size as i32,
            head_dim: cfg.head_dim() as i32,
        };
        let s = scratch;
        Ok(CudaExecutor {
            loads: None,
            host_logits: None,
            dev,
            cfg,
            w,
            inv_freq,
            pool: pool_buf,
            shape,
            kv_dtype: pool.kv_dtype,
            num_blocks: pool.num_blocks,
            block_bytes,
            s,
            prefill_min: PREFILL_MIN,
            graphs: Graphs::default(),
            use_graphs: true,
            use_dependent: true,
            part_cap: PART_CAP_BYTES,
            mask_all_tiles: false,
            prefill_kernel: PrefillKernel::Narrow,
            prefill_probe: None,
            fused_attention: false,
            split_prefetch: false,
            fused_norm: false,
            ordered_imports: crate::libs::has_batch_copies(),
            load_copy_min: LOAD_COPY_MIN_BYTES,
        })
    }

    /// Masks every key tile of the prefill kernel, not only those that cross a row's last key or window
    /// (the same results: for measuring what skipping the mask saves).
    pub fn set_mask_all_tiles(&mut self, on: bool) {
        self.mask_all_tiles = on;
    }

    /// Runs prefill attention through another of its kernels ([`PrefillKernel`]; `Narrow` by default).
    /// A kernel this device did not load for the pool's format and the model's head size (more shared
    /// memory than a block may have here: [`PrefillKernel::Deep`] on sm_86) is refused: this returns
    /// false and changes nothing.
    pub fn set_prefill_kernel(&mut self, kernel: PrefillKernel) -> bool {
        let name = kernel.kernel(self.kv_name(), self.cfg.head_dim());
        if !self.dev.has_kernel(&name) {
            return false;
        }
        self.prefill_kernel = kernel;
        self.graphs.clear();
        true
    }

    /// The pool's format in kernel names.
    fn kv_name(&self) -> &'static str {
        match self.kv_dtype {
            KvDtype::F32 => "f32",
            KvDtype::Fp8 => "fp8",
            _ => "bf16",
        }
    }

    /// Runs prefill attention through a timing probe instead (`None`: the kernel again). The probes
    /// are built for bf16 pools only: with another pool this returns false and changes nothing. What a
    /// step computes with a probe is not attention, so its tokens and KV are to be thrown away.
    pub fn set_prefill_probe(&mut self, probe: Option<PrefillProbe>) -> bool {
        if probe.is_some() && self.kv_dtype != KvDtype::Bf16 {
            return false;
        }
        self.prefill_probe = probe;
        self.graphs.clear();
        true
    }

    /// Runs fewer, fused kernels a layer (the same bits): the split-key attention kernel merges its
    /// splits itself (the last block of each token and KV head to finish does it, instead of
    /// `attn_merge`) and asks L2 for each key's K and V rows before reading them; and for steps of at
    /// most [`crate::device::GEMV_NORM_MAX_TOKENS`] tokens the products after an RMSNorm norm their
    /// input themselves (`gemv_norm_*`: Q/K/V and the output head), and the FFN's gate and up products
    /// write SiLU(gate) · up directly (`gemv_swiglu_norm_*`). Six launches a layer instead of ten. The
    /// merge stays a kernel of its own past [`FUSED_MERGE_MAX_SPLITS`] splits. Off by default until measured on a
    /// GPU; the GPU tests compare the two, and `gpu-bench` times both.
    pub fn set_fused_decode(&mut self, on: bool) {
        self.set_fused_parts(on, on);
    }

    /// The two halves of [`CudaExecutor::set_fused_decode`] apart: `attention`, the split-key kernel
    /// merging its splits itself (and prefetching K and V); `norm`, the products that norm their input
    /// (and the FFN's SiLU · up in its product). Each gives the bits of the separate kernels.
    pub fn set_fused_parts(&mut self, attention: bool, norm: bool) {
        self.fused_attention = attention;
        self.fused_norm = norm;
        self.graphs.clear();
    }

    /// The split-key kernel asks L2 for each key's K and V rows as it starts (the fused attention's
    /// prefetch, without its merge): a thread's first K line and its weighted sum's V loads then wait
    /// on L2, not on memory. The same bits; off by default until a GPU has timed it alone
    /// (`gpu-bench`'s `"split_prefetch"`).
    pub fn set_split_prefetch(&mut self, on: bool) {
        self.split_prefetch = on;
        self.graphs.clear();
    }

    /// Copies host-tier loads layer by layer, ordered before later steps (the default where the driver
    /// has batched copies, CUDA 13), or as whole blocks the engine waits for. Asked for where the
    /// driver lacks batched copies, it stays off and this returns `false`.
    pub fn set_ordered_imports(&mut self, on: bool) -> bool {
        self.ordered_imports = on && crate::libs::has_batch_copies();
        self.ordered_imports == on
    }

    /// The fewest bytes one copy of ordered host-tier loads moves ([`LOAD_COPY_MIN_BYTES`]); 0 copies
    /// each layer of each block alone.
    pub fn set_load_copy_min(&mut self, bytes: usize) {
        self.load_copy_min = bytes;
    }

    /// Runs decode steps as captured graphs (the default) or launch by launch (tests compare the two).
    pub fn set_graphs(&mut self, on: bool) {
        self.use_graphs = on;
        self.graphs.clear();
    }

    /// Caps the split-key kernel's partials at `bytes` (tests run every wave at one token).
    pub fn set_part_cap(&mut self, bytes: usize) {
        self.part_cap = bytes;
        self.graphs.clear();
    }

    /// Launches a step's kernels after the first as programmatic dependent launches (the default,
    /// where the device has them: [`Device::set_dependent`]) or plainly (tests and the benchmark
    /// compare the two).
    pub fn set_dependent_launch(&mut self, on: bool) {
        self.use_dependent = on;
        self.graphs.clear();
    }

    /// The decode products (steps of at most 8 tokens) in `form`. A product of few rows (4,096, a
    /// warp each) needs more bytes on the way than the one or two loads a lane the compiler keeps in
    /// flight in `gemv_T`: `gemv_ahead_T` has each load of W also ask L2 for the part of its row 4 KiB
    /// further on, `gemv_batched_T` stages a lane's chunks of W through shared memory by `cp.async`,
    /// two batches of four ahead of the one it adds. `gemv_T` by default until a GPU has timed the
    /// others ([`CudaExecutor::tune`] does at start); the same bits in every form (the GPU tests
    /// compare them, and `gpu-bench` times each).
    pub fn set_gemv(&mut self, form: crate::GemvForm) {
        self.dev.set_gemv(form);
        self.graphs.clear();
    }

    /// Sends sequences with at least `n` new tokens through the prefill kernel (default
    /// [`PREFILL_MIN`]): 1 sends every sequence there, `usize::MAX` none (tests compare the two).
    pub fn set_prefill_min(&mut self, n: usize) {
        self.prefill_min = n.max(1);
    }

    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// The pool's KV element format.
    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn weight_bytes(&self) -> usize {
        self.w.bytes
    }

    /// Bytes the per-step buffers take for steps of up to `tokens` new tokens and `rows` sequences
    /// ([`budget::activation_bytes`], the table `Scratch::grow` allocates from).
    pub fn activation_bytes(cfg: &ModelConfig, tokens: usize, rows: usize) -> usize {
        budget::activation_bytes(&Dims::of(cfg), tokens, rows) as usize
    }

    fn limits(&self) -> StepLimits {
        StepLimits {
            block_size: self.shape.block_size as usize,
            num_blocks: self.num_blocks,
            vocab: self.cfg.vocab_size(),
            max_context: self.cfg.max_context(),
            window: self.cfg.sliding_window(),
            prefill_min: self.prefill_min,
            max_tokens: i32::MAX as usize / self.cfg.intermediate_size().max(1),
        }
    }

    /// Runs the step and leaves each sequence's last-token logits in `s.logits` (`n_seqs × vocab`; with
    /// `tails`, each sequence's last `tails[i]` tokens' rows, `n_rows × vocab`), or with `every`,
    /// every token's in `s.every` (`n_tokens × vocab`, which the caller made room for).
    fn run(
        &mut self,
        batch: &[SeqInput<'_>],
        tails: Option<&[usize]>,
        every: bool,
    ) -> Result<StepPlan> {
        let plan = match tails {
            Some(tails) => plan_tails(batch, tails, self.limits())?,
            None => plan_step(batch, self.limits())?,
        };
        self.dev.ctx.bind_to_thread()?;
        // A step writes its new tokens' blocks: after the stores that read them. Loads started since
        // the last step go out now; a step that reads one of their blocks waits for each layer's bytes
        // before that layer's attention.
        self.after_stores_of(plan.blocks_written())?;
        self.issue_imports()?;
        let wait = self.imports_read_by(batch);
        let c = &self.cfg;
        let (t, n) = (plan.n_tokens, plan.n_rows);
        let wave = split_wave(
            plan.split_tokens,
            c.num_heads(),
            plan.max_splits,
            c.head_dim(),
            self.part_cap,
        );
        let part_len =
            (wave.min(plan.split_tokens) * c.num_heads() * plan.max_splits * (c.head_dim() + 2))
                .max(argmax_part_len(n, c.vocab_size()));
        let arrive_len = wave.min(plan.split_tokens) * c.num_kv_heads();
        let s = &mut self.s;
        let before = (s.tokens, s.rows, s.meta.len(), s.part.len(), s.arrive.len());
        // Metadata room for the longest block tables a step may have, so that it is seldom reallocated.
        let meta_len = plan
            .meta
            .len()
            .max(4 * t + n + 4 * plan.split_tokens + 4 * plan.tiles + 4096);
        let grown = s
            .grow(&self.dev, c, t, n)
            .and_then(|()| ensure(&self.dev, &mut s.meta, meta_len, "step metadata"))
            .and_then(|()| ensure(&self.dev, &mut s.part, part_len, "attention partials"))
            .and_then(|()| ensure(&self.dev, &mut s.arrive, arrive_len, "attention partials"));
        // A buffer moved (or was freed by an allocation that then failed): the captured graphs name the
        // old ones.
        let after = (s.tokens, s.rows, s.meta.len(), s.part.len(), s.arrive.len());
        if grown.is_err() || before != after {
            self.graphs.clear();
        }
        grown?;
        {
            let mut view = s.meta.slice_mut(0..plan.meta.len());
            self.dev.stream.memcpy_htod(&plan.meta, &mut view)?;
        }
        // Decode-sized steps replay a graph of their shape (one launch instead of ~10 per layer).
        if plan.tiles == 0 && t <= GRAPH_MAX_TOKENS && self.use_graphs && !every {
            let key = (t, n, plan.split_tokens, plan.max_splits);
            if !self.graphs.contains_key(&key) {
                let graph = match self.capture(&plan) {
                    Ok(g) => g,
                    // A driver that cannot capture dependent launches (before CUDA 12.3): plain ones.
                    Err(e) if self.use_dependent && self.dev.has_dependent_launch() => {
                        self.use_dependent = false;
                        match self.capture(&plan) {
                            Ok(g) => {
                                tracing::warn!(
                                    "capturing a decode step with dependent launches failed ({e}); \
                                     steps run with plain launches from now on"
                                );
                                self.graphs.clear();
                                g
                            }
                            // Not the dependent launches' fault: they stay on.
                            Err(plain) => {
                                self.use_dependent = true;
                                return Err(plain);
                            }
                        }
                    }
                    Err(e) => return Err(e),
                };
                if self.graphs.len() >= MAX_GRAPHS {
                    self.graphs.clear();
                }
                self.graphs.insert(key, graph);
            }
            self.wait_all_layers(wait)?;
            self.graphs[&key].launch()?;
        } else {
            self.enqueue(&plan, wait, every)?;
        }
        self.waited_for(wait);
        Ok(plan)
    }

    /// The step `plan` captured as a graph (not launched).
    fn capture(&self, plan: &StepPlan) -> Result<cudarc::driver::CudaGraph> {
        if self.fused_norm {
            // The fused products' grids (a driver query, the first time) before the capture, not in it.
            let h = self.cfg.hidden_size();
            self.dev.prepare_normed(plan.n_tokens, h)?;
            self.dev.prepare_normed(plan.n_rows, h)?;
        }
        self.dev.stream.begin_capture(
            cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )?;
        let enqueued = self.enqueue(plan, None, false);
        let graph = self
            .dev
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))?;
        enqueued?;
        graph.ok_or_else(|| CudaError::driver("capturing a decode step gave no graph"))
    }

    /// Launches every kernel and product of the step `plan` (whose metadata is on the device); layer
    /// *i* writes and reads the pool after layer *i* of the ordered loads issued as `wait` (and of every
    /// issue before it) has landed. The output head runs on each sequence's last token, or with `every`
    /// on every token.
    fn enqueue(&self, plan: &StepPlan, wait: Option<u64>, every: bool) -> Result<()> {
        let c = &self.cfg;
        let (h, inter, d) = (c.hidden_size(), c.intermediate_size(), c.head_dim());
        let (heads, kvh) = (c.num_heads(), c.num_kv_heads());
        let (q_dim, qkv_dim) = (heads * d, (heads + 2 * kvh) * d);
        let vocab = c.vocab_size();
        let (t, n) = (plan.n_tokens, plan.n_rows);
        let dev = &self.dev;
        let s = &self.s;
        let meta = dev.ptr(&s.meta);
        let m = |at: usize| meta + 4 * at as u64;
        let (x, xn, qkv, q, attn, gu, act) = (
            dev.ptr(&s.x),
            dev.ptr(&s.xn),
            dev.ptr(&s.qkv),
            dev.ptr(&s.q),
            dev.ptr(&s.attn),
            dev.ptr(&s.gu),
            dev.ptr(&s.act),
        );
        let (pool, part, arrive) = (dev.ptr(&self.pool), dev.ptr(&s.part), dev.ptr(&s.arrive));
        // The split kernel's flags. The merge is fused only over few splits: the last block of a
        // (token, KV head) merges all its heads' splits alone, which over hundreds of splits would
        // leave one block working at the kernel's end.
        let fuse_merge = self.fused_attention && plan.max_splits <= FUSED_MERGE_MAX_SPLITS;
        let split_flags = (if fuse_merge { SPLIT_MERGE } else { 0 })
            | (if self.fused_attention || self.split_prefetch {
                SPLIT_PREFETCH
            } else {
                0
            });
        let kv = self.kv_name();
        let eps = c.params.rms_norm_eps;
        let style = match c.params.rope_style {
            kura_checkpoint::config::RopeStyle::Half => 0,
            kura_checkpoint::config::RopeStyle::Interleaved => 1,
        };
        let scale_log2 = scale_log2(d);
        let group = heads / kvh;
        let g = [1, 2, 4, 8, 16]
            .into_iter()
            .find(|g| *g >= group)
            .unwrap_or(16);
        // The fused decode path norms inside the products ([`Device::gemv_norm_fits`]).
        let fuse_norm = self.fused_norm && Device::gemv_norm_fits(t, h);

        dev.launch(
            "embed",
            (t as u32, 1, 1),
            256,
            &[
                Arg::Ptr(m(plan.at_tokens)),
                Arg::Ptr(dev.ptr(&self.w.embed)),
                Arg::Ptr(x),
                Arg::I32(h as i32),
                Arg::F32(1.0),
            ],
        )?;
        // The rest of the step's kernels may start while the one before them drains; the first waited
        // for whatever came before the step (the upload of its metadata). Plain launches again after
        // the step, however it ends.
        struct PlainAfter<'a>(&'a Device);
        impl Drop for PlainAfter<'_> {
            fn drop(&mut self) {
                self.0.set_dependent(false);
            }
        }
        // A step that waits for ordered loads launches plainly: a kernel launched to overlap the one
        // before it would not be ordered after a wait between them.
        dev.set_dependent(self.use_dependent && wait.is_none());
        let _plain_after = PlainAfter(dev);
        let half = d / 2;
        let (cs, sn) = (dev.ptr(&s.cos), dev.ptr(&s.sin));
        dev.launch(
            "rope_table",
            ((t * half).div_ceil(256) as u32, 1, 1),
            256,
            &[
                Arg::Ptr(m(plan.at_pos)),
                Arg::Ptr(dev.ptr(&self.inv_freq)),
                Arg::Ptr(cs),
                Arg::Ptr(sn),
                Arg::I32(half as i32),
                Arg::I32((t * half) as i32),
            ],
        )?;
        // RMSNorm of `rows` rows of x (the rows `index` lists, or the first ones when 0) into `out`.
        let norm = |rows: usize, index: u64, weight: u64, out: u64| {
            dev.launch(
                "rms_norm",
                (rows as u32, 1, 1),
                crate::device::NORM_THREADS,
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(index),
                    Arg::Ptr(weight),
                    Arg::Ptr(out),
                    Arg::I32(h as i32),
                    Arg::F32(eps),
                ],
            )
        };
        for (li, lw) in self.w.layers.iter().enumerate() {
            if fuse_norm {
                let w = dev.ptr(&lw.wqkv);
                dev.gemv_norm(x, 0, t, dev.ptr(&lw.attn_norm), eps, w, qkv_dim, h, qkv)?;
            } else {
                norm(t, 0, dev.ptr(&lw.attn_norm), xn)?;
                dev.matmul(xn, t, dev.ptr(&lw.wqkv), qkv_dim, h, qkv, false)?;
            }
            let items = (heads + kvh) * half + kvh * d;
            let bias = lw.bqkv.as_ref().map_or(0, |b| dev.ptr(b));
            self.wait_layer(wait, li)?;
            if self.kv_dtype == KvDtype::Fp8 {
                // RoPE into place in qkv, then each K and V row scaled and stored as fp8.
                dev.launch(
                    "rope_kv_inplace",
                    (t as u32, items.div_ceil(256) as u32, 1),
                    256,
                    &[
                        Arg::Ptr(qkv),
                        Arg::Ptr(bias),
                        Arg::Ptr(cs),
                        Arg::Ptr(sn),
                        Arg::Ptr(q),
                        Arg::Shape(self.shape),
                        Arg::I32(heads as i32),
                        Arg::I32(style),
                    ],
                )?;
                dev.launch(
                    "quant_store_fp8",
                    (t as u32, 2 * kvh as u32, 1),
                    (d / 2) as u32,
                    &[
                        Arg::Ptr(qkv),
                        Arg::Ptr(m(plan.at_slots)),
                        Arg::Ptr(pool),
                        Arg::Shape(self.shape),
                        Arg::I32(li as i32),
                        Arg::I32(heads as i32),
                    ],
                )?;
            } else {
                dev.launch(
                    &format!("rope_store_{kv}"),
                    (t as u32, items.div_ceil(256) as u32, 1),
                    256,
                    &[
                        Arg::Ptr(qkv),
                        Arg::Ptr(bias),
                        Arg::Ptr(cs),
                        Arg::Ptr(sn),
                        Arg::Ptr(m(plan.at_slots)),
                        Arg::Ptr(q),
                        Arg::Ptr(pool),
                        Arg::Shape(self.shape),
                        Arg::I32(li as i32),
                        Arg::I32(heads as i32),
                        Arg::I32(style),
                    ],
                )?;
            }
            // In waves of tokens whose partials fit the buffer (one wave but at very long contexts):
            // each wave's kernels see its tokens from the first, the partials from the buffer's start.
            let wave = split_wave(plan.split_tokens, heads, plan.max_splits, d, self.part_cap);
            for first in (0..plan.split_tokens).step_by(wave) {
                let count = wave.min(plan.split_tokens - first);
                let info = m(plan.at_tok_info + 4 * first);
                dev.launch(
                    &format!("attn_split_{kv}_{d}_g{g}"),
                    (count as u32, kvh as u32, plan.max_splits as u32),
                    128,
                    &[
                        Arg::Ptr(q),
                        Arg::Ptr(pool),
                        Arg::Ptr(m(plan.at_tables)),
                        Arg::Ptr(info),
                        Arg::Ptr(part),
                        Arg::Shape(self.shape),
                        Arg::I32(li as i32),
                        Arg::I32(heads as i32),
                        Arg::I32(plan.max_splits as i32),
                        Arg::F32(scale_log2),
                        Arg::Ptr(arrive),
                        Arg::Ptr(attn),
                        Arg::I32(split_flags),
                    ],
                )?;
                if fuse_merge {
                    continue;
                }
                dev.launch(
                    "attn_merge",
                    (count as u32, heads as u32, 1),
                    d as u32,
                    &[
                        Arg::Ptr(part),
                        Arg::Ptr(info),
                        Arg::Ptr(attn),
                        Arg::I32(heads as i32),
                        Arg::I32(plan.max_splits as i32),
                        Arg::I32(d as i32),
                    ],
                )?;
            }
            if plan.tiles > 0 {
                let (k, name) = match self.prefill_probe {
                    Some(p) => (PrefillKernel::Narrow, p.kernel(d)),
                    None => (self.prefill_kernel, self.prefill_kernel.kernel(kv, d)),
                };
                self.launch_prefill(&name, k, plan, li)?;
            }
            dev.matmul(attn, t, dev.ptr(&lw.wo), h, q_dim, x, true)?;
            if fuse_norm {
                let (ffn_norm, w) = (dev.ptr(&lw.ffn_norm), dev.ptr(&lw.w_gate_up));
                dev.gemv_swiglu_norm(x, t, ffn_norm, eps, w, inter, h, act)?;
            } else {
                norm(t, 0, dev.ptr(&lw.ffn_norm), xn)?;
                dev.matmul(xn, t, dev.ptr(&lw.w_gate_up), 2 * inter, h, gu, false)?;
                let total = t * inter;
                dev.launch(
                    "silu_mul",
                    ((total / 4).div_ceil(256) as u32, 1, 1),
                    256,
                    &[
                        Arg::Ptr(gu),
                        Arg::Ptr(act),
                        Arg::I32(inter as i32),
                        Arg::I32(total as i32),
                    ],
                )?;
            }
            dev.matmul(act, t, dev.ptr(&lw.w_down), h, inter, x, true)?;
        }
        let head = dev.ptr(self.w.lm_head.as_ref().unwrap_or(&self.w.embed));
        if every {
            // Every token's rows, normed into `xn` (free after the last layer).
            norm(t, 0, dev.ptr(&self.w.final_norm), xn)?;
            return dev.matmul(xn, t, head, vocab, h, dev.ptr(&s.every), false);
        }
        if self.fused_norm && Device::gemv_norm_fits(n, h) {
            let (final_norm, logits) = (dev.ptr(&self.w.final_norm), dev.ptr(&s.logits));
            return dev.gemv_norm(
                x,
                m(plan.at_last),
                n,
                final_norm,
                eps,
                head,
                vocab,
                h,
                logits,
            );
        }
        let last = dev.ptr(&s.last);
        norm(n, m(plan.at_last), dev.ptr(&self.w.final_norm), last)?;
        dev.matmul(last, n, head, vocab, h, dev.ptr(&s.logits), false)
    }

    /// Launches layer `li`'s prefill attention over the tiles of `plan` (whose metadata is on the
    /// device), reading the queries in `q` and writing `attn`, through kernel `name`: `kernel`'s own, or
    /// a probe's (whose grid and block are `Narrow`'s).
    fn launch_prefill(
        &self,
        name: &str,
        kernel: PrefillKernel,
        plan: &StepPlan,
        li: usize,
    ) -> Result<()> {
        let (dev, s, c) = (&self.dev, &self.s, &self.cfg);
        let meta = dev.ptr(&s.meta);
        let m = |at: usize| meta + 4 * at as u64;
        let heads = c.num_heads();
        dev.launch(
            name,
            (
                (plan.tiles * kernel.blocks_a_tile()) as u32,
                heads as u32,
                1,
            ),
            kernel.threads(),
            &[
                Arg::Ptr(dev.ptr(&s.q)),
                Arg::Ptr(dev.ptr(&self.pool)),
                Arg::Ptr(m(plan.at_tables)),
                Arg::Ptr(m(plan.at_tiles)),
                Arg::Ptr(dev.ptr(&s.attn)),
                Arg::Shape(self.shape),
                Arg::I32(li as i32),
                Arg::I32(heads as i32),
                Arg::I32(c.sliding_window().map_or(0, |w| w as i32)),
                Arg::F32(scale_log2(c.head_dim())),
                Arg::I32(plan.tiles as i32),
                Arg::I32(self.mask_all_tiles as i32),
            ],
        )
    }

    /// Each sequence's last-token logits, `n × vocab` row by row.
    pub fn forward_logits(&mut self, batch: &[SeqInput<'_>]) -> Result<Vec<f32>> {
        let plan = self.run(batch, None, false)?;
        let n = plan.n_rows * self.cfg.vocab_size();
        let mut out = vec![0f32; n];
        self.dev
            .stream
            .memcpy_dtoh(&self.s.logits.slice(0..n), &mut out)?;
        self.dev.synchronize()?;
        Ok(out)
    }

    /// The logits of every token of `item`, `tokens × vocab` row by row (`kura perplexity`): one step
    /// over the sequence, through the prefill kernel where it has enough tokens.
    pub fn forward_every_position(&mut self, item: SeqInput<'_>) -> Result<Vec<f32>> {
        let n = item
            .tokens
            .len()
            .checked_mul(self.cfg.vocab_size())
            .ok_or_else(|| {
                CudaError::Batch("too many tokens for every position's logits".into())
            })?;
        self.dev.ctx.bind_to_thread()?;
        // Exactly `n` (not rounded up, as the per-step buffers): every position of a long piece is
        // many vocabularies of logits.
        ensure_as(
            &self.dev,
            &mut self.s.every,
            n,
            n,
            "every position's logits",
        )?;
        self.run(&[item], None, true)?;
        let mut out = vec![0f32; n];
        self.dev
            .stream
            .memcpy_dtoh(&self.s.every.slice(0..n), &mut out)?;
        self.dev.synchronize()?;
        Ok(out)
    }

    /// Each sequence's greedy next token, chosen on the device (only the ids come back).
    pub fn forward_greedy(&mut self, batch: &[SeqInput<'_>]) -> Result<Vec<u32>> {
        let plan = self.run(batch, None, false)?;
        let out = self.argmax_ids(plan.n_rows)?;
        self.dev.synchronize()?;
        Ok(out)
    }

    /// Each sequence's answer as `wants` asks ([`Executor::forward_rows`]): a greedy token found on
    /// the device (its id comes back), a row of logits copied back through page-locked memory, or
    /// nothing (no copy at all for a prefill chunk with more to come).
    pub fn forward_rows(&mut self, batch: &[SeqInput<'_>], wants: &[Want]) -> Result<Vec<Row>> {
        if wants.len() != batch.len() {
            return Err(CudaError::Batch(format!(
                "{} answers asked of a step of {} sequences",
                wants.len(),
                batch.len()
            )));
        }
        let plan = self.run(batch, None, false)?;
        self.answer_rows(&plan, wants)
    }

    /// Each sequence's last `tails[i]` positions answered as `wants[i]` asks, in position order
    /// ([`Executor::forward_tails`]): one step over the whole batch, whose output head runs on those
    /// rows alone; greedy tokens are found on the device and rows of logits asked for copied back, as
    /// [`CudaExecutor::forward_rows`] does.
    pub fn forward_tails(
        &mut self,
        batch: &[SeqInput<'_>],
        wants: &[Want],
        tails: &[usize],
    ) -> Result<Vec<Vec<Row>>> {
        if wants.len() != batch.len() {
            return Err(CudaError::Batch(format!(
                "{} answers asked of a step of {} sequences",
                wants.len(),
                batch.len()
            )));
        }
        let plan = self.run(batch, Some(tails), false)?;
        let row_wants: Vec<Want> = wants
            .iter()
            .zip(tails)
            .flat_map(|(&want, &k)| std::iter::repeat_n(want, k))
            .collect();
        let mut rows = self.answer_rows(&plan, &row_wants)?.into_iter();
        Ok(tails
            .iter()
            .map(|&k| rows.by_ref().take(k).collect())
            .collect())
    }

    /// The rows of the step `plan` (just run) answered as `wants` (one per row) asks.
    fn answer_rows(&mut self, plan: &StepPlan, wants: &[Want]) -> Result<Vec<Row>> {
        let (n, vocab) = (plan.n_rows, self.cfg.vocab_size());
        if wants.len() != n {
            return Err(CudaError::Batch(format!(
                "{} answers asked of a step of {n} rows",
                wants.len()
            )));
        }
        let ids = if wants.contains(&Want::Argmax) {
            self.argmax_ids(n)?
        } else {
            Vec::new()
        };
        // Each run of consecutive rows asked for is one copy, to the same place in the host buffer.
        let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
        for (r, want) in wants.iter().enumerate() {
            if *want != Want::Logits {
                continue;
            }
            match runs.last_mut() {
                Some(run) if run.end == r => run.end = r + 1,
                _ => runs.push(r..r + 1),
            }
        }
        let host = match runs.last() {
            Some(last) => {
                self.make_rows_room(last.end * vocab)?;
                let host = self.host_logits.as_mut().expect("made room");
                let values = std::sync::Arc::get_mut(host)
                    .expect("make_rows_room leaves rows no step shares")
                    .values_mut();
                let mut copied = Ok(());
                for run in &runs {
                    let at = run.start * vocab..run.end * vocab;
                    copied = self
                        .dev
                        .stream
                        .memcpy_dtoh(&self.s.logits.slice(at.clone()), &mut values[at]);
                    if copied.is_err() {
                        break;
                    }
                }
                if let Err(e) = copied {
                    // The copies already queued land before the buffer can be freed or reused.
                    let _ = self.dev.synchronize();
                    return Err(e.into());
                }
                Some(std::sync::Arc::clone(host) as std::sync::Arc<dyn HostRows>)
            }
            None => None,
        };
        self.dev.synchronize()?;
        wants
            .iter()
            .enumerate()
            .map(|(r, want)| match (want, &host) {
                (Want::Nothing, _) => Ok(Row::Nothing),
                (Want::Argmax, _) => Ok(Row::Token(ids[r])),
                (Want::Logits, Some(host)) => {
                    Logits::shared(host.clone(), r * vocab..(r + 1) * vocab)
                        .map(Row::Logits)
                        .map_err(|e| CudaError::Batch(e.to_string()))
                }
                (Want::Logits, None) => unreachable!("rows of logits asked for have a buffer"),
            })
            .collect()
    }

    /// Page-locked memory for `len` floats of logits that no earlier step's rows still share: the last
    /// one's when the engine has dropped its rows and it is large enough, else a new one with room for
    /// the next power of two of rows (at most as many as the step buffers hold), so that it is seldom
    /// made again and never pins more than twice the rows a step asked for (the step buffers may hold
    /// a row for every draft token: [`budget::head_rows`]).
    fn make_rows_room(&mut self, len: usize) -> Result<()> {
        let reusable = self
            .host_logits
            .as_mut()
            .and_then(std::sync::Arc::get_mut)
            .is_some_and(|r| r.buf.len() >= len);
        if !reusable {
            let vocab = self.cfg.vocab_size().max(1);
            let rows = budget::rows_cap(len.div_ceil(vocab)).min(self.s.rows);
            let room = len.max(rows.saturating_mul(vocab));
            // The old buffer goes first (or with the engine's last rows of it).
            self.host_logits = None;
            self.host_logits = Some(std::sync::Arc::new(PinnedRows::new(&self.dev, room)?));
        }
        Ok(())
    }

    /// Finds each of the step's `n` rows' greedy token on the device and queues the copy of their ids
    /// to the host (landed at the next synchronisation): each row's segments are read by blocks of
    /// their own (`argmax_part`, into the attention partials, which the step has finished with and made
    /// room for: [`argmax_part_len`]), then merged (`argmax_merge`).
    fn argmax_ids(&mut self, n: usize) -> Result<Vec<u32>> {
        let vocab = self.cfg.vocab_size();
        let segs = argmax_segments(vocab);
        self.dev.launch(
            "argmax_part",
            (n as u32, segs as u32, 1),
            256,
            &[
                Arg::Ptr(self.dev.ptr(&self.s.logits)),
                Arg::Ptr(self.dev.ptr(&self.s.part)),
                Arg::I32(vocab as i32),
                Arg::I32(ARGMAX_SEG as i32),
            ],
        )?;
        self.dev.launch(
            "argmax_merge",
            (n as u32, 1, 1),
            32,
            &[
                Arg::Ptr(self.dev.ptr(&self.s.logits)),
                Arg::Ptr(self.dev.ptr(&self.s.part)),
                Arg::Ptr(self.dev.ptr(&self.s.ids)),
                Arg::I32(vocab as i32),
                Arg::I32(segs as i32),
            ],
        )?;
        let mut out = vec![0u32; n];
        self.dev
            .stream
            .memcpy_dtoh(&self.s.ids.slice(0..n), &mut out)?;
        Ok(out)
    }

    /// [`CudaExecutor::forward_greedy`] launch by launch, timing each kernel and product: milliseconds
    /// per name, largest first, with the number of launches.
    pub fn profile_greedy(&mut self, batch: &[SeqInput<'_>]) -> Result<Vec<(String, f64, usize)>> {
        let graphs = std::mem::replace(&mut self.use_graphs, false);
        let start = self.dev.profile_begin()?;
        let run = self.forward_greedy(batch);
        let profile = self.dev.profile_end(start);
        self.use_graphs = graphs;
        run?;
        profile
    }

    fn check_block(&self, block: u32) -> Result<usize> {
        let b = block as usize;
        if b >= self.num_blocks {
            return Err(CudaError::Batch(format!(
                "block {block} is outside the pool of {} blocks",
                self.num_blocks
            )));
        }
        Ok(b)
    }

    /// [`CudaExecutor::check_block`], and that a host buffer of `len` bytes holds exactly one block.
    fn check_block_bytes(&self, block: u32, len: usize) -> Result<usize> {
        let b = self.check_block(block)?;
        if len != self.block_bytes {
            return Err(CudaError::Batch(format!(
                "a block is {} bytes, not {len}",
                self.block_bytes
            )));
        }
        Ok(b)
    }

    /// Copies slots `0..num_tokens` of every layer's K and V of block `src` into `dst`.
    pub fn try_copy_block_prefix(&mut self, src: u32, dst: u32, num_tokens: usize) -> Result<()> {
        let (s, d) = (self.check_block(src)?, self.check_block(dst)?);
        self.dev.ctx.bind_to_thread()?;
        self.after_stores_of([dst])?;
        self.after_imports_of(&[src, dst])?;
        let bs = self.shape.block_size as usize;
        if num_tokens > bs {
            return Err(CudaError::Batch(format!(
                "{num_tokens} tokens do not fit a block of {bs}"
            )));
        }
        let runs = self.cfg.num_layers() * 2 * self.cfg.num_kv_heads();
        self.dev.ctx.bind_to_thread()?;
        // A region's rows (f32, bf16) or its payload rows and scale rows (fp8).
        let (kernel, last) = match self.kv_dtype {
            KvDtype::Fp8 => ("copy_block_prefix_fp8", self.cfg.head_dim()),
            dtype => ("copy_block_prefix", row_bytes(dtype, self.cfg.head_dim())),
        };
        self.dev.launch(
            kernel,
            (runs as u32, 1, 1),
            256,
            &[
                Arg::Ptr(self.dev.ptr(&self.pool)),
                Arg::I32(s as i32),
                Arg::I32(d as i32),
                Arg::I32(num_tokens as i32),
                Arg::Usize(self.block_bytes as u64),
                Arg::I32(bs as i32),
                Arg::I32(last as i32),
            ],
        )
    }

    /// Block `block`'s bytes (every layer's K then V), as the CPU pool exports them.
    pub fn try_export_block(&self, block: u32, out: &mut [u8]) -> Result<()> {
        let b = self.check_block_bytes(block, out.len())?;
        self.dev.ctx.bind_to_thread()?;
        if self.export_over_imports(block, out)? {
            return Ok(());
        }
        let at = b * self.block_bytes;
        self.dev
            .stream
            .memcpy_dtoh(&self.pool.slice(at..at + self.block_bytes), out)?;
        self.dev.synchronize()
    }

    /// Overwrites block `block` with `bytes` as [`CudaExecutor::try_export_block`] wrote them.
    pub fn try_import_block(&mut self, block: u32, bytes: &[u8]) -> Result<()> {
        let b = self.check_block_bytes(block, bytes.len())?;
        self.dev.ctx.bind_to_thread()?;
        self.after_stores_of([block])?;
        self.after_imports_of(&[block])?;
        let at = b * self.block_bytes;
        let mut view = self.pool.slice_mut(at..at + self.block_bytes);
        self.dev.stream.memcpy_htod(bytes, &mut view)?;
        self.dev.synchronize()
    }
}

impl Executor for CudaExecutor {
    fn forward(&mut self, batch: &[SeqInput<'_>]) -> std::result::Result<Vec<Vec<f32>>, ExecError> {
        let vocab = self.cfg.vocab_size();
        let flat = self.forward_logits(batch)?;
        Ok(flat.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
    }

    fn forward_rows(
        &mut self,
        batch: &[SeqInput<'_>],
        wants: &[Want],
    ) -> std::result::Result<Vec<Row>, ExecError> {
        Ok(CudaExecutor::forward_rows(self, batch, wants)?)
    }

    fn forward_tails(
        &mut self,
        batch: &[SeqInput<'_>],
        wants: &[Want],
        tails: &[usize],
    ) -> std::result::Result<Vec<Vec<Row>>, ExecError> {
        Ok(CudaExecutor::forward_tails(self, batch, wants, tails)?)
    }

    fn forward_every_position(
        &mut self,
        item: SeqInput<'_>,
    ) -> std::result::Result<Vec<f32>, ExecError> {
        Ok(CudaExecutor::forward_every_position(self, item)?)
    }

    fn copy_block_prefix(
        &mut self,
        src: u32,
        dst: u32,
        num_tokens: usize,
    ) -> std::result::Result<(), ExecError> {
        Ok(self.try_copy_block_prefix(src, dst, num_tokens)?)
    }

    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn export_block(&self, block: u32, out: &mut [u8]) -> std::result::Result<(), ExecError> {
        Ok(self.try_export_block(block, out)?)
    }

    fn import_block(&mut self, block: u32, bytes: &[u8]) -> std::result::Result<(), ExecError> {
        Ok(self.try_import_block(block, bytes)?)
    }

    fn start_import(&mut self, block: u32, bytes: &[u8]) -> std::result::Result<bool, ExecError> {
        Ok(self.try_start_import(block, bytes)?)
    }

    fn start_export(&mut self, block: u32, out: &mut [u8]) -> std::result::Result<bool, ExecError> {
        Ok(self.try_start_export(block, out)?)
    }

    fn imports_ordered(&self) -> bool {
        self.ordered_imports
    }

    fn exports_fence(&mut self) -> std::result::Result<(), ExecError> {
        Ok(self.try_stores_fence()?)
    }

    fn exports_fence_slot(&mut self, slot: &[u8]) -> std::result::Result<(), ExecError> {
        Ok(self.try_stores_fence_slot(slot)?)
    }

    fn imports_done(
        &mut self,
        wait: std::time::Duration,
        done: &mut Vec<(u32, std::time::Duration)>,
    ) -> std::result::Result<(), ExecError> {
        Ok(self.try_imports_done(wait, done)?)
    }

    fn register_host_region(&mut self, region: &mut [u8]) -> bool {
        match self.dev.pin_host(region) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(
                    "the host KV tier stays pageable ({} bytes could not be pinned: {e}); its copies \
                     to and from the GPU run slower",
                    region.len()
                );
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lim() -> StepLimits {
        StepLimits {
            block_size: 4,
            num_blocks: 10,
            vocab: 100,
            max_context: 64,
            window: None,
            prefill_min: 3,
            max_tokens: 1000,
        }
    }

    #[test]
    fn a_step_packs_tokens_slots_tables_and_routes_sequences_by_length() {
        // Sequence 0: 5 new tokens from position 2 (prefill kernel, one tile); sequence 1: one decode
        // token at position 6 (split kernel).
        let (t0, t1) = ([10u32, 11, 12, 13, 14], [20u32]);
        let (b0, b1) = ([7u32, 3], [1u32, 9, 5]);
        let p = plan_step(
            &[SeqInput::new(&t0, 2, &b0), SeqInput::new(&t1, 6, &b1)],
            lim(),
        )
        .unwrap();
        assert_eq!((p.n_tokens, p.n_seqs), (6, 2));
        assert_eq!(&p.meta[p.at_tokens..p.at_pos], &[10, 11, 12, 13, 14, 20]);
        assert_eq!(&p.meta[p.at_pos..p.at_slots], &[2, 3, 4, 5, 6, 6]);
        // (block, slot) of each new token: positions 2, 3 in block 7; 4, 5, 6 in block 3; 6 in block 9.
        assert_eq!(
            &p.meta[p.at_slots..p.at_last],
            &[7, 2, 7, 3, 3, 0, 3, 1, 3, 2, 9, 2]
        );
        assert_eq!(p.blocks_written().collect::<Vec<_>>(), [7, 7, 3, 3, 3, 9]);
        assert_eq!(&p.meta[p.at_last..p.at_tok_info], &[4, 5]);
        assert_eq!((p.split_tokens, p.tiles, p.max_splits), (1, 1, 1));
        // The decode token: row 5, position 6, its table at 2, no window.
        assert_eq!(&p.meta[p.at_tok_info..p.at_tiles], &[5, 6, 2, 0]);
        // The tile: rows 0..5 from position 2, table at 0.
        assert_eq!(&p.meta[p.at_tiles..p.at_tables], &[0, 5, 2, 0]);
        // Last, only the blocks the positions reach: 2 of sequence 0's, 2 of sequence 1's (of 3 given).
        assert_eq!(&p.meta[p.at_tables..], &[7, 3, 1, 9]);
    }

    #[test]
    fn tails_put_each_sequences_last_rows_before_the_next_sequences_and_bad_tails_are_refused() {
        // A 4-token draft check (rows 0..4, its last 3 asked) beside a lone decode token (row 4) and a
        // 2-token item asking only its last: rows 1, 2, 3, 4, 6 — and every offset after them moved
        // by the two extra rows.
        let (t0, t1, t2) = ([10u32, 11, 12, 13], [20u32], [30u32, 31]);
        let (b0, b1, b2) = ([0u32, 1], [2u32, 3], [4u32]);
        let batch = [
            SeqInput::new(&t0, 3, &b0),
            SeqInput::new(&t1, 5, &b1),
            SeqInput::new(&t2, 0, &b2),
        ];
        let p = plan_tails(&batch, &[3, 1, 1], lim()).unwrap();
        assert_eq!((p.n_tokens, p.n_seqs, p.n_rows), (7, 3, 5));
        assert_eq!(&p.meta[p.at_last..p.at_tok_info], &[1, 2, 3, 4, 6]);
        let plain = plan_step(&batch, lim()).unwrap();
        assert_eq!(plain.n_rows, 3);
        assert_eq!(&plain.meta[plain.at_last..plain.at_tok_info], &[3, 4, 6]);
        // The same metadata after the rows: the step is the same, only its output head differs.
        assert_eq!(&p.meta[p.at_tok_info..], &plain.meta[plain.at_tok_info..]);
        assert_eq!(plan_tails(&batch, &[1, 1, 1], lim()).unwrap(), plain);
        for (tails, expect) in [
            (
                &[0usize, 1, 1][..],
                "sequence 0: 0 rows of logits asked of its 4 new tokens",
            ),
            (
                &[1, 2, 1],
                "sequence 1: 2 rows of logits asked of its 1 new tokens (1 to 1",
            ),
            (&[1, 1], "2 tails asked of a step of 3 sequences"),
        ] {
            let err = plan_tails(&batch, tails, lim()).unwrap_err().to_string();
            assert!(err.contains(expect), "{tails:?}: {err}");
        }
    }

    #[test]
    fn long_prompts_make_tiles_of_128_and_long_contexts_more_splits() {
        let t: Vec<u32> = vec![1; 150];
        let table: Vec<u32> = (0..40).collect();
        let l = StepLimits {
            num_blocks: 40,
            max_context: 1000,
            prefill_min: 64,
            ..lim()
        };
        let p = plan_step(&[SeqInput::new(&t, 0, &table)], l).unwrap();
        assert_eq!(p.tiles, 2);
        assert_eq!(
            &p.meta[p.at_tiles..p.at_tables],
            &[0, 128, 0, 0, 128, 22, 128, 0]
        );
        // One token at position 150 sees 151 keys: two splits of 128; at 300, three, rounded up to
        // four (graph shapes come in powers of two).
        let one = [5u32];
        let p = plan_step(&[SeqInput::new(&one, 150, &table)], l).unwrap();
        assert_eq!((p.split_tokens, p.max_splits), (1, 2));
        let big: Vec<u32> = (0..80).collect();
        let l80 = StepLimits {
            num_blocks: 80,
            ..l
        };
        let p = plan_step(
            &[
                SeqInput::new(&one, 300, &big[..76]),
                SeqInput::new(&one, 10, &big[76..]),
            ],
            l80,
        )
        .unwrap();
        assert_eq!((p.split_tokens, p.max_splits), (2, 4));
        // A window of 100 keeps keys 51..=150: one split, starting at 51.
        let p = plan_step(
            &[SeqInput::new(&one, 150, &table)],
            StepLimits {
                window: Some(100),
                ..l
            },
        )
        .unwrap();
        assert_eq!(p.max_splits, 1);
        assert_eq!(&p.meta[p.at_tok_info..p.at_tiles], &[0, 150, 0, 51]);
    }

    #[test]
    fn bad_batches_are_refused_by_name_before_anything_reaches_the_device() {
        let cases: Vec<(Vec<u32>, usize, Vec<u32>, &str)> = vec![
            (vec![], 0, vec![0], "no new tokens"),
            (vec![1, 2], 0, vec![10], "outside the pool"),
            (vec![1; 5], 0, vec![0], "cannot hold"),
            (vec![100], 0, vec![0], "outside the vocabulary"),
            (vec![1], 64, vec![0; 17], "beyond the model's context"),
        ];
        for (tokens, start, table, expect) in cases {
            let err = plan_step(&[SeqInput::new(&tokens, start, &table)], lim())
                .unwrap_err()
                .to_string();
            assert!(err.contains(expect), "{expect}: {err}");
        }
        // Two new tokens writing one slot.
        let (a, b) = ([1u32], [2u32]);
        let table = [0u32];
        let err = plan_step(
            &[SeqInput::new(&a, 1, &table), SeqInput::new(&b, 1, &table)],
            lim(),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("also writes"), "{err}");
        // More new tokens than the kernels index (7 over two sequences where a step takes 6).
        let (long, short) = ([1u32; 4], [1u32; 3]);
        let (ta, tb) = ([1u32, 2], [3u32]);
        let err = plan_step(
            &[SeqInput::new(&long, 0, &ta), SeqInput::new(&short, 0, &tb)],
            StepLimits {
                max_tokens: 6,
                ..lim()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("at most 6"), "{err}");
        // Layer pages (a hybrid pool) are the CPU's.
        let pages = [0u32; 4];
        let s = SeqInput {
            tokens: &a,
            start_pos: 0,
            block_table: &table,
            layer_pages: &pages,
        };
        assert!(plan_step(&[s], lim())
            .unwrap_err()
            .to_string()
            .contains("whole-model blocks"));
        assert!(plan_step(&[], lim()).is_err());
    }

    #[test]
    fn the_pool_block_is_every_layers_k_and_v() {
        let cfg = kura_checkpoint::ModelConfig::from_hf_json(
            r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":4096,
            "intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,
            "num_key_value_heads":8,"vocab_size":128256,"rms_norm_eps":1e-5,"rope_theta":500000.0,
            "max_position_embeddings":131072}"#,
        )
        .unwrap();
        // Llama-3.1-8B: 131,072 bytes of bf16 KV per token.
        assert_eq!(block_bytes(&cfg, KvDtype::Bf16, 1), 131_072);
        assert_eq!(block_bytes(&cfg, KvDtype::Bf16, 16), 16 * 131_072);
        assert_eq!(block_bytes(&cfg, KvDtype::F32, 16), 32 * 131_072);
        // The CPU pool's layout agrees: a block moves between the two byte for byte.
        let layout = cfg.kv_layout(KvDtype::Bf16, 16).unwrap();
        assert_eq!(
            layout.bytes_per_block() as usize,
            block_bytes(&cfg, KvDtype::Bf16, 16)
        );
        // fp8: a byte an element and an f16 scale per 64 (132 bytes a row of 128), the same bytes a
        // block as the engine's layout counts; blocks of a multiple of 8 tokens only (16-byte rows).
        assert_eq!(block_bytes(&cfg, KvDtype::Fp8, 16), 16 * 32 * 2 * 8 * 132);
        for bs in [8, 16, 256] {
            let layout = cfg.kv_layout(KvDtype::Fp8, bs).unwrap();
            assert_eq!(
                layout.bytes_per_block() as usize,
                block_bytes(&cfg, KvDtype::Fp8, bs)
            );
            assert!(check_pool_format(KvDtype::Fp8, bs).is_ok());
        }
        for bs in [1, 4, 12] {
            let e = check_pool_format(KvDtype::Fp8, bs).unwrap_err().to_string();
            assert!(e.contains("multiple of 8"), "{e}");
        }
        let e = check_pool_format(KvDtype::Int8, 16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("int8") && e.contains("bf16, f32 or fp8"), "{e}");
        for bs in [0, 257, 1024] {
            let e = check_pool_format(KvDtype::Bf16, bs)
                .unwrap_err()
                .to_string();
            assert!(e.contains("blocks of 1 to 256 tokens"), "{e}");
        }
        assert!(check_pool_format(KvDtype::Bf16, 1).is_ok());
        assert!(check_pool_format(KvDtype::F32, 256).is_ok());
    }

    #[test]
    fn the_split_kernels_partials_stay_within_their_cap_in_waves() {
        // Llama-3.1-8B's 32 heads of 128: at 1,024 tokens of context (16 splits, rounded) a batch of
        // 64 fits one wave; at 131,072 (1,024 splits) each token's partials are 17 MB, 3 a wave.
        let per = |splits: usize| 32 * splits * 130 * 4;
        let cap = PART_CAP_BYTES;
        assert_eq!(split_wave(64, 32, 16, 128, cap), 64);
        let w = split_wave(64, 32, 1024, 128, cap);
        assert_eq!(w, 3);
        assert!(w * per(1024) <= cap && (w + 1) * per(1024) > cap);
        // One token past the cap still runs, alone; nothing splits no wave.
        assert_eq!(split_wave(5, 32, 8192, 128, cap), 1);
        assert_eq!(split_wave(0, 32, 0, 128, cap), 1);
    }

    #[test]
    fn devices_are_named_cpu_cuda_or_cuda_n() {
        use crate::device::parse_device;
        assert_eq!(parse_device("cpu"), Ok(None));
        assert_eq!(parse_device("cuda"), Ok(Some(0)));
        assert_eq!(parse_device("cuda:3"), Ok(Some(3)));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1"] {
            assert!(
                parse_device(bad)
                    .unwrap_err()
                    .contains("cpu, cuda or cuda:N"),
                "{bad}"
            );
        }
    }
}
