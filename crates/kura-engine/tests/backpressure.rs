//! Output is bounded per request: a sink that reports itself full gets no further steps (its client is
//! behind), resumes when it drains, and is cancelled with `ClientStalled` (blocks freed, metric counted)
//! once it has been full for longer than `stalled_client_timeout`. While a client is stalled the engine
//! loop keeps passing (it must, to see the sink drain) without stepping its request. (How often an idle
//! loop passes is a performance property, not asserted here.)

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{config, metric, request, settle, start, PATIENCE};
use kura_engine::{EngineConfig, EngineEvent, EventSink, RequestError, Usage};

/// A sink that reports full once it holds `limit` deltas, until the test drains it.
struct BoundedSink {
    tx: Sender<EngineEvent>,
    deltas: Arc<AtomicUsize>,
    limit: usize,
    drained: Arc<AtomicBool>,
}

impl EventSink for BoundedSink {
    fn send(&mut self, event: EngineEvent) -> bool {
        if matches!(event, EngineEvent::Delta { .. }) {
            self.deltas.fetch_add(1, Ordering::SeqCst);
        }
        self.tx.send(event).is_ok()
    }
    fn is_full(&self) -> bool {
        !self.drained.load(Ordering::SeqCst) && self.deltas.load(Ordering::SeqCst) >= self.limit
    }
}

struct Client {
    rx: Receiver<EngineEvent>,
    deltas: Arc<AtomicUsize>,
    drained: Arc<AtomicBool>,
}

impl Client {
    /// The next event after the prompt's usage (`Prompted`, which comes before the first token).
    fn next(&self) -> EngineEvent {
        loop {
            match self.rx.recv_timeout(PATIENCE).unwrap() {
                EngineEvent::Prompted { .. } => {}
                event => return event,
            }
        }
    }

    /// The tokens of the rest of the request, and its usage.
    fn rest(&self) -> (Vec<u32>, Usage) {
        let mut tokens = Vec::new();
        loop {
            match self.next() {
                EngineEvent::Delta { token_ids, .. } => tokens.extend(token_ids),
                EngineEvent::Done { usage } => return (tokens, usage),
                EngineEvent::Failed(e) => panic!("request failed: {e}"),
                _ => {}
            }
        }
    }
}

fn bounded(limit: usize) -> (BoundedSink, Client) {
    let (tx, rx) = mpsc::channel();
    let deltas = Arc::new(AtomicUsize::new(0));
    let drained = Arc::new(AtomicBool::new(false));
    let sink = BoundedSink {
        tx,
        deltas: deltas.clone(),
        limit,
        drained: drained.clone(),
    };
    (
        sink,
        Client {
            rx,
            deltas,
            drained,
        },
    )
}

/// Waits until the engine loop has made `n` more scheduling passes.
fn passes_later(e: &kura_engine::EngineHandle, n: f64) {
    let target = metric(e, "kura:scheduler_passes_total") + n;
    let deadline = Instant::now() + PATIENCE;
    while metric(e, "kura:scheduler_passes_total") < target {
        assert!(Instant::now() < deadline, "the engine loop stopped passing");
        // Poll interval: the deadline only turns a hang into a failure.
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_full_sink_pauses_its_request_while_the_loop_passes_and_resumes_when_drained() {
    let fake = start(EngineConfig {
        stalled_client_timeout: Duration::from_secs(3600),
        ..config(64, 64, 8)
    });
    let e = &fake.engine;
    let (sink, client) = bounded(1);
    let _guard = e.submit(request(6, 20), sink).unwrap();
    // The first step (the prefill) fills the sink; the engine must then stop stepping the request (after
    // at most one more step: the output of a step is made while the next is computed).
    let first = client.next();
    assert!(matches!(first, EngineEvent::Delta { .. }), "{first:?}");
    passes_later(e, 3.0);
    let calls = fake.control.calls();
    // Ten more passes of the loop with the sink still full: none of them steps the request (unpaused,
    // it would have made a forward call in each).
    passes_later(e, 10.0);
    assert_eq!(
        fake.control.calls(),
        calls,
        "no forward call for a full sink in 10 scheduling passes"
    );
    let delivered = client.deltas.load(Ordering::SeqCst);
    assert!((1..=2).contains(&delivered), "{delivered} deltas");
    assert!(
        metric(e, "kura:kv_cache_blocks_used") > 0.0,
        "a paused request keeps its blocks"
    );

    client.drained.store(true, Ordering::SeqCst);
    let (tokens, usage) = client.rest();
    assert_eq!(usage.completion_tokens, 20);
    assert_eq!(tokens.len(), 19, "the other 19 tokens follow once drained");
    assert_eq!(metric(e, "kura:request_cancelled_stalled_total"), 0.0);
    settle(e);
    e.stop();
}

#[test]
fn a_sink_full_past_the_timeout_is_cancelled_and_its_blocks_freed() {
    let fake = start(EngineConfig {
        stalled_client_timeout: Duration::from_millis(20),
        ..config(64, 64, 8)
    });
    let e = &fake.engine;
    assert_eq!(e.info().stalled_client_timeout, Duration::from_millis(20));
    let (sink, client) = bounded(1);
    let _guard = e.submit(request(6, 20), sink).unwrap();
    let first = client.next();
    assert!(matches!(first, EngineEvent::Delta { .. }), "{first:?}");
    let mut last = client.next();
    if matches!(last, EngineEvent::Delta { .. }) {
        // The one step the engine may run before it sees the sink full.
        last = client.next();
    }
    match last {
        EngineEvent::Failed(RequestError::ClientStalled { waited_ms }) => {
            assert!(waited_ms >= 20, "cancelled after {waited_ms} ms");
        }
        other => panic!("expected a stalled-client failure, got {other:?}"),
    }
    assert!(client.deltas.load(Ordering::SeqCst) <= 2);
    settle(e);
    assert_eq!(metric(e, "kura:kv_cache_blocks_used"), 0.0);
    assert_eq!(metric(e, "kura:request_cancelled_stalled_total"), 1.0);
    assert_eq!(metric(e, "kura:request_cancelled_total"), 1.0);

    // Others are unaffected: a closure sink is never full.
    let (_g, rx) = common::submit(e, request(6, 5));
    assert_eq!(common::wait(&rx).1.completion_tokens, 5);
    e.stop();
}
