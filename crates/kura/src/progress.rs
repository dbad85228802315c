//! Progress bars on stderr for the long commands (`kura cache build`, `kura perplexity`, `kura sim`).
//!
//! They are drawn only when stderr is a terminal: piped or redirected (a log file, a test reading the
//! output), a bar is hidden and writes nothing, so stdout and stderr carry exactly what they do without it.
//! Lines a command prints while a bar may be drawn go through [`ProgressBar::suspend`], which clears the
//! bar, prints and redraws it (and just prints when the bar is hidden). A bar dropped unfinished (the
//! command failed) is cleared, so the error is not printed after a half-drawn bar.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressFinish, ProgressStyle};

/// Where bars go: stderr when it is a terminal, nowhere otherwise. indicatif's stderr target hides
/// itself on a non-terminal too; choosing `hidden` here makes sure of it whatever the library does.
fn target(stderr_is_terminal: bool) -> ProgressDrawTarget {
    if stderr_is_terminal {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    }
}

fn stderr_is_terminal() -> bool {
    std::io::stderr().is_terminal()
}

/// A bar of `len` steps of `unit` (a word such as "tokens"), labelled with the message `what`.
pub fn bar(len: u64, what: &str, unit: &str) -> ProgressBar {
    bar_to(target(stderr_is_terminal()), len, what, unit)
}

fn bar_to(target: ProgressDrawTarget, len: u64, what: &str, unit: &str) -> ProgressBar {
    let template = format!(
        "{{msg}} {{wide_bar}} {{human_pos}}/{{human_len}} {unit} ({{elapsed}}, eta {{eta}})"
    );
    let style =
        ProgressStyle::with_template(&template).unwrap_or_else(|_| ProgressStyle::default_bar());
    ProgressBar::with_draw_target(Some(len), target)
        .with_style(style)
        .with_message(what.to_string())
        .with_finish(ProgressFinish::AndClear)
}

/// A spinner for work of unknown length, labelled with the message `what`, ticking on its own.
pub fn spinner(what: &str) -> ProgressBar {
    spinner_to(target(stderr_is_terminal()), what)
}

fn spinner_to(target: ProgressDrawTarget, what: &str) -> ProgressBar {
    let style = ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let s = ProgressBar::with_draw_target(None, target)
        .with_style(style)
        .with_message(what.to_string())
        .with_finish(ProgressFinish::AndClear);
    if !s.is_hidden() {
        s.enable_steady_tick(Duration::from_millis(120));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_are_hidden_when_stderr_is_not_a_terminal() {
        let b = bar_to(target(false), 10, "prefill", "tokens");
        assert!(b.is_hidden());
        b.inc(5);
        // A hidden bar still counts (the commands read nothing back, but it must not stop working).
        assert_eq!(b.position(), 5);
        b.finish_and_clear();
        assert!(spinner_to(target(false), "writing").is_hidden());
        // Where the tests run with stderr piped, the public constructors hide their bars too.
        if !stderr_is_terminal() {
            assert!(bar(10, "x", "tokens").is_hidden());
            assert!(spinner("x").is_hidden());
        }
    }
}
