//! Pinned prefixes: what context caching keeps (Anthropic `cache_control` breakpoints, OpenAI's
//! `prompt_cache_retention`, saved contexts).
//!
//! A request names prefixes of its prompt to keep ([`PinSpec`]); once its prompt is computed, the engine
//! pins each one's blocks in the pool until its expiry on the cache clock. A prefix is known by its tenant
//! (the request's cache key) and its tokens, so pinning it again refreshes its expiry (never shortens it)
//! instead of pinning twice.
//!
//! Pins share a budget of pool blocks (`--kv-pin-budget`). A pin that does not fit is never refused: pins
//! are demoted until it fits, each time the least recently used pin of the tenant that holds the most
//! blocks (the new pin counted with its tenant's), so that one tenant's pins never push out those of a
//! tenant holding less. When its own tenant is the largest holder and has nothing else in the pool, or
//! when it alone is over the budget, the new pin is demoted itself. Pins give way the same way to a
//! request that cannot be admitted while nothing else runs ([`PinTable::give_way`]). A pin's tenant is the part of its
//! cache salt before [`TENANT_SEPARATOR`] (the server salts a tenant's requests with its name, then the
//! separator and the request's own `cache_salt`). A demoted pin's blocks are written to the lower tiers at the highest priority and
//! become ordinary cached blocks of the pool; the next request that names the prefix finds them (in the
//! pool or below), and pins them again. Expired pins are released when the engine next looks at the
//! clock: their blocks become ordinary cached blocks, evicted in LRU order.

use std::collections::HashMap;
use std::sync::Arc;

use kura_kv::{CacheKey, PinId, MAX_PRIORITY};

use crate::request::PinSpec;
use kura_sched::Scheduler;

use kura_request::TENANT_SEPARATOR;

/// The tenant part of a cache key's salt (`""` for none).
fn holder(key: &CacheKey) -> &str {
    key.salt()
        .map_or("", |s| s.split(TENANT_SEPARATOR).next().unwrap_or(""))
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PinKey {
    key: CacheKey,
    digest: u64,
    len: usize,
}

impl PinKey {
    fn new(key: &CacheKey, tokens: &[u32]) -> Self {
        Self {
            key: key.clone(),
            digest: xxhash_rust::xxh3::xxh3_64(&token_bytes(tokens)),
            len: tokens.len(),
        }
    }
}

#[derive(Debug)]
struct PinEntry {
    /// `None` once demoted to the lower tiers.
    pin: Option<PinId>,
    blocks: usize,
    expires_at_ms: u64,
    last_used: u64,
    tokens: Arc<[u32]>,
}

/// What pinning one prefix did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pinned {
    /// Tokens of the prefix found cached (whole blocks), pinned or demoted.
    pub tokens: usize,
    /// Pins demoted to make room (this one included, when it did not fit at all).
    pub demoted: usize,
}

/// Most demoted pins remembered (beyond the budget's worth): a demoted pin holds no block, only its
/// tokens and expiry, so the least recently used ones are forgotten past this many (their blocks stay in
/// the lower tiers at the highest priority; their next use pins them again).
const MIN_DEMOTED_KEPT: usize = 1024;

/// Every live pin of the engine.
#[derive(Debug)]
pub(crate) struct PinTable {
    budget_blocks: usize,
    block_size: usize,
    pinned_blocks: usize,
    entries: HashMap<PinKey, PinEntry>,
    tick: u64,
    /// No entry expires before this (so that a step with nothing due costs one comparison).
    next_expiry_ms: u64,
}

impl PinTable {
    pub fn new(budget_blocks: usize, block_size: usize) -> Self {
        Self {
            budget_blocks,
            block_size,
            pinned_blocks: 0,
            entries: HashMap::new(),
            tick: 0,
            next_expiry_ms: u64::MAX,
        }
    }

    /// Live pins (demoted ones included).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Pool blocks held by pins.
    pub fn pinned_blocks(&self) -> usize {
        self.pinned_blocks
    }

    /// Pins (or refreshes) the prefix `spec.tokens` of `prompt` under `key`.
    pub fn pin(
        &mut self,
        sched: &mut Scheduler,
        key: &CacheKey,
        prompt: &[u32],
        spec: PinSpec,
    ) -> Pinned {
        let len = spec.tokens.min(prompt.len());
        let tokens = &prompt[..len];
        let pk = PinKey::new(key, tokens);
        self.tick += 1;
        let mut expires_at_ms = spec.expires_at_ms;
        if let Some(mut old) = self.entries.remove(&pk) {
            expires_at_ms = expires_at_ms.max(old.expires_at_ms);
            unhold(sched, &mut self.pinned_blocks, &mut old);
        }
        let (pin, pinned_tokens) = sched.pin_prefix(tokens, key);
        let blocks = pinned_tokens / self.block_size;
        let mut demoted = 0;
        let pin = if blocks == 0 {
            // Nothing cached to hold (a prefix shorter than a block, or prefix caching off).
            sched.unpin(pin);
            None
        } else if blocks > self.budget_blocks {
            sched.unpin(pin);
            sched.store_prefix_down(tokens, key, MAX_PRIORITY);
            demoted += 1;
            None
        } else {
            let mut fits = true;
            while self.pinned_blocks + blocks > self.budget_blocks {
                if !self.demote_from_largest_holder(sched, holder(key), blocks) {
                    fits = false;
                    break;
                }
                demoted += 1;
            }
            if fits {
                self.pinned_blocks += blocks;
                Some(pin)
            } else {
                sched.unpin(pin);
                sched.store_prefix_down(tokens, key, MAX_PRIORITY);
                demoted += 1;
                None
            }
        };
        if spec.persist && pin.is_some() {
            sched.store_prefix_down(tokens, key, MAX_PRIORITY);
        }
        self.next_expiry_ms = self.next_expiry_ms.min(expires_at_ms);
        // Only a pin in the pool needs its tokens (to be demoted later).
        let tokens: Arc<[u32]> = if pin.is_some() {
            tokens.into()
        } else {
            Arc::from(Vec::new())
        };
        self.entries.insert(
            pk,
            PinEntry {
                pin,
                blocks,
                expires_at_ms,
                last_used: self.tick,
                tokens,
            },
        );
        self.forget_demoted_past_cap();
        Pinned {
            tokens: pinned_tokens,
            demoted,
        }
    }

    /// Demotes the least recently used pin in the pool of the tenant holding the most blocks, counting
    /// `incoming` more for `newcomer` (which pays on a tie); false when that tenant is `newcomer` with
    /// nothing in the pool (the new pin must go itself) or no pin is in the pool.
    fn demote_from_largest_holder(
        &mut self,
        sched: &mut Scheduler,
        newcomer: &str,
        incoming: usize,
    ) -> bool {
        let mut held: HashMap<&str, usize> = HashMap::new();
        held.insert(newcomer, incoming);
        for (pk, e) in self.entries.iter().filter(|(_, e)| e.pin.is_some()) {
            *held.entry(holder(&pk.key)).or_default() += e.blocks;
        }
        let Some((victim, _)) = held
            .iter()
            .max_by_key(|(h, n)| (**n, **h == newcomer))
            .map(|(h, n)| (h.to_string(), *n))
        else {
            return false;
        };
        let Some((pk, _)) = self
            .entries
            .iter()
            .filter(|(pk, e)| e.pin.is_some() && holder(&pk.key) == victim)
            .min_by_key(|(_, e)| e.last_used)
        else {
            return false;
        };
        let pk = pk.clone();
        let e = self.entries.get_mut(&pk).expect("found above");
        unhold(sched, &mut self.pinned_blocks, e);
        let tokens = std::mem::replace(&mut e.tokens, Arc::from(Vec::new()));
        sched.store_prefix_down(&tokens, &pk.key, MAX_PRIORITY);
        true
    }

    /// Demotes one pin, of the tenant holding the most pinned blocks (its least recently used), to
    /// give its blocks back to the pool: for a request that cannot be admitted while nothing else
    /// runs. False when no pin holds a block.
    pub fn give_way(&mut self, sched: &mut Scheduler) -> bool {
        // A newcomer that holds nothing and brings nothing never wins the largest-holder count.
        self.pinned_blocks > 0 && self.demote_from_largest_holder(sched, "\u{0}", 0)
    }

    /// Releases the pin of the prefix `tokens` under `key`; false when there is none.
    pub fn release(&mut self, sched: &mut Scheduler, key: &CacheKey, tokens: &[u32]) -> bool {
        let pk = PinKey::new(key, tokens);
        let Some(mut e) = self.entries.remove(&pk) else {
            return false;
        };
        unhold(sched, &mut self.pinned_blocks, &mut e);
        true
    }

    /// Forgets the least recently used demoted pins beyond `max(MIN_DEMOTED_KEPT, budget)`.
    fn forget_demoted_past_cap(&mut self) {
        let cap = MIN_DEMOTED_KEPT.max(self.budget_blocks);
        let demoted =
            self.entries.len() - self.entries.values().filter(|e| e.pin.is_some()).count();
        if demoted <= cap {
            return;
        }
        let mut old: Vec<(u64, PinKey)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.pin.is_none())
            .map(|(k, e)| (e.last_used, k.clone()))
            .collect();
        old.sort_unstable_by_key(|(t, _)| *t);
        for (_, k) in old.into_iter().take(demoted - cap) {
            self.entries.remove(&k);
        }
    }

    /// Releases every pin whose expiry is at or before `now_ms`; returns how many.
    pub fn expire(&mut self, sched: &mut Scheduler, now_ms: u64) -> usize {
        if now_ms < self.next_expiry_ms {
            return 0;
        }
        let before = self.entries.len();
        let pinned = &mut self.pinned_blocks;
        self.entries.retain(|_, e| {
            if e.expires_at_ms > now_ms {
                return true;
            }
            unhold(sched, pinned, e);
            false
        });
        self.next_expiry_ms = self
            .entries
            .values()
            .map(|e| e.expires_at_ms)
            .min()
            .unwrap_or(u64::MAX);
        before - self.entries.len()
    }
}

/// Releases an entry's pin in the pool, if it holds one, and takes its blocks off the count.
fn unhold(sched: &mut Scheduler, pinned_blocks: &mut usize, e: &mut PinEntry) {
    if let Some(p) = e.pin.take() {
        sched.unpin(p);
        *pinned_blocks -= e.blocks;
    }
}

/// The little-endian bytes of `tokens`, for hashing.
fn token_bytes(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kura_sched::SchedulerConfig;

    fn scheduler(num_blocks: usize) -> Scheduler {
        Scheduler::new(SchedulerConfig {
            block_size_tokens: 4,
            num_blocks,
            max_num_seqs: 4,
            max_num_batched_tokens: 64,
            enable_prefix_caching: true,
            policy: kura_sched::SchedulingPolicy::Fcfs,
            eviction_policy: kura_kv::EvictionPolicy::LeafLru,
            hash_seed: Some(1),
            tiers: kura_kv::TierConfig::default(),
            preemption: kura_sched::PreemptionMode::Recompute,
            admission: kura_sched::AdmissionMode::MaxUtilization,
            window: None,
            record_kv_events: false,
        })
        .unwrap()
    }

    #[test]
    fn a_tenant_pinning_past_the_budget_demotes_its_own_pins_not_anothers() {
        let mut sched = scheduler(64);
        let mut pins = PinTable::new(6, 4);
        let spec = PinSpec {
            tokens: 8,
            expires_at_ms: u64::MAX - 1,
            persist: false,
        };
        let a = CacheKey::new().with_salt("key-a");
        let b = |i: u32| CacheKey::new().with_salt(format!("key-b{TENANT_SEPARATOR}salt{i}"));
        let prompt = |i: u32| [i, i, i, i, i + 1, i + 1, i + 1, i + 1, 0];
        assert!(sched.cache_prompt(&prompt(100), &a).unwrap());
        assert_eq!(pins.pin(&mut sched, &a, &prompt(100), spec).tokens, 8);
        // Tenant b pins many prefixes (under different request salts): the budget of 6 blocks is full
        // after its second, and from then on each of its pins demotes its own oldest.
        for i in 0..6 {
            let k = b(i);
            assert!(sched.cache_prompt(&prompt(i * 10), &k).unwrap());
            let done = pins.pin(&mut sched, &k, &prompt(i * 10), spec);
            assert_eq!(done.tokens, 8);
            assert_eq!(done.demoted, usize::from(i >= 2), "pin {i}");
        }
        assert_eq!(pins.pinned_blocks(), 6);
        let a_entry = pins
            .entries
            .iter()
            .find(|(pk, _)| pk.key == a)
            .map(|(_, e)| e.pin.is_some());
        assert_eq!(a_entry, Some(true), "tenant a's pin stays in the pool");
    }

    #[test]
    fn demoted_and_empty_pins_are_forgotten_past_the_cap() {
        let mut sched = scheduler(16);
        let mut pins = PinTable::new(4, 4);
        let key = CacheKey::new();
        for i in 0..(MIN_DEMOTED_KEPT as u32 + 100) {
            let spec = PinSpec {
                tokens: 8,
                expires_at_ms: 1_000 + u64::from(i),
                persist: false,
            };
            // Nothing is cached: each pin holds no block.
            let done = pins.pin(
                &mut sched,
                &key,
                &[i, i + 1, i + 2, i + 3, 1, 2, 3, 4],
                spec,
            );
            assert_eq!(done.tokens, 0);
        }
        assert_eq!(pins.len(), MIN_DEMOTED_KEPT);
        assert_eq!(pins.pinned_blocks(), 0);
        assert_eq!(pins.expire(&mut sched, 999), 0, "nothing due yet");
        assert_eq!(pins.expire(&mut sched, u64::MAX), MIN_DEMOTED_KEPT);
        assert_eq!(pins.len(), 0);
    }
}
