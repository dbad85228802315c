//! The capacity planner behind `kura plan`: how much KV cache a model gets on given memory, and how many
//! requests of a given context fit in it.
//!
//! ```text
//! memory × utilization                                  usable, per device
//!   − weights / (tp × pp)                               exact for a GGUF file, else params × bytes/param
//!   − runtime overhead                                  estimate, --overhead overrides
//!   − activation peak                                   estimate, --activation overrides
//!   − host KV tier (L2)                                 on the CPU only: the same RAM as the pool
//!   = KV budget  →  num_blocks = budget / bytes_per_block      (KvLayout, the same math as the server)
//!                →  max_concurrency = budget / bytes_for_sequence(context)
//!                →  under `--scheduling guaranteed`: num_blocks / blocks of (context − 1) tokens
//! ```
//!
//! The estimates, and what they stand on:
//! - Runtime overhead: on an accelerator 1 GiB (the CUDA/ROCm context, about 0.5 GiB, plus BLAS and
//!   collective-communication workspaces and captured graphs, which vLLM measures at a few hundred MiB);
//!   on the CPU 256 MiB (Kura's threads, tokenizer, request buffers and per-step scratch).
//! - Activation peak: the largest forward step, `max_batched_tokens` tokens (default 8,192, vLLM's
//!   chunked-prefill budget) through one layer at a time: the residual stream and its normed copy, Q/K/V,
//!   attention output and the gated FFN's two intermediate tensors, in the activation format (2 bytes, or 4
//!   for f32 weights); plus f32 logits for up to 256 sequences. Attention scores are not materialised
//!   (flash-style kernels), so context length does not enter.
//!
//! The lower KV tiers (a host-memory tier and a disk tier, see [`tiers`]) are reported beside the pool;
//! the host tier is host memory on top of the pool, so on the CPU it is a term of the breakdown.
//!
//! All of it is O(layers).

pub mod catalog;
pub mod tiers;
/// The model shape reader, shared with the runtime (`kura-shape`).
pub use kura_shape as spec;

use serde::Serialize;

use kura_kv::codec::KvDtype;
use kura_kv::layout::{KvLayout, LayoutError};
use kura_kv::units::format_bytes;
use spec::ModelSpec;

pub use kura_shape::WeightsDtype;
pub use tiers::{DiskTier, LowerTiers, Preemption, TierReport};

/// Where the model runs, for the default overhead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    Accelerator,
    Cpu,
}

/// How `kura serve --scheduling` admits requests: the scheduler's own admission mode.
pub use kura_sched::AdmissionMode as Scheduling;

/// What `kura serve --scheduling guaranteed` admits at once: requests of the planned context, each with
/// every block of its full length reserved and no prefix shared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GuaranteedAdmission {
    /// Blocks one request of `context` tokens (prompt + output) reserves: its KV holds every token but
    /// the last, which is never fed back, so `ceil((context − 1) / block_size)`.
    pub blocks_per_request: u64,
    /// `num_blocks / blocks_per_request`: requests admitted at once with their blocks reserved.
    pub max_concurrency: u64,
}

/// What the user asked.
#[derive(Clone, Debug)]
pub struct PlanRequest {
    pub spec: ModelSpec,
    /// Exact weight bytes (a GGUF file's size); `None` = params × `weights_dtype`.
    pub weights_bytes: Option<u64>,
    pub weights_dtype: WeightsDtype,
    pub kv_dtype: KvDtype,
    pub block_size_tokens: usize,
    /// Tokens per request; `None` = the model's maximum context.
    pub context: Option<u64>,
    pub batch: u64,
    pub tp: usize,
    pub pp: usize,
    pub device: Device,
    /// Memory of one device; with `kv_cache_memory` set it is not needed.
    pub memory_bytes: Option<u64>,
    pub memory_utilization: f64,
    /// A KV budget given directly (as `kura serve --kv-cache-memory`): skips the memory arithmetic.
    pub kv_cache_memory: Option<u64>,
    pub overhead_bytes: Option<u64>,
    pub activation_bytes: Option<u64>,
    pub max_batched_tokens: u64,
    /// The lower KV tiers, in blocks of [`PlanRequest::pool_layout`] as `kura serve` counts them.
    pub tiers: LowerTiers,
    /// `--scheduling`: under `Guaranteed` the report says how many requests are admitted with every
    /// block reserved.
    pub scheduling: Scheduling,
    /// A model with sliding layers gets the hybrid pool (`kura serve` without `--no-hybrid-pool`).
    pub hybrid_pool: bool,
}

/// A plan that cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(
        "give the memory (--memory SIZE or --gpu NAME) or a KV budget (--kv-cache-memory SIZE)"
    )]
    NoMemory,
    #[error("--memory-utilization must be in (0, 1], got {0}")]
    Utilization(f64),
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    #[error("{flag} {got} is beyond what Kura plans for (at most {max})")]
    OutOfRange {
        flag: &'static str,
        got: u64,
        max: u64,
    },
    #[error("{0} overflows 64-bit byte counts; ask for less")]
    TooLarge(String),
}

/// The largest `--tp` and `--pp` (devices a plan spans).
pub const MAX_PARALLEL: usize = 4096;

/// The answer, every byte count exact (per device unless named otherwise).
#[derive(Clone, Debug, Serialize)]
pub struct PlanReport {
    pub model: String,
    pub source: String,
    pub params: u64,
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub attention: String,
    pub kv_dtype: KvDtype,
    pub block_size: usize,
    pub context: u64,
    pub model_max_context: Option<u64>,
    pub batch: u64,
    pub tp: usize,
    pub pp: usize,
    /// Where the KV pool is: an accelerator's memory or the CPU's RAM.
    pub device: Device,
    /// Whole model, all ranks.
    pub kv_bytes_per_token: u64,
    /// Whole model, all ranks, paged.
    pub kv_bytes_per_request: u64,
    /// `batch` requests, whole model.
    pub kv_bytes_total: u64,
    pub kv_bytes_per_token_per_device: u64,
    pub kv_bytes_per_request_per_device: u64,
    pub bytes_per_block_per_device: u64,
    pub memory_bytes: Option<u64>,
    pub memory_utilization: Option<f64>,
    pub weights_bytes: u64,
    pub weights_exact: bool,
    pub overhead_bytes: u64,
    pub activation_bytes: u64,
    pub kv_budget_bytes: u64,
    pub num_blocks: u64,
    pub max_tokens_in_pool: u64,
    pub max_concurrency: u64,
    /// The longest context at which `batch` requests still fit.
    pub max_context_for_batch: u64,
    /// Whether weights, overhead and activations (and the host KV tier, where it is a term of the
    /// breakdown) fit in the usable memory at all; when they do not, the KV figures above are still exact
    /// and the budget, blocks and concurrency are 0.
    pub fits: bool,
    /// Bytes missing for the model to fit (0 when it fits).
    pub short_bytes: u64,
    pub fits_batch: bool,
    /// For models with sliding-window layers: the bytes of one request and the concurrency when each
    /// sliding layer holds only the blocks its window overlaps (Kura's hybrid pool).
    pub windowed_kv_bytes_per_request: Option<u64>,
    pub windowed_max_concurrency: Option<u64>,
    /// The hybrid pool `kura serve` runs with the same flags (sliding layers paged apart), when it does:
    /// then `max_concurrency` and `kv_bytes_per_request` are its figures.
    pub hybrid_pool: Option<HybridPoolReport>,
    /// Requests of `context` tokens a whole-model pool (every layer holding the whole context) would hold.
    pub whole_model_max_concurrency: u64,
    /// The lower KV tiers beside the pool, per device.
    pub kv_tiers: TierReport,
    pub scheduling: Scheduling,
    /// Under `--scheduling guaranteed`: requests of `context` tokens admitted at once with every block
    /// reserved (`null` otherwise).
    pub guaranteed_admission: Option<GuaranteedAdmission>,
    pub warnings: Vec<String>,
}

/// The hybrid pool of a model with sliding layers, per device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HybridPoolReport {
    /// Pages of one layer of one block.
    pub num_pages: u64,
    pub page_bytes: u64,
    pub full_layers: usize,
    pub sliding_layers: usize,
    pub window_tokens: usize,
    /// Blocks a sliding layer holds per request at most (those a window overlaps).
    pub window_blocks: u64,
    /// Pages one request of `context` tokens holds.
    pub pages_per_request: u64,
}

pub const DEFAULT_CONTEXT: u64 = 4096;
/// `kura serve`'s default step budget (`kura_engine::DEFAULT_MAX_BATCHED_TOKENS`; the kura binary's tests
/// check that the two agree).
pub const DEFAULT_MAX_BATCHED_TOKENS: u64 = 8192;
const MAX_SEQS_FOR_LOGITS: u64 = 256;

impl PlanRequest {
    /// A request with the defaults of `kura plan`.
    pub fn new(spec: ModelSpec) -> Self {
        PlanRequest {
            spec,
            weights_bytes: None,
            weights_dtype: WeightsDtype::Bf16,
            kv_dtype: KvDtype::F16,
            block_size_tokens: 16,
            context: None,
            batch: 1,
            tp: 1,
            pp: 1,
            device: Device::Accelerator,
            memory_bytes: None,
            memory_utilization: 0.9,
            kv_cache_memory: None,
            overhead_bytes: None,
            activation_bytes: None,
            max_batched_tokens: DEFAULT_MAX_BATCHED_TOKENS,
            tiers: LowerTiers::default(),
            scheduling: Scheduling::default(),
            hybrid_pool: true,
        }
    }

    /// The layout of one device's pool, whole-model blocks (windowed layers at the full context, as
    /// `kura serve` holds them): what the KV figures and the lower tiers' blocks are counted in.
    pub fn pool_layout(&self) -> Result<KvLayout, PlanError> {
        self.check_parallel()?;
        Ok(self
            .spec
            .kv_layout(self.kv_dtype, self.block_size_tokens)?
            .shard(self.tp, self.pp)?
            .whole_model_pool())
    }

    fn check_parallel(&self) -> Result<(), PlanError> {
        for (flag, v) in [("--tp", self.tp), ("--pp", self.pp)] {
            if v > MAX_PARALLEL {
                return Err(PlanError::OutOfRange {
                    flag,
                    got: v as u64,
                    max: MAX_PARALLEL as u64,
                });
            }
        }
        Ok(())
    }

    fn default_overhead(&self) -> u64 {
        match self.device {
            Device::Accelerator => 1 << 30,
            Device::Cpu => 256 << 20,
        }
    }

    /// The activation-peak estimate of the module docs, per device; `None` when it leaves 64 bits.
    pub fn estimate_activation(&self) -> Option<u64> {
        let s = &self.spec;
        let act_bytes: u128 = if self.weights_dtype == WeightsDtype::F32 {
            4
        } else {
            2
        };
        let tp = self.tp.max(1) as u128;
        // Every factor is below 2^64, so each product of two fits u128; the sums are checked.
        let q_dim = s.num_heads as u128 * s.head_dim as u128;
        let kv_dim = s.num_kv_heads as u128 * s.head_dim as u128;
        let sharded = q_dim
            .checked_mul(2)?
            .checked_add(kv_dim.checked_mul(2)?)?
            .checked_add((s.active_ffn_width() as u128).checked_mul(2)?)?
            / tp;
        let per_token = (s.hidden_size as u128)
            .checked_mul(2)?
            .checked_add(sharded)?;
        let tokens = self.max_batched_tokens as u128;
        let logits =
            (tokens.min(MAX_SEQS_FOR_LOGITS as u128)).checked_mul(s.vocab_size as u128)? / tp * 4;
        let total = tokens
            .checked_mul(per_token)?
            .checked_mul(act_bytes)?
            .checked_add(logits)?;
        u64::try_from(total).ok()
    }

    pub fn plan(&self) -> Result<PlanReport, PlanError> {
        if self.batch == 0 {
            return Err(PlanError::Zero("--batch"));
        }
        if self.max_batched_tokens == 0 {
            return Err(PlanError::Zero("--max-batched-tokens"));
        }
        self.check_parallel()?;
        if !(self.memory_utilization > 0.0 && self.memory_utilization <= 1.0) {
            return Err(PlanError::Utilization(self.memory_utilization));
        }
        let s = &self.spec;
        let mut warnings = Vec::new();
        let context = self
            .context
            .unwrap_or(s.max_context.unwrap_or(DEFAULT_CONTEXT));
        if context == 0 {
            return Err(PlanError::Zero("--context"));
        }
        if context > spec::MAX_CONTEXT {
            return Err(PlanError::OutOfRange {
                flag: "--context",
                got: context,
                max: spec::MAX_CONTEXT,
            });
        }
        if let Some(max) = s.max_context {
            if context > max {
                warnings.push(format!(
                    "context {context} exceeds the model's maximum of {max} tokens; computed anyway"
                ));
            }
        }
        let windowed = s.kv_layout(self.kv_dtype, self.block_size_tokens)?;
        let windowed_rank = windowed.shard(self.tp, self.pp)?;
        // Every figure is what Kura's pool holds: whole-model blocks, windowed layers included.
        let layout = windowed.whole_model_pool();
        let rank = windowed_rank.whole_model_pool();
        if self.tp > s.num_kv_heads && s.mla.is_none() {
            warnings.push(format!(
                "--tp {} exceeds the {} KV heads: each rank keeps a replicated head",
                self.tp, s.num_kv_heads
            ));
        }

        // The KV figures: the answer to the question asked, whether or not the model fits.
        let too_large = |what: String| PlanError::TooLarge(what);
        let copies = rank_copies(&layout, &rank, self.tp);
        let kv_bytes_per_token = layout
            .bytes_per_token()
            .checked_mul(copies)
            .ok_or_else(|| too_large(format!("KV per token across --tp {}", self.tp)))?;
        let per_request = layout
            .bytes_for_sequence(context)
            .and_then(|b| b.checked_mul(copies))
            .ok_or_else(|| too_large(format!("KV for one request of {context} tokens")))?;
        let kv_bytes_total = per_request.checked_mul(self.batch).ok_or_else(|| {
            too_large(format!(
                "KV for --batch {} requests of {context} tokens",
                self.batch
            ))
        })?;
        let per_request_per_device = rank
            .bytes_for_sequence(context)
            .ok_or_else(|| too_large(format!("KV for one request of {context} tokens")))?;

        let devices = (self.tp * self.pp) as u64;
        let (weights_total, weights_exact) = match self.weights_bytes {
            Some(b) => (b, true),
            None => (
                // A float-to-integer cast saturates; params are checked at 64 bits.
                (s.params() as f64 * self.weights_dtype.bits_per_weight() / 8.0).ceil() as u64,
                false,
            ),
        };
        let weights = weights_total.div_ceil(devices);
        let overhead = self
            .overhead_bytes
            .unwrap_or_else(|| self.default_overhead());
        let activation = match self.activation_bytes {
            Some(a) => a,
            None => self.estimate_activation().ok_or_else(|| {
                too_large(format!(
                    "the activation estimate for --max-batched-tokens {}",
                    self.max_batched_tokens
                ))
            })?,
        };

        // The lower tiers, in the pool's blocks. On the CPU the host tier is the same RAM as the pool, so
        // it is a term of the breakdown when the budget comes from the memory.
        let host_in_breakdown = self.device == Device::Cpu && self.kv_cache_memory.is_none();
        let kv_tiers = TierReport::new(
            &self.tiers,
            rank.bytes_per_block(),
            self.block_size_tokens as u64,
            host_in_breakdown,
        )
        .ok_or_else(|| too_large("the lower KV tiers' bytes".into()))?;
        let host_term = if kv_tiers.host_in_breakdown {
            kv_tiers.host_bytes
        } else {
            0
        };

        let (kv_budget, memory, short_bytes) = match (self.kv_cache_memory, self.memory_bytes) {
            (Some(kv), mem) => (kv, mem, 0),
            (None, None) => return Err(PlanError::NoMemory),
            (None, Some(mem)) => {
                let usable = (mem as f64 * self.memory_utilization).floor() as u64;
                // Sizes from flags or estimates: the sums are taken wide, so they cannot wrap.
                let model_needs = weights as u128 + overhead as u128 + activation as u128;
                let needed = model_needs + host_term as u128;
                match u64::try_from(needed)
                    .ok()
                    .and_then(|n| usable.checked_sub(n))
                {
                    Some(budget) => (budget, Some(mem), 0),
                    None => {
                        let short = u64::try_from(needed - usable as u128).unwrap_or(u64::MAX);
                        let warning = if model_needs <= usable as u128 {
                            // The model fits: the host tier is what leaves no room for the pool.
                            format!(
                                "the host KV tier does not fit: --kv-host-memory takes {} ({} blocks), \
                                 host memory on top of the KV pool and on the CPU the same RAM, but \
                                 weights {} + overhead {} + activations {} per device leave {} of the {} \
                                 usable ({} × {}); short by {}. Give a smaller --kv-host-memory (what is \
                                 left must hold the KV pool too) or more memory",
                                format_bytes(host_term),
                                kv_tiers.host_blocks,
                                format_bytes(weights),
                                format_bytes(overhead),
                                format_bytes(activation),
                                format_bytes(usable - model_needs as u64),
                                format_bytes(usable),
                                format_bytes(mem),
                                self.memory_utilization,
                                format_bytes(short)
                            )
                        } else {
                            let (host, smaller_host) = if host_term > 0 {
                                (
                                    format!(" + host KV tier {}", format_bytes(host_term)),
                                    ", a smaller --kv-host-memory",
                                )
                            } else {
                                (String::new(), "")
                            };
                            format!(
                                "the model does not fit: weights {} + overhead {} + activations {}{host} \
                                 per device exceed the {} usable ({} × {}); short by {}. Try a larger \
                                 --tp/--pp, a smaller --weights-dtype{smaller_host}, or \
                                 --memory-utilization closer to 1",
                                format_bytes(weights),
                                format_bytes(overhead),
                                format_bytes(activation),
                                format_bytes(usable),
                                format_bytes(mem),
                                self.memory_utilization,
                                format_bytes(short)
                            )
                        };
                        warnings.insert(0, warning);
                        (0, Some(mem), short)
                    }
                }
            }
        };
        let fits = short_bytes == 0;

        let num_blocks = rank.num_blocks_for_budget(kv_budget);
        let whole_model_max_concurrency = rank.max_concurrency(kv_budget, context);
        // `kura serve` pages sliding layers apart unless lower tiers or guaranteed admission need whole
        // blocks (`hybrid_pool_for`).
        let hybrid = hybrid_pool_for(
            &windowed_rank,
            kv_budget,
            self.tiers.host_blocks > 0 || self.tiers.disk.is_some(),
            self.scheduling == Scheduling::Guaranteed,
        )
        .filter(|_| self.hybrid_pool);
        let pool_rank = if hybrid.is_some() {
            &windowed_rank
        } else {
            &rank
        };
        let max_concurrency = pool_rank.max_concurrency(kv_budget, context);
        let limit = s.max_context.unwrap_or(context).max(context);
        let max_context_for_batch = pool_rank.max_context_for_batch(kv_budget, self.batch, limit);
        let page_bytes = windowed_rank.layer_bytes_per_block(0);
        let hybrid_pool = hybrid.map(|pool| HybridPoolReport {
            num_pages: u64::from(pool.num_pages),
            page_bytes,
            full_layers: pool.full_layers(),
            sliding_layers: pool.sliding_layers(),
            window_tokens: pool.window_tokens,
            window_blocks: kura_kv::WindowPool::window_blocks(
                pool.window_tokens,
                self.block_size_tokens,
            ) as u64,
            pages_per_request: windowed_rank
                .bytes_for_sequence(context)
                .map_or(0, |b| b / page_bytes.max(1)),
        });
        let guaranteed_admission = (self.scheduling == Scheduling::Guaranteed).then(|| {
            // As `kura serve` reserves: prompt + max_tokens − 1 tokens, in whole blocks, nothing shared.
            let blocks_per_request = context
                .saturating_sub(1)
                .max(1)
                .div_ceil(self.block_size_tokens as u64);
            GuaranteedAdmission {
                blocks_per_request,
                max_concurrency: num_blocks / blocks_per_request,
            }
        });
        let fits_batch = max_concurrency >= self.batch;
        if fits && !fits_batch {
            warnings.push(format!(
                "{} requests of {context} tokens do not fit: at most {max_concurrency} do; {} requests fit at up to \
                 {max_context_for_batch} tokens each",
                self.batch, self.batch
            ));
        }
        let (windowed_kv_bytes_per_request, windowed_max_concurrency) = if windowed
            .has_sliding_window()
        {
            let per_request = windowed
                .bytes_for_sequence(context)
                .and_then(|b| b.checked_mul(copies));
            let concurrency = windowed_rank.max_concurrency(kv_budget, context);
            if hybrid_pool.is_none() {
                warnings.push(format!(
                    "sliding-window layers keep at most their window, but this pool pages whole-model \
                     blocks (lower tiers and guaranteed admission need whole blocks; so do layers of \
                     several shapes or windows): these figures count every layer at the full context. \
                     The hybrid pool would need {} per request and hold {concurrency} requests of \
                     {context} tokens",
                    per_request.map_or_else(|| "more than 2^64 bytes".into(), format_bytes)
                ));
            }
            (per_request, Some(concurrency))
        } else {
            (None, None)
        };
        // With the hybrid pool, what a request holds is its windowed figure.
        let (per_request, per_request_per_device, kv_bytes_total) =
            match (&hybrid_pool, windowed_kv_bytes_per_request) {
                (Some(_), Some(windowed)) => (
                    windowed,
                    windowed_rank.bytes_for_sequence(context).ok_or_else(|| {
                        too_large(format!("KV for one request of {context} tokens"))
                    })?,
                    windowed.checked_mul(self.batch).ok_or_else(|| {
                        too_large(format!("KV for --batch {} requests", self.batch))
                    })?,
                ),
                _ => (per_request, per_request_per_device, kv_bytes_total),
            };
        Ok(PlanReport {
            windowed_kv_bytes_per_request,
            windowed_max_concurrency,
            hybrid_pool,
            whole_model_max_concurrency,
            model: s.name.clone(),
            source: s.source.clone(),
            params: s.params(),
            num_layers: s.num_layers,
            num_kv_heads: s.num_kv_heads,
            head_dim: s.head_dim,
            attention: describe_attention(s, &windowed),
            kv_dtype: self.kv_dtype,
            block_size: self.block_size_tokens,
            context,
            model_max_context: s.max_context,
            batch: self.batch,
            tp: self.tp,
            pp: self.pp,
            device: self.device,
            kv_bytes_per_token,
            kv_bytes_per_request: per_request,
            kv_bytes_total,
            kv_bytes_per_token_per_device: rank.bytes_per_token(),
            kv_bytes_per_request_per_device: per_request_per_device,
            bytes_per_block_per_device: rank.bytes_per_block(),
            memory_bytes: memory,
            memory_utilization: memory.map(|_| self.memory_utilization),
            weights_bytes: weights,
            weights_exact,
            overhead_bytes: overhead,
            activation_bytes: activation,
            kv_budget_bytes: kv_budget,
            num_blocks,
            max_tokens_in_pool: num_blocks * self.block_size_tokens as u64,
            max_concurrency,
            max_context_for_batch,
            fits,
            short_bytes,
            fits_batch,
            kv_tiers,
            scheduling: self.scheduling,
            guaranteed_admission,
            warnings,
        })
    }
}

/// How many copies of the model's KV exist across tensor-parallel ranks: 1 when heads are split exactly,
/// more when heads (or an MLA latent) are replicated.
fn rank_copies(layout: &KvLayout, rank: &KvLayout, tp: usize) -> u64 {
    let first = &layout.layers[0];
    let kept = rank.layers[0].kv_heads * tp;
    if matches!(first.attention, kura_kv::layout::AttentionKind::Mla { .. }) {
        tp as u64
    } else {
        (kept / first.kv_heads).max(1) as u64
    }
}

fn describe_attention(s: &ModelSpec, layout: &KvLayout) -> String {
    use kura_kv::layout::AttentionKind::*;
    if let Some(m) = &s.mla {
        return format!(
            "MLA (latent {} + rope {})",
            m.kv_lora_rank, m.qk_rope_head_dim
        );
    }
    let kind = match s.num_kv_heads {
        1 => "MQA".to_string(),
        k if k == s.num_heads => "MHA".to_string(),
        k => format!("GQA ({} query heads per KV head)", s.num_heads / k),
    };
    let windowed: Vec<usize> = layout
        .layers
        .iter()
        .filter_map(|l| match l.attention {
            SlidingWindow { window_tokens } => Some(window_tokens),
            _ => None,
        })
        .collect();
    match windowed.first() {
        None => kind,
        Some(w) => format!(
            "{kind}, {} of {} layers sliding window {w}",
            windowed.len(),
            layout.num_layers()
        ),
    }
}

/// The hybrid pool `kura serve` runs for `layout` (one device's, windowed layers as they are) with
/// `budget_bytes` of KV: `None` when nothing slides, when the layers differ in shape or window
/// (`KvLayout::window_pool`), or when lower tiers or guaranteed admission need whole blocks.
pub fn hybrid_pool_for(
    layout: &KvLayout,
    budget_bytes: u64,
    tiers: bool,
    guaranteed: bool,
) -> Option<kura_kv::WindowPool> {
    if tiers || guaranteed {
        return None;
    }
    layout.window_pool(budget_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn req(name: &str) -> PlanRequest {
        PlanRequest::new(catalog::find_model(name).unwrap().spec())
    }

    #[test]
    fn qwen25_32b_request_at_32k_f16_is_8_gib() {
        let mut r = req("qwen2.5-32b");
        r.context = Some(32_768);
        r.kv_cache_memory = Some(100 * GIB);
        let p = r.plan().unwrap();
        assert_eq!(p.kv_bytes_per_request, 8_589_934_592);
        assert_eq!(p.kv_bytes_per_token, 2 * 64 * 8 * 128 * 2);
    }

    #[test]
    fn llama31_8b_request_at_8k_f16_is_1_gib() {
        // 2 × 32 layers × 8 kv heads × 128 × 2 bytes = 128 KiB per token; × 8,192 = 1,024 MiB.
        let mut r = req("llama-3.1-8b");
        r.context = Some(8192);
        r.kv_cache_memory = Some(10 * GIB);
        let p = r.plan().unwrap();
        assert_eq!(p.kv_bytes_per_token, 128 * 1024);
        assert_eq!(p.kv_bytes_per_request, 1024 * MIB);
        assert_eq!(p.max_concurrency, 10);
        assert_eq!(p.num_blocks, 10 * GIB / (128 * 1024 * 16));
    }

    #[test]
    fn deepseek_v3_mla_is_one_latent_per_layer() {
        // 61 layers × (512 + 64) × 2 bytes = 70,272 bytes per token; 4,096 tokens = 287,834,112 bytes.
        let mut r = req("deepseek-v3");
        r.context = Some(4096);
        r.kv_cache_memory = Some(GIB);
        let p = r.plan().unwrap();
        assert_eq!(p.kv_bytes_per_token, 61 * 576 * 2);
        assert_eq!(p.kv_bytes_per_request, 61 * 576 * 2 * 4096);
        assert!(p.attention.starts_with("MLA"));
    }

    #[test]
    fn gemma2_9b_sliding_layers_cap_at_the_window_only_in_a_per_group_pool() {
        // 42 layers, 21 sliding (window 4,096), 21 global; 8 kv heads × 256 × 2 (K,V) × 2 bytes = 8 KiB
        // per layer per token.
        let mut r = req("gemma-2-9b");
        r.context = Some(8192);
        r.kv_cache_memory = Some(10 * GIB);
        let p = r.plan().unwrap();
        let per_layer_token = 8 * 256 * 2 * 2;
        // The hybrid pool: 21 layers × 8,192 tokens + 21 sliding layers × the 257 blocks of 16 tokens a
        // window of 4,096 can overlap.
        let windowed = (21 * 8192 + 21 * 257 * 16) * per_layer_token;
        assert_eq!(p.kv_bytes_per_request, windowed);
        assert_eq!(p.max_concurrency, 10 * GIB / windowed);
        assert_eq!(p.windowed_kv_bytes_per_request, Some(windowed));
        assert_eq!(p.windowed_max_concurrency, Some(10 * GIB / windowed));
        let hybrid = p.hybrid_pool.as_ref().unwrap();
        assert_eq!((hybrid.full_layers, hybrid.sliding_layers), (21, 21));
        assert_eq!(hybrid.pages_per_request, 21 * 512 + 21 * 257);
        // A whole-model pool: every layer holds the whole context.
        assert_eq!(
            p.whole_model_max_concurrency,
            10 * GIB / (42 * 8192 * per_layer_token)
        );
        // Guaranteed admission counts whole blocks: the whole-model pool, said in a warning.
        r.scheduling = Scheduling::Guaranteed;
        let g = r.plan().unwrap();
        assert!(g.hybrid_pool.is_none());
        assert_eq!(g.max_concurrency, g.whole_model_max_concurrency);
        assert_eq!(g.kv_bytes_per_request, 42 * 8192 * per_layer_token);
        assert!(g.warnings.iter().any(|w| w.contains("whole-model")));
        r.scheduling = Scheduling::MaxUtilization;
        assert!(
            p.attention.contains("sliding window 4096"),
            "{}",
            p.attention
        );
        // Below the window both kinds of layer hold everything.
        r.context = Some(2048);
        let p = r.plan().unwrap();
        assert_eq!(p.kv_bytes_per_request, 42 * 2048 * per_layer_token);
        assert_eq!(
            p.windowed_kv_bytes_per_request,
            Some(42 * 2048 * per_layer_token)
        );
    }

    #[test]
    fn memory_breakdown_adds_up() {
        let mut r = req("llama-3.1-8b");
        r.memory_bytes = Some(80 * GIB);
        r.context = Some(8192);
        let p = r.plan().unwrap();
        let usable = (80.0 * GIB as f64 * 0.9) as u64;
        assert_eq!(
            p.kv_budget_bytes + p.weights_bytes + p.overhead_bytes + p.activation_bytes,
            usable
        );
        assert_eq!(p.weights_bytes, 8_030_000_000 * 2);
        assert_eq!(p.max_concurrency, p.kv_budget_bytes / (1024 * MIB));
        assert!(p.max_tokens_in_pool >= p.max_concurrency * 8192);
    }

    #[test]
    fn weights_that_do_not_fit_say_by_how_much_and_keep_the_kv_figures() {
        let mut r = req("llama-3.1-70b");
        r.memory_bytes = Some(80 * GIB);
        r.context = Some(8192);
        let p = r.plan().unwrap();
        assert!(!p.fits);
        // 141 GB of bf16 weights alone exceed 72 GiB usable.
        assert!(p.short_bytes > 60 * GIB, "{}", p.short_bytes);
        assert!(p.warnings[0].contains("short by"), "{:?}", p.warnings);
        // 2 × 80 layers × 8 kv heads × 128 × 2 bytes × 8,192 tokens: the answer the user asked for.
        assert_eq!(p.kv_bytes_per_request, 2 * 80 * 8 * 128 * 2 * 8192);
        assert_eq!(
            (p.kv_budget_bytes, p.num_blocks, p.max_concurrency),
            (0, 0, 0)
        );
        r.tp = 4;
        let p = r.plan().unwrap();
        assert!(p.fits && p.short_bytes == 0 && p.max_concurrency > 0);
    }

    #[test]
    fn sizes_from_flags_that_leave_64_bits_are_errors_not_wrapped() {
        let mut r = req("llama-3.1-8b");
        r.kv_cache_memory = Some(GIB);
        r.context = Some(u64::MAX);
        let e = r.plan().unwrap_err();
        assert!(
            matches!(
                e,
                PlanError::OutOfRange {
                    flag: "--context",
                    ..
                }
            ),
            "{e}"
        );
        r.context = Some(8192);
        r.batch = u64::MAX;
        let e = r.plan().unwrap_err();
        assert!(
            e.to_string().contains("--batch") && e.to_string().contains("overflows"),
            "{e}"
        );
        r.batch = 1;
        r.max_batched_tokens = u64::MAX;
        r.kv_cache_memory = None;
        r.memory_bytes = Some(80 * GIB);
        let e = r.plan().unwrap_err();
        assert!(e.to_string().contains("--max-batched-tokens"), "{e}");
        r.max_batched_tokens = 8192;
        r.tp = usize::MAX;
        assert!(matches!(
            r.plan().unwrap_err(),
            PlanError::OutOfRange { flag: "--tp", .. }
        ));
        r.tp = 1;
        r.overhead_bytes = Some(u64::MAX);
        r.activation_bytes = Some(u64::MAX);
        let p = r.plan().unwrap();
        assert!(!p.fits);
        assert_eq!(p.short_bytes, u64::MAX);
    }

    #[test]
    fn context_beyond_the_maximum_is_computed_with_a_warning() {
        let mut r = req("llama-2-7b");
        r.context = Some(8192);
        r.kv_cache_memory = Some(100 * GIB);
        let p = r.plan().unwrap();
        assert_eq!(p.kv_bytes_per_request, 4 * GIB);
        assert!(p
            .warnings
            .iter()
            .any(|w| w.contains("exceeds the model's maximum of 4096")));
    }

    /// A host tier of `blocks` blocks and a disk tier of `disk_blocks` files of `file` bytes.
    fn tiers(blocks: u32, disk_blocks: u32, file: u64) -> LowerTiers {
        LowerTiers {
            host_memory_bytes: GIB,
            host_blocks: blocks,
            disk: Some(DiskTier {
                path: "/kv".into(),
                size_bytes: 10 * GIB,
                block_file_bytes: file,
                blocks: disk_blocks,
            }),
            policy: kura_kv::OffloadPolicy::WriteThrough { min_hits: 2 },
            preemption: Preemption::Swap,
        }
    }

    #[test]
    fn the_lower_tiers_are_reported_in_bytes_and_tokens_of_the_pools_blocks() {
        let mut r = req("llama-3.1-8b");
        r.kv_cache_memory = Some(GIB);
        let block = r.pool_layout().unwrap().bytes_per_block();
        assert_eq!(block, 128 * 1024 * 16);
        r.tiers = tiers(512, 100, block + 180);
        let p = r.plan().unwrap();
        assert_eq!(p.bytes_per_block_per_device, block);
        let t = &p.kv_tiers;
        assert_eq!((t.host_blocks, t.host_tokens), (512, 512 * 16));
        assert_eq!(t.host_bytes, 512 * block);
        assert_eq!((t.disk_blocks, t.disk_tokens), (100, 1600));
        assert_eq!(t.disk_bytes, 100 * (block + 180));
        assert_eq!(t.disk_path.as_deref(), Some("/kv"));
        assert_eq!(
            (t.offload_policy, t.offload_min_hits),
            ("write-through", Some(2))
        );
        assert_eq!(t.preemption_mode, Preemption::Swap);
        // A budget given directly skips the memory arithmetic: the host tier is beside it.
        assert!(!t.host_in_breakdown);
        // The pool itself is what it was without tiers.
        r.tiers = LowerTiers::default();
        let without = r.plan().unwrap();
        assert_eq!(without.num_blocks, p.num_blocks);
        assert_eq!(without.kv_tiers.host_blocks, 0);
        assert_eq!(without.kv_tiers.offload_policy, "write-back");
        assert_eq!(without.kv_tiers.preemption_mode, Preemption::Recompute);
    }

    #[test]
    fn on_the_cpu_the_host_tier_comes_out_of_the_same_memory_as_the_pool() {
        let mut r = req("llama-3.1-8b");
        r.device = Device::Cpu;
        r.memory_bytes = Some(64 * GIB);
        r.context = Some(8192);
        let block = r.pool_layout().unwrap().bytes_per_block();
        let before = r.plan().unwrap();
        r.tiers = tiers(4096, 0, 0);
        let p = r.plan().unwrap();
        let host = 4096 * block;
        assert!(p.fits && p.kv_tiers.host_in_breakdown);
        assert_eq!(p.kv_tiers.host_bytes, host);
        assert_eq!(p.kv_budget_bytes, before.kv_budget_bytes - host);
        let usable = (64.0 * GIB as f64 * 0.9) as u64;
        assert_eq!(
            p.kv_budget_bytes + p.weights_bytes + p.overhead_bytes + p.activation_bytes + host,
            usable
        );
        // A host tier larger than what the model leaves: no pool, and the warning says which term.
        let left = before.kv_budget_bytes;
        r.tiers = tiers(u32::try_from(left / block + 1).unwrap(), 0, 0);
        let p = r.plan().unwrap();
        assert!(!p.fits);
        assert_eq!(p.short_bytes, (left / block + 1) * block - left);
        assert_eq!((p.kv_budget_bytes, p.num_blocks), (0, 0));
        assert!(
            p.warnings[0].starts_with("the host KV tier does not fit")
                && p.warnings[0].contains("--kv-host-memory"),
            "{:?}",
            p.warnings
        );
        // On an accelerator the pool is in the device's memory and the host tier in the host's.
        r.device = Device::Accelerator;
        r.memory_bytes = Some(80 * GIB);
        r.tiers = tiers(1 << 20, 0, 0);
        let p = r.plan().unwrap();
        assert!(p.fits && !p.kv_tiers.host_in_breakdown);
        r.tiers = LowerTiers::default();
        assert_eq!(r.plan().unwrap().kv_budget_bytes, p.kv_budget_bytes);
    }

    #[test]
    fn tier_bytes_that_leave_64_bits_are_errors() {
        let mut r = req("llama-3.1-405b");
        r.kv_cache_memory = Some(GIB);
        r.block_size_tokens = 1024;
        r.tiers = tiers(u32::MAX, u32::MAX, u64::MAX);
        let e = r.plan().unwrap_err();
        assert!(e.to_string().contains("lower KV tiers"), "{e}");
    }

    #[test]
    fn reverse_question_longest_context_for_batch() {
        let mut r = req("llama-3.1-8b");
        r.kv_cache_memory = Some(16 * GIB);
        r.batch = 4;
        let p = r.plan().unwrap();
        // 16 GiB / 4 requests / 128 KiB per token = 32,768 tokens each.
        assert_eq!(p.max_context_for_batch, 32_768);
    }
}
