//! Client commands: submit, status, list, watch, cancel, retry, dead-letter replay,
//! talking to NATS directly (the same contracts other services use), so no ingress is
//! needed. With `--api URL` the same commands go through the HTTP API instead
//! ([`crate::api`]); this module owns their arguments and what they print.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use stemq_core::{JobId, JobStatus, JobView};
use stemq_nats as names;
use stemq_nats::read::{self, ListIndex, Views};
use stemq_storage::Store;
use tokio_util::sync::CancellationToken;

use crate::global::{ApiArgs, Global, StoreArg};
use crate::job_opts::{json_of, set_fields, EncodingArg, FormatArg, OutputOpts, PriorityArg, SplitOpts};

/// `stemq submit`: the job request in the spellings of `stemq separate` (demucs's), with
/// the request's own names (`--model`, `--format`, `--encoding`, `--output-dir`) too.
#[derive(Debug, clap::Args, Clone)]
pub struct SubmitArgs {
    /// An audio URI in the store, or a local file to upload first.
    pub input: String,
    /// Model (`dsp` until the neural engine is installed on the workers).
    #[arg(short = 'n', long, visible_alias = "name", default_value = "dsp")]
    pub model: String,
    #[command(flatten)]
    pub split: SplitOpts,
    #[command(flatten)]
    pub output: OutputOpts,
    /// Output container (`--flac` is the same as `--format flac`, `--mp3` as `--format
    /// mp3`).
    #[arg(long, value_enum, conflicts_with_all = ["flac", "mp3"])]
    pub format: Option<FormatArg>,
    /// Sample encoding (`--int24` is `s24`, `--float32` is `f32`).
    #[arg(long, value_enum, conflicts_with_all = ["int24", "float32"])]
    pub encoding: Option<EncodingArg>,
    /// Metadata (a JSON object).
    #[arg(long, value_parser = parse_metadata)]
    pub metadata: Option<Value>,
    /// The lane the job waits in within its model's pool: `interactive` runs before any
    /// `batch` job. Default: the API key's default lane (`stemq keys create
    /// --priority`), else interactive.
    #[arg(long, value_enum)]
    pub priority: Option<PriorityArg>,
    /// Wait for the job to end, with a progress bar.
    #[arg(long)]
    pub wait: bool,
    /// With `--wait`: copy the stems into this folder as `<stem>.<ext>` once the job
    /// has succeeded.
    #[arg(short = 'o', long = "output-dir", visible_alias = "out", value_name = "DIR", requires = "wait")]
    pub output_dir: Option<PathBuf>,
    /// Without `--api`: the object store to upload to and download from.
    #[command(flatten)]
    pub store: StoreArg,
    #[command(flatten)]
    pub api: ApiArgs,
}

impl SubmitArgs {
    /// The request document for the song at `audio_uri`.
    pub fn request(&self, audio_uri: &str) -> Value {
        let mut req = json!({"audio_uri": audio_uri, "model": self.model});
        self.split.fill(&mut req);
        let format = self.format.map(FormatArg::format).or(self.output.format());
        let encoding = self.encoding.map(EncodingArg::encoding).or(self.output.encoding());
        set_fields(
            &mut req,
            [
                ("output_format", format.map(json_of)),
                ("encoding", encoding.map(json_of)),
                ("clip_mode", self.output.clip_mode.map(|c| json_of(c.mode()))),
                ("metadata", self.metadata.clone()),
                ("priority", self.priority.map(|p| json_of(p.priority()))),
            ],
        );
        set_fields(&mut req, self.output.mp3_fields(format));
        req
    }

    /// True when the input names a URI rather than a local file.
    pub fn input_is_uri(&self) -> bool {
        self.input.contains("://")
    }
}

/// Parses `--metadata`: a JSON object.
fn parse_metadata(s: &str) -> Result<Value, String> {
    match serde_json::from_str(s) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err("must be a JSON object".into()),
        Err(e) => Err(format!("must be a JSON object: {e}")),
    }
}

/// A progress bar that follows a job's views.
pub(crate) struct JobBar(ProgressBar);

impl JobBar {
    pub(crate) fn new() -> JobBar {
        let bar = ProgressBar::new(100);
        bar.set_style(
            ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos:>3}% {msg}")
                .expect("template")
                .progress_chars("=> "),
        );
        bar.enable_steady_tick(Duration::from_millis(120));
        bar.set_message("queued");
        JobBar(bar)
    }

    /// Shows `v`; when it is terminal, finishes and prints the outputs or the error, and
    /// returns true.
    pub(crate) fn show(&self, v: &JobView) -> bool {
        let bar = &self.0;
        let (pct, stage) = v.progress.as_ref().map(|p| (p.percent, p.stage.clone())).unwrap_or((0.0, String::new()));
        bar.set_position(pct as u64);
        let mut msg = v.status.as_str().to_string();
        if !stage.is_empty() && v.status == JobStatus::Running {
            msg = format!("{msg}: {stage}");
        }
        if v.attempt > 1 {
            msg = format!("{msg} (attempt {})", v.attempt);
        }
        bar.set_message(msg);
        if !v.status.is_terminal() {
            return false;
        }
        bar.finish();
        match v.status {
            JobStatus::Succeeded => {
                for o in &v.outputs {
                    println!("{:<12} {}", o.stem, o.uri);
                }
            }
            _ => {
                if let Some(e) = &v.error {
                    eprintln!("{}: {} ({})", v.status.as_str(), e.message, e.code);
                }
            }
        }
        true
    }
}

/// The header of `stemq list`.
pub(crate) fn print_list_header() {
    println!("{:<64}  {:<13}  {:<7}  {:<9}  created", "job id", "status", "attempt", "progress");
}

/// One row of `stemq list`.
pub(crate) fn print_list_row(v: &JobView) {
    let progress = v.progress.as_ref().map(|p| format!("{:.0}%", p.percent)).unwrap_or_default();
    let created = v.created_at.map(|t| t.to_rfc3339()).unwrap_or_default();
    println!("{:<64}  {:<13}  {:<7}  {:<9}  {created}", v.job_id, v.status.as_str(), v.attempt, progress);
}

async fn js(g: &Global) -> Result<jetstream::Context> {
    let client = g.connect("stemq-cli").await?;
    Ok(jetstream::new(client))
}

async fn bucket(js: &jetstream::Context) -> Result<kv::Store> {
    js.get_key_value(names::JOBS_BUCKET)
        .await
        .context("the status bucket is missing: run `stemq nats apply` or `stemq dev`")
}

async fn views(js: &jetstream::Context) -> Result<Views> {
    Views::open(js)
        .await
        .context("the status bucket or the job stream is missing: run `stemq nats apply` or `stemq dev`")
}

/// Uploads a local file to the store, content-addressed (`uploads/<owner>/<sha256>.<ext>`);
/// returns its URI. The file is streamed and hashed on the way, then moved to its key.
async fn upload(store: &Store, owner: &str, file: &Path) -> Result<String> {
    let meta = tokio::fs::metadata(file).await.with_context(|| format!("reading {}", file.display()))?;
    if meta.len() == 0 {
        bail!("{} is empty", file.display());
    }
    let ext = file.extension().and_then(|e| e.to_str()).unwrap_or("bin").to_ascii_lowercase();
    let tmp = format!("incoming/{}", uuid::Uuid::new_v4());
    let stored = store.put_file(&tmp, file).await.with_context(|| format!("uploading {}", file.display()))?;
    let key = format!("{}{}.{ext}", stemq_core::uri::uploads_prefix(owner), stored.sha256);
    if let Err(e) = store.rename(&tmp, &key).await {
        let _ = store.delete(&tmp).await;
        return Err(e).context("moving the upload to its final key");
    }
    Ok(store.uri(&key))
}

/// Copies a succeeded job's stems from the store into `dir` as `<stem>.<ext>`.
async fn download_stems(store: &Store, view: &JobView, dir: &Path) -> Result<()> {
    tokio::fs::create_dir_all(dir).await.with_context(|| format!("creating {}", dir.display()))?;
    let allowed = [store.base_url().to_string()];
    for o in &view.outputs {
        let (_, key) = stemq_core::uri::store_key(&o.uri, &allowed)
            .map_err(|e| anyhow!("stem {} is at {}, outside the configured store: {}", o.stem, o.uri, e.message))?;
        let ext = key.rsplit_once('.').map(|(_, e)| e).unwrap_or("bin");
        let dest = dir.join(format!("{}.{ext}", o.stem));
        let bytes = store.get_to_file(key, &dest).await.with_context(|| format!("downloading {}", o.uri))?;
        if bytes != o.bytes {
            bail!("{}: got {bytes} bytes, the job recorded {}", dest.display(), o.bytes);
        }
        println!("{:<12} {}", o.stem, dest.display());
    }
    Ok(())
}

pub async fn submit(g: &Global, a: SubmitArgs) -> Result<()> {
    let looks_like_uri = a.input_is_uri();
    let store_url = a.store.url(&g.data_dir)?;
    let store = if looks_like_uri && a.output_dir.is_none() {
        None
    } else {
        Some(Store::open(&store_url).context("opening the object store")?)
    };
    let uri = match &store {
        Some(store) if !looks_like_uri => upload(store, &g.owner, Path::new(&a.input)).await?,
        _ => a.input.clone(),
    };
    let req = a.request(&uri);
    let js = js(g).await?;
    let body = serde_json::to_vec(&req)?;
    let stores = vec![store_url];
    let (resp, _) = stemq_ingress::submit::submit(&js, &body, &g.owner, None, &stores, None).await?;
    println!("{}", serde_json::to_string_pretty(&resp)?);
    if a.wait {
        let view = watch(g, &resp.job_id).await?;
        if view.status != JobStatus::Succeeded {
            bail!("job ended {}", view.status.as_str());
        }
        if let (Some(dir), Some(store)) = (&a.output_dir, &store) {
            download_stems(store, &view, dir).await?;
        }
    }
    Ok(())
}

pub async fn status(g: &Global, id: &JobId) -> Result<()> {
    let js = js(g).await?;
    // The view, else the request from the log: a job just submitted is never "no job".
    let views = views(&js).await?;
    match views.current(id).await? {
        Some(v) => println!("{}", serde_json::to_string_pretty(&v)?),
        None => bail!("no job {id}"),
    }
    Ok(())
}

pub async fn list(g: &Global, status: Option<JobStatus>, limit: usize) -> Result<()> {
    let js = js(g).await?;
    let kv = bucket(&js).await?;
    let stop = CancellationToken::new();
    let index = ListIndex::follow(kv.clone(), stop.clone()).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !index.caught_up() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    print_list_header();
    for (id, _) in index.page(status, limit, None) {
        if let Some((v, _)) = read::get_view(&kv, &id).await? {
            print_list_row(&v);
        }
    }
    stop.cancel();
    Ok(())
}

/// Follows a job's KV entry with a progress bar; returns the terminal view.
pub async fn watch(g: &Global, id: &JobId) -> Result<JobView> {
    let js = js(g).await?;
    let kv = bucket(&js).await?;
    let bar = JobBar::new();
    let mut watch = read::watch_view(&kv, id).await?;
    while let Some(entry) = watch.next().await {
        let entry = entry?;
        if entry.operation != kv::Operation::Put {
            continue;
        }
        let Ok(v) = serde_json::from_slice::<JobView>(&entry.value) else {
            continue;
        };
        if bar.show(&v) {
            return Ok(v);
        }
    }
    bail!("the watch ended before the job did")
}

/// Re-runs a failed, dead-lettered, cancelled or expired job as a new job linked both
/// ways (`stemq retry`, `stemq dlq replay`): the same code as `POST .../retry`.
pub async fn replay(g: &Global, id: &JobId) -> Result<()> {
    let js = js(g).await?;
    let view = views(&js).await?.current(id).await?.ok_or_else(|| anyhow!("no job {id}"))?;
    let (new_id, created) = stemq_ingress::control::retry(&js, &view, "/stemq/cli").await?;
    if created {
        println!("retrying {id} as {new_id}");
    } else {
        println!("{id} was already retried as {new_id}");
    }
    Ok(())
}

/// Cancels a queued or running job: the same code as `POST .../cancel`.
pub async fn cancel(g: &Global, id: &JobId) -> Result<()> {
    let js = js(g).await?;
    let view = views(&js).await?.current(id).await?.ok_or_else(|| anyhow!("no job {id}"))?;
    match stemq_ingress::control::cancel(&js, &view, "cli").await? {
        stemq_ingress::control::CancelOutcome::Cancelled => println!("{id} cancelled"),
        stemq_ingress::control::CancelOutcome::AlreadyCancelled => println!("{id} was already cancelled"),
        stemq_ingress::control::CancelOutcome::Cancelling => {
            println!("{id} is running; its worker stops it within about a second")
        }
    }
    Ok(())
}
