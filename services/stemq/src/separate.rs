//! `stemq separate`: the Demucs command line, drop-in, without a queue.
//!
//! This module owns the local, one-shot path for people who use `demucs` today: the
//! flags of `python -m demucs.separate` (4.1.0) with its defaults (`-n htdemucs`,
//! `--shifts 1`, `--overlap 0.25`, `--clip-mode rescale`), the same output layout
//! (`OUT/NAME/TRACK/STEM.EXT`, or `--filename`), a progress bar, and the engines the
//! workers run: `-n dsp` (no weights), or any model of the model folder (`--repo`,
//! default `<data-dir>/models`, where `stemq models pull` puts them): a bag `NAME.yaml`
//! or a checkpoint's signature, as demucs resolves `-n`, and `-s SIG` likewise. Each
//! file becomes a normal [`NormalizedRequest`](stemq_core::request::NormalizedRequest),
//! so a request the pipeline would refuse is refused here with the same message.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use stemq_core::device::Device;
use stemq_core::engine::{Engine, EngineContext, EngineError, EngineJob, StemFile};
use stemq_core::request::{JobRequest, Model, OtherMethod, ANONYMOUS};

use crate::global::Global;
use crate::job_opts::{json_of, parse_device, set_fields, ClipModeArg, DeviceArg, OutputOpts, SplitOpts};

/// `demucs`-compatible options (`python -m demucs.separate --help`, 4.1.0).
#[derive(Debug, Args, Clone)]
pub struct SeparateArgs {
    /// Audio files to separate (demucs's `tracks`).
    #[arg(value_name = "TRACKS", required_unless_present = "list_models")]
    pub files: Vec<PathBuf>,
    /// Model: a bag (`NAME.yaml`) or a signature in the model folder, or `dsp` (no
    /// weights).
    #[arg(short = 'n', long = "name", default_value = "htdemucs")]
    pub name: String,
    /// A locally trained model's signature (`SIG.th` in the model folder); outputs go to
    /// `OUT/SIG/`.
    #[arg(short = 's', long = "sig", conflicts_with = "name")]
    pub sig: Option<String>,
    /// Model folder (demucs `--repo` layout: `<sig>[-<checksum>].th`, `<name>.yaml`);
    /// default `<data-dir>/models`, where `stemq models pull` installs.
    #[arg(long)]
    pub repo: Option<PathBuf>,
    /// List the models of the model folder and exit.
    #[arg(long)]
    pub list_models: bool,
    /// Say more: the model folder, the device, and time and speed per track.
    #[arg(short = 'v', long)]
    pub verbose: bool,
    /// Output folder; a subfolder named after the model is created in it.
    #[arg(short = 'o', long = "out", default_value = "separated")]
    pub out: PathBuf,
    /// Output file template: `{track}`, `{trackext}`, `{stem}`, `{ext}`.
    #[arg(long, default_value = "{track}/{stem}.{ext}")]
    pub filename: String,
    #[command(flatten)]
    pub split: SplitOpts,
    /// One forward pass over the whole track instead of overlapping segments: memory
    /// grows with the track, and HTDemucs refuses tracks longer than its trained
    /// segment (as demucs does).
    #[arg(long, conflicts_with = "segment")]
    pub no_split: bool,
    /// Device: `cpu`, `cuda`, `cuda:N`, `vulkan` or `vulkan:N` (default: CUDA when
    /// present, else a Vulkan GPU in a build with `--features vulkan`, else the CPU).
    /// `vulkan` also takes a software driver (Mesa's lavapipe), which the default never
    /// picks.
    #[arg(short = 'd', long, value_parser = parse_device)]
    pub device: Option<DeviceArg>,
    /// The type a GPU keeps the weights in: `f16` halves their memory (lossless for the
    /// official checkpoints, stored in f16); the arithmetic stays f32 (not in demucs).
    #[arg(long, value_enum, default_value_t = crate::services::GpuWeights::F32)]
    pub gpu_weights: crate::services::GpuWeights,
    #[command(flatten)]
    pub output: OutputOpts,
    /// Forward passes run at once on the CPU: faster with several cores, more memory
    /// (default: up to 2, the cores there are).
    #[arg(short = 'j', long = "jobs", value_parser = clap::value_parser!(u16).range(1..))]
    pub jobs: Option<u16>,
}

impl SeparateArgs {
    /// The model asked for: `-s SIG` or `-n NAME`.
    fn model(&self) -> &str {
        self.sig.as_deref().unwrap_or(&self.name)
    }
}

struct Bar(ProgressBar);

impl EngineContext for Bar {
    fn progress(&self, fraction: f32, stage: &str) {
        self.0.set_position((fraction * 100.0).round() as u64);
        self.0.set_message(stage.to_string());
    }
    fn cancelled(&self) -> bool {
        false
    }
}

/// The engine that runs the asked model.
enum Separator {
    Dsp(Arc<dyn Engine>),
    #[cfg(feature = "demucs")]
    Demucs(Box<stemq_demucs::engine::DemucsEngine>, stemq_demucs::engine::RunOptions),
}

impl Separator {
    fn open(g: &Global, a: &SeparateArgs) -> Result<Separator> {
        if a.model() == "dsp" {
            return Ok(Separator::Dsp(Arc::new(stemq_audio::DspEngine::default())));
        }
        Separator::demucs(g, a)
    }

    #[cfg(feature = "demucs")]
    fn demucs(g: &Global, a: &SeparateArgs) -> Result<Separator> {
        let repo = a.repo.clone().unwrap_or_else(|| g.data_dir.join("models"));
        if !repo.is_dir() {
            bail!(
                "model `{}`: the model folder {} does not exist; install the model with `stemq models pull {}` \
                 (or pass --repo DIR), or use `-n dsp` (no weights)",
                a.model(),
                repo.display(),
                a.model()
            );
        }
        let place = crate::services::DemucsPlacement {
            memory_budget: None,
            cross_job: None,
            gpu_weights: a.gpu_weights,
            device: a.device.as_ref().map(|d| d.0.clone()),
            device_max_alloc: None,
        };
        let engine = crate::services::demucs_engine_here(g, Some(repo), place)?;
        if !engine.repo().has(a.model()) {
            let names = engine.repo().names();
            bail!(
                "model `{}` is not in the model folder {} (it has: {}); `stemq models pull NAME` installs a released \
                 one, `stemq separate --list-models` lists them",
                a.model(),
                engine.repo().root().display(),
                if names.is_empty() { "nothing".to_string() } else { names.join(", ") }
            );
        }
        let options = stemq_demucs::engine::RunOptions {
            model: Some(a.model().to_string()),
            no_split: a.no_split,
            jobs: a.jobs.map(usize::from),
        };
        Ok(Separator::Demucs(Box::new(engine), options))
    }

    #[cfg(not(feature = "demucs"))]
    fn demucs(_: &Global, a: &SeparateArgs) -> Result<Separator> {
        bail!(
            "model `{}` needs the demucs engine, which this stemq was built without (it is in the default \
             build); `-n dsp` needs no weights",
            a.model()
        )
    }

    fn devices(&self) -> Vec<Device> {
        match self {
            Separator::Dsp(e) => e.devices(),
            #[cfg(feature = "demucs")]
            Separator::Demucs(e, _) => e.devices(),
        }
    }

    fn separate(&self, job: &EngineJob<'_>, ctx: &dyn EngineContext) -> Result<Vec<StemFile>, EngineError> {
        match self {
            Separator::Dsp(e) => e.separate(job, ctx),
            #[cfg(feature = "demucs")]
            Separator::Demucs(e, options) => e.separate_with(job, ctx, options),
        }
    }
}

/// `--list-models`: what `-n` takes here, as demucs lists its repo.
fn list_models(g: &Global, a: &SeparateArgs) -> Result<()> {
    let repo = a.repo.clone().unwrap_or_else(|| g.data_dir.join("models"));
    println!("Built in:\n    dsp");
    #[cfg(feature = "demucs")]
    if repo.is_dir() {
        let r = stemq_demucs::repo::ModelRepo::open(&repo)
            .with_context(|| format!("reading the model folder {}", repo.display()))?;
        println!("Bag of models:");
        for name in r.bag_names() {
            println!("    {name}");
        }
        println!("Single models:");
        for sig in r.signatures() {
            println!("    {sig}");
        }
        return Ok(());
    }
    if cfg!(feature = "demucs") {
        println!("No model folder at {} (`stemq models pull NAME` makes it).", repo.display());
    } else {
        println!("(this stemq was built without the demucs engine: only dsp)");
    }
    Ok(())
}

/// Separates every file, writing stems like `demucs` does.
pub fn run(g: &Global, a: SeparateArgs) -> Result<()> {
    if a.list_models {
        return list_models(g, &a);
    }
    let engine = Separator::open(g, &a)?;
    let devices = engine.devices();
    let device = match &a.device {
        Some(want) => match devices.iter().find(|d| want.matches(d)) {
            Some(d) => d.clone(),
            None => bail!(
                "device `{want}` is not available here; available: {}",
                devices.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")
            ),
        },
        None => devices.first().cloned().unwrap_or(Device::Cpu),
    };
    let name = a.model();
    if a.verbose {
        let repo = a.repo.clone().unwrap_or_else(|| g.data_dir.join("models"));
        eprintln!("model {name} (model folder {}), device {device}", repo.display());
        if a.split.other_method.is_some() && a.split.two_stems.is_none() {
            eprintln!("--other-method changes nothing without --two-stems");
        }
    }
    for file in &a.files {
        let started = Instant::now();
        let track =
            file.file_stem().and_then(|s| s.to_str()).ok_or_else(|| anyhow!("bad file name {}", file.display()))?;
        let trackext = file.extension().and_then(|s| s.to_str()).unwrap_or("");
        // The request the pipeline would take: a model it routes by name keeps its name;
        // any other model of the folder is run by name, validated as HTDemucs (its stems
        // are checked against the loaded model's own sources).
        let model = Model::parse(name).unwrap_or(Model::Htdemucs);
        let mut req = json!({
            "audio_uri": url::Url::from_file_path(std::fs::canonicalize(file).with_context(|| format!("{} not found", file.display()))?)
                .map_err(|_| anyhow!("bad path {}", file.display()))?.to_string(),
            "model": model.as_str(),
            "output_format": json_of(a.output.format().unwrap_or_default()),
            "encoding": json_of(a.output.encoding().unwrap_or_default()),
            "clip_mode": json_of(a.output.clip_mode.unwrap_or(ClipModeArg::Rescale).mode()),
        });
        a.split.fill(&mut req);
        // A model the request does not name (a signature, a custom bag) has its own
        // sources: its stem, and with it the other method, is checked against the loaded
        // model, not HTDemucs's.
        let (two_stems, other_method) = match (Model::parse(name), req.as_object_mut()) {
            (None, Some(o)) => {
                let stem = o.remove("two_stems").and_then(|v| v.as_str().map(String::from));
                o.remove("other_method");
                (stem, a.split.other_method.map(|m| m.method()).filter(|&m| m != OtherMethod::Add))
            }
            _ => (None, None),
        };
        set_fields(&mut req, a.output.mp3_fields(a.output.format()));
        let mut request =
            JobRequest::from_value(req).and_then(|r| r.normalize(ANONYMOUS)).map_err(|e| anyhow!("{e}"))?;
        if two_stems.is_some() {
            request.two_stems = two_stems;
            request.other_method = other_method;
        }
        let job_id = request.job_id();
        let scratch = tempfile::tempdir()?;
        let bar = ProgressBar::new(100);
        bar.set_style(
            ProgressStyle::with_template("{prefix} {bar:40} {pos:>3}% {msg}").expect("template").progress_chars("=> "),
        );
        bar.set_prefix(track.to_string());
        let ctx = Bar(bar);
        let job = EngineJob {
            job_id: &job_id,
            request: &request,
            metadata: None,
            attempt: 1,
            input: file,
            out_dir: scratch.path(),
            device: &device,
            segment: request.segment,
        };
        let stems = engine.separate(&job, &ctx).map_err(|e| anyhow!("{}: {e}", file.display()))?;
        ctx.0.finish_with_message("done");
        let ext = request.output_format.extension();
        let seconds = stems.first().and_then(|s| s.audio).map(|a| a.secs());
        for s in stems {
            let rel = a
                .filename
                .replace("{track}", track)
                .replace("{trackext}", trackext)
                .replace("{stem}", &s.stem)
                .replace("{ext}", ext);
            let dest = a.out.join(name).join(rel);
            move_file(&s.path, &dest)?;
            println!("{}", dest.display());
        }
        if a.verbose {
            let took = started.elapsed().as_secs_f64();
            match seconds {
                Some(len) => {
                    eprintln!("{}: {len:.1} s of audio in {took:.1} s ({:.1}× real time)", file.display(), len / took)
                }
                None => eprintln!("{}: {took:.1} s", file.display()),
            }
        }
    }
    Ok(())
}

fn move_file(from: &Path, to: &Path) -> Result<()> {
    if let Some(dir) = to.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if std::fs::rename(from, to).is_err() {
        std::fs::copy(from, to).with_context(|| format!("writing {}", to.display()))?;
    }
    Ok(())
}
