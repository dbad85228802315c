//! `out[t, r] (+)= Σ_c x[t, c] · W[r, c]`: every projection of the model, as one thread's share of a
//! parallel region ([`super::team`]).
//!
//! Matrices are packed in 64-row panels where the CPU has the instructions, and every product goes
//! through [`super::packed`]: bf16 weights with `vdpbf16ps` (AVX-512 BF16), f32 weights with FMA
//! (AVX-512F, or AVX2 with FMA); one kernel for all batch sizes, so prefill and decode agree bit for bit.
//! Otherwise (bf16 weights without AVX-512 BF16; f32 and bf16 on the portable path) row-major weights go
//! through the row kernel ([`super::dot`]) for every batch size: it walks the weight rows and multiplies
//! each into a group of activations; threads split the rows. Each (row, token) dot product is summed in
//! one fixed order whatever the group, the tile, the thread split or the number of tokens in the step, so
//! a token's logits are the same bits whether it is prefilled among a thousand, in a chunk, or decoded
//! alone (a library GEMM picks its blocking, and with it its summation order, by shape: that broke cold =
//! cached here). Decode is memory bound (the cost is reading W once); prefill reuses a block of weight
//! rows from cache across a tile of tokens.
//!
//! With `add`, the product is added to what `out` holds (a residual connection fused into the product).

use super::dot::{F32Act, GroupDot, Isa, WeightElem, MAX_GROUP};
use super::packed::{self, pack_act_row};
use super::qpacked::{self, quantize_act_row, QAct, QBLOCK};
use super::team::{self, SharedMut, Team};
use crate::weights::{MatData, Matrix};

const ROW_BLOCK: usize = 16;
const TOKEN_TILE: usize = 16;

/// The activation format a matrix multiplies: f32, bf16 pairs for packed bf16 weights, or int8 blocks
/// for quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActKind {
    F32,
    Bf16Pairs,
    Int8Blocks,
}

/// Activations (`t` rows) in the format of the matrix they multiply.
#[derive(Clone, Copy)]
pub enum Act<'a> {
    F32(&'a [f32]),
    Bf16Pairs(&'a [u32]),
    Int8Blocks(QAct<'a>),
}

/// An activation buffer of `t × cols` values, kept in one [`ActKind`].
pub struct ActBuf {
    kind: ActKind,
    cols: usize,
    f32s: Vec<f32>,
    pairs: Vec<u32>,
    int8: Vec<i8>,
    scales: Vec<[f32; 2]>,
}

impl ActBuf {
    /// For int8 blocks, `cols` is a multiple of 32 (the model checks its widths at load).
    pub fn new(kind: ActKind, t: usize, cols: usize) -> Self {
        let mut buf = ActBuf {
            kind,
            cols,
            f32s: Vec::new(),
            pairs: Vec::new(),
            int8: Vec::new(),
            scales: Vec::new(),
        };
        match kind {
            ActKind::F32 => buf.f32s = vec![0f32; t * cols],
            ActKind::Bf16Pairs => buf.pairs = vec![0u32; t * cols.div_ceil(2)],
            ActKind::Int8Blocks => {
                assert!(
                    cols.is_multiple_of(QBLOCK),
                    "int8 activations are whole blocks"
                );
                buf.int8 = vec![0i8; t * cols];
                buf.scales = vec![[0f32; 2]; t * cols / QBLOCK];
            }
        }
        buf
    }

    /// A handle through which the threads of a region write disjoint rows or column ranges, and then
    /// read the whole.
    pub fn shared(&mut self) -> ActShared<'_> {
        ActShared {
            kind: self.kind,
            cols: self.cols,
            f32s: SharedMut::new(&mut self.f32s),
            pairs: SharedMut::new(&mut self.pairs),
            int8: SharedMut::new(&mut self.int8),
            scales: SharedMut::new(&mut self.scales),
        }
    }
}

/// See [`ActBuf::shared`].
#[derive(Clone, Copy)]
pub struct ActShared<'a> {
    kind: ActKind,
    cols: usize,
    f32s: SharedMut<'a, f32>,
    pairs: SharedMut<'a, u32>,
    int8: SharedMut<'a, i8>,
    scales: SharedMut<'a, [f32; 2]>,
}

impl<'a> ActShared<'a> {
    /// Writes `vals` to row `t` from column `col0`, converting to the buffer's format. For bf16 pairs,
    /// `col0` is even and the write ends on an even column or at the row's end, so that no pair is shared
    /// with another write; for int8 blocks, it covers whole blocks of 32.
    ///
    /// # Safety
    /// No other thread touches these elements until the deal that writes them is done.
    pub unsafe fn write(&self, t: usize, col0: usize, vals: &[f32]) {
        let end = col0 + vals.len();
        assert!(end <= self.cols, "write past the end of the row");
        match self.kind {
            ActKind::F32 => {
                let at = t * self.cols + col0;
                // SAFETY: the caller's guarantee.
                unsafe { self.f32s.part_mut(at..at + vals.len()) }.copy_from_slice(vals);
            }
            ActKind::Bf16Pairs => {
                assert!(
                    col0.is_multiple_of(2) && (end.is_multiple_of(2) || end == self.cols),
                    "a bf16-pair write must cover whole pairs"
                );
                let at = t * self.cols.div_ceil(2) + col0 / 2;
                // SAFETY: the caller's guarantee.
                pack_act_row(vals, unsafe {
                    self.pairs.part_mut(at..at + vals.len().div_ceil(2))
                });
            }
            ActKind::Int8Blocks => {
                assert!(
                    col0.is_multiple_of(QBLOCK) && end.is_multiple_of(QBLOCK),
                    "an int8 write must cover whole blocks"
                );
                let at = t * self.cols + col0;
                let bt = at / QBLOCK;
                // SAFETY: the caller's guarantee.
                unsafe {
                    quantize_act_row(
                        vals,
                        self.int8.part_mut(at..at + vals.len()),
                        self.scales.part_mut(bt..bt + vals.len() / QBLOCK),
                    )
                };
            }
        }
    }

    /// The whole buffer, to multiply.
    ///
    /// # Safety
    /// Nobody writes it while the activations are used.
    pub unsafe fn read(&self) -> Act<'a> {
        // SAFETY: the caller's guarantee.
        unsafe {
            match self.kind {
                ActKind::F32 => Act::F32(self.f32s.all()),
                ActKind::Bf16Pairs => Act::Bf16Pairs(self.pairs.all()),
                ActKind::Int8Blocks => Act::Int8Blocks(QAct {
                    q: self.int8.all(),
                    ds: self.scales.all(),
                }),
            }
        }
    }
}

impl Matrix {
    /// The activation format this matrix multiplies.
    pub fn act_kind(&self) -> ActKind {
        match self.data {
            MatData::Packed(_) => ActKind::Bf16Pairs,
            MatData::Quant(_) => ActKind::Int8Blocks,
            _ => ActKind::F32,
        }
    }
}

/// `out` (`t × w.rows`) = `x` (`t × w.cols`) · Wᵀ, in a parallel region of its own (the whole-step
/// region of the model calls [`matmul_part`] instead).
pub fn matmul(x: &[f32], t: usize, w: &Matrix, out: &mut [f32]) {
    assert_eq!(x.len(), t * w.cols, "x is t × cols");
    let mut buf = ActBuf::new(w.act_kind(), t, w.cols);
    let xs = buf.shared();
    for i in 0..t {
        // SAFETY: single-threaded here.
        unsafe { xs.write(i, 0, &x[i * w.cols..(i + 1) * w.cols]) };
    }
    let out = SharedMut::new(out);
    // SAFETY: nothing writes the activations during the region; every thread passes the same arguments.
    team::run(|tm| unsafe { matmul_part(tm, xs.read(), t, w, out, false) });
}

/// `out` (`t × w.rows`) (+)= `x` · Wᵀ, dealt to the team and done when it returns. Every thread of the
/// team calls it with the same arguments; nothing else touches `out` while it runs.
pub fn matmul_part(
    tm: &Team<'_>,
    x: Act<'_>,
    t: usize,
    w: &Matrix,
    out: SharedMut<'_, f32>,
    add: bool,
) {
    assert_eq!(out.len(), t * w.rows, "out is t × rows");
    if t == 0 {
        return;
    }
    match (&w.data, x) {
        // SAFETY: a PackedBf16 can only be made with a Bf16Act, which proves the CPU features; every
        // thread passes the same arguments (this function's contract).
        (MatData::Packed(p), Act::Bf16Pairs(x)) => unsafe {
            packed::matmul_part(tm, x, t, p, out, add)
        },
        // SAFETY: as above, with the Avx512 proof.
        (MatData::PackedF32(p), Act::F32(x)) => unsafe {
            packed::matmul_part(tm, x, t, p, out, add)
        },
        // SAFETY: every thread passes the same arguments (this function's contract); the kernel checks
        // the CPU's features itself.
        (MatData::Quant(q), Act::Int8Blocks(x)) => unsafe {
            qpacked::matmul_part(tm, x, t, q, out, add)
        },
        (MatData::F32(d), Act::F32(x)) => rows_part(tm, x, t, d, w, out, add),
        (MatData::Bf16(d), Act::F32(x)) => rows_part(tm, x, t, d, w, out, add),
        _ => panic!("activation format does not match the matrix (ActBuf::new(w.act_kind(), ..))"),
    }
}

/// A row-major matrix's rows dealt to the team, through the row kernel.
fn rows_part<T: WeightElem>(
    tm: &Team<'_>,
    x: &[f32],
    t: usize,
    d: &[T],
    w: &Matrix,
    out: SharedMut<'_, f32>,
    add: bool,
) {
    assert_eq!(x.len(), t * w.cols, "x is t × cols");
    let isa = Isa::detect();
    if t == 1 {
        // One token (decode): a run of rows writes its outputs alone, computed as rows 0.. of the
        // matrix that starts at the run's first row (a row's dot product is the same wherever it
        // lies in a block).
        let cols = w.cols;
        // SAFETY: every thread passes the same arguments; a run of rows writes its outputs alone;
        // addresses and lengths come from the matrix's shape, never from the activations.
        unsafe {
            tm.deal_out(
                w.rows,
                team::grain(cols * std::mem::size_of::<T>()),
                out,
                add,
                |rows| rows,
                |rows, dest| {
                    let n = rows.len();
                    let part = &d[rows.start * cols..rows.end * cols];
                    rows_on(isa, x, 1, part, n, cols, SharedMut::new(dest), 0..n, add)
                },
            )
        }
        return;
    }
    tm.deal(w.rows, |rows| {
        rows_on(isa, x, t, d, w.rows, w.cols, out, rows, add)
    })
}

/// Rows `range` of a row-major matrix into their output columns, with the row kernel of `isa`. Where a
/// row serves more than one group of tokens, bf16 rows are widened to f32 a block at a time, once for
/// all the tokens, instead of once per group: widening is exact and the f32 kernel then does the same
/// operations in the same order, so a token gets the same bits either way.
#[allow(clippy::too_many_arguments)]
fn rows_on<T: WeightElem>(
    isa: Isa,
    x: &[f32],
    t: usize,
    w: &[T],
    rows: usize,
    cols: usize,
    out: SharedMut<'_, f32>,
    range: std::ops::Range<usize>,
    add: bool,
) {
    let dot = F32Act(isa);
    if !T::WIDENED || t <= MAX_GROUP {
        return rows_kernel(x, t, w, 0, rows, cols, out, range, add, &dot);
    }
    let mut block = vec![0f32; ROW_BLOCK * cols];
    for r0 in range.clone().step_by(ROW_BLOCK) {
        let r1 = (r0 + ROW_BLOCK).min(range.end);
        let widened = &mut block[..(r1 - r0) * cols];
        for (dst, src) in widened.iter_mut().zip(&w[r0 * cols..r1 * cols]) {
            *dst = src.to_f32();
        }
        rows_kernel(x, t, widened, r0, rows, cols, out, r0..r1, add, &dot);
    }
}

/// Rows `range` through `dot`; `w` holds rows from `w_first` on (row `r` at `(r - w_first) · cols`), and
/// `out` is `t × rows` with row `r`'s results in column `r`.
#[allow(clippy::too_many_arguments)]
fn rows_kernel<T: Sync, X: Sync, D: GroupDot<T, X>>(
    x: &[X],
    t: usize,
    w: &[T],
    w_first: usize,
    rows: usize,
    cols: usize,
    out: SharedMut<'_, f32>,
    range: std::ops::Range<usize>,
    add: bool,
    dot: &D,
) {
    assert!(
        out.len() == t * rows && range.end <= rows,
        "out is t × rows"
    );
    assert!(range.start >= w_first && (range.end - w_first) * cols <= w.len());
    // Blocked so that a tile of TOKEN_TILE activation rows stays in L1 while ROW_BLOCK weight rows are
    // reused from L2; every (row, token) dot product is computed the same way whatever the blocking or
    // the batch.
    for rb in range.clone().step_by(ROW_BLOCK) {
        for tt in (0..t).step_by(TOKEN_TILE) {
            let t_end = (tt + TOKEN_TILE).min(t);
            for r in rb..(rb + ROW_BLOCK).min(range.end) {
                let row = &w[(r - w_first) * cols..(r - w_first + 1) * cols];
                let mut t0 = tt;
                while t0 < t_end {
                    let g = (t_end - t0).min(MAX_GROUP);
                    let args = (row, x, t0, cols, out, rows, r, add);
                    // SAFETY: (t0 + j) < t and r < rows keep every write inside `out`; row r belongs to
                    // this thread's range only.
                    unsafe {
                        match g {
                            1 => dot_into::<T, X, D, 1>(dot, args),
                            2 => dot_into::<T, X, D, 2>(dot, args),
                            3 => dot_into::<T, X, D, 3>(dot, args),
                            _ => dot_into::<T, X, D, 4>(dot, args),
                        }
                    }
                    t0 += g;
                }
            }
        }
    }
}

/// (weight row, x, first token, cols, out, rows, row index, add).
type DotArgs<'a, T, X> = (
    &'a [T],
    &'a [X],
    usize,
    usize,
    SharedMut<'a, f32>,
    usize,
    usize,
    bool,
);

/// Writes (or adds) `row · x[t0 + j]` to `out[t0 + j, r]` for `j < N`.
///
/// # Safety
/// `out` is a `t × rows` buffer with `t0 + N ≤ t`, `r < rows`, and no other thread touches row `r`.
#[inline]
unsafe fn dot_into<T, X, D: GroupDot<T, X>, const N: usize>(
    dot: &D,
    (row, x, t0, cols, out, rows, r, add): DotArgs<'_, T, X>,
) {
    let xs: [&[X]; N] = std::array::from_fn(|j| &x[(t0 + j) * cols..(t0 + j + 1) * cols]);
    let vals = dot.dot(row, &xs);
    for (j, v) in vals.into_iter().enumerate() {
        // SAFETY: guaranteed by the caller.
        unsafe {
            let p = out.ptr().add((t0 + j) * rows + r);
            *p = if add { *p + v } else { v };
        }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::kernels::team::split;
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

    /// `run(x, t, out)`: `out` = the product of `t` activation rows `x`.
    type Run<'a> = dyn Fn(&[f32], usize, &mut [f32]) + 'a;

    /// Tokens computed alone, in a chunk and among all: the same bits (what makes a cached prefix give
    /// the logits of a cold prompt).
    fn assert_batch_invariant(
        run: &Run<'_>,
        x: &[f32],
        t: usize,
        cols: usize,
        rows: usize,
        what: &str,
    ) {
        let mut all = vec![0f32; t * rows];
        run(x, t, &mut all);
        for i in [0, 3, 4, 5, 8, 9, 17, t - 1] {
            let mut one = vec![0f32; rows];
            run(&x[i * cols..(i + 1) * cols], 1, &mut one);
            assert_eq!(
                one,
                all[i * rows..(i + 1) * rows],
                "{what}: token {i} alone"
            );
        }
        let (from, n) = (t / 2, 9);
        let mut chunk = vec![0f32; n * rows];
        run(&x[from * cols..(from + n) * cols], n, &mut chunk);
        assert_eq!(
            chunk,
            all[from * rows..(from + n) * rows],
            "{what}: a chunk of {n}"
        );
    }

    #[test]
    fn every_format_gives_a_token_the_same_bits_in_any_batch() {
        let (rows, cols, t) = (130, 150, 70);
        let w: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let x: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.011).cos()).collect();
        let row_major = |data| Matrix { rows, cols, data };
        let cases = [
            (
                Matrix::from_f32(rows, cols, w.clone(), WeightsDtype::F32),
                "f32",
            ),
            (
                Matrix::from_f32(rows, cols, w.clone(), WeightsDtype::Bf16),
                "bf16",
            ),
            (row_major(MatData::F32(w.clone())), "f32 row-major"),
            (
                row_major(MatData::Bf16(
                    w.iter().map(|v| bf16::from_f32(*v)).collect(),
                )),
                "bf16 row-major",
            ),
        ];
        for (m, what) in &cases {
            let run = |x: &[f32], t: usize, out: &mut [f32]| matmul(x, t, m, out);
            assert_batch_invariant(&run, &x, t, cols, rows, what);
        }
    }

    #[test]
    fn the_row_kernel_gives_a_token_the_same_bits_in_any_batch_on_every_path() {
        let (rows, cols, t) = (70, 150, 40);
        let w: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let wb: Vec<bf16> = w.iter().map(|v| bf16::from_f32(*v)).collect();
        let x: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.011).cos()).collect();
        for isa in [Isa::Scalar, Isa::Avx2Fma, Isa::Avx512] {
            let has = crate::kernels::cpu_has(isa);
            if !crate::kernels::compared(&format!("row kernel, {}", isa.name()), has, has) {
                continue;
            }
            // bf16: decoded alone through the in-register widening, in a batch widened a block at a time.
            let run_f32 = |x: &[f32], t: usize, out: &mut [f32]| {
                let out = SharedMut::new(out);
                team::run(|tm| {
                    let range = split(rows, tm.size(), tm.index());
                    rows_on(isa, x, t, &w, rows, cols, out, range, false)
                });
            };
            let run_bf16 = |x: &[f32], t: usize, out: &mut [f32]| {
                let out = SharedMut::new(out);
                team::run(|tm| {
                    let range = split(rows, tm.size(), tm.index());
                    rows_on(isa, x, t, &wb, rows, cols, out, range, false)
                });
            };
            assert_batch_invariant(&run_f32, &x, t, cols, rows, &format!("f32 {}", isa.name()));
            assert_batch_invariant(
                &run_bf16,
                &x,
                t,
                cols,
                rows,
                &format!("bf16 {}", isa.name()),
            );
        }
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
            // f32 and bf16 as this CPU keeps them (packed where it has AVX-512 / vdpbf16ps), and the
            // row-major layouts (the paths of CPUs without them) whatever this CPU has.
            let row_major = Matrix {
                rows,
                cols,
                data: MatData::Bf16(w.iter().map(|v| bf16::from_f32(*v)).collect()),
            };
            let row_major_f32 = Matrix {
                rows,
                cols,
                data: MatData::F32(w.clone()),
            };
            let cases = [
                (
                    Matrix::from_f32(rows, cols, w.clone(), WeightsDtype::F32),
                    "f32",
                ),
                (
                    Matrix::from_f32(rows, cols, w.clone(), WeightsDtype::Bf16),
                    "bf16",
                ),
                (row_major, "bf16 row-major"),
                (row_major_f32, "f32 row-major"),
            ];
            for (m, name) in &cases {
                // Packed products round the activations to bf16: the reference does the same.
                let xr: Vec<f32> = if m.act_kind() == ActKind::Bf16Pairs {
                    x.iter().map(|v| bf16::from_f32(*v).to_f32()).collect()
                } else {
                    x.clone()
                };
                let want = naive(&xr, t, &w, rows, cols);
                let mut out = vec![0f32; t * rows];
                matmul(&x, t, m, &mut out);
                let err = out
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(err < 1e-3, "t={t} {name} err={err}");
            }
        }
    }
}
