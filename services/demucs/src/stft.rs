//! Port of `HTDemucs._spec` / `HTDemucs._ispec` with `demucs.spec.spectro` /
//! `ispectro` (`torch.stft` / `torch.istft` with a periodic Hann window,
//! `normalized=True`, `center=True`, reflect padding), computed on the host in `f64`
//! with `realfft`.
//!
//! `spec`: `[L]` → complex `[F = nfft/2, T = ceil(L / hop)]`: reflect-pad
//! `(3·hop/2, 3·hop/2 + T·hop − L)`, STFT (which reflect-pads nfft/2 more), drop the
//! Nyquist bin, keep frames `2..2+T`.
//!
//! `ispec`: complex `[F, T]` → `[length]`: add a zero Nyquist bin and two zero frames
//! each side, iSTFT to `hop·ceil(length/hop) + 3·hop`, keep `[3·hop/2, 3·hop/2 + length)`.

use std::sync::Arc;

use realfft::num_complex::Complex;
use realfft::{ComplexToReal, RealFftPlanner, RealToComplex};

use crate::error::DemucsError;

/// A planned STFT pair for one `nfft` (hop = nfft / 4).
pub struct Stft {
    nfft: usize,
    window: Vec<f64>,
    forward: Arc<dyn RealToComplex<f64>>,
    inverse: Arc<dyn ComplexToReal<f64>>,
}

impl std::fmt::Debug for Stft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stft").field("nfft", &self.nfft).finish()
    }
}

/// A complex spectrogram `[freqs, frames]`, row-major, as `(re, im)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Spectrogram {
    /// Frequency bins.
    pub freqs: usize,
    /// Frames.
    pub frames: usize,
    /// `freqs · frames` values.
    pub data: Vec<Complex<f64>>,
}

fn reflect_index(i: isize, n: usize) -> usize {
    // torch 'reflect' (edge not repeated), valid while |pad| < n.
    let n = n as isize;
    let mut j = i;
    if j < 0 {
        j = -j;
    }
    if j >= n {
        j = 2 * (n - 1) - j;
    }
    j as usize
}

impl Stft {
    /// Plans the transforms.
    pub fn new(nfft: usize) -> Self {
        let mut planner = RealFftPlanner::<f64>::new();
        let window =
            (0..nfft).map(|i| 0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / nfft as f64).cos()).collect();
        Stft { nfft, window, forward: planner.plan_fft_forward(nfft), inverse: planner.plan_fft_inverse(nfft) }
    }

    /// Hop length.
    pub fn hop(&self) -> usize {
        self.nfft / 4
    }

    /// `HTDemucs._spec` of one channel: `[L]` → `[nfft/2, ceil(L/hop)]`.
    pub fn spec(&self, x: &[f32]) -> Result<Spectrogram, DemucsError> {
        self.spec_with(x, false)
    }

    /// `HDemucs._spec`: as [`Stft::spec`], and any length ≥ 1 (`pad1d` inserts zeros
    /// before reflecting an input shorter than the padding); `hybrid_old` pads with zeros
    /// instead of reflecting (the MDX models).
    pub fn spec_with(&self, x: &[f32], hybrid_old: bool) -> Result<Spectrogram, DemucsError> {
        let hl = self.hop();
        let nfft = self.nfft;
        let len = x.len();
        if len == 0 {
            return Err(DemucsError::InvalidArgument("empty input for the STFT".into()));
        }
        let le = len.div_ceil(hl);
        let pad = hl / 2 * 3;
        let (left, right) = (pad, pad + le * hl - len);
        let total = len + left + right;
        // First padding (Demucs's `pad1d`).
        let xp: Vec<f64> = if hybrid_old {
            (0..total).map(|i| if i < left || i >= left + len { 0.0 } else { x[i - left] as f64 }).collect()
        } else {
            // Reflection needs more samples than the padding: zeros go in first, right
            // side before left, as `pad1d` does.
            let max_pad = left.max(right);
            let (extra_left, extra_right) = if len <= max_pad {
                let extra = max_pad - len + 1;
                let r = right.min(extra);
                (extra - r, r)
            } else {
                (0, 0)
            };
            let mut inner = vec![0f32; extra_left];
            inner.extend_from_slice(x);
            inner.resize(extra_left + len + extra_right, 0.0);
            let (l2, n) = (left - extra_left, inner.len());
            (0..total).map(|i| inner[reflect_index(i as isize - l2 as isize, n)] as f64).collect()
        };
        // torch.stft center=True: reflect-pad nfft/2 more; frame f starts at f·hl.
        let half = (nfft / 2) as isize;
        let n = xp.len();
        let freqs = nfft / 2;
        let scale = 1.0 / (nfft as f64).sqrt();
        let mut data = vec![Complex::new(0.0, 0.0); freqs * le];
        let mut frame = self.forward.make_input_vec();
        let mut out = self.forward.make_output_vec();
        for t in 0..le {
            let f = t + 2;
            let start = (f * hl) as isize - half;
            for (i, v) in frame.iter_mut().enumerate() {
                *v = xp[reflect_index(start + i as isize, n)] * self.window[i];
            }
            self.forward
                .process(&mut frame, &mut out)
                .map_err(|e| DemucsError::InvalidArgument(format!("fft: {e}")))?;
            for k in 0..freqs {
                data[k * le + t] = out[k] * scale;
            }
        }
        Ok(Spectrogram { freqs, frames: le, data })
    }

    /// `HTDemucs._ispec` of one channel: `[nfft/2, T]` → `[length]`.
    pub fn ispec(&self, z: &Spectrogram, length: usize) -> Vec<f32> {
        self.ispec_with(z, length, false)
    }

    /// `HDemucs._ispec`: as [`Stft::ispec`]; `hybrid_old` inverts to `hop·⌈L/hop⌉`
    /// samples and keeps the first `length` (the MDX models' delay of `3·hop/2`).
    pub fn ispec_with(&self, z: &Spectrogram, length: usize, hybrid_old: bool) -> Vec<f32> {
        let hl = self.hop();
        let nfft = self.nfft;
        let pad = if hybrid_old { 0 } else { hl / 2 * 3 };
        let frames = z.frames + 4;
        let le = hl * length.div_ceil(hl) + 2 * pad;
        // istft: full OLA length nfft + hl·(frames − 1), center removes nfft/2.
        let full = nfft + hl * (frames - 1);
        let mut y = vec![0f64; full];
        let mut env = vec![0f64; full];
        let scale = (nfft as f64).sqrt() / nfft as f64; // un-normalise, irfft 1/n
        let mut spec = self.inverse.make_input_vec();
        let mut frame = self.inverse.make_output_vec();
        for f in 0..frames {
            let start = f * hl;
            for (i, w) in self.window.iter().enumerate() {
                env[start + i] += w * w;
            }
            if f < 2 || f >= z.frames + 2 {
                continue; // zero frames
            }
            let t = f - 2;
            for (k, s) in spec.iter_mut().enumerate() {
                *s = if k < z.freqs { z.data[k * z.frames + t] } else { Complex::new(0.0, 0.0) };
            }
            spec[0].im = 0.0;
            let last = spec.len() - 1;
            spec[last].im = 0.0;
            self.inverse.process(&mut spec, &mut frame).expect("inverse fft with real DC and Nyquist bins");
            for (i, w) in self.window.iter().enumerate() {
                y[start + i] += frame[i] * scale * w;
            }
        }
        let off = nfft / 2 + pad;
        (0..length)
            .map(|i| {
                let j = off + i;
                if i + pad < le && j < full && env[j] > 1e-11 {
                    (y[j] / env[j]) as f32
                } else {
                    0.0
                }
            })
            .collect()
    }
}
