//! Replays checked against brute force on synthetic traces, and the acceptance figures on the real
//! Mooncake trace (vendored in `data/traces/`).

use std::collections::HashSet;
use std::path::PathBuf;

use kura_sim::{replay, Policy, SimConfig};
use kura_trace::mooncake::parse_trace;
use kura_trace::{load_trace, TraceRequest};

fn synthetic(n: usize, seed: u64) -> Vec<TraceRequest> {
    // Conversations: each request extends an earlier one's ids or starts a new chain.
    let mut state = seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u32
    };
    let mut chains: Vec<Vec<u32>> = Vec::new();
    let mut next_id = 0;
    let mut out = Vec::new();
    for i in 0..n {
        let mut ids = if !chains.is_empty() && next() % 3 != 0 {
            let c = &chains[next() as usize % chains.len()];
            c[..1 + next() as usize % c.len()].to_vec()
        } else {
            Vec::new()
        };
        for _ in 0..1 + next() % 3 {
            ids.push(next_id);
            next_id += 1;
        }
        let input_length = ids.len() as u32 * 512 - next() % 300;
        chains.push(ids.clone());
        let output_length = next() % 400;
        out.push(
            TraceRequest::new(
                i as u64 * 50,
                input_length.into(),
                output_length.into(),
                ids,
            )
            .unwrap(),
        );
    }
    out
}

/// Brute force, unbounded cache, block size 512: a full 512-token block hits if its whole id prefix was
/// seen as full blocks before.
fn reference_unbounded(trace: &[TraceRequest]) -> (u64, u64) {
    let mut seen: HashSet<Vec<u32>> = HashSet::new();
    let (mut hit_tokens, mut prompt_tokens) = (0, 0);
    for r in trace {
        prompt_tokens += u64::from(r.input_length());
        let full = (r.input_length() / 512) as usize;
        let mut prefix = true;
        for k in 1..=full {
            let key = r.hash_ids()[..k].to_vec();
            if prefix && seen.contains(&key) {
                hit_tokens += 512;
            } else {
                prefix = false;
            }
            seen.insert(key);
        }
    }
    (hit_tokens, prompt_tokens)
}

#[test]
fn unbounded_replay_equals_brute_force() {
    let trace = synthetic(400, 7);
    let (hit, total) = reference_unbounded(&trace);
    for overlap in [false, true] {
        let cfg = SimConfig {
            block_size: 512,
            overlap,
            ..SimConfig::default()
        };
        let r = replay(&trace, &cfg).unwrap();
        assert_eq!(r.prompt_tokens, total);
        // Partial last blocks add copied tokens on top of the full-block reference, never fewer.
        assert!(
            r.hit_tokens >= hit,
            "overlap {overlap}: {} < {hit}",
            r.hit_tokens
        );
        assert_eq!(r.hit_blocks * 512, hit, "overlap {overlap}");
        assert_eq!(r.evictions, 0);
        assert_eq!(r.rejected, 0);
    }
}

#[test]
fn small_block_sizes_find_at_least_the_512_token_hits() {
    let trace = synthetic(300, 3);
    let (hit, _) = reference_unbounded(&trace);
    let cfg = SimConfig {
        block_size: 16,
        overlap: false,
        ..SimConfig::default()
    };
    let r = replay(&trace, &cfg).unwrap();
    assert!(r.hit_tokens >= hit);
    assert_eq!(r.evictions, 0);
}

#[test]
fn capacity_bounds_the_hit_ratio_and_no_cache_hits_nothing() {
    let trace = synthetic(400, 11);
    let run = |capacity_tokens, policy| {
        let cfg = SimConfig {
            block_size: 64,
            capacity_tokens,
            policy,
            overlap: false,
            ..SimConfig::default()
        };
        replay(&trace, &cfg).unwrap()
    };
    let unbounded = run(None, Policy::LeafLru);
    let small_leaf = run(Some(20_000), Policy::LeafLru);
    let small_lru = run(Some(20_000), Policy::Lru);
    let none = run(None, Policy::NoCache);
    assert!(small_leaf.evictions > 0 && small_lru.evictions > 0);
    assert!(small_leaf.hit_tokens <= unbounded.hit_tokens);
    assert!(small_lru.hit_tokens <= unbounded.hit_tokens);
    assert_eq!(none.hit_tokens, 0);
}

#[test]
fn holding_requests_on_the_trace_clock_delays_them_when_the_cache_is_full() {
    let trace = synthetic(200, 5);
    let cfg = SimConfig {
        block_size: 16,
        capacity_tokens: Some(8_000),
        overlap: true,
        decode_ms_per_token: 50.0,
        ..SimConfig::default()
    };
    let r = replay(&trace, &cfg).unwrap();
    assert!(r.delayed_requests > 0);
    assert!(r.peak_used_blocks <= 500);
}

#[test]
fn bad_settings_are_errors() {
    let trace = synthetic(5, 1);
    let cfg = SimConfig {
        block_size: 0,
        ..SimConfig::default()
    };
    assert!(replay(&trace, &cfg)
        .unwrap_err()
        .to_string()
        .contains("--block-size 0"));
    let cfg = SimConfig {
        capacity_tokens: Some(3),
        ..SimConfig::default()
    };
    assert!(replay(&trace, &cfg).is_err());
    let err = parse_trace("{\"timestamp\": 1}".as_bytes(), &PathBuf::from("x.jsonl")).unwrap_err();
    assert!(err.to_string().starts_with("x.jsonl:1:"));
}

#[test]
fn degenerate_settings_name_their_flag() {
    let trace = synthetic(5, 1);
    let err = |cfg: SimConfig| replay(&trace, &cfg).unwrap_err().to_string();
    let base = SimConfig::default;
    assert!(err(SimConfig {
        capacity_tokens: Some(0),
        ..base()
    })
    .contains("--capacity-tokens 0 holds no block of 16 tokens"));
    assert!(err(SimConfig {
        capacity_tokens: Some(15),
        ..base()
    })
    .contains("--capacity-tokens 15"));
    assert!(err(SimConfig {
        block_size: 5000,
        ..base()
    })
    .contains("--block-size 5000 is outside 1..=1024"));
    for rate in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(err(SimConfig {
            prefill_tokens_per_s: rate,
            ..base()
        })
        .contains("--prefill-tokens-per-s"));
    }
    for ms in [-1.0, f64::NAN, f64::INFINITY] {
        assert!(err(SimConfig {
            decode_ms_per_token: ms,
            ..base()
        })
        .contains("--decode-ms-per-token"));
    }
    // No request (`--max-requests 0` once truncated the trace to this) is named as such, not as "0 blocks".
    let empty = replay(&[], &base()).unwrap_err().to_string();
    assert!(empty.contains("no request"), "{empty}");
    assert!(!empty.contains("0 blocks"), "{empty}");
}

#[test]
fn a_capacity_beyond_what_the_trace_fills_replays_like_an_unbounded_one() {
    let trace = synthetic(300, 9);
    for overlap in [false, true] {
        let run = |capacity_tokens| {
            let cfg = SimConfig {
                capacity_tokens,
                overlap,
                ..SimConfig::default()
            };
            replay(&trace, &cfg).unwrap()
        };
        // u64::MAX tokens once asked the manager for 2^60 blocks (an error, or an abort when it fit u32).
        let huge = run(Some(u64::MAX));
        let unbounded = run(None);
        assert_eq!(huge.capacity_blocks, u64::MAX / 16);
        assert_eq!(huge.allocated_blocks, unbounded.allocated_blocks);
        assert_eq!(huge.hit_tokens, unbounded.hit_tokens);
        assert_eq!((huge.evictions, huge.rejected), (0, 0));
        assert!(huge.to_string().contains("never evicts"));
    }
}

#[test]
fn extreme_but_valid_requests_replay_without_overflow() {
    use kura_trace::mooncake::{MAX_HASH_ID, MAX_TIMESTAMP_MS};
    let max = TraceRequest::new(MAX_TIMESTAMP_MS - 1, 512, 3, vec![MAX_HASH_ID]).unwrap();
    let again = TraceRequest::new(MAX_TIMESTAMP_MS, 512, 3, vec![MAX_HASH_ID]).unwrap();
    let trace = [max, again];
    let cfg = SimConfig {
        block_size: 16,
        // Durations of u64::MAX ms on a clock at 2^53 ms.
        prefill_tokens_per_s: f64::MIN_POSITIVE,
        decode_ms_per_token: 1e300,
        ..SimConfig::default()
    };
    let r = replay(&trace, &cfg).unwrap();
    assert_eq!(r.prompt_tokens, 1024);
    // The second request finds the first one's blocks: the largest id keeps all 512 of its tokens.
    assert_eq!(r.hit_blocks, 32);
}

fn mooncake() -> Vec<TraceRequest> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/traces/mooncake_conversation_trace.jsonl");
    load_trace(&path)
        .unwrap_or_else(|e| panic!("the Mooncake trace is needed beside the repository: {e}"))
}

/// The trace README: unbounded cache, 37.4 % of prompt tokens hit; plain LRU at 10,000 blocks of 512
/// tokens, 21.2 % of prompt blocks. Kura must land within 0.5 points of both.
#[test]
fn mooncake_acceptance_figures() {
    let trace = mooncake();
    assert_eq!(trace.len(), 12_031);
    let run = |capacity_tokens, policy| {
        let cfg = SimConfig {
            block_size: 512,
            capacity_tokens,
            policy,
            overlap: false,
            ..SimConfig::default()
        };
        replay(&trace, &cfg).unwrap()
    };
    let unbounded = run(None, Policy::LeafLru);
    assert_eq!(unbounded.prompt_blocks, 288_500);
    assert!(
        (unbounded.hit_ratio_tokens * 100.0 - 37.4).abs() <= 0.5,
        "unbounded token hit ratio {}",
        unbounded.hit_ratio_tokens
    );
    let lru = run(Some(10_000 * 512), Policy::Lru);
    assert!(
        (lru.hit_ratio_blocks * 100.0 - 21.2).abs() <= 0.5,
        "plain LRU block hit ratio {}",
        lru.hit_ratio_blocks
    );
    let leaf = run(Some(10_000 * 512), Policy::LeafLru);
    assert!(leaf.hit_ratio_blocks <= unbounded.hit_ratio_blocks);
}
