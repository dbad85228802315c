//! The scheduler with a deterministic stand-in model, so that batches can be inspected: chunked prefill
//! mixed with decode in one forward call, the token budget and the sequence limit, and cached blocks
//! reused by a later request. The stand-in's next token depends on the last input token and its position,
//! so any mix-up of positions or block tables changes the output.

mod common;

use std::time::Duration;

use common::{engine, request, submit, wait};
use kura_engine::EngineEvent;

#[test]
fn prefill_chunks_and_decode_tokens_share_forward_calls_within_the_budget() {
    let (e, batches) = engine(1024, 16, 8);
    // A decodes for long enough (and is dropped once B is done).
    let (a, a_rx) = submit(&e, request(6, 3000));
    // Let A reach decode, then send a long prompt that needs several chunks.
    let first = a_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(matches!(first, EngineEvent::Delta { .. }));
    let (_b, b_rx) = submit(&e, request(100, 3));
    let (b_tokens, b_usage) = wait(&b_rx);
    drop(a);
    let batches = batches.lock().unwrap().clone();
    assert!(batches
        .iter()
        .all(|b| b.iter().map(|&(_, n)| n).sum::<usize>() <= 16));
    let mixed = batches
        .iter()
        .filter(|b| b.len() == 2 && b.iter().any(|&(_, n)| n == 1) && b.iter().any(|&(_, n)| n > 1))
        .count();
    assert!(
        mixed >= 3,
        "decode and prefill chunks in the same call: {batches:?}"
    );
    assert_eq!(b_usage.prompt_tokens, 100);
    assert_eq!(b_tokens.len(), 3);

    // Chunked or not, cached or not, the same tokens: B alone on a fresh engine with a big budget.
    let (fresh, _) = engine(256, 4096, 8);
    let (_b2, rx) = submit(&fresh, request(100, 3));
    assert_eq!(wait(&rx).0, b_tokens);
    // And again on the same engine, from the cache (all whole blocks but the last token's).
    let (_b3, rx) = submit(&fresh, request(100, 3));
    let (tokens, usage) = wait(&rx);
    assert_eq!(tokens, b_tokens);
    assert_eq!(usage.cached_tokens, 99);
    e.stop();
    fresh.stop();
}

#[test]
fn at_most_max_num_seqs_run_at_once() {
    let (e, batches) = engine(256, 64, 2);
    let rxs: Vec<_> = (0..5).map(|i| submit(&e, request(5 + i, 6))).collect();
    for (_, rx) in &rxs {
        wait(rx);
    }
    let batches = batches.lock().unwrap();
    assert!(batches.iter().all(|b| b.len() <= 2), "{batches:?}");
    e.stop();
}

#[test]
fn n_choices_compute_the_prompt_once() {
    let (e, batches) = engine(256, 64, 8);
    let mut r = request(10, 5);
    r.n = 3;
    let (_g, rx) = submit(&e, r);
    let (tokens, usage) = wait(&rx);
    assert_eq!(usage.completion_tokens, 15);
    assert_eq!(tokens.len(), 15);
    // The prompt was computed once: one item covers positions 0..10, no other item starts before 10.
    let batches = batches.lock().unwrap();
    let prompt_items: Vec<_> = batches
        .iter()
        .flatten()
        .filter(|&&(start, _)| start < 10)
        .collect();
    assert_eq!(prompt_items, vec![&(0, 10)]);
    e.stop();
}
