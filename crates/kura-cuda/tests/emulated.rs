//! Kura's CUDA kernels run on the CPU: `emu/check.cpp` compiles `kernels/kura.cu` with a C++ compiler
//! against `emu/emu.h` (each GPU thread a fiber; barriers, warp shuffles, `ldmatrix`, `mma.sync` and
//! `cp.async` emulated) and checks the prefill kernels (8-warp, wide, half-tile, small and the three-stage ones) and their timing
//! probes, the split-key kernel with and without its fused merge, and the matrix-vector kernels that norm their input, against attention in
//! double and against each other bit for bit; the prefill kernels also with every `cp.async` copy landing
//! as it is issued and each warp running on to the next barrier before the next starts, where a stage
//! of K and V reused before every warp has read it changes the outputs. What it cannot check — the GPU's own floating-point
//! results, memory ordering between blocks, speed — `scripts/test-gpu.sh` checks on a device.
//!
//! The compiler is `$KURA_CXX`, else `c++` on PATH (`scripts/fetch-cxx.sh` installs one); without one
//! the test fails.

use std::path::{Path, PathBuf};
use std::process::Command;

fn compiler() -> String {
    std::env::var("KURA_CXX").unwrap_or_else(|_| "c++".to_string())
}

#[test]
fn the_kernels_run_on_the_cpu_agree_with_attention_in_double_and_the_fused_ones_with_the_separate_ones(
) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let source = root.join("emu/check.cpp");
    let exe: PathBuf = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kura-cuda-emulated-check");
    let cxx = compiler();
    let built = Command::new(&cxx)
        .args([
            "-std=c++17",
            "-O2",
            // One rounding per written operation: the claims checked are about the operations the
            // kernels write, not what a compiler may fuse.
            "-ffp-contract=off",
            "-fno-strict-aliasing",
            "-Wall",
            "-Werror",
            "-Wno-unknown-pragmas",
            "-Wno-sign-compare",
            "-Wno-unused-variable",
            "-o",
        ])
        .arg(&exe)
        .arg(&source)
        .output()
        .unwrap_or_else(|e| {
            panic!("no C++ compiler `{cxx}` ({e}): run scripts/fetch-cxx.sh, or set KURA_CXX")
        });
    assert!(
        built.status.success(),
        "{cxx} failed on {}:\n{}",
        source.display(),
        String::from_utf8_lossy(&built.stderr)
    );
    let run = Command::new(&exe)
        .output()
        .expect("the emulated check runs");
    let stdout = String::from_utf8_lossy(&run.stdout);
    println!("{stdout}");
    assert!(
        run.status.success(),
        "emulated kernels: {}\n{stdout}{}",
        match run.status.code() {
            Some(1) => "checks failed".to_string(),
            Some(3) => "the emulation caught a fault".to_string(),
            other => format!("exit {other:?}"),
        },
        String::from_utf8_lossy(&run.stderr)
    );
    // Every check ran: the prefill, split-key and matrix-vector ones, none failed.
    let ok = stdout.lines().filter(|l| l.starts_with("ok: ")).count();
    assert!(ok >= 80, "only {ok} checks reported ok:\n{stdout}");
    assert!(stdout.contains("0 failed"), "{stdout}");
    for what in [
        "the wide kernel gives the 8-warp kernel's bits",
        "the half-tile kernel gives the 8-warp kernel's bits",
        "the fused merge (blocks in shuffled order) gives the bits of attn_merge",
        "the bits of rms_norm + gemv_4 + silu_mul",
    ] {
        assert!(stdout.contains(what), "no check of {what:?}:\n{stdout}");
    }
}
