//! `kura-text` — the text layer of a served model, without its weights: the tokenizer (GGUF vocabularies
//! and HF `tokenizer.json`, special tokens, byte-level and SentencePiece styles), the chat template
//! (minijinja, with special tokens kept out of message contents), the incremental detokenizer that
//! streams UTF-8 safely, and stop strings. [`ModelText`] loads all of it from a model file;
//! [`ModelCodec`] puts it behind the [`TextCodec`] seam the engine, the HTTP server and the router use.
//!
//! It links no kernels and no weights: `kura router` tokenizes requests exactly as `kura serve` does
//! with this crate alone.

pub mod chat;
mod codec;
pub mod error;
mod model_text;
mod stop;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate, CHATML, GEMMA3};
pub use codec::ModelCodec;
pub use error::TextError;
/// The seam the engine and the HTTP layer tokenize through (`kura-request`'s).
pub use kura_request::TextCodec;
pub use model_text::{default_template, gguf_model_spec, ModelText, TokenizerConfig};
pub use stop::{StopChecker, StopReason};

/// The most bytes read from a model's JSON files (`config.json`, `tokenizer.json`,
/// `tokenizer_config.json`): the largest tokenizers are tens of MB.
pub const MODEL_JSON_MAX_BYTES: u64 = 512 << 20;
pub use tokenizer::{IncrementalDecoder, Tokenizer};

/// Kura's cache folder: `$KURA_CACHE_DIR`, else `$XDG_CACHE_HOME/kura`, else `~/.cache/kura` (where the
/// scripts put the default model and test data).
pub fn cache_dir() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("KURA_CACHE_DIR") {
        return p.into();
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache")
        });
    base.join("kura")
}

/// The default model's path: `$KURA_MODEL`, else where `scripts/fetch-model.sh` puts it.
pub fn default_model_path() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("KURA_MODEL") {
        return p.into();
    }
    cache_dir()
        .join("models")
        .join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The default model's text, for tests: a missing model fails the test that asks for it.
#[cfg(test)]
pub(crate) fn test_model_text() -> ModelText {
    let path = default_model_path();
    assert!(
        path.exists(),
        "default model missing at {}: run scripts/fetch-model.sh (or set KURA_MODEL)",
        path.display()
    );
    ModelText::load(&path).unwrap()
}
