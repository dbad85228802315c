//! How attention's work is split over threads, shared by the CPU kernel (`kura-model`) and the
//! simulator's cost model (`kura-sim`): a token's context is cut into segments at absolute positions,
//! each (token, segment, KV head) is a unit with a cost, and a [`Dealer`] deals a step's units in order to
//! the threads so that each thread gets one contiguous run of about `total / threads`.

/// Positions per attention segment. A token's context is cut at multiples of `SEGMENT` (absolute
/// positions, so the cut does not depend on the batch); each piece is a unit of its own, which spreads a
/// long-context decode over the threads, and the pieces are merged in order.
pub const SEGMENT: usize = 1024;

/// The first position a token at `pos` attends to.
pub fn context_start(pos: usize, window: Option<usize>) -> usize {
    match window {
        Some(w) if pos + 1 > w => pos + 1 - w,
        _ => 0,
    }
}

/// Segments of the context of a token at `pos`.
pub fn segments(pos: usize, window: Option<usize>) -> usize {
    pos / SEGMENT - context_start(pos, window) / SEGMENT + 1
}

/// The cost of one unit, a token at `pos` (context from `lo`) over segment `k` of its context: the
/// positions it reads, plus a fixed cost for the unit's own work (its query, softmax and output).
pub fn unit_cost(lo: usize, pos: usize, k: usize) -> usize {
    const PER_UNIT: usize = 16;
    pos.min(k * SEGMENT + SEGMENT - 1) + 1 - lo.max(k * SEGMENT) + PER_UNIT
}

/// The segments of the context of a token at `pos`, in order, each with its [`unit_cost`] (per KV head).
pub fn token_units(pos: usize, window: Option<usize>) -> impl Iterator<Item = (usize, usize)> {
    let lo = context_start(pos, window);
    (lo / SEGMENT..=pos / SEGMENT).map(move |k| (k, unit_cost(lo, pos, k)))
}

/// The summed [`unit_cost`] of every (token, segment) for tokens at `positions`, for one KV head.
pub fn units_cost(positions: impl Iterator<Item = usize>, window: Option<usize>) -> usize {
    positions
        .flat_map(|pos| token_units(pos, window))
        .map(|(_, cost)| cost)
        .sum()
}

/// Deals a step's units, in order, to the threads: each unit goes to the thread whose even share of
/// the total cost holds the unit's midpoint. Each thread's units are then one contiguous run, and its
/// summed cost is within one unit of `total / threads`.
#[derive(Debug, Clone)]
pub struct Dealer {
    done: usize,
    total: usize,
    threads: usize,
}

impl Dealer {
    /// For new tokens at `positions` (in batch order) with `kv_heads` KV heads and contexts under
    /// `window`, on `threads` threads (at least 1).
    pub fn new(
        positions: impl Iterator<Item = usize>,
        window: Option<usize>,
        kv_heads: usize,
        threads: usize,
    ) -> Self {
        Dealer {
            done: 0,
            total: units_cost(positions, window) * kv_heads,
            threads: threads.max(1),
        }
    }

    /// The thread of the next unit, which costs `cost`.
    pub fn deal(&mut self, cost: usize) -> usize {
        let owner =
            ((2 * self.done + cost) * self.threads / (2 * self.total)).min(self.threads - 1);
        self.done += cost;
        owner
    }
}

/// Each thread's summed unit cost (context positions read, plus a fixed cost per unit) when attention
/// of new tokens at `positions` (in batch order), with `kv_heads` KV heads and contexts under `window`,
/// is dealt to `threads` threads as [`attention_part`] deals it. A step's attention takes as long as its
/// busiest thread: the simulator's cost model reads that from here.
pub fn thread_shares(
    positions: impl Iterator<Item = usize> + Clone,
    window: Option<usize>,
    kv_heads: usize,
    threads: usize,
) -> Vec<usize> {
    let mut dealer = Dealer::new(positions.clone(), window, kv_heads, threads);
    let mut share = vec![0; dealer.threads];
    for pos in positions {
        for (_, cost) in token_units(pos, window) {
            for _ in 0..kv_heads {
                share[dealer.deal(cost)] += cost;
            }
        }
    }
    share
}
