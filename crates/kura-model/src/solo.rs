//! One sequence run step by step on KV storage of its own, outside the engine: `kura generate` and the
//! model's tests. The first call computes the prompt in one forward call; each later call computes the
//! tokens pushed since, usually one. Without the KV cache every call computes the whole sequence again (to
//! measure what the cache saves, and to check that both give the same tokens).
//!
//! A model with sliding layers runs on a hybrid pool, as in the server: a KV manager with the sliding
//! layers paged apart hands out the pages, and a sliding layer's blocks are given back as its window
//! leaves them (the pages are sized for that: the full layers' blocks of the whole run, the sliding
//! layers' of the prompt plus a window).

use kura_kv::codec::KvDtype;
use kura_kv::storage::KvStorage;
use kura_kv::{CacheKey, KvCacheConfig, KvCacheManager, SeqId, WindowPool};

use crate::error::{ModelError, Result};
use crate::model::{Logits, Model, SeqBatchItem};

/// Where the run's KV lives.
enum Pool {
    /// Blocks of every layer, the sequence's table `0, 1, 2, …`.
    Whole { table: Vec<u32> },
    /// A hybrid pool: the manager's pages.
    Paged {
        kv: Box<KvCacheManager>,
        seq: SeqId,
        /// Tokens handed to the manager so far.
        allocated: usize,
        pages: Vec<u32>,
    },
}

pub struct SoloRun<'m> {
    model: &'m Model,
    kv: KvStorage,
    pool: Pool,
    capacity: usize,
    tokens: Vec<u32>,
    /// Tokens whose K/V are in the storage.
    computed: usize,
    use_kv_cache: bool,
}

impl<'m> SoloRun<'m> {
    /// Storage for `prompt` and `max_new_tokens` more, in blocks of `block_size` tokens of `kv_dtype`.
    pub fn new(
        model: &'m Model,
        prompt: &[u32],
        max_new_tokens: usize,
        kv_dtype: KvDtype,
        block_size: usize,
        use_kv_cache: bool,
    ) -> Result<Self> {
        if prompt.is_empty() {
            return Err(ModelError::Config("the prompt holds no token".into()));
        }
        let capacity = prompt
            .len()
            .checked_add(max_new_tokens)
            .filter(|&n| n <= model.config().max_context())
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "a prompt of {} tokens and {max_new_tokens} more exceed the model's context of {}",
                    prompt.len(),
                    model.config().max_context()
                ))
            })?;
        let layout = model.kv_layout(kv_dtype, block_size)?;
        let blocks = capacity.div_ceil(block_size);
        let hybrid = use_kv_cache
            .then(|| layout.window_pool(layout.layer_bytes_per_block(0)))
            .flatten();
        let (kv, pool) = match hybrid {
            Some(shape) => {
                let window_blocks = WindowPool::window_blocks(shape.window_tokens, block_size);
                let sliding_blocks = blocks.min(prompt.len().div_ceil(block_size) + window_blocks);
                let num_pages =
                    shape.full_layers() * blocks + shape.sliding_layers() * sliding_blocks;
                let window = WindowPool {
                    num_pages: u32::try_from(num_pages).map_err(|_| {
                        ModelError::Config(format!("{num_pages} KV pages for one run"))
                    })?,
                    ..shape
                };
                let mut config = KvCacheConfig::new(window.logical_blocks(), block_size);
                config.enable_prefix_caching = false;
                config.hash_seed = Some(0);
                config.window = Some(window);
                let mut manager = KvCacheManager::new(config)
                    .map_err(|e| ModelError::Config(format!("the run's KV pool: {e}")))?;
                let seq = manager.add_sequence(&CacheKey::new());
                (
                    model.kv_storage_paged(&layout, num_pages)?,
                    Pool::Paged {
                        kv: Box::new(manager),
                        seq,
                        allocated: 0,
                        pages: Vec::new(),
                    },
                )
            }
            None => (
                model.kv_storage(&layout, blocks)?,
                Pool::Whole {
                    table: (0..blocks as u32).collect(),
                },
            ),
        };
        Ok(Self {
            model,
            kv,
            pool,
            capacity,
            tokens: prompt.to_vec(),
            computed: 0,
            use_kv_cache,
        })
    }

    /// Computes the tokens not yet computed; returns the logits of the last position (one row).
    pub fn next_logits(&mut self) -> Result<Logits> {
        let start = if self.use_kv_cache { self.computed } else { 0 };
        let start = start.min(self.tokens.len() - 1);
        let end = self.tokens.len();
        let pool_err = |e: kura_kv::KvError| ModelError::Forward(format!("the run's KV pool: {e}"));
        let item = match &mut self.pool {
            Pool::Whole { table } => SeqBatchItem::new(&self.tokens[start..], start, table),
            Pool::Paged {
                kv,
                seq,
                allocated,
                pages,
            } => {
                let short = || ModelError::Forward("the run's KV pool is out of pages".into());
                kv.allocate_slots(*seq, &self.tokens[*allocated..], None)
                    .map_err(pool_err)?
                    .ok_or_else(short)?;
                *allocated = end;
                if !kv.prepare_window(*seq, start, end).map_err(pool_err)? {
                    return Err(short());
                }
                kv.layer_pages(*seq, pages).map_err(pool_err)?;
                SeqBatchItem {
                    tokens: &self.tokens[start..],
                    start_pos: start,
                    block_table: kv.block_table(*seq).map_err(pool_err)?,
                    layer_pages: pages,
                }
            }
        };
        let logits = self.model.forward(&[item], &mut self.kv)?;
        if let Pool::Paged { kv, seq, .. } = &mut self.pool {
            kv.mark_computed(*seq, end).map_err(pool_err)?;
        }
        self.computed = end;
        Ok(logits)
    }

    /// Appends a token (the one sampled from the last logits); the next call computes it.
    pub fn push(&mut self, token: u32) -> Result<()> {
        if self.tokens.len() >= self.capacity {
            return Err(ModelError::Config(format!(
                "the run holds {} tokens, as many as it was made for",
                self.capacity
            )));
        }
        self.tokens.push(token);
        Ok(())
    }

    /// The prompt and every token pushed since.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Whether the run's sliding layers are paged apart (a hybrid pool).
    pub fn is_hybrid(&self) -> bool {
        matches!(self.pool, Pool::Paged { .. })
    }

    /// Pages of the hybrid pool in use now (`None` without one): the full layers' blocks so far, and
    /// the sliding layers' blocks within their window.
    pub fn pages_in_use(&self) -> Option<u32> {
        match &self.pool {
            Pool::Paged { kv, .. } => kv.page_usage().map(|(total, free, _)| total - free),
            Pool::Whole { .. } => None,
        }
    }
}
