//! CPU kernels of the forward pass, chosen at run time by CPU features ([`dot::Isa`]).

pub mod arena;
pub mod attention;
pub mod dot;
pub mod matmul;
pub mod ops;
pub mod pace;
pub mod packed;
pub mod qpacked;
pub mod roster;
pub mod seats;
pub mod team;

/// The kernel paths this process dispatches to, for the log: the vector instruction set (which
/// `KURA_ISA=avx2` or `KURA_ISA=scalar` narrows), the product of bf16 weights, and that of quantized
/// weights. For example `isa=avx512 bf16=vdpbf16ps quant=Vnni`.
pub fn paths() -> String {
    let bf16 = if dot::Bf16Act::detect().is_some() {
        "vdpbf16ps"
    } else {
        "widened"
    };
    format!(
        "isa={} bf16={bf16} quant={:?}",
        dot::Isa::detect().name(),
        qpacked::Path::detect()
    )
}

/// For kernel tests: says whether the path `name` is compared, and fails when this CPU has the
/// path's instructions but the test could not run it (only a `KURA_ISA` that narrows the dispatch on
/// purpose excuses that). A path the CPU lacks is reported as not compared, never passed in silence.
#[cfg(test)]
pub(crate) fn compared(name: &str, cpu_has: bool, runs: bool) -> bool {
    if runs {
        eprintln!("compared: {name}");
        return true;
    }
    assert!(
        !cpu_has || std::env::var("KURA_ISA").is_ok(),
        "{name}: this CPU has its instructions, but the test could not run it"
    );
    eprintln!("not compared: {name} (this CPU lacks its instructions, or KURA_ISA narrows them)");
    false
}

/// Whether this CPU has the instructions of each [`dot::Isa`]'s path, whatever `KURA_ISA` says.
#[cfg(test)]
pub(crate) fn cpu_has(isa: dot::Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        match isa {
            dot::Isa::Avx512 => is_x86_feature_detected!("avx512f"),
            dot::Isa::Avx2Fma => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
            }
            dot::Isa::Scalar => true,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        isa == dot::Isa::Scalar
    }
}
