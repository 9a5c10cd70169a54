//! Test support: runs Prometheus's `promtool` (Debian's `prometheus` package) on what
//! stemq exports and on the alert rules, for the tests that check them.
//!
//! This module owns finding promtool and the skip policy: when promtool is not on
//! `PATH` the checks are skipped with a message, unless `STEMQ_REQUIRE_PROMTOOL` is set
//! (`scripts/test.sh` installs promtool and sets it), in which case they fail.

use std::io::Write;
use std::process::{Command, Stdio};

/// What promtool said.
#[derive(Debug)]
pub struct Report {
    /// It exited with status 0.
    pub ok: bool,
    /// Its stdout and stderr.
    pub output: String,
}

/// True when promtool can be run; panics when it cannot but `STEMQ_REQUIRE_PROMTOOL`
/// is set; prints why the caller is skipped otherwise.
pub fn available() -> bool {
    if Command::new("promtool").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return true;
    }
    assert!(
        std::env::var_os("STEMQ_REQUIRE_PROMTOOL").is_none(),
        "promtool is not on PATH and STEMQ_REQUIRE_PROMTOOL is set (scripts/install-test-deps.sh installs it)"
    );
    eprintln!("skipped: promtool is not installed (Debian package `prometheus`)");
    false
}

/// `promtool check metrics` on an exposition body; `None` when promtool is missing.
pub fn check_metrics(body: &str) -> Option<Report> {
    if !available() {
        return None;
    }
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    child.stdin.take().expect("stdin").write_all(body.as_bytes()).expect("write to promtool");
    Some(report(child.wait_with_output().expect("promtool output")))
}

/// `promtool` with these arguments (`check rules FILE`, `test rules FILE`); `None` when
/// promtool is missing.
pub fn run(args: &[&str]) -> Option<Report> {
    if !available() {
        return None;
    }
    Some(report(Command::new("promtool").args(args).output().expect("run promtool")))
}

fn report(out: std::process::Output) -> Report {
    let mut output = String::from_utf8_lossy(&out.stdout).into_owned();
    output.push_str(&String::from_utf8_lossy(&out.stderr));
    Report { ok: out.status.success(), output }
}
