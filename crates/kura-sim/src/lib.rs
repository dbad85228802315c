//! `kura-sim` — replays real serving traces through the real `kura-kv` cache manager, with a cost model in
//! place of a model, for capacities and policies that do not fit on one machine.
//!
//! Traces are read by `kura-trace` (the Mooncake format: one JSON request a line, prompts as chains of
//! 512-token block hash ids, mapped to token ids).
//! - [`mod@replay`]: the replay loop (lookup, allocate, hold for the request's duration, free) and its
//!   configuration.
//! - [`report`]: hit ratios, evictions and throughput, as a table or JSON.
//! - [`serve`]: the server simulated: `kura bench`'s workloads under a closed loop of clients, through the
//!   engine's own scheduler ([`kura_sched::Scheduler`]) on the simulator's clock, with a [`cost`] model calibrated on
//!   the real model in place of the forward pass.
//! - [`fleet`]: a fleet of such servers behind a router (`kura_fleet::policy`: the policies `kura router` uses),
//!   replaying a trace open loop, with an optional shared tier (L4): hit ratio, TTFT and throughput per
//!   policy and fleet size.

pub mod cost;
pub mod fleet;
pub mod replay;
pub mod report;
pub mod serve;

pub use cost::{CostModel, StepItem};
pub use replay::{replay, Policy, SimConfig, SimError};
pub use report::SimReport;
pub use serve::{simulate, ServeReport, ServeSim, Workload};
