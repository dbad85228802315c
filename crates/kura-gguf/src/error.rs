//! Errors of reading a GGUF file. Every variant names what was wrong: the file and byte offset, the key
//! or the tensor.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The cause is the error's source: `{:#}` prints it after the path.
    #[error("cannot read {path}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file: {what}")]
    NotGguf { path: PathBuf, what: String },
    #[error("{path}: GGUF version {version} is not supported (supported: 2, 3)")]
    GgufVersion { path: PathBuf, version: u32 },
    #[error("{path}: truncated or malformed GGUF at byte {offset}: {what}")]
    GgufMalformed {
        path: PathBuf,
        offset: u64,
        what: String,
    },
    #[error("metadata key '{key}' is missing")]
    MissingKey { key: String },
    #[error("metadata key '{key}' has the wrong type: expected {expected}")]
    KeyType { key: String, expected: &'static str },
    #[error("metadata key '{key}' {what}")]
    BadValue { key: String, what: String },
    #[error("tensor '{name}' is missing")]
    MissingTensor { name: String },
    #[error("tensor '{name}' has element type {dtype}, which is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)")]
    TensorType { name: String, dtype: String },
    #[error("tensor '{name}' lies outside the file (bytes {start}..{end}, file has {file_len})")]
    TensorBounds {
        name: String,
        start: u64,
        end: u64,
        file_len: u64,
    },
    #[error("{path}: {what}")]
    Format { path: PathBuf, what: String },
}

pub type Result<T> = std::result::Result<T, GgufError>;
