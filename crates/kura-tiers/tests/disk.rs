//! The disk tier against real files: round trips, every kind of damage a disk or a crash can leave, files of
//! other configurations, the meta file, and the I/O thread.

use std::fs::{self, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use kura_tiers::{
    BlockRecord, Check, DiskJob, DiskStats, DiskStore, DiskWorker, ReadError, TierError,
};

const FP: u128 = 0x0123_4567_89ab_cdef_0011_2233_4455_6677;
const LEN: usize = 64;

/// A fresh directory under the system temp dir, removed on drop.
struct TestDir(PathBuf);

impl TestDir {
    fn new(name: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p =
            std::env::temp_dir().join(format!("kura-tiers-test-{}-{n}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        TestDir(p)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Block `i`: hashes spread over the fan-out directories, `i % 5` tokens.
fn rec(i: u64) -> BlockRecord {
    let hash = u128::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
    BlockRecord {
        hash,
        parent_hash: hash ^ 0xffff,
        key_digest: 0xaaaa_0000 + u128::from(i % 3),
        tokens: (0..(i % 5) as u32).map(|t| t * 31 + i as u32).collect(),
    }
}

fn payload(i: u64) -> Vec<u8> {
    (0..LEN as u64)
        .map(|j| (i.wrapping_mul(131).wrapping_add(j * 7) % 251) as u8)
        .collect()
}

fn open(dir: &Path) -> (DiskStore, kura_tiers::ScanReport) {
    DiskStore::open(dir, FP, LEN).unwrap()
}

fn read(store: &DiskStore, r: &BlockRecord) -> Result<Vec<u8>, ReadError> {
    let mut out = vec![0u8; store.payload_len()];
    store.read(r, &mut out).map(|()| out)
}

fn flip(path: &Path, at: usize) {
    let mut bytes = fs::read(path).unwrap();
    bytes[at] ^= 0x40;
    fs::write(path, bytes).unwrap();
}

fn header_len(r: &BlockRecord) -> usize {
    116 + 4 * r.tokens.len()
}

fn sorted(mut v: Vec<BlockRecord>) -> Vec<BlockRecord> {
    v.sort_by_key(|r| r.hash);
    v
}

fn records(report: &kura_tiers::ScanReport) -> Vec<BlockRecord> {
    sorted(report.blocks.iter().map(|(r, _)| r.clone()).collect())
}

#[test]
fn write_then_read_round_trips_and_overwrites() {
    let d = TestDir::new("roundtrip");
    let (store, report) = open(&d.0);
    assert!(report.blocks.is_empty());
    for i in 0..8 {
        store.write(&rec(i), &payload(i)).unwrap();
    }
    for i in 0..8 {
        assert_eq!(read(&store, &rec(i)).unwrap(), payload(i), "block {i}");
    }
    // Same hash again: the new payload replaces the old.
    store.write(&rec(3), &payload(100)).unwrap();
    assert_eq!(read(&store, &rec(3)).unwrap(), payload(100));
    let p = store.path_of(rec(3).hash);
    assert_eq!(
        fs::metadata(&p).unwrap().len() as usize,
        header_len(&rec(3)) + LEN
    );
    assert!(p.starts_with(d.0.join("blocks")));
    assert!(fs::read_dir(d.0.join("tmp")).unwrap().next().is_none());
}

#[test]
fn read_of_another_block_is_rejected_and_the_file_deleted() {
    let d = TestDir::new("mismatch");
    let (store, _) = open(&d.0);
    let base = rec(4);
    let cases: [(BlockRecord, Check); 4] = [
        (
            BlockRecord {
                tokens: vec![1, 2, 3, 5],
                ..base.clone()
            },
            Check::Tokens,
        ),
        (
            BlockRecord {
                tokens: vec![],
                ..base.clone()
            },
            Check::Tokens,
        ),
        (
            BlockRecord {
                parent_hash: base.parent_hash + 1,
                ..base.clone()
            },
            Check::ParentHash,
        ),
        (
            BlockRecord {
                key_digest: base.key_digest + 1,
                ..base.clone()
            },
            Check::KeyDigest,
        ),
    ];
    for (expect, check) in cases {
        store.write(&base, &payload(4)).unwrap();
        let path = store.path_of(base.hash);
        match read(&store, &expect) {
            Err(ReadError::Corrupt { path: p, what }) => {
                assert_eq!(what, check);
                assert_eq!(p, path);
            }
            other => panic!("expected {check:?}, got {other:?}"),
        }
        assert!(!path.exists(), "{check:?}: the file must be deleted");
        assert!(matches!(
            read(&store, &base),
            Err(ReadError::Missing { .. })
        ));
    }
    // A file holding another block under this block's name.
    let other = rec(9);
    store.write(&other, &payload(9)).unwrap();
    fs::rename(store.path_of(other.hash), store.path_of(base.hash)).unwrap();
    match read(&store, &base) {
        Err(ReadError::Corrupt {
            what: Check::BlockHash { found },
            ..
        }) => assert_eq!(found, other.hash),
        other => panic!("expected BlockHash, got {other:?}"),
    }
    assert!(!store.path_of(base.hash).exists());
    // A FIFO put where a block file was listed: refused without opening it (the open blocked the
    // disk tier's thread, and every load and store behind it).
    #[cfg(unix)]
    {
        let fifo = store.path_of(base.hash);
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        match read(&store, &base) {
            Err(ReadError::Corrupt {
                what: Check::NotRegular,
                ..
            }) => {}
            other => panic!("expected NotRegular, got {other:?}"),
        }
        fs::remove_file(&fifo).unwrap();
    }
}

#[test]
fn a_flipped_payload_byte_fails_the_checksum_and_deletes_the_file() {
    let d = TestDir::new("payloadflip");
    let (store, _) = open(&d.0);
    let r = rec(7);
    for at in 0..LEN {
        store.write(&r, &payload(7)).unwrap();
        let path = store.path_of(r.hash);
        flip(&path, header_len(&r) + at);
        match read(&store, &r) {
            Err(ReadError::Corrupt {
                what: Check::PayloadChecksum,
                ..
            }) => {}
            other => panic!("payload byte {at}: expected a checksum error, got {other:?}"),
        }
        assert!(!path.exists(), "payload byte {at}: file not deleted");
    }
}

#[test]
fn a_flipped_header_byte_is_removed_at_open_and_rejected_by_read() {
    let d = TestDir::new("headerflip");
    let r = rec(8); // 3 tokens
    assert_eq!(r.tokens.len(), 3);
    for at in 0..header_len(&r) {
        let path = {
            let (store, _) = open(&d.0);
            store.write(&r, &payload(8)).unwrap();
            let path = store.path_of(r.hash);
            flip(&path, at);
            path
        };
        let (store, report) = open(&d.0);
        assert_eq!(
            (report.removed_corrupt, report.removed_foreign),
            (1, 0),
            "header byte {at}"
        );
        assert!(report.blocks.is_empty(), "header byte {at}");
        assert!(!path.exists(), "header byte {at}: file not deleted");

        // The same damage seen by a read instead of a scan.
        store.write(&r, &payload(8)).unwrap();
        flip(&path, at);
        assert!(
            matches!(read(&store, &r), Err(ReadError::Corrupt { .. })),
            "header byte {at}"
        );
        assert!(!path.exists());
    }
}

#[test]
fn truncated_and_extended_files_are_removed_at_open() {
    let d = TestDir::new("truncate");
    let (store, _) = open(&d.0);
    let r = rec(13); // 3 tokens
    let h = header_len(&r);
    let lengths = [
        0,
        1,
        8,
        15,
        16,
        40,
        h - 9,
        h - 1,
        h,
        h + 1,
        h + LEN / 2,
        h + LEN - 1,
    ];
    let mut paths = Vec::new();
    for (k, &len) in lengths.iter().enumerate() {
        let mut r = rec(1000 + k as u64);
        r.tokens = vec![1, 2, 3];
        store.write(&r, &payload(k as u64)).unwrap();
        let path = store.path_of(r.hash);
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len as u64)
            .unwrap();
        paths.push(path);
    }
    // One byte too many is damage too.
    let long = rec(2000);
    store.write(&long, &payload(1)).unwrap();
    let long_path = store.path_of(long.hash);
    let mut bytes = fs::read(&long_path).unwrap();
    bytes.push(0);
    fs::write(&long_path, bytes).unwrap();
    paths.push(long_path);
    let kept = rec(3000);
    store.write(&kept, &payload(3)).unwrap();
    drop(store);

    let (store, report) = open(&d.0);
    assert_eq!(report.removed_corrupt, lengths.len() as u64 + 1);
    assert_eq!(report.removed_foreign, 0);
    assert_eq!(records(&report), vec![kept.clone()]);
    for p in &paths {
        assert!(!p.exists(), "{} not deleted", p.display());
    }
    assert_eq!(read(&store, &kept).unwrap(), payload(3));
}

#[test]
fn a_truncated_payload_is_rejected_by_read() {
    let d = TestDir::new("truncread");
    let (store, _) = open(&d.0);
    let r = rec(2);
    store.write(&r, &payload(2)).unwrap();
    let path = store.path_of(r.hash);
    let len = fs::metadata(&path).unwrap().len();
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    assert!(matches!(
        read(&store, &r),
        Err(ReadError::Corrupt {
            what: Check::FileSize { .. },
            ..
        })
    ));
    assert!(!path.exists());
}

#[test]
fn files_of_another_fingerprint_or_payload_size_are_foreign() {
    let d = TestDir::new("foreign");
    {
        let (store, _) = open(&d.0);
        for i in 0..3 {
            store.write(&rec(i), &payload(i)).unwrap();
        }
    }
    let (_, report) = DiskStore::open(&d.0, FP ^ 1, LEN).unwrap();
    assert_eq!((report.removed_foreign, report.removed_corrupt), (3, 0));
    assert!(report.blocks.is_empty());

    {
        let (store, _) = open(&d.0);
        store.write(&rec(5), &payload(5)).unwrap();
        store.write(&rec(6), &payload(6)).unwrap();
    }
    let (short, report) = DiskStore::open(&d.0, FP, LEN / 2).unwrap();
    assert_eq!((report.removed_foreign, report.removed_corrupt), (2, 0));
    assert!(report.blocks.is_empty());
    assert!(!short.path_of(rec(5).hash).exists());

    // Seen by a read: a store of another fingerprint finds a file written after it opened.
    let (other, _) = DiskStore::open(&d.0, FP ^ 2, LEN).unwrap();
    let (store, _) = open(&d.0);
    store.write(&rec(7), &payload(7)).unwrap();
    match read(&other, &rec(7)) {
        Err(ReadError::Corrupt {
            what: Check::Fingerprint { found },
            ..
        }) => assert_eq!(found, FP),
        r => panic!("expected a fingerprint mismatch, got {r:?}"),
    }
    assert!(!store.path_of(rec(7).hash).exists());
}

#[test]
fn misplaced_and_misnamed_files_are_removed_at_open() {
    let d = TestDir::new("names");
    let (store, _) = open(&d.0);
    let a = rec(1);
    let b = rec(2);
    let c = rec(3);
    for (i, r) in [&a, &b, &c].into_iter().enumerate() {
        store.write(r, &payload(i as u64)).unwrap();
    }
    // A valid block under another block's name (and so, here, in another fan-out directory).
    let target = store.path_of(rec(4).hash);
    fs::rename(store.path_of(a.hash), &target).unwrap();
    // A valid block in the wrong fan-out directory under its own name.
    let pb = store.path_of(b.hash);
    let fan = format!("{:02x}", ((b.hash >> 120) as u8).wrapping_add(1));
    let wrong_fan = d.0.join("blocks").join(fan).join(pb.file_name().unwrap());
    fs::rename(&pb, &wrong_fan).unwrap();
    // Names that are no block's, and a file directly in blocks/.
    let fan_dir = store.path_of(c.hash).parent().unwrap().to_path_buf();
    let junk = [
        fan_dir.join("notes.txt"),
        fan_dir.join(format!("{:032X}.kvb", c.hash)),
        d.0.join("blocks").join("stray"),
    ];
    for j in &junk {
        fs::write(j, b"x").unwrap();
    }
    drop(store);

    let (_, report) = open(&d.0);
    assert_eq!(report.removed_corrupt, 2 + junk.len() as u64);
    assert_eq!(records(&report), vec![c]);
    assert!(!target.exists() && !wrong_fan.exists());
    for j in &junk {
        assert!(!j.exists(), "{} not deleted", j.display());
    }
}

#[test]
fn stray_temp_files_are_removed_at_open() {
    let d = TestDir::new("tmp");
    drop(open(&d.0));
    let tmp = d.0.join("tmp");
    fs::write(
        tmp.join("00112233445566778899aabbccddeeff.1.0.tmp"),
        b"half a blo",
    )
    .unwrap();
    fs::write(tmp.join("anything"), b"").unwrap();
    let (_, report) = open(&d.0);
    assert_eq!(report.removed_tmp, 2);
    assert_eq!(report.removed_corrupt, 0);
    assert!(fs::read_dir(&tmp).unwrap().next().is_none());
}

#[test]
fn the_seed_survives_reopen_and_differs_between_stores() {
    let d = TestDir::new("seed");
    let e = TestDir::new("seed2");
    let seed = open(&d.0).0.seed();
    assert_eq!(open(&d.0).0.seed(), seed);
    // Not a constant: another store draws another seed (a collision has odds 2^-64).
    assert_ne!(open(&e.0).0.seed(), seed);
    // Even a store of another configuration keeps it.
    assert_eq!(DiskStore::open(&d.0, 5, 7).unwrap().0.seed(), seed);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(d.0.join("kura-kv-disk"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}

#[test]
fn blocks_of_a_deleted_meta_file_are_removed_with_it() {
    // The seed named the blocks: with the meta file gone a new seed is drawn, and no lookup could ask
    // for the old names again. Kept, they would hold disk space that is never hit.
    let d = TestDir::new("lost-seed");
    let written: Vec<BlockRecord> = (0..12).map(rec).collect();
    let seed = {
        let (store, _) = open(&d.0);
        for (i, r) in written.iter().enumerate() {
            store.write(r, &payload(i as u64)).unwrap();
        }
        store.seed()
    };
    fs::remove_file(d.0.join("kura-kv-disk")).unwrap();
    let (store, report) = open(&d.0);
    assert_ne!(store.seed(), seed);
    assert!(report.blocks.is_empty());
    assert_eq!((report.removed_foreign, report.removed_corrupt), (12, 0));
    assert_eq!(report.bytes, 0);
    assert!(matches!(
        read(&store, &written[0]),
        Err(ReadError::Missing { .. })
    ));
    // Blocks written under the new seed are kept by the next open.
    store.write(&written[0], &payload(0)).unwrap();
    drop(store);
    let (store, report) = open(&d.0);
    assert_eq!(records(&report), vec![written[0].clone()]);
    assert_eq!(read(&store, &written[0]).unwrap(), payload(0));
}

#[test]
fn a_corrupt_meta_file_is_an_error_naming_it_and_is_kept() {
    let d = TestDir::new("meta");
    drop(open(&d.0));
    let meta = d.0.join("kura-kv-disk");
    for bad in [
        &b"garbage"[..],
        b"",
        b"kura-kv-disk 1\nseed 12\n",
        b"kura-kv-disk 9\nseed 0000000000000001\n",
        b"\xff\xfe\x00",
        // Longer than any meta file: refused before it is read whole.
        &[b'k'; 4097][..],
    ] {
        fs::write(&meta, bad).unwrap();
        match DiskStore::open(&d.0, FP, LEN) {
            Err(e @ TierError::BadMeta { .. }) => {
                assert!(e.to_string().contains(&meta.display().to_string()), "{e}");
            }
            Err(e) => panic!("expected BadMeta, got {e}"),
            Ok(_) => panic!("a corrupt meta file {bad:?} was accepted"),
        }
        assert_eq!(fs::read(&meta).unwrap(), bad, "the meta file was replaced");
    }
    // A meta path that is not a regular file is named, and not opened (a FIFO would block).
    fs::remove_file(&meta).unwrap();
    fs::create_dir(&meta).unwrap();
    match DiskStore::open(&d.0, FP, LEN) {
        Err(e @ TierError::BadMeta { .. }) => {
            assert!(e.to_string().contains("not a regular file"), "{e}");
        }
        Err(e) => panic!("expected BadMeta, got {e}"),
        Ok(_) => panic!("a directory was taken for the meta file"),
    }
}

#[test]
fn reopen_lists_exactly_the_blocks_written() {
    let d = TestDir::new("reopen");
    let written: Vec<BlockRecord> = (0..40).map(rec).collect();
    {
        let (store, _) = open(&d.0);
        for (i, r) in written.iter().enumerate() {
            store.write(r, &payload(i as u64)).unwrap();
        }
        // Removed blocks are not listed; removing a missing one is fine.
        store.remove(written[39].hash).unwrap();
        store.remove(written[39].hash).unwrap();
        store.remove(0xdead).unwrap();
    }
    let (store, report) = open(&d.0);
    let kept = sorted(written[..39].to_vec());
    assert_eq!(records(&report), kept);
    assert_eq!(
        (
            report.removed_corrupt,
            report.removed_foreign,
            report.removed_tmp
        ),
        (0, 0, 0)
    );
    let bytes: u64 = kept.iter().map(|r| (header_len(r) + LEN) as u64).sum();
    assert_eq!(report.bytes, bytes);
    for (i, r) in written[..39].iter().enumerate() {
        assert_eq!(read(&store, r).unwrap(), payload(i as u64));
    }
}

#[test]
fn blocks_that_are_their_own_ancestors_are_removed_at_open() {
    let d = TestDir::new("cycles");
    let block = |hash: u128, parent: u128| BlockRecord {
        hash,
        parent_hash: parent,
        key_digest: 0xaaaa,
        tokens: vec![hash as u32, 1, 2],
    };
    let h = |i: u128| i << 100 | i;
    // Its own parent; a loop of two and one of three; a block hanging from the loop of three; a
    // chain from a root (the key digest) that loops nowhere.
    let looped = [
        block(h(1), h(1)),
        block(h(2), h(3)),
        block(h(3), h(2)),
        block(h(4), h(5)),
        block(h(5), h(6)),
        block(h(6), h(4)),
    ];
    let kept = [
        block(h(7), h(5)),
        block(h(8), 0xaaaa),
        block(h(9), h(8)),
        block(h(10), h(9)),
    ];
    {
        let (store, _) = open(&d.0);
        for (i, r) in looped.iter().chain(&kept).enumerate() {
            store.write(r, &payload(i as u64)).unwrap();
        }
    }
    let (store, report) = open(&d.0);
    assert_eq!(records(&report), sorted(kept.to_vec()));
    assert_eq!(report.removed_corrupt, looped.len() as u64);
    let bytes: u64 = kept.iter().map(|r| (header_len(r) + LEN) as u64).sum();
    assert_eq!(report.bytes, bytes);
    for r in &looped {
        assert!(!store.path_of(r.hash).exists());
    }
    // Nothing left to remove at the next open.
    let (_, again) = open(&d.0);
    assert_eq!(records(&again), sorted(kept.to_vec()));
    assert_eq!(again.removed_corrupt, 0);
}

#[test]
fn the_listing_is_oldest_first() {
    let d = TestDir::new("mtime");
    let (store, _) = open(&d.0);
    let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let ages = [(rec(1), 30), (rec(2), 10), (rec(3), 20)];
    for (r, secs) in &ages {
        store.write(r, &payload(0)).unwrap();
        let f = OpenOptions::new()
            .write(true)
            .open(store.path_of(r.hash))
            .unwrap();
        f.set_modified(t0 + Duration::from_secs(*secs)).unwrap();
    }
    let (_, report) = open(&d.0);
    let order: Vec<u128> = report.blocks.iter().map(|(r, _)| r.hash).collect();
    assert_eq!(order, vec![rec(2).hash, rec(3).hash, rec(1).hash]);
    assert_eq!(report.blocks[0].1, t0 + Duration::from_secs(10));
}

#[test]
fn misuse_is_an_error_and_leaves_files_alone() {
    let d = TestDir::new("misuse");
    let (store, _) = open(&d.0);
    let r = rec(1);
    assert!(matches!(
        store.write(&r, &[0u8; LEN - 1]),
        Err(TierError::PayloadLen { expected: LEN, got, .. }) if got == LEN - 1
    ));
    assert!(!store.path_of(r.hash).exists());
    let huge = BlockRecord {
        tokens: vec![0; kura_tiers::disk::MAX_TOKENS + 1],
        ..r.clone()
    };
    assert!(matches!(
        store.write(&huge, &payload(1)),
        Err(TierError::TooManyTokens { .. })
    ));
    store.write(&r, &payload(1)).unwrap();
    let mut short = vec![0u8; LEN + 1];
    assert!(matches!(
        store.read(&r, &mut short),
        Err(ReadError::BufferLen { .. })
    ));
    assert_eq!(read(&store, &r).unwrap(), payload(1));
}

#[test]
fn store_and_worker_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<DiskStore>();
    check::<DiskWorker>();
}

#[test]
fn worker_runs_jobs_in_order_and_counts_them() {
    let d = TestDir::new("worker");
    let store = Arc::new(open(&d.0).0);
    let worker = DiskWorker::start(Arc::clone(&store));
    for i in 0..10 {
        worker.submit(DiskJob::Write {
            rec: rec(i),
            payload: payload(i),
        });
    }
    // FIFO: each read sees the writes before it, the second write of block 0 included, and the read after
    // the remove finds nothing.
    worker.submit(DiskJob::Write {
        rec: rec(0),
        payload: payload(50),
    });
    for i in 0..10 {
        worker.submit(DiskJob::Read {
            rec: rec(i),
            tag: 100 + i,
        });
    }
    worker.submit(DiskJob::Remove { hash: rec(9).hash });
    worker.submit(DiskJob::Read {
        rec: rec(9),
        tag: 200,
    });
    // A write of the wrong size fails, is counted, and does not stop the thread.
    worker.submit(DiskJob::Write {
        rec: rec(20),
        payload: vec![1; 3],
    });
    worker.flush();
    assert_eq!(worker.queued_jobs(), 0);

    for i in 0..10 {
        let done = worker.try_done().expect("flush returned before a read ran");
        assert_eq!((done.tag, done.hash), (100 + i, rec(i).hash));
        let want = if i == 0 { payload(50) } else { payload(i) };
        assert_eq!(done.result.unwrap(), want, "block {i}");
    }
    let last = worker.wait_done(Duration::from_secs(5)).unwrap();
    assert_eq!(last.tag, 200);
    assert!(matches!(last.result, Err(ReadError::Missing { .. })));
    assert!(worker.try_done().is_none());
    assert!(worker.wait_done(Duration::from_millis(10)).is_none());
    assert_eq!(
        worker.stats(),
        DiskStats {
            writes: 11,
            write_errors: 1,
            write_bytes: 11 * LEN as u64,
            reads: 10,
            read_errors: 1,
            removes: 1,
            remove_errors: 0,
        }
    );
}

#[test]
fn flush_waits_and_drop_finishes_the_queue() {
    let d = TestDir::new("flush");
    let store = Arc::new(open(&d.0).0);
    let worker = DiskWorker::start(Arc::clone(&store));
    for i in 0..300 {
        worker.submit(DiskJob::Write {
            rec: rec(i),
            payload: payload(i),
        });
    }
    worker.flush();
    assert_eq!(worker.queued_jobs(), 0);
    assert_eq!(worker.stats().writes, 300);
    for i in 0..300 {
        assert!(store.path_of(rec(i).hash).exists(), "block {i}");
    }

    for i in 300..600 {
        worker.submit(DiskJob::Write {
            rec: rec(i),
            payload: payload(i),
        });
    }
    drop(worker);
    for i in 300..600 {
        assert!(store.path_of(rec(i).hash).exists(), "block {i}");
    }
    drop(store);
    assert_eq!(open(&d.0).1.blocks.len(), 600);
}
