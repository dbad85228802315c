//! The tier cost check: is a block worth loading from a lower tier, or cheaper to compute again?
//!
//! A block of `block_bytes` bytes holding `block_tokens` tokens is loaded from a tier only when its bytes
//! at that tier's load bandwidth arrive sooner than the model prefills its tokens:
//!
//! ```text
//!   load  if  block_bytes / bandwidth(tier)  <  block_tokens / prefill_rate
//! ```
//!
//! otherwise the prefix lookup stops at that tier (`KvCacheManager::set_tier_loadable`) and the blocks
//! are computed again, counted in `kura:kv_tier_recomputed_blocks_total`. The decision is per tier: a
//! prefix's run of blocks in one tier is loaded whole or not at all.
//!
//! Both sides are measured ([`TierCostCheck::Measured`], `kura serve`'s default): each tier's achieved
//! load bandwidth (bytes of a load over its I/O time: the host copy, the disk thread's read, the Redis
//! lookup's round trip) and the executor's prefill rate (tokens over forward time of steps that are
//! mostly prefill), each an exponentially weighted average (weight [`EWMA_WEIGHT`] for a new sample).
//! Start values come from probes where cheap (the engine copies a part of the host arena, and reads a
//! few of the disk tier's block files when there are some), else from [`TierRates::PRIOR`]; the first
//! measured sample replaces a start value (a probe of a few blocks may be served by a CPU cache or the
//! page cache: the tier's own loads are the figure that counts). [`TierCostCheck::Fixed`] pins the rates (tests, or an operator who
//! knows them) and [`TierCostCheck::Off`] loads from every tier, as before the check.
//!
//! A refused tier is not read, so its bandwidth is not measured again; the decision flips back when the
//! prefill rate falls (longer contexts, busier batches) below what the last measured bandwidth delivers.

use std::time::Duration;

/// Weight of a new sample in the running averages.
pub const EWMA_WEIGHT: f64 = 0.2;

/// A lower tier as the cost check knows it (Redis included, which the KV manager does not index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CostTier {
    Host = 0,
    Disk = 1,
    Redis = 2,
}

impl CostTier {
    pub const ALL: [CostTier; 3] = [CostTier::Host, CostTier::Disk, CostTier::Redis];

    pub fn as_str(self) -> &'static str {
        match self {
            CostTier::Host => "host",
            CostTier::Disk => "disk",
            CostTier::Redis => "redis",
        }
    }
}

impl From<kura_kv::Tier> for CostTier {
    fn from(t: kura_kv::Tier) -> Self {
        match t {
            kura_kv::Tier::Host => CostTier::Host,
            kura_kv::Tier::Disk => CostTier::Disk,
        }
    }
}

/// Load bandwidth per tier (bytes per second) and the prefill rate (tokens per second).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierRates {
    pub host_bytes_per_s: f64,
    pub disk_bytes_per_s: f64,
    pub redis_bytes_per_s: f64,
    pub prefill_tokens_per_s: f64,
}

impl TierRates {
    /// Start values where nothing was measured: host memory 5 GB/s (a memcpy, or a PCIe copy to a
    /// device, is faster), disk 200 MB/s (slower than any SSD, about a hard disk's sequential reads),
    /// Redis 100 MB/s (about a 1 Gbit/s link), prefill 1,000 tokens/s (a small model on a few CPU cores;
    /// an accelerator's first prefill step replaces it). With them every tier loads, as before the
    /// check, until something is measured.
    pub const PRIOR: TierRates = TierRates {
        host_bytes_per_s: 5e9,
        disk_bytes_per_s: 2e8,
        redis_bytes_per_s: 1e8,
        prefill_tokens_per_s: 1e3,
    };

    pub fn bandwidth(&self, tier: CostTier) -> f64 {
        match tier {
            CostTier::Host => self.host_bytes_per_s,
            CostTier::Disk => self.disk_bytes_per_s,
            CostTier::Redis => self.redis_bytes_per_s,
        }
    }
}

/// How the engine decides between loading and recomputing.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum TierCostCheck {
    /// Every tier is loaded from (the behaviour before the check; the library's default).
    #[default]
    Off,
    /// Rates measured at start and while serving (`kura serve`'s default).
    Measured,
    /// These rates, never updated (tests; an operator who knows them).
    Fixed(TierRates),
}

/// Whether loading a block is faster than recomputing it: `block_bytes / bandwidth <
/// block_tokens / prefill`, compared as products. A tier of no known bandwidth is never loaded from; an
/// unknown (zero) prefill rate always loads.
pub fn load_wins(block_bytes: f64, bandwidth: f64, block_tokens: f64, prefill: f64) -> bool {
    if bandwidth.is_nan() || bandwidth <= 0.0 {
        return false;
    }
    if prefill.is_nan() || prefill <= 0.0 || bandwidth.is_infinite() {
        return true;
    }
    if prefill.is_infinite() {
        return false;
    }
    block_bytes * prefill < block_tokens * bandwidth
}

/// A running average: a start value (a prior or a probe, replaced by the first sample) or measured
/// samples.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ewma {
    value: f64,
    samples: u64,
    probed: bool,
}

impl Ewma {
    pub fn prior(value: f64) -> Self {
        Self {
            value,
            samples: 0,
            probed: false,
        }
    }

    /// A start value measured by a probe: reported as measured, replaced by the first sample.
    pub fn probed(value: f64) -> Self {
        Self {
            value,
            samples: 0,
            probed: true,
        }
    }

    /// Whether the value is measured (a probe or samples), not a prior.
    pub fn measured(&self) -> bool {
        self.probed || self.samples > 0
    }

    pub fn value(&self) -> f64 {
        self.value
    }

    #[cfg(test)]
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Adds a sample (ignored unless finite and positive).
    pub fn observe(&mut self, x: f64) {
        if !(x.is_finite() && x > 0.0) {
            return;
        }
        self.value = if self.samples == 0 {
            x
        } else {
            self.value + EWMA_WEIGHT * (x - self.value)
        };
        self.samples += 1;
    }
}

/// The rates as the engine keeps them, and the decision per tier.
#[derive(Clone, Debug)]
pub struct CostModel {
    mode: TierCostCheck,
    block_bytes: f64,
    block_tokens: f64,
    bandwidth: [Ewma; 3],
    prefill: Ewma,
}

/// Shortest time a sample may take (a copy timed below the clock's resolution is not infinitely fast).
const MIN_SAMPLE: Duration = Duration::from_nanos(100);

impl CostModel {
    pub fn new(mode: TierCostCheck, block_bytes: usize, block_tokens: usize) -> Self {
        let start = match mode {
            TierCostCheck::Fixed(r) => r,
            _ => TierRates::PRIOR,
        };
        Self {
            mode,
            block_bytes: block_bytes as f64,
            block_tokens: block_tokens as f64,
            bandwidth: CostTier::ALL.map(|t| Ewma::prior(start.bandwidth(t))),
            prefill: Ewma::prior(start.prefill_tokens_per_s),
        }
    }

    fn measuring(&self) -> bool {
        self.mode == TierCostCheck::Measured
    }

    /// A start probe of `tier`: `bytes` moved in `elapsed`. It replaces the prior as the start value,
    /// and the first load measured replaces it in turn (a probe of a few blocks may read from a CPU
    /// cache or the page cache).
    pub fn probe(&mut self, tier: CostTier, bytes: usize, elapsed: Duration) {
        if self.measuring() && bytes > 0 {
            let secs = elapsed.max(MIN_SAMPLE).as_secs_f64();
            self.bandwidth[tier as usize] = Ewma::probed(bytes as f64 / secs);
        }
    }

    /// A load of `bytes` from `tier` that took `elapsed` of I/O.
    pub fn observe_load(&mut self, tier: CostTier, bytes: usize, elapsed: Duration) {
        if self.measuring() && bytes > 0 {
            let secs = elapsed.max(MIN_SAMPLE).as_secs_f64();
            self.bandwidth[tier as usize].observe(bytes as f64 / secs);
        }
    }

    /// A forward step of `tokens` prefill tokens that took `elapsed`.
    pub fn observe_prefill(&mut self, tokens: usize, elapsed: Duration) {
        if self.measuring() && tokens > 0 {
            let secs = elapsed.max(MIN_SAMPLE).as_secs_f64();
            self.prefill.observe(tokens as f64 / secs);
        }
    }

    pub fn bandwidth(&self, tier: CostTier) -> f64 {
        self.bandwidth[tier as usize].value()
    }

    /// Whether `tier`'s bandwidth is measured (a probe or loads, not the prior).
    pub fn bandwidth_measured(&self, tier: CostTier) -> bool {
        self.bandwidth[tier as usize].measured()
    }

    pub fn prefill(&self) -> f64 {
        self.prefill.value()
    }

    pub fn prefill_measured(&self) -> bool {
        self.prefill.measured()
    }

    /// Tokens per second a tier delivers: its bandwidth in blocks, times tokens per block.
    pub fn load_tokens_per_s(&self, tier: CostTier) -> f64 {
        if self.block_bytes > 0.0 {
            self.bandwidth(tier) / self.block_bytes * self.block_tokens
        } else {
            f64::INFINITY
        }
    }

    /// Whether a block of `tier` is loaded (always, with the check off).
    pub fn load(&self, tier: CostTier) -> bool {
        match self.mode {
            TierCostCheck::Off => true,
            _ => load_wins(
                self.block_bytes,
                self.bandwidth(tier),
                self.block_tokens,
                self.prefill(),
            ),
        }
    }

    /// The decision for `tier` in words: "load (2.1 GB/s ≈ 171000 tokens/s) vs recompute (900 tokens/s)".
    pub fn describe(&self, tier: CostTier) -> String {
        let source = |measured: bool| if measured { "measured" } else { "prior" };
        format!(
            "{} ({:.3} GB/s {} ≈ {:.0} tokens/s) vs recompute ({:.0} tokens/s {})",
            if self.load(tier) { "load" } else { "recompute" },
            self.bandwidth(tier) / 1e9,
            source(self.bandwidth_measured(tier)),
            self.load_tokens_per_s(tier),
            self.prefill(),
            source(self.prefill_measured()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_boundary_is_bytes_over_bandwidth_against_tokens_over_prefill() {
        // 1 MB blocks of 16 tokens: prefill 1,600 tokens/s recomputes a block in 10 ms; a tier of
        // 100 MB/s loads it in 10 ms too: a tie recomputes, a hair faster loads.
        assert!(!load_wins(1e6, 1e8, 16.0, 1600.0));
        assert!(load_wins(1e6, 1.0001e8, 16.0, 1600.0));
        assert!(!load_wins(1e6, 0.9999e8, 16.0, 1600.0));
        assert!(load_wins(1e6, 1e8, 16.0, 1599.0));
        // Unknown or broken figures: no bandwidth never loads, no prefill rate always does.
        assert!(!load_wins(1e6, 0.0, 16.0, 1600.0));
        assert!(!load_wins(1e6, f64::NAN, 16.0, 1600.0));
        assert!(load_wins(1e6, 1e8, 16.0, 0.0));
        assert!(load_wins(1e6, f64::INFINITY, 16.0, 1600.0));
        assert!(!load_wins(1e6, 1e8, 16.0, f64::INFINITY));
    }

    #[test]
    fn the_average_starts_at_the_first_sample_and_moves_a_fifth_of_the_way() {
        let mut e = Ewma::prior(5.0);
        assert_eq!((e.value(), e.samples()), (5.0, 0));
        e.observe(100.0);
        assert_eq!((e.value(), e.samples()), (100.0, 1));
        e.observe(200.0);
        assert!((e.value() - 120.0).abs() < 1e-9, "{}", e.value());
        e.observe(0.0);
        e.observe(f64::NAN);
        e.observe(-3.0);
        assert_eq!(e.samples(), 2, "nonsense samples are ignored");
    }

    #[test]
    fn measured_rates_move_the_decision_and_fixed_ones_do_not() {
        // 100 kB blocks of 16 tokens.
        let mut m = CostModel::new(TierCostCheck::Measured, 100_000, 16);
        assert!(CostTier::ALL.iter().all(|&t| m.load(t)), "the priors load");
        // 100 kB read in 10 ms: 10 MB/s = 1,600 tokens/s; prefill 16,000 tokens in 1 s.
        m.observe_load(CostTier::Disk, 100_000, Duration::from_millis(10));
        m.observe_prefill(16_000, Duration::from_secs(1));
        assert_eq!(m.bandwidth(CostTier::Disk), 1e7);
        assert!((m.load_tokens_per_s(CostTier::Disk) - 1600.0).abs() < 1e-6);
        assert_eq!(m.prefill(), 16_000.0);
        assert!(!m.load(CostTier::Disk));
        assert!(m.load(CostTier::Host), "5 GB/s = 800,000 tokens/s");
        assert!(m
            .describe(CostTier::Disk)
            .starts_with("recompute (0.010 GB/s measured"));
        // Slower prefill (long contexts): the disk wins again once the average crosses 1,600.
        for _ in 0..20 {
            m.observe_prefill(1_000, Duration::from_secs(1));
        }
        assert!(m.prefill() < 1600.0 && m.load(CostTier::Disk));

        let fixed = TierRates {
            disk_bytes_per_s: 1e6,
            ..TierRates::PRIOR
        };
        let mut f = CostModel::new(TierCostCheck::Fixed(fixed), 100_000, 16);
        assert!(!f.load(CostTier::Disk), "160 tokens/s against 1,000");
        f.observe_load(CostTier::Disk, 100_000, Duration::from_micros(1));
        f.observe_prefill(1, Duration::from_secs(1));
        assert_eq!(f.bandwidth(CostTier::Disk), 1e6);
        assert_eq!(f.prefill(), 1e3);
        assert!(!f.load(CostTier::Disk));

        // A probe is the start value, reported as measured, and the first load replaces it.
        let mut p = CostModel::new(TierCostCheck::Measured, 100_000, 16);
        p.probe(CostTier::Host, 100_000, Duration::from_micros(10));
        assert_eq!(p.bandwidth(CostTier::Host), 1e10);
        assert!(p.bandwidth_measured(CostTier::Host));
        assert!(!p.bandwidth_measured(CostTier::Disk));
        p.observe_load(CostTier::Host, 100_000, Duration::from_micros(100));
        assert_eq!(p.bandwidth(CostTier::Host), 1e9);

        let off = CostModel::new(TierCostCheck::Off, 100_000, 16);
        assert!(off.load(CostTier::Disk));
    }
}
