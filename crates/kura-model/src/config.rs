//! The model's shape and hyper-parameters, resolved from GGUF metadata or an HF `config.json`, validated
//! once (raw → validated, with cross-field checks that say what was given).

use kura_kv::codec::KvDtype;
use kura_kv::layout::{AttentionKind, KvLayout, LayerKv};
use serde::Deserialize;

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// Which architecture family (decides biases and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Mistral,
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
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_context: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_style: RopeStyle,
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Q, K and V projections carry a bias (Qwen2).
    pub qkv_bias: bool,
    /// The window of the layers that slide: each attends to at most this many tokens.
    pub sliding_window: Option<usize>,
    /// Which layers slide (all of them for Mistral; from `max_window_layers` on for Qwen2; as
    /// `layer_types` says where the config has it). Empty when nothing slides.
    pub sliding_layers: Vec<bool>,
    pub tie_word_embeddings: bool,
}

impl ModelConfig {
    pub fn validate(self) -> Result<Self> {
        let bad = |m: String| Err(ModelError::Config(m));
        if self.num_layers == 0
            || self.hidden_size == 0
            || self.vocab_size == 0
            || self.intermediate_size == 0
        {
            return bad(format!(
                "layers {}, hidden {}, intermediate {}, vocab {} must all be at least 1",
                self.num_layers, self.hidden_size, self.intermediate_size, self.vocab_size
            ));
        }
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return bad(format!(
                "{} attention heads must be a non-zero multiple of {} kv heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be even and non-zero (RoPE rotates pairs)",
                self.head_dim
            ));
        }
        if self.sliding_window == Some(0) {
            return bad("sliding_window 0".into());
        }
        if !self.sliding_layers.is_empty() && self.sliding_layers.len() != self.num_layers {
            return bad(format!(
                "layer_types has {} entries for {} layers",
                self.sliding_layers.len(),
                self.num_layers
            ));
        }
        Ok(self)
    }

    /// The window of layer `layer`, if it slides.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        self.sliding_window
            .filter(|_| self.sliding_layers.get(layer).copied().unwrap_or(false))
    }

    /// The KV cache shape of this model in `dtype` with blocks of `block_size_tokens`.
    pub fn kv_layout(&self, dtype: KvDtype, block_size_tokens: usize) -> Result<KvLayout> {
        let layers = (0..self.num_layers)
            .map(|i| LayerKv {
                kv_heads: self.num_kv_heads,
                head_dim: self.head_dim,
                attention: match self.layer_window(i) {
                    Some(w) if w < self.max_context => {
                        AttentionKind::SlidingWindow { window_tokens: w }
                    }
                    _ => AttentionKind::Full,
                },
            })
            .collect();
        Ok(KvLayout::new(layers, dtype, block_size_tokens)?)
    }

    /// Parameters of the weights (embedding counted once when tied).
    pub fn num_parameters(&self) -> usize {
        let (h, i, d) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let qkv = h * (self.num_heads + 2 * self.num_kv_heads) * d;
        let per_layer = qkv + self.num_heads * d * h + 3 * h * i + 2 * h;
        let emb = self.vocab_size * h * if self.tie_word_embeddings { 1 } else { 2 };
        per_layer * self.num_layers + emb + h
    }

    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch_name = g.get_str("general.architecture")?.to_string();
        let arch = match arch_name.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "mistral" => Arch::Mistral,
            other => return Err(ModelError::Architecture(other.to_string())),
        };
        let k = |s: &str| format!("{arch_name}.{s}");
        let u = |s: &str| g.get_u64(&k(s)).map(|v| v as usize);
        let hidden_size = u("embedding_length")?;
        let num_heads = u("attention.head_count")?;
        let num_kv_heads = g
            .opt_u64(&k("attention.head_count_kv"))?
            .map(|v| v as usize)
            .unwrap_or(num_heads);
        let head_dim = match g.opt_u64(&k("attention.key_length"))? {
            Some(d) => d as usize,
            None if num_heads > 0 => hidden_size / num_heads,
            None => 0,
        };
        let vocab_size = match g.opt_u64(&k("vocab_size"))? {
            Some(v) => v as usize,
            None => g.get_array("tokenizer.ggml.tokens")?.len(),
        };
        let tie = !g.tensors.contains_key("output.weight");
        let sliding_window = g
            .opt_u64(&k("attention.sliding_window"))?
            .map(|v| v as usize);
        let num_layers = u("block_count")?;
        ModelConfig {
            arch,
            hidden_size,
            intermediate_size: u("feed_forward_length")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            max_context: u("context_length")?,
            rms_norm_eps: g.get_f64(&k("attention.layer_norm_rms_epsilon"))? as f32,
            rope_theta: g.opt_f64(&k("rope.freq_base"))?.unwrap_or(10_000.0),
            // llama.cpp runs Llama/Mistral with NORM rope on permuted Q/K rows, Qwen2 with NEOX on HF rows.
            rope_style: if arch == Arch::Qwen2 {
                RopeStyle::Half
            } else {
                RopeStyle::Interleaved
            },
            rope_scaling: None,
            qkv_bias: arch == Arch::Qwen2,
            sliding_window,
            sliding_layers: if sliding_window.is_some() {
                vec![true; num_layers]
            } else {
                Vec::new()
            },
            tie_word_embeddings: tie,
        }
        .validate()
    }

    pub fn from_hf_json(text: &str) -> Result<Self> {
        let raw: HfConfig = serde_json::from_str(text)
            .map_err(|e| ModelError::Config(format!("config.json: {e}")))?;
        let model_type = raw.model_type.clone().unwrap_or_else(|| "llama".into());
        let arch = match model_type.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "mistral" => Arch::Mistral,
            other => return Err(ModelError::Architecture(other.to_string())),
        };
        // Older configs: `rope_theta` + `rope_scaling`; newer ones: one `rope_parameters` object.
        let rope = raw.rope_parameters.as_ref().or(raw.rope_scaling.as_ref());
        let rope_theta = raw
            .rope_parameters
            .as_ref()
            .and_then(|p| p.rope_theta)
            .or(raw.rope_theta)
            .unwrap_or(10_000.0);
        let rope_scaling = match rope {
            None => None,
            Some(s) => {
                let kind = s
                    .rope_type
                    .as_deref()
                    .or(s.kind.as_deref())
                    .unwrap_or("default");
                match kind {
                    "default" => None,
                    "llama3" => Some(Llama3RopeScaling {
                        factor: s.factor.unwrap_or(8.0),
                        low_freq_factor: s.low_freq_factor.unwrap_or(1.0),
                        high_freq_factor: s.high_freq_factor.unwrap_or(4.0),
                        original_max_position_embeddings: s
                            .original_max_position_embeddings
                            .unwrap_or(8192.0),
                    }),
                    other => {
                        return Err(ModelError::Config(format!(
                            "rope_scaling type '{other}' is not supported (supported: llama3)"
                        )))
                    }
                }
            }
        };
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        let head_dim = raw.head_dim.unwrap_or(
            raw.hidden_size
                .checked_div(raw.num_attention_heads)
                .unwrap_or(0),
        );
        // Qwen2 configs carry `sliding_window` but only apply it when `use_sliding_window` is set, and then
        // only from layer `max_window_layers` on (transformers' default: 28); `layer_types`, where a
        // config has it, names each layer's kind.
        let sliding_window = match arch {
            Arch::Qwen2 if !raw.use_sliding_window.unwrap_or(false) => None,
            _ => raw.sliding_window,
        };
        let n = raw.num_hidden_layers;
        let sliding_layers = match (&sliding_window, &raw.layer_types) {
            (None, _) => Vec::new(),
            (Some(_), Some(types)) => types.iter().map(|t| t.contains("sliding")).collect(),
            (Some(_), None) if arch == Arch::Qwen2 => {
                let from = raw.max_window_layers.unwrap_or(28);
                (0..n).map(|i| i >= from).collect()
            }
            (Some(_), None) => vec![true; n],
        };
        ModelConfig {
            arch,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: raw.vocab_size,
            max_context: raw.max_position_embeddings.unwrap_or(2048),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta,
            rope_style: RopeStyle::Half,
            rope_scaling,
            qkv_bias: arch == Arch::Qwen2 || raw.attention_bias.unwrap_or(false),
            sliding_window,
            sliding_layers,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
        }
        .validate()
    }
}

#[derive(Deserialize)]
struct HfRopeScaling {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
    /// Newer checkpoints (`rope_parameters`) keep the base here.
    rope_theta: Option<f64>,
}

#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<HfRopeScaling>,
    rope_parameters: Option<HfRopeScaling>,
    attention_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    layer_types: Option<Vec<String>>,
    tie_word_embeddings: Option<bool>,
}

/// Inverse frequencies of RoPE for one head (`head_dim / 2` values), Llama-3 scaling applied.
pub fn rope_inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let d = cfg.head_dim;
    (0..d / 2)
        .map(|i| {
            // HF computes the exponent in f32 and the power in f32: do the same so angles agree.
            let exponent = (2 * i) as f32 / d as f32;
            let mut f = 1.0f32 / (cfg.rope_theta as f32).powf(exponent);
            if let Some(s) = cfg.rope_scaling {
                let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
                let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
                let wavelen = 2.0 * std::f64::consts::PI / f as f64;
                let fd = f as f64;
                f = if wavelen < high_wavelen {
                    f
                } else if wavelen > low_wavelen {
                    (fd / s.factor) as f32
                } else {
                    let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    ((1.0 - smooth) * fd / s.factor + smooth * fd) as f32
                };
            }
            f
        })
        .collect()
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
        assert_eq!(c.head_dim, 16);
        let f = rope_inv_freq(&c);
        // The lowest frequency is divided by the factor, the highest kept.
        let plain = ModelConfig {
            rope_scaling: None,
            ..c.clone()
        };
        let g = rope_inv_freq(&plain);
        assert_eq!(f[0], g[0]);
        assert!((f[7] - g[7] / 8.0).abs() < 1e-12);
        let bad = json.replace("\"num_key_value_heads\":2", "\"num_key_value_heads\":3");
        let err = ModelConfig::from_hf_json(&bad).unwrap_err().to_string();
        assert!(
            err.contains("4 attention heads") && err.contains("3 kv heads"),
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
}
