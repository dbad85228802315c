//! Start-up steps shared by the subcommands that run the model (`generate`, `serve`, `sim --calibrate`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use kura_model::{LoadOptions, Model, WeightsDtype};

/// The most compute threads `--threads` may ask for: each is a thread of the process, and far more
/// than the cores only queue behind each other.
pub const MAX_THREADS: usize = 1024;

/// Sizes the forward pass's thread pool: `--threads`, or [`default_threads`]; says which in the log.
pub fn threads(threads: Option<usize>) -> Result<()> {
    let n = match threads {
        Some(0) => bail!("--threads must be at least 1"),
        Some(n) if n > MAX_THREADS => bail!(
            "--threads {n}: at most {MAX_THREADS} (this machine has {} usable CPUs)",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        ),
        Some(n) => {
            tracing::info!(threads = n, "compute threads: {n} (--threads)");
            n
        }
        None => {
            let (n, why) = default_threads();
            tracing::info!(
                threads = n,
                "compute threads: {n} ({why}; --threads overrides)"
            );
            n
        }
    };
    kura_model::set_threads(n)
        .map_err(anyhow::Error::msg)
        .context("setting up the thread pool")
}

/// The thread count when `--threads` is not given, and why: one worker per physical core that this
/// process may use. `available_parallelism` counts the CPUs of the affinity mask (`taskset`, cpusets)
/// and the cgroup's CPU quota (containers); the second hardware thread of a core shares its vector
/// units and its path to memory, so a worker there adds a thread every barrier waits for and little
/// arithmetic: llama.cpp's default is the physical cores too.
pub fn default_threads() -> (usize, String) {
    let usable = std::thread::available_parallelism().map_or(1, |n| n.get());
    match physical_cores() {
        Some(cores) if cores < usable => (
            cores,
            format!("{usable} usable CPUs on {cores} physical cores: one worker per core"),
        ),
        Some(cores) => (
            usable,
            format!("{usable} usable CPUs, {cores} physical cores among the allowed ones"),
        ),
        None => (
            usable,
            format!("{usable} usable CPUs; the core topology could not be read"),
        ),
    }
}

/// The physical cores (distinct package and core ids) among the CPUs this process may run on, from
/// `/proc/self/status` and sysfs (Linux); `None` where they cannot be read.
fn physical_cores() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    let mut cores = std::collections::BTreeSet::new();
    for cpu in parse_cpu_list(list.trim())? {
        let topo = format!("/sys/devices/system/cpu/cpu{cpu}/topology");
        let read = |f: &str| std::fs::read_to_string(format!("{topo}/{f}")).ok();
        let package = read("physical_package_id")?;
        let core = read("core_id")?;
        cores.insert((package.trim().to_owned(), core.trim().to_owned()));
    }
    (!cores.is_empty()).then_some(cores.len())
}

/// The CPUs of a list such as `0-3,8,10-11`; `None` for anything else.
fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        let (lo, hi): (usize, usize) = match part.split_once('-') {
            Some((a, b)) => (a.parse().ok()?, b.parse().ok()?),
            None => {
                let c = part.parse().ok()?;
                (c, c)
            }
        };
        // A mask lists at most a few thousand CPUs; anything longer is not one.
        if hi < lo || hi - lo > 65_536 {
            return None;
        }
        cpus.extend(lo..=hi);
    }
    Some(cpus)
}

/// `--block-size`: tokens per KV block, 1..=[`kura_kv::MAX_BLOCK_SIZE`], checked as the flags are
/// parsed (a 0 would otherwise reach a division before any layout check).
pub fn block_size_arg(s: &str) -> std::result::Result<usize, String> {
    let max = kura_kv::MAX_BLOCK_SIZE;
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!("`{s}`: a block holds 1 to {max} tokens")),
    }
}

/// A count of sequences or tokens a step may hold (`--max-num-seqs`, `--max-num-batched-tokens`): 1
/// to 2^32, checked as the flags are parsed rather than after the model has loaded.
pub fn step_count_arg(s: &str) -> std::result::Result<usize, String> {
    const MAX: usize = 1 << 32;
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=MAX).contains(&n) => Ok(n),
        _ => Err(format!("`{s}`: give a whole number from 1 to {MAX}")),
    }
}

/// The most bytes read from a `--chat-template` file (the largest templates models ship are tens of
/// KB).
pub const CHAT_TEMPLATE_MAX_BYTES: u64 = 1 << 20;

/// `codec` writing chats with the template in `file` (`--chat-template`) when one is given: an error
/// naming the file when it cannot be read or does not compile.
pub fn with_chat_template(
    codec: kura_text::ModelCodec,
    file: Option<&PathBuf>,
) -> Result<kura_text::ModelCodec> {
    let Some(file) = file else {
        return Ok(codec);
    };
    let source = kura_files::read_text(file, CHAT_TEMPLATE_MAX_BYTES)
        .with_context(|| format!("--chat-template {}", file.display()))?;
    codec
        .with_chat_template(&source)
        .with_context(|| format!("--chat-template {}", file.display()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_and_step_counts_are_checked_as_flags_are_read() {
        assert_eq!(block_size_arg("16"), Ok(16));
        assert_eq!(block_size_arg("1024"), Ok(1024));
        for bad in ["0", "1025", "-1", "", "lots", "18446744073709551616"] {
            let e = block_size_arg(bad).unwrap_err();
            assert!(e.contains("a block holds 1 to 1024 tokens"), "{bad}: {e}");
        }
        assert_eq!(step_count_arg("64"), Ok(64));
        assert_eq!(step_count_arg("4294967296"), Ok(1 << 32));
        for bad in ["0", "4294967297", "18446744073709551615", "x"] {
            let e = step_count_arg(bad).unwrap_err();
            assert!(e.contains("from 1 to 4294967296"), "{bad}: {e}");
        }
    }

    #[test]
    fn cpu_lists_parse_as_the_kernel_writes_them() {
        assert_eq!(parse_cpu_list("0"), Some(vec![0]));
        assert_eq!(
            parse_cpu_list("0-3,8,10-11"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("a-b"), None);
        assert_eq!(parse_cpu_list("0-99999999"), None);
    }

    #[test]
    fn the_default_is_at_least_one_and_at_most_the_usable_cpus() {
        let usable = std::thread::available_parallelism().map_or(1, |n| n.get());
        let (n, why) = default_threads();
        assert!((1..=usable).contains(&n), "{n} of {usable}: {why}");
        assert!(why.contains(&format!("{usable} usable")), "{why}");
        // Where the topology is readable (Linux with sysfs) the default is the physical cores among the
        // usable CPUs; where it is not, every usable CPU, and the log says why.
        match physical_cores() {
            Some(cores) => assert_eq!(n, cores.min(usable), "{why}"),
            None => {
                assert_eq!(n, usable);
                assert!(why.contains("could not be read"), "{why}");
            }
        }
    }
}
