#!/usr/bin/env bash
# Writes the fuzz seeds of the containers and codecs that Debian's ffmpeg encodes (the
# other seeds come from make_audio_seeds.py): a tenth of a second of a tone and noise each.
set -euo pipefail
cd "$(dirname "$0")/audio"
src=(-f lavfi -i "sine=frequency=440:duration=0.1:sample_rate=8000" -f lavfi -i "anoisesrc=d=0.1:r=8000:a=0.05")
mix=(-filter_complex "[0][1]amix=inputs=2")
ff() { ffmpeg -hide_banner -loglevel error -y "${src[@]}" "${mix[@]}" -map_metadata -1 -fflags +bitexact "$@"; }
ff -c:a aac -b:a 16k -movflags +faststart aac_mono_8k.m4a
ff -c:a aac -b:a 16k -ac 2 aac_stereo_8k_moov_last.m4a
ff -c:a alac alac_mono_8k.m4a
ff -ar 48000 -c:a libopus -b:a 16k opus_mono_48k.opus
ff -ar 48000 -ac 2 -c:a libopus -b:a 24k opus_stereo_48k.webm
ff -c:a libvorbis -q:a 0 vorbis_mono_8k.webm
ff -c:a pcm_s16be pcm16_mono_8k.aiff
ff -c:a pcm_f32be pcmf32_mono_8k.aifc
ff -c:a pcm_s16le pcm16_mono_8k.caf
ff -c:a pcm_f64le pcmf64_mono_8k.wav
ff -c:a pcm_s32le -ac 2 pcm32_stereo_8k.wav
ff -c:a adpcm_ima_wav adpcm_ima_mono_8k.wav
ls -l aac_* alac_* opus_* vorbis_mono_8k.webm pcm16_mono_8k.* pcmf* pcm32* adpcm*
