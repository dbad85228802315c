//! One memory mapping for all of a model's packed matrices, 2 MiB aligned and advised to use transparent
//! huge pages.
//!
//! A decode step streams every weight once. With 4 KiB pages its TLB misses cost about a fifth of
//! single-thread decode speed on the development machine (whose THP setting is `madvise`, so nothing gets
//! huge pages unless it asks). Matrices are built in vectors of their own while the model loads (in
//! parallel), then [`WeightArena::gather`] copies them into one mapping in decode order: O(bytes), once.

use std::sync::Arc;

const HUGE_PAGE: usize = 2 << 20;
/// Every part starts on a cache line.
const ALIGN: usize = 64;

/// Element types that may be viewed from raw bytes: every bit pattern is a value, no padding, alignment
/// at most [`ALIGN`].
///
/// # Safety
/// Implement only for such types.
pub unsafe trait Plain: Copy + Send + Sync + 'static {}

// SAFETY: plain numbers.
unsafe impl Plain for u32 {}
// SAFETY: plain numbers (every bit pattern is some f32).
unsafe impl Plain for f32 {}

/// The mapping.
pub struct WeightArena {
    map: memmap2::MmapMut,
    /// Offset of the first 2 MiB boundary in `map`.
    start: usize,
}

/// A matrix's elements: its own vector while the model loads, then a part of the model's arena.
#[derive(Clone)]
pub enum Stored<T: Plain> {
    Own(Vec<T>),
    Arena {
        arena: Arc<WeightArena>,
        /// Bytes from the arena's start (a multiple of [`ALIGN`]).
        offset: usize,
        len: usize,
    },
}

impl<T: Plain> std::ops::Deref for Stored<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Stored::Own(v) => v,
            Stored::Arena { arena, offset, len } => {
                let bytes =
                    &arena.map[arena.start + offset..arena.start + offset + len * size_of::<T>()];
                // SAFETY: `T: Plain` (any bytes are a value); the part was copied from a `[T]` of `len`
                // elements; its offset is a multiple of ALIGN from a 2 MiB boundary, so aligned for T;
                // the view borrows the arena through `self`.
                unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), *len) }
            }
        }
    }
}

impl<T: Plain> Stored<T> {
    /// The elements' bytes.
    pub fn as_bytes(&self) -> &[u8] {
        let s: &[T] = self;
        // SAFETY: `T: Plain` has no padding, so its elements are initialised bytes.
        unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
    }
}

/// A matrix's elements as the arena moves them.
pub trait ArenaPart {
    fn part_bytes(&self) -> &[u8];
    /// From now on, the elements are those at `offset` in `arena` (already copied there).
    fn move_to(&mut self, arena: &Arc<WeightArena>, offset: usize);
}

impl<T: Plain> ArenaPart for Stored<T> {
    fn part_bytes(&self) -> &[u8] {
        self.as_bytes()
    }

    fn move_to(&mut self, arena: &Arc<WeightArena>, offset: usize) {
        let len = self.len();
        *self = Stored::Arena {
            arena: Arc::clone(arena),
            offset,
            len,
        };
    }
}

impl WeightArena {
    /// Moves `parts` into one arena, in the order given. Huge pages are a request: where the kernel
    /// refuses them, the arena works on ordinary pages.
    pub fn gather(parts: &mut [&mut dyn ArenaPart]) -> std::io::Result<()> {
        let total: usize = parts
            .iter()
            .map(|p| p.part_bytes().len().next_multiple_of(ALIGN))
            .sum();
        if total == 0 {
            return Ok(());
        }
        let mut map = memmap2::MmapMut::map_anon(total + HUGE_PAGE)?;
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        let start = (HUGE_PAGE - map.as_ptr() as usize % HUGE_PAGE) % HUGE_PAGE;
        let mut offsets = Vec::with_capacity(parts.len());
        let mut at = 0;
        for p in parts.iter() {
            let bytes = p.part_bytes();
            map[start + at..start + at + bytes.len()].copy_from_slice(bytes);
            offsets.push(at);
            at += bytes.len().next_multiple_of(ALIGN);
        }
        let arena = Arc::new(WeightArena { map, start });
        for (p, offset) in parts.iter_mut().zip(offsets) {
            p.move_to(&arena, offset);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathered_parts_keep_their_elements() {
        let mut a = Stored::Own(vec![1u32, 2, 3]);
        let mut b = Stored::Own((0..1000).map(|i| i as f32 * 0.5).collect::<Vec<_>>());
        let (want_a, want_b) = (a.to_vec(), b.to_vec());
        WeightArena::gather(&mut [&mut a, &mut b]).unwrap();
        assert!(matches!(a, Stored::Arena { offset: 0, .. }));
        assert!(matches!(b, Stored::Arena { offset: 64, .. }));
        assert_eq!(a.to_vec(), want_a);
        assert_eq!(b.to_vec(), want_b);
        assert_eq!(b.as_ptr() as usize % 64, 0);
    }
}
