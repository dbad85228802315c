//! Engine death is visible: a panic on the engine thread (here a kernel fault of the fake model), or an
//! executor error the engine cannot go on after (a device fault), fails every request in the engine
//! with `EngineFailed`, marks the engine dead for the server (`is_alive`, `failure`, `wait_exit`) and
//! refuses later submits with a distinct error. An executor error that concerns one step only fails
//! that step's requests, and the engine goes on.

mod common;

use common::{config, metric, outcome, request, start, submit, Op, PATIENCE};
use kura_engine::{EngineExit, ExecError, RequestError, SubmitError};
use std::time::Duration;

#[test]
fn a_panicking_forward_call_fails_every_request_and_marks_the_engine_dead() {
    // One sequence at a time: A runs, B waits in the queue when the third forward call panics.
    let fake = start(config(64, 16, 1));
    let e = &fake.engine;
    fake.control.panic_at(3);
    let (_a, a_rx) = submit(e, request(6, 100));
    let (_b, b_rx) = submit(e, request(6, 100));

    let a = outcome(&a_rx);
    // Calls 1 (prefill) and 2 (decode) each produced a token before call 3 panicked.
    assert_eq!(a.tokens.len(), 2, "{a:?}");
    match a.result {
        Err(RequestError::EngineFailed(reason)) => assert!(
            reason.contains("fake kernel fault in forward call 3"),
            "the panic's message is reported: {reason}"
        ),
        other => panic!("running request: {other:?}"),
    }
    let b = outcome(&b_rx);
    assert!(b.tokens.is_empty());
    assert!(
        matches!(b.result, Err(RequestError::EngineFailed(_))),
        "queued request: {:?}",
        b.result
    );

    let exit = e.wait_exit(Some(PATIENCE)).expect("the engine loop ended");
    match &exit {
        EngineExit::Failed(reason) => assert!(reason.contains("fake kernel fault"), "{reason}"),
        EngineExit::Stopped => panic!("a panic is not a normal stop"),
    }
    assert!(!e.is_alive());
    assert!(e
        .failure()
        .is_some_and(|r| r.contains("fake kernel fault in forward call 3")));
    assert!(!e.is_shutting_down(), "death is not a shutdown");

    let err = e.submit(request(6, 4), |_| true).unwrap_err();
    assert!(matches!(err, SubmitError::EngineFailed(_)), "{err:?}");
    assert!(err.to_string().contains("fake kernel fault"), "{err}");
    assert_eq!(e.queued(), 0, "failed requests leave the queue");
    assert_eq!(metric(e, "kura:request_failed_total"), 2.0);
    assert_eq!(metric(e, "kura:num_requests_running"), 0.0);
    assert_eq!(fake.control.calls(), 3);
    // Stopping a dead engine still joins its thread.
    e.stop();
    assert_eq!(e.wait_exit(None), Some(exit));
}

#[test]
fn wait_exit_times_out_while_the_engine_runs_and_reports_a_normal_stop() {
    let fake = start(config(64, 16, 4));
    let e = &fake.engine;
    let (_g, rx) = submit(e, request(6, 3));
    common::wait(&rx);
    assert!(e.is_alive());
    assert_eq!(e.failure(), None);
    assert_eq!(e.wait_exit(Some(Duration::from_millis(1))), None);
    e.stop();
    assert!(!e.is_alive());
    assert_eq!(e.wait_exit(None), Some(EngineExit::Stopped));
    assert_eq!(e.failure(), None);
    let err = e.submit(request(6, 3), |_| true).unwrap_err();
    assert_eq!(err, SubmitError::ShuttingDown);
}

#[test]
fn a_fatal_executor_error_ends_the_engine_as_a_panic_does_and_names_the_step() {
    let fake = start(config(64, 16, 1));
    let e = &fake.engine;
    fake.control.fail_at(
        3,
        ExecError::Fatal("CUDA driver: CUDA_ERROR_ILLEGAL_ADDRESS".into()),
    );
    let (_a, a_rx) = submit(e, request(6, 100));
    let (_b, b_rx) = submit(e, request(6, 100));

    let a = outcome(&a_rx);
    assert_eq!(a.tokens.len(), 2, "{a:?}");
    let expected = "the executor failed at a forward step: CUDA driver: CUDA_ERROR_ILLEGAL_ADDRESS";
    match a.result {
        Err(RequestError::EngineFailed(reason)) => assert_eq!(reason, expected),
        other => panic!("running request: {other:?}"),
    }
    let b = outcome(&b_rx);
    assert!(b.tokens.is_empty());
    assert!(
        matches!(&b.result, Err(RequestError::EngineFailed(r)) if r == expected),
        "queued request: {:?}",
        b.result
    );
    assert_eq!(
        e.wait_exit(Some(PATIENCE)),
        Some(EngineExit::Failed(expected.to_string()))
    );
    assert!(!e.is_alive());
    assert_eq!(e.failure().as_deref(), Some(expected));
    let err = e.submit(request(6, 4), |_| true).unwrap_err();
    assert!(matches!(err, SubmitError::EngineFailed(_)), "{err:?}");
    assert_eq!(metric(e, "kura:request_failed_total"), 2.0);
    // Nothing ran after the fault.
    assert_eq!(fake.control.calls(), 3);
    e.stop();
}

#[test]
fn an_executor_that_answers_less_than_asked_ends_the_engine_and_names_what_it_gave() {
    // A sampled request needs its row of logits: a token in its place is the executor's fault, and
    // what the engine then knows of its pool is in doubt, as after a fault.
    let fake = start(config(64, 16, 1));
    let e = &fake.engine;
    fake.control.answer_short();
    let mut r = request(6, 10);
    r.sampling.temperature = 1.0;
    let (_a, a_rx) = submit(e, r);
    let a = outcome(&a_rx);
    assert!(a.tokens.is_empty(), "{a:?}");
    let expected =
        "the executor failed at a forward step: the executor answered item 0's Logits with Token";
    match &a.result {
        Err(RequestError::EngineFailed(reason)) => {
            assert!(reason.starts_with(expected), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert!(!e.is_alive());
    e.stop();
}

#[test]
fn a_step_error_fails_only_that_steps_requests_and_the_engine_goes_on() {
    let fake = start(config(64, 16, 1));
    let e = &fake.engine;
    fake.control.fail_at(
        3,
        ExecError::Step("device memory is short for this step".into()),
    );
    let (_a, a_rx) = submit(e, request(6, 100));
    let (_b, b_rx) = submit(e, request(7, 5));

    let a = outcome(&a_rx);
    assert_eq!(a.tokens.len(), 2, "{a:?}");
    match a.result {
        Err(RequestError::Model(m)) => assert_eq!(m, "device memory is short for this step"),
        other => panic!("the request in the failed step: {other:?}"),
    }
    // The queued request runs after it, whole, as it would have alone.
    let b = outcome(&b_rx);
    assert!(b.result.is_ok(), "{:?}", b.result);
    assert_eq!(b.tokens.len(), 5);
    let alone = start(config(64, 16, 1));
    let (_c, c_rx) = submit(&alone.engine, request(7, 5));
    assert_eq!(outcome(&c_rx).tokens, b.tokens);
    alone.engine.stop();

    assert!(e.is_alive());
    assert_eq!(e.failure(), None);
    assert_eq!(metric(e, "kura:request_failed_total"), 1.0);
    e.stop();
}

#[test]
fn a_failed_copy_on_write_ends_the_engine_before_a_step_reads_the_block() {
    // A's prompt fills three blocks; B shares its first 7 tokens: one whole block and 3 tokens of A's
    // second, which B gets as a copy of those tokens into a block of its own (copy-on-write).
    let fake = start(config(64, 64, 4));
    let e = &fake.engine;
    let a: Vec<u32> = (1..=12).collect();
    let b: Vec<u32> = a[..7].iter().copied().chain([40, 41, 42, 43, 44]).collect();
    let greedy = |prompt: &[u32]| {
        let mut r = kura_engine::GenerateRequest::greedy(prompt.to_vec(), 2);
        r.ignore_eos = true;
        r
    };
    let (_a, a_rx) = submit(e, greedy(&a));
    assert!(outcome(&a_rx).result.is_ok());
    let calls = fake.control.calls();
    fake.control.fail(Op::Copy);
    let (_b, b_rx) = submit(e, greedy(&b));
    let out = outcome(&b_rx);
    let expected = format!(
        "the executor failed at a copy-on-write block copy: {}",
        Op::Copy.fault()
    );
    match &out.result {
        Err(RequestError::EngineFailed(reason)) => assert_eq!(reason, &expected),
        other => panic!("B: {other:?}"),
    }
    assert!(out.tokens.is_empty(), "{out:?}");
    // No step ran over the block whose copy failed.
    assert_eq!(fake.control.calls(), calls);
    assert_eq!(e.failure().as_deref(), Some(expected.as_str()));
    assert!(!e.is_alive());
}

/// A grammar whose walk fails at its first token (as llguidance may past its limits).
#[derive(Debug)]
struct FailingGrammar;

struct FailingWalk;

impl kura_engine::ConstraintSpec for FailingGrammar {
    fn start(&self) -> Result<Box<dyn kura_engine::TokenConstraint>, String> {
        Ok(Box::new(FailingWalk))
    }
    fn param(&self) -> Option<&'static str> {
        Some("response_format")
    }
}

impl kura_engine::TokenConstraint for FailingWalk {
    fn choose(
        &mut self,
        _budget: usize,
        _sample: &mut dyn FnMut(&[u32]) -> u32,
    ) -> Result<u32, String> {
        Err("row has 60001 items; max is 2000".into())
    }
    fn accept(&mut self, _token: u32) -> Result<(), String> {
        Ok(())
    }
    fn is_done(&self) -> bool {
        false
    }
}

#[test]
fn a_grammar_that_fails_one_choice_of_several_fails_its_request_and_the_engine_goes_on() {
    // n = 3: the first choice's failure ends the request, its other choices with it, before they
    // sample (they were sampled after it from the same logits, and found gone).
    let fake = start(config(64, 16, 4));
    let e = &fake.engine;
    let mut r = request(6, 8);
    r.n = 3;
    r.constraint = Some(std::sync::Arc::new(FailingGrammar));
    let (_g, rx) = submit(e, r);
    match outcome(&rx).result {
        Err(RequestError::Constraint { message: m, param }) => {
            assert!(m.contains("60001 items"), "{m}");
            // The error names the field the grammar came from (the HTTP error's `param`).
            assert_eq!(param, Some("response_format"));
        }
        other => panic!("{other:?}"),
    }
    // The engine lives on and serves the next request.
    let (_h, rx) = submit(e, request(6, 4));
    assert_eq!(common::wait(&rx).0.len(), 4);
    assert!(e.is_alive());
}
