//! Owns the streamed sample-rate converter used by the decoder.
//!
//! It wraps rubato's asynchronous sinc resampler (`SincFixedIn`, 256-tap
//! windowed sinc, Blackman-Harris window, cubic interpolation between 256
//! oversampled filter points), feeds it fixed input blocks from a small FIFO,
//! drops the filter's start-up delay and, at the end, flushes the tail so the
//! output has exactly `round(input_frames * out_rate / in_rate)` frames and is
//! time-aligned with the input. Memory is bounded by the block size.

use rubato::{
    Resampler, SincFixedIn, SincInterpolationParameters, SincInterpolationType, WindowFunction,
};

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

impl StreamResampler {
    pub(crate) fn new(from: u32, to: u32) -> Result<Self, AudioError> {
        let ratio = to as f64 / from as f64;
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
        let to_drop = inner.output_delay();
        Ok(StreamResampler {
            inner,
            pending: [Vec::with_capacity(2 * BLOCK), Vec::with_capacity(2 * BLOCK)],
            out_buf,
            to_drop,
            in_total: 0,
            out_total: 0,
            ratio,
        })
    }

    fn emit(&mut self, frames: usize, out: &mut StereoChunk, limit: Option<u64>) {
        let mut start = 0;
        if self.to_drop > 0 {
            start = self.to_drop.min(frames);
            self.to_drop -= start;
        }
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
    pub(crate) fn push(
        &mut self,
        left: &[f32],
        right: &[f32],
        out: &mut StereoChunk,
    ) -> Result<(), AudioError> {
        self.pending[0].extend_from_slice(left);
        self.pending[1].extend_from_slice(right);
        self.in_total += left.len() as u64;
        let mut offset = 0;
        loop {
            let need = self.inner.input_frames_next();
            if self.pending[0].len() - offset < need {
                break;
            }
            let input = [
                &self.pending[0][offset..offset + need],
                &self.pending[1][offset..offset + need],
            ];
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
                self.inner
                    .process_partial_into_buffer(Some(&input), &mut self.out_buf, None)
            } else {
                self.inner
                    .process_partial_into_buffer(None::<&[&[f32]]>, &mut self.out_buf, None)
            }
            .map_err(|e| AudioError::Internal(format!("resampler: {e}")))?
            .1;
            first = false;
            self.emit(produced, out, Some(expected));
            guard += 1;
            if guard > 64 {
                return Err(AudioError::Internal("resampler did not flush".into()));
            }
        }
        self.pending[0].clear();
        self.pending[1].clear();
        Ok(())
    }
}
