//! Owns AAC decoding: [`AacCodec`], a symphonia codec around `rusty_aac`, so symphonia's
//! MP4/M4A, Matroska/WebM and ADTS readers hand it their AAC packets like any other
//! codec.
//!
//! It reads the AudioSpecificConfig the reader puts in the codec parameters (MP4's
//! `esds`, Matroska's `CodecPrivate`); for ADTS, the rate and channel count its frame
//! headers state. It decodes AAC-LC, HE-AAC (SBR; signalled in the
//! configuration or found in the stream's fill elements) and HE-AAC v2 (SBR with
//! parametric stereo), AAC Main and AAC-LTP, to `f32` at the output rate: twice the core
//! rate where SBR is present. Channels come in ffmpeg's order (the WAVE channel mask's).
//!
//! With SBR found only in the stream (no signal in the configuration), the output rate is
//! known after the first packet: [`crate::decode`] decodes it before choosing the
//! resampler.
//!
//! `rusty_aac` was chosen over symphonia's own AAC decoder (AAC-LC only; its 0.6 release
//! still has no SBR), `oxideav-aac` (an AAC framework's codec, decoding to 16-bit PCM
//! through that framework's types) and the libfdk-aac bindings (165 000 lines of C++
//! built on every machine that builds stemq, under a licence Debian puts in non-free): it
//! is pure Rust with no dependencies, Apache-2.0 like stemq, fuzzed, and matches ffmpeg
//! within one 16-bit step on the ISO/IEC 14496-26 conformance streams.

use symphonia::core::audio::{AsAudioBufferRef, AudioBuffer, AudioBufferRef, Channels, Signal, SignalSpec};
use symphonia::core::codecs::{
    CodecDescriptor, CodecParameters, Decoder, DecoderOptions, FinalizeResult, CODEC_TYPE_AAC,
};
use symphonia::core::errors::{decode_error, unsupported_error, Result};
use symphonia::core::formats::Packet;

/// The most samples per channel one AAC packet decodes to (1024 doubled by SBR).
const MAX_PACKET_FRAMES: usize = 2048;

/// symphonia's positions of ffmpeg's AAC output order for `n` channels (the standard
/// channel configurations 1 to 7).
fn positions(n: usize) -> Option<Channels> {
    use Channels as C;
    Some(match n {
        1 => C::FRONT_LEFT,
        2 => C::FRONT_LEFT | C::FRONT_RIGHT,
        3 => C::FRONT_LEFT | C::FRONT_RIGHT | C::FRONT_CENTRE,
        4 => C::FRONT_LEFT | C::FRONT_RIGHT | C::FRONT_CENTRE | C::REAR_CENTRE,
        5 => C::FRONT_LEFT | C::FRONT_RIGHT | C::FRONT_CENTRE | C::REAR_LEFT | C::REAR_RIGHT,
        6 => C::FRONT_LEFT | C::FRONT_RIGHT | C::FRONT_CENTRE | C::LFE1 | C::REAR_LEFT | C::REAR_RIGHT,
        8 => {
            C::FRONT_LEFT
                | C::FRONT_RIGHT
                | C::FRONT_CENTRE
                | C::LFE1
                | C::REAR_LEFT
                | C::REAR_RIGHT
                | C::FRONT_LEFT_CENTRE
                | C::FRONT_RIGHT_CENTRE
        }
        _ => return None,
    })
}

/// How the decoder is (re)built: from the configuration bytes, or, for ADTS (whose
/// reader hands over the frames without their headers), from the rate and channel count
/// the headers state.
#[derive(Clone)]
enum Setup {
    Config(Vec<u8>),
    Adts { rate: u32, channels: u16 },
}

impl Setup {
    fn decoder(&self) -> Result<rusty_aac::AacDecoder> {
        match self {
            Setup::Config(asc) => match rusty_aac::AacDecoder::with_config_bytes(asc) {
                Ok(d) => Ok(d),
                Err(rusty_aac::Error::Unsupported(_)) => {
                    unsupported_error("aac: the stream's configuration uses a tool not decoded")
                }
                Err(_) => unsupported_error("aac: the stream's AudioSpecificConfig is invalid"),
            },
            &Setup::Adts { rate, channels } => Ok(rusty_aac::AacDecoder::with_config(rusty_aac::AudioSpecificConfig {
                object_type: 2,
                sample_rate: rate,
                channels,
            })),
        }
    }
}

/// The AAC codec for symphonia's readers (see the module docs).
pub(crate) struct AacCodec {
    params: CodecParameters,
    setup: Setup,
    dec: rusty_aac::AacDecoder,
    buf: AudioBuffer<f32>,
}

impl AacCodec {
    fn decode_packet(&mut self, data: &[u8]) -> Result<()> {
        self.buf.clear();
        let pcm = match self.dec.decode(data, None) {
            Ok(pcm) => pcm,
            Err(rusty_aac::Error::Again) => return Ok(()),
            Err(rusty_aac::Error::Unsupported(_)) => {
                return unsupported_error("aac: the stream uses a tool not decoded")
            }
            Err(_) => return decode_error("aac: the packet is malformed"),
        };
        let ch = usize::from(pcm.channels);
        let frames = pcm.frames();
        if ch == 0 || frames == 0 {
            return Ok(());
        }
        if frames > MAX_PACKET_FRAMES {
            return decode_error("aac: a packet decoded to more than 2048 samples");
        }
        let spec = *self.buf.spec();
        if spec.rate != pcm.sample_rate || spec.channels.count() != ch {
            // SBR found in the stream (the rate doubles), or a layout learnt from it.
            let Some(channels) = positions(ch) else {
                return unsupported_error("aac: a channel layout other than the standard ones");
            };
            self.buf = AudioBuffer::new(MAX_PACKET_FRAMES as u64, SignalSpec::new(pcm.sample_rate, channels));
            self.params.with_sample_rate(pcm.sample_rate).with_channels(channels);
        }
        self.buf.render_reserved(Some(frames));
        for c in 0..ch {
            let out = self.buf.chan_mut(c);
            for (i, o) in out.iter_mut().enumerate() {
                *o = pcm.samples[i * ch + c];
            }
        }
        Ok(())
    }
}

impl Decoder for AacCodec {
    fn try_new(params: &CodecParameters, _: &DecoderOptions) -> Result<Self> {
        let setup = match (params.extra_data.as_deref(), params.sample_rate) {
            (Some(asc), _) if !asc.is_empty() => Setup::Config(asc.to_vec()),
            (_, Some(rate)) => {
                Setup::Adts { rate, channels: params.channels.map_or(0, |c| c.count()).try_into().unwrap_or(0) }
            }
            _ => return unsupported_error("aac: the stream states neither its configuration nor its rate"),
        };
        let dec = setup.decoder()?;
        let mut params = params.clone();
        // The output rate the configuration announces (SBR doubles it); ADTS: the reader's.
        let rate = dec.output_sample_rate().or(params.sample_rate);
        let Some(rate) = rate else {
            return unsupported_error("aac: the stream does not state its sample rate");
        };
        let channels = params.channels.unwrap_or(Channels::FRONT_LEFT | Channels::FRONT_RIGHT);
        params.with_sample_rate(rate).with_channels(channels);
        let buf = AudioBuffer::new(MAX_PACKET_FRAMES as u64, SignalSpec::new(rate, channels));
        Ok(AacCodec { params, setup, dec, buf })
    }

    fn supported_codecs() -> &'static [CodecDescriptor] {
        &[CodecDescriptor {
            codec: CODEC_TYPE_AAC,
            short_name: "aac",
            long_name: "AAC (rusty_aac)",
            inst_func: |params, opts| Ok(Box::new(AacCodec::try_new(params, opts)?)),
        }]
    }

    fn reset(&mut self) {
        if let Ok(d) = self.setup.decoder() {
            self.dec = d;
        }
    }

    fn codec_params(&self) -> &CodecParameters {
        &self.params
    }

    fn decode(&mut self, packet: &Packet) -> Result<AudioBufferRef<'_>> {
        self.decode_packet(packet.buf())?;
        Ok(self.buf.as_audio_buffer_ref())
    }

    fn finalize(&mut self) -> FinalizeResult {
        FinalizeResult::default()
    }

    fn last_decoded(&self) -> AudioBufferRef<'_> {
        self.buf.as_audio_buffer_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use symphonia::core::codecs::CodecParameters;

    #[test]
    fn the_configuration_sets_the_output_rate() {
        // AAC-LC, 44.1 kHz stereo.
        let mut params = CodecParameters::new();
        params.for_codec(CODEC_TYPE_AAC).with_sample_rate(44_100).with_extra_data(Box::new([0x12, 0x10]));
        let lc = AacCodec::try_new(&params, &DecoderOptions::default()).unwrap();
        assert_eq!(lc.codec_params().sample_rate, Some(44_100));
        // HE-AAC, explicit (object type 5): 22.05 kHz core, 44.1 kHz out, stereo.
        params.with_sample_rate(22_050).with_extra_data(Box::new([0x2B, 0x92, 0x08, 0x00]));
        let he = AacCodec::try_new(&params, &DecoderOptions::default()).unwrap();
        assert_eq!(he.codec_params().sample_rate, Some(44_100));
        // Garbage is refused, not a panic.
        params.with_extra_data(Box::new([0xFF]));
        assert!(AacCodec::try_new(&params, &DecoderOptions::default()).is_err());
    }
}
