//! `DiskStore`: the bytes of the disk tier (L3), one file per KV block, safe against crashes and against
//! whatever a damaged disk hands back.
//!
//! Layout under the directory the store is opened on:
//!
//! ```text
//! dir/kura-kv-disk                 meta file (text): format version and the random 64-bit hash seed
//! dir/blocks/XX/<hash>.kvb         one file per block; <hash> = 32 lowercase hex digits, XX = its first two
//! dir/tmp/                         files being written; anything left here at open is a crash's leftover
//! ```
//!
//! A block file is a header followed by the payload, little-endian:
//!
//! ```text
//! offset        size  field
//!   0              8  magic         b"KURAKVB1"
//!   8              4  version       1
//!  12              4  header_len    116 + 4 × num_tokens (magic to header_xxh3 inclusive)
//!  16             16  fingerprint   model + KV layout fingerprint the store was opened with
//!  32             16  key_digest    digest of the cache key (never the tenant's raw salt)
//!  48             16  block_hash    = the file name
//!  64             16  parent_hash   the parent block's hash (the key digest for a root block)
//!  80              4  num_tokens
//!  84       4 × n     tokens
//!  84 + 4n         8  payload_len   = the store's payload size
//!  92 + 4n        16  payload_xxh3  xxh3_128 of the payload
//! 108 + 4n         8  header_xxh3   xxh3_64 of every header byte before this field
//! 116 + 4n            payload       payload_len bytes
//! ```
//!
//! Crash safety: a block is written whole into `tmp/` and then renamed into place, which POSIX makes atomic,
//! so a process crash can never leave a half-written block under a block name; the temp files it leaves are
//! deleted at the next open. Nothing is fsynced (the tier is a cache, and the cost of a flush per block would
//! dominate): after a power loss a file may be torn or empty, and then fails its size or checksum checks and
//! is removed. The meta file alone is fsynced before it is renamed into place, since it is written once and
//! a damaged one stops the store from opening.
//!
//! Nothing read from disk is trusted: every size is checked before it is used (a header may not be longer
//! than the file, nor than a block of [`MAX_TOKENS`] tokens needs), and a file failing any check is deleted
//! and reported, never a panic. One process owns a directory at a time; two stores open on the same
//! directory do not corrupt blocks (every write is a rename) but each deletes the other's temp files at open.
//!
//! Costs: `open` reads each file's header only (one open and two reads per block, O(blocks)); `write` is one
//! file creation, two writes and a rename; `read` one open, three reads and an xxh3 pass over the payload.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use kura_files::{create_private_dir, make_private_dir};

use crate::error::{Check, ReadError, TierError};

/// The identity of a stored block: what a reader must present to get its payload back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockRecord {
    /// The block's chained hash; also its file name.
    pub hash: u128,
    /// The parent block's hash; the key digest itself for a sequence's first block.
    pub parent_hash: u128,
    /// Digest of the cache key the block was computed under.
    pub key_digest: u128,
    /// The token ids the block holds.
    pub tokens: Vec<u32>,
}

/// What [`DiskStore::open`] found on disk.
#[derive(Clone, Debug)]
pub struct ScanReport {
    /// The valid blocks, oldest modification time first (ties by hash), with that time, for an initial LRU
    /// order.
    pub blocks: Vec<(BlockRecord, SystemTime)>,
    /// Files deleted because they were damaged: bad magic, version, header length or checksum, a size other
    /// than the header says, a name that is not the header's block hash or not a block file name, not a
    /// regular file, unreadable, or its own ancestor (a parent chain that loops).
    pub removed_corrupt: u64,
    /// Intact files deleted because they belong to another configuration (another fingerprint or payload
    /// size).
    pub removed_foreign: u64,
    /// Files deleted from `tmp/` (writes a crash interrupted).
    pub removed_tmp: u64,
    /// Total size of the files kept.
    pub bytes: u64,
    /// Time `open` took.
    pub elapsed: Duration,
}

/// Bytes of the file of a block of `num_tokens` tokens and a payload of `payload_len` bytes: what a disk
/// budget is counted in.
pub fn block_file_bytes(num_tokens: usize, payload_len: usize) -> u64 {
    (HEADER_FIXED as u64)
        .saturating_add(4u64.saturating_mul(num_tokens as u64))
        .saturating_add(payload_len as u64)
}

/// The most tokens a block file holds; bounds the header a reader allocates for.
pub const MAX_TOKENS: usize = 1 << 16;

/// How often [`DiskStore::open`] logs the progress of a long index rebuild.
const SCAN_LOG_EVERY: Duration = Duration::from_secs(2);

const MAGIC: [u8; 8] = *b"KURAKVB1";
const VERSION: u32 = 1;
/// Header bytes besides the tokens.
const HEADER_FIXED: usize = 116;
/// Bytes before the tokens: magic to num_tokens.
const TOKENS_AT: usize = 84;
/// Magic, version and header_len: what is read before the header's length is known.
const PREFIX: usize = 16;
const META_NAME: &str = "kura-kv-disk";
const META_MAGIC: &str = "kura-kv-disk";
const META_VERSION: u32 = 1;
/// Larger meta files are corrupt (a valid one is about 40 bytes).
const META_MAX_BYTES: u64 = 4096;

/// The disk tier's files. `Send + Sync`: every method takes `&self`, and concurrent writes of different
/// blocks never share a file.
#[derive(Debug)]
pub struct DiskStore {
    dir: PathBuf,
    blocks_dir: PathBuf,
    tmp_dir: PathBuf,
    fingerprint: u128,
    payload_len: usize,
    seed: u64,
    pid: u32,
    /// Numbers temp files, unique within this process.
    tmp_counter: AtomicU64,
}

/// A parsed, checksum-verified header.
struct Header {
    fingerprint: u128,
    key_digest: u128,
    hash: u128,
    parent_hash: u128,
    tokens: Vec<u32>,
    payload_len: u64,
    payload_xxh3: u128,
    header_len: u32,
}

/// Why a header could not be read.
enum Fail {
    Check(Check),
    Io(io::Error),
}

impl From<io::Error> for Fail {
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            Fail::Check(Check::Truncated)
        } else {
            Fail::Io(e)
        }
    }
}

impl From<Check> for Fail {
    fn from(c: Check) -> Self {
        Fail::Check(c)
    }
}

impl DiskStore {
    /// Opens the store at `dir`, creating it if needed, for blocks written under `fingerprint` with payloads of
    /// `payload_len` bytes.
    ///
    /// Deletes every file left in `tmp/`, reads the meta file (or draws a fresh random seed, deletes every
    /// block file, whose names came from a seed that is gone so that no lookup could find them, and only
    /// then records the seed, mode 0600 on unix), and rebuilds the list of blocks from the files' headers
    /// alone: each must pass its magic,
    /// version and header checksum, carry `fingerprint` and `payload_len`, be exactly header plus payload
    /// long, and be named after its block hash. Every file that fails is deleted and counted in the report.
    ///
    /// Errors: a directory that cannot be created or listed, or a meta file that cannot be read or is
    /// corrupt ([`TierError::BadMeta`]; it is never replaced silently, since its seed names the blocks).
    pub fn open(
        dir: &Path,
        fingerprint: u128,
        payload_len: usize,
    ) -> Result<(DiskStore, ScanReport), TierError> {
        let started = Instant::now();
        let blocks_dir = dir.join("blocks");
        let tmp_dir = dir.join("tmp");
        // Private: block names are prompt digests, and their files' times say when a tenant was active.
        // The directory named keeps its mode if it exists (it may be the user's for other things);
        // the tier's own are narrowed to 700.
        create_private_dir(dir).map_err(|source| TierError::Io {
            op: "cannot create directory",
            path: dir.to_path_buf(),
            source,
        })?;
        for d in [&blocks_dir, &tmp_dir] {
            make_private_dir(d).map_err(|source| TierError::Io {
                op: "cannot create directory",
                path: d.to_path_buf(),
                source,
            })?;
        }
        let mut report = ScanReport {
            blocks: Vec::new(),
            removed_corrupt: 0,
            removed_foreign: 0,
            removed_tmp: 0,
            bytes: 0,
            elapsed: Duration::ZERO,
        };
        report.removed_tmp = clean_tmp(&tmp_dir)?;
        // A new seed is recorded only once the old blocks are gone: killed during the scan, the next
        // open finds no meta file again and deletes the rest.
        let recorded = read_meta(dir)?;
        let new_seed = recorded.is_none();
        let seed = recorded.unwrap_or_else(rand::random);
        let store = DiskStore {
            dir: dir.to_path_buf(),
            blocks_dir,
            tmp_dir,
            fingerprint,
            payload_len,
            seed,
            pid: std::process::id(),
            tmp_counter: AtomicU64::new(0),
        };
        for fan in 0..=255u8 {
            let d = store.blocks_dir.join(format!("{fan:02x}"));
            make_private_dir(&d).map_err(|source| TierError::Io {
                op: "cannot create directory",
                path: d.clone(),
                source,
            })?;
        }
        store.scan(&mut report, new_seed)?;
        store.drop_parent_cycles(&mut report);
        if new_seed {
            write_meta(dir, &store.tmp_dir, seed)?;
        }
        report
            .blocks
            .sort_by(|(a, ta), (b, tb)| ta.cmp(tb).then(a.hash.cmp(&b.hash)));
        report.elapsed = started.elapsed();
        Ok((store, report))
    }

    /// The hash seed recorded in the meta file: random at the store's creation, the same on every later open.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Bytes of every block's payload.
    pub fn payload_len(&self) -> usize {
        self.payload_len
    }

    /// The directory the store was opened on.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file that holds (or would hold) block `hash`.
    pub fn path_of(&self, hash: u128) -> PathBuf {
        self.blocks_dir
            .join(format!("{:02x}", (hash >> 120) as u8))
            .join(format!("{hash:032x}.kvb"))
    }

    /// Writes block `rec` with `payload`, replacing any file of the same hash.
    ///
    /// The whole file goes to `tmp/<hash>.<pid>.<counter>.tmp` first and is then renamed into place
    /// (atomic on POSIX), so no reader and no later open ever sees a half-written block after a process crash.
    /// Nothing is fsynced: after a power loss a torn file fails its checks at the next open and is removed.
    ///
    /// Errors: `payload` not [`DiskStore::payload_len`] bytes, more than [`MAX_TOKENS`] tokens, or an I/O
    /// failure (the temp file is then removed).
    pub fn write(&self, rec: &BlockRecord, payload: &[u8]) -> Result<(), TierError> {
        if payload.len() != self.payload_len {
            return Err(TierError::PayloadLen {
                dir: self.dir.clone(),
                expected: self.payload_len,
                got: payload.len(),
            });
        }
        if rec.tokens.len() > MAX_TOKENS {
            return Err(TierError::TooManyTokens {
                hash: rec.hash,
                tokens: rec.tokens.len(),
                max: MAX_TOKENS,
            });
        }
        let header = encode_header(self.fingerprint, rec, payload);
        let n = self.tmp_counter.fetch_add(1, Ordering::Relaxed);
        let tmp = self
            .tmp_dir
            .join(format!("{:032x}.{}.{n}.tmp", rec.hash, self.pid));
        let written = create_private(&tmp).and_then(|mut f| {
            f.write_all(&header)?;
            f.write_all(payload)
        });
        if let Err(source) = written {
            let _ = fs::remove_file(&tmp);
            return Err(TierError::Io {
                op: "cannot write temporary block file",
                path: tmp,
                source,
            });
        }
        let dest = self.path_of(rec.hash);
        let mut moved = fs::rename(&tmp, &dest);
        if matches!(&moved, Err(e) if e.kind() == io::ErrorKind::NotFound) {
            // The fan-out directory was removed under us: recreate it once.
            if let Some(parent) = dest.parent() {
                let _ = create_private_dir(parent);
            }
            moved = fs::rename(&tmp, &dest);
        }
        if let Err(source) = moved {
            let _ = fs::remove_file(&tmp);
            return Err(TierError::Io {
                op: "cannot move a block file into place at",
                path: dest,
                source,
            });
        }
        Ok(())
    }

    /// Reads block `expect.hash` into `out` (exactly [`DiskStore::payload_len`] bytes).
    ///
    /// The header must pass every check of [`DiskStore::open`] and match `expect` (hash, parent, key digest,
    /// tokens), and the payload its checksum. A file failing any check is deleted and the error names the
    /// check ([`ReadError::Corrupt`]); on any error the contents of `out` are unspecified.
    pub fn read(&self, expect: &BlockRecord, out: &mut [u8]) -> Result<(), ReadError> {
        let path = self.path_of(expect.hash);
        if out.len() != self.payload_len {
            return Err(ReadError::BufferLen {
                path,
                expected: self.payload_len,
                got: out.len(),
            });
        }
        // Never opened unless a regular file: a FIFO put in its place would block this thread, and
        // with it every load and store queued behind it.
        let opened = kura_files::regular(&path).and_then(|_| File::open(&path));
        let mut file = match opened {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(ReadError::Missing { path });
            }
            Err(e) if e.kind() == io::ErrorKind::InvalidInput => {
                return Err(ReadError::Corrupt {
                    path,
                    what: Check::NotRegular,
                });
            }
            Err(source) => return Err(ReadError::Io { path, source }),
        };
        match self.read_checked(&mut file, expect, out) {
            Ok(()) => Ok(()),
            Err(Fail::Io(source)) => Err(ReadError::Io { path, source }),
            Err(Fail::Check(what)) => {
                drop(file);
                if let Err(e) = fs::remove_file(&path) {
                    if e.kind() != io::ErrorKind::NotFound {
                        tracing::warn!(
                            path = %path.display(),
                            error = %e,
                            "disk tier: cannot delete a rejected block file"
                        );
                    }
                }
                Err(ReadError::Corrupt { path, what })
            }
        }
    }

    /// Deletes block `hash`'s file; a file that does not exist is not an error.
    pub fn remove(&self, hash: u128) -> Result<(), TierError> {
        let path = self.path_of(hash);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(TierError::Io {
                op: "cannot remove block file",
                path,
                source,
            }),
        }
    }

    fn read_checked(
        &self,
        file: &mut File,
        expect: &BlockRecord,
        out: &mut [u8],
    ) -> Result<(), Fail> {
        let file_len = file.metadata()?.len();
        let h = read_header(file, file_len)?;
        self.check_header(&h, file_len)?;
        check_expected(&h, expect)?;
        file.read_exact(out)?;
        if xxh3_128(out) != h.payload_xxh3 {
            return Err(Check::PayloadChecksum.into());
        }
        Ok(())
    }

    /// The checks of a verified header against this store: fingerprint, payload size, file size.
    fn check_header(&self, h: &Header, file_len: u64) -> Result<(), Check> {
        check_header(h, self.fingerprint, self.payload_len, file_len)
    }

    /// Lists `blocks/`, keeping the valid files and deleting the others.
    /// Lists the blocks kept from the files' headers. With `new_seed` (the meta file was just created)
    /// every block file is of a seed that is gone, and is deleted.
    fn scan(&self, report: &mut ScanReport, new_seed: bool) -> Result<(), TierError> {
        // A large store takes a while to check: its progress is logged every SCAN_LOG_EVERY, by the
        // fan-out directories done (blocks spread evenly over the 256 of them).
        let started = Instant::now();
        let mut last_log = started;
        let mut fans_done = 0u32;
        for entry in list(&self.blocks_dir)? {
            let path = entry.path();
            let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(false);
            let fan = entry.file_name().to_str().and_then(parse_fan);
            match (is_dir, fan) {
                (true, Some(fan)) => {
                    self.scan_fan(&path, fan, report, new_seed)?;
                    fans_done += 1;
                }
                (true, None) => tracing::warn!(
                    path = %path.display(),
                    "disk tier: leaving an unexpected directory alone"
                ),
                (false, _) => discard(&path, Check::FileName, report),
            }
            if last_log.elapsed() >= SCAN_LOG_EVERY {
                last_log = Instant::now();
                let files =
                    report.blocks.len() as u64 + report.removed_corrupt + report.removed_foreign;
                tracing::info!(
                    dir = %self.dir.display(),
                    directories_done = fans_done,
                    files_checked = files,
                    blocks_kept = report.blocks.len(),
                    seconds = started.elapsed().as_secs(),
                    "disk KV tier: rebuilding the index, {}% ({fans_done} of 256 directories, {files} files checked)",
                    fans_done * 100 / 256
                );
            }
        }
        Ok(())
    }

    /// Scans one fan-out directory, `blocks/XX`, whose files' hashes start with byte `fan`.
    fn scan_fan(
        &self,
        dir: &Path,
        fan: u8,
        report: &mut ScanReport,
        new_seed: bool,
    ) -> Result<(), TierError> {
        for entry in list(dir)? {
            let path = entry.path();
            let file_type = match entry.file_type() {
                Ok(t) => t,
                Err(e) => {
                    discard(&path, Fail::Io(e), report);
                    continue;
                }
            };
            if file_type.is_dir() {
                tracing::warn!(
                    path = %path.display(),
                    "disk tier: leaving an unexpected directory alone"
                );
                continue;
            }
            let name_hash = entry
                .file_name()
                .to_str()
                .and_then(parse_block_name)
                .filter(|h| (h >> 120) as u8 == fan);
            let Some(name_hash) = name_hash.filter(|_| file_type.is_file()) else {
                // A name that is no block's, in the wrong fan-out directory, or not a regular file (never
                // opened: a FIFO would block).
                discard(&path, Check::FileName, report);
                continue;
            };
            match self.scan_file(&path, name_hash) {
                // Intact, but its name was hashed with the seed that is gone.
                Ok(_) if new_seed => discard(&path, Check::SeedLost, report),
                Ok((rec, mtime, size)) => {
                    report.bytes = report.bytes.saturating_add(size);
                    report.blocks.push((rec, mtime));
                }
                Err(fail) => discard(&path, fail, report),
            }
        }
        Ok(())
    }

    /// Deletes the blocks kept whose parent chain, followed through the blocks kept, comes back to
    /// them (a block its own parent, or a longer loop). A chained hash covers its parent's, so no
    /// block written by Kura is in one: such a file is damaged or forged, and as its own descendant it
    /// would never be a leaf of the tier's leaf-first eviction order, so never evicted. A block that
    /// only hangs from a loop is kept, as one whose parent is gone. O(blocks).
    fn drop_parent_cycles(&self, report: &mut ScanReport) {
        let at: std::collections::HashMap<u128, usize> = report
            .blocks
            .iter()
            .enumerate()
            .map(|(i, (r, _))| (r.hash, i))
            .collect();
        // Per block: not seen, on the chain being followed, in a loop, or not in one.
        #[derive(Clone, Copy, PartialEq)]
        enum Seen {
            No,
            OnChain,
            Loop,
            Done,
        }
        let mut seen = vec![Seen::No; report.blocks.len()];
        let mut chain = Vec::new();
        for start in 0..report.blocks.len() {
            let mut b = start;
            let mut looped = false;
            while seen[b] == Seen::No {
                seen[b] = Seen::OnChain;
                chain.push(b);
                match at.get(&report.blocks[b].0.parent_hash) {
                    Some(&parent) => {
                        b = parent;
                        looped = seen[b] == Seen::OnChain;
                    }
                    None => break,
                }
            }
            if looped {
                // The chain came back to `b`: it and the blocks after it on the chain form the loop.
                let from = chain.iter().position(|&c| c == b).unwrap_or(0);
                for &c in &chain[from..] {
                    seen[c] = Seen::Loop;
                }
            }
            for c in chain.drain(..) {
                if seen[c] == Seen::OnChain {
                    seen[c] = Seen::Done;
                }
            }
        }
        if !seen.contains(&Seen::Loop) {
            return;
        }
        let blocks = std::mem::take(&mut report.blocks);
        for ((rec, mtime), seen) in blocks.into_iter().zip(seen) {
            if seen != Seen::Loop {
                report.blocks.push((rec, mtime));
                continue;
            }
            // The scan checked the file's size against its header: this is it.
            let size = block_file_bytes(rec.tokens.len(), self.payload_len);
            report.bytes = report.bytes.saturating_sub(size);
            tracing::warn!(path = %self.path_of(rec.hash).display(),
                "disk tier: a block file is its own ancestor; removing it");
            discard(&self.path_of(rec.hash), Check::ParentCycle, report);
        }
    }

    /// Checks one block file from its header; returns its record, modification time and size.
    fn scan_file(
        &self,
        path: &Path,
        name_hash: u128,
    ) -> Result<(BlockRecord, SystemTime, u64), Fail> {
        let mut file = File::open(path)?;
        let meta = file.metadata()?;
        let h = read_header(&mut file, meta.len())?;
        self.check_header(&h, meta.len())?;
        if h.hash != name_hash {
            return Err(Check::FileName.into());
        }
        let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        let rec = BlockRecord {
            hash: h.hash,
            parent_hash: h.parent_hash,
            key_digest: h.key_digest,
            tokens: h.tokens,
        };
        Ok((rec, mtime, meta.len()))
    }
}

/// Deletes a file that failed at open and counts it (foreign or corrupt). A file that cannot be deleted is
/// logged and left out of the listing.
fn discard(path: &Path, why: impl Into<Fail>, report: &mut ScanReport) {
    let why = why.into();
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "disk tier: cannot delete a bad block file");
            return;
        }
    }
    match why {
        Fail::Check(c) if c.is_foreign() => {
            tracing::debug!(path = %path.display(), reason = %c, "disk tier: removed a foreign block file");
            report.removed_foreign += 1;
        }
        Fail::Check(c) => {
            tracing::debug!(path = %path.display(), reason = %c, "disk tier: removed a corrupt block file");
            report.removed_corrupt += 1;
        }
        Fail::Io(e) => {
            tracing::warn!(path = %path.display(), error = %e, "disk tier: removed an unreadable block file");
            report.removed_corrupt += 1;
        }
    }
}

/// The entries of `dir`; a failure to list it is an error, a failure on one entry skips it.
fn list(dir: &Path) -> Result<Vec<fs::DirEntry>, TierError> {
    let rd = fs::read_dir(dir).map_err(|source| TierError::Io {
        op: "cannot list directory",
        path: dir.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for entry in rd {
        match entry {
            Ok(e) => out.push(e),
            Err(e) => {
                tracing::warn!(path = %dir.display(), error = %e, "disk tier: cannot read a directory entry")
            }
        }
    }
    Ok(out)
}

/// Deletes every file in `tmp/`; returns how many.
fn clean_tmp(tmp_dir: &Path) -> Result<u64, TierError> {
    let mut removed = 0;
    for entry in list(tmp_dir)? {
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            continue;
        }
        let path = entry.path();
        match fs::remove_file(&path) {
            Ok(()) => removed += 1,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "disk tier: cannot delete a temp file")
            }
        }
    }
    Ok(removed)
}

/// The seed recorded in `dir/kura-kv-disk`; `None` when there is no such file.
fn read_meta(dir: &Path) -> Result<Option<u64>, TierError> {
    let path = dir.join(META_NAME);
    // Never opened unless a regular file (opening a FIFO would block), nor read past its limit.
    match kura_files::read_text(&path, META_MAX_BYTES) {
        Ok(text) => parse_meta(&path, &text).map(Some),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::InvalidInput | io::ErrorKind::InvalidData
            ) =>
        {
            Err(TierError::BadMeta {
                path,
                what: e.to_string(),
            })
        }
        Err(source) => Err(io_err("cannot read", &path)(source)),
    }
}

/// Records `seed` in `dir/kura-kv-disk` (mode 0600 on unix): written whole in `tmp_dir`, fsynced and
/// renamed into place.
fn write_meta(dir: &Path, tmp_dir: &Path, seed: u64) -> Result<(), TierError> {
    let path = dir.join(META_NAME);
    let text = format!("{META_MAGIC} {META_VERSION}\nseed {seed:016x}\n");
    let tmp = tmp_dir.join(format!("{META_NAME}.{}.tmp", std::process::id()));
    let written = create_private(&tmp).and_then(|mut f| {
        f.write_all(text.as_bytes())?;
        f.sync_all()
    });
    if let Err(source) = written {
        let _ = fs::remove_file(&tmp);
        return Err(io_err("cannot write", &tmp)(source));
    }
    if let Err(source) = fs::rename(&tmp, &path) {
        let _ = fs::remove_file(&tmp);
        return Err(io_err("cannot create", &path)(source));
    }
    Ok(())
}

/// `TierError::Io` for `op` on `path`, for `map_err`.
fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> TierError {
    let path = path.to_path_buf();
    move |source| TierError::Io { op, path, source }
}

/// Parses the meta file's text: `kura-kv-disk 1\nseed <16 hex digits>\n`.
fn parse_meta(path: &Path, text: &str) -> Result<u64, TierError> {
    let bad = |what: String| TierError::BadMeta {
        path: path.to_path_buf(),
        what,
    };
    let mut lines = text.lines();
    let version = lines
        .next()
        .and_then(|l| l.strip_prefix(META_MAGIC))
        .and_then(|v| v.strip_prefix(' '))
        .ok_or_else(|| bad(format!("the first line is not \"{META_MAGIC} <version>\"")))?;
    if version != META_VERSION.to_string() {
        return Err(bad(format!(
            "format version {version:?}, this build reads {META_VERSION}"
        )));
    }
    let seed_hex = lines
        .next()
        .and_then(|l| l.strip_prefix("seed "))
        .filter(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| bad("the second line is not \"seed <16 hex digits>\"".into()))?;
    if lines.next().is_some() {
        return Err(bad("unexpected text after the seed".into()));
    }
    u64::from_str_radix(seed_hex, 16).map_err(|e| bad(format!("bad seed: {e}")))
}

/// Creates `path` (which must not exist), readable and writable by the owner only on unix.
fn create_private(path: &Path) -> io::Result<File> {
    let mut opts = OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    opts.open(path)
}

/// `XX` (two lowercase hex digits) → its byte.
fn parse_fan(name: &str) -> Option<u8> {
    if name.len() != 2 || !is_lower_hex(name) {
        return None;
    }
    u8::from_str_radix(name, 16).ok()
}

/// `<32 lowercase hex digits>.kvb` → the hash.
fn parse_block_name(name: &str) -> Option<u128> {
    let hex = name.strip_suffix(".kvb")?;
    if hex.len() != 32 || !is_lower_hex(hex) {
        return None;
    }
    u128::from_str_radix(hex, 16).ok()
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The checks of a verified header against a store of `fingerprint` and `payload_len`-byte payloads, for
/// a file (or record) of `total_len` bytes.
fn check_header(
    h: &Header,
    fingerprint: u128,
    payload_len: usize,
    total_len: u64,
) -> Result<(), Check> {
    if h.fingerprint != fingerprint {
        return Err(Check::Fingerprint {
            found: h.fingerprint,
        });
    }
    // usize is at most 64 bits on every supported target.
    let expected = payload_len as u64;
    if h.payload_len != expected {
        return Err(Check::PayloadLen {
            found: h.payload_len,
            expected,
        });
    }
    match u64::from(h.header_len).checked_add(h.payload_len) {
        Some(size) if size == total_len => Ok(()),
        size => Err(Check::FileSize {
            found: total_len,
            expected: size.unwrap_or(u64::MAX),
        }),
    }
}

/// The block a header names against the one asked for: hash, parent, key digest, tokens.
fn check_expected(h: &Header, expect: &BlockRecord) -> Result<(), Check> {
    if h.hash != expect.hash {
        return Err(Check::BlockHash { found: h.hash });
    }
    if h.parent_hash != expect.parent_hash {
        return Err(Check::ParentHash);
    }
    if h.key_digest != expect.key_digest {
        return Err(Check::KeyDigest);
    }
    if h.tokens != expect.tokens {
        return Err(Check::Tokens);
    }
    Ok(())
}

/// A whole block record in memory — the bytes of a block file, header then payload — as a remote tier
/// stores it under one key.
pub fn encode_record(fingerprint: u128, rec: &BlockRecord, payload: &[u8]) -> Vec<u8> {
    let mut bytes = encode_header(fingerprint, rec, payload);
    bytes.extend_from_slice(payload);
    bytes
}

/// The payload of a record made by [`encode_record`], after every check a disk read makes: header
/// checksum, `fingerprint`, `payload_len`, total size, the block `expect` names, payload checksum.
pub fn decode_record<'a>(
    bytes: &'a [u8],
    fingerprint: u128,
    payload_len: usize,
    expect: &BlockRecord,
) -> Result<&'a [u8], Check> {
    let total = bytes.len() as u64;
    let mut reader = bytes;
    let h = match read_header(&mut reader, total) {
        Ok(h) => h,
        Err(Fail::Check(c)) => return Err(c),
        Err(Fail::Io(_)) => return Err(Check::Truncated),
    };
    check_header(&h, fingerprint, payload_len, total)?;
    check_expected(&h, expect)?;
    // The size check above makes the payload exactly the bytes after the header.
    let payload = &bytes[h.header_len as usize..];
    if xxh3_128(payload) != h.payload_xxh3 {
        return Err(Check::PayloadChecksum);
    }
    Ok(payload)
}

/// The header of a block file for `rec` and `payload` (layout in the module docs).
fn encode_header(fingerprint: u128, rec: &BlockRecord, payload: &[u8]) -> Vec<u8> {
    // Callers bound the tokens by MAX_TOKENS, so neither cast below truncates.
    let header_len = HEADER_FIXED + 4 * rec.tokens.len();
    let mut h = Vec::with_capacity(header_len);
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&(header_len as u32).to_le_bytes());
    h.extend_from_slice(&fingerprint.to_le_bytes());
    h.extend_from_slice(&rec.key_digest.to_le_bytes());
    h.extend_from_slice(&rec.hash.to_le_bytes());
    h.extend_from_slice(&rec.parent_hash.to_le_bytes());
    h.extend_from_slice(&(rec.tokens.len() as u32).to_le_bytes());
    for t in &rec.tokens {
        h.extend_from_slice(&t.to_le_bytes());
    }
    h.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    h.extend_from_slice(&xxh3_128(payload).to_le_bytes());
    let sum = xxh3_64(&h);
    h.extend_from_slice(&sum.to_le_bytes());
    debug_assert_eq!(h.len(), header_len);
    h
}

/// Reads and verifies the header of a file of `file_len` bytes, leaving `file` at the payload's start.
fn read_header(file: &mut impl Read, file_len: u64) -> Result<Header, Fail> {
    if file_len < PREFIX as u64 {
        return Err(Check::Truncated.into());
    }
    let mut prefix = [0u8; PREFIX];
    file.read_exact(&mut prefix)?;
    let mut c = Cursor(&prefix);
    if c.bytes::<8>() != Some(MAGIC) {
        return Err(Check::Magic.into());
    }
    let version = c.u32().ok_or(Check::Truncated)?;
    if version != VERSION {
        return Err(Check::Version { found: version }.into());
    }
    let header_len = c.u32().ok_or(Check::Truncated)?;
    let max = HEADER_FIXED + 4 * MAX_TOKENS;
    let len = header_len as usize;
    if len < HEADER_FIXED || len > max || (len - HEADER_FIXED) % 4 != 0 {
        return Err(Check::HeaderLen { found: header_len }.into());
    }
    if u64::from(header_len) > file_len {
        return Err(Check::Truncated.into());
    }
    let mut buf = vec![0u8; len];
    buf[..PREFIX].copy_from_slice(&prefix);
    file.read_exact(&mut buf[PREFIX..])?;
    let (body, sum) = buf
        .split_last_chunk::<8>()
        .ok_or(Check::HeaderLen { found: header_len })?;
    if xxh3_64(body) != u64::from_le_bytes(*sum) {
        return Err(Check::HeaderChecksum.into());
    }
    Ok(parse_header(body, header_len).ok_or(Check::HeaderLen { found: header_len })?)
}

/// Parses a checksum-verified header (without its checksum); `None` if its token count disagrees with its
/// length.
fn parse_header(body: &[u8], header_len: u32) -> Option<Header> {
    let mut c = Cursor(body.get(PREFIX..)?);
    let fingerprint = c.u128()?;
    let key_digest = c.u128()?;
    let hash = c.u128()?;
    let parent_hash = c.u128()?;
    let num_tokens = c.u32()? as usize;
    let expected_len = num_tokens.checked_mul(4)?.checked_add(HEADER_FIXED)?;
    if expected_len != header_len as usize {
        return None;
    }
    let mut tokens = Vec::with_capacity(num_tokens);
    for _ in 0..num_tokens {
        tokens.push(c.u32()?);
    }
    let payload_len = c.u64()?;
    let payload_xxh3 = c.u128()?;
    debug_assert!(c.0.is_empty());
    debug_assert_eq!(TOKENS_AT + 4 * num_tokens + 24, body.len());
    Some(Header {
        fingerprint,
        key_digest,
        hash,
        parent_hash,
        tokens,
        payload_len,
        payload_xxh3,
        header_len,
    })
}

/// Little-endian reads off the front of a byte slice; `None` past its end.
struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn bytes<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*head)
    }
    fn u32(&mut self) -> Option<u32> {
        self.bytes().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.bytes().map(u64::from_le_bytes)
    }
    fn u128(&mut self) -> Option<u128> {
        self.bytes().map(u128::from_le_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_in_memory_comes_back_only_whole_and_as_asked() {
        let rec = BlockRecord {
            hash: 0xa,
            parent_hash: 0xb,
            key_digest: 0xc,
            tokens: vec![1, 2, 3, 4],
        };
        let payload: Vec<u8> = (0..64).collect();
        let bytes = encode_record(7, &rec, &payload);
        assert_eq!(decode_record(&bytes, 7, 64, &rec), Ok(&payload[..]));
        // Every single-byte change is caught by a check.
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(decode_record(&bad, 7, 64, &rec).is_err(), "byte {i}");
        }
        for cut in [0, 10, bytes.len() - 1] {
            assert!(
                decode_record(&bytes[..cut], 7, 64, &rec).is_err(),
                "cut at {cut}"
            );
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(matches!(
            decode_record(&long, 7, 64, &rec),
            Err(Check::FileSize { .. })
        ));
        assert!(matches!(
            decode_record(&bytes, 8, 64, &rec),
            Err(Check::Fingerprint { .. })
        ));
        assert!(matches!(
            decode_record(&bytes, 7, 32, &rec),
            Err(Check::PayloadLen { .. })
        ));
        let other = BlockRecord {
            tokens: vec![1, 2, 3, 5],
            ..rec.clone()
        };
        assert_eq!(decode_record(&bytes, 7, 64, &other), Err(Check::Tokens));
        let other = BlockRecord {
            parent_hash: 0xd,
            ..rec.clone()
        };
        assert_eq!(decode_record(&bytes, 7, 64, &other), Err(Check::ParentHash));
    }

    #[test]
    #[cfg(unix)]
    fn a_new_store_keeps_its_directories_to_the_servers_user() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("kura-disk-perm-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let (_store, _) = DiskStore::open(&dir, 7, 64).unwrap();
        for d in [
            dir.clone(),
            dir.join("blocks"),
            dir.join("tmp"),
            dir.join("blocks").join("ab"),
        ] {
            let mode = fs::metadata(&d).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", d.display());
        }
        drop(_store);
        // A store an earlier version left open: its own directories are narrowed at the next open,
        // the directory named keeps the mode its user gave it.
        for d in [
            dir.clone(),
            dir.join("blocks"),
            dir.join("tmp"),
            dir.join("blocks").join("ab"),
        ] {
            fs::set_permissions(&d, fs::Permissions::from_mode(0o755)).unwrap();
        }
        let (_store, _) = DiskStore::open(&dir, 7, 64).unwrap();
        let mode_of = |d: &std::path::Path| fs::metadata(d).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode_of(&dir), 0o755);
        for d in [
            dir.join("blocks"),
            dir.join("tmp"),
            dir.join("blocks").join("ab"),
        ] {
            assert_eq!(mode_of(&d), 0o700, "{}", d.display());
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn header_layout_matches_the_docs() {
        let rec = BlockRecord {
            hash: 0x1111,
            parent_hash: 0x2222,
            key_digest: 0x3333,
            tokens: vec![7, 8, 9],
        };
        let h = encode_header(0x4444, &rec, &[1, 2, 3, 4, 5]);
        assert_eq!(h.len(), HEADER_FIXED + 12);
        assert_eq!(&h[0..8], b"KURAKVB1");
        assert_eq!(u32::from_le_bytes(h[8..12].try_into().unwrap()), 1);
        assert_eq!(u32::from_le_bytes(h[12..16].try_into().unwrap()), 128);
        assert_eq!(u128::from_le_bytes(h[16..32].try_into().unwrap()), 0x4444);
        assert_eq!(u128::from_le_bytes(h[32..48].try_into().unwrap()), 0x3333);
        assert_eq!(u128::from_le_bytes(h[48..64].try_into().unwrap()), 0x1111);
        assert_eq!(u128::from_le_bytes(h[64..80].try_into().unwrap()), 0x2222);
        assert_eq!(u32::from_le_bytes(h[80..84].try_into().unwrap()), 3);
        assert_eq!(
            u32::from_le_bytes(h[TOKENS_AT + 8..96].try_into().unwrap()),
            9
        );
        assert_eq!(u64::from_le_bytes(h[96..104].try_into().unwrap()), 5);
        assert_eq!(
            u128::from_le_bytes(h[104..120].try_into().unwrap()),
            xxh3_128(&[1, 2, 3, 4, 5])
        );
        assert_eq!(
            u64::from_le_bytes(h[120..128].try_into().unwrap()),
            xxh3_64(&h[..120])
        );
        let parsed = parse_header(&h[..120], 128).unwrap();
        assert_eq!(parsed.tokens, vec![7, 8, 9]);
        assert_eq!(parsed.payload_len, 5);
        // A token count that disagrees with the header length is refused, not read past.
        assert!(parse_header(&h[..120], 132).is_none());
    }

    #[test]
    fn file_names() {
        let hash = 0xab00_0000_0000_0000_0000_0000_0000_00cd_u128;
        assert_eq!(
            parse_block_name("ab0000000000000000000000000000cd.kvb"),
            Some(hash)
        );
        assert_eq!(
            parse_block_name("AB0000000000000000000000000000cd.kvb"),
            None
        );
        assert_eq!(
            parse_block_name("+b0000000000000000000000000000cd.kvb"),
            None
        );
        assert_eq!(
            parse_block_name("ab0000000000000000000000000000cd.kvx"),
            None
        );
        assert_eq!(
            parse_block_name("ab000000000000000000000000000cd.kvb"),
            None
        );
        assert_eq!(parse_fan("ab"), Some(0xab));
        assert_eq!(parse_fan("aB"), None);
        assert_eq!(parse_fan("abc"), None);
    }

    #[test]
    fn meta_parsing() {
        let p = Path::new("/x/kura-kv-disk");
        assert_eq!(
            parse_meta(p, "kura-kv-disk 1\nseed 00000000000000ff\n").unwrap(),
            0xff
        );
        for bad in [
            "",
            "kura-kv-disk 2\nseed 00000000000000ff\n",
            "kura-kv-disk 1\nseed 00ff\n",
            "kura-kv-disk 1\nseed 00000000000000fg\n",
            "kura-kv-disk 1\nseed 00000000000000ff\nmore\n",
            "something else\n",
        ] {
            let e = parse_meta(p, bad).unwrap_err();
            assert!(matches!(e, TierError::BadMeta { .. }), "{bad:?}: {e}");
            assert!(e.to_string().contains("/x/kura-kv-disk"), "{e}");
        }
    }
}
