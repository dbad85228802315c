//! The HTTP layer over real sockets: authentication, body checks (413, 415, trailing data), error
//! shapes, SSE framing, batched prompts, priority, and what a hostile or broken client can do to the
//! server (silent floods, slow heads and bodies, clients that stop reading, disconnects, shutdown).

mod common;

use std::time::Duration;

use common::*;
use kura_server::{ConnLimits, ServeError, ServerConfig};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a test waits for a state before it fails (a hang is a failure, not a timing check).
const PATIENCE: Duration = Duration::from_secs(30);

/// Polls until `done` holds; fails after [`PATIENCE`].
async fn wait_for(done: impl Fn() -> bool, what: &str) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        // Poll interval: the deadline only turns a hang into a failure.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn post(url: &str, body: &Value) -> reqwest::Response {
    client().post(url).json(body).send().await.unwrap()
}

fn assert_openai_error(body: &Value) {
    let e = &body["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(e["type"].is_string(), "{body}");
    assert!(
        e.get("param").is_some() && e.get("code").is_some(),
        "{body}"
    );
}

#[tokio::test]
async fn keys_are_required_on_the_api_but_not_on_health() {
    let s = TestServer::start(Setup {
        server: ServerConfig {
            api_keys: vec!["k1".into(), "k2".into()],
            ..ServerConfig::default()
        },
        ..Setup::default()
    })
    .await;
    let body = json!({"prompt": "hi", "max_tokens": 2});
    let url = s.url("/v1/completions");
    let r = client().post(&url).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    assert_openai_error(&r.json().await.unwrap());
    let r = client()
        .post(&url)
        .bearer_auth("k3")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = client()
        .post(&url)
        .bearer_auth("k2")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = client().get(s.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn bodies_must_be_one_json_object_sent_as_json_within_the_limit() {
    let s = TestServer::start(Setup {
        server: ServerConfig {
            max_body_bytes: 1024,
            ..ServerConfig::default()
        },
        ..Setup::default()
    })
    .await;
    let url = s.url("/v1/completions");
    let send = |ct: Option<&'static str>, body: Vec<u8>| {
        let mut r = client().post(&url).body(body);
        if let Some(ct) = ct {
            r = r.header("content-type", ct);
        }
        r.send()
    };
    let ok = br#"{"prompt": "hi", "max_tokens": 1}"#.to_vec();
    assert_eq!(
        send(Some("application/json"), ok.clone())
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        send(Some("application/json; charset=utf-8"), ok.clone())
            .await
            .unwrap()
            .status(),
        200
    );
    for ct in [
        None,
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
    ] {
        let r = send(ct, ok.clone()).await.unwrap();
        assert_eq!(r.status(), 415, "{ct:?}");
        assert_openai_error(&r.json().await.unwrap());
    }
    for bad in [
        &br#"{"prompt": "hi"} trailing"#[..],
        br#"{"prompt": "hi"}{"prompt": "again"}"#,
        b"{\"prompt\": \"hi\"}\0",
    ] {
        let r = send(Some("application/json"), bad.to_vec()).await.unwrap();
        assert_eq!(r.status(), 400, "{:?}", String::from_utf8_lossy(bad));
    }
    let big = format!(r#"{{"prompt": "{}"}}"#, "x".repeat(2000));
    let r = send(Some("application/json"), big.into_bytes())
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_openai_error(&r.json().await.unwrap());
}

#[tokio::test]
async fn unknown_routes_methods_and_bad_values_get_openai_shaped_errors() {
    let s = TestServer::start(Setup::default()).await;
    let r = client().get(s.url("/v1/nothing")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_openai_error(&r.json().await.unwrap());
    let r = client().get(s.url("/v1/completions")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    assert_openai_error(&r.json().await.unwrap());
    let r = post(
        &s.url("/v1/completions"),
        &json!({"prompt": "hi", "max_tokens": 4294967296u64}),
    )
    .await;
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_openai_error(&body);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at most"),
        "{body}"
    );
    let r = post(
        &s.url("/v1/completions"),
        &json!({"prompt": "hi", "priority": -1}),
    )
    .await;
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["param"], "priority");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--scheduling-policy priority"));
}

#[tokio::test]
async fn priority_is_accepted_under_the_priority_policy() {
    let s = TestServer::start(Setup {
        policy: kura_engine::SchedulingPolicy::Priority,
        server: ServerConfig {
            priority_scheduling: true,
            ..ServerConfig::default()
        },
        ..Setup::default()
    })
    .await;
    let r = post(
        &s.url("/v1/completions"),
        &json!({"prompt": "hi", "max_tokens": 2, "priority": -1}),
    )
    .await;
    assert_eq!(r.status(), 200);
}

/// The `data:` payloads of an SSE body, checking the framing on the way.
fn sse_payloads(text: &str) -> Vec<String> {
    assert!(
        text.ends_with("\n\n"),
        "an SSE body ends with a blank line: {text:?}"
    );
    let mut out = Vec::new();
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let data: Vec<&str> = event
            .lines()
            .filter(|l| !l.starts_with(':'))
            .map(|l| {
                l.strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("not a data line: {l:?}"))
            })
            .collect();
        if !data.is_empty() {
            out.push(data.join("\n"));
        }
    }
    out
}

#[tokio::test]
async fn streams_are_framed_as_server_sent_events_ending_with_done() {
    let s = TestServer::start(Setup::default()).await;
    let r = post(
        &s.url("/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": true,
                "n": 2, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let payloads = sse_payloads(&r.text().await.unwrap());
    assert_eq!(payloads.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = payloads[..payloads.len() - 1]
        .iter()
        .map(|p| serde_json::from_str(p).unwrap())
        .collect();
    // One role chunk per choice first, then content, one finish per choice, then usage alone.
    for (i, c) in chunks[..2].iter().enumerate() {
        assert_eq!(c["choices"][0]["index"], i);
        assert_eq!(c["choices"][0]["delta"]["role"], "assistant");
    }
    let finishes = chunks
        .iter()
        .filter(|c| {
            c["choices"]
                .get(0)
                .is_some_and(|ch| !ch["finish_reason"].is_null())
        })
        .count();
    assert_eq!(finishes, 2);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 10);
    assert!(chunks.last().unwrap()["choices"]
        .as_array()
        .unwrap()
        .is_empty());
}

/// A response that is not streamed holds every log-probability until the request ends: one request of
/// 64 choices with 20 alternatives over a long context held tens of GB. Their number is bounded.
#[tokio::test]
async fn a_response_with_logprobs_that_is_not_streamed_holds_a_bounded_number() {
    // Room for 64 sequences of 800 tokens at once.
    let s = TestServer::start(Setup {
        num_blocks: 16384,
        ..Setup::default()
    })
    .await;
    // 64 choices × 1,000 tokens × (1 + 20) log-probabilities: refused up front, naming max_tokens.
    let body = json!({"prompt": "hi", "n": 64, "logprobs": 20, "max_tokens": 1000});
    let r = post(&s.url("/v1/completions"), &body).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_openai_error(&e);
    assert_eq!(e["error"]["param"], "max_tokens");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("at most 780 here") && message.contains("stream"),
        "{message}"
    );
    // Streamed, the same request is served (and cancelled here by dropping it).
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = post(&s.url("/v1/completions"), &streamed).await;
    assert_eq!(r.status(), 200);
    drop(r);
    // Chat without max_tokens: the context's room (about 8,000 tokens) is lowered to the 780 that fit.
    let r = post(
        &s.url("/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "hi"}], "n": 64, "logprobs": true,
                "top_logprobs": 20, "ignore_eos": true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 64);
    for c in choices {
        assert_eq!(c["finish_reason"], "length");
        let content = c["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), 780);
        assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 20);
    }
    assert_eq!(v["usage"]["completion_tokens"], 64 * 780);
}

/// A server that holds at most 1,000 log-probabilities at once, whose steps take 10 ms (a long
/// request is still running while others are sent).
async fn held_logprobs_server() -> TestServer {
    TestServer::start(Setup {
        behaviour: Behaviour {
            step_delay: Duration::from_millis(10),
            ..Behaviour::default()
        },
        server: ServerConfig {
            max_held_logprobs: 1000,
            ..Setup::default().server
        },
        ..Setup::default()
    })
    .await
}

/// A non-streamed completion of `tokens` tokens with one alternative each: it holds `tokens` × 2.
fn scored(tokens: u32) -> Value {
    json!({"prompt": "hi", "max_tokens": tokens, "logprobs": 1})
}

/// Non-streamed responses hold their log-probabilities until their requests end: together they are
/// bounded server-wide (`ServerConfig::max_held_logprobs`). A request that would pass the bound gets
/// 429 while others hold it, and is served once they are done or gone; streams and requests without
/// log-probabilities are not held back; one that needs more than the bound alone gets 400.
#[tokio::test]
async fn responses_with_logprobs_that_are_not_streamed_share_a_server_wide_bound() {
    // 400 steps of 10 ms: the first request is still running while the others are sent.
    let s = held_logprobs_server().await;
    let url = s.url("/v1/completions");
    // 400 tokens × (1 + 1): 800 of the 1,000 held while it runs; sent, and running.
    async fn run_long(
        s: &TestServer,
        url: &str,
        what: &str,
    ) -> tokio::task::JoinHandle<reqwest::Response> {
        let url = url.to_string();
        let body = json!({"prompt": "hi", "max_tokens": 400, "logprobs": 1, "ignore_eos": true});
        let task = tokio::spawn(async move { post(&url, &body).await });
        wait_for(|| s.metric("kura:num_requests_running") == 1.0, what).await;
        task
    }
    let first = run_long(&s, &url, "the first request to run").await;
    // 100 × 2 = 200 more would make 1,000: served; 101 × 2 would pass it: 429, saying why.
    let r = post(&url, &scored(101)).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let e: Value = r.json().await.unwrap();
    assert_openai_error(&e);
    let message = e["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("hold too many of this server's 1000")
            && message.contains("this one's 202")
            && message.contains("stream"),
        "{message}"
    );
    // What the others hold is not told: it would count other tenants' requests.
    assert!(!message.contains("800"), "{message}");
    assert_eq!(post(&url, &scored(100)).await.status(), 200);
    // Streamed, or without log-probabilities, nothing is held.
    let mut streamed = scored(300);
    streamed["stream"] = json!(true);
    let r = post(&url, &streamed).await;
    assert_eq!(r.status(), 200);
    r.text().await.unwrap();
    let r = post(&url, &json!({"prompt": "hi", "max_tokens": 300})).await;
    assert_eq!(r.status(), 200);
    // More than the whole bound alone: 400, naming max_tokens (500 fit).
    let r = post(&url, &scored(501)).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "max_tokens");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at most 500 here"),
        "{e}"
    );
    // The first ends: its 800 are free again.
    assert_eq!(first.await.unwrap().status(), 200);
    assert_eq!(post(&url, &scored(500)).await.status(), 200);
    // A client that goes away gives its share back with its request (taken while it ran: 429).
    let gone = run_long(&s, &url, "the request that goes away to run").await;
    assert_eq!(post(&url, &scored(101)).await.status(), 429);
    gone.abort();
    assert!(
        s.wait_blocks_free(PATIENCE).await,
        "the request that went away still holds its blocks"
    );
    assert_eq!(post(&url, &scored(500)).await.status(), 200);
}

/// A stream holds its scored prompts' log-probabilities (a prompt is scored whole before any of it is
/// sent) until the stream ends: a request that would pass the bound meanwhile gets 429.
#[tokio::test]
async fn a_stream_keeps_its_scored_prompts_share_until_it_ends() {
    let s = held_logprobs_server().await;
    let url = s.url("/v1/completions");
    // 300 prompt tokens (one a byte) × (1 + 1): 600 held while it streams its 400 tokens.
    let body = json!({"prompt": "a".repeat(300), "echo": true, "logprobs": 1, "max_tokens": 400,
                      "ignore_eos": true, "stream": true});
    let streamed = {
        let url = url.clone();
        tokio::spawn(async move {
            let r = post(&url, &body).await;
            let status = r.status();
            (status, r.text().await.unwrap())
        })
    };
    wait_for(
        || s.metric("kura:num_requests_running") == 1.0 || streamed.is_finished(),
        "the stream to run",
    )
    .await;
    assert!(!streamed.is_finished(), "{:?}", streamed.await.unwrap());
    // 201 × 2 = 402 more would pass the 1,000 beside the stream's 600; 200 × 2 would not.
    let r = post(&url, &scored(201)).await;
    assert_eq!(r.status(), 429, "{}", r.text().await.unwrap());
    assert_eq!(post(&url, &scored(200)).await.status(), 200);
    let (status, text) = streamed.await.unwrap();
    assert_eq!(status, 200, "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // Ended: its share is back.
    wait_for_status(&url, &scored(201), 200).await;
}

/// A response's share of the held log-probabilities is kept until its body has been written out: a
/// client that stops reading a body of tens of MB (more than the sockets' buffers) keeps it, and gives
/// it back once it has read to the end.
#[tokio::test]
async fn a_client_that_reads_slowly_keeps_its_share_until_its_body_is_written() {
    let s = TestServer::start(Setup {
        num_blocks: 16384,
        server: ServerConfig {
            max_held_logprobs: (1 << 20) + 1000,
            ..Setup::default().server
        },
        ..Setup::default()
    })
    .await;
    // 64 choices × 780 tokens × (1 + 20): 1,048,320 held, 1,256 left.
    let body = json!({"prompt": "hi", "n": 64, "logprobs": 20, "max_tokens": 780,
                      "ignore_eos": true})
    .to_string();
    // A receive buffer of its own size (set before connecting, it does not grow with the kernel's
    // autotuning): what the client does not read stays on the server's side.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(64 * 1024).unwrap();
    let mut slow = socket.connect(s.addr).await.unwrap();
    slow.write_all(
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    // The head comes once every choice has ended; then nothing more is read for a while.
    let mut head = vec![0u8; 4096];
    let n = tokio::time::timeout(PATIENCE, slow.read(&mut head))
        .await
        .expect("the response's head")
        .unwrap();
    assert!(
        head[..n].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&head[..n])
    );
    let url = s.url("/v1/completions");
    let more = json!({"prompt": "hi", "max_tokens": 700, "logprobs": 1});
    let r = post(&url, &more).await;
    assert_eq!(
        r.status(),
        429,
        "the share went back before the body was read"
    );
    // Read to the end: the whole body came (more than the sockets could hold), and the share is back.
    let mut rest = Vec::new();
    tokio::time::timeout(PATIENCE, slow.read_to_end(&mut rest))
        .await
        .expect("the rest of the body")
        .unwrap();
    // More than a socket's send buffer holds at most by default (4 MiB) and the 64 KiB received.
    assert!(
        n + rest.len() > 8 << 20,
        "a body of {} bytes",
        n + rest.len()
    );
    wait_for_status(&url, &more, 200).await;
}

/// Posts `body` to `url` until it answers `status` (what another request gives back may take a moment
/// after its client has read its response); fails after [`PATIENCE`].
async fn wait_for_status(url: &str, body: &Value, status: u16) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let got = post(url, body).await.status();
        if got == status {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{url} answered {got}, never {status}"
        );
        // Poll interval: the deadline only turns a hang into a failure.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A token's log-probability is written once as a number of its own and once in its alternatives:
/// both as the same f32, so that a client reads the same value from each.
#[tokio::test]
async fn a_tokens_logprob_reads_the_same_among_its_alternatives() {
    let s = TestServer::start(Setup::default()).await;
    for stream in [false, true] {
        let r = post(
            &s.url("/v1/completions"),
            &json!({"prompt": "hi", "max_tokens": 5, "logprobs": 3, "temperature": 0,
                    "stream": stream}),
        )
        .await;
        assert_eq!(r.status(), 200);
        let bodies: Vec<Value> = if stream {
            let text = r.text().await.unwrap();
            let payloads = sse_payloads(&text);
            payloads[..payloads.len() - 1]
                .iter()
                .map(|p| serde_json::from_str(p).unwrap())
                .collect()
        } else {
            vec![r.json().await.unwrap()]
        };
        let mut seen = 0;
        for b in &bodies {
            for c in b["choices"].as_array().unwrap() {
                let lp = &c["logprobs"];
                let Some(tokens) = lp["tokens"].as_array() else {
                    continue;
                };
                for (i, t) in tokens.iter().enumerate() {
                    let top = &lp["top_logprobs"][i][t.as_str().unwrap()];
                    assert_eq!(top, &lp["token_logprobs"][i], "stream {stream}: {lp}");
                    seen += 1;
                }
            }
        }
        assert_eq!(seen, 5, "stream {stream}");
    }
}

#[tokio::test]
async fn a_list_of_prompts_gets_choices_numbered_prompt_major() {
    let s = TestServer::start(Setup::default()).await;
    let prompts = ["one", "two two", "three three three"];
    let r = post(
        &s.url("/v1/completions"),
        &json!({"prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    // Each prompt alone (same n, on a fresh server so that no cached prefix changes what the stand-in
    // computes) gives its choices' text: the batch is the same as separate requests.
    let mut prompt_tokens = 0;
    for (p, prompt) in prompts.iter().enumerate() {
        let fresh = TestServer::start(Setup::default()).await;
        let alone: Value = post(
            &fresh.url("/v1/completions"),
            &json!({"prompt": prompt, "n": 2, "max_tokens": 3, "temperature": 0}),
        )
        .await
        .json()
        .await
        .unwrap();
        for j in 0..2 {
            assert_eq!(
                choices[p * 2 + j]["text"],
                alone["choices"][j]["text"],
                "prompt {p}"
            );
        }
        prompt_tokens += alone["usage"]["prompt_tokens"].as_u64().unwrap();
    }
    assert_eq!(
        body["usage"]["prompt_tokens"].as_u64().unwrap(),
        prompt_tokens
    );
    assert_eq!(body["usage"]["completion_tokens"], 18);

    // Streaming: the same numbering, one [DONE].
    let r = post(
        &s.url("/v1/completions"),
        &json!({"prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 0, "stream": true}),
    )
    .await;
    let payloads = sse_payloads(&r.text().await.unwrap());
    assert_eq!(payloads.iter().filter(|p| *p == "[DONE]").count(), 1);
    let mut seen = std::collections::BTreeSet::new();
    for p in &payloads[..payloads.len() - 1] {
        let v: Value = serde_json::from_str(p).unwrap();
        seen.insert(v["choices"][0]["index"].as_u64().unwrap());
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![0, 1, 2, 3, 4, 5]);
}

#[tokio::test]
async fn tokenization_runs_off_the_async_workers() {
    // Tokenization blocks until released: four requests would hold both async workers if it ran on
    // them, and /health could not answer.
    let gate = Gate::closed();
    let s = TestServer::start_gated(Setup::default(), gate.clone()).await;
    let mut pending = Vec::new();
    for _ in 0..4 {
        let url = s.url("/v1/completions");
        pending.push(tokio::spawn(async move {
            post(&url, &json!({"prompt": "x".repeat(4000), "max_tokens": 1}))
                .await
                .status()
        }));
    }
    wait_for(
        || gate.waiting.load(std::sync::atomic::Ordering::SeqCst) >= 2,
        "two tokenizations to block",
    )
    .await;
    let r = client().get(s.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        gate.waiting.load(std::sync::atomic::Ordering::SeqCst) >= 2,
        "health answered first"
    );
    gate.release();
    for p in pending {
        assert_eq!(p.await.unwrap(), 200);
    }
}

fn quick_limits() -> ConnLimits {
    ConnLimits {
        max_connections: 4096,
        header_timeout: Duration::from_millis(500),
        idle_timeout: Duration::from_millis(500),
        write_stall_timeout: Duration::from_secs(1),
    }
}

/// Reads until the server closes the connection; the bytes read.
async fn read_to_close(stream: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    tokio::time::timeout(within, stream.read_to_end(&mut out))
        .await
        .ok()?
        .ok()?;
    Some(out)
}

#[tokio::test]
async fn silent_slow_and_idle_connections_are_closed() {
    let s = TestServer::start(Setup {
        server: ServerConfig {
            conn: quick_limits(),
            ..ServerConfig::default()
        },
        ..Setup::default()
    })
    .await;
    // Silent: nothing sent at all.
    let mut silent = TcpStream::connect(s.addr).await.unwrap();
    // Slow head: the request line and a header, never the blank line, a byte now and then.
    let mut slow = TcpStream::connect(s.addr).await.unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let trickle = tokio::spawn(async move {
        // Paces the slow client (a byte per 100 ms, each one resetting any per-read timer); 300 bytes
        // = 30 s, a deadline far past the 500 ms head timeout that only turns a hang into a failure.
        for _ in 0..300 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if slow.write_all(b"X").await.is_err() {
                return true;
            }
        }
        false
    });
    // Idle after one request on a kept-alive connection.
    let mut idle = TcpStream::connect(s.addr).await.unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    let n = idle.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));

    assert!(
        read_to_close(&mut silent, PATIENCE).await.is_some(),
        "silent stays open"
    );
    assert!(
        read_to_close(&mut idle, PATIENCE).await.is_some(),
        "idle stays open"
    );
    assert!(
        trickle.await.unwrap(),
        "a head trickled for 30 s was not cut"
    );
}

#[tokio::test]
async fn a_body_shorter_than_its_length_gets_408() {
    let s = TestServer::start(Setup {
        server: ServerConfig {
            body_timeout: Duration::from_millis(300),
            ..ServerConfig::default()
        },
        ..Setup::default()
    })
    .await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"prompt\": ",
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(PATIENCE, c.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
}

/// `request_timeout` counts from a request's arrival, not from when it reaches the engine: a body
/// that takes longer than the limit to arrive (within the body timeout) leaves no time to generate.
#[tokio::test]
async fn the_request_timeout_counts_from_arrival() {
    let s = TestServer::start(Setup {
        behaviour: Behaviour {
            step_delay: Duration::from_millis(10),
            ..Behaviour::default()
        },
        server: ServerConfig {
            body_timeout: Duration::from_secs(30),
            request_timeout: Some(Duration::from_secs(2)),
            ..ServerConfig::default()
        },
        ..Setup::default()
    })
    .await;
    let body = br#"{"prompt": "hi", "max_tokens": 10, "ignore_eos": true}"#;
    for late in [false, true] {
        let mut c = TcpStream::connect(s.addr).await.unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        c.write_all(head.as_bytes()).await.unwrap();
        if late {
            tokio::time::sleep(Duration::from_millis(2500)).await;
        }
        c.write_all(body).await.unwrap();
        let answer = read_to_close(&mut c, PATIENCE).await.expect("an answer");
        let text = String::from_utf8_lossy(&answer);
        match late {
            // 10 steps of 10 ms fit in the two seconds.
            false => assert!(text.starts_with("HTTP/1.1 200"), "{text}"),
            true => assert!(
                text.starts_with("HTTP/1.1 504") && text.contains("request_timeout"),
                "{text}"
            ),
        }
    }
}

/// A request whose tokenization outlasts `request_timeout` is answered 504 and never reaches the
/// engine, streamed or not (a stream would otherwise have begun, 200, and carried the timeout as an
/// error event).
#[tokio::test]
async fn a_request_past_its_deadline_before_it_reaches_the_engine_gets_504() {
    let gate = Gate::closed();
    let s = TestServer::start_gated(
        Setup {
            server: ServerConfig {
                request_timeout: Some(Duration::from_secs(1)),
                ..ServerConfig::default()
            },
            ..Setup::default()
        },
        gate.clone(),
    )
    .await;
    let mut pending = Vec::new();
    for stream in [false, true] {
        let url = s.url("/v1/completions");
        pending.push(tokio::spawn(async move {
            let r = post(
                &url,
                &json!({"prompt": "hi", "max_tokens": 4, "stream": stream}),
            )
            .await;
            let status = r.status();
            (status, r.text().await.unwrap())
        }));
    }
    wait_for(
        || gate.waiting.load(std::sync::atomic::Ordering::SeqCst) >= 2,
        "both tokenizations to block",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    gate.release();
    for p in pending {
        let (status, text) = p.await.unwrap();
        assert_eq!(status, 504, "{text}");
        assert!(text.contains("request_timeout"), "{text}");
    }
    assert_eq!(s.metric("kura:prompt_tokens_total"), 0.0);
}

#[tokio::test]
async fn a_flood_of_silent_connections_does_not_stop_health() {
    let mut limits = quick_limits();
    limits.max_connections = 300;
    // Long timeouts: the flood is evicted by the cap, not by timeouts.
    limits.header_timeout = Duration::from_secs(60);
    limits.idle_timeout = Duration::from_secs(60);
    let s = TestServer::start(Setup {
        server: ServerConfig {
            conn: limits,
            ..ServerConfig::default()
        },
        ..Setup::default()
    })
    .await;
    let mut flood = Vec::new();
    for _ in 0..2000 {
        flood.push(TcpStream::connect(s.addr).await.unwrap());
    }
    for _ in 0..5 {
        let r = client().get(s.url("/health")).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    // The oldest silent connections were closed to make room: all of the 100 oldest (the 300 newest
    // are the ones kept), each one seen closed before one shared, generous deadline.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    for (i, c) in flood.iter_mut().take(100).enumerate() {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        assert!(
            read_to_close(c, left).await.is_some(),
            "silent connection {i} (of the 100 oldest) was not closed"
        );
    }
}

#[tokio::test]
async fn a_client_that_stops_reading_is_cancelled_and_its_blocks_freed() {
    let s = TestServer::start(Setup {
        behaviour: Behaviour {
            token_text_bytes: 4096,
            ..Behaviour::default()
        },
        stalled_client_timeout: Duration::from_secs(1),
        server: ServerConfig {
            conn: quick_limits(),
            ..ServerConfig::default()
        },
        ..Setup::default()
    })
    .await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    let body = r#"{"prompt": "never read", "max_tokens": 6000, "stream": true, "logprobs": 20}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    c.write_all(head.as_bytes()).await.unwrap();
    // Never read. The engine pauses the request once its output queue is full; the server closes the
    // connection once its writes have been blocked for the stall timeout. Its 6000 tokens of 4 KiB
    // cannot all fit in the socket buffers: the request cannot finish on its own. That it ran (and so
    // held blocks) is seen on a counter: the blocks-used gauge may already be back at zero, a second
    // after the stall, when a loaded machine first looks.
    wait_for(
        || s.metric("kura:generation_tokens_total") > 0.0,
        "the request to run",
    )
    .await;
    // The cancellation first: the blocks-used gauge can read zero before it, while the request waits
    // on its full output queue without blocks, and a request that completed never counts one.
    wait_for(
        || s.metric("kura:request_cancelled_total") == 1.0,
        "the stalled request to be cancelled (not completed)",
    )
    .await;
    assert!(
        s.wait_blocks_free(PATIENCE).await,
        "blocks still held by a client that stopped reading"
    );
    drop(c);
}

#[tokio::test]
async fn a_non_streaming_client_that_disconnects_frees_its_blocks() {
    let s = TestServer::start(Setup {
        behaviour: Behaviour {
            step_delay: Duration::from_millis(5),
            ..Behaviour::default()
        },
        ..Setup::default()
    })
    .await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    let body = r#"{"prompt": "a long answer please", "max_tokens": 5000}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    c.write_all(head.as_bytes()).await.unwrap();
    wait_for(
        || s.metric("kura:kv_cache_blocks_used") > 0.0,
        "the request to start",
    )
    .await;
    drop(c);
    assert!(
        s.wait_blocks_free(PATIENCE).await,
        "blocks still held after disconnect"
    );
    // Freed by the cancellation, not by finishing (a finished request counts no cancellation).
    assert_eq!(s.metric("kura:request_cancelled_total"), 1.0);
}

#[tokio::test]
async fn shutdown_closes_partial_requests_and_unread_streams_after_the_grace() {
    let mut s = TestServer::start(Setup {
        behaviour: Behaviour {
            step_delay: Duration::from_millis(2),
            ..Behaviour::default()
        },
        server: ServerConfig {
            shutdown_grace: Duration::from_millis(500),
            conn: ConnLimits {
                header_timeout: Duration::from_secs(600),
                idle_timeout: Duration::from_secs(600),
                write_stall_timeout: Duration::from_secs(600),
                ..ConnLimits::default()
            },
            body_timeout: Duration::from_secs(600),
            ..ServerConfig::default()
        },
        ..Setup::default()
    })
    .await;
    // A head without its blank line, a body shorter than its length, a stream never read.
    let mut partial_head = TcpStream::connect(s.addr).await.unwrap();
    partial_head
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut short_body = TcpStream::connect(s.addr).await.unwrap();
    short_body
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 50\r\n\r\n{",
        )
        .await
        .unwrap();
    let mut unread = TcpStream::connect(s.addr).await.unwrap();
    // 8000 steps of 2 ms: still streaming when the grace ends (it fits the context of 8192).
    let body = r#"{"prompt": "x", "max_tokens": 8000, "stream": true}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    unread.write_all(head.as_bytes()).await.unwrap();
    // The stream runs: the server has accepted every connection (in order: this one was last).
    wait_for(
        || s.metric("kura:num_requests_running") == 1.0,
        "the unread stream to run",
    )
    .await;
    let stopped = tokio::time::timeout(PATIENCE, s.shutdown()).await;
    assert!(
        matches!(stopped, Ok(Ok(()))),
        "serve did not return after the grace"
    );
    for c in [&mut partial_head, &mut short_body, &mut unread] {
        assert!(
            read_to_close(c, PATIENCE).await.is_some(),
            "a connection stayed open"
        );
    }
}

#[tokio::test]
async fn engine_death_turns_health_to_503_fails_requests_and_ends_serve_with_an_error() {
    engine_death(
        Behaviour {
            panic_at_forward: Some(3),
            ..Behaviour::default()
        },
        "stand-in model failure",
    )
    .await;
}

#[tokio::test]
async fn a_device_fault_ends_serve_as_an_engine_death_does() {
    // A fatal executor error (on a GPU: a fault that leaves the CUDA context unusable) must not leave a
    // server that fails every request while its health check says it is well.
    engine_death(
        Behaviour {
            fail_at_forward: Some((
                3,
                kura_engine::ExecError::Fatal("CUDA driver: CUDA_ERROR_ILLEGAL_ADDRESS".into()),
            )),
            ..Behaviour::default()
        },
        "the executor failed at a forward step: CUDA driver: CUDA_ERROR_ILLEGAL_ADDRESS",
    )
    .await;
}

/// A request while the engine dies (`behaviour` makes it die) fails with `expected` in its message,
/// `serve` returns that error, and `/health` answers 503 after.
async fn engine_death(behaviour: Behaviour, expected: &str) {
    let mut s = TestServer::start(Setup {
        behaviour,
        ..Setup::default()
    })
    .await;
    assert_eq!(
        client()
            .get(s.url("/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let r = post(
        &s.url("/v1/completions"),
        &json!({"prompt": "hi", "max_tokens": 50}),
    )
    .await;
    assert!(r.status().is_server_error(), "{}", r.status());
    let body: Value = r.json().await.unwrap();
    assert_openai_error(&body);
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(expected), "{message}");
    let result = tokio::time::timeout(PATIENCE, s.done.take().unwrap())
        .await
        .expect("serve returns after the engine dies")
        .unwrap();
    match result {
        Err(ServeError::EngineFailed(m)) => assert!(m.contains(expected), "{m}"),
        other => panic!("serve returned {other:?}"),
    }
    assert!(s.engine.failure().is_some());
    // Whatever still reaches the router now hears that the engine is gone.
    use tower::ServiceExt;
    let app = kura_server::router(s.engine.clone(), &ServerConfig::default());
    let health = app
        .oneshot(
            axum::http::Request::get("/health")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(health.status(), 503);
}
