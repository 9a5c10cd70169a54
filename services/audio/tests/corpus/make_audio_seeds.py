import numpy as np, soundfile as sf, os, io
rng=np.random.default_rng(1)
def sig(rate, secs, ch):
    t=np.arange(int(rate*secs))/rate
    x=0.3*np.sin(2*np.pi*440*t)+0.05*rng.standard_normal(len(t))
    return np.stack([x*(0.8+0.2*i) for i in range(ch)],axis=1).astype(np.float32)
def w(name, data, rate, **kw):
    sf.write(name, data, rate, **kw); print(name, os.path.getsize(name))
w("pcm16_stereo_8k.wav", sig(8000,0.05,2), 8000, subtype="PCM_16")
w("pcmu8_mono_8k.wav", sig(8000,0.05,1), 8000, subtype="PCM_U8")
w("pcm24_mono_11k.wav", sig(11025,0.03,1), 11025, subtype="PCM_24")
w("float_stereo_48k.wav", sig(48000,0.005,2), 48000, subtype="FLOAT")
w("wavex_6ch_8k.wav", sig(8000,0.01,6), 8000, format="WAVEX", subtype="PCM_16")
w("flac16_stereo_8k.flac", sig(8000,0.1,2), 8000, subtype="PCM_16")
w("flac24_mono_22k.flac", sig(22050,0.05,1), 22050, subtype="PCM_24")
w("mp3_mono_8k.mp3", sig(8000,0.3,1), 8000, format="MP3")
w("mp3_stereo_44k.mp3", sig(44100,0.1,2), 44100, format="MP3")
w("vorbis_mono_8k.ogg", sig(8000,0.2,1), 8000, format="OGG", subtype="VORBIS", compression_level=1.0)
# legit worst cases for MAX_EXPANSION (not seeds)
music = lambda rate, secs: (lambda t: np.stack([0.3*np.sin(2*np.pi*220*t*(1+0.01*np.sin(t)))+0.2*np.sign(np.sin(2*np.pi*2*t))*np.sin(2*np.pi*80*t)+0.05*rng.standard_normal(len(t))],axis=1).astype(np.float32))(np.arange(int(rate*secs))/rate)
for fmt,kw,ext in [("MP3",dict(),"mp3"),("OGG",dict(subtype="VORBIS",compression_level=1.0),"ogg")]:
    b=io.BytesIO(); d=music(8000,60); sf.write(b,d,8000,format=fmt,**kw); n=len(b.getvalue())
    print("legit", fmt, n, "bytes for 60 s; expansion to 44.1k stereo f32:", 60*44100*8/n)
    b=io.BytesIO(); d=np.zeros((8000*60,1),np.float32); sf.write(b,d,8000,format=fmt,**kw); n=len(b.getvalue())
    print("silence", fmt, n, "bytes for 60 s; expansion:", 60*44100*8/n)
