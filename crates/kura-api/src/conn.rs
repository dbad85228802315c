//! The HTTP connection layer: the accept loop, one task per connection, and the limits that keep a
//! hostile or broken client from holding the server: a cap on open connections, a deadline for a
//! request's head, an idle (keep-alive) timeout, a timeout for a client that stops reading, and a hard
//! close of every connection when the shutdown grace is over.
//!
//! ```text
//!   accept ──> at the cap? ──yes──> close the oldest idle connection (none idle: refuse the new one)
//!     │
//!     └──> task: hyper HTTP/1 connection over TrackedIo ◄── watchdog (every tick):
//!                  - no request in flight and nothing read for `idle_timeout`   -> close
//!                  - a write blocked for `write_stall_timeout` (client not reading) -> close
//!                  - phase Draining -> graceful shutdown (finish in-flight, then close)
//!                  - phase Closed   -> close now
//! ```
//!
//! Closing a connection drops its response body, which drops the engine's request guard: the request
//! is cancelled and its KV blocks are freed. A silent flood therefore costs one file descriptor and one
//! small task per connection until the cap, and then evicts its own oldest members, so `/health` keeps
//! answering. Costs: O(1) per read and write; eviction scans the open connections oldest first.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes, HttpBody};
use axum::http::Request;
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tower::ServiceExt;

/// Limits of the connection layer; every one is a flag of `kura serve`.
#[derive(Debug, Clone)]
pub struct ConnLimits {
    /// Most connections open at once.
    pub max_connections: usize,
    /// Longest time to receive a request's head (request line and headers).
    pub header_timeout: Duration,
    /// Longest time a connection may stay open with no request in flight and nothing received.
    pub idle_timeout: Duration,
    /// Longest time a response write may stay blocked because the client does not read.
    pub write_stall_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            header_timeout: Duration::from_secs(15),
            idle_timeout: Duration::from_secs(15),
            write_stall_timeout: Duration::from_secs(30),
        }
    }
}

/// Where the server is in its life; every connection watches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Serving,
    /// Shutdown began: no new connections; idle ones close, in-flight requests may finish.
    Draining,
    /// The grace is over: every connection closes now.
    Closed,
}

/// What the watchdog reads of one connection. Times are milliseconds since the server's epoch.
#[derive(Debug)]
struct ConnState {
    /// Requests whose response body has not been fully sent or dropped.
    in_flight: AtomicUsize,
    /// Last time bytes arrived or a response finished.
    last_activity_ms: AtomicU64,
    /// When the current blocked write began; [`NOT_BLOCKED`] when no write is blocked.
    write_blocked_since_ms: AtomicU64,
    /// Set when the connection was chosen for eviction (so that it is chosen once).
    evicted: AtomicBool,
    evict: Notify,
}

const NOT_BLOCKED: u64 = u64::MAX;

/// A millisecond clock from the server's start (monotonic).
#[derive(Debug, Clone, Copy)]
struct Clock(Instant);

impl Clock {
    fn now_ms(self) -> u64 {
        u64::try_from(self.0.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }
}

impl ConnState {
    fn new(now_ms: u64) -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            last_activity_ms: AtomicU64::new(now_ms),
            write_blocked_since_ms: AtomicU64::new(NOT_BLOCKED),
            evicted: AtomicBool::new(false),
            evict: Notify::new(),
        }
    }
}

/// The open connections, oldest first (ids grow with accept order).
#[derive(Default)]
struct Registry {
    conns: Mutex<BTreeMap<u64, Arc<ConnState>>>,
}

impl Registry {
    fn len(&self) -> usize {
        self.conns.lock().map(|c| c.len()).unwrap_or(0)
    }

    fn insert(&self, id: u64, state: Arc<ConnState>) {
        if let Ok(mut c) = self.conns.lock() {
            c.insert(id, state);
        }
    }

    fn remove(&self, id: u64) {
        if let Ok(mut c) = self.conns.lock() {
            c.remove(&id);
        }
    }

    /// Asks the oldest connection with no request in flight to close; `false` if every one is busy.
    fn evict_oldest_idle(&self) -> bool {
        let Ok(conns) = self.conns.lock() else {
            return false;
        };
        for state in conns.values() {
            if state.in_flight.load(Ordering::Acquire) == 0
                && !state.evicted.swap(true, Ordering::AcqRel)
            {
                state.evict.notify_one();
                return true;
            }
        }
        false
    }
}

/// A TCP stream that records when bytes arrive and when a write is blocked.
struct TrackedIo {
    inner: TcpStream,
    state: Arc<ConnState>,
    clock: Clock,
}

impl AsyncRead for TrackedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(result, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.state
                .last_activity_ms
                .store(self.clock.now_ms(), Ordering::Release);
        }
        result
    }
}

impl TrackedIo {
    fn note_write<T>(&self, result: &Poll<T>) {
        let blocked = &self.state.write_blocked_since_ms;
        match result {
            Poll::Pending => {
                if blocked.load(Ordering::Acquire) == NOT_BLOCKED {
                    blocked.store(self.clock.now_ms(), Ordering::Release);
                }
            }
            Poll::Ready(_) => blocked.store(NOT_BLOCKED, Ordering::Release),
        }
    }
}

impl AsyncWrite for TrackedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.note_write(&result);
        result
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.note_write(&result);
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let result = Pin::new(&mut self.inner).poll_flush(cx);
        self.note_write(&result);
        result
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Counts a request as in flight until its response body is finished or dropped.
struct InFlight {
    state: Arc<ConnState>,
    clock: Clock,
}

impl InFlight {
    fn new(state: Arc<ConnState>, clock: Clock) -> Self {
        state.in_flight.fetch_add(1, Ordering::AcqRel);
        Self { state, clock }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state
            .last_activity_ms
            .store(self.clock.now_ms(), Ordering::Release);
        self.state.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted as in flight while it is being sent.
struct CountedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl HttpBody for CountedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Log lines about refused or evicted connections, at most one per interval (a flood must not flood
/// the log).
struct RateLimitedLog {
    last_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl RateLimitedLog {
    const INTERVAL_MS: u64 = 10_000;

    fn new() -> Self {
        Self {
            last_ms: AtomicU64::new(u64::MAX),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(number suppressed since the last line)` when a line may be written now.
    fn allow(&self, now_ms: u64) -> Option<u64> {
        let last = self.last_ms.load(Ordering::Acquire);
        if last == u64::MAX || now_ms.saturating_sub(last) >= Self::INTERVAL_MS {
            self.last_ms.store(now_ms, Ordering::Release);
            Some(self.suppressed.swap(0, Ordering::AcqRel))
        } else {
            self.suppressed.fetch_add(1, Ordering::AcqRel);
            None
        }
    }
}

/// How often a connection's watchdog looks at its connection: a quarter of the shortest timeout, between
/// 20 ms and 1 s.
fn tick_for(limits: &ConnLimits) -> Duration {
    let shortest = limits
        .idle_timeout
        .min(limits.write_stall_timeout)
        .min(limits.header_timeout);
    (shortest / 4).clamp(Duration::from_millis(20), Duration::from_secs(1))
}

/// Accepts connections on `listener` and serves `app` on each until `phase` reaches [`Phase::Closed`]
/// (returns once every connection task has ended) or the phase sender is dropped.
pub async fn accept_loop(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    mut phase: watch::Receiver<Phase>,
) {
    let clock = Clock(Instant::now());
    let registry = Arc::new(Registry::default());
    let refused_log = Arc::new(RateLimitedLog::new());
    let accept_error_log = RateLimitedLog::new();
    let mut tasks = tokio::task::JoinSet::new();
    let mut next_id: u64 = 0;
    loop {
        // Reap finished connection tasks so the set does not grow with the server's lifetime.
        while tasks.try_join_next().is_some() {}
        let accepted = tokio::select! {
            changed = phase.changed() => {
                if changed.is_err() || *phase.borrow() != Phase::Serving {
                    break;
                }
                continue;
            }
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(e) => {
                // Out of file descriptors or a transient network error: say so, back off, go on.
                if let Some(suppressed) = accept_error_log.allow(clock.now_ms()) {
                    tracing::error!(error = %e, suppressed, "accept failed; retrying");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if registry.len() >= limits.max_connections && !registry.evict_oldest_idle() {
            if let Some(suppressed) = refused_log.allow(clock.now_ms()) {
                tracing::warn!(
                    max_connections = limits.max_connections,
                    suppressed,
                    "connection limit reached and every connection has a request in flight: \
                     refusing a new connection (raise --max-connections)"
                );
            }
            drop(stream);
            continue;
        }
        if registry.len() >= limits.max_connections {
            if let Some(suppressed) = refused_log.allow(clock.now_ms()) {
                tracing::warn!(
                    max_connections = limits.max_connections,
                    suppressed,
                    "connection limit reached: closing the oldest idle connection to admit a new one \
                     (raise --max-connections if clients are legitimate)"
                );
            }
        }
        let _ = stream.set_nodelay(true);
        let id = next_id;
        next_id += 1;
        let state = Arc::new(ConnState::new(clock.now_ms()));
        registry.insert(id, state.clone());
        let io = TrackedIo {
            inner: stream,
            state: state.clone(),
            clock,
        };
        let conn = serve_connection(io, app.clone(), state, limits.clone(), clock, phase.clone());
        let registry = registry.clone();
        tasks.spawn(async move {
            conn.await;
            registry.remove(id);
        });
    }
    // Draining or closed: no new connections. Wait for the open ones, which watch the phase.
    while tasks.join_next().await.is_some() {}
}

/// One connection: hyper's HTTP/1 state machine and its watchdog.
fn serve_connection(
    io: TrackedIo,
    app: Router,
    state: Arc<ConnState>,
    limits: ConnLimits,
    clock: Clock,
    mut phase: watch::Receiver<Phase>,
) -> impl Future<Output = ()> + Send {
    let service_state = state.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let in_flight = InFlight::new(service_state.clone(), clock);
        let app = app.clone();
        async move {
            let response = app
                .oneshot(req.map(Body::new))
                .await
                .unwrap_or_else(|never| match never {});
            Ok::<_, std::convert::Infallible>(response.map(|inner| {
                Body::new(CountedBody {
                    inner,
                    _in_flight: in_flight,
                })
            }))
        }
    });
    async move {
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .keep_alive(true);
        let conn = builder.serve_connection(TokioIo::new(io), service);
        tokio::pin!(conn);
        let mut ticker = tokio::time::interval(tick_for(&limits));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut draining = false;
        if *phase.borrow() != Phase::Serving {
            conn.as_mut().graceful_shutdown();
            draining = true;
        }
        loop {
            tokio::select! {
                result = conn.as_mut() => {
                    if let Err(e) = result {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                    return;
                }
                _ = state.evict.notified() => return,
                changed = phase.changed() => {
                    let now = if changed.is_err() { Phase::Closed } else { *phase.borrow() };
                    match now {
                        Phase::Closed => return,
                        Phase::Draining if !draining => {
                            conn.as_mut().graceful_shutdown();
                            draining = true;
                        }
                        _ => {}
                    }
                }
                _ = ticker.tick() => {
                    let now = clock.now_ms();
                    let blocked = state.write_blocked_since_ms.load(Ordering::Acquire);
                    if blocked != NOT_BLOCKED
                        && now.saturating_sub(blocked) >= millis(limits.write_stall_timeout)
                    {
                        tracing::info!(
                            stalled_s = limits.write_stall_timeout.as_secs_f64(),
                            "closing a connection whose client stopped reading; its request is cancelled"
                        );
                        return;
                    }
                    let idle_since = state.last_activity_ms.load(Ordering::Acquire);
                    if state.in_flight.load(Ordering::Acquire) == 0
                        && now.saturating_sub(idle_since) >= millis(limits.idle_timeout)
                    {
                        return;
                    }
                }
            }
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limited_log_allows_one_line_per_interval_and_counts_the_rest() {
        let log = RateLimitedLog::new();
        assert_eq!(log.allow(0), Some(0));
        assert_eq!(log.allow(1), None);
        assert_eq!(log.allow(9_999), None);
        assert_eq!(log.allow(10_000), Some(2));
    }

    #[test]
    fn eviction_picks_the_oldest_connection_without_a_request_in_flight() {
        let registry = Registry::default();
        let states: Vec<Arc<ConnState>> = (0..3).map(|_| Arc::new(ConnState::new(0))).collect();
        for (i, s) in states.iter().enumerate() {
            registry.insert(i as u64, s.clone());
        }
        let clock = Clock(Instant::now());
        let _busy = InFlight::new(states[0].clone(), clock);
        assert!(registry.evict_oldest_idle());
        assert!(!states[0].evicted.load(Ordering::Acquire));
        assert!(states[1].evicted.load(Ordering::Acquire));
        assert!(registry.evict_oldest_idle());
        assert!(states[2].evicted.load(Ordering::Acquire));
        // Every remaining one is busy or already evicted.
        assert!(!registry.evict_oldest_idle());
    }

    #[test]
    fn the_watchdog_ticks_within_bounds() {
        let mut limits = ConnLimits::default();
        assert_eq!(tick_for(&limits), Duration::from_secs(1));
        limits.idle_timeout = Duration::from_millis(10);
        assert_eq!(tick_for(&limits), Duration::from_millis(20));
    }
}
