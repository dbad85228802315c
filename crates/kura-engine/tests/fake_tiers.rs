//! The lower KV tiers through the engine, on the fake model (whose output depends on every K/V slot it
//! reads back, and which panics on a slot never written): blocks evicted from the pool come back from the
//! host tier and from disk with the same tokens as computed cold; the disk tier survives a restart and
//! refuses another model's blocks; damaged files are recomputed; a prefix only on disk is read once for
//! any number of concurrent requests; swap preemption loads a preempted request's blocks back; the tier
//! cost check recomputes a prefix whose tier loads slower than the model prefills, and loads it otherwise;
//! a copy that fails at any tier (a device fault), even while the engine stops, ends the engine with
//! where it failed.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use common::*;
use kura_engine::{DiskSetup, EngineConfig, PreemptionMode, TierCostCheck, TierRates, TierSetup};

/// A fresh directory under the system temp dir, removed on drop.
struct TestDir(PathBuf);

impl TestDir {
    fn new(name: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!(
            "kura-engine-tiers-{}-{n}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        TestDir(p)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn with_tiers(num_blocks: usize, host_blocks: u32, disk: Option<(&TestDir, u128)>) -> EngineConfig {
    let mut c = config(num_blocks, 64, 8);
    c.tiers = TierSetup {
        host_blocks,
        disk: disk.map(|(dir, fingerprint)| DiskSetup {
            dir: dir.0.clone(),
            blocks: 1000,
            fingerprint,
        }),
        ..TierSetup::default()
    };
    c
}

fn run(e: &kura_engine::EngineHandle, r: kura_engine::GenerateRequest) -> (Vec<u32>, u32) {
    let (_guard, rx) = submit(e, r);
    let (tokens, usage) = wait(&rx);
    (tokens, usage.cached_tokens)
}

/// Tokens of five distinct 24-token prompts (6 blocks each, 30 in all) computed cold, one at a time.
fn cold_outputs() -> Vec<Vec<u32>> {
    let fake = start(config(64, 64, 8));
    let out = (0..5)
        .map(|s| run(&fake.engine, distinct_request(s, 24, 6)).0)
        .collect();
    fake.engine.stop();
    out
}

/// Runs the five prompts of [`cold_outputs`] one at a time, each giving its cold tokens.
fn run_the_five(e: &kura_engine::EngineHandle, cold: &[Vec<u32>]) {
    for s in 0..5 {
        let (tokens, _) = run(e, distinct_request(s, 24, 6));
        assert_eq!(tokens, cold[s as usize], "prompt {s}");
    }
}

fn tier_metric(e: &kura_engine::EngineHandle, name: &str, tier: &str) -> f64 {
    metric(e, &format!("{name}{{tier=\"{tier}\"}}"))
}

fn block_files(dir: &TestDir) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for fan in std::fs::read_dir(dir.0.join("blocks")).unwrap() {
        for f in std::fs::read_dir(fan.unwrap().path()).unwrap() {
            files.push(f.unwrap().path());
        }
    }
    files
}

#[test]
fn evicted_blocks_come_back_from_the_host_tier_with_the_same_tokens() {
    let cold = cold_outputs();
    // A pool of 12 blocks holds two prompts' blocks at most: the others are evicted into the host tier.
    let fake = start(with_tiers(12, 64, None));
    // The engine offered the executor the host tier's bytes, all 64 slots, before the first step (a
    // GPU executor pins them: its block copies then run at the bus's speed).
    assert_eq!(fake.control.host_region(), Some(64 * BLOCK * 5));
    run_the_five(&fake.engine, &cold);
    let forwards_before = fake.control.calls();
    for s in 0..5 {
        let (tokens, cached) = run(&fake.engine, distinct_request(s, 24, 6));
        assert_eq!(tokens, cold[s as usize], "prompt {s} from the tiers");
        // Every full block of the 23 tokens looked up: 5 blocks of 4.
        assert_eq!(cached, 20, "prompt {s}");
    }
    settle(&fake.engine);
    let e = &fake.engine;
    assert!(tier_metric(e, "kura:kv_tier_hit_blocks_total", "host") >= 15.0);
    assert_eq!(
        tier_metric(e, "kura:kv_tier_loads_total", "host"),
        tier_metric(e, "kura:kv_tier_hit_blocks_total", "host")
    );
    assert_eq!(
        tier_metric(e, "kura:kv_tier_load_failures_total", "host"),
        0.0
    );
    assert!(tier_metric(e, "kura:kv_tier_stores_total", "host") >= 15.0);
    // The bytes moved each way: a block's bytes a load or store.
    let block = (BLOCK * 5) as f64;
    assert_eq!(
        tier_metric(e, "kura:kv_tier_loaded_bytes_total", "host"),
        block * tier_metric(e, "kura:kv_tier_loads_total", "host")
    );
    assert_eq!(
        tier_metric(e, "kura:kv_tier_stored_bytes_total", "host"),
        block * tier_metric(e, "kura:kv_tier_stores_total", "host")
    );
    // Revisits computed only their last block's tokens: 6 decode steps plus a 4-token chunk each.
    assert!(fake.control.calls() - forwards_before <= 5 * 7);
    fake.engine.stop();
}

#[test]
fn a_failed_load_from_the_host_tier_ends_the_engine_instead_of_computing_over_the_block() {
    for started in [false, true] {
        // The same eviction as above; then every import fails (synchronous ones, and, where the
        // executor copies asynchronously, the start of one), as copies on a faulted device do.
        let fake = start(with_tiers(12, 64, None));
        if started {
            fake.control.async_imports();
        }
        let e = &fake.engine;
        for s in 0..5 {
            run(e, distinct_request(s, 24, 6));
        }
        settle(e);
        let forwards = fake.control.calls();
        fake.control.fail_imports();
        // Prompt 0's blocks are only in the host tier now.
        let (_g, rx) = submit(e, distinct_request(0, 24, 6));
        let out = outcome(&rx);
        let expected = "the executor failed at a load from the host tier: fake device fault in a \
                        block import";
        match &out.result {
            Err(kura_engine::RequestError::EngineFailed(reason)) => {
                assert_eq!(reason, expected, "started: {started}")
            }
            other => panic!("started: {started}: {other:?}"),
        }
        assert!(out.tokens.is_empty(), "started: {started}: {out:?}");
        // No step ran over the block that did not arrive.
        assert_eq!(fake.control.calls(), forwards, "started: {started}");
        assert_eq!(e.failure().as_deref(), Some(expected));
        e.stop();
    }
}

/// The five prompts one at a time, then prompt 0 again (from a lower tier), until a request fails:
/// it must fail with `expected` as the engine's failure, and the engine must have failed with it.
fn runs_until_the_engine_fails(fake: &Fake, expected: &str, case: &str) {
    let e = &fake.engine;
    for s in [0, 1, 2, 3, 4, 0] {
        if s == 0 && fake.control.calls() > 0 {
            settle(e);
        }
        // The engine may fail between two requests (storing blocks ahead of their eviction): the
        // next one is refused with the failure.
        let (tx, rx) = std::sync::mpsc::channel();
        let _g = match e.submit(distinct_request(s, 24, 6), move |ev| tx.send(ev).is_ok()) {
            Ok(g) => g,
            Err(kura_engine::SubmitError::EngineFailed(reason)) => {
                assert_eq!(reason, expected, "{case}: prompt {s} refused");
                assert!(!e.is_alive(), "{case}");
                return;
            }
            Err(other) => panic!("{case}: prompt {s} refused: {other:?}"),
        };
        match outcome(&rx).result {
            Ok(_) => continue,
            Err(kura_engine::RequestError::EngineFailed(reason)) => {
                assert_eq!(reason, expected, "{case}: prompt {s}");
                assert_eq!(e.failure().as_deref(), Some(expected), "{case}");
                assert!(!e.is_alive(), "{case}");
                return;
            }
            Err(other) => panic!("{case}: prompt {s}: {other:?}"),
        }
    }
    panic!("{case}: every request ran; the engine never called the failing copy");
}

#[test]
fn a_failed_store_or_load_at_each_tier_ends_the_engine_with_where_it_failed() {
    // Every executor call the tiers make besides the host tier's loads (the test above): each fails
    // from the start, as on a faulted device, and the first request that needs it fails with the
    // engine, whose failure names the tier, the direction and the executor's message.
    type Setup = fn(&Control);
    let cases: [(&str, u32, bool, Setup, Op, &str); 6] = [
        (
            "host store",
            64,
            false,
            |_| {},
            Op::Export,
            "a store into the host tier",
        ),
        (
            "host store started asynchronously",
            64,
            false,
            |c| c.async_exports(),
            Op::StartExport,
            "a store into the host tier",
        ),
        (
            "host stores' fence before a synchronous load",
            64,
            false,
            |c| c.async_exports(),
            Op::Fence,
            "a store into the host tier",
        ),
        (
            "host load reported asynchronously",
            64,
            false,
            |c| c.async_imports(),
            Op::ImportsDone,
            "a load from the host tier",
        ),
        (
            "disk store",
            0,
            true,
            |_| {},
            Op::Export,
            "a store into the disk tier",
        ),
        (
            "disk load",
            0,
            true,
            |_| {},
            Op::Import,
            "a load from the disk tier",
        ),
    ];
    for (case, host_blocks, disk, setup, op, at) in cases {
        let dir = TestDir::new("fail");
        let fake = start(with_tiers(12, host_blocks, disk.then_some((&dir, 7))));
        setup(&fake.control);
        fake.control.fail(op);
        let expected = format!("the executor failed at {at}: {}", op.fault());
        runs_until_the_engine_fails(&fake, &expected, case);
        fake.engine.stop();
    }
}

#[test]
fn a_store_that_fails_while_the_engine_stops_ends_the_stop_as_a_failure() {
    // Stopping writes the cached blocks the disk tier lacks; a device fault there is the stop's
    // failure, with its message (not a silent end of the engine thread).
    let dir = TestDir::new("stop");
    let fake = start(with_tiers(64, 0, Some((&dir, 7))));
    run(&fake.engine, distinct_request(0, 24, 6));
    settle(&fake.engine);
    fake.control.fail(Op::Export);
    fake.engine.stop();
    assert_eq!(
        fake.engine.failure().as_deref(),
        Some("the executor failed at a store into the disk tier: fake device fault in a block export")
    );
    // Nothing reached the disk.
    assert!(!dir.0.join("blocks").exists() || block_files(&dir).is_empty());
}

#[test]
fn a_host_tier_load_copied_asynchronously_is_waited_for_while_other_requests_run() {
    let cold = cold_outputs();
    let short = {
        let fake = start(config(64, 64, 8));
        let out = run(&fake.engine, distinct_request(9, 4, 2)).0;
        fake.engine.stop();
        out
    };
    let fake = start(with_tiers(12, 64, None));
    // Loads from the host tier are started and land later, as an accelerator's copies on their own
    // stream do (the bytes reach the block only when the engine hears that the copy finished).
    fake.control.async_imports();
    run_the_five(&fake.engine, &cold);
    settle(&fake.engine);
    // Prompt 0's blocks were evicted into the host tier; its revisit loads them, and the copies are held.
    fake.control.hold_imports();
    let (_guard, rx0) = submit(&fake.engine, distinct_request(0, 24, 6));
    fake.control.wait_imports_started(5);
    // Another request runs to its end while the loads are under way.
    assert_eq!(run(&fake.engine, distinct_request(9, 4, 2)).0, short);
    // The revisit has produced nothing: it waits for its blocks.
    if let Ok(ev) = rx0.try_recv() {
        panic!("the revisit ran before its blocks arrived: {ev:?}");
    }
    fake.control.release_imports();
    let (tokens, usage) = wait(&rx0);
    assert_eq!(tokens, cold[0], "the revisit, from asynchronous host loads");
    assert_eq!(usage.cached_tokens, 20);
    host_loads_all_counted(&fake);
    fake.engine.stop();
}

#[test]
fn a_revisit_runs_over_host_loads_the_executor_orders_before_its_steps() {
    let cold = cold_outputs();
    let fake = start(with_tiers(12, 64, None));
    // Loads from the host tier are started and ordered before every later call, as an accelerator
    // orders a step's layers after the copies of their KV: the engine need not wait for them.
    fake.control.ordered_imports();
    fake.control.async_exports();
    run_the_five(&fake.engine, &cold);
    settle(&fake.engine);
    let started = fake.control.imports_started();
    // No load is reported from now on: a revisit that waited for its loads would never finish.
    fake.control.hold_imports();
    let (tokens, usage) = wait(&submit(&fake.engine, distinct_request(0, 24, 6)).1);
    assert_eq!(tokens, cold[0], "the revisit, over its ordered host loads");
    assert_eq!(usage.cached_tokens, 20);
    assert_eq!(fake.control.imports_started() - started, 5);
    assert_eq!(fake.control.imports_reported(), started);
    // Its prefill read the loaded blocks before their copies were reported.
    assert!(fake.control.steps_over_loads() >= 1);
    // Released, the copies are reported at the next steps, once each (their times feed the tier cost
    // check; a second report of one would stop the engine).
    fake.control.release_imports();
    assert_eq!(
        run(&fake.engine, distinct_request(1, 24, 6)).0,
        cold[1],
        "prompt 1, after prompt 0's loads were reported"
    );
    host_loads_all_counted(&fake);
    assert_eq!(
        fake.control.imports_reported(),
        fake.control.imports_started()
    );
    fake.engine.stop();
}

/// Once the engine settles: every host load the executor started is counted as a load, none failed.
fn host_loads_all_counted(fake: &Fake) {
    settle(&fake.engine);
    let e = &fake.engine;
    assert_eq!(
        fake.control.imports_started() as f64,
        tier_metric(e, "kura:kv_tier_loads_total", "host")
    );
    assert_eq!(
        tier_metric(e, "kura:kv_tier_load_failures_total", "host"),
        0.0
    );
}

/// How the fake executor copies host-tier loads.
#[derive(Clone, Copy, PartialEq)]
enum Loads {
    Synchronous,
    /// Land later; the engine waits for their report.
    Asynchronous,
    /// Land before every later call; reported later.
    Ordered,
}

#[test]
fn asynchronous_stores_and_loads_through_host_and_disk_give_the_cold_tokens() {
    stores_and_loads_through_host_and_disk(Loads::Asynchronous);
}

#[test]
fn asynchronous_stores_and_ordered_loads_through_host_and_disk_give_the_cold_tokens() {
    stores_and_loads_through_host_and_disk(Loads::Ordered);
}

#[test]
fn asynchronous_stores_with_synchronous_loads_give_the_cold_tokens() {
    stores_and_loads_through_host_and_disk(Loads::Synchronous);
}

fn stores_and_loads_through_host_and_disk(loads: Loads) {
    let async_loads = loads != Loads::Synchronous;
    let cold = cold_outputs();
    let dir = TestDir::new("async");
    // A pool of 12 blocks and a host tier of 8: blocks go down to the host tier as they are evicted,
    // and on to disk as the host tier evicts them. With synchronous loads, a host tier of 64 and no
    // disk: nothing but a load then fences the stores, so every load reads a slot just stored into.
    let fake = if async_loads {
        start(with_tiers(12, 8, Some((&dir, 7))))
    } else {
        start(with_tiers(12, 64, None))
    };
    // Stores land only when the engine fences them (the slot holds other bytes until then) and loads
    // land later, as an accelerator's copies on their own stream do.
    fake.control.async_exports();
    match loads {
        Loads::Synchronous => {}
        Loads::Asynchronous => fake.control.async_imports(),
        Loads::Ordered => fake.control.ordered_imports(),
    }
    // The last prompts evicted are revisited first (their blocks in the host tier), the first ones
    // after (on disk by then).
    let order = [0, 1, 2, 3, 4, 2, 1, 0, 3, 4, 4, 2, 0, 1, 3];
    for (i, s) in order.into_iter().enumerate() {
        let (tokens, _) = run(&fake.engine, distinct_request(s, 24, 6));
        assert_eq!(tokens, cold[s as usize], "request {i}, prompt {s}");
    }
    settle(&fake.engine);
    let e = &fake.engine;
    assert!(
        fake.control.exports_started() >= 15,
        "{}",
        fake.control.exports_started()
    );
    // The engine fences a slot's stores before it reads that slot (a spill to disk, a synchronous
    // load), never all of them: the stores into other slots go on.
    let (whole, past_others) = fake.control.fences();
    assert_eq!(whole, 0, "no fence of every store");
    if async_loads {
        assert!(
            past_others > 0,
            "spills to disk left other slots' stores copying"
        );
    }
    assert!(tier_metric(e, "kura:kv_tier_hit_blocks_total", "host") > 0.0);
    let tiers: &[&str] = if async_loads {
        assert!(tier_metric(e, "kura:kv_tier_hit_blocks_total", "disk") > 0.0);
        &["host", "disk"]
    } else {
        &["host"]
    };
    for &tier in tiers {
        assert_eq!(
            tier_metric(e, "kura:kv_tier_load_failures_total", tier),
            0.0,
            "{tier}"
        );
    }
    fake.engine.stop();
}

#[test]
fn blocks_stored_ahead_are_evicted_without_a_copy() {
    // On an accelerator a step that writes a block waits for that block's store: evicted by the
    // step's own pass, its copy starts just before it. Stored ahead (at the end of a step, or beside
    // its forward pass), the copy has run by then.
    let cold = cold_outputs();
    for store_ahead in [0, 8] {
        let mut c = with_tiers(12, 64, None);
        c.tiers.store_ahead = Some(store_ahead);
        let fake = start(c);
        fake.control.async_exports();
        // One at a time (each evicts the one before), then revisits from the host tier.
        for (i, s) in [0, 1, 2, 3, 4, 2, 1, 0].into_iter().enumerate() {
            let (tokens, _) = run(&fake.engine, distinct_request(s, 24, 6));
            assert_eq!(
                tokens, cold[s as usize],
                "request {i}, prompt {s}, {store_ahead} blocks stored ahead"
            );
        }
        settle(&fake.engine);
        let e = &fake.engine;
        let evictions = metric(e, "kura:kv_cache_evictions_total");
        let copied = metric(e, "kura:kv_evictions_copied_total");
        let ahead = metric(e, "kura:kv_host_stored_ahead_blocks_total");
        assert!(evictions > 0.0);
        assert!(tier_metric(e, "kura:kv_tier_hit_blocks_total", "host") > 0.0);
        if store_ahead == 0 {
            // Blocks loaded back are evicted again without a copy: the host tier still holds them.
            assert!(copied > 0.0 && ahead == 0.0, "{copied} {ahead}");
        } else {
            assert_eq!(copied, 0.0, "of {evictions} evictions");
            assert!(ahead > 0.0);
        }
        fake.engine.stop();
    }
}

#[test]
fn the_disk_tier_survives_a_restart_and_refuses_another_models_blocks() {
    let cold = cold_outputs();
    let dir = TestDir::new("restart");
    let a = start(with_tiers(12, 0, Some((&dir, 7))));
    run_the_five(&a.engine, &cold);
    // A clean stop writes every cached block down.
    a.engine.stop();
    assert!(block_files(&dir).len() >= 25, "{:?}", block_files(&dir));

    let b = start(with_tiers(12, 0, Some((&dir, 7))));
    for s in 0..5 {
        let (tokens, cached) = run(&b.engine, distinct_request(s, 24, 6));
        assert_eq!(tokens, cold[s as usize], "prompt {s} after the restart");
        assert_eq!(cached, 20, "prompt {s} after the restart");
    }
    settle(&b.engine);
    assert!(tier_metric(&b.engine, "kura:kv_tier_hit_blocks_total", "disk") >= 25.0);
    assert_eq!(
        metric(&b.engine, "kura:kv_tier_checksum_failures_total"),
        0.0
    );
    b.engine.stop();

    // Another fingerprint (other weights or KV format): nothing is served, the files are removed.
    let c = start(with_tiers(12, 0, Some((&dir, 8))));
    assert!(metric(&c.engine, "kura:kv_disk_removed_foreign_total") >= 25.0);
    let (tokens, cached) = run(&c.engine, distinct_request(0, 24, 6));
    assert_eq!((tokens, cached), (cold[0].clone(), 0));
    c.engine.stop();
}

#[test]
fn a_damaged_block_on_disk_is_dropped_and_recomputed() {
    let cold = cold_outputs();
    let dir = TestDir::new("damaged");
    let a = start(with_tiers(12, 0, Some((&dir, 7))));
    for s in 0..5 {
        run(&a.engine, distinct_request(s, 24, 6));
    }
    a.engine.stop();
    // Flip the last payload byte of every block file: headers stay valid, so the damage is found when
    // a block is read.
    let files = block_files(&dir);
    for f in &files {
        let mut bytes = std::fs::read(f).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x5a;
        std::fs::write(f, bytes).unwrap();
    }
    let b = start(with_tiers(12, 0, Some((&dir, 7))));
    for s in 0..5 {
        let (tokens, cached) = run(&b.engine, distinct_request(s, 24, 6));
        assert_eq!(tokens, cold[s as usize], "prompt {s} over damaged blocks");
        // Every block it found on disk failed its check and was computed: none was served cached.
        assert_eq!(cached, 0, "prompt {s} over damaged blocks");
    }
    settle(&b.engine);
    let failures = tier_metric(&b.engine, "kura:kv_tier_load_failures_total", "disk");
    assert!(failures >= 5.0, "{failures}");
    assert_eq!(
        metric(&b.engine, "kura:kv_tier_checksum_failures_total"),
        failures
    );
    b.engine.stop();
}

#[test]
fn a_prefix_only_on_disk_is_read_once_for_sixteen_concurrent_requests() {
    let dir = TestDir::new("convoy");
    let fake = start(with_tiers(96, 0, Some((&dir, 7))));
    let e = &fake.engine;
    // A 32-token (8-block) shared prefix, computed once, then pushed out of the pool by other prompts.
    let prefix: Vec<u32> = (0..32).map(|i| (i * 5 + 3) % 60 + 1).collect();
    let with_suffix = |k: u32| {
        let mut p = prefix.clone();
        p.extend((0..3).map(|i| (k * 11 + i) % 60 + 1));
        let mut r = kura_engine::GenerateRequest::greedy(p, 4);
        r.ignore_eos = true;
        r
    };
    let alone = run(e, with_suffix(99)).0;
    for s in 0..30 {
        run(e, distinct_request(100 + s, 24, 1));
    }
    settle(e);
    let reads_before = metric(e, "kura:kv_disk_reads_total");
    // Hold the engine inside a forward pass while the 16 arrive, so that one scheduling pass sees them.
    let calls = fake.control.calls();
    fake.control.hold_at(calls + 1);
    let (_blocker, blocker_rx) = submit(e, distinct_request(999, 8, 2));
    fake.control.wait_held();
    let rxs: Vec<_> = (0..16).map(|k| submit(e, with_suffix(k))).collect();
    fake.control.release();
    wait(&blocker_rx);
    for (k, (_guard, rx)) in rxs.iter().enumerate() {
        let (tokens, usage) = wait(rx);
        assert_eq!(usage.cached_tokens, 32, "request {k}");
        assert_eq!(tokens.len(), 4);
    }
    // The request alone before and the one with the same suffix now agree.
    let (_g, rx) = submit(e, with_suffix(99));
    assert_eq!(wait(&rx).0, alone);
    settle(e);
    let reads = metric(e, "kura:kv_disk_reads_total") - reads_before;
    assert_eq!(reads, 8.0, "the 8 prefix blocks are read once each");
    fake.engine.stop();
}

#[test]
fn swap_preemption_loads_a_preempted_requests_blocks_back() {
    // Alone: the reference tokens.
    let reference: Vec<Vec<u32>> = {
        let fake = start(config(64, 64, 8));
        let out = (0..3)
            .map(|s| run(&fake.engine, distinct_request(s, 20, 24)).0)
            .collect();
        fake.engine.stop();
        out
    };
    // Three requests growing to 44 tokens (11 blocks) each in a pool of 24 blocks: someone is preempted.
    let mut c = with_tiers(24, 64, None);
    c.preemption = PreemptionMode::Swap;
    let fake = start(c);
    let rxs: Vec<_> = (0..3)
        .map(|s| submit(&fake.engine, distinct_request(s, 20, 24)))
        .collect();
    for (s, (_g, rx)) in rxs.iter().enumerate() {
        assert_eq!(wait(rx).0, reference[s], "request {s}");
    }
    settle(&fake.engine);
    let e = &fake.engine;
    assert!(metric(e, "kura:num_preemptions_total") >= 1.0);
    assert!(metric(e, "kura:kv_swapped_out_blocks_total") >= 1.0);
    assert!(tier_metric(e, "kura:kv_tier_hit_blocks_total", "host") >= 1.0);
    fake.engine.stop();
}

#[test]
fn the_disk_budget_holds_across_restarts() {
    let dir = TestDir::new("budget");
    let a = start(with_tiers(12, 0, Some((&dir, 7))));
    for s in 0..5 {
        run(&a.engine, distinct_request(s, 24, 6));
    }
    a.engine.stop();
    let written = block_files(&dir).len();
    assert!(written >= 25, "{written}");
    // Started again with room for 10 blocks: the oldest files beyond that are deleted.
    let mut c = with_tiers(12, 0, Some((&dir, 7)));
    c.tiers.disk.as_mut().unwrap().blocks = 10;
    let b = start(c);
    // The engine thread publishes its gauges as it starts.
    let deadline = std::time::Instant::now() + PATIENCE;
    while metric(&b.engine, "kura:kv_tier_blocks_used{tier=\"disk\"}") != 10.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the disk tier never showed 10 blocks"
        );
        // Poll interval: the deadline only turns a hang into a failure.
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    b.engine.stop();
    assert_eq!(block_files(&dir).len(), 10);
}

/// Writes the five distinct prompts' blocks to a fresh disk tier (a clean stop writes every cached block
/// down), so that an engine started on it finds them only on disk.
fn prompts_on_disk(dir: &TestDir) {
    let a = start(with_tiers(12, 0, Some((dir, 7))));
    for s in 0..5 {
        run(&a.engine, distinct_request(s, 24, 6));
    }
    a.engine.stop();
    assert!(block_files(dir).len() >= 25);
}

/// Blocks of the fake model: 4 tokens; 1 kB of "KV" is what the rates below are compared with.
fn fixed_rates(disk_bytes_per_s: f64, prefill_tokens_per_s: f64) -> TierCostCheck {
    TierCostCheck::Fixed(TierRates {
        disk_bytes_per_s,
        prefill_tokens_per_s,
        ..TierRates::PRIOR
    })
}

/// The forward calls' items as (first position, tokens) since `from`.
fn items_since(fake: &Fake, from: usize) -> Vec<(usize, usize)> {
    fake.batches.lock().unwrap()[from..]
        .iter()
        .flatten()
        .copied()
        .collect()
}

#[test]
fn a_prefix_only_on_disk_is_recomputed_when_the_disk_loads_slower_than_prefill() {
    let cold = cold_outputs();
    let dir = TestDir::new("cost-recompute");
    prompts_on_disk(&dir);
    let block_bytes = (BLOCK * 5) as f64; // the fake model's block
                                          // A block by disk: block_bytes / 10 B/s = 2 s; by prefill: 4 tokens / 1,000 tokens/s = 4 ms.
    let mut c = with_tiers(12, 0, Some((&dir, 7)));
    c.tier_cost = fixed_rates(10.0, 1000.0);
    assert!(!kura_engine::load_wins(
        block_bytes,
        10.0,
        BLOCK as f64,
        1000.0
    ));
    let fake = start(c);
    let e = &fake.engine;
    for s in 0..5 {
        let from = fake.batches.lock().unwrap().len();
        let (tokens, cached) = run(e, distinct_request(s, 24, 6));
        assert_eq!(tokens, cold[s as usize], "prompt {s} recomputed");
        assert_eq!(cached, 0, "prompt {s}: nothing served from disk");
        // The forward calls computed the whole prompt from position 0, the prefix on disk included.
        let prefill: usize = items_since(&fake, from)
            .iter()
            .filter(|(start, n)| *start < 24 && *n > 1)
            .map(|(_, n)| n)
            .sum();
        assert_eq!(prefill, 24, "prompt {s}: {:?}", items_since(&fake, from));
    }
    settle(e);
    // 5 prompts × 5 blocks of their 23 looked-up tokens, all on disk, all recomputed.
    assert_eq!(
        tier_metric(e, "kura:kv_tier_recomputed_blocks_total", "disk"),
        25.0
    );
    assert_eq!(tier_metric(e, "kura:kv_tier_hit_blocks_total", "disk"), 0.0);
    assert_eq!(metric(e, "kura:kv_disk_reads_total"), 0.0);
    assert_eq!(tier_metric(e, "kura:kv_tier_load_chosen", "disk"), 0.0);
    assert_eq!(
        tier_metric(e, "kura:kv_tier_load_bandwidth_bytes_per_second", "disk"),
        10.0
    );
    assert_eq!(metric(e, "kura:prefill_tokens_per_second"), 1000.0);
    fake.engine.stop();
}

#[test]
fn a_prefix_only_on_disk_is_loaded_when_the_disk_loads_faster_than_prefill() {
    let cold = cold_outputs();
    let dir = TestDir::new("cost-load");
    prompts_on_disk(&dir);
    // A block by disk: 20 B / 1 GB/s = 20 ns; by prefill: 4 tokens / 10 tokens/s = 0.4 s.
    let mut c = with_tiers(12, 0, Some((&dir, 7)));
    c.tier_cost = fixed_rates(1e9, 10.0);
    let fake = start(c);
    let e = &fake.engine;
    for s in 0..5 {
        let from = fake.batches.lock().unwrap().len();
        let (tokens, cached) = run(e, distinct_request(s, 24, 6));
        assert_eq!(tokens, cold[s as usize], "prompt {s} from disk");
        assert_eq!(cached, 20, "prompt {s}");
        // Only the last block's tokens were computed.
        assert!(
            items_since(&fake, from)
                .iter()
                .all(|(start, _)| *start >= 20),
            "prompt {s}: {:?}",
            items_since(&fake, from)
        );
    }
    settle(e);
    assert_eq!(
        tier_metric(e, "kura:kv_tier_recomputed_blocks_total", "disk"),
        0.0
    );
    assert!(tier_metric(e, "kura:kv_tier_hit_blocks_total", "disk") >= 25.0);
    assert_eq!(tier_metric(e, "kura:kv_tier_load_chosen", "disk"), 1.0);
    fake.engine.stop();
}

#[test]
fn measured_rates_replace_the_start_values() {
    let dir = TestDir::new("cost-measured");
    prompts_on_disk(&dir);
    let mut c = with_tiers(12, 16, Some((&dir, 7)));
    c.tier_cost = TierCostCheck::Measured;
    let fake = start(c);
    let e = &fake.engine;
    // The start probes read some of the disk's block files and copied host slots; the engine thread
    // publishes its gauges as it starts.
    let prior = TierRates::PRIOR;
    let deadline = std::time::Instant::now() + PATIENCE;
    while tier_metric(e, "kura:kv_tier_load_bandwidth_bytes_per_second", "disk") == 0.0 {
        assert!(std::time::Instant::now() < deadline, "no gauges published");
        // Poll interval: the deadline only turns a hang into a failure.
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let disk = tier_metric(e, "kura:kv_tier_load_bandwidth_bytes_per_second", "disk");
    let host = tier_metric(e, "kura:kv_tier_load_bandwidth_bytes_per_second", "host");
    assert!(disk > 0.0 && disk != prior.disk_bytes_per_s, "{disk}");
    assert!(host > 0.0 && host != prior.host_bytes_per_s, "{host}");
    // Redis is not configured: its start value stays.
    assert_eq!(
        tier_metric(e, "kura:kv_tier_load_bandwidth_bytes_per_second", "redis"),
        prior.redis_bytes_per_s
    );
    // A prompt of 24 new tokens is one prefill step: a sample of the prefill rate.
    run(e, distinct_request(40, 24, 2));
    settle(e);
    let prefill = metric(e, "kura:prefill_tokens_per_second");
    assert!(
        prefill > 0.0 && prefill != prior.prefill_tokens_per_s,
        "{prefill}"
    );
    fake.engine.stop();
}

#[test]
fn partial_hits_beside_host_tier_loads_give_the_cold_tokens() {
    // In a pool of 20 blocks, 16 prompts in waves of 8 and of 16, six rounds each: a pass can release
    // a partial hit's source once its copy is planned, evict it and load another prefix from the host
    // tier into it (here a few times a run). The copy runs before that load; after it, the copy read
    // the loaded KV, and the request gave other tokens.
    let prompts = stem_prompts();
    let cold = cold_tokens(&prompts);
    for wave_size in [8, 16] {
        let fake = start(with_tiers(20, 128, None));
        run_in_waves(&fake.engine, &prompts, &cold, wave_size, 6);
        settle(&fake.engine);
        assert!(tier_metric(&fake.engine, "kura:kv_tier_loads_total", "host") > 0.0);
        fake.engine.stop();
    }
}
