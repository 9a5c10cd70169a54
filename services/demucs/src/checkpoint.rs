//! Official Demucs `.th` checkpoints, read with no Python.
//!
//! A `.th` file is `torch.save({'klass', 'args', 'kwargs', 'state', 'training_args',
//! ...})`: a zip archive holding `<prefix>/data.pkl` (the pickle) and one
//! `<prefix>/data/<key>` file per tensor storage. The state dict is stored in fp16 (by
//! `demucs.states.get_state(half=True)`); tensors are cast to `f32` here. `klass` is a
//! class reference and stays opaque ([`Value::Global`]); `kwargs` are kept as decoded
//! pickle values for [`crate::config::HTDemucsConfig::from_kwargs`].
//!
//! The state dict keys are PyTorch's, unchanged (`encoder.0.dconv.layers.0.3.weight`,
//! `crosstransformer.layers.0.self_attn.in_proj_weight`, ...); the blocks' `load`
//! functions say which keys they take, and [`StateDict::finish`] refuses leftovers
//! (strict, like `load_state_dict`).
//!
//! A damaged or hostile file is an error, never a panic or a huge allocation (found by
//! fuzzing, `tests/fuzz_checkpoint.rs`): archive entries are read up to
//! [`MAX_ENTRY_BYTES`] whatever size the archive declares, and a tensor's view
//! (offset, shape, strides) must lie inside its storage, checked with overflow-free
//! arithmetic before anything is allocated for it.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use half::{bf16, f16};

use crate::diffq::{Packed, Quantized, QuantizedParam};
use crate::error::DemucsError;
use crate::nn::{Param, WeightPrecision};
use crate::pickle::{unpickle, Value};

/// A tensor on the host: row-major `f32` values and a shape.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub data: Vec<f32>,
}

/// The named tensors of a model, consumed as blocks load.
#[derive(Debug, Clone, Default)]
pub struct StateDict {
    tensors: BTreeMap<String, HostTensor>,
    /// A dry run: every `take` answers zeros and is recorded here (name, shape).
    recorded: Option<Vec<(String, Vec<usize>)>>,
    /// The type loaded weights are kept in on the device ([`StateDict::param`]).
    precision: WeightPrecision,
    /// Device bytes of the weights made from here so far.
    kept_bytes: u64,
}

impl StateDict {
    /// Wraps a map of tensors.
    pub fn new(tensors: BTreeMap<String, HostTensor>) -> Self {
        StateDict { tensors, ..StateDict::default() }
    }

    /// Keeps the weights loaded from here in `precision` on the device.
    pub fn with_precision(mut self, precision: WeightPrecision) -> Self {
        self.precision = precision;
        self
    }

    /// A loaded weight, kept on its device in this state dict's precision.
    pub fn param<B: Backend, const D: usize>(&mut self, t: Tensor<B, D>) -> Param<B, D> {
        self.count(Param::with_precision(t, self.precision))
    }

    /// A weight derived from loaded ones (a sum, a scaled copy), kept in `f32`: rounding
    /// it to `f16` would change the model.
    pub fn param_f32<B: Backend, const D: usize>(&mut self, t: Tensor<B, D>) -> Param<B, D> {
        self.count(Param::new(t))
    }

    fn count<B: Backend, const D: usize>(&mut self, p: Param<B, D>) -> Param<B, D> {
        self.kept_bytes += p.bytes();
        p
    }

    /// Device bytes of the weights made by [`StateDict::param`] and
    /// [`StateDict::param_f32`] so far.
    pub fn kept_bytes(&self) -> u64 {
        self.kept_bytes
    }

    /// A dry run: loading from it records every parameter a model takes (its name and
    /// shape) and gives zeros; [`StateDict::into_recorded`] returns them.
    pub fn recording() -> Self {
        StateDict { recorded: Some(Vec::new()), ..StateDict::default() }
    }

    /// The parameters taken from a [`StateDict::recording`], in the order taken.
    pub fn into_recorded(self) -> Vec<(String, Vec<usize>)> {
        self.recorded.unwrap_or_default()
    }

    /// Names still present.
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// Borrows a tensor.
    pub fn get(&self, name: &str) -> Option<&HostTensor> {
        self.tensors.get(name)
    }

    /// Removes and returns a tensor, checking its shape.
    pub fn take(&mut self, name: &str, expected: &[usize]) -> Result<HostTensor, DemucsError> {
        if let Some(r) = self.recorded.as_mut() {
            r.push((name.to_string(), expected.to_vec()));
            return Ok(HostTensor { shape: expected.to_vec(), data: vec![0.0; expected.iter().product()] });
        }
        let t = self.tensors.remove(name).ok_or_else(|| DemucsError::MissingTensor(name.to_string()))?;
        if t.shape != expected {
            return Err(DemucsError::Shape { name: name.to_string(), expected: expected.to_vec(), found: t.shape });
        }
        Ok(t)
    }

    /// Removes and returns a tensor whatever its shape.
    pub fn take_any(&mut self, name: &str) -> Result<HostTensor, DemucsError> {
        self.tensors.remove(name).ok_or_else(|| DemucsError::MissingTensor(name.to_string()))
    }

    /// Keeps only the tensors under `prefix.` and strips it (for loading one block).
    pub fn sub(&self, prefix: &str) -> StateDict {
        let p = format!("{prefix}.");
        StateDict {
            tensors: self
                .tensors
                .iter()
                .filter_map(|(k, v)| k.strip_prefix(&p).map(|s| (s.to_string(), v.clone())))
                .collect(),
            precision: self.precision,
            ..StateDict::default()
        }
    }

    /// Fails when tensors were left unused.
    pub fn finish(self) -> Result<(), DemucsError> {
        if self.tensors.is_empty() {
            Ok(())
        } else {
            Err(DemucsError::UnexpectedTensors(self.tensors.into_keys().collect()))
        }
    }
}

/// A decoded Demucs package.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The pickled class reference (`demucs.htdemucs.HTDemucs`), opaque.
    pub klass: Value,
    /// Positional constructor arguments.
    pub args: Value,
    /// Keyword constructor arguments.
    pub kwargs: Value,
    /// The weights, cast to `f32` (empty for a DiffQ package: see `quantized`).
    pub state: StateDict,
    /// A DiffQ-quantised package's state, decoded against the model's parameters when
    /// it is built ([`crate::diffq`]).
    pub quantized: Option<Quantized>,
}

impl Checkpoint {
    /// The class name `module.Name`, when `klass` is a plain class reference.
    pub fn class_name(&self) -> Option<String> {
        match &self.klass {
            Value::Global(m, n) => Some(format!("{m}.{n}")),
            _ => None,
        }
    }

    /// Reads a `.th` file.
    pub fn load(path: &Path) -> Result<Self, DemucsError> {
        let file = std::fs::File::open(path).map_err(|e| DemucsError::io(path, e))?;
        Self::from_reader(file)
    }

    /// Reads a `.th` archive from any seekable reader.
    pub fn from_reader<R: Read + std::io::Seek>(reader: R) -> Result<Self, DemucsError> {
        let mut zip = zip::ZipArchive::new(reader).map_err(|source| DemucsError::Zip { entry: None, source })?;
        let pkl_name = zip
            .file_names()
            .find(|n| n.ends_with("/data.pkl") || *n == "data.pkl")
            .map(str::to_string)
            .ok_or_else(|| DemucsError::Archive("no data.pkl (not a torch zip checkpoint)".into()))?;
        let prefix = pkl_name.strip_suffix("data.pkl").unwrap_or("").to_string();
        let pkl = read_entry(&mut zip, &pkl_name)?;
        let root = unpickle(&pkl)?;

        let field =
            |k: &str| root.get(k).cloned().ok_or_else(|| DemucsError::Checkpoint(format!("no `{k}` in the package")));
        let klass = field("klass")?;
        let args = root.get("args").cloned().unwrap_or(Value::List(vec![]));
        let kwargs = field("kwargs")?;
        let state_v = field("state")?;
        if state_v.get("__quantized").is_some_and(|q| !matches!(q, Value::Bool(false) | Value::None)) {
            let quantized = read_quantized(&state_v, &prefix, &mut zip)?;
            return Ok(Checkpoint { klass, args, kwargs, state: StateDict::default(), quantized: Some(quantized) });
        }
        let items = state_v.dict_items().ok_or_else(|| DemucsError::Checkpoint("`state` is not a dict".into()))?;
        let mut tensors = BTreeMap::new();
        let mut storages: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        for (k, v) in items {
            let name = k.as_str().ok_or_else(|| DemucsError::Checkpoint("non-string state key".into()))?;
            let t = rebuild_tensor(v, &prefix, &mut zip, &mut storages)
                .map_err(|e| DemucsError::Checkpoint(format!("tensor `{name}`: {e}")))?;
            tensors.insert(name.to_string(), t);
        }
        Ok(Checkpoint { klass, args, kwargs, state: StateDict::new(tensors), quantized: None })
    }
}

/// The `state` of a DiffQ package: `quantized`, `others`, `meta` (a `DiffQuantizer`
/// with `min_size` and `group_size`, packed the int64 way).
fn read_quantized<R: Read + std::io::Seek>(
    state: &Value,
    prefix: &str,
    zip: &mut zip::ZipArchive<R>,
) -> Result<Quantized, DemucsError> {
    let bad = |m: &str| DemucsError::Checkpoint(format!("diffq state: {m}"));
    let meta = state.get("meta").ok_or_else(|| bad("no `meta`"))?;
    match meta.get("klass") {
        Some(Value::Global(m, n)) if m == "diffq.diffq" && n == "DiffQuantizer" => {}
        other => return Err(DemucsError::Unsupported(format!("quantizer {other:?} (only diffq's DiffQuantizer)"))),
    }
    if matches!(meta.get("packed"), Some(Value::Bool(false))) {
        return Err(DemucsError::Unsupported("an unpacked diffq state".into()));
    }
    if matches!(meta.get("torch_pack"), Some(Value::Bool(true))) {
        return Err(DemucsError::Unsupported("a diffq state packed with torch_pack".into()));
    }
    let init = meta.get("init_kwargs");
    let num = |k: &str| match init.and_then(|i| i.get(k)) {
        Some(Value::Float(f)) => Some(*f),
        Some(Value::Int(i)) => Some(*i as f64),
        _ => None,
    };
    // DiffQuantizer's defaults.
    let min_size = num("min_size").unwrap_or(0.01);
    let group_size = num("group_size").unwrap_or(1.0);
    if group_size < 1.0 || group_size.fract() != 0.0 {
        return Err(bad(&format!("group_size {group_size}")));
    }
    if let Some(Value::List(f16)) = state.get("float16") {
        if !f16.is_empty() {
            return Err(DemucsError::Unsupported("diffq float16 parameters".into()));
        }
    }
    let mut storages = BTreeMap::new();
    let mut packed = |v: &Value, what: &str| -> Result<Packed, DemucsError> {
        let (shape, words) = rebuild_words(v, prefix, zip, &mut storages)
            .map_err(|e| DemucsError::Checkpoint(format!("diffq {what}: {e}")))?;
        Ok(Packed { shape, words })
    };
    let list = |k: &str| match state.get(k) {
        Some(Value::List(l)) | Some(Value::Tuple(l)) => Ok(l.clone()),
        _ => Err(bad(&format!("no `{k}` list"))),
    };
    let mut quantized = Vec::new();
    for entry in list("quantized")? {
        let (Value::Tuple(parts) | Value::List(parts)) = &entry else { return Err(bad("an entry is not a tuple")) };
        let [levels, range, bits] = parts.as_slice() else { return Err(bad("an entry is not (levels, range, bits)")) };
        let (Value::List(levels) | Value::Tuple(levels)) = levels else { return Err(bad("levels are not a list")) };
        let levels = levels
            .iter()
            .map(|l| match l {
                Value::None => Ok(None),
                v => packed(v, "levels").map(Some),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let float = |v: &Value| match v {
            Value::Float(f) => Ok(*f),
            Value::Int(i) => Ok(*i as f64),
            _ => Err(bad("a range bound is not a number")),
        };
        let range = match range {
            Value::Tuple(r) | Value::List(r) if r.len() == 2 => (float(&r[0])?, float(&r[1])?),
            _ => return Err(bad("the range is not (min, max)")),
        };
        quantized.push(QuantizedParam { levels, range, bits: packed(bits, "bits")? });
    }
    let mut storages = BTreeMap::new();
    let others = list("others")?
        .iter()
        .map(|v| {
            rebuild_tensor(v, prefix, zip, &mut storages)
                .map_err(|e| DemucsError::Checkpoint(format!("diffq others: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Quantized { min_size, group_size: group_size as usize, quantized, others })
}

/// Largest archive entry read (the pickle or one tensor storage). The largest storage of
/// the released HTDemucs models is a few MB; a model whose single tensor passes 1 GiB is
/// not one this engine runs.
pub const MAX_ENTRY_BYTES: u64 = 1 << 30;

fn read_entry<R: Read + std::io::Seek>(zip: &mut zip::ZipArchive<R>, name: &str) -> Result<Vec<u8>, DemucsError> {
    let f = zip.by_name(name).map_err(|source| DemucsError::Zip { entry: Some(name.into()), source })?;
    let declared = f.size();
    if declared > MAX_ENTRY_BYTES {
        return Err(DemucsError::Archive(format!(
            "{name}: {declared} bytes, more than the {MAX_ENTRY_BYTES} accepted"
        )));
    }
    // The declared size is only a hint: a damaged archive may state anything.
    let mut buf = Vec::with_capacity(declared.min(16 << 20) as usize);
    f.take(MAX_ENTRY_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(|source| DemucsError::EntryRead { entry: name.into(), source })?;
    if buf.len() as u64 > MAX_ENTRY_BYTES {
        return Err(DemucsError::Archive(format!("{name}: more than the {MAX_ENTRY_BYTES} bytes accepted")));
    }
    Ok(buf)
}

#[derive(Clone, Copy)]
enum DType {
    F16,
    BF16,
    F32,
    F64,
    /// `LongStorage`: DiffQ's packed bit words.
    I64,
}

impl DType {
    fn from_storage(name: &str) -> Result<Self, String> {
        Ok(match name {
            "HalfStorage" => DType::F16,
            "BFloat16Storage" => DType::BF16,
            "FloatStorage" => DType::F32,
            "DoubleStorage" => DType::F64,
            "LongStorage" => DType::I64,
            other => return Err(format!("unsupported storage type {other}")),
        })
    }
    fn size(self) -> usize {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }
    /// Element `i` as `f32` (integers are refused where floats are expected).
    fn read(self, b: &[u8], i: usize) -> Result<f32, String> {
        let s = &b[i * self.size()..(i + 1) * self.size()];
        Ok(match self {
            DType::F16 => f16::from_le_bytes([s[0], s[1]]).to_f32(),
            DType::BF16 => bf16::from_le_bytes([s[0], s[1]]).to_f32(),
            DType::F32 => f32::from_le_bytes(s.try_into().unwrap()),
            DType::F64 => f64::from_le_bytes(s.try_into().unwrap()) as f32,
            DType::I64 => return Err("an integer tensor where weights were expected".into()),
        })
    }
    /// Element `i` as the raw 64 bits of an integer storage.
    fn read_word(self, b: &[u8], i: usize) -> Result<u64, String> {
        match self {
            DType::I64 => Ok(u64::from_le_bytes(b[i * 8..(i + 1) * 8].try_into().unwrap())),
            _ => Err("a float tensor where packed integers were expected".into()),
        }
    }
}

fn ints(v: &Value) -> Result<Vec<usize>, String> {
    match v {
        Value::Tuple(items) | Value::List(items) => items
            .iter()
            .map(|x| match x {
                Value::Int(i) if *i >= 0 => Ok(*i as usize),
                _ => Err("expected a non-negative integer".to_string()),
            })
            .collect(),
        _ => Err("expected a tuple of integers".into()),
    }
}

/// `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` of a float
/// tensor, as `f32`.
fn rebuild_tensor<R: Read + std::io::Seek>(
    v: &Value,
    prefix: &str,
    zip: &mut zip::ZipArchive<R>,
    storages: &mut BTreeMap<String, Vec<u8>>,
) -> Result<HostTensor, String> {
    let (shape, data) = rebuild_with(v, prefix, zip, storages, DType::read)?;
    Ok(HostTensor { shape, data })
}

/// An int64 tensor (DiffQ's packed words), as raw `u64`s.
fn rebuild_words<R: Read + std::io::Seek>(
    v: &Value,
    prefix: &str,
    zip: &mut zip::ZipArchive<R>,
    storages: &mut BTreeMap<String, Vec<u8>>,
) -> Result<(Vec<usize>, Vec<u64>), String> {
    rebuild_with(v, prefix, zip, storages, DType::read_word)
}

/// A tensor's shape and elements, each read from its storage by `read`.
fn rebuild_with<R: Read + std::io::Seek, T>(
    v: &Value,
    prefix: &str,
    zip: &mut zip::ZipArchive<R>,
    storages: &mut BTreeMap<String, Vec<u8>>,
    read: fn(DType, &[u8], usize) -> Result<T, String>,
) -> Result<(Vec<usize>, Vec<T>), String> {
    let (callable, args) = match v {
        Value::Object { callable, args, .. } => (callable, args),
        _ => return Err("not a tensor".into()),
    };
    match callable.as_ref() {
        Value::Global(m, n) if m == "torch._utils" && n == "_rebuild_tensor_v2" => {}
        other => return Err(format!("unsupported tensor constructor {other:?}")),
    }
    let args = match args.as_ref() {
        Value::Tuple(a) if a.len() >= 4 => a,
        _ => return Err("bad _rebuild_tensor_v2 arguments".into()),
    };
    let pid = match &args[0] {
        Value::PersId(p) => match p.as_ref() {
            Value::Tuple(t) if t.len() >= 5 => t.clone(),
            _ => return Err("bad storage id".into()),
        },
        _ => return Err("tensor without a storage".into()),
    };
    let dtype = match &pid[1] {
        Value::Global(_, name) => DType::from_storage(name)?,
        _ => return Err("bad storage type".into()),
    };
    let key = pid[2].as_str().ok_or("bad storage key")?.to_string();
    let offset = match &args[1] {
        Value::Int(i) if *i >= 0 => *i as usize,
        _ => return Err("bad storage offset".into()),
    };
    let shape = ints(&args[2])?;
    let stride = ints(&args[3])?;
    if shape.len() != stride.len() {
        return Err(format!("{} dimensions but {} strides", shape.len(), stride.len()));
    }
    if !storages.contains_key(&key) {
        let bytes = read_entry(zip, &format!("{prefix}data/{key}")).map_err(|e| e.to_string())?;
        storages.insert(key.clone(), bytes);
    }
    let bytes = &storages[&key];
    let n_storage = bytes.len() / dtype.size();
    // A saved parameter never has more elements than its storage, and its last element
    // (offset + Σ (size−1)·stride) lies inside it: checked before allocating, so every
    // position below is in bounds and no sum can overflow.
    let outside = || "tensor view outside its storage".to_string();
    let numel =
        shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).filter(|&n| n <= n_storage).ok_or_else(outside)?;
    if numel > 0 {
        let last = shape.iter().zip(&stride).try_fold(offset, |acc, (&d, &s)| (d - 1).checked_mul(s)?.checked_add(acc));
        if last.is_none_or(|l| l >= n_storage) {
            return Err(outside());
        }
    }
    let mut data = Vec::with_capacity(numel);
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..numel {
        let pos = offset + idx.iter().zip(&stride).map(|(i, s)| i * s).sum::<usize>();
        data.push(read(dtype, bytes, pos)?);
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok((shape, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn storage() -> Value {
        Value::PersId(Box::new(Value::Tuple(vec![
            Value::Str("storage".into()),
            Value::Global("torch".into(), "FloatStorage".into()),
            Value::Str("0".into()),
            Value::Str("cpu".into()),
            Value::Int(4),
        ])))
    }

    fn tensor(offset: i64, shape: &[i64], stride: &[i64]) -> Value {
        let ints = |v: &[i64]| Value::Tuple(v.iter().map(|&i| Value::Int(i)).collect());
        Value::Object {
            callable: Box::new(Value::Global("torch._utils".into(), "_rebuild_tensor_v2".into())),
            args: Box::new(Value::Tuple(vec![storage(), Value::Int(offset), ints(shape), ints(stride)])),
            state: None,
            items: Vec::new(),
        }
    }

    fn rebuild(v: &Value) -> Result<HostTensor, String> {
        let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        w.start_file("archive/data/0", zip::write::SimpleFileOptions::default()).unwrap();
        std::io::Write::write_all(&mut w, &[0u8; 16]).unwrap();
        let bytes = w.finish().unwrap().into_inner();
        let mut zip = zip::ZipArchive::new(std::io::Cursor::new(bytes)).unwrap();
        rebuild_tensor(v, "archive/", &mut zip, &mut BTreeMap::new())
    }

    #[test]
    fn a_tensor_view_inside_its_storage_rebuilds() {
        assert_eq!(rebuild(&tensor(1, &[3], &[1])).unwrap().shape, [3]);
        assert_eq!(rebuild(&tensor(0, &[2, 2], &[1, 2])).unwrap().data.len(), 4);
    }

    #[test]
    fn absurd_tensor_headers_are_errors_not_panics_or_huge_allocations() {
        for (offset, shape, stride) in [
            (0, vec![1i64 << 40, 1 << 40], vec![0i64, 0]), // 2^80 elements (overflow)
            (0, vec![1 << 31, 1 << 31], vec![0, 0]),       // 2^62 elements of a 4-element storage
            (0, vec![1 << 26], vec![0]),                   // 2^26 copies of one element
            (-1, vec![1], vec![1]),                        // negative offset
            (i64::MAX, vec![2], vec![1]),                  // offset + index overflows
            (0, vec![2, 2], vec![i64::MAX, 1]),            // index * stride overflows
            (0, vec![5], vec![1]),                         // past the end
        ] {
            let r = rebuild(&tensor(offset, &shape, &stride));
            assert!(r.is_err(), "{offset} {shape:?} {stride:?}: {r:?}");
        }
    }
}
