//! Deterministic prompt text of a given token length.
//!
//! Text is a seeded stream of common English words. Each word with its leading space is one token in the
//! byte-pair vocabularies of the Llama, GPT-2 and SmolLM families, so a word count is a good first guess of
//! a token count. When the server exposes its tokenizer, [`TokenCounter::text_of`] then calibrates the text
//! to the exact count (a few `/tokenize` calls: adjust the number of words by the remaining difference,
//! bisect if that oscillates, pad with one-token words when no whole-word prefix lands exactly); otherwise
//! the word count stands and the run says its lengths are approximate.

use serde::{Deserialize, Serialize};

use crate::client::RemoteTokenizer;
use crate::rng::Rng;
use crate::BenchError;

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "that",
    "with",
    "on",
    "as",
    "by",
    "at",
    "from",
    "this",
    "be",
    "are",
    "was",
    "it",
    "an",
    "or",
    "not",
    "have",
    "which",
    "all",
    "can",
    "more",
    "their",
    "will",
    "one",
    "about",
    "time",
    "year",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "president",
    "team",
    "minute",
    "idea",
    "kid",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "others",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
    "good",
    "new",
    "first",
    "last",
    "long",
    "great",
    "little",
    "own",
    "other",
    "old",
    "big",
    "high",
    "different",
    "small",
    "large",
    "next",
    "early",
    "young",
    "important",
    "few",
    "public",
    "bad",
    "same",
    "able",
    "make",
    "know",
    "take",
    "see",
    "come",
    "think",
    "look",
    "want",
    "give",
    "use",
    "find",
    "tell",
    "ask",
    "seem",
    "feel",
    "try",
    "leave",
    "call",
    "keep",
    "let",
    "begin",
    "help",
    "show",
    "hear",
    "play",
    "run",
    "move",
    "live",
    "believe",
    "hold",
    "bring",
    "happen",
    "write",
    "provide",
    "sit",
    "stand",
    "lose",
    "pay",
    "meet",
    "include",
    "continue",
    "set",
    "learn",
    "lead",
    "understand",
    "watch",
    "follow",
    "stop",
    "create",
    "speak",
    "read",
    "spend",
    "grow",
    "open",
    "walk",
    "win",
    "offer",
    "remember",
    "love",
    "consider",
    "appear",
    "buy",
    "wait",
    "serve",
    "die",
    "send",
    "expect",
    "build",
    "stay",
    "fall",
    "cut",
    "reach",
    "kill",
    "remain",
    "suggest",
    "raise",
    "pass",
    "sell",
    "require",
    "report",
    "decide",
    "pull",
    "river",
    "market",
    "light",
    "paper",
    "music",
    "color",
    "field",
    "road",
    "table",
    "tree",
    "stone",
    "garden",
    "window",
    "letter",
    "season",
    "island",
];

/// Words that pad a text by one token each when no whole-word prefix of the stream hits the target.
const PAD_WORD: &str = " the";

/// An endless seeded stream of words.
#[derive(Debug, Clone)]
pub struct WordStream {
    rng: Rng,
}

impl WordStream {
    pub fn new(rng: Rng) -> Self {
        Self { rng }
    }

    /// The next `n` words, space-separated, with a leading space (so pieces concatenate cleanly).
    pub fn take(&mut self, n: usize) -> String {
        let mut s = String::with_capacity(n * 7);
        for _ in 0..n {
            s.push(' ');
            s.push_str(WORDS[self.rng.below(WORDS.len())]);
        }
        s
    }
}

/// How prompt lengths were obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenCounting {
    /// Counted by the server's own tokenizer.
    Exact,
    /// One token per word assumed (the server has no tokenizer endpoint).
    Approximate,
}

/// Counts tokens with the server's tokenizer when there is one.
#[derive(Debug, Clone)]
pub enum TokenCounter {
    Server(RemoteTokenizer),
    Approximate,
}

/// A piece of prompt text and its length in tokens (exact or estimated, per [`TokenCounter`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sized {
    pub text: String,
    pub tokens: usize,
}

impl TokenCounter {
    pub fn counting(&self) -> TokenCounting {
        match self {
            TokenCounter::Server(_) => TokenCounting::Exact,
            TokenCounter::Approximate => TokenCounting::Approximate,
        }
    }

    /// The length of a fixed text (exact with the server's tokenizer, else its word count).
    pub async fn sized(&self, text: &str) -> Result<Sized, BenchError> {
        let tokens = match self {
            TokenCounter::Server(tok) => tok.count(text).await?,
            TokenCounter::Approximate => text.split_whitespace().count(),
        };
        Ok(Sized {
            text: text.to_string(),
            tokens,
        })
    }

    /// Text of `target` tokens drawn from the seeded stream `rng`. The text is a prefix-extension of the
    /// stream: two calls with equal streams and targets give equal text, and a shorter target gives
    /// (approximately) a prefix of a longer one.
    pub async fn text_of(&self, rng: Rng, target: usize) -> Result<Sized, BenchError> {
        let tok = match self {
            TokenCounter::Approximate => {
                return Ok(Sized {
                    text: WordStream::new(rng).take(target),
                    tokens: target,
                })
            }
            TokenCounter::Server(tok) => tok,
        };
        calibrate(async |text: &str| tok.count(text).await, rng, target).await
    }
}

/// Text of exactly `target` tokens by `count` where whole words and one-token padding allow (see the
/// module doc), else the closest found. At most ~28 calls of `count`.
async fn calibrate(
    count: impl AsyncFn(&str) -> Result<usize, BenchError>,
    rng: Rng,
    target: usize,
) -> Result<Sized, BenchError> {
    if target == 0 {
        return Ok(Sized {
            text: String::new(),
            tokens: 0,
        });
    }
    // Word i of the stream must not depend on how many words were asked for: generate once, slice.
    let pool: Vec<String> = {
        let mut stream = WordStream::new(rng);
        (0..target * 2 + 16).map(|_| stream.take(1)).collect()
    };
    let text_of_words = |n: usize| pool[..n.min(pool.len())].concat();
    // lo: most words known to give <= target tokens; hi: fewest known to give > target.
    let (mut lo, mut lo_tokens) = (0usize, 0usize);
    let mut hi = pool.len() + 1;
    let mut words = target.min(pool.len());
    for _ in 0..24 {
        let n = count(&text_of_words(words)).await?;
        if n == target {
            return Ok(Sized {
                text: text_of_words(words),
                tokens: n,
            });
        }
        if n < target {
            (lo, lo_tokens) = (words, n);
        } else {
            hi = words;
        }
        if hi - lo <= 1 {
            break;
        }
        // Step by the remaining difference (each word is at least one token), kept inside (lo, hi).
        let guess = if n < target {
            words + (target - n)
        } else {
            words.saturating_sub(n - target)
        };
        words = if guess > lo && guess < hi {
            guess
        } else {
            lo + (hi - lo) / 2
        };
    }
    // No whole-word prefix lands on the target: pad the longest one below it with one-token words.
    let base = text_of_words(lo);
    let mut pad = target - lo_tokens;
    let mut best = Sized {
        text: base.clone(),
        tokens: lo_tokens,
    };
    for _ in 0..4 {
        let text = format!("{base}{}", PAD_WORD.repeat(pad));
        let n = count(&text).await?;
        if n.abs_diff(target) < best.tokens.abs_diff(target) || n == target {
            best = Sized { text, tokens: n };
        }
        if n == target || pad == 0 {
            break;
        }
        pad = if n < target {
            pad + (target - n)
        } else {
            pad.saturating_sub(n - target)
        };
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_stream_is_deterministic_and_seed_dependent() {
        let a = WordStream::new(Rng::stream(1, &[2])).take(50);
        let b = WordStream::new(Rng::stream(1, &[2])).take(50);
        let c = WordStream::new(Rng::stream(1, &[3])).take(50);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.split_whitespace().count(), 50);
        assert!(a.starts_with(' '));
    }

    /// A stand-in tokenizer for the search logic only: words of more than 5 letters cost two tokens,
    /// and a text costs one extra (as if a prefix token were added).
    async fn uneven(text: &str) -> Result<usize, BenchError> {
        Ok(1 + text
            .split_whitespace()
            .map(|w| if w.len() > 5 { 2 } else { 1 })
            .sum::<usize>())
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    #[test]
    fn calibration_hits_exact_counts_with_uneven_tokens() {
        for target in [1, 2, 7, 50, 512, 1000] {
            for seed in 0..5 {
                let s = block_on(calibrate(uneven, Rng::stream(seed, &[9]), target)).unwrap();
                assert_eq!(s.tokens, target, "target {target} seed {seed}");
                assert_eq!(block_on(uneven(&s.text)).unwrap(), target);
            }
        }
        // Deterministic, and a shorter target is a prefix of a longer one (up to padding).
        let a = block_on(calibrate(uneven, Rng::new(3), 300)).unwrap();
        let b = block_on(calibrate(uneven, Rng::new(3), 300)).unwrap();
        assert_eq!(a, b);
        let short = block_on(calibrate(uneven, Rng::new(3), 100)).unwrap();
        let head: String = short
            .text
            .split(" the")
            .next()
            .unwrap_or_default()
            .to_string();
        assert!(a.text.starts_with(&head));
    }

    #[test]
    fn vocabulary_words_are_plain_lowercase() {
        assert!(WORDS
            .iter()
            .all(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase())));
    }
}
