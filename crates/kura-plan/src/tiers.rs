//! The lower KV tiers of `kura serve` in the plan: a host-memory tier (L2, `--kv-host-memory`) and a disk
//! tier (L3, `--kv-disk-path`, `--kv-disk-size`).
//!
//! The planner does not count their blocks itself: the caller counts them with the server's own code over
//! [`crate::PlanRequest::pool_layout`] (the kura binary's `tiers` module, which `kura serve` runs), so that
//! the two cannot disagree, and hands them over as [`LowerTiers`]. The planner turns them into bytes and
//! tokens ([`TierReport`]) and, where the host tier shares the memory of the breakdown (on the CPU, the
//! pool and the host tier are the same RAM), counts it there:
//!
//! ```text
//! host_bytes  = host_blocks × bytes_per_block                         (what the host arena allocates)
//! disk_bytes  = disk_blocks × (header + bytes_per_block)              (one file per block)
//! tokens      = blocks × block_size
//! ```

use kura_kv::OffloadPolicy;
use serde::Serialize;

/// What a preemption does with a request's blocks (`--preemption-mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Preemption {
    /// Blocks stay cached in the pool; what it evicts meanwhile is recomputed.
    #[default]
    Recompute,
    /// Blocks are copied to the host tier and loaded back on resumption.
    Swap,
}

impl Preemption {
    pub fn as_str(self) -> &'static str {
        match self {
            Preemption::Recompute => "recompute",
            Preemption::Swap => "swap",
        }
    }
}

/// The lower tiers as `kura serve` sizes them from its flags, per device. The default is no tier.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LowerTiers {
    /// `--kv-host-memory` in bytes, as given (0 = off).
    pub host_memory_bytes: u64,
    /// Blocks of the host tier: whole blocks of the pool's size within `host_memory_bytes`.
    pub host_blocks: u32,
    /// The disk tier, if `--kv-disk-path` is given.
    pub disk: Option<DiskTier>,
    pub policy: OffloadPolicy,
    pub preemption: Preemption,
}

/// The disk tier (L3) as `kura serve` sizes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskTier {
    /// `--kv-disk-path`.
    pub path: String,
    /// `--kv-disk-size`: the most bytes its files take.
    pub size_bytes: u64,
    /// Bytes of one block file: a header (block identity and tokens) and the block.
    pub block_file_bytes: u64,
    /// Block files within `size_bytes`.
    pub blocks: u32,
}

/// The lower tiers in a [`crate::PlanReport`] (`kv_tiers` in the JSON), per device. A tier that is off has
/// 0 blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TierReport {
    /// `--kv-host-memory` as given.
    pub host_memory_bytes: u64,
    /// Bytes the host tier allocates: `host_blocks × bytes_per_block`. Host memory on top of the pool.
    pub host_bytes: u64,
    pub host_blocks: u64,
    pub host_tokens: u64,
    /// Whether the host tier is a term of the memory breakdown: on the CPU the pool and the host tier
    /// are the same RAM, so it is counted when the plan works from the memory (not from
    /// `--kv-cache-memory`); on an accelerator it is the host's memory, not the device's.
    pub host_in_breakdown: bool,
    pub disk_path: Option<String>,
    /// `--kv-disk-size` (0 without a disk tier).
    pub disk_size_bytes: u64,
    /// One block file: header and block.
    pub disk_block_file_bytes: u64,
    /// Bytes the disk tier's files take when full: `disk_blocks × disk_block_file_bytes`.
    pub disk_bytes: u64,
    pub disk_blocks: u64,
    pub disk_tokens: u64,
    /// `write-back` or `write-through`, as `--kv-offload-policy` spells it.
    pub offload_policy: &'static str,
    /// Hits before a block is copied down, under `write-through`.
    pub offload_min_hits: Option<u32>,
    pub preemption_mode: Preemption,
}

impl TierReport {
    /// The report of `tiers` for blocks of `bytes_per_block` bytes and `block_size` tokens; `None` when
    /// a byte count leaves 64 bits.
    pub(crate) fn new(
        tiers: &LowerTiers,
        bytes_per_block: u64,
        block_size: u64,
        host_in_breakdown: bool,
    ) -> Option<TierReport> {
        let host_blocks = u64::from(tiers.host_blocks);
        let (disk_path, disk_size_bytes, disk_block_file_bytes, disk_blocks) = match &tiers.disk {
            Some(d) => (
                Some(d.path.clone()),
                d.size_bytes,
                d.block_file_bytes,
                u64::from(d.blocks),
            ),
            None => (None, 0, 0, 0),
        };
        let (offload_policy, offload_min_hits) = match tiers.policy {
            OffloadPolicy::WriteBack => ("write-back", None),
            OffloadPolicy::WriteThrough { min_hits } => ("write-through", Some(min_hits)),
        };
        Some(TierReport {
            host_memory_bytes: tiers.host_memory_bytes,
            host_bytes: host_blocks.checked_mul(bytes_per_block)?,
            host_blocks,
            host_tokens: host_blocks.checked_mul(block_size)?,
            host_in_breakdown: host_in_breakdown && host_blocks > 0,
            disk_path,
            disk_size_bytes,
            disk_block_file_bytes,
            disk_bytes: disk_blocks.checked_mul(disk_block_file_bytes)?,
            disk_blocks,
            disk_tokens: disk_blocks.checked_mul(block_size)?,
            offload_policy,
            offload_min_hits,
            preemption_mode: tiers.preemption,
        })
    }
}
