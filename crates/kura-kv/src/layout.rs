//! `KvLayout`: the shape of a model's KV cache and every byte computation made on it.
//!
//! This is the one source of truth for sizes: `kura plan`, the engine's pool sizing and the metrics all call
//! it, so the planner and the running server always agree. Everything here is O(layers).
//!
//! What one token costs, per layer ([`LayerKv::bytes_per_token`]):
//!
//! ```text
//! full or sliding-window attention:  2 (K and V) × kv_heads × bytes_per_vector(head_dim)
//! MLA (DeepSeek-V2/V3):              1 latent    × bytes_per_vector(kv_lora_rank + qk_rope_head_dim)
//! ```
//!
//! What a sequence of `context` tokens holds, with paging (blocks of `block_size_tokens`):
//!
//! ```text
//! block_size 16, context 40:   [16][16][8 used, 8 empty]  -> 3 blocks = 48 token slots
//! sliding window 32, same:     only the last 32 tokens matter -> min(40, 32) = 32 -> 2 blocks
//! ```
//!
//! A windowed layer holds at most `window` tokens, rounded up to whole blocks; a full layer holds all of
//! them. The pool of a running server gives every block all layers (one block id spans the model), so for a
//! model without windowed layers `bytes_for_sequence` is exactly `blocks × bytes_per_block`.

use serde::{Deserialize, Serialize};

use crate::codec::KvDtype;

/// How a layer attends, which decides what it must keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum AttentionKind {
    /// Every earlier token: keeps the whole context.
    Full,
    /// Only the last `window_tokens` tokens (Mistral, Gemma-2/3 local layers, Phi-3).
    SlidingWindow { window_tokens: usize },
    /// Multi-head latent attention: one compressed latent of `latent_dim` elements per token instead of K
    /// and V per head (`kv_lora_rank + qk_rope_head_dim` in DeepSeek-V2/V3).
    Mla { latent_dim: usize },
}

/// The KV shape of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerKv {
    /// KV heads of this layer (ignored for MLA, whose latent is shared by all heads).
    pub kv_heads: usize,
    /// Elements of one head's K (and V) vector.
    pub head_dim: usize,
    pub attention: AttentionKind,
}

impl LayerKv {
    pub fn full(kv_heads: usize, head_dim: usize) -> Self {
        LayerKv {
            kv_heads,
            head_dim,
            attention: AttentionKind::Full,
        }
    }

    /// Bytes one token costs in this layer, in `dtype`; `None` when the sizes overflow 64 bits (shapes come
    /// from config files, so every product is checked).
    pub fn bytes_per_token(&self, dtype: KvDtype) -> Option<u64> {
        // `bytes_per_vector` multiplies elements by bits and adds at most one scale per group: with the
        // bit count checked, the rest stays below it.
        let vector = |elements: usize| -> Option<u64> {
            elements.checked_mul(dtype.bits_per_element())?;
            u64::try_from(dtype.bytes_per_vector(elements)).ok()
        };
        match self.attention {
            AttentionKind::Mla { latent_dim } => vector(latent_dim),
            AttentionKind::Full | AttentionKind::SlidingWindow { .. } => vector(self.head_dim)?
                .checked_mul(u64::try_from(self.kv_heads).ok()?)?
                .checked_mul(2),
        }
    }

    /// Tokens of a `context`-token sequence this layer must keep.
    pub fn tokens_kept(&self, context: u64) -> u64 {
        match self.attention {
            AttentionKind::SlidingWindow { window_tokens } => context.min(window_tokens as u64),
            AttentionKind::Full | AttentionKind::Mla { .. } => context,
        }
    }

    /// Blocks of `block_size` tokens this layer holds for a `context`-token sequence, paged: every
    /// block of the context, or for a sliding layer the blocks a window can overlap
    /// ([`crate::WindowPool::window_blocks`]: a window that does not start on a block boundary spans one
    /// block more than its length).
    pub fn blocks_kept(&self, context: u64, block_size: usize) -> u64 {
        let all = context.div_ceil(block_size as u64);
        match self.attention {
            AttentionKind::SlidingWindow { window_tokens } => {
                all.min(crate::WindowPool::window_blocks(window_tokens, block_size) as u64)
            }
            AttentionKind::Full | AttentionKind::Mla { .. } => all,
        }
    }
}

/// The KV cache shape of a whole model (or of one rank of it, see [`KvLayout::shard`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    pub layers: Vec<LayerKv>,
    pub dtype: KvDtype,
    /// Tokens per block; any of 1..=[`MAX_BLOCK_SIZE`] (see [`LayoutError`]).
    pub block_size_tokens: usize,
}

/// A layout that cannot exist.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("block size must be between 1 and {MAX_BLOCK_SIZE} tokens, got {0}")]
    BlockSize(usize),
    #[error("a model needs at least one layer")]
    NoLayers,
    #[error("layer {layer}: {what} must be at least 1")]
    ZeroDimension { layer: usize, what: &'static str },
    #[error("tensor parallelism must be at least 1, got {0}")]
    TensorParallel(usize),
    #[error(
        "pipeline parallelism must be between 1 and the number of layers ({layers}), got {pp}"
    )]
    PipelineParallel { pp: usize, layers: usize },
    #[error("{0} layers; at most {max} are supported", max = KvLayout::MAX_LAYERS)]
    TooManyLayers(usize),
    #[error("KV sizes overflow 64-bit byte counts: {0}")]
    TooLarge(String),
}

/// The most tokens a block may hold, everywhere in Kura (the server's pool, the planner, the manager and
/// the simulator, which replays Mooncake's 512-token blocks).
pub const MAX_BLOCK_SIZE: usize = 1024;

impl KvLayout {
    pub const MAX_BLOCK_SIZE: usize = MAX_BLOCK_SIZE;
    /// The most layers a model may have (the largest models have a few hundred): readers check a
    /// config's layer count against it before allocating per-layer tables.
    pub const MAX_LAYERS: usize = 1 << 16;

    pub fn new(
        layers: Vec<LayerKv>,
        dtype: KvDtype,
        block_size_tokens: usize,
    ) -> Result<Self, LayoutError> {
        if block_size_tokens == 0 || block_size_tokens > Self::MAX_BLOCK_SIZE {
            return Err(LayoutError::BlockSize(block_size_tokens));
        }
        if layers.is_empty() {
            return Err(LayoutError::NoLayers);
        }
        for (i, l) in layers.iter().enumerate() {
            let zero = match l.attention {
                AttentionKind::Mla { latent_dim: 0 } => Some("latent_dim"),
                AttentionKind::SlidingWindow { window_tokens: 0 } => Some("window"),
                AttentionKind::Mla { .. } => None,
                _ if l.kv_heads == 0 => Some("kv_heads"),
                _ if l.head_dim == 0 => Some("head_dim"),
                _ => None,
            };
            if let Some(what) = zero {
                return Err(LayoutError::ZeroDimension { layer: i, what });
            }
        }
        if layers.len() > Self::MAX_LAYERS {
            return Err(LayoutError::TooManyLayers(layers.len()));
        }
        let layout = KvLayout {
            layers,
            dtype,
            block_size_tokens,
        };
        // A whole-model block must have a byte count in every element format (so that `with_dtype` and
        // the per-token, per-block sizes below never overflow); sequences are checked per call.
        for d in KvDtype::ALL {
            if layout.with_dtype(d).checked_bytes_per_block().is_none() {
                let bs = block_size_tokens as u64;
                let what = match layout.layers.iter().enumerate().find(|(_, l)| {
                    l.bytes_per_token(d)
                        .and_then(|b| b.checked_mul(bs))
                        .is_none()
                }) {
                    Some((i, l)) => match l.attention {
                        AttentionKind::Mla { latent_dim } => format!(
                            "layer {i}: latent_dim {latent_dim} × {bs} tokens in {}",
                            d.name()
                        ),
                        _ => format!(
                            "layer {i}: {} kv heads × head_dim {} × {bs} tokens in {}",
                            l.kv_heads,
                            l.head_dim,
                            d.name()
                        ),
                    },
                    None => format!(
                        "{} layers × {bs} tokens in {}",
                        layout.layers.len(),
                        d.name()
                    ),
                };
                return Err(LayoutError::TooLarge(what));
            }
        }
        Ok(layout)
    }

    fn checked_bytes_per_token(&self) -> Option<u64> {
        self.layers.iter().try_fold(0u64, |sum, l| {
            sum.checked_add(l.bytes_per_token(self.dtype)?)
        })
    }

    fn checked_bytes_per_block(&self) -> Option<u64> {
        self.checked_bytes_per_token()?
            .checked_mul(self.block_size_tokens as u64)
    }

    /// The same full-attention shape in every layer: the common case (Llama, Qwen2, SmolLM2).
    pub fn uniform(
        num_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
        block_size_tokens: usize,
    ) -> Result<Self, LayoutError> {
        Self::new(
            vec![LayerKv::full(kv_heads, head_dim); num_layers],
            dtype,
            block_size_tokens,
        )
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Whether any layer keeps less than the whole context.
    pub fn has_sliding_window(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(l.attention, AttentionKind::SlidingWindow { .. }))
    }

    /// The layout Kura's pool really holds: a pool block spans every layer, so a windowed layer keeps as
    /// many tokens as a full one (its blocks outside the window are not freed on their own). Capacity
    /// figures of the server come from this; the windowed layout is what a pool per layer group would
    /// hold.
    pub fn whole_model_pool(&self) -> KvLayout {
        KvLayout {
            layers: self
                .layers
                .iter()
                .map(|l| LayerKv {
                    attention: match l.attention {
                        AttentionKind::SlidingWindow { .. } => AttentionKind::Full,
                        other => other,
                    },
                    ..*l
                })
                .collect(),
            dtype: self.dtype,
            block_size_tokens: self.block_size_tokens,
        }
    }

    /// Bytes one token costs across all layers, before paging. [`KvLayout::new`] checked that it fits;
    /// a layout whose public fields were edited past that saturates instead of wrapping.
    pub fn bytes_per_token(&self) -> u64 {
        self.checked_bytes_per_token().unwrap_or(u64::MAX)
    }

    /// Bytes one block holds in one layer (0 for a layer the layout does not have).
    pub fn layer_bytes_per_block(&self, layer: usize) -> u64 {
        self.layers
            .get(layer)
            .and_then(|l| l.bytes_per_token(self.dtype))
            .and_then(|b| b.checked_mul(self.block_size_tokens as u64))
            .unwrap_or(0)
    }

    /// Bytes of one pool block spanning every layer (checked by [`KvLayout::new`], as `bytes_per_token`).
    pub fn bytes_per_block(&self) -> u64 {
        self.checked_bytes_per_block().unwrap_or(u64::MAX)
    }

    /// Blocks that hold `tokens` tokens: never loses a token, wastes less than one block.
    pub fn blocks_for_tokens(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.block_size_tokens as u64)
    }

    /// Bytes a sequence of `context` tokens holds, paged, windowed layers capped at the blocks their
    /// window overlaps ([`LayerKv::blocks_kept`]); `None` when that is beyond 64 bits.
    pub fn bytes_for_sequence(&self, context: u64) -> Option<u64> {
        self.layers.iter().try_fold(0u64, |sum, l| {
            let slots = l
                .blocks_kept(context, self.block_size_tokens)
                .checked_mul(self.block_size_tokens as u64)?;
            sum.checked_add(slots.checked_mul(l.bytes_per_token(self.dtype)?)?)
        })
    }

    /// The hybrid pool `budget_bytes` holds for this layout, when it has one: some layers slide, all
    /// with one window, and every layer has the same KV shape (a page is one layer of one block). Its
    /// concurrency is this layout's [`KvLayout::max_concurrency`]: a sequence takes
    /// `bytes_for_sequence / page bytes` pages.
    pub fn window_pool(&self, budget_bytes: u64) -> Option<crate::WindowPool> {
        let mut windows = self.layers.iter().filter_map(|l| match l.attention {
            AttentionKind::SlidingWindow { window_tokens } => Some(window_tokens),
            _ => None,
        });
        let window_tokens = windows.next()?;
        let first = self.layers[0];
        let uniform = self.layers.iter().all(|l| {
            (l.kv_heads, l.head_dim) == (first.kv_heads, first.head_dim)
                && !matches!(l.attention, AttentionKind::Mla { .. })
        });
        if !uniform || windows.any(|w| w != window_tokens) {
            return None;
        }
        let page = self.layer_bytes_per_block(0);
        let num_pages = budget_bytes.checked_div(page)?;
        let num_pages = u32::try_from(num_pages)
            .unwrap_or(u32::MAX - 1)
            .min(u32::MAX - 1);
        Some(crate::WindowPool {
            sliding: self
                .layers
                .iter()
                .map(|l| matches!(l.attention, AttentionKind::SlidingWindow { .. }))
                .collect(),
            window_tokens,
            num_pages,
        })
    }

    /// Bytes `batch` sequences of `context` tokens each hold; `None` beyond 64 bits.
    pub fn bytes_for_batch(&self, context: u64, batch: u64) -> Option<u64> {
        self.bytes_for_sequence(context)?.checked_mul(batch)
    }

    /// Pool blocks that fit in `budget_bytes` (each spanning every layer).
    pub fn num_blocks_for_budget(&self, budget_bytes: u64) -> u64 {
        budget_bytes
            .checked_div(self.bytes_per_block())
            .unwrap_or(0)
    }

    /// Sequences of `context` tokens that fit in `budget_bytes` at once (none when one sequence is
    /// beyond 64 bits of bytes).
    pub fn max_concurrency(&self, budget_bytes: u64, context: u64) -> u64 {
        match self.bytes_for_sequence(context.max(1)) {
            None | Some(0) => 0,
            Some(per_seq) => budget_bytes / per_seq,
        }
    }

    /// The longest context (a whole number of blocks) such that `batch` sequences of it fit in
    /// `budget_bytes`; 0 when not even one block each fits. O(layers × log context).
    pub fn max_context_for_batch(&self, budget_bytes: u64, batch: u64, context_limit: u64) -> u64 {
        let batch = batch.max(1);
        let fits = |ctx: u64| {
            self.bytes_for_batch(ctx, batch)
                .is_some_and(|b| b <= budget_bytes)
        };
        if fits(context_limit) {
            return context_limit;
        }
        // Search over whole blocks (bytes are monotone in context) below the limit, which does not fit:
        // `hi` blocks hold fewer than `context_limit` tokens, so `mid * bs` cannot overflow.
        let bs = self.block_size_tokens as u64;
        let (mut lo, mut hi) = (0u64, context_limit.div_ceil(bs).saturating_sub(1));
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if fits(mid * bs) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo * bs
    }

    /// The layout one rank holds under tensor parallelism `tp` (kv heads per rank = max(1, kv_heads / tp):
    /// heads are split, or replicated when fewer than ranks; an MLA latent is replicated on every rank) and
    /// pipeline parallelism `pp` (the first stage, which holds ceil(layers / pp) layers, the most of any).
    pub fn shard(&self, tp: usize, pp: usize) -> Result<KvLayout, LayoutError> {
        if tp == 0 {
            return Err(LayoutError::TensorParallel(tp));
        }
        if pp == 0 || pp > self.layers.len() {
            return Err(LayoutError::PipelineParallel {
                pp,
                layers: self.layers.len(),
            });
        }
        let layers_per_stage = self.layers.len().div_ceil(pp);
        let layers = self.layers[..layers_per_stage]
            .iter()
            .map(|l| LayerKv {
                kv_heads: (l.kv_heads / tp).max(1),
                ..*l
            })
            .collect();
        Ok(KvLayout {
            layers,
            dtype: self.dtype,
            block_size_tokens: self.block_size_tokens,
        })
    }

    /// The same shape in another element format.
    pub fn with_dtype(&self, dtype: KvDtype) -> KvLayout {
        KvLayout {
            dtype,
            ..self.clone()
        }
    }

    /// The same shape with another block size.
    pub fn with_block_size(&self, block_size_tokens: usize) -> Result<KvLayout, LayoutError> {
        KvLayout::new(self.layers.clone(), self.dtype, block_size_tokens)
    }

    /// Appends this layout's identity to `out` as bytes for the server's KV fingerprint: a stable
    /// encoding that changes only when the bytes a block holds change (never Rust's `Debug` output).
    /// Fixed-width little-endian fields:
    ///
    /// ```text
    /// u64 element format code   f32 1, f16 2, bf16 3, fp8 4, int8 5, int4 6
    /// u64 block size in tokens
    /// u64 number of layers, then per layer:
    ///     u64 attention code    full 1, sliding window 2, MLA 3
    ///     u64 kv heads
    ///     u64 head dim
    ///     u64 parameter         full 0, sliding window: window tokens, MLA: latent dim
    /// ```
    ///
    /// New variants take new codes; a changed meaning of any field needs a new version tag in the
    /// fingerprint that embeds this.
    pub fn encode_for_fingerprint(&self, out: &mut Vec<u8>) {
        // usize is at most 64 bits on every platform Rust supports: the cast is lossless.
        let mut put = |v: usize| out.extend_from_slice(&(v as u64).to_le_bytes());
        put(match self.dtype {
            KvDtype::F32 => 1,
            KvDtype::F16 => 2,
            KvDtype::Bf16 => 3,
            KvDtype::Fp8 => 4,
            KvDtype::Int8 => 5,
            KvDtype::Int4 => 6,
        });
        put(self.block_size_tokens);
        put(self.layers.len());
        for l in &self.layers {
            let (code, param) = match l.attention {
                AttentionKind::Full => (1, 0),
                AttentionKind::SlidingWindow { window_tokens } => (2, window_tokens),
                AttentionKind::Mla { latent_dim } => (3, latent_dim),
            };
            put(code);
            put(l.kv_heads);
            put(l.head_dim);
            put(param);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn qwen25_32b_one_request_at_32k_f16_is_8_gib() {
        // 2 × 64 layers × 8 kv heads × 128 head dim × 2 bytes × 32,768 tokens
        let l = KvLayout::uniform(64, 8, 128, KvDtype::F16, 16).unwrap();
        assert_eq!(
            l.bytes_for_sequence(32_768),
            Some(2 * 64 * 8 * 128 * 2 * 32_768)
        );
        assert_eq!(l.bytes_for_sequence(32_768), Some(8_589_934_592));
    }

    #[test]
    fn mha_32_layers_f32_batch_32_context_2048_is_64_gib() {
        let l = KvLayout::uniform(32, 32, 128, KvDtype::F32, 16).unwrap();
        assert_eq!(l.bytes_for_batch(2048, 32), Some(64 * GIB));
    }

    #[test]
    fn paging_rounds_up_to_whole_blocks() {
        let l = KvLayout::uniform(2, 1, 4, KvDtype::F32, 16).unwrap();
        let per_token = 2 * 2 * 4 * 4;
        assert_eq!(l.bytes_per_token(), per_token);
        assert_eq!(l.bytes_for_sequence(40), Some(48 * per_token));
        assert_eq!(l.bytes_for_sequence(48), Some(48 * per_token));
        assert_eq!(l.bytes_for_sequence(49), Some(64 * per_token));
        assert_eq!(l.blocks_for_tokens(0), 0);
    }

    #[test]
    fn sliding_window_layers_keep_at_most_the_window() {
        // Two layers: one full, one with a 32-token window, block size 16.
        let layers = vec![
            LayerKv::full(1, 4),
            LayerKv {
                kv_heads: 1,
                head_dim: 4,
                attention: AttentionKind::SlidingWindow { window_tokens: 32 },
            },
        ];
        let l = KvLayout::new(layers, KvDtype::F32, 16).unwrap();
        let per_layer_token = 2 * 4 * 4;
        assert_eq!(l.bytes_for_sequence(20), Some((32 + 32) * per_layer_token));
        // A window of 32 that does not start on a block boundary overlaps 3 blocks of 16.
        assert_eq!(
            l.bytes_for_sequence(1000),
            Some((1008 + 48) * per_layer_token)
        );
    }

    #[test]
    fn mla_keeps_one_latent_not_k_and_v() {
        // DeepSeek-V3: 61 layers × (512 + 64) elements × 2 bytes (bf16) = 70,272 bytes per token.
        let layers = vec![
            LayerKv {
                kv_heads: 128,
                head_dim: 192,
                attention: AttentionKind::Mla { latent_dim: 576 }
            };
            61
        ];
        let l = KvLayout::new(layers, KvDtype::Bf16, 64).unwrap();
        assert_eq!(l.bytes_per_token(), 70_272);
        // Replicated, not split, across tensor-parallel ranks.
        assert_eq!(l.shard(8, 1).unwrap().bytes_per_token(), 70_272);
    }

    #[test]
    fn tensor_and_pipeline_parallel_shards() {
        let l = KvLayout::uniform(80, 8, 128, KvDtype::F16, 16).unwrap();
        assert_eq!(
            l.shard(4, 1).unwrap().bytes_per_token() * 4,
            l.bytes_per_token()
        );
        // 16 ranks for 8 heads: each rank keeps one replicated head.
        assert_eq!(l.shard(16, 1).unwrap().layers[0].kv_heads, 1);
        // 80 layers over 3 stages: the first holds 27.
        assert_eq!(l.shard(1, 3).unwrap().num_layers(), 27);
        assert!(matches!(l.shard(0, 1), Err(LayoutError::TensorParallel(0))));
        assert!(matches!(
            l.shard(1, 81),
            Err(LayoutError::PipelineParallel { pp: 81, layers: 80 })
        ));
    }

    #[test]
    fn max_context_for_batch_is_the_largest_that_fits() {
        let l = KvLayout::uniform(30, 3, 64, KvDtype::F16, 16).unwrap();
        let budget = 100 << 20;
        let ctx = l.max_context_for_batch(budget, 4, 1 << 20);
        assert_eq!(ctx % 16, 0);
        assert!(l.bytes_for_batch(ctx, 4).unwrap() <= budget);
        assert!(l.bytes_for_batch(ctx + 16, 4).unwrap() > budget);
        // A limit that already fits is returned as is.
        assert_eq!(l.max_context_for_batch(budget, 1, 100), 100);
    }

    #[test]
    fn invalid_layouts_are_named() {
        assert_eq!(
            KvLayout::uniform(1, 1, 1, KvDtype::F16, 0),
            Err(LayoutError::BlockSize(0))
        );
        assert_eq!(
            KvLayout::uniform(1, 1, 1, KvDtype::F16, 1025),
            Err(LayoutError::BlockSize(1025))
        );
        assert_eq!(
            KvLayout::uniform(0, 1, 1, KvDtype::F16, 16),
            Err(LayoutError::NoLayers)
        );
        assert_eq!(
            KvLayout::uniform(2, 0, 64, KvDtype::F16, 16),
            Err(LayoutError::ZeroDimension {
                layer: 0,
                what: "kv_heads"
            })
        );
    }

    #[test]
    fn sizes_beyond_64_bits_are_none_or_errors_never_wrapped() {
        let l = KvLayout::uniform(30, 3, 64, KvDtype::F16, 16).unwrap();
        assert_eq!(l.bytes_for_sequence(u64::MAX), None);
        assert_eq!(l.bytes_for_batch(4096, u64::MAX), None);
        assert_eq!(l.max_concurrency(1 << 40, u64::MAX), 0);
        // The longest context for an absurd batch: nothing fits, and nothing overflows finding that out.
        assert_eq!(l.max_context_for_batch(1 << 40, u64::MAX, u64::MAX), 0);
        let one = l.bytes_for_sequence(16).unwrap();
        assert_eq!(l.max_context_for_batch(one, 1, u64::MAX), 16);
        for (layers, kv, hd) in [
            (1, usize::MAX, 128),
            (1, 1, usize::MAX / 2),
            (1 << 16, 1 << 20, 1 << 22),
        ] {
            let err = KvLayout::uniform(layers, kv, hd, KvDtype::F16, 16).unwrap_err();
            assert!(matches!(err, LayoutError::TooLarge(_)), "{err}");
            assert!(err.to_string().contains("overflow"), "{err}");
        }
        assert_eq!(
            KvLayout::uniform(KvLayout::MAX_LAYERS + 1, 1, 2, KvDtype::F16, 16),
            Err(LayoutError::TooManyLayers(KvLayout::MAX_LAYERS + 1))
        );
    }

    #[test]
    fn the_fingerprint_encoding_is_fixed_width_little_endian() {
        let layout = KvLayout::new(
            vec![
                LayerKv::full(2, 64),
                LayerKv {
                    kv_heads: 1,
                    head_dim: 256,
                    attention: AttentionKind::SlidingWindow { window_tokens: 512 },
                },
                LayerKv {
                    kv_heads: 1,
                    head_dim: 1,
                    attention: AttentionKind::Mla { latent_dim: 576 },
                },
            ],
            KvDtype::Int8,
            16,
        )
        .unwrap();
        let mut out = Vec::new();
        layout.encode_for_fingerprint(&mut out);
        let words: Vec<u64> = out
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(out.len(), 8 * words.len());
        #[rustfmt::skip]
        let expected = [
            5, 16, 3,        // int8, 16 tokens per block, 3 layers
            1, 2, 64, 0,     // full, 2 kv heads × 64
            2, 1, 256, 512,  // sliding window of 512, 1 kv head × 256
            3, 1, 1, 576,    // MLA, latent of 576
        ];
        assert_eq!(words, expected);
        // Every element format has its own code, and every field counts.
        let codes: std::collections::HashSet<Vec<u8>> = KvDtype::ALL
            .iter()
            .map(|&d| {
                let mut o = Vec::new();
                layout.with_dtype(d).encode_for_fingerprint(&mut o);
                o
            })
            .collect();
        assert_eq!(codes.len(), KvDtype::ALL.len());
        let mut other = Vec::new();
        layout
            .with_block_size(32)
            .unwrap()
            .encode_for_fingerprint(&mut other);
        assert_ne!(other, out);
    }
}
