//! Step 4 of a delivery: the engine on a blocking thread, stepping down the
//! out-of-memory ladder (a smaller segment, then the CPU) when it runs out of memory,
//! and what each engine error means for the job ([`classify`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use stemq_core::device::Device;
use stemq_core::engine::{EngineContext, EngineError, EngineJob};
use stemq_core::event::{FailureCode, Requested};
use stemq_core::JobId;
use tokio::sync::watch;
use tracing::{info_span, warn, Instrument};

use super::input::fetch_input;
use super::{Done, Failure};
use crate::outputs::{puts_in_flight, store_outputs, Stems};
use crate::Shared;

struct Ctx {
    progress: watch::Sender<Option<(f32, String)>>,
    cancel: Arc<AtomicBool>,
}

impl EngineContext for Ctx {
    fn progress(&self, fraction: f32, stage: &str) {
        let _ = self.progress.send(Some((fraction.clamp(0.0, 1.0), stage.to_string())));
    }
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
}

/// The rungs of the out-of-memory ladder: (device, segment).
fn ladder(devices: &[Device], requested: Option<f64>, max_segment: Option<f64>) -> Vec<(Device, Option<f64>)> {
    let first = devices.first().cloned().unwrap_or(Device::Cpu);
    let mut rungs = vec![(first.clone(), requested)];
    let base = requested.or(max_segment);
    if let Some(b) = base {
        rungs.push((first.clone(), Some((b / 2.0).max(1.0))));
    }
    if !first.is_cpu() && devices.iter().any(Device::is_cpu) {
        rungs.push((Device::Cpu, requested));
    }
    rungs
}

pub(super) async fn run_engine(
    shared: &Arc<Shared>,
    job_id: &JobId,
    requested: &Requested,
    attempt: u32,
    devices: &[Device],
    progress: watch::Sender<Option<(f32, String)>>,
    cancel: Arc<AtomicBool>,
) -> Result<Done, Failure> {
    if attempt > 1 {
        // A redelivery: some attempt may have died without cleaning up.
        let shared = shared.clone();
        let _ = tokio::task::spawn_blocking(move || shared.scratch.sweep()).await;
    }
    let dir = shared.scratch.attempt_dir(job_id.as_str(), attempt);
    // Removed when the attempt ends, if it was made: an engine that neither reads its
    // input nor writes files (stems in memory) never makes one.
    let mut cleanup = ScratchDir { path: dir.clone(), made: false };
    let out_dir = dir.join("out");
    let make_out_dir = |out_dir: &Path| {
        std::fs::create_dir_all(out_dir)
            .map_err(|e| Failure::transient(FailureCode::Scratch, format!("cannot create {}: {e}", out_dir.display())))
    };
    let input = if shared.engine.reads_input() {
        cleanup.made = true;
        let out = out_dir.clone();
        tokio::task::spawn_blocking(move || make_out_dir(&out)).await.map_err(|e| {
            Failure::transient(FailureCode::Scratch, format!("cannot create the scratch folder: {e}"))
        })??;
        fetch_input(shared, &requested.request.audio_uri, &requested.request.owner, &dir)
            .instrument(info_span!("fetch_input"))
            .await?
    } else {
        dir.join("input")
    };
    // Paid for before any engine time is spent (nothing happens when credits are off).
    crate::credits::reserve(shared, job_id, requested, &input).await?;

    let ctx = Arc::new(Ctx { progress, cancel });
    let rungs = ladder(devices, requested.request.segment, requested.request.model.max_segment());
    // The last rung's refusal decides the failure: a real out-of-memory may clear later
    // (memory freed elsewhere), a budget refusal will not.
    let mut last_oom = EngineError::OutOfMemory { device: String::new() };
    for (i, (device, segment)) in rungs.iter().enumerate() {
        let engine = shared.engine.clone();
        let (job_id2, req, input2, out2, dev, ctx2) =
            (job_id.clone(), requested.clone(), input.clone(), out_dir.clone(), device.clone(), ctx.clone());
        let segment = *segment;
        let engine_span = info_span!("engine.separate", %device, segment = ?segment);
        // One hand-off to a blocking thread per rung: the engine keeps its stems in
        // memory, or the output folder is made there and the engine writes files.
        let (wrote_files, res) = tokio::task::spawn_blocking(move || {
            let _entered = engine_span.entered();
            let job = EngineJob {
                job_id: &job_id2,
                request: &req.request,
                metadata: stemq_core::engine::metadata_for(engine.as_ref(), req.metadata.as_ref()),
                attempt,
                input: &input2,
                out_dir: &out2,
                device: &dev,
                segment,
            };
            if let Some(res) = engine.separate_in_memory(&job, ctx2.as_ref()) {
                return (false, Ok(res.map(Stems::Memory)));
            }
            if let Err(f) = make_out_dir(&out2) {
                return (true, Err(f));
            }
            (true, Ok(engine.separate(&job, ctx2.as_ref()).map(Stems::Files)))
        })
        .await
        .map_err(|e| Failure::transient(FailureCode::EnginePanic, format!("the engine crashed: {e}")))?;
        cleanup.made |= wrote_files;
        match res? {
            Ok(_) if ctx.cancel.load(Ordering::SeqCst) => {
                // Stopped from outside (time limit, cancel) just as it finished: store nothing.
                return Err(Failure::permanent(FailureCode::Cancelled, "the attempt was stopped".into()));
            }
            Ok(stems) => {
                let degraded = i > 0;
                if degraded {
                    warn!(event = "job.degraded", %device, ?segment, "finished on a lower rung of the memory ladder");
                }
                let audio_secs = stems.first_audio().map(|a| a.secs());
                let span = info_span!("store_outputs", stems = stems.len());
                let store = &shared.config.store;
                let in_flight = puts_in_flight(store, &stems);
                let (outputs, manifest_uri) =
                    store_outputs(store, in_flight, job_id, requested, stems, device, degraded)
                        .instrument(span)
                        .await?;
                return Ok(Done { audio_secs, outputs, manifest_uri, degraded, device: device.clone(), segment });
            }
            Err(e @ (EngineError::OutOfMemory { .. } | EngineError::OverBudget { .. })) => {
                warn!(event = "job.oom", %device, ?segment, error = %e, "out of memory; stepping down");
                last_oom = e;
                // Nothing partial may survive into the next rung.
                if wrote_files {
                    let _ = tokio::fs::remove_dir_all(&out_dir).await;
                }
            }
            Err(e) => return Err(classify(e)),
        }
    }
    Err(match last_oom {
        EngineError::OverBudget { device, needed, budget } => Failure::permanent(
            FailureCode::OverMemoryBudget,
            format!(
                "does not fit the memory budget on {device} at any rung of the ladder (the smallest needs about \
                 {needed} bytes, the budget is {budget})"
            ),
        ),
        e => Failure::transient(FailureCode::OutOfMemory, format!("{e} at every rung")),
    })
}

fn classify(e: EngineError) -> Failure {
    match e {
        EngineError::InvalidInput { code, message } => Failure::permanent(code, message),
        EngineError::Unsupported { code, message } => Failure::permanent(code, message),
        e @ EngineError::Transient { .. } => {
            Failure::transient(FailureCode::EngineError, stemq_nats::error::report(&e))
        }
        // The attempt's own process died: this job, and only it, pays an attempt.
        EngineError::Crashed(how) => Failure::transient(FailureCode::EngineCrashed, how.to_string()),
        EngineError::Cancelled => Failure::permanent(FailureCode::Cancelled, "the job was cancelled".into()),
        EngineError::OutOfMemory { device } => {
            Failure::transient(FailureCode::OutOfMemory, format!("out of memory on {device}"))
        }
        e @ EngineError::OverBudget { .. } => Failure::permanent(FailureCode::OverMemoryBudget, e.to_string()),
    }
}

/// An attempt's scratch folder: removed when the attempt ends, however it ends, once
/// it was `made`.
struct ScratchDir {
    path: PathBuf,
    made: bool,
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if self.made {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use stemq_core::event::FailureClass;

    use super::*;

    #[test]
    fn ladder_steps_segment_then_cpu() {
        let gpu = Device::Cuda(Some(0));
        let devs = vec![gpu.clone(), Device::Cpu];
        assert_eq!(
            ladder(&devs, None, Some(7.8)),
            vec![(gpu.clone(), None), (gpu.clone(), Some(3.9)), (Device::Cpu, None)]
        );
        let cpu_only = vec![Device::Cpu];
        assert_eq!(ladder(&cpu_only, Some(4.0), Some(7.8)), vec![(Device::Cpu, Some(4.0)), (Device::Cpu, Some(2.0))]);
        assert_eq!(ladder(&cpu_only, None, None), vec![(Device::Cpu, None)]);
        // The fake engine's GPU is not the CPU; an engine without a CPU has no CPU rung.
        let fake = Device::from("fake-gpu");
        assert_eq!(ladder(&[fake.clone(), Device::Cpu], None, None), vec![(fake.clone(), None), (Device::Cpu, None)]);
        assert_eq!(ladder(std::slice::from_ref(&fake), None, None), vec![(fake, None)]);
        assert_eq!(ladder(&[], None, None), vec![(Device::Cpu, None)]);
    }

    #[test]
    fn engine_errors_are_classified_with_their_codes() {
        let f = classify(EngineError::InvalidInput { code: FailureCode::InvalidAudio, message: "m".into() });
        assert_eq!((f.class, f.code), (FailureClass::Permanent, FailureCode::InvalidAudio));
        let f = classify(EngineError::Unsupported { code: "brand_new".into(), message: "m".into() });
        assert_eq!((f.class, f.code), (FailureClass::Permanent, FailureCode::Other("brand_new".into())));
        let f = classify(EngineError::transient("writing vocals", std::io::Error::other("disk full")));
        assert_eq!((f.class, f.code), (FailureClass::Transient, FailureCode::EngineError));
        assert_eq!(f.message, "writing vocals: disk full");
        let f = classify(EngineError::Crashed(stemq_core::engine::Death::Signal(9)));
        assert_eq!((f.class, f.code), (FailureClass::Transient, FailureCode::EngineCrashed));
        assert!(f.message.contains("SIGKILL"), "{}", f.message);
        let f = classify(EngineError::OutOfMemory { device: "cuda:0".into() });
        assert_eq!((f.class, f.code), (FailureClass::Transient, FailureCode::OutOfMemory));
        let f = classify(EngineError::OverBudget { device: "cpu".into(), needed: 2, budget: 1 });
        assert_eq!((f.class, f.code), (FailureClass::Permanent, FailureCode::OverMemoryBudget));
        let f = classify(EngineError::Cancelled);
        assert_eq!((f.class, f.code), (FailureClass::Permanent, FailureCode::Cancelled));
    }
}
