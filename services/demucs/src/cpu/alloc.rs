//! Allocator tuning for a process that runs the model.
//!
//! Not a side effect of loading a model: a process that only links the model crate (the
//! ingress, a test, a tool) keeps glibc's defaults. The processes that run separations
//! call [`tune_allocator`] before the first forward pass: `stemq` when it builds the
//! demucs engine for a worker, `stemq dev` or `stemq separate`, and the benchmarks.

/// Tunes glibc's allocator for the model's working set, once per process: large
/// activation buffers (tens of MB, allocated and freed for every layer) come from the
/// heap instead of fresh `mmap`s, and up to 256 MiB of freed memory stays mapped. Without
/// it every such buffer costs page faults and zeroing: 22 % of the CPU time of a
/// separation went to the kernel; with it 4 % (30 s of audio on 2 cores: 14.6 → 12.6 s
/// for the first two settings, → 11.3 s with one arena; peak RSS 830 → 770 MB). A no-op
/// on other C libraries.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        // SAFETY: mallopt takes plain integers and only changes the allocator's own
        // tuning parameters, under its lock (glibc documents it MT-Safe); it touches no
        // memory of ours, and blocks already allocated stay valid under the new settings.
        ONCE.call_once(|| unsafe {
            libc::mallopt(libc::M_MMAP_MAX, 0);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
            // One arena: a thread arena's heaps are at most 64 MiB, so larger blocks on
            // the forward-pass threads would be mmap'd anyway.
            libc::mallopt(libc::M_ARENA_MAX, 1);
        });
    }
}
