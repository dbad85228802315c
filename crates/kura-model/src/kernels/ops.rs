//! Element-wise and row-wise kernels: RMSNorm, RoPE, SiLU·mul, residual add. Each is O(n) and
//! written as plain loops over slices with independent accumulators, which the compiler vectorises for
//! the target's SIMD width; all accumulate in f32 like the PyTorch reference.

use crate::config::RopeStyle;

/// `out = x / sqrt(mean(x²) + eps) · weight`, row by row (`x` and `out` are `rows × weight.len()`).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mut acc = [0f32; 16];
        let mut chunks = xr.chunks_exact(16);
        for c in &mut chunks {
            for (a, v) in acc.iter_mut().zip(c) {
                *a += v * v;
            }
        }
        let mut ss: f32 = acc.iter().sum();
        for v in chunks.remainder() {
            ss += v * v;
        }
        let inv = 1.0 / (ss / n as f32 + eps).sqrt();
        for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
            *o = w * (v * inv);
        }
    }
}

/// Cosines and sines of one position's angles (`head_dim / 2` each).
pub fn rope_angles(pos: usize, inv_freq: &[f32], cos: &mut [f32], sin: &mut [f32]) {
    for ((f, c), s) in inv_freq.iter().zip(cos.iter_mut()).zip(sin.iter_mut()) {
        // The angle in f32 like the reference (position × inv_freq as an f32 product).
        let angle = pos as f32 * f;
        *c = angle.cos();
        *s = angle.sin();
    }
}

/// Rotates every head of `x` (`heads × head_dim`) by the given angles.
pub fn rope(x: &mut [f32], head_dim: usize, style: RopeStyle, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        match style {
            RopeStyle::Half => {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x0, x1) = (a[i], b[i]);
                    a[i] = x0 * cos[i] - x1 * sin[i];
                    b[i] = x1 * cos[i] + x0 * sin[i];
                }
            }
            RopeStyle::Interleaved => {
                for i in 0..half {
                    let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = x0 * cos[i] - x1 * sin[i];
                    head[2 * i + 1] = x1 * cos[i] + x0 * sin[i];
                }
            }
        }
    }
}

/// `out[i] = silu(gate[i]) · up[i]` over a run of columns (a token's `[gate | up]` row, or the same
/// columns of both halves: element by element, so a row cut into runs gives the bits of the whole).
///
/// `silu(g) = g / (1 + e^−g)` with e^x from [`exp_lane`]: the same operations in the same order on every
/// path (16 lanes with AVX-512, 8 with AVX2 and FMA, one at a time otherwise), each fused multiply-add
/// rounded once, so every path gives the same bits; the vector paths take a decode step's exponentials
/// from about 5 % of the step to a fraction of a percent.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    silu_mul_on(super::dot::Isa::detect(), gate, up, out)
}

/// [`silu_mul`] through the path of `isa` (tests force each one).
pub fn silu_mul_on(isa: super::dot::Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len().min(gate.len()).min(up.len());
    let (gate, up, out) = (&gate[..n], &up[..n], &mut out[..n]);
    let done = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::detect found avx512f (tests force only paths the CPU has).
        super::dot::Isa::Avx512 if is_x86_feature_detected!("avx512f") => unsafe {
            x86::silu_mul_avx512(gate, up, out)
        },
        #[cfg(target_arch = "x86_64")]
        super::dot::Isa::Avx2Fma
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") =>
        // SAFETY: both features checked just above.
        unsafe { x86::silu_mul_avx2(gate, up, out) },
        _ => 0,
    };
    for ((o, g), u) in out[done..].iter_mut().zip(&gate[done..]).zip(&up[done..]) {
        // `0 − g`, not `−g`: the vector paths' negation (the same bits at g = 0).
        *o = g / (1.0 + exp_lane(0.0 - g)) * u;
    }
}

/// Bounds of [`exp_lane`]'s argument: e^x stays a normal float, and 2^n is built from its exponent bits.
const EXP_MIN: f32 = -87.0;
const EXP_MAX: f32 = 87.0;
/// ln 2 in two parts (the first exact in few bits), for `r = x − n·ln 2` without cancellation error.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// The Taylor coefficients of e^r from 1/6! down to 1, in Horner order.
const EXP_POLY: [f32; 7] = [
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// e^x for one lane, as the vector paths compute each of theirs: x clamped to ±87, `x = n·ln 2 + r`
/// with `n` rounded to nearest even and |r| ≤ ln 2 / 2, a degree-6 Taylor polynomial for e^r (relative
/// error below 2e-7), times 2^n built from its bits.
#[inline]
pub fn exp_lane(x: f32) -> f32 {
    let x = x.clamp(EXP_MIN, EXP_MAX);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p.mul_add(r, *c);
    }
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    //! [`super::silu_mul`]'s vector paths: [`super::exp_lane`] lane-wise, operation for operation.

    use std::arch::x86_64::*;

    use super::{EXP_MAX, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO};

    /// e^x, lane-wise, before its scaling by 2^n: `(n, p)` with `x = n·ln 2 + r`, `n` rounded to nearest
    /// even, and `p` the degree-6 polynomial of e^r, so that e^x = p · 2^n (the caller clamps x and
    /// scales). Attention's softmax shares it.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(in crate::kernels) fn exp_parts_avx512(x: __m512) -> (__m512, __m512) {
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(EXP_POLY[0]);
        for c in &EXP_POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        (n, p)
    }

    /// Columns `0..16k` of `out = silu(gate) · up` (k as large as fits); returns how many it wrote.
    ///
    /// # Safety
    /// avx512f is present; the three slices have the same length.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn silu_mul_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) -> usize {
        let n = out.len() / 16 * 16;
        let one = _mm512_set1_ps(1.0);
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 ≤ n ≤ the length of each slice.
            unsafe {
                let g = _mm512_loadu_ps(gate.as_ptr().add(i));
                let x = _mm512_sub_ps(_mm512_setzero_ps(), g);
                let x = _mm512_min_ps(
                    _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN)),
                    _mm512_set1_ps(EXP_MAX),
                );
                let (nf, p) = exp_parts_avx512(x);
                let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(
                    _mm512_cvtps_epi32(nf),
                    _mm512_set1_epi32(127),
                ));
                let e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
                let s = _mm512_div_ps(g, _mm512_add_ps(one, e));
                let u = _mm512_loadu_ps(up.as_ptr().add(i));
                _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(s, u));
            }
        }
        n
    }

    /// As [`silu_mul_avx512`], 8 columns at a time.
    ///
    /// # Safety
    /// avx2 and fma are present; the three slices have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) -> usize {
        let n = out.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 ≤ n ≤ the length of each slice.
            unsafe {
                let g = _mm256_loadu_ps(gate.as_ptr().add(i));
                let x = _mm256_sub_ps(_mm256_setzero_ps(), g);
                let x = _mm256_min_ps(
                    _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)),
                    _mm256_set1_ps(EXP_MAX),
                );
                let nf = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
                );
                let r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(LN2_HI), x);
                let r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(LN2_LO), r);
                let mut p = _mm256_set1_ps(EXP_POLY[0]);
                for c in &EXP_POLY[1..] {
                    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
                }
                let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
                    _mm256_cvtps_epi32(nf),
                    _mm256_set1_epi32(127),
                ));
                let e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
                let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
                let u = _mm256_loadu_ps(up.as_ptr().add(i));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(s, u));
            }
        }
        n
    }
}

/// `out[i] = gelu_tanh(gate[i]) · up[i]`, as [`silu_mul`], with GELU's tanh approximation
/// `0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³)))` as PyTorch computes it.
pub fn gelu_tanh_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        let inner = SQRT_2_OVER_PI * (g + 0.044715 * g * g * g);
        *o = 0.5 * g * (1.0 + inner.tanh()) * u;
    }
}

/// `x *= s`.
pub fn scale_in_place(x: &mut [f32], s: f32) {
    for a in x {
        *a *= s;
    }
}

/// `x += y`.
pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_of_constant_row_is_weight() {
        let x = [3.0f32; 20];
        let w: Vec<f32> = (0..20).map(|i| i as f32).collect();
        let mut out = [0f32; 20];
        rms_norm(&x, &w, 0.0, &mut out);
        for (o, w) in out.iter().zip(&w) {
            assert!((o - w).abs() < 1e-5);
        }
    }

    #[test]
    fn rope_styles_are_permutations_of_each_other() {
        // Interleaved rope on (x0, y0, x1, y1) equals half rope on (x0, x1, y0, y1).
        let inter = [1.0f32, 2.0, 3.0, 4.0];
        let mut half = [1.0f32, 3.0, 2.0, 4.0];
        let mut a = inter;
        let (mut c, mut s) = ([0f32; 2], [0f32; 2]);
        rope_angles(5, &[1.0, 0.1], &mut c, &mut s);
        rope(&mut a, 4, RopeStyle::Interleaved, &c, &s);
        rope(&mut half, 4, RopeStyle::Half, &c, &s);
        assert_eq!([a[0], a[2], a[1], a[3]], half);
        // Position 0 is the identity.
        rope_angles(0, &[1.0, 0.1], &mut c, &mut s);
        let mut b = inter;
        rope(&mut b, 4, RopeStyle::Half, &c, &s);
        assert_eq!(b, inter);
    }

    #[test]
    fn silu_mul_matches_definition() {
        let gu = [1.0f32, -2.0, 3.0, 0.5];
        let mut out = [0f32; 2];
        silu_mul(&gu[..2], &gu[2..], &mut out);
        let silu = |v: f32| v / (1.0 + (-v).exp());
        assert!((out[0] - silu(1.0) * 3.0).abs() < 1e-6);
        assert!((out[1] - silu(-2.0) * 0.5).abs() < 1e-6);
    }

    /// Gates across the whole range (far past ±87, zeros of both signs, subnormals) and up values.
    fn gates() -> (Vec<f32>, Vec<f32>) {
        let mut gate = vec![
            0.0, -0.0, 1e-40, -1e-40, 86.9, 87.0, 87.1, -87.0, -87.1, 200.0, -200.0,
        ];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        while gate.len() < 1000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let unit = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            // Mostly the range a model's gates take, some far out.
            gate.push(unit * if gate.len() % 10 == 0 { 400.0 } else { 24.0 });
        }
        let up = gate.iter().map(|g| 0.75 - g / 16.0).collect();
        (gate, up)
    }

    #[test]
    fn exp_lane_is_close_to_exp() {
        for x in (-8700..=8700).map(|i| i as f32 / 100.0) {
            let (got, want) = (exp_lane(x), (x as f64).exp());
            assert!(
                ((got as f64 - want) / want).abs() < 4e-7,
                "e^{x}: {got} vs {want}"
            );
        }
        assert_eq!(exp_lane(0.0), 1.0);
        assert_eq!(exp_lane(-1000.0), exp_lane(-87.0));
        assert_eq!(exp_lane(1000.0), exp_lane(87.0));
    }

    #[test]
    fn silu_mul_paths_give_the_same_bits() {
        use crate::kernels::dot::Isa;
        let (gate, up) = gates();
        let silu = |v: f64| v / (1.0 + (-v).exp());
        let mut want = vec![0f32; gate.len()];
        silu_mul_on(Isa::Scalar, &gate, &up, &mut want);
        for ((w, g), u) in want.iter().zip(&gate).zip(&up) {
            let exact = silu(*g as f64) * *u as f64;
            assert!(
                (*w as f64 - exact).abs() <= 1e-6 * exact.abs().max(1e-3),
                "silu({g})·{u}: {w} vs {exact}"
            );
        }
        let mut paths = vec![];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                paths.push(Isa::Avx2Fma);
            }
            if is_x86_feature_detected!("avx512f") {
                paths.push(Isa::Avx512);
            }
        }
        for isa in paths {
            // Every length up to a few vectors, so that each path's tail runs too.
            for n in [1, 7, 8, 9, 15, 16, 17, 33, gate.len()] {
                let mut got = vec![0f32; n];
                silu_mul_on(isa, &gate[..n], &up[..n], &mut got);
                for i in 0..n {
                    assert_eq!(
                        got[i].to_bits(),
                        want[i].to_bits(),
                        "{isa:?}, column {i} of {n}: silu({})·{}",
                        gate[i],
                        up[i]
                    );
                }
            }
        }
    }

    #[test]
    fn gelu_tanh_mul_matches_pytorch() {
        // torch.nn.functional.gelu(x, approximate="tanh") at 1, −1 and 3.
        let gu = [1.0f32, -1.0, 3.0, 2.0, 0.5, 1.0];
        let mut out = [0f32; 3];
        gelu_tanh_mul(&gu[..3], &gu[3..], &mut out);
        for (o, want) in out
            .iter()
            .zip([0.841_192 * 2.0, -0.158_808 * 0.5, 2.996_363])
        {
            assert!((o - want).abs() < 1e-5, "{o} vs {want}");
        }
    }
}
