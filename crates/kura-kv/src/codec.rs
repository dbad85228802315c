//! Element formats of stored KV and their exact byte sizes.
//!
//! Every format stores a head's vector (`head_dim` elements of one token, one head, K or V) on its own, so
//! a quantisation group never straddles two heads or two tokens and a block's bytes are a whole multiple of
//! one vector's bytes. Quantised formats split the vector into groups of [`KvDtype::group_size`] elements,
//! each followed by its scale (and, for int4, its minimum), the layout of llama.cpp's `Q8_0` and `Q4_1`:
//!
//! ```text
//! int8, head_dim 64, group 32:  [32 × i8][f16 scale] [32 × i8][f16 scale]       = 2 × 34 = 68 bytes
//! int4, head_dim 64, group 32:  [16 B nibbles][f16 scale][f16 min] × 2          = 2 × 20 = 40 bytes
//! f16,  head_dim 64:            [64 × f16]                                       = 128 bytes
//! ```
//!
//! A vector whose length is not a multiple of the group ends in a short group that still carries a full
//! scale: `bytes_per_vector` counts it exactly. All functions are O(1).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The element format of stored K and V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    F32,
    F16,
    Bf16,
    /// fp8 e4m3 with one f32 scale per tensor (held outside the blocks, so 0 bytes per block).
    Fp8,
    /// int8 with one f16 scale per group of 32 elements.
    Int8,
    /// int4 with one f16 scale and one f16 minimum per group of 32 elements.
    Int4,
}

impl KvDtype {
    pub const ALL: [KvDtype; 6] = [
        KvDtype::F32,
        KvDtype::F16,
        KvDtype::Bf16,
        KvDtype::Fp8,
        KvDtype::Int8,
        KvDtype::Int4,
    ];

    /// Bits of one element's payload, scales not included.
    pub fn bits_per_element(self) -> usize {
        match self {
            KvDtype::F32 => 32,
            KvDtype::F16 | KvDtype::Bf16 => 16,
            KvDtype::Fp8 | KvDtype::Int8 => 8,
            KvDtype::Int4 => 4,
        }
    }

    /// Elements sharing one scale; `None` for formats without per-group scales.
    pub fn group_size(self) -> Option<usize> {
        match self {
            KvDtype::Int8 | KvDtype::Int4 => Some(32),
            _ => None,
        }
    }

    /// Bytes of scale (and minimum) stored after each group.
    pub fn scale_bytes_per_group(self) -> usize {
        match self {
            KvDtype::Int8 => 2,
            KvDtype::Int4 => 4,
            _ => 0,
        }
    }

    /// Exact bytes of one stored vector of `elements` elements, scales included.
    pub fn bytes_per_vector(self, elements: usize) -> usize {
        match self.group_size() {
            None => (elements * self.bits_per_element()).div_ceil(8),
            Some(group) => {
                let full = elements / group;
                let rest = elements % group;
                let group_bytes = |n: usize| {
                    (n * self.bits_per_element()).div_ceil(8) + self.scale_bytes_per_group()
                };
                full * group_bytes(group) + if rest > 0 { group_bytes(rest) } else { 0 }
            }
        }
    }

    /// Whether decoding a stored value gives back exactly what was written (for f32 activations).
    pub fn is_lossless(self) -> bool {
        self == KvDtype::F32
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8 => "fp8",
            KvDtype::Int8 => "int8",
            KvDtype::Int4 => "int4",
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A format name that is not one of [`KvDtype::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown KV element format '{given}': expected one of f32, f16, bf16, fp8, int8, int4")]
pub struct UnknownDtype {
    pub given: String,
}

impl FromStr for KvDtype {
    type Err = UnknownDtype;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => KvDtype::F32,
            "f16" | "fp16" | "float16" | "half" => KvDtype::F16,
            "bf16" | "bfloat16" => KvDtype::Bf16,
            "fp8" | "f8" | "fp8_e4m3" | "e4m3" => KvDtype::Fp8,
            "int8" | "i8" | "q8" | "q8_0" => KvDtype::Int8,
            "int4" | "i4" | "q4" | "q4_1" => KvDtype::Int4,
            _ => {
                return Err(UnknownDtype {
                    given: s.to_string(),
                })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_formats_are_elements_times_width() {
        assert_eq!(KvDtype::F32.bytes_per_vector(128), 512);
        assert_eq!(KvDtype::F16.bytes_per_vector(128), 256);
        assert_eq!(KvDtype::Bf16.bytes_per_vector(128), 256);
        assert_eq!(KvDtype::Fp8.bytes_per_vector(128), 128);
    }

    #[test]
    fn grouped_formats_count_scales_exactly() {
        // 128 = 4 groups of 32: int8 4 × (32 + 2), int4 4 × (16 + 4).
        assert_eq!(KvDtype::Int8.bytes_per_vector(128), 136);
        assert_eq!(KvDtype::Int4.bytes_per_vector(128), 80);
        // 80 = 2 full groups + a short group of 16 that still carries its scale.
        assert_eq!(KvDtype::Int8.bytes_per_vector(80), 2 * 34 + 16 + 2);
        assert_eq!(KvDtype::Int4.bytes_per_vector(80), 2 * 20 + 8 + 4);
    }

    #[test]
    fn narrower_formats_are_smaller() {
        for n in [31, 32, 64, 96, 128, 192, 256, 576] {
            let b = |d: KvDtype| d.bytes_per_vector(n);
            assert!(b(KvDtype::Int4) < b(KvDtype::Int8), "n = {n}");
            assert!(b(KvDtype::Int8) <= b(KvDtype::F16), "n = {n}");
            assert!(b(KvDtype::F16) < b(KvDtype::F32), "n = {n}");
        }
    }

    #[test]
    fn names_round_trip_and_unknown_is_named() {
        for d in KvDtype::ALL {
            assert_eq!(d.name().parse::<KvDtype>().unwrap(), d);
        }
        let err = "f12".parse::<KvDtype>().unwrap_err();
        assert!(err.to_string().contains("'f12'"));
    }
}
