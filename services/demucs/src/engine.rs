//! The stemq [`Engine`] backed by HTDemucs: reads the input twice with `stemq-audio`'s
//! decoder (resampled to the model's rate, stereo): once for the whole-track
//! statistics, once streamed through [`separate_stream`] (segments with overlap, shifts
//! seeded from the job id) straight into one `StemEncoder` per stem, so memory does not
//! grow with the track. Progress is reported and cancellation honoured per chunk;
//! partial files are removed on failure. Two-stem requests get `STEM` and its
//! complement, made and named as demucs's `--other-method` says: the sum of the other
//! stems (`add`: `no_STEM`), the mixture minus the stem (`minus`: `minus_STEM`, reading
//! the input a third time), or not at all.
//!
//! Models come from a local folder ([`ModelRepo`]) and stay resident once loaded.
//!
//! With a memory budget ([`DemucsEngineConfig::memory_budget`]) each attempt is planned
//! before it runs, from [`crate::memory::forward_peak_bytes`]: fewer concurrent passes
//! (or a smaller batch) when all of them would not fit; then, when the worker's
//! out-of-memory ladder asks for a segment shorter than the model's, forward passes on
//! that segment instead of padding it to the trained length (demucs's
//! `BagOfModels(segment=…)`); and [`EngineError::OverBudget`] when even that does not
//! fit, so the worker steps down the ladder, or fails the job for good at its last rung.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use stemq_audio::{ClipMode, DecodeOptions, Decoder, StemEncoder, StereoChunk};
use stemq_core::device::Device;
use stemq_core::engine::{Engine, EngineContext, EngineError, EngineJob, StemAudio, StemFile};
use stemq_core::failure::FailureCode;
use stemq_core::request::{Model, OtherMethod};

use crate::apply::{ApplyOptions, BagOfModels, Progress};
use crate::batch::CrossJobBatching;
use crate::checkpoint::HostTensor;
use crate::error::DemucsError;
use crate::memory::forward_peak_bytes;
use crate::nn::WeightPrecision;
use crate::repo::ModelRepo;
use crate::stream::{separate_stream, StatsAccumulator};
use crate::CpuBackend;

/// Settings of a [`DemucsEngine`].
#[derive(Debug, Clone)]
pub struct DemucsEngineConfig {
    /// The model folder (demucs `--repo` layout).
    pub repo: PathBuf,
    /// Clip mode used where a request does not say (requests always do today).
    pub clip: ClipMode,
    /// Refuse inputs longer than this (seconds).
    pub max_duration_secs: Option<f64>,
    /// Segments per forward pass on CUDA (the CPU always runs one at a time).
    pub gpu_batch: usize,
    /// Forward passes run concurrently (threads); the number of cores is a good value
    /// on the CPU.
    pub cpu_jobs: usize,
    /// Bytes the forward passes of one attempt may use on top of the loaded model
    /// (estimated before running, see [`crate::memory`]); `None` for no limit. Over it,
    /// the engine first runs fewer passes at once, then shortens the forward pass to a
    /// smaller requested segment, then refuses with [`EngineError::OverBudget`].
    pub memory_budget: Option<u64>,
    /// Jobs running at the same time in this engine share forward passes of the same
    /// model ([`crate::batch`]); `None`: every job runs its own.
    pub cross_job: Option<CrossJobBatching>,
    /// The type the weights stay in on a GPU ([`WeightPrecision::Half`]: half the device
    /// memory, lossless for checkpoints stored in f16); the CPU keeps `f32`, and so does
    /// a Vulkan device without `f16` support (with a warning).
    pub gpu_weights: WeightPrecision,
    /// The device offered first ([`Engine::devices`]): `stemq worker --device`, `stemq
    /// separate -d`. `None`: CUDA when present, else a Vulkan GPU (never a software
    /// driver such as lavapipe unless named), else the CPU. The CPU is always offered
    /// last, the out-of-memory ladder's last rung.
    pub device: Option<Device>,
    /// No single allocation above this many bytes in a Vulkan device's memory pool
    /// ([`crate::vulkan::PoolLimit`]): a device that runs out of memory at a chosen size,
    /// to exercise the out-of-memory ladder. `None`: the driver's limits.
    pub device_max_alloc: Option<u64>,
}

/// How one attempt runs within the memory budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryPlan {
    /// Passes at once: concurrent threads on the CPU, the batch on CUDA.
    pub parallel: usize,
    /// Forward passes shortened to this segment (seconds), below the trained one.
    pub training_segment: Option<f64>,
    /// Estimated peak bytes of the plan.
    pub estimate: u64,
}

/// What a caller may choose besides the request: the demucs command line's `-n` (any
/// model of the folder, not only the names the service routes), `--no-split` and `-j`.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// The model (a bag `NAME.yaml` or a signature) in the folder; default: the
    /// request's model.
    pub model: Option<String>,
    /// One forward pass over the whole track instead of overlapping segments (demucs
    /// `--no-split`: memory grows with the track; HTDemucs refuses tracks longer than
    /// its trained segment, as demucs does).
    pub no_split: bool,
    /// Forward passes run at once on the CPU (demucs `-j`); default: the engine's.
    pub jobs: Option<usize>,
}

/// How one attempt's forward passes run.
#[derive(Debug, Clone)]
struct Passes {
    /// Segments per forward pass (CUDA).
    batch_size: usize,
    /// Forward passes at once (CPU threads).
    jobs: usize,
    /// Forward passes shortened to this segment ([`MemoryPlan::training_segment`]).
    training_segment: Option<f64>,
    /// One pass over the whole track ([`RunOptions::no_split`]).
    no_split: bool,
    /// On a CubeCL device: its thread's faults since the run began, checked after
    /// every block (a fault voids what the device returned).
    faults: Option<crate::device_fault::Watch>,
}

/// HTDemucs as a stemq engine.
pub struct DemucsEngine {
    repo: ModelRepo,
    config: DemucsEngineConfig,
    cpu: ModelCache<BagOfModels<CpuBackend>>,
    #[cfg(feature = "cuda")]
    cuda: ModelCache<BagOfModels<crate::CudaBackend>>,
    /// The CUDA budget read from free device memory, once.
    #[cfg(feature = "cuda")]
    cuda_budget: std::sync::OnceLock<Option<u64>>,
    /// Models on Vulkan devices, by `<index>/<name>`.
    #[cfg(feature = "vulkan")]
    vulkan: ModelCache<BagOfModels<crate::VulkanBackend>>,
}

/// Loaded models by name. The map's lock is held only to find a model's slot; a slot's
/// own lock is held while that model loads (so two jobs never load the same model
/// twice) and tolerates poisoning: a load that panicked leaves the slot empty, and the
/// next job simply loads again instead of failing on a poisoned lock until restart.
struct ModelCache<T> {
    slots: Mutex<HashMap<String, Slot<T>>>,
}

/// One model's place in the cache: empty until loaded.
type Slot<T> = Arc<Mutex<Option<Arc<T>>>>;

impl<T> Default for ModelCache<T> {
    fn default() -> Self {
        ModelCache { slots: Mutex::new(HashMap::new()) }
    }
}

impl<T> ModelCache<T> {
    fn get_or_load<E>(&self, name: &str, load: impl FnOnce() -> Result<T, E>) -> Result<Arc<T>, E> {
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            slots.entry(name.to_string()).or_default().clone()
        };
        let mut slot = slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(m) = slot.as_ref() {
            return Ok(m.clone());
        }
        let m = Arc::new(load()?);
        *slot = Some(m.clone());
        Ok(m)
    }
}

impl std::fmt::Debug for DemucsEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DemucsEngine").field("repo", &self.repo.root()).finish()
    }
}

/// Maps crate errors onto the worker's failure kinds.
pub fn engine_error(e: DemucsError) -> EngineError {
    match e {
        DemucsError::Cancelled => EngineError::Cancelled,
        DemucsError::Audio(a) => stemq_audio::engine::engine_error(a),
        DemucsError::InvalidArgument(m) => EngineError::Unsupported { code: FailureCode::InvalidArgument, message: m },
        DemucsError::DeviceUnavailable(m) => {
            EngineError::Unsupported { code: FailureCode::DeviceUnavailable, message: m }
        }
        DemucsError::DeviceOutOfMemory { device, .. } => EngineError::OutOfMemory { device },
        e @ DemucsError::DeviceFault { .. } => EngineError::transient("device fault", e),
        e @ DemucsError::Io { .. } => EngineError::transient("I/O error", e),
        e @ DemucsError::SharedPass(_) => EngineError::transient_without_source(e.to_string()),
        other => EngineError::Unsupported { code: FailureCode::ModelUnavailable, message: other.to_string() },
    }
}

struct Ctx<'a>(&'a dyn EngineContext);

impl Progress for Ctx<'_> {
    fn chunk_done(&mut self, fraction: f32) {
        self.0.progress(fraction, "separate");
    }
    fn cancelled(&self) -> bool {
        self.0.cancelled()
    }
}

/// The Vulkan device `vulkan` (`index` `None`) or `vulkan:<index>` names, by its index,
/// when this build has Vulkan and the machine has that device.
#[allow(unused_variables)]
fn vulkan_device(index: Option<u32>, software: bool) -> Option<Device> {
    #[cfg(feature = "vulkan")]
    return crate::vulkan::resolve(index, software).map(crate::vulkan::Adapter::device);
    #[cfg(not(feature = "vulkan"))]
    None
}

fn cuda_present() -> bool {
    cfg!(feature = "cuda") && std::path::Path::new("/proc/driver/nvidia/version").exists()
}

impl DemucsEngine {
    /// Opens the model folder; models load on first use. A process that will run the
    /// model on the CPU also wants [`crate::cpu::tune_allocator`] (not done here: it
    /// changes the whole process's allocator).
    pub fn new(config: DemucsEngineConfig) -> Result<Self, DemucsError> {
        Ok(DemucsEngine {
            repo: ModelRepo::open(&config.repo)?,
            config,
            cpu: ModelCache::default(),
            #[cfg(feature = "cuda")]
            cuda: ModelCache::default(),
            #[cfg(feature = "cuda")]
            cuda_budget: std::sync::OnceLock::new(),
            #[cfg(feature = "vulkan")]
            vulkan: ModelCache::default(),
        })
    }

    /// Loads (once) and returns the CPU copy of a model.
    pub fn cpu_model(&self, name: &str) -> Result<Arc<BagOfModels<CpuBackend>>, DemucsError> {
        self.cpu.get_or_load(name, || self.load::<CpuBackend>(name, WeightPrecision::Full, &Default::default()))
    }

    /// Loads a model onto a backend's device, with cross-job batching when configured.
    fn load<B: burn::tensor::backend::Backend>(
        &self,
        name: &str,
        precision: WeightPrecision,
        device: &B::Device,
    ) -> Result<BagOfModels<B>, DemucsError> {
        let mut bag = self.repo.load_with::<B>(name, device, precision)?;
        if let Some(c) = self.config.cross_job {
            bag.batch_across_jobs(c);
        }
        Ok(bag)
    }

    fn open_input(&self, job: &EngineJob<'_>, samplerate: u32) -> Result<Decoder, DemucsError> {
        Ok(Decoder::open_path(
            job.input,
            DecodeOptions { target_sample_rate: samplerate, max_duration_secs: self.config.max_duration_secs },
        )?)
    }

    /// Fits an attempt into the memory budget: `parallel` passes of one segment at the
    /// models' trained length if they fit, else as many as fit (at least one), else one
    /// pass shortened to the job's segment when that is shorter than the trained one;
    /// [`EngineError::OverBudget`] when nothing fits. Without a budget: as asked.
    pub fn plan<B: burn::tensor::backend::Backend>(
        &self,
        bag: &BagOfModels<B>,
        job: &EngineJob<'_>,
        device: &str,
        parallel: usize,
    ) -> Result<MemoryPlan, EngineError> {
        self.plan_within(bag, job, device, parallel, self.config.memory_budget)
    }

    /// [`DemucsEngine::plan`] within `budget` (bytes; `None`: no limit).
    pub fn plan_within<B: burn::tensor::backend::Backend>(
        &self,
        bag: &BagOfModels<B>,
        job: &EngineJob<'_>,
        device: &str,
        parallel: usize,
        budget: Option<u64>,
    ) -> Result<MemoryPlan, EngineError> {
        let sr = bag.samplerate() as f64;
        // One pass of the hungriest model of the bag at the given training segments.
        let per_pass = |training_segment: Option<f64>| {
            let opts = ApplyOptions { training_segment, ..ApplyOptions::default() };
            bag.models()
                .iter()
                .zip(bag.training_segments(&opts))
                .map(|(m, seg)| forward_peak_bytes(m.config(), (seg * sr) as usize, 1))
                .max()
                .unwrap_or(0)
        };
        let full = per_pass(None);
        // A forward shared by several jobs holds all their segments at once: no more of
        // them than the budget fits.
        if let (Some(hub), Some(budget)) = (bag.hub(), budget) {
            hub.limit_rows((budget / full.max(1)) as usize);
        }
        let Some(budget) = budget else {
            return Ok(MemoryPlan { parallel, training_segment: None, estimate: full * parallel as u64 });
        };
        let fitting = (budget / full.max(1)).min(parallel as u64) as usize;
        if fitting >= 1 {
            return Ok(MemoryPlan { parallel: fitting, training_segment: None, estimate: full * fitting as u64 });
        }
        let mut needed = full;
        if let Some(s) = segment_for(bag, job) {
            if s < bag.max_allowed_segment() {
                let short = per_pass(Some(s));
                if short <= budget {
                    return Ok(MemoryPlan { parallel: 1, training_segment: Some(s), estimate: short });
                }
                needed = short;
            }
        }
        Err(EngineError::OverBudget { device: device.to_string(), needed, budget })
    }

    /// Two passes over the decoder: the whole-track statistics, then the streamed
    /// separation straight into the stem encoders (memory does not grow with the track).
    fn run<B: burn::tensor::backend::Backend>(
        &self,
        bag: &BagOfModels<B>,
        job: &EngineJob<'_>,
        ctx: &dyn EngineContext,
        passes: Passes,
    ) -> Result<Vec<StemFile>, DemucsError> {
        let Passes { batch_size, jobs, training_segment, no_split, faults } = passes;
        let check_device = || faults.as_ref().map_or(Ok(()), crate::device_fault::Watch::check);
        let req = job.request;
        if bag.audio_channels() != 2 {
            return Err(DemucsError::Unsupported("models with other than 2 audio channels".into()));
        }
        let sr = bag.samplerate();
        let mut stats = StatsAccumulator::default();
        let mut dec = self.open_input(job, sr)?;
        while let Some(chunk) = dec.next_chunk()? {
            stats.push(&[&chunk.left, &chunk.right]);
        }
        let stats = stats.finish();
        if stats.length == 0 {
            return Err(DemucsError::Audio(stemq_audio::AudioError::Empty));
        }
        let seed = u64::from_str_radix(&job.job_id.as_str().chars().take(16).collect::<String>(), 16).unwrap_or(0);
        let opts = ApplyOptions {
            shifts: req.shifts as usize,
            split: !no_split,
            overlap: req.overlap,
            transition_power: 1.0,
            segment: segment_for(bag, job),
            seed,
            shift_offsets: None,
            batch_size,
            jobs: jobs.max(1),
            training_segment,
        };
        let sources = bag.sources().to_vec();
        let selected = match &req.two_stems {
            Some(stem) => Some(
                sources
                    .iter()
                    .position(|s| s == stem)
                    .ok_or_else(|| DemucsError::InvalidArgument(format!("stem `{stem}` is not one of {sources:?}")))?,
            ),
            None => None,
        };
        let method = req.other_method.unwrap_or_default();
        // With two_stems, the request says which files (`NormalizedRequest::stems`).
        let names: Vec<String> = if selected.is_some() { req.stems() } else { sources.clone() };
        let (format, clip) = stemq_audio::engine::output_settings(req);
        let ext = req.output_format.extension();
        let paths: Vec<PathBuf> = names.iter().map(|n| job.out_dir.join(format!("{n}.{ext}"))).collect();
        // Partial stems go, whether the run fails or panics (a device out of memory).
        let partial = Partial(&paths);
        let result = (|| {
            let mut encoders =
                paths.iter().map(|p| StemEncoder::create(p, format, clip, sr)).collect::<Result<Vec<_>, _>>()?;
            // `minus` reads the mixture a third time, in step with the finished blocks.
            let mut mixture = match (selected, method) {
                (Some(_), OtherMethod::Minus) => Some(MixtureReader::new(self.open_input(job, sr)?)),
                _ => None,
            };
            let mut dec = self.open_input(job, sr)?;
            let mut next = || -> Result<Option<Vec<Vec<f32>>>, DemucsError> {
                Ok(dec.next_chunk()?.map(|c| vec![c.left, c.right]))
            };
            let mut sink = |block: HostTensor| -> Result<(), DemucsError> {
                check_device()?;
                let n = block.shape[2];
                let row = |s: usize, c: usize| &block.data[(s * 2 + c) * n..(s * 2 + c + 1) * n];
                match selected {
                    None => {
                        for (s, enc) in encoders.iter_mut().enumerate() {
                            enc.write(&StereoChunk::from_planar(row(s, 0).to_vec(), row(s, 1).to_vec()))?;
                        }
                    }
                    Some(idx) => {
                        encoders[0].write(&StereoChunk::from_planar(row(idx, 0).to_vec(), row(idx, 1).to_vec()))?;
                        let other = match (method, mixture.as_mut()) {
                            (OtherMethod::None, _) => return Ok(()),
                            // demucs --other-method minus: the mixture minus the stem.
                            (OtherMethod::Minus, Some(mix)) => {
                                let mut m = mix.take(n)?;
                                for (c, o) in m.iter_mut().enumerate() {
                                    o.iter_mut().zip(row(idx, c)).for_each(|(a, v)| *a -= v);
                                }
                                m
                            }
                            // demucs --other-method add: the sum of the other stems.
                            _ => {
                                let mut other = [vec![0f32; n], vec![0f32; n]];
                                for s in (0..sources.len()).filter(|s| *s != idx) {
                                    for (c, o) in other.iter_mut().enumerate() {
                                        o.iter_mut().zip(row(s, c)).for_each(|(a, v)| *a += v);
                                    }
                                }
                                other
                            }
                        };
                        let [l, r] = other;
                        encoders[1].write(&StereoChunk::from_planar(l, r))?;
                    }
                }
                Ok(())
            };
            // From here on the job's passes may share forward passes with other jobs.
            let _slot = bag.join();
            if no_split {
                // The whole track in memory, one pass (the stats are the same).
                let (mut left, mut right) = (Vec::new(), Vec::new());
                while let Some(block) = next()? {
                    left.extend_from_slice(&block[0]);
                    right.extend_from_slice(&block[1]);
                }
                let len = left.len();
                left.extend_from_slice(&right);
                let mix = HostTensor { shape: vec![2, len], data: left };
                sink(crate::apply::separate(bag, &mix, &opts, &mut Ctx(ctx))?)?;
            } else {
                separate_stream(bag, stats, &mut next, &opts, &mut Ctx(ctx), &mut sink)?;
            }
            for enc in encoders {
                enc.finish()?;
            }
            Ok::<(), DemucsError>(())
        })();
        result?;
        check_device()?;
        std::mem::forget(partial);
        if let Some(hub) = bag.hub() {
            let s = hub.stats();
            tracing::info!(job_id = %job.job_id, forwards = s.forwards, shared = s.shared, rows = s.rows,
                "cross-job batching: this model's forward passes so far");
        }
        Ok(names
            .into_iter()
            .zip(paths)
            .map(|(stem, path)| StemFile {
                stem,
                path,
                audio: Some(StemAudio { sample_rate: sr, frames: stats.length as u64 }),
            })
            .collect())
    }

    #[cfg(feature = "cuda")]
    fn run_cuda(
        &self,
        name: &str,
        job: &EngineJob<'_>,
        ctx: &dyn EngineContext,
        options: &RunOptions,
    ) -> Result<Vec<StemFile>, EngineError> {
        let bag = self
            .cuda
            .get_or_load(name, || self.load::<crate::CudaBackend>(name, self.config.gpu_weights, &Default::default()))
            .map_err(engine_error)?;
        let budget = self.cuda_budget();
        let plan = self.plan_within(&bag, job, "cuda", self.config.gpu_batch.max(1), budget)?;
        let passes = Passes {
            batch_size: plan.parallel,
            jobs: 1,
            training_segment: plan.training_segment,
            no_split: options.no_split,
            faults: Some(crate::device_fault::Watch::start("cuda")),
        };
        self.run(&bag, job, ctx, passes).map_err(engine_error)
    }

    /// The budget of CUDA forward passes: the configured one, else 80 % of the device
    /// memory free once the first model is on it (read once: Burn's memory pool keeps
    /// what it allocated, so later readings would count our own passes as used).
    #[cfg(feature = "cuda")]
    fn cuda_budget(&self) -> Option<u64> {
        if self.config.memory_budget.is_some() {
            return self.config.memory_budget;
        }
        *self.cuda_budget.get_or_init(|| {
            let free = match cudarc::driver::CudaContext::new(0).and_then(|c| c.mem_get_info()) {
                Ok((free, _total)) => free as u64,
                Err(e) => {
                    tracing::warn!(error = %e, "reading free CUDA memory failed; no memory budget on CUDA");
                    return None;
                }
            };
            let budget = free / 10 * 8;
            tracing::info!(free, budget, "CUDA memory budget: 80 % of the free device memory");
            Some(budget)
        })
    }
}

#[cfg(feature = "vulkan")]
impl DemucsEngine {
    /// The budget of forward passes on an opened Vulkan device: the configured one,
    /// else 80 % of its device-local memory (Vulkan has no portable reading of free
    /// memory; the weights are small beside it), or none when the driver does not say.
    pub fn vulkan_budget(&self, opened: &crate::vulkan::Opened) -> Option<u64> {
        self.config.memory_budget.or(opened.device_memory.map(|bytes| bytes / 10 * 8))
    }

    /// Loads (once) and returns the copy of a model on `vulkan:<index>` (`None`: the
    /// device `vulkan` names, a software driver included), with the opened device.
    pub fn vulkan_model(
        &self,
        index: Option<u32>,
        name: &str,
    ) -> Result<(Arc<BagOfModels<crate::VulkanBackend>>, Arc<crate::vulkan::Opened>), EngineError> {
        let unavailable = |message: String| EngineError::Unsupported { code: FailureCode::DeviceUnavailable, message };
        let adapter = crate::vulkan::resolve(index, true)
            .ok_or_else(|| unavailable(format!("no such Vulkan device; here: {}", crate::vulkan::describe())))?;
        let limit = self.config.device_max_alloc.map(|max_alloc| crate::vulkan::PoolLimit { max_alloc });
        let opened = crate::vulkan::open(adapter.index, limit).map_err(|e| unavailable(e.to_string()))?;
        let precision = match self.config.gpu_weights {
            WeightPrecision::Half if !opened.f16 => {
                tracing::warn!(device = %adapter.device(), name = %adapter.name,
                    "this Vulkan device has no f16 support: the weights stay f32");
                WeightPrecision::Full
            }
            p => p,
        };
        let key = format!("{}/{name}", adapter.index);
        let bag = self
            .vulkan
            .get_or_load(&key, || self.load::<crate::VulkanBackend>(name, precision, &opened.device))
            .map_err(engine_error)?;
        Ok((bag, opened))
    }

    /// One attempt on `vulkan:<index>` (`None`: the device `vulkan` names, a software
    /// driver included since it was asked for by name): the model loaded there once,
    /// segments batched as on CUDA, within the budget the device's memory gives.
    fn run_vulkan(
        &self,
        index: Option<u32>,
        name: &str,
        job: &EngineJob<'_>,
        ctx: &dyn EngineContext,
        options: &RunOptions,
    ) -> Result<Vec<StemFile>, EngineError> {
        let (bag, opened) = self.vulkan_model(index, name)?;
        let device = opened.adapter.device().to_string();
        let budget = self.vulkan_budget(&opened);
        let plan = self.plan_within(&bag, job, &device, self.config.gpu_batch.max(1), budget)?;
        let passes = Passes {
            batch_size: plan.parallel,
            jobs: 1,
            training_segment: plan.training_segment,
            no_split: options.no_split,
            faults: Some(crate::device_fault::Watch::start(&device)),
        };
        self.run(&bag, job, ctx, passes).map_err(engine_error)
    }
}

/// The segment an attempt runs with: the request's, or the one the worker's
/// out-of-memory ladder chose. The ladder halves the trained segment of the model *name*
/// (7.8 s for HTDemucs); a folder's model trained on less (a bag naming other
/// checkpoints) gets half of its own instead, never a segment it would refuse. A
/// segment the request itself asks for is kept, and refused when too long.
fn segment_for<B: burn::tensor::backend::Backend>(bag: &BagOfModels<B>, job: &EngineJob<'_>) -> Option<f64> {
    let max = bag.max_allowed_segment();
    match job.segment {
        Some(s) if job.segment != job.request.segment && s > max => Some((max / 2.0).max(1.0).min(max)),
        other => other.or(job.request.segment),
    }
}

/// True when a panic's message is a device allocation failure: CubeCL's
/// `IoError::BufferTooBig` ("can't allocate buffer of size"), its launch error
/// `OutOfMemory` ("An out-of-memory error happened during launch"), or the CUDA
/// driver's `CUDA_ERROR_OUT_OF_MEMORY` / "out of memory", in their `Display` or `Debug`
/// spellings.
pub fn is_out_of_memory(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    ["out of memory", "out-of-memory", "outofmemory", "out_of_memory", "can't allocate buffer", "buffertoobig"]
        .iter()
        .any(|needle| m.contains(needle))
}

/// Runs one attempt, turning a panic of the backend into an engine error: an
/// allocation failure on `device` ([`is_out_of_memory`]) into
/// [`EngineError::OutOfMemory`], which the worker's ladder steps down from (a smaller
/// segment, then the CPU); any other panic into a transient failure.
/// A panic on a device after an allocation failed on its thread is that failure's
/// consequence ([`crate::device_fault`]), whatever its own message.
fn guarded<T>(device: &Device, f: impl FnOnce() -> Result<T, EngineError>) -> Result<T, EngineError> {
    let faults = (*device != Device::Cpu).then(|| crate::device_fault::Watch::start(device));
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(panic) => {
            let msg = stemq_core::engine::panic_message(panic.as_ref()).unwrap_or_default();
            let device_oom = faults.is_some_and(|w| matches!(w.check(), Err(DemucsError::DeviceOutOfMemory { .. })));
            if device_oom || is_out_of_memory(&msg) {
                Err(EngineError::OutOfMemory { device: device.to_string() })
            } else {
                Err(EngineError::transient_without_source(format!("the {device} backend panicked: {msg}")))
            }
        }
    }
}

/// Removes its files when dropped (a finished run forgets it): the stems of a run that
/// did not finish.
struct Partial<'a>(&'a [PathBuf]);

impl Drop for Partial<'_> {
    fn drop(&mut self) {
        for p in self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The decoded mixture handed out in runs of exactly `n` frames, however the decoder
/// chunks it (for `--other-method minus`).
struct MixtureReader {
    dec: Decoder,
    buf: [std::collections::VecDeque<f32>; 2],
}

impl MixtureReader {
    fn new(dec: Decoder) -> Self {
        MixtureReader { dec, buf: Default::default() }
    }

    /// The next `n` frames, left and right (zeros past the end, which the separation
    /// never asks for: it emits exactly as many frames as it read).
    fn take(&mut self, n: usize) -> Result<[Vec<f32>; 2], DemucsError> {
        while self.buf[0].len() < n {
            match self.dec.next_chunk()? {
                Some(c) => {
                    self.buf[0].extend(c.left);
                    self.buf[1].extend(c.right);
                }
                None => break,
            }
        }
        Ok(self.buf.each_mut().map(|b| {
            let k = n.min(b.len());
            let mut v: Vec<f32> = b.drain(..k).collect();
            v.resize(n, 0.0);
            v
        }))
    }
}

impl Engine for DemucsEngine {
    fn name(&self) -> &str {
        "demucs"
    }

    fn devices(&self) -> Vec<Device> {
        let mut d = Vec::new();
        match &self.config.device {
            Some(Device::Cpu) => {}
            Some(Device::Cuda(_)) if cuda_present() => d.push(Device::Cuda(None)),
            Some(Device::Vulkan(index)) => d.extend(vulkan_device(*index, true)),
            Some(_) => {}
            None if cuda_present() => d.push(Device::Cuda(None)),
            None => d.extend(vulkan_device(None, false)),
        }
        d.push(Device::Cpu);
        d
    }

    /// Every demucs model whose files are in the model folder.
    fn models(&self) -> Vec<Model> {
        Model::ALL.iter().copied().filter(|m| *m != Model::Dsp && self.repo.has(m.as_str())).collect()
    }

    fn separate(&self, job: &EngineJob<'_>, ctx: &dyn EngineContext) -> Result<Vec<StemFile>, EngineError> {
        if job.request.model == Model::Dsp {
            return Err(EngineError::Unsupported {
                code: FailureCode::ModelUnavailable,
                message: "model `dsp` is not a demucs model".into(),
            });
        }
        self.separate_with(job, ctx, &RunOptions::default())
    }
}

impl DemucsEngine {
    /// [`Engine::separate`] with the command line's choices ([`RunOptions`]).
    pub fn separate_with(
        &self,
        job: &EngineJob<'_>,
        ctx: &dyn EngineContext,
        options: &RunOptions,
    ) -> Result<Vec<StemFile>, EngineError> {
        let name = options.model.as_deref().unwrap_or(job.request.model.as_str());
        if !self.repo.has(name) {
            return Err(EngineError::Unsupported {
                code: FailureCode::ModelUnavailable,
                message: format!("model `{name}` is not installed in {}", self.repo.root().display()),
            });
        }
        guarded(job.device, || self.run_on_device(name, job, ctx, options))
    }

    fn run_on_device(
        &self,
        name: &str,
        job: &EngineJob<'_>,
        ctx: &dyn EngineContext,
        options: &RunOptions,
    ) -> Result<Vec<StemFile>, EngineError> {
        match job.device {
            Device::Cpu => {
                let bag = self.cpu_model(name).map_err(engine_error)?;
                let plan = self.plan(&bag, job, "cpu", options.jobs.unwrap_or(self.config.cpu_jobs).max(1))?;
                let passes = Passes {
                    batch_size: 1,
                    jobs: plan.parallel,
                    training_segment: plan.training_segment,
                    no_split: options.no_split,
                    faults: None,
                };
                self.run(&bag, job, ctx, passes).map_err(engine_error)
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(None) => self.run_cuda(name, job, ctx, options),
            #[cfg(feature = "vulkan")]
            Device::Vulkan(index) => self.run_vulkan(*index, name, job, ctx, options),
            other => Err(EngineError::Unsupported {
                code: FailureCode::DeviceUnavailable,
                message: format!("device `{other}` is not available to the demucs engine"),
            }),
        }
    }

    /// The model folder this engine reads.
    pub fn repo(&self) -> &ModelRepo {
        &self.repo
    }
}

#[cfg(test)]
mod tests {
    use super::ModelCache;

    /// Issue 11, item 9: a panic while loading a model poisoned the cache's mutex, and
    /// every later job failed with `engine_panic` until the worker restarted.
    #[test]
    fn a_panicking_load_does_not_poison_the_model_cache() {
        let cache: ModelCache<u32> = ModelCache::default();
        let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = cache.get_or_load::<()>("htdemucs", || panic!("corrupt checkpoint"));
        }));
        assert!(crashed.is_err());
        assert_eq!(*cache.get_or_load::<()>("htdemucs", || Ok(7)).unwrap(), 7, "the next job loads again");
        assert_eq!(*cache.get_or_load::<()>("htdemucs", || Ok(8)).unwrap(), 7, "and keeps what it loaded");
        assert!(cache.get_or_load("other", || Err("missing")).is_err());
        assert_eq!(*cache.get_or_load::<()>("other", || Ok(9)).unwrap(), 9, "a failed load is not cached");
    }
}
