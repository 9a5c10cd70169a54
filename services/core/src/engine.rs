//! The separation engine seam, and (feature `fake`) the fake engine used by tests and
//! benchmarks.
//!
//! This module owns the contract between a worker and whatever turns a song into stems.
//! An engine is loaded once per worker process and called synchronously (on a blocking
//! thread) once per attempt. It reads a local input file, writes one local file per stem
//! into a folder the worker gives it, reports progress, and checks for cancellation
//! between chunks. It says *how* it failed through [`EngineError`]; the worker decides
//! what that means (retry, degrade, give up).
//!
//! An engine whose stems are small may keep them in memory instead
//! ([`Engine::separate_in_memory`], the fake engine's way): the worker then stores the
//! bytes as they are and makes no output folder, so an attempt costs no file system work
//! at all when the engine does not read its input either.

use std::path::{Path, PathBuf};
#[cfg(feature = "fake")]
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::device::Device;
use crate::failure::FailureCode;
use crate::request::{JobId, Model, NormalizedRequest};

/// What the engine is asked to do.
pub struct EngineJob<'a> {
    /// The job.
    pub job_id: &'a JobId,
    /// What to produce.
    pub request: &'a NormalizedRequest,
    /// Client metadata, only for an engine that asks for it ([`Engine::wants_metadata`]);
    /// `None` for every other engine, whatever the client sent.
    pub metadata: Option<&'a Value>,
    /// Delivery attempt, from 1.
    pub attempt: u32,
    /// The input audio, already fetched to local disk.
    pub input: &'a Path,
    /// Where to write the stems.
    pub out_dir: &'a Path,
    /// Device to run on (one of [`Engine::devices`]).
    pub device: &'a Device,
    /// Segment length override (seconds), from the request or the out-of-memory ladder.
    pub segment: Option<f64>,
}

/// Callbacks into the worker while the engine runs.
pub trait EngineContext: Sync {
    /// Progress in [0, 1] with a stage name. Cheap: the worker rate-limits publishing.
    fn progress(&self, fraction: f32, stage: &str);
    /// True when the engine should stop at the next chunk boundary.
    fn cancelled(&self) -> bool;
}

/// One stem written by the engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StemFile {
    /// Stem name.
    pub stem: String,
    /// Local file.
    pub path: PathBuf,
    /// What the engine knows about the audio in the file (for the manifest); `None`
    /// when it wrote no real audio (the fake engine).
    pub audio: Option<StemAudio>,
}

/// One stem an engine kept in memory ([`Engine::separate_in_memory`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StemBytes {
    /// Stem name.
    pub stem: String,
    /// The file's content, exactly as a written stem file would hold it.
    pub bytes: Vec<u8>,
    /// What the engine knows about the audio (as [`StemFile::audio`]).
    pub audio: Option<StemAudio>,
}

/// Audio facts of a written stem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StemAudio {
    /// Sample rate in Hz.
    pub sample_rate: u32,
    /// Length in sample frames (duration = frames / sample_rate).
    pub frames: u64,
}

impl StemAudio {
    /// How long it plays, in seconds (a sample rate of 0 counts as 1).
    pub fn secs(&self) -> f64 {
        self.frames as f64 / f64::from(self.sample_rate.max(1))
    }
}

/// How an engine attempt failed. It crosses process boundaries (an engine isolated in a
/// child process reports it over a pipe), hence the serde form.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "detail", rename_all = "snake_case")]
pub enum EngineError {
    /// The device ran out of memory: the worker retries with a smaller segment, then on
    /// the CPU.
    #[error("out of memory on {device}")]
    OutOfMemory {
        /// Where.
        device: String,
    },
    /// The attempt would not fit the memory the engine may use on `device` (its
    /// configured budget), so it was refused before it allocated anything. The worker
    /// steps down the ladder as for [`EngineError::OutOfMemory`]; unlike a real
    /// out-of-memory, the refusal is deterministic, so when the last rung is also refused
    /// the job fails for good instead of being retried.
    #[error("needs about {needed} bytes on {device}, over its memory budget of {budget} bytes")]
    OverBudget {
        /// Where.
        device: String,
        /// Estimated peak bytes of the attempt at its smallest setting.
        needed: u64,
        /// The budget.
        budget: u64,
    },
    /// The input cannot be processed (not audio, corrupt, too long...). Never retried.
    #[error("{message}")]
    InvalidInput {
        /// Stable code (`invalid_audio`, `unsupported_codec`, `empty_audio`, `too_long`).
        code: FailureCode,
        /// For people.
        message: String,
    },
    /// The engine cannot do what was asked (model not installed...). Never retried.
    #[error("{message}")]
    Unsupported {
        /// Stable code (`model_unavailable`, `invalid_argument`, ...).
        code: FailureCode,
        /// For people.
        message: String,
    },
    /// Worth another try later: a file the attempt could not read or write, a panic of
    /// the engine's backend, an engine host that could not be started or reached.
    #[error("{what}")]
    Transient {
        /// What failed, for people ("writing vocals", "the cpu backend panicked: ...").
        what: String,
        /// The error underneath, when one said why.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        source: Option<Cause>,
    },
    /// The process running the attempt died (a crash, an abort, a kill): only an engine
    /// isolated in a child process can report this, and it names the culprit exactly,
    /// since that process ran this one job. Retried like a transient failure; a job that
    /// crashes on every delivery is dead-lettered with this as its last error.
    #[error("the engine process died: {0}")]
    Crashed(Death),
    /// Stopped because [`EngineContext::cancelled`] said so.
    #[error("cancelled")]
    Cancelled,
}

impl EngineError {
    /// A transient failure of `what`, caused by `source`.
    pub fn transient(what: impl Into<String>, source: impl std::error::Error + Send + Sync + 'static) -> EngineError {
        EngineError::Transient { what: what.into(), source: Some(Cause::new(source)) }
    }

    /// A transient failure that no error underneath explains (a panic, a scripted
    /// failure).
    pub fn transient_without_source(what: impl Into<String>) -> EngineError {
        EngineError::Transient { what: what.into(), source: None }
    }
}

/// The error underneath an [`EngineError`]: the error itself inside one process; its
/// text (with its own causes) once it crossed a process boundary, since an isolated
/// engine reports over a pipe.
#[derive(Clone)]
pub struct Cause(std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>);

impl Cause {
    /// Keeps `source`.
    pub fn new(source: impl std::error::Error + Send + Sync + 'static) -> Cause {
        Cause(std::sync::Arc::new(source))
    }

    /// The error itself, to downcast (a [`RemoteCause`] when it came over a pipe).
    pub fn get(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }

    /// The text of the error and its causes, `: `-separated.
    fn chain(&self) -> String {
        let mut out = self.0.to_string();
        let mut next = self.0.source();
        while let Some(s) = next {
            let text = s.to_string();
            if !out.ends_with(&text) {
                out.push_str(": ");
                out.push_str(&text);
            }
            next = s.source();
        }
        out
    }
}

impl std::fmt::Debug for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.0, f)
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for Cause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Two causes are equal when they say the same (a cause read back from a pipe equals
/// the one sent).
impl PartialEq for Cause {
    fn eq(&self, other: &Cause) -> bool {
        self.chain() == other.chain()
    }
}

impl Serialize for Cause {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.chain())
    }
}

impl<'de> Deserialize<'de> for Cause {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Cause, D::Error> {
        String::deserialize(d).map(|text| Cause::new(RemoteCause(text)))
    }
}

/// A [`Cause`] read back from another process: what it said.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RemoteCause(pub String);

/// How the process running an attempt died ([`EngineError::Crashed`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Death {
    /// Killed by the signal with this number.
    Signal(i32),
    /// Exited with this status.
    Exited(i32),
    /// The engine panicked with this message; its host reported it, then exited.
    Panicked(String),
    /// Closed its output but did not exit, and was killed.
    Silenced,
    /// Ended without saying how.
    Ended,
}

impl std::fmt::Display for Death {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Death::Signal(sig) => {
                let name = match sig {
                    4 => " (SIGILL)",
                    6 => " (SIGABRT)",
                    7 => " (SIGBUS)",
                    8 => " (SIGFPE)",
                    9 => " (SIGKILL: killed, often for memory)",
                    11 => " (SIGSEGV)",
                    15 => " (SIGTERM)",
                    _ => "",
                };
                write!(f, "killed by signal {sig}{name}")
            }
            Death::Exited(code) => write!(f, "exited with status {code}"),
            Death::Panicked(what) => write!(f, "the engine panicked: {what}"),
            Death::Silenced => f.write_str("closed its output and was killed"),
            Death::Ended => f.write_str("ended"),
        }
    }
}

/// A loaded separation engine.
pub trait Engine: Send + Sync + 'static {
    /// Short name for logs and metrics.
    fn name(&self) -> &str;
    /// Devices this engine can use, preferred first; the last is the fallback of the
    /// out-of-memory ladder (normally `cpu`).
    fn devices(&self) -> Vec<Device>;
    /// The models it runs: the pools its worker pulls from and announces in the worker
    /// registry. A job for any other model never reaches it.
    fn models(&self) -> Vec<Model>;
    /// False when the engine never reads the input (the worker then skips the fetch).
    fn reads_input(&self) -> bool {
        true
    }
    /// True when the engine reads the client's `metadata` (the fake engine reads its
    /// script there). The worker hands it over only then: client metadata is for the
    /// client, and an engine that does not ask never sees it.
    fn wants_metadata(&self) -> bool {
        false
    }
    /// How long the input plays, in milliseconds, known before the engine runs (what
    /// credits are reserved for), when the engine can say without reading the input
    /// (the fake engine reads it from its script). `None`: the worker probes the input
    /// file's header itself.
    fn audio_ms(&self, _request: &crate::NormalizedRequest, _metadata: Option<&Value>) -> Option<u64> {
        None
    }
    /// Runs one attempt.
    fn separate(&self, job: &EngineJob<'_>, ctx: &dyn EngineContext) -> Result<Vec<StemFile>, EngineError>;
    /// Runs one attempt keeping the stems in memory, when this engine does so for this
    /// job (small stems only: the worker holds them whole). `None` (the default): it
    /// writes files, and the worker calls [`Engine::separate`] with an output folder.
    /// When this answers, `job.out_dir` does not exist and nothing may be written there.
    fn separate_in_memory(
        &self,
        _job: &EngineJob<'_>,
        _ctx: &dyn EngineContext,
    ) -> Option<Result<Vec<StemBytes>, EngineError>> {
        None
    }
}

/// The message a caught panic carries (`panic!` with a literal or a formatted string),
/// if any.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<String> {
    payload.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| payload.downcast_ref::<String>().cloned())
}

/// The client metadata `engine` may see: all of it when it asks
/// ([`Engine::wants_metadata`]), nothing otherwise. The worker builds every
/// [`EngineJob::metadata`] through this.
pub fn metadata_for<'a>(engine: &dyn Engine, metadata: Option<&'a Value>) -> Option<&'a Value> {
    if engine.wants_metadata() {
        metadata
    } else {
        None
    }
}

/// Several engines behind one: each job goes to the first engine that runs its model.
/// What a worker loads when it serves `dsp` and the demucs models it has weights for.
pub struct Engines {
    engines: Vec<std::sync::Arc<dyn Engine>>,
    name: String,
}

impl Engines {
    /// Combines `engines` (earlier ones win a model both run).
    pub fn new(engines: Vec<std::sync::Arc<dyn Engine>>) -> Engines {
        let name = engines.iter().map(|e| e.name()).collect::<Vec<_>>().join("+");
        Engines { engines, name }
    }

    fn for_model(&self, model: Model) -> Option<&std::sync::Arc<dyn Engine>> {
        self.engines.iter().find(|e| e.models().contains(&model))
    }
}

impl Engine for Engines {
    fn name(&self) -> &str {
        &self.name
    }

    /// Every device of every engine, preferred first, the CPU last.
    fn devices(&self) -> Vec<Device> {
        let mut out: Vec<Device> = Vec::new();
        for d in self.engines.iter().flat_map(|e| e.devices()) {
            if !out.contains(&d) {
                out.push(d);
            }
        }
        out.sort_by_key(|d| d.is_cpu());
        out
    }

    fn models(&self) -> Vec<Model> {
        Model::ALL.iter().copied().filter(|m| self.for_model(*m).is_some()).collect()
    }

    fn reads_input(&self) -> bool {
        self.engines.iter().any(|e| e.reads_input())
    }

    fn wants_metadata(&self) -> bool {
        self.engines.iter().any(|e| e.wants_metadata())
    }

    fn audio_ms(&self, request: &crate::NormalizedRequest, metadata: Option<&Value>) -> Option<u64> {
        self.for_model(request.model)?.audio_ms(request, metadata)
    }

    /// Runs the job on the engine of its model, on the device asked for when that
    /// engine has it, else on that engine's first device.
    fn separate(&self, job: &EngineJob<'_>, ctx: &dyn EngineContext) -> Result<Vec<StemFile>, EngineError> {
        let Some(engine) = self.for_model(job.request.model) else {
            return Err(Engines::unavailable(job));
        };
        let device = Engines::device_on(engine, job);
        engine.separate(&Engines::job_for(engine, job, &device), ctx)
    }

    /// As [`Engines::separate`], when the model's engine keeps its stems in memory.
    fn separate_in_memory(
        &self,
        job: &EngineJob<'_>,
        ctx: &dyn EngineContext,
    ) -> Option<Result<Vec<StemBytes>, EngineError>> {
        let Some(engine) = self.for_model(job.request.model) else {
            return Some(Err(Engines::unavailable(job)));
        };
        let device = Engines::device_on(engine, job);
        engine.separate_in_memory(&Engines::job_for(engine, job, &device), ctx)
    }
}

impl Engines {
    fn unavailable(job: &EngineJob<'_>) -> EngineError {
        EngineError::Unsupported {
            code: FailureCode::ModelUnavailable,
            message: format!("no engine here runs {}", job.request.model),
        }
    }

    /// The device asked for when `engine` has it, else its first.
    fn device_on(engine: &std::sync::Arc<dyn Engine>, job: &EngineJob<'_>) -> Device {
        let devices = engine.devices();
        if devices.contains(job.device) {
            job.device.clone()
        } else {
            devices[0].clone()
        }
    }

    /// `job` as `engine` gets it: on `device`, with the metadata only if it asks.
    fn job_for<'a>(engine: &std::sync::Arc<dyn Engine>, job: &EngineJob<'a>, device: &'a Device) -> EngineJob<'a> {
        let metadata = if engine.wants_metadata() { job.metadata } else { None };
        EngineJob { device, metadata, ..*job }
    }
}

/// The fake engine's script for one job, read from `metadata.fake`.
///
/// ```json
/// {"fake": {"sleep_ms": 500, "fail_transient": 2, "fail_permanent": false,
///           "oom_until": "cpu", "abort": false}}
/// ```
#[cfg(feature = "fake")]
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FakeScript {
    /// Total time the work takes, spread over 10 chunks.
    pub sleep_ms: u64,
    /// Fail transiently on attempts 1..=N.
    pub fail_transient: u32,
    /// Fail permanently (invalid input).
    pub fail_permanent: bool,
    /// Report out-of-memory until this rung of the ladder: `"segment"` (OOM at the
    /// requested segment only; a smaller one works) or `"cpu"` (OOM on every non-CPU
    /// device).
    pub oom_until: Option<String>,
    /// Abort the whole process, on attempts 1..=N (`u32::MAX` for always).
    pub abort: u32,
    /// The length of the pretend input, in milliseconds (default 10 s): what credits
    /// are reserved for.
    pub audio_ms: Option<u64>,
}

/// What the fake engine takes an input to last when its script does not say.
pub const FAKE_AUDIO_MS: u64 = 10_000;

/// A stand-in engine that does no audio work: it follows the job's [`FakeScript`] and
/// writes small deterministic stem files.
#[cfg(feature = "fake")]
#[derive(Debug, Clone)]
pub struct FakeEngine {
    /// Added to every job's own `sleep_ms`.
    pub base_delay: Duration,
    /// The models it pretends to run (default: every model).
    pub models: Vec<Model>,
}

#[cfg(feature = "fake")]
impl Default for FakeEngine {
    fn default() -> Self {
        FakeEngine { base_delay: Duration::ZERO, models: Model::ALL.to_vec() }
    }
}

#[cfg(feature = "fake")]
impl FakeEngine {
    /// A fake engine that runs only `models`.
    pub fn serving(models: &[Model]) -> FakeEngine {
        FakeEngine { models: models.to_vec(), ..FakeEngine::default() }
    }
}

#[cfg(feature = "fake")]
impl Engine for FakeEngine {
    fn name(&self) -> &str {
        "fake"
    }

    fn devices(&self) -> Vec<Device> {
        vec![Device::from("fake-gpu"), Device::Cpu]
    }

    fn models(&self) -> Vec<Model> {
        self.models.clone()
    }

    fn reads_input(&self) -> bool {
        false
    }

    fn wants_metadata(&self) -> bool {
        true
    }

    fn audio_ms(&self, _request: &crate::NormalizedRequest, metadata: Option<&Value>) -> Option<u64> {
        let script: FakeScript = metadata
            .and_then(|m| m.get("fake"))
            .and_then(|v| serde_json::from_value(v.clone()).ok())
            .unwrap_or_default();
        Some(script.audio_ms.unwrap_or(FAKE_AUDIO_MS))
    }

    /// Writes the scripted stems as files (what an isolated fake engine does: its host
    /// process hands files back).
    fn separate(&self, job: &EngineJob<'_>, ctx: &dyn EngineContext) -> Result<Vec<StemFile>, EngineError> {
        self.run_script(job, ctx)?
            .into_iter()
            .map(|stem| {
                let path = job.out_dir.join(format!("{}.{}", stem.stem, job.request.output_format.extension()));
                std::fs::write(&path, &stem.bytes)
                    .map_err(|e| EngineError::transient(format!("writing {}", stem.stem), e))?;
                Ok(StemFile { stem: stem.stem, path, audio: stem.audio })
            })
            .collect()
    }

    /// Its stems are a line each: kept in memory.
    fn separate_in_memory(
        &self,
        job: &EngineJob<'_>,
        ctx: &dyn EngineContext,
    ) -> Option<Result<Vec<StemBytes>, EngineError>> {
        Some(self.run_script(job, ctx))
    }
}

#[cfg(feature = "fake")]
impl FakeEngine {
    /// Follows the job's script; the stems' content on success.
    fn run_script(&self, job: &EngineJob<'_>, ctx: &dyn EngineContext) -> Result<Vec<StemBytes>, EngineError> {
        let script: FakeScript = match job.metadata.and_then(|m| m.get("fake")) {
            Some(v) => serde_json::from_value(v.clone())
                .map_err(|e| EngineError::Unsupported { code: FailureCode::BadFakeScript, message: e.to_string() })?,
            None => FakeScript::default(),
        };
        if job.attempt <= script.abort {
            eprintln!("fake engine: aborting the process as scripted (attempt {})", job.attempt);
            std::process::abort();
        }
        match script.oom_until.as_deref() {
            Some("cpu") if !job.device.is_cpu() => {
                return Err(EngineError::OutOfMemory { device: job.device.to_string() })
            }
            Some("segment") if job.segment.is_none() => {
                return Err(EngineError::OutOfMemory { device: job.device.to_string() })
            }
            _ => {}
        }
        if script.fail_permanent {
            return Err(EngineError::InvalidInput {
                code: FailureCode::InvalidAudio,
                message: "the fake engine was told this input is bad".into(),
            });
        }
        let total = self.base_delay + Duration::from_millis(script.sleep_ms);
        if !total.is_zero() {
            for i in 0..10 {
                if ctx.cancelled() {
                    return Err(EngineError::Cancelled);
                }
                std::thread::sleep(total / 10);
                ctx.progress((i + 1) as f32 / 10.0, "separate");
            }
        }
        if job.attempt <= script.fail_transient {
            return Err(EngineError::transient_without_source(format!(
                "scripted transient failure on attempt {}",
                job.attempt
            )));
        }
        Ok(job
            .request
            .stems()
            .into_iter()
            .map(|stem| {
                let bytes = format!("fake stem {stem} of job {} from {}\n", job.job_id, job.request.audio_uri);
                StemBytes { stem, bytes: bytes.into_bytes(), audio: None }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// An engine that keeps the trait's defaults.
    struct Plain;

    impl Engine for Plain {
        fn name(&self) -> &str {
            "plain"
        }
        fn devices(&self) -> Vec<Device> {
            vec![Device::Cpu]
        }
        fn models(&self) -> Vec<Model> {
            vec![Model::Dsp]
        }
        fn separate(&self, _job: &EngineJob<'_>, _ctx: &dyn EngineContext) -> Result<Vec<StemFile>, EngineError> {
            Ok(Vec::new())
        }
    }

    #[test]
    fn an_engine_that_does_not_ask_gets_no_metadata() {
        let metadata = json!({"owner_ref": "secret", "fake": {"fail_permanent": true}});
        assert!(!Plain.wants_metadata());
        assert_eq!(metadata_for(&Plain, Some(&metadata)), None);
        assert_eq!(metadata_for(&Plain, None), None);
    }

    /// Records the device each job it ran was given.
    struct Cpu(Model, std::sync::Mutex<Vec<Device>>);

    impl Engine for Cpu {
        fn name(&self) -> &str {
            self.0.as_str()
        }
        fn devices(&self) -> Vec<Device> {
            vec![Device::Cpu]
        }
        fn models(&self) -> Vec<Model> {
            vec![self.0]
        }
        fn separate(&self, job: &EngineJob<'_>, _ctx: &dyn EngineContext) -> Result<Vec<StemFile>, EngineError> {
            self.1.lock().unwrap().push(job.device.clone());
            Ok(vec![StemFile { stem: self.0.to_string(), path: job.out_dir.into(), audio: None }])
        }
    }

    struct Quiet;
    impl EngineContext for Quiet {
        fn progress(&self, _: f32, _: &str) {}
        fn cancelled(&self) -> bool {
            false
        }
    }

    #[test]
    fn engines_send_each_job_to_the_engine_of_its_model_on_a_device_it_has() {
        let dsp = std::sync::Arc::new(Cpu(Model::Dsp, Default::default()));
        let ht = std::sync::Arc::new(Cpu(Model::Htdemucs, Default::default()));
        let both = Engines::new(vec![dsp.clone(), ht.clone()]);
        assert_eq!(both.name(), "dsp+htdemucs");
        assert_eq!(both.models(), [Model::Htdemucs, Model::Dsp]);
        let run = |model: &str, device: &Device| {
            let request = crate::request::JobRequest::from_value(json!({"audio_uri": "file:///a.wav", "model": model}))
                .unwrap()
                .normalize("o")
                .unwrap();
            let id = request.job_id();
            let job = EngineJob {
                job_id: &id,
                request: &request,
                metadata: None,
                attempt: 1,
                input: std::path::Path::new("/in"),
                out_dir: std::path::Path::new("/out"),
                device,
                segment: None,
            };
            both.separate(&job, &Quiet).map(|s| s[0].stem.clone())
        };
        assert_eq!(run("dsp", &Device::Cpu).unwrap(), "dsp");
        // A device the model's engine lacks becomes that engine's own.
        assert_eq!(run("htdemucs", &Device::from("cuda")).unwrap(), "htdemucs");
        assert_eq!(*ht.1.lock().unwrap(), [Device::Cpu]);
        let e = run("htdemucs_6s", &Device::Cpu).unwrap_err();
        assert!(
            matches!(e, EngineError::Unsupported { ref code, .. } if *code == FailureCode::ModelUnavailable),
            "{e:?}"
        );
    }

    #[test]
    fn a_transient_failure_keeps_its_source_and_sends_its_text_over_a_pipe() {
        use std::error::Error as _;
        let io = std::io::Error::new(std::io::ErrorKind::StorageFull, "no space left");
        let e = EngineError::transient("writing vocals", io);
        assert_eq!(e.to_string(), "writing vocals");
        let source = e.source().expect("the io error is the source");
        assert_eq!(source.to_string(), "no space left");
        let EngineError::Transient { source: Some(cause), .. } = &e else { panic!("{e:?}") };
        assert_eq!(
            cause.get().downcast_ref::<std::io::Error>().map(|io| io.kind()),
            Some(std::io::ErrorKind::StorageFull)
        );
        // Across a process boundary: the same text, the same value.
        let wire = serde_json::to_value(&e).unwrap();
        assert_eq!(wire, json!({"kind": "transient", "detail": {"what": "writing vocals", "source": "no space left"}}));
        let back: EngineError = serde_json::from_value(wire).unwrap();
        assert_eq!(back, e);
        let EngineError::Transient { source: Some(cause), .. } = &back else { panic!("{back:?}") };
        assert!(cause.get().downcast_ref::<RemoteCause>().is_some());
        let plain = EngineError::transient_without_source("scripted");
        assert_eq!(serde_json::to_value(&plain).unwrap(), json!({"kind": "transient", "detail": {"what": "scripted"}}));
    }

    #[test]
    fn deaths_say_how_the_process_ended() {
        assert_eq!(Death::Signal(6).to_string(), "killed by signal 6 (SIGABRT)");
        assert_eq!(Death::Signal(42).to_string(), "killed by signal 42");
        assert_eq!(Death::Exited(101).to_string(), "exited with status 101");
        let e = EngineError::Crashed(Death::Panicked("boom".into()));
        assert_eq!(e.to_string(), "the engine process died: the engine panicked: boom");
        let back: EngineError = serde_json::from_value(serde_json::to_value(&e).unwrap()).unwrap();
        assert_eq!(back, e);
    }

    #[cfg(feature = "fake")]
    #[test]
    fn the_fake_engine_asks_for_its_script() {
        let metadata = json!({"fake": {"fail_permanent": true}});
        let fake = FakeEngine::default();
        assert!(fake.wants_metadata());
        assert_eq!(metadata_for(&fake, Some(&metadata)), Some(&metadata));
        assert_eq!(metadata_for(&fake, None), None);
    }
}
