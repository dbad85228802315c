//! `kura-files` — files given from outside (a model's JSON, key files, saved contexts, run files, cost
//! models, the disk tier's meta file, files named on the command line), read with a size limit, and
//! opened only when regular where a process serves: a FIFO would block the read forever and
//! `/dev/zero` never ends.
//!
//! Errors are `std::io::Error`s whose text says what was wrong (`not a regular file (…)`, `larger than
//! the N bytes read from such a file`, `not UTF-8 text`); callers add the path and the flag.

use std::fs::Metadata;
use std::io::{Error, ErrorKind, Read};
use std::path::Path;

/// The text of the error for a path that is not a regular file.
pub const NOT_REGULAR: &str = "not a regular file (a directory, FIFO, socket or device)";

/// `path`'s metadata when it is a regular file (following links); otherwise an `InvalidInput` error
/// saying it is not. Nothing is opened: opening a FIFO blocks until a writer comes.
pub fn regular(path: &Path) -> std::io::Result<Metadata> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(Error::new(ErrorKind::InvalidInput, NOT_REGULAR));
    }
    Ok(meta)
}

/// The bytes of a regular file of at most `max_bytes`: a path that is not a regular file, or a file over
/// the limit, is an error that says so, before anything is read into memory (and a file that grows while
/// it is read is cut at the limit and refused).
pub fn read(path: &Path, max_bytes: u64) -> std::io::Result<Vec<u8>> {
    if regular(path)?.len() > max_bytes {
        return Err(too_large(max_bytes));
    }
    read_bounded(std::fs::File::open(path)?, max_bytes)
}

/// [`read`] as UTF-8 text.
pub fn read_text(path: &Path, max_bytes: u64) -> std::io::Result<String> {
    utf8(read(path, max_bytes)?)
}

/// A file named on the command line, read whole, at most `max_bytes`. Unlike [`read`] a FIFO is read
/// as the stream it is (`--file <(make-doc)`): the user who named it is the writer. A device that never
/// ends (`/dev/zero`) stops at the limit with an error.
pub fn read_arg(path: &Path, max_bytes: u64) -> std::io::Result<Vec<u8>> {
    let meta = std::fs::metadata(path)?;
    if meta.is_dir() {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "a directory, not a file",
        ));
    }
    if meta.is_file() && meta.len() > max_bytes {
        return Err(too_large(max_bytes));
    }
    read_bounded(std::fs::File::open(path)?, max_bytes)
}

/// [`read_arg`] as UTF-8 text.
pub fn read_arg_text(path: &Path, max_bytes: u64) -> std::io::Result<String> {
    utf8(read_arg(path, max_bytes)?)
}

fn read_bounded(file: std::fs::File, max_bytes: u64) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    file.take(max_bytes.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max_bytes {
        return Err(too_large(max_bytes));
    }
    Ok(bytes)
}

fn too_large(max_bytes: u64) -> Error {
    Error::new(
        ErrorKind::InvalidData,
        format!("larger than the {max_bytes} bytes read from such a file"),
    )
}

fn utf8(bytes: Vec<u8>) -> std::io::Result<String> {
    String::from_utf8(bytes).map_err(|e| {
        Error::new(
            ErrorKind::InvalidData,
            format!(
                "not UTF-8 text (bad byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

/// Creates `dir` (and its parents) readable by the process's user only where they are new (mode 700);
/// an existing one is left as it is (a directory the user named may be theirs for other things).
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir)
}

/// [`create_private_dir`] for a directory of the process's own (its blocks, its saved contexts): an
/// existing one open to others (made by an earlier version, or by hand) is narrowed to its owner where
/// the process may change it (one it does not own is left as its owner made it).
pub fn make_private_dir(dir: &Path) -> std::io::Result<()> {
    create_private_dir(dir)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir)?.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            let narrowed = std::fs::Permissions::from_mode(mode & !0o077);
            match std::fs::set_permissions(dir, narrowed) {
                // Not the process's to change, or on a read-only mount: left as it is.
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::PermissionDenied | ErrorKind::ReadOnlyFilesystem
                    ) => {}
                other => other?,
            }
        }
    }
    Ok(())
}

/// The name of the file a temporary file of [`write_private_atomic`] (`<name>.<pid>-<n>.tmp`) was
/// for, or `None` for any other name: what a start-up removes as a write cut short.
pub fn atomic_tmp_target(file_name: &str) -> Option<&str> {
    let (target, tag) = file_name.strip_suffix(".tmp")?.rsplit_once('.')?;
    let (pid, n) = tag.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(pid) && digits(n) && !target.is_empty()).then_some(target)
}

/// Temporary files [`write_private_atomic`] has made in this process, for their names.
static TMP_COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Why [`replace_private_atomic`] failed.
#[derive(Debug)]
pub enum ReplaceError {
    /// Nothing changed: `path` holds what it held before (or is still absent).
    NotWritten(Error),
    /// `path` holds the new bytes, but its directory could not be synced after the rename: a power
    /// loss may still bring the old file back (or take the new one away).
    NotSynced(Error),
}

impl ReplaceError {
    /// The I/O error behind it.
    pub fn io_error(&self) -> &Error {
        match self {
            ReplaceError::NotWritten(e) | ReplaceError::NotSynced(e) => e,
        }
    }
}

impl std::fmt::Display for ReplaceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplaceError::NotWritten(e) => write!(f, "{e}"),
            ReplaceError::NotSynced(e) => write!(
                f,
                "written, but its directory could not be synced (a power loss may undo it): {e}"
            ),
        }
    }
}

impl std::error::Error for ReplaceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.io_error())
    }
}

/// The directory `path` is in (`.` for a bare name).
fn parent_dir(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Syncs directory `dir`, so that the names created, renamed or removed in it outlive a power loss.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Writes `bytes` to `path` whole or not at all, readable by the process's user only: into
/// `<path>.<pid>-<n>.tmp`, a name of this write alone (a leftover of that name removed first; the new
/// one created exclusively, so that a link planted there is never followed), synced, renamed over
/// `path`, and the directory synced so that the rename outlives a power loss. Where that last sync
/// fails, `path` is removed again: an error means the bytes are not there, not that they may be.
/// For a new file; [`replace_private_atomic`] replaces one whose old bytes must not be lost.
pub fn write_private_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    match replace_private_atomic(path, bytes) {
        Ok(()) => Ok(()),
        Err(ReplaceError::NotWritten(e)) => Err(e),
        Err(ReplaceError::NotSynced(e)) => {
            let _ = std::fs::remove_file(path);
            Err(e)
        }
    }
}

/// [`write_private_atomic`] for a file that may hold bytes already: where the directory sync after
/// the rename fails, the new file is left in place ([`ReplaceError::NotSynced`]) rather than removed,
/// which would lose the old bytes and the new ones both.
pub fn replace_private_atomic(path: &Path, bytes: &[u8]) -> Result<(), ReplaceError> {
    use std::io::Write;
    let n = TMP_COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}-{n}.tmp", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp);
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != ErrorKind::NotFound => return Err(ReplaceError::NotWritten(e)),
        _ => {}
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let written = options.open(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    if let Err(e) = written.and_then(|_| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(ReplaceError::NotWritten(e));
    }
    sync_dir(parent_dir(path)).map_err(ReplaceError::NotSynced)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kura-files-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn files_from_outside_are_read_only_when_regular_and_within_their_limit() {
        let dir = scratch("read");
        let f = dir.join("config.json");
        std::fs::write(&f, b"{\"a\": 1}").unwrap();
        assert_eq!(read_text(&f, 8).unwrap(), "{\"a\": 1}");
        let e = read(&f, 7).unwrap_err();
        assert!(e.to_string().contains("larger than the 7 bytes"), "{e}");
        for odd in [dir.clone(), PathBuf::from("/dev/zero")] {
            let e = read(&odd, 1 << 20).unwrap_err();
            assert!(e.to_string().contains("not a regular file"), "{e}");
            assert_eq!(e.kind(), ErrorKind::InvalidInput);
        }
        std::fs::write(&f, [b'a', 0xff, 0xfe]).unwrap();
        let e = read_text(&f, 8).unwrap_err();
        assert!(
            e.to_string()
                .contains("not UTF-8 text (bad byte at offset 1)"),
            "{e}"
        );
        assert_eq!(
            read(&dir.join("absent"), 8).unwrap_err().kind(),
            ErrorKind::NotFound
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_file_named_on_the_command_line_may_be_a_stream_but_not_an_endless_one() {
        let dir = scratch("arg");
        let f = dir.join("doc.txt");
        std::fs::write(&f, "a document").unwrap();
        assert_eq!(read_arg_text(&f, 10).unwrap(), "a document");
        let e = read_arg(&f, 9).unwrap_err();
        assert!(e.to_string().contains("larger than the 9 bytes"), "{e}");
        // A device that never ends is cut at the limit.
        let e = read_arg(Path::new("/dev/zero"), 4096).unwrap_err();
        assert!(e.to_string().contains("larger than the 4096 bytes"), "{e}");
        let e = read_arg(&dir, 4096).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        #[cfg(unix)]
        {
            // A FIFO is read as a stream: what a writer puts in it, up to its end.
            let fifo = dir.join("fifo");
            let made = std::process::Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .unwrap();
            assert!(made.success());
            let writer = {
                let fifo = fifo.clone();
                std::thread::spawn(move || std::fs::write(&fifo, "streamed text").unwrap())
            };
            assert_eq!(read_arg_text(&fifo, 64).unwrap(), "streamed text");
            writer.join().unwrap();
            // ... and refused by `read`, which never opens it.
            let e = read(&fifo, 64).unwrap_err();
            assert!(e.to_string().contains("not a regular file"), "{e}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The temporary files a write of `path` leaves in its directory.
    fn tmp_files(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.unwrap().file_name().into_string().ok())
            .filter(|n| atomic_tmp_target(n).is_some())
            .collect()
    }

    #[test]
    fn an_atomic_write_replaces_the_file_and_never_follows_a_planted_link() {
        let dir =
            std::env::temp_dir().join(format!("kura-files-{}-{}", std::process::id(), line!()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ctx.json");
        write_private_atomic(&path, b"one").unwrap();
        write_private_atomic(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        // Links where the next temporary files go: removed, not written through.
        let victim = dir.join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        #[cfg(unix)]
        {
            let next = TMP_COUNTER.load(std::sync::atomic::Ordering::Relaxed);
            for n in next..next + 64 {
                let name = format!("ctx.json.{}-{n}.tmp", std::process::id());
                std::os::unix::fs::symlink(&victim, dir.join(name)).unwrap();
            }
            write_private_atomic(&path, b"three").unwrap();
            assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
            assert_eq!(std::fs::read(&path).unwrap(), b"three");
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
            for t in tmp_files(&dir) {
                std::fs::remove_file(dir.join(t)).unwrap();
            }
        }
        // Writers at once: each write is whole, none fails, and none leaves a temporary file.
        let writers: Vec<_> = (0..8u8)
            .map(|w| {
                let path = path.clone();
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        write_private_atomic(&path, &[w; 4096]).unwrap();
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        let last = std::fs::read(&path).unwrap();
        assert!(last.len() == 4096 && last.iter().all(|&b| b == last[0]));
        assert!(tmp_files(&dir).is_empty(), "{:?}", tmp_files(&dir));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_replace_that_cannot_write_leaves_the_old_file() {
        let dir =
            std::env::temp_dir().join(format!("kura-files-{}-{}", std::process::id(), line!()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ctx.json");
        replace_private_atomic(&path, b"old").unwrap();
        replace_private_atomic(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        sync_dir(&dir).unwrap();
        // Directories where the next temporary files go: nothing can be written, and the file keeps
        // its bytes.
        let next = TMP_COUNTER.load(std::sync::atomic::Ordering::Relaxed);
        for n in next..next + 64 {
            let name = format!("ctx.json.{}-{n}.tmp", std::process::id());
            std::fs::create_dir(dir.join(name)).unwrap();
        }
        let e = replace_private_atomic(&path, b"newer").unwrap_err();
        assert!(matches!(e, ReplaceError::NotWritten(_)), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert!(sync_dir(&dir.join("absent")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn temporary_names_are_told_from_others() {
        assert_eq!(atomic_tmp_target("ctx_a.json.12-0.tmp"), Some("ctx_a.json"));
        assert_eq!(
            atomic_tmp_target("server.secret.4-17.tmp"),
            Some("server.secret")
        );
        for other in [
            "ctx_a.json",
            "ctx_a.json.tmp",
            "a.x-1.tmp",
            "a.1-.tmp",
            ".1-2.tmp",
            "1-2.tmp",
        ] {
            assert_eq!(atomic_tmp_target(other), None, "{other}");
        }
    }

    #[cfg(unix)]
    #[test]
    fn a_private_dir_is_narrowed_when_it_was_open() {
        use std::os::unix::fs::PermissionsExt;
        let dir = scratch("narrowed");
        let sub = dir.join("blocks");
        std::fs::create_dir_all(&sub).unwrap();
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o755)).unwrap();
        // A directory the user named is left as it is; one of the process's own is narrowed.
        create_private_dir(&sub).unwrap();
        let mode = std::fs::metadata(&sub).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o755);
        make_private_dir(&sub).unwrap();
        let mode = std::fs::metadata(&sub).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        let new = dir.join("new");
        create_private_dir(&new).unwrap();
        assert_eq!(
            std::fs::metadata(&new).unwrap().permissions().mode() & 0o777,
            0o700
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
