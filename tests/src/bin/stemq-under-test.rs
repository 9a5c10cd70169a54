//! The `stemq` binary, built in the test package so tests can spawn it.

#[global_allocator]
static ALLOC: stemq::alloc::ByRole = stemq::alloc::ByRole;

fn main() -> std::process::ExitCode {
    stemq::main_entry()
}
