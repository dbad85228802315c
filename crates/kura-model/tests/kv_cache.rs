//! The KV cache changes nothing about the output: recomputing the whole sequence at every step, or
//! paging its K/V with blocks of 1, 16 or 256 tokens, gives the same greedy tokens.

mod common;

use kura_kv::codec::KvDtype;
use kura_kv::storage::KvStorage;
use kura_model::{Model, SeqBatchItem};

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
                },
                SeqBatchItem {
                    tokens: &b[split..],
                    start_pos: split,
                    block_table: &table_b,
                },
            ],
            &mut kv,
        )
        .unwrap();
    assert_eq!(out.num_rows(), 2);
    assert_eq!(kura_model::sampling::argmax(out.row(0)), ga[0]);
    assert_eq!(kura_model::sampling::argmax(out.row(1)), gb[0]);
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
        },
        SeqBatchItem {
            tokens: &[3],
            start_pos: 1,
            block_table: &[0],
        },
    ];
    let err = model.forward(&both, &mut kv).expect_err("a shared slot");
    assert!(err.to_string().contains("block 0 slot 1"), "{err}");
}

#[test]
fn prefill_and_decode_give_bit_identical_logits_with_bf16_dot_products() {
    // With vdpbf16ps every product is batch-invariant; elsewhere gemm (prefill) and the row kernel
    // (decode) sum in different orders and only agree to rounding.
    if kura_model::kernels::dot::Bf16Act::detect().is_none() {
        return;
    }
    let model = Model::load(&common::default_model_path()).unwrap();
    let prompt = model
        .tokenizer()
        .encode("The quick brown fox jumps over the lazy dog because", true)
        .unwrap();
    let (_, whole) = common::greedy(&model, &prompt, 1, 16, true);
    let layout = model.kv_layout(KvDtype::F32, 16).unwrap();
    let mut kv = KvStorage::new(&layout, 4).unwrap();
    let table = [0u32, 1, 2, 3];
    let n = prompt.len();
    model
        .forward(
            &[SeqBatchItem {
                tokens: &prompt[..n - 3],
                start_pos: 0,
                block_table: &table,
            }],
            &mut kv,
        )
        .unwrap();
    let mut last = Vec::new();
    for p in n - 3..n {
        let out = model
            .forward(
                &[SeqBatchItem {
                    tokens: &prompt[p..p + 1],
                    start_pos: p,
                    block_table: &table,
                }],
                &mut kv,
            )
            .unwrap();
        last = out.row(0).to_vec();
    }
    assert_eq!(last, whole);
}
