//! `kura plan` with `kura serve`'s lower-tier flags (`--kv-host-memory`, `--kv-disk-path`, `--kv-disk-size`,
//! `--kv-offload-policy`, `--preemption-mode`), end to end on the default model file: the real binary's
//! plan gives the tiers `kura serve` logs for the same flags, and bad flags get the same errors from both.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{default_model, number_before, serve_line, start_serve};

/// A directory of this test's own, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("kura-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn plan(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kura"))
        .arg("plan")
        .args(args)
        .output()
        .expect("run kura plan")
}

fn plan_json(args: &[&str]) -> serde_json::Value {
    let out = plan(&[args, &["--json"]].concat());
    assert!(
        out.status.success(),
        "kura plan {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn plan_gives_the_tiers_serve_logs_for_the_same_flags() {
    let model = default_model();
    let dir = TempDir::new("plan-tiers-disk");
    let disk = dir.0.to_str().unwrap();
    let flags = [
        "--model",
        &model,
        "--kv-cache-memory",
        "64MiB",
        "--kv-dtype",
        "bf16",
        "--kv-host-memory",
        "256MiB",
        "--kv-disk-path",
        disk,
        "--kv-disk-size",
        "1GiB",
    ];
    let p = plan_json(&flags);
    let t = &p["kv_tiers"];
    // bf16, blocks of 16: 2 (K, V) × 30 layers × 3 KV heads × 64 × 2 bytes × 16 = 368,640 bytes a block;
    // 256 MiB holds 728 of them; a block file adds a 116-byte header and 4 bytes per token (180 bytes),
    // and 1 GiB holds 2,911 such files.
    assert_eq!(p["bytes_per_block_per_device"], 368_640);
    assert_eq!(t["host_blocks"], 728, "{t}");
    assert_eq!(t["host_tokens"], 728 * 16);
    assert_eq!(t["host_bytes"], 728 * 368_640);
    assert_eq!(t["host_memory_bytes"], 256u64 << 20);
    assert_eq!(t["host_in_breakdown"], false);
    assert_eq!(t["disk_blocks"], 2911, "{t}");
    assert_eq!(t["disk_tokens"], 2911 * 16);
    assert_eq!(t["disk_block_file_bytes"], 368_640 + 180);
    assert_eq!(t["disk_bytes"], 2911 * (368_640 + 180));
    assert_eq!(t["disk_size_bytes"], 1u64 << 30);
    assert_eq!(t["disk_path"], disk);
    assert_eq!(t["offload_policy"], "write-back");
    assert_eq!(t["offload_min_hits"], serde_json::Value::Null);
    assert_eq!(t["preemption_mode"], "swap");
    // The plan does not touch the disk tier's directory.
    assert!(!dir.0.exists());

    // What `kura serve` logs for the same flags.
    let line = serve_line(start_serve(&flags), "KV tiers:")
        .unwrap_or_else(|seen| panic!("kura serve logged no KV tiers line:\n{}", seen.join("\n")));
    assert_eq!(number_before(&line, "blocks = "), 728, "{line}");
    let disk_part = &line[line.find("disk (L3)").unwrap()..];
    assert_eq!(number_before(disk_part, "blocks = "), 2911, "{line}");
    assert_eq!(number_before(&line, "bytes per block"), 368_640, "{line}");
    assert!(line.contains("preemption swap"), "{line}");
    for (what, json) in [
        (&line[..line.find("disk (L3)").unwrap()], &t["host_tokens"]),
        (disk_part, &t["disk_tokens"]),
    ] {
        assert_eq!(
            number_before(what, "tokens"),
            json.as_u64().unwrap(),
            "{line}"
        );
    }

    // The table says the same, and where the host tier's memory is.
    let out = plan(&flags);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for part in [
        "Lower KV tiers",
        "host (L2)            728 blocks = 11648 tokens",
        "host memory on top of the KV pool; on this CPU build both are RAM",
        "disk (L3)            2911 blocks = 46576 tokens",
        "a 180-byte header",
        "offload policy       write-back",
        "preemption           swap",
    ] {
        assert!(text.contains(part), "no {part:?} in:\n{text}");
    }
}

#[test]
fn on_this_machine_the_host_tier_is_a_term_of_the_memory_breakdown() {
    let model = default_model();
    let base = ["--model", &model, "--kv-dtype", "bf16", "--memory", "2GiB"];
    let without = plan_json(&base);
    let with = plan_json(&[&base[..], &["--kv-host-memory", "256MiB"]].concat());
    let host = with["kv_tiers"]["host_bytes"].as_u64().unwrap();
    assert_eq!(host, 728 * 368_640);
    assert_eq!(with["kv_tiers"]["host_in_breakdown"], true);
    assert_eq!(
        with["kv_budget_bytes"].as_u64().unwrap() + host,
        without["kv_budget_bytes"].as_u64().unwrap()
    );
    let out = plan(&[&base[..], &["--kv-host-memory", "256MiB"]].concat());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("− host KV tier (L2)"), "{text}");
    assert!(text.contains("(counted above)"), "{text}");

    // A host tier beyond what the model leaves: no pool, and the warning names the flag.
    let big = plan_json(&[&base[..], &["--kv-host-memory", "1800MiB"]].concat());
    assert_eq!(big["fits"], false);
    assert_eq!(big["num_blocks"], 0);
    let warning = big["warnings"][0].as_str().unwrap();
    assert!(
        warning.starts_with("the host KV tier does not fit")
            && warning.contains("--kv-host-memory"),
        "{warning}"
    );
}

#[test]
fn bad_tier_flags_get_the_same_errors_from_plan_and_serve() {
    let model = default_model();
    let dir = TempDir::new("plan-tiers-bad");
    let disk = dir.0.to_str().unwrap();
    for (flags, expected) in [
        (
            vec!["--kv-disk-path", disk, "--kv-disk-size", "0"],
            "--kv-disk-size must be more than 0 bytes",
        ),
        (
            vec!["--preemption-mode", "swap"],
            "--preemption-mode swap needs a host tier",
        ),
        (
            vec!["--kv-offload-policy", "write-through"],
            "--kv-offload-policy write-through needs a lower tier",
        ),
        (
            vec!["--kv-store-ahead", "8"],
            "--kv-store-ahead needs a host tier to store into",
        ),
        (
            vec!["--kv-disk-path", disk, "--kv-disk-size", "100"],
            "--kv-disk-size 100 B holds no KV block",
        ),
    ] {
        let common = [
            "--model",
            &model,
            "--kv-cache-memory",
            "64MiB",
            "--kv-dtype",
            "bf16",
        ];
        let args = [&common[..], &flags].concat();
        let out = plan(&args);
        assert!(!out.status.success(), "{flags:?}");
        let plan_err = String::from_utf8_lossy(&out.stderr).trim().to_string();
        assert!(plan_err.contains(expected), "{flags:?}: {plan_err}");
        let serve_err = serve_line(start_serve(&args), "error:").unwrap_or_else(|seen| {
            panic!("kura serve {flags:?} gave no error:\n{}", seen.join("\n"))
        });
        assert_eq!(serve_err.trim(), plan_err, "{flags:?}");
    }
}
