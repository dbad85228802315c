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
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
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
