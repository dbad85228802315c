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
    /// A CUDA driver call failed; `fault` when the error leaves the CUDA context unusable (see
    /// [`CudaError::is_device_fault`]).
    #[error("CUDA driver: {message}")]
    Driver { message: String, fault: bool },
    /// A cuBLAS call failed; `fault` as for [`CudaError::Driver`].
    #[error("cuBLAS: {message}")]
    Blas { message: String, fault: bool },
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
    /// Host-tier loads that the engine already counts as landed (ordered loads are reported when they
    /// start) could be copied no way at all: the pool's blocks no longer hold what the engine recorded.
    /// Every later use of the executor's loads and steps answers this again.
    #[error(
        "host-tier loads into {blocks} block(s) could not be copied ({message}): the KV pool no longer \
         holds what the engine recorded"
    )]
    LoadsLost { blocks: usize, message: String },
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

impl CudaError {
    /// A driver error of Kura's own making (not a driver call's result): the context is as it was.
    pub fn driver(message: impl Into<String>) -> Self {
        CudaError::Driver {
            message: message.into(),
            fault: false,
        }
    }

    /// Whether the device can no longer be used by this process after this error: CUDA's "sticky"
    /// errors (an illegal address or instruction, a failed or timed-out launch, a device-side assert,
    /// an uncorrectable ECC or NVLink error, a destroyed context, ...), after which every later call
    /// returns an error and only a new process gets a working context; and cuBLAS's failures to run.
    /// Running out of device memory, a value the driver refuses and the like leave the context as it
    /// was.
    pub fn is_device_fault(&self) -> bool {
        matches!(
            self,
            CudaError::Driver { fault: true, .. } | CudaError::Blas { fault: true, .. }
        )
    }

    /// Whether the engine cannot go on after this error: a device fault, or a pool whose contents are
    /// no longer what the engine recorded ([`CudaError::LoadsLost`]).
    pub fn is_fatal(&self) -> bool {
        self.is_device_fault() || matches!(self, CudaError::LoadsLost { .. })
    }
}

/// Whether the CUDA context is unusable after `code`: the codes the driver API documents as "the
/// process must be terminated and relaunched", a device or context that is gone, and, to be safe, a
/// driver that is not initialised, a device unavailable and an unknown error.
fn driver_fault(code: cudarc::driver::sys::CUresult) -> bool {
    use cudarc::driver::sys::CUresult as R;
    matches!(
        code,
        R::CUDA_ERROR_ILLEGAL_ADDRESS
            | R::CUDA_ERROR_LAUNCH_FAILED
            | R::CUDA_ERROR_LAUNCH_TIMEOUT
            | R::CUDA_ERROR_HARDWARE_STACK_ERROR
            | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | R::CUDA_ERROR_MISALIGNED_ADDRESS
            | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | R::CUDA_ERROR_INVALID_PC
            | R::CUDA_ERROR_ASSERT
            | R::CUDA_ERROR_ECC_UNCORRECTABLE
            | R::CUDA_ERROR_NVLINK_UNCORRECTABLE
            | R::CUDA_ERROR_CONTEXT_IS_DESTROYED
            | R::CUDA_ERROR_DEINITIALIZED
            | R::CUDA_ERROR_NOT_INITIALIZED
            | R::CUDA_ERROR_DEVICE_UNAVAILABLE
            | R::CUDA_ERROR_EXTERNAL_DEVICE
            | R::CUDA_ERROR_CONTAINED
            | R::CUDA_ERROR_TENSOR_MEMORY_LEAK
            | R::CUDA_ERROR_MPS_CLIENT_TERMINATED
            | R::CUDA_ERROR_UNKNOWN
    )
}

impl CudaError {
    /// The error of a driver call that returned `code`, described by `message`.
    pub fn from_driver_code(code: cudarc::driver::sys::CUresult, message: String) -> Self {
        CudaError::Driver {
            message,
            fault: driver_fault(code),
        }
    }
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::from_driver_code(e.0, format!("{e:?}"))
    }
}

impl From<cudarc::cublas::result::CublasError> for CudaError {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        use cudarc::cublas::sys::cublasStatus_t as S;
        // A product that failed to run (a fault underneath it) or a library no longer initialised;
        // an allocation or a refused argument leaves the context as it was.
        let fault = matches!(
            e.0,
            S::CUBLAS_STATUS_EXECUTION_FAILED
                | S::CUBLAS_STATUS_INTERNAL_ERROR
                | S::CUBLAS_STATUS_NOT_INITIALIZED
        );
        CudaError::Blas {
            message: format!("{e:?}"),
            fault,
        }
    }
}

/// How the engine takes a CUDA error: a device fault ends it (every request fails, `kura serve`
/// exits so that a supervisor starts a new process), anything else fails the step's requests only.
impl From<CudaError> for kura_engine::ExecError {
    fn from(e: CudaError) -> Self {
        if e.is_fatal() {
            kura_engine::ExecError::Fatal(e.to_string())
        } else {
            kura_engine::ExecError::Step(e.to_string())
        }
    }
}

pub type Result<T> = std::result::Result<T, CudaError>;

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::cublas::result::CublasError;
    use cudarc::cublas::sys::cublasStatus_t as S;
    use cudarc::driver::sys::CUresult as R;
    use kura_engine::ExecError;

    /// The engine's reading of a driver error with `code` (built as `From<DriverError>` builds it; its
    /// text needs the driver, which this machine may lack).
    fn engine_reads(code: R) -> ExecError {
        CudaError::from_driver_code(code, format!("{code:?}")).into()
    }

    #[test]
    fn errors_that_leave_the_context_unusable_end_the_engine_and_others_fail_the_step() {
        for code in [
            R::CUDA_ERROR_ILLEGAL_ADDRESS,
            R::CUDA_ERROR_LAUNCH_FAILED,
            R::CUDA_ERROR_MISALIGNED_ADDRESS,
            R::CUDA_ERROR_ASSERT,
            R::CUDA_ERROR_ECC_UNCORRECTABLE,
            R::CUDA_ERROR_CONTEXT_IS_DESTROYED,
            R::CUDA_ERROR_CONTAINED,
            R::CUDA_ERROR_MPS_CLIENT_TERMINATED,
        ] {
            let e = engine_reads(code);
            assert_eq!(
                e,
                ExecError::Fatal(format!("CUDA driver: {code:?}")),
                "{code:?}"
            );
        }
        for code in [
            R::CUDA_ERROR_OUT_OF_MEMORY,
            R::CUDA_ERROR_INVALID_VALUE,
            R::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
            R::CUDA_ERROR_NOT_READY,
        ] {
            assert!(matches!(engine_reads(code), ExecError::Step(_)), "{code:?}");
        }
        let blas = |s: S| ExecError::from(CudaError::from(CublasError(s)));
        assert!(matches!(
            blas(S::CUBLAS_STATUS_EXECUTION_FAILED),
            ExecError::Fatal(m) if m.contains("EXECUTION_FAILED")
        ));
        assert!(matches!(
            blas(S::CUBLAS_STATUS_ALLOC_FAILED),
            ExecError::Step(_)
        ));
        // Kura's own refusals of a step, and its own driver-side messages, fail the step only.
        for e in [
            CudaError::Batch("a step of 0 tokens".into()),
            CudaError::driver("capturing a decode step gave no graph"),
        ] {
            let text = e.to_string();
            assert_eq!(ExecError::from(e), ExecError::Step(text));
        }
        // Loads the engine counts as landed, lost: the engine cannot go on.
        let lost = CudaError::LoadsLost {
            blocks: 3,
            message: "CUDA_ERROR_INVALID_VALUE".into(),
        };
        assert!(!lost.is_device_fault());
        let text = lost.to_string();
        assert!(
            text.contains("3 block(s)") && text.contains("INVALID_VALUE"),
            "{text}"
        );
        assert_eq!(ExecError::from(lost), ExecError::Fatal(text));
    }
}
