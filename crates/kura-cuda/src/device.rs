//! One CUDA device as the executor uses it: its context and stream, cuBLAS, Kura's kernels loaded from
//! the kernel cache, and device buffers addressed by raw pointers (one stream orders everything, so
//! cudarc's per-buffer events are off).

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    PushKernelArg, ValidAsZeroBits,
};

use crate::error::{CudaError, Result};
use crate::executor::PrefillKernel;
use crate::kernels;

/// The K/V pool's shape as the kernels take it (`PoolShape` in `kura.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolShape {
    pub layers: i32,
    pub kv_heads: i32,
    pub block_size: i32,
    pub head_dim: i32,
}

// SAFETY: a plain C struct of four ints, passed by value.
unsafe impl DeviceRepr for PoolShape {}

/// One kernel argument: a device pointer, an integer, a float or the pool's shape.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    F32(f32),
    Usize(u64),
    Shape(PoolShape),
}

/// The forms of the decode products (at most 8 rows: `gemv_T` and its kin), all of the same bits: a
/// lane's chunks of W added in the same order, the loads issued differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GemvForm {
    /// `gemv_T`: four loads of W a lane unrolled, scheduled as the compiler sees fit.
    #[default]
    Plain,
    /// `gemv_ahead_T`: each load of W also asks L2 for the part of its row 4 KiB further on.
    Ahead,
    /// `gemv_batched_T`: a lane's chunks of W copied into shared memory by `cp.async`, two batches of
    /// four issued ahead of the one being added (4 KiB a warp on the way, whatever the compiler's
    /// schedule).
    Batched,
}

impl GemvForm {
    /// Every form, the default first.
    pub const ALL: [GemvForm; 3] = [GemvForm::Plain, GemvForm::Ahead, GemvForm::Batched];

    /// Its kernels' name, without the row count (`gemv`, `gemv_ahead`, `gemv_batched`).
    pub fn kernel(self) -> &'static str {
        match self {
            GemvForm::Plain => "gemv",
            GemvForm::Ahead => "gemv_ahead",
            GemvForm::Batched => "gemv_batched",
        }
    }
}

/// A device opened for the executor.
pub struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    pub ordinal: usize,
    pub name: String,
    /// `sm_XY`.
    pub arch: String,
    /// Multiprocessors.
    pub sms: usize,
    functions: HashMap<String, CudaFunction>,
    /// Dynamic shared memory of the prefill timing probes on this device ([`probe_smem`]).
    probe_smem: u32,
    /// Whether the kernels were compiled at this start (else read from the cache).
    pub compiled: bool,
    /// Seconds spent creating the context and loading (or compiling) the kernels.
    pub setup_seconds: f64,
    /// What the bits of this device's computations depend on beyond the model and their inputs
    /// ([`numerics_of`]): KV computed on two devices that agree on it is the same bit for bit, so a
    /// KV fingerprint names it (a tier shared by a fleet, or kept across an upgrade of cuBLAS or of
    /// Kura, never serves one device's KV to another that would have computed other bits).
    pub numerics: u128,
    /// While profiling: an event after each launch, with what was launched ([`Device::profile`]).
    marks: std::cell::RefCell<Option<Vec<(String, cudarc::driver::CudaEvent)>>>,
    /// Whether Kura's launches are programmatic dependent launches now ([`Device::set_dependent`]).
    dependent: std::cell::Cell<bool>,
    /// The form of the decode products ([`Device::set_gemv`]).
    gemv: std::cell::Cell<GemvForm>,
    /// Blocks of a kernel resident on one multiprocessor, by (kernel, dynamic shared memory): the
    /// driver's occupancy answer, asked once.
    resident: std::cell::RefCell<HashMap<(String, u32), usize>>,
    /// Host regions pinned for this device's copies ([`Device::pin_host`]): (address, bytes).
    pinned: Vec<(usize, usize)>,
}

impl Drop for Device {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // Kernels still queued (a block copy, the last step) finish before the module, the cuBLAS
        // handle and the pinned regions they may use go.
        let _ = self.stream.synchronize();
        for (at, _) in self.pinned.drain(..) {
            // SAFETY: each address was registered by `pin_host` and is unregistered once.
            let _ =
                unsafe { cudarc::driver::sys::cuMemHostUnregister(at as *mut std::ffi::c_void) };
        }
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({} {}, {})", self.ordinal, self.name, self.arch)
    }
}

/// Parses `cuda`, `cuda:N` (the device's ordinal).
pub fn parse_device(s: &str) -> std::result::Result<Option<usize>, String> {
    match s {
        "cpu" => Ok(None),
        "cuda" => Ok(Some(0)),
        _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(Some(n)),
            _ => Err(format!(
                "device {s:?}: give cpu, cuda or cuda:N (N the GPU's index)"
            )),
        },
    }
}

impl Device {
    /// Opens GPU `ordinal`: checks the libraries, the device and its architecture, then loads Kura's
    /// kernels for it (compiling them once into the kernel cache).
    pub fn open(ordinal: usize) -> Result<Self> {
        let t0 = std::time::Instant::now();
        crate::libs::check_all()?;
        let count = CudaContext::device_count().map_err(|e| CudaError::NoDevice {
            ordinal,
            found: format!("the driver reports no usable GPU ({e:?})"),
        })?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaError::NoDevice {
                ordinal,
                found: format!("this machine has {count} GPU(s)"),
            });
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: cudarc's buffers live on the device stream only. The host tier's copies run on a
        // second stream through raw pointers (`executor/transfers.rs`), ordered against the device
        // stream by events of their own; nothing relies on cudarc's cross-stream events.
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name()?;
        let (major, minor) = ctx.compute_capability()?;
        if major < 8 {
            return Err(CudaError::Architecture {
                ordinal,
                name,
                major,
                minor,
            });
        }
        let arch = format!("sm_{major}{minor}");
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )?
            .max(1) as usize;
        let smem_per_sm = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            )?
            .max(0) as u32;
        let probe_smem = probe_smem(smem_per_sm);
        let smem_optin = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )?
            .max(0) as u32;
        // A stream of its own (the legacy default stream cannot be captured into a graph).
        let stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let mut cublas_version = 0;
        // SAFETY: a live handle and a valid out-pointer.
        unsafe { blas_sys::cublasGetVersion_v2(*blas.handle(), &mut cublas_version) }
            .result()
            .map_err(|e| CudaError::driver(format!("cublasGetVersion: {e:?}")))?;
        let numerics = numerics_of(
            &kernels::cache_key(compile_arch(&arch), kernels::nvrtc_version()?),
            &name,
            sms,
            cublas_version,
        );
        let dir = kernels::cache_dir();
        let (cubin, mut compiled) = kernels::cubin_for(compile_arch(&arch), &dir)?;
        let functions = match load_kernels(&ctx, &arch, cubin, probe_smem, smem_optin) {
            Ok(f) => f,
            // A cached cubin the driver will not load (a file damaged past its ELF magic): compiled
            // again and the cache's file replaced, once.
            Err(e) if !compiled => {
                tracing::warn!(
                    error = %e,
                    dir = %dir.display(),
                    "the cached kernels would not load; compiling them again"
                );
                compiled = true;
                load_kernels(
                    &ctx,
                    &arch,
                    kernels::compile_to_cache(compile_arch(&arch), &dir)?,
                    probe_smem,
                    smem_optin,
                )?
            }
            Err(e) => return Err(e),
        };
        Ok(Device {
            ctx,
            stream,
            blas,
            ordinal,
            name,
            arch,
            sms,
            functions,
            probe_smem,
            compiled,
            setup_seconds: t0.elapsed().as_secs_f64(),
            numerics,
            marks: std::cell::RefCell::new(None),
            dependent: std::cell::Cell::new(false),
            gemv: std::cell::Cell::new(GemvForm::Plain),
            resident: std::cell::RefCell::new(HashMap::new()),
            pinned: Vec::new(),
        })
    }

    /// Whether this device can start a kernel while the one before it drains (programmatic dependent
    /// launch: compute capability 9.0 and later).
    pub fn has_dependent_launch(&self) -> bool {
        self.arch
            .strip_prefix("sm_")
            .and_then(|v| v.parse::<u32>().ok())
            .is_some_and(|v| v >= 90)
    }

    /// Decode products (at most 8 rows) through the kernels of `form`: the same bits whichever. Graphs
    /// captured before keep the kernels they captured: [`crate::CudaExecutor::set_gemv`] clears them.
    pub fn set_gemv(&self, form: GemvForm) {
        self.gemv.set(form);
    }

    /// The form of the decode products ([`Device::set_gemv`]).
    pub fn gemv(&self) -> GemvForm {
        self.gemv.get()
    }

    /// Launches Kura's kernels from now on as programmatic dependent launches (`on`, where the device
    /// has them), or plainly. Each kernel waits on the one before it (`dep_wait` in `kura.cu`) before
    /// it reads or writes anything but the weights, so the results are the same either way; what
    /// changes is that a kernel's blocks are scheduled, and a product's weights asked of L2, while the
    /// previous kernel drains.
    pub fn set_dependent(&self, on: bool) {
        self.dependent.set(on && self.has_dependent_launch());
    }

    /// Pins `region`'s pages (page-locks them and registers them with the driver; kernels do not read
    /// them), so that copies between it and device memory run as direct transfers at the bus's speed;
    /// unpinned when the device closes. The caller keeps the region alive and in place until then.
    pub fn pin_host(&mut self, region: &mut [u8]) -> Result<()> {
        if region.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: the region is valid host memory of its length; the driver only page-locks it.
        unsafe {
            cudarc::driver::sys::cuMemHostRegister_v2(
                region.as_mut_ptr().cast(),
                region.len(),
                cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result()?;
        self.pinned
            .push((region.as_mut_ptr() as usize, region.len()));
        Ok(())
    }

    /// Whether `bytes` lie within a host region pinned by [`Device::pin_host`] (copies from it can run
    /// asynchronously, at the bus's speed).
    pub fn is_pinned(&self, bytes: &[u8]) -> bool {
        let (start, len) = (bytes.as_ptr() as usize, bytes.len());
        self.pinned.iter().any(|&(at, n)| {
            start >= at
                && start
                    .checked_add(len)
                    .is_some_and(|end| end <= at.saturating_add(n))
        })
    }

    /// Starts timing every launch (host-synchronised at the end; not for graphs): see
    /// [`Device::profile_end`].
    pub fn profile_begin(&self) -> Result<cudarc::driver::CudaEvent> {
        let start = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        start.record(&self.stream)?;
        *self.marks.borrow_mut() = Some(Vec::new());
        Ok(start)
    }

    /// Milliseconds per kernel or product name since [`Device::profile_begin`], largest first, with
    /// how many launches each.
    pub fn profile_end(
        &self,
        start: cudarc::driver::CudaEvent,
    ) -> Result<Vec<(String, f64, usize)>> {
        let marks = self.marks.borrow_mut().take().unwrap_or_default();
        self.synchronize()?;
        let mut by_name: HashMap<String, (f64, usize)> = HashMap::new();
        let mut prev = &start;
        for (name, ev) in &marks {
            let ms = f64::from(prev.elapsed_ms(ev)?);
            let e = by_name.entry(name.clone()).or_default();
            e.0 += ms;
            e.1 += 1;
            prev = ev;
        }
        let mut out: Vec<(String, f64, usize)> =
            by_name.into_iter().map(|(k, (ms, n))| (k, ms, n)).collect();
        out.sort_by(|a, b| b.1.total_cmp(&a.1));
        Ok(out)
    }

    fn mark(&self, name: impl FnOnce() -> String) -> Result<()> {
        if let Some(marks) = self.marks.borrow_mut().as_mut() {
            let ev = self
                .ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            ev.record(&self.stream)?;
            marks.push((name(), ev));
        }
        Ok(())
    }

    /// Free and total device memory, in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// A zeroed buffer of `n` elements; `what` names it in the out-of-memory error.
    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
        what: &str,
    ) -> Result<CudaSlice<T>> {
        let bytes =
            n.checked_mul(std::mem::size_of::<T>())
                .ok_or_else(|| CudaError::OutOfMemory {
                    what: what.into(),
                    need: usize::MAX,
                    free: 0,
                })?;
        let (mut free, _) = self.memory()?;
        if bytes > free {
            // Buffers freed just before (a buffer growing) go back to the driver in stream order: wait
            // for the stream, then look again.
            self.synchronize()?;
            free = self.memory()?.0;
        }
        if bytes > free {
            return Err(CudaError::OutOfMemory {
                what: what.into(),
                need: bytes,
                free,
            });
        }
        self.stream
            .alloc_zeros::<T>(n.max(1))
            .map_err(|e| alloc_failed(e.0, format!("{e:?}"), what, bytes, free))
    }

    /// The device address of a buffer.
    pub fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    /// Launches kernel `name` with `args` in order (and the dynamic shared memory its name calls for).
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        let smem = kernel_smem(name, self.probe_smem).unwrap_or(0);
        self.launch_as(name, grid, block, smem, args, || name.to_string())
    }

    /// [`Device::launch`] with `smem` bytes of dynamic shared memory, named `label()` in a profile.
    fn launch_as(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
        label: impl FnOnce() -> String,
    ) -> Result<()> {
        let f = self
            .functions
            .get(name)
            .ok_or_else(|| CudaError::driver(format!("no kernel {name} in Kura's module")))?;
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Ptr(p) | Arg::Usize(p) => b.arg(p),
                Arg::I32(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
                Arg::Shape(s) => b.arg(s),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: smem,
        };
        if self.dependent.get() {
            self.launch_dependent(f, &cfg, args)?;
            return self.mark(label);
        }
        // SAFETY: every kernel of Kura's module is launched with the argument list of its C signature
        // (the callers in `executor.rs` mirror `kura.cu`), and every pointer is into a live buffer
        // sized for the launch.
        unsafe { b.launch(cfg) }?;
        self.mark(label)
    }

    /// A launch through `cuLaunchKernelEx` with programmatic stream serialisation allowed.
    fn launch_dependent(&self, f: &CudaFunction, cfg: &LaunchConfig, args: &[Arg]) -> Result<()> {
        use cudarc::driver::sys;
        use std::ffi::c_void;
        self.ctx.bind_to_thread()?;
        // Each parameter's address: the values live in `args` for the whole call.
        let mut params: Vec<*mut c_void> = args
            .iter()
            .map(|a| match a {
                Arg::Ptr(p) | Arg::Usize(p) => p as *const u64 as *mut c_void,
                Arg::I32(v) => v as *const i32 as *mut c_void,
                Arg::F32(v) => v as *const f32 as *mut c_void,
                Arg::Shape(s) => s as *const PoolShape as *mut c_void,
            })
            .collect();
        // SAFETY: a zeroed attribute value is valid (a C union of plain fields); its one field read is
        // set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as in `launch_as`: the argument list mirrors the kernel's C signature and every
        // pointer is into a live buffer; `params` and `attr` outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()?;
        Ok(())
    }

    /// `out[t][n] (+)= Σ_k x[t][k] · w[n][k]`: bf16 `x` (`t × k`) and `w` (`n × k`), f32 `out`; adds
    /// to `out` when `accumulate`. cuBLAS, or the decode kernel for at most 8 rows.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        x: u64,
        t: usize,
        w: u64,
        n: usize,
        k: usize,
        out: u64,
        accumulate: bool,
    ) -> Result<()> {
        if t == 0 {
            return Ok(());
        }
        if t <= 8 && k.is_multiple_of(8) {
            // (`GEMV_WARPS` in `kura.cu`: `gemv_batched_T`'s shared memory has a stage for each.)
            let warps_per_block = 8;
            let kernel = self.gemv.get().kernel();
            self.launch_as(
                &format!("{kernel}_{t}"),
                (n.div_ceil(warps_per_block) as u32, 1, 1),
                32 * warps_per_block as u32,
                0,
                &[
                    Arg::Ptr(w),
                    Arg::Ptr(x),
                    Arg::Ptr(out),
                    Arg::I32(n as i32),
                    Arg::I32(k as i32),
                    Arg::I32(accumulate as i32),
                ],
                || format!("{kernel} {t}x{n}x{k}"),
            )?;
            return Ok(());
        }
        let alpha = 1f32;
        let beta = if accumulate { 1f32 } else { 0f32 };
        // Column-major view: out (n × t) = wᵀ (n × k) · x (k × t).
        // SAFETY: the pointers are device buffers of the sizes above; alpha and beta are host f32s.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                t as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                w as *const std::ffi::c_void,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                k as i32,
                x as *const std::ffi::c_void,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                k as i32,
                (&beta as *const f32).cast(),
                out as *mut std::ffi::c_void,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                n as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        self.mark(|| format!("cublas {t}x{n}x{k}"))
    }

    /// Whether [`Device::gemv_norm`] and [`Device::gemv_swiglu_norm`] take `t` rows of `k`: at most
    /// [`GEMV_NORM_MAX_TOKENS`], `k % 8 == 0`, and the normed rows within [`GEMV_NORM_SMEM`].
    pub fn gemv_norm_fits(t: usize, k: usize) -> bool {
        (1..=GEMV_NORM_MAX_TOKENS).contains(&t)
            && k.is_multiple_of(8)
            && t * k * 2 <= GEMV_NORM_SMEM as usize
    }

    /// The grid of grid-stride matrix-vector kernel `name` (blocks of [`NORM_THREADS`], a warp a row)
    /// over `rows` rows with `smem` bytes of dynamic shared memory: one block per 8 rows, but no more
    /// than the device holds at once, so that each block's work before its rows (norming the input)
    /// is done once per resident block at most.
    fn gemv_grid(&self, name: &str, rows: usize, smem: u32) -> Result<u32> {
        let resident = {
            let mut cache = self.resident.borrow_mut();
            match cache.get(&(name.to_string(), smem)) {
                Some(r) => *r,
                None => {
                    let f = self.functions.get(name).ok_or_else(|| {
                        CudaError::driver(format!("no kernel {name} in Kura's module"))
                    })?;
                    let r = f
                        .occupancy_max_active_blocks_per_multiprocessor(
                            NORM_THREADS,
                            smem as usize,
                            None,
                        )?
                        .max(1) as usize;
                    cache.insert((name.to_string(), smem), r);
                    r
                }
            }
        };
        let warps = (NORM_THREADS / 32) as usize;
        Ok(rows.div_ceil(warps).clamp(1, resident * self.sms.max(1)) as u32)
    }

    /// Asks the driver, now, how many blocks of the kernels that norm `t` rows of `k` a multiprocessor
    /// holds (cached for their grids): a step about to be captured in a graph then makes no driver
    /// query while it is captured. Shapes they do not take are left alone.
    pub fn prepare_normed(&self, t: usize, k: usize) -> Result<()> {
        if Self::gemv_norm_fits(t, k) {
            for kind in ["gemv_norm", "gemv_swiglu_norm"] {
                self.gemv_grid(&format!("{kind}_{t}"), 1, (t * k * 2) as u32)?;
            }
        }
        Ok(())
    }

    /// `out[t][j] = Σ_k w[j][k] · norm(x[r_t])[k]` (f32) for `t` rows `r_t` of the f32 residual `x`
    /// (`rows`, a device array of `t` row indices, or the first `t` when 0), normed with `norm` (the
    /// bits of `rms_norm`), and `n` rows of bf16 `w` (`n × k`): the norm and the decode product in one
    /// launch ([`Device::gemv_norm_fits`] says which shapes).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_norm(
        &self,
        x: u64,
        rows: u64,
        t: usize,
        norm: u64,
        eps: f32,
        w: u64,
        n: usize,
        k: usize,
        out: u64,
    ) -> Result<()> {
        let args = [
            Arg::Ptr(w),
            Arg::Ptr(x),
            Arg::Ptr(rows),
            Arg::Ptr(norm),
            Arg::F32(eps),
            Arg::Ptr(out),
            Arg::I32(n as i32),
            Arg::I32(k as i32),
        ];
        self.launch_normed("gemv_norm", t, n, k, &args)
    }

    /// `act[t][j] = SiLU(h[t] · w[j]) · (h[t] · w[inter + j])` in bf16, where `h` is the first `t` rows
    /// of the f32 residual `x` normed with `norm`, and `w` = [gate | up] (`2·inter × k`): the FFN's
    /// norm, gate and up products and SiLU·mul in one launch, with the bits of `rms_norm`, the decode
    /// product and `silu_mul`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_swiglu_norm(
        &self,
        x: u64,
        t: usize,
        norm: u64,
        eps: f32,
        w: u64,
        inter: usize,
        k: usize,
        act: u64,
    ) -> Result<()> {
        let args = [
            Arg::Ptr(w),
            Arg::Ptr(x),
            Arg::Ptr(norm),
            Arg::F32(eps),
            Arg::Ptr(act),
            Arg::I32(inter as i32),
            Arg::I32(k as i32),
        ];
        self.launch_normed("gemv_swiglu_norm", t, inter, k, &args)
    }

    /// Launches `{kind}_{t}` (a kernel that norms `t` rows of `k` into shared memory, then takes `rows`
    /// output rows grid-stride) with `args`.
    fn launch_normed(
        &self,
        kind: &str,
        t: usize,
        rows: usize,
        k: usize,
        args: &[Arg],
    ) -> Result<()> {
        if !Self::gemv_norm_fits(t, k) {
            return Err(CudaError::driver(format!(
                "{kind} of {t} rows of {k}: takes 1 to {GEMV_NORM_MAX_TOKENS} rows, a multiple of 8 \
                 long, within {GEMV_NORM_SMEM} bytes"
            )));
        }
        let (name, smem) = (format!("{kind}_{t}"), (t * k * 2) as u32);
        let grid = self.gemv_grid(&name, rows, smem)?;
        self.launch_as(&name, (grid, 1, 1), NORM_THREADS, smem, args, || {
            format!("{kind} {t}x{rows}x{k}")
        })
    }

    /// Whether kernel `name` of Kura's module was loaded on this device (every one is, but those that
    /// take more shared memory than a block may have here).
    pub fn has_kernel(&self, name: &str) -> bool {
        self.functions.contains_key(name)
    }

    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
}

/// What a failed allocation (or the zeroing after it) of `need` bytes for `what` is: a device fault
/// when the driver's `code` says the context is unusable (an earlier kernel's illegal address often
/// surfaces at the next call), else out of memory, which fails the step only.
fn alloc_failed(
    code: cudarc::driver::sys::CUresult,
    message: String,
    what: &str,
    need: usize,
    free: usize,
) -> CudaError {
    match CudaError::from_driver_code(code, message.clone()) {
        e if e.is_device_fault() => e,
        _ => CudaError::OutOfMemory {
            what: format!("{what} ({message})"),
            need,
            free,
        },
    }
}

/// Every kernel of Kura's module from `cubin` (compiled for `arch`'s [`compile_arch`]), with the dynamic
/// shared memory each is allowed (the timing probes `probe_smem`), but those that take more than a block
/// may have on this device (`smem_optin`): a prefill kernel of three stages on sm_86
/// ([`Device::has_kernel`]).
fn load_kernels(
    ctx: &Arc<cudarc::driver::CudaContext>,
    arch: &str,
    cubin: Vec<u8>,
    probe_smem: u32,
    smem_optin: u32,
) -> Result<HashMap<String, cudarc::driver::CudaFunction>> {
    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?;
    let mut functions = HashMap::new();
    for n in kernel_names() {
        if !in_module(&n, arch) {
            continue;
        }
        let smem = kernel_smem(&n, probe_smem);
        if !fits_a_block(smem, smem_optin) {
            tracing::debug!(
                kernel = n,
                "not loaded: takes more shared memory than a block may have on this device ({smem_optin} bytes)"
            );
            continue;
        }
        let f = module
            .load_function(&n)
            .map_err(|e| CudaError::from_driver_code(e.0, format!("loading kernel {n}: {e:?}")))?;
        if let Some(bytes) = smem {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )?;
        }
        functions.insert(n.clone(), f);
    }
    Ok(functions)
}

/// Dynamic shared memory of the kernels that take it: the prefill attention kernels'
/// ([`PrefillKernel::shared_bytes`], by the name's form and head size).
pub fn dynamic_smem(kernel: &str) -> Option<u32> {
    let rest = kernel.strip_prefix("attn_prefill_")?;
    let d: u32 = rest.rsplit('_').next()?.parse().ok()?;
    let form = PrefillKernel::ALL
        .into_iter()
        .find(|k| !k.prefix().is_empty() && rest.starts_with(k.prefix()))
        .unwrap_or(PrefillKernel::Narrow);
    Some(form.shared_bytes(d))
}

/// The architecture Kura's module is compiled for on a device of architecture `arch` (`sm_80`, …):
/// `sm_90a` on compute capability 9.0, whose warpgroup products (`wgmma`) exist only in code for that
/// one architecture; `arch` elsewhere.
pub fn compile_arch(arch: &str) -> &str {
    if arch == "sm_90" {
        "sm_90a"
    } else {
        arch
    }
}

/// The identity of a device's numerics ([`Device::numerics`]): Kura's kernels as compiled for it (their
/// cache key `kernels`: the source, the compile options, the architecture and NVRTC's version), the
/// device's name and multiprocessors (cuBLAS chooses its algorithms, and so the order of its sums, by
/// the device) and cuBLAS' version.
pub fn numerics_of(kernels: &str, name: &str, sms: usize, cublas_version: i32) -> u128 {
    let mut h = blake3::Hasher::new();
    h.update(b"kura-cuda-numerics\0");
    for part in [kernels.as_bytes(), name.as_bytes()] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.update(&(sms as u64).to_le_bytes());
    h.update(&cublas_version.to_le_bytes());
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    u128::from_le_bytes(out)
}

/// Whether kernel `name` is in Kura's module compiled for a device of architecture `arch` (every kernel
/// but the prefill forms on warpgroup products, [`PrefillKernel::needs_sm90a`], which only sm_90 has).
pub fn in_module(name: &str, arch: &str) -> bool {
    let hopper_only = PrefillKernel::ALL.into_iter().any(|k| {
        k.needs_sm90a()
            && name
                .strip_prefix("attn_prefill_")
                .is_some_and(|rest| rest.starts_with(k.prefix()))
    });
    !hopper_only || compile_arch(arch) == "sm_90a"
}

/// Whether a kernel of `smem` bytes of dynamic shared memory (None: none) fits a block on a device whose
/// blocks may opt in to `smem_optin` bytes.
fn fits_a_block(smem: Option<u32>, smem_optin: u32) -> bool {
    smem.is_none_or(|bytes| bytes <= smem_optin)
}

/// Whether `kernel` is a timing probe of the prefill attention (`attn_prefill_probe_*`).
fn is_probe(kernel: &str) -> bool {
    kernel.starts_with("attn_prefill_probe_")
}

/// Dynamic shared memory `kernel` is allowed and launched with on a device whose prefill timing probes
/// take `probe_smem` ([`probe_smem`]); the others' from [`dynamic_smem`].
fn kernel_smem(kernel: &str, probe_smem: u32) -> Option<u32> {
    if is_probe(kernel) {
        Some(probe_smem)
    } else {
        dynamic_smem(kernel)
    }
}

/// Dynamic shared memory of the prefill timing probes on a device with `per_sm` bytes of shared memory
/// a multiprocessor: more than half of it, so that each probe runs one block a multiprocessor as the
/// 8-warp kernel does (which its registers hold to one), whatever registers the probe needs (the
/// copies alone need 40); at least that kernel's two stages.
pub fn probe_smem(per_sm: u32) -> u32 {
    (per_sm / 2 + 1024).max(PrefillKernel::Narrow.shared_bytes(128))
}

/// Dynamic shared memory the matrix-vector kernels that norm their input may take: `t × k` bf16 rows.
/// A block may have 48 KiB without the driver's opt-in, static and dynamic shared memory together, and
/// these kernels' own static memory (the block sum's 32 floats) comes first: 1 KiB is left for it (4
/// rows of 4,096 fit; 3 of 8,192, exactly 48 KiB, do not).
pub const GEMV_NORM_SMEM: u32 = (48 << 10) - 1024;

/// The most tokens of a step whose products norm their input themselves: every block norms all of
/// them, so beyond a few the rereads of the residual stream cost more than the launch they save.
pub const GEMV_NORM_MAX_TOKENS: usize = 4;

/// Threads of a block of the kernels that take a row's RMS (`NORM_THREADS` in `kura.cu`): `rms_norm`
/// and the matrix-vector kernels that norm their input, whose sums must agree to the bit.
pub const NORM_THREADS: u32 = 256;

/// Every kernel of `kura.cu` the executor launches (those on warpgroup products are in the module for
/// sm_90 only: [`in_module`]).
pub fn kernel_names() -> Vec<String> {
    let mut v: Vec<String> = [
        "embed",
        "rms_norm",
        "silu_mul",
        "rope_store_bf16",
        "rope_store_f32",
        "rope_table",
        "attn_merge",
        "argmax_part",
        "argmax_merge",
        "copy_block_prefix",
        "copy_block_prefix_fp8",
        "rope_kv_inplace",
        "quant_store_fp8",
        "fill_random_bf16",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for kv in ["bf16", "f32", "fp8"] {
        for d in [64, 128] {
            v.extend(PrefillKernel::ALL.iter().map(|k| k.kernel(kv, d)));
            for g in [1, 2, 4, 8, 16] {
                v.push(format!("attn_split_{kv}_{d}_g{g}"));
            }
        }
    }
    for probe in crate::executor::PrefillProbe::ALL {
        for d in [64, 128] {
            v.push(probe.kernel(d));
        }
    }
    v.extend((1..=8).map(|t| format!("gemv_{t}")));
    for form in GemvForm::ALL {
        if form != GemvForm::Plain {
            v.extend((1..=8).map(|t| format!("{}_{t}", form.kernel())));
        }
    }
    v.extend((1..=GEMV_NORM_MAX_TOKENS).map(|t| format!("gemv_norm_{t}")));
    v.extend((1..=GEMV_NORM_MAX_TOKENS).map(|t| format!("gemv_swiglu_norm_{t}")));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_capability_9_0_compiles_for_sm_90a_and_only_it_has_the_warpgroup_kernels() {
        assert_eq!(compile_arch("sm_90"), "sm_90a");
        for arch in ["sm_80", "sm_86", "sm_89", "sm_100", "sm_120"] {
            assert_eq!(compile_arch(arch), arch);
        }
        for k in PrefillKernel::ALL {
            for kv in ["bf16", "f32", "fp8"] {
                let name = k.kernel(kv, 128);
                assert!(in_module(&name, "sm_90"), "{name}");
                assert!(in_module(&name, "sm_90a"), "{name}");
                for arch in ["sm_80", "sm_89", "sm_100"] {
                    assert_eq!(in_module(&name, arch), !k.needs_sm90a(), "{name} on {arch}");
                }
            }
        }
        let wg = kernel_names()
            .into_iter()
            .filter(|n| !in_module(n, "sm_80"))
            .collect::<Vec<_>>();
        assert_eq!(wg.len(), 24, "{wg:?}");
        assert!(wg.iter().all(|n| [
            "attn_prefill_wg_",
            "attn_prefill_halfwg_",
            "attn_prefill_wgpipe_",
            "attn_prefill_halfwgpipe_"
        ]
        .iter()
        .any(|p| n.starts_with(p))));
    }

    #[test]
    fn a_failed_allocation_is_a_device_fault_when_the_context_is_gone_and_else_out_of_memory() {
        use cudarc::driver::sys::CUresult as R;
        let e = alloc_failed(
            R::CUDA_ERROR_ILLEGAL_ADDRESS,
            "ILLEGAL_ADDRESS".into(),
            "KV",
            64,
            0,
        );
        assert!(e.is_device_fault(), "{e}");
        let e = alloc_failed(
            R::CUDA_ERROR_OUT_OF_MEMORY,
            "OUT_OF_MEMORY".into(),
            "KV",
            64,
            0,
        );
        assert!(!e.is_device_fault(), "{e}");
        assert_eq!(
            e.to_string(),
            "not enough device memory: KV (OUT_OF_MEMORY) needs 64 bytes, 0 are free on the device"
        );
    }

    #[test]
    fn the_products_norm_their_input_for_few_tokens_whose_rows_fit_without_an_opt_in() {
        // Up to 4 tokens, rows a multiple of 8 long, the normed rows and the kernel's own static shared
        // memory within 48 KiB (what every kernel may take without the driver's opt-in).
        assert!(Device::gemv_norm_fits(1, 576));
        assert!(Device::gemv_norm_fits(4, 4096));
        assert!(!Device::gemv_norm_fits(5, 576), "5 tokens");
        assert!(!Device::gemv_norm_fits(0, 576), "no token");
        assert!(Device::gemv_norm_fits(2, 8192));
        assert!(Device::gemv_norm_fits(4, 5120), "40 KiB of rows");
        // Exactly 48 KiB of rows leaves no room for the block sum's 128 bytes: the launch would fail.
        assert!(!Device::gemv_norm_fits(3, 8192), "48 KiB of rows");
        assert!(!Device::gemv_norm_fits(4, 6144), "48 KiB of rows");
        assert!(!Device::gemv_norm_fits(2, 12288), "48 KiB of rows");
        assert!(!Device::gemv_norm_fits(4, 8192), "64 KiB of rows");
        assert!(!Device::gemv_norm_fits(1, 4100), "not a multiple of 8");
        // A kernel for each count it takes, in the module.
        for t in 1..=GEMV_NORM_MAX_TOKENS {
            assert!(kernel_names().contains(&format!("gemv_norm_{t}")));
            assert!(kernel_names().contains(&format!("gemv_swiglu_norm_{t}")));
        }
    }

    #[test]
    fn the_prefill_kernels_shared_memory_is_their_stages_and_the_wide_ones_query_rows() {
        // 8 warps: two stages of 64 keys' K and V rows of (d + 8) bf16.
        assert_eq!(
            dynamic_smem("attn_prefill_bf16_128"),
            Some(2 * 2 * 64 * 136 * 2)
        );
        assert_eq!(
            dynamic_smem("attn_prefill_fp8_64"),
            Some(2 * 2 * 64 * 72 * 2)
        );
        // Wide: 32 keys a stage at d = 128 (64 at d = 64), then 128 query rows.
        assert_eq!(
            dynamic_smem("attn_prefill_wide_f32_128"),
            Some(2 * 2 * 32 * 136 * 2 + 128 * 136 * 2)
        );
        assert_eq!(
            dynamic_smem("attn_prefill_wide_bf16_64"),
            Some(2 * 2 * 64 * 72 * 2 + 128 * 72 * 2)
        );
        // Half tiles: the 8-warp kernel's stages.
        assert_eq!(
            dynamic_smem("attn_prefill_half_bf16_128"),
            Some(2 * 2 * 64 * 136 * 2)
        );
        // Small: the wide kernel's stages without its query rows (three blocks fit sm_90's 227 KiB).
        assert_eq!(
            dynamic_smem("attn_prefill_small_fp8_128"),
            Some(2 * 2 * 32 * 136 * 2)
        );
        assert_eq!(
            dynamic_smem("attn_prefill_small_bf16_64"),
            Some(2 * 2 * 64 * 72 * 2)
        );
        assert_eq!(dynamic_smem("attn_split_bf16_128_g4"), None);
        // Every launched kernel that takes shared memory has its size, within sm_80's 163 KiB.
        for k in kernel_names() {
            if k.starts_with("attn_prefill") {
                let bytes = dynamic_smem(&k).unwrap_or_else(|| panic!("{k}: no size"));
                assert!(bytes <= 163 * 1024, "{k}: {bytes} bytes");
            }
        }
    }

    #[test]
    fn each_part_of_a_devices_numerics_counts() {
        let key = kernels::cache_key("sm_90a", (13, 0));
        let h100 = numerics_of(&key, "NVIDIA H100 80GB HBM3", 132, 130_000);
        assert_eq!(
            h100,
            numerics_of(&key, "NVIDIA H100 80GB HBM3", 132, 130_000)
        );
        for other in [
            numerics_of(
                &kernels::cache_key("sm_90a", (13, 1)),
                "NVIDIA H100 80GB HBM3",
                132,
                130_000,
            ),
            numerics_of(
                &kernels::cache_key("sm_80", (13, 0)),
                "NVIDIA H100 80GB HBM3",
                132,
                130_000,
            ),
            numerics_of(&key, "NVIDIA H100 PCIe", 132, 130_000),
            // A MIG slice of the same GPU: fewer multiprocessors, which cuBLAS chooses by.
            numerics_of(&key, "NVIDIA H100 80GB HBM3", 66, 130_000),
            numerics_of(&key, "NVIDIA H100 80GB HBM3", 132, 130_100),
            // The parts are delimited: a name's end is not the key's.
            numerics_of(&format!("{key}N"), "VIDIA H100 80GB HBM3", 132, 130_000),
        ] {
            assert_ne!(other, h100);
        }
    }

    #[test]
    fn three_stage_prefill_kernels_at_head_size_128_are_the_only_ones_too_big_for_sm_86() {
        assert_eq!(
            dynamic_smem("attn_prefill_deep_bf16_128"),
            Some(3 * 2 * 64 * 136 * 2)
        );
        assert_eq!(
            dynamic_smem("attn_prefill_halfdeep_fp8_64"),
            Some(3 * 2 * 64 * 72 * 2)
        );
        // (the most a block may opt in to, the per-multiprocessor size): sm_90, sm_80, sm_86 / sm_89.
        for (optin, per_sm) in [
            (227 << 10, 228 << 10),
            (163 << 10, 164 << 10),
            (99 << 10, 100 << 10),
        ] {
            let probe = probe_smem(per_sm);
            let mut left_out: Vec<String> = kernel_names()
                .into_iter()
                .filter(|k| !fits_a_block(kernel_smem(k, probe), optin))
                .collect();
            left_out.sort();
            let want = if optin < (100 << 10) {
                [
                    "attn_prefill_deep_bf16_128",
                    "attn_prefill_deep_f32_128",
                    "attn_prefill_deep_fp8_128",
                    "attn_prefill_halfdeep_bf16_128",
                    "attn_prefill_halfdeep_f32_128",
                    "attn_prefill_halfdeep_fp8_128",
                ]
                .as_slice()
            } else {
                &[]
            };
            assert_eq!(left_out, want, "opt-in {optin}");
        }
        assert!(fits_a_block(None, 0));
    }

    #[test]
    fn a_prefill_probe_runs_one_block_a_multiprocessor_within_the_per_block_limit() {
        // (shared memory a multiprocessor, the most a block may opt in to): sm_90, sm_80, sm_86 / sm_89.
        for (per_sm, optin) in [
            (228 << 10, 227 << 10),
            (164 << 10, 163 << 10),
            (100 << 10, 99 << 10),
        ] {
            let bytes = probe_smem(per_sm);
            assert!(2 * bytes > per_sm && bytes <= optin, "{per_sm}: {bytes}");
            assert!(bytes >= dynamic_smem("attn_prefill_bf16_128").unwrap());
        }
        let probes: Vec<String> = kernel_names().into_iter().filter(|k| is_probe(k)).collect();
        assert_eq!(probes.len(), 8, "{probes:?}");
        assert!(probes
            .iter()
            .all(|k| k.ends_with("_bf16_64") || k.ends_with("_bf16_128")));
    }
}
