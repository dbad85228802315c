//! `kura serve --kv-cache-memory` on the real binary and the default model: a request this machine
//! cannot hold exits with an error that says what is needed, what is available and which flag to change,
//! instead of being killed by the kernel (1TB, 100%) or aborting in the allocator (u64::MAX bytes).

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn model() -> PathBuf {
    let p = std::env::var_os("KURA_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from("/root/.cache/kura/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        p.is_file(),
        "the model is missing at {} (set KURA_MODEL, or run scripts/fetch-model.sh)",
        p.display()
    );
    p
}

/// Runs `kura serve` with `--kv-cache-memory <memory>` and returns its exit code and stderr. A server
/// that starts instead of refusing is killed (after a generous wait) and fails the test.
fn serve_with(memory: &str) -> (i32, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kura"))
        .args([
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--threads",
            "1",
        ])
        .arg("--model")
        .arg(model())
        // `=`: a value such as `-1` must reach the flag, not be taken for another flag.
        .arg(format!("--kv-cache-memory={memory}"))
        .env("KURA_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kura serve");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for kura serve") {
            break status;
        }
        if started.elapsed() > Duration::from_secs(300) {
            child.kill().ok();
            child.wait().ok();
            panic!("kura serve --kv-cache-memory {memory} is still running: it did not refuse");
        }
        // Poll interval: the 300 s deadline only turns a server that starts into a failure.
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let code = status.code().unwrap_or_else(|| {
        panic!(
            "kura serve --kv-cache-memory {memory} was killed by signal {:?} (core dumped: {}):\n{stderr}",
            status.signal(),
            status.core_dumped()
        )
    });
    (code, stderr)
}

fn assert_refused(memory: &str, asks_for: &str) {
    let (code, stderr) = serve_with(memory);
    assert_eq!(code, 1, "kura serve --kv-cache-memory {memory}:\n{stderr}");
    let expected = format!("error: --kv-cache-memory {memory} asks for {asks_for} but ");
    assert!(stderr.contains(&expected), "{memory}: {stderr}");
    for part in [
        "is available (",
        "must stay free",
        "give at most --kv-cache-memory ",
    ] {
        assert!(stderr.contains(part), "{memory}: no {part:?} in {stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_terabyte_is_refused_before_anything_is_allocated() {
    assert_refused("1TB", "931.32 GiB");
}

#[test]
fn u64_max_bytes_is_refused_not_aborted() {
    assert_refused("18446744073709551615", "16777216.00 TiB");
}

#[test]
fn all_of_the_memory_is_refused_with_the_largest_share_that_fits() {
    let (code, stderr) = serve_with("100%");
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("error: --kv-cache-memory 100% asks for "),
        "{stderr}"
    );
    assert!(stderr.contains("must stay free"), "{stderr}");
    assert!(stderr.contains("(or 9"), "no largest share in {stderr}");
}

#[test]
fn nonsense_is_refused_naming_the_flag() {
    for (memory, why) in [
        ("0", "is no memory at all"),
        ("150%", "a percentage in (0%, 100%]"),
        ("-1", "must be a non-negative number"),
        ("NaN", "not a number"),
    ] {
        let (code, stderr) = serve_with(memory);
        assert_eq!(code, 1, "{memory}: {stderr}");
        assert!(
            stderr.contains(&format!("error: --kv-cache-memory \"{memory}\""))
                && stderr.contains(why),
            "{memory}: {stderr}"
        );
    }
}
