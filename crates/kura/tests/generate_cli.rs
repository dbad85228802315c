//! `kura generate --json` on the default model: what it reports of its compute threads.

mod common;

/// One `kura generate` at a time: each takes both cores of a 2-core machine.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `kura generate --json` of `max_tokens` tokens after `prompt` on the default model, 2 compute threads,
/// ignoring the end of text.
fn generate(prompt: &str, max_tokens: usize) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kura"));
    cmd.args([
        "generate",
        "--model",
        &common::default_model(),
        "--threads",
        "2",
    ])
    .args(["--prompt", prompt, "--max-tokens", &max_tokens.to_string()])
    .args(["--ignore-eos", "--json"]);
    cmd
}

/// Runs `cmd` (a `kura generate --json`) and returns its report.
fn report_of(cmd: &mut std::process::Command) -> serde_json::Value {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out = cmd.output().expect("run kura generate");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kura generate failed: {stderr}");
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

#[cfg(target_os = "linux")]
#[test]
fn two_compute_threads_on_one_cpu_give_the_core_to_each_other_and_the_report_counts_it() {
    use std::os::unix::process::CommandExt;
    let mut cmd = generate("The quick brown fox jumps over the lazy dog.", 8);
    // The command runs on the one CPU its process starts on (one it may use).
    // SAFETY: between fork and exec the child only reads its CPU, builds a CPU set on its stack and
    // makes one system call, all async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            let cpu = usize::try_from(libc::sched_getcpu())
                .map_err(|_| std::io::Error::last_os_error())?;
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut one);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    };
    let report = report_of(&mut cmd);
    assert_eq!(report["threads"], 2, "{report}");
    assert_eq!(report["generated_tokens"], 8, "{report}");
    // Both threads of the pool run on the one CPU: a thread that waits for the other yields to it.
    let gave_way = &report["gave_way"];
    assert!(
        gave_way["same_cpu"].as_u64().is_some_and(|n| n > 0),
        "no thread gave its CPU to the other: {report}"
    );
    assert!(gave_way["shared_core"].is_u64(), "{report}");
}

#[test]
fn decode_steps_try_another_team_size_now_and_then_and_the_report_counts_it() {
    let report = report_of(&mut generate("Once upon a time", 200));
    assert_eq!(report["generated_tokens"], 200, "{report}");
    // The first trial starts after 64 decode steps and tries one thread in place of two.
    let pace = &report["pace"];
    assert_eq!(pace["threads"], 2, "{report}");
    assert!(
        pace["trial_steps"].as_u64().is_some_and(|n| n > 0),
        "no decode step ran on a trial's team size: {report}"
    );
    assert!(
        pace["size"].as_u64().is_some_and(|n| (1..=2).contains(&n)),
        "{report}"
    );
    assert!(
        pace["trials"].is_u64() && pace["changes"].is_u64(),
        "{report}"
    );
}
