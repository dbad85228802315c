//! bf16 weights packed for `vdpbf16ps` (AVX-512 BF16), and the one kernel that multiplies them, for
//! decode and prefill alike.
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

use super::dot::Bf16Act;
use super::team::{split, SharedMut, Team};

/// Rows per panel.
pub const PANEL_ROWS: usize = 64;
/// Tokens per register tile.
pub const TILE_TOKENS: usize = 6;
/// Tokens per cache chunk in prefill.
const CHUNK_TOKENS: usize = 96;
/// Up to this many tokens, threads split rows only, so that each weight is read from memory once.
const ROWS_ONLY_UP_TO: usize = 16;

/// A `[rows, cols]` matrix in the panel layout.
#[derive(Clone)]
pub struct PackedBf16 {
    pub rows: usize,
    pub cols: usize,
    /// Column pairs: `cols.div_ceil(2)`.
    pub pairs: usize,
    panels: usize,
    data: Vec<u32>,
}

#[inline]
fn pair(lo: bf16, hi: bf16) -> u32 {
    u32::from(lo.to_bits()) | (u32::from(hi.to_bits()) << 16)
}

impl PackedBf16 {
    /// Packs a row-major f32 matrix, rounding each value to bf16 (to nearest, ties to even). Takes the
    /// proof that this CPU can multiply it.
    pub fn from_f32(_cpu: &Bf16Act, rows: usize, cols: usize, w: &[f32]) -> Self {
        assert_eq!(w.len(), rows * cols, "w is rows × cols");
        let pairs = cols.div_ceil(2);
        let panels = rows.div_ceil(PANEL_ROWS);
        let mut data = vec![0u32; panels * pairs * PANEL_ROWS];
        if data.is_empty() {
            return PackedBf16 {
                rows,
                cols,
                pairs,
                panels,
                data,
            };
        }
        let at = |r: usize, c: usize| {
            if c < cols {
                bf16::from_f32(w[r * cols + c])
            } else {
                bf16::ZERO
            }
        };
        for (p, panel) in data.chunks_exact_mut(pairs * PANEL_ROWS).enumerate() {
            for lane in 0..PANEL_ROWS.min(rows - p * PANEL_ROWS) {
                let r = p * PANEL_ROWS + lane;
                for j in 0..pairs {
                    panel[j * PANEL_ROWS + lane] = pair(at(r, 2 * j), at(r, 2 * j + 1));
                }
            }
        }
        PackedBf16 {
            rows,
            cols,
            pairs,
            panels,
            data,
        }
    }

    /// Element `(r, c)`.
    pub fn get(&self, r: usize, c: usize) -> bf16 {
        let (p, lane) = (r / PANEL_ROWS, r % PANEL_ROWS);
        let word = self.data[(p * self.pairs + c / 2) * PANEL_ROWS + lane];
        bf16::from_bits((word >> (16 * (c % 2))) as u16)
    }

    /// Row `r` as f32 into `out` (an embedding lookup).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        for (c, o) in out.iter_mut().enumerate().take(self.cols) {
            *o = self.get(r, c).to_f32();
        }
    }

    /// Bytes held, padding included: what a decode step reads.
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }

    fn panel(&self, p: usize) -> &[u32] {
        &self.data[p * self.pairs * PANEL_ROWS..(p + 1) * self.pairs * PANEL_ROWS]
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

/// This thread's share of `out (t × w.rows) (+)= x (t × pairs, bf16 pairs) · Wᵀ`: with `add`, the product
/// is added to what `out` holds (a residual connection), else it replaces it.
///
/// # Safety
/// Every thread of the team calls this with the same arguments, and nothing else touches `out` until the
/// next barrier. (The CPU features are proven by the matrix: a `PackedBf16` is made with a `Bf16Act`.)
pub unsafe fn matmul_part(
    tm: &Team<'_>,
    x: &[u32],
    t: usize,
    w: &PackedBf16,
    out: SharedMut<'_, f32>,
    add: bool,
) {
    assert_eq!(x.len(), t * w.pairs, "x is t × pairs");
    assert_eq!(out.len(), t * w.rows, "out is t × rows");
    let chunk = chunk_tokens(t, w.panels, tm.size());
    let chunks = t.div_ceil(chunk.max(1));
    for item in split(chunks * w.panels, tm.size(), tm.index()) {
        let (c, p) = (item / w.panels, item % w.panels);
        let panel = w.panel(p);
        let r0 = p * PANEL_ROWS;
        let valid = PANEL_ROWS.min(w.rows - r0);
        let (t_lo, t_hi) = (c * chunk, ((c + 1) * chunk).min(t));
        let mut t0 = t_lo;
        while t0 < t_hi {
            let m = (t_hi - t0).min(TILE_TOKENS);
            let xp = x[t0 * w.pairs..].as_ptr();
            // SAFETY: rows r0..r0+valid of tokens t0..t0+m lie inside `out` (t0 + m ≤ t, r0 + valid ≤
            // rows) and belong to this work item alone; the panel holds pairs × 64 words and x holds m
            // rows of pairs words from t0. The CPU features: `w` was made with a Bf16Act.
            unsafe {
                let op = out.ptr().add(t0 * w.rows + r0);
                let args = (panel.as_ptr(), w.pairs, xp, op, w.rows, valid, add);
                match m {
                    1 => x86::tile::<1>(args),
                    2 => x86::tile::<2>(args),
                    3 => x86::tile::<3>(args),
                    4 => x86::tile::<4>(args),
                    5 => x86::tile::<5>(args),
                    _ => x86::tile::<6>(args),
                }
            }
            t0 += m;
        }
    }
}

/// Tokens per work item: all of them for small batches (threads split the rows, each weight read
/// once); otherwise chunks of [`CHUNK_TOKENS`], smaller when there are too few panels to give every
/// thread several items.
fn chunk_tokens(t: usize, panels: usize, threads: usize) -> usize {
    if t <= ROWS_ONLY_UP_TO || threads <= 1 && t <= CHUNK_TOKENS {
        return t;
    }
    let want_chunks = (8 * threads).div_ceil(panels).max(t.div_ceil(CHUNK_TOKENS));
    t.div_ceil(want_chunks)
        .div_ceil(TILE_TOKENS)
        .max(1)
        .saturating_mul(TILE_TOKENS)
        .min(CHUNK_TOKENS)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// (panel, pairs, x at the tile's first token, out at (first token, first row), out row stride,
    /// valid rows of the panel, add).
    pub type TileArgs = (*const u32, usize, *const u32, *mut f32, usize, usize, bool);

    /// One tile: `M` tokens × 64 rows.
    ///
    /// # Safety
    /// avx512f and avx512bf16 are present; the panel holds `pairs × 64` words; `x` holds `M` rows of
    /// `pairs` words; `out` has `M` rows (stride `ldo`) with `valid` writable columns each.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn tile<const M: usize>((w, pairs, x, out, ldo, valid, add): TileArgs) {
        let mut acc = [[_mm512_setzero_ps(); 4]; M];
        for j in 0..pairs {
            // SAFETY: j < pairs keeps every read inside the panel and the activation rows.
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
                        *x.add(m * pairs + j) as i32,
                    ));
                    for s in 0..4 {
                        accm[s] = _mm512_dpbf16_ps(accm[s], b[s], a);
                    }
                }
            }
        }
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
    pub type TileArgs = (*const u32, usize, *const u32, *mut f32, usize, usize, bool);
    pub unsafe fn tile<const M: usize>(_: TileArgs) {
        unreachable!("packed bf16 weights exist only on CPUs with AVX-512 BF16")
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

    fn run_packed(x: &[f32], t: usize, w: &PackedBf16, out: &mut [f32], add: bool) {
        let mut xp = vec![0u32; t * w.pairs];
        for (src, dst) in x.chunks_exact(w.cols).zip(xp.chunks_exact_mut(w.pairs)) {
            pack_act_row(src, dst);
        }
        let shared = SharedMut::new(out);
        // SAFETY: the callers checked the CPU; every thread passes the same arguments.
        team::run(|tm| unsafe { matmul_part(tm, &xp, t, w, shared, add) });
    }

    #[test]
    fn packing_keeps_every_element() {
        let Some(cpu) = Bf16Act::detect() else { return };
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
        let Some(cpu) = Bf16Act::detect() else { return };
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
        let Some(cpu) = Bf16Act::detect() else { return };
        let (rows, cols) = (192, 96);
        let w: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = PackedBf16::from_f32(&cpu, rows, cols, &w);
        let t = 150;
        let x: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.011).cos()).collect();
        let mut all = vec![0f32; t * rows];
        run_packed(&x, t, &p, &mut all, false);
        for i in [0, 5, 6, 77, 149] {
            let mut one = vec![0f32; rows];
            run_packed(&x[i * cols..(i + 1) * cols], 1, &p, &mut one, false);
            assert_eq!(one, all[i * rows..(i + 1) * rows], "token {i}");
        }
    }
}
