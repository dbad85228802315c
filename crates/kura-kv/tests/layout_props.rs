//! Property tests of `KvLayout`'s byte math: linear in context and batch, exact under tensor parallelism,
//! ordered by element width, paging never loses a token, and a hybrid pool's pages for a sequence are
//! the layout's bytes for it.

use kura_kv::codec::KvDtype;
use kura_kv::layout::{AttentionKind, KvLayout, LayerKv};
use proptest::prelude::*;

fn dtype() -> impl Strategy<Value = KvDtype> {
    prop::sample::select(KvDtype::ALL.to_vec())
}

fn full_layout() -> impl Strategy<Value = KvLayout> {
    (
        1usize..=96,
        1usize..=64,
        prop::sample::select(vec![32usize, 64, 80, 96, 128, 256]),
        dtype(),
        1usize..=256,
    )
        .prop_map(|(layers, kv, hd, d, bs)| KvLayout::uniform(layers, kv, hd, d, bs).unwrap())
}

proptest! {
    #[test]
    fn whole_blocks_grow_linearly_in_context(l in full_layout(), blocks in 1u64..2000, k in 1u64..8) {
        let ctx = blocks * l.block_size_tokens as u64;
        prop_assert_eq!(l.bytes_for_sequence(ctx * k).unwrap(), k * l.bytes_for_sequence(ctx).unwrap());
        prop_assert_eq!(l.bytes_for_sequence(ctx).unwrap(), ctx * l.bytes_per_token());
    }

    #[test]
    fn bytes_grow_linearly_in_batch(l in full_layout(), ctx in 1u64..200_000, batch in 1u64..512) {
        prop_assert_eq!(l.bytes_for_batch(ctx, batch).unwrap(), batch * l.bytes_for_sequence(ctx).unwrap());
    }

    #[test]
    fn paging_never_loses_a_token_and_wastes_less_than_a_block(l in full_layout(), ctx in 0u64..500_000) {
        let slots = l.blocks_for_tokens(ctx) * l.block_size_tokens as u64;
        prop_assert!(slots >= ctx);
        prop_assert!(slots < ctx + l.block_size_tokens as u64);
        prop_assert!(l.bytes_for_sequence(ctx).unwrap() >= ctx * l.bytes_per_token());
    }

    #[test]
    fn tp_divides_kv_bytes_exactly_when_it_divides_kv_heads(
        layers in 1usize..=80, kv_exp in 0u32..=6, tp_exp in 0u32..=6, d in dtype(), ctx in 1u64..100_000,
    ) {
        let (kv, tp) = (1usize << kv_exp, 1usize << tp_exp);
        let l = KvLayout::uniform(layers, kv, 128, d, 16).unwrap();
        let shard = l.shard(tp, 1).unwrap();
        if kv % tp == 0 {
            prop_assert_eq!(shard.bytes_for_sequence(ctx).unwrap() * tp as u64, l.bytes_for_sequence(ctx).unwrap());
        } else {
            // Fewer heads than ranks: each rank keeps one replicated head.
            prop_assert_eq!(shard.layers[0].kv_heads, 1);
            prop_assert!(shard.bytes_for_sequence(ctx).unwrap() * tp as u64 > l.bytes_for_sequence(ctx).unwrap());
        }
    }

    #[test]
    fn int4_lt_int8_lt_f16_lt_f32(l in full_layout(), ctx in 1u64..100_000) {
        let at = |d: KvDtype| l.with_dtype(d).bytes_for_sequence(ctx).unwrap();
        prop_assert!(at(KvDtype::Int4) < at(KvDtype::Int8));
        prop_assert!(at(KvDtype::Int8) < at(KvDtype::F16));
        prop_assert_eq!(at(KvDtype::F16), at(KvDtype::Bf16));
        prop_assert!(at(KvDtype::F16) < at(KvDtype::F32));
    }

    #[test]
    fn a_window_never_holds_more_than_full_attention(
        window in 1usize..10_000, ctx in 1u64..100_000, bs in 1usize..=256,
    ) {
        let sw = LayerKv { kv_heads: 8, head_dim: 128, attention: AttentionKind::SlidingWindow { window_tokens: window } };
        let windowed = KvLayout::new(vec![sw; 4], KvDtype::F16, bs).unwrap();
        let full = KvLayout::uniform(4, 8, 128, KvDtype::F16, bs).unwrap();
        prop_assert!(windowed.bytes_for_sequence(ctx).unwrap() <= full.bytes_for_sequence(ctx).unwrap());
        // A window overlaps at most ceil((window - 1) / bs) + 1 blocks, never more than the context's.
        let overlap = ((window as u64 - 1).div_ceil(bs as u64) + 1) * bs as u64;
        prop_assert_eq!(windowed.bytes_for_sequence(ctx).unwrap(), full.bytes_for_sequence(ctx.min(overlap)).unwrap());
    }

    #[test]
    fn the_pages_a_hybrid_pool_asks_for_a_sequence_are_the_layouts_bytes_for_it(
        window in 1usize..5_000, ctx in 1u64..50_000, bs in 1usize..=256,
        sliding in 1usize..=5, full in 0usize..=3,
    ) {
        // What submission refuses a request by (`WindowPool::pages_to_hold`) and what `kura plan` and
        // the server's concurrency count (`bytes_for_sequence`) are one figure.
        let sw = LayerKv { kv_heads: 8, head_dim: 128, attention: AttentionKind::SlidingWindow { window_tokens: window } };
        let fa = LayerKv { kv_heads: 8, head_dim: 128, attention: AttentionKind::Full };
        let layers: Vec<LayerKv> =
            std::iter::repeat_n(fa, full).chain(std::iter::repeat_n(sw, sliding)).collect();
        let layout = KvLayout::new(layers, KvDtype::F16, bs).unwrap();
        let page = layout.layer_bytes_per_block(0);
        let pool = layout.window_pool(page * 1000).unwrap();
        let blocks = ctx.div_ceil(bs as u64) as usize;
        prop_assert_eq!(
            pool.pages_to_hold(blocks, bs) as u64 * page,
            layout.bytes_for_sequence(ctx).unwrap()
        );
    }

    #[test]
    fn max_concurrency_fits_and_one_more_does_not(l in full_layout(), ctx in 1u64..100_000, budget_gib in 1u64..200) {
        let budget = budget_gib << 30;
        let n = l.max_concurrency(budget, ctx);
        prop_assert!(n * l.bytes_for_sequence(ctx).unwrap() <= budget);
        prop_assert!((n + 1) * l.bytes_for_sequence(ctx).unwrap() > budget);
    }
}
