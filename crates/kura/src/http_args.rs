//! The HTTP flags `kura serve` and `kura router` share: the body limit, the connection cap and the
//! timeouts of kura-api's connection layer, and the shutdown grace.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use kura_api::ConnLimits;
use kura_kv::units::{format_bytes, parse_bytes};

/// Longest `--shutdown-grace-s`.
const MAX_GRACE_S: u64 = 3600;
/// Largest `--max-body-size`.
const MAX_BODY_BYTES: u64 = 1 << 30;
/// Default `--max-connections`.
const DEFAULT_MAX_CONNECTIONS: u64 = 4096;
/// File descriptors kept free of connections (model file, logs, the engine, the blocking pool, health
/// checks and event streams).
const RESERVED_FDS: u64 = 64;

#[derive(Args, Debug)]
pub struct HttpArgs {
    /// Largest accepted request body, e.g. `8MiB` (at most 1GiB); larger ones get 413.
    #[arg(long, default_value = "8MiB")]
    max_body_size: String,
    /// Seconds in-flight requests may run after a shutdown signal before they are cancelled and every
    /// connection closed (0..=3600).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(0..=MAX_GRACE_S))]
    shutdown_grace_s: u64,
    /// Most open HTTP connections. At the limit, the oldest connection without a request in flight is
    /// closed to admit a new one. Default: 4096, or less where the open-file limit is lower.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_connections: Option<u64>,
    /// Seconds a client has to send a request's head (request line and headers) (1..=3600).
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..=3600))]
    http_header_timeout_s: u64,
    /// Seconds a connection may stay open with no request in flight and nothing received (1..=3600).
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..=3600))]
    http_idle_timeout_s: u64,
    /// Seconds a client has to send a request's body once its head has arrived (408 after) (1..=3600).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    http_body_timeout_s: u64,
    /// Seconds a client may stop reading its response (a full socket or output queue) before the request
    /// is cancelled and its connection closed (1..=3600).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub stalled_client_timeout_s: u64,
}

/// The flags, checked.
#[derive(Debug, Clone)]
pub struct HttpLimits {
    pub max_body_bytes: usize,
    pub body_timeout: Duration,
    pub shutdown_grace: Duration,
    pub conn: ConnLimits,
}

impl HttpArgs {
    /// The limits these flags give a process each of whose client connections may hold
    /// `fds_per_connection` descriptors (2 for a router: the client's and one to a replica).
    pub fn limits(&self, fds_per_connection: u64) -> Result<HttpLimits> {
        let max_body_bytes = parse_bytes(&self.max_body_size)
            .with_context(|| format!("--max-body-size {:?}", self.max_body_size))?;
        if max_body_bytes == 0 || max_body_bytes > MAX_BODY_BYTES {
            bail!(
                "--max-body-size {:?} must be between 1 byte and {}",
                self.max_body_size,
                format_bytes(MAX_BODY_BYTES)
            );
        }
        let max_connections =
            max_connections(self.max_connections, open_file_limit(), fds_per_connection)?;
        Ok(HttpLimits {
            max_body_bytes: usize::try_from(max_body_bytes).context("--max-body-size")?,
            body_timeout: Duration::from_secs(self.http_body_timeout_s),
            shutdown_grace: Duration::from_secs(self.shutdown_grace_s),
            conn: ConnLimits {
                max_connections,
                header_timeout: Duration::from_secs(self.http_header_timeout_s),
                idle_timeout: Duration::from_secs(self.http_idle_timeout_s),
                write_stall_timeout: Duration::from_secs(self.stalled_client_timeout_s),
            },
        })
    }
}

/// `--max-connections`, or the default bounded by the open-file limit, so that a flood meets the
/// connection cap (which evicts idle connections) before it meets `Too many open files`.
fn max_connections(
    given: Option<u64>,
    open_files: Option<u64>,
    fds_per_connection: u64,
) -> Result<usize> {
    let per = fds_per_connection.max(1);
    let room = open_files.map(|limit| limit.saturating_sub(RESERVED_FDS) / per);
    let n = match (given, room) {
        (Some(n), Some(room)) if n > room => bail!(
            "--max-connections {n} is more than this process may open: its open-file limit leaves \
             room for {room} connections{}; lower --max-connections or raise the limit (ulimit -n)",
            if per > 1 {
                " (each may hold one to a replica)"
            } else {
                ""
            }
        ),
        (Some(n), _) => n,
        (None, Some(0)) => bail!(
            "the open-file limit (ulimit -n) leaves no room for connections; raise it above {}",
            RESERVED_FDS + per
        ),
        (None, Some(room)) => DEFAULT_MAX_CONNECTIONS.min(room),
        (None, None) => DEFAULT_MAX_CONNECTIONS,
    };
    usize::try_from(n).context("--max-connections does not fit this platform")
}

/// The soft limit on open files (`/proc/self/limits`), where the platform says it.
fn open_file_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    crate::memory::soft_limit(&text, "Max open files")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_connections_stays_within_the_open_file_limit() {
        let Some(limit) = open_file_limit() else {
            panic!("/proc/self/limits has no open-file limit on this machine");
        };
        let room = limit.saturating_sub(RESERVED_FDS);
        let default = max_connections(None, Some(limit), 1).unwrap() as u64;
        assert!(
            default <= room && default <= DEFAULT_MAX_CONNECTIONS,
            "{default}"
        );
        let e = max_connections(Some(room + 1), Some(limit), 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("ulimit -n"), "{e}");
        assert_eq!(max_connections(Some(1), Some(limit), 1).unwrap(), 1);
    }

    #[test]
    fn a_router_leaves_room_for_a_replica_connection_each() {
        assert_eq!(max_connections(None, None, 2).unwrap(), 4096);
        assert_eq!(max_connections(None, Some(20_000), 2).unwrap(), 4096);
        assert_eq!(max_connections(None, Some(1024), 2).unwrap(), 480);
        let e = max_connections(Some(481), Some(1024), 2)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("room for 480 connections (each may hold one to a replica)"),
            "{e}"
        );
        assert_eq!(max_connections(Some(480), Some(1024), 2).unwrap(), 480);
        assert!(max_connections(None, Some(10), 2).is_err());
    }
}
