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

/// Creates `dir` (and its parents) readable by the process's user only (mode 700 where it is new).
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir)
}

/// Writes `bytes` to `path` whole or not at all, readable by the process's user only: into
/// `<path>.tmp` (a leftover one removed first; the new one created exclusively, so that a link planted
/// there is never followed), synced, renamed over `path`, and the directory synced so that the rename
/// outlives a power loss.
pub fn write_private_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != ErrorKind::NotFound => return Err(e),
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
        return Err(e);
    }
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) => std::fs::File::open(dir)?.sync_all(),
        None => std::fs::File::open(".")?.sync_all(),
    }
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

    #[test]
    fn an_atomic_write_replaces_the_file_and_never_follows_a_planted_link() {
        let dir =
            std::env::temp_dir().join(format!("kura-files-{}-{}", std::process::id(), line!()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ctx.json");
        write_private_atomic(&path, b"one").unwrap();
        write_private_atomic(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        // A link where the temporary file goes: removed, not written through.
        let victim = dir.join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(&victim, dir.join("ctx.json.tmp")).unwrap();
            write_private_atomic(&path, b"three").unwrap();
            assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
            assert_eq!(std::fs::read(&path).unwrap(), b"three");
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert!(!dir.join("ctx.json.tmp").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
