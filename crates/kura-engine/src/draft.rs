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

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// How drafts are found (`kura serve --speculative-config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramDraft {
    /// Most draft tokens a step checks for one sequence.
    pub num_tokens: usize,
    /// Shortest and longest n-gram at the sequence's end that is looked up (the longest found first).
    pub min_n: usize,
    pub max_n: usize,
    /// Drafting pauses for a step in which at least this many sequences decode (vLLM's
    /// `disable_by_batch_size`): a full batch's step is no longer bound by reading the weights, and
    /// each draft token then costs about what a token of its own would. `None`: never paused.
    pub disable_by_batch_size: Option<usize>,
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
        if let Some(n) = self.disable_by_batch_size {
            if n < 2 {
                return Err(format!(
                    "disable_by_batch_size {n} must be at least 2 (drafting pauses in a step where that \
                     many sequences decode; leave it out to draft at any batch size)"
                ));
            }
        }
        Ok(())
    }

    /// Whether a step in which `decoding` sequences decode checks drafts at all
    /// ([`NgramDraft::disable_by_batch_size`]).
    pub fn drafts_at(&self, decoding: usize) -> bool {
        self.disable_by_batch_size.is_none_or(|n| decoding < n)
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
            if let Some(end) = earlier_end(tokens, n) {
                return tokens[end..(end + k).min(len)].to_vec();
            }
        }
        Vec::new()
    }

    /// [`NgramDraft::propose`]'s draft, the same tokens, found through `index` (the sequence's
    /// n-grams by where each last ended) instead of a scan: each call indexes the n-grams that end at
    /// the tokens appended since the last (O(new tokens × n-gram lengths)) and looks up the final
    /// n-gram of each length (O(lengths × n)), so a step's lookups cost the same at any context
    /// length. `index` belongs to one sequence whose tokens only grow; one that is shorter than
    /// what was indexed is indexed again from its start. Where two n-grams share a hash the latest
    /// occurrence is found by a scan, as `propose` does.
    pub fn propose_indexed(&self, index: &mut NgramIndex, tokens: &[u32], most: usize) -> Vec<u32> {
        let k = self.num_tokens.min(most);
        let len = tokens.len();
        if u32::try_from(len).is_err() {
            return self.propose(tokens, most);
        }
        // Indexed for other lengths, or for tokens these are not (fewer, or another last token
        // where the index ended): indexed again from the start.
        let same = index.lengths == (self.min_n, self.max_n)
            && len > index.ended
            && (index.ended == 0 || tokens[index.ended - 1] == index.last);
        if !same {
            let lengths = self.max_n - self.min_n + 1;
            index.latest = (0..lengths)
                .map(|_| HashMap::with_capacity_and_hasher(len, Default::default()))
                .collect();
            index.lengths = (self.min_n, self.max_n);
            index.ended = 0;
        }
        // The n-grams ending before the last token: every occurrence but the final one.
        for end in index.ended + 1..len {
            let mut h = HASH_SEED;
            for n in 1..=self.max_n.min(end) {
                h = mix(h, tokens[end - n]);
                if n >= self.min_n {
                    index.latest[n - self.min_n].insert(h & index.mask, end as u32);
                }
            }
        }
        index.ended = index.ended.max(len.saturating_sub(1));
        if index.ended > 0 {
            index.last = tokens[index.ended - 1];
        }
        if k == 0 {
            return Vec::new();
        }
        let longest = self.max_n.min(len.saturating_sub(1));
        if longest < self.min_n {
            return Vec::new();
        }
        let mut hashes = [0u64; MAX_NGRAM + 1];
        let mut h = HASH_SEED;
        for n in 1..=longest {
            h = mix(h, tokens[len - n]);
            hashes[n] = h & index.mask;
        }
        for n in (self.min_n..=longest).rev() {
            let pattern = &tokens[len - n..];
            let Some(&end) = index.latest[n - self.min_n].get(&hashes[n]) else {
                continue;
            };
            let end = end as usize;
            let end = if tokens[end - n..end] == *pattern {
                end
            } else {
                // Another n-gram with the same hash occurred last: the scan finds this one's latest.
                match earlier_end(tokens, n) {
                    Some(end) => end,
                    None => continue,
                }
            };
            return tokens[end..(end + k).min(len)].to_vec();
        }
        Vec::new()
    }
}

/// Where the latest occurrence of `tokens`' final `n`-gram before the final one ends (exclusive), by a
/// scan back from the end.
fn earlier_end(tokens: &[u32], n: usize) -> Option<usize> {
    let len = tokens.len();
    let pattern = &tokens[len - n..];
    (0..len - n)
        .rev()
        .find(|&s| tokens[s..s + n] == *pattern)
        .map(|s| s + n)
}

/// A sequence's n-grams of the lengths an [`NgramDraft`] looks up, by where each last ended
/// ([`NgramDraft::propose_indexed`]): a hash and a position per n-gram length per token, 16 bytes and
/// a control byte in a hash table at most 7/8 full — 20 to 40 bytes a token for each length (one
/// length with vLLM's 5 to 5 lookup; the KV of a token is 23 KB for SmolLM2 in bf16, 128 KiB for
/// Llama-3.1-8B). The engine drops a sequence's index when it is preempted.
#[derive(Debug)]
pub struct NgramIndex {
    /// Per n-gram length (`n - min_n`): an n-gram's hash → the end (exclusive) of its latest indexed
    /// occurrence.
    latest: Vec<HashMap<u64, u32, BuildHasherDefault<Mixed>>>,
    /// The shortest and longest length indexed.
    lengths: (usize, usize),
    /// The n-grams ending at positions `1..=ended` are indexed, and `last` is the token before
    /// `ended` (a sequence whose token there differs is not the one indexed).
    ended: usize,
    last: u32,
    /// The hash bits kept (all; fewer in tests, to make n-grams share hashes).
    mask: u64,
}

impl Default for NgramIndex {
    fn default() -> Self {
        NgramIndex {
            latest: Vec::new(),
            lengths: (0, 0),
            ended: 0,
            last: 0,
            mask: u64::MAX,
        }
    }
}

impl NgramIndex {
    /// n-grams indexed, over every length.
    pub fn len(&self) -> usize {
        self.latest.iter().map(HashMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

const HASH_SEED: u64 = 0x243f_6a88_85a3_08d3;

/// An n-gram's hash extended by one more token at its front.
fn mix(h: u64, token: u32) -> u64 {
    (h ^ u64::from(token))
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .rotate_left(29)
}

/// The hasher of keys that are hashes already: their bits folded, high into low.
#[derive(Default)]
struct Mixed(u64);

impl Hasher for Mixed {
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 32)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) ^ u64::from(b) ^ (self.0 >> 56);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// The most tokens a sequence's next draft may have, after a draft of `drafted` tokens of which it
/// kept `kept`: one more than it kept where it turned a token down (a draft longer than that would
/// likely be turned down at the same distance again, and each token turned down costs a position's
/// compute), all of `most` (`num_speculative_tokens`) again where it kept them all (text that
/// repeats goes on repeating); never below 1. Which tokens are drawn never depends on it.
pub fn next_room(drafted: usize, kept: usize, most: usize) -> usize {
    let next = if kept < drafted { kept + 1 } else { most };
    next.clamp(1, most.max(1))
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
        disable_by_batch_size: None,
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

    /// A sequence of `len` tokens from a vocabulary of `vocab` (xorshift, seeded): small vocabularies
    /// repeat n-grams of every length.
    fn random_tokens(len: usize, vocab: u32, seed: u64) -> Vec<u32> {
        let mut x = seed.max(1);
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % u64::from(vocab)) as u32
            })
            .collect()
    }

    #[test]
    fn the_index_proposes_what_the_scan_does_as_a_sequence_grows() {
        // Grown a token (or a few) at a time, as a decoding sequence is, from vocabularies that repeat
        // n-grams of every length, with lookups of several ranges and lengths: every draft the scan's.
        // With 3 hash bits nearly every lookup meets another n-gram's hash first (the scan's path).
        let mut drafted = 0;
        for (seed, vocab) in [(1u64, 2u32), (2, 3), (3, 5), (4, 40)] {
            for (min_n, max_n, num_tokens) in [(1, 3, 3), (2, 4, 4), (5, 5, 4), (1, 16, 32)] {
                for mask in [u64::MAX, 0b111] {
                    let d = NgramDraft {
                        num_tokens,
                        min_n,
                        max_n,
                        disable_by_batch_size: None,
                    };
                    let tokens = random_tokens(300, vocab, seed);
                    let mut index = NgramIndex {
                        mask,
                        ..NgramIndex::default()
                    };
                    let mut len = 0;
                    let mut step = 0;
                    while len < tokens.len() {
                        len = (len + 1 + step % 3).min(tokens.len());
                        step += 1;
                        let most = step % 7;
                        let want = d.propose(&tokens[..len], most);
                        let got = d.propose_indexed(&mut index, &tokens[..len], most);
                        assert_eq!(got, want, "{d:?}, vocab {vocab}, mask {mask}, {len} tokens");
                        drafted += usize::from(!got.is_empty());
                    }
                }
            }
        }
        assert!(
            drafted > 1000,
            "only {drafted} drafts: the sequences do not repeat"
        );
    }

    #[test]
    fn the_index_holds_an_entry_per_ngram_and_starts_again_for_a_shorter_sequence() {
        let d = NgramDraft {
            num_tokens: 4,
            min_n: 2,
            max_n: 4,
            disable_by_batch_size: None,
        };
        let tokens = random_tokens(1000, 1 << 20, 9);
        let mut index = NgramIndex::default();
        assert!(d.propose_indexed(&mut index, &tokens, 4).is_empty());
        // The n-grams ending at positions 2..=999 (of lengths 2 to 4, all distinct): 998 + 997 + 996.
        assert_eq!(index.len(), 998 + 997 + 996);
        // Another sequence, shorter: indexed from its start, as the scan reads it.
        let other = [7, 8, 9, 7, 8];
        assert_eq!(d.propose_indexed(&mut index, &other, 4), vec![9, 7, 8]);
        assert_eq!(
            d.propose_indexed(&mut index, &other, 4),
            d.propose(&other, 4)
        );
        assert_eq!(index.len(), 3 + 2 + 1);
        // A configuration of other lengths starts again too, also with as many lengths.
        for (min_n, max_n) in [(1, 1), (3, 5), (1, 3)] {
            let other_lengths = NgramDraft { min_n, max_n, ..d };
            let more = [7, 8, 9, 7, 8, 9, 7, 8];
            assert_eq!(
                other_lengths.propose_indexed(&mut index, &more, 4),
                other_lengths.propose(&more, 4),
                "{min_n} to {max_n}"
            );
        }
        // A sequence as long, or longer, whose token where the index ended differs: indexed again.
        let a = [1, 2, 3, 1, 2, 3, 1, 2];
        let b = [5, 6, 5, 6, 5, 6, 5, 6, 5];
        assert_eq!(d.propose_indexed(&mut index, &a, 4), d.propose(&a, 4));
        assert_eq!(d.propose_indexed(&mut index, &b, 4), d.propose(&b, 4));
    }

    #[test]
    fn a_draft_turned_down_leaves_room_for_one_more_than_it_kept_and_one_kept_whole_for_all() {
        // Turned down at its first token: room for 1; at its third: for 3.
        assert_eq!(next_room(4, 0, 4), 1);
        assert_eq!(next_room(4, 2, 4), 3);
        // Kept whole (also a draft shorter than the most): room for the most again.
        assert_eq!(next_room(1, 1, 4), 4);
        assert_eq!(next_room(2, 2, 4), 4);
        assert_eq!(next_room(0, 0, 32), 32);
        // Never below 1, nor above the most.
        assert_eq!(next_room(0, 0, 0), 1);
        assert_eq!(next_room(9, 8, 4), 4);
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
            NgramDraft {
                disable_by_batch_size: Some(1),
                ..CFG
            },
        ] {
            let e = bad.check().unwrap_err();
            assert!(
                e.contains("num_speculative_tokens")
                    || e.contains("prompt_lookup")
                    || e.contains("disable_by_batch_size 1 must be at least 2"),
                "{e}"
            );
        }
        let paused = NgramDraft {
            disable_by_batch_size: Some(4),
            ..CFG
        };
        assert!(paused.check().is_ok());
        assert!(paused.drafts_at(3) && !paused.drafts_at(4) && !paused.drafts_at(9));
        assert!(CFG.drafts_at(1 << 20));
    }
}
