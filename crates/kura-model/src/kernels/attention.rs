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
//! One unit handles one token's query heads of one KV head (its GQA group), so a K or V vector is read
//! from the cache once per group and never copied, over one segment of the token's context: positions
//! are cut at multiples of [`SEGMENT`] (absolute positions), so a long-context decode spreads over the
//! threads of the step's region ([`super::team`]), which deal the units out in turn. A unit keeps the
//! scores of its positions, their max `m`, the sum `l` of `e^(score − m)` and the unnormalised output
//! `o = Σ e^(score − m) · V`; the segments of a token are merged in order (`Σ e^(m_s − M) o_s / Σ e^(m_s −
//! M) l_s`). Positions are visited in the same order whatever the paging, so the result does not depend
//! on the block size, and each token is computed the same way whether it comes in a prefill chunk or alone
//! in a decode step, so a token's output does not depend on its batch. With AVX-512 and a head size of 64,
//! 128 or 256 a vector kernel computes 16 scores at a time (see [`x86`]); with AVX2, plain rows (f32,
//! bf16, f16) of a head size that is a multiple of 8 and encoded ones (int8, fp8, int4) of a multiple of
//! 64 go through one that computes 8 at a time (see [`avx2`]), also on AVX-512 CPUs for what their own
//! kernels do not take; other shapes and CPUs take a portable loop ([`attention_kernel`] says which a
//! unit takes). Cost:
//! O(tokens × heads × context × head_dim).

use half::{bf16, f16};
use kura_kv::codec::{self, KvDtype, QUANT_GROUP};
use kura_kv::storage::{KvSlice, LayerStorage};

use kura_shape::attn_split::{context_start, segments, token_units, Dealer, SEGMENT};

use super::dot::Isa;
use super::matmul::ActShared;
use super::team::{SharedMut, Team};

#[cfg(target_arch = "x86_64")]
#[path = "attention_avx2.rs"]
mod avx2;

/// How one stored K or V row (one token's vector of one head) is read: its units (elements of a plain
/// format, bytes of an encoded one), its decoding to f32 for the portable loop, its scales (read once per
/// row), and for AVX-512 its 16 lanes at a time, dequantised in registers (the AVX2 kernel's 8 lanes:
/// `attention_avx2.rs`).
trait KvRow {
    type Unit: Copy;
    /// Whether scores against these rows are integer dot products with the query quantised
    /// ([`QuantQuery`]) rather than f32 ones.
    const INTEGER_SCORES: bool = false;
    /// What a row's lanes need besides its units: its scales (and minimums), read once per row.
    #[cfg(target_arch = "x86_64")]
    type Params: Copy;
    /// The units of a slice of this storage's format.
    fn typed(s: KvSlice<'_>) -> &[Self::Unit];
    /// Decodes a row (its units) into `out` (`head_dim` values, in the stored basis).
    fn decode(row: &[Self::Unit], out: &mut [f32]);
    /// The row's scales.
    ///
    /// # Safety
    /// A whole row of a `head_dim`-element vector is readable at `row`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn params(row: *const Self::Unit, head_dim: usize) -> Self::Params;
    /// Elements `16c..16c + 16` of the row, as f32.
    ///
    /// # Safety
    /// avx512f is present; a whole row of a `head_dim`-element vector, `head_dim` a multiple of 64, is
    /// readable at `row`, and `16c < head_dim`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(
        row: *const Self::Unit,
        c: usize,
        p: &Self::Params,
    ) -> std::arch::x86_64::__m512;
    /// For a row of one group whose lanes are `scale × raw`: that scale ([`KvRow::load16_unscaled`]
    /// gives the raw lanes).
    #[cfg(target_arch = "x86_64")]
    fn single_scale(_p: &Self::Params) -> Option<f32> {
        None
    }
    /// Lanes `16c..16c + 16` before the scale of [`KvRow::single_scale`].
    ///
    /// # Safety
    /// As [`KvRow::load16`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16_unscaled(_row: *const Self::Unit, _c: usize) -> std::arch::x86_64::__m512 {
        unreachable!("only rows with a single scale are read unscaled")
    }
}

macro_rules! plain_row {
    ($t:ty, $variant:ident, |$p:ident| $load:expr) => {
        impl KvRow for $t {
            type Unit = $t;
            #[cfg(target_arch = "x86_64")]
            type Params = ();
            #[inline(always)]
            fn typed(s: KvSlice<'_>) -> &[$t] {
                match s {
                    KvSlice::$variant(x) => x,
                    _ => unreachable!("one storage has one element format"),
                }
            }
            #[inline(always)]
            fn decode(row: &[$t], out: &mut [f32]) {
                for (o, x) in out.iter_mut().zip(row) {
                    *o = f32::from(*x);
                }
            }
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn params(_: *const $t, _: usize) {}
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn load16(row: *const $t, c: usize, _: &()) -> std::arch::x86_64::__m512 {
                #[allow(unused_imports)]
                use std::arch::x86_64::*;
                // SAFETY: the caller's guarantee (16 elements readable at 16c, avx512f present).
                unsafe {
                    let $p = row.add(16 * c);
                    $load
                }
            }
        }
    };
}

plain_row!(f32, F32, |p| _mm512_loadu_ps(p));
// bf16 widens to f32 by a 16-bit shift.
plain_row!(bf16, Bf16, |p| _mm512_castsi512_ps(
    _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
        p as *const __m256i
    )))
));
plain_row!(f16, F16, |p| _mm512_cvtph_ps(_mm256_loadu_si256(
    p as *const __m256i
)));

/// Rows of int8, fp8 and int4 ([`kura_kv::codec`]'s encodings).
struct Int8Row;
struct Fp8Row;
struct Int4Row;

/// The f16 at `p` (little-endian), as f32.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's guarantee that two bytes are readable at p, and (called from the AVX-512
    // kernel, whose avx512f implies f16c, and the AVX2 one, which checks it) that f16c is present.
    unsafe {
        let bits = std::ptr::read_unaligned(p as *const u16);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le(
            bits,
        )))))
    }
}

/// Scales of the groups (one for head size 64, two for 128, three for 192, four for 256) of a row whose
/// payload is `payload` bytes, each group's scale `stride` bytes after the last; `mul` folded in. Where
/// the row has fewer groups, the first group's scale stands in for the others.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn group_scales(
    row: *const u8,
    payload: usize,
    stride: usize,
    groups: usize,
    mul: f32,
) -> [f32; 4] {
    // SAFETY: the caller's guarantee that the row is readable.
    unsafe {
        let s0 = f16_at(row.add(payload)) * mul;
        let at = |g: usize| {
            if groups > g {
                f16_at(row.add(payload + g * stride)) * mul
            } else {
                s0
            }
        };
        [s0, at(1), at(2), at(3)]
    }
}

/// The units of an encoded storage.
fn quant_units(s: KvSlice<'_>) -> &[u8] {
    match s {
        KvSlice::Quant(x) => x,
        _ => unreachable!("one storage has one element format"),
    }
}

/// A format of one byte an element and one f16 scale per group (int8, fp8): its lanes are the raw
/// values (`$unscaled`, 16 payload bytes at `$p`) times the group's scale, `$mul` folded into the scale;
/// `$integer`: whether its scores are integer dot products ([`KvRow::INTEGER_SCORES`]).
macro_rules! byte_row {
    ($row:ident, $dtype:expr, $integer:expr, $mul:expr, |$p:ident| $unscaled:expr) => {
        impl KvRow for $row {
            type Unit = u8;
            const INTEGER_SCORES: bool = $integer;
            #[cfg(target_arch = "x86_64")]
            type Params = [f32; 4];
            fn typed(s: KvSlice<'_>) -> &[u8] {
                quant_units(s)
            }
            fn decode(row: &[u8], out: &mut [f32]) {
                codec::decode_stored($dtype, row, out);
            }
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn params(row: *const u8, head_dim: usize) -> [f32; 4] {
                // SAFETY: the caller's guarantee.
                unsafe { group_scales(row, head_dim, 2, head_dim / QUANT_GROUP, $mul) }
            }
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn load16(row: *const u8, c: usize, p: &[f32; 4]) -> std::arch::x86_64::__m512 {
                use std::arch::x86_64::*;
                // SAFETY: the caller's guarantee: 16 payload bytes at 16c.
                unsafe { _mm512_mul_ps(Self::load16_unscaled(row, c), _mm512_set1_ps(p[c / 4])) }
            }
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            fn single_scale(p: &[f32; 4]) -> Option<f32> {
                Some(p[0])
            }
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn load16_unscaled(row: *const u8, c: usize) -> std::arch::x86_64::__m512 {
                #[allow(unused_imports)]
                use std::arch::x86_64::*;
                // SAFETY: the caller's guarantee: 16 payload bytes at 16c.
                unsafe {
                    let $p = _mm_loadu_si128(row.add(16 * c) as *const __m128i);
                    $unscaled
                }
            }
        }
    };
}

byte_row!(Int8Row, KvDtype::Int8, true, 1.0, |b| _mm512_cvtepi32_ps(
    _mm512_cvtepi8_epi32(b)
));
// e4m3 is read as an f16 whose exponent is 8 short (bias 15, not 7): 2^8 goes into the scale. Each byte
// s eeee mmm becomes the f16 s 0eeee mmm0000000: the byte into the high half of a 16-bit lane (s eeee
// mmm 00000000), an arithmetic shift right by one (s s eeee mmm 0000000), bit 14 cleared.
byte_row!(Fp8Row, KvDtype::Fp8, false, 256.0, |b| {
    let hi = _mm256_slli_epi16::<8>(_mm256_cvtepu8_epi16(b));
    _mm512_cvtph_ps(_mm256_and_si256(
        _mm256_srai_epi16::<1>(hi),
        _mm256_set1_epi16(0xBFFFu16 as i16),
    ))
});

impl KvRow for Int4Row {
    type Unit = u8;
    const INTEGER_SCORES: bool = true;
    #[cfg(target_arch = "x86_64")]
    type Params = [[f32; 4]; 2];
    fn typed(s: KvSlice<'_>) -> &[u8] {
        quant_units(s)
    }
    fn decode(row: &[u8], out: &mut [f32]) {
        codec::decode_stored(KvDtype::Int4, row, out);
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn params(row: *const u8, head_dim: usize) -> [[f32; 4]; 2] {
        let payload = head_dim / 2;
        // SAFETY: the caller's guarantee.
        unsafe {
            let groups = head_dim / QUANT_GROUP;
            let scale = group_scales(row, payload, 4, groups, 1.0);
            let min = group_scales(row.add(2), payload, 4, groups, 1.0);
            [scale, min]
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(row: *const u8, c: usize, p: &[[f32; 4]; 2]) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // Group c / 4 has 32 bytes; its chunks 0, 1 are the low nibbles of bytes 0..16, 16..32 and its
        // chunks 2, 3 the high nibbles of the same bytes.
        let (g, cc) = (c / 4, c % 4);
        // SAFETY: the caller's guarantee: the group's 32 payload bytes are readable.
        unsafe {
            let b = _mm_loadu_si128(row.add(g * 32 + (cc % 2) * 16) as *const __m128i);
            let b = if cc >= 2 { _mm_srli_epi16::<4>(b) } else { b };
            let q = _mm_and_si128(b, _mm_set1_epi8(0x0F));
            let x = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
            _mm512_fmadd_ps(x, _mm512_set1_ps(p[0][g]), _mm512_set1_ps(p[1][g]))
        }
    }
}

/// `q · k` over f32 rows, 16 lanes of partial sums added in order.
#[inline(always)]
fn dot(q: &[f32], k: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let n = q.len() / 16 * 16;
    for (qc, kc) in q[..n].chunks_exact(16).zip(k[..n].chunks_exact(16)) {
        for l in 0..16 {
            acc[l] += qc[l] * kc[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in n..q.len() {
        s += q[i] * k[i];
    }
    s
}

#[inline(always)]
fn axpy(out: &mut [f32], w: f32, v: &[f32]) {
    for (o, x) in out.iter_mut().zip(v) {
        *o += w * x;
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

/// Floats of one unit's partial result: per query head of the group, its running max, its sum of
/// exponentials, and its unnormalised output.
fn partial_len(shape: AttnShape) -> usize {
    shape.num_heads / shape.num_kv_heads * (shape.head_dim + 2)
}

/// Positions of the new tokens of a batch, in batch order.
fn batch_positions<'s>(seqs: &'s [AttnSeq<'_>]) -> impl Iterator<Item = usize> + Clone + 's {
    seqs.iter()
        .flat_map(|s| s.start_pos..s.start_pos + s.n_tokens)
}

thread_local! {
    /// A thread's buffer of one unit's scores, kept between calls (a step calls attention once a layer).
    static SCORES: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Makes `scores` hold at least `n` values, keeping what it held: every kernel writes each of a unit's
/// `group × n_ctx` scores before it reads it, so nothing needs clearing.
fn fit(scores: &mut Vec<f32>, n: usize) {
    if scores.len() < n {
        scores.resize(n, 0.0);
    }
}

/// Length of the scratch buffer [`attention_part`] needs for this batch: the partials of the tokens whose
/// context spans more than one segment.
pub fn partials_len(seqs: &[AttnSeq<'_>], shape: AttnShape) -> usize {
    let mut n = 0;
    for seq in seqs {
        for pos in seq.start_pos..seq.start_pos + seq.n_tokens {
            let k = segments(pos, shape.window);
            if k > 1 {
                n += k;
            }
        }
    }
    n * shape.num_kv_heads * partial_len(shape)
}

/// `out` (`tokens × heads × head_dim`) = attention of `q` (rows `q_stride` apart,
/// each starting with the token's `heads × head_dim` query) over each token's context in `kv`. The new
/// tokens' own K and V must already be written to `kv`. `partials` (at least [`partials_len`]) is scratch.
/// The work is dealt to the team (units of about equal cost, then the merges of tokens whose context
/// spans several segments) and done when it returns.
///
/// # Safety
/// Every thread of the team calls it with the same arguments, and nothing else touches `out` or
/// `partials` while it runs.
#[allow(clippy::too_many_arguments)]
pub unsafe fn attention_part(
    tm: &Team<'_>,
    q: &[f32],
    q_stride: usize,
    seqs: &[AttnSeq<'_>],
    kv: &LayerStorage,
    shape: AttnShape,
    partials: SharedMut<'_, f32>,
    out: ActShared<'_>,
) {
    // SAFETY: the caller's guarantee; the path is this CPU's.
    unsafe {
        attention_part_on(
            Isa::detect(),
            tm,
            q,
            q_stride,
            seqs,
            kv,
            shape,
            partials,
            out,
        )
    }
}

/// [`attention_part`] through the kernels of `isa`.
///
/// # Safety
/// As [`attention_part`]; the CPU has `isa`'s instructions.
#[allow(clippy::too_many_arguments)]
unsafe fn attention_part_on(
    isa: Isa,
    tm: &Team<'_>,
    q: &[f32],
    q_stride: usize,
    seqs: &[AttnSeq<'_>],
    kv: &LayerStorage,
    shape: AttnShape,
    partials: SharedMut<'_, f32>,
    out: ActShared<'_>,
) {
    let AttnShape {
        num_heads,
        num_kv_heads,
        head_dim,
        window,
    } = shape;
    let group = num_heads / num_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let plen = partial_len(shape);
    let needed = partials_len(seqs, shape);
    assert!(partials.len() >= needed, "partials sized by partials_len");
    // Kept from the thread's last call: a unit's scores are all written before they are read, so the
    // buffer is neither cleared nor zeroed (at ~1,300 positions zeroing it took 3.5 % of a decode step).
    let mut scores = SCORES.with(|s| s.take());
    let mut own = vec![0f32; plen];
    let mut o = vec![0f32; group * head_dim];
    let mut qrot = vec![0f32; group * head_dim];
    let mut qq = QuantQuery::default();
    // Phase 1: one unit per (token, segment of its context, KV head), prefill and decode alike. The
    // units, in order, are cut into one contiguous run per thread of about equal cost (positions read,
    // plus a fixed cost per unit): units differ in size (a token's last segment is short, contexts
    // differ), so dealing them out in turn can give one thread twice the work of the other. Which thread
    // computes a unit does not change its bits. A token with one segment is finished at once (the same
    // arithmetic as a merge of one); the others leave their partials for phase 2.
    // The runs are dealt to the threads as work items: a thread that is switched out takes none.
    let runs_of = Dealer::new(batch_positions(seqs), window, num_kv_heads, tm.size());
    let mut stage = Staged::default();
    let run_units = |runs: std::ops::Range<usize>, mut staged: Option<&mut Staged>| {
        if let Some(stage) = staged.as_deref_mut() {
            stage.clear();
        }
        let mut dealer = runs_of.clone();
        let mut first = 0usize;
        for seq in seqs {
            for i in 0..seq.n_tokens {
                let t = seq.first_token + i;
                let pos = seq.start_pos + i;
                let lo = context_start(pos, window);
                let n_seg = segments(pos, window);
                for (j, (k, cost)) in token_units(pos, window).enumerate() {
                    for kvh in 0..num_kv_heads {
                        if !runs.contains(&dealer.deal(cost)) {
                            continue;
                        }
                        let q_base = t * q_stride + kvh * group * head_dim;
                        let q = rotated_query(
                            kv.dtype(),
                            head_dim,
                            &q[q_base..q_base + group * head_dim],
                            &mut qrot,
                        );
                        if integer_scores(kv.dtype()) {
                            qq.fill(q, head_dim);
                        }
                        let job = Job {
                            q,
                            qq: &qq,
                            seq,
                            kv,
                            kvh,
                            lo: lo.max(k * SEGMENT),
                            pos: pos.min(k * SEGMENT + SEGMENT - 1),
                            group,
                            head_dim,
                            scale,
                        };
                        let at = ((first + j) * num_kv_heads + kvh) * plen;
                        let part: &mut [f32] = match (n_seg, staged.as_deref_mut()) {
                            (1, _) => &mut own,
                            (_, Some(stage)) => stage.slot(StagedWrite::Partial(at), plen),
                            // SAFETY: this unit alone writes this partial, until the deal is done.
                            (_, None) => unsafe { partials.part_mut(at..at + plen) },
                        };
                        attend_dtype(kv.dtype(), isa, &job, &mut scores, part);
                        if n_seg == 1 {
                            merge(std::iter::once(&own[..]), group, head_dim, &mut o);
                            unrotate(kv.dtype(), head_dim, &mut o);
                            let col = kvh * group * head_dim;
                            match staged.as_deref_mut() {
                                Some(stage) => stage
                                    .slot(StagedWrite::Out(t, col), o.len())
                                    .copy_from_slice(&o),
                                // SAFETY: the heads of (t, kvh) are written by this unit only,
                                // until the deal is done.
                                None => unsafe { out.write(t, col, &o) },
                            }
                        }
                    }
                }
                if n_seg > 1 {
                    first += n_seg;
                }
            }
        }
    };
    // SAFETY: every thread passes the same arguments; a unit computes the same bits on any thread,
    // staged or in place; units write disjoint partials and heads; the block tables and positions that
    // decide addresses stay as they are until the region ends (a step's batch is the caller's).
    unsafe {
        tm.deal_staged(tm.size(), 1, &mut stage, run_units, |stage| {
            stage.publish(partials, out)
        });
    }
    SCORES.with(|s| s.replace(scores));
    if needed == 0 {
        return;
    }
    // Phase 2: one unit per (token with several segments, KV head) merges its segments in order.
    // SAFETY: nobody writes the partials until the next deal.
    let all = unsafe { partials.all() };
    let merges = seqs
        .iter()
        .flat_map(|seq| (0..seq.n_tokens).map(move |i| segments(seq.start_pos + i, window)))
        .filter(|&n_seg| n_seg > 1)
        .count()
        * num_kv_heads;
    tm.deal(merges, |units| {
        let (mut first, mut v) = (0usize, 0usize);
        for seq in seqs {
            for i in 0..seq.n_tokens {
                let t = seq.first_token + i;
                let n_seg = segments(seq.start_pos + i, window);
                if n_seg == 1 {
                    continue;
                }
                for kvh in 0..num_kv_heads {
                    v += 1;
                    if !units.contains(&(v - 1)) {
                        continue;
                    }
                    let parts = (0..n_seg).map(|j| {
                        let at = ((first + j) * num_kv_heads + kvh) * plen;
                        &all[at..at + plen]
                    });
                    merge(parts, group, head_dim, &mut o);
                    unrotate(kv.dtype(), head_dim, &mut o);
                    // SAFETY: the heads of (t, kvh) are written by this unit only, until the deal is
                    // done.
                    unsafe { out.write(t, kvh * group * head_dim, &o) };
                }
                first += n_seg;
            }
        }
    });
}

/// What a run of attention units computed, kept until it is published ([`Team::deal_staged`]): each
/// write's destination and length, in order, and their values end to end.
#[derive(Default)]
struct Staged {
    writes: Vec<(StagedWrite, usize)>,
    vals: Vec<f32>,
}

/// Where a staged write goes: a partial at an offset of the partials, or query heads of a token from
/// a column of the output.
#[derive(Clone, Copy)]
enum StagedWrite {
    Partial(usize),
    Out(usize, usize),
}

impl Staged {
    fn clear(&mut self) {
        self.writes.clear();
        self.vals.clear();
    }

    /// Room for a write of `len` values to `to`.
    fn slot(&mut self, to: StagedWrite, len: usize) -> &mut [f32] {
        let start = self.vals.len();
        self.vals.resize(start + len, 0.0);
        self.writes.push((to, len));
        &mut self.vals[start..]
    }

    /// Writes what was staged.
    ///
    /// # Safety
    /// This thread alone writes these partials and heads until the deal is done.
    unsafe fn publish(&self, partials: SharedMut<'_, f32>, out: ActShared<'_>) {
        let mut start = 0;
        for &(to, len) in &self.writes {
            let vals = &self.vals[start..start + len];
            start += len;
            // SAFETY: the caller's guarantee.
            unsafe {
                match to {
                    StagedWrite::Partial(at) => {
                        partials.part_mut(at..at + len).copy_from_slice(vals)
                    }
                    StagedWrite::Out(t, col) => out.write(t, col, vals),
                }
            }
        }
    }
}

/// A unit's query heads as attention over `dtype` reads them: for a rotated format each head's groups
/// rotated like the stored K ([`codec::rotate_groups`]) into `buf`, otherwise `q` itself.
fn rotated_query<'q>(
    dtype: KvDtype,
    head_dim: usize,
    q: &'q [f32],
    buf: &'q mut [f32],
) -> &'q [f32] {
    if !dtype.is_rotated() {
        return q;
    }
    buf.copy_from_slice(q);
    for head in buf.chunks_exact_mut(head_dim) {
        codec::rotate_groups(head);
    }
    buf
}

/// Rotates each head of a merged output back to the original basis, for rotated formats (the output is
/// a weighted sum of rotated V rows).
fn unrotate(dtype: KvDtype, head_dim: usize, o: &mut [f32]) {
    if dtype.is_rotated() {
        for head in o.chunks_exact_mut(head_dim) {
            codec::unrotate_groups(head);
        }
    }
}

/// The kernel that computes a unit of attention. Each gives its own bits (its own order of additions,
/// its own exponential), the same whatever the batch, the chunk or the block size: KV computed through
/// one is served only where the same one would compute it ([`super::numerics`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKernel {
    /// The portable loop: other CPUs, head sizes and formats the vector kernels do not take.
    Portable,
    /// The AVX2 kernel (`attention_avx2.rs`): plain rows of a head size that is a multiple of 8 and
    /// encoded ones of a multiple of 64, up to 256, on a CPU with AVX2, FMA and F16C; with AVX-512, what
    /// its own kernels do not take (other head sizes, int8 and int4 without VNNI).
    Avx2,
    /// The AVX-512 kernel ([`x86::attend`]): f32, bf16, f16 and fp8 rows, at head sizes 64, 128 and 256.
    Avx512,
    /// The AVX-512 kernel with int8 and int4 scores by `vpdpbusd` ([`x86::attend_int`]), at head sizes
    /// 64, 128 and 256.
    Avx512Vnni,
}

impl AttnKernel {
    /// Its code in a KV fingerprint ([`super::numerics`]).
    pub fn code(self) -> u8 {
        match self {
            AttnKernel::Portable => 1,
            AttnKernel::Avx2 => 2,
            AttnKernel::Avx512 => 3,
            AttnKernel::Avx512Vnni => 4,
        }
    }
}

/// The kernel that computes attention over `dtype` rows of `head_dim` elements through `isa`'s kernels,
/// `vnni` saying whether the CPU has AVX-512 VNNI with BW (what the int8 and int4 kernel needs). What every unit's
/// dispatch follows.
pub fn attention_kernel(isa: Isa, vnni: bool, dtype: KvDtype, head_dim: usize) -> AttnKernel {
    let vector_head = matches!(head_dim, 64 | 128 | 256) && cfg!(target_arch = "x86_64");
    #[cfg(target_arch = "x86_64")]
    let avx2 = || avx2::takes(dtype, head_dim);
    #[cfg(not(target_arch = "x86_64"))]
    let avx2 = || false;
    match isa {
        Isa::Avx512 if vector_head && integer_scores(dtype) && vnni => AttnKernel::Avx512Vnni,
        Isa::Avx512 if vector_head && !integer_scores(dtype) => AttnKernel::Avx512,
        // What the AVX-512 kernels do not take (other head sizes, int8 and int4 without VNNI), the AVX2
        // kernel does, on the same CPU.
        Isa::Avx512 | Isa::Avx2Fma if avx2() => AttnKernel::Avx2,
        _ => AttnKernel::Portable,
    }
}

/// One unit's partials through the kernel of `dtype`'s rows.
fn attend_dtype(
    dtype: KvDtype,
    isa: Isa,
    job: &Job<'_, '_>,
    scores: &mut Vec<f32>,
    part: &mut [f32],
) {
    let vnni = super::dot::Vnni::detect().is_some();
    let kernel = attention_kernel(isa, vnni, dtype, job.head_dim);
    #[cfg(target_arch = "x86_64")]
    if kernel == AttnKernel::Avx2 {
        // SAFETY: `attention_kernel` chose it through `avx2::takes`, which checked the CPU's features
        // and the head size for this format; the quantised query is filled wherever KV is int8 or int4
        // (`integer_scores`).
        unsafe {
            match dtype {
                KvDtype::F32 => return avx2::attend::<f32>(job, scores, part),
                KvDtype::Bf16 => return avx2::attend::<bf16>(job, scores, part),
                KvDtype::F16 => return avx2::attend::<f16>(job, scores, part),
                KvDtype::Int8 => return avx2::attend::<Int8Row>(job, scores, part),
                KvDtype::Fp8 => return avx2::attend::<Fp8Row>(job, scores, part),
                KvDtype::Int4 => return avx2::attend::<Int4Row>(job, scores, part),
            }
        }
    }
    match dtype {
        KvDtype::F32 => attend_any::<f32>(kernel, job, scores, part),
        KvDtype::Bf16 => attend_any::<bf16>(kernel, job, scores, part),
        KvDtype::F16 => attend_any::<f16>(kernel, job, scores, part),
        KvDtype::Int8 => attend_any::<Int8Row>(kernel, job, scores, part),
        KvDtype::Fp8 => attend_any::<Fp8Row>(kernel, job, scores, part),
        KvDtype::Int4 => attend_any::<Int4Row>(kernel, job, scores, part),
    }
}

/// Combines the partials of a token's segments, in order, into its `group × head_dim` output:
/// `out = Σ_s e^(m_s − M) · o_s / Σ_s e^(m_s − M) · l_s` with `M` the largest `m_s`.
fn merge<'p>(
    parts: impl Iterator<Item = &'p [f32]> + Clone,
    group: usize,
    d: usize,
    out: &mut [f32],
) {
    for g in 0..group {
        let at = g * (d + 2);
        let m = parts
            .clone()
            .map(|p| p[at])
            .fold(f32::NEG_INFINITY, f32::max);
        let o = &mut out[g * d..(g + 1) * d];
        o.fill(0.0);
        let mut l = 0f32;
        for p in parts.clone() {
            let w = (p[at] - m).exp();
            l += w * p[at + 1];
            for (x, y) in o.iter_mut().zip(&p[at + 2..at + 2 + d]) {
                *x += w * y;
            }
        }
        let inv = 1.0 / l;
        for x in o.iter_mut() {
            *x *= inv;
        }
    }
}

/// Whether keys of `dtype` are scored as integer dot products with the quantised query ([`QuantQuery`]).
fn integer_scores(dtype: KvDtype) -> bool {
    matches!(dtype, KvDtype::Int8 | KvDtype::Int4)
}

/// A unit's query heads quantised for int8 and int4 K, so that a score is an integer dot product: per
/// head and group of [`QUANT_GROUP`] elements, `q ≈ scale · qi` with `qi ∈ [−127, 127]` and
/// `scale = max|q| / 127` (in f32), and the group's `Σ qi`. The score of an int8 row (`k ≈ s · ki`) is
/// then `Σ_group (Σ qi · ki) · (s · scale_q)`; of an int4 row (`k ≈ m + s · ni`, `ni ∈ [0, 15]`)
/// `Σ_group ((Σ qi · ni) · (s · scale_q) + (m · scale_q) · Σ qi)`; the integer sums exact, each group's
/// term formed in that order and the terms added in group order: the same bits from the VNNI kernel,
/// the AVX2 kernel and the portable loop. (llama.cpp scores its 4-bit K against an 8-bit query too.)
#[derive(Default)]
struct QuantQuery {
    qi: Vec<i8>,
    /// `[head × groups + group]`.
    scale: Vec<f32>,
    sum: Vec<i32>,
}

impl QuantQuery {
    fn fill(&mut self, q: &[f32], head_dim: usize) {
        let groups = head_dim.div_ceil(QUANT_GROUP);
        self.qi.resize(q.len(), 0);
        self.scale.clear();
        self.sum.clear();
        for (head, qh) in q.chunks_exact(head_dim).enumerate() {
            for (g, part) in qh.chunks(QUANT_GROUP).enumerate() {
                let amax = part.iter().fold(0f32, |m, x| m.max(x.abs()));
                let s = amax / 127.0;
                let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
                let at = head * head_dim + g * QUANT_GROUP;
                let mut sum = 0i32;
                for (o, x) in self.qi[at..at + part.len()].iter_mut().zip(part) {
                    *o = (x * inv).round().clamp(-127.0, 127.0) as i8;
                    sum += i32::from(*o);
                }
                self.scale.push(s);
                self.sum.push(sum);
            }
            debug_assert_eq!(self.scale.len(), (head + 1) * groups);
        }
    }

    /// The score of query head `g` against a row of `dtype`, int8 or int4 (before the softmax scale).
    fn score(&self, dtype: KvDtype, g: usize, head_dim: usize, row: &[u8]) -> f32 {
        match dtype {
            KvDtype::Int8 => self.score_int8(g, head_dim, row),
            KvDtype::Int4 => self.score_int4(g, head_dim, row),
            _ => unreachable!("{dtype} keys are not scored as integers"),
        }
    }

    /// The score of query head `g` against an int4 row: per group (the last one may be shorter), its
    /// nibbles' exact `Σ qi · ni`, then the group's term as the type's documentation writes it.
    fn score_int4(&self, g: usize, head_dim: usize, row: &[u8]) -> f32 {
        let groups = head_dim.div_ceil(QUANT_GROUP);
        let payload = KvDtype::Int4.payload_bytes(head_dim);
        let mut acc = 0f32;
        let mut at = 0;
        for gr in 0..groups {
            let lo = gr * QUANT_GROUP;
            let n = (head_dim - lo).min(QUANT_GROUP);
            let half = n.div_ceil(2);
            let qi = &self.qi[g * head_dim + lo..g * head_dim + lo + n];
            let bytes = &row[at..at + half];
            let d: i32 = qi
                .iter()
                .enumerate()
                .map(|(i, q)| i32::from(*q) * i32::from(codec::int4_code(bytes, i)))
                .sum();
            let sc = payload + 4 * gr;
            let (sk, mk) = (codec::read_f16(&row[sc..]), codec::read_f16(&row[sc + 2..]));
            let i = g * groups + gr;
            let sq = self.scale[i];
            let term = d as f32 * (sk * sq) + (mk * sq) * self.sum[i] as f32;
            acc = if gr == 0 { term } else { acc + term };
            at += half;
        }
        acc
    }

    /// The score of query head `g` against an int8 row (before the softmax scale).
    fn score_int8(&self, g: usize, head_dim: usize, row: &[u8]) -> f32 {
        let groups = head_dim.div_ceil(QUANT_GROUP);
        let mut acc = 0f32;
        for gr in 0..groups {
            let lo = gr * QUANT_GROUP;
            let hi = (lo + QUANT_GROUP).min(head_dim);
            let qi = &self.qi[g * head_dim + lo..g * head_dim + hi];
            let d: i32 = qi
                .iter()
                .zip(&row[lo..hi])
                .map(|(q, k)| i32::from(*q) * i32::from(*k as i8))
                .sum();
            let at = head_dim + 2 * gr;
            let sk = codec::read_f16(&row[at..]);
            let term = d as f32 * (sk * self.scale[g * groups + gr]);
            acc = if gr == 0 { term } else { acc + term };
        }
        acc
    }
}

/// One unit: a token's query heads of one KV head, over the context positions `lo..=pos`.
struct Job<'a, 'b> {
    q: &'a [f32],
    /// The query heads quantised for int8 and int4 K (empty for other formats).
    qq: &'a QuantQuery,
    seq: &'a AttnSeq<'b>,
    kv: &'a LayerStorage,
    kvh: usize,
    lo: usize,
    pos: usize,
    group: usize,
    head_dim: usize,
    scale: f32,
}

/// A unit through `kernel` (the AVX-512 ones at head sizes 64, 128 and 256; the AVX2 kernel is
/// [`attend_dtype`]'s), or the portable loop [`attend`].
fn attend_any<'a, R: KvRow + 'a>(
    kernel: AttnKernel,
    job: &Job<'a, '_>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    match kernel {
        // SAFETY: `attention_kernel` chose it for a CPU with avx512f, avx512bw and avx512vnni (the
        // `vnni` it was given, `Vnni::detect`), int8 or int4 storage and one of these head sizes.
        AttnKernel::Avx512Vnni if job.kv.dtype() == KvDtype::Int4 => unsafe {
            match job.head_dim {
                64 => return x86::attend_int::<true, 4, 1>(job, scores, out),
                128 => return x86::attend_int::<true, 8, 2>(job, scores, out),
                256 => return x86::attend_int::<true, 16, 4>(job, scores, out),
                _ => {}
            }
        },
        // SAFETY: as above.
        AttnKernel::Avx512Vnni => unsafe {
            match job.head_dim {
                64 => return x86::attend_int::<false, 4, 1>(job, scores, out),
                128 => return x86::attend_int::<false, 8, 2>(job, scores, out),
                256 => return x86::attend_int::<false, 16, 4>(job, scores, out),
                _ => {}
            }
        },
        // SAFETY: `attention_kernel` chose it for `Isa::Avx512`, which `Isa::detect` (or the tests'
        // `cpu_has`) checked, and one of these head sizes.
        AttnKernel::Avx512 => unsafe {
            match job.head_dim {
                64 => return x86::attend::<R, 4>(job, scores, out),
                128 => return x86::attend::<R, 8>(job, scores, out),
                256 => return x86::attend::<R, 16>(job, scores, out),
                _ => {}
            }
        },
        AttnKernel::Portable | AttnKernel::Avx2 => {}
    }
    debug_assert!(
        matches!(kernel, AttnKernel::Portable),
        "{kernel:?} at head size {} reached the portable loop",
        job.head_dim
    );
    attend::<R>(job, scores, out)
}

/// Visits the context positions `lo..=pos` block by block: (block id, first slot, last slot, index of
/// the first slot among the context positions, and while the context goes on the id of the block to
/// prefetch: 4 blocks ahead, or the last one).
fn spans<'s>(
    seq: &'s AttnSeq<'_>,
    bs: usize,
    lo: usize,
    pos: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize, Option<usize>)> + Clone + 's {
    (lo / bs..=pos / bs).map(move |b| {
        let block = seq.block_table[b] as usize;
        let first = lo.max(b * bs) - b * bs;
        let last = pos.min(b * bs + bs - 1) - b * bs;
        let next = (b < pos / bs).then(|| seq.block_table[(b + 4).min(pos / bs)] as usize);
        (block, first, last, b * bs + first - lo, next)
    })
}

/// Asks for the cache lines of one stored row (`n` units from `p`) ahead of use. A hint: it reads
/// nothing and cannot fault, so `p` may come from `wrapping_add`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_row<U>(p: *const U, n: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let bytes = n * std::mem::size_of::<U>();
    for off in (0..bytes).step_by(64) {
        // SAFETY: a prefetch is a hint that never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>((p as *const i8).wrapping_add(off)) };
    }
}

/// The portable kernel. Writes, per query head, the partial `[m, l, o]`: the largest score `m`, the sum
/// `l` of `e^(score − m)`, and `o = Σ e^(score − m) · V`, all in position order.
fn attend<'a, R: KvRow + 'a>(job: &Job<'a, '_>, scores: &mut Vec<f32>, out: &mut [f32]) {
    let Job {
        q,
        qq: _,
        seq,
        kv,
        kvh,
        lo,
        pos,
        group,
        head_dim,
        scale,
    } = *job;
    let n_ctx = pos + 1 - lo;
    fit(scores, group * n_ctx);
    let spans = spans(seq, kv.block_size_tokens, lo, pos);
    let ru = kv.vector_units();
    let mut row = vec![0f32; head_dim];
    for (block, first, last, at, _) in spans.clone() {
        let k = R::typed(kv.k_head_block(block, kvh));
        for slot in first..=last {
            if R::INTEGER_SCORES {
                let bytes = &quant_units(kv.k_head_block(block, kvh))[slot * ru..(slot + 1) * ru];
                for g in 0..group {
                    scores[g * n_ctx + at + slot - first] =
                        job.qq.score(kv.dtype(), g, head_dim, bytes) * scale;
                }
                continue;
            }
            R::decode(&k[slot * ru..(slot + 1) * ru], &mut row);
            for g in 0..group {
                scores[g * n_ctx + at + slot - first] =
                    dot(&q[g * head_dim..(g + 1) * head_dim], &row) * scale;
            }
        }
    }
    let d2 = head_dim + 2;
    for g in 0..group {
        let row = &mut scores[g * n_ctx..(g + 1) * n_ctx];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut l = 0f32;
        for x in row.iter_mut() {
            *x = (*x - m).exp();
            l += *x;
        }
        out[g * d2] = m;
        out[g * d2 + 1] = l;
        out[g * d2 + 2..(g + 1) * d2].fill(0.0);
    }
    for (block, first, last, at, _) in spans {
        let v = R::typed(kv.v_head_block(block, kvh));
        for slot in first..=last {
            R::decode(&v[slot * ru..(slot + 1) * ru], &mut row);
            for g in 0..group {
                axpy(
                    &mut out[g * d2 + 2..(g + 1) * d2],
                    scores[g * n_ctx + at + slot - first],
                    &row,
                );
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The AVX-512 kernel, for head sizes of `16 · CH`. Scores come 16 keys at a time: each key's 16
    //! partial sums are reduced by a fixed tree of shuffles and adds shared by the 16 keys (not 15
    //! dependent scalar adds per key), so every key's score is computed the same way wherever it sits in
    //! its group of 16; the softmax uses a vector exp; V is accumulated in registers, in position order.

    use std::arch::x86_64::*;

    use kura_kv::codec::KvDtype;

    use super::{prefetch_row, spans, Int4Row, Int8Row, Job, KvRow};

    /// `[Σ a0, Σ a1, …, Σ a15]`: the lane sums of 16 vectors, in order, by the same tree for each.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn transpose_sum(v: &[__m512; 16]) -> __m512 {
        // Level 1: pairs (a, b) → per 128-bit quarter [a0+a2, b0+b2, a1+a3, b1+b3].
        let l1: [__m512; 8] = std::array::from_fn(|i| {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
        });
        // Level 2: (ab, cd) → per quarter [a, b, c, d] sums of the quarter.
        let l2: [__m512; 4] = std::array::from_fn(|i| {
            let (x, y) = (l1[2 * i], l1[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(x, y),
                _mm512_shuffle_ps::<0b11_10_11_10>(x, y),
            )
        });
        // Level 3: quarters (0 + 1) and (2 + 3) of two vectors.
        let l3: [__m512; 2] = std::array::from_fn(|i| {
            let (x, y) = (l2[2 * i], l2[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
            )
        });
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(l3[0], l3[1]),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(l3[0], l3[1]),
        )
    }

    /// e^x, lane-wise, for x ≤ 0 (a softmax's shifted scores): x = n·ln 2 + r with |r| ≤ ln 2 / 2, a
    /// degree-6 Taylor polynomial for e^r (relative error below 2e-7), scaled by 2^n.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn exp(x: __m512) -> __m512 {
        let x = _mm512_max_ps(x, _mm512_set1_ps(-104.0));
        let (n, p) = crate::kernels::ops::x86::exp_parts_avx512(x);
        _mm512_scalef_ps(p, n)
    }

    /// Replaces a row of scores by `e^(score − m)` and returns `(m, Σ e^(score − m))`, `m` the largest.
    #[target_feature(enable = "avx512f")]
    fn exp_sum(x: &mut [f32]) -> (f32, f32) {
        let n = x.len();
        let mask = |i: usize| -> __mmask16 {
            let k = (n - i).min(16);
            if k == 16 {
                0xFFFF
            } else {
                (1u16 << k) - 1
            }
        };
        let p = x.as_mut_ptr();
        let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
        for i in (0..n).step_by(16) {
            // SAFETY: the mask keeps the read inside x.
            let v = unsafe {
                _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), mask(i), p.add(i))
            };
            mx = _mm512_max_ps(mx, v);
        }
        let m = _mm512_reduce_max_ps(mx);
        let mv = _mm512_set1_ps(m);
        let mut sum = _mm512_setzero_ps();
        for i in (0..n).step_by(16) {
            let k = mask(i);
            // SAFETY: the mask keeps the access inside x.
            unsafe {
                let e = exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p.add(i)), mv));
                let e = _mm512_maskz_mov_ps(k, e);
                sum = _mm512_add_ps(sum, e);
                _mm512_mask_storeu_ps(p.add(i), k, e);
            }
        }
        (m, _mm512_reduce_add_ps(sum))
    }

    /// One unit for head size `16 · CH` of f32, bf16, f16 or fp8 rows: writes the partial `[m, l, o]` of
    /// each query head (see [`super::attend`]).
    ///
    /// # Safety
    /// avx512f is present; `job.head_dim == 16 · CH`; `out` holds `group × (head_dim + 2)` values.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn attend<'a, R: KvRow + 'a, const CH: usize>(
        job: &Job<'a, '_>,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let Job {
            q,
            qq: _,
            seq,
            kv,
            kvh,
            lo,
            pos,
            group,
            head_dim,
            scale,
        } = *job;
        debug_assert_eq!(head_dim, 16 * CH);
        // Integer-scored rows take `attend_int`: these f32 scores would not be their bits.
        assert!(
            !R::INTEGER_SCORES,
            "integer-scored keys reached the f32 kernel"
        );
        let n_ctx = pos + 1 - lo;
        super::fit(scores, group * n_ctx);
        let spans = spans(seq, kv.block_size_tokens, lo, pos);
        let ru = kv.vector_units();
        let scale_v = _mm512_set1_ps(scale);
        // K: 16 keys at a time, each row read (and dequantised) once into a tile of registers spilled to
        // L1, then every query head of the group takes its 16 scores from the tile. Each score is the same
        // chain of fused multiply-adds over the row as when every head read the row itself. The tile
        // (4, 8 or 16 KiB) is cleared once a unit, not for every 16 keys, where clearing it wrote twice the
        // bytes of K that were read: a group reads only its `keys` rows, each written first.
        let mut tile = [[_mm512_setzero_ps(); CH]; 16];
        for (block, first, last, at, next) in spans.clone() {
            let k = R::typed(kv.k_head_block(block, kvh));
            // A head's block is a few KiB on its own pages, where hardware prefetchers stop: fetch the
            // rows of a block ahead while this one is computed.
            let next_k = next.map(|b| R::typed(kv.k_head_block(b, kvh)).as_ptr());
            let mut s0 = first;
            while s0 <= last {
                let keys = (last + 1 - s0).min(16);
                for (j, t) in tile.iter_mut().enumerate().take(keys) {
                    if let Some(nk) = next_k {
                        prefetch_row(nk.wrapping_add((s0 + j) * ru), ru);
                    }
                    let kp = k[(s0 + j) * ru..(s0 + j + 1) * ru].as_ptr();
                    // SAFETY: a whole row (head_dim = 16 · CH elements) is readable from kp.
                    let pr = unsafe { R::params(kp, head_dim) };
                    for (c, tc) in t.iter_mut().enumerate() {
                        // SAFETY: as above, and 16c < head_dim.
                        *tc = unsafe { R::load16(kp, c, &pr) };
                    }
                }
                let m: __mmask16 = if keys == 16 {
                    0xFFFF
                } else {
                    (1u16 << keys) - 1
                };
                for g in 0..group {
                    let mut acc = [_mm512_setzero_ps(); 16];
                    if CH <= 8 {
                        // SAFETY: q holds group × head_dim values.
                        let qv: [__m512; CH] = std::array::from_fn(|c| unsafe {
                            _mm512_loadu_ps(q.as_ptr().add(g * head_dim + 16 * c))
                        });
                        for (a, t) in acc.iter_mut().zip(&tile).take(keys) {
                            for (qc, tc) in qv.iter().zip(t) {
                                *a = _mm512_fmadd_ps(*qc, *tc, *a);
                            }
                        }
                    } else {
                        // A head of 256: 16 query vectors and 16 sums would take every register, so
                        // the query comes in halves of 8 vectors, each taken by every key in turn.
                        // Each sum is still the chain over c = 0, 1, ... of the loop above.
                        for half in 0..CH / 8 {
                            // SAFETY: q holds group × head_dim values, 16 (8 half + c) < head_dim.
                            let qv: [__m512; 8] = std::array::from_fn(|c| unsafe {
                                _mm512_loadu_ps(q.as_ptr().add(g * head_dim + 16 * (8 * half + c)))
                            });
                            for (a, t) in acc.iter_mut().zip(&tile).take(keys) {
                                for (qc, tc) in qv.iter().zip(&t[8 * half..]) {
                                    *a = _mm512_fmadd_ps(*qc, *tc, *a);
                                }
                            }
                        }
                    }
                    let sums = _mm512_mul_ps(transpose_sum(&acc), scale_v);
                    let dst = &mut scores[g * n_ctx + at + s0 - first..][..keys];
                    // SAFETY: the mask writes `keys` values, all inside dst.
                    unsafe { _mm512_mask_storeu_ps(dst.as_mut_ptr(), m, sums) };
                }
                s0 += keys;
            }
        }
        // SAFETY: avx512f is present (this function's contract).
        unsafe { softmax_pv::<R, CH>(job, scores, n_ctx, out) }
    }

    /// The int8 (`INT4` false) or int4 (`INT4` true) unit for head size `16 · CH` (`CH` = 4 · `G`, `G`
    /// groups of 64): scores by integer dot products of the quantised query ([`super::QuantQuery`]) with
    /// the stored rows, `vpdpbusd` taking 64 products a row and head, then softmax and V as in
    /// [`attend`]. Int8 bytes are made unsigned (`k + 128`) and `128 · Σ qi` taken off after; int4
    /// nibbles are unsigned already, the group's 32 bytes unpacked to its 64 lanes in order (low
    /// nibbles, then high ones). Every sum is an integer below 2^24, exact in f32, and each group's term
    /// is formed as the portable loop forms it, so each score has the bits of
    /// [`super::QuantQuery::score`].
    ///
    /// # Safety
    /// avx512f, avx512bw and avx512vnni are present; `job.head_dim == 16 · CH`, `CH == 4 · G`; `out`
    /// holds `group × (head_dim + 2)` values; the storage is int4 if `INT4`, int8 otherwise; `job.qq`
    /// holds the quantised query.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn attend_int<'a, const INT4: bool, const CH: usize, const G: usize>(
        job: &Job<'a, '_>,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let Job {
            qq,
            seq,
            kv,
            kvh,
            lo,
            pos,
            group,
            head_dim,
            scale,
            ..
        } = *job;
        assert!(head_dim == 16 * CH && CH == 4 * G);
        assert_eq!(kv.dtype(), if INT4 { KvDtype::Int4 } else { KvDtype::Int8 });
        assert!(qq.qi.len() >= group * head_dim && qq.scale.len() >= group * G);
        let groups = G;
        // Where the groups' scales (int4: scale, then minimum) start, and their stride.
        let (payload, stride) = if INT4 {
            (head_dim / 2, 4)
        } else {
            (head_dim, 2)
        };
        let n_ctx = pos + 1 - lo;
        super::fit(scores, group * n_ctx);
        let ru = kv.vector_units();
        let scale_v = _mm512_set1_ps(scale);
        let bias = _mm512_set1_epi8(-128);
        let low = _mm256_set1_epi8(0x0F);
        // Cleared once a unit (see `attend`): a group reads only its `keys` rows, each written first.
        let mut tile = [[_mm512_setzero_si512(); G]; 16];
        for (block, first, last, at, next) in spans(seq, kv.block_size_tokens, lo, pos) {
            let k = Int8Row::typed(kv.k_head_block(block, kvh));
            let next_k = next.map(|b| Int8Row::typed(kv.k_head_block(b, kvh)).as_ptr());
            let mut s0 = first;
            while s0 <= last {
                let keys = (last + 1 - s0).min(16);
                let mut sk_bits = [[0u16; 16]; G];
                let mut mk_bits = [[0u16; 16]; G];
                for (j, t) in tile.iter_mut().enumerate().take(keys) {
                    if let Some(nk) = next_k {
                        prefetch_row(nk.wrapping_add((s0 + j) * ru), ru);
                    }
                    let row = &k[(s0 + j) * ru..(s0 + j + 1) * ru];
                    for gr in 0..groups {
                        t[gr] = if INT4 {
                            // SAFETY: the group's 32 payload bytes lie inside the row (sliced).
                            let b = unsafe {
                                _mm256_loadu_si256(row[32 * gr..32 * gr + 32].as_ptr().cast())
                            };
                            let lo = _mm256_and_si256(b, low);
                            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(b), low);
                            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
                        } else {
                            // SAFETY: the group's 64 payload bytes lie inside the row (sliced).
                            let b = unsafe {
                                _mm512_loadu_si512(row[64 * gr..64 * gr + 64].as_ptr().cast())
                            };
                            _mm512_xor_si512(b, bias)
                        };
                        let at = payload + stride * gr;
                        sk_bits[gr][j] = u16::from_le_bytes([row[at], row[at + 1]]);
                        if INT4 {
                            mk_bits[gr][j] = u16::from_le_bytes([row[at + 2], row[at + 3]]);
                        }
                    }
                }
                let m: __mmask16 = if keys == 16 {
                    0xFFFF
                } else {
                    (1u16 << keys) - 1
                };
                // SAFETY: 16 u16 in each array.
                let sk: [__m512; G] = std::array::from_fn(|gr| unsafe {
                    _mm512_cvtph_ps(_mm256_loadu_si256(sk_bits[gr].as_ptr().cast()))
                });
                // SAFETY: as above.
                let mk: [__m512; G] = std::array::from_fn(|gr| unsafe {
                    _mm512_cvtph_ps(_mm256_loadu_si256(mk_bits[gr].as_ptr().cast()))
                });
                for g in 0..group {
                    let mut score = _mm512_setzero_ps();
                    for gr in 0..groups {
                        let at = g * head_dim + 64 * gr;
                        // SAFETY: the head's group holds 64 quantised values (sliced).
                        let qv = unsafe { _mm512_loadu_si512(qq.qi[at..at + 64].as_ptr().cast()) };
                        let mut acc = [_mm512_setzero_ps(); 16];
                        for (a, t) in acc.iter_mut().zip(&tile).take(keys) {
                            *a = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(
                                _mm512_setzero_si512(),
                                t[gr],
                                qv,
                            ));
                        }
                        let i = g * groups + gr;
                        let sq = _mm512_set1_ps(qq.scale[i]);
                        let term = if INT4 {
                            let d = transpose_sum(&acc);
                            _mm512_add_ps(
                                _mm512_mul_ps(d, _mm512_mul_ps(sk[gr], sq)),
                                _mm512_mul_ps(
                                    _mm512_mul_ps(mk[gr], sq),
                                    _mm512_set1_ps(qq.sum[i] as f32),
                                ),
                            )
                        } else {
                            let d = _mm512_sub_ps(
                                transpose_sum(&acc),
                                _mm512_set1_ps((128 * qq.sum[i]) as f32),
                            );
                            _mm512_mul_ps(d, _mm512_mul_ps(sk[gr], sq))
                        };
                        score = if gr == 0 {
                            term
                        } else {
                            _mm512_add_ps(score, term)
                        };
                    }
                    let sums = _mm512_mul_ps(score, scale_v);
                    let dst = &mut scores[g * n_ctx + at + s0 - first..][..keys];
                    // SAFETY: the mask writes `keys` values, all inside dst.
                    unsafe { _mm512_mask_storeu_ps(dst.as_mut_ptr(), m, sums) };
                }
                s0 += keys;
            }
        }
        // SAFETY: avx512f is present (this function's contract).
        unsafe {
            if INT4 {
                softmax_pv::<Int4Row, CH>(job, scores, n_ctx, out)
            } else {
                softmax_pv::<Int8Row, CH>(job, scores, n_ctx, out)
            }
        }
    }

    /// The softmax of each query head's scores (into the `m`, `l` of its partial) and the weighted sum of
    /// V rows.
    ///
    /// # Safety
    /// avx512f is present; `job.head_dim == 16 · CH`; `scores` holds `group × n_ctx` scores; `out` holds
    /// `group × (head_dim + 2)` values.
    #[target_feature(enable = "avx512f")]
    unsafe fn softmax_pv<'a, R: KvRow + 'a, const CH: usize>(
        job: &Job<'a, '_>,
        scores: &mut [f32],
        n_ctx: usize,
        out: &mut [f32],
    ) {
        let (group, head_dim) = (job.group, job.head_dim);
        for g in 0..group {
            let (m, l) = exp_sum(&mut scores[g * n_ctx..(g + 1) * n_ctx]);
            out[g * (head_dim + 2)] = m;
            out[g * (head_dim + 2) + 1] = l;
        }
        // V: heads in blocks of up to 4 (2 for head size 128 and 256), whose sums stay in registers
        // while each V row is loaded once per block; at head size 256 a row in two halves of 8 vectors
        // (2 heads × 16 vectors of sums would take every register). Each (head, lane) still sums the
        // positions in order, one fused multiply-add after another, so the blocking does not change any
        // result.
        let most = if CH <= 4 { 4 } else { 2 };
        for col0 in (0..CH).step_by(CH.min(8)) {
            let mut g0 = 0;
            while g0 < group {
                let gb = (group - g0).min(most);
                let args = (&scores[..], n_ctx, g0, col0);
                let o = out.as_mut_ptr();
                // SAFETY: avx512f is present (this function's contract); pv writes columns
                // 16 col0 .. 16 (col0 + COLS) of heads g0..g0+gb of out.
                unsafe {
                    if CH <= 8 {
                        match gb {
                            1 => pv::<R, CH, 1, CH>(job, args, o),
                            2 => pv::<R, CH, 2, CH>(job, args, o),
                            3 => pv::<R, CH, 3, CH>(job, args, o),
                            _ => pv::<R, CH, 4, CH>(job, args, o),
                        }
                    } else {
                        match gb {
                            1 => pv::<R, CH, 1, 8>(job, args, o),
                            _ => pv::<R, CH, 2, 8>(job, args, o),
                        }
                    }
                }
                g0 += gb;
            }
        }
    }

    /// Heads `g0..g0 + G` of the weighted sum of V: `o[g] = Σ_pos scores[g][pos] · V[pos]`, its lanes
    /// `16 col0 .. 16 (col0 + COLS)`, into the `o` part of each head's `[m, l, o]` in `out`.
    ///
    /// # Safety
    /// avx512f is present; `job.head_dim == 16 · CH`; `out` holds `group × (head_dim + 2)` values,
    /// `g0 + G ≤ group` and `col0 + COLS ≤ CH`.
    #[target_feature(enable = "avx512f")]
    unsafe fn pv<'a, R: KvRow + 'a, const CH: usize, const G: usize, const COLS: usize>(
        job: &Job<'a, '_>,
        (scores, n_ctx, g0, col0): (&[f32], usize, usize, usize),
        out: *mut f32,
    ) {
        let Job {
            seq,
            kv,
            kvh,
            lo,
            pos,
            head_dim,
            ..
        } = *job;
        let mut acc = [[_mm512_setzero_ps(); COLS]; G];
        let ru = kv.vector_units();
        for (block, first, last, at, next) in spans(seq, kv.block_size_tokens, lo, pos) {
            let v = R::typed(kv.v_head_block(block, kvh));
            let next_v = next
                .filter(|_| g0 == 0 && col0 == 0)
                .map(|b| R::typed(kv.v_head_block(b, kvh)).as_ptr());
            for slot in first..=last {
                if let Some(nv) = next_v {
                    prefetch_row(nv.wrapping_add(slot * ru), ru);
                }
                let vp = v[slot * ru..(slot + 1) * ru].as_ptr();
                // SAFETY: a whole row (head_dim = 16 · CH elements) is readable from vp.
                let pr = unsafe { R::params(vp, head_dim) };
                // A row with one scale (int8, fp8 at head size 64) is read unscaled and its scale goes
                // into each head's weight: one multiply a head instead of one a lane.
                let folded = if CH == 4 && COLS == 4 {
                    R::single_scale(&pr)
                } else {
                    None
                };
                // SAFETY: as above, and 16 (col0 + c) < head_dim.
                let vv: [__m512; COLS] = std::array::from_fn(|c| unsafe {
                    match folded {
                        Some(_) => R::load16_unscaled(vp, col0 + c),
                        None => R::load16(vp, col0 + c, &pr),
                    }
                });
                for (g, ag) in acc.iter_mut().enumerate() {
                    let w = scores[(g0 + g) * n_ctx + at + slot - first];
                    let p = _mm512_set1_ps(folded.map_or(w, |s| w * s));
                    for (a, x) in ag.iter_mut().zip(&vv) {
                        *a = _mm512_fmadd_ps(p, *x, *a);
                    }
                }
            }
        }
        for (g, ag) in acc.iter().enumerate() {
            for (c, a) in ag.iter().enumerate() {
                // SAFETY: head g0 + g < group and col0 + c < CH, so the 16 values lie inside out (its
                // [m, l, o] triple).
                unsafe {
                    _mm512_storeu_ps(out.add((g0 + g) * (head_dim + 2) + 2 + 16 * (col0 + c)), *a)
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kura_kv::codec::KvDtype;
    use kura_kv::layout::KvLayout;
    use kura_kv::storage::KvStorage;

    use kura_shape::attn_split::{thread_shares, unit_cost, units_cost};

    use super::*;
    use crate::kernels::matmul::{Act, ActBuf, ActKind};
    use crate::kernels::team::{self, SharedMut};

    /// Attention of `tokens` new tokens after `past` cached ones, every head, through the kernels of
    /// `isa` (which the CPU has) and the portable loop.
    #[allow(clippy::too_many_arguments)]
    fn both(
        isa: Isa,
        dtype: KvDtype,
        block: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        past: usize,
        tokens: usize,
        window: Option<usize>,
    ) -> (Vec<f32>, Vec<f32>) {
        let layout = KvLayout::uniform(1, kv_heads, head_dim, dtype, block).unwrap();
        let total = past + tokens;
        let blocks = total.div_ceil(block);
        let mut kv = KvStorage::new(&layout, blocks + 3).unwrap();
        // Blocks out of order, so that the block table matters.
        let table: Vec<u32> = (0..blocks as u32).rev().map(|b| b + 3).collect();
        let val = |i: usize| ((i * 2654435761usize % 1000) as f32 / 500.0 - 1.0) * 2.0;
        for p in 0..total {
            let k: Vec<f32> = (0..kv_heads * head_dim).map(|i| val(p * 977 + i)).collect();
            let v: Vec<f32> = (0..kv_heads * head_dim)
                .map(|i| val(p * 131 + i + 7))
                .collect();
            kv.write_token(0, table[p / block] as usize, p % block, &k, &v);
        }
        // Each query depends on its position only, so a token has the same query in any batch.
        let row = heads * head_dim;
        let q: Vec<f32> = (0..tokens * row)
            .map(|i| val((past + i / row) * 7919 + i % row * 31 + 5))
            .collect();
        let seqs = [AttnSeq {
            first_token: 0,
            n_tokens: tokens,
            start_pos: past,
            block_table: &table,
        }];
        let shape = AttnShape {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            window,
        };
        let mut vector = ActBuf::new(ActKind::F32, tokens, heads * head_dim);
        let out = vector.shared();
        let mut partials = vec![0f32; partials_len(&seqs, shape)];
        let parts = SharedMut::new(&mut partials);
        // SAFETY: every thread passes the same arguments; nothing else uses `out` during the region.
        team::run(|tm| unsafe {
            attention_part_on(
                isa,
                tm,
                &q,
                heads * head_dim,
                &seqs,
                kv.layer(0),
                shape,
                parts,
                out,
            )
        });
        // SAFETY: the region is over.
        let Act::F32(vector) = (unsafe { out.read() }) else {
            unreachable!()
        };
        // The portable loop, one unit after another: every segment, then the merge.
        let mut portable = vec![0f32; tokens * heads * head_dim];
        let group = heads / kv_heads;
        let plen = group * (head_dim + 2);
        let mut scores = Vec::new();
        let mut qrot = vec![0f32; group * head_dim];
        let mut qq = QuantQuery::default();
        for t in 0..tokens {
            let pos = past + t;
            let lo = context_start(pos, window);
            for kvh in 0..kv_heads {
                let at = t * heads * head_dim + kvh * group * head_dim;
                let qu = rotated_query(dtype, head_dim, &q[at..at + group * head_dim], &mut qrot);
                let segments: Vec<Vec<f32>> = (lo / SEGMENT..=pos / SEGMENT)
                    .map(|k| {
                        if integer_scores(dtype) {
                            qq.fill(qu, head_dim);
                        }
                        let job = Job {
                            q: qu,
                            qq: &qq,
                            seq: &seqs[0],
                            kv: kv.layer(0),
                            kvh,
                            lo: lo.max(k * SEGMENT),
                            pos: pos.min(k * SEGMENT + SEGMENT - 1),
                            group,
                            head_dim,
                            scale: 1.0 / (head_dim as f32).sqrt(),
                        };
                        let mut part = vec![0f32; plen];
                        attend_dtype(dtype, Isa::Scalar, &job, &mut scores, &mut part);
                        part
                    })
                    .collect();
                let o = &mut portable[at..at + group * head_dim];
                merge(segments.iter().map(|p| &p[..]), group, head_dim, o);
                unrotate(dtype, head_dim, o);
            }
        }
        (vector.to_vec(), portable)
    }

    #[test]
    fn units_are_dealt_in_even_shares_of_their_cost() {
        let table = [0u32; 0];
        let seq = |first_token, n_tokens, start_pos| AttnSeq {
            first_token,
            n_tokens,
            start_pos,
            block_table: &table,
        };
        // Decode of 8 tokens at about 1,100 positions: each token has a full segment and a short one
        // per KV head. Dealt out in turn, one of two threads took both full segments of 2 heads of every
        // token, and twice the other's work.
        let decode: Vec<AttnSeq<'_>> = (0..8).map(|s| seq(s, 1, 1050 + s)).collect();
        // A prefill of 1,500 tokens, and a mixed batch.
        let prefill = [seq(0, 1500, 0)];
        let mixed = [seq(0, 1, 3000), seq(1, 1, 40), seq(2, 300, 700)];
        for (name, seqs) in [
            ("decode", &decode[..]),
            ("prefill", &prefill),
            ("mixed", &mixed),
        ] {
            // The largest unit: a full segment.
            let largest = unit_cost(0, SEGMENT - 1, 0);
            for threads in [2, 3, 4] {
                let share = thread_shares(batch_positions(seqs), None, 3, threads);
                let total: usize = share.iter().sum();
                assert_eq!(total, units_cost(batch_positions(seqs), None) * 3);
                for s in &share {
                    assert!(
                        s.abs_diff(total / threads) <= largest,
                        "{name}, {threads} threads: shares {share:?}, largest unit {largest}"
                    );
                }
            }
        }
    }

    #[test]
    fn vector_kernel_matches_the_portable_loop() {
        let cases = [
            // (dtype, block, heads, kv heads, head_dim, past, tokens, window)
            (KvDtype::F32, 16, 9, 3, 64, 0, 40, None),
            (KvDtype::F32, 1, 9, 3, 64, 5, 3, None),
            (KvDtype::F32, 256, 4, 1, 128, 300, 2, None),
            (KvDtype::Bf16, 16, 10, 2, 64, 17, 20, None),
            (KvDtype::F16, 7, 6, 2, 128, 33, 9, None),
            (KvDtype::F32, 16, 8, 8, 64, 50, 30, Some(20)),
            (KvDtype::F32, 16, 4, 2, 16, 10, 5, None),
            // Contexts across segment boundaries (SEGMENT = 1024), with and without a window.
            (KvDtype::F32, 16, 9, 3, 64, 1000, 40, None),
            (KvDtype::Bf16, 32, 6, 2, 128, 1030, 3, Some(700)),
            (KvDtype::F32, 16, 4, 2, 16, 1020, 8, None),
            // Quantised rows: the vector kernel's in-register dequantisation against the scalar decode
            // of kura_kv::codec, at both head sizes, across segments and blocks out of order.
            (KvDtype::Int8, 16, 9, 3, 64, 0, 40, None),
            (KvDtype::Int8, 16, 4, 1, 128, 1000, 30, None),
            (KvDtype::Fp8, 16, 9, 3, 64, 17, 20, None),
            (KvDtype::Fp8, 5, 4, 2, 128, 1030, 3, Some(700)),
            (KvDtype::Int4, 16, 9, 3, 64, 5, 40, None),
            (KvDtype::Int4, 7, 6, 2, 128, 1020, 8, None),
            // Head sizes the vector kernel does not take: the portable loop alone (and rotation of a
            // short group for int4: 80 = 64 + 16).
            (KvDtype::Int8, 16, 4, 2, 80, 10, 5, None),
            (KvDtype::Int4, 16, 4, 2, 80, 10, 5, None),
            // Gemma 3's head size of 256 (4 query heads on 1 KV head) in every format, across a
            // segment boundary, in a sliding window, with a short last tile of keys.
            (KvDtype::Bf16, 16, 4, 1, 256, 40, 20, None),
            (KvDtype::F32, 16, 4, 1, 256, 1015, 12, Some(512)),
            (KvDtype::F16, 5, 8, 2, 256, 3, 9, None),
            (KvDtype::Int8, 16, 4, 1, 256, 1000, 30, None),
            (KvDtype::Fp8, 7, 4, 1, 256, 33, 9, None),
            (KvDtype::Int4, 16, 4, 1, 256, 1020, 8, Some(700)),
            // Shapes of the AVX2 kernel alone: head sizes of 80 and 40 (lane vectors not a multiple
            // of 4), groups of 4 and 5 (heads in threes), across a segment boundary.
            (KvDtype::F16, 16, 8, 2, 80, 1020, 8, None),
            (KvDtype::F32, 3, 5, 1, 40, 9, 11, Some(13)),
            // Encoded rows of 3 groups (head size 192, the AVX2 kernel's on every x86 CPU): int8's and
            // int4's integer products for odd groups of heads (3 and 5, in twos), fp8 widened into the
            // tile for a group of 5, across a segment boundary, with a short last run of keys.
            (KvDtype::Int8, 16, 9, 3, 192, 1000, 30, None),
            (KvDtype::Fp8, 7, 10, 2, 192, 1020, 9, Some(700)),
            (KvDtype::Int4, 5, 5, 1, 192, 33, 9, None),
        ];
        // Which kernels run here, said aloud; one this CPU has but did not run fails.
        #[cfg(target_arch = "x86_64")]
        let vnni = crate::kernels::cpu_has(Isa::Avx512)
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni");
        #[cfg(not(target_arch = "x86_64"))]
        let vnni = false;
        crate::kernels::compared(
            "attention, int8 and int4 with VNNI",
            vnni,
            crate::kernels::dot::Vnni::detect().is_some(),
        );
        for isa in vector_isas() {
            for (i, &(dtype, block, heads, kv_heads, dim, past, tokens, window)) in
                cases.iter().enumerate()
            {
                let (vector, portable) = both(
                    isa, dtype, block, heads, kv_heads, dim, past, tokens, window,
                );
                let err = vector
                    .iter()
                    .zip(&portable)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(err < 1e-4, "{isa:?} case {i}: max |Δ| {err}");
                assert!(portable.iter().any(|v| *v != 0.0), "case {i}: all zero");
                // A vector kernel has its own order of additions and its own exponential: where one
                // is chosen, some bits differ from the portable loop's (it ran).
                let vnni = crate::kernels::dot::Vnni::detect().is_some();
                let kernel = attention_kernel(isa, vnni, dtype, dim);
                assert_eq!(
                    vector
                        .iter()
                        .zip(&portable)
                        .any(|(a, b)| a.to_bits() != b.to_bits()),
                    kernel != AttnKernel::Portable,
                    "{isa:?} case {i}: {kernel:?}"
                );
            }
        }
    }

    #[test]
    fn each_head_size_and_format_has_its_kernel() {
        use AttnKernel::*;
        // The AVX2 kernel is chosen only where the CPU has it.
        #[cfg(target_arch = "x86_64")]
        let avx2 = crate::kernels::cpu_has(Isa::Avx2Fma) && is_x86_feature_detected!("f16c");
        #[cfg(not(target_arch = "x86_64"))]
        let avx2 = false;
        let or_portable = |k: AttnKernel| if avx2 { k } else { Portable };
        let plain = [KvDtype::F32, KvDtype::Bf16, KvDtype::F16];
        let encoded = [KvDtype::Int8, KvDtype::Fp8, KvDtype::Int4];
        for dim in [64, 128, 256] {
            for dtype in plain.into_iter().chain([KvDtype::Fp8]) {
                assert_eq!(attention_kernel(Isa::Avx512, true, dtype, dim), Avx512);
            }
            for dtype in [KvDtype::Int8, KvDtype::Int4] {
                assert_eq!(attention_kernel(Isa::Avx512, true, dtype, dim), Avx512Vnni);
                // Without VNNI: AVX2's integer products.
                assert_eq!(
                    attention_kernel(Isa::Avx512, false, dtype, dim),
                    or_portable(Avx2)
                );
            }
        }
        // Head sizes the AVX-512 kernel does not take: the AVX2 kernel's, on the same CPU.
        for (dtype, dim, takes) in [
            (KvDtype::F32, 16, true),
            (KvDtype::Bf16, 80, true),
            (KvDtype::F16, 96, true),
            (KvDtype::Int8, 192, true),
            (KvDtype::Int4, 192, true),
            (KvDtype::Bf16, 512, false),
            (KvDtype::Int8, 512, false),
            (KvDtype::Fp8, 96, false),
        ] {
            let want = if takes { or_portable(Avx2) } else { Portable };
            assert_eq!(
                attention_kernel(Isa::Avx512, true, dtype, dim),
                want,
                "{dtype:?} {dim}"
            );
        }
        // Encoded rows need whole groups of 64; the portable loop takes the rest, on every CPU.
        for isa in [Isa::Avx512, Isa::Avx2Fma, Isa::Scalar] {
            for dtype in encoded {
                assert_eq!(attention_kernel(isa, true, dtype, 80), Portable);
            }
        }
        assert_eq!(
            attention_kernel(Isa::Scalar, false, KvDtype::Bf16, 64),
            Portable
        );
        // The AVX2 kernel takes plain rows of a multiple of 8 and encoded ones of a multiple of 64, up to
        // 256, where the CPU has it.
        for (dtype, dim, takes) in [
            (KvDtype::Bf16, 256, true),
            (KvDtype::F32, 40, true),
            (KvDtype::F16, 264, false),
            (KvDtype::Int8, 64, true),
            (KvDtype::Fp8, 128, true),
            (KvDtype::Int4, 256, true),
            (KvDtype::Int8, 96, false),
            (KvDtype::Fp8, 320, false),
        ] {
            let want = if takes { or_portable(Avx2) } else { Portable };
            for vnni in [false, true] {
                assert_eq!(
                    attention_kernel(Isa::Avx2Fma, vnni, dtype, dim),
                    want,
                    "{dtype:?} {dim}"
                );
            }
        }
    }

    /// Int8 and int4 scores are integer dot products formed group by group as the portable loop forms
    /// them: the AVX2 kernel's scores and the VNNI kernel's are the portable loop's, bit for bit (each
    /// key alone, where the largest score of a one-position context is its score; and the largest of a
    /// whole context).
    #[test]
    fn integer_scores_are_the_portable_loops() {
        #[cfg(target_arch = "x86_64")]
        let (avx2, vnni) = (
            crate::kernels::cpu_has(Isa::Avx2Fma) && is_x86_feature_detected!("f16c"),
            crate::kernels::cpu_has(Isa::Avx512)
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni"),
        );
        #[cfg(not(target_arch = "x86_64"))]
        let (avx2, vnni) = (false, false);
        let mut kernels = Vec::new();
        if crate::kernels::compared("attention, AVX2 integer scores", avx2, avx2) {
            kernels.push((Isa::Avx2Fma, AttnKernel::Avx2));
        }
        let runs = crate::kernels::dot::Vnni::detect().is_some();
        if crate::kernels::compared("attention, VNNI integer scores", vnni, runs) {
            kernels.push((Isa::Avx512, AttnKernel::Avx512Vnni));
        }
        let cases = [(3, 64), (5, 128), (2, 192), (4, 256)];
        for dtype in [KvDtype::Int8, KvDtype::Int4] {
            for (heads, dim) in cases {
                let layout = KvLayout::uniform(1, 1, dim, dtype, 16).unwrap();
                let n = 45;
                let mut kv = KvStorage::new(&layout, 3).unwrap();
                let val = |i: usize| ((i * 2654435761usize % 1000) as f32 / 500.0 - 1.0) * 3.0;
                for p in 0..n {
                    // Int4's minimum is then not 0, and differs from row to row.
                    let k: Vec<f32> = (0..dim)
                        .map(|i| val(p * 977 + i) + (p % 5) as f32)
                        .collect();
                    kv.write_token(0, p / 16, p % 16, &k, &k);
                }
                let table = [0u32, 1, 2];
                let seq = AttnSeq {
                    first_token: 0,
                    n_tokens: 1,
                    start_pos: n - 1,
                    block_table: &table,
                };
                let q: Vec<f32> = (0..heads * dim).map(|i| val(i * 31 + 5)).collect();
                let mut qq = QuantQuery::default();
                qq.fill(&q, dim);
                let spans = (0..n).map(|p| (p, p)).chain([(0, n - 1), (3, n - 2)]);
                for (lo, pos) in spans {
                    let job = Job {
                        q: &q,
                        qq: &qq,
                        seq: &seq,
                        kv: kv.layer(0),
                        kvh: 0,
                        lo,
                        pos,
                        group: heads,
                        head_dim: dim,
                        scale: 1.0 / (dim as f32).sqrt(),
                    };
                    let largest = |isa| {
                        let mut part = vec![0f32; heads * (dim + 2)];
                        attend_dtype(dtype, isa, &job, &mut Vec::new(), &mut part);
                        (0..heads)
                            .map(|g| part[g * (dim + 2)].to_bits())
                            .collect::<Vec<_>>()
                    };
                    for &(isa, kernel) in &kernels {
                        if attention_kernel(isa, runs, dtype, dim) != kernel {
                            // VNNI's kernel takes 64, 128 and 256 only.
                            assert_eq!((kernel, dim), (AttnKernel::Avx512Vnni, 192));
                            continue;
                        }
                        assert_eq!(
                            largest(isa),
                            largest(Isa::Scalar),
                            "{kernel:?} {dtype}: {heads} heads of {dim}, positions {lo}..={pos}"
                        );
                    }
                }
            }
        }
    }

    /// An int4 score (the query quantised, the nibbles' products exact) is the score of the query
    /// against the decoded row up to the query's rounding: within 0.5 % of `Σ |q| · |k|`, for whole
    /// groups and a short last one (head size 80 = 64 + 16), rows with a minimum far from 0 included.
    #[test]
    fn int4_scores_are_the_decoded_rows_scores() {
        let val = |i: usize| ((i * 2654435761usize % 1000) as f32 / 500.0 - 1.0) * 3.0;
        for dim in [64, 80, 128] {
            let heads = 2;
            let q: Vec<f32> = (0..heads * dim).map(|i| val(i * 31 + 5)).collect();
            let mut qq = QuantQuery::default();
            qq.fill(&q, dim);
            for p in 0..20 {
                let k: Vec<f32> = (0..dim)
                    .map(|i| val(p * 977 + i) + p as f32 - 8.0)
                    .collect();
                let mut row = vec![0u8; KvDtype::Int4.bytes_per_vector(dim)];
                codec::encode_vector(KvDtype::Int4, &k, &mut row, &mut vec![0f32; dim]);
                let mut decoded = vec![0f32; dim];
                codec::decode_stored(KvDtype::Int4, &row, &mut decoded);
                for g in 0..heads {
                    let qg = &q[g * dim..(g + 1) * dim];
                    let exact: f32 = qg.iter().zip(&decoded).map(|(a, b)| a * b).sum();
                    let size: f32 = qg.iter().zip(&decoded).map(|(a, b)| (a * b).abs()).sum();
                    let got = qq.score(KvDtype::Int4, g, dim, &row);
                    assert!(
                        (got - exact).abs() <= 0.005 * size,
                        "dim {dim} row {p} head {g}: {got} against {exact} (of {size})"
                    );
                }
            }
        }
    }

    /// The vector paths this CPU has (each said aloud); the portable loop is every test's reference.
    fn vector_isas() -> Vec<Isa> {
        [
            ("attention, AVX-512 kernel", Isa::Avx512),
            ("attention, AVX2 kernel", Isa::Avx2Fma),
        ]
        .into_iter()
        .filter(|(name, isa)| {
            let has = crate::kernels::cpu_has(*isa);
            crate::kernels::compared(name, has, has)
        })
        .map(|(_, isa)| isa)
        .collect()
    }

    /// Attention over quantised K and V (int8 and int4 with their quantised query too) stays close to attention
    /// over the same vectors in f32, on random data whose V elements lie in [−2, 2], through the vector
    /// kernel and the portable loop alike: int8 within 0.5 % of that range, fp8 2 %, int4 7.5 %.
    #[test]
    fn quantised_attention_is_close_to_f32() {
        for (dim, past) in [(64, 300), (128, 40)] {
            let (exact, _) = both(Isa::Scalar, KvDtype::F32, 16, 6, 2, dim, past, 4, None);
            let mut errs = Vec::new();
            for (dtype, bound) in [
                (KvDtype::Int8, 0.01),
                (KvDtype::Fp8, 0.04),
                (KvDtype::Int4, 0.15),
            ] {
                let (vector, portable) = both(Isa::detect(), dtype, 16, 6, 2, dim, past, 4, None);
                for out in [vector, portable] {
                    let err = out
                        .iter()
                        .zip(&exact)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(err <= bound, "{dtype} dim {dim}: max |Δ| {err} > {bound}");
                    assert!(err > 0.0, "{dtype} dim {dim}: no rounding at all?");
                    errs.push(err);
                }
            }
            // More bits, less error.
            assert!(
                errs[0] < errs[2] && errs[2] < errs[4],
                "dim {dim}: {errs:?}"
            );
        }
    }

    #[test]
    fn units_give_the_same_bits_staged_or_in_place() {
        // Runs of units computed into each thread's stage and published by whoever finishes first
        // (while a core is busy with another process) against runs written in place, on teams of 1 to
        // 3: decode and a short prefill, with one segment and with several (partials, then merges).
        let isa = vector_isas().into_iter().next().unwrap_or(Isa::Scalar);
        for (dtype, past, tokens) in [
            (KvDtype::F32, 40, 1),
            (KvDtype::Bf16, 2 * SEGMENT + 30, 1),
            (KvDtype::Int8, SEGMENT - 3, 6),
        ] {
            for threads in 1..=3 {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let go = || both(isa, dtype, 16, 6, 2, 64, past, tokens, None).0;
                let in_place = pool.install(go);
                let staged = pool.install(|| team::with_redo_form(go));
                assert_eq!(
                    staged, in_place,
                    "{dtype:?} past {past} tokens {tokens} threads {threads}"
                );
            }
        }
    }

    #[test]
    fn a_token_gets_the_same_bits_alone_or_in_a_prefill() {
        // Decode of position n − 1 (n − 1 cached, one new token) equals the last row of a prefill of n.
        for (dtype, block, dim) in [
            (KvDtype::F32, 16, 64),
            (KvDtype::Bf16, 5, 128),
            (KvDtype::F16, 3, 16),
            (KvDtype::Int8, 16, 64),
            (KvDtype::Fp8, 5, 128),
            (KvDtype::Int4, 16, 64),
            (KvDtype::Bf16, 16, 256),
            (KvDtype::Int8, 5, 256),
            (KvDtype::Int4, 3, 256),
        ] {
            let n = 37;
            for isa in vector_isas().into_iter().chain([Isa::Scalar]) {
                let (prefill, _) = both(isa, dtype, block, 6, 2, dim, 0, n, None);
                let (alone, _) = both(isa, dtype, block, 6, 2, dim, n - 1, 1, None);
                assert_eq!(
                    alone[..],
                    prefill[(n - 1) * 6 * dim..],
                    "{isa:?} {dtype:?} block {block} dim {dim}"
                );
            }
        }
    }
}
