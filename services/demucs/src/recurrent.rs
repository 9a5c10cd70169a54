//! Port of `demucs.demucs.BLSTM` and `LocalState`: the two blocks Hybrid Demucs (v3)
//! inserts into the DConv branch of its deepest layers (index ≥ `dconv_lstm` /
//! `dconv_attn`). Both take and return `[N, C, T]` and run on Burn's generic tensor ops
//! only (so CUDA runs them as they are).
//!
//! **BLSTM** (`layers = 2`, `max_steps = 200`, `skip`): a two-layer bidirectional
//! `nn.LSTM(C, C)` over time, then `Linear(2C → C)`, plus the input. PyTorch's LSTM:
//! gates `W_ih x + b_ih + W_hh h + b_hh` in row blocks `[i; f; g; o]`,
//! `c' = σ(f)·c + σ(i)·tanh(g)`, `h' = σ(o)·tanh(c')`; the reverse direction runs over
//! the reversed sequence; layer 2 reads `[forward; backward]`. Sequences longer than
//! `max_steps` are cut into frames of 200 with hop 100 (zero-padded at the end), all
//! frames run as one batch, and each frame keeps its middle (`[0, 150)` of the first,
//! `[50, 150)` of the middle ones, `[50, 200)` of the last), cut back to `T`.
//!
//! **LocalState** (`heads = 4`, `ndecay = 4`, no `nfreqs`): 1×1 convolutions `query`,
//! `key`, `content`, `query_decay`, `proj`; per head, attention of each query step `s`
//! over key steps `t` with scores `k_t · q_s / √(C/heads)` minus a learned decay
//! `Σ_f f·|t − s| / √ndecay · σ(decay_f(s)) / 2`, the diagonal set to −100 (a finite
//! fill), softmax over `t`; `x + proj(attended content)`.

use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::checkpoint::StateDict;
use crate::error::DemucsError;
use crate::nn::{to_device, transposed, Conv1d, Conv1dConfig, Linear, LinearConfig, Param};

/// Longest sequence the BLSTM reads in one piece (demucs's `max_steps`).
pub const MAX_STEPS: usize = 200;

/// One direction of one LSTM layer, weights transposed for `x · W`.
#[derive(Debug, Clone)]
struct Direction<B: Backend> {
    /// `W_ih` transposed: `[in, 4H]`.
    w_ih: Param<B, 2>,
    /// `W_hh` transposed: `[H, 4H]`.
    w_hh: Param<B, 2>,
    /// `b_ih + b_hh`: `[4H]`.
    bias: Param<B, 1>,
}

impl<B: Backend> Direction<B> {
    fn load(
        state: &mut StateDict,
        prefix: &str,
        suffix: &str,
        din: usize,
        h: usize,
        device: &B::Device,
    ) -> Result<Self, DemucsError> {
        let take =
            |state: &mut StateDict, name: &str, shape: &[usize]| state.take(&format!("{prefix}.{name}{suffix}"), shape);
        let w_ih: Tensor<B, 2> = to_device(take(state, "weight_ih", &[4 * h, din])?, device);
        let w_hh: Tensor<B, 2> = to_device(take(state, "weight_hh", &[4 * h, h])?, device);
        let b_ih: Tensor<B, 1> = to_device(take(state, "bias_ih", &[4 * h])?, device);
        let b_hh: Tensor<B, 1> = to_device(take(state, "bias_hh", &[4 * h])?, device);
        Ok(Direction {
            w_ih: state.param(transposed(w_ih)),
            w_hh: state.param(transposed(w_hh)),
            bias: state.param_f32(b_ih + b_hh),
        })
    }

    /// `[T, N, in]` → `[T, N, H]`, over the sequence forwards or backwards.
    fn run(&self, xs: Tensor<B, 3>, reverse: bool) -> Tensor<B, 3> {
        let [t_len, n, din] = xs.dims();
        let h = self.w_hh.dims()[0];
        let gx = xs.reshape([t_len * n, din]).matmul(self.w_ih.val()) + self.bias.val().reshape([1, 4 * h]);
        let gx = gx.reshape([t_len, n, 4 * h]);
        let device = gx.device();
        let mut hidden: Tensor<B, 2> = Tensor::zeros([n, h], &device);
        let mut cell: Tensor<B, 2> = Tensor::zeros([n, h], &device);
        let mut out: Vec<Tensor<B, 2>> = Vec::with_capacity(t_len);
        for step in 0..t_len {
            let t = if reverse { t_len - 1 - step } else { step };
            let g = gx.clone().narrow(0, t, 1).reshape([n, 4 * h]) + hidden.matmul(self.w_hh.val());
            let i = sigmoid(g.clone().narrow(1, 0, h));
            let f = sigmoid(g.clone().narrow(1, h, h));
            let gg = g.clone().narrow(1, 2 * h, h).tanh();
            let o = sigmoid(g.narrow(1, 3 * h, h));
            cell = f * cell + i * gg;
            hidden = o * cell.clone().tanh();
            out.push(hidden.clone());
        }
        if reverse {
            out.reverse();
        }
        Tensor::stack(out, 0)
    }
}

/// `demucs.demucs.BLSTM(dim, layers=2, max_steps=200, skip=True)`.
#[derive(Debug, Clone)]
pub struct BLstm<B: Backend> {
    /// Per layer: (forward, backward).
    layers: Vec<(Direction<B>, Direction<B>)>,
    linear: Linear<B>,
    dim: usize,
}

impl<B: Backend> BLstm<B> {
    /// Reads `{prefix}.lstm.{weight,bias}_{ih,hh}_l{k}[_reverse]` and `{prefix}.linear`
    /// for a BLSTM of `dim` channels and `layers` layers.
    pub fn load(
        state: &mut StateDict,
        prefix: &str,
        dim: usize,
        layers: usize,
        device: &B::Device,
    ) -> Result<Self, DemucsError> {
        let mut ls = Vec::with_capacity(layers);
        for k in 0..layers {
            let din = if k == 0 { dim } else { 2 * dim };
            let p = format!("{prefix}.lstm");
            let fwd = Direction::load(state, &p, &format!("_l{k}"), din, dim, device)?;
            let bwd = Direction::load(state, &p, &format!("_l{k}_reverse"), din, dim, device)?;
            ls.push((fwd, bwd));
        }
        let linear = LinearConfig { din: 2 * dim, dout: dim }.init(device).load(state, &format!("{prefix}.linear"))?;
        Ok(BLstm { layers: ls, linear, dim })
    }

    /// The LSTM and the linear layer on whole sequences: `[N, C, T]` → `[N, C, T]`.
    fn sequences(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        // [T, N, C], as PyTorch's LSTM reads it.
        let mut xs = x.permute([2, 0, 1]);
        for (fwd, bwd) in &self.layers {
            let a = fwd.run(xs.clone(), false);
            let b = bwd.run(xs, true);
            xs = Tensor::cat(vec![a, b], 2);
        }
        // Linear over the last axis: [T, N, 2C] → [T, N, C] → [N, C, T].
        self.linear.forward(xs).permute([1, 2, 0])
    }

    /// `[N, C, T]` → `[N, C, T]` (with the skip connection).
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [n, c, t] = x.dims();
        debug_assert_eq!(c, self.dim);
        if t <= MAX_STEPS {
            return self.sequences(x.clone()) + x;
        }
        let width = MAX_STEPS;
        let stride = width / 2;
        let frames = t.div_ceil(stride);
        let target = (frames - 1) * stride + width;
        let padded = Tensor::cat(vec![x.clone(), Tensor::zeros([n, c, target - t], &x.device())], 2);
        // [N, frames, C, width] → [N·frames, C, width].
        let framed: Vec<Tensor<B, 3>> = (0..frames).map(|k| padded.clone().narrow(2, k * stride, width)).collect();
        let framed = Tensor::stack::<4>(framed, 1).reshape([n * frames, c, width]);
        let y = self.sequences(framed).reshape([n, frames, c, width]);
        let limit = stride / 2;
        let pieces: Vec<Tensor<B, 3>> = (0..frames)
            .map(|k| {
                let (from, len) = if k == 0 {
                    (0, width - limit)
                } else if k == frames - 1 {
                    (limit, width - limit)
                } else {
                    (limit, width - 2 * limit)
                };
                y.clone().narrow(1, k, 1).reshape([n, c, width]).narrow(2, from, len)
            })
            .collect();
        Tensor::cat(pieces, 2).narrow(2, 0, t) + x
    }
}

/// `demucs.demucs.LocalState(channels, heads=4, ndecay=4)`.
#[derive(Debug, Clone)]
pub struct LocalState<B: Backend> {
    content: Conv1d<B>,
    query: Conv1d<B>,
    key: Conv1d<B>,
    query_decay: Conv1d<B>,
    proj: Conv1d<B>,
    heads: usize,
    ndecay: usize,
}

impl<B: Backend> LocalState<B> {
    /// Reads `{prefix}.{content,query,key,query_decay,proj}` for `channels`.
    pub fn load(state: &mut StateDict, prefix: &str, channels: usize, device: &B::Device) -> Result<Self, DemucsError> {
        let (heads, ndecay) = (4, 4);
        if !channels.is_multiple_of(heads) {
            return Err(DemucsError::Checkpoint(format!("LocalState of {channels} channels for {heads} heads")));
        }
        let conv = |state: &mut StateDict, name: &str, cout: usize| {
            Conv1dConfig::new(channels, cout, 1).init::<B>(device).load(state, &format!("{prefix}.{name}"))
        };
        Ok(LocalState {
            content: conv(state, "content", channels)?,
            query: conv(state, "query", channels)?,
            key: conv(state, "key", channels)?,
            query_decay: conv(state, "query_decay", heads * ndecay)?,
            proj: conv(state, "proj", channels)?,
            heads,
            ndecay,
        })
    }

    /// `[N, C, T]` → `[N, C, T]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [n, c, t] = x.dims();
        let (h, d) = (self.heads, c / self.heads);
        let device = x.device();
        let queries = self.query.forward(x.clone()).reshape([n, h, d, t]);
        let keys = self.key.forward(x.clone()).reshape([n, h, d, t]);
        // dots[n, h, t, s] = Σ_c keys[n, h, c, t] · queries[n, h, c, s] / √d
        let dots = keys.swap_dims(2, 3).matmul(queries).div_scalar((d as f64).sqrt());
        // The decay: Σ_f −f·|t − s| / √ndecay · σ(query_decay)[n, h, f, s] / 2, which is
        // −|t − s| / √ndecay times Σ_f f·q_f(s).
        let decay_q = sigmoid(self.query_decay.forward(x.clone()).reshape([n, h, self.ndecay, t])).div_scalar(2.0);
        let factors: Tensor<B, 1> = Tensor::from_data(
            TensorData::new((1..=self.ndecay).map(|f| f as f32).collect::<Vec<_>>(), [self.ndecay]),
            &device,
        );
        let weighted = (decay_q * factors.reshape([1, 1, self.ndecay, 1])).sum_dim(2); // [n, h, 1, t]
        let (dist, keep, fill) = distances(t);
        let dist: Tensor<B, 4> = Tensor::from_data(TensorData::new(dist, [1, 1, t, t]), &device);
        let dots = dots - dist.div_scalar((self.ndecay as f64).sqrt()) * weighted;
        // The diagonal is −100 (PyTorch's masked_fill): ×0 + (−100) there, ×1 + 0 elsewhere.
        let keep: Tensor<B, 4> = Tensor::from_data(TensorData::new(keep, [1, 1, t, t]), &device);
        let fill: Tensor<B, 4> = Tensor::from_data(TensorData::new(fill, [1, 1, t, t]), &device);
        let weights = softmax(dots * keep + fill, 2);
        let content = self.content.forward(x.clone()).reshape([n, h, d, t]);
        // result[n, h, c, s] = Σ_t weights[n, h, t, s] · content[n, h, c, t]
        let result = content.matmul(weights).reshape([n, c, t]);
        x + self.proj.forward(result)
    }
}

/// `|t − s|`, the keep mask (0 on the diagonal) and the fill (−100 on the diagonal),
/// `[t, t]` each.
fn distances(t: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut dist = Vec::with_capacity(t * t);
    let mut keep = Vec::with_capacity(t * t);
    let mut fill = Vec::with_capacity(t * t);
    for i in 0..t {
        for j in 0..t {
            dist.push(i.abs_diff(j) as f32);
            keep.push(if i == j { 0.0 } else { 1.0 });
            fill.push(if i == j { -100.0 } else { 0.0 });
        }
    }
    (dist, keep, fill)
}
