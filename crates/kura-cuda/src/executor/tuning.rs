//! Choosing the prefill attention kernel on the device at hand: every form this device loaded
//! ([`PrefillKernel`]) is run over the same prompt, those whose output is not `Narrow`'s bit for bit
//! are set aside, and the fastest of the others is kept when it beats `Narrow` by more than the timings'
//! spread. A prompt's tokens therefore never depend on the choice, only its time to first token.
//!
//! ```text
//!   one forward pass over a prompt of `tokens` (K/V in the pool, the last layer's queries in `q`)
//!     ─▶ each form once on the last layer: its output against Narrow's, bit for bit
//!     ─▶ each form over up to 8 layers, 3 rounds interleaved: the median time (device events)
//!     ─▶ the fastest form with Narrow's bits, if it is more than 3 % faster; else Narrow
//! ```

use std::fmt;

use half::bf16;
use kura_engine::SeqInput;

use super::transfers::TIMED;
use super::{CudaExecutor, PrefillKernel};
use crate::error::Result;

/// The prompt a server times the prefill kernels over when it starts (fewer tokens where its pool or
/// its steps hold fewer): long enough that every multiprocessor runs several tiles of queries, as in
/// the long prompts where attention takes most of a step.
pub const TUNE_TOKENS: usize = 4096;
/// Layers each timing launches the kernel for (spread over the model): enough to last well beyond the
/// events' resolution.
const TUNE_LAYERS: usize = 8;
/// Rounds of timings, each form once a round.
const TUNE_ROUNDS: usize = 3;
/// How much faster than `Narrow` another form must be to be chosen: the spread of such timings from
/// one round to the next is a few per cent.
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

/// What [`CudaExecutor::tune_prefill`] measured and chose.
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

impl PrefillTuning {
    /// The form to run given `forms` (`Narrow` first): the fastest of those with `Narrow`'s bits when
    /// it is more than [`TUNE_MARGIN`] faster than `Narrow`, else `Narrow`.
    pub fn choose(forms: &[FormTiming]) -> PrefillKernel {
        let Some(narrow) = forms.iter().find(|f| f.kernel == PrefillKernel::Narrow) else {
            return PrefillKernel::Narrow;
        };
        forms
            .iter()
            .filter(|f| f.same_bits && f.ms < narrow.ms * (1.0 - TUNE_MARGIN))
            .min_by(|a, b| a.ms.total_cmp(&b.ms))
            .map_or(PrefillKernel::Narrow, |f| f.kernel)
    }
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
        for (i, t) in self.forms.iter().enumerate() {
            let sep = if i == 0 { " " } else { ", " };
            let bits = if t.same_bits { "" } else { " (other bits)" };
            write!(f, "{sep}{} {:.3} ms{bits}", t.kernel.name(), t.ms)?;
        }
        write!(f, ")")
    }
}

impl CudaExecutor {
    /// The prefill attention kernel steps run through.
    pub fn prefill_kernel(&self) -> PrefillKernel {
        self.prefill_kernel
    }

    /// Times every prefill form this device loaded over a prompt of `tokens` (fewer where the pool,
    /// the model's context or the reserved activation buffers hold fewer) and runs steps through the
    /// one [`PrefillTuning::choose`] picks. `None` (nothing changed) when that leaves too few tokens
    /// for the prefill kernel. The prompt's K and V are written into the pool's first blocks: call it
    /// before the pool holds anything. A timing probe set before is set again after.
    pub fn tune_prefill(&mut self, tokens: usize) -> Result<Option<PrefillTuning>> {
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

    fn tune_over(&mut self, n: usize) -> Result<Option<PrefillTuning>> {
        let bs = self.shape.block_size as usize;
        let vocab = self.cfg.vocab_size();
        let prompt: Vec<u32> = (0..n).map(|i| ((i * 7919 + 11) % vocab) as u32).collect();
        let table: Vec<u32> = (0..n.div_ceil(bs) as u32).collect();
        // One forward pass: each layer's K and V in the pool, the last layer's queries in `q`, and the
        // step's tiles in the metadata, which the launches below read.
        let plan = self.run(&[SeqInput::new(&prompt, 0, &table)], false)?;
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
        Ok(Some(PrefillTuning {
            tokens: n,
            layers: timed,
            forms,
            chosen,
        }))
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
    fn the_fastest_form_with_narrows_bits_is_chosen_only_when_clearly_faster() {
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
    }
}
