//! The ggml formats as `native` weights keep them ([`crate::kernels::qpacked`]): a row of a block
//! format unpacked into `scale · u + min` records, or requantized to 8 bits where it has no exact form.
//! Dequantization to f32 is `kura-checkpoint`'s, re-exported here.

use half::f16;

pub use kura_checkpoint::quant::*;
use kura_gguf::{Q4K_BYTES, Q5K_BYTES, QK};

use crate::kernels::qpacked::{QBits, QRow};

/// The packed width `native` weights of type `ty` take ([`crate::kernels::qpacked`]): 4 bits for the
/// 4-bit formats, 8 for every other.
pub fn native_bits(ty: GgmlType) -> QBits {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4K => QBits::U4,
        _ => QBits::U8,
    }
}

/// One row of `ty` (`bytes`, whole blocks) as `u`, scale and offset per 32 columns, exactly: every
/// element is `scale · u + min` with the file's values (K-quant sub-block scales rounded to f16 when
/// packed). Returns false for types that have no such form (Q2_K, Q3_K, Q6_K and the float types).
pub fn unpack_row(ty: GgmlType, bytes: &[u8], row: &mut QRow) -> bool {
    let blocks = row.scale.len();
    let (u, scale, min) = (&mut row.u, &mut row.scale, &mut row.min);
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (_, size) = ty.block().expect("legacy quants have blocks");
            for (b, blk) in bytes.chunks_exact(size).enumerate().take(blocks) {
                let d = f16_at(blk, 0);
                let o = &mut u[b * QK..(b + 1) * QK];
                scale[b] = d;
                match ty {
                    GgmlType::Q8_0 => {
                        for (x, q) in o.iter_mut().zip(&blk[2..]) {
                            *x = (*q as i8 as i16 + 128) as u8;
                        }
                        min[b] = -128.0 * d;
                    }
                    GgmlType::Q4_0 | GgmlType::Q4_1 => {
                        let qs = &blk[size - QK / 2..];
                        for (j, q) in qs.iter().enumerate() {
                            o[j] = q & 0xF;
                            o[j + QK / 2] = q >> 4;
                        }
                        min[b] = if ty == GgmlType::Q4_0 {
                            -8.0 * d
                        } else {
                            f16_at(blk, 2)
                        };
                    }
                    _ => {
                        let at = if ty == GgmlType::Q5_0 { 2 } else { 4 };
                        let qh =
                            u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
                        for (j, q) in blk[at + 4..].iter().enumerate() {
                            (o[j], o[j + QK / 2]) = five_bits(*q, qh, j);
                        }
                        min[b] = if ty == GgmlType::Q5_0 {
                            -16.0 * d
                        } else {
                            f16_at(blk, 2)
                        };
                    }
                }
            }
            true
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let size = if ty == GgmlType::Q4K {
                Q4K_BYTES
            } else {
                Q5K_BYTES
            };
            for (sb, blk) in bytes.chunks_exact(size).enumerate().take(blocks / 8) {
                let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                let scales = &blk[4..16];
                let (qh, qs) = if ty == GgmlType::Q4K {
                    (&blk[0..0], &blk[16..])
                } else {
                    (&blk[16..48], &blk[48..])
                };
                for (c, q) in qs.chunks_exact(32).enumerate() {
                    for half in 0..2 {
                        let j = 2 * c + half;
                        let (sc, m) = scale_min_k4(j, scales);
                        let b = sb * 8 + j;
                        scale[b] = d * sc;
                        min[b] = -(dmin * m);
                        let o = &mut u[b * QK..(b + 1) * QK];
                        for l in 0..32 {
                            let low = if half == 0 { q[l] & 0xF } else { q[l] >> 4 };
                            let high = if qh.is_empty() || qh[l] & (1u8 << j) == 0 {
                                0
                            } else {
                                16
                            };
                            o[l] = low + high;
                        }
                    }
                }
            }
            true
        }
        _ => false,
    }
}

/// Quantizes a row of f32 values (whole blocks of 32) to 8-bit `u` with a symmetric scale per block
/// (llama.cpp's Q8_0 rule, `scale = max|x| / 127`, rounded to f16 first so that `u` is computed with the
/// scale the kernel will use): the form of types [`unpack_row`] has no exact form for.
pub fn requantize_row_u8(x: &[f32], row: &mut QRow) {
    for (b, xb) in x.chunks_exact(QK).enumerate() {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = f16::from_f32(amax / 127.0).to_f32();
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        for (o, v) in row.u[b * QK..(b + 1) * QK].iter_mut().zip(xb) {
            *o = ((v * inv).round() + 128.0).clamp(0.0, 255.0) as u8;
        }
        row.scale[b] = d;
        row.min[b] = -128.0 * d;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpacked_rows_give_the_dequantized_values_exactly() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/golden/quants.json");
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let mut cases: Vec<(GgmlType, Vec<u8>)> = golden
            .as_object()
            .unwrap()
            .values()
            .map(|case| {
                let hex = case["bytes"].as_str().unwrap();
                let bytes = (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                    .collect();
                (
                    GgmlType::from_id(case["id"].as_u64().unwrap() as u32),
                    bytes,
                )
            })
            .collect();
        // Legacy blocks of every sign and value.
        for (ty, extra) in [
            (GgmlType::Q4_0, 0),
            (GgmlType::Q4_1, 2),
            (GgmlType::Q8_0, 0),
        ] {
            let mut b = f16::from_f32(0.37).to_le_bytes().to_vec();
            if extra > 0 {
                b.extend_from_slice(&f16::from_f32(-1.25).to_le_bytes());
            }
            let n = if ty == GgmlType::Q8_0 { 32 } else { 16 };
            b.extend((0..n).map(|i| (i * 37 + 11) as u8));
            cases.push((ty, b));
        }
        let mut exact = 0;
        for (ty, bytes) in cases {
            let n = bytes.len() / ty.block().unwrap().1 * ty.block().unwrap().0;
            let mut want = vec![0f32; n];
            dequantize(ty, &bytes, &mut want).unwrap();
            let mut row = QRow::new(n);
            if !unpack_row(ty, &bytes, &mut row) {
                assert!(matches!(ty, GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q6K));
                continue;
            }
            exact += 1;
            for (i, w) in want.iter().enumerate() {
                let b = i / QK;
                assert!(row.u[i] <= native_bits(ty).max_value(), "{}", ty.name());
                assert_eq!(
                    row.scale[b] * f32::from(row.u[i]) + row.min[b],
                    *w,
                    "{} element {i}",
                    ty.name()
                );
            }
        }
        assert_eq!(exact, 7, "Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K and Q5_K");
    }

    #[test]
    fn requantized_rows_stay_within_half_a_step() {
        let x: Vec<f32> = (0..64).map(|i| ((i as f32) * 0.7).sin() * 3.0).collect();
        let mut row = QRow::new(64);
        requantize_row_u8(&x, &mut row);
        for (i, v) in x.iter().enumerate() {
            let b = i / QK;
            let back = row.scale[b] * f32::from(row.u[i]) + row.min[b];
            assert!(
                (back - v).abs() <= row.scale[b] / 2.0 + 1e-6,
                "{i}: {back} vs {v}"
            );
        }
    }
}
