//! The scheduler on its own, driven by a clock the test gives it and a pretend forward pass that computes
//! whatever was planned: the same calls give the same plans, priorities age on the given clock (not on
//! wall time), prompts are chunked within the token budget, a second request waits for blocks a first one
//! is computing instead of computing them again, a full pool preempts the most recent request, prompts
//! beside decodes stay within the prefill cap, and a draft (speculative decoding) is computed in its sequence's item, takes only free blocks that the sequences
//! after it do not need (no eviction, no preemption for it), and leaves what the sampler kept of it cached
//! when the sequence ends on it; a sequence whose client is behind leaves the pending blocks others wait
//! for to them.

mod common;

use std::time::Duration;

use kura_kv::CacheKey;
use kura_sched::pace::PrefillCap;
use kura_sched::{
    Item, OutputLimit, Plan, SchedEvent, Scheduler, SchedulerConfig, SchedulingPolicy, SeqKey,
};

fn config(num_blocks: usize, budget: usize, max_seqs: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: max_seqs,
        policy: SchedulingPolicy::Priority,
        ..common::config(4, num_blocks, budget)
    }
}

/// What the requests of these tests may generate (they are stepped for fewer tokens).
const LIMIT: OutputLimit = OutputLimit {
    max_tokens: 64,
    n: 1,
};

fn prompt(first: u32, len: u32) -> Vec<u32> {
    (first..first + len).collect()
}

/// Runs one step at `now`: every planned item is computed and every sequence whose tokens are all
/// computed gets the token `1000 + its key`.
fn step(s: &mut Scheduler, now: Duration) -> Plan {
    let plan = s.schedule(now);
    for &item in &plan.items {
        if s.computed(item).complete {
            s.push_token(item.seq, 1000 + item.seq as u32);
        }
    }
    plan
}

fn items(plan: &Plan) -> Vec<(SeqKey, usize, usize)> {
    plan.items.iter().map(|i| (i.seq, i.start, i.end)).collect()
}

#[test]
fn the_same_calls_give_the_same_plans() {
    let run = || {
        let mut s = Scheduler::new(config(24, 8, 4)).unwrap();
        let mut log = Vec::new();
        for r in 0..6u64 {
            let p = if r % 2 == 0 {
                prompt(0, 10)
            } else {
                prompt(100 * r as u32, 7)
            };
            s.add_request(
                r,
                CacheKey::new(),
                (r % 3) as i32,
                Duration::from_millis(r * 5),
                p,
                LIMIT,
            );
        }
        for t in 0..40u64 {
            let plan = step(&mut s, Duration::from_millis(t * 10));
            log.push((items(&plan), plan.events.clone(), plan.pending_waits));
        }
        log
    };
    let a = run();
    assert_eq!(a, run());
    // Something happened: admissions and preemptions in a pool of 24 blocks of 4 tokens.
    let events: Vec<&SchedEvent> = a.iter().flat_map(|(_, e, _)| e).collect();
    assert!(events
        .iter()
        .any(|e| matches!(e, SchedEvent::Admitted { .. })));
    assert!(
        events
            .iter()
            .any(|e| matches!(e, SchedEvent::Preempted { .. })),
        "{events:?}"
    );
}

#[test]
fn priorities_age_on_the_given_clock() {
    // Room for one running sequence: whoever is admitted first is the one the order prefers.
    let admitted_first = |now_s: u64| {
        let mut s = Scheduler::new(config(64, 64, 1)).unwrap();
        // A: priority 5, arrived at 0 s; B: priority 0, arrived at `now_s`.
        let a = s.add_request(0, CacheKey::new(), 5, Duration::ZERO, prompt(0, 8), LIMIT);
        let b = s.add_request(
            1,
            CacheKey::new(),
            0,
            Duration::from_secs(now_s),
            prompt(50, 8),
            LIMIT,
        );
        let plan = s.schedule(Duration::from_secs(now_s));
        assert_eq!(plan.items.len(), 1);
        let first = plan.items[0].seq;
        assert!(first == a || first == b);
        if first == a {
            'a'
        } else {
            'b'
        }
    };
    // After 10 s A's effective priority is 5 − 1 = 4: B (0) goes first. After 60 s it is −1: A goes first.
    assert_eq!(admitted_first(10), 'b');
    assert_eq!(admitted_first(60), 'a');
}

#[test]
fn prompts_are_chunked_within_the_budget_and_decode_joins_them() {
    let mut s = Scheduler::new(config(64, 8, 4)).unwrap();
    let a = s.add_request(0, CacheKey::new(), 0, Duration::ZERO, prompt(0, 3), LIMIT);
    let plan = step(&mut s, Duration::ZERO);
    assert_eq!(items(&plan), vec![(a, 0, 3)]);
    let b = s.add_request(
        1,
        CacheKey::new(),
        0,
        Duration::ZERO,
        prompt(100, 20),
        LIMIT,
    );
    // A decodes one token a step; B's prompt fills the rest of the budget of 8.
    let plan = step(&mut s, Duration::from_millis(1));
    assert_eq!(items(&plan), vec![(a, 3, 4), (b, 0, 7)]);
    let plan = step(&mut s, Duration::from_millis(2));
    assert_eq!(items(&plan), vec![(a, 4, 5), (b, 7, 14)]);
    let plan = step(&mut s, Duration::from_millis(3));
    assert_eq!(items(&plan), vec![(a, 5, 6), (b, 14, 20)]);
    assert_eq!(s.tokens(b).len(), 21, "B sampled its first token");
    assert_eq!(s.num_generated(a), 4);
}

#[test]
fn beside_a_decode_prompts_take_at_most_the_prefill_cap_a_step_and_alone_the_whole_budget() {
    let mut s = Scheduler::new(config(64, 64, 8)).unwrap();
    s.set_prefill_cap(Some(PrefillCap::tokens(5)));
    // Nothing decodes yet: the first prompt takes the budget, whatever the cap.
    let a = s.add_request(0, CacheKey::new(), 0, Duration::ZERO, prompt(0, 12), LIMIT);
    let plan = step(&mut s, Duration::ZERO);
    assert_eq!(items(&plan), vec![(a, 0, 12)]);
    // A decodes: B's and C's prompts share 5 tokens a step, B first; C is admitted only once B's
    // prompt leaves room in a step's cap.
    let b = s.add_request(1, CacheKey::new(), 0, Duration::ZERO, prompt(100, 7), LIMIT);
    let c = s.add_request(2, CacheKey::new(), 0, Duration::ZERO, prompt(200, 6), LIMIT);
    let plan = step(&mut s, Duration::from_millis(1));
    assert_eq!(items(&plan), vec![(a, 12, 13), (b, 0, 5)]);
    let plan = step(&mut s, Duration::from_millis(2));
    assert_eq!(items(&plan), vec![(a, 13, 14), (b, 5, 7), (c, 0, 3)]);
    // B decodes now beside A; C's rest.
    let plan = step(&mut s, Duration::from_millis(3));
    assert_eq!(items(&plan), vec![(a, 14, 15), (b, 7, 8), (c, 3, 6)]);
    // No cap: a prompt beside decodes takes what the budget leaves.
    s.set_prefill_cap(None);
    let d = s.add_request(
        3,
        CacheKey::new(),
        0,
        Duration::ZERO,
        prompt(300, 40),
        LIMIT,
    );
    let plan = step(&mut s, Duration::from_millis(4));
    assert_eq!(
        items(&plan),
        vec![(a, 15, 16), (b, 8, 9), (c, 6, 7), (d, 0, 40)]
    );
    // A cap of 0 still lets a prompt progress a token a step.
    s.set_prefill_cap(Some(PrefillCap::tokens(0)));
    let e = s.add_request(4, CacheKey::new(), 0, Duration::ZERO, prompt(400, 3), LIMIT);
    let mut e_steps = 0;
    for t in 5..20 {
        let plan = step(&mut s, Duration::from_millis(t));
        if let Some(&(_, start, end)) = items(&plan).iter().find(|i| i.0 == e) {
            assert!(
                end - start == 1 || start >= 3,
                "a token a step: {start}..{end}"
            );
            e_steps += 1;
        }
        if s.decoding(e) {
            break;
        }
    }
    assert_eq!(e_steps, 3, "three prompt tokens in three steps");
    assert_eq!(s.tokens(e).len(), 4, "E sampled its first token");
}

#[test]
fn no_one_is_admitted_past_a_prompt_the_cap_holds_back_whatever_its_room_leaves() {
    let mut s = Scheduler::new(config(64, 64, 8)).unwrap();
    let a = s.add_request(0, CacheKey::new(), 0, Duration::ZERO, prompt(0, 4), LIMIT);
    step(&mut s, Duration::ZERO);
    // Three tokens of 0.3 s fit a room of 1 s; the 0.1 s left holds no token of anyone's prompt.
    s.set_prefill_cap(Some(PrefillCap {
        room_s: 1.0,
        per_token_s: 0.3,
        per_token_context_s: 0.0,
        min_tokens: 1,
    }));
    let b = s.add_request(1, CacheKey::new(), 0, Duration::ZERO, prompt(100, 8), LIMIT);
    let c = s.add_request(2, CacheKey::new(), 0, Duration::ZERO, prompt(200, 8), LIMIT);
    let plan = step(&mut s, Duration::from_millis(1));
    assert_eq!(items(&plan), vec![(a, 4, 5), (b, 0, 3)]);
    let admitted: Vec<u64> = plan
        .events
        .iter()
        .filter_map(|e| match e {
            SchedEvent::Admitted { request, .. } => Some(*request),
            _ => None,
        })
        .collect();
    assert_eq!(admitted, vec![1], "C waits, holding no blocks");
    assert_eq!(s.num_decoding(), 1);
    let plan = step(&mut s, Duration::from_millis(2));
    assert_eq!(items(&plan), vec![(a, 5, 6), (b, 3, 6)]);
    let plan = step(&mut s, Duration::from_millis(3));
    assert_eq!(items(&plan), vec![(a, 6, 7), (b, 6, 8), (c, 0, 1)]);
}

#[test]
fn a_second_request_waits_for_blocks_being_computed_instead_of_computing_them() {
    let mut s = Scheduler::new(config(64, 20, 4)).unwrap();
    let shared = prompt(0, 16);
    let a = s.add_request(0, CacheKey::new(), 0, Duration::ZERO, shared.clone(), LIMIT);
    let mut b_prompt = shared.clone();
    b_prompt.extend(prompt(500, 2));
    let b = s.add_request(1, CacheKey::new(), 0, Duration::ZERO, b_prompt, LIMIT);
    let plan = step(&mut s, Duration::ZERO);
    // A computes its 16 tokens; B, admitted in the same pass, found A's 4 blocks pending and has nothing
    // it may compute yet.
    assert_eq!(items(&plan), vec![(a, 0, 16)]);
    assert!(plan
        .events
        .iter()
        .any(|e| matches!(e, SchedEvent::Admitted { seq, .. } if *seq == b)));
    assert_eq!(s.kv().stats().prefix_pending_hit_tokens, 16);
    assert_eq!(plan.pending_waits, 1);
    // A's blocks are computed now and B's too: B computes only its own 2 tokens.
    let plan = step(&mut s, Duration::from_millis(1));
    assert_eq!(items(&plan), vec![(a, 16, 17), (b, 16, 18)]);
    assert!(plan.items.contains(&Item {
        seq: b,
        start: 16,
        end: 18
    }));
}

#[test]
fn a_full_pool_preempts_the_most_recent_and_resumes_it_from_its_cached_blocks() {
    // 6 blocks of 4 tokens; two requests of 8-token prompts, each growing by a block every 4 tokens.
    let mut s = Scheduler::new(config(6, 64, 4)).unwrap();
    let a = s.add_request(0, CacheKey::new(), 0, Duration::ZERO, prompt(0, 8), LIMIT);
    let b = s.add_request(1, CacheKey::new(), 0, Duration::ZERO, prompt(100, 8), LIMIT);
    let mut preempted = Vec::new();
    let mut b_resumed = Vec::new();
    for t in 0..12u64 {
        let plan = step(&mut s, Duration::from_millis(t));
        for e in &plan.events {
            match e {
                SchedEvent::Preempted { seq, .. } => preempted.push(*seq),
                SchedEvent::Admitted {
                    seq,
                    first: false,
                    cached_tokens,
                    ..
                } if *seq == b => b_resumed.push(*cached_tokens),
                _ => {}
            }
        }
        if t == 5 {
            // A finishes: B gets the pool back.
            s.finish(a);
        }
    }
    assert_eq!(
        preempted.first(),
        Some(&b),
        "the later admission goes first"
    );
    assert!(!preempted.contains(&a));
    assert!(!b_resumed.is_empty(), "B resumed");
    assert!(
        b_resumed[0] >= 8,
        "from its cached prompt blocks: {b_resumed:?}"
    );
}

#[test]
fn a_scored_prompt_reads_nothing_cached_and_is_computed_in_chunks_of_its_own_size() {
    let mut s = Scheduler::new(config(32, 16, 4)).unwrap();
    let at = Duration::ZERO;
    // A first request caches the prompt's three full blocks.
    s.add_request(0, CacheKey::new(), 0, at, prompt(0, 14), LIMIT);
    let plan = step(&mut s, at);
    assert_eq!(items(&plan), vec![(0, 0, 14)]);
    s.remove_request(0);

    // The same prompt, scored: admitted with nothing cached, and computed 5 tokens a step although
    // the step's budget is 16.
    let key = s.add_request(1, CacheKey::new(), 0, at, prompt(0, 14), LIMIT);
    s.score_prompt(1, 5);
    let plan = step(&mut s, at);
    let cached: Vec<usize> = plan
        .events
        .iter()
        .filter_map(|e| match e {
            SchedEvent::Admitted { cached_tokens, .. } => Some(*cached_tokens),
            _ => None,
        })
        .collect();
    assert_eq!(cached, vec![0]);
    assert_eq!(items(&plan), vec![(key, 0, 5)]);
    assert_eq!(items(&step(&mut s, at)), vec![(key, 5, 10)]);
    // Once scored, it is stepped within the whole budget again.
    s.prompt_scored(1);
    assert_eq!(items(&step(&mut s, at)), vec![(key, 10, 14)]);
    s.remove_request(1);

    // A chunk larger than the step's budget is cut to the budget.
    let key = s.add_request(3, CacheKey::new(), 0, at, prompt(0, 14), LIMIT);
    s.score_prompt(3, 100);
    assert_eq!(items(&step(&mut s, at)), vec![(key, 0, 14)]);
    s.remove_request(3);
    let mut small = Scheduler::new(config(32, 6, 4)).unwrap();
    let key = small.add_request(0, CacheKey::new(), 0, at, prompt(0, 14), LIMIT);
    small.score_prompt(0, 100);
    assert_eq!(items(&step(&mut small, at)), vec![(key, 0, 6)]);

    // Not scored, the same prompt reads the three cached blocks.
    let key = s.add_request(2, CacheKey::new(), 0, at, prompt(0, 14), LIMIT);
    assert_eq!(items(&step(&mut s, at)), vec![(key, 12, 14)]);
}

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
    let mut s = Scheduler::new(config(16, 64, 8)).unwrap();
    let a = decoding(&mut s, 1, prompt(0, 6), 50);
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
        items(&plan),
        [(a, 8, 9)],
        "the next step computes the token after the kept draft token"
    );
    assert_eq!(s.tokens(a), [0, 1, 2, 3, 4, 5, 50, 51, 60]);
}

#[test]
fn a_draft_takes_only_free_blocks_that_later_sequences_do_not_need() {
    // 4 blocks: a holds 2 (7 tokens), b holds 2 (8 tokens, its next token needs a new block).
    let mut s = Scheduler::new(config(5, 64, 8)).unwrap();
    let a = decoding(&mut s, 1, prompt(0, 6), 50);
    let b = decoding(&mut s, 2, prompt(100, 7), 150);
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
    let mut s = Scheduler::new(config(16, 64, 8)).unwrap();
    let a = decoding(&mut s, 1, prompt(0, 6), 50);
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
            SchedEvent::Admitted {
                seq, cached_tokens, ..
            } if *seq == b => Some(*cached_tokens),
            _ => None,
        })
        .expect("admitted");
    assert_eq!(admitted, 8);
}

#[test]
fn a_writer_whose_client_is_behind_leaves_its_pending_blocks_to_those_waiting_for_them() {
    let mut s = Scheduler::new(config(64, 8, 4)).unwrap();
    let shared = prompt(0, 40);
    let w = s.add_request(0, CacheKey::new(), 0, Duration::ZERO, shared.clone(), LIMIT);
    assert_eq!(items(&step(&mut s, Duration::ZERO)), vec![(w, 0, 8)]);
    // W's client falls behind (the sink of a request of several prompts is shared: another prompt's
    // output fills it): W is not stepped, up to the stalled-client timeout (30 s by default).
    s.set_blocked(0, true);
    // R, with the same 40 tokens and 2 of its own, attaches to W's 8 pending blocks. It waited for W
    // all that time; it computes them itself.
    let mut r_prompt = shared;
    r_prompt.extend(prompt(500, 2));
    let r = s.add_request(1, CacheKey::new(), 0, Duration::ZERO, r_prompt, LIMIT);
    for t in 1..10 {
        let plan = step(&mut s, Duration::from_millis(t));
        assert!(plan.items.iter().all(|i| i.seq != w), "W is not stepped");
    }
    assert!(s.num_generated(r) > 0, "R waited for W's blocks");
    assert_eq!(s.kv().stats().withdrawn_blocks, 8);
    // W's client catches up: W is admitted again, finds its prompt cached and computes only its last
    // token, for its logits.
    s.set_blocked(0, false);
    let plan = step(&mut s, Duration::from_millis(10));
    assert!(items(&plan).contains(&(w, 39, 40)), "{:?}", items(&plan));
    let plan = step(&mut s, Duration::from_millis(11));
    assert!(items(&plan).contains(&(w, 40, 41)), "{:?}", items(&plan));
}

#[test]
fn a_prompt_as_large_as_the_pool_is_admitted_past_a_partly_reused_block() {
    // 8 blocks of 4 tokens. A leaves 3 blocks cached; B's prompt is 8 blocks, the first 10 tokens A's:
    // 2 blocks hit, and the third of A's matches 2 of B's tokens (a partial hit, copied). The copy holds
    // its source beside its destination: 9 blocks at once, with nothing running to give way. B waited
    // for ever, and every request behind it.
    let mut s = Scheduler::new(config(8, 64, 4)).unwrap();
    let a = s.add_request(0, CacheKey::new(), 0, Duration::ZERO, prompt(0, 12), LIMIT);
    step(&mut s, Duration::ZERO);
    s.finish(a);
    s.remove_request(0);
    let mut b_prompt = prompt(0, 10);
    b_prompt.extend(prompt(500, 22));
    let b = s.add_request(1, CacheKey::new(), 0, Duration::ZERO, b_prompt, LIMIT);
    let plan = step(&mut s, Duration::from_millis(1));
    assert!(
        plan.items.iter().any(|i| i.seq == b),
        "B was not admitted: {:?}",
        plan.events
    );
    assert_eq!(s.kv().stats().prefix_hit_tokens, 8, "its 2 full blocks hit");
}

#[test]
fn under_guaranteed_admission_a_writer_whose_client_is_behind_is_not_preempted() {
    let mut c = config(64, 8, 4);
    c.admission = kura_sched::AdmissionMode::Guaranteed;
    let mut s = Scheduler::new(c).unwrap();
    let shared = prompt(0, 40);
    s.add_request(0, CacheKey::new(), 0, Duration::ZERO, shared.clone(), LIMIT);
    step(&mut s, Duration::ZERO);
    s.set_blocked(0, true);
    let mut r_prompt = shared;
    r_prompt.extend(prompt(500, 2));
    s.add_request(1, CacheKey::new(), 0, Duration::ZERO, r_prompt, LIMIT);
    for t in 1..5 {
        let plan = step(&mut s, Duration::from_millis(t));
        assert!(
            !plan
                .events
                .iter()
                .any(|e| matches!(e, SchedEvent::Preempted { .. })),
            "an admitted request is never preempted"
        );
    }
}
