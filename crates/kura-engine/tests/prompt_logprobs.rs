//! Scoring a prompt (`GenerateRequest::prompt_logprobs`, the API's `echo` with `logprobs`) on the
//! deterministic fake model: every prompt token after the first gets the log-probability that the
//! model's logits at the position before it give, the cached prefix is not read (the logits of its
//! positions are needed) except, after a preemption, the blocks of the positions it scored already, a
//! scored prompt shares steps with other requests without changing their output, and `max_tokens` 0
//! scores the prompt alone.

mod common;

use common::{config, fake_logits, request, start, submit, wait, Fake, PATIENCE};
use kura_engine::{
    EngineEvent, EngineHandle, FinishReason, GenerateRequest, MissReason, PromptLogprobs, Usage,
};

/// A scored request's events until `Done`: its prompt's scores, its tokens, its finishes, its usage.
struct Scored {
    scores: Option<PromptLogprobs>,
    /// Whether the scores came before every other event.
    scores_first: bool,
    tokens: Vec<u32>,
    finished: Vec<(u32, FinishReason)>,
    usage: Usage,
}

fn run_scored(e: &EngineHandle, r: GenerateRequest) -> Scored {
    let (_guard, rx) = submit(e, r);
    let mut out = Scored {
        scores: None,
        scores_first: false,
        tokens: Vec::new(),
        finished: Vec::new(),
        usage: Usage::default(),
    };
    let mut seen = 0;
    loop {
        let event = rx.recv_timeout(PATIENCE).expect("the engine answers");
        if matches!(event, EngineEvent::Prompted { .. }) {
            continue; // the prompt's usage, checked by `common::outcome`
        }
        seen += 1;
        match event {
            EngineEvent::PromptLogprobs { prompt, logprobs } => {
                assert_eq!(prompt, 0, "the engine numbers no prompts");
                assert!(out.scores.is_none(), "the scores come once");
                out.scores_first = seen == 1;
                out.scores = Some((*logprobs).clone());
            }
            EngineEvent::Delta { token_ids, .. } => out.tokens.extend(token_ids),
            EngineEvent::Finished { choice, reason, .. } => out.finished.push((choice, reason)),
            EngineEvent::Done { usage } => {
                out.usage = usage;
                return out;
            }
            EngineEvent::Failed(e) => panic!("the scored request failed: {e}"),
            EngineEvent::Prompted { .. } => unreachable!("skipped above"),
        }
    }
}

fn scored(prompt_len: u32, max_tokens: u32, top: usize) -> GenerateRequest {
    let mut r = request(prompt_len, max_tokens);
    r.prompt_logprobs = Some(top);
    r
}

/// Checks each score against the fake model's logits at the position before its token.
fn check_scores(p: &PromptLogprobs, prompt: &[u32], top: usize) {
    assert_eq!(p.first.token_id, prompt[0]);
    assert_eq!(p.rest.len(), prompt.len() - 1);
    assert_eq!(p.ranks.len(), p.rest.len());
    for (i, lp) in p.rest.iter().enumerate() {
        let row = fake_logits(&prompt[..=i]);
        let lse = row.iter().map(|x| x.exp()).sum::<f32>().ln();
        let token = prompt[i + 1];
        assert_eq!(lp.sampled.token_id, token, "position {i}");
        let want = row[token as usize] - lse;
        assert!(
            (lp.sampled.logprob - want).abs() < 1e-6,
            "token {} of the prompt: logprob {} where the model gives {want}",
            i + 1,
            lp.sampled.logprob
        );
        let rank = row.iter().filter(|&&x| x >= row[token as usize]).count();
        assert_eq!(p.ranks[i] as usize, rank, "the rank of token {}", i + 1);
        assert_eq!(lp.top.len(), top);
        if top > 0 {
            let best = row.iter().position(|&x| x == 1.0).unwrap() as u32;
            assert_eq!(lp.top[0].token_id, best, "the most likely at position {i}");
            assert!((lp.top[0].logprob - (1.0 - lse)).abs() < 1e-6);
        }
    }
}

/// The positions a list of (first position, tokens) calls computed, in order of position.
fn covered(calls: &[(usize, usize)]) -> Vec<usize> {
    let mut positions: Vec<usize> = calls.iter().flat_map(|&(s, n)| s..s + n).collect();
    positions.sort_unstable();
    positions
}

#[test]
fn a_scored_prompt_gets_each_tokens_logprob_and_reads_nothing_cached() {
    let Fake {
        engine, control, ..
    } = start(config(256, 64, 4));
    let plain = request(40, 3);
    let prompt = plain.prompt_tokens.clone();
    let (_g, rx) = submit(&engine, plain.clone());
    let (tokens, usage) = wait(&rx);
    assert_eq!(usage.cached_tokens, 0);

    // The same prompt again, scored: all 40 positions computed (every position's logits), the same
    // output as unscored.
    let s = run_scored(&engine, scored(40, 3, 2));
    assert!(s.scores_first, "the scores come before the first token");
    check_scores(s.scores.as_ref().expect("scores sent"), &prompt, 2);
    assert_eq!(s.tokens, tokens);
    assert_eq!(s.usage.cached_tokens, 0);
    assert_eq!(
        s.usage.miss.map(|m| m.reason),
        Some(MissReason::PromptLogprobs)
    );
    // Its 40 positions, each computed once for every position's logits.
    assert_eq!(
        covered(&control.every_position_calls()),
        (0..40).collect::<Vec<_>>()
    );
    // The letters of the codec name each token.
    assert_eq!(s.scores.unwrap().rest[0].sampled.text.len(), 1);

    // Unscored, the prompt is read from the cache as before (all but its last token).
    let (_g, rx) = submit(&engine, plain);
    let (again, usage) = wait(&rx);
    assert_eq!(again, tokens);
    assert_eq!(usage.cached_tokens, 39);
}

#[test]
fn a_prompt_scored_alone_ends_each_choice_without_a_token() {
    let Fake { engine, .. } = start(config(256, 64, 4));
    let mut r = scored(13, 0, 0);
    r.n = 2;
    let prompt = r.prompt_tokens.clone();
    let s = run_scored(&engine, r);
    check_scores(s.scores.as_ref().expect("scores sent"), &prompt, 0);
    assert!(s.tokens.is_empty(), "no token generated: {:?}", s.tokens);
    let mut finished = s.finished.clone();
    finished.sort_by_key(|f| f.0);
    assert_eq!(
        finished,
        vec![(0, FinishReason::Length), (1, FinishReason::Length)]
    );
    assert_eq!(s.usage.completion_tokens, 0);
    assert_eq!(s.usage.prompt_tokens, 13);
}

#[test]
fn a_scored_prompt_shares_steps_without_changing_anyone_elses_output() {
    // Alone first: what each request gives.
    let requests: Vec<GenerateRequest> = (0..3).map(|i| request(20 + 7 * i, 12)).collect();
    let alone: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| {
            let fake = start(config(256, 64, 4));
            let (_g, rx) = submit(&fake.engine, r.clone());
            wait(&rx).0
        })
        .collect();
    let scored_alone = run_scored(&start(config(256, 64, 4)).engine, scored(90, 5, 3));

    // Together, with a step budget of 16 tokens: the scored prompt's chunks run beside the others'
    // prefill and decode.
    let Fake {
        engine, batches, ..
    } = start(config(256, 16, 4));
    let handles: Vec<_> = requests
        .iter()
        .map(|r| submit(&engine, r.clone()))
        .collect();
    let prompt = scored(90, 5, 3).prompt_tokens;
    let s = run_scored(&engine, scored(90, 5, 3));
    for ((_g, rx), want) in handles.iter().zip(&alone) {
        assert_eq!(&wait(rx).0, want);
    }
    check_scores(s.scores.as_ref().expect("scores sent"), &prompt, 3);
    assert_eq!(s.tokens, scored_alone.tokens);
    // Every call kept to the step's budget, the scored prompt's chunks too.
    let batches = batches.lock().unwrap();
    assert!(batches.iter().all(|b| b.iter().all(|&(_, n)| n <= 16)));
}

#[test]
fn a_scored_prompt_preempted_half_way_reads_back_what_it_scored_and_scores_the_rest_once() {
    // A pool of 16 blocks of 4 holds one of the two requests (13 blocks each at full length), and a
    // step's budget of 8 tokens scores the 40-token prompt in five steps: the higher-priority request
    // arrives in the third and preempts it.
    let Fake {
        engine, control, ..
    } = start(kura_engine::EngineConfig {
        scheduling_policy: kura_engine::SchedulingPolicy::Priority,
        ..config(16, 8, 8)
    });
    let mut low = scored(40, 12, 1);
    low.priority = 5;
    let prompt = low.prompt_tokens.clone();
    let alone = run_scored(&start(config(64, 8, 8)).engine, low.clone());
    let mut high = common::distinct_request(1, 10, 40);
    high.priority = -10;

    control.hold_at(3);
    let (_l, low_rx) = submit(&engine, low);
    control.wait_held();
    let (_h, high_rx) = submit(&engine, high);
    control.release();
    wait(&high_rx);
    let mut scores = None;
    let mut tokens = Vec::new();
    let usage = loop {
        match low_rx.recv_timeout(PATIENCE).expect("the engine answers") {
            EngineEvent::PromptLogprobs { logprobs, .. } => {
                assert!(scores.is_none(), "the scores come once");
                assert!(tokens.is_empty(), "the scores come before the first token");
                scores = Some((*logprobs).clone());
            }
            EngineEvent::Delta { token_ids, .. } => tokens.extend(token_ids),
            EngineEvent::Finished { .. } | EngineEvent::Prompted { .. } => {}
            EngineEvent::Done { usage } => break usage,
            EngineEvent::Failed(e) => panic!("the scored request failed: {e}"),
        }
    };
    assert!(common::metric(&engine, "kura:num_preemptions_total") >= 1.0);
    // Admitted again, it read the blocks of the 24 positions it had scored from the cache and
    // computed the rest: every position once, and every token scored once, as alone.
    let calls = control.every_position_calls();
    assert_eq!(covered(&calls), (0..40).collect::<Vec<_>>(), "{calls:?}");
    assert!(calls.iter().any(|&(start, _)| start == 24), "{calls:?}");
    let scores = scores.expect("scores sent");
    check_scores(&scores, &prompt, 1);
    assert_eq!(Some(scores), alone.scores);
    assert_eq!(tokens, alone.tokens);
    assert_eq!(usage.cached_tokens, 0);
}

#[test]
fn a_scored_prompts_chunks_keep_their_logits_within_the_bound() {
    // Rows of 64 logits (256 bytes): a bound of 5 rows cuts a step's chunk of the 23-token prompt to
    // 5 tokens, although the step's budget is 64.
    let Fake {
        engine, control, ..
    } = start(kura_engine::EngineConfig {
        score_rows_bytes: 5 * 64 * 4,
        ..config(256, 64, 4)
    });
    let r = scored(23, 2, 1);
    let prompt = r.prompt_tokens.clone();
    let s = run_scored(&engine, r);
    check_scores(s.scores.as_ref().expect("scores sent"), &prompt, 1);
    let calls = control.every_position_calls();
    assert_eq!(calls, vec![(0, 5), (5, 5), (10, 5), (15, 5), (20, 3)]);
    // Unbounded, the same prompt in one step gives the same scores and tokens.
    let alone = run_scored(&start(config(256, 64, 4)).engine, scored(23, 2, 1));
    assert_eq!(alone.scores, s.scores);
    assert_eq!(alone.tokens, s.tokens);
}

#[test]
fn an_executor_that_cannot_score_fails_that_request_alone() {
    let Fake {
        engine, control, ..
    } = start(config(256, 64, 4));
    control.fail_at(
        1,
        kura_engine::ExecError::Step("no logits of every position here".into()),
    );
    let (_g, rx) = submit(&engine, scored(12, 3, 1));
    let failed = loop {
        match rx.recv_timeout(PATIENCE).expect("the engine answers") {
            EngineEvent::Failed(e) => break e,
            EngineEvent::Done { .. } => panic!("the scored request finished"),
            _ => {}
        }
    };
    assert!(
        failed
            .to_string()
            .contains("no logits of every position here"),
        "{failed}"
    );
    // The engine goes on.
    let (_g, rx) = submit(&engine, request(12, 3));
    assert_eq!(wait(&rx).0.len(), 3);
}
