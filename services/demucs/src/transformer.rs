//! Port of `demucs.transformer.CrossTransformerEncoder` with its layers
//! `MyTransformerEncoderLayer` (self attention) and `CrossTransformerEncoderLayer`,
//! for the released configuration: `norm_first`, LayerScale, `norm_out`
//! (`MyGroupNorm(1, C)` over all tokens), sin embeddings, no sparse attention.
//!
//! Shapes: frequency tokens `x` `[B, C, Fr, T1]` are flattened time-major
//! (`b c fr t1 -> b (t1 fr) c`); time tokens `xt` `[B, C, T2]` become `[B, T2, C]`.
//! Layer `i` is self attention when `i % 2 == 0` (unless `cross_first`), otherwise
//! cross attention where each branch attends to the other's previous output.
//!
//! Attention is `torch.nn.MultiheadAttention`: the packed `in_proj_weight` `[3C, C]` is
//! split into q/k/v projections at load time; the product (softmax(q kᵀ / √d) v) runs on
//! the host kernels of [`crate::cpu`] on the CPU backend and on Burn's fused `attention`
//! op elsewhere; so does the exact GELU of the feed-forward block.

use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Tensor, TensorData};

use crate::checkpoint::{HostTensor, StateDict};
use crate::cpu;
use crate::error::DemucsError;
use crate::nn::{GroupNorm, GroupNormConfig, LayerNorm, LayerNormConfig, LayerScale, Linear, LinearConfig};

/// Shape of a [`CrossTransformerEncoder`].
#[derive(Debug, Clone)]
pub struct CrossTransformerEncoderConfig {
    /// Model width C.
    pub dim: usize,
    /// FFN hidden = int(dim · hidden_scale).
    pub hidden_scale: f64,
    /// Heads.
    pub num_heads: usize,
    /// Layers per branch.
    pub num_layers: usize,
    /// Cross attention at even layers instead of odd ones.
    pub cross_first: bool,
    /// LayerNorm on the inputs.
    pub norm_in: bool,
    /// GroupNorm(1) at the end of each layer.
    pub norm_out: bool,
    /// Sin embedding max period.
    pub max_period: f64,
    /// LayerScale on the residual branches.
    pub layer_scale: bool,
    /// GELU (else ReLU) in the FFN.
    pub gelu: bool,
    /// Weight of the positional embedding.
    pub weight_pos_embed: f64,
}

/// `nn.MultiheadAttention` (batch first), q/k/v split.
#[derive(Debug, Clone)]
pub struct MultiheadAttention<B: Backend> {
    q: Linear<B>,
    k: Linear<B>,
    v: Linear<B>,
    out: Linear<B>,
    heads: usize,
}

impl<B: Backend> MultiheadAttention<B> {
    fn init(dim: usize, heads: usize, device: &B::Device) -> Self {
        let lin = || LinearConfig { din: dim, dout: dim }.init(device);
        MultiheadAttention { q: lin(), k: lin(), v: lin(), out: lin(), heads }
    }

    /// Takes `{prefix}.in_proj_weight` `[3C, C]`, `.in_proj_bias` `[3C]` (q, k, v stacked)
    /// and `.out_proj.{weight,bias}`.
    fn load(self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
        let c = self.q.weight_t.dims()[0];
        let device = self.q.weight_t.device();
        let w = state.take(&format!("{prefix}.in_proj_weight"), &[3 * c, c])?;
        let b = state.take(&format!("{prefix}.in_proj_bias"), &[3 * c])?;
        let part = |i: usize| {
            (
                HostTensor { shape: vec![c, c], data: w.data[i * c * c..(i + 1) * c * c].to_vec() },
                HostTensor { shape: vec![c], data: b.data[i * c..(i + 1) * c].to_vec() },
            )
        };
        let (qw, qb) = part(0);
        let (kw, kb) = part(1);
        let (vw, vb) = part(2);
        Ok(MultiheadAttention {
            q: Linear::from_host(qw, qb, state, &device),
            k: Linear::from_host(kw, kb, state, &device),
            v: Linear::from_host(vw, vb, state, &device),
            out: self.out.load(state, &format!("{prefix}.out_proj"))?,
            heads: self.heads,
        })
    }

    /// `query` `[B, Tq, C]`, `key` (= value) `[B, Tk, C]` → `[B, Tq, C]`.
    pub fn forward(&self, query: Tensor<B, 3>, key: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, tq, c] = query.dims();
        let tk = key.dims()[1];
        let h = self.heads;
        let (q, k, v) = (self.q.forward(query), self.k.forward(key.clone()), self.v.forward(key));
        if cpu::is_cpu::<B>() {
            // Host kernel: all heads in parallel, vectorised softmax, no head transposes.
            let device = q.device();
            let shape = cpu::AttentionShape { batch: b, tq, tk, heads: h, head_dim: c / h };
            let y =
                cpu::with_host(&q, |q| cpu::with_host(&k, |k| cpu::with_host(&v, |v| cpu::attention(q, k, v, shape))));
            return self.out.forward(Tensor::from_data(TensorData::new(y, [b, tq, c]), &device));
        }
        let split = |x: Tensor<B, 3>, t: usize| x.reshape([b, t, h, c / h]).swap_dims(1, 2);
        let y = attention(split(q, tq), split(k, tk), split(v, tk), None, None, AttentionModuleOptions::default());
        self.out.forward(y.swap_dims(1, 2).reshape([b, tq, c]))
    }
}

/// One transformer layer of either kind.
#[derive(Debug, Clone)]
pub struct TransformerLayer<B: Backend> {
    cross: bool,
    attn: MultiheadAttention<B>,
    linear1: Linear<B>,
    linear2: Linear<B>,
    norm1: LayerNorm<B>,
    norm2: LayerNorm<B>,
    /// Cross layers only: the norm before the FFN (norm2 then normalises the keys).
    norm3: Option<LayerNorm<B>>,
    norm_out: Option<GroupNorm<B>>,
    gamma_1: Option<LayerScale<B>>,
    gamma_2: Option<LayerScale<B>>,
    gelu: bool,
}

impl<B: Backend> TransformerLayer<B> {
    fn init(cfg: &CrossTransformerEncoderConfig, cross: bool, device: &B::Device) -> Self {
        let d = cfg.dim;
        let hidden = (d as f64 * cfg.hidden_scale) as usize;
        let ln = || LayerNormConfig { channels: d }.init(device);
        TransformerLayer {
            cross,
            attn: MultiheadAttention::init(d, cfg.num_heads, device),
            linear1: LinearConfig { din: d, dout: hidden }.init(device),
            linear2: LinearConfig { din: hidden, dout: d }.init(device),
            norm1: ln(),
            norm2: ln(),
            norm3: cross.then(ln),
            norm_out: cfg.norm_out.then(|| GroupNormConfig { groups: 1, channels: d }.init(device)),
            gamma_1: cfg.layer_scale.then(|| LayerScale::init(d, device)),
            gamma_2: cfg.layer_scale.then(|| LayerScale::init(d, device)),
            gelu: cfg.gelu,
        }
    }

    /// Takes `{prefix}.self_attn` or `.cross_attn`, `.linear1`, `.linear2`, `.norm1..3`,
    /// `.norm_out`, `.gamma_1.scale`, `.gamma_2.scale`.
    pub fn load(self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
        let p = |n: &str| format!("{prefix}.{n}");
        let attn_name = if self.cross { "cross_attn" } else { "self_attn" };
        Ok(TransformerLayer {
            cross: self.cross,
            attn: self.attn.load(state, &p(attn_name))?,
            linear1: self.linear1.load(state, &p("linear1"))?,
            linear2: self.linear2.load(state, &p("linear2"))?,
            norm1: self.norm1.load(state, &p("norm1"))?,
            norm2: self.norm2.load(state, &p("norm2"))?,
            norm3: self.norm3.map(|n| n.load(state, &p("norm3"))).transpose()?,
            norm_out: self.norm_out.map(|n| n.load(state, &p("norm_out"))).transpose()?,
            gamma_1: self.gamma_1.map(|g| g.load(state, &p("gamma_1"))).transpose()?,
            gamma_2: self.gamma_2.map(|g| g.load(state, &p("gamma_2"))).transpose()?,
            gelu: self.gelu,
        })
    }

    /// `x + gamma · y` (LayerScale), or `x + y` without it.
    fn residual(g: &Option<LayerScale<B>>, x: Tensor<B, 3>, y: Tensor<B, 3>) -> Tensor<B, 3> {
        match g {
            Some(g) => g.residual_cl(x, y),
            None => x + y,
        }
    }

    fn ff(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let h = self.linear1.forward(x);
        let h = if self.gelu { cpu::gelu(h) } else { relu(h) };
        self.linear2.forward(h)
    }

    /// Self attention layer (`other = None`) or cross attention layer attending to
    /// `other`: `[B, T, C]` → `[B, T, C]`.
    pub fn forward(&self, x: Tensor<B, 3>, other: Option<Tensor<B, 3>>) -> Tensor<B, 3> {
        let x = match (&self.norm3, other) {
            (Some(norm3), Some(k)) => {
                let a = self.attn.forward(self.norm1.forward(x.clone()), self.norm2.forward(k));
                let x = Self::residual(&self.gamma_1, x, a);
                let f = self.ff(norm3.forward(x.clone()));
                Self::residual(&self.gamma_2, x, f)
            }
            (None, None) => {
                let n = self.norm1.forward(x.clone());
                let a = self.attn.forward(n.clone(), n);
                let x = Self::residual(&self.gamma_1, x, a);
                let f = self.ff(self.norm2.forward(x.clone()));
                Self::residual(&self.gamma_2, x, f)
            }
            _ => panic!("cross layers need the other branch, self layers must not get one"),
        };
        match &self.norm_out {
            // MyGroupNorm: GroupNorm over [B, C, T], computed channels last.
            Some(n) => n.forward_channels_last(x),
            None => x,
        }
    }
}

/// `CrossTransformerEncoder`.
#[derive(Debug, Clone)]
pub struct CrossTransformerEncoder<B: Backend> {
    norm_in: Option<LayerNorm<B>>,
    norm_in_t: Option<LayerNorm<B>>,
    layers: Vec<TransformerLayer<B>>,
    layers_t: Vec<TransformerLayer<B>>,
    max_period: f64,
    weight_pos_embed: f64,
}

impl CrossTransformerEncoderConfig {
    /// Zero-initialised encoder.
    pub fn init<B: Backend>(&self, device: &B::Device) -> CrossTransformerEncoder<B> {
        let parity = if self.cross_first { 1 } else { 0 };
        let mk = |i: usize| TransformerLayer::init(self, i % 2 != parity, device);
        CrossTransformerEncoder {
            norm_in: self.norm_in.then(|| LayerNormConfig { channels: self.dim }.init(device)),
            norm_in_t: self.norm_in.then(|| LayerNormConfig { channels: self.dim }.init(device)),
            layers: (0..self.num_layers).map(mk).collect(),
            layers_t: (0..self.num_layers).map(mk).collect(),
            max_period: self.max_period,
            weight_pos_embed: self.weight_pos_embed,
        }
    }
}

/// `create_sin_embedding(T, C)` computed as PyTorch does in float32: `[T, C]` row-major,
/// `[cos(phase), sin(phase)]` with `phase = t / max_period^(i / (C/2 − 1))`.
pub fn sin_embedding(length: usize, dim: usize, max_period: f64) -> Vec<f32> {
    let half = dim / 2;
    let mp = max_period as f32;
    let mut out = vec![0f32; length * dim];
    for i in 0..half {
        let den = mp.powf(i as f32 / (half as f32 - 1.0));
        for t in 0..length {
            let phase = t as f32 / den;
            out[t * dim + i] = phase.cos();
            out[t * dim + half + i] = phase.sin();
        }
    }
    out
}

/// `create_2d_sin_embedding(C, Fr, T1)` flattened to tokens `(t1 fr)`: `[T1·Fr, C]`.
pub fn sin_embedding_2d(dim: usize, height: usize, width: usize, max_period: f64) -> Vec<f32> {
    let d = dim / 2;
    let coef = (-(max_period.ln() / d as f64)) as f32;
    let div: Vec<f32> = (0..d / 2).map(|j| ((2 * j) as f32 * coef).exp()).collect();
    let mut out = vec![0f32; width * height * dim];
    for w in 0..width {
        for h in 0..height {
            let row = &mut out[(w * height + h) * dim..(w * height + h + 1) * dim];
            for (j, dv) in div.iter().enumerate() {
                let pw = w as f32 * dv;
                let ph = h as f32 * dv;
                row[2 * j] = pw.sin();
                row[2 * j + 1] = pw.cos();
                row[d + 2 * j] = ph.sin();
                row[d + 2 * j + 1] = ph.cos();
            }
        }
    }
    out
}

impl<B: Backend> CrossTransformerEncoder<B> {
    /// Takes `{prefix}.norm_in`, `.norm_in_t`, `.layers.{i}`, `.layers_t.{i}`.
    pub fn load(self, state: &mut StateDict, prefix: &str) -> Result<Self, DemucsError> {
        let p = |n: &str| format!("{prefix}.{n}");
        let load_all = |ls: Vec<TransformerLayer<B>>, name: &str, state: &mut StateDict| {
            ls.into_iter()
                .enumerate()
                .map(|(i, l)| l.load(state, &format!("{prefix}.{name}.{i}")))
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(CrossTransformerEncoder {
            norm_in: self.norm_in.map(|n| n.load(state, &p("norm_in"))).transpose()?,
            norm_in_t: self.norm_in_t.map(|n| n.load(state, &p("norm_in_t"))).transpose()?,
            layers: load_all(self.layers, "layers", state)?,
            layers_t: load_all(self.layers_t, "layers_t", state)?,
            max_period: self.max_period,
            weight_pos_embed: self.weight_pos_embed,
        })
    }

    /// One layer of the frequency (`time == false`) or time branch, for tests.
    pub fn layer(&self, time: bool, index: usize) -> &TransformerLayer<B> {
        if time {
            &self.layers_t[index]
        } else {
            &self.layers[index]
        }
    }

    /// `x` `[B, C, Fr, T1]`, `xt` `[B, C, T2]` → the same shapes.
    pub fn forward(&self, x: Tensor<B, 4>, xt: Tensor<B, 3>) -> (Tensor<B, 4>, Tensor<B, 3>) {
        let [b, c, fr, t1] = x.dims();
        let t2 = xt.dims()[2];
        let device = x.device();
        let w = self.weight_pos_embed as f32;

        let pos2d: Tensor<B, 3> =
            Tensor::from_data(TensorData::new(sin_embedding_2d(c, fr, t1, self.max_period), [1, t1 * fr, c]), &device);
        let mut x = x.permute([0, 3, 2, 1]).reshape([b, t1 * fr, c]);
        if let Some(n) = &self.norm_in {
            x = n.forward(x);
        }
        let mut x = x + pos2d * w;

        let pos1d: Tensor<B, 3> =
            Tensor::from_data(TensorData::new(sin_embedding(t2, c, self.max_period), [1, t2, c]), &device);
        let mut xt = xt.swap_dims(1, 2);
        if let Some(n) = &self.norm_in_t {
            xt = n.forward(xt);
        }
        let mut xt = xt + pos1d * w;

        for (l, lt) in self.layers.iter().zip(&self.layers_t) {
            if l.cross {
                let old_x = x.clone();
                x = l.forward(x, Some(xt.clone()));
                xt = lt.forward(xt, Some(old_x));
            } else {
                x = l.forward(x, None);
                xt = lt.forward(xt, None);
            }
        }
        let x = x.reshape([b, t1, fr, c]).permute([0, 3, 2, 1]);
        (x, xt.swap_dims(1, 2))
    }
}
