//! `kura-checkpoint` — a model checkpoint as every executor reads it, before any weight is loaded in a
//! compute format: its configuration ([`ModelConfig`], around `kura-shape`'s `ModelSpec`), the GGUF and
//! safetensors readers ([`gguf`], [`hf`]; every size and offset read from a file is checked), the ggml
//! formats dequantized to f32 ([`quant`]), the tensors by name ([`Naming`], [`TensorSource`]) with the
//! digest of their values that names a model's KV ([`WeightsDigest`]), and the file opened whole
//! ([`ModelParts`]: configuration, text layer, tensor source).
//!
//! The CPU runtime (`kura-model`) and the CUDA executor (`kura-cuda`) each load their weights from here
//! in their own format; neither links the other.

pub mod config;
pub mod error;
pub mod gguf;
pub mod hf;
pub mod parts;
pub mod quant;
pub mod tensors;

pub use config::ModelConfig;
pub use error::ModelError;
pub use parts::ModelParts;
pub use tensors::{Naming, RawTensor, TensorSource, WeightsDigest};
