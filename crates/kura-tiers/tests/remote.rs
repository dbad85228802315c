//! The Redis tier against a real `redis-server` ($KURA_REDIS_SERVER, else `redis-server` on PATH;
//! scripts/fetch-redis.sh installs one): values are authenticated with a keyed MAC over the Redis key
//! and the record, checked before anything is decoded, and sized before they are read. A missing
//! `redis-server` fails these tests.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kura_tiers::remote::{record_mac, verify_value, MAC_LEN};
use kura_tiers::{
    block_file_bytes, encode_record, BlockRecord, RemoteSetup, RemoteWorker, TierError,
};

#[path = "support/redis_server.rs"]
mod redis_server;
use redis_server::Redis;

const FP: u128 = 0x0123_4567_89ab_cdef_0011_2233_4455_6677;
const LEN: usize = 4096;
const KEY_A: [u8; 32] = [0xa1; 32];
const KEY_B: [u8; 32] = [0xb2; 32];

fn setup(url: &str, mac_key: [u8; 32], fingerprint: u128) -> RemoteSetup {
    RemoteSetup {
        url: url.into(),
        ttl_s: 600,
        fingerprint,
        payload_len: LEN,
        timeout: Duration::from_secs(5),
        mac_key,
        ca_file: None,
    }
}

fn worker(redis: &Redis, mac_key: [u8; 32]) -> RemoteWorker {
    RemoteWorker::start(setup(&redis.url, mac_key, FP)).unwrap()
}

/// Block `i` of 16 tokens and its payload.
fn block(i: u32) -> (BlockRecord, Vec<u8>) {
    let rec = BlockRecord {
        hash: 0x1000 + u128::from(i),
        parent_hash: 0x0fff + u128::from(i),
        key_digest: 0xabc,
        tokens: (0..16).map(|t| i * 100 + t).collect(),
    };
    let payload = (0..LEN).map(|b| (b as u32 * 31 + i) as u8).collect();
    (rec, payload)
}

fn key(i: u32) -> String {
    format!("kura:kv:{{abc}}:{i:032x}")
}

/// Writes block `i` under `key` through `w` and waits until it is stored.
fn put(w: &RemoteWorker, key: &str, i: u32) {
    let (rec, payload) = block(i);
    let before = w.stats().stores.load(Ordering::Relaxed);
    assert!(w.try_put(u128::from(i), key.into(), encode_record(FP, &rec, &payload)));
    let deadline = Instant::now() + Duration::from_secs(10);
    while w.stats().stores.load(Ordering::Relaxed) == before {
        assert!(Instant::now() < deadline, "the write was not stored");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Fetches `blocks` (key, block number expected there) through `w`: the payloads answered.
fn fetch(w: &RemoteWorker, blocks: &[(String, u32)]) -> Vec<Vec<u8>> {
    static TICKET: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let ticket = TICKET.fetch_add(1, Ordering::Relaxed);
    let lookups = blocks
        .iter()
        .map(|(k, i)| (k.clone(), block(*i).0))
        .collect();
    assert!(w.try_fetch(ticket, lookups, Instant::now() + Duration::from_secs(10)));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(done) = w.poll().into_iter().find(|d| d.ticket == ticket) {
            return done.payloads;
        }
        assert!(Instant::now() < deadline, "the fetch was not answered");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn counts(w: &RemoteWorker) -> (u64, u64, u64) {
    let s = w.stats();
    (
        s.rejected.load(Ordering::Relaxed),
        s.corrupt.load(Ordering::Relaxed),
        s.errors.load(Ordering::Relaxed),
    )
}

#[test]
fn a_block_is_stored_as_its_record_and_mac_and_fetched_back() {
    let redis = Redis::start();
    let w = worker(&redis, KEY_A);
    put(&w, &key(1), 1);
    let value = redis.get(&key(1)).expect("stored");
    let (rec, payload) = block(1);
    let record = encode_record(FP, &rec, &payload);
    assert_eq!(value.len(), block_file_bytes(16, LEN) as usize + MAC_LEN);
    assert_eq!(&value[..record.len()], record.as_slice());
    assert_eq!(value[record.len()..], record_mac(&KEY_A, &key(1), &record));
    assert_eq!(
        verify_value(&KEY_A, &key(1), &value),
        Some(record.as_slice())
    );
    assert_eq!(fetch(&w, &[(key(1), 1)]), vec![payload]);
    assert_eq!(counts(&w), (0, 0, 0));
    assert_eq!(w.stats().fetched_blocks.load(Ordering::Relaxed), 1);
}

#[test]
fn a_record_macd_with_another_key_is_rejected_and_deleted() {
    let redis = Redis::start();
    // A writer without the fleet's key writes a record that is right in every other way.
    let outsider = worker(&redis, KEY_B);
    put(&outsider, &key(2), 2);
    let reader = worker(&redis, KEY_A);
    assert!(fetch(&reader, &[(key(2), 2)]).is_empty());
    assert_eq!(counts(&reader), (1, 0, 0));
    assert!(!redis.exists(&key(2)), "a rejected value is deleted");
    assert_eq!(reader.stats().fetched_blocks.load(Ordering::Relaxed), 0);
}

#[test]
fn a_valid_value_copied_under_another_key_is_rejected() {
    let redis = Redis::start();
    let w = worker(&redis, KEY_A);
    put(&w, &key(3), 3);
    // The same value under another name, asked for as the very block it holds: only the key differs.
    let value = redis.get(&key(3)).unwrap();
    let copy = format!("kura:kv:{{abc}}:copy-of-{}", key(3));
    redis.set(&copy, &value);
    assert!(fetch(&w, &[(copy.clone(), 3)]).is_empty());
    assert_eq!(counts(&w), (1, 0, 0));
    assert!(!redis.exists(&copy));
    // The original is untouched and still served.
    assert_eq!(fetch(&w, &[(key(3), 3)]), vec![block(3).1]);
}

#[test]
fn a_value_of_the_wrong_size_is_refused_without_being_read() {
    let redis = Redis::start();
    let w = worker(&redis, KEY_A);
    put(&w, &key(4), 4);
    let value = redis.get(&key(4)).unwrap();
    let want = value.len();
    // A valid value followed by 16 MiB: refused after want + 1 bytes, the rest never sent.
    let mut oversized = value.clone();
    oversized.resize(want + (16 << 20), 0x5a);
    redis.set(&key(4), &oversized);
    let before = redis.net_output_bytes();
    assert!(fetch(&w, &[(key(4), 4)]).is_empty());
    let sent = redis.net_output_bytes() - before;
    assert!(
        sent < (want as u64) + (64 << 10),
        "Redis sent {sent} bytes for a {want}-byte value"
    );
    assert_eq!(counts(&w), (1, 0, 0));
    assert!(!redis.exists(&key(4)));
    // One byte short, and one byte long.
    redis.set(&key(5), &value[..want - 1]);
    assert!(fetch(&w, &[(key(5), 4)]).is_empty());
    redis.set(&key(6), &[value.as_slice(), b"x"].concat());
    assert!(fetch(&w, &[(key(6), 4)]).is_empty());
    assert_eq!(counts(&w), (3, 0, 0));
    assert_eq!(w.stats().fetched_blocks.load(Ordering::Relaxed), 0);
}

#[test]
fn a_key_of_another_type_is_rejected_without_failing_the_connection() {
    let redis = Redis::start();
    let w = worker(&redis, KEY_A);
    put(&w, &key(7), 7);
    redis::cmd("LPUSH")
        .arg(key(8))
        .arg("x")
        .query::<()>(&mut redis.conn())
        .unwrap();
    assert_eq!(fetch(&w, &[(key(7), 7), (key(8), 8)]), vec![block(7).1]);
    assert_eq!(counts(&w), (1, 0, 0));
    assert_eq!(w.stats().connected.load(Ordering::Relaxed), 1);
    assert!(!redis.exists(&key(8)));
}

#[test]
fn a_good_mac_on_a_record_failing_its_checks_is_counted_corrupt() {
    let redis = Redis::start();
    // Same fleet key, another model fingerprint.
    let other = RemoteWorker::start(setup(&redis.url, KEY_A, FP ^ 1)).unwrap();
    let (rec, payload) = block(9);
    assert!(other.try_put(9, key(9), encode_record(FP ^ 1, &rec, &payload)));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !redis.exists(&key(9)) {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    let w = worker(&redis, KEY_A);
    assert!(fetch(&w, &[(key(9), 9)]).is_empty());
    assert_eq!(counts(&w), (0, 1, 0));
    assert!(!redis.exists(&key(9)));
}

#[test]
fn a_fetch_stops_at_the_first_missing_block() {
    let redis = Redis::start();
    let w = worker(&redis, KEY_A);
    put(&w, &key(10), 10);
    put(&w, &key(12), 12);
    let got = fetch(&w, &[(key(10), 10), (key(11), 11), (key(12), 12)]);
    assert_eq!(got, vec![block(10).1]);
    assert_eq!(counts(&w), (0, 0, 0));
    assert!(redis.exists(&key(12)));
}

/// Offers block `i`'s write under `key(i)` and waits until it is stored (`true`) or reported as not
/// stored (`false`).
fn try_store(w: &RemoteWorker, i: u32) -> bool {
    let (rec, payload) = block(i);
    let before = w.stats().stores.load(Ordering::Relaxed);
    assert!(w.try_put(u128::from(i), key(i), encode_record(FP, &rec, &payload)));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if w.stats().stores.load(Ordering::Relaxed) > before {
            return true;
        }
        let failed = w.failed_puts();
        if !failed.is_empty() {
            assert_eq!(failed, vec![u128::from(i)]);
            return false;
        }
        assert!(
            Instant::now() < deadline,
            "the write was neither stored nor failed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_write_dropped_while_redis_is_down_is_reported_and_stored_when_offered_again() {
    let port = redis_server::free_port();
    let mut s = setup(&format!("redis://127.0.0.1:{port}"), KEY_A, FP);
    s.timeout = Duration::from_millis(200);
    let w = RemoteWorker::start(s).unwrap();
    // Nothing listens: the write is dropped, and its tag comes back so that it can be offered again.
    assert!(!try_store(&w, 20));
    assert_eq!(w.stats().connected.load(Ordering::Relaxed), 0);
    let redis = Redis::start_on(port);
    assert!(!redis.exists(&key(20)));
    // Reconnection is tried at most once a second: offered again until it is stored.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !try_store(&w, 20) {
        assert!(
            Instant::now() < deadline,
            "never stored after Redis came back"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(redis.exists(&key(20)));
    assert_eq!(fetch(&w, &[(key(20), 20)]), vec![block(20).1]);
    // Redis restarted (empty): a write on the lost connection fails and is reported too.
    drop(redis);
    let redis = Redis::start_on(port);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !try_store(&w, 21) {
        assert!(
            Instant::now() < deadline,
            "never stored after Redis restarted"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(redis.exists(&key(21)));
}

#[test]
fn an_error_reply_fails_its_write_and_keeps_the_connection() {
    let redis = Redis::start();
    let w = worker(&redis, KEY_A);
    assert!(try_store(&w, 30));
    // Out of memory under noeviction: Redis answers every SET with an error.
    for (name, value) in [("maxmemory-policy", "noeviction"), ("maxmemory", "1")] {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query::<()>(&mut redis.conn())
            .unwrap();
    }
    let connections = redis.connections_received();
    assert!(!try_store(&w, 31));
    assert!(!redis.exists(&key(31)));
    assert_eq!(w.stats().connected.load(Ordering::Relaxed), 1);
    assert_eq!(counts(&w), (0, 0, 1));
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("0")
        .query::<()>(&mut redis.conn())
        .unwrap();
    // Offered again, it is stored at once, on the same connection (a lost one would drop writes for
    // a second).
    assert!(try_store(&w, 31));
    assert!(redis.exists(&key(31)));
    // No new connection but the helper's own: two checks of the key, the CONFIG SET, this count.
    assert_eq!(redis.connections_received(), connections + 4);
    assert_eq!(w.stats().connected.load(Ordering::Relaxed), 1);
}

#[test]
fn a_fetch_reached_after_its_deadline_is_answered_empty_without_asking_redis() {
    let redis = Redis::start();
    let w = worker(&redis, KEY_A);
    put(&w, &key(40), 40);
    assert!(w.try_fetch(1 << 40, vec![(key(40), block(40).0)], Instant::now()));
    let deadline = Instant::now() + Duration::from_secs(10);
    let done = loop {
        if let Some(done) = w.poll().into_iter().next() {
            break done;
        }
        assert!(Instant::now() < deadline, "the fetch was not answered");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(done.ticket, 1 << 40);
    assert!(done.payloads.is_empty());
    assert_eq!(redis.calls("getrange"), 0);
    assert_eq!(w.stats().fetches.load(Ordering::Relaxed), 0);
    assert_eq!(w.stats().dropped.load(Ordering::Relaxed), 1);
    // In time, it runs.
    assert_eq!(fetch(&w, &[(key(40), 40)]), vec![block(40).1]);
    assert_eq!(redis.calls("getrange"), 1);
}

#[test]
fn tls_settings_are_checked_at_start_without_showing_the_password() {
    let dir = std::env::temp_dir().join(format!("kura-tiers-ca-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let not_pem = dir.join("not.pem");
    std::fs::write(&not_pem, "not a certificate").unwrap();
    let start = |url: &str, ca: Option<PathBuf>| {
        let mut s = setup(url, KEY_A, FP);
        s.ca_file = ca;
        RemoteWorker::start(s).unwrap_err()
    };
    let cases = [
        start("redis://:hunter2@127.0.0.1:1", Some(not_pem.clone())),
        start(
            "rediss://:hunter2@127.0.0.1:1",
            Some(dir.join("missing.pem")),
        ),
        start("rediss://:hunter2@127.0.0.1:1", Some(not_pem.clone())),
        start("rediss://:hunter2@127.0.0.1:1#insecure", None),
        start("http://:hunter2@nowhere", None),
    ];
    let texts: Vec<String> = cases.iter().map(|e| e.to_string()).collect();
    for t in &texts {
        assert!(!t.contains("hunter2"), "{t}");
    }
    assert!(texts[0].contains("not rediss://"), "{}", texts[0]);
    assert!(matches!(cases[1], TierError::Io { .. }), "{}", texts[1]);
    assert!(texts[2].contains("no PEM certificate"), "{}", texts[2]);
    assert!(texts[3].contains("#insecure"), "{}", texts[3]);
    assert!(texts[4].contains("--kv-redis-url"), "{}", texts[4]);
    // rediss:// with the system's roots starts (Redis itself is tried later).
    let mut s = setup("rediss://:hunter2@127.0.0.1:1", KEY_A, FP);
    s.timeout = Duration::from_millis(100);
    let w = RemoteWorker::start(s).unwrap();
    drop(w);
    let _ = std::fs::remove_dir_all(&dir);
}
