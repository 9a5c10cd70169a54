//! The scalar functions the kernels share, written so loops over them vectorise: `exp`
//! (softmax, sigmoid) and `erf` (GELU). Both are branch-free polynomials in `f32`.

/// `exp(x)`: Cephes's `expf` reduction `x = n ln2 + r`, `|r| <= ln2/2`, and its
/// degree-6 polynomial, then `2^n` through the exponent bits. Arguments are clamped to
/// [-87.3, 88.3]: below, 1.2e-38 (nothing against the softmax row maximum's 1 or
/// sigmoid's 1; PyTorch returns a subnormal or 0); above, 2e38 (sigmoid's 1/(1+e^x)
/// is 0 either way).
#[inline(always)]
#[allow(clippy::excessive_precision)] // Cephes's coefficients, as published
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4; // ln 2, high part (exact in few bits)
    const C2: f32 = -2.121_944_4e-4; // ln 2 - C1
    let x = x.clamp(-87.3, 88.3);
    // round-to-nearest of x·log2(e) via the 1.5·2^23 shifter
    let shifter = 12_582_912.0f32;
    let t = x.mul_add(LOG2E, shifter);
    let n = t - shifter;
    let r = n.mul_add(-C2, n.mul_add(-C1, x));
    let mut p = 1.987_569_2e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 5.000_000_1e-1);
    let e = (p * r).mul_add(r, r) + 1.0;
    // 2^n: n is an integer in [-126, 127]; the shifter left it in t's low mantissa bits.
    let bits = (t.to_bits() as i32).wrapping_sub(0x4B40_0000).wrapping_add(127) << 23;
    e * f32::from_bits(bits as u32)
}

/// `erf(x)`, within 2e-7 absolute of the exact value (f32 carries ~6e-8 at 1):
/// the Maclaurin series on `|x| < 1`, `1 - erfc(|x|)` from a Chebyshev fit above, both
/// evaluated and selected without branches so the loop vectorises.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let a = x.abs();
    // |x| < 1: x · P(x²), the series to x²⁰ (the next term is 1e-9).
    let z = a * a;
    let mut p = ERF_SMALL[0];
    for &c in &ERF_SMALL[1..] {
        p = p.mul_add(z, c);
    }
    let small = a * p;
    // |x| >= 1: erfc(a) = t · exp(-a² + Q(t)), t = 1/(1 + a/2).
    let t = 1.0 / (1.0 + 0.5 * a);
    let mut q = ERF_LARGE[0];
    for &c in &ERF_LARGE[1..] {
        q = q.mul_add(t, c);
    }
    let large = 1.0 - t * exp(-z + q);
    let r = if a < 1.0 { small } else { large.min(1.0) };
    r.copysign(x)
}

/// Coefficients of `erf(x)/x` as a polynomial in `x²`, highest first (Maclaurin series
/// of erf: 2/√π · Σ (-1)ⁿ x²ⁿ / (n! (2n+1)), truncated where the terms fall below 1e-9
/// on |x| < 1).
const ERF_SMALL: [f32; 11] = {
    // 2/sqrt(pi) * (-1)^n / (n! (2n+1)), n = 10..0
    const K: f64 = std::f64::consts::FRAC_2_SQRT_PI;
    const fn term(n: u32) -> f32 {
        let mut fact = 1.0f64;
        let mut i = 1;
        while i <= n {
            fact *= i as f64;
            i += 1;
        }
        let sign = if n.is_multiple_of(2) { 1.0 } else { -1.0 };
        (K * sign / (fact * (2 * n + 1) as f64)) as f32
    }
    [term(10), term(9), term(8), term(7), term(6), term(5), term(4), term(3), term(2), term(1), term(0)]
};

/// Numerical Recipes' `erfc` Chebyshev fit (`erfcc`, fractional error < 1.2e-7):
/// `erfc(a) = t · exp(-a² - 1.26551223 + t·(1.00002368 + t·(…)))`, `t = 1/(1 + a/2)`;
/// highest power first, the constant term folded in.
#[allow(clippy::excessive_precision)] // as published
const ERF_LARGE: [f32; 10] = [
    0.170_872_77,
    -0.822_152_23,
    1.488_515_87,
    -1.135_203_98,
    0.278_868_07,
    -0.186_288_06,
    0.096_784_18,
    0.374_091_96,
    1.000_023_68,
    -1.265_512_23,
];

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Relative error of `a` against the f64 value `b`.
    fn close(a: f32, b: f64) -> f64 {
        ((a as f64) - b).abs() / b.abs().max(f64::MIN_POSITIVE)
    }

    #[test]
    fn exp_is_within_two_ulp() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            worst = worst.max(close(exp(x), (x as f64).exp()));
            x += 0.000_731;
        }
        assert!(worst < 2.5e-7, "worst relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) < 1.3e-38);
    }

    #[test]
    fn erf_is_within_2e7_absolute() {
        let mut worst = 0f64;
        let mut x = -6.0f32;
        while x <= 6.0 {
            let exact = libm_erf(x as f64);
            worst = worst.max(((erf(x) as f64) - exact).abs());
            x += 0.000_37;
        }
        assert!(worst < 2e-7, "worst absolute error {worst:e}");
    }

    /// erf in f64 from its continued fraction / series (reference only).
    pub(in crate::cpu) fn libm_erf(x: f64) -> f64 {
        // Series for |x| < 3, asymptotic complement above: both far below f32's error.
        let a = x.abs();
        let r = if a < 3.0 {
            let mut sum = 0f64;
            let mut term = a;
            let mut n = 0f64;
            loop {
                let t = term / (2.0 * n + 1.0);
                sum += t;
                if t.abs() < 1e-17 {
                    break;
                }
                n += 1.0;
                term *= -a * a / n;
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            // erfc continued fraction (Lentz), 60 terms.
            let mut f = 0f64;
            for k in (1..60).rev() {
                f = (k as f64 / 2.0) / (a + f);
            }
            1.0 - (-a * a).exp() / std::f64::consts::PI.sqrt() / (a + f)
        };
        r.copysign(x)
    }
}
