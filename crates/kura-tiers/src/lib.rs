//! `kura-tiers` — the byte stores of Kura's lower KV-cache tiers: host memory ([`host`], L2), local disk
//! ([`disk`], L3, with its I/O thread in [`worker`]) and Redis shared by a fleet ([`remote`], L4).
//!
//! This crate stores and returns bytes; it does not decide what to keep. Which block lives in which tier, and
//! when it moves, is the cache manager's business: here a block is only a [`BlockRecord`] (its identity) and
//! an opaque payload of a fixed size.

pub mod disk;
pub mod error;
pub mod host;
pub mod remote;
pub mod worker;

pub use disk::{
    block_file_bytes, decode_record, encode_record, BlockRecord, DiskStore, ScanReport,
};
pub use error::{Check, ReadError, TierError};
pub use host::HostArena;
pub use remote::{redact_url, FetchDone, RemoteSetup, RemoteStats, RemoteWorker};
pub use worker::{DiskJob, DiskStats, DiskWorker, ReadDone};
