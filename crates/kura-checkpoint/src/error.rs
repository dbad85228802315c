//! Errors of loading and running a model. Every variant names what was wrong (a file, a key, a tensor).

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The cause is the error's source: `{:#}` prints it after the path.
    #[error("cannot read {path}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("metadata key '{key}' {what}")]
    BadValue { key: String, what: String },
    #[error("tensor '{name}' is missing")]
    MissingTensor { name: String },
    #[error("tensor '{name}' has shape {got:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tensor '{name}' has element type {dtype}, which is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)")]
    TensorType { name: String, dtype: String },
    #[error("tensor '{name}' lies outside the file (bytes {start}..{end}, file has {file_len})")]
    TensorBounds {
        name: String,
        start: u64,
        end: u64,
        file_len: u64,
    },
    #[error("architecture '{0}' is not supported (supported: llama, qwen2, mistral, gemma3 / gemma3_text)")]
    Architecture(String),
    #[error("invalid model configuration: {0}")]
    Config(String),
    #[error("{path}: {what}")]
    Format { path: PathBuf, what: String },
    #[error("forward: {0}")]
    Forward(String),
    #[error(transparent)]
    Gguf(#[from] kura_gguf::GgufError),
    #[error(transparent)]
    Text(#[from] kura_text::TextError),
    #[error(transparent)]
    Storage(#[from] kura_kv::storage::StorageError),
    #[error(transparent)]
    Layout(#[from] kura_kv::layout::LayoutError),
}

pub type Result<T> = std::result::Result<T, ModelError>;
