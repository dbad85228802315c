//! Guaranteed admission (`AdmissionMode::Guaranteed`): a request is admitted only when the blocks of every
//! choice at full length (prompt plus `max_tokens`), less the prefix blocks running sequences already hold,
//! can be reserved on top of what running requests still have reserved. So no admitted request is ever
//! preempted, a prefix shared with a running request lowers the reservation, and a request whose choices
//! outgrow the pool is refused. The same workloads under `MaxUtilization` admit more and preempt.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use kura_engine::{
    AdmissionMode, EngineConfig, OutputLimit, SchedEvent, Scheduler, SchedulerConfig,
    SchedulingPolicy, SeqKey,
};
use kura_kv::{CacheKey, EvictionPolicy};

const BLOCK: usize = 4;

fn config(num_blocks: usize, admission: AdmissionMode, prefix_caching: bool) -> SchedulerConfig {
    SchedulerConfig {
        block_size_tokens: BLOCK,
        num_blocks,
        max_num_seqs: 16,
        max_num_batched_tokens: 64,
        enable_prefix_caching: prefix_caching,
        policy: SchedulingPolicy::Fcfs,
        eviction_policy: EvictionPolicy::LeafLru,
        hash_seed: Some(3),
        tiers: Default::default(),
        preemption: Default::default(),
        admission,
        window: None,
        record_kv_events: false,
    }
}

/// A prompt of its own for each `seed`.
fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| seed * 1000 + i).collect()
}

/// Drives a scheduler as the engine does, with a pretend model: every planned item is computed; a
/// sequence whose tokens are all computed samples a token; a request with `n > 1` forks its other choices
/// at its first sample; a choice ends at `max_tokens`, a request when all its choices have.
struct Driver {
    s: Scheduler,
    limits: HashMap<u64, OutputLimit>,
    forked: HashMap<u64, bool>,
    live: HashMap<u64, usize>,
    finished: Vec<u64>,
    events: Vec<SchedEvent>,
    /// Most sequences running after any pass.
    max_running: usize,
    /// The least `available - reserved` blocks seen after a pass (negative: over-committed).
    min_slack: i64,
    t: u64,
}

impl Driver {
    fn new(config: SchedulerConfig) -> Self {
        Driver {
            s: Scheduler::new(config).unwrap(),
            limits: HashMap::new(),
            forked: HashMap::new(),
            live: HashMap::new(),
            finished: Vec::new(),
            events: Vec::new(),
            max_running: 0,
            min_slack: i64::MAX,
            t: 0,
        }
    }

    fn add(&mut self, id: u64, prompt: Vec<u32>, max_tokens: usize, n: usize) -> SeqKey {
        let limit = OutputLimit { max_tokens, n };
        self.limits.insert(id, limit);
        self.live.insert(id, n);
        let arrival = Duration::from_millis(self.t);
        self.s
            .add_request(id, CacheKey::new(), 0, arrival, prompt, limit)
    }

    /// One step; returns the events of its pass.
    fn step(&mut self) -> Vec<SchedEvent> {
        self.t += 1;
        let plan = self.s.schedule(Duration::from_millis(self.t));
        self.max_running = self.max_running.max(self.s.num_running());
        let slack = self.s.kv().num_available_blocks() as i64 - self.s.reserved_blocks() as i64;
        self.min_slack = self.min_slack.min(slack);
        for e in &plan.events {
            if let SchedEvent::CannotFit { request, .. } = e {
                self.live.remove(request);
            }
        }
        for &item in &plan.items {
            if !self.s.computed(item).complete {
                continue;
            }
            let request = self.s.request_of(item.seq).unwrap();
            let limit = self.limits[&request];
            let mut choices = vec![item.seq];
            if limit.n > 1 && !self.forked.get(&request).copied().unwrap_or(false) {
                self.forked.insert(request, true);
                for _ in 1..limit.n {
                    choices.push(self.s.fork(item.seq));
                }
            }
            for seq in choices {
                if self.s.num_generated(seq) + 1 >= limit.max_tokens {
                    self.s.finish(seq);
                    let live = self.live.get_mut(&request).unwrap();
                    *live -= 1;
                    if *live == 0 {
                        self.live.remove(&request);
                        self.s.remove_request(request);
                        self.finished.push(request);
                    }
                } else {
                    self.s.push_token(seq, 7);
                }
            }
        }
        self.events.extend(plan.events.iter().cloned());
        plan.events
    }

    fn run(&mut self, max_steps: usize) {
        for _ in 0..max_steps {
            if self.s.is_idle() {
                return;
            }
            self.step();
        }
        panic!("not done after {max_steps} steps: {:?}", self.events);
    }

    fn preemptions(&self) -> usize {
        self.events
            .iter()
            .filter(|e| matches!(e, SchedEvent::Preempted { .. }))
            .count()
    }
}

/// Five requests of 8 prompt tokens and 9 output tokens: each holds 8 + 9 - 1 = 16 tokens = 4 blocks at
/// full length, so a pool of 8 blocks holds two of them.
fn five_requests(admission: AdmissionMode) -> Driver {
    let mut d = Driver::new(config(8, admission, true));
    for id in 0..5 {
        d.add(id, prompt(id as u32 + 1, 8), 9, 1);
    }
    d.run(500);
    d
}

#[test]
fn guaranteed_admission_runs_two_of_five_at_once_and_never_preempts() {
    let d = five_requests(AdmissionMode::Guaranteed);
    let mut finished = d.finished.clone();
    finished.sort_unstable();
    assert_eq!(finished, vec![0, 1, 2, 3, 4]);
    assert_eq!(d.max_running, 2);
    assert_eq!(d.preemptions(), 0, "{:?}", d.events);
    assert!(d.min_slack >= 0, "over-committed by {}", -d.min_slack);
    // Every admission is a first one (nothing resumed), and in arrival order.
    let admitted: Vec<u64> = d
        .events
        .iter()
        .filter_map(|e| match e {
            SchedEvent::Admitted { request, first, .. } => {
                assert!(first, "{e:?}");
                Some(*request)
            }
            _ => None,
        })
        .collect();
    assert_eq!(admitted, vec![0, 1, 2, 3, 4]);
}

#[test]
fn max_utilization_runs_more_at_once_and_preempts_on_the_same_workload() {
    let d = five_requests(AdmissionMode::MaxUtilization);
    let mut finished = d.finished.clone();
    finished.sort_unstable();
    assert_eq!(finished, vec![0, 1, 2, 3, 4]);
    assert!(d.max_running > 2, "{}", d.max_running);
    assert!(d.preemptions() > 0, "{:?}", d.events);
}

#[test]
fn a_prefix_held_by_a_running_request_lowers_the_reservation() {
    // A: 16 prompt tokens (4 blocks) + 5 output = 20 tokens = 5 blocks. B: A's prompt + 2 tokens, 3
    // output = 20 tokens = 5 blocks, 4 of them A's. With 9 blocks B fits beside A only by sharing them.
    let admitted_together = |prefix_caching: bool| {
        let mut d = Driver::new(config(9, AdmissionMode::Guaranteed, prefix_caching));
        let shared = prompt(1, 16);
        let mut b_prompt = shared.clone();
        b_prompt.extend(prompt(2, 2));
        d.add(0, shared, 5, 1);
        d.add(1, b_prompt, 3, 1);
        let first = d.step();
        let together = first
            .iter()
            .filter(|e| matches!(e, SchedEvent::Admitted { .. }))
            .count()
            == 2;
        d.run(200);
        assert_eq!(d.finished.len(), 2);
        assert_eq!(d.preemptions(), 0);
        assert!(d.min_slack >= 0);
        together
    };
    assert!(admitted_together(true), "B reuses A's 4 blocks: needs 1");
    assert!(!admitted_together(false), "B needs 5 blocks, 4 are left");
}

#[test]
fn every_choice_is_reserved_and_choices_that_outgrow_the_pool_are_refused() {
    // n = 3, 8 prompt tokens, 9 output: the first choice holds 4 blocks at full length, each other one
    // its own 2 (the prompt's 2 full blocks are shared): 8 blocks.
    let mut d = Driver::new(config(10, AdmissionMode::Guaranteed, true));
    d.add(0, prompt(1, 8), 9, 3);
    // A one-choice request of 4 blocks must wait: 10 - 8 leaves 2.
    d.add(1, prompt(2, 8), 9, 1);
    d.step();
    // Its prompt was computed and its choices forked; request 1 waits.
    assert_eq!((d.s.num_running(), d.s.num_waiting()), (3, 1));
    assert_eq!(
        d.s.reserved_blocks(),
        8 - 2,
        "the prompt's 2 blocks are held"
    );
    d.run(200);
    assert_eq!(d.finished, vec![0, 1]);
    assert_eq!(
        d.max_running, 3,
        "the three choices, never request 1 beside them"
    );
    assert_eq!(d.preemptions(), 0);
    assert!(d.min_slack >= 0);

    // In a pool of 7 the three choices can never fit: refused, and the next request runs.
    let mut d = Driver::new(config(7, AdmissionMode::Guaranteed, true));
    d.add(0, prompt(1, 8), 9, 3);
    d.add(1, prompt(2, 8), 9, 1);
    d.run(200);
    assert!(d.events.contains(&SchedEvent::CannotFit {
        request: 0,
        needed_blocks: 8,
        total_blocks: 7
    }));
    assert_eq!(d.finished, vec![1]);
}

/// The engine with the fake model: 5 requests whose full length is 4 blocks each, in a pool of 8.
fn engine_run(admission: AdmissionMode) -> (usize, f64, f64) {
    let fake = common::start(EngineConfig {
        admission,
        ..common::config(8, 64, 16)
    });
    let e = &fake.engine;
    let rxs: Vec<_> = (0..5)
        .map(|i| common::submit(e, common::distinct_request(i, 8, 9)))
        .collect();
    for (_, rx) in &rxs {
        let (tokens, _) = common::wait(rx);
        assert_eq!(tokens.len(), 9);
    }
    common::settle(e);
    let widest = fake
        .batches
        .lock()
        .unwrap()
        .iter()
        .map(Vec::len)
        .max()
        .unwrap();
    let preemptions = common::metric(e, "kura:num_preemptions_total");
    let reserved = common::metric(e, "kura:kv_reserved_blocks");
    e.stop();
    (widest, preemptions, reserved)
}

#[test]
fn the_engine_in_guaranteed_mode_never_preempts() {
    let (widest, preemptions, reserved) = engine_run(AdmissionMode::Guaranteed);
    assert!(widest <= 2, "{widest} requests in one step");
    assert_eq!(preemptions, 0.0);
    assert_eq!(reserved, 0.0, "nothing running, nothing reserved");
    let (widest, preemptions, _) = engine_run(AdmissionMode::MaxUtilization);
    assert!(widest > 2, "{widest}");
    assert!(preemptions > 0.0);
}
