//! `kura-engine` — the one place that decides who runs: a continuous-batching [`Scheduler`] over the
//! shared KV cache, driven by a clock it is given (the engine loop's wall clock, or `kura sim`'s trace
//! clock), the engine loop on its own thread ([`engine`]), request handles
//! over channels ([`handle`]), and metrics ([`metrics`]).
//!
//! A caller submits a tokenized [`GenerateRequest`] with an [`EventSink`] and gets a [`RequestGuard`];
//! the engine streams [`EngineEvent`]s (text deltas, finish reasons, usage with cached tokens) into the
//! sink. Dropping the guard cancels the request and frees its KV blocks at once.

mod backend;
mod engine;
mod handle;
mod kv_events;
mod metrics;
mod model_backend;
mod output;
mod pins;
mod remote;
mod request;
mod scheduler;
mod seq;
mod tiers;

pub use backend::{ChatMessage, Executor, SeqInput, TextCodec};
pub use engine::{start_engine, EngineConfig, EngineStartError, DEFAULT_MAX_BATCHED_TOKENS};
pub use handle::{EngineExit, EngineHandle, EngineInfo, RequestGuard};
pub use kv_events::{
    Gap, KvBlockInfo, KvChange, KvEventLog, KvEventRecord, KvEventsSetup, KvSnapshot,
};
pub use metrics::TierMetrics;
pub use metrics::{Counter, EngineMetrics, Gauge, Histogram};
pub use model_backend::{ModelCodec, ModelExecutor};
pub use pins::TENANT_SEPARATOR;
pub use remote::RemoteTierSetup;
pub use request::{
    EngineEvent, EventSink, FinishReason, GenerateRequest, PinSpec, RequestError, SamplingParams,
    SubmitError, TokenCandidate, TokenLogprob, Usage,
};
pub use scheduler::{
    AdmissionMode, Computed, Item, OutputLimit, Plan, PreemptionMode, SchedEvent, Scheduler,
    SchedulerConfig, SchedulingPolicy, SeqKey, PRIORITY_AGING_S,
};
pub use tiers::{DiskSetup, TierSetup};
