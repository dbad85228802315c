//! Cost of the Redis tier's record MAC per block, against the record's own checksums, for the default
//! model's block: SmolLM2-135M, 30 layers × 3 KV heads × head dim 64, 16 tokens, bf16 K and V
//! (16 × 30 × 2 × 3 × 64 × 2 = 368,640 bytes of payload).
//!
//! `cargo bench -p kura-tiers --bench remote_mac`
//!
//! - `mac`: the MAC a write appends (keyed BLAKE3 over the Redis key and the record).
//! - `verify`: a fetch's MAC check (the same pass and a constant-time compare).
//! - `decode_record`: a fetch's record checks after it (header xxh3_64, identity, payload xxh3_128).
//! - `encode_record`: a write's record (header, payload xxh3_128, one copy of the payload).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kura_tiers::remote::{record_mac, verify_value};
use kura_tiers::{decode_record, encode_record, BlockRecord};

const FP: u128 = 0x0123_4567_89ab_cdef_0011_2233_4455_6677;
const TOKENS: usize = 16;
const PAYLOAD: usize = TOKENS * 30 * 2 * 3 * 64 * 2;

fn bench(c: &mut Criterion) {
    let rec = BlockRecord {
        hash: 0x1111_2222_3333_4444_5555_6666_7777_8888,
        parent_hash: 0x9999_aaaa_bbbb_cccc_dddd_eeee_ffff_0000,
        key_digest: 0x0f0f_0f0f_0f0f_0f0f_0f0f_0f0f_0f0f_0f0f,
        tokens: (0..TOKENS as u32).map(|t| t * 7919).collect(),
    };
    let payload: Vec<u8> = (0..PAYLOAD).map(|i| (i * 131 + 17) as u8).collect();
    let record = encode_record(FP, &rec, &payload);
    let mac_key = [0x5a; 32];
    let redis_key = format!("kura:kv:{{{:032x}}}:{:032x}", rec.key_digest, rec.hash);
    let mut value = record.clone();
    value.extend_from_slice(&record_mac(&mac_key, &redis_key, &record));
    assert!(verify_value(&mac_key, &redis_key, &value).is_some());

    let mut g = c.benchmark_group("redis_record");
    g.throughput(Throughput::Bytes(record.len() as u64));
    g.sample_size(30);
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("mac", |b| {
        b.iter(|| {
            record_mac(
                black_box(&mac_key),
                black_box(&redis_key),
                black_box(&record),
            )
        })
    });
    g.bench_function("verify", |b| {
        b.iter(|| {
            verify_value(
                black_box(&mac_key),
                black_box(&redis_key),
                black_box(&value),
            )
        })
    });
    g.bench_function("decode_record", |b| {
        b.iter(|| decode_record(black_box(&record), FP, PAYLOAD, black_box(&rec)).map(|p| p.len()))
    });
    g.bench_function("encode_record", |b| {
        b.iter(|| encode_record(FP, black_box(&rec), black_box(&payload)))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
