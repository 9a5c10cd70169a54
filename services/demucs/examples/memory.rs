//! Peak memory of one HTDemucs forward pass against [`stemq_demucs::memory`]'s estimate.
//!
//! ```text
//! cargo run -p stemq-demucs --example memory -- <checkpoint.th> <seconds> [batch]
//! ```
//!
//! Loads the checkpoint, builds a random `[batch, 2, seconds·samplerate]` mix, resets the
//! kernel's peak-RSS counter (`/proc/self/clear_refs` ← 5), runs one forward pass with
//! that length as the training length, and prints the estimate and the measured peak
//! RSS above the pre-pass RSS (Linux with glibc: the heap is trimmed first). Run each length in a fresh process: freed
//! memory the allocator keeps would hide the next pass's peak.

use std::path::PathBuf;

use stemq_demucs::checkpoint::HostTensor;
use stemq_demucs::memory::forward_peak_bytes;
use stemq_demucs::model::HTDemucs;
use stemq_demucs::CpuBackend;

fn status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .expect("field in /proc/self/status")
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = PathBuf::from(args.get(1).expect("usage: memory <checkpoint.th> <seconds> [batch]"));
    let seconds: f64 = args.get(2).and_then(|s| s.parse().ok()).expect("seconds");
    let batch: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(1);
    let model = HTDemucs::<CpuBackend>::load_file(&path, &Default::default()).expect("checkpoint");
    let cfg = model.config().clone();
    let len = (seconds * cfg.samplerate as f64) as usize;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let data = (0..batch * cfg.audio_channels * len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    let mix = HostTensor { shape: vec![batch, cfg.audio_channels, len], data };
    // Give the heap's free pages back first (loading frees large buffers, which the next
    // allocations would reuse without raising RSS), so the delta counts the pass.
    // SAFETY: glibc's malloc_trim takes a plain integer and only returns free heap pages
    // to the kernel; no live allocation moves or changes.
    unsafe {
        libc::malloc_trim(0);
    }
    std::fs::write("/proc/self/clear_refs", "5").expect("reset peak RSS (Linux)");
    let before = status_kib("VmRSS:");
    let t0 = std::time::Instant::now();
    let out = model.forward_with_training_length(&mix, len).expect("forward");
    let peak = status_kib("VmHWM:");
    drop(out);
    let est = forward_peak_bytes(&cfg, len, batch);
    let measured = (peak - before) * 1024;
    println!(
        "segment {seconds} s ({len} samples), batch {batch}: estimate {:.1} MiB, measured peak RSS delta {:.1} MiB \
         (ratio {:.2}), {:.1} s",
        est as f64 / 1048576.0,
        measured as f64 / 1048576.0,
        est as f64 / measured.max(1) as f64,
        t0.elapsed().as_secs_f64()
    );
}
