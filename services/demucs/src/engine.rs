//! The stemq [`Engine`] backed by HTDemucs: reads the input with `stemq-audio`'s
//! decoder (resampled to the model's rate, stereo), runs [`separate`] (whole-track
//! normalisation, segments with overlap, shifts seeded from the job id), reports
//! progress and honours cancellation per chunk, and writes one file per stem with
//! `StemEncoder` (two-stem requests get `STEM` and `no_STEM`, the sum of the others).
//!
//! Models come from a local folder ([`ModelRepo`]) and stay resident once loaded.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use stemq_audio::{ClipMode, DecodeOptions, Decoder, OutputFormat, StemEncoder, StereoChunk};
use stemq_core::engine::{Engine, EngineContext, EngineError, EngineJob, StemAudio, StemFile};
use stemq_core::request::{Model, OutputFormat as RequestFormat};

use crate::apply::{separate, two_stems, ApplyOptions, BagOfModels, OtherMethod, Progress};
use crate::checkpoint::HostTensor;
use crate::error::DemucsError;
use crate::repo::ModelRepo;
use crate::CpuBackend;

/// Settings of a [`DemucsEngine`].
#[derive(Debug, Clone)]
pub struct DemucsEngineConfig {
    /// The model folder (demucs `--repo` layout).
    pub repo: PathBuf,
    /// Clip mode of the written stems.
    pub clip: ClipMode,
    /// Refuse inputs longer than this (seconds).
    pub max_duration_secs: Option<f64>,
    /// Segments per forward pass on CUDA (the CPU always runs one at a time).
    pub gpu_batch: usize,
}

/// HTDemucs as a stemq engine.
pub struct DemucsEngine {
    repo: ModelRepo,
    config: DemucsEngineConfig,
    cpu: Mutex<HashMap<String, Arc<BagOfModels<CpuBackend>>>>,
    #[cfg(feature = "cuda")]
    cuda: Mutex<HashMap<String, Arc<BagOfModels<crate::CudaBackend>>>>,
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
        DemucsError::InvalidArgument(m) => EngineError::Unsupported {
            code: "invalid_argument".into(),
            message: m,
        },
        DemucsError::Io { .. } => EngineError::Transient(e.to_string()),
        other => EngineError::Unsupported {
            code: "model_unavailable".into(),
            message: other.to_string(),
        },
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

fn cuda_present() -> bool {
    cfg!(feature = "cuda") && std::path::Path::new("/proc/driver/nvidia/version").exists()
}

impl DemucsEngine {
    /// Opens the model folder; models load on first use.
    pub fn new(config: DemucsEngineConfig) -> Result<Self, DemucsError> {
        Ok(DemucsEngine {
            repo: ModelRepo::open(&config.repo)?,
            config,
            cpu: Mutex::new(HashMap::new()),
            #[cfg(feature = "cuda")]
            cuda: Mutex::new(HashMap::new()),
        })
    }

    /// Loads (once) and returns the CPU copy of a model.
    pub fn cpu_model(&self, name: &str) -> Result<Arc<BagOfModels<CpuBackend>>, DemucsError> {
        let mut cache = self.cpu.lock().expect("model cache poisoned");
        if let Some(m) = cache.get(name) {
            return Ok(m.clone());
        }
        let m = Arc::new(self.repo.load::<CpuBackend>(name, &Default::default())?);
        cache.insert(name.to_string(), m.clone());
        Ok(m)
    }

    fn read_input(&self, job: &EngineJob<'_>, samplerate: u32) -> Result<HostTensor, DemucsError> {
        let mut dec = Decoder::open_path(
            job.input,
            DecodeOptions {
                target_sample_rate: samplerate,
                max_duration_secs: self.config.max_duration_secs,
            },
        )?;
        let mut all = StereoChunk::with_capacity(0);
        while let Some(chunk) = dec.next_chunk()? {
            all.extend_from(&chunk);
        }
        if all.is_empty() {
            return Err(DemucsError::Audio(stemq_audio::AudioError::Empty));
        }
        let len = all.len();
        let mut data = all.left;
        data.extend_from_slice(&all.right);
        Ok(HostTensor {
            shape: vec![2, len],
            data,
        })
    }

    fn run<B: burn::tensor::backend::Backend>(
        &self,
        bag: &BagOfModels<B>,
        job: &EngineJob<'_>,
        ctx: &dyn EngineContext,
        batch_size: usize,
    ) -> Result<Vec<StemFile>, DemucsError> {
        let req = job.request;
        if bag.audio_channels() != 2 {
            return Err(DemucsError::Unsupported(
                "models with other than 2 audio channels".into(),
            ));
        }
        let sr = bag.samplerate();
        let mix = self.read_input(job, sr)?;
        let seed = u64::from_str_radix(&job.job_id.0.chars().take(16).collect::<String>(), 16).unwrap_or(0);
        let opts = ApplyOptions {
            shifts: req.shifts as usize,
            split: true,
            overlap: req.overlap,
            transition_power: 1.0,
            segment: job.segment.or(req.segment),
            seed,
            shift_offsets: None,
            batch_size,
        };
        let out = separate(bag, &mix, &opts, &mut Ctx(ctx))?;
        let len = mix.shape[1];
        let stems: Vec<(String, HostTensor)> = match &req.two_stems {
            Some(stem) => two_stems(bag.sources(), &out, &mix, stem, OtherMethod::Add)?,
            None => bag
                .sources()
                .iter()
                .enumerate()
                .map(|(s, name)| {
                    (
                        name.clone(),
                        HostTensor {
                            shape: vec![2, len],
                            data: out.data[s * 2 * len..(s + 1) * 2 * len].to_vec(),
                        },
                    )
                })
                .collect(),
        };
        let (format, ext) = match req.output_format {
            RequestFormat::Wav => (OutputFormat::Wav16, "wav"),
            RequestFormat::Flac => (OutputFormat::Flac16, "flac"),
        };
        let mut files = Vec::new();
        for (name, audio) in stems {
            let path = job.out_dir.join(format!("{name}.{ext}"));
            let mut enc = StemEncoder::create(&path, format, self.config.clip, sr)?;
            const BLOCK: usize = 1 << 16;
            let mut start = 0;
            while start < len {
                let end = (start + BLOCK).min(len);
                enc.write(&StereoChunk::from_planar(
                    audio.data[start..end].to_vec(),
                    audio.data[len + start..len + end].to_vec(),
                ))?;
                start = end;
            }
            enc.finish()?;
            files.push(StemFile {
                stem: name,
                path,
                audio: Some(StemAudio {
                    sample_rate: sr,
                    frames: len as u64,
                }),
            });
        }
        Ok(files)
    }

    #[cfg(feature = "cuda")]
    fn run_cuda(&self, name: &str, job: &EngineJob<'_>, ctx: &dyn EngineContext) -> Result<Vec<StemFile>, EngineError> {
        let attempt = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let bag = {
                let mut cache = self.cuda.lock().expect("model cache poisoned");
                match cache.get(name) {
                    Some(m) => m.clone(),
                    None => {
                        let m = Arc::new(self.repo.load::<crate::CudaBackend>(name, &Default::default())?);
                        cache.insert(name.to_string(), m.clone());
                        m
                    }
                }
            };
            self.run(&bag, job, ctx, self.config.gpu_batch.max(1))
        }));
        match attempt {
            Ok(r) => r.map_err(engine_error),
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                if msg.to_lowercase().contains("out of memory") {
                    Err(EngineError::OutOfMemory { device: "cuda".into() })
                } else {
                    Err(EngineError::Transient(format!("cuda backend panicked: {msg}")))
                }
            }
        }
    }
}

impl Engine for DemucsEngine {
    fn name(&self) -> &str {
        "demucs"
    }

    fn devices(&self) -> Vec<String> {
        let mut d = Vec::new();
        if cuda_present() {
            d.push("cuda".to_string());
        }
        d.push("cpu".to_string());
        d
    }

    fn separate(&self, job: &EngineJob<'_>, ctx: &dyn EngineContext) -> Result<Vec<StemFile>, EngineError> {
        let name = job.request.model.as_str();
        if job.request.model == Model::Dsp || !self.repo.has(name) {
            return Err(EngineError::Unsupported {
                code: "model_unavailable".into(),
                message: format!("model `{name}` is not installed in {}", self.repo.root().display()),
            });
        }
        match job.device {
            "cpu" => {
                let bag = self.cpu_model(name).map_err(engine_error)?;
                self.run(&bag, job, ctx, 1).map_err(engine_error)
            }
            #[cfg(feature = "cuda")]
            "cuda" => self.run_cuda(name, job, ctx),
            other => Err(EngineError::Unsupported {
                code: "device_unavailable".into(),
                message: format!("device `{other}` is not available to the demucs engine"),
            }),
        }
    }
}
