//! The AVX2 kernel of [`super`]'s attention, for rows of any format: plain (f32, bf16, f16) of a head
//! size that is a multiple of 8 up to [`MAX_HEAD_DIM`], and encoded (int8, fp8, int4) of a multiple of
//! [`QUANT_GROUP`] up to the same. CPUs without AVX-512 (AMD Zen 2 and 3, Intel before Skylake-SP, most
//! small cloud instances) no longer fall back to the portable loop, whose scalar `exp`, SSE products and
//! scalar decoding of encoded rows made a long prompt's attention cost more than its matrix products;
//! AVX-512 CPUs take it for what their own kernel does not (other head sizes; int8 and int4 without VNNI).
//!
//! Scores come 4 keys × 3 query heads at a time (12 accumulators in registers), each key's row widened
//! (and dequantised) from its stored format as it is read; a group of more than 3 query heads first
//! widens 8 keys into a tile in L1, which each pass of 3 heads then reads. Each key's 8 partial sums are
//! reduced by one fixed tree of `hadd`s, so a key's score is computed the same way wherever it sits among
//! the others. Int8 and int4 keys are scored as integer dot products with the query quantised
//! (`vpmaddubsw` on `|k|` and `q` with k's sign, or on the unsigned nibbles and `q`, then `vpmaddwd`), 4
//! keys × 2 heads at a time: the integer sums are exact, and each group's term is formed as the portable
//! loop forms it, so the scores are the portable loop's, bit for bit. The softmax uses a vector exp; V
//! is summed in registers, position after position, in column slices of 32 lanes for up to 3 heads at
//! once (12 accumulators, 3 scores and one V vector fill the 16 registers). Each token is computed the
//! same way in a prefill and alone in a decode step, as in the other kernels.

use std::arch::x86_64::*;

use half::{bf16, f16};
use kura_kv::codec::{KvDtype, QUANT_GROUP};

use super::{prefetch_row, spans, Fp8Row, Int4Row, Int8Row, Job, KvRow};

/// The largest head size the kernel takes (the tile of 8 widened keys stays in 8 KiB; an encoded row
/// has at most the 4 groups whose scales [`KvRow::params`] holds).
pub(super) const MAX_HEAD_DIM: usize = 256;

/// Whether the kernel takes rows of `dtype` at a head size: a multiple of 8 lanes for plain rows, of
/// an encoded format's group for the others, up to [`MAX_HEAD_DIM`].
fn takes_shape(dtype: KvDtype, head_dim: usize) -> bool {
    let unit = if dtype.is_quantized() { QUANT_GROUP } else { 8 };
    head_dim > 0 && head_dim.is_multiple_of(unit) && head_dim <= MAX_HEAD_DIM
}

/// Whether the kernel takes rows of `dtype` at a head size, and this CPU has what it needs.
pub(super) fn takes(dtype: KvDtype, head_dim: usize) -> bool {
    takes_shape(dtype, head_dim)
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// A row read 8 lanes at a time as f32: plain elements widen exactly; encoded ones are dequantised in
/// registers with the row's scales ([`KvRow::params`]).
pub(super) trait Lanes8: KvRow {
    /// What the lanes of one group need from the row's scales, in registers (`()` for plain rows).
    type Group: Copy;
    /// That of the group holding lanes `8c..`, from the row's [`KvRow::params`]: taken once a group,
    /// not once a lane vector.
    ///
    /// # Safety
    /// avx2 is present.
    unsafe fn group(p: &Self::Params, c: usize) -> Self::Group;
    /// Elements `8c..8c + 8` of the row at `row`, as f32.
    ///
    /// # Safety
    /// avx2 and f16c are present; a whole row of a head size the kernel takes is readable at `row`,
    /// `8c` is below that head size, and `s` is [`Lanes8::group`] of that row's params at `c`.
    unsafe fn load8(row: *const Self::Unit, c: usize, s: &Self::Group) -> __m256;
    /// Elements `8c..8c + 8` before the scale of [`KvRow::single_scale`] (rows of one group that
    /// have one).
    ///
    /// # Safety
    /// As [`Lanes8::load8`].
    unsafe fn load8_unscaled(_row: *const Self::Unit, _c: usize) -> __m256 {
        unreachable!("only rows with a single scale are read unscaled")
    }
    /// Whether keys are widened into the tile in L1 before their scores, whatever the group of query
    /// heads: a format whose widening needs registers of its own (fp8's mask), which beside the 12
    /// accumulators of 3 heads × 4 keys would spill them to the stack in the loop.
    const WIDEN_KEYS: bool = false;
}

impl Lanes8 for f32 {
    type Group = ();
    #[inline(always)]
    unsafe fn group(_: &(), _: usize) {}
    #[inline(always)]
    unsafe fn load8(row: *const f32, c: usize, _: &()) -> __m256 {
        // SAFETY: the caller's guarantee.
        unsafe { _mm256_loadu_ps(row.add(8 * c)) }
    }
}

impl Lanes8 for bf16 {
    type Group = ();
    #[inline(always)]
    unsafe fn group(_: &(), _: usize) {}
    #[inline(always)]
    unsafe fn load8(row: *const bf16, c: usize, _: &()) -> __m256 {
        // SAFETY: the caller's guarantee; bf16 widens by a 16-bit shift.
        unsafe {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(row.add(8 * c).cast()),
            )))
        }
    }
}

impl Lanes8 for f16 {
    type Group = ();
    #[inline(always)]
    unsafe fn group(_: &(), _: usize) {}
    #[inline(always)]
    unsafe fn load8(row: *const f16, c: usize, _: &()) -> __m256 {
        // SAFETY: the caller's guarantee.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(row.add(8 * c).cast())) }
    }
}

/// The 8 payload bytes of lanes `8c..8c + 8` of a one-byte format.
///
/// # Safety
/// 8 bytes are readable at `row + 8c`.
#[inline(always)]
unsafe fn bytes8(row: *const u8, c: usize) -> __m128i {
    // SAFETY: the caller's guarantee.
    unsafe { _mm_loadl_epi64(row.add(8 * c).cast()) }
}

/// A one-byte format (int8, fp8): its lanes are the raw values (`$raw`, of the 8 payload bytes `$b`)
/// times their group's scale.
macro_rules! byte_lanes {
    ($row:ident, $widen:expr, |$b:ident| $raw:expr) => {
        impl Lanes8 for $row {
            type Group = __m256;
            #[inline(always)]
            unsafe fn group(p: &[f32; 4], c: usize) -> __m256 {
                // Lanes 8c.. lie in group 8c / 64.
                // SAFETY: the caller's guarantee (avx2, which implies avx).
                unsafe { _mm256_set1_ps(p[c / 8]) }
            }
            #[inline(always)]
            unsafe fn load8(row: *const u8, c: usize, scale: &__m256) -> __m256 {
                // SAFETY: the caller's guarantee.
                unsafe { _mm256_mul_ps(Self::load8_unscaled(row, c), *scale) }
            }
            #[inline(always)]
            unsafe fn load8_unscaled(row: *const u8, c: usize) -> __m256 {
                // SAFETY: the caller's guarantee.
                unsafe {
                    let $b = bytes8(row, c);
                    $raw
                }
            }
            const WIDEN_KEYS: bool = $widen;
        }
    };
}

byte_lanes!(Int8Row, false, |b| _mm256_cvtepi32_ps(
    _mm256_cvtepi8_epi32(b)
));
// As the AVX-512 kernel reads e4m3: each byte s eeee mmm becomes the f16 s 0eeee mmm0000000, its
// exponent 8 short, 2^8 in the scale. Here in three steps: the byte into the high half of a 16-bit lane
// (s eeee mmm 00000000), an arithmetic shift right by one (s s eeee mmm 0000000), bit 14 cleared.
byte_lanes!(Fp8Row, true, |b| {
    let hi = _mm_unpacklo_epi8(_mm_setzero_si128(), b);
    let h = _mm_and_si128(_mm_srai_epi16::<1>(hi), _mm_set1_epi16(0xBFFFu16 as i16));
    _mm256_cvtph_ps(h)
});

impl Lanes8 for Int4Row {
    /// The group's scale and minimum.
    type Group = (__m256, __m256);
    #[inline(always)]
    unsafe fn group(p: &[[f32; 4]; 2], c: usize) -> (__m256, __m256) {
        // SAFETY: the caller's guarantee (avx2, which implies avx).
        unsafe { (_mm256_set1_ps(p[0][c / 8]), _mm256_set1_ps(p[1][c / 8])) }
    }
    #[inline(always)]
    unsafe fn load8(row: *const u8, c: usize, s: &(__m256, __m256)) -> __m256 {
        // Group c / 8 has 32 bytes: its lanes 0..32 are the low nibbles of those bytes, its lanes 32..64
        // the high nibbles, so its chunks 0..4 of 8 lanes read bytes 8·cc.. low, chunks 4..8 the same
        // bytes high.
        let (g, cc) = (c / 8, c % 8);
        // SAFETY: the caller's guarantee: the group's 32 payload bytes are readable.
        unsafe {
            let b = _mm_loadl_epi64(row.add(g * 32 + (cc % 4) * 8).cast());
            let b = if cc >= 4 { _mm_srli_epi16::<4>(b) } else { b };
            let q = _mm_and_si128(b, _mm_set1_epi8(0x0F));
            let x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
            _mm256_fmadd_ps(x, s.0, s.1)
        }
    }
}

/// `[Σ a0, …, Σ a3]`: the lane sums of 4 vectors, each by the same tree
/// `((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))`.
#[target_feature(enable = "avx2")]
#[inline]
fn transpose_sum4(a: &[__m256; 4]) -> __m128 {
    // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7], twice: per 128-bit half,
    // the sums of that half of a0..a3.
    let u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps::<1>(u))
}

/// The scores of every query head of `job` against up to 4 keys (`n` of the rows, `params` theirs; the
/// others repeat one of them), into `scores[g · n_ctx + col ..][..n]`, 3 heads at a time.
///
/// # Safety
/// avx2, fma and f16c are present; each row holds a whole row of `job.head_dim` elements, and `job.q`
/// `group` heads; `scores` holds `group · n_ctx` values and `col + n ≤ n_ctx`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn heads_scores<K: Lanes8>(
    job: &Job<'_, '_>,
    rows: [*const K::Unit; 4],
    params: &[K::Params; 4],
    n: usize,
    scores: *mut f32,
    n_ctx: usize,
    col: usize,
) {
    let (group, head_dim) = (job.group, job.head_dim);
    let scale = _mm256_set1_ps(job.scale);
    let mut g0 = 0;
    while g0 < group {
        let gb = (group - g0).min(3);
        let qp = job.q[g0 * head_dim..(g0 + gb) * head_dim].as_ptr();
        // SAFETY: the caller's guarantee; heads g0..g0 + gb lie inside q.
        let sums = unsafe {
            match gb {
                1 => qk::<K, 1>(qp, rows, params, head_dim, scale),
                2 => qk::<K, 2>(qp, rows, params, head_dim, scale),
                _ => qk::<K, 3>(qp, rows, params, head_dim, scale),
            }
        };
        for (g, row) in sums[..gb].iter().enumerate() {
            // SAFETY: scores of head g0 + g, columns col..col + n, lie inside (the caller's guarantee).
            unsafe { store_scores(scores.add((g0 + g) * n_ctx + col), *row, n) };
        }
        g0 += gb;
    }
}

/// The first `n` (up to 4) of a key's 4 scores, to `dst`.
///
/// # Safety
/// `n` values are writable at `dst`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn store_scores(dst: *mut f32, four: __m128, n: usize) {
    // SAFETY: the caller's guarantee.
    unsafe {
        if n == 4 {
            _mm_storeu_ps(dst, four);
        } else {
            let mut buf = [0f32; 4];
            _mm_storeu_ps(buf.as_mut_ptr(), four);
            std::ptr::copy_nonoverlapping(buf.as_ptr(), dst, n);
        }
    }
}

/// The scores of every query head of `job` against up to 4 int8 (`INT4` false) or int4 (`INT4` true)
/// keys (as [`heads_scores`]), 2 heads at a time, as integer dot products with the quantised query
/// (`job.qq`): per group of [`QUANT_GROUP`] lanes, `Σ q·k` ([`int8_dots`], [`int4_dots`]), exact; then
/// the group's term (int8: `d · (s · scale_q)`; int4: `d · (s · scale_q) + (m · scale_q) · Σ q`) and the
/// sum of the terms in group order, as [`super::QuantQuery::score`] forms them (the same bits).
///
/// # Safety
/// avx2, fma and f16c are present; each row is a whole row of the format of `job.head_dim` (a multiple
/// of [`QUANT_GROUP`]) lanes; `job.qq` holds the quantised `group` heads; `scores` holds
/// `group · n_ctx` values and `col + n ≤ n_ctx`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn int_scores<const INT4: bool>(
    job: &Job<'_, '_>,
    rows: [*const u8; 4],
    n: usize,
    scores: *mut f32,
    n_ctx: usize,
    col: usize,
) {
    let (group, head_dim, qq) = (job.group, job.head_dim, job.qq);
    let groups = head_dim / QUANT_GROUP;
    // Where the groups' scales (int4: scale, then minimum) start, and their stride.
    let (payload, stride) = if INT4 {
        (head_dim / 2, 4)
    } else {
        (head_dim, 2)
    };
    let scale = _mm_set1_ps(job.scale);
    // The f16 at byte `at` of each of the 4 rows: [key 0, …, key 3].
    let f16x4 = |at: usize| {
        let bits: [u16; 4] = std::array::from_fn(|j| {
            // SAFETY: `at` is a group's scale or minimum, inside the row (the caller's guarantee).
            unsafe { std::ptr::read_unaligned(rows[j].add(at).cast::<u16>()) }
        });
        // SAFETY: 4 u16 in `bits`; f16c is present.
        unsafe { _mm_cvtph_ps(_mm_loadl_epi64(bits.as_ptr().cast())) }
    };
    // The keys' scales (and int4's minimums), group by group.
    let mut sk = [_mm_setzero_ps(); 4];
    let mut mk = [_mm_setzero_ps(); 4];
    for gr in 0..groups {
        sk[gr] = f16x4(payload + stride * gr);
        if INT4 {
            mk[gr] = f16x4(payload + stride * gr + 2);
        }
    }
    let mut g0 = 0;
    while g0 < group {
        let gb = (group - g0).min(2);
        let mut score = [_mm_setzero_ps(); 2];
        for gr in 0..groups {
            let off = gr * QUANT_GROUP;
            // Checked: the group's lanes of the head lie inside the quantised query.
            let qi = |h: usize| {
                let at = (g0 + h) * head_dim + off;
                qq.qi[at..at + QUANT_GROUP].as_ptr()
            };
            // SAFETY: heads g0..g0 + gb of the quantised query and each row's payload hold the group's
            // lanes (the caller's guarantee).
            let d = unsafe {
                match (gb, INT4) {
                    (1, false) => {
                        let [d] = int8_dots::<1>([qi(0)], rows, off);
                        [d, d]
                    }
                    (_, false) => int8_dots::<2>([qi(0), qi(1)], rows, off),
                    (1, true) => {
                        let [d] = int4_dots::<1>([qi(0)], rows, gr);
                        [d, d]
                    }
                    (_, true) => int4_dots::<2>([qi(0), qi(1)], rows, gr),
                }
            };
            for (h, dh) in d.iter().enumerate().take(gb) {
                let i = (g0 + h) * groups + gr;
                let sq = _mm_set1_ps(qq.scale[i]);
                let mut term = _mm_mul_ps(*dh, _mm_mul_ps(sk[gr], sq));
                if INT4 {
                    let sum = _mm_set1_ps(qq.sum[i] as f32);
                    term = _mm_add_ps(term, _mm_mul_ps(_mm_mul_ps(mk[gr], sq), sum));
                }
                score[h] = if gr == 0 {
                    term
                } else {
                    _mm_add_ps(score[h], term)
                };
            }
        }
        for (h, s) in score.iter().enumerate().take(gb) {
            // SAFETY: scores of head g0 + h, columns col..col + n, lie inside (the caller's guarantee).
            unsafe { store_scores(scores.add((g0 + h) * n_ctx + col), _mm_mul_ps(*s, scale), n) };
        }
        g0 += gb;
    }
}

/// `[Σ q·n0, …, Σ q·n3]` over the 64 lanes of group `gr` of 4 int4 rows (their nibbles n, unsigned:
/// the group's 32 bytes hold lanes 0..32 in their low nibbles and 32..64 in their high ones), for each
/// of `H` quantised query heads (the group's lanes at `q[h]`), exact: a pair of products is at most
/// 2 · 15 · 127 and two pairs 7,620, inside an i16.
///
/// # Safety
/// avx2 is present; `QUANT_GROUP` lanes are readable at each `q[h]` and the group's 32 payload bytes at
/// `rows[j] + 32 · gr`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn int4_dots<const H: usize>(
    q: [*const i8; H],
    rows: [*const u8; 4],
    gr: usize,
) -> [__m128; H] {
    let ones = _mm256_set1_epi16(1);
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = [[_mm256_setzero_si256(); 4]; H];
    // SAFETY: the caller's guarantee.
    unsafe {
        let qlo: [__m256i; H] = std::array::from_fn(|h| _mm256_loadu_si256(q[h].cast()));
        let qhi: [__m256i; H] = std::array::from_fn(|h| _mm256_loadu_si256(q[h].add(32).cast()));
        for j in 0..4 {
            let b = _mm256_loadu_si256(rows[j].add(32 * gr).cast());
            let lo = _mm256_and_si256(b, low);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(b), low);
            for h in 0..H {
                let p = _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo, qlo[h]),
                    _mm256_maddubs_epi16(hi, qhi[h]),
                );
                acc[h][j] = _mm256_madd_epi16(p, ones);
            }
        }
    }
    acc.map(|a| lane_sums4(&a))
}

/// `[Σ q·k0, …, Σ q·k3]` over lanes `off..off + QUANT_GROUP` of 4 int8 rows, for each of `H` quantised
/// query heads (their lanes at `q[h]`), exact (below 2^24, so exact in f32 too).
///
/// # Safety
/// avx2 is present; `QUANT_GROUP` lanes are readable at each `q[h]` and at `rows[j] + off`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn int8_dots<const H: usize>(
    q: [*const i8; H],
    rows: [*const u8; 4],
    off: usize,
) -> [__m128; H] {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_si256(); 4]; H];
    for half in 0..QUANT_GROUP / 32 {
        // SAFETY: the caller's guarantee.
        unsafe {
            let qv: [__m256i; H] =
                std::array::from_fn(|h| _mm256_loadu_si256(q[h].add(32 * half).cast()));
            for j in 0..4 {
                let kb = _mm256_loadu_si256(rows[j].add(off + 32 * half).cast());
                let ak = _mm256_abs_epi8(kb);
                for (a, x) in acc.iter_mut().zip(&qv) {
                    let p = _mm256_maddubs_epi16(ak, _mm256_sign_epi8(*x, kb));
                    a[j] = _mm256_add_epi32(a[j], _mm256_madd_epi16(p, ones));
                }
            }
        }
    }
    acc.map(|a| lane_sums4(&a))
}

/// `[Σ a0, …, Σ a3]`: the integer lane sums of 4 vectors, as f32 (exact below 2^24).
#[target_feature(enable = "avx2")]
#[inline]
fn lane_sums4(a: &[__m256i; 4]) -> __m128 {
    let u = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    _mm_cvtepi32_ps(_mm_add_epi32(
        _mm256_castsi256_si128(u),
        _mm256_extracti128_si256::<1>(u),
    ))
}

/// The scaled scores of `G` query heads (rows of `head_dim` from `q`) against 4 keys (rows of `head_dim`
/// at `k`, their params `p`), per head in key order (heads past `G` zero): each score's lanes summed in
/// chunk order, then by [`transpose_sum4`].
///
/// # Safety
/// avx2, fma and f16c are present; `q` holds `G` rows and each of `k` one whole row of `head_dim` (a
/// head size the kernel takes) values.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn qk<K: Lanes8, const G: usize>(
    q: *const f32,
    k: [*const K::Unit; 4],
    p: &[K::Params; 4],
    head_dim: usize,
    scale: __m256,
) -> [__m128; 3] {
    let mut acc = [[_mm256_setzero_ps(); 4]; G];
    let chunks = head_dim / 8;
    // A group of 64 lanes (8 lane vectors) at a time, its scales taken once; chunks in order.
    for c0 in (0..chunks).step_by(8) {
        // SAFETY: avx2 is present.
        let sg: [K::Group; 4] = std::array::from_fn(|j| unsafe { K::group(&p[j], c0) });
        for c in c0..chunks.min(c0 + 8) {
            // SAFETY: the caller's guarantee.
            unsafe {
                let qv: [__m256; G] =
                    std::array::from_fn(|g| _mm256_loadu_ps(q.add(g * head_dim + 8 * c)));
                for j in 0..4 {
                    let kv = K::load8(k[j], c, &sg[j]);
                    for (a, x) in acc.iter_mut().zip(&qv) {
                        a[j] = _mm256_fmadd_ps(*x, kv, a[j]);
                    }
                }
            }
        }
    }
    let mut out = [_mm_setzero_ps(); 3];
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = _mm_mul_ps(transpose_sum4(a), _mm256_castps256_ps128(scale));
    }
    out
}

/// e^x, lane-wise, for x ≤ 0: x = n·ln 2 + r with |r| ≤ ln 2 / 2, a degree-6 Taylor polynomial for e^r
/// (relative error below 2e-7), times 2^n built in the exponent field. x is held above −87 so that 2^n
/// stays a normal float: e^−87 ≈ 1.6e-38 stands for anything smaller, which is nothing beside the
/// largest score's e^0 = 1 in the sum.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn exp(x: __m256) -> __m256 {
    let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm256_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(p, _mm256_castsi256_ps(two_n))
}

/// The 8 lanes of `v` reduced by `f` in a fixed order.
#[target_feature(enable = "avx2")]
#[inline]
fn reduce(v: __m256, f: impl Fn(__m128, __m128) -> __m128) -> f32 {
    let h = f(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h = f(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(f(h, _mm_shuffle_ps::<0b01>(h, h)))
}

/// Replaces a row of scores by `e^(score − m)` and returns `(m, Σ e^(score − m))`, `m` the largest.
#[target_feature(enable = "avx2,fma")]
fn exp_sum(x: &mut [f32]) -> (f32, f32) {
    let full = x.len() / 8 * 8;
    let tail = x.len() - full;
    let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
    for c in x[..full].chunks_exact(8) {
        // SAFETY: 8 values.
        mx = _mm256_max_ps(mx, unsafe { _mm256_loadu_ps(c.as_ptr()) });
    }
    let mut m = reduce(mx, |a, b| _mm_max_ps(a, b));
    for v in &x[full..] {
        m = m.max(*v);
    }
    let mv = _mm256_set1_ps(m);
    let mut sum = _mm256_setzero_ps();
    for c in x[..full].chunks_exact_mut(8) {
        // SAFETY: 8 values.
        unsafe {
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv));
            sum = _mm256_add_ps(sum, e);
            _mm256_storeu_ps(c.as_mut_ptr(), e);
        }
    }
    if tail > 0 {
        // The last partial chunk through the same lanes, padded with m; the padding's e^0 is kept out
        // of the sum.
        let mut buf = [m; 8];
        buf[..tail].copy_from_slice(&x[full..]);
        let keep: [i32; 8] = std::array::from_fn(|i| if i < tail { -1 } else { 0 });
        // SAFETY: 8 values in each array.
        unsafe {
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(buf.as_ptr()), mv));
            let e = _mm256_and_ps(
                e,
                _mm256_castsi256_ps(_mm256_loadu_si256(keep.as_ptr().cast())),
            );
            sum = _mm256_add_ps(sum, e);
            _mm256_storeu_ps(buf.as_mut_ptr(), e);
        }
        x[full..].copy_from_slice(&buf[..tail]);
    }
    (m, reduce(sum, |a, b| _mm_add_ps(a, b)))
}

/// One unit: writes, per query head, the partial `[m, l, o]` (see [`super::attend`]).
///
/// # Safety
/// [`takes`]`(dtype, job.head_dim)` is true for `R`'s format; for int8 and int4, `job.qq` holds the
/// quantised query; `out` holds `group × (head_dim + 2)` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attend<'a, R: Lanes8 + 'a>(
    job: &Job<'a, '_>,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    let Job {
        q,
        seq,
        kv,
        kvh,
        lo,
        pos,
        group,
        head_dim,
        ..
    } = *job;
    assert!(takes_shape(kv.dtype(), head_dim));
    assert!(!R::INTEGER_SCORES || job.qq.qi.len() >= group * head_dim);
    assert!(q.len() >= group * head_dim && out.len() >= group * (head_dim + 2));
    let chunks = head_dim / 8;
    let n_ctx = pos + 1 - lo;
    let ru = kv.vector_units();
    // Up to 3 query heads read each key once, so a key is widened inside the product; a larger group,
    // or a format that widens keys first (fp8), widens 8 keys into a tile in L1 first, which each pass
    // of 3 heads then reads (the scratch's tail).
    // Int8 and int4 keys are read as they are stored, by integer products.
    let direct = (group <= 3 && !R::WIDEN_KEYS) || R::INTEGER_SCORES;
    let tile_len = if direct { 0 } else { 8 * head_dim };
    // Every tile row, like every score, is written before it is read.
    super::fit(scratch, group * n_ctx + tile_len);
    let (scores, tile) = scratch.split_at_mut(group * n_ctx);
    let tp = tile.as_mut_ptr();
    let sp = scores.as_mut_ptr();
    for (block, first, last, at, next) in spans(seq, kv.block_size_tokens, lo, pos) {
        let k = R::typed(kv.k_head_block(block, kvh));
        assert!(k.len() >= (last + 1) * ru);
        let kp = k.as_ptr();
        let next_k = next.map(|b| R::typed(kv.k_head_block(b, kvh)).as_ptr());
        let mut s0 = first;
        while s0 <= last {
            let keys = (last + 1 - s0).min(if direct { 4 } else { 8 });
            if let Some(nk) = next_k {
                for j in 0..keys {
                    prefetch_row(nk.wrapping_add((s0 + j) * ru), ru);
                }
            }
            // Key j's row; past the last key, the last one again (its scores are not kept).
            // SAFETY: slots up to `last` lie inside the block (asserted above).
            let row = |j: usize| unsafe { kp.add((s0 + j.min(keys - 1)) * ru) };
            let col = at + s0 - first;
            if R::INTEGER_SCORES {
                let rows: [*const u8; 4] = std::array::from_fn(|j| row(j).cast());
                // SAFETY: int8 or int4 rows (the formats with integer scores, as the storage says) of
                // head_dim lanes and their scales; qq holds group quantised heads (asserted); columns
                // inside n_ctx.
                unsafe {
                    if kv.dtype() == KvDtype::Int4 {
                        int_scores::<true>(job, rows, keys, sp, n_ctx, col)
                    } else {
                        int_scores::<false>(job, rows, keys, sp, n_ctx, col)
                    }
                };
            } else if direct {
                let rows: [*const R::Unit; 4] = std::array::from_fn(row);
                // SAFETY: each row is a whole row of head_dim elements.
                let params = rows.map(|r| unsafe { R::params(r, head_dim) });
                // SAFETY: as above; q holds group × head_dim (asserted); the span's columns lie inside
                // the context's n_ctx.
                unsafe { heads_scores::<R>(job, rows, &params, keys, sp, n_ctx, col) };
            } else {
                for j in 0..keys {
                    let rp = row(j);
                    // SAFETY: a whole row of head_dim elements.
                    let pr = unsafe { R::params(rp, head_dim) };
                    for c0 in (0..chunks).step_by(8) {
                        // SAFETY: avx2 is present.
                        let sg = unsafe { R::group(&pr, c0) };
                        for c in c0..chunks.min(c0 + 8) {
                            // SAFETY: the row holds head_dim elements; the tile 8 rows of head_dim.
                            unsafe {
                                _mm256_storeu_ps(tp.add(j * head_dim + 8 * c), R::load8(rp, c, &sg))
                            };
                        }
                    }
                }
                for k0 in (0..keys).step_by(4) {
                    let n = (keys - k0).min(4);
                    let rows: [*const f32; 4] = std::array::from_fn(|j| {
                        tp.cast_const().wrapping_add((k0 + j.min(n - 1)) * head_dim)
                    });
                    // SAFETY: rows k0..k0 + n of the tile are inside it, widened above.
                    unsafe { heads_scores::<f32>(job, rows, &[(); 4], n, sp, n_ctx, col + k0) };
                }
            }
            s0 += keys;
        }
    }
    for g in 0..group {
        let (m, l) = exp_sum(&mut scores[g * n_ctx..(g + 1) * n_ctx]);
        out[g * (head_dim + 2)] = m;
        out[g * (head_dim + 2) + 1] = l;
    }
    // V: up to 3 heads × 4 vectors of lanes at a time (12 accumulators, 3 broadcast scores and one V
    // vector: the 16 registers), each (head, lane) summing the positions in order.
    let mut g0 = 0;
    while g0 < group {
        let gb = (group - g0).min(3);
        let mut c0 = 0;
        while c0 < chunks {
            let cw = (chunks - c0).min(4);
            let args = (&scores[..], n_ctx, g0, c0);
            let o = out.as_mut_ptr();
            // SAFETY: this function's contract; heads g0..g0+gb and lane vectors c0..c0+cw lie inside.
            unsafe {
                match (gb, cw) {
                    (1, 1) => pv::<R, 1, 1>(job, args, o),
                    (1, 2) => pv::<R, 1, 2>(job, args, o),
                    (1, 3) => pv::<R, 1, 3>(job, args, o),
                    (1, _) => pv::<R, 1, 4>(job, args, o),
                    (2, 1) => pv::<R, 2, 1>(job, args, o),
                    (2, 2) => pv::<R, 2, 2>(job, args, o),
                    (2, 3) => pv::<R, 2, 3>(job, args, o),
                    (2, _) => pv::<R, 2, 4>(job, args, o),
                    (_, 1) => pv::<R, 3, 1>(job, args, o),
                    (_, 2) => pv::<R, 3, 2>(job, args, o),
                    (_, 3) => pv::<R, 3, 3>(job, args, o),
                    (_, _) => pv::<R, 3, 4>(job, args, o),
                }
            }
            c0 += cw;
        }
        g0 += gb;
    }
}

/// Heads `g0..g0 + G`, lane vectors `c0..c0 + W` of the weighted sum of V, into the `o` part of each
/// head's `[m, l, o]` in `out`.
///
/// # Safety
/// As [`attend`]; `g0 + G ≤ group` and `8 · (c0 + W) ≤ head_dim`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pv<'a, R: Lanes8 + 'a, const G: usize, const W: usize>(
    job: &Job<'a, '_>,
    (scores, n_ctx, g0, c0): (&[f32], usize, usize, usize),
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
    let mut acc = [[_mm256_setzero_ps(); W]; G];
    let ru = kv.vector_units();
    let prefetch = g0 == 0 && c0 == 0;
    let one_group = head_dim == QUANT_GROUP;
    assert!(scores.len() >= (g0 + G) * n_ctx);
    for (block, first, last, at, next) in spans(seq, kv.block_size_tokens, lo, pos) {
        let v = R::typed(kv.v_head_block(block, kvh));
        assert!(v.len() >= (last + 1) * ru);
        let next_v = next
            .filter(|_| prefetch)
            .map(|b| R::typed(kv.v_head_block(b, kvh)).as_ptr());
        let n = last + 1 - first;
        debug_assert!(at + n <= n_ctx);
        // SAFETY: slots first..=last of the block lie inside `v` (asserted); positions at..at + n of
        // each head's scores inside `scores` (spans stay inside the context, n_ctx of them).
        unsafe {
            let mut vp = v.as_ptr().add(first * ru);
            let sp: [*const f32; G] =
                std::array::from_fn(|g| scores.as_ptr().add((g0 + g) * n_ctx + at));
            for i in 0..n {
                if let Some(nv) = next_v {
                    prefetch_row(nv.wrapping_add((first + i) * ru), ru);
                }
                let pr = R::params(vp, head_dim);
                match R::single_scale(&pr).filter(|_| one_group) {
                    // A row with one scale (int8, fp8 at head size 64) is read unscaled and its
                    // scale goes into each head's weight: one multiply a head instead of one a lane
                    // vector, and no register for the scale.
                    Some(scale) => {
                        let p: [__m256; G] =
                            std::array::from_fn(|g| _mm256_set1_ps(*sp[g].add(i) * scale));
                        for c in 0..W {
                            let x = R::load8_unscaled(vp, c0 + c);
                            for (ag, pg) in acc.iter_mut().zip(&p) {
                                ag[c] = _mm256_fmadd_ps(*pg, x, ag[c]);
                            }
                        }
                    }
                    None => {
                        // Lanes 8c0.. of at most 4 vectors (c0 a multiple of 4) lie in one group.
                        let sg = R::group(&pr, c0);
                        let p: [__m256; G] =
                            std::array::from_fn(|g| _mm256_broadcast_ss(&*sp[g].add(i)));
                        for c in 0..W {
                            let x = R::load8(vp, c0 + c, &sg);
                            for (ag, pg) in acc.iter_mut().zip(&p) {
                                ag[c] = _mm256_fmadd_ps(*pg, x, ag[c]);
                            }
                        }
                    }
                }
                vp = vp.add(ru);
            }
        }
    }
    for (g, ag) in acc.iter().enumerate() {
        for (c, a) in ag.iter().enumerate() {
            // SAFETY: head g0 + g < group and lane 8·(c0 + c) + 8 ≤ head_dim: inside out.
            unsafe { _mm256_storeu_ps(out.add((g0 + g) * (head_dim + 2) + 2 + 8 * (c0 + c)), *a) };
        }
    }
}
