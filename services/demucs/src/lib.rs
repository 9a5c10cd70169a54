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
//! | [`device_fault`] | (stemq's own) allocation failures and other faults on CubeCL's device threads, which CubeCL swallows |
//! | [`engine`] | the stemq [`stemq_core::engine::Engine`] |
//! | `vulkan` | (feature `vulkan`) the Vulkan devices: naming, opening, memory |
//!
//! The default backend is Burn's `Flex` CPU backend ([`CpuBackend`]); the `cuda` feature
//! adds `CudaBackend`, the `vulkan` feature `VulkanBackend` (both CubeCL: the same
//! kernels, through CubeCL's CUDA and SPIR-V compilers).
//!
//! ## What differs between the CPU and a device
//!
//! Every difference is listed here; everything else (checkpoints, the STFT and iSTFT on
//! the host, normalisation, chunking and overlap-add, the BLSTM and LocalState of v3,
//! the waveform model, streaming, cross-job batching) is one code path for all
//! backends, so a run on `vulkan` covers on a device all that `cuda` runs except the
//! last table's rows.
//!
//! | where | on the CPU ([`cpu::is_cpu`] true) | on a device (Vulkan, CUDA; and the CPU with `STEMQ_DEMUCS_GENERIC_OPS=1`) |
//! |---|---|---|
//! | `nn::Conv1d::forward` | [`cpu::conv_axis`] for kernels > 1 | Burn's `conv1d` |
//! | `nn::Conv1d::forward_sum_glu`, `nn::Conv2d::forward_sum_glu` | [`cpu::conv_glu()`], [`cpu::conv3x3`] (Winograd) | add, Burn's `conv1d`/`conv2d`, `glu` |
//! | `nn::Conv2d::forward` | [`cpu::conv_axis`] along the kernel's axis | Burn's `conv2d` |
//! | `nn::ConvTranspose1d`/`2d` `forward`, `forward_crop` | [`cpu::conv_transpose_axis`] (and `_crop`, GELU fused) | Burn's `conv_transpose1d`/`2d`, `narrow`, `gelu` |
//! | `nn::GroupNorm` (`forward3`, `forward_rows`, `forward_channels_last`) | [`cpu::group_norm_in_place`] (f64 statistics) | Burn's `var_mean` and broadcasts |
//! | `nn::LayerNorm::forward` | [`cpu::layer_norm_in_place`] | Burn's `var_mean` |
//! | `nn::Linear::forward` | [`cpu::linear`] (one gemm, bias folded in) | Burn's `matmul` and add |
//! | `nn::LayerScale::residual_cl` | one pass, in place | multiply and add |
//! | `dconv::DConv` (layers without BLSTM/LocalState) | [`cpu::dconv_layer_in_place`], the whole layer in cache-sized chunks | the layer op by op |
//! | `transformer` attention | [`cpu::attention()`] | Burn's fused `attention` |
//! | engine: passes at once | threads (`cpu_jobs`, `-j`), one segment a pass | one pass, `gpu_batch` segments a batch |
//! | engine: weights | `f32` | `--gpu-weights` (`f16` where the device takes it, else `f32` with a warning) |
//! | engine: memory budget | `--memory-budget`, else none | `--memory-budget`, else 80 % of the device's memory (CUDA: free memory once the model is loaded; Vulkan: the device-local heap) |
//! | engine: out of memory | an allocation failure on the host (rare) | an allocation the pool refuses on CubeCL's device thread, which CubeCL swallows ([`device_fault`], checked after every block), and the caller's own allocation panics ([`engine::is_out_of_memory`]), both turned into [`stemq_core::engine::EngineError::OutOfMemory`] |
//!
//! What only CUDA runs, which a Vulkan device does not cover: CubeCL's CUDA compiler
//! and runtime (NVRTC, streams), its choice of matmul and convolution kernels where
//! the hardware has tensor cores (lavapipe has no cooperative matrices, so CubeCL
//! takes its plain kernels there), and the free-memory reading through the CUDA
//! driver. `scripts/gpu_check.sh` runs the parity suites' `cuda::` tests, the engine
//! and the speed figures on a lent NVIDIA GPU.

pub mod apply;
pub mod batch;
pub mod checkpoint;
pub mod config;
pub mod cpu;
pub mod dconv;
pub mod decoder;
pub mod device_fault;
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
#[cfg(feature = "vulkan")]
pub mod vulkan;
pub mod wave;

pub use burn;
pub use error::DemucsError;

/// The CPU backend.
pub type CpuBackend = burn_flex::Flex;

/// The CUDA backend.
#[cfg(feature = "cuda")]
pub type CudaBackend = burn::backend::Cuda;

/// The Vulkan backend ([`vulkan`]).
#[cfg(feature = "vulkan")]
pub use vulkan::VulkanBackend;
