//! Owns the streamed FLAC encoder (stereo, 16 or 24 bit), written for this crate.
//!
//! It is deliberately simple but produces standard, lossless FLAC:
//! fixed block size of 4096 samples; per frame it picks the cheapest of
//! independent, left/side, right/side and mid/side stereo; each subframe is
//! CONSTANT (digital silence), FIXED (polynomial predictor of order 0–4,
//! chosen by the smallest sum of absolute residuals) with partitioned Rice
//! coding, or VERBATIM if prediction does not pay. STREAMINFO's total sample
//! count and frame sizes are patched at [`FlacWriter::finish`]; the MD5 field
//! is left zero ("unknown"), which the format allows.

use std::io::{Seek, SeekFrom, Write};

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

/// Rice parameter and estimated bit cost for `count` residuals whose zig-zag sum is `sum`.
fn rice_param(sum: u64, count: usize, max_k: u32) -> (u32, u64) {
    if count == 0 {
        return (0, 0);
    }
    let mean = sum / count as u64;
    let mut k = 0u32;
    while k < max_k && (1u64 << (k + 1)) <= mean + 1 {
        k += 1;
    }
    let cost = count as u64 * (1 + k as u64) + (sum >> k);
    (k, cost)
}

/// Plan for one subframe.
enum Sub {
    Constant(i64),
    Verbatim,
    Fixed { order: usize, porder: u32, params: Vec<u32>, wide: bool },
}

struct Planned {
    sub: Sub,
    bits: u64,
}

fn plan_channel(x: &[i64], bps: u32, scratch: &mut Vec<i64>) -> Planned {
    let n = x.len();
    if x.iter().all(|&v| v == x[0]) {
        return Planned { sub: Sub::Constant(x[0]), bits: bps as u64 };
    }
    let verbatim_bits = n as u64 * bps as u64;
    // Pick the predictor order by sum of absolute residuals.
    let max_order = 4.min(n.saturating_sub(1));
    let mut best_order = 0;
    let mut best_sum = u64::MAX;
    for order in 0..=max_order {
        fixed_residual(x, order, scratch);
        let s: u64 = scratch.iter().map(|&e| zigzag(e)).sum();
        if s < best_sum {
            best_sum = s;
            best_order = order;
        }
    }
    fixed_residual(x, best_order, scratch);
    // Partition search: finest-level sums, merged upwards.
    let mut best: Option<(u64, u32, Vec<u32>, bool)> = None;
    for porder in 0..=MAX_PARTITION_ORDER {
        let parts = 1usize << porder;
        if n % parts != 0 || n / parts <= best_order {
            break;
        }
        let plen = n / parts;
        let mut params = Vec::with_capacity(parts);
        let mut bits = 0u64;
        let mut wide = false;
        let mut idx = 0usize;
        for p in 0..parts {
            let count = if p == 0 { plen - best_order } else { plen };
            let s: u64 = scratch[idx..idx + count].iter().map(|&e| zigzag(e)).sum();
            idx += count;
            let (k, c) = rice_param(s, count, 30);
            if k > 14 {
                wide = true;
            }
            params.push(k);
            bits += c;
        }
        bits += parts as u64 * if wide { 5 } else { 4 };
        if best.as_ref().is_none_or(|b| bits < b.0) {
            best = Some((bits, porder, params, wide));
        }
    }
    let (rbits, porder, params, wide) = best.expect("partition order 0 is always valid");
    let fixed_bits = best_order as u64 * bps as u64 + 6 + rbits;
    if fixed_bits >= verbatim_bits {
        return Planned { sub: Sub::Verbatim, bits: verbatim_bits };
    }
    Planned { sub: Sub::Fixed { order: best_order, porder, params, wide }, bits: fixed_bits }
}

fn write_subframe(w: &mut BitWriter, x: &[i64], bps: u32, plan: &Planned, scratch: &mut Vec<i64>) {
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
        Sub::Fixed { order, porder, params, wide } => {
            w.put(0b001000 | *order as u64, 6);
            w.put(0, 1);
            for &v in &x[..*order] {
                w.put_signed(v, bps);
            }
            fixed_residual(x, *order, scratch);
            w.put(if *wide { 1 } else { 0 }, 2);
            w.put(*porder as u64, 4);
            let plen = x.len() >> porder;
            let mut idx = 0;
            for (p, &k) in params.iter().enumerate() {
                let count = if p == 0 { plen - order } else { plen };
                w.put(k as u64, if *wide { 5 } else { 4 });
                for &e in &scratch[idx..idx + count] {
                    let u = zigzag(e);
                    w.put_unary(u >> k);
                    w.put(u & ((1u64 << k) - 1), k);
                }
                idx += count;
            }
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
    scratch: Vec<i64>,
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
        h.extend_from_slice(&[0u8; 16]); // MD5 unknown
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
            scratch: Vec::with_capacity(BLOCK),
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
        for (&l, &r) in left.iter().zip(right) {
            self.left.push(float_to_int(l, self.bits) as i64);
            self.right.push(float_to_int(r, self.bits) as i64);
            if self.left.len() == BLOCK {
                self.flush_block()?;
            }
        }
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
        let pl = plan_channel(&self.left, bps, &mut self.scratch);
        let pr = plan_channel(&self.right, bps, &mut self.scratch);
        let ps = plan_channel(&side, bps + 1, &mut self.scratch);
        let pm = plan_channel(&mid, bps, &mut self.scratch);
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
        let scratch = &mut self.scratch;
        match assignment {
            0b0001 => {
                write_subframe(&mut w, &self.left, bps, &pl, scratch);
                write_subframe(&mut w, &self.right, bps, &pr, scratch);
            }
            0b1000 => {
                write_subframe(&mut w, &self.left, bps, &pl, scratch);
                write_subframe(&mut w, &side, bps + 1, &ps, scratch);
            }
            0b1001 => {
                write_subframe(&mut w, &side, bps + 1, &ps, scratch);
                write_subframe(&mut w, &self.right, bps, &pr, scratch);
            }
            _ => {
                write_subframe(&mut w, &mid, bps, &pm, scratch);
                write_subframe(&mut w, &side, bps + 1, &ps, scratch);
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

    /// Encodes the last partial block, patches STREAMINFO, flushes, and returns the sink.
    pub fn finish(mut self) -> Result<W, AudioError> {
        self.flush_block()?;
        let end = self.out.stream_position()?;
        let mut patch = Vec::with_capacity(14);
        let (minf, maxf) = if self.frame_no == 0 { (0, 0) } else { (self.min_frame, self.max_frame) };
        patch.extend_from_slice(&minf.to_be_bytes()[1..]);
        patch.extend_from_slice(&maxf.to_be_bytes()[1..]);
        patch.extend_from_slice(&Self::packed_format(self.sample_rate, self.bits, self.total).to_be_bytes());
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
