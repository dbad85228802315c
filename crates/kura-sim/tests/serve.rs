//! The server simulated through the engine's scheduler: every request of a workload completes with its
//! output, a shared system prompt is served from the cache (and TTFT falls with it), a pool too small for
//! the clients preempts, prompts paced beside decodes keep the time between tokens near the target, and
//! the same settings give the same figures.

use kura_kv::EvictionPolicy;
use kura_sched::{SchedulerConfig, SchedulingPolicy};
use kura_sim::{simulate, CostModel, ServeSim, Workload};

fn sim(num_blocks: usize, concurrency: usize, prefix_caching: bool) -> ServeSim {
    ServeSim {
        scheduler: SchedulerConfig {
            block_size_tokens: 16,
            num_blocks,
            max_num_seqs: 64,
            max_num_batched_tokens: 8192,
            enable_prefix_caching: prefix_caching,
            policy: SchedulingPolicy::Fcfs,
            eviction_policy: EvictionPolicy::LeafLru,
            hash_seed: Some(0),
            tiers: Default::default(),
            preemption: Default::default(),
            admission: Default::default(),
            window: None,
            record_kv_events: false,
        },
        // About the default model on two threads: 0.5 ms a prompt token, 8 ms a step.
        cost: CostModel {
            base_ms: 8.0,
            per_token_ms: 0.5,
            per_seq_ms: 0.3,
            per_prefill_attention_ms: 1.0,
            per_decode_context_ms: 3.0,
            per_shared_context_ms: Some(1.0),
            frontend_ms_per_token: 0.005,
            measured_on: "test".into(),
            threads: 1,
            kv_heads: 1,
        },
        concurrency,
        output_tokens: 64,
        max_model_len: 8192,
        prefill_step: None,
    }
}

const SHARED: Workload = Workload::SharedPrefix {
    groups: 4,
    users_per_group: 8,
    system_tokens: 1000,
    question_tokens: 50,
};

#[test]
fn every_request_completes_with_its_output() {
    for w in [
        SHARED,
        Workload::MultiTurn {
            conversations: 8,
            turns: 4,
            system_tokens: 200,
            user_tokens: 100,
        },
        Workload::Unique {
            requests: 32,
            prompt_tokens: 1050,
        },
    ] {
        let r = simulate(&w, &sim(4096, 8, true)).unwrap();
        assert_eq!(r.requests, 32, "{w:?}");
        assert_eq!(r.failed, 0);
        assert_eq!(r.output_tokens, 32 * 64);
        assert!(r.ttft_ms.p50 > 0.0 && r.itl_ms.p50 > 0.0 && r.output_tokens_per_s > 0.0);
        assert!(r.ttft_ms.p50 <= r.ttft_ms.p99 && r.itl_ms.p50 <= r.itl_ms.p99);
    }
}

#[test]
fn a_shared_system_prompt_is_served_from_the_cache() {
    let cached = simulate(&SHARED, &sim(4096, 8, true)).unwrap();
    let cold = simulate(&SHARED, &sim(4096, 8, false)).unwrap();
    assert_eq!(cold.cached_ratio, 0.0);
    // 28 of 32 requests find their group's 1,000-token system prompt (whole blocks) cached or pending.
    assert!(cached.cached_ratio > 0.7, "{}", cached.cached_ratio);
    assert!(
        cached.ttft_ms.p50 * 3.0 < cold.ttft_ms.p50,
        "{cached:?} vs {cold:?}"
    );
    assert!(cached.output_tokens_per_s > 2.0 * cold.output_tokens_per_s);
    // A conversation's next turn finds its history.
    let multi = Workload::MultiTurn {
        conversations: 8,
        turns: 4,
        system_tokens: 200,
        user_tokens: 100,
    };
    assert!(simulate(&multi, &sim(4096, 8, true)).unwrap().cached_ratio > 0.5);
}

#[test]
fn a_pool_too_small_for_the_clients_preempts() {
    let unique = Workload::Unique {
        requests: 24,
        prompt_tokens: 1050,
    };
    // A request is 1,065 prompt tokens (67 blocks of 16) and grows to 1,129 (71 blocks). 700 blocks admit
    // 10 prompts, which then outgrow the pool (710 blocks): 8 clients fit, 16 do not.
    let fits = simulate(&unique, &sim(700, 8, true)).unwrap();
    let over = simulate(&unique, &sim(700, 16, true)).unwrap();
    assert_eq!(fits.preemptions, 0);
    assert!(over.preemptions > 0);
    assert_eq!(over.requests, 24);
    assert_eq!(over.output_tokens, fits.output_tokens);
    // Past the pool, more clients only wait longer: throughput stays, latency grows.
    assert!(over.e2e_ms.p50 > fits.e2e_ms.p50, "{over:?} vs {fits:?}");
}

#[test]
fn paced_prefill_beside_decodes_keeps_the_time_between_tokens_near_the_target() {
    // Prompts of 1,065 tokens (about 530 ms of prefill at this cost model) arriving while 15 others
    // decode: uncut, each holds every stream's next token for its whole prefill.
    let unique = Workload::Unique {
        requests: 48,
        prompt_tokens: 1050,
    };
    let plain = simulate(&unique, &sim(4096, 16, true)).unwrap();
    let mut paced_sim = sim(4096, 16, true);
    paced_sim.prefill_step = Some(std::time::Duration::from_millis(100));
    let paced = simulate(&unique, &paced_sim).unwrap();
    assert_eq!(paced.requests, 48);
    assert_eq!(paced.output_tokens, plain.output_tokens);
    assert!(plain.itl_ms.p99 > 400.0, "{plain:?}");
    // Steps of about 100 ms (the cap settles on the simulated steps' times).
    assert!(paced.itl_ms.p99 < 140.0, "{paced:?}");
    assert!(paced.steps > plain.steps);
}

#[test]
fn the_same_settings_give_the_same_figures() {
    let a = simulate(&SHARED, &sim(600, 12, true)).unwrap();
    let b = simulate(&SHARED, &sim(600, 12, true)).unwrap();
    assert_eq!(a, b);
}

#[test]
fn a_pool_that_cannot_hold_one_request_is_an_error() {
    let unique = Workload::Unique {
        requests: 2,
        prompt_tokens: 1050,
    };
    let err = simulate(&unique, &sim(10, 1, true))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cannot hold") || err.contains("blocks"),
        "{err}"
    );
}

/// A first request longer than the model is refused before any session is built, at exactly the
/// length the simulation itself would send: one token less room fails, and exactly enough runs.
#[test]
fn a_first_request_longer_than_the_model_is_refused_at_its_exact_length() {
    let multi = Workload::MultiTurn {
        conversations: 2,
        turns: 1,
        system_tokens: 300,
        user_tokens: 40,
    };
    let unique = Workload::Unique {
        requests: 2,
        prompt_tokens: 500,
    };
    // System message and turn each in `<|im_start|>role\n … <|im_end|>\n`, then the answer's start.
    for (w, first) in [
        (SHARED, 1000 + 5 + 50 + 5 + 3),
        (multi, 300 + 5 + 40 + 5 + 3),
        (unique, 500 + 5 + 2 + 5 + 3),
    ] {
        let mut s = sim(4096, 1, true);
        s.max_model_len = first + s.output_tokens - 1;
        let err = simulate(&w, &s).unwrap_err().to_string();
        assert!(
            err.contains(&format!(
                "request of {first} prompt tokens and 64 output tokens"
            )),
            "{err}"
        );
        s.max_model_len = first + s.output_tokens;
        let r = simulate(&w, &s).unwrap();
        assert_eq!(r.failed, 0, "{}", w.name());
    }
}

/// A trace replayed open loop: every request is sent at its time (an idle server waits for it), prompts
/// with shared hash ids share cached blocks, and a faster replay of the same trace queues more.
#[test]
fn a_trace_is_sent_open_loop_at_its_times() {
    use kura_trace::parse_line;
    let lines = [
        r#"{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]}"#,
        r#"{"timestamp": 60000, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]}"#,
        r#"{"timestamp": 60010, "input_length": 600, "output_length": 10, "hash_ids": [3, 4]}"#,
    ];
    let requests: Vec<_> = lines.iter().map(|l| parse_line(l).unwrap()).collect();
    let trace = |time_scale: f64| Workload::Trace {
        source: "test".into(),
        requests: requests.clone(),
        time_scale,
        max_prompt_tokens: None,
        max_output_tokens: Some(8),
    };
    let r = simulate(&trace(1.0), &sim(4096, 1, true)).unwrap();
    assert_eq!((r.requests, r.concurrency), (3, 0));
    assert_eq!(r.output_tokens, 3 * 8);
    // The second request, a minute later, finds the first one's 62 whole blocks (992 tokens).
    assert!(
        (r.cached_ratio - 992.0 / 2600.0).abs() < 1e-9,
        "{}",
        r.cached_ratio
    );
    // The run lasts as long as the trace: the server idles until the second request.
    assert!(r.duration_s > 60.0, "{}", r.duration_s);
    // Sent at once, the three queue behind each other.
    let fast = simulate(&trace(0.0), &sim(4096, 1, true)).unwrap();
    assert!(
        fast.duration_s < 10.0 && fast.ttft_ms.p99 > r.ttft_ms.p99,
        "{fast:?} vs {r:?}"
    );
}
