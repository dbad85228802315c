//! Attention over paged KV blocks, for decode (one new token) and prefill (many) alike.
//!
//! Each new token at position `p` of a sequence attends to positions `lo..=p` (`lo = 0`, or `p + 1 − window`
//! for sliding-window layers) by walking its block table:
//!
//! ```text
//! block_size 4, p = 9:   table[0]      table[1]      table[2]
//!                        [0 1 2 3]     [4 5 6 7]     [8 9 · ·]     slots after p are never read
//! ```
//!
//! One task handles one (token, KV head) pair and all the query heads of its GQA group, so a K or V vector
//! is read from the cache once per group and never copied. Scores of all context positions are kept (one
//! row per query head) and softmaxed exactly, so the result does not depend on the block size: positions are
//! visited in the same order whatever the paging. Cost: O(tokens × heads × context × head_dim).

use half::{bf16, f16};
use kura_kv::storage::{KvSlice, LayerStorage};
use rayon::prelude::*;

use super::ops::softmax;

/// An element of stored K/V.
trait KvElem: Copy {
    fn f32(self) -> f32;
}

impl KvElem for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

impl KvElem for bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
}

#[inline]
fn dot<E: KvElem>(q: &[f32], k: &[E]) -> f32 {
    let mut acc = [0f32; 16];
    let n = q.len() / 16 * 16;
    for (qc, kc) in q[..n].chunks_exact(16).zip(k[..n].chunks_exact(16)) {
        for l in 0..16 {
            acc[l] += qc[l] * kc[l].f32();
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in n..q.len() {
        s += q[i] * k[i].f32();
    }
    s
}

#[inline]
fn axpy<E: KvElem>(out: &mut [f32], w: f32, v: &[E]) {
    for (o, x) in out.iter_mut().zip(v) {
        *o += w * x.f32();
    }
}

/// Where one sequence's new tokens sit in the batch and in its own positions.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    /// Index of its first new token among all tokens of the batch.
    pub first_token: usize,
    pub n_tokens: usize,
    /// Position of its first new token.
    pub start_pos: usize,
    pub block_table: &'a [u32],
}

/// The shape of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub window: Option<usize>,
}

/// `out` (`tokens × heads × head_dim`) = attention of `q` (same shape) over each token's context in `kv`.
/// The new tokens' own K and V must already be written to `kv`.
pub fn paged_attention(
    q: &[f32],
    seqs: &[AttnSeq<'_>],
    kv: &LayerStorage,
    shape: AttnShape,
    out: &mut [f32],
) {
    let AttnShape {
        num_heads,
        num_kv_heads,
        head_dim,
        window,
    } = shape;
    let group = num_heads / num_kv_heads;
    let mut token_pos = Vec::new();
    for (s, seq) in seqs.iter().enumerate() {
        for i in 0..seq.n_tokens {
            token_pos.push((s, seq.start_pos + i));
        }
    }
    let scale = 1.0 / (head_dim as f32).sqrt();
    let unit =
        |u: usize, out: &mut [f32]| {
            let (t, kvh) = (u / num_kv_heads, u % num_kv_heads);
            let (s, pos) = token_pos[t];
            let seq = &seqs[s];
            let lo = match window {
                Some(w) if pos + 1 > w => pos + 1 - w,
                _ => 0,
            };
            let q_base = t * num_heads * head_dim + kvh * group * head_dim;
            let q = &q[q_base..q_base + group * head_dim];
            match kv.k_head_block(0, 0) {
                KvSlice::F32(_) => attend::<f32>(
                    q,
                    seq,
                    kv,
                    kvh,
                    lo,
                    pos,
                    group,
                    head_dim,
                    scale,
                    out,
                    |s| match s {
                        KvSlice::F32(x) => x,
                        _ => unreachable!("one storage has one element format"),
                    },
                ),
                KvSlice::Bf16(_) => {
                    attend::<bf16>(q, seq, kv, kvh, lo, pos, group, head_dim, scale, out, |s| {
                        match s {
                            KvSlice::Bf16(x) => x,
                            _ => unreachable!("one storage has one element format"),
                        }
                    })
                }
                KvSlice::F16(_) => attend::<f16>(
                    q,
                    seq,
                    kv,
                    kvh,
                    lo,
                    pos,
                    group,
                    head_dim,
                    scale,
                    out,
                    |s| match s {
                        KvSlice::F16(x) => x,
                        _ => unreachable!("one storage has one element format"),
                    },
                ),
            }
        };
    // Sequences with many new tokens (prefill chunks) go through the tiled gemm path, one unit per
    // (sequence, KV head, tile of query tokens); the others one unit per (token, KV head).
    let mut units = Vec::new();
    let mut ctx_work = 0usize;
    for (s, seq) in seqs.iter().enumerate() {
        ctx_work += seq.n_tokens * (seq.start_pos + seq.n_tokens);
        if seq.n_tokens >= PREFILL_MIN_TOKENS {
            for kvh in 0..num_kv_heads {
                for i0 in (0..seq.n_tokens).step_by(PREFILL_TILE) {
                    units.push(Unit::Tile {
                        s,
                        kvh,
                        i0,
                        i1: (i0 + PREFILL_TILE).min(seq.n_tokens),
                    });
                }
            }
        } else {
            for i in 0..seq.n_tokens {
                for kvh in 0..num_kv_heads {
                    units.push(Unit::Token {
                        t: seq.first_token + i,
                        kvh,
                    });
                }
            }
        }
    }
    let out_ptr = OutPtr(out.as_mut_ptr());
    let row = num_heads * head_dim;
    let run = |u: &Unit| match *u {
        Unit::Token { t, kvh } => {
            // SAFETY: the group of heads of (t, kvh) is written by this unit only; the range lies inside
            // `out` (t < tokens, kvh < kv heads).
            let o = unsafe {
                std::slice::from_raw_parts_mut(
                    out_ptr.get().add(t * row + kvh * group * head_dim),
                    group * head_dim,
                )
            };
            unit(t * num_kv_heads + kvh, o)
        }
        Unit::Tile { s, kvh, i0, i1 } => tile(q, &seqs[s], kv, shape, kvh, i0, i1, scale, out_ptr),
    };
    if rayon::current_num_threads() <= 1 || ctx_work * num_heads * head_dim < 1 << 18 {
        units.iter().for_each(run);
    } else {
        units.par_iter().for_each(run);
    }
}

/// Query tokens per prefill tile, and the fewest new tokens for which a sequence takes the tiled path.
const PREFILL_TILE: usize = 32;
const PREFILL_MIN_TOKENS: usize = 16;

enum Unit {
    Token {
        t: usize,
        kvh: usize,
    },
    Tile {
        s: usize,
        kvh: usize,
        i0: usize,
        i1: usize,
    },
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: units write disjoint parts of the output (their own tokens' heads), which outlives the region.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    #[inline]
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Copies the K (or V) vectors of `kvh` at positions `lo..=hi` of a sequence into `dst` as f32 rows.
fn gather(
    kv: &LayerStorage,
    seq: &AttnSeq<'_>,
    kvh: usize,
    lo: usize,
    hi: usize,
    values: bool,
    dst: &mut Vec<f32>,
) {
    let (bs, d) = (kv.block_size_tokens, kv.head_dim);
    dst.clear();
    for b in lo / bs..=hi / bs {
        let block = seq.block_table[b] as usize;
        let first = lo.max(b * bs) - b * bs;
        let last = hi.min(b * bs + bs - 1) - b * bs;
        let src = if values {
            kv.v_head_block(block, kvh)
        } else {
            kv.k_head_block(block, kvh)
        };
        let span = first * d..(last + 1) * d;
        match src {
            KvSlice::F32(x) => dst.extend_from_slice(&x[span]),
            KvSlice::Bf16(x) => dst.extend(x[span].iter().map(|v| v.to_f32())),
            KvSlice::F16(x) => dst.extend(x[span].iter().map(|v| v.to_f32())),
        }
    }
}

/// Attention of query tokens `i0..i1` of one sequence, all heads of KV head `kvh`, as two products:
/// `S = Q·Kᵀ` (masked causally and by the window, softmaxed per row), then `O = S·V`.
#[allow(clippy::too_many_arguments)]
fn tile(
    q: &[f32],
    seq: &AttnSeq<'_>,
    kv: &LayerStorage,
    shape: AttnShape,
    kvh: usize,
    i0: usize,
    i1: usize,
    scale: f32,
    out: OutPtr,
) {
    let AttnShape {
        num_heads,
        num_kv_heads,
        head_dim: d,
        window,
    } = shape;
    let group = num_heads / num_kv_heads;
    let lo_of = |pos: usize| match window {
        Some(w) if pos + 1 > w => pos + 1 - w,
        _ => 0,
    };
    let (p0, p1) = (seq.start_pos + i0, seq.start_pos + i1 - 1);
    let klo = lo_of(p0);
    let n_k = p1 + 1 - klo;
    let m = (i1 - i0) * group;
    let mut k = Vec::with_capacity(n_k * d);
    let mut v = Vec::with_capacity(n_k * d);
    gather(kv, seq, kvh, klo, p1, false, &mut k);
    gather(kv, seq, kvh, klo, p1, true, &mut v);
    let mut qt = Vec::with_capacity(m * d);
    for i in i0..i1 {
        let base = (seq.first_token + i) * num_heads * d + kvh * group * d;
        qt.extend_from_slice(&q[base..base + group * d]);
    }
    let mut s = vec![0f32; m * n_k];
    // SAFETY: S is m × n_k row-major; Q is m × d row-major; Kᵀ (d × n_k) reads K (n_k × d row-major)
    // with row stride 1 and column stride d. All buffers have exactly these sizes.
    unsafe {
        gemm::gemm(
            m,
            n_k,
            d,
            s.as_mut_ptr(),
            1,
            n_k as isize,
            false,
            qt.as_ptr(),
            1,
            d as isize,
            k.as_ptr(),
            d as isize,
            1,
            0.0,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
    for (r, row) in s.chunks_exact_mut(n_k).enumerate() {
        let pos = p0 + r / group;
        let (lo, hi) = (lo_of(pos) - klo, pos - klo);
        // Positions outside the window or after the query get weight 0 (no exp of -inf needed).
        softmax(&mut row[lo..=hi]);
        row[..lo].fill(0.0);
        row[hi + 1..].fill(0.0);
    }
    let mut o = vec![0f32; m * d];
    // SAFETY: O is m × d row-major; P (= S) is m × n_k row-major; V is n_k × d row-major.
    unsafe {
        gemm::gemm(
            m,
            d,
            n_k,
            o.as_mut_ptr(),
            1,
            d as isize,
            false,
            s.as_ptr(),
            1,
            n_k as isize,
            v.as_ptr(),
            1,
            d as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
    for (i, rows) in (i0..i1).zip(o.chunks_exact(group * d)) {
        let at = (seq.first_token + i) * num_heads * d + kvh * group * d;
        // SAFETY: the heads of kvh for tokens i0..i1 of this sequence are written by this unit only, and
        // lie inside the output (tokens × heads × head_dim).
        unsafe { std::ptr::copy_nonoverlapping(rows.as_ptr(), out.get().add(at), group * d) };
    }
}

#[allow(clippy::too_many_arguments)]
fn attend<'a, E: KvElem + 'a>(
    q: &[f32],
    seq: &AttnSeq<'_>,
    kv: &'a LayerStorage,
    kvh: usize,
    lo: usize,
    pos: usize,
    group: usize,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
    typed: impl Fn(KvSlice<'a>) -> &'a [E],
) {
    let bs = kv.block_size_tokens;
    let n_ctx = pos + 1 - lo;
    let mut scores = vec![0f32; group * n_ctx];
    // Visits the context positions lo..=pos block by block: (block id, first slot, last slot, index of the
    // first slot among the context positions).
    let spans = (lo / bs..=pos / bs).map(|b| {
        let block = seq.block_table[b] as usize;
        let first = lo.max(b * bs) - b * bs;
        let last = pos.min(b * bs + bs - 1) - b * bs;
        (block, first, last, b * bs + first - lo)
    });
    for (block, first, last, at) in spans.clone() {
        let k = typed(kv.k_head_block(block, kvh));
        for slot in first..=last {
            let krow = &k[slot * head_dim..(slot + 1) * head_dim];
            for g in 0..group {
                scores[g * n_ctx + at + slot - first] =
                    dot(&q[g * head_dim..(g + 1) * head_dim], krow) * scale;
            }
        }
    }
    for g in 0..group {
        softmax(&mut scores[g * n_ctx..(g + 1) * n_ctx]);
    }
    out.fill(0.0);
    for (block, first, last, at) in spans {
        let v = typed(kv.v_head_block(block, kvh));
        for slot in first..=last {
            let vrow = &v[slot * head_dim..(slot + 1) * head_dim];
            for g in 0..group {
                axpy(
                    &mut out[g * head_dim..(g + 1) * head_dim],
                    scores[g * n_ctx + at + slot - first],
                    vrow,
                );
            }
        }
    }
}
