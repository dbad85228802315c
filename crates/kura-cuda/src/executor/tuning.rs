//! Choosing kernels on the device at hand. Some forms of the same computation (the prefill attention
//! kernels of [`PrefillKernel`]; the decode products' L2 window and the split-key kernel's K/V
//! prefetch) give the same bits and differ only in speed, by amounts that depend on the GPU. When an
//! executor starts, each is run over the same prompt, those whose output is not the default's bit for
//! bit are set aside, and the fastest of the others is kept when it beats the default by more than the
//! timings' spread. A prompt's tokens therefore never depend on the choice, only its speed.
//!
//! ```text
//!   one forward pass over a prompt of `tokens` (K/V in the pool, the last layer's queries in `q`)
//!     ─▶ prefill: each form once on the last layer, its output against Narrow's, bit for bit;
//!                 then each over up to 8 layers, 3 rounds interleaved: median time (device events)
//!     ─▶ decode:  batch-1 steps at the prompt's last position (each rewrites the same slot with the
//!                 same K and V): each option's logits against the default's, then 8 steps a round,
//!                 3 rounds interleaved: median time a step (wall clock, graphs as served)
//!     ─▶ each: the fastest with the default's bits, if more than 3 % faster; else the default
//! ```

use std::fmt;
use std::time::Instant;

use half::bf16;
use kura_engine::SeqInput;

use super::transfers::TIMED;
use super::{CudaExecutor, PrefillKernel};
use crate::error::Result;
use crate::GemvForm;

/// The prompt an executor times its kernels over when it starts (fewer tokens where its pool or its
/// steps hold fewer): long enough that every multiprocessor runs several tiles of queries, as in the
/// long prompts where attention takes most of a step.
pub const TUNE_TOKENS: usize = 4096;
/// Layers each prefill timing launches the kernel for (spread over the model): enough to last well
/// beyond the events' resolution.
const TUNE_LAYERS: usize = 8;
/// Rounds of timings, each form once a round.
const TUNE_ROUNDS: usize = 3;
/// Decode steps timed a round for each option.
const TUNE_STEPS: usize = 8;
/// How much faster than the default another form must be to be chosen: the spread of such timings
/// from one round to the next is a few per cent.
const TUNE_MARGIN: f64 = 0.03;

/// One form's timing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FormTiming {
    pub kernel: PrefillKernel,
    /// Median milliseconds of a round (the kernel launched for [`PrefillTuning::layers`] layers).
    pub ms: f64,
    /// Whether its output was `Narrow`'s bit for bit (only those may be chosen).
    pub same_bits: bool,
}

/// What [`CudaExecutor::tune`] measured and chose for prefill attention.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillTuning {
    /// The prompt's tokens.
    pub tokens: usize,
    /// Layers a timing launched the kernel for.
    pub layers: usize,
    /// Each form this device loaded, `Narrow` first.
    pub forms: Vec<FormTiming>,
    pub chosen: PrefillKernel,
}

/// The decode options [`CudaExecutor::tune`] times: the products' form
/// ([`CudaExecutor::set_gemv`]: plain, the L2 window or W staged through shared memory) and the split-key kernel's K/V
/// prefetch ([`CudaExecutor::set_split_prefetch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DecodeOptions {
    pub gemv: GemvForm,
    pub split_prefetch: bool,
}

impl DecodeOptions {
    /// Every combination, the default (plain products, no prefetch) first.
    pub const ALL: [DecodeOptions; 6] = {
        let mut all = [DecodeOptions {
            gemv: GemvForm::Plain,
            split_prefetch: false,
        }; 6];
        let mut i = 0;
        while i < 6 {
            all[i] = DecodeOptions {
                gemv: GemvForm::ALL[i % 3],
                split_prefetch: i >= 3,
            };
            i += 1;
        }
        all
    };

    /// Its name in the log: `default`, `gemv_ahead`, `gemv_batched`, `split_prefetch`,
    /// `gemv_ahead+split_prefetch` or `gemv_batched+split_prefetch`.
    pub fn name(self) -> &'static str {
        match (self.gemv, self.split_prefetch) {
            (GemvForm::Plain, false) => "default",
            (GemvForm::Ahead, false) => "gemv_ahead",
            (GemvForm::Batched, false) => "gemv_batched",
            (GemvForm::Plain, true) => "split_prefetch",
            (GemvForm::Ahead, true) => "gemv_ahead+split_prefetch",
            (GemvForm::Batched, true) => "gemv_batched+split_prefetch",
        }
    }
}

/// One decode option's timing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptionTiming {
    pub options: DecodeOptions,
    /// Median milliseconds of a batch-1 step.
    pub ms: f64,
    /// Whether its logits were the default's bit for bit (only those may be chosen).
    pub same_bits: bool,
}

/// What [`CudaExecutor::tune`] measured and chose for decode.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeTuning {
    /// Tokens of context each step attends to.
    pub context: usize,
    /// Each option, the default first.
    pub options: Vec<OptionTiming>,
    pub chosen: DecodeOptions,
}

/// Both choices.
#[derive(Debug, Clone, PartialEq)]
pub struct Tuning {
    pub prefill: PrefillTuning,
    pub decode: DecodeTuning,
}

/// The index of the fastest of `timings` (milliseconds, same bits as the first) with the first's bits
/// that is more than [`TUNE_MARGIN`] faster than the first; 0 (the first, the default) otherwise.
fn fastest(timings: &[(f64, bool)]) -> usize {
    let Some(&(default, _)) = timings.first() else {
        return 0;
    };
    timings
        .iter()
        .enumerate()
        .filter(|(_, &(ms, same))| same && ms < default * (1.0 - TUNE_MARGIN))
        .min_by(|a, b| a.1 .0.total_cmp(&b.1 .0))
        .map_or(0, |(i, _)| i)
}

impl PrefillTuning {
    /// The form to run given `forms` (`Narrow` first): the fastest of those with `Narrow`'s bits when
    /// it is more than [`TUNE_MARGIN`] faster than `Narrow`, else `Narrow`.
    pub fn choose(forms: &[FormTiming]) -> PrefillKernel {
        if forms.first().map(|f| f.kernel) != Some(PrefillKernel::Narrow) {
            return PrefillKernel::Narrow;
        }
        let t: Vec<(f64, bool)> = forms.iter().map(|f| (f.ms, f.same_bits)).collect();
        forms[fastest(&t)].kernel
    }
}

impl DecodeTuning {
    /// The options to run given `options` (the default first), by the rule of
    /// [`PrefillTuning::choose`].
    pub fn choose(options: &[OptionTiming]) -> DecodeOptions {
        if options.first().map(|o| o.options) != Some(DecodeOptions::default()) {
            return DecodeOptions::default();
        }
        let t: Vec<(f64, bool)> = options.iter().map(|o| (o.ms, o.same_bits)).collect();
        options[fastest(&t)].options
    }
}

/// `name 1.234 ms` for each, ` (other bits)` after those whose output differed.
fn timings<'a>(
    f: &mut fmt::Formatter<'_>,
    items: impl Iterator<Item = (&'a str, f64, bool)>,
) -> fmt::Result {
    for (i, (name, ms, same)) in items.enumerate() {
        let sep = if i == 0 { " " } else { ", " };
        let bits = if same { "" } else { " (other bits)" };
        write!(f, "{sep}{name} {ms:.3} ms{bits}")?;
    }
    Ok(())
}

impl fmt::Display for PrefillTuning {
    /// `half (a 4096-token prompt, 8 layers: narrow 1.234 ms, wide 1.100 ms (other bits), half 1.150 ms)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (a {}-token prompt, {} layers:",
            self.chosen.name(),
            self.tokens,
            self.layers
        )?;
        timings(
            f,
            self.forms
                .iter()
                .map(|t| (t.kernel.name(), t.ms, t.same_bits)),
        )?;
        write!(f, ")")
    }
}

impl fmt::Display for DecodeTuning {
    /// `gemv_ahead (batch-1 steps over 4096 tokens: default 5.100 ms, gemv_ahead 4.800 ms, ...)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (batch-1 steps over {} tokens:",
            self.chosen.name(),
            self.context
        )?;
        timings(
            f,
            self.options
                .iter()
                .map(|t| (t.options.name(), t.ms, t.same_bits)),
        )?;
        write!(f, ")")
    }
}

impl CudaExecutor {
    /// The prefill attention kernel steps run through.
    pub fn prefill_kernel(&self) -> PrefillKernel {
        self.prefill_kernel
    }

    /// The decode options steps run with.
    pub fn decode_options(&self) -> DecodeOptions {
        DecodeOptions {
            gemv: self.dev.gemv(),
            split_prefetch: self.split_prefetch,
        }
    }

    /// Runs steps with `options` (clears the captured graphs).
    pub fn set_decode_options(&mut self, options: DecodeOptions) {
        self.set_gemv(options.gemv);
        self.set_split_prefetch(options.split_prefetch);
    }

    /// Times every prefill form this device loaded and every decode option over a prompt of
    /// `tokens` (fewer where the pool, the model's context or the reserved activation buffers hold
    /// fewer) and runs steps through those [`PrefillTuning::choose`] and [`DecodeTuning::choose`]
    /// pick. `None` (nothing changed) when that leaves too few tokens for the prefill kernel. The
    /// prompt's K and V are written into the pool's first blocks: call it before the pool holds
    /// anything. A timing probe set before is set again after.
    pub fn tune(&mut self, tokens: usize) -> Result<Option<Tuning>> {
        let bs = self.shape.block_size as usize;
        let mut n = tokens
            .min(self.num_blocks.saturating_mul(bs))
            .min(self.cfg.max_context());
        if self.s.tokens > 0 {
            n = n.min(self.s.tokens);
        }
        if n < self.prefill_min {
            return Ok(None);
        }
        let probe = self.prefill_probe.take();
        let tuned = self.tune_over(n);
        self.prefill_probe = probe;
        tuned
    }

    fn tune_over(&mut self, n: usize) -> Result<Option<Tuning>> {
        let bs = self.shape.block_size as usize;
        let vocab = self.cfg.vocab_size();
        let prompt: Vec<u32> = (0..n).map(|i| ((i * 7919 + 11) % vocab) as u32).collect();
        let table: Vec<u32> = (0..n.div_ceil(bs) as u32).collect();
        // One forward pass: each layer's K and V in the pool, the last layer's queries in `q`, and the
        // step's tiles in the metadata, which the launches below read.
        let plan = self.run(&[SeqInput::new(&prompt, 0, &table)], None, false)?;
        if plan.tiles == 0 {
            return Ok(None);
        }
        let (kv, d) = (self.kv_name(), self.cfg.head_dim());
        let forms: Vec<PrefillKernel> = PrefillKernel::ALL
            .into_iter()
            .filter(|k| self.dev.has_kernel(&k.kernel(kv, d)))
            .collect();
        if forms.first() != Some(&PrefillKernel::Narrow) {
            return Ok(None);
        }
        let layers = self.cfg.num_layers();
        let last = layers - 1;
        // Each form's output of the last layer, against Narrow's (also each kernel's first launch).
        let len = n * self.cfg.num_heads() * d;
        let mut narrow: Vec<bf16> = Vec::new();
        let mut same_bits = Vec::with_capacity(forms.len());
        for &k in &forms {
            self.launch_prefill(&k.kernel(kv, d), k, &plan, last)?;
            let mut out = vec![bf16::ZERO; len];
            self.dev
                .stream
                .memcpy_dtoh(&self.s.attn.slice(0..len), &mut out)?;
            self.dev.synchronize()?;
            if k == PrefillKernel::Narrow {
                narrow = out;
                same_bits.push(true);
            } else {
                same_bits.push(
                    out.iter()
                        .zip(&narrow)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                );
            }
        }
        let timed = layers.min(TUNE_LAYERS);
        let spread: Vec<usize> = (0..timed).map(|i| i * layers / timed).collect();
        let mut times = vec![Vec::with_capacity(TUNE_ROUNDS); forms.len()];
        for _ in 0..TUNE_ROUNDS {
            for (&k, times) in forms.iter().zip(times.iter_mut()) {
                let name = k.kernel(kv, d);
                let start = self.dev.ctx.new_event(TIMED)?;
                start.record(&self.dev.stream)?;
                for &li in &spread {
                    self.launch_prefill(&name, k, &plan, li)?;
                }
                let end = self.dev.ctx.new_event(TIMED)?;
                end.record(&self.dev.stream)?;
                self.dev.synchronize()?;
                times.push(f64::from(start.elapsed_ms(&end)?));
            }
        }
        let forms: Vec<FormTiming> = forms
            .into_iter()
            .zip(times)
            .zip(same_bits)
            .map(|((kernel, times), same_bits)| FormTiming {
                kernel,
                ms: median(times),
                same_bits,
            })
            .collect();
        let chosen = PrefillTuning::choose(&forms);
        let set = self.set_prefill_kernel(chosen);
        debug_assert!(set, "{} was loaded", chosen.name());
        let prefill = PrefillTuning {
            tokens: n,
            layers: timed,
            forms,
            chosen,
        };
        let decode = self.tune_decode(&prompt, &table)?;
        Ok(Some(Tuning { prefill, decode }))
    }

    /// Times batch-1 decode steps at the last position of `prompt` (whose K and V are in the blocks of
    /// `table`) with each of [`DecodeOptions::ALL`], and keeps the one [`DecodeTuning::choose`] picks.
    fn tune_decode(&mut self, prompt: &[u32], table: &[u32]) -> Result<DecodeTuning> {
        let n = prompt.len();
        // Each step writes the last token's K and V into its slot again, the same values: every step
        // sees the same context and computes the same logits.
        let last = [prompt[n - 1]];
        let step = [SeqInput::new(&last, n - 1, table)];
        let mut default: Vec<f32> = Vec::new();
        let mut same_bits = Vec::with_capacity(DecodeOptions::ALL.len());
        for options in DecodeOptions::ALL {
            self.set_decode_options(options);
            let logits = self.forward_logits(&step)?;
            if options == DecodeOptions::default() {
                default = logits;
                same_bits.push(true);
            } else {
                same_bits.push(
                    logits
                        .iter()
                        .zip(&default)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                );
            }
        }
        let mut times = vec![Vec::with_capacity(TUNE_ROUNDS); DecodeOptions::ALL.len()];
        for _ in 0..TUNE_ROUNDS {
            for (&options, times) in DecodeOptions::ALL.iter().zip(times.iter_mut()) {
                self.set_decode_options(options);
                // The first step captures the step's graph.
                self.forward_greedy(&step)?;
                let t = Instant::now();
                for _ in 0..TUNE_STEPS {
                    self.forward_greedy(&step)?;
                }
                times.push(t.elapsed().as_secs_f64() * 1e3 / TUNE_STEPS as f64);
            }
        }
        let options: Vec<OptionTiming> = DecodeOptions::ALL
            .into_iter()
            .zip(times)
            .zip(same_bits)
            .map(|((options, times), same_bits)| OptionTiming {
                options,
                ms: median(times),
                same_bits,
            })
            .collect();
        let chosen = DecodeTuning::choose(&options);
        self.set_decode_options(chosen);
        Ok(DecodeTuning {
            context: n,
            options,
            chosen,
        })
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(kernel: PrefillKernel, ms: f64, same_bits: bool) -> FormTiming {
        FormTiming {
            kernel,
            ms,
            same_bits,
        }
    }

    #[test]
    fn the_fastest_form_with_the_defaults_bits_is_chosen_only_when_clearly_faster() {
        use PrefillKernel::*;
        // Half beats Narrow by 10 %, Wide by more but with other bits.
        let forms = [
            t(Narrow, 1.0, true),
            t(Wide, 0.5, false),
            t(Half, 0.9, true),
            t(Deep, 0.95, true),
        ];
        assert_eq!(PrefillTuning::choose(&forms), Half);
        // Within the margin: Narrow stays.
        let forms = [t(Narrow, 1.0, true), t(Half, 0.98, true)];
        assert_eq!(PrefillTuning::choose(&forms), Narrow);
        // Only other bits are faster: Narrow.
        let forms = [t(Narrow, 1.0, true), t(Small, 0.2, false)];
        assert_eq!(PrefillTuning::choose(&forms), Narrow);
        // Narrow is the fastest.
        let forms = [t(Narrow, 1.0, true), t(HalfDeep, 1.2, true)];
        assert_eq!(PrefillTuning::choose(&forms), Narrow);
        let tuning = PrefillTuning {
            tokens: 4096,
            layers: 8,
            forms: vec![
                t(Narrow, 1.2344, true),
                t(Wide, 1.1, false),
                t(Half, 1.0, true),
            ],
            chosen: Half,
        };
        assert_eq!(
            tuning.to_string(),
            "half (a 4096-token prompt, 8 layers: narrow 1.234 ms, wide 1.100 ms (other bits), half \
             1.000 ms)"
        );

        // The decode options by the same rule.
        let [none, ahead, batched, prefetch, both, batched_prefetch] = DecodeOptions::ALL;
        assert_eq!(
            DecodeOptions::ALL.map(DecodeOptions::name),
            [
                "default",
                "gemv_ahead",
                "gemv_batched",
                "split_prefetch",
                "gemv_ahead+split_prefetch",
                "gemv_batched+split_prefetch"
            ]
        );
        assert_eq!(none, DecodeOptions::default());
        assert_eq!(batched_prefetch.gemv, GemvForm::Batched);
        assert!(batched_prefetch.split_prefetch);
        let o = |options, ms, same_bits| OptionTiming {
            options,
            ms,
            same_bits,
        };
        let options = [
            o(none, 5.0, true),
            o(ahead, 4.5, true),
            o(batched, 4.7, true),
            o(prefetch, 4.0, false),
            o(both, 4.6, true),
            o(batched_prefetch, 4.55, true),
        ];
        assert_eq!(DecodeTuning::choose(&options), ahead);
        let options = [
            o(none, 5.0, true),
            o(batched, 4.4, true),
            o(ahead, 4.5, true),
        ];
        assert_eq!(DecodeTuning::choose(&options), batched);
        let options = [o(none, 5.0, true), o(ahead, 4.9, true)];
        assert_eq!(DecodeTuning::choose(&options), none);
        let tuning = DecodeTuning {
            context: 4096,
            options: options.to_vec(),
            chosen: none,
        };
        assert_eq!(
            tuning.to_string(),
            "default (batch-1 steps over 4096 tokens: default 5.000 ms, gemv_ahead 4.900 ms)"
        );
        assert_eq!(both.name(), "gemv_ahead+split_prefetch");
    }
}
