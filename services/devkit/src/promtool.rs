//! Test support: runs Prometheus's `promtool` (Debian's `prometheus` package) on what
//! stemq exports and on the alert rules, for the tests that check them.
//!
//! This module owns finding promtool and the skip rule: when promtool is not on `PATH`
//! the checks fail in CI (`CI=true`) and are skipped with a `SKIPPED` line elsewhere
//! (`scripts/install-test-deps.sh` installs it).

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

/// True when promtool can be run; when it cannot, panics in CI (`CI=true`) and prints
/// why the caller is skipped elsewhere.
pub fn available() -> bool {
    if Command::new("promtool").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return true;
    }
    assert_ne!(
        std::env::var("CI").as_deref(),
        Ok("true"),
        "promtool is missing under CI (Debian package `prometheus`: scripts/install-test-deps.sh installs it)"
    );
    eprintln!("SKIPPED: the promtool check (promtool is not installed: Debian package `prometheus`)");
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
