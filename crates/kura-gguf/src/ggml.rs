//! The ggml element types a GGUF tensor may have, by their GGUF ids, and the bytes of their blocks.

/// A ggml tensor element type, by its GGUF id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Other(u32),
}

pub const QK: usize = 32;
/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

impl GgmlType {
    pub fn from_id(id: u32) -> Self {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
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
            GgmlType::Q5_0 => "Q5_0".into(),
            GgmlType::Q5_1 => "Q5_1".into(),
            GgmlType::Q8_0 => "Q8_0".into(),
            GgmlType::Q2K => "Q2_K".into(),
            GgmlType::Q3K => "Q3_K".into(),
            GgmlType::Q4K => "Q4_K".into(),
            GgmlType::Q5K => "Q5_K".into(),
            GgmlType::Q6K => "Q6_K".into(),
            GgmlType::Other(id) => format!("ggml type {id}"),
        }
    }

    /// `(elements, bytes)` of one block: a single element for the plain float types, 32 elements for the
    /// legacy quants, 256 for the K-quants; `None` for unsupported types.
    pub fn block(self) -> Option<(usize, usize)> {
        Some(match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q8_0 => (QK, 2 + QK),
            GgmlType::Q4_0 => (QK, 2 + QK / 2),
            GgmlType::Q4_1 => (QK, 4 + QK / 2),
            GgmlType::Q5_0 => (QK, 6 + QK / 2),
            GgmlType::Q5_1 => (QK, 8 + QK / 2),
            GgmlType::Q2K => (QK_K, Q2K_BYTES),
            GgmlType::Q3K => (QK_K, Q3K_BYTES),
            GgmlType::Q4K => (QK_K, Q4K_BYTES),
            GgmlType::Q5K => (QK_K, Q5K_BYTES),
            GgmlType::Q6K => (QK_K, Q6K_BYTES),
            GgmlType::Other(_) => return None,
        })
    }

    /// Bytes of `n` elements; `None` for unsupported types, a count that is not whole blocks, or a size
    /// beyond `usize` (counts come from files, so the product is checked).
    pub fn byte_size(self, n: usize) -> Option<usize> {
        let (elems, bytes) = self.block()?;
        if !n.is_multiple_of(elems) {
            return None;
        }
        (n / elems).checked_mul(bytes)
    }
}

/// Bytes of one K-quant super-block of 256 elements.
pub const Q2K_BYTES: usize = QK_K / 16 + QK_K / 4 + 4;
pub const Q3K_BYTES: usize = QK_K / 8 + QK_K / 4 + 12 + 2;
pub const Q4K_BYTES: usize = 4 + 12 + QK_K / 2;
pub const Q5K_BYTES: usize = 4 + 12 + QK_K / 8 + QK_K / 2;
pub const Q6K_BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;
