//! The Redis tier through the engine, on the fake model and a real `redis-server` (scripts/fetch-redis.sh
//! installs one; a missing one fails these tests): which prompts are looked up there.

mod common;

#[path = "../../kura-tiers/tests/support/redis_server.rs"]
mod redis_server;

use common::*;
use kura_engine::TierSetup;
use kura_kv::hash::Secret;
use redis_server::Redis;

fn with_redis(
    num_blocks: usize,
    host_blocks: u32,
    redis: &Redis,
    secret: &Secret,
) -> kura_engine::EngineConfig {
    let mut c = config(num_blocks, 64, 8);
    c.tiers = TierSetup {
        host_blocks,
        ..TierSetup::default()
    };
    with_remote(c, &redis.url, secret)
}

fn run(e: &kura_engine::EngineHandle, r: kura_engine::GenerateRequest) -> u32 {
    let (_guard, rx) = submit(e, r);
    wait(&rx).1.cached_tokens
}

#[test]
fn a_prompt_whose_local_prefix_is_in_a_lower_tier_is_not_looked_up_in_redis() {
    let redis = Redis::start();
    let secret = Secret::random();
    // One replica computes a 33-token prompt: its 8 whole blocks before the last token go to Redis.
    let prompt = |len| distinct_request(0, len, 1);
    let a = start(with_redis(64, 0, &redis, &secret));
    run(&a.engine, prompt(33));
    // Stopping runs the Redis writes still queued before the engine thread ends.
    a.engine.stop();
    assert!(redis.keys() >= 8, "the blocks were not written");

    // Another replica, with a pool of 12 blocks and a host tier, takes the prompt's first 3 blocks
    // from Redis, then computes three other prompts, which push them out of the pool into the host
    // tier.
    let b = start(with_redis(12, 64, &redis, &secret));
    let e = &b.engine;
    assert_eq!(run(e, prompt(13)), 12, "adopted from Redis");
    for s in 1..=3 {
        run(e, distinct_request(s, 24, 1));
    }
    settle(e);
    let fetches = metric(e, "kura:kv_remote_fetches_total");
    let adopted = metric(e, "kura:kv_remote_hit_blocks_total");
    // The whole prompt: its first 3 blocks are in the host tier, the other 5 in Redis. Blocks fetched
    // now could not be adopted after ones still to be loaded: no lookup is sent (one used to be, its
    // answer then thrown away), and the host tier's blocks are loaded.
    assert_eq!(run(e, prompt(33)), 12);
    assert_eq!(metric(e, "kura:kv_remote_fetches_total"), fetches);
    assert_eq!(metric(e, "kura:kv_remote_hit_blocks_total"), adopted);
    assert!(metric(e, "kura:kv_tier_hit_blocks_total{tier=\"host\"}") >= 3.0);
    b.engine.stop();
}
