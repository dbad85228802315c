//! kura-bench: a load generator and report for any OpenAI-compatible server, built around the workloads
//! where a KV cache matters (shared system prompts, multi-turn chat, many questions over one document,
//! nothing shared at all, and replays of real traces).
//!
//! ```text
//! workload (seeded prompts) ──> runner (load shape) ──> client (streamed request, timed) ──> records
//!                                                                        │
//!                 report: run.json, summary.md, terminal table  <── stats (percentiles)
//!                 plot:   TTFT/ITL CDFs, latency and throughput vs load, cached-token ratio
//! ```
//!
//! The crate knows only the OpenAI HTTP API (and the optional `POST /tokenize`), never Kura's internals,
//! so the same run measures Kura, llama.cpp's server, vLLM or anything else that speaks it.

pub mod client;
pub mod plot;
pub mod report;
pub mod rng;
pub mod runner;
pub mod stats;
pub mod text;
pub mod workload;

use std::path::{Path, PathBuf};

pub use client::{Api, Endpoint};
pub use kura_trace::TraceFormat;
pub use plot::Mark;
pub use report::{terminal_table, BenchRun};
pub use runner::{run, Load, RunConfig};
pub use text::TokenCounting;
pub use workload::WorkloadSpec;

/// What can stop a run or a report. Failed requests are not errors: they are counted in the report.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("cannot reach the server at {url}: {detail}\n  is it running, and is --url right?")]
    Unreachable { url: String, detail: String },
    #[error(transparent)]
    Trace(#[from] kura_trace::TraceFileError),
    #[error("the server's tokenizer at {url} failed: {detail}")]
    Tokenize { url: String, detail: String },
    #[error("{0}")]
    Config(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not a kura-bench run file: {detail}", .path.display())]
    RunFile { path: PathBuf, detail: String },
    #[error("drawing plot {plot}: {detail}")]
    Plot { plot: String, detail: String },
}

/// [`run`] on a runtime of its own, for callers that are not async (the `kura` binary).
pub fn run_blocking(cfg: RunConfig) -> Result<BenchRun, BenchError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| BenchError::Io {
            what: "starting the async runtime".into(),
            source: e,
        })?;
    runtime.block_on(run(cfg))
}

/// Writes `run.json`, `summary.md` and `plots/` for one run into `dir`; returns the summary's path.
pub fn write_report(
    run: &BenchRun,
    dir: &Path,
    mark: Option<&Mark>,
) -> Result<PathBuf, BenchError> {
    std::fs::create_dir_all(dir).map_err(|e| BenchError::Io {
        what: format!("creating {}", dir.display()),
        source: e,
    })?;
    run.write(&dir.join("run.json"))?;
    let plots = plot::write_plots(&[run], &plot::plots_dir(dir), mark)?;
    let title = format!("kura-bench: {} on {}", run.workload, run.label);
    let summary = dir.join("summary.md");
    report::write_file(
        &summary,
        report::markdown(&title, &[run], &plots).as_bytes(),
    )?;
    Ok(summary)
}

/// Reads run files and writes `compare.md` and overlaid `plots/` into `dir`; returns the report's path
/// and the runs read.
pub fn write_comparison(
    files: &[PathBuf],
    dir: &Path,
    mark: Option<&Mark>,
) -> Result<(PathBuf, Vec<BenchRun>), BenchError> {
    if files.is_empty() {
        return Err(BenchError::Config(
            "--compare needs at least one run.json".into(),
        ));
    }
    let runs = files
        .iter()
        .map(|f| BenchRun::read(f))
        .collect::<Result<Vec<_>, _>>()?;
    std::fs::create_dir_all(dir).map_err(|e| BenchError::Io {
        what: format!("creating {}", dir.display()),
        source: e,
    })?;
    let refs: Vec<&BenchRun> = runs.iter().collect();
    let plots = plot::write_plots(&refs, &plot::plots_dir(dir), mark)?;
    let mut workloads: Vec<&str> = runs.iter().map(|r| r.workload.as_str()).collect();
    workloads.dedup();
    let title = format!("kura-bench comparison: {}", workloads.join(", "));
    let path = dir.join("compare.md");
    report::write_file(&path, report::markdown(&title, &refs, &plots).as_bytes())?;
    Ok((path, runs))
}
