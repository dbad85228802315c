//! Errors of the cache manager: misuse by a caller, reported with what was wrong. Running out of blocks is
//! not an error (see `KvCacheManager::allocate_slots`).

use thiserror::Error;

use crate::manager::SeqId;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum KvError {
    #[error("invalid KV cache configuration: {0}")]
    Config(String),
    #[error("unknown or freed sequence {0:?}")]
    UnknownSequence(SeqId),
    #[error(
        "a prefix hit can only start an empty sequence; {seq:?} already holds {num_tokens} tokens"
    )]
    HitOnNonEmptySequence { seq: SeqId, num_tokens: usize },
    #[error("the prefix hit was looked up under another cache key than {seq:?} was created with")]
    HitKeyMismatch { seq: SeqId },
    #[error("the prefix hit is stale: block {block} changed since the lookup (look up again)")]
    StaleHit { block: u32 },
    #[error("{seq:?} marked {upto} tokens computed but holds only {num_tokens}")]
    ComputedBeyondEnd {
        seq: SeqId,
        upto: usize,
        num_tokens: usize,
    },
    #[error(
        "{seq:?} marked block {block} computed, but another sequence is computing it (wait for it)"
    )]
    NotWriter { seq: SeqId, block: u32 },
    #[error("{seq:?} cannot be forked with {uncomputed} uncomputed tokens")]
    ForkUncomputed { seq: SeqId, uncomputed: usize },
    #[error("the prefix hit is stale: the {tier} tier's slot {slot} changed since the lookup (look up again)")]
    StaleTierHit { tier: &'static str, slot: u32 },
    #[error("block {0} is not being loaded from a tier")]
    UnknownLoad(u32),
    #[error("unknown or released pin {0}")]
    UnknownPin(u32),
    #[error("retention range [{start}, {end}) is empty or priority {priority} exceeds {max}")]
    BadRetention {
        start: usize,
        end: usize,
        priority: u8,
        max: u8,
    },
    #[error("{seq:?} would compute tokens {start}..{end} but holds {num_tokens}")]
    ComputeRange {
        seq: SeqId,
        start: usize,
        end: usize,
        num_tokens: usize,
    },
    #[error("block {block} has KV but lost its sliding layers' pages, which {seq:?} still reads")]
    WindowLost { seq: SeqId, block: u32 },
    #[error("{seq:?}: {why}")]
    Draft { seq: SeqId, why: &'static str },
    #[error("{seq:?} keeps {keep} tokens of a draft that spans {from}..{num_tokens}")]
    DraftKeep {
        seq: SeqId,
        keep: usize,
        from: usize,
        num_tokens: usize,
    },
}
