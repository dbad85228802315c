//! Whole-state consistency checks and a brute-force prefix lookup, for the randomized tests.
//!
//! Both are O(blocks × depth) and meant for tests only; nothing on the serving path calls them.

use std::collections::HashMap;

use super::lower_tiers::LOADER;
use super::KvCacheManager;
use crate::evict::EvictionPolicy;
use crate::hash::CacheKey;
use crate::pool::{BlockId, NO_BLOCK, NO_WRITER, ORPHAN};

/// The longest cached prefix as found by brute force: (full blocks, partial tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReferenceHit {
    pub full_blocks: usize,
    pub partial_tokens: usize,
}

impl KvCacheManager {
    /// The token path from the root to `b` (None if `b` hangs below an orphan).
    fn path_of(&self, b: BlockId) -> Option<Vec<u32>> {
        let mut chain = vec![b];
        let mut c = b;
        loop {
            let p = self.pool.meta[c as usize].parent;
            if p == NO_BLOCK {
                break;
            }
            if p == ORPHAN {
                return None;
            }
            chain.push(p);
            c = p;
        }
        Some(
            chain
                .iter()
                .rev()
                .flat_map(|&x| self.pool.tokens_of(x).iter().copied())
                .collect(),
        )
    }

    /// The longest cached prefix of `tokens` under `key`, by comparing against the full token path of every
    /// indexed block (no hashing). Must agree with [`KvCacheManager::find_cached_prefix`].
    #[doc(hidden)]
    pub fn reference_lookup(&self, tokens: &[u32], key: &CacheKey) -> ReferenceHit {
        let bs = self.config.block_size;
        let mut best = ReferenceHit {
            full_blocks: 0,
            partial_tokens: 0,
        };
        let Some(key_id) = self.index.key_id(key) else {
            return best;
        };
        if !self.config.enable_prefix_caching {
            return best;
        }
        let mut full_hit_paths = Vec::new();
        for b in 0..self.pool.num_blocks() {
            let m = &self.pool.meta[b as usize];
            if !m.indexed || m.key_id != key_id {
                continue;
            }
            let Some(path) = self.path_of(b) else {
                continue;
            };
            if path.len() <= tokens.len() && tokens[..path.len()] == path[..] {
                best.full_blocks = best.full_blocks.max(path.len() / bs);
                full_hit_paths.push(b);
            }
        }
        // Partial: a computed indexed block whose parent path is the full hit and whose own tokens share a
        // prefix with the rest.
        let start = best.full_blocks * bs;
        let rest = &tokens[start..];
        for b in 0..self.pool.num_blocks() {
            let m = &self.pool.meta[b as usize];
            if !m.indexed || m.key_id != key_id || usize::from(m.computed) < bs {
                continue;
            }
            if self.pages.as_ref().is_some_and(|p| !p.attached(b)) {
                continue; // a hybrid pool copies the sliding layers too
            }
            let Some(path) = self.path_of(b) else {
                continue;
            };
            if path.len() != start + bs || tokens[..start] != path[..start] {
                continue;
            }
            let n = path[start..]
                .iter()
                .zip(rest)
                .take_while(|(a, b)| a == b)
                .count();
            best.partial_tokens = best.partial_tokens.max(n);
        }
        self.reference_window_cut(best, &full_hit_paths)
    }

    /// A hybrid pool's rule, checked directly: a hit of `k` blocks (and `n` partial tokens) stands only if
    /// every block the next token's sliding window reads has its window part, or is still pending.
    fn reference_window_cut(&self, best: ReferenceHit, path_blocks: &[BlockId]) -> ReferenceHit {
        let Some(p) = &self.pages else { return best };
        let bs = self.config.block_size;
        let mut by_depth = vec![NO_BLOCK; best.full_blocks];
        for &b in path_blocks {
            let depth = self.path_of(b).map_or(0, |path| path.len() / bs);
            if (1..=best.full_blocks).contains(&depth) {
                by_depth[depth - 1] = b;
            }
        }
        let pending = |b: BlockId| usize::from(self.pool.meta[b as usize].computed) < bs;
        let fits = |k: usize, n: usize| {
            // The sequence computes from its first pending block should that block's writer give up.
            let next = (0..k)
                .find(|&i| pending(by_depth[i]))
                .map_or(k * bs + n, |i| i * bs);
            let first = (next + 1).saturating_sub(p.sliding.window_tokens()) / bs;
            (first..k).all(|i| p.attached(by_depth[i]) || pending(by_depth[i]))
        };
        let k = best.full_blocks;
        if best.partial_tokens > 0 && fits(k, best.partial_tokens) {
            return best;
        }
        let keep = (0..=k).rev().find(|&k| fits(k, 0)).unwrap_or(0);
        ReferenceHit {
            full_blocks: keep,
            partial_tokens: 0,
        }
    }

    /// The token ids a sequence's block table holds, read back block by block.
    #[doc(hidden)]
    pub fn sequence_tokens(&self, id: super::SeqId) -> Result<Vec<u32>, crate::KvError> {
        let seq = self.seq(id)?;
        let bs = self.config.block_size;
        let mut out = Vec::with_capacity(seq.num_tokens);
        for (i, &b) in seq.table.iter().enumerate() {
            let n = (seq.num_tokens - i * bs).min(bs);
            out.extend_from_slice(&self.pool.tokens_of(b)[..n]);
        }
        Ok(out)
    }

    /// Checks every invariant of the manager's state; returns the first violation found.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let bs = self.config.block_size;
        let n = self.pool.num_blocks() as usize;
        let mut refs = vec![0u32; n];
        let mut writers: HashMap<u32, ()> = HashMap::new();
        for (i, seq) in self.seqs.iter() {
            writers.insert(i, ());
            if seq.table.len() != seq.num_tokens.div_ceil(bs) {
                return Err(format!(
                    "seq {i}: {} blocks for {} tokens",
                    seq.table.len(),
                    seq.num_tokens
                ));
            }
            for &b in &seq.table {
                refs[b as usize] += 1;
            }
        }
        for b in self.tiers.loader_refs() {
            refs[b as usize] += 1; // the loader's references
        }
        let mut pins = vec![0u32; n];
        for p in self.pins.iter() {
            for &b in &p.blocks {
                pins[b as usize] += 1;
            }
        }
        let mut on_free = vec![false; n];
        for &b in &self.pool.free {
            if std::mem::replace(&mut on_free[b as usize], true) {
                return Err(format!("block {b} is twice on the free list"));
            }
        }
        let (mut idle, mut indexed, mut referenced) = (0u32, 0usize, 0u32);
        for b in 0..n {
            let m = &self.pool.meta[b];
            if m.ref_count != refs[b] {
                return Err(format!(
                    "block {b}: ref_count {} but {} tables hold it",
                    m.ref_count, refs[b]
                ));
            }
            if m.pin_count != pins[b] {
                return Err(format!(
                    "block {b}: pin_count {} but {} pins",
                    m.pin_count, pins[b]
                ));
            }
            referenced += u32::from(m.ref_count > 0);
            if on_free[b] && (m.ref_count > 0 || m.indexed || m.pin_count > 0) {
                return Err(format!("block {b} is on the free list but in use"));
            }
            if !on_free[b] && m.ref_count == 0 && !m.indexed {
                return Err(format!(
                    "block {b} leaked: unreferenced, uncached, not free"
                ));
            }
            if m.computed > m.filled || usize::from(m.filled) > bs {
                return Err(format!(
                    "block {b}: computed {} filled {}",
                    m.computed, m.filled
                ));
            }
            let loading = m.writer == LOADER && self.tiers.is_loading(b as BlockId);
            if m.writer != NO_WRITER && !loading && !writers.contains_key(&m.writer) {
                return Err(format!(
                    "block {b}: writer {} is not a live sequence",
                    m.writer
                ));
            }
            if !m.indexed {
                continue;
            }
            indexed += 1;
            if usize::from(m.filled) != bs {
                return Err(format!("block {b} is indexed but not full"));
            }
            if self.index.get(m.hash) != Some(b as BlockId) {
                return Err(format!("block {b} is indexed but its hash maps elsewhere"));
            }
            if m.ref_count == 0 && usize::from(m.computed) < bs {
                return Err(format!(
                    "block {b}: cached without KV (pending, unreferenced)"
                ));
            }
            if m.is_idle() {
                idle += 1;
                if self.evictor.is_candidate(m) && m.heap_token == 0 {
                    return Err(format!(
                        "block {b} is evictable but not in the eviction heap"
                    ));
                }
            }
            let mut count = 0;
            let mut c = m.first_child;
            while c != NO_BLOCK {
                let cm = &self.pool.meta[c as usize];
                if cm.parent != b as BlockId || !cm.indexed {
                    return Err(format!(
                        "block {c} is in {b}'s child list but not its child"
                    ));
                }
                if cm.ref_count > 0 && m.ref_count == 0 {
                    return Err(format!("child {c} referenced while its parent {b} is not"));
                }
                // (With tiers, a loaded child may arrive before its parent, whose load may fail.)
                if cm.computed > 0 && usize::from(m.computed) < bs && !self.config.tiers.enabled() {
                    return Err(format!("child {c} computed before its parent {b}"));
                }
                count += 1;
                c = cm.next_sibling;
            }
            if count != m.num_children {
                return Err(format!(
                    "block {b}: num_children {} but {count} linked",
                    m.num_children
                ));
            }
            match m.parent {
                NO_BLOCK => {}
                ORPHAN => {
                    // (A failed load abandoned by its requester orphans the children loaded after it.)
                    if self.config.eviction_policy == EvictionPolicy::LeafLru
                        && !self.config.tiers.enabled()
                    {
                        return Err(format!("block {b} orphaned under leaf-first eviction"));
                    }
                }
                p => {
                    if !self.pool.meta[p as usize].indexed {
                        return Err(format!(
                            "block {b}'s parent {p} is not cached (evicted before its child)"
                        ));
                    }
                }
            }
        }
        if idle != self.evictor.num_idle {
            return Err(format!(
                "num_idle {} but {idle} idle blocks",
                self.evictor.num_idle
            ));
        }
        if referenced != self.pool.num_referenced {
            return Err(format!(
                "num_referenced {} but {referenced}",
                self.pool.num_referenced
            ));
        }
        self.index.check_groups(&self.pool)?;
        self.check_tiers()?;
        self.check_pages()?;
        if indexed != self.index.len() {
            return Err(format!(
                "index holds {} entries but {indexed} blocks are indexed",
                self.index.len()
            ));
        }
        Ok(())
    }
}
