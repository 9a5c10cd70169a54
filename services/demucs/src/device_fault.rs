//! Faults on CubeCL's device threads, for every CubeCL device (Vulkan and CUDA alike).
//!
//! CubeCL runs each device's work on a thread of its own (named `DSD-<type>-<index>`)
//! and catches a panic there. An allocation the memory pool refuses (`can't allocate
//! buffer of size`, the driver out of memory) is such a panic: the task ends, the
//! tensors it should have backed read back as zeros, and the caller gets no error.
//! This module counts those panics, through a panic hook ([`install`], when a run on a
//! device starts), so that a run can tell its results are void ([`Watch`]): an
//! allocation failure is an out-of-memory ([`DemucsError::DeviceOutOfMemory`], the
//! worker's ladder steps down), any other panic there a device fault
//! ([`DemucsError::DeviceFault`], a transient failure).
//!
//! The counts are per process, not per job: a fault during a pass voids every run on a
//! device at that time (their passes share the device's memory pool, whose book-keeping
//! the failed task left behind). The device itself keeps working; the next pass
//! allocates afresh.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once};

use crate::error::DemucsError;

/// One kind of fault: how many were seen, and the first line of the last one's message
/// (for the error).
struct Faults {
    count: AtomicU64,
    last: Mutex<String>,
}

impl Faults {
    const fn new() -> Faults {
        Faults { count: AtomicU64::new(0), last: Mutex::new(String::new()) }
    }

    /// The message first, so that a [`Watch`] that sees the count move reads it.
    fn record(&self, first_line: String) {
        *self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = first_line;
        self.count.fetch_add(1, Ordering::SeqCst);
    }

    fn count(&self) -> u64 {
        self.count.load(Ordering::SeqCst)
    }

    fn last(&self) -> String {
        self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

/// Allocations the pool refused. Kept apart from the others: an allocation failure is
/// followed by panics of the pool's book-keeping, which say less.
static ALLOCATION_FAILURES: Faults = Faults::new();
/// Every other panic on a device thread.
static OTHER_FAULTS: Faults = Faults::new();

/// True on one of CubeCL's device threads (`DSD-3-0`, `DSU-...`).
fn on_device_thread() -> bool {
    std::thread::current().name().is_some_and(|n| n.starts_with("DSD-") || n.starts_with("DSU-"))
}

/// Installs the panic hook that counts panics on CubeCL's device threads (once per
/// process; the hook before it still handles every other panic). Such a panic is
/// logged as one `warn` line instead of the default report with its backtrace.
pub fn install() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !on_device_thread() {
                return previous(info);
            }
            let message = stemq_core::engine::panic_message(info.payload()).unwrap_or_default();
            let out_of_memory = crate::engine::is_out_of_memory(&message);
            let first_line = message.lines().next().unwrap_or_default().to_string();
            let location = info.location().map(|l| format!("{}:{}", l.file(), l.line())).unwrap_or_default();
            tracing::warn!(event = "device.fault", out_of_memory, %location, message = %first_line,
                "a task on the device thread failed; the passes running now are void");
            let faults = if out_of_memory { &ALLOCATION_FAILURES } else { &OTHER_FAULTS };
            faults.record(first_line);
        }));
    });
}

/// The device faults counted when it was taken; [`Watch::check`] says whether any
/// happened since.
#[derive(Debug, Clone)]
pub struct Watch {
    device: String,
    allocation_failures: u64,
    other: u64,
}

impl Watch {
    /// Starts watching for faults during a run on `device` (a name for the error).
    pub fn start(device: impl std::fmt::Display) -> Self {
        install();
        Watch {
            device: device.to_string(),
            allocation_failures: ALLOCATION_FAILURES.count(),
            other: OTHER_FAULTS.count(),
        }
    }

    /// `Ok` when no task failed on a device thread since [`Watch::start`]; else the
    /// run's results are void: an out-of-memory when an allocation failed, else a
    /// device fault.
    pub fn check(&self) -> Result<(), DemucsError> {
        if ALLOCATION_FAILURES.count() != self.allocation_failures {
            return Err(DemucsError::DeviceOutOfMemory {
                device: self.device.clone(),
                message: ALLOCATION_FAILURES.last(),
            });
        }
        if OTHER_FAULTS.count() != self.other {
            return Err(DemucsError::DeviceFault { device: self.device.clone(), message: OTHER_FAULTS.last() });
        }
        Ok(())
    }
}
