//! Start-up steps shared by the subcommands that run the model (`generate`, `serve`).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

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
