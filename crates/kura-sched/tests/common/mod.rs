//! What the scheduler's integration tests share: a configuration to start from, and a pass whose items
//! are all computed.

#![allow(dead_code)]

use std::time::Duration;

use kura_kv::EvictionPolicy;
use kura_sched::{Plan, SchedEvent, Scheduler, SchedulerConfig, SchedulingPolicy};

/// Blocks of `block_size` tokens, `num_blocks` of them, at most 8 sequences and `budget` tokens a
/// pass, FCFS, prefix caching on, no tiers and no window; a test changes what it needs.
pub fn config(block_size: usize, num_blocks: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size_tokens: block_size,
        num_blocks,
        max_num_seqs: 8,
        max_num_batched_tokens: budget,
        enable_prefix_caching: true,
        policy: SchedulingPolicy::Fcfs,
        eviction_policy: EvictionPolicy::LeafLru,
        hash_seed: Some(7),
        tiers: Default::default(),
        preemption: Default::default(),
        admission: Default::default(),
        window: None,
        record_kv_events: false,
    }
}

/// Runs one pass at `t` ms: every planned item is computed and every sequence whose tokens are all
/// computed gets a token.
pub fn step(s: &mut Scheduler, t: u64) -> Plan {
    let plan = s.schedule(Duration::from_millis(t));
    for &item in &plan.items {
        if s.computed(item).complete {
            s.push_token(item.seq, 5000 + t as u32);
        }
    }
    plan
}

/// Asserts that pass `t`'s plan failed no request as unable to fit.
pub fn assert_none_failed(plan: &Plan, t: u64) {
    assert!(
        !plan
            .events
            .iter()
            .any(|e| matches!(e, SchedEvent::CannotFit { .. })),
        "pass {t}: {:?}",
        plan.events
    );
}
