//! An allocation that a device's memory pool refuses, on a real device (`--features
//! vulkan`; Mesa's lavapipe in CI): CubeCL swallows it on its device thread and the
//! tensor reads back as zeros, so the run must learn of it from
//! `stemq_demucs::device_fault`; the device keeps working afterwards.
#![cfg(feature = "vulkan")]

mod common;

use burn::tensor::Tensor;
use stemq_demucs::device_fault::Watch;
use stemq_demucs::error::DemucsError;
use stemq_demucs::vulkan::{self, PoolLimit, VulkanBackend};

#[test]
fn a_refused_allocation_is_an_out_of_memory_and_the_device_recovers() {
    let Some(adapter) = common::vulkan_adapter("device faults on Vulkan") else { return };
    // No single buffer above 1 MiB: a 1024 × 1024 f32 tensor (4 MiB) is refused.
    let opened = vulkan::open(adapter.index, Some(PoolLimit { max_alloc: 1 << 20 })).unwrap();
    let device = opened.device.clone();
    let small = || Tensor::<VulkanBackend, 2>::ones([64, 64], &device).sum().into_scalar();

    let watch = Watch::start("vulkan");
    assert_eq!(small(), 4096.0);
    watch.check().expect("no fault on a pass that fits");

    let watch = Watch::start("vulkan");
    let big = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let t = Tensor::<VulkanBackend, 2>::ones([1024, 1024], &device);
        (t.clone() * 2.0 + t).sum().into_scalar()
    }));
    // What CubeCL 0.10 gives the caller: a wrong sum, or a panic of its own.
    eprintln!("a pass over the pool's limit returned {:?}", big.as_ref().map_err(|_| "a panic"));
    assert_ne!(big.ok(), Some(3.0 * 1024.0 * 1024.0), "the pool limit did not refuse the buffer");
    match watch.check() {
        Err(DemucsError::DeviceOutOfMemory { device, message }) => {
            assert_eq!(device, "vulkan");
            assert!(message.contains("can't allocate buffer"), "{message}");
        }
        other => panic!("the refused allocation was not seen: {other:?}"),
    }

    let watch = Watch::start("vulkan");
    assert_eq!(small(), 4096.0, "the device computes again after the failure");
    watch.check().expect("no fault after the failure");
}
