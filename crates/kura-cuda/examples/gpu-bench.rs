//! Kura's CUDA executor on a model shape with random bf16 weights made on the device (no checkpoint):
//! `gpu-bench CONFIG.json [--divide N] [--within S]` prints one JSON line per figure as it is measured,
//! then the line of all of them. `bench/gpu.sh` runs it beside HF transformers (`bench/gpu/hf_peer.py`)
//! on the same GPU. `--divide N` runs the same sections at a fraction of the lengths below, each figure
//! timed once: `tests/emulated_executor.rs` runs it so on the CPU's stand-in driver.
//!
//! First the figures the GPU is judged by, with the default kernels: batch-1 decode after a 1,024-token
//! prompt (and its share of the HBM bound, weights read once per token over the measured copy bandwidth,
//! null where the copy's buffers could not be made, and over the card's datasheet bandwidth), prefill of 4,096 and 16,384 tokens (TTFT: one step and the
//! first token), the TTFT of a 4,096-token prompt whose first 4,080 tokens are cached, and decode at
//! batch 64 with 1,024 tokens of context each. An error there ends the run.
//!
//! Then the optional sections, newest first: the kernel timing a server runs at its start, the other
//! prefill attention forms at both lengths, batch-1 decode with the decode options (the products' L2
//! window and staged copies, the split-key kernel's prefetch, the fused kernels), batch 4 with them,
//! batch 64 with the fused kernels, the cost of checking drafts of 1 to 15 tokens at batch 1 and 4
//! (speculative decoding), the batch's steps right after a swap-out to the host tier; then those measured
//! on a GPU before (batch 1 without dependent launches and without graphs, the batch's steps while a
//! 16,384-token prefix loads from the host tier, revisits whose KV is only in the host tier); the
//! profiles of single steps; and the fp8 revisit on an executor of its own. With `--within S`, a section
//! whose estimate (from the figures measured before it) would end past S seconds from the start is
//! skipped, and stderr says so. A section that fails is named on stderr at once and at the end (exit 1);
//! the run goes on while the CUDA context still answers, and otherwise ends with what it printed.
//!
//! Times are the executor's: host clock around steps that end in a synchronisation (the token ids back
//! on the host).

use std::error::Error;
use std::io::Write;
use std::time::Instant;

use kura_cuda::executor::LOAD_COPY_MIN_BYTES;
use kura_cuda::{
    CudaExecutor, DevWeights, Device, GemvForm, PoolSpec, PrefillKernel, PrefillProbe,
};
use kura_engine::{SeqInput, Want};
use kura_kv::codec::KvDtype;

const USAGE: &str = "usage: gpu-bench CONFIG.json [--divide N] [--within S]\n  \
    --divide N: every length, batch and step count divided by N (a power of two up to 32): the same \
    sections, smaller, as the emulated device's test runs them\n  \
    --within S: the optional sections that would end past S seconds from the start are skipped";

/// How a decode step runs.
#[derive(Debug, Clone, Copy, Default)]
struct DecodeMode {
    graphs: bool,
    dependent: bool,
    /// The split-key kernel merging its splits itself (and prefetching K and V).
    attention: bool,
    /// The products norming their input.
    norm: bool,
    /// The products' form (`gemv_T`, the L2 window's `gemv_ahead_T`, W staged by `cp.async` in `gemv_batched_T`).
    gemv: GemvForm,
    /// The split-key kernel's prefetch of K and V alone.
    prefetch: bool,
}

impl DecodeMode {
    /// The default: captured graphs with dependent launches, separate kernels.
    const DEFAULT: DecodeMode = DecodeMode {
        graphs: true,
        dependent: true,
        attention: false,
        norm: false,
        gemv: GemvForm::Plain,
        prefetch: false,
    };

    fn apply(&self, gpu: &mut CudaExecutor) {
        gpu.set_graphs(self.graphs);
        gpu.set_dependent_launch(self.dependent);
        gpu.set_fused_parts(self.attention, self.norm);
        gpu.set_gemv(self.gemv);
        gpu.set_split_prefetch(self.prefetch);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % (vocab as u64 - 3)) as u32 + 3
        })
        .collect()
}

/// What the benchmark runs at: token counts, batches and step counts.
#[derive(Clone, Copy, Debug)]
pub struct Lengths {
    /// The context of the batch-1, batch-4 and batch decode figures, and the shortest host-tier
    /// revisit (1,024).
    pub context: usize,
    /// Decode steps timed at batch 1 and 4 (128).
    pub steps: usize,
    /// Steps of each draft check, timed once (32).
    pub draft_steps: usize,
    /// Sequences in the batch decode (64), and its steps (32).
    pub batch: usize,
    pub batch_steps: usize,
    /// The prefills timed (4,096 and 16,384). The longer is also the longest prompt: the block table,
    /// the host tier's bytes, the overlap case's cached part and the profiled prefill.
    pub prefills: [usize; 2],
    /// New tokens after the overlap case's cached part (1,024).
    pub overlap_new: usize,
    /// The activation buffers' reservation (`kura plan`'s defaults: 8,192-token steps over 256
    /// sequences).
    pub reserve_tokens: usize,
    pub reserve_seqs: usize,
    /// Bytes of each of the two device buffers the copy bandwidth is measured over (1 GiB).
    pub copy_bytes: usize,
    /// Each figure timed once, not the median of several runs.
    pub once: bool,
}

impl Lengths {
    /// The figures' lengths.
    pub const FULL: Lengths = Lengths {
        context: 1024,
        steps: 128,
        draft_steps: 32,
        batch: 64,
        batch_steps: 32,
        prefills: [4096, 16_384],
        overlap_new: 1024,
        reserve_tokens: 8192,
        reserve_seqs: 256,
        copy_bytes: 1 << 30,
        once: false,
    };

    /// [`Lengths::FULL`] with each divided by `n`, a power of two up to 32 (the shortest revisit then
    /// still caches a block of 16 tokens); batches and step counts at least 2. Divided (`n` > 1), each
    /// figure is timed once.
    pub fn divided(n: usize) -> Result<Lengths, String> {
        if !n.is_power_of_two() || n > 32 {
            return Err(format!("--divide {n}: a power of two up to 32 is wanted"));
        }
        let f = Lengths::FULL;
        Ok(Lengths {
            context: f.context / n,
            steps: (f.steps / n).max(2),
            draft_steps: (f.draft_steps / n).max(2),
            batch: (f.batch / n).max(2),
            batch_steps: (f.batch_steps / n).max(2),
            prefills: f.prefills.map(|p| p / n),
            overlap_new: f.overlap_new / n,
            reserve_tokens: f.reserve_tokens / n,
            reserve_seqs: (f.reserve_seqs / n).max(2),
            copy_bytes: f.copy_bytes / n,
            once: n > 1,
        })
    }

    /// How many times a figure is timed, whose median is `n` runs: 1 when timed once.
    fn runs(&self, n: usize) -> usize {
        if self.once {
            1
        } else {
            n
        }
    }

    /// The longest prompt.
    fn long(&self) -> usize {
        self.prefills[1]
    }
}

/// The command line: the model config's path, the lengths, and the seconds from the start within
/// which the optional sections must end (none: every section runs).
#[derive(Clone, Debug)]
pub struct Args {
    pub path: String,
    pub lengths: Lengths,
    pub within: Option<f64>,
}

/// `CONFIG.json [--divide N] [--within S]`.
pub fn parse(args: &[String]) -> Result<Args, String> {
    let (path, mut rest) = match args.split_first() {
        Some((path, rest)) if !path.starts_with('-') => (path.clone(), rest),
        _ => return Err(USAGE.into()),
    };
    let mut parsed = Args {
        path,
        lengths: Lengths::FULL,
        within: None,
    };
    while let [flag, value, more @ ..] = rest {
        match flag.as_str() {
            "--divide" => {
                let n = value
                    .parse()
                    .map_err(|_| format!("--divide {value}: not a number\n{USAGE}"))?;
                parsed.lengths = Lengths::divided(n)?;
            }
            "--within" => {
                let s: f64 = value
                    .parse()
                    .ok()
                    .filter(|s: &f64| s.is_finite() && *s > 0.0)
                    .ok_or_else(|| {
                        format!("--within {value}: seconds above 0 are wanted\n{USAGE}")
                    })?;
                parsed.within = Some(s);
            }
            _ => return Err(USAGE.into()),
        }
        rest = more;
    }
    if !rest.is_empty() {
        return Err(USAGE.into());
    }
    Ok(parsed)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args = parse(&args).unwrap_or_else(|e| {
        eprintln!("gpu-bench: {e}");
        std::process::exit(2);
    });
    let out = &mut std::io::stdout().lock();
    if let Err(e) = run(&args.path, &args.lengths, args.within, out) {
        eprintln!("gpu-bench: {e}");
        std::process::exit(1);
    }
}

/// Where the figures go: each JSON line printed as soon as it is measured (a later failure keeps it),
/// and the figures kept for the line of all.
struct Report<'a> {
    out: &'a mut dyn Write,
    figures: Vec<String>,
}

impl Report<'_> {
    /// Prints a line at once.
    fn line(&mut self, line: &str) -> std::io::Result<()> {
        writeln!(self.out, "{line}")?;
        self.out.flush()
    }

    /// Prints a figure's line at once and keeps it for the line of all.
    fn figure(&mut self, line: String) -> std::io::Result<()> {
        self.line(&line)?;
        self.figures.push(line);
        Ok(())
    }
}

/// Writes `line` and a newline to stderr in one write, so that a line does not come out broken by the
/// JSON lines written to stdout into the same log.
fn note(line: &str) {
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// The optional sections' bookkeeping: the time they may take, those that failed, and whether the CUDA
/// context still answers.
struct Optional {
    start: Instant,
    /// Seconds from `start` within which a section must end.
    within: Option<f64>,
    failed: Vec<String>,
    /// Why no section runs any more (the context failed after a section's error).
    stopped: Option<String>,
}

/// A section starts only where this many times its estimate fits in the time left.
const ESTIMATE_MARGIN: f64 = 1.25;

impl Optional {
    /// Whether the section `what`, estimated at `estimate` seconds, runs; stderr says why not.
    fn begin(&self, what: &str, estimate: f64) -> bool {
        if let Some(why) = &self.stopped {
            note(&format!("gpu-bench: skipped {what}: {why}"));
            return false;
        }
        let Some(within) = self.within else {
            return true;
        };
        let left = within - self.start.elapsed().as_secs_f64();
        if estimate * ESTIMATE_MARGIN > left {
            note(&format!(
                "gpu-bench: skipped {what}: about {estimate:.1} s estimated, {:.1} s left of --within {within}",
                left.max(0.0)
            ));
            return false;
        }
        true
    }

    /// Notes how the section `what` ended: a failure is named at once and kept for the end; after one,
    /// a context that no longer synchronises stops the sections after it.
    fn end(&mut self, what: &str, result: Result<(), Box<dyn Error>>, dev: &Device) {
        let Err(e) = result else {
            return;
        };
        note(&format!("gpu-bench: {what} failed: {e}"));
        self.failed.push(format!("{what}: {e}"));
        if let Err(e) = dev.synchronize() {
            let why = format!("the CUDA context failed after {what} ({e})");
            note(&format!("gpu-bench: {why}: no further section runs"));
            self.stopped = Some(why);
        }
    }
}

/// What the figures measured first cost, in seconds: the optional sections' estimates are made of them.
#[derive(Clone, Copy, Debug)]
struct Costs {
    /// A batch-1 decode step at the context.
    step1: f64,
    /// A prefill of the context's tokens, and of each of the two prefills'.
    context_prefill: f64,
    prefill: [f64; 2],
    /// A batch decode step.
    step_batch: f64,
    /// The longest prompt's blocks copied between host and device (at 20 GB/s, less than pinned
    /// memory's).
    host_copy: f64,
    /// Making the weights.
    weights: f64,
}

/// A batch-1 decode figure's line.
struct Decode1 {
    ctx: usize,
    weight_bytes: usize,
    /// Device-to-device copy bandwidth, bytes a second (none where its measurement failed).
    bandwidth: Option<f64>,
    has_dependent: bool,
    card: String,
    datasheet: Option<f64>,
}

impl Decode1 {
    fn line(&self, mode: DecodeMode, tps: f64) -> String {
        let DecodeMode {
            graphs,
            attention,
            norm,
            gemv,
            prefetch,
            ..
        } = mode;
        let (ctx, weight_bytes, card) = (self.ctx, self.weight_bytes, &self.card);
        let gemv = gemv.kernel();
        let dependent = mode.dependent && self.has_dependent;
        let fused = attention && norm;
        let bound = self.bandwidth.map(|b| b / weight_bytes as f64);
        format!(
            "{{\"peer\":\"kura\",\"what\":\"decode\",\"batch\":1,\"context\":{ctx},\"graphs\":{graphs},\
             \"dependent_launch\":{dependent},\"fused\":{fused},\"fused_attention\":{attention},\
             \"fused_norm\":{norm},\"gemv\":{gemv:?},\"split_prefetch\":{prefetch},\
             \"tokens_per_s\":{tps:.1},\"ms_per_token\":{:.3},\"weight_bytes\":{weight_bytes},\
             \"copy_bandwidth_gbs\":{},\"hbm_bound_tokens_per_s\":{},\"fraction_of_bound\":{},\
             \"card\":{card:?},\"datasheet_tbs\":{},\"fraction_of_datasheet_bound\":{}}}",
            1e3 / tps,
            json(self.bandwidth.map(|b| b / 1e9), 0),
            json(bound, 1),
            json(bound.map(|b| tps / b), 3),
            self.datasheet.map_or("null".into(), |b| format!("{b}")),
            json(
                self.datasheet
                    .map(|b| tps / (b * 1e12 / weight_bytes as f64)),
                3
            ),
        )
    }
}

/// Batch-1 decode after the prompt `p` (its KV written again before each mode's steps) in each of
/// `modes`, rounds interleaved: each mode's median tokens a second. Leaves the default mode set, whether
/// the steps ran or failed.
fn decode1_rates(
    gpu: &mut CudaExecutor,
    modes: &[DecodeMode],
    p: &[u32],
    table: &[u32],
    len: &Lengths,
) -> Result<Vec<f64>, Box<dyn Error>> {
    let ctx = p.len();
    let mut rates = vec![Vec::new(); modes.len()];
    let timed = (|| -> Result<(), Box<dyn Error>> {
        for _ in 0..len.runs(3) {
            for (m, mode) in modes.iter().enumerate() {
                mode.apply(gpu);
                let mut next = gpu.forward_greedy(&[SeqInput::new(p, 0, table)])?[0];
                next = gpu.forward_greedy(&[SeqInput::new(&[next], ctx, table)])?[0];
                let t = Instant::now();
                for i in 0..len.steps {
                    next = gpu.forward_greedy(&[SeqInput::new(&[next], ctx + 1 + i, table)])?[0];
                }
                rates[m].push(len.steps as f64 / t.elapsed().as_secs_f64());
            }
        }
        Ok(())
    })();
    DecodeMode::DEFAULT.apply(gpu);
    timed.map(|()| rates.into_iter().map(median).collect())
}

/// Prefills of `n` tokens through each of `kernels`, rounds interleaved: each kernel's times in ms.
/// Leaves the 8-warp kernel set.
fn prefill_times(
    gpu: &mut CudaExecutor,
    kernels: &[PrefillKernel],
    n: usize,
    table: &[u32],
    len: &Lengths,
) -> Result<Vec<Vec<f64>>, Box<dyn Error>> {
    let p = tokens(n, n as u64, gpu.config().vocab_size());
    let mut times = vec![Vec::new(); kernels.len()];
    let timed = (|| -> Result<(), Box<dyn Error>> {
        for _ in 0..len.runs(3) {
            for (&kernel, times) in kernels.iter().zip(times.iter_mut()) {
                gpu.set_prefill_kernel(kernel);
                let t = Instant::now();
                gpu.forward_greedy(&[SeqInput::new(&p, 0, table)])?;
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        Ok(())
    })();
    gpu.set_prefill_kernel(PrefillKernel::Narrow);
    timed.map(|()| times)
}

fn prefill_line(kernel: PrefillKernel, n: usize, times: Vec<f64>) -> String {
    format!(
        "{{\"peer\":\"kura\",\"what\":\"prefill\",\"kernel\":\"{}\",\"tokens\":{n},\"ms\":{:.1},\
         \"runs_ms\":{times:?}}}",
        kernel.name(),
        median(times.clone())
    )
}

/// Batch-4 decode at the context in each of `modes` (each mode's prompts prefilled again), rounds
/// interleaved: one line a mode. Leaves the default mode set, whether the steps ran or failed.
fn decode4(
    gpu: &mut CudaExecutor,
    report: &mut Report<'_>,
    modes: &[DecodeMode],
    (prompts, tables): (&[Vec<u32>], &[Vec<u32>]),
    len: &Lengths,
) -> Result<(), Box<dyn Error>> {
    let ctx = len.context;
    let mut rates = vec![Vec::new(); modes.len()];
    let timed = (|| -> Result<(), Box<dyn Error>> {
        for _ in 0..len.runs(3) {
            for (mode, rates) in modes.iter().zip(rates.iter_mut()) {
                mode.apply(gpu);
                let items: Vec<SeqInput<'_>> = (0..4)
                    .map(|i| SeqInput::new(&prompts[i], 0, &tables[i]))
                    .collect();
                let first = gpu.forward_greedy(&items)?;
                let (_, s) = decode_steps(gpu, tables, first, ctx, len.steps)?;
                rates.push(4.0 * len.steps as f64 / s);
            }
        }
        Ok(())
    })();
    DecodeMode::DEFAULT.apply(gpu);
    timed?;
    for (mode, rates) in modes.iter().zip(rates) {
        report.figure(format!(
            "{{\"peer\":\"kura\",\"what\":\"decode\",\"batch\":4,\"context\":{ctx},\"fused\":{},\
             \"gemv\":{:?},\"split_prefetch\":{},\"tokens_per_s\":{:.1},\"runs\":{rates:.1?}}}",
            mode.attention && mode.norm,
            mode.gemv.kernel(),
            mode.prefetch,
            median(rates.clone())
        ))?;
    }
    Ok(())
}

/// The benchmark on the model config at `path` (weights made at random on device 0), at `len`, its
/// JSON lines written to `out`; the optional sections only where they end within `within` seconds of
/// the start. An error names each section that failed; the lines before it stand.
pub fn run(
    path: &str,
    len: &Lengths,
    within: Option<f64>,
    out: &mut dyn Write,
) -> Result<(), Box<dyn Error>> {
    let start = Instant::now();
    let mut report = Report {
        out,
        figures: Vec::new(),
    };
    let cfg = kura_checkpoint::ModelConfig::from_hf_json(
        &std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?,
    )?;
    let dev = Device::open(0)?;
    report.line(&format!(
        "{{\"device\":\"{}\",\"arch\":\"{}\",\"kernels_compiled_now\":{},\"setup_s\":{:.2}}}",
        dev.name, dev.arch, dev.compiled, dev.setup_seconds
    ))?;
    // Device memory as the planner splits it: what the context, cuBLAS and the kernels take before any
    // weight, then the weights, then the activation buffers (`kura plan`'s reservation).
    let (free0, total) = dev.memory()?;
    let t = Instant::now();
    let w = DevWeights::random(&dev, &cfg, 1)?;
    let (free1, _) = dev.memory()?;
    let weight_bytes = w.bytes;
    let weights_s = t.elapsed().as_secs_f64();
    eprintln!(
        "weights: {:.2} GB made in {weights_s:.2} s",
        weight_bytes as f64 / 1e9
    );
    let bs = 16;
    let (ctx, long) = (len.context, len.long());
    // The batch's sequences, each with its context and steps, plus the longest prompt, in blocks of 16.
    let num_blocks = len.batch * (ctx + len.batch_steps).div_ceil(bs) + long / bs + 64;
    let spec = PoolSpec {
        reserve_tokens: len.reserve_tokens,
        reserve_seqs: len.reserve_seqs,
        ..PoolSpec::new(KvDtype::Bf16, bs, num_blocks)
    };
    // The host tier's bytes for the L2 revisits below (declared before the executor, which unpins
    // them when it closes): the longest prompt's blocks.
    let block_bytes = kura_cuda::block_bytes(&cfg, KvDtype::Bf16, bs);
    let mut host = vec![0u8; long / bs * block_bytes];
    let mut gpu = CudaExecutor::new(dev, cfg.clone(), w, spec)?;
    let (free2, _) = gpu.device().memory()?;
    let pool_bytes = num_blocks * kura_cuda::block_bytes(&cfg, KvDtype::Bf16, bs);
    report.line(&format!(
        "{{\"what\":\"memory\",\"total\":{total},\"context_and_libraries\":{},\"weights\":{},\
         \"weights_counted\":{weight_bytes},\"reserve_tokens\":{},\"reserve_seqs\":{},\"activations\":{},\
         \"activations_estimate\":{},\"pool\":{pool_bytes}}}",
        total - free0,
        free0 - free1,
        len.reserve_tokens,
        len.reserve_seqs,
        (free1 - free2).saturating_sub(pool_bytes),
        CudaExecutor::activation_bytes(&cfg, len.reserve_tokens, len.reserve_seqs)
    ))?;
    let vocab = cfg.vocab_size();

    // Warm-up: every kernel and product shape once.
    let table: Vec<u32> = (0..(long / bs) as u32).collect();
    let p = tokens(ctx, 7, vocab);
    gpu.forward_greedy(&[SeqInput::new(&p, 0, &table)])?;
    gpu.forward_greedy(&[SeqInput::new(&p[..1], ctx, &table)])?;

    // The figures the GPU is judged by, with the default kernels, each printed as it is measured.
    // Batch-1 decode after a 1,024-token prompt: captured graphs with dependent launches, separate
    // kernels; three runs, the median.
    let d = DecodeMode::DEFAULT;
    let tps = decode1_rates(&mut gpu, &[d], &p, &table, len)?[0];
    // The HBM bound of batch-1 decode: the weights read once per token at the measured copy bandwidth.
    // A copy that fails (its two buffers not allocated) leaves the bound null, not the figure unprinted.
    let card = gpu.device().name.clone();
    let bandwidth = copy_bandwidth(gpu.device(), len.copy_bytes)
        .inspect_err(|e| eprintln!("copy bandwidth not measured ({e}): the HBM bound is null"))
        .ok();
    let b1 = Decode1 {
        ctx,
        weight_bytes,
        bandwidth,
        has_dependent: gpu.device().has_dependent_launch(),
        datasheet: datasheet_tbs(&card),
        card,
    };
    report.figure(b1.line(d, tps))?;
    // Prefill TTFT with the default prefill attention kernel (8 warps of 16 query rows).
    let mut prefill_s = [0.0; 2];
    for (n, s) in len.prefills.into_iter().zip(prefill_s.iter_mut()) {
        let times = prefill_times(&mut gpu, &[PrefillKernel::Narrow], n, &table, len)?;
        let times = times.into_iter().next().unwrap_or_default();
        *s = median(times.clone()) / 1e3;
        report.figure(prefill_line(PrefillKernel::Narrow, n, times))?;
    }
    // TTFT of 4,096 tokens with the first 4,080 cached (255 whole blocks).
    let (prompt, cached) = (len.prefills[0], len.prefills[0] - 16);
    let p_cached = tokens(prompt, 99, vocab);
    gpu.forward_greedy(&[SeqInput::new(&p_cached[..cached], 0, &table)])?;
    let mut times = Vec::new();
    for _ in 0..len.runs(10) {
        let t = Instant::now();
        gpu.forward_greedy(&[SeqInput::new(&p_cached[cached..], cached, &table)])?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    report.figure(format!(
        "{{\"peer\":\"kura\",\"what\":\"cached_ttft\",\"prompt\":{prompt},\"cached\":{cached},\"ms\":{:.2},\
         \"runs_ms\":{:?}}}",
        median(times.clone()),
        times.iter().map(|t| (t * 100.0).round() / 100.0).collect::<Vec<_>>()
    ))?;
    // Batch-64 decode at 1,024 tokens of context each, separate kernels.
    let (batch, steps) = (len.batch, len.batch_steps);
    let per = (ctx + steps).div_ceil(bs);
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|i| ((i * per) as u32..((i + 1) * per) as u32).collect())
        .collect();
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|i| tokens(ctx, 1000 + i as u64, vocab))
        .collect();
    let mut first = Vec::new();
    for chunk in (0..batch).collect::<Vec<_>>().chunks(8) {
        let items: Vec<SeqInput<'_>> = chunk
            .iter()
            .map(|i| SeqInput::new(&prompts[*i], 0, &tables[*i]))
            .collect();
        first.extend(gpu.forward_greedy(&items)?);
    }
    let batch_line = |fused: bool, s: f64| {
        format!(
            "{{\"peer\":\"kura\",\"what\":\"decode\",\"batch\":{batch},\"context\":{ctx},\"fused\":{fused},\
             \"tokens_per_s\":{:.0},\"ms_per_step\":{:.2}}}",
            (batch * steps) as f64 / s,
            1e3 * s / steps as f64
        )
    };
    // Each pass from the same tokens writes the same K and V rows, so every batch section reads the
    // same context. One step untimed first, as at batch 1 (it captures the batch's graph), writing the
    // rows the first timed step writes again.
    decode_steps(&mut gpu, &tables, first.clone(), ctx, 1)?;
    let (mut last, s) = decode_steps(&mut gpu, &tables, first.clone(), ctx, steps)?;
    report.figure(batch_line(false, s))?;
    let costs = Costs {
        step1: 1.0 / tps,
        context_prefill: prefill_s[0] * ctx as f64 / len.prefills[0] as f64,
        prefill: prefill_s,
        step_batch: s / steps as f64,
        host_copy: host.len() as f64 / 20e9,
        weights: weights_s,
    };

    // The optional sections: each may fail, or be skipped for time, without losing the figures before
    // it (printed as they came); each is named on stderr where it is.
    let mut opt = Optional {
        start,
        within,
        failed: Vec::new(),
        stopped: None,
    };
    let runs = |n: usize| len.runs(n) as f64;

    // What a server starting on this device runs (`CudaExecutor::tune`, over the shorter prompt:
    // 4,096 tokens, as `kura serve` times them): each prefill form's time over 8 layers and each decode
    // option's time a batch-1 step, and whether each gave the default's bits. It writes the first
    // blocks, which the sections below write again; the kernels go back to the default after.
    let mut tuned = None;
    let what = "the kernel timing (CudaExecutor::tune)";
    if opt.begin(what, 3.0 * costs.prefill[0] + 200.0 * costs.step1 + 1.0) {
        let r = (|| -> Result<(), Box<dyn Error>> {
            let Some(t) = gpu.tune(len.prefills[0])? else {
                return Ok(());
            };
            tuned = Some(t.prefill.chosen);
            let forms: Vec<String> = t
                .prefill
                .forms
                .iter()
                .map(|f| {
                    format!(
                        "{{\"kernel\":\"{}\",\"ms\":{:.3},\"same_bits\":{}}}",
                        f.kernel.name(),
                        f.ms,
                        f.same_bits
                    )
                })
                .collect();
            let options: Vec<String> = t
                .decode
                .options
                .iter()
                .map(|o| {
                    format!(
                        "{{\"options\":\"{}\",\"ms\":{:.3},\"same_bits\":{}}}",
                        o.options.name(),
                        o.ms,
                        o.same_bits
                    )
                })
                .collect();
            report.line(&format!(
                "{{\"what\":\"tuning\",\"tokens\":{},\"layers\":{},\"prefill_chosen\":\"{}\",\
                 \"prefill\":[{}],\"decode_chosen\":\"{}\",\"decode\":[{}]}}",
                t.prefill.tokens,
                t.prefill.layers,
                t.prefill.chosen.name(),
                forms.join(","),
                t.decode.chosen.name(),
                options.join(",")
            ))?;
            Ok(())
        })();
        gpu.set_prefill_kernel(PrefillKernel::Narrow);
        gpu.set_decode_options(kura_cuda::DecodeOptions::default());
        opt.end(what, r, gpu.device());
    }

    // Prefill TTFT through each other prefill attention kernel this device loaded (the wide one, 4
    // warps of 32; half tiles of 4 warps of 16; the small one, half tiles over the wide one's key
    // tiles, three blocks a multiprocessor; the 8-warp and half-tile ones with three stages and one
    // barrier a key tile; those with Hopper's warpgroup products), runs interleaved, each length a
    // section.
    let kernels = loaded_prefill_kernels(&mut gpu, &mut report)?;
    let others: Vec<PrefillKernel> = kernels[1..].to_vec();
    for (n, s) in len.prefills.into_iter().zip(costs.prefill) {
        let what = format!("prefill of {n} tokens through the other kernels");
        if others.is_empty() || !opt.begin(&what, 1.5 * runs(3) * others.len() as f64 * s) {
            continue;
        }
        let r = (|| -> Result<(), Box<dyn Error>> {
            let times = prefill_times(&mut gpu, &others, n, &table, len)?;
            for (&kernel, times) in others.iter().zip(times) {
                report.figure(prefill_line(kernel, n, times))?;
            }
            Ok(())
        })();
        opt.end(&what, r, gpu.device());
    }
    // The same 16,384-token prefill with every key tile masked (what skipping whole tiles' masks saves).
    let what = "the prefill with every key tile masked";
    if std::env::var_os("KURA_BENCH_MASK_AB").is_some()
        && opt.begin(what, runs(3) * 1.5 * costs.prefill[1])
    {
        let r = (|| -> Result<(), Box<dyn Error>> {
            let p = tokens(long, long as u64, vocab);
            gpu.set_mask_all_tiles(true);
            let mut times = Vec::new();
            let timed = (|| -> Result<(), Box<dyn Error>> {
                for _ in 0..len.runs(3) {
                    let t = Instant::now();
                    gpu.forward_greedy(&[SeqInput::new(&p, 0, &table)])?;
                    times.push(t.elapsed().as_secs_f64() * 1e3);
                }
                Ok(())
            })();
            gpu.set_mask_all_tiles(false);
            timed?;
            report.line(&format!(
                "{{\"peer\":\"kura\",\"what\":\"prefill_mask_all\",\"tokens\":{long},\"ms\":{:.1}}}",
                median(times)
            ))?;
            Ok(())
        })();
        opt.end(what, r, gpu.device());
    }

    // Batch-1 decode with the decode options: the products' L2 window (`gemv_ahead`), W staged through
    // shared memory (`gemv_batched`), the split-key kernel's K and V prefetch alone and with each of the
    // two, then the fused decode kernels (both halves, then each alone: the attention's merge, the
    // products' norms); three rounds, the median of each.
    let decode_options = [
        DecodeMode {
            gemv: GemvForm::Ahead,
            ..d
        },
        DecodeMode {
            gemv: GemvForm::Batched,
            ..d
        },
        DecodeMode {
            prefetch: true,
            ..d
        },
        DecodeMode {
            gemv: GemvForm::Ahead,
            prefetch: true,
            ..d
        },
        DecodeMode {
            gemv: GemvForm::Batched,
            prefetch: true,
            ..d
        },
        DecodeMode {
            attention: true,
            norm: true,
            ..d
        },
        DecodeMode {
            attention: true,
            ..d
        },
        DecodeMode { norm: true, ..d },
    ];
    let decode1_estimate = |modes: usize, slower: f64| {
        runs(3)
            * modes as f64
            * (costs.context_prefill + (len.steps + 2) as f64 * costs.step1 * slower)
    };
    let what = "batch-1 decode with the decode options and the fused kernels";
    if opt.begin(what, decode1_estimate(decode_options.len(), 1.2)) {
        let r = (|| -> Result<(), Box<dyn Error>> {
            let rates = decode1_rates(&mut gpu, &decode_options, &p, &table, len)?;
            for (mode, tps) in decode_options.iter().zip(rates) {
                report.figure(b1.line(*mode, tps))?;
            }
            Ok(())
        })();
        opt.end(what, r, gpu.device());
    }

    // Batch-4 decode at 1,024 tokens of context each (the most tokens whose products norm their input
    // themselves in the fused path): separate kernels, fused, then separate with the split-key kernel's
    // prefetch and the products' L2 window, then with W staged; three rounds of the four.
    let per4 = (ctx + len.steps + 32).div_ceil(bs);
    let tables4: Vec<Vec<u32>> = (0..4)
        .map(|i| table[i * per4..(i + 1) * per4].to_vec())
        .collect();
    let prompts4: Vec<Vec<u32>> = (0..4).map(|i| tokens(ctx, 50 + i as u64, vocab)).collect();
    let modes4 = [
        d,
        DecodeMode {
            attention: true,
            norm: true,
            ..d
        },
        DecodeMode {
            gemv: GemvForm::Ahead,
            prefetch: true,
            ..d
        },
        DecodeMode {
            gemv: GemvForm::Batched,
            prefetch: true,
            ..d
        },
    ];
    let what = "batch-4 decode with the decode options and the fused kernels";
    let estimate = runs(3)
        * modes4.len() as f64
        * (4.0 * costs.context_prefill + len.steps as f64 * costs.step1 * 1.5);
    if opt.begin(what, estimate) {
        let r = decode4(&mut gpu, &mut report, &modes4, (&prompts4, &tables4), len);
        opt.end(what, r, gpu.device());
    }

    // Batch-64 decode with the fused kernels, from the same tokens as the separate ones above.
    let what = "batch-64 decode with the fused kernels";
    if opt.begin(what, 1.5 * steps as f64 * costs.step_batch) {
        let r = (|| -> Result<(), Box<dyn Error>> {
            gpu.set_fused_decode(true);
            // One step untimed first, as for the separate kernels.
            let stepped = decode_steps(&mut gpu, &tables, first.clone(), ctx, 1)
                .and_then(|_| decode_steps(&mut gpu, &tables, first.clone(), ctx, steps));
            gpu.set_fused_decode(false);
            let (ids, s) = stepped?;
            last = ids;
            report.figure(batch_line(true, s))?;
            Ok(())
        })();
        opt.end(what, r, gpu.device());
    }

    // Checking drafts (speculative decoding, `forward_tails`): a step of each sequence's last token and
    // `k` draft tokens at 1,024 tokens of context, a greedy token found on the device at every position,
    // against a plain decode step of the same sequences; batch 1 and 4, k = 1, 2, 4 and 7 (a batch-1
    // step within 8 tokens: the matrix-vector products) then 8 and 15 (cuBLAS); 32 steps of each, once.
    // Each draft writes the positions after the context again; the sequences' KV before it stays.
    let draft_ks = [1usize, 2, 4, 7, 8, 15];
    let what = "the draft checks";
    let estimate = costs.context_prefill
        + 2.0 * (1 + draft_ks.len()) as f64 * len.draft_steps as f64 * costs.step1 * 2.0;
    if opt.begin(what, estimate) {
        let r = (|| -> Result<(), Box<dyn Error>> {
            for batch in [1usize, 4] {
                let tables: Vec<&[u32]> = if batch == 1 {
                    vec![&table[..]]
                } else {
                    tables4.iter().map(Vec::as_slice).collect()
                };
                if batch == 1 {
                    gpu.forward_greedy(&[SeqInput::new(&p, 0, &table)])?;
                }
                let drafts: Vec<Vec<u32>> = (0..batch)
                    .map(|i| tokens(16, 90 + i as u64, vocab))
                    .collect();
                let steps = len.draft_steps;
                let items: Vec<SeqInput<'_>> = (0..batch)
                    .map(|i| SeqInput::new(&drafts[i][..1], ctx, tables[i]))
                    .collect();
                let t = Instant::now();
                for _ in 0..steps {
                    gpu.forward_greedy(&items)?;
                }
                let plain = t.elapsed().as_secs_f64() * 1e3 / steps as f64;
                for k in draft_ks {
                    let items: Vec<SeqInput<'_>> = (0..batch)
                        .map(|i| SeqInput::new(&drafts[i][..=k], ctx, tables[i]))
                        .collect();
                    let (wants, tails) = (vec![Want::Argmax; batch], vec![k + 1; batch]);
                    let t = Instant::now();
                    for _ in 0..steps {
                        gpu.forward_tails(&items, &wants, &tails)?;
                    }
                    let ms = t.elapsed().as_secs_f64() * 1e3 / steps as f64;
                    report.figure(format!(
                        "{{\"peer\":\"kura\",\"what\":\"draft_check\",\"batch\":{batch},\"context\":{ctx},\
                         \"draft_tokens\":{k},\"steps\":{steps},\"ms_per_step\":{ms:.3},\
                         \"plain_ms_per_step\":{plain:.3},\"over_plain\":{:.3}}}",
                        ms / plain
                    ))?;
                }
            }
            Ok(())
        })();
        opt.end(what, r, gpu.device());
    }

    // The batch's steps right after a 16,384-token sequence is swapped out to the pinned host tier.
    let pinned = kura_engine::Executor::register_host_region(&mut gpu, &mut host);
    let what = "the steps after a swap-out to the host tier (itl_after_swap_out)";
    let estimate = 20.0 * costs.step_batch + 15.0 * costs.host_copy;
    if pinned && opt.begin(what, estimate) {
        let pos = ctx + steps - 1;
        let r = itl_after_swap_out(&mut gpu, &mut host, &tables, &mut last, pos, len)
            .and_then(|line| Ok(report.figure(line)?));
        opt.end(what, r, gpu.device());
    }

    // Measured on a GPU before. Batch-1 decode with graphs of plain launches, then launch by launch.
    let launches = [
        DecodeMode {
            dependent: false,
            ..d
        },
        DecodeMode {
            graphs: false,
            dependent: false,
            ..d
        },
    ];
    let what = "batch-1 decode without dependent launches and without graphs";
    if opt.begin(what, decode1_estimate(launches.len(), 2.0)) {
        let r = (|| -> Result<(), Box<dyn Error>> {
            let rates = decode1_rates(&mut gpu, &launches, &p, &table, len)?;
            for (mode, tps) in launches.iter().zip(rates) {
                report.figure(b1.line(*mode, tps))?;
            }
            Ok(())
        })();
        opt.end(what, r, gpu.device());
    }
    // The batch's steps while a 16,384-token prefix loads from the host tier into other blocks.
    let what = "the steps beside host-tier loads (itl_while_loading)";
    let estimate = 20.0 * costs.step_batch + 8.0 * costs.host_copy;
    if pinned && opt.begin(what, estimate) && gpu.set_ordered_imports(true) {
        let pos = ctx + steps - 1;
        let r = itl_while_loading(&mut gpu, &host, &tables, &mut last, pos, len)
            .and_then(|line| Ok(report.figure(line)?));
        opt.end(what, r, gpu.device());
    }
    // A revisited prompt whose KV is only in the host tier (L2): its blocks exported to host memory, then
    // brought back one copy a block (as the engine's host tier does) before the last 16 tokens are
    // prefilled. Against the same prompt with its KV still in device memory, one pinned copy of the same
    // bytes, and the cold prefill. Pinned (the host tier of a GPU server) at every length; pageable
    // memory at 4,096 tokens for comparison; then 16,384 cached tokens and 1,024 new ones, where
    // ordered loads let the first layers compute while the later ones are copied.
    let what = "the host-tier revisits (l2_revisit)";
    let [short, long_s] = costs.prefill;
    let estimate = runs(3) * (costs.context_prefill + 2.0 * short + 2.1 * long_s)
        + runs(5) * 5.0 * (4.0 * costs.host_copy + 0.1 * long_s);
    if opt.begin(what, estimate) {
        let r = (|| -> Result<(), Box<dyn Error>> {
            let mut staging = gpu.device().alloc::<u8>(host.len(), "the copy benchmark")?;
            let mut pageable = vec![0u8; len.prefills[0] / bs * block_bytes];
            for (n, in_pinned) in [
                (ctx, true),
                (len.prefills[0], true),
                (long, true),
                (len.prefills[0], false),
            ] {
                let buf: &mut [u8] = if in_pinned { &mut host } else { &mut pageable };
                let host_kind = if in_pinned && pinned {
                    "pinned"
                } else {
                    "pageable"
                };
                let line = l2_revisit(
                    &mut gpu,
                    buf,
                    &mut staging,
                    (n - 16, 16),
                    &table,
                    host_kind,
                    len,
                )?;
                report.figure(line)?;
            }
            let long_table: Vec<u32> = (0..((long + len.overlap_new) / bs) as u32).collect();
            let line = l2_revisit(
                &mut gpu,
                &mut host,
                &mut staging,
                (long, len.overlap_new),
                &long_table,
                if pinned { "pinned" } else { "pageable" },
                len,
            )?;
            report.figure(line)?;
            Ok(())
        })();
        opt.end(what, r, gpu.device());
    }
    let all = format!("[{}]", report.figures.join(","));
    report.line(&all)?;

    // Where a step's time goes, kernel by kernel (launch by launch, host-synchronised per kernel): a
    // batch-1 decode step at 1,024 tokens of context, a batch-64 decode step, a 16,384-token prefill with
    // the 8-warp kernel and with the one the kernel timing chose; then the batch-1 step with the fused
    // kernels, the L2 window and W staged; then the prefill with each timing probe of the 8-warp kernel
    // (its time without the copies, without the softmax, the copies alone, the products alone). Each
    // profile only where its estimate fits the time left.
    if opt.stopped.is_none() {
        let p1 = tokens(ctx, 7, vocab);
        let long_prompt = tokens(long, long as u64, vocab);
        let toks: Vec<[u32; 1]> = last.iter().map(|t| [*t]).collect();
        let b64: Vec<SeqInput<'_>> = (0..batch)
            .map(|i| SeqInput::new(&toks[i], ctx + steps - 1, &tables[i]))
            .collect();
        // (step, prefill kernel, timing probe, inputs, estimated seconds): nothing after the profiles
        // reads the long prompt's KV or tokens (the probes' outputs are not attention).
        let b1_in = || vec![SeqInput::new(&[5], ctx, &table)];
        let long_in = || vec![SeqInput::new(&long_prompt, 0, &table)];
        let narrow = PrefillKernel::Narrow;
        let (e1, e64, elong) = (
            10.0 * costs.step1,
            10.0 * costs.step_batch,
            3.0 * costs.prefill[1],
        );
        let mut profiles = vec![
            ("decode_b1".to_string(), narrow, None, b1_in(), e1),
            ("decode_batch".to_string(), narrow, None, b64, e64),
            ("prefill_long".to_string(), narrow, None, long_in(), elong),
        ];
        if let Some(k) = tuned.filter(|k| *k != narrow) {
            let what = format!("prefill_long_{}", k.name());
            profiles.push((what, k, None, long_in(), elong));
        }
        for form in ["fused", "ahead", "batched"] {
            profiles.push((format!("decode_b1_{form}"), narrow, None, b1_in(), e1));
        }
        for p in PrefillProbe::ALL {
            let what = format!("prefill_long_probe_{}", p.name());
            profiles.push((what, narrow, Some(p), long_in(), elong));
        }
        let what = "the profiles' context (a prefill of its tokens)";
        let r = gpu.forward_greedy(&[SeqInput::new(&p1, 0, &table)]);
        opt.end(what, r.map(|_| ()).map_err(Into::into), gpu.device());
        for (what, kernel, probe, items, estimate) in profiles {
            let section = format!("the profile of {what}");
            if !opt.begin(&section, estimate) {
                continue;
            }
            let r = (|| -> Result<(), Box<dyn Error>> {
                if !gpu.set_prefill_kernel(kernel) {
                    return Err(
                        format!("the {} prefill kernel is not loaded", kernel.name()).into(),
                    );
                }
                if !gpu.set_prefill_probe(probe) {
                    return Err("the prefill probes take a bf16 pool".into());
                }
                gpu.set_fused_decode(what.ends_with("_fused"));
                gpu.set_gemv(if what.ends_with("_ahead") {
                    GemvForm::Ahead
                } else if what.ends_with("_batched") {
                    GemvForm::Batched
                } else {
                    GemvForm::Plain
                });
                gpu.forward_greedy(&items)?;
                let prof = gpu.profile_greedy(&items)?;
                let total: f64 = prof.iter().map(|p| p.1).sum();
                let top: Vec<String> = prof
                    .iter()
                    .take(16)
                    .map(|(k, ms, n)| {
                        format!("{{\"kernel\":\"{k}\",\"ms\":{ms:.3},\"launches\":{n}}}")
                    })
                    .collect();
                report.line(&format!(
                    "{{\"what\":\"profile\",\"step\":\"{what}\",\"tokens\":{},\"total_ms\":{total:.3},\
                     \"top\":[{}]}}",
                    items.iter().map(|i| i.tokens.len()).sum::<usize>(),
                    top.join(",")
                ))?;
                Ok(())
            })();
            gpu.set_prefill_probe(None);
            gpu.set_prefill_kernel(narrow);
            gpu.set_fused_decode(false);
            gpu.set_gemv(GemvForm::Plain);
            opt.end(&section, r, gpu.device());
        }
    }

    // fp8 KV (half the bytes a block moves): the 16,384-token revisit from the host tier again, on a
    // fresh executor with an fp8 pool (the bf16 one and its weights freed first).
    let what = "the fp8 host-tier revisit";
    let estimate = costs.weights + 3.0 * 1.2 * costs.prefill[1] + 10.0 * costs.host_copy;
    if opt.begin(what, estimate) {
        drop(gpu);
        let bb8 = kura_cuda::block_bytes(&cfg, KvDtype::Fp8, bs);
        let mut host8 = vec![0u8; long / bs * bb8];
        let fp8 = (|| -> Result<String, Box<dyn Error>> {
            let dev = Device::open(0)?;
            let w = DevWeights::random(&dev, &cfg, 1)?;
            let spec8 = PoolSpec {
                reserve_tokens: len.reserve_tokens,
                reserve_seqs: len.reserve_seqs,
                ..PoolSpec::new(KvDtype::Fp8, bs, long / bs + 64)
            };
            let mut g8 = CudaExecutor::new(dev, cfg.clone(), w, spec8)?;
            let pinned8 = kura_engine::Executor::register_host_region(&mut g8, &mut host8);
            let mut staging8 = g8.device().alloc::<u8>(host8.len(), "the copy benchmark")?;
            // The executor (which unpins `host8`) goes before it, as `gpu` before `host`.
            l2_revisit(
                &mut g8,
                &mut host8,
                &mut staging8,
                (long - 16, 16),
                &table,
                if pinned8 { "pinned" } else { "pageable" },
                len,
            )
        })();
        match fp8 {
            Ok(line) => report.line(&line)?,
            Err(e) => {
                note(&format!("gpu-bench: {what} failed: {e}"));
                opt.failed.push(format!("{what}: {e}"));
            }
        }
    }
    if opt.failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} section(s) failed:\n  {}",
            opt.failed.len(),
            opt.failed.join("\n  ")
        )
        .into())
    }
}

/// The prefill attention kernels this device loaded: [`PrefillKernel::ALL`] less those that take more
/// shared memory than a block may have there or need sm_90 (the warpgroup products), each of which the
/// report names.
fn loaded_prefill_kernels(
    gpu: &mut CudaExecutor,
    report: &mut Report<'_>,
) -> std::io::Result<Vec<PrefillKernel>> {
    let mut loaded = Vec::new();
    for k in PrefillKernel::ALL {
        if gpu.set_prefill_kernel(k) {
            loaded.push(k);
        } else {
            let why = if k.needs_sm90a() {
                "warpgroup products, sm_90 only"
            } else {
                "more shared memory than a block may have"
            };
            report.line(&format!(
                "prefill kernel {}: not loaded on this device ({why})",
                k.name()
            ))?;
        }
    }
    gpu.set_prefill_kernel(PrefillKernel::Narrow);
    Ok(loaded)
}

/// `steps` greedy decode steps of the sequences with block tables `tables`, from their tokens `last` at
/// position `pos` on: their last tokens, and the seconds the steps took.
fn decode_steps(
    gpu: &mut CudaExecutor,
    tables: &[Vec<u32>],
    mut last: Vec<u32>,
    pos: usize,
    steps: usize,
) -> Result<(Vec<u32>, f64), Box<dyn Error>> {
    let t = Instant::now();
    for step in 0..steps {
        let toks: Vec<[u32; 1]> = last.iter().map(|t| [*t]).collect();
        let items: Vec<SeqInput<'_>> = tables
            .iter()
            .zip(&toks)
            .map(|(table, tok)| SeqInput::new(tok, pos + step, table))
            .collect();
        last = gpu.forward_greedy(&items)?;
    }
    Ok((last, t.elapsed().as_secs_f64()))
}

/// The memory bandwidth a card's datasheet gives, in TB/s, for the cards whose name says which part it
/// is: H200 (HBM3e, 4.8), H100 SXM 80 GB (3.35; "NVIDIA H100 80GB HBM3"), H100 NVL (3.9), H100 PCIe
/// (2.0). Others: none (the table then gives only the share of the measured copy bandwidth).
fn datasheet_tbs(card: &str) -> Option<f64> {
    let c = card.to_ascii_uppercase();
    if c.contains("H200") {
        Some(4.8)
    } else if c.contains("H100") && c.contains("NVL") {
        Some(3.9)
    } else if c.contains("H100") && c.contains("PCIE") {
        Some(2.0)
    } else if c.contains("H100") && c.contains("HBM3") {
        Some(3.35)
    } else {
        None
    }
}

/// A revisited prompt of `cached` tokens (whole blocks of 16) whose KV is only in host memory `buf`,
/// and `new` tokens after them: the cold prefill, the TTFT with the KV still in device memory, the TTFT
/// with its blocks brought back first (one synchronous copy a block), the TTFT with the blocks loaded
/// layer by layer and the step issued at once (ordered loads, the engine's default on CUDA 13; pinned
/// memory only), and one copy of the same bytes into `staging` (medians). One JSON line.
fn l2_revisit(
    gpu: &mut CudaExecutor,
    buf: &mut [u8],
    staging: &mut cudarc::driver::CudaSlice<u8>,
    (cached, new): (usize, usize),
    table: &[u32],
    host_kind: &str,
    len: &Lengths,
) -> Result<String, Box<dyn Error>> {
    use kura_engine::Executor;
    let (bs, vocab) = (16, gpu.config().vocab_size());
    let block_bytes = Executor::block_bytes(gpu);
    let n = cached + new;
    let p = tokens(n, 500 + n as u64, vocab);
    let nb = cached / bs;
    let mut cold = Vec::new();
    for _ in 0..len.runs(3) {
        let t = Instant::now();
        gpu.forward_greedy(&[SeqInput::new(&p, 0, table)])?;
        cold.push(t.elapsed().as_secs_f64() * 1e3);
    }
    for b in 0..nb {
        gpu.try_export_block(b as u32, &mut buf[b * block_bytes..(b + 1) * block_bytes])?;
    }
    let (mut device_ms, mut l2_ms, mut copy_ms) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..len.runs(5) {
        let t = Instant::now();
        gpu.forward_greedy(&[SeqInput::new(&p[cached..], cached, table)])?;
        device_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        for b in 0..nb {
            gpu.try_import_block(b as u32, &buf[b * block_bytes..(b + 1) * block_bytes])?;
        }
        gpu.forward_greedy(&[SeqInput::new(&p[cached..], cached, table)])?;
        l2_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        let mut view = staging.slice_mut(0..nb * block_bytes);
        gpu.device()
            .stream
            .memcpy_htod(&buf[..nb * block_bytes], &mut view)?;
        gpu.device().synchronize()?;
        copy_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    // Ordered loads in copies of the default size, then a layer of a block a copy (for comparison).
    let mut ordered_ms = [Vec::new(), Vec::new()];
    if host_kind == "pinned" && gpu.set_ordered_imports(true) {
        for (times, copy_min) in ordered_ms.iter_mut().zip([LOAD_COPY_MIN_BYTES, 0]) {
            gpu.set_load_copy_min(copy_min);
            for _ in 0..len.runs(5) {
                let t = Instant::now();
                for b in 0..nb {
                    let slot = &buf[b * block_bytes..(b + 1) * block_bytes];
                    if !gpu.try_start_import(b as u32, slot)? {
                        return Err("an ordered load from pinned memory was not started".into());
                    }
                }
                gpu.forward_greedy(&[SeqInput::new(&p[cached..], cached, table)])?;
                times.push(t.elapsed().as_secs_f64() * 1e3);
                await_loads(gpu, nb, &mut Vec::new())?;
            }
        }
        gpu.set_load_copy_min(LOAD_COPY_MIN_BYTES);
    }
    let [ordered_ms, per_layer_ms] = ordered_ms;
    let ordered = (!ordered_ms.is_empty()).then(|| median(ordered_ms));
    let per_layer = (!per_layer_ms.is_empty()).then(|| median(per_layer_ms));
    let (cold, device, l2, copy) = (
        median(cold),
        median(device_ms),
        median(l2_ms),
        median(copy_ms),
    );
    let kv = match gpu.kv_dtype() {
        KvDtype::Fp8 => "fp8",
        KvDtype::F32 => "f32",
        _ => "bf16",
    };
    Ok(format!(
        "{{\"peer\":\"kura\",\"what\":\"l2_revisit\",\"kv\":\"{kv}\",\"tokens\":{n},\"cached\":{cached},\
         \"new\":{new},\"host\":\"{host_kind}\",\"blocks\":{nb},\"block_bytes\":{block_bytes},\
         \"copy_ms\":{copy:.4},\"copy_gbs\":{:.1},\"ttft_device_ms\":{device:.2},\"ttft_l2_ms\":{l2:.2},\
         \"ttft_l2_ordered_ms\":{},\"ttft_l2_ordered_per_layer_ms\":{},\"ttft_cold_ms\":{cold:.1},\
         \"l2_over_copy_plus_device\":{:.3},\"ordered_over_copy_plus_device\":{},\
         \"ordered_over_max_copy_device\":{},\"speedup_over_cold\":{:.2}}}",
        (nb * block_bytes) as f64 / copy / 1e6,
        json(ordered, 2),
        json(per_layer, 2),
        l2 / (copy + device),
        json(ordered.map(|o| o / (copy + device)), 3),
        json(ordered.map(|o| o / copy.max(device)), 3),
        cold / l2.min(ordered.unwrap_or(f64::INFINITY))
    ))
}

/// A JSON number with `decimals` decimals, or `null` for a figure not measured.
fn json(x: Option<f64>, decimals: usize) -> String {
    x.map_or("null".into(), |x| format!("{x:.decimals$}"))
}

/// Inter-token latency of a decoding batch (`tables`, each sequence's next token in `last`, stepped at
/// position `pos` again and again) while a prefix of `host`'s blocks loads from the pinned host tier into
/// other blocks, as ordered loads on the transfer stream: step times alone; beside the copies, the loading
/// request not in the steps; and the one step that also holds the loading request's last 16 tokens (which
/// waits for each layer's copies, and so do the batch's sequences in it). Medians of 3 loads. One JSON
/// line.
fn itl_while_loading(
    gpu: &mut CudaExecutor,
    host: &[u8],
    tables: &[Vec<u32>],
    last: &mut Vec<u32>,
    pos: usize,
    len: &Lengths,
) -> Result<String, Box<dyn Error>> {
    use kura_engine::Executor;
    use std::time::Duration;
    let (bs, vocab) = (16, gpu.config().vocab_size());
    let block_bytes = Executor::block_bytes(gpu);
    let nb = host.len() / block_bytes;
    let first = tables.iter().flatten().max().map_or(0, |b| b + 1);
    if first as usize + nb + 1 > gpu.num_blocks() {
        return Err("the pool has no room for the loading prefix beside the batch".into());
    }
    let load_table: Vec<u32> = (first..first + nb as u32 + 1).collect();
    let batch = tables.len();
    let step = |gpu: &mut CudaExecutor, last: &mut Vec<u32>, extra: Option<SeqInput<'_>>| {
        batch_step(gpu, tables, last, pos, extra)
    };
    let start_loads = |gpu: &mut CudaExecutor| -> Result<(), Box<dyn Error>> {
        for (b, &dst) in load_table[..nb].iter().enumerate() {
            if !gpu.try_start_import(dst, &host[b * block_bytes..(b + 1) * block_bytes])? {
                return Err("an ordered load from pinned memory was not started".into());
            }
        }
        Ok(())
    };
    let alone: Vec<f64> = (0..len.runs(10))
        .map(|_| step(gpu, last, None))
        .collect::<Result<_, _>>()?;
    let p = tokens(nb * bs + 16, 4242, vocab);
    let (mut beside, mut beside_max, mut with_request, mut copy) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..len.runs(3) {
        start_loads(gpu)?;
        let mut done = Vec::new();
        let mut times = Vec::new();
        let started = Instant::now();
        while done.len() < nb {
            loads_not_overdue(started, done.len(), nb)?;
            times.push(step(gpu, last, None)?);
            gpu.try_imports_done(Duration::ZERO, &mut done)?;
        }
        copy.push(done.iter().map(|d| d.1.as_secs_f64()).sum::<f64>() * 1e3);
        beside_max.push(times.iter().copied().fold(0f64, f64::max));
        beside.push(median(times));
        start_loads(gpu)?;
        let extra = SeqInput::new(&p[nb * bs..], nb * bs, &load_table);
        with_request.push(step(gpu, last, Some(extra))?);
        await_loads(gpu, nb, &mut Vec::new())?;
    }
    Ok(format!(
        "{{\"peer\":\"kura\",\"what\":\"itl_while_loading\",\"batch\":{batch},\"prefix_tokens\":{},\
         \"copy_ms\":{:.2},\"step_ms_alone\":{:.2},\"step_ms_beside_loads\":{:.2},\
         \"step_ms_beside_loads_max\":{:.2},\"step_ms_with_loading_request\":{:.2}}}",
        nb * bs,
        median(copy),
        median(alone),
        median(beside),
        median(beside_max),
        median(with_request)
    ))
}

/// One decode step of a batch (`tables`, each sequence's next token in `last`, at position `pos`), with
/// `extra` in the same step: its time in ms (the host's, token ids read back); `last` becomes the batch's
/// next tokens.
fn batch_step(
    gpu: &mut CudaExecutor,
    tables: &[Vec<u32>],
    last: &mut Vec<u32>,
    pos: usize,
    extra: Option<SeqInput<'_>>,
) -> Result<f64, Box<dyn Error>> {
    let batch = tables.len();
    let toks: Vec<[u32; 1]> = last.iter().map(|t| [*t]).collect();
    let mut items: Vec<SeqInput<'_>> = (0..batch)
        .map(|i| SeqInput::new(&toks[i], pos, &tables[i]))
        .collect();
    items.extend(extra);
    let t = Instant::now();
    let ids = gpu.forward_greedy(&items)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    *last = ids[..batch].to_vec();
    Ok(ms)
}

/// Inter-token latency of a decoding batch (as [`itl_while_loading`]) right after a swap-out: stores of
/// the `host.len() / block_bytes` blocks after the batch's (a 16,384-token sequence) into the pinned host
/// tier, started tail first as the engine asks for them, then at once a step of the batch, which writes
/// none of them; and the same with the step also writing the block stored first (as the step that
/// reuses the first block the pool evicts does). Each against the copies' time (the host fence after
/// starting them) and the step alone. Then both directions at once: whole-block loads of half the
/// swapped blocks' bytes into other blocks, alone and started right after the stores of the other half
/// (loads and stores run on streams of their own: PCIe carries both at once, and the loads do not
/// queue behind the stores). Medians of 3. One JSON line.
fn itl_after_swap_out(
    gpu: &mut CudaExecutor,
    host: &mut [u8],
    tables: &[Vec<u32>],
    last: &mut Vec<u32>,
    pos: usize,
    len: &Lengths,
) -> Result<String, Box<dyn Error>> {
    use kura_engine::Executor;
    let block_bytes = Executor::block_bytes(gpu);
    let nb = host.len() / block_bytes;
    let first = tables.iter().flatten().max().map_or(0, |b| b + 1);
    if nb == 0 || first as usize + nb > gpu.num_blocks() {
        return Err("the pool has no room for the swapped-out sequence beside the batch".into());
    }
    // Tail first, each block into its own slot.
    let start_stores = |gpu: &mut CudaExecutor, host: &mut [u8]| -> Result<(), Box<dyn Error>> {
        for (b, slot) in host.chunks_exact_mut(block_bytes).enumerate().rev() {
            if !gpu.try_start_export(first + b as u32, slot)? {
                return Err("a store into pinned memory was not started".into());
            }
        }
        Ok(())
    };
    let stored_first = first + nb as u32 - 1;
    let mut saved = vec![0u8; block_bytes];
    gpu.try_export_block(stored_first, &mut saved)?;
    let alone: Vec<f64> = (0..len.runs(10))
        .map(|_| batch_step(gpu, tables, last, pos, None))
        .collect::<Result<_, _>>()?;
    let reuse_tok = [last[0]];
    let reuse_table = [stored_first];
    let (mut copy, mut after, mut reusing) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..len.runs(3) {
        let t = Instant::now();
        start_stores(gpu, host)?;
        gpu.try_stores_fence()?;
        copy.push(t.elapsed().as_secs_f64() * 1e3);
        start_stores(gpu, host)?;
        after.push(batch_step(gpu, tables, last, pos, None)?);
        gpu.try_stores_fence()?;
        start_stores(gpu, host)?;
        let extra = SeqInput::new(&reuse_tok, 0, &reuse_table);
        reusing.push(batch_step(gpu, tables, last, pos, Some(extra))?);
        gpu.try_stores_fence()?;
        // The block the step wrote, as it was (its store holds it).
        gpu.try_import_block(stored_first, &saved)?;
    }
    let (load_alone, load_beside, half_store) = loads_beside_stores(gpu, host, first, nb, len)?;
    Ok(format!(
        "{{\"peer\":\"kura\",\"what\":\"itl_after_swap_out\",\"batch\":{},\"swapped_tokens\":{},\
         \"store_ms\":{:.2},\"step_ms_alone\":{:.2},\"step_ms_after_stores\":{:.2},\
         \"step_ms_reusing_first_stored\":{:.2},\"duplex_blocks\":{},\"duplex_store_ms\":{:.2},\
         \"load_ms_alone\":{:.2},\"load_ms_beside_stores\":{:.2}}}",
        tables.len(),
        nb * 16,
        median(copy),
        median(alone),
        median(after),
        median(reusing),
        nb / 2,
        half_store,
        load_alone,
        load_beside
    ))
}

/// Whole-block loads of the second half of `host`'s `nb` slots into pool blocks `first..` (the first
/// half of the swapped blocks), alone and started right after the stores of blocks `first + nb / 2..`
/// into the first half's slots: (load ms alone, load ms beside the stores, the stores' ms alone),
/// medians of 3, each load timed from its start to the last one reported. The two share no block
/// and no slot, so nothing orders one after the other.
fn loads_beside_stores(
    gpu: &mut CudaExecutor,
    host: &mut [u8],
    first: u32,
    nb: usize,
    len: &Lengths,
) -> Result<(f64, f64, f64), Box<dyn Error>> {
    use kura_engine::Executor;
    let block_bytes = Executor::block_bytes(gpu);
    let half = nb / 2;
    if half == 0 {
        return Err("too few blocks to load and store at once".into());
    }
    let ordered = gpu.set_ordered_imports(false);
    let (stored_slots, load_slots) = host.split_at_mut(half * block_bytes);
    let loads = |gpu: &mut CudaExecutor| -> Result<f64, Box<dyn Error>> {
        let t = Instant::now();
        for (i, slot) in load_slots.chunks_exact(block_bytes).take(half).enumerate() {
            if !gpu.try_start_import(first + i as u32, slot)? {
                return Err("a load from pinned memory was not started".into());
            }
        }
        let mut done = Vec::new();
        await_loads(gpu, half, &mut done)?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    let mut stores = |gpu: &mut CudaExecutor| -> Result<(), Box<dyn Error>> {
        for (i, slot) in stored_slots.chunks_exact_mut(block_bytes).enumerate() {
            if !gpu.try_start_export(first + (half + i) as u32, slot)? {
                return Err("a store into pinned memory was not started".into());
            }
        }
        Ok(())
    };
    let (mut alone, mut beside, mut store) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..len.runs(3) {
        alone.push(loads(gpu)?);
        let t = Instant::now();
        stores(gpu)?;
        gpu.try_stores_fence()?;
        store.push(t.elapsed().as_secs_f64() * 1e3);
        stores(gpu)?;
        beside.push(loads(gpu)?);
        gpu.try_stores_fence()?;
    }
    gpu.set_ordered_imports(ordered);
    Ok((median(alone), median(beside), median(store)))
}

/// How long a benchmark waits for started host-tier loads to be reported before it gives up (their
/// copies take milliseconds): a load never reported is an error, not a hang.
const LOADS_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// An error once [`LOADS_DEADLINE`] has passed since `started` with `reported` of `n` started loads
/// reported.
fn loads_not_overdue(started: Instant, reported: usize, n: usize) -> Result<(), Box<dyn Error>> {
    if started.elapsed() > LOADS_DEADLINE {
        return Err(format!(
            "{reported} of {n} started loads reported after {} s",
            LOADS_DEADLINE.as_secs()
        )
        .into());
    }
    Ok(())
}

/// Waits until `n` started host-tier loads are reported into `done` (at most [`LOADS_DEADLINE`]).
fn await_loads(
    gpu: &mut CudaExecutor,
    n: usize,
    done: &mut Vec<(u32, std::time::Duration)>,
) -> Result<(), Box<dyn Error>> {
    let started = Instant::now();
    while done.len() < n {
        loads_not_overdue(started, done.len(), n)?;
        gpu.try_imports_done(std::time::Duration::from_millis(50), done)?;
    }
    Ok(())
}

/// Device-to-device copy bandwidth (bytes read plus written per second) of a buffer of `n` bytes into
/// another: the HBM figure the decode bound divides by.
fn copy_bandwidth(dev: &Device, n: usize) -> Result<f64, Box<dyn Error>> {
    let a = dev.alloc::<u8>(n, "the copy benchmark")?;
    let mut b = dev.alloc::<u8>(n, "the copy benchmark")?;
    dev.stream.memcpy_dtod(&a, &mut b)?;
    dev.synchronize()?;
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        dev.stream.memcpy_dtod(&a, &mut b)?;
        dev.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * n as f64 / median(times))
}
