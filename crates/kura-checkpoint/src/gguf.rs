//! GGUF files as the runtime reads them: `kura-gguf`'s reader, with each tensor dequantized to f32
//! ([`tensor_f32`]) and the model configuration a file describes ([`parse_bytes`]).

pub use kura_gguf::{GgmlType, GgufError, GgufFile, TensorInfo, Value};

use crate::error::{ModelError, Result};
use crate::quant;

/// Parses a GGUF held in memory: header, metadata, tensor directory (every size and offset checked) and the
/// model configuration derived from them, tensor shapes included. Never panics, whatever the bytes; the
/// entry point for fuzzing. Errors name the file as `<memory>`.
pub fn parse_bytes(bytes: &[u8]) -> Result<(GgufFile, crate::config::ModelConfig)> {
    let file = GgufFile::from_bytes("<memory>", bytes.to_vec())?;
    let config = crate::config::ModelConfig::from_gguf(&file)?;
    Ok((file, config))
}

/// The tensor `name` of `g` dequantized to f32, in its stored order (innermost dimension contiguous).
pub fn tensor_f32(g: &GgufFile, name: &str) -> Result<Vec<f32>> {
    let (info, bytes) = g.tensor_bytes(name)?;
    let mut out = vec![0f32; info.n_elements()];
    quant::dequantize(info.dtype, bytes, &mut out).map_err(|what| ModelError::Format {
        path: g.path.clone(),
        what: format!("tensor '{name}': {what}"),
    })?;
    Ok(out)
}
