//! Dot products of one weight row with up to [`MAX_GROUP`] activation vectors at once: the inner loop
//! of decode. The weight row is loaded (and, for bf16, widened to f32) once and multiplied into every
//! vector, so a batch of `n` tokens reads the weights once instead of `n` times.
//!
//! Variants, picked once at run time by [`Isa::detect`]: AVX-512F (16 lanes), AVX2+FMA (8 lanes), and a
//! portable scalar loop. bf16 widens exactly to f32 (a 16-bit shift), so every variant computes the same
//! products; only the summation order differs (≤ a few ulps).

use std::sync::OnceLock;

use half::bf16;

/// The most vectors one call handles.
pub const MAX_GROUP: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2Fma,
    Scalar,
}

impl Isa {
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            // `KURA_ISA` narrows the kernels: `scalar`, `avx2`, or `avx512` (AVX-512 without its
            // optional extensions: no `vdpbf16ps`, no AMX tiles).
            let forced = std::env::var("KURA_ISA").ok();
            if let Some(other) = forced
                .as_deref()
                .filter(|v| !["scalar", "avx2", "avx512"].contains(v))
            {
                tracing::warn!(
                    "KURA_ISA={other:?} is not a kernel set (scalar, avx2 or avx512): the kernels \
                     stay those the CPU has, less AVX-512's optional extensions"
                );
            }
            if forced.as_deref() == Some("scalar") {
                return Isa::Scalar;
            }
            #[cfg(target_arch = "x86_64")]
            {
                // `KURA_ISA=avx2` narrows to AVX2 on a CPU that has AVX-512; it never widens.
                if is_x86_feature_detected!("avx512f") && forced.as_deref() != Some("avx2") {
                    return Isa::Avx512;
                }
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    return Isa::Avx2Fma;
                }
            }
            Isa::Scalar
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2Fma => "avx2+fma",
            Isa::Scalar => "scalar",
        }
    }
}

/// A weight row element: f32 or bf16.
pub trait WeightElem: Copy + Send + Sync + 'static {
    /// Whether the kernels widen it to f32 (exactly) before multiplying.
    const WIDENED: bool;
    fn to_f32(self) -> f32;
    /// `out[j] = Σ_i w[i] · xs[j][i]` for `j < N`.
    fn dot_group<const N: usize>(isa: Isa, w: &[Self], xs: &[&[f32]; N]) -> [f32; N];
}

fn scalar_group<T: WeightElem, const N: usize>(w: &[T], xs: &[&[f32]; N]) -> [f32; N] {
    let mut acc = [[0f32; 8]; N];
    let chunks = w.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            let wi = w[c * 8 + l].to_f32();
            for j in 0..N {
                acc[j][l] += wi * xs[j][c * 8 + l];
            }
        }
    }
    let mut out = [0f32; N];
    for j in 0..N {
        let mut s: f32 = acc[j].iter().sum();
        for i in chunks * 8..w.len() {
            s += w[i].to_f32() * xs[j][i];
        }
        out[j] = s;
    }
    out
}

impl WeightElem for f32 {
    const WIDENED: bool = false;

    #[inline]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline]
    fn dot_group<const N: usize>(isa: Isa, w: &[f32], xs: &[&[f32]; N]) -> [f32; N] {
        debug_assert!(xs.iter().all(|x| x.len() >= w.len()));
        match isa {
            // SAFETY: `Isa::detect` returned this variant only after checking the CPU features, and every
            // x is at least as long as w (asserted by the callers, which slice them to the same length).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::dot_f32_avx512(w, xs) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => unsafe { x86::dot_f32_avx2(w, xs) },
            _ => scalar_group(w, xs),
        }
    }
}

impl WeightElem for bf16 {
    const WIDENED: bool = true;

    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }

    #[inline]
    fn dot_group<const N: usize>(isa: Isa, w: &[bf16], xs: &[&[f32]; N]) -> [f32; N] {
        debug_assert!(xs.iter().all(|x| x.len() >= w.len()));
        match isa {
            // SAFETY: the CPU features were checked by `Isa::detect`; lengths as for f32.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::dot_bf16_avx512(w, xs) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => unsafe { x86::dot_bf16_avx2(w, xs) },
            _ => scalar_group(w, xs),
        }
    }
}

/// A way to multiply a weight row of `T` into up to [`MAX_GROUP`] activation vectors of `X`.
pub trait GroupDot<T, X>: Sync {
    fn dot<const N: usize>(&self, w: &[T], xs: &[&[X]; N]) -> [f32; N];
}

/// f32 activations, any weight element, with the given instruction set.
pub struct F32Act(pub Isa);

impl<T: WeightElem> GroupDot<T, f32> for F32Act {
    #[inline]
    fn dot<const N: usize>(&self, w: &[T], xs: &[&[f32]; N]) -> [f32; N] {
        T::dot_group(self.0, w, xs)
    }
}

/// Proof that the CPU runs [`super::packed`]'s f32 kernel: AVX-512F, or AVX2 with FMA (as `KURA_ISA`
/// leaves them). Both give the same bits: one fused multiply-add chain per output lane, column after
/// column.
pub struct F32Panels(());

impl F32Panels {
    pub fn detect() -> Option<F32Panels> {
        (Isa::detect() != Isa::Scalar).then_some(F32Panels(()))
    }
}

/// Proof that the CPU has `vpdpbusd` on 512-bit vectors (AVX-512 VNNI, with AVX-512 BW for byte
/// operations): what the int8 attention kernel needs.
pub struct Vnni(());

impl Vnni {
    pub fn detect() -> Option<Vnni> {
        static HAS: OnceLock<bool> = OnceLock::new();
        let has = *HAS.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                Isa::detect() == Isa::Avx512
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                false
            }
        });
        has.then_some(Vnni(()))
    }
}

/// Proof that the CPU has `vdpbf16ps` (AVX-512 BF16): bf16 activations × bf16 weights, two products per
/// f32 lane per instruction (see [`super::packed`]). Exists only where the CPU has the instruction.
pub struct Bf16Act(());

impl Bf16Act {
    pub fn detect() -> Option<Bf16Act> {
        static HAS: OnceLock<bool> = OnceLock::new();
        let has = *HAS.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                Isa::detect() == Isa::Avx512
                    && std::env::var("KURA_ISA").is_err()
                    && is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                false
            }
        });
        has.then_some(Bf16Act(()))
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::bf16;

    use super::WeightElem;

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn widen_bf16_16(p: *const bf16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable bf16 at p.
        let raw = unsafe { _mm256_loadu_si256(p as *const __m256i) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn widen_bf16_8(p: *const bf16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable bf16 at p.
        let raw = unsafe { _mm_loadu_si128(p as *const __m128i) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)))
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn hsum256(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0x55>(s, s));
        _mm_cvtss_f32(s)
    }

    macro_rules! dot_kernel {
        ($name:ident, $elem:ty, $feat:literal, $lanes:expr, $vec:ty, $zero:ident, $fma:ident, $add:ident,
         $loadx:ident, $loadw:expr, $hsum:expr) => {
            /// # Safety
            /// The CPU supports the enabled features and every `xs[j]` holds at least `w.len()` elements.
            #[target_feature(enable = $feat)]
            pub unsafe fn $name<const N: usize>(w: &[$elem], xs: &[&[f32]; N]) -> [f32; N] {
                const L: usize = $lanes;
                let n = w.len();
                let wp = w.as_ptr();
                let mut acc0: [$vec; N] = [$zero(); N];
                let mut acc1: [$vec; N] = [$zero(); N];
                let mut i = 0;
                while i + 2 * L <= n {
                    // SAFETY: i + 2L ≤ n = w.len() ≤ xs[j].len().
                    unsafe {
                        let w0 = $loadw(wp.add(i));
                        let w1 = $loadw(wp.add(i + L));
                        for j in 0..N {
                            let xp = xs[j].as_ptr();
                            acc0[j] = $fma(w0, $loadx(xp.add(i)), acc0[j]);
                            acc1[j] = $fma(w1, $loadx(xp.add(i + L)), acc1[j]);
                        }
                    }
                    i += 2 * L;
                }
                if i + L <= n {
                    // SAFETY: i + L ≤ n.
                    unsafe {
                        let w0 = $loadw(wp.add(i));
                        for j in 0..N {
                            acc0[j] = $fma(w0, $loadx(xs[j].as_ptr().add(i)), acc0[j]);
                        }
                    }
                    i += L;
                }
                let mut out = [0f32; N];
                for j in 0..N {
                    let mut s = $hsum($add(acc0[j], acc1[j]));
                    for k in i..n {
                        s += WeightElem::to_f32(w[k]) * xs[j][k];
                    }
                    out[j] = s;
                }
                out
            }
        };
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn load_f32_512(p: *const f32) -> __m512 {
        // SAFETY: the caller guarantees 16 readable f32 at p.
        unsafe { _mm512_loadu_ps(p) }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn load_f32_256(p: *const f32) -> __m256 {
        // SAFETY: the caller guarantees 8 readable f32 at p.
        unsafe { _mm256_loadu_ps(p) }
    }

    dot_kernel!(
        dot_f32_avx512,
        f32,
        "avx512f",
        16,
        __m512,
        _mm512_setzero_ps,
        _mm512_fmadd_ps,
        _mm512_add_ps,
        load_f32_512,
        load_f32_512,
        _mm512_reduce_add_ps
    );
    dot_kernel!(
        dot_bf16_avx512,
        bf16,
        "avx512f",
        16,
        __m512,
        _mm512_setzero_ps,
        _mm512_fmadd_ps,
        _mm512_add_ps,
        load_f32_512,
        widen_bf16_16,
        _mm512_reduce_add_ps
    );
    dot_kernel!(
        dot_f32_avx2,
        f32,
        "avx2,fma",
        8,
        __m256,
        _mm256_setzero_ps,
        _mm256_fmadd_ps,
        _mm256_add_ps,
        load_f32_256,
        load_f32_256,
        hsum256
    );
    dot_kernel!(
        dot_bf16_avx2,
        bf16,
        "avx2,fma",
        8,
        __m256,
        _mm256_setzero_ps,
        _mm256_fmadd_ps,
        _mm256_add_ps,
        load_f32_256,
        widen_bf16_8,
        hsum256
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(w: &[f32], x: &[f32]) -> f32 {
        w.iter()
            .zip(x)
            .map(|(a, b)| (*a as f64) * (*b as f64))
            .sum::<f64>() as f32
    }

    #[test]
    fn every_isa_agrees_with_f64_reference_on_odd_lengths() {
        for n in [1usize, 7, 15, 16, 17, 31, 33, 64, 100, 576] {
            let w: Vec<f32> = (0..n).map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0).collect();
            let wb: Vec<bf16> = w.iter().map(|x| bf16::from_f32(*x)).collect();
            let x0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let x1: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let isas = [Isa::Scalar, Isa::Avx2Fma, Isa::Avx512]
                .into_iter()
                .filter(|&isa| crate::kernels::cpu_has(isa));
            for isa in isas {
                let got = f32::dot_group(isa, &w, &[&x0[..], &x1[..]]);
                assert!((got[0] - reference(&w, &x0)).abs() < 1e-4, "{isa:?} n={n}");
                assert!((got[1] - reference(&w, &x1)).abs() < 1e-4, "{isa:?} n={n}");
                // The weights are exact in bf16, so bf16 must give the same sums.
                let gb = bf16::dot_group(isa, &wb, &[&x0[..]]);
                assert!(
                    (gb[0] - reference(&w, &x0)).abs() < 1e-4,
                    "{isa:?} bf16 n={n}"
                );
            }
        }
    }
}
