//! Owns naming what a file is from its bytes, before any decoder sees it: the container
//! and, where the container states it, the codec inside; and the trims a container asks
//! for (Opus pre-skip and the Ogg end granule, an MP4 edit list's priming samples).
//!
//! symphonia's probe looks for any known marker anywhere in the first megabyte, so an
//! unknown file can be taken for an MP3 with a stray frame sync in it (an AAC `.m4a`
//! was once refused as "MPEG-1 Layer I"). Here the first bytes decide: a container
//! stemq does not read is refused naming it and its codec ([`Identity::refusal`]), a
//! known one names the codec in any later error, and a file with no marker at its start
//! is left to the probe (MP3 with junk before it, raw ADTS).
//!
//! Only headers are read: a bounded number of boxes, pages or elements, each bounded by
//! the file's size, so memory does not depend on the file.

use std::io::{Read, Seek, SeekFrom};

use crate::error::AudioError;

/// What stemq decodes, as a person names it; every refusal of an input ends with it.
pub const SUPPORTED: &str = "WAV (PCM 8/16/24/32-bit, float, ADPCM), AIFF/AIFF-C, CAF, FLAC, MP3, \
                             Ogg (Vorbis, Opus, FLAC), M4A/MP4 (AAC-LC, HE-AAC, HE-AAC v2, ALAC, Opus, MP3), \
                             WebM/Matroska (Opus, Vorbis, AAC, FLAC)";

/// Bytes read from the start of the file to recognise it.
const HEAD: usize = 64 * 1024;
/// Most MP4 boxes walked (a real file has a few dozen).
const MAX_BOXES: usize = 4096;
/// Largest `moov` box read whole (a one-hour AAC song's is under 2 MiB).
const MAX_MOOV: u64 = 64 << 20;
/// Bytes read from the end of an Ogg file to find its last page.
const OGG_TAIL: u64 = 64 * 1024;

/// A container stemq recognises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Container {
    Wav,
    Aiff,
    Caf,
    Flac,
    Ogg,
    Mp4,
    Matroska,
    WebM,
    Mp3,
    /// Raw AAC in ADTS frames (`.aac`).
    Adts,
    /// Anything else: left to symphonia's probe.
    Unknown,
}

impl Container {
    /// The name a person knows the container by.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Container::Wav => "WAV",
            Container::Aiff => "AIFF",
            Container::Caf => "CAF",
            Container::Flac => "FLAC",
            Container::Ogg => "Ogg",
            Container::Mp4 => "MP4/M4A",
            Container::Matroska => "Matroska",
            Container::WebM => "WebM",
            Container::Mp3 => "MP3",
            Container::Adts => "ADTS (raw AAC)",
            Container::Unknown => "unknown",
        }
    }
}

/// What the first bytes say.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Identity {
    pub container: Container,
    /// The codec, as a person names it, where the container states it up front.
    pub codec: Option<String>,
    /// A file stemq cannot decode: the error to answer with.
    pub refusal: Option<Refusal>,
    /// Frames (at the codec's rate) to drop from the start of the decoded stream.
    pub skip_frames: u64,
    /// Frames the decoded stream holds after the skip, where the container says.
    pub total_frames: Option<u64>,
    /// Frames (at the codec's rate) to drop from the end of the decoded stream: the
    /// padding a WebM/Matroska Opus stream's last block asks to discard.
    pub end_trim_frames: u64,
    /// The rate [`Identity::skip_frames`] and [`Identity::total_frames`] count at, where
    /// it may differ from the decoder's (an MP4 track's timescale).
    pub timescale: Option<u32>,
    /// The container's framing shows the file was cut off (an Ogg file whose last page
    /// is incomplete or not marked as the end of its stream).
    pub truncated: bool,
}

/// Why a file is refused before decoding.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Refusal {
    /// Audio stemq does not decode: what it is.
    Codec(String),
    /// Not audio at all: what it is.
    NotAudio(String),
}

impl Refusal {
    pub(crate) fn into_error(self) -> AudioError {
        match self {
            Refusal::Codec(codec) => AudioError::UnsupportedCodec { codec },
            Refusal::NotAudio(detail) => AudioError::NotAudio { detail },
        }
    }
}

impl Identity {
    fn of(container: Container) -> Self {
        Identity {
            container,
            codec: None,
            refusal: None,
            skip_frames: 0,
            total_frames: None,
            end_trim_frames: 0,
            timescale: None,
            truncated: false,
        }
    }

    fn refused(container: Container, refusal: Refusal) -> Self {
        Identity { refusal: Some(refusal), ..Identity::of(container) }
    }

    /// `codec` named with its container, for errors: "AC-3 (Dolby Digital) in MP4/M4A".
    pub(crate) fn describe(&self, codec: &str) -> String {
        match self.container {
            Container::Unknown => codec.to_string(),
            c => format!("{codec} in {}", c.name()),
        }
    }
}

fn codec_refusal(container: Container, codec: &str) -> Identity {
    let mut id = Identity::of(container);
    id.refusal = Some(Refusal::Codec(id.describe(codec)));
    id.codec = Some(codec.to_string());
    id
}

/// Reads as much of `buf` as the source has; the count read.
fn read_full<R: Read>(r: &mut R, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Names the file that starts at the reader's position and is `len` bytes long; leaves
/// the position where it was. Only I/O errors fail it.
pub(crate) fn identify<R: Read + Seek>(r: &mut R, len: u64) -> Result<Identity, AudioError> {
    let start = r.stream_position()?;
    let result = identify_at(r, start, start + len);
    r.seek(SeekFrom::Start(start))?;
    Ok(result?)
}

fn identify_at<R: Read + Seek>(r: &mut R, start: u64, end: u64) -> std::io::Result<Identity> {
    let mut head = vec![0u8; HEAD.min((end - start) as usize)];
    r.seek(SeekFrom::Start(start))?;
    let n = read_full(r, &mut head)?;
    head.truncate(n);
    // An ID3v2 tag may stand before any container (MP3 mostly; FLAC and ADTS too).
    let mut at = 0usize;
    while head.len() >= at + 10 && &head[at..at + 3] == b"ID3" {
        let size = head[at + 6..at + 10].iter().fold(0usize, |s, &b| (s << 7) | usize::from(b & 0x7F));
        let footer = if head[at + 5] & 0x10 != 0 { 10 } else { 0 };
        at += 10 + size + footer;
        if at >= head.len() {
            // A tag larger than the head: whatever follows is the probe's to find.
            return Ok(Identity::of(Container::Mp3));
        }
    }
    let h = &head[at..];
    let pos = start + at as u64;
    Ok(match magic(h) {
        Magic::Known(c) => match c {
            Container::Ogg => ogg(r, h, pos, end)?,
            Container::Mp4 => mp4(r, pos, end)?,
            Container::Matroska => matroska(r, h, pos, end)?,
            Container::Aiff => aiff(h),
            c => Identity::of(c),
        },
        Magic::Refused(id) => id,
        Magic::None if at > 0 => Identity::of(Container::Mp3),
        Magic::None => Identity::of(Container::Unknown),
    })
}

enum Magic {
    Known(Container),
    Refused(Identity),
    None,
}

fn starts(h: &[u8], m: &[u8]) -> bool {
    h.len() >= m.len() && &h[..m.len()] == m
}

fn magic(h: &[u8]) -> Magic {
    let refuse = |c: Container, codec: &str| Magic::Refused(codec_refusal(c, codec));
    let other = |what: &str| Magic::Refused(Identity::refused(Container::Unknown, Refusal::Codec(what.to_string())));
    let not_audio = |what: &str| Magic::Refused(Identity::refused(Container::Unknown, Refusal::NotAudio(what.into())));
    if starts(h, b"RIFF") || starts(h, b"RIFX") {
        return match h.get(8..12) {
            Some(b"WAVE") => Magic::Known(Container::Wav),
            Some(b"AVI ") => other("an AVI video file"),
            Some(b"CDDA") => other("a CD audio track descriptor (.cda), which holds no audio"),
            _ => not_audio("a RIFF file that is not WAV"),
        };
    }
    if starts(h, b"RF64") || starts(h, b"BW64") {
        return other("an RF64/BW64 file (WAV over 4 GiB)");
    }
    if starts(h, b"FORM") {
        return match h.get(8..12) {
            Some(b"AIFF") | Some(b"AIFC") => Magic::Known(Container::Aiff),
            _ => other("an IFF file that is not AIFF"),
        };
    }
    if starts(h, b"caff") {
        return Magic::Known(Container::Caf);
    }
    if starts(h, b"fLaC") {
        return Magic::Known(Container::Flac);
    }
    if starts(h, b"OggS") {
        return Magic::Known(Container::Ogg);
    }
    if h.len() >= 8 && matches!(&h[4..8], b"ftyp" | b"moov" | b"mdat" | b"free" | b"wide" | b"skip") {
        return Magic::Known(Container::Mp4);
    }
    if starts(h, &[0x1A, 0x45, 0xDF, 0xA3]) {
        return Magic::Known(Container::Matroska);
    }
    if starts(h, &[0x30, 0x26, 0xB2, 0x75, 0x8E, 0x66, 0xCF, 0x11]) {
        return refuse(Container::Unknown, "Windows Media Audio (WMA, an ASF file)");
    }
    if starts(h, b"MAC ") {
        return other("Monkey's Audio (APE)");
    }
    if starts(h, b"wvpk") {
        return other("WavPack");
    }
    if starts(h, b"TTA1") {
        return other("TTA (True Audio)");
    }
    if starts(h, b"MPCK") || starts(h, b"MP+") {
        return other("Musepack");
    }
    if starts(h, b"OFR ") {
        return other("OptimFROG");
    }
    if starts(h, b"ajkg") {
        return other("Shorten");
    }
    if starts(h, b".snd") {
        return other("Sun/NeXT audio (.au)");
    }
    if starts(h, b"#!AMR") {
        return other("AMR speech audio");
    }
    if starts(h, b"DSD ") {
        return other("DSD audio (DSF)");
    }
    if starts(h, b"FRM8") {
        return other("DSD audio (DSDIFF)");
    }
    if starts(h, b".RMF") || starts(h, b".ra\xfd") {
        return other("RealAudio");
    }
    if starts(h, &[0x0B, 0x77]) {
        return other("AC-3 (Dolby Digital)");
    }
    if starts(h, &[0x7F, 0xFE, 0x80, 0x01]) {
        return other("DTS");
    }
    if starts(h, b"MThd") {
        return not_audio("a MIDI file (notes, not recorded audio)");
    }
    if starts(h, &[0x47]) && h.get(188) == Some(&0x47) {
        return other("an MPEG transport stream (.ts)");
    }
    if starts(h, &[0, 0, 1, 0xBA]) {
        return other("an MPEG program stream (.mpg/.vob)");
    }
    if starts(h, b"FLV") {
        return other("a Flash video file (FLV)");
    }
    if starts(h, b"%PDF") {
        return not_audio("a PDF document");
    }
    if starts(h, b"\x89PNG") || starts(h, &[0xFF, 0xD8, 0xFF]) || starts(h, b"GIF8") {
        return not_audio("an image");
    }
    if starts(h, b"PK\x03\x04") {
        return not_audio("a ZIP archive");
    }
    let text = h.iter().take(512).skip_while(|b| b.is_ascii_whitespace()).take(15).copied().collect::<Vec<u8>>();
    let lower = text.to_ascii_lowercase();
    if lower.starts_with(b"<!doctype html") || lower.starts_with(b"<html") {
        return not_audio("an HTML page");
    }
    if h.len() >= 2 && h[0] == 0xFF && h[1] & 0xF6 == 0xF0 {
        return Magic::Known(Container::Adts);
    }
    if h.len() >= 2 && h[0] == 0xFF && h[1] & 0xE0 == 0xE0 {
        // An MPEG audio frame sync at the very start: the probe reads it.
        return Magic::Known(Container::Mp3);
    }
    Magic::None
}

/// An AIFF's length from its `COMM` chunk (symphonia counts the `SSND` chunk's offset
/// and block-size fields as samples).
fn aiff(h: &[u8]) -> Identity {
    let mut id = Identity::of(Container::Aiff);
    let mut pos = 12usize;
    while pos + 8 <= h.len() {
        let size = u32::from_be_bytes(h[pos + 4..pos + 8].try_into().expect("4 bytes")) as usize;
        if &h[pos..pos + 4] == b"COMM" {
            id.total_frames =
                h.get(pos + 10..pos + 14).map(|b| u64::from(u32::from_be_bytes(b.try_into().expect("4 bytes"))));
            break;
        }
        pos = pos.saturating_add(8).saturating_add(size).saturating_add(size & 1);
    }
    id
}

/// The codec of an Ogg file's first logical stream, and Opus's trims.
fn ogg<R: Read + Seek>(r: &mut R, h: &[u8], pos: u64, end: u64) -> std::io::Result<Identity> {
    let mut id = Identity::of(Container::Ogg);
    // The first page holds the identification packet alone (RFC 3533 mappings).
    let Some(&nseg) = h.get(26) else { return Ok(id) };
    let body = 27 + usize::from(nseg);
    let Some(packet) = h.get(body..) else { return Ok(id) };
    let serial = h.get(14..18).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
    let codec = if packet.starts_with(b"\x01vorbis") {
        "Vorbis"
    } else if packet.starts_with(b"OpusHead") {
        "Opus"
    } else if packet.starts_with(b"\x7fFLAC") {
        "FLAC"
    } else if packet.starts_with(b"Speex   ") {
        return Ok(codec_refusal(Container::Ogg, "Speex"));
    } else if packet.starts_with(b"\x80theora") {
        return Ok(codec_refusal(Container::Ogg, "Theora video"));
    } else if packet.starts_with(b"\x80kate") {
        return Ok(codec_refusal(Container::Ogg, "Kate subtitles"));
    } else if packet.starts_with(b"fishead") {
        // Ogg Skeleton comes first; the audio stream follows: the reader finds it.
        return Ok(id);
    } else {
        return Ok(id);
    };
    id.codec = Some(codec.into());
    let Some(serial) = serial else { return Ok(id) };
    let tail = ogg_tail(r, pos, end, serial)?;
    id.truncated = !tail.complete || !tail.eos;
    // The pre-skip is the Opus codec's to drop (it reads it from the same header); the
    // last granule position, less the pre-skip, is the stream's length.
    if codec == "Opus" && packet.len() >= 12 {
        let pre_skip = u64::from(u16::from_le_bytes([packet[10], packet[11]]));
        id.total_frames = tail.granule.and_then(|g| g.checked_sub(pre_skip));
    }
    Ok(id)
}

/// What the end of an Ogg file says about stream `serial`.
struct OggTail {
    /// The last granule position of the stream.
    granule: Option<u64>,
    /// The stream's last page is marked as its end.
    eos: bool,
    /// The file's last page ends exactly where the file ends.
    complete: bool,
}

fn ogg_tail<R: Read + Seek>(r: &mut R, start: u64, end: u64, serial: u32) -> std::io::Result<OggTail> {
    let from = end.saturating_sub(OGG_TAIL).max(start);
    let mut tail = vec![0u8; (end - from) as usize];
    r.seek(SeekFrom::Start(from))?;
    let n = read_full(r, &mut tail)?;
    tail.truncate(n);
    let mut out = OggTail { granule: None, eos: false, complete: false };
    let mut i = 0;
    while i + 27 <= tail.len() {
        if &tail[i..i + 4] != b"OggS" || tail[i + 4] != 0 {
            i += 1;
            continue;
        }
        let nseg = usize::from(tail[i + 26]);
        let page_end =
            tail.get(i + 27..i + 27 + nseg).map(|t| i + 27 + nseg + t.iter().map(|&b| usize::from(b)).sum::<usize>());
        out.complete = page_end == Some(tail.len());
        let page_serial = u32::from_le_bytes(tail[i + 14..i + 18].try_into().expect("4 bytes"));
        if page_serial == serial {
            out.eos = tail[i + 5] & 0x04 != 0;
            let granule = u64::from_le_bytes(tail[i + 6..i + 14].try_into().expect("8 bytes"));
            // -1: no packet ends on this page.
            if granule != u64::MAX {
                out.granule = Some(granule);
            }
        }
        // A page whose body is all there: the next page starts after it.
        i = match page_end {
            Some(e) if e <= tail.len() => e,
            _ => i + 1,
        };
    }
    Ok(out)
}

/// The codec ids of a Matroska file's tracks, from its first bytes (the `Tracks`
/// element sits before the clusters in every muxer's output).
fn matroska<R: Read + Seek>(r: &mut R, h: &[u8], pos: u64, end: u64) -> std::io::Result<Identity> {
    let webm = h.windows(4).take(64).any(|w| w == b"webm");
    let container = if webm { Container::WebM } else { Container::Matroska };
    let mut id = Identity::of(container);
    // CodecID elements: id 0x86, a one-byte size, then the id string.
    let mut audio = Vec::new();
    let mut i = 0;
    while i + 2 < h.len() {
        if h[i] == 0x86 && h[i + 1] & 0x80 != 0 {
            let len = usize::from(h[i + 1] & 0x7F);
            if let Some(s) = h.get(i + 2..i + 2 + len) {
                if s.starts_with(b"A_") && s.iter().all(|b| b.is_ascii_graphic()) {
                    audio.push(String::from_utf8_lossy(s).into_owned());
                }
            }
        }
        i += 1;
    }
    let Some(first) = audio.first() else { return Ok(id) };
    let (name, supported) = match first.as_str() {
        "A_OPUS" => ("Opus", true),
        "A_VORBIS" => ("Vorbis", true),
        "A_FLAC" => ("FLAC", true),
        "A_MPEG/L3" => ("MP3", true),
        s if s.starts_with("A_AAC") => ("AAC", true),
        s if s.starts_with("A_PCM") => ("PCM", true),
        "A_AC3" => ("AC-3 (Dolby Digital)", false),
        "A_EAC3" => ("E-AC-3 (Dolby Digital Plus)", false),
        "A_DTS" => ("DTS", false),
        "A_TRUEHD" => ("Dolby TrueHD", false),
        "A_ALAC" => ("ALAC", false),
        "A_WAVPACK4" => ("WavPack", false),
        "A_MPEG/L2" => ("MPEG-1 Layer II", false),
        "A_MPEG/L1" => ("MPEG-1 Layer I", false),
        "A_TTA1" => ("TTA", false),
        "A_MS/ACM" => ("a Windows ACM codec", false),
        other => (other, false),
    };
    if !supported {
        return Ok(codec_refusal(container, name));
    }
    id.codec = Some(name.into());
    if name == "Opus" && audio.len() == 1 {
        // The codec drops the pre-skip (Matroska's CodecDelay); the end padding is
        // here, as ffmpeg rounds it: nanoseconds to 48 kHz samples.
        let ns = matroska_end_padding(r, pos, end)?;
        id.end_trim_frames = (u128::from(ns) * 48_000 + 500_000_000).div_euclid(1_000_000_000) as u64;
    }
    Ok(id)
}

/// Bytes read from the end of a Matroska file to find its last cluster.
const MKV_TAIL: u64 = 1 << 20;

/// An EBML variable-length integer at `d[at]`: its value (length marker kept for an
/// element id, dropped for a size), its length, and whether it is the reserved
/// "unknown" size.
fn vint(d: &[u8], at: usize, keep_marker: bool) -> Option<(u64, usize, bool)> {
    let first = *d.get(at)?;
    let len = first.leading_zeros() as usize + 1;
    if len > 8 {
        return None;
    }
    let mut v = if keep_marker { u64::from(first) } else { u64::from(first) & (0xFF >> len) };
    for &b in d.get(at + 1..at + len)? {
        v = (v << 8) | u64::from(b);
    }
    let unknown = !keep_marker && v == (1u64 << (7 * len)) - 1;
    Some((v, len, unknown))
}

/// One EBML element at `d[at]`: its id, where its body starts, and where it ends
/// (`limit` for an unknown size); `None` where it does not fit before `limit`.
fn ebml(d: &[u8], at: usize, limit: usize) -> Option<(u64, usize, usize)> {
    let (id, il, _) = vint(d, at, true)?;
    let (size, sl, unknown) = vint(d, at + il, false)?;
    let body = at + il + sl;
    let end = if unknown { limit } else { body.checked_add(usize::try_from(size).ok()?)? };
    (end <= limit).then_some((id, body, end))
}

/// The padding (ns) the last block of a Matroska file's last cluster asks to discard
/// (`DiscardPadding` in its `BlockGroup`; 0 for none or a `SimpleBlock`). The cluster is
/// the last one in the file's tail whose children tile it exactly.
fn matroska_end_padding<R: Read + Seek>(r: &mut R, start: u64, end: u64) -> std::io::Result<u64> {
    const CLUSTER: u64 = 0x1F43_B675;
    const BLOCK_GROUP: u64 = 0xA0;
    const SIMPLE_BLOCK: u64 = 0xA3;
    const DISCARD_PADDING: u64 = 0x75A2;
    let from = end.saturating_sub(MKV_TAIL).max(start);
    let mut tail = vec![0u8; (end - from) as usize];
    r.seek(SeekFrom::Start(from))?;
    let n = read_full(r, &mut tail)?;
    tail.truncate(n);
    let walk = |at: usize| -> Option<u64> {
        let (id, body, cend) = ebml(&tail, at, tail.len())?;
        if id != CLUSTER {
            return None;
        }
        let mut padding = None;
        let mut pos = body;
        while pos < cend {
            let (id, b, e) = ebml(&tail, pos, cend)?;
            match id {
                SIMPLE_BLOCK => padding = Some(0),
                BLOCK_GROUP => {
                    let mut ns = 0i64;
                    let mut p = b;
                    while p < e {
                        let (cid, cb, ce) = ebml(&tail, p, e)?;
                        if cid == DISCARD_PADDING && ce - cb <= 8 && ce > cb {
                            let raw = tail[cb..ce].iter().fold(0i64, |v, &x| (v << 8) | i64::from(x));
                            let bits = 64 - 8 * (ce - cb) as u32;
                            ns = (raw << bits) >> bits;
                        }
                        p = ce;
                    }
                    padding = Some(u64::try_from(ns).unwrap_or(0));
                }
                _ => {}
            }
            pos = e;
        }
        (pos == cend).then_some(padding.unwrap_or(0))
    };
    let mut at = tail.len();
    while let Some(i) = tail[..at].windows(4).rposition(|w| w == [0x1F, 0x43, 0xB6, 0x75]) {
        if let Some(ns) = walk(i) {
            return Ok(ns);
        }
        at = i;
    }
    Ok(0)
}

/// One MP4 box: its type and where its body lies.
pub(crate) struct Mp4Box {
    pub kind: [u8; 4],
    pub body: u64,
    pub end: u64,
}

/// The box at `pos` (whose parent ends at `end`), or `None` where the bytes stop being
/// boxes.
pub(crate) fn mp4_box<R: Read + Seek>(r: &mut R, pos: u64, end: u64) -> std::io::Result<Option<Mp4Box>> {
    if pos + 8 > end {
        return Ok(None);
    }
    let mut h = [0u8; 16];
    r.seek(SeekFrom::Start(pos))?;
    let n = read_full(r, &mut h[..(16u64.min(end - pos)) as usize])?;
    if n < 8 {
        return Ok(None);
    }
    let size32 = u64::from(u32::from_be_bytes(h[0..4].try_into().expect("4 bytes")));
    let kind: [u8; 4] = h[4..8].try_into().expect("4 bytes");
    let (size, header) = match size32 {
        0 => (end - pos, 8),
        1 if n >= 16 => (u64::from_be_bytes(h[8..16].try_into().expect("8 bytes")), 16),
        1 => return Ok(None),
        s => (s, 8),
    };
    if size < header || pos.checked_add(size).is_none_or(|e| e > end) {
        // Cut off: what is there is the probe's to judge.
        return Ok(None);
    }
    Ok(Some(Mp4Box { kind, body: pos + header, end: pos + size }))
}

/// The facts of an MP4 file's first sound track.
fn mp4<R: Read + Seek>(r: &mut R, start: u64, end: u64) -> std::io::Result<Identity> {
    let mut id = Identity::of(Container::Mp4);
    // The top level: find `moov`, wherever it is (before or after `mdat`).
    let mut pos = start;
    let mut moov = None;
    for _ in 0..MAX_BOXES {
        let Some(b) = mp4_box(r, pos, end)? else { break };
        if &b.kind == b"moov" {
            moov = Some(b);
            break;
        }
        pos = b.end;
    }
    let Some(moov) = moov else { return Ok(id) };
    if moov.end - moov.body > MAX_MOOV {
        return Ok(id);
    }
    let mut data = vec![0u8; (moov.end - moov.body) as usize];
    r.seek(SeekFrom::Start(moov.body))?;
    let n = read_full(r, &mut data)?;
    data.truncate(n);
    let mut movie_scale = 0u32;
    let mut tracks = Vec::new();
    for (kind, body) in children(&data) {
        match &kind {
            b"mvhd" => movie_scale = timescale(body).unwrap_or(0),
            b"trak" => tracks.push(body),
            _ => {}
        }
    }
    for trak in tracks {
        let Some(t) = sound_track(trak) else { continue };
        let Some(entry) = t.entry else { continue };
        let (name, supported) = sample_entry_name(&entry);
        if !supported {
            return Ok(codec_refusal(Container::Mp4, &name));
        }
        id.codec = Some(name);
        id.timescale = Some(t.media_scale).filter(|&s| s > 0);
        if let Some((media_time, segment)) = t.edit {
            if media_time > 0 {
                id.skip_frames = media_time;
            }
            if movie_scale > 0 && t.media_scale > 0 && segment > 0 {
                id.total_frames = Some(segment * u64::from(t.media_scale) / u64::from(movie_scale));
            }
        }
        return Ok(id);
    }
    Ok(id)
}

/// The boxes inside `data` (a box's body), stopping where they stop being boxes.
pub(crate) fn children(data: &[u8]) -> Vec<([u8; 4], &[u8])> {
    let mut out = Vec::new();
    let mut pos = 0usize;
    while pos + 8 <= data.len() && out.len() < MAX_BOXES {
        let size = u32::from_be_bytes(data[pos..pos + 4].try_into().expect("4 bytes")) as u64;
        let kind: [u8; 4] = data[pos + 4..pos + 8].try_into().expect("4 bytes");
        let (size, header) = match size {
            0 => ((data.len() - pos) as u64, 8),
            1 if pos + 16 <= data.len() => {
                (u64::from_be_bytes(data[pos + 8..pos + 16].try_into().expect("8 bytes")), 16)
            }
            1 => break,
            s => (s, 8),
        };
        if size < header || size > (data.len() - pos) as u64 {
            break;
        }
        out.push((kind, &data[pos + header as usize..pos + size as usize]));
        pos += size as usize;
    }
    out
}

fn child<'a>(data: &'a [u8], kind: &[u8; 4]) -> Option<&'a [u8]> {
    children(data).into_iter().find(|(k, _)| k == kind).map(|(_, b)| b)
}

/// The timescale of an `mvhd` or `mdhd` body.
fn timescale(body: &[u8]) -> Option<u32> {
    let at = if *body.first()? == 1 { 20 } else { 12 };
    Some(u32::from_be_bytes(body.get(at..at + 4)?.try_into().ok()?))
}

struct SoundTrack {
    entry: Option<SampleEntry>,
    media_scale: u32,
    /// The first edit's media time and segment duration (movie timescale).
    edit: Option<(u64, u64)>,
}

/// A sample entry: its type and, for `mp4a`, the object type indication of its `esds`
/// and the audio object type of its AudioSpecificConfig.
struct SampleEntry {
    kind: [u8; 4],
    object_type: Option<u8>,
    audio_object_type: Option<u8>,
}

fn sound_track(trak: &[u8]) -> Option<SoundTrack> {
    let mdia = child(trak, b"mdia")?;
    let hdlr = child(mdia, b"hdlr")?;
    if hdlr.get(8..12)? != b"soun" {
        return None;
    }
    let media_scale = child(mdia, b"mdhd").and_then(timescale).unwrap_or(0);
    let stsd = child(mdia, b"minf").and_then(|m| child(m, b"stbl")).and_then(|s| child(s, b"stsd"));
    let entry = stsd.and_then(|s| s.get(8..)).and_then(|e| children(e).into_iter().next()).map(|(kind, body)| {
        // An audio sample entry: 28 bytes of fields (v0), then its own boxes.
        let version = body.get(8..10).map(|v| u16::from_be_bytes([v[0], v[1]])).unwrap_or(0);
        let skip = match version {
            1 => 28 + 16,
            2 => 28 + 36,
            _ => 28,
        };
        let esds = body.get(skip..).and_then(|b| child(b, b"esds"));
        let (object_type, audio_object_type) = esds.map(esds_types).unwrap_or((None, None));
        SampleEntry { kind, object_type, audio_object_type }
    });
    let edit = child(trak, b"edts").and_then(|e| child(e, b"elst")).and_then(|elst| {
        let version = *elst.first()?;
        let count = u32::from_be_bytes(elst.get(4..8)?.try_into().ok()?);
        if count == 0 {
            return None;
        }
        if version == 1 {
            let seg = u64::from_be_bytes(elst.get(8..16)?.try_into().ok()?);
            let media = i64::from_be_bytes(elst.get(16..24)?.try_into().ok()?);
            Some((u64::try_from(media).unwrap_or(0), seg))
        } else {
            let seg = u64::from(u32::from_be_bytes(elst.get(8..12)?.try_into().ok()?));
            let media = i32::from_be_bytes(elst.get(12..16)?.try_into().ok()?);
            Some((u64::try_from(media).unwrap_or(0), seg))
        }
    });
    Some(SoundTrack { entry, media_scale, edit })
}

/// An MPEG-4 descriptor at `d[pos]`: its tag, where its body starts and its length.
fn descriptor(d: &[u8], pos: usize) -> Option<(u8, usize, usize)> {
    let tag = *d.get(pos)?;
    let mut len = 0usize;
    let mut i = pos + 1;
    for _ in 0..4 {
        let b = *d.get(i)?;
        i += 1;
        len = (len << 7) | usize::from(b & 0x7F);
        if b & 0x80 == 0 {
            break;
        }
    }
    Some((tag, i, len))
}

/// The object type indication and audio object type in an `esds` body.
fn esds_types(esds: &[u8]) -> (Option<u8>, Option<u8>) {
    let inner = || -> Option<(Option<u8>, Option<u8>)> {
        // Full box header, then ES_Descriptor (tag 3).
        let (tag, body, _) = descriptor(esds, 4)?;
        if tag != 3 {
            return None;
        }
        let flags = *esds.get(body + 2)?;
        let mut pos = body + 3;
        if flags & 0x80 != 0 {
            pos += 2;
        }
        if flags & 0x40 != 0 {
            pos += 1 + usize::from(*esds.get(pos)?);
        }
        if flags & 0x20 != 0 {
            pos += 2;
        }
        let (tag, dc, _) = descriptor(esds, pos)?;
        if tag != 4 {
            return None;
        }
        let oti = *esds.get(dc)?;
        // DecoderSpecificInfo (tag 5) after the 13 bytes of DecoderConfigDescriptor.
        let aot = descriptor(esds, dc + 13).filter(|(t, _, _)| *t == 5).and_then(|(_, dsi, len)| {
            let asc = esds.get(dsi..dsi + len)?;
            let first = *asc.first()? >> 3;
            if first == 31 {
                let second = *asc.get(1)?;
                Some(32 + (((asc[0] & 7) << 3) | (second >> 5)))
            } else {
                Some(first)
            }
        });
        Some((Some(oti), aot))
    };
    inner().unwrap_or((None, None))
}

/// How a sample entry's codec is named, and whether stemq decodes it.
fn sample_entry_name(e: &SampleEntry) -> (String, bool) {
    let named = |s: &str, ok: bool| (s.to_string(), ok);
    match &e.kind {
        b"mp4a" => match e.object_type {
            Some(0x40) | Some(0x66..=0x68) | None => match e.audio_object_type {
                Some(2) | None => named("AAC-LC", true),
                Some(5) => named("HE-AAC", true),
                Some(29) => named("HE-AAC v2", true),
                Some(1) => named("AAC Main", true),
                Some(4) => named("AAC-LTP", true),
                Some(3) => named("AAC-SSR", false),
                Some(23) => named("AAC-LD", false),
                Some(39) => named("AAC-ELD", false),
                Some(42) => named("xHE-AAC (USAC)", false),
                Some(n) => (format!("MPEG-4 audio object type {n}"), false),
            },
            Some(0x69) | Some(0x6B) => named("MP3", true),
            Some(0xA5) => named("AC-3 (Dolby Digital)", false),
            Some(0xA6) => named("E-AC-3 (Dolby Digital Plus)", false),
            Some(0xA9) => named("DTS", false),
            Some(0xAD) => named("Opus", true),
            Some(n) => (format!("MPEG-4 object type 0x{n:02X}"), false),
        },
        b"alac" => named("ALAC", true),
        b"Opus" => named("Opus", true),
        b"fLaC" => named("FLAC", true),
        b".mp3" => named("MP3", true),
        b"ac-3" => named("AC-3 (Dolby Digital)", false),
        b"ec-3" => named("E-AC-3 (Dolby Digital Plus)", false),
        b"ac-4" => named("AC-4", false),
        b"dtsc" | b"dtsh" | b"dtsl" | b"dtse" => named("DTS", false),
        b"samr" => named("AMR-NB", false),
        b"sawb" => named("AMR-WB", false),
        b"mha1" | b"mhm1" => named("MPEG-H 3D Audio", false),
        b"lpcm" | b"sowt" | b"twos" | b"in24" | b"in32" | b"fl32" | b"fl64" | b"raw " => named("PCM", true),
        b"ulaw" | b"alaw" => named("G.711", true),
        k => (format!("the `{}` codec", String::from_utf8_lossy(k)), false),
    }
}

/// An MP4 box of `kind` around `body`, for tests.
#[cfg(test)]
pub(crate) fn bx(kind: &[u8; 4], body: &[u8]) -> Vec<u8> {
    let mut v = ((body.len() + 8) as u32).to_be_bytes().to_vec();
    v.extend_from_slice(kind);
    v.extend_from_slice(body);
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn id(bytes: &[u8]) -> Identity {
        identify(&mut Cursor::new(bytes.to_vec()), bytes.len() as u64).unwrap()
    }

    #[test]
    fn foreign_files_are_named() {
        let asf = [0x30, 0x26, 0xB2, 0x75, 0x8E, 0x66, 0xCF, 0x11, 0xA6, 0xD9, 0, 0xAA, 0, 0x62, 0xCE, 0x6C];
        assert_eq!(id(&asf).refusal, Some(Refusal::Codec("Windows Media Audio (WMA, an ASF file)".into())));
        assert!(matches!(id(b"<!DOCTYPE html><html>").refusal, Some(Refusal::NotAudio(ref s)) if s == "an HTML page"));
        assert!(matches!(id(b"MAC \x96\x0f").refusal, Some(Refusal::Codec(ref s)) if s.contains("Monkey")));
        assert_eq!(id(b"RIFF\0\0\0\0WAVEfmt ").container, Container::Wav);
        assert_eq!(id(b"some bytes that are nothing").container, Container::Unknown);
    }

    /// An MP4 whose one sound track has the sample entry `entry`, its `moov` last.
    fn mp4_with(entry: &[u8]) -> Vec<u8> {
        let hdlr = bx(b"hdlr", &[0, 0, 0, 0, 0, 0, 0, 0, b's', b'o', b'u', b'n', 0, 0, 0, 0]);
        let mut stsd_body = vec![0, 0, 0, 0, 0, 0, 0, 1];
        stsd_body.extend_from_slice(entry);
        let minf = bx(b"minf", &bx(b"stbl", &bx(b"stsd", &stsd_body)));
        let mut mdia_body = hdlr;
        mdia_body.extend_from_slice(&minf);
        let mut file = bx(b"ftyp", b"M4A \0\0\0\0");
        file.extend_from_slice(&bx(b"mdat", &[0u8; 100]));
        file.extend_from_slice(&bx(b"moov", &bx(b"trak", &bx(b"mdia", &mdia_body))));
        file
    }

    /// An `mp4a` sample entry whose `esds` holds this AudioSpecificConfig.
    fn mp4a(asc: &[u8]) -> Vec<u8> {
        let mut dsi = vec![5, asc.len() as u8];
        dsi.extend_from_slice(asc);
        let mut dcd = vec![0x40, 0x15, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        dcd.extend_from_slice(&dsi);
        let mut es = vec![0, 1, 0];
        es.push(4);
        es.push(dcd.len() as u8);
        es.extend_from_slice(&dcd);
        let mut esds = vec![0, 0, 0, 0, 3, es.len() as u8];
        esds.extend_from_slice(&es);
        let mut body = vec![0u8; 28];
        body.extend_from_slice(&bx(b"esds", &esds));
        bx(b"mp4a", &body)
    }

    #[test]
    fn mp4_names_the_aac_object_type() {
        // AAC-LC, 44.1 kHz stereo.
        let lc = id(&mp4_with(&mp4a(&[0x12, 0x10])));
        assert_eq!((lc.codec.as_deref(), lc.refusal), (Some("AAC-LC"), None));
        // HE-AAC (object type 5, SBR) and HE-AAC v2 (29, PS): read.
        let he = id(&mp4_with(&mp4a(&[0x2B, 0x92, 0x08, 0x00])));
        assert_eq!((he.codec.as_deref(), he.refusal), (Some("HE-AAC"), None));
        let v2 = id(&mp4_with(&mp4a(&[0xEB, 0x92, 0x08, 0x00])));
        assert_eq!((v2.codec.as_deref(), v2.refusal), (Some("HE-AAC v2"), None));
        // xHE-AAC (USAC, 42, escaped): named and refused.
        let usac = id(&mp4_with(&mp4a(&[0xF9, 0x44, 0x10, 0x00])));
        assert_eq!(usac.refusal, Some(Refusal::Codec("xHE-AAC (USAC) in MP4/M4A".into())));
    }

    #[test]
    fn the_last_matroska_cluster_states_the_end_padding() {
        let el = |id: &[u8], body: &[u8]| [id, &[0x80 | body.len() as u8], body].concat();
        let simple = el(&[0xA3], &[0x81, 0, 0, 0x80, 1, 2]);
        let padded =
            el(&[0xA0], &[el(&[0xA1], &[0x81, 0, 20, 0x80, 3]), el(&[0x75, 0xA2], &[0x63, 0x2E, 0xA0])].concat());
        let cluster = |blocks: &[u8]| el(&[0x1F, 0x43, 0xB6, 0x75], &[el(&[0xE7], &[0]), blocks.to_vec()].concat());
        // Junk with a cluster id inside that does not tile, then a real cluster, then cues.
        let mut file = vec![0x1F, 0x43, 0xB6, 0x75, 0x85, 1, 2];
        file.extend(cluster(&simple));
        file.extend(cluster(&[simple.clone(), padded].concat()));
        file.extend(el(&[0x1C, 0x53, 0xBB, 0x6B], &[0xBB, 0x80]));
        let len = file.len() as u64;
        assert_eq!(matroska_end_padding(&mut Cursor::new(file.clone()), 0, len).unwrap(), 6_500_000);
        // A last block without padding.
        file.extend(cluster(&simple));
        let len = file.len() as u64;
        assert_eq!(matroska_end_padding(&mut Cursor::new(file), 0, len).unwrap(), 0);
    }

    #[test]
    fn mp4_names_the_codec_of_its_sound_track() {
        let got = id(&mp4_with(&bx(b"ac-3", &[0u8; 28])));
        assert_eq!(got.container, Container::Mp4);
        assert_eq!(got.refusal, Some(Refusal::Codec("AC-3 (Dolby Digital) in MP4/M4A".into())));
    }
}
