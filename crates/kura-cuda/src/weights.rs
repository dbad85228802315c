//! A Llama-family model's weights in device memory: bf16 matrices (a GGUF's blocks dequantized at load,
//! safetensors converted), f32 norms and biases. Q, K and V are one matrix, as are gate and up, so a
//! layer takes four products.

use cudarc::driver::CudaSlice;
use half::bf16;
use rayon::prelude::*;

use kura_checkpoint::config::{Activation, Arch};
use kura_checkpoint::tensors::{Naming, TensorSource};
use kura_checkpoint::{ModelConfig, ModelError};

use crate::device::{Arg, Device};
use crate::error::{CudaError, Result};

/// One layer's buffers.
pub struct DevLayer {
    pub attn_norm: CudaSlice<f32>,
    pub wqkv: CudaSlice<bf16>,
    pub bqkv: Option<CudaSlice<f32>>,
    pub wo: CudaSlice<bf16>,
    pub ffn_norm: CudaSlice<f32>,
    pub w_gate_up: CudaSlice<bf16>,
    pub w_down: CudaSlice<bf16>,
}

/// The model's weights on the device.
pub struct DevWeights {
    pub embed: CudaSlice<bf16>,
    pub layers: Vec<DevLayer>,
    pub final_norm: CudaSlice<f32>,
    /// `None`: the output head is the embedding (tied).
    pub lm_head: Option<CudaSlice<bf16>>,
    /// Bytes the weights take on the device.
    pub bytes: usize,
    /// The weights' identity, which cached KV is tied to: a digest of every tensor's name, shape and
    /// values as read from the file, made as the CPU loader makes it (`kura_checkpoint::WeightsDigest`); for
    /// random weights, of their shape and seed.
    pub fingerprint: u128,
}

/// Refuses what the executor does not run: Gemma 3 (its norms, GELU and sliding layers run on the CPU
/// only), widths the kernels do not take.
pub fn check_supported(c: &ModelConfig) -> Result<()> {
    let unsupported = |m: String| Err(CudaError::Unsupported(m));
    if c.arch == Arch::Gemma3 {
        return unsupported("Gemma 3 runs on the CPU only (--device cpu)".into());
    }
    if c.activation() != Activation::Silu
        || c.embedding_scale().is_some()
        || c.query_scale().is_some()
    {
        return unsupported("only SiLU-gated Llama-family models run on the GPU".into());
    }
    let d = c.head_dim();
    if d != 64 && d != 128 {
        return unsupported(format!("head_dim {d}: the GPU kernels take 64 or 128"));
    }
    let group = c.num_heads() / c.num_kv_heads().max(1);
    if c.num_kv_heads() == 0 || !c.num_heads().is_multiple_of(c.num_kv_heads()) || group > 16 {
        return unsupported(format!(
            "{} query heads over {} KV heads: the GPU kernels take whole groups of at most 16",
            c.num_heads(),
            c.num_kv_heads()
        ));
    }
    for (what, n) in [
        ("hidden_size", c.hidden_size()),
        ("intermediate_size", c.intermediate_size()),
    ] {
        if !n.is_multiple_of(8) {
            return unsupported(format!("{what} {n} is not a multiple of 8"));
        }
    }
    if c.hidden_size() > 16_384 {
        return unsupported(format!(
            "hidden_size {}: the GPU's RMSNorm takes at most 16,384",
            c.hidden_size()
        ));
    }
    let windows: Vec<Option<usize>> = (0..c.num_layers()).map(|l| c.layer_window(l)).collect();
    if windows.windows(2).any(|w| w[0] != w[1]) {
        return unsupported("layers with different attention windows run on the CPU only".into());
    }
    Ok(())
}

impl DevWeights {
    /// Reads every tensor of `cfg` from `src` and copies it to the device.
    pub fn load(
        dev: &Device,
        src: &dyn TensorSource,
        naming: Naming,
        cfg: &ModelConfig,
    ) -> Result<Self> {
        check_supported(cfg)?;
        let (h, inter, d) = (cfg.hidden_size(), cfg.intermediate_size(), cfg.head_dim());
        let (q_rows, kv_rows) = (cfg.num_heads() * d, cfg.num_kv_heads() * d);
        let bytes = std::cell::Cell::new(0usize);
        let digest = kura_checkpoint::WeightsDigest::default();
        let upload_bf16 = |parts: Vec<Vec<bf16>>, what: &str| -> Result<CudaSlice<bf16>> {
            let n: usize = parts.iter().map(Vec::len).sum();
            let mut buf = dev.alloc::<bf16>(n, what)?;
            let mut at = 0;
            for p in parts {
                let mut view = buf.slice_mut(at..at + p.len());
                dev.stream.memcpy_htod(&p, &mut view)?;
                at += p.len();
            }
            bytes.set(bytes.get() + n * 2);
            Ok(buf)
        };
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<Vec<bf16>> {
            let (shape, v) = src.load(name)?;
            digest.add(name, &shape, &v);
            if shape.iter().product::<usize>() != rows * cols {
                return Err(ModelError::TensorShape {
                    name: name.into(),
                    expected: vec![rows, cols],
                    got: shape,
                }
                .into());
            }
            Ok(v.par_iter().map(|x| bf16::from_f32(*x)).collect())
        };
        let vector = |name: &str, len: usize| -> Result<Vec<f32>> {
            let (shape, v) = src.load(name)?;
            digest.add(name, &shape, &v);
            if v.len() != len {
                return Err(ModelError::TensorShape {
                    name: name.into(),
                    expected: vec![len],
                    got: shape,
                }
                .into());
            }
            Ok(v)
        };
        let upload_f32 = |v: Vec<f32>, what: &str| -> Result<CudaSlice<f32>> {
            let mut buf = dev.alloc::<f32>(v.len(), what)?;
            dev.stream.memcpy_htod(&v, &mut buf)?;
            Ok(buf)
        };
        let mut layers = Vec::with_capacity(cfg.num_layers());
        for i in 0..cfg.num_layers() {
            let name = |w: &str| naming.layer(i, w);
            let what = format!("layer {i}'s weights");
            // The layer's matrices read and converted in parallel, then copied in order.
            let names = [
                (name("q"), q_rows, h),
                (name("k"), kv_rows, h),
                (name("v"), kv_rows, h),
                (name("o"), h, q_rows),
                (name("gate"), inter, h),
                (name("up"), inter, h),
                (name("down"), h, inter),
            ];
            let mut mats: Vec<Vec<bf16>> = names
                .par_iter()
                .map(|(n, r, c)| matrix(n, *r, *c))
                .collect::<Result<Vec<_>>>()?;
            let down = mats.pop().unwrap_or_default();
            let up = mats.pop().unwrap_or_default();
            let gate = mats.pop().unwrap_or_default();
            let o = mats.pop().unwrap_or_default();
            let bqkv = if cfg.params.qkv_bias {
                let mut b = vector(&name("q_bias"), q_rows)?;
                b.extend(vector(&name("k_bias"), kv_rows)?);
                b.extend(vector(&name("v_bias"), kv_rows)?);
                bytes.set(bytes.get() + b.len() * 4);
                Some(upload_f32(b, &what)?)
            } else {
                None
            };
            let attn_norm = upload_f32(vector(&name("attn_norm"), h)?, &what)?;
            let ffn_norm = upload_f32(vector(&name("ffn_norm"), h)?, &what)?;
            bytes.set(bytes.get() + 2 * h * 4);
            layers.push(DevLayer {
                attn_norm,
                wqkv: upload_bf16(mats, &what)?,
                bqkv,
                wo: upload_bf16(vec![o], &what)?,
                ffn_norm,
                w_gate_up: upload_bf16(vec![gate, up], &what)?,
                w_down: upload_bf16(vec![down], &what)?,
            });
        }
        let vocab = cfg.vocab_size();
        let embed = upload_bf16(
            vec![matrix(&naming.global("embed"), vocab, h)?],
            "the embeddings",
        )?;
        let head_name = naming.global("lm_head");
        let lm_head = if !cfg.tie_word_embeddings() && src.contains(&head_name) {
            Some(upload_bf16(
                vec![matrix(&head_name, vocab, h)?],
                "the output head",
            )?)
        } else if !cfg.tie_word_embeddings() {
            return Err(ModelError::MissingTensor { name: head_name }.into());
        } else {
            None
        };
        let final_norm = upload_f32(vector(&naming.global("norm"), h)?, "the final norm")?;
        bytes.set(bytes.get() + h * 4);
        dev.synchronize()?;
        Ok(DevWeights {
            embed,
            layers,
            final_norm,
            lm_head,
            bytes: bytes.get(),
            fingerprint: digest.finish(),
        })
    }

    /// Weights of `cfg`'s shape made on the device: seeded uniform values scaled by 1/√fan-in, norms of
    /// one, no biases; for measuring speed without a checkpoint.
    pub fn random(dev: &Device, cfg: &ModelConfig, seed: u64) -> Result<Self> {
        check_supported(cfg)?;
        let (h, inter, d) = (cfg.hidden_size(), cfg.intermediate_size(), cfg.head_dim());
        let qkv_rows = (cfg.num_heads() + 2 * cfg.num_kv_heads()) * d;
        let mut bytes = 0usize;
        let mut next = seed;
        let mut rand = |rows: usize, cols: usize, what: &str| -> Result<CudaSlice<bf16>> {
            let n = rows * cols;
            let buf = dev.alloc::<bf16>(n, what)?;
            next = next.wrapping_add(0x9E37_79B9);
            dev.launch(
                "fill_random_bf16",
                (1024, 1, 1),
                256,
                &[
                    Arg::Ptr(dev.ptr(&buf)),
                    Arg::Usize(n as u64),
                    Arg::Usize(next),
                    Arg::F32(1.0 / (cols as f32).sqrt()),
                ],
            )?;
            bytes += n * 2;
            Ok(buf)
        };
        let mut norms = 0usize;
        let mut ones = |n: usize, what: &str| -> Result<CudaSlice<f32>> {
            let mut buf = dev.alloc::<f32>(n, what)?;
            dev.stream.memcpy_htod(&vec![1f32; n], &mut buf)?;
            norms += n * 4;
            Ok(buf)
        };
        let mut layers = Vec::with_capacity(cfg.num_layers());
        for i in 0..cfg.num_layers() {
            let what = format!("layer {i}'s weights");
            layers.push(DevLayer {
                attn_norm: ones(h, &what)?,
                wqkv: rand(qkv_rows, h, &what)?,
                bqkv: None,
                wo: rand(h, cfg.num_heads() * d, &what)?,
                ffn_norm: ones(h, &what)?,
                w_gate_up: rand(2 * inter, h, &what)?,
                w_down: rand(h, inter, &what)?,
            });
        }
        let embed = rand(cfg.vocab_size(), h, "the embeddings")?;
        let lm_head = if cfg.tie_word_embeddings() {
            None
        } else {
            Some(rand(cfg.vocab_size(), h, "the output head")?)
        };
        let final_norm = ones(h, "the final norm")?;
        dev.synchronize()?;
        let bytes = bytes + norms;
        Ok(DevWeights {
            embed,
            layers,
            final_norm,
            lm_head,
            bytes,
            fingerprint: {
                let d = kura_checkpoint::WeightsDigest::default();
                d.add(&format!("random weights of {cfg:?}"), &[seed as usize], &[]);
                d.finish()
            },
        })
    }
}
