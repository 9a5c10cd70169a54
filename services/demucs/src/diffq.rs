//! DiffQ-quantised checkpoints (`diffq` 0.2, the `_q` models: `mdx_q`, `mdx_extra_q`),
//! decoded without Python.
//!
//! Such a package's `state` is `{quantized, float16, others, meta, __quantized}` with no
//! parameter names: the model's parameters are taken in PyTorch's registration order
//! ([`canonical_order`]); one of at most `min_size · 2²⁰ / 4` values comes from `others`
//! (float), a larger one from `quantized`: `(levels, (min, max), bits)` where the
//! flattened parameter is cut into groups of `group_size`, group `g` has `bits[g] + 2`
//! bits, `levels[b − 1]` holds the levels of every `b`-bit group in order, and a weight
//! is `level / (2^b − 1) · (max − min) + min` (in `f32`, `max − min` in `f64` first, as
//! diffq computes it). Packed arrays are int64 `[lines, nbits, 32]`: value
//! `line·2048 + j·32 + i` has its bit `k` in bit `j` of word `[line][k][i]`.
//!
//! The result is an ordinary [`StateDict`], so loading stays strict.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use crate::checkpoint::{HostTensor, StateDict};
use crate::error::DemucsError;

/// A packed int64 array `[lines, nbits, 32]` (raw bits).
#[derive(Debug, Clone, PartialEq)]
pub struct Packed {
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its words, row-major.
    pub words: Vec<u64>,
}

/// One quantised parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedParam {
    /// `levels[b − 1]`: the levels of the `b`-bit groups (`None`: no such group).
    pub levels: Vec<Option<Packed>>,
    /// The parameter's minimum and maximum.
    pub range: (f64, f64),
    /// Each group's bit width minus 2.
    pub bits: Packed,
}

/// The `state` of a DiffQ package.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    /// `meta.init_kwargs.min_size` (MB): parameters up to `min_size · 2²⁰ / 4` values are
    /// kept as floats.
    pub min_size: f64,
    /// `meta.init_kwargs.group_size`.
    pub group_size: usize,
    /// The quantised parameters, in order.
    pub quantized: Vec<QuantizedParam>,
    /// The other parameters (floats), in order.
    pub others: Vec<HostTensor>,
}

/// `n` values of `nbits` bits each from a packed array.
fn unpack(p: &Packed, n: usize) -> Result<Vec<u64>, DemucsError> {
    let bad = |m: String| DemucsError::Checkpoint(format!("diffq packed array: {m}"));
    let [lines, nbits, width] = <[usize; 3]>::try_from(p.shape.as_slice())
        .map_err(|_| bad(format!("shape {:?}, expected [lines, nbits, 32]", p.shape)))?;
    if width != 32 || p.words.len() != lines * nbits * 32 {
        return Err(bad(format!("shape {:?} with {} words", p.shape, p.words.len())));
    }
    if n > lines * 2048 {
        return Err(bad(format!("{n} values asked of {lines} lines")));
    }
    let mut out = vec![0u64; lines * 2048];
    for line in 0..lines {
        for k in 0..nbits {
            for i in 0..32 {
                let word = p.words[(line * nbits + k) * 32 + i];
                for j in 0..64 {
                    out[line * 2048 + j * 32 + i] |= ((word >> j) & 1) << k;
                }
            }
        }
    }
    out.truncate(n);
    Ok(out)
}

impl QuantizedParam {
    /// The parameter's `numel` values, `group_size` per group.
    fn decode(&self, numel: usize, group_size: usize) -> Result<Vec<f32>, DemucsError> {
        let bad = |m: String| DemucsError::Checkpoint(format!("diffq parameter: {m}"));
        if group_size == 0 || !numel.is_multiple_of(group_size) {
            return Err(bad(format!("{numel} values in groups of {group_size}")));
        }
        let groups = numel / group_size;
        let bits: Vec<u64> = unpack(&self.bits, groups)?.into_iter().map(|b| b + 2).collect();
        if let Some(b) = bits.iter().find(|b| **b > 14) {
            // diffq stores levels for 1..=14 bits only: such a group's weights are lost.
            return Err(DemucsError::Unsupported(format!("a diffq group of {b} bits (not stored by diffq)")));
        }
        let mut levels = vec![0u64; numel];
        for width in 1..=14u64 {
            let members: Vec<usize> = (0..groups).filter(|g| bits[*g] == width).collect();
            if members.is_empty() {
                continue;
            }
            let packed = self
                .levels
                .get(width as usize - 1)
                .and_then(Option::as_ref)
                .ok_or_else(|| bad(format!("{} groups of {width} bits but no levels for them", members.len())))?;
            let values = unpack(packed, members.len() * group_size)?;
            for (m, g) in members.iter().enumerate() {
                levels[g * group_size..(g + 1) * group_size]
                    .copy_from_slice(&values[m * group_size..(m + 1) * group_size]);
            }
        }
        let (mn, mx) = self.range;
        let span = (mx - mn) as f32;
        Ok(levels
            .iter()
            .enumerate()
            .map(|(i, &level)| {
                let b = bits[i / group_size] as i32;
                let w = level as f32 * (1f32 / (2f32.powi(b) - 1f32));
                w * span + mn as f32
            })
            .collect())
    }
}

/// The rank of a module attribute or parameter among its siblings, in the order the
/// demucs classes register them (`__init__`); `in_decoder`: the encoder and decoder
/// layers register their norms in opposite orders.
fn rank(name: &str, depth: usize, in_decoder: bool) -> u32 {
    if depth == 0 {
        return match name {
            "encoder" => 0,
            "decoder" => 1,
            "tencoder" => 2,
            "tdecoder" => 3,
            "freq_emb" => 4,
            "lstm" => 5,
            _ => 100,
        };
    }
    if let Some(r) = lstm_param_rank(name) {
        return r;
    }
    match name {
        // HEncLayer: conv, norm1, rewrite, norm2, dconv. HDecLayer: conv_tr, norm2,
        // rewrite, norm1, dconv.
        "conv" | "conv_tr" => 0,
        "norm1" => {
            if in_decoder {
                3
            } else {
                1
            }
        }
        "norm2" => {
            if in_decoder {
                1
            } else {
                3
            }
        }
        "rewrite" => 2,
        "dconv" => 4,
        // LocalState: content, query, key, (query_freqs), query_decay, proj.
        "content" => 0,
        "query" => 1,
        "key" => 2,
        "query_freqs" => 3,
        "query_decay" => 4,
        "proj" => 5,
        // BLSTM: lstm, linear. DConv / MultiWrap: layers. ScaledEmbedding: embedding.
        "lstm" | "layers" | "embedding" => 0,
        "linear" => 1,
        // Parameters.
        "weight" | "scale" => 0,
        "bias" => 1,
        _ => 100,
    }
}

/// `nn.LSTM`'s parameters: per layer, forward then reverse, each `weight_ih`,
/// `weight_hh`, `bias_ih`, `bias_hh`.
fn lstm_param_rank(name: &str) -> Option<u32> {
    let (kind, rest) = ["weight_ih_l", "weight_hh_l", "bias_ih_l", "bias_hh_l"]
        .iter()
        .enumerate()
        .find_map(|(k, p)| name.strip_prefix(p).map(|r| (k as u32, r)))?;
    let (layer, reverse) = match rest.strip_suffix("_reverse") {
        Some(l) => (l, 1),
        None => (rest, 0),
    };
    Some(layer.parse::<u32>().ok()? * 8 + reverse * 4 + kind)
}

/// PyTorch's order of the parameters named `names` (`named_parameters()`: modules in
/// registration order, list items by index).
pub fn canonical_order(mut names: Vec<(String, Vec<usize>)>) -> Vec<(String, Vec<usize>)> {
    fn cmp(a: &str, b: &str) -> Ordering {
        let (pa, pb): (Vec<&str>, Vec<&str>) = (a.split('.').collect(), b.split('.').collect());
        let in_decoder = matches!(pa[0], "decoder" | "tdecoder");
        for (depth, (x, y)) in pa.iter().zip(&pb).enumerate() {
            if x == y {
                continue;
            }
            return match (x.parse::<u64>(), y.parse::<u64>()) {
                (Ok(i), Ok(j)) => i.cmp(&j),
                _ => rank(x, depth, in_decoder).cmp(&rank(y, depth, in_decoder)).then_with(|| x.cmp(y)),
            };
        }
        pa.len().cmp(&pb.len())
    }
    names.sort_by(|a, b| cmp(&a.0, &b.0));
    names
}

/// The named state of a model whose parameters are `order` (names and shapes, in
/// [`canonical_order`]) from its quantised package.
pub fn dequantize(q: Quantized, order: &[(String, Vec<usize>)]) -> Result<StateDict, DemucsError> {
    let small = (q.min_size * (1u64 << 20) as f64 / 4.0).floor() as usize;
    let mut quantized = q.quantized.into_iter();
    let mut others = q.others.into_iter();
    let mut tensors = BTreeMap::new();
    for (name, shape) in order {
        let numel: usize = shape.iter().product();
        let t = if numel <= small {
            let t =
                others.next().ok_or_else(|| DemucsError::Checkpoint(format!("diffq `others` ran out at `{name}`")))?;
            if t.data.len() != numel {
                return Err(DemucsError::Shape { name: name.clone(), expected: shape.clone(), found: t.shape });
            }
            HostTensor { shape: shape.clone(), data: t.data }
        } else {
            let p = quantized
                .next()
                .ok_or_else(|| DemucsError::Checkpoint(format!("diffq `quantized` ran out at `{name}`")))?;
            HostTensor { shape: shape.clone(), data: p.decode(numel, q.group_size)? }
        };
        tensors.insert(name.clone(), t);
    }
    let (left_q, left_o) = (quantized.count(), others.count());
    if left_q + left_o > 0 {
        return Err(DemucsError::Checkpoint(format!(
            "diffq state has {left_q} quantised and {left_o} other parameters more than the model"
        )));
    }
    Ok(StateDict::new(tensors))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packs `values` of `nbits` bits as diffq does (the inverse of [`unpack`]).
    fn pack(values: &[u64], nbits: usize) -> Packed {
        let lines = values.len().div_ceil(2048);
        let mut words = vec![0u64; lines * nbits * 32];
        for (n, v) in values.iter().enumerate() {
            let (line, j, i) = (n / 2048, (n % 2048) / 32, n % 32);
            for k in 0..nbits {
                words[(line * nbits + k) * 32 + i] |= ((v >> k) & 1) << j;
            }
        }
        Packed { shape: vec![lines, nbits, 32], words }
    }

    #[test]
    fn unpack_reads_what_pack_wrote() {
        let values: Vec<u64> = (0..3000).map(|i| (i * 7919 % 13) as u64).collect();
        assert_eq!(unpack(&pack(&values, 4), values.len()).unwrap(), values);
        assert!(unpack(&pack(&values, 4), 5000).is_err(), "more values than stored");
    }

    #[test]
    fn a_parameter_decodes_group_by_group() {
        // Two groups of 4: 2 bits (levels 0..3) and 3 bits (0..7), range [-1, 1].
        let p = QuantizedParam {
            levels: (1..=14)
                .map(|b| match b {
                    2 => Some(pack(&[0, 1, 2, 3], 2)),
                    3 => Some(pack(&[7, 0, 3, 4], 3)),
                    _ => None,
                })
                .collect(),
            range: (-1.0, 1.0),
            bits: pack(&[0, 1], 1),
        };
        let w = p.decode(8, 4).unwrap();
        let want = [-1.0, -1.0 + 2.0 / 3.0, -1.0 + 4.0 / 3.0, 1.0, 1.0, -1.0, -1.0 + 6.0 / 7.0, -1.0 + 8.0 / 7.0];
        for (a, b) in w.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{w:?}");
        }
        assert!(p.decode(8, 3).is_err(), "groups must divide the parameter");
    }

    #[test]
    fn parameters_sort_in_registration_order() {
        let names = [
            "tdecoder.0.conv_tr.weight",
            "freq_emb.embedding.weight",
            "decoder.0.norm1.weight",
            "decoder.0.conv_tr.bias",
            "decoder.0.norm2.weight",
            "encoder.10.conv.weight",
            "encoder.2.dconv.layers.0.3.lstm.bias_hh_l1_reverse",
            "encoder.2.dconv.layers.0.3.lstm.weight_ih_l1",
            "encoder.2.dconv.layers.0.3.linear.weight",
            "encoder.2.norm2.weight",
            "encoder.2.norm1.weight",
            "encoder.2.dconv.layers.0.4.query_decay.weight",
            "encoder.2.dconv.layers.0.4.key.bias",
        ];
        let sorted: Vec<String> = canonical_order(names.iter().map(|n| (n.to_string(), vec![1])).collect())
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(
            sorted,
            [
                "encoder.2.norm1.weight",
                "encoder.2.norm2.weight",
                "encoder.2.dconv.layers.0.3.lstm.weight_ih_l1",
                "encoder.2.dconv.layers.0.3.lstm.bias_hh_l1_reverse",
                "encoder.2.dconv.layers.0.3.linear.weight",
                "encoder.2.dconv.layers.0.4.key.bias",
                "encoder.2.dconv.layers.0.4.query_decay.weight",
                "encoder.10.conv.weight",
                "decoder.0.conv_tr.bias",
                "decoder.0.norm2.weight",
                "decoder.0.norm1.weight",
                "tdecoder.0.conv_tr.weight",
                "freq_emb.embedding.weight",
            ]
        );
    }
}
