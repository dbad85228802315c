//! The model's weights in the compute format (bf16 by default, f32 on request, or `native`: a GGUF's
//! block formats kept packed, see [`crate::kernels::qpacked`]), with Q/K/V and gate/up fused into one
//! matrix each so that a layer reads its input once per projection group.
//!
//! Tensors come from a [`TensorSource`] (GGUF or safetensors) dequantized to f32, then are converted;
//! native weights are unpacked from the file's blocks instead. Loading is O(parameters), parallel over
//! layers.

use half::bf16;
use rayon::prelude::*;
use xxhash_rust::xxh3::Xxh3;

use crate::config::{Arch, ModelConfig};
use crate::error::{ModelError, Result};
use crate::kernels::arena::{ArenaPart, WeightArena};
use crate::kernels::dot::{Bf16Act, F32Panels};
use crate::kernels::packed::{PackedBf16, PackedF32};
use crate::kernels::qpacked::{PackedQ, QBits, QRow, QBLOCK};
use crate::quant::{self, GgmlType};

/// Tensors by name and the weights' digest are `kura-checkpoint`'s.
pub use kura_checkpoint::tensors::{
    expected_shapes, shape_matches, Naming, RawTensor, TensorSource, WeightsDigest,
};
pub use kura_shape::WeightsDtype;

/// The formats the runtime computes in: bf16 or f32 whatever the file holds, or `native` (the file's
/// block formats kept packed); any other format is refused by name.
pub fn check_compute_dtype(dtype: WeightsDtype) -> Result<()> {
    match dtype {
        WeightsDtype::Bf16 | WeightsDtype::F32 | WeightsDtype::Native => Ok(()),
        other => Err(ModelError::Config(format!(
            "weights dtype {}: Kura's runtime keeps weights in bf16 or f32, or as the file stores \
             them (native); give native, bf16 or f32",
            other.name()
        ))),
    }
}

#[derive(Clone)]
pub enum MatData {
    F32(Vec<f32>),
    /// Row-major bf16, for CPUs without AVX-512 BF16 (widened to f32 in the products).
    Bf16(Vec<bf16>),
    /// bf16 packed for `vdpbf16ps`, on CPUs that have it.
    Packed(PackedBf16),
    /// f32 packed for FMA, on CPUs with AVX-512F or AVX2 and FMA.
    PackedF32(PackedF32),
    /// Quantized blocks (native weights of a quantized file).
    Quant(PackedQ),
}

/// A row-major `[rows, cols]` matrix: row `r` holds the weights of output `r` (PyTorch's `[out, in]`).
#[derive(Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: MatData,
}

impl Matrix {
    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>, dtype: WeightsDtype) -> Self {
        debug_assert_eq!(data.len(), rows * cols);
        let data = match dtype {
            WeightsDtype::F32 => match F32Panels::detect() {
                Some(cpu) => MatData::PackedF32(PackedF32::from_f32(&cpu, rows, cols, &data)),
                None => MatData::F32(data),
            },
            // Every other format is refused at load (`check_compute_dtype`): bf16.
            _ => match Bf16Act::detect() {
                Some(cpu) => MatData::Packed(PackedBf16::from_f32(&cpu, rows, cols, &data)),
                None => MatData::Bf16(data.iter().map(|x| bf16::from_f32(*x)).collect()),
            },
        };
        Matrix { rows, cols, data }
    }

    /// Row `r` as f32 into `out` (an embedding lookup).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let span = r * self.cols..(r + 1) * self.cols;
        match &self.data {
            MatData::F32(d) => out.copy_from_slice(&d[span]),
            MatData::Bf16(d) => {
                for (o, x) in out.iter_mut().zip(&d[span]) {
                    *o = x.to_f32();
                }
            }
            MatData::Packed(p) => p.row_into(r, out),
            MatData::PackedF32(p) => p.row_into(r, out),
            MatData::Quant(p) => p.row_into(r, out),
        }
    }

    pub fn bytes(&self) -> usize {
        match &self.data {
            MatData::F32(d) => d.len() * 4,
            MatData::Bf16(d) => d.len() * 2,
            MatData::Packed(p) => p.bytes(),
            MatData::PackedF32(p) => p.bytes(),
            MatData::Quant(p) => p.bytes(),
        }
    }
}

/// One transformer layer.
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    /// Rows: Q (heads × head_dim), then K, then V (kv_heads × head_dim each).
    pub wqkv: Matrix,
    pub bqkv: Option<Vec<f32>>,
    pub wo: Matrix,
    pub ffn_norm: Vec<f32>,
    /// Rows: gate (intermediate), then up (intermediate).
    pub w_gate_up: Matrix,
    pub w_down: Matrix,
    /// Gemma 3's extra norms; `None` for the Llama family.
    pub gemma: Option<GemmaNorms>,
}

/// The norms a Gemma 3 layer has beyond the Llama family's two, as plain RMSNorm weights (the 1 of Gemma's
/// `x · (1 + w)` added: by the GGUF converter, or at load for HF checkpoints).
pub struct GemmaNorms {
    /// Over each Q head (`head_dim`), before RoPE.
    pub q_norm: Vec<f32>,
    /// Over each K head (`head_dim`), before RoPE.
    pub k_norm: Vec<f32>,
    /// On the attention output, before its residual add.
    pub post_attn_norm: Vec<f32>,
    /// On the FFN output, before its residual add.
    pub post_ffn_norm: Vec<f32>,
}

pub struct Weights {
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// `None` when tied to the embedding.
    pub lm_head: Option<Matrix>,
    pub dtype: WeightsDtype,
    /// Digest of every tensor as read from the model file (names, shapes, values): two loads share it
    /// exactly when they compute with the same weights.
    pub fingerprint: u128,
}

impl Weights {
    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes the weights hold in memory: every matrix (a tied head once) and every vector.
    pub fn bytes_held(&self) -> usize {
        let vec_bytes = |v: &[f32]| v.len() * 4;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let gemma = l.gemma.as_ref().map_or(0, |g| {
                    vec_bytes(&g.q_norm)
                        + vec_bytes(&g.k_norm)
                        + vec_bytes(&g.post_attn_norm)
                        + vec_bytes(&g.post_ffn_norm)
                });
                l.wqkv.bytes()
                    + l.wo.bytes()
                    + l.w_gate_up.bytes()
                    + l.w_down.bytes()
                    + vec_bytes(&l.attn_norm)
                    + vec_bytes(&l.ffn_norm)
                    + l.bqkv.as_deref().map_or(0, vec_bytes)
                    + gemma
            })
            .sum();
        layers
            + self.embed.bytes()
            + self.lm_head.as_ref().map_or(0, Matrix::bytes)
            + vec_bytes(&self.final_norm)
    }

    /// Bytes of weights one decode step reads (every matrix once, the embedding only as the output head).
    pub fn bytes_per_token(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.wqkv.bytes() + l.wo.bytes() + l.w_gate_up.bytes() + l.w_down.bytes())
            .sum();
        layers + self.lm_head().bytes()
    }
}

fn load_shaped(
    src: &dyn TensorSource,
    name: &str,
    expected: &[usize],
    digests: &WeightsDigest,
) -> Result<Vec<f32>> {
    let (shape, data) = src.load(name)?;
    if !shape_matches(&shape, expected) {
        return Err(ModelError::TensorShape {
            name: name.into(),
            got: shape,
            expected: expected.to_vec(),
        });
    }
    digests.add(name, &shape, &data);
    Ok(data)
}

/// An RMSNorm weight of `len` elements as the plain `x / rms · w` the runtime computes: the naming's
/// stored offset added (Gemma's HF weights are `w − 1`).
fn load_norm(
    src: &dyn TensorSource,
    naming: Naming,
    name: &str,
    len: usize,
    digests: &WeightsDigest,
) -> Result<Vec<f32>> {
    let mut w = load_shaped(src, name, &[len], digests)?;
    let offset = naming.norm_offset();
    if offset != 0.0 {
        for x in &mut w {
            *x += offset;
        }
    }
    Ok(w)
}

/// How [`Weights::load`] makes a matrix of row-stacked tensors: dequantized to f32 and converted to
/// `dtype`, or (native weights) unpacked from the file's blocks.
struct MatrixMaker<'a> {
    src: &'a dyn TensorSource,
    dtype: WeightsDtype,
    quantized: bool,
    digests: &'a WeightsDigest,
}

impl MatrixMaker<'_> {
    /// The tensors `parts` (name, rows), each `[rows, cols]`, stacked into one matrix.
    fn make(&self, parts: &[(String, usize)], cols: usize) -> Result<Matrix> {
        let rows: usize = parts.iter().map(|(_, r)| r).sum();
        if self.quantized {
            return self.quantized(parts, rows, cols);
        }
        let mut data = Vec::with_capacity(rows * cols);
        for (name, r) in parts {
            data.extend(load_shaped(self.src, name, &[*r, cols], self.digests)?);
        }
        Ok(Matrix::from_f32(rows, cols, data, self.dtype))
    }

    fn quantized(&self, parts: &[(String, usize)], rows: usize, cols: usize) -> Result<Matrix> {
        let mut raws = Vec::with_capacity(parts.len());
        for (name, r) in parts {
            let raw = self
                .src
                .raw(name)?
                .ok_or_else(|| ModelError::MissingTensor { name: name.clone() })?;
            if !shape_matches(&raw.shape, &[*r, cols]) {
                return Err(ModelError::TensorShape {
                    name: name.clone(),
                    got: raw.shape,
                    expected: vec![*r, cols],
                });
            }
            let row_bytes = raw
                .dtype
                .byte_size(cols)
                .filter(|b| b.checked_mul(*r) == Some(raw.bytes.len()))
                .ok_or_else(|| ModelError::TensorType {
                    name: name.clone(),
                    dtype: raw.dtype.name(),
                })?;
            let mut h = Xxh3::new();
            h.update(&raw.dtype.name().into_bytes());
            for d in &raw.shape {
                h.update(&(*d as u64).to_le_bytes());
            }
            h.update(raw.bytes);
            self.digests.push(name, h.digest128());
            raws.push((raw, *r, row_bytes));
        }
        let parts_raw: Vec<(GgmlType, usize, &[u8])> = raws
            .iter()
            .map(|(raw, r, _)| (raw.dtype, *r, raw.bytes))
            .collect();
        let packed = pack_rows(&parts_raw, cols).map_err(|(part, what)| {
            ModelError::Config(format!("tensor '{}': {what}", parts[part].0))
        })?;
        Ok(Matrix {
            rows,
            cols,
            data: MatData::Quant(packed),
        })
    }
}

/// Packs row-stacked tensors `(type, rows, bytes)` of `cols` columns (whole blocks of their type, checked
/// by the caller) as one matrix: 4-bit if every part is a 4-bit format, else 8-bit; formats with no
/// exact packed form are requantized to 8 bits. An error names the part and what failed.
pub(crate) fn pack_rows(
    parts: &[(GgmlType, usize, &[u8])],
    cols: usize,
) -> std::result::Result<PackedQ, (usize, String)> {
    let rows: usize = parts.iter().map(|p| p.1).sum();
    let bits = if parts
        .iter()
        .all(|(ty, ..)| quant::native_bits(*ty) == QBits::U4)
    {
        QBits::U4
    } else {
        QBits::U8
    };
    let row_bytes: Vec<usize> = parts
        .iter()
        .map(|(ty, ..)| ty.byte_size(cols).unwrap_or(0))
        .collect();
    let mut scratch = vec![0f32; cols];
    let mut failed = None;
    let packed = PackedQ::build(rows, cols, bits, |mut r, row: &mut QRow| {
        let mut part = 0;
        while r >= parts[part].1 {
            r -= parts[part].1;
            part += 1;
        }
        let (ty, _, all) = parts[part];
        let rb = row_bytes[part];
        let Some(bytes) = all.get(r * rb..(r + 1) * rb) else {
            failed = Some((
                part,
                format!("row {r} lies outside its {} bytes", all.len()),
            ));
            return;
        };
        if !quant::unpack_row(ty, bytes, row) {
            match quant::dequantize(ty, bytes, &mut scratch) {
                Ok(()) => quant::requantize_row_u8(&scratch, row),
                Err(what) => failed = Some((part, what)),
            }
        }
    });
    match failed {
        Some(e) => Err(e),
        None => Ok(packed),
    }
}

/// Whether any matrix of the model is stored in a block format (so that `native` keeps blocks).
fn has_block_matrices(src: &dyn TensorSource, naming: Naming, cfg: &ModelConfig) -> Result<bool> {
    for (name, shape) in expected_shapes(naming, cfg) {
        if shape.len() == 2 && src.contains(&name) {
            if let Some(raw) = src.raw(&name)? {
                if quant::is_block_format(raw.dtype) {
                    return Ok(true);
                }
            }
        }
    }
    Ok(false)
}

/// The bytes [`Weights::bytes_held`] gives for `native` weights, from the tensors' shapes and types
/// alone (nothing is unpacked): `None` when native computes in bf16 (no block-format matrix, or widths
/// the kernels do not take).
pub fn native_bytes(
    src: &dyn TensorSource,
    naming: Naming,
    cfg: &ModelConfig,
) -> Result<Option<usize>> {
    if !native_keeps_blocks(src, naming, cfg)? {
        return Ok(None);
    }
    let (h, inter, d) = (cfg.hidden_size(), cfg.intermediate_size(), cfg.head_dim());
    let (q_rows, kv_rows) = (cfg.num_heads() * d, cfg.num_kv_heads() * d);
    let matrix = |names: &[String], rows: usize, cols: usize| -> Result<usize> {
        let mut bits = QBits::U4;
        for n in names {
            let raw = src
                .raw(n)?
                .ok_or_else(|| ModelError::MissingTensor { name: n.clone() })?;
            if quant::native_bits(raw.dtype) == QBits::U8 {
                bits = QBits::U8;
            }
        }
        Ok(PackedQ::bytes_for(rows, cols, bits))
    };
    let mut total = 0;
    for i in 0..cfg.num_layers() {
        let n = |w: &str| naming.layer(i, w);
        total += matrix(&[n("q"), n("k"), n("v")], q_rows + 2 * kv_rows, h)?;
        total += matrix(&[n("o")], h, q_rows)?;
        total += matrix(&[n("gate"), n("up")], 2 * inter, h)?;
        total += matrix(&[n("down")], h, inter)?;
        let mut vectors = 2 * h;
        if cfg.params.qkv_bias {
            vectors += q_rows + 2 * kv_rows;
        }
        if cfg.arch == Arch::Gemma3 {
            vectors += 2 * d + 2 * h;
        }
        total += vectors * 4;
    }
    total += matrix(&[naming.global("embed")], cfg.vocab_size(), h)?;
    if !cfg.tie_word_embeddings() {
        total += matrix(&[naming.global("lm_head")], cfg.vocab_size(), h)?;
    }
    Ok(Some(total + h * 4))
}

/// Native weights multiply int8 activations in blocks of 32: every width a product reads, and every
/// span the attention writes at once (the query heads of one KV head), must be whole blocks. Says which
/// is not.
fn native_width_problem(cfg: &ModelConfig) -> Option<String> {
    let group = cfg.num_heads() / cfg.num_kv_heads().max(1);
    [
        ("hidden size", cfg.hidden_size()),
        ("intermediate size", cfg.intermediate_size()),
        (
            "query width (heads × head dim)",
            cfg.num_heads() * cfg.head_dim(),
        ),
        ("query heads per KV head × head dim", group * cfg.head_dim()),
    ]
    .into_iter()
    .find(|(_, n)| !n.is_multiple_of(QBLOCK))
    .map(|(what, n)| format!("its {what} is {n}, not a multiple of {QBLOCK}"))
}

/// Whether `native` keeps this model's blocks: it has a block-format matrix and widths the kernels
/// take. A quantized model whose widths they do not take computes in bf16, and the log says why.
fn native_keeps_blocks(src: &dyn TensorSource, naming: Naming, cfg: &ModelConfig) -> Result<bool> {
    if !has_block_matrices(src, naming, cfg)? {
        return Ok(false);
    }
    if let Some(why) = native_width_problem(cfg) {
        tracing::warn!("native weights: the model's blocks are dequantized to bf16: {why}");
        return Ok(false);
    }
    Ok(true)
}

impl Weights {
    /// Loads every tensor of `cfg`. `dtype` native keeps a GGUF's block formats packed when any matrix
    /// has one (the file's float matrices are then requantized to 8 bits, as are Q2_K, Q3_K and Q6_K,
    /// which have no exact packed form); a model with float matrices only, or with widths that are not
    /// whole blocks of 32, computes in bf16.
    pub fn load(
        src: &dyn TensorSource,
        naming: Naming,
        cfg: &ModelConfig,
        dtype: WeightsDtype,
    ) -> Result<Self> {
        let (h, inter, d) = (cfg.hidden_size(), cfg.intermediate_size(), cfg.head_dim());
        let (q_rows, kv_rows) = (cfg.num_heads() * d, cfg.num_kv_heads() * d);
        let quantized = dtype == WeightsDtype::Native && native_keeps_blocks(src, naming, cfg)?;
        let dtype = match dtype {
            WeightsDtype::Native if !quantized => WeightsDtype::Bf16,
            other => other,
        };
        let dg = WeightsDigest::default();
        let mm = MatrixMaker {
            src,
            dtype,
            quantized,
            digests: &dg,
        };
        let layers = (0..cfg.num_layers())
            .into_par_iter()
            .map(|i| -> Result<LayerWeights> {
                let name = |w: &str| naming.layer(i, w);
                let bqkv = if cfg.params.qkv_bias {
                    let mut b = load_shaped(src, &name("q_bias"), &[q_rows], &dg)?;
                    b.extend(load_shaped(src, &name("k_bias"), &[kv_rows], &dg)?);
                    b.extend(load_shaped(src, &name("v_bias"), &[kv_rows], &dg)?);
                    Some(b)
                } else {
                    None
                };
                let norm = |w: &str, len: usize| load_norm(src, naming, &name(w), len, &dg);
                let gemma = if cfg.arch == Arch::Gemma3 {
                    Some(GemmaNorms {
                        q_norm: norm("q_norm", d)?,
                        k_norm: norm("k_norm", d)?,
                        post_attn_norm: norm("post_attn_norm", h)?,
                        post_ffn_norm: norm("post_ffn_norm", h)?,
                    })
                } else {
                    None
                };
                let qkv = [
                    (name("q"), q_rows),
                    (name("k"), kv_rows),
                    (name("v"), kv_rows),
                ];
                Ok(LayerWeights {
                    attn_norm: norm("attn_norm", h)?,
                    wqkv: mm.make(&qkv, h)?,
                    bqkv,
                    wo: mm.make(&[(name("o"), h)], q_rows)?,
                    ffn_norm: norm("ffn_norm", h)?,
                    w_gate_up: mm.make(&[(name("gate"), inter), (name("up"), inter)], h)?,
                    w_down: mm.make(&[(name("down"), h)], inter)?,
                    gemma,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = mm.make(&[(naming.global("embed"), cfg.vocab_size())], h)?;
        let head_name = naming.global("lm_head");
        let lm_head = if !cfg.tie_word_embeddings() && src.contains(&head_name) {
            Some(mm.make(&[(head_name, cfg.vocab_size())], h)?)
        } else if !cfg.tie_word_embeddings() {
            return Err(ModelError::MissingTensor { name: head_name });
        } else {
            None
        };
        let final_norm = load_norm(src, naming, &naming.global("norm"), h, &dg)?;
        let mut embed = embed;
        let mut layers = layers;
        let mut lm_head = lm_head;
        // Every packed matrix into one huge-page arena, in decode order: each layer's matrices, then
        // the output head.
        let mut all: Vec<&mut Matrix> = Vec::new();
        for l in &mut layers {
            all.extend([&mut l.wqkv, &mut l.wo, &mut l.w_gate_up, &mut l.w_down]);
        }
        all.push(&mut embed);
        all.extend(lm_head.as_mut());
        let mut parts: Vec<&mut dyn ArenaPart> = all
            .into_iter()
            .filter_map(|m| -> Option<&mut dyn ArenaPart> {
                match &mut m.data {
                    MatData::Quant(q) => Some(&mut q.data),
                    MatData::Packed(p) => Some(&mut p.data),
                    MatData::PackedF32(p) => Some(&mut p.data),
                    MatData::F32(_) | MatData::Bf16(_) => None,
                }
            })
            .collect();
        WeightArena::gather(&mut parts)
            .map_err(|e| ModelError::Config(format!("mapping the weights' memory: {e}")))?;
        Ok(Weights {
            embed,
            layers,
            final_norm,
            lm_head,
            dtype,
            fingerprint: dg.finish(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::matmul::matmul;

    /// Seeded bytes of `n` blocks of `ty` with sane f16 scales (a random f16 may be Inf or NaN).
    fn blocks(ty: GgmlType, n: usize, seed: u64) -> Vec<u8> {
        let (_, size) = ty.block().unwrap();
        let mut s = seed;
        let mut bytes: Vec<u8> = (0..n * size)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 56) as u8
            })
            .collect();
        let half = |v: f32| half::f16::from_f32(v).to_le_bytes();
        for (i, b) in bytes.chunks_exact_mut(size).enumerate() {
            let d = half(0.01 + (i % 7) as f32 * 0.003);
            let m = half(-0.05 - (i % 5) as f32 * 0.01);
            match ty {
                GgmlType::Q6K => b[size - 2..].copy_from_slice(&d),
                GgmlType::Q4K | GgmlType::Q5K => {
                    b[0..2].copy_from_slice(&d);
                    b[2..4].copy_from_slice(&half(0.004));
                }
                GgmlType::Q4_1 | GgmlType::Q5_1 => {
                    b[0..2].copy_from_slice(&d);
                    b[2..4].copy_from_slice(&m);
                }
                _ => b[0..2].copy_from_slice(&d),
            }
        }
        bytes
    }

    #[test]
    fn every_format_multiplies_as_its_dequantized_values() {
        let (rows, cols, t) = (40, 512, 5);
        let x: Vec<f32> = (0..t * cols).map(|i| ((i as f32) * 0.21).cos()).collect();
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
        ] {
            let (per, _) = ty.block().unwrap();
            let bytes = blocks(ty, rows * cols / per, 7);
            let packed = pack_rows(&[(ty, rows, &bytes)], cols).unwrap();
            assert_eq!(packed.bits, quant::native_bits(ty), "{}", ty.name());
            let mut w = vec![0f32; rows * cols];
            quant::dequantize(ty, &bytes, &mut w).unwrap();
            let reference = crate::kernels::qpacked::portable_product(&x, t, &packed);
            let m = Matrix {
                rows,
                cols,
                data: MatData::Quant(packed),
            };
            let mut out = vec![0f32; t * rows];
            matmul(&x, t, &m, &mut out);
            // This CPU's kernel gives the portable loop's bits.
            assert_eq!(out, reference, "{}", ty.name());
            for i in 0..t {
                for r in 0..rows {
                    let terms =
                        (0..cols).map(|c| f64::from(x[i * cols + c]) * f64::from(w[r * cols + c]));
                    let exact: f64 = terms.clone().sum();
                    let scale: f64 = terms.map(f64::abs).sum();
                    let got = f64::from(out[i * rows + r]);
                    // int8 activations (and Q6_K's requantization to 8 bits) cost well under 1 %.
                    assert!(
                        (got - exact).abs() <= 0.01 * scale,
                        "{} token {i} row {r}: {got} vs {exact}",
                        ty.name()
                    );
                }
            }
        }
    }

    #[test]
    fn the_runtime_computes_in_bf16_or_f32_and_names_what_it_refuses() {
        assert!(check_compute_dtype(WeightsDtype::Bf16).is_ok());
        assert!(check_compute_dtype(WeightsDtype::F32).is_ok());
        assert!(check_compute_dtype(WeightsDtype::Native).is_ok());
        for d in [
            WeightsDtype::F16,
            WeightsDtype::Fp8,
            WeightsDtype::Int8,
            WeightsDtype::Int4,
        ] {
            let err = check_compute_dtype(d).unwrap_err().to_string();
            assert!(
                err.contains(d.name()) && err.contains("bf16 or f32"),
                "{err}"
            );
        }
    }
}
