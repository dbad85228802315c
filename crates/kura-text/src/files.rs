//! Files given from outside (a model's JSON, key files, saved contexts), read with a size limit and
//! only when regular: a FIFO would block the read forever and `/dev/zero` never ends.

use std::path::Path;

/// The bytes of a file given from outside (a model's `config.json` or `tokenizer.json`, a key file, a
/// saved context), at most `max_bytes`: a path that is not a regular file (a FIFO would block the
/// read forever, `/dev/zero` never ends) or a file over the limit is an error that says so, before
/// anything is read into memory.
pub fn read_file(path: &Path, max_bytes: u64) -> std::io::Result<Vec<u8>> {
    use std::io::{Error, ErrorKind, Read};
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "not a regular file (a directory, FIFO, socket or device)",
        ));
    }
    let too_large = || {
        Error::new(
            ErrorKind::InvalidData,
            format!("larger than the {max_bytes} bytes read from such a file"),
        )
    };
    if meta.len() > max_bytes {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(max_bytes.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max_bytes {
        return Err(too_large());
    }
    Ok(bytes)
}

/// [`read_file`] as UTF-8 text.
pub fn read_text_file(path: &Path, max_bytes: u64) -> std::io::Result<String> {
    String::from_utf8(read_file(path, max_bytes)?)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

/// The most bytes read from a model's JSON files (`config.json`, `tokenizer.json`,
/// `tokenizer_config.json`): the largest tokenizers are tens of MB.
pub const MODEL_JSON_MAX_BYTES: u64 = 512 << 20;

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn files_from_outside_are_read_only_when_regular_and_within_their_limit() {
        let dir = std::env::temp_dir().join(format!("kura-text-read-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("config.json");
        std::fs::write(&f, b"{\"a\": 1}").unwrap();
        assert_eq!(read_text_file(&f, 8).unwrap(), "{\"a\": 1}");
        let e = read_file(&f, 7).unwrap_err();
        assert!(e.to_string().contains("larger than the 7 bytes"), "{e}");
        for odd in [dir.clone(), PathBuf::from("/dev/zero")] {
            let e = read_file(&odd, 1 << 20).unwrap_err();
            assert!(e.to_string().contains("not a regular file"), "{e}");
        }
        std::fs::write(&f, [0xff, 0xfe]).unwrap();
        assert!(read_text_file(&f, 8)
            .unwrap_err()
            .to_string()
            .contains("not UTF-8"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
