//! The model's shape and hyper-parameters, resolved from GGUF metadata or an HF `config.json`, validated
//! once (raw → validated, with cross-field checks that say what was given).
//!
//! The shape (layers, heads, widths, vocabulary, context, which layers slide) is `kura-shape`'s
//! [`ModelSpec`], the reader `kura plan` uses too, kept as it read it ([`ModelConfig::shape`], read through
//! accessors; no field is copied); what it describes and the runtime cannot run (latent attention,
//! experts, windows of several sizes) is refused here with an error naming it. The numbers that do not
//! decide memory (RoPE, norm epsilon, biases) are read here.

use kura_kv::codec::KvDtype;
use kura_kv::layout::{AttentionKind, KvLayout};
use kura_shape::ModelSpec;
use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::tensors::{shape_matches, Naming};

/// Which architecture family (decides biases and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Mistral,
    /// Gemma 3 (text): embeddings scaled by √hidden, RMSNorm on each Q and K head, norms after attention
    /// and after the FFN (before their residual adds), GELU (tanh) gating, and sliding layers with a
    /// RoPE base of their own.
    Gemma3,
}

/// The activation of the gated FFN: `act(gate) · up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (Llama, Qwen2, Mistral).
    Silu,
    /// GELU, tanh approximation (PyTorch's `gelu(approximate="tanh")`; Gemma).
    GeluTanh,
}

/// How RoPE pairs the elements of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Elements `(2i, 2i+1)` rotate together: llama.cpp's NORM rope, matching the Q/K rows of a GGUF
    /// Llama, which the converter permuted from HF order.
    Interleaved,
    /// Elements `(i, i + head_dim/2)` rotate together: HF's `rotate_half` (and llama.cpp's NEOX).
    Half,
}

/// Llama-3 frequency-dependent RoPE scaling (`rope_type: "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    /// The shape, as `kura-shape` read it for the planner too: layers, heads, widths, vocabulary, the
    /// context (always set here: an HF config without one gets 2,048), tied embeddings, and each layer's
    /// attention (full, or one sliding window: [`refuse_what_the_runtime_lacks`] refused the rest).
    shape: ModelSpec,
    /// RoPE, norms and biases.
    pub params: RuntimeParams,
}

/// What the runtime reads of a model beyond its shape: RoPE, norms, biases.
#[derive(Debug, Clone, PartialEq)]
pub struct RuntimeParams {
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_style: RopeStyle,
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// The RoPE base of the sliding layers when it differs from `rope_theta` (Gemma 3: 10,000, while
    /// its full-attention layers use `rope_theta`).
    pub rope_theta_sliding: Option<f64>,
    /// Linear RoPE scaling of the full-attention layers (positions divided by this factor; Gemma 3's
    /// larger models).
    pub rope_linear_factor: Option<f64>,
    /// Per-frequency divisors of the inverse frequencies (a GGUF's `rope_freqs.weight`, which
    /// llama.cpp writes for Llama 3.1's scaling instead of its parameters): `head_dim / 2` positive
    /// numbers.
    pub rope_freq_factors: Option<Vec<f32>>,
    /// Attention scores are `q·k / sqrt(query_pre_attn_scalar)` when set (Gemma), else
    /// `q·k / sqrt(head_dim)`.
    pub query_pre_attn_scalar: Option<f64>,
    /// Q, K and V projections carry a bias (Qwen2).
    pub qkv_bias: bool,
}

/// The longest context a model may declare: positions and token counts are 32-bit in the engine and the
/// API (block tables, `max_tokens`, usage), so a longer one could never be served.
pub const MAX_CONTEXT: usize = u32::MAX as usize;
/// The largest vocabulary: token ids are `u32`.
pub const MAX_VOCAB: usize = u32::MAX as usize;

/// What each field is called in the source, so that an error names the key the user can fix.
struct Keys {
    layers: String,
    hidden: String,
    intermediate: String,
    heads: String,
    kv_heads: String,
    head_dim: String,
    vocab: String,
    context: String,
    window: String,
    eps: String,
    theta: String,
}

impl Keys {
    fn hf() -> Self {
        Keys {
            layers: "num_hidden_layers".into(),
            hidden: "hidden_size".into(),
            intermediate: "intermediate_size".into(),
            heads: "num_attention_heads".into(),
            kv_heads: "num_key_value_heads".into(),
            head_dim: "head_dim".into(),
            vocab: "vocab_size".into(),
            context: "max_position_embeddings".into(),
            window: "sliding_window".into(),
            eps: "rms_norm_eps".into(),
            theta: "rope_theta".into(),
        }
    }

    fn gguf(arch: &str, vocab: &str) -> Self {
        let k = |s: &str| format!("{arch}.{s}");
        Keys {
            layers: k("block_count"),
            hidden: k("embedding_length"),
            intermediate: k("feed_forward_length"),
            heads: k("attention.head_count"),
            kv_heads: k("attention.head_count_kv"),
            head_dim: k("attention.key_length"),
            vocab: vocab.into(),
            context: k("context_length"),
            window: k("attention.sliding_window"),
            eps: k("attention.layer_norm_rms_epsilon"),
            theta: k("rope.freq_base"),
        }
    }
}

/// `a × b × …` of named sizes, or an error naming them when the product exceeds `limit` (or `usize`).
fn product(factors: &[(&str, usize)], limit: usize) -> Result<usize> {
    match factors
        .iter()
        .try_fold(1usize, |acc, (_, v)| acc.checked_mul(*v))
    {
        Some(n) if n <= limit => Ok(n),
        _ => {
            let names: Vec<String> = factors.iter().map(|(k, v)| format!("{k} {v}")).collect();
            Err(ModelError::Config(format!(
                "{} exceeds {limit}: the sizes are too large",
                names.join(" × ")
            )))
        }
    }
}

impl ModelConfig {
    /// The configuration of a model of `shape` (as `kura-shape` read it, and accepted by
    /// [`refuse_what_the_runtime_lacks`]) run with `params`; a shape without a context gets 2,048
    /// tokens. Not yet validated: the constructors check it next.
    fn assemble(arch: Arch, mut shape: ModelSpec, params: RuntimeParams) -> Self {
        shape.max_context.get_or_insert(DEFAULT_CONTEXT);
        ModelConfig {
            arch,
            shape,
            params,
        }
    }

    /// The model's shape, as the planner reads it.
    pub fn shape(&self) -> &ModelSpec {
        &self.shape
    }
    pub fn hidden_size(&self) -> usize {
        self.shape.hidden_size
    }
    pub fn intermediate_size(&self) -> usize {
        self.shape.intermediate_size
    }
    pub fn num_layers(&self) -> usize {
        self.shape.num_layers
    }
    pub fn num_heads(&self) -> usize {
        self.shape.num_heads
    }
    pub fn num_kv_heads(&self) -> usize {
        self.shape.num_kv_heads
    }
    pub fn head_dim(&self) -> usize {
        self.shape.head_dim
    }
    pub fn vocab_size(&self) -> usize {
        self.shape.vocab_size
    }
    /// The longest context, in tokens.
    pub fn max_context(&self) -> usize {
        // `new` set it.
        self.shape
            .max_context
            .map_or(DEFAULT_CONTEXT as usize, |n| {
                usize::try_from(n).unwrap_or(usize::MAX)
            })
    }
    pub fn tie_word_embeddings(&self) -> bool {
        self.shape.tied_embeddings
    }
    /// The window of the layers that slide (one size: `new` refused several), if any layer slides.
    pub fn sliding_window(&self) -> Option<usize> {
        self.shape.layer_attention.iter().find_map(|a| match a {
            AttentionKind::SlidingWindow { window_tokens } => Some(*window_tokens),
            _ => None,
        })
    }

    /// Checks every field and the sizes they imply, naming the keys of an HF `config.json`.
    pub fn validate(self) -> Result<Self> {
        self.check(&Keys::hf())
    }

    fn check(self, k: &Keys) -> Result<Self> {
        let bad = |m: String| Err(ModelError::Config(m));
        for (key, v) in [
            (&k.layers, self.num_layers()),
            (&k.hidden, self.hidden_size()),
            (&k.intermediate, self.intermediate_size()),
            (&k.heads, self.num_heads()),
            (&k.kv_heads, self.num_kv_heads()),
            (&k.head_dim, self.head_dim()),
            (&k.vocab, self.vocab_size()),
            (&k.context, self.max_context()),
        ] {
            if v == 0 {
                return bad(format!("{key} is 0; it must be at least 1"));
            }
        }
        let limits = [
            (&k.layers, self.num_layers(), KvLayout::MAX_LAYERS, "layers"),
            (
                &k.vocab,
                self.vocab_size(),
                MAX_VOCAB,
                "tokens (ids are 32-bit)",
            ),
            (
                &k.context,
                self.max_context(),
                MAX_CONTEXT,
                "tokens (positions are 32-bit)",
            ),
        ];
        for (key, v, max, unit) in limits {
            if v > max {
                return bad(format!("{key} is {v}; at most {max} {unit} are supported"));
            }
        }
        let (heads, kv_heads, head_dim) = (self.num_heads(), self.num_kv_heads(), self.head_dim());
        if kv_heads > heads {
            return bad(format!(
                "{} {kv_heads} exceeds {} {heads}",
                k.kv_heads, k.heads
            ));
        }
        if !heads.is_multiple_of(kv_heads) {
            return bad(format!(
                "{heads} attention heads ({}) must be a multiple of {kv_heads} kv heads ({})",
                k.heads, k.kv_heads
            ));
        }
        if !head_dim.is_multiple_of(2) {
            return bad(format!(
                "{} {head_dim} must be even (RoPE rotates pairs)",
                k.head_dim
            ));
        }
        if self.sliding_window() == Some(0) {
            return bad(format!("{} is 0; it must be at least 1", k.window));
        }
        if !(self.params.rms_norm_eps.is_finite() && self.params.rms_norm_eps > 0.0) {
            return bad(format!(
                "{} {} must be a positive number",
                k.eps, self.params.rms_norm_eps
            ));
        }
        if !(self.params.rope_theta.is_finite() && self.params.rope_theta > 0.0) {
            return bad(format!(
                "{} {} must be a positive number",
                k.theta, self.params.rope_theta
            ));
        }
        for (key, v) in [
            ("sliding layers' RoPE base", self.params.rope_theta_sliding),
            ("rope.scaling.factor", self.params.rope_linear_factor),
            ("query_pre_attn_scalar", self.params.query_pre_attn_scalar),
        ] {
            if let Some(v) = v.filter(|v| !(v.is_finite() && *v > 0.0)) {
                return bad(format!("{key} {v} must be a positive number"));
            }
        }
        if let Some(r) = &self.params.rope_scaling {
            let positive = [
                ("factor", r.factor),
                ("low_freq_factor", r.low_freq_factor),
                ("high_freq_factor", r.high_freq_factor),
                (
                    "original_max_position_embeddings",
                    r.original_max_position_embeddings,
                ),
            ];
            for (key, v) in positive {
                if !(v.is_finite() && v > 0.0) {
                    return bad(format!("rope_scaling.{key} {v} must be a positive number"));
                }
            }
            if r.high_freq_factor <= r.low_freq_factor {
                return bad(format!(
                    "rope_scaling.high_freq_factor {} must exceed low_freq_factor {}",
                    r.high_freq_factor, r.low_freq_factor
                ));
            }
        }
        if self.shape.layer_attention.len() != self.num_layers() {
            return bad(format!(
                "layer_types has {} entries for {} layers",
                self.shape.layer_attention.len(),
                self.num_layers()
            ));
        }
        // Every weight matrix is dequantized to f32 at load: its bytes must be addressable.
        let f32_bytes = ("f32 bytes", 4);
        let heads = (k.heads.as_str(), heads);
        let kv_heads = (k.kv_heads.as_str(), kv_heads);
        let head_dim = (k.head_dim.as_str(), head_dim);
        let hidden = (k.hidden.as_str(), self.hidden_size());
        for factors in [
            &[heads, head_dim, hidden, f32_bytes][..],
            &[kv_heads, head_dim, hidden, f32_bytes],
            &[
                (k.intermediate.as_str(), self.intermediate_size()),
                hidden,
                ("gate and up", 2),
                f32_bytes,
            ],
            &[(k.vocab.as_str(), self.vocab_size()), hidden, f32_bytes],
        ] {
            product(factors, isize::MAX as usize)?;
        }
        if self.checked_parameters().is_none() {
            return bad(format!(
                "the parameter count of {} layers of these shapes overflows",
                self.num_layers()
            ));
        }
        // The runtime computes in f32: a value that is positive in f64 may still be 0 or infinite
        // there (a RoPE base of 1e-50 or 1e39), which would make every angle NaN or no rotation.
        let freqs = rope_inv_freq(&self);
        let sliding = rope_inv_freq_sliding(&self).unwrap_or_default();
        if let Some(f) = freqs
            .iter()
            .chain(&sliding)
            .find(|f| !(f.is_finite() && **f > 0.0))
        {
            return bad(format!(
                "the RoPE settings ({} {}, its scaling and the sliding layers' base) give an inverse \
                 frequency of {f} in f32; each must be a positive number",
                k.theta, self.params.rope_theta
            ));
        }
        if let Some(q) = self.query_scale().filter(|q| !(q.is_finite() && *q > 0.0)) {
            return bad(format!(
                "query_pre_attn_scalar {} gives a query scale of {q} in f32; it must be a positive number",
                self.params.query_pre_attn_scalar.unwrap_or_default()
            ));
        }
        Ok(self)
    }

    /// The activation of the gated FFN.
    pub fn activation(&self) -> Activation {
        match self.arch {
            Arch::Gemma3 => Activation::GeluTanh,
            _ => Activation::Silu,
        }
    }

    /// The factor the token embeddings are multiplied by before the first layer: √hidden for Gemma
    /// (in f32, as the reference computes in f32), none for the Llama family.
    pub fn embedding_scale(&self) -> Option<f32> {
        match self.arch {
            Arch::Gemma3 => Some((self.hidden_size() as f64).sqrt() as f32),
            _ => None,
        }
    }

    /// The factor Q is multiplied by so that attention, which divides scores by √head_dim, divides
    /// them by √query_pre_attn_scalar instead; `None` when the two agree.
    pub fn query_scale(&self) -> Option<f32> {
        let head_dim = self.head_dim() as f64;
        self.params
            .query_pre_attn_scalar
            .filter(|s| *s != head_dim)
            .map(|s| (head_dim / s).sqrt() as f32)
    }

    /// The window of layer `layer`, if it slides.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        match self.shape.layer_attention.get(layer) {
            Some(AttentionKind::SlidingWindow { window_tokens }) => Some(*window_tokens),
            _ => None,
        }
    }

    /// The KV cache shape of this model in `dtype` with blocks of `block_size_tokens`: the planner's
    /// ([`ModelSpec::kv_layout`] of the same shape).
    pub fn kv_layout(&self, dtype: KvDtype, block_size_tokens: usize) -> Result<KvLayout> {
        Ok(self.shape.kv_layout(dtype, block_size_tokens)?)
    }

    /// Parameters of the weights (embedding counted once when tied).
    pub fn num_parameters(&self) -> usize {
        // `validate` checked that the count fits.
        self.checked_parameters().unwrap_or(usize::MAX)
    }

    fn checked_parameters(&self) -> Option<usize> {
        let (h, i, d) = (
            self.hidden_size(),
            self.intermediate_size(),
            self.head_dim(),
        );
        let heads = self
            .num_kv_heads()
            .checked_mul(2)?
            .checked_add(self.num_heads())?;
        let qkv = h.checked_mul(heads)?.checked_mul(d)?;
        let o = self.num_heads().checked_mul(d)?.checked_mul(h)?;
        let ffn = h.checked_mul(i)?.checked_mul(3)?;
        // Two norms a layer; Gemma 3 adds two after attention and the FFN and two over a head.
        let norms = match self.arch {
            Arch::Gemma3 => h.checked_mul(4)?.checked_add(d.checked_mul(2)?)?,
            _ => h.checked_mul(2)?,
        };
        let per_layer = qkv.checked_add(o)?.checked_add(ffn)?.checked_add(norms)?;
        let tables = if self.tie_word_embeddings() { 1 } else { 2 };
        let emb = self.vocab_size().checked_mul(h)?.checked_mul(tables)?;
        per_layer
            .checked_mul(self.num_layers())?
            .checked_add(emb)?
            .checked_add(h)
    }

    /// The configuration a GGUF's metadata describes. Every key is checked (a 0, an absurd size or
    /// products that overflow are errors naming the key), and so are the shapes of the tensors the file
    /// holds against it: a file whose directory disagrees with its metadata fails here, before any
    /// tensor is read.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch_name = g.get_str("general.architecture")?.to_string();
        let arch = match arch_name.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "mistral" => Arch::Mistral,
            "gemma3" => Arch::Gemma3,
            other => return Err(ModelError::Architecture(other.to_string())),
        };
        let k = |s: &str| format!("{arch_name}.{s}");
        let gemma = match arch {
            Arch::Gemma3 => Some(GemmaGguf::read(g, &arch_name)?),
            _ => None,
        };
        // One value per key: a per-layer array (layers of different shapes) is not something the runtime
        // runs, and the shape reader refuses it with the key's name (the same reading as the text side's).
        let spec = kura_text::gguf_model_spec(g, &arch_name)
            .map_err(|e| ModelError::Config(e.to_string()))?;
        refuse_what_the_runtime_lacks(&spec, &k("attention.sliding_window"))?;
        let head_dim = spec.head_dim;
        if let Some(v) = g.opt_u64(&k("attention.value_length"))? {
            if v != head_dim as u64 {
                return Err(ModelError::BadValue {
                    key: k("attention.value_length"),
                    what: format!("is {v}, but Kura needs it equal to the key length {head_dim}"),
                });
            }
        }
        // Rotary embedding over part of a head (`rope.dimension_count` below the head size, as some
        // models use) is not what the runtime computes: refused rather than run wrong.
        if let Some(r) = g.opt_u64(&k("rope.dimension_count"))? {
            if r != head_dim as u64 {
                return Err(ModelError::BadValue {
                    key: k("rope.dimension_count"),
                    what: format!(
                        "is {r}, but Kura rotates whole heads: it needs the head size {head_dim}"
                    ),
                });
            }
        }
        let vocab_key = if g.metadata.contains_key(&k("vocab_size")) {
            k("vocab_size")
        } else {
            "tokenizer.ggml.tokens (its length)".to_string()
        };
        if spec.max_context.is_none() {
            return Err(ModelError::Config(format!(
                "GGUF metadata has no '{}'",
                k("context_length")
            )));
        }
        let query_pre_attn_scalar = gemma.map(|_| {
            gemma3_query_pre_attn_scalar(
                spec.num_layers,
                spec.hidden_size,
                spec.num_heads,
                head_dim,
            )
        });
        let params = RuntimeParams {
            rms_norm_eps: g.get_f64(&k("attention.layer_norm_rms_epsilon"))? as f32,
            rope_theta: g.opt_f64(&k("rope.freq_base"))?.unwrap_or(10_000.0),
            // llama.cpp runs Llama/Mistral with NORM rope on permuted Q/K rows, Qwen2 and Gemma with NEOX
            // on HF rows.
            rope_style: if matches!(arch, Arch::Qwen2 | Arch::Gemma3) {
                RopeStyle::Half
            } else {
                RopeStyle::Interleaved
            },
            rope_scaling: None,
            rope_theta_sliding: gemma.map(|_| GEMMA3_SLIDING_ROPE_THETA),
            rope_linear_factor: gguf_rope_linear_factor(g, &arch_name)?,
            rope_freq_factors: gguf_rope_freq_factors(g, head_dim)?,
            query_pre_attn_scalar,
            qkv_bias: arch == Arch::Qwen2,
        };
        let cfg =
            ModelConfig::assemble(arch, spec, params).check(&Keys::gguf(&arch_name, &vocab_key))?;
        cfg.check_gguf_tensors(g, &k("block_count"))?;
        Ok(cfg)
    }

    /// The tensors a GGUF holds against this configuration: each one the model reads is there, of an
    /// element type Kura reads and of the shape the configuration implies, and no layer tensor lies
    /// beyond the layer count. Every reader of a GGUF's configuration (the loaders, `kura plan`) so
    /// refuses the same files. O(tensors).
    fn check_gguf_tensors(&self, g: &GgufFile, layers_key: &str) -> Result<()> {
        for (name, expected) in crate::tensors::expected_shapes(Naming::Gguf, self) {
            let Some(info) = g.tensors.get(&name) else {
                return Err(ModelError::MissingTensor { name });
            };
            if info.dtype.block().is_none() {
                return Err(ModelError::TensorType {
                    name,
                    dtype: info.dtype.name(),
                });
            }
            let got: Vec<usize> = info.dims.iter().rev().copied().collect();
            if !shape_matches(&got, &expected) {
                return Err(ModelError::TensorShape {
                    name,
                    got,
                    expected,
                });
            }
        }
        for name in g.tensors.keys() {
            let layer = name
                .strip_prefix("blk.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|i| i.parse::<usize>().ok());
            if let Some(i) = layer.filter(|i| *i >= self.num_layers()) {
                return Err(ModelError::Config(format!(
                    "tensor '{name}' is for layer {i}, but {layers_key} is {}",
                    self.num_layers()
                )));
            }
        }
        Ok(())
    }

    /// The configuration an HF `config.json` describes; every field is checked and an error names it.
    /// Never panics, whatever the text (an entry point for fuzzing).
    pub fn from_hf_json(text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| ModelError::Config(format!("config.json is not valid JSON: {e}")))?;
        let raw = Json::new(&v)?;
        let model_type = raw.str("model_type")?.unwrap_or("llama");
        let arch = match model_type {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "mistral" => Arch::Mistral,
            "gemma3_text" => Arch::Gemma3,
            other => return Err(ModelError::Architecture(other.to_string())),
        };
        let (rope_theta, rope_scaling, gemma) = match arch {
            Arch::Gemma3 => {
                let g = GemmaHf::read(&raw)?;
                (g.rope_theta, None, Some(g))
            }
            _ => {
                let (theta, scaling) = llama_rope(&raw)?;
                refuse_llama_variants(&raw, arch)?;
                (theta, scaling, None)
            }
        };
        let mut spec = ModelSpec::from_hf_config(&v, model_type, "config.json")
            .map_err(|e| ModelError::Config(e.to_string()))?;
        refuse_what_the_runtime_lacks(&spec, "sliding_window")?;
        // transformers ties Gemma's output head to the embedding unless told otherwise.
        spec.tied_embeddings = raw
            .bool("tie_word_embeddings")?
            .unwrap_or(arch == Arch::Gemma3);
        let params = RuntimeParams {
            rms_norm_eps: raw.float("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_theta,
            rope_style: RopeStyle::Half,
            rope_scaling,
            rope_theta_sliding: gemma.map(|g| g.rope_theta_sliding),
            rope_linear_factor: gemma.and_then(|g| g.rope_linear_factor),
            rope_freq_factors: None,
            query_pre_attn_scalar: gemma.map(|g| g.query_pre_attn_scalar),
            // Qwen2's Q, K and V have biases; a Llama with `attention_bias` is refused above.
            qkv_bias: arch == Arch::Qwen2,
        };
        ModelConfig::assemble(arch, spec, params).validate()
    }
}

/// Refuses what a Llama-family `config.json` may ask for that Kura's runtime does not compute (it
/// would load, ignore it and compute another model): biases on the output projection and the FFN
/// (transformers' `attention_bias` puts one on `o_proj` as well as Q/K/V; `mlp_bias` on gate, up and
/// down) and an activation other than SiLU.
fn refuse_llama_variants(raw: &Json<'_>, arch: Arch) -> Result<()> {
    if arch != Arch::Qwen2 && raw.bool("attention_bias")? == Some(true) {
        return Err(ModelError::Config(
            "config.json: 'attention_bias' is true, which gives o_proj a bias as well as Q, K and \
             V; Kura's runtime has no o_proj bias"
                .into(),
        ));
    }
    if raw.bool("mlp_bias")? == Some(true) {
        return Err(ModelError::Config(
            "config.json: 'mlp_bias' is true; Kura's runtime has no biases on gate, up and down"
                .into(),
        ));
    }
    let act = raw.str("hidden_act")?.unwrap_or("silu");
    if !matches!(act, "silu" | "swish") {
        return Err(ModelError::Config(format!(
            "config.json: 'hidden_act' is '{act}'; Kura runs this architecture's FFN with silu"
        )));
    }
    Ok(())
}

/// RoPE of a Llama-family `config.json`: its base and Llama-3 scaling.
fn llama_rope(raw: &Json<'_>) -> Result<(f64, Option<Llama3RopeScaling>)> {
    // Older configs: `rope_theta` + `rope_scaling`; newer ones: one `rope_parameters` object.
    let params = raw.object("rope_parameters")?;
    let scaling = raw.object("rope_scaling")?;
    if let (Some(p), Some(s)) = (params, scaling) {
        let (pt, st) = (p.rope_type()?, s.rope_type()?);
        if pt != st {
            return Err(ModelError::Config(format!(
                "config.json has rope_parameters of type '{pt}' and rope_scaling of type '{st}': \
                 they disagree; keep one"
            )));
        }
    }
    let rope = params.or(scaling);
    let rope_theta = match params {
        Some(p) => p.float("rope_theta")?,
        None => None,
    };
    let rope_theta = match rope_theta {
        Some(t) => t,
        None => raw.float("rope_theta")?.unwrap_or(10_000.0),
    };
    let rope_scaling = match rope {
        None => None,
        Some(s) => match s.rope_type()? {
            "default" => None,
            "llama3" => Some(Llama3RopeScaling {
                factor: s.float("factor")?.unwrap_or(8.0),
                low_freq_factor: s.float("low_freq_factor")?.unwrap_or(1.0),
                high_freq_factor: s.float("high_freq_factor")?.unwrap_or(4.0),
                original_max_position_embeddings: s
                    .float("original_max_position_embeddings")?
                    .unwrap_or(8192.0),
            }),
            other => {
                return Err(ModelError::Config(format!(
                    "rope_scaling type '{other}' is not supported (supported: llama3)"
                )))
            }
        },
    };
    Ok((rope_theta, rope_scaling))
}

/// What a Gemma 3 `config.json` says beyond the common keys. Newer transformers write one RoPE object
/// per attention kind (`rope_parameters.full_attention`, `.sliding_attention`); older ones `rope_theta`,
/// `rope_local_base_freq` and `rope_scaling` (for the full-attention layers). Soft-capping and
/// activations other than GELU (tanh) are refused by name.
#[derive(Debug, Clone, Copy)]
struct GemmaHf {
    rope_theta: f64,
    rope_theta_sliding: f64,
    rope_linear_factor: Option<f64>,
    query_pre_attn_scalar: f64,
}

impl GemmaHf {
    fn read(raw: &Json<'_>) -> Result<Self> {
        for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
            if let Some(v) = raw.float(key)? {
                return Err(ModelError::Config(format!(
                    "config.json: '{key}' is {v}; logit soft-capping is not supported by Kura's runtime"
                )));
            }
        }
        if raw.bool("use_bidirectional_attention")? == Some(true) {
            return Err(ModelError::Config(
                "config.json: 'use_bidirectional_attention' is true; Kura's runtime runs causal \
                 attention only"
                    .into(),
            ));
        }
        let act = raw.str("hidden_activation")?.unwrap_or("gelu_pytorch_tanh");
        if act != "gelu_pytorch_tanh" {
            return Err(ModelError::Config(format!(
                "config.json: 'hidden_activation' is '{act}'; Kura runs Gemma 3 with gelu_pytorch_tanh"
            )));
        }
        let (full, sliding) = match raw.object("rope_parameters")? {
            Some(p) => (p.object("full_attention")?, p.object("sliding_attention")?),
            None => (None, None),
        };
        let rope_theta = match full {
            Some(f) => f.float("rope_theta")?,
            None => raw.float("rope_theta")?,
        }
        .unwrap_or(1_000_000.0);
        let rope_theta_sliding = match sliding {
            Some(s) => {
                if let Some(kind) = s.str("rope_type")?.filter(|k| *k != "default") {
                    return Err(ModelError::Config(format!(
                        "config.json: 'rope_parameters.sliding_attention.rope_type' is '{kind}'; \
                         Kura scales only the full-attention layers' RoPE"
                    )));
                }
                s.float("rope_theta")?
            }
            None => raw.float("rope_local_base_freq")?,
        }
        .unwrap_or(GEMMA3_SLIDING_ROPE_THETA);
        let scaling = match full {
            Some(f) => Some(f),
            None => raw.object("rope_scaling")?,
        };
        let rope_linear_factor = match scaling {
            None => None,
            Some(s) => match s.rope_type()? {
                "default" => None,
                "linear" => s.float("factor")?.filter(|f| *f != 1.0),
                other => {
                    return Err(ModelError::Config(format!(
                    "rope_scaling type '{other}' is not supported for Gemma 3 (supported: linear)"
                )))
                }
            },
        };
        Ok(GemmaHf {
            rope_theta,
            rope_theta_sliding,
            rope_linear_factor,
            query_pre_attn_scalar: raw.float("query_pre_attn_scalar")?.unwrap_or(256.0),
        })
    }
}

/// The context of a model whose config names none (transformers' default for Llama).
const DEFAULT_CONTEXT: u64 = 2048;

/// Refuses a `spec` the runtime cannot run, with an error naming what it lacks (latent attention,
/// experts, windows of several sizes; `window_key` names the window's key).
fn refuse_what_the_runtime_lacks(spec: &ModelSpec, window_key: &str) -> Result<()> {
    if let Some(m) = &spec.mla {
        return Err(ModelError::Config(format!(
            "multi-head latent attention (kv_lora_rank {}) is not supported by Kura's runtime \
             (`kura plan` sizes such models)",
            m.kv_lora_rank
        )));
    }
    if let Some(m) = &spec.moe {
        return Err(ModelError::Config(format!(
            "mixture of experts ({} experts) is not supported by Kura's runtime \
             (`kura plan` sizes such models)",
            m.num_experts
        )));
    }
    let mut windows = spec.layer_attention.iter().filter_map(|a| match a {
        AttentionKind::SlidingWindow { window_tokens } => Some(*window_tokens),
        _ => None,
    });
    let window = windows.next();
    if let Some((window, other)) = window.zip(windows.find(|w| Some(*w) != window)) {
        return Err(ModelError::Config(format!(
            "{window_key}: layers slide with windows of {window} and {other} tokens; Kura's \
             runtime runs one window size"
        )));
    }
    Ok(())
}

/// A JSON object of a config, read field by field so that a wrong type names its key (serde's derived
/// errors name only the line and column). A `null` field counts as absent, as transformers reads it.
#[derive(Clone, Copy)]
struct Json<'a> {
    obj: &'a serde_json::Map<String, Value>,
    /// The key of this object inside its parent, for nested errors (`rope_scaling.factor`).
    prefix: &'a str,
}

impl<'a> Json<'a> {
    fn new(v: &'a Value) -> Result<Self> {
        match v {
            Value::Object(obj) => Ok(Json { obj, prefix: "" }),
            _ => Err(ModelError::Config(
                "config.json is not a JSON object".into(),
            )),
        }
    }

    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn wrong(&self, key: &str, expected: &str, got: &Value) -> ModelError {
        ModelError::Config(format!(
            "config.json: '{}{key}' must be {expected}, got {}",
            self.prefix,
            kura_shape::spec::short(got)
        ))
    }

    /// A RoPE scaling object's kind: `rope_type`, else the older `type`, else "default".
    fn rope_type(&self) -> Result<&'a str> {
        Ok(match self.str("rope_type")? {
            Some(t) => t,
            None => self.str("type")?.unwrap_or("default"),
        })
    }

    fn float(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.wrong(key, "a number", v)))
            .transpose()
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| self.wrong(key, "true or false", v))
            })
            .transpose()
    }

    fn str(&self, key: &str) -> Result<Option<&'a str>> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| self.wrong(key, "a string", v)))
            .transpose()
    }

    fn object(&self, key: &'a str) -> Result<Option<Json<'a>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(obj)) => Ok(Some(Json {
                obj,
                prefix: match key {
                    "rope_scaling" => "rope_scaling.",
                    "rope_parameters" => "rope_parameters.",
                    "full_attention" => "rope_parameters.full_attention.",
                    "sliding_attention" => "rope_parameters.sliding_attention.",
                    _ => "",
                },
            })),
            Some(v) => Err(self.wrong(key, "an object", v)),
        }
    }
}

/// Inverse frequencies of RoPE for one head (`head_dim / 2` values) of the full-attention layers (every
/// layer, unless [`rope_inv_freq_sliding`] gives the sliding ones their own), Llama-3 or linear scaling
/// applied.
pub fn rope_inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let mut freqs = inv_freq(cfg.head_dim(), cfg.params.rope_theta, |f| {
        let mut f = match cfg.params.rope_scaling {
            Some(s) => llama3_scaled(f, &s),
            None => f,
        };
        if let Some(factor) = cfg.params.rope_linear_factor {
            f = (f as f64 / factor) as f32;
        }
        f
    });
    // As llama.cpp divides the angle's frequency by `rope_freqs.weight` (checked to be one positive
    // factor per frequency when the file was read).
    if let Some(factors) = &cfg.params.rope_freq_factors {
        for (f, d) in freqs.iter_mut().zip(factors) {
            *f /= d;
        }
    }
    freqs
}

impl ModelConfig {
    /// A digest of what computes K and V besides the weights: the RMSNorm epsilon, the RoPE style and
    /// the inverse frequencies of every layer kind (its base, scaling and factors), as fixed-width
    /// little-endian words. Cached KV is tied to it ([`crate::tensors::WeightsDigest`] covers the
    /// tensors): a file whose RoPE is read differently (a GGUF's `rope_freqs.weight`, an edited
    /// `config.json`) does not reuse KV computed without it.
    pub fn kv_params_digest(&self) -> u128 {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(b"kura-kv-params\0");
        bytes.extend_from_slice(&self.params.rms_norm_eps.to_bits().to_le_bytes());
        let style: u32 = match self.params.rope_style {
            RopeStyle::Interleaved => 1,
            RopeStyle::Half => 2,
        };
        bytes.extend_from_slice(&style.to_le_bytes());
        for freqs in [Some(rope_inv_freq(self)), rope_inv_freq_sliding(self)] {
            let freqs = freqs.unwrap_or_default();
            bytes.extend_from_slice(&(freqs.len() as u64).to_le_bytes());
            for f in freqs {
                bytes.extend_from_slice(&f.to_bits().to_le_bytes());
            }
        }
        xxhash_rust::xxh3::xxh3_128(&bytes)
    }
}

/// The inverse frequencies of the sliding layers when their RoPE base differs (Gemma 3); unscaled.
pub fn rope_inv_freq_sliding(cfg: &ModelConfig) -> Option<Vec<f32>> {
    cfg.params
        .rope_theta_sliding
        .map(|theta| inv_freq(cfg.head_dim(), theta, |f| f))
}

fn inv_freq(d: usize, theta: f64, scale: impl Fn(f32) -> f32) -> Vec<f32> {
    (0..d / 2)
        .map(|i| {
            // HF computes the exponent in f32 and the power in f32: do the same so angles agree.
            let exponent = (2 * i) as f32 / d as f32;
            scale(1.0f32 / (theta as f32).powf(exponent))
        })
        .collect()
}

/// Llama-3's frequency-dependent scaling of one inverse frequency.
fn llama3_scaled(f: f32, s: &Llama3RopeScaling) -> f32 {
    let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
    let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
    let wavelen = 2.0 * std::f64::consts::PI / f as f64;
    let fd = f as f64;
    if wavelen < high_wavelen {
        f
    } else if wavelen > low_wavelen {
        (fd / s.factor) as f32
    } else {
        let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor);
        ((1.0 - smooth) * fd / s.factor + smooth * fd) as f32
    }
}

/// The RoPE base of Gemma 3's sliding layers. GGUF does not store it: llama.cpp fixes it for the
/// architecture, as transformers' `rope_local_base_freq` default does.
pub const GEMMA3_SLIDING_ROPE_THETA: f64 = 10_000.0;

/// Gemma 3's `query_pre_attn_scalar`, which GGUF does not store: `hidden / heads` for the 27B model (62
/// layers), `head_dim` for the others (llama.cpp's rule, matching each model's HF config).
fn gemma3_query_pre_attn_scalar(
    layers: usize,
    hidden: usize,
    heads: usize,
    head_dim: usize,
) -> f64 {
    if layers == 62 {
        hidden as f64 / heads as f64
    } else {
        head_dim as f64
    }
}

/// The linear RoPE factor of a GGUF (`<arch>.rope.scaling.type` `linear` and its
/// `rope.scaling.factor`); `None` without scaling. Other kinds (YaRN, LongRoPE) are refused: Kura's
/// runtime would compute another model.
fn gguf_rope_linear_factor(g: &GgufFile, arch: &str) -> Result<Option<f64>> {
    let k = |s: &str| format!("{arch}.{s}");
    let kind_key = k("rope.scaling.type");
    let kind = match g.metadata.get(&kind_key) {
        None => None,
        Some(crate::gguf::Value::String(s)) => Some(s.as_str()),
        Some(_) => {
            return Err(ModelError::BadValue {
                key: kind_key,
                what: "is not a string".into(),
            })
        }
    };
    let factor_key = k("rope.scaling.factor");
    let factor = g.opt_f64(&factor_key)?;
    match (kind, factor) {
        (None | Some("none"), _) => Ok(None),
        (Some("linear"), Some(f)) if f.is_finite() && f > 0.0 => Ok((f != 1.0).then_some(f)),
        (Some("linear"), f) => Err(ModelError::BadValue {
            key: factor_key,
            what: format!("is {f:?}; linear RoPE scaling needs a positive factor"),
        }),
        (Some(other), _) => Err(ModelError::BadValue {
            key: kind_key,
            what: format!("is '{other}'; Kura runs linear RoPE scaling or none"),
        }),
    }
}

/// The tensor `rope_freqs.weight` of a GGUF, when there is one: llama.cpp's converter writes Llama
/// 3.1's RoPE scaling as one divisor per frequency. It must hold `head_dim / 2` positive finite
/// numbers.
fn gguf_rope_freq_factors(g: &GgufFile, head_dim: usize) -> Result<Option<Vec<f32>>> {
    const NAME: &str = "rope_freqs.weight";
    let Some(info) = g.tensors.get(NAME) else {
        return Ok(None);
    };
    // The shape first, from the directory: a large tensor under this name is not dequantized to be
    // refused.
    let shape_error = |got: Vec<usize>| ModelError::TensorShape {
        name: NAME.into(),
        got,
        expected: vec![head_dim / 2],
    };
    if info.dims.iter().product::<usize>() != head_dim / 2 {
        return Err(shape_error(info.dims.iter().rev().copied().collect()));
    }
    let (shape, values) = crate::tensors::TensorSource::load(g, NAME)?;
    if !crate::tensors::shape_matches(&shape, &[head_dim / 2]) {
        return Err(shape_error(shape));
    }
    if let Some(bad) = values.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
        return Err(ModelError::Config(format!(
            "tensor '{NAME}' holds {bad}; RoPE frequency factors must be positive numbers"
        )));
    }
    Ok(Some(values))
}

/// What a Gemma 3 GGUF says beyond the common keys: that it uses no logit soft-capping (which Kura's
/// runtime does not implement). Its RoPE scaling is read as every architecture's
/// ([`gguf_rope_linear_factor`]).
#[derive(Debug, Clone, Copy)]
struct GemmaGguf;

impl GemmaGguf {
    fn read(g: &GgufFile, arch: &str) -> Result<Self> {
        let k = |s: &str| format!("{arch}.{s}");
        for key in [k("final_logit_softcapping"), k("attn_logit_softcapping")] {
            if let Some(v) = g.opt_f64(&key)? {
                if v != 0.0 {
                    return Err(ModelError::BadValue {
                        key,
                        what: format!(
                            "is {v}; logit soft-capping is not supported by Kura's runtime"
                        ),
                    });
                }
            }
        }
        Ok(GemmaGguf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_config_with_llama3_scaling_and_bad_heads() {
        let json = r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"rope_theta":500000.0,
            "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
            "original_max_position_embeddings":8192}}"#;
        let c = ModelConfig::from_hf_json(json).unwrap();
        assert_eq!(c.head_dim(), 16);
        let f = rope_inv_freq(&c);
        // The lowest frequency is divided by the factor, the highest kept.
        let mut plain = c.clone();
        plain.params.rope_scaling = None;
        let g = rope_inv_freq(&plain);
        assert_eq!(f[0], g[0]);
        assert!((f[7] - g[7] / 8.0).abs() < 1e-12);
        let bad = json.replace("\"num_key_value_heads\":2", "\"num_key_value_heads\":3");
        let err = ModelConfig::from_hf_json(&bad).unwrap_err().to_string();
        assert!(
            err.contains("num_attention_heads (4) is not a multiple of num_key_value_heads (3)"),
            "{err}"
        );
    }

    #[test]
    fn kv_layout_carries_the_window() {
        let json = r#"{"model_type":"mistral","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"sliding_window":8,
            "max_position_embeddings":512}"#;
        let c = ModelConfig::from_hf_json(json).unwrap();
        let l = c.kv_layout(KvDtype::F32, 16).unwrap();
        assert!(l.has_sliding_window());
        assert_eq!(l.bytes_per_token(), 2 * 2 * 2 * 16 * 4);
    }

    #[test]
    fn qwen2_slides_only_from_max_window_layers_and_layer_types_must_fit() {
        let base = r#""model_type":"qwen2","hidden_size":64,"intermediate_size":128,"num_hidden_layers":3,
            "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"sliding_window":8"#;
        let cfg = |extra: &str| ModelConfig::from_hf_json(&format!("{{{base}{extra}}}"));
        let windows = |c: &ModelConfig| (0..3).map(|i| c.layer_window(i)).collect::<Vec<_>>();
        // Without use_sliding_window nothing slides.
        assert_eq!(windows(&cfg("").unwrap()), [None, None, None]);
        let c = cfg(r#","use_sliding_window":true,"max_window_layers":1"#).unwrap();
        assert_eq!(windows(&c), [None, Some(8), Some(8)]);
        let c = cfg(
            r#","use_sliding_window":true,"layer_types":["sliding_attention","full_attention","sliding_attention"]"#,
        )
        .unwrap();
        assert_eq!(windows(&c), [Some(8), None, Some(8)]);
        let err =
            cfg(r#","use_sliding_window":true,"layer_types":["full_attention"]"#).unwrap_err();
        assert!(
            err.to_string()
                .contains("layer_types has 1 entries for 3 layers"),
            "{err}"
        );
    }

    #[test]
    fn gemma3_configs_old_and_new_read_alike_and_refusals_name_the_key() {
        let base = r#""model_type":"gemma3_text","hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":6,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,
            "vocab_size":100,"sliding_window":8,"query_pre_attn_scalar":24"#;
        let cfg = |extra: &str| ModelConfig::from_hf_json(&format!("{{{base}{extra}}}"));
        let new = cfg(r#","rope_parameters":{"full_attention":{"rope_type":"linear","factor":4.0,
            "rope_theta":100000.0},"sliding_attention":{"rope_type":"default","rope_theta":20000.0}}"#)
        .unwrap();
        let old = cfg(r#","rope_theta":100000.0,"rope_local_base_freq":20000.0,
            "rope_scaling":{"rope_type":"linear","factor":4.0}"#)
        .unwrap();
        assert_eq!(new, old);
        assert_eq!(new.arch, Arch::Gemma3);
        assert_eq!(
            (
                new.params.rope_theta,
                new.params.rope_theta_sliding,
                new.params.rope_linear_factor
            ),
            (100_000.0, Some(20_000.0), Some(4.0))
        );
        assert!(new.tie_word_embeddings());
        assert_eq!(new.activation(), Activation::GeluTanh);
        // The sixth layer attends to everything (sliding_window_pattern's default of 6).
        let windows: Vec<_> = (0..6).map(|i| new.layer_window(i)).collect();
        assert_eq!(windows, [Some(8), Some(8), Some(8), Some(8), Some(8), None]);
        // Scores divided by √24, attention divides by √16: Q is scaled by √(16/24).
        let s = new.query_scale().unwrap();
        assert!((s - (16f32 / 24.0).sqrt()).abs() < 1e-7);
        // Defaults: the bases of transformers' Gemma 3, no scaling, query_pre_attn_scalar 256.
        let plain = ModelConfig::from_hf_json(&format!(
            "{{{}}}",
            base.replace(r#","query_pre_attn_scalar":24"#, "")
        ))
        .unwrap();
        assert_eq!(
            (
                plain.params.rope_theta,
                plain.params.rope_theta_sliding,
                plain.params.rope_linear_factor
            ),
            (1e6, Some(10_000.0), None)
        );
        assert_eq!(plain.params.query_pre_attn_scalar, Some(256.0));
        for (extra, expected) in [
            (
                r#","final_logit_softcapping":30.0"#,
                "'final_logit_softcapping' is 30",
            ),
            (
                r#","attn_logit_softcapping":50.0"#,
                "'attn_logit_softcapping' is 50",
            ),
            (
                r#","hidden_activation":"gelu""#,
                "'hidden_activation' is 'gelu'",
            ),
            (
                r#","use_bidirectional_attention":true"#,
                "'use_bidirectional_attention' is true",
            ),
            (
                r#","rope_parameters":{"sliding_attention":{"rope_type":"linear","factor":2.0}}"#,
                "'rope_parameters.sliding_attention.rope_type' is 'linear'",
            ),
            (
                r#","rope_scaling":{"rope_type":"yarn","factor":2.0}"#,
                "rope_scaling type 'yarn' is not supported for Gemma 3",
            ),
            (
                r#","query_pre_attn_scalar":0"#,
                "query_pre_attn_scalar 0 must be a positive number",
            ),
            (
                r#","query_pre_attn_scalar":1e-300"#,
                "gives a query scale of inf in f32",
            ),
        ] {
            let err = cfg(extra).unwrap_err().to_string();
            assert!(
                err.contains(expected),
                "{extra}: expected '{expected}' in: {err}"
            );
        }
    }

    #[test]
    fn absurd_hf_values_are_named() {
        let base = r#""model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100"#;
        let with = |extra: &str| ModelConfig::from_hf_json(&format!("{{{base}{extra}}}"));
        assert!(with("").is_ok());
        let max = u64::MAX;
        for (extra, expected) in [
            (r#","num_hidden_layers":0"#.to_string(), "'num_hidden_layers' must be a positive integer, got 0"),
            (
                r#","rope_parameters":{"rope_type":"default"},"rope_scaling":{"type":"linear","factor":0}"#.into(),
                "rope_parameters of type 'default' and rope_scaling of type 'linear'",
            ),
            (r#","num_attention_heads":0"#.into(), "'num_attention_heads' must be a positive integer, got 0"),
            (r#","num_key_value_heads":0"#.into(), "'num_key_value_heads' must be a positive integer, got 0"),
            (r#","head_dim":0"#.into(), "'head_dim' must be a positive integer, got 0"),
            (r#","vocab_size":0"#.into(), "'vocab_size' must be a positive integer, got 0"),
            (r#","max_position_embeddings":0"#.into(), "'max_position_embeddings' is 0"),
            (
                format!(r#","max_position_embeddings":{max}"#),
                "'max_position_embeddings' is 18446744073709551615",
            ),
            (
                r#","num_key_value_heads":8"#.into(),
                "num_key_value_heads (8) exceeds num_attention_heads (4)",
            ),
            (
                r#","num_attention_heads":3,"num_key_value_heads":1"#.into(),
                "hidden_size (64) is not a multiple of num_attention_heads (3)",
            ),
            (r#","sliding_window":0"#.into(), "'sliding_window' must be a positive integer, got 0"),
            (
                format!(r#","num_hidden_layers":{max}"#),
                "'num_hidden_layers' is 18446744073709551615",
            ),
            (
                r#","hidden_size":4294967296,"head_dim":16,"vocab_size":4294967295"#.into(),
                "vocab_size 4294967295 × hidden_size 4294967296",
            ),
            (r#","hidden_size":-1"#.into(), "'hidden_size' must be a positive integer, got -1"),
            (r#","vocab_size":1e300"#.into(), "'vocab_size' must be a positive integer"),
            (r#","hidden_size":"64""#.into(), "'hidden_size' must be a positive integer"),
            (r#","rms_norm_eps":-1.0"#.into(), "rms_norm_eps -1 must be a positive number"),
            (r#","rope_theta":0"#.into(), "rope_theta 0 must be a positive number"),
            // Positive in f64, 0 or infinite in f32, as the runtime computes.
            (r#","rope_theta":1e-50"#.into(), "give an inverse frequency of inf in f32"),
            (r#","rope_theta":1e39"#.into(), "give an inverse frequency of 0 in f32"),
            (
                r#","rope_scaling":{"rope_type":"llama3","factor":1e-300,"low_freq_factor":1,"high_freq_factor":4,"original_max_position_embeddings":8192}"#.into(),
                "give an inverse frequency of inf in f32",
            ),
            (
                r#","rope_scaling":{"rope_type":"llama3","low_freq_factor":4,"high_freq_factor":4}"#.into(),
                "rope_scaling.high_freq_factor 4 must exceed low_freq_factor 4",
            ),
            (r#","rope_scaling":{"factor":"x","rope_type":"llama3"}"#.into(), "'rope_scaling.factor' must be a number"),
            (r#","layer_types":[1],"sliding_window":4"#.into(), "layer_types must be a list of strings, got [1]"),
        ] {
            // A later key wins in serde_json's map, so `extra` overrides the base.
            let err = with(&extra).unwrap_err().to_string();
            assert!(err.contains(expected), "{extra}: expected '{expected}' in: {err}");
        }
        let err = ModelConfig::from_hf_json("[1]").unwrap_err().to_string();
        assert!(err.contains("not a JSON object"), "{err}");
        let err = ModelConfig::from_hf_json(r#"{"hidden_size":64}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no 'num_hidden_layers'"), "{err}");
    }
}
