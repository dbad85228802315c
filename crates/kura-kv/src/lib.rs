//! `kura-kv` — Kura's KV cache manager: how big the cache is ([`layout`]), how its bytes are stored
//! ([`codec`], [`storage`]), and how its blocks are shared, reused and evicted.
//!
//! No knowledge of models, tokenizers, threads or async lives here: everything is synchronous and
//! deterministic (a logical clock, seeded hashing) so that the simulator and the tests can replay it.

pub mod codec;
pub mod layout;
