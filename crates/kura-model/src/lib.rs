//! `kura-model` — Kura's model runtime on the CPU: loading (GGUF, HF safetensors directories), the
//! tokenizer and chat template, SIMD kernels chosen at run time, and the Llama-family and Gemma 3 forward
//! pass over the paged KV cache of `kura-kv`, behind the engine's executor seam ([`ModelExecutor`]).
//! Sampling is the engine's (`kura_engine::sampling`).
//!
//! The model owns no cache state: [`Model::forward`] takes a batch of sequences (new tokens, first
//! position, block table) and a [`kura_kv::storage::KvStorage`], writes the new tokens' K and V into their
//! blocks and returns the last position's logits of each sequence.

mod executor;
pub mod kernels;
pub mod model;
pub mod quant;
pub mod solo;
pub mod weights;

pub use executor::ModelExecutor;
/// The checkpoint side (configuration, file readers, tensors by name, the weights' digest) is
/// `kura-checkpoint`'s, re-exported for the runtime's users.
pub use kura_checkpoint::{config, error, gguf, hf, ModelConfig, ModelError, ModelParts};
/// The text layer (tokenizer, chat template, detokenizer, stop strings) is `kura-text`'s; re-exported
/// for the model's users.
pub use kura_text::{
    chat, tokenizer, ChatMessage, ChatTemplate, IncrementalDecoder, ModelText, StopChecker,
    StopReason, Tokenizer,
};
pub use model::{LoadOptions, Logits, Model, SeqBatchItem};
pub use solo::SoloRun;
pub use weights::{WeightsDigest, WeightsDtype};

/// Where the scripts put the default model and test data (`kura-text`'s, which loads it first).
pub use kura_text::{cache_dir, default_model_path};

/// Sets the number of threads of the compute pool (once, before the first forward pass). Its steps then
/// run on fewer of them while a core is busy with something else (`kernels::roster`).
pub fn set_threads(n: usize) -> Result<(), String> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .map_err(|e| e.to_string())?;
    kernels::roster::enable(n);
    Ok(())
}

/// Threads of the compute pool.
pub fn num_threads() -> usize {
    rayon::current_num_threads()
}
