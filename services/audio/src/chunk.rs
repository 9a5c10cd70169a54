//! Owns [`StereoChunk`], the planar stereo `f32` block that flows between
//! the decoder, the separation engine and the encoders.

/// A block of planar stereo samples (`left[i]` and `right[i]` are one frame).
///
/// Invariant kept by every producer in this crate: `left.len() == right.len()`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StereoChunk {
    /// Left channel samples, nominally in [-1, 1].
    pub left: Vec<f32>,
    /// Right channel samples, nominally in [-1, 1].
    pub right: Vec<f32>,
}

impl StereoChunk {
    /// An empty chunk with room for `frames` frames.
    pub fn with_capacity(frames: usize) -> Self {
        StereoChunk { left: Vec::with_capacity(frames), right: Vec::with_capacity(frames) }
    }

    /// Builds a chunk from two channels of equal length.
    ///
    /// # Panics
    /// If the lengths differ.
    pub fn from_planar(left: Vec<f32>, right: Vec<f32>) -> Self {
        assert_eq!(left.len(), right.len(), "channels must have equal length");
        StereoChunk { left, right }
    }

    /// Builds a chunk from interleaved `L R L R ...` samples (a trailing odd sample is ignored).
    pub fn from_interleaved(samples: &[f32]) -> Self {
        let mut c = StereoChunk::with_capacity(samples.len() / 2);
        for f in samples.chunks_exact(2) {
            c.left.push(f[0]);
            c.right.push(f[1]);
        }
        c
    }

    /// The samples interleaved as `L R L R ...`.
    pub fn to_interleaved(&self) -> Vec<f32> {
        self.left.iter().zip(&self.right).flat_map(|(&l, &r)| [l, r]).collect()
    }

    /// Number of frames.
    pub fn len(&self) -> usize {
        self.left.len()
    }

    /// True when the chunk holds no frames.
    pub fn is_empty(&self) -> bool {
        self.left.is_empty()
    }

    /// Appends the frames of `other`.
    pub fn extend_from(&mut self, other: &StereoChunk) {
        self.left.extend_from_slice(&other.left);
        self.right.extend_from_slice(&other.right);
    }

    /// Largest absolute sample value (0 for an empty chunk).
    pub fn peak(&self) -> f32 {
        self.left.iter().chain(&self.right).fold(0.0f32, |m, &x| m.max(x.abs()))
    }
}
