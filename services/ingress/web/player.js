// The stems of a finished job as players that play in sync: one AudioContext, each stem
// an AudioBuffer through its own gain (volume, mute, solo), one clock for all. Each stem
// shows its waveform with a playhead; clicking a waveform seeks every stem.

import { el, clock } from "./dom.js";

export class Mixer {
  // `stems`: [{ name, bytes: ArrayBuffer }] in the job's order.
  constructor(host, stems, onError) {
    this.host = host;
    this.ctx = new AudioContext();
    this.offset = 0;        // position (s) when paused
    this.startedAt = null;  // ctx time that corresponds to position 0, while playing
    this.sources = [];
    this.tracks = [];
    this.duration = 0;
    this.onError = onError;
    this.ready = this.load(stems);
  }

  async load(stems) {
    const decoded = await Promise.all(stems.map(async (s) => {
      try { return await this.ctx.decodeAudioData(s.bytes.slice(0)); } catch { return null; }
    }));
    this.host.replaceChildren();
    const transport = el("div", { class: "transport" },
      this.playAll = el("button", { type: "button", class: "play-all", "aria-pressed": "false" }, "Play all"),
      this.time = el("output", { class: "time", "aria-live": "off" }, "0:00"),
    );
    this.playAll.addEventListener("click", () => this.toggle());
    this.host.append(transport);
    stems.forEach((s, i) => {
      const buffer = decoded[i];
      if (buffer) this.duration = Math.max(this.duration, buffer.duration);
      this.tracks.push(this.track(s.name, buffer));
    });
    this.time.textContent = `${clock(0)} / ${clock(this.duration)}`;
    if (decoded.some((b) => !b)) this.onError?.("This browser cannot play some stems; download them instead.");
    this.mix();
  }

  track(name, buffer) {
    const gain = this.ctx.createGain();
    gain.connect(this.ctx.destination);
    const t = { name, buffer, gain, mute: false, solo: false, volume: 1 };
    const id = `stem-${name}`;
    const canvas = el("canvas", { class: "wave", width: "600", height: "64", "aria-hidden": "true" });
    const play = el("button", { type: "button", class: "play", "aria-pressed": "false", "aria-label": `Play ${name}` }, "Play");
    const mute = el("button", { type: "button", class: "mute", "aria-pressed": "false", "aria-label": `Mute ${name}` }, "Mute");
    const solo = el("button", { type: "button", class: "solo", "aria-pressed": "false", "aria-label": `Solo ${name}` }, "Solo");
    const volume = el("input", { type: "range", min: "0", max: "1.5", step: "0.05", value: "1", id: `${id}-volume` });
    const row = el("div", { class: "stem", role: "group", "aria-label": name, "data-stem": name },
      el("h3", {}, name),
      canvas,
      el("div", { class: "stem-controls" },
        play, mute, solo,
        el("label", { for: `${id}-volume` }, "Volume"), volume,
      ),
    );
    t.row = row; t.canvas = canvas; t.play = play;
    play.addEventListener("click", () => this.toggle());
    mute.addEventListener("click", () => { t.mute = !t.mute; mute.setAttribute("aria-pressed", String(t.mute)); this.mix(); });
    solo.addEventListener("click", () => { t.solo = !t.solo; solo.setAttribute("aria-pressed", String(t.solo)); this.mix(); });
    volume.addEventListener("input", () => { t.volume = Number(volume.value); this.mix(); });
    canvas.addEventListener("click", (e) => {
      const r = canvas.getBoundingClientRect();
      this.seek(((e.clientX - r.left) / r.width) * this.duration);
    });
    if (buffer) t.peaks = peaks(buffer, 600); else play.disabled = true;
    this.host.append(row);
    this.draw(t, 0);
    return t;
  }

  // Gains from mute, solo and volume: with any stem soloed, only soloed stems sound.
  mix() {
    const soloing = this.tracks.some((t) => t.solo);
    for (const t of this.tracks) {
      const on = !t.mute && (!soloing || t.solo);
      t.gain.gain.setTargetAtTime(on ? t.volume : 0, this.ctx.currentTime, 0.01);
      t.row.classList.toggle("silent", !on);
    }
  }

  get playing() { return this.startedAt !== null; }

  position() {
    return this.playing ? Math.min(this.ctx.currentTime - this.startedAt, this.duration) : this.offset;
  }

  async toggle() {
    if (this.playing) this.pause(); else await this.play();
  }

  async play() {
    await this.ctx.resume();
    if (this.offset >= this.duration) this.offset = 0;
    const at = this.ctx.currentTime + 0.05;
    this.sources = this.tracks.filter((t) => t.buffer).map((t) => {
      const src = this.ctx.createBufferSource();
      src.buffer = t.buffer;
      src.connect(t.gain);
      src.start(at, this.offset);
      return src;
    });
    this.startedAt = at - this.offset;
    this.pressed(true);
    const tick = () => {
      if (!this.playing) return;
      const p = this.position();
      this.show(p);
      if (p >= this.duration) { this.pause(); this.offset = 0; this.show(0); return; }
      requestAnimationFrame(tick);
    };
    requestAnimationFrame(tick);
  }

  pause() {
    if (!this.playing) return;
    this.offset = this.position();
    for (const s of this.sources) { try { s.stop(); } catch { /* already stopped */ } }
    this.sources = [];
    this.startedAt = null;
    this.pressed(false);
    this.show(this.offset);
  }

  async seek(t) {
    const was = this.playing;
    this.pause();
    this.offset = Math.max(0, Math.min(t, this.duration));
    this.show(this.offset);
    if (was) await this.play();
  }

  pressed(on) {
    this.playAll.setAttribute("aria-pressed", String(on));
    this.playAll.textContent = on ? "Pause all" : "Play all";
    for (const t of this.tracks) {
      t.play.setAttribute("aria-pressed", String(on));
      t.play.textContent = on ? "Pause" : "Play";
    }
    this.host.dataset.playing = String(on);
  }

  show(p) {
    this.time.textContent = `${clock(p)} / ${clock(this.duration)}`;
    this.host.dataset.position = p.toFixed(2);
    for (const t of this.tracks) this.draw(t, this.duration ? p / this.duration : 0);
  }

  draw(t, frac) {
    const c = t.canvas, g = c.getContext("2d");
    const w = c.width, h = c.height, mid = h / 2;
    g.clearRect(0, 0, w, h);
    if (!t.peaks) return;
    const played = Math.round(frac * w);
    for (let x = 0; x < w; x++) {
      const [lo, hi] = t.peaks[x];
      g.fillStyle = x < played ? "#1f6feb" : "#8b949e";
      g.fillRect(x, mid - hi * mid, 1, Math.max(1, (hi - lo) * mid));
    }
    g.fillStyle = "#d1242f";
    g.fillRect(Math.min(played, w - 1), 0, 1, h);
  }

  close() {
    this.pause();
    this.ctx.close();
  }
}

// Min and max of each of `n` columns, over all channels.
function peaks(buffer, n) {
  const out = [];
  const chans = Array.from({ length: buffer.numberOfChannels }, (_, i) => buffer.getChannelData(i));
  const per = Math.max(1, Math.floor(buffer.length / n));
  for (let x = 0; x < n; x++) {
    let lo = 0, hi = 0;
    const from = x * per, to = Math.min(buffer.length, from + per);
    for (const d of chans) {
      for (let i = from; i < to; i += 4) {
        const v = d[i];
        if (v < lo) lo = v; else if (v > hi) hi = v;
      }
    }
    out.push([lo, hi]);
  }
  return out;
}
