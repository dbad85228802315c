//! The Redis tier through the engine, on the fake model and a real `redis-server` (scripts/fetch-redis.sh
//! installs one; a missing one fails these tests): a device fault while a block is copied out for Redis,
//! or into the pool from a record Redis returned, ends the engine with where it failed, as every other
//! tier's copies do (`fake_tiers.rs`).

mod common;

#[path = "../../kura-tiers/tests/support/redis_server.rs"]
mod redis_server;

use common::*;
use kura_engine::RequestError;
use kura_kv::hash::Secret;
use redis_server::Redis;

fn with_redis(redis: &Redis, secret: &Secret) -> kura_engine::EngineConfig {
    with_remote(config(64, 64, 8), &redis.url, secret)
}

/// Prompt 0 on `fake`, whose executor call `op` fails: the request and the engine fail with `op`'s
/// fault at `at`.
fn engine_fails_at(fake: &Fake, at: &str, op: Op) {
    let expected = format!("the executor failed at {at}: {}", op.fault());
    let expected = expected.as_str();
    fake.control.fail(op);
    let (_g, rx) = submit(&fake.engine, distinct_request(0, 24, 6));
    match outcome(&rx).result {
        Err(RequestError::EngineFailed(reason)) => assert_eq!(reason, expected),
        other => panic!("{other:?}"),
    }
    assert_eq!(fake.engine.failure().as_deref(), Some(expected));
    assert!(!fake.engine.is_alive());
}

#[test]
fn a_failed_copy_to_or_from_the_redis_tier_ends_the_engine_with_where_it_failed() {
    let redis = Redis::start();
    let secret = Secret::random();

    // A block copied out of the pool to be written to Redis.
    let a = start(with_redis(&redis, &secret));
    engine_fails_at(&a, "a store into the Redis tier", Op::Export);
    a.engine.stop();
    assert_eq!(redis.keys(), 0, "nothing was written");

    // A healthy server writes prompt 0's blocks; another one, whose imports fail, finds them there.
    let b = start(with_redis(&redis, &secret));
    let (_g, rx) = submit(&b.engine, distinct_request(0, 24, 6));
    wait(&rx);
    // Stopping runs the Redis writes still queued before the engine thread ends.
    b.engine.stop();
    assert!(redis.keys() > 0, "no block reached Redis");
    let c = start(with_redis(&redis, &secret));
    engine_fails_at(&c, "a load from the Redis tier", Op::Import);
    // No step computed over the blocks that did not arrive.
    assert_eq!(c.control.calls(), 0);
    c.engine.stop();
}

#[test]
fn blocks_written_to_redis_hold_their_own_kv_when_loads_and_evictions_crowd_the_pool() {
    // Blocks a server loads from its disk tier are announced (and written to Redis, the first time
    // this process sees them) as the step after their read starts, and that step's pass may evict one
    // and load or compute other KV into it. Each is read for Redis before that. A server with a disk
    // tier runs 16 prompts over four shared stems; a second one, restarted over that disk tier with
    // Redis and a pool of 20 blocks, runs them in waves, six rounds; a third with Redis alone then
    // serves every prompt from the records: the cold tokens (a record holding other KV gives other
    // tokens).
    let redis = Redis::start();
    let secret = Secret::random();
    let prompts = stem_prompts();
    let cold = cold_tokens(&prompts);
    let dir = std::env::temp_dir().join(format!("kura-engine-redis-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let with_disk = |c: &mut kura_engine::EngineConfig| {
        c.num_blocks = 20;
        c.tiers = kura_engine::TierSetup {
            disk: Some(kura_engine::DiskSetup {
                dir: dir.clone(),
                blocks: 1000,
                fingerprint: 7,
            }),
            ..kura_engine::TierSetup::default()
        };
    };
    let mut c = config(20, 64, 8);
    with_disk(&mut c);
    let first = start(c);
    run_in_waves(&first.engine, &prompts, &cold, 8, 6);
    first.engine.stop();
    let mut c = with_redis(&redis, &secret);
    with_disk(&mut c);
    let second = start(c);
    second.control.async_exports();
    run_in_waves(&second.engine, &prompts, &cold, 8, 6);
    second.engine.stop();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(redis.keys() > 0, "no block reached Redis");
    let third = start(with_redis(&redis, &secret));
    for (i, r) in prompts.iter().enumerate() {
        let (_guard, rx) = submit(&third.engine, r.clone());
        let (tokens, usage) = wait(&rx);
        assert_eq!(tokens, cold[i], "prompt {i} over the records in Redis");
        assert!(
            usage.cached_tokens > 0,
            "prompt {i}: nothing came from Redis"
        );
    }
    third.engine.stop();
}
