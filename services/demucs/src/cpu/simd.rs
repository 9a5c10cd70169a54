//! Run-time dispatch of the hot loops to the widest vector unit the CPU has.
//!
//! The loops themselves are plain Rust written in [`LANES`]-wide chunks
//! (`#[inline(always)]`, in their kernel's module); the wrappers here compile them again
//! inside `#[target_feature]` functions, and [`dispatch!`] picks one at run time. Only
//! x86-64 has wrappers; elsewhere the portable build runs.

/// Lanes the loops are written for; the compiler maps them onto the vector unit.
pub(super) const LANES: usize = 16;

/// Runs `$f(args)` compiled for the widest vector unit the CPU has (chosen at run
/// time): `simd::x86::avx512::$f`, `simd::x86::avx2::$f`, or the portable `$f` in scope
/// at the call site. Returns from the calling function.
macro_rules! dispatch {
    ($f:ident($($a:expr),*)) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the wrapper's only precondition is that the CPU has AVX-512F,
                // which was just detected.
                return unsafe { $crate::cpu::simd::x86::avx512::$f($($a),*) };
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: the wrapper's only precondition is that the CPU has AVX2 and
                // FMA, both just detected.
                return unsafe { $crate::cpu::simd::x86::avx2::$f($($a),*) };
            }
        }
        $f($($a),*)
    }};
}

/// `#[target_feature]` builds of the kernels' inner loops.
///
/// # Safety
///
/// Every function here is safe to call exactly when the CPU supports the features its
/// module is named after; their bodies are safe code (slices, no raw pointers).
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    /// Built with AVX-512F.
    pub mod avx512 {
        use crate::cpu::{activation, attention, dconv, norm};

        /// [`dconv::sum_lanes_impl`] with AVX-512F.
        ///
        /// # Safety
        /// The CPU must support AVX-512F.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn sum_lanes_impl(x: &[f32]) -> f32 {
            dconv::sum_lanes_impl(x)
        }

        /// [`dconv::sum_sq_dev_lanes_impl`] with AVX-512F.
        ///
        /// # Safety
        /// The CPU must support AVX-512F.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn sum_sq_dev_lanes_impl(x: &[f32], center: f32) -> f32 {
            dconv::sum_sq_dev_lanes_impl(x, center)
        }

        /// [`dconv::affine_gelu_impl`] with AVX-512F.
        ///
        /// # Safety
        /// The CPU must support AVX-512F.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn affine_gelu_impl(x: &mut [f32], a: f32, b: f32) {
            dconv::affine_gelu_impl(x, a, b)
        }

        /// [`dconv::glu_affine_add_impl`] with AVX-512F.
        ///
        /// # Safety
        /// The CPU must support AVX-512F.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn glu_affine_add_impl(out: &mut [f32], a: &[f32], b: &[f32], k: [f32; 5]) {
            dconv::glu_affine_add_impl(out, a, b, k)
        }

        /// [`attention::softmax_numerators_impl`] with AVX-512F.
        ///
        /// # Safety
        /// The CPU must support AVX-512F.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn softmax_numerators_impl(row: &mut [f32]) -> f32 {
            attention::softmax_numerators_impl(row)
        }

        /// [`activation::gelu_impl`] with AVX-512F.
        ///
        /// # Safety
        /// The CPU must support AVX-512F.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn gelu_impl(x: &mut [f32]) {
            activation::gelu_impl(x)
        }

        /// [`activation::glu_scale_add_impl`] with AVX-512F.
        ///
        /// # Safety
        /// The CPU must support AVX-512F.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn glu_scale_add_impl(x: &mut [f32], y: &[f32], scale: &[f32], r: usize) {
            activation::glu_scale_add_impl(x, y, scale, r)
        }

        /// `Σ (x − center)²` in f64 lanes with AVX-512F.
        ///
        /// # Safety
        /// The CPU must support AVX-512F.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn sum_sq_f64_impl(x: &[f32], center: f64) -> f64 {
            norm::sum_sq_f64_impl(x, center)
        }

        /// `Σ (x − center)` in f64 lanes with AVX-512F.
        ///
        /// # Safety
        /// The CPU must support AVX-512F.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn sum_centered_f64_impl(x: &[f32], center: f64) -> f64 {
            norm::sum_centered_f64_impl(x, center)
        }
    }

    /// Built with AVX2 and FMA.
    pub mod avx2 {
        use crate::cpu::{activation, attention, dconv, norm};

        /// [`dconv::sum_lanes_impl`] with AVX2 and FMA.
        ///
        /// # Safety
        /// The CPU must support AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn sum_lanes_impl(x: &[f32]) -> f32 {
            dconv::sum_lanes_impl(x)
        }

        /// [`dconv::sum_sq_dev_lanes_impl`] with AVX2 and FMA.
        ///
        /// # Safety
        /// The CPU must support AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn sum_sq_dev_lanes_impl(x: &[f32], center: f32) -> f32 {
            dconv::sum_sq_dev_lanes_impl(x, center)
        }

        /// [`dconv::affine_gelu_impl`] with AVX2 and FMA.
        ///
        /// # Safety
        /// The CPU must support AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn affine_gelu_impl(x: &mut [f32], a: f32, b: f32) {
            dconv::affine_gelu_impl(x, a, b)
        }

        /// [`dconv::glu_affine_add_impl`] with AVX2 and FMA.
        ///
        /// # Safety
        /// The CPU must support AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn glu_affine_add_impl(out: &mut [f32], a: &[f32], b: &[f32], k: [f32; 5]) {
            dconv::glu_affine_add_impl(out, a, b, k)
        }

        /// [`attention::softmax_numerators_impl`] with AVX2 and FMA.
        ///
        /// # Safety
        /// The CPU must support AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn softmax_numerators_impl(row: &mut [f32]) -> f32 {
            attention::softmax_numerators_impl(row)
        }

        /// [`activation::gelu_impl`] with AVX2 and FMA.
        ///
        /// # Safety
        /// The CPU must support AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn gelu_impl(x: &mut [f32]) {
            activation::gelu_impl(x)
        }

        /// [`activation::glu_scale_add_impl`] with AVX2 and FMA.
        ///
        /// # Safety
        /// The CPU must support AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn glu_scale_add_impl(x: &mut [f32], y: &[f32], scale: &[f32], r: usize) {
            activation::glu_scale_add_impl(x, y, scale, r)
        }

        /// `Σ (x − center)²` in f64 lanes with AVX2 and FMA.
        ///
        /// # Safety
        /// The CPU must support AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn sum_sq_f64_impl(x: &[f32], center: f64) -> f64 {
            norm::sum_sq_f64_impl(x, center)
        }

        /// `Σ (x − center)` in f64 lanes with AVX2 and FMA.
        ///
        /// # Safety
        /// The CPU must support AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn sum_centered_f64_impl(x: &[f32], center: f64) -> f64 {
            norm::sum_centered_f64_impl(x, center)
        }
    }
}
