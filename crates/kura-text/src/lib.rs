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
pub use model_text::{default_template, ModelText, TokenizerConfig};
pub use stop::{StopChecker, StopReason};
pub use tokenizer::{IncrementalDecoder, Tokenizer};

/// The default model's text, for tests: `$KURA_MODEL` (set by `scripts/test.sh`), or the path
/// `scripts/fetch-model.sh` uses. A missing model fails the test that asks for it.
#[cfg(test)]
pub(crate) fn test_model_text() -> ModelText {
    let path = std::env::var_os("KURA_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").unwrap_or_default();
            std::path::PathBuf::from(home)
                .join(".cache/kura/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        path.exists(),
        "default model missing at {}: run scripts/fetch-model.sh (or set KURA_MODEL)",
        path.display()
    );
    ModelText::load(&path).unwrap()
}
