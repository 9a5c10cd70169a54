//! `stemq`: see the library's [`stemq::cli`] for the commands.

/// mimalloc instead of glibc's malloc: the services free on one thread what another
/// allocated (a message read by a connection task, handled by a job loop), which glibc
/// serialises on its arenas' locks; measured in `docs/benchmarks.md` (issue 18).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    stemq::main_entry()
}
