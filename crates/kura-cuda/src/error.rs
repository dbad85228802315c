//! What can go wrong on the CUDA path, each naming what is missing or what to change.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum CudaError {
    /// A CUDA library could not be loaded (no driver, no toolkit on the library path).
    #[error("{what} ({lib}) could not be loaded: {hint}")]
    NoLibrary {
        what: &'static str,
        lib: String,
        hint: &'static str,
    },
    #[error("no CUDA device {ordinal}: {found}")]
    NoDevice { ordinal: usize, found: String },
    #[error(
        "CUDA device {ordinal} ({name}) has compute capability {major}.{minor}; Kura's kernels need 8.0 or later \
         (Ampere, Ada, Hopper, Blackwell)"
    )]
    Architecture {
        ordinal: usize,
        name: String,
        major: i32,
        minor: i32,
    },
    #[error("CUDA driver: {0}")]
    Driver(String),
    #[error("cuBLAS: {0}")]
    Blas(String),
    #[error("compiling Kura's kernels with NVRTC for {arch}: {message}")]
    Compile { arch: String, message: String },
    #[error("not enough device memory: {what} needs {need} bytes, {free} are free on the device")]
    OutOfMemory {
        what: String,
        need: usize,
        free: usize,
    },
    #[error("the CUDA executor does not run this model: {0}")]
    Unsupported(String),
    #[error("forward step: {0}")]
    Batch(String),
    #[error(transparent)]
    Model(#[from] kura_checkpoint::ModelError),
    #[error("kernel cache {path}: {source}")]
    Cache {
        path: String,
        source: std::io::Error,
    },
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(format!("{e:?}"))
    }
}

impl From<cudarc::cublas::result::CublasError> for CudaError {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        CudaError::Blas(format!("{e:?}"))
    }
}

pub type Result<T> = std::result::Result<T, CudaError>;
