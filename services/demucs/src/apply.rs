//! Port of `demucs.apply.apply_model` / `BagOfModels` / `TensorChunk` and of the
//! whole-track normalisation in `demucs.api.Separator.separate_tensor`.
//!
//! * [`separate`]: `ref = mix.mean(channels)`; `(mix − ref.mean()) / (ref.std() + 1e-8)`,
//!   [`apply_model`], then `· std + mean`.
//! * [`apply_model`]: for each model of the bag (weighted per source); for each shift
//!   (the mix zero-padded by 0.5 s, a random offset in `[0, 0.5 s]`, outputs averaged);
//!   chunks of one segment every `(1 − overlap)·segment` samples, each padded with real
//!   neighbouring audio to the model's length (`TensorChunk.padded`), separated, centre
//!   trimmed and summed with triangular weights (`transition_power`), normalised by the
//!   summed weights.
//!
//! Shapes: a track is `[C, L]`, the result `[S, C, L]` (host, `f32`).

use burn::tensor::backend::Backend;
use rand::{Rng, SeedableRng};

use crate::batch::{CrossJobBatching, Hub, JobSlot, Key};
use crate::checkpoint::HostTensor;
use crate::config::Arch;
use crate::error::DemucsError;
use crate::model::HTDemucs;

/// Models with per-source weights (`demucs.apply.BagOfModels`); a single model is a
/// bag of one with unit weights.
#[derive(Debug)]
pub struct BagOfModels<B: Backend> {
    pub(crate) models: Vec<HTDemucs<B>>,
    pub(crate) weights: Vec<Vec<f32>>,
    /// Each model's effective segment in seconds (the bag's `segment` when it is not
    /// above the model's own).
    pub(crate) segments: Vec<f64>,
    /// Where forward passes of several jobs meet ([`BagOfModels::batch_across_jobs`]).
    hub: Option<Hub>,
}

impl<B: Backend> BagOfModels<B> {
    /// A bag; `weights` default to ones, `segment` overrides each model's segment when
    /// not larger (as demucs does for HTDemucs).
    pub fn new(
        models: Vec<HTDemucs<B>>,
        weights: Option<Vec<Vec<f32>>>,
        segment: Option<f64>,
    ) -> Result<Self, DemucsError> {
        let first = models
            .first()
            .ok_or_else(|| DemucsError::InvalidArgument("a bag needs at least one model".into()))?
            .config()
            .clone();
        for m in &models {
            let c = m.config();
            if c.sources != first.sources
                || c.samplerate != first.samplerate
                || c.audio_channels != first.audio_channels
            {
                return Err(DemucsError::InvalidArgument(
                    "models of a bag must share sources, sample rate and channels".into(),
                ));
            }
        }
        let weights = match weights {
            None => vec![vec![1.0; first.sources.len()]; models.len()],
            Some(w) => {
                if w.len() != models.len() || w.iter().any(|r| r.len() != first.sources.len()) {
                    return Err(DemucsError::InvalidArgument(
                        "bag weights must have one row per model and one weight per source".into(),
                    ));
                }
                w
            }
        };
        // demucs's BagOfModels(segment=…): an HTDemucs member takes it only when not
        // above its own (it cannot run longer segments); any other member takes it.
        let segments = models
            .iter()
            .map(|m| {
                let own = m.config().segment_seconds();
                match (segment, m.config().arch) {
                    (Some(s), Arch::HDemucs | Arch::Demucs) => s,
                    (Some(s), Arch::HTDemucs) if s <= own => s,
                    _ => own,
                }
            })
            .collect();
        Ok(BagOfModels { models, weights, segments, hub: None })
    }

    /// A single model.
    pub fn single(model: HTDemucs<B>) -> Self {
        let n = model.config().sources.len();
        let seg = model.config().segment_seconds();
        BagOfModels { models: vec![model], weights: vec![vec![1.0; n]], segments: vec![seg], hub: None }
    }

    /// Lets the chunks of jobs running at the same time share forward passes
    /// ([`crate::batch`]); each job holds [`BagOfModels::join`] while it runs.
    pub fn batch_across_jobs(&mut self, config: CrossJobBatching) {
        self.hub = Some(Hub::new(config));
    }

    /// The cross-job batching hub, if any.
    pub fn hub(&self) -> Option<&Hub> {
        self.hub.as_ref()
    }

    /// Registers a job on the bag for as long as the slot lives: with cross-job
    /// batching, passes wait (up to the linger) for the passes of registered jobs.
    pub fn join(&self) -> JobSlot<'_> {
        self.hub.as_ref().map_or_else(JobSlot::none, Hub::join)
    }

    /// Forward passes of model `index` over `inputs` (`[B, C, L]` each, run at once on
    /// their own threads), through the hub when there is one.
    pub(crate) fn forward(
        &self,
        index: usize,
        inputs: Vec<HostTensor>,
        training_length: usize,
    ) -> Result<Vec<HostTensor>, DemucsError> {
        let model = &self.models[index];
        let Some(hub) = &self.hub else {
            return model.forward_parallel(inputs, training_length);
        };
        // The job of this thread: the threads below run its passes.
        let job = crate::batch::current_job();
        let one = |input: HostTensor| {
            if input.shape.len() != 3 {
                // Not `[B, C, L]`: the model's own check says why.
                return model.forward_with_training_length(&input, training_length);
            }
            let key = Key { model: index, channels: input.shape[1], length: input.shape[2], training_length };
            hub.forward(key, job, input, |x| model.forward_with_training_length(x, training_length))
        };
        crate::model::on_threads(inputs, one)
    }

    /// Source names.
    pub fn sources(&self) -> &[String] {
        &self.models[0].config().sources
    }
    /// Sample rate.
    pub fn samplerate(&self) -> u32 {
        self.models[0].config().samplerate
    }
    /// Audio channels.
    pub fn audio_channels(&self) -> usize {
        self.models[0].config().audio_channels
    }
    /// The models.
    pub fn models(&self) -> &[HTDemucs<B>] {
        &self.models
    }
    /// Each model's training segment (seconds) with `opts.training_segment` applied
    /// where it is not larger, as demucs's `BagOfModels(segment=…)` does.
    pub fn training_segments(&self, opts: &ApplyOptions) -> Vec<f64> {
        self.segments
            .iter()
            .map(|&own| match opts.training_segment {
                Some(s) if s > 0.0 && s <= own => s,
                _ => own,
            })
            .collect()
    }

    /// The largest `segment` a caller may ask for: the smallest segment of its HTDemucs
    /// members (which pad every chunk to it); unlimited for Hybrid Demucs alone.
    pub fn max_allowed_segment(&self) -> f64 {
        self.models
            .iter()
            .zip(&self.segments)
            .filter(|(m, _)| m.config().arch == Arch::HTDemucs)
            .map(|(_, s)| *s)
            .fold(f64::INFINITY, f64::min)
    }
}

/// How to apply a model (`apply_model`'s keyword arguments).
#[derive(Debug, Clone)]
pub struct ApplyOptions {
    /// Random shifts averaged (0 = none).
    pub shifts: usize,
    /// Split into segments.
    pub split: bool,
    /// Overlap between segments (0.25).
    pub overlap: f64,
    /// Exponent of the triangular weights (1).
    pub transition_power: f64,
    /// Segment length override in seconds (at most the model's).
    pub segment: Option<f64>,
    /// Seed of the shift offsets.
    pub seed: u64,
    /// Explicit shift offsets (samples), used instead of the seeded RNG (parity tests).
    pub shift_offsets: Option<Vec<usize>>,
    /// Chunks run together in one forward pass (batch dimension); 1 on the CPU, more on
    /// a GPU. Results do not depend on it.
    pub batch_size: usize,
    /// Batches run concurrently on their own threads (demucs's `-j`); the CPU
    /// backend's kernels alone keep barely more than one core busy.
    pub jobs: usize,
    /// Shortens the models' training segment (seconds; ignored where not shorter), as
    /// demucs's `BagOfModels(segment=…)` does: each forward pass then runs on this many
    /// samples instead of being padded to the trained length, which is what makes a
    /// smaller segment need less memory (the output changes a little: less context).
    pub training_segment: Option<f64>,
}

impl Default for ApplyOptions {
    fn default() -> Self {
        ApplyOptions {
            shifts: 1,
            split: true,
            overlap: 0.25,
            transition_power: 1.0,
            segment: None,
            seed: 0,
            shift_offsets: None,
            batch_size: 1,
            jobs: 1,
            training_segment: None,
        }
    }
}

/// Per-chunk callbacks: progress in [0, 1] and cancellation.
pub trait Progress {
    /// Called after each chunk with the fraction done.
    fn chunk_done(&mut self, fraction: f32);
    /// True to stop at the next chunk boundary.
    fn cancelled(&self) -> bool {
        false
    }
}

/// No callbacks.
pub struct NoProgress;

impl Progress for NoProgress {
    fn chunk_done(&mut self, _fraction: f32) {}
}

/// A view `[offset, offset + length)` of the last axis of a `[C, N]` track
/// (`TensorChunk`).
#[derive(Clone, Copy)]
struct Chunk<'a> {
    data: &'a [f32],
    channels: usize,
    total: usize,
    offset: usize,
    length: usize,
}

impl<'a> Chunk<'a> {
    fn whole(data: &'a [f32], channels: usize, total: usize) -> Self {
        Chunk { data, channels, total, offset: 0, length: total }
    }

    /// `TensorChunk(self, offset, length)`.
    fn sub(&self, offset: usize, length: usize) -> Self {
        let length = length.min(self.length - offset);
        Chunk { offset: self.offset + offset, length, ..*self }
    }

    /// `TensorChunk.padded(target)`: `[C, target]` centred on the chunk, real audio
    /// where the underlying track has it, zeros elsewhere.
    fn padded(&self, target: usize) -> Vec<f32> {
        let delta = target - self.length;
        let start = self.offset as isize - (delta / 2) as isize;
        let mut out = vec![0f32; self.channels * target];
        for c in 0..self.channels {
            for i in 0..target {
                let j = start + i as isize;
                if j >= 0 && (j as usize) < self.total {
                    out[c * target + i] = self.data[c * self.total + j as usize];
                }
            }
        }
        out
    }
}

struct Run<'p> {
    done: usize,
    total: usize,
    progress: &'p mut dyn Progress,
}

impl Run<'_> {
    fn tick(&mut self) -> Result<(), DemucsError> {
        self.done += 1;
        self.progress.chunk_done(self.done as f32 / self.total.max(1) as f32);
        if self.progress.cancelled() {
            return Err(DemucsError::Cancelled);
        }
        Ok(())
    }
}

fn chunks_per_pass(length: usize, samplerate: u32, segment: f64, opts: &ApplyOptions) -> usize {
    if !opts.split {
        return 1;
    }
    let seg = (samplerate as f64 * segment) as usize;
    let stride = ((1.0 - opts.overlap) * seg as f64) as usize;
    length.div_ceil(stride.max(1))
}

/// `[C, L]` of a mixture, or why not.
fn mix_shape(mix: &HostTensor) -> Result<[usize; 2], DemucsError> {
    <[usize; 2]>::try_from(mix.shape.as_slice())
        .map_err(|_| DemucsError::InvalidArgument(format!("mix shape {:?}, expected [C, L]", mix.shape)))
}

/// The whole-track normalisation of `Separator.separate_tensor` around [`apply_model`]:
/// `mix` `[C, L]` → `[S, C, L]`.
pub fn separate<B: Backend>(
    bag: &BagOfModels<B>,
    mix: &HostTensor,
    opts: &ApplyOptions,
    progress: &mut dyn Progress,
) -> Result<HostTensor, DemucsError> {
    let [ch, len] = mix_shape(mix)?;
    if len < 2 {
        return Err(DemucsError::InvalidArgument("empty input".into()));
    }
    let reference: Vec<f64> =
        (0..len).map(|i| (0..ch).map(|c| mix.data[c * len + i] as f64).sum::<f64>() / ch as f64).collect();
    let mean = reference.iter().sum::<f64>() / len as f64;
    let var = reference.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / (len as f64 - 1.0);
    let std = var.sqrt() + 1e-8;
    let normalised = HostTensor {
        shape: mix.shape.clone(),
        data: mix.data.iter().map(|v| ((*v as f64 - mean) / std) as f32).collect(),
    };
    let mut out = apply_model(bag, &normalised, opts, progress)?;
    for v in out.data.iter_mut() {
        *v = (*v as f64 * std + mean) as f32;
    }
    Ok(out)
}

/// `apply_model(bag, mix[None], ...)[0]`: `mix` `[C, L]` → `[S, C, L]`.
pub fn apply_model<B: Backend>(
    bag: &BagOfModels<B>,
    mix: &HostTensor,
    opts: &ApplyOptions,
    progress: &mut dyn Progress,
) -> Result<HostTensor, DemucsError> {
    let [ch, len] = mix_shape(mix)?;
    if ch != bag.audio_channels() {
        return Err(DemucsError::InvalidArgument(format!(
            "mix has {ch} channels, the model takes {}",
            bag.audio_channels()
        )));
    }
    if let Some(s) = opts.segment {
        if s.is_nan() || s <= 0.0 || s > bag.max_allowed_segment() {
            return Err(DemucsError::InvalidArgument(format!(
                "segment {s} s is not in (0, {}] (the trained segment)",
                bag.max_allowed_segment()
            )));
        }
    }
    if opts.overlap < 0.0 || opts.overlap >= 1.0 || opts.transition_power < 1.0 {
        return Err(DemucsError::InvalidArgument("overlap must be in [0, 1), transition_power >= 1".into()));
    }
    let nsrc = bag.sources().len();
    let sr = bag.samplerate();
    let passes = opts.shifts.max(1);
    let segments = bag.training_segments(opts);
    let total: usize = segments
        .iter()
        .map(|seg| {
            let shift_len = if opts.shifts > 0 { len + (0.5 * sr as f64) as usize } else { len };
            passes * chunks_per_pass(shift_len, sr, opts.segment.unwrap_or(*seg), opts)
        })
        .sum();
    let mut run = Run { done: 0, total, progress };
    let mut rng = rand::rngs::StdRng::seed_from_u64(opts.seed);
    let mut offsets_given = opts.shift_offsets.clone().unwrap_or_default().into_iter();

    let mut estimates = vec![0f32; nsrc * ch * len];
    let mut totals = vec![0f32; nsrc];
    for (index, (weights, seg)) in bag.weights.iter().zip(&segments).enumerate() {
        let training_length = (*seg * sr as f64) as usize;
        let single = Single { bag, index, training_length, model_segment: *seg };
        let whole = Chunk::whole(&mix.data, ch, len);
        let out = if opts.shifts > 0 {
            let max_shift = (0.5 * sr as f64) as usize;
            let padded = whole.padded(len + 2 * max_shift);
            let plen = len + 2 * max_shift;
            let mut acc = vec![0f32; nsrc * ch * len];
            for _ in 0..opts.shifts {
                let offset = match offsets_given.next() {
                    Some(o) => o.min(max_shift),
                    None => rng.random_range(0..=max_shift),
                };
                let shifted = Chunk::whole(&padded, ch, plen).sub(offset, len + max_shift - offset);
                let res = single.apply_split(shifted, opts, &mut run)?;
                let rlen = len + max_shift - offset;
                let skip = max_shift - offset;
                for row in 0..nsrc * ch {
                    for i in 0..len {
                        acc[row * len + i] += res[row * rlen + skip + i];
                    }
                }
            }
            acc.iter_mut().for_each(|v| *v /= opts.shifts as f32);
            acc
        } else {
            single.apply_split(whole, opts, &mut run)?
        };
        for s in 0..nsrc {
            let w = weights[s];
            for (e, o) in
                estimates[s * ch * len..(s + 1) * ch * len].iter_mut().zip(&out[s * ch * len..(s + 1) * ch * len])
            {
                *e += o * w;
            }
            totals[s] += w;
        }
    }
    for s in 0..nsrc {
        estimates[s * ch * len..(s + 1) * ch * len].iter_mut().for_each(|v| *v /= totals[s]);
    }
    Ok(HostTensor { shape: vec![nsrc, ch, len], data: estimates })
}

struct Single<'m, B: Backend> {
    bag: &'m BagOfModels<B>,
    /// The model's place in the bag.
    index: usize,
    /// `int(model.segment * samplerate)` with the bag's override.
    training_length: usize,
    model_segment: f64,
}

impl<B: Backend> Single<'_, B> {
    /// The `split` branch; returns `[S, C, chunk.length]`.
    fn apply_split(&self, mix: Chunk<'_>, opts: &ApplyOptions, run: &mut Run<'_>) -> Result<Vec<f32>, DemucsError> {
        if !opts.split {
            return self.apply_one(mix, opts, run);
        }
        let cfg = self.bag.models[self.index].config();
        let nsrc = cfg.sources.len();
        let ch = mix.channels;
        let length = mix.length;
        let segment = opts.segment.unwrap_or(self.model_segment);
        let seg_len = (cfg.samplerate as f64 * segment) as usize;
        let stride = ((1.0 - opts.overlap) * seg_len as f64) as usize;
        let half = seg_len / 2;
        let weight: Vec<f64> = (1..=half).chain((1..=seg_len - half).rev()).map(|v| v as f64).collect();
        let wmax = weight.iter().cloned().fold(0.0, f64::max);
        let weight: Vec<f32> = weight.iter().map(|w| ((w / wmax) as f32).powf(opts.transition_power as f32)).collect();
        let mut out = vec![0f32; nsrc * ch * length];
        let mut sum_weight = vec![0f32; length];
        let offsets: Vec<usize> = (0..length).step_by(stride.max(1)).collect();
        // Chunks of one batch must share their padded length.
        // Inputs of one batch share their length: a fixed one only with HTDemucs.
        let as_is = cfg.arch != Arch::HTDemucs || (opts.segment.is_none() && !cfg.use_train_segment);
        let batch = if as_is { 1 } else { opts.batch_size.max(1) };
        for group in offsets.chunks(batch * opts.jobs.max(1)) {
            let chunks: Vec<Chunk<'_>> = group.iter().map(|o| mix.sub(*o, seg_len)).collect();
            let results = self.apply_batch(&chunks, batch, opts, run)?;
            for ((offset, chunk), res) in group.iter().zip(&chunks).zip(results) {
                let clen = chunk.length;
                for row in 0..nsrc * ch {
                    for i in 0..clen {
                        out[row * length + offset + i] += weight[i] * res[row * clen + i];
                    }
                }
                for i in 0..clen {
                    sum_weight[offset + i] += weight[i];
                }
            }
        }
        for row in 0..nsrc * ch {
            for i in 0..length {
                out[row * length + i] /= sum_weight[i];
            }
        }
        Ok(out)
    }

    /// The last branch of `apply_model` on one chunk.
    fn apply_one(&self, mix: Chunk<'_>, opts: &ApplyOptions, run: &mut Run<'_>) -> Result<Vec<f32>, DemucsError> {
        Ok(self.apply_batch(&[mix], 1, opts, run)?.remove(0))
    }

    /// The last branch of `apply_model` on several chunks at once: pad each to the
    /// valid length, run them in batches of `batch` (batches on parallel threads),
    /// centre-trim; one progress tick per chunk.
    fn apply_batch(
        &self,
        chunks: &[Chunk<'_>],
        batch: usize,
        opts: &ApplyOptions,
        run: &mut Run<'_>,
    ) -> Result<Vec<Vec<f32>>, DemucsError> {
        let cfg = self.bag.models[self.index].config();
        let ch = chunks[0].channels;
        let mut inputs = Vec::new();
        for group in chunks.chunks(batch.max(1)) {
            let mut valid_length = 0;
            let mut input = Vec::new();
            for mix in group {
                let length = mix.length;
                valid_length = match opts.segment {
                    // Hybrid Demucs has no valid length: each chunk goes in as it is.
                    _ if cfg.arch == Arch::HDemucs => length,
                    // The waveform Demucs: its `valid_length`, real audio around the chunk.
                    _ if cfg.arch == Arch::Demucs => crate::wave::valid_length(cfg, length),
                    Some(s) => (s * cfg.samplerate as f64) as usize,
                    None if cfg.use_train_segment => {
                        if length > self.training_length {
                            return Err(DemucsError::InvalidArgument(format!(
                                "given length {length} is longer than the training length {}",
                                self.training_length
                            )));
                        }
                        self.training_length
                    }
                    None => length,
                };
                input.extend(mix.padded(valid_length));
            }
            inputs.push(HostTensor { shape: vec![group.len(), ch, valid_length], data: input });
        }
        let outs = self.bag.forward(self.index, inputs, self.training_length)?;
        // center_trim each to its length.
        let nrows = cfg.sources.len() * ch;
        let mut results = Vec::with_capacity(chunks.len());
        let per_chunk = outs.iter().flat_map(|o| (0..o.shape[0]).map(move |bi| (o, bi)));
        for ((out, bi), mix) in per_chunk.zip(chunks) {
            let length = mix.length;
            let valid_length = out.shape[3];
            let start = (valid_length - length) / 2;
            let mut trimmed = Vec::with_capacity(nrows * length);
            for row in bi * nrows..(bi + 1) * nrows {
                trimmed.extend_from_slice(&out.data[row * valid_length + start..row * valid_length + start + length]);
            }
            results.push(trimmed);
            run.tick()?;
        }
        Ok(results)
    }
}

/// `--two-stems STEM` with `--other-method`: the selected stem and, for `add`, the sum
/// of the others (`no_STEM`), for `minus`, the mix minus the stem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtherMethod {
    /// No second stem.
    None,
    /// Sum of the other stems.
    Add,
    /// Original minus the stem.
    Minus,
}

/// Turns `[S, C, L]` sources into `(name, [C, L])` stems for two-stem output.
pub fn two_stems(
    sources: &[String],
    separated: &HostTensor,
    original: &HostTensor,
    stem: &str,
    method: OtherMethod,
) -> Result<Vec<(String, HostTensor)>, DemucsError> {
    let idx = sources
        .iter()
        .position(|s| s == stem)
        .ok_or_else(|| DemucsError::InvalidArgument(format!("stem `{stem}` is not one of {sources:?}")))?;
    let (ch, len) = (separated.shape[1], separated.shape[2]);
    let n = ch * len;
    let row = |s: usize| separated.data[s * n..(s + 1) * n].to_vec();
    let mut out = vec![(stem.to_string(), HostTensor { shape: vec![ch, len], data: row(idx) })];
    match method {
        OtherMethod::None => {}
        OtherMethod::Add => {
            let mut acc = vec![0f32; n];
            for s in (0..sources.len()).filter(|s| *s != idx) {
                for (a, v) in acc.iter_mut().zip(row(s)) {
                    *a += v;
                }
            }
            out.push((format!("no_{stem}"), HostTensor { shape: vec![ch, len], data: acc }));
        }
        OtherMethod::Minus => {
            let data = original.data.iter().zip(row(idx)).map(|(o, s)| o - s).collect();
            out.push((format!("minus_{stem}"), HostTensor { shape: vec![ch, len], data }));
        }
    }
    Ok(out)
}
