//! Compiles a CUDA C file as Kura compiles its kernels and prints ptxas' report of the kernels whose
//! names contain a filter: `nvrtc-report FILE ARCH [FILTER]`. With `KURA_CUBIN_OUT=PATH` it also writes
//! the cubin there (for `nvdisasm`, to read the instructions a kernel compiles to).

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: nvrtc-report FILE ARCH [FILTER]");
        std::process::exit(2);
    }
    let src = std::fs::read_to_string(&args[1]).unwrap_or_else(|e| {
        eprintln!("{}: {e}", args[1]);
        std::process::exit(2)
    });
    let filter = args.get(3).map(String::as_str).unwrap_or("");
    let include = kura_cuda::kernels::include_dir().unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    match kura_cuda::kernels::compile_source(&src, &args[2], &include) {
        Ok(c) => {
            if let Some(path) = std::env::var_os("KURA_CUBIN_OUT") {
                if let Err(e) = std::fs::write(&path, &c.cubin) {
                    eprintln!("{}: {e}", std::path::Path::new(&path).display());
                    std::process::exit(1)
                }
            }
            let mut show = false;
            for line in c.log.lines() {
                if line.contains("Compiling entry function") {
                    show = line.contains(filter);
                }
                if show && !line.contains("Compile time") {
                    println!("{line}");
                }
            }
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1)
        }
    }
}
