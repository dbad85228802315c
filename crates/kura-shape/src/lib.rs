//! `kura-shape` — the one reader of a model's shape, for `kura plan` and the runtime alike:
//!
//! ```text
//!  HF config.json ──────────────┐
//!  GGUF metadata (gguf_spec) ───┴─► ModelSpec (layers, heads, widths, vocab, context, per-layer
//!                                    attention: full, sliding window, MLA; MoE) ─► KvLayout
//! ```
//!
//! Every architecture the planner's catalog knows is read here (MLA, MoE, sliding and mixed windows). The
//! runtime (`kura-model`) takes its shape from the same [`ModelSpec`] and refuses what it cannot run with
//! an error naming it; the planner (`kura-plan`) sizes memory from it. Both take their `KvLayout` from
//! [`ModelSpec::kv_layout`], so the two cannot disagree about a file. The runtime's own numbers that do not
//! decide memory (RoPE, norms, biases) it reads itself.

pub mod attn_split;
mod gguf;
pub mod spec;
mod weights;

pub use gguf::{GgufMetadata, GGUF_TO_HF};
pub use spec::{kv_layout, MlaSpec, ModelSpec, MoeSpec, SpecError, MAX_CONTEXT};
pub use weights::WeightsDtype;
