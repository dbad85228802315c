//! `kura perplexity`: what a KV format costs in quality, measured on a text.
//!
//! The text is tokenized whole and cut into chunks of `--context` tokens. Each chunk is computed from an
//! empty cache, in pieces of at most [`PIECE`] tokens, so every piece attends over the K and V that earlier
//! pieces stored in the format under test (as a served request reads its cached blocks). As in llama.cpp's
//! `llama-perplexity`, the first half of a chunk is context only; each token of the second half is scored
//! on how well the logits before it predicted it.
//!
//! The reference is the same model with f32 KV, run over the same chunks in lockstep. For each format the
//! report gives the perplexity (`exp` of the mean negative log-likelihood), its change against the
//! reference, the mean KL divergence `KL(p_ref ‖ p)` of the next-token distributions (nats), and the share
//! of positions whose most likely next token is the reference's (top-1 agreement).
//!
//! With `--device cuda[:N]` the passes run on a GPU (bf16, f32 or fp8 KV), each format's executor with its
//! own copy of the weights; a piece is one step that returns every position's logits, through the
//! prefill attention kernel as a served prompt of that length would be.
//!
//! Cost: one forward pass of every chunk per format (the reference included), plus O(vocab) per scored
//! position and format for the log-softmax and the divergence.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use kura_kv::codec::KvDtype;

use kura_kv::storage::KvStorage;
use kura_model::{Logits, Model, ModelConfig, ModelParts, SeqBatchItem, WeightsDtype};
use serde::Serialize;

/// Tokens per forward call within a chunk.
const PIECE: usize = 512;
/// The most bytes read from `--text`: wikitext-103's whole training split is about 540 MB.
const TEXT_MAX_BYTES: u64 = 1 << 30;

#[derive(Debug, Args)]
pub struct PerplexityArgs {
    /// A GGUF file or an HF directory (default: the model fetched by scripts/fetch-model.sh, or $KURA_MODEL).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The text to score, UTF-8 (scripts/fetch-eval-text.sh fetches the one docs/quantized-kv.md's figures use).
    #[arg(long)]
    pub text: PathBuf,
    /// Tokens per chunk; the second half of each chunk is scored.
    #[arg(long, default_value_t = 512)]
    pub context: usize,
    /// KV formats to measure against the f32 reference, comma-separated (f32, f16, bf16, fp8, int8, int4).
    #[arg(long, default_value = "bf16", value_delimiter = ',')]
    pub kv_dtype: Vec<KvDtype>,
    /// Weights format of the forward pass: native (default: a GGUF's block formats kept packed and
    /// multiplied as integers, the fastest; a float checkpoint in bf16), bf16 or f32.
    #[arg(long, default_value = "native")]
    pub weights_dtype: WeightsDtype,
    /// Score at most this many chunks (default: every whole chunk of the text).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Tokens per KV block (1..=1024).
    #[arg(long, default_value_t = 16, value_parser = crate::setup::block_size_arg)]
    pub block_size: usize,
    /// Worker threads (default: one per physical core this process may use).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where the passes run: cpu, or cuda[:N] (a GPU: bf16, f32 or fp8 KV, and bf16 weights; each
    /// format's pass holds its own copy of the weights on the device).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Print the report as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    text: String,
    text_tokens: usize,
    context: usize,
    chunks: usize,
    scored_tokens: u64,
    weights_dtype: String,
    reference_kv_dtype: KvDtype,
    reference_perplexity: f64,
    formats: Vec<FormatReport>,
    seconds: f64,
}

#[derive(Debug, Serialize)]
struct FormatReport {
    kv_dtype: KvDtype,
    kv_bytes_per_token: u64,
    perplexity: f64,
    /// (perplexity / reference − 1) × 100.
    perplexity_change_pct: f64,
    /// Mean KL(p_ref ‖ p) over the scored positions, in nats.
    kl_mean: f64,
    /// Largest KL at one position.
    kl_max: f64,
    /// Share of scored positions whose argmax is the reference's.
    top1_agreement: f64,
}

/// Running sums of one format.
#[derive(Default, Clone)]
struct Sums {
    nll: f64,
    kl: f64,
    kl_max: f64,
    agree: u64,
}

/// `log Σ e^x` and the index of the largest `x`.
fn log_sum_exp(row: &[f32]) -> (f32, usize) {
    let (mut best, mut m) = (0, f32::NEG_INFINITY);
    for (i, &x) in row.iter().enumerate() {
        if x > m {
            (best, m) = (i, x);
        }
    }
    let s: f32 = row.iter().map(|x| (x - m).exp()).sum();
    (m + s.ln(), best)
}

/// What the passes run on: the CPU model, or the file opened once for GPU `ordinal` (each format's
/// executor loads the weights from it).
enum Source {
    Cpu(Box<Model>),
    Gpu {
        ordinal: usize,
        path: PathBuf,
        parts: Box<ModelParts>,
    },
}

impl Source {
    fn config(&self) -> &ModelConfig {
        match self {
            Source::Cpu(m) => m.config(),
            Source::Gpu { parts, .. } => &parts.config,
        }
    }

    fn tokenizer(&self) -> &kura_model::Tokenizer {
        match self {
            Source::Cpu(m) => m.tokenizer(),
            Source::Gpu { parts, .. } => &parts.text.tokenizer,
        }
    }

    fn weights_dtype(&self) -> String {
        match self {
            Source::Cpu(m) => m.weights_dtype().name().to_string(),
            Source::Gpu { ordinal, .. } => format!("bf16 (cuda:{ordinal})"),
        }
    }

    /// One format's pass over chunks of `context` tokens in blocks of `block_size`.
    fn run(&self, dtype: KvDtype, block_size: usize, context: usize) -> Result<Run<'_>> {
        let blocks = context.div_ceil(block_size);
        let table = (0..blocks as u32).collect();
        let layout = self.config().kv_layout(dtype, block_size)?;
        Ok(match self {
            Source::Cpu(model) => Run::Cpu {
                model,
                kv: model
                    .kv_storage(&layout, blocks)
                    .with_context(|| format!("allocating {dtype} KV for {context} tokens"))?,
                table,
            },
            Source::Gpu {
                ordinal,
                path,
                parts,
            } => {
                let setup =
                    crate::gpu::GpuSetup::load(*ordinal, path, parts, dtype, block_size, PIECE, 1)?;
                let exec = setup.executor(&layout, blocks).with_context(|| {
                    format!("{dtype} KV for {context} tokens on cuda:{ordinal}")
                })?;
                Run::Gpu {
                    exec: Box::new(exec),
                    table,
                    vocab: parts.config.vocab_size(),
                }
            }
        })
    }
}

/// One format's KV for a chunk, and what computes it: the CPU model over its storage, or a GPU executor
/// with its own pool; each with the block table over the chunk.
enum Run<'m> {
    Cpu {
        model: &'m Model,
        kv: KvStorage,
        table: Vec<u32>,
    },
    Gpu {
        exec: Box<kura_cuda::CudaExecutor>,
        table: Vec<u32>,
        vocab: usize,
    },
}

impl Run<'_> {
    /// Computes `piece` at positions `start..` over this format's KV; the logits of every position.
    fn forward(&mut self, piece: &[u32], start: usize) -> Result<Logits> {
        match self {
            Run::Cpu { model, kv, table } => Ok(model.forward_every_position(
                &[SeqBatchItem {
                    tokens: piece,
                    start_pos: start,
                    block_table: table,
                    layer_pages: &[],
                }],
                kv,
            )?),
            Run::Gpu { exec, table, vocab } => Ok(Logits {
                vocab: *vocab,
                data: exec
                    .forward_every_position(kura_engine::SeqInput::new(piece, start, table))?,
            }),
        }
    }
}

pub fn run(args: PerplexityArgs) -> Result<()> {
    crate::setup::threads(args.threads)?;
    if args.context < 2 {
        bail!(
            "--context {} is too short: a chunk needs at least 2 tokens",
            args.context
        );
    }
    if args.kv_dtype.is_empty() {
        bail!("--kv-dtype names no format");
    }
    if args.chunks == Some(0) {
        bail!("--chunks must be at least 1");
    }
    let device =
        kura_cuda::parse_device(&args.device).map_err(|e| anyhow::anyhow!("--device: {e}"))?;
    if device.is_some() {
        crate::gpu::check_weights(args.weights_dtype)?;
        for &d in &args.kv_dtype {
            crate::gpu::check_pool(d, args.block_size)?;
        }
    }
    let path = crate::setup::model_path(args.model.as_ref())?;
    let source = match device {
        Some(ordinal) => Source::Gpu {
            ordinal,
            parts: Box::new(ModelParts::open(&path)?),
            path: path.clone(),
        },
        None => Source::Cpu(Box::new(crate::setup::load_model(
            &path,
            args.weights_dtype,
        )?)),
    };
    let (config, tokenizer) = (source.config(), source.tokenizer());
    if args.context > config.max_context() {
        bail!(
            "--context {} is longer than the model's context of {} tokens",
            args.context,
            config.max_context()
        );
    }
    let text = kura_files::read_arg_text(&args.text, TEXT_MAX_BYTES)
        .with_context(|| format!("reading --text {}", args.text.display()))?;
    let tokens = tokenizer.encode(&text, false)?;
    let whole = tokens.len() / args.context;
    if whole == 0 {
        bail!(
            "--text {} holds {} tokens, fewer than one chunk of --context {}",
            args.text.display(),
            tokens.len(),
            args.context
        );
    }
    let chunks = args.chunks.map_or(whole, |c| c.min(whole));
    // As llama-perplexity: a model whose tokenizer starts a text with BOS reads each chunk from BOS
    // (the chunk's first token is replaced by it), so that the figures compare with llama.cpp's.
    let bos = match tokenizer.encode("", true)?.as_slice() {
        [b] => Some(*b),
        _ => None,
    };
    let vocab = config.vocab_size();
    let started = Instant::now();

    let mut reference = source.run(KvDtype::F32, args.block_size, args.context)?;
    let mut runs = args
        .kv_dtype
        .iter()
        .map(|&d| source.run(d, args.block_size, args.context))
        .collect::<Result<Vec<_>>>()?;
    let mut ref_nll = 0f64;
    let mut sums = vec![Sums::default(); runs.len()];
    let mut scored = 0u64;
    // Log-probabilities and probabilities of the reference at the scored positions of a piece.
    let (mut ref_lp, mut ref_p): (Vec<f32>, Vec<f32>) = (Vec::new(), Vec::new());
    let first_scored = args.context / 2;
    // Tokens computed, counting each chunk once for the reference and once per format (a forward pass
    // each); drawn only on a terminal.
    let passes = (1 + runs.len()) as u64;
    let bar = crate::progress::bar(
        (chunks * args.context) as u64 * passes,
        "perplexity",
        "tokens computed",
    );
    for c in 0..chunks {
        let mut chunk = tokens[c * args.context..(c + 1) * args.context].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        let mut start = 0;
        while start < args.context {
            let end = (start + PIECE).min(args.context);
            let piece = &chunk[start..end];
            let logits = reference.forward(piece, start)?;
            bar.inc(piece.len() as u64);
            // Position p's logits predict chunk[p + 1]; scored: first_scored ≤ p + 1 < context.
            let rows: Vec<usize> = (start..end)
                .filter(|&p| p + 1 >= first_scored && p + 1 < args.context)
                .collect();
            ref_lp.clear();
            ref_p.clear();
            let mut ref_top = Vec::with_capacity(rows.len());
            for &p in &rows {
                let row = logits.row(p - start);
                let (lse, top) = log_sum_exp(row);
                ref_nll += f64::from(lse - row[chunk[p + 1] as usize]);
                ref_top.push(top);
                ref_lp.extend(row.iter().map(|x| x - lse));
            }
            ref_p.extend(ref_lp.iter().map(|a| a.exp()));
            scored += rows.len() as u64;
            for (run, sum) in runs.iter_mut().zip(&mut sums) {
                let logits = run.forward(piece, start)?;
                bar.inc(piece.len() as u64);
                for (i, &p) in rows.iter().enumerate() {
                    let row = logits.row(p - start);
                    let (lse, top) = log_sum_exp(row);
                    sum.nll += f64::from(lse - row[chunk[p + 1] as usize]);
                    sum.agree += u64::from(top == ref_top[i]);
                    let at = i * vocab..(i + 1) * vocab;
                    let kl: f64 = ref_p[at.clone()]
                        .iter()
                        .zip(&ref_lp[at])
                        .zip(row)
                        .map(|((&p, &a), &x)| f64::from(p * (a - (x - lse))))
                        .sum();
                    sum.kl += kl;
                    sum.kl_max = sum.kl_max.max(kl);
                }
            }
            start = end;
        }
        if !args.json {
            let ppl = (ref_nll / scored as f64).exp();
            bar.suspend(|| {
                eprintln!(
                    "chunk {}/{chunks}: reference perplexity so far {ppl:.4} ({:.0} s)",
                    c + 1,
                    started.elapsed().as_secs_f64()
                )
            });
        }
    }
    bar.finish_and_clear();
    let n = scored as f64;
    let reference_perplexity = (ref_nll / n).exp();
    let formats = args
        .kv_dtype
        .iter()
        .zip(&sums)
        .map(|(&d, s)| {
            let perplexity = (s.nll / n).exp();
            Ok(FormatReport {
                kv_dtype: d,
                kv_bytes_per_token: config.kv_layout(d, args.block_size)?.bytes_per_token(),
                perplexity,
                perplexity_change_pct: (perplexity / reference_perplexity - 1.0) * 100.0,
                kl_mean: s.kl / n,
                kl_max: s.kl_max,
                top1_agreement: s.agree as f64 / n,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let report = Report {
        model: path.display().to_string(),
        text: args.text.display().to_string(),
        text_tokens: tokens.len(),
        context: args.context,
        chunks,
        scored_tokens: scored,
        weights_dtype: source.weights_dtype(),
        reference_kv_dtype: KvDtype::F32,
        reference_perplexity,
        formats,
        seconds: started.elapsed().as_secs_f64(),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{} tokens of {} in {} chunks of {} ({} scored), weights {}; reference f32 KV perplexity {:.4}",
        report.text_tokens,
        report.text,
        chunks,
        args.context,
        scored,
        report.weights_dtype,
        reference_perplexity
    );
    println!(
        "{:<6} {:>12} {:>11} {:>9} {:>10} {:>10} {:>8}",
        "kv", "bytes/token", "perplexity", "change", "KL mean", "KL max", "top-1"
    );
    for f in &report.formats {
        println!(
            "{:<6} {:>12} {:>11.4} {:>8.3}% {:>10.5} {:>10.4} {:>7.2}%",
            f.kv_dtype.name(),
            f.kv_bytes_per_token,
            f.perplexity,
            f.perplexity_change_pct,
            f.kl_mean,
            f.kl_max,
            f.top1_agreement * 100.0
        );
    }
    Ok(())
}
