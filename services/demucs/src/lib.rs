//! HTDemucs v4 (demucs 4.1.0) ported to Burn.
//!
//! | module | ports |
//! |---|---|
//! | [`checkpoint`] | `.th` packages (torch zip + pickle, fp16 state) without Python |
//! | [`config`] | `HTDemucs.__init__` keyword arguments |
//! | [`cpu`] | host kernels for the CPU backend (attention, convolutions, Winograd, a whole DConv layer, conv + GLU, GroupNorm, GELU/GLU), allocator tuning |
//! | [`stft`] | `HTDemucs._spec` / `_ispec` (`spectro` / `ispectro`) |
//! | [`nn`] | Conv1d/2d, ConvTranspose1d/2d, GroupNorm, LayerNorm, Linear, LayerScale |
//! | [`dconv`] | `DConv` |
//! | [`encoder`] / [`decoder`] | `HEncLayer` / `HDecLayer` |
//! | [`transformer`] | `CrossTransformerEncoder` and its layers |
//! | [`model`] | `HTDemucs` |
//! | [`apply`] | `apply_model`, `BagOfModels`, the whole-track normalisation of `Separator` |
//! | [`batch`] | (stemq's own) forward passes shared by the chunks of several jobs |
//! | [`stream`] | the same with bounded memory, fed block by block |
//! | [`memory`] | the peak memory of a forward pass, from the architecture |
//! | [`repo`] | a local model folder laid out like demucs `--repo` |
//! | [`engine`] | the stemq [`stemq_core::engine::Engine`] |
//!
//! The default backend is Burn's `Flex` CPU backend ([`CpuBackend`]); the `cuda` feature
//! adds `CudaBackend`.

pub mod apply;
pub mod batch;
pub mod checkpoint;
pub mod config;
pub mod cpu;
pub mod dconv;
pub mod decoder;
pub mod diffq;
pub mod encoder;
pub mod engine;
pub mod error;
pub mod memory;
pub mod model;
pub mod nn;
pub mod pickle;
pub mod recurrent;
pub mod repo;
pub mod stft;
pub mod stream;
pub mod transformer;
pub mod wave;

pub use burn;
pub use error::DemucsError;

/// The CPU backend.
pub type CpuBackend = burn_flex::Flex;

/// The CUDA backend.
#[cfg(feature = "cuda")]
pub type CudaBackend = burn::backend::Cuda;
