//! Counters of the cache's work, cheap enough to be always on (plain integer increments), and the usage
//! snapshot that the server exports as gauges.

/// Monotonic counters since the manager was created.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    /// Prompt tokens of admitted sequences that were looked up in the prefix index: counted once per
    /// admission, when a fresh sequence's allocation with its hit succeeds (a lookup whose allocation
    /// failed, repeated later, counts once). The server's `kura:prefix_cache_queries_tokens` and the
    /// simulators' hit ratios are these counters.
    pub prefix_query_tokens: u64,
    /// Of those, tokens found cached (full blocks, blocks of lower tiers and partially reused blocks).
    pub prefix_hit_tokens: u64,
    /// Of those, tokens of blocks still being computed by another sequence when attached (early reuse).
    pub prefix_pending_hit_tokens: u64,
    /// Full prompt blocks of admitted sequences looked up.
    pub prefix_query_blocks: u64,
    /// Of those, blocks found cached in the pool.
    pub prefix_hit_blocks: u64,
    /// Admissions that reused part of a cached block by copy.
    pub partial_hits: u64,
    /// Full blocks walked by lookups, admitted or not: the index's work.
    pub lookup_blocks: u64,
    /// Blocks attached while another sequence was still computing them (early reuse: a wait, not a recompute).
    pub pending_waits: u64,
    /// Pending blocks whose writer was cancelled while others waited on them.
    pub withdrawn_blocks: u64,
    /// Cached blocks evicted to make room.
    pub evictions: u64,
    /// Blocks entered in the prefix index.
    pub blocks_indexed: u64,
    /// Full blocks left out of the index because their hash was taken (same content computed twice, or a
    /// hash collision).
    pub index_conflicts: u64,
    /// Block copies handed to the engine (copy-on-write and partial reuse).
    pub block_copies: u64,
    /// Block operations: allocations, attachments and releases of one block each.
    pub block_ops: u64,
    /// Full blocks found in the host tier (L2) and attached by a load.
    pub host_hit_blocks: u64,
    /// Full blocks found on disk (L3) and attached by a load.
    pub disk_hit_blocks: u64,
    /// Full prompt blocks found in the host tier (L2) and recomputed instead, because the cost check
    /// refused the tier's loads ([`crate::KvCacheManager::set_tier_loadable`]).
    pub host_refused_blocks: u64,
    /// The same for the disk tier (L3).
    pub disk_refused_blocks: u64,
    /// Blocks copied from the pool into the host tier (on eviction, write-through or swap).
    pub host_stores: u64,
    /// Of those, blocks copied ahead of their eviction ([`crate::KvCacheManager::store_ahead`]).
    pub host_stored_ahead: u64,
    /// Evictions from the pool that copied their block down as they evicted it (a lower tier lacked
    /// it): where copies run beside the steps, each holds back the step that reuses the block until it
    /// has landed. Blocks stored ahead (or written through) are evicted without one.
    pub evictions_copied: u64,
    /// Blocks written to disk.
    pub disk_stores: u64,
    /// Blocks evicted from the host tier (written to disk first when there is one).
    pub host_evictions: u64,
    /// Blocks evicted from disk.
    pub disk_evictions: u64,
    /// Blocks that could not go down because the tier was full of blocks being loaded.
    pub tier_full_drops: u64,
    /// Loads that failed (a stored block that did not verify: checksum, header, missing file); the
    /// block was removed from its tier and computed instead.
    pub load_failures: u64,
    /// Window parts of cached blocks (a hybrid pool's sliding layers) dropped to make room.
    pub window_part_drops: u64,
}

/// Blocks held by a lower tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierUsage {
    pub capacity_blocks: u32,
    pub used_blocks: u32,
}

/// Where the blocks are right now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvUsage {
    pub total_blocks: u32,
    /// Referenced by at least one sequence.
    pub used_blocks: u32,
    /// Cached, unreferenced and unpinned: reusable on a hit, reclaimable by eviction.
    pub cached_idle_blocks: u32,
    /// Cached, unreferenced and pinned.
    pub pinned_idle_blocks: u32,
    /// On the free list: no identity.
    pub free_blocks: u32,
}

impl KvUsage {
    /// Fraction of blocks referenced by sequences (what vLLM calls KV cache usage).
    pub fn used_fraction(&self) -> f64 {
        if self.total_blocks == 0 {
            0.0
        } else {
            f64::from(self.used_blocks) / f64::from(self.total_blocks)
        }
    }
}

impl KvStats {
    /// Hit ratio over looked-up tokens (0 when nothing was looked up).
    pub fn token_hit_ratio(&self) -> f64 {
        ratio(self.prefix_hit_tokens, self.prefix_query_tokens)
    }

    /// Hit ratio over looked-up full blocks.
    pub fn block_hit_ratio(&self) -> f64 {
        ratio(self.prefix_hit_blocks, self.prefix_query_blocks)
    }
}

fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}
