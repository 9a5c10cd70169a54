//! Owns the streamed FLAC encoder (stereo, 16 or 24 bit), written for this crate.
//!
//! It follows what libFLAC does at its default level (`flac -5`) and produces standard,
//! lossless FLAC: fixed block size of 4096 samples; per frame it picks the cheapest of
//! independent, left/side, right/side and mid/side stereo; each subframe is the cheapest
//! of CONSTANT (digital silence), FIXED (polynomial predictor of order 0–4, chosen by
//! the smallest sum of absolute residuals), LPC (order 1–8: Tukey(0.5)-windowed
//! autocorrelation, Levinson–Durbin, the order libFLAC's bit estimate picks, coefficients
//! quantised to libFLAC's precision) and VERBATIM; residuals are partitioned-Rice coded
//! (partition order 0–8, each parameter the cheapest near the partition's mean).
//! STREAMINFO's total sample count, frame sizes and the MD5 of the samples are patched
//! at [`FlacWriter::finish`], so `flac -t` verifies the file. Size against libFLAC is in
//! `docs/benchmarks.md`.

use std::io::{Seek, SeekFrom, Write};

use md5::{Digest, Md5};

use crate::error::AudioError;
use crate::wav::float_to_int;

const BLOCK: usize = 4096;
const MAX_PARTITION_ORDER: u32 = 8;

struct BitWriter {
    bytes: Vec<u8>,
    acc: u64,
    nbits: u32,
}

impl BitWriter {
    fn new() -> Self {
        BitWriter { bytes: Vec::with_capacity(BLOCK * 8), acc: 0, nbits: 0 }
    }
    /// Writes the low `n` bits of `value` (n <= 32).
    #[inline]
    fn put(&mut self, value: u64, n: u32) {
        if n == 0 {
            return;
        }
        self.acc = (self.acc << n) | (value & ((1u64 << n) - 1));
        self.nbits += n;
        while self.nbits >= 8 {
            self.nbits -= 8;
            self.bytes.push((self.acc >> self.nbits) as u8);
        }
    }
    #[inline]
    fn put_signed(&mut self, value: i64, n: u32) {
        self.put(value as u64, n);
    }
    #[inline]
    fn put_unary(&mut self, mut zeros: u64) {
        while zeros >= 32 {
            self.put(0, 32);
            zeros -= 32;
        }
        self.put(1, zeros as u32 + 1);
    }
    fn align(&mut self) {
        if self.nbits > 0 {
            self.put(0, 8 - self.nbits);
        }
    }
}

fn crc8(data: &[u8]) -> u8 {
    let mut crc: u8 = 0;
    for &b in data {
        crc ^= b;
        for _ in 0..8 {
            crc = if crc & 0x80 != 0 { (crc << 1) ^ 0x07 } else { crc << 1 };
        }
    }
    crc
}

fn crc16_table() -> [u16; 256] {
    let mut t = [0u16; 256];
    for (i, e) in t.iter_mut().enumerate() {
        let mut c = (i as u16) << 8;
        for _ in 0..8 {
            c = if c & 0x8000 != 0 { (c << 1) ^ 0x8005 } else { c << 1 };
        }
        *e = c;
    }
    t
}

fn crc16(table: &[u16; 256], data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc = (crc << 8) ^ table[((crc >> 8) as u8 ^ b) as usize];
    }
    crc
}

fn utf8_number(x: u64, out: &mut Vec<u8>) {
    if x < 0x80 {
        out.push(x as u8);
        return;
    }
    let n = match x {
        _ if x < 1 << 11 => 2,
        _ if x < 1 << 16 => 3,
        _ if x < 1 << 21 => 4,
        _ if x < 1 << 26 => 5,
        _ if x < 1 << 31 => 6,
        _ => 7,
    };
    let first_prefix: u8 = if n == 7 { 0xFE } else { 0xFFu8 << (8 - n) };
    out.push(first_prefix | (x >> (6 * (n - 1))) as u8);
    for i in (0..n - 1).rev() {
        out.push(0x80 | ((x >> (6 * i)) & 0x3F) as u8);
    }
}

fn fixed_residual(x: &[i64], order: usize, out: &mut Vec<i64>) {
    out.clear();
    for i in order..x.len() {
        let e = match order {
            0 => x[i],
            1 => x[i] - x[i - 1],
            2 => x[i] - 2 * x[i - 1] + x[i - 2],
            3 => x[i] - 3 * x[i - 1] + 3 * x[i - 2] - x[i - 3],
            _ => x[i] - 4 * x[i - 1] + 6 * x[i - 2] - 4 * x[i - 3] + x[i - 4],
        };
        out.push(e);
    }
}

#[inline]
fn zigzag(e: i64) -> u64 {
    ((e << 1) ^ (e >> 63)) as u64
}

/// Exact bit cost of Rice-coding `res` with parameter `k`.
fn rice_bits(res: &[u64], k: u32) -> u64 {
    res.iter().map(|&u| u >> k).sum::<u64>() + res.len() as u64 * (1 + k as u64)
}

/// The cheapest Rice parameter for one partition (zig-zagged residuals `res`) and its
/// exact cost: estimated from the mean, then the neighbours are tried.
fn rice_param(res: &[u64], max_k: u32) -> (u32, u64) {
    if res.is_empty() {
        return (0, 0);
    }
    let mean = res.iter().sum::<u64>() / res.len() as u64;
    let mut k = 0u32;
    while k < max_k && (1u64 << (k + 1)) <= mean + 1 {
        k += 1;
    }
    let mut best = (k, rice_bits(res, k));
    for cand in [k.saturating_sub(1), (k + 1).min(max_k)] {
        let bits = rice_bits(res, cand);
        if bits < best.1 {
            best = (cand, bits);
        }
    }
    best
}

/// Partitioned Rice coding of one subframe's residual.
struct RicePlan {
    porder: u32,
    params: Vec<u32>,
    /// RICE2 (5-bit parameters), needed when a parameter exceeds 14.
    wide: bool,
    /// Bits of the whole residual section: method, partition order, parameters, codes.
    bits: u64,
}

/// The Rice parameter near `sum / count` and the estimated cost of `count` residuals
/// whose zig-zag values sum to `sum` (`(sum >> k)` for the quotients).
fn rice_estimate(sum: u64, count: usize, max_k: u32) -> (u32, u64) {
    if count == 0 {
        return (0, 0);
    }
    let mean = sum / count as u64;
    let mut k = 0u32;
    while k < max_k && (1u64 << (k + 1)) <= mean + 1 {
        k += 1;
    }
    (k, count as u64 * (1 + k as u64) + (sum >> k))
}

/// Picks the partition order and parameters for `residual` (the first partition is
/// `order` samples shorter: the warm-up samples are not coded as residuals). The
/// partition order is chosen on estimated costs from partition sums (each level the sum
/// of the finer one's pairs, so one pass over the residual), then each parameter of the
/// chosen order exactly.
fn plan_rice(residual: &[i64], n: usize, order: usize, zz: &mut Vec<u64>) -> RicePlan {
    zz.clear();
    zz.extend(residual.iter().map(|&e| zigzag(e)));
    let mut max_porder = 0;
    while max_porder < MAX_PARTITION_ORDER && n % (1 << (max_porder + 1)) == 0 && n >> (max_porder + 1) > order {
        max_porder += 1;
    }
    let plen = n >> max_porder;
    let mut sums: Vec<u64> = Vec::with_capacity(1 << max_porder);
    let mut counts: Vec<usize> = Vec::with_capacity(1 << max_porder);
    let mut idx = 0;
    for p in 0..1usize << max_porder {
        let count = if p == 0 { plen - order } else { plen };
        sums.push(zz[idx..idx + count].iter().sum());
        counts.push(count);
        idx += count;
    }
    let mut best = (u64::MAX, 0u32);
    let mut porder = max_porder;
    loop {
        let mut bits = 0u64;
        let mut wide = false;
        for (&sum, &count) in sums.iter().zip(&counts) {
            let (k, c) = rice_estimate(sum, count, 30);
            wide |= k > 14;
            bits += c;
        }
        bits += sums.len() as u64 * if wide { 5 } else { 4 };
        if bits < best.0 {
            best = (bits, porder);
        }
        if porder == 0 {
            break;
        }
        porder -= 1;
        sums = sums.chunks(2).map(|c| c[0] + c[1]).collect();
        counts = counts.chunks(2).map(|c| c[0] + c[1]).collect();
    }
    let porder = best.1;
    let plen = n >> porder;
    let mut params = Vec::with_capacity(1 << porder);
    let mut bits = 0u64;
    let mut wide = false;
    let mut idx = 0usize;
    for p in 0..1usize << porder {
        let count = if p == 0 { plen - order } else { plen };
        let (k, c) = rice_param(&zz[idx..idx + count], 30);
        idx += count;
        wide |= k > 14;
        params.push(k);
        bits += c;
    }
    bits += 2 + 4 + params.len() as u64 * if wide { 5 } else { 4 };
    RicePlan { porder, params, wide, bits }
}

/// Plan for one subframe.
enum Sub {
    Constant(i64),
    Verbatim,
    Fixed { order: usize, rice: RicePlan, residual: Vec<i64> },
    Lpc { order: usize, precision: u32, shift: u32, coefs: Vec<i32>, rice: RicePlan, residual: Vec<i64> },
}

struct Planned {
    sub: Sub,
    bits: u64,
}

/// Largest LPC order tried (libFLAC's `-l 8`, as at its default level 5).
const MAX_LPC_ORDER: usize = 8;

/// The Tukey(0.5) window libFLAC applies before the autocorrelation at its default level:
/// flat in the middle, a raised cosine over a quarter of the block at each end.
fn tukey_window(len: usize) -> Vec<f64> {
    let mut w = vec![1.0; len];
    let np = (0.25 * len as f64) as i64 - 1;
    if np > 0 {
        let np = np as usize;
        for i in 0..=np {
            let pi = std::f64::consts::PI;
            w[i] = 0.5 - 0.5 * (pi * i as f64 / np as f64).cos();
            w[len - np - 1 + i] = 0.5 - 0.5 * (pi * (i + np) as f64 / np as f64).cos();
        }
    }
    w
}

/// Predictor coefficients of every order 1..=`max_order` by Levinson–Durbin on the
/// autocorrelation `r`, with the prediction error of each order. Stops early (fewer
/// orders returned) when the error reaches zero.
fn levinson(r: &[f64], max_order: usize) -> Vec<(Vec<f64>, f64)> {
    let mut out = Vec::with_capacity(max_order);
    let mut a = vec![0.0f64; max_order];
    let mut err = r[0];
    for i in 0..max_order {
        let mut k = -r[i + 1];
        for j in 0..i {
            k -= a[j] * r[i - j];
        }
        k /= err;
        let prev = a.clone();
        a[i] = k;
        for j in 0..i {
            a[j] = prev[j] + k * prev[i - 1 - j];
        }
        err *= 1.0 - k * k;
        // Predictor: x[n] ≈ Σ c[j]·x[n-1-j] with c = -a.
        out.push((a[..=i].iter().map(|v| -v).collect(), err));
        if err <= 0.0 {
            break;
        }
    }
    out
}

/// Quantises predictor coefficients to `precision`-bit integers and a right shift
/// (libFLAC's method: error feedback from one coefficient to the next). `None` when they
/// cannot be (all zero, or so large a negative shift would be needed).
fn quantize(coefs: &[f64], precision: u32) -> Option<(Vec<i32>, u32)> {
    let cmax = coefs.iter().fold(0.0f64, |m, c| m.max(c.abs()));
    if cmax <= 0.0 || !cmax.is_finite() {
        return None;
    }
    let p = precision as i32 - 1;
    let qmax = (1i64 << p) - 1;
    let qmin = -(1i64 << p);
    let log2cmax = cmax.log2().floor() as i32;
    let shift = (p - log2cmax - 1).min(15);
    if shift < 0 {
        return None;
    }
    let mut error = 0.0f64;
    let mut q = Vec::with_capacity(coefs.len());
    for &c in coefs {
        error += c * (1i64 << shift) as f64;
        let v = (error.round() as i64).clamp(qmin, qmax);
        error -= v as f64;
        q.push(v as i32);
    }
    Some((q, shift as u32))
}

/// The residual of the quantised predictor, or `None` when one does not fit the 32-bit
/// signed range that FLAC decoders hold residuals in.
fn lpc_residual(x: &[i64], coefs: &[i32], shift: u32, out: &mut Vec<i64>) -> bool {
    out.clear();
    let order = coefs.len();
    for i in order..x.len() {
        let mut sum = 0i64;
        for (j, &c) in coefs.iter().enumerate() {
            sum += c as i64 * x[i - 1 - j];
        }
        let e = x[i] - (sum >> shift);
        if e.unsigned_abs() >= (1u64 << 31) - 1 {
            return false;
        }
        out.push(e);
    }
    true
}

/// libFLAC's coefficient precision for a block of `n` samples of `bps` bits (the
/// stream's, not the side channel's).
fn lpc_precision(stream_bps: u32, n: usize) -> u32 {
    if stream_bps <= 16 {
        match n {
            0..=192 => 7,
            193..=384 => 8,
            385..=576 => 9,
            577..=1152 => 10,
            1153..=2304 => 11,
            2305..=4608 => 12,
            _ => 13,
        }
    } else if n <= 384 {
        13
    } else if n <= 1152 {
        14
    } else {
        15
    }
}

/// Reusable buffers of the encoder.
struct Scratch {
    window: Vec<f64>,
    windowed: Vec<f64>,
    residual: Vec<i64>,
    zz: Vec<u64>,
}

impl Scratch {
    fn new() -> Self {
        Scratch { window: tukey_window(BLOCK), windowed: Vec::new(), residual: Vec::new(), zz: Vec::new() }
    }
}

/// Plans the cheapest subframe for channel `x` of `bps` bits (the side channel has one
/// more than the stream): CONSTANT, FIXED of order 0–4, LPC of order 1–8, or VERBATIM.
fn plan_channel(x: &[i64], bps: u32, stream_bps: u32, s: &mut Scratch) -> Planned {
    let n = x.len();
    if x.iter().all(|&v| v == x[0]) {
        return Planned { sub: Sub::Constant(x[0]), bits: 8 + bps as u64 };
    }
    let mut best = Planned { sub: Sub::Verbatim, bits: 8 + n as u64 * bps as u64 };

    // FIXED: the order with the smallest sum of absolute residuals, all five orders
    // in one pass (each order's residual is the difference of the one below).
    let max_fixed = 4.min(n.saturating_sub(1));
    let mut sums = [0u64; 5];
    let mut last = [0i64; 4];
    for (i, &v) in x.iter().enumerate() {
        let mut e = v;
        for (o, sum) in sums.iter_mut().enumerate() {
            if i >= o {
                *sum += e.unsigned_abs();
            }
            if o < 4 {
                let d = e - last[o];
                last[o] = e;
                e = d;
            }
        }
    }
    let fixed_order = (0..=max_fixed).min_by_key(|&o| sums[o]).expect("order 0 always exists");
    fixed_residual(x, fixed_order, &mut s.residual);
    if s.residual.iter().all(|e| e.unsigned_abs() < (1u64 << 31) - 1) {
        let rice = plan_rice(&s.residual, n, fixed_order, &mut s.zz);
        let bits = 8 + fixed_order as u64 * bps as u64 + rice.bits;
        if bits < best.bits {
            let residual = std::mem::take(&mut s.residual);
            best = Planned { sub: Sub::Fixed { order: fixed_order, rice, residual }, bits };
        }
    }

    // LPC: Tukey-windowed autocorrelation, Levinson–Durbin, the order with the fewest
    // expected bits (libFLAC's estimate), quantised and coded exactly.
    let max_order = MAX_LPC_ORDER.min(n.saturating_sub(1));
    if max_order == 0 {
        return best;
    }
    if s.window.len() != n {
        s.window = tukey_window(n);
    }
    s.windowed.clear();
    s.windowed.extend(x.iter().zip(&s.window).map(|(&v, &w)| v as f64 * w));
    let wx = &s.windowed;
    let mut r = [0.0f64; MAX_LPC_ORDER + 1];
    for (lag, r) in r.iter_mut().enumerate().take(max_order + 1) {
        *r = wx[lag..].iter().zip(wx).map(|(a, b)| a * b).sum();
    }
    if r[0] <= 0.0 {
        return best;
    }
    let orders = levinson(&r, max_order);
    let base_precision = lpc_precision(stream_bps, n);
    let error_scale = 0.5 / n as f64;
    let expected = |order: usize, err: f64| -> f64 {
        let per_sample = if err > 0.0 { (0.5 * (error_scale * err).log2()).max(0.0) } else { 0.0 };
        per_sample * (n - order) as f64 + (order as u32 * (bps + base_precision)) as f64
    };
    let Some((order, (coefs, _))) = orders
        .iter()
        .enumerate()
        .map(|(i, o)| (i + 1, o))
        .min_by(|a, b| expected(a.0, a.1 .1).total_cmp(&expected(b.0, b.1 .1)))
    else {
        return best;
    };
    // libFLAC keeps the predictor's sum within 32 bits for subframes of up to 17 bits.
    let precision = if bps <= 17 {
        base_precision.min(32 - bps - (usize::BITS - 1 - order.leading_zeros())).max(5)
    } else {
        base_precision
    };
    let Some((q, shift)) = quantize(coefs, precision) else {
        return best;
    };
    if lpc_residual(x, &q, shift, &mut s.residual) {
        let rice = plan_rice(&s.residual, n, order, &mut s.zz);
        let bits = 8 + order as u64 * bps as u64 + 4 + 5 + order as u64 * precision as u64 + rice.bits;
        if bits < best.bits {
            let residual = std::mem::take(&mut s.residual);
            best = Planned { sub: Sub::Lpc { order, precision, shift, coefs: q, rice, residual }, bits };
        }
    }
    best
}

fn write_residual(w: &mut BitWriter, rice: &RicePlan, residual: &[i64], n: usize, order: usize) {
    w.put(if rice.wide { 1 } else { 0 }, 2);
    w.put(rice.porder as u64, 4);
    let plen = n >> rice.porder;
    let mut idx = 0;
    for (p, &k) in rice.params.iter().enumerate() {
        let count = if p == 0 { plen - order } else { plen };
        w.put(k as u64, if rice.wide { 5 } else { 4 });
        for &e in &residual[idx..idx + count] {
            let u = zigzag(e);
            w.put_unary(u >> k);
            w.put(u & ((1u64 << k) - 1), k);
        }
        idx += count;
    }
}

fn write_subframe(w: &mut BitWriter, x: &[i64], bps: u32, plan: &Planned) {
    w.put(0, 1);
    match &plan.sub {
        Sub::Constant(v) => {
            w.put(0, 6);
            w.put(0, 1);
            w.put_signed(*v, bps);
        }
        Sub::Verbatim => {
            w.put(1, 6);
            w.put(0, 1);
            for &v in x {
                w.put_signed(v, bps);
            }
        }
        Sub::Fixed { order, rice, residual } => {
            w.put(0b001000 | *order as u64, 6);
            w.put(0, 1);
            for &v in &x[..*order] {
                w.put_signed(v, bps);
            }
            write_residual(w, rice, residual, x.len(), *order);
        }
        Sub::Lpc { order, precision, shift, coefs, rice, residual } => {
            w.put(0b100000 | (*order as u64 - 1), 6);
            w.put(0, 1);
            for &v in &x[..*order] {
                w.put_signed(v, bps);
            }
            w.put((*precision - 1) as u64, 4);
            w.put(*shift as u64, 5);
            for &c in coefs {
                w.put_signed(c as i64, *precision);
            }
            write_residual(w, rice, residual, x.len(), *order);
        }
    }
}

/// Streamed stereo FLAC writer.
pub struct FlacWriter<W: Write + Seek> {
    out: W,
    bits: u32,
    sample_rate: u32,
    start: u64,
    left: Vec<i64>,
    right: Vec<i64>,
    frame_no: u64,
    total: u64,
    min_frame: u32,
    max_frame: u32,
    crc_table: [u16; 256],
    scratch: Scratch,
    /// MD5 of the samples as `flac -t` checks them: interleaved, little-endian, in
    /// `bits / 8` bytes each.
    md5: Md5,
    md5_buf: Vec<u8>,
}

impl<W: Write + Seek> FlacWriter<W> {
    /// Writes the stream header for 2 channels of `bits` (16 or 24) at `sample_rate`.
    pub fn new(mut out: W, bits: u32, sample_rate: u32) -> Result<Self, AudioError> {
        if bits != 16 && bits != 24 {
            return Err(AudioError::InvalidArgument(format!("FLAC bit depth must be 16 or 24, not {bits}")));
        }
        if sample_rate == 0 || sample_rate >= 1 << 20 {
            return Err(AudioError::InvalidArgument(format!("bad sample rate {sample_rate}")));
        }
        let start = out.stream_position()?;
        let mut h = Vec::with_capacity(42);
        h.extend_from_slice(b"fLaC");
        h.push(0x80); // last metadata block, type 0 = STREAMINFO
        h.extend_from_slice(&[0, 0, 34]);
        h.extend_from_slice(&(BLOCK as u16).to_be_bytes());
        h.extend_from_slice(&(BLOCK as u16).to_be_bytes());
        h.extend_from_slice(&[0u8; 6]); // min/max frame size: patched at finish
        h.extend_from_slice(&Self::packed_format(sample_rate, bits, 0).to_be_bytes());
        h.extend_from_slice(&[0u8; 16]); // MD5 of the samples: patched at finish
        out.write_all(&h)?;
        Ok(FlacWriter {
            out,
            bits,
            sample_rate,
            start,
            left: Vec::with_capacity(BLOCK),
            right: Vec::with_capacity(BLOCK),
            frame_no: 0,
            total: 0,
            min_frame: u32::MAX,
            max_frame: 0,
            crc_table: crc16_table(),
            scratch: Scratch::new(),
            md5: Md5::new(),
            md5_buf: Vec::with_capacity(BLOCK * 6),
        })
    }

    fn packed_format(rate: u32, bits: u32, total: u64) -> u64 {
        ((rate as u64) << 44) | (1u64 << 41) | (((bits - 1) as u64) << 36) | (total & ((1 << 36) - 1))
    }

    /// Appends planar stereo float samples; they are scaled to integers and clamped.
    pub fn write(&mut self, left: &[f32], right: &[f32]) -> Result<(), AudioError> {
        if left.len() != right.len() {
            return Err(AudioError::InvalidArgument("left and right differ in length".into()));
        }
        let width = (self.bits / 8) as usize;
        for (&l, &r) in left.iter().zip(right) {
            let (l, r) = (float_to_int(l, self.bits), float_to_int(r, self.bits));
            self.md5_buf.extend_from_slice(&l.to_le_bytes()[..width]);
            self.md5_buf.extend_from_slice(&r.to_le_bytes()[..width]);
            self.left.push(l as i64);
            self.right.push(r as i64);
            if self.left.len() == BLOCK {
                self.md5.update(&self.md5_buf);
                self.md5_buf.clear();
                self.flush_block()?;
            }
        }
        self.md5.update(&self.md5_buf);
        self.md5_buf.clear();
        Ok(())
    }

    fn flush_block(&mut self) -> Result<(), AudioError> {
        let n = self.left.len();
        if n == 0 {
            return Ok(());
        }
        let bps = self.bits;
        let side: Vec<i64> = self.left.iter().zip(&self.right).map(|(l, r)| l - r).collect();
        let mid: Vec<i64> = self.left.iter().zip(&self.right).map(|(l, r)| (l + r) >> 1).collect();
        let s = &mut self.scratch;
        let pl = plan_channel(&self.left, bps, bps, s);
        let pr = plan_channel(&self.right, bps, bps, s);
        let ps = plan_channel(&side, bps + 1, bps, s);
        let pm = plan_channel(&mid, bps, bps, s);
        let options = [
            (0b0001u64, pl.bits + pr.bits),
            (0b1000, pl.bits + ps.bits),
            (0b1001, ps.bits + pr.bits),
            (0b1010, pm.bits + ps.bits),
        ];
        let (assignment, _) = *options.iter().min_by_key(|o| o.1).expect("non-empty");

        let mut w = BitWriter::new();
        w.put(0b11111111111110, 14);
        w.put(0, 1);
        w.put(0, 1); // fixed block size stream
        let size_code = if n == BLOCK { 0b1100 } else { 0b0111 };
        w.put(size_code, 4);
        w.put(0, 4); // sample rate from STREAMINFO
        w.put(assignment, 4);
        w.put(if bps == 16 { 0b100 } else { 0b110 }, 3);
        w.put(0, 1);
        let mut num = Vec::new();
        utf8_number(self.frame_no, &mut num);
        for b in num {
            w.put(b as u64, 8);
        }
        if size_code == 0b0111 {
            w.put((n - 1) as u64, 16);
        }
        let c8 = crc8(&w.bytes);
        w.put(c8 as u64, 8);
        match assignment {
            0b0001 => {
                write_subframe(&mut w, &self.left, bps, &pl);
                write_subframe(&mut w, &self.right, bps, &pr);
            }
            0b1000 => {
                write_subframe(&mut w, &self.left, bps, &pl);
                write_subframe(&mut w, &side, bps + 1, &ps);
            }
            0b1001 => {
                write_subframe(&mut w, &side, bps + 1, &ps);
                write_subframe(&mut w, &self.right, bps, &pr);
            }
            _ => {
                write_subframe(&mut w, &mid, bps, &pm);
                write_subframe(&mut w, &side, bps + 1, &ps);
            }
        }
        w.align();
        let c16 = crc16(&self.crc_table, &w.bytes);
        w.bytes.extend_from_slice(&c16.to_be_bytes());
        self.out.write_all(&w.bytes)?;
        let len = w.bytes.len() as u32;
        self.min_frame = self.min_frame.min(len);
        self.max_frame = self.max_frame.max(len);
        self.frame_no += 1;
        self.total += n as u64;
        self.left.clear();
        self.right.clear();
        Ok(())
    }

    /// Encodes the last partial block, patches STREAMINFO (total samples, frame sizes,
    /// MD5), flushes, and returns the sink.
    pub fn finish(mut self) -> Result<W, AudioError> {
        self.flush_block()?;
        let end = self.out.stream_position()?;
        let mut patch = Vec::with_capacity(14);
        let (minf, maxf) = if self.frame_no == 0 { (0, 0) } else { (self.min_frame, self.max_frame) };
        patch.extend_from_slice(&minf.to_be_bytes()[1..]);
        patch.extend_from_slice(&maxf.to_be_bytes()[1..]);
        patch.extend_from_slice(&Self::packed_format(self.sample_rate, self.bits, self.total).to_be_bytes());
        patch.extend_from_slice(&self.md5.finalize_reset());
        self.out.seek(SeekFrom::Start(self.start + 8 + 4))?;
        self.out.write_all(&patch)?;
        self.out.seek(SeekFrom::Start(end))?;
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_numbers() {
        let mut v = Vec::new();
        utf8_number(0x7F, &mut v);
        assert_eq!(v, [0x7F]);
        v.clear();
        utf8_number(0x80, &mut v);
        assert_eq!(v, [0xC2, 0x80]);
        v.clear();
        utf8_number(0x800, &mut v);
        assert_eq!(v, [0xE0, 0xA0, 0x80]);
    }

    #[test]
    fn crc_known_values() {
        // CRC-8/ATM ("123456789") = 0xF4, CRC-16/UMTS (buypass) = 0xFEE8.
        assert_eq!(crc8(b"123456789"), 0xF4);
        assert_eq!(crc16(&crc16_table(), b"123456789"), 0xFEE8);
    }
}
