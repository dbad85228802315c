//! `kura bench` on bad flags: a clear error naming the flag before any request is sent.

use std::process::Command;

fn kura_bench(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kura"))
        .arg("bench")
        .args(args)
        // Nothing listens here: a flag checked after connecting would fail on the connection instead.
        .args(["--url", "http://127.0.0.1:9", "--quiet"])
        .output()
        .expect("run kura bench");
    (
        out.status
            .code()
            .expect("kura bench was killed by a signal"),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn a_temperature_outside_0_to_2_names_the_flag() {
    for bad in ["2.5", "-0.1", "NaN", "inf"] {
        let flag = format!("--temperature={bad}");
        let (code, err) = kura_bench(&["unique", &flag]);
        assert_ne!(code, 0, "--temperature {bad}");
        assert!(
            err.contains("--temperature must be between 0 and 2"),
            "--temperature {bad}: {err}"
        );
    }
    let (code, err) = kura_bench(&["unique", "--temperature", "warm"]);
    assert_ne!(code, 0);
    assert!(err.contains("--temperature"), "{err}");
}

#[test]
fn a_request_timeout_outside_a_year_names_the_flag() {
    let (code, err) = kura_bench(&["unique", "--request-timeout-s", "0"]);
    assert_ne!(code, 0);
    assert!(err.contains("--request-timeout-s"), "{err}");
}
