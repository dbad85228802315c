//! `kura cache build|list|rm`: saved contexts without a server (offline cache-augmented generation).
//!
//! `build` loads the model as `kura serve` would with the same flags (so the KV carries the same
//! fingerprint), computes a document's KV, writes its blocks into the disk tier and its record into
//! `<kv-disk-path>/contexts/`, and prints the context's id; a server started on that directory serves it
//! (`cached_content`). `list` and `rm` read and edit the records.

use std::path::PathBuf;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use kura_engine::{ChatMessage, EngineEvent};
use kura_server::caching::{
    context_tokens, parse_context_ttl, ContextKind, ContextStore, SavedContext,
};

use crate::serve::ServeArgs;

#[derive(Args, Debug)]
pub struct CacheArgs {
    #[command(subcommand)]
    command: CacheCommand,
}

#[derive(Subcommand, Debug)]
enum CacheCommand {
    /// Compute a document's KV into the disk tier (--kv-disk-path) and save it as a context; prints its id.
    Build(Box<BuildArgs>),
    /// The saved contexts of a disk tier's directory.
    List {
        #[arg(long)]
        kv_disk_path: PathBuf,
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Deletes saved contexts (their records; their blocks stay cached until evicted).
    Rm {
        #[arg(long)]
        kv_disk_path: PathBuf,
        /// Context ids (`ctx_…`).
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

#[derive(Args, Debug)]
struct BuildArgs {
    /// A text file: the context is its text, and requests' prompts follow it.
    #[arg(long, conflicts_with = "messages_json")]
    file: Option<PathBuf>,
    /// A JSON file holding an array of chat messages (`[{"role": "system", "content": "…"}, …]`):
    /// requests' own messages follow them in the chat template.
    #[arg(long)]
    messages_json: Option<PathBuf>,
    /// Time to live: seconds, or `300s`, `30m`, `1h`, `7d` (at most 365 days).
    #[arg(long, default_value = "1h")]
    ttl: String,
    /// A name shown by `kura cache list` and `GET /v1/caches`.
    #[arg(long)]
    display_name: Option<String>,
    /// Every flag of `kura serve` that shapes the KV (model, --kv-dtype, --weights-dtype, --block-size,
    /// the disk tier); with one --api-key, the context belongs to that key's tenant.
    #[command(flatten)]
    serve: ServeArgs,
}

pub fn run(args: CacheArgs) -> Result<()> {
    match args.command {
        CacheCommand::Build(b) => build(*b),
        CacheCommand::List { kv_disk_path, json } => {
            let store = open(&kv_disk_path)?;
            let contexts = store.all();
            if json {
                for c in &contexts {
                    let mut v = c.to_json();
                    v["tenant"] = serde_json::json!(c.tenant);
                    println!("{v}");
                }
            } else {
                println!(
                    "{:<28}  {:>8}  {:>20}  {:>20}  name",
                    "id", "tokens", "created (unix s)", "expires (unix s)"
                );
                for c in &contexts {
                    println!(
                        "{:<28}  {:>8}  {:>20}  {:>20}  {}",
                        c.id,
                        c.tokens.len(),
                        c.created_at_ms / 1000,
                        c.expires_at_ms / 1000,
                        c.display_name.as_deref().unwrap_or("")
                    );
                }
            }
            Ok(())
        }
        CacheCommand::Rm { kv_disk_path, ids } => {
            let store = open(&kv_disk_path)?;
            let mut missing = Vec::new();
            for id in &ids {
                match store.delete_any(id) {
                    Ok(Some(changed)) => {
                        println!("deleted {id}");
                        if let Some(e) = changed.not_durable {
                            eprintln!("warning: {id}: {e}");
                        }
                    }
                    Ok(None) => missing.push(id.as_str()),
                    Err(e) => bail!("{id}: {e}"),
                }
            }
            if !missing.is_empty() {
                bail!(
                    "no saved context {} in {}",
                    missing.join(", "),
                    kv_disk_path.display()
                );
            }
            Ok(())
        }
    }
}

fn open(dir: &std::path::Path) -> Result<ContextStore> {
    if !dir.is_dir() {
        bail!(
            "--kv-disk-path {} is not a directory (no disk tier there)",
            dir.display()
        );
    }
    let (store, warnings) = ContextStore::open(dir).map_err(anyhow::Error::msg)?;
    for w in warnings {
        eprintln!("warning: {w}");
    }
    Ok(store)
}

/// The most bytes `cache build` reads from `--file` or `--messages-json`: far more text than any
/// model's context holds (the build refuses what does not fit, after tokenizing).
const BUILD_FILE_MAX_BYTES: u64 = 256 << 20;

/// The context a build saves, read from its file.
fn read_kind(b: &BuildArgs) -> Result<ContextKind> {
    match (&b.file, &b.messages_json) {
        (Some(f), None) => {
            let text = kura_files::read_arg_text(f, BUILD_FILE_MAX_BYTES)
                .with_context(|| format!("reading --file {}", f.display()))?;
            if text.is_empty() {
                bail!("--file {} is empty: there is nothing to save", f.display());
            }
            Ok(ContextKind::Prompt { text })
        }
        (None, Some(f)) => {
            let bytes = kura_files::read_arg(f, BUILD_FILE_MAX_BYTES)
                .with_context(|| format!("reading --messages-json {}", f.display()))?;
            let messages: Vec<ChatMessage> = serde_json::from_slice(&bytes).with_context(|| {
                format!(
                    "--messages-json {}: expected an array of {{\"role\", \"content\"}} objects",
                    f.display()
                )
            })?;
            if messages.is_empty() {
                bail!("--messages-json {} holds no message", f.display());
            }
            for (i, m) in messages.iter().enumerate() {
                if !["system", "user", "assistant"].contains(&m.role.as_str()) {
                    bail!(
                        "--messages-json {}: message {i} has role {:?}; give system, user or assistant",
                        f.display(),
                        m.role
                    );
                }
            }
            Ok(ContextKind::Messages { messages })
        }
        _ => bail!("give the document to save: --file (text) or --messages-json (chat messages)"),
    }
}

/// How often `build` updates its progress bar while the context is computed.
const PROGRESS_TICK: Duration = Duration::from_millis(100);
/// Longest wait for the engine's next event on the context's request.
const EVENT_WAIT: Duration = Duration::from_secs(3600);

fn build(b: BuildArgs) -> Result<()> {
    let Some(dir) = b.serve.tiers.kv_disk_path.clone() else {
        bail!("kura cache build needs --kv-disk-path: saved contexts live in the disk tier");
    };
    let kind = read_kind(&b)?;
    let ttl_s = parse_context_ttl(&match b.ttl.parse::<u64>() {
        Ok(n) => serde_json::json!(n),
        Err(_) => serde_json::json!(b.ttl),
    })
    .map_err(|e| anyhow::anyhow!("--ttl: {e}"))?;
    let owner_key = match &b.serve.api_keys()?[..] {
        [] => None,
        [key] => Some(key.clone()),
        _ => bail!(
            "give at most one API key (--api-key or a line of --api-key-file): the context belongs \
             to that key's tenant"
        ),
    };
    if let Some(name) = &b.display_name {
        if name.len() > 128 {
            bail!("--display-name is longer than 128 bytes");
        }
    }
    let started = Instant::now();
    let fleet_secret = b.serve.fleet_secret()?;
    let engine = crate::serve::start(&b.serve, fleet_secret.as_ref())?;
    // After `start`, which checks the disk tier's flags before anything is written there.
    let tenant = match owner_key.map(|key| {
        crate::serve::tenant_namer(&b.serve, fleet_secret.as_ref())
            .map(|t| t.tenant_of_key(&key).to_string())
    }) {
        None => None,
        Some(Ok(t)) => Some(t),
        Some(Err(e)) => {
            engine.stop();
            return Err(e);
        }
    };
    let info = engine.info().clone();
    let tokens =
        context_tokens(engine.codec().as_ref(), &kind).map_err(|e| anyhow::anyhow!("{e}"))?;
    if tokens.len() >= info.max_model_len {
        engine.stop();
        bail!(
            "the document is {} tokens; the model's context is {} tokens and requests need room after it",
            tokens.len(),
            info.max_model_len
        );
    }
    let now = engine.cache_now_ms();
    let context = SavedContext::new(
        &info,
        tenant,
        b.display_name.clone(),
        kind,
        tokens,
        now,
        ttl_s,
    );
    let request = context.build_request();
    let (tx, rx) = mpsc::channel();
    // Progress (drawn only on a terminal): the prompt tokens this engine computed, which is the whole
    // document unless part of it was cached already.
    let total = context.tokens.len() as u64;
    let computed_before = engine.metrics().prompt_tokens_computed.get();
    let guard = engine
        .submit(request, move |e: EngineEvent| tx.send(e).is_ok())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let bar = crate::progress::bar(total, "prefill", "tokens");
    // An hour without an event from the engine is an error, as before; the bar is updated meanwhile.
    let mut deadline = Instant::now() + EVENT_WAIT;
    let outcome = loop {
        match rx.recv_timeout(PROGRESS_TICK) {
            Ok(EngineEvent::Done { usage }) => break Ok(usage),
            Ok(EngineEvent::Failed(e)) => break Err(anyhow::anyhow!("computing the context: {e}")),
            Ok(_) => deadline = Instant::now() + EVENT_WAIT,
            Err(RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
            Err(e) => break Err(anyhow::anyhow!("computing the context: {e}")),
        }
        let computed = engine
            .metrics()
            .prompt_tokens_computed
            .get()
            .saturating_sub(computed_before);
        bar.set_position(computed.min(total));
    };
    if outcome.is_ok() {
        bar.set_position(total);
    }
    bar.finish_and_clear();
    drop(guard);
    // A clean stop writes every cached block to the disk tier.
    let writing = crate::progress::spinner("writing the context's blocks to the disk tier");
    engine.stop();
    writing.finish_and_clear();
    let usage = outcome?;
    let store = open(&dir)?;
    store
        .insert(context.clone(), usize::MAX)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    tracing::info!(
        id = %context.id,
        tokens = context.tokens.len(),
        computed = usage.prompt_tokens.saturating_sub(usage.cached_tokens),
        seconds = started.elapsed().as_secs_f64(),
        "saved context built"
    );
    println!("{}", context.id);
    Ok(())
}
