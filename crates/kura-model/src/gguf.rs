//! GGUF reader (versions 2 and 3): metadata, tensor directory, and tensors dequantized to f32.
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

use crate::error::{ModelError, Result};
use crate::quant::{self, GgmlType};

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
    pub n_bytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }
}

/// An open GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    mmap: Mmap,
}

struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, what: impl Into<String>) -> ModelError {
        ModelError::GgufMalformed {
            path: self.path.to_path_buf(),
            offset: self.pos as u64,
            what: what.into(),
        }
    }

    fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|e| *e <= self.data.len());
        match end {
            Some(end) => {
                let s = &self.data[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(self.err(format!("file ends inside {what} ({n} bytes needed)"))),
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

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > self.data.len() as u64 {
            return Err(self.err(format!("{what}: string length {len} exceeds the file")));
        }
        let b = self.bytes(len as usize, what)?;
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
                let n = self.u64(key)?;
                // Every element takes at least one byte: a count beyond the file is malformed.
                if n > (self.data.len() - self.pos) as u64 {
                    return Err(self.err(format!(
                        "key '{key}': array of {n} elements exceeds the file"
                    )));
                }
                let mut out = Vec::with_capacity(n as usize);
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

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only and Kura never writes model files; a concurrent truncation by
        // another process is outside what any mmap-based loader can defend against.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let mut c = Cursor {
            data: &mmap,
            pos: 0,
            path,
        };
        let magic = c.u32("magic")?;
        if magic != 0x4655_4747 {
            return Err(ModelError::NotGguf {
                path: path.to_path_buf(),
                magic,
            });
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(ModelError::GgufVersion {
                path: path.to_path_buf(),
                version,
            });
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        let mut metadata = HashMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key #{i}"))?;
            let ty = c.u32(&key)?;
            let v = c.value(ty, &key, 0)?;
            metadata.insert(key, v);
        }
        let mut infos = Vec::new();
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor name #{i}"))?;
            let n_dims = c.u32(&name)? as usize;
            if n_dims == 0 || n_dims > 4 {
                return Err(c.err(format!(
                    "tensor '{name}': {n_dims} dimensions (1..=4 allowed)"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                let d = c.u64(&name)?;
                if d > u32::MAX as u64 {
                    return Err(c.err(format!("tensor '{name}': dimension {d} too large")));
                }
                dims.push(d as usize);
            }
            let ty = c.u32(&name)?;
            let offset = c.u64(&name)?;
            infos.push((name, dims, ty, offset));
        }
        let alignment = match metadata.get("general.alignment") {
            Some(v) => v
                .as_u64()
                .filter(|a| *a > 0 && a.is_power_of_two())
                .ok_or_else(|| ModelError::KeyType {
                    key: "general.alignment".into(),
                    expected: "a power of two",
                })?,
            None => 32,
        };
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let file_len = mmap.len() as u64;
        let mut tensors = HashMap::new();
        for (name, dims, ty, offset) in infos {
            let n: usize = dims.iter().product();
            let dtype = GgmlType::from_id(ty);
            let n_bytes = match dtype.byte_size(n) {
                Some(b) => b as u64,
                None => {
                    // Unsupported types are kept in the directory so that the error names the tensor only
                    // if the model actually needs it.
                    0
                }
            };
            let start = data_start + offset;
            let end = start + n_bytes;
            if end > file_len {
                return Err(ModelError::TensorBounds {
                    name,
                    start,
                    end,
                    file_len,
                });
            }
            tensors.insert(
                name.clone(),
                TensorInfo {
                    name,
                    dims,
                    dtype,
                    offset: start,
                    n_bytes,
                },
            );
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            mmap,
        })
    }

    pub fn get(&self, key: &str) -> Result<&Value> {
        self.metadata
            .get(key)
            .ok_or_else(|| ModelError::MissingKey {
                key: key.to_string(),
            })
    }

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get(key)?.as_u64().ok_or_else(|| ModelError::KeyType {
            key: key.into(),
            expected: "an unsigned integer",
        })
    }

    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.get(key)?.as_f64().ok_or_else(|| ModelError::KeyType {
            key: key.into(),
            expected: "a number",
        })
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.get(key)? {
            Value::String(s) => Ok(s),
            _ => Err(ModelError::KeyType {
                key: key.into(),
                expected: "a string",
            }),
        }
    }

    pub fn get_array(&self, key: &str) -> Result<&[Value]> {
        match self.get(key)? {
            Value::Array(a) => Ok(a),
            _ => Err(ModelError::KeyType {
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
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
            })
    }

    /// The tensor dequantized to f32, in its stored order (innermost dimension contiguous).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.tensor_info(name)?;
        let n = info.n_elements();
        if info.dtype.byte_size(n).is_none() {
            return Err(ModelError::TensorType {
                name: name.into(),
                dtype: info.dtype.name(),
            });
        }
        let bytes = &self.mmap[info.offset as usize..(info.offset + info.n_bytes) as usize];
        let mut out = vec![0f32; n];
        quant::dequantize(info.dtype, bytes, &mut out).map_err(|what| ModelError::Format {
            path: self.path.clone(),
            what: format!("tensor '{name}': {what}"),
        })?;
        Ok(out)
    }
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
        assert_eq!(g.tensor_f32("w").unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        assert!(
            matches!(g.tensor_f32("nope"), Err(ModelError::MissingTensor { name }) if name == "nope")
        );
        assert!(matches!(
            g.get_str("llama.block_count"),
            Err(ModelError::KeyType { .. })
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
            Err(ModelError::GgufVersion { version: 9, .. })
        ));
        b[0] = b'X';
        std::fs::write(&p, &b).unwrap();
        assert!(matches!(
            GgufFile::open(&p),
            Err(ModelError::NotGguf { .. })
        ));
        std::fs::remove_file(p).ok();
    }
}
