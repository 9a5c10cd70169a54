//! The HTDemucs engine through the whole pipeline: upload over HTTP, submit
//! `{"model": "htdemucs", ...}`, an in-process worker running `DemucsEngine` on a model
//! folder whose `htdemucs.yaml` names the committed reduced checkpoint (8 kHz, 1.5 s
//! segment, random weights), then the stems downloaded over HTTP and decoded.
//!
//! The weights are random, so the stems do not sum back to the mix; instead every stem
//! is checked against a direct `DemucsEngine::separate` call on the same input with the
//! same job id (shifts are seeded from it), which must give the same samples, and the
//! two-stem request against the four-stem one (`no_vocals` is the sum of the others,
//! demucs's `--other-method add`). Stems are float WAV without clipping, so the only
//! difference allowed is float summation order (1e-6).
//!
//! Also cross-job batching: two jobs at once on one worker share forward passes and
//! still get exactly their own samples.
//!
//! Also the memory guard with the worker's out-of-memory ladder: a budget that fits only
//! the ladder's smaller segment (the job succeeds, degraded, with that segment), and one
//! that fits nothing (the job fails at once with `over_memory_budget`).
//!
//! Needs `--features demucs` (Burn): `scripts/test.sh` turns it on.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use stemq_audio::{ClipMode, DecodeOptions, Decoder, OutputFormat, StemEncoder, StereoChunk};
use stemq_core::engine::{Engine, EngineContext, EngineJob};
use stemq_core::event::EventBody;
use stemq_core::{JobId, JobStatus, JobView};
use stemq_demucs::batch::CrossJobBatching;
use stemq_demucs::engine::{DemucsEngine, DemucsEngineConfig};
use stemq_demucs::memory::forward_peak_bytes;
use stemq_tests::{job_id, Stack, StackOptions};

/// The fixture model's sample rate and trained segment.
const SR: u32 = 8000;
const MODEL_SEGMENT: f64 = 1.5;
/// 2.5 s of input: two segments with overlap at 1.5 s, three at 1 s.
const FRAMES: usize = 20_000;
/// Debug builds are slow; the fixture model still needs well under a second per pass.
const WAIT: Duration = Duration::from_secs(120);

/// A model folder holding the reduced checkpoint as `htdemucs`.
fn model_folder(dir: &Path) -> PathBuf {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../services/demucs/tests/fixtures/repo");
    let repo = dir.join("models");
    std::fs::create_dir_all(&repo).unwrap();
    std::fs::copy(fixtures.join("a0a0a0a0.th"), repo.join("a0a0a0a0.th")).expect("fixture checkpoint");
    std::fs::write(repo.join("htdemucs.yaml"), "models: ['a0a0a0a0']\n").unwrap();
    repo
}

fn engine(repo: &Path, memory_budget: Option<u64>) -> DemucsEngine {
    DemucsEngine::new(config(repo, memory_budget)).expect("model folder")
}

/// The engine's settings for model folder `repo`.
fn config(repo: &Path, memory_budget: Option<u64>) -> DemucsEngineConfig {
    DemucsEngineConfig {
        repo: repo.to_path_buf(),
        clip: ClipMode::None,
        max_duration_secs: None,
        gpu_batch: 1,
        cpu_jobs: 2,
        memory_budget,
        cross_job: None,
        gpu_weights: Default::default(),
        device: None,
        device_max_alloc: None,
    }
}

/// A stereo mix with some structure (two tones, a decaying click train, noise).
fn mix() -> [Vec<f32>; 2] {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut noise = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let mut l = Vec::with_capacity(FRAMES);
    let mut r = Vec::with_capacity(FRAMES);
    for i in 0..FRAMES {
        let t = i as f32 / SR as f32;
        let click = (-((i % 2000) as f32) / 150.0).exp();
        let n = noise();
        l.push(0.3 * (2.0 * std::f32::consts::PI * 220.0 * t).sin() + 0.2 * click + 0.05 * n);
        r.push(0.3 * (2.0 * std::f32::consts::PI * 330.0 * t).sin() + 0.2 * click - 0.05 * n);
    }
    [l, r]
}

fn write_wav(path: &Path) {
    let [l, r] = mix();
    let mut enc = StemEncoder::create(path, OutputFormat::WavF32, ClipMode::None, SR).unwrap();
    enc.write(&StereoChunk::from_planar(l, r)).unwrap();
    enc.finish().unwrap();
}

/// Decodes a WAV (no resampling: the stems are at the model's rate); `[left, right]`.
fn decode(path: &Path) -> [Vec<f32>; 2] {
    let mut d = Decoder::open_path(path, DecodeOptions { target_sample_rate: SR, max_duration_secs: None })
        .expect("a decodable WAV");
    let mut all = StereoChunk::with_capacity(0);
    while let Some(c) = d.next_chunk().expect("decodes") {
        all.extend_from(&c);
    }
    [all.left, all.right]
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Uploads the mix over HTTP; returns its `audio_uri`.
async fn upload(stack: &Stack) -> String {
    let path = stack.dir.path().join("mix.wav");
    write_wav(&path);
    let r = stack
        .request(reqwest::Method::POST, "/v1/uploads?filename=mix.wav")
        .body(std::fs::read(&path).unwrap())
        .send()
        .await
        .expect("upload");
    assert_eq!(r.status().as_u16(), 201, "upload answer");
    let v: Value = r.json().await.unwrap();
    v["audio_uri"].as_str().expect("audio_uri").to_string()
}

fn request(audio_uri: &str, extra: Value) -> Value {
    let mut v = json!({
        "audio_uri": audio_uri, "model": "htdemucs", "output_format": "wav", "encoding": "f32",
        "clip_mode": "none", "shifts": 0, "overlap": 0.25,
    });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

/// The job's `succeeded` event.
async fn succeeded_event(stack: &Stack, id: &JobId) -> stemq_core::event::Succeeded {
    stack
        .events(id)
        .await
        .into_iter()
        .find_map(|e| match e.body {
            EventBody::Succeeded(s) => Some(s),
            _ => None,
        })
        .expect("a succeeded event")
}

/// Submits and waits for a terminal state.
async fn run_job(stack: &Stack, body: &Value) -> (JobId, JobView) {
    let (code, answer) = stack.submit(body).await;
    assert_eq!(code, 202, "{answer}");
    let id = job_id(&answer);
    let view = stack.wait_terminal(&id, WAIT).await;
    (id, view)
}

/// Downloads every stem of a succeeded job over HTTP and decodes it.
async fn download(stack: &Stack, id: &JobId, view: &JobView) -> Vec<(String, [Vec<f32>; 2])> {
    let mut out = Vec::new();
    for o in &view.outputs {
        let r = stack
            .request(reqwest::Method::GET, &format!("/v1/separations/{id}/stems/{}", o.stem))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200, "stem {}", o.stem);
        let path = stack.dir.path().join(format!("{id}-{}.wav", o.stem));
        std::fs::write(&path, r.bytes().await.unwrap()).unwrap();
        out.push((o.stem.clone(), decode(&path)));
    }
    out
}

struct NoCtx;
impl EngineContext for NoCtx {
    fn progress(&self, _: f32, _: &str) {}
    fn cancelled(&self) -> bool {
        false
    }
}

/// The same job run by the engine directly, outside the pipeline.
fn direct(engine: &DemucsEngine, stack: &Stack, id: &JobId, body: &Value, segment: Option<f64>) -> Vec<[Vec<f32>; 2]> {
    direct_on(engine, &stemq_core::device::Device::Cpu, stack, id, body, segment)
}

/// [`direct`] on `device`.
fn direct_on(
    engine: &DemucsEngine,
    device: &stemq_core::device::Device,
    stack: &Stack,
    id: &JobId,
    body: &Value,
    segment: Option<f64>,
) -> Vec<[Vec<f32>; 2]> {
    let request = stemq_core::JobRequest::from_value(body.clone()).unwrap().normalize("anonymous").unwrap();
    let input = stack.dir.path().join("mix.wav");
    let out = tempfile::tempdir().unwrap();
    let job = EngineJob {
        job_id: id,
        request: &request,
        metadata: None,
        attempt: 1,
        input: &input,
        out_dir: out.path(),
        device,
        segment,
    };
    engine.separate(&job, &NoCtx).expect("direct run").iter().map(|s| decode(&s.path)).collect()
}

async fn stack_with(engine: DemucsEngine) -> Stack {
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    stack.add_worker(Arc::new(engine)).await;
    stack
}

/// Peak bytes of one forward pass of the fixture model at `seconds`.
fn pass_bytes(engine: &DemucsEngine, seconds: f64) -> u64 {
    let bag = engine.cpu_model("htdemucs").unwrap();
    forward_peak_bytes(bag.models()[0].config(), (seconds * SR as f64) as usize, 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn htdemucs_four_and_two_stems_through_the_pipeline() {
    let models = tempfile::tempdir().unwrap();
    let repo = model_folder(models.path());
    let stack = stack_with(engine(&repo, None)).await;
    let uri = upload(&stack).await;

    let body = request(&uri, json!({}));
    let (id, view) = run_job(&stack, &body).await;
    assert_eq!(view.status, JobStatus::Succeeded, "{view:#?}");
    assert!(!view.degraded);
    let stems = download(&stack, &id, &view).await;
    let names: Vec<_> = stems.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["drums", "bass", "other", "vocals"]);
    let reference = direct(&engine(&repo, None), &stack, &id, &body, None);
    let [mix_l, _] = mix();
    for ((name, got), want) in stems.iter().zip(&reference) {
        for c in 0..2 {
            assert_eq!(got[c].len(), FRAMES, "{name}: one output frame per input frame");
            assert!(got[c].iter().any(|v| v.abs() > 1e-4), "{name} is not silent");
            assert_eq!(max_diff(&got[c], &want[c]), 0.0, "{name}: same samples as the engine run directly");
        }
    }
    // A model that is not installed never reaches this worker (its pool is another
    // one): the job waits, saying for what, instead of failing on the wrong worker.
    let (code, answer) = stack.submit(&request(&uri, json!({"model": "htdemucs_6s"}))).await;
    assert_eq!(code, 202, "{answer}");
    let missing = job_id(&answer);
    let t0 = std::time::Instant::now();
    let waiting = loop {
        let (_, v) = stack.get(&format!("/v1/separations/{missing}")).await;
        if v["waiting"].is_string() || t0.elapsed() > WAIT {
            break v;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(waiting["status"], "queued", "{waiting}");
    assert_eq!(waiting["waiting"], "waiting for a worker that serves htdemucs_6s", "{waiting}");
    assert_eq!(stack.count_on(&format!("stemq.jobs.{missing}.started")).await, 0, "a worker took it");

    // Two stems: vocals as above, no_vocals = drums + bass + other.
    let (id2, view2) = run_job(&stack, &request(&uri, json!({"two_stems": "vocals"}))).await;
    assert_eq!(view2.status, JobStatus::Succeeded, "{view2:#?}");
    let two = download(&stack, &id2, &view2).await;
    let names: Vec<_> = two.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["vocals", "no_vocals"]);
    for c in 0..2 {
        assert!(max_diff(&two[0].1[c], &stems[3].1[c]) <= 1e-6, "vocals of the two-stem job");
        let others: Vec<f32> = (0..FRAMES).map(|i| stems[0].1[c][i] + stems[1].1[c][i] + stems[2].1[c][i]).collect();
        assert!(max_diff(&two[1].1[c], &others) <= 1e-6, "no_vocals = drums + bass + other");
    }
    assert_ne!(two[0].1[0], mix_l, "the model did something");
    stack.shutdown().await;
}

/// Two different jobs (the shifted one reads its chunks at other offsets), submitted
/// before any worker runs so that one with two job loops takes both at once.
async fn two_jobs(stack: &Stack, uri: &str) -> Vec<(JobId, Value)> {
    let mut jobs = Vec::new();
    for body in [request(uri, json!({})), request(uri, json!({"shifts": 1}))] {
        let (code, answer) = stack.submit(&body).await;
        assert_eq!(code, 202, "{answer}");
        jobs.push((job_id(&answer), body));
    }
    jobs
}

/// Each job succeeded with the very samples the engine gives it alone (`worker`: the
/// worker process whose log explains a failure, if any).
async fn assert_as_alone(stack: &Stack, jobs: &[(JobId, Value)], repo: &Path, worker: &str) {
    assert_as_alone_on(stack, jobs, &engine(repo, None), &stemq_core::device::Device::Cpu, worker).await;
}

/// [`assert_as_alone`] against `alone` on `device`.
async fn assert_as_alone_on(
    stack: &Stack,
    jobs: &[(JobId, Value)],
    alone: &DemucsEngine,
    device: &stemq_core::device::Device,
    worker: &str,
) {
    for (id, body) in jobs {
        let view = stack.wait_terminal(id, WAIT).await;
        let log = if worker.is_empty() { String::new() } else { stack.worker_log(worker) };
        assert_eq!(view.status, JobStatus::Succeeded, "{view:#?}\n{log}");
        let stems = download(stack, id, &view).await;
        let reference = direct_on(alone, device, stack, id, body, None);
        assert_eq!(stems.len(), 4);
        for ((name, got), want) in stems.iter().zip(&reference) {
            for c in 0..2 {
                assert_eq!(max_diff(&got[c], &want[c]), 0.0, "{id} {name}: the job's samples as alone");
            }
        }
    }
}

/// Issue 14: a worker with two job loops and cross-job batching takes two jobs at once;
/// their chunks share forward passes, and each job's stems are the samples the engine
/// gives that job alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_jobs_on_one_worker_share_forward_passes_and_keep_their_stems() {
    let models = tempfile::tempdir().unwrap();
    let repo = model_folder(models.path());
    let batching = Arc::new(
        DemucsEngine::new(DemucsEngineConfig {
            // A long linger: the two jobs start within it, whatever the machine's load.
            cross_job: Some(CrossJobBatching { max_rows: 4, linger: Duration::from_secs(2) }),
            gpu_weights: Default::default(),
            ..config(&repo, None)
        })
        .unwrap(),
    );
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let uri = upload(&stack).await;
    let jobs = two_jobs(&stack, &uri).await;
    stack.add_worker_with(batching.clone(), 2).await;
    assert_as_alone(&stack, &jobs, &repo, "").await;
    let stats = batching.cpu_model("htdemucs").unwrap().hub().expect("a hub").stats();
    assert!(stats.shared > 0 && stats.rows > stats.forwards, "the jobs shared no forward pass: {stats:?}");
    stack.shutdown().await;
}

/// The same through the `stemq worker` command line: `--isolation shared
/// --concurrency 2 --batch-across-jobs 4` runs both jobs in one engine host, where they
/// share forward passes (its log says how many), with each job's samples as alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_process_with_a_shared_engine_host_batches_across_jobs() {
    let models = tempfile::tempdir().unwrap();
    let repo = model_folder(models.path());
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let uri = upload(&stack).await;
    let jobs = two_jobs(&stack, &uri).await;
    let repo_arg = repo.to_str().unwrap();
    let extra = [
        ("STEMQ_ENGINE", "demucs"),
        ("STEMQ_MODELS", repo_arg),
        ("STEMQ_ISOLATION", "shared"),
        ("STEMQ_CONCURRENCY", "2"),
        ("STEMQ_BATCH_ACROSS_JOBS", "4"),
        ("STEMQ_BATCH_LINGER_MS", "2000"),
    ];
    let mut w = stack.spawn_worker("batching", &extra);
    assert_as_alone(&stack, &jobs, &repo, "batching").await;
    let log = stack.worker_log("batching");
    let shared = log
        .lines()
        .filter(|l| l.contains("cross-job batching"))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["fields"]["shared"].as_u64().or_else(|| v["shared"].as_u64()))
        .max();
    assert!(shared.is_some_and(|n| n > 0), "no shared forward pass in the host's log:\n{log}");
    stemq_tests::signal(&w, stemq_tests::SIGTERM);
    assert!(stemq_tests::wait_exit(&mut w, WAIT).expect("exits").success());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_budget_for_a_smaller_segment_degrades_the_job() {
    let models = tempfile::tempdir().unwrap();
    let repo = model_folder(models.path());
    let probe = engine(&repo, None);
    let (full, short) = (pass_bytes(&probe, MODEL_SEGMENT), pass_bytes(&probe, 1.0));
    assert!(short < full, "a shorter pass needs less: {short} vs {full}");
    let budget = (short + full) / 2;
    let stack = stack_with(engine(&repo, Some(budget))).await;
    let uri = upload(&stack).await;

    // The worker's ladder halves the requested segment (never below 1 s): 1.5 s → 1 s.
    let body = request(&uri, json!({"segment": MODEL_SEGMENT}));
    let (id, view) = run_job(&stack, &body).await;
    assert_eq!(view.status, JobStatus::Succeeded, "{view:#?}");
    assert!(view.degraded, "finished on the ladder's smaller segment");
    let succeeded = succeeded_event(&stack, &id).await;
    assert_eq!(
        (succeeded.degraded, succeeded.segment, succeeded.device.to_string().as_str()),
        (true, Some(1.0), "cpu")
    );
    let stems = download(&stack, &id, &view).await;
    assert_eq!(stems.len(), 4);
    let reference = direct(&engine(&repo, Some(budget)), &stack, &id, &body, Some(1.0));
    let unlimited = direct(&probe, &stack, &id, &body, Some(1.0));
    for ((name, got), want) in stems.iter().zip(&reference) {
        for c in 0..2 {
            assert_eq!(got[c].len(), FRAMES, "{name}");
            assert_eq!(max_diff(&got[c], &want[c]), 0.0, "{name}: same as the engine run directly");
        }
    }
    // Shortened passes really ran (1 s of context instead of 1.5 s padded), so the
    // result differs from an unlimited engine's at the same segment.
    assert!(max_diff(&stems[0].1[0], &unlimited[0][0]) > 1e-4, "the forward pass was shortened");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_too_small_for_every_rung_fails_the_job_at_once() {
    let models = tempfile::tempdir().unwrap();
    let repo = model_folder(models.path());
    let probe = engine(&repo, None);
    let budget = pass_bytes(&probe, 1.0) / 2;
    let stack = stack_with(engine(&repo, Some(budget))).await;
    let uri = upload(&stack).await;

    let (id, view) = run_job(&stack, &request(&uri, json!({"segment": MODEL_SEGMENT}))).await;
    assert_eq!(view.status, JobStatus::Failed, "{view:#?}");
    let error = view.error.as_ref().expect("an error");
    assert_eq!(error.code, "over_memory_budget", "{error:?}");
    assert!(error.message.contains(&budget.to_string()), "the message names the budget: {}", error.message);
    assert_eq!(view.attempt, 1, "a permanent failure: no redelivery");
    assert_eq!(view.retries, 0);
    let failed = stack.events(&id).await.into_iter().filter(|e| matches!(e.body, EventBody::Failed(_))).count();
    assert_eq!(failed, 1, "one failure event, not a retry loop");
    stack.shutdown().await;
}

/// A GPU that runs out of memory: the demucs engine, offered as `cuda` and `cpu`. On
/// `cuda` it runs the CPU model with a context whose progress callback panics with the
/// text CubeCL prints when a CUDA allocation fails (`IoError::BufferTooBig`): the panic
/// rises from inside the engine's run, as the backend's would.
struct OutOfMemoryGpu(DemucsEngine);

struct AllocationFails;

impl EngineContext for AllocationFails {
    fn progress(&self, _: f32, _: &str) {
        panic!("can't allocate buffer of size: 4294967296");
    }
    fn cancelled(&self) -> bool {
        false
    }
}

impl Engine for OutOfMemoryGpu {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn devices(&self) -> Vec<stemq_core::device::Device> {
        vec![stemq_core::device::Device::Cuda(None), stemq_core::device::Device::Cpu]
    }
    fn models(&self) -> Vec<stemq_core::request::Model> {
        self.0.models()
    }
    fn separate(
        &self,
        job: &EngineJob<'_>,
        ctx: &dyn EngineContext,
    ) -> Result<Vec<stemq_core::engine::StemFile>, stemq_core::engine::EngineError> {
        if job.device.is_cpu() {
            return self.0.separate(job, ctx);
        }
        let on_cpu = EngineJob { device: &stemq_core::device::Device::Cpu, ..*job };
        self.0.separate(&on_cpu, &AllocationFails)
    }
}

/// Issue 14: a CUDA out-of-memory inside the demucs engine reaches the worker's ladder
/// as an out-of-memory step: the smaller segment on the GPU (out of memory again), then
/// the CPU, where the job succeeds, degraded, with the same stems as a direct CPU run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cuda_out_of_memory_steps_down_the_ladder_to_the_cpu() {
    let models = tempfile::tempdir().unwrap();
    let repo = model_folder(models.path());
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    stack.add_worker(Arc::new(OutOfMemoryGpu(engine(&repo, None)))).await;
    let uri = upload(&stack).await;
    let body = request(&uri, json!({}));
    let (id, view) = run_job(&stack, &body).await;
    assert_eq!(view.status, JobStatus::Succeeded, "{view:#?}");
    assert!(view.degraded, "finished down the ladder");
    assert_eq!(view.device.as_deref(), Some("cpu"));
    assert_eq!(view.attempt, 1, "the ladder is within one delivery: no redelivery");
    let succeeded = succeeded_event(&stack, &id).await;
    assert_eq!((succeeded.degraded, succeeded.device.to_string().as_str()), (true, "cpu"));
    let stems = download(&stack, &id, &view).await;
    let reference = direct(&engine(&repo, None), &stack, &id, &body, None);
    for ((name, got), want) in stems.iter().zip(&reference) {
        for c in 0..2 {
            assert_eq!(max_diff(&got[c], &want[c]), 0.0, "{name}: the CPU rung's stems");
        }
    }
    stack.shutdown().await;
}

/// The demucs engine on a Vulkan device (`--features vulkan`; Mesa's lavapipe in CI):
/// a `stemq worker --device vulkan` process serves a job end to end, cross-job batching
/// keeps each job's samples bit for bit, a real device allocation failure steps down
/// the ladder, and a worker killed mid-job loses nothing.
#[cfg(feature = "vulkan")]
mod vulkan {
    use super::*;
    use stemq_core::device::Device;

    /// The Vulkan device the tests run on (`vulkan`, a software driver allowed), or
    /// `None` after a SKIPPED line (a failure in CI).
    fn device() -> Option<Device> {
        match stemq_demucs::vulkan::resolve(None, true) {
            Some(a) => Some(Device::Vulkan(Some(a.index))),
            None => {
                let why = "no Vulkan device (Mesa's lavapipe: scripts/install-test-deps.sh)";
                assert!(std::env::var("CI").as_deref() != Ok("true"), "{why}");
                eprintln!("SKIPPED: the Vulkan pipeline tests: {why}");
                None
            }
        }
    }

    /// The engine offering `device` first (then the CPU).
    fn engine_on(repo: &Path, device: &Device, cross_job: Option<CrossJobBatching>) -> DemucsEngine {
        DemucsEngine::new(DemucsEngineConfig { device: Some(device.clone()), cross_job, ..config(repo, None) })
            .expect("model folder")
    }

    /// SNR in dB of `got` against `want`.
    fn snr(want: &[f32], got: &[f32]) -> f64 {
        let sig: f64 = want.iter().map(|v| (*v as f64).powi(2)).sum();
        let err: f64 = want.iter().zip(got).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
        10.0 * (sig / err.max(1e-300)).log10()
    }

    /// A worker process on the Vulkan device, through the engine host (`--isolation
    /// process`, the default): the job runs there, not degraded; its stems are the
    /// engine's own on that device, bit for bit, and within 80 dB of the CPU's; the
    /// registry shows the device.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_vulkan_worker_process_serves_a_job_end_to_end() {
        let Some(device) = device() else { return };
        let models = tempfile::tempdir().unwrap();
        let repo = model_folder(models.path());
        let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
        let uri = upload(&stack).await;
        let extra = [("STEMQ_ENGINE", "demucs"), ("STEMQ_MODELS", repo.to_str().unwrap()), ("STEMQ_DEVICE", "vulkan")];
        let mut w = stack.spawn_worker("vulkan", &extra);
        let body = request(&uri, json!({}));
        let (id, view) = run_job(&stack, &body).await;
        assert_eq!(view.status, JobStatus::Succeeded, "{view:#?}\n{}", stack.worker_log("vulkan"));
        assert!(!view.degraded, "{view:#?}");
        assert_eq!(view.device.as_deref(), Some(device.to_string().as_str()));
        let (_, fleet) = stack.get("/v1/workers").await;
        let listed = fleet["workers"].as_array().unwrap().iter().find(|w| w["name"] == "vulkan").cloned();
        assert_eq!(
            listed.expect("the worker in the registry")["devices"],
            json!([device.to_string(), "cpu"]),
            "{fleet}"
        );
        let stems = download(&stack, &id, &view).await;
        let on_device = direct_on(&engine_on(&repo, &device, None), &device, &stack, &id, &body, None);
        let on_cpu = direct(&engine(&repo, None), &stack, &id, &body, None);
        for (((name, got), want), cpu) in stems.iter().zip(&on_device).zip(&on_cpu) {
            for c in 0..2 {
                assert_eq!(got[c].len(), FRAMES, "{name}");
                assert_eq!(max_diff(&got[c], &want[c]), 0.0, "{name}: the engine's samples on {device}");
                let db = snr(&cpu[c], &got[c]);
                eprintln!("PARITY vulkan pipeline {name}[{c}] against the CPU: SNR {db:.1} dB");
                assert!(db >= 80.0, "{name}[{c}]: {db:.1} dB against the CPU");
            }
        }
        stemq_tests::signal(&w, stemq_tests::SIGTERM);
        assert!(stemq_tests::wait_exit(&mut w, WAIT).expect("exits").success());
        stack.shutdown().await;
    }

    /// Two jobs at once on one worker with cross-job batching on the Vulkan device: they
    /// share forward passes (batches of rows from both), and each job's stems are bit
    /// for bit what the device gives it alone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_jobs_on_a_vulkan_worker_share_forward_passes_and_keep_their_stems() {
        let Some(device) = device() else { return };
        let models = tempfile::tempdir().unwrap();
        let repo = model_folder(models.path());
        let batching =
            Arc::new(engine_on(&repo, &device, Some(CrossJobBatching { max_rows: 4, linger: Duration::from_secs(2) })));
        // lavapipe runs the kernels on the CPU: a loaded 2-core box needs more than the
        // stack's default job limit for two jobs.
        let opts = StackOptions { workers: 0, time_limit: Duration::from_secs(600), ..Default::default() };
        let mut stack = Stack::start(opts).await;
        let uri = upload(&stack).await;
        let jobs = two_jobs(&stack, &uri).await;
        stack.add_worker_with(batching.clone(), 2).await;
        assert_as_alone_on(&stack, &jobs, &engine_on(&repo, &device, None), &device, "").await;
        for (id, _) in &jobs {
            let view = stack.wait_terminal(id, WAIT).await;
            assert_eq!(view.device.as_deref(), Some(device.to_string().as_str()));
        }
        let Device::Vulkan(index) = device else { unreachable!() };
        let (bag, _) = batching.vulkan_model(index, "htdemucs").unwrap();
        let stats = bag.hub().expect("a hub").stats();
        assert!(stats.shared > 0 && stats.rows > stats.forwards, "the jobs shared no forward pass: {stats:?}");
        stack.shutdown().await;
    }

    /// A real allocation failure on the device: a worker whose Vulkan memory pool takes
    /// no single allocation above `STEMQ_DEVICE_MAX_ALLOC` (as a smaller GPU would run
    /// out) fails the forward passes at the model's segment and at the ladder's smaller
    /// one, then finishes on the CPU: degraded, one delivery, the CPU's stems.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_vulkan_allocation_failure_steps_down_the_ladder() {
        let Some(_device) = device() else { return };
        let models = tempfile::tempdir().unwrap();
        let repo = model_folder(models.path());
        let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
        let uri = upload(&stack).await;
        let extra = [
            ("STEMQ_ENGINE", "demucs"),
            ("STEMQ_MODELS", repo.to_str().unwrap()),
            ("STEMQ_DEVICE", "vulkan"),
            ("STEMQ_DEVICE_MAX_ALLOC", &max_alloc(&repo).to_string()),
        ];
        let mut w = stack.spawn_worker("small-gpu", &extra);
        let body = request(&uri, json!({}));
        let (id, view) = run_job(&stack, &body).await;
        let log = stack.worker_log("small-gpu");
        assert_eq!(view.status, JobStatus::Succeeded, "{view:#?}\n{log}");
        assert!(view.degraded, "finished down the ladder: {view:#?}");
        assert_eq!(view.device.as_deref(), Some("cpu"));
        assert_eq!(view.attempt, 1, "the ladder is within one delivery");
        assert!(log.contains("out_of_memory") || log.contains("out of memory"), "no out-of-memory step logged:\n{log}");
        let stems = download(&stack, &id, &view).await;
        let reference = direct(&engine(&repo, None), &stack, &id, &body, None);
        for ((name, got), want) in stems.iter().zip(&reference) {
            for c in 0..2 {
                assert_eq!(max_diff(&got[c], &want[c]), 0.0, "{name}: the CPU rung's stems");
            }
        }
        stemq_tests::signal(&w, stemq_tests::SIGTERM);
        assert!(stemq_tests::wait_exit(&mut w, WAIT).expect("exits").success());
        stack.shutdown().await;
    }

    /// The pool limit of [`a_vulkan_allocation_failure_steps_down_the_ladder`]: twice
    /// the largest weight of the fixture model (so it loads, alignment and all), far
    /// below the activations of a forward pass at 1 s or 1.5 s.
    fn max_alloc(repo: &Path) -> u64 {
        let ckpt = stemq_demucs::checkpoint::Checkpoint::load(&repo.join("a0a0a0a0.th")).unwrap();
        let largest = ckpt.state.keys().map(|k| ckpt.state.get(k).unwrap().shape.iter().product::<usize>()).max();
        2 * 4 * largest.unwrap() as u64
    }

    /// A worker on the Vulkan device killed (SIGKILL) in the middle of a job: the job
    /// is redelivered to another worker and succeeds there, every stem complete.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_vulkan_worker_killed_mid_job_loses_nothing() {
        let Some(device) = device() else { return };
        let models = tempfile::tempdir().unwrap();
        let repo = model_folder(models.path());
        let mut opts = StackOptions { workers: 0, ..Default::default() };
        opts.settings.ack_wait = Duration::from_millis(2000);
        let mut stack = Stack::start(opts).await;
        let uri = upload(&stack).await;
        let extra = [("STEMQ_ENGINE", "demucs"), ("STEMQ_MODELS", repo.to_str().unwrap()), ("STEMQ_DEVICE", "vulkan")];
        let mut w = stack.spawn_worker("doomed", &extra);
        // Shifts make the job long enough to be killed in the middle of it.
        let body = request(&uri, json!({"shifts": 4}));
        let (code, answer) = stack.submit(&body).await;
        assert_eq!(code, 202, "{answer}");
        let id = job_id(&answer);
        let running = stack.wait_status(&id, JobStatus::Running, WAIT).await;
        assert_eq!(running.device.as_deref(), Some(device.to_string().as_str()), "{running:#?}");
        stemq_tests::signal(&w, stemq_tests::SIGKILL);
        stemq_tests::wait_exit(&mut w, WAIT).expect("killed");
        let (_, v) = stack.get(&format!("/v1/separations/{id}")).await;
        assert_ne!(v["status"], "succeeded", "the job ended before the kill: {v}");
        stack.add_worker(Arc::new(engine(&repo, None))).await;
        let view = stack.wait_terminal(&id, WAIT).await;
        assert_eq!(view.status, JobStatus::Succeeded, "{view:#?}");
        assert_eq!(view.attempt, 2, "redelivered once: {view:#?}");
        assert_eq!(view.device.as_deref(), Some("cpu"));
        let stems = download(&stack, &id, &view).await;
        assert_eq!(stems.len(), 4);
        let reference = direct(&engine(&repo, None), &stack, &id, &body, None);
        for ((name, got), want) in stems.iter().zip(&reference) {
            for c in 0..2 {
                assert_eq!(max_diff(&got[c], &want[c]), 0.0, "{name}: complete, as a run alone");
            }
        }
        stack.shutdown().await;
    }
}
