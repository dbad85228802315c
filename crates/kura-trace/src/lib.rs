//! `kura-trace` — the one reader of request traces, for `kura sim` and `kura bench` alike:
//! - [`mooncake`]: the Mooncake format (one JSON request a line, prompts as chains of 512-token block hash
//!   ids) with its bounds, and its mapping to token ids for the simulator;
//! - [`file`]: a trace file of either format (Mooncake, or Azure's CSV of timestamp, context and generated
//!   tokens) read as arrivals and token counts for the load generator.
//!
//! Everything read is bounded and a bad line is an error naming `file:line`; nothing is skipped silently.

pub mod file;
pub mod mooncake;

pub use file::{read_trace, TraceFileError, TraceFormat};
pub use mooncake::{
    load_trace, load_trace_limited, parse_line, LineError, TraceError, TraceRequest,
};
