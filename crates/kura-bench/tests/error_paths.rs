//! Error paths of the load generator against a small in-process mock of an OpenAI-compatible server.
//!
//! The mock exists ONLY to produce failures a real server rarely produces on demand: HTTP 500s, streams
//! that are not valid JSON, streams cut before `[DONE]`, error events, endless bodies, and an
//! unreachable port; and a `/tokenize` that adds BOS (as Kura's does on a model that wants one, which
//! the default model does not). The happy
//! path (timings, cached tokens, token counts) is measured against real servers (Kura, llama.cpp), never
//! against this mock.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use kura_bench::report::ErrorKind;
use kura_bench::{run, Api, BenchError, Endpoint, Load, RunConfig, WorkloadSpec};

/// What the mock does with the n-th completion request (the preflight request is n = 0).
#[derive(Clone, Copy)]
enum Behaviour {
    /// Every request after the preflight gets a 500.
    Http500,
    /// Odd requests stream a chunk that is not JSON; even ones are fine.
    MalformedOnOdd,
    /// A valid token chunk, then the body ends without `[DONE]`.
    CutBeforeDone,
    /// An error object inside the stream.
    ErrorEvent,
    /// One token chunk, then the connection is dropped mid-body.
    Disconnect,
    /// A 500 whose body never ends.
    EndlessErrorBody,
    /// A stream line that never ends.
    EndlessLine,
    /// A 200 that is JSON, not an event stream.
    NotAStream,
}

/// A body of `piece` repeated for ever.
fn endless(piece: &'static [u8]) -> Body {
    Body::from_stream(futures::stream::repeat_with(move || {
        Ok::<_, std::io::Error>(axum::body::Bytes::from_static(piece))
    }))
}

struct Mock {
    behaviour: Behaviour,
    calls: AtomicUsize,
}

fn sse(body: String) -> Response {
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        Body::from(body),
    )
        .into_response()
}

const GOOD: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\
                    data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n\
                    data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n\
                    data: [DONE]\n\n";

async fn completions(State(mock): State<Arc<Mock>>) -> Response {
    let n = mock.calls.fetch_add(1, Ordering::SeqCst);
    if n == 0 {
        return sse(GOOD.to_string());
    }
    match mock.behaviour {
        Behaviour::Http500 => {
            (StatusCode::INTERNAL_SERVER_ERROR, "engine exploded").into_response()
        }
        Behaviour::MalformedOnOdd if n % 2 == 1 => sse("data: {\"choices\": [oops\n\n".to_string()),
        Behaviour::MalformedOnOdd => sse(GOOD.to_string()),
        Behaviour::CutBeforeDone => {
            sse("data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n".to_string())
        }
        Behaviour::ErrorEvent => {
            sse("data: {\"error\":{\"message\":\"KV pool exhausted\"}}\n\n".to_string())
        }
        Behaviour::EndlessErrorBody => {
            (StatusCode::INTERNAL_SERVER_ERROR, endless(&[b'x'; 65536])).into_response()
        }
        Behaviour::EndlessLine => (
            [(header::CONTENT_TYPE, "text/event-stream")],
            endless(&[b'd'; 65536]),
        )
            .into_response(),
        Behaviour::NotAStream => (
            [(header::CONTENT_TYPE, "application/json")],
            "{\"choices\": []}",
        )
            .into_response(),
        Behaviour::Disconnect => {
            let pieces: Vec<Result<&'static str, std::io::Error>> = vec![
                Ok("data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n"),
                Err(std::io::Error::other("engine thread died")),
            ];
            // Paces the mock's body (not a wait for a state): the pause lets the headers and the first
            // chunk leave before the connection drops, to exercise a break mid-stream. The assertion
            // (every request a `disconnected`) holds whenever the break lands.
            let body = Body::from_stream(futures::StreamExt::then(
                futures::stream::iter(pieces),
                |p| async move {
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    p
                },
            ));
            ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
        }
    }
}

async fn start(behaviour: Behaviour) -> SocketAddr {
    let mock = Arc::new(Mock {
        behaviour,
        calls: AtomicUsize::new(0),
    });
    let app = Router::new()
        .route("/v1/chat/completions", post(completions))
        .with_state(mock);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

fn config(url: String, requests: usize) -> RunConfig {
    RunConfig {
        endpoint: Endpoint {
            base_url: url,
            api_key: None,
            model: "mock".into(),
            api: Api::Chat,
            ignore_eos: true,
            temperature: 0.0,
            request_timeout: Duration::from_secs(10),
        },
        label: "mock".into(),
        spec: WorkloadSpec::Unique {
            requests,
            prompt_tokens: 8,
        },
        output_tokens: 2,
        seed: 1,
        loads: vec![Load::Concurrency(2)],
        progress: false,
    }
}

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kura-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[tokio::test]
async fn http_500s_are_counted_and_the_report_is_still_written() {
    let addr = start(Behaviour::Http500).await;
    let run = run(config(format!("http://{addr}"), 4))
        .await
        .expect("a run with failures still completes");
    let s = &run.points[0].summary;
    assert_eq!((s.requests, s.ok, s.failed), (4, 0, 4));
    assert_eq!(s.errors_by_kind.get("http_500"), Some(&4));
    let err = run.points[0].requests[0].error.as_ref().unwrap();
    assert_eq!(err.kind, ErrorKind::Http { status: 500 });
    assert!(err.message.contains("engine exploded"), "{}", err.message);

    let dir = out_dir("http500");
    let summary = kura_bench::write_report(&run, &dir, None).expect("report");
    let md = std::fs::read_to_string(summary).unwrap();
    assert!(md.contains("0/4") && md.contains("4 http_500"), "{md}");
    assert!(md.contains("## Failures (4 requests)"), "{md}");
    let back = kura_bench::BenchRun::read(&dir.join("run.json")).unwrap();
    assert_eq!(back.points[0].summary.errors_by_kind, s.errors_by_kind);
    assert_eq!(back.points[0].requests.len(), 4);
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn malformed_chunks_fail_only_their_requests() {
    let addr = start(Behaviour::MalformedOnOdd).await;
    let run = run(config(format!("http://{addr}"), 6)).await.unwrap();
    let s = &run.points[0].summary;
    assert_eq!((s.ok, s.failed), (3, 3));
    assert_eq!(s.errors_by_kind.get("malformed_stream"), Some(&3));
    assert_eq!(s.output_tokens, 6);
    let bad = run.points[0]
        .requests
        .iter()
        .find_map(|r| r.error.as_ref())
        .unwrap();
    assert!(bad.message.contains("not JSON"), "{}", bad.message);
}

#[tokio::test]
async fn a_stream_cut_before_done_and_an_error_event_are_failures() {
    let addr = start(Behaviour::CutBeforeDone).await;
    let cut = run(config(format!("http://{addr}"), 2)).await.unwrap();
    let r = &cut.points[0].requests[0];
    let e = r.error.as_ref().unwrap();
    assert_eq!(e.kind, ErrorKind::MalformedStream);
    assert!(e.message.contains("[DONE]"), "{}", e.message);
    assert!(
        r.ttft_ms.is_some(),
        "the token that did arrive is still timed"
    );

    let addr = start(Behaviour::ErrorEvent).await;
    let errored = run(config(format!("http://{addr}"), 2)).await.unwrap();
    let e = errored.points[0].requests[0].error.as_ref().unwrap();
    assert_eq!(e.kind, ErrorKind::ServerError);
    assert!(e.message.contains("KV pool exhausted"), "{}", e.message);
}

#[tokio::test]
async fn a_connection_dropped_mid_stream_is_a_disconnect() {
    let addr = start(Behaviour::Disconnect).await;
    let run = run(config(format!("http://{addr}"), 2)).await.unwrap();
    let s = &run.points[0].summary;
    assert_eq!(
        s.errors_by_kind.get("disconnected"),
        Some(&2),
        "{:?}",
        run.points[0].requests
    );
}

#[tokio::test]
async fn an_unreachable_url_is_a_clear_error_before_any_request() {
    // Bind then drop a listener: the port is then (almost certainly) closed.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let err = run(config(format!("http://127.0.0.1:{port}/v1/"), 2))
        .await
        .unwrap_err();
    assert!(matches!(err, BenchError::Unreachable { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
    assert!(msg.contains("is it running"), "{msg}");
}

#[tokio::test]
async fn a_bad_trace_line_names_file_and_line() {
    let dir = out_dir("trace");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.jsonl");
    std::fs::write(
        &path,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}\nnot json\n",
    )
    .unwrap();
    let addr = start(Behaviour::MalformedOnOdd).await;
    let mut cfg = config(format!("http://{addr}"), 1);
    cfg.spec = WorkloadSpec::Trace {
        path: path.clone(),
        format: kura_bench::TraceFormat::Mooncake,
        max_requests: None,
        time_scale: 1.0,
        max_prompt_tokens: None,
        max_output_tokens: None,
    };
    let err = run(cfg).await.unwrap_err().to_string();
    assert!(err.contains(&format!("{}:2", path.display())), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn endless_bodies_and_lines_fail_their_requests_in_bounded_memory() {
    // Unbounded, the first grew to 9.5 GB and the second to 5.4 GB within an 8 s request timeout.
    let addr = start(Behaviour::EndlessErrorBody).await;
    let run500 = run(config(format!("http://{addr}"), 2)).await.unwrap();
    let e = run500.points[0].requests[0].error.as_ref().unwrap();
    assert_eq!(e.kind, ErrorKind::Http { status: 500 });
    assert!(e.message.contains("xxxx"), "{}", e.message);

    let addr = start(Behaviour::EndlessLine).await;
    let endless = run(config(format!("http://{addr}"), 2)).await.unwrap();
    let e = endless.points[0].requests[0].error.as_ref().unwrap();
    assert_eq!(e.kind, ErrorKind::MalformedStream);
    assert!(
        e.message.contains("larger than the 16777216 bytes"),
        "{}",
        e.message
    );

    let addr = start(Behaviour::NotAStream).await;
    let json = run(config(format!("http://{addr}"), 2)).await.unwrap();
    let e = json.points[0].requests[0].error.as_ref().unwrap();
    assert_eq!(e.kind, ErrorKind::MalformedStream);
    assert!(
        e.message
            .contains("with application/json, not an event stream"),
        "{}",
        e.message
    );
}

/// A `/tokenize` that, like Kura's and vLLM's on a model that adds BOS, puts one token before every
/// text: one per word after it.
async fn tokenize_with_bos(axum::Json(body): axum::Json<serde_json::Value>) -> Response {
    let words = body["prompt"]
        .as_str()
        .unwrap_or("")
        .split_whitespace()
        .count();
    axum::Json(serde_json::json!({ "tokens": vec![1; words + 1] })).into_response()
}

#[tokio::test]
async fn a_tokenizer_that_adds_bos_counts_a_text_without_it() {
    // Each piece of a prompt is sized alone and the pieces are joined: a BOS in every count made each
    // piece one token short of its target.
    let app = Router::new().route("/tokenize", post(tokenize_with_bos));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let ep = config(format!("http://{addr}"), 1).endpoint;
    let tok = kura_bench::client::RemoteTokenizer::probe(&reqwest::Client::new(), &ep)
        .await
        .unwrap();
    assert_eq!(tok.count("one two three").await.unwrap(), 3);
    assert_eq!(tok.count("").await.unwrap(), 0);
}
