//! Where `kura serve` and `kura router` take their keys and secrets from: flags naming files, or the
//! environment, never only argv (which every user of the machine can read in `ps`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use kura_kv::Secret;

/// The most bytes read from a key, secret or URL file.
pub const SECRET_FILE_MAX_BYTES: u64 = 1 << 20;
/// The environment variable that may hold the fleet secret instead of `--fleet-secret-file`.
pub const FLEET_SECRET_ENV: &str = "KURA_FLEET_SECRET";
/// The environment variable that may hold the operator key instead of `--admin-api-key-file`.
pub const ADMIN_KEY_ENV: &str = "KURA_ADMIN_API_KEY";

/// Warns when a file holding a secret can be read by other users.
pub fn warn_if_shared(path: &Path, what: &str) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(meta) = std::fs::metadata(path) {
            if meta.permissions().mode() & 0o077 != 0 {
                tracing::warn!(
                    "{what} {} can be read by other users (mode {:o}); `chmod 600` it",
                    path.display(),
                    meta.permissions().mode() & 0o777
                );
            }
        }
    }
}

/// The fleet's secret: the content of `file`, else of `$KURA_FLEET_SECRET`, else none.
pub fn fleet_secret(file: Option<&PathBuf>) -> Result<Option<Secret>> {
    if let Some(path) = file {
        let text = kura_files::read_text(path, SECRET_FILE_MAX_BYTES)
            .with_context(|| format!("reading --fleet-secret-file {}", path.display()))?;
        warn_if_shared(path, "--fleet-secret-file");
        let secret = Secret::from_text(&text)
            .map_err(|e| anyhow::anyhow!("--fleet-secret-file {}: {e}", path.display()))?;
        return Ok(Some(secret));
    }
    match std::env::var(FLEET_SECRET_ENV) {
        Ok(text) => Secret::from_text(&text)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("${FLEET_SECRET_ENV}: {e}")),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => bail!("${FLEET_SECRET_ENV} is not UTF-8"),
    }
}

/// The server's own secret kept beside the disk tier's metadata (`<dir>/server.secret`, 32 random bytes,
/// readable by the server's user only): made on first use, the same after every restart.
pub fn server_secret(disk_dir: &Path) -> Result<Secret> {
    let path = disk_dir.join("server.secret");
    match kura_files::read(&path, 4096) {
        Ok(bytes) => {
            let bytes: [u8; 32] = bytes.as_slice().try_into().map_err(|_| {
                anyhow::anyhow!(
                    "{} holds {} bytes, not the 32 of a server secret: restore it from a backup, or \
                     delete it to make a new one (tenants' saved contexts then lose their owner)",
                    path.display(),
                    bytes.len()
                )
            })?;
            Ok(Secret::from_bytes(bytes))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            kura_files::create_private_dir(disk_dir)
                .with_context(|| format!("creating {}", disk_dir.display()))?;
            // What a first start killed while it wrote the secret left behind.
            for entry in std::fs::read_dir(disk_dir)
                .with_context(|| format!("reading {}", disk_dir.display()))?
                .flatten()
            {
                let name = entry.file_name();
                if name.to_str().and_then(kura_files::atomic_tmp_target) == Some("server.secret") {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
            let secret = Secret::random();
            kura_files::write_private_atomic(&path, &secret.to_bytes())
                .with_context(|| format!("writing {}", path.display()))?;
            Ok(secret)
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Keys of a key file, each with its line number (from 1): one per line, blank lines and `#` comments
/// ignored.
fn numbered_keys(text: &str) -> Vec<(usize, String)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
        .map(|(i, l)| (i, l.to_string()))
        .collect()
}

/// The reason given for a key that [`sendable`] refuses.
const UNSENDABLE: &str = "a key must be visible ASCII characters, without spaces, as an HTTP \
                          header carries it; this one could never be sent";

/// Whether a client can send `key`: an `Authorization: Bearer` or `x-api-key` header carries visible
/// ASCII (a key of other characters, or with a space inside, could never match).
fn sendable(key: &str) -> bool {
    key.bytes().all(|b| b.is_ascii_graphic())
}

/// The keys given as `flag` values and in `file` (`flag_name`'s file flag), checked: none empty, and a
/// file given must hold at least one (a file that names none would start without authentication).
pub fn read_keys(given: &[String], file: Option<&PathBuf>, flag_name: &str) -> Result<Vec<String>> {
    let mut keys: Vec<String> = given.iter().map(|k| k.trim().to_string()).collect();
    if keys.iter().any(|k| k.is_empty()) {
        bail!("--{flag_name} must not be empty");
    }
    if let Some(i) = keys.iter().position(|k| !sendable(k)) {
        bail!("--{flag_name} (the {} given): {UNSENDABLE}", ordinal(i + 1));
    }
    if let Some(path) = file {
        let text = kura_files::read_text(path, SECRET_FILE_MAX_BYTES)
            .with_context(|| format!("reading --{flag_name}-file {}", path.display()))?;
        warn_if_shared(path, &format!("--{flag_name}-file"));
        let from_file = numbered_keys(&text);
        if let Some((line, _)) = from_file.iter().find(|(_, k)| !sendable(k)) {
            bail!(
                "--{flag_name}-file {} line {line}: {UNSENDABLE}",
                path.display()
            );
        }
        if from_file.is_empty() {
            let noun = match flag_name {
                "api-key" => "API key",
                _ => "key",
            };
            // A key the process presents to others, or one it checks.
            let consequence = match flag_name {
                "replica-admin-key" => {
                    "the router could not read the replicas' KV events. Put the replicas' operator \
                     key in it"
                }
                _ => {
                    "the server would run without authentication. Put one key per line, or drop \
                     the flag to run without keys on purpose"
                }
            };
            bail!(
                "--{flag_name}-file {} holds no {noun} (only blank lines or # comments); \
                 {consequence}",
                path.display()
            );
        }
        keys.extend(from_file.into_iter().map(|(_, k)| k));
    }
    // A key given twice is one key: counted once.
    let before = keys.len();
    let mut seen = std::collections::HashSet::new();
    keys.retain(|k| seen.insert(k.clone()));
    if keys.len() < before {
        tracing::warn!(
            "--{flag_name}: {} key(s) given more than once, counted once",
            before - keys.len()
        );
    }
    Ok(keys)
}

/// `1st`, `2nd`, `3rd`, `4th`, ...
fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (1, 11) | (2, 12) | (3, 13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// The operator keys: `--admin-api-key`, `--admin-api-key-file`, else `$KURA_ADMIN_API_KEY`.
pub fn admin_keys(given: &[String], file: Option<&PathBuf>) -> Result<Vec<String>> {
    let mut keys = read_keys(given, file, "admin-api-key")?;
    if keys.is_empty() {
        if let Ok(key) = std::env::var(ADMIN_KEY_ENV) {
            let key = key.trim();
            if key.is_empty() {
                bail!("${ADMIN_KEY_ENV} is set but empty");
            }
            keys.push(key.to_string());
        }
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_file_of_comments_and_blank_lines_holds_no_key() {
        assert!(numbered_keys("# keys\n\n   \n# none yet\n").is_empty());
        assert_eq!(
            numbered_keys("a\n  b  \n#c\n"),
            vec![(1, "a".to_string()), (2, "b".to_string())]
        );
    }

    #[test]
    fn the_server_secret_is_made_once_private_and_kept() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("kura-secret-{}", std::process::id()));
        let first = server_secret(&dir).unwrap();
        let file = dir.join("server.secret");
        assert_eq!(
            std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(server_secret(&dir).unwrap().to_bytes(), first.to_bytes());
        std::fs::write(&file, b"short").unwrap();
        let err = server_secret(&dir).unwrap_err();
        assert!(format!("{err:#}").contains("holds 5 bytes"), "{err:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_empty_key_and_an_empty_key_file_are_refused_by_flag() {
        let err = read_keys(&[" ".into()], None, "api-key").unwrap_err();
        assert!(err.to_string().contains("--api-key must not be empty"));
        let dir = std::env::temp_dir().join(format!("kura-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys");
        std::fs::write(&file, "# none\n").unwrap();
        let err = read_keys(&[], Some(&file), "admin-api-key").unwrap_err();
        assert!(err.to_string().contains("--admin-api-key-file"), "{err:#}");
        // A key no header can carry is refused by its line; one given twice counts once.
        std::fs::write(&file, "# keys\nkey-a\n\nключ\n").unwrap();
        let err = read_keys(&[], Some(&file), "api-key").unwrap_err();
        assert!(
            err.to_string()
                .contains("line 4: a key must be visible ASCII"),
            "{err:#}"
        );
        let err = read_keys(&["key a".into()], None, "api-key").unwrap_err();
        assert!(
            err.to_string().contains("--api-key (the 1st given)"),
            "{err:#}"
        );
        std::fs::write(&file, "key-a\nkey-b\nkey-a\n").unwrap();
        let keys = read_keys(&["key-b".into()], Some(&file), "api-key").unwrap();
        assert_eq!(keys, vec!["key-b", "key-a"]);
        std::fs::write(&file, "tiny\n").unwrap();
        let err = fleet_secret(Some(&file)).unwrap_err();
        assert!(format!("{err:#}").contains("at least 32"), "{err:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
