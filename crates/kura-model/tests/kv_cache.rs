//! The KV cache changes nothing about the output: recomputing the whole sequence at every step, or
//! paging its K/V with blocks of 1, 16 or 256 tokens, gives the same greedy tokens.

mod common;

use kura_kv::codec::KvDtype;
use kura_kv::storage::KvStorage;
use kura_model::{LoadOptions, Model, SeqBatchItem, WeightsDtype};

#[test]
fn with_and_without_cache_and_any_block_size_give_the_same_tokens() {
    let model = Model::load(&common::default_model_path()).unwrap();
    let prompt = model
        .tokenizer()
        .encode("The three primary colors are", true)
        .unwrap();
    let (reference, _) = common::greedy(&model, &prompt, 24, 16, true);
    let (no_cache, _) = common::greedy(&model, &prompt, 24, 16, false);
    assert_eq!(no_cache, reference, "without KV cache");
    for bs in [1, 256] {
        assert_eq!(
            common::greedy(&model, &prompt, 24, bs, true).0,
            reference,
            "block size {bs}"
        );
    }
}

#[test]
fn batched_sequences_and_chunked_prefill_match_single_runs() {
    let model = Model::load(&common::default_model_path()).unwrap();
    let tok = model.tokenizer();
    let a = tok.encode("The capital of France is", true).unwrap();
    let b = tok.encode("Water boils at a temperature of", true).unwrap();
    let (ga, la) = common::greedy(&model, &a, 1, 16, true);
    let (gb, lb) = common::greedy(&model, &b, 1, 16, true);

    // Both sequences in one step, with shuffled, non-contiguous blocks; b is prefilled in two chunks.
    let layout = model.kv_layout(KvDtype::F32, 4).unwrap();
    let mut kv = KvStorage::new(&layout, 16).unwrap();
    let table_a = [9u32, 2, 14];
    let table_b = [5u32, 11, 0, 7];
    let split = 3;
    model
        .forward(
            &[SeqBatchItem {
                tokens: &b[..split],
                start_pos: 0,
                block_table: &table_b,
                layer_pages: &[],
            }],
            &mut kv,
        )
        .unwrap();
    let out = model
        .forward(
            &[
                SeqBatchItem {
                    tokens: &a,
                    start_pos: 0,
                    block_table: &table_a,
                    layer_pages: &[],
                },
                SeqBatchItem {
                    tokens: &b[split..],
                    start_pos: split,
                    block_table: &table_b,
                    layer_pages: &[],
                },
            ],
            &mut kv,
        )
        .unwrap();
    assert_eq!(out.num_rows(), 2);
    assert_eq!(kura_engine::sampling::argmax(out.row(0)), ga[0]);
    assert_eq!(kura_engine::sampling::argmax(out.row(1)), gb[0]);
    let diff = |x: &[f32], y: &[f32]| {
        x.iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0f32, f32::max)
    };
    assert!(diff(out.row(0), &la) < 1e-3 && diff(out.row(1), &lb) < 1e-3);
}

#[test]
fn copy_block_prefix_reuses_a_shared_prefix() {
    // Copy-on-write of a partial block: sequence B shares A's first 6 tokens (block size 4: one full
    // block shared, the partial second block copied), then continues on its own.
    let model = Model::load(&common::default_model_path()).unwrap();
    let prompt = model
        .tokenizer()
        .encode("One two three four five six seven", true)
        .unwrap();
    assert!(prompt.len() > 6);
    let layout = model.kv_layout(KvDtype::F32, 4).unwrap();
    let mut kv = KvStorage::new(&layout, 8).unwrap();
    let table_a = [0u32, 1, 2];
    model
        .forward(
            &[SeqBatchItem {
                tokens: &prompt[..6],
                start_pos: 0,
                block_table: &table_a,
                layer_pages: &[],
            }],
            &mut kv,
        )
        .unwrap();
    kv.copy_block_prefix(1, 5, 2).unwrap();
    let table_b = [0u32, 5, 6];
    let reused = model
        .forward(
            &[SeqBatchItem {
                tokens: &prompt[6..],
                start_pos: 6,
                block_table: &table_b,
                layer_pages: &[],
            }],
            &mut kv,
        )
        .unwrap();
    let (_, cold) = common::greedy(&model, &prompt, 1, 4, true);
    assert_eq!(reused.row(0), &cold[..], "bit-identical at f32 KV");
}

#[test]
fn bad_batches_are_errors_not_panics() {
    let model = Model::load(&common::default_model_path()).unwrap();
    let layout = model.kv_layout(KvDtype::F32, 16).unwrap();
    let mut kv = KvStorage::new(&layout, 2).unwrap();
    let cases: [(&[u32], usize, &[u32]); 4] = [
        (&[], 0, &[0]),
        (&[1; 40], 0, &[0, 1]),
        (&[1, 2], 0, &[7]),
        (&[1_000_000], 0, &[0]),
    ];
    for (tokens, start_pos, block_table) in cases {
        let err = model.forward(
            &[SeqBatchItem {
                tokens,
                start_pos,
                block_table,
                layer_pages: &[],
            }],
            &mut kv,
        );
        assert!(err.is_err(), "{tokens:?} {block_table:?}");
    }
    // Two sequences whose new tokens land in the same block and slot.
    let both = [
        SeqBatchItem {
            tokens: &[1, 2],
            start_pos: 0,
            block_table: &[0],
            layer_pages: &[],
        },
        SeqBatchItem {
            tokens: &[3],
            start_pos: 1,
            block_table: &[0],
            layer_pages: &[],
        },
    ];
    let err = model.forward(&both, &mut kv).expect_err("a shared slot");
    assert!(err.to_string().contains("block 0 slot 1"), "{err}");
}

/// A position's logits are the same bits whether it is computed in a whole prefill, in a later chunk
/// after a cached prefix, or alone in a decode step: in every weights format, in every KV format (int8,
/// fp8 and int4 included: a token's stored bytes depend on that token alone), on every kernel path. The
/// path is chosen once per process (`KURA_ISA`), so the test runs itself again in a child process for
/// each narrower path this CPU has; with `KURA_ISA` already set it checks that path alone.
#[test]
fn prefill_chunks_and_decode_give_bit_identical_logits_in_every_format_on_every_path() {
    use kura_model::kernels::dot::Isa;
    let isa = Isa::detect();
    eprintln!("kernel paths: {}", kura_model::kernels::paths());
    // Every weights format with every KV format on the path this process runs; on a narrower path
    // (slower, in a child process) every weights format with bf16 KV, and every KV format with native
    // weights on the AVX2 path (its own attention kernel, which reads every KV format).
    let forced = std::env::var("KURA_ISA").ok();
    for weights_dtype in [WeightsDtype::Native, WeightsDtype::Bf16, WeightsDtype::F32] {
        let model =
            Model::load_with(&common::default_model_path(), LoadOptions { weights_dtype }).unwrap();
        let kv_dtypes = match forced.as_deref() {
            None => KvDtype::ALL.to_vec(),
            Some("avx2" | "avx512") if weights_dtype == WeightsDtype::Native => {
                KvDtype::ALL.to_vec()
            }
            Some(_) => vec![KvDtype::Bf16],
        };
        check_invariance(&model, weights_dtype, &kv_dtypes);
    }
    if forced.is_some() {
        return;
    }
    // The narrower paths, each in a process of its own.
    let mut narrower = Vec::new();
    // AMX tiles for the quantized products' prefill: `KURA_ISA=avx512` runs the VNNI kernel instead.
    if kura_model::kernels::paths().contains("quant=Amx") {
        narrower.push("avx512");
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        narrower.push("avx2");
    }
    if isa != Isa::Scalar {
        narrower.push("scalar");
    }
    let me = std::env::current_exe().unwrap();
    let name = "prefill_chunks_and_decode_give_bit_identical_logits_in_every_format_on_every_path";
    for forced in narrower {
        let out = std::process::Command::new(&me)
            .args([name, "--exact", "--nocapture", "--test-threads", "1"])
            .env("KURA_ISA", forced)
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "KURA_ISA={forced}:\n{stdout}\n{stderr}"
        );
        let (isa_name, quant) = match forced {
            "avx512" => ("avx512", "quant=Vnni"),
            "avx2" => ("avx2+fma", "quant="),
            _ => ("scalar", "quant="),
        };
        assert!(
            stderr.contains(&format!("isa={isa_name} ")) && stderr.contains(quant),
            "KURA_ISA={forced} ran another path:\n{stderr}"
        );
        eprintln!("compared: {isa_name}");
    }
}

fn check_invariance(model: &Model, weights_dtype: WeightsDtype, kv_dtypes: &[KvDtype]) {
    let prompt = model
        .tokenizer()
        .encode(
            "The quick brown fox jumps over the lazy dog because it wanted to see what was on the \
             other side of the old stone wall at the edge of the quiet village. The dog, who had \
             seen the wall every day of its long life, did not move, and the fox went on alone \
             through the tall grass towards the river and the bridge.",
            true,
        )
        .unwrap();
    let n = prompt.len();
    // Long enough that the whole prompt takes the AMX kernel where the CPU has it (64 tokens and more)
    // while its pieces below do not; six blocks of 16 hold it.
    assert!((64..=96).contains(&n), "{n} tokens");
    // Quantised formats too: a token's stored bytes depend on that token alone, and attention reads
    // them the same way in a prefill chunk or a decode step.
    for &dtype in kv_dtypes {
        let layout = model.kv_layout(dtype, 16).unwrap();
        let table = [0u32, 1, 2, 3, 4, 5];
        let run = |parts: &[(usize, usize)]| -> Vec<f32> {
            let mut kv = model.kv_storage(&layout, table.len()).unwrap();
            let mut last = Vec::new();
            for &(a, b) in parts {
                let out = model
                    .forward(
                        &[SeqBatchItem {
                            tokens: &prompt[a..b],
                            start_pos: a,
                            block_table: &table,
                            layer_pages: &[],
                        }],
                        &mut kv,
                    )
                    .unwrap();
                last = out.row(0).to_vec();
            }
            last
        };
        let whole = run(&[(0, n)]);
        // A cached prefix of 40 tokens, a chunk of the rest but 3, then three single-token steps.
        let pieces = run(&[
            (0, 40),
            (40, n - 3),
            (n - 3, n - 2),
            (n - 2, n - 1),
            (n - 1, n),
        ]);
        assert_eq!(pieces, whole, "{weights_dtype:?} weights, {dtype:?} KV");
    }
}
