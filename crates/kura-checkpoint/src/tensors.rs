//! What a checkpoint's tensors are called and where they come from: the names of each format
//! ([`Naming`]), a source of tensors dequantized to f32 ([`TensorSource`], a GGUF file or a safetensors
//! directory), the shapes a configuration expects, and the digest of the values every executor's loader
//! takes ([`WeightsDigest`]).

use std::sync::Mutex;

use xxhash_rust::xxh3::Xxh3;

use crate::config::{Arch, ModelConfig};
use crate::error::Result;
use crate::quant::GgmlType;

/// The tensor names of a checkpoint format.
#[derive(Debug, Clone, Copy)]
pub enum Naming {
    Gguf,
    Hf,
    /// HF names of Gemma 3, whose norm after attention is `post_attention_layernorm` and whose norm
    /// before the FFN is `pre_feedforward_layernorm`; its norm weights are stored as `w` of `x · (1 + w)`.
    HfGemma3,
}

impl Naming {
    /// The naming of `arch`'s HF checkpoints.
    pub fn hf(arch: Arch) -> Self {
        match arch {
            Arch::Gemma3 => Naming::HfGemma3,
            _ => Naming::Hf,
        }
    }

    /// What is added to stored RMSNorm weights: 1 for Gemma's HF weights (`x · (1 + w)`), else 0 (GGUF
    /// stores Gemma's with the one added).
    pub fn norm_offset(self) -> f32 {
        match self {
            Naming::HfGemma3 => 1.0,
            _ => 0.0,
        }
    }

    /// The stored name of a whole-model tensor: `embed`, `norm` or `lm_head`.
    pub fn global(self, what: &str) -> String {
        match (self, what) {
            (Naming::Gguf, "embed") => "token_embd.weight".into(),
            (Naming::Gguf, "norm") => "output_norm.weight".into(),
            (Naming::Gguf, "lm_head") => "output.weight".into(),
            (Naming::Hf | Naming::HfGemma3, "embed") => "model.embed_tokens.weight".into(),
            (Naming::Hf | Naming::HfGemma3, "norm") => "model.norm.weight".into(),
            (Naming::Hf | Naming::HfGemma3, "lm_head") => "lm_head.weight".into(),
            _ => unreachable!("unknown global tensor {what}"),
        }
    }

    /// The stored name of layer `i`'s tensor `what` (`q`, `k`, `v`, `o`, `gate`, `up`, `down`,
    /// `attn_norm`, `ffn_norm`, the biases `q_bias`…, Gemma's norms).
    pub fn layer(self, i: usize, what: &str) -> String {
        match self {
            Naming::Gguf => {
                let n = match what {
                    "attn_norm" => "attn_norm.weight",
                    "q" => "attn_q.weight",
                    "k" => "attn_k.weight",
                    "v" => "attn_v.weight",
                    "q_bias" => "attn_q.bias",
                    "k_bias" => "attn_k.bias",
                    "v_bias" => "attn_v.bias",
                    "o" => "attn_output.weight",
                    "ffn_norm" => "ffn_norm.weight",
                    "gate" => "ffn_gate.weight",
                    "up" => "ffn_up.weight",
                    "down" => "ffn_down.weight",
                    "q_norm" => "attn_q_norm.weight",
                    "k_norm" => "attn_k_norm.weight",
                    "post_attn_norm" => "post_attention_norm.weight",
                    "post_ffn_norm" => "post_ffw_norm.weight",
                    _ => unreachable!("unknown layer tensor {what}"),
                };
                format!("blk.{i}.{n}")
            }
            Naming::HfGemma3 => {
                let n = match what {
                    "ffn_norm" => "pre_feedforward_layernorm.weight",
                    "post_attn_norm" => "post_attention_layernorm.weight",
                    "post_ffn_norm" => "post_feedforward_layernorm.weight",
                    "q_norm" => "self_attn.q_norm.weight",
                    "k_norm" => "self_attn.k_norm.weight",
                    _ => return Naming::Hf.layer(i, what),
                };
                format!("model.layers.{i}.{n}")
            }
            Naming::Hf => {
                let n = match what {
                    "attn_norm" => "input_layernorm.weight",
                    "q" => "self_attn.q_proj.weight",
                    "k" => "self_attn.k_proj.weight",
                    "v" => "self_attn.v_proj.weight",
                    "q_bias" => "self_attn.q_proj.bias",
                    "k_bias" => "self_attn.k_proj.bias",
                    "v_bias" => "self_attn.v_proj.bias",
                    "o" => "self_attn.o_proj.weight",
                    "ffn_norm" => "post_attention_layernorm.weight",
                    "gate" => "mlp.gate_proj.weight",
                    "up" => "mlp.up_proj.weight",
                    "down" => "mlp.down_proj.weight",
                    _ => unreachable!("unknown layer tensor {what}"),
                };
                format!("model.layers.{i}.{n}")
            }
        }
    }
}

/// Where tensors come from: each is returned dequantized to f32 with its PyTorch-order shape.
pub trait TensorSource: Sync {
    fn contains(&self, name: &str) -> bool;
    /// `(shape outermost first, values)`.
    fn load(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)>;
    /// The tensor as stored, where the source has an element type of ggml's (GGUF); `None` otherwise.
    fn raw(&self, _name: &str) -> Result<Option<RawTensor<'_>>> {
        Ok(None)
    }
}

/// A tensor as a GGUF stores it: whole blocks of `dtype`, rows of the innermost dimension.
pub struct RawTensor<'a> {
    /// Outermost first (PyTorch order).
    pub shape: Vec<usize>,
    pub dtype: GgmlType,
    pub bytes: &'a [u8],
}

/// Whether a stored shape is the expected one: exactly, or up to axes of size 1 (a vector may be stored
/// as `[n]` or `[1, n]`).
pub fn shape_matches(got: &[usize], expected: &[usize]) -> bool {
    let squeeze = |s: &[usize]| s.iter().copied().filter(|d| *d != 1).collect::<Vec<_>>();
    got == expected || squeeze(got) == squeeze(expected)
}

/// Every tensor [`Weights::load`] reads, with the PyTorch-order shape it must have: Q/K/V biases only with
/// `qkv_bias`, the output head only when untied. `cfg` is validated, so the products fit. Lets a reader
/// check a file's directory against its configuration before loading anything.
pub fn expected_shapes(naming: Naming, cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, inter, d) = (cfg.hidden_size(), cfg.intermediate_size(), cfg.head_dim());
    let (q_rows, kv_rows) = (cfg.num_heads() * d, cfg.num_kv_heads() * d);
    let mut out = Vec::new();
    for i in 0..cfg.num_layers() {
        let mut add = |w: &str, shape: &[usize]| out.push((naming.layer(i, w), shape.to_vec()));
        add("q", &[q_rows, h]);
        add("k", &[kv_rows, h]);
        add("v", &[kv_rows, h]);
        if cfg.params.qkv_bias {
            add("q_bias", &[q_rows]);
            add("k_bias", &[kv_rows]);
            add("v_bias", &[kv_rows]);
        }
        add("o", &[h, q_rows]);
        add("attn_norm", &[h]);
        add("ffn_norm", &[h]);
        add("gate", &[inter, h]);
        add("up", &[inter, h]);
        add("down", &[h, inter]);
        if cfg.arch == Arch::Gemma3 {
            add("q_norm", &[d]);
            add("k_norm", &[d]);
            add("post_attn_norm", &[h]);
            add("post_ffn_norm", &[h]);
        }
    }
    out.push((naming.global("embed"), vec![cfg.vocab_size(), h]));
    if !cfg.tie_word_embeddings() {
        out.push((naming.global("lm_head"), vec![cfg.vocab_size(), h]));
    }
    out.push((naming.global("norm"), vec![h]));
    out
}

/// Digests of the tensors loaded so far, by name, folded by [`WeightsDigest::finish`] into the
/// weights' fingerprint: one 128-bit digest of every tensor's name, shape and values as loaded (before
/// conversion to the compute format), independent of the order they were loaded in. The identity of a
/// model that cached KV is tied to; the GPU's loader digests its tensors the same way.
#[derive(Debug, Default)]
pub struct WeightsDigest(Mutex<Vec<(String, u128)>>);

impl WeightsDigest {
    /// Adds tensor `name` of `shape` with values `data` (as the tensor source gave them).
    pub fn add(&self, name: &str, shape: &[usize], data: &[f32]) {
        let mut h = Xxh3::new();
        for d in shape {
            h.update(&(*d as u64).to_le_bytes());
        }
        // SAFETY: any f32 is 4 initialised bytes and u8 has no alignment; the view lives only as long
        // as `data`'s borrow.
        let bytes =
            unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), data.len() * 4) };
        h.update(bytes);
        self.push(name, h.digest128());
    }

    /// Adds tensor `name` by a digest of its own making (bytes kept in another form).
    pub fn push(&self, name: &str, digest: u128) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((name.to_string(), digest));
    }

    /// The fingerprint of every tensor added.
    pub fn finish(self) -> u128 {
        let mut all = self.0.into_inner().unwrap_or_else(|e| e.into_inner());
        all.sort();
        let mut h = Xxh3::new();
        for (name, d) in &all {
            h.update(&(name.len() as u64).to_le_bytes());
            h.update(name.as_bytes());
            h.update(&d.to_le_bytes());
        }
        h.digest128()
    }
}
