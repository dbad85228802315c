//! Fills the kernel cache (`$KURA_CACHE_DIR/cuda-kernels`) for the given architectures, so that a GPU
//! machine with the same NVRTC version loads Kura's kernels without compiling them:
//! `kernel-cache sm_90 [sm_80 …]` (a device's architecture: sm_90's module is compiled for sm_90a,
//! `kura_cuda::device::compile_arch`).

fn main() {
    let archs: Vec<String> = std::env::args().skip(1).collect();
    if archs.is_empty() {
        eprintln!("usage: kernel-cache ARCH...");
        std::process::exit(2);
    }
    for arch in archs {
        let target = kura_cuda::device::compile_arch(&arch);
        match kura_cuda::kernels::cubin_for(target, &kura_cuda::kernels::cache_dir()) {
            Ok((cubin, compiled)) => println!(
                "{arch} ({target}): {} bytes ({})",
                cubin.len(),
                if compiled {
                    "compiled"
                } else {
                    "already cached"
                }
            ),
            Err(e) => {
                eprintln!("{arch}: {e}");
                std::process::exit(1);
            }
        }
    }
}
