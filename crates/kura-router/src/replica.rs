//! One replica as the router sees it: health, load, and the follower of its KV events.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kura_bench::sse::{SseDecoder, SseEvent};
use serde_json::Value;

use crate::index::{AnnouncedBlock, Change};
use crate::{lock, Fleet};

/// Consecutive failed health checks after which a replica is down.
const DOWN_AFTER: u32 = 2;
/// Longest wait for a health or metrics answer.
const CHECK_TIMEOUT: Duration = Duration::from_millis(500);

/// What a replica's KV snapshot says about how it names blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ReplicaInfo {
    pub model: String,
    pub model_fingerprint: String,
    pub block_size: usize,
    /// Whether the replica has API keys (each key its own tenant, salting its blocks).
    pub tenants: bool,
}

pub(crate) struct Replica {
    pub url: String,
    up: AtomicBool,
    failed_checks: AtomicU32,
    pub in_flight: AtomicU64,
    pub work_blocks: AtomicU64,
    pub reported_load: AtomicU64,
    pub info: Mutex<Option<ReplicaInfo>>,
    pub requests: AtomicU64,
    pub failures: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub predicted_cached: AtomicU64,
    pub reported_cached: AtomicU64,
    pub snapshots: AtomicU64,
    pub gaps: AtomicU64,
}

impl Replica {
    pub fn new(url: String) -> Self {
        Self {
            url,
            // Up until a check says otherwise, so that the first requests need not wait for one.
            up: AtomicBool::new(true),
            failed_checks: AtomicU32::new(0),
            in_flight: AtomicU64::new(0),
            work_blocks: AtomicU64::new(0),
            reported_load: AtomicU64::new(0),
            info: Mutex::new(None),
            requests: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            predicted_cached: AtomicU64::new(0),
            reported_cached: AtomicU64::new(0),
            snapshots: AtomicU64::new(0),
            gaps: AtomicU64::new(0),
        }
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }
}

impl Fleet {
    /// Marks replica `r` down at once (a refused connection): no new requests go to it and its blocks
    /// are forgotten until it is back and has sent a new snapshot.
    pub(crate) fn mark_down(&self, r: usize, why: &str) {
        let rep = &self.replicas[r];
        rep.failed_checks.store(DOWN_AFTER, Ordering::Relaxed);
        if rep.up.swap(false, Ordering::AcqRel) {
            tracing::warn!(replica = %rep.url, reason = why, "replica down: draining it");
        }
        lock(&self.index).forget(r);
    }

    fn check_passed(&self, r: usize) {
        let rep = &self.replicas[r];
        rep.failed_checks.store(0, Ordering::Relaxed);
        if !rep.up.swap(true, Ordering::AcqRel) {
            tracing::info!(replica = %rep.url, "replica up again");
        }
    }

    fn check_failed(&self, r: usize, why: &str) {
        let rep = &self.replicas[r];
        let failed = rep.failed_checks.fetch_add(1, Ordering::Relaxed) + 1;
        if failed >= DOWN_AFTER {
            self.mark_down(r, why);
        }
    }
}

/// The number after `name` at the start of a Prometheus line (`name 3` or `name{..} 3`).
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let rest = rest.strip_prefix(' ').or_else(|| {
            let end = rest.strip_prefix('{')?.find('}')?;
            rest.get(end + 2..)?.strip_prefix(' ')
        })?;
        rest.trim().parse().ok()
    })
}

/// Checks replica `r`'s `/health` every interval, and reads its load from `/metrics` while it is up.
pub(crate) async fn check_health(fleet: Arc<Fleet>, r: usize) {
    let url = fleet.replicas[r].url.clone();
    let mut tick = tokio::time::interval(fleet.config.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let health = fleet
            .client
            .get(format!("{url}/health"))
            .timeout(CHECK_TIMEOUT)
            .send()
            .await;
        match health {
            Ok(resp) if resp.status().is_success() => fleet.check_passed(r),
            Ok(resp) => fleet.check_failed(r, &format!("/health answered {}", resp.status())),
            Err(e) => fleet.check_failed(r, &format!("/health failed: {e}")),
        }
        if !fleet.replicas[r].is_up() {
            continue;
        }
        let metrics = fleet
            .client
            .get(format!("{url}/metrics"))
            .timeout(CHECK_TIMEOUT)
            .send()
            .await;
        if let Ok(resp) = metrics {
            if let Ok(text) = resp.text().await {
                let load = ["kura:num_requests_running", "kura:num_requests_waiting"]
                    .iter()
                    .filter_map(|n| metric(&text, n))
                    .sum::<f64>();
                fleet.replicas[r]
                    .reported_load
                    .store(load.max(0.0) as u64, Ordering::Relaxed);
            }
        }
    }
}

fn hex(v: Option<&Value>) -> Result<Option<u128>, String> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => u128::from_str_radix(s, 16)
            .map(Some)
            .map_err(|_| format!("{s:?} is not a hexadecimal hash")),
        Some(other) => Err(format!("{other} is not a hash")),
    }
}

fn block(v: &Value) -> Result<AnnouncedBlock, String> {
    let tokens = v
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or("a block without tokens")?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| format!("token {t} is not a token id"))
        })
        .collect::<Result<_, _>>()?;
    Ok(AnnouncedBlock {
        hash: hex(v.get("hash"))?.ok_or("a block without a hash")?,
        parent: hex(v.get("parent"))?,
        tokens,
        key_digest: hex(v.get("key_digest"))?,
    })
}

fn snapshot(v: &Value) -> Result<(u64, ReplicaInfo, Vec<AnnouncedBlock>), String> {
    let seq = v.get("seq").and_then(Value::as_u64).ok_or("no seq")?;
    let text = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
    let info = ReplicaInfo {
        model: text("model").ok_or("no model")?,
        model_fingerprint: text("model_fingerprint").ok_or("no model_fingerprint")?,
        block_size: v
            .get("block_size")
            .and_then(Value::as_u64)
            .filter(|&b| b > 0)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or("no block_size")?,
        tenants: v.get("tenants").and_then(Value::as_bool).unwrap_or(false),
    };
    let blocks = v
        .get("blocks")
        .and_then(Value::as_array)
        .ok_or("no blocks")?
        .iter()
        .map(block)
        .collect::<Result<_, _>>()?;
    Ok((seq, info, blocks))
}

fn change(v: &Value) -> Result<(u64, Change), String> {
    let seq = v
        .get("seq")
        .and_then(Value::as_u64)
        .ok_or("an event without seq")?;
    let change = match v.get("type").and_then(Value::as_str) {
        Some("stored") => Change::Stored(block(v)?),
        Some("removed") => Change::Removed {
            hash: hex(v.get("hash"))?.ok_or("a removal without a hash")?,
        },
        Some("cleared") => Change::Cleared,
        other => return Err(format!("unknown event type {other:?}")),
    };
    Ok((seq, change))
}

/// What ended one event stream.
enum StreamEnd {
    /// A gap (announced by the replica or seen here): resynchronize at once.
    Gap,
    /// Closed, refused or broken: try again after a pause.
    Broken(String),
    /// The replica publishes no events.
    NotPublished,
}

/// Applies one SSE event of replica `r`'s stream; `Err` ends the stream.
fn on_event(fleet: &Fleet, r: usize, e: &SseEvent) -> Result<(), StreamEnd> {
    let rep = &fleet.replicas[r];
    let parse = |data: &str| {
        serde_json::from_str::<Value>(data)
            .map_err(|err| StreamEnd::Broken(format!("event data is not JSON: {err}")))
    };
    match e.event.as_deref() {
        Some("snapshot") => {
            let (seq, info, blocks) = snapshot(&parse(&e.data)?)
                .map_err(|m| StreamEnd::Broken(format!("snapshot: {m}")))?;
            let n = blocks.len();
            lock(&fleet.index).reset(r, seq, &blocks);
            *lock(&rep.info) = Some(info);
            rep.snapshots.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(replica = %rep.url, seq, blocks = n, "KV snapshot");
            Ok(())
        }
        Some("kv") => {
            let events = parse(&e.data)?;
            let events = events
                .as_array()
                .ok_or_else(|| StreamEnd::Broken("kv data is not an array".into()))?;
            let mut index = lock(&fleet.index);
            for v in events {
                let (seq, change) = change(v).map_err(StreamEnd::Broken)?;
                if let Err(gap) = index.apply(r, seq, &change) {
                    tracing::warn!(replica = %rep.url, expected = gap.expected, got = gap.got,
                        "KV events out of order: resynchronizing from a snapshot");
                    return Err(StreamEnd::Gap);
                }
            }
            Ok(())
        }
        Some("gap") => {
            tracing::warn!(replica = %rep.url, data = %e.data, "the replica dropped KV events for this stream: resynchronizing");
            Err(StreamEnd::Gap)
        }
        _ => Ok(()),
    }
}

async fn follow_once(fleet: &Fleet, r: usize) -> StreamEnd {
    let rep = &fleet.replicas[r];
    let mut request = fleet.client.get(format!("{}/v1/kv/events", rep.url));
    if let Some(key) = &fleet.config.replica_api_key {
        request = request.bearer_auth(key);
    }
    let resp = match request.send().await {
        Ok(resp) => resp,
        Err(e) => return StreamEnd::Broken(format!("connecting: {e}")),
    };
    match resp.status().as_u16() {
        200 => {}
        404 => return StreamEnd::NotPublished,
        s => return StreamEnd::Broken(format!("/v1/kv/events answered {s}")),
    }
    let mut body = resp.bytes_stream();
    let mut decoder = SseDecoder::new();
    while let Some(chunk) = body.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => return StreamEnd::Broken(format!("reading: {e}")),
        };
        let events = match decoder.feed(&chunk) {
            Ok(events) => events,
            Err(e) => return StreamEnd::Broken(e.to_string()),
        };
        for e in &events {
            if let Err(end) = on_event(fleet, r, e) {
                return end;
            }
        }
        if !rep.is_up() {
            return StreamEnd::Broken("the replica is down".into());
        }
    }
    StreamEnd::Broken("the stream ended".into())
}

/// Follows replica `r`'s KV events for the router's life: a snapshot, then changes; on a gap at once,
/// and on any other end after a pause, it forgets the replica's blocks and starts again.
pub(crate) async fn follow_events(fleet: Arc<Fleet>, r: usize) {
    let mut warned_unpublished = false;
    loop {
        if !fleet.replicas[r].is_up() {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let end = follow_once(&fleet, r).await;
        lock(&fleet.index).forget(r);
        let rep = &fleet.replicas[r];
        match end {
            StreamEnd::Gap => {
                rep.gaps.fetch_add(1, Ordering::Relaxed);
            }
            StreamEnd::NotPublished => {
                if !warned_unpublished {
                    tracing::warn!(replica = %rep.url,
                        "the replica publishes no KV events (start it with --kv-events): routing to it without its cache");
                    warned_unpublished = true;
                }
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            StreamEnd::Broken(why) => {
                tracing::debug!(replica = %rep.url, reason = %why, "KV event stream ended");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_values_are_read_with_or_without_labels() {
        let text = "# HELP kura:num_requests_running x\nkura:num_requests_running 3\n\
                    kura:num_requests_waiting{model=\"m\"} 2\nkura:num_requests_running_total 9\n";
        assert_eq!(metric(text, "kura:num_requests_running"), Some(3.0));
        assert_eq!(metric(text, "kura:num_requests_waiting"), Some(2.0));
        assert_eq!(metric(text, "kura:missing"), None);
    }

    #[test]
    fn events_parse_and_bad_ones_name_the_problem() {
        let v: Value = serde_json::from_str(
            r#"{"seq":4,"type":"stored","hash":"0a","parent":null,"tokens":[1,2],"key_digest":"ff"}"#,
        )
        .unwrap();
        assert_eq!(
            change(&v).unwrap(),
            (
                4,
                Change::Stored(AnnouncedBlock {
                    hash: 10,
                    parent: None,
                    tokens: vec![1, 2],
                    key_digest: Some(255)
                })
            )
        );
        let bad: Value =
            serde_json::from_str(r#"{"seq":1,"type":"stored","hash":"zz","tokens":[]}"#).unwrap();
        assert!(change(&bad).unwrap_err().contains("\"zz\""));
        let bad: Value = serde_json::from_str(r#"{"seq":1,"type":"moved"}"#).unwrap();
        assert!(change(&bad).unwrap_err().contains("moved"));
        let bad: Value =
            serde_json::from_str(r#"{"seq":1,"type":"stored","hash":"1","tokens":[-1]}"#).unwrap();
        assert!(change(&bad).unwrap_err().contains("-1"));
    }
}
