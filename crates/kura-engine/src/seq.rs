//! Per-request and per-choice state kept by the engine thread: a [`Group`] is one submitted request
//! (its sink, its parameters, its usage), a [`Seq`] is the sampling side of one of its choices (its
//! sampler and stop tokens); its tokens and blocks are the [`Scheduler`]'s, its text the output
//! stage's ([`crate::output`]), which also holds the [`Detokenizer`].
//!
//! [`Scheduler`]: kura_sched::Scheduler

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use kura_kv::CacheKey;
use kura_text::IncrementalDecoder;

use crate::sampling::{Sampled, Sampler, SamplingParams};

use crate::backend::TextCodec;
use crate::output::SinkSlot;
use crate::request::{FinishReason, GenerateRequest, TokenConstraint, Usage};

/// One submitted request and everything shared by its choices.
pub(crate) struct Group {
    /// Where its events go (through the output stage); closed once its reader is gone, and the group
    /// is then cancelled.
    pub slot: Arc<SinkSlot>,
    pub request: GenerateRequest,
    pub key: CacheKey,
    pub arrival: Instant,
    /// Choices 1.. are forked from choice 0 once its prompt is computed.
    pub forked: bool,
    /// Choices not yet finished (counts unforked ones too).
    pub live_choices: u32,
    pub usage: Usage,
    /// Prefix-cache accounting is done at the first admission only (recomputation is not a client hit).
    pub admitted_once: bool,
    /// At the first admission, the pool held more of the prompt's blocks than the hit, without the
    /// parts a sliding window reads ([`crate::request::MissReason::WindowDropped`]).
    pub window_cut: bool,
    pub first_token_at: Option<Instant>,
    /// The sink reported full at the start of this step: the group is not stepped.
    pub full: bool,
    /// Since when the sink has been full without a break (for `stalled_client_timeout`).
    pub full_since: Option<Instant>,
    /// How its last choice to finish ended (for the finish counters).
    pub reason: Option<FinishReason>,
    /// Prompt positions this request computed itself before its first token; the rest were served
    /// from the cache (any tier) or computed by another request it waited for.
    pub prompt_computed: PromptCoverage,
    /// While its prompt is being scored ([`GenerateRequest::prompt_logprobs`]): the scores so far.
    pub scores: Option<crate::score::PromptScores>,
}

/// A set of prompt positions, one bit each (positions computed twice, after a preemption, count once).
#[derive(Debug, Clone, Default)]
pub(crate) struct PromptCoverage {
    words: Vec<u64>,
}

impl PromptCoverage {
    /// Adds positions `[start, end)`.
    pub fn add(&mut self, start: usize, end: usize) {
        if end > start && self.words.len() * 64 < end {
            self.words.resize(end.div_ceil(64), 0);
        }
        for p in start..end {
            self.words[p / 64] |= 1 << (p % 64);
        }
    }

    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }
}

/// One choice of a request.
pub(crate) struct Seq {
    pub group: u64,
    pub choice: u32,
    pub sampler: Sampler,
    /// Tokens that end the choice (EOS unless ignored, and the request's own).
    pub stop_tokens: Vec<u32>,
    pub last_token_at: Option<Instant>,
    /// The grammar the choice's output follows ([`GenerateRequest::constraint`]), or why it could not
    /// start (the choice then fails at its first token).
    pub constraint: Result<Option<Box<dyn TokenConstraint>>, String>,
    /// The token its sampler chose for this step, with its logprobs when asked, ahead of the step's
    /// bookkeeping, beside the other sequences of the batch (`Core::choose_batch`); not yet recorded.
    pub chosen: Option<Sampled>,
    /// Its tokens' n-grams, where speculative decoding looks up its drafts
    /// ([`crate::NgramDraft::propose_indexed`]; empty until the first lookup).
    pub ngrams: crate::NgramIndex,
    /// The most draft tokens its next draft may have (speculative decoding): `num_speculative_tokens`
    /// at first and after a draft kept whole, one more than the tokens kept after a draft turned
    /// down ([`crate::next_draft_room`]).
    pub draft_room: Option<usize>,
}

impl Seq {
    pub fn new(group: u64, choice: u32, request: &GenerateRequest, eos: &[u32]) -> Self {
        let params = SamplingParams {
            seed: request
                .sampling
                .seed
                .map(|seed| seed.wrapping_add(u64::from(choice))),
            ..request.sampling.clone()
        };
        let mut stop_tokens = request.stop_token_ids.clone();
        if !request.ignore_eos {
            stop_tokens.extend_from_slice(eos);
        }
        Self {
            group,
            choice,
            sampler: Sampler::new(params, &request.prompt_tokens)
                .holding_back(held_back(&stop_tokens, request, eos), request.min_tokens),
            stop_tokens,
            last_token_at: None,
            constraint: request.constraint.as_ref().map(|c| c.start()).transpose(),
            chosen: None,
            ngrams: crate::NgramIndex::default(),
            draft_room: None,
        }
    }
}

/// The tokens a choice of `request` ends on, which `min_tokens` holds back: its stop tokens, and
/// end-of-sequence under a grammar even when the request ignores it (a grammar's end ends the choice).
fn held_back(stop_tokens: &[u32], request: &GenerateRequest, eos: &[u32]) -> Vec<u32> {
    let mut held = stop_tokens.to_vec();
    if request.constraint.is_some() {
        held.extend(eos.iter().filter(|t| !stop_tokens.contains(t)));
    }
    held
}

/// Incremental detokenization over [`TextCodec::decode`]: kura-model's [`IncrementalDecoder`] (a short
/// window of recent tokens, text released only once it no longer ends in an incomplete UTF-8 character)
/// driven through the engine's codec interface. O(window) per token. Special tokens are skipped,
/// unless it keeps them ([`Detokenizer::keeping_special`]).
#[derive(Debug, Default, Clone)]
pub(crate) struct Detokenizer {
    decoder: IncrementalDecoder,
    keep_special: bool,
}

impl Detokenizer {
    /// A detokenizer that writes special tokens' text too (`skip_special_tokens: false`) when
    /// `keep_special`.
    pub fn keeping_special(keep_special: bool) -> Self {
        Self {
            keep_special,
            ..Self::default()
        }
    }

    pub fn push(&mut self, codec: &Arc<dyn TextCodec>, id: u32) -> String {
        let decode = decoding(codec, self.keep_special);
        let Ok(text) = self.decoder.push_with(id, decode);
        text
    }

    /// Whatever is still held back (an incomplete character at the end of generation).
    pub fn flush(&mut self, codec: &Arc<dyn TextCodec>) -> String {
        let decode = decoding(codec, self.keep_special);
        let Ok(text) = self.decoder.flush_with(decode);
        text
    }
}

/// `codec`'s decoding, special tokens kept or skipped.
fn decoding(
    codec: &Arc<dyn TextCodec>,
    keep_special: bool,
) -> impl FnMut(&[u32]) -> Result<String, Infallible> + '_ {
    move |ids| Ok(decode(codec, ids, keep_special))
}

/// The text of `ids`, special tokens' text kept (`skip_special_tokens: false`) or skipped.
pub(crate) fn decode(codec: &Arc<dyn TextCodec>, ids: &[u32], keep_special: bool) -> String {
    match keep_special {
        true => codec.decode_keeping_special(ids),
        false => codec.decode(ids),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct AnyGrammar;

    impl kura_request::ConstraintSpec for AnyGrammar {
        fn start(&self) -> Result<Box<dyn kura_request::TokenConstraint>, String> {
            Err("not walked here".into())
        }
    }

    #[test]
    fn min_tokens_holds_back_end_of_sequence_under_a_grammar_even_when_ignored() {
        let eos = [2];
        let mut r = GenerateRequest::greedy(vec![1, 2, 3], 8);
        r.ignore_eos = true;
        r.stop_token_ids = vec![7];
        assert_eq!(held_back(&r.stop_token_ids, &r, &eos), [7]);
        // A grammar's end ends the choice on end-of-sequence, ignored or not: held back too.
        r.constraint = Some(Arc::new(AnyGrammar));
        assert_eq!(held_back(&r.stop_token_ids, &r, &eos), [7, 2]);
        // Not twice where it is a stop token already.
        assert_eq!(held_back(&[7, 2], &r, &eos), [7, 2]);
        let seq = Seq::new(1, 0, &r, &eos);
        assert_eq!(seq.stop_tokens, [7]);
    }
}
