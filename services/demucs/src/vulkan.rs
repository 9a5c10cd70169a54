//! The Vulkan devices (feature `vulkan`): Burn's wgpu backend with CubeCL's SPIR-V
//! compiler, on any GPU with a Vulkan driver (AMD, Intel, NVIDIA) and on Mesa's
//! software driver lavapipe, which runs the same kernels on the CPU.
//!
//! This module owns what stemq knows of them: the list the driver gives
//! ([`adapters`]), which one `vulkan` and `vulkan:<n>` name ([`resolve`]), and opening
//! one for the engine ([`open`]): its CubeCL client, with a pool limit when one is
//! asked for ([`PoolLimit`]), the size of its device-local memory (the memory budget's
//! base) and whether it takes `f16` weights.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};

use burn::backend::wgpu::{graphics, init_setup, MemoryConfiguration, RuntimeOptions, WgpuDevice};
use burn::tensor::backend::Backend;
use burn::tensor::DType;
use cubecl_runtime::memory_management::{MemoryPoolOptions, PoolType};
use stemq_core::device::Device;

use crate::error::DemucsError;

/// The Vulkan backend: CubeCL's kernels compiled to SPIR-V, in `f32`.
pub type VulkanBackend = burn::backend::Vulkan<f32, i32>;

/// The kind of a Vulkan device, as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Discrete,
    Integrated,
    Virtual,
    /// A software driver running on the CPU (lavapipe, SwiftShader).
    Cpu,
    Other,
}

/// One Vulkan device in the driver's list.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// Its place in the driver's list: `vulkan:<index>`.
    pub index: u32,
    /// `llvmpipe (LLVM 15.0.6, 256 bits)`, `AMD Radeon RX 7900 XTX`, ...
    pub name: String,
    /// The driver: `llvmpipe`, `radv`, `NVIDIA`, ...
    pub driver: String,
    pub kind: Kind,
    /// CubeCL's name of the same device (kind and the index among that kind).
    cubecl: WgpuDevice,
}

impl Adapter {
    /// Its device: `vulkan:<index>`.
    pub fn device(&self) -> Device {
        Device::Vulkan(Some(self.index))
    }
}

/// The Vulkan devices of this machine, in the driver's order (read once). Empty when
/// there is no Vulkan loader or driver.
pub fn adapters() -> &'static [Adapter] {
    static ADAPTERS: OnceLock<Vec<Adapter>> = OnceLock::new();
    ADAPTERS.get_or_init(|| {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: wgpu::Backends::VULKAN,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let found = block_on(instance.enumerate_adapters(wgpu::Backends::VULKAN));
        let mut per_kind: HashMap<u8, usize> = HashMap::new();
        found
            .iter()
            .enumerate()
            .map(|(index, a)| {
                let info = a.get_info();
                let kind = match info.device_type {
                    wgpu::DeviceType::DiscreteGpu => Kind::Discrete,
                    wgpu::DeviceType::IntegratedGpu => Kind::Integrated,
                    wgpu::DeviceType::VirtualGpu => Kind::Virtual,
                    wgpu::DeviceType::Cpu => Kind::Cpu,
                    wgpu::DeviceType::Other => Kind::Other,
                };
                // CubeCL counts devices per kind, in the same enumeration order.
                let nth = per_kind.entry(kind as u8).or_default();
                let cubecl = match kind {
                    Kind::Discrete => WgpuDevice::DiscreteGpu(*nth),
                    Kind::Integrated => WgpuDevice::IntegratedGpu(*nth),
                    Kind::Virtual => WgpuDevice::VirtualGpu(*nth),
                    Kind::Cpu => WgpuDevice::Cpu,
                    Kind::Other => WgpuDevice::DefaultDevice,
                };
                *nth += 1;
                Adapter { index: index as u32, name: info.name, driver: info.driver, kind, cubecl }
            })
            .collect()
    })
}

/// The device `vulkan` (`index` `None`) or `vulkan:<index>` names. `vulkan` is the
/// first discrete GPU, else integrated, else virtual; a software driver only when
/// `software` says it may be chosen (asked for by name: a worker that merely has Mesa
/// installed keeps its CPU host kernels, which are faster than lavapipe).
pub fn resolve(index: Option<u32>, software: bool) -> Option<&'static Adapter> {
    let all = adapters();
    match index {
        Some(i) => all.iter().find(|a| a.index == i),
        None => [Kind::Discrete, Kind::Integrated, Kind::Virtual, Kind::Cpu, Kind::Other]
            .into_iter()
            .filter(|k| software || !matches!(k, Kind::Cpu | Kind::Other))
            .find_map(|k| all.iter().find(|a| a.kind == k)),
    }
}

/// The device names of this machine, for messages: `vulkan:0 (llvmpipe ...)`.
pub fn describe() -> String {
    let all = adapters();
    if all.is_empty() {
        return "no Vulkan device (no Vulkan driver installed: Mesa's `mesa-vulkan-drivers` has lavapipe)".into();
    }
    all.iter().map(|a| format!("{} ({}, {:?})", a.device(), a.name, a.kind)).collect::<Vec<_>>().join(", ")
}

/// A limit on the device memory pool: no single allocation above `max_alloc` bytes.
/// An allocation over it fails in CubeCL's memory manager as it would on a device that
/// ran out of memory (`can't allocate buffer of size`), which the worker's
/// out-of-memory ladder steps down from: how the ladder is tested on a real device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLimit {
    pub max_alloc: u64,
}

/// A Vulkan device opened for the engine.
#[derive(Debug)]
pub struct Opened {
    pub adapter: &'static Adapter,
    /// What Burn's tensors name it by.
    pub device: WgpuDevice,
    /// Bytes of its device-local memory heap, as the driver reports it.
    pub device_memory: Option<u64>,
    /// Whether it takes `f16` tensors (`--gpu-weights f16`).
    pub f16: bool,
    /// The pool limit it was opened with.
    pub pool_limit: Option<PoolLimit>,
}

/// Opens `vulkan:<index>` once per process (CubeCL keeps one client per device; later
/// calls get the same one, whatever `pool_limit` they pass).
pub fn open(index: u32, pool_limit: Option<PoolLimit>) -> Result<Arc<Opened>, DemucsError> {
    static OPENED: OnceLock<Mutex<HashMap<u32, Arc<Opened>>>> = OnceLock::new();
    let mut opened = OPENED.get_or_init(Default::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(o) = opened.get(&index) {
        return Ok(o.clone());
    }
    let adapter = resolve(Some(index), true).ok_or_else(|| {
        DemucsError::DeviceUnavailable(format!("there is no device vulkan:{index}; the devices here: {}", describe()))
    })?;
    let memory_config = match pool_limit {
        None => MemoryConfiguration::default(),
        Some(l) => MemoryConfiguration::Custom {
            pool_options: vec![MemoryPoolOptions {
                pool_type: PoolType::ExclusivePages { max_alloc_size: l.max_alloc },
                dealloc_period: None,
            }],
        },
    };
    let options = RuntimeOptions { memory_config, ..RuntimeOptions::default() };
    let init = std::panic::AssertUnwindSafe(|| init_setup::<graphics::Vulkan>(&adapter.cubecl, options));
    let setup = std::panic::catch_unwind(init).map_err(|p| {
        let why = stemq_core::engine::panic_message(p.as_ref()).unwrap_or_default();
        DemucsError::DeviceUnavailable(format!("{} ({}) did not open: {why}", adapter.device(), adapter.name))
    })?;
    let device_memory = device_local_bytes(&setup.adapter);
    let f16 = VulkanBackend::supports_dtype(&adapter.cubecl, DType::F16);
    tracing::info!(device = %adapter.device(), name = %adapter.name, driver = %adapter.driver,
        kind = ?adapter.kind, device_memory, f16, ?pool_limit, "Vulkan device opened");
    let o = Arc::new(Opened { adapter, device: adapter.cubecl.clone(), device_memory, f16, pool_limit });
    opened.insert(index, o.clone());
    Ok(o)
}

/// The size of the adapter's first device-local memory heap (`VkMemoryHeap::size`).
fn device_local_bytes(adapter: &wgpu::Adapter) -> Option<u64> {
    // SAFETY: the raw Vulkan handles are only read, while the adapter is alive.
    unsafe {
        let hal = adapter.as_hal::<wgpu::hal::api::Vulkan>()?;
        let instance = hal.shared_instance().raw_instance();
        let props = instance.get_physical_device_memory_properties(hal.raw_physical_device());
        // VK_MEMORY_HEAP_DEVICE_LOCAL_BIT is bit 0.
        props.memory_heaps[..props.memory_heap_count as usize]
            .iter()
            .find(|h| h.flags.as_raw() & 1 != 0)
            .map(|h| h.size)
    }
}

/// Runs a future to completion on this thread (wgpu's native futures are ready at
/// once; this only waits for them).
fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        match f.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(v) => return v,
            std::task::Poll::Pending => std::thread::park(),
        }
    }
}

/// What a device's memory pool holds now: bytes in live tensors and bytes reserved
/// from the driver (pages kept for reuse). Reserved memory grows to the working set of
/// the largest forward pass and stays there; it does not grow with the track.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolUsage {
    pub in_use: u64,
    pub reserved: u64,
}

/// The pool of an opened device, read from CubeCL's memory manager.
pub fn pool_usage(opened: &Opened) -> Option<PoolUsage> {
    use cubecl_runtime::runtime::Runtime;
    let client = burn::backend::wgpu::WgpuRuntime::client(&opened.device);
    let usage = client.memory_usage().ok()?;
    Some(PoolUsage { in_use: usage.bytes_in_use, reserved: usage.bytes_reserved })
}
