//! `--device cuda`: the model's weights on a GPU first, then the activation buffers and the KV pool,
//! planned from the device's total memory by the arithmetic `kura plan --gpu` prints ([`plan_pool`])
//! and checked against what the device has free (`--kv-cache-memory` is device memory there).

use anyhow::{bail, Context, Result};

use kura_cuda::budget::{self, Dims, PoolPlan, PoolRequest};
use kura_cuda::{CudaExecutor, DevWeights, Device, PoolSpec, PrefillKernel};
use kura_kv::codec::KvDtype;
use kura_kv::layout::KvLayout;
use kura_model::{ModelConfig, ModelParts, WeightsDtype};

use crate::memory::KvMemoryRequest;

pub use kura_cuda::budget::DEVICE_RESERVE;

/// `--kv-cache-memory` on a device: a size, or a share of what the weights, CUDA context, activation
/// buffers and reserve leave.
pub fn pool_request(request: KvMemoryRequest) -> PoolRequest {
    match request {
        KvMemoryRequest::Bytes(b) => PoolRequest::Bytes(b),
        KvMemoryRequest::Share(f) => PoolRequest::Share(f),
    }
}

/// The pool `kura serve --device cuda` plans on a device of `total` bytes: [`budget::plan_pool`] with the
/// server's flags (`kura plan --gpu` calls the same); `drafts` is what `--speculative-config` asks
/// ([`drafts_of`]).
pub fn plan_pool(
    dims: &Dims,
    total: u64,
    request: PoolRequest,
    max_num_batched_tokens: usize,
    max_num_seqs: usize,
    drafts: budget::Drafts,
    layout: &KvLayout,
) -> Result<PoolPlan> {
    budget::plan_pool(
        dims,
        total,
        request,
        max_num_batched_tokens,
        max_num_seqs,
        drafts,
        layout.bytes_per_block(),
    )
    .map_err(anyhow::Error::msg)
}

/// What `--speculative-config` asks of a GPU step's output head: drafts of `num_speculative_tokens`,
/// by fewer sequences than `disable_by_batch_size` where it is given; none without it.
pub fn drafts_of(config: Option<&kura_engine::NgramDraft>) -> budget::Drafts {
    config.map_or(budget::Drafts::NONE, |d| {
        budget::Drafts::of(d.num_tokens, d.disable_by_batch_size)
    })
}

/// That the GPU pool holds `kv_dtype` (bf16, f32 or fp8) in blocks of `block_size` tokens (1 to
/// [`kura_cuda::MAX_BLOCK_SIZE`]; fp8 in multiples of 8): checked before a device is opened.
pub fn check_pool(kv_dtype: KvDtype, block_size: usize) -> Result<()> {
    if !matches!(kv_dtype, KvDtype::Bf16 | KvDtype::F32 | KvDtype::Fp8) {
        bail!(
            "--kv-dtype {}: the GPU pool holds bf16, f32 or fp8 KV (--device cpu has int8 and int4)",
            kv_dtype.name()
        );
    }
    if !(1..=kura_cuda::MAX_BLOCK_SIZE).contains(&block_size) {
        bail!(
            "--block-size {block_size}: the GPU pool holds blocks of 1 to {} tokens (--device cpu \
             takes up to {})",
            kura_cuda::MAX_BLOCK_SIZE,
            kura_kv::MAX_BLOCK_SIZE
        );
    }
    match kura_cuda::check_pool_format(kv_dtype, block_size) {
        Err(kura_cuda::CudaError::Unsupported(why)) => {
            bail!(
                "--kv-dtype {} --block-size {block_size}: {why}",
                kv_dtype.name()
            )
        }
        other => Ok(other?),
    }
}

/// That `weights_dtype` is what the GPU holds: bf16 (a GGUF's blocks are dequantized to it at load;
/// `native` means that on the device). Checked before a device is opened.
pub fn check_weights(weights_dtype: WeightsDtype) -> Result<()> {
    if !matches!(weights_dtype, WeightsDtype::Native | WeightsDtype::Bf16) {
        bail!(
            "--weights-dtype {}: the GPU holds bf16 weights (give native or bf16; --device cpu has \
             the others)",
            weights_dtype.name()
        );
    }
    Ok(())
}

/// A GPU holding a model's weights, before its pool is sized.
pub struct GpuSetup {
    dev: Device,
    config: ModelConfig,
    weights: DevWeights,
    kv_dtype: KvDtype,
    max_tokens: usize,
    max_seqs: usize,
    /// Draft tokens a step may check ([`GpuSetup::checking_drafts`]).
    drafts: budget::Drafts,
    /// Device memory free before the weights were loaded, and after.
    free_before_weights: u64,
    free_after_weights: u64,
}

impl GpuSetup {
    /// Opens GPU `ordinal` and loads the model `parts` (opened from `path`) onto it.
    pub fn load(
        ordinal: usize,
        path: &std::path::Path,
        parts: &ModelParts,
        kv_dtype: KvDtype,
        block_size: usize,
        max_tokens: usize,
        max_seqs: usize,
    ) -> Result<Self> {
        check_pool(kv_dtype, block_size)?;
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
        let (free_before_weights, _) = dev.memory()?;
        let t = std::time::Instant::now();
        let weights = DevWeights::load(&dev, parts.source.as_ref(), parts.naming, &parts.config)
            .with_context(|| format!("loading {} onto {}", path.display(), dev.name))?;
        tracing::info!(
            "weights on the GPU: {:.2} GB (bf16) in {:.2} s",
            weights.bytes as f64 / 1e9,
            t.elapsed().as_secs_f64()
        );
        let (free_after_weights, _) = dev.memory()?;
        Ok(GpuSetup {
            dev,
            config: parts.config.clone(),
            weights,
            kv_dtype,
            max_tokens,
            max_seqs,
            drafts: budget::Drafts::NONE,
            free_before_weights: free_before_weights as u64,
            free_after_weights: free_after_weights as u64,
        })
    }

    /// Steps that check `drafts` (`--speculative-config`, [`drafts_of`]): the output head's buffers
    /// are planned and allocated for their rows ([`budget::head_rows`]).
    pub fn checking_drafts(mut self, drafts: budget::Drafts) -> Self {
        self.drafts = drafts;
        self
    }

    /// The GPU's name, as the driver gives it.
    pub fn device_name(&self) -> &str {
        &self.dev.name
    }

    /// The device's numerics (`Device::numerics`), which the KV fingerprint is made from too.
    pub fn numerics(&self) -> u128 {
        self.dev.numerics
    }

    /// The weights' identity (`DevWeights::fingerprint`), which the KV fingerprint is made from.
    pub fn weights_fingerprint(&self) -> u128 {
        self.weights.fingerprint
    }

    /// The pool for `--kv-cache-memory` (`request`): planned by [`plan_pool`] from the device's total
    /// memory, as `kura plan --gpu` plans it, then checked against what is free on the device now that
    /// the weights are there. Logs the planned and measured breakdowns side by side.
    pub fn pool(&self, request: KvMemoryRequest, layout: &KvLayout) -> Result<PoolPlan> {
        let (_, total) = self.dev.memory()?;
        let total = total as u64;
        let plan = plan_pool(
            &Dims::of(&self.config),
            total,
            pool_request(request),
            self.max_tokens,
            self.max_seqs,
            self.drafts,
            layout,
        )
        .with_context(|| format!("--kv-cache-memory on {}", self.dev.name))?;
        let gb = |b: u64| format!("{:.3} GB", b as f64 / 1e9);
        let measured_context = total.saturating_sub(self.free_before_weights);
        let measured_weights = self
            .free_before_weights
            .saturating_sub(self.free_after_weights);
        // The activation buffers are allocated with the pool, from the table the plan counts.
        let measured_left = self
            .free_after_weights
            .saturating_sub(plan.activation_bytes + plan.reserve_bytes);
        tracing::info!(
            "GPU memory of {}: {total} bytes in all ({}); planned | measured: weights {} | {} ({} counted by the loader); \
             CUDA context and libraries {} | {}; activation buffers {} (steps of {} tokens over {} \
             sequences{}); reserve {}; left for the KV pool {} | {}",
            self.dev.name,
            gb(total),
            gb(plan.weights_bytes),
            gb(measured_weights),
            gb(self.weights.bytes as u64),
            gb(plan.context_bytes),
            gb(measured_context),
            gb(plan.activation_bytes),
            self.max_tokens,
            self.max_seqs,
            budget::drafts_note(self.drafts, self.max_seqs, plan.head_rows),
            gb(plan.reserve_bytes),
            gb(plan.left_bytes),
            gb(measured_left),
        );
        let pool_bytes = plan.num_blocks * plan.block_bytes;
        if pool_bytes > measured_left {
            bail!(
                "the planned KV pool of {} blocks ({} bytes) does not fit on {}: {} bytes are free with the \
                 weights loaded, and the activation buffers ({} bytes) and reserve ({} bytes) leave {} \
                 (planned: {} left of {} total, with {} for the weights and {} for the CUDA context; \
                 measured: {} and {}). Give a smaller --kv-cache-memory",
                plan.num_blocks,
                pool_bytes,
                self.dev.name,
                self.free_after_weights,
                plan.activation_bytes,
                plan.reserve_bytes,
                measured_left,
                plan.left_bytes,
                total,
                plan.weights_bytes,
                plan.context_bytes,
                measured_weights,
                measured_context
            );
        }
        Ok(plan)
    }

    /// The executor with a pool of `num_blocks` blocks of `layout`.
    pub fn executor(self, layout: &KvLayout, num_blocks: usize) -> Result<CudaExecutor> {
        let spec = PoolSpec {
            kv_dtype: self.kv_dtype,
            block_size: layout.block_size_tokens,
            num_blocks,
            reserve_tokens: self.max_tokens,
            reserve_seqs: budget::head_rows(self.max_tokens, self.max_seqs, self.drafts),
        };
        let exec = CudaExecutor::new(self.dev, self.config, self.weights, spec)?;
        if let Ok((free, _)) = exec.device().memory() {
            tracing::info!(
                "GPU memory after the activation buffers and the KV pool ({num_blocks} blocks): {:.3} GB \
                 free (planned: the {:.3} GB reserve and what the pool's whole blocks leave)",
                free as f64 / 1e9,
                DEVICE_RESERVE as f64 / 1e9
            );
        }
        let bytes = kura_engine::Executor::block_bytes(&exec) as u64;
        if bytes != layout.bytes_per_block() {
            bail!(
                "the GPU pool's block is {bytes} bytes, the KV layout's {}",
                layout.bytes_per_block()
            );
        }
        let mut exec = exec;
        let choice = match std::env::var(GPU_KERNELS_VAR) {
            Ok(v) => Some(v),
            Err(std::env::VarError::NotPresent) => None,
            Err(e) => bail!("{GPU_KERNELS_VAR}: {e}"),
        };
        choose_kernels(&mut exec, choice.as_deref())?;
        Ok(exec)
    }
}

/// The environment variable that says which kernels a GPU executor runs: `auto` (the default) times the
/// forms that give the same bits when it starts and keeps the fastest ([`CudaExecutor::tune`]);
/// `default` runs the default ones untimed; a prefill attention form's name (`narrow`, `half`, ...)
/// runs that form, and the default decode options, untimed.
pub const GPU_KERNELS_VAR: &str = "KURA_GPU_KERNELS";

/// Chooses the kernels of a new executor (its pool still empty) as `choice` ([`GPU_KERNELS_VAR`]'s
/// value) says, and says which in the log.
pub fn choose_kernels(exec: &mut CudaExecutor, choice: Option<&str>) -> Result<()> {
    let forms = || {
        PrefillKernel::ALL
            .iter()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match choice.map(str::trim) {
        None | Some("") | Some("auto") => {
            let tuned = exec.tune(kura_cuda::TUNE_TOKENS).with_context(|| {
                format!(
                    "timing the kernels on {} ({GPU_KERNELS_VAR}=default runs the default ones \
                     without timing them)",
                    exec.device().name
                )
            })?;
            match tuned {
                Some(t) => {
                    tracing::info!(
                        kernel = t.prefill.chosen.name(),
                        "prefill attention: {}; {GPU_KERNELS_VAR} overrides",
                        t.prefill
                    );
                    tracing::info!(
                        options = t.decode.chosen.name(),
                        "decode: {}; {GPU_KERNELS_VAR} overrides",
                        t.decode
                    );
                }
                None => tracing::info!(
                    "prefill attention: {}, decode: default (the pool or steps hold too few tokens to \
                     time the others)",
                    exec.prefill_kernel().name()
                ),
            }
        }
        Some("default") => tracing::info!(
            "prefill attention: {}, decode: default ({GPU_KERNELS_VAR}=default)",
            exec.prefill_kernel().name()
        ),
        Some(name) => {
            let Some(kernel) = PrefillKernel::ALL.into_iter().find(|k| k.name() == name) else {
                bail!(
                    "{GPU_KERNELS_VAR}={name}: give auto, default or a prefill attention kernel ({})",
                    forms()
                );
            };
            if !exec.set_prefill_kernel(kernel) {
                bail!(
                    "{GPU_KERNELS_VAR}={name}: {} did not load that prefill attention kernel for this \
                     model and KV format (it takes more shared memory than a block may have there, or, \
                     the forms on Hopper's warpgroup products, wg, halfwg, wgpipe and halfwgpipe); give \
                     auto, default or another of {}",
                    exec.device().name,
                    forms()
                );
            }
            tracing::info!("prefill attention: {name}, decode: default ({GPU_KERNELS_VAR})");
        }
    }
    Ok(())
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
        let context = parts.config.max_context();
        let total = match prompt.len().checked_add(max_tokens) {
            Some(total) if total <= context => total,
            _ => bail!(
                "the prompt ({} tokens) and --max-tokens {max_tokens} exceed the model's context of \
                 {context}",
                prompt.len()
            ),
        };
        let setup = GpuSetup::load(
            ordinal,
            path,
            parts,
            kv_dtype,
            block_size,
            prompt.len().max(1),
            1,
        )?;
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

    /// The token `sampler` takes after the last one, the tokens not yet in the blocks computed in one
    /// step: chosen on the device for a greedy sampler that needs nothing else (only its id comes
    /// back), else drawn from the row of logits copied back.
    pub fn next(&mut self, sampler: &mut kura_engine::Sampler) -> Result<u32> {
        let item =
            kura_engine::SeqInput::new(&self.tokens[self.computed..], self.computed, &self.table);
        let want = if sampler.argmax_only() {
            kura_engine::Want::Argmax
        } else {
            kura_engine::Want::Logits
        };
        let row = self.exec.forward_rows(&[item], &[want])?;
        self.computed = self.tokens.len();
        Ok(match row.first() {
            Some(&kura_engine::Row::Token(t)) => sampler.record_chosen(t).token,
            Some(kura_engine::Row::Logits(l)) => sampler.sample(l).token,
            _ => bail!("the GPU step answered no token and no logits"),
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_gpu_does_not_hold_is_refused_naming_the_flag() {
        for (kv, bs, expected) in [
            (
                KvDtype::Bf16,
                512,
                "--block-size 512: the GPU pool holds blocks of 1 to 256 tokens",
            ),
            (KvDtype::F32, 0, "--block-size 0:"),
            (
                KvDtype::Int8,
                16,
                "--kv-dtype int8: the GPU pool holds bf16, f32 or fp8 KV",
            ),
            (
                KvDtype::Fp8,
                12,
                "--kv-dtype fp8 --block-size 12: fp8 KV on the GPU in blocks of 12 tokens",
            ),
        ] {
            let e = check_pool(kv, bs).unwrap_err().to_string();
            assert!(e.contains(expected), "{kv:?} {bs}: {e}");
        }
        for (kv, bs) in [(KvDtype::Bf16, 1), (KvDtype::F32, 256), (KvDtype::Fp8, 16)] {
            check_pool(kv, bs).unwrap();
        }
        for w in [WeightsDtype::F32, WeightsDtype::Int8, WeightsDtype::Int4] {
            let e = check_weights(w).unwrap_err().to_string();
            assert!(e.contains("the GPU holds bf16 weights"), "{w:?}: {e}");
        }
        check_weights(WeightsDtype::Native).unwrap();
        check_weights(WeightsDtype::Bf16).unwrap();
    }
}
