//! The process's allocator, chosen by its role before its first allocation (mimalloc for
//! the services, glibc's malloc where the model runs), and with it the process's use of
//! transparent huge pages. Each binary names [`ByRole`] its `#[global_allocator]`: the
//! `stemq` command and the tests' `stemq-under-test`, so the tests run what ships.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU8, Ordering};

/// The allocator, chosen once per process before its first allocation.
///
/// mimalloc for the services: they free on one thread what another allocated (a
/// message read by a connection task, handled by a job loop), which glibc serialises on
/// its arenas' locks; 1.14× pipeline throughput. glibc's malloc (tuned by
/// `stemq_demucs::cpu::tune_allocator`) where the model runs in this process (`stemq
/// engine-host`, `stemq separate`): there mimalloc was about 10 % slower on 120 s of
/// audio. Both measured in `docs/benchmarks.md` ("Settings, each against its
/// alternative"). A process never switches, so every block is freed by the allocator
/// that gave it.
///
/// With the choice goes the process's use of transparent huge pages (`huge_pages`).
pub struct ByRole;

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
            huge_pages(choice == 1);
            // The first allocation happens before any other thread exists.
            CHOICE.store(choice, Ordering::Relaxed);
            choice == 1
        }
    }
}

/// Transparent huge pages off for a service process, as the system says for one that
/// runs the model.
///
/// mimalloc asks for huge pages on its arenas, and the services' small, short-lived
/// blocks then cost the kernel a cleared 2 MiB page each time a freed range is touched
/// again: 15–17 % of the whole box's CPU in `clear_page_erms` under the pipeline
/// benchmark, whose throughput without them was 1.07–1.32× (median 1.18×) in six pairs
/// (`docs/benchmarks.md`, "Settings, each against its alternative"). `MIMALLOC_ALLOW_THP` in the
/// environment leaves the process as it is.
/// The setting is inherited by child processes, so one that runs the model (an engine
/// host started by a worker) turns it back on: its tensors are large and long-lived.
fn huge_pages(model: bool) {
    #[cfg(target_os = "linux")]
    // SAFETY: getenv reads the environment without allocating (no other thread exists
    // yet); prctl with these options only reads or sets one flag of this process.
    unsafe {
        if model {
            if libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) == 1 {
                libc::prctl(libc::PR_SET_THP_DISABLE, 0, 0, 0, 0);
            }
        } else if libc::getenv(c"MIMALLOC_ALLOW_THP".as_ptr()).is_null() {
            libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = model;
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
