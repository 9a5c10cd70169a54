//! Owns the `dsp` separation engine: a real, weight-free **baseline**
//! separator into vocals / drums / bass / other, streamed with bounded memory.
//!
//! This is classic signal processing, not a neural model. Expect clearly
//! audible bleed between stems on real music; it exists so the service works
//! end to end without model weights, and as a floor that the neural engines
//! must beat.
//!
//! # Method
//! A short-time Fourier transform (4096-sample √Hann window, hop 1024, 75 %
//! overlap) of both channels. For each time-frequency bin:
//! * **harmonic/percussive split** (Fitzgerald-style HPSS): the mid magnitude
//!   `M = √((|L|²+|R|²)/2)` is median-filtered along time (17 frames ≈ 0.4 s:
//!   the harmonic estimate `Ĥ`) and along frequency (17 bins ≈ 180 Hz: the
//!   percussive estimate `P̂`); soft Wiener-like masks `h = Ĥ²/(Ĥ²+P̂²)`,
//!   `p = 1 − h`;
//! * **centre detection**: `c = 2·Re(L·R̄)/(|L|²+|R|²)` is 1 only when L and R
//!   agree in both magnitude and phase; the soft centre mask ramps from 0 at
//!   `c ≤ 0.6` to 1 at `c ≥ 0.95` (smoothstep);
//! * a smooth **crossover** `lp(f) = 1/(1+(f/150 Hz)⁴)`, `hp = 1 − lp`.
//!
//! Masks (applied to both channels' complex spectra):
//! * drums  = `p`
//! * vocals = `h · centre · hp`  (harmonic, centred, above the bass band)
//! * bass   = `h · lp · (1 − centre · hp)`  (low band of the non-vocal harmonic part)
//! * other  = **mixture − vocals − drums − bass in the time domain**, so the
//!   four stems sum back to the input by construction (to float rounding).
//!
//! With `two_stems: Some(s)` the output is `s` and its complement `mixture − s`,
//! named as Demucs names it: `no_s` for `other_method` `add` (the sum of the other
//! stems, which here is exactly the mixture minus `s`, as the stems sum to the
//! mixture), `minus_s` for `minus`, and nothing for `none`.
//!
//! # Streaming
//! [`DspSeparator::push`] accepts chunks of any size; the STFT frames, the
//! ring of 17 frames for the time median, and the overlap-add buffers are the
//! only state, so memory is constant and the output is bit-identical whatever
//! the chunking (there are no seams: chunk boundaries are invisible to the
//! frame grid). Latency is `4096 − 1024 + 8·1024` samples; [`DspSeparator::finish`]
//! flushes it and trims the output to exactly the input length.
//!
//! # Measured quality (synthetic test mixture, `tests/separation.rs`)
//! 12 s mixture of a centred voice-like tone (vibrato, 10 harmonics), panned
//! noise-burst hits plus a centred kick, a centred bass line and a wide
//! detuned pad. SDR in dB, `10·log10(|s|²/|s−ŝ|²)` over both channels:
//!
//! | stem   | dsp SDR | mixture-as-estimate | improvement | asserted |
//! |--------|--------:|--------------------:|------------:|---------:|
//! | vocals |  10.36  |  −7.60              |  +17.97     |  > 16.0  |
//! | drums  |   5.70  |  −9.60              |  +15.31     |  > 13.5  |
//! | bass   |  12.32  |   4.40              |   +7.91     |  >  6.5  |
//! | other  |   3.27  | −17.11              |  +20.38     |  > 18.5  |
//!
//! These figures say the engine does what it is designed to do on signals
//! that fit its assumptions; they say nothing about real songs.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use realfft::num_complex::Complex32;
use realfft::{ComplexToReal, RealFftPlanner, RealToComplex};

use stemq_core::request::OtherMethod;

use crate::chunk::StereoChunk;
use crate::decode::{DecodeOptions, Decoder};
use crate::encode::{summarize_file, ClipMode, FileSummary, OutputFormat, StemEncoder};
use crate::error::AudioError;

/// STFT window length in samples.
pub const FFT_SIZE: usize = 4096;
/// STFT hop in samples.
pub const HOP: usize = 1024;
const BINS: usize = FFT_SIZE / 2 + 1;
/// Half-length of the time median (frames each side).
const TIME_HALF: usize = 8;
/// Half-length of the frequency median (bins each side).
const FREQ_HALF: usize = 8;
const CROSSOVER_HZ: f32 = 150.0;
const CENTRE_LO: f32 = 0.6;
const CENTRE_HI: f32 = 0.95;

/// One of the four stems.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stem {
    /// Singing voice.
    Vocals,
    /// Percussion.
    Drums,
    /// Bass line.
    Bass,
    /// Everything else.
    Other,
}

impl Stem {
    /// All stems in output order.
    pub const ALL: [Stem; 4] = [Stem::Vocals, Stem::Drums, Stem::Bass, Stem::Other];

    /// Lower-case name, as used in file names (`"vocals"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Stem::Vocals => "vocals",
            Stem::Drums => "drums",
            Stem::Bass => "bass",
            Stem::Other => "other",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Options of the `dsp` engine.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DspOptions {
    /// `Some(stem)`: output only `stem` and its complement (mixture minus it).
    pub two_stems: Option<Stem>,
    /// With `two_stems`: the complement's name (`no_<stem>` for `add`, `minus_<stem>`
    /// for `minus`, as Demucs names them), or no complement (`none`).
    #[serde(default)]
    pub other_method: OtherMethod,
}

impl DspOptions {
    /// Names of the output stems in the order [`DspSeparator`] returns them.
    pub fn stem_names(&self) -> Vec<String> {
        match (self.two_stems, self.other_method) {
            (None, _) => Stem::ALL.iter().map(|s| s.name().to_string()).collect(),
            (Some(s), OtherMethod::None) => vec![s.name().to_string()],
            (Some(s), OtherMethod::Minus) => vec![s.name().to_string(), format!("minus_{}", s.name())],
            (Some(s), OtherMethod::Add) => vec![s.name().to_string(), format!("no_{}", s.name())],
        }
    }
}

struct Frame {
    l: Vec<Complex32>,
    r: Vec<Complex32>,
    mag: Vec<f32>,
}

impl Frame {
    fn zero() -> Self {
        Frame { l: vec![Complex32::new(0.0, 0.0); BINS], r: vec![Complex32::new(0.0, 0.0); BINS], mag: vec![0.0; BINS] }
    }
}

fn median(v: &mut [f32]) -> f32 {
    let mid = v.len() / 2;
    let (_, m, _) = v.select_nth_unstable_by(mid, |a, b| a.total_cmp(b));
    *m
}

fn smoothstep(x: f32) -> f32 {
    let t = x.clamp(0.0, 1.0);
    t * t * (3.0 - 2.0 * t)
}

/// The streamed separator. Feed chunks with [`push`](Self::push), then call
/// [`finish`](Self::finish); every call returns one chunk per output stem
/// (see [`DspOptions::stem_names`]), all of equal length.
pub struct DspSeparator {
    opts: DspOptions,
    fwd: Arc<dyn RealToComplex<f32>>,
    inv: Arc<dyn ComplexToReal<f32>>,
    window: Vec<f32>,
    lowpass: Vec<f32>,
    /// Analysis FIFO of the zero-prefixed input, per channel.
    pending: [Vec<f32>; 2],
    /// Mixture samples waiting for their separated counterparts.
    mix_delay: [VecDeque<f32>; 2],
    frames: VecDeque<Frame>,
    spare: Vec<Frame>,
    /// Overlap-add accumulators: [stem 0..3][channel].
    ola: [[Vec<f32>; 2]; 3],
    time_buf: Vec<f32>,
    spec_buf: Vec<Complex32>,
    scratch_fwd: Vec<Complex32>,
    scratch_inv: Vec<Complex32>,
    to_skip: usize,
    in_total: u64,
    out_total: u64,
    finished: bool,
}

impl DspSeparator {
    /// A separator for 44.1 kHz stereo input (other rates work; the crossover
    /// and medians are then scaled in bins, not Hz).
    pub fn new(opts: DspOptions) -> Self {
        let mut planner = RealFftPlanner::<f32>::new();
        let fwd = planner.plan_fft_forward(FFT_SIZE);
        let inv = planner.plan_fft_inverse(FFT_SIZE);
        let window: Vec<f32> = (0..FFT_SIZE)
            .map(|n| {
                let hann = 0.5 - 0.5 * (2.0 * std::f64::consts::PI * n as f64 / FFT_SIZE as f64).cos();
                hann.sqrt() as f32
            })
            .collect();
        let lowpass = (0..BINS)
            .map(|k| {
                let f = k as f32 * 44_100.0 / FFT_SIZE as f32;
                1.0 / (1.0 + (f / CROSSOVER_HZ).powi(4))
            })
            .collect();
        let prefix = FFT_SIZE - HOP;
        let mut frames = VecDeque::with_capacity(2 * TIME_HALF + 2);
        for _ in 0..TIME_HALF {
            frames.push_back(Frame::zero());
        }
        let scratch_fwd = fwd.make_scratch_vec();
        let scratch_inv = inv.make_scratch_vec();
        DspSeparator {
            opts,
            fwd,
            inv,
            window,
            lowpass,
            pending: [vec![0.0; prefix], vec![0.0; prefix]],
            mix_delay: [VecDeque::from(vec![0.0; prefix]), VecDeque::from(vec![0.0; prefix])],
            frames,
            spare: Vec::new(),
            ola: std::array::from_fn(|_| [vec![0.0; FFT_SIZE], vec![0.0; FFT_SIZE]]),
            time_buf: vec![0.0; FFT_SIZE],
            spec_buf: vec![Complex32::new(0.0, 0.0); BINS],
            scratch_fwd,
            scratch_inv,
            to_skip: prefix,
            in_total: 0,
            out_total: 0,
            finished: false,
        }
    }

    /// Names of the output stems, in output order.
    pub fn stem_names(&self) -> Vec<String> {
        self.opts.stem_names()
    }

    /// Input frames still held inside the separator (its latency).
    pub fn latency_frames() -> usize {
        FFT_SIZE - HOP + TIME_HALF * HOP
    }

    fn empty_outputs(&self) -> Vec<StereoChunk> {
        vec![StereoChunk::default(); self.opts.stem_names().len()]
    }

    /// Feeds a chunk; returns the separated samples that became final.
    pub fn push(&mut self, chunk: &StereoChunk) -> Vec<StereoChunk> {
        assert!(!self.finished, "push after finish");
        let mut out = self.empty_outputs();
        self.in_total += chunk.len() as u64;
        self.feed(&chunk.left, &chunk.right, &mut out);
        out
    }

    /// Flushes the latency; the total output then equals the total input.
    pub fn finish(&mut self) -> Vec<StereoChunk> {
        let mut out = self.empty_outputs();
        if self.finished {
            return out;
        }
        self.finished = true;
        let zeros = vec![0.0f32; HOP];
        while self.out_total < self.in_total {
            self.feed(&zeros, &zeros, &mut out);
        }
        out
    }

    fn feed(&mut self, left: &[f32], right: &[f32], out: &mut [StereoChunk]) {
        let mut offset = 0;
        while offset < left.len() {
            let room = FFT_SIZE - self.pending[0].len();
            let take = room.min(left.len() - offset);
            self.pending[0].extend_from_slice(&left[offset..offset + take]);
            self.pending[1].extend_from_slice(&right[offset..offset + take]);
            self.mix_delay[0].extend(&left[offset..offset + take]);
            self.mix_delay[1].extend(&right[offset..offset + take]);
            offset += take;
            if self.pending[0].len() == FFT_SIZE {
                self.analyse();
                self.pending[0].drain(..HOP);
                self.pending[1].drain(..HOP);
                if self.frames.len() == 2 * TIME_HALF + 1 {
                    self.synthesise(out);
                    let f = self.frames.pop_front().expect("non-empty");
                    self.spare.push(f);
                }
            }
        }
    }

    fn analyse(&mut self) {
        let mut frame = self.spare.pop().unwrap_or_else(Frame::zero);
        for ch in 0..2 {
            for (t, (&x, &w)) in self.time_buf.iter_mut().zip(self.pending[ch].iter().zip(&self.window)) {
                *t = x * w;
            }
            let dst = if ch == 0 { &mut frame.l } else { &mut frame.r };
            self.fwd.process_with_scratch(&mut self.time_buf, dst, &mut self.scratch_fwd).expect("FFT sizes are fixed");
        }
        for k in 0..BINS {
            frame.mag[k] = ((frame.l[k].norm_sqr() + frame.r[k].norm_sqr()) * 0.5).sqrt();
        }
        self.frames.push_back(frame);
    }

    #[allow(clippy::needless_range_loop)] // per-bin work indexes several arrays at once
    fn synthesise(&mut self, out: &mut [StereoChunk]) {
        let cur = &self.frames[TIME_HALF];
        // Masks for the three masked stems: vocals, drums, bass.
        let mut masks = [vec![0.0f32; BINS], vec![0.0f32; BINS], vec![0.0f32; BINS]];
        let mut tvals = [0.0f32; 2 * TIME_HALF + 1];
        let mut fvals = [0.0f32; 2 * FREQ_HALF + 1];
        for k in 0..BINS {
            for (v, f) in tvals.iter_mut().zip(self.frames.iter()) {
                *v = f.mag[k];
            }
            let h = median(&mut tvals);
            let lo = k.saturating_sub(FREQ_HALF);
            let hi = (k + FREQ_HALF).min(BINS - 1);
            let n = hi - lo + 1;
            fvals[..n].copy_from_slice(&cur.mag[lo..=hi]);
            let p = median(&mut fvals[..n]);
            let (h2, p2) = (h * h, p * p);
            let mh = if h2 + p2 > 0.0 { h2 / (h2 + p2) } else { 0.5 };
            let mp = 1.0 - mh;
            let (l, r) = (cur.l[k], cur.r[k]);
            let energy = l.norm_sqr() + r.norm_sqr();
            let sim = if energy > 0.0 { 2.0 * (l * r.conj()).re / energy } else { 0.0 };
            let centre = smoothstep((sim - CENTRE_LO) / (CENTRE_HI - CENTRE_LO));
            let lp = self.lowpass[k];
            let hp = 1.0 - lp;
            masks[0][k] = mh * centre * hp;
            masks[1][k] = mp;
            masks[2][k] = mh * lp * (1.0 - centre * hp);
        }
        let scale = 1.0 / (FFT_SIZE as f32 * 2.0);
        for (s, mask) in masks.iter().enumerate() {
            for ch in 0..2 {
                let src = if ch == 0 { &cur.l } else { &cur.r };
                for ((d, &x), &m) in self.spec_buf.iter_mut().zip(src).zip(mask) {
                    *d = x * m;
                }
                self.spec_buf[0].im = 0.0;
                self.spec_buf[BINS - 1].im = 0.0;
                self.inv
                    .process_with_scratch(&mut self.spec_buf, &mut self.time_buf, &mut self.scratch_inv)
                    .expect("FFT sizes are fixed");
                let acc = &mut self.ola[s][ch];
                for ((a, &t), &w) in acc.iter_mut().zip(&self.time_buf).zip(&self.window) {
                    *a += t * w * scale;
                }
            }
        }
        self.emit_hop(out);
    }

    /// Emits the first HOP samples of the accumulators, which are now final.
    #[allow(clippy::needless_range_loop)]
    fn emit_hop(&mut self, out: &mut [StereoChunk]) {
        for i in 0..HOP {
            let m = [
                self.mix_delay[0].pop_front().expect("mixture delay holds the hop"),
                self.mix_delay[1].pop_front().expect("mixture delay holds the hop"),
            ];
            if self.to_skip > 0 {
                self.to_skip -= 1;
                continue;
            }
            if self.out_total >= self.in_total {
                continue;
            }
            self.out_total += 1;
            for ch in 0..2 {
                let v = self.ola[0][ch][i];
                let d = self.ola[1][ch][i];
                let b = self.ola[2][ch][i];
                let o = m[ch] - v - d - b;
                let vals = match self.opts.two_stems {
                    None => [v, d, b, o],
                    Some(stem) => {
                        let s = [v, d, b, o][stem.index()];
                        [s, m[ch] - s, 0.0, 0.0]
                    }
                };
                for (c, &x) in out.iter_mut().zip(&vals) {
                    if ch == 0 {
                        c.left.push(x);
                    } else {
                        c.right.push(x);
                    }
                }
            }
        }
        for stem in &mut self.ola {
            for acc in stem.iter_mut() {
                acc.copy_within(HOP.., 0);
                acc[FFT_SIZE - HOP..].fill(0.0);
            }
        }
    }
}

/// One written stem file.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StemOutput {
    /// Stem name (`"vocals"`, `"no_vocals"`, `"minus_vocals"`, ...).
    pub name: String,
    /// Where the file was written.
    pub path: PathBuf,
    /// Hash, size and duration of the file.
    pub summary: FileSummary,
}

/// How [`separate_file`] writes its stems.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EncodeSettings {
    /// File format of every stem.
    pub format: OutputFormat,
    /// Clip handling of every stem.
    pub clip: ClipMode,
}

/// Decodes `input`, separates it with the `dsp` engine and writes one file
/// per stem into `out_dir` (`<stem>.<ext>`), chunk by chunk.
///
/// `progress` receives the fraction done (0..=1) after each chunk when the
/// input's length is known, and 1.0 at the end. `cancel` is polled between
/// chunks; when it returns true the partial files are removed and
/// [`AudioError::Cancelled`] is returned. Any error also removes them.
pub fn separate_file(
    input: &Path,
    out_dir: &Path,
    decode: &DecodeOptions,
    opts: &DspOptions,
    encode: EncodeSettings,
    progress: &mut dyn FnMut(f32),
    cancel: &dyn Fn() -> bool,
) -> Result<Vec<StemOutput>, AudioError> {
    let names = opts.stem_names();
    let paths: Vec<PathBuf> =
        names.iter().map(|n| out_dir.join(format!("{n}.{}", encode.format.extension()))).collect();
    let result = separate_into(input, &paths, decode, opts, encode, progress, cancel);
    match result {
        Ok(()) => {
            let mut outs = Vec::with_capacity(paths.len());
            for (name, path) in names.into_iter().zip(paths) {
                let summary = summarize_file(&path)?;
                outs.push(StemOutput { name, path, summary });
            }
            Ok(outs)
        }
        Err(e) => {
            for p in &paths {
                let _ = std::fs::remove_file(p);
            }
            Err(e)
        }
    }
}

fn separate_into(
    input: &Path,
    paths: &[PathBuf],
    decode: &DecodeOptions,
    opts: &DspOptions,
    encode: EncodeSettings,
    progress: &mut dyn FnMut(f32),
    cancel: &dyn Fn() -> bool,
) -> Result<(), AudioError> {
    let mut decoder = Decoder::open_path(input, decode.clone())?;
    let rate = decoder.output_sample_rate();
    let total = decoder.info().frames;
    let mut encoders = paths
        .iter()
        .map(|p| StemEncoder::create(p, encode.format, encode.clip, rate))
        .collect::<Result<Vec<_>, _>>()?;
    let mut sep = DspSeparator::new(opts.clone());
    progress(0.0);
    while let Some(chunk) = decoder.next_chunk()? {
        if cancel() {
            return Err(AudioError::Cancelled);
        }
        let stems = sep.push(&chunk);
        for (enc, s) in encoders.iter_mut().zip(&stems) {
            enc.write(s)?;
        }
        if let Some(total) = total {
            progress((decoder.decoded_frames() as f64 / total.max(1) as f64).min(0.99) as f32);
        }
    }
    if cancel() {
        return Err(AudioError::Cancelled);
    }
    let stems = sep.finish();
    for (enc, s) in encoders.iter_mut().zip(&stems) {
        enc.write(s)?;
    }
    for enc in encoders {
        enc.finish()?;
    }
    progress(1.0);
    Ok(())
}
