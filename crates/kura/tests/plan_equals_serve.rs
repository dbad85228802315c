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
        let runtime = ModelConfig::from_hf_json(&text)
            .unwrap_or_else(|e| panic!("{what}: runtime refuses: {e}"))
            .kv_layout(KvDtype::F16, 16)
            .unwrap();
        let spec = ModelSpec::from_hf_config_str(&text, what, "test")
            .unwrap_or_else(|e| panic!("{what}: planner refuses: {e}"));
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
            plan.max_concurrency,
            pool.max_concurrency(budget, 4096),
            "{what}"
        );
        assert_eq!(
            plan.kv_bytes_per_request,
            pool.bytes_for_sequence(4096).unwrap(),
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
    let model = kura_model::default_model_path();
    assert!(
        model.is_file(),
        "default model missing at {}: run scripts/fetch-model.sh",
        model.display()
    );
    let model = model.to_str().unwrap();
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
