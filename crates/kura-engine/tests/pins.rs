//! Pinned prefixes on the deterministic fake model: a pinned prefix survives traffic worth ten pools
//! until its expiry on the cache clock and is evicted after it; pins share a budget, and one over it is
//! demoted (never refused); pinning the same prefix again refreshes it; a released pin frees its blocks.

mod common;

use common::{config, distinct_request, metric, start, submit, wait, Fake, BLOCK};
use kura_engine::{EngineConfig, EngineHandle, GenerateRequest, PinSpec};

fn with_budget(num_blocks: usize, budget: usize) -> EngineConfig {
    EngineConfig {
        pin_budget_blocks: Some(budget),
        ..config(num_blocks, 64, 8)
    }
}

/// `r` with its whole prompt pinned for `ttl_ms` on the engine's cache clock.
fn pinned(e: &EngineHandle, mut r: GenerateRequest, ttl_ms: u64) -> GenerateRequest {
    r.pins = vec![PinSpec {
        tokens: r.prompt_tokens.len(),
        expires_at_ms: e.cache_now_ms() + ttl_ms,
        persist: false,
    }];
    r
}

/// Distinct requests whose prompts add up to `tokens`.
fn flood(e: &EngineHandle, tokens: usize, seed: u32) {
    let mut sent = 0;
    let mut i = 0;
    while sent < tokens {
        let (_g, rx) = submit(e, distinct_request(seed + i, 40, 1));
        wait(&rx);
        sent += 40;
        i += 1;
    }
}

/// Returns once the engine has handled every command sent before this call: commands are handled in
/// the order they were sent, so a request submitted now completes only after all of them.
fn barrier(e: &EngineHandle) {
    let (_g, rx) = submit(e, distinct_request(9_999, 8, 1));
    wait(&rx);
}

/// Cached prompt tokens of `r` now.
fn cached(e: &EngineHandle, r: GenerateRequest) -> u32 {
    let (_g, rx) = submit(e, r);
    wait(&rx).1.cached_tokens
}

#[test]
fn a_pinned_prefix_survives_ten_pools_of_traffic_until_it_expires() {
    let fake = start(with_budget(32, 16));
    let e = &fake.engine;
    let doc = distinct_request(1000, 40, 1);
    let (_g, rx) = submit(e, pinned(e, doc.clone(), 60_000));
    let usage = wait(&rx).1;
    assert_eq!(
        usage.cache_write_tokens, 40,
        "the pin computed its 40 tokens"
    );
    assert_eq!(metric(e, "kura:kv_pinned_blocks"), 10.0);
    flood(e, 10 * 32 * BLOCK, 0);
    assert_eq!(
        cached(e, doc.clone()),
        39,
        "pinned: every token but the last is a hit"
    );
    // Its time runs out on the cache clock: no waiting.
    e.advance_cache_clock(61_000);
    barrier(e);
    assert_eq!(metric(e, "kura:kv_pins"), 0.0);
    assert_eq!(metric(e, "kura:kv_pins_expired_total"), 1.0);
    flood(e, 10 * 32 * BLOCK, 500);
    assert_eq!(cached(e, doc), 0, "expired: evicted like any block");
    e.stop();
}

#[test]
fn without_a_pin_the_same_traffic_evicts_the_prefix() {
    let fake = start(with_budget(32, 16));
    let e = &fake.engine;
    let doc = distinct_request(1000, 40, 1);
    let (_g, rx) = submit(e, doc.clone());
    assert_eq!(wait(&rx).1.cache_write_tokens, 0);
    flood(e, 10 * 32 * BLOCK, 0);
    assert_eq!(cached(e, doc), 0);
    e.stop();
}

#[test]
fn pins_share_a_budget_and_the_oldest_is_demoted_not_refused() {
    let fake = start(with_budget(64, 8));
    let e = &fake.engine;
    // 10 blocks alone are over the budget of 8: demoted at once, still served.
    let big = distinct_request(1, 40, 1);
    let (_g, rx) = submit(e, pinned(e, big, 60_000));
    assert_eq!(wait(&rx).1.cache_write_tokens, 40);
    assert_eq!(metric(e, "kura:kv_pins_demoted_total"), 1.0);
    assert_eq!(metric(e, "kura:kv_pinned_blocks"), 0.0);
    // Two of 6 blocks: the second makes the first (least recently used) go.
    let a = distinct_request(2, 24, 1);
    let b = distinct_request(3, 24, 1);
    let (_ga, rx) = submit(e, pinned(e, a.clone(), 60_000));
    wait(&rx);
    assert_eq!(metric(e, "kura:kv_pinned_blocks"), 6.0);
    let (_gb, rx) = submit(e, pinned(e, b, 60_000));
    wait(&rx);
    assert_eq!(metric(e, "kura:kv_pinned_blocks"), 6.0);
    assert_eq!(metric(e, "kura:kv_pins_demoted_total"), 2.0);
    assert_eq!(
        metric(e, "kura:kv_pins"),
        3.0,
        "demoted pins are still tracked"
    );
    // Using A again pins it again (and demotes B).
    let (_ga2, rx) = submit(e, pinned(e, a, 60_000));
    let usage = wait(&rx).1;
    assert_eq!(usage.cached_tokens, 23);
    assert_eq!(usage.cache_write_tokens, 0, "a hit writes nothing");
    assert_eq!(metric(e, "kura:kv_pinned_blocks"), 6.0);
    assert_eq!(metric(e, "kura:kv_pins_demoted_total"), 3.0);
    e.stop();
}

#[test]
fn pinning_a_prefix_again_refreshes_it_and_release_frees_it() {
    let fake = start(with_budget(64, 32));
    let e = &fake.engine;
    let doc = distinct_request(7, 40, 1);
    // Expiries far beyond any stall of the test: only the clock's advance below makes them pass.
    let (_g, rx) = submit(e, pinned(e, doc.clone(), 100_000));
    wait(&rx);
    // A second pin of the same prefix, for longer: one pin, expiring later.
    let (_g, rx) = submit(e, pinned(e, doc.clone(), 10_000_000));
    wait(&rx);
    assert_eq!(metric(e, "kura:kv_pins"), 1.0);
    // A control pinned once with the first expiry: it must expire when the clock passes it.
    let (_g, rx) = submit(e, pinned(e, distinct_request(8, 24, 1), 100_000));
    wait(&rx);
    assert_eq!(metric(e, "kura:kv_pins"), 2.0);
    e.advance_cache_clock(200_000);
    // The engine has handled the clock's move: the control is gone, the refreshed pin is not.
    barrier(e);
    assert_eq!(
        metric(e, "kura:kv_pins_expired_total"),
        1.0,
        "the control pin expired at the clock's move"
    );
    assert_eq!(
        metric(e, "kura:kv_pins"),
        1.0,
        "refreshed past the first expiry"
    );
    // Another tenant's pin of the same tokens is its own.
    let mut other = pinned(e, doc.clone(), 10_000_000);
    other.cache_salt = Some("tenant-b".into());
    let (_g, rx) = submit(e, other);
    assert_eq!(wait(&rx).1.cached_tokens, 0, "tenants never share blocks");
    assert_eq!(metric(e, "kura:kv_pins"), 2.0);
    e.release_pin(None, doc.prompt_tokens.clone());
    barrier(e);
    assert_eq!(metric(e, "kura:kv_pins"), 1.0, "the released pin is gone");
    assert_eq!(metric(e, "kura:kv_pinned_blocks"), 10.0);
    e.stop();
}

/// A pool of 32 blocks with a 40-token prompt's 10 blocks pinned for a minute.
fn pool_of_32_with_10_pinned() -> Fake {
    let fake = start(with_budget(32, 16));
    let e = &fake.engine;
    let (_g, rx) = submit(e, pinned(e, distinct_request(1000, 40, 1), 60_000));
    wait(&rx);
    assert_eq!(metric(e, "kura:kv_pinned_blocks"), 10.0);
    fake
}

/// A request that needs more than the pool less the pins (but fits the pool) waited for the pins'
/// expiry, a minute here and up to a day when served, with every request behind it: with nothing
/// else running, a pin now gives way.
#[test]
fn pins_give_way_to_a_request_that_cannot_run_beside_them() {
    let fake = pool_of_32_with_10_pinned();
    let e = &fake.engine;
    // 26 blocks of prompt and output: more than the 22 the pin leaves, less than the pool's 32.
    let big = distinct_request(2000, 100, 4);
    let (_b, big_rx) = submit(e, big);
    let (_n, next_rx) = submit(e, distinct_request(3000, 8, 1));
    assert_eq!(wait(&big_rx).0.len(), 4);
    assert_eq!(wait(&next_rx).0.len(), 1);
    assert_eq!(metric(e, "kura:kv_pins_demoted_total"), 1.0);
    assert_eq!(metric(e, "kura:kv_pinned_blocks"), 0.0);
    e.stop();
}

/// A running request alone whose output outgrows the pool less the pins (but fits the pool) failed
/// with CannotFit: it steps back to the queue, and a pin gives way.
#[test]
fn pins_give_way_to_a_running_request_that_outgrows_the_room_they_leave() {
    let fake = pool_of_32_with_10_pinned();
    let e = &fake.engine;
    // 20 blocks of prompt fit beside the pin; 40 tokens of output make 30 blocks, past the 22 left.
    let grows = distinct_request(2000, 80, 40);
    let (_b, rx) = submit(e, grows);
    assert_eq!(wait(&rx).0.len(), 40);
    assert_eq!(metric(e, "kura:kv_pins_demoted_total"), 1.0);
    e.stop();
}
