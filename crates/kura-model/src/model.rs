//! `Model`: a loaded Llama-family or Gemma 3 model (weights, tokenizer, chat template) and its forward
//! step over a batch of sequences whose KV lives in a [`KvStorage`]. The model keeps no cache state: every
//! call says, per sequence, which tokens are new, where they start and which blocks hold the sequence.
//!
//! One step for a batch of `T` new tokens (all sequences concatenated), per layer:
//!
//! ```text
//! x[T, hidden] ─ RMSNorm ─ ·Wqkvᵀ (+bias) ─ RoPE(q, k) ─ write k, v to blocks ─ paged attention ─ ·Woᵀ ─ + x
//!              ─ RMSNorm ─ ·W_gate_upᵀ ─ SiLU(gate)·up ─ ·W_downᵀ ─ + x
//! ```
//!
//! then RMSNorm and the output head on the last token of each sequence only. The whole step is one
//! parallel region ([`crate::kernels::team`]): each operation is dealt to the threads in chunks, and a
//! thread goes on to the next once every chunk is done; the residual adds are fused into the products
//! that precede them.
//!
//! Gemma 3 differs in a few places: the embeddings are scaled by √hidden, Q and K get an RMSNorm per head
//! before RoPE, the sliding layers use a RoPE base of their own, the FFN gates with GELU (tanh), and the
//! outputs of attention and of the FFN are normalised before their residual adds (so those adds are not
//! fused: the product goes to a buffer, then each thread normalises and adds its tokens).

use std::path::Path;
use std::sync::Arc;

use kura_kv::codec::KvDtype;
use kura_kv::layout::KvLayout;
use kura_kv::storage::KvStorage;

use crate::config::{rope_inv_freq, rope_inv_freq_sliding, Activation, ModelConfig};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::kernels::attention::{attention_part, partials_len, AttnSeq, AttnShape};
use crate::kernels::matmul::{matmul_part, Act, ActBuf, ActShared};
use crate::kernels::ops::{
    add_in_place, gelu_tanh_mul, rms_norm, rope, rope_angles, scale_in_place, silu_mul,
};
use crate::kernels::qpacked::QBLOCK;
use crate::kernels::team::{self, SharedMut, Team};
use crate::weights::{Naming, Weights, WeightsDtype};
use kura_checkpoint::parts::default_template;
use kura_checkpoint::ModelParts;
use kura_text::Tokenizer;
use kura_text::{ChatMessage, ChatTemplate, ModelText};

/// One sequence's part of a forward step.
#[derive(Debug, Clone, Copy)]
pub struct SeqBatchItem<'a> {
    /// The new tokens (a prefill chunk, or one decode token).
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` in the sequence; positions `0..start_pos` are already in the blocks.
    pub start_pos: usize,
    /// Block ids of the sequence in order; must cover positions `0..start_pos + tokens.len()`.
    pub block_table: &'a [u32],
    /// For a paged storage ([`KvStorage::new_paged`]), the page of every layer for each block of
    /// `block_table`, layer-major (`layer_pages[l * n + i]`, `n = block_table.len()`); a sliding layer's
    /// blocks before its window may be `kura_kv::NO_PAGE`. Empty otherwise.
    pub layer_pages: &'a [u32],
}

impl<'a> SeqBatchItem<'a> {
    /// An item over a storage addressed by block ids (not paged).
    pub fn new(tokens: &'a [u32], start_pos: usize, block_table: &'a [u32]) -> Self {
        SeqBatchItem {
            tokens,
            start_pos,
            block_table,
            layer_pages: &[],
        }
    }

    /// Where layer `layer` finds this sequence's blocks: its pages when paged, else the block table.
    fn table(&self, layer: usize, paged: bool) -> &'a [u32] {
        if paged {
            let n = self.block_table.len();
            &self.layer_pages[layer * n..(layer + 1) * n]
        } else {
            self.block_table
        }
    }
}

/// Last-position logits of each sequence of a step: `rows × vocab`.
#[derive(Debug, Clone)]
pub struct Logits {
    pub vocab: usize,
    pub data: Vec<f32>,
}

impl Logits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    pub fn num_rows(&self) -> usize {
        self.data.len() / self.vocab.max(1)
    }
}

/// Options of loading.
#[derive(Debug, Clone, Copy, Default)]
pub struct LoadOptions {
    pub weights_dtype: WeightsDtype,
}

pub struct Model {
    config: ModelConfig,
    text: Arc<ModelText>,
    weights: Weights,
    inv_freq: Vec<f32>,
    /// RoPE of the sliding layers when their base differs (Gemma 3).
    inv_freq_sliding: Option<Vec<f32>>,
    /// The mean K of each layer and KV head over [`CALIBRATION_TEXT`], computed on first use.
    key_means: std::sync::OnceLock<std::result::Result<Vec<Vec<f32>>, String>>,
}

/// A paragraph of ordinary English prose that the model reads once to find each KV head's mean K
/// ([`Model::key_means`]).
const CALIBRATION_TEXT: &str = include_str!("calibration.txt");

/// Positions at the start of the calibration text left out of the mean: the first tokens of a sequence
/// (attention sinks) have K unlike the rest.
const CALIBRATION_SKIP: usize = 4;

impl Model {
    /// Loads a GGUF file or an HF directory with the default options (bf16 weights).
    pub fn load(path: &Path) -> Result<Self> {
        Self::load_with(path, LoadOptions::default())
    }

    pub fn load_with(path: &Path, opts: LoadOptions) -> Result<Self> {
        crate::weights::check_compute_dtype(opts.weights_dtype)?;
        if path.is_dir() {
            Self::load_hf_dir(path, opts)
        } else {
            Self::load_gguf(path, opts)
        }
    }

    fn load_gguf(path: &Path, opts: LoadOptions) -> Result<Self> {
        let g = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&g)?;
        let text = ModelText::from_gguf(&g, default_template(config.arch), config.vocab_size())?;
        let weights = Weights::load(&g, Naming::Gguf, &config, opts.weights_dtype)?;
        Ok(Self::assemble(config, text, weights))
    }

    /// Bytes `native` weights of the GGUF at `path` hold once loaded, from its directory alone; `None`
    /// when its matrices are all float (native is bf16 then).
    pub fn native_weight_bytes(path: &Path) -> Result<Option<usize>> {
        let g = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&g)?;
        crate::weights::native_bytes(&g, Naming::Gguf, &config)
    }

    fn load_hf_dir(dir: &Path, opts: LoadOptions) -> Result<Self> {
        // Opened as every executor opens it: the tensors checked against the configuration first.
        let parts = ModelParts::open(dir)?;
        let weights = Weights::load(
            parts.source.as_ref(),
            parts.naming,
            &parts.config,
            opts.weights_dtype,
        )?;
        Ok(Self::assemble(parts.config, parts.text, weights))
    }

    fn assemble(config: ModelConfig, text: ModelText, weights: Weights) -> Self {
        let inv_freq = rope_inv_freq(&config);
        let inv_freq_sliding = rope_inv_freq_sliding(&config);
        Model {
            config,
            text: Arc::new(text),
            weights,
            inv_freq,
            inv_freq_sliding,
            key_means: std::sync::OnceLock::new(),
        }
    }

    /// The mean K (after RoPE) of each layer and KV head over a fixed paragraph of English
    /// ([`CALIBRATION_TEXT`]), skipping its first positions: `[layer][head × head_dim + i]`. Computed once
    /// per model (one forward pass over about 300 tokens with f32 KV) and the same bits every time for the
    /// same weights. Quantised KV stores K minus this mean ([`KvStorage::set_key_offsets`]).
    pub fn key_means(&self) -> Result<&[Vec<f32>]> {
        self.key_means
            .get_or_init(|| self.compute_key_means().map_err(|e| e.to_string()))
            .as_deref()
            .map_err(|e| ModelError::Config(format!("computing the mean K of each head: {e}")))
    }

    fn compute_key_means(&self) -> Result<Vec<Vec<f32>>> {
        const BLOCK: usize = 16;
        let mut tokens = self.text.tokenizer.encode(CALIBRATION_TEXT, false)?;
        tokens.truncate(self.config.max_context());
        if tokens.len() <= CALIBRATION_SKIP {
            return Err(ModelError::Config(format!(
                "the calibration text is {} tokens for this tokenizer",
                tokens.len()
            )));
        }
        let layout = self.kv_layout(KvDtype::F32, BLOCK)?;
        let blocks = tokens.len().div_ceil(BLOCK);
        let mut kv = KvStorage::new(&layout, blocks)?;
        let table: Vec<u32> = (0..blocks as u32).collect();
        self.forward(
            &[SeqBatchItem {
                tokens: &tokens,
                start_pos: 0,
                block_table: &table,
                layer_pages: &[],
            }],
            &mut kv,
        )?;
        let n = (tokens.len() - CALIBRATION_SKIP) as f64;
        let means = (0..self.config.num_layers())
            .map(|layer| {
                let l = kv.layer(layer);
                let d = l.head_dim;
                let mut sum = vec![0f64; l.kv_heads * d];
                for pos in CALIBRATION_SKIP..tokens.len() {
                    for head in 0..l.kv_heads {
                        let kura_kv::storage::KvSlice::F32(k) = l.k_head_block(pos / BLOCK, head)
                        else {
                            unreachable!("f32 storage")
                        };
                        let row = &k[(pos % BLOCK) * d..(pos % BLOCK + 1) * d];
                        for (s, x) in sum[head * d..(head + 1) * d].iter_mut().zip(row) {
                            *s += f64::from(*x);
                        }
                    }
                }
                sum.iter().map(|s| (s / n) as f32).collect()
            })
            .collect();
        Ok(means)
    }

    /// A KV storage of `num_blocks` blocks of `layout` for this model: for a quantised format, one that
    /// stores K minus each head's mean ([`Model::key_means`]).
    pub fn kv_storage(&self, layout: &KvLayout, num_blocks: usize) -> Result<KvStorage> {
        let mut kv = KvStorage::new(layout, num_blocks)?;
        if layout.dtype.is_quantized() {
            kv.set_key_offsets(self.key_means()?.to_vec())?;
        }
        Ok(kv)
    }

    /// A paged KV storage of `num_pages` pages (one layer of one block each) of `layout`, for a hybrid
    /// pool (`kura_kv::WindowPool`); quantised formats store K minus each head's mean, as
    /// [`Model::kv_storage`].
    pub fn kv_storage_paged(&self, layout: &KvLayout, num_pages: usize) -> Result<KvStorage> {
        let mut kv = KvStorage::new_paged(layout, num_pages)?;
        if layout.dtype.is_quantized() {
            kv.set_key_offsets(self.key_means()?.to_vec())?;
        }
        Ok(kv)
    }

    /// Digest of what shapes this model's stored KV beyond the weights: for quantised formats, the key
    /// offsets their blocks were written under (0 for plain formats).
    pub fn kv_encoding_fingerprint(&self, dtype: KvDtype) -> Result<u128> {
        if !dtype.is_quantized() {
            return Ok(0);
        }
        let mut bytes = Vec::new();
        for layer in self.key_means()? {
            for x in layer {
                bytes.extend_from_slice(&x.to_le_bytes());
            }
        }
        Ok(xxhash_rust::xxh3::xxh3_128(&bytes))
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The tokenizer, chat template and vocabulary size, shareable without the weights.
    pub fn text(&self) -> &Arc<ModelText> {
        &self.text
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.text.tokenizer
    }

    pub fn chat_template(&self) -> &ChatTemplate {
        &self.text.chat_template
    }

    pub fn weights_dtype(&self) -> WeightsDtype {
        self.weights.dtype
    }

    /// Digest of the weights as read from the model file (every tensor's name, shape and values): the
    /// identity of the model that cached KV is tied to, whatever name it is served under.
    pub fn weights_fingerprint(&self) -> u128 {
        self.weights.fingerprint
    }

    /// Bytes the weights hold in memory.
    pub fn weight_bytes_held(&self) -> usize {
        self.weights.bytes_held()
    }

    /// Bytes of weights a decode step reads: the numerator of the memory-bandwidth bound.
    pub fn weight_bytes_per_token(&self) -> usize {
        self.weights.bytes_per_token()
    }

    /// The KV layout of this model.
    pub fn kv_layout(&self, dtype: KvDtype, block_size_tokens: usize) -> Result<KvLayout> {
        self.config.kv_layout(dtype, block_size_tokens)
    }

    /// Renders `messages` with the chat template and tokenizes the result: special tokens are recognised
    /// where the template writes them, never inside a message's content ([`ChatTemplate::encode`]).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        self.text
            .chat_template
            .encode(&self.text.tokenizer, messages, add_generation_prompt)
            .map_err(ModelError::from)
    }

    fn check_batch(&self, batch: &[SeqBatchItem<'_>], kv: &KvStorage) -> Result<()> {
        let c = &self.config;
        let layout = kv.layout();
        if layout.num_layers() != c.num_layers()
            || layout
                .layers
                .iter()
                .any(|l| l.kv_heads != c.num_kv_heads() || l.head_dim != c.head_dim())
        {
            return Err(ModelError::Forward(format!(
                "KV storage shape does not match the model ({} layers × {} kv heads × head_dim {})",
                c.num_layers(),
                c.num_kv_heads(),
                c.head_dim()
            )));
        }
        let bs = kv.block_size_tokens();
        for (i, item) in batch.iter().enumerate() {
            if item.tokens.is_empty() {
                return Err(ModelError::Forward(format!(
                    "sequence {i} of the batch has no new tokens"
                )));
            }
            let end = item.start_pos + item.tokens.len();
            if end > c.max_context() {
                return Err(ModelError::Forward(format!(
                    "sequence {i} reaches position {end}, beyond the model's context of {}",
                    c.max_context()
                )));
            }
            if item.block_table.len() * bs < end {
                return Err(ModelError::Forward(format!(
                    "sequence {i}: {} blocks of {bs} tokens cannot hold {end} positions",
                    item.block_table.len()
                )));
            }
            let paged = kv.is_paged();
            if paged && item.layer_pages.len() != c.num_layers() * item.block_table.len() {
                return Err(ModelError::Forward(format!(
                    "sequence {i}: {} layer pages for {} layers of {} blocks",
                    item.layer_pages.len(),
                    c.num_layers(),
                    item.block_table.len()
                )));
            }
            for layer in 0..if paged { c.num_layers() } else { 1 } {
                // The blocks this step reads: from the window's start for a sliding layer.
                let first = match c.layer_window(layer) {
                    Some(w) if paged => (item.start_pos + 1).saturating_sub(w) / bs,
                    _ => 0,
                };
                if let Some(b) = item.table(layer, paged)[first..end.div_ceil(bs)]
                    .iter()
                    .find(|b| **b as usize >= kv.num_blocks())
                {
                    return Err(ModelError::Forward(format!(
                        "sequence {i}: block {b} (layer {layer}) is outside the storage of {} blocks",
                        kv.num_blocks()
                    )));
                }
            }
            if let Some(t) = item.tokens.iter().find(|t| **t as usize >= c.vocab_size()) {
                return Err(ModelError::Forward(format!(
                    "sequence {i}: token id {t} is outside the vocabulary of {}",
                    c.vocab_size()
                )));
            }
        }
        // Every new token writes its own (block, slot): two writes to one slot would leave one token's
        // K/V under another's position.
        let mut slots = std::collections::HashSet::new();
        let paged = kv.is_paged();
        for (i, item) in batch.iter().enumerate() {
            for p in item.start_pos..item.start_pos + item.tokens.len() {
                let written = (0..if paged { c.num_layers() } else { 1 })
                    .map(|layer| item.table(layer, paged)[p / bs]);
                let (block, slot) = (item.block_table[p / bs], p % bs);
                if written.into_iter().any(|page| !slots.insert((page, slot))) {
                    return Err(ModelError::Forward(format!(
                        "sequence {i}: position {p} writes block {block} slot {slot}, which another new \
                         token of the batch also writes"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Runs the new tokens of every sequence through the model, writing their K and V into `kv` at their
    /// positions, and returns the logits of each sequence's last new token.
    pub fn forward(&self, batch: &[SeqBatchItem<'_>], kv: &mut KvStorage) -> Result<Logits> {
        self.forward_rows(batch, kv, Heads::Last)
    }

    /// As [`Model::forward`], but returns the logits of each sequence's last `tails[i]` new tokens
    /// (at least 1), sequence by sequence in position order: the rows a draft's check needs
    /// (speculative decoding). Each row is the one [`Model::forward`] gives that token as its
    /// sequence's last.
    pub fn forward_tails(
        &self,
        batch: &[SeqBatchItem<'_>],
        kv: &mut KvStorage,
        tails: &[usize],
    ) -> Result<Logits> {
        if tails.len() != batch.len() {
            return Err(ModelError::Forward(format!(
                "{} row counts for a batch of {} sequences",
                tails.len(),
                batch.len()
            )));
        }
        if let Some(i) =
            (0..batch.len()).find(|&i| tails[i] == 0 || tails[i] > batch[i].tokens.len())
        {
            return Err(ModelError::Forward(format!(
                "sequence {i}: {} rows asked of {} new tokens",
                tails[i],
                batch[i].tokens.len()
            )));
        }
        self.forward_rows(batch, kv, Heads::Tails(tails))
    }

    /// As [`Model::forward`], but returns the logits of every new token, in batch order (`kura
    /// perplexity` scores each position of a text).
    pub fn forward_every_position(
        &self,
        batch: &[SeqBatchItem<'_>],
        kv: &mut KvStorage,
    ) -> Result<Logits> {
        self.forward_rows(batch, kv, Heads::Every)
    }

    fn forward_rows(
        &self,
        batch: &[SeqBatchItem<'_>],
        kv: &mut KvStorage,
        heads: Heads<'_>,
    ) -> Result<Logits> {
        self.check_batch(batch, kv)?;
        let c = &self.config;
        let (h, d, inter) = (c.hidden_size(), c.head_dim(), c.intermediate_size());
        let (q_dim, kv_dim) = (c.num_heads() * d, c.num_kv_heads() * d);
        let qkv_dim = q_dim + 2 * kv_dim;
        let t_total: usize = batch.iter().map(|b| b.tokens.len()).sum();
        let bs = kv.block_size_tokens();

        // Embeddings, positions and RoPE angles of every new token.
        let mut x = vec![0f32; t_total * h];
        let paged = kv.is_paged();
        // The attention's view of the sequences: one per layer when the storage is paged.
        let mut seqs_of: Vec<Vec<AttnSeq>> =
            vec![Vec::with_capacity(batch.len()); if paged { c.num_layers() } else { 1 }];
        let mut positions = Vec::with_capacity(t_total);
        for item in batch {
            for (layer, seqs) in seqs_of.iter_mut().enumerate() {
                seqs.push(AttnSeq {
                    first_token: positions.len(),
                    n_tokens: item.tokens.len(),
                    start_pos: item.start_pos,
                    block_table: item.table(layer, paged),
                });
            }
            for (i, tok) in item.tokens.iter().enumerate() {
                let t = positions.len();
                let xr = &mut x[t * h..(t + 1) * h];
                self.weights.embed.row_into(*tok as usize, xr);
                if let Some(s) = c.embedding_scale() {
                    scale_in_place(xr, s);
                }
                positions.push(item.start_pos + i);
            }
        }
        let half = d / 2;
        let (cos, sin) = angles(&positions, &self.inv_freq, half);
        // The sliding layers' own angles, when their RoPE base differs.
        let sliding_angles = self
            .inv_freq_sliding
            .as_ref()
            .map(|f| angles(&positions, f, half));
        let q_scale = c.query_scale();
        let activation = c.activation();
        // Where each token's K/V goes: (block id or page, slot), per layer when paged.
        let slots_of: Vec<Vec<(usize, usize)>> = (0..seqs_of.len())
            .map(|layer| {
                batch
                    .iter()
                    .flat_map(|item| {
                        let table = item.table(layer, paged);
                        (0..item.tokens.len()).map(move |i| {
                            let p = item.start_pos + i;
                            (table[p / bs] as usize, p % bs)
                        })
                    })
                    .collect()
            })
            .collect();
        let seqs = &seqs_of[0];

        let head = self.weights.lm_head();
        let kind = head.act_kind();
        // Rows of the output head: the tokens (in the step's order) whose logits are returned.
        let head_tokens: Vec<usize> = match heads {
            Heads::Every => (0..t_total).collect(),
            Heads::Last => seqs
                .iter()
                .map(|s| s.first_token + s.n_tokens - 1)
                .collect(),
            Heads::Tails(tails) => seqs
                .iter()
                .zip(tails)
                .flat_map(|(s, &k)| s.first_token + s.n_tokens - k..s.first_token + s.n_tokens)
                .collect(),
        };
        let n = head_tokens.len();
        let mut xn = ActBuf::new(kind, t_total, h);
        let mut qkv = vec![0f32; t_total * qkv_dim];
        let mut attn = ActBuf::new(kind, t_total, q_dim);
        let mut gate_up = vec![0f32; t_total * 2 * inter];
        // The attention and FFN outputs before their post-norms (Gemma 3).
        let post_norms = self.weights.layers.iter().any(|l| l.gemma.is_some());
        let mut proj = vec![0f32; if post_norms { t_total * h } else { 0 }];
        let heads_len = if post_norms { q_dim.max(kv_dim) } else { 0 };
        let mut act = ActBuf::new(kind, t_total, inter);
        let mut last = ActBuf::new(kind, n, h);
        let mut logits = vec![0f32; n * head.rows];
        let shape = AttnShape {
            num_heads: c.num_heads(),
            num_kv_heads: c.num_kv_heads(),
            head_dim: d,
            window: c.sliding_window(),
        };
        let (xs, xns, qkvs, attns) = (
            SharedMut::new(&mut x),
            xn.shared(),
            SharedMut::new(&mut qkv),
            attn.shared(),
        );
        let (gus, acts, lasts, logits_s) = (
            SharedMut::new(&mut gate_up),
            act.shared(),
            last.shared(),
            SharedMut::new(&mut logits),
        );
        let projs = SharedMut::new(&mut proj);
        // Sized for a full-context layer, the most segments any layer has.
        let full = AttnShape {
            window: None,
            ..shape
        };
        let mut partials = vec![0f32; partials_len(seqs, full)];
        let parts = SharedMut::new(&mut partials);
        let kvs = KvShared(kv);
        let eps = c.params.rms_norm_eps;

        // One parallel region for the whole step: every operation is a deal ([`Team::deal`]) of work
        // items (tokens for the row-wise ones, rows or tiles of each product, attention units), and
        // a thread goes on to the next operation once every item of this one is done. SAFETY (for
        // every access below): during a deal each buffer is either only read, or written in parts
        // that no two items share (a token, the output rows of a product's item, the heads of an
        // attention unit, or the whole K/V write in one item); all buffers outlive the region. A
        // thread that was switched out and comes back after the team has moved on finds every deal
        // it reaches done and takes no item: the rows it norms into its own buffer meanwhile (decode)
        // may be read while a later deal writes `x`, and are never used, as its next product is done.
        team::run_step(t_total, |tm| {
            let mut row = vec![0f32; h.max(inter)];
            // Scratch of the per-head Q/K norms (models that have them).
            let mut heads = vec![0f32; heads_len];
            // With fewer tokens than threads (decode), this thread's own buffers of the normed rows.
            let decode = t_total < tm.size();
            let mut own_xn = decode.then(|| ActBuf::new(kind, t_total, h));
            let mut own_last = decode.then(|| ActBuf::new(kind, n, h));
            let (own_xn, own_last) = (
                own_xn.as_mut().map(ActBuf::shared),
                own_last.as_mut().map(ActBuf::shared),
            );
            // The tokens normed with `weight`, as the next product reads them.
            // SAFETY: called after the deal that last wrote `x` and before the product, with `xns` free
            // (see `normed`).
            let norm_tokens = |weight: &[f32], row: &mut [f32]| unsafe {
                normed(tm, own_xn, xns, xs, h, t_total, |t| t, weight, eps, row)
            };
            for (li, lw) in self.weights.layers.iter().enumerate() {
                let x_in = norm_tokens(&lw.attn_norm, &mut row);
                matmul_part(tm, x_in, t_total, &lw.wqkv, qkvs, false);
                let (cos, sin) = match (&sliding_angles, c.layer_window(li)) {
                    (Some((cs, sn)), Some(_)) => (cs, sn),
                    _ => (&cos, &sin),
                };
                let angles_of = |t: usize| {
                    (
                        &cos[t * half..(t + 1) * half],
                        &sin[t * half..(t + 1) * half],
                    )
                };
                // K and V of every token in one work item, which writes them to the storage; the
                // query of each token in one item each. Element by element: the same bits whoever
                // computes them.
                tm.deal(1 + t_total, |items| {
                    for item in items {
                        if item == 0 {
                            // SAFETY: only this item writes the storage until the deal is done.
                            let kv = unsafe { kvs.get_mut() };
                            let slots = &slots_of[if paged { li } else { 0 }];
                            for (t, &(block, slot)) in slots.iter().enumerate() {
                                let row = unsafe {
                                    qkvs.part_mut(t * qkv_dim + q_dim..(t + 1) * qkv_dim)
                                };
                                if let Some(b) = &lw.bqkv {
                                    add_in_place(row, &b[q_dim..]);
                                }
                                let (cs, sn) = angles_of(t);
                                let (kr, vr) = row.split_at_mut(kv_dim);
                                if let Some(g) = &lw.gemma {
                                    norm_heads(kr, &g.k_norm, eps, &mut heads);
                                }
                                rope(kr, d, c.params.rope_style, cs, sn);
                                kv.write_token(li, block, slot, kr, vr);
                            }
                            continue;
                        }
                        let t = item - 1;
                        let qr = unsafe { qkvs.part_mut(t * qkv_dim..t * qkv_dim + q_dim) };
                        if let Some(b) = &lw.bqkv {
                            add_in_place(qr, &b[..q_dim]);
                        }
                        let (cs, sn) = angles_of(t);
                        if let Some(g) = &lw.gemma {
                            norm_heads(qr, &g.q_norm, eps, &mut heads);
                        }
                        rope(qr, d, c.params.rope_style, cs, sn);
                        if let Some(s) = q_scale {
                            scale_in_place(qr, s);
                        }
                    }
                });
                let layer_kv = unsafe { kvs.get() }.layer(li);
                let shape = AttnShape {
                    window: c.layer_window(li),
                    ..shape
                };
                unsafe {
                    attention_part(
                        tm,
                        qkvs.all(),
                        qkv_dim,
                        &seqs_of[if paged { li } else { 0 }],
                        layer_kv,
                        shape,
                        parts,
                        attns,
                    )
                };
                match &lw.gemma {
                    Some(g) => {
                        unsafe { matmul_part(tm, attns.read(), t_total, &lw.wo, projs, false) };
                        unsafe {
                            add_normed(tm, t_total, projs, xs, &g.post_attn_norm, eps, &mut row)
                        };
                    }
                    None => unsafe { matmul_part(tm, attns.read(), t_total, &lw.wo, xs, true) },
                }
                let x_in = norm_tokens(&lw.ffn_norm, &mut row);
                matmul_part(tm, x_in, t_total, &lw.w_gate_up, gus, false);
                // Work items of whole tokens; with fewer tokens than threads (decode), one per thread
                // of equal runs of 32 columns of every token instead, so that the exponentials and
                // the quantization are not left to one thread while the others wait. Element by
                // element: the same bits.
                let (threads, blocks) = (tm.size(), inter.div_ceil(QBLOCK));
                tm.deal(if decode { threads } else { t_total }, |items| {
                    let (tokens, c0, c1) = if decode {
                        let b0 = team::split(blocks, threads, items.start).start;
                        let b1 = team::split(blocks, threads, items.end - 1).end;
                        (0..t_total, b0 * QBLOCK, (b1 * QBLOCK).min(inter))
                    } else {
                        (items, 0, inter)
                    };
                    // A run of no columns (fewer blocks than threads) has nothing to do.
                    for t in tokens.filter(|_| c0 < c1) {
                        let base = t * 2 * inter;
                        let g = unsafe { gus.part_mut(base + c0..base + c1) };
                        let u = unsafe { gus.part_mut(base + inter + c0..base + inter + c1) };
                        let out = &mut row[..c1 - c0];
                        match activation {
                            Activation::Silu => silu_mul(g, u, out),
                            Activation::GeluTanh => gelu_tanh_mul(g, u, out),
                        }
                        unsafe { acts.write(t, c0, out) };
                    }
                });
                match &lw.gemma {
                    Some(g) => {
                        unsafe { matmul_part(tm, acts.read(), t_total, &lw.w_down, projs, false) };
                        unsafe {
                            add_normed(tm, t_total, projs, xs, &g.post_ffn_norm, eps, &mut row)
                        };
                    }
                    None => unsafe { matmul_part(tm, acts.read(), t_total, &lw.w_down, xs, true) },
                }
            }
            // The output head only for the tokens asked.
            let token = |i: usize| head_tokens[i];
            let final_norm = &self.weights.final_norm;
            let x_in = unsafe {
                normed(
                    tm, own_last, lasts, xs, h, n, token, final_norm, eps, &mut row,
                )
            };
            matmul_part(tm, x_in, n, head, logits_s, false);
        });
        Ok(Logits {
            vocab: head.rows,
            data: logits,
        })
    }
}

/// Which new tokens' logits a forward pass returns.
#[derive(Clone, Copy)]
enum Heads<'a> {
    /// Each sequence's last.
    Last,
    /// Every one.
    Every,
    /// Each sequence's last `tails[i]`.
    Tails(&'a [usize]),
}

/// The chat template of a model that ships none: Gemma 3's own for Gemma 3, else ChatML.
/// Cosines and sines of every position's RoPE angles: `(cos, sin)`, `positions × half` each.
fn angles(positions: &[usize], inv_freq: &[f32], half: usize) -> (Vec<f32>, Vec<f32>) {
    let mut cos = vec![0f32; positions.len() * half];
    let mut sin = vec![0f32; positions.len() * half];
    for (t, pos) in positions.iter().enumerate() {
        rope_angles(
            *pos,
            inv_freq,
            &mut cos[t * half..(t + 1) * half],
            &mut sin[t * half..(t + 1) * half],
        );
    }
    (cos, sin)
}

/// RMSNorm over each head of `x` (`heads × weight.len()`), in place; `scratch` at least as long as `x`.
fn norm_heads(x: &mut [f32], weight: &[f32], eps: f32, scratch: &mut [f32]) {
    let out = &mut scratch[..x.len()];
    rms_norm(x, weight, eps, out);
    x.copy_from_slice(out);
}

/// Rows `token(i)`, `i < rows`, of `x` (`h` wide) normed with `weight`, in the activation buffer the next
/// product reads. With a buffer of this thread's own (`own`: decode, fewer tokens than threads), every
/// thread norms all the rows into its own: the same arithmetic on each, so every thread multiplies the
/// same values, with no deal to wait for and no thread idle while one norms. Otherwise the rows are
/// dealt to the team and normed into `shared`.
///
/// # Safety
/// Nothing writes `x` during the call, and nothing else uses `shared` until the product that reads it
/// is done.
#[allow(clippy::too_many_arguments)]
unsafe fn normed<'b>(
    tm: &Team<'_>,
    own: Option<ActShared<'b>>,
    shared: ActShared<'b>,
    x: SharedMut<'_, f32>,
    h: usize,
    rows: usize,
    token: impl Fn(usize) -> usize,
    weight: &[f32],
    eps: f32,
    scratch: &mut [f32],
) -> Act<'b> {
    // SAFETY: the caller's guarantee.
    let x = unsafe { x.all() };
    let mut norm_rows = |dst: ActShared<'b>, rows: std::ops::Range<usize>| {
        for i in rows {
            let t = token(i);
            rms_norm(&x[t * h..(t + 1) * h], weight, eps, &mut scratch[..h]);
            // SAFETY: row i of `dst` is this thread's (its own buffer, or a dealt row).
            unsafe { dst.write(i, 0, &scratch[..h]) };
        }
    };
    let dst = match own {
        Some(o) => {
            norm_rows(o, 0..rows);
            o
        }
        None => {
            tm.deal(rows, |r| norm_rows(shared, r));
            shared
        }
    };
    // SAFETY: written above (or by the deal's items, all done); nothing writes it until the product
    // that reads it is done.
    unsafe { dst.read() }
}

/// `x[t] += RMSNorm(y[t])` for every token `t < tokens`, dealt to the team (Gemma's post-attention and
/// post-FFN norms, applied to a sublayer's output before its residual add); `row` at least
/// `weight.len()` long.
///
/// # Safety
/// During the deal nothing else touches `x` and `y`.
unsafe fn add_normed(
    tm: &Team<'_>,
    tokens: usize,
    y: SharedMut<'_, f32>,
    x: SharedMut<'_, f32>,
    weight: &[f32],
    eps: f32,
    row: &mut [f32],
) {
    let h = weight.len();
    tm.deal(tokens, |mine| {
        for t in mine {
            // SAFETY: the caller's guarantee; token t is this work item's.
            let (yr, xr) = unsafe {
                (
                    y.part_mut(t * h..(t + 1) * h),
                    x.part_mut(t * h..(t + 1) * h),
                )
            };
            rms_norm(yr, weight, eps, &mut row[..h]);
            add_in_place(xr, &row[..h]);
        }
    });
}

/// The KV storage, shared by the threads of a step: written by one work item of a deal, read by all
/// in later deals.
#[derive(Clone, Copy)]
struct KvShared(*mut KvStorage);

// SAFETY: see `Model::forward`: writes (one work item) and reads are in different deals.
unsafe impl Send for KvShared {}
// SAFETY: as above.
unsafe impl Sync for KvShared {}

impl KvShared {
    /// # Safety
    /// No other thread uses the storage until the deal that writes it is done.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get_mut(&self) -> &mut KvStorage {
        // SAFETY: the caller's guarantee; the storage outlives the step.
        unsafe { &mut *self.0 }
    }

    /// # Safety
    /// No thread writes the storage while the reference is used.
    unsafe fn get(&self) -> &KvStorage {
        // SAFETY: the caller's guarantee; the storage outlives the step.
        unsafe { &*self.0 }
    }
}
