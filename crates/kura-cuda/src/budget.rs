//! What the executor takes of a device's memory, as arithmetic without a device: the one table of the
//! per-step activation buffers ([`ACTIVATIONS`], which `Scratch::grow` allocates from), the weights as
//! [`crate::DevWeights`] holds them, the measured CUDA context, and the pool that is left
//! ([`plan_pool`], which `kura plan --gpu` prints and `kura serve --device cuda` sizes its pool with).
//!
//! ```text
//! device memory (the driver's total)
//!   − weights                          bf16 matrices, f32 norms and biases (weight_bytes)
//!   − CUDA context and libraries       CONTEXT_BYTES, measured
//!   − activation buffers               the table below, for the step budget
//!   − reserve                          DEVICE_RESERVE: buffers grown at run time
//!   = left  →  the pool: a size (≤ left), a share of left, or a utilization of the total
//! ```
//!
//! Not in the table: the step metadata (`meta`: 8 i32 per token, one per sequence, 4,096 spare, plus
//! the block tables, whose length is the context's) and the split-key kernel's partials (`part`: split
//! tokens × heads × splits × (head_dim + 2) f32, where splits grow with the context, 128 keys each; the
//! kernel runs in waves of tokens so that they stay within `PART_CAP_BYTES`, 64 MiB, or one token's),
//! with its arrival counters (`arrive`: an i32 per token of a wave and KV head); greedy sampling's
//! segment maxima share `part` (two f32 per 4,096 logits of a row). All are grown by the
//! step that first needs them, out of [`DEVICE_RESERVE`].

use kura_checkpoint::ModelConfig;

/// Device memory the CUDA context, cuBLAS (handle and workspace) and Kura's loaded kernels take before
/// any buffer of Kura's: 0.58 GiB measured on an H100 with cuBLAS 13 (total − free before the weights),
/// rounded up to 600 MiB.
pub const CONTEXT_BYTES: u64 = 600 << 20;

/// Device memory left free beside the pool: the attention partials of long contexts, the step
/// metadata, and cuBLAS' workspace growth.
pub const DEVICE_RESERVE: u64 = 512 << 20;

/// The dimensions the executor's buffers and weights are sized by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub tied_embeddings: bool,
    /// Q, K and V carry biases (f32 on the device).
    pub qkv_bias: bool,
}

impl Dims {
    pub fn of(c: &ModelConfig) -> Self {
        Dims {
            hidden: c.hidden_size(),
            intermediate: c.intermediate_size(),
            layers: c.num_layers(),
            heads: c.num_heads(),
            kv_heads: c.num_kv_heads(),
            head_dim: c.head_dim(),
            vocab: c.vocab_size(),
            tied_embeddings: c.tie_word_embeddings(),
            qkv_bias: c.params.qkv_bias,
        }
    }

    fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_heads * self.head_dim
    }
}

/// What a buffer's rows are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Per {
    /// One row per new token of the step.
    Token,
    /// One row per row of the output head: each sequence's last token, and each draft token a step
    /// checks (speculative decoding: [`head_rows`]).
    Seq,
}

/// One per-step buffer: `rows × width` elements of `elem_bytes` bytes.
pub struct ActivationBuffer {
    pub name: &'static str,
    pub elem_bytes: usize,
    pub per: Per,
    pub width: fn(&Dims) -> usize,
}

/// The executor's per-step buffers, in `Scratch`'s order (the indices below name them).
pub const ACTIVATIONS: [ActivationBuffer; 12] = [
    // The residual stream, f32.
    buf("x", 4, Per::Token, |d| d.hidden),
    // Its RMS-normed copy, the products' input.
    buf("xn", 2, Per::Token, |d| d.hidden),
    // Q, K and V out of the fused product, f32.
    buf("qkv", 4, Per::Token, Dims::qkv_dim),
    // Q after RoPE.
    buf("q", 2, Per::Token, Dims::q_dim),
    // Attention's output.
    buf("attn", 2, Per::Token, Dims::q_dim),
    // Gate and up out of the fused product, f32.
    buf("gu", 4, Per::Token, |d| 2 * d.intermediate),
    // silu(gate) · up.
    buf("act", 2, Per::Token, |d| d.intermediate),
    // RoPE cosines and sines of the step's positions.
    buf("cos", 4, Per::Token, |d| d.head_dim / 2),
    buf("sin", 4, Per::Token, |d| d.head_dim / 2),
    // Each sequence's last token, normed.
    buf("last", 2, Per::Seq, |d| d.hidden),
    buf("logits", 4, Per::Seq, |d| d.vocab),
    // Greedy ids.
    buf("ids", 4, Per::Seq, |_| 1),
];

pub const X: usize = 0;
pub const XN: usize = 1;
pub const QKV: usize = 2;
pub const Q: usize = 3;
pub const ATTN: usize = 4;
pub const GU: usize = 5;
pub const ACT: usize = 6;
pub const COS: usize = 7;
pub const SIN: usize = 8;
pub const LAST: usize = 9;
pub const LOGITS: usize = 10;
pub const IDS: usize = 11;

const fn buf(
    name: &'static str,
    elem_bytes: usize,
    per: Per,
    width: fn(&Dims) -> usize,
) -> ActivationBuffer {
    ActivationBuffer {
        name,
        elem_bytes,
        per,
        width,
    }
}

/// What speculative decoding asks of a step's output head: each drafting sequence checks up to
/// `tokens` draft tokens, and at most `seqs` sequences draft in one step (`disable_by_batch_size` − 1
/// where drafting pauses at that batch size; `usize::MAX`: any number).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drafts {
    pub tokens: usize,
    pub seqs: usize,
}

impl Drafts {
    /// No drafts.
    pub const NONE: Drafts = Drafts { tokens: 0, seqs: 0 };

    /// Whether no step checks a draft token.
    pub fn is_none(self) -> bool {
        self.tokens == 0 || self.seqs == 0
    }

    /// Drafts of up to `tokens` tokens, by every sequence or (`paused_at`: drafting pauses in a step
    /// of that many decoding sequences) by fewer than `paused_at`; [`Drafts::NONE`] for 0 tokens.
    pub fn of(tokens: usize, paused_at: Option<usize>) -> Drafts {
        if tokens == 0 {
            return Drafts::NONE;
        }
        Drafts {
            tokens,
            seqs: paused_at.map_or(usize::MAX, |n| n.saturating_sub(1)),
        }
    }
}

/// The most rows the output head computes in a step of up to `max_tokens` new tokens over `max_seqs`
/// sequences, of which drafting ones check `drafts` (speculative decoding): a row per sequence, and
/// one per draft token — never more than the step's tokens. What the per-sequence buffers
/// ([`Per::Seq`]) are sized for.
pub fn head_rows(max_tokens: usize, max_seqs: usize, drafts: Drafts) -> usize {
    if drafts.is_none() {
        return max_seqs;
    }
    max_seqs
        .saturating_add(max_seqs.min(drafts.seqs).saturating_mul(drafts.tokens))
        .min(max_tokens.max(max_seqs))
}

/// Elements a buffer asked for `n` elements gets (`ensure`: the next power of two; at least the one
/// element every buffer starts with). Saturates at `usize::MAX`: a size past any device is then
/// refused as too large, not wrapped to a small one.
pub fn alloc_len(n: usize) -> usize {
    n.max(1).checked_next_power_of_two().unwrap_or(usize::MAX)
}

/// Rows the buffers are grown for when a step has `n` tokens (or sequences): the next power of two, so
/// that every step up to it fits without growing again (0: not grown; saturating as [`alloc_len`]).
pub fn rows_cap(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        n.checked_next_power_of_two().unwrap_or(usize::MAX)
    }
}

impl ActivationBuffer {
    /// The rows of a step of `tokens` new tokens over `seqs` sequences.
    pub fn rows(&self, tokens: usize, seqs: usize) -> usize {
        match self.per {
            Per::Token => tokens,
            Per::Seq => seqs,
        }
    }

    /// Elements this buffer has once grown for `rows` rows ([`rows_cap`] of the step's).
    pub fn len(&self, d: &Dims, rows: usize) -> usize {
        alloc_len(rows_cap(rows).saturating_mul((self.width)(d)))
    }
}

/// What `Scratch::grow` does for a step of `tokens` new tokens over `seqs` sequences when its buffers
/// are grown for `tokens_cap` tokens and `rows_cap` sequences.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grow {
    /// The rows the token buffers are grown for now, or `None` when they are left as they are.
    pub grow_tokens: Option<usize>,
    pub grow_seqs: Option<usize>,
    /// The caps after the step.
    pub tokens: usize,
    pub rows: usize,
}

/// The growth a step needs: the token buffers when it has more tokens than they are grown for, the
/// sequence buffers likewise; each then grown for [`rows_cap`] of the step's.
pub fn grow_step(tokens_cap: usize, rows_cap_now: usize, tokens: usize, seqs: usize) -> Grow {
    let grow_tokens = (tokens > tokens_cap).then_some(tokens);
    let grow_seqs = (seqs > rows_cap_now).then_some(seqs);
    Grow {
        grow_tokens,
        grow_seqs,
        tokens: grow_tokens.map_or(tokens_cap, rows_cap),
        rows: grow_seqs.map_or(rows_cap_now, rows_cap),
    }
}

impl Grow {
    /// Each buffer of [`ACTIVATIONS`] to grow (its index) with the rows to grow it for.
    pub fn buffers(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        ACTIVATIONS.iter().enumerate().filter_map(|(i, b)| {
            match b.per {
                Per::Token => self.grow_tokens,
                Per::Seq => self.grow_seqs,
            }
            .map(|rows| (i, rows))
        })
    }
}

/// Bytes the per-step buffers take once grown for steps of up to `tokens` new tokens over `seqs`
/// sequences: what `Scratch::new` then `Scratch::grow(tokens, seqs)` allocate.
pub fn activation_bytes(d: &Dims, tokens: usize, seqs: usize) -> u64 {
    ACTIVATIONS
        .iter()
        .map(|b| (b.len(d, b.rows(tokens, seqs)) as u64).saturating_mul(b.elem_bytes as u64))
        .fold(0u64, u64::saturating_add)
}

/// Bytes the per-step buffers take for steps of up to `max_tokens` new tokens over `max_seqs`
/// sequences, of which drafting ones check `drafts`: [`activation_bytes`] for the output head's
/// [`head_rows`] (what [`plan_pool`] counts).
pub fn step_activation_bytes(d: &Dims, max_tokens: usize, max_seqs: usize, drafts: Drafts) -> u64 {
    activation_bytes(d, max_tokens, head_rows(max_tokens, max_seqs, drafts))
}

/// Bytes the weights take on the device, as [`crate::DevWeights::load`] counts them: bf16 matrices (Q,
/// K, V, O, gate, up, down per layer, the embeddings, the output head unless tied), f32 norms and Q/K/V
/// biases.
pub fn weight_bytes(d: &Dims) -> u64 {
    let (h, i) = (d.hidden as u64, d.intermediate as u64);
    let (q, qkv) = (d.q_dim() as u64, d.qkv_dim() as u64);
    let matrices = qkv * h + h * q + 2 * i * h + h * i;
    let bias = if d.qkv_bias { qkv } else { 0 };
    let layer = 2 * matrices + 4 * (2 * h + bias);
    let heads = if d.tied_embeddings { 1 } else { 2 };
    d.layers as u64 * layer + heads * 2 * d.vocab as u64 * h + 4 * h
}

/// How much of the device the pool is asked for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PoolRequest {
    /// A size in bytes (`--kv-cache-memory 40GiB`): at most what is left.
    Bytes(u64),
    /// A share of what is left (`--kv-cache-memory 90%`).
    Share(f64),
    /// A share of the device's total memory for everything (`kura plan --memory-utilization`, vLLM's
    /// `gpu_memory_utilization`): the pool gets what the rest leaves of it.
    Utilization(f64),
}

/// A device's memory as the executor uses it, and the pool in blocks.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolPlan {
    pub total_bytes: u64,
    pub weights_bytes: u64,
    pub context_bytes: u64,
    pub activation_bytes: u64,
    pub reserve_bytes: u64,
    /// Total less weights, context, activations and reserve (0 when they do not fit).
    pub left_bytes: u64,
    pub request: PoolRequest,
    /// The pool's bytes as asked for; a whole number of blocks of it is allocated.
    pub budget_bytes: u64,
    pub block_bytes: u64,
    pub num_blocks: u64,
    /// The step budget the activation buffers are sized for.
    pub max_tokens: usize,
    pub max_seqs: usize,
    /// The drafts a step may check, and the output head's rows ([`head_rows`]).
    pub drafts: Drafts,
    pub head_rows: usize,
}

/// The pool of `block_bytes`-byte blocks `request` gets on a device of `total_bytes` for a model of `d`
/// run in steps of up to `max_tokens` new tokens over `max_seqs` sequences, of which drafting ones
/// check `drafts`. An error says what does not fit, naming both sides.
pub fn plan_pool(
    d: &Dims,
    total_bytes: u64,
    request: PoolRequest,
    max_tokens: usize,
    max_seqs: usize,
    drafts: Drafts,
    block_bytes: u64,
) -> Result<PoolPlan, String> {
    let gb = |b: u64| format!("{:.2} GB", b as f64 / 1e9);
    let weights_bytes = weight_bytes(d);
    let rows = head_rows(max_tokens, max_seqs, drafts);
    let activations = step_activation_bytes(d, max_tokens, max_seqs, drafts);
    let base = match request {
        PoolRequest::Utilization(u) if !(u > 0.0 && u <= 1.0) => {
            return Err(format!("a memory utilization must be in (0, 1], got {u}"))
        }
        PoolRequest::Share(f) if !(f > 0.0 && f <= 1.0) => {
            return Err(format!(
                "a share of device memory must be in (0, 1], got {f}"
            ))
        }
        // A float product floored: at most `total_bytes`.
        PoolRequest::Utilization(u) => (total_bytes as f64 * u).floor() as u64,
        _ => total_bytes,
    };
    let needs = weights_bytes
        .saturating_add(CONTEXT_BYTES)
        .saturating_add(activations)
        .saturating_add(DEVICE_RESERVE);
    let Some(left_bytes) = base.checked_sub(needs) else {
        return Err(format!(
            "the model does not fit: weights {} + CUDA context and libraries {} + activation buffers {} \
             (steps of {max_tokens} tokens over {max_seqs} sequences{}) + reserve {} = {} exceed the {} of \
             the device{}; short by {}",
            gb(weights_bytes),
            gb(CONTEXT_BYTES),
            gb(activations),
            drafts_note(drafts, max_seqs, rows),
            gb(DEVICE_RESERVE),
            gb(needs),
            gb(base),
            match request {
                PoolRequest::Utilization(u) => format!(" at a utilization of {u}"),
                _ => String::new(),
            },
            gb(needs - base)
        ));
    };
    let budget_bytes = match request {
        PoolRequest::Bytes(b) if b > left_bytes => {
            return Err(format!(
                "the KV pool is asked for {b} bytes ({}), but {left_bytes} ({}) are left of the device's {} \
                 once the weights ({}), CUDA context and libraries ({}), activation buffers ({}) and \
                 reserve ({}) are counted",
                gb(b),
                gb(left_bytes),
                gb(total_bytes),
                gb(weights_bytes),
                gb(CONTEXT_BYTES),
                gb(activations),
                gb(DEVICE_RESERVE)
            ))
        }
        PoolRequest::Bytes(b) => b,
        PoolRequest::Share(f) => (left_bytes as f64 * f).floor() as u64,
        PoolRequest::Utilization(_) => left_bytes,
    };
    Ok(PoolPlan {
        total_bytes,
        weights_bytes,
        context_bytes: CONTEXT_BYTES,
        activation_bytes: activations,
        reserve_bytes: DEVICE_RESERVE,
        left_bytes,
        request,
        budget_bytes,
        block_bytes,
        num_blocks: budget_bytes / block_bytes.max(1),
        max_tokens,
        max_seqs,
        drafts,
        head_rows: rows,
    })
}

/// `, each checking up to K draft tokens: R rows of logits` where a step of up to `max_seqs` sequences
/// checks `drafts` (`, up to S of them checking …` where fewer may draft at once).
pub fn drafts_note(drafts: Drafts, max_seqs: usize, rows: usize) -> String {
    let k = drafts.tokens;
    if drafts.is_none() {
        String::new()
    } else if drafts.seqs >= max_seqs {
        format!(", each checking up to {k} draft tokens: {rows} rows of logits")
    } else {
        let s = drafts.seqs;
        format!(", up to {s} of them checking up to {k} draft tokens each: {rows} rows of logits")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama-3.1-8B.
    pub(crate) fn llama8b() -> Dims {
        Dims {
            hidden: 4096,
            intermediate: 14336,
            layers: 32,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            vocab: 128_256,
            tied_embeddings: false,
            qkv_bias: false,
        }
    }

    #[test]
    fn llama_8b_at_8192_tokens_over_256_sequences_takes_what_an_h100_measured() {
        // Measured on an H100: 2.08 GB of activation buffers; the element counts are rounded up to powers
        // of two (gu: 8192 × 28,672 = 234.9 M → 268.4 M f32).
        let bytes = activation_bytes(&llama8b(), 8192, 256);
        assert_eq!(bytes, 2_086_667_264);
        // Measured: 16.07 GB of weights (bf16, untied head).
        assert_eq!(weight_bytes(&llama8b()), 16_061_054_976);
    }

    #[test]
    fn steps_past_any_device_saturate_rather_than_wrap() {
        // A step of 2^63 + 1 tokens has no next power of two in a usize: its buffers must come out as
        // large as can be (refused by the budget), not wrapped to 0.
        let huge = (1usize << 63) + 1;
        assert_eq!(rows_cap(huge), usize::MAX);
        assert_eq!(alloc_len(huge), usize::MAX);
        assert_eq!(activation_bytes(&llama8b(), huge, huge), u64::MAX);
        assert_eq!(activation_bytes(&llama8b(), usize::MAX, 1), u64::MAX);
    }

    #[test]
    fn buffers_are_grown_for_the_next_power_of_two_of_rows() {
        let d = llama8b();
        let gu = &ACTIVATIONS[GU];
        // 9 tokens are grown for 16: a later step of 16 tokens must fit without growing.
        assert!(gu.len(&d, 9) >= 16 * 2 * 14336);
        assert_eq!(gu.len(&d, 9), gu.len(&d, 16));
        // Not grown: the one element every buffer starts with.
        assert_eq!(gu.len(&d, 0), 1);
    }

    /// `Scratch::grow`'s steps over buffers of lengths `lens` (as `ensure` grows them).
    fn grow(lens: &mut [usize; 12], caps: &mut (usize, usize), d: &Dims, t: usize, n: usize) {
        let g = grow_step(caps.0, caps.1, t, n);
        for (i, rows) in g.buffers() {
            let want = ACTIVATIONS[i].len(d, rows);
            if lens[i] < want {
                lens[i] = alloc_len(want);
            }
        }
        *caps = (g.tokens, g.rows);
    }

    fn bytes(lens: &[usize; 12]) -> u64 {
        lens.iter()
            .zip(&ACTIVATIONS)
            .map(|(l, b)| (*l * b.elem_bytes) as u64)
            .sum()
    }

    #[test]
    fn the_table_total_is_what_grow_allocates_and_every_smaller_step_fits() {
        let d = llama8b();
        for (steps, t, n) in [
            (vec![(8192, 256)], 8192, 256),
            (
                vec![(1, 1), (9, 3), (16, 4), (700, 64), (3000, 64)],
                3000,
                64,
            ),
            (vec![(5, 1), (0, 0)], 5, 1),
        ] {
            let mut lens = [1usize; 12];
            let mut caps = (0, 0);
            for (tt, nn) in &steps {
                grow(&mut lens, &mut caps, &d, *tt, *nn);
                // Every step up to the caps fits the buffers as they are (no growth in between).
                for (i, b) in ACTIVATIONS.iter().enumerate() {
                    let rows = b.rows(caps.0, caps.1);
                    assert!(
                        lens[i] >= rows * (b.width)(&d),
                        "{} after {steps:?}",
                        b.name
                    );
                }
            }
            assert_eq!(bytes(&lens), activation_bytes(&d, t, n), "{steps:?}");
        }
        // Nothing grown: the one element each buffer starts with.
        assert_eq!(bytes(&[1; 12]), activation_bytes(&d, 0, 0));
    }

    #[test]
    fn drafts_size_the_logits_rows_by_their_tokens_within_the_steps_tokens() {
        // Without drafts a row per sequence; with drafts of 4, five per sequence, but never more rows
        // than a step's tokens (nor fewer than its sequences).
        let every = |tokens| Drafts::of(tokens, None);
        assert_eq!(head_rows(8192, 256, Drafts::NONE), 256);
        assert_eq!(head_rows(8192, 256, every(0)), 256);
        assert_eq!(head_rows(8192, 256, every(4)), 1280);
        assert_eq!(head_rows(1024, 256, every(4)), 1024);
        assert_eq!(head_rows(128, 256, every(4)), 256);
        assert_eq!(head_rows(usize::MAX, usize::MAX, every(32)), usize::MAX);
        // Drafting paused at 8 decoding sequences: at most 7 draft, a row per sequence beside.
        assert_eq!(head_rows(8192, 256, Drafts::of(4, Some(8))), 256 + 7 * 4);
        assert_eq!(head_rows(8192, 4, Drafts::of(4, Some(8))), 4 * 5);
        // The pool gives the extra rows' logits (Llama-3.1-8B: 128,256 f32 a row) to the buffers.
        let d = llama8b();
        let (block, total) = (16 * 131_072, 80_000_000_000);
        let plan = |drafts| plan_pool(&d, total, PoolRequest::Share(1.0), 8192, 64, drafts, block);
        let plain = plan(Drafts::NONE).unwrap();
        let drafts = plan(every(4)).unwrap();
        let paused = plan(Drafts::of(4, Some(16))).unwrap();
        assert_eq!(paused.head_rows, 64 + 15 * 4);
        assert_eq!(
            drafts_note(paused.drafts, 64, paused.head_rows),
            ", up to 15 of them checking up to 4 draft tokens each: 124 rows of logits"
        );
        assert_eq!(drafts_note(Drafts::NONE, 64, 64), "");
        assert!(paused.left_bytes > drafts.left_bytes && paused.left_bytes < plain.left_bytes);
        assert_eq!((plain.head_rows, drafts.head_rows), (64, 320));
        assert_eq!(
            drafts.activation_bytes,
            activation_bytes(&d, 8192, 320),
            "the buffers for 320 rows"
        );
        assert!(drafts.activation_bytes - plain.activation_bytes >= 256 * 128_256 * 4);
        assert_eq!(
            plain.left_bytes - drafts.left_bytes,
            drafts.activation_bytes - plain.activation_bytes
        );
        let e = plan_pool(
            &d,
            16_000_000_000,
            PoolRequest::Share(1.0),
            8192,
            64,
            every(4),
            block,
        )
        .unwrap_err();
        assert!(
            e.contains("each checking up to 4 draft tokens: 320 rows of logits"),
            "{e}"
        );
    }

    #[test]
    fn the_pool_is_what_the_rest_leaves_as_asked() {
        let d = llama8b();
        let block = 16 * 131_072;
        let total = 80_000_000_000;
        let plan = |request| plan_pool(&d, total, request, 8192, 64, Drafts::NONE, block);
        let all = plan(PoolRequest::Share(1.0)).unwrap();
        assert_eq!(
            all.left_bytes,
            total
                - weight_bytes(&d)
                - CONTEXT_BYTES
                - activation_bytes(&d, 8192, 64)
                - DEVICE_RESERVE
        );
        assert_eq!(all.num_blocks, all.left_bytes / block);
        let half = plan(PoolRequest::Share(0.5)).unwrap();
        assert_eq!(half.budget_bytes, all.left_bytes / 2);
        let util = plan(PoolRequest::Utilization(0.9)).unwrap();
        assert_eq!(util.budget_bytes, 72_000_000_000 - (total - all.left_bytes));
        let one = plan(PoolRequest::Bytes(1 << 30)).unwrap();
        assert_eq!(one.num_blocks, 512);
        let e = plan(PoolRequest::Bytes(total)).unwrap_err();
        assert!(e.contains("are left of the device"), "{e}");
        let e = plan_pool(
            &d,
            16_000_000_000,
            PoolRequest::Share(1.0),
            8192,
            64,
            Drafts::NONE,
            block,
        )
        .unwrap_err();
        assert!(e.contains("does not fit") && e.contains("short by"), "{e}");
        assert!(plan(PoolRequest::Share(1.5)).is_err());
    }
}
