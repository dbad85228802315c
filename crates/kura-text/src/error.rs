//! Errors of the text layer. Every variant names what was wrong (a file, a key, the tokenizer or the
//! template).

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// The cause is the error's source: `{:#}` prints it after the path.
    #[error("cannot read {path}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {what}")]
    Format { path: PathBuf, what: String },
    #[error("invalid model configuration: {0}")]
    Config(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error(transparent)]
    Gguf(#[from] kura_gguf::GgufError),
}

pub type Result<T> = std::result::Result<T, TextError>;
