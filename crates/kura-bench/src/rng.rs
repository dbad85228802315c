//! A small deterministic random number generator (SplitMix64).
//!
//! Workloads must be reproducible from a seed across machines and across dependency upgrades, so the
//! generator is written out here rather than borrowed: the same seed yields the same prompts forever.
//! Every draw is O(1).

/// SplitMix64 (Steele, Lea and Flood, 2014): one 64-bit state, full period, good enough for workload text
/// and arrival times (it is not a cryptographic generator).
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// One SplitMix64 finalisation step: a bijective 64-bit mix.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self { state: mix64(seed) }
    }

    /// A generator for one named stream under `seed` (for example "group 3's system prompt"), independent
    /// of how many draws other streams made.
    pub fn stream(seed: u64, path: &[u64]) -> Self {
        let mut state = mix64(seed);
        for &p in path {
            state = mix64(state ^ mix64(p.wrapping_add(GOLDEN_GAMMA)));
        }
        Self { state }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }

    /// Uniform in `0..n` (`n > 0`); the modulo bias is below 2^-40 for the small `n` used here.
    pub fn below(&mut self, n: usize) -> usize {
        debug_assert!(n > 0);
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// An exponential variate with the given rate (mean `1 / rate`): the gap between Poisson arrivals.
    pub fn exponential(&mut self, rate: f64) -> f64 {
        -(1.0 - self.unit()).ln() / rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_streams_differ() {
        let a: Vec<u64> = (0..8).map(|_| Rng::new(7).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let mut s1 = Rng::stream(7, &[1, 2]);
        let mut s2 = Rng::stream(7, &[2, 1]);
        assert_ne!(s1.next_u64(), s2.next_u64());
    }

    #[test]
    fn exponential_mean_is_close_to_one_over_rate() {
        let mut rng = Rng::new(42);
        let n = 20_000;
        let mean = (0..n).map(|_| rng.exponential(4.0)).sum::<f64>() / n as f64;
        assert!((mean - 0.25).abs() < 0.01, "mean {mean}");
    }
}
