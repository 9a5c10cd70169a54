//! `stemq`: see the library's [`stemq::cli`] for the commands.

#[global_allocator]
static ALLOC: stemq::alloc::ByRole = stemq::alloc::ByRole;

fn main() -> std::process::ExitCode {
    stemq::main_entry()
}
