//! Weights packed in panels of 64 rows, and the one kernel per format that multiplies them, for decode
//! and prefill alike: bf16 pairs for `vdpbf16ps` (AVX-512 BF16), or f32 for FMA (one column per step
//! instead of a pair, otherwise the same) on AVX-512F or, 8 lanes at a time, on AVX2 (16 rows of up to 6
//! tokens in registers; one token takes all 64 rows): the same chain of multiply-adds per output lane on
//! either, so the same bits.
//!
//! Layout: rows in panels of [`PANEL_ROWS`]; within a panel, for each pair of columns `(2j, 2j+1)`, the 64
//! rows' two values side by side as one 32-bit word (the low half holds column `2j`):
//!
//! ```text
//! panel p:  pair 0: [r0:c0c1  r1:c0c1 … r63:c0c1]  pair 1: [r0:c2c3 …]  …      (rows and columns padded
//!           └──────────── 256 bytes ────────────┘                               with zeros to 64 and 2)
//! ```
//!
//! The activations are bf16 pairs too (`t × pairs` words). A tile of up to [`TILE_TOKENS`] tokens × 64 rows
//! keeps its 24 sums in registers: per pair it loads four 64-byte weight vectors, broadcasts each token's
//! pair, and issues one `vdpbf16ps` per (token, 16 rows). Each output lane sums its row's pairs in order,
//! one `vdpbf16ps` after another, whatever the tile, the chunk or the thread split: a token's result is
//! the same bit for bit whether it is decoded alone or prefilled among a thousand (batch invariance).
//! Decode (few tokens) reads each weight once from memory; prefill reuses a panel from L2 across a chunk
//! of tokens, and the chunk from L1/L2 across panels.

use half::bf16;

use super::arena::{Plain, Stored};
use super::dot::{Bf16Act, F32Panels, Isa};
use super::team::{self, chunk_tokens, SharedMut, Team};

/// Rows per panel.
pub const PANEL_ROWS: usize = 64;
/// Tokens per register tile.
pub const TILE_TOKENS: usize = 6;
/// Tokens per cache chunk in prefill.
const CHUNK_TOKENS: usize = 96;
/// Up to this many tokens, threads split rows only, so that each weight is read from memory once.
const ROWS_ONLY_UP_TO: usize = 16;

/// A `[rows, cols]` matrix in the panel layout, as bf16 pairs (`W = u32`, see [`PackedBf16`]) or f32
/// (`W = f32`, see [`PackedF32`]).
#[derive(Clone)]
pub struct Packed<W: Plain> {
    pub rows: usize,
    pub cols: usize,
    /// Steps along a row: column pairs for bf16 (`cols.div_ceil(2)`), columns for f32.
    pub steps: usize,
    panels: usize,
    /// In the model's [`super::arena::WeightArena`] once loaded.
    pub(crate) data: Stored<W>,
}

/// bf16 weights for `vdpbf16ps` (AVX-512 BF16).
pub type PackedBf16 = Packed<u32>;
/// f32 weights for AVX-512 FMA: the same panels with one column per step.
pub type PackedF32 = Packed<f32>;

#[inline]
fn pair(lo: bf16, hi: bf16) -> u32 {
    u32::from(lo.to_bits()) | (u32::from(hi.to_bits()) << 16)
}

impl<W: Plain + Default> Packed<W> {
    /// Lays out `steps` values per row, `value(r, j)` for row `r` and step `j`, in panels of 64 rows.
    fn pack(rows: usize, cols: usize, steps: usize, value: impl Fn(usize, usize) -> W) -> Self {
        let panels = rows.div_ceil(PANEL_ROWS);
        let mut data = vec![W::default(); panels * steps * PANEL_ROWS];
        if !data.is_empty() {
            for (p, panel) in data.chunks_exact_mut(steps * PANEL_ROWS).enumerate() {
                for lane in 0..PANEL_ROWS.min(rows - p * PANEL_ROWS) {
                    for j in 0..steps {
                        panel[j * PANEL_ROWS + lane] = value(p * PANEL_ROWS + lane, j);
                    }
                }
            }
        }
        Packed {
            rows,
            cols,
            steps,
            panels,
            data: Stored::Own(data),
        }
    }

    fn word(&self, r: usize, j: usize) -> W {
        let (p, lane) = (r / PANEL_ROWS, r % PANEL_ROWS);
        self.data[(p * self.steps + j) * PANEL_ROWS + lane]
    }

    /// Bytes held, padding included: what a decode step reads.
    pub fn bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<W>()
    }

    fn panel(&self, p: usize) -> &[W] {
        &self.data[p * self.steps * PANEL_ROWS..(p + 1) * self.steps * PANEL_ROWS]
    }
}

impl PackedBf16 {
    /// Packs a row-major f32 matrix, rounding each value to bf16 (to nearest, ties to even). Takes the
    /// proof that this CPU can multiply it.
    pub fn from_f32(_cpu: &Bf16Act, rows: usize, cols: usize, w: &[f32]) -> Self {
        assert_eq!(w.len(), rows * cols, "w is rows × cols");
        let at = |r: usize, c: usize| {
            if c < cols {
                bf16::from_f32(w[r * cols + c])
            } else {
                bf16::ZERO
            }
        };
        Self::pack(rows, cols, cols.div_ceil(2), |r, j| {
            pair(at(r, 2 * j), at(r, 2 * j + 1))
        })
    }

    /// Element `(r, c)`.
    pub fn get(&self, r: usize, c: usize) -> bf16 {
        bf16::from_bits((self.word(r, c / 2) >> (16 * (c % 2))) as u16)
    }

    /// Row `r` as f32 into `out` (an embedding lookup).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        for (c, o) in out.iter_mut().enumerate().take(self.cols) {
            *o = self.get(r, c).to_f32();
        }
    }
}

impl PackedF32 {
    /// Packs a row-major f32 matrix. Takes the proof that this CPU can multiply it.
    pub fn from_f32(_cpu: &F32Panels, rows: usize, cols: usize, w: &[f32]) -> Self {
        assert_eq!(w.len(), rows * cols, "w is rows × cols");
        Self::pack(rows, cols, cols, |r, c| w[r * cols + c])
    }

    /// Row `r` into `out` (an embedding lookup).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        for (c, o) in out.iter_mut().enumerate().take(self.cols) {
            *o = self.word(r, c);
        }
    }
}

/// Rounds a row of f32 activations into bf16 pairs (`dst.len()` = pairs; an odd last column pairs with 0).
pub fn pack_act_row(src: &[f32], dst: &mut [u32]) {
    debug_assert_eq!(dst.len(), src.len().div_ceil(2));
    let mut it = src.chunks_exact(2);
    for (d, s) in dst.iter_mut().zip(&mut it) {
        *d = pair(bf16::from_f32(s[0]), bf16::from_f32(s[1]));
    }
    if let [last] = it.remainder() {
        dst[dst.len() - 1] = pair(bf16::from_f32(*last), bf16::ZERO);
    }
}

/// `out (t × w.rows) (+)= x · Wᵀ`, dealt to the team and done when it returns, with `x` as `t` rows of
/// `w.steps` values (bf16 pairs for [`PackedBf16`], f32 for [`PackedF32`]): with `add`, the product is
/// added to what `out` holds (a residual connection), else it replaces it.
///
/// # Safety
/// Every thread of the team calls this with the same arguments, and nothing else touches `out` while it
/// runs. (The CPU features are proven by the matrix: a `Packed` is made with a `Bf16Act` or an
/// `F32Panels`.)
pub unsafe fn matmul_part<W: Tile>(
    tm: &Team<'_>,
    x: &[W::X],
    t: usize,
    w: &Packed<W>,
    out: SharedMut<'_, f32>,
    add: bool,
) {
    assert_eq!(x.len(), t * w.steps, "x is t × steps");
    assert_eq!(out.len(), t * w.rows, "out is t × rows");
    let chunk = chunk_tokens(
        t,
        w.panels,
        tm.size(),
        (ROWS_ONLY_UP_TO, CHUNK_TOKENS, TILE_TOKENS),
    );
    if t == 1 {
        // One token (decode): a run of panels writes its rows of the token, one tile a panel.
        let rows = |panels: std::ops::Range<usize>| {
            panels.start * PANEL_ROWS..(panels.end * PANEL_ROWS).min(w.rows)
        };
        let grain = team::grain(w.steps * PANEL_ROWS * std::mem::size_of::<W>());
        // SAFETY: every thread passes the same arguments (this function's contract); a run of panels
        // writes its rows alone; the tiles' addresses and lengths come from the matrix's shape, never
        // from the activations they read.
        unsafe {
            tm.deal_out(w.panels, grain, out, add, rows, |panels, dest| {
                for p in panels.clone() {
                    let at = (p - panels.start) * PANEL_ROWS;
                    let valid = PANEL_ROWS.min(w.rows - p * PANEL_ROWS);
                    // SAFETY: the panel holds steps × 64 words, x one row of steps values, and `dest`
                    // this panel's `valid` rows from `at`. The CPU features: `w` was made with their
                    // proof.
                    let args = (
                        w.panel(p).as_ptr(),
                        w.steps,
                        x.as_ptr(),
                        dest[at..at + valid].as_mut_ptr(),
                        w.rows,
                        valid,
                        add,
                    );
                    W::tile::<1>(args);
                }
            });
        }
        return;
    }
    let chunks = t.div_ceil(chunk.max(1));
    tm.deal(chunks * w.panels, |items| {
        for item in items {
            let (c, p) = (item / w.panels, item % w.panels);
            let panel = w.panel(p);
            let r0 = p * PANEL_ROWS;
            let valid = PANEL_ROWS.min(w.rows - r0);
            let (t_lo, t_hi) = (c * chunk, ((c + 1) * chunk).min(t));
            let mut t0 = t_lo;
            while t0 < t_hi {
                let m = (t_hi - t0).min(TILE_TOKENS);
                let xp = x[t0 * w.steps..].as_ptr();
                // SAFETY: rows r0..r0+valid of tokens t0..t0+m lie inside `out` (t0 + m ≤ t, r0 + valid ≤
                // rows) and belong to this work item alone; the panel holds steps × 64 words and x holds m
                // rows of steps values from t0. The CPU features: `w` was made with their proof.
                unsafe {
                    let op = out.ptr().add(t0 * w.rows + r0);
                    let args = (panel.as_ptr(), w.steps, xp, op, w.rows, valid, add);
                    match m {
                        1 => W::tile::<1>(args),
                        2 => W::tile::<2>(args),
                        3 => W::tile::<3>(args),
                        4 => W::tile::<4>(args),
                        5 => W::tile::<5>(args),
                        _ => W::tile::<6>(args),
                    }
                }
                t0 += m;
            }
        }
    });
}

/// (panel, steps, x at the tile's first token, out at (first token, first row), out row stride, valid
/// rows of the panel, add).
pub type TileArgs<W, X> = (*const W, usize, *const X, *mut f32, usize, usize, bool);

/// A panel element type and its register tile.
pub trait Tile: Plain + Default {
    /// The activation element it multiplies.
    type X: Copy + Sync;
    /// One tile: `M` tokens × 64 rows.
    ///
    /// # Safety
    /// The CPU has the features the matrix was made with; the panel holds `steps × 64` words; `x` holds
    /// `M` rows of `steps` values; `out` has `M` rows (stride `ldo`) with `valid` writable columns each.
    unsafe fn tile<const M: usize>(args: TileArgs<Self, Self::X>);
}

impl Tile for u32 {
    type X = u32;
    unsafe fn tile<const M: usize>(args: TileArgs<u32, u32>) {
        // SAFETY: the caller's guarantee (a PackedBf16 exists only with AVX-512 BF16).
        unsafe { x86::tile_bf16::<M>(args) }
    }
}

impl Tile for f32 {
    type X = f32;
    unsafe fn tile<const M: usize>(args: TileArgs<f32, f32>) {
        // SAFETY: the caller's guarantee: a PackedF32 exists only with an `F32Panels`, so this process
        // runs AVX-512F or AVX2 with FMA, and `Isa::detect` (fixed for the process) says which.
        unsafe {
            if Isa::detect() == Isa::Avx512 {
                x86::tile_f32::<M>(args)
            } else if M == 1 {
                x86::tile_f32_avx2_one(args)
            } else {
                x86::tile_f32_avx2::<M>(args)
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::TileArgs;

    /// bf16 pairs: one `vdpbf16ps` per (token, 16 rows) and column pair.
    ///
    /// # Safety
    /// See [`super::Tile::tile`]; avx512f and avx512bf16 are present.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn tile_bf16<const M: usize>(
        (w, steps, x, out, ldo, valid, add): TileArgs<u32, u32>,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 4]; M];
        for j in 0..steps {
            // SAFETY: j < steps keeps every read inside the panel and the activation rows.
            unsafe {
                let wp = w.add(j * 64) as *const __m512i;
                let b: [__m512bh; 4] = [
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(wp)),
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(wp.add(1))),
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(wp.add(2))),
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(wp.add(3))),
                ];
                for (m, accm) in acc.iter_mut().enumerate() {
                    let a = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                        *x.add(m * steps + j) as i32,
                    ));
                    for s in 0..4 {
                        accm[s] = _mm512_dpbf16_ps(accm[s], b[s], a);
                    }
                }
            }
        }
        // SAFETY: the caller's guarantee on `out`.
        unsafe { store::<M>(&acc, out, ldo, valid, add) }
    }

    /// f32: one fused multiply-add per (token, 16 rows) and column.
    ///
    /// # Safety
    /// See [`super::Tile::tile`]; avx512f is present.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile_f32<const M: usize>(
        (w, steps, x, out, ldo, valid, add): TileArgs<f32, f32>,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 4]; M];
        for j in 0..steps {
            // SAFETY: j < steps keeps every read inside the panel and the activation rows.
            unsafe {
                let wp = w.add(j * 64);
                let b = [
                    _mm512_loadu_ps(wp),
                    _mm512_loadu_ps(wp.add(16)),
                    _mm512_loadu_ps(wp.add(32)),
                    _mm512_loadu_ps(wp.add(48)),
                ];
                for (m, accm) in acc.iter_mut().enumerate() {
                    let a = _mm512_set1_ps(*x.add(m * steps + j));
                    for s in 0..4 {
                        accm[s] = _mm512_fmadd_ps(b[s], a, accm[s]);
                    }
                }
            }
        }
        // SAFETY: the caller's guarantee on `out`.
        unsafe { store::<M>(&acc, out, ldo, valid, add) }
    }

    /// f32 on AVX2: the AVX-512 kernel's arithmetic, 8 lanes at a time, so the same bits. The 64 rows are
    /// taken 16 at a time (2 × 8 lanes × `M` ≤ 6 tokens: 12 sums in registers, 2 weight vectors, 1
    /// broadcast); each output lane is one chain of fused multiply-adds, column after column.
    ///
    /// # Safety
    /// See [`super::Tile::tile`]; avx2 and fma are present.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile_f32_avx2<const M: usize>(
        (w, steps, x, out, ldo, valid, add): TileArgs<f32, f32>,
    ) {
        for s in 0..4 {
            if valid <= s * 16 {
                break;
            }
            let mut acc = [[_mm256_setzero_ps(); 2]; M];
            for j in 0..steps {
                // SAFETY: j < steps keeps every read inside the panel and the activation rows.
                unsafe {
                    let wp = w.add(j * 64 + s * 16);
                    let b = [_mm256_loadu_ps(wp), _mm256_loadu_ps(wp.add(8))];
                    for (m, accm) in acc.iter_mut().enumerate() {
                        let a = _mm256_set1_ps(*x.add(m * steps + j));
                        accm[0] = _mm256_fmadd_ps(b[0], a, accm[0]);
                        accm[1] = _mm256_fmadd_ps(b[1], a, accm[1]);
                    }
                }
            }
            for (m, accm) in acc.iter().enumerate() {
                for (h, v) in accm.iter().enumerate() {
                    // SAFETY: the caller's guarantee on `out`: row m, columns s·16 + h·8 onwards.
                    unsafe {
                        store8(
                            *v,
                            out.add(m * ldo + s * 16 + h * 8),
                            valid,
                            s * 16 + h * 8,
                            add,
                        )
                    };
                }
            }
        }
    }

    /// One token on AVX2 (decode): all 64 rows at once (8 sums), so that eight independent chains hide
    /// the latency of the multiply-add; per lane the same chain as [`tile_f32_avx2`].
    ///
    /// # Safety
    /// See [`super::Tile::tile`]; avx2 and fma are present.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile_f32_avx2_one((w, steps, x, out, _ldo, valid, add): TileArgs<f32, f32>) {
        let mut acc = [_mm256_setzero_ps(); 8];
        for j in 0..steps {
            // SAFETY: j < steps keeps every read inside the panel and the activation row.
            unsafe {
                let wp = w.add(j * 64);
                let a = _mm256_set1_ps(*x.add(j));
                for (k, acck) in acc.iter_mut().enumerate() {
                    *acck = _mm256_fmadd_ps(_mm256_loadu_ps(wp.add(k * 8)), a, *acck);
                }
            }
        }
        for (k, v) in acc.iter().enumerate() {
            // SAFETY: the caller's guarantee on `out`: columns k·8 onwards of its one row.
            unsafe { store8(*v, out.add(k * 8), valid, k * 8, add) };
        }
    }

    /// Writes (or adds) 8 sums to the columns `first..first + 8` of a row, less those at or past `valid`.
    ///
    /// # Safety
    /// avx2 is present; the columns below `valid` from `out` on are writable.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn store8(v: __m256, out: *mut f32, valid: usize, first: usize, add: bool) {
        let lanes = valid.saturating_sub(first).min(8);
        let mut vals = [0f32; 8];
        // SAFETY: vals holds 8 floats.
        unsafe { _mm256_storeu_ps(vals.as_mut_ptr(), v) };
        for (i, val) in vals.iter().enumerate().take(lanes) {
            // SAFETY: i < lanes keeps the write below `valid` (caller's guarantee).
            unsafe {
                let p = out.add(i);
                *p = if add { *p + *val } else { *val };
            }
        }
    }

    /// Writes (or adds) the tile's sums to the first `valid` of 64 columns of `M` rows.
    ///
    /// # Safety
    /// avx512f is present; `out` has `M` rows (stride `ldo`) with `valid` writable columns each.
    #[target_feature(enable = "avx512f")]
    unsafe fn store<const M: usize>(
        acc: &[[__m512; 4]; M],
        out: *mut f32,
        ldo: usize,
        valid: usize,
        add: bool,
    ) {
        for (m, accm) in acc.iter().enumerate() {
            for (s, v) in accm.iter().enumerate() {
                let lanes = valid.saturating_sub(s * 16).min(16);
                if lanes == 0 {
                    break;
                }
                let mask: __mmask16 = if lanes == 16 {
                    0xFFFF
                } else {
                    (1u16 << lanes) - 1
                };
                // SAFETY: the first `lanes` of these 16 columns are writable (caller's guarantee).
                unsafe {
                    let p = out.add(m * ldo + s * 16);
                    let v = if add {
                        _mm512_add_ps(_mm512_maskz_loadu_ps(mask, p), *v)
                    } else {
                        *v
                    };
                    _mm512_mask_storeu_ps(p, mask, v);
                }
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use super::TileArgs;

    pub unsafe fn tile_bf16<const M: usize>(_: TileArgs<u32, u32>) {
        unreachable!("packed weights exist only on CPUs with AVX-512")
    }

    pub unsafe fn tile_f32<const M: usize>(_: TileArgs<f32, f32>) {
        unreachable!("packed weights exist only on CPUs with AVX-512")
    }

    pub unsafe fn tile_f32_avx2<const M: usize>(_: TileArgs<f32, f32>) {
        unreachable!("packed weights exist only on CPUs with AVX2")
    }

    pub unsafe fn tile_f32_avx2_one(_: TileArgs<f32, f32>) {
        unreachable!("packed weights exist only on CPUs with AVX2")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::team;

    fn naive_bf16(x: &[f32], t: usize, w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let r = |v: f32| bf16::from_f32(v).to_f32() as f64;
        let mut out = vec![0f32; t * rows];
        for i in 0..t {
            for j in 0..rows {
                out[i * rows + j] = (0..cols)
                    .map(|c| r(x[i * cols + c]) * r(w[j * cols + c]))
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    /// The proof for the bf16 kernel, where this CPU has `vdpbf16ps` (a test fails where it has it and
    /// the kernel did not run).
    fn bf16_cpu() -> Option<Bf16Act> {
        #[cfg(target_arch = "x86_64")]
        let has = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16");
        #[cfg(not(target_arch = "x86_64"))]
        let has = false;
        let cpu = Bf16Act::detect();
        crate::kernels::compared("packed bf16 (vdpbf16ps)", has, cpu.is_some());
        cpu
    }

    /// The proof for the f32 kernel, where this CPU has AVX2 with FMA (AVX-512F where it has it).
    fn f32_cpu() -> Option<F32Panels> {
        let cpu = F32Panels::detect();
        crate::kernels::compared(
            &format!("packed f32 ({})", Isa::detect().name()),
            crate::kernels::cpu_has(Isa::Avx2Fma),
            cpu.is_some(),
        );
        cpu
    }

    fn run_packed(x: &[f32], t: usize, w: &PackedBf16, out: &mut [f32], add: bool) {
        let mut xp = vec![0u32; t * w.steps];
        for (src, dst) in x.chunks_exact(w.cols).zip(xp.chunks_exact_mut(w.steps)) {
            pack_act_row(src, dst);
        }
        let shared = SharedMut::new(out);
        // SAFETY: the callers checked the CPU; every thread passes the same arguments.
        team::run(|tm| unsafe { matmul_part(tm, &xp, t, w, shared, add) });
    }

    /// Every f32 tile (AVX-512 and AVX2, each token count) gives, for each output lane, the bits of one
    /// fused multiply-add chain over the columns in order: the same bits on either kernel and in any batch.
    #[test]
    fn every_f32_tile_gives_the_bits_of_one_fused_chain_per_lane() {
        let (rows, cols) = (100, 37); // a whole panel and one of 36 rows
        let w: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = PackedF32::pack(rows, cols, cols, |r, c| w[r * cols + c]);
        let x: Vec<f32> = (0..6 * cols).map(|i| (i as f32 * 0.011).cos()).collect();
        let chain = |m: usize, r: usize| {
            (0..cols).fold(0f32, |acc, c| w[r * cols + c].mul_add(x[m * cols + c], acc))
        };
        let avx512 = crate::kernels::cpu_has(Isa::Avx512);
        let avx2 = crate::kernels::cpu_has(Isa::Avx2Fma);
        crate::kernels::compared("f32 tile, AVX-512", avx512, avx512);
        crate::kernels::compared("f32 tile, AVX2", avx2, avx2);
        for panel in 0..2 {
            let valid = PANEL_ROWS.min(rows - panel * PANEL_ROWS);
            for m in 1..=6 {
                let mut kernels: Vec<(&str, TileFn)> = Vec::new();
                if avx512 {
                    kernels.push((
                        "avx512",
                        [
                            x86::tile_f32::<1>,
                            x86::tile_f32::<2>,
                            x86::tile_f32::<3>,
                            x86::tile_f32::<4>,
                            x86::tile_f32::<5>,
                            x86::tile_f32::<6>,
                        ][m - 1],
                    ));
                }
                if avx2 {
                    kernels.push((
                        "avx2",
                        [
                            x86::tile_f32_avx2::<1>,
                            x86::tile_f32_avx2::<2>,
                            x86::tile_f32_avx2::<3>,
                            x86::tile_f32_avx2::<4>,
                            x86::tile_f32_avx2::<5>,
                            x86::tile_f32_avx2::<6>,
                        ][m - 1],
                    ));
                    if m == 1 {
                        kernels.push(("avx2, one token", x86::tile_f32_avx2_one));
                    }
                }
                for (name, tile) in kernels {
                    for add in [false, true] {
                        let mut out = vec![0.5f32; m * PANEL_ROWS];
                        // SAFETY: `compared` above checked the CPU; the panel holds cols × 64 words, x
                        // holds m rows of cols, out has m rows of 64.
                        unsafe {
                            tile((
                                p.panel(panel).as_ptr(),
                                cols,
                                x.as_ptr(),
                                out.as_mut_ptr(),
                                PANEL_ROWS,
                                valid,
                                add,
                            ))
                        };
                        for i in 0..m {
                            for lane in 0..PANEL_ROWS {
                                let want = if lane >= valid {
                                    0.5
                                } else if add {
                                    0.5 + chain(i, panel * PANEL_ROWS + lane)
                                } else {
                                    chain(i, panel * PANEL_ROWS + lane)
                                };
                                assert_eq!(out[i * PANEL_ROWS + lane].to_bits(), want.to_bits(), "{name}: panel {panel}, {m} tokens, token {i}, lane {lane}, add {add}");
                            }
                        }
                    }
                }
            }
        }
    }

    type TileFn = unsafe fn(TileArgs<f32, f32>);

    #[test]
    fn packing_keeps_every_element() {
        let Some(cpu) = bf16_cpu() else { return };
        let (rows, cols) = (70, 9);
        let w: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let p = PackedBf16::from_f32(&cpu, rows, cols, &w);
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(
                    p.get(r, c).to_f32(),
                    bf16::from_f32(w[r * cols + c]).to_f32()
                );
            }
        }
    }

    #[test]
    fn odd_shapes_match_reference_and_add_mode_adds() {
        let Some(cpu) = bf16_cpu() else { return };
        for (rows, cols) in [(1, 1), (17, 3), (64, 64), (130, 77), (200, 150)] {
            let w: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 7919 % 61) as f32 - 30.0) / 32.0)
                .collect();
            let p = PackedBf16::from_f32(&cpu, rows, cols, &w);
            for t in [1, 2, 5, 6, 7, 13, 17, 40, 200] {
                let x: Vec<f32> = (0..t * cols).map(|i| ((i as f32) * 0.013).sin()).collect();
                let want = naive_bf16(&x, t, &w, rows, cols);
                let mut out = vec![0f32; t * rows];
                run_packed(&x, t, &p, &mut out, false);
                for (a, b) in out.iter().zip(&want) {
                    assert!(
                        (a - b).abs() < 1e-3,
                        "rows={rows} cols={cols} t={t}: {a} vs {b}"
                    );
                }
                let mut acc = vec![1.5f32; t * rows];
                run_packed(&x, t, &p, &mut acc, true);
                for (a, b) in acc.iter().zip(&out) {
                    assert_eq!(*a, 1.5 + b, "add mode");
                }
            }
        }
    }

    #[test]
    fn a_token_gets_the_same_bits_in_any_batch() {
        let (rows, cols) = (192, 96);
        let w: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let t = 150;
        let x: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.011).cos()).collect();
        if let Some(cpu) = bf16_cpu() {
            let p = PackedBf16::from_f32(&cpu, rows, cols, &w);
            let mut all = vec![0f32; t * rows];
            run_packed(&x, t, &p, &mut all, false);
            for i in [0, 5, 6, 77, 149] {
                let mut one = vec![0f32; rows];
                run_packed(&x[i * cols..(i + 1) * cols], 1, &p, &mut one, false);
                assert_eq!(one, all[i * rows..(i + 1) * rows], "bf16 token {i}");
            }
        }
        if let Some(cpu) = f32_cpu() {
            let p = PackedF32::from_f32(&cpu, rows, cols, &w);
            let run = |x: &[f32], t: usize, out: &mut [f32]| {
                let shared = SharedMut::new(out);
                // SAFETY: every thread passes the same arguments.
                team::run(|tm| unsafe { matmul_part(tm, x, t, &p, shared, false) });
            };
            let mut all = vec![0f32; t * rows];
            run(&x, t, &mut all);
            let naive = |i: usize, r: usize| -> f64 {
                (0..cols)
                    .map(|c| x[i * cols + c] as f64 * w[r * cols + c] as f64)
                    .sum()
            };
            for i in [0, 5, 6, 77, 149] {
                let mut one = vec![0f32; rows];
                run(&x[i * cols..(i + 1) * cols], 1, &mut one);
                assert_eq!(one, all[i * rows..(i + 1) * rows], "f32 token {i}");
                for r in [0, 63, 64, 191] {
                    assert!(
                        (one[r] as f64 - naive(i, r)).abs() < 1e-4,
                        "f32 token {i} row {r}"
                    );
                }
            }
        }
    }
}
