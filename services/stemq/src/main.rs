//! `stemq`: see the library's [`stemq::cli`] for the commands.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU8, Ordering};

/// The allocator, chosen once per process before its first allocation.
///
/// mimalloc for the services: they free on one thread what another allocated (a
/// message read by a connection task, handled by a job loop), which glibc serialises on
/// its arenas' locks; 1.14× pipeline throughput. glibc's malloc (tuned by
/// `stemq_demucs::cpu::tune_allocator`) where the model runs in this process (`stemq
/// engine-host`, `stemq separate`): there mimalloc was about 10 % slower on 120 s of
/// audio. Both measured in `docs/benchmarks.md` (issue 18). A process never switches,
/// so every block is freed by the allocator that gave it.
struct ByRole;

#[global_allocator]
static ALLOC: ByRole = ByRole;

/// 0: not chosen yet; 1: glibc; 2: mimalloc.
static CHOICE: AtomicU8 = AtomicU8::new(0);

/// Whether this process runs the model: its command line (read from
/// `/proc/self/cmdline` without allocating) names `engine-host` or `separate`.
fn runs_the_model() -> bool {
    let mut buf = [0u8; 4096];
    // SAFETY: open/read/close on a path we own and a stack buffer of the given length.
    let n = unsafe {
        let fd = libc::open(c"/proc/self/cmdline".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return false;
        }
        let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
        libc::close(fd);
        n
    };
    if n <= 0 {
        return false;
    }
    buf[..n as usize].split(|b| *b == 0).skip(1).any(|arg| arg == b"engine-host" || arg == b"separate")
}

#[inline]
fn glibc() -> bool {
    match CHOICE.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            let choice = if runs_the_model() { 1 } else { 2 };
            // The first allocation happens before any other thread exists.
            CHOICE.store(choice, Ordering::Relaxed);
            choice == 1
        }
    }
}

// SAFETY: every call goes to the same allocator for the life of the process (the choice
// is made once, before the first allocation), so each block is freed or grown by the
// allocator that made it; both allocators uphold `GlobalAlloc`'s contract.
unsafe impl GlobalAlloc for ByRole {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if glibc() {
            System.alloc(layout)
        } else {
            mimalloc::MiMalloc.alloc(layout)
        }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if glibc() {
            System.alloc_zeroed(layout)
        } else {
            mimalloc::MiMalloc.alloc_zeroed(layout)
        }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if glibc() {
            System.dealloc(ptr, layout)
        } else {
            mimalloc::MiMalloc.dealloc(ptr, layout)
        }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if glibc() {
            System.realloc(ptr, layout, new_size)
        } else {
            mimalloc::MiMalloc.realloc(ptr, layout, new_size)
        }
    }
}

fn main() -> std::process::ExitCode {
    stemq::main_entry()
}
