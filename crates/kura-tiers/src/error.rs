//! Errors of the tiers: misuse by a caller, a machine that lacks the memory asked for, and files that fail
//! their checks. Every message names the file concerned and what was wrong with it.

use std::path::PathBuf;

use thiserror::Error;

/// A failure to create a tier or to write to it.
#[derive(Debug, Error)]
pub enum TierError {
    #[error("{0}")]
    BadConfig(String),
    #[error("a host tier of {num_slots} slots of {slot_bytes} bytes does not fit in this machine's address space")]
    TooLarge { num_slots: usize, slot_bytes: usize },
    #[error("cannot allocate the host tier: the allocator refused {bytes} bytes")]
    OutOfMemory {
        bytes: u64,
        #[source]
        source: std::collections::TryReserveError,
    },
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done, as the start of a sentence ("cannot create directory").
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("corrupt disk tier meta file {path}: {what} (fix or delete it; the blocks it seeds are then lost)")]
    BadMeta { path: PathBuf, what: String },
    #[error("a payload of {got} bytes was given to the disk tier at {dir}, whose blocks hold {expected}")]
    PayloadLen {
        dir: PathBuf,
        expected: usize,
        got: usize,
    },
    #[error("block {hash:032x} holds {tokens} tokens; a block file holds at most {max}")]
    TooManyTokens {
        hash: u128,
        tokens: usize,
        max: usize,
    },
}

/// Why reading a block from disk failed.
#[derive(Debug, Error)]
pub enum ReadError {
    /// No file for this block (never written, removed, or deleted after failing a check).
    #[error("block file {path} does not exist")]
    Missing { path: PathBuf },
    /// The file failed a check: it is damaged, or it holds another block than the one expected. The file has
    /// been deleted.
    #[error("block file {path} rejected and deleted: {what}")]
    Corrupt { path: PathBuf, what: Check },
    /// The operating system failed to read the file; it is left in place (Kura's cache manager drops
    /// the block and has the file removed).
    #[error("cannot read block file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The caller's buffer is not one payload long (a bug in the caller; the file is untouched).
    #[error("a read buffer of {got} bytes was given for block file {path}, whose payload holds {expected}")]
    BufferLen {
        path: PathBuf,
        expected: usize,
        got: usize,
    },
}

/// The check a block file failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Check {
    #[error("bad magic (not a Kura KV block file)")]
    Magic,
    #[error("format version {found}, this build reads version 1")]
    Version { found: u32 },
    #[error("impossible header length {found}")]
    HeaderLen { found: u32 },
    #[error("the file ends inside its header")]
    Truncated,
    #[error("header checksum mismatch")]
    HeaderChecksum,
    #[error("written for another model or KV layout (fingerprint {found:032x})")]
    Fingerprint { found: u128 },
    #[error("payload of {found} bytes, this store's blocks hold {expected}")]
    PayloadLen { found: u64, expected: u64 },
    #[error("the file is {found} bytes, its header says {expected}")]
    FileSize { found: u64, expected: u64 },
    #[error("the file name is not the block hash of its header, or not a block file name")]
    FileName,
    #[error("holds block {found:032x}, not the one asked for")]
    BlockHash { found: u128 },
    #[error("holds another parent block than expected")]
    ParentHash,
    #[error("holds another cache key digest than expected")]
    KeyDigest,
    #[error("holds other tokens than expected")]
    Tokens,
    #[error("payload checksum mismatch")]
    PayloadChecksum,
    #[error("written under the hash seed of a meta file that is gone (its blocks' names can never be asked for)")]
    SeedLost,
    #[error("not a regular file (a directory, FIFO, socket or device) where a block file belongs")]
    NotRegular,
    #[error(
        "its parent chain comes back to it (a block's hash covers its parent's: damaged or forged)"
    )]
    ParentCycle,
}

impl Check {
    /// Whether the file is intact but belongs to another configuration (another model fingerprint or payload
    /// size, or a hash seed no longer known), as opposed to being damaged or holding another block.
    pub fn is_foreign(&self) -> bool {
        matches!(
            self,
            Check::Fingerprint { .. } | Check::PayloadLen { .. } | Check::SeedLost
        )
    }
}
