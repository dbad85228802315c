//! `kura generate`: runs one prompt through the model on the CPU (or a GPU, `--device cuda`), streams the
//! text, and reports load time, time to first token, inter-token latency and prompt/decode throughput
//! (`--json` for machines).
//!
//! With `--no-kv-cache` every step recomputes the whole sequence from scratch (the classic comparison
//! that shows what the KV cache buys); otherwise the prompt is prefilled once and each new token is one
//! decode step over the cached blocks.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::bail;
use clap::Args;
use kura_engine::{Sampler, SamplingParams};
use kura_kv::codec::KvDtype;
use kura_model::{ChatMessage, IncrementalDecoder, SoloRun, WeightsDtype};
use serde::Serialize;

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// A GGUF file or an HF directory (default: the model fetched by scripts/fetch-model.sh, or $KURA_MODEL).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as a user message with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Worker threads (default: one per physical core this process may use).
    #[arg(long)]
    pub threads: Option<usize>,
    /// `cpu` (default), or `cuda` / `cuda:N`: the forward pass on GPU N (Llama-family models, bf16
    /// weights, bf16, f32 or fp8 KV; `--weights-dtype` and `--no-kv-cache` are the CPU's).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Recompute the whole sequence at every step instead of reusing K/V.
    #[arg(long)]
    pub no_kv_cache: bool,
    /// Tokens per KV block (1..=1024).
    #[arg(long, default_value_t = 16, value_parser = crate::setup::block_size_arg)]
    pub block_size: usize,
    /// Element format of stored K/V: bf16 (default), f16, f32, or quantised int8, fp8
    /// (e4m3) or int4.
    #[arg(long, default_value = "bf16")]
    pub kv_dtype: KvDtype,
    /// Weights format of the forward pass: native (default: a GGUF's block formats kept packed and
    /// multiplied as integers, the fastest; a float checkpoint in bf16), bf16 or f32.
    #[arg(long, default_value = "native")]
    pub weights_dtype: WeightsDtype,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating past end-of-sequence tokens (for fixed-length measurements).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print the figures as one JSON object on stdout instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    weights_dtype: String,
    /// Bytes of weights a decode step reads: with the measured memory bandwidth, the bound on decode.
    weight_bytes_per_token: usize,
    kv_dtype: String,
    /// `cpu`, or `cuda:N` for a run on GPU `N`.
    device: String,
    /// Compute threads of a CPU run; none (`null`) on a GPU.
    threads: Option<usize>,
    kv_cache: bool,
    block_size: usize,
    load_ms: f64,
    prompt_tokens: usize,
    generated_tokens: usize,
    ttft_ms: f64,
    itl_ms_median: f64,
    itl_ms_mean: f64,
    prompt_tok_per_s: f64,
    decode_tok_per_s: f64,
    total_ms: f64,
    /// Times the compute threads of a CPU run gave their core away instead of spinning; none (`null`)
    /// on a GPU.
    gave_way: Option<GaveWay>,
    /// The team size of decode steps that the compute threads' trials settled on; none (`null`) on a
    /// GPU.
    pace: Option<Pace>,
    text: String,
}

/// Where the pacing of steps of few tokens stands (`kura_model::kernels::pace`).
#[derive(Debug, Serialize)]
struct Pace {
    /// Threads in the pool.
    threads: usize,
    /// The team size of decode steps outside trials.
    size: usize,
    /// Trials judged, and of those, the ones whose size was kept.
    trials: u64,
    changes: u64,
    /// Steps run on a trial's size.
    trial_steps: u64,
}

/// Times the compute threads gave their core away instead of spinning (`kura_model::kernels::seats`).
#[derive(Debug, Serialize)]
struct GaveWay {
    /// To a teammate running on the same CPU.
    same_cpu: u64,
    /// Between steps, from a core shared with a busy process to a teammate with a core of its own.
    shared_core: u64,
}

/// Where the forward pass runs.
enum Runner<'a> {
    Cpu(SoloRun<'a>),
    Gpu(Box<crate::gpu::GpuRun>),
}

impl Runner<'_> {
    /// Samples the next token from the logits after the last one.
    fn next(&mut self, sampler: &mut Sampler) -> anyhow::Result<u32> {
        Ok(match self {
            Runner::Cpu(r) => sampler.sample(r.next_logits()?.row(0)).token,
            Runner::Gpu(r) => r.next(sampler)?,
        })
    }

    fn push(&mut self, token: u32) -> anyhow::Result<()> {
        match self {
            Runner::Cpu(r) => r.push(token)?,
            Runner::Gpu(r) => r.push(token),
        }
        Ok(())
    }

    fn tokens(&self) -> &[u32] {
        match self {
            Runner::Cpu(r) => r.tokens(),
            Runner::Gpu(r) => r.tokens(),
        }
    }
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    crate::setup::threads(args.threads)?;
    let path = crate::setup::model_path(args.model.as_ref())?;
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        ..SamplingParams::default()
    };
    sampling.validate().map_err(anyhow::Error::msg)?;

    let device =
        kura_cuda::parse_device(&args.device).map_err(|e| anyhow::anyhow!("--device: {e}"))?;
    if device.is_some() && args.no_kv_cache {
        bail!("--no-kv-cache runs on the CPU only; leave out --device");
    }
    if device.is_some() {
        crate::gpu::check_weights(args.weights_dtype)?;
        crate::gpu::check_pool(args.kv_dtype, args.block_size)?;
    }
    let t_load = Instant::now();
    // The CPU model, or the file opened once for a GPU (its weights go to the device below).
    let (model, parts) = match device {
        Some(_) => (None, Some(kura_model::ModelParts::open(&path)?)),
        None => (
            Some(crate::setup::load_model(&path, args.weights_dtype)?),
            None,
        ),
    };
    let text_side: &kura_model::ModelText = match (&model, &parts) {
        (Some(m), _) => m.text(),
        (None, Some(p)) => &p.text,
        (None, None) => unreachable!("one of the two is loaded"),
    };
    let tok = &text_side.tokenizer;
    let prompt = if args.chat {
        text_side.chat_template.encode(
            tok,
            &[ChatMessage::new("user", args.prompt.clone())],
            true,
        )?
    } else {
        tok.encode(&args.prompt, true)?
    };
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let mut run = match (&model, &parts, device) {
        (Some(m), _, _) => Runner::Cpu(SoloRun::new(
            m,
            &prompt,
            args.max_tokens,
            args.kv_dtype,
            args.block_size,
            !args.no_kv_cache,
        )?),
        (None, Some(p), Some(ordinal)) => Runner::Gpu(Box::new(crate::gpu::GpuRun::new(
            ordinal,
            &path,
            p,
            &prompt,
            args.max_tokens,
            args.kv_dtype,
            args.block_size,
        )?)),
        _ => unreachable!("the CPU model, or the opened file and a GPU"),
    };
    let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
    let mut sampler = Sampler::new(sampling, &prompt);
    let mut decoder = IncrementalDecoder::new();
    let mut text = String::new();
    let mut stdout = std::io::stdout();
    if !args.json {
        eprintln!(
            "loaded {} in {load_ms:.0} ms; prompt {} tokens",
            path.display(),
            prompt.len()
        );
    }

    let t_start = Instant::now();
    let mut step_ms = Vec::with_capacity(args.max_tokens);
    let mut ttft_ms = 0.0;
    for i in 0..args.max_tokens {
        let t_step = Instant::now();
        let next = run.next(&mut sampler)?;
        let ms = t_step.elapsed().as_secs_f64() * 1e3;
        if i == 0 {
            ttft_ms = ms;
        } else {
            step_ms.push(ms);
        }
        if !args.ignore_eos && tok.is_stop_token(next) {
            break;
        }
        run.push(next)?;
        let piece = decoder.push(tok, next)?;
        text.push_str(&piece);
        if !args.json {
            write!(stdout, "{piece}")?;
            stdout.flush()?;
        }
    }
    let tail = decoder.flush(tok)?;
    text.push_str(&tail);
    let total_ms = t_start.elapsed().as_secs_f64() * 1e3;
    if !args.json {
        writeln!(stdout, "{tail}")?;
    }

    let generated = run.tokens().len() - prompt.len();
    let decode_ms: f64 = step_ms.iter().sum();
    let mut sorted = step_ms.clone();
    sorted.sort_by(f64::total_cmp);
    let median = if sorted.is_empty() {
        0.0
    } else {
        sorted[sorted.len() / 2]
    };
    let report = Report {
        model: path.display().to_string(),
        weights_dtype: match (&model, &run) {
            (Some(m), _) => m.weights_dtype().name().to_string(),
            _ => "bf16 (cuda)".to_string(),
        },
        weight_bytes_per_token: match (&model, &run) {
            (Some(m), _) => m.weight_bytes_per_token(),
            (_, Runner::Gpu(r)) => r.weight_bytes(),
            (None, Runner::Cpu(_)) => unreachable!("a CPU runner runs the CPU model"),
        },
        kv_dtype: args.kv_dtype.to_string(),
        device: match device {
            Some(n) => format!("cuda:{n}"),
            None => "cpu".to_string(),
        },
        threads: device.is_none().then(kura_model::num_threads),
        kv_cache: !args.no_kv_cache,
        block_size: args.block_size,
        load_ms,
        prompt_tokens: prompt.len(),
        generated_tokens: generated,
        ttft_ms,
        itl_ms_median: median,
        itl_ms_mean: if step_ms.is_empty() {
            0.0
        } else {
            decode_ms / step_ms.len() as f64
        },
        prompt_tok_per_s: prompt.len() as f64 / (ttft_ms / 1e3),
        decode_tok_per_s: if decode_ms > 0.0 {
            step_ms.len() as f64 / (decode_ms / 1e3)
        } else {
            0.0
        },
        total_ms,
        gave_way: device.is_none().then(|| {
            let (same_cpu, shared_core) = kura_model::kernels::seats::gave_way();
            GaveWay {
                same_cpu,
                shared_core,
            }
        }),
        pace: device
            .is_none()
            .then(kura_model::kernels::roster::global_pace)
            .flatten()
            .map(|p| Pace {
                threads: p.threads,
                size: p.size,
                trials: p.trials,
                changes: p.changes,
                trial_steps: p.trial_steps,
            }),
        text,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        eprintln!(
            "load {:.0} ms | prompt {} tok, TTFT {:.1} ms ({:.1} tok/s) | {} tok generated, ITL median {:.2} ms, decode {:.1} tok/s | {}, weights {}, kv {}{}",
            report.load_ms,
            report.prompt_tokens,
            report.ttft_ms,
            report.prompt_tok_per_s,
            report.generated_tokens,
            report.itl_ms_median,
            report.decode_tok_per_s,
            match report.threads {
                Some(n) => format!("{n} threads"),
                None => report.device.clone(),
            },
            report.weights_dtype,
            report.kv_dtype,
            if report.kv_cache { "" } else { ", no KV cache" },
        );
    }
    Ok(())
}
