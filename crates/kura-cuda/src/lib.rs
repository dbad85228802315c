//! `kura-cuda` — Kura's CUDA executor: a Llama-family forward pass whose KV pool lives in device
//! memory, behind the engine's [`kura_engine::Executor`] seam (the scheduler, KV manager,
//! tiers and HTTP server are the CPU path's, unchanged).
//!
//! Nothing of CUDA is needed to build: cudarc loads the driver, NVRTC and cuBLAS at run time, and
//! [`libs`] checks for each first so that a machine without them gets an error naming what is missing.
//! The kernels are CUDA C ([`kernels::SOURCE`]), compiled by NVRTC once per device and cached on disk;
//! the weight products are cuBLAS (and a kernel of Kura's for decode batches of at most 8 tokens).

pub mod budget;
pub mod device;
pub mod error;
pub mod executor;
pub mod kernels;
pub mod libs;
pub mod weights;

pub use device::{parse_device, Device, GemvForm};
pub use error::{CudaError, Result};
pub use executor::{
    block_bytes, check_pool_format, CudaExecutor, DecodeOptions, DecodeTuning, FormTiming,
    OptionTiming, PoolSpec, PrefillKernel, PrefillProbe, PrefillTuning, Tuning, MAX_BLOCK_SIZE,
    TUNE_TOKENS,
};
pub use weights::DevWeights;
