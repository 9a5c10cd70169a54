//! Owns the check of the lengths a file declares in its metadata, before symphonia
//! reads it.
//!
//! symphonia allocates some metadata fields at the length the file states, before
//! reading them: a Vorbis comment (FLAC `VORBIS_COMMENT` blocks, Ogg Vorbis/Opus
//! comment packets), a FLAC picture, a WAV `LIST`/`INFO` entry. A damaged or hostile
//! header of a few bytes can so ask for 4 GiB (found by `tests/fuzz.rs`). Every such
//! length is checked here against the bytes that can actually hold it (the rest of the
//! block, packet, chunk or file); a length that cannot fit is a damaged file
//! ([`AudioError::NotAudio`]). Nothing is allocated beyond one metadata block or
//! packet, itself bounded by the file's size.

use std::io::{Read, Seek, SeekFrom};

use crate::container;
use crate::error::AudioError;

/// Most chunks, blocks or pages looked at (real files have a handful).
const MAX_STEPS: usize = 4096;
/// Most Ogg bytes read while looking for the header packets.
const MAX_OGG_BYTES: u64 = 4 << 20;

fn damaged(what: &str, declared: u64, room: u64) -> AudioError {
    AudioError::NotAudio { detail: format!("damaged {what}: it declares {declared} bytes where only {room} remain") }
}

/// Checks the declared metadata lengths of the file that starts at the reader's
/// position and is `len` bytes long; leaves the position where it was.
pub(crate) fn check<R: Read + Seek>(r: &mut R, len: u64) -> Result<(), AudioError> {
    let start = r.stream_position()?;
    let result = check_from(r, start, start + len);
    r.seek(SeekFrom::Start(start))?;
    result
}

/// How far symphonia's probe looks for a container's marker (`Probe::PROBE_SEARCH_LIMIT`
/// in symphonia-core 0.5, plus its 16-byte window): it skips anything before it.
const PROBE_WINDOW: u64 = (1 << 20) + 16;

fn check_from<R: Read + Seek>(r: &mut R, start: u64, end: u64) -> Result<(), AudioError> {
    // The container whose marker comes first, wherever it is in the probe's window: the
    // one symphonia opens (a file may start with junk or a tag before it).
    let mut head = vec![0u8; PROBE_WINDOW.min(end - start) as usize];
    let n = read_exact_or_short(r, &mut head)?;
    head.truncate(n);
    if head.len() >= 8 && matches!(&head[4..8], b"ftyp" | b"moov" | b"mdat" | b"free" | b"wide" | b"skip" | b"moof") {
        return mp4(r, start, end);
    }
    let found = head.windows(4).position(|w| matches!(w, b"RIFF" | b"fLaC" | b"OggS"));
    let Some(at) = found else { return Ok(()) };
    let at_pos = start + at as u64;
    match &head[at..at + 4] {
        b"RIFF" => wav(r, at_pos + 12, end),
        b"fLaC" => flac(r, at_pos + 4, end),
        _ => ogg(r, at_pos, end),
    }
}

/// Reads as much of `buf` as the source has; the count read.
fn read_exact_or_short<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<usize, AudioError> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(n)
}

/// Reads `n` bytes at `pos`, or `None` when the file ends first.
fn read_at<R: Read + Seek>(r: &mut R, pos: u64, n: u64, end: u64) -> Result<Option<Vec<u8>>, AudioError> {
    if pos.checked_add(n).is_none_or(|e| e > end) {
        return Ok(None);
    }
    r.seek(SeekFrom::Start(pos))?;
    let mut buf = vec![0u8; n as usize];
    Ok((read_exact_or_short(r, &mut buf)? == buf.len()).then_some(buf))
}

/// A cursor over one metadata structure, checking each length against what is left.
struct Fields<'a> {
    data: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl Fields<'_> {
    fn u32(&mut self, big_endian: bool) -> Result<u32, AudioError> {
        let b = self.skip(4)?;
        let b: [u8; 4] = b.try_into().expect("4 bytes");
        Ok(if big_endian { u32::from_be_bytes(b) } else { u32::from_le_bytes(b) })
    }
    fn skip(&mut self, n: u64) -> Result<&[u8], AudioError> {
        let room = (self.data.len() - self.pos) as u64;
        if n > room {
            return Err(damaged(self.what, n, room));
        }
        let s = &self.data[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
}

/// A Vorbis comment (vendor, count, entries; little-endian lengths).
fn vorbis_comment(data: &[u8]) -> Result<(), AudioError> {
    let mut f = Fields { data, pos: 0, what: "Vorbis comment" };
    let vendor = f.u32(false)?;
    f.skip(u64::from(vendor))?;
    let n = f.u32(false)?;
    for _ in 0..n {
        let len = f.u32(false)?;
        f.skip(u64::from(len))?;
    }
    Ok(())
}

/// A FLAC `PICTURE` block (big-endian lengths).
fn flac_picture(data: &[u8]) -> Result<(), AudioError> {
    let mut f = Fields { data, pos: 0, what: "FLAC picture" };
    f.skip(4)?; // picture type
    let mime = f.u32(true)?;
    f.skip(u64::from(mime))?;
    let desc = f.u32(true)?;
    f.skip(u64::from(desc))?;
    f.skip(16)?; // width, height, depth, colours
    let len = f.u32(true)?;
    f.skip(u64::from(len))?;
    Ok(())
}

/// The body of one FLAC metadata block of type `kind`.
fn flac_block(kind: u8, body: &[u8]) -> Result<(), AudioError> {
    match kind {
        4 => vorbis_comment(body),
        6 => flac_picture(body),
        _ => Ok(()),
    }
}

fn flac<R: Read + Seek>(r: &mut R, mut pos: u64, end: u64) -> Result<(), AudioError> {
    for _ in 0..MAX_STEPS {
        let Some(h) = read_at(r, pos, 4, end)? else {
            return Ok(());
        };
        let last = h[0] & 0x80 != 0;
        let kind = h[0] & 0x7F;
        let len = u64::from(u32::from_be_bytes([0, h[1], h[2], h[3]]));
        pos += 4;
        if kind == 4 || kind == 6 {
            match read_at(r, pos, len, end)? {
                Some(body) => flac_block(kind, &body)?,
                None => return Err(damaged("FLAC metadata block", len, end - pos)),
            }
        }
        pos += len;
        if last {
            break;
        }
    }
    Ok(())
}

fn wav<R: Read + Seek>(r: &mut R, mut pos: u64, end: u64) -> Result<(), AudioError> {
    for _ in 0..MAX_STEPS {
        let Some(h) = read_at(r, pos, 8, end)? else {
            return Ok(());
        };
        let size = u64::from(u32::from_le_bytes([h[4], h[5], h[6], h[7]]));
        pos += 8;
        match &h[..4] {
            b"data" => return Ok(()),
            b"LIST" => {
                let room = end - pos;
                if size > room {
                    return Err(damaged("WAV LIST chunk", size, room));
                }
                let Some(body) = read_at(r, pos, size, end)? else {
                    return Ok(());
                };
                wav_list(&body)?;
            }
            _ => {}
        }
        pos += size + (size & 1);
    }
    Ok(())
}

/// The entries of a `LIST` chunk (`INFO` and others): each must fit in the list.
fn wav_list(body: &[u8]) -> Result<(), AudioError> {
    let mut f = Fields { data: body, pos: 0, what: "WAV LIST entry" };
    f.skip(4)?; // list type
    for _ in 0..MAX_STEPS {
        if f.pos + 8 > body.len() {
            break;
        }
        f.skip(4)?; // id
        let len = f.u32(false)?;
        f.skip(u64::from(len))?;
        if len & 1 == 1 && f.pos < body.len() {
            f.skip(1)?; // pad byte
        }
    }
    Ok(())
}

/// The header packets of the first logical stream of an Ogg file.
fn ogg<R: Read + Seek>(r: &mut R, start: u64, end: u64) -> Result<(), AudioError> {
    let mut pos = start;
    let mut serial = None;
    let mut packet = Vec::new();
    let mut packets = 0;
    let mut is_flac = false;
    for _ in 0..MAX_STEPS {
        if pos - start > MAX_OGG_BYTES || packets >= 8 {
            break;
        }
        let Some(h) = read_at(r, pos, 27, end)? else {
            break;
        };
        if &h[..4] != b"OggS" {
            break;
        }
        let this_serial = u32::from_le_bytes([h[14], h[15], h[16], h[17]]);
        let nseg = u64::from(h[26]);
        let Some(table) = read_at(r, pos + 27, nseg, end)? else {
            break;
        };
        let body_len: u64 = table.iter().map(|&s| u64::from(s)).sum();
        let body_pos = pos + 27 + nseg;
        pos = body_pos + body_len;
        if *serial.get_or_insert(this_serial) != this_serial {
            continue;
        }
        let Some(body) = read_at(r, body_pos, body_len, end)? else {
            break;
        };
        let mut at = 0usize;
        for &seg in &table {
            packet.extend_from_slice(&body[at..at + seg as usize]);
            at += seg as usize;
            if seg < 255 {
                packets += 1;
                if packets == 1 {
                    is_flac = packet.starts_with(b"\x7fFLAC");
                } else if let Some(c) = packet.strip_prefix(b"\x03vorbis") {
                    vorbis_comment(c)?;
                } else if let Some(c) = packet.strip_prefix(b"OpusTags") {
                    vorbis_comment(c)?;
                } else if is_flac && packet.len() >= 4 {
                    flac_block(packet[0] & 0x7F, &packet[4..])?;
                }
                packet.clear();
            }
        }
    }
    Ok(())
}

/// Most bytes of one MP4 `moov` or `moof` box read to check its tables (a 60-minute
/// track's tables take a few MiB).
const MAX_MP4_HEADER: u64 = 64 << 20;

/// An MP4/M4A file: the tables of its `moov` and `moof` boxes. symphonia reserves room for
/// each table (chunk offsets, sample sizes, time-to-sample, edit lists, fragment runs)
/// at the entry count the table declares; a count that its box cannot hold is a damaged
/// file, not a request for gigabytes.
fn mp4<R: Read + Seek>(r: &mut R, start: u64, end: u64) -> Result<(), AudioError> {
    let mut pos = start;
    for _ in 0..MAX_STEPS {
        let Some(b) = container::mp4_box(r, pos, end)? else {
            // A last box cut short by the end of the file is checked as far as it goes:
            // symphonia reads it too, and reserves by the counts it finds.
            let rest = end.saturating_sub(pos).min(MAX_MP4_HEADER);
            if rest >= 8 {
                if let Some(data) = read_at(r, pos, rest, end)? {
                    mp4_boxes(&data, 0)?;
                }
            }
            break;
        };
        if &b.kind == b"ftyp" && b.end - b.body < 8 {
            return Err(damaged("MP4 `ftyp` box", 8, b.end - b.body));
        }
        if matches!(&b.kind, b"moov" | b"moof") {
            let body = b.end - b.body;
            if body > MAX_MP4_HEADER {
                return Err(damaged("MP4 header box", body, MAX_MP4_HEADER));
            }
            if let Some(data) = read_at(r, b.body, body, end)? {
                mp4_boxes(&data, 0)?;
            }
        }
        pos = b.end;
    }
    Ok(())
}

/// Checks the boxes in `data` (a container box's body), descending into containers.
fn mp4_boxes(data: &[u8], depth: usize) -> Result<(), AudioError> {
    if depth >= 16 {
        return Ok(());
    }
    for (kind, body, declared) in children_or_cut(data) {
        match &kind {
            b"moov" | b"moof" | b"trak" | b"mdia" | b"minf" | b"stbl" | b"edts" | b"mvex" | b"traf" | b"dinf"
            | b"udta" => mp4_boxes(body, depth + 1)?,
            b"meta" => {
                mp4_min_body(&kind, body)?;
                mp4_boxes(&body[4..], depth + 1)?
            }
            b"ilst" => {
                for (_, item) in container::children(body) {
                    mp4_boxes(item, depth + 1)?
                }
            }
            _ => {
                mp4_cut_leaf(&kind, body, declared)?;
                mp4_min_body(&kind, body)?;
                mp4_table(&kind, body)?;
                mp4_sample_sizes(&kind, body)?;
                mp4_alac_config(&kind, body)?
            }
        }
    }
    Ok(())
}

/// The most samples an ALAC frame may declare (Apple's encoder writes 4096).
const MAX_ALAC_FRAME: u32 = 1 << 20;

/// The ALAC configuration (Apple's `ALACSpecificConfig`, the magic cookie) of an `stsd`
/// box's `alac` sample entries: symphonia reserves a buffer of the frame length times
/// the channels before decoding, so a frame length over [`MAX_ALAC_FRAME`] or a channel
/// count outside 1 to 8 is a damaged file.
fn mp4_alac_config(kind: &[u8; 4], body: &[u8]) -> Result<(), AudioError> {
    if kind != b"stsd" || body.len() < 8 {
        return Ok(());
    }
    for (entry_kind, entry) in container::children(&body[8..]) {
        // An audio sample entry's own fields take 28 bytes; its boxes follow.
        if &entry_kind != b"alac" || entry.len() < 28 {
            continue;
        }
        for (cookie_kind, cookie) in container::children(&entry[28..]) {
            // Version and flags, then the 24 bytes of the configuration.
            let Some(config) = cookie.get(4..28).filter(|_| &cookie_kind == b"alac") else { continue };
            let frame = u32::from_be_bytes(config[..4].try_into().expect("4 bytes"));
            let channels = config[9];
            if frame == 0 || frame > MAX_ALAC_FRAME || !(1..=8).contains(&channels) {
                return Err(AudioError::NotAudio {
                    detail: format!("damaged ALAC configuration: frames of {frame} samples in {channels} channels"),
                });
            }
        }
    }
    Ok(())
}

/// A box read whole (a handler's name, metadata, a codec's configuration) that the end
/// of the file cuts short of a size over [`MAX_PACKET`]: symphonia reserves the size it
/// declares before reading, so the lie would cost gigabytes. Media data may be cut (a
/// download that stopped).
fn mp4_cut_leaf(kind: &[u8; 4], body: &[u8], declared: u64) -> Result<(), AudioError> {
    if declared > body.len() as u64 && declared > MAX_PACKET && !matches!(kind, b"mdat" | b"free" | b"skip" | b"wide") {
        return Err(AudioError::NotAudio {
            detail: format!(
                "damaged MP4 `{}` box: it declares {declared} bytes where the file holds {}",
                String::from_utf8_lossy(kind),
                body.len()
            ),
        });
    }
    Ok(())
}

/// The boxes in `data`, and then the box that `data` ends inside of, cut at the end
/// (its body is what remains), each with the body size it declares.
fn children_or_cut(data: &[u8]) -> Vec<([u8; 4], &[u8], u64)> {
    let children = container::children(data);
    let used: usize = children
        .iter()
        .map(|(_, body)| body.as_ptr() as usize + body.len() - data.as_ptr() as usize)
        .max()
        .unwrap_or(0);
    let mut out: Vec<([u8; 4], &[u8], u64)> =
        children.into_iter().map(|(kind, body)| (kind, body, body.len() as u64)).collect();
    let rest = &data[used..];
    if rest.len() >= 8 {
        let size = u64::from(u32::from_be_bytes(rest[..4].try_into().expect("4 bytes")));
        let (header, size) = match size {
            1 => (16, rest.get(8..16).map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes"))).unwrap_or(0)),
            s => (8, s),
        };
        if size > rest.len() as u64 && rest.len() >= header {
            out.push((rest[4..8].try_into().expect("4 bytes"), &rest[header..], size - header as u64));
        }
    }
    out
}

/// One table box: its declared entry count against the bytes it holds.
fn mp4_table(kind: &[u8; 4], body: &[u8]) -> Result<(), AudioError> {
    let u32_at = |at: usize| body.get(at..at + 4).map(|b| u32::from_be_bytes(b.try_into().expect("4 bytes")));
    let version = body.first().copied().unwrap_or(0);
    let flags = u32_at(0).unwrap_or(0) & 0x00ff_ffff;
    // (offset of the count, bytes before the entries, bytes per entry)
    let layout: Option<(usize, usize, u64)> = match kind {
        b"stco" | b"stss" => Some((4, 8, 4)),
        b"co64" | b"stts" | b"ctts" => Some((4, 8, 8)),
        b"stsc" => Some((4, 8, 12)),
        b"stsz" => Some((8, 12, if u32_at(4) == Some(0) { 4 } else { 0 })),
        b"elst" => Some((4, 8, if version == 1 { 20 } else { 12 })),
        // Sample descriptions and data references: boxes of at least 8 bytes each.
        b"stsd" | b"dref" => Some((4, 8, 8)),
        b"sbgp" => {
            let at = if version == 1 { 12 } else { 8 };
            Some((at, at + 4, 8))
        }
        b"trun" => {
            let before = 8 + 4 * usize::from(flags & 0x001 != 0) + 4 * usize::from(flags & 0x004 != 0);
            let per = 4 * (flags & 0xf00).count_ones() as u64;
            Some((4, before, per))
        }
        _ => None,
    };
    let Some((count_at, before, per)) = layout else { return Ok(()) };
    let Some(count) = u32_at(count_at) else { return Ok(()) };
    let room = body.len().saturating_sub(before) as u64;
    let declared = u64::from(count) * per;
    if declared > room {
        let what = format!("MP4 `{}` table", String::from_utf8_lossy(kind));
        return Err(AudioError::NotAudio {
            detail: format!("damaged {what}: it declares {declared} bytes where only {room} remain"),
        });
    }
    // A table without entries of its own (fixed sample size, a run without per-sample
    // fields) still may not declare more samples than a file can have.
    if per == 0 && u64::from(count) > MAX_SAMPLES {
        return Err(AudioError::NotAudio {
            detail: format!("damaged MP4 `{}` table: it declares {count} samples", String::from_utf8_lossy(kind)),
        });
    }
    Ok(())
}

/// A box shorter than its fixed fields: symphonia subtracts those from the box's size,
/// and a smaller box would make it reserve nearly 4 GiB.
fn mp4_min_body(kind: &[u8; 4], body: &[u8]) -> Result<(), AudioError> {
    let min = match kind {
        b"hdlr" => 24,
        b"ftyp" | b"data" => 8,
        b"meta" | b"mean" | b"name" | b"alac" | b"esds" => 4,
        _ => 0,
    };
    if body.len() < min {
        return Err(AudioError::NotAudio {
            detail: format!(
                "damaged MP4 `{}` box: {} bytes where its fields need {min}",
                String::from_utf8_lossy(kind),
                body.len()
            ),
        });
    }
    Ok(())
}

/// The largest audio packet an MP4 file may declare. symphonia reserves a packet's
/// declared size before reading it; real audio packets (an ALAC frame of 4096 samples,
/// 8 channels of 32 bits) stay far below this.
const MAX_PACKET: u64 = 16 << 20;

/// The sample (packet) sizes an MP4 box declares: the fixed or per-sample sizes of
/// `stsz`, the per-sample sizes of a fragment run (`trun`), and the default sizes of
/// `tfhd` and `trex`. A size over [`MAX_PACKET`] is a damaged file.
fn mp4_sample_sizes(kind: &[u8; 4], body: &[u8]) -> Result<(), AudioError> {
    let u32_at = |at: usize| body.get(at..at + 4).map(|b| u32::from_be_bytes(b.try_into().expect("4 bytes")));
    let flags = u32_at(0).unwrap_or(0) & 0x00ff_ffff;
    let too_big = |size: u32| {
        (u64::from(size) > MAX_PACKET).then(|| AudioError::NotAudio {
            detail: format!(
                "damaged MP4 `{}` box: it declares a packet of {size} bytes (at most {MAX_PACKET})",
                String::from_utf8_lossy(kind)
            ),
        })
    };
    let sizes: Vec<u32> = match kind {
        b"stsz" => match u32_at(4) {
            Some(0) => {
                let count = u32_at(8).unwrap_or(0) as usize;
                (0..count).map_while(|i| u32_at(12 + 4 * i)).collect()
            }
            fixed => fixed.into_iter().collect(),
        },
        b"trun" if flags & 0x200 != 0 => {
            let count = u32_at(4).unwrap_or(0) as usize;
            let before = 8 + 4 * usize::from(flags & 0x001 != 0) + 4 * usize::from(flags & 0x004 != 0);
            let per = 4 * (flags & 0xf00).count_ones() as usize;
            let at = 4 * usize::from(flags & 0x100 != 0);
            (0..count).map_while(|i| u32_at(before + per * i + at)).collect()
        }
        b"tfhd" if flags & 0x10 != 0 => {
            let at = 8
                + 8 * usize::from(flags & 0x1 != 0)
                + 4 * usize::from(flags & 0x2 != 0)
                + 4 * usize::from(flags & 0x8 != 0);
            u32_at(at).into_iter().collect()
        }
        b"trex" => u32_at(16).into_iter().collect(),
        _ => Vec::new(),
    };
    match sizes.into_iter().find_map(too_big) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Most samples an MP4 table without per-sample entries may declare: 24 hours of
/// 384 kHz audio, one sample per entry.
const MAX_SAMPLES: u64 = 384_000 * 86_400;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::container::bx;

    #[test]
    fn comment_lengths_must_fit() {
        let mut ok = Vec::new();
        ok.extend_from_slice(&3u32.to_le_bytes());
        ok.extend_from_slice(b"abc");
        ok.extend_from_slice(&1u32.to_le_bytes());
        ok.extend_from_slice(&5u32.to_le_bytes());
        ok.extend_from_slice(b"A=bcd");
        vorbis_comment(&ok).unwrap();
        let mut bad = ok.clone();
        bad[11..15].copy_from_slice(&0x6000_0000u32.to_le_bytes());
        let e = vorbis_comment(&bad).unwrap_err();
        assert!(e.to_string().contains("declares 1610612736 bytes where only 5 remain"), "{e}");
        assert!(vorbis_comment(&ok[..13]).is_err());
    }

    #[test]
    fn an_mp4_table_that_declares_more_entries_than_it_holds_is_damaged() {
        let table = |count: u32| {
            let mut stco = vec![0u8; 4];
            stco.extend_from_slice(&count.to_be_bytes());
            stco.extend_from_slice(&[0u8; 8]);
            let stbl = bx(b"stbl", &bx(b"stco", &stco));
            let trak = bx(b"trak", &bx(b"mdia", &bx(b"minf", &stbl)));
            let mut file = bx(b"ftyp", b"M4A \0\0\0\0");
            file.extend(bx(b"moov", &trak));
            file
        };
        let check_bytes = |b: Vec<u8>| {
            let len = b.len() as u64;
            check(&mut std::io::Cursor::new(b), len)
        };
        assert!(check_bytes(table(2)).is_ok());
        let err = check_bytes(table(u32::MAX)).unwrap_err();
        assert!(err.to_string().contains("stco"), "{err}");
    }

    #[test]
    fn an_mp4_packet_larger_than_any_audio_packet_is_damaged() {
        let file = |stsz: &[u8]| {
            let stbl = bx(b"stbl", &bx(b"stsz", stsz));
            let trak = bx(b"trak", &bx(b"mdia", &bx(b"minf", &stbl)));
            let mut file = bx(b"ftyp", b"M4A \0\0\0\0");
            file.extend(bx(b"moov", &trak));
            let len = file.len() as u64;
            check(&mut std::io::Cursor::new(file), len)
        };
        let table = |sizes: &[u32]| {
            let mut stsz = vec![0u8; 8];
            stsz.extend_from_slice(&(sizes.len() as u32).to_be_bytes());
            sizes.iter().for_each(|s| stsz.extend_from_slice(&s.to_be_bytes()));
            stsz
        };
        let fixed = |size: u32| {
            let mut stsz = vec![0u8; 4];
            stsz.extend_from_slice(&size.to_be_bytes());
            stsz.extend_from_slice(&10u32.to_be_bytes());
            stsz
        };
        assert!(file(&table(&[400, 4096])).is_ok());
        assert!(file(&fixed(4096)).is_ok());
        for bad in [table(&[400, u32::MAX]), fixed(0xF000_0000)] {
            let err = file(&bad).unwrap_err();
            assert!(err.to_string().contains("declares a packet of"), "{err}");
        }
        let mut trun = vec![0, 0, 0x02, 0x00];
        trun.extend_from_slice(&1u32.to_be_bytes());
        trun.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(mp4_sample_sizes(b"trun", &trun).is_err());
        trun[8..12].copy_from_slice(&512u32.to_be_bytes());
        assert!(mp4_sample_sizes(b"trun", &trun).is_ok());
    }

    #[test]
    fn an_mp4_table_cut_by_the_end_of_the_file_is_checked_as_far_as_it_goes() {
        let mut stts = vec![0u8; 4];
        stts.extend_from_slice(&u32::MAX.to_be_bytes());
        stts.extend_from_slice(&[0u8; 16]);
        let stbl = bx(b"stbl", &bx(b"stts", &stts));
        let trak = bx(b"trak", &bx(b"mdia", &bx(b"minf", &stbl)));
        let mut file = bx(b"ftyp", b"M4A \0\0\0\0");
        file.extend(bx(b"moov", &trak));
        // Cut the file inside the table: every box around it now claims more than remains.
        file.truncate(file.len() - 8);
        let len = file.len() as u64;
        let err = check(&mut std::io::Cursor::new(file), len).unwrap_err();
        assert!(err.to_string().contains("stts"), "{err}");
    }

    #[test]
    fn an_mp4_box_read_whole_that_the_file_cuts_short_of_gigabytes_is_damaged() {
        // moov > trak > mdia > hdlr, the hdlr declaring 2 GiB and the file ending 40
        // bytes into it (the fuzz target's abort: symphonia reserved the handler's name).
        let file = |declared: u32| {
            let mut hdlr = declared.to_be_bytes().to_vec();
            hdlr.extend_from_slice(b"hdlr");
            hdlr.extend_from_slice(&[0u8; 40]);
            let trak = bx(b"trak", &bx(b"mdia", &hdlr));
            let mut file = bx(b"ftyp", b"M4A \0\0\0\0");
            file.extend(bx(b"moov", &trak));
            let len = file.len() as u64;
            check(&mut std::io::Cursor::new(file), len)
        };
        let err = file(0x8000_000d).unwrap_err();
        assert!(err.to_string().contains("`hdlr` box: it declares"), "{err}");
        // A box cut by a few bytes is checked as far as it goes, as before.
        assert!(file(60).is_ok());
    }

    #[test]
    fn an_alac_configuration_beyond_a_frame_of_a_million_samples_or_eight_channels_is_damaged() {
        let file = |frame: u32, channels: u8| {
            let mut config = vec![0u8; 4];
            config.extend_from_slice(&frame.to_be_bytes());
            config.extend_from_slice(&[0, 16, 40, 10, 14, channels, 0, 255]);
            config.extend_from_slice(&[0u8; 12]);
            let mut entry = vec![0u8; 28];
            entry.extend(bx(b"alac", &config));
            let mut stsd = vec![0, 0, 0, 0, 0, 0, 0, 1];
            stsd.extend(bx(b"alac", &entry));
            let stbl = bx(b"stbl", &bx(b"stsd", &stsd));
            let trak = bx(b"trak", &bx(b"mdia", &bx(b"minf", &stbl)));
            let mut file = bx(b"ftyp", b"M4A \0\0\0\0");
            file.extend(bx(b"moov", &trak));
            let len = file.len() as u64;
            check(&mut std::io::Cursor::new(file), len)
        };
        assert!(file(4096, 2).is_ok());
        for (frame, channels) in [(0x7374_7473, 1), (0, 2), (4096, 0), (4096, 9)] {
            let err = file(frame, channels).unwrap_err();
            assert!(err.to_string().contains("damaged ALAC configuration"), "{err}");
        }
    }

    #[test]
    fn an_mp4_box_shorter_than_its_fields_is_damaged() {
        let file = |hdlr_body: &[u8]| {
            let trak = bx(b"trak", &bx(b"mdia", &bx(b"hdlr", hdlr_body)));
            let mut file = bx(b"ftyp", b"M4A \0\0\0\0");
            file.extend(bx(b"moov", &trak));
            let len = file.len() as u64;
            check(&mut std::io::Cursor::new(file), len)
        };
        assert!(file(&[0u8; 25]).is_ok());
        let err = file(&[0u8; 4]).unwrap_err();
        assert!(err.to_string().contains("`hdlr` box: 4 bytes"), "{err}");
    }
}
