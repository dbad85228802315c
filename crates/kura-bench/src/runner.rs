//! Applying a load shape to a workload and collecting every request's figures.
//!
//! Sessions (one per conversation, one per single request) are tasks; a session sends its turns one after
//! another. The load shape decides when sessions start and how many requests may be in flight:
//!
//! ```text
//! concurrency N   all sessions queue on an N-permit semaphore (FIFO), a permit per request
//! rate R          session i starts at the i-th arrival of a seeded Poisson process of rate R (open loop)
//! burst           each shared-prefix group starts at one instant; the next group when it has finished
//! trace           session i starts at its trace arrival time (times the time scale)
//! ```
//!
//! Records are pushed into a mutex-guarded vector that is never held across an `.await`.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::Semaphore;

use crate::client::{
    discover_model, preflight, stream_completion, Endpoint, Message, RemoteTokenizer,
};
use crate::report::{BenchRun, LoadShape, PointResult, RequestRecord};
use crate::rng::Rng;
use crate::stats::Summary;
use crate::text::TokenCounter;
use crate::workload::{build, Session, Workload, WorkloadSpec};
use crate::BenchError;

/// The seeded stream of Poisson arrival gaps (apart from every text stream of `workload`).
const ARRIVALS_STREAM: u64 = 0xA2;

/// A load the user asked for; each is one point of the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    Concurrency(usize),
    Rate(f64),
}

#[derive(Debug, Clone)]
pub struct RunConfig {
    pub endpoint: Endpoint,
    pub label: String,
    pub spec: WorkloadSpec,
    pub output_tokens: u32,
    pub seed: u64,
    /// Points of the run, in order. Ignored by trace replays and bursts, which carry their own timing.
    pub loads: Vec<Load>,
    /// Draw a progress line on stderr (when it is a terminal) and print warnings.
    pub progress: bool,
}

/// Runs every point of `cfg` and returns what was measured. Fails only before any request is measured
/// (an unreachable server, a bad trace, a bad setting); failed requests are counted, not raised.
pub async fn run(mut cfg: RunConfig) -> Result<BenchRun, BenchError> {
    for load in &cfg.loads {
        match load {
            Load::Concurrency(0) => {
                return Err(BenchError::Config("concurrency must be at least 1".into()))
            }
            // At least one a day: a slower rate is a mistake (1e-300 is a wait of 10^292 years).
            Load::Rate(r) if !(r.is_finite() && *r >= 1.0 / 86_400.0) => {
                return Err(BenchError::Config(format!(
                    "request rate must be at least 1/86400 (one request a day), got {r:?}"
                )))
            }
            _ => {}
        }
    }
    cfg.spec.validate()?;
    // A fresh connection per request: a pooled keep-alive connection that the server closed while idle
    // (llama.cpp's closes after 5 s) fails the next request sent on it, which is the client's fault,
    // not the server's. On loopback a connect costs well under a millisecond of the TTFT.
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .connect_timeout(Duration::from_secs(10))
        .tcp_nodelay(true)
        .build()
        .map_err(|e| BenchError::Config(format!("HTTP client: {e}")))?;
    cfg.endpoint.base_url = Endpoint::normalize_base(&cfg.endpoint.base_url);
    if cfg.endpoint.model.is_empty() {
        cfg.endpoint.model = discover_model(&http, &cfg.endpoint)
            .await?
            .unwrap_or_else(|| "default".to_string());
    }
    let say = |msg: String| {
        if cfg.progress {
            eprintln!("{msg}");
        }
    };
    let mut notes = Vec::new();
    if let Some(warning) = preflight(&http, &cfg.endpoint).await? {
        say(format!("warning: {warning}"));
        notes.push(warning);
    }
    let counter = match RemoteTokenizer::probe(&http, &cfg.endpoint).await {
        Ok(tok) => TokenCounter::Server(tok),
        Err(why) => {
            say(format!(
                "note: the server's POST /tokenize counted no tokens ({why}); prompt lengths are \
                 approximate"
            ));
            TokenCounter::Approximate
        }
    };
    let fixed_timing = matches!(cfg.spec, WorkloadSpec::Trace { .. })
        || matches!(cfg.spec, WorkloadSpec::SharedPrefix { burst: true, .. });
    let loads: Vec<Option<Load>> = if fixed_timing || cfg.loads.is_empty() {
        vec![cfg.loads.first().copied().filter(|_| !fixed_timing)]
    } else {
        cfg.loads.iter().copied().map(Some).collect()
    };
    let started_unix_s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut points = Vec::new();
    let mut workload_meta = None;
    for (k, load) in loads.iter().enumerate() {
        // Each point of a sweep gets its own prompts (seed + k) so that it does not hit the cache
        // the previous point filled.
        say(format!(
            "building {} prompts (point {} of {})…",
            cfg.spec.name(),
            k + 1,
            loads.len()
        ));
        let workload = build(
            &cfg.spec,
            cfg.output_tokens,
            cfg.seed.wrapping_add(k as u64),
            &counter,
        )
        .await?;
        let shape = shape_of(&workload, &cfg.spec, *load);
        let point = run_point(
            &http,
            &cfg.endpoint,
            &workload,
            shape,
            cfg.seed,
            &cfg.label,
            cfg.progress,
        )
        .await;
        workload_meta.get_or_insert((
            workload.params.clone(),
            workload.counting,
            workload.notes.clone(),
        ));
        points.push(point);
    }
    let (mut params, token_counting, wl_notes) =
        workload_meta.ok_or_else(|| BenchError::Config("no load point to run".into()))?;
    // How the requests sampled, beside what they asked (a sampled run costs a server more per token).
    if let Some(obj) = params.as_object_mut() {
        obj.insert(
            "temperature".into(),
            serde_json::json!(cfg.endpoint.temperature),
        );
    }
    notes.extend(wl_notes);
    Ok(BenchRun {
        kura_bench_version: env!("CARGO_PKG_VERSION").to_string(),
        label: cfg.label,
        url: cfg.endpoint.base_url,
        model: cfg.endpoint.model,
        api: cfg.endpoint.api,
        workload: cfg.spec.name().to_string(),
        params,
        token_counting,
        notes,
        started_unix_s,
        points,
    })
}

fn shape_of(workload: &Workload, spec: &WorkloadSpec, load: Option<Load>) -> LoadShape {
    if let WorkloadSpec::Trace { time_scale, .. } = spec {
        return LoadShape::Trace {
            time_scale: *time_scale,
        };
    }
    if workload.burst {
        let group_size = match spec {
            WorkloadSpec::SharedPrefix {
                users_per_group, ..
            } => *users_per_group,
            _ => 1,
        };
        return LoadShape::Burst { group_size };
    }
    match load {
        Some(Load::Rate(rate)) => LoadShape::Rate { rate },
        Some(Load::Concurrency(concurrency)) => LoadShape::Concurrency { concurrency },
        None => LoadShape::Concurrency { concurrency: 1 },
    }
}

struct Progress {
    total: usize,
    done: AtomicUsize,
    failed: AtomicUsize,
}

struct PointCtx {
    http: reqwest::Client,
    endpoint: Endpoint,
    t0: Instant,
    records: Mutex<Vec<RequestRecord>>,
    progress: Progress,
}

async fn run_session(
    ctx: Arc<PointCtx>,
    session: Session,
    first_id: usize,
    delay: Option<Duration>,
    limit: Option<Arc<Semaphore>>,
) {
    if let Some(delay) = delay {
        tokio::time::sleep_until((ctx.t0 + delay).into()).await;
    }
    let mut history: Vec<Message> = Vec::new();
    if let Some(system) = &session.system {
        history.push(Message {
            role: "system",
            content: system.text.clone(),
        });
    }
    for (t, turn) in session.turns.iter().enumerate() {
        let _permit = match &limit {
            Some(sem) => match sem.clone().acquire_owned().await {
                Ok(p) => Some(p),
                Err(_) => return,
            },
            None => None,
        };
        history.push(Message {
            role: "user",
            content: turn.user.text.clone(),
        });
        let start_ms = ctx.t0.elapsed().as_secs_f64() * 1e3;
        let out = stream_completion(&ctx.http, &ctx.endpoint, &history, turn.max_tokens).await;
        let failed = out.error.is_some();
        let record = RequestRecord {
            id: first_id + t,
            session: session.id,
            turn: t,
            group: session.group,
            start_ms,
            prompt_tokens_sent: (turn.user.tokens + session.system.as_ref().map_or(0, |s| s.tokens))
                as u64,
            prompt_tokens: out.usage.and_then(|u| u.prompt_tokens),
            cached_tokens: out.usage.and_then(|u| u.cached_tokens),
            output_tokens: out.output_tokens,
            ttft_ms: out.ttft_ms,
            e2e_ms: out.e2e_ms,
            itl_ms: out.itl_ms,
            error: out.error,
        };
        ctx.records
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(record);
        ctx.progress.done.fetch_add(1, Ordering::Relaxed);
        if failed {
            ctx.progress.failed.fetch_add(1, Ordering::Relaxed);
            // The rest of the conversation would resend a history the server never completed.
            return;
        }
        history.push(Message {
            role: "assistant",
            content: out.text,
        });
    }
}

/// A request's delay from the start of its point, saturated where a `Duration` cannot hold it (never,
/// with the rates and trace spans [`run`] and the trace reader accept).
fn after_s(s: f64) -> Duration {
    Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX)
}

async fn run_point(
    http: &reqwest::Client,
    endpoint: &Endpoint,
    workload: &Workload,
    shape: LoadShape,
    seed: u64,
    label: &str,
    show_progress: bool,
) -> PointResult {
    let planned = workload.requests();
    let ctx = Arc::new(PointCtx {
        http: http.clone(),
        endpoint: endpoint.clone(),
        t0: Instant::now(),
        records: Mutex::new(Vec::with_capacity(planned)),
        progress: Progress {
            total: planned,
            done: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
        },
    });
    // On a terminal a progress bar redrawn in place; elsewhere (logs, CI) a line every 10 s.
    let tty = std::io::stderr().is_terminal();
    let title = format!("{label} {} {}", workload.name, shape.describe());
    let ticker = show_progress.then(|| {
        let ctx = ctx.clone();
        let title = title.clone();
        tokio::spawn(async move {
            let period = Duration::from_millis(if tty { 200 } else { 10_000 });
            loop {
                tokio::time::sleep(period).await;
                draw_progress(&title, &ctx, tty);
            }
        })
    });
    let mut first_ids = Vec::with_capacity(workload.sessions.len());
    let mut next = 0;
    for s in &workload.sessions {
        first_ids.push(next);
        next += s.turns.len();
    }
    let sessions: Vec<(Session, usize)> =
        workload.sessions.iter().cloned().zip(first_ids).collect();
    match shape {
        LoadShape::Burst { .. } => {
            let mut groups: Vec<Vec<(Session, usize)>> = Vec::new();
            for (s, id) in sessions {
                match groups.last_mut() {
                    Some(g) if g[0].0.group == s.group => g.push((s, id)),
                    _ => groups.push(vec![(s, id)]),
                }
            }
            for group in groups {
                let tasks: Vec<_> = group
                    .into_iter()
                    .map(|(s, id)| tokio::spawn(run_session(ctx.clone(), s, id, None, None)))
                    .collect();
                for t in tasks {
                    let _ = t.await;
                }
            }
        }
        _ => {
            let limit = match shape {
                LoadShape::Concurrency { concurrency } => {
                    Some(Arc::new(Semaphore::new(concurrency)))
                }
                _ => None,
            };
            let mut arrivals = Rng::stream(seed, &[ARRIVALS_STREAM]);
            let mut at_s = 0.0;
            let tasks: Vec<_> = sessions
                .into_iter()
                .map(|(s, id)| {
                    let delay = match shape {
                        LoadShape::Rate { rate } => {
                            let d = after_s(at_s);
                            at_s += arrivals.exponential(rate);
                            Some(d)
                        }
                        LoadShape::Trace { .. } => s.arrival_ms.map(|ms| after_s(ms / 1e3)),
                        _ => None,
                    };
                    tokio::spawn(run_session(ctx.clone(), s, id, delay, limit.clone()))
                })
                .collect();
            for t in tasks {
                let _ = t.await;
            }
        }
    }
    if let Some(t) = ticker {
        t.abort();
        draw_progress(&title, &ctx, tty);
        if tty {
            eprintln!();
        }
    }
    let mut requests = std::mem::take(&mut *ctx.records.lock().unwrap_or_else(|p| p.into_inner()));
    requests.sort_by_key(|r| r.id);
    PointResult {
        load: shape,
        planned,
        summary: Summary::of(&requests),
        requests,
    }
}

fn draw_progress(title: &str, ctx: &PointCtx, tty: bool) {
    let p = &ctx.progress;
    let done = p.done.load(Ordering::Relaxed);
    let failed = p.failed.load(Ordering::Relaxed);
    const WIDTH: usize = 30;
    let filled = (done * WIDTH)
        .checked_div(p.total)
        .unwrap_or(WIDTH)
        .min(WIDTH);
    let line = format!(
        "{title} [{}{}] {done}/{} done, {failed} failed, {:.1} s",
        "#".repeat(filled),
        ".".repeat(WIDTH - filled),
        p.total,
        ctx.t0.elapsed().as_secs_f64()
    );
    let mut err = std::io::stderr().lock();
    let _ = if tty {
        write!(err, "\r{line} ")
    } else {
        writeln!(err, "{line}")
    };
    let _ = err.flush();
}
