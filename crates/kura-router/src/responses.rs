//! OpenAI's Responses API through the router. A stored response lives on the server that made it, so a
//! request that continues one (`previous_response_id`, on `POST /v1/responses` and
//! `/v1/responses/input_tokens`) and `GET` / `DELETE /v1/responses/{id}` go to that server; a new
//! conversation is placed by its prompt's blocks like a chat request.
//!
//! The router learns where each response lives from the answers it relays (the first `"id":"resp_…"` of
//! a response body or stream, the response's own id). An id it has not seen (made before the router
//! started, or forgotten past [`MAX_HOMES`]) is looked for: the replicas up are asked in turn
//! (`GET /v1/responses/{id}` with the client's key and nothing else of its request), and the first that
//! has it is where it lives. Ownership stays the servers' to check: a server answers "not found" for
//! another tenant's response whoever asks. The table is kept per presented key, so that another
//! key's id is looked for as an unknown one is, and its answer says nothing of where it lives.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Extension, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use kura_api::body::PathId;
use kura_api::routing::Endpoint;
use kura_api::ApiError;

use crate::proxy::{client_key, find, relayed_head, unavailable, with_headers, ClientKey};
use crate::{lock, Fleet};

/// Most response ids whose server the router remembers (when full, the key holding the most gives
/// way; an id then forgotten is looked for again).
pub(crate) const MAX_HOMES: usize = 100_000;
/// Longest wait for one replica's answer to whether it holds a response.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// The id prefix of the servers' stored responses.
const ID_PREFIX: &[u8] = b"resp_";
/// Longest response id looked for or sent on (the servers' are 29 characters).
const MAX_ID_LEN: usize = 128;

/// Where each stored response lives, as far as the router has seen, by the key that made or found it.
#[derive(Default)]
pub(crate) struct Homes {
    map: Mutex<HashMap<(u64, String), usize>>,
    /// Keys the digests of presented API keys (drawn at each start: the table holds no key).
    keys: std::collections::hash_map::RandomState,
    /// Replicas asked whether they hold a response the table did not name.
    pub probes: AtomicU64,
    /// Requests sent to the server holding the response they name.
    pub routed: AtomicU64,
}

impl Homes {
    /// The owner of a request served under `key` ([`crate::proxy::client_key`]): a keyed digest of it
    /// (one value for none).
    pub fn owner_of(&self, key: Option<&str>) -> u64 {
        use std::hash::BuildHasher;
        self.keys.hash_one(key)
    }

    /// Response `id`, made or found with `owner`'s key, lives on `replica`.
    pub fn note(&self, owner: u64, id: String, replica: usize) {
        let mut map = lock(&self.map);
        let key = (owner, id);
        if !map.contains_key(&key) {
            crate::proxy::make_room(&mut map, MAX_HOMES, |(owner, _)| *owner);
        }
        map.insert(key, replica);
    }

    fn forget(&self, owner: u64, id: &str) {
        lock(&self.map).remove(&(owner, id.to_string()));
    }

    fn get(&self, owner: u64, id: &str) -> Option<usize> {
        lock(&self.map).get(&(owner, id.to_string())).copied()
    }

    /// Response ids whose server the table names.
    pub fn len(&self) -> usize {
        lock(&self.map).len()
    }
}

/// Whether `id` can be a server's response id and go into a URL path as it is.
fn plausible_id(id: &str) -> bool {
    id.len() <= MAX_ID_LEN
        && id.as_bytes().starts_with(ID_PREFIX)
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The replica up that holds stored response `id`: the one the table names, else the first replica up
/// that answers `GET /v1/responses/{id}` with 200 for the client's key (taken from `headers`); `None`
/// when none does.
pub(crate) async fn home_of(
    fleet: &Fleet,
    id: &str,
    headers: &HeaderMap,
    owner: u64,
) -> Option<usize> {
    if !plausible_id(id) {
        return None;
    }
    if let Some(r) = fleet.homes.get(owner, id) {
        if fleet.replicas[r].routable() {
            return Some(r);
        }
    }
    for (r, rep) in fleet.replicas.iter().enumerate() {
        if !rep.routable() {
            continue;
        }
        fleet.homes.probes.fetch_add(1, Ordering::Relaxed);
        let mut ask = fleet
            .client
            .get(format!("{}/v1/responses/{id}", rep.url))
            .timeout(PROBE_TIMEOUT);
        for name in [header::AUTHORIZATION.as_str(), "x-api-key"] {
            if let Some(v) = headers.get(name) {
                ask = ask.header(name, v);
            }
        }
        if let Ok(resp) = ask.send().await {
            if resp.status() == StatusCode::OK {
                fleet.homes.note(owner, id.to_string(), r);
                return Some(r);
            }
        }
    }
    None
}

/// The first response id (`"id":"resp_…"`) of a body that arrives in pieces: a response object's own
/// id comes before those of its output items, and a stream's first event (`response.created`) holds
/// the response.
#[derive(Default)]
pub(crate) struct IdScan {
    tail: Vec<u8>,
}

impl IdScan {
    const KEY: &'static [u8] = b"\"id\":\"";
    /// Bytes kept from one piece to the next: a key and an id cut by a piece's end.
    const TAIL: usize = 6 + MAX_ID_LEN + 1;

    /// Adds `chunk`; the first response id once it is complete in what came so far.
    pub fn feed(&mut self, chunk: &[u8]) -> Option<String> {
        let mut buf = std::mem::take(&mut self.tail);
        buf.extend_from_slice(chunk);
        let mut from = 0;
        while let Some(at) = find(&buf[from..], Self::KEY) {
            let start = from + at + Self::KEY.len();
            let rest = &buf[start..];
            if rest.starts_with(ID_PREFIX) || ID_PREFIX.starts_with(rest) {
                match rest.iter().position(|b| *b == b'"') {
                    Some(end) => {
                        let id = std::str::from_utf8(&rest[..end]).ok();
                        if let Some(id) = id.filter(|id| plausible_id(id)) {
                            return Some(id.to_string());
                        }
                    }
                    // Cut by the piece's end: read again with the next one.
                    None if rest.len() <= MAX_ID_LEN => {
                        self.tail = buf[from + at..].to_vec();
                        return None;
                    }
                    None => {}
                }
            }
            from = start;
        }
        let keep = buf.len().saturating_sub(Self::TAIL);
        self.tail = buf.split_off(keep);
        None
    }
}

/// `GET /v1/responses/{id}`.
pub(crate) async fn get(
    State(fleet): State<Arc<Fleet>>,
    accepted: Option<Extension<ClientKey>>,
    PathId(id): PathId,
    headers: HeaderMap,
) -> Response {
    let owner = fleet
        .homes
        .owner_of(client_key(accepted.as_deref(), &headers).as_deref());
    by_id(fleet, Method::GET, id, headers, owner).await
}

/// `DELETE /v1/responses/{id}`.
pub(crate) async fn delete(
    State(fleet): State<Arc<Fleet>>,
    accepted: Option<Extension<ClientKey>>,
    PathId(id): PathId,
    headers: HeaderMap,
) -> Response {
    let owner = fleet
        .homes
        .owner_of(client_key(accepted.as_deref(), &headers).as_deref());
    by_id(fleet, Method::DELETE, id, headers, owner).await
}

/// Sends a request for stored response `id` to the server holding it, and its answer back. An id that
/// no server holds is "not found", in the servers' words. `owner`: whose key the request is served
/// under ([`Homes::owner_of`]).
async fn by_id(
    fleet: Arc<Fleet>,
    method: Method,
    id: String,
    headers: HeaderMap,
    owner: u64,
) -> Response {
    let Some(r) = home_of(&fleet, &id, &headers, owner).await else {
        return ApiError::ResponseNotFound(id).into_response();
    };
    fleet.homes.routed.fetch_add(1, Ordering::Relaxed);
    let rep = &fleet.replicas[r];
    let request = fleet
        .client
        .request(method.clone(), format!("{}/v1/responses/{id}", rep.url));
    let resp = match with_headers(request, &headers).send().await {
        Ok(resp) => resp,
        Err(e) => {
            rep.failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(replica = %rep.url, error = %e, "a stored response's server did not answer");
            return unavailable(
                Endpoint::Responses,
                &format!("the server holding response {id:?} did not answer; try again shortly"),
            );
        }
    };
    let status = resp.status();
    if method == Method::DELETE && status.is_success() {
        fleet.homes.forget(owner, &id);
    }
    relayed_head(&resp, r, fleet.config.replica_header)
        .body(Body::from_stream(resp.bytes_stream().boxed()))
        .unwrap_or_else(|e| {
            ApiError::Internal(format!("building the response: {e}")).into_response()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_response_id_is_found_across_pieces() {
        let body = br#"data: {"type":"response.created","response":{"id":"resp_0123456789abcdef01234567","output":[{"id":"msg_1"}]}}"#;
        for cut in 1..body.len() {
            let mut scan = IdScan::default();
            let found = scan.feed(&body[..cut]).or_else(|| scan.feed(&body[cut..]));
            assert_eq!(
                found.as_deref(),
                Some("resp_0123456789abcdef01234567"),
                "cut at {cut}"
            );
        }
        // Item ids and ids of another shape are not response ids.
        let mut scan = IdScan::default();
        assert_eq!(scan.feed(br#"{"id":"msg_1","x":{"id":"call_2"}}"#), None);
        assert_eq!(scan.feed(br#"{"id":"resp_../../x"}"#), None);
        assert_eq!(
            scan.feed(br#"{"id":"resp_ok"}"#).as_deref(),
            Some("resp_ok")
        );
    }

    #[test]
    fn only_ids_of_the_servers_shape_go_into_a_path() {
        assert!(plausible_id("resp_0123456789abcdef01234567"));
        for bad in [
            "",
            "resp_a/b",
            "resp_a?b",
            "msg_1",
            "resp_%2e",
            &"resp_x".repeat(40),
        ] {
            assert!(!plausible_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn the_table_is_bounded() {
        let homes = Homes::default();
        for i in 0..MAX_HOMES + 5 {
            homes.note(7, format!("resp_{i}"), i % 3);
        }
        assert!(homes.len() <= MAX_HOMES);
        assert_eq!(
            homes.get(7, &format!("resp_{}", MAX_HOMES + 4)),
            Some((MAX_HOMES + 4) % 3)
        );
        // Another key's ids are kept when one key fills the table: that key gives way.
        let homes = Homes::default();
        homes.note(1, "resp_mine".into(), 2);
        for i in 0..MAX_HOMES + 5 {
            homes.note(7, format!("resp_{i}"), i % 3);
        }
        assert_eq!(homes.get(1, "resp_mine"), Some(2));
        assert!(homes.len() <= MAX_HOMES);
        homes.forget(7, &format!("resp_{}", MAX_HOMES + 4));
        assert_eq!(homes.get(7, &format!("resp_{}", MAX_HOMES + 4)), None);
    }

    #[test]
    fn a_response_is_found_under_the_key_that_made_it_only() {
        let homes = Homes::default();
        let with = |name: &str, value: &str| {
            let mut h = HeaderMap::new();
            h.insert(
                axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
            homes.owner_of(client_key(None, &h).as_deref())
        };
        let (a, b) = (
            with("authorization", "Bearer key-a"),
            with("authorization", "Bearer key-b"),
        );
        assert_ne!(a, b);
        assert_eq!(
            with("x-api-key", "key-a"),
            a,
            "either header names the same key"
        );
        // The key the router accepted counts, not another one presented beside it.
        let mut both = HeaderMap::new();
        both.insert(header::AUTHORIZATION, "Bearer placeholder".parse().unwrap());
        both.insert("x-api-key", "key-b".parse().unwrap());
        let accepted = ClientKey::for_tests("key-b");
        assert_eq!(
            homes.owner_of(client_key(Some(&accepted), &both).as_deref()),
            b
        );
        homes.note(a, "resp_1".into(), 2);
        assert_eq!(homes.get(a, "resp_1"), Some(2));
        // Another key's lookup finds nothing, as for an id nobody made.
        assert_eq!(homes.get(b, "resp_1"), None);
        assert_eq!(homes.get(homes.owner_of(None), "resp_1"), None);
    }
}
