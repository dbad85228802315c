//! Kura's CUDA C kernels (`kernels/kura.cu`), compiled by NVRTC for one architecture and cached on disk.
//!
//! A cubin is keyed by the digest of the source, the compile options, the architecture and NVRTC's
//! version: a change to any of them compiles anew, and a second start on the same device loads the
//! cubin without compiling. ptxas' resource report (registers, stack, spills per kernel) comes with
//! every compile; [`spills`] reads it, and the tests refuse any spill for sm_80 and sm_90.

use std::ffi::CString;
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use crate::error::{CudaError, Result};

/// The kernels' source.
pub const SOURCE: &str = include_str!("../kernels/kura.cu");

/// Options of every compile, beside the architecture and the include folder.
const OPTIONS: &[&str] = &["--std=c++17", "--ptxas-options=-v", "--fmad=true"];

/// A compiled module: the cubin and NVRTC's log (ptxas' report of each kernel).
#[derive(Debug, Clone)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    crate::libs::check_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::Compile {
            arch: String::new(),
            message: format!("nvrtcVersion: {e:?}"),
        })?;
    Ok((major, minor))
}

/// The folder holding `cuda_bf16.h`: `KURA_CUDA_INCLUDE`, else a CUDA toolkit's under /usr/local.
pub fn include_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("KURA_CUDA_INCLUDE") {
        let dir = PathBuf::from(dir);
        return if dir.join("cuda_bf16.h").is_file() {
            Ok(dir)
        } else {
            Err(CudaError::Compile {
                arch: String::new(),
                message: format!(
                    "KURA_CUDA_INCLUDE={} holds no cuda_bf16.h; point it at a CUDA include folder \
                     (scripts/fetch-nvrtc.sh prints one)",
                    dir.display()
                ),
            })
        };
    }
    let mut candidates = vec![PathBuf::from("/usr/local/cuda/include")];
    if let Ok(entries) = std::fs::read_dir("/usr/local") {
        let mut found: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("cuda"))
            })
            .flat_map(|p| {
                [
                    p.join("targets/x86_64-linux/include"),
                    p.join("targets/sbsa-linux/include"),
                    p.join("include"),
                ]
            })
            .collect();
        found.sort();
        candidates.extend(found.into_iter().rev());
    }
    candidates
        .into_iter()
        .find(|d| d.join("cuda_bf16.h").is_file())
        .ok_or_else(|| CudaError::Compile {
            arch: String::new(),
            message: "no folder with cuda_bf16.h under /usr/local/cuda*; set KURA_CUDA_INCLUDE to a CUDA \
                      include folder (scripts/fetch-nvrtc.sh fetches one)"
                .into(),
        })
}

/// Compiles [`SOURCE`] for `arch` (`sm_90`, …) with the headers of `include`.
pub fn compile(arch: &str, include: &Path) -> Result<Compiled> {
    compile_source(SOURCE, arch, include)
}

/// Compiles `source` (another version of the kernels, for experiments) as [`compile`] does.
pub fn compile_source(source: &str, arch: &str, include: &Path) -> Result<Compiled> {
    crate::libs::check_nvrtc()?;
    let err = |message: String| CudaError::Compile {
        arch: arch.to_string(),
        message,
    };
    let src = CString::new(source).map_err(|_| err("the source holds a NUL byte".into()))?;
    let prog = nvrtc::create_program(&src, Some(c"kura.cu"))
        .map_err(|e| err(format!("nvrtcCreateProgram: {e:?}")))?;
    let mut options: Vec<String> = vec![
        format!("--gpu-architecture={arch}"),
        format!("--include-path={}", include.display()),
    ];
    options.extend(OPTIONS.iter().map(|s| s.to_string()));
    // SAFETY: `prog` is a live program until destroyed below.
    let compiled = unsafe { nvrtc::compile_program(prog, &options) };
    // SAFETY: as above.
    let log = unsafe { nvrtc::get_program_log(prog) }
        .map(|chars| {
            let bytes: Vec<u8> = chars
                .iter()
                .map(|c| *c as u8)
                .take_while(|b| *b != 0)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default();
    let result = compiled
        .map_err(|e| err(format!("{e:?}:\n{log}")))
        .and_then(|()| {
            let mut size = 0usize;
            // SAFETY: a compiled program and a valid out-pointer.
            unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) }
                .result()
                .map_err(|e| err(format!("nvrtcGetCUBINSize: {e:?}")))?;
            let mut cubin = vec![0u8; size];
            // SAFETY: `cubin` holds the size NVRTC reported.
            unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }
                .result()
                .map_err(|e| err(format!("nvrtcGetCUBIN: {e:?}")))?;
            Ok(Compiled {
                cubin,
                log: log.clone(),
            })
        });
    // SAFETY: the program is not used after this.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

/// Kernels whose ptxas report in `log` shows spill stores or loads: `(kernel, report line)`.
pub fn spills(log: &str) -> Vec<(String, String)> {
    let mut kernel = String::new();
    let mut out = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            kernel = rest.split('\'').next().unwrap_or_default().to_string();
        } else if line.contains("spill stores")
            && !line.contains(" 0 bytes spill stores, 0 bytes spill loads")
        {
            out.push((kernel.clone(), line.trim().to_string()));
        }
    }
    out
}

/// Kernels named in `log`'s ptxas report.
pub fn kernels_reported(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|l| l.split("Compiling entry function '").nth(1))
        .filter_map(|r| r.split('\'').next())
        .map(str::to_string)
        .collect()
}

/// The cache key of [`SOURCE`] compiled for `arch` by NVRTC `version` (a hex digest).
pub fn cache_key(arch: &str, version: (i32, i32)) -> String {
    cache_key_of(SOURCE, arch, version)
}

/// The cache key of `source` compiled for `arch` by NVRTC `version`.
pub fn cache_key_of(source: &str, arch: &str, version: (i32, i32)) -> String {
    let mut h = blake3::Hasher::new();
    h.update(source.as_bytes());
    for o in OPTIONS {
        h.update(o.as_bytes());
        h.update(&[0]);
    }
    h.update(arch.as_bytes());
    h.update(&version.0.to_le_bytes());
    h.update(&version.1.to_le_bytes());
    h.finalize().to_hex()[..32].to_string()
}

/// Where cubins are kept: `<Kura's cache>/cuda-kernels`.
pub fn cache_dir() -> PathBuf {
    kura_text::cache_dir().join("cuda-kernels")
}

/// The cubin of [`SOURCE`] for `arch`: read from `dir` when a compile of the same key is there, else
/// compiled and written there (atomically: a half-written file is never read). Returns whether it was
/// compiled.
pub fn cubin_for(arch: &str, dir: &Path) -> Result<(Vec<u8>, bool)> {
    cubin_of(SOURCE, arch, dir)
}

/// [`cubin_for`] of another source (the cache's tests compile a small one).
pub fn cubin_of(source: &str, arch: &str, dir: &Path) -> Result<(Vec<u8>, bool)> {
    let path = cache_file(source, arch, dir)?;
    // Read only when a regular file of a cubin's size (a FIFO would block the start); a cubin is an
    // ELF file, and anything else (a damaged file) is compiled anew.
    if let Ok(bytes) = kura_files::read(&path, CUBIN_MAX_BYTES) {
        if bytes.starts_with(b"\x7fELF") {
            return Ok((bytes, false));
        }
    }
    Ok((compile_to_cache_of(source, arch, dir)?, true))
}

/// The cache's file for `source` compiled for `arch` by this NVRTC.
fn cache_file(source: &str, arch: &str, dir: &Path) -> Result<PathBuf> {
    let key = cache_key_of(source, arch, nvrtc_version()?);
    Ok(dir.join(format!("kura-{arch}-{key}.cubin")))
}

/// The most bytes read from a cached cubin (Kura's module is a few MB).
const CUBIN_MAX_BYTES: u64 = 256 << 20;

/// [`SOURCE`] compiled for `arch`, and the cache's file for it (re)written: atomically, its bytes
/// synced before the rename, so that a crash never leaves a half-written file under the cubin's name.
pub fn compile_to_cache(arch: &str, dir: &Path) -> Result<Vec<u8>> {
    compile_to_cache_of(SOURCE, arch, dir)
}

fn compile_to_cache_of(source: &str, arch: &str, dir: &Path) -> Result<Vec<u8>> {
    let path = cache_file(source, arch, dir)?;
    let compiled = compile_source(source, arch, &include_dir()?)?;
    for (kernel, line) in spills(&compiled.log) {
        tracing::warn!("kernel {kernel} spills registers on {arch}: {line}");
    }
    let cache_err = |source| CudaError::Cache {
        path: dir.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(cache_err)?;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("kura");
    let tmp = dir.join(format!(".{stem}.{}.tmp", std::process::id()));
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp).map_err(cache_err)?;
        f.write_all(&compiled.cubin).map_err(cache_err)?;
        f.sync_all().map_err(cache_err)?;
    }
    std::fs::rename(&tmp, &path).map_err(cache_err)?;
    Ok(compiled.cubin)
}
