//! Start-up steps shared by the subcommands that run the model (`generate`, `serve`, `sim --calibrate`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use kura_model::{LoadOptions, Model, WeightsDtype};

/// Sizes the forward pass's thread pool when `--threads` is given.
pub fn threads(threads: Option<usize>) -> Result<()> {
    if let Some(n) = threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        kura_model::set_threads(n)
            .map_err(anyhow::Error::msg)
            .context("setting up the thread pool")?;
    }
    Ok(())
}

/// `--model`, or the default model's path; an error that says how to get it when it is not there.
pub fn model_path(model: Option<&PathBuf>) -> Result<PathBuf> {
    let path = model
        .cloned()
        .unwrap_or_else(kura_model::default_model_path);
    if !path.exists() {
        bail!(
            "model {} does not exist; run scripts/fetch-model.sh for the default model or pass --model",
            path.display()
        );
    }
    Ok(path)
}

/// Loads the model at `path` with its weights kept in `weights_dtype`; the error names the file.
pub fn load_model(path: &Path, weights_dtype: WeightsDtype) -> Result<Model> {
    Model::load_with(path, LoadOptions { weights_dtype })
        .with_context(|| format!("loading the model {}", path.display()))
}
