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
//! visited in the same order whatever the paging. Each token is computed the same way whether it comes in a
//! prefill chunk or alone in a decode step, so a token's output does not depend on its batch. The loops
//! are compiled for AVX-512 where the CPU has it. Cost: O(tokens × heads × context × head_dim).

use half::{bf16, f16};
use kura_kv::storage::{KvSlice, LayerStorage};
use rayon::prelude::*;

use super::dot::Isa;
use super::matmul::OutPtr;
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

#[inline(always)]
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

#[inline(always)]
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
    let use_avx512 = Isa::detect() == Isa::Avx512;
    let unit = |u: usize, out: &mut [f32]| {
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
            KvSlice::F32(_) => attend_any::<f32>(
                use_avx512,
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
            KvSlice::Bf16(_) => attend_any::<bf16>(
                use_avx512,
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
                    KvSlice::Bf16(x) => x,
                    _ => unreachable!("one storage has one element format"),
                },
            ),
            KvSlice::F16(_) => attend_any::<f16>(
                use_avx512,
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
    // One unit per (token, KV head), prefill and decode alike: a token's result never depends on what
    // else is in the batch, so prefill, chunked prefill and decode give bit-identical outputs.
    let mut units = Vec::new();
    let mut ctx_work = 0usize;
    for seq in seqs {
        ctx_work += seq.n_tokens * (seq.start_pos + seq.n_tokens);
        for i in 0..seq.n_tokens {
            for kvh in 0..num_kv_heads {
                units.push(Unit {
                    t: seq.first_token + i,
                    kvh,
                });
            }
        }
    }
    let out_ptr = OutPtr(out.as_mut_ptr());
    let row = num_heads * head_dim;
    let run = |u: &Unit| {
        let Unit { t, kvh } = *u;
        {
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
    };
    if rayon::current_num_threads() <= 1 || ctx_work * num_heads * head_dim < 1 << 18 {
        units.iter().for_each(run);
    } else {
        units.par_iter().for_each(run);
    }
}

struct Unit {
    t: usize,
    kvh: usize,
}

/// [`attend`] with the widest vectors the CPU has.
#[allow(clippy::too_many_arguments)]
fn attend_any<'a, E: KvElem + 'a>(
    use_avx512: bool,
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
    #[cfg(target_arch = "x86_64")]
    if use_avx512 {
        // SAFETY: use_avx512 comes from Isa::detect, which checked avx512f.
        return unsafe {
            attend_avx512(q, seq, kv, kvh, lo, pos, group, head_dim, scale, out, typed)
        };
    }
    let _ = use_avx512;
    attend(q, seq, kv, kvh, lo, pos, group, head_dim, scale, out, typed)
}

/// [`attend`] compiled for AVX-512, so that its loops over `head_dim` use 16-lane vectors.
///
/// # Safety
/// The CPU supports avx512f.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_avx512<'a, E: KvElem + 'a>(
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
    attend(q, seq, kv, kvh, lo, pos, group, head_dim, scale, out, typed)
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
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
