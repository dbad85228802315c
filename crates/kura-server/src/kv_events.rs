//! `GET /v1/kv/snapshot` and `GET /v1/kv/events`: the pool's content for a router (`kura serve
//! --kv-events`), for the operator key only (tenant keys get 403), at most `TenantQuotas::event_streams`
//! streams at once.
//!
//! The stream is SSE. Its first event (`event: snapshot`) lists every cached block and the sequence
//! number it is current at; then each change comes as `event: kv` with the next number. A stream that
//! falls behind the engine's ring by more than `--kv-events-buffer` events gets `event: gap` and ends: the
//! reader reconnects and starts again from a new snapshot. A reader that sees a number skipped (it
//! should never, within one stream) does the same. Blocks are named by keyed content names (hexadecimal;
//! see `kura_engine::KvEventLog`): a reader with the fleet secret names a request's blocks the same way,
//! and nothing in a stream reveals a token or a tenant. `tokens` appear only under
//! `--kv-events-tokens`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::stream::{self, Stream, StreamExt};
use kura_engine::{KvBlockInfo, KvChange, KvEventLog, KvEventRecord};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::AppState;

/// How often a stream looks for new events.
const POLL: Duration = Duration::from_millis(20);
/// Most events one SSE message carries.
const BATCH: usize = kura_api::routing::KV_EVENTS_BATCH;
/// The only tier whose content is announced: the pool that attention reads.
const TIER: &str = "pool";

fn hex(h: u128) -> String {
    format!("{h:032x}")
}

fn block_json(b: &KvBlockInfo) -> Value {
    let mut v = json!({"name": hex(b.name)});
    if let Some(tokens) = &b.tokens {
        v["tokens"] = json!(tokens);
    }
    v
}

fn event_json(e: &KvEventRecord) -> Value {
    match &e.change {
        KvChange::Stored(b) => {
            let mut v = block_json(b);
            v["seq"] = json!(e.seq);
            v["type"] = json!("stored");
            v["tier"] = json!(TIER);
            v
        }
        KvChange::Removed { name } => {
            json!({"seq": e.seq, "type": "removed", "name": hex(*name), "tier": TIER})
        }
        KvChange::Cleared => json!({"seq": e.seq, "type": "cleared", "tier": TIER}),
    }
}

fn events_log(s: &AppState) -> Result<Arc<KvEventLog>, ApiError> {
    s.engine.kv_events().cloned().ok_or_else(|| {
        ApiError::NotFound(
            "/v1/kv: this server does not publish KV events (start it with --kv-events)".into(),
        )
    })
}

/// What a reader needs besides the blocks: who this is and how blocks are named.
fn snapshot_json(s: &AppState, log: &KvEventLog) -> (u64, Value) {
    let snap = log.snapshot();
    let info = s.engine.info();
    let blocks: Vec<Value> = snap.blocks.iter().map(|b| block_json(b)).collect();
    let body = json!({
        "object": "kv.snapshot",
        "instance": &*s.instance,
        "seq": snap.seq,
        "block_size": info.block_size_tokens,
        "model": info.model_name,
        "model_fingerprint": info.model_fingerprint,
        "tenants": !s.api_keys.is_empty(),
        "tier": TIER,
        "blocks": blocks,
    });
    (snap.seq, body)
}

pub async fn snapshot(State(s): State<AppState>) -> Result<Json<Value>, ApiError> {
    let log = events_log(&s)?;
    Ok(Json(snapshot_json(&s, &log).1))
}

enum Phase {
    Start,
    After(u64),
    Done,
}

/// One open event stream, counted until it ends.
struct StreamSlot(Arc<AtomicUsize>);

impl StreamSlot {
    fn take(open: &Arc<AtomicUsize>, max: usize) -> Option<Self> {
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()
        .map(|_| Self(open.clone()))
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

pub async fn events(State(s): State<AppState>) -> Result<Response, ApiError> {
    let log = events_log(&s)?;
    let max = s.quotas.event_streams;
    let Some(slot) = StreamSlot::take(&s.event_streams, max) else {
        return Err(ApiError::QuotaExceeded {
            message: format!(
                "{max} KV event streams are open, the limit (--max-kv-event-streams); close one first"
            ),
            code: "too_many_streams",
        });
    };
    let body = event_stream(s, log).map(move |e| {
        let _held = &slot;
        e
    });
    Ok(Sse::new(body)
        .keep_alive(KeepAlive::default())
        .into_response())
}

fn event_stream(
    s: AppState,
    log: Arc<KvEventLog>,
) -> impl Stream<Item = Result<Event, Infallible>> {
    stream::unfold(Phase::Start, move |phase| {
        let (s, log) = (s.clone(), log.clone());
        async move {
            match phase {
                Phase::Start => {
                    let (seq, body) = snapshot_json(&s, &log);
                    let event = Event::default().event("snapshot").data(body.to_string());
                    Some((Ok(event), Phase::After(seq)))
                }
                Phase::After(after) => loop {
                    // A draining server ends its streams, so that shutdown does not wait on them.
                    if s.engine.is_shutting_down() || !s.engine.is_alive() {
                        return None;
                    }
                    match log.since(after, BATCH) {
                        Ok(events) if events.is_empty() => tokio::time::sleep(POLL).await,
                        Ok(events) => {
                            let last = events.last().map_or(after, |e| e.seq);
                            let data: Vec<Value> = events.iter().map(event_json).collect();
                            let event = Event::default()
                                .event("kv")
                                .data(Value::Array(data).to_string());
                            return Some((Ok(event), Phase::After(last)));
                        }
                        Err(gap) => {
                            tracing::warn!(
                                wanted = gap.wanted,
                                oldest = gap.oldest,
                                "a KV event stream fell behind the ring: telling it to resynchronize"
                            );
                            let data = json!({"wanted": gap.wanted, "oldest": gap.oldest});
                            let event = Event::default().event("gap").data(data.to_string());
                            return Some((Ok(event), Phase::Done));
                        }
                    }
                },
                Phase::Done => None,
            }
        }
    })
}
