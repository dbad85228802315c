//! The lower KV tiers' flags, shared by `kura serve` and `kura plan` (the same clap arguments, defaults,
//! checks and messages), and their sizes in blocks as the server counts them: the host tier (L2) in
//! blocks of the pool's size, the disk tier (L3) in block files (a header and the block,
//! `kura_tiers::block_file_bytes`).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use kura_engine::PreemptionMode;
use kura_kv::layout::KvLayout;
use kura_kv::units::{format_bytes, parse_bytes};
use kura_kv::OffloadPolicy;

/// The lower KV tiers: where blocks evicted from the pool go instead of being dropped.
#[derive(Args, Debug, Clone)]
pub struct TierArgs {
    /// Host-memory KV tier (L2): blocks evicted from the pool are copied here and loaded back on a
    /// prefix hit instead of being recomputed. A size (`4GiB`); 0 = off. Checked against the memory
    /// available once the pool is allocated.
    #[arg(long, default_value = "0")]
    pub kv_host_memory: String,
    /// Directory of the disk KV tier (L3): blocks evicted from the host tier (or from the pool, without
    /// one) are written here, checksummed, and kept across restarts. Off without a path.
    #[arg(long)]
    pub kv_disk_path: Option<PathBuf>,
    /// Most bytes the disk tier's files take (`20GiB`); the budget holds across restarts.
    #[arg(long, default_value = "10GiB")]
    pub kv_disk_size: String,
    /// When blocks are copied down: `write-back` (when evicted from the tier above; the default) or
    /// `write-through` (also as soon as a block has been hit --kv-offload-min-hits times).
    #[arg(long, value_enum, default_value_t = OffloadArg::WriteBack)]
    pub kv_offload_policy: OffloadArg,
    /// With `--kv-offload-policy write-through`: hits before a block is copied down (0: as soon as it
    /// is computed). Blocks reused are the ones worth keeping.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub kv_offload_min_hits: u32,
    /// Blocks of the pool kept free or already copied to the host tier ahead of their eviction, so
    /// that a step reusing an evicted block waits for no copy. Default: on a GPU (whose copies run
    /// beside the forward passes), the blocks one step can take; on the CPU none. 0 = off. At most
    /// half the host tier and the pool.
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=100_000_000))]
    pub kv_store_ahead: Option<u32>,
    /// What preemption does with a request's blocks: `swap` copies them to the host tier and loads
    /// them back on resumption (the default with --kv-host-memory), `recompute` recomputes what the
    /// pool evicted meanwhile (the default without).
    #[arg(long, value_enum)]
    pub preemption_mode: Option<PreemptionMode>,
}

/// `--kv-offload-policy`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffloadArg {
    WriteBack,
    WriteThrough,
}

/// The lower tiers as sizes in bytes, before the model is known.
#[derive(Debug, Clone)]
pub struct TierSizes {
    pub host_bytes: u64,
    pub disk: Option<(PathBuf, u64)>,
    pub policy: OffloadPolicy,
    pub preemption: PreemptionMode,
    /// `--kv-store-ahead`, where given.
    pub store_ahead: Option<u32>,
}

impl TierArgs {
    /// Checks the flags alone (sizes, combinations); the memory check comes once the pool is allocated.
    pub fn sizes(&self) -> Result<TierSizes> {
        let host_bytes = parse_bytes(&self.kv_host_memory)
            .with_context(|| format!("--kv-host-memory {:?}", self.kv_host_memory))?;
        let disk = match &self.kv_disk_path {
            Some(dir) => {
                if dir.as_os_str().is_empty() {
                    bail!("--kv-disk-path must not be empty");
                }
                let bytes = parse_bytes(&self.kv_disk_size)
                    .with_context(|| format!("--kv-disk-size {:?}", self.kv_disk_size))?;
                if bytes == 0 {
                    bail!("--kv-disk-size must be more than 0 bytes (drop --kv-disk-path to turn the disk tier off)");
                }
                Some((dir.clone(), bytes))
            }
            None => None,
        };
        let policy = match self.kv_offload_policy {
            OffloadArg::WriteBack => OffloadPolicy::WriteBack,
            OffloadArg::WriteThrough => {
                if host_bytes == 0 && disk.is_none() {
                    bail!("--kv-offload-policy write-through needs a lower tier: give --kv-host-memory or --kv-disk-path");
                }
                OffloadPolicy::WriteThrough {
                    min_hits: self.kv_offload_min_hits,
                }
            }
        };
        if self.kv_store_ahead.is_some_and(|n| n > 0) && host_bytes == 0 {
            bail!("--kv-store-ahead needs a host tier to store into: give --kv-host-memory");
        }
        let preemption = match self.preemption_mode {
            Some(PreemptionMode::Swap) if host_bytes == 0 => {
                bail!("--preemption-mode swap needs a host tier to swap to: give --kv-host-memory")
            }
            Some(mode) => mode,
            None if host_bytes > 0 => PreemptionMode::Swap,
            None => PreemptionMode::Recompute,
        };
        Ok(TierSizes {
            host_bytes,
            disk,
            policy,
            preemption,
            store_ahead: self.kv_store_ahead,
        })
    }
}

impl TierSizes {
    /// Blocks of the host tier for blocks of `block_bytes`.
    pub fn host_blocks(&self, block_bytes: u64) -> Result<u32> {
        let n = blocks_in(self.host_bytes, block_bytes, "--kv-host-memory")?;
        if n == 0 && self.host_bytes > 0 {
            bail!(
                "--kv-host-memory {} holds no KV block: one block takes {}; give at least that (or 0 \
                 for no host tier)",
                format_bytes(self.host_bytes),
                format_bytes(block_bytes)
            );
        }
        Ok(n)
    }

    /// Blocks the disk budget holds (each file is a header and the block).
    pub fn disk_blocks(&self, layout: &KvLayout) -> Result<u32> {
        let Some((_, bytes)) = &self.disk else {
            return Ok(0);
        };
        let file = block_file_bytes(layout)?;
        let n = blocks_in(*bytes, file, "--kv-disk-size")?;
        if n == 0 {
            bail!(
                "--kv-disk-size {} holds no KV block: one block file takes {}; give at least that",
                format_bytes(*bytes),
                format_bytes(file)
            );
        }
        Ok(n)
    }
}

/// Bytes of one disk tier file of a block of `layout`: a header (its identity and tokens) and the block.
pub fn block_file_bytes(layout: &KvLayout) -> Result<u64> {
    Ok(kura_tiers::block_file_bytes(
        layout.block_size_tokens,
        usize::try_from(layout.bytes_per_block()).context("KV block size")?,
    ))
}

/// How many `unit`-byte blocks `bytes` holds, as a block count the KV manager takes.
fn blocks_in(bytes: u64, unit: u64, flag: &str) -> Result<u32> {
    let n = bytes / unit.max(1);
    u32::try_from(n).map_err(|_| {
        anyhow::anyhow!(
            "{flag} {} holds {n} KV blocks of {}, more than the {} a tier indexes: give less",
            format_bytes(bytes),
            format_bytes(unit),
            u32::MAX
        )
    })
}
