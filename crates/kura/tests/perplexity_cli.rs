//! `kura perplexity` end to end on the real model and the real evaluation text (scripts/test.sh fetches it
//! with scripts/fetch-eval-text.sh; a missing text fails the test): the f32 format measured against the
//! f32 reference is exact, int8 and int4 cost what their bits say, and bad input is a clear error.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn kura_perplexity(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kura"))
        .arg("perplexity")
        .args(args)
        .args(["--threads", "2"])
        .output()
        .expect("run kura perplexity");
    (
        out.status
            .code()
            .expect("kura perplexity was killed by a signal"),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn eval_text() -> PathBuf {
    let path = std::env::var_os("KURA_EVAL_TEXT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("KURA_CACHE_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    let home = std::env::var_os("HOME").expect("HOME is set");
                    PathBuf::from(home).join(".cache/kura")
                });
            cache.join("text/canterbury-alice29-lcet10.txt")
        });
    assert!(
        path.exists(),
        "evaluation text missing at {}: run scripts/fetch-eval-text.sh (or set KURA_EVAL_TEXT)",
        path.display()
    );
    path
}

#[test]
fn formats_are_measured_against_the_f32_reference() {
    let text = eval_text();
    let (code, out, err) = kura_perplexity(&[
        "--text",
        text.to_str().unwrap(),
        "--context",
        "128",
        "--chunks",
        "2",
        "--kv-dtype",
        "f32,int8,int4",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let r: Value = serde_json::from_str(&out).expect("one JSON object");
    // Second halves of 2 chunks of 128 tokens.
    assert_eq!(r["scored_tokens"], 128);
    assert_eq!(r["chunks"], 2);
    assert!(
        r["text_tokens"].as_u64().unwrap() >= 100_000,
        "{}",
        r["text_tokens"]
    );
    let reference = r["reference_perplexity"].as_f64().unwrap();
    assert!(reference > 1.0 && reference < 1000.0, "{reference}");
    let f = &r["formats"];
    let get = |i: usize, k: &str| f[i][k].as_f64().unwrap();
    // f32 KV in lockstep with the f32 reference: the same bits, so nothing differs.
    assert_eq!(f[0]["kv_dtype"], "f32");
    assert_eq!(get(0, "perplexity"), reference);
    assert_eq!(get(0, "kl_mean"), 0.0);
    assert_eq!(get(0, "top1_agreement"), 1.0);
    // Quantised KV moves the distributions, int4 more than int8, and saves the bytes it says.
    assert_eq!(f[1]["kv_dtype"], "int8");
    assert_eq!(f[2]["kv_dtype"], "int4");
    assert!(get(1, "kl_mean") > 0.0, "{}", f[1]);
    assert!(get(2, "kl_mean") > get(1, "kl_mean"), "{f}");
    assert!(get(1, "top1_agreement") > 0.9, "{}", f[1]);
    let bytes = |i: usize| f[i]["kv_bytes_per_token"].as_u64().unwrap();
    // SmolLM2: 30 layers × 2 × 3 KV heads × (64 elements): f32 256 B, int8 64 + 2, int4 32 + 4.
    assert_eq!((bytes(0), bytes(1), bytes(2)), (46_080, 11_880, 6_480));
}

#[test]
fn bad_input_is_a_clear_error() {
    let text = eval_text();
    let text = text.to_str().unwrap();
    let dir = std::env::temp_dir().join(format!("kura-ppl-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let binary = dir.join("binary.txt");
    std::fs::write(&binary, [0xFFu8, 0xFE, 0x00, 0x41]).unwrap();
    let short = dir.join("short.txt");
    std::fs::write(&short, "Too short to hold a chunk.").unwrap();
    let missing = dir.join("missing.txt");
    for (args, want) in [
        (vec!["--text", missing.to_str().unwrap()], "reading --text"),
        (
            vec!["--text", binary.to_str().unwrap()],
            "not UTF-8 text (bad byte at offset 0)",
        ),
        (
            vec!["--text", short.to_str().unwrap()],
            "fewer than one chunk",
        ),
        (
            vec!["--text", text, "--context", "1"],
            "--context 1 is too short",
        ),
        (
            vec!["--text", text, "--context", "100000"],
            "longer than the model's context",
        ),
        (
            vec!["--text", text, "--chunks", "0"],
            "--chunks must be at least 1",
        ),
        (
            vec!["--text", text, "--kv-dtype", "int3"],
            "unknown KV element format 'int3'",
        ),
    ] {
        let (code, _, err) = kura_perplexity(&args);
        assert_ne!(code, 0, "{args:?}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--device` that names no device, a GPU this machine does not have, or a KV format the GPU pool does
/// not hold: a clear error naming it, never a panic.
#[test]
fn a_device_that_is_not_there_or_a_format_it_lacks_is_a_clear_error() {
    let text = eval_text();
    let t = text.to_str().unwrap();
    let base = ["--text", t, "--context", "128", "--chunks", "1"];
    let (code, _, err) = kura_perplexity(&[&base[..], &["--device", "gpu0"]].concat());
    assert_ne!(code, 0);
    assert!(err.contains("--device") && err.contains("cuda:N"), "{err}");
    let (code, _, err) = kura_perplexity(&[&base[..], &["--device", "cuda:99"]].concat());
    assert_ne!(code, 0);
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("cuda:99"), "{err}");
    let (code, _, err) =
        kura_perplexity(&[&base[..], &["--device", "cuda", "--kv-dtype", "bf16,int8"]].concat());
    assert_ne!(code, 0);
    assert!(
        err.contains("--kv-dtype int8") && err.contains("--device cpu"),
        "{err}"
    );
}
