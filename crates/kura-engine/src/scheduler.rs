//! The scheduling decision of one engine step: who runs, how many tokens each computes, who is
//! admitted, who is preempted. One pass over all sequences, best first:
//!
//! ```text
//!  order: effective priority (priority − age / PRIORITY_AGING_S), then running before waiting, then age
//!         (priority is a request's own under `SchedulingPolicy::Priority`, 0 for all under `Fcfs`)
//!  ┌────────────┬──────────────────────────────────────────────────────────────────────────────────┐
//!  │ running    │ slot for its newly sampled token; if the pool is empty, preempt the worst running │
//!  │            │ sequence after it in the order (or itself); then its next chunk within the budget │
//!  │ waiting    │ prefix lookup (cached and pending blocks), allocate the rest; if the pool is      │
//!  │            │ empty, preempt strictly worse running sequences; else stop admitting (FCFS)       │
//!  └────────────┴──────────────────────────────────────────────────────────────────────────────────┘
//! ```
//!
//! A request whose sink is full (its client is behind) is skipped: not admitted, not stepped.
//!
//! A chunk is the range `[computed, computable)` that the KV manager reports, cut to the step's token
//! budget: tokens that another request is computing right now (pending blocks) are waited for, never
//! computed twice. Prefill chunks and decode tokens go into the same forward call. Because effective
//! priority falls linearly with age for everyone alike, the order of two requests never flips, so
//! preemption cannot cycle, and a low-priority request eventually overtakes fresh higher-priority ones
//! (no starvation). Cost: O(sequences · log sequences) per step plus the KV manager's calls.

use std::time::Instant;

use kura_kv::{BlockCopy, SeqId};

use crate::engine::Core;
use crate::request::RequestError;
use crate::seq::SeqKey;

/// Whose order counts. Under `Fcfs` (the default) every request has priority 0, so requests run in
/// arrival order and none can preempt an older one; under `Priority` a request's `priority` field is
/// honoured (lower first) and may preempt others: give it only to trusted clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SchedulingPolicy {
    #[default]
    Fcfs,
    Priority,
}

impl SchedulingPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            SchedulingPolicy::Fcfs => "fcfs",
            SchedulingPolicy::Priority => "priority",
        }
    }
}

impl std::fmt::Display for SchedulingPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for SchedulingPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fcfs" => Ok(SchedulingPolicy::Fcfs),
            "priority" => Ok(SchedulingPolicy::Priority),
            other => Err(format!(
                "unknown scheduling policy '{other}' (expected fcfs or priority)"
            )),
        }
    }
}

/// Seconds of waiting that improve a request's effective priority by one level.
pub(crate) const PRIORITY_AGING_S: f64 = 10.0;

/// One sequence's share of a step: compute the KV of `tokens[start..end]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Item {
    pub seq: SeqKey,
    pub start: usize,
    pub end: usize,
}

#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub items: Vec<Item>,
    /// Block copies (copy-on-write, partial prefix reuse) to execute before the forward pass.
    pub copies: Vec<BlockCopy>,
}

#[derive(Debug, Clone, Copy)]
struct Candidate {
    priority: f64,
    waiting: bool,
    order: u64,
    seq: SeqKey,
}

enum Admit {
    Admitted,
    /// The pool cannot hold it now and nobody may be preempted for it.
    NoRoom,
    /// Its group was cancelled or failed meanwhile.
    Gone,
}

impl Core {
    fn effective_priority(&self, seq: SeqKey, now: Instant) -> f64 {
        let Some(g) = self.seqs.get(&seq).and_then(|s| self.groups.get(&s.group)) else {
            return f64::INFINITY;
        };
        let priority = match self.config.scheduling_policy {
            SchedulingPolicy::Fcfs => 0,
            SchedulingPolicy::Priority => g.request.priority,
        };
        f64::from(priority)
            - now.saturating_duration_since(g.arrival).as_secs_f64() / PRIORITY_AGING_S
    }

    pub(crate) fn schedule(&mut self) -> Plan {
        let now = Instant::now();
        let mut cands: Vec<Candidate> = self
            .running
            .iter()
            .map(|&k| (k, false))
            .chain(self.waiting.iter().map(|&k| (k, true)))
            .map(|(seq, waiting)| Candidate {
                priority: self.effective_priority(seq, now),
                waiting,
                order: if waiting {
                    self.seqs[&seq].group
                } else {
                    self.seqs[&seq].admitted_order
                },
                seq,
            })
            .collect();
        cands.sort_by(|a, b| {
            a.priority
                .total_cmp(&b.priority)
                .then(a.waiting.cmp(&b.waiting))
                .then(a.order.cmp(&b.order))
        });

        let mut plan = Plan::default();
        let mut budget = self.config.max_num_batched_tokens;
        let mut admitting = true;
        for i in 0..cands.len() {
            if budget == 0 {
                break;
            }
            let c = cands[i];
            let Some(seq) = self.seqs.get(&c.seq) else {
                continue;
            };
            // A client that is behind gets no output for now; a running sequence keeps its blocks
            // (and stays a possible victim for those after it).
            if self.groups.get(&seq.group).is_some_and(|g| g.full) {
                continue;
            }
            if c.waiting {
                if !admitting || self.running.len() >= self.config.max_num_seqs {
                    continue;
                }
                match self.admit(c, &cands[i + 1..], &mut plan.copies) {
                    Admit::Admitted => {}
                    Admit::NoRoom => {
                        admitting = false;
                        continue;
                    }
                    Admit::Gone => continue,
                }
            } else {
                // Preempted earlier in this pass as someone's victim.
                let Some(id) = seq.kv else { continue };
                if !self.grow(c.seq, id, &cands[i + 1..], &mut plan.copies) {
                    continue;
                }
            }
            let seq = &self.seqs[&c.seq];
            let Some(id) = seq.kv else { continue };
            let status = match self.kv.pending_status(id) {
                Ok(s) => s,
                Err(e) => panic!("KV sequence of a running request is unknown: {e}"),
            };
            let start = status.computed_tokens;
            let end = status.computable_tokens.min(start + budget);
            if end > start {
                plan.items.push(Item {
                    seq: c.seq,
                    start,
                    end,
                });
                budget -= end - start;
            } else if status.waiting_blocks > 0 {
                self.metrics.pending_waits.add(1);
            }
        }
        plan
    }

    /// Gives a running sequence the slots of its tokens not yet in the KV sequence (the token sampled in
    /// the last step), preempting worse sequences (after it in `rest`) or itself when the pool is full.
    /// Returns whether it is still running.
    fn grow(
        &mut self,
        key: SeqKey,
        id: SeqId,
        rest: &[Candidate],
        copies: &mut Vec<BlockCopy>,
    ) -> bool {
        loop {
            let kv_len = self.kv.num_tokens(id).expect("running sequence is known");
            let seq = &self.seqs[&key];
            if kv_len >= seq.tokens.len() {
                return true;
            }
            match self.kv.allocate_slots(id, &seq.tokens[kv_len..], None) {
                Ok(Some(alloc)) => {
                    copies.extend(alloc.copies);
                    return true;
                }
                Ok(None) => {}
                Err(e) => panic!("allocating slots of a running sequence: {e}"),
            }
            if let Some(victim) = self.pick_victim(rest, None) {
                self.preempt(victim);
                continue;
            }
            let group = seq.group;
            if self.running.len() == 1 {
                // Alone and still out of blocks: it can never fit (admission checks make this rare:
                // only when the pool is smaller than one request's prompt plus output).
                let bs = self.kv.block_size();
                let needed_blocks = (self.seqs[&key].tokens.len()).div_ceil(bs);
                self.fail_group(
                    group,
                    RequestError::CannotFit {
                        needed_blocks,
                        total_blocks: self.config.num_blocks,
                    },
                );
            } else {
                self.preempt(key);
            }
            return false;
        }
    }

    /// The worst running sequence among `rest` that is strictly worse than `than` (any when `None`).
    fn pick_victim(&self, rest: &[Candidate], than: Option<f64>) -> Option<SeqKey> {
        rest.iter()
            .rev()
            .filter(|c| !c.waiting)
            .filter(|c| than.is_none_or(|p| c.priority > p))
            .find(|c| self.seqs.get(&c.seq).is_some_and(|s| s.kv.is_some()))
            .map(|c| c.seq)
    }

    /// Takes a waiting sequence into the running set: looks up its prefix (cached or pending blocks),
    /// allocates the rest, preempting strictly worse running sequences when needed.
    fn admit(&mut self, c: Candidate, rest: &[Candidate], copies: &mut Vec<BlockCopy>) -> Admit {
        loop {
            let Some(seq) = self.seqs.get(&c.seq) else {
                return Admit::Gone;
            };
            let Some(group) = self.groups.get(&seq.group) else {
                return Admit::Gone;
            };
            let id = self.kv.add_sequence(&group.key);
            let lookup = &seq.tokens[..seq.tokens.len() - 1];
            let hit = self.kv.find_cached_prefix(lookup, &group.key);
            let cached = hit.num_cached_tokens();
            match self
                .kv
                .allocate_slots(id, &seq.tokens[cached..], Some(&hit))
            {
                Ok(Some(alloc)) => {
                    copies.extend(alloc.copies);
                    let pending_tokens = hit.num_pending_blocks() * self.kv.block_size();
                    self.on_admitted(c.seq, id, lookup.len(), cached, pending_tokens);
                    return Admit::Admitted;
                }
                Ok(None) => {
                    self.kv.free(id).expect("fresh sequence is known");
                }
                Err(e) => panic!("allocating a fresh sequence with its own hit: {e}"),
            }
            match self.pick_victim(rest, Some(c.priority)) {
                Some(victim) => self.preempt(victim),
                None => return Admit::NoRoom,
            }
        }
    }

    fn on_admitted(
        &mut self,
        key: SeqKey,
        id: SeqId,
        query_tokens: usize,
        cached: usize,
        pending_tokens: usize,
    ) {
        let now = Instant::now();
        let order = self.next_order;
        self.next_order += 1;
        let seq = self.seqs.get_mut(&key).expect("admitted sequence exists");
        seq.kv = Some(id);
        seq.admitted_order = order;
        seq.prefilling = true;
        let prompt_len = seq.prompt_len;
        let group_id = seq.group;
        self.waiting.retain(|&k| k != key);
        self.running.push(key);
        self.metrics.prefix_queries_tokens.add(query_tokens as u64);
        self.metrics.prefix_hits_tokens.add(cached as u64);
        self.metrics
            .prefix_pending_hit_tokens
            .add(pending_tokens as u64);
        let group = self
            .groups
            .get_mut(&group_id)
            .expect("sequence's group exists");
        if !group.admitted_once {
            group.admitted_once = true;
            group.usage.cached_tokens = cached as u32;
            self.shared
                .queued
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            self.metrics.prompt_tokens.add(prompt_len as u64);
            self.metrics
                .queue_time
                .observe(now.saturating_duration_since(group.arrival));
        }
    }

    /// Sends a running sequence back to the waiting queue. Its computed full blocks stay cached, so
    /// that its resumption finds them by prefix lookup and recomputes only what was evicted meanwhile.
    pub(crate) fn preempt(&mut self, key: SeqKey) {
        let Some(seq) = self.seqs.get_mut(&key) else {
            return;
        };
        if let Some(id) = seq.kv.take() {
            self.kv.free(id).expect("running sequence is known");
        }
        seq.prefilling = true;
        self.running.retain(|&k| k != key);
        self.waiting.push(key);
        self.metrics.preemptions.add(1);
        tracing::debug!(seq = key, "preempted: out of KV blocks");
    }
}
