//! Every kernel compiles with NVRTC for sm_80 and sm_90a with no register spills, on a machine with no
//! GPU: NVRTC and the CUDA headers come from PyPI (`scripts/fetch-nvrtc.sh`; `scripts/test.sh` sets
//! `KURA_NVRTC_LIB` and `KURA_CUDA_INCLUDE`). A missing NVRTC fails these tests.

use kura_cuda::device::{in_module, kernel_names};
use kura_cuda::kernels;

/// A kernel that compiles in a moment, for the cache's test.
const SMALL: &str = "extern \"C\" __global__ void add_one(float* x) { x[threadIdx.x] += 1.f; }\n";

// One test an architecture: the two compiles (the longest of these tests) run at once.
#[test]
fn every_kernel_compiles_for_ampere_without_spills() {
    every_kernel_compiles_without_spills("sm_80");
}

#[test]
fn every_kernel_compiles_for_hopper_without_spills() {
    // Compute capability 9.0's module is compiled for sm_90a (its warpgroup products).
    every_kernel_compiles_without_spills(kura_cuda::device::compile_arch("sm_90"));
}

fn every_kernel_compiles_without_spills(arch: &str) {
    let include = kernels::include_dir().expect("CUDA headers (run scripts/fetch-nvrtc.sh)");
    let version = kernels::nvrtc_version().expect("NVRTC (run scripts/fetch-nvrtc.sh)");
    assert!(version.0 >= 12, "NVRTC {version:?}");
    let c = kernels::compile(arch, &include).unwrap_or_else(|e| panic!("{e}"));
    assert!(c.cubin.starts_with(b"\x7fELF"), "{arch}: not a cubin");
    let reported = kernels::kernels_reported(&c.log);
    for k in kernel_names() {
        // The prefill forms on warpgroup products are in sm_90a's module only.
        assert_eq!(
            reported.iter().any(|r| r == &k),
            in_module(&k, arch),
            "{arch}: kernel {k} in ptxas' report: {}; in the module: {}\n{}",
            reported.iter().any(|r| r == &k),
            in_module(&k, arch),
            c.log
        );
    }
    let spills = kernels::spills(&c.log);
    assert!(
        spills.is_empty(),
        "{arch}: kernels spill: {spills:?}\n{}",
        c.log
    );
    // Each kernel's registers and shared memory, for the record (`cargo test -- --nocapture`).
    let mut kernel = "";
    for line in c.log.lines() {
        if let Some(name) = line.split("Function properties for ").nth(1) {
            kernel = name.trim();
        } else if line.contains("registers") {
            let used = line.split("Used ").nth(1).unwrap_or(line).trim();
            println!("{arch}: {kernel}: {used}");
        }
    }
}

#[test]
fn the_kernel_cache_compiles_once_and_then_reads() {
    let dir = std::env::temp_dir().join(format!("kura-kcache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // A small source, compiled in a moment: the cache's logic is `cubin_for`'s for Kura's kernels (whose
    // compiles, the longest of these tests, the tests above run once an architecture).
    let cached = |arch: &str, dir: &std::path::Path| kernels::cubin_of(SMALL, arch, dir);
    let (first, compiled) = cached("sm_90", &dir).unwrap_or_else(|e| panic!("{e}"));
    assert!(compiled, "an empty cache compiles");
    let (second, compiled_again) = cached("sm_90", &dir).unwrap();
    assert!(!compiled_again, "the second start reads the cache");
    assert_eq!(first, second);
    // A damaged file is compiled anew, not loaded.
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "cubin"))
        .unwrap();
    std::fs::write(&file, b"not a cubin").unwrap();
    let (third, recompiled) = cached("sm_90", &dir).unwrap();
    assert!(recompiled);
    assert_eq!(
        third, first,
        "NVRTC compiles the same source to the same cubin"
    );
    // A path that is not a regular file is never opened (a FIFO would block the start): compiled
    // anew, and the compile cannot replace it, which is an error naming the cache.
    std::fs::remove_file(&file).unwrap();
    std::fs::create_dir(&file).unwrap();
    let e = cached("sm_90", &dir).unwrap_err().to_string();
    assert!(e.contains(&dir.display().to_string()), "{e}");
    std::fs::remove_dir(&file).unwrap();
    // Another architecture is another key.
    assert_ne!(
        kernels::cache_key("sm_80", (13, 0)),
        kernels::cache_key("sm_90", (13, 0))
    );
    assert_ne!(
        kernels::cache_key("sm_90", (13, 0)),
        kernels::cache_key("sm_90", (13, 1))
    );
    // Another source is another key.
    assert_ne!(
        kernels::cache_key_of(SMALL, "sm_90", (13, 0)),
        kernels::cache_key("sm_90", (13, 0))
    );
    let _ = std::fs::remove_dir_all(&dir);
}
