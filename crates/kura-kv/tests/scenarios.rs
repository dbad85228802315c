//! Named scenarios, one per feature of the cache manager.

use std::sync::{Arc, Mutex};

use kura_kv::hash::BlockHasher;
use kura_kv::{
    BlockCopy, CacheKey, EvictedBlock, EvictionHook, EvictionPolicy, KvCacheConfig, KvCacheManager,
    KvError, KvEvent, OffloadPolicy, RetentionRange, SeqId, TierConfig, TierMove,
};

const BS: usize = 4;

fn manager(num_blocks: u32) -> KvCacheManager {
    let mut c = KvCacheConfig::new(num_blocks, BS);
    c.hash_seed = Some(42);
    c.record_events = true;
    KvCacheManager::new(c).unwrap()
}

fn manager_with(num_blocks: u32, f: impl FnOnce(&mut KvCacheConfig)) -> KvCacheManager {
    let mut c = KvCacheConfig::new(num_blocks, BS);
    c.hash_seed = Some(42);
    c.record_events = true;
    f(&mut c);
    KvCacheManager::new(c).unwrap()
}

/// A manager of `num_blocks` blocks with a host tier of `host_blocks`, write-back.
fn manager_with_host(num_blocks: u32, host_blocks: u32) -> KvCacheManager {
    manager_with(num_blocks, |c| {
        c.tiers = TierConfig {
            host_blocks,
            disk_blocks: 0,
            policy: OffloadPolicy::WriteBack,
        }
    })
}

/// The blocks the tier moves decided since the last drain store, in order; they must all be stores
/// (into a host tier with room: no spill, no load).
fn stored_blocks(kv: &mut KvCacheManager) -> Vec<u32> {
    kv.drain_tier_moves()
        .map(|m| match m {
            TierMove::Demote { block, .. } => block,
            other => panic!("only stores into a host tier with room: {other:?}"),
        })
        .collect()
}

/// Runs a prompt to completion the way the scheduler would: lookup, allocate, compute, optionally free.
fn run(kv: &mut KvCacheManager, key: &CacheKey, prompt: &[u32], free: bool) -> SeqId {
    let seq = kv.add_sequence(key);
    let hit = kv.find_cached_prefix(prompt, key);
    kv.allocate_slots(seq, &prompt[hit.num_cached_tokens()..], Some(&hit))
        .unwrap()
        .expect("enough blocks");
    kv.mark_computed(seq, prompt.len()).unwrap();
    kv.check_invariants().unwrap();
    if free {
        kv.free(seq).unwrap();
        kv.check_invariants().unwrap();
    }
    seq
}

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

#[test]
fn full_blocks_hit_after_the_sequence_is_freed() {
    let mut kv = manager(16);
    let key = CacheKey::new();
    let prompt = toks(0..10); // 2 full blocks + 2 tokens
    let seq = run(&mut kv, &key, &prompt, false);
    let table = kv.block_table(seq).unwrap().to_vec();
    kv.free(seq).unwrap();
    let hit = kv.find_cached_prefix(&prompt, &key);
    assert_eq!(hit.num_full_blocks(), 2);
    assert_eq!(hit.block_ids().collect::<Vec<_>>(), table[..2]);
    assert_eq!(hit.num_pending_blocks(), 0);
    assert_eq!(kv.usage().cached_idle_blocks, 2);
    assert_eq!(kv.usage().used_blocks, 0);
    // Counted when a sequence is admitted with the hit, not at the lookup.
    assert_eq!(kv.stats().prefix_hit_blocks, 0);
    let again = kv.add_sequence(&key);
    kv.allocate_slots(again, &prompt[hit.num_cached_tokens()..], Some(&hit))
        .unwrap()
        .unwrap();
    assert_eq!(kv.stats().prefix_hit_blocks, 2);
}

#[test]
fn a_partly_shared_block_is_reused_by_copy() {
    let mut kv = manager(16);
    let key = CacheKey::new();
    run(&mut kv, &key, &toks(0..8), true);
    // Shares block 0 fully and 3 tokens of block 1.
    let mut prompt = toks(0..7);
    prompt.extend([100, 101, 102]);
    let hit = kv.find_cached_prefix(&prompt, &key);
    assert_eq!((hit.num_full_blocks(), hit.partial_tokens()), (1, 3));
    assert_eq!(hit.num_cached_tokens(), 7);
    let seq = kv.add_sequence(&key);
    let cached_src = kv
        .find_cached_prefix(&toks(0..8), &key)
        .block_ids()
        .nth(1)
        .unwrap();
    let alloc = kv
        .allocate_slots(seq, &prompt[7..], Some(&hit))
        .unwrap()
        .unwrap();
    let table = kv.block_table(seq).unwrap().to_vec();
    assert_eq!(
        alloc.copies,
        vec![BlockCopy {
            src: cached_src,
            dst: table[1],
            num_tokens: 3
        }]
    );
    assert_ne!(
        table[1], cached_src,
        "the cached block itself is never written"
    );
    let status = kv.pending_status(seq).unwrap();
    assert_eq!(status.computed_tokens, 7, "copied tokens count as computed");
    assert_eq!(status.computable_tokens, 10);
    assert_eq!(kv.stats().partial_hits, 1);
    kv.check_invariants().unwrap();
}

#[test]
fn a_forced_hash_collision_never_hits() {
    // One significant hash bit: every other block collides with whatever is indexed.
    let mut kv = manager_with(64, |c| c.hash_bits = 1);
    let mut hasher = BlockHasher::new(42, 1);
    let key = CacheKey::new();
    let cached = toks(0..4);
    run(&mut kv, &key, &cached, true);
    let root = hasher.key_hash(&key);
    let cached_hash = hasher.chain(root, &cached);
    let mut collisions = 0;
    for i in 1..40u32 {
        let other: Vec<u32> = (0..4).map(|t| 1000 * i + t).collect();
        if hasher.chain(root, &other) == cached_hash {
            collisions += 1;
        }
        let hit = kv.find_cached_prefix(&other, &key);
        assert_eq!(hit.num_cached_tokens(), 0, "prompt {other:?} must not hit");
        kv.check_invariants().unwrap();
    }
    assert!(
        collisions > 0,
        "the test must actually produce colliding hashes"
    );
    // The true prefix still hits.
    assert_eq!(kv.find_cached_prefix(&cached, &key).num_full_blocks(), 1);
}

#[test]
fn colliding_blocks_stay_private_and_correct() {
    let mut kv = manager_with(64, |c| c.hash_bits = 1);
    let key = CacheKey::new();
    for i in 0..20u32 {
        let prompt: Vec<u32> = (0..12).map(|t| 100 * i + t).collect();
        run(&mut kv, &key, &prompt, true);
    }
    assert!(kv.stats().index_conflicts > 0);
    assert!(kv.num_indexed_blocks() <= 2, "only two hash values exist");
    for i in 0..20u32 {
        let prompt: Vec<u32> = (0..12).map(|t| 100 * i + t).collect();
        let hit = kv.find_cached_prefix(&prompt, &key);
        let reference = kv.reference_lookup(&prompt, &key);
        assert_eq!(hit.num_full_blocks(), reference.full_blocks);
    }
}

#[test]
fn two_salts_never_share_even_when_their_hashes_collide() {
    for bits in [128, 1] {
        let mut kv = manager_with(64, |c| c.hash_bits = bits);
        let a = CacheKey::new().with_salt("tenant-a");
        let b = CacheKey::new().with_salt("tenant-b");
        let prompt = toks(0..16);
        run(&mut kv, &a, &prompt, true);
        let seq_b = kv.add_sequence(&b);
        let hit = kv.find_cached_prefix(&prompt, &b);
        assert_eq!(hit.num_cached_tokens(), 0, "bits {bits}");
        kv.allocate_slots(seq_b, &prompt, Some(&hit))
            .unwrap()
            .unwrap();
        kv.mark_computed(seq_b, 16).unwrap();
        kv.free(seq_b).unwrap();
        // Each tenant hits only its own blocks.
        let ha = kv
            .find_cached_prefix(&prompt, &a)
            .block_ids()
            .collect::<Vec<_>>();
        let hb = kv
            .find_cached_prefix(&prompt, &b)
            .block_ids()
            .collect::<Vec<_>>();
        assert!(
            ha.iter().all(|x| !hb.contains(x)),
            "bits {bits}: {ha:?} vs {hb:?}"
        );
        if bits == 128 {
            assert_eq!(ha.len(), 4);
        }
        kv.check_invariants().unwrap();
    }
}

#[test]
fn a_hit_from_another_key_is_refused() {
    let mut kv = manager(16);
    let a = CacheKey::new().with_salt("a");
    run(&mut kv, &a, &toks(0..8), true);
    let hit = kv.find_cached_prefix(&toks(0..8), &a);
    let seq = kv.add_sequence(&CacheKey::new().with_salt("b"));
    assert_eq!(
        kv.allocate_slots(seq, &[], Some(&hit)),
        Err(KvError::HitKeyMismatch { seq })
    );
}

#[test]
fn early_reuse_attaches_to_pending_blocks_and_waits() {
    let mut kv = manager(32);
    let key = CacheKey::new();
    let prompt = toks(0..12);
    let writer = kv.add_sequence(&key);
    kv.allocate_slots(writer, &prompt, None).unwrap().unwrap();
    // Not computed yet, but already in the index.
    let reader = kv.add_sequence(&key);
    let hit = kv.find_cached_prefix(&prompt[..11], &key);
    assert_eq!(hit.num_full_blocks(), 2);
    assert_eq!(hit.num_pending_blocks(), 2);
    kv.allocate_slots(reader, &prompt[8..], Some(&hit))
        .unwrap()
        .unwrap();
    let st = kv.pending_status(reader).unwrap();
    assert_eq!(
        (st.computed_tokens, st.computable_tokens, st.waiting_blocks),
        (0, 0, 2)
    );
    assert_eq!(kv.stats().pending_waits, 2);
    // The writer computes its first block: the reader advances but still waits for the second.
    kv.mark_computed(writer, 4).unwrap();
    let st = kv.pending_status(reader).unwrap();
    assert_eq!((st.computed_tokens, st.waiting_blocks), (4, 1));
    assert_eq!(
        kv.mark_computed(reader, 12),
        Err(KvError::NotWriter {
            seq: reader,
            block: kv.block_table(reader).unwrap()[1]
        })
    );
    kv.mark_computed(writer, 12).unwrap();
    let st = kv.pending_status(reader).unwrap();
    assert_eq!(
        (st.computed_tokens, st.computable_tokens, st.waiting_blocks),
        (8, 12, 0)
    );
    kv.mark_computed(reader, 12).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn a_cancelled_writer_withdraws_and_the_waiter_computes() {
    let mut kv = manager(32);
    let key = CacheKey::new();
    let prompt = toks(0..12);
    let writer = kv.add_sequence(&key);
    kv.allocate_slots(writer, &prompt, None).unwrap().unwrap();
    kv.mark_computed(writer, 4).unwrap();
    let reader = kv.add_sequence(&key);
    let hit = kv.find_cached_prefix(&prompt, &key);
    assert_eq!((hit.num_full_blocks(), hit.num_pending_blocks()), (3, 2));
    kv.allocate_slots(reader, &[], Some(&hit)).unwrap().unwrap();
    kv.free(writer).unwrap();
    assert_eq!(kv.stats().withdrawn_blocks, 2);
    kv.check_invariants().unwrap();
    let st = kv.pending_status(reader).unwrap();
    assert_eq!(
        (st.computed_tokens, st.computable_tokens, st.waiting_blocks),
        (4, 12, 0),
        "the waiter is told to compute the withdrawn blocks"
    );
    kv.mark_computed(reader, 12).unwrap();
    kv.free(reader).unwrap();
    assert_eq!(kv.find_cached_prefix(&prompt, &key).num_full_blocks(), 3);
    kv.check_invariants().unwrap();
}

#[test]
fn an_abandoned_pending_block_is_dropped_not_cached() {
    let mut kv = manager(8);
    let key = CacheKey::new();
    let seq = kv.add_sequence(&key);
    kv.allocate_slots(seq, &toks(0..8), None).unwrap().unwrap();
    kv.mark_computed(seq, 4).unwrap();
    kv.free(seq).unwrap();
    let hit = kv.find_cached_prefix(&toks(0..8), &key);
    assert_eq!(
        hit.num_full_blocks(),
        1,
        "only the computed block stays cached"
    );
    assert_eq!(kv.usage().free_blocks, 7);
    kv.check_invariants().unwrap();
}

#[test]
fn fork_shares_blocks_and_copies_the_partial_last_block_on_write() {
    let mut kv = manager(16);
    let key = CacheKey::new();
    let parent = run(&mut kv, &key, &toks(0..6), false);
    let child = kv.fork(parent).unwrap();
    assert_eq!(
        kv.block_table(child).unwrap(),
        kv.block_table(parent).unwrap()
    );
    let shared_last = kv.block_table(parent).unwrap()[1];
    let alloc = kv.allocate_slots(child, &[50], None).unwrap().unwrap();
    let child_last = kv.block_table(child).unwrap()[1];
    assert_eq!(
        alloc.copies,
        vec![BlockCopy {
            src: shared_last,
            dst: child_last,
            num_tokens: 2
        }]
    );
    assert_eq!(kv.block_table(parent).unwrap()[1], shared_last);
    // The parent now holds its last block alone: it appends in place, no copy.
    let alloc = kv.allocate_slots(parent, &[60], None).unwrap().unwrap();
    assert!(alloc.copies.is_empty());
    assert_eq!(kv.block_table(parent).unwrap()[1], shared_last);
    kv.check_invariants().unwrap();
    kv.mark_computed(child, 7).unwrap();
    kv.mark_computed(parent, 7).unwrap();
    kv.free(parent).unwrap();
    kv.free(child).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.usage().used_blocks, 0);
}

#[test]
fn fork_of_an_uncomputed_sequence_is_refused() {
    let mut kv = manager(16);
    let seq = kv.add_sequence(&CacheKey::new());
    kv.allocate_slots(seq, &toks(0..6), None).unwrap().unwrap();
    assert_eq!(
        kv.fork(seq),
        Err(KvError::ForkUncomputed { seq, uncomputed: 6 })
    );
}

/// Builds two branches under a shared 2-block prefix and frees them (branch b last), in a 6-block pool:
/// prefix [p0 p1], branch a [a2], branch b [b2].
fn two_branches(kv: &mut KvCacheManager, key: &CacheKey) -> (Vec<u32>, Vec<u32>) {
    let mut a = toks(0..8);
    a.extend(100..104);
    let mut b = toks(0..8);
    b.extend(200..204);
    run(kv, key, &a, true);
    run(kv, key, &b, true);
    (a, b)
}

#[test]
fn leaf_first_eviction_keeps_every_cached_block_reachable() {
    let mut kv = manager(6);
    let key = CacheKey::new();
    let (a, b) = two_branches(&mut kv, &key);
    assert_eq!(kv.usage().cached_idle_blocks, 4);
    // Needs 3 blocks: 2 free + 1 eviction. The prefix is older than nothing: only leaves go, LRU first (a).
    run(&mut kv, &key, &toks(500..512), true);
    assert_eq!(kv.stats().evictions, 1);
    assert_eq!(kv.find_cached_prefix(&a, &key).num_full_blocks(), 2);
    assert_eq!(kv.find_cached_prefix(&b, &key).num_full_blocks(), 3);
    // Every cached block is still reachable: cached blocks == blocks a lookup can find.
    kv.check_invariants().unwrap();
}

/// A retained child under a default-priority parent: plain LRU evicts the parent and strands the child
/// (cached, unreachable); leaf-first eviction takes another block and keeps the prefix whole.
#[test]
fn plain_lru_strands_children_and_leaf_first_does_not() {
    for policy in [EvictionPolicy::PlainLru, EvictionPolicy::LeafLru] {
        let mut kv = manager_with(3, |c| c.eviction_policy = policy);
        let key = CacheKey::new();
        let seq = kv.add_sequence(&key);
        let retained = RetentionRange {
            start: 4,
            end: 8,
            priority: 80,
            duration_ms: None,
        };
        kv.set_retention(seq, &[retained]).unwrap();
        kv.allocate_slots(seq, &toks(0..8), None).unwrap().unwrap();
        kv.mark_computed(seq, 8).unwrap();
        kv.free(seq).unwrap();
        run(&mut kv, &key, &toks(100..104), true);
        run(&mut kv, &key, &toks(200..204), true); // one eviction
        assert_eq!(kv.stats().evictions, 1);
        let hit = kv.find_cached_prefix(&toks(0..8), &key).num_full_blocks();
        match policy {
            EvictionPolicy::PlainLru => {
                assert_eq!(hit, 0, "the root went first");
                assert_eq!(
                    kv.num_indexed_blocks(),
                    3,
                    "its child is still cached, unreachable"
                );
            }
            EvictionPolicy::LeafLru => {
                assert_eq!(hit, 2);
                assert_eq!(
                    kv.find_cached_prefix(&toks(100..104), &key)
                        .num_full_blocks(),
                    0
                );
            }
        }
        kv.check_invariants().unwrap();
    }
}

#[test]
fn lru_order_follows_the_logical_clock() {
    let mut kv = manager(4);
    let key = CacheKey::new();
    run(&mut kv, &key, &toks(0..4), true);
    run(&mut kv, &key, &toks(10..14), true);
    run(&mut kv, &key, &toks(0..4), true); // touches the first again
    run(&mut kv, &key, &toks(20..32), true); // 3 blocks: 2 free, 1 evicted: the older of the two
    assert_eq!(
        kv.find_cached_prefix(&toks(0..4), &key).num_full_blocks(),
        1
    );
    assert_eq!(
        kv.find_cached_prefix(&toks(10..14), &key).num_full_blocks(),
        0
    );
}

#[test]
fn retention_outlives_lru_until_it_expires() {
    let mut kv = manager(3);
    let key = CacheKey::new();
    let kept = kv.add_sequence(&key);
    kv.set_retention(
        kept,
        &[RetentionRange {
            start: 0,
            end: 4,
            priority: 80,
            duration_ms: Some(1000),
        }],
    )
    .unwrap();
    kv.allocate_slots(kept, &toks(0..4), None).unwrap().unwrap();
    kv.mark_computed(kept, 4).unwrap();
    kv.free(kept).unwrap();
    run(&mut kv, &key, &toks(10..14), true);
    run(&mut kv, &key, &toks(20..28), true); // needs 2: 1 free, 1 evicted: the newer, unretained block
    assert_eq!(
        kv.find_cached_prefix(&toks(0..4), &key).num_full_blocks(),
        1
    );
    assert_eq!(
        kv.find_cached_prefix(&toks(10..14), &key).num_full_blocks(),
        0
    );
    kv.set_time_ms(1000); // retention over: back to plain LRU, and it is the oldest
    run(&mut kv, &key, &toks(30..34), true);
    assert_eq!(
        kv.find_cached_prefix(&toks(0..4), &key).num_full_blocks(),
        0
    );
    kv.check_invariants().unwrap();
}

#[test]
fn a_bad_retention_range_is_refused() {
    let mut kv = manager(3);
    let seq = kv.add_sequence(&CacheKey::new());
    let bad = RetentionRange {
        start: 4,
        end: 4,
        priority: 50,
        duration_ms: None,
    };
    assert!(matches!(
        kv.set_retention(seq, &[bad]),
        Err(KvError::BadRetention { .. })
    ));
}

#[test]
fn pinned_prefixes_survive_pressure_until_unpinned_or_expired() {
    let mut kv = manager(4);
    let key = CacheKey::new();
    run(&mut kv, &key, &toks(0..8), true);
    let (pin, pinned) = kv.pin_prefix(&toks(0..8), &key, None);
    assert_eq!(pinned, 8);
    assert_eq!(kv.usage().pinned_idle_blocks, 2);
    kv.check_invariants().unwrap();
    let seq = kv.add_sequence(&key);
    assert_eq!(
        kv.allocate_slots(seq, &toks(50..62), None),
        Ok(None),
        "only 2 blocks reclaimable"
    );
    kv.unpin(pin).unwrap();
    assert_eq!(kv.unpin(pin), Err(KvError::UnknownPin(0)));
    assert!(kv
        .allocate_slots(seq, &toks(50..62), None)
        .unwrap()
        .is_some());
    kv.free(seq).unwrap();
    // With a time to live.
    run(&mut kv, &key, &toks(0..4), true);
    let (_, pinned) = kv.pin_prefix(&toks(0..4), &key, Some(50));
    assert_eq!(pinned, 4);
    assert_eq!(kv.num_available_blocks(), 3);
    kv.set_time_ms(50);
    assert_eq!(kv.num_available_blocks(), 4);
    kv.check_invariants().unwrap();
}

#[test]
fn out_of_blocks_is_a_value_and_changes_nothing() {
    let mut kv = manager(4);
    let key = CacheKey::new();
    run(&mut kv, &key, &toks(0..8), true);
    let before = (kv.usage(), kv.stats().clone());
    let seq = kv.add_sequence(&key);
    assert_eq!(kv.allocate_slots(seq, &toks(100..120), None), Ok(None));
    assert_eq!((kv.usage(), kv.stats().clone()), before);
    assert_eq!(kv.num_tokens(seq).unwrap(), 0);
    kv.check_invariants().unwrap();
}

/// (block, tokens, has a parent) of each evicted block.
type Seen = Arc<Mutex<Vec<(u32, Vec<u32>, bool)>>>;

struct Recorder(Seen);

impl EvictionHook for Recorder {
    fn on_evict(&mut self, block: &EvictedBlock<'_>) {
        self.0.lock().unwrap().push((
            block.block,
            block.tokens.to_vec(),
            block.parent_hash.is_some(),
        ));
    }
}

#[test]
fn the_eviction_hook_sees_each_evicted_block_with_its_tokens() {
    let mut kv = manager(2);
    let seen = Arc::new(Mutex::new(Vec::new()));
    kv.set_eviction_hook(Box::new(Recorder(seen.clone())));
    let key = CacheKey::new();
    run(&mut kv, &key, &toks(0..8), true);
    run(&mut kv, &key, &toks(10..18), true);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].1, toks(4..8), "the leaf first");
    assert!(seen[0].2);
    assert_eq!(seen[1].1, toks(0..4));
    assert!(!seen[1].2, "a root has no parent hash");
}

#[test]
fn a_swapped_out_sequence_is_stored_in_the_order_the_pool_reuses_its_blocks() {
    // An executor copies stores in order on a stream of its own (the GPU's), and work that writes a
    // block waits for its store and every store before it: the block the pool hands on first must be
    // the one stored first, or the first step after a swap-out waits for the whole sequence's copies.
    let mut kv = manager_with_host(4, 8);
    let key = CacheKey::new();
    let seq = run(&mut kv, &key, &toks(0..16), false);
    let table = kv.block_table(seq).unwrap().to_vec();
    assert_eq!(kv.swap_out(seq).unwrap(), 4);
    let stored = stored_blocks(&mut kv);
    kv.free(seq).unwrap();
    // Another prompt takes the pool's blocks one at a time, as decode steps do.
    let other = kv.add_sequence(&CacheKey::new().with_salt("other"));
    let mut taken = Vec::new();
    for i in 0..4u32 {
        kv.allocate_slots(other, &toks(100 + 4 * i..104 + 4 * i), None)
            .unwrap()
            .expect("the swapped-out blocks are evictable");
        taken.push(*kv.block_table(other).unwrap().last().unwrap());
        kv.mark_computed(other, 4 * (i as usize + 1)).unwrap();
        // Evicted blocks already in the host tier are not stored again.
        assert_eq!(kv.drain_tier_moves().count(), 0);
        kv.check_invariants().unwrap();
    }
    assert_eq!(taken, stored, "reused in the order they were stored");
    let tail_first: Vec<u32> = table.iter().rev().copied().collect();
    assert_eq!(stored, tail_first);
}

#[test]
fn stored_ahead_blocks_are_evicted_without_a_copy() {
    // An executor whose stores run beside its steps (a GPU's) holds back a step that writes a block
    // until that block's store has landed: blocks stored ahead of their eviction spare it the wait.
    let mut kv = manager_with_host(8, 16);
    let key = CacheKey::new();
    let older = run(&mut kv, &key, &toks(0..16), false);
    let older_table = kv.block_table(older).unwrap().to_vec();
    kv.free(older).unwrap();
    let newer = run(&mut kv, &key, &toks(100..112), false);
    let newer_table = kv.block_table(newer).unwrap().to_vec();
    kv.free(newer).unwrap();
    assert_eq!(kv.usage().free_blocks, 1);
    assert_eq!(kv.store_ahead(1), 0, "enough blocks free: nothing to do");
    assert_eq!(kv.drain_tier_moves().count(), 0);
    // Four more evictions to keep clean: the older sequence's chain, tail first, as leaf-first
    // eviction will take it.
    assert_eq!(kv.store_ahead(5), 4);
    let stored = stored_blocks(&mut kv);
    let tail_first: Vec<u32> = older_table.iter().rev().copied().collect();
    assert_eq!(stored, tail_first);
    assert_eq!(kv.stats().host_stored_ahead, 4);
    assert_eq!(kv.store_ahead(5), 0, "held already: not stored again");
    assert_eq!(kv.drain_tier_moves().count(), 0);
    kv.check_invariants().unwrap();
    // The blocks stay cached in the pool until they are needed.
    let hit = kv.find_cached_prefix(&toks(0..16), &key);
    assert_eq!(hit.num_full_blocks(), 4);
    // A prompt of five blocks takes the free one and evicts the four stored ahead: no copy.
    let taker = kv.add_sequence(&CacheKey::new().with_salt("other"));
    kv.allocate_slots(taker, &toks(200..220), None)
        .unwrap()
        .expect("the idle blocks are evictable");
    assert_eq!(kv.stats().evictions, 4);
    assert_eq!(
        kv.drain_tier_moves().count(),
        0,
        "evicted blocks were stored"
    );
    assert_eq!(kv.stats().evictions_copied, 0);
    kv.mark_computed(taker, 20).unwrap();
    kv.check_invariants().unwrap();
    // Nothing free now: the newer sequence's chain is next.
    assert_eq!(kv.store_ahead(8), 3);
    let stored = stored_blocks(&mut kv);
    assert_eq!(
        stored,
        newer_table.iter().rev().copied().collect::<Vec<_>>()
    );
    // And the older prompt comes back from the host tier.
    let hit = kv.find_cached_prefix(&toks(0..16), &key);
    assert_eq!(hit.num_cached_tokens(), 16);
    assert_eq!(hit.num_full_blocks(), 0, "not in the pool any more");
}

#[test]
fn an_eviction_that_copies_its_block_down_is_counted() {
    let mut kv = manager_with_host(2, 8);
    let key = CacheKey::new();
    run(&mut kv, &key, &toks(0..8), true);
    run(&mut kv, &key, &toks(10..18), true);
    assert_eq!(kv.drain_tier_moves().count(), 2);
    assert_eq!((kv.stats().evictions, kv.stats().evictions_copied), (2, 2));
    // Stored ahead, the next two are evicted without a copy.
    assert_eq!(kv.store_ahead(2), 2);
    assert_eq!(kv.drain_tier_moves().count(), 2);
    run(&mut kv, &key, &toks(20..28), true);
    assert_eq!(kv.drain_tier_moves().count(), 0);
    assert_eq!((kv.stats().evictions, kv.stats().evictions_copied), (4, 2));
}

#[test]
fn store_ahead_needs_a_host_tier() {
    let mut kv = manager(2);
    let key = CacheKey::new();
    run(&mut kv, &key, &toks(0..8), true);
    assert_eq!(kv.store_ahead(2), 0);
    assert_eq!(kv.drain_tier_moves().count(), 0);
}

#[test]
fn events_announce_stored_removed_and_cleared() {
    let mut kv = manager(2);
    let key = CacheKey::new();
    run(&mut kv, &key, &toks(0..8), true);
    let stored: Vec<_> = kv.drain_events().collect();
    let [KvEvent::Stored {
        hash: h0,
        parent: None,
        ..
    }, KvEvent::Stored {
        parent: Some(p1),
        hash: h1,
        ..
    }] = stored[..]
    else {
        panic!("unexpected events {stored:?}")
    };
    assert_eq!(p1, h0);
    // Each block names its tokens; a root carries its key (for a keyed content name, never published).
    let KvEvent::Stored {
        tokens,
        key: root_key,
        ..
    } = &stored[0]
    else {
        unreachable!()
    };
    assert_eq!(
        (tokens.as_slice(), root_key.as_ref()),
        (&toks(0..4)[..], Some(&key))
    );
    assert!(
        matches!(&stored[1], KvEvent::Stored { tokens, key: None, .. } if tokens[..] == toks(4..8)[..])
    );
    run(&mut kv, &key, &toks(10..14), true);
    let removed: Vec<_> = kv.drain_events().collect();
    assert!(matches!(removed[0], KvEvent::Removed { hash, .. } if hash == h1));
    assert_eq!(kv.clear_cache(), 2);
    assert_eq!(
        kv.drain_events().collect::<Vec<_>>(),
        vec![KvEvent::Cleared]
    );
    assert_eq!(kv.num_indexed_blocks(), 0);
    kv.check_invariants().unwrap();
}

#[test]
fn without_prefix_caching_nothing_is_indexed_or_hit() {
    let mut kv = manager_with(16, |c| c.enable_prefix_caching = false);
    let key = CacheKey::new();
    run(&mut kv, &key, &toks(0..8), true);
    assert_eq!(kv.num_indexed_blocks(), 0);
    assert_eq!(
        kv.find_cached_prefix(&toks(0..8), &key).num_cached_tokens(),
        0
    );
    assert_eq!(kv.usage().free_blocks, 16);
    // The admitted prompt counts; the lookup that no allocation followed does not.
    assert_eq!(kv.stats().prefix_query_tokens, 8);
}

#[test]
fn a_stale_hit_is_refused() {
    let mut kv = manager(2);
    let key = CacheKey::new();
    run(&mut kv, &key, &toks(0..8), true);
    let hit = kv.find_cached_prefix(&toks(0..8), &key);
    run(&mut kv, &key, &toks(10..18), true); // evicts both
    let seq = kv.add_sequence(&key);
    assert!(matches!(
        kv.allocate_slots(seq, &[], Some(&hit)),
        Err(KvError::StaleHit { .. })
    ));
}

#[test]
fn freed_sequences_and_bad_arguments_are_typed_errors() {
    let mut kv = manager(4);
    let seq = kv.add_sequence(&CacheKey::new());
    kv.allocate_slots(seq, &[1, 2], None).unwrap().unwrap();
    assert_eq!(
        kv.mark_computed(seq, 3),
        Err(KvError::ComputedBeyondEnd {
            seq,
            upto: 3,
            num_tokens: 2
        })
    );
    kv.free(seq).unwrap();
    assert_eq!(kv.free(seq), Err(KvError::UnknownSequence(seq)));
    assert!(kv.block_table(seq).is_err());
    assert!(KvCacheManager::new(KvCacheConfig::new(4, 0)).is_err());
    assert!(KvCacheManager::new(KvCacheConfig::new(4, 1025)).is_err());
    assert!(KvCacheManager::new(KvCacheConfig::new(0, 16)).is_err());
}

#[test]
fn counters_and_usage_add_up() {
    let mut kv = manager(8);
    let key = CacheKey::new();
    run(&mut kv, &key, &toks(0..10), true);
    let seq = run(&mut kv, &key, &toks(0..10), false);
    let s = kv.stats().clone();
    assert_eq!(s.prefix_query_tokens, 20);
    assert_eq!(s.prefix_hit_tokens, 8);
    assert_eq!((s.prefix_query_blocks, s.prefix_hit_blocks), (4, 2));
    // A lookup whose allocation fails (no room) is work, not an admission.
    let big = kv.add_sequence(&key);
    let hit = kv.find_cached_prefix(&toks(0..40), &key);
    assert_eq!(kv.allocate_slots(big, &toks(8..40), Some(&hit)), Ok(None));
    kv.free(big).unwrap();
    let after = kv.stats();
    assert_eq!(after.prefix_query_tokens, s.prefix_query_tokens);
    assert_eq!(after.prefix_hit_tokens, s.prefix_hit_tokens);
    assert_eq!(after.lookup_blocks, s.lookup_blocks + 10);
    let u = kv.usage();
    assert_eq!(
        (u.used_blocks, u.cached_idle_blocks, u.free_blocks),
        (3, 0, 5)
    );
    kv.free(seq).unwrap();
    assert_eq!(kv.num_cache_keys(), 1, "the key stays while blocks use it");
    kv.clear_cache();
    assert_eq!(kv.num_cache_keys(), 0, "and goes with them");
}

#[test]
fn decode_tokens_fill_and_index_blocks() {
    let mut kv = manager(8);
    let key = CacheKey::new();
    let seq = run(&mut kv, &key, &toks(0..3), false);
    for (i, t) in (3..9u32).enumerate() {
        kv.allocate_slots(seq, &[t], None).unwrap().unwrap();
        kv.mark_computed(seq, 4 + i).unwrap();
    }
    kv.free(seq).unwrap();
    assert_eq!(
        kv.find_cached_prefix(&toks(0..9), &key).num_full_blocks(),
        2
    );
    kv.check_invariants().unwrap();
}

#[test]
fn a_pending_block_is_never_a_copy_source() {
    let mut kv = manager(16);
    let key = CacheKey::new();
    let writer = kv.add_sequence(&key);
    kv.allocate_slots(writer, &toks(0..8), None)
        .unwrap()
        .unwrap();
    kv.mark_computed(writer, 4).unwrap(); // block 1 still pending
    let mut prompt = toks(0..6);
    prompt.push(99);
    let hit = kv.find_cached_prefix(&prompt, &key);
    assert_eq!(
        (hit.num_full_blocks(), hit.partial_tokens()),
        (1, 0),
        "no copy of bytes not yet written"
    );
    kv.mark_computed(writer, 8).unwrap();
    let hit = kv.find_cached_prefix(&prompt, &key);
    assert_eq!((hit.num_full_blocks(), hit.partial_tokens()), (1, 2));
}

#[test]
fn a_sequence_with_caching_off_enters_nothing_new_in_the_index() {
    let mut kv = manager(16);
    let key = CacheKey::new();
    let seq = kv.add_sequence(&key);
    kv.allocate_slots(seq, &toks(0..4), None).unwrap().unwrap();
    kv.set_caching(seq, false).unwrap();
    kv.allocate_slots(seq, &toks(4..12), None).unwrap().unwrap();
    kv.mark_computed(seq, 12).unwrap();
    kv.free(seq).unwrap();
    assert_eq!(kv.num_indexed_blocks(), 1);
    assert_eq!(
        kv.find_cached_prefix(&toks(0..12), &key).num_full_blocks(),
        1
    );
    assert_eq!(kv.usage().free_blocks, 15);
    kv.check_invariants().unwrap();
}

/// A hybrid pool (one full layer, one sliding layer with a window of 8 tokens: 3 blocks of 4) under
/// pressure drops the window parts no likely hit needs first — those in the middle of a chain — and keeps
/// the first window (a short shared prefix) and the window before the chain's end (a continued
/// conversation); no whole block is evicted while such parts remain. Lookups are cut back to what the
/// next token's window finds.
/// A hybrid pool of 48 pages (one full and one sliding layer, a window of 8 tokens) holding a cached
/// chain of 80 tokens (20 blocks), computed in one step so that every block's window part is attached.
fn hybrid_pool_with_a_chain() -> (KvCacheManager, CacheKey, Vec<u32>) {
    let mut kv = manager_with(0, |c| {
        let pool = kura_kv::WindowPool {
            sliding: vec![false, true],
            window_tokens: 8,
            num_pages: 48,
        };
        c.num_blocks = pool.logical_blocks();
        c.window = Some(pool);
    });
    let key = CacheKey::new();
    let chain: Vec<u32> = (0..80).collect();
    let a = kv.add_sequence(&key);
    kv.allocate_slots(a, &chain, None).unwrap().unwrap();
    assert!(kv.prepare_window(a, 0, 80).unwrap());
    kv.mark_computed(a, 80).unwrap();
    kv.free(a).unwrap();
    kv.check_invariants().unwrap();
    (kv, key, chain)
}

#[test]
fn a_hybrid_pool_drops_the_window_parts_no_hit_needs_first() {
    let (mut kv, key, chain) = hybrid_pool_with_a_chain();
    assert_eq!(kv.page_usage(), Some((48, 8, 20)));

    // Another prompt of 6 blocks needs 12 pages; 8 are free, so 4 idle window parts go.
    let other: Vec<u32> = (1000..1024).collect();
    let b = kv.add_sequence(&key);
    kv.allocate_slots(b, &other, None).unwrap().unwrap();
    assert!(kv.prepare_window(b, 0, 24).unwrap());
    kv.mark_computed(b, 24).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.stats().window_part_drops, 4);
    assert_eq!(
        kv.stats().evictions,
        0,
        "a whole block went while window parts could"
    );

    // The chain's end still hits in full: its last window kept its parts.
    let hit = kv.find_cached_prefix(&chain[..79], &key);
    assert_eq!(hit.num_full_blocks(), 19);
    // A short prefix (inside the first window) still hits.
    let mut short = chain[..8].to_vec();
    short.extend([5000, 5001, 5002]);
    assert_eq!(kv.find_cached_prefix(&short, &key).num_full_blocks(), 2);
    // A prefix ending in the middle, where parts were dropped, is cut back to the first window.
    let mut middle = chain[..28].to_vec();
    middle.extend([6000, 6001, 6002]);
    let hit = kv.find_cached_prefix(&middle, &key);
    assert_eq!(hit.num_full_blocks(), 3);
    assert_eq!(
        kv.reference_lookup(&middle, &key).full_blocks,
        3,
        "the brute-force lookup applies the same window rule"
    );
    kv.free(b).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn a_pinned_prefix_keeps_its_window_parts_on_a_hybrid_pool() {
    let (mut kv, key, chain) = hybrid_pool_with_a_chain();
    let (pin, pinned) = kv.pin_prefix(&chain[..40], &key, None);
    assert_eq!(pinned, 40);
    kv.check_invariants().unwrap();

    // Other prompts, computed a block at a time, take every page they can get.
    for round in 0..3u32 {
        let other: Vec<u32> = (0..40).map(|t| 1000 * (round + 1) + t).collect();
        let s = kv.add_sequence(&key);
        for end in (4..=40).step_by(4) {
            if kv.allocate_slots(s, &other[..end], None).unwrap().is_none()
                || !kv.prepare_window(s, end - 4, end).unwrap()
            {
                break;
            }
            kv.mark_computed(s, end).unwrap();
        }
        kv.free(s).unwrap();
        kv.check_invariants().unwrap();
    }
    assert!(
        kv.stats().window_part_drops >= 10,
        "the pressure reached the window parts: {} dropped",
        kv.stats().window_part_drops
    );

    // The pinned prefix still hits in full: its last window kept its parts.
    let mut next = chain[..40].to_vec();
    next.extend([7000, 7001]);
    assert_eq!(kv.find_cached_prefix(&next, &key).num_full_blocks(), 10);
    kv.unpin(pin).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn adopted_blocks_become_cached_hits_without_counting_an_admission() {
    let mut kv = manager(8);
    let key = CacheKey::new().with_salt("t");
    let doc = toks(0..16); // 4 blocks
    run(&mut kv, &key, &doc[..8], true);
    kv.drain_events().for_each(drop);
    assert_eq!(kv.held_prefix_blocks(&doc, &key), 2);
    let before = kv.stats().clone();
    let (seq, fresh) = kv
        .begin_adoption(&doc, &key, 2)
        .unwrap()
        .expect("room for 2 blocks");
    assert_eq!(fresh.len(), 2);
    kv.finish_adoption(seq).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.stats().prefix_query_tokens, before.prefix_query_tokens);
    assert_eq!(kv.stats().prefix_hit_tokens, before.prefix_hit_tokens);
    // The adopted blocks are announced and hit like blocks computed here.
    let stored: Vec<_> = kv.drain_events().collect();
    assert_eq!(stored.len(), 2);
    assert!(matches!(&stored[0], KvEvent::Stored { block, .. } if *block == fresh[0]));
    assert_eq!(kv.held_prefix_blocks(&doc, &key), 4);
    let mut prompt = doc.clone();
    prompt.push(99);
    assert_eq!(
        kv.find_cached_prefix(&prompt[..16], &key)
            .num_cached_tokens(),
        16
    );
    // Nothing to adopt when the pool's part is not what the caller saw.
    assert!(kv.begin_adoption(&doc, &key, 1).unwrap().is_none());
    assert!(kv.begin_adoption(&doc, &key, 4).unwrap().is_none());
    kv.check_invariants().unwrap();
}

#[test]
fn blocks_are_adoptable_only_after_a_computed_prefix_in_the_pool() {
    let key = CacheKey::new().with_salt("t");
    let doc = toks(0..16); // 4 blocks
    let mut kv = manager_with_host(4, 16);
    // Being computed: held (a lookup elsewhere need not bring them), but nothing can be adopted after
    // them until they are computed.
    let seq = kv.add_sequence(&key);
    kv.allocate_slots(seq, &doc[..8], None)
        .unwrap()
        .expect("room");
    assert_eq!(kv.held_prefix_blocks(&doc, &key), 2);
    assert_eq!(kv.adoptable_prefix_blocks(&doc, &key), None, "pending");
    assert!(kv.begin_adoption(&doc, &key, 2).unwrap().is_none());
    kv.mark_computed(seq, 8).unwrap();
    assert_eq!(kv.adoptable_prefix_blocks(&doc, &key), Some(2));
    kv.free(seq).unwrap();
    kv.drain_tier_moves().for_each(drop);
    // Pushed out of the pool into the host tier: held there, and again nothing adoptable after them.
    for s in 1..3u32 {
        run(&mut kv, &key, &toks(100 * s..100 * s + 16), true);
        kv.drain_tier_moves().for_each(drop);
    }
    assert_eq!(kv.held_prefix_blocks(&doc, &key), 2);
    assert_eq!(
        kv.adoptable_prefix_blocks(&doc, &key),
        None,
        "in the host tier"
    );
    assert!(kv.begin_adoption(&doc, &key, 2).unwrap().is_none());
    // Nothing held: adoptable from the first block.
    assert_eq!(kv.adoptable_prefix_blocks(&toks(500..516), &key), Some(0));
    kv.check_invariants().unwrap();
}

#[test]
fn the_pool_lists_its_cached_prefixes_largest_first() {
    let mut kv = manager(32);
    let (a, b) = (
        CacheKey::new().with_salt("a"),
        CacheKey::new().with_salt("b"),
    );
    // A system prompt of 2 blocks, two conversations after it (4 and 3 blocks), and another tenant's
    // prompt of 1 block.
    let system = toks(0..8);
    let long = [system.clone(), toks(100..108)].concat();
    let short = [system.clone(), toks(200..204)].concat();
    run(&mut kv, &a, &long, true);
    run(&mut kv, &a, &short, true);
    run(&mut kv, &b, &toks(0..4), true);
    // Reuse the long one twice: its leaf and its root are hit.
    for _ in 0..2 {
        run(&mut kv, &a, &[long.clone(), vec![999]].concat(), true);
    }
    let held = run(&mut kv, &a, &short, false);
    let (pin, _) = kv.pin_prefix(&system, &a, None);
    let (chains, total) = kv.prefix_chains(10);
    // The held sequence's own last block is not indexed until computed: what it shares is.
    assert!(total >= 3, "{chains:?}");
    let sizes: Vec<usize> = chains.iter().map(|c| c.blocks).collect();
    let mut sorted = sizes.clone();
    sorted.sort_by(|x, y| y.cmp(x));
    assert_eq!(sizes, sorted);
    let first = &chains[0];
    assert_eq!(first.blocks, 4);
    assert_eq!(first.key.salt(), Some("a"));
    assert_eq!(first.leaf_hits, 2);
    assert!(first.root_hits >= 3, "{first:?}");
    assert_eq!(first.pinned_blocks, 2);
    let short_chain = chains
        .iter()
        .find(|c| c.blocks == 3)
        .expect("the short conversation");
    assert_eq!(short_chain.used_blocks, 3);
    assert_eq!(short_chain.idle_ticks, None);
    let other = chains
        .iter()
        .find(|c| c.key.salt() == Some("b"))
        .expect("tenant b");
    assert_eq!(
        (other.blocks, other.pinned_blocks, other.used_blocks),
        (1, 0, 0)
    );
    assert!(other.idle_ticks.is_some_and(|t| t > 0));
    // At most `limit`.
    assert_eq!(kv.prefix_chains(1).0.len(), 1);
    kv.unpin(pin).unwrap();
    kv.free(held).unwrap();
    kv.check_invariants().unwrap();
}

/// A sequence of 6 computed tokens (`0..6`) holding a draft of 7 more (`[100, 107)`), computed: blocks
/// `|0 1 2 3|4 5 100 101|102 103 104 105|106 . . .|`.
fn with_computed_draft(kv: &mut KvCacheManager, key: &CacheKey) -> SeqId {
    let seq = run(kv, key, &toks(0..6), false);
    let indexed = kv.num_indexed_blocks();
    kv.allocate_draft_slots(seq, &toks(100..107))
        .unwrap()
        .expect("room for the draft");
    assert_eq!(kv.num_tokens(seq).unwrap(), 13);
    assert_eq!(kv.draft_from(seq).unwrap(), Some(6));
    kv.mark_computed(seq, 13).unwrap();
    // The two blocks the draft filled are not findable while it may be taken back.
    assert_eq!(kv.num_indexed_blocks(), indexed);
    let mut draft_prompt = toks(0..6);
    draft_prompt.extend(toks(100..107));
    assert_eq!(
        kv.find_cached_prefix(&draft_prompt, key).num_full_blocks(),
        1
    );
    kv.check_invariants().unwrap();
    seq
}

#[test]
fn a_settled_draft_keeps_its_accepted_tokens_and_indexes_only_their_blocks() {
    let mut kv = manager(16);
    let key = CacheKey::new();
    let seq = with_computed_draft(&mut kv, &key);
    let free_before = kv.num_available_blocks();
    // Keep 3 of the 7 draft tokens: |0 1 2 3|4 5 100 101|102 . . .|, the fourth block given back.
    kv.settle_draft(seq, 9).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_tokens(seq).unwrap(), 9);
    assert_eq!(kv.draft_from(seq).unwrap(), None);
    assert_eq!(kv.block_table(seq).unwrap().len(), 3);
    assert_eq!(kv.num_available_blocks(), free_before + 1);
    // The kept full block is found; the taken-back tokens are not, even where the block held them.
    let mut kept = toks(0..6);
    kept.extend(toks(100..103));
    assert_eq!(kv.find_cached_prefix(&kept, &key).num_full_blocks(), 2);
    let mut rejected = toks(0..6);
    rejected.extend(toks(100..107));
    rejected.push(7);
    assert_eq!(kv.find_cached_prefix(&rejected, &key).num_full_blocks(), 2);
    // The sequence goes on from its kept tokens: the cut block fills with the next ones and is indexed.
    kv.allocate_slots(seq, &[50, 51, 52], None)
        .unwrap()
        .expect("room");
    let status = kv.pending_status(seq).unwrap();
    assert_eq!((status.computed_tokens, status.computable_tokens), (9, 12));
    kv.mark_computed(seq, 12).unwrap();
    kv.free(seq).unwrap();
    kv.check_invariants().unwrap();
    let mut went_on = kept.clone();
    went_on.extend([50, 51, 52]);
    assert_eq!(kv.find_cached_prefix(&went_on, &key).num_full_blocks(), 3);
    let mut taken_back = kept;
    taken_back.extend([103, 104, 105]);
    assert_eq!(
        kv.find_cached_prefix(&taken_back, &key).num_full_blocks(),
        2
    );
}

#[test]
fn a_draft_taken_back_whole_or_kept_whole_leaves_the_cache_as_appending_would() {
    for keep in [6, 13] {
        let mut kv = manager(16);
        let key = CacheKey::new();
        let seq = with_computed_draft(&mut kv, &key);
        kv.settle_draft(seq, keep).unwrap();
        kv.check_invariants().unwrap();
        assert_eq!(kv.block_table(seq).unwrap().len(), keep.div_ceil(BS));
        kv.free(seq).unwrap();
        kv.check_invariants().unwrap();
        let mut all = toks(0..6);
        all.extend(toks(100..107));
        // Taken back whole: only the block before the draft; kept whole: the two it filled too.
        assert_eq!(
            kv.find_cached_prefix(&all, &key).num_full_blocks(),
            keep / BS
        );
        let announced = kv
            .drain_events()
            .filter(|e| matches!(e, KvEvent::Stored { .. }))
            .count();
        assert_eq!(announced, keep / BS, "keep {keep}");
    }
}

#[test]
fn drafts_are_refused_where_they_cannot_be_taken_back() {
    let mut kv = manager(16);
    let key = CacheKey::new();
    let seq = with_computed_draft(&mut kv, &key);
    assert!(matches!(
        kv.allocate_draft_slots(seq, &[1]),
        Err(KvError::Draft { .. })
    ));
    assert!(matches!(kv.fork(seq), Err(KvError::Draft { .. })));
    assert!(matches!(
        kv.settle_draft(seq, 5),
        Err(KvError::DraftKeep {
            keep: 5,
            from: 6,
            ..
        })
    ));
    assert!(matches!(
        kv.settle_draft(seq, 14),
        Err(KvError::DraftKeep { keep: 14, .. })
    ));
    kv.check_invariants().unwrap();
    // Out of room: nothing changes, and the sequence holds no draft.
    let mut small = manager(3);
    let seq = run(&mut small, &key, &toks(0..6), false);
    assert!(small
        .allocate_draft_slots(seq, &toks(100..107))
        .unwrap()
        .is_none());
    assert_eq!(small.draft_from(seq).unwrap(), None);
    assert_eq!(small.num_tokens(seq).unwrap(), 6);
    small.check_invariants().unwrap();
    // Freed while holding a draft: every block of it goes back.
    let mut kv = manager(16);
    let seq = with_computed_draft(&mut kv, &key);
    kv.free(seq).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_indexed_blocks(), 1);
    assert_eq!(kv.num_available_blocks(), 16);
}

#[test]
fn a_draft_settled_as_its_owners_tokens_keeps_the_tokens_drawn_in_place() {
    let mut kv = manager(16);
    let key = CacheKey::new();
    let seq = with_computed_draft(&mut kv, &key);
    // The owner drew 100 and 101 as drafted, then 999 where the draft said 102.
    let mut tokens = toks(0..6);
    tokens.extend([100, 101, 999]);
    assert_eq!(kv.settle_draft_as(seq, &tokens).unwrap(), 8);
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_tokens(seq).unwrap(), 8);
    // Both blocks full of drawn tokens are findable; a sequence without a draft is left as it is.
    assert_eq!(kv.find_cached_prefix(&tokens, &key).num_full_blocks(), 2);
    assert_eq!(kv.settle_draft_as(seq, &toks(0..3)).unwrap(), 8);
    // The tokens before the draft are always kept, even when the owner has fewer.
    let mut kv = manager(16);
    let seq = with_computed_draft(&mut kv, &key);
    assert_eq!(kv.settle_draft_as(seq, &toks(0..6)).unwrap(), 6);
    kv.check_invariants().unwrap();
}
