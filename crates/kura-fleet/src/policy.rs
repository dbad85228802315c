//! Which replica gets a request: the three policies, as a pure function of what a router knows. `kura
//! router` decides with it, and the fleet simulator (`kura_sim::fleet`) replays the same decisions.

/// How the router picks a replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Lowest `overlap_weight × blocks to prefill + blocks of work in flight` (Dynamo's KV router cost,
    /// with the replica's load counted as the work this router has sent it: each request's blocks to
    /// prefill plus one for its decoding): a replica holding the prompt's prefix wins unless it is
    /// busier by more than the saving.
    #[default]
    Kv,
    /// Each replica in turn.
    RoundRobin,
    /// Fewest requests in flight.
    LeastLoad,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Kv => "kv",
            Policy::RoundRobin => "round-robin",
            Policy::LeastLoad => "least-load",
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "kv" => Ok(Policy::Kv),
            "round-robin" => Ok(Policy::RoundRobin),
            "least-load" => Ok(Policy::LeastLoad),
            _ => Err(format!(
                "unknown routing policy {s:?}: use kv, round-robin or least-load"
            )),
        }
    }
}

/// What the router knows of one replica when a request arrives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Candidate {
    /// Up, and not yet tried for this request.
    pub eligible: bool,
    /// Requests in flight: the more of those this router sent and the replica reports.
    pub load: u64,
    /// Work of the requests this router has in flight there, in blocks: each one's blocks to prefill
    /// (not held there when it was sent) plus one for its decoding.
    pub work_blocks: u64,
    /// Leading blocks of this prompt the replica holds.
    pub held_blocks: u64,
}

/// The replica for a request of `prompt_blocks` full blocks, or `None` if none is eligible. `turn` is the
/// round-robin cursor, advanced past the choice; ties go to the lower load, then to the next in turn.
pub fn choose(
    policy: Policy,
    candidates: &[Candidate],
    prompt_blocks: u64,
    overlap_weight: f64,
    turn: &mut usize,
) -> Option<usize> {
    let n = candidates.len();
    // Replicas in turn order from the cursor, so that ties rotate.
    let order = (0..n).map(|i| (*turn + i) % n.max(1));
    let eligible = order.filter(|&r| candidates[r].eligible);
    let chosen = match policy {
        Policy::RoundRobin => eligible.into_iter().next(),
        Policy::LeastLoad => eligible.min_by_key(|&r| candidates[r].load),
        Policy::Kv => {
            let cost = |r: usize| {
                let c = &candidates[r];
                let prefill = prompt_blocks.saturating_sub(c.held_blocks) as f64;
                overlap_weight * prefill + c.work_blocks as f64
            };
            eligible.min_by(|&a, &b| {
                cost(a)
                    .total_cmp(&cost(b))
                    .then(candidates[a].load.cmp(&candidates[b].load))
            })
        }
    }?;
    *turn = (chosen + 1) % n;
    Some(chosen)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(load: u64, work_blocks: u64, held_blocks: u64) -> Candidate {
        Candidate {
            eligible: true,
            load,
            work_blocks,
            held_blocks,
        }
    }

    #[test]
    fn each_policy_picks_as_documented() {
        let mut turn = 0;
        let c = [up(3, 30, 0), up(1, 10, 0), up(2, 20, 8)];
        // Round robin walks the replicas and skips one that is down.
        let mut down = c;
        down[1].eligible = false;
        let picks: Vec<_> = (0..4)
            .map(|_| choose(Policy::RoundRobin, &down, 8, 1.0, &mut turn).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 2, 0, 2]);
        assert_eq!(choose(Policy::LeastLoad, &c, 8, 1.0, &mut turn), Some(1));
        // KV: replica 2 holds all 8 blocks (cost 20) against 18 for the idle replica 1: 1 wins...
        assert_eq!(choose(Policy::Kv, &c, 8, 1.0, &mut turn), Some(1));
        // ...unless prefill weighs more (2 × 8 + 10 = 26 > 20).
        assert_eq!(choose(Policy::Kv, &c, 8, 2.0, &mut turn), Some(2));
        // Equal costs go to the lower load.
        let tie = [up(2, 5, 0), up(1, 5, 0)];
        assert_eq!(choose(Policy::Kv, &tie, 4, 1.0, &mut 0), Some(1));
        let none = [Candidate::default(); 3];
        assert_eq!(choose(Policy::Kv, &none, 4, 1.0, &mut turn), None);
        assert!("kv".parse::<Policy>().is_ok());
        assert!("random"
            .parse::<Policy>()
            .unwrap_err()
            .contains("round-robin"));
    }
}
