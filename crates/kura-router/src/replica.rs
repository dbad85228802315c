//! One replica as the router sees it: health, load, and the follower of its KV events.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kura_api::sse::{SseDecoder, SseEvent};
use serde_json::Value;

use crate::{lock, Fleet};
use kura_fleet::index::Change;

/// Consecutive failed health checks after which a replica is down.
const DOWN_AFTER: u32 = 2;
/// Longest wait for a health or metrics answer.
const CHECK_TIMEOUT: Duration = Duration::from_millis(500);
/// How long the result of a health probe made after a failed request answers for later ones.
const PROBE_REUSE: Duration = Duration::from_millis(100);

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
    /// Times the replica went from up to down.
    pub mark_downs: AtomicU64,
    /// Whether an earlier address in `--replica`, up, reaches the same server (the same `instance`):
    /// then requests go there, not here, so that one server is not counted twice.
    duplicate: AtomicBool,
    /// The last health probe made after a failed request: when, and whether the replica answered.
    probe: tokio::sync::Mutex<Option<(Instant, bool)>>,
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
            mark_downs: AtomicU64::new(0),
            duplicate: AtomicBool::new(false),
            probe: tokio::sync::Mutex::new(None),
        }
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Whether an earlier address reaches the same server ([`Fleet::note_instance`]).
    pub fn is_duplicate(&self) -> bool {
        self.duplicate.load(Ordering::Acquire)
    }

    /// Whether requests may go to this address: up, and not a second address of a server listed
    /// before it.
    pub fn routable(&self) -> bool {
        self.is_up() && !self.is_duplicate()
    }
}

impl Fleet {
    /// Marks replica `r` down at once (a refused connection): no new requests go to it and its blocks
    /// are forgotten until it is back and has sent a new snapshot.
    pub(crate) fn mark_down(&self, r: usize, why: &str) {
        let rep = &self.replicas[r];
        rep.failed_checks.store(DOWN_AFTER, Ordering::Relaxed);
        if rep.up.swap(false, Ordering::AcqRel) {
            rep.mark_downs.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(replica = %rep.url, reason = why, "replica down: draining it");
            // A later address of the same server may take its place.
            self.refresh_duplicates(&lock(&self.instances));
        }
        lock(&self.index).forget(r);
    }

    /// Records the server process behind replica `r` (its snapshot's `instance`; `Fleet::instances`)
    /// and marks again which addresses are duplicates ([`Fleet::refresh_duplicates`]).
    pub(crate) fn note_instance(&self, r: usize, instance: Option<String>) {
        let mut names = lock(&self.instances);
        names[r] = instance;
        self.refresh_duplicates(&names);
    }

    /// Marks every address that reaches the same server process as an earlier address that is up a
    /// duplicate, and the others not (said in the log when it changes, with both addresses): the same
    /// server listed twice (`localhost` and `127.0.0.1`, say) would otherwise count twice, its cache
    /// indexed as two and its load split in two. Called with `Fleet::instances` held, so that
    /// concurrent snapshots and health changes apply one after the other; when an address goes down
    /// or comes back, and at every snapshot.
    fn refresh_duplicates(&self, names: &[Option<String>]) {
        for (k, rep) in self.replicas.iter().enumerate() {
            let first = names[k].as_ref().and_then(|name| {
                (0..k).find(|&j| names[j].as_ref() == Some(name) && self.replicas[j].is_up())
            });
            let was = rep.duplicate.swap(first.is_some(), Ordering::AcqRel);
            match (first, was) {
                (Some(j), false) => tracing::warn!(
                    replica = %rep.url,
                    same_as = %self.replicas[j].url,
                    "this replica is the server another --replica already names (the same instance): \
                     requests go to the first address only; list each server once"
                ),
                (None, true) => tracing::info!(
                    replica = %rep.url,
                    "requests go to this replica again (no earlier address of its server is up)"
                ),
                _ => {}
            }
        }
    }

    fn check_passed(&self, r: usize) {
        let rep = &self.replicas[r];
        rep.failed_checks.store(0, Ordering::Relaxed);
        if !rep.up.swap(true, Ordering::AcqRel) {
            tracing::info!(replica = %rep.url, "replica up again");
            self.refresh_duplicates(&lock(&self.instances));
        }
    }

    fn check_failed(&self, r: usize, why: &str) {
        let rep = &self.replicas[r];
        let failed = rep.failed_checks.fetch_add(1, Ordering::Relaxed) + 1;
        if failed >= DOWN_AFTER {
            self.mark_down(r, why);
        }
    }

    /// One health check of replica `r` now; a failure counts towards [`DOWN_AFTER`], and with
    /// `refused_is_down` a refused connection marks it down at once. `true` when it answered 2xx.
    async fn check_now(&self, r: usize, refused_is_down: bool) -> bool {
        let health = self
            .client
            .get(format!("{}/health", self.replicas[r].url))
            .timeout(CHECK_TIMEOUT)
            .send()
            .await;
        match health {
            Ok(resp) if resp.status().is_success() => {
                self.check_passed(r);
                true
            }
            Ok(resp) => {
                self.check_failed(r, &format!("/health answered {}", resp.status()));
                false
            }
            Err(e) if refused_is_down && e.is_connect() => {
                self.mark_down(r, &format!("/health could not connect: {e}"));
                false
            }
            Err(e) => {
                self.check_failed(r, &format!("/health failed: {e}"));
                false
            }
        }
    }

    /// Whether replica `r` is alive, checked now: after a request to it failed on the way (the
    /// connection broke after it was made), which says nothing by itself of whose fault it was (a
    /// replica that died, or one that refused the request's body and closed). Concurrent callers share
    /// one check; a result younger than [`PROBE_REUSE`] is reused.
    pub(crate) async fn confirm_alive(&self, r: usize) -> bool {
        let mut last = self.replicas[r].probe.lock().await;
        if let Some((at, alive)) = *last {
            if at.elapsed() < PROBE_REUSE {
                return alive;
            }
        }
        let alive = self.check_now(r, true).await;
        *last = Some((Instant::now(), alive));
        alive
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
        fleet.check_now(r, false).await;
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
            if let Some(text) = read_bounded(resp, METRICS_MAX_BYTES)
                .await
                .and_then(|b| String::from_utf8(b).ok())
            {
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

/// The most bytes read of a replica's `/metrics` (a replica's own run to about 20 KB).
const METRICS_MAX_BYTES: usize = 4 << 20;

/// A replica's answer whole, when it is at most `max` bytes; `None` past that or on a read error.
pub(crate) async fn read_bounded(mut resp: reqwest::Response, max: usize) -> Option<Vec<u8>> {
    if resp.content_length().is_some_and(|n| n > max as u64) {
        return None;
    }
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await.ok()? {
        if out.len() + chunk.len() > max {
            return None;
        }
        out.extend_from_slice(&chunk);
    }
    Some(out)
}

/// A block's name: 32 hexadecimal digits, as replicas write them.
fn name(v: Option<&Value>, what: &str) -> Result<u128, String> {
    match v {
        None | Some(Value::Null) => Err(format!("{what} without a name")),
        Some(Value::String(s)) => {
            if s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
                u128::from_str_radix(s, 16).map_err(|e| format!("block name {s:?}: {e}"))
            } else {
                Err(format!(
                    "block name {s:?} is not 32 hexadecimal digits (a replica of another version?)"
                ))
            }
        }
        Some(other) => Err(format!("block name {other} is not a string")),
    }
}

/// A snapshot's sequence number, what it says of the replica, its block names, and the name of the
/// server process that sent it (`instance`; absent from older replicas).
type Snapshot = (u64, ReplicaInfo, Vec<u128>, Option<String>);

/// A snapshot as a replica sends it, read without a JSON tree: a snapshot of millions of blocks (up to
/// the 256 MiB an event may hold) would take several times its size as one. Each block keeps its name
/// only; its tokens (a replica's --kv-events-tokens) are skipped.
#[derive(serde::Deserialize)]
struct SnapshotWire {
    seq: Option<u64>,
    model: Option<String>,
    model_fingerprint: Option<String>,
    block_size: Option<u64>,
    tenants: Option<bool>,
    blocks: Option<Vec<BlockWire>>,
    instance: Option<String>,
}

#[derive(serde::Deserialize)]
struct BlockWire {
    #[serde(default)]
    name: BlockName,
}

/// A block's name, or why it is not one ([`name`]'s message).
struct BlockName(Result<u128, String>);

impl Default for BlockName {
    fn default() -> Self {
        BlockName(name(None, "a block"))
    }
}

impl<'de> serde::Deserialize<'de> for BlockName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        Ok(BlockName(name(Some(&v), "a block")))
    }
}

fn snapshot(data: &str) -> Result<Snapshot, String> {
    let v: SnapshotWire = serde_json::from_str(data).map_err(|e| format!("not a snapshot: {e}"))?;
    let seq = v.seq.ok_or("no seq")?;
    let info = ReplicaInfo {
        model: v.model.ok_or("no model")?,
        model_fingerprint: v.model_fingerprint.ok_or("no model_fingerprint")?,
        block_size: v
            .block_size
            .filter(|&b| b > 0)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or("no block_size")?,
        tenants: v.tenants.unwrap_or(false),
    };
    let names = v
        .blocks
        .ok_or("no blocks")?
        .into_iter()
        .map(|b| b.name.0)
        .collect::<Result<_, _>>()?;
    Ok((seq, info, names, v.instance))
}

fn change(v: &Value) -> Result<(u64, Change), String> {
    let seq = v
        .get("seq")
        .and_then(Value::as_u64)
        .ok_or("an event without seq")?;
    let change = match v.get("type").and_then(Value::as_str) {
        Some("stored") => Change::Stored {
            name: name(v.get("name"), "a stored event")?,
        },
        Some("removed") => Change::Removed {
            name: name(v.get("name"), "a removed event")?,
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
    /// The replica refused the key presented (401: none or unknown; 403: a tenant's key).
    Refused(u16),
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
            let (seq, info, names, instance) =
                snapshot(&e.data).map_err(|m| StreamEnd::Broken(format!("snapshot: {m}")))?;
            let n = names.len();
            if !info.tenants && !fleet.config.api_keys.is_empty() {
                // Keys here, none there: every client of the router shares the replica's cache, so
                // one tenant's cached_tokens would tell it what another sent. Said at every snapshot
                // (a replica's start or a resynchronization), not at every request.
                tracing::warn!(
                    replica = %rep.url,
                    "the router has API keys but this replica does not: its cache is shared by \
                     every client, which keeps no tenant apart; start the replicas with the same keys"
                );
            }
            lock(&fleet.index).reset(r, seq, &names);
            *lock(&rep.info) = Some(info);
            fleet.note_instance(r, instance);
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
    if let Some(key) = &fleet.config.replica_admin_key {
        request = request.bearer_auth(key);
    }
    let resp = match request.send().await {
        Ok(resp) => resp,
        Err(e) => return StreamEnd::Broken(format!("connecting: {e}")),
    };
    match resp.status().as_u16() {
        200 => {}
        404 => return StreamEnd::NotPublished,
        s @ (401 | 403) => return StreamEnd::Refused(s),
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
    let mut warned_refused = false;
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
            StreamEnd::Refused(status) => {
                if !warned_refused {
                    let given = match fleet.config.replica_admin_key {
                        Some(_) => "the operator key given",
                        None => "no key (give --replica-admin-key-file)",
                    };
                    tracing::warn!(replica = %rep.url, status,
                        "the replica refused {given} at /v1/kv/events: routing to it without its cache \
                         until it accepts the replicas' operator key");
                    warned_refused = true;
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
        let parse = |text: &str| change(&serde_json::from_str::<Value>(text).unwrap());
        let name = "000000000000000000000000000000ff";
        assert_eq!(
            parse(&format!(
                r#"{{"seq":4,"type":"stored","name":"{name}","tier":"pool"}}"#
            ))
            .unwrap(),
            (4, Change::Stored { name: 255 })
        );
        assert_eq!(
            parse(&format!(r#"{{"seq":5,"type":"removed","name":"{name}"}}"#)).unwrap(),
            (5, Change::Removed { name: 255 })
        );
        assert_eq!(
            parse(r#"{"seq":6,"type":"cleared"}"#).unwrap(),
            (6, Change::Cleared)
        );
        for (bad, says) in [
            (
                r#"{"seq":1,"type":"stored","name":"zz"}"#,
                "\"zz\" is not 32 hexadecimal digits",
            ),
            (
                r#"{"seq":1,"type":"stored","name":"+0000000000000000000000000000001"}"#,
                "not 32 hexadecimal digits",
            ),
            (
                r#"{"seq":1,"type":"stored","name":"0000000000000000000000000000000001"}"#,
                "not 32 hexadecimal digits",
            ),
            (
                r#"{"seq":1,"type":"removed"}"#,
                "a removed event without a name",
            ),
            (r#"{"seq":1,"type":"stored","name":7}"#, "7 is not a string"),
            // The old format (hash, parent, tokens) is refused by name, not read as something else.
            (
                r#"{"seq":1,"type":"stored","hash":"0a","tokens":[1,2]}"#,
                "a stored event without a name",
            ),
            (r#"{"seq":1,"type":"moved"}"#, "moved"),
            (r#"{"type":"cleared"}"#, "without seq"),
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn a_snapshot_gives_its_names_and_ignores_debug_tokens() {
        let v = r#"{"object":"kv.snapshot","instance":"i","seq":9,"block_size":16,"model":"m",
                "model_fingerprint":"f","tenants":true,"tier":"pool",
                "blocks":[{"name":"0000000000000000000000000000000a"},
                          {"name":"0000000000000000000000000000000b","tokens":[1,2,3]}]}"#;
        let (seq, info, names, instance) = snapshot(v).unwrap();
        assert_eq!((seq, names), (9, vec![10, 11]));
        assert_eq!(instance.as_deref(), Some("i"));
        assert_eq!((info.block_size, info.tenants), (16, true));
        let bad = r#"{"seq":1,"block_size":16,"model":"m","model_fingerprint":"f","blocks":[{"name":"g"}]}"#;
        assert!(snapshot(bad).unwrap_err().contains("\"g\""));
        for (body, says) in [
            (
                r#"{"block_size":16,"model":"m","model_fingerprint":"f","blocks":[]}"#,
                "no seq",
            ),
            (
                r#"{"seq":1,"block_size":16,"model":"m","model_fingerprint":"f","blocks":[{}]}"#,
                "without a name",
            ),
            (
                r#"{"seq":1,"block_size":0,"model":"m","model_fingerprint":"f","blocks":[]}"#,
                "no block_size",
            ),
            (r#"[1]"#, "not a snapshot"),
        ] {
            let e = snapshot(body).unwrap_err();
            assert!(e.contains(says), "{body}: {e}");
        }
    }
}
