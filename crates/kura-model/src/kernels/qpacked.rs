//! Quantized weights kept packed (`--weights-dtype native`): 4- or 8-bit unsigned values in blocks of 32
//! columns, each block of each row with an f16 scale and an f16 offset, multiplied by int8 activations
//! with integer dot products (AVX-512 VNNI `vpdpbusd`), as llama.cpp multiplies its Q4_1 and Q8_0 blocks.
//!
//! Every GGUF block format the runtime keeps maps onto `w = scale · u + min` exactly (see
//! [`crate::quant::unpack_row`]): Q4_0, Q4_1 and Q4_K as 4-bit `u`; Q8_0, Q5_0, Q5_1 and Q5_K as 8-bit `u`
//! (a Q8_0 value `q` is `u = q + 128` with `min = −128 · scale`).
//!
//! Layout: rows in panels of [`QROWS`] = 16; a panel is a run of block records, one per 32 columns:
//!
//! ```text
//! 4-bit record (320 B): 4 × 64 B of values | 16 × f16 scales | 16 × f16 offsets
//!   value vector v, byte 4r + k = u[r][8v + k] | u[r][8v + 4 + k] << 4     (r: row of the panel)
//! 8-bit record (576 B): 8 × 64 B of values | 16 × f16 scales | 16 × f16 offsets
//!   value vector v, byte 4r + k = u[r][4v + k]
//! ```
//!
//! so that one `vpdpbusd` of a value vector with four activation bytes broadcast adds four columns of
//! 16 rows into 16 lanes: no horizontal sums. The activations of a token are int8 in the same blocks of 32
//! with an f32 scale `dx` and `sx = dx · Σq` per block ([`quantize_act_row`]); a block contributes
//! `(Σ u·q) · (scale · dx)` to its row's sum of products and `min · sx` to its sum of offsets, each
//! added block after block in column order with fused multiply-adds; the row's result is their sum. The integer sums are exact, so the portable loop gives the same bits as the vector
//! kernel, and a token's result does not depend on the batch it is in (batch invariance).
//!
//! Cost: a decode step reads 5 bits per weight (4-bit) or 9 bits (8-bit): the file's Q4_1 size and a
//! little more than Q8_0.

use half::f16;

use super::arena::{Plain, Stored};

#[cfg(target_arch = "x86_64")]
mod amx;

use super::dot::{Isa, Vnni};
use super::team::{self, chunk_tokens, SharedMut, Team};

/// Rows per panel: the 16 i32 lanes of a 512-bit register.
pub const QROWS: usize = 16;
/// Columns per block: one scale and one offset each.
pub const QBLOCK: usize = 32;
/// Tokens per register tile.
const TILE_TOKENS: usize = 8;
/// Tokens per cache chunk in prefill.
const CHUNK_TOKENS: usize = 64;
/// Tokens per AMX tile (the rows of its A tile).
const AMX_TOKENS: usize = 16;
/// Products of fewer tokens take the VNNI kernel: a work item's unpacked 4-bit panel then serves too
/// few tiles (a decode step of 32 sequences ran 7 % slower on AMX; products of 64 tokens and more are
/// faster). Work items of 128 tokens rather than 64 made prefill slower.
const AMX_FROM: usize = 64;
/// Up to this many tokens, threads split rows only, so that each weight is read from memory once.
const ROWS_ONLY_UP_TO: usize = 16;

/// Bits per stored value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QBits {
    U4,
    U8,
}

impl QBits {
    /// The largest value `u` may hold.
    pub fn max_value(self) -> u8 {
        match self {
            QBits::U4 => 15,
            QBits::U8 => 255,
        }
    }

    fn value_bytes(self) -> usize {
        match self {
            QBits::U4 => QROWS * QBLOCK / 2,
            QBits::U8 => QROWS * QBLOCK,
        }
    }

    /// Bytes of one block record: values, then 16 f16 scales and 16 f16 offsets.
    fn record_bytes(self) -> usize {
        self.value_bytes() + 4 * QROWS
    }
}

/// One cache line: the records are 64-byte aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct Line([u8; 64]);

// SAFETY: 64 plain bytes, aligned to 64 (the arena's alignment).
unsafe impl Plain for Line {}

/// One row of a matrix as [`PackedQ::build`] takes it: `u` (one value per column, at most
/// [`QBits::max_value`]) and each block's scale and offset.
pub struct QRow {
    pub u: Vec<u8>,
    pub scale: Vec<f32>,
    pub min: Vec<f32>,
}

impl QRow {
    pub fn new(cols: usize) -> Self {
        QRow {
            u: vec![0; cols],
            scale: vec![0.0; cols / QBLOCK],
            min: vec![0.0; cols / QBLOCK],
        }
    }
}

/// A `[rows, cols]` matrix of quantized weights in the panel layout above.
#[derive(Clone)]
pub struct PackedQ {
    pub rows: usize,
    pub cols: usize,
    pub bits: QBits,
    blocks: usize,
    panels: usize,
    /// The records, 64-byte aligned (in the model's [`super::arena::WeightArena`] once loaded).
    pub(crate) data: Stored<Line>,
}

impl PackedQ {
    /// Packs `rows` rows, `fill(r, row)` giving row `r`. `cols` is a multiple of [`QBLOCK`].
    pub fn build(
        rows: usize,
        cols: usize,
        bits: QBits,
        mut fill: impl FnMut(usize, &mut QRow),
    ) -> Self {
        assert!(cols.is_multiple_of(QBLOCK), "cols is whole blocks of 32");
        let (blocks, panels) = (cols / QBLOCK, rows.div_ceil(QROWS));
        let rec = bits.record_bytes();
        let mut bytes = vec![0u8; panels * blocks * rec];
        let mut row = QRow::new(cols);
        for r in 0..rows {
            fill(r, &mut row);
            let (p, lane) = (r / QROWS, r % QROWS);
            for b in 0..blocks {
                let at = (p * blocks + b) * rec;
                let record = &mut bytes[at..at + rec];
                let u = &row.u[b * QBLOCK..(b + 1) * QBLOCK];
                debug_assert!(u.iter().all(|v| *v <= bits.max_value()));
                match bits {
                    QBits::U4 => {
                        for v in 0..4 {
                            for k in 0..4 {
                                record[v * 64 + 4 * lane + k] =
                                    (u[8 * v + k] & 0xF) | (u[8 * v + 4 + k] << 4);
                            }
                        }
                    }
                    QBits::U8 => {
                        for v in 0..8 {
                            record[v * 64 + 4 * lane..v * 64 + 4 * lane + 4]
                                .copy_from_slice(&u[4 * v..4 * v + 4]);
                        }
                    }
                }
                let vb = bits.value_bytes();
                record[vb + 2 * lane..vb + 2 * lane + 2]
                    .copy_from_slice(&f16::from_f32(row.scale[b]).to_le_bytes());
                let mb = vb + 2 * QROWS + 2 * lane;
                record[mb..mb + 2].copy_from_slice(&f16::from_f32(row.min[b]).to_le_bytes());
            }
        }
        let data = Stored::Own(
            bytes
                .chunks_exact(64)
                .map(|c| Line(c.try_into().expect("64-byte chunks")))
                .collect(),
        );
        PackedQ {
            rows,
            cols,
            bits,
            blocks,
            panels,
            data,
        }
    }

    /// The records, 64-byte aligned.
    fn bytes_slice(&self) -> &[u8] {
        self.data.as_bytes()
    }

    fn record(&self, p: usize, b: usize) -> &[u8] {
        let rec = self.bits.record_bytes();
        let at = (p * self.blocks + b) * rec;
        &self.bytes_slice()[at..at + rec]
    }

    /// The value, scale and offset of element `(r, c)`, as stored.
    fn parts(&self, r: usize, c: usize) -> (u8, f32, f32) {
        let (p, lane, b, j) = (r / QROWS, r % QROWS, c / QBLOCK, c % QBLOCK);
        let rec = self.record(p, b);
        let u = match self.bits {
            QBits::U4 => {
                let (v, hi, k) = (j / 8, (j % 8) / 4, j % 4);
                (rec[v * 64 + 4 * lane + k] >> (4 * hi)) & 0xF
            }
            QBits::U8 => rec[(j / 4) * 64 + 4 * lane + j % 4],
        };
        let vb = self.bits.value_bytes();
        let half = |at: usize| f16::from_le_bytes([rec[at], rec[at + 1]]).to_f32();
        (u, half(vb + 2 * lane), half(vb + 2 * QROWS + 2 * lane))
    }

    /// Element `(r, c)` as f32: `scale · u + min`.
    pub fn get(&self, r: usize, c: usize) -> f32 {
        let (u, scale, min) = self.parts(r, c);
        scale * f32::from(u) + min
    }

    /// Row `r` as f32 into `out` (an embedding lookup).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        for (c, o) in out.iter_mut().enumerate().take(self.cols) {
            *o = self.get(r, c);
        }
    }

    /// Bytes held, padding included: what a decode step reads.
    pub fn bytes(&self) -> usize {
        self.data.len() * 64
    }

    /// Bytes a `[rows, cols]` matrix of `bits` takes: what [`Self::build`] allocates.
    pub fn bytes_for(rows: usize, cols: usize, bits: QBits) -> usize {
        rows.div_ceil(QROWS) * (cols / QBLOCK) * bits.record_bytes()
    }
}

/// A token's activations quantized per block of 32: int8 values, and per block `[dx, sx]` (the scale,
/// and the scale times the sum of the values).
#[derive(Clone, Copy)]
pub struct QAct<'a> {
    /// Within ±127, as [`quantize_act_row`] makes them (the AVX2 kernel's 8-bit products rely on it).
    pub q: &'a [i8],
    pub ds: &'a [[f32; 2]],
}

/// Quantizes one row of activations (`x.len()` a multiple of 32) as llama.cpp's Q8_1: per block,
/// `dx = max|x| / 127` and `q = round(x / dx)`. With AVX-512 sixteen values at a time, with AVX2 eight:
/// the same bits as the portable loop ([`quantize_act_row_portable`]).
pub fn quantize_act_row(x: &[f32], q: &mut [i8], ds: &mut [[f32; 2]]) {
    assert!(x.len().is_multiple_of(QBLOCK) && q.len() == x.len());
    assert!(ds.len() >= x.len() / QBLOCK);
    #[cfg(target_arch = "x86_64")]
    match Isa::detect() {
        // SAFETY: AVX-512F is present; the slices hold whole blocks (asserted).
        Isa::Avx512 => unsafe { x86::quantize_act_row_avx512(x, q, ds) },
        // SAFETY: AVX2 is present; as above.
        Isa::Avx2Fma => unsafe { x86::quantize_act_row_avx2(x, q, ds) },
        Isa::Scalar => quantize_act_row_portable(x, q, ds),
    }
    #[cfg(not(target_arch = "x86_64"))]
    quantize_act_row_portable(x, q, ds);
}

/// [`quantize_act_row`] one value at a time: the reference.
pub(crate) fn quantize_act_row_portable(x: &[f32], q: &mut [i8], ds: &mut [[f32; 2]]) {
    debug_assert!(x.len().is_multiple_of(QBLOCK) && q.len() == x.len());
    for ((xb, qb), d) in x
        .chunks_exact(QBLOCK)
        .zip(q.chunks_exact_mut(QBLOCK))
        .zip(ds.iter_mut())
    {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let dx = amax / 127.0;
        let inv = if dx > 0.0 { 1.0 / dx } else { 0.0 };
        let mut sum = 0i32;
        for (qv, xv) in qb.iter_mut().zip(xb) {
            // Within ±127 whatever the block: where `dx` is subnormal, `inv` is infinite.
            let v = round_half_away(xv * inv).clamp(-127, 127);
            *qv = v as i8;
            sum += v;
        }
        *d = [dx, dx * sum as f32];
    }
}

/// `v.round() as i32` (halves away from zero; NaN to 0) for |v| ≤ 200, without a call to libm's
/// `roundf`, which the baseline x86-64 target makes of `f32::round`: truncating `v + ±(½ − ½ ulp)`
/// gives the same integer for every such float (an exhaustive check over all of them agreed; the test
/// checks the floats nearest every half and integer), and the loop vectorises.
#[inline(always)]
fn round_half_away(v: f32) -> i32 {
    const BELOW_HALF: f32 = 0.499_999_97;
    (v + BELOW_HALF.copysign(v)) as i32
}

/// `out (t × w.rows) (+)= x · Wᵀ`, dealt to the team and done when it returns; with `add` the product is
/// added to what `out` holds (a residual connection).
///
/// # Safety
/// Every thread of the team calls this with the same arguments, and nothing else touches `out` while it
/// runs.
pub unsafe fn matmul_part(
    tm: &Team<'_>,
    x: QAct<'_>,
    t: usize,
    w: &PackedQ,
    out: SharedMut<'_, f32>,
    add: bool,
) {
    // SAFETY: the caller's guarantee; the path is this CPU's.
    unsafe { matmul_part_on(Path::detect(), tm, x, t, w, out, add) }
}

/// [`matmul_part`] on a given kernel path.
///
/// # Safety
/// As [`matmul_part`]; the CPU has what `path` needs.
unsafe fn matmul_part_on(
    path: Path,
    tm: &Team<'_>,
    x: QAct<'_>,
    t: usize,
    w: &PackedQ,
    out: SharedMut<'_, f32>,
    add: bool,
) {
    assert_eq!(x.q.len(), t * w.cols, "x is t × cols");
    assert_eq!(x.ds.len(), t * w.blocks, "x has t × blocks scales");
    assert_eq!(out.len(), t * w.rows, "out is t × rows");
    let amx = path == Path::Amx && t >= AMX_FROM;
    let tile_tokens = if amx { AMX_TOKENS } else { TILE_TOKENS };
    let chunk = chunk_tokens(
        t,
        w.panels,
        tm.size(),
        (ROWS_ONLY_UP_TO, CHUNK_TOKENS, tile_tokens),
    );
    #[cfg(target_arch = "x86_64")]
    if t == 1 && path != Path::Portable {
        // One token (decode): each dealt run of panels streams through one call, into its rows of the
        // token.
        let rows =
            |panels: std::ops::Range<usize>| panels.start * QROWS..(panels.end * QROWS).min(w.rows);
        let panel_bytes = w.blocks * w.bits.record_bytes();
        let grain = team::grain(panel_bytes);
        // SAFETY: every thread passes the same arguments (this function's contract); a run of panels
        // writes its rows of the token alone; the kernel's addresses and lengths come from the matrix's
        // shape, never from the activations it reads.
        unsafe {
            tm.deal_out(w.panels, grain, out, add, rows, |panels, dest| {
                let tile = Tile {
                    panel: &w.bytes_slice()[panels.start * panel_bytes..],
                    blocks: w.blocks,
                    bits: w.bits,
                    xq: x.q,
                    xds: x.ds,
                    out: dest.as_mut_ptr(),
                    ldo: w.rows,
                    valid: dest.len(),
                    add,
                };
                let n = panels.len();
                // SAFETY: `path` was detected on this CPU; the tile's slices hold the token and the
                // panels' records, and `dest` its valid rows of them.
                match (path, w.bits) {
                    (Path::Vnni | Path::Amx, QBits::U4) => x86::panels_vnni_one::<true>(&tile, n),
                    (Path::Vnni | Path::Amx, QBits::U8) => x86::panels_vnni_one::<false>(&tile, n),
                    (_, QBits::U4) => x86::panels_avx2_one::<true>(&tile, n),
                    (_, QBits::U8) => x86::panels_avx2_one::<false>(&tile, n),
                }
            });
        }
        return;
    }
    let chunks = t.div_ceil(chunk.max(1));
    tm.deal(chunks * w.panels, |items| {
        for item in items {
            let (c, p) = (item / w.panels, item % w.panels);
            let r0 = p * QROWS;
            let valid = QROWS.min(w.rows - r0);
            let (t_lo, t_hi) = (c * chunk, ((c + 1) * chunk).min(t));
            // Tokens t0..t1 (within the chunk) × the panel's rows.
            let tile_of = |t0: usize, t1: usize| Tile {
                panel: &w.bytes_slice()[p * w.blocks * w.bits.record_bytes()..],
                blocks: w.blocks,
                bits: w.bits,
                xq: &x.q[t0 * w.cols..t1 * w.cols],
                xds: &x.ds[t0 * w.blocks..t1 * w.blocks],
                // SAFETY: rows r0..r0+valid of tokens t0..t1 lie inside `out` and belong to this work
                // item alone (the caller's guarantee on `out`).
                out: unsafe { out.ptr().add(t0 * w.rows + r0) },
                ldo: w.rows,
                valid,
                add,
            };
            #[cfg(target_arch = "x86_64")]
            if amx {
                // SAFETY: `Path::Amx` was detected on this CPU (AMX granted); the tile's slices hold
                // the chunk's tokens and the panel's records.
                unsafe { amx::tile(&tile_of(t_lo, t_hi), t_hi - t_lo) };
                continue;
            }
            let mut t0 = t_lo;
            while t0 < t_hi {
                let m = (t_hi - t0).min(TILE_TOKENS);
                let tile = tile_of(t0, t0 + m);
                // SAFETY: `path` was detected on this CPU; the tile's slices hold m tokens and the
                // panel's records.
                unsafe {
                    match path {
                        Path::Vnni | Path::Amx => x86::tile_dispatch(&tile, m),
                        Path::Avx2 => x86::tile_dispatch_avx2(&tile, m),
                        Path::Portable => tile_portable(&tile, m),
                    }
                }
                t0 += m;
            }
        }
    });
}

/// The kernel this CPU runs: AMX tiles for prefill with `vpdpbusd` for decode, `vpdpbusd` (AVX-512
/// VNNI), `vpmaddubsw` (AVX2 with FMA and F16C), or the portable loop; all four give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Amx,
    Vnni,
    Avx2,
    Portable,
}

impl Path {
    pub fn detect() -> Path {
        #[cfg(target_arch = "x86_64")]
        if amx::Amx::detect().is_some() {
            return Path::Amx;
        }
        if Vnni::detect().is_some() {
            return Path::Vnni;
        }
        #[cfg(target_arch = "x86_64")]
        if Isa::detect() != Isa::Scalar && is_x86_feature_detected!("f16c") {
            return Path::Avx2;
        }
        Path::Portable
    }
}

/// `x (t × cols) · Wᵀ` on the portable loop alone, in a region of its own: the reference the kernels'
/// tests compare with.
#[cfg(test)]
pub(crate) fn portable_product(x: &[f32], t: usize, w: &PackedQ) -> Vec<f32> {
    let mut q = vec![0i8; x.len()];
    let mut ds = vec![[0f32; 2]; t * w.blocks];
    for i in 0..t {
        quantize_act_row(
            &x[i * w.cols..(i + 1) * w.cols],
            &mut q[i * w.cols..(i + 1) * w.cols],
            &mut ds[i * w.blocks..(i + 1) * w.blocks],
        );
    }
    let mut out = vec![0f32; t * w.rows];
    let shared = SharedMut::new(&mut out);
    let act = QAct { q: &q, ds: &ds };
    // SAFETY: the portable path needs nothing of the CPU; every thread passes the same arguments.
    super::team::run(|tm| unsafe { matmul_part_on(Path::Portable, tm, act, t, w, shared, false) });
    out
}

/// A tile: up to [`TILE_TOKENS`] tokens × the 16 rows of one panel.
pub(crate) struct Tile<'a> {
    /// The panel's records from its first block on.
    panel: &'a [u8],
    blocks: usize,
    bits: QBits,
    /// The tile's tokens: `m × cols` values and `m × blocks` scales.
    xq: &'a [i8],
    xds: &'a [[f32; 2]],
    /// Output at (first token, first row of the panel); rows `ldo` apart; `valid` writable columns.
    out: *mut f32,
    ldo: usize,
    valid: usize,
    add: bool,
}

impl Tile<'_> {
    /// (blocks, columns, record bytes, value bytes) of a tile of `m` tokens whose values are 4-bit
    /// (`U4`) or 8-bit, checking that its slices hold them.
    fn shape<const U4: bool>(&self, m: usize) -> (usize, usize, usize, usize) {
        let bits = if U4 { QBits::U4 } else { QBits::U8 };
        debug_assert_eq!(bits, self.bits);
        let (blocks, cols) = (self.blocks, self.blocks * QBLOCK);
        let (rec, vb) = (bits.record_bytes(), bits.value_bytes());
        assert!(self.panel.len() >= blocks * rec && self.xq.len() >= m * cols);
        assert!(self.xds.len() >= m * blocks);
        (blocks, cols, rec, vb)
    }
}

/// The reference: the same integer sums and the same fused multiply-adds in the same order as the vector
/// kernel, one lane at a time.
///
/// # Safety
/// `tile.out` has `m` rows (stride `ldo`) with `valid` writable columns each, touched by no other thread.
unsafe fn tile_portable(tile: &Tile<'_>, m: usize) {
    let cols = tile.blocks * QBLOCK;
    let rec = tile.bits.record_bytes();
    let vb = tile.bits.value_bytes();
    let half = |r: &[u8], at: usize| f16::from_le_bytes([r[at], r[at + 1]]).to_f32();
    for i in 0..m {
        for lane in 0..tile.valid {
            let (mut products, mut offsets) = (0f32, 0f32);
            for b in 0..tile.blocks {
                let record = &tile.panel[b * rec..(b + 1) * rec];
                let xq = &tile.xq[i * cols + b * QBLOCK..i * cols + (b + 1) * QBLOCK];
                let mut isum = 0i32;
                for (j, &q) in xq.iter().enumerate() {
                    let u = match tile.bits {
                        QBits::U4 => {
                            let (v, hi, k) = (j / 8, (j % 8) / 4, j % 4);
                            (record[v * 64 + 4 * lane + k] >> (4 * hi)) & 0xF
                        }
                        QBits::U8 => record[(j / 4) * 64 + 4 * lane + j % 4],
                    };
                    isum += i32::from(u) * i32::from(q);
                }
                let [dx, sx] = tile.xds[i * tile.blocks + b];
                let (scale, min) = (
                    half(record, vb + 2 * lane),
                    half(record, vb + 32 + 2 * lane),
                );
                products = (isum as f32).mul_add(scale * dx, products);
                offsets = min.mul_add(sx, offsets);
            }
            let acc = products + offsets;
            // SAFETY: the caller's guarantee on `out`.
            unsafe {
                let p = tile.out.add(i * tile.ldo + lane);
                *p = if tile.add { *p + acc } else { acc };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{QBits, Tile, QBLOCK, QROWS};

    /// [`super::quantize_act_row_portable`] sixteen values at a time, each step the same IEEE operation
    /// on each value: the largest magnitude (a NaN is passed over, as `f32::max` does), `dx` and its
    /// inverse, `x · inv` rounded half away from zero by the same truncation of `v ± (½ − ½ ulp)` (a NaN
    /// to 0, as `as i32` does) within ±127, and the exact integer sum.
    ///
    /// # Safety
    /// avx512f is present; `x` and `q` hold the same whole blocks, `ds` one entry per block.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn quantize_act_row_avx512(x: &[f32], q: &mut [i8], ds: &mut [[f32; 2]]) {
        let magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFF_FFFF));
        let sign = _mm512_castsi512_ps(_mm512_set1_epi32(i32::MIN));
        let below_half = _mm512_set1_ps(0.499_999_97);
        let (lowest, highest) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        for ((xb, qb), d) in x
            .chunks_exact(QBLOCK)
            .zip(q.chunks_exact_mut(QBLOCK))
            .zip(ds.iter_mut())
        {
            // SAFETY: each block is 32 values and 32 bytes.
            unsafe {
                let v = [
                    _mm512_loadu_ps(xb.as_ptr()),
                    _mm512_loadu_ps(xb.as_ptr().add(16)),
                ];
                // `max(a, m)` gives m where a is NaN; m is never NaN.
                let mut m = _mm512_setzero_ps();
                for h in v {
                    m = _mm512_max_ps(_mm512_and_ps(h, magnitude), m);
                }
                let amax = _mm512_reduce_max_ps(m);
                let dx = amax / 127.0;
                let inv = _mm512_set1_ps(if dx > 0.0 { 1.0 / dx } else { 0.0 });
                let mut sum = _mm512_setzero_si512();
                for (k, h) in v.into_iter().enumerate() {
                    let y = _mm512_mul_ps(h, inv);
                    let r = _mm512_add_ps(y, _mm512_or_ps(below_half, _mm512_and_ps(y, sign)));
                    let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(r, r);
                    // Clamped before the truncation, which gives i32::MIN for +∞ where `as i32`
                    // saturates (the portable loop clamps the integer).
                    let r = _mm512_min_ps(_mm512_max_ps(r, lowest), highest);
                    let i = _mm512_maskz_cvttps_epi32(ordered, r);
                    sum = _mm512_add_epi32(sum, i);
                    _mm_storeu_si128(qb.as_mut_ptr().add(16 * k).cast(), _mm512_cvtepi32_epi8(i));
                }
                *d = [dx, dx * _mm512_reduce_add_epi32(sum) as f32];
            }
        }
    }

    /// [`quantize_act_row_avx512`] eight values at a time.
    ///
    /// # Safety
    /// avx2 is present; `x` and `q` hold the same whole blocks, `ds` one entry per block.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_act_row_avx2(x: &[f32], q: &mut [i8], ds: &mut [[f32; 2]]) {
        let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let sign = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
        let below_half = _mm256_set1_ps(0.499_999_97);
        let (lowest, highest) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        for ((xb, qb), d) in x
            .chunks_exact(QBLOCK)
            .zip(q.chunks_exact_mut(QBLOCK))
            .zip(ds.iter_mut())
        {
            // SAFETY: each block is 32 values and 32 bytes.
            unsafe {
                let v: [__m256; 4] =
                    std::array::from_fn(|k| _mm256_loadu_ps(xb.as_ptr().add(8 * k)));
                let mut m = _mm256_setzero_ps();
                for h in v {
                    m = _mm256_max_ps(_mm256_and_ps(h, magnitude), m);
                }
                let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
                let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
                let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
                let dx = amax / 127.0;
                let inv = _mm256_set1_ps(if dx > 0.0 { 1.0 / dx } else { 0.0 });
                let i: [__m256i; 4] = v.map(|h| {
                    let y = _mm256_mul_ps(h, inv);
                    let r = _mm256_add_ps(y, _mm256_or_ps(below_half, _mm256_and_ps(y, sign)));
                    let ordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
                    let r = _mm256_min_ps(_mm256_max_ps(r, lowest), highest);
                    _mm256_and_si256(_mm256_cvttps_epi32(r), ordered)
                });
                let sum =
                    _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
                let s = _mm_add_epi32(
                    _mm256_castsi256_si128(sum),
                    _mm256_extracti128_si256::<1>(sum),
                );
                let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
                let s = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<1>(s)));
                // Within ±127, so the saturating packs are exact; they interleave 128-bit lanes,
                // which the permutation undoes.
                let packed = _mm256_packs_epi16(
                    _mm256_packs_epi32(i[0], i[1]),
                    _mm256_packs_epi32(i[2], i[3]),
                );
                let ordered =
                    _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256(qb.as_mut_ptr().cast(), ordered);
                *d = [dx, dx * s as f32];
            }
        }
    }

    /// # Safety
    /// avx512f, avx512bw and avx512vnni are present; see [`super::tile_portable`] for `out`.
    pub(super) unsafe fn tile_dispatch(tile: &Tile<'_>, m: usize) {
        // SAFETY: the caller's guarantee.
        unsafe {
            match (tile.bits, m) {
                (QBits::U4, 1) => tile_vnni::<1, true>(tile),
                (QBits::U4, 2) => tile_vnni::<2, true>(tile),
                (QBits::U4, 3) => tile_vnni::<3, true>(tile),
                (QBits::U4, 4) => tile_vnni::<4, true>(tile),
                (QBits::U4, 5) => tile_vnni::<5, true>(tile),
                (QBits::U4, 6) => tile_vnni::<6, true>(tile),
                (QBits::U4, 7) => tile_vnni::<7, true>(tile),
                (QBits::U4, _) => tile_vnni::<8, true>(tile),
                (QBits::U8, 1) => tile_vnni::<1, false>(tile),
                (QBits::U8, 2) => tile_vnni::<2, false>(tile),
                (QBits::U8, 3) => tile_vnni::<3, false>(tile),
                (QBits::U8, 4) => tile_vnni::<4, false>(tile),
                (QBits::U8, 5) => tile_vnni::<5, false>(tile),
                (QBits::U8, 6) => tile_vnni::<6, false>(tile),
                (QBits::U8, 7) => tile_vnni::<7, false>(tile),
                (QBits::U8, _) => tile_vnni::<8, false>(tile),
            }
        }
    }

    /// The AVX2 kernel in groups of up to 4 tokens (16 registers hold no more).
    ///
    /// # Safety
    /// avx2, fma and f16c are present; see [`super::tile_portable`] for `out`.
    pub(super) unsafe fn tile_dispatch_avx2(tile: &Tile<'_>, m: usize) {
        let cols = tile.blocks * QBLOCK;
        let mut t0 = 0;
        while t0 < m {
            let g = (m - t0).min(4);
            let sub = Tile {
                panel: tile.panel,
                blocks: tile.blocks,
                bits: tile.bits,
                xq: &tile.xq[t0 * cols..],
                xds: &tile.xds[t0 * tile.blocks..],
                // SAFETY: token t0 < m of the tile's output (caller's guarantee).
                out: unsafe { tile.out.add(t0 * tile.ldo) },
                ldo: tile.ldo,
                valid: tile.valid,
                add: tile.add,
            };
            // SAFETY: the caller's guarantee, for g of its tokens.
            unsafe {
                match (tile.bits, g) {
                    (QBits::U4, 1) => panels_avx2_one::<true>(&sub, 1),
                    (QBits::U4, 2) => tile_avx2::<2, true>(&sub),
                    (QBits::U4, 3) => tile_avx2::<3, true>(&sub),
                    (QBits::U4, _) => tile_avx2::<4, true>(&sub),
                    (QBits::U8, 1) => panels_avx2_one::<false>(&sub, 1),
                    (QBits::U8, 2) => tile_avx2::<2, false>(&sub),
                    (QBits::U8, 3) => tile_avx2::<3, false>(&sub),
                    (QBits::U8, _) => tile_avx2::<4, false>(&sub),
                }
            }
            t0 += g;
        }
    }

    /// `M` tokens × 16 rows as two halves of 8: `vpmaddubsw` of 4-bit values with the activations
    /// broadcast (no 16-bit sum can saturate: a pair is at most 2 × 15 × 128, and the 8 pairs of a block
    /// are added in 16 bits before one `vpmaddwd` by ones widens them to 32-bit lanes); 8-bit values
    /// centred on 128 (`Σ (u − 128)·q + 128 · Σ q`, each product as |u − 128| times q with the sign of
    /// u − 128). The same exact integer sums as `vpdpbusd`, then the same fused multiply-adds.
    ///
    /// # Safety
    /// avx2, fma and f16c are present; the tile holds `M` tokens; see [`super::tile_portable`].
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_avx2<const M: usize, const U4: bool>(tile: &Tile<'_>) {
        let (blocks, cols, rec, vb) = tile.shape::<U4>(M);
        let (wp, xq, xds) = (tile.panel.as_ptr(), tile.xq.as_ptr(), tile.xds.as_ptr());
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let ones8 = _mm256_set1_epi8(1);
        for half in 0..2 {
            let mut acc = [[_mm256_setzero_ps(); 2]; M];
            for b in 0..blocks {
                // SAFETY: b < blocks keeps the record inside the panel and the activations inside the
                // tile's tokens (asserted above).
                unsafe {
                    let r = wp.add(b * rec);
                    let mut isum = [_mm256_setzero_si256(); M];
                    // `u · q` summed by fours (u unsigned, q signed bytes).
                    let dot4 = |u: __m256i, q: __m256i| {
                        _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), ones)
                    };
                    if U4 {
                        // The block's 8 products of pairs per 16-bit lane added in 16 bits, widened
                        // once: each is at most 2 × 15 × 128 in size, 8 of them below 2^15.
                        let mut pairs = [_mm256_setzero_si256(); M];
                        for v in 0..4 {
                            let w = _mm256_loadu_si256(r.add(v * 64 + 32 * half).cast());
                            let lo = _mm256_and_si256(w, low);
                            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(w), low);
                            for (i, p) in pairs.iter_mut().enumerate() {
                                let x = xq.add(i * cols + b * QBLOCK + 8 * v).cast::<i32>();
                                let ql = _mm256_set1_epi32(x.read_unaligned());
                                let qh = _mm256_set1_epi32(x.add(1).read_unaligned());
                                *p = _mm256_add_epi16(*p, _mm256_maddubs_epi16(lo, ql));
                                *p = _mm256_add_epi16(*p, _mm256_maddubs_epi16(hi, qh));
                            }
                        }
                        for (s, p) in isum.iter_mut().zip(&pairs) {
                            *s = _mm256_madd_epi16(*p, ones);
                        }
                    } else {
                        // s = u − 128 as a signed byte: Σ u·q = Σ s·q + 128 · Σ q, and s·q is
                        // |s| · (q signed like s), whose pairs are at most 2 × 128 × 127 < 2^15 (the
                        // activations lie within ±127): exact, one product per byte.
                        let flip = _mm256_set1_epi8(i8::MIN);
                        for v in 0..8 {
                            let w = _mm256_loadu_si256(r.add(v * 64 + 32 * half).cast());
                            let sv = _mm256_xor_si256(w, flip);
                            let mag = _mm256_abs_epi8(sv);
                            for (i, s) in isum.iter_mut().enumerate() {
                                let x = xq.add(i * cols + b * QBLOCK + 4 * v).cast::<i32>();
                                let q = _mm256_sign_epi8(_mm256_set1_epi32(x.read_unaligned()), sv);
                                *s = _mm256_add_epi32(*s, dot4(mag, q));
                            }
                        }
                        for (i, s) in isum.iter_mut().enumerate() {
                            let x = _mm256_loadu_si256(xq.add(i * cols + b * QBLOCK).cast());
                            let sum = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, x), ones);
                            let sum = _mm256_hadd_epi32(sum, sum);
                            let sum = _mm256_hadd_epi32(sum, sum);
                            let sum =
                                _mm256_add_epi32(sum, _mm256_permute2x128_si256::<1>(sum, sum));
                            *s = _mm256_add_epi32(*s, _mm256_slli_epi32::<7>(sum));
                        }
                    }
                    let scale = _mm256_cvtph_ps(_mm_loadu_si128(r.add(vb + 16 * half).cast()));
                    let min =
                        _mm256_cvtph_ps(_mm_loadu_si128(r.add(vb + 2 * QROWS + 16 * half).cast()));
                    for (i, a) in acc.iter_mut().enumerate() {
                        let [dx, sx] = *xds.add(i * blocks + b);
                        let f = _mm256_mul_ps(scale, _mm256_set1_ps(dx));
                        a[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), f, a[0]);
                        a[1] = _mm256_fmadd_ps(min, _mm256_set1_ps(sx), a[1]);
                    }
                }
            }
            let lanes = tile.valid.saturating_sub(8 * half).min(8);
            for (i, a) in acc.iter().enumerate() {
                let mut vals = [0f32; 8];
                // SAFETY: `vals` holds 8 floats.
                unsafe { _mm256_storeu_ps(vals.as_mut_ptr(), _mm256_add_ps(a[0], a[1])) };
                for (lane, v) in vals.iter().enumerate().take(lanes) {
                    // SAFETY: the first `valid` columns of token i are writable (caller's guarantee).
                    unsafe {
                        let p = tile.out.add(i * tile.ldo + 8 * half + lane);
                        *p = if tile.add { *p + v } else { *v };
                    }
                }
            }
        }
    }

    /// Bytes ahead of the record in use that the AVX2 one-token kernel asks the caches for: a decode
    /// step streams every weight once, and on the AVX2-only AMD EPYC the hardware prefetcher alone left
    /// the memory idle part of the time (79 % of a plain read without, about 100 % with 2 KiB; 1 and
    /// 4 KiB did less). The VNNI kernel asks for nothing ahead ([`panels_vnni_one`]).
    const PREFETCH_AHEAD: usize = 2048;

    /// One token × `panels` consecutive panels of 16 rows, each in one pass (both halves of 8 rows at
    /// once), so that each record is read once, in order, a few records behind the prefetches: the
    /// weights stream as a plain read does. The same integer sums and the same fused multiply-adds per
    /// lane as [`tile_avx2`], so the same bits. Here `tile.valid` counts the rows from the first panel's
    /// first row to the matrix's end.
    ///
    /// # Safety
    /// avx2, fma and f16c are present; the tile holds one token; `out` has `valid` writable columns,
    /// touched by no other thread.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn panels_avx2_one<const U4: bool>(tile: &Tile<'_>, panels: usize) {
        let (blocks, _, rec, _) = tile.shape::<U4>(1);
        assert!(tile.panel.len() >= panels * blocks * rec && tile.valid > (panels - 1) * QROWS);
        for p in 0..panels {
            let one = Tile {
                panel: &tile.panel[p * blocks * rec..],
                // SAFETY: rows 16p.. of the token's output (the caller's guarantee).
                out: unsafe { tile.out.add(p * QROWS) },
                valid: (tile.valid - p * QROWS).min(QROWS),
                ..*tile
            };
            // SAFETY: the caller's guarantee, for one panel.
            unsafe { panel_avx2_one::<U4>(&one) }
        }
    }

    /// [`panels_avx2_one`] for one panel, with `tile.valid` its rows (at most 16).
    ///
    /// # Safety
    /// avx2, fma and f16c are present; the tile holds one token; see [`super::tile_portable`].
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn panel_avx2_one<const U4: bool>(tile: &Tile<'_>) {
        let (blocks, _, rec, vb) = tile.shape::<U4>(1);
        let (wp, xq, xds) = (tile.panel.as_ptr(), tile.xq.as_ptr(), tile.xds.as_ptr());
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let ones8 = _mm256_set1_epi8(1);
        let flip = _mm256_set1_epi8(i8::MIN);
        let mut acc = [[_mm256_setzero_ps(); 2]; 2];
        for b in 0..blocks {
            // SAFETY: b < blocks keeps the record inside the panel and the activations inside the
            // token (asserted above); a prefetch never faults, wherever it points.
            unsafe {
                let r = wp.add(b * rec);
                for line in (0..rec).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(PREFETCH_AHEAD + line).cast());
                }
                let x = xq.add(b * QBLOCK);
                let mut isum = [_mm256_setzero_si256(); 2];
                if U4 {
                    let mut pairs = [_mm256_setzero_si256(); 2];
                    for v in 0..4 {
                        let xv = x.add(8 * v).cast::<i32>();
                        let ql = _mm256_set1_epi32(xv.read_unaligned());
                        let qh = _mm256_set1_epi32(xv.add(1).read_unaligned());
                        for (half, p) in pairs.iter_mut().enumerate() {
                            let w = _mm256_loadu_si256(r.add(v * 64 + 32 * half).cast());
                            let lo = _mm256_and_si256(w, low);
                            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(w), low);
                            *p = _mm256_add_epi16(*p, _mm256_maddubs_epi16(lo, ql));
                            *p = _mm256_add_epi16(*p, _mm256_maddubs_epi16(hi, qh));
                        }
                    }
                    for (s, p) in isum.iter_mut().zip(&pairs) {
                        *s = _mm256_madd_epi16(*p, ones);
                    }
                } else {
                    for v in 0..8 {
                        let qv = _mm256_set1_epi32(x.add(4 * v).cast::<i32>().read_unaligned());
                        for (half, s) in isum.iter_mut().enumerate() {
                            let w = _mm256_loadu_si256(r.add(v * 64 + 32 * half).cast());
                            let sv = _mm256_xor_si256(w, flip);
                            let q = _mm256_sign_epi8(qv, sv);
                            let d = _mm256_maddubs_epi16(_mm256_abs_epi8(sv), q);
                            *s = _mm256_add_epi32(*s, _mm256_madd_epi16(d, ones));
                        }
                    }
                    let xb = _mm256_loadu_si256(x.cast());
                    let sum = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, xb), ones);
                    let sum = _mm256_hadd_epi32(sum, sum);
                    let sum = _mm256_hadd_epi32(sum, sum);
                    let sum = _mm256_add_epi32(sum, _mm256_permute2x128_si256::<1>(sum, sum));
                    let centre = _mm256_slli_epi32::<7>(sum);
                    for s in isum.iter_mut() {
                        *s = _mm256_add_epi32(*s, centre);
                    }
                }
                let [dx, sx] = *xds.add(b);
                let (dx, sx) = (_mm256_set1_ps(dx), _mm256_set1_ps(sx));
                for (half, a) in acc.iter_mut().enumerate() {
                    let scale = _mm256_cvtph_ps(_mm_loadu_si128(r.add(vb + 16 * half).cast()));
                    let min =
                        _mm256_cvtph_ps(_mm_loadu_si128(r.add(vb + 2 * QROWS + 16 * half).cast()));
                    let f = _mm256_mul_ps(scale, dx);
                    a[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[half]), f, a[0]);
                    a[1] = _mm256_fmadd_ps(min, sx, a[1]);
                }
            }
        }
        for (half, a) in acc.iter().enumerate() {
            let lanes = tile.valid.saturating_sub(8 * half).min(8);
            let mut vals = [0f32; 8];
            // SAFETY: `vals` holds 8 floats.
            unsafe { _mm256_storeu_ps(vals.as_mut_ptr(), _mm256_add_ps(a[0], a[1])) };
            for (lane, v) in vals.iter().enumerate().take(lanes) {
                // SAFETY: the first `valid` columns of the token are writable (caller's guarantee).
                unsafe {
                    let p = tile.out.add(8 * half + lane);
                    *p = if tile.add { *p + v } else { *v };
                }
            }
        }
    }

    /// One token × `panels` consecutive panels of 16 rows through `vpdpbusd`, the weights streamed in
    /// order with no software prefetch: on an AMD EPYC with AVX-512 (Zen 4) the hardware prefetchers
    /// alone read them 12–16 % sooner than with prefetches 1, 2 or 4 KiB ahead, where the AVX2 kernel
    /// on an AVX2-only AMD EPYC gained from them (`cargo bench -p kura-model --bench products`).
    /// 4-bit values: the low nibbles as they are and the high ones kept in place (16 times their
    /// value), each in a chain of its own: `Σ u·q = Σ lo·q + (Σ 16·hi·q) / 16`, an exact shift. The
    /// same integer sums and fused multiply-adds per lane as [`tile_vnni`], so the same bits.
    ///
    /// # Safety
    /// avx512f, avx512bw and avx512vnni are present; the tile holds one token; `out` has `valid`
    /// writable columns, touched by no other thread.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn panels_vnni_one<const U4: bool>(tile: &Tile<'_>, panels: usize) {
        let (blocks, _, rec, vb) = tile.shape::<U4>(1);
        assert!(tile.panel.len() >= panels * blocks * rec && tile.valid > (panels - 1) * QROWS);
        let (xq, xds) = (tile.xq.as_ptr(), tile.xds.as_ptr());
        let low = _mm512_set1_epi8(0x0F);
        let high = _mm512_set1_epi8(0xF0u8 as i8);
        for p in 0..panels {
            // SAFETY: panel p's records lie inside the tile (asserted above).
            let wp = unsafe { tile.panel.as_ptr().add(p * blocks * rec) };
            let mut products = _mm512_setzero_ps();
            let mut offsets = _mm512_setzero_ps();
            for b in 0..blocks {
                // SAFETY: b < blocks keeps the record inside the panel and the activations inside the
                // token (asserted above).
                unsafe {
                    let r = wp.add(b * rec);
                    let x = xq.add(b * QBLOCK).cast::<i32>();
                    let isum = if U4 {
                        let (mut lo, mut hi) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                        for v in 0..4 {
                            let w = _mm512_loadu_si512(r.add(v * 64).cast());
                            let ql = _mm512_set1_epi32(x.add(2 * v).read_unaligned());
                            let qh = _mm512_set1_epi32(x.add(2 * v + 1).read_unaligned());
                            lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(w, low), ql);
                            hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(w, high), qh);
                        }
                        _mm512_add_epi32(lo, _mm512_srai_epi32::<4>(hi))
                    } else {
                        let mut s = [_mm512_setzero_si512(); 2];
                        for v in 0..8 {
                            let w = _mm512_loadu_si512(r.add(v * 64).cast());
                            let q = _mm512_set1_epi32(x.add(v).read_unaligned());
                            s[v % 2] = _mm512_dpbusd_epi32(s[v % 2], w, q);
                        }
                        _mm512_add_epi32(s[0], s[1])
                    };
                    let [dx, sx] = *xds.add(b);
                    let scale = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(vb).cast()));
                    let min = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(vb + 2 * QROWS).cast()));
                    let f = _mm512_mul_ps(scale, _mm512_set1_ps(dx));
                    products = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), f, products);
                    offsets = _mm512_fmadd_ps(min, _mm512_set1_ps(sx), offsets);
                }
            }
            let valid = (tile.valid - p * QROWS).min(QROWS);
            let a = _mm512_add_ps(products, offsets);
            // SAFETY: the first `valid` of panel p's 16 rows of the token are writable (the caller's
            // guarantee).
            unsafe { store_row(tile.out.add(p * QROWS), valid, tile.add, a) };
        }
    }

    /// `M` tokens × 16 rows: per block, `vpdpbusd` of each value vector with each token's four
    /// activation bytes broadcast, then the block's scale and offset by two fused multiply-adds.
    ///
    /// # Safety
    /// See [`tile_dispatch`]; the tile holds `M` tokens.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn tile_vnni<const M: usize, const U4: bool>(tile: &Tile<'_>) {
        let (blocks, cols, rec, vb) = tile.shape::<U4>(M);
        let (wp, xq, xds) = (tile.panel.as_ptr(), tile.xq.as_ptr(), tile.xds.as_ptr());
        let low = _mm512_set1_epi8(0x0F);
        // Independent chains of `vpdpbusd` per token, so that few tokens do not wait on one chain's
        // latency; integer sums are exact, so the split does not change a bit.
        let chains = if M <= 2 {
            4
        } else if M <= 4 {
            2
        } else {
            1
        };
        // Two float sums per token (products and offsets), added at the end.
        let mut acc = [[_mm512_setzero_ps(); 2]; M];
        for b in 0..blocks {
            // SAFETY: b < blocks keeps the record inside the panel and the activations inside the
            // tile's tokens (asserted above).
            unsafe {
                let r = wp.add(b * rec);
                let mut isum = [[_mm512_setzero_si512(); 4]; M];
                if U4 {
                    for v in 0..4 {
                        let w = _mm512_loadu_si512(r.add(v * 64).cast());
                        let lo = _mm512_and_si512(w, low);
                        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), low);
                        for (i, s) in isum.iter_mut().enumerate() {
                            let x = xq.add(i * cols + b * QBLOCK + 8 * v).cast::<i32>();
                            let (c0, c1) = ((2 * v) % chains, (2 * v + 1) % chains);
                            s[c0] = _mm512_dpbusd_epi32(
                                s[c0],
                                lo,
                                _mm512_set1_epi32(x.read_unaligned()),
                            );
                            s[c1] = _mm512_dpbusd_epi32(
                                s[c1],
                                hi,
                                _mm512_set1_epi32(x.add(1).read_unaligned()),
                            );
                        }
                    }
                } else {
                    for v in 0..8 {
                        let w = _mm512_loadu_si512(r.add(v * 64).cast());
                        for (i, s) in isum.iter_mut().enumerate() {
                            let x = xq.add(i * cols + b * QBLOCK + 4 * v).cast::<i32>();
                            let c = v % chains;
                            s[c] =
                                _mm512_dpbusd_epi32(s[c], w, _mm512_set1_epi32(x.read_unaligned()));
                        }
                    }
                }
                let scale = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(vb).cast()));
                let min = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(vb + 2 * QROWS).cast()));
                for (i, a) in acc.iter_mut().enumerate() {
                    let [dx, sx] = *xds.add(i * blocks + b);
                    let s = &isum[i];
                    let total = match chains {
                        4 => _mm512_add_epi32(
                            _mm512_add_epi32(s[0], s[1]),
                            _mm512_add_epi32(s[2], s[3]),
                        ),
                        2 => _mm512_add_epi32(s[0], s[1]),
                        _ => s[0],
                    };
                    let f = _mm512_mul_ps(scale, _mm512_set1_ps(dx));
                    a[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), f, a[0]);
                    a[1] = _mm512_fmadd_ps(min, _mm512_set1_ps(sx), a[1]);
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            let a = _mm512_add_ps(a[0], a[1]);
            // SAFETY: the first `valid` of these 16 columns of token i are writable (caller's guarantee).
            unsafe { store_row(tile.out.add(i * tile.ldo), tile.valid, tile.add, a) };
        }
    }

    /// One token's result for a panel: `a` written to the first `valid` of the 16 floats at `o`, or
    /// added to what they hold (`add`, a residual connection).
    ///
    /// # Safety
    /// avx512f is present; the first `valid` floats at `o` are writable.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn store_row(o: *mut f32, valid: usize, add: bool, a: __m512) {
        let mask: __mmask16 = if valid >= 16 {
            0xFFFF
        } else {
            (1u16 << valid) - 1
        };
        // SAFETY: the caller's guarantee; masked lanes are neither read nor written.
        unsafe {
            let v = if add {
                _mm512_add_ps(_mm512_maskz_loadu_ps(mask, o), a)
            } else {
                a
            };
            _mm512_mask_storeu_ps(o, mask, v);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use super::Tile;

    pub(super) unsafe fn tile_dispatch(_: &Tile<'_>, _: usize) {
        unreachable!("Vnni::detect is false off x86_64")
    }

    pub(super) unsafe fn tile_dispatch_avx2(_: &Tile<'_>, _: usize) {
        unreachable!("Path::detect gives Avx2 only on x86_64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::team;

    /// A matrix of seeded values: `u` up to `bits`' largest, scales and offsets of either sign.
    fn matrix(rows: usize, cols: usize, bits: QBits, seed: u64) -> PackedQ {
        let mut s = seed;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let vals: Vec<(Vec<u8>, Vec<f32>, Vec<f32>)> = (0..rows)
            .map(|_| {
                let u = (0..cols)
                    .map(|_| (next() % (u32::from(bits.max_value()) + 1)) as u8)
                    .collect();
                let sc = (0..cols / QBLOCK)
                    .map(|_| (next() % 1000) as f32 / 20000.0)
                    .collect();
                let mn = (0..cols / QBLOCK)
                    .map(|_| ((next() % 1000) as f32 - 500.0) / 5000.0)
                    .collect();
                (u, sc, mn)
            })
            .collect();
        PackedQ::build(rows, cols, bits, |r, row| {
            row.u.copy_from_slice(&vals[r].0);
            row.scale.copy_from_slice(&vals[r].1);
            row.min.copy_from_slice(&vals[r].2);
        })
    }

    fn quantized(x: &[f32], cols: usize) -> (Vec<i8>, Vec<[f32; 2]>) {
        let t = x.len() / cols;
        let mut q = vec![0i8; x.len()];
        let mut ds = vec![[0f32; 2]; t * cols / QBLOCK];
        for i in 0..t {
            quantize_act_row(
                &x[i * cols..(i + 1) * cols],
                &mut q[i * cols..(i + 1) * cols],
                &mut ds[i * cols / QBLOCK..(i + 1) * cols / QBLOCK],
            );
        }
        (q, ds)
    }

    fn run(x: &[f32], t: usize, w: &PackedQ, out: &mut [f32], add: bool) {
        let (q, ds) = quantized(x, w.cols);
        let shared = SharedMut::new(out);
        let act = QAct { q: &q, ds: &ds };
        // SAFETY: every thread passes the same arguments.
        team::run(|tm| unsafe { matmul_part(tm, act, t, w, shared, add) });
    }

    /// The product by the portable loop alone, one token at a time.
    fn portable(x: &[f32], t: usize, w: &PackedQ) -> Vec<f32> {
        let (q, ds) = quantized(x, w.cols);
        let mut out = vec![0f32; t * w.rows];
        for i in 0..t {
            for p in 0..w.panels {
                let tile = Tile {
                    panel: &w.bytes_slice()[p * w.blocks * w.bits.record_bytes()..],
                    blocks: w.blocks,
                    bits: w.bits,
                    xq: &q[i * w.cols..(i + 1) * w.cols],
                    xds: &ds[i * w.blocks..(i + 1) * w.blocks],
                    out: out[i * w.rows + p * QROWS..].as_mut_ptr(),
                    ldo: w.rows,
                    valid: QROWS.min(w.rows - p * QROWS),
                    add: false,
                };
                // SAFETY: one token, the panel's valid rows of `out`.
                unsafe { tile_portable(&tile, 1) };
            }
        }
        out
    }

    #[test]
    fn packing_keeps_every_value_scale_and_offset() {
        for bits in [QBits::U4, QBits::U8] {
            let (rows, cols) = (21, 96);
            let p = PackedQ::build(rows, cols, bits, |r, row| {
                for (c, u) in row.u.iter_mut().enumerate() {
                    *u = ((r * 7 + c * 3) % (usize::from(bits.max_value()) + 1)) as u8;
                }
                for b in 0..cols / QBLOCK {
                    row.scale[b] = 0.5 + r as f32 / 4.0 + b as f32;
                    row.min[b] = -(r as f32) - b as f32 / 2.0;
                }
            });
            assert_eq!(p.bytes(), PackedQ::bytes_for(rows, cols, bits));
            for r in 0..rows {
                for c in 0..cols {
                    let u = ((r * 7 + c * 3) % (usize::from(bits.max_value()) + 1)) as f32;
                    let b = (c / QBLOCK) as f32;
                    let want = (0.5 + r as f32 / 4.0 + b) * u + (-(r as f32) - b / 2.0);
                    assert_eq!(p.get(r, c), want, "{bits:?} ({r}, {c})");
                }
            }
        }
    }

    #[test]
    fn activations_quantize_to_the_same_bits_on_every_path() {
        // Spread values, halves and values either side of them, zeros of both signs, NaN, infinities,
        // subnormals, and blocks whose largest magnitude is zero, subnormal or infinite.
        let mut x: Vec<f32> = (0..32 * 40)
            .map(|i| ((i as f32) * 0.173).sin() * 9.0)
            .collect();
        for (j, v) in x[..32 * 8].iter_mut().enumerate() {
            let h = (j % 255) as f32 - 127.0 + 0.5;
            *v = [h, h.next_up(), h.next_down(), -h][j % 4];
        }
        x[32 * 8..32 * 9].fill(0.0);
        x[32 * 9 + 3] = -0.0;
        x[32 * 10 + 5] = f32::NAN;
        x[32 * 11 + 7] = f32::INFINITY;
        x[32 * 12 + 1] = f32::NEG_INFINITY;
        x[32 * 13..32 * 14].fill(f32::MIN_POSITIVE / 8.0);
        x[32 * 14..32 * 15].fill(-1e-42);
        x[32 * 15 + 9] = f32::MAX;
        let n = x.len();
        let (mut q0, mut ds0) = (vec![0i8; n], vec![[0f32; 2]; n / 32]);
        quantize_act_row_portable(&x, &mut q0, &mut ds0);
        assert!(q0.iter().all(|v| v.unsigned_abs() <= 127));
        let bits = |d: &[[f32; 2]]| d.iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>();
        type Quantizer<'a> = &'a dyn Fn(&mut [i8], &mut [[f32; 2]]);
        let check = |name: &str, f: Quantizer<'_>| {
            let (mut q1, mut ds1) = (vec![0i8; n], vec![[0f32; 2]; n / 32]);
            f(&mut q1, &mut ds1);
            assert_eq!(q0, q1, "{name}");
            assert_eq!(bits(&ds0), bits(&ds1), "{name}");
        };
        check("as dispatched", &|q, ds| quantize_act_row(&x, q, ds));
        #[cfg(target_arch = "x86_64")]
        {
            let avx512 = crate::kernels::cpu_has(Isa::Avx512);
            if crate::kernels::compared("int8 activations, AVX-512", avx512, avx512) {
                // SAFETY: the CPU has AVX-512F.
                check("AVX-512", &|q, ds| unsafe {
                    x86::quantize_act_row_avx512(&x, q, ds)
                });
            }
            let avx2 = is_x86_feature_detected!("avx2");
            if crate::kernels::compared("int8 activations, AVX2", avx2, avx2) {
                // SAFETY: the CPU has AVX2.
                check("AVX2", &|q, ds| unsafe {
                    x86::quantize_act_row_avx2(&x, q, ds)
                });
            }
        }
    }

    #[test]
    fn activations_quantize_as_q8_1() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) / 8.0).collect();
        let (q, ds) = quantized(&x, 64);
        for b in 0..2 {
            let amax = x[b * 32..(b + 1) * 32]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            let [dx, sx] = ds[b];
            assert_eq!(dx, amax / 127.0);
            let sum: i32 = q[b * 32..(b + 1) * 32].iter().map(|v| i32::from(*v)).sum();
            assert_eq!(sx, dx * sum as f32);
            for j in 0..32 {
                let back = f32::from(q[b * 32 + j]) * dx;
                assert!((back - x[b * 32 + j]).abs() <= dx / 2.0 + 1e-6);
            }
        }
        let (q, ds) = quantized(&[0f32; 32], 32);
        assert!(q.iter().all(|v| *v == 0) && ds[0] == [0.0, 0.0]);
    }

    #[test]
    fn every_path_gives_the_portable_bits_and_near_the_float_product() {
        for bits in [QBits::U4, QBits::U8] {
            for (rows, cols) in [(1, 32), (17, 64), (64, 96), (130, 576)] {
                let w = matrix(rows, cols, bits, rows as u64 * 31 + cols as u64);
                for t in [1, 2, 7, 8, 9, 20, 70] {
                    let x: Vec<f32> = (0..t * cols)
                        .map(|i| ((i as f32) * 0.37).sin() * 2.0)
                        .collect();
                    let want = portable(&x, t, &w);
                    let mut out = vec![0f32; t * rows];
                    run(&x, t, &w, &mut out, false);
                    assert_eq!(out, want, "{bits:?} rows={rows} cols={cols} t={t}");
                    // Against the float product of the stored weights: int8 activations cost < 1 %.
                    for i in [0, t - 1] {
                        for r in [0, rows - 1] {
                            let exact: f64 = (0..cols)
                                .map(|c| f64::from(x[i * cols + c]) * f64::from(w.get(r, c)))
                                .sum();
                            let scale: f64 = (0..cols)
                                .map(|c| {
                                    (f64::from(x[i * cols + c]) * f64::from(w.get(r, c))).abs()
                                })
                                .sum();
                            let got = f64::from(out[i * rows + r]);
                            assert!(
                                (got - exact).abs() <= 0.01 * scale + 1e-6,
                                "{bits:?} token {i} row {r}: {got} vs {exact}"
                            );
                        }
                    }
                    let mut acc = vec![1.5f32; t * rows];
                    run(&x, t, &w, &mut acc, true);
                    for (a, b) in acc.iter().zip(&out) {
                        assert_eq!(*a, 1.5 + b, "add mode");
                    }
                }
            }
        }
    }

    /// The kernel paths this CPU can run.
    /// Each is reported as compared or not; one that this CPU has and the test cannot run fails it.
    fn paths() -> Vec<Path> {
        let mut p = vec![Path::Portable];
        #[cfg(target_arch = "x86_64")]
        let (avx2, vnni) = (
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c"),
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni"),
        );
        #[cfg(not(target_arch = "x86_64"))]
        let (avx2, vnni) = (false, false);
        if crate::kernels::compared("int8 blocks, AVX2 (vpmaddubsw)", avx2, avx2) {
            p.push(Path::Avx2);
        }
        if crate::kernels::compared("int8 blocks, AVX-512 VNNI", vnni, Vnni::detect().is_some()) {
            p.push(Path::Vnni);
        }
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::compared(
            "int8 blocks, AMX tiles (tdpbsud)",
            vnni && amx::cpu_and_os_have_amx(),
            amx::Amx::detect().is_some(),
        ) {
            p.push(Path::Amx);
        }
        p
    }

    #[test]
    fn every_kernel_path_gives_the_same_bits() {
        let paths = paths();
        for bits in [QBits::U4, QBits::U8] {
            let (rows, cols) = (45, 160);
            let w = matrix(rows, cols, bits, 99);
            for t in [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 30, 47, 64, 65, 100, 143] {
                let x: Vec<f32> = (0..t * cols).map(|i| ((i as f32) * 0.29).sin()).collect();
                let (q, ds) = quantized(&x, cols);
                let act = QAct { q: &q, ds: &ds };
                let mut first: Option<Vec<f32>> = None;
                for &path in &paths {
                    let mut out = vec![0.25f32; t * rows];
                    let shared = SharedMut::new(&mut out);
                    // SAFETY: `paths` lists what this CPU has; every thread passes the same arguments.
                    team::run(|tm| unsafe { matmul_part_on(path, tm, act, t, &w, shared, true) });
                    match &first {
                        None => first = Some(out),
                        Some(f) => assert_eq!(&out, f, "{path:?} {bits:?} t={t}"),
                    }
                }
            }
        }
    }

    #[test]
    fn a_decode_product_gives_the_same_bits_when_its_chunks_are_published_from_buffers() {
        // The redo form of a decode product (each chunk computed into a thread's buffer, then copied
        // out by whoever finishes it first) against the chunks written in place, on teams of 1 to 3.
        let paths = paths();
        for bits in [QBits::U4, QBits::U8] {
            for (rows, cols) in [(45, 160), (130, 576), (16, 32)] {
                let w = matrix(rows, cols, bits, rows as u64 + 7);
                let x: Vec<f32> = (0..cols).map(|i| ((i as f32) * 0.41).cos()).collect();
                let (q, ds) = quantized(&x, cols);
                let act = QAct { q: &q, ds: &ds };
                for &path in &paths {
                    for threads in 1..=3 {
                        let product = |add: bool| {
                            let mut out: Vec<f32> = (0..rows).map(|r| r as f32 * 0.5).collect();
                            let shared = SharedMut::new(&mut out);
                            rayon::ThreadPoolBuilder::new()
                                .num_threads(threads)
                                .build()
                                .expect("pool")
                                // SAFETY: `paths` lists what this CPU has; every thread passes the
                                // same arguments.
                                .install(|| {
                                    team::run(|tm| unsafe {
                                        matmul_part_on(path, tm, act, 1, &w, shared, add)
                                    })
                                });
                            out
                        };
                        for add in [false, true] {
                            let in_place = product(add);
                            let published = team::with_redo_form(|| product(add));
                            assert_eq!(
                                published, in_place,
                                "{path:?} {bits:?} {rows}×{cols} threads={threads} add={add}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn rounding_without_libm_matches_f32_round() {
        assert_eq!(0.499_999_97f32, f32::from_bits(0.5f32.to_bits() - 1));
        // Around every half and every integer in range, a few floats either side, and spread values.
        let mut checked = 0;
        for k in -400..=400 {
            let centre = k as f32 / 2.0;
            let mut v = centre;
            let mut w = centre;
            for _ in 0..64 {
                for x in [v, w] {
                    assert_eq!(round_half_away(x), x.round() as i32, "{x:e}");
                    checked += 1;
                }
                v = v.next_up();
                w = w.next_down();
            }
        }
        for i in 0..200_000 {
            let x = (i as f32 * 0.001_37).sin() * 130.0;
            assert_eq!(round_half_away(x), x.round() as i32, "{x:e}");
        }
        assert_eq!(round_half_away(f32::NAN), 0);
        assert!(checked > 100_000);
    }

    #[test]
    fn integer_sums_at_their_largest_give_the_same_bits_on_every_path() {
        // Every value at its largest (or, for 8-bit values, its smallest: 0 is −128 from the AVX2
        // kernel's centre) and every activation at ±127 (a block of equal magnitudes): the AVX2
        // kernel's 16-bit sums of pairs reach their bound, which must not saturate.
        let paths = paths();
        for (bits, u) in [(QBits::U4, 15), (QBits::U8, 255), (QBits::U8, 0)] {
            let (rows, cols) = (16, 64);
            let w = PackedQ::build(rows, cols, bits, |_, row| {
                row.u.fill(u);
                row.scale.fill(1.0);
                row.min.fill(0.0);
            });
            // Enough tokens for the AMX kernel, in whole groups of 16 and a padded one.
            let t = AMX_FROM + 17;
            for sign in [1.0f32, -1.0] {
                let x = vec![sign * 3.0; t * cols];
                let (q, ds) = quantized(&x, cols);
                assert!(q.iter().all(|v| i32::from(*v) == 127 * sign as i32));
                let act = QAct { q: &q, ds: &ds };
                let exact = f32::from(u) * 3.0 * sign * cols as f32;
                for &path in &paths {
                    let mut out = vec![0f32; t * rows];
                    let shared = SharedMut::new(&mut out);
                    // SAFETY: `paths` lists what this CPU has; every thread passes the same arguments.
                    team::run(|tm| unsafe { matmul_part_on(path, tm, act, t, &w, shared, false) });
                    for v in &out {
                        assert!(
                            (v - exact).abs() <= exact.abs() * 1e-5,
                            "{path:?} {bits:?}: {v} vs {exact}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_token_gets_the_same_bits_in_any_batch() {
        let (rows, cols, t) = (200, 128, 150);
        for bits in [QBits::U4, QBits::U8] {
            let w = matrix(rows, cols, bits, 7);
            let x: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.011).cos()).collect();
            let mut all = vec![0f32; t * rows];
            run(&x, t, &w, &mut all, false);
            for i in [0, 5, 8, 77, 149] {
                let mut one = vec![0f32; rows];
                run(&x[i * cols..(i + 1) * cols], 1, &w, &mut one, false);
                assert_eq!(one, all[i * rows..(i + 1) * rows], "{bits:?} token {i}");
            }
        }
    }
}
