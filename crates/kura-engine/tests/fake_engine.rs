//! The engine's preemption, cancellation and priority rules on the deterministic fake model
//! (milliseconds, no download): a full pool preempts and every request still completes with the tokens
//! it gets alone, without leaking blocks; dropping a guard frees blocks at once; `priority` decides who
//! is preempted only under `SchedulingPolicy::Priority`.

mod common;

use std::sync::mpsc;

use common::{
    config, distinct_request, metric, outcome, request, settle, start, submit, wait, PATIENCE,
};
use kura_engine::{EngineConfig, EngineEvent, GenerateRequest, SchedulingPolicy, TextCodec};

/// Every event `rx` receives until its sender is dropped (the engine let go of the request's sink).
fn until_disconnected(rx: &mpsc::Receiver<EngineEvent>) -> Vec<EngineEvent> {
    let mut events = Vec::new();
    loop {
        match rx.recv_timeout(PATIENCE) {
            Ok(ev) => events.push(ev),
            Err(mpsc::RecvTimeoutError::Disconnected) => return events,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("the engine still holds the sink of a cancelled request: {events:?}")
            }
        }
    }
}

/// The tokens `r` gets alone on a roomy engine.
fn alone(r: &GenerateRequest) -> Vec<u32> {
    let fake = start(config(1024, 64, 8));
    let (_g, rx) = submit(&fake.engine, r.clone());
    let tokens = wait(&rx).0;
    fake.engine.stop();
    tokens
}

#[test]
fn a_full_pool_preempts_and_everything_completes_without_leaking_blocks() {
    // 24 blocks of 4 = 96 token slots for 6 requests of 10 + 20 tokens (8 blocks each): not all fit.
    let fake = start(config(24, 64, 8));
    let e = &fake.engine;
    let requests: Vec<GenerateRequest> = (0..6).map(|i| distinct_request(i, 10, 20)).collect();
    let pending: Vec<_> = requests.iter().map(|r| submit(e, r.clone())).collect();
    for ((_, rx), r) in pending.iter().zip(&requests) {
        let (tokens, usage) = wait(rx);
        assert_eq!(usage.completion_tokens, 20);
        assert_eq!(
            tokens,
            alone(r),
            "same tokens after preemption and recomputation"
        );
    }
    assert!(metric(e, "kura:num_preemptions_total") > 0.0);
    settle(e);
    assert_eq!(
        metric(e, "kura:kv_cache_blocks_used"),
        0.0,
        "no block leaks"
    );
    assert_eq!(e.queued(), 0);
    e.stop();
}

#[test]
fn dropping_the_guard_frees_the_blocks_of_a_running_and_a_queued_request() {
    // One sequence at a time: A runs, B waits.
    let fake = start(config(64, 64, 1));
    let e = &fake.engine;
    fake.control.hold_at(3);
    let (a, a_rx) = submit(e, distinct_request(0, 10, 200));
    let (b, b_rx) = submit(e, distinct_request(1, 10, 200));
    fake.control.wait_held();
    // Gauges were published after A's second step: it holds its prompt's blocks.
    assert!(metric(e, "kura:kv_cache_blocks_used") >= 3.0);
    assert_eq!(e.queued(), 1, "B waits for its first step");
    drop(a);
    drop(b);
    fake.control.release();
    settle(e);
    assert_eq!(metric(e, "kura:kv_cache_blocks_used"), 0.0);
    assert_eq!(metric(e, "kura:request_cancelled_total"), 2.0);
    assert_eq!(e.queued(), 0, "the queued request gave its queue slot back");
    // A got its prompt's usage, its two tokens and the one of the step in flight when it was
    // cancelled, nothing after; B never started. Neither gets a terminal event: the reader is the one
    // who left. The output stage delivers on its own thread; once the engine and that stage have let
    // go of a cancelled request's sink, its channel disconnects, and every event it will ever get is
    // in it.
    let a_events = until_disconnected(&a_rx);
    assert_eq!(a_events.len(), 4, "{a_events:?}");
    assert!(matches!(a_events[0], EngineEvent::Prompted { .. }));
    assert!(a_events[1..]
        .iter()
        .all(|ev| matches!(ev, EngineEvent::Delta { .. })));
    let b_events = until_disconnected(&b_rx);
    assert!(b_events.is_empty(), "{b_events:?}");
    e.stop();
}

/// Low-priority request L runs; high-priority request H arrives while L is in its third step. The pool
/// (16 blocks) holds one of them to the end, not both (13 blocks each). Returns which finished first,
/// and both outcomes' tokens.
fn low_then_high(policy: SchedulingPolicy) -> (Vec<&'static str>, Vec<u32>, Vec<u32>, f64) {
    let fake = start(EngineConfig {
        scheduling_policy: policy,
        ..config(16, 64, 8)
    });
    let e = &fake.engine;
    assert_eq!(e.info().scheduling_policy, policy);
    let mut low = distinct_request(0, 10, 40);
    low.priority = 5;
    let mut high = distinct_request(1, 10, 40);
    high.priority = -10;
    let (tx, rx) = mpsc::channel();
    let sink = |tag: &'static str| {
        let tx = tx.clone();
        move |ev: EngineEvent| tx.send((tag, ev)).is_ok()
    };
    fake.control.hold_at(3);
    let _l = e.submit(low.clone(), sink("low")).unwrap();
    fake.control.wait_held();
    let _h = e.submit(high.clone(), sink("high")).unwrap();
    fake.control.release();

    let mut done = Vec::new();
    let mut tokens = [Vec::new(), Vec::new()];
    while done.len() < 2 {
        let (tag, ev) = rx.recv_timeout(PATIENCE).expect("the engine answers");
        let slot = usize::from(tag == "high");
        match ev {
            EngineEvent::Delta { token_ids, .. } => tokens[slot].extend(token_ids),
            EngineEvent::Finished { .. } | EngineEvent::Prompted { .. } => {}
            EngineEvent::Done { .. } => done.push(tag),
            EngineEvent::Failed(err) => panic!("{tag}: {err}"),
            EngineEvent::PromptLogprobs { .. } => panic!("{tag}: prompt scores not asked for"),
        }
    }
    assert_eq!(tokens[0], alone(&low));
    assert_eq!(tokens[1], alone(&high));
    let preemptions = metric(e, "kura:num_preemptions_total");
    settle(e);
    e.stop();
    let [l, h] = tokens;
    (done, l, h, preemptions)
}

#[test]
fn under_priority_scheduling_a_higher_priority_request_preempts_a_running_one() {
    let (done, _, _, preemptions) = low_then_high(SchedulingPolicy::Priority);
    assert_eq!(done, ["high", "low"]);
    assert!(preemptions >= 1.0);
}

#[test]
fn under_fcfs_request_priority_is_ignored() {
    let (done, _, _, _) = low_then_high(SchedulingPolicy::Fcfs);
    assert_eq!(done, ["low", "high"], "the earlier request keeps its place");
}

#[test]
fn logprob_candidates_carry_the_codecs_token_bytes() {
    let fake = start(config(64, 64, 8));
    let mut r = distinct_request(0, 6, 5);
    r.sampling.logprobs = Some(3);
    let (_g, rx) = submit(&fake.engine, r);
    let mut candidates = 0;
    loop {
        match rx.recv_timeout(PATIENCE).expect("the engine answers") {
            EngineEvent::Delta {
                token_ids,
                logprobs,
                ..
            } => {
                assert_eq!(logprobs.len(), 1);
                assert_eq!(logprobs[0].sampled.token_id, token_ids[0]);
                for c in std::iter::once(&logprobs[0].sampled).chain(&logprobs[0].top) {
                    assert_eq!(c.bytes, [0xFF, c.token_id as u8], "{c:?}");
                    assert_eq!(c.text, common::Letters.decode(&[c.token_id]));
                    candidates += 1;
                }
            }
            EngineEvent::Finished { .. } | EngineEvent::Prompted { .. } => {}
            EngineEvent::Done { .. } => break,
            EngineEvent::Failed(e) => panic!("{e}"),
            EngineEvent::PromptLogprobs { .. } => panic!("prompt scores not asked for"),
        }
    }
    assert_eq!(candidates, 5 * 4);
    fake.engine.stop();
}

#[test]
fn fcfs_is_the_default_policy() {
    assert_eq!(
        EngineConfig::default().scheduling_policy,
        SchedulingPolicy::Fcfs
    );
    assert_eq!("priority".parse(), Ok(SchedulingPolicy::Priority));
    assert!("lifo"
        .parse::<SchedulingPolicy>()
        .unwrap_err()
        .contains("lifo"));
    let _ = outcome; // shared helper, used by other test files
}

#[test]
fn sampling_outside_the_samplers_domain_is_refused_at_submit() {
    let fake = start(config(64, 64, 8));
    for (edit, name) in [
        (
            (|r: &mut GenerateRequest| r.sampling.top_p = 0.0) as fn(&mut GenerateRequest),
            "top_p",
        ),
        (|r| r.sampling.temperature = f32::NAN, "temperature"),
        (
            |r| r.sampling.repetition_penalty = 0.0,
            "repetition_penalty",
        ),
    ] {
        let mut r = distinct_request(0, 4, 4);
        edit(&mut r);
        match fake.engine.submit(r, |_: EngineEvent| true) {
            Err(kura_engine::SubmitError::BadSampling(m)) => assert!(m.contains(name), "{m}"),
            Err(other) => panic!("{name}: wrong error {other}"),
            Ok(_) => panic!("{name}: accepted"),
        }
    }
    fake.engine.stop();
}

#[test]
fn min_tokens_holds_back_the_stop_tokens_of_every_choice() {
    let fake = start(config(256, 64, 8));
    let e = &fake.engine;
    let free = request(6, 8);
    let (_g, rx) = submit(e, free.clone());
    let (tokens, _) = wait(&rx);
    assert_ne!(
        tokens[0], tokens[1],
        "the test needs a second token unlike the first"
    );
    let stop = tokens[1];
    // Its second token ends it...
    let mut r = free.clone();
    r.stop_token_ids = vec![stop];
    let (_g, rx) = submit(e, r.clone());
    let (cut, usage) = wait(&rx);
    assert_eq!(usage.completion_tokens, 2, "{cut:?}");
    // ...unless min_tokens holds it back: then not before the fifth token is chosen, in each choice.
    r.min_tokens = 5;
    let (_g, rx) = submit(e, r.clone());
    let (held, _) = wait(&rx);
    assert!(held.len() >= 5, "{held:?}");
    assert_eq!(held[0], tokens[0]);
    assert!(!held[..5].contains(&stop), "{held:?}");
    r.n = 2;
    let (_g, rx) = submit(e, r);
    let (both, usage) = wait(&rx);
    assert!(usage.completion_tokens >= 10, "{usage:?} {both:?}");
    e.stop();
}
