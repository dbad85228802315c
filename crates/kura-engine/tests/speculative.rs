//! Speculative decoding (`EngineConfig::speculative`) on the deterministic fake model, whose executor
//! answers a draft's rows through the default `Executor::forward_tails` (each drafting item computed on
//! its own, every position's logits): the tokens are those of decoding one token a step, greedy and
//! seeded, with several choices and stop tokens, also when a full pool preempts sequences holding a draft;
//! no block leaks; and the engine refuses a configuration it cannot run.

mod common;

use common::{config, distinct_request, metric, settle, start, submit, PATIENCE};
use kura_engine::{EngineConfig, EngineEvent, FinishReason, GenerateRequest, NgramDraft};

/// One request's tokens by choice, each choice's finish, and its completion tokens.
type Outcome = (Vec<Vec<u32>>, Vec<(u32, FinishReason)>, u32);

fn outcome(rx: &std::sync::mpsc::Receiver<EngineEvent>) -> Outcome {
    let (mut tokens, mut finished) = (Vec::<Vec<u32>>::new(), Vec::new());
    loop {
        match rx.recv_timeout(PATIENCE).expect("the engine answers") {
            EngineEvent::Delta {
                choice, token_ids, ..
            } => {
                let c = choice as usize;
                if tokens.len() <= c {
                    tokens.resize(c + 1, Vec::new());
                }
                tokens[c].extend(token_ids);
            }
            EngineEvent::Finished { choice, reason, .. } => finished.push((choice, reason)),
            EngineEvent::Done { usage } => {
                finished.sort_by_key(|f| f.0);
                return (tokens, finished, usage.completion_tokens);
            }
            EngineEvent::PromptLogprobs { .. } | EngineEvent::Prompted { .. } => {}
            EngineEvent::Failed(e) => panic!("request failed: {e}"),
        }
    }
}

const DRAFT: NgramDraft = NgramDraft {
    num_tokens: 4,
    min_n: 1,
    max_n: 3,
    disable_by_batch_size: None,
};

/// Requests of every sampling kind: greedy, seeded with top-k and penalties, three choices, a stop token.
fn requests() -> Vec<GenerateRequest> {
    (0..8)
        .map(|i| {
            let mut r = distinct_request(i, 6 + i, 30);
            match i % 4 {
                0 => {}
                1 => {
                    r.sampling.temperature = 0.9;
                    r.sampling.top_k = 12;
                    r.sampling.frequency_penalty = 0.4;
                    r.sampling.seed = Some(u64::from(i));
                }
                2 => {
                    r.sampling.temperature = 1.0;
                    r.sampling.seed = Some(7);
                    r.n = 3;
                }
                _ => r.stop_token_ids = vec![5, 9],
            }
            r
        })
        .collect()
}

/// Every request's outcome, all submitted at once; the draft tokens checked and the preemptions.
fn run(config: EngineConfig) -> (Vec<Outcome>, f64, f64) {
    let (out, drafted, preemptions, _) = run_these(config, requests());
    (out, drafted, preemptions)
}

/// [`run`] for these requests, with the passes in which drafting paused
/// (`kura:spec_decode_paused_steps_total`).
fn run_these(config: EngineConfig, rs: Vec<GenerateRequest>) -> (Vec<Outcome>, f64, f64, f64) {
    let config_drafts = config.speculative.map(|d| d.num_tokens);
    let fake = start(config);
    let e = &fake.engine;
    let pending: Vec<_> = rs.iter().map(|r| submit(e, r.clone())).collect();
    let out = pending.iter().map(|(_, rx)| outcome(rx)).collect();
    settle(e);
    assert_eq!(
        metric(e, "kura:kv_cache_blocks_used"),
        0.0,
        "no block leaks"
    );
    let drafted = metric(e, "kura:spec_decode_num_draft_tokens_total");
    let accepted = metric(e, "kura:spec_decode_num_accepted_tokens_total");
    assert!(accepted <= drafted);
    if drafted > 0.0 {
        // The fake model's greedy choices run in cycles: drafts from their history are kept.
        assert!(accepted > 0.0, "no draft token kept of {drafted}");
    }
    let preemptions = metric(e, "kura:num_preemptions_total");
    let paused = metric(e, "kura:spec_decode_paused_steps_total");
    // Kept tokens by their position in the draft: one series per position up to
    // num_speculative_tokens, together the kept tokens, fewer at each later position.
    let text = e.metrics().render_prometheus();
    let per_pos: Vec<f64> = text
        .lines()
        .filter_map(|l| {
            l.strip_prefix("kura:spec_decode_num_accepted_tokens_per_pos_total{position=\"")
        })
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    match &config_drafts {
        Some(k) => {
            assert_eq!(per_pos.len(), *k, "{text}");
            assert_eq!(per_pos.iter().sum::<f64>(), accepted);
            assert!(per_pos.windows(2).all(|w| w[0] >= w[1]), "{per_pos:?}");
        }
        None => assert!(per_pos.is_empty(), "{per_pos:?}"),
    }
    let every_position = fake.control.every_position_calls().len();
    e.stop();
    if drafted > 0.0 {
        assert!(
            every_position > 0,
            "the default forward_tails checks drafts"
        );
    }
    (out, drafted, preemptions, paused)
}

#[test]
fn drafting_gives_the_tokens_of_one_token_a_step() {
    let (plain, drafted, _) = run(config(256, 64, 16));
    assert_eq!(drafted, 0.0);
    let (spec, drafted, _) = run(EngineConfig {
        speculative: Some(DRAFT),
        ..config(256, 64, 16)
    });
    assert!(drafted > 0.0, "no draft was checked");
    assert_eq!(spec, plain);
}

/// A configuration that drafts as `DRAFT` does, pausing at `disable_by_batch_size`.
#[test]
fn a_walk_that_stops_only_counting_inside_a_draft_gives_the_tokens_of_one_token_a_step() {
    // Greedy under a walk that only counts for its first few tokens (a reasoning budget): while it
    // does, the token is the device's argmax; a draft that runs past that point is checked row by
    // row, as its walk asks, and the tokens are those of one token a step.
    let rs: Vec<GenerateRequest> = (0..6)
        .map(|i| {
            let mut r = distinct_request(20 + i, 6 + i, 30);
            r.constraint = Some(std::sync::Arc::new(common::CountingFor(8 + 3 * i as usize)));
            r
        })
        .collect();
    let (plain, ..) = run_these(config(256, 64, 16), rs.clone());
    let (spec, drafted, ..) = run_these(
        EngineConfig {
            speculative: Some(DRAFT),
            ..config(256, 64, 16)
        },
        rs,
    );
    assert!(drafted > 0.0, "no draft was checked");
    assert_eq!(spec, plain);
}

fn pausing_at(disable_by_batch_size: Option<usize>) -> EngineConfig {
    EngineConfig {
        speculative: Some(NgramDraft {
            disable_by_batch_size,
            ..DRAFT
        }),
        ..config(256, 64, 16)
    }
}

#[test]
fn drafting_pauses_while_at_least_disable_by_batch_size_sequences_decode() {
    // One request of three choices (top-k 1: each greedy, drafts kept as often), decoding together
    // to their last token: at 3 no pass drafts, at 4 none pauses.
    let mut three = distinct_request(3, 9, 24);
    three.n = 3;
    three.sampling.temperature = 1.0;
    three.sampling.top_k = 1;
    three.sampling.seed = Some(5);
    let (plain, _, _, _) = run_these(config(256, 64, 16), vec![three.clone()]);
    let (at3, drafted3, _, paused3) = run_these(pausing_at(Some(3)), vec![three.clone()]);
    assert_eq!(drafted3, 0.0, "drafts checked while three sequences decode");
    assert!(
        paused3 >= 20.0,
        "{paused3} passes paused for 23 decode steps"
    );
    let (at4, drafted4, _, paused4) = run_these(pausing_at(Some(4)), vec![three]);
    assert_eq!(paused4, 0.0);
    assert!(drafted4 > 0.0, "no draft below the batch size that pauses");
    assert_eq!(at3, plain);
    assert_eq!(at4, plain);
    // Eight requests (ten sequences) at 3: paused while the batch is full, drafting as it thins out
    // (the stop-token request ends early), the tokens of one a step throughout.
    let (plain, _, _) = run(config(256, 64, 16));
    let (free, drafted_free, _, paused_free) = run_these(pausing_at(None), requests());
    assert_eq!(paused_free, 0.0);
    let (low, drafted_low, _, paused_low) = run_these(pausing_at(Some(3)), requests());
    assert!(
        paused_low > 0.0 && drafted_low < drafted_free,
        "{paused_low} {drafted_low} {drafted_free}"
    );
    assert_eq!(free, plain);
    assert_eq!(low, plain);
}

#[test]
fn drafting_in_a_full_pool_preempts_and_gives_the_same_tokens() {
    // 40 blocks of 4 tokens for 8 requests of up to 13 + 30 tokens (some with three choices).
    let (plain, _, _) = run(config(256, 32, 16));
    let (spec, drafted, preemptions) = run(EngineConfig {
        speculative: Some(DRAFT),
        ..config(40, 32, 16)
    });
    assert!(
        drafted > 0.0 && preemptions > 0.0,
        "{drafted} {preemptions}"
    );
    assert_eq!(spec, plain);
}

/// A greedy sequence's drafts, replayed from its prompt and output: each step proposes from the
/// tokens so far, cut to the tokens it may still generate and to the sequence's draft room
/// (`num_speculative_tokens` when `adaptive` is off), keeps the draft's tokens its output repeats and
/// draws one more. The draft count and the draft tokens checked.
fn replay_drafts(prompt: &[u32], out: &[u32], max_tokens: usize, adaptive: bool) -> (usize, usize) {
    let (mut room, mut drafts, mut drafted) = (DRAFT.num_tokens, 0, 0);
    // The prefill step draws the first token; drafts start with the first decode step.
    let mut at = 1;
    while at < out.len() {
        let tokens: Vec<u32> = prompt.iter().chain(&out[..at]).copied().collect();
        let most = (max_tokens - at).saturating_sub(1).min(room);
        let draft = DRAFT.propose(&tokens, most);
        let kept = draft
            .iter()
            .zip(&out[at..])
            .take_while(|(d, t)| d == t)
            .count();
        at += kept + 1;
        if !draft.is_empty() {
            drafts += 1;
            drafted += draft.len();
            if adaptive {
                room = kura_engine::next_draft_room(draft.len(), kept, DRAFT.num_tokens);
            }
        }
    }
    (drafts, drafted)
}

#[test]
fn a_sequences_drafts_shrink_to_one_more_than_it_kept_and_grow_back_whole_once_one_is_kept() {
    // One greedy sequence of the fake model, whose drafts are often turned down at their first
    // tokens: the engine checked the drafts the replay of its own output says, with the room each
    // draft left for the next — fewer draft tokens than drafts of `num_speculative_tokens` would
    // have been, in as many drafts, and the same output as one token a step.
    let fake = start(EngineConfig {
        speculative: Some(DRAFT),
        ..config(256, 64, 16)
    });
    let e = &fake.engine;
    let max_tokens = 120;
    let r = distinct_request(3, 9, max_tokens);
    let (_guard, rx) = submit(e, r.clone());
    let (tokens, finished, _) = outcome(&rx);
    settle(e);
    assert_eq!(finished, vec![(0, FinishReason::Length)]);
    let out = &tokens[0];
    assert_eq!(out.len(), max_tokens as usize);
    let drafts = metric(e, "kura:spec_decode_num_drafts_total") as usize;
    let drafted = metric(e, "kura:spec_decode_num_draft_tokens_total") as usize;
    e.stop();
    let adaptive = replay_drafts(&r.prompt_tokens, out, max_tokens as usize, true);
    let fixed = replay_drafts(&r.prompt_tokens, out, max_tokens as usize, false);
    println!(
        "(drafts, draft tokens): {adaptive:?}; drafts of {} always: {fixed:?}",
        DRAFT.num_tokens
    );
    assert_eq!(
        (drafts, drafted),
        adaptive,
        "drafts and draft tokens checked"
    );
    assert!(
        adaptive.1 < fixed.1,
        "the replay's draft tokens {adaptive:?}, with drafts of {} always {fixed:?}",
        DRAFT.num_tokens
    );
    let plain = start(config(256, 64, 16));
    let (_guard, rx) = submit(&plain.engine, r);
    assert_eq!(outcome(&rx).0, tokens, "the output of one token a step");
    plain.engine.stop();
}

#[test]
fn bad_drafting_configurations_are_refused_at_start() {
    for (draft, says) in [
        (
            NgramDraft {
                num_tokens: 0,
                ..DRAFT
            },
            "num_speculative_tokens 0",
        ),
        (NgramDraft { min_n: 4, ..DRAFT }, "prompt_lookup_min 4"),
        (
            NgramDraft {
                disable_by_batch_size: Some(0),
                ..DRAFT
            },
            "disable_by_batch_size 0",
        ),
    ] {
        let c = EngineConfig {
            speculative: Some(draft),
            ..config(16, 16, 4)
        };
        let e = common::try_start(c).err().expect("refused");
        assert!(e.to_string().contains(says), "{e}");
    }
}
