//! What a run records and how it is shown: per-request figures, the run file (`run.json`), the terminal
//! table and the Markdown summary.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::client::Api;
use crate::stats::{Dist, Summary};
use crate::text::TokenCounting;
use crate::BenchError;

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum ErrorKind {
    /// No connection could be made (refused, DNS, reset before the response).
    Connect,
    /// No complete response within the request timeout.
    Timeout,
    /// The server answered with a non-2xx status.
    Http { status: u16 },
    /// The stream was not valid SSE or its chunks were not OpenAI JSON, or it ended without `[DONE]`.
    MalformedStream,
    /// The connection broke in the middle of the stream.
    Disconnected,
    /// The server sent an error object inside the stream.
    ServerError,
}

impl ErrorKind {
    pub fn label(&self) -> String {
        match self {
            ErrorKind::Connect => "connect".into(),
            ErrorKind::Timeout => "timeout".into(),
            ErrorKind::Http { status } => format!("http_{status}"),
            ErrorKind::MalformedStream => "malformed_stream".into(),
            ErrorKind::Disconnected => "disconnected".into(),
            ErrorKind::ServerError => "server_error".into(),
        }
    }
}

impl From<ErrorKind> for String {
    fn from(k: ErrorKind) -> String {
        k.label()
    }
}

impl TryFrom<String> for ErrorKind {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        Ok(match s.as_str() {
            "connect" => ErrorKind::Connect,
            "timeout" => ErrorKind::Timeout,
            "malformed_stream" => ErrorKind::MalformedStream,
            "disconnected" => ErrorKind::Disconnected,
            "server_error" => ErrorKind::ServerError,
            other => match other.strip_prefix("http_").and_then(|c| c.parse().ok()) {
                Some(status) => ErrorKind::Http { status },
                None => return Err(format!("unknown error kind `{other}`")),
            },
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestError {
    pub kind: ErrorKind,
    pub message: String,
}

/// One request's figures. Times are milliseconds; `start_ms` is after the load point's start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub id: usize,
    pub session: usize,
    pub turn: usize,
    pub group: Option<usize>,
    pub start_ms: f64,
    /// Prompt tokens as the workload built them (exact or approximate, see the run's `token_counting`),
    /// not counting the chat template or earlier turns' answers.
    pub prompt_tokens_sent: u64,
    /// `usage.prompt_tokens` as the server reported it.
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub output_tokens: u64,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: f64,
    pub itl_ms: Vec<f64>,
    pub error: Option<RequestError>,
}

/// The load applied at one point of a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "shape", rename_all = "snake_case")]
pub enum LoadShape {
    /// At most `concurrency` requests in flight; the next starts when one ends.
    Concurrency { concurrency: usize },
    /// Sessions start as a Poisson process of `rate` per second.
    Rate { rate: f64 },
    /// Each shared-prefix group sent at one instant, group after group.
    Burst { group_size: usize },
    /// Sessions start at the trace's arrival times.
    Trace { time_scale: f64 },
}

impl LoadShape {
    pub fn describe(&self) -> String {
        match self {
            LoadShape::Concurrency { concurrency } => format!("concurrency {concurrency}"),
            LoadShape::Rate { rate } => format!("rate {rate}/s"),
            LoadShape::Burst { group_size } => format!("burst of {group_size}"),
            LoadShape::Trace { time_scale } => format!("trace ×{time_scale}"),
        }
    }

    /// The x value of this point on a latency-vs-load plot, and the axis it belongs on.
    pub fn x(&self) -> Option<(f64, &'static str)> {
        match self {
            LoadShape::Concurrency { concurrency } => Some((*concurrency as f64, "concurrency")),
            LoadShape::Rate { rate } => Some((*rate, "request rate (req/s)")),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PointResult {
    pub load: LoadShape,
    /// Requests the workload planned; more than `summary.requests` when a failed turn ended its
    /// conversation early.
    pub planned: usize,
    pub summary: Summary,
    pub requests: Vec<RequestRecord>,
}

/// Everything one `kura bench` run measured: the content of `run.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchRun {
    pub kura_bench_version: String,
    /// A name for the server in comparisons ("kura", "kura --no-prefix-cache", "llama.cpp").
    pub label: String,
    pub url: String,
    pub model: String,
    pub api: Api,
    pub workload: String,
    pub params: Value,
    pub token_counting: TokenCounting,
    pub notes: Vec<String>,
    pub started_unix_s: u64,
    pub points: Vec<PointResult>,
}

/// The most bytes read from a run file (`--compare`): a run of a million requests is about 300 MB.
pub const RUN_FILE_MAX_BYTES: u64 = 1 << 30;

impl BenchRun {
    pub fn failed(&self) -> usize {
        self.points.iter().map(|p| p.summary.failed).sum()
    }

    pub fn requests(&self) -> usize {
        self.points.iter().map(|p| p.summary.requests).sum()
    }

    /// Reads a run written by [`BenchRun::write`]: a regular file (a FIFO would block, `/dev/zero`
    /// never ends) of at most [`RUN_FILE_MAX_BYTES`].
    pub fn read(path: &Path) -> Result<BenchRun, BenchError> {
        let io = |e| BenchError::Io {
            what: format!("reading {}", path.display()),
            source: e,
        };
        let text = kura_files::read_text(path, RUN_FILE_MAX_BYTES).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData => {
                BenchError::RunFile {
                    path: path.to_path_buf(),
                    detail: e.to_string(),
                }
            }
            _ => io(e),
        })?;
        serde_json::from_str(&text).map_err(|e| BenchError::RunFile {
            path: path.to_path_buf(),
            detail: e.to_string(),
        })
    }

    pub fn write(&self, path: &Path) -> Result<(), BenchError> {
        let text = serde_json::to_string_pretty(self).map_err(|e| BenchError::RunFile {
            path: path.to_path_buf(),
            detail: e.to_string(),
        })?;
        write_file(path, text.as_bytes())
    }
}

pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> Result<(), BenchError> {
    std::fs::write(path, bytes).map_err(|e| BenchError::Io {
        what: format!("writing {}", path.display()),
        source: e,
    })
}

fn ms(d: Option<Dist>, pick: fn(&Dist) -> f64) -> String {
    d.map(|d| format!("{:.1}", pick(&d)))
        .unwrap_or_else(|| "-".into())
}

fn ratio(r: Option<f64>) -> String {
    r.map(|r| format!("{:.1} %", r * 100.0))
        .unwrap_or_else(|| "not reported".into())
}

fn errors(s: &Summary) -> String {
    if s.errors_by_kind.is_empty() {
        return "0".into();
    }
    s.errors_by_kind
        .iter()
        .map(|(k, n)| format!("{n} {k}"))
        .collect::<Vec<_>>()
        .join(", ")
}

const COLUMNS: [&str; 11] = [
    "run",
    "load",
    "ok/sent",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "ITL p50 ms",
    "ITL p99 ms",
    "E2E p50 ms",
    "out tok/s",
    "cached",
    "errors",
];

fn row(run: &BenchRun, p: &PointResult) -> Vec<String> {
    let s = &p.summary;
    vec![
        run.label.clone(),
        p.load.describe(),
        format!("{}/{}", s.ok, s.requests),
        ms(s.ttft_ms, |d| d.p50),
        ms(s.ttft_ms, |d| d.p99),
        ms(s.itl_ms, |d| d.p50),
        ms(s.itl_ms, |d| d.p99),
        ms(s.e2e_ms, |d| d.p50),
        format!("{:.1}", s.output_tok_per_s),
        ratio(s.cached_token_ratio),
        errors(s),
    ]
}

/// A plain-text table of every point of every run, columns aligned.
pub fn terminal_table(runs: &[&BenchRun]) -> String {
    let mut rows: Vec<Vec<String>> = vec![COLUMNS.iter().map(|c| c.to_string()).collect()];
    for run in runs {
        for p in &run.points {
            rows.push(row(run, p));
        }
    }
    let widths: Vec<usize> = (0..COLUMNS.len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for (i, r) in rows.iter().enumerate() {
        let cells: Vec<String> = r
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(c, (cell, w))| {
                if c < 2 {
                    format!("{cell:<w$}")
                } else {
                    format!("{cell:>w$}")
                }
            })
            .collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
        if i == 0 {
            let _ = writeln!(
                out,
                "{}",
                "-".repeat(widths.iter().sum::<usize>() + 2 * (widths.len() - 1))
            );
        }
    }
    out
}

fn markdown_table(runs: &[&BenchRun]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "| {} |", COLUMNS.join(" | "));
    let _ = writeln!(
        out,
        "|{}",
        COLUMNS
            .iter()
            .enumerate()
            .map(|(i, _)| if i < 2 { "---|" } else { "---:|" })
            .collect::<String>()
    );
    for run in runs {
        for p in &run.points {
            let _ = writeln!(out, "| {} |", row(run, p).join(" | "));
        }
    }
    out
}

/// `groups=4, users_per_group=8, …` from the workload's parameters.
fn params_text(params: &Value) -> String {
    match params {
        Value::Object(map) => map
            .iter()
            .filter(|(k, _)| k.as_str() != "workload")
            .map(|(k, v)| match v {
                Value::String(s) => format!("{k}={s}"),
                other => format!("{k}={other}"),
            })
            .collect::<Vec<_>>()
            .join(", "),
        other => other.to_string(),
    }
}

fn counting(c: TokenCounting) -> &'static str {
    match c {
        TokenCounting::Exact => "exact (the server's own tokenizer, `POST /tokenize`)",
        TokenCounting::Approximate => {
            "approximate (the server has no tokenizer endpoint; one token per word assumed)"
        }
    }
}

/// The Markdown report of one or more runs; `plots` are file names (without extension) under `plots/`.
pub fn markdown(title: &str, runs: &[&BenchRun], plots: &[(String, String)]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# {title}\n");
    for run in runs {
        let _ = writeln!(
            out,
            "- **{}**: {}, model `{}`, {:?} API, workload `{}` ({}); token counts {}.",
            run.label,
            run.url,
            run.model,
            run.api,
            run.workload,
            params_text(&run.params),
            counting(run.token_counting)
        );
        for note in &run.notes {
            let _ = writeln!(out, "  - {note}");
        }
    }
    let _ = writeln!(out, "\n{}", markdown_table(runs));
    let _ = writeln!(
        out,
        "TTFT: time to the first streamed token. ITL: gap between consecutive streamed tokens. \
         E2E: whole request. out tok/s: output tokens of successful requests per second of wall time. \
         cached: prompt tokens the server reported as served from its prefix cache \
         (`usage.prompt_tokens_details.cached_tokens`, or llama.cpp's `timings.cache_n`) over all prompt tokens.\n"
    );
    let failures: Vec<(&BenchRun, &RequestRecord)> = runs
        .iter()
        .flat_map(|r| {
            r.points
                .iter()
                .flat_map(move |p| p.requests.iter().map(move |q| (*r, q)))
        })
        .filter(|(_, q)| q.error.is_some())
        .collect();
    if !failures.is_empty() {
        let _ = writeln!(out, "## Failures ({} requests)\n", failures.len());
        for (run, q) in failures.iter().take(10) {
            if let Some(e) = &q.error {
                let _ = writeln!(
                    out,
                    "- {} request {}: `{}` {}",
                    run.label,
                    q.id,
                    e.kind.label(),
                    e.message
                );
            }
        }
        if failures.len() > 10 {
            let _ = writeln!(out, "- … {} more in the run files", failures.len() - 10);
        }
        out.push('\n');
    }
    if !plots.is_empty() {
        let _ = writeln!(out, "## Plots\n");
        for (file, caption) in plots {
            let _ = writeln!(out, "![{caption}](plots/{file}.png)\n");
        }
    }
    out
}
