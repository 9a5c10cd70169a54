//! `stemq batch DIR`: every song of a folder as one batch, over the HTTP API, with one
//! progress bar; and `stemq status --batch ID`, `stemq watch --batch ID` to follow one.
//!
//! This module owns the client side of batches (`POST /v1/batches`,
//! `GET /v1/batches/{id}`):
//!
//! 1. the folder's audio files (not its subfolders, not hidden files) are taken in name
//!    order, each known by its bytes (whatever its name) and opened here first: what is
//!    not audio is skipped with a note, audio stemq cannot read (a codec it does not
//!    decode, a damaged file) is listed with the reason and left out;
//! 2. each is uploaded (content-addressed, so uploading the same file again stores
//!    nothing new and gives the same URI) and becomes one item, with the request the
//!    `submit` flags spell and `metadata.file` = its file name;
//! 3. the batch is submitted: the same folder gives the same batch id, so running the
//!    command again goes on where a limit stopped it, and never queues a song twice;
//!    refused files are listed with their error;
//! 4. with `--wait`, items a limit left `not_submitted` are submitted again after
//!    `Retry-After`, then one bar follows the batch until every job has ended, and with
//!    `-o OUT` each song's stems are downloaded into `OUT/<file stem>/<stem>.<ext>`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use reqwest::Method;
use serde_json::{json, Value};
use stemq_core::batch::{BatchId, BatchStatus, BatchView, ItemState, MAX_BATCH_ITEMS};
use stemq_core::JobStatus;

use crate::api::{Api, ApiError};
use crate::client::SubmitArgs;

/// `stemq batch`: the `submit` flags (the request of every song), with a folder as the
/// input.
#[derive(Debug, clap::Args, Clone)]
pub struct BatchArgs {
    #[command(flatten)]
    pub job: SubmitArgs,
    /// Tell this URL once when the whole batch has ended: a signed
    /// `io.stemq.batch.ended.v1` webhook with every item's outcome.
    #[arg(long, value_name = "URL")]
    pub webhook: Option<String>,
}

/// File extensions of audio: a file so named that does not open is refused with its
/// reason rather than skipped as "not audio".
const AUDIO: [&str; 19] = [
    "wav", "wave", "aif", "aiff", "aifc", "caf", "flac", "mp3", "ogg", "oga", "opus", "m4a", "m4b", "mp4", "aac",
    "webm", "weba", "mka", "mkv",
];

/// What a folder holds: its songs in name order, the files that are not audio, and the
/// audio files stemq cannot read with the reason.
#[derive(Debug, Default)]
pub struct Folder {
    pub songs: Vec<PathBuf>,
    pub skipped: Vec<String>,
    pub refused: Vec<(String, String)>,
}

/// The songs of `dir`: every file whose header stemq reads (the bytes decide, not the
/// name).
pub fn songs_in(dir: &Path) -> Result<Folder> {
    let entries = std::fs::read_dir(dir).with_context(|| format!("reading the folder {}", dir.display()))?;
    let mut f = Folder::default();
    for e in entries {
        let e = e.with_context(|| format!("reading the folder {}", dir.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let path = e.path();
        if name.starts_with('.') || !path.is_file() {
            continue;
        }
        let ext = path.extension().and_then(|x| x.to_str()).unwrap_or_default().to_ascii_lowercase();
        match stemq_audio::Decoder::open_path(&path, stemq_audio::DecodeOptions::default()) {
            Ok(_) => f.songs.push(path),
            Err(stemq_audio::AudioError::NotAudio { .. }) if !AUDIO.contains(&ext.as_str()) => f.skipped.push(name),
            Err(e) => f.refused.push((name, e.to_string())),
        }
    }
    f.songs.sort();
    f.skipped.sort();
    f.refused.sort();
    Ok(f)
}

/// The folder each song's stems go to: its file stem, or its whole name when two songs
/// share a stem (`a.wav`, `a.flac`).
pub fn out_names(files: &[String]) -> Vec<String> {
    let stem = |f: &str| Path::new(f).file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or(f.to_string());
    let mut seen: HashMap<String, usize> = HashMap::new();
    for f in files {
        *seen.entry(stem(f)).or_default() += 1;
    }
    files.iter().map(|f| if seen[&stem(f)] > 1 { f.clone() } else { stem(f) }).collect()
}

/// One bar for the whole batch: uploads, then jobs ended out of jobs submitted.
struct BatchBar(ProgressBar);

impl BatchBar {
    fn new(len: u64, what: &str) -> BatchBar {
        let bar = ProgressBar::new(len);
        bar.set_style(
            ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos:>4}/{len:<4} {msg}")
                .expect("template")
                .progress_chars("=> "),
        );
        bar.enable_steady_tick(Duration::from_millis(120));
        bar.set_message(what.to_string());
        BatchBar(bar)
    }

    /// Shows where `v` is: jobs ended out of jobs submitted.
    fn show(&self, v: &BatchView) {
        let c = &v.counts;
        let ended = c.submitted - c.queued - c.running;
        self.0.set_length(c.submitted as u64);
        self.0.set_position(ended as u64);
        let mut parts = vec![format!("{} running", c.running), format!("{} queued", c.queued)];
        let failed = c.failed + c.dead_lettered + c.rejected + c.cancelled + c.expired;
        if failed > 0 {
            parts.push(format!("{failed} not succeeded"));
        }
        if c.not_submitted > 0 {
            parts.push(format!("{} waiting to be submitted", c.not_submitted));
        }
        self.0.set_message(parts.join(" · "));
    }
}

/// `stemq batch DIR` (with `--api`).
pub async fn submit(api: &Api, a: BatchArgs) -> Result<()> {
    let dir = PathBuf::from(&a.job.input);
    let Folder { songs, skipped, refused } = songs_in(&dir)?;
    for (file, why) in &refused {
        eprintln!("leaving out {file}: {why}");
    }
    if !skipped.is_empty() {
        let shown: Vec<&str> = skipped.iter().take(5).map(String::as_str).collect();
        let more = if skipped.len() > 5 { format!(" and {} more", skipped.len() - 5) } else { String::new() };
        eprintln!("skipping {} files that are not audio: {}{more}", skipped.len(), shown.join(", "));
    }
    if songs.is_empty() {
        bail!("{} holds no audio files stemq reads ({})", dir.display(), stemq_audio::SUPPORTED);
    }
    if songs.len() > MAX_BATCH_ITEMS {
        bail!(
            "{} holds {} audio files; a batch takes at most {MAX_BATCH_ITEMS}: split the folder",
            dir.display(),
            songs.len()
        );
    }
    let files: Vec<String> =
        songs.iter().map(|p| p.file_name().unwrap_or_default().to_string_lossy().into_owned()).collect();
    let bar = BatchBar::new(songs.len() as u64, "uploading");
    let mut items = Vec::with_capacity(songs.len());
    for (path, file) in songs.iter().zip(&files) {
        bar.0.set_message(format!("uploading {file}"));
        let uri = api.upload(path).await.inspect_err(|_| bar.0.abandon())?.audio_uri;
        let mut item = a.job.request(&uri);
        let mut metadata = a.job.metadata.clone().unwrap_or_else(|| json!({}));
        metadata["file"] = json!(file);
        item["metadata"] = metadata;
        items.push(item);
        bar.0.inc(1);
    }
    let mut body = json!({"items": items});
    if let Some(url) = &a.webhook {
        body["webhook"] = json!({"url": url});
    }
    bar.0.set_message("submitting");
    let mut view = post(api, &body).await.inspect_err(|_| bar.0.abandon())?;
    bar.0.finish_and_clear();
    let id = view.batch_id.clone();
    report_submit(&view, &files);
    if !a.job.wait {
        println!("follow it:    stemq watch --batch {id}   (-o DIR downloads the stems)");
        println!("or read it:   GET /v1/batches/{id}");
        return leftovers(&view);
    }
    // Whatever a limit left waits for its Retry-After, then goes in (a refusal that
    // waiting does not cure, one without Retry-After, ends the wait).
    let bar = BatchBar::new(view.counts.submitted as u64, "");
    while let Some((reason, wait)) = view.stopped.clone().and_then(|r| r.retry_after.map(|s| (r, s.max(1)))) {
        bar.show(&view);
        bar.0.set_message(format!(
            "{} waiting to be submitted ({}): again in {wait} s",
            view.counts.not_submitted, reason.code
        ));
        tokio::time::sleep(Duration::from_secs(wait)).await;
        view = post(api, &body).await.inspect_err(|_| bar.0.abandon())?;
    }
    let view = follow(api, &id, bar).await?;
    finish(api, &view, Some(&files), a.job.output_dir.as_deref()).await
}

/// `POST /v1/batches`.
async fn post(api: &Api, body: &Value) -> Result<BatchView, ApiError> {
    api.call(Method::POST, "/v1/batches", Some(body)).await
}

/// What the submission did, file by file where it matters.
fn report_submit(v: &BatchView, files: &[String]) {
    let c = &v.counts;
    println!(
        "batch {}: {} items, {} submitted, {} refused, {} not submitted",
        v.batch_id, c.items, c.submitted, c.refused, c.not_submitted
    );
    for i in &v.items {
        if let ItemState::Refused { error } = &i.state {
            let file = files.get(i.index).map(String::as_str).unwrap_or("?");
            let field = error.field.as_deref().map(|f| format!(" (`{f}`)")).unwrap_or_default();
            println!("  refused  {file}: {}{field}: {}", error.code, error.message);
        }
    }
    if let Some(reason) = &v.stopped {
        let after = reason.retry_after.map(|s| format!(" in {s} s")).unwrap_or_default();
        println!(
            "  stopped: {}: {} — {} files wait; run the same command again{after} (the same batch goes on)",
            reason.code, reason.message, c.not_submitted
        );
    }
}

/// The error a submission without `--wait` ends with, when something is left to do.
fn leftovers(v: &BatchView) -> Result<()> {
    match (v.counts.refused, v.counts.not_submitted) {
        (0, 0) => Ok(()),
        (r, 0) => bail!("{r} of {} files were refused", v.counts.items),
        (_, n) => bail!("{n} of {} files are not submitted yet: run the same command again", v.counts.items),
    }
}

/// Polls the batch with one bar until it has ended (or stopped with nothing running).
async fn follow(api: &Api, id: &BatchId, bar: BatchBar) -> Result<BatchView> {
    loop {
        let v: BatchView =
            api.call(Method::GET, &format!("/v1/batches/{id}"), None).await.inspect_err(|_| bar.0.abandon())?;
        bar.show(&v);
        if v.status != BatchStatus::Running {
            bar.0.finish();
            return Ok(v);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// After the end: the summary, the stems of the songs that succeeded into `out`, and an
/// error when any song did not. `files` names the items (else each job's
/// `metadata.file`, else its id).
async fn finish(api: &Api, v: &BatchView, files: Option<&[String]>, out: Option<&Path>) -> Result<()> {
    let c = &v.counts;
    println!(
        "batch {} {}: {} succeeded, {} failed, {} dead-lettered, {} cancelled, {} expired, {} rejected, {} refused, {} not submitted",
        v.batch_id,
        match v.status {
            BatchStatus::Ended => "ended",
            BatchStatus::Stopped => "stopped",
            BatchStatus::Running => "running",
        },
        c.succeeded,
        c.failed,
        c.dead_lettered,
        c.cancelled,
        c.expired,
        c.rejected,
        c.refused,
        c.not_submitted
    );
    let mut done = Vec::new();
    let mut failed = 0;
    for i in &v.items {
        let ItemState::Submitted { job_id } = &i.state else { continue };
        let view = api.view(job_id).await?;
        let file = files
            .and_then(|f| f.get(i.index).cloned())
            .or_else(|| view.metadata.as_ref().and_then(|m| m["file"].as_str()).map(str::to_string))
            .unwrap_or_else(|| job_id.to_string());
        if view.status == JobStatus::Succeeded {
            done.push((file, view));
            continue;
        }
        failed += 1;
        let why = view.error.as_ref().map(|e| format!(": {} ({})", e.message, e.code)).unwrap_or_default();
        println!("  {:<13} {file}  {job_id}{why}", view.status.as_str());
    }
    if let Some(out) = out {
        let names = out_names(&done.iter().map(|(f, _)| f.clone()).collect::<Vec<_>>());
        for ((_, view), name) in done.iter().zip(names) {
            download(api, view, &out.join(name)).await?;
        }
        if !done.is_empty() {
            println!("stems of {} songs in {}", done.len(), out.display());
        }
    }
    if failed > 0 || c.refused > 0 || c.not_submitted > 0 {
        bail!("{} of {} songs did not succeed", c.items - c.succeeded, c.items);
    }
    Ok(())
}

/// Downloads a succeeded job's stems into `folder/<stem>.<ext>`.
async fn download(api: &Api, view: &stemq_core::JobView, folder: &Path) -> Result<()> {
    tokio::fs::create_dir_all(folder).await.with_context(|| format!("creating {}", folder.display()))?;
    for o in &view.outputs {
        let ext = o.uri.rsplit_once('.').map(|(_, e)| e).filter(|e| !e.contains('/')).unwrap_or("bin");
        let dest = folder.join(format!("{}.{ext}", o.stem));
        let bytes = api.download(&view.job_id, &o.stem, &dest).await?;
        if bytes != o.bytes {
            bail!("{}: got {bytes} bytes, the job recorded {}", dest.display(), o.bytes);
        }
    }
    Ok(())
}

/// `stemq status --batch ID`: the batch's view.
pub async fn status(api: &Api, id: &BatchId) -> Result<()> {
    let v: Value = api.call(Method::GET, &format!("/v1/batches/{id}"), None).await?;
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

/// `stemq watch --batch ID [-o DIR]`: one bar until the batch ends, then the summary
/// (and the stems of the songs that succeeded, into `DIR/<file stem>/`).
pub async fn watch(api: &Api, id: &BatchId, out: Option<&Path>) -> Result<()> {
    let v = follow(api, id, BatchBar::new(0, "")).await?;
    finish(api, &v, None, out).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_gives_its_songs_in_order_and_names_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join(".tone.wav");
        stemq_audio::synth::write_demo_song(&src, 0.1, 8_000).unwrap();
        let tone = std::fs::read(&src).unwrap();
        // The bytes decide: a WAV named `.MP3` or with no extension is a song.
        for f in ["b.wav", "a.wav", "c.MP3", "d", ".hidden.wav"] {
            std::fs::write(dir.path().join(f), &tone).unwrap();
        }
        for f in ["cover.jpg", "notes.txt"] {
            std::fs::write(dir.path().join(f), b"x").unwrap();
        }
        // Audio stemq cannot read: named, with the reason.
        std::fs::write(dir.path().join("broken.flac"), b"fLaC").unwrap();
        std::fs::write(dir.path().join("song.wma"), [0x30, 0x26, 0xB2, 0x75, 0x8E, 0x66, 0xCF, 0x11, 0xA6, 0xD9])
            .unwrap();
        std::fs::create_dir(dir.path().join("sub.wav")).unwrap();
        let f = songs_in(dir.path()).unwrap();
        let names: Vec<_> = f.songs.iter().map(|p| p.file_name().unwrap().to_str().unwrap()).collect();
        assert_eq!(names, ["a.wav", "b.wav", "c.MP3", "d"]);
        assert_eq!(f.skipped, ["cover.jpg", "notes.txt"]);
        let refused: Vec<_> = f.refused.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(refused, ["broken.flac", "song.wma"]);
        assert!(f.refused[1].1.contains("Windows Media Audio"), "{:?}", f.refused);
    }

    #[test]
    fn songs_that_share_a_stem_keep_their_whole_name() {
        let files = ["a.wav", "a.flac", "b.mp3"].map(String::from);
        assert_eq!(out_names(&files), ["a.wav", "a.flac", "b"]);
    }
}
