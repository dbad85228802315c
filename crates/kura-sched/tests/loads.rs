//! The scheduler with a host tier, its loads reported when the test says: blocks that the loader holds
//! for loads still in flight come back when the loads land, so a sequence running alone that needs
//! them waits instead of failing as unable to fit.

mod common;

use common::step;
use std::time::Duration;

use kura_kv::{CacheKey, TierConfig, TierMove};
use kura_sched::{OutputLimit, Scheduler, SchedulerConfig};

fn config(num_blocks: usize) -> SchedulerConfig {
    SchedulerConfig {
        tiers: TierConfig {
            host_blocks: 64,
            ..TierConfig::default()
        },
        ..common::config(4, num_blocks, 64)
    }
}

const LIMIT: OutputLimit = OutputLimit {
    max_tokens: 32,
    n: 1,
};

/// The blocks the tier moves decided so far load into.
fn loads(s: &mut Scheduler) -> Vec<u32> {
    s.take_tier_moves()
        .into_iter()
        .filter_map(|m| match m {
            TierMove::LoadHost { block, .. } | TierMove::LoadDisk { block, .. } => Some(block),
            _ => None,
        })
        .collect()
}

#[test]
fn a_sequence_alone_waits_for_blocks_held_by_loads_in_flight_instead_of_failing() {
    // 8 blocks of 4 tokens. A 24-token prompt is cached, then pushed down to the host tier by another.
    let mut s = Scheduler::new(config(8)).unwrap();
    let long: Vec<u32> = (0..24).collect();
    assert!(s.cache_prompt(&long, &CacheKey::new()).unwrap());
    assert!(s
        .cache_prompt(&(100..132).collect::<Vec<u32>>(), &CacheKey::new())
        .unwrap());
    loads(&mut s);
    // R1 finds its 6 blocks in the host tier: loads into 6 pool blocks, which the loader holds.
    let mut p1 = long.clone();
    p1.push(7);
    s.add_request(1, CacheKey::new(), 0, Duration::ZERO, p1, LIMIT);
    let plan = step(&mut s, 0);
    assert_eq!(plan.pending_waits, 1, "R1 waits for its loads");
    let loading = loads(&mut s);
    assert_eq!(loading.len(), 6);
    // Its client goes: the loads stay in flight, and so do the loader's references.
    s.remove_request(1);
    assert_eq!(s.num_loads(), 6);
    // R2, alone, has the 2 other blocks: its prompt fits, its output soon needs a third.
    let r2 = s.add_request(
        2,
        CacheKey::new(),
        0,
        Duration::from_millis(1),
        (200..205).collect(),
        LIMIT,
    );
    for t in 1..10 {
        let plan = step(&mut s, t);
        common::assert_none_failed(&plan, t);
    }
    let before = s.num_generated(r2);
    // The reads land: the loader's blocks come back, and R2 goes on.
    for b in loading {
        s.complete_load(b, true);
    }
    for t in 10..20 {
        step(&mut s, t);
    }
    assert!(
        s.num_generated(r2) > before + 5,
        "{} tokens before the loads landed, {} after",
        before,
        s.num_generated(r2)
    );
}
