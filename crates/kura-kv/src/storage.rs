//! `KvStorage`: the bytes of the KV cache, one contiguous K region and one V region per layer.
//!
//! Each region is laid out head-major, then block, then token slot, then element, so that an attention
//! kernel reads one head's tokens of a block as one contiguous run, and one head's tokens of blocks with
//! consecutive ids (a sequence's blocks as a fresh pool hands them out) as one longer run, which the
//! CPU's hardware prefetchers stream: a decode step after ~1,000 tokens runs 18 % faster on one thread
//! than with the block outermost (blocks of 16, bf16; docs/performance.md).
//!
//! ```text
//! layer l, K region:  [kv_heads][num_blocks][block_size_tokens][head_dim]
//!
//! head 1, block 7, block size 4, head_dim 3:
//!   ... | h1: … b6 | b7: [e0 e1 e2][e0 e1 e2][e0 e1 e2][e0 e1 e2] | b8 … | ...
//!                         slot 0     slot 1    slot 2    slot 3
//! offset(block, head, slot) = ((head × num_blocks + block) × block_size + slot) × head_dim
//! ```
//!
//! Plain formats (f32, f16, bf16) are stored as typed elements. The quantised formats of [`crate::codec`]
//! (int8, fp8, int4) are stored as bytes, one encoded vector (payload, then its scales) per slot, so that
//! the same offsets hold in units of bytes: `offset = ((head × num_blocks + block) × block_size + slot) ×
//! bytes_per_vector(head_dim)`. Scales live inside the block, so a block's bytes are self-contained and
//! move through the tiers unchanged. Sizes come from [`KvLayout`]: a storage of `num_blocks` blocks holds
//! exactly `num_blocks × layout.bytes_per_block()` bytes.
//!
//! Construction allocates fallibly (`Vec::try_reserve_exact`): a pool larger than the allocator can give
//! is [`StorageError::OutOfMemory`], never an abort, and a size that overflows `usize` is
//! [`StorageError::TooLarge`]. The regions are then written with zeros, which faults every page in at
//! start-up: memory the machine does not have fails there, not in the middle of serving (callers check
//! the size against the memory available first, since the kernel may grant more than it can back).
//!
//! Costs: construction O(bytes) (zeroed), writing a token O(kv_heads × head_dim) (plus a rotation of
//! O(head_dim log head_dim) per head for the quantised formats), copying a block prefix
//! O(layers × kv_heads × tokens × head_dim).

use std::collections::TryReserveError;

use half::{bf16, f16};

use crate::codec::{self, KvDtype};
use crate::layout::{AttentionKind, KvLayout, LayerKv};

/// Misuse of a [`KvStorage`] by its caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StorageError {
    #[error(
        "KV element format {dtype} rotates groups of {group} elements, which needs head_dim {head_dim} \
         to split into groups whose sizes are powers of two"
    )]
    UnsupportedHeadDim {
        dtype: KvDtype,
        head_dim: usize,
        group: usize,
    },
    #[error("layer {layer} uses multi-head latent attention, which KvStorage does not store yet")]
    UnsupportedAttention { layer: usize },
    #[error("block {block} is out of range: the storage holds {num_blocks} blocks")]
    BlockOutOfRange { block: usize, num_blocks: usize },
    #[error("{tokens} tokens do not fit in a block of {block_size_tokens} tokens")]
    TooManyTokens {
        tokens: usize,
        block_size_tokens: usize,
    },
    #[error("key offsets: {0}")]
    KeyOffsets(String),
    #[error(
        "layer {layer}'s KV shape differs from layer 0's; a paged pool needs one shape for every layer"
    )]
    MixedLayers { layer: usize },
    #[error("a paged KV storage has no whole blocks to export or import (lower tiers need whole blocks)")]
    Paged,
    #[error("a block's KV is {expected} bytes, not {got}")]
    BlockBytes { expected: u64, got: usize },
    #[error("a KV cache of {num_blocks} blocks does not fit in this machine's address space")]
    TooLarge { num_blocks: usize },
    #[error(
        "cannot allocate the KV cache: {num_blocks} blocks take {bytes} bytes and the allocator refused \
         {region_bytes} of them (layer {layer})"
    )]
    OutOfMemory {
        num_blocks: usize,
        bytes: u64,
        layer: usize,
        region_bytes: u64,
        #[source]
        source: std::collections::TryReserveError,
    },
}

/// One layer's K or V region in its element format.
#[derive(Clone)]
pub enum KvRegion {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
    /// Encoded vectors of a quantised format ([`codec::encode_vector`]).
    Quant(Vec<u8>),
}

/// The largest head size whose K can be centred ([`KvStorage::set_key_offsets`]).
const MAX_CENTRED_HEAD_DIM: usize = 512;

/// A read-only view of the vectors of one head in one block: `block_size_tokens × head_dim` elements, or
/// for a quantised format `block_size_tokens` encoded vectors of `bytes_per_vector(head_dim)` bytes.
#[derive(Clone, Copy)]
pub enum KvSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
    Quant(&'a [u8]),
}

/// An element format whose values are plain bytes: no padding, every bit pattern valid.
trait Element: Copy {
    const BYTES: usize;
    fn to_le(self, out: &mut [u8]);
    fn from_le(b: &[u8]) -> Self;
}

macro_rules! element {
    ($t:ty, $n:expr) => {
        impl Element for $t {
            const BYTES: usize = $n;
            fn to_le(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
            fn from_le(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("chunks of the element's size"))
            }
        }
    };
}
element!(f32, 4);
element!(f16, 2);
element!(bf16, 2);
element!(u8, 1);

/// Copies `src` little-endian into the front of `out`; returns the bytes written. On a little-endian
/// machine the memory is already that: one memcpy.
fn export_le<T: Element>(src: &[T], out: &mut [u8]) -> usize {
    let n = src.len() * T::BYTES;
    let out = &mut out[..n];
    if cfg!(target_endian = "little") {
        // SAFETY: T is f32, f16, bf16 or u8 (the `Element` impls): `n` initialised bytes without padding,
        // read through a shared borrow of `src` that outlives the view.
        let bytes = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), n) };
        out.copy_from_slice(bytes);
    } else {
        for (o, &x) in out.chunks_exact_mut(T::BYTES).zip(src) {
            x.to_le(o);
        }
    }
    n
}

/// Fills `dst` from the little-endian bytes at the front of `src`; returns the bytes read.
fn import_le<T: Element>(dst: &mut [T], src: &[u8]) -> usize {
    let n = dst.len() * T::BYTES;
    let src = &src[..n];
    if cfg!(target_endian = "little") {
        // SAFETY: as in `export_le`; every bit pattern is a valid f32, f16, bf16 or u8, and `dst` is borrowed
        // mutably for the view's life.
        let bytes = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), n) };
        bytes.copy_from_slice(src);
    } else {
        for (d, b) in dst.iter_mut().zip(src.chunks_exact(T::BYTES)) {
            *d = T::from_le(b);
        }
    }
    n
}

/// `elements` zeros, or the allocator's refusal.
fn try_zeroed<T: Clone>(zero: T, elements: usize) -> Result<Vec<T>, TryReserveError> {
    let mut v = Vec::new();
    v.try_reserve_exact(elements)?;
    v.resize(elements, zero);
    Ok(v)
}

/// Units of one stored vector of `head_dim` elements (elements for plain formats, bytes for quantised
/// ones) and the bytes of one unit.
fn vector_units(dtype: KvDtype, head_dim: usize) -> (usize, usize) {
    match dtype {
        KvDtype::F32 => (head_dim, std::mem::size_of::<f32>()),
        KvDtype::F16 => (head_dim, std::mem::size_of::<f16>()),
        KvDtype::Bf16 => (head_dim, std::mem::size_of::<bf16>()),
        KvDtype::Fp8 | KvDtype::Int8 | KvDtype::Int4 => (dtype.bytes_per_vector(head_dim), 1),
    }
}

impl KvRegion {
    /// A zeroed region; `oom` turns the allocator's refusal into the caller's error.
    fn zeroed(
        dtype: KvDtype,
        elements: usize,
        oom: impl Fn(TryReserveError) -> StorageError,
    ) -> Result<Self, StorageError> {
        match dtype {
            KvDtype::F32 => try_zeroed(0.0, elements).map(KvRegion::F32),
            KvDtype::F16 => try_zeroed(f16::ZERO, elements).map(KvRegion::F16),
            KvDtype::Bf16 => try_zeroed(bf16::ZERO, elements).map(KvRegion::Bf16),
            KvDtype::Fp8 | KvDtype::Int8 | KvDtype::Int4 => {
                try_zeroed(0u8, elements).map(KvRegion::Quant)
            }
        }
        .map_err(oom)
    }

    fn slice(&self, start: usize, len: usize) -> KvSlice<'_> {
        match self {
            KvRegion::F32(v) => KvSlice::F32(&v[start..start + len]),
            KvRegion::F16(v) => KvSlice::F16(&v[start..start + len]),
            KvRegion::Bf16(v) => KvSlice::Bf16(&v[start..start + len]),
            KvRegion::Quant(v) => KvSlice::Quant(&v[start..start + len]),
        }
    }

    /// Stores one vector `src` at unit `start`; `dtype` and `scratch` serve the quantised formats.
    fn write(&mut self, start: usize, src: &[f32], dtype: KvDtype, scratch: &mut [f32]) {
        match self {
            KvRegion::Quant(v) => {
                let n = dtype.bytes_per_vector(src.len());
                codec::encode_vector(dtype, src, &mut v[start..start + n], scratch);
            }
            KvRegion::F32(v) => v[start..start + src.len()].copy_from_slice(src),
            KvRegion::F16(v) => {
                for (d, s) in v[start..start + src.len()].iter_mut().zip(src) {
                    *d = f16::from_f32(*s);
                }
            }
            KvRegion::Bf16(v) => {
                for (d, s) in v[start..start + src.len()].iter_mut().zip(src) {
                    *d = bf16::from_f32(*s);
                }
            }
        }
    }

    /// Writes elements `[start, start + len)` little-endian at the front of `out`; returns the bytes written.
    fn export(&self, start: usize, len: usize, out: &mut [u8]) -> usize {
        match self {
            KvRegion::F32(v) => export_le(&v[start..start + len], out),
            KvRegion::F16(v) => export_le(&v[start..start + len], out),
            KvRegion::Bf16(v) => export_le(&v[start..start + len], out),
            KvRegion::Quant(v) => export_le(&v[start..start + len], out),
        }
    }

    /// Reads elements `[start, start + len)` from the front of `src` (as `export` wrote them); returns the
    /// bytes read.
    fn import(&mut self, start: usize, len: usize, src: &[u8]) -> usize {
        match self {
            KvRegion::F32(v) => import_le(&mut v[start..start + len], src),
            KvRegion::F16(v) => import_le(&mut v[start..start + len], src),
            KvRegion::Bf16(v) => import_le(&mut v[start..start + len], src),
            KvRegion::Quant(v) => import_le(&mut v[start..start + len], src),
        }
    }

    fn copy_within(&mut self, src: usize, dst: usize, len: usize) {
        match self {
            KvRegion::F32(v) => v.copy_within(src..src + len, dst),
            KvRegion::F16(v) => v.copy_within(src..src + len, dst),
            KvRegion::Bf16(v) => v.copy_within(src..src + len, dst),
            KvRegion::Quant(v) => v.copy_within(src..src + len, dst),
        }
    }
}

/// The K and V regions of one layer, with the shape needed to index them. Each region is head-major:
/// every block's slots of head 0, then of head 1, and so on, so that one head's vectors over blocks
/// with consecutive ids (a sequence's blocks, as a fresh pool hands them out) are one contiguous run,
/// which the CPU's prefetchers stream; a block's head is one run of `block_size_tokens` vectors.
///
/// ```text
/// region: | head 0: block 0 (slots), block 1, … | head 1: block 0, block 1, … | …
/// ```
#[derive(Clone)]
pub struct LayerStorage {
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size_tokens: usize,
    /// Blocks in the region (the stride between heads, in blocks).
    num_blocks: usize,
    dtype: KvDtype,
    /// Units (elements, or bytes for quantised formats) of one stored vector.
    vec_units: usize,
    k: KvRegion,
    v: KvRegion,
    /// Room for one vector while it is encoded.
    scratch: Vec<f32>,
    /// Subtracted from every K vector before it is encoded, per head (`kv_heads × head_dim`); empty for
    /// none. See [`KvStorage::set_key_offsets`].
    key_offset: Vec<f32>,
}

impl LayerStorage {
    /// Unit offset (elements, or bytes for quantised formats) of `(block, head, slot)` in either region.
    #[inline]
    pub fn offset(&self, block: usize, head: usize, slot: usize) -> usize {
        ((head * self.num_blocks + block) * self.block_size_tokens + slot) * self.vec_units
    }

    /// The element format of both regions.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Units of one stored vector: `head_dim` for plain formats, `bytes_per_vector(head_dim)` bytes for
    /// quantised ones.
    pub fn vector_units(&self) -> usize {
        self.vec_units
    }

    /// The unit ranges of `block` in either region: one run of its slots per head, in head order. The
    /// iterator holds the offsets, not the storage, so the regions can be written while it runs.
    fn block_runs(&self, block: usize) -> impl Iterator<Item = (usize, usize)> + Clone {
        let len = self.block_size_tokens * self.vec_units;
        let (first, stride) = (self.offset(block, 0, 0), self.num_blocks * len);
        (0..self.kv_heads).map(move |head| (first + head * stride, len))
    }

    /// K vectors of every slot of `head` in `block` (`block_size_tokens` vectors).
    #[inline]
    pub fn k_head_block(&self, block: usize, head: usize) -> KvSlice<'_> {
        self.k.slice(
            self.offset(block, head, 0),
            self.block_size_tokens * self.vec_units,
        )
    }

    /// V vectors of every slot of `head` in `block`.
    #[inline]
    pub fn v_head_block(&self, block: usize, head: usize) -> KvSlice<'_> {
        self.v.slice(
            self.offset(block, head, 0),
            self.block_size_tokens * self.vec_units,
        )
    }

    /// Stores one token's K and V (`kv_heads × head_dim` each, heads consecutive) at `slot` of `block`.
    pub fn write_token(&mut self, block: usize, slot: usize, k: &[f32], v: &[f32]) {
        let offset = std::mem::take(&mut self.key_offset);
        self.write_token_centred(block, slot, k, v, &offset);
        self.key_offset = offset;
    }

    /// [`LayerStorage::write_token`] with K stored minus `key_offset` (empty for none).
    fn write_token_centred(
        &mut self,
        block: usize,
        slot: usize,
        k: &[f32],
        v: &[f32],
        key_offset: &[f32],
    ) {
        assert_eq!(
            k.len(),
            self.kv_heads * self.head_dim,
            "K of one token has kv_heads × head_dim elements"
        );
        assert_eq!(
            v.len(),
            k.len(),
            "V of one token has kv_heads × head_dim elements"
        );
        assert!(
            slot < self.block_size_tokens,
            "slot {slot} outside a block of {}",
            self.block_size_tokens
        );
        let hd = self.head_dim;
        for head in 0..self.kv_heads {
            let at = self.offset(block, head, slot);
            let src = head * hd..(head + 1) * hd;
            let (dtype, scratch) = (self.dtype, &mut self.scratch[..]);
            if key_offset.is_empty() {
                self.k.write(at, &k[src.clone()], dtype, scratch);
            } else {
                let mut centred = [0f32; MAX_CENTRED_HEAD_DIM];
                let centred = &mut centred[..hd];
                for ((c, x), m) in centred
                    .iter_mut()
                    .zip(&k[src.clone()])
                    .zip(&key_offset[src.clone()])
                {
                    *c = x - m;
                }
                self.k.write(at, centred, dtype, scratch);
            }
            self.v.write(at, &v[src], dtype, scratch);
        }
    }
}

/// The KV bytes of a pool of `num_blocks` blocks; every block spans all layers. Or, paged
/// ([`KvStorage::new_paged`]), one arena of `num_blocks` pages of one layer each, which a hybrid pool's
/// manager hands out per layer (`kura_kv::manager` `WindowPool`): the ids given to it are then pages.
#[derive(Clone)]
pub struct KvStorage {
    layout: KvLayout,
    num_blocks: usize,
    layers: Vec<LayerStorage>,
    /// Paged: `layers` is one arena shared by every layer, and these are the key offsets per layer.
    paged: Option<Vec<Vec<f32>>>,
}

impl KvStorage {
    /// Allocates zeroed regions for `num_blocks` blocks of `layout`: [`StorageError::TooLarge`] or
    /// [`StorageError::OutOfMemory`] when they cannot be had.
    pub fn new(layout: &KvLayout, num_blocks: usize) -> Result<Self, StorageError> {
        let block_size_tokens = layout.block_size_tokens;
        let too_large = || StorageError::TooLarge { num_blocks };
        let dtype = layout.dtype;
        // Every layer's unit count, and the whole size, checked before anything is allocated.
        let mut shapes = Vec::with_capacity(layout.num_layers());
        for (i, l) in layout.layers.iter().enumerate() {
            if matches!(l.attention, AttentionKind::Mla { .. }) {
                return Err(StorageError::UnsupportedAttention { layer: i });
            }
            if dtype.is_rotated() && !codec::groups_are_powers_of_two(l.head_dim) {
                return Err(StorageError::UnsupportedHeadDim {
                    dtype,
                    head_dim: l.head_dim,
                    group: codec::QUANT_GROUP,
                });
            }
            let (vec_units, unit_bytes) = vector_units(dtype, l.head_dim);
            let elements = num_blocks
                .checked_mul(l.kv_heads)
                .and_then(|n| n.checked_mul(block_size_tokens))
                .and_then(|n| n.checked_mul(vec_units))
                .filter(|&n| n.checked_mul(unit_bytes).is_some())
                .ok_or_else(too_large)?;
            shapes.push((elements, vec_units, unit_bytes));
        }
        let bytes = (num_blocks as u64)
            .checked_mul(layout.bytes_per_block())
            .ok_or_else(too_large)?;
        let mut layers = Vec::with_capacity(shapes.len());
        for (i, (l, &(elements, vec_units, unit_bytes))) in
            layout.layers.iter().zip(&shapes).enumerate()
        {
            let oom = |source| StorageError::OutOfMemory {
                num_blocks,
                bytes,
                layer: i,
                region_bytes: (elements * unit_bytes) as u64,
                source,
            };
            let k = KvRegion::zeroed(dtype, elements, oom)?;
            let v = KvRegion::zeroed(dtype, elements, oom)?;
            layers.push(LayerStorage {
                kv_heads: l.kv_heads,
                head_dim: l.head_dim,
                block_size_tokens,
                num_blocks,
                dtype,
                vec_units,
                k,
                v,
                scratch: vec![0.0; l.head_dim],
                key_offset: Vec::new(),
            });
        }
        Ok(KvStorage {
            layout: layout.clone(),
            num_blocks,
            layers,
            paged: None,
        })
    }

    /// An arena of `num_pages` pages, one layer of one block each, for a hybrid pool whose manager gives
    /// every layer of a block its own page. Every layer must have the same KV shape.
    pub fn new_paged(layout: &KvLayout, num_pages: usize) -> Result<Self, StorageError> {
        let first = layout.layers[0];
        if let Some(i) = layout
            .layers
            .iter()
            .position(|l| (l.kv_heads, l.head_dim) != (first.kv_heads, first.head_dim))
        {
            return Err(StorageError::MixedLayers { layer: i });
        }
        let one = KvLayout {
            layers: vec![LayerKv {
                attention: AttentionKind::Full,
                ..first
            }],
            dtype: layout.dtype,
            block_size_tokens: layout.block_size_tokens,
        };
        let arena = KvStorage::new(&one, num_pages)?;
        Ok(KvStorage {
            layout: layout.clone(),
            num_blocks: num_pages,
            layers: arena.layers,
            paged: Some(vec![Vec::new(); layout.num_layers()]),
        })
    }

    /// Whether ids address pages of one layer ([`KvStorage::new_paged`]) rather than whole blocks.
    pub fn is_paged(&self) -> bool {
        self.paged.is_some()
    }

    /// Stores one token's K and V for layer `layer` at `slot` of `block` (a page when paged).
    pub fn write_token(&mut self, layer: usize, block: usize, slot: usize, k: &[f32], v: &[f32]) {
        match &self.paged {
            None => self.layers[layer].write_token(block, slot, k, v),
            Some(offsets) => {
                self.layers[0].write_token_centred(block, slot, k, v, &offsets[layer]);
            }
        }
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size_tokens(&self) -> usize {
        self.layout.block_size_tokens
    }

    pub fn dtype(&self) -> KvDtype {
        self.layout.dtype
    }

    /// Bytes held by the regions: `num_blocks × layout.bytes_per_block()` (pages of one layer when
    /// paged).
    pub fn bytes(&self) -> u64 {
        let per = if self.paged.is_some() {
            self.layout.layer_bytes_per_block(0)
        } else {
            self.layout.bytes_per_block()
        };
        self.num_blocks as u64 * per
    }

    /// Layer `layer`'s storage (the shared arena when paged).
    pub fn layer(&self, layer: usize) -> &LayerStorage {
        if self.paged.is_some() {
            &self.layers[0]
        } else {
            &self.layers[layer]
        }
    }

    /// Checks that a block id addresses this storage.
    pub fn check_block(&self, block: usize) -> Result<(), StorageError> {
        if block < self.num_blocks {
            Ok(())
        } else {
            Err(StorageError::BlockOutOfRange {
                block,
                num_blocks: self.num_blocks,
            })
        }
    }

    /// Sets the vector subtracted from every K written from now on, per layer and head (`offsets[layer]`
    /// holds `kv_heads × head_dim` values). Attention is unchanged by it: a query's scores all move by the
    /// same `q · offset`, which the softmax cancels. What it buys is precision: K of a head shares a large
    /// common part across tokens (its mean), and a quantised K spends its steps on that common part unless
    /// it is taken out first (SageAttention's smoothing of K, with a mean fixed per head instead of per
    /// block, so that a token's bytes still depend on that token alone). The offsets shape the stored
    /// bytes: blocks written under other offsets must not be mixed in (the server's KV fingerprint covers
    /// them). Only quantised formats take offsets; head sizes up to 512.
    pub fn set_key_offsets(&mut self, offsets: Vec<Vec<f32>>) -> Result<(), StorageError> {
        if !self.layout.dtype.is_quantized() {
            return Err(StorageError::KeyOffsets(format!(
                "{} KV stores K as it is; only quantised formats take key offsets",
                self.layout.dtype
            )));
        }
        let layers = self.layout.num_layers();
        if offsets.len() != layers {
            return Err(StorageError::KeyOffsets(format!(
                "{} layers of offsets for {layers} layers",
                offsets.len()
            )));
        }
        for (i, o) in offsets.iter().enumerate() {
            let layer = self.layer(i);
            if o.len() != layer.kv_heads * layer.head_dim || layer.head_dim > MAX_CENTRED_HEAD_DIM {
                return Err(StorageError::KeyOffsets(format!(
                    "layer {i}: {} offsets for {} heads of {}",
                    o.len(),
                    layer.kv_heads,
                    layer.head_dim
                )));
            }
            if o.iter().any(|x| !x.is_finite()) {
                return Err(StorageError::KeyOffsets(format!(
                    "layer {i}: an offset is not finite"
                )));
            }
        }
        match &mut self.paged {
            Some(per_layer) => *per_layer = offsets,
            None => {
                for (layer, o) in self.layers.iter_mut().zip(offsets) {
                    layer.key_offset = o;
                }
            }
        }
        Ok(())
    }

    /// Writes every byte of block `block`'s KV into `out` (exactly `layout.bytes_per_block()` bytes): layer
    /// by layer, the block's K run (`kv_heads × block_size_tokens × head_dim` elements) then its V run,
    /// each element little-endian. This is how a block leaves the pool for a lower tier; the same bytes
    /// given to [`KvStorage::import_block`] restore it exactly.
    ///
    /// ```text
    /// out: | L0 K (heads, slots, dims) | L0 V | L1 K | L1 V | ... |
    /// ```
    pub fn export_block(&self, block: usize, out: &mut [u8]) -> Result<(), StorageError> {
        self.check_whole_blocks()?;
        self.check_block(block)?;
        self.check_block_bytes(out.len())?;
        let mut at = 0;
        for layer in &self.layers {
            for region in [&layer.k, &layer.v] {
                for (start, len) in layer.block_runs(block) {
                    at += region.export(start, len, &mut out[at..]);
                }
            }
        }
        debug_assert_eq!(at, out.len());
        Ok(())
    }

    /// Overwrites block `block`'s KV with `bytes`, as [`KvStorage::export_block`] wrote them.
    pub fn import_block(&mut self, block: usize, bytes: &[u8]) -> Result<(), StorageError> {
        self.check_whole_blocks()?;
        self.check_block(block)?;
        self.check_block_bytes(bytes.len())?;
        let mut at = 0;
        for layer in &mut self.layers {
            let runs = layer.block_runs(block);
            for region in [&mut layer.k, &mut layer.v] {
                for (start, len) in runs.clone() {
                    at += region.import(start, len, &bytes[at..]);
                }
            }
        }
        debug_assert_eq!(at, bytes.len());
        Ok(())
    }

    fn check_whole_blocks(&self) -> Result<(), StorageError> {
        if self.paged.is_some() {
            Err(StorageError::Paged)
        } else {
            Ok(())
        }
    }

    fn check_block_bytes(&self, got: usize) -> Result<(), StorageError> {
        let expected = self.layout.bytes_per_block();
        if got as u64 == expected {
            Ok(())
        } else {
            Err(StorageError::BlockBytes { expected, got })
        }
    }

    /// Copies the first `num_tokens` token slots of block `src` into block `dst`, in every layer, head, K
    /// and V: the copy-on-write of a partially filled shared block. Slots after `num_tokens` in `dst` are
    /// left as they were. Copying a block onto itself is a no-op.
    pub fn copy_block_prefix(
        &mut self,
        src: usize,
        dst: usize,
        num_tokens: usize,
    ) -> Result<(), StorageError> {
        self.check_block(src)?;
        self.check_block(dst)?;
        if num_tokens > self.layout.block_size_tokens {
            return Err(StorageError::TooManyTokens {
                tokens: num_tokens,
                block_size_tokens: self.layout.block_size_tokens,
            });
        }
        if src == dst || num_tokens == 0 {
            return Ok(());
        }
        for layer in &mut self.layers {
            let len = num_tokens * layer.vec_units;
            for head in 0..layer.kv_heads {
                let (from, to) = (layer.offset(src, head, 0), layer.offset(dst, head, 0));
                layer.k.copy_within(from, to, len);
                layer.v.copy_within(from, to, len);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(s: KvSlice<'_>) -> Vec<f32> {
        match s {
            KvSlice::F32(v) => v.to_vec(),
            KvSlice::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            KvSlice::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
            KvSlice::Quant(_) => unreachable!("quantised slices are read with `decoded`"),
        }
    }

    /// The vectors of a head's block, decoded to the original basis, for any format.
    fn decoded(l: &LayerStorage, s: KvSlice<'_>) -> Vec<f32> {
        match s {
            KvSlice::Quant(bytes) => bytes
                .chunks_exact(l.vector_units())
                .flat_map(|v| {
                    let mut out = vec![0f32; l.head_dim];
                    codec::decode_vector(l.dtype(), v, &mut out);
                    out
                })
                .collect(),
            other => read(other),
        }
    }

    const QUANT: [KvDtype; 3] = [KvDtype::Int8, KvDtype::Fp8, KvDtype::Int4];

    #[test]
    fn quantised_storage_is_exactly_the_layouts_bytes() {
        // The planner's bytes per block (the layout) and the storage's regions agree in every format.
        for dtype in KvDtype::ALL {
            for head_dim in [64, 128, 80] {
                let layout = KvLayout::uniform(3, 2, head_dim, dtype, 16).unwrap();
                let s = KvStorage::new(&layout, 5).unwrap();
                let mut held = 0u64;
                for l in &s.layers {
                    for r in [&l.k, &l.v] {
                        held += match r {
                            KvRegion::F32(v) => v.len() as u64 * 4,
                            KvRegion::F16(v) => v.len() as u64 * 2,
                            KvRegion::Bf16(v) => v.len() as u64 * 2,
                            KvRegion::Quant(v) => v.len() as u64,
                        };
                    }
                }
                assert_eq!(
                    held,
                    5 * layout.bytes_per_block(),
                    "{dtype} head_dim {head_dim}"
                );
                assert_eq!(s.bytes(), held);
            }
        }
    }

    #[test]
    fn quantised_tokens_decode_close_to_what_was_written_and_stay_in_their_slot() {
        for dtype in QUANT {
            let layout = KvLayout::uniform(1, 2, 64, dtype, 4).unwrap();
            let mut s = KvStorage::new(&layout, 3).unwrap();
            let k: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
            let v: Vec<f32> = k.iter().map(|x| -x * 0.5).collect();
            s.write_token(0, 1, 2, &k, &v);
            let l = s.layer(0);
            let h1 = decoded(l, l.k_head_block(1, 1));
            let tol = match dtype {
                // Values up to 3 stored rotated (max |r| up to 3 · √64 / 2): a step spread back.
                KvDtype::Int8 => 0.05,
                KvDtype::Fp8 => 0.3,
                // A 4-bit step of the rotated range, spread back over the group.
                _ => 1.0,
            };
            for (a, b) in h1[128..192].iter().zip(&k[64..]) {
                assert!((a - b).abs() <= tol, "{dtype}: {a} vs {b}");
            }
            let h0v = decoded(l, l.v_head_block(1, 0));
            for (a, b) in h0v[128..192].iter().zip(&v[..64]) {
                assert!((a - b).abs() <= tol, "{dtype}: {a} vs {b}");
            }
            // Other slots and blocks untouched.
            assert!(decoded(l, l.k_head_block(1, 1))[..128]
                .iter()
                .all(|x| *x == 0.0));
            assert!(decoded(l, l.k_head_block(0, 0)).iter().all(|x| *x == 0.0));
        }
    }

    #[test]
    fn key_offsets_are_taken_out_of_k_only_and_checked() {
        let layout = KvLayout::uniform(2, 2, 64, KvDtype::Int8, 4).unwrap();
        let mut s = KvStorage::new(&layout, 2).unwrap();
        let offsets: Vec<Vec<f32>> = (0..2)
            .map(|l| (0..128).map(|i| (l * 128 + i) as f32 * 0.1).collect())
            .collect();
        s.set_key_offsets(offsets.clone()).unwrap();
        let k: Vec<f32> = (0..128).map(|i| i as f32 * 0.1 + 1.0).collect();
        let v = k.clone();
        s.write_token(1, 1, 3, &k, &v);
        let l = s.layer(1);
        for head in 0..2 {
            let kd = decoded(l, l.k_head_block(1, head));
            let vd = decoded(l, l.v_head_block(1, head));
            for i in 0..64 {
                let (want_k, want_v) = (
                    k[head * 64 + i] - offsets[1][head * 64 + i],
                    v[head * 64 + i],
                );
                assert!(
                    (kd[192 + i] - want_k).abs() < 0.15,
                    "K {i}: {} vs {want_k}",
                    kd[192 + i]
                );
                assert!(
                    (vd[192 + i] - want_v).abs() < 0.2,
                    "V {i}: {} vs {want_v}",
                    vd[192 + i]
                );
            }
        }
        // Shapes, values and formats are checked.
        let err = |r: Result<(), StorageError>| r.unwrap_err().to_string();
        assert!(err(s.set_key_offsets(vec![vec![0.0; 128]])).contains("1 layers of offsets for 2"));
        assert!(err(s.set_key_offsets(vec![vec![0.0; 128], vec![0.0; 64]]))
            .contains("layer 1: 64 offsets"));
        assert!(
            err(s.set_key_offsets(vec![vec![0.0; 128], vec![f32::NAN; 128]]))
                .contains("not finite")
        );
        let mut plain = KvStorage::new(&layout.with_dtype(KvDtype::Bf16), 1).unwrap();
        assert!(err(plain.set_key_offsets(offsets)).contains("only quantised formats"));
    }

    #[test]
    fn rotated_formats_need_power_of_two_groups() {
        let layout = KvLayout::uniform(1, 1, 72, KvDtype::Int4, 4).unwrap();
        assert!(KvStorage::new(&layout, 1).is_ok(), "72 = 64 + 8");
        let layout = KvLayout::uniform(1, 1, 70, KvDtype::Int4, 4).unwrap();
        let err = KvStorage::new(&layout, 1).err().unwrap();
        assert!(matches!(
            err,
            StorageError::UnsupportedHeadDim { head_dim: 70, .. }
        ));
        assert!(err.to_string().contains("head_dim 70"), "{err}");
        // The plain formats take any head size.
        let layout = KvLayout::uniform(1, 1, 70, KvDtype::Bf16, 4).unwrap();
        assert!(KvStorage::new(&layout, 1).is_ok());
    }

    #[test]
    fn size_matches_layout() {
        let layout = KvLayout::uniform(3, 2, 8, KvDtype::F16, 4).unwrap();
        let s = KvStorage::new(&layout, 5).unwrap();
        assert_eq!(s.bytes(), 5 * layout.bytes_per_block());
        let elements = match &s.layer(0).k {
            KvRegion::F16(v) => v.len(),
            _ => unreachable!(),
        };
        // K and V of one layer together are that layer's share of the bytes.
        assert_eq!(2 * elements as u64 * 2, 5 * layout.layer_bytes_per_block(0));
    }

    #[test]
    fn token_lands_in_its_head_and_slot() {
        let layout = KvLayout::uniform(1, 2, 3, KvDtype::F32, 4).unwrap();
        let mut s = KvStorage::new(&layout, 2).unwrap();
        let k = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let v = [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0];
        s.write_token(0, 1, 2, &k, &v);
        let h1 = read(s.layer(0).k_head_block(1, 1));
        assert_eq!(&h1[6..9], &[4.0, 5.0, 6.0]);
        let h0v = read(s.layer(0).v_head_block(1, 0));
        assert_eq!(&h0v[6..9], &[-1.0, -2.0, -3.0]);
        assert!(read(s.layer(0).k_head_block(0, 0))
            .iter()
            .all(|x| *x == 0.0));
    }

    #[test]
    fn a_heads_vectors_over_consecutive_blocks_are_one_run() {
        let layout = KvLayout::uniform(1, 3, 4, KvDtype::Bf16, 16).unwrap();
        let s = KvStorage::new(&layout, 10).unwrap();
        let l = s.layer(0);
        for head in 0..3 {
            for block in 0..9 {
                assert_eq!(
                    l.offset(block + 1, head, 0),
                    l.offset(block, head, 15) + l.vector_units(),
                    "head {head}, block {block}"
                );
            }
        }
    }

    #[test]
    fn an_exported_block_is_heads_then_slots_then_elements_k_before_v() {
        // The tiers' byte format: unchanged by how the pool lays out its regions.
        let layout = KvLayout::uniform(2, 2, 3, KvDtype::F32, 4).unwrap();
        let mut s = KvStorage::new(&layout, 3).unwrap();
        for layer in 0..2 {
            for slot in 0..4 {
                let at = |kv: f32, h: f32| -> Vec<f32> {
                    (0..3)
                        .map(|e| {
                            kv * 1000.0
                                + layer as f32 * 100.0
                                + h * 10.0
                                + slot as f32
                                + e as f32 / 10.0
                        })
                        .collect()
                };
                let k = [at(1.0, 0.0), at(1.0, 1.0)].concat();
                let v = [at(2.0, 0.0), at(2.0, 1.0)].concat();
                s.write_token(layer, 1, slot, &k, &v);
            }
        }
        let mut out = vec![0u8; layout.bytes_per_block() as usize];
        s.export_block(1, &mut out).unwrap();
        let got: Vec<f32> = out
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let mut want = vec![];
        for layer in 0..2 {
            for kv in [1.0f32, 2.0] {
                for h in 0..2 {
                    for slot in 0..4 {
                        for e in 0..3 {
                            want.push(
                                kv * 1000.0
                                    + layer as f32 * 100.0
                                    + h as f32 * 10.0
                                    + slot as f32
                                    + e as f32 / 10.0,
                            );
                        }
                    }
                }
            }
        }
        assert_eq!(got, want);
    }

    #[test]
    fn copy_block_prefix_copies_only_the_prefix() {
        for dtype in KvDtype::ALL {
            let layout = KvLayout::uniform(2, 2, 2, dtype, 4).unwrap();
            let mut s = KvStorage::new(&layout, 3).unwrap();
            for layer in 0..2 {
                for slot in 0..4 {
                    let x = (layer * 10 + slot) as f32;
                    s.write_token(layer, 0, slot, &[x, x, -x, -x], &[x + 0.5; 4]);
                }
            }
            s.copy_block_prefix(0, 2, 3).unwrap();
            for layer in 0..2 {
                let l = s.layer(layer);
                let dst = decoded(l, l.k_head_block(2, 1));
                let src = decoded(l, l.k_head_block(0, 1));
                assert_eq!(&dst[..6], &src[..6], "{dtype} layer {layer}");
                assert_eq!(&dst[6..], &[0.0, 0.0], "slot 3 must stay untouched");
                let dv = decoded(l, l.v_head_block(2, 0));
                let want = (layer * 10 + 2) as f32 + 0.5;
                assert!(
                    (dv[4] - want).abs() <= want * 0.07,
                    "{dtype}: {} vs {want}",
                    dv[4]
                );
            }
        }
    }

    #[test]
    fn misuse_is_a_typed_error() {
        let layout = KvLayout::uniform(1, 1, 4, KvDtype::F32, 4).unwrap();
        let mut s = KvStorage::new(&layout, 2).unwrap();
        assert_eq!(
            s.copy_block_prefix(0, 2, 1),
            Err(StorageError::BlockOutOfRange {
                block: 2,
                num_blocks: 2
            })
        );
        assert_eq!(
            s.copy_block_prefix(0, 1, 5),
            Err(StorageError::TooManyTokens {
                tokens: 5,
                block_size_tokens: 4
            })
        );
        let int8 = layout.with_dtype(KvDtype::Int8);
        assert!(matches!(
            KvStorage::new(&int8, usize::MAX),
            Err(StorageError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_pool_too_large_for_the_machine_is_an_error_not_an_abort() {
        let layout = KvLayout::uniform(2, 4, 64, KvDtype::Bf16, 16).unwrap();
        // The element count overflows usize: this used to panic ("capacity overflow").
        assert_eq!(
            KvStorage::new(&layout, usize::MAX / 8).err(),
            Some(StorageError::TooLarge {
                num_blocks: usize::MAX / 8
            })
        );
        // 2^41 blocks × 32 KiB = 64 PiB: representable, never allocatable (this used to abort with
        // "memory allocation of … failed").
        let num_blocks = 1usize << 41;
        match KvStorage::new(&layout, num_blocks) {
            Err(e @ StorageError::OutOfMemory { .. }) => {
                let StorageError::OutOfMemory {
                    bytes,
                    layer,
                    region_bytes,
                    ..
                } = &e
                else {
                    unreachable!()
                };
                assert_eq!(*bytes, num_blocks as u64 * layout.bytes_per_block());
                assert_eq!((*layer, *region_bytes), (0, *bytes / 4));
                assert!(
                    e.to_string().starts_with("cannot allocate the KV cache"),
                    "{e}"
                );
                assert!(std::error::Error::source(&e).is_some());
            }
            Err(other) => panic!("expected OutOfMemory, got {other}"),
            Ok(_) => panic!("64 PiB were allocated"),
        }
    }

    #[test]
    fn a_block_exported_and_imported_elsewhere_is_the_same_block() {
        for dtype in KvDtype::ALL {
            let layout = KvLayout::uniform(3, 2, 8, dtype, 4).unwrap();
            let mut s = KvStorage::new(&layout, 4).unwrap();
            for layer in 0..3 {
                for slot in 0..4 {
                    let k: Vec<f32> = (0..16)
                        .map(|i| (layer * 100 + slot * 10 + i) as f32)
                        .collect();
                    let v: Vec<f32> = k.iter().map(|x| -x - 0.5).collect();
                    s.write_token(layer, 1, slot, &k, &v);
                }
            }
            let mut bytes = vec![0u8; layout.bytes_per_block() as usize];
            s.export_block(1, &mut bytes).unwrap();
            s.import_block(3, &bytes).unwrap();
            let mut again = vec![0u8; bytes.len()];
            s.export_block(3, &mut again).unwrap();
            assert_eq!(bytes, again, "{dtype}: the bytes come back as they left");
            for layer in 0..3 {
                for head in 0..2 {
                    let l = s.layer(layer);
                    let d = |x| decoded(l, x);
                    assert_eq!(d(l.k_head_block(1, head)), d(l.k_head_block(3, head)));
                    assert_eq!(d(l.v_head_block(1, head)), d(l.v_head_block(3, head)));
                }
            }
            // Blocks 0 and 2 untouched.
            let l = s.layer(2);
            assert!(decoded(l, l.k_head_block(2, 1)).iter().all(|&x| x == 0.0));
            assert_eq!(
                s.export_block(1, &mut bytes[1..]),
                Err(StorageError::BlockBytes {
                    expected: layout.bytes_per_block(),
                    got: bytes.len() - 1
                })
            );
            assert!(s.import_block(4, &bytes).is_err());
        }
    }
}
