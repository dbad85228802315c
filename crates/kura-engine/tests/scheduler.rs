//! The scheduler with a deterministic stand-in model, so that batches can be inspected: chunked prefill
//! mixed with decode in one forward call, the token budget and the sequence limit, the prefill cap beside
//! decodes, and cached blocks
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
    let first = common::next_output(&a_rx);
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

/// A decodes while B's prompt of 300 tokens arrives: every forward call, and B's and A's tokens.
fn prompt_beside_a_decode(
    prefill_step: Option<Duration>,
) -> (Vec<common::Batch>, Vec<u32>, Vec<u32>, f64) {
    let mut config = common::config(1024, 4096, 8);
    config.prefill_step = prefill_step;
    let fake = common::start(config);
    let e = &fake.engine;
    // A decodes for as long as the test needs (it is dropped once B is done).
    let (a, a_rx) = submit(e, request(6, 3000));
    let first = common::next_output(&a_rx);
    assert!(matches!(first, EngineEvent::Delta { .. }), "{first:?}");
    let (_b, b_rx) = submit(e, common::distinct_request(3, 300, 4));
    let (b_tokens, _) = wait(&b_rx);
    let cap = common::metric(e, "kura:prefill_cap_tokens");
    // A's first 20 tokens (it decoded one a step while B's prompt was computed, and goes on).
    let mut a_tokens = Vec::new();
    if let EngineEvent::Delta { token_ids, .. } = first {
        a_tokens.extend(token_ids);
    }
    while a_tokens.len() < 20 {
        match common::next_output(&a_rx) {
            EngineEvent::Delta { token_ids, .. } => a_tokens.extend(token_ids),
            other => panic!("A ended early: {other:?}"),
        }
    }
    a_tokens.truncate(20);
    drop(a);
    e.stop();
    let batches = fake.batches.lock().unwrap().clone();
    (batches, a_tokens, b_tokens, cap)
}

#[test]
fn beside_decodes_a_prompt_is_cut_to_the_prefill_cap_and_the_tokens_stay_the_same() {
    let (plain, a_plain, b_plain, cap) = prompt_beside_a_decode(None);
    assert_eq!(cap, 0.0, "no cap without a target");
    // Without a target the prompt goes in one call beside A's decode.
    assert!(
        plain.iter().any(|b| b.contains(&(0, 300))),
        "B's prompt in one call: {plain:?}"
    );
    // A target far below a decode step's time: the cap is its floor, and B's prompt takes five calls
    // of at most 64 tokens, each beside A's decode.
    let (paced, a_paced, b_paced, cap) = prompt_beside_a_decode(Some(Duration::from_nanos(1)));
    assert_eq!(cap, kura_sched::pace::MIN_CHUNK as f64);
    // (A's own prompt of 6 went alone in the first call.)
    assert_eq!(paced[0], vec![(0, 6)]);
    let chunks: Vec<(usize, usize)> = paced[1..]
        .iter()
        .flat_map(|b| b.iter().copied().filter(|&(_, n)| n > 1))
        .collect();
    assert_eq!(
        chunks,
        vec![(0, 64), (64, 64), (128, 64), (192, 64), (256, 44)],
        "{paced:?}"
    );
    assert!(
        paced[1..]
            .iter()
            .filter(|b| b.iter().any(|&(_, n)| n > 1))
            .all(|b| b.len() == 2 && b.iter().any(|&(_, n)| n == 1)),
        "every chunk beside A's decode: {paced:?}"
    );
    // Cut or not, the same tokens.
    assert_eq!((a_paced, b_paced), (a_plain.clone(), b_plain.clone()));
    // A target of an hour at the start's assumed rate (a thousand tokens a second) cuts nothing; the
    // gauge says the step's whole budget.
    let (long, a_long, b_long, cap) = prompt_beside_a_decode(Some(Duration::from_secs(3600)));
    assert_eq!(cap, 4096.0);
    assert!(long.iter().any(|b| b.contains(&(0, 300))), "{long:?}");
    assert_eq!((a_long, b_long), (a_plain, b_plain));
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

/// A grammar that allows every token: it changes no choice, but its sampler needs each row's logits.
#[derive(Debug)]
struct AnyToken;

impl kura_engine::ConstraintSpec for AnyToken {
    fn start(&self) -> Result<Box<dyn kura_engine::TokenConstraint>, String> {
        Ok(Box::new(AnyToken))
    }
}

impl kura_engine::TokenConstraint for AnyToken {
    fn choose(
        &mut self,
        _budget: usize,
        sample: &mut dyn FnMut(&[u32]) -> u32,
    ) -> Result<u32, String> {
        Ok(sample(&[u32::MAX; common::VOCAB.div_ceil(32)]))
    }
    fn accept(&mut self, _token: u32) -> Result<(), String> {
        Ok(())
    }
    fn is_done(&self) -> bool {
        false
    }
}

#[test]
fn each_step_asks_the_executor_for_no_more_than_its_sequences_take() {
    use kura_engine::Want::{Argmax, Logits, Nothing};
    // Each request alone, with a prompt of its own of 40 tokens in chunks of 16: two chunks that
    // sample nothing, then its last chunk and 3 decode steps, each asking `last` (an `n = 2` request:
    // its first token from logits, as both choices draw from that row, then a token for each).
    let kinds: Vec<(
        &str,
        kura_engine::GenerateRequest,
        Vec<Vec<kura_engine::Want>>,
    )> = vec![
        (
            "greedy",
            common::distinct_request(11, 40, 4),
            vec![vec![Argmax]; 4],
        ),
        (
            "temperature 1",
            {
                let mut r = common::distinct_request(12, 40, 4);
                r.sampling.temperature = 1.0;
                r.sampling.seed = Some(7);
                r
            },
            vec![vec![Logits]; 4],
        ),
        (
            "greedy with logprobs",
            {
                let mut r = common::distinct_request(13, 40, 4);
                r.sampling.logprobs = Some(2);
                r
            },
            vec![vec![Logits]; 4],
        ),
        (
            "greedy with a repetition penalty",
            {
                let mut r = common::distinct_request(14, 40, 4);
                r.sampling.repetition_penalty = 1.3;
                r
            },
            vec![vec![Logits]; 4],
        ),
        (
            "greedy with presence and frequency penalties",
            {
                let mut r = common::distinct_request(15, 40, 4);
                r.sampling.presence_penalty = 0.5;
                r.sampling.frequency_penalty = 0.5;
                r
            },
            vec![vec![Logits]; 4],
        ),
        (
            "greedy under a grammar",
            {
                let mut r = common::distinct_request(16, 40, 4);
                r.constraint = Some(std::sync::Arc::new(AnyToken));
                r
            },
            vec![vec![Logits]; 4],
        ),
        (
            "greedy under a walk that only counts",
            {
                let mut r = common::distinct_request(18, 40, 4);
                r.constraint = Some(std::sync::Arc::new(common::Counting));
                r
            },
            vec![vec![Argmax]; 4],
        ),
        (
            "greedy, n = 2",
            {
                let mut r = common::distinct_request(17, 40, 4);
                r.n = 2;
                r
            },
            vec![
                vec![Logits],
                vec![Argmax, Argmax],
                vec![Argmax, Argmax],
                vec![Argmax, Argmax],
            ],
        ),
    ];
    let asked = common::start(common::config(256, 16, 8));
    let every_row = common::start(common::config(256, 16, 8));
    every_row.control.answer_every_row();
    for (name, r, last) in kinds {
        let from = asked.control.wants().len();
        let (_g, rx) = submit(&asked.engine, r.clone());
        let (tokens, _) = wait(&rx);
        let wants = asked.control.wants()[from..].to_vec();
        let mut expected = vec![vec![Nothing], vec![Nothing]];
        expected.extend(last);
        assert_eq!(wants, expected, "{name}");
        // Answered with every row, the engine makes the same tokens: a token chosen by the executor
        // is the one its sampler would have taken from the row.
        let (_g, rx) = submit(&every_row.engine, r);
        assert_eq!(wait(&rx).0, tokens, "{name}");
    }
    // Alongside another request's decode steps, a chunk of a prompt still asks nothing.
    let from = asked.control.wants().len();
    // (A decodes for long enough, and is dropped once B is done.)
    let (a, a_rx) = submit(&asked.engine, common::distinct_request(1, 8, 800));
    let first = common::next_output(&a_rx);
    assert!(matches!(first, EngineEvent::Delta { .. }));
    let (_b, b_rx) = submit(&asked.engine, common::distinct_request(2, 60, 2));
    wait(&b_rx);
    drop(a);
    let wants = asked.control.wants()[from..].to_vec();
    assert!(
        wants.contains(&vec![Argmax, Nothing]),
        "a decode token and a prompt's chunk in one step: {wants:?}"
    );
    asked.engine.stop();
    every_row.engine.stop();
}
