//! The stemq `Engine` implementation end to end: a WAV file in, stem files out, through
//! a model folder holding the reduced random checkpoint under the name `htdemucs`.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use common::{figures, fixtures, load};
use stemq_audio::{ClipMode, DecodeOptions, Decoder, OutputFormat, StemEncoder, StereoChunk};
use stemq_core::engine::{Engine, EngineContext, EngineError, EngineJob};
use stemq_core::request::{Encoding, JobId, Model, NormalizedRequest, OtherMethod, OutputFormat as RequestFormat};
use stemq_demucs::engine::{DemucsEngine, DemucsEngineConfig, MemoryPlan};
use stemq_demucs::memory::forward_peak_bytes;

struct Ctx {
    progress: Mutex<Vec<f32>>,
    cancel_after: Option<usize>,
    calls: AtomicUsize,
    cancelled: AtomicBool,
}

impl Ctx {
    fn new(cancel_after: Option<usize>) -> Self {
        Ctx {
            progress: Mutex::new(Vec::new()),
            cancel_after,
            calls: AtomicUsize::new(0),
            cancelled: AtomicBool::new(false),
        }
    }
}

impl EngineContext for Ctx {
    fn progress(&self, fraction: f32, _stage: &str) {
        self.progress.lock().unwrap().push(fraction);
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if self.cancel_after.is_some_and(|k| n >= k) {
            self.cancelled.store(true, Ordering::SeqCst);
        }
    }
    fn cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }
}

fn request(model: Model, two_stems: Option<&str>) -> NormalizedRequest {
    NormalizedRequest {
        audio_uri: "file:///input.wav".into(),
        model,
        two_stems: two_stems.map(String::from),
        other_method: None,
        output_format: RequestFormat::Wav,
        mp3_bitrate: None,
        mp3_preset: None,
        encoding: Default::default(),
        clip_mode: Default::default(),
        segment: None,
        overlap: 0.25,
        shifts: 0,
        owner: "test".into(),
        retry_of: None,
    }
}

struct Setup {
    _dir: tempfile::TempDir,
    engine: DemucsEngine,
    input: std::path::PathBuf,
    out: std::path::PathBuf,
}

fn setup() -> Setup {
    setup_with_budget(None)
}

fn setup_with_budget(memory_budget: Option<u64>) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("models");
    std::fs::create_dir(&repo).unwrap();
    std::fs::copy(fixtures().join("repo/a0a0a0a0.th"), repo.join("a0a0a0a0.th")).unwrap();
    std::fs::write(repo.join("htdemucs.yaml"), "models: ['a0a0a0a0']\n").unwrap();
    // The fixture track as a float WAV at the model's 8 kHz.
    let input = write_track(dir.path(), &load("apply.safetensors")["track"]);
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let engine = engine_at(repo, memory_budget);
    Setup { _dir: dir, engine, input, out }
}

/// `dir/input.wav`: a `[2, L]` track as a float WAV at the fixtures' 8 kHz.
fn write_track(dir: &std::path::Path, track: &stemq_demucs::checkpoint::HostTensor) -> std::path::PathBuf {
    let len = track.shape[1];
    let input = dir.join("input.wav");
    let mut enc = StemEncoder::create(&input, OutputFormat::WavF32, ClipMode::None, 8000).unwrap();
    enc.write(&StereoChunk::from_planar(track.data[..len].to_vec(), track.data[len..].to_vec())).unwrap();
    enc.finish().unwrap();
    input
}

/// The engine on model folder `repo`.
fn engine_at(repo: std::path::PathBuf, memory_budget: Option<u64>) -> DemucsEngine {
    DemucsEngine::new(DemucsEngineConfig {
        repo,
        clip: ClipMode::None,
        max_duration_secs: None,
        gpu_batch: 4,
        cpu_jobs: 2,
        memory_budget,
        cross_job: None,
        gpu_weights: Default::default(),
        device: None,
        device_max_alloc: None,
    })
    .unwrap()
}

fn job<'a>(s: &'a Setup, req: &'a NormalizedRequest, id: &'a JobId) -> EngineJob<'a> {
    EngineJob {
        job_id: id,
        request: req,
        metadata: None,
        attempt: 1,
        input: &s.input,
        out_dir: &s.out,
        device: &stemq_core::device::Device::Cpu,
        segment: None,
    }
}

fn read_wav(path: &std::path::Path) -> Vec<f32> {
    let mut d = Decoder::open_path(path, DecodeOptions { target_sample_rate: 8000, max_duration_secs: None }).unwrap();
    let mut all = StereoChunk::with_capacity(0);
    while let Some(c) = d.next_chunk().unwrap() {
        all.extend_from(&c);
    }
    let mut v = all.left;
    v.extend(all.right);
    v
}

#[test]
fn separates_a_file_into_stems() {
    let s = setup();
    let id = JobId::parse(&"ab".repeat(32)).unwrap();
    let req = request(Model::Htdemucs, None);
    let ctx = Ctx::new(None);
    assert_eq!(s.engine.devices().last(), Some(&stemq_core::device::Device::Cpu));
    let files = s.engine.separate(&job(&s, &req, &id), &ctx).unwrap();
    let names: Vec<_> = files.iter().map(|f| f.stem.as_str()).collect();
    assert_eq!(names, ["drums", "bass", "other", "vocals"]);
    let progress = ctx.progress.lock().unwrap().clone();
    assert!(progress.len() >= 2, "progress per chunk: {progress:?}");
    assert_eq!(progress.last().copied(), Some(1.0));
    // Stems match the PyTorch reference up to 16-bit quantisation.
    let f = load("apply.safetensors");
    let reference = &f["out.split"];
    let n = reference.shape[1] * reference.shape[2];
    for (i, file) in files.iter().enumerate() {
        assert_eq!(file.audio.unwrap().frames as usize, reference.shape[2]);
        let got = read_wav(&file.path);
        let (snr, _) = figures(&reference.data[i * n..(i + 1) * n], &got);
        assert!(snr > 60.0, "{}: {snr:.1} dB", file.stem);
    }
}

/// A context whose progress callback panics with `message`: a panic raised inside the
/// run, between chunks, as a backend's would be.
struct Panics(&'static str);

impl EngineContext for Panics {
    fn progress(&self, _: f32, _: &str) {
        panic!("{}", self.0);
    }
    fn cancelled(&self) -> bool {
        false
    }
}

/// Issue 14: a device allocation failure inside the run reaches the worker as
/// `EngineError::OutOfMemory`, the step its ladder takes down (a smaller segment, then
/// the CPU); injected as panics with the texts CubeCL 0.10 and the CUDA driver print.
/// Any other panic is a transient failure. Either way no partial stem is left, and the
/// engine runs the next job.
#[test]
fn an_allocation_failure_inside_the_run_is_an_out_of_memory_step() {
    let s = setup();
    let id = JobId::parse(&"ef".repeat(32)).unwrap();
    let req = request(Model::Htdemucs, None);
    for message in [
        // cubecl_runtime::server::IoError::BufferTooBig, Display and Debug.
        "can't allocate buffer of size: 1073741824\n",
        "called `Result::unwrap()` on an `Err` value: BufferTooBig { size: 1073741824 }",
        // cubecl_runtime::server::LaunchError::OutOfMemory.
        "An out-of-memory error happened during launch\nCaused by:\n  cuMemAlloc\nBacktrace\n",
        // The driver's own error.
        "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")",
    ] {
        let err = s.engine.separate(&job(&s, &req, &id), &Panics(message)).unwrap_err();
        assert_eq!(err, EngineError::OutOfMemory { device: "cpu".into() }, "{message}");
        assert!(stemq_demucs::engine::is_out_of_memory(message));
    }
    let err = s.engine.separate(&job(&s, &req, &id), &Panics("index out of bounds")).unwrap_err();
    assert!(
        matches!(&err, EngineError::Transient { what, .. } if what.contains("panicked: index out of bounds")),
        "{err:?}"
    );
    let left: Vec<_> = std::fs::read_dir(&s.out).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "partial stems left: {left:?}");
    let files = s.engine.separate(&job(&s, &req, &id), &Ctx::new(None)).unwrap();
    assert_eq!(files.len(), 4, "the engine still runs");
}

#[test]
fn two_stems_and_cancellation_and_missing_model() {
    let s = setup();
    let id = JobId::parse(&"cd".repeat(32)).unwrap();
    let req = request(Model::Htdemucs, Some("vocals"));
    let files = s.engine.separate(&job(&s, &req, &id), &Ctx::new(None)).unwrap();
    let names: Vec<_> = files.iter().map(|f| f.stem.as_str()).collect();
    assert_eq!(names, req.stems());

    let err = s.engine.separate(&job(&s, &req, &id), &Ctx::new(Some(1))).unwrap_err();
    assert_eq!(err, EngineError::Cancelled);
    assert!(files.iter().all(|f| !f.path.exists()), "partial stems are removed");

    let ft = request(Model::HtdemucsFt, None);
    let err = s.engine.separate(&job(&s, &ft, &id), &Ctx::new(None)).unwrap_err();
    assert!(matches!(err, EngineError::Unsupported { ref code, .. } if code == "model_unavailable"), "{err:?}");
}

#[test]
fn other_method_add_minus_none_match_demucs() {
    let s = setup();
    let f = load("apply.safetensors");
    let len = f["track"].shape[1];
    for (method, reference) in [
        (OtherMethod::Add, Some("two_stems.no_vocals_add")),
        (OtherMethod::Minus, Some("two_stems.no_vocals_minus")),
        (OtherMethod::None, None),
    ] {
        let mut req = request(Model::Htdemucs, Some("vocals"));
        req.other_method = Some(method);
        // Float samples, no clip handling: the mixture minus the stem exceeds [-1, 1].
        req.encoding = Encoding::F32;
        req.clip_mode = stemq_core::request::ClipMode::None;
        let id = JobId::parse(&"ef".repeat(32)).unwrap();
        let files = s.engine.separate(&job(&s, &req, &id), &Ctx::new(None)).unwrap();
        let names: Vec<_> = files.iter().map(|f| f.stem.as_str()).collect();
        assert_eq!(names, req.stems(), "{method:?}");
        match reference {
            Some(key) => {
                let got = read_wav(&files[1].path);
                assert_eq!(got.len(), 2 * len);
                let (snr, _) = figures(&f[key].data, &got);
                assert!(snr > 60.0, "{method:?}: no_vocals at {snr:.1} dB from demucs's");
            }
            None => assert_eq!(names, ["vocals"]),
        }
        for file in files {
            std::fs::remove_file(file.path).unwrap();
        }
    }
}

/// The memory guard: one forward pass of the fixture model (8 kHz) at its trained 1.5 s
/// segment, and shortened to 1 s.
fn pass_bytes(seconds: f64) -> u64 {
    let s = setup();
    let bag = s.engine.cpu_model("htdemucs").unwrap();
    forward_peak_bytes(bag.models()[0].config(), (seconds * 8000.0) as usize, 1)
}

#[test]
fn a_memory_budget_refuses_the_default_segment_and_admits_a_smaller_one() {
    let (full, short) = (pass_bytes(1.5), pass_bytes(1.0));
    assert!(short < full && short > full / 2, "1 s needs less than 1.5 s, not absurdly less: {short} vs {full}");
    let id = JobId::parse(&"ef".repeat(32)).unwrap();
    let req = request(Model::Htdemucs, None);
    let frames = load("apply.safetensors")["out.split"].shape[2] as u64;

    // Room for one pass but not two: fewer passes at once, same segment, same result.
    let one = setup_with_budget(Some(full));
    let j = job(&one, &req, &id);
    let bag = one.engine.cpu_model("htdemucs").unwrap();
    assert_eq!(
        one.engine.plan(&bag, &j, "cpu", 2).unwrap(),
        MemoryPlan { parallel: 1, training_segment: None, estimate: full }
    );
    let files = one.engine.separate(&j, &Ctx::new(None)).unwrap();
    assert_eq!(files.len(), 4);
    assert!(files.iter().all(|f| f.audio.unwrap().frames == frames));

    // Between the two: the trained segment is refused, the ladder's 1 s runs shortened.
    let budget = (short + full) / 2;
    let s = setup_with_budget(Some(budget));
    let err = s.engine.separate(&job(&s, &req, &id), &Ctx::new(None)).unwrap_err();
    assert_eq!(err, EngineError::OverBudget { device: "cpu".into(), needed: full, budget });
    assert!(std::fs::read_dir(&s.out).unwrap().next().is_none(), "refused before writing anything");
    let smaller = EngineJob { segment: Some(1.0), ..job(&s, &req, &id) };
    assert_eq!(
        s.engine.plan(&bag, &smaller, "cpu", 2).unwrap(),
        MemoryPlan { parallel: 1, training_segment: Some(1.0), estimate: short }
    );
    let files = s.engine.separate(&smaller, &Ctx::new(None)).unwrap();
    let names: Vec<_> = files.iter().map(|f| f.stem.as_str()).collect();
    assert_eq!(names, ["drums", "bass", "other", "vocals"]);
    for f in &files {
        assert_eq!(f.audio.unwrap().frames, frames);
        assert_eq!(read_wav(&f.path).len() as u64, 2 * frames, "{}", f.stem);
    }

    // Below even the smaller segment: refused at every rung, with what it would need.
    let tiny = setup_with_budget(Some(short / 2));
    let err = tiny.engine.separate(&EngineJob { segment: Some(1.0), ..job(&tiny, &req, &id) }, &Ctx::new(None));
    assert_eq!(err.unwrap_err(), EngineError::OverBudget { device: "cpu".into(), needed: short, budget: short / 2 });
}

/// Issue 14: the engine serves the older official names from its folder like the
/// HTDemucs ones: a folder whose `mdx.yaml` names a bag of waveform Demucs and Hybrid
/// Demucs checkpoints (the reduced fixtures), and whose `mdx_q.yaml` names a DiffQ one,
/// offers `mdx` and `mdx_q`; a job of `mdx` writes the bag's stems (float WAV, compared
/// with demucs's own output on the same track).
#[test]
fn older_families_are_served_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("models");
    std::fs::create_dir(&repo).unwrap();
    for (from, file) in [("v2", "e5e5e5e5.th"), ("v3", "c3c3c3c3.th"), ("v2", "f6f6f6f6.th"), ("diffq", "f6f6f6f6q.th")]
    {
        let src =
            fixtures().join(if from == "diffq" { format!("diffq/{file}") } else { format!("{from}/repo/{file}") });
        let dst = if from == "diffq" { "a1b2c3d4.th".to_string() } else { file.to_string() };
        std::fs::copy(src, repo.join(dst)).unwrap();
    }
    std::fs::write(
        repo.join("mdx.yaml"),
        "models: ['e5e5e5e5', 'c3c3c3c3', 'f6f6f6f6']\nweights: [[1., 1., 0., 0.], [0., 1., 1., 1.], [1., 0., 1., 1.]]\nsegment: 1.5\n",
    )
    .unwrap();
    std::fs::write(repo.join("mdx_q.yaml"), "models: ['a1b2c3d4']\n").unwrap();
    let f = common::load_path(&fixtures().join("v2/apply.safetensors"));
    let input = write_track(dir.path(), &f["track"]);
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let engine = engine_at(repo, None);
    assert_eq!(engine.models(), vec![Model::Mdx, Model::MdxQ]);
    let id = JobId::parse(&"9a".repeat(32)).unwrap();
    let mut req = request(Model::Mdx, None);
    req.encoding = Encoding::F32;
    let job = EngineJob {
        job_id: &id,
        request: &req,
        metadata: None,
        attempt: 1,
        input: &input,
        out_dir: &out,
        device: &stemq_core::device::Device::Cpu,
        segment: None,
    };
    let files = engine.separate(&job, &Ctx::new(None)).unwrap();
    let reference = &f["out.mixed"];
    let n = reference.shape[1] * reference.shape[2];
    for (i, file) in files.iter().enumerate() {
        let (snr, _) = figures(&reference.data[i * n..(i + 1) * n], &read_wav(&file.path));
        assert!(snr > 100.0, "{}: {snr:.1} dB", file.stem);
    }
    let q = request(Model::MdxQ, None);
    let job = EngineJob { request: &q, ..job };
    assert_eq!(engine.separate(&job, &Ctx::new(None)).unwrap().len(), 4, "the DiffQ model runs");
}

/// Issue 14: with cross-job batching, the chunks of two jobs running at the same time
/// share forward passes, and each job's stems are bit for bit those it gets alone.
#[test]
fn jobs_that_share_forward_passes_get_the_stems_they_get_alone() {
    use stemq_demucs::batch::CrossJobBatching;
    let s = setup();
    let dir = s._dir.path();
    // A second, different input: the fixture track reversed and scaled.
    let track = &load("apply.safetensors")["track"];
    let mut other = track.clone();
    other.data.reverse();
    other.data.iter_mut().for_each(|v| *v *= 0.7);
    let other_dir = dir.join("other");
    std::fs::create_dir(&other_dir).unwrap();
    let inputs = [s.input.clone(), write_track(&other_dir, &other)];
    let ids = [JobId::parse(&"a1".repeat(32)).unwrap(), JobId::parse(&"b2".repeat(32)).unwrap()];
    let mut req = request(Model::Htdemucs, None);
    req.encoding = Encoding::F32;
    // One random shift each (seeded by the job id): the jobs' chunks sit at other offsets.
    req.shifts = 1;
    let run = |engine: &DemucsEngine, i: usize, out: &std::path::Path| {
        std::fs::create_dir_all(out).unwrap();
        let job = EngineJob {
            job_id: &ids[i],
            request: &req,
            metadata: None,
            attempt: 1,
            input: &inputs[i],
            out_dir: out,
            device: &stemq_core::device::Device::Cpu,
            segment: None,
        };
        let files = engine.separate(&job, &Ctx::new(None)).unwrap();
        files.iter().map(|f| std::fs::read(&f.path).unwrap()).collect::<Vec<_>>()
    };
    let alone: Vec<_> = (0..2).map(|i| run(&s.engine, i, &dir.join(format!("alone{i}")))).collect();

    let batching = DemucsEngine::new(DemucsEngineConfig {
        repo: dir.join("models"),
        clip: ClipMode::None,
        max_duration_secs: None,
        gpu_batch: 4,
        cpu_jobs: 2,
        memory_budget: None,
        cross_job: Some(CrossJobBatching { max_rows: 4, linger: std::time::Duration::from_secs(2) }),
        gpu_weights: Default::default(),
        device: None,
        device_max_alloc: None,
    })
    .unwrap();
    let barrier = std::sync::Barrier::new(2);
    let together: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|i| {
                let (batching, barrier, run) = (&batching, &barrier, &run);
                scope.spawn(move || {
                    barrier.wait();
                    run(batching, i, &dir.join(format!("together{i}")))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let stats = batching.cpu_model("htdemucs").unwrap().hub().unwrap().stats();
    assert!(stats.shared > 0, "no forward pass was shared: {stats:?}");
    assert!(stats.rows > stats.forwards, "{stats:?}");
    for i in 0..2 {
        assert_eq!(alone[i].len(), 4);
        for (stem, (a, t)) in alone[i].iter().zip(&together[i]).enumerate() {
            assert!(a == t, "job {i}, stem {stem}: the shared passes changed the stem");
        }
    }
    assert!(alone[0] != alone[1], "the two jobs separate different inputs");
    eprintln!("cross-job batching: {stats:?}");
}

/// A forward shared across jobs holds all their segments at once: the memory budget
/// caps how many it takes.
#[test]
fn the_memory_budget_caps_the_segments_of_a_shared_forward() {
    use stemq_demucs::batch::CrossJobBatching;
    let full = pass_bytes(1.5);
    let s = setup();
    let engine = DemucsEngine::new(DemucsEngineConfig {
        repo: s._dir.path().join("models"),
        clip: ClipMode::None,
        max_duration_secs: None,
        gpu_batch: 4,
        cpu_jobs: 1,
        memory_budget: Some(3 * full + full / 2),
        cross_job: Some(CrossJobBatching { max_rows: 8, linger: std::time::Duration::from_millis(20) }),
        gpu_weights: Default::default(),
        device: None,
        device_max_alloc: None,
    })
    .unwrap();
    let id = JobId::parse(&"c3".repeat(32)).unwrap();
    let req = request(Model::Htdemucs, None);
    let files = engine.separate(&job(&s, &req, &id), &Ctx::new(None)).unwrap();
    assert_eq!(files.len(), 4);
    let bag = engine.cpu_model("htdemucs").unwrap();
    assert_eq!(bag.hub().unwrap().max_rows(), 3, "room for 3 segments of {full} bytes");
}

/// The engine on a Vulkan device (`--features vulkan`; Mesa's lavapipe in CI).
#[cfg(feature = "vulkan")]
mod vulkan {
    use super::*;
    use stemq_core::device::Device;
    use stemq_demucs::nn::WeightPrecision;
    use stemq_demucs::vulkan;

    /// The device `vulkan` names here, a software driver allowed; `None` after a SKIPPED
    /// line (a failure in CI).
    fn adapter() -> Option<&'static vulkan::Adapter> {
        crate::common::vulkan_adapter("the engine on Vulkan")
    }

    fn engine_with(device: Option<Device>, weights: WeightPrecision, budget: Option<u64>) -> Setup {
        let mut s = setup_with_budget(budget);
        s.engine = DemucsEngine::new(DemucsEngineConfig {
            device,
            gpu_weights: weights,
            memory_budget: budget,
            ..engine_config(s.engine.repo().root().to_path_buf())
        })
        .unwrap();
        s
    }

    fn engine_config(repo: std::path::PathBuf) -> DemucsEngineConfig {
        DemucsEngineConfig {
            repo,
            clip: ClipMode::None,
            max_duration_secs: None,
            gpu_batch: 4,
            cpu_jobs: 2,
            memory_budget: None,
            cross_job: None,
            gpu_weights: Default::default(),
            device: None,
            device_max_alloc: None,
        }
    }

    /// Devices are named as the driver lists them: `vulkan` resolves to one
    /// `vulkan:<n>`, offered first with the CPU last; a software driver (lavapipe) only
    /// when asked for; a device that is not here is refused with the list of those
    /// that are.
    #[test]
    fn vulkan_devices_are_named_and_offered_as_asked() {
        let Some(a) = adapter() else { return };
        let named = Device::Vulkan(Some(a.index));
        let s = engine_with(Some(Device::Vulkan(None)), WeightPrecision::Full, None);
        assert_eq!(s.engine.devices(), vec![named.clone(), Device::Cpu]);
        let s = engine_with(Some(named.clone()), WeightPrecision::Full, None);
        assert_eq!(s.engine.devices(), vec![named.clone(), Device::Cpu]);
        let s = engine_with(Some(Device::Cpu), WeightPrecision::Full, None);
        assert_eq!(s.engine.devices(), vec![Device::Cpu]);
        if a.kind == vulkan::Kind::Cpu {
            let s = engine_with(None, WeightPrecision::Full, None);
            assert_eq!(s.engine.devices(), vec![Device::Cpu], "lavapipe is never the default");
        }
        let missing = Device::Vulkan(Some(99));
        let s = engine_with(Some(missing.clone()), WeightPrecision::Full, None);
        assert_eq!(s.engine.devices(), vec![Device::Cpu]);
        let (id, req) = (JobId::parse(&"cd".repeat(32)).unwrap(), request(Model::Htdemucs, None));
        let err =
            s.engine.separate(&EngineJob { device: &missing, ..job(&s, &req, &id) }, &Ctx::new(None)).unwrap_err();
        let EngineError::Unsupported { code, message } = err else { panic!("{err:?}") };
        assert_eq!(code, stemq_core::failure::FailureCode::DeviceUnavailable);
        assert!(message.contains(&format!("vulkan:{}", a.index)), "{message}");
    }

    /// The engine on the device: stems within 80 dB of the CPU's for the same job, the
    /// memory budget read from the device (80 % of its device-local heap), and `f16`
    /// weights where the device takes them giving the same stems bit for bit.
    #[test]
    fn the_engine_separates_on_the_device_within_the_budget_the_device_gives() {
        let Some(a) = adapter() else { return };
        let device = Device::Vulkan(Some(a.index));
        let (id, req) = (JobId::parse(&"ef".repeat(32)).unwrap(), request(Model::Htdemucs, None));
        let cpu = setup();
        let want: Vec<Vec<f32>> = cpu
            .engine
            .separate(&job(&cpu, &req, &id), &Ctx::new(None))
            .unwrap()
            .iter()
            .map(|f| read_wav(&f.path))
            .collect();
        let mut stems = Vec::new();
        for weights in [WeightPrecision::Full, WeightPrecision::Half] {
            let s = engine_with(Some(device.clone()), weights, None);
            let files =
                s.engine.separate(&EngineJob { device: &device, ..job(&s, &req, &id) }, &Ctx::new(None)).unwrap();
            let got: Vec<Vec<f32>> = files.iter().map(|f| read_wav(&f.path)).collect();
            for ((file, got), want) in files.iter().zip(&got).zip(&want) {
                let (snr, max) = figures(want, got);
                eprintln!(
                    "PARITY vulkan engine {} ({} weights) against the CPU: SNR {snr:.1} dB, max abs {max:.2e}",
                    file.stem,
                    weights.as_str()
                );
                assert!(snr >= 80.0, "{}: {snr:.1} dB", file.stem);
            }
            let (_, opened) = s.engine.vulkan_model(Some(a.index), "htdemucs").unwrap();
            let heap = opened.device_memory.expect("the driver reports its device-local memory");
            assert!(heap > 0);
            assert_eq!(s.engine.vulkan_budget(&opened), Some(heap / 10 * 8));
            eprintln!("vulkan:{} ({}): device-local memory {heap} bytes, f16 {}", a.index, a.name, opened.f16);
            stems.push(got);
        }
        assert!(stems[0] == stems[1], "f16 weights (or their f32 fallback) changed the stems");
        // A configured budget wins over the device's, and is planned against.
        let s = engine_with(Some(device.clone()), WeightPrecision::Full, Some(1));
        let err = s.engine.separate(&EngineJob { device: &device, ..job(&s, &req, &id) }, &Ctx::new(None)).unwrap_err();
        assert!(
            matches!(&err, EngineError::OverBudget { device: d, budget: 1, .. } if *d == device.to_string()),
            "{err:?}"
        );
    }
}
