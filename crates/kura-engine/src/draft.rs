//! Speculative decoding by n-gram lookup (vLLM's `ngram` method, llama.cpp's prompt lookup): a sequence
//! that ends in an n-gram it has held before is guessed to go on as it did then. The guess (the draft)
//! is computed in the sequence's next step beside its last token (`kura_sched::Scheduler::propose_draft`),
//! and the sampler draws each next token from the logits of its position as it would have one step at a
//! time: while it draws the draft's tokens, they cost no step of their own; at the first token it draws
//! otherwise, the rest of the draft is given back. No draft model runs.
//!
//! The tokens are those of decoding one step at a time, bit for bit: each position's logits are those
//! of the decode step that would have computed it (a forward pass gives a token the same bits whatever
//! else its step computes), each draw is the one the sampler would have made there (its random stream
//! advances one draw per token it keeps), and penalties, grammars and stop conditions see the tokens one
//! by one. A draft only changes how many steps the tokens take.

/// How drafts are found (`kura serve --speculative-config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramDraft {
    /// Most draft tokens a step checks for one sequence.
    pub num_tokens: usize,
    /// Shortest and longest n-gram at the sequence's end that is looked up (the longest found first).
    pub min_n: usize,
    pub max_n: usize,
}

impl NgramDraft {
    /// Why this configuration is refused, if it is.
    pub fn check(&self) -> Result<(), String> {
        if self.num_tokens == 0 || self.num_tokens > MAX_DRAFT_TOKENS {
            return Err(format!(
                "num_speculative_tokens {} is outside 1..={MAX_DRAFT_TOKENS}",
                self.num_tokens
            ));
        }
        if self.min_n == 0 || self.min_n > self.max_n || self.max_n > MAX_NGRAM {
            return Err(format!(
                "prompt_lookup_min {} and prompt_lookup_max {} must satisfy 1 <= min <= max <= {MAX_NGRAM}",
                self.min_n, self.max_n
            ));
        }
        Ok(())
    }

    /// The draft for a sequence of `tokens`, at most `most` tokens: what followed the latest earlier
    /// occurrence of its longest final n-gram (`max_n` down to `min_n`) that occurred before. Empty when
    /// none did. O(tokens × n) at worst.
    pub fn propose(&self, tokens: &[u32], most: usize) -> Vec<u32> {
        let k = self.num_tokens.min(most);
        let len = tokens.len();
        if k == 0 {
            return Vec::new();
        }
        for n in (self.min_n..=self.max_n.min(len.saturating_sub(1))).rev() {
            let pattern = &tokens[len - n..];
            let Some(start) = (0..len - n).rev().find(|&s| tokens[s..s + n] == *pattern) else {
                continue;
            };
            let from = start + n;
            return tokens[from..(from + k).min(len)].to_vec();
        }
        Vec::new()
    }
}

/// The most draft tokens a step checks for one sequence.
pub const MAX_DRAFT_TOKENS: usize = 32;
/// The longest n-gram looked up.
pub const MAX_NGRAM: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: NgramDraft = NgramDraft {
        num_tokens: 3,
        min_n: 1,
        max_n: 3,
    };

    #[test]
    fn the_longest_final_ngram_seen_before_gives_what_followed_it_last() {
        // "5 6 7" occurred at 1 (followed by 8 9 1) and the final "6 7" also at 9 (followed by 4):
        // the longest n-gram wins.
        let tokens = [1, 5, 6, 7, 8, 9, 1, 2, 3, 6, 7, 4, 5, 6, 7];
        assert_eq!(CFG.propose(&tokens, 10), vec![8, 9, 1]);
        // At most `most` tokens, and none past the sequence's end.
        assert_eq!(CFG.propose(&tokens, 2), vec![8, 9]);
        assert_eq!(CFG.propose(&[4, 4], 10), vec![4]);
        // The latest occurrence, for a 1-gram.
        assert_eq!(CFG.propose(&[3, 1, 3, 2, 9, 3], 10), vec![2, 9, 3]);
    }

    #[test]
    fn nothing_is_proposed_without_an_earlier_occurrence() {
        assert!(CFG.propose(&[1, 2, 3, 4], 10).is_empty());
        assert!(CFG.propose(&[], 10).is_empty());
        assert!(CFG.propose(&[7], 10).is_empty());
        assert!(CFG.propose(&[1, 2, 1], 0).is_empty());
        let long = NgramDraft { min_n: 2, ..CFG };
        // "1" occurred before, but no 2-gram did.
        assert!(long.propose(&[1, 2, 3, 1], 10).is_empty());
    }

    #[test]
    fn bad_configurations_are_refused_with_their_bounds() {
        assert!(CFG.check().is_ok());
        for bad in [
            NgramDraft {
                num_tokens: 0,
                ..CFG
            },
            NgramDraft {
                num_tokens: 33,
                ..CFG
            },
            NgramDraft { min_n: 0, ..CFG },
            NgramDraft { min_n: 4, ..CFG },
            NgramDraft { max_n: 17, ..CFG },
        ] {
            let e = bad.check().unwrap_err();
            assert!(
                e.contains("num_speculative_tokens") || e.contains("prompt_lookup"),
                "{e}"
            );
        }
    }
}
