//! `ModelSpec`: the shape facts of a model that decide its memory, read from a Hugging Face `config.json`
//! (also the form the built-in catalog and GGUF metadata are turned into), and the `KvLayout` they imply.
//!
//! Raw JSON → validated `ModelSpec` (required keys checked, each error names the key) → `KvLayout`.
//! Parameter counts are estimated from the shapes when the source gives none (see [`ModelSpec::params`]).

use serde_json::Value;

use kura_kv::codec::KvDtype;
use kura_kv::layout::{AttentionKind, KvLayout, LayerKv, LayoutError};

/// Mixture-of-experts shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeSpec {
    pub num_experts: usize,
    pub experts_per_token: usize,
    /// FFN width of one routed expert.
    pub expert_intermediate: usize,
    /// Total FFN width of the always-on shared experts (0 when none).
    pub shared_intermediate: usize,
    /// Leading layers with a dense FFN instead of experts (DeepSeek's `first_k_dense_replace`).
    pub first_dense_layers: usize,
}

/// Multi-head latent attention shape (DeepSeek-V2/V3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MlaSpec {
    pub kv_lora_rank: usize,
    pub qk_rope_head_dim: usize,
    pub qk_nope_head_dim: usize,
    pub v_head_dim: usize,
    /// 0 when queries are projected directly.
    pub q_lora_rank: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSpec {
    pub name: String,
    /// Where the numbers come from (a config URL or file path).
    pub source: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub max_context: Option<u64>,
    pub tied_embeddings: bool,
    /// Attention kind of each layer (`num_layers` entries).
    pub layer_attention: Vec<AttentionKind>,
    pub moe: Option<MoeSpec>,
    pub mla: Option<MlaSpec>,
    /// Parameter count given by the source; `None` means estimate it from the shapes.
    pub params_given: Option<u64>,
}

/// A config that does not describe a model Kura can size.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("config is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("config is not a JSON object")]
    NotAnObject,
    #[error("config has no '{key}' (needed for {why})")]
    Missing {
        key: &'static str,
        why: &'static str,
    },
    #[error("config key '{key}' must be a positive integer, got {got}")]
    BadNumber { key: String, got: String },
    #[error("config key '{key}' is {got}; {why}")]
    OutOfRange {
        key: String,
        got: u64,
        why: &'static str,
    },
    #[error("config: {0}")]
    Inconsistent(String),
    #[error("config: {0} overflows 64 bits: the sizes are too large")]
    Overflow(String),
    /// An error of GGUF metadata, naming its keys.
    #[error("{0}")]
    Gguf(String),
}

/// The longest context a config may declare: positions are 32-bit in Kura's engine and API, and no model
/// comes near it.
pub const MAX_CONTEXT: u64 = u32::MAX as u64;

/// `a × b × …` of named sizes, or an error naming them when the product leaves 64 bits.
fn product(factors: &[(&str, u64)]) -> Result<u64, SpecError> {
    factors
        .iter()
        .try_fold(1u64, |acc, (_, v)| acc.checked_mul(*v))
        .ok_or_else(|| {
            let names: Vec<String> = factors.iter().map(|(k, v)| format!("{k} {v}")).collect();
            SpecError::Overflow(names.join(" × "))
        })
}

/// `a + b + …` of named terms, or an error naming what they add up to.
fn sum(what: &str, terms: &[u64]) -> Result<u64, SpecError> {
    terms
        .iter()
        .try_fold(0u64, |acc, t| acc.checked_add(*t))
        .ok_or_else(|| SpecError::Overflow(what.to_string()))
}

/// A value as shown in an error: its JSON, cut to 60 bytes.
pub fn short(v: &Value) -> String {
    let mut shown = v.to_string();
    if shown.len() > 60 {
        let cut = (0..=60)
            .rev()
            .find(|i| shown.is_char_boundary(*i))
            .unwrap_or(0);
        shown.truncate(cut);
        shown.push('…');
    }
    shown
}

fn get<'a>(cfg: &'a Value, keys: &[&str]) -> Option<(&'a Value, String)> {
    keys.iter().find_map(|k| {
        cfg.get(*k)
            .filter(|v| !v.is_null())
            .map(|v| (v, k.to_string()))
    })
}

fn opt_usize(cfg: &Value, keys: &[&str]) -> Result<Option<usize>, SpecError> {
    match get(cfg, keys) {
        None => Ok(None),
        Some((v, key)) => {
            let n = match (v.as_u64(), v.as_f64()) {
                (Some(n), _) => Some(n),
                // Some configs write integers as floats (1e4, 4096.0); beyond 2^53 a float is not exact.
                (None, Some(f)) if f >= 0.0 && f.fract() == 0.0 && f <= (1u64 << 53) as f64 => {
                    Some(f as u64)
                }
                _ => None,
            };
            n.and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| SpecError::BadNumber {
                    key,
                    got: v.to_string(),
                })
        }
    }
}

fn req_usize(cfg: &Value, keys: &[&'static str], why: &'static str) -> Result<usize, SpecError> {
    match get(cfg, keys).map(|(_, k)| k) {
        None => Err(SpecError::Missing { key: keys[0], why }),
        Some(key) => match opt_usize(cfg, keys)? {
            Some(0) | None => Err(SpecError::BadNumber {
                key,
                got: "0".into(),
            }),
            Some(n) => Ok(n),
        },
    }
}

/// The KV layout of layers of `kv_heads × head_dim` with the given attention kinds: the one rule for the
/// planner and the runtime. A window at least as long as the model's context never slides.
pub fn kv_layout(
    kv_heads: usize,
    head_dim: usize,
    layer_attention: &[AttentionKind],
    max_context: Option<u64>,
    dtype: KvDtype,
    block_size_tokens: usize,
) -> Result<KvLayout, LayoutError> {
    let layers = layer_attention
        .iter()
        .map(|&attention| LayerKv {
            kv_heads,
            head_dim,
            attention: match attention {
                AttentionKind::SlidingWindow { window_tokens }
                    if max_context.is_some_and(|max| window_tokens as u64 >= max) =>
                {
                    AttentionKind::Full
                }
                other => other,
            },
        })
        .collect();
    KvLayout::new(layers, dtype, block_size_tokens)
}

impl ModelSpec {
    /// Parses a Hugging Face `config.json` text.
    pub fn from_hf_config_str(text: &str, name: &str, source: &str) -> Result<Self, SpecError> {
        let v: Value = serde_json::from_str(text)?;
        Self::from_hf_config(&v, name, source)
    }

    /// Reads a Hugging Face config object (multimodal configs: their `text_config`).
    pub fn from_hf_config(cfg: &Value, name: &str, source: &str) -> Result<Self, SpecError> {
        if !cfg.is_object() {
            return Err(SpecError::NotAnObject);
        }
        let model_type = cfg
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let cfg = match cfg.get("text_config") {
            Some(t) if t.is_object() => t,
            _ => cfg,
        };
        let text_type = cfg
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or(&model_type)
            .to_string();

        let num_layers = req_usize(
            cfg,
            &["num_hidden_layers", "n_layer", "num_layers"],
            "the number of layers",
        )?;
        if num_layers > KvLayout::MAX_LAYERS {
            // Checked before the per-layer tables below allocate by it.
            return Err(SpecError::OutOfRange {
                key: "num_hidden_layers".into(),
                got: num_layers as u64,
                why: "more layers than Kura supports (65,536)",
            });
        }
        let hidden_size = req_usize(
            cfg,
            &["hidden_size", "n_embd", "d_model"],
            "the model width",
        )?;
        let num_heads = req_usize(
            cfg,
            &["num_attention_heads", "n_head"],
            "the number of attention heads",
        )?;
        let multi_query = cfg
            .get("multi_query")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let num_kv_heads =
            match opt_usize(cfg, &["num_key_value_heads", "n_head_kv", "num_kv_heads"])? {
                Some(0) => {
                    return Err(SpecError::BadNumber {
                        key: "num_key_value_heads".into(),
                        got: "0".into(),
                    })
                }
                Some(n) => n,
                None if multi_query => 1,
                None => num_heads,
            };
        if num_kv_heads > num_heads {
            return Err(SpecError::Inconsistent(format!(
                "num_key_value_heads ({num_kv_heads}) exceeds num_attention_heads ({num_heads})"
            )));
        }
        if num_heads % num_kv_heads != 0 {
            return Err(SpecError::Inconsistent(format!(
                "num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
            )));
        }
        let head_dim = match opt_usize(cfg, &["head_dim"])? {
            Some(0) => {
                return Err(SpecError::BadNumber {
                    key: "head_dim".into(),
                    got: "0".into(),
                })
            }
            Some(d) => d,
            None => {
                if hidden_size % num_heads != 0 {
                    return Err(SpecError::Inconsistent(format!(
                        "no head_dim given and hidden_size ({hidden_size}) is not a multiple of \
                         num_attention_heads ({num_heads})"
                    )));
                }
                hidden_size / num_heads
            }
        };
        let intermediate_size = match opt_usize(cfg, &["intermediate_size", "ffn_dim", "n_inner"])?
        {
            Some(n) => n,
            None => hidden_size.checked_mul(4).ok_or_else(|| {
                SpecError::Overflow(format!(
                    "4 × hidden_size {hidden_size} (the default FFN width)"
                ))
            })?,
        };
        let vocab_size = req_usize(cfg, &["vocab_size"], "the embedding size")?;
        let max_context = opt_usize(
            cfg,
            &[
                "max_position_embeddings",
                "n_positions",
                "seq_length",
                "max_seq_len",
            ],
        )?
        .map(|n| n as u64);
        if let Some(n) = max_context.filter(|n| *n == 0 || *n > MAX_CONTEXT) {
            let key = get(
                cfg,
                &[
                    "max_position_embeddings",
                    "n_positions",
                    "seq_length",
                    "max_seq_len",
                ],
            )
            .map_or_else(|| "max_position_embeddings".to_string(), |(_, k)| k);
            return Err(SpecError::OutOfRange {
                key,
                got: n,
                why: "a model's context must be 1 to 4,294,967,295 tokens",
            });
        }
        let tied_embeddings = cfg
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(false);

        let mla = match opt_usize(cfg, &["kv_lora_rank"])? {
            Some(rank) if rank > 0 => Some(MlaSpec {
                kv_lora_rank: rank,
                qk_rope_head_dim: req_usize(cfg, &["qk_rope_head_dim"], "MLA's latent size")?,
                qk_nope_head_dim: opt_usize(cfg, &["qk_nope_head_dim"])?.unwrap_or(head_dim),
                v_head_dim: opt_usize(cfg, &["v_head_dim"])?.unwrap_or(head_dim),
                q_lora_rank: opt_usize(cfg, &["q_lora_rank"])?.unwrap_or(0),
            }),
            _ => None,
        };

        let layer_attention = Self::layer_attention(cfg, &text_type, num_layers, mla.as_ref())?;

        let num_experts = opt_usize(
            cfg,
            &["num_local_experts", "num_experts", "n_routed_experts"],
        )?
        .unwrap_or(0);
        let moe = if num_experts > 1 {
            let experts_per_token = req_usize(
                cfg,
                &["num_experts_per_tok", "num_experts_per_token"],
                "MoE routing",
            )?;
            let expert_intermediate =
                opt_usize(cfg, &["moe_intermediate_size"])?.unwrap_or(intermediate_size);
            let shared_intermediate = match opt_usize(cfg, &["shared_expert_intermediate_size"])? {
                Some(n) => n,
                None => {
                    let n = opt_usize(cfg, &["n_shared_experts"])?.unwrap_or(0);
                    n.checked_mul(expert_intermediate).ok_or_else(|| {
                        SpecError::Overflow(format!(
                            "n_shared_experts {n} × moe_intermediate_size {expert_intermediate}"
                        ))
                    })?
                }
            };
            let first_dense_layers = opt_usize(cfg, &["first_k_dense_replace"])?
                .unwrap_or(0)
                .min(num_layers);
            Some(MoeSpec {
                num_experts,
                experts_per_token,
                expert_intermediate,
                shared_intermediate,
                first_dense_layers,
            })
        } else {
            None
        };

        let spec = ModelSpec {
            name: name.to_string(),
            source: source.to_string(),
            num_layers,
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size,
            vocab_size,
            max_context,
            tied_embeddings,
            layer_attention,
            moe,
            mla,
            params_given: opt_usize(cfg, &["num_parameters", "params"])?.map(|n| n as u64),
        };
        spec.check_sizes()?;
        Ok(spec)
    }

    /// The products the planner takes of the shapes fit in 64 bits: the parameter estimate, the FFN width
    /// of a token, and a whole-model KV block in the widest format at the largest block size (so that
    /// `kv_layout` cannot overflow either). Errors name the fields.
    fn check_sizes(&self) -> Result<(), SpecError> {
        self.try_estimate_params()?;
        self.try_active_ffn_width()?;
        let latent = match &self.mla {
            Some(m) => m
                .kv_lora_rank
                .checked_add(m.qk_rope_head_dim)
                .ok_or_else(|| SpecError::Overflow("kv_lora_rank + qk_rope_head_dim".into()))?,
            None => 0,
        };
        let per_layer: &[(&str, u64)] = if self.mla.is_some() {
            &[("kv_lora_rank + qk_rope_head_dim", latent as u64)]
        } else {
            &[
                ("K and V", 2),
                ("num_key_value_heads", self.num_kv_heads as u64),
                ("head_dim", self.head_dim as u64),
            ]
        };
        let fixed = [
            ("num_hidden_layers", self.num_layers as u64),
            ("f32 bytes", 4),
            ("tokens per block", KvLayout::MAX_BLOCK_SIZE as u64),
        ];
        product(&[per_layer, &fixed[..]].concat())?;
        Ok(())
    }

    /// Which layers slide, from the config's own words:
    /// - `layer_types` (newer transformers): `"sliding_attention"` / `"full_attention"` per layer;
    /// - Gemma-2: every even layer (0, 2, …) slides; Gemma-3: `sliding_window_pattern` (default 6), every
    ///   pattern-th layer is global;
    /// - Qwen2: only with `use_sliding_window`, and only layers at or past `max_window_layers`;
    /// - otherwise a `sliding_window` applies to every layer (Mistral v0.1, Phi-3).
    fn layer_attention(
        cfg: &Value,
        model_type: &str,
        num_layers: usize,
        mla: Option<&MlaSpec>,
    ) -> Result<Vec<AttentionKind>, SpecError> {
        if let Some(m) = mla {
            let latent_dim = m
                .kv_lora_rank
                .checked_add(m.qk_rope_head_dim)
                .ok_or_else(|| SpecError::Overflow("kv_lora_rank + qk_rope_head_dim".into()))?;
            return Ok(vec![AttentionKind::Mla { latent_dim }; num_layers]);
        }
        let qwen_off = model_type.starts_with("qwen")
            && !cfg
                .get("use_sliding_window")
                .and_then(Value::as_bool)
                .unwrap_or(false);
        let window = opt_usize(cfg, &["sliding_window"])?;
        let window_tokens = match window {
            None => return Ok(vec![AttentionKind::Full; num_layers]),
            // Qwen configs carry a window they do not use: its value does not matter.
            Some(_) if qwen_off => return Ok(vec![AttentionKind::Full; num_layers]),
            Some(0) => {
                return Err(SpecError::BadNumber {
                    key: "sliding_window".into(),
                    got: "0".into(),
                })
            }
            Some(w) => w,
        };
        let slide = AttentionKind::SlidingWindow { window_tokens };
        if let Some(types) = cfg.get("layer_types").filter(|v| !v.is_null()) {
            let types: Vec<&str> = types
                .as_array()
                .and_then(|a| a.iter().map(Value::as_str).collect())
                .ok_or_else(|| {
                    SpecError::Inconsistent(format!(
                        "layer_types must be a list of strings, got {}",
                        short(types)
                    ))
                })?;
            if types.len() != num_layers {
                return Err(SpecError::Inconsistent(format!(
                    "layer_types has {} entries for {num_layers} layers",
                    types.len()
                )));
            }
            return Ok(types
                .iter()
                .map(|t| {
                    if t.contains("sliding") {
                        slide
                    } else {
                        AttentionKind::Full
                    }
                })
                .collect());
        }
        let per_layer = |f: &dyn Fn(usize) -> bool| -> Vec<AttentionKind> {
            (0..num_layers)
                .map(|i| if f(i) { slide } else { AttentionKind::Full })
                .collect()
        };
        Ok(match model_type {
            "gemma2" => per_layer(&|i| i % 2 == 0),
            t if t.starts_with("gemma3") => {
                let pattern = opt_usize(cfg, &["sliding_window_pattern"])?
                    .unwrap_or(6)
                    .max(1);
                per_layer(&|i| (i + 1) % pattern != 0)
            }
            // `use_sliding_window` is set (checked above); transformers' Qwen2 default is 28.
            t if t.starts_with("qwen") => {
                let from = opt_usize(cfg, &["max_window_layers"])?.unwrap_or(28);
                per_layer(&|i| i >= from)
            }
            _ => vec![slide; num_layers],
        })
    }

    /// The KV layout of the whole model in `dtype` with `block_size_tokens` per block.
    pub fn kv_layout(
        &self,
        dtype: KvDtype,
        block_size_tokens: usize,
    ) -> Result<KvLayout, LayoutError> {
        kv_layout(
            self.num_kv_heads,
            self.head_dim,
            &self.layer_attention,
            self.max_context,
            dtype,
            block_size_tokens,
        )
    }

    /// Parameters: the source's count when it gives one, else estimated from the shapes (embeddings, an
    /// untied head, attention projections (MLA's low-rank ones for DeepSeek), gated FFN or experts with
    /// their router, norms; biases are ignored, under 0.1 % for the models of the catalog).
    pub fn params(&self) -> u64 {
        self.params_given.unwrap_or_else(|| self.estimate_params())
    }

    /// The estimate of [`ModelSpec::params`]. A spec from [`ModelSpec::from_hf_config`] was checked to
    /// give one; fields edited past that saturate rather than wrap.
    pub fn estimate_params(&self) -> u64 {
        self.try_estimate_params().unwrap_or(u64::MAX)
    }

    /// The estimate with every product checked; an overflow names the fields.
    pub fn try_estimate_params(&self) -> Result<u64, SpecError> {
        let h = ("hidden_size", self.hidden_size as u64);
        let heads = ("num_attention_heads", self.num_heads as u64);
        let layers = self.num_layers as u64;
        let tables = if self.tied_embeddings { 1 } else { 2 };
        let embed = product(&[
            ("vocab_size", self.vocab_size as u64),
            h,
            ("tables", tables),
        ])?;
        let attention = match &self.mla {
            Some(m) => {
                let qk = (m.qk_nope_head_dim as u64)
                    .checked_add(m.qk_rope_head_dim as u64)
                    .ok_or_else(|| {
                        SpecError::Overflow("qk_nope_head_dim + qk_rope_head_dim".into())
                    })?;
                let qk = ("qk_nope_head_dim + qk_rope_head_dim", qk);
                let q = if m.q_lora_rank > 0 {
                    let rank = ("q_lora_rank", m.q_lora_rank as u64);
                    sum(
                        "the Q projection",
                        &[product(&[h, rank])?, product(&[rank, heads, qk])?],
                    )?
                } else {
                    product(&[h, heads, qk])?
                };
                let latent = (m.kv_lora_rank as u64)
                    .checked_add(m.qk_rope_head_dim as u64)
                    .ok_or_else(|| SpecError::Overflow("kv_lora_rank + qk_rope_head_dim".into()))?;
                let kv_a = product(&[h, ("kv_lora_rank + qk_rope_head_dim", latent)])?;
                let nope_v = (m.qk_nope_head_dim as u64)
                    .checked_add(m.v_head_dim as u64)
                    .ok_or_else(|| SpecError::Overflow("qk_nope_head_dim + v_head_dim".into()))?;
                let kv_b = product(&[
                    ("kv_lora_rank", m.kv_lora_rank as u64),
                    heads,
                    ("qk_nope_head_dim + v_head_dim", nope_v),
                ])?;
                let o = product(&[heads, ("v_head_dim", m.v_head_dim as u64), h])?;
                sum("the attention parameters", &[q, kv_a, kv_b, o])?
            }
            None => {
                let hd = ("head_dim", self.head_dim as u64);
                let qo = product(&[h, heads, hd, ("Q and O", 2)])?;
                let kv = product(&[
                    h,
                    ("num_key_value_heads", self.num_kv_heads as u64),
                    hd,
                    ("K and V", 2),
                ])?;
                sum("the attention parameters", &[qo, kv])?
            }
        };
        let dense_ffn = product(&[
            ("gate, up, down", 3),
            h,
            ("intermediate_size", self.intermediate_size as u64),
        ])?;
        let ffn_total = match &self.moe {
            None => product(&[("FFN", dense_ffn), ("num_hidden_layers", layers)])?,
            Some(m) => {
                let experts = ("num_experts", m.num_experts as u64);
                let moe_layer = sum(
                    "an MoE layer",
                    &[
                        product(&[
                            experts,
                            ("gate, up, down", 3),
                            h,
                            ("moe_intermediate_size", m.expert_intermediate as u64),
                        ])?,
                        product(&[
                            ("gate, up, down", 3),
                            h,
                            ("shared experts' width", m.shared_intermediate as u64),
                        ])?,
                        product(&[h, experts])?,
                    ],
                )?;
                let moe_layers = layers.saturating_sub(m.first_dense_layers as u64);
                sum(
                    "the FFN parameters",
                    &[
                        product(&[
                            ("FFN", dense_ffn),
                            ("first_k_dense_replace", m.first_dense_layers as u64),
                        ])?,
                        product(&[("MoE layer", moe_layer), ("MoE layers", moe_layers)])?,
                    ],
                )?
            }
        };
        let norms = product(&[("norms", 2 * layers + 1), h])?;
        let attention_total = product(&[("attention", attention), ("num_hidden_layers", layers)])?;
        sum(
            "the parameter count",
            &[embed, attention_total, ffn_total, norms],
        )
    }

    /// FFN width a token passes through (for the activation estimate): the dense width, or the routed
    /// experts' plus the shared ones'. Checked at construction, as [`ModelSpec::estimate_params`].
    pub fn active_ffn_width(&self) -> usize {
        self.try_active_ffn_width().unwrap_or(usize::MAX)
    }

    fn try_active_ffn_width(&self) -> Result<usize, SpecError> {
        match &self.moe {
            None => Ok(self.intermediate_size),
            Some(m) => m
                .experts_per_token
                .checked_mul(m.expert_intermediate)
                .and_then(|w| w.checked_add(m.shared_intermediate))
                .ok_or_else(|| {
                    SpecError::Overflow(format!(
                        "num_experts_per_tok {} × moe_intermediate_size {} + shared {}",
                        m.experts_per_token, m.expert_intermediate, m.shared_intermediate
                    ))
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn gqa_and_explicit_head_dim() {
        let cfg = json!({"num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "intermediate_size": 12288});
        let s = ModelSpec::from_hf_config(&cfg, "q", "t").unwrap();
        assert_eq!((s.num_kv_heads, s.head_dim), (8, 128));
        let mha = json!({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10});
        let s = ModelSpec::from_hf_config(&mha, "m", "t").unwrap();
        assert_eq!((s.num_kv_heads, s.head_dim), (4, 16));
    }

    #[test]
    fn missing_and_malformed_keys_are_named() {
        let err = ModelSpec::from_hf_config(&json!({"hidden_size": 64}), "x", "t").unwrap_err();
        assert!(err.to_string().contains("'num_hidden_layers'"), "{err}");
        let err = ModelSpec::from_hf_config(
            &json!({"num_hidden_layers": "many", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 1}),
            "x",
            "t",
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("num_hidden_layers") && err.to_string().contains("\"many\""),
            "{err}"
        );
        assert!(ModelSpec::from_hf_config_str("{not json", "x", "t")
            .unwrap_err()
            .to_string()
            .contains("JSON"));
        let err = ModelSpec::from_hf_config(
            &json!({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3, "vocab_size": 1}),
            "x",
            "t",
        )
        .unwrap_err();
        assert!(err.to_string().contains("not a multiple"), "{err}");
    }

    #[test]
    fn sliding_window_rules() {
        let base = |extra: Value| {
            let mut cfg = json!({"num_hidden_layers": 6, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10});
            cfg.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            ModelSpec::from_hf_config(&cfg, "x", "t")
                .unwrap()
                .layer_attention
        };
        let sw = AttentionKind::SlidingWindow {
            window_tokens: 4096,
        };
        let full = AttentionKind::Full;
        assert_eq!(base(json!({"sliding_window": 4096})), vec![sw; 6]);
        assert_eq!(
            base(json!({"model_type": "gemma2", "sliding_window": 4096})),
            vec![sw, full, sw, full, sw, full]
        );
        assert_eq!(
            base(
                json!({"model_type": "gemma3_text", "sliding_window": 4096, "sliding_window_pattern": 3})
            ),
            vec![sw, sw, full, sw, sw, full]
        );
        assert_eq!(
            base(
                json!({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": false})
            ),
            vec![full; 6]
        );
        assert_eq!(
            base(
                json!({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": true, "max_window_layers": 4})
            ),
            vec![full, full, full, full, sw, sw]
        );
        assert_eq!(base(json!({"sliding_window": null})), vec![full; 6]);
    }

    #[test]
    fn llama2_7b_params_estimate_is_close_to_its_card() {
        let cfg = json!({"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
            "intermediate_size": 11008, "vocab_size": 32000});
        let p = ModelSpec::from_hf_config(&cfg, "l", "t")
            .unwrap()
            .estimate_params();
        // Model card: 6.74 B.
        assert!((p as f64 - 6.74e9).abs() / 6.74e9 < 0.01, "{p}");
    }
}
