//! The server simulated: `kura bench`'s workloads (closed loop) and traces (open loop, at their times)
//! replayed through the engine's own [`Scheduler`] (admission, chunked prefill, early reuse of pending
//! blocks, preemption, priorities, the prefill cap beside decodes paced on the steps' simulated times),
//! on the simulator's clock, with a [`CostModel`] for the time of each step instead of the model.
//!
//! ```text
//!  clients (closed loop: at most `concurrency` requests in flight, FIFO; a session's turns in order)
//!     │ add_request(t)
//!     ▼
//!  Scheduler::schedule(t) ─► plan ─► t += cost.step_ms(plan) ─► computed(item) ─► first/next token at t
//!     ▲                                                                            │ max_tokens reached
//!     └──────────────────────── request done at t: its session sends the next turn ◄┘
//! ```
//!
//! Prompts are token ids with the structure of the workload and the chat template: every message is
//! `[start, role, newline] content [end, newline]` and the prompt ends with the generation prompt, as in
//! the ChatML templates of the default model; equal texts are equal ids, so the cache sees what the
//! server sees. Output tokens are ids no prompt holds, and a conversation's next turn carries them as the
//! assistant's message. The figures are what `kura bench` reports for the same workload: TTFT, ITL, E2E,
//! output tokens per second of the run, cached prompt tokens.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use kura_kv::CacheKey;
use kura_sched::pace::PrefillPace;
use kura_sched::{Item, OutputLimit, SchedEvent, Scheduler, SchedulerConfig};
use serde::Serialize;

use crate::cost::{CostModel, StepItem};
use crate::replay::SimError;
use kura_trace::TraceRequest;

/// Template tokens of a ChatML message: `<|im_start|>role\n` … `<|im_end|>\n`.
const IM_START: u32 = 1;
const IM_END: u32 = 2;
const NEWLINE: u32 = 3;
const ROLE_SYSTEM: u32 = 4;
const ROLE_USER: u32 = 5;
const ROLE_ASSISTANT: u32 = 6;
/// `Continue.`: the user turn after a prompt sent as the system message (`kura bench unique`).
const CONTINUE: [u32; 2] = [7, 8];
/// Ids of content start here (below: template tokens).
const FIRST_CONTENT_ID: u32 = 100;
/// Ids of generated tokens start here: content ids stay below.
pub(crate) const FIRST_OUTPUT_ID: u32 = u32::MAX / 2;

/// A workload of `kura bench`, by the same parameters.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "workload", rename_all = "kebab-case")]
pub enum Workload {
    SharedPrefix {
        groups: usize,
        users_per_group: usize,
        system_tokens: usize,
        question_tokens: usize,
    },
    MultiTurn {
        conversations: usize,
        turns: usize,
        system_tokens: usize,
        user_tokens: usize,
    },
    Unique {
        requests: usize,
        prompt_tokens: usize,
    },
    /// A Mooncake-format trace replayed open loop: each request sent at its timestamp (times
    /// `time_scale`), its prompt the trace's token ids (cut to `max_prompt_tokens`, no chat template),
    /// its output the trace's length (cut to `max_output_tokens`).
    Trace {
        source: String,
        #[serde(skip)]
        requests: Vec<TraceRequest>,
        time_scale: f64,
        max_prompt_tokens: Option<usize>,
        max_output_tokens: Option<usize>,
    },
}

/// One client session: an optional system message, then user turns sent one after another; or, from a
/// trace, one raw prompt sent at its time.
#[derive(Debug, Clone)]
pub(crate) struct Session {
    system: Option<Vec<u32>>,
    pub(crate) turns: Vec<Vec<u32>>,
    /// Trace requests: when it is sent, and its output length (the prompt is the one turn, as is).
    pub(crate) arrival_ms: Option<f64>,
    pub(crate) output_tokens: Option<usize>,
}

struct Ids(u32);

impl Ids {
    fn take(&mut self, n: usize) -> Vec<u32> {
        let first = self.0;
        self.0 += n as u32;
        (first..self.0).collect()
    }
}

impl Workload {
    pub fn name(&self) -> &'static str {
        match self {
            Workload::SharedPrefix { .. } => "shared-prefix",
            Workload::MultiTurn { .. } => "multi-turn",
            Workload::Unique { .. } => "unique",
            Workload::Trace { .. } => "trace",
        }
    }

    pub(crate) fn validate(&self) -> Result<(), SimError> {
        let bad = |what: &str| Err(SimError::Config(format!("{what} must be at least 1")));
        const LIMIT: usize = 1 << 24;
        let (counts, tokens): (Vec<usize>, Vec<usize>) = match *self {
            Workload::SharedPrefix {
                groups,
                users_per_group,
                system_tokens,
                question_tokens,
            } => (
                vec![groups, users_per_group],
                vec![system_tokens, question_tokens],
            ),
            Workload::MultiTurn {
                conversations,
                turns,
                system_tokens,
                user_tokens,
            } => (vec![conversations, turns], vec![system_tokens, user_tokens]),
            Workload::Unique {
                requests,
                prompt_tokens,
            } => (vec![requests], vec![prompt_tokens]),
            Workload::Trace {
                ref requests,
                time_scale,
                max_prompt_tokens,
                max_output_tokens,
                ..
            } => {
                if !(time_scale.is_finite() && time_scale >= 0.0) {
                    return Err(SimError::Config(format!(
                        "--time-scale {time_scale} must be a finite number, 0 or more"
                    )));
                }
                if max_prompt_tokens == Some(0) || max_output_tokens == Some(0) {
                    return bad("--max-prompt-tokens and --max-output-tokens");
                }
                (vec![requests.len()], vec![])
            }
        };
        if counts.contains(&0) {
            return bad(
                "every count of the workload (groups, users, conversations, turns, requests)",
            );
        }
        if tokens.iter().chain(&counts).any(|&n| n > LIMIT)
            || counts.iter().product::<usize>() > LIMIT
        {
            return Err(SimError::Config(format!(
                "the workload is larger than the simulator takes ({LIMIT} requests or tokens per text)"
            )));
        }
        Ok(())
    }

    /// What the run holds in memory and names, with `output_tokens` generated per request (a trace's
    /// own lengths): the fresh content ids its sessions draw, the tokens it generates (each a fresh
    /// id too), and the token ids it holds at most at once (the sessions' texts, a system message
    /// once per session that sends it, and each session's history, its last prompt and answer).
    /// `None` when a count overflows.
    fn footprint(&self, output_tokens: usize) -> Option<(u64, u64, u64)> {
        let n = |v: usize| v as u64;
        // Template tokens a turn adds around its content and the answer's start (see `message`).
        const TEMPLATE: u64 = 16;
        let out = n(output_tokens).checked_add(TEMPLATE)?;
        match *self {
            Workload::SharedPrefix {
                groups,
                users_per_group,
                system_tokens,
                question_tokens,
            } => {
                let sessions = n(groups).checked_mul(n(users_per_group))?;
                let (s, q) = (n(system_tokens), n(question_tokens));
                let ids = n(groups)
                    .checked_mul(s)?
                    .checked_add(sessions.checked_mul(q)?)?;
                let per_session = s.checked_add(q)?.checked_mul(2)?.checked_add(out)?;
                Some((
                    ids,
                    sessions.checked_mul(n(output_tokens))?,
                    sessions.checked_mul(per_session)?,
                ))
            }
            Workload::MultiTurn {
                conversations,
                turns,
                system_tokens,
                user_tokens,
            } => {
                let text = n(turns)
                    .checked_mul(n(user_tokens))?
                    .checked_add(n(system_tokens))?;
                let history = n(turns).checked_mul(out)?.checked_add(text)?;
                Some((
                    n(conversations).checked_mul(text)?,
                    n(conversations)
                        .checked_mul(n(turns))?
                        .checked_mul(n(output_tokens))?,
                    n(conversations).checked_mul(text.checked_add(history)?)?,
                ))
            }
            Workload::Unique {
                requests,
                prompt_tokens,
            } => {
                let per = n(prompt_tokens).checked_mul(2)?.checked_add(out)?;
                Some((
                    n(requests).checked_mul(n(prompt_tokens))?,
                    n(requests).checked_mul(n(output_tokens))?,
                    n(requests).checked_mul(per)?,
                ))
            }
            Workload::Trace {
                ref requests,
                max_prompt_tokens,
                max_output_tokens,
                ..
            } => {
                let (mut outputs, mut held) = (0u64, 0u64);
                for r in requests {
                    let prompt = u64::from(r.input_length());
                    held =
                        held.checked_add(max_prompt_tokens.map_or(prompt, |m| prompt.min(n(m))))?;
                    let output = u64::from(r.output_length().max(1));
                    outputs = outputs
                        .checked_add(max_output_tokens.map_or(output, |m| output.min(n(m))))?;
                }
                Some((0, outputs, held))
            }
        }
    }

    /// Refuses, before anything is built, a run whose content ids would run into the answers' (a
    /// wrapped id would join unrelated prompts in the cache) or whose tokens and KV bookkeeping
    /// (`blocks` blocks, all replicas) need more memory than `available` (where that is known): the
    /// kernel lends memory it does not have, and the process would grow until it is killed.
    pub(crate) fn check_size(
        &self,
        output_tokens: usize,
        blocks: u64,
        available: Option<u64>,
    ) -> Result<(), SimError> {
        let too_large = || {
            SimError::Config(format!(
                "the {} workload is larger than the simulator takes: its prompts or its outputs \
                 hold more than 2^31 token ids in all; give fewer requests or shorter texts",
                self.name()
            ))
        };
        let (ids, outputs, tokens) = self.footprint(output_tokens).ok_or_else(too_large)?;
        if ids > u64::from(FIRST_OUTPUT_ID - FIRST_CONTENT_ID)
            || outputs > u64::from(u32::MAX - FIRST_OUTPUT_ID)
        {
            return Err(too_large());
        }
        let Some(available) = available else {
            return Ok(());
        };
        let needed = tokens
            .saturating_mul(4)
            .saturating_add(blocks.saturating_mul(crate::replay::BYTES_PER_BLOCK));
        if needed <= available {
            return Ok(());
        }
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        Err(SimError::Config(format!(
            "this {} run needs about {:.1} GiB ({tokens} token ids and the bookkeeping of {blocks} \
             KV blocks), more than the {:.1} GiB this machine has available: give fewer or shorter \
             requests, or fewer --kv-blocks",
            self.name(),
            gib(needed),
            gib(available)
        )))
    }

    /// The tokens of a closed-loop workload's first request, template included (as `simulate` builds
    /// it); `None` for a trace, whose requests are checked as they are sent.
    fn first_prompt_len(&self) -> Option<usize> {
        const MESSAGE: usize = 5; // <|im_start|> role \n … <|im_end|> \n
        const ANSWER: usize = 3; // <|im_start|> assistant \n
        let system = |n: usize| if n > 0 { n.saturating_add(MESSAGE) } else { 0 };
        let turn = |n: usize| n.saturating_add(MESSAGE + ANSWER);
        match *self {
            Workload::SharedPrefix {
                system_tokens,
                question_tokens,
                ..
            } => Some(system(system_tokens).saturating_add(turn(question_tokens))),
            Workload::MultiTurn {
                system_tokens,
                user_tokens,
                ..
            } => Some(system(system_tokens).saturating_add(turn(user_tokens))),
            Workload::Unique { prompt_tokens, .. } => {
                Some(system(prompt_tokens).saturating_add(turn(CONTINUE.len())))
            }
            Workload::Trace { .. } => None,
        }
    }

    /// The sessions, in the order their first requests queue.
    pub(crate) fn sessions(&self) -> Vec<Session> {
        let mut ids = Ids(FIRST_CONTENT_ID);
        match *self {
            Workload::SharedPrefix {
                groups,
                users_per_group,
                system_tokens,
                question_tokens,
            } => {
                let systems: Vec<Vec<u32>> = (0..groups).map(|_| ids.take(system_tokens)).collect();
                // The groups interleaved, as `kura bench` shuffles them.
                let mut out = Vec::new();
                for _u in 0..users_per_group {
                    for system in &systems {
                        out.push(Session {
                            system: Some(system.clone()),
                            turns: vec![ids.take(question_tokens)],
                            arrival_ms: None,
                            output_tokens: None,
                        });
                    }
                }
                out
            }
            Workload::MultiTurn {
                conversations,
                turns,
                system_tokens,
                user_tokens,
            } => (0..conversations)
                .map(|_| Session {
                    system: (system_tokens > 0).then(|| ids.take(system_tokens)),
                    turns: (0..turns).map(|_| ids.take(user_tokens)).collect(),
                    arrival_ms: None,
                    output_tokens: None,
                })
                .collect(),
            Workload::Unique {
                requests,
                prompt_tokens,
            } => (0..requests)
                .map(|_| Session {
                    system: Some(ids.take(prompt_tokens)),
                    turns: vec![CONTINUE.to_vec()],
                    arrival_ms: None,
                    output_tokens: None,
                })
                .collect(),
            Workload::Trace {
                ref requests,
                time_scale,
                max_prompt_tokens,
                max_output_tokens,
                ..
            } => requests
                .iter()
                .map(|r| {
                    let mut prompt = Vec::new();
                    r.prompt_tokens(&mut prompt);
                    if let Some(max) = max_prompt_tokens {
                        prompt.truncate(max);
                    }
                    let output = r.output_length().max(1) as usize;
                    Session {
                        system: None,
                        turns: vec![prompt],
                        arrival_ms: Some(r.timestamp_ms() as f64 * time_scale),
                        output_tokens: Some(max_output_tokens.map_or(output, |m| output.min(m))),
                    }
                })
                .collect(),
        }
    }
}

fn message(out: &mut Vec<u32>, role: u32, content: &[u32]) {
    out.extend_from_slice(&[IM_START, role, NEWLINE]);
    out.extend_from_slice(content);
    out.extend_from_slice(&[IM_END, NEWLINE]);
}

/// Summary of one distribution, as `kura bench` computes it (numpy's linear percentiles).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Dist {
    pub p50: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Dist {
    pub(crate) fn of(values: &mut [f64]) -> Dist {
        if values.is_empty() {
            return Dist::default();
        }
        values.sort_by(f64::total_cmp);
        let pct = |q: f64| {
            let rank = q / 100.0 * (values.len() - 1) as f64;
            let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
            values[lo] + (values[hi] - values[lo]) * (rank - lo as f64)
        };
        Dist {
            p50: pct(50.0),
            p99: pct(99.0),
            mean: values.iter().sum::<f64>() / values.len() as f64,
        }
    }
}

/// What one simulated run gives: `kura bench`'s figures for the same workload and load.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ServeReport {
    pub workload: String,
    /// Clients of the closed loop; 0 for a trace (open loop).
    pub concurrency: usize,
    pub requests: usize,
    pub failed: usize,
    pub ttft_ms: Dist,
    pub itl_ms: Dist,
    pub e2e_ms: Dist,
    pub output_tokens: u64,
    pub output_tokens_per_s: f64,
    /// Prompt tokens served from the prefix cache at first admission, over all prompt tokens.
    pub cached_ratio: f64,
    pub preemptions: u64,
    pub steps: u64,
    pub duration_s: f64,
}

/// The settings of one simulated run.
#[derive(Debug, Clone)]
pub struct ServeSim {
    pub scheduler: SchedulerConfig,
    pub cost: CostModel,
    pub concurrency: usize,
    pub output_tokens: usize,
    pub max_model_len: usize,
    /// `kura serve --prefill-step-ms`: the time a step beside decodes is cut to (`None`: no cut).
    pub prefill_step: Option<Duration>,
}

struct InFlight {
    session: usize,
    turn: usize,
    output_tokens: usize,
    prompt: Vec<u32>,
    sent_at: f64,
    first_at: Option<f64>,
    last_at: f64,
    output: Vec<u32>,
}

fn too_long(
    workload: &Workload,
    prompt: usize,
    output_tokens: usize,
    max_model_len: usize,
    hint: &str,
) -> SimError {
    SimError::Config(format!(
        "a {} request of {prompt} prompt tokens and {output_tokens} output tokens is longer than \
         the model's {max_model_len} tokens{hint}",
        workload.name(),
    ))
}

/// A request whose prompt alone needs more blocks than the whole pool: the scheduler refuses it at
/// admission (`CannotFit`), and a simulation of such a pool is a configuration error, as the server
/// refuses it at submission.
pub(crate) fn prompt_too_large(
    what: &str,
    prompt: usize,
    block_size: usize,
    num_blocks: usize,
) -> Option<SimError> {
    let needed = prompt.div_ceil(block_size.max(1));
    (needed > num_blocks).then(|| {
        SimError::Config(format!(
            "a {what} request of {prompt} prompt tokens needs {needed} KV blocks of {block_size} \
             tokens: the KV pool of {num_blocks} blocks cannot hold it"
        ))
    })
}

/// Runs `workload` under a closed loop of `sim.concurrency` clients through the engine's scheduler.
pub fn simulate(workload: &Workload, sim: &ServeSim) -> Result<ServeReport, SimError> {
    workload.validate()?;
    sim.cost.validate()?;
    if sim.concurrency == 0 || sim.output_tokens == 0 {
        return Err(SimError::Config(
            "concurrency and output tokens must be at least 1".into(),
        ));
    }
    if let Some(first) = workload.first_prompt_len() {
        // Checked again for each request as it is sent; here before the sessions are built.
        if first.saturating_add(sim.output_tokens) > sim.max_model_len {
            return Err(too_long(
                workload,
                first,
                sim.output_tokens,
                sim.max_model_len,
                "",
            ));
        }
    }
    workload.check_size(
        sim.output_tokens,
        sim.scheduler.num_blocks as u64,
        crate::replay::available_memory_bytes(),
    )?;
    let sessions = workload.sessions();
    let mut sched = Scheduler::new(sim.scheduler.clone())?;
    let mut pace = sim.prefill_step.map(PrefillPace::new);
    let mut next_output_id = FIRST_OUTPUT_ID;
    // A session's next request waits here (FIFO) for one of the `concurrency` permits.
    let mut queue: VecDeque<(usize, usize)> = (0..sessions.len()).map(|s| (s, 0)).collect();
    // The history sent so far per session (prompt of its last turn, then the answer).
    let mut history: Vec<Vec<u32>> = sessions
        .iter()
        .map(|s| {
            let mut h = Vec::new();
            if let Some(system) = &s.system {
                message(&mut h, ROLE_SYSTEM, system);
            }
            h
        })
        .collect();
    let mut inflight: HashMap<u64, InFlight> = HashMap::new();
    let mut next_request = 0u64;
    let mut report = ServeReport {
        workload: workload.name().to_owned(),
        concurrency: sim.concurrency,
        ..ServeReport::default()
    };
    let (mut ttft, mut itl, mut e2e) = (Vec::new(), Vec::new(), Vec::new());
    let (mut prompt_tokens, mut cached_tokens) = (0u64, 0u64);
    let mut now_ms = 0.0f64;
    let mut idle_passes = 0u32;
    // The server's front end (chat template and tokenizer) takes requests one at a time: a request reaches
    // the scheduler once it is through, and a step that has started does not see it.
    let mut frontend_free_ms = 0.0f64;
    let mut arriving: Vec<(f64, u64)> = Vec::new();
    // Trace requests are sent at their times, whatever is in flight (open loop, as `kura bench trace`).
    let open_loop = sessions.iter().any(|s| s.arrival_ms.is_some());
    if open_loop {
        report.concurrency = 0;
    }
    loop {
        while open_loop || inflight.len() < sim.concurrency {
            let Some(&(s, t)) = queue.front() else {
                break;
            };
            if sessions[s].arrival_ms.is_some_and(|at| at > now_ms) {
                break;
            }
            queue.pop_front();
            let session = &sessions[s];
            let prompt = if session.arrival_ms.is_some() {
                session.turns[t].clone()
            } else {
                let mut prompt = history[s].clone();
                message(&mut prompt, ROLE_USER, &session.turns[t]);
                prompt.extend_from_slice(&[IM_START, ROLE_ASSISTANT, NEWLINE]);
                prompt
            };
            let output_tokens = session.output_tokens.unwrap_or(sim.output_tokens);
            let id = next_request;
            next_request += 1;
            prompt_tokens += prompt.len() as u64;
            if prompt.len() + output_tokens > sim.max_model_len {
                let hint = if session.arrival_ms.is_some() {
                    ": give --max-prompt-tokens and --max-output-tokens"
                } else {
                    ""
                };
                return Err(too_long(
                    workload,
                    prompt.len(),
                    output_tokens,
                    sim.max_model_len,
                    hint,
                ));
            }
            if let Some(e) = prompt_too_large(
                workload.name(),
                prompt.len(),
                sim.scheduler.block_size_tokens,
                sim.scheduler.num_blocks,
            ) {
                return Err(e);
            }
            // A trace request was sent at its time, which may lie inside the step just simulated.
            let sent = session.arrival_ms.unwrap_or(now_ms);
            let ready = frontend_free_ms.max(sent) + sim.cost.frontend_ms(prompt.len());
            frontend_free_ms = ready;
            arriving.push((ready, id));
            inflight.insert(
                id,
                InFlight {
                    session: s,
                    turn: t,
                    output_tokens,
                    prompt,
                    sent_at: sent,
                    first_at: None,
                    last_at: sent,
                    output: Vec::new(),
                },
            );
        }
        if inflight.is_empty() {
            match queue.front() {
                None => break,
                // Idle until the next trace request is sent.
                Some(&(s, _)) => {
                    now_ms = now_ms.max(sessions[s].arrival_ms.unwrap_or(now_ms));
                    continue;
                }
            }
        }
        if sched.is_idle() {
            // Nothing to step: the clock moves to the next request through the front end.
            if let Some(first) = arriving.iter().map(|a| a.0).min_by(f64::total_cmp) {
                now_ms = now_ms.max(first);
            }
        }
        let mut k = 0;
        while k < arriving.len() {
            let (ready, id) = arriving[k];
            if ready <= now_ms {
                arriving.swap_remove(k);
                let r = &inflight[&id];
                let limit = OutputLimit {
                    max_tokens: r.output_tokens,
                    n: 1,
                };
                sched.add_request(id, CacheKey::new(), 0, at(ready), r.prompt.clone(), limit);
            } else {
                k += 1;
            }
        }
        if let Some(p) = &pace {
            p.plan(&mut sched);
        }
        let plan = sched.schedule(at(now_ms));
        for event in &plan.events {
            match *event {
                SchedEvent::Admitted {
                    first: true,
                    cached_tokens: c,
                    ..
                } => cached_tokens += c as u64,
                SchedEvent::Preempted { .. } => report.preemptions += 1,
                SchedEvent::CannotFit { request, .. } => {
                    report.failed += 1;
                    inflight.remove(&request);
                }
                _ => {}
            }
        }
        if plan.items.is_empty() {
            // A pass may only admit or preempt (its events change the next one); two in a row that
            // compute nothing mean that nothing ever will.
            idle_passes += 1;
            if idle_passes > 2 && !inflight.is_empty() {
                return Err(SimError::Config(format!(
                    "the scheduler planned nothing with {} requests in flight: the KV pool of {} \
                     blocks cannot hold one of them",
                    inflight.len(),
                    sim.scheduler.num_blocks
                )));
            }
            continue;
        }
        idle_passes = 0;
        let shape = step_shape(&sched, &plan.items, sim.scheduler.block_size_tokens);
        let step_ms = sim.cost.step_ms(&shape);
        if let Some(p) = &mut pace {
            p.observe_step(&sched, &plan.items, at(step_ms));
        }
        now_ms += step_ms;
        report.steps += 1;
        for &item in &plan.items {
            if !sched.computed(item).complete {
                continue;
            }
            let request = sched
                .request_of(item.seq)
                .expect("a planned sequence is known");
            let r = inflight
                .get_mut(&request)
                .expect("a planned request is in flight");
            match r.first_at {
                None => {
                    r.first_at = Some(now_ms);
                    ttft.push(now_ms - r.sent_at);
                }
                Some(_) => itl.push(now_ms - r.last_at),
            }
            r.last_at = now_ms;
            let token = next_output_id;
            next_output_id += 1;
            r.output.push(token);
            report.output_tokens += 1;
            if r.output.len() < r.output_tokens {
                sched.push_token(item.seq, token);
                continue;
            }
            sched.remove_request(request);
            let r = inflight.remove(&request).expect("in flight");
            e2e.push(now_ms - r.sent_at);
            report.requests += 1;
            let s = r.session;
            if r.turn + 1 < sessions[s].turns.len() {
                // The next turn resends the history with this answer as the assistant's message.
                let mut h = r.prompt;
                h.truncate(h.len() - 3);
                message(&mut h, ROLE_ASSISTANT, &r.output);
                history[s] = h;
                queue.push_back((s, r.turn + 1));
            }
        }
    }
    report.ttft_ms = Dist::of(&mut ttft);
    report.itl_ms = Dist::of(&mut itl);
    report.e2e_ms = Dist::of(&mut e2e);
    report.duration_s = now_ms / 1e3;
    report.output_tokens_per_s = if now_ms > 0.0 {
        report.output_tokens as f64 / report.duration_s
    } else {
        0.0
    };
    report.cached_ratio = if prompt_tokens == 0 {
        0.0
    } else {
        cached_tokens as f64 / prompt_tokens as f64
    };
    Ok(report)
}

/// What the cost model needs of a planned step: each item's position and tokens, and the context
/// blocks an earlier item of the step already read (a shared prefix), counted apart.
pub(crate) fn step_shape(sched: &Scheduler, items: &[Item], bs: usize) -> Vec<StepItem> {
    let mut read: HashSet<u32> = HashSet::new();
    items
        .iter()
        .map(|i| {
            let table = sched.block_table(i.seq);
            let context_blocks = &table[..(i.start / bs).min(table.len())];
            let shared = context_blocks.iter().filter(|b| read.contains(b)).count() * bs;
            read.extend(context_blocks.iter().copied());
            StepItem {
                start: i.start,
                tokens: i.end - i.start,
                shared,
            }
        })
        .collect()
}

/// The scheduler's clock at simulated time `ms`: saturated past what a `Duration` holds (a trace
/// stretched by a huge `--time-scale`), where the scheduler only compares and subtracts.
pub(crate) fn at(ms: f64) -> Duration {
    Duration::try_from_secs_f64(ms.max(0.0) / 1e3).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unique(requests: usize, prompt_tokens: usize) -> Workload {
        Workload::Unique {
            requests,
            prompt_tokens,
        }
    }

    #[test]
    fn a_run_larger_than_memory_or_the_id_space_is_refused_before_it_is_built() {
        let gib = 1u64 << 30;
        // 16,000 prompts of 16 M tokens (once killed for memory at 24 GiB): the ids run out first.
        let err = unique(16_000, 16_000_000)
            .check_size(128, 1024, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("more than 2^31 token ids"), "{err}");
        // Outputs are fresh ids too.
        let err = unique(1 << 20, 8)
            .check_size(1 << 12, 1024, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("its prompts or its outputs"), "{err}");
        // Within the ids, against the memory available: 100 M tokens held twice, about 0.8 GiB.
        let w = unique(100, 1_000_000);
        let err = w.check_size(16, 0, Some(gib / 2)).unwrap_err().to_string();
        assert!(
            err.contains("needs about 0.7 GiB (200003200 token ids")
                && err.contains("the 0.5 GiB this machine has available"),
            "{err}"
        );
        assert!(w.check_size(16, 0, Some(gib)).is_ok());
        // The KV bookkeeping counts: 100 M blocks of 512 bytes.
        let err = unique(4, 10)
            .check_size(16, 100_000_000, Some(gib))
            .unwrap_err()
            .to_string();
        assert!(err.contains("100000000 KV blocks"), "{err}");
        // Overflowing counts are refused, not wrapped.
        let shared = Workload::SharedPrefix {
            groups: usize::MAX,
            users_per_group: 2,
            system_tokens: 1,
            question_tokens: 1,
        };
        assert!(shared.check_size(1, 1, None).is_err());
        // What the tests and the defaults run passes.
        let multi = Workload::MultiTurn {
            conversations: 64,
            turns: 8,
            system_tokens: 200,
            user_tokens: 64,
        };
        assert!(multi.check_size(128, 4096, Some(gib)).is_ok());
    }
}
