//! What the operator console sees of the pool ([`EngineHandle::inspect`]): the largest cached prefixes,
//! each with its reuse, its age and the tenant it belongs to — as an opaque label, never the key or the
//! salt — and no token.
//!
//! Ages: the KV manager orders blocks by a logical clock (one tick per allocation or release); the
//! engine keeps a few samples of (tick, time) per second, for an hour, and turns a block's last tick
//! into seconds with them.
//!
//! [`EngineHandle::inspect`]: crate::EngineHandle::inspect

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::time::{Duration, Instant};

use kura_kv::KvCacheManager;

use crate::request::TENANT_SEPARATOR;

/// One cached prefix of the pool, as the console shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixView {
    /// Blocks from the root of its chain to its leaf.
    pub blocks: usize,
    /// Times the whole prefix (its last block) was reused, and its first block.
    pub leaf_hits: u32,
    pub root_hits: u32,
    /// Seconds since a request last held its last block; `None` while a request holds any of its
    /// blocks. An age past the oldest sample the engine keeps is reported as that sample's age.
    pub idle_seconds: Option<f64>,
    pub pinned_blocks: usize,
    pub used_blocks: usize,
    /// The tenant's opaque label ([`crate::EngineHandle::tenant_label`]).
    pub tenant: String,
}

/// The pool as the console sees it at one moment.
#[derive(Debug, Clone)]
pub struct KvInspect {
    /// When the engine thread took it.
    pub taken_at: Instant,
    /// Milliseconds since the engine started, when this was taken.
    pub uptime_ms: u64,
    /// The largest cached prefixes, largest first.
    pub prefixes: Vec<PrefixView>,
    /// Cached prefixes (leaves of the prefix tree) in all.
    pub total_prefixes: usize,
}

/// Tenant labels: a keyed hash (a key drawn at random when the engine starts) of the salt's tenant
/// part, so that a label says which prefixes share a tenant and nothing of who it is.
#[derive(Debug, Clone, Default)]
pub(crate) struct Labels(std::hash::RandomState);

impl Labels {
    pub fn of(&self, salt: Option<&str>) -> String {
        match salt {
            None => "shared".into(),
            Some(s) => {
                let tenant = s.split(TENANT_SEPARATOR).next().unwrap_or("");
                format!("tenant-{:06x}", self.0.hash_one(tenant) & 0xff_ffff)
            }
        }
    }
}

/// Samples of (the KV manager's tick, when).
#[derive(Debug, Default)]
pub(crate) struct TickTimes {
    samples: VecDeque<(u64, Instant)>,
}

/// A sample at most this often.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);
/// Samples kept: an hour of them.
const SAMPLES: usize = 4 * 3600;

impl TickTimes {
    pub fn note(&mut self, tick: u64, now: Instant) {
        if self
            .samples
            .back()
            .is_some_and(|&(_, t)| now.saturating_duration_since(t) < SAMPLE_EVERY)
        {
            return;
        }
        if self.samples.len() == SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back((tick, now));
    }

    /// When the manager's clock was last at or before `tick` (the oldest sample when none is that old).
    fn time_of(&self, tick: u64, now: Instant) -> Instant {
        let i = self.samples.partition_point(|&(t, _)| t <= tick);
        match i {
            0 => self.samples.front().map_or(now, |&(_, at)| at),
            i => self.samples[i - 1].1,
        }
    }
}

pub(crate) fn inspect(
    kv: &KvCacheManager,
    limit: usize,
    times: &TickTimes,
    labels: &Labels,
    started: Instant,
) -> KvInspect {
    let now = Instant::now();
    let tick = kv.tick();
    let (chains, total_prefixes) = kv.prefix_chains(limit);
    let prefixes = chains
        .into_iter()
        .map(|c| PrefixView {
            blocks: c.blocks,
            leaf_hits: c.leaf_hits,
            root_hits: c.root_hits,
            idle_seconds: c.idle_ticks.map(|idle| {
                let at = times.time_of(tick.saturating_sub(idle), now);
                now.saturating_duration_since(at).as_secs_f64()
            }),
            pinned_blocks: c.pinned_blocks,
            used_blocks: c.used_blocks,
            tenant: labels.of(c.key.salt()),
        })
        .collect();
    KvInspect {
        taken_at: now,
        uptime_ms: u64::try_from(now.saturating_duration_since(started).as_millis())
            .unwrap_or(u64::MAX),
        prefixes,
        total_prefixes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_name_tenants_apart_and_hide_them() {
        let l = Labels::default();
        let sep = TENANT_SEPARATOR;
        let a = l.of(Some("acme"));
        assert_eq!(a, l.of(Some(&format!("acme{sep}their-own-salt"))));
        assert_ne!(a, l.of(Some("globex")));
        assert!(!a.contains("acme"));
        assert_eq!(l.of(None), "shared");
        // Another engine draws another key: labels do not carry over.
        let other = Labels::default();
        assert_ne!(a, other.of(Some("acme")));
    }

    #[test]
    fn ticks_turn_into_times() {
        let mut t = TickTimes::default();
        let t0 = Instant::now();
        t.note(10, t0);
        t.note(11, t0 + Duration::from_millis(10)); // too soon: not kept
        t.note(50, t0 + Duration::from_secs(1));
        t.note(90, t0 + Duration::from_secs(2));
        assert_eq!(t.time_of(60, t0), t0 + Duration::from_secs(1));
        assert_eq!(t.time_of(90, t0), t0 + Duration::from_secs(2));
        assert_eq!(t.time_of(5, t0), t0);
    }
}
