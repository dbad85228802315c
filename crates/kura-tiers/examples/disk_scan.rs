//! How long the disk tier takes to rebuild its index at start: fills a directory with block files of the
//! default model's size (368,640-byte payloads, 16 tokens) up to a given total, then times
//! `DiskStore::open` over it.
//!
//!   cargo run --release -p kura-tiers --example disk_scan -- DIR GIB [PAYLOAD_BYTES]
//!
//! Run it twice on the same DIR to time a second open; drop the page cache in between
//! (`echo 3 > /proc/sys/vm/drop_caches`) to time a cold one.

use std::path::PathBuf;
use std::time::Instant;

use kura_tiers::{BlockRecord, DiskStore};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: disk_scan DIR GIB [PAYLOAD_BYTES]");
        std::process::exit(2);
    }
    let dir = PathBuf::from(&args[1]);
    let gib: f64 = args[2].parse().expect("GIB is a number");
    let payload_len: usize = args
        .get(3)
        .map_or(368_640, |s| s.parse().expect("PAYLOAD_BYTES is a number"));
    let fingerprint = 0x6b75_7261;
    let (store, report) = DiskStore::open(&dir, fingerprint, payload_len).expect("open");
    let have = report.blocks.len();
    let want = (gib * (1u64 << 30) as f64 / payload_len as f64) as usize;
    println!(
        "open: {have} blocks ({:.2} GiB) in {:.3} s",
        report.bytes as f64 / (1u64 << 30) as f64,
        report.elapsed.as_secs_f64()
    );
    if have < want {
        let started = Instant::now();
        let payload = vec![0x5au8; payload_len];
        for i in have..want {
            let hash = (i as u128 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
            let rec = BlockRecord {
                hash,
                parent_hash: hash ^ 1,
                key_digest: 7,
                tokens: (0..16).map(|t| t + i as u32).collect(),
            };
            store.write(&rec, &payload).expect("write");
        }
        println!(
            "wrote {} blocks in {:.1} s",
            want - have,
            started.elapsed().as_secs_f64()
        );
        drop(store);
        let (_, report) = DiskStore::open(&dir, fingerprint, payload_len).expect("reopen");
        println!(
            "open: {} blocks ({:.2} GiB) in {:.3} s",
            report.blocks.len(),
            report.bytes as f64 / (1u64 << 30) as f64,
            report.elapsed.as_secs_f64()
        );
    }
}
