//! `kura-gguf` — the GGUF reader (versions 2 and 3): metadata, the tensor directory and each tensor's
//! bytes as stored, with the ggml element types' block sizes ([`GgmlType`]). Dequantizing is the model
//! runtime's (`kura-model`); the text layer (`kura-text`) reads the tokenizer from the metadata alone.
//!
//! The file is memory-mapped; parsing walks the header once (O(keys + tensors)) with every read bounds
//! checked, so a truncated or malformed file is an error naming the byte offset, key or tensor, never a
//! panic. Layout of the file (all integers little-endian):
//!
//! ```text
//! "GGUF" | version u32 | n_tensors u64 | n_kv u64
//! n_kv × (key string, value type u32, value)
//! n_tensors × (name string, n_dims u32, dims u64 × n_dims (innermost first), ggml type u32, offset u64)
//! padding to `general.alignment` (default 32) | tensor data (offsets relative to here)
//! ```

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

mod error;
mod ggml;

pub use error::{GgufError, Result};
pub use ggml::{GgmlType, Q2K_BYTES, Q3K_BYTES, Q4K_BYTES, Q5K_BYTES, Q6K_BYTES, QK, QK_K};

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        Some(match *self {
            Value::U8(v) => v as u64,
            Value::U16(v) => v as u64,
            Value::U32(v) => v as u64,
            Value::U64(v) => v,
            Value::I8(v) if v >= 0 => v as u64,
            Value::I16(v) if v >= 0 => v as u64,
            Value::I32(v) if v >= 0 => v as u64,
            Value::I64(v) if v >= 0 => v as u64,
            _ => return None,
        })
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
}

/// Where a tensor is and what it holds.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions innermost first, as GGUF stores them (a PyTorch `[out, in]` weight is `[in, out]`).
    pub dims: Vec<usize>,
    pub dtype: GgmlType,
    /// Absolute byte offset in the file.
    pub offset: u64,
    /// Bytes of the data; 0 for an element type Kura cannot read (its size is unknown).
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Elements of the tensor (the reader checked that the product fits).
    pub fn n_elements(&self) -> usize {
        self.dims
            .iter()
            .try_fold(1usize, |n, d| n.checked_mul(*d))
            .unwrap_or(usize::MAX)
    }
}

/// The bytes of a GGUF: a read-only mapping of a file, or a buffer given by the caller.
enum Data {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Data {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Data::Mapped(m) => m,
            Data::Owned(v) => v,
        }
    }
}

/// An open GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    /// `general.alignment` (32 when absent): every tensor offset is a multiple of it.
    pub alignment: u64,
    /// Where tensor data begins: the end of the directory rounded up to the alignment.
    pub data_start: u64,
    data: Data,
}

/// Fewest bytes a metadata value of GGUF type `ty` takes (strings: their length; arrays: element type and
/// count); `None` for an unknown type. A declared count times this must fit in the bytes left.
fn min_value_bytes(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
}

/// Fewest bytes of one tensor-directory entry: empty name (8), n_dims (4), one dim (8), type (4), offset (8).
const MIN_TENSOR_INFO_BYTES: usize = 32;
/// Fewest bytes of one metadata entry: empty key (8), type (4), a one-byte value.
const MIN_KV_BYTES: usize = 13;
/// GGML_MAX_DIMS.
const MAX_DIMS: usize = 4;

struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
    path: &'a Path,
    /// Metadata array elements still allowed ([`MAX_ARRAY_ELEMENTS`] in all).
    elements_left: usize,
}

/// The most metadata array elements one file may hold, all arrays together: a vocabulary of 262,144
/// tokens with its scores, types and merges is about 1.3 million. Each element takes 32 bytes in
/// memory where the file may spend 8 on it (an empty string), so this bounds what the metadata costs.
pub const MAX_ARRAY_ELEMENTS: usize = 1 << 24;

/// Metadata entries a file may declare (real models have a few dozen; arrays count as one).
pub const MAX_METADATA_ENTRIES: usize = 1 << 16;

/// Tensors a file may declare (real models have hundreds to tens of thousands, one a weight).
pub const MAX_TENSORS: usize = 1 << 20;

impl<'a> Cursor<'a> {
    fn err(&self, what: impl Into<String>) -> GgufError {
        GgufError::GgufMalformed {
            path: self.path.to_path_buf(),
            offset: self.pos as u64,
            what: what.into(),
        }
    }

    fn remaining(&self) -> usize {
        self.data.len().saturating_sub(self.pos)
    }

    fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        match self
            .pos
            .checked_add(n)
            .and_then(|end| self.data.get(self.pos..end))
        {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => Err(self.err(format!(
                "file ends inside {what} ({n} bytes needed, {} left)",
                self.remaining()
            ))),
        }
    }

    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let b = self.bytes(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    /// A declared count of items of at least `each` bytes: an error when the rest of the file cannot hold
    /// that many, so that the count can size an allocation.
    fn count(&self, n: u64, each: usize, what: &str) -> Result<usize> {
        let room = self.remaining() / each.max(1);
        match usize::try_from(n) {
            Ok(n) if n <= room => Ok(n),
            _ => Err(self.err(format!(
                "{what}: {n} declared, but the {} bytes left hold at most {room}",
                self.remaining()
            ))),
        }
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let len = self.count(len, 1, &format!("{what}: string length"))?;
        let b = self.bytes(len, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err(format!("{what}: string is not UTF-8")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.arr::<1>(key)?[0]),
            1 => Value::I8(self.arr::<1>(key)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.arr(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.arr(key)?)),
            4 => Value::U32(self.u32(key)?),
            5 => Value::I32(i32::from_le_bytes(self.arr(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.arr(key)?)),
            7 => Value::Bool(self.arr::<1>(key)?[0] != 0),
            8 => Value::String(self.string(key)?),
            9 => {
                if depth > 2 {
                    return Err(self.err(format!("key '{key}': arrays nested too deeply")));
                }
                let elem_ty = self.u32(key)?;
                let Some(each) = min_value_bytes(elem_ty) else {
                    return Err(
                        self.err(format!("key '{key}': unknown array element type {elem_ty}"))
                    );
                };
                let n = self.u64(key)?;
                let n = self.count(n, each, &format!("key '{key}': array elements"))?;
                self.elements_left = self.elements_left.checked_sub(n).ok_or_else(|| {
                    self.err(format!(
                        "key '{key}': an array of {n} elements; the metadata's arrays may hold \
                         {MAX_ARRAY_ELEMENTS} elements in all"
                    ))
                })?;
                let mut out = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    out.push(self.value(elem_ty, key, depth + 1)?);
                }
                Value::Array(out)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(i64::from_le_bytes(self.arr(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.arr(key)?)),
            other => return Err(self.err(format!("key '{key}': unknown value type {other}"))),
        })
    }
}

/// One entry of the tensor directory as read, before its data is placed.
struct RawTensor {
    name: String,
    dims: Vec<usize>,
    ty: u32,
    offset: u64,
    /// Where the entry starts in the file, for errors.
    at: u64,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        // Never opened unless a regular file: opening a FIFO would block, and a device is no model.
        kura_files::regular(path).map_err(io)?;
        let file = File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only and Kura never writes model files; a concurrent truncation by
        // another process is outside what any mmap-based loader can defend against.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(path.to_path_buf(), Data::Mapped(mmap))
    }

    /// A GGUF from a buffer; `path` only names it in errors.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self> {
        Self::parse(path.into(), Data::Owned(bytes))
    }

    fn parse(path: PathBuf, data: Data) -> Result<Self> {
        let mut c = Cursor {
            data: &data,
            pos: 0,
            path: &path,
            elements_left: MAX_ARRAY_ELEMENTS,
        };
        let not_gguf = |what: String| GgufError::NotGguf {
            path: path.clone(),
            what,
        };
        match data.get(..4) {
            None => {
                return Err(not_gguf(format!(
                    "the file is {} bytes, too short for the 4-byte magic 'GGUF'",
                    data.len()
                )))
            }
            Some(m) if m != b"GGUF" => {
                return Err(not_gguf(format!(
                    "it starts with bytes {:02x} {:02x} {:02x} {:02x}, not the magic 'GGUF'",
                    m[0], m[1], m[2], m[3]
                )))
            }
            Some(_) => c.pos = 4,
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::GgufVersion { path, version });
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        let n_kv = c.count(n_kv, MIN_KV_BYTES, "metadata entries")?;
        if n_kv > MAX_METADATA_ENTRIES {
            return Err(c.err(format!(
                "metadata entries: {n_kv} declared; at most {MAX_METADATA_ENTRIES} are read"
            )));
        }
        // Reserved as read: a count the file's size allows may still be far more than it holds.
        let mut metadata = HashMap::with_capacity(n_kv.min(1 << 8));
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key #{i}"))?;
            let ty = c.u32(&key)?;
            let v = c.value(ty, &key, 0)?;
            if metadata.insert(key.clone(), v).is_some() {
                return Err(c.err(format!("metadata key '{key}' appears twice")));
            }
        }
        let n_tensors = c.count(n_tensors, MIN_TENSOR_INFO_BYTES, "tensor entries")?;
        if n_tensors > MAX_TENSORS {
            return Err(c.err(format!(
                "tensor entries: {n_tensors} declared; at most {MAX_TENSORS} are read"
            )));
        }
        let mut raw = Vec::with_capacity(n_tensors.min(1 << 12));
        for i in 0..n_tensors {
            let at = c.pos as u64;
            let name = c.string(&format!("tensor name #{i}"))?;
            let n_dims = c.u32(&name)?;
            if n_dims == 0 || n_dims as usize > MAX_DIMS {
                return Err(c.err(format!(
                    "tensor '{name}': {n_dims} dimensions (1..={MAX_DIMS} allowed)"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                let d = c.u64(&name)?;
                match usize::try_from(d) {
                    Ok(d) if d > 0 => dims.push(d),
                    _ => {
                        return Err(c.err(format!(
                            "tensor '{name}': dimension {d} (must be 1..={})",
                            usize::MAX
                        )))
                    }
                }
            }
            let ty = c.u32(&name)?;
            let offset = c.u64(&name)?;
            raw.push(RawTensor {
                name,
                dims,
                ty,
                offset,
                at,
            });
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => {
                    return Err(GgufError::BadValue {
                        key: "general.alignment".into(),
                        what: format!(
                            "is {}; it must be a power of two (1, 2, 4, …, 32, …)",
                            v.as_u64()
                                .map_or_else(|| format!("{v:?}"), |a| a.to_string())
                        ),
                    })
                }
            },
        };
        let directory_end = c.pos as u64;
        let data_start = directory_end
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| GgufError::BadValue {
                key: "general.alignment".into(),
                what: format!("{alignment} puts the tensor data beyond 2^64 bytes"),
            })?;
        let tensors = place_tensors(&path, raw, data_start, alignment, data.len() as u64)?;
        Ok(GgufFile {
            path,
            version,
            metadata,
            tensors,
            alignment,
            data_start,
            data,
        })
    }

    pub fn get(&self, key: &str) -> Result<&Value> {
        self.metadata.get(key).ok_or_else(|| GgufError::MissingKey {
            key: key.to_string(),
        })
    }

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get(key)?.as_u64().ok_or_else(|| GgufError::KeyType {
            key: key.into(),
            expected: "an unsigned integer",
        })
    }

    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.get(key)?.as_f64().ok_or_else(|| GgufError::KeyType {
            key: key.into(),
            expected: "a number",
        })
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.get(key)? {
            Value::String(s) => Ok(s),
            _ => Err(GgufError::KeyType {
                key: key.into(),
                expected: "a string",
            }),
        }
    }

    pub fn get_array(&self, key: &str) -> Result<&[Value]> {
        match self.get(key)? {
            Value::Array(a) => Ok(a),
            _ => Err(GgufError::KeyType {
                key: key.into(),
                expected: "an array",
            }),
        }
    }

    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        if self.metadata.contains_key(key) {
            self.get_u64(key).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        if self.metadata.contains_key(key) {
            self.get_f64(key).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor {
                name: name.to_string(),
            })
    }

    /// The tensor's entry and its bytes as stored, checked to be whole blocks of a type Kura reads and to
    /// lie inside the file.
    pub fn tensor_bytes(&self, name: &str) -> Result<(&TensorInfo, &[u8])> {
        let info = self.tensor_info(name)?;
        let n = info.n_elements();
        if info
            .dtype
            .byte_size(n)
            .is_none_or(|b| b as u64 != info.n_bytes)
        {
            return Err(GgufError::TensorType {
                name: name.into(),
                dtype: info.dtype.name(),
            });
        }
        // The reader placed every tensor inside the file; `get` keeps a hand-made TensorInfo panic-free.
        let bytes = usize::try_from(info.offset)
            .ok()
            .zip(usize::try_from(info.n_bytes).ok())
            .and_then(|(start, len)| self.data.get(start..start.checked_add(len)?))
            .ok_or_else(|| GgufError::TensorBounds {
                name: name.into(),
                start: info.offset,
                end: info.offset.saturating_add(info.n_bytes),
                file_len: self.data.len() as u64,
            })?;
        Ok((info, bytes))
    }
}

/// Places each directory entry in the file: its element count and byte size (checked products), the
/// offset a multiple of `alignment`, the data inside the file and overlapping no other tensor, each name
/// once. Tensors of a type Kura cannot read keep a size of 0 so that only a model that needs them fails.
///
/// The data is laid out as ggml writes and reads it: in directory order, each tensor where the one
/// before it ends (padded to the alignment). A tensor whose type or shape was changed so that its size
/// changed no longer fits that layout, and is refused rather than read under the wrong format (a change
/// between types of the same size, F16 and BF16, is not seen). After a tensor of a type Kura cannot
/// size, the next one is only required not to start before it.
fn place_tensors(
    path: &Path,
    raw: Vec<RawTensor>,
    data_start: u64,
    alignment: u64,
    file_len: u64,
) -> Result<HashMap<String, TensorInfo>> {
    let bad = |at: u64, what: String| GgufError::GgufMalformed {
        path: path.to_path_buf(),
        offset: at,
        what,
    };
    let mut tensors: HashMap<String, TensorInfo> = HashMap::with_capacity(raw.len());
    // Directory order: each tensor's offset (relative to the data start) and its size where known.
    let mut order: Vec<(String, u64, Option<u64>)> = Vec::with_capacity(raw.len());
    for t in raw {
        let name = &t.name;
        let n = t
            .dims
            .iter()
            .try_fold(1usize, |n, d| n.checked_mul(*d))
            .ok_or_else(|| {
                bad(
                    t.at,
                    format!(
                        "tensor '{name}': dimensions {:?} overflow an element count",
                        t.dims
                    ),
                )
            })?;
        let dtype = GgmlType::from_id(t.ty);
        let n_bytes = match dtype.block() {
            None => 0,
            Some((elems, _)) => {
                // ggml stores whole blocks per row: the innermost dimension is a whole number of them.
                if !t.dims[0].is_multiple_of(elems) {
                    return Err(bad(
                        t.at,
                        format!(
                            "tensor '{name}': innermost dimension {} is not a whole number of {elems}-element {} blocks",
                            t.dims[0],
                            dtype.name()
                        ),
                    ));
                }
                dtype
                    .byte_size(n)
                    .and_then(|b| u64::try_from(b).ok())
                    .ok_or_else(|| {
                        bad(
                            t.at,
                            format!(
                                "tensor '{name}': {n} {} elements overflow a byte size",
                                dtype.name()
                            ),
                        )
                    })?
            }
        };
        if !t.offset.is_multiple_of(alignment) {
            return Err(bad(
                t.at,
                format!(
                    "tensor '{name}': offset {} is not a multiple of the alignment {alignment}",
                    t.offset
                ),
            ));
        }
        let Some(start) = data_start.checked_add(t.offset) else {
            return Err(bad(
                t.at,
                format!(
                    "tensor '{name}': offset {} past the data start {data_start} overflows 64 bits, outside the file",
                    t.offset
                ),
            ));
        };
        match start.checked_add(n_bytes) {
            Some(end) if end <= file_len => {
                let info = TensorInfo {
                    name: t.name.clone(),
                    dims: t.dims,
                    dtype,
                    offset: start,
                    n_bytes,
                };
                if tensors.insert(t.name.clone(), info).is_some() {
                    return Err(bad(t.at, format!("tensor '{name}' appears twice")));
                }
                order.push((t.name.clone(), t.offset, dtype.block().map(|_| n_bytes)));
            }
            end => {
                return Err(GgufError::TensorBounds {
                    name: t.name,
                    start,
                    end: end.unwrap_or(u64::MAX),
                    file_len,
                })
            }
        }
    }
    // Overlap: sorted by start, each tensor must begin at or after the end of the one before.
    let mut spans: Vec<&TensorInfo> = tensors.values().filter(|t| t.n_bytes > 0).collect();
    spans.sort_by_key(|t| (t.offset, t.n_bytes));
    for w in spans.windows(2) {
        let (a, b) = (w[0], w[1]);
        if b.offset < a.offset + a.n_bytes {
            return Err(GgufError::Format {
                path: path.to_path_buf(),
                what: format!(
                    "tensor '{}' (bytes {}..{}) overlaps tensor '{}' (bytes {}..{})",
                    b.name,
                    b.offset,
                    b.offset + b.n_bytes,
                    a.name,
                    a.offset,
                    a.offset + a.n_bytes
                ),
            });
        }
    }
    // The layout: in directory order, each tensor where the one before it ends, padded.
    let mut next = (0u64, true, "");
    for (name, offset, n_bytes) in &order {
        let (at, exact, before) = next;
        if (exact && *offset != at) || (!exact && *offset < at) {
            let info = &tensors[name];
            let what = if before.is_empty() {
                "the data starts at 0".to_string()
            } else {
                let b = &tensors[before];
                let ends = if exact { "ends" } else { "starts" };
                format!(
                    "tensor '{before}' before it in the directory ({}, {:?}) {ends} at {at}",
                    b.dtype.name(),
                    b.dims
                )
            };
            return Err(GgufError::Format {
                path: path.to_path_buf(),
                what: format!(
                    "tensor '{name}' ({}, {:?}) has its data at offset {offset}, where {what}: a \
                     tensor's type or shape does not match its data",
                    info.dtype.name(),
                    info.dims
                ),
            });
        }
        // The sizes lie inside the file, so only the padding can overflow.
        next = match n_bytes.and_then(|n| n.checked_next_multiple_of(alignment)) {
            Some(padded) => (offset.saturating_add(padded), true, name),
            None => (*offset, false, name),
        };
    }
    Ok(tensors)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    /// A minimal GGUF with one u32 key and one 2×2 f32 tensor.
    fn tiny_gguf() -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        write_string(&mut b, "llama.block_count");
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&7u32.to_le_bytes());
        write_string(&mut b, "w");
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        for x in [1.0f32, 2.0, 3.0, 4.0] {
            b.extend_from_slice(&x.to_le_bytes());
        }
        b
    }

    fn write_tmp(name: &str, bytes: &[u8]) -> PathBuf {
        let p = std::env::temp_dir().join(format!("kura-gguf-{}-{name}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn reads_metadata_and_tensor() {
        let p = write_tmp("ok.gguf", &tiny_gguf());
        let g = GgufFile::open(&p).unwrap();
        assert_eq!(g.get_u64("llama.block_count").unwrap(), 7);
        let (info, bytes) = g.tensor_bytes("w").unwrap();
        assert_eq!(
            (info.dims.as_slice(), info.dtype),
            ([2, 2].as_slice(), GgmlType::F32)
        );
        let floats: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(floats, vec![1.0, 2.0, 3.0, 4.0]);
        assert!(
            matches!(g.tensor_bytes("nope"), Err(GgufError::MissingTensor { name }) if name == "nope")
        );
        assert!(matches!(
            g.get_str("llama.block_count"),
            Err(GgufError::KeyType { .. })
        ));
        std::fs::remove_file(p).ok();
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let full = tiny_gguf();
        for len in 0..full.len() {
            let p = write_tmp(&format!("trunc{len}.gguf"), &full[..len]);
            assert!(GgufFile::open(&p).is_err(), "truncated at {len} must fail");
            std::fs::remove_file(p).ok();
        }
    }

    #[test]
    fn wrong_magic_and_version_are_named() {
        let mut b = tiny_gguf();
        b[4] = 9;
        let p = write_tmp("v9.gguf", &b);
        assert!(matches!(
            GgufFile::open(&p),
            Err(GgufError::GgufVersion { version: 9, .. })
        ));
        b[0] = b'X';
        std::fs::write(&p, &b).unwrap();
        assert!(matches!(GgufFile::open(&p), Err(GgufError::NotGguf { .. })));
        std::fs::remove_file(p).ok();
    }
    /// A GGUF whose only key is an array of `n` u8 values, and no tensor.
    fn gguf_with_array(n: u64) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        write_string(&mut b, "general.many");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&n.to_le_bytes());
        b.resize(b.len() + n as usize, 7);
        b
    }

    #[test]
    fn metadata_arrays_are_bounded_in_all() {
        let at = MAX_ARRAY_ELEMENTS as u64;
        assert!(GgufFile::from_bytes("ok", gguf_with_array(at)).is_ok());
        match GgufFile::from_bytes("big", gguf_with_array(at + 1)) {
            Err(GgufError::GgufMalformed { what, .. }) => {
                assert!(what.contains("may hold 16777216 elements in all"), "{what}")
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
    }

    #[test]
    fn a_path_that_is_not_a_regular_file_is_refused_without_opening_it() {
        let dir = std::env::temp_dir();
        match GgufFile::open(&dir) {
            Err(GgufError::Io { source, .. }) => {
                assert!(
                    source.to_string().contains("not a regular file"),
                    "{source}"
                )
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
    }
}
