//! `kura plan` end to end: the real binary on the default model file, catalog names, config files, and every
//! kind of bad input getting a clear error.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::default_model;

fn kura(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kura"))
        .args(args)
        .output()
        .expect("run kura");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn json(args: &[&str]) -> serde_json::Value {
    let (ok, out, err) = kura(args);
    assert!(ok, "kura {args:?} failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

#[test]
fn plans_the_default_gguf_model_from_its_metadata() {
    let model = default_model();
    let r = json(&[
        "plan",
        "--model",
        &model,
        "--kv-cache-memory",
        "512MiB",
        "--context",
        "2048",
        "--json",
    ]);
    assert_eq!(r["num_layers"], 30);
    assert_eq!(r["num_kv_heads"], 3);
    assert_eq!(r["head_dim"], 64);
    // 2 (K, V) × 30 layers × 3 heads × 64 × 2 bytes (f16)
    assert_eq!(r["kv_bytes_per_token"], 23_040);
    assert_eq!(r["kv_bytes_per_request"], 23_040 * 2048);
    assert_eq!(r["num_blocks"], (512u64 << 20) / (23_040 * 16));
    assert_eq!(r["max_concurrency"], (512u64 << 20) / (23_040 * 2048));
    assert_eq!(r["model_max_context"], 8192);
    // Weights: what `kura serve` holds with native weights, exactly: the Q4_1 matrices in 4-bit records
    // of 16 rows × 32 columns (320 bytes), the Q8_0 embedding in 8-bit ones (576 bytes), f32 norms.
    assert_eq!(r["weights_exact"], true);
    let record = |rows: u64, cols: u64, bytes: u64| rows.div_ceil(16) * (cols / 32) * bytes;
    let layer = record(960, 576, 320)
        + record(576, 576, 320)
        + record(3072, 576, 320)
        + record(576, 1536, 320)
        + 2 * 576 * 4;
    let want = 30 * layer + record(49_152, 576, 576) + 576 * 4;
    assert_eq!(r["weights_bytes"].as_u64().unwrap(), want);
}

#[test]
fn the_table_names_every_term_of_the_breakdown() {
    let (ok, out, err) = kura(&[
        "plan",
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "L40S",
        "--context",
        "8192",
        // f16 KV is not what the GPU executor holds: the generic accelerator estimates, with a warning.
        "--kv-dtype",
        "f16",
    ]);
    assert!(ok, "{err}");
    for term in [
        "KV per token",
        "128.00 KiB",
        "1.00 GiB",
        "− weights",
        "runtime overhead",
        "activation peak",
        "= KV budget",
        "max concurrency",
        "longest context",
        "not what kura serve --device cuda would hold (--kv-dtype f16",
    ] {
        assert!(out.contains(term), "missing '{term}' in:\n{out}");
    }
}

#[test]
fn a_gpu_plan_is_kura_serve_device_cuda_s_breakdown() {
    let (ok, out, err) = kura(&["plan", "--model", "llama-3.1-8b", "--gpu", "H100"]);
    assert!(ok, "{err}");
    for term in [
        "as kura serve --device cuda uses it",
        "− weights",
        "− CUDA context, libs",
        "600.00 MiB  measured on an H100 with cuBLAS 13",
        "− activation buffers",
        "for steps of 8192 tokens over 64 sequences",
        "− reserve",
        "KV pool",
    ] {
        assert!(out.contains(term), "missing '{term}' in:\n{out}");
    }
    let r = json(&[
        "plan",
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "H100",
        "--max-num-seqs",
        "256",
        "--json",
    ]);
    let c = &r["cuda"];
    assert_eq!(c["num_blocks"], r["num_blocks"]);
    assert_eq!(c["context_bytes"], 600u64 << 20);
    // The executor's buffers for 8,192-token steps over 256 sequences: 2.087 GB (2.08 GB measured on an
    // H100); the weights as the device holds them, bf16.
    assert_eq!(c["activation_bytes"], 2_086_667_264u64);
    assert_eq!(r["activation_bytes"], 2_086_667_264u64);
    assert_eq!(c["weights_bytes"], r["weights_bytes"]);
    // A multi-GPU plan is not the single-GPU server's.
    let r = json(&[
        "plan",
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "H100",
        "--tp",
        "2",
        "--json",
    ]);
    assert!(r.get("cuda").is_none());
}

#[test]
fn config_files_and_directories_are_read() {
    let dir = std::env::temp_dir().join(format!("kura-plan-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("config.json");
    std::fs::write(&cfg, r#"{"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 32, "head_dim": 128, "vocab_size": 32000, "intermediate_size": 11008}"#).unwrap();
    // 32 layers, 32 kv heads, head dim 128, f32, batch 32, context 2,048: 64 GiB.
    for model in [cfg.to_str().unwrap(), dir.to_str().unwrap()] {
        let r = json(&[
            "plan",
            "--model",
            model,
            "--kv-dtype",
            "f32",
            "--batch",
            "32",
            "--context",
            "2048",
            "--kv-cache-memory",
            "100GiB",
            "--json",
        ]);
        assert_eq!(r["kv_bytes_total"], 64u64 << 30);
    }
    std::fs::write(&cfg, "{\"num_hidden_layers\": 2,").unwrap();
    let (ok, _, err) = kura(&["plan", "--model", cfg.to_str().unwrap(), "--memory", "1GiB"]);
    assert!(!ok && err.contains("not valid JSON"), "{err}");
    std::fs::write(
        &cfg,
        r#"{"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10}"#,
    )
    .unwrap();
    let (ok, _, err) = kura(&["plan", "--model", cfg.to_str().unwrap(), "--memory", "1GiB"]);
    assert!(!ok && err.contains("'num_hidden_layers'"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_input_gets_a_clear_error() {
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "plan",
                "--model",
                "qwen2.5-32",
                "--kv-cache-memory",
                "1GiB",
                "--context",
                "10",
            ],
            "",
        ),
        (
            &["plan", "--model", "lama-3.1-8b", "--memory", "80GiB"],
            "closest: llama-3.1-8b",
        ),
        (
            &[
                "plan",
                "--model",
                "/no/such/config.json",
                "--memory",
                "80GiB",
            ],
            "no such file",
        ),
        (
            &["plan", "--model", "llama-3.1-8b", "--gpu", "H1OO"],
            "unknown accelerator 'H1OO'",
        ),
        (
            &["plan", "--model", "llama-3.1-8b", "--memory", "12 parsecs"],
            "cannot read '12 parsecs' as a size",
        ),
        (
            &[
                "plan",
                "--model",
                "llama-3.1-8b",
                "--memory",
                "80GiB",
                "--kv-dtype",
                "f12",
            ],
            "unknown KV element format 'f12'",
        ),
        (
            &[
                "plan",
                "--model",
                "llama-3.1-8b",
                "--memory",
                "80GiB",
                "--block-size",
                "0",
            ],
            "invalid value '0' for '--block-size <BLOCK_SIZE>': `0`: a block holds 1 to 1024 tokens",
        ),
        (
            &[
                "plan",
                "--model",
                "llama-3.1-8b",
                "--memory",
                "80GiB",
                "--tp",
                "0",
            ],
            "tensor parallelism must be at least 1",
        ),
        (
            &[
                "plan",
                "--model",
                "llama-3.1-8b",
                "--memory",
                "80GiB",
                "--memory-utilization",
                "1.5",
            ],
            "--memory-utilization must be in (0, 1]",
        ),
    ];
    for (args, expected) in cases {
        let (ok, _, err) = kura(args);
        if expected.is_empty() {
            // A unique prefix of a catalog name is accepted.
            assert!(ok, "{args:?}: {err}");
        } else {
            assert!(!ok, "{args:?} should fail");
            assert!(
                err.contains(expected),
                "{args:?}: expected '{expected}' in: {err}"
            );
            assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
        }
    }
}

#[test]
fn a_model_that_does_not_fit_still_gets_its_kv_figures_and_the_shortfall() {
    // The planner's own question on a 24 GiB machine: the weights alone (65.5 GB in bf16) do not fit, and
    // the KV size is still the answer asked for.
    let args = [
        "plan",
        "--model",
        "qwen2.5-32b",
        "--context",
        "32768",
        "--kv-dtype",
        "f16",
        "--memory",
        "24GiB",
    ];
    let (ok, out, err) = kura(&args);
    assert!(ok, "{err}");
    for term in [
        "KV per token",
        "256.00 KiB",
        "KV per request  8.00 GiB (8589934592 B) at 32768 tokens",
        "does not fit",
        "short by",
    ] {
        assert!(out.contains(term), "'{term}' missing from:\n{out}");
    }
    let mut with_json = args.to_vec();
    with_json.push("--json");
    let r = json(&with_json);
    assert_eq!(r["fits"], false);
    assert_eq!(r["kv_bytes_per_request"], 8_589_934_592u64);
    assert_eq!(r["kv_bytes_per_token"], 262_144);
    assert_eq!(r["kv_bytes_total"], 8_589_934_592u64);
    assert_eq!(
        (r["kv_budget_bytes"].as_u64(), r["max_concurrency"].as_u64()),
        (Some(0), Some(0))
    );
    let short = r["short_bytes"].as_u64().unwrap();
    let needed = ["weights_bytes", "overhead_bytes", "activation_bytes"]
        .iter()
        .map(|k| r[k].as_u64().unwrap())
        .sum::<u64>();
    let usable = ((24u64 << 30) as f64 * 0.9).floor() as u64;
    assert_eq!(short, needed - usable);
}

#[test]
fn sizes_that_would_wrap_are_refused_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "plan",
                "--model",
                "llama-3.1-8b",
                "--kv-cache-memory",
                "1GiB",
                "--context",
                "18446744073709551615",
            ],
            "--context 18446744073709551615 is beyond",
        ),
        (
            &[
                "plan",
                "--model",
                "llama-3.1-8b",
                "--kv-cache-memory",
                "1GiB",
                "--context",
                "4096",
                "--batch",
                "18446744073709551615",
            ],
            "--batch 18446744073709551615 requests of 4096 tokens overflows",
        ),
        (
            &[
                "plan",
                "--model",
                "llama-3.1-8b",
                "--memory",
                "80GiB",
                "--max-batched-tokens",
                "18446744073709551615",
            ],
            "--max-batched-tokens",
        ),
    ];
    for (args, expected) in cases {
        let (ok, out, err) = kura(args);
        assert!(!ok, "{args:?} should fail, printed: {out}");
        assert!(
            err.contains(expected),
            "{args:?}: expected '{expected}' in: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // A config whose context would wrap the planner's arithmetic names its key.
    let dir = std::env::temp_dir().join(format!("kura-plan-wrap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 18446744073709551615}"#,
    )
    .unwrap();
    let (ok, _, err) = kura(&[
        "plan",
        "--model",
        cfg.to_str().unwrap(),
        "--kv-cache-memory",
        "1GiB",
    ]);
    assert!(!ok);
    assert!(
        err.contains("max_position_embeddings") && err.contains("18446744073709551615"),
        "{err}"
    );
    // An empty `.gguf` is reported as a GGUF, not as JSON.
    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let (ok, _, err) = kura(&[
        "plan",
        "--model",
        empty.to_str().unwrap(),
        "--kv-cache-memory",
        "1GiB",
    ]);
    assert!(!ok);
    assert!(!err.contains("JSON"), "{err}");
    assert!(err.contains("GGUF") || err.contains("gguf"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The default model with the type code of `blk.0.ffn_down.weight` (Q4_1) in its tensor directory set
/// to `ty`: the entry is the name, n_dims (u32), the dims (u64 each), then the type (u32).
fn retyped_default_model(dir: &std::path::Path, ty: u32) -> PathBuf {
    let mut bytes = std::fs::read(default_model()).unwrap();
    let name = b"blk.0.ffn_down.weight";
    let at = bytes
        .windows(name.len())
        .position(|w| w == name)
        .expect("the tensor's directory entry")
        + name.len();
    let n_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let ty_at = at + 4 + 8 * n_dims;
    assert_eq!(
        u32::from_le_bytes(bytes[ty_at..ty_at + 4].try_into().unwrap()),
        3,
        "Q4_1"
    );
    bytes[ty_at..ty_at + 4].copy_from_slice(&ty.to_le_bytes());
    let path = dir.join(format!("retyped-{ty}.gguf"));
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn a_gguf_the_loader_refuses_is_refused_by_plan_with_the_same_error() {
    let dir = std::env::temp_dir().join(format!("kura-plan-retyped-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (ty, expected) in [
        // An element type Kura cannot read, on a tensor the model needs.
        (
            99,
            "tensor 'blk.0.ffn_down.weight' has element type ggml type 99, which is not supported",
        ),
        // Q4_1 relabelled Q4_0: smaller than its data, which the loader would read with the wrong
        // layout.
        (2, "type or shape does not match its data"),
    ] {
        let path = retyped_default_model(&dir, ty);
        let (ok, out, err) = kura(&[
            "plan",
            "--model",
            path.to_str().unwrap(),
            "--kv-cache-memory",
            "1GiB",
        ]);
        assert!(!ok, "planned: {out}");
        assert!(err.contains(expected), "{err}");
        let (ok, out, err) = kura(&[
            "generate",
            "--model",
            path.to_str().unwrap(),
            "--prompt",
            "Hi",
            "--max-tokens",
            "1",
        ]);
        assert!(!ok, "generated: {out}");
        assert!(err.contains(expected), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn context_beyond_the_model_maximum_warns_and_still_computes() {
    let r = json(&[
        "plan",
        "--model",
        "llama-2-7b",
        "--context",
        "8192",
        "--kv-cache-memory",
        "40GiB",
        "--json",
    ]);
    assert_eq!(r["kv_bytes_per_request"], 4u64 << 30);
    assert!(r["warnings"][0]
        .as_str()
        .unwrap()
        .contains("exceeds the model's maximum of 4096"));
}

/// The number just after `label` on the table line that starts with it.
fn figure_after(table: &str, label: &str) -> u64 {
    let line = table
        .lines()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("no '{label}' line in:\n{table}"));
    line.trim_start()[label.len()..]
        .split_whitespace()
        .next()
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no number after '{label}' in: {line}"))
}

#[test]
fn guaranteed_scheduling_reports_the_requests_admitted_with_every_block_reserved() {
    // Contexts around block boundaries: a request of C tokens holds C − 1 of KV (its last token is never
    // fed back), so 1025 tokens reserve 64 blocks of 16, and 17 tokens one.
    for (context, block) in [(1000u64, 16u64), (1025, 16), (17, 16), (3000, 32)] {
        let (context_s, block_s) = (context.to_string(), block.to_string());
        let args = [
            "plan",
            "--model",
            "smollm2-135m",
            "--kv-cache-memory",
            "64MiB",
            "--context",
            &context_s,
            "--block-size",
            &block_s,
        ];
        let (ok, out, err) = kura(&[&args[..], &["--scheduling", "guaranteed"]].concat());
        assert!(ok, "{err}");
        let num_blocks = figure_after(&out, "KV cache");
        let per_request = (context - 1).div_ceil(block);
        let admitted = figure_after(&out, "guaranteed admission");
        assert_eq!(admitted, num_blocks / per_request, "{out}");
        assert!(
            out.contains(&format!(
                "{admitted} requests of {context} tokens at once (--scheduling guaranteed: \
                 {per_request} blocks reserved per request"
            )),
            "{out}"
        );

        let r = json(&[&args[..], &["--scheduling", "guaranteed", "--json"]].concat());
        assert_eq!(r["scheduling"], "guaranteed");
        assert_eq!(r["num_blocks"], num_blocks);
        assert_eq!(r["guaranteed_admission"]["blocks_per_request"], per_request);
        assert_eq!(r["guaranteed_admission"]["max_concurrency"], admitted);

        // The default says nothing of it.
        let (ok, out, err) = kura(&args);
        assert!(ok, "{err}");
        assert!(!out.contains("guaranteed"), "{out}");
        let r = json(&[&args[..], &["--json"]].concat());
        assert_eq!(r["scheduling"], "max-utilization");
        assert!(r["guaranteed_admission"].is_null());
    }
}
