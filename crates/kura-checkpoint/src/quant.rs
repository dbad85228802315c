//! ggml element types and their dequantization to f32 (done once, at load).
//!
//! Block formats, 32 elements per block (ggml's `QK4_0 = QK4_1 = QK8_0 = 32`):
//!
//! ```text
//! Q8_0: [d: f16][q: 32 × i8]                       x[i] = q[i] × d
//! Q4_0: [d: f16][qs: 16 bytes]                     x[i] = (nibble(i) − 8) × d
//! Q4_1: [d: f16][m: f16][qs: 16 bytes]             x[i] = nibble(i) × d + m
//! Q5_0: [d: f16][qh: u32][qs: 16 bytes]            x[i] = (nibble(i) | bit(i) << 4 − 16) × d
//! Q5_1: [d: f16][m: f16][qh: u32][qs: 16 bytes]    x[i] = (nibble(i) | bit(i) << 4) × d + m
//! nibble(i) = qs[i] & 0xF for i < 16, qs[i − 16] >> 4 for i ≥ 16; bit(i) = (qh >> i) & 1
//! ```
//!
//! K-quants (llama.cpp's `Q*_K`, what `Q4_K_M` and friends are made of) use super-blocks of 256 elements
//! in 16 or 8 sub-blocks, each with its own small integer scale (and minimum) times the super-block's f16
//! `d` (and `dmin`):
//!
//! ```text
//! Q2_K  84 B: [scales: 16 × (4-bit scale | 4-bit min)][qs: 2-bit × 256][d][dmin]
//! Q3_K 110 B: [hmask: high bits][qs: low 2 bits][scales: 16 × 6-bit, packed in 12 B][d]
//! Q4_K 144 B: [d][dmin][scales: 8 × (6-bit scale, 6-bit min), packed in 12 B][qs: 4-bit × 256]
//! Q5_K 176 B: [d][dmin][scales as Q4_K][qh: 5th bits][qs: low 4 bits]
//! Q6_K 210 B: [ql: low 4 bits][qh: high 2 bits][scales: 16 × i8][d]
//! ```
//!
//! The element order within a super-block follows ggml's `dequantize_row_q*_K` exactly (checked against
//! the `gguf` Python package's reference in `tests/data/golden/kquants.json`). O(elements), no allocation.

use half::{bf16, f16};

pub use kura_gguf::GgmlType;
use kura_gguf::{Q2K_BYTES, Q3K_BYTES, Q4K_BYTES, Q5K_BYTES, Q6K_BYTES, QK, QK_K};

/// The f16 at byte `i` of `b`, as f32.
pub fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes `bytes` of type `ty` into `out` (whose length is the element count).
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
    let n = out.len();
    match ty.byte_size(n) {
        Some(len) if len == bytes.len() => {}
        Some(len) => {
            return Err(format!(
                "{} bytes for {n} {} elements, expected {len}",
                bytes.len(),
                ty.name()
            ))
        }
        None => return Err(format!("{n} elements cannot be stored as {}", ty.name())),
    }
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Bf16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(2 + QK)) {
                let d = f16_at(b, 0);
                for (x, q) in o.iter_mut().zip(&b[2..]) {
                    *x = (*q as i8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(2 + QK / 2)) {
                let d = f16_at(b, 0);
                for (j, q) in b[2..].iter().enumerate() {
                    o[j] = ((q & 0xF) as i32 - 8) as f32 * d;
                    o[j + QK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(4 + QK / 2)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for (j, q) in b[4..].iter().enumerate() {
                    o[j] = (q & 0xF) as f32 * d + m;
                    o[j + QK / 2] = (q >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q5_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(6 + QK / 2)) {
                let d = f16_at(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for (j, q) in b[6..].iter().enumerate() {
                    let (lo, hi) = five_bits(*q, qh, j);
                    o[j] = (lo as i32 - 16) as f32 * d;
                    o[j + QK / 2] = (hi as i32 - 16) as f32 * d;
                }
            }
        }
        GgmlType::Q5_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(8 + QK / 2)) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
                for (j, q) in b[8..].iter().enumerate() {
                    let (lo, hi) = five_bits(*q, qh, j);
                    o[j] = lo as f32 * d + m;
                    o[j + QK / 2] = hi as f32 * d + m;
                }
            }
        }
        GgmlType::Q2K => super_blocks(bytes, out, Q2K_BYTES, q2_k),
        GgmlType::Q3K => super_blocks(bytes, out, Q3K_BYTES, q3_k),
        GgmlType::Q4K => super_blocks(bytes, out, Q4K_BYTES, q4_k),
        GgmlType::Q5K => super_blocks(bytes, out, Q5K_BYTES, q5_k),
        GgmlType::Q6K => super_blocks(bytes, out, Q6K_BYTES, q6_k),
        // byte_size returned None for it above; an error keeps this path panic-free all the same.
        GgmlType::Other(_) => return Err(format!("{} is not supported", ty.name())),
    }
    Ok(())
}

/// Whether `ty` is a block format (a quantized type), as opposed to a float type.
pub fn is_block_format(ty: GgmlType) -> bool {
    !matches!(
        ty,
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 | GgmlType::Other(_)
    )
}

/// The 5-bit values of elements `j` and `j + 16` of a Q5 block: nibbles of `q`, fifth bits from `qh`.
pub fn five_bits(q: u8, qh: u32, j: usize) -> (u8, u8) {
    let h0 = ((qh >> j) & 1) as u8;
    let h1 = ((qh >> (j + 16)) & 1) as u8;
    ((q & 0xF) | (h0 << 4), (q >> 4) | (h1 << 4))
}

fn super_blocks(bytes: &[u8], out: &mut [f32], size: usize, f: fn(&[u8], &mut [f32])) {
    for (o, b) in out.chunks_exact_mut(QK_K).zip(bytes.chunks_exact(size)) {
        f(b, o);
    }
}

fn q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[..16], &b[16..80]);
    let (d, min) = (f16_at(b, 80), f16_at(b, 82));
    let mut i = 0;
    for (half, q) in qs.chunks_exact(32).enumerate() {
        for j in 0..4 {
            let shift = 2 * j;
            for part in 0..2 {
                let sc = scales[half * 8 + j * 2 + part];
                let (dl, ml) = (d * (sc & 0xF) as f32, min * (sc >> 4) as f32);
                for l in 0..16 {
                    y[i] = dl * ((q[part * 16 + l] >> shift) & 3) as f32 - ml;
                    i += 1;
                }
            }
        }
    }
}

fn q3_k(b: &[u8], y: &mut [f32]) {
    let (hmask, qs, packed) = (&b[..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    // 16 six-bit scales: low 4 bits in bytes 0..8 (two per byte), high 2 bits in bytes 8..12.
    let scale = |k: usize| -> f32 {
        let low = (packed[k % 8] >> (4 * (k / 8))) & 0xF;
        let high = (packed[8 + k % 4] >> (2 * (k / 4))) & 3;
        ((low | (high << 4)) as i32 - 32) as f32
    };
    let mut i = 0;
    let mut k = 0;
    let mut m = 1u8;
    for q in qs.chunks_exact(32) {
        for j in 0..4 {
            let shift = 2 * j;
            for part in 0..2 {
                let dl = d * scale(k);
                k += 1;
                for l in 0..16 {
                    let at = part * 16 + l;
                    let low = ((q[at] >> shift) & 3) as i32;
                    let high = if hmask[at] & m != 0 { 0 } else { 4 };
                    y[i] = dl * (low - high) as f32;
                    i += 1;
                }
            }
            m = m.wrapping_shl(1);
        }
    }
}

/// Scale and minimum `j` (0..8) of a Q4_K/Q5_K block's 12 packed bytes (ggml's `get_scale_min_k4`).
pub fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    };
    (sc as f32, m as f32)
}

fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..]);
    for (c, (q, o)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (s1, m1) = scale_min_k4(2 * c, scales);
        let (s2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1, d2, m2) = (d * s1, min * m1, d * s2, min * m2);
        for l in 0..32 {
            o[l] = d1 * (q[l] & 0xF) as f32 - m1;
            o[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..]);
    for (c, (q, o)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (s1, m1) = scale_min_k4(2 * c, scales);
        let (s2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1, d2, m2) = (d * s1, min * m1, d * s2, min * m2);
        let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            o[l] = d1 * ((q[l] & 0xF) + h1) as f32 - m1;
            o[l + 32] = d2 * ((q[l] >> 4) + h2) as f32 - m2;
        }
    }
}

fn q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (n, o) in y.chunks_exact_mut(128).enumerate() {
        let (ql, qh, sc) = (&ql[n * 64..], &qh[n * 32..], &sc[n * 8..]);
        for l in 0..32 {
            let is = l / 16;
            let q = |low: u8, high_shift: u32| -> f32 {
                ((low | (((qh[l] >> high_shift) & 3) << 4)) as i32 - 32) as f32
            };
            let s = |k: usize| sc[is + k] as i8 as f32;
            o[l] = d * s(0) * q(ql[l] & 0xF, 0);
            o[l + 32] = d * s(2) * q(ql[l + 32] & 0xF, 2);
            o[l + 64] = d * s(4) * q(ql[l] >> 4, 4);
            o[l + 96] = d * s(6) * q(ql[l + 32] >> 4, 6);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_block_matches_hand_computation() {
        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b.extend_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_1, &b, &mut out).unwrap();
        assert_eq!(out[0], -1.0);
        assert_eq!(out[3], 0.5);
        assert_eq!(out[16], 15.0 * 0.5 - 1.0);
        assert_eq!(out[31], -1.0);
    }

    #[test]
    fn q4_0_and_q8_0_are_signed() {
        let mut b = f16::from_f32(2.0).to_le_bytes().to_vec();
        b.extend(std::iter::repeat_n(0x80u8, 16));
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_0, &b, &mut out).unwrap();
        assert_eq!(out[0], -16.0);
        assert_eq!(out[16], 0.0);
        let mut b = f16::from_f32(0.25).to_le_bytes().to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        dequantize(GgmlType::Q8_0, &b, &mut out).unwrap();
        assert_eq!(out[0], -4.0);
        assert_eq!(out[31], 15.0 * 0.25);
    }

    #[test]
    fn q5_and_k_quants_match_the_reference_dequantizer() {
        // Seeded random super-blocks and their values from the `gguf` package's reference
        // (scripts/golden/make_quants.py).
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../kura-model/tests/data/golden/quants.json"
        );
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let cases = golden.as_object().unwrap();
        assert_eq!(cases.len(), 7);
        for (name, case) in cases {
            let ty = GgmlType::from_id(case["id"].as_u64().unwrap() as u32);
            assert_eq!(&ty.name(), name);
            let hex = case["bytes"].as_str().unwrap();
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            let want: Vec<f32> = case["values"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            let mut out = vec![0f32; want.len()];
            dequantize(ty, &bytes, &mut out).unwrap();
            for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                    "{name} element {i}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn wrong_sizes_are_errors() {
        let mut out = [0f32; 31];
        assert!(dequantize(GgmlType::Q8_0, &[0; 34], &mut out).is_err());
        let mut out = [0f32; 32];
        assert!(dequantize(GgmlType::Q8_0, &[0; 33], &mut out).is_err());
        assert!(dequantize(GgmlType::Other(16), &[], &mut out).is_err());
        // K-quants hold whole super-blocks of 256.
        assert!(dequantize(GgmlType::Q4K, &[0; 144], &mut out).is_err());
    }
}
