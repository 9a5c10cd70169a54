//! `stemq separate`: the Demucs command line, drop-in, without a queue.
//!
//! This module owns the local, one-shot path for people who use `demucs` today: the same
//! flags, the same output layout (`OUT/NAME/TRACK/STEM.EXT`, or `--filename`), a
//! progress bar, and the same engines the workers run (`-n dsp` always; `-n htdemucs`,
//! `htdemucs_ft`, `htdemucs_6s` with a build that has `--features demucs` and a model
//! folder given by `--repo`). Each file becomes a normal [`NormalizedRequest`], so a
//! request the pipeline would refuse is refused here with the same message.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use stemq_core::engine::{Engine, EngineContext, EngineJob};
use stemq_core::request::{JobRequest, ANONYMOUS};

use crate::global::Global;
use crate::job_opts::{json_of, set_fields, ClipModeArg, DeviceArg, OutputOpts, SplitOpts};
use crate::services::EngineKind;

/// `demucs`-compatible options.
#[derive(Debug, Args, Clone)]
pub struct SeparateArgs {
    /// Audio files to separate.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Model name (`dsp` needs no weights).
    #[arg(short = 'n', long = "name", default_value = "dsp")]
    pub name: String,
    /// Model folder (demucs `--repo` layout) for the HTDemucs models.
    #[arg(long)]
    pub repo: Option<PathBuf>,
    /// Output folder.
    #[arg(short = 'o', long = "out", default_value = "separated")]
    pub out: PathBuf,
    /// Output file template: `{track}`, `{trackext}`, `{stem}`, `{ext}`.
    #[arg(long, default_value = "{track}/{stem}.{ext}")]
    pub filename: String,
    #[command(flatten)]
    pub split: SplitOpts,
    /// Device (default: the engine's first).
    #[arg(short = 'd', long, value_enum)]
    pub device: Option<DeviceArg>,
    #[command(flatten)]
    pub output: OutputOpts,
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

fn engine_for(g: &Global, a: &SeparateArgs) -> Result<Arc<dyn Engine>> {
    let kind = if a.name == "dsp" { EngineKind::Dsp } else { EngineKind::Demucs };
    crate::services::engine_named(g, kind, a.repo.clone(), None, std::time::Duration::ZERO)
}

/// Separates every file, writing stems like `demucs` does.
pub fn run(g: &Global, a: SeparateArgs) -> Result<()> {
    let engine = engine_for(g, &a)?;
    let devices = engine.devices();
    let device = match a.device {
        Some(want) => match devices.iter().find(|d| want.matches(d)) {
            Some(d) => d.clone(),
            None => bail!(
                "device `{}` is not available here; available: {}",
                want.as_str(),
                devices.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")
            ),
        },
        None => devices.first().cloned().unwrap_or(stemq_core::device::Device::Cpu),
    };
    for file in &a.files {
        let track =
            file.file_stem().and_then(|s| s.to_str()).ok_or_else(|| anyhow!("bad file name {}", file.display()))?;
        let trackext = file.extension().and_then(|s| s.to_str()).unwrap_or("");
        let mut req = json!({
            "audio_uri": url::Url::from_file_path(std::fs::canonicalize(file).with_context(|| format!("{} not found", file.display()))?)
                .map_err(|_| anyhow!("bad path {}", file.display()))?.to_string(),
            "model": a.name,
            "output_format": json_of(a.output.format().unwrap_or_default()),
            "encoding": json_of(a.output.encoding().unwrap_or_default()),
            "clip_mode": json_of(a.output.clip_mode.unwrap_or(ClipModeArg::Rescale).mode()),
        });
        a.split.fill(&mut req);
        set_fields(&mut req, a.output.mp3_fields(a.output.format()));
        let request = JobRequest::from_value(req).and_then(|r| r.normalize(ANONYMOUS)).map_err(|e| anyhow!("{e}"))?;
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
        for s in stems {
            let rel = a
                .filename
                .replace("{track}", track)
                .replace("{trackext}", trackext)
                .replace("{stem}", &s.stem)
                .replace("{ext}", ext);
            let dest = a.out.join(&a.name).join(rel);
            move_file(&s.path, &dest)?;
            println!("{}", dest.display());
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
