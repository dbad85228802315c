//! The fleet simulated: one replica gives the single-server simulator's figures, the kv policy keeps
//! a prefix where it is cached while round-robin scatters it, and a shared tier turns one replica's
//! prefill into another's hit.

use kura_fleet::Policy;
use kura_kv::EvictionPolicy;
use kura_sched::{SchedulerConfig, SchedulingPolicy};
use kura_sim::fleet::{simulate_fleet, FleetSim};
use kura_sim::{simulate, CostModel, ServeSim, Workload};
use kura_trace::parse_line;

fn server(num_blocks: usize) -> ServeSim {
    ServeSim {
        scheduler: SchedulerConfig {
            block_size_tokens: 16,
            num_blocks,
            max_num_seqs: 64,
            max_num_batched_tokens: 8192,
            enable_prefix_caching: true,
            policy: SchedulingPolicy::Fcfs,
            eviction_policy: EvictionPolicy::LeafLru,
            hash_seed: Some(0),
            tiers: Default::default(),
            preemption: Default::default(),
            admission: Default::default(),
            window: None,
            record_kv_events: false,
        },
        cost: CostModel {
            base_ms: 8.0,
            per_token_ms: 0.5,
            per_seq_ms: 0.3,
            per_prefill_attention_ms: 1.0,
            per_decode_context_ms: 3.0,
            per_shared_context_ms: Some(1.0),
            frontend_ms_per_token: 0.0,
            measured_on: "test".into(),
            threads: 1,
            kv_heads: 1,
        },
        concurrency: 1,
        output_tokens: 8,
        max_model_len: 8192,
        prefill_step: None,
    }
}

/// `docs` documents of 4 hash ids (2,048 tokens) each asked about `rounds` times, one request a second.
fn trace(docs: u64, rounds: u64) -> Workload {
    let mut requests = Vec::new();
    for round in 0..rounds {
        for d in 0..docs {
            let t = (round * docs + d) * 1000;
            let ids: Vec<String> = (0..4).map(|i| (d * 10 + i).to_string()).collect();
            let unique = 100_000 + round * docs + d;
            let line = format!(
                r#"{{"timestamp": {t}, "input_length": 2200, "output_length": 8, "hash_ids": [{}, {unique}]}}"#,
                ids.join(", ")
            );
            requests.push(parse_line(&line).unwrap());
        }
    }
    Workload::Trace {
        source: "test".into(),
        requests,
        time_scale: 1.0,
        max_prompt_tokens: None,
        max_output_tokens: None,
    }
}

fn fleet(replicas: usize, policy: Policy, num_blocks: usize, l4: Option<usize>) -> FleetSim {
    FleetSim {
        replica: server(num_blocks),
        replicas,
        policy,
        overlap_weight: 1.0,
        l4_blocks: l4,
    }
}

#[test]
fn one_replica_is_the_single_server() {
    let w = trace(3, 4);
    let one = simulate(&w, &server(1024)).unwrap();
    for policy in [Policy::Kv, Policy::RoundRobin, Policy::LeastLoad] {
        let f = simulate_fleet(&w, &fleet(1, policy, 1024, None)).unwrap();
        assert_eq!(f.requests, one.requests);
        assert!(
            (f.cached_ratio - one.cached_ratio).abs() < 1e-12,
            "{f:?} {one:?}"
        );
        assert!(
            (f.ttft_ms.p50 - one.ttft_ms.p50).abs() < 1e-6,
            "{f:?} {one:?}"
        );
        assert!((f.duration_s - one.duration_s).abs() < 1e-9);
    }
}

#[test]
fn kv_routing_keeps_each_document_on_one_replica() {
    // 7 documents of 128 blocks over 4 replicas of 300 blocks: 2 documents fit a replica, not 7; round
    // robin sends each document to every replica in turn.
    let w = trace(7, 6);
    let kv = simulate_fleet(&w, &fleet(4, Policy::Kv, 300, None)).unwrap();
    let rr = simulate_fleet(&w, &fleet(4, Policy::RoundRobin, 300, None)).unwrap();
    assert_eq!((kv.requests, rr.requests), (42, 42));
    // After each document's first request, kv finds its 128 blocks every time: 35 × 2,048 of 42 × 2,200.
    assert!(kv.cached_ratio > 0.7, "{kv:?}");
    assert!(rr.cached_ratio < kv.cached_ratio / 2.0, "{rr:?} vs {kv:?}");
    assert!(kv.ttft_ms.p50 < rr.ttft_ms.p50, "{kv:?} vs {rr:?}");
    assert_eq!(rr.max_replica_requests, 11);
    assert_eq!(kv.l4_ratio, 0.0);
}

#[test]
fn a_shared_tier_serves_one_replicas_prefill_to_another() {
    let w = trace(7, 6);
    let rr = simulate_fleet(&w, &fleet(4, Policy::RoundRobin, 300, None)).unwrap();
    let shared = simulate_fleet(&w, &fleet(4, Policy::RoundRobin, 300, Some(100_000))).unwrap();
    assert!(shared.l4_ratio > 0.3, "{shared:?}");
    assert!(
        shared.cached_ratio > rr.cached_ratio + 0.3,
        "{shared:?} vs {rr:?}"
    );
    // A tier too small for one document helps little.
    let tiny = simulate_fleet(&w, &fleet(4, Policy::RoundRobin, 300, Some(16))).unwrap();
    assert!(tiny.l4_ratio < 0.05, "{tiny:?}");
}

#[test]
fn a_fleet_refuses_what_it_cannot_simulate() {
    let closed = Workload::Unique {
        requests: 2,
        prompt_tokens: 10,
    };
    let err = simulate_fleet(&closed, &fleet(2, Policy::Kv, 64, None)).unwrap_err();
    assert!(err.to_string().contains("--workload trace"), "{err}");
    let err = simulate_fleet(&trace(1, 1), &fleet(0, Policy::Kv, 64, None)).unwrap_err();
    assert!(err.to_string().contains("at least 1 replica"), "{err}");
}
