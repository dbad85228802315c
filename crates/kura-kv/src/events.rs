//! What the cache tells the outside world: events about its content (for a router that sends requests to
//! the replica holding their prefix, as vLLM's KV events) and the hook that receives each evicted block
//! (the seam where the host, disk and remote tiers attach).
//!
//! Events are buffered only when enabled in the configuration; draining them is O(number of events).

use crate::hash::{BlockHash, CacheKey};
use crate::pool::BlockId;

/// A change of the cache's content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// A full block's KV is computed and can be hit.
    Stored {
        hash: BlockHash,
        /// `None` for the first block of a sequence (its parent is the cache key).
        parent: Option<BlockHash>,
        block: BlockId,
        /// The block's token ids.
        tokens: Vec<u32>,
        /// For a root block (`parent` is `None`), its cache key (what a `kura_fleet::ContentNamer` names the
        /// root by).
        key: Option<CacheKey>,
    },
    /// A block announced by `Stored` is no longer cached.
    Removed { hash: BlockHash, block: BlockId },
    /// Every cached block was dropped.
    Cleared,
}

/// A block leaving the cache, as shown to an [`EvictionHook`]. Its KV bytes are still intact in the storage
/// arena while the hook runs; they are overwritten only once the block is handed to a new owner.
#[derive(Debug)]
pub struct EvictedBlock<'a> {
    pub block: BlockId,
    pub hash: BlockHash,
    /// `None` for a root block.
    pub parent_hash: Option<BlockHash>,
    /// The block's token ids.
    pub tokens: &'a [u32],
    /// Priority class it was evicted from.
    pub priority: u8,
}

/// Receives every block evicted from the cache, before the block is reused.
pub trait EvictionHook: Send {
    fn on_evict(&mut self, block: &EvictedBlock<'_>);
}
