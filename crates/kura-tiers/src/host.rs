//! `HostArena`: the bytes of the host-memory tier (L2), a flat arena of equal slots addressed by integer ids.
//!
//! One allocation of `num_slots × slot_bytes` bytes; slot `s` is the byte range
//! `[s × slot_bytes, (s + 1) × slot_bytes)`. A slot holds one KV block's payload in whatever layout its owner
//! packs; the arena knows nothing of it and keeps no metadata (which slot holds which block is the caller's
//! table):
//!
//! ```text
//! slot_bytes = 4, num_slots = 3:
//!   | s0: b b b b | s1: b b b b | s2: b b b b |
//!   offset(s) = s × slot_bytes
//! ```
//!
//! Construction allocates fallibly (`Vec::try_reserve_exact`): a size that overflows `usize` is
//! [`TierError::TooLarge`], one the allocator refuses is [`TierError::OutOfMemory`], never an abort. The
//! arena is then written with zeros, which faults every page in at start-up: memory the machine does not
//! have fails there, not in the middle of serving (callers check the size against the memory available
//! first, since the kernel may grant more than it can back).
//!
//! Costs: construction O(bytes) (zeroed); a slot lookup O(1), no allocation.

use crate::error::TierError;

/// The host tier's bytes: `num_slots` slots of `slot_bytes` bytes each.
pub struct HostArena {
    bytes: Vec<u8>,
    num_slots: usize,
    slot_bytes: usize,
}

impl HostArena {
    /// A zeroed arena of `num_slots` slots of `slot_bytes` bytes.
    pub fn new(num_slots: usize, slot_bytes: usize) -> Result<Self, TierError> {
        let total = num_slots
            .checked_mul(slot_bytes)
            .ok_or(TierError::TooLarge {
                num_slots,
                slot_bytes,
            })?;
        let mut bytes = Vec::new();
        bytes
            .try_reserve_exact(total)
            .map_err(|source| TierError::OutOfMemory {
                bytes: total as u64,
                source,
            })?;
        bytes.resize(total, 0);
        Ok(Self {
            bytes,
            num_slots,
            slot_bytes,
        })
    }

    /// Slot `s`'s bytes.
    ///
    /// # Panics
    /// If `s >= num_slots()`: slot ids come from the caller's own table, so an out-of-range id is a bug in
    /// the caller, treated like an out-of-range slice index.
    pub fn slot(&self, s: u32) -> &[u8] {
        let start = self.start(s);
        &self.bytes[start..start + self.slot_bytes]
    }

    /// Slot `s`'s bytes, writable.
    ///
    /// # Panics
    /// If `s >= num_slots()`, as [`HostArena::slot`].
    pub fn slot_mut(&mut self, s: u32) -> &mut [u8] {
        let start = self.start(s);
        &mut self.bytes[start..start + self.slot_bytes]
    }

    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Every slot's bytes as one region: what an accelerator pins so that its copies to and from the
    /// slots run at the bus's speed. The region never moves: the arena is allocated once.
    pub fn region_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Total bytes held (`num_slots × slot_bytes`).
    pub fn bytes(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// Offset of slot `s`; panics on an out-of-range slot (see [`HostArena::slot`]).
    fn start(&self, s: u32) -> usize {
        let s = s as usize;
        assert!(
            s < self.num_slots,
            "host tier slot {s} is out of range: the arena holds {} slots",
            self.num_slots
        );
        // Cannot overflow: s < num_slots and num_slots × slot_bytes fit in usize.
        s * self.slot_bytes
    }
}

impl std::fmt::Debug for HostArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostArena")
            .field("num_slots", &self.num_slots)
            .field("slot_bytes", &self.slot_bytes)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        let a = HostArena::new(3, 5).unwrap();
        assert_eq!(a.num_slots(), 3);
        assert_eq!(a.slot_bytes(), 5);
        assert_eq!(a.bytes(), 15);
        for s in 0..3 {
            assert_eq!(a.slot(s).len(), 5);
            assert!(a.slot(s).iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn slots_are_independent() {
        let mut a = HostArena::new(4, 8).unwrap();
        for s in 0..4u32 {
            a.slot_mut(s).fill(s as u8 + 1);
        }
        a.slot_mut(2)[7] = 0xee;
        for s in 0..4u32 {
            let want = s as u8 + 1;
            let got = a.slot(s);
            if s == 2 {
                assert!(got[..7].iter().all(|&b| b == want));
                assert_eq!(got[7], 0xee);
            } else {
                assert!(got.iter().all(|&b| b == want), "slot {s}: {got:?}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn out_of_range_slot_panics() {
        let a = HostArena::new(2, 4).unwrap();
        let _ = a.slot(2);
    }

    #[test]
    fn impossible_sizes_are_errors() {
        // Fits in usize but no allocator can give it.
        match HostArena::new(usize::MAX / 2, 1) {
            Err(TierError::OutOfMemory { bytes, .. }) => assert_eq!(bytes, (usize::MAX / 2) as u64),
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
        // Overflows usize.
        match HostArena::new(usize::MAX / 2, 3) {
            Err(TierError::TooLarge {
                num_slots,
                slot_bytes,
            }) => assert_eq!((num_slots, slot_bytes), (usize::MAX / 2, 3)),
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }

    #[test]
    fn empty_arena() {
        let a = HostArena::new(0, 64).unwrap();
        assert_eq!(a.bytes(), 0);
        let b = HostArena::new(10, 0).unwrap();
        assert_eq!(b.slot(9).len(), 0);
    }
}
