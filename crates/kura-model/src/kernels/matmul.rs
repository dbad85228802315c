//! `out[t, r] = Σ_c x[t, c] · W[r, c]`: every projection of the model.
//!
//! With bf16 weights on a CPU with AVX-512 BF16, every product goes through the row kernel with
//! `vdpbf16ps` (blocked for cache reuse at large batches): each (row, token) dot product is computed the
//! same way whatever the batch, so prefill and decode agree bit for bit. Otherwise, two paths:
//! - **few tokens** (decode, `t ≤ SMALL_BATCH`): our own kernel ([`super::dot`]) walks the weight rows
//!   once and multiplies each into all `t` activations; rows are split across threads. This is memory
//!   bound: the cost is reading W once.
//! - **many tokens** (prefill, large batches): the `gemm` crate. f32 weights are passed as they are; bf16
//!   weights are widened panel by panel (`PANEL_ROWS` rows at a time, into a per-thread buffer) and each
//!   panel is one `gemm` call, so widening costs `1 / t` of the multiply.
//!
//! Products smaller than `PARALLEL_MIN_MACS` run on the calling thread: waking the pool costs more.

use half::bf16;
use rayon::prelude::*;

use super::dot::{Bf16Act, F32Act, GroupDot, Isa, MAX_GROUP};
use crate::weights::{MatData, Matrix};

/// Largest token count served by the row kernel.
pub const SMALL_BATCH: usize = 8;
/// Largest token count served by the row kernel with `vdpbf16ps` (bf16 weights): all of them by
/// default (it is as fast as widening to f32 for gemm, and batch-invariant); `KURA_BF16_GEMM_FROM=n`
/// sends batches above `n` tokens to gemm instead.
pub fn dp_batch() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("KURA_BF16_GEMM_FROM")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(usize::MAX)
    })
}
const PANEL_ROWS: usize = 64;
const ROW_BLOCK: usize = 16;
const TOKEN_TILE: usize = 16;
/// Multiply-adds below which a product stays on one thread.
const PARALLEL_MIN_MACS: usize = 1 << 16;

/// A raw output pointer shared by tasks that write disjoint elements (matmul rows or columns, attention
/// units' own tokens and heads).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: every task writes a disjoint set of elements (its own rows or columns; in attention, its own
// tokens and heads), and the owning slice
// outlives the parallel region that uses the pointer.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer, through a method so that closures capture the whole (Send) wrapper, not its field.
    #[inline]
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// `out` (`t × w.rows`) = `x` (`t × w.cols`) · Wᵀ.
pub fn matmul(x: &[f32], t: usize, w: &Matrix, out: &mut [f32]) {
    assert_eq!(x.len(), t * w.cols, "x is t × cols");
    assert_eq!(out.len(), t * w.rows, "out is t × rows");
    if t == 0 {
        return;
    }
    match &w.data {
        MatData::F32(d) if t <= SMALL_BATCH => {
            rows_kernel(x, t, d, w.rows, w.cols, out, &F32Act(Isa::detect()))
        }
        // bf16 × bf16 products with f32 sums (the activations rounded to bf16 once per call): twice the
        // multiply-adds per instruction of f32 FMA and no widening, so it beats gemm up to larger batches.
        MatData::Bf16(d) if t <= dp_batch() && Bf16Act::detect().is_some() => {
            let dp = Bf16Act::detect().expect("checked above");
            let xb: Vec<bf16> = x.iter().map(|v| bf16::from_f32(*v)).collect();
            rows_kernel(&xb, t, d, w.rows, w.cols, out, &dp)
        }
        MatData::Bf16(d) if t <= SMALL_BATCH => {
            rows_kernel(x, t, d, w.rows, w.cols, out, &F32Act(Isa::detect()))
        }
        MatData::F32(d) => gemm_f32(x, t, d, w.rows, w.cols, out),
        MatData::Bf16(d) => gemm_bf16_panels(x, t, d, w.rows, w.cols, out),
    }
}

fn rows_kernel<T: Sync, X: Sync, D: GroupDot<T, X>>(
    x: &[X],
    t: usize,
    w: &[T],
    rows: usize,
    cols: usize,
    out: &mut [f32],
    dot: &D,
) {
    let out_ptr = OutPtr(out.as_mut_ptr());
    // Blocked so that a tile of TOKEN_TILE activation rows stays in L1 while ROW_BLOCK weight rows are
    // reused from L2; every (row, token) dot product is computed the same way whatever the blocking or
    // the batch, so a token's result does not depend on what else is in the batch.
    let do_rows = |r0: usize, r1: usize| {
        for rb in (r0..r1).step_by(ROW_BLOCK) {
            for tt in (0..t).step_by(TOKEN_TILE) {
                let t_end = (tt + TOKEN_TILE).min(t);
                for r in rb..(rb + ROW_BLOCK).min(r1) {
                    let row = &w[r * cols..(r + 1) * cols];
                    let mut t0 = tt;
                    while t0 < t_end {
                        let g = (t_end - t0).min(MAX_GROUP);
                        // SAFETY: (t0 + j) < t and r < rows keep every write inside `out`; each row r
                        // is written by exactly one task.
                        unsafe {
                            match g {
                                1 => {
                                    dot_into::<T, X, D, 1>(dot, row, x, t0, cols, out_ptr, rows, r)
                                }
                                2 => {
                                    dot_into::<T, X, D, 2>(dot, row, x, t0, cols, out_ptr, rows, r)
                                }
                                3 => {
                                    dot_into::<T, X, D, 3>(dot, row, x, t0, cols, out_ptr, rows, r)
                                }
                                _ => {
                                    dot_into::<T, X, D, 4>(dot, row, x, t0, cols, out_ptr, rows, r)
                                }
                            }
                        }
                        t0 += g;
                    }
                }
            }
        }
    };
    let threads = rayon::current_num_threads();
    if threads <= 1 || rows * cols * t < PARALLEL_MIN_MACS {
        do_rows(0, rows);
        return;
    }
    // A few chunks per thread evens out imbalance without paying for many tiny tasks.
    let chunk = rows.div_ceil(threads * 2).max(16);
    (0..rows.div_ceil(chunk))
        .into_par_iter()
        .for_each(|c| do_rows(c * chunk, ((c + 1) * chunk).min(rows)));
}

/// Writes `row · x[t0 + j]` to `out[t0 + j, r]` for `j < N`.
///
/// # Safety
/// `out` points at a `t × rows` buffer with `t0 + N ≤ t`, `r < rows`, and no other thread writes row `r`.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn dot_into<T, X, D: GroupDot<T, X>, const N: usize>(
    dot: &D,
    row: &[T],
    x: &[X],
    t0: usize,
    cols: usize,
    out: OutPtr,
    rows: usize,
    r: usize,
) {
    let xs: [&[X]; N] = std::array::from_fn(|j| &x[(t0 + j) * cols..(t0 + j + 1) * cols]);
    let vals = dot.dot(row, &xs);
    for (j, v) in vals.into_iter().enumerate() {
        // SAFETY: guaranteed by the caller.
        unsafe { *out.get().add((t0 + j) * rows + r) = v };
    }
}

fn gemm_f32(x: &[f32], t: usize, w: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    let threads = rayon::current_num_threads();
    let par = if threads > 1 && rows * cols * t >= PARALLEL_MIN_MACS {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: dst is t × rows row-major (row stride rows, column stride 1); lhs x is t × cols row-major;
    // rhs is Wᵀ (cols × rows): element (c, r) at r·cols + c, so row stride 1 and column stride cols. All
    // three slices have exactly these sizes (asserted by `matmul`).
    unsafe {
        gemm::gemm(
            t,
            rows,
            cols,
            out.as_mut_ptr(),
            1,
            rows as isize,
            false,
            x.as_ptr(),
            1,
            cols as isize,
            w.as_ptr(),
            cols as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

fn gemm_bf16_panels(x: &[f32], t: usize, w: &[bf16], rows: usize, cols: usize, out: &mut [f32]) {
    let out_ptr = OutPtr(out.as_mut_ptr());
    let panels = rows.div_ceil(PANEL_ROWS);
    let panel = |p: usize, buf: &mut Vec<f32>| {
        let r0 = p * PANEL_ROWS;
        let n = PANEL_ROWS.min(rows - r0);
        buf.clear();
        buf.extend(w[r0 * cols..(r0 + n) * cols].iter().map(|v| v.to_f32()));
        // SAFETY: dst is the column block r0..r0+n of the t × rows output (row stride rows, column stride 1),
        // written only by this panel; lhs is x (t × cols); rhs is the widened panel transposed
        // (cols × n: element (c, r) at r·cols + c).
        unsafe {
            gemm::gemm(
                t,
                n,
                cols,
                out_ptr.get().add(r0),
                1,
                rows as isize,
                false,
                x.as_ptr(),
                1,
                cols as isize,
                buf.as_ptr(),
                cols as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    };
    if rayon::current_num_threads() <= 1 || rows * cols * t < PARALLEL_MIN_MACS {
        let mut buf = Vec::with_capacity(PANEL_ROWS * cols);
        for p in 0..panels {
            panel(p, &mut buf);
        }
    } else {
        (0..panels).into_par_iter().for_each_init(
            || Vec::with_capacity(PANEL_ROWS * cols),
            |buf, p| panel(p, buf),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::WeightsDtype;

    fn naive(x: &[f32], t: usize, w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let mut out = vec![0f32; t * rows];
        for i in 0..t {
            for r in 0..rows {
                out[i * rows + r] = (0..cols)
                    .map(|c| x[i * cols + c] as f64 * w[r * cols + c] as f64)
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn both_paths_and_formats_match_naive() {
        let (rows, cols) = (200, 150);
        // Values exact in bf16 so that both formats must agree with the same reference.
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 61) as f32 - 30.0) / 32.0)
            .collect();
        for t in [1, 3, 5, 8, 9, 40] {
            let x: Vec<f32> = (0..t * cols).map(|i| ((i as f32) * 0.013).sin()).collect();
            for dtype in [WeightsDtype::F32, WeightsDtype::Bf16] {
                // With vdpbf16ps, decode rounds the activations to bf16: the reference does the same.
                let rounded =
                    dtype == WeightsDtype::Bf16 && t <= dp_batch() && Bf16Act::detect().is_some();
                let xr: Vec<f32> = if rounded {
                    x.iter().map(|v| bf16::from_f32(*v).to_f32()).collect()
                } else {
                    x.clone()
                };
                let want = naive(&xr, t, &w, rows, cols);
                let m = Matrix::from_f32(rows, cols, w.clone(), dtype);
                let mut out = vec![0f32; t * rows];
                matmul(&x, t, &m, &mut out);
                let err = out
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(err < 1e-3, "t={t} {dtype:?} err={err}");
            }
        }
    }
}
