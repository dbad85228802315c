//! ggml element types and their dequantization to f32 (done once, at load).
//!
//! Block formats, 32 elements per block (ggml's `QK4_0 = QK4_1 = QK8_0 = 32`):
//!
//! ```text
//! Q8_0: [d: f16][q: 32 × i8]                       x[i] = q[i] × d
//! Q4_0: [d: f16][qs: 16 bytes]                     x[i] = (nibble(i) − 8) × d
//! Q4_1: [d: f16][m: f16][qs: 16 bytes]             x[i] = nibble(i) × d + m
//! nibble(i) = qs[i] & 0xF for i < 16, qs[i − 16] >> 4 for i ≥ 16
//! ```
//!
//! O(elements), no allocation.

use half::{bf16, f16};

/// A ggml tensor element type, by its GGUF id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q8_0,
    Other(u32),
}

const QK: usize = 32;

impl GgmlType {
    pub fn from_id(id: u32) -> Self {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            30 => GgmlType::Bf16,
            other => GgmlType::Other(other),
        }
    }

    pub fn name(self) -> String {
        match self {
            GgmlType::F32 => "F32".into(),
            GgmlType::F16 => "F16".into(),
            GgmlType::Bf16 => "BF16".into(),
            GgmlType::Q4_0 => "Q4_0".into(),
            GgmlType::Q4_1 => "Q4_1".into(),
            GgmlType::Q8_0 => "Q8_0".into(),
            GgmlType::Other(id) => format!("ggml type {id}"),
        }
    }

    /// Bytes of `n` elements; `None` for unsupported types or a count that is not whole blocks.
    pub fn byte_size(self, n: usize) -> Option<usize> {
        let blocks =
            |bytes_per_block: usize| n.is_multiple_of(QK).then_some(n / QK * bytes_per_block);
        match self {
            GgmlType::F32 => Some(n * 4),
            GgmlType::F16 | GgmlType::Bf16 => Some(n * 2),
            GgmlType::Q8_0 => blocks(2 + QK),
            GgmlType::Q4_0 => blocks(2 + QK / 2),
            GgmlType::Q4_1 => blocks(4 + QK / 2),
            GgmlType::Other(_) => None,
        }
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
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
        GgmlType::Other(_) => unreachable!("byte_size rejected it"),
    }
    Ok(())
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
    fn wrong_sizes_are_errors() {
        let mut out = [0f32; 31];
        assert!(dequantize(GgmlType::Q8_0, &[0; 34], &mut out).is_err());
        let mut out = [0f32; 32];
        assert!(dequantize(GgmlType::Q8_0, &[0; 33], &mut out).is_err());
        assert!(dequantize(GgmlType::Other(12), &[], &mut out).is_err());
    }
}
