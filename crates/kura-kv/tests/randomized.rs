//! Seeded randomized operation sequences checked against whole-state invariants and a brute-force lookup.
//!
//! After every operation: no leak, no double free, reference counts equal the block tables holding each
//! block, no referenced block without its tokens, no cached child without its parent (leaf-first), every
//! lookup equal to the brute-force reference, and every sequence reading back exactly its own tokens.
//! The same with a hybrid pool (sliding layers paged apart): every page owned once or free, window
//! references equal to the sequences whose window covers each block, and lookups cut back to the
//! prefixes whose next token finds its window.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use kura_kv::{
    CacheKey, EvictionPolicy, KvCacheConfig, KvCacheManager, KvStats, PinId, RetentionRange, SeqId,
    WindowPool,
};

struct Live {
    seq: SeqId,
    key: usize,
    tokens: Vec<u32>,
}

struct Driver {
    kv: KvCacheManager,
    rng: StdRng,
    keys: Vec<CacheKey>,
    docs: Vec<Vec<u32>>,
    live: Vec<Live>,
    pins: Vec<PinId>,
    now_ms: u64,
    next_token: u32,
    /// Drafts settled.
    stats_drafts: usize,
}

impl Driver {
    fn new(seed: u64, config: KvCacheConfig) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        // Shared "documents" over a small alphabet: many common prefixes and partial block matches.
        let docs = (0..4)
            .map(|_| {
                (0..rng.random_range(4..40))
                    .map(|_| rng.random_range(0..6))
                    .collect()
            })
            .collect();
        Self {
            kv: KvCacheManager::new(config).unwrap(),
            rng,
            keys: vec![
                CacheKey::new().with_salt("a"),
                CacheKey::new().with_salt("b"),
            ],
            docs,
            live: Vec::new(),
            pins: Vec::new(),
            now_ms: 0,
            next_token: 1000,
            stats_drafts: 0,
        }
    }

    fn prompt(&mut self) -> Vec<u32> {
        let doc = &self.docs[self.rng.random_range(0..self.docs.len())];
        let cut = self.rng.random_range(0..=doc.len());
        let mut p = doc[..cut].to_vec();
        for _ in 0..self.rng.random_range(1..12) {
            p.push(self.rng.random_range(0..6));
        }
        p
    }

    fn check_lookup(&mut self, tokens: &[u32], key: usize) -> kura_kv::PrefixHit {
        let key = self.keys[key].clone();
        let reference = self.kv.reference_lookup(tokens, &key);
        let hit = self.kv.find_cached_prefix(tokens, &key);
        assert_eq!(
            (hit.num_full_blocks(), hit.partial_tokens()),
            (reference.full_blocks, reference.partial_tokens),
            "lookup of {tokens:?} disagrees with the brute-force reference"
        );
        hit
    }

    fn step(&mut self) {
        match self.rng.random_range(0..100) {
            0..25 => self.new_request(),
            25..55 => self.compute(),
            55..68 => self.decode(),
            68..73 => self.fork(),
            73..90 => self.free(),
            90..94 => self.pin(),
            94..97 => {
                if let Some(pin) = self.pins.pop() {
                    // It may have expired meanwhile; never another pin released by a stale id.
                    let before = self.kv.usage();
                    if self.kv.unpin(pin).is_err() {
                        assert_eq!(self.kv.usage(), before);
                    }
                }
            }
            97..99 => {
                self.now_ms += self.rng.random_range(0..30);
                self.kv.set_time_ms(self.now_ms);
            }
            _ => {
                if self.rng.random_range(0..10) == 0 {
                    self.kv.clear_cache();
                }
            }
        }
        if let Err(e) = self.kv.check_invariants() {
            panic!("invariant broken: {e}");
        }
        for l in &self.live {
            assert_eq!(
                self.kv.sequence_tokens(l.seq).unwrap(),
                l.tokens,
                "sequence reads back other tokens"
            );
        }
    }

    fn new_request(&mut self) {
        let key = self.rng.random_range(0..self.keys.len());
        let prompt = self.prompt();
        let seq = self.kv.add_sequence(&self.keys[key].clone());
        if self.rng.random_bool(0.2) {
            let r = RetentionRange {
                start: 0,
                end: self.rng.random_range(1..40),
                priority: self.rng.random_range(0..=100),
                duration_ms: Some(self.rng.random_range(0..100)),
            };
            self.kv.set_retention(seq, &[r]).unwrap();
        }
        let hit = self.check_lookup(&prompt, key);
        let cached = hit.num_cached_tokens();
        match self
            .kv
            .allocate_slots(seq, &prompt[cached..], Some(&hit))
            .unwrap()
        {
            Some(alloc) => {
                for c in &alloc.copies {
                    assert!(c.num_tokens > 0 && c.src != c.dst);
                }
                self.live.push(Live {
                    seq,
                    key,
                    tokens: prompt,
                });
            }
            None => self.kv.free(seq).unwrap(),
        }
    }

    fn pick(&mut self) -> Option<usize> {
        (!self.live.is_empty()).then(|| self.rng.random_range(0..self.live.len()))
    }

    fn compute(&mut self) {
        let Some(i) = self.pick() else { return };
        let seq = self.live[i].seq;
        let st = self.kv.pending_status(seq).unwrap();
        assert!(
            st.computed_tokens <= st.computable_tokens && st.computable_tokens <= st.num_tokens
        );
        if st.computable_tokens > st.computed_tokens {
            let upto = self
                .rng
                .random_range(st.computed_tokens + 1..=st.computable_tokens);
            // The sliding layers' pages for the step, as the scheduler asks before each forward pass.
            if self
                .kv
                .prepare_window(seq, st.computed_tokens, upto)
                .unwrap()
            {
                self.kv.mark_computed(seq, upto).unwrap();
            }
        }
    }

    fn decode(&mut self) {
        let Some(i) = self.pick() else { return };
        let seq = self.live[i].seq;
        let st = self.kv.pending_status(seq).unwrap();
        if st.computed_tokens != st.num_tokens {
            return;
        }
        // Mostly fresh tokens; sometimes the alphabet, so that decoded blocks can match prompts.
        let t = if self.rng.random_bool(0.5) {
            self.next_token += 1;
            self.next_token
        } else {
            self.rng.random_range(0..6)
        };
        if self.kv.allocate_slots(seq, &[t], None).unwrap().is_some() {
            self.live[i].tokens.push(t);
            let n = st.num_tokens;
            if self.rng.random_bool(0.5) && self.draft(i, n + 1) {
                return;
            }
            if self.kv.prepare_window(seq, n, n + 1).unwrap() {
                self.kv.mark_computed(seq, n + 1).unwrap();
            }
        }
    }

    /// A draft after the sequence's `firm` tokens (speculative decoding), computed with its last token,
    /// then a random part of it kept; sometimes the sequence is freed or forked while it holds the
    /// draft. Returns false, changing nothing, where no draft was taken (no room; a hybrid pool).
    fn draft(&mut self, i: usize, firm: usize) -> bool {
        let seq = self.live[i].seq;
        let draft: Vec<u32> = (0..self.rng.random_range(1..7))
            .map(|_| self.rng.random_range(0..6))
            .collect();
        match self.kv.allocate_draft_slots(seq, &draft) {
            Ok(Some(_)) => {}
            Ok(None) => return false,
            Err(kura_kv::KvError::Draft { .. }) => return false, // a hybrid pool
            Err(e) => panic!("{e}"),
        }
        // Its blocks are not findable while on trial.
        let mut trial = self.live[i].tokens.clone();
        trial.extend(&draft);
        let key = self.live[i].key;
        self.check_lookup(&trial, key);
        self.kv.mark_computed(seq, firm + draft.len()).unwrap();
        if let Err(e) = self.kv.check_invariants() {
            panic!("invariant broken with a draft: {e}");
        }
        assert!(
            self.kv.fork(seq).is_err(),
            "a sequence holding a draft is forked"
        );
        if self.rng.random_bool(0.1) {
            let l = self.live.swap_remove(i);
            self.kv.free(l.seq).unwrap();
            return true;
        }
        let keep = self.rng.random_range(0..=draft.len());
        self.kv.settle_draft(seq, firm + keep).unwrap();
        self.live[i].tokens.extend(&draft[..keep]);
        self.stats_drafts += 1;
        true
    }

    fn fork(&mut self) {
        let Some(i) = self.pick() else { return };
        let seq = self.live[i].seq;
        let st = self.kv.pending_status(seq).unwrap();
        match self.kv.fork(seq) {
            Ok(child) => {
                assert_eq!(st.computed_tokens, st.num_tokens);
                let (key, tokens) = (self.live[i].key, self.live[i].tokens.clone());
                self.live.push(Live {
                    seq: child,
                    key,
                    tokens,
                });
            }
            Err(_) => assert!(st.computed_tokens < st.num_tokens),
        }
    }

    fn free(&mut self) {
        let Some(i) = self.pick() else { return };
        let l = self.live.swap_remove(i);
        self.kv.free(l.seq).unwrap();
        // Whatever is cached for this prompt must still agree with the reference.
        self.check_lookup(&l.tokens, l.key);
    }

    fn pin(&mut self) {
        let key = self.rng.random_range(0..self.keys.len());
        let prompt = self.prompt();
        let ttl = self
            .rng
            .random_bool(0.5)
            .then(|| self.rng.random_range(0..50));
        let (pin, _) = self.kv.pin_prefix(&prompt, &self.keys[key].clone(), ttl);
        self.pins.push(pin);
    }
}

fn run(
    seed: u64,
    block_size: usize,
    policy: EvictionPolicy,
    hash_bits: u32,
    steps: usize,
) -> KvStats {
    run_with(
        KvCacheConfig::new(48, block_size),
        seed,
        policy,
        hash_bits,
        steps,
    )
}

/// A hybrid pool: `sliding` says which layers slide with a window of `window` tokens; as many pages as
/// `pages_per_layer` blocks of every layer would take.
fn run_hybrid(
    seed: u64,
    block_size: usize,
    sliding: &[bool],
    window: usize,
    steps: usize,
) -> KvStats {
    let pool = WindowPool {
        sliding: sliding.to_vec(),
        window_tokens: window,
        num_pages: 40 * sliding.len() as u32,
    };
    let mut config = KvCacheConfig::new(pool.logical_blocks(), block_size);
    config.window = Some(pool);
    run_with(config, seed, EvictionPolicy::LeafLru, 128, steps)
}

fn run_with(
    mut config: KvCacheConfig,
    seed: u64,
    policy: EvictionPolicy,
    hash_bits: u32,
    steps: usize,
) -> KvStats {
    config.eviction_policy = policy;
    config.hash_seed = Some(seed);
    config.hash_bits = hash_bits;
    config.record_events = true;
    let mut d = Driver::new(seed, config);
    for _ in 0..steps {
        d.step();
        d.kv.drain_events().for_each(drop);
    }
    if d.kv.page_usage().is_none() && steps >= 500 {
        assert!(d.stats_drafts > 3, "only {} drafts settled", d.stats_drafts);
    }
    // Freeing everything leaves no block referenced and none leaked.
    for l in std::mem::take(&mut d.live) {
        d.kv.free(l.seq).unwrap();
    }
    for pin in std::mem::take(&mut d.pins) {
        let _ = d.kv.unpin(pin); // expired ones are already released
    }
    d.kv.check_invariants().unwrap();
    let u = d.kv.usage();
    assert_eq!(u.used_blocks, 0);
    assert_eq!(u.free_blocks + u.cached_idle_blocks, u.total_blocks);
    d.kv.clear_cache();
    assert_eq!(d.kv.usage().free_blocks, u.total_blocks);
    if let Some((total, free, idle)) = d.kv.page_usage() {
        assert_eq!(
            (free, idle),
            (total, 0),
            "pages left held after clearing the cache"
        );
    }
    assert_eq!(d.kv.num_cache_keys(), 0);
    d.kv.stats().clone()
}

/// The random operations must reach every path the invariants guard, or the test proves little.
fn assert_exercised(all: &[KvStats]) {
    let sum = |f: fn(&KvStats) -> u64| all.iter().map(f).sum::<u64>();
    eprintln!(
        "evictions {} partial {} waits {} withdrawn {} copies {} conflicts {} hits {}",
        sum(|s| s.evictions),
        sum(|s| s.partial_hits),
        sum(|s| s.pending_waits),
        sum(|s| s.withdrawn_blocks),
        sum(|s| s.block_copies),
        sum(|s| s.index_conflicts),
        sum(|s| s.prefix_hit_blocks),
    );
    assert!(sum(|s| s.evictions) > 0);
    assert!(sum(|s| s.partial_hits) > 0);
    assert!(sum(|s| s.pending_waits) > 0);
    assert!(sum(|s| s.withdrawn_blocks) > 0);
    assert!(sum(|s| s.block_copies) > 0);
    assert!(sum(|s| s.prefix_hit_blocks) > 0);
}

#[test]
fn leaf_lru_random_operations_keep_every_invariant() {
    let mut all = Vec::new();
    for seed in 0..6 {
        for bs in [1, 3, 4] {
            all.push(run(seed, bs, EvictionPolicy::LeafLru, 128, 1500));
        }
    }
    assert_exercised(&all);
}

#[test]
fn plain_lru_random_operations_keep_every_invariant() {
    let all: Vec<_> = (0..4)
        .map(|seed| run(seed, 4, EvictionPolicy::PlainLru, 128, 1500))
        .collect();
    assert_exercised(&all);
}

#[test]
fn random_operations_with_forced_hash_collisions_stay_exact() {
    let mut all = Vec::new();
    for seed in 0..4 {
        for policy in [EvictionPolicy::LeafLru, EvictionPolicy::PlainLru] {
            all.push(run(seed, 2, policy, 3, 1500));
        }
    }
    assert_exercised(&all);
    assert!(all.iter().map(|s| s.index_conflicts).sum::<u64>() > 0);
}

#[test]
fn hybrid_pool_random_operations_keep_every_invariant() {
    let mut all = Vec::new();
    for seed in 0..16 {
        for (bs, sliding, window) in [
            (4, &[false, true, true, true, true, true][..], 9),
            (3, &[true, false][..], 4),
            (2, &[true, true][..], 7),
            (4, &[false, true][..], 16),
        ] {
            all.push(run_hybrid(seed, bs, sliding, window, 1500));
        }
    }
    assert_exercised(&all);
    let drops: u64 = all.iter().map(|s| s.window_part_drops).sum();
    eprintln!("window parts dropped {drops}");
    assert!(drops > 0, "no window part was ever reclaimed");
}
