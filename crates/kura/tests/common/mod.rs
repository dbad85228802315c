//! Helpers shared by the tests that run the real binary on the default model: the model's path, and for
//! `kura serve`, start it, read a line of its start-up log, take a number out of that line.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The default model's path (scripts/fetch-model.sh puts it there); fails the test, saying so, where
/// it is missing.
pub fn default_model() -> String {
    let p = kura_model::default_model_path();
    assert!(
        p.is_file(),
        "default model missing at {}: run scripts/fetch-model.sh",
        p.display()
    );
    p.to_str().expect("the model's path is UTF-8").to_string()
}

/// `kura serve --port 0 ARGS`, its output piped.
pub fn start_serve(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_kura"))
        .arg("serve")
        .args(["--port", "0"])
        .args(args)
        .env("KURA_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kura serve")
}

/// Lines of the child's output until one contains `marker` (or the child ends, or 120 s pass): that
/// line, or every line seen. The child is killed either way.
pub fn serve_line(mut child: Child, marker: &str) -> Result<String, Vec<String>> {
    let (tx, rx) = std::sync::mpsc::channel();
    for stream in [
        Box::new(child.stderr.take().unwrap()) as Box<dyn std::io::Read + Send>,
        Box::new(child.stdout.take().unwrap()),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
    }
    drop(tx);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut seen = Vec::new();
    let found = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(marker) => break Some(line),
            Ok(line) => seen.push(line),
            Err(_) => break None,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    found.ok_or(seen)
}

/// The number before `word` in `line` (`123 blocks` → 123).
pub fn number_before(line: &str, word: &str) -> u64 {
    let head = &line[..line
        .find(word)
        .unwrap_or_else(|| panic!("no '{word}' in: {line}"))];
    head.split_whitespace()
        .last()
        .and_then(|n| n.trim_end_matches(':').parse().ok())
        .unwrap_or_else(|| panic!("no number before '{word}' in: {line}"))
}
