//! The pages of a hybrid pool (what they are for: see the `window` module): one arena of equal pages, a
//! page being one layer of one block, and one page manager per attention kind over it, as vLLM's
//! `SingleTypeKVCacheManager`s share one block pool:
//! - [`FullAttentionPages`]: a logical block holds a page per full-attention layer from the moment it is
//!   taken until it is freed or evicted, so these pages follow the pool's blocks and need no state of
//!   their own;
//! - [`SlidingWindowPages`]: a block holds a page per sliding layer (its *window part*) only while some
//!   sequence may read it (a window reference) or a future hit may need it (an idle part, reclaimed
//!   before any whole block).
//!
//! Both answer one small interface, [`AttentionPages`]: the model layers of their kind, the pages a block
//! takes for them, and how many blocks' pages of theirs could be reclaimed now. [`HybridPages`] holds the
//! arena and the two managers; the manager decides when blocks are taken, referenced and freed and tells
//! it (`window`).
//!
//! Every operation is O(layers) per block, but for picking an idle window part to drop (a scan of at
//! most [`SCAN`] entries) and the consistency check (every block, for the tests).

use std::collections::{HashSet, VecDeque};

use super::window::{WindowPool, NO_PAGE};
use super::BlockCopy;
use crate::error::KvError;
use crate::pool::{BlockId, BlockMeta};

/// How many idle window parts a reclaim looks at for one that no likely hit needs before it takes the
/// oldest.
const SCAN: usize = 64;

/// The arena: its free pages, and the page of every layer of every logical block.
#[derive(Debug)]
pub(super) struct PageArena {
    /// Layers per block (every layer of the model).
    layers: usize,
    num_pages: u32,
    free: Vec<u32>,
    /// `of_block[b * layers + l]`: the page of layer `l` of block `b`, or `NO_PAGE`.
    of_block: Vec<u32>,
}

impl PageArena {
    fn new(cfg: &WindowPool, num_blocks: u32) -> Result<Self, KvError> {
        let layers = cfg.sliding.len();
        let slots = (num_blocks as usize)
            .checked_mul(layers)
            .ok_or_else(|| KvError::Config("page table size overflows".into()))?;
        let mut of_block = Vec::new();
        of_block
            .try_reserve_exact(slots)
            .map_err(|e| KvError::Config(format!("page table of {slots} entries: {e}")))?;
        of_block.resize(slots, NO_PAGE);
        Ok(Self {
            layers,
            num_pages: cfg.num_pages,
            free: (0..cfg.num_pages).rev().collect(),
            of_block,
        })
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// The page of layer `l` of block `b`, or `NO_PAGE`.
    fn page(&self, b: BlockId, l: usize) -> u32 {
        self.of_block[b as usize * self.layers + l]
    }

    /// Gives block `b` a free page for each of `layers` (the caller made them free first).
    fn take(&mut self, b: BlockId, layers: &[usize]) {
        for &l in layers {
            let page = self.free.pop().expect("pages were reclaimed first");
            self.of_block[b as usize * self.layers + l] = page;
        }
    }

    /// Returns the pages block `b` holds for `layers`, in that order.
    fn give_back(&mut self, b: BlockId, layers: impl IntoIterator<Item = usize>) {
        for l in layers {
            let slot = &mut self.of_block[b as usize * self.layers + l];
            if *slot != NO_PAGE {
                self.free.push(*slot);
                *slot = NO_PAGE;
            }
        }
    }

    /// Records a copy of KV tokens `[0, n)` from `src` to `dst`: one copy per layer whose pages both
    /// blocks have, in layer order.
    fn copies(&self, src: BlockId, dst: BlockId, n: usize, out: &mut Vec<BlockCopy>) {
        for l in 0..self.layers {
            let (s, d) = (self.page(src, l), self.page(dst, l));
            if s != NO_PAGE && d != NO_PAGE {
                out.push(BlockCopy {
                    src: s,
                    dst: d,
                    num_tokens: n,
                });
            }
        }
    }
}

/// What the page manager of each attention kind answers.
pub(super) trait AttentionPages {
    /// The model layers of this kind, ascending.
    fn layers(&self) -> &[usize];

    /// Blocks whose pages of this kind could be reclaimed now, given the pool's `idle_blocks` idle cached
    /// blocks.
    fn reclaimable_blocks(&self, idle_blocks: u32) -> u32;

    /// Pages a block takes for this kind.
    fn pages_per_block(&self) -> usize {
        self.layers().len()
    }

    /// Pages of this kind that could be reclaimed now.
    fn reclaimable_pages(&self, idle_blocks: u32) -> usize {
        self.pages_per_block() * self.reclaimable_blocks(idle_blocks) as usize
    }

    /// Gives block `b` its pages of this kind from the arena's free ones (the caller made them free).
    fn take_pages(&self, arena: &mut PageArena, b: BlockId) {
        arena.take(b, self.layers());
    }
}

/// The full-attention layers: their pages live as long as their block is the pool's.
#[derive(Debug)]
pub(super) struct FullAttentionPages {
    layers: Vec<usize>,
}

impl AttentionPages for FullAttentionPages {
    fn layers(&self) -> &[usize] {
        &self.layers
    }

    /// Those of every idle cached block: evicting it frees them.
    fn reclaimable_blocks(&self, idle_blocks: u32) -> u32 {
        idle_blocks
    }
}

/// The sliding layers: window parts, window references, and the idle parts kept for hits.
#[derive(Debug)]
pub(super) struct SlidingWindowPages {
    layers: Vec<usize>,
    /// Tokens a sliding layer attends to, the current token included.
    window: usize,
    /// Window references per block.
    refs: Vec<u32>,
    /// Bumped whenever a block's window part changes state; stale `idle` entries carry an older stamp.
    stamp: Vec<u32>,
    /// Index of the block in its sequence (its first token is `depth × block_size`).
    depth: Vec<u32>,
    /// Attached window parts without references, oldest first (with stale entries).
    idle: VecDeque<(BlockId, u32)>,
    num_idle: u32,
}

impl AttentionPages for SlidingWindowPages {
    fn layers(&self) -> &[usize] {
        &self.layers
    }

    /// Its idle window parts (the parts of referenced blocks are read, and idle cached blocks' parts
    /// are counted here).
    fn reclaimable_blocks(&self, _idle_blocks: u32) -> u32 {
        self.num_idle
    }
}

impl SlidingWindowPages {
    /// Tokens a sliding layer attends to, the current token included.
    pub fn window_tokens(&self) -> usize {
        self.window
    }

    /// The first block a token at `pos` reads.
    pub fn window_start(&self, pos: usize, block_size: usize) -> usize {
        (pos + 1).saturating_sub(self.window) / block_size
    }

    /// Blocks a sliding layer holds for one sequence at most ([`WindowPool::window_blocks`]).
    pub fn window_blocks(&self, block_size: usize) -> usize {
        WindowPool::window_blocks(self.window, block_size)
    }

    /// Whether block `b` has its window part.
    pub fn attached(&self, arena: &PageArena, b: BlockId) -> bool {
        arena.page(b, self.layers[0]) != NO_PAGE
    }

    /// Whether block `b` has a window part without references.
    pub fn is_idle_part(&self, arena: &PageArena, b: BlockId) -> bool {
        self.refs[b as usize] == 0 && self.attached(arena, b)
    }

    /// Records the index of block `b` in its sequence.
    pub fn set_depth(&mut self, b: BlockId, i: usize) {
        self.depth[b as usize] = i as u32;
    }

    /// Gives block `b` (referenced) its window part (the caller made the pages free).
    pub fn attach(&mut self, arena: &mut PageArena, b: BlockId) {
        self.take_pages(arena, b);
        self.stamp[b as usize] = self.stamp[b as usize].wrapping_add(1);
    }

    /// Takes a window reference on block `b`.
    pub fn add_ref(&mut self, arena: &PageArena, b: BlockId) {
        let i = b as usize;
        if self.refs[i] == 0 && self.attached(arena, b) {
            self.num_idle -= 1;
            self.stamp[i] = self.stamp[i].wrapping_add(1);
        }
        self.refs[i] += 1;
    }

    /// Drops a window reference on block `b`: an unreferenced window part stays idle while the block is
    /// a computed cached block (`cached`: a hit may need it), else its pages go back at once.
    pub fn drop_ref(&mut self, arena: &mut PageArena, b: BlockId, cached: bool) {
        let i = b as usize;
        self.refs[i] = self.refs[i]
            .checked_sub(1)
            .expect("window reference count below zero");
        if self.refs[i] > 0 || !self.attached(arena, b) {
            return;
        }
        self.stamp[i] = self.stamp[i].wrapping_add(1);
        if cached {
            self.num_idle += 1;
            self.idle.push_back((b, self.stamp[i]));
        } else {
            arena.give_back(b, self.layers.iter().copied());
        }
    }

    /// Returns the pages of idle window part `b` (picked by [`Self::pick_idle_part`]).
    pub fn drop_part(&mut self, arena: &mut PageArena, b: BlockId) {
        self.num_idle -= 1;
        self.stamp[b as usize] = self.stamp[b as usize].wrapping_add(1);
        arena.give_back(b, self.layers.iter().copied());
    }

    /// Forgets block `b`'s window part, whose pages the arena takes back with the block's others.
    fn forget(&mut self, arena: &PageArena, b: BlockId) {
        debug_assert_eq!(
            self.refs[b as usize], 0,
            "block {b} freed with window references"
        );
        if self.attached(arena, b) {
            self.num_idle -= 1;
        }
        self.stamp[b as usize] = self.stamp[b as usize].wrapping_add(1);
    }

    /// The idle window part to drop next, taken out of the idle ones: among the oldest [`SCAN`], the
    /// first that no likely hit needs; else the oldest.
    pub fn pick_idle_part(
        &mut self,
        arena: &PageArena,
        meta: &[BlockMeta],
        block_size: usize,
    ) -> Option<BlockId> {
        let live = |s: &Self, b: BlockId, stamp: u32| {
            s.stamp[b as usize] == stamp && s.refs[b as usize] == 0 && s.attached(arena, b)
        };
        // Drop stale entries at the front.
        while let Some(&(b, stamp)) = self.idle.front() {
            if live(self, b, stamp) {
                break;
            }
            self.idle.pop_front();
        }
        let mut oldest = None;
        let mut chosen = None;
        for (at, &(b, stamp)) in self.idle.iter().enumerate().take(SCAN) {
            if !live(self, b, stamp) {
                continue;
            }
            oldest.get_or_insert(at);
            if !self.part_may_serve_a_hit(meta, b, block_size) {
                chosen = Some(at);
                break;
            }
        }
        let at = chosen.or(oldest)?;
        self.idle.remove(at).map(|(b, _)| b)
    }

    /// Whether block `b`'s window part lies where a prefix hit is likely: within the first window of its
    /// chain (a short shared prefix), within a window before a leaf (a conversation continued) or a branch
    /// point (a prefix many prompts share), or in a pinned block.
    fn part_may_serve_a_hit(&self, meta: &[BlockMeta], b: BlockId, block_size: usize) -> bool {
        let reach = self.window_blocks(block_size);
        let m = &meta[b as usize];
        if (self.depth[b as usize] as usize) < reach || m.pin_count > 0 {
            return true;
        }
        let mut c = b;
        for _ in 0..reach {
            let m = &meta[c as usize];
            if m.num_children != 1 {
                return true;
            }
            c = m.first_child;
        }
        false
    }
}

/// The page state of a hybrid pool: the arena, and the page manager of each attention kind.
#[derive(Debug)]
pub(super) struct HybridPages {
    pub arena: PageArena,
    pub full: FullAttentionPages,
    pub sliding: SlidingWindowPages,
}

impl HybridPages {
    pub fn new(cfg: &WindowPool, num_blocks: u32) -> Result<Self, KvError> {
        let layers = cfg.sliding.len();
        let n = num_blocks as usize;
        let arena = PageArena::new(cfg, num_blocks)?;
        Ok(Self {
            arena,
            full: FullAttentionPages {
                layers: (0..layers).filter(|&l| !cfg.sliding[l]).collect(),
            },
            sliding: SlidingWindowPages {
                layers: (0..layers).filter(|&l| cfg.sliding[l]).collect(),
                window: cfg.window_tokens,
                refs: vec![0; n],
                stamp: vec![0; n],
                depth: vec![0; n],
                idle: VecDeque::new(),
                num_idle: 0,
            },
        })
    }

    /// Whether block `b` has its window part.
    pub fn attached(&self, b: BlockId) -> bool {
        self.sliding.attached(&self.arena, b)
    }

    /// Pages obtainable now without touching referenced or pinned blocks, the pool having `idle_blocks`
    /// idle cached blocks: free ones, and each kind's reclaimable ones.
    pub fn reclaimable(&self, idle_blocks: u32) -> usize {
        self.arena.num_free()
            + self.full.reclaimable_pages(idle_blocks)
            + self.sliding.reclaimable_pages(idle_blocks)
    }

    /// Pages `needed` new blocks take (their full parts, and window parts for `with_part` of them).
    pub fn pages_for_blocks(&self, needed: usize, with_part: usize) -> usize {
        needed * self.full.pages_per_block() + with_part * self.sliding.pages_per_block()
    }

    /// Returns every page of block `b`, which is leaving the pool's blocks (free list or eviction).
    pub fn free_block(&mut self, b: BlockId) {
        self.sliding.forget(&self.arena, b);
        let layers = self.arena.layers;
        self.arena.give_back(b, 0..layers);
    }

    /// Records a copy of KV tokens `[0, n)` from `src` to `dst`: one copy per layer whose pages both
    /// blocks have.
    pub fn copies(&self, src: BlockId, dst: BlockId, n: usize, out: &mut Vec<BlockCopy>) {
        self.arena.copies(src, dst, n, out);
    }

    /// The page of every layer for each block of `table`, layer-major: `out[l * n + i]` is the page of
    /// layer `l` of block `table[i]`.
    pub fn layer_pages(&self, table: &[BlockId], out: &mut Vec<u32>) {
        out.clear();
        for l in 0..self.arena.layers {
            out.extend(table.iter().map(|&b| self.arena.page(b, l)));
        }
    }

    /// (total pages, free pages, pages held by idle window parts).
    pub fn usage(&self) -> (u32, u32, u32) {
        (
            self.arena.num_pages,
            self.arena.free.len() as u32,
            self.sliding.num_idle * self.sliding.layers.len() as u32,
        )
    }

    /// Checks the page bookkeeping against what the manager holds: `held[b]` window references on block
    /// `b` (by sequences and pins), the pool's free blocks `on_free`, and the blocks' `meta`.
    pub fn check(
        &self,
        held: &[u32],
        on_free: &HashSet<BlockId>,
        meta: &[BlockMeta],
        block_size: usize,
    ) -> Result<(), String> {
        let (a, full, s) = (&self.arena, &self.full.layers, &self.sliding);
        let mut owner = vec![false; a.num_pages as usize];
        for &page in &a.free {
            if std::mem::replace(&mut owner[page as usize], true) {
                return Err(format!("page {page} is twice free"));
            }
        }
        let mut idle = 0;
        for (b, &held) in held.iter().enumerate() {
            let m = &meta[b];
            if s.refs[b] != held {
                return Err(format!(
                    "block {b}: {} window references but {held} sequences hold its window",
                    s.refs[b]
                ));
            }
            let pages = &a.of_block[b * a.layers..(b + 1) * a.layers];
            for (l, &page) in pages.iter().enumerate() {
                if page == NO_PAGE {
                    continue;
                }
                if std::mem::replace(&mut owner[page as usize], true) {
                    return Err(format!("page {page} (block {b}, layer {l}) has two owners"));
                }
            }
            let in_use = !on_free.contains(&(b as BlockId));
            for &l in full {
                if (pages[l] != NO_PAGE) != in_use {
                    return Err(format!(
                        "block {b}: full layer {l} has page {} while the block is {}",
                        pages[l],
                        if in_use { "in use" } else { "free" }
                    ));
                }
            }
            let attached = pages[s.layers[0]] != NO_PAGE;
            if s.layers.iter().any(|&l| (pages[l] != NO_PAGE) != attached) {
                return Err(format!(
                    "block {b}: window part attached in some layers only"
                ));
            }
            if attached && s.refs[b] == 0 {
                if !m.indexed || usize::from(m.computed) < block_size {
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
        if idle != s.num_idle {
            return Err(format!(
                "{} idle window parts counted, {idle} found",
                s.num_idle
            ));
        }
        if let Some(page) = owner.iter().position(|o| !o) {
            return Err(format!("page {page} leaked: neither free nor owned"));
        }
        Ok(())
    }
}
