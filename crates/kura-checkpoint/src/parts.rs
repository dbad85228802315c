//! A checkpoint opened without loading its weights ([`ModelParts`]): its configuration, its text side,
//! where its tensors are and how they are named. Each executor loads the weights from here in its own
//! format.

use std::path::Path;

use kura_text::{ModelText, CHATML, GEMMA3};

use crate::config::{Arch, ModelConfig};
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::hf::{read_text, SafetensorsDir};
use crate::tensors::{Naming, RawTensor, TensorSource};

/// A GGUF tensor's shape in PyTorch's order (outermost first; GGUF stores innermost first).
fn torch_shape(g: &GgufFile, name: &str) -> Result<Vec<usize>> {
    Ok(g.tensor_info(name)?.dims.iter().rev().copied().collect())
}

impl TensorSource for GgufFile {
    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn load(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        Ok((
            torch_shape(self, name)?,
            crate::gguf::tensor_f32(self, name)?,
        ))
    }

    fn raw(&self, name: &str) -> Result<Option<RawTensor<'_>>> {
        let (info, bytes) = self.tensor_bytes(name)?;
        Ok(Some(RawTensor {
            shape: torch_shape(self, name)?,
            dtype: info.dtype,
            bytes,
        }))
    }
}

/// A model file opened without loading its weights: its configuration, its text side, where its
/// tensors are and how they are named.
pub struct ModelParts {
    pub config: ModelConfig,
    pub text: ModelText,
    pub source: Box<dyn TensorSource>,
    pub naming: Naming,
}

impl ModelParts {
    /// Opens a GGUF file or an HF directory.
    pub fn open(path: &Path) -> Result<Self> {
        if path.is_dir() {
            let config = ModelConfig::from_hf_json(&read_text(&path.join("config.json"))?)?;
            let text =
                ModelText::from_hf_dir(path, default_template(config.arch), config.vocab_size())?;
            let naming = Naming::hf(config.arch);
            let source = SafetensorsDir::open(path)?;
            source.check(&crate::tensors::expected_shapes(naming, &config))?;
            Ok(ModelParts {
                source: Box::new(source),
                config,
                text,
                naming,
            })
        } else {
            let g = GgufFile::open(path)?;
            let config = ModelConfig::from_gguf(&g)?;
            let text =
                ModelText::from_gguf(&g, default_template(config.arch), config.vocab_size())?;
            Ok(ModelParts {
                source: Box::new(g),
                config,
                text,
                naming: Naming::Gguf,
            })
        }
    }
}

/// The chat template of an architecture whose file has none.
pub fn default_template(arch: Arch) -> &'static str {
    match arch {
        Arch::Gemma3 => GEMMA3,
        _ => CHATML,
    }
}
