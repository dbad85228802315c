//! The hybrid pool: for models whose layers mix full attention with a sliding window (Gemma 2 and 3,
//! Mistral, Qwen2 with `use_sliding_window`), a block's layers are paged separately, so that a sliding
//! layer holds only the blocks its window still reads.
//!
//! Memory is one arena of equal *pages*, a page being one layer of one block (every layer of such a model
//! has the same KV shape). A logical block — the unit of the prefix index, the eviction order and the
//! block tables, as for every other model — owns:
//! - one page per full-attention layer, from the moment it is taken until it is freed or evicted;
//! - one page per sliding layer, its *window part*, only while some sequence may read it or a future
//!   prefix hit may need it.
//!
//! ```text
//!  window W = 8 tokens, block 4, a sequence about to compute token 13:
//!  tokens      |0 1 2 3|4 5 6 7|8 9 a b|c d . .|
//!  full layers |  page |  page |  page |  page |
//!  sliding     |   -   |  page |  page |  page |   token 13 reads 6..=13: blocks 1, 2, 3
//! ```
//!
//! A sequence holds a *window reference* on each of its blocks from `win_from` on; it takes them as it
//! appends blocks and drops them as its computing position leaves them behind
//! ([`KvCacheManager::prepare_window`]). Pages for a window part are attached lazily, when the sequence
//! is about to compute tokens whose window covers the block. A window part without references is kept
//! while its block is cached (a future hit may need it) and reclaimed before any whole block: first the
//! parts no likely hit needs (neither within the first window of a chain, nor within a window before a
//! leaf or a branch point, nor pinned), then the others, oldest first.
//!
//! A prefix hit at block `k` needs the full parts of blocks `0..k` and the window parts of the blocks the
//! next token's window reads; a lookup is cut back to the longest such prefix
//! ([`KvCacheManager::find_cached_prefix`]).
//!
//! Lower tiers (host, disk) are not available with a hybrid pool: a block without its window part has no
//! whole bytes to move.
//!
//! The pages and their bookkeeping belong to `HybridPages` (the `pages` module: the arena, and a page
//! manager per attention kind). This module is the manager's side: when a block takes, references and
//! gives back pages, how pages are reclaimed (idle window parts, then whole blocks by eviction), and how
//! a hit is cut back to the window.

use super::pages::{AttentionPages, HybridPages};
use super::{Allocation, BlockCopy, KvCacheManager, SeqId};
use crate::error::KvError;
use crate::pool::BlockId;
use crate::prefix::PrefixHit;

/// Sentinel: "no page" (a window part not attached, or a block on the free list).
pub const NO_PAGE: u32 = u32::MAX;

/// The pages of a model whose layers slide with one window, some or all of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WindowPool {
    /// Per model layer: whether it slides.
    pub sliding: Vec<bool>,
    /// Tokens a sliding layer attends to, the current token included.
    pub window_tokens: usize,
    /// Pages of the arena: one layer of one block each.
    pub num_pages: u32,
}

impl WindowPool {
    pub fn full_layers(&self) -> usize {
        self.sliding.iter().filter(|s| !**s).count()
    }

    pub fn sliding_layers(&self) -> usize {
        self.sliding.iter().filter(|s| **s).count()
    }

    /// Blocks a sliding layer of one sequence holds at most while it decodes: those a window of
    /// `window_tokens` can overlap.
    pub fn window_blocks(window_tokens: usize, block_size: usize) -> usize {
        window_tokens.saturating_sub(1).div_ceil(block_size) + 1
    }

    /// Pages one step of a sequence of `num_blocks` blocks takes, the pool otherwise empty: every block's
    /// full-attention pages and the window parts of the blocks a window overlaps (what
    /// [`KvCacheManager::allocate_slots`] asks for a prompt of that many blocks). A request whose blocks
    /// fit the logical pool may still need more pages than the arena has.
    pub fn pages_to_hold(&self, num_blocks: usize, block_size: usize) -> usize {
        let parts = num_blocks.min(Self::window_blocks(self.window_tokens, block_size));
        num_blocks
            .saturating_mul(self.full_layers())
            .saturating_add(parts.saturating_mul(self.sliding_layers()))
    }

    /// Logical blocks to give the manager for this arena: enough that pages, not block ids, run out
    /// first (each block costs at least its full pages; with no full layer, a sequence still holds a
    /// block id per block of its context).
    pub fn logical_blocks(&self) -> u32 {
        let full = self.full_layers() as u32;
        self.num_pages
            .checked_div(full)
            .unwrap_or_else(|| self.num_pages.saturating_mul(2))
    }

    pub(crate) fn validate(&self, block_size: usize) -> Result<(), KvError> {
        if self.window_tokens == 0 {
            return Err(KvError::Config("a sliding window of 0 tokens".into()));
        }
        if self.sliding_layers() == 0 {
            return Err(KvError::Config(
                "a window pool needs at least one sliding layer".into(),
            ));
        }
        if self.num_pages == 0 || self.num_pages == NO_PAGE {
            return Err(KvError::Config(format!(
                "{} pages is outside 1..{NO_PAGE}",
                self.num_pages
            )));
        }
        let per_block = self.sliding.len();
        if (self.num_pages as usize) < per_block {
            return Err(KvError::Config(format!(
                "{} pages cannot hold one block of {per_block} layers (block size {block_size})",
                self.num_pages
            )));
        }
        Ok(())
    }
}

impl KvCacheManager {
    /// Pages the pool could hand out now without touching referenced or pinned blocks: free ones, those
    /// of idle cached blocks and idle window parts.
    pub(super) fn reclaimable_pages(&self) -> usize {
        self.pages
            .as_ref()
            .map_or(0, |p| p.reclaimable(self.evictor.num_idle))
    }

    /// Gives block `b` its full-attention pages (it was just taken, and is referenced).
    pub(super) fn take_full_pages(&mut self, b: BlockId) {
        let Some(p) = &self.pages else { return };
        self.reclaim_pages(p.full.pages_per_block());
        let p = self.hybrid_mut();
        p.full.take_pages(&mut p.arena, b);
    }

    /// Gives block `b` (referenced) its window part.
    fn attach_window(&mut self, b: BlockId) {
        let need = self.hybrid_mut().sliding.pages_per_block();
        self.reclaim_pages(need);
        let p = self.hybrid_mut();
        p.sliding.attach(&mut p.arena, b);
    }

    fn hybrid_mut(&mut self) -> &mut HybridPages {
        self.pages.as_mut().expect("a hybrid pool")
    }

    /// Returns every page of block `b`, which is leaving the pool's blocks (free list or eviction).
    pub(super) fn free_block_pages(&mut self, b: BlockId) {
        if let Some(p) = self.pages.as_mut() {
            p.free_block(b);
        }
    }

    /// Takes a window reference on block `b`.
    pub(super) fn win_ref(&mut self, b: BlockId) {
        if let Some(p) = self.pages.as_mut() {
            p.sliding.add_ref(&p.arena, b);
        }
    }

    /// Drops a window reference on block `b`: an unreferenced window part stays while the block is a
    /// computed cached block (a hit may need it), else its pages go back at once.
    pub(super) fn win_unref(&mut self, b: BlockId) {
        let bs = self.config.block_size;
        let m = &self.pool.meta[b as usize];
        let cached = m.indexed && usize::from(m.computed) == bs;
        if let Some(p) = self.pages.as_mut() {
            p.sliding.drop_ref(&mut p.arena, b, cached);
        }
    }

    /// Frees pages until `n` are free: idle window parts first (see
    /// `SlidingWindowPages::pick_idle_part`), then idle cached blocks, leaf first. The caller checked
    /// that enough are reclaimable.
    fn reclaim_pages(&mut self, n: usize) {
        while self.pages.as_ref().is_some_and(|p| p.arena.num_free() < n) {
            if self.drop_idle_window_part() {
                self.stats.window_part_drops += 1;
                continue;
            }
            self.evictor.expire(&mut self.pool.meta, self.clock.now_ms);
            let b = self
                .evictor
                .pop(&mut self.pool.meta)
                .expect("capacity was checked: an idle block must be evictable");
            self.drop_cached(b);
            self.stats.evictions += 1;
            self.free_to_pool(b);
        }
    }

    /// Drops the idle window part that goes first; false when there is none.
    fn drop_idle_window_part(&mut self) -> bool {
        let bs = self.config.block_size;
        let Some(p) = self.pages.as_mut() else {
            return false;
        };
        let Some(b) = p.sliding.pick_idle_part(&p.arena, &self.pool.meta, bs) else {
            return false;
        };
        p.sliding.drop_part(&mut p.arena, b);
        true
    }

    /// Prepares the sliding layers for computing tokens `[start, end)` of the sequence: drops its window
    /// references on blocks no token from `start` on reads, and attaches window parts to the blocks the
    /// step reads or writes. Returns `Ok(false)`, changing only the references it dropped, when the pool
    /// cannot supply the pages (the scheduler computes fewer tokens, waits or preempts). A no-op for a
    /// pool without sliding layers.
    pub fn prepare_window(&mut self, id: SeqId, start: usize, end: usize) -> Result<bool, KvError> {
        let Some(p) = &self.pages else {
            return Ok(true);
        };
        let bs = self.config.block_size;
        let seq = self.seq(id)?;
        if start >= end || end > seq.num_tokens {
            return Err(KvError::ComputeRange {
                seq: id,
                start,
                end,
                num_tokens: seq.num_tokens,
            });
        }
        let first = p.sliding.window_start(start, bs);
        let from = seq.win_from;
        if first > from {
            let gone: Vec<BlockId> = seq.table[from..first].to_vec();
            self.seq_mut(id)?.win_from = first;
            for b in gone {
                self.win_unref(b);
            }
        } else if first < from {
            // Computing from before the position its window references were taken for (cannot happen
            // with hits cut by `fit_hit_to_window`): the blocks it reads must still have their parts.
            let back: Vec<BlockId> = seq.table[first..from].to_vec();
            if let Some(&b) = back.iter().find(|&&b| !p.attached(b)) {
                return Err(KvError::WindowLost { seq: id, block: b });
            }
            self.seq_mut(id)?.win_from = first;
            for b in back {
                self.win_ref(b);
            }
        }
        let seq = self.seq(id)?;
        let p = self.pages.as_ref().expect("a hybrid pool");
        let last = (end - 1) / bs;
        let missing: Vec<BlockId> = seq.table[first.max(seq.win_from)..=last]
            .iter()
            .copied()
            .filter(|&b| !p.attached(b))
            .collect();
        if let Some(&b) = missing
            .iter()
            .find(|&&b| self.pool.meta[b as usize].computed > 0)
        {
            return Err(KvError::WindowLost { seq: id, block: b });
        }
        if missing.len() * p.sliding.pages_per_block() > self.reclaimable_pages() {
            return Ok(false);
        }
        for b in missing {
            self.attach_window(b);
        }
        Ok(true)
    }

    /// Drops the sequence's window references on the blocks no token from `pos` on reads: its tokens
    /// before `pos` are computed, and it never computes them again. Their parts become idle (a hit may
    /// still want them) or go back, so that the sequence's next block finds those pages: until its next
    /// step's window moved on ([`Self::prepare_window`]), the references the last chunk took on every
    /// block it read held them, and a sequence that fits the pool exactly found it full.
    pub(super) fn release_window_behind(&mut self, id: SeqId, pos: usize) -> Result<(), KvError> {
        let Some(p) = &self.pages else {
            return Ok(());
        };
        let seq = self.seq(id)?;
        let first = p
            .sliding
            .window_start(pos, self.config.block_size)
            .min(seq.table.len());
        if first <= seq.win_from {
            return Ok(());
        }
        let gone: Vec<BlockId> = seq.table[seq.win_from..first].to_vec();
        self.seq_mut(id)?.win_from = first;
        for b in gone {
            self.win_unref(b);
        }
        Ok(())
    }

    /// The prefix index's lookup of `tokens` under `key_id` into `hit`: partial reuse only from blocks
    /// whose window part is there to copy (a hybrid pool).
    pub(super) fn lookup_pool(&mut self, key_id: u32, tokens: &[u32], hit: &mut PrefixHit) {
        let pages = &self.pages;
        self.index
            .lookup(&self.pool, &mut self.hasher, key_id, tokens, hit, |b| {
                pages.as_ref().is_none_or(|p| p.attached(b))
            });
    }

    /// Cuts `hit` back to the longest prefix whose next token finds the window parts it reads: attached,
    /// or pending (their writer attaches them before computing them).
    pub(super) fn fit_hit_to_window(&self, hit: &mut PrefixHit) {
        let Some(p) = &self.pages else { return };
        let bs = self.config.block_size;
        let ready =
            |b: BlockId| p.attached(b) || usize::from(self.pool.meta[b as usize].computed) < bs;
        // run[i]: ready blocks ending at block i.
        let mut run = Vec::with_capacity(hit.blocks.len());
        for (i, &(b, _)) in hit.blocks.iter().enumerate() {
            let before = if i == 0 { 0 } else { run[i - 1] };
            run.push(if ready(b) { before + 1 } else { 0 });
        }
        let pending = self.first_pending(hit);
        let fits = |k: usize, n: usize| {
            let next = match pending {
                Some(i) if i < k => i * bs,
                _ => k * bs + n,
            };
            k == 0 || run[k - 1] >= k - p.sliding.window_start(next, bs)
        };
        let k = hit.blocks.len();
        if let Some((src, _, n)) = hit.partial {
            if p.attached(src) && fits(k, n) {
                return;
            }
            hit.partial = None;
        }
        let keep = (0..=k).rev().find(|&k| fits(k, 0)).unwrap_or(0);
        if keep == k {
            return;
        }
        hit.window_cut = k - keep;
        hit.blocks.truncate(keep);
        hit.num_pending = hit
            .blocks
            .iter()
            .filter(|&&(b, _)| usize::from(self.pool.meta[b as usize].computed) < bs)
            .count();
        hit.last_hash = match hit.blocks.last() {
            Some(&(b, _)) => self.pool.meta[b as usize].hash,
            None => self
                .index
                .key_hash(hit.key_id.expect("a hit with blocks has a key")),
        };
    }

    /// Index of the first pending block of `hit`, if one is.
    fn first_pending(&self, hit: &PrefixHit) -> Option<usize> {
        let bs = self.config.block_size;
        hit.blocks
            .iter()
            .position(|&(b, _)| usize::from(self.pool.meta[b as usize].computed) < bs)
    }

    /// The first position a sequence starting with `hit` may compute: after the hit, or at its first
    /// pending block should that block's writer give it up.
    fn hit_next_position(&self, hit: &PrefixHit) -> usize {
        match self.first_pending(hit) {
            Some(i) => i * self.config.block_size,
            None => hit.num_cached_tokens(),
        }
    }

    /// The blocks of a pinned prefix of `blocks` (computed, cached) whose window parts a hit right after
    /// it reads: the pin holds references on them.
    pub(super) fn pinned_window(&self, blocks: &[BlockId]) -> Vec<BlockId> {
        let Some(p) = &self.pages else {
            return Vec::new();
        };
        let first = p.sliding.window_start(
            blocks.len() * self.config.block_size,
            self.config.block_size,
        );
        blocks[first.min(blocks.len())..].to_vec()
    }

    /// Window parts a hit attached to a fresh sequence takes from the reclaimable ones: its idle parts
    /// within the next token's window (they gain a reference), and the partly reused block's (held while
    /// it is copied).
    pub(super) fn hit_window_parts(&self, hit: &PrefixHit) -> (usize, usize) {
        let Some(p) = &self.pages else { return (0, 0) };
        let bs = self.config.block_size;
        let first = p.sliding.window_start(self.hit_next_position(hit), bs);
        let idle = |b: BlockId| p.sliding.is_idle_part(&p.arena, b);
        let window = hit
            .blocks
            .iter()
            .skip(first)
            .filter(|&&(b, _)| idle(b))
            .count();
        let partial = hit.partial.map_or(0, |(src, _, _)| usize::from(idle(src)));
        (window, partial)
    }

    /// Drops every idle window part (clearing the cache).
    pub(super) fn drop_idle_window_parts(&mut self) {
        while self.drop_idle_window_part() {}
    }

    /// Window references of a sequence that just attached `hit`: on the blocks the next token reads.
    pub(super) fn ref_hit_window(&mut self, id: SeqId, hit: &PrefixHit) -> Result<(), KvError> {
        let Some(p) = &self.pages else { return Ok(()) };
        let first = p
            .sliding
            .window_start(self.hit_next_position(hit), self.config.block_size);
        let blocks: Vec<BlockId> = hit.blocks.iter().skip(first).map(|&(b, _)| b).collect();
        self.seq_mut(id)?.win_from = first;
        for b in blocks {
            self.win_ref(b);
        }
        Ok(())
    }

    /// A block just taken for the sequence at table index `i`: its position, a window reference and,
    /// when it receives copied KV, its window part.
    pub(super) fn new_block_window(&mut self, b: BlockId, i: usize, with_part: bool) {
        let Some(p) = self.pages.as_mut() else { return };
        p.sliding.set_depth(b, i);
        self.win_ref(b);
        if with_part {
            self.attach_window(b);
        }
    }

    /// Records a copy of KV tokens `[0, n)` from `src` to `dst`: one block copy, or with a hybrid pool
    /// one copy per layer whose pages both blocks have.
    pub(super) fn push_copy(&self, alloc: &mut Allocation, src: BlockId, dst: BlockId, n: usize) {
        match &self.pages {
            Some(p) => p.copies(src, dst, n, &mut alloc.copies),
            None => alloc.copies.push(BlockCopy {
                src,
                dst,
                num_tokens: n,
            }),
        }
    }

    /// Pages `needed` new blocks take (their full parts, and window parts for `with_part` of them).
    pub(super) fn pages_for_blocks(&self, needed: usize, with_part: usize) -> usize {
        self.pages
            .as_ref()
            .map_or(0, |p| p.pages_for_blocks(needed, with_part))
    }

    /// Blocks a sliding layer holds for one sequence at most ([`WindowPool::window_blocks`]); 0 without
    /// a hybrid pool.
    pub(super) fn window_blocks(&self) -> usize {
        self.pages
            .as_ref()
            .map_or(0, |p| p.sliding.window_blocks(self.config.block_size))
    }

    /// Whether one sequence of `num_blocks` blocks could be held at all, the pool otherwise empty: its
    /// block ids, and in a hybrid pool the pages of one step, which run out before the block ids do.
    pub fn could_hold(&self, num_blocks: usize) -> bool {
        num_blocks <= self.pool.num_blocks() as usize
            && self
                .pages_to_hold(num_blocks)
                .is_none_or(|(needed, total)| needed <= total)
    }

    /// In a hybrid pool, the pages one step of a sequence of `num_blocks` blocks takes (every block's
    /// full-layer pages, and its window's parts) and the pool's pages; `None` in other pools.
    pub fn pages_to_hold(&self, num_blocks: usize) -> Option<(usize, usize)> {
        let w = self.config.window.as_ref()?;
        Some((
            w.pages_to_hold(num_blocks, self.config.block_size),
            w.num_pages as usize,
        ))
    }

    /// Whether the pool has a sliding window paged apart.
    pub fn is_hybrid(&self) -> bool {
        self.pages.is_some()
    }

    /// The page of every layer for each block of the sequence, layer-major: `out[l * n + i]` is the page
    /// of layer `l` of block `i` of its table (`NO_PAGE` for a sliding layer's block out of its window),
    /// for the attention of a hybrid pool. `None` for a pool without sliding layers paged apart, whose
    /// block ids address the storage directly.
    pub fn layer_pages(&self, id: SeqId, out: &mut Vec<u32>) -> Result<bool, KvError> {
        let seq = self.seq(id)?;
        let Some(p) = &self.pages else {
            return Ok(false);
        };
        p.layer_pages(&seq.table, out);
        Ok(true)
    }

    /// Pages in use, free, and held by idle window parts, for metrics and tests: (total, free, idle parts'
    /// pages).
    pub fn page_usage(&self) -> Option<(u32, u32, u32)> {
        self.pages.as_ref().map(HybridPages::usage)
    }

    /// Checks the page bookkeeping (for [`Self::check_invariants`]) against the window references the
    /// sequences and the pins hold.
    pub(super) fn check_pages(&self) -> Result<(), String> {
        let Some(p) = &self.pages else { return Ok(()) };
        let n = self.pool.num_blocks() as usize;
        let mut refs = vec![0u32; n];
        for (_, seq) in self.seqs.iter() {
            for &b in &seq.table[seq.win_from.min(seq.table.len())..] {
                refs[b as usize] += 1;
            }
        }
        for pin in self.pins.iter() {
            for &b in &pin.window {
                refs[b as usize] += 1;
            }
        }
        let on_free: std::collections::HashSet<BlockId> = self.pool.free.iter().copied().collect();
        p.check(&refs, &on_free, &self.pool.meta, self.config.block_size)
    }
}
