//! The router's routes: pick a replica, forward the request unchanged, stream the answer back.
//!
//! A request goes to the replica the policy picks among those up and not yet tried for it. What a
//! replica answers, whatever its status (400, 401, 413…), is the client's answer: a refused request
//! says nothing of the replica's health. A failed send is told apart by its cause:
//!
//! - the connection could not be made (nothing listens there): the replica is marked down and the
//!   request goes to the next choice, where it had not started;
//! - the connection broke after it was made: the replica may have died, or may have refused the
//!   request's body and closed (a replica closes a connection whose body it will not read). The replica
//!   is checked at once: down, and the request goes to the next choice; alive, and the client gets 502
//!   while the replica keeps its place.
//!
//! A 503 (a replica shutting down) is retried the same way, without marking the replica down. The
//! answer is streamed as it comes; on its way the router reads the cached tokens the replica reports
//! (`cached_tokens`, `cache_read_input_tokens`) for its metrics. A stream cut by its replica ends with an
//! error event (OpenAI's or Anthropic's shape), never a silently short 200; a cut non-streamed answer
//! aborts the client's connection. A client that leaves drops the replica's connection, which cancels
//! the request there.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use kura_api::routing::{previous_response_id, routing_prompt, Endpoint, RoutingPrompt};
use kura_api::{same_key, AnthropicError, ApiError};
use kura_kv::CacheKey;
use serde_json::{json, Value};

use crate::responses::{home_of, IdScan};
use crate::{lock, Fleet};
use kura_fleet::index::prompt_names;
use kura_fleet::{choose, Candidate, Policy};

/// A replica whose load exceeds the least loaded one's by no more than this keeps the requests of a
/// `prompt_cache_key` it served before.
const AFFINITY_SLACK: u64 = 4;
/// Most `prompt_cache_key`s remembered (when full, the scope holding the most gives way:
/// [`make_room`]).
const MAX_AFFINITY_KEYS: usize = 100_000;

/// Room for one more entry in a map of `max` entries, each kept for an owner (`owner_of`: a tenant, or
/// an API key's digest): when the map is full, every entry of the owner holding the most (at least a
/// sixteenth of the map) is dropped, as the pool's pins give way, so that one tenant's flood of keys
/// clears its own and not the others'; with no such owner, the whole map.
pub(crate) fn make_room<K, V, O: Eq + std::hash::Hash>(
    map: &mut std::collections::HashMap<K, V>,
    max: usize,
    owner_of: impl Fn(&K) -> O,
) {
    if map.len() < max {
        return;
    }
    let mut counts: std::collections::HashMap<O, usize> = std::collections::HashMap::new();
    for k in map.keys() {
        *counts.entry(owner_of(k)).or_default() += 1;
    }
    match counts.into_iter().max_by_key(|(_, n)| *n) {
        // A flood spread over many owners (new salts or unchecked keys, one entry each) has no
        // largest owner to give way: the map is cleared, so that the count runs once a fill, not once
        // an entry, and no owner pays for the others' spread.
        Some((largest, n)) if n >= max / ROOM_SHARE => map.retain(|k, _| owner_of(k) != largest),
        _ => map.clear(),
    }
}

/// The share of a full map ([`make_room`]) its largest owner must hold to give way alone.
const ROOM_SHARE: usize = 16;

/// Whose an affinity key is: the tenant its cache salt starts with (a salt of its own after the
/// separator does not make another owner, so that many salts are still one tenant's keys); without
/// tenants, the salt.
fn affinity_owner((scope, _): &AffinityKey) -> Option<String> {
    scope.as_deref().map(|s| {
        s.split(kura_api::keys::TENANT_SEPARATOR)
            .next()
            .unwrap_or(s)
            .to_string()
    })
}
/// The header naming the replica that served a response.
pub(crate) const REPLICA_HEADER: &str = "x-kura-replica";
/// Longest wait for a tokenizer slot; past it the request is routed without its prompt's blocks.
const TOKENIZER_WAIT: Duration = Duration::from_millis(50);
/// Most bytes of an unfinished SSE event held back (a stream without event boundaries is passed on).
const MAX_SSE_TAIL: usize = 1 << 20;
/// What a client is told when its replica fails in the middle of its answer.
const FAILED_MID_STREAM: &str = "the replica serving this request failed mid-stream";

/// The API key a request was authenticated with (set by [`authenticate`] when the router has keys).
#[derive(Clone)]
pub(crate) struct ClientKey(String);

#[cfg(test)]
impl ClientKey {
    pub(crate) fn for_tests(key: &str) -> Self {
        ClientKey(key.to_string())
    }
}

/// The API key a request is served under: the one [`authenticate`] accepted (with keys configured, a
/// request may also present another, unknown one), else the first it presents.
pub(crate) fn client_key(accepted: Option<&ClientKey>, headers: &HeaderMap) -> Option<String> {
    match accepted {
        Some(ClientKey(key)) => Some(key.clone()),
        None => kura_api::presented_keys(headers)
            .into_iter()
            .flatten()
            .next()
            .map(str::to_string),
    }
}

/// An error in the route's API shape: Anthropic's on `/v1/messages`, OpenAI's elsewhere.
fn api_error(endpoint: Endpoint, e: ApiError) -> Response {
    if endpoint.anthropic() {
        AnthropicError(e).into_response()
    } else {
        e.into_response()
    }
}

/// With API keys configured, lets a request with one of them through (noting which) and answers 401
/// to any other before its body is read.
pub(crate) async fn authenticate(
    State(fleet): State<Arc<Fleet>>,
    mut req: Request,
    next: Next,
) -> Response {
    let keys = &fleet.config.api_keys;
    if keys.is_empty() {
        return next.run(req).await;
    }
    let [bearer, x_api_key] = kura_api::presented_keys(req.headers());
    let known = |k: Option<&str>| k.and_then(|k| keys.iter().find(|x| same_key(x, k)));
    match known(bearer).or_else(|| known(x_api_key)) {
        Some(key) => {
            let key = ClientKey(key.clone());
            req.extensions_mut().insert(key);
            next.run(req).await
        }
        None => {
            fleet.unauthorized.fetch_add(1, Ordering::Relaxed);
            let path = req.uri().path();
            let endpoint = [Endpoint::Messages, Endpoint::MessagesCountTokens]
                .into_iter()
                .find(|e| e.path() == path)
                .unwrap_or(Endpoint::ChatCompletions);
            api_error(endpoint, ApiError::Unauthorized)
        }
    }
}

/// What routing knows about a request's prompt.
#[derive(Debug, Default)]
struct Prompt {
    /// Names of its full blocks (empty when it could not be read, or no replica's layout is known).
    names: Vec<u128>,
    block_size: usize,
    tokens: usize,
    /// The prompt is scored: a replica computes it whole whatever it holds, so the choice counts no
    /// held block (its blocks are still noted as routed there: it caches them).
    scored: bool,
    /// The request's `prompt_cache_key`, scoped to its cache salt (its tenant and own salt): one
    /// tenant's key never names where another tenant's requests went.
    prompt_cache_key: Option<AffinityKey>,
}

/// A `prompt_cache_key` within the cache salt of the request that gave it.
pub(crate) type AffinityKey = (Option<String>, String);

/// The prompt's blocks, computed as the replicas compute them (parsed and tokenized on the blocking
/// pool, at most `tokenizer_threads` at once). `client_key` is the API key the request presents.
async fn read_prompt(
    fleet: &Arc<Fleet>,
    endpoint: Endpoint,
    client_key: Option<String>,
    body: Bytes,
) -> Prompt {
    let (Some(namer), Some(tenants)) = (fleet.namer.clone(), fleet.tenants.as_ref()) else {
        return Prompt::default();
    };
    let Some(info) = fleet.replicas.iter().find_map(|r| lock(&r.info).clone()) else {
        return Prompt::default();
    };
    let tenant = match info.tenants {
        true => client_key.map(|k| tenants.tenant_of_key(&k)),
        false => None,
    };
    let wait = tokio::time::timeout(TOKENIZER_WAIT, fleet.tokenizer.clone().acquire_owned());
    let Ok(Ok(permit)) = wait.await else {
        fleet.tokenizer_busy.fetch_add(1, Ordering::Relaxed);
        return Prompt::default();
    };
    let (fleet, codec) = (fleet.clone(), fleet.config.codec.clone());
    let read = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let value = serde_json::from_slice::<Value>(&body).ok()?;
        if !value.is_object() {
            return None;
        }
        fleet.tokenized.fetch_add(1, Ordering::Relaxed);
        // A request the servers will refuse goes to one of them anyway, which answers with its error.
        let RoutingPrompt {
            tokens,
            cache_salt,
            prompt_cache_key,
            scored,
            ..
        } = routing_prompt(endpoint, &value, &info.model, codec.as_ref(), tenant).ok()?;
        let mut key = CacheKey::new().with_model_fingerprint(info.model_fingerprint.clone());
        if let Some(salt) = &cache_salt {
            key = key.with_salt(salt.clone());
        }
        let mut namer = namer;
        Some(Prompt {
            names: prompt_names(&mut namer, &key, &tokens, info.block_size),
            block_size: info.block_size,
            tokens: tokens.len(),
            scored,
            prompt_cache_key: prompt_cache_key.map(|k| (cache_salt, k)),
        })
    })
    .await;
    read.ok().flatten().unwrap_or_default()
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
            eligible: rep.routable() && !tried[r],
            load: rep
                .in_flight
                .load(Ordering::Relaxed)
                .max(rep.reported_load.load(Ordering::Relaxed)),
            work_blocks: rep.work_blocks.load(Ordering::Relaxed),
            held_blocks: match prompt.scored {
                true => 0,
                false => index.held_prefix(r, &prompt.names, now) as u64,
            },
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
        // A scored prompt holds nothing anywhere: the least work decides, not the key's replica.
        Some(key) if policy == Policy::Kv && !prompt.scored => {
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
                        && candidates[r].load <= least.saturating_add(AFFINITY_SLACK)
                        && candidates[r].held_blocks >= candidates[chosen].held_blocks =>
                {
                    r
                }
                _ => {
                    if !affinity.contains_key(key) {
                        make_room(&mut affinity, MAX_AFFINITY_KEYS, affinity_owner);
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

/// Where `needle` first occurs in `hay`.
pub(crate) fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The bytes of an SSE body after its last complete event (`\n\n`), held back until the event
/// completes, so that an error event appended after a cut starts on an event boundary.
#[derive(Default)]
struct SseTail(Vec<u8>);

impl SseTail {
    /// Adds `chunk`; returns what is ready to send: everything up to the last event boundary.
    fn feed(&mut self, chunk: &[u8]) -> Option<Bytes> {
        let from = self.0.len().saturating_sub(1);
        self.0.extend_from_slice(chunk);
        let end = match self.0[from..].windows(2).rposition(|w| w == b"\n\n") {
            Some(at) => from + at + 2,
            // An event larger than the bound is passed on as it comes.
            None if self.0.len() > MAX_SSE_TAIL => self.0.len(),
            None => return None,
        };
        let rest = self.0.split_off(end);
        Some(Bytes::from(std::mem::replace(&mut self.0, rest)))
    }

    /// What is left when the body ends.
    fn finish(&mut self) -> Option<Bytes> {
        (!self.0.is_empty()).then(|| Bytes::from(std::mem::take(&mut self.0)))
    }
}

/// The event that ends a stream whose replica failed, in the route's API shape.
fn failure_event(endpoint: Endpoint) -> Bytes {
    let text = match endpoint {
        e if e.anthropic() => {
            let data = json!({"type": "error", "error": {"type": "api_error", "message": FAILED_MID_STREAM}});
            format!("event: error\ndata: {data}\n\n")
        }
        _ => {
            let data = json!({"error": {"message": FAILED_MID_STREAM, "type": "server_error",
                "param": null, "code": "replica_failed"}});
            format!("data: {data}\n\n")
        }
    };
    Bytes::from(text)
}

/// The replica's body on its way to the client.
struct Relay {
    inner: BoxStream<'static, reqwest::Result<Bytes>>,
    scan: CachedScan,
    flight: InFlight,
    endpoint: Endpoint,
    /// `Some` when the answer is an SSE stream.
    sse: Option<SseTail>,
    /// `Some` while a Responses answer's id (where the response is stored) has not been seen.
    ids: Option<IdScan>,
    /// Whose key the request presented ([`crate::responses::Homes::owner_of`]).
    owner: u64,
    done: bool,
}

impl Relay {
    /// The replica's body broke: have the replica checked now (a dead one is drained at once).
    fn replica_failed(&self, e: &reqwest::Error) {
        let (fleet, r) = (self.flight.fleet.clone(), self.flight.replica);
        tracing::warn!(replica = %fleet.replicas[r].url, error = %e,
            "a replica's answer broke off mid-way: checking the replica");
        tokio::spawn(async move {
            fleet.confirm_alive(r).await;
        });
    }
}

impl Stream for Relay {
    type Item = reqwest::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            let item = match self.inner.poll_next_unpin(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(item) => item,
            };
            match item {
                Some(Ok(chunk)) => {
                    self.flight.prefilled();
                    if let Some(n) = self.scan.feed(&chunk) {
                        self.flight.reported = Some(n);
                    }
                    if let Some(id) = self.ids.as_mut().and_then(|s| s.feed(&chunk)) {
                        let owner = self.owner;
                        self.flight.fleet.homes.note(owner, id, self.flight.replica);
                        self.ids = None;
                    }
                    match self.sse.as_mut() {
                        None => return Poll::Ready(Some(Ok(chunk))),
                        Some(tail) => {
                            if let Some(ready) = tail.feed(&chunk) {
                                return Poll::Ready(Some(Ok(ready)));
                            }
                        }
                    }
                }
                Some(Err(e)) => {
                    self.replica_failed(&e);
                    self.done = true;
                    // A stream ends with an error event in place of its unfinished one; any other
                    // answer ends with the error, which aborts the client's connection.
                    return Poll::Ready(Some(match self.sse {
                        Some(_) => Ok(failure_event(self.endpoint)),
                        None => Err(e),
                    }));
                }
                None => {
                    self.done = true;
                    return Poll::Ready(self.sse.as_mut().and_then(SseTail::finish).map(Ok));
                }
            }
        }
    }
}

pub(crate) fn unavailable(endpoint: Endpoint, message: &str) -> Response {
    let body = match endpoint {
        e if e.anthropic() => {
            json!({"type": "error", "error": {"type": "overloaded_error", "message": message}})
        }
        _ => {
            json!({"error": {"message": message, "type": "service_unavailable", "param": null, "code": null}})
        }
    };
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}

/// 502: the replica's connection broke before it answered, and the replica is alive.
fn bad_gateway(endpoint: Endpoint, message: &str) -> Response {
    let body = match endpoint {
        e if e.anthropic() => {
            json!({"type": "error", "error": {"type": "api_error", "message": message}})
        }
        _ => {
            json!({"error": {"message": message, "type": "server_error", "param": null, "code": "bad_gateway"}})
        }
    };
    (StatusCode::BAD_GATEWAY, Json(body)).into_response()
}

/// Headers not forwarded either way: the connection's own.
pub(crate) fn hop_by_hop(name: &HeaderName) -> bool {
    name == header::HOST
        || name == header::CONNECTION
        || name == header::CONTENT_LENGTH
        || name == header::TRANSFER_ENCODING
        || name.as_str() == "keep-alive"
}

/// `request` with the client's headers but the connection's own.
pub(crate) fn with_headers(
    mut request: reqwest::RequestBuilder,
    headers: &HeaderMap,
) -> reqwest::RequestBuilder {
    for (name, value) in headers {
        if !hop_by_hop(name) {
            request = request.header(name, value);
        }
    }
    request
}

/// The head of the client's answer to replica `r`'s `resp`: its status and headers (but the
/// connection's own), and the replica's number where `show_replica` (`--replica-header`: a client
/// that sees where its requests went learns where the others' went, and under `round-robin` how many
/// there were).
pub(crate) fn relayed_head(
    resp: &reqwest::Response,
    r: usize,
    show_replica: bool,
) -> axum::http::response::Builder {
    let mut out = Response::builder().status(resp.status());
    if let Some(h) = out.headers_mut() {
        for (name, value) in resp.headers() {
            if !hop_by_hop(name) {
                h.insert(name.clone(), value.clone());
            }
        }
        if show_replica {
            h.insert(REPLICA_HEADER, HeaderValue::from(r));
        }
    }
    out
}

/// The request's body, within the body limit (413) and the body timeout (408).
async fn read_body(fleet: &Fleet, endpoint: Endpoint, req: Request) -> Result<Bytes, Response> {
    let limit_bytes = fleet.config.max_body_bytes;
    // A body announced larger than the limit is refused from the head, without reading it.
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if announced.is_some_and(|n| n > limit_bytes as u64) {
        return Err(api_error(endpoint, ApiError::BodyTooLarge { limit_bytes }));
    }
    let timeout = fleet.config.body_timeout;
    let read = tokio::time::timeout(timeout, Bytes::from_request(req, &())).await;
    let error = match read {
        Ok(Ok(bytes)) => return Ok(bytes),
        Err(_) => ApiError::BodyTimeout {
            seconds: timeout.as_secs_f64(),
        },
        Ok(Err(rejection)) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            ApiError::BodyTooLarge { limit_bytes }
        }
        Ok(Err(rejection)) => ApiError::invalid(
            format!("could not read the request body: {}", rejection.body_text()),
            None,
        ),
    };
    Err(api_error(endpoint, error))
}

/// What a failed send says about the replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SendFailure {
    /// No connection could be made: nothing serves there.
    Unreachable,
    /// The connection broke after it was made: the replica died, or refused the request and closed.
    Broken,
}

impl SendFailure {
    fn of(e: &reqwest::Error) -> Self {
        if e.is_connect() {
            SendFailure::Unreachable
        } else {
            SendFailure::Broken
        }
    }
}

async fn forward(fleet: Arc<Fleet>, endpoint: Endpoint, req: Request) -> Response {
    let client_key = client_key(req.extensions().get::<ClientKey>(), req.headers());
    let owner = fleet.homes.owner_of(client_key.as_deref());
    let headers = req.headers().clone();
    let body = match read_body(&fleet, endpoint, req).await {
        Ok(body) => body,
        Err(response) => return response,
    };
    // A request that continues a stored response goes to the server holding it, and only there (the
    // others would answer that they do not know it); where none does, the policy picks one, which says so.
    // Its prompt starts with a conversation only that server knows: it is not tokenized here.
    let previous = match endpoint.continues_responses() {
        true => {
            let b = body.clone();
            tokio::task::spawn_blocking(move || previous_response_id(&b))
                .await
                .ok()
                .flatten()
        }
        false => None,
    };
    let mut tried = vec![false; fleet.replicas.len()];
    if let Some(id) = &previous {
        if let Some(home) = home_of(&fleet, id, &headers, owner).await {
            fleet.homes.routed.fetch_add(1, Ordering::Relaxed);
            for (r, t) in tried.iter_mut().enumerate() {
                *t = r != home;
            }
        }
    }
    // A request that runs no prompt (a token count) is placed without blocks (by work and load, or in turn),
    // and the index is not told that a replica holds blocks it was never asked to compute.
    let prompt = if endpoint.runs_prompt() && previous.is_none() {
        read_prompt(&fleet, endpoint, client_key, body.clone()).await
    } else {
        Prompt::default()
    };
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
        request = with_headers(request, &headers);
        let resp = match request.send().await {
            Ok(resp) => resp,
            Err(e) => {
                rep.failures.fetch_add(1, Ordering::Relaxed);
                drop(flight);
                let alive = match SendFailure::of(&e) {
                    SendFailure::Unreachable => {
                        fleet.mark_down(r, &format!("forwarding a request failed: {e}"));
                        false
                    }
                    SendFailure::Broken => fleet.confirm_alive(r).await,
                };
                if alive {
                    tracing::info!(replica = %rep.url, error = %e,
                        "a replica closed a request's connection before answering and is alive: 502");
                    return bad_gateway(
                        endpoint,
                        "the replica closed the connection before answering this request",
                    );
                }
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
        let status = resp.status();
        let sse = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
        let out = relayed_head(&resp, r, fleet.config.replica_header);
        let relay = Relay {
            inner: resp.bytes_stream().boxed(),
            scan: CachedScan::default(),
            flight,
            endpoint,
            sse: sse.then(SseTail::default),
            ids: (endpoint == Endpoint::Responses && status.is_success()).then(IdScan::default),
            owner,
            done: false,
        };
        return out
            .body(Body::from_stream(relay))
            .unwrap_or_else(|e| unavailable(endpoint, &format!("building the response: {e}")));
    }
}

pub(crate) async fn chat_completions(State(fleet): State<Arc<Fleet>>, req: Request) -> Response {
    forward(fleet, Endpoint::ChatCompletions, req).await
}

pub(crate) async fn completions(State(fleet): State<Arc<Fleet>>, req: Request) -> Response {
    forward(fleet, Endpoint::Completions, req).await
}

pub(crate) async fn messages(State(fleet): State<Arc<Fleet>>, req: Request) -> Response {
    forward(fleet, Endpoint::Messages, req).await
}

pub(crate) async fn count_tokens(State(fleet): State<Arc<Fleet>>, req: Request) -> Response {
    forward(fleet, Endpoint::MessagesCountTokens, req).await
}

pub(crate) async fn responses(State(fleet): State<Arc<Fleet>>, req: Request) -> Response {
    forward(fleet, Endpoint::Responses, req).await
}

pub(crate) async fn responses_input_tokens(
    State(fleet): State<Arc<Fleet>>,
    req: Request,
) -> Response {
    forward(fleet, Endpoint::ResponsesInputTokens, req).await
}

/// `GET /v1/models`: the first replica up answers.
pub(crate) async fn models(State(fleet): State<Arc<Fleet>>, headers: HeaderMap) -> Response {
    for rep in fleet.replicas.iter().filter(|r| r.is_up()) {
        let mut request = fleet.client.get(format!("{}/v1/models", rep.url));
        request = with_headers(request, &headers);
        if let Ok(resp) = request.send().await {
            let status = resp.status();
            // A model list is a few hundred bytes; one past this limit is not taken from a replica.
            if let Some(bytes) = crate::replica::read_bounded(resp, 1 << 20).await {
                return (status, [(header::CONTENT_TYPE, "application/json")], bytes)
                    .into_response();
            }
        }
    }
    unavailable(Endpoint::ChatCompletions, "no replica is available")
}

/// `GET /health`: 200 while a replica is up. `replicas_up` counts the servers requests may go to: an
/// address that is up but reaches a server an earlier address already names is counted apart, in
/// `duplicates`, not as a second replica.
pub(crate) async fn health(State(fleet): State<Arc<Fleet>>) -> Response {
    let up = fleet.replicas.iter().filter(|r| r.routable()).count();
    let duplicates = fleet
        .replicas
        .iter()
        .filter(|r| r.is_up() && r.is_duplicate())
        .count();
    let status = if up > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({
            "replicas": fleet.replicas.len(),
            "replicas_up": up,
            "duplicates": duplicates,
        })),
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
    fn a_full_map_makes_room_from_its_largest_owner() {
        let mut map: std::collections::HashMap<AffinityKey, usize> = Default::default();
        let a = Some("tenant-a".to_string());
        let b = Some("tenant-b".to_string());
        for i in 0..10 {
            map.insert((a.clone(), format!("a{i}")), 0);
        }
        // B fills the rest with a flood of keys, each under a salt of its own.
        let mut i = 0;
        while map.len() < MAX_AFFINITY_KEYS {
            let salted = Some(format!("tenant-b{}{i}", kura_api::keys::TENANT_SEPARATOR));
            map.insert((salted, format!("b{i}")), 1);
            i += 1;
        }
        make_room(&mut map, MAX_AFFINITY_KEYS, affinity_owner);
        // B's keys are gone, A's all kept.
        assert_eq!(map.len(), 10);
        assert!(map.keys().all(|(scope, _)| *scope == a));
        // Below the bound, nothing is dropped.
        make_room(&mut map, MAX_AFFINITY_KEYS, affinity_owner);
        assert_eq!(map.len(), 10);
        // A flood of one key each under new salts without tenants: no owner gives way alone, and
        // the map is cleared once rather than scanned for every new key.
        let mut i = 0;
        while map.len() < MAX_AFFINITY_KEYS {
            map.insert((Some(format!("salt-{i}")), format!("k{i}")), 1);
            i += 1;
        }
        make_room(&mut map, MAX_AFFINITY_KEYS, affinity_owner);
        assert!(map.is_empty());
        assert_eq!(affinity_owner(&(b.clone(), "k".into())), b);
        assert_eq!(affinity_owner(&(None, "k".into())), None);
    }

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
