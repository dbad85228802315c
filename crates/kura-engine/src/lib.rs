//! `kura-engine` — the engine loop on its own thread ([`engine`]) that drives `kura-sched`'s
//! continuous-batching [`Scheduler`] (the one place that decides who runs, re-exported here) with the wall
//! clock and runs what it plans on an [`Executor`]; request handles over channels ([`handle`]), the KV
//! tiers' workers, pins, KV events and metrics ([`metrics`]).
//!
//! A caller submits a tokenized [`GenerateRequest`] with an [`EventSink`] and gets a [`RequestGuard`];
//! the engine streams [`EngineEvent`]s (text deltas, finish reasons, usage with cached tokens) into the
//! sink. Dropping the guard cancels the request and frees its KV blocks at once.

mod backend;
mod cost;
mod draft;
mod engine;
mod handle;
mod inspect;
mod kv_events;
mod metrics;
mod output;
mod pins;
mod remote;
pub mod sampling;
/// The request vocabulary is `kura-request`'s.
use kura_request as request;
mod miss;
mod score;
mod seq;
mod tiers;

pub use backend::{
    check_tails, ChatMessage, ExecError, Executor, HostRows, Logits, Row, SeqInput, TextCodec, Want,
};
pub use cost::{load_wins, CostTier, TierCostCheck, TierRates};
pub use draft::{
    next_room as next_draft_room, NgramDraft, NgramIndex, MAX_DRAFT_TOKENS, MAX_NGRAM,
};
pub use engine::{start_engine, EngineConfig, EngineStartError, DEFAULT_MAX_BATCHED_TOKENS};
pub use handle::{EngineExit, EngineHandle, EngineInfo, RequestGuard};
pub use inspect::{KvInspect, PrefixView};
pub use kura_request::{
    CacheMiss, ConstraintSpec, EngineEvent, EventSink, FinishReason, GenerateRequest, MissReason,
    PinSpec, PromptLogprobs, RequestError, SamplingParams, SubmitError, TokenCandidate,
    TokenConstraint, TokenLogprob, Usage, TENANT_SEPARATOR,
};
pub use kura_sched::{
    AdmissionMode, Computed, Item, OutputLimit, Plan, PreemptionMode, SchedEvent, Scheduler,
    SchedulerConfig, SchedulingPolicy, SeqKey, PRIORITY_AGING_S,
};
pub use kura_text::ModelCodec;
pub use kv_events::{
    Gap, KvBlockInfo, KvChange, KvEventLog, KvEventRecord, KvEventsSetup, KvSnapshot,
};
pub use metrics::TierMetrics;
pub use metrics::{Counter, EngineMetrics, Gauge, Histogram};
pub use remote::RemoteTierSetup;
pub use sampling::{Sampled, Sampler};
pub use tiers::{DiskSetup, TierSetup};
