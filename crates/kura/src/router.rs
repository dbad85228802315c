//! `kura router`: one OpenAI- and Anthropic-compatible endpoint over several `kura serve` replicas,
//! sending each request to the replica that holds its prefix (see kura-router).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use kura_engine::ModelCodec;
use kura_model::ModelText;
use kura_router::{Policy, RouterConfig};

#[derive(Args, Debug)]
pub struct RouterArgs {
    /// A replica's base URL (`http://127.0.0.1:8001`); give one per replica. Replicas started with
    /// `--kv-events` are routed by their cache.
    #[arg(long = "replica", required = true)]
    replicas: Vec<String>,
    /// `kv`: lowest `overlap weight × blocks to prefill + active blocks`; `round-robin`; `least-load`.
    #[arg(long, default_value = "kv")]
    policy: Policy,
    /// The model the replicas serve (GGUF file or HF directory), read for its tokenizer and chat
    /// template only. Default: Kura's default model (scripts/fetch-model.sh).
    #[arg(long, short)]
    model: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Weight of one block to prefill against one block in use in the `kv` cost (0..=1000).
    #[arg(long, default_value_t = 1.0)]
    overlap_weight: f64,
    /// API key the router presents to the replicas' `/v1/kv/events` when they have keys (clients'
    /// own keys are forwarded with their requests).
    #[arg(long)]
    replica_api_key: Option<String>,
    /// Milliseconds between health checks of each replica (50..=10000); a replica is drained after two
    /// failed checks or one refused request.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(50..=10_000))]
    health_interval_ms: u64,
}

pub fn run(args: RouterArgs) -> Result<()> {
    if !(0.0..=1000.0).contains(&args.overlap_weight) {
        anyhow::bail!(
            "--overlap-weight must be from 0 to 1000, got {}",
            args.overlap_weight
        );
    }
    let path = crate::setup::model_path(args.model.as_ref())?;
    let text = ModelText::load(&path)
        .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
    let config = RouterConfig {
        replicas: args.replicas,
        policy: args.policy,
        overlap_weight: args.overlap_weight,
        replica_api_key: args.replica_api_key,
        health_interval: Duration::from_millis(args.health_interval_ms),
        codec: Arc::new(ModelCodec::from_text(Arc::new(text))),
        max_body_bytes: 8 * 1024 * 1024,
    };
    let addr = format!("{}:{}", args.host, args.port);
    kura_router::serve_blocking(&addr, config).context("running the router")?;
    Ok(())
}
