//! Memory a burst of requests freed, handed back to the system.
//!
//! glibc's malloc keeps what a thread's arena freed for the next allocation in that arena, and returns
//! it to the kernel only from the top of the main heap. A server's requests are parsed, tokenized and
//! their grammars compiled on many threads, so after a burst of large ones (megabyte bodies, grammars
//! of hundreds of thousands of rules) the process kept hundreds of megabytes it no longer used: with
//! the KV cache sized against the memory available, that is memory taken from a container's limit for
//! good. A thread of its own reads the resident size every [`PERIOD`] and, when it has grown by more
//! than [`STEP`] since the level it started from, calls `malloc_trim(0)`, which gives every arena's
//! free pages back. A trim in the middle of a burst finds little free yet, and what the burst frees
//! after it raises no resident size, so the thread trims again every period while the size stays more
//! than [`STEP`] above that level, up to [`SETTLE`] trims; only then is the size reached taken as the
//! new level (growth that is kept). The KV pool is one allocation of its own (a mapping, which malloc
//! does not keep), and a step allocates little, so a trim finds only what requests left; growth that
//! is kept (the pool's pages touched for the first time) costs [`SETTLE`] trims per [`STEP`] of it.

use std::time::Duration;

/// How often the resident size is read.
pub const PERIOD: Duration = Duration::from_secs(2);
/// Growth of the resident size over its level that calls for a trim.
pub const STEP: u64 = 64 << 20;
/// Trims, a period apart, while the size stays over its level by [`STEP`] before the size is taken as
/// the new level.
pub const SETTLE: u32 = 8;

/// Starts the trimming thread (glibc on Linux; elsewhere nothing to do).
pub fn start() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let started = std::thread::Builder::new()
            .name("kura-trim".into())
            .spawn(|| {
                let mut floor = resident_bytes().unwrap_or(0);
                // Trims left before the size reached is taken as the new level (0: none under way).
                let mut settle = 0u32;
                loop {
                    std::thread::sleep(PERIOD);
                    let Some(now) = resident_bytes() else {
                        return;
                    };
                    if now > floor.saturating_add(STEP) {
                        // SAFETY: malloc_trim takes no pointer and may be called from any thread.
                        unsafe { libc::malloc_trim(0) };
                        settle = if settle == 0 { SETTLE } else { settle } - 1;
                        if settle == 0 {
                            floor = resident_bytes().unwrap_or(now);
                        }
                    } else {
                        floor = floor.min(now);
                        settle = 0;
                    }
                }
            });
        if let Err(e) = started {
            tracing::warn!(error = %e, "cannot start the thread that returns freed memory");
        }
    }
}

/// The process's resident size, from `/proc/self/statm` (in pages).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages.checked_mul(u64::try_from(page).ok()?)
}
