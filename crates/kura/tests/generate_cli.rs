//! `kura generate --json` on the default model: what it reports of its compute threads.

#[cfg(target_os = "linux")]
#[test]
fn two_compute_threads_on_one_cpu_give_the_core_to_each_other_and_the_report_counts_it() {
    use std::os::unix::process::CommandExt;
    use std::process::Command;
    let model = kura_model::default_model_path();
    assert!(
        model.is_file(),
        "default model missing at {}: run scripts/fetch-model.sh",
        model.display()
    );
    // The first CPU this process may run on: the command runs on it alone.
    // SAFETY: an all-zero set is a valid empty set, which the call fills; it is as large as the size.
    let mut allowed: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    assert_eq!(unsafe { libc::sched_getaffinity(0, size, &mut allowed) }, 0);
    let cpus = usize::try_from(libc::CPU_SETSIZE).expect("a count");
    // SAFETY: every CPU asked about is below the set's size.
    let cpu = (0..cpus)
        .find(|&c| unsafe { libc::CPU_ISSET(c, &allowed) })
        .expect("a CPU this process may use");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kura"));
    cmd.args([
        "generate",
        "--model",
        model.to_str().expect("a UTF-8 path"),
        "--threads",
        "2",
        "--prompt",
        "The quick brown fox jumps over the lazy dog.",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--json",
    ]);
    // SAFETY: between fork and exec the child only builds a CPU set on its stack and makes one system
    // call, both async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut one);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    };
    let out = cmd.output().expect("run kura generate");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kura generate failed: {stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)));
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
