//! `--device cuda`: the model's weights and activation buffers on a GPU first, then the KV pool in
//! what they leave (`--kv-cache-memory` is device memory there).

use anyhow::{bail, Context, Result};

use kura_cuda::{CudaExecutor, DevWeights, Device, PoolSpec};
use kura_kv::codec::KvDtype;
use kura_kv::layout::KvLayout;
use kura_model::{ModelConfig, ModelParts};

use crate::memory::KvMemoryRequest;

/// Device memory left free beside the pool: cuBLAS' workspaces and the attention partials of long
/// contexts.
pub const DEVICE_RESERVE: u64 = 512 << 20;

/// A GPU holding a model's weights, before its pool is sized.
pub struct GpuSetup {
    dev: Device,
    config: ModelConfig,
    weights: DevWeights,
    kv_dtype: KvDtype,
    max_tokens: usize,
    max_seqs: usize,
}

impl GpuSetup {
    /// Opens GPU `ordinal` and loads the model `parts` (opened from `path`) onto it.
    pub fn load(
        ordinal: usize,
        path: &std::path::Path,
        parts: &ModelParts,
        kv_dtype: KvDtype,
        max_tokens: usize,
        max_seqs: usize,
    ) -> Result<Self> {
        if !matches!(kv_dtype, KvDtype::Bf16 | KvDtype::F32) {
            bail!(
                "--kv-dtype {}: the GPU pool holds bf16 or f32 KV (--device cpu has the quantised formats)",
                kv_dtype.name()
            );
        }
        let dev = Device::open(ordinal).with_context(|| format!("--device cuda:{ordinal}"))?;
        tracing::info!(
            "GPU {ordinal}: {} ({}); kernels {} in {:.2} s",
            dev.name,
            dev.arch,
            if dev.compiled {
                "compiled into the kernel cache"
            } else {
                "read from the kernel cache"
            },
            dev.setup_seconds
        );
        let t = std::time::Instant::now();
        let weights = DevWeights::load(&dev, parts.source.as_ref(), parts.naming, &parts.config)
            .with_context(|| format!("loading {} onto {}", path.display(), dev.name))?;
        tracing::info!(
            "weights on the GPU: {:.2} GB (bf16) in {:.2} s",
            weights.bytes as f64 / 1e9,
            t.elapsed().as_secs_f64()
        );
        Ok(GpuSetup {
            dev,
            config: parts.config.clone(),
            weights,
            kv_dtype,
            max_tokens,
            max_seqs,
        })
    }

    /// Bytes of the activation buffers, allocated before the pool.
    pub fn activation_bytes(&self) -> u64 {
        CudaExecutor::activation_bytes(&self.config, self.max_tokens, self.max_seqs) as u64
    }

    /// The pool's bytes for `--kv-cache-memory`: a size, checked against the device's free memory, or a
    /// share of what the activation buffers and [`DEVICE_RESERVE`] leave free.
    pub fn kv_budget(&self, request: KvMemoryRequest) -> Result<u64> {
        let (free, total) = self.dev.memory()?;
        let usable = (free as u64).saturating_sub(self.activation_bytes() + DEVICE_RESERVE);
        tracing::info!(
            "GPU memory: {:.2} GB free of {:.2} GB with the weights loaded; {:.2} GB for activations, \
             {:.2} GB kept free, {:.2} GB for the KV pool at most",
            free as f64 / 1e9,
            total as f64 / 1e9,
            self.activation_bytes() as f64 / 1e9,
            DEVICE_RESERVE as f64 / 1e9,
            usable as f64 / 1e9
        );
        match request {
            KvMemoryRequest::Bytes(b) if b > usable => bail!(
                "--kv-cache-memory asks for {b} bytes of device memory, but {usable} are free on {} once \
                 the weights and activation buffers are there",
                self.dev.name
            ),
            KvMemoryRequest::Bytes(b) => Ok(b),
            KvMemoryRequest::Share(f) => Ok((usable as f64 * f).floor() as u64),
        }
    }

    /// The executor with a pool of `num_blocks` blocks of `layout`.
    pub fn executor(self, layout: &KvLayout, num_blocks: usize) -> Result<CudaExecutor> {
        let spec = PoolSpec {
            kv_dtype: self.kv_dtype,
            block_size: layout.block_size_tokens,
            num_blocks,
            reserve_tokens: self.max_tokens,
            reserve_seqs: self.max_seqs,
        };
        let exec = CudaExecutor::new(self.dev, self.config, self.weights, spec)?;
        let bytes = kura_engine::Executor::block_bytes(&exec) as u64;
        if bytes != layout.bytes_per_block() {
            bail!(
                "the GPU pool's block is {bytes} bytes, the KV layout's {}",
                layout.bytes_per_block()
            );
        }
        Ok(exec)
    }
}

/// One sequence on a GPU for `kura generate --device cuda`: the prompt prefilled in one step, then one
/// decode step a token, over blocks of its own.
pub struct GpuRun {
    exec: CudaExecutor,
    tokens: Vec<u32>,
    table: Vec<u32>,
    /// Tokens whose K/V are in the blocks.
    computed: usize,
}

impl GpuRun {
    /// Loads the model `parts` (opened from `path`) onto GPU `ordinal` with a pool for `prompt` plus
    /// `max_tokens`.
    pub fn new(
        ordinal: usize,
        path: &std::path::Path,
        parts: &ModelParts,
        prompt: &[u32],
        max_tokens: usize,
        kv_dtype: KvDtype,
        block_size: usize,
    ) -> Result<Self> {
        let setup = GpuSetup::load(ordinal, path, parts, kv_dtype, prompt.len().max(1), 1)?;
        let total = prompt.len() + max_tokens;
        if total > setup.config.max_context() {
            bail!(
                "the prompt ({} tokens) and --max-tokens {max_tokens} exceed the model's context of {}",
                prompt.len(),
                setup.config.max_context()
            );
        }
        let blocks = total.div_ceil(block_size.max(1));
        let layout = setup.config.kv_layout(kv_dtype, block_size)?;
        let exec = setup.executor(&layout, blocks)?;
        Ok(GpuRun {
            exec,
            tokens: prompt.to_vec(),
            table: (0..blocks as u32).collect(),
            computed: 0,
        })
    }

    /// The logits after the last token: the tokens not yet in the blocks in one step.
    pub fn next_logits(&mut self) -> Result<Vec<f32>> {
        let item =
            kura_engine::SeqInput::new(&self.tokens[self.computed..], self.computed, &self.table);
        let logits = self.exec.forward_logits(&[item])?;
        self.computed = self.tokens.len();
        Ok(logits)
    }

    pub fn push(&mut self, token: u32) {
        self.tokens.push(token);
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Bytes of weights on the device (a decode step reads each matrix once).
    pub fn weight_bytes(&self) -> usize {
        self.exec.weight_bytes()
    }
}
