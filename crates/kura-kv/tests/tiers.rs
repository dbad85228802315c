//! The pool with a host tier and a disk tier, driven by seeded random operations, with the bytes of every
//! place modelled: each computed block's "KV" is a digest of its cache key and every token up to its end,
//! moves copy those digests as the engine copies bytes, and disk loads complete late (some failing, as a
//! corrupt file would). After every operation: the manager's invariants, every tier slot the index names
//! holds bytes, the disk holds exactly the blocks its index names, and every sequence whose blocks are all
//! present reads back exactly the KV of its own tokens (no block anywhere with another block's content).

use std::collections::{HashMap, HashSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use kura_kv::{
    BlockHash, CacheKey, KvCacheConfig, KvCacheManager, OffloadPolicy, SeqId, Tier, TierConfig,
    TierMove,
};

const BS: usize = 4;

fn digest(key: usize, tokens: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ key as u64;
    for &t in tokens {
        h = (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3);
    }
    h
}

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
    pool: Vec<Option<u64>>,
    host: Vec<Option<u64>>,
    disk: HashMap<BlockHash, u64>,
    /// Files a failed read deleted (a check failed), whose index entries the manager then drops.
    deleted_by_read: HashSet<BlockHash>,
    /// Disk loads in flight: (block, hash).
    reading: Vec<(u32, BlockHash)>,
    fail_reads: bool,
    loads_failed: u64,
    /// Turn the tiers' loads off and on at random (the engine's cost check changing its mind).
    toggle_loadable: bool,
}

impl Driver {
    fn new(seed: u64, pool: u32, host: u32, disk: u32, policy: OffloadPolicy) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let docs = (0..6)
            .map(|_| {
                (0..rng.random_range(8..48))
                    .map(|_| rng.random_range(0..5))
                    .collect()
            })
            .collect();
        let mut config = KvCacheConfig::new(pool, BS);
        config.hash_seed = Some(seed);
        config.tiers = TierConfig {
            host_blocks: host,
            disk_blocks: disk,
            policy,
        };
        Self {
            kv: KvCacheManager::new(config).unwrap(),
            rng,
            keys: vec![
                CacheKey::new().with_salt("a"),
                CacheKey::new().with_salt("b"),
            ],
            docs,
            live: Vec::new(),
            pool: vec![None; pool as usize],
            host: vec![None; host as usize],
            disk: HashMap::new(),
            deleted_by_read: HashSet::new(),
            reading: Vec::new(),
            fail_reads: true,
            loads_failed: 0,
            toggle_loadable: false,
        }
    }

    /// Runs the moves in order, as the engine does.
    fn run_moves(&mut self) {
        loop {
            let moves: Vec<TierMove> = self.kv.drain_tier_moves().collect();
            if moves.is_empty() {
                return;
            }
            self.run(moves);
        }
    }

    fn run(&mut self, moves: Vec<TierMove>) {
        for m in moves {
            match m {
                TierMove::Demote { block, slot } => {
                    let bytes = self.pool[block as usize].expect("demoted block has KV");
                    self.host[slot as usize] = Some(bytes);
                }
                TierMove::HostToDisk { slot, record } => {
                    let bytes = self.host[slot as usize].expect("spilled slot has KV");
                    self.disk.insert(record.hash, bytes);
                }
                TierMove::BlockToDisk { block, record } => {
                    let bytes = self.pool[block as usize].expect("written block has KV");
                    self.disk.insert(record.hash, bytes);
                }
                TierMove::DropDisk { hash } => {
                    if self.disk.remove(&hash).is_none() {
                        assert!(
                            self.deleted_by_read.remove(&hash),
                            "dropped a block never written"
                        );
                    }
                }
                TierMove::LoadHost { slot, block } => {
                    self.pool[block as usize] =
                        Some(self.host[slot as usize].expect("loaded slot"));
                    self.kv.complete_load(block, true).unwrap();
                }
                TierMove::LoadDisk { record, block } => {
                    assert!(
                        self.disk.contains_key(&record.hash),
                        "load of a block not on disk"
                    );
                    self.reading.push((block, record.hash));
                }
            }
        }
    }

    fn finish_a_read(&mut self) {
        if self.reading.is_empty() {
            return;
        }
        let (block, hash) = self
            .reading
            .remove(self.rng.random_range(0..self.reading.len()));
        if self.fail_reads && self.rng.random_range(0..10) == 0 {
            // A corrupt file, which the store deletes, or one the disk fails to read, which stays
            // until the manager, dropping it from its index, has it deleted too.
            if self.rng.random_range(0..2) == 0 {
                self.disk.remove(&hash);
                self.deleted_by_read.insert(hash);
            }
            self.kv.complete_load(block, false).unwrap();
            self.loads_failed += 1;
            // Another load of the same hash may be queued: it fails too (file gone).
            let again: Vec<u32> = self
                .reading
                .iter()
                .filter(|(_, h)| *h == hash)
                .map(|(b, _)| *b)
                .collect();
            self.reading.retain(|(_, h)| *h != hash);
            for b in again {
                self.kv.complete_load(b, false).unwrap();
                self.loads_failed += 1;
            }
        } else {
            self.pool[block as usize] = Some(self.disk[&hash]);
            self.kv.complete_load(block, true).unwrap();
        }
    }

    fn prompt(&mut self) -> (usize, Vec<u32>) {
        let doc = self.docs[self.rng.random_range(0..self.docs.len())].clone();
        let cut = self.rng.random_range(0..=doc.len());
        let mut p = doc[..cut].to_vec();
        for _ in 0..self.rng.random_range(1..6) {
            p.push(self.rng.random_range(0..5));
        }
        (self.rng.random_range(0..self.keys.len()), p)
    }

    fn admit(&mut self) {
        let (key, tokens) = self.prompt();
        let k = self.keys[key].clone();
        let seq = self.kv.add_sequence(&k);
        let hit = self.kv.find_cached_prefix(&tokens[..tokens.len() - 1], &k);
        let cached = hit.num_cached_tokens();
        match self
            .kv
            .allocate_slots(seq, &tokens[cached..], Some(&hit))
            .unwrap()
        {
            Some(alloc) => {
                self.run_moves();
                for c in alloc.copies {
                    self.pool[c.dst as usize] = self.pool[c.src as usize];
                }
                self.live.push(Live { seq, key, tokens });
            }
            None => self.kv.free(seq).unwrap(),
        }
    }

    /// Computes what a live sequence may compute now (its KV digests), as a forward pass would.
    fn compute(&mut self, i: usize) {
        let st = self.kv.pending_status(self.live[i].seq).unwrap();
        if st.computable_tokens <= st.computed_tokens {
            return;
        }
        let table = self.kv.block_table(self.live[i].seq).unwrap().to_vec();
        let l = &self.live[i];
        for (bi, &b) in table.iter().enumerate() {
            let end = ((bi + 1) * BS).min(st.computable_tokens);
            if end > bi * BS && end > st.computed_tokens {
                // A partial block's digest is of its tokens so far; full blocks end at their last token.
                self.pool[b as usize] = Some(digest(l.key, &l.tokens[..end]));
            }
        }
        self.kv.mark_computed(l.seq, st.computable_tokens).unwrap();
    }

    fn check_sequences(&mut self) {
        for i in 0..self.live.len() {
            let l = &self.live[i];
            let st = self.kv.pending_status(l.seq).unwrap();
            let table = self.kv.block_table(l.seq).unwrap();
            for (bi, &b) in table.iter().enumerate().take(st.computed_tokens / BS) {
                let want = digest(l.key, &l.tokens[..(bi + 1) * BS]);
                assert_eq!(
                    self.pool[b as usize],
                    Some(want),
                    "block {bi} (pool block {b}) of a sequence holds KV of other tokens"
                );
            }
        }
    }

    fn check_tiers(&self) {
        self.kv.check_invariants().unwrap();
        for (slot, _) in self.kv.tier_blocks(Tier::Host) {
            assert!(
                self.host[slot as usize].is_some(),
                "host slot {slot} indexed without bytes"
            );
        }
        let on_disk = self.kv.tier_blocks(Tier::Disk);
        assert_eq!(
            on_disk.len(),
            self.disk.len(),
            "disk files and disk index differ"
        );
        for (_, b) in on_disk {
            assert!(
                self.disk.contains_key(&b.hash),
                "disk index names a block never written"
            );
        }
        let usage = self.kv.tier_usage(Tier::Host).map_or(0, |u| u.used_blocks);
        assert_eq!(usage as usize, self.kv.tier_blocks(Tier::Host).len());
    }

    fn step(&mut self) {
        match self.rng.random_range(0..100) {
            0..=29 => self.admit(),
            30..=59 if !self.live.is_empty() => {
                let i = self.rng.random_range(0..self.live.len());
                self.compute(i);
            }
            60..=79 if !self.live.is_empty() => {
                let i = self.rng.random_range(0..self.live.len());
                let l = self.live.swap_remove(i);
                self.kv.free(l.seq).unwrap();
            }
            80..=94 => self.finish_a_read(),
            95 => {
                self.kv.flush_to_disk();
                self.run_moves();
            }
            96..=97 if self.toggle_loadable => {
                let tier = [Tier::Host, Tier::Disk][self.rng.random_range(0..2)];
                let on = self.rng.random_range(0..3) > 0;
                self.kv.set_tier_loadable(tier, on);
            }
            98..=99 => {
                // The engine's store-ahead, with a reserve anywhere from none to the whole pool.
                let reserve = self.rng.random_range(0..=self.pool.len());
                self.kv.store_ahead(reserve);
            }
            _ => {}
        }
        // Moves decided after a forward pass (write-through of computed blocks) or by a completed load
        // run before the next step, as in the engine.
        self.run_moves();
        self.check_tiers();
        self.check_sequences();
    }
}

#[test]
fn random_operations_keep_every_tier_consistent() {
    let (mut loads, mut stored_ahead) = (0, 0);
    for (seed, policy) in [
        (1, OffloadPolicy::WriteBack),
        (2, OffloadPolicy::WriteThrough { min_hits: 0 }),
        (3, OffloadPolicy::WriteThrough { min_hits: 2 }),
        (4, OffloadPolicy::WriteBack),
    ] {
        for (host, disk) in [(12, 40), (0, 30), (20, 0), (6, 6)] {
            let mut d = Driver::new(seed * 31 + u64::from(host), 24, host, disk, policy);
            for _ in 0..2_500 {
                d.step();
            }
            while !d.reading.is_empty() {
                d.finish_a_read();
                d.run_moves();
                d.check_tiers();
            }
            let s = d.kv.stats();
            loads += s.host_hit_blocks + s.disk_hit_blocks;
            stored_ahead += s.host_stored_ahead;
            assert_eq!(s.load_failures, d.loads_failed);
        }
    }
    assert!(
        loads > 1_000,
        "the tiers were hardly exercised: {loads} loads"
    );
    assert!(stored_ahead > 100, "{stored_ahead} blocks stored ahead");
}

#[test]
fn with_room_below_nothing_evicted_from_the_pool_is_recomputed() {
    // A pool of 8 blocks, a host tier of 64 and a disk of 256: every block computed once is found again.
    let mut d = Driver::new(9, 8, 64, 256, OffloadPolicy::WriteBack);
    d.fail_reads = false;
    let mut seen: Vec<(usize, Vec<u32>)> = Vec::new();
    for round in 0..200 {
        let (key, tokens) = d.prompt();
        let k = d.keys[key].clone();
        let full = (tokens.len() - 1) / BS * BS;
        let was_seen = seen
            .iter()
            .any(|(sk, st)| *sk == key && st.len() >= full && st[..full] == tokens[..full]);
        let seq = d.kv.add_sequence(&k);
        let hit = d.kv.find_cached_prefix(&tokens[..tokens.len() - 1], &k);
        if was_seen {
            assert_eq!(
                hit.num_cached_tokens() / BS * BS,
                full,
                "round {round}: a block seen before was lost"
            );
        }
        let cached = hit.num_cached_tokens();
        d.kv.allocate_slots(seq, &tokens[cached..], Some(&hit))
            .unwrap()
            .expect("room");
        d.run_moves();
        d.live.push(Live {
            seq,
            key,
            tokens: tokens.clone(),
        });
        while !d.reading.is_empty() {
            d.finish_a_read();
            d.run_moves();
        }
        d.compute(0);
        d.run_moves();
        d.check_sequences();
        let l = d.live.pop().unwrap();
        d.kv.free(l.seq).unwrap();
        d.check_tiers();
        seen.push((key, tokens));
    }
    let s = d.kv.stats();
    assert!(s.host_hit_blocks > 50 && s.disk_hit_blocks > 10, "{s:?}");
}

#[test]
fn random_operations_stay_consistent_while_the_cost_check_refuses_tiers() {
    let (mut loads, mut refused) = (0, 0);
    for (seed, (host, disk)) in [(11, (12, 40)), (12, (0, 30)), (13, (20, 0)), (14, (6, 6))] {
        let mut d = Driver::new(seed, 24, host, disk, OffloadPolicy::WriteBack);
        d.toggle_loadable = true;
        for _ in 0..2_500 {
            d.step();
        }
        while !d.reading.is_empty() {
            d.finish_a_read();
            d.run_moves();
            d.check_tiers();
        }
        let s = d.kv.stats();
        loads += s.host_hit_blocks + s.disk_hit_blocks;
        refused += s.host_refused_blocks + s.disk_refused_blocks;
    }
    assert!(
        loads > 100 && refused > 100,
        "{loads} loads, {refused} refused"
    );
}

/// Computes `tokens` in a fresh sequence (whatever the lookup finds is attached), then frees it.
fn compute_prompt(d: &mut Driver, key: usize, tokens: &[u32]) {
    let k = d.keys[key].clone();
    let seq = d.kv.add_sequence(&k);
    let hit = d.kv.find_cached_prefix(&tokens[..tokens.len() - 1], &k);
    let cached = hit.num_cached_tokens();
    d.kv.allocate_slots(seq, &tokens[cached..], Some(&hit))
        .unwrap()
        .expect("room");
    d.run_moves();
    while !d.reading.is_empty() {
        d.finish_a_read();
        d.run_moves();
    }
    d.live.push(Live {
        seq,
        key,
        tokens: tokens.to_vec(),
    });
    d.compute(d.live.len() - 1);
    d.run_moves();
    let l = d.live.pop().unwrap();
    d.kv.free(l.seq).unwrap();
    d.run_moves();
}

#[test]
fn a_failed_disk_load_has_its_file_deleted() {
    // A pool of 8 blocks and a disk tier of 64: a 6-block prefix pushed out of the pool is on disk.
    let mut d = Driver::new(31, 8, 0, 64, OffloadPolicy::WriteBack);
    d.fail_reads = false;
    let prefix: Vec<u32> = (0..25).map(|i| (i * 7 + 1) % 5).collect();
    compute_prompt(&mut d, 0, &prefix);
    for s in 0..4u32 {
        let other: Vec<u32> = (0..29).map(|i| (i * 3 + s) % 5).collect();
        compute_prompt(&mut d, 1, &other);
    }
    let k = d.keys[0].clone();
    let seq = d.kv.add_sequence(&k);
    let hit = d.kv.find_cached_prefix(&prefix[..24], &k);
    assert!(hit.num_tier_blocks(Tier::Disk) >= 2, "the prefix went down");
    let cached = hit.num_cached_tokens();
    d.kv.allocate_slots(seq, &prefix[cached..], Some(&hit))
        .unwrap()
        .expect("room");
    d.run_moves();
    // Every read fails with an I/O error, which leaves the file where it is: the manager drops the
    // block from its index and has the file deleted, or it would hold disk space outside the budget.
    let failed: Vec<(u32, BlockHash)> = d.reading.drain(..).collect();
    assert_eq!(failed.len(), hit.num_tier_blocks(Tier::Disk));
    for &(block, _) in &failed {
        d.kv.complete_load(block, false).unwrap();
    }
    let dropped: Vec<BlockHash> =
        d.kv.drain_tier_moves()
            .filter_map(|m| match m {
                TierMove::DropDisk { hash } => Some(hash),
                _ => None,
            })
            .collect();
    for (_, hash) in &failed {
        assert!(dropped.contains(hash), "the file of a failed load is kept");
        assert!(!d.kv.tier_has(Tier::Disk, *hash));
    }
    d.kv.free(seq).unwrap();
    d.kv.check_invariants().unwrap();
}

#[test]
fn a_refused_tier_stops_the_lookup_and_counts_its_blocks_as_recomputed() {
    // A pool of 8 blocks, a host tier of 3 and a disk tier of 64: a 6-block prefix pushed out of the
    // pool lies partly in the host tier and, evicted from there, on disk.
    let mut d = Driver::new(21, 8, 3, 64, OffloadPolicy::WriteBack);
    d.fail_reads = false;
    let prefix: Vec<u32> = (0..25).map(|i| (i * 7 + 1) % 5).collect();
    compute_prompt(&mut d, 0, &prefix);
    for s in 0..4u32 {
        let other: Vec<u32> = (0..29).map(|i| (i * 3 + s) % 5).collect();
        compute_prompt(&mut d, 1, &other);
    }
    let k = d.keys[0].clone();
    // A lookup is a new sequence's (which keeps its cache key known while no block of it is in the pool).
    let holder = d.kv.add_sequence(&k);
    let look = |d: &mut Driver| d.kv.find_cached_prefix(&prefix[..24], &k);

    let all = look(&mut d);
    let below = all.num_tier_blocks(Tier::Host) + all.num_tier_blocks(Tier::Disk);
    assert_eq!(all.num_cached_tokens(), 24, "every block is somewhere");
    assert!(
        below >= 4,
        "the prefix went down: {below} blocks below the pool"
    );
    assert_eq!(all.num_refused_tier_blocks(Tier::Disk), 0);
    let pooled = 6 - below;

    // Disk refused: the lookup takes the pool's blocks and the host tier's up to the first block
    // only the disk holds; that block and the rest found below are refused.
    d.kv.set_tier_loadable(Tier::Disk, false);
    let h = look(&mut d);
    assert_eq!(h.num_tier_blocks(Tier::Disk), 0);
    let host_taken = h.num_tier_blocks(Tier::Host);
    let refused = h.num_refused_tier_blocks(Tier::Disk) + h.num_refused_tier_blocks(Tier::Host);
    assert!(h.num_refused_tier_blocks(Tier::Disk) >= 1);
    assert_eq!(pooled + host_taken + refused, 6);
    assert_eq!(h.num_cached_tokens(), (pooled + host_taken) * BS);

    // Both refused: only the pool's blocks are a hit.
    d.kv.set_tier_loadable(Tier::Host, false);
    let h = look(&mut d);
    assert_eq!(h.num_cached_tokens(), pooled * BS);
    assert_eq!(
        h.num_refused_tier_blocks(Tier::Host) + h.num_refused_tier_blocks(Tier::Disk),
        below
    );
    assert!(
        d.kv.stats().disk_refused_blocks == 0,
        "a lookup alone counts nothing"
    );

    d.kv.free(holder).unwrap();
    // Admitted with both refused: the refused blocks are counted, computed again, and nothing loads.
    let before = d.kv.stats().clone();
    compute_prompt(&mut d, 0, &prefix);
    let s = d.kv.stats();
    assert_eq!(
        (s.host_refused_blocks + s.disk_refused_blocks)
            - (before.host_refused_blocks + before.disk_refused_blocks),
        below as u64
    );
    assert_eq!(
        s.host_hit_blocks + s.disk_hit_blocks,
        before.host_hit_blocks + before.disk_hit_blocks
    );
    d.check_tiers();
    d.kv.set_tier_loadable(Tier::Host, true);
    d.kv.set_tier_loadable(Tier::Disk, true);
    assert!(d.kv.tier_loadable(Tier::Disk));
}
