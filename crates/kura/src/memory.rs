//! How much memory the KV cache may take: `--kv-cache-memory` parsed, then checked against what this
//! process can really get, before anything is allocated.
//!
//! What is available is the least of:
//! - `MemAvailable` in /proc/meminfo: what the kernel can hand out without swapping (it counts
//!   reclaimable page cache, such as a model file just read);
//! - the headroom of every memory cgroup the process is in, its own and its ancestors' (v2:
//!   `memory.max − memory.current`; v1: `memory.limit_in_bytes − memory.usage_in_bytes`), inactive file
//!   pages counted as free since the kernel reclaims them before it kills anything;
//! - the headroom under the soft RLIMIT_AS and RLIMIT_DATA (`ulimit -v`, `ulimit -d`): the limits from
//!   /proc/self/limits minus `VmSize` / `VmData` from /proc/self/status (read from /proc: no libc).
//!
//! `kura serve` resolves the flag after the model is loaded. The weights are copied out of the file into
//! process memory by then, so what is available at that point is what is left after the weights, and a
//! share (`25%`, `0.25`) is a share of that. Whatever the form, the KV cache must leave
//! [`reserve_bytes`] free for everything else the server allocates (activations, logits, block tables,
//! connections): `100%` is refused with the largest share that fits. A request in bytes is checked once
//! before the model is loaded too, so that `1TB` fails in milliseconds.
//!
//! Every parser takes a file's text as a string, so that tests can give it any content.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use kura_kv::units::{format_bytes, parse_bytes};

/// The least memory kept free besides the KV cache.
pub const MIN_RESERVE_BYTES: u64 = 256 << 20;
/// The share of the available memory kept free besides the KV cache: 1/20, 5 %.
pub const RESERVE_DIVISOR: u64 = 20;
/// Cgroup limits at or above this mean "no limit" (cgroup v1 writes 2^63 rounded down to a page).
const UNLIMITED_CGROUP: u64 = 1 << 62;

/// Memory kept free besides the KV cache when `available` bytes are available.
pub fn reserve_bytes(available: u64) -> u64 {
    (available / RESERVE_DIVISOR).max(MIN_RESERVE_BYTES)
}

/// A `--kv-cache-memory` value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvMemoryRequest {
    /// A size in bytes, at least 1.
    Bytes(u64),
    /// A share of the available memory, in (0, 1].
    Share(f64),
}

impl KvMemoryRequest {
    /// Reads `512MiB`, `2GB`, `1073741824` (bytes), `0.25` (a fraction: a decimal point and no unit) or
    /// `25%`.
    pub fn parse(given: &str) -> Result<Self> {
        let t = given.trim();
        let share = |v: Option<f64>| {
            match v {
            Some(f) if f > 0.0 && f <= 1.0 => Ok(KvMemoryRequest::Share(f)),
            _ => Err(anyhow!(
                "--kv-cache-memory {given:?}: a share of the available memory is a fraction in (0, 1] \
                 or a percentage in (0%, 100%], e.g. 0.25 or 25% (a size takes a unit: 1.5GiB)"
            )),
        }
        };
        if let Some(p) = t.strip_suffix('%') {
            return share(p.trim().parse::<f64>().ok().map(|v| v / 100.0));
        }
        if t.contains('.') && !t.chars().any(|c| c.is_ascii_alphabetic()) {
            return share(t.parse::<f64>().ok());
        }
        let bytes = parse_bytes(t).with_context(|| format!("--kv-cache-memory {given:?}"))?;
        if bytes == 0 {
            bail!(
                "--kv-cache-memory {given:?} is no memory at all: give a size such as 1GiB or a share \
                 such as 25%"
            );
        }
        Ok(KvMemoryRequest::Bytes(bytes))
    }

    /// The KV budget in bytes, if it fits in `available` with [`reserve_bytes`] left over; otherwise an
    /// error saying what was asked, what is available (and what limits it) and what to give instead.
    /// `given` is the flag as written, for the message.
    pub fn resolve(self, given: &str, available: &Available) -> Result<u64> {
        let avail = available.bytes;
        let reserve = reserve_bytes(avail);
        let usable = avail.saturating_sub(reserve);
        let wanted = match self {
            KvMemoryRequest::Bytes(b) => b,
            // A float product floored: at most `avail` since the share is at most 1.
            KvMemoryRequest::Share(f) => (avail as f64 * f).floor() as u64,
        };
        if usable == 0 {
            bail!(
                "--kv-cache-memory {given}: only {} is available ({}), less than the {} the server needs \
                 besides the KV cache: free some memory",
                format_bytes(avail),
                available.limited_by,
                format_bytes(reserve)
            );
        }
        if wanted > usable {
            let max_percent = (usable as f64 / avail as f64 * 100.0).floor();
            bail!(
                "--kv-cache-memory {given} asks for {} but {} is available ({}), and {} of it must stay \
                 free for the server besides the KV cache: give at most --kv-cache-memory {}MiB \
                 (or {max_percent}%)",
                format_bytes(wanted),
                format_bytes(avail),
                available.limited_by,
                format_bytes(reserve),
                usable >> 20
            );
        }
        Ok(wanted)
    }
}

/// `--kv-cache-memory` as a budget in bytes against the memory available now. Where that cannot be
/// read (no /proc), a size in bytes is taken as given, with a warning; a share is an error.
pub fn kv_budget_bytes(request: KvMemoryRequest, given: &str) -> Result<u64> {
    match available_now() {
        Ok(available) => request.resolve(given, &available),
        Err(e) => match request {
            KvMemoryRequest::Bytes(bytes) => {
                tracing::warn!(
                    "cannot tell how much memory is available ({e:#}); --kv-cache-memory {given} is not checked"
                );
                Ok(bytes)
            }
            KvMemoryRequest::Share(_) => Err(e.context(format!(
                "--kv-cache-memory {given} is a share of the available memory; give a size in bytes instead"
            ))),
        },
    }
}

/// Checks that `bytes` more (asked by `flag`, written `given`) fit in the memory available now with the
/// server's reserve left over; where that cannot be read, warns and goes on.
pub fn check_fits_in_memory(flag: &str, given: &str, bytes: u64) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let available = match available_now() {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(
                "cannot tell how much memory is available ({e:#}); {flag} {given} is not checked"
            );
            return Ok(());
        }
    };
    let reserve = reserve_bytes(available.bytes);
    let usable = available.bytes.saturating_sub(reserve);
    if bytes > usable {
        bail!(
            "{flag} {given} asks for {} but {} is available once the model and the KV pool are loaded \
             ({}), and {} of it must stay free for the server: give at most {flag} {}MiB",
            format_bytes(bytes),
            format_bytes(available.bytes),
            available.limited_by,
            format_bytes(reserve),
            usable >> 20
        );
    }
    Ok(())
}

/// Memory this process can still get, and what limits it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Available {
    pub bytes: u64,
    /// The tightest limit, in words: `MemAvailable in /proc/meminfo`, a cgroup file, an rlimit.
    pub limited_by: String,
}

/// The /proc/meminfo figures used here, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Meminfo {
    pub total: u64,
    pub available: u64,
}

/// One `Name:  <n> kB` field of /proc/meminfo or /proc/self/status, in bytes; `None` when absent, an
/// error when present but not a number of kB.
fn kib_field(text: &str, name: &str) -> Result<Option<u64>> {
    let Some(rest) = text
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
    else {
        return Ok(None);
    };
    let value = rest.trim();
    let digits = value.strip_suffix("kB").unwrap_or(value).trim();
    let kib: u64 = digits
        .parse()
        .map_err(|_| anyhow!("{name} is {value:?}, not a number of kB"))?;
    kib.checked_mul(1024)
        .map(Some)
        .ok_or_else(|| anyhow!("{name} of {kib} kB overflows 64 bits"))
}

/// Parses /proc/meminfo text: `MemTotal` and `MemAvailable` (Linux 3.14 and later) are required.
pub fn parse_meminfo(text: &str) -> Result<Meminfo> {
    let field = |name| -> Result<u64> {
        kib_field(text, name)?.ok_or_else(|| anyhow!("/proc/meminfo has no {name} line"))
    };
    Ok(Meminfo {
        total: field("MemTotal")?,
        available: field("MemAvailable")?,
    })
}

/// This machine's memory (`MemTotal`), for sizing against the whole machine (`kura plan`).
#[allow(dead_code)] // For kura plan, which still reads MemTotal itself.
pub fn total_memory_bytes() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    Ok(parse_meminfo(&text).context("reading /proc/meminfo")?.total)
}

/// Headroom of one memory cgroup: `limit − (usage − inactive file pages)`; `None` without a limit.
/// `limit` is `memory.max` (v2, `max` for none) or `memory.limit_in_bytes` (v1), `usage`
/// `memory.current` or `memory.usage_in_bytes`, `stat` `memory.stat` if it could be read.
pub fn cgroup_headroom(limit: &str, usage: &str, stat: Option<&str>) -> Result<Option<u64>> {
    let limit = limit.trim();
    if limit == "max" {
        return Ok(None);
    }
    let limit: u64 = limit
        .parse()
        .map_err(|_| anyhow!("cgroup memory limit {limit:?} is not a number"))?;
    if limit >= UNLIMITED_CGROUP {
        return Ok(None);
    }
    let usage: u64 = usage
        .trim()
        .parse()
        .map_err(|_| anyhow!("cgroup memory usage {:?} is not a number", usage.trim()))?;
    // v1's hierarchical total first, then the plain counter (v2 has only that one).
    let inactive_file = stat
        .and_then(|s| {
            ["total_inactive_file", "inactive_file"]
                .iter()
                .find_map(|key| {
                    s.lines().find_map(|l| {
                        let mut it = l.split_whitespace();
                        (it.next() == Some(*key)).then(|| it.next()?.parse::<u64>().ok())?
                    })
                })
        })
        .unwrap_or(0);
    Ok(Some(
        limit.saturating_sub(usage.saturating_sub(inactive_file)),
    ))
}

/// The cgroup v1 or v2 layout of one directory's memory files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

/// Directories of the memory cgroups that bound this process, its own first, then its ancestors, from
/// the text of /proc/self/cgroup and the cgroup mount `root` (/sys/fs/cgroup). Only existing
/// directories are returned; inside a container the own path may not be visible, and the mount's root is
/// then the container's cgroup.
pub fn cgroup_dirs(proc_self_cgroup: &str, root: &Path) -> Vec<(PathBuf, CgroupVersion)> {
    let mut out = Vec::new();
    for line in proc_self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (base, version) = if controllers.is_empty() {
            (root.to_path_buf(), CgroupVersion::V2)
        } else if controllers.split(',').any(|c| c == "memory") {
            (root.join("memory"), CgroupVersion::V1)
        } else {
            continue;
        };
        let relative = Path::new(path.trim_start_matches('/'));
        // A path that climbs (`..`) is not followed above the mount: only the mount's root is read.
        let climbs = relative
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)));
        let mut dir = if climbs {
            base.clone()
        } else {
            base.join(relative)
        };
        loop {
            if dir.is_dir() && !out.iter().any(|(d, _)| d == &dir) {
                out.push((dir.clone(), version));
            }
            if dir == base || !dir.pop() {
                break;
            }
        }
    }
    out
}

/// Soft limit of one /proc/self/limits row (`Max address space`, `Max data size`); `None` when unlimited
/// or absent.
pub fn soft_limit(limits: &str, row: &str) -> Option<u64> {
    let rest = limits.lines().find_map(|l| l.strip_prefix(row))?;
    rest.split_whitespace().next()?.parse().ok()
}

/// What the files say, as text, so that [`available_from`] can be tested on any content.
#[derive(Clone, Debug, Default)]
pub struct MemorySources {
    pub meminfo: String,
    /// Per cgroup directory: its name, limit, usage and stat texts.
    pub cgroups: Vec<(String, String, String, Option<String>)>,
    pub limits: Option<String>,
    pub status: Option<String>,
}

/// The least of the limits described by `sources` (see the module documentation).
pub fn available_from(sources: &MemorySources) -> Result<Available> {
    let meminfo = parse_meminfo(&sources.meminfo)?;
    let mut best = Available {
        bytes: meminfo.available,
        limited_by: format!(
            "MemAvailable in /proc/meminfo, of {} in all",
            format_bytes(meminfo.total)
        ),
    };
    let mut offer = |bytes: u64, why: String| {
        if bytes < best.bytes {
            best = Available {
                bytes,
                limited_by: why,
            };
        }
    };
    for (name, limit, usage, stat) in &sources.cgroups {
        if let Some(h) = cgroup_headroom(limit, usage, stat.as_deref())
            .with_context(|| format!("reading the memory cgroup {name}"))?
        {
            offer(
                h,
                format!("under the cgroup limit {name} = {}", limit.trim()),
            );
        }
    }
    if let (Some(limits), Some(status)) = (&sources.limits, &sources.status) {
        for (row, field, flag, what) in [
            ("Max address space", "VmSize", "RLIMIT_AS", "ulimit -v"),
            ("Max data size", "VmData", "RLIMIT_DATA", "ulimit -d"),
        ] {
            if let Some(limit) = soft_limit(limits, row) {
                let used = kib_field(status, field)?.unwrap_or(0);
                offer(
                    limit.saturating_sub(used),
                    format!(
                        "under {flag} ({what}) of {}, {} already in use",
                        format_bytes(limit),
                        format_bytes(used)
                    ),
                );
            }
        }
    }
    Ok(best)
}

/// Memory available to this process now, from /proc and /sys/fs/cgroup.
pub fn available_now() -> Result<Available> {
    let read = |p: &Path| std::fs::read_to_string(p).ok();
    let meminfo = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let mut cgroups = Vec::new();
    if let Some(own) = read(Path::new("/proc/self/cgroup")) {
        for (dir, version) in cgroup_dirs(&own, Path::new("/sys/fs/cgroup")) {
            let (limit, usage) = match version {
                CgroupVersion::V2 => ("memory.max", "memory.current"),
                CgroupVersion::V1 => ("memory.limit_in_bytes", "memory.usage_in_bytes"),
            };
            if let (Some(l), Some(u)) = (read(&dir.join(limit)), read(&dir.join(usage))) {
                let name = dir.join(limit).display().to_string();
                cgroups.push((name, l, u, read(&dir.join("memory.stat"))));
            }
        }
    }
    available_from(&MemorySources {
        meminfo,
        cgroups,
        limits: read(Path::new("/proc/self/limits")),
        status: read(Path::new("/proc/self/status")),
    })
}

#[cfg(test)]
mod tests;
