//! Owns the streamed sample-rate converter used by the decoder.
//!
//! It wraps rubato's asynchronous sinc resampler (`SincFixedIn`, 256-tap
//! windowed sinc, Blackman-Harris window, cubic interpolation between 256
//! oversampled filter points), feeds it fixed input blocks from a small FIFO
//! and, at the end, flushes the tail so the output has exactly
//! `round(input_frames * out_rate / in_rate)` frames.
//!
//! Alignment: measured on rubato 0.16, `SincFixedIn`'s output lags the
//! input by `ratio − 1` output frames (`ratio = out/in`; e.g. one frame when
//! doubling the rate; its `output_delay()` figure does not describe this).
//! To make output frame `j` sit exactly at input time `j / ratio`, the
//! wrapper prepends `b − 1` zero input frames and drops the first `a − 1`
//! output frames, where `a/b` is the reduced ratio: the net delay is
//! `(b − 1)·a/b + (ratio − 1) − (a − 1) = 0`, an exact integer bookkeeping of
//! a fractional shift. `tests/formats.rs` checks the
//! phase against an ideal sine. Memory is bounded by the block size.

use rubato::{Resampler, SincFixedIn, SincInterpolationParameters, SincInterpolationType, WindowFunction};

use crate::chunk::StereoChunk;
use crate::error::AudioError;

const BLOCK: usize = 1024;

/// Streamed stereo resampler.
pub(crate) struct StreamResampler {
    inner: SincFixedIn<f32>,
    pending: [Vec<f32>; 2],
    out_buf: Vec<Vec<f32>>,
    to_drop: usize,
    in_total: u64,
    out_total: u64,
    ratio: f64,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl StreamResampler {
    pub(crate) fn new(from: u32, to: u32) -> Result<Self, AudioError> {
        let ratio = to as f64 / from as f64;
        let g = gcd(from as u64, to as u64);
        let (a, b) = (to as u64 / g, from as u64 / g);
        let params = SincInterpolationParameters {
            sinc_len: 256,
            f_cutoff: 0.95,
            oversampling_factor: 256,
            interpolation: SincInterpolationType::Cubic,
            window: WindowFunction::BlackmanHarris2,
        };
        let inner = SincFixedIn::<f32>::new(ratio, 1.0, params, BLOCK, 2)
            .map_err(|e| AudioError::Internal(format!("resampler: {e}")))?;
        let out_buf = inner.output_buffer_allocate(true);
        let lead = (b - 1) as usize;
        Ok(StreamResampler {
            inner,
            pending: [vec![0.0; lead], vec![0.0; lead]],
            to_drop: (a - 1) as usize,
            out_buf,
            in_total: 0,
            out_total: 0,
            ratio,
        })
    }

    fn emit(&mut self, frames: usize, out: &mut StereoChunk, limit: Option<u64>) {
        let start = self.to_drop.min(frames);
        self.to_drop -= start;
        let mut end = frames;
        if let Some(limit) = limit {
            let room = limit.saturating_sub(self.out_total) as usize;
            end = end.min(start + room);
        }
        if end > start {
            out.left.extend_from_slice(&self.out_buf[0][start..end]);
            out.right.extend_from_slice(&self.out_buf[1][start..end]);
            self.out_total += (end - start) as u64;
        }
    }

    /// Feeds input frames; appends whatever output is ready to `out`.
    pub(crate) fn push(&mut self, left: &[f32], right: &[f32], out: &mut StereoChunk) -> Result<(), AudioError> {
        self.pending[0].extend_from_slice(left);
        self.pending[1].extend_from_slice(right);
        self.in_total += left.len() as u64;
        let mut offset = 0;
        loop {
            let need = self.inner.input_frames_next();
            if self.pending[0].len() - offset < need {
                break;
            }
            let input = [&self.pending[0][offset..offset + need], &self.pending[1][offset..offset + need]];
            let (used, produced) = self
                .inner
                .process_into_buffer(&input, &mut self.out_buf, None)
                .map_err(|e| AudioError::Internal(format!("resampler: {e}")))?;
            offset += used;
            self.emit(produced, out, None);
        }
        self.pending[0].drain(..offset);
        self.pending[1].drain(..offset);
        Ok(())
    }

    /// Flushes the tail; afterwards the total output length is exact.
    pub(crate) fn finish(&mut self, out: &mut StereoChunk) -> Result<(), AudioError> {
        let expected = (self.in_total as f64 * self.ratio).round() as u64;
        let mut first = true;
        let mut guard = 0;
        while self.out_total < expected {
            let produced = if first && !self.pending[0].is_empty() {
                let input = [&self.pending[0][..], &self.pending[1][..]];
                self.inner.process_partial_into_buffer(Some(&input), &mut self.out_buf, None)
            } else {
                self.inner.process_partial_into_buffer(None::<&[&[f32]]>, &mut self.out_buf, None)
            }
            .map_err(|e| AudioError::Internal(format!("resampler: {e}")))?
            .1;
            first = false;
            self.emit(produced, out, Some(expected));
            guard += 1;
            if guard > 1 << 16 {
                return Err(AudioError::Internal("resampler did not flush".into()));
            }
        }
        self.pending[0].clear();
        self.pending[1].clear();
        Ok(())
    }
}
