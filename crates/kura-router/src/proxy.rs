//! The router's routes: pick a replica, forward the request unchanged, stream the answer back.
//!
//! A request goes to the replica the policy picks among those up and not yet tried for it. If the
//! connection fails before an answer (the replica is gone), the replica is marked down and the request
//! goes to the next choice: it had not started there. A 503 (a replica shutting down) is retried the
//! same way, without marking the replica down. The answer is streamed as it comes; on its way the router
//! reads the cached tokens the replica reports (`cached_tokens`, `cache_read_input_tokens`) for its
//! metrics. A client that leaves drops the replica's connection, which cancels the request there.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use kura_kv::CacheKey;
use kura_server::routing::{routing_prompt, Endpoint, RoutingPrompt};
use serde_json::{json, Value};

use crate::policy::{choose, Candidate, Policy};
use crate::{lock, Fleet};

/// A replica whose load exceeds the least loaded one's by no more than this keeps the requests of a
/// `prompt_cache_key` it served before.
const AFFINITY_SLACK: u64 = 4;
/// Most `prompt_cache_key`s remembered (the map is cleared when full).
const MAX_AFFINITY_KEYS: usize = 100_000;
/// The header naming the replica that served a response.
const REPLICA_HEADER: &str = "x-kura-replica";

/// What routing knows about a request's prompt.
#[derive(Debug, Default)]
struct Prompt {
    /// Names of its full blocks (empty when it could not be read, or no replica's layout is known).
    names: Vec<u128>,
    block_size: usize,
    tokens: usize,
    prompt_cache_key: Option<String>,
}

/// The prompt's blocks, computed as the replicas compute them (tokenized off the async workers).
async fn read_prompt(
    fleet: &Arc<Fleet>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: &Bytes,
) -> Prompt {
    let Some(info) = fleet.replicas.iter().find_map(|r| lock(&r.info).clone()) else {
        return Prompt::default();
    };
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        return Prompt::default();
    };
    if !value.is_object() {
        return Prompt::default();
    }
    let key = info
        .tenants
        .then(|| {
            kura_server::presented_keys(headers)
                .into_iter()
                .flatten()
                .next()
                .map(str::to_string)
        })
        .flatten();
    let codec = fleet.config.codec.clone();
    let model = info.model.clone();
    let read = tokio::task::spawn_blocking(move || {
        routing_prompt(endpoint, &value, &model, codec.as_ref(), key.as_deref())
    })
    .await;
    // A request the servers will refuse goes to one of them anyway, which answers with its error.
    let Ok(Ok(RoutingPrompt {
        tokens,
        cache_salt,
        prompt_cache_key,
        ..
    })) = read
    else {
        return Prompt::default();
    };
    let mut cache_key = CacheKey::new().with_model_fingerprint(info.model_fingerprint.clone());
    if let Some(salt) = cache_salt {
        cache_key = cache_key.with_salt(salt);
    }
    let names = lock(&fleet.index).prompt_names(&cache_key, &tokens, info.block_size);
    Prompt {
        names,
        block_size: info.block_size,
        tokens: tokens.len(),
        prompt_cache_key,
    }
}

/// The replica for `prompt` among those not `tried`, and how many of its blocks it holds.
fn pick(fleet: &Fleet, prompt: &Prompt, tried: &[bool]) -> Option<(usize, u64)> {
    let now = fleet.now_ms();
    let mut index = lock(&fleet.index);
    let candidates: Vec<Candidate> = fleet
        .replicas
        .iter()
        .enumerate()
        .map(|(r, rep)| Candidate {
            eligible: rep.is_up() && !tried[r],
            load: rep
                .in_flight
                .load(Ordering::Relaxed)
                .max(rep.reported_load.load(Ordering::Relaxed)),
            work_blocks: rep.work_blocks.load(Ordering::Relaxed),
            held_blocks: index.held_prefix(r, &prompt.names, now) as u64,
        })
        .collect();
    let policy = fleet.config.policy;
    let chosen = {
        let mut turn = lock(&fleet.turn);
        choose(
            policy,
            &candidates,
            prompt.names.len() as u64,
            fleet.config.overlap_weight,
            &mut turn,
        )?
    };
    let chosen = match &prompt.prompt_cache_key {
        Some(key) if policy == Policy::Kv => {
            let mut affinity = lock(&fleet.affinity);
            let least = candidates
                .iter()
                .filter(|c| c.eligible)
                .map(|c| c.load)
                .min()
                .unwrap_or(0);
            match affinity.get(key) {
                Some(&r)
                    if candidates[r].eligible
                        && candidates[r].load <= least + AFFINITY_SLACK
                        && candidates[r].held_blocks >= candidates[chosen].held_blocks =>
                {
                    r
                }
                _ => {
                    if affinity.len() >= MAX_AFFINITY_KEYS {
                        affinity.clear();
                    }
                    affinity.insert(key.clone(), chosen);
                    chosen
                }
            }
        }
        _ => chosen,
    };
    index.note_routed(chosen, &prompt.names, now);
    Some((chosen, candidates[chosen].held_blocks))
}

/// A request in flight at a replica: counted in its load until the response ends or is dropped, and its
/// blocks to prefill in the replica's work until its first bytes arrive (a stream's first token).
struct InFlight {
    fleet: Arc<Fleet>,
    replica: usize,
    /// Blocks to prefill, still counted in the replica's work.
    prefill: u64,
    /// The cached tokens the response reported, when it did.
    reported: Option<u64>,
}

impl InFlight {
    fn new(fleet: Arc<Fleet>, replica: usize, prefill: u64) -> Self {
        let rep = &fleet.replicas[replica];
        rep.in_flight.fetch_add(1, Ordering::Relaxed);
        // One more block of work for its decoding, until it ends.
        rep.work_blocks.fetch_add(prefill + 1, Ordering::Relaxed);
        Self {
            fleet,
            replica,
            prefill,
            reported: None,
        }
    }

    /// Its prefill is over: the first bytes of its answer arrived.
    fn prefilled(&mut self) {
        let rep = &self.fleet.replicas[self.replica];
        rep.work_blocks.fetch_sub(self.prefill, Ordering::Relaxed);
        self.prefill = 0;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let rep = &self.fleet.replicas[self.replica];
        rep.in_flight.fetch_sub(1, Ordering::Relaxed);
        rep.work_blocks
            .fetch_sub(self.prefill + 1, Ordering::Relaxed);
        if let Some(n) = self.reported {
            rep.reported_cached.fetch_add(n, Ordering::Relaxed);
        }
    }
}

/// The last `"cached_tokens": N` or `"cache_read_input_tokens": N` in a body that arrives in pieces.
#[derive(Default)]
struct CachedScan {
    tail: Vec<u8>,
}

impl CachedScan {
    const KEYS: [&'static [u8]; 2] = [b"\"cached_tokens\":", b"\"cache_read_input_tokens\":"];
    const TAIL: usize = 64;

    fn feed(&mut self, chunk: &[u8]) -> Option<u64> {
        let mut buf = std::mem::take(&mut self.tail);
        buf.extend_from_slice(chunk);
        let mut last = None;
        for key in Self::KEYS {
            let mut from = 0;
            while let Some(at) = find(&buf[from..], key) {
                let start = from + at + key.len();
                let rest = &buf[start..];
                let skip = rest.iter().take_while(|b| **b == b' ').count();
                let digits: Vec<u8> = rest[skip..]
                    .iter()
                    .copied()
                    .take_while(u8::is_ascii_digit)
                    .collect();
                // A number cut by the end of the piece is read again with the next one.
                let complete = skip + digits.len() < rest.len();
                if complete && !digits.is_empty() {
                    last = std::str::from_utf8(&digits)
                        .ok()
                        .and_then(|d| d.parse().ok())
                        .or(last);
                }
                from = start;
            }
        }
        let keep = buf.len().saturating_sub(Self::TAIL);
        self.tail = buf.split_off(keep);
        last
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The replica's body on its way to the client.
struct Relay {
    inner: BoxStream<'static, reqwest::Result<Bytes>>,
    scan: CachedScan,
    flight: InFlight,
}

impl Stream for Relay {
    type Item = reqwest::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let item = self.inner.poll_next_unpin(cx);
        if let Poll::Ready(Some(Ok(chunk))) = &item {
            let chunk = chunk.clone();
            self.flight.prefilled();
            if let Some(n) = self.scan.feed(&chunk) {
                self.flight.reported = Some(n);
            }
        }
        item
    }
}

fn unavailable(endpoint: Endpoint, message: &str) -> Response {
    let body = match endpoint {
        Endpoint::Messages => {
            json!({"type": "error", "error": {"type": "overloaded_error", "message": message}})
        }
        _ => {
            json!({"error": {"message": message, "type": "service_unavailable", "param": null, "code": null}})
        }
    };
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}

/// Headers not forwarded either way: the connection's own.
fn hop_by_hop(name: &HeaderName) -> bool {
    name == header::HOST
        || name == header::CONNECTION
        || name == header::CONTENT_LENGTH
        || name == header::TRANSFER_ENCODING
        || name.as_str() == "keep-alive"
}

async fn forward(
    fleet: Arc<Fleet>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let prompt = read_prompt(&fleet, endpoint, &headers, &body).await;
    let mut tried = vec![false; fleet.replicas.len()];
    loop {
        let Some((r, held)) = pick(&fleet, &prompt, &tried) else {
            fleet.unroutable.fetch_add(1, Ordering::Relaxed);
            return unavailable(
                endpoint,
                "no replica is available to serve this request; try again shortly",
            );
        };
        tried[r] = true;
        let rep = &fleet.replicas[r];
        // The work it adds there: the blocks it will prefill (and one for its decoding).
        let prefill = (prompt.names.len() as u64).saturating_sub(held);
        let flight = InFlight::new(fleet.clone(), r, prefill);
        let mut request = fleet
            .client
            .post(format!("{}{}", rep.url, endpoint.path()))
            .body(body.clone());
        for (name, value) in &headers {
            if !hop_by_hop(name) {
                request = request.header(name, value);
            }
        }
        let resp = match request.send().await {
            Ok(resp) => resp,
            Err(e) => {
                rep.failures.fetch_add(1, Ordering::Relaxed);
                fleet.mark_down(r, &format!("forwarding a request failed: {e}"));
                fleet.retries.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        if resp.status() == StatusCode::SERVICE_UNAVAILABLE && tried.iter().any(|t| !t) {
            fleet.retries.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        rep.requests.fetch_add(1, Ordering::Relaxed);
        rep.prompt_tokens
            .fetch_add(prompt.tokens as u64, Ordering::Relaxed);
        let predicted = (held as usize).saturating_mul(prompt.block_size) as u64;
        rep.predicted_cached.fetch_add(predicted, Ordering::Relaxed);
        let mut out = Response::builder().status(resp.status());
        if let Some(h) = out.headers_mut() {
            for (name, value) in resp.headers() {
                if !hop_by_hop(name) {
                    h.insert(name.clone(), value.clone());
                }
            }
            h.insert(REPLICA_HEADER, HeaderValue::from(r));
        }
        let relay = Relay {
            inner: resp.bytes_stream().boxed(),
            scan: CachedScan::default(),
            flight,
        };
        return out
            .body(Body::from_stream(relay))
            .unwrap_or_else(|e| unavailable(endpoint, &format!("building the response: {e}")));
    }
}

pub(crate) async fn chat_completions(
    State(fleet): State<Arc<Fleet>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    forward(fleet, Endpoint::ChatCompletions, headers, body).await
}

pub(crate) async fn completions(
    State(fleet): State<Arc<Fleet>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    forward(fleet, Endpoint::Completions, headers, body).await
}

pub(crate) async fn messages(
    State(fleet): State<Arc<Fleet>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    forward(fleet, Endpoint::Messages, headers, body).await
}

/// `GET /v1/models`: the first replica up answers.
pub(crate) async fn models(State(fleet): State<Arc<Fleet>>, headers: HeaderMap) -> Response {
    for rep in fleet.replicas.iter().filter(|r| r.is_up()) {
        let mut request = fleet.client.get(format!("{}/v1/models", rep.url));
        for (name, value) in &headers {
            if !hop_by_hop(name) {
                request = request.header(name, value);
            }
        }
        if let Ok(resp) = request.send().await {
            let status = resp.status();
            if let Ok(bytes) = resp.bytes().await {
                return (status, [(header::CONTENT_TYPE, "application/json")], bytes)
                    .into_response();
            }
        }
    }
    unavailable(Endpoint::ChatCompletions, "no replica is available")
}

/// `GET /health`: 200 while a replica is up.
pub(crate) async fn health(State(fleet): State<Arc<Fleet>>) -> Response {
    let up = fleet.replicas.iter().filter(|r| r.is_up()).count();
    let status = if up > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({"replicas": fleet.replicas.len(), "replicas_up": up})),
    )
        .into_response()
}

pub(crate) async fn metrics(State(fleet): State<Arc<Fleet>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        fleet.metrics_text(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_tokens_are_found_across_pieces() {
        let body = br#"data: {"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens": 32}}}"#;
        for cut in 1..body.len() {
            let mut scan = CachedScan::default();
            let mut last = scan.feed(&body[..cut]);
            last = scan.feed(&body[cut..]).or(last);
            assert_eq!(last, Some(32), "cut at {cut}");
        }
        let mut scan = CachedScan::default();
        assert_eq!(
            scan.feed(br#"{"usage":{"cache_read_input_tokens":16,"input_tokens":3}}"#),
            Some(16)
        );
        assert_eq!(CachedScan::default().feed(b"{\"usage\":{}}"), None);
    }
}
