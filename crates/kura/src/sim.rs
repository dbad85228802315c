//! `kura sim`: replays a Mooncake-format trace through the KV cache manager (no model) and prints hit
//! ratios, evictions and the manager's throughput as a table or JSON.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use kura_sim::{load_trace_limited, replay, Policy, SimConfig};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum PolicyArg {
    /// Leaf-first LRU within priority classes (Kura's default).
    LeafLru,
    /// Plain LRU over all idle blocks (vLLM's order): a parent may go before its children.
    Lru,
    /// No prefix caching.
    None,
}

#[derive(Args, Debug)]
pub struct SimArgs {
    /// A Mooncake-format trace (JSONL: timestamp, input_length, output_length, hash_ids).
    #[arg(long, default_value = "data/traces/mooncake_conversation_trace.jsonl")]
    trace: PathBuf,
    /// Tokens per KV block (1..=1024); each 512-token hash id of the trace is mapped to its tokens.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Cache capacity in tokens, at least one block (rounded down to whole blocks). Default: unbounded
    /// (nothing is ever evicted).
    #[arg(long)]
    capacity_tokens: Option<u64>,
    /// Eviction policy.
    #[arg(long, value_enum, default_value_t = PolicyArg::LeafLru)]
    policy: PolicyArg,
    /// Free each request as soon as it is allocated instead of holding it for its duration.
    #[arg(long)]
    no_overlap: bool,
    /// Cost model: prefill speed for uncached prompt tokens (positive).
    #[arg(long, default_value_t = 10_000.0)]
    prefill_tokens_per_s: f64,
    /// Cost model: time per output token (0 or more; 0: output takes no time).
    #[arg(long, default_value_t = 20.0)]
    decode_ms_per_token: f64,
    /// Replay only the first N requests (N >= 1); the rest of the trace is not read.
    #[arg(long)]
    limit: Option<usize>,
    /// Hash seed (results do not depend on it unless hashes collide).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(args: SimArgs) -> Result<()> {
    if args.limit == Some(0) {
        bail!("--limit 0 replays no request: give at least 1, or leave it out to replay the whole trace");
    }
    let cfg = SimConfig {
        block_size: args.block_size,
        capacity_tokens: args.capacity_tokens,
        policy: match args.policy {
            PolicyArg::LeafLru => Policy::LeafLru,
            PolicyArg::Lru => Policy::Lru,
            PolicyArg::None => Policy::NoCache,
        },
        overlap: !args.no_overlap,
        prefill_tokens_per_s: args.prefill_tokens_per_s,
        decode_ms_per_token: args.decode_ms_per_token,
        hash_seed: args.seed,
    };
    // Flags first: a bad one is reported before a large trace is read.
    cfg.validate()?;
    let trace = load_trace_limited(&args.trace, args.limit)?;
    let report =
        replay(&trace, &cfg).with_context(|| format!("replaying {}", args.trace.display()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("trace                {}", args.trace.display());
        print!("{report}");
    }
    Ok(())
}
