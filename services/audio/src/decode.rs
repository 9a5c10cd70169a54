//! Owns streamed decoding: naming the file from its bytes ([`crate::container`]),
//! opening it with symphonia (WAV, AIFF, CAF, FLAC, MP3, Ogg, MP4/M4A, Matroska/WebM;
//! PCM, ADPCM, FLAC, MP3, Vorbis, ALAC; AAC through [`crate::aac`], Opus through
//! [`crate::opus`]),
//! the container's trims (Opus pre-skip and end, an MP4 edit list), channel conversion
//! to stereo, resampling to the engines' rate, the duration limit and the input-error
//! classification.
//!
//! The format is found from the bytes alone; a file's name or extension plays no part.
//!
//! # Channel handling
//! * mono is duplicated to both channels;
//! * stereo passes through;
//! * more than two channels are downmixed by speaker position, ITU-R BS.775
//!   style: left-side speakers (front, side, rear, wide, high, left-of-centre)
//!   go to the left output, right-side ones to the right, centre speakers go to
//!   both at −3 dB (×0.7071), surround/rear/top speakers are themselves
//!   attenuated by −3 dB, and LFE channels are dropped: ffmpeg's `-ac 2` fold to
//!   float, which is what demucs reads (not normalised: a loud fold may exceed 1.0, and
//!   the stems' clip mode deals with it as demucs's does). Rear/top centres and
//!   channels without a known position go to both sides at −6 dB.
//!
//! # Memory
//! Only one packet, one resampler block and one output chunk are alive at a
//! time: memory does not grow with the length of the track.
//!
//! # Hostile input
//! A decoder must never take a worker down or make it retry a bad file, so:
//! * source sample rates outside [`MIN_SAMPLE_RATE`]`..=`[`MAX_SAMPLE_RATE`] are
//!   refused ([`AudioError::SampleRate`]), read from the WAV/FLAC header before
//!   symphonia sees it (a 0 Hz WAV panics inside symphonia);
//! * the decoded stream may not grow beyond [`MAX_EXPANSION`] times the input
//!   file's size ([`AudioError::TooLarge`]), checked from the header's length when
//!   it states one, else while decoding;
//! * metadata lengths that cannot fit in the file are refused before symphonia
//!   allocates them ([`crate::preflight`]);
//! * a panic anywhere inside probing or decoding (symphonia, the resampler, our
//!   own conversion) is caught and reported as [`AudioError::Undecodable`]: bad
//!   input, permanent, never an engine fault.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use symphonia::core::audio::{AudioBufferRef, Channels, SampleBuffer, SignalSpec};
use symphonia::core::codecs::{self, CodecRegistry, CodecType, DecoderOptions, CODEC_TYPE_NULL};
use symphonia::core::errors::Error as SymError;
use symphonia::core::formats::{FormatOptions, FormatReader};
use symphonia::core::io::{MediaSource, MediaSourceStream, MediaSourceStreamOptions};
use symphonia::core::meta::MetadataOptions;
use symphonia::core::probe::Hint;
use symphonia::core::units::TimeBase;

use crate::chunk::StereoChunk;
use crate::container::{self, Identity};
use crate::error::{format_mmss, AudioError};
use crate::resample::StreamResampler;

/// The sample rate the separation engines work at.
pub const ENGINE_SAMPLE_RATE: u32 = 44_100;

/// Lowest accepted source sample rate (telephone-band audio). Below it a tiny file
/// declares minutes of audio: a 244-byte WAV at 1 Hz would come out as 70 MB of stems.
pub const MIN_SAMPLE_RATE: u32 = 8_000;

/// Highest accepted source sample rate (the highest rate of studio converters).
pub const MAX_SAMPLE_RATE: u32 = 384_000;

/// Most bytes of decoded audio (stereo `f32` at the target rate, 8 bytes a frame) per
/// byte of input file.
///
/// The worst legitimate music is the lowest-bitrate codec stream decoded to the
/// engines' 44.1 kHz stereo float: MP3's lowest bitrate, 8 kbit/s (MPEG-2.5, 8 kHz
/// mono), is 1 000 bytes a second of input for 44 100 × 8 = 352 800 bytes a second
/// decoded, a factor of 352.8 (libsndfile's 8 kHz mono MP3 and lowest-quality Vorbis of
/// a busy signal measure about 170); PCM WAV at 8 kHz 8-bit mono, the leanest PCM we
/// accept, is 44.1. Even a whole file of digital silence from standard encoders
/// passes: 2 194 for FLAC at 44.1 kHz stereo, 3 193 for Vorbis at 8 kHz mono (both
/// measured with libsndfile, 60 s). Hence 4 096. Stems are written at most 4 (6 for
/// `htdemucs_6s`) per job, each no larger than the decoded stream (the widest output,
/// `f32` WAV, is 8 bytes a frame), so a job writes at most 6 × 4 096 times its input.
/// What it stops is the tiny file that claims hours: a 244-byte WAV at 1 Hz
/// decodes to 144 590 times its size (refused by the sample-rate floor as well), and
/// half a kilobyte of FLAC made of constant 65 535-sample blocks to over 200 000 times.
pub const MAX_EXPANSION: u64 = 4096;

/// Options for [`Decoder`].
#[derive(Debug, Clone)]
pub struct DecodeOptions {
    /// Output sample rate; other rates are resampled. Default [`ENGINE_SAMPLE_RATE`].
    pub target_sample_rate: u32,
    /// Reject inputs longer than this many seconds (header check when the
    /// header states the length, otherwise while decoding). Default: no limit.
    pub max_duration_secs: Option<f64>,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions { target_sample_rate: ENGINE_SAMPLE_RATE, max_duration_secs: None }
    }
}

/// What the probe learnt about the source.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceInfo {
    /// Codec short name, e.g. `"pcm_s16le"`, `"flac"`, `"mp3"`, `"vorbis"`.
    pub codec: String,
    /// Native sample rate of the source.
    pub sample_rate: u32,
    /// Native channel count (0 if unknown until the first packet).
    pub channels: usize,
    /// Number of frames at the native rate, if the header states it.
    pub frames: Option<u64>,
    /// Duration in seconds, if the header states it.
    pub duration_secs: Option<f64>,
}

/// Adapts any `Read + Seek + Send + Sync` value to symphonia's `MediaSource`.
struct SeekableSource<R> {
    inner: R,
    len: Option<u64>,
}

impl<R: Read + Seek> Read for SeekableSource<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.inner.read(buf)
    }
}

impl<R: Read + Seek> Seek for SeekableSource<R> {
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        self.inner.seek(pos)
    }
}

impl<R: Read + Seek + Send + Sync> MediaSource for SeekableSource<R> {
    fn is_seekable(&self) -> bool {
        true
    }
    fn byte_len(&self) -> Option<u64> {
        self.len
    }
}

/// Facts read from the first bytes of the source before symphonia sees it.
#[derive(Default)]
struct Sniff {
    /// WAV format tag (or the extensible sub-format).
    wav_tag: Option<u16>,
    /// FLAC STREAMINFO total samples.
    flac_total: Option<u64>,
    /// The sample rate the WAV `fmt ` chunk or the FLAC STREAMINFO declares.
    rate: Option<u32>,
}

/// Reads container facts without consuming the source.
fn sniff<R: Read + Seek>(r: &mut R) -> Sniff {
    let mut head = vec![0u8; 4096];
    let Ok(start) = r.stream_position() else {
        return Sniff::default();
    };
    let mut n = 0;
    while n < head.len() {
        match r.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(_) => break,
        }
    }
    if r.seek(SeekFrom::Start(start)).is_err() {
        return Sniff::default();
    }
    let head = &head[..n];
    let (wav_tag, wav_rate) = wav_fmt(head).unzip();
    let mut s = Sniff { wav_tag, flac_total: None, rate: wav_rate.flatten() };
    if head.len() >= 26 && &head[0..4] == b"fLaC" && head[4] & 0x7F == 0 {
        let v = u64::from_be_bytes(head[18..26].try_into().expect("8 bytes"));
        s.flac_total = Some(v & ((1 << 36) - 1));
        // STREAMINFO: 20 bits of sample rate after the two 16-bit block sizes and the
        // two 24-bit frame sizes.
        s.rate = Some((v >> 44) as u32);
    }
    s
}

/// The WAV format tag (or the extensible sub-format) and, when the chunk is long
/// enough to hold it, the declared sample rate.
fn wav_fmt(head: &[u8]) -> Option<(u16, Option<u32>)> {
    if head.len() < 12 || &head[0..4] != b"RIFF" || &head[8..12] != b"WAVE" {
        return None;
    }
    let mut pos = 12usize;
    while pos.checked_add(8)? <= head.len() {
        let id = &head[pos..pos + 4];
        let size = u32::from_le_bytes(head[pos + 4..pos + 8].try_into().ok()?) as usize;
        if id == b"fmt " && pos + 10 <= head.len() {
            let rate = head.get(pos + 12..pos + 16).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
            let tag = u16::from_le_bytes([head[pos + 8], head[pos + 9]]);
            if tag == 0xFFFE && pos + 8 + 26 <= head.len() {
                return Some((u16::from_le_bytes([head[pos + 8 + 24], head[pos + 8 + 25]]), rate));
            }
            return Some((tag, rate));
        }
        pos = pos.checked_add(8)?.checked_add(size)?.checked_add(size & 1)?;
    }
    None
}

/// Refuses sample rates no real recording has.
fn check_rate(rate: u32) -> Result<(), AudioError> {
    if (MIN_SAMPLE_RATE..=MAX_SAMPLE_RATE).contains(&rate) {
        Ok(())
    } else {
        Err(AudioError::SampleRate { rate })
    }
}

/// The message of a caught panic, first line only and bounded, for an error detail.
fn panic_detail(payload: &(dyn std::any::Any + Send)) -> String {
    let msg = stemq_core::engine::panic_message(payload).unwrap_or_else(|| "no message".into());
    let line = msg.lines().next().unwrap_or("").trim();
    line.chars().take(200).collect()
}

/// Runs one decoding step; a panic inside it becomes [`AudioError::Undecodable`].
fn guarded<T>(step: impl FnOnce() -> Result<T, AudioError>) -> Result<T, AudioError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(step)) {
        Ok(r) => r,
        Err(payload) => Err(AudioError::Undecodable { detail: panic_detail(payload.as_ref()) }),
    }
}

fn wav_tag_name(tag: u16) -> String {
    let name = match tag {
        0x0002 => "Microsoft ADPCM",
        0x0011 => "IMA ADPCM",
        0x0031 => "GSM 6.10",
        0x0050 => "MPEG-1 Layer I/II",
        0x0055 => "MPEG-1 Layer III (MP3 inside WAV)",
        0x00FF | 0x1610 => "AAC",
        0x0160..=0x0163 => "Windows Media Audio",
        0x2000 => "Dolby AC-3",
        _ => "",
    };
    if name.is_empty() {
        format!("WAV format tag 0x{tag:04X}")
    } else {
        format!("{name} (WAV format tag 0x{tag:04X})")
    }
}

/// symphonia's codecs with Opus added and AAC replaced.
fn codecs() -> &'static CodecRegistry {
    static REGISTRY: std::sync::OnceLock<CodecRegistry> = std::sync::OnceLock::new();
    REGISTRY.get_or_init(|| {
        let mut r = CodecRegistry::new();
        symphonia::default::register_enabled_codecs(&mut r);
        r.register_all::<crate::opus::OpusCodec>();
        // After symphonia's: replaces its AAC-LC-only decoder.
        r.register_all::<crate::aac::AacCodec>();
        r
    })
}

fn codec_name(ct: CodecType) -> String {
    if let Some(d) = codecs().get_codec(ct) {
        return d.short_name.to_string();
    }
    let name = match ct {
        codecs::CODEC_TYPE_AAC => "AAC",
        codecs::CODEC_TYPE_AC4 => "AC-4",
        codecs::CODEC_TYPE_MUSEPACK => "Musepack",
        codecs::CODEC_TYPE_ALAC => "ALAC",
        codecs::CODEC_TYPE_OPUS => "Opus",
        codecs::CODEC_TYPE_SPEEX => "Speex",
        codecs::CODEC_TYPE_MP1 => "MPEG-1 Layer I",
        codecs::CODEC_TYPE_MP2 => "MPEG-1 Layer II",
        codecs::CODEC_TYPE_ADPCM_MS => "Microsoft ADPCM",
        codecs::CODEC_TYPE_ADPCM_IMA_WAV | codecs::CODEC_TYPE_ADPCM_IMA_QT => "IMA ADPCM",
        codecs::CODEC_TYPE_WAVPACK => "WavPack",
        codecs::CODEC_TYPE_MONKEYS_AUDIO => "Monkey's Audio",
        codecs::CODEC_TYPE_TTA => "TTA",
        codecs::CODEC_TYPE_WMA => "Windows Media Audio",
        codecs::CODEC_TYPE_EAC3 => "E-AC-3",
        codecs::CODEC_TYPE_DCA => "DTS",
        CODEC_TYPE_NULL => "unknown codec",
        _ => "",
    };
    if name.is_empty() {
        format!("codec id {ct}")
    } else {
        name.to_string()
    }
}

/// Left/right gains for one input channel of a multichannel layout.
fn channel_gains(ch: Channels) -> (f32, f32) {
    const H: f32 = std::f32::consts::FRAC_1_SQRT_2;
    let left_front = Channels::FRONT_LEFT | Channels::FRONT_LEFT_CENTRE | Channels::FRONT_LEFT_WIDE;
    let right_front = Channels::FRONT_RIGHT | Channels::FRONT_RIGHT_CENTRE | Channels::FRONT_RIGHT_WIDE;
    let left_sur = Channels::SIDE_LEFT
        | Channels::REAR_LEFT
        | Channels::REAR_LEFT_CENTRE
        | Channels::TOP_FRONT_LEFT
        | Channels::TOP_REAR_LEFT
        | Channels::FRONT_LEFT_HIGH;
    let right_sur = Channels::SIDE_RIGHT
        | Channels::REAR_RIGHT
        | Channels::REAR_RIGHT_CENTRE
        | Channels::TOP_FRONT_RIGHT
        | Channels::TOP_REAR_RIGHT
        | Channels::FRONT_RIGHT_HIGH;
    if ch.intersects(Channels::LFE1 | Channels::LFE2) {
        (0.0, 0.0)
    } else if left_front.contains(ch) {
        (1.0, 0.0)
    } else if right_front.contains(ch) {
        (0.0, 1.0)
    } else if left_sur.contains(ch) {
        (H, 0.0)
    } else if right_sur.contains(ch) {
        (0.0, H)
    } else if ch == Channels::FRONT_CENTRE {
        (H, H)
    } else {
        // Rear/top centres and unknown positions.
        (0.5, 0.5)
    }
}

/// Per-input-channel gains to stereo, in plane order.
fn downmix_matrix(spec: &SignalSpec) -> Vec<(f32, f32)> {
    let n = spec.channels.count();
    match n {
        1 => vec![(1.0, 1.0)],
        2 => vec![(1.0, 0.0), (0.0, 1.0)],
        _ => spec.channels.iter().map(channel_gains).collect(),
    }
}

/// Converts decoded packets to stereo at the native rate (downmix state).
struct Converter {
    matrix: Vec<(f32, f32)>,
    spec: Option<SignalSpec>,
    sample_buf: Option<SampleBuffer<f32>>,
}

impl Converter {
    fn convert(&mut self, buf: AudioBufferRef<'_>) -> StereoChunk {
        let spec = *buf.spec();
        let frames = buf.frames();
        let channels = spec.channels.count();
        if self.spec != Some(spec) {
            self.matrix = downmix_matrix(&spec);
            self.spec = Some(spec);
        }
        let need = buf.capacity() as u64;
        if self.sample_buf.as_ref().is_none_or(|b| (b.capacity() as u64) < need * channels as u64) {
            self.sample_buf = Some(SampleBuffer::<f32>::new(need, spec));
        }
        let sb = self.sample_buf.as_mut().expect("allocated above");
        sb.copy_planar_ref(buf);
        let s = sb.samples();
        let mut out = StereoChunk::with_capacity(frames);
        out.left.resize(frames, 0.0);
        out.right.resize(frames, 0.0);
        for (c, &(gl, gr)) in self.matrix.iter().enumerate() {
            let plane = &s[c * frames..(c + 1) * frames];
            if gl != 0.0 {
                for (o, &x) in out.left.iter_mut().zip(plane) {
                    *o += gl * x;
                }
            }
            if gr != 0.0 {
                for (o, &x) in out.right.iter_mut().zip(plane) {
                    *o += gr * x;
                }
            }
        }
        out
    }
}

/// A streamed decoder yielding stereo `f32` chunks at the target sample rate.
///
/// Use [`Decoder::next_chunk`] (or the [`Iterator`] impl) until it returns `None`.
pub struct Decoder {
    format: Box<dyn FormatReader>,
    codec: Box<dyn codecs::Decoder>,
    track_id: u32,
    time_base: Option<TimeBase>,
    info: SourceInfo,
    opts: DecodeOptions,
    conv: Converter,
    resampler: Option<StreamResampler>,
    /// The first packet's samples, decoded while opening (AAC), not yet handed out.
    pending: Option<StereoChunk>,
    /// Frames to drop from the end of the stream (a WebM Opus stream's padding).
    end_trim: u64,
    /// The last packet's samples, held while [`Decoder::end_trim`] is not zero.
    held: Option<StereoChunk>,
    /// The packets have run out.
    eof: bool,
    /// Frames past the container's trims so far (ahead of `decoded_frames` by the
    /// held-back packet).
    trimmed_frames: u64,
    decoded_frames: u64,
    /// Frames handed out so far, at the target rate (for [`MAX_EXPANSION`]).
    output_frames: u64,
    /// Size of the input in bytes.
    input_bytes: u64,
    /// Decoded frames still to drop from the start (the container's priming samples).
    skip_left: u64,
    /// Frames the stream holds after the skip, where the container says (its end trim).
    limit: Option<u64>,
    /// The container's framing shows the file was cut off (checked at the end).
    truncated: bool,
    done: bool,
}

/// Refuses a decoded stream of `out_frames` stereo `f32` frames from `input_bytes`
/// bytes when it exceeds [`MAX_EXPANSION`].
fn check_expansion(out_frames: u128, input_bytes: u64) -> Result<(), AudioError> {
    let decoded = out_frames.saturating_mul(8);
    if decoded > u128::from(input_bytes) * u128::from(MAX_EXPANSION) {
        Err(AudioError::TooLarge { input_bytes, max_ratio: MAX_EXPANSION })
    } else {
        Ok(())
    }
}

/// Whether an I/O error symphonia returned came from the operating system (a read that
/// may work next time) rather than from parsing the bytes it had read: its bit readers
/// report running off the end of a frame as an `io::Error` ("unexpected end of
/// bitstream") with no OS error code, and that is damaged data, not a transient fault.
fn from_the_os(e: &std::io::Error) -> bool {
    e.raw_os_error().is_some()
}

fn map_open_error(e: SymError, sniffed: &Sniff, id: &Identity) -> AudioError {
    let wav_tag = sniffed.wav_tag;
    let known = id.container != container::Container::Unknown;
    match e {
        SymError::IoError(ref io)
            if io.kind() == std::io::ErrorKind::UnexpectedEof && sniffed.flac_total == Some(0) =>
        {
            AudioError::Empty
        }
        SymError::IoError(ref io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            AudioError::NotAudio { detail: "the file ends before its header is complete".into() }
        }
        SymError::IoError(io) if from_the_os(&io) => AudioError::Io(io),
        SymError::IoError(io) => AudioError::NotAudio { detail: format!("the header does not parse: {io}") },
        SymError::Unsupported(msg) if msg.contains("no suitable format reader") => {
            AudioError::NotAudio { detail: "no audio format stemq reads was recognised in its bytes".into() }
        }
        SymError::Unsupported(msg) => match (wav_tag, &id.codec) {
            (Some(tag), _) => AudioError::UnsupportedCodec { codec: wav_tag_name(tag) },
            (None, Some(codec)) => AudioError::UnsupportedCodec { codec: format!("{} ({msg})", id.describe(codec)) },
            (None, None) if known => AudioError::UnsupportedCodec {
                codec: format!("a {} file stemq cannot read ({msg})", id.container.name()),
            },
            (None, None) => AudioError::UnsupportedCodec { codec: msg.to_string() },
        },
        other if known => AudioError::NotAudio { detail: format!("a damaged {} file: {other}", id.container.name()) },
        other => AudioError::NotAudio { detail: other.to_string() },
    }
}

impl Decoder {
    /// Opens a file. Its name plays no part: the format is found from its bytes.
    pub fn open_path(path: impl AsRef<Path>, opts: DecodeOptions) -> Result<Self, AudioError> {
        Self::open(File::open(path.as_ref())?, opts)
    }

    /// Opens any seekable byte source; the format is found from its bytes.
    ///
    /// A panic while probing is caught and returned as [`AudioError::Undecodable`].
    pub fn open<R>(source: R, opts: DecodeOptions) -> Result<Self, AudioError>
    where
        R: Read + Seek + Send + Sync + 'static,
    {
        guarded(|| Self::open_unguarded(source, opts))
    }

    fn open_unguarded<R>(mut source: R, opts: DecodeOptions) -> Result<Self, AudioError>
    where
        R: Read + Seek + Send + Sync + 'static,
    {
        if opts.target_sample_rate == 0 {
            return Err(AudioError::InvalidArgument("target sample rate must be > 0".into()));
        }
        let start = source.stream_position()?;
        let end = source.seek(SeekFrom::End(0))?;
        source.seek(SeekFrom::Start(start))?;
        if end <= start {
            return Err(AudioError::NotAudio { detail: "the file is zero bytes long".into() });
        }
        let input_bytes = end - start;
        let id = container::identify(&mut source, input_bytes)?;
        if let Some(refusal) = id.refusal.clone() {
            return Err(refusal.into_error());
        }
        let sniffed = sniff(&mut source);
        if let Some(rate) = sniffed.rate {
            check_rate(rate)?;
        }
        crate::preflight::check(&mut source, input_bytes)?;
        let wav_tag = sniffed.wav_tag;
        let mss = MediaSourceStream::new(
            Box::new(SeekableSource { inner: source, len: Some(end - start) }),
            MediaSourceStreamOptions::default(),
        );
        let probed = symphonia::default::get_probe()
            .format(&Hint::new(), mss, &FormatOptions::default(), &MetadataOptions::default())
            .map_err(|e| map_open_error(e, &sniffed, &id))?;
        let mut format = probed.format;
        let track = format
            .tracks()
            .iter()
            .find(|t| t.codec_params.codec != CODEC_TYPE_NULL)
            .or_else(|| format.default_track())
            .ok_or_else(|| AudioError::NotAudio { detail: "the container has no audio track".into() })?
            .clone();
        let params = &track.codec_params;
        let mut codec = codecs().make(params, &DecoderOptions { verify: false }).map_err(|e| match e {
            // MPEG Layer I/II found by the probe's search in a file whose first bytes are
            // no container: a stray frame sync in something else, not a codec to name.
            SymError::Unsupported(_)
                if id.container == container::Container::Unknown
                    && matches!(params.codec, codecs::CODEC_TYPE_MP1 | codecs::CODEC_TYPE_MP2) =>
            {
                AudioError::NotAudio { detail: "no audio format stemq reads was recognised in its bytes".into() }
            }
            SymError::Unsupported(msg) => match wav_tag {
                Some(tag) if params.codec == CODEC_TYPE_NULL => {
                    AudioError::UnsupportedCodec { codec: wav_tag_name(tag) }
                }
                _ => {
                    let name = match (&id.codec, params.codec) {
                        (Some(c), CODEC_TYPE_NULL) => c.clone(),
                        (_, ct) => codec_name(ct),
                    };
                    // The decoder's own reason, when the codec is one it reads.
                    let why =
                        if codecs().get_codec(params.codec).is_some() { format!(" ({msg})") } else { String::new() };
                    AudioError::UnsupportedCodec { codec: format!("{}{why}", id.describe(&name)) }
                }
            },
            other => map_open_error(other, &sniffed, &id),
        })?;
        // AAC's output rate doubles where SBR is found only in the stream: decode the first
        // packet to know it (kept for the first chunk).
        let mut conv = Converter { matrix: Vec::new(), spec: None, sample_buf: None };
        let mut pending = None;
        if params.codec == codecs::CODEC_TYPE_AAC {
            for _ in 0..16 {
                let Ok(packet) = format.next_packet() else { break };
                if packet.track_id() != track.id {
                    continue;
                }
                match codec.decode(&packet) {
                    Ok(buf) if buf.frames() == 0 => continue,
                    Ok(buf) => {
                        pending = Some(conv.convert(buf));
                        break;
                    }
                    Err(SymError::Unsupported(msg)) => {
                        return Err(AudioError::UnsupportedCodec { codec: id.describe(&format!("AAC ({msg})")) })
                    }
                    Err(e) => {
                        return Err(AudioError::CorruptFrame { at: format_mmss(0.0), detail: e.to_string() });
                    }
                }
            }
        }
        // The codec's rate (Opus always decodes at 48 kHz, whatever the container says).
        let sample_rate = codec
            .codec_params()
            .sample_rate
            .or(params.sample_rate)
            .ok_or_else(|| AudioError::NotAudio { detail: "the stream does not state its sample rate".into() })?;
        check_rate(sample_rate)?;
        // The container counts at its own rate (an HE-AAC track may count at the core
        // rate, half the output's): counts are brought to the decoder's.
        let at_rate = |n: u64, from: Option<u32>| match from {
            Some(from) if from > 0 && from != sample_rate => {
                (u128::from(n) * u128::from(sample_rate) / u128::from(from)).min(u128::from(u64::MAX)) as u64
            }
            _ => n,
        };
        let skip_frames = at_rate(id.skip_frames, id.timescale);
        let total_frames = id.total_frames.map(|n| at_rate(n, id.timescale));
        // The container's own count after its trims, else the stream's.
        let frames = total_frames.or(params.n_frames.map(|n| at_rate(n, params.sample_rate)));
        let duration_secs = frames.map(|f| f as f64 / sample_rate as f64);
        let info = SourceInfo {
            codec: codec_name(params.codec),
            sample_rate,
            channels: params.channels.map(|c| c.count()).unwrap_or(0),
            frames,
            duration_secs,
        };
        if frames == Some(0) {
            return Err(AudioError::Empty);
        }
        if let (Some(d), Some(max)) = (duration_secs, opts.max_duration_secs) {
            if d > max {
                return Err(AudioError::TooLong { duration: format_mmss(d), max: format_mmss(max) });
            }
        }
        if let Some(frames) = frames {
            let out_frames = u128::from(frames) * u128::from(opts.target_sample_rate) / u128::from(sample_rate);
            check_expansion(out_frames, input_bytes)?;
        }
        let resampler = if sample_rate != opts.target_sample_rate {
            Some(StreamResampler::new(sample_rate, opts.target_sample_rate)?)
        } else {
            None
        };
        Ok(Decoder {
            format,
            codec,
            track_id: track.id,
            time_base: params.time_base,
            info,
            opts,
            conv,
            resampler,
            pending,
            end_trim: id.end_trim_frames,
            held: None,
            eof: false,
            trimmed_frames: 0,
            decoded_frames: 0,
            output_frames: 0,
            input_bytes,
            skip_left: skip_frames,
            limit: total_frames,
            truncated: id.truncated,
            done: false,
        })
    }

    /// What the probe learnt about the source.
    pub fn info(&self) -> &SourceInfo {
        &self.info
    }

    /// Sample rate of the chunks this decoder yields.
    pub fn output_sample_rate(&self) -> u32 {
        self.opts.target_sample_rate
    }

    /// Frames decoded so far, at the source's native rate.
    pub fn decoded_frames(&self) -> u64 {
        self.decoded_frames
    }

    /// FLAC, ALAC and PCM state their exact length and packet positions.
    fn lossless(&self) -> bool {
        self.info.codec == "flac" || self.info.codec == "alac" || self.info.codec.starts_with("pcm")
    }

    /// Applies the container's trims to a decoded chunk (at the native rate).
    fn trim(&mut self, chunk: &mut StereoChunk) {
        if self.skip_left > 0 {
            let k = (self.skip_left.min(chunk.len() as u64)) as usize;
            chunk.left.drain(..k);
            chunk.right.drain(..k);
            self.skip_left -= k as u64;
        }
        if let Some(limit) = self.limit {
            let room = limit.saturating_sub(self.trimmed_frames);
            if (chunk.len() as u64) > room {
                chunk.left.truncate(room as usize);
                chunk.right.truncate(room as usize);
            }
        }
    }

    fn position_secs(&self, ts: Option<u64>) -> f64 {
        match (ts, self.time_base) {
            (Some(ts), Some(tb)) => {
                let t = tb.calc_time(ts);
                t.seconds as f64 + t.frac
            }
            _ => self.decoded_frames as f64 / self.info.sample_rate as f64,
        }
    }

    fn corrupt(&self, ts: Option<u64>, detail: impl Into<String>) -> AudioError {
        AudioError::CorruptFrame { at: format_mmss(self.position_secs(ts)), detail: detail.into() }
    }

    fn finish_stream(&mut self) -> Result<Option<StereoChunk>, AudioError> {
        self.done = true;
        if self.decoded_frames == 0 {
            return Err(AudioError::Empty);
        }
        if self.truncated {
            return Err(AudioError::CorruptFrame {
                at: format_mmss(self.decoded_frames as f64 / self.info.sample_rate as f64),
                detail: "the file is truncated: its last page is cut off or not marked as the end".into(),
            });
        }
        if let Some(expected) = self.info.frames {
            // A stream that stops well short of what its header promised was cut off.
            let slack = if self.lossless() { 0 } else { 8192 + expected / 100 };
            if self.decoded_frames + slack < expected {
                return Err(AudioError::CorruptFrame {
                    at: format_mmss(self.decoded_frames as f64 / self.info.sample_rate as f64),
                    detail: format!(
                        "the file is truncated: the data stops here but the header announces {}",
                        format_mmss(expected as f64 / self.info.sample_rate as f64)
                    ),
                });
            }
        }
        if let Some(r) = self.resampler.as_mut() {
            let mut out = StereoChunk::default();
            r.finish(&mut out)?;
            if !out.is_empty() {
                return Ok(Some(out));
            }
        }
        Ok(None)
    }

    /// Decodes the next chunk. Returns `Ok(None)` at the end of the stream.
    ///
    /// Chunk sizes follow the codec's packet sizes (and the resampler's
    /// block size); never rely on a particular size. A panic while decoding is
    /// caught and returned as [`AudioError::Undecodable`]; the decoder is done after
    /// any error.
    pub fn next_chunk(&mut self) -> Result<Option<StereoChunk>, AudioError> {
        if self.done {
            return Ok(None);
        }
        let result = guarded(|| self.next_chunk_unguarded());
        match result {
            Ok(Some(chunk)) => {
                self.output_frames += chunk.len() as u64;
                if let Err(e) = check_expansion(u128::from(self.output_frames), self.input_bytes) {
                    self.done = true;
                    return Err(e);
                }
                Ok(Some(chunk))
            }
            Ok(None) => Ok(None),
            Err(e) => {
                self.done = true;
                Err(e)
            }
        }
    }

    /// The next packet's samples at the native rate (`None` at the end of the packets;
    /// empty for a packet that decoded to nothing).
    fn next_packet_samples(&mut self) -> Result<Option<StereoChunk>, AudioError> {
        if let Some(first) = self.pending.take() {
            return Ok(Some(first));
        }
        let packet = match self.format.next_packet() {
            Ok(p) => p,
            Err(SymError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(SymError::ResetRequired) => return Ok(None),
            Err(SymError::IoError(e)) if from_the_os(&e) => return Err(AudioError::Io(e)),
            Err(e) => return Err(self.corrupt(None, e.to_string())),
        };
        if packet.track_id() != self.track_id {
            return Ok(Some(StereoChunk::default()));
        }
        let ts = packet.ts();
        match self.codec.decode(&packet) {
            Ok(buf) => {
                if buf.frames() == 0 {
                    return Ok(Some(StereoChunk::default()));
                }
                if self.info.codec == "flac" && ts > self.decoded_frames {
                    // The reader skipped damaged bytes and resynchronised.
                    let at = self.decoded_frames;
                    return Err(
                        self.corrupt(Some(at), format!("{} samples are missing (damaged data was skipped)", ts - at))
                    );
                }
                Ok(Some(self.conv.convert(buf)))
            }
            Err(SymError::Unsupported(msg)) => {
                Err(AudioError::UnsupportedCodec { codec: format!("{} ({msg})", self.info.codec) })
            }
            Err(SymError::IoError(e)) if e.kind() != std::io::ErrorKind::UnexpectedEof && from_the_os(&e) => {
                Err(AudioError::Io(e))
            }
            Err(e) => Err(self.corrupt(Some(ts), e.to_string())),
        }
    }

    /// The next samples after the container's trims, at the native rate; `None` at the
    /// end of the stream.
    fn next_trimmed(&mut self) -> Result<Option<StereoChunk>, AudioError> {
        loop {
            if self.eof || self.limit.is_some_and(|l| self.trimmed_frames >= l) {
                // The held-back packet, less the end padding.
                return Ok(self.held.take().map(|mut c| {
                    let keep = c.len().saturating_sub(usize::try_from(self.end_trim).unwrap_or(usize::MAX));
                    c.left.truncate(keep);
                    c.right.truncate(keep);
                    c
                }));
            }
            let Some(mut chunk) = self.next_packet_samples()? else {
                self.eof = true;
                continue;
            };
            self.trim(&mut chunk);
            self.trimmed_frames += chunk.len() as u64;
            if chunk.is_empty() {
                continue;
            }
            if self.end_trim == 0 {
                return Ok(Some(chunk));
            }
            // Padding to drop from the end lies in the last packet: each packet is held
            // until the next one shows it was not the last.
            if let Some(previous) = self.held.replace(chunk) {
                return Ok(Some(previous));
            }
        }
    }

    fn next_chunk_unguarded(&mut self) -> Result<Option<StereoChunk>, AudioError> {
        loop {
            if self.done {
                return Ok(None);
            }
            let decoded = match self.next_trimmed() {
                Ok(Some(c)) if c.is_empty() => continue,
                Ok(Some(c)) => c,
                Ok(None) => return self.finish_stream(),
                Err(e) => {
                    self.done = true;
                    return Err(e);
                }
            };
            self.decoded_frames += decoded.len() as u64;
            if self.info.channels == 0 {
                self.info.channels = self.conv.spec.map(|s| s.channels.count()).unwrap_or(0);
            }
            if let Some(max) = self.opts.max_duration_secs {
                let secs = self.decoded_frames as f64 / self.info.sample_rate as f64;
                if secs > max {
                    self.done = true;
                    return Err(AudioError::TooLong {
                        duration: format!("more than {}", format_mmss(max)),
                        max: format_mmss(max),
                    });
                }
            }
            match self.resampler.as_mut() {
                None => return Ok(Some(decoded)),
                Some(r) => {
                    let mut out = StereoChunk::with_capacity(decoded.len() * 2);
                    r.push(&decoded.left, &decoded.right, &mut out)?;
                    if !out.is_empty() {
                        return Ok(Some(out));
                    }
                }
            }
        }
    }
}

impl Iterator for Decoder {
    type Item = Result<StereoChunk, AudioError>;
    fn next(&mut self) -> Option<Self::Item> {
        self.next_chunk().transpose()
    }
}

/// How long the file at `path` plays, in milliseconds, as its header states (`None`:
/// not audio, or the header does not say). Reads the header only.
pub fn probe_duration_ms(path: &Path) -> Option<u64> {
    let d = Decoder::open_path(path, DecodeOptions::default()).ok()?;
    let info = d.info();
    match (info.frames, info.duration_secs) {
        (Some(f), _) if info.sample_rate > 0 => Some(f * 1000 / info.sample_rate as u64),
        (_, Some(s)) if s.is_finite() && s >= 0.0 => Some((s * 1000.0).round() as u64),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::from_the_os;

    /// A failed read of the disk stays transient (retried); symphonia running off the end
    /// of a frame's bits is damaged data (the fuzz regression
    /// `mp3_xing_end_of_bitstream.bin`).
    #[test]
    fn only_errors_from_the_os_count_as_io() {
        assert!(from_the_os(&std::io::Error::from_raw_os_error(5)));
        assert!(!from_the_os(&std::io::Error::other("unexpected end of bitstream")));
    }
}
