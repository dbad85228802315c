//! Retention, pins and the caller's clock: what keeps cached blocks longer than LRU alone would.
//!
//! A retention range raises the priority class of a sequence's blocks until its expiry; a pin exempts a
//! cached prefix from eviction until released or expired (the pins are kept in `Pins`, by [`PinId`]).
//! Both are O(blocks touched); expiry is checked when the caller advances the clock (`set_time_ms`) and
//! before each eviction.

use super::{KvCacheManager, PinId, RetentionRange, SeqId};
use crate::error::KvError;
use crate::hash::CacheKey;
use crate::pool::{BlockId, MAX_PRIORITY};
use crate::prefix::PrefixHit;

/// A pinned prefix's blocks.
#[derive(Debug)]
pub(super) struct Pin {
    pub blocks: Vec<BlockId>,
    pub expires_at_ms: Option<u64>,
    /// Hybrid pool: the blocks the pin holds window references on (those the token after the prefix
    /// reads), so that the pinned prefix keeps hitting.
    pub window: Vec<BlockId>,
}

/// The pins, by [`PinId`]: slots of (generation, pin), a slot's generation changing when its pin is
/// released, so that a stale id is unknown rather than another pin.
#[derive(Debug, Default)]
pub(super) struct Pins {
    slots: Vec<(u32, Option<Pin>)>,
}

impl Pins {
    /// Enters `pin` in the first free slot, or a new one.
    fn insert(&mut self, pin: Pin) -> PinId {
        let index = match self.slots.iter().position(|(_, p)| p.is_none()) {
            Some(i) => {
                self.slots[i].1 = Some(pin);
                i
            }
            None => {
                self.slots.push((0, Some(pin)));
                self.slots.len() - 1
            }
        };
        PinId {
            index: index as u32,
            generation: self.slots[index].0,
        }
    }

    /// Whether `pin` is held (not released, not expired).
    fn is_held(&self, pin: PinId) -> bool {
        matches!(
            self.slots.get(pin.index as usize),
            Some((generation, Some(_))) if *generation == pin.generation
        )
    }

    /// Takes the pin of slot `i` out, if one is there; the slot's generation changes.
    fn take(&mut self, i: u32) -> Option<Pin> {
        let slot = &mut self.slots[i as usize];
        let pin = slot.1.take()?;
        slot.0 = slot.0.wrapping_add(1);
        Some(pin)
    }

    /// Slots of the pins expired at `now_ms`.
    fn expired(&self, now_ms: u64) -> Vec<u32> {
        (0..self.slots.len() as u32)
            .filter(|&i| {
                self.slots[i as usize]
                    .1
                    .as_ref()
                    .and_then(|p| p.expires_at_ms)
                    .is_some_and(|t| t <= now_ms)
            })
            .collect()
    }

    /// The held pins.
    pub fn iter(&self) -> impl Iterator<Item = &Pin> {
        self.slots.iter().filter_map(|(_, p)| p.as_ref())
    }
}

impl KvCacheManager {
    /// Advances the caller's clock (ms, monotonic): retentions and pins whose time has come expire.
    pub fn set_time_ms(&mut self, now_ms: u64) {
        self.clock.now_ms = self.clock.now_ms.max(now_ms);
        self.evictor.expire(&mut self.pool.meta, self.clock.now_ms);
        for i in self.pins.expired(self.clock.now_ms) {
            self.release_pin(i);
        }
    }

    /// Sets the retention of this sequence's token ranges; applied to its blocks now and as they are
    /// allocated or attached.
    pub fn set_retention(&mut self, id: SeqId, ranges: &[RetentionRange]) -> Result<(), KvError> {
        for r in ranges {
            if r.start >= r.end || r.priority > MAX_PRIORITY {
                return Err(KvError::BadRetention {
                    start: r.start,
                    end: r.end,
                    priority: r.priority,
                    max: MAX_PRIORITY,
                });
            }
        }
        let seq = self.seq_mut(id)?;
        seq.retention = ranges.to_vec();
        let table = std::mem::take(&mut seq.table);
        for (i, &b) in table.iter().enumerate() {
            self.apply_retention(id, i, b)?;
        }
        self.seq_mut(id)?.table = table;
        Ok(())
    }

    pub(super) fn apply_retention(
        &mut self,
        id: SeqId,
        block_index: usize,
        b: BlockId,
    ) -> Result<(), KvError> {
        let pos = block_index * self.config.block_size;
        let Some(r) = self
            .seq(id)?
            .retention
            .iter()
            .find(|r| r.start <= pos && pos < r.end)
            .copied()
        else {
            return Ok(());
        };
        let until = r
            .duration_ms
            .map_or(u64::MAX, |d| self.clock.now_ms.saturating_add(d));
        let m = &mut self.pool.meta[b as usize];
        let current = m.effective_priority(self.clock.now_ms);
        if r.priority > current || (r.priority == current && until > m.retained_until_ms) {
            m.priority = r.priority;
            m.retained_until_ms = until;
            self.evictor.note_retention(b, m.identity, until);
        }
        Ok(())
    }

    /// Pins the computed cached prefix of `tokens` under `key` against eviction, until [`Self::unpin`] or
    /// until `ttl_ms` has passed on the caller's clock. Returns the pin and the number of tokens pinned
    /// (whole blocks; 0 if nothing is cached).
    pub fn pin_prefix(
        &mut self,
        tokens: &[u32],
        key: &CacheKey,
        ttl_ms: Option<u64>,
    ) -> (PinId, usize) {
        let bs = self.config.block_size;
        let blocks = self.cached_prefix_blocks(tokens, key);
        for &b in &blocks {
            let m = &mut self.pool.meta[b as usize];
            if m.is_idle() {
                self.evictor.num_idle -= 1;
            }
            m.pin_count += 1;
            m.heap_token = 0;
        }
        let pinned = blocks.len() * bs;
        let window = self.pinned_window(&blocks);
        for &b in &window {
            self.win_ref(b);
        }
        let pin = Pin {
            blocks,
            expires_at_ms: ttl_ms.map(|t| self.clock.now_ms.saturating_add(t)),
            window,
        };
        (self.pins.insert(pin), pinned)
    }

    /// The pool blocks holding the computed, cached full blocks of the prefix `tokens` under `key`, from
    /// the first on, up to the first that is missing or still being computed.
    pub(super) fn cached_prefix_blocks(&mut self, tokens: &[u32], key: &CacheKey) -> Vec<BlockId> {
        let bs = self.config.block_size;
        let mut blocks = Vec::new();
        if let Some(key_id) = self
            .index
            .key_id(key)
            .filter(|_| self.config.enable_prefix_caching)
        {
            let mut hit = PrefixHit::default();
            self.lookup_pool(key_id, tokens, &mut hit);
            hit.partial = None;
            self.fit_hit_to_window(&mut hit);
            for b in hit.block_ids() {
                let m = &self.pool.meta[b as usize];
                if usize::from(m.computed) < bs || m.writer != crate::pool::NO_WRITER {
                    break;
                }
                blocks.push(b);
            }
        }
        blocks
    }

    /// Releases a pin. A pin that expired or was released already is an [`KvError::UnknownPin`].
    pub fn unpin(&mut self, pin: PinId) -> Result<(), KvError> {
        if !self.pins.is_held(pin) {
            return Err(KvError::UnknownPin(pin.index));
        }
        self.release_pin(pin.index);
        Ok(())
    }

    pub(super) fn release_pin(&mut self, i: u32) {
        let Some(pin) = self.pins.take(i) else {
            return;
        };
        for &b in &pin.window {
            self.win_unref(b);
        }
        for &b in pin.blocks.iter().rev() {
            let m = &mut self.pool.meta[b as usize];
            m.pin_count -= 1;
            if m.is_idle() {
                self.evictor.num_idle += 1;
                self.evictor
                    .offer(&mut self.pool.meta, b, self.clock.now_ms);
            }
        }
    }
}
