//! `stemq`: see the library's [`stemq::cli`] for the commands.

fn main() -> std::process::ExitCode {
    stemq::main_entry()
}
