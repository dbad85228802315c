//! `kura bench`: measure any OpenAI-compatible server on KV-cache workloads (arguments and wiring; the
//! work is in kura-bench).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use kura_bench::{Api, Endpoint, Load, Mark, RunConfig, TraceFormat, WorkloadSpec};

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    workload: Option<WorkloadCmd>,
    /// Overlay earlier runs instead of running: `--compare a/run.json b/run.json --out DIR`.
    #[arg(long, num_args = 1.., value_name = "RUN_JSON")]
    compare: Vec<PathBuf>,
    /// With --compare: where compare.md and plots/ go.
    #[arg(long, default_value = "bench-compare")]
    out: PathBuf,
    #[command(flatten)]
    mark: MarkArgs,
}

#[derive(Args, Debug, Clone)]
struct MarkArgs {
    /// Draw a vertical line at this concurrency on sweep plots (e.g. the KV pool `kura plan` predicts).
    #[arg(long, value_parser = mark_concurrency_arg)]
    mark_concurrency: Option<f64>,
    /// The legend of --mark-concurrency.
    #[arg(long, default_value = "KV pool (kura plan)")]
    mark_label: String,
}

/// `--mark-concurrency`: a concurrency, more than 0 and at most 10^9.
fn mark_concurrency_arg(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(c) if c > 0.0 && c <= 1e9 => Ok(c),
        _ => Err(format!("`{s}`: give a concurrency above 0, at most 1e9")),
    }
}

impl MarkArgs {
    fn mark(&self) -> Option<Mark> {
        self.mark_concurrency.map(|c| Mark {
            concurrency: c,
            label: self.mark_label.clone(),
        })
    }
}

#[derive(Subcommand, Debug)]
enum WorkloadCmd {
    /// G groups of users; each group shares a system prompt of S tokens, each user asks Q tokens.
    SharedPrefix {
        #[arg(long, default_value_t = 4)]
        groups: usize,
        #[arg(long, default_value_t = 8)]
        users_per_group: usize,
        #[arg(long, default_value_t = 1000)]
        system_tokens: usize,
        #[arg(long, default_value_t = 50)]
        question_tokens: usize,
        /// Send each group's users at one instant, one group after the other (ignores the load flags).
        #[arg(long)]
        burst: bool,
        #[command(flatten)]
        common: CommonArgs,
    },
    /// Conversations whose every turn resends the whole history (with the server's real answers).
    MultiTurn {
        #[arg(long, default_value_t = 8)]
        conversations: usize,
        #[arg(long, default_value_t = 4)]
        turns: usize,
        #[arg(long, default_value_t = 200)]
        system_tokens: usize,
        #[arg(long, default_value_t = 100)]
        user_tokens: usize,
        #[command(flatten)]
        common: CommonArgs,
    },
    /// Many questions over one long document (sent as the system message).
    LongDoc {
        #[arg(long, default_value_t = 4000)]
        doc_tokens: usize,
        #[arg(long, default_value_t = 16)]
        questions: usize,
        #[arg(long, default_value_t = 30)]
        question_tokens: usize,
        #[command(flatten)]
        common: CommonArgs,
    },
    /// Prompts that share nothing: the cost of prefix caching when it cannot help.
    Unique {
        #[arg(long, default_value_t = 32)]
        requests: usize,
        #[arg(long, default_value_t = 1050)]
        prompt_tokens: usize,
        #[command(flatten)]
        common: CommonArgs,
    },
    /// Replay a Mooncake (.jsonl, hash ids → shared text, 512 tokens per id) or Azure (.csv) trace.
    Trace {
        /// The trace file.
        file: PathBuf,
        /// Default: from the extension (.jsonl Mooncake, .csv Azure).
        #[arg(long)]
        format: Option<TraceFormat>,
        /// Replay only the first N requests.
        #[arg(long)]
        max_requests: Option<usize>,
        #[command(flatten)]
        shaping: TraceShaping,
        #[command(flatten)]
        common: CommonArgs,
    },
}

/// How a trace is replayed, for `kura bench trace` and `kura sim --workload trace` alike.
#[derive(Args, Debug, Clone, Copy)]
pub struct TraceShaping {
    /// Trace: multiply arrival times by this (0.1 = ten times faster).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Trace: cut longer prompts to this many tokens (small models have short contexts).
    #[arg(long)]
    pub max_prompt_tokens: Option<usize>,
    /// Trace: cut longer outputs to this many tokens.
    #[arg(long)]
    pub max_output_tokens: Option<usize>,
}

#[derive(Args, Debug, Clone)]
struct CommonArgs {
    /// The server's root URL (a trailing /v1 is fine).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// The `model` to send. Default: the first one GET /v1/models lists.
    #[arg(long)]
    model: Option<String>,
    /// Sent as `Authorization: Bearer <key>`.
    #[arg(long)]
    api_key: Option<String>,
    #[arg(long, value_enum, default_value = "chat")]
    api: Api,
    /// Name of this server in reports (default: the URL).
    #[arg(long)]
    label: Option<String>,
    /// Write run.json, summary.md and plots/ here.
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    output_tokens: u32,
    /// Let the model stop at end-of-sequence (by default `ignore_eos` makes every output full length).
    #[arg(long)]
    allow_eos: bool,
    /// The `temperature` every request sends, 0 to 2: 0 (the default) decodes greedily; above 0 the
    /// server samples each token, as most chat clients ask.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long, default_value_t = 300.0)]
    request_timeout_s: f64,
    /// Requests in flight at once (the default load).
    #[arg(long, conflicts_with_all = ["rate", "sweep_concurrency", "sweep_rate"])]
    concurrency: Option<usize>,
    /// Poisson arrivals at this many sessions per second.
    #[arg(long, conflicts_with_all = ["sweep_concurrency", "sweep_rate"])]
    rate: Option<f64>,
    /// One point per concurrency, e.g. `1,2,4,8,16`.
    #[arg(long, value_delimiter = ',', conflicts_with = "sweep_rate")]
    sweep_concurrency: Vec<usize>,
    /// One point per request rate, e.g. `0.5,1,2,4`.
    #[arg(long, value_delimiter = ',')]
    sweep_rate: Vec<f64>,
    /// No progress line, warnings or table.
    #[arg(long, short)]
    quiet: bool,
    #[command(flatten)]
    mark: MarkArgs,
}

impl CommonArgs {
    fn loads(&self) -> Vec<Load> {
        if !self.sweep_concurrency.is_empty() {
            self.sweep_concurrency
                .iter()
                .map(|&c| Load::Concurrency(c))
                .collect()
        } else if !self.sweep_rate.is_empty() {
            self.sweep_rate.iter().map(|&r| Load::Rate(r)).collect()
        } else if let Some(r) = self.rate {
            vec![Load::Rate(r)]
        } else {
            vec![Load::Concurrency(self.concurrency.unwrap_or(8))]
        }
    }
}

pub fn run(args: BenchArgs) -> Result<()> {
    let (spec, common) = match args.workload {
        None if args.compare.is_empty() => {
            bail!("give a workload (shared-prefix, multi-turn, long-doc, unique, trace) or --compare RUN_JSON...")
        }
        None => return compare(&args.compare, &args.out, args.mark.mark()),
        Some(w) => workload_spec(w)?,
    };
    // Up to a year: a longer wait is a mistake, and 1e300 s is no `Duration`.
    if !(common.request_timeout_s.is_finite()
        && common.request_timeout_s > 0.0
        && common.request_timeout_s <= 31_536_000.0)
    {
        bail!(
            "--request-timeout-s must be > 0 and at most 31536000 (a year), got {:?}",
            common.request_timeout_s
        );
    }
    if !(0.0..=2.0).contains(&common.temperature) {
        bail!(
            "--temperature must be between 0 and 2, got {}",
            common.temperature
        );
    }
    let cfg = RunConfig {
        endpoint: Endpoint {
            base_url: common.url.clone(),
            api_key: common.api_key.clone(),
            model: common.model.clone().unwrap_or_default(),
            api: common.api,
            ignore_eos: !common.allow_eos,
            temperature: common.temperature,
            request_timeout: Duration::from_secs_f64(common.request_timeout_s),
        },
        label: common.label.clone().unwrap_or_else(|| common.url.clone()),
        spec,
        output_tokens: common.output_tokens,
        seed: common.seed,
        loads: common.loads(),
        progress: !common.quiet,
    };
    let run = kura_bench::run_blocking(cfg)?;
    if !common.quiet {
        println!("{}", kura_bench::terminal_table(&[&run]));
    }
    if let Some(out) = &common.out {
        let summary = kura_bench::write_report(&run, out, common.mark.mark().as_ref())?;
        if !common.quiet {
            println!(
                "report: {} (run.json and plots/ beside it)",
                summary.display()
            );
        }
    }
    let (failed, total) = (run.failed(), run.requests());
    if failed > 0 {
        let first = run
            .points
            .iter()
            .flat_map(|p| &p.requests)
            .find_map(|r| r.error.as_ref())
            .map(|e| format!(" (first: {})", e.message))
            .unwrap_or_default();
        if failed == total {
            bail!("all {total} requests failed{first}");
        }
        eprintln!("warning: {failed} of {total} requests failed{first}");
    }
    Ok(())
}

fn compare(files: &[PathBuf], out: &std::path::Path, mark: Option<Mark>) -> Result<()> {
    let (path, runs) = kura_bench::write_comparison(files, out, mark.as_ref())?;
    let refs: Vec<&kura_bench::BenchRun> = runs.iter().collect();
    println!("{}", kura_bench::terminal_table(&refs));
    println!("comparison: {} (plots/ beside it)", path.display());
    Ok(())
}

fn workload_spec(w: WorkloadCmd) -> Result<(WorkloadSpec, CommonArgs)> {
    Ok(match w {
        WorkloadCmd::SharedPrefix {
            groups,
            users_per_group,
            system_tokens,
            question_tokens,
            burst,
            common,
        } => (
            WorkloadSpec::SharedPrefix {
                groups,
                users_per_group,
                system_tokens,
                question_tokens,
                burst,
            },
            common,
        ),
        WorkloadCmd::MultiTurn {
            conversations,
            turns,
            system_tokens,
            user_tokens,
            common,
        } => (
            WorkloadSpec::MultiTurn {
                conversations,
                turns,
                system_tokens,
                user_tokens,
            },
            common,
        ),
        WorkloadCmd::LongDoc {
            doc_tokens,
            questions,
            question_tokens,
            common,
        } => (
            WorkloadSpec::LongDoc {
                doc_tokens,
                questions,
                question_tokens,
            },
            common,
        ),
        WorkloadCmd::Unique {
            requests,
            prompt_tokens,
            common,
        } => (
            WorkloadSpec::Unique {
                requests,
                prompt_tokens,
            },
            common,
        ),
        WorkloadCmd::Trace {
            file,
            format,
            max_requests,
            shaping,
            common,
        } => {
            if common.concurrency.is_some()
                || common.rate.is_some()
                || !common.sweep_concurrency.is_empty()
                || !common.sweep_rate.is_empty()
            {
                bail!(
                    "kura bench trace sends each request at its time in the trace: --concurrency, \
                     --rate and --sweep-* do not apply (--time-scale speeds the replay up or down)"
                );
            }
            let format = match format {
                Some(format) => format,
                None => TraceFormat::infer(&file).with_context(|| {
                    format!(
                        "cannot tell the format of {} from its extension; give --format mooncake or --format azure",
                        file.display()
                    )
                })?,
            };
            (
                WorkloadSpec::Trace {
                    path: file,
                    format,
                    max_requests,
                    time_scale: shaping.time_scale,
                    max_prompt_tokens: shaping.max_prompt_tokens,
                    max_output_tokens: shaping.max_output_tokens,
                },
                common,
            )
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    #[test]
    fn arguments_are_consistent_and_parse() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "kura-bench",
            "shared-prefix",
            "--groups",
            "2",
            "--sweep-concurrency",
            "1,2,4",
            "--mark-concurrency",
            "10",
        ])
        .unwrap();
        let Some(WorkloadCmd::SharedPrefix { groups, common, .. }) = cli.bench.workload else {
            panic!("expected shared-prefix");
        };
        assert_eq!(groups, 2);
        assert_eq!(
            common.loads(),
            [
                Load::Concurrency(1),
                Load::Concurrency(2),
                Load::Concurrency(4)
            ]
        );
        assert_eq!(common.mark.mark().map(|m| m.concurrency), Some(10.0));
        let cli = Cli::try_parse_from(["kura-bench", "--compare", "a.json", "b.json"]).unwrap();
        assert_eq!(cli.bench.compare.len(), 2);
        assert!(
            Cli::try_parse_from(["kura-bench", "unique", "--rate", "1", "--concurrency", "2"])
                .is_err()
        );
    }

    #[test]
    fn flags_that_would_do_nothing_or_never_end_are_refused() {
        for (args, expected) in [
            (
                &["unique", "--mark-concurrency", "1.75e308"][..],
                "give a concurrency above 0, at most 1e9",
            ),
            (&["unique", "--mark-concurrency", "0"], "above 0"),
            (&["unique", "--mark-concurrency", "NaN"], "above 0"),
            (&["unique", "--output-tokens", "0"], "0 is not in 1.."),
        ] {
            let e = Cli::try_parse_from(std::iter::once("kura-bench").chain(args.iter().copied()))
                .err()
                .unwrap_or_else(|| panic!("{args:?} parsed"))
                .to_string();
            assert!(e.contains(expected), "{args:?}: {e}");
        }
        // A trace is sent at its own times: a load of clients or a rate would be ignored.
        for load in [
            &["--concurrency", "4"][..],
            &["--rate", "2"],
            &["--sweep-concurrency", "1,2"],
            &["--sweep-rate", "1,2"],
        ] {
            let args = ["kura-bench", "trace", "t.jsonl"].iter().chain(load);
            let cli = Cli::try_parse_from(args).unwrap();
            let e = run(cli.bench).unwrap_err().to_string();
            assert!(
                e.contains("--concurrency, --rate and --sweep-* do not apply"),
                "{load:?}: {e}"
            );
        }
    }
}
