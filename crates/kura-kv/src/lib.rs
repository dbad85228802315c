//! `kura-kv` — Kura's KV cache manager: how big the cache is ([`layout`]), how its bytes are stored
//! ([`codec`], [`storage`]), and how its blocks are shared, reused and evicted.
//!
//! No knowledge of models, tokenizers, threads or async lives here: everything is synchronous and
//! deterministic (a logical clock, seeded hashing) so that the simulator and the tests can replay it.

pub mod codec;
pub mod error;
pub mod events;
pub mod evict;
pub mod hash;
pub mod layout;
pub mod manager;
pub mod pool;
pub mod prefix;
pub mod stats;
pub mod storage;
pub mod tier;
pub mod units;

pub use error::KvError;
pub use events::{EvictedBlock, EvictionHook, KvEvent};
pub use evict::EvictionPolicy;
pub use hash::{BlockHash, CacheKey, Secret};
pub use manager::{
    Allocation, BlockCopy, KvCacheConfig, KvCacheManager, PendingStatus, PinId, PrefixChain,
    RetentionRange, SeqId, WindowPool, MAX_BLOCK_SIZE, NO_PAGE,
};
pub use pool::{BlockId, DEFAULT_PRIORITY, MAX_PRIORITY};
pub use prefix::PrefixHit;
pub use stats::{KvStats, KvUsage, TierUsage};
pub use tier::{OffloadPolicy, Tier, TierBlock, TierConfig, TierMove};
