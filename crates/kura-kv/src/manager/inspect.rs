//! What the pool holds, as an operator looks at it: the cached prefixes (chains of the prefix tree from a
//! root to a leaf), largest first, with their reuse, their age in the manager's ticks, their pins and
//! the cache key they belong to. No token is in it.

use super::KvCacheManager;
use crate::hash::CacheKey;
use crate::pool::{BlockId, NO_BLOCK, ORPHAN};

/// One cached prefix: the chain from a root of the prefix tree to one of its leaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixChain {
    /// Blocks from the root to the leaf (those other chains share included).
    pub blocks: usize,
    /// Times a lookup attached the leaf block: the whole prefix was reused.
    pub leaf_hits: u32,
    /// Times a lookup attached the root block: the prefix's start was reused.
    pub root_hits: u32,
    /// Ticks of the manager's logical clock since the leaf was last released; `None` while a
    /// running request holds any block of the chain.
    pub idle_ticks: Option<u64>,
    /// Blocks of the chain under a pin.
    pub pinned_blocks: usize,
    /// Blocks of the chain running requests hold now.
    pub used_blocks: usize,
    /// The cache key the prefix was computed under (its salt names the tenant).
    pub key: CacheKey,
}

impl KvCacheManager {
    /// The manager's logical clock: one tick per allocation or release.
    pub fn tick(&self) -> u64 {
        self.clock.tick
    }

    /// The `limit` largest cached prefixes of the pool (ties: the most reused first), and how many
    /// prefixes there are in all. One pass over the pool's blocks.
    pub fn prefix_chains(&self, limit: usize) -> (Vec<PrefixChain>, usize) {
        let meta = &self.pool.meta;
        // depth[b]: blocks from the root to b (0: not computed yet); pins and holders likewise.
        let mut depth = vec![0u32; meta.len()];
        let mut pinned = vec![0u32; meta.len()];
        let mut used = vec![0u32; meta.len()];
        let mut stack: Vec<BlockId> = Vec::new();
        let indexed = |b: BlockId| (b as usize) < meta.len() && meta[b as usize].indexed;
        // The parent in the tree, when it is a cached block (not a root, nor an orphan).
        let parent = |b: BlockId| {
            let p = meta[b as usize].parent;
            (p != NO_BLOCK && p != ORPHAN && indexed(p)).then_some(p)
        };
        for start in 0..meta.len() as BlockId {
            if !indexed(start) || depth[start as usize] != 0 {
                continue;
            }
            // Down to the first ancestor already known (or a root), then back up.
            let mut b = start;
            stack.push(b);
            while let Some(p) = parent(b).filter(|&p| depth[p as usize] == 0) {
                stack.push(p);
                b = p;
            }
            while let Some(b) = stack.pop() {
                let m = &meta[b as usize];
                let (d, pin, u) = parent(b).map_or((0, 0, 0), |p| {
                    (depth[p as usize], pinned[p as usize], used[p as usize])
                });
                depth[b as usize] = d + 1;
                pinned[b as usize] = pin + u32::from(m.pin_count > 0);
                used[b as usize] = u + u32::from(m.ref_count > 0);
            }
        }
        let root_of = |mut b: BlockId| {
            while let Some(p) = parent(b) {
                b = p;
            }
            b
        };
        let mut leaves: Vec<BlockId> = (0..meta.len() as BlockId)
            .filter(|&b| indexed(b) && meta[b as usize].num_children == 0)
            .collect();
        let total = leaves.len();
        leaves.sort_by_key(|&b| {
            (
                std::cmp::Reverse(depth[b as usize]),
                std::cmp::Reverse(meta[b as usize].hits),
                b,
            )
        });
        leaves.truncate(limit);
        let chains = leaves
            .into_iter()
            .map(|b| {
                let m = &meta[b as usize];
                PrefixChain {
                    blocks: depth[b as usize] as usize,
                    leaf_hits: m.hits,
                    root_hits: meta[root_of(b) as usize].hits,
                    idle_ticks: (used[b as usize] == 0)
                        .then(|| self.clock.tick.saturating_sub(m.last_used)),
                    pinned_blocks: pinned[b as usize] as usize,
                    used_blocks: used[b as usize] as usize,
                    key: self.index.key(m.key_id).clone(),
                }
            })
            .collect();
        (chains, total)
    }
}
