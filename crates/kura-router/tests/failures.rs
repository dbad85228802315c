//! The router against fake replicas (raw TCP, each doing one wrong thing on purpose): a replica that
//! refuses a request, or closes its connection without answering while it is alive, keeps its place; a
//! replica that cannot be reached is drained and the request goes on to the next; a stream cut by its
//! replica ends with an error event; a cut non-streamed answer aborts the client's connection; a client
//! without a key gets 401 and its body is never read.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use kura_router::{Policy, RouterConfig};
use kura_text::{ChatMessage, TextCodec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A codec the tests never reach: without the fleet's secret the router tokenizes nothing.
struct NoCodec;

impl TextCodec for NoCodec {
    fn encode(&self, _: &str) -> Result<Vec<u32>, String> {
        Err("not used".into())
    }
    fn decode(&self, _: &[u32]) -> String {
        String::new()
    }
    fn token_bytes(&self, _: u32) -> Vec<u8> {
        Vec::new()
    }
    fn render_chat(&self, _: &[ChatMessage]) -> Result<String, String> {
        Err("not used".into())
    }
    fn encode_chat(&self, _: &[ChatMessage]) -> Result<Vec<u32>, String> {
        Err("not used".into())
    }
    fn chat_content_spans(
        &self,
        _: &str,
        _: usize,
        _: &[ChatMessage],
    ) -> Result<Vec<Range<usize>>, String> {
        Ok(Vec::new())
    }
    fn encode_with_plain_spans(&self, _: &str, _: &[Range<usize>]) -> Result<Vec<u32>, String> {
        Err("not used".into())
    }
    fn eos_token_ids(&self) -> &[u32] {
        &[]
    }
    fn vocab_size(&self) -> usize {
        1
    }
}

/// What a fake replica does with a POST.
#[derive(Clone, Copy)]
enum Post {
    /// Closes the connection without an answer (as a replica that will not read a body may).
    Close,
    /// Answers 413.
    TooLarge,
    /// Starts an SSE stream, sends one event and half of the next, then closes.
    CutStream,
    /// Starts a chunked JSON answer, then closes.
    CutJson,
}

async fn read_head(s: &mut TcpStream) -> Option<String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte).await.ok()? == 0 {
            return None;
        }
        head.push(byte[0]);
    }
    Some(String::from_utf8_lossy(&head).into_owned())
}

async fn fake_connection(mut s: TcpStream, post: Post) {
    let Some(head) = read_head(&mut s).await else {
        return;
    };
    let reply: &[u8] = if head.starts_with("GET ") {
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n"
    } else {
        match post {
            Post::Close => return,
            Post::TooLarge => {
                b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n\
                  content-length: 11\r\nconnection: close\r\n\r\n{\"e\":\"413\"}"
            }
            Post::CutStream => {
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                  transfer-encoding: chunked\r\n\r\n\
                  10\r\ndata: {\"n\": 1}\n\n\r\n\
                  9\r\ndata: {\"n\r\n"
            }
            Post::CutJson => {
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                  transfer-encoding: chunked\r\n\r\n6\r\n{\"a\": \r\n"
            }
        }
    };
    let _ = s.write_all(reply).await;
    let _ = s.flush().await;
}

/// A fake replica; its URL.
async fn fake_replica(post: Post) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            tokio::spawn(fake_connection(s, post));
        }
    });
    url
}

/// A URL where nothing listens.
async fn dead_replica() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    format!("http://{}", listener.local_addr().unwrap())
}

struct Router {
    url: String,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn router(replicas: Vec<String>, api_keys: Vec<String>) -> Router {
    router_with(replicas, api_keys, true).await
}

/// A round-robin router; `replica_header`: `--replica-header`.
async fn router_with(replicas: Vec<String>, api_keys: Vec<String>, replica_header: bool) -> Router {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let mut config = RouterConfig::new(replicas, Policy::RoundRobin, Arc::new(NoCodec));
    config.api_keys = api_keys;
    config.replica_header = replica_header;
    config.health_interval = Duration::from_secs(10);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        kura_router::run(listener, config, shutdown).await.unwrap();
    });
    Router { url, _stop: stop }
}

async fn metric(router: &Router, sample: &str) -> f64 {
    let text = reqwest::get(format!("{}/metrics", router.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {sample} in\n{text}"))
}

async fn post(router: &Router, path: &str, body: Vec<u8>) -> reqwest::Result<reqwest::Response> {
    reqwest::Client::new()
        .post(format!("{}{path}", router.url))
        .header("content-type", "application/json")
        .header("authorization", "Bearer key")
        .body(body)
        .send()
        .await
}

#[tokio::test]
async fn a_replica_that_closes_without_answering_while_alive_is_not_drained() {
    let replica = fake_replica(Post::Close).await;
    let r = router(vec![replica.clone()], vec![]).await;
    for _ in 0..3 {
        let resp = post(&r, "/v1/chat/completions", vec![b' '; 1 << 20])
            .await
            .unwrap();
        assert_eq!(resp.status(), 502);
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["type"], "server_error", "{body}");
    }
    let label = format!("{{replica=\"{replica}\"}}");
    assert_eq!(
        metric(&r, &format!("kura_router:replica_up{label}")).await,
        1.0
    );
    assert_eq!(
        metric(&r, &format!("kura_router:replica_mark_downs_total{label}")).await,
        0.0
    );
    assert_eq!(metric(&r, "kura_router:retries_total").await, 0.0);
}

#[tokio::test]
async fn a_refusal_is_the_clients_answer_and_an_unreachable_replica_is_drained() {
    let dead = dead_replica().await;
    let refusing = fake_replica(Post::TooLarge).await;
    // Round-robin tries the dead replica first.
    let r = router(vec![dead.clone(), refusing.clone()], vec![]).await;
    let resp = post(&r, "/v1/messages", b"{}".to_vec()).await.unwrap();
    assert_eq!(resp.status(), 413);
    assert_eq!(resp.headers()["x-kura-replica"], "1");
    // Without --replica-header, no answer says where it was served: under round-robin the gap
    // between two of a client's replicas would count the others' requests.
    let other = fake_replica(Post::TooLarge).await;
    let quiet = router_with(vec![refusing.clone(), other], vec![], false).await;
    for _ in 0..2 {
        let resp = post(&quiet, "/v1/completions", b"{}".to_vec())
            .await
            .unwrap();
        assert_eq!(resp.status(), 413);
        assert!(resp.headers().get("x-kura-replica").is_none());
    }
    for _ in 0..3 {
        let resp = post(&r, "/v1/completions", b"{}".to_vec()).await.unwrap();
        assert_eq!(resp.status(), 413);
    }
    let up = |url: &str| format!("kura_router:replica_up{{replica=\"{url}\"}}");
    let downs = |url: &str| format!("kura_router:replica_mark_downs_total{{replica=\"{url}\"}}");
    assert_eq!(metric(&r, &up(&dead)).await, 0.0);
    assert_eq!(metric(&r, &downs(&dead)).await, 1.0);
    assert_eq!(metric(&r, &up(&refusing)).await, 1.0);
    assert_eq!(metric(&r, &downs(&refusing)).await, 0.0);
    assert_eq!(metric(&r, "kura_router:retries_total").await, 1.0);
}

#[tokio::test]
async fn a_cut_stream_ends_with_an_error_event_in_the_routes_shape() {
    let replica = fake_replica(Post::CutStream).await;
    let r = router(vec![replica], vec![]).await;
    let resp = post(&r, "/v1/chat/completions", b"{}".to_vec())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // The body ends cleanly: the event that was cut is dropped, an error event takes its place.
    let text = resp.text().await.unwrap();
    let events: Vec<&str> = text.split_terminator("\n\n").collect();
    assert_eq!(events.len(), 2, "{text:?}");
    assert_eq!(events[0], "data: {\"n\": 1}");
    let error: serde_json::Value =
        serde_json::from_str(events[1].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(error["error"]["type"], "server_error");
    assert!(error["error"]["message"]
        .as_str()
        .unwrap()
        .contains("failed mid-stream"));
    assert!(text.ends_with("\n\n"));

    let text = post(&r, "/v1/messages", b"{}".to_vec())
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let last = text.split_terminator("\n\n").last().unwrap();
    let data = last.strip_prefix("event: error\ndata: ").unwrap();
    let error: serde_json::Value = serde_json::from_str(data).unwrap();
    assert_eq!(
        (error["type"].as_str(), error["error"]["type"].as_str()),
        (Some("error"), Some("api_error"))
    );
}

#[tokio::test]
async fn a_cut_answer_that_is_not_a_stream_aborts_the_clients_connection() {
    let replica = fake_replica(Post::CutJson).await;
    let r = router(vec![replica], vec![]).await;
    let resp = post(&r, "/v1/completions", b"{}".to_vec()).await.unwrap();
    assert_eq!(resp.status(), 200);
    // Never a short body read as a whole one.
    assert!(resp.bytes().await.is_err());
}

#[tokio::test]
async fn without_a_key_a_request_gets_401_before_its_body_is_read() {
    let replica = fake_replica(Post::TooLarge).await;
    let r = router(vec![replica], vec!["key".into()]).await;
    // A head announcing a body that never comes: answered at once, without waiting for the body.
    let mut s = TcpStream::connect(r.url.trim_start_matches("http://"))
        .await
        .unwrap();
    s.write_all(
        b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
          x-api-key: wrong\r\ncontent-length: 1000000\r\n\r\n{",
    )
    .await
    .unwrap();
    let head = read_head(&mut s).await.unwrap();
    assert!(head.starts_with("HTTP/1.1 401"), "{head}");
    let openai = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", r.url))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(openai.status(), 401);
    let body: serde_json::Value = openai.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_api_key");
    // The right key goes through (and meets the replica's 413).
    let resp = post(&r, "/v1/chat/completions", b"{}".to_vec())
        .await
        .unwrap();
    assert_eq!(resp.status(), 413);
    assert_eq!(metric(&r, "kura_router:unauthorized_total").await, 2.0);
}

#[tokio::test]
async fn a_body_announced_over_the_limit_gets_413_from_the_head_alone() {
    let replica = fake_replica(Post::TooLarge).await;
    let r = router(vec![replica.clone()], vec![]).await;
    let mut s = TcpStream::connect(r.url.trim_start_matches("http://"))
        .await
        .unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
          content-length: 9437184\r\n\r\n{",
    )
    .await
    .unwrap();
    let head = read_head(&mut s).await.unwrap();
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(!head.contains("x-kura-replica"), "{head}");
    let label = format!("{{replica=\"{replica}\"}}");
    assert_eq!(
        metric(&r, &format!("kura_router:requests_total{label}")).await,
        0.0
    );
}

/// A replica whose `/v1/models` never ends (chunks for as long as it is read); its health checks pass.
async fn endless_models_replica() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Some(head) = read_head(&mut s).await else {
                    return;
                };
                if !head.starts_with("GET /v1/models") {
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n")
                        .await;
                    return;
                }
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
                    .await;
                let chunk = format!("10000\r\n{}\r\n", "x".repeat(0x10000));
                while s.write_all(chunk.as_bytes()).await.is_ok() {}
            });
        }
    });
    url
}

#[tokio::test]
async fn a_replica_answer_that_never_ends_is_not_read_whole() {
    // The first replica's model list never ends: the router stops reading it at its limit and
    // answers from the next replica (before, it read until it ran out of memory).
    let endless = endless_models_replica().await;
    let good = fake_replica(Post::Close).await;
    let r = router(vec![endless, good], Vec::new()).await;
    let resp = reqwest::get(format!("{}/v1/models", r.url)).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "ok\n");
}
