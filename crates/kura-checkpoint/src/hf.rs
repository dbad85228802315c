//! HF checkpoint directories: `config.json` and `*.safetensors` (memory-mapped; one file or a sharded
//! `model.safetensors.index.json`). The tokenizer files are `kura-text`'s.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensors};

use crate::error::{ModelError, Result};
use crate::tensors::TensorSource;

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    header_len: usize,
    meta: Metadata,
}

/// All safetensors shards of a directory, by tensor name.
pub struct SafetensorsDir {
    shards: Vec<Shard>,
    index: HashMap<String, usize>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub fn read_text(path: &Path) -> Result<String> {
    kura_files::read_text(path, kura_text::MODEL_JSON_MAX_BYTES).map_err(io(path))
}

impl SafetensorsDir {
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text = read_text(&index_path)?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ModelError::Format {
                    path: index_path.clone(),
                    what: e.to_string(),
                })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::Format {
                    path: index_path.clone(),
                    what: "no 'weight_map' object".into(),
                })?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(String::from))
                .collect();
            names.sort();
            names.dedup();
            // A shard is a file of this directory: a name with a separator or `..` would read elsewhere.
            if let Some(bad) = names.iter().find(|n| {
                Path::new(n.as_str()).file_name() != Some(std::ffi::OsStr::new(n.as_str()))
            }) {
                return Err(ModelError::Format {
                    path: index_path.clone(),
                    what: format!(
                        "weight_map names '{bad}', which is not a file of the model directory"
                    ),
                });
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            let single = dir.join("model.safetensors");
            if !single.exists() {
                return Err(ModelError::Format {
                    path: dir.to_path_buf(),
                    what: "no model.safetensors or model.safetensors.index.json".into(),
                });
            }
            vec![single]
        };
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for path in files {
            // Never opened unless a regular file: opening a FIFO would block.
            kura_files::regular(&path).map_err(io(&path))?;
            let file = File::open(&path).map_err(io(&path))?;
            // SAFETY: read-only mapping of a model file that Kura never writes.
            let mmap = unsafe { Mmap::map(&file) }.map_err(io(&path))?;
            let (header_len, meta) =
                SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::Format {
                    path: path.clone(),
                    what: format!("safetensors header: {e}"),
                })?;
            for name in meta.offset_keys() {
                if let Some(first) = index.insert(name.clone(), shards.len()) {
                    let first: &Shard = &shards[first];
                    return Err(ModelError::Format {
                        path: path.clone(),
                        what: format!(
                            "tensor '{name}' is also in {}: a tensor must be in one shard",
                            first.path.display()
                        ),
                    });
                }
            }
            shards.push(Shard {
                path,
                mmap,
                header_len,
                meta,
            });
        }
        Ok(SafetensorsDir { shards, index })
    }

    /// Every tensor of `expected` (name, PyTorch-order shape) is there, of the shape given and of an
    /// element type Kura reads (F32, F16, BF16): a configuration and a checkpoint that disagree are
    /// refused before anything is allocated for them, by every executor alike.
    pub fn check(&self, expected: &[(String, Vec<usize>)]) -> Result<()> {
        for (name, shape) in expected {
            let info = self
                .index
                .get(name)
                .and_then(|&s| self.shards[s].meta.info(name))
                .ok_or_else(|| ModelError::MissingTensor { name: name.clone() })?;
            if !matches!(info.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
                return Err(ModelError::TensorType {
                    name: name.clone(),
                    dtype: format!("{:?}", info.dtype),
                });
            }
            if !crate::tensors::shape_matches(&info.shape, shape) {
                return Err(ModelError::TensorShape {
                    name: name.clone(),
                    got: info.shape.clone(),
                    expected: shape.clone(),
                });
            }
        }
        Ok(())
    }
}

impl TensorSource for SafetensorsDir {
    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn load(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let shard = &self.shards[*self
            .index
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?];
        let info = shard
            .meta
            .info(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
        // read_metadata checked that the offsets lie inside the buffer; checked sums keep it so here.
        let base = shard.header_len.checked_add(8);
        let start = base.and_then(|b| b.checked_add(info.data_offsets.0));
        let end = base.and_then(|b| b.checked_add(info.data_offsets.1));
        let bytes = start
            .zip(end)
            .and_then(|(s, e)| shard.mmap.get(s..e))
            .ok_or_else(|| ModelError::TensorBounds {
                name: name.into(),
                start: start.unwrap_or(usize::MAX) as u64,
                end: end.unwrap_or(usize::MAX) as u64,
                file_len: shard.mmap.len() as u64,
            })?;
        let data: Vec<f32> = match info.dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(ModelError::TensorType {
                    name: format!("{name} in {}", shard.path.display()),
                    dtype: format!("{other:?}"),
                })
            }
        };
        Ok((info.shape.clone(), data))
    }
}
