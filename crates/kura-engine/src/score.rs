//! Scoring a prompt ([`crate::GenerateRequest::prompt_logprobs`], OpenAI's `echo` with `logprobs`):
//! the log-probability of each prompt token given the tokens before it, which evaluation harnesses read
//! (lm-evaluation-harness's log-likelihood tasks send a context and a continuation as one prompt and
//! sum the continuation's log-probabilities).
//!
//! Token `p`'s score comes from the logits at position `p - 1`, so every prompt position's logits are
//! needed: a prompt being scored reads nothing cached (the scheduler's `score_prompt`; its own blocks
//! are cached as any others; admitted again after a preemption, it reads the blocks of the positions
//! it has scored, `prompt_scored_to`), and each step computes at most [`score_chunk`] tokens of it, through
//! [`crate::Executor::forward_every_position`], after the step's other items; each scored item's rows
//! are scored before the next item's are computed, so a step holds one item's rows at a time. The
//! scores are sent as one event once the whole prompt is scored, before its first token.

use rayon::prelude::*;

use crate::sampling::{token_logprob, TokenLogprob};

/// The most bytes of logits one step's scoring item brings back (every position's row) by default
/// (`EngineConfig::score_rows_bytes`).
pub(crate) const SCORE_ROWS_BYTES: usize = 32 << 20;

/// The most prompt tokens one step computes of a prompt being scored: their rows of logits within
/// `bytes` (with the default 32 MiB: 682 tokens of a 12,288-token vocabulary, 170 of SmolLM2's 49,152,
/// 32 of Gemma 3's 262,144), and at least one.
pub(crate) fn score_chunk(bytes: usize, vocab: usize) -> usize {
    (bytes / vocab.saturating_mul(4).max(1)).max(1)
}

/// A prompt's scores as its chunks are computed.
#[derive(Debug)]
pub(crate) struct PromptScores {
    /// The most likely alternatives reported at each position.
    top: usize,
    /// Entry `p - 1` scores prompt token `p` (with its rank); `None` until computed.
    got: Vec<Option<(TokenLogprob, u32)>>,
    /// Entries still `None`.
    left: usize,
    /// Entries `0..leading` are all scored.
    leading: usize,
}

impl PromptScores {
    /// Scores for a prompt of `prompt_len` tokens (its first is not scored), with `top` alternatives.
    pub fn new(prompt_len: usize, top: usize) -> Self {
        let n = prompt_len.saturating_sub(1);
        PromptScores {
            top,
            got: vec![None; n],
            left: n,
            leading: 0,
        }
    }

    /// Records what the logits of positions `start..` (`logits`: rows of `vocab` values) say of the
    /// prompt tokens after them. A position already scored (computed again after a preemption) keeps
    /// its first score; rows past the prompt's last token but one score nothing.
    pub fn record(&mut self, prompt: &[u32], start: usize, logits: &[f32], vocab: usize) {
        if vocab == 0 {
            return;
        }
        let top = self.top;
        let rows: Vec<(usize, &[f32])> = logits
            .chunks_exact(vocab)
            .enumerate()
            .map(|(i, row)| (start + i, row))
            .filter(|&(p, _)| p < self.got.len() && self.got[p].is_none())
            .collect();
        let scored: Vec<(usize, (TokenLogprob, u32))> = rows
            .into_par_iter()
            .map(|(p, row)| {
                let token = prompt[p + 1];
                (p, (token_logprob(row, token, top), rank(row, token)))
            })
            .collect();
        for (p, score) in scored {
            self.got[p] = Some(score);
            self.left -= 1;
        }
        while self.got.get(self.leading).is_some_and(Option::is_some) {
            self.leading += 1;
        }
    }

    /// The prompt's first tokens whose positions are all scored: what a computation of it again (after
    /// a preemption) may read from the cache.
    pub fn scored_tokens(&self) -> usize {
        self.leading
    }

    /// Whether every scored token of the prompt has its score.
    pub fn is_done(&self) -> bool {
        self.left == 0
    }

    /// The scores of prompt tokens `1..`, in order, and their ranks; `None` until
    /// [`PromptScores::is_done`].
    pub fn take(&mut self) -> Option<(Vec<TokenLogprob>, Vec<u32>)> {
        if !self.is_done() {
            return None;
        }
        std::mem::take(&mut self.got).into_iter().collect()
    }
}

/// `token`'s rank in `row`: how many tokens are at least as likely, itself included (1 for the most
/// likely; vLLM's count: two tokens tied for the most likely are both 2).
fn rank(row: &[f32], token: u32) -> u32 {
    let x = row[token as usize];
    let n = row.iter().filter(|&&y| y >= x).count();
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_token_is_scored_by_the_row_before_it_once() {
        // A vocabulary of 4; the prompt 0 1 2 3 2.
        let prompt = [0u32, 1, 2, 3, 2];
        let vocab = 4;
        let row = |p: usize| -> Vec<f32> { (0..vocab).map(|t| (t * (p + 1)) as f32).collect() };
        let mut s = PromptScores::new(prompt.len(), 2);
        assert!(!s.is_done());
        // Positions 0 and 1, then 1 again (a preemption) with other values, then 2..5 (4 is the last
        // position: its row gives the first output token, not a prompt score).
        s.record(&prompt, 0, &[row(0), row(1)].concat(), vocab);
        s.record(&prompt, 1, &vec![9.0; vocab], vocab);
        assert!(s.take().is_none());
        // Positions 0 and 1 scored: the first two tokens could be read from the cache.
        assert_eq!(s.scored_tokens(), 2);
        s.record(&prompt, 2, &[row(2), row(3), row(4)].concat(), vocab);
        let (got, ranks) = s.take().expect("every token scored");
        assert_eq!(got.len(), 4);
        // Rows rise with the token id: token t of a row of 4 has rank 4 - t.
        assert_eq!(ranks, vec![3, 2, 1, 2]);
        // Each from the first row computed for its position (token 2's from row(1), not the 9s).
        for (i, lp) in got.iter().enumerate() {
            let want = token_logprob(&row(i), prompt[i + 1], 2);
            assert_eq!(lp, &want, "token {}", i + 1);
            assert_eq!(lp.top.len(), 2);
        }
    }

    #[test]
    fn a_one_token_prompt_has_nothing_to_score() {
        let mut s = PromptScores::new(1, 0);
        assert!(s.is_done());
        assert_eq!(s.take(), Some((Vec::new(), Vec::new())));
    }

    #[test]
    fn the_chunk_keeps_a_steps_rows_within_the_bound() {
        assert_eq!(score_chunk(SCORE_ROWS_BYTES, 49_152), 170);
        assert_eq!(score_chunk(SCORE_ROWS_BYTES, 262_144), 32);
        assert_eq!(score_chunk(SCORE_ROWS_BYTES, usize::MAX), 1);
        assert_eq!(score_chunk(0, 64), 1);
        assert!(score_chunk(SCORE_ROWS_BYTES, 0) >= 1);
    }
}
