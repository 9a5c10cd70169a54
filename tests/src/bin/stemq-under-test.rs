//! The `stemq` binary, built in the test package so tests can spawn it.

fn main() -> std::process::ExitCode {
    stemq::main_entry()
}
