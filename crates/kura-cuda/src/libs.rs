//! Finding CUDA's libraries at run time. cudarc loads the driver, NVRTC and cuBLAS when first used and
//! panics when one is missing; Kura looks for each first and answers with an error that says what to
//! install instead.
//!
//! NVRTC may come from a toolkit on the library path or from PyPI (`scripts/fetch-nvrtc.sh`, whose
//! folder `KURA_NVRTC_LIB` names): that `libnvrtc` opens its builtins library by bare name, so both are
//! loaded here first, by path, and stay loaded.

use std::sync::OnceLock;

use libloading::Library;

use crate::error::{CudaError, Result};

/// Loads the first of cudarc's candidate names for `lib` that opens.
fn open_any(lib: &str) -> Option<Library> {
    cudarc::get_lib_name_candidates(lib)
        .iter()
        // SAFETY: loading a CUDA library runs only its initialisers, which have no preconditions.
        .find_map(|name| unsafe { Library::new(name) }.ok())
}

/// The libraries of `KURA_NVRTC_LIB`, loaded for the life of the process.
fn preload_nvrtc() -> &'static Vec<Library> {
    static LIBS: OnceLock<Vec<Library>> = OnceLock::new();
    LIBS.get_or_init(|| {
        let Some(dir) = std::env::var_os("KURA_NVRTC_LIB") else {
            return Vec::new();
        };
        let dir = std::path::PathBuf::from(dir);
        ["libnvrtc-builtins.so.13.0", "libnvrtc.so.13"]
            .iter()
            .filter_map(|f| {
                let path = dir.join(f);
                // SAFETY: as in `open_any`. RTLD_GLOBAL: later lookups by soname find these.
                unsafe {
                    libloading::os::unix::Library::open(
                        Some(&path),
                        libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                    )
                }
                .ok()
                .map(Library::from)
            })
            .collect()
    })
}

/// NVRTC, the run-time compiler of Kura's kernels.
pub fn check_nvrtc() -> Result<()> {
    preload_nvrtc();
    open_any("nvrtc").map(drop).ok_or(CudaError::NoLibrary {
        what: "NVRTC, CUDA's run-time compiler",
        lib: "libnvrtc.so".into(),
        hint: "install the CUDA toolkit and put its lib64 folder on LD_LIBRARY_PATH, or run \
               scripts/fetch-nvrtc.sh and set KURA_NVRTC_LIB to the folder it prints",
    })
}

/// Whether the driver has `cuMemcpyBatchAsync_v2` (CUDA 13): many copies in one call, which host-tier
/// loads ordered layer by layer need (one call a layer for every block). cudarc would panic on a missing
/// symbol; without it, loads are whole-block copies.
pub fn has_batch_copies() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        open_any("cuda").is_some_and(|lib| {
            // SAFETY: looking a symbol up runs nothing; it is not called through this pointer.
            unsafe { lib.get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync_v2\0") }.is_ok()
        })
    })
}

/// The driver, NVRTC and cuBLAS: everything the executor loads.
pub fn check_all() -> Result<()> {
    open_any("cuda").map(drop).ok_or(CudaError::NoLibrary {
        what: "the NVIDIA driver",
        lib: "libcuda.so".into(),
        hint: "this machine has no NVIDIA driver; install one, or run with --device cpu",
    })?;
    check_nvrtc()?;
    open_any("cublas").map(drop).ok_or(CudaError::NoLibrary {
        what: "cuBLAS",
        lib: "libcublas.so".into(),
        hint: "install the CUDA toolkit's cuBLAS and put its folder on LD_LIBRARY_PATH",
    })?;
    Ok(())
}
