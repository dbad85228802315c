//! The engine on the real default model: reuse, early reuse, forking, preemption, cancellation and
//! leak freedom, observed through events and metrics. The model file must be there (CI fetches it with
//! scripts/fetch-model.sh); a missing model fails the tests. The same rules on a fake model, without a
//! download, are in `fake_engine.rs`.

mod common;

use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kura_engine::{
    start_engine, DiskSetup, EngineConfig, EngineEvent, EngineHandle, FinishReason,
    GenerateRequest, ModelCodec, PreemptionMode, RequestGuard, SchedulingPolicy, SubmitError,
    TierSetup, Usage,
};
use kura_kv::codec::KvDtype;
use kura_model::{LoadOptions, Model, WeightsDtype};

const BLOCK: usize = 16;

fn model() -> Arc<Model> {
    let path = kura_model::default_model_path();
    assert!(
        path.exists(),
        "default model missing at {}: run scripts/fetch-model.sh (or set KURA_MODEL)",
        path.display()
    );
    // f32 weights: a position gets the same logits whether computed alone or inside a prefill chunk,
    // which the comparisons across cache paths below rely on (bf16 decode and prefill kernels differ).
    let options = LoadOptions {
        weights_dtype: WeightsDtype::F32,
    };
    Arc::new(Model::load_with(&path, options).expect("default model loads"))
}

fn engine(model: &Arc<Model>, num_blocks: usize, max_num_batched_tokens: usize) -> EngineHandle {
    engine_with(model, num_blocks, max_num_batched_tokens, |c| {
        c.scheduling_policy = SchedulingPolicy::Fcfs
    })
}

/// An engine over f32 KV, its configuration adjusted by `tweak`.
fn engine_with(
    model: &Arc<Model>,
    num_blocks: usize,
    max_num_batched_tokens: usize,
    tweak: impl FnOnce(&mut EngineConfig),
) -> EngineHandle {
    engine_in(
        KvDtype::F32,
        model,
        num_blocks,
        max_num_batched_tokens,
        tweak,
    )
}

/// An engine over KV of `dtype`, its configuration adjusted by `tweak`.
fn engine_in(
    dtype: KvDtype,
    model: &Arc<Model>,
    num_blocks: usize,
    max_num_batched_tokens: usize,
    tweak: impl FnOnce(&mut EngineConfig),
) -> EngineHandle {
    let layout = model.kv_layout(dtype, BLOCK).unwrap();
    let storage = model.kv_storage(&layout, num_blocks).unwrap();
    let mut config = EngineConfig {
        model_name: "test".into(),
        max_model_len: model.config().max_context(),
        block_size_tokens: BLOCK,
        num_blocks,
        max_num_seqs: 64,
        max_num_batched_tokens,
        max_queue: 1000,
        enable_prefix_caching: true,
        model_fingerprint: "test".into(),
        ..EngineConfig::default()
    };
    tweak(&mut config);
    start_engine(
        config,
        Box::new(kura_model::ModelExecutor::new(model.clone(), storage)),
        Arc::new(ModelCodec::from_text(model.text().clone())),
    )
    .unwrap()
}

fn submit(e: &EngineHandle, r: GenerateRequest) -> (RequestGuard, Receiver<EngineEvent>) {
    let (tx, rx) = mpsc::channel();
    let guard = e.submit(r, move |ev| tx.send(ev).is_ok()).unwrap();
    (guard, rx)
}

#[derive(Debug, Default)]
struct Outcome {
    texts: Vec<String>,
    tokens: Vec<Vec<u32>>,
    logprobs: Vec<Vec<kura_engine::TokenLogprob>>,
    finish: Vec<Option<FinishReason>>,
    usage: Usage,
}

fn wait(rx: &Receiver<EngineEvent>, n: usize) -> Outcome {
    let mut o = Outcome {
        texts: vec![String::new(); n],
        tokens: vec![Vec::new(); n],
        logprobs: vec![Vec::new(); n],
        finish: vec![None; n],
        ..Outcome::default()
    };
    loop {
        match rx
            .recv_timeout(Duration::from_secs(120))
            .expect("engine answers")
        {
            EngineEvent::Delta {
                choice,
                text,
                token_ids,
                logprobs,
            } => {
                o.texts[choice as usize].push_str(&text);
                o.tokens[choice as usize].extend(token_ids);
                o.logprobs[choice as usize].extend(logprobs);
            }
            EngineEvent::Finished { choice, reason, .. } => {
                o.finish[choice as usize] = Some(reason)
            }
            EngineEvent::Done { usage } => {
                o.usage = usage;
                return o;
            }
            EngineEvent::Failed(e) => panic!("request failed: {e}"),
            EngineEvent::PromptLogprobs { .. } => panic!("prompt scores not asked for"),
            EngineEvent::Prompted { .. } => {}
        }
    }
}

fn metric(e: &EngineHandle, name: &str) -> f64 {
    let text = e.metrics().render_prometheus();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

fn prompt(model: &Model, words: usize, seed: usize) -> Vec<u32> {
    let text: String = (0..words)
        .map(|i| format!("item{} ", (i * 7919 + seed * 104729) % 1000))
        .collect();
    model.tokenizer().encode(&text, true).unwrap()
}

/// Waits until the engine thread has updated its gauges after the last request (nothing running, no
/// block held); fails if that never happens.
fn settle(e: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while metric(e, "kura:num_requests_running") != 0.0
        || metric(e, "kura:kv_cache_blocks_used") != 0.0
    {
        assert!(
            Instant::now() < deadline,
            "the engine never went idle: {}",
            e.metrics().render_prometheus()
        );
        // Poll interval: the deadline only turns a hang into a failure.
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn same_prompt_twice_reuses_whole_blocks_and_gives_the_same_tokens() {
    let model = model();
    let e = engine(&model, 256, 512);
    let p = prompt(&model, 150, 1);
    let (_g, rx) = submit(&e, GenerateRequest::greedy(p.clone(), 12));
    let cold = wait(&rx, 1);
    let (_g, rx) = submit(&e, GenerateRequest::greedy(p.clone(), 12));
    let warm = wait(&rx, 1);
    assert_eq!(cold.usage.cached_tokens, 0);
    let whole_blocks = (p.len() - 1) / BLOCK * BLOCK;
    assert!(
        warm.usage.cached_tokens as usize >= whole_blocks,
        "cached {} < whole blocks {whole_blocks}",
        warm.usage.cached_tokens
    );
    assert_eq!(cold.tokens, warm.tokens);
    assert_eq!(cold.texts, warm.texts);
    assert_eq!(warm.usage.prompt_tokens as usize, p.len());
    assert_eq!(warm.usage.completion_tokens, 12);
    settle(&e);
    assert_eq!(metric(&e, "kura:kv_cache_blocks_used"), 0.0);
    // Every step is counted and its time is split between the forward pass and the rest of the loop:
    // both totals are reported and have grown (how they compare is a performance question, for
    // benchmarks, not asserted here).
    let steps = metric(&e, "kura:engine_steps_total");
    let forward = metric(&e, "kura:engine_forward_seconds_total");
    let other = metric(&e, "kura:engine_step_other_seconds_total");
    assert!(steps >= 24.0, "{steps} steps for 24 generated tokens");
    assert!(forward > 0.0, "no forward time in {steps} steps");
    assert!(
        other > 0.0,
        "no time outside the forward pass in {steps} steps"
    );
    e.stop();
}

#[test]
fn different_salts_share_nothing() {
    let model = model();
    let e = engine(&model, 256, 512);
    let p = prompt(&model, 80, 2);
    let mut a = GenerateRequest::greedy(p.clone(), 2);
    a.cache_salt = Some("a".into());
    let mut b = a.clone();
    b.cache_salt = Some("b".into());
    let (_g, rx) = submit(&e, a);
    wait(&rx, 1);
    let (_g, rx) = submit(&e, b);
    assert_eq!(wait(&rx, 1).usage.cached_tokens, 0);
    e.stop();
}

#[test]
fn concurrent_requests_compute_a_shared_prefix_once() {
    let model = model();
    // A small step budget makes the first request's prefill span many steps, so the others arrive
    // while its blocks are still pending.
    let e = engine(&model, 1024, 128);
    let shared = prompt(&model, 200, 3);
    let mut guards = Vec::new();
    for i in 0..8 {
        let mut p = shared.clone();
        p.extend(prompt(&model, 3, 100 + i));
        guards.push(submit(&e, GenerateRequest::greedy(p, 4)));
    }
    let mut total_prompt = 0;
    let mut cached = 0;
    for (_, rx) in &guards {
        let o = wait(rx, 1);
        total_prompt += o.usage.prompt_tokens as usize;
        cached += o.usage.cached_tokens as usize;
    }
    let computed = metric(&e, "kura:prompt_tokens_computed_total") as usize;
    let shared_blocks = shared.len() / BLOCK * BLOCK;
    // Everything but the shared prefix's whole blocks is computed per request; those blocks once.
    assert!(
        computed <= total_prompt - 7 * shared_blocks,
        "computed {computed} prompt tokens of {total_prompt}; shared prefix {shared_blocks}"
    );
    assert_eq!(computed, total_prompt - cached);
    e.stop();
}

#[test]
fn n_choices_fork_the_prompt_and_seeded_sampling_repeats() {
    let model = model();
    let e = engine(&model, 256, 512);
    let p = prompt(&model, 40, 4);
    let mut r = GenerateRequest::greedy(p.clone(), 8);
    r.n = 3;
    r.sampling.temperature = 0.9;
    r.sampling.seed = Some(7);
    let before = metric(&e, "kura:prompt_tokens_computed_total");
    let (_g, rx) = submit(&e, r.clone());
    let first = wait(&rx, 3);
    assert_eq!(
        metric(&e, "kura:prompt_tokens_computed_total") - before,
        p.len() as f64,
        "the prompt is computed once for all choices"
    );
    assert_eq!(
        first.usage.completion_tokens as usize,
        first.tokens.iter().map(Vec::len).sum::<usize>()
    );
    assert!(first.finish.iter().all(Option::is_some));
    let mut again = r.clone();
    again.cache_salt = Some("fresh".into());
    let (_g, rx) = submit(&e, again);
    assert_eq!(wait(&rx, 3).tokens, first.tokens, "same seed, same tokens");
    e.stop();
}

#[test]
fn sampled_requests_draw_the_same_tokens_batched_together_as_alone() {
    // In a batch, every sequence's sampler draws at once beside the others' (the engine's
    // `choose_batch`), and scores its token's logprobs there; alone, a request's one sequence draws
    // and scores in the step's bookkeeping. Seeded, the tokens and logprobs must be the same either
    // way.
    let model = model();
    let e = engine(&model, 256, 512);
    let requests: Vec<GenerateRequest> = (0..8)
        .map(|i| {
            let mut r = GenerateRequest::greedy(prompt(&model, 30 + 7 * i, 10 + i), 24);
            r.ignore_eos = true;
            r.sampling.seed = Some(100 + i as u64);
            match i {
                0 => r.sampling.temperature = 1.0,
                1 => {
                    r.sampling.temperature = 0.8;
                    r.sampling.top_p = 0.9;
                }
                2 => {
                    r.sampling.temperature = 1.2;
                    r.sampling.top_k = 20;
                    r.sampling.repetition_penalty = 1.1;
                }
                3 => {
                    r.sampling.temperature = 1.0;
                    r.sampling.min_p = 0.05;
                }
                4 => {
                    r.sampling.temperature = 1.0;
                    r.sampling.logprobs = Some(5);
                }
                5 => r.sampling.logprobs = Some(20), // greedy, with logprobs
                6 => {}                              // greedy
                // Drawn under a walk that only counts: drawn beside the others all the same.
                _ => {
                    r.sampling.temperature = 1.0;
                    r.constraint = Some(std::sync::Arc::new(common::Counting));
                }
            }
            r
        })
        .collect();
    let alone: Vec<(Vec<u32>, Vec<kura_engine::TokenLogprob>)> = requests
        .iter()
        .map(|r| {
            let (_g, rx) = submit(&e, r.clone());
            let mut o = wait(&rx, 1);
            (o.tokens.remove(0), o.logprobs.remove(0))
        })
        .collect();
    for (i, (tokens, logprobs)) in alone.iter().enumerate() {
        let scored = requests[i].sampling.logprobs.is_some();
        assert_eq!(
            logprobs.len(),
            if scored { tokens.len() } else { 0 },
            "request {i}"
        );
        for (lp, &t) in logprobs.iter().zip(tokens) {
            assert_eq!(lp.sampled.token_id, t, "request {i}");
            assert_eq!(lp.top.len(), requests[i].sampling.logprobs.unwrap());
        }
    }
    let together: Vec<_> = requests
        .iter()
        .map(|r| {
            let mut r = r.clone();
            r.cache_salt = Some("together".into());
            submit(&e, r)
        })
        .collect();
    for (i, (_g, rx)) in together.iter().enumerate() {
        let o = wait(rx, 1);
        assert_eq!(o.tokens[0], alone[i].0, "request {i}");
        assert_eq!(o.logprobs[0], alone[i].1, "request {i}'s logprobs");
        assert_eq!(o.tokens[0].len(), 24);
    }
    e.stop();
}

#[test]
fn a_full_pool_preempts_and_everything_completes_without_leaks() {
    let model = model();
    // 24 blocks of 16 = 384 tokens for 6 requests of ~60 + 60 tokens each: not all fit at once.
    let e = engine(&model, 24, 256);
    let mut guards = Vec::new();
    for i in 0..6 {
        let mut r = GenerateRequest::greedy(prompt(&model, 25, 10 + i), 60);
        r.ignore_eos = true;
        guards.push(submit(&e, r));
    }
    for (_, rx) in &guards {
        let o = wait(rx, 1);
        assert_eq!(o.usage.completion_tokens, 60);
    }
    assert!(metric(&e, "kura:num_preemptions_total") > 0.0);
    settle(&e);
    assert_eq!(
        metric(&e, "kura:kv_cache_blocks_used"),
        0.0,
        "no block leaks"
    );
    e.stop();
}

/// The next event after the prompt's usage (`Prompted`, told before the first token).
fn next_output(rx: &Receiver<EngineEvent>) -> EngineEvent {
    loop {
        match rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            EngineEvent::Prompted { .. } => {}
            event => return event,
        }
    }
}

#[test]
fn cancelling_frees_blocks_at_once_and_oversized_requests_are_refused() {
    let model = model();
    let e = engine(&model, 64, 256);
    let mut r = GenerateRequest::greedy(prompt(&model, 30, 20), 400);
    r.ignore_eos = true;
    let (guard, rx) = submit(&e, r);
    // Wait for two tokens (the gauges are published at the end of the step that emitted the first),
    // then walk away.
    for _ in 0..2 {
        let event = next_output(&rx);
        assert!(matches!(event, EngineEvent::Delta { .. }), "{event:?}");
    }
    assert!(metric(&e, "kura:kv_cache_blocks_used") > 0.0);
    drop(guard);
    settle(&e);
    assert_eq!(metric(&e, "kura:kv_cache_blocks_used"), 0.0);
    assert_eq!(metric(&e, "kura:request_cancelled_total"), 1.0);

    let too_big = GenerateRequest::greedy(prompt(&model, 30, 21), 64 * BLOCK as u32);
    let err = e.submit(too_big, |_| true).unwrap_err();
    assert!(matches!(err, SubmitError::CannotFit { .. }), "{err}");
    e.stop();
}

#[test]
fn a_higher_priority_request_overtakes_and_the_preempted_one_resumes_with_the_same_output() {
    let model = model();
    let low_prompt = prompt(&model, 25, 30);
    let high_prompt = prompt(&model, 25, 31);
    let request = |p: &Vec<u32>, priority: i32| {
        let mut r = GenerateRequest::greedy(p.clone(), 120);
        r.ignore_eos = true;
        r.priority = priority;
        r
    };
    // Alone, on a roomy pool: the reference output.
    let roomy = engine(&model, 256, 256);
    let (_g, rx) = submit(&roomy, request(&low_prompt, 0));
    let alone = wait(&rx, 1);
    roomy.stop();

    // 16 blocks = 256 tokens; each request needs about 14 blocks by its end: they cannot both finish
    // without one being preempted, and the low-priority one (priority 5 vs -10) is the one.
    let e = engine_with(&model, 16, 256, |c| {
        c.scheduling_policy = SchedulingPolicy::Priority
    });
    let (_gl, low_rx) = submit(&e, request(&low_prompt, 5));
    // Wait until it runs (its first token), then the high-priority request arrives.
    let mut low_text = match next_output(&low_rx) {
        EngineEvent::Delta { text, .. } => text,
        other => panic!("unexpected {other:?}"),
    };
    let (_gh, high_rx) = submit(&e, request(&high_prompt, -10));
    let high = wait(&high_rx, 1);
    assert_eq!(high.usage.completion_tokens, 120);
    // The low-priority request is still unfinished when the high one is done (the engine emits in
    // order, so a low `Done` sent before the high one would already be in the channel).
    for event in low_rx.try_iter() {
        match event {
            EngineEvent::Delta { text, .. } => low_text.push_str(&text),
            other => panic!("the low-priority request ended before the high one: {other:?}"),
        }
    }
    let rest = wait(&low_rx, 1);
    low_text.push_str(&rest.texts[0]);
    assert!(metric(&e, "kura:num_preemptions_total") >= 1.0);
    assert_eq!(
        low_text, alone.texts[0],
        "same greedy output after preemption and recomputation"
    );
    settle(&e);
    assert_eq!(metric(&e, "kura:kv_cache_blocks_used"), 0.0);
    e.stop();
}

/// A stop string ends a choice where it starts, even though the output stage finds it beside the engine
/// loop: the text stops before it, the reason is `Stop`, usage counts the tokens the client received,
/// the choice's blocks are freed, and the other choices run on.
#[test]
fn a_stop_string_ends_its_choice_where_it_starts_and_frees_its_blocks() {
    let model = model();
    let e = engine(&model, 256, 512);
    let p = prompt(&model, 20, 6);
    // What the model says greedily, unstopped.
    let (_g, rx) = submit(&e, GenerateRequest::greedy(p.clone(), 24));
    let full = wait(&rx, 1);
    let text = &full.texts[0];
    // A stop string from the middle of that text (a few characters that start after the first token).
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 12, "{text:?}");
    let stop: String = chars[8..11].iter().collect();
    let expected: String = text[..text.find(&stop).unwrap()].to_string();

    let mut r = GenerateRequest::greedy(p.clone(), 24);
    r.stop = vec![stop.clone()];
    r.n = 2;
    r.sampling.temperature = 0.0;
    let (_g, rx) = submit(&e, r);
    let stopped = wait(&rx, 2);
    for c in 0..2 {
        assert_eq!(stopped.texts[c], expected, "stop {stop:?}");
        assert_eq!(stopped.finish[c], Some(FinishReason::Stop));
        assert!(stopped.tokens[c].len() < full.tokens[0].len());
        assert_eq!(stopped.tokens[c], full.tokens[0][..stopped.tokens[c].len()]);
    }
    assert_eq!(
        stopped.usage.completion_tokens as usize,
        stopped.tokens.iter().map(Vec::len).sum::<usize>(),
        "usage counts what the client received"
    );
    settle(&e);
    assert_eq!(metric(&e, "kura:kv_cache_blocks_used"), 0.0);
    assert_eq!(metric(&e, "kura:num_requests_running"), 0.0);
    e.stop();
}

/// Blocks evicted from a small pool into the host tier and onward to disk come back bit-identical: the
/// revisits give the cold tokens, and a restart on the same directory does too, with swap preemption in
/// the mix.
#[test]
fn blocks_from_the_host_and_disk_tiers_give_the_cold_tokens() {
    tiers_give_the_cold_tokens(KvDtype::F32);
}

// The same in each quantised format: a request served from cached int8 (fp8, int4) blocks, from the
// pool, the host tier or the disk, is bit-identical to a cold run in that format, since a block's
// scales travel inside its bytes. (A test a format: they run at once.)
#[test]
fn int8_blocks_from_the_pool_and_the_tiers_give_the_cold_tokens() {
    tiers_give_the_cold_tokens(KvDtype::Int8);
}

#[test]
fn fp8_blocks_from_the_pool_and_the_tiers_give_the_cold_tokens() {
    tiers_give_the_cold_tokens(KvDtype::Fp8);
}

#[test]
fn int4_blocks_from_the_pool_and_the_tiers_give_the_cold_tokens() {
    tiers_give_the_cold_tokens(KvDtype::Int4);
}

fn tiers_give_the_cold_tokens(dtype: KvDtype) {
    let model = model();
    let dir = std::env::temp_dir().join(format!(
        "kura-engine-model-tiers-{dtype}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let tiered = |c: &mut EngineConfig| {
        c.tiers = TierSetup {
            host_blocks: 40,
            disk: Some(DiskSetup {
                dir: dir.clone(),
                blocks: 400,
                fingerprint: 1,
            }),
            ..TierSetup::default()
        };
        c.preemption = PreemptionMode::Swap;
    };
    let request = |seed: usize| {
        let mut r = GenerateRequest::greedy(prompt(&model, 40, 300 + seed), 24);
        r.ignore_eos = true;
        r
    };
    let cold: Vec<Vec<u32>> = {
        let e = engine_in(dtype, &model, 64, 512, |c| {
            c.scheduling_policy = SchedulingPolicy::Fcfs
        });
        let out = (0..4)
            .map(|s| wait(&submit(&e, request(s)).1, 1).tokens.remove(0))
            .collect();
        e.stop();
        out
    };
    // Room for two prompts and a little more: the four do not fit at once, and two running together
    // outgrow the pool as they decode (preemption).
    let longest = (0..4)
        .map(|s| request(s).prompt_tokens.len())
        .max()
        .unwrap();
    let num_blocks = 2 * longest.div_ceil(BLOCK) + 2;
    // A revisit finds every full block before its last prompt token.
    let full_blocks = |s: usize| (request(s).prompt_tokens.len() - 1) / BLOCK * BLOCK;
    let e = engine_in(dtype, &model, num_blocks, 512, tiered);
    for (s, want) in cold.iter().enumerate() {
        assert_eq!(
            &wait(&submit(&e, request(s)).1, 1).tokens[0],
            want,
            "{dtype}"
        );
    }
    for (s, want) in cold.iter().enumerate() {
        let o = wait(&submit(&e, request(s)).1, 1);
        assert_eq!(&o.tokens[0], want, "{dtype}: revisit of prompt {s}");
        assert_eq!(
            o.usage.cached_tokens as usize,
            full_blocks(s),
            "{dtype}: prompt {s}"
        );
    }
    // Concurrent: preemption swaps to the host tier.
    let guards: Vec<_> = (0..4).map(|s| submit(&e, request(s))).collect();
    for (s, (_, rx)) in guards.iter().enumerate() {
        assert_eq!(
            &wait(rx, 1).tokens[0],
            &cold[s],
            "{dtype}: concurrent prompt {s}"
        );
    }
    settle(&e);
    assert!(metric(&e, "kura:kv_tier_hit_blocks_total{tier=\"host\"}") > 0.0);
    assert!(metric(&e, "kura:kv_swapped_out_blocks_total") > 0.0);
    e.stop();
    let e = engine_in(dtype, &model, num_blocks, 512, tiered);
    for (s, want) in cold.iter().enumerate() {
        let o = wait(&submit(&e, request(s)).1, 1);
        assert_eq!(&o.tokens[0], want, "{dtype}: prompt {s} after a restart");
        assert_eq!(
            o.usage.cached_tokens as usize,
            full_blocks(s),
            "{dtype}: prompt {s}"
        );
    }
    settle(&e);
    assert!(metric(&e, "kura:kv_tier_hit_blocks_total{tier=\"disk\"}") > 0.0);
    e.stop();
    let _ = std::fs::remove_dir_all(&dir);
}
