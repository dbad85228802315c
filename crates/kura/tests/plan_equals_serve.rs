//! Plan equals serve: for the same model and flags, `kura plan` and `kura serve` give the same KV layout
//! and the same pool (blocks, tokens, max concurrency). The planner reads shapes with
//! `kura_plan::spec::ModelSpec`, the runtime with `kura_model::ModelConfig`: for every config the runtime
//! can load, the two readers must agree layer by layer; and on the default GGUF the real binary's two
//! commands must print the same pool.

mod common;

use std::process::Command;

use kura_kv::codec::KvDtype;
use kura_model::ModelConfig;
use kura_plan::spec::ModelSpec;
use kura_plan::PlanRequest;

use common::{number_before, serve_line, start_serve};

/// A Llama-family config of `layers` layers with `extra` keys added.
fn config(model_type: &str, layers: usize, extra: &str) -> String {
    format!(
        r#"{{"model_type":"{model_type}","architectures":["X"],"hidden_size":256,"intermediate_size":512,
            "num_hidden_layers":{layers},"num_attention_heads":8,"num_key_value_heads":2,"vocab_size":1000,
            "max_position_embeddings":4096,"rms_norm_eps":1e-6,"rope_theta":10000.0{extra}}}"#
    )
}

#[test]
fn the_planner_and_the_runtime_read_the_same_layout_and_pool() {
    let cases = [
        ("llama", config("llama", 4, "")),
        (
            "qwen2 without use_sliding_window",
            config("qwen2", 4, r#","sliding_window":1024"#),
        ),
        (
            "qwen2 sliding from max_window_layers",
            config(
                "qwen2",
                4,
                r#","sliding_window":1024,"use_sliding_window":true,"max_window_layers":2"#,
            ),
        ),
        (
            "qwen2 sliding with the default max_window_layers (28)",
            config(
                "qwen2",
                30,
                r#","sliding_window":1024,"use_sliding_window":true"#,
            ),
        ),
        (
            "qwen2 layer_types",
            config(
                "qwen2",
                3,
                r#","sliding_window":1024,"use_sliding_window":true,
                   "layer_types":["full_attention","sliding_attention","full_attention"]"#,
            ),
        ),
        (
            "mistral window below the context",
            config("mistral", 4, r#","sliding_window":1024"#),
        ),
        (
            "mistral window of the whole context",
            config("mistral", 4, r#","sliding_window":4096"#),
        ),
    ];
    for (what, text) in cases {
        let config = ModelConfig::from_hf_json(&text)
            .unwrap_or_else(|e| panic!("{what}: runtime refuses: {e}"));
        let runtime = config.kv_layout(KvDtype::F16, 16).unwrap();
        let spec = ModelSpec::from_hf_config_str(&text, what, "test")
            .unwrap_or_else(|e| panic!("{what}: planner refuses: {e}"));
        // One reading: the runtime keeps the planner's shape as it is (the name aside).
        let kept = config.shape();
        assert_eq!(
            (
                &kept.layer_attention,
                kept.max_context,
                kept.num_kv_heads,
                kept.head_dim
            ),
            (
                &spec.layer_attention,
                spec.max_context,
                spec.num_kv_heads,
                spec.head_dim
            ),
            "{what}"
        );
        let planned = spec.kv_layout(KvDtype::F16, 16).unwrap();
        assert_eq!(planned.layers, runtime.layers, "{what}");

        // The pool for 64 MiB at 4,096 tokens a request, as each side computes it.
        let budget = 64u64 << 20;
        let mut req = PlanRequest::new(spec);
        req.kv_cache_memory = Some(budget);
        req.context = Some(4096);
        let plan = req.plan().unwrap();
        let pool = runtime.whole_model_pool();
        assert_eq!(
            plan.num_blocks,
            pool.num_blocks_for_budget(budget),
            "{what}"
        );
        assert_eq!(
            plan.whole_model_max_concurrency,
            pool.max_concurrency(budget, 4096),
            "{what}"
        );
        // A model with sliding layers is served from the hybrid pool (sliding layers paged apart), which
        // the planner counts the same way; the others from whole-model blocks.
        let hybrid = kura_plan::hybrid_pool_for(&runtime, budget, false, false);
        assert_eq!(hybrid.is_some(), runtime.has_sliding_window(), "{what}");
        let served = if hybrid.is_some() { &runtime } else { &pool };
        assert_eq!(
            plan.max_concurrency,
            served.max_concurrency(budget, 4096),
            "{what}"
        );
        assert_eq!(
            plan.kv_bytes_per_request,
            served.bytes_for_sequence(4096).unwrap(),
            "{what}"
        );
        assert_eq!(
            plan.hybrid_pool.as_ref().map(|h| h.num_pages),
            hybrid.map(|w| u64::from(w.num_pages)),
            "{what}"
        );
    }
}

/// The `KV cache: …` line `kura serve` logs at start (the process is killed once it is read).
fn serve_pool_line(args: &[&str]) -> String {
    serve_line(start_serve(args), "KV cache:")
        .unwrap_or_else(|seen| panic!("kura serve logged no KV cache line:\n{}", seen.join("\n")))
}

/// In every KV format the server stores (the quantised ones included), the real binary's `kura plan` and
/// `kura serve` print the same pool, and a quantised pool's start-up log says what it gained over bf16.
#[test]
fn kura_plan_and_kura_serve_print_the_same_pool_for_the_default_model() {
    let model = &common::default_model();
    let mut bf16_blocks = 0;
    for dtype in ["bf16", "int8", "fp8", "int4"] {
        let out = Command::new(env!("CARGO_BIN_EXE_kura"))
            .args(["plan", "--model", model, "--kv-cache-memory", "96MiB"])
            .args(["--context", "2048", "--kv-dtype", dtype, "--json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let flags = [
            "--model",
            model,
            "--kv-cache-memory",
            "96MiB",
            "--max-model-len",
            "2048",
            "--kv-dtype",
            dtype,
        ];
        let line = serve_pool_line(&flags);
        let blocks = number_before(&line, "blocks of");
        assert_eq!(
            plan["num_blocks"].as_u64().unwrap(),
            blocks,
            "{dtype}: {line}"
        );
        assert_eq!(
            plan["max_tokens_in_pool"].as_u64().unwrap(),
            number_before(&line, "tokens, max concurrency"),
            "{dtype}: {line}"
        );
        let concurrency: u64 = line
            .split("per request: ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no concurrency in: {line}"));
        assert_eq!(
            plan["max_concurrency"].as_u64().unwrap(),
            concurrency,
            "{dtype}: {line}"
        );
        if dtype == "bf16" {
            bf16_blocks = blocks;
            continue;
        }
        let gain = serve_line(start_serve(&flags), "the tokens bf16 would hold")
            .unwrap_or_else(|seen| panic!("{dtype}: no capacity line:\n{}", seen.join("\n")));
        assert!(
            gain.contains(&format!("{blocks} blocks instead of {bf16_blocks}")),
            "{dtype}: {gain}"
        );
        let ratio = blocks as f64 / bf16_blocks as f64;
        assert!(gain.contains(&format!("{ratio:.2}×")), "{dtype}: {gain}");
        assert!(
            ratio >= if dtype == "int4" { 3.5 } else { 1.9 },
            "{dtype}: {ratio}"
        );
    }
}

/// For a model with sliding layers (the tiny Qwen2 with one full and one sliding layer), the real
/// binary's `kura plan` and `kura serve` give the same hybrid pool: its pages, and the requests of the
/// context it holds next to what a whole-model pool would.
#[test]
fn kura_plan_and_kura_serve_print_the_same_hybrid_pool() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../kura-model/tests/data/tiny-qwen2-swa");
    let dir = dir.to_str().unwrap();
    for (memory, block) in [("256KiB", "2"), ("1MiB", "16")] {
        let out = Command::new(env!("CARGO_BIN_EXE_kura"))
            .args(["plan", "--model", dir, "--kv-cache-memory", memory])
            .args(["--context", "256", "--block-size", block, "--json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let flags = [
            "--model",
            dir,
            "--kv-cache-memory",
            memory,
            "--max-model-len",
            "256",
            "--block-size",
            block,
        ];
        let line = serve_line(start_serve(&flags), "hybrid pool of")
            .unwrap_or_else(|seen| panic!("no hybrid pool line:\n{}", seen.join("\n")));
        let pages = number_before(&line, "pages (one layer");
        assert_eq!(
            plan["hybrid_pool"]["num_pages"].as_u64(),
            Some(pages),
            "{line}"
        );
        let after = |marker: &str| -> u64 {
            line.split(marker)
                .nth(1)
                .and_then(|r| {
                    r.split(|c: char| !c.is_ascii_digit())
                        .find(|s| !s.is_empty())
                })
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no '{marker}' in: {line}"))
        };
        let concurrency = after("per request: ");
        let whole = after("a whole-model pool: ");
        assert_eq!(
            plan["max_concurrency"].as_u64(),
            Some(concurrency),
            "{line}"
        );
        assert_eq!(
            plan["whole_model_max_concurrency"].as_u64(),
            Some(whole),
            "{line}"
        );
        // One full layer of two: at 256 tokens the sliding layer holds a window of 8, so the hybrid pool
        // holds nearly twice the requests.
        assert!(concurrency * 10 >= whole * 17, "{line}");
    }
}
