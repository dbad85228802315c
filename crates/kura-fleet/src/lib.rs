//! `kura-fleet` — what a fleet of Kura servers agrees on, shared by `kura router` and the fleet
//! simulator (`kura sim --replicas`):
//! - [`naming`]: keyed content names of KV blocks ([`ContentNamer`]), with which replicas announce the
//!   blocks they hold, a router names a request's prefix and a shared tier keys its records;
//! - [`index`]: which replica holds which blocks ([`FleetIndex`]), built from the replicas' KV events;
//! - [`policy`]: which replica gets a request ([`choose`] under a [`Policy`]), a pure function of what a
//!   router knows, so the simulator replays the router's decisions.
//!
//! Nothing here does I/O: the router feeds the index from HTTP streams, the simulator from its own
//! replicas' events.

pub mod index;
pub mod naming;
pub mod policy;

pub use index::FleetIndex;
pub use naming::ContentNamer;
pub use policy::{choose, Candidate, Policy};
