//! A fleet simulated: a trace sent open loop (each request at its time) to `replicas` servers behind a
//! router. Each replica is the engine's own [`Scheduler`] on its own pool, stepped on the simulator's
//! clock with the [`CostModel`] (as [`crate::serve`] steps one); the router decides with
//! [`kura_fleet::choose`], the function `kura router` uses, from what each replica's KV manager holds
//! (the router's index with no event lag: blocks computed, pending, or in a lower tier) and the work it
//! sent each one (blocks to prefill until the first token, one per request until it ends).
//!
//! With `l4_blocks`, the replicas share a tier of that many blocks (Redis in `kura serve
//! --kv-redis-url`): a request's prompt blocks enter it when its first token is out, and a request's
//! blocks that its replica lacks but the tier holds are adopted into the replica's pool on arrival
//! (`Scheduler::begin_adoption`), as the server does; the fetch itself is taken to cost nothing.
//! Least recently used blocks leave the tier first.
//!
//! ```text
//!  arrivals (trace order) ─▶ choose(held prefix, work, load) ─▶ replica r: [L4 adoption] add_request
//!  earliest event first:   arrival  │  replica r's step ends: tokens, first tokens, completions; next step
//! ```

use std::collections::{BTreeMap, HashMap};

use kura_fleet::ContentNamer;
use kura_kv::{CacheKey, Secret};
use kura_sched::{Item, OutputLimit, SchedEvent, Scheduler};
use serde::Serialize;

use crate::replay::SimError;
use crate::serve::{at, step_shape, Dist, ServeSim, Workload};
use kura_fleet::{choose, Candidate, Policy};
use kura_sched::pace::PrefillPace;

/// The settings of one fleet run.
#[derive(Debug, Clone)]
pub struct FleetSim {
    /// Each replica's scheduler, cost model and limits.
    pub replica: ServeSim,
    pub replicas: usize,
    pub policy: Policy,
    pub overlap_weight: f64,
    /// Blocks of the shared tier; `None`: no shared tier.
    pub l4_blocks: Option<usize>,
}

/// What one fleet run gives.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct FleetReport {
    pub replicas: usize,
    pub policy: String,
    pub l4_blocks: Option<usize>,
    pub requests: usize,
    pub failed: usize,
    pub ttft_ms: Dist,
    pub e2e_ms: Dist,
    pub output_tokens_per_s: f64,
    /// Prompt tokens served from a cache (the replica's pool and tiers, or adopted from L4), over all.
    pub cached_ratio: f64,
    /// Prompt tokens adopted from the shared tier, over all.
    pub l4_ratio: f64,
    /// Requests of the busiest and the idlest replica.
    pub max_replica_requests: usize,
    pub min_replica_requests: usize,
    pub duration_s: f64,
}

struct Replica {
    sched: Scheduler,
    /// Its prefill pacing (`ServeSim::prefill_step`).
    pace: Option<PrefillPace>,
    /// The step in progress: when it ends and what it computes.
    step: Option<(f64, Vec<Item>)>,
    in_flight: u64,
    work_blocks: u64,
    requests: usize,
}

struct Req {
    replica: usize,
    output_tokens: usize,
    sent_at: f64,
    first_at: Option<f64>,
    produced: usize,
    prefill_blocks: u64,
    /// Content names of the prompt's whole blocks (for the shared tier).
    names: Vec<u128>,
}

/// The shared tier: block names, least recently used first out.
struct SharedTier {
    capacity: usize,
    stamp: u64,
    by_name: HashMap<u128, u64>,
    by_stamp: BTreeMap<u64, u128>,
}

impl SharedTier {
    fn touch(&mut self, name: u128) {
        self.stamp += 1;
        if let Some(old) = self.by_name.insert(name, self.stamp) {
            self.by_stamp.remove(&old);
        }
        self.by_stamp.insert(self.stamp, name);
        while self.by_name.len() > self.capacity {
            let Some((_, oldest)) = self.by_stamp.pop_first() else {
                break;
            };
            self.by_name.remove(&oldest);
        }
    }

    fn contains(&self, name: &u128) -> bool {
        self.by_name.contains_key(name)
    }
}

/// Runs a trace `workload` through `sim.replicas` simulated servers behind the router.
pub fn simulate_fleet(workload: &Workload, sim: &FleetSim) -> Result<FleetReport, SimError> {
    workload.validate()?;
    sim.replica.cost.validate()?;
    if sim.replicas == 0 {
        return Err(SimError::Config("a fleet needs at least 1 replica".into()));
    }
    if !(sim.overlap_weight.is_finite() && sim.overlap_weight >= 0.0) {
        return Err(SimError::Config(format!(
            "the overlap weight must be a finite number ≥ 0, got {}",
            sim.overlap_weight
        )));
    }
    let blocks = (sim.replica.scheduler.num_blocks as u64)
        .saturating_mul(sim.replicas as u64)
        .saturating_add(sim.l4_blocks.unwrap_or(0) as u64);
    workload.check_size(
        sim.replica.output_tokens,
        blocks,
        crate::replay::available_memory_bytes(),
    )?;
    let sessions = workload.sessions();
    if sessions.iter().any(|s| s.arrival_ms.is_none()) {
        return Err(SimError::Config(
            "the fleet simulator replays traces (open loop): give --workload trace".into(),
        ));
    }
    let bs = sim.replica.scheduler.block_size_tokens;
    let key = CacheKey::new();
    // Names blocks as a fleet does; any fixed secret gives the same sharing, and the same run every time.
    let secret = Secret::from_text("kura-sim fleet simulation secret, not for serving")
        .map_err(SimError::Config)?;
    let mut namer = ContentNamer::new(&secret);
    let mut replicas = (0..sim.replicas)
        .map(|_| {
            Ok(Replica {
                sched: Scheduler::new(sim.replica.scheduler.clone())?,
                pace: sim.replica.prefill_step.map(PrefillPace::new),
                step: None,
                in_flight: 0,
                work_blocks: 0,
                requests: 0,
            })
        })
        .collect::<Result<Vec<_>, SimError>>()?;
    let mut shared = sim.l4_blocks.map(|capacity| SharedTier {
        capacity,
        stamp: 0,
        by_name: HashMap::new(),
        by_stamp: BTreeMap::new(),
    });
    let mut order: Vec<usize> = (0..sessions.len()).collect();
    order.sort_by(|&a, &b| {
        sessions[a]
            .arrival_ms
            .unwrap_or(0.0)
            .total_cmp(&sessions[b].arrival_ms.unwrap_or(0.0))
    });
    let mut report = FleetReport {
        replicas: sim.replicas,
        policy: sim.policy.as_str().to_owned(),
        l4_blocks: sim.l4_blocks,
        ..FleetReport::default()
    };
    let mut reqs: HashMap<u64, Req> = HashMap::new();
    let (mut ttft, mut e2e) = (Vec::new(), Vec::new());
    let (mut prompt_tokens, mut cached_tokens, mut l4_tokens, mut output_tokens) =
        (0u64, 0u64, 0u64, 0u64);
    let mut next_output_id = crate::serve::FIRST_OUTPUT_ID;
    let mut turn = 0usize;
    let mut next = 0usize;
    let mut now_ms = 0.0f64;

    loop {
        let arrival = order
            .get(next)
            .map(|&s| sessions[s].arrival_ms.unwrap_or(0.0));
        let step_end = replicas
            .iter()
            .enumerate()
            .filter_map(|(r, rep)| rep.step.as_ref().map(|(end, _)| (r, *end)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        let (r, arriving) = match (arrival, step_end) {
            (None, None) => break,
            (Some(t), Some((_, end))) if t <= end => (None, Some(t)),
            (Some(t), None) => (None, Some(t)),
            (_, Some((r, end))) => {
                now_ms = now_ms.max(end);
                (Some(r), None)
            }
        };
        if let Some(t) = arriving {
            now_ms = now_ms.max(t);
            let s = &sessions[order[next]];
            let id = next as u64;
            next += 1;
            let prompt = &s.turns[0];
            let out = s.output_tokens.unwrap_or(sim.replica.output_tokens);
            if prompt.len() + out > sim.replica.max_model_len {
                return Err(SimError::Config(format!(
                    "a trace request of {} prompt tokens and {out} output tokens is longer than the \
                     model's {} tokens: give --max-prompt-tokens and --max-output-tokens",
                    prompt.len(),
                    sim.replica.max_model_len
                )));
            }
            if let Some(e) = crate::serve::prompt_too_large(
                "trace",
                prompt.len(),
                bs,
                sim.replica.scheduler.num_blocks,
            ) {
                return Err(e);
            }
            prompt_tokens += prompt.len() as u64;
            let whole = prompt.len().saturating_sub(1) / bs * bs;
            let blocks = (whole / bs) as u64;
            let candidates: Vec<Candidate> = replicas
                .iter_mut()
                .map(|rep| Candidate {
                    eligible: true,
                    load: rep.in_flight,
                    work_blocks: rep.work_blocks,
                    held_blocks: rep.sched.held_prefix_blocks(&prompt[..whole], &key) as u64,
                })
                .collect();
            let r = choose(
                sim.policy,
                &candidates,
                blocks,
                sim.overlap_weight,
                &mut turn,
            )
            .expect("every replica is eligible");
            let mut held = candidates[r].held_blocks as usize;
            let mut names = Vec::new();
            if let Some(tier) = shared.as_mut() {
                names = namer.chain_blocks(&key, &prompt[..whole], bs);
                let found = names[held..]
                    .iter()
                    .take_while(|n| tier.contains(n))
                    .count();
                if found > 0 {
                    let upto = (held + found) * bs;
                    if let Some((seq, _)) =
                        replicas[r]
                            .sched
                            .begin_adoption(&prompt[..upto], &key, held)?
                    {
                        replicas[r].sched.finish_adoption(seq)?;
                        l4_tokens += (found * bs) as u64;
                        held += found;
                        for n in &names[..held] {
                            tier.touch(*n);
                        }
                    }
                }
            }
            let prefill_blocks = blocks.saturating_sub(held as u64);
            let rep = &mut replicas[r];
            rep.in_flight += 1;
            rep.work_blocks += prefill_blocks + 1;
            rep.requests += 1;
            rep.sched.add_request(
                id,
                key.clone(),
                0,
                at(now_ms),
                prompt.clone(),
                OutputLimit {
                    max_tokens: out,
                    n: 1,
                },
            );
            reqs.insert(
                id,
                Req {
                    replica: r,
                    output_tokens: out,
                    sent_at: now_ms,
                    first_at: None,
                    produced: 0,
                    prefill_blocks,
                    names,
                },
            );
            if replicas[r].step.is_none() {
                start_step(
                    &mut replicas[r],
                    sim,
                    now_ms,
                    &mut reqs,
                    &mut report,
                    &mut cached_tokens,
                )?;
            }
            continue;
        }
        let Some(r) = r else { continue };
        // Replica r's step is over: its tokens come out now.
        let (_, items) = replicas[r].step.take().expect("a step in progress");
        for item in items {
            let rep = &mut replicas[r];
            if !rep.sched.computed(item).complete {
                continue;
            }
            let request = rep
                .sched
                .request_of(item.seq)
                .expect("a planned sequence is known");
            let q = reqs.get_mut(&request).expect("a planned request is known");
            if q.first_at.is_none() {
                q.first_at = Some(now_ms);
                ttft.push(now_ms - q.sent_at);
                rep.work_blocks = rep.work_blocks.saturating_sub(q.prefill_blocks);
                if let Some(tier) = shared.as_mut() {
                    for n in &q.names {
                        tier.touch(*n);
                    }
                }
            }
            q.produced += 1;
            output_tokens += 1;
            if q.produced < q.output_tokens {
                rep.sched.push_token(item.seq, next_output_id);
                next_output_id += 1;
                continue;
            }
            rep.sched.remove_request(request);
            rep.in_flight -= 1;
            rep.work_blocks = rep.work_blocks.saturating_sub(1);
            let q = reqs.remove(&request).expect("known");
            e2e.push(now_ms - q.sent_at);
            report.requests += 1;
        }
        start_step(
            &mut replicas[r],
            sim,
            now_ms,
            &mut reqs,
            &mut report,
            &mut cached_tokens,
        )?;
    }
    if let Some(stuck) = reqs.values().next() {
        return Err(SimError::Config(format!(
            "replica {} planned nothing with {} requests in flight: its KV pool of {} blocks cannot \
             hold one of them",
            stuck.replica,
            reqs.len(),
            sim.replica.scheduler.num_blocks
        )));
    }
    report.ttft_ms = Dist::of(&mut ttft);
    report.e2e_ms = Dist::of(&mut e2e);
    report.duration_s = now_ms / 1e3;
    report.output_tokens_per_s = if now_ms > 0.0 {
        output_tokens as f64 / report.duration_s
    } else {
        0.0
    };
    let ratio = |n: u64| {
        if prompt_tokens == 0 {
            0.0
        } else {
            n as f64 / prompt_tokens as f64
        }
    };
    report.cached_ratio = ratio(cached_tokens);
    report.l4_ratio = ratio(l4_tokens);
    report.max_replica_requests = replicas.iter().map(|r| r.requests).max().unwrap_or(0);
    report.min_replica_requests = replicas.iter().map(|r| r.requests).min().unwrap_or(0);
    Ok(report)
}

/// Plans replica `rep`'s next step at `now_ms`, if it has anything to compute.
fn start_step(
    rep: &mut Replica,
    sim: &FleetSim,
    now_ms: f64,
    reqs: &mut HashMap<u64, Req>,
    report: &mut FleetReport,
    cached_tokens: &mut u64,
) -> Result<(), SimError> {
    if let Some(p) = &rep.pace {
        p.plan(&mut rep.sched);
    }
    let plan = rep.sched.schedule(at(now_ms));
    for event in &plan.events {
        match *event {
            SchedEvent::Admitted {
                first: true,
                cached_tokens: c,
                ..
            } => *cached_tokens += c as u64,
            SchedEvent::CannotFit { request, .. } => {
                report.failed += 1;
                if let Some(q) = reqs.remove(&request) {
                    rep.in_flight -= 1;
                    rep.work_blocks = rep.work_blocks.saturating_sub(q.prefill_blocks + 1);
                }
                rep.sched.remove_request(request);
            }
            _ => {}
        }
    }
    if plan.items.is_empty() {
        return Ok(());
    }
    let shape = step_shape(
        &rep.sched,
        &plan.items,
        sim.replica.scheduler.block_size_tokens,
    );
    let step_ms = sim.replica.cost.step_ms(&shape);
    if let Some(p) = &mut rep.pace {
        p.observe_step(&rep.sched, &plan.items, at(step_ms));
    }
    rep.step = Some((now_ms + step_ms, plan.items));
    Ok(())
}
