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

/// What decides the bits of the KV this process computes for a layout, besides the model, its weights
/// format and the layout itself: a digest of the kernel paths that compute other bits on other CPUs.
/// The vector instruction set (AVX-512, AVX2 or the portable loops, as `KURA_ISA` leaves it), whether
/// AVX-512 VNNI is there (int8 attention scores) and AVX-512 BF16 (the bf16 products, `vdpbf16ps`), and
/// the attention kernel of each layer ([`attention::attention_kernel`]: each has its own order of
/// additions and its own exponential). The quantized products give the same bits on every path (AMX,
/// VNNI, AVX2 and portable; `qpacked`), so they do not count. A server's KV fingerprint holds it: blocks
/// one CPU computed are never served to a process whose kernels would compute them otherwise (a fleet's
/// shared tier, a disk tier moved to another machine).
pub fn numerics(layout: &kura_kv::layout::KvLayout) -> u128 {
    numerics_of(
        dot::Isa::detect(),
        dot::Vnni::detect().is_some(),
        dot::Bf16Act::detect().is_some(),
        layout,
    )
}

/// [`numerics`] for a CPU with these paths.
pub(crate) fn numerics_of(
    isa: dot::Isa,
    vnni: bool,
    bf16_pairs: bool,
    layout: &kura_kv::layout::KvLayout,
) -> u128 {
    let isa_code: u8 = match isa {
        dot::Isa::Scalar => 1,
        dot::Isa::Avx2Fma => 2,
        dot::Isa::Avx512 => 3,
    };
    let mut bytes = vec![isa_code, u8::from(vnni), u8::from(bf16_pairs)];
    let kernels: Vec<attention::AttnKernel> = layout
        .layers
        .iter()
        .map(|l| attention::attention_kernel(isa, vnni, layout.dtype, l.head_dim))
        .collect();
    bytes.extend(kernels.iter().map(|k| k.code()));
    // Revision 1 of the AVX2 kernel: an int8 or fp8 V row of one scale (head size 64) is read unscaled
    // and its scale folded into the weights, which gives other bits than before; blocks computed before
    // are foreign. Every other layout keeps its numerics (and its cached blocks).
    let folds = layout.layers.iter().zip(&kernels).any(|(l, k)| {
        *k == attention::AttnKernel::Avx2
            && matches!(
                layout.dtype,
                kura_kv::codec::KvDtype::Int8 | kura_kv::codec::KvDtype::Fp8
            )
            && l.head_dim == kura_kv::codec::QUANT_GROUP
    });
    if folds {
        bytes.push(1);
    }
    xxhash_rust::xxh3::xxh3_128(&bytes)
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

#[cfg(test)]
mod tests {
    use kura_kv::codec::KvDtype;
    use kura_kv::layout::{KvLayout, LayerKv};

    use super::dot::Isa;
    use super::numerics_of;

    #[test]
    fn each_kernel_path_counts_in_the_numerics() {
        let layout = |dtype, dim| KvLayout::new(vec![LayerKv::full(1, dim); 3], dtype, 16).unwrap();
        let bf16 = layout(KvDtype::Bf16, 256);
        let base = numerics_of(Isa::Avx512, true, true, &bf16);
        assert_eq!(base, numerics_of(Isa::Avx512, true, true, &bf16));
        for other in [
            numerics_of(Isa::Avx2Fma, false, false, &bf16),
            numerics_of(Isa::Scalar, false, false, &bf16),
            numerics_of(Isa::Avx512, false, true, &bf16),
            numerics_of(Isa::Avx512, true, false, &bf16),
            // The same paths, other kernels: the AVX-512 kernel at 256, the AVX2 kernel (or, without
            // AVX2, the portable loop) at 80.
            numerics_of(Isa::Avx512, true, true, &layout(KvDtype::Bf16, 80)),
            numerics_of(Isa::Avx512, true, true, &layout(KvDtype::Int8, 256)),
        ] {
            assert_ne!(other, base);
        }
        // int8 rows: the VNNI kernel, or without VNNI the AVX2 kernel (the portable loop without AVX2),
        // one per layer.
        let int8 = layout(KvDtype::Int8, 128);
        assert_ne!(
            numerics_of(Isa::Avx512, true, false, &int8),
            numerics_of(Isa::Avx512, false, false, &int8)
        );
    }

    #[test]
    fn the_avx2_kernels_scale_folding_is_its_revision_1() {
        let layout = |dtype, dim| KvLayout::new(vec![LayerKv::full(1, dim); 3], dtype, 16).unwrap();
        // ISA, VNNI, bf16 pairs, then each layer's kernel (2: AVX2), as before the revision.
        let before = xxhash_rust::xxh3::xxh3_128(&[2, 0, 0, 2, 2, 2]);
        let revised = xxhash_rust::xxh3::xxh3_128(&[2, 0, 0, 2, 2, 2, 1]);
        for dtype in [KvDtype::Int8, KvDtype::Fp8] {
            assert_eq!(
                numerics_of(Isa::Avx2Fma, false, false, &layout(dtype, 64)),
                revised
            );
            // Several scales a row: read as before.
            assert_eq!(
                numerics_of(Isa::Avx2Fma, false, false, &layout(dtype, 128)),
                before
            );
        }
        for dtype in [KvDtype::Bf16, KvDtype::Int4] {
            assert_eq!(
                numerics_of(Isa::Avx2Fma, false, false, &layout(dtype, 64)),
                before
            );
        }
        // An AVX-512 CPU without VNNI runs int8 on the AVX2 kernel too.
        assert_eq!(
            numerics_of(Isa::Avx512, false, true, &layout(KvDtype::Int8, 64)),
            xxhash_rust::xxh3::xxh3_128(&[3, 0, 1, 2, 2, 2, 1])
        );
    }
}
