//! How much memory one HTDemucs forward pass needs, worked out from the architecture,
//! so the engine can refuse a pass that would not fit *before* it allocates anything
//! (and the worker's out-of-memory ladder steps down) instead of dying half way.
//!
//! # The estimate
//!
//! [`forward_peak_bytes`] walks the layers of `HTDemucs.forward` in order with the
//! shapes of [`crate::model`] and keeps track of what is alive, in f32 values:
//!
//! * the host side: the padded mix `[B, C, L]`, the f64 complex spectrogram of every
//!   channel (`_spec`, 16 bytes a bin) and the normalised `[B, 2C, F, T]` input; at the
//!   end the network outputs copied back, `[B, S·2C, F, T]` + `[B, S·C, L]`, and the
//!   summed waveform `[B, S, C, L]`;
//! * the skip connections saved by each encoder (both branches), alive until their
//!   decoder;
//! * per layer, the transient working set: the input, the im2col columns of its
//!   convolution (`chin·k` values per output position), the convolution output, its
//!   GELU, and the rewrite `1×1` (encoder) or `3×3` (decoder) convolution's `2·chout`
//!   channels with their GLU; for decoders the transposed convolution's columns
//!   (`chout·k` per input position) and its output;
//! * per transformer layer (tokens `N` = `F_depth·T` and `L_depth`, width `D`): norm,
//!   `q`, `k`, `v`, the attention output, the projection and the feed-forward hidden
//!   layer (`hidden_scale·D`, twice for GELU); attention scores are tiled by the backend
//!   and not materialised.
//!
//! The peak is the largest (host + skips + working set) over all steps, times the batch.
//! The first frequency encoder and the last frequency decoder dominate (at full size,
//! 7.8 s: `4·8` im2col values and `2·48` rewrite channels over `512 × 336` positions).
//!
//! # Validation (peak RSS on the CPU)
//!
//! Measured with `cargo run -p stemq-demucs --example memory -- <checkpoint> <seconds>`
//! (one forward pass, batch 1, in a fresh process; the figure is `VmHWM` minus `VmRSS`
//! after loading the model, building the input and trimming the heap, so weights and
//! freed loading buffers are not counted). See the table in the doc of
//! [`forward_peak_bytes`].
//!
//! The estimate is meant as an upper bound with a small margin: the engine multiplies it
//! by the passes that run at once (`cpu_jobs` threads, or `gpu_batch` segments).

use crate::config::HTDemucsConfig;

const F32: u64 = 4;

/// Peak bytes that one forward pass of `config` over `batch` segments of
/// `training_length` samples allocates on top of the loaded model (host buffers
/// included).
///
/// Measured with `examples/memory.rs` (Flex CPU backend, batch 1, debug build with
/// optimised dependencies, one fresh process per row, heap trimmed before the pass;
/// `measured` is the peak RSS above the pre-pass RSS; 2-core machine shared with other
/// builds):
///
/// | model | segment | estimate | measured | estimate / measured |
/// |---|---:|---:|---:|---:|
/// | full-size random htdemucs (44.1 kHz, channels 48) | 2 s | 129.1 MiB | 140.2 MiB | 0.92 |
/// | full-size random htdemucs | 4 s | 256.8 MiB | 210.6 MiB | 1.22 |
/// | reduced fixture (8 kHz, channels 8) | 1.5 s | 8.7 MiB | 11.4 MiB | 0.76 |
/// | reduced fixture | 1.0 s | 5.8 MiB | 7.7 MiB | 0.76 |
/// | reduced fixture | 0.5 s | 2.9 MiB | 4.7 MiB | 0.62 |
///
/// So it scales with the segment as measured and is within ±25 % at full size; the
/// small model's passes carry 2–3 MiB the formula does not count (thread-local arenas of
/// the backend's worker threads, allocator rounding). Treat a budget as approximate:
/// leave 25 % headroom under the real limit.
///
/// The CPU's own convolutions build no im2col columns (the host kernel's polyphase
/// layout is about the size of the input, and the decoders' `[3, 3]` rewrite runs on it
/// too), so on the CPU the estimate is an upper bound with room to spare. Release build,
/// same example, fresh process per row:
///
/// | model | segment | estimate | measured | estimate / measured |
/// |---|---:|---:|---:|---:|
/// | full-size random htdemucs | 2 s | 129.1 MiB | 93.0 MiB | 1.39 |
/// | full-size random htdemucs | 4 s | 256.8 MiB | 156.1 MiB | 1.64 |
/// | full-size random htdemucs | 7.8 s | 498.7 MiB | 273.0 MiB | 1.83 |
///
/// The formula keeps the im2col terms: a GPU backend's convolutions are not these host
/// kernels, and the estimate must not fall below what they use (unmeasured until a
/// device is lent).
pub fn forward_peak_bytes(config: &HTDemucsConfig, training_length: usize, batch: usize) -> u64 {
    let c = config;
    let b = batch.max(1) as u64;
    let ch = c.audio_channels as u64;
    let nsrc = c.sources.len() as u64;
    let len = training_length.max(1) as u64;
    let freqs0 = (c.nfft / 2) as u64;
    let frames = len.div_ceil(c.hop_length() as u64);
    let k = c.kernel_size as u64;
    let stride = c.stride.max(1) as u64;
    let ctx_enc = 1 + 2 * c.context_enc as u64;
    let ctx_dec = 1 + 2 * c.context as u64;
    let hidden_dconv = |cout: u64| ((cout as f64 / c.dconv_comp.max(1.0)) as u64).max(1);

    // Host buffers alive through the whole pass (f64 complex spectrogram = 4 f32).
    let host = ch * len + ch * freqs0 * frames * 4;
    // Host buffers at the end: network outputs and the summed waveforms.
    let host_out = nsrc * 2 * ch * freqs0 * frames + 2 * nsrc * ch * len + nsrc * ch * len;

    // Encoders: (freq rows, channels, time length) per level, both branches.
    let mut peak = 0u64;
    let mut skips = 0u64;
    let (mut cin_z, mut cin_t) = (2 * ch, ch);
    let (mut cout_z, mut cout_t) = (c.channels as u64, c.channels_time.unwrap_or(c.channels) as u64);
    let (mut f_in, mut l_in) = (freqs0, len);
    let mut cur = 2 * ch * freqs0 * frames + ch * len; // x and xt
    let mut levels = Vec::new();
    for _ in 0..c.depth {
        let f_out = f_in / stride;
        let l_out = l_in.div_ceil(stride);
        // frequency layer: positions f_out·T
        let pos = f_out * frames;
        let work_z = cin_z * k * pos
            + cout_z * pos * 2
            + hidden_dconv(cout_z) * 2 * pos
            + cout_z * ctx_enc * pos
            + 2 * cout_z * pos
            + cout_z * pos;
        let work_t = cin_t * k * l_out
            + cout_t * l_out * 2
            + hidden_dconv(cout_t) * 2 * l_out
            + cout_t * ctx_enc * l_out
            + 2 * cout_t * l_out
            + cout_t * l_out;
        peak = peak.max(host + skips + cur + work_t.max(work_z));
        skips += cout_z * pos + cout_t * l_out;
        cur = cout_z * pos + cout_t * l_out;
        levels.push((cin_z, cout_z, f_in, f_out, cin_t, cout_t, l_in, l_out));
        cin_z = cout_z;
        cin_t = cout_t;
        cout_z = (c.growth * cout_z as f64) as u64;
        cout_t = (c.growth * cout_t as f64) as u64;
        f_in = f_out;
        l_in = l_out;
    }

    // Transformer at the bottom.
    if c.t_layers > 0 {
        let d = if c.bottom_channels > 0 { c.bottom_channels as u64 } else { cin_z };
        let n1 = f_in * frames;
        let n2 = l_in;
        let hidden = (c.t_hidden_scale * d as f64) as u64;
        // tokens of both branches, plus the per-layer transient of the larger one.
        let tokens = (n1 + n2) * d * 2;
        let layer = n1.max(n2) * (6 * d + 2 * hidden) + n1.min(n2) * 3 * d;
        peak = peak.max(host + skips + tokens + layer);
    }

    // Decoders, deepest first.
    for &(cin_z, cout_z, f_in, f_out, cin_t, cout_t, l_in, l_out) in levels.iter().rev() {
        // The decoder reads `cout` channels at the coarse resolution and writes `cin`
        // channels (S times more at level 0) at the fine one.
        let last = f_in == freqs0;
        let (dz, dt) = if last { (nsrc * cin_z, nsrc * cin_t) } else { (cin_z, cin_t) };
        let pos = f_out * frames;
        let x = cout_z * pos;
        let work_z = 3 * x
            + cout_z * ctx_dec * pos
            + 3 * x
            + hidden_dconv(cout_z) * 2 * pos
            + dz * k * pos
            + 2 * dz * f_in * frames;
        let xt = cout_t * l_out;
        let work_t = 3 * xt
            + cout_t * ctx_dec * l_out
            + 3 * xt
            + hidden_dconv(cout_t) * 2 * l_out
            + dt * k * l_out
            + 2 * dt * l_in;
        skips -= cout_z * pos + cout_t * l_out;
        peak = peak.max(host + skips + work_z.max(work_t) + x.min(xt));
    }
    peak = peak.max(host + host_out);
    peak * F32 * b
}
