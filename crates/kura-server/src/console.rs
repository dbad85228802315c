//! `kura serve --console`: a page at `/console` that shows the KV cache live, beside a chat playground,
//! and the operator summary behind it (`GET /v1/kv/summary`).
//!
//! The page is three static files compiled into the binary (no library, nothing fetched from elsewhere);
//! it polls the summary twice a second and computes rates and ratios from successive summaries. The
//! summary holds counts, the largest cached prefixes and the saved contexts: no token, no text, and no
//! tenant's key or salt, only an opaque label per tenant ([`kura_engine::KvInspect`]).
//!
//! Who sees it: with operator keys, the operator key only (a tenant key gets 403, no key 401); with API
//! keys but no operator key, nobody (the routes are not there); with no keys at all, anyone who reaches
//! the server (by default the console is on only when it listens on loopback).

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::AppState;

const INDEX: &str = include_str!("../console/index.html");
const SCRIPT: &str = include_str!("../console/console.js");
const STYLE: &str = include_str!("../console/console.css");

/// The largest cached prefixes the summary lists.
const TOP_PREFIXES: usize = 20;
/// A view of the pool younger than this is served at once (the page polls twice a second: each poll
/// asks for the view the next one gets).
const INSPECT_FRESH: Duration = Duration::from_secs(2);
/// Longest the summary waits for a younger view (the engine takes it after its current step).
const INSPECT_WAIT: Duration = Duration::from_millis(250);

/// The summary's clock (`time_ms`, for rates): the first summary's time.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

pub async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX)
}

pub async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

pub async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}

/// `GET /v1/kv/summary`: the pool, the lower tiers, the counters the page turns into rates, the
/// requests, the largest cached prefixes, the pins and the saved contexts. The values are those
/// `/metrics` shows at the same moment.
pub async fn summary(State(s): State<AppState>) -> Result<Json<Value>, ApiError> {
    let engine = s.engine.clone();
    let view = tokio::task::spawn_blocking(move || {
        engine.inspect(TOP_PREFIXES, INSPECT_FRESH, INSPECT_WAIT)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("the summary task failed: {e}")))?;
    let m = s.engine.metrics();
    let info = s.engine.info();
    let total = m.kv_blocks_total.get();
    let used = m.kv_blocks_used.get();
    let cached = m.kv_blocks_cached.get();
    let mut tiers = Vec::new();
    for (name, t) in m.tiers() {
        if t.blocks_total.get() > 0.0 {
            tiers.push(json!({
                "name": name,
                "blocks_total": t.blocks_total.get(),
                "blocks_used": t.blocks_used.get(),
                "bytes_used": t.bytes_used.get(),
                "hit_blocks": t.hit_blocks.get(),
                "loads": t.loads.get(),
                "stores": t.stores.get(),
                "evictions": t.evictions.get(),
            }));
        }
    }
    let misses: serde_json::Map<String, Value> = kura_engine::MissReason::ALL
        .iter()
        .zip(&m.cache_misses)
        .map(|(r, c)| (r.as_str().to_string(), json!(c.get())))
        .collect();
    let ttft = m.ttft.snapshot();
    let itl = m.itl.snapshot();
    let bs = info.block_size_tokens;
    let now_ms = s.engine.cache_now_ms();
    let prefixes: Vec<Value> = view
        .iter()
        .flat_map(|v| &v.prefixes)
        .map(|p| {
            json!({
                "blocks": p.blocks,
                "tokens": p.blocks * bs,
                "leaf_hits": p.leaf_hits,
                "root_hits": p.root_hits,
                "in_use": p.idle_seconds.is_none(),
                "idle_seconds": p.idle_seconds,
                "tier": "pool",
                "pinned_blocks": p.pinned_blocks,
                "used_blocks": p.used_blocks,
                "tenant": p.tenant,
            })
        })
        .collect();
    let contexts: Vec<Value> = s
        .contexts
        .all()
        .iter()
        .filter(|c| c.expires_at_ms > now_ms)
        .map(|c| {
            json!({
                "id": c.id.chars().take(12).collect::<String>(),
                "tokens": c.tokens.len(),
                "expires_in_seconds": (c.expires_at_ms - now_ms) as f64 / 1000.0,
                "tenant": s.engine.tenant_label(c.tenant.as_deref()),
            })
        })
        .collect();
    Ok(Json(json!({
        "model": info.model_name,
        "time_ms": u64::try_from(epoch().elapsed().as_millis()).unwrap_or(u64::MAX),
        "block_size": bs,
        "pool": {
            "blocks_total": total,
            "blocks_used": used,
            "blocks_cached": cached,
            "blocks_free": (total - used - cached).max(0.0),
            "blocks_reserved": m.kv_reserved_blocks.get(),
            "blocks_pinned": m.pinned_blocks.get(),
            "usage": m.kv_usage_perc.get(),
        },
        "tiers": tiers,
        "counters": {
            "prefix_query_tokens": m.prefix_queries_tokens.get(),
            "prefix_hit_tokens": m.prefix_hits_tokens.get(),
            "evictions": m.kv_evictions.get(),
            "prompt_tokens": m.prompt_tokens.get(),
            "prompt_tokens_computed": m.prompt_tokens_computed.get(),
            "generation_tokens": m.generation_tokens.get(),
            "requests_finished": m.requests_finished_stop.get() + m.requests_finished_length.get(),
            "preemptions": m.preemptions.get(),
            "steps": m.steps.get(),
            "ttft_seconds_sum": ttft.sum_s,
            "ttft_count": ttft.count,
            "itl_seconds_sum": itl.sum_s,
            "itl_count": itl.count,
            "misses": misses,
        },
        "requests": {
            "running": m.requests_running.get(),
            "waiting": m.requests_waiting.get(),
            "preempted_waiting": m.requests_preempted_waiting.get(),
        },
        "prefixes": {
            "total": view.as_ref().map(|v| v.total_prefixes),
            "age_ms": view.as_ref().map(|v| v.taken_at.elapsed().as_millis() as u64),
            "top": prefixes,
        },
        "pins": {
            "count": m.pins.get(),
            "blocks": m.pinned_blocks.get(),
            "budget_blocks": m.pin_budget_blocks.get(),
            "demoted": m.pins_demoted.get(),
            "expired": m.pins_expired.get(),
        },
        "contexts": contexts,
    })))
}
