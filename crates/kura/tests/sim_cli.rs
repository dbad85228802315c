//! `kura sim` end to end on bad flags and on input that is not a trace: each is a clear error naming the
//! flag or the line, never a report of nonsense, a panic or unbounded reading; and `--prefill-step-ms`
//! reaching the simulated server.

mod common;

use std::path::PathBuf;
use std::process::Command;

fn kura_sim(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kura"))
        .arg("sim")
        .args(args)
        .output()
        .expect("run kura sim");
    (
        out.status.code().expect("kura sim was killed by a signal"),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// A trace file in a fresh temporary directory.
fn trace_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kura-sim-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("trace.jsonl");
    std::fs::write(&path, text).unwrap();
    path
}

const LINE: &str =
    "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 4, \"hash_ids\": [1, 2]}\n";

#[test]
fn degenerate_flags_name_the_flag() {
    let trace = trace_file("flags", LINE);
    let t = trace.to_str().unwrap();
    for (args, why) in [
        (
            vec!["--max-requests", "0"],
            "--max-requests 0 replays no request",
        ),
        (vec!["--limit", "0"], "--max-requests 0 replays no request"),
        (
            vec!["--capacity-tokens", "0"],
            "--capacity-tokens 0 holds no block of 16 tokens",
        ),
        (
            vec!["--capacity-tokens", "8"],
            "--capacity-tokens 8 holds no block",
        ),
        (
            vec!["--prefill-tokens-per-s", "0"],
            "--prefill-tokens-per-s 0 must be a positive",
        ),
        (
            vec!["--prefill-tokens-per-s", "NaN"],
            "--prefill-tokens-per-s NaN",
        ),
        (
            vec!["--decode-ms-per-token=-1"],
            "--decode-ms-per-token -1 must be",
        ),
    ] {
        let mut all = vec!["--trace", t];
        all.extend(&args);
        let (code, out, err) = kura_sim(&all);
        assert_eq!(code, 1, "{args:?}: {out}{err}");
        assert!(err.contains(why), "{args:?}: {err}");
        assert!(!err.contains("capacity of 0 blocks"), "{err}");
    }
    // A block size is checked as the flags are read (clap's usage error, status 2), before the
    // calibration's division by it.
    for extra in [&[][..], &["--calibrate"]] {
        let mut all = vec!["--trace", t, "--block-size", "0"];
        all.extend(extra);
        let (code, out, err) = kura_sim(&all);
        assert_eq!(code, 2, "{out}{err}");
        assert!(err.contains("`0`: a block holds 1 to 1024 tokens"), "{err}");
    }
    // A fleet is simulated on a trace only; a trace is one open-loop run.
    let (code, out, err) = kura_sim(&["--trace", t, "--replicas", "4"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("--replicas simulates a fleet on a trace"),
        "{err}"
    );
    let (code, out, err) = kura_sim(&["--workload", "trace", "--trace", t, "--concurrency", "1,2"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("--concurrency takes no list"), "{err}");
    // The server simulation reads a trace through the same refusal.
    let (code, out, err) = kura_sim(&["--workload", "trace", "--trace", t, "--max-requests", "0"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("--max-requests 0 replays no request"), "{err}");
    let (code, out, err) = kura_sim(&[
        "--trace",
        t,
        "--limit",
        "1",
        "--capacity-tokens",
        "1000000000000",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("62500000000 blocks"), "{out}");
}

#[test]
fn a_prefill_step_past_an_hour_or_not_a_count_of_milliseconds_is_refused_by_serve_and_sim() {
    for cmd in ["serve", "sim"] {
        for bad in ["3600001", "-1", "0.5", "x"] {
            let out = Command::new(env!("CARGO_BIN_EXE_kura"))
                .args([cmd, &format!("--prefill-step-ms={bad}")])
                .output()
                .expect("run kura");
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{cmd} {bad}: {err}");
            assert!(err.contains("--prefill-step-ms"), "{cmd} {bad}: {err}");
        }
    }
    // The simulated server paces with the flag as the server does: cut, its ITL stays near the target.
    let run = |ms: &str| {
        let (code, out, err) = kura_sim(&[
            "--workload",
            "unique",
            "--concurrency",
            "16",
            "--kv-blocks",
            "4096",
            "--json",
            "--cost",
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../data/cost/smollm2-135m-q4_1-2t-f32kv.json"
            ),
            "--prefill-step-ms",
            ms,
        ]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        v["points"][0]["itl_ms"]["p99"].as_f64().expect("ITL p99")
    };
    let (whole, cut) = (run("0"), run("250"));
    assert!(whole > 1_000.0, "{whole}");
    assert!(cut < 300.0, "{cut}");
}

#[test]
fn times_past_what_a_clock_holds_are_refused_or_saturated_never_a_panic() {
    // The second request arrives at 2^53 ms, the latest a trace may say; × 10^7 it was past what a
    // `Duration` holds, and the server simulation panicked converting it.
    let text = "{\"timestamp\": 0, \"input_length\": 100, \"output_length\": 4, \"hash_ids\": [0]}\n\
                {\"timestamp\": 9007199254740992, \"input_length\": 100, \"output_length\": 4, \"hash_ids\": [1]}\n";
    let trace = trace_file("far", text);
    let t = trace.to_str().unwrap();
    let cost = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/cost/smollm2-135m-q4_1-2t-f32kv.json"
    );
    for replicas in ["1", "2"] {
        let (code, out, err) = kura_sim(&[
            "--cost",
            cost,
            "--trace",
            t,
            "--workload",
            "trace",
            "--time-scale",
            "1e7",
            "--replicas",
            replicas,
            "--json",
        ]);
        assert_eq!(code, 0, "{replicas} replicas: {err}");
        let report: serde_json::Value = serde_json::from_str(&out).unwrap();
        let point = &report["fleets"][0];
        assert_eq!(
            (&point["requests"], &point["failed"]),
            (&2.into(), &0.into()),
            "{out}"
        );
    }
    // A cost coefficient of 10^300 ms is refused, naming it.
    let dir = trace.parent().unwrap();
    let mut model: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cost).unwrap()).unwrap();
    model["base_ms"] = serde_json::json!(1e300);
    let huge = dir.join("huge-cost.json");
    std::fs::write(&huge, model.to_string()).unwrap();
    let (code, out, err) = kura_sim(&[
        "--cost",
        huge.to_str().unwrap(),
        "--workload",
        "unique",
        "--requests",
        "4",
    ]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("cost model base_ms is 1e300"), "{err}");
    // A workload whose ids or memory the machine cannot hold is refused before it is built (these
    // two grew until killed at 24 GiB).
    let cost_arg = cost;
    for (args, want) in [
        (
            &[
                "--requests",
                "16000",
                "--prompt-tokens",
                "16000000",
                "--max-model-len",
                "100000000",
            ][..],
            "more than 2^31 token ids",
        ),
        (
            &["--kv-blocks", "4000000000"][..],
            "bookkeeping of 4000000000 KV blocks), more than the",
        ),
    ] {
        let mut all = vec!["--cost", cost_arg, "--workload", "unique"];
        all.extend_from_slice(args);
        let (code, out, err) = kura_sim(&all);
        assert_eq!(code, 1, "{args:?}: {out}{err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // A cost model that is not a regular file is refused at once (a FIFO blocked for ever).
    let (code, _, err) = kura_sim(&["--cost", "/dev/zero", "--workload", "unique"]);
    assert_eq!(code, 1);
    assert!(err.contains("not a regular file"), "{err}");
}

#[test]
fn dev_zero_is_refused_at_once() {
    // It read 5 GB in 12 s before; now the first buffer shows the NUL bytes.
    let (code, _, err) = kura_sim(&["--trace", "/dev/zero"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("/dev/zero:1: binary data (a NUL byte): not a Mooncake JSONL trace"),
        "{err}"
    );
}

#[test]
fn the_largest_hash_id_is_replayed_in_full() {
    let text = "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [8388607]}\n\
                {\"timestamp\": 1, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [8388607]}\n";
    let trace = trace_file("maxid", text);
    let (code, out, err) =
        kura_sim(&["--trace", trace.to_str().unwrap(), "--json", "--no-overlap"]);
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["prompt_tokens"], 1024, "{out}");
    assert_eq!(report["hit_tokens"], 512, "{out}");
}

/// `--calibrate` on the real default model writes a cost model, and `--workload` simulates a server with
/// it: every request completes, the figures are those of a run that happened (positive times, the
/// prompts' shared prefix cached), and the same flags give the same report.
#[test]
fn calibrate_then_simulate_the_server() {
    let model = common::default_model();
    let dir = std::env::temp_dir().join(format!("kura-sim-cli-{}-cost", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cost = dir.join("cost.json");
    let (code, _, err) = kura_sim(&[
        "--calibrate",
        "--model",
        &model,
        "--threads",
        "1",
        "--repeats",
        "1",
        "--cost",
        cost.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let fitted: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cost).unwrap()).unwrap();
    assert!(fitted["per_token_ms"].as_f64().unwrap() > 0.0, "{fitted}");
    assert!(fitted["measured_on"]
        .as_str()
        .unwrap()
        .contains("1 threads"));

    let args = [
        "--workload",
        "shared-prefix",
        "--groups",
        "2",
        "--users-per-group",
        "3",
        "--system-tokens",
        "200",
        "--concurrency",
        "1,3",
        "--cost",
        cost.to_str().unwrap(),
        "--json",
    ];
    let (code, out, err) = kura_sim(&args);
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let points = report["points"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    for p in points {
        assert_eq!(p["requests"], 6);
        assert_eq!(p["output_tokens"], 6 * 64);
        assert!(p["ttft_ms"]["p50"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["itl_ms"]["p50"].as_f64().unwrap() > 0.0, "{p}");
        // 4 of 6 requests find their group's 200-token system prompt.
        assert!(p["cached_ratio"].as_f64().unwrap() > 0.5, "{p}");
    }
    assert_eq!(kura_sim(&args).1, out, "deterministic");
    std::fs::remove_dir_all(&dir).ok();

    let (code, _, err) = kura_sim(&["--workload", "unique", "--cost", "/nonexistent/cost.json"]);
    assert_ne!(code, 0);
    assert!(err.contains("/nonexistent/cost.json"), "{err}");
    let (code, _, err) = kura_sim(&["--workload", "unique", "--concurrency", "0"]);
    assert_ne!(code, 0);
    assert!(err.contains("--concurrency"), "{err}");
}

/// `--calibrate --device` with a name that is no device, or a GPU index no machine has: a clear error
/// naming it, never a panic.
#[test]
fn calibrating_on_a_device_that_is_not_there_is_a_clear_error() {
    let model = kura_model::default_model_path();
    let m = model.to_str().unwrap();
    let (code, _, err) = kura_sim(&["--calibrate", "--model", m, "--device", "gpu0"]);
    assert_ne!(code, 0);
    assert!(err.contains("--device") && err.contains("cuda:N"), "{err}");
    let (code, _, err) = kura_sim(&[
        "--calibrate",
        "--model",
        m,
        "--device",
        "cuda:99",
        "--repeats",
        "1",
    ]);
    assert_ne!(code, 0);
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("cuda:99"), "{err}");
}
