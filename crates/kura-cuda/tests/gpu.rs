//! The CUDA executor on a real GPU, against Kura's CPU runtime and HF transformers on the same weights.
//! These tests need a GPU: `scripts/test-gpu.sh` runs them (`--ignored`) on the lent accelerator after
//! `scripts/gpu/make_models.py` has made the models (random bf16 weights in SmolLM2-135M's shape and in
//! Llama-3.1-8B's cut to 4 layers) and HF's logits and greedy tokens for three prompts, in the folder
//! `KURA_GPU_MODELS` names. Without a GPU they fail, naming what is missing.

use std::path::PathBuf;
use std::time::Duration;

use kura_cuda::{
    CudaError, CudaExecutor, DecodeOptions, DecodeTuning, Device, GemvForm, PoolSpec,
    PrefillKernel, PrefillTuning,
};
use kura_engine::SeqInput;
use kura_kv::codec::KvDtype;
use kura_model::Model;

#[path = "support/scenarios.rs"]
mod scenarios;
use scenarios::cpu_logits;

fn models() -> PathBuf {
    PathBuf::from(std::env::var_os("KURA_GPU_MODELS").expect(
        "KURA_GPU_MODELS names the folder scripts/gpu/make_models.py wrote (scripts/test-gpu.sh sets it)",
    ))
}

fn prompts() -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(models().join("prompts.json")).expect("prompts.json");
    serde_json::from_str(&text).expect("prompts.json: lists of token ids")
}

fn read_f32(path: PathBuf) -> Vec<f32> {
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn device() -> Device {
    Device::open(0).unwrap_or_else(|e| panic!("a GPU is needed: {e}"))
}

fn exec(model: &str, dtype: KvDtype, block_size: usize, num_blocks: usize) -> CudaExecutor {
    CudaExecutor::load(
        device(),
        &models().join(model),
        PoolSpec::new(dtype, block_size, num_blocks),
    )
    .unwrap_or_else(|e| panic!("{model}: {e}"))
}

/// `‖a − b‖ / ‖b‖` and `max |a − b| / max |b|`.
fn errors(a: &[f32], b: &[f32]) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    let (mut d2, mut b2, mut dmax, mut bmax) = (0f64, 0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        assert!(x.is_finite(), "non-finite logit {x}");
        let d = f64::from(*x) - f64::from(*y);
        d2 += d * d;
        b2 += f64::from(*y) * f64::from(*y);
        dmax = dmax.max(d.abs());
        bmax = bmax.max(f64::from(*y).abs());
    }
    ((d2 / b2).sqrt(), dmax / bmax)
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// The relative (L2) error of logits the issue asks for: bf16 weights, activations and KV on every side.
const LOGITS_TOL: f64 = 1e-2;
/// What bf16 leaves between two implementations of the 4-layer Llama-3.1-8B shape (hidden 4,096): the
/// GPU and the CPU runtime differ by 1.1–1.3e-2 there (q rounded to bf16 on the GPU, other summation
/// orders); the assertions hold the GPU to this and to no further from HF than the CPU runtime is.
const LOGITS_TOL_WIDE: f64 = 1.5e-2;

#[test]
#[ignore = "needs a GPU: scripts/test-gpu.sh runs it"]
fn logits_match_the_cpu_runtime_and_hf_transformers() {
    let prompts = prompts();
    let mut failures = Vec::new();
    for model in ["smol", "llama8b4"] {
        let dir = models().join(model);
        let cpu = Model::load(&dir).unwrap();
        let mut gpu = exec(model, KvDtype::Bf16, 16, 256);
        for (i, p) in prompts.iter().enumerate() {
            let table: Vec<u32> = (0..p.len().div_ceil(16) as u32).collect();
            let g = gpu.forward_logits(&[SeqInput::new(p, 0, &table)]).unwrap();
            let hf = read_f32(dir.join(format!("hf_logits_{i}.f32")));
            let (rel_hf, max_hf) = errors(&g, &hf);
            let c = cpu_logits(&cpu, p, KvDtype::Bf16);
            let (rel_cpu, max_cpu) = errors(&g, &c);
            let (cpu_hf, _) = errors(&c, &hf);
            println!(
                "{model} prompt {i} ({} tokens): GPU vs HF rel {rel_hf:.2e} (max {max_hf:.2e}); GPU vs CPU rel \
                 {rel_cpu:.2e} (max {max_cpu:.2e}); CPU vs HF rel {cpu_hf:.2e}; argmax GPU {} CPU {} HF {}",
                p.len(),
                argmax(&g),
                argmax(&c),
                argmax(&hf),
            );
            let within = |rel: f64| {
                if rel <= LOGITS_TOL {
                    "within 1e-2"
                } else {
                    "NOT within 1e-2"
                }
            };
            println!(
                "  against HF {}, against the CPU {}",
                within(rel_hf),
                within(rel_cpu)
            );
            // Against the same weights in float32: how far each bf16 run (HF's, the GPU's, the CPU's)
            // is from the exact model, which tells whose rounding the differences above are.
            let exact = read_f32(dir.join(format!("hf32_logits_{i}.f32")));
            println!(
                "  against float32: HF bf16 {:.2e}, GPU {:.2e}, CPU {:.2e}",
                errors(&hf, &exact).0,
                errors(&g, &exact).0,
                errors(&c, &exact).0
            );
            if rel_hf > LOGITS_TOL.max(1.25 * cpu_hf) {
                failures.push(format!(
                    "{model} prompt {i}: {rel_hf:.2e} against HF (the CPU: {cpu_hf:.2e})"
                ));
            }
            if rel_cpu > LOGITS_TOL_WIDE {
                failures.push(format!("{model} prompt {i}: {rel_cpu:.2e} against the CPU"));
            }
            if argmax(&g) != argmax(&c) || argmax(&g) != argmax(&hf) {
                failures.push(format!("{model} prompt {i}: the argmax differs"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Which attention a step of `prefill_min` ([`CudaExecutor::set_prefill_min`]) runs a prompt through.
fn kernels(prefill_min: usize) -> String {
    if prefill_min == usize::MAX {
        "split kernel only".into()
    } else {
        format!("prefill kernel from {prefill_min} tokens")
    }
}

#[test]
#[ignore = "needs a GPU: scripts/test-gpu.sh runs it"]
fn both_attention_kernels_agree_with_each_other_and_the_cpu_in_bf16_and_f32_kv() {
    let p = &prompts()[1];
    let dir = models().join("smol");
    let cpu = Model::load(&dir).unwrap();
    let mut failures = Vec::new();
    for dtype in [KvDtype::Bf16, KvDtype::F32] {
        let c = cpu_logits(&cpu, p, dtype);
        let mut first: Option<Vec<f32>> = None;
        for (bs, prefill_min) in [(16, 1), (16, usize::MAX), (1, 64), (256, 64), (7, 1)] {
            let blocks = p.len().div_ceil(bs);
            let mut gpu = exec("smol", dtype, bs, blocks + 1);
            gpu.set_prefill_min(prefill_min);
            let table: Vec<u32> = (1..=blocks as u32).rev().collect();
            // A cached prefix: the first 200 tokens in one step, the rest in a second.
            gpu.forward_logits(&[SeqInput::new(&p[..200], 0, &table)])
                .unwrap();
            let g = gpu
                .forward_logits(&[SeqInput::new(&p[200..], 200, &table)])
                .unwrap();
            let (rel, max) = errors(&g, &c);
            let gpu_rel = first.as_ref().map(|f| errors(&g, f).0);
            println!(
                "{} KV, block {bs}, {}: vs CPU rel {rel:.2e} max {max:.2e}; vs the first GPU run {gpu_rel:?}",
                dtype.name(),
                kernels(prefill_min)
            );
            if rel > LOGITS_TOL {
                failures.push(format!(
                    "{} block {bs}, {}: {rel:.2e} against the CPU",
                    dtype.name(),
                    kernels(prefill_min)
                ));
            }
            // Two GPU kernels on the same KV: f32 sums in another order, bf16 P in the prefill kernel.
            if gpu_rel.is_some_and(|r| r > LOGITS_TOL) {
                failures.push(format!(
                    "{} block {bs}, {}: {gpu_rel:?} against the first GPU run",
                    dtype.name(),
                    kernels(prefill_min)
                ));
            }
            first.get_or_insert(g);
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
#[ignore = "needs a GPU: scripts/test-gpu.sh runs it"]
fn kernel_tuning_on_the_gpu_runs_forms_with_the_default_kernels_bits() {
    // What `kura serve --device cuda` does when it starts: every loaded prefill form and every decode
    // option timed over a 4,096-token prompt; those chosen give the default kernels' bits (checked again
    // here on a prompt of its own and a decode step after it). On the stand-in of
    // `scripts/gpu/preflight.sh` (`KURA_GPU_PREFLIGHT`), whose steps are all cut, over 256 tokens.
    let tokens = if std::env::var_os("KURA_GPU_PREFLIGHT").is_some() {
        256
    } else {
        kura_cuda::TUNE_TOKENS
    };
    let mut failures = Vec::new();
    for model in ["smol", "llama8b4"] {
        // (A pool of 4,096 tokens, for the prompts below as well.)
        let mut gpu = exec(model, KvDtype::Bf16, 16, 4096 / 16 + 1);
        let t = gpu
            .tune(tokens)
            .unwrap()
            .expect("the prompt takes the prefill kernel");
        println!(
            "{model}: prefill attention: {}; decode: {}",
            t.prefill, t.decode
        );
        let forms: Vec<PrefillKernel> = t.prefill.forms.iter().map(|f| f.kernel).collect();
        if forms[..4]
            != [
                PrefillKernel::Narrow,
                PrefillKernel::Wide,
                PrefillKernel::Half,
                PrefillKernel::Small,
            ]
        {
            failures.push(format!("{model}: the forms timed: {}", t.prefill));
        }
        if t.prefill.tokens != tokens
            || t.prefill.chosen != PrefillTuning::choose(&t.prefill.forms)
            || gpu.prefill_kernel() != t.prefill.chosen
            || t.decode.chosen != DecodeTuning::choose(&t.decode.options)
            || gpu.decode_options() != t.decode.chosen
        {
            failures.push(format!(
                "{model}: a choice against the rule: {}; {}",
                t.prefill, t.decode
            ));
        }
        if t.decode.options.iter().any(|o| !o.same_bits) {
            failures.push(format!(
                "{model}: a decode option changes the bits: {}",
                t.decode
            ));
        }
        let p = &prompts()[1];
        let table: Vec<u32> = (1..=p.len().div_ceil(16) as u32 + 1).rev().collect();
        let run = |gpu: &mut CudaExecutor| {
            let first = gpu.forward_logits(&[SeqInput::new(p, 0, &table)]).unwrap();
            let next = [5u32];
            let step = gpu
                .forward_logits(&[SeqInput::new(&next, p.len(), &table)])
                .unwrap();
            (first, step)
        };
        let chosen = run(&mut gpu);
        gpu.set_prefill_kernel(PrefillKernel::Narrow);
        gpu.set_decode_options(DecodeOptions::default());
        let default = run(&mut gpu);
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        if !same(&chosen.0, &default.0) || !same(&chosen.1, &default.1) {
            failures.push(format!(
                "{model}: the chosen kernels change the bits: {}; {}",
                t.prefill, t.decode
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
#[ignore = "needs a GPU: scripts/test-gpu.sh runs it"]
fn the_half_tile_and_small_prefill_kernels_give_the_narrow_and_the_wide_kernels_bits() {
    // Every prompt's first 200 tokens in one step and the rest in a second (a cached prefix), all
    // through the prefill kernel, narrow, then wide, then half tiles, then small, then narrow with
    // every tile masked, over the same shuffled blocks. The half-tile kernel and the masked tiles give
    // the narrow kernel's bits at every head size, the small one the wide one's; the wide one the
    // narrow one's at head size 64, and the same logits within the tolerance at 128.
    let prompts = prompts();
    // Per warpgroup form: runs, runs with the narrow kernel's bits, the largest distance from it.
    let mut warpgroup: Vec<(&str, usize, usize, f64)> = Vec::new();
    let mut failures = Vec::new();
    for model in ["smol", "llama8b4"] {
        for dtype in [KvDtype::Bf16, KvDtype::F32, KvDtype::Fp8] {
            // A block size that splits tiles (7; fp8 blocks are a multiple of 8 tokens: 8) on the small
            // model only: each 8B-shaped executor loads 3 GB of weights.
            let sizes: &[usize] = match (model, dtype) {
                ("smol", KvDtype::Fp8) => &[16, 8],
                ("smol", _) => &[16, 7],
                _ => &[16],
            };
            for &bs in sizes {
                let most = prompts.iter().map(Vec::len).max().unwrap_or(0).div_ceil(bs);
                let mut gpu = exec(model, dtype, bs, most + 1);
                gpu.set_prefill_min(1);
                for (i, p) in prompts.iter().enumerate().filter(|(_, p)| p.len() > 200) {
                    let blocks = p.len().div_ceil(bs);
                    let table: Vec<u32> = (1..=blocks as u32).rev().collect();
                    // Each run writes every position's K and V again before it reads them. A kernel
                    // the device did not load (three stages at a head size of 128 on sm_86 and
                    // sm_89, whose blocks have 99 KiB of shared memory) gives None.
                    let arch = gpu.device().arch.clone();
                    let mut run = |kernel: PrefillKernel, mask_all: bool| {
                        if !gpu.set_prefill_kernel(kernel) {
                            return None;
                        }
                        gpu.set_mask_all_tiles(mask_all);
                        gpu.forward_logits(&[SeqInput::new(&p[..200], 0, &table)])
                            .unwrap();
                        Some(
                            gpu.forward_logits(&[SeqInput::new(&p[200..], 200, &table)])
                                .unwrap(),
                        )
                    };
                    let mut always = |kernel: PrefillKernel, mask_all: bool| {
                        run(kernel, mask_all)
                            .unwrap_or_else(|| panic!("{} kernel not loaded", kernel.name()))
                    };
                    let narrow = always(PrefillKernel::Narrow, false);
                    let wide = always(PrefillKernel::Wide, false);
                    let half = always(PrefillKernel::Half, false);
                    let small = always(PrefillKernel::Small, false);
                    let masked = always(PrefillKernel::Narrow, true);
                    let mut deep = Vec::new();
                    for kernel in [PrefillKernel::Deep, PrefillKernel::HalfDeep] {
                        match run(kernel, false) {
                            Some(logits) => deep.push((kernel.name(), logits)),
                            None if model != "smol" && (arch == "sm_86" || arch == "sm_89") => {}
                            None => failures.push(format!(
                                "{model} {} on {arch}: the {} kernel was not loaded",
                                dtype.name(),
                                kernel.name()
                            )),
                        }
                    }
                    // Warpgroup products (sm_90 only): the same k-steps in the same order. Whether
                    // the tensor cores round a warpgroup's k-step as they round `mma.sync`'s is the
                    // device's to say (printed); a wrong layout of K or V is of order 1. The
                    // overlapped forms issue the same products in the same order as `Wg`: its bits,
                    // or a product read or wrote registers or shared memory while in flight.
                    let mut wg: Option<Vec<f32>> = None;
                    for kernel in [
                        PrefillKernel::Wg,
                        PrefillKernel::HalfWg,
                        PrefillKernel::WgPipe,
                        PrefillKernel::HalfWgPipe,
                    ] {
                        match run(kernel, false) {
                            Some(logits) => {
                                match (&wg, kernel) {
                                    (None, PrefillKernel::Wg) => wg = Some(logits.clone()),
                                    (Some(w), _) if w.iter().zip(&logits).any(|(a, b)| a.to_bits() != b.to_bits()) => {
                                        failures.push(format!(
                                            "{model} {} block {bs} prompt {i}: the {} kernel does not \
                                             give the wg kernel's bits",
                                            dtype.name(),
                                            kernel.name()
                                        ))
                                    }
                                    _ => {}
                                }
                                let (rel, max) = errors(&logits, &narrow);
                                let same = logits
                                    .iter()
                                    .zip(&narrow)
                                    .all(|(a, b)| a.to_bits() == b.to_bits());
                                println!(
                                    "{model} {} KV, block {bs}, prompt {i}: {} against narrow rel \
                                     {rel:.2e} max {max:.2e}, same bits {same}",
                                    dtype.name(),
                                    kernel.name()
                                );
                                let name = kernel.name();
                                match warpgroup.iter_mut().find(|w| w.0 == name) {
                                    Some(w) => {
                                        w.1 += 1;
                                        w.2 += usize::from(same);
                                        w.3 = w.3.max(rel);
                                    }
                                    None => warpgroup.push((name, 1, usize::from(same), rel)),
                                }
                                if rel > LOGITS_TOL || argmax(&logits) != argmax(&narrow) {
                                    failures.push(format!(
                                        "{model} {} block {bs} prompt {i}: the {} kernel is \
                                         {rel:.2e} from the narrow one",
                                        dtype.name(),
                                        kernel.name()
                                    ));
                                }
                            }
                            None if arch != "sm_90" => {}
                            None => failures.push(format!(
                                "{model} {} on {arch}: the {} kernel was not loaded",
                                dtype.name(),
                                kernel.name()
                            )),
                        }
                    }
                    let mut same_as = vec![
                        ("the half-tile kernel", &half, &narrow),
                        ("masking every tile", &masked, &narrow),
                        ("the small kernel (against the wide one)", &small, &wide),
                    ];
                    for (name, logits) in &deep {
                        let what = if *name == "deep" {
                            "the 8-warp kernel with three stages"
                        } else {
                            "the half-tile kernel with three stages"
                        };
                        same_as.push((what, logits, &narrow));
                    }
                    for (what, got, want) in same_as {
                        if got
                            .iter()
                            .zip(want)
                            .any(|(a, b)| a.to_bits() != b.to_bits())
                        {
                            failures.push(format!(
                                "{model} {} block {bs} prompt {i}: {what} changes the bits ({:.2e})",
                                dtype.name(),
                                errors(got, want).0
                            ));
                        }
                    }
                    let (rel, max) = errors(&wide, &narrow);
                    let same = wide
                        .iter()
                        .zip(&narrow)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    println!(
                        "{model} {} KV, block {bs}, prompt {i} ({} tokens): wide against narrow rel {rel:.2e} \
                         max {max:.2e}, same bits {same}",
                        dtype.name(),
                        p.len()
                    );
                    // Head size 64 (SmolLM2's shape): the same key tiles, so the same bits.
                    if model == "smol" && !same {
                        failures.push(format!(
                            "{model} {} block {bs} prompt {i}: bits differ",
                            dtype.name()
                        ));
                    }
                    // Head size 128: other key tiles (32 keys, not 64), so other summation orders and
                    // bf16 roundings of P, which the 4-layer 8B shape carries as far as any two
                    // implementations (on an H200: 8.7e-3 in bf16 and f32 KV, 1.2e-2 in fp8 KV, whose
                    // rounding of K and V to 3 mantissa bits passes on a difference of layer 1's output).
                    let tol = if model == "smol" {
                        LOGITS_TOL
                    } else {
                        LOGITS_TOL_WIDE
                    };
                    if rel > tol {
                        failures.push(format!(
                            "{model} {} block {bs} prompt {i}: {rel:.2e} against the narrow kernel",
                            dtype.name()
                        ));
                    }
                    if argmax(&wide) != argmax(&narrow) {
                        failures.push(format!(
                            "{model} {} block {bs} prompt {i}: the argmax differs",
                            dtype.name()
                        ));
                    }
                }
            }
        }
    }
    for (name, runs, same, worst) in &warpgroup {
        println!(
            "warpgroup products: {name} gave the narrow kernel's bits in {same} of {runs} runs (the \
             largest distance {worst:.2e})"
        );
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
#[ignore = "needs a GPU: scripts/test-gpu.sh runs it"]
fn the_fused_decode_kernels_give_the_same_bits_as_the_separate_ones() {
    // Four sequences of different lengths (1 to 4 splits of 128 keys) decode together, one token each
    // (the norms fused into the products, SiLU·mul into the gate and up products, for the most tokens
    // they take); then the first alone; then a step of a 3-token chunk of the first beside one token
    // of the second (the output head's rows are tokens 2 and 3); then a 20-token chunk of the third
    // (cuBLAS products; the merge still fused into the split kernel); then a decode of a fifth sequence
    // at 4,200 tokens (past 32 splits, where `attn_merge` runs again beside the fused products). Each
    // step is run with the separate kernels, with the products' L2 window (`gemv_ahead_T`) or batched
    // loads (`gemv_batched_T`) and the split-key kernel's K/V prefetch, then fused in graphs, launch by launch, and in waves of one
    // token; every run writes the same K and V rows before reading them, so the logits must agree bit
    // for bit.
    let prompts = prompts();
    let mut failures = Vec::new();
    for (model, dtypes) in [
        ("smol", &[KvDtype::Bf16, KvDtype::F32, KvDtype::Fp8][..]),
        ("llama8b4", &[KvDtype::Bf16, KvDtype::Fp8][..]),
    ] {
        for &dtype in dtypes {
            let bs = 16;
            let lens = [100usize, 200, 300, 420, 4200];
            // Each sequence: a prompt's tokens, repeated to its length and 20 more.
            let tokens: Vec<Vec<u32>> = lens
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    prompts[i % prompts.len()]
                        .iter()
                        .copied()
                        .cycle()
                        .take(n + 20)
                        .collect()
                })
                .collect();
            let mut gpu = exec(model, dtype, bs, scenarios::Sequences::blocks(&tokens, bs));
            let seqs = scenarios::Sequences::prefill(&mut gpu, tokens, bs);
            let mut steps = seqs.mixed_steps();
            steps.push(("decode past 32 splits", vec![seqs.item(4, 1)]));
            let all = |g: &mut CudaExecutor| scenarios::run_steps(g, &steps);
            let separate = all(&mut gpu);
            gpu.set_fused_decode(true);
            // The kernels a step launches, by name.
            let launches = |g: &mut CudaExecutor, batch: &[SeqInput<'_>]| -> Vec<String> {
                let profile = g.profile_greedy(batch).unwrap();
                profile.into_iter().map(|(kernel, _, _)| kernel).collect()
            };
            // The fused kernels are the ones that run.
            let launched = launches(&mut gpu, &steps[0].1);
            for (kernel, wanted) in [
                ("gemv_norm", true),
                ("gemv_swiglu_norm", true),
                ("attn_merge", false),
                ("rms_norm", false),
                ("silu_mul", false),
            ] {
                let ran = launched.iter().any(|k| k.starts_with(kernel));
                assert_eq!(ran, wanted, "{model}: {kernel} in {launched:?}");
            }
            // Past 32 splits the merge is a kernel of its own again; the products stay fused.
            let long = launches(&mut gpu, &steps[4].1);
            for kernel in ["attn_merge", "gemv_norm", "gemv_swiglu_norm"] {
                assert!(
                    long.iter().any(|k| k.starts_with(kernel)),
                    "{model}: no {kernel} at 4,200 tokens in {long:?}"
                );
            }
            // The products' L2 window (`gemv_ahead_T`) and W staged through shared memory (`gemv_batched_T`),
            // each with the split-key kernel's prefetch without its merge, separate kernels, in
            // graphs: the same bits.
            gpu.set_fused_decode(false);
            gpu.set_split_prefetch(true);
            for form in [GemvForm::Ahead, GemvForm::Batched] {
                gpu.set_gemv(form);
                let kernel = form.kernel();
                let launched = launches(&mut gpu, &steps[0].1);
                assert!(
                    launched
                        .iter()
                        .any(|k| k.starts_with(&format!("{kernel} "))),
                    "{model}: no {kernel} in {launched:?}"
                );
                let other = all(&mut gpu);
                for (((step, _), a), b) in steps.iter().zip(&other).zip(&separate) {
                    let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                    println!(
                        "{model} {} KV, {step}, the products as {kernel} and K/V prefetch: same bits {same}",
                        dtype.name()
                    );
                    if !same {
                        failures.push(format!("{model} {} {step} {kernel}", dtype.name()));
                    }
                }
            }
            gpu.set_gemv(GemvForm::Plain);
            gpu.set_split_prefetch(false);
            gpu.set_fused_decode(true);
            for (what, graphs, cap) in [
                ("in graphs", true, usize::MAX),
                ("launch by launch", false, usize::MAX),
                ("in waves of one token", true, 1),
            ] {
                gpu.set_graphs(graphs);
                gpu.set_part_cap(cap);
                let fused = all(&mut gpu);
                for (((step, _), a), b) in steps.iter().zip(&fused).zip(&separate) {
                    let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                    let (rel, _) = errors(a, b);
                    println!(
                        "{model} {} KV, {step}, fused {what}: same bits {same} (rel {rel:.2e})",
                        dtype.name()
                    );
                    if !same {
                        failures.push(format!(
                            "{model} {} {step} fused {what}: rel {rel:.2e}",
                            dtype.name()
                        ));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// `prompt` from position `cached` on (the positions before it already in the table's blocks), in
/// chunks of `chunk` tokens: the last chunk's logits and the next position.
fn prefill(
    gpu: &mut CudaExecutor,
    prompt: &[u32],
    cached: usize,
    chunk: usize,
    table: &[u32],
) -> (Vec<f32>, usize) {
    let mut pos = cached;
    let mut logits = Vec::new();
    while pos < prompt.len() {
        let end = pos.saturating_add(chunk).min(prompt.len());
        logits = gpu
            .forward_logits(&[SeqInput::new(&prompt[pos..end], pos, table)])
            .unwrap();
        pos = end;
    }
    (logits, pos)
}

/// Greedy tokens of `prompt` on `gpu`, with the gap between the two largest logits at each step: the
/// prompt in chunks of `chunk` tokens from `cached` on (positions before `cached` are already in the
/// table's blocks), then decode steps up to `n` tokens.
fn greedy(
    gpu: &mut CudaExecutor,
    prompt: &[u32],
    cached: usize,
    chunk: usize,
    table: &[u32],
    n: usize,
) -> (Vec<u32>, Vec<f32>) {
    let (mut logits, mut pos) = prefill(gpu, prompt, cached, chunk, table);
    let (mut out, mut gaps) = (Vec::new(), Vec::new());
    loop {
        let next = argmax(&logits);
        let top = logits[next as usize];
        let second = logits
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != next as usize)
            .map(|(_, x)| *x)
            .fold(f32::MIN, f32::max);
        out.push(next);
        gaps.push(top - second);
        if out.len() == n {
            return (out, gaps);
        }
        logits = gpu
            .forward_logits(&[SeqInput::new(&[next], pos, table)])
            .unwrap();
        pos += 1;
    }
}

/// The logits of each step when `prompt` (from `cached` on, in chunks of `chunk`) is followed by the
/// given `tokens` (teacher forcing): the same sequence as another path's greedy run, so that the two
/// paths' logits can be compared step by step.
fn forced(
    gpu: &mut CudaExecutor,
    prompt: &[u32],
    cached: usize,
    chunk: usize,
    table: &[u32],
    tokens: &[u32],
) -> Vec<Vec<f32>> {
    let (logits, mut pos) = prefill(gpu, prompt, cached, chunk, table);
    let mut out = vec![logits];
    for t in &tokens[..tokens.len() - 1] {
        out.push(
            gpu.forward_logits(&[SeqInput::new(&[*t], pos, table)])
                .unwrap(),
        );
        pos += 1;
    }
    out
}

/// Another path (cached prefix, chunked prefill: other kernels and other row counts in the products)
/// against the cold run, teacher-forced on the cold run's tokens: its logits within [`LOGITS_TOL`] at
/// every step, and the same greedy token wherever the cold run's two best logits are further apart than
/// twice the largest difference between the two paths' logits (elsewhere rounding may pick either).
fn same_path(
    cold: &(Vec<u32>, Vec<f32>),
    cold_logits: &[Vec<f32>],
    other: &[Vec<f32>],
    what: &str,
) {
    let mut flips = 0;
    let mut worst = 0f64;
    for (i, (a, b)) in cold_logits.iter().zip(other).enumerate() {
        let (rel, _) = errors(b, a);
        worst = worst.max(rel);
        assert!(
            rel <= LOGITS_TOL,
            "{what}: step {i}: logits {rel:.2e} from the cold run's"
        );
        let d = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        if argmax(b) != cold.0[i] {
            flips += 1;
            assert!(
                cold.1[i] <= 2.0 * d,
                "{what}: step {i}: token {} instead of {} where the top-2 gap {} exceeds twice the logit \
                 difference {d}",
                argmax(b),
                cold.0[i],
                cold.1[i]
            );
        }
    }
    println!(
        "{what}: logits within {worst:.2e} of the cold run's at every step; {flips} near-tie flips"
    );
}

#[test]
#[ignore = "needs a GPU: scripts/test-gpu.sh runs it"]
fn greedy_tokens_are_the_same_cold_cached_chunked_batched_and_for_every_block_size() {
    // `smolw`: SmolLM2's shape with weights of a wider spread (HF init 0.05), whose greedy text does
    // not settle on one token.
    let prompts = prompts();
    let p = &prompts[1];
    let n = 24;
    let total = p.len() + n;
    let hf: Vec<u32> = serde_json::from_str(
        &std::fs::read_to_string(models().join("smolw/hf_greedy_1.json")).unwrap(),
    )
    .unwrap();
    let mut gpu = exec("smolw", KvDtype::Bf16, 16, 200);
    let table_a: Vec<u32> = (0..total.div_ceil(16) as u32).collect();
    let cold = greedy(&mut gpu, p, 0, usize::MAX, &table_a, n);
    let agree = cold.0.iter().zip(&hf).take_while(|(a, b)| a == b).count();
    println!(
        "cold greedy {:?}\nHF greedy   {hf:?}\n({agree} of {n} agree from the start)\ntop-2 gaps {:?}",
        cold.0, cold.1
    );
    // The device's argmax is the argmax of the logits it returns.
    let g = gpu
        .forward_logits(&[SeqInput::new(&p[..100], 0, &table_a)])
        .unwrap();
    let dev = gpu
        .forward_greedy(&[SeqInput::new(&p[..100], 0, &table_a)])
        .unwrap()[0];
    assert_eq!(argmax(&g), dev);
    // Launch by launch (no captured graphs): the same kernels, the same bits.
    gpu.set_graphs(false);
    assert_eq!(
        greedy(&mut gpu, p, 0, usize::MAX, &table_a, n),
        cold,
        "without graphs"
    );
    // Plain launches instead of dependent ones, with and without graphs: every kernel still waits for
    // the one before it, so the same bits.
    gpu.set_dependent_launch(false);
    assert_eq!(
        greedy(&mut gpu, p, 0, usize::MAX, &table_a, n),
        cold,
        "without dependent launches, launch by launch"
    );
    gpu.set_graphs(true);
    assert_eq!(
        greedy(&mut gpu, p, 0, usize::MAX, &table_a, n),
        cold,
        "without dependent launches, in graphs"
    );
    gpu.set_dependent_launch(true);
    // Every block size: the kernels see the same keys in the same order, so the same bits.
    for bs in [1, 3, 64, 256] {
        let blocks = total.div_ceil(bs);
        let mut g = exec("smolw", KvDtype::Bf16, bs, blocks);
        let table: Vec<u32> = (0..blocks as u32).rev().collect();
        assert_eq!(
            greedy(&mut g, p, 0, usize::MAX, &table, n),
            cold,
            "block size {bs}"
        );
    }
    // A cached prefix (the first 8 blocks of sequence A, 128 tokens, under fresh blocks) and chunked
    // prefill (50 tokens a step: the split kernel; 100: the prefill kernel) multiply other row counts,
    // which cuBLAS may sum in another order: compared step by step on the cold run's tokens.
    let table_b: Vec<u32> = table_a[..8]
        .iter()
        .copied()
        .chain(100..100 + (total.div_ceil(16) - 8) as u32)
        .collect();
    // On this model (chaotic: 30 layers of wide random weights) the paths' rounding differences grow
    // until a step picks another token: where, for the record.
    gpu.forward_greedy(&[SeqInput::new(p, 0, &table_a)])
        .unwrap();
    for (what, cached, chunk, table) in [
        ("128 cached tokens", 128, usize::MAX, &table_b),
        ("chunks of 50", 0, 50, &table_a),
        ("chunks of 100", 0, 100, &table_a),
    ] {
        let other = greedy(&mut gpu, p, cached, chunk, table, n);
        match cold.0.iter().zip(&other.0).position(|(a, b)| a != b) {
            None => println!("smolw, {what}: the same {n} tokens"),
            Some(i) => println!(
                "smolw, {what}: the same first {i} tokens, then {} for {} (the cold run's top-2 gap there: {})",
                other.0[i], cold.0[i], cold.1[i]
            ),
        }
    }
    // On `smol` (HF's default spread), step by step on the cold run's tokens: the logits of a cached
    // prefix and of chunked prefill within 1e-2 of the cold run's, and the same tokens but at near-ties.
    let mut gs = exec("smol", KvDtype::Bf16, 16, 200);
    let cold_s = greedy(&mut gs, p, 0, usize::MAX, &table_a, n);
    let cold_logits = forced(&mut gs, p, 0, usize::MAX, &table_a, &cold_s.0);
    assert_eq!(
        cold_logits.iter().map(|l| argmax(l)).collect::<Vec<_>>(),
        cold_s.0,
        "teacher forcing on its own tokens replays the cold run"
    );
    let cached = forced(&mut gs, p, 128, usize::MAX, &table_b, &cold_s.0);
    same_path(&cold_s, &cold_logits, &cached, "smol, 128 cached tokens");
    for chunk in [50, 100] {
        let chunked = forced(&mut gs, p, 0, chunk, &table_a, &cold_s.0);
        same_path(
            &cold_s,
            &cold_logits,
            &chunked,
            &format!("smol, chunks of {chunk}"),
        );
    }
    // Batched decode: four sequences stepping together give each the tokens it gets alone (the decode
    // products and attention compute each row alike at any batch size).
    let others: Vec<&Vec<u32>> = vec![&prompts[0], &prompts[1], &prompts[0], &prompts[2]];
    let mut tables = Vec::new();
    let mut next_block = 0u32;
    for q in &others {
        let blocks = (q.len() + n).div_ceil(16) as u32;
        tables.push((next_block..next_block + blocks).collect::<Vec<u32>>());
        next_block += blocks;
    }
    let mut g = exec("smolw", KvDtype::Bf16, 16, next_block as usize);
    let alone: Vec<Vec<u32>> = others
        .iter()
        .zip(&tables)
        .map(|(q, t)| greedy(&mut g, q, 0, usize::MAX, t, n).0)
        .collect();
    let mut last: Vec<u32> = others
        .iter()
        .zip(&tables)
        .map(|(q, t)| g.forward_greedy(&[SeqInput::new(q, 0, t)]).unwrap()[0])
        .collect();
    let mut together: Vec<Vec<u32>> = last.iter().map(|t| vec![*t]).collect();
    for step in 1..n {
        let toks: Vec<[u32; 1]> = last.iter().map(|t| [*t]).collect();
        let batch: Vec<SeqInput<'_>> = others
            .iter()
            .zip(&tables)
            .zip(&toks)
            .map(|((q, t), tok)| SeqInput::new(tok, q.len() + step - 1, t))
            .collect();
        last = g.forward_greedy(&batch).unwrap();
        for (i, l) in last.iter().enumerate() {
            together[i].push(*l);
        }
    }
    assert_eq!(together, alone, "a batch of four decodes as each alone");
    // The split kernel in waves of one token (its partials capped): the same bits as in one wave.
    g.set_part_cap(1);
    let toks: Vec<[u32; 1]> = alone.iter().map(|a| [a[n - 1]]).collect();
    let step = |g: &mut CudaExecutor| {
        let batch: Vec<SeqInput<'_>> = others
            .iter()
            .zip(&tables)
            .zip(&toks)
            .map(|((q, t), tok)| SeqInput::new(tok, q.len() + n - 1, t))
            .collect();
        g.forward_logits(&batch).unwrap()
    };
    let waves = step(&mut g);
    g.set_part_cap(usize::MAX);
    assert_eq!(
        waves,
        step(&mut g),
        "the split kernel in waves of one token"
    );
}

#[test]
#[ignore = "needs a GPU: scripts/test-gpu.sh runs it"]
fn blocks_export_import_and_copy_as_the_cpu_pool_lays_them_out() {
    let cpu = Model::load(&models().join("smol")).unwrap();
    let mut gpu = exec("smol", KvDtype::Bf16, 16, 8);
    scenarios::blocks_move_as_the_cpu_pool_lays_them_out(&mut gpu, &cpu, &prompts()[0], 16);
}

#[test]
#[ignore = "needs a GPU: scripts/test-gpu.sh runs it"]
fn host_tier_loads_and_stores_copy_asynchronously_through_pinned_memory_byte_for_byte() {
    let gpu = exec("smol", KvDtype::Bf16, 16, 8);
    scenarios::whole_block_loads_and_stores(gpu, &prompts()[0], 16, Duration::from_secs(10));
}

#[test]
#[ignore = "needs a GPU: scripts/test-gpu.sh runs it"]
fn host_tier_loads_and_stores_go_both_ways_at_once_and_keep_their_order_where_it_matters() {
    let gpu = exec("smol", KvDtype::Bf16, 16, 8);
    scenarios::loads_and_stores_go_both_ways_at_once(
        gpu,
        &prompts()[0],
        16,
        Duration::from_secs(10),
        false,
    );
}

#[test]
#[ignore = "needs a GPU: scripts/test-gpu.sh runs it"]
fn a_host_tier_store_holds_back_only_the_work_that_writes_its_block() {
    let gpu = exec("smol", KvDtype::Bf16, 16, 8);
    scenarios::stores_wait_only_for_their_blocks_writers(gpu, &prompts()[0], 16, false);
}

#[test]
#[ignore = "needs a GPU: scripts/test-gpu.sh runs it"]
fn every_positions_logits_are_each_prefixs_last_logits() {
    // `kura perplexity`'s step: one sequence, every token's logits.
    let p = &prompts()[1];
    let bs = 16;
    let blocks = p.len().div_ceil(bs);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut gpu = exec("smol", KvDtype::Bf16, bs, blocks);
    let every = gpu
        .forward_every_position(SeqInput::new(p, 0, &table))
        .unwrap();
    let vocab = every.len() / p.len();
    assert_eq!(every.len(), p.len() * vocab);
    // Row i is what the last logits of the prompt's first i + 1 tokens are (the head's product runs
    // over other row counts: close, not the same bits).
    for i in [0, 63, 150, p.len() - 1] {
        let mut one = exec("smol", KvDtype::Bf16, bs, blocks);
        let last = one
            .forward_logits(&[SeqInput::new(&p[..=i], 0, &table)])
            .unwrap();
        let row = &every[i * vocab..(i + 1) * vocab];
        let (rel, _) = errors(row, &last);
        println!("every position, row {i}: {rel:.2e} from the prefix's last logits");
        assert!(rel < LOGITS_TOL, "row {i}: {rel:.2e}");
    }
}

#[test]
#[ignore = "needs a GPU: scripts/test-gpu.sh runs it"]
fn a_draft_checks_rows_are_each_positions_logits_in_one_step() {
    // Speculative decoding's step on the device, SmolLM2's shape: each row asked within the tolerance
    // of the CPU runtime's last logits of its prefix, greedy tokens its argmax, tails of 1 the bits of
    // a plain step; then in graphs, the same bits.
    let dir = models().join("smol");
    let cpu = Model::load(&dir).unwrap();
    let bs = 16;
    let tokens: Vec<Vec<u32>> = prompts().into_iter().take(3).collect();
    assert_eq!(tokens.len(), 3, "prompts.json holds three prompts");
    let mut gpu = exec(
        "smol",
        KvDtype::Bf16,
        bs,
        scenarios::Sequences::blocks(&tokens, bs),
    );
    let seqs = scenarios::Sequences::prefill(&mut gpu, tokens, bs);
    gpu.set_graphs(false);
    let plain = scenarios::tail_rows(&mut gpu, &cpu, &seqs, LOGITS_TOL);
    // Each shape runs five times a call: captured, then replayed.
    gpu.set_graphs(true);
    let graphs = scenarios::tail_rows(&mut gpu, &cpu, &seqs, LOGITS_TOL);
    for (shape, (a, b)) in graphs.iter().zip(&plain).enumerate() {
        assert!(
            scenarios::same_bits(a, b),
            "shape {shape}, in graphs: {:.2e} from launch by launch",
            scenarios::rel(a, b)
        );
    }
}

#[test]
#[ignore = "needs a GPU: scripts/test-gpu.sh runs it"]
fn host_tier_loads_ordered_layer_by_layer_are_read_by_the_next_step_bit_for_bit() {
    // Each load comes with 2,048 more into other blocks, which make one layer's copies last far longer
    // than a layer's compute (2,048 blocks' layer: 24 MB, about half a millisecond at 55 GB/s).
    scenarios::ordered_loads(
        &mut |blocks| exec("smol", KvDtype::Bf16, 16, blocks),
        &prompts()[1],
        16,
        2048,
        Duration::from_secs(10),
    );
}

#[test]
#[ignore = "needs a GPU: scripts/test-gpu.sh runs it"]
fn fp8_kv_stays_as_close_to_bf16_as_the_cpus_fp8_and_moves_byte_for_byte() {
    // SmolLM2's shape, 300 tokens: the CPU's fp8 (rotated groups, key offsets) against its bf16 sets
    // the scale of what fp8 rounding leaves; the GPU's fp8 (plain groups of 64) is held to it.
    let p = &prompts()[1];
    let dir = models().join("smol");
    let cpu = Model::load(&dir).unwrap();
    let c16 = cpu_logits(&cpu, p, KvDtype::Bf16);
    let c8 = cpu_logits(&cpu, p, KvDtype::Fp8);
    let cpu_fp8 = errors(&c8, &c16).0;
    let allowed = (1.5 * cpu_fp8).max(LOGITS_TOL);
    let mut failures = Vec::new();
    let mut split_logits: Option<Vec<f32>> = None;
    for (bs, prefill_min) in [
        (16, usize::MAX),
        (8, usize::MAX),
        (256, usize::MAX),
        (16, 64),
    ] {
        let blocks = p.len().div_ceil(bs);
        let mut gpu = exec("smol", KvDtype::Fp8, bs, blocks + 1);
        gpu.set_prefill_min(prefill_min);
        let table: Vec<u32> = (1..=blocks as u32).rev().collect();
        // A cached prefix of 200 tokens, then the rest.
        gpu.forward_logits(&[SeqInput::new(&p[..200], 0, &table)])
            .unwrap();
        let g = gpu
            .forward_logits(&[SeqInput::new(&p[200..], 200, &table)])
            .unwrap();
        let (rel16, rel8) = (errors(&g, &c16).0, errors(&g, &c8).0);
        println!(
            "fp8 KV, block {bs}, {}: vs CPU bf16 {rel16:.2e} (the CPU's fp8: {cpu_fp8:.2e}), vs CPU fp8 \
             {rel8:.2e}; argmax GPU {} CPU bf16 {}",
            kernels(prefill_min),
            argmax(&g),
            argmax(&c16)
        );
        if rel16 > allowed {
            failures.push(format!(
                "block {bs}, {}: {rel16:.2e} from bf16, more than {allowed:.2e}",
                kernels(prefill_min)
            ));
        }
        if prefill_min == usize::MAX {
            // The split kernel reads the same bytes in the same order at every block size.
            match &split_logits {
                None => split_logits = Some(g),
                Some(first) if *first != g => failures.push(format!(
                    "block {bs}: other bits than block 16 ({:.2e})",
                    errors(&g, first).0
                )),
                Some(_) => {}
            }
        } else if let Some(first) = &split_logits {
            // The prefill kernel rounds K and V to bf16 in shared memory: close, not equal.
            let r = errors(&g, first).0;
            if r > LOGITS_TOL {
                failures.push(format!("the prefill kernel: {r:.2e} from the split kernel"));
            }
        }
    }
    // Blocks move byte for byte, and copy-on-write copies payload and scales of the first slots.
    use kura_engine::Executor;
    let bs = 16;
    let q = &prompts()[0];
    let blocks = q.len().div_ceil(bs);
    let mut gpu = exec("smol", KvDtype::Fp8, bs, blocks + 4);
    let table: Vec<u32> = (0..blocks as u32).collect();
    gpu.forward_logits(&[SeqInput::new(q, 0, &table)]).unwrap();
    let bb = cpu.kv_layout(KvDtype::Fp8, bs).unwrap().bytes_per_block() as usize;
    assert_eq!(gpu.block_bytes(), bb);
    let mut g = vec![0u8; bb];
    gpu.export_block(0, &mut g).unwrap();
    assert!(g.iter().any(|b| *b != 0), "block 0 holds KV");
    let spare = blocks as u32;
    gpu.import_block(spare, &g).unwrap();
    let mut back = vec![0u8; bb];
    gpu.export_block(spare, &mut back).unwrap();
    assert_eq!(back, g);
    // The prompt's rest over the imported copy of block 0: the same bits as over the original.
    let rest = |gpu: &mut CudaExecutor, t: &[u32]| {
        gpu.forward_logits(&[SeqInput::new(&q[16..], 16, t)])
            .unwrap()
    };
    let over_original = rest(&mut gpu, &table);
    let mut moved = table.clone();
    moved[0] = spare;
    let over_copy = rest(&mut gpu, &moved);
    if over_copy != over_original {
        failures.push(format!(
            "the prompt's rest over an imported block: {:.2e} from over the original",
            errors(&over_copy, &over_original).0
        ));
    }
    gpu.import_block(spare + 1, &vec![0u8; bb]).unwrap();
    gpu.copy_block_prefix(0, spare + 1, 5).unwrap();
    gpu.export_block(spare + 1, &mut back).unwrap();
    let d = 64;
    let region = bs * (d + 2);
    for (r, (a, b)) in back
        .chunks_exact(region)
        .zip(g.chunks_exact(region))
        .enumerate()
    {
        let (pay, sc) = (bs * d, 2);
        assert_eq!(&a[..5 * d], &b[..5 * d], "region {r}: copied payload rows");
        assert!(
            a[5 * d..pay].iter().all(|x| *x == 0),
            "region {r}: payload past the copy"
        );
        assert_eq!(
            &a[pay..pay + 5 * sc],
            &b[pay..pay + 5 * sc],
            "region {r}: copied scales"
        );
        assert!(
            a[pay + 5 * sc..].iter().all(|x| *x == 0),
            "region {r}: scales past the copy"
        );
    }
    // Blocks of a size the fp8 layout cannot align are refused by name.
    let e = CudaExecutor::load(device(), &dir, PoolSpec::new(KvDtype::Fp8, 4, 8))
        .expect_err("fp8 in blocks of 4 is refused")
        .to_string();
    assert!(e.contains("multiple of 8"), "{e}");
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
#[ignore = "needs a GPU: scripts/test-gpu.sh runs it"]
fn a_missing_device_or_too_little_memory_is_an_error_naming_it() {
    match Device::open(99) {
        Err(CudaError::NoDevice { ordinal: 99, found }) => println!("cuda:99: {found}"),
        other => panic!("cuda:99: {other:?}"),
    }
    let dev = device();
    let (free, total) = dev.memory().unwrap();
    println!("{}: {} of {} bytes free", dev.name, free, total);
    let err = CudaExecutor::load(
        dev,
        &models().join("smol"),
        PoolSpec::new(KvDtype::Bf16, 16, total / 16 + 1),
    )
    .unwrap_err();
    assert!(matches!(err, CudaError::OutOfMemory { .. }), "{err}");
    println!("{err}");
    let mut gpu = exec("smol", KvDtype::Bf16, 16, 4);
    let err = gpu
        .forward_logits(&[SeqInput::new(&[1, 2, 3], 0, &[4])])
        .unwrap_err()
        .to_string();
    assert!(err.contains("outside the pool"), "{err}");
}
