//! [`separate`](crate::apply::separate) with bounded memory: the same arithmetic as
//! `apply_model` (bags, shifts, segments with overlap and triangular weights), fed by a
//! stream of input blocks and emitting finished output samples as soon as no later
//! chunk overlaps them.
//!
//! Each (model, shift) is a *pass* over a virtual signal `zeros(k) ++ mix` (`k = 0`
//! without shifts, `max_shift − offset` with one: exactly what `TensorChunk.padded`
//! reads from the zero-padded mix), whose first `k` output samples are dropped. Passes
//! advance in lockstep; a sample is emitted once every pass has finished it. Memory is a
//! few segments per pass, whatever the track length.
//!
//! The whole-track normalisation needs the reference mean/std first: collect them with
//! [`StatsAccumulator`] on a first pass over the input.

use std::collections::VecDeque;

use burn::tensor::backend::Backend;
use rand::{Rng, SeedableRng};

use crate::apply::{ApplyOptions, BagOfModels, Progress};
use crate::checkpoint::HostTensor;
use crate::config::Arch;
use crate::error::DemucsError;
use crate::model::HTDemucs;

/// Whole-track statistics of the channel-mean reference signal.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrackStats {
    /// `ref.mean()`.
    pub mean: f64,
    /// `ref.std() + 1e-8` (unbiased).
    pub std: f64,
    /// Samples per channel.
    pub length: usize,
}

/// Welford accumulation of [`TrackStats`] over stereo blocks.
#[derive(Debug, Clone, Default)]
pub struct StatsAccumulator {
    n: usize,
    mean: f64,
    m2: f64,
}

impl StatsAccumulator {
    /// Adds planar channels (all the same length).
    pub fn push(&mut self, channels: &[&[f32]]) {
        let len = channels[0].len();
        for i in 0..len {
            let r = channels.iter().map(|c| c[i] as f64).sum::<f64>() / channels.len() as f64;
            self.n += 1;
            let d = r - self.mean;
            self.mean += d / self.n as f64;
            self.m2 += d * (r - self.mean);
        }
    }

    /// The statistics.
    pub fn finish(&self) -> TrackStats {
        let var = if self.n > 1 { self.m2 / (self.n as f64 - 1.0) } else { 0.0 };
        TrackStats { mean: self.mean, std: var.sqrt() + 1e-8, length: self.n }
    }
}

struct Pass<'m, B: Backend> {
    model: &'m HTDemucs<B>,
    /// The model's place in the bag.
    index: usize,
    training_length: usize,
    seg_len: usize,
    stride: usize,
    valid_length: usize,
    /// Each chunk goes in as it is, at its own length (Hybrid Demucs: no valid length).
    as_is: bool,
    weight: Vec<f32>,
    /// Per source: bag weight / (shifts · total weight of the source).
    scale: Vec<f32>,
    /// Leading zeros of the virtual signal.
    k: usize,
    /// Virtual length `k + L`.
    lv: usize,
    /// Next chunk offset (virtual coordinates).
    next: usize,
    /// First virtual sample not yet finished.
    fin: usize,
    acc: Vec<VecDeque<f32>>,
    sum_weight: VecDeque<f32>,
    /// Finished samples in mix coordinates, already scaled, per row `[S·C]`.
    out: Vec<VecDeque<f32>>,
}

impl<B: Backend> Pass<'_, B> {
    fn done(&self) -> bool {
        self.next >= self.lv
    }

    /// Mix range `[start, end)` the next chunk reads (clipped to the track).
    fn next_read(&self, len: usize) -> (isize, usize) {
        self.read_at(self.next, len)
    }

    /// Mix range `[start, end)` read by the chunk at virtual offset `o`.
    fn read_at(&self, o: usize, len: usize) -> (isize, usize) {
        let clen = self.seg_len.min(self.lv - o);
        let valid = self.valid_for(clen);
        let start = o as isize - ((valid - clen) / 2) as isize - self.k as isize;
        let end = (start + valid as isize).clamp(0, len as isize) as usize;
        (start, end)
    }

    /// The length a chunk of `clen` samples is fed to the model at.
    fn valid_for(&self, clen: usize) -> usize {
        let cfg = self.model.config();
        if cfg.arch == Arch::Demucs {
            crate::wave::valid_length(cfg, clen)
        } else if self.as_is {
            clen
        } else {
            self.valid_length
        }
    }
}

/// Separates a stream. `next_block` yields planar blocks `[C][n]` of the *raw* mix (in
/// order, any sizes) and `None` at the end; `sink` receives finished `[S, C, n]` blocks
/// in order, de-normalised. Equivalent to [`crate::apply::separate`] on the whole track.
pub fn separate_stream<B: Backend>(
    bag: &BagOfModels<B>,
    stats: TrackStats,
    next_block: &mut dyn FnMut() -> Result<Option<Vec<Vec<f32>>>, DemucsError>,
    opts: &ApplyOptions,
    progress: &mut dyn Progress,
    sink: &mut dyn FnMut(HostTensor) -> Result<(), DemucsError>,
) -> Result<(), DemucsError> {
    let len = stats.length;
    let ch = bag.audio_channels();
    let nsrc = bag.sources().len();
    let rows = nsrc * ch;
    let sr = bag.samplerate();
    if len == 0 {
        return Err(DemucsError::InvalidArgument("empty input".into()));
    }
    if let Some(s) = opts.segment {
        if s.is_nan() || s <= 0.0 || s > bag.max_allowed_segment() {
            return Err(DemucsError::InvalidArgument(format!(
                "segment {s} s is not in (0, {}] (the trained segment)",
                bag.max_allowed_segment()
            )));
        }
    }
    if !opts.split {
        return Err(DemucsError::Unsupported("streaming needs split = true".into()));
    }
    let shifts = opts.shifts.max(1);
    let max_shift = (0.5 * sr as f64) as usize;
    let mut rng = rand::rngs::StdRng::seed_from_u64(opts.seed);
    let mut given = opts.shift_offsets.clone().unwrap_or_default().into_iter();
    let mut totals = vec![0f32; nsrc];
    for w in &bag.weights {
        for (t, v) in totals.iter_mut().zip(w) {
            *t += v;
        }
    }

    let mut passes = Vec::new();
    let segments = bag.training_segments(opts);
    for (index, ((model, weights), seg)) in bag.models.iter().zip(&bag.weights).zip(&segments).enumerate() {
        let cfg = model.config();
        let training_length = (*seg * sr as f64) as usize;
        let segment = opts.segment.unwrap_or(*seg);
        let seg_len = (sr as f64 * segment) as usize;
        let stride = (((1.0 - opts.overlap) * seg_len as f64) as usize).max(1);
        // apply_model's last branch: HTDemucs pads each chunk to the segment asked for,
        // or its training length; Hybrid Demucs takes the chunk as it is.
        let as_is = cfg.arch == Arch::HDemucs || (opts.segment.is_none() && !cfg.use_train_segment);
        let valid_length = match opts.segment {
            _ if as_is => seg_len,
            Some(s) => (s * sr as f64) as usize,
            None => training_length,
        };
        let half = seg_len / 2;
        let tri: Vec<f64> = (1..=half).chain((1..=seg_len - half).rev()).map(|v| v as f64).collect();
        let wmax = tri.iter().cloned().fold(0.0, f64::max);
        let weight: Vec<f32> = tri.iter().map(|w| ((w / wmax) as f32).powf(opts.transition_power as f32)).collect();
        let scale: Vec<f32> = (0..nsrc).map(|s| weights[s] / (shifts as f32 * totals[s])).collect();
        for _ in 0..shifts {
            let k = if opts.shifts == 0 {
                0
            } else {
                let offset = match given.next() {
                    Some(o) => o.min(max_shift),
                    None => rng.random_range(0..=max_shift),
                };
                max_shift - offset
            };
            passes.push(Pass {
                model,
                index,
                training_length,
                seg_len,
                stride,
                valid_length,
                as_is,
                weight: weight.clone(),
                scale: scale.clone(),
                k,
                lv: k + len,
                next: 0,
                fin: 0,
                acc: vec![VecDeque::new(); rows],
                sum_weight: VecDeque::new(),
                out: vec![VecDeque::new(); rows],
            });
        }
    }
    let total_chunks: usize = passes.iter().map(|p| p.lv.div_ceil(p.stride)).sum();
    let mut done_chunks = 0usize;

    // Normalised input window: mix samples [base, base + buf[0].len()).
    let mut base = 0usize;
    let mut buf: Vec<Vec<f32>> = vec![Vec::new(); ch];
    let mut eof = false;
    let (mean, std) = (stats.mean, stats.std);

    loop {
        // Run every chunk whose input is available.
        let available = base + buf[0].len();
        let group_max = opts.batch_size.max(1) * opts.jobs.max(1);
        for p in passes.iter_mut() {
            loop {
                // The chunks whose input is available, up to one round of batches.
                let mut ready = Vec::new();
                let mut o = p.next;
                while o < p.lv && ready.len() < group_max {
                    let (start, end) = p.read_at(o, len);
                    if end > available && !eof {
                        break;
                    }
                    ready.push((o, start, p.seg_len.min(p.lv - o)));
                    o += p.stride;
                }
                // Wait for a full round while more input can come: a round of one chunk
                // would leave the other jobs' threads idle.
                if ready.is_empty() || (ready.len() < group_max && !eof) {
                    break;
                }
                let mut inputs = Vec::new();
                // A batch shares one input length: chunks fed as they are (the last one
                // may be shorter) batch only with chunks of their length.
                let mut groups: Vec<&[(usize, isize, usize)]> = Vec::new();
                let mut from = 0;
                for i in 1..=ready.len() {
                    let split = i == ready.len()
                        || i - from == opts.batch_size.max(1)
                        || p.valid_for(ready[i].2) != p.valid_for(ready[from].2);
                    if split {
                        groups.push(&ready[from..i]);
                        from = i;
                    }
                }
                for group in groups {
                    let valid = p.valid_for(group[0].2);
                    let mut input = vec![0f32; group.len() * ch * valid];
                    for (bi, (_, start, _)) in group.iter().enumerate() {
                        for c in 0..ch {
                            let dst = &mut input[(bi * ch + c) * valid..(bi * ch + c + 1) * valid];
                            for (i, d) in dst.iter_mut().enumerate() {
                                let m = start + i as isize;
                                if m >= 0 && (m as usize) < len {
                                    *d = buf[c][m as usize - base];
                                }
                            }
                        }
                    }
                    inputs.push(HostTensor { shape: vec![group.len(), ch, valid], data: input });
                }
                let outs = bag.forward(p.index, inputs, p.training_length)?;
                let per_chunk = outs.iter().flat_map(|o| (0..o.shape[0]).map(move |bi| (o, bi)));
                for ((out, bi), (o, _, clen)) in per_chunk.zip(ready) {
                    debug_assert_eq!(o, p.next);
                    let valid = out.shape[3];
                    let trim = (valid - clen) / 2;
                    let rel = p.next - p.fin;
                    while p.sum_weight.len() < rel + clen {
                        p.sum_weight.push_back(0.0);
                        for a in p.acc.iter_mut() {
                            a.push_back(0.0);
                        }
                    }
                    for (r, a) in p.acc.iter_mut().enumerate() {
                        let at = (bi * rows + r) * valid + trim;
                        let row = &out.data[at..at + clen];
                        for i in 0..clen {
                            a[rel + i] += p.weight[i] * row[i];
                        }
                    }
                    for i in 0..clen {
                        p.sum_weight[rel + i] += p.weight[i];
                    }
                    p.next += p.stride;
                    let new_fin = p.next.min(p.lv);
                    for _ in p.fin..new_fin {
                        let sw = p.sum_weight.pop_front().unwrap_or(1.0);
                        let keep = p.fin >= p.k;
                        for (r, a) in p.acc.iter_mut().enumerate() {
                            let v = a.pop_front().unwrap_or(0.0) / sw;
                            if keep {
                                p.out[r].push_back(v * p.scale[r / ch]);
                            }
                        }
                        p.fin += 1;
                    }
                    done_chunks += 1;
                    progress.chunk_done(done_chunks as f32 / total_chunks.max(1) as f32);
                    if progress.cancelled() {
                        return Err(DemucsError::Cancelled);
                    }
                }
            }
        }
        // Emit what every pass has finished.
        let n = passes.iter().map(|p| p.out[0].len()).min().unwrap_or(0);
        if n > 0 {
            let mut block = vec![0f32; rows * n];
            for p in passes.iter_mut() {
                for (r, q) in p.out.iter_mut().enumerate() {
                    for (i, v) in q.drain(..n).enumerate() {
                        block[r * n + i] += v;
                    }
                }
            }
            for v in block.iter_mut() {
                *v = (*v as f64 * std + mean) as f32;
            }
            sink(HostTensor { shape: vec![nsrc, ch, n], data: block })?;
        }
        if passes.iter().all(|p| p.done()) {
            return Ok(());
        }
        // Drop input no pass will read again.
        let keep_from =
            passes.iter().filter(|p| !p.done()).map(|p| p.next_read(len).0.max(0) as usize).min().unwrap_or(available);
        if keep_from > base {
            let drop = (keep_from - base).min(buf[0].len());
            for b in buf.iter_mut() {
                b.drain(..drop);
            }
            base += drop;
        }
        // More input.
        match next_block()? {
            Some(block) => {
                if block.len() != ch {
                    return Err(DemucsError::InvalidArgument(format!("blocks must have {ch} channels")));
                }
                for (b, c) in buf.iter_mut().zip(block) {
                    b.extend(c.into_iter().map(|v| ((v as f64 - mean) / std) as f32));
                }
            }
            None => {
                eof = true;
                if base + buf[0].len() != len {
                    return Err(DemucsError::InvalidArgument(format!(
                        "the stream has {} samples, the statistics say {len}",
                        base + buf[0].len()
                    )));
                }
            }
        }
    }
}
