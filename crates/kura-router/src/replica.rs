//! One replica as the router sees it: health, load, and the follower of its KV events.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use std::fmt;

use futures::StreamExt;
use kura_api::routing::KV_EVENTS_BATCH;
use kura_api::sse::{SseDecoder, SseEvent};
use kura_kv::MAX_BLOCK_SIZE;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use crate::{lock, Fleet};
use kura_fleet::index::{Change, MAX_HELD};

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

/// At most the first bytes of `s` (cut at a character), quoted and escaped, with its length when cut:
/// what an error or the log repeats of text a replica sent.
fn short(s: &str) -> String {
    const SHORT: usize = 40;
    if s.len() <= SHORT {
        return format!("{s:?}");
    }
    let mut end = SHORT;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}… ({} bytes)", &s[..end], s.len())
}

/// A block's name: 32 hexadecimal digits, as replicas write them. Anything else fails the read where it
/// stands (the rest of the data unread), repeating at most the first bytes of what was there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BlockName(u128);

impl<'de> Deserialize<'de> for BlockName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Hex;
        impl Visitor<'_> for Hex {
            type Value = BlockName;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a block name (a string of 32 hexadecimal digits)")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<BlockName, E> {
                if s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
                    if let Ok(name) = u128::from_str_radix(s, 16) {
                        return Ok(BlockName(name));
                    }
                }
                Err(E::custom(format_args!(
                    "block name {} is not 32 hexadecimal digits (a replica of another version?)",
                    short(s)
                )))
            }
        }
        d.deserialize_str(Hex)
    }
}

/// A snapshot as the router keeps it: its sequence number, what it says of the replica, the names of
/// its first blocks (at most the index's bound), how many blocks it listed, and the name of the server
/// process that sent it (`instance`; absent from older replicas).
struct Snapshot {
    seq: u64,
    info: ReplicaInfo,
    names: Vec<u128>,
    listed: usize,
    instance: Option<String>,
}

/// A snapshot as a replica sends it, read without a JSON tree: a snapshot of millions of blocks (up to
/// the 256 MiB an event may hold) would take several times its size as one. Each block keeps its name
/// only; its tokens (a replica's --kv-events-tokens) are skipped. `MAX`: most names kept.
#[derive(Deserialize)]
struct SnapshotWire<const MAX: usize> {
    seq: Option<u64>,
    model: Option<String>,
    model_fingerprint: Option<String>,
    block_size: Option<u64>,
    tenants: Option<bool>,
    blocks: Option<Names<MAX>>,
    instance: Option<String>,
}

#[derive(Deserialize)]
struct BlockWire {
    name: BlockName,
}

/// A snapshot's block names: every one checked as it is read (the first bad one ends the read), the
/// first `MAX` kept, the others counted only.
struct Names<const MAX: usize> {
    kept: Vec<u128>,
    listed: usize,
}

impl<'de, const MAX: usize> Deserialize<'de> for Names<MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Blocks<const MAX: usize>;
        impl<'de, const MAX: usize> Visitor<'de> for Blocks<MAX> {
            type Value = Names<MAX>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of blocks")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Names<MAX>, A::Error> {
                let mut names = Names {
                    kept: Vec::new(),
                    listed: 0,
                };
                while let Some(BlockWire { name }) = seq.next_element()? {
                    names.listed = names.listed.saturating_add(1);
                    if names.kept.len() < MAX {
                        names.kept.push(name.0);
                    }
                }
                Ok(names)
            }
        }
        d.deserialize_seq(Blocks::<MAX>)
    }
}

/// Reads a snapshot, keeping the names of its first `MAX` blocks (the index records no more for one
/// replica: [`MAX_HELD`]).
fn snapshot<const MAX: usize>(data: &str) -> Result<Snapshot, String> {
    let v: SnapshotWire<MAX> =
        serde_json::from_str(data).map_err(|e| format!("not a snapshot: {e}"))?;
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
    let blocks = v.blocks.ok_or("no blocks")?;
    Ok(Snapshot {
        seq,
        info,
        names: blocks.kept,
        listed: blocks.listed,
        instance: v.instance,
    })
}

/// Most events the router takes in one `kv` message: twice what a server sends in one
/// ([`KV_EVENTS_BATCH`]).
const MAX_KV_EVENTS: usize = 2 * KV_EVENTS_BATCH;
/// The longest event a server sends: a stored block's with its tokens (`--kv-events-tokens`): its
/// 32-digit name, a seq of at most 20 digits, its tier, type and punctuation (112 bytes, 128 counted),
/// and a block of at most [`MAX_BLOCK_SIZE`] tokens of at most 10 digits and a comma each.
const MAX_KV_EVENT_BYTES: usize = 128 + 11 * MAX_BLOCK_SIZE;
/// Most bytes of a `kv` or `gap` event read (about 6 MB): [`MAX_KV_EVENTS`] of the longest, with the
/// array's commas and brackets. A snapshot may fill the SSE decoder's bound.
const MAX_EVENT_BYTES: usize = MAX_KV_EVENTS * (MAX_KV_EVENT_BYTES + 1) + 2;

/// One `kv` event as a replica sends it (its `tier`, and its `tokens` under `--kv-events-tokens`,
/// skipped).
#[derive(Deserialize)]
struct EventWire {
    seq: Option<u64>,
    #[serde(rename = "type")]
    kind: Option<EventKind>,
    name: Option<BlockName>,
}

enum EventKind {
    Stored,
    Removed,
    Cleared,
}

impl<'de> Deserialize<'de> for EventKind {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Kind;
        impl Visitor<'_> for Kind {
            type Value = EventKind;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an event type (stored, removed or cleared)")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<EventKind, E> {
                match s {
                    "stored" => Ok(EventKind::Stored),
                    "removed" => Ok(EventKind::Removed),
                    "cleared" => Ok(EventKind::Cleared),
                    other => Err(E::custom(format_args!(
                        "unknown event type {}",
                        short(other)
                    ))),
                }
            }
        }
        d.deserialize_str(Kind)
    }
}

/// A `kv` message's events, at most [`MAX_KV_EVENTS`]: the read stops at the first one past it.
struct Events(Vec<EventWire>);

impl<'de> Deserialize<'de> for Events {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct List;
        impl<'de> Visitor<'de> for List {
            type Value = Events;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of KV events")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Events, A::Error> {
                let mut events = Vec::new();
                while let Some(e) = seq.next_element()? {
                    if events.len() == MAX_KV_EVENTS {
                        return Err(de::Error::custom(format_args!(
                            "more than {MAX_KV_EVENTS} events in one message (a server sends at \
                             most {KV_EVENTS_BATCH})"
                        )));
                    }
                    events.push(e);
                }
                Ok(Events(events))
            }
        }
        d.deserialize_seq(List)
    }
}

/// A `kv` message's changes with their sequence numbers, in order; an error names the first thing wrong.
fn kv_events(data: &str) -> Result<Vec<(u64, Change)>, String> {
    let Events(events) = serde_json::from_str(data).map_err(|e| format!("kv data: {e}"))?;
    events.into_iter().map(change).collect()
}

fn change(e: EventWire) -> Result<(u64, Change), String> {
    let seq = e.seq.ok_or("an event without seq")?;
    let name = |what: &str| e.name.map(|n| n.0).ok_or(format!("{what} without a name"));
    let change = match e.kind.ok_or("an event without type")? {
        EventKind::Stored => Change::Stored {
            name: name("a stored event")?,
        },
        EventKind::Removed => Change::Removed {
            name: name("a removed event")?,
        },
        EventKind::Cleared => Change::Cleared,
    };
    Ok((seq, change))
}

/// A `gap` event as a server sends it: the event the stream wanted next and the oldest it still held.
#[derive(Deserialize)]
struct GapWire {
    wanted: Option<u64>,
    oldest: Option<u64>,
}

/// What the log says of a `gap` event's data: its two numbers, or the start of data not of that form.
fn gap_text(data: &str) -> String {
    match serde_json::from_str::<GapWire>(data) {
        Ok(GapWire {
            wanted: Some(wanted),
            oldest: Some(oldest),
        }) => format!("wanted event {wanted}, the oldest held is {oldest}"),
        _ => format!(
            "gap data {} not of the form {{wanted, oldest}}",
            short(data)
        ),
    }
}

/// The first pause before resynchronizing after a gap that follows another.
const GAP_WAIT_MIN: Duration = Duration::from_millis(250);
/// The longest pause between resynchronizations after gaps in a row.
const GAP_WAIT_MAX: Duration = Duration::from_secs(10);
/// A stream that lasted this long before its gap starts the count of gaps in a row again.
const GAP_STEADY: Duration = Duration::from_secs(30);

/// The pauses after gaps: the first at once (a snapshot resynchronizes), then, while streams keep
/// ending in gaps before [`GAP_STEADY`], from [`GAP_WAIT_MIN`] doubling up to [`GAP_WAIT_MAX`], so that
/// a replica whose ring its reader cannot keep up with is not asked for a snapshot after another.
#[derive(Debug, Default)]
struct GapBackoff {
    in_a_row: u32,
}

impl GapBackoff {
    /// The pause after a stream that lasted `lasted` and ended in a gap.
    fn after_gap(&mut self, lasted: Duration) -> Duration {
        if lasted >= GAP_STEADY {
            self.in_a_row = 0;
        }
        let wait = match self.in_a_row.checked_sub(1) {
            None => Duration::ZERO,
            Some(doublings) => 1u32
                .checked_shl(doublings)
                .and_then(|f| GAP_WAIT_MIN.checked_mul(f))
                .map_or(GAP_WAIT_MAX, |w| w.min(GAP_WAIT_MAX)),
        };
        self.in_a_row = self.in_a_row.saturating_add(1);
        wait
    }
}

/// What ended one event stream.
enum StreamEnd {
    /// A gap (announced by the replica or seen here): resynchronize, at once after a first one
    /// ([`GapBackoff`]).
    Gap,
    /// Closed, refused or broken: try again after a pause.
    Broken(String),
    /// The replica publishes no events.
    NotPublished,
    /// The replica refused the key presented (401: none or unknown; 403: a tenant's key).
    Refused(u16),
}

/// Applies one SSE event of replica `r`'s stream; `Err` ends the stream. A `kv` or `gap` event longer
/// than [`MAX_EVENT_BYTES`] is not read: it breaks the stream, as bad data does.
fn on_event(fleet: &Fleet, r: usize, e: &SseEvent) -> Result<(), StreamEnd> {
    let rep = &fleet.replicas[r];
    let kind = e.event.as_deref();
    if let Some(kind @ ("kv" | "gap")) = kind {
        if e.data.len() > MAX_EVENT_BYTES {
            return Err(StreamEnd::Broken(format!(
                "a {kind} event of {} bytes, more than the {MAX_EVENT_BYTES} a replica sends",
                e.data.len()
            )));
        }
    }
    match kind {
        Some("snapshot") => {
            let Snapshot {
                seq,
                info,
                names,
                listed,
                instance,
            } = snapshot::<MAX_HELD>(&e.data)
                .map_err(|m| StreamEnd::Broken(format!("snapshot: {m}")))?;
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
            if listed > names.len() {
                tracing::warn!(
                    replica = %rep.url,
                    blocks = listed,
                    indexed = names.len(),
                    "the replica's snapshot lists more blocks than the router indexes for one \
                     replica: the others are not recorded (prompts they start route as uncached)"
                );
            }
            lock(&fleet.index).reset(r, seq, &names);
            *lock(&rep.info) = Some(info);
            fleet.note_instance(r, instance);
            rep.snapshots.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(replica = %rep.url, seq, blocks = listed, "KV snapshot");
            Ok(())
        }
        Some("kv") => {
            let events = kv_events(&e.data).map_err(StreamEnd::Broken)?;
            let mut index = lock(&fleet.index);
            for (seq, change) in &events {
                if let Err(gap) = index.apply(r, *seq, change) {
                    tracing::warn!(replica = %rep.url, expected = gap.expected, got = gap.got,
                        "KV events out of order: resynchronizing from a snapshot");
                    return Err(StreamEnd::Gap);
                }
            }
            Ok(())
        }
        Some("gap") => {
            tracing::warn!(replica = %rep.url, gap = %gap_text(&e.data),
                "the replica dropped KV events for this stream: resynchronizing");
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

/// Follows replica `r`'s KV events for the router's life: a snapshot, then changes; on a gap at once
/// (after a growing pause when gaps come in a row: [`GapBackoff`]), and on any other end after a pause,
/// it forgets the replica's blocks and starts again.
pub(crate) async fn follow_events(fleet: Arc<Fleet>, r: usize) {
    let mut warned_unpublished = false;
    let mut warned_refused = false;
    let mut gaps = GapBackoff::default();
    loop {
        if !fleet.replicas[r].is_up() {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let began = Instant::now();
        let end = follow_once(&fleet, r).await;
        lock(&fleet.index).forget(r);
        let rep = &fleet.replicas[r];
        match end {
            StreamEnd::Gap => {
                rep.gaps.fetch_add(1, Ordering::Relaxed);
                let wait = gaps.after_gap(began.elapsed());
                if !wait.is_zero() {
                    tracing::debug!(replica = %rep.url, in_a_row = gaps.in_a_row, wait_ms = wait.as_millis(),
                        "KV event streams keep ending in gaps: pausing before the next snapshot");
                    tokio::time::sleep(wait).await;
                }
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
        let one = |event: &str| kv_events(&format!("[{event}]"));
        let name = "000000000000000000000000000000ff";
        assert_eq!(
            one(&format!(
                r#"{{"seq":4,"type":"stored","name":"{name}","tier":"pool","tokens":[1,2]}}"#
            ))
            .unwrap(),
            [(4, Change::Stored { name: 255 })]
        );
        assert_eq!(
            one(&format!(r#"{{"seq":5,"type":"removed","name":"{name}"}}"#)).unwrap(),
            [(5, Change::Removed { name: 255 })]
        );
        assert_eq!(
            one(r#"{"seq":6,"type":"cleared"}"#).unwrap(),
            [(6, Change::Cleared)]
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
            (
                r#"{"seq":1,"type":"stored","name":7}"#,
                "integer `7`, expected a block name",
            ),
            // The old format (hash, parent, tokens) is refused by name, not read as something else.
            (
                r#"{"seq":1,"type":"stored","hash":"0a","tokens":[1,2]}"#,
                "a stored event without a name",
            ),
            (
                r#"{"seq":1,"type":"moved"}"#,
                "unknown event type \"moved\"",
            ),
            (r#"{"seq":1}"#, "without type"),
            (r#"{"type":"cleared"}"#, "without seq"),
        ] {
            let err = one(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
        let err = kv_events(r#"{"seq":1}"#).unwrap_err();
        assert!(err.contains("expected an array of KV events"), "{err}");
    }

    #[test]
    fn a_kv_message_past_the_event_bound_is_refused() {
        let cleared = |n: usize| {
            let events: Vec<String> = (1..=n)
                .map(|seq| format!(r#"{{"seq":{seq},"type":"cleared"}}"#))
                .collect();
            format!("[{}]", events.join(","))
        };
        assert_eq!(
            kv_events(&cleared(MAX_KV_EVENTS)).unwrap().len(),
            MAX_KV_EVENTS
        );
        let err = kv_events(&cleared(MAX_KV_EVENTS + 1)).unwrap_err();
        assert!(
            err.contains(&format!("more than {MAX_KV_EVENTS} events in one message")),
            "{err}"
        );
        // The bound leaves room for what a server sends: its largest message, a batch of stored
        // blocks of the largest size with tokens of the most digits, fits.
        let tokens = vec![u32::MAX.to_string(); MAX_BLOCK_SIZE].join(",");
        let stored: Vec<String> = (1..=KV_EVENTS_BATCH as u64)
            .map(|seq| {
                format!(
                    r#"{{"name":"{:032x}","seq":{},"tier":"pool","tokens":[{tokens}],"type":"stored"}}"#,
                    u128::MAX,
                    u64::MAX - KV_EVENTS_BATCH as u64 + seq
                )
            })
            .collect();
        let largest = format!("[{}]", stored.join(","));
        assert!(largest.len() <= MAX_EVENT_BYTES / 2, "{}", largest.len());
        assert_eq!(kv_events(&largest).unwrap().len(), KV_EVENTS_BATCH);
    }

    /// A codec for a fleet that tokenizes nothing (no fleet secret).
    struct NoCodec;

    impl kura_text::TextCodec for NoCodec {
        fn encode(&self, _: &str) -> Result<Vec<u32>, String> {
            Err("not used".into())
        }
        fn decode(&self, _: &[u32]) -> String {
            String::new()
        }
        fn token_bytes(&self, _: u32) -> Vec<u8> {
            Vec::new()
        }
        fn render_chat(&self, _: &[kura_text::ChatMessage]) -> Result<String, String> {
            Err("not used".into())
        }
        fn encode_chat(&self, _: &[kura_text::ChatMessage]) -> Result<Vec<u32>, String> {
            Err("not used".into())
        }
        fn chat_content_spans(
            &self,
            _: &str,
            _: usize,
            _: &[kura_text::ChatMessage],
        ) -> Result<Vec<std::ops::Range<usize>>, String> {
            Ok(Vec::new())
        }
        fn encode_with_plain_spans(
            &self,
            _: &str,
            _: &[std::ops::Range<usize>],
        ) -> Result<Vec<u32>, String> {
            Err("not used".into())
        }
        fn eos_token_ids(&self) -> &[u32] {
            &[]
        }
        fn vocab_size(&self) -> usize {
            1
        }
    }

    fn event(kind: &str, data: String) -> SseEvent {
        SseEvent {
            event: Some(kind.into()),
            data,
        }
    }

    #[test]
    fn an_oversized_kv_event_breaks_the_stream_unread() {
        let config = crate::RouterConfig::new(
            vec!["http://127.0.0.1:9".into()],
            crate::Policy::RoundRobin,
            Arc::new(NoCodec),
        );
        let fleet = Fleet::new(config).unwrap();
        let snap = r#"{"seq":3,"block_size":16,"model":"m","model_fingerprint":"f",
                       "blocks":[{"name":"0000000000000000000000000000000a"}]}"#;
        assert!(on_event(&fleet, 0, &event("snapshot", snap.into())).is_ok());
        let stored = r#"[{"seq":4,"type":"stored","name":"0000000000000000000000000000000b"}]"#;
        assert!(on_event(&fleet, 0, &event("kv", stored.into())).is_ok());
        assert_eq!(lock(&fleet.index).num_blocks(0), 2);

        // Valid JSON, one event, padded with spaces past the bound: refused by its size, not read.
        let mut big = String::from(r#"[{"seq":5,"type":"cleared"}"#);
        big.push_str(&" ".repeat(MAX_EVENT_BYTES));
        big.push(']');
        let n = big.len();
        match on_event(&fleet, 0, &event("kv", big)) {
            Err(StreamEnd::Broken(why)) => assert!(
                why.contains(&format!(
                    "a kv event of {n} bytes, more than the {MAX_EVENT_BYTES}"
                )),
                "{why}"
            ),
            _ => panic!("an oversized kv event must break the stream"),
        }
        assert_eq!(
            lock(&fleet.index).num_blocks(0),
            2,
            "its clear was not applied"
        );
        // As bad kv data does.
        assert!(matches!(
            on_event(&fleet, 0, &event("kv", "[1]".into())),
            Err(StreamEnd::Broken(_))
        ));
        // An oversized gap is refused the same way; one of the server's shape resynchronizes.
        let gap = format!(
            r#"{{"wanted":1,"oldest":2{}}}"#,
            " ".repeat(MAX_EVENT_BYTES)
        );
        assert!(matches!(
            on_event(&fleet, 0, &event("gap", gap)),
            Err(StreamEnd::Broken(why)) if why.contains("a gap event of")
        ));
        assert!(matches!(
            on_event(
                &fleet,
                0,
                &event("gap", r#"{"wanted":1,"oldest":2}"#.into())
            ),
            Err(StreamEnd::Gap)
        ));
    }

    #[test]
    fn a_snapshot_gives_its_names_and_ignores_debug_tokens() {
        let v = r#"{"object":"kv.snapshot","instance":"i","seq":9,"block_size":16,"model":"m",
                "model_fingerprint":"f","tenants":true,"tier":"pool",
                "blocks":[{"name":"0000000000000000000000000000000a"},
                          {"name":"0000000000000000000000000000000b","tokens":[1,2,3]}]}"#;
        let s = snapshot::<MAX_HELD>(v).unwrap();
        assert_eq!((s.seq, s.names, s.listed), (9, vec![10, 11], 2));
        assert_eq!(s.instance.as_deref(), Some("i"));
        assert_eq!((s.info.block_size, s.info.tenants), (16, true));
        for (body, says) in [
            (
                r#"{"block_size":16,"model":"m","model_fingerprint":"f","blocks":[]}"#,
                "no seq",
            ),
            (
                r#"{"seq":1,"block_size":16,"model":"m","model_fingerprint":"f","blocks":[{"name":"g"}]}"#,
                "block name \"g\" is not 32 hexadecimal digits",
            ),
            (
                r#"{"seq":1,"block_size":16,"model":"m","model_fingerprint":"f","blocks":[{}]}"#,
                "missing field `name`",
            ),
            (
                r#"{"seq":1,"block_size":16,"model":"m","model_fingerprint":"f","blocks":[{"name":null}]}"#,
                "expected a block name",
            ),
            (
                r#"{"seq":1,"block_size":0,"model":"m","model_fingerprint":"f","blocks":[]}"#,
                "no block_size",
            ),
            (r#"[1]"#, "not a snapshot"),
        ] {
            let e = snapshot::<MAX_HELD>(body).map(drop).unwrap_err();
            assert!(e.contains(says), "{body}: {e}");
        }
    }

    /// The column a serde_json error names.
    fn column(err: &str) -> usize {
        err.rsplit("column ").next().unwrap().parse().unwrap()
    }

    #[test]
    fn a_bad_block_ends_the_snapshot_where_it_stands() {
        let head = r#"{"seq":1,"block_size":16,"model":"m","model_fingerprint":"f","blocks":["#;
        let good = format!(r#",{{"name":"{:032x}"}}"#, 7u128).repeat(100_000);
        for (first, says) in [
            ("{}", "missing field `name`"),
            (
                r#"{"name":1}"#,
                "invalid type: integer `1`, expected a block name",
            ),
            (
                r#"{"name":{"a":[1]}}"#,
                "invalid type: map, expected a block name",
            ),
        ] {
            let body = format!("{head}{first}{good}]}}");
            let e = snapshot::<MAX_HELD>(&body).map(drop).unwrap_err();
            assert!(e.contains(says), "{first}: {e}");
            // Read no further than the bad block.
            assert!(column(&e) <= head.len() + first.len(), "{first}: {e}");
        }
        // A name that is a huge array or string is neither built nor repeated whole.
        for first in [
            format!(r#"{{"name":[{}1]}}"#, "1,".repeat(1_000_000)),
            format!(r#"{{"name":"{}"}}"#, "z".repeat(1_000_000)),
        ] {
            let body = format!("{head}{first}{good}]}}");
            let e = snapshot::<MAX_HELD>(&body).map(drop).unwrap_err();
            assert!(e.len() < 300, "{} bytes: {}", e.len(), &e[..300]);
            assert!(column(&e) <= head.len() + first.len(), "{e}");
        }
    }

    #[test]
    fn a_snapshot_past_the_index_bound_keeps_its_first_blocks() {
        let blocks: Vec<String> = (1..=5u128)
            .map(|n| format!(r#"{{"name":"{n:032x}"}}"#))
            .collect();
        let body = |blocks: &[String]| {
            format!(
                r#"{{"seq":1,"block_size":16,"model":"m","model_fingerprint":"f","blocks":[{}]}}"#,
                blocks.join(",")
            )
        };
        let s = snapshot::<3>(&body(&blocks)).unwrap();
        assert_eq!((s.names, s.listed), (vec![1, 2, 3], 5));
        let s = snapshot::<5>(&body(&blocks)).unwrap();
        assert_eq!((s.names, s.listed), (vec![1, 2, 3, 4, 5], 5));
        // Blocks past the bound are still checked.
        let mut bad = blocks.clone();
        bad.push(r#"{"name":"x"}"#.into());
        let e = snapshot::<3>(&body(&bad)).map(drop).unwrap_err();
        assert!(e.contains("block name \"x\""), "{e}");
    }

    #[test]
    fn a_gap_is_logged_by_its_numbers_or_a_short_start() {
        assert_eq!(
            gap_text(r#"{"wanted":12,"oldest":40}"#),
            "wanted event 12, the oldest held is 40"
        );
        let junk = format!("\u{1b}[31m{}", "x".repeat(1 << 20));
        let text = gap_text(&junk);
        assert!(text.len() < 200, "{text}");
        assert!(text.starts_with(r#"gap data "\u{1b}[31mxxx"#), "{text}");
        assert!(text.contains(&format!("({} bytes)", junk.len())), "{text}");
        // A short text is quoted whole; a cut falls on a character.
        assert_eq!(short("é"), "\"é\"");
        assert!(short(&"é".repeat(100)).starts_with(&format!("\"{}\"…", "é".repeat(20))));
    }

    #[test]
    fn gaps_in_a_row_back_off_and_a_steady_stream_starts_again() {
        let quick = Duration::from_millis(10);
        let mut gaps = GapBackoff::default();
        let waits: Vec<Duration> = (0..9).map(|_| gaps.after_gap(quick)).collect();
        let ms = |m: u64| Duration::from_millis(m);
        assert_eq!(
            waits,
            [
                ms(0),
                ms(250),
                ms(500),
                ms(1000),
                ms(2000),
                ms(4000),
                ms(8000),
                ms(10_000),
                ms(10_000)
            ]
        );
        // Many gaps in a row stay at the cap.
        for _ in 0..100 {
            assert_eq!(gaps.after_gap(quick), GAP_WAIT_MAX);
        }
        // A stream that lasted ends its gap with an immediate resynchronization, and the count
        // starts again.
        assert_eq!(gaps.after_gap(GAP_STEADY), Duration::ZERO);
        assert_eq!(gaps.after_gap(quick), GAP_WAIT_MIN);
    }
}
