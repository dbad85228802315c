//! Drafts (speculative decoding) through the scheduler: a draft is computed in its sequence's item, takes
//! only free blocks beyond those the sequences after it need for their next token (no eviction, no
//! preemption for it), and what the sampler kept of it stays cached when the sequence ends on it.

use std::time::Duration;

use kura_kv::{CacheKey, EvictionPolicy};
use kura_sched::{OutputLimit, Scheduler, SchedulerConfig, SchedulingPolicy, SeqKey};

const BS: usize = 4;

fn scheduler(num_blocks: usize) -> Scheduler {
    Scheduler::new(SchedulerConfig {
        block_size_tokens: BS,
        num_blocks,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        enable_prefix_caching: true,
        policy: SchedulingPolicy::Fcfs,
        eviction_policy: EvictionPolicy::LeafLru,
        hash_seed: Some(7),
        tiers: Default::default(),
        preemption: Default::default(),
        admission: Default::default(),
        window: None,
        record_kv_events: false,
    })
    .unwrap()
}

const LIMIT: OutputLimit = OutputLimit {
    max_tokens: 64,
    n: 1,
};

/// A request of `prompt` computed and given its first token `first`: a decoding sequence.
fn decoding(s: &mut Scheduler, id: u64, prompt: Vec<u32>, first: u32) -> SeqKey {
    let key = s.add_request(id, CacheKey::new(), 0, Duration::ZERO, prompt, LIMIT);
    let plan = s.schedule(Duration::ZERO);
    let item = *plan.items.iter().find(|i| i.seq == key).expect("admitted");
    assert!(s.computed(item).complete);
    s.push_token(key, first);
    assert!(s.decoding(key));
    key
}

#[test]
fn a_draft_is_computed_in_its_sequences_item_and_settled_to_the_tokens_drawn() {
    let mut s = scheduler(16);
    let a = decoding(&mut s, 1, (0..6).collect(), 50);
    s.propose_draft(a, vec![51, 52, 53]);
    let plan = s.schedule(Duration::ZERO);
    assert_eq!(plan.items.len(), 1);
    let item = plan.items[0];
    assert_eq!(
        (item.start, item.end),
        (6, 10),
        "the last token and the draft"
    );
    assert_eq!(s.num_draft(a), 3);
    assert_eq!(s.num_generated(a), 1, "a draft is not generated yet");
    assert!(s.computed(item).complete);
    assert_eq!(s.take_draft(a), vec![51, 52, 53]);
    // The sampler drew 51, then 60 where the draft said 52.
    s.push_token(a, 51);
    s.push_token(a, 60);
    s.settle_draft(a);
    assert_eq!(s.num_generated(a), 3);
    let plan = s.schedule(Duration::ZERO);
    assert_eq!(
        (plan.items[0].start, plan.items[0].end),
        (8, 9),
        "the next step computes the token after the kept draft token"
    );
    assert_eq!(s.tokens(a), [0, 1, 2, 3, 4, 5, 50, 51, 60]);
}

#[test]
fn a_draft_takes_only_free_blocks_that_later_sequences_do_not_need() {
    // 4 blocks: a holds 2 (7 tokens), b holds 2 (8 tokens, its next token needs a new block).
    let mut s = scheduler(5);
    let a = decoding(&mut s, 1, (0..6).collect(), 50);
    let b = decoding(&mut s, 2, (100..107).collect(), 150);
    // One block is free, and b needs it for its next token: a's draft of 3 would need it too.
    s.propose_draft(a, vec![51, 52, 53]);
    let plan = s.schedule(Duration::ZERO);
    assert!(
        plan.events.is_empty(),
        "nobody is preempted: {:?}",
        plan.events
    );
    let spans: Vec<_> = plan
        .items
        .iter()
        .map(|i| (i.seq, i.end - i.start))
        .collect();
    assert_eq!(
        spans,
        [(a, 2), (b, 1)],
        "a's draft cut to the slot left in its last block"
    );
    assert_eq!(s.num_draft(a), 1);
}

#[test]
fn a_sequence_that_ends_inside_its_draft_leaves_the_drawn_tokens_blocks_cached() {
    let mut s = scheduler(16);
    let a = decoding(&mut s, 1, (0..6).collect(), 50);
    s.propose_draft(a, vec![51, 52, 53]);
    let plan = s.schedule(Duration::ZERO);
    assert!(s.computed(plan.items[0]).complete);
    s.take_draft(a);
    // 51 and 52 drawn as drafted; then a stop token, which is not pushed: the sequence ends.
    s.push_token(a, 51);
    s.push_token(a, 52);
    s.finish(a);
    // The two full blocks (0..4 and 4 5 50 51) are cached: a new request with that prefix finds them.
    let b = s.add_request(
        2,
        CacheKey::new(),
        0,
        Duration::ZERO,
        vec![0, 1, 2, 3, 4, 5, 50, 51, 52, 9],
        LIMIT,
    );
    let plan = s.schedule(Duration::ZERO);
    let admitted = plan
        .events
        .iter()
        .find_map(|e| match e {
            kura_sched::SchedEvent::Admitted {
                seq, cached_tokens, ..
            } if *seq == b => Some(*cached_tokens),
            _ => None,
        })
        .expect("admitted");
    assert_eq!(admitted, 8);
}
