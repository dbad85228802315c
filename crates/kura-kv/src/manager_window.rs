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

use std::collections::VecDeque;

use super::{Allocation, BlockCopy, KvCacheManager, SeqId};
use crate::error::KvError;
use crate::pool::BlockId;
use crate::prefix::PrefixHit;

/// Sentinel: "no page" (a window part not attached, or a block on the free list).
pub const NO_PAGE: u32 = u32::MAX;

/// How many idle window parts a reclaim looks at for one that no likely hit needs before it takes the
/// oldest.
const SCAN: usize = 64;

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

/// The page state of a hybrid pool.
#[derive(Debug)]
pub(crate) struct Pages {
    pub layers: usize,
    pub full: Vec<usize>,
    pub sliding: Vec<usize>,
    pub window: usize,
    pub num_pages: u32,
    pub free: Vec<u32>,
    /// `of_block[b * layers + l]`: the page of layer `l` of block `b`, or `NO_PAGE`.
    pub of_block: Vec<u32>,
    /// Window references per block.
    pub refs: Vec<u32>,
    /// Bumped whenever a block's window part changes state; stale `idle` entries carry an older stamp.
    pub stamp: Vec<u32>,
    /// Index of the block in its sequence (its first token is `depth × block_size`).
    pub depth: Vec<u32>,
    /// Attached window parts without references, oldest first (with stale entries).
    pub idle: VecDeque<(BlockId, u32)>,
    pub num_idle: u32,
}

impl Pages {
    pub fn new(cfg: &WindowPool, num_blocks: u32) -> Result<Self, KvError> {
        let layers = cfg.sliding.len();
        let n = num_blocks as usize;
        let slots = n
            .checked_mul(layers)
            .ok_or_else(|| KvError::Config("page table size overflows".into()))?;
        let mut of_block = Vec::new();
        of_block
            .try_reserve_exact(slots)
            .map_err(|e| KvError::Config(format!("page table of {slots} entries: {e}")))?;
        of_block.resize(slots, NO_PAGE);
        Ok(Pages {
            layers,
            full: (0..layers).filter(|&l| !cfg.sliding[l]).collect(),
            sliding: (0..layers).filter(|&l| cfg.sliding[l]).collect(),
            window: cfg.window_tokens,
            num_pages: cfg.num_pages,
            free: (0..cfg.num_pages).rev().collect(),
            of_block,
            refs: vec![0; n],
            stamp: vec![0; n],
            depth: vec![0; n],
            idle: VecDeque::new(),
            num_idle: 0,
        })
    }

    pub fn attached(&self, b: BlockId) -> bool {
        self.of_block[b as usize * self.layers + self.sliding[0]] != NO_PAGE
    }

    /// The first block a token at `pos` reads in a sliding layer.
    pub fn window_start(&self, pos: usize, block_size: usize) -> usize {
        (pos + 1).saturating_sub(self.window) / block_size
    }

    fn take(&mut self, b: BlockId, layers: &[usize]) {
        for &l in layers {
            let page = self.free.pop().expect("pages were reclaimed first");
            self.of_block[b as usize * self.layers + l] = page;
        }
    }

    fn give_back(&mut self, b: BlockId, sliding_only: bool) {
        for l in 0..self.layers {
            if sliding_only && !self.sliding.contains(&l) {
                continue;
            }
            let slot = &mut self.of_block[b as usize * self.layers + l];
            if *slot != NO_PAGE {
                self.free.push(*slot);
                *slot = NO_PAGE;
            }
        }
    }
}

impl KvCacheManager {
    fn pages_mut(&mut self) -> &mut Pages {
        self.pages.as_mut().expect("a hybrid pool")
    }

    /// Pages the pool could hand out now without touching referenced or pinned blocks: free ones, those
    /// of idle cached blocks and idle window parts.
    pub(super) fn reclaimable_pages(&self) -> usize {
        let Some(p) = &self.pages else { return 0 };
        p.free.len() + p.full.len() * self.num_idle as usize + p.sliding.len() * p.num_idle as usize
    }

    /// Gives block `b` its full-attention pages (it was just taken, and is referenced).
    pub(super) fn take_full_pages(&mut self, b: BlockId) {
        let Some(p) = &self.pages else { return };
        let need = p.full.len();
        self.reclaim_pages(need);
        let p = self.pages_mut();
        let full = std::mem::take(&mut p.full);
        p.take(b, &full);
        p.full = full;
    }

    /// Gives block `b` (referenced) its window part.
    fn attach_window(&mut self, b: BlockId) {
        let need = self.pages.as_ref().expect("a hybrid pool").sliding.len();
        self.reclaim_pages(need);
        let p = self.pages_mut();
        let sliding = std::mem::take(&mut p.sliding);
        p.take(b, &sliding);
        p.sliding = sliding;
        p.stamp[b as usize] = p.stamp[b as usize].wrapping_add(1);
    }

    /// Returns every page of block `b`, which is leaving the pool's blocks (free list or eviction).
    pub(super) fn free_block_pages(&mut self, b: BlockId) {
        let Some(p) = self.pages.as_mut() else { return };
        debug_assert_eq!(
            p.refs[b as usize], 0,
            "block {b} freed with window references"
        );
        if p.attached(b) {
            p.num_idle -= 1;
        }
        p.stamp[b as usize] = p.stamp[b as usize].wrapping_add(1);
        p.give_back(b, false);
    }

    /// Takes a window reference on block `b`.
    pub(super) fn win_ref(&mut self, b: BlockId) {
        let Some(p) = self.pages.as_mut() else { return };
        let i = b as usize;
        if p.refs[i] == 0 && p.attached(b) {
            p.num_idle -= 1;
            p.stamp[i] = p.stamp[i].wrapping_add(1);
        }
        p.refs[i] += 1;
    }

    /// Drops a window reference on block `b`: an unreferenced window part stays while the block is a
    /// computed cached block (a hit may need it), else its pages go back at once.
    pub(super) fn win_unref(&mut self, b: BlockId) {
        let bs = self.config.block_size;
        let m = &self.pool.meta[b as usize];
        let cached = m.indexed && usize::from(m.computed) == bs;
        let Some(p) = self.pages.as_mut() else { return };
        let i = b as usize;
        p.refs[i] = p.refs[i]
            .checked_sub(1)
            .expect("window reference count below zero");
        if p.refs[i] > 0 || !p.attached(b) {
            return;
        }
        p.stamp[i] = p.stamp[i].wrapping_add(1);
        if cached {
            p.num_idle += 1;
            p.idle.push_back((b, p.stamp[i]));
        } else {
            p.give_back(b, true);
        }
    }

    /// Frees pages until `n` are free: idle window parts first (see [`Self::pick_idle_part`]), then
    /// idle cached blocks, leaf first. The caller checked that enough are reclaimable.
    fn reclaim_pages(&mut self, n: usize) {
        while self.pages.as_ref().is_some_and(|p| p.free.len() < n) {
            if let Some(b) = self.pick_idle_part() {
                let p = self.pages_mut();
                p.num_idle -= 1;
                p.stamp[b as usize] = p.stamp[b as usize].wrapping_add(1);
                p.give_back(b, true);
                self.stats.window_part_drops += 1;
                continue;
            }
            self.evictor.expire(&mut self.pool.meta, self.now_ms);
            let b = self
                .evictor
                .pop(&mut self.pool.meta)
                .expect("capacity was checked: an idle block must be evictable");
            self.drop_cached(b);
            self.stats.evictions += 1;
            self.free_to_pool(b);
        }
    }

    /// The idle window part to drop next: among the oldest [`SCAN`], the first that no likely hit needs;
    /// else the oldest.
    fn pick_idle_part(&mut self) -> Option<BlockId> {
        let p = self.pages.as_mut()?;
        // Drop stale entries at the front.
        while let Some(&(b, stamp)) = p.idle.front() {
            if p.stamp[b as usize] == stamp && p.refs[b as usize] == 0 && p.attached(b) {
                break;
            }
            p.idle.pop_front();
        }
        let p = self.pages.as_ref()?;
        let mut oldest = None;
        let mut chosen = None;
        for (at, &(b, stamp)) in p.idle.iter().enumerate().take(SCAN) {
            if p.stamp[b as usize] != stamp || p.refs[b as usize] != 0 || !p.attached(b) {
                continue;
            }
            oldest.get_or_insert(at);
            if !self.part_may_serve_a_hit(b) {
                chosen = Some(at);
                break;
            }
        }
        let at = chosen.or(oldest)?;
        let p = self.pages.as_mut()?;
        p.idle.remove(at).map(|(b, _)| b)
    }

    /// Whether block `b`'s window part lies where a prefix hit is likely: within the first window of its
    /// chain (a short shared prefix), within a window before a leaf (a conversation continued) or a branch
    /// point (a prefix many prompts share), or in a pinned block.
    fn part_may_serve_a_hit(&self, b: BlockId) -> bool {
        let p = self.pages.as_ref().expect("a hybrid pool");
        let bs = self.config.block_size;
        let reach = WindowPool::window_blocks(p.window, bs);
        let m = &self.pool.meta[b as usize];
        if (p.depth[b as usize] as usize) < reach || m.pin_count > 0 {
            return true;
        }
        let mut c = b;
        for _ in 0..reach {
            let m = &self.pool.meta[c as usize];
            if m.num_children != 1 {
                return true;
            }
            c = m.first_child;
        }
        false
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
        let first = p.window_start(start, bs);
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
        if missing.len() * p.sliding.len() > self.reclaimable_pages() {
            return Ok(false);
        }
        for b in missing {
            self.attach_window(b);
        }
        Ok(true)
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
            k == 0 || run[k - 1] >= k - p.window_start(next, bs)
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
        let first = p.window_start(
            blocks.len() * self.config.block_size,
            self.config.block_size,
        );
        blocks[first.min(blocks.len())..].to_vec()
    }

    /// Window pages a hit attached to a fresh sequence takes from the reclaimable ones: its idle parts
    /// within the next token's window (they gain a reference), and the partly reused block's (held while
    /// it is copied).
    pub(super) fn hit_window_pages(&self, hit: &PrefixHit) -> usize {
        let Some(p) = &self.pages else { return 0 };
        let bs = self.config.block_size;
        let first = p.window_start(self.hit_next_position(hit), bs);
        let idle = |b: BlockId| p.refs[b as usize] == 0 && p.attached(b);
        let parts = hit
            .blocks
            .iter()
            .skip(first)
            .filter(|&&(b, _)| idle(b))
            .count()
            + hit.partial.map_or(0, |(src, _, _)| usize::from(idle(src)));
        parts * p.sliding.len()
    }

    /// Drops every idle window part (clearing the cache).
    pub(super) fn drop_idle_window_parts(&mut self) {
        while let Some(b) = self.pick_idle_part() {
            let p = self.pages_mut();
            p.num_idle -= 1;
            p.stamp[b as usize] = p.stamp[b as usize].wrapping_add(1);
            p.give_back(b, true);
        }
    }

    /// Window references of a sequence that just attached `hit`: on the blocks the next token reads.
    pub(super) fn ref_hit_window(&mut self, id: SeqId, hit: &PrefixHit) -> Result<(), KvError> {
        let Some(p) = &self.pages else { return Ok(()) };
        let first = p.window_start(self.hit_next_position(hit), self.config.block_size);
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
        p.depth[b as usize] = i as u32;
        self.win_ref(b);
        if with_part {
            self.attach_window(b);
        }
    }

    /// Records a copy of KV tokens `[0, n)` from `src` to `dst`: one block copy, or with a hybrid pool
    /// one copy per layer whose pages both blocks have.
    pub(super) fn push_copy(&self, alloc: &mut Allocation, src: BlockId, dst: BlockId, n: usize) {
        let Some(p) = &self.pages else {
            alloc.copies.push(BlockCopy {
                src,
                dst,
                num_tokens: n,
            });
            return;
        };
        for l in 0..p.layers {
            let (s, d) = (
                p.of_block[src as usize * p.layers + l],
                p.of_block[dst as usize * p.layers + l],
            );
            if s != NO_PAGE && d != NO_PAGE {
                alloc.copies.push(BlockCopy {
                    src: s,
                    dst: d,
                    num_tokens: n,
                });
            }
        }
    }

    /// Pages `needed` new blocks take (their full parts, and window parts for `with_part` of them).
    pub(super) fn pages_for_blocks(&self, needed: usize, with_part: usize) -> usize {
        self.pages
            .as_ref()
            .map_or(0, |p| needed * p.full.len() + with_part * p.sliding.len())
    }

    /// Blocks a sliding layer holds for one sequence at most ([`WindowPool::window_blocks`]); 0 without
    /// a hybrid pool.
    pub(super) fn window_blocks(&self) -> usize {
        self.pages.as_ref().map_or(0, |p| {
            WindowPool::window_blocks(p.window, self.config.block_size)
        })
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
        out.clear();
        for l in 0..p.layers {
            out.extend(
                seq.table
                    .iter()
                    .map(|&b| p.of_block[b as usize * p.layers + l]),
            );
        }
        Ok(true)
    }

    /// Pages in use, free, and held by idle window parts, for metrics and tests: (total, free, idle parts'
    /// pages).
    pub fn page_usage(&self) -> Option<(u32, u32, u32)> {
        let p = self.pages.as_ref()?;
        Some((
            p.num_pages,
            p.free.len() as u32,
            p.num_idle * p.sliding.len() as u32,
        ))
    }

    /// Checks the page bookkeeping (for [`Self::check_invariants`]).
    pub(super) fn check_pages(&self) -> Result<(), String> {
        let Some(p) = &self.pages else { return Ok(()) };
        let n = self.pool.num_blocks() as usize;
        let mut owner = vec![false; p.num_pages as usize];
        for &page in &p.free {
            if std::mem::replace(&mut owner[page as usize], true) {
                return Err(format!("page {page} is twice free"));
            }
        }
        let mut refs = vec![0u32; n];
        for slot in &self.seqs {
            if let Some(seq) = &slot.seq {
                for &b in &seq.table[seq.win_from.min(seq.table.len())..] {
                    refs[b as usize] += 1;
                }
            }
        }
        for pin in self.pins.iter().filter_map(|(_, p)| p.as_ref()) {
            for &b in &pin.window {
                refs[b as usize] += 1;
            }
        }
        let on_free: std::collections::HashSet<BlockId> = self.pool.free.iter().copied().collect();
        let mut idle = 0;
        for (b, &held) in refs.iter().enumerate() {
            let m = &self.pool.meta[b];
            if p.refs[b] != held {
                return Err(format!(
                    "block {b}: {} window references but {held} sequences hold its window",
                    p.refs[b]
                ));
            }
            let pages = &p.of_block[b * p.layers..(b + 1) * p.layers];
            for (l, &page) in pages.iter().enumerate() {
                if page == NO_PAGE {
                    continue;
                }
                if std::mem::replace(&mut owner[page as usize], true) {
                    return Err(format!("page {page} (block {b}, layer {l}) has two owners"));
                }
            }
            let in_use = !on_free.contains(&(b as BlockId));
            for &l in &p.full {
                if (pages[l] != NO_PAGE) != in_use {
                    return Err(format!(
                        "block {b}: full layer {l} has page {} while the block is {}",
                        pages[l],
                        if in_use { "in use" } else { "free" }
                    ));
                }
            }
            let attached = pages[p.sliding[0]] != NO_PAGE;
            if p.sliding.iter().any(|&l| (pages[l] != NO_PAGE) != attached) {
                return Err(format!(
                    "block {b}: window part attached in some layers only"
                ));
            }
            if attached && p.refs[b] == 0 {
                if !m.indexed || usize::from(m.computed) < self.config.block_size {
                    return Err(format!(
                        "block {b}: unreferenced window part of a block that is not cached"
                    ));
                }
                idle += 1;
            }
            if attached && !in_use {
                return Err(format!("free block {b} holds a window part"));
            }
        }
        if idle != p.num_idle {
            return Err(format!(
                "{} idle window parts counted, {idle} found",
                p.num_idle
            ));
        }
        if let Some(page) = owner.iter().position(|o| !o) {
            return Err(format!("page {page} leaked: neither free nor owned"));
        }
        Ok(())
    }
}
