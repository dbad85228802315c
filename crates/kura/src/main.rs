//! `kura`: the command-line binary. Argument parsing and wiring, plus what belongs to no library: memory
//! sizing (`memory`), the KV fingerprint and pool sizing of `kura serve` (`serve`), where secrets come from
//! (`secrets`), progress bars (`progress`) and the offline commands (`cache`, `generate`, `perplexity`).

use clap::{Parser, Subcommand};

mod bench;
mod cache;
mod generate;
mod gpu;
mod http_args;
mod memory;
mod perplexity;
mod plan;
mod progress;
mod router;
mod secrets;
mod serve;
mod setup;
mod sim;
mod speculative;
mod tiers;
mod trim;

#[derive(Parser)]
#[command(
    name = "kura",
    version,
    about = "Kura: a KV-cache-centred LLM inference server"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// KV cache size and maximum concurrency for a model on given memory.
    Plan(plan::PlanArgs),
    /// Generate text from one prompt on the CPU and report load time, TTFT, ITL and tokens/s.
    Generate(generate::GenerateArgs),
    /// Perplexity of a text with each KV format, against f32 KV: KL divergence and top-1 agreement.
    Perplexity(perplexity::PerplexityArgs),
    /// Serve the OpenAI-compatible API (completions, chat, streaming, /metrics) on a model.
    Serve(Box<serve::ServeArgs>),
    /// Route requests over several `kura serve` replicas by where their prefix is cached.
    Router(router::RouterArgs),
    /// Measure an OpenAI-compatible server (Kura or another) on KV-cache workloads; reports and plots.
    Bench(bench::BenchArgs),
    /// Saved contexts without a server: build a document's KV into the disk tier, list, remove.
    Cache(cache::CacheArgs),
    /// Replay a serving trace through the KV cache manager (no model), or simulate the server or a fleet:
    /// hit ratios, evictions, throughput, TTFT.
    Sim(sim::SimArgs),
}

/// A command that only prints (`kura plan | head -1`) ends quietly when its reader goes, as Unix tools
/// do, instead of failing on the next print: SIGPIPE back to its default. The servers, the benchmark
/// client and `generate` keep it ignored (a closed socket or pipe is then an error of that write).
fn quiet_on_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: restores the default action of one signal, before any thread is started.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KURA_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // Colours only for a person at a terminal: a log file or a pipe gets plain text.
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os("NO_COLOR").is_none(),
        )
        .init();
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Plan(_) | Command::Cache(_) | Command::Sim(_) | Command::Perplexity(_)
    ) {
        quiet_on_closed_pipe();
    }
    let result = match cli.command {
        Command::Plan(args) => plan::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Perplexity(args) => perplexity::run(args),
        Command::Serve(args) => serve::run(*args),
        Command::Router(args) => router::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Sim(args) => sim::run(args),
        Command::Cache(args) => cache::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
