// The page: sign in, separate a song, follow it, listen to its stems; recent jobs; the
// operators' view. Plain modules, no build step; every call goes through the public API
// with the key from this tab's session storage.

import { api, bytes, upload, follow, session, TERMINAL } from "./api.js";
import { sayRequest, sayJob, sayStatus } from "./words.js";
import { Mixer } from "./player.js";
import { zip } from "./zip.js";
import { Ops } from "./ops.js";
import { el, ago, download, short } from "./dom.js";

const $ = (id) => document.getElementById(id);
const SECTIONS = ["signin", "home", "job", "ops"];
let me = null;        // GET /v1/me
let models = null;    // GET /v1/models
let job = null;       // the job on screen: { id, abort, mixer, stems }
let recentTimer = null;
const ops = new Ops();

function show(id) {
  $("loading").hidden = true;
  for (const s of SECTIONS) $(s).hidden = s !== id;
}

// ---- signing in ----------------------------------------------------------------

async function start() {
  wire();
  const link = location.hash.match(/^#signin=([0-9a-fA-F]+)$/);
  if (link) {
    // The token is used once; drop it from the address bar and history at once.
    history.replaceState(null, "", `${location.pathname}#/`);
    try {
      const r = await api("POST", "/v1/signin", { token: link[1] });
      session.key = r.key;
    } catch (e) {
      await check();
      if (!me) $("signin-error").textContent = `This sign-in link did not work: ${sayRequest(e)}`;
      return;
    }
  }
  await check();
}

// Who the stored key is (or whether no key is needed); the sign-in form otherwise.
async function check() {
  try {
    me = await api("GET", "/v1/me");
  } catch (e) {
    me = null;
    if (e.status === 401) {
      if (session.key) $("signin-error").textContent = sayRequest(e);
      session.key = null;
    } else {
      $("signin-error").textContent = sayRequest(e);
    }
    $("nav").hidden = true;
    show("signin");
    $("key").focus();
    return;
  }
  $("nav").hidden = false;
  $("who").textContent = `${me.owner} · ${me.role}`;
  $("nav-ops").hidden = !me.can.operate;
  $("signout").hidden = !session.key;
  route();
}

async function signIn(ev) {
  ev.preventDefault();
  $("signin-error").textContent = "";
  session.key = $("key").value.trim();
  $("key").value = "";
  await check();
}

function signOut() {
  session.key = null;
  me = null;
  leaveJob();
  ops.stop();
  location.hash = "#/";
  $("signin-error").textContent = "";
  check();
}

// ---- routing -------------------------------------------------------------------

function route() {
  if (!me) return;
  const h = location.hash;
  const m = h.match(/^#\/jobs\/([0-9a-f]{64})$/);
  if (m) {
    if (job?.id !== m[1]) openJob(m[1]);
    else show("job");
    ops.stop();
    stopRecent();
    return;
  }
  leaveJob();
  if (h === "#/ops" && me.can.operate) {
    stopRecent();
    show("ops");
    ops.start();
    return;
  }
  ops.stop();
  show("home");
  home();
}

// ---- a new job -----------------------------------------------------------------

async function home() {
  $("go").disabled = !me.can.write;
  if (!me.can.write) $("form-error").textContent = "This key can read jobs but not submit them.";
  if (!models) {
    try {
      models = await api("GET", "/v1/models");
    } catch (e) {
      $("form-error").textContent = sayRequest(e);
    }
    fillModels();
  }
  startRecent();
}

// While no worker serves any model (a stack just starting, or all workers down), ask
// again every 2 s, so the choice appears as soon as one does.
let modelsRetry = null;

function fillModels() {
  const sel = $("model");
  sel.replaceChildren();
  if (!models) return;
  const usable = models.models.filter((m) => m.served !== false);
  for (const m of usable) sel.append(el("option", { value: m.name }, m.name));
  const hidden = models.models.length - usable.length;
  $("model-note").textContent = usable.length === 0
    ? "No worker is running right now, so no model can be picked yet. Models appear here as soon as a worker serves one."
    : hidden > 0 ? `${hidden} more model(s) exist but no worker serves them now.` : "";
  if (usable.length === 0 && !modelsRetry) {
    modelsRetry = setTimeout(async () => {
      modelsRetry = null;
      try {
        models = await api("GET", "/v1/models");
      } catch (e) {
        $("form-error").textContent = sayRequest(e);
      }
      fillModels();
    }, 2000);
  }
  $("format").replaceChildren(...models.output_formats.map((f) => el("option", { value: f }, f.toUpperCase())));
  fillStems();
}

function fillStems() {
  const m = models?.models.find((x) => x.name === $("model").value);
  const opts = [el("option", { value: "" }, `All ${m ? m.stems.length : ""} stems`.replace("  ", " "))];
  for (const s of m?.stems ?? []) opts.push(el("option", { value: s }, `${s} + the rest`));
  $("two-stems").replaceChildren(...opts);
}

function chooseFile(file) {
  $("file-name").textContent = file ? `${file.name} (${(file.size / 1e6).toFixed(1)} MB)` : "";
}

async function submitJob(ev) {
  ev.preventDefault();
  $("form-error").textContent = "";
  const file = $("file").files[0];
  const url = $("url").value.trim();
  if (!file && !url) {
    $("form-error").textContent = "Choose or drop a song, or paste its URL.";
    return;
  }
  $("go").disabled = true;
  try {
    let audio_uri = url;
    if (file) {
      $("upload").hidden = false;
      const bar = $("upload-progress");
      const up = await upload(file, (f) => { bar.value = Math.round(f * 100); });
      audio_uri = up.audio_uri;
    }
    const body = { audio_uri, model: $("model").value, output_format: $("format").value };
    if ($("two-stems").value) body.two_stems = $("two-stems").value;
    const r = await api("POST", "/v1/separations", body);
    $("job-form").reset();
    chooseFile(null);
    fillStems();
    location.hash = `#/jobs/${r.job_id}`;
  } catch (e) {
    $("form-error").textContent = sayRequest(e);
    if (e.code === "model_not_served") { models = null; home(); }
  } finally {
    $("upload").hidden = true;
    $("go").disabled = !me?.can.write;
  }
}

// ---- recent jobs ---------------------------------------------------------------

function startRecent() {
  stopRecent();
  const tick = async () => {
    await recent();
    recentTimer = setTimeout(tick, 3000);
  };
  tick();
}

function stopRecent() {
  clearTimeout(recentTimer);
  recentTimer = null;
}

async function recent() {
  try {
    const r = await api("GET", "/v1/separations?limit=20");
    $("recent-error").textContent = "";
    const rows = r.jobs.map((v) => el("tr", { "data-job": v.job_id },
      el("td", {}, el("a", { href: `#/jobs/${v.job_id}` }, short(v.job_id))),
      el("td", {}, ago(v.created_at)),
      el("td", {}, v.request?.model ?? ""),
      el("td", {}, statusCell(v)),
      el("td", {}, actions(v, () => recent())),
    ));
    $("recent").tBodies[0].replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { colspan: "5" }, "No jobs yet."))]));
  } catch (e) {
    $("recent-error").textContent = sayRequest(e);
  }
}

function statusCell(v) {
  const words = sayStatus(v);
  if (v.status === "running" && v.progress) return `${words} ${Math.round(v.progress.percent)} %`;
  return words;
}

// Cancel and retry buttons for a job, as its status allows.
export function actions(v, after) {
  const out = [];
  if (!me?.can.write) return out;
  if (!TERMINAL.has(v.status)) {
    const b = el("button", { type: "button", class: "small", "aria-label": `Cancel job ${short(v.job_id)}` }, "Cancel");
    b.addEventListener("click", () => control(v.job_id, "cancel", after));
    out.push(b);
  } else if (v.status !== "succeeded" && v.status !== "rejected" && !v.retried_by) {
    const b = el("button", { type: "button", class: "small", "aria-label": `Retry job ${short(v.job_id)}` }, "Retry");
    b.addEventListener("click", () => control(v.job_id, "retry", after));
    out.push(b);
  }
  return out;
}

async function control(id, what, after) {
  try {
    const r = await api("POST", `/v1/separations/${id}/${what}`);
    if (what === "retry" && r?.job_id) location.hash = `#/jobs/${r.job_id}`;
    else after?.();
  } catch (e) {
    alertIn(e);
  }
}

function alertIn(e) {
  const target = !$("job").hidden ? "job-error" : !$("ops").hidden ? "ops-error" : "form-error";
  $(target).textContent = sayRequest(e);
}

// ---- one job -------------------------------------------------------------------

function leaveJob() {
  if (!job) return;
  job.abort.abort();
  job.mixer?.close();
  job = null;
}

async function openJob(id) {
  leaveJob();
  job = { id, abort: new AbortController() };
  const mine = job;
  show("job");
  $("job-id").textContent = short(id);
  $("job-id").title = id;
  for (const x of ["job-status", "job-error", "job-queue", "job-meta"]) $(x).textContent = "";
  $("players").replaceChildren();
  $("downloads").replaceChildren();
  $("job-zip").hidden = true;
  $("job-progress").value = 0;
  let view;
  try {
    view = await api("GET", `/v1/separations/${id}`);
  } catch (e) {
    $("job-error").textContent = sayRequest(e);
    return;
  }
  render(view);
  if (TERMINAL.has(view.status)) return finish(view, mine);
  // Resume where this tab was (a reload): only newer revisions come.
  const key = `stemq.last-event.${id}`;
  try {
    await follow(id, sessionStorage.getItem(key), ({ id: last, view: v }) => {
      if (job !== mine) return;
      if (last) sessionStorage.setItem(key, last);
      view = v;
      render(v);
    }, mine.abort.signal);
  } catch (e) {
    if (job === mine) $("job-error").textContent = sayRequest(e);
    return;
  }
  if (job === mine && TERMINAL.has(view.status)) finish(view, mine);
}

function render(v) {
  const r = v.request ?? {};
  $("job-meta").textContent = [r.model && `model ${r.model}`, v.created_at && `created ${ago(v.created_at)}`,
    v.worker && `on ${v.worker}`, v.degraded && "computed on a fallback"].filter(Boolean).join(" · ");
  let words = sayStatus(v);
  if (v.status === "running" && v.progress) words += `: ${v.progress.stage} ${Math.round(v.progress.percent)} %`;
  if (v.cancel_requested_at && !TERMINAL.has(v.status)) words += " (cancelling)";
  $("job-status").textContent = words;
  $("job-status").dataset.status = v.status;
  const pct = v.status === "succeeded" ? 100 : v.progress?.percent ?? 0;
  $("job-progress").value = pct;
  const q = [];
  // queue_position is 0-based (0: next); eta is when the job should finish, eta_seconds
  // how far that is from the answer.
  if (v.queue_position !== undefined && v.status === "queued") {
    const n = v.queue_position;
    q.push(n === 0 ? "next in the queue" : `${n} job${n === 1 ? "" : "s"} ahead in the queue`);
  }
  if (v.eta && v.eta_seconds !== undefined) {
    const s = v.eta_seconds;
    q.push(`done ${s < 60 ? `in about ${Math.max(1, s)} s` : s < 3600 ? `in about ${Math.round(s / 60)} min`
      : `around ${new Date(v.eta).toLocaleTimeString()}`}`);
  }
  $("job-queue").textContent = q.join(" · ");
  $("job-error").textContent = v.error && v.status !== "succeeded" ? sayJob(v.error) : "";
  $("job-cancel").hidden = TERMINAL.has(v.status) || !me.can.write;
  $("job-retry").hidden = !(TERMINAL.has(v.status) && !["succeeded", "rejected"].includes(v.status)) || !me.can.write;
  if (v.retried_by) {
    $("job-retry").hidden = true;
    $("job-queue").replaceChildren("Retried as ", el("a", { href: `#/jobs/${v.retried_by}` }, short(v.retried_by)));
  }
}

async function finish(view, mine) {
  render(view);
  if (view.status !== "succeeded") return;
  $("job-status").textContent = "Done: loading the stems…";
  const stems = [];
  try {
    for (const o of view.outputs) {
      const ext = (o.uri.match(/\.([a-z0-9]+)$/i) || [, "wav"])[1];
      const data = await bytes(`/v1/separations/${view.job_id}/stems/${encodeURIComponent(o.stem)}`);
      stems.push({ name: o.stem, bytes: data, file: `${o.stem}.${ext}`, type: { flac: "audio/flac", mp3: "audio/mpeg" }[ext] || "audio/wav" });
    }
  } catch (e) {
    if (job === mine) $("job-error").textContent = sayRequest(e);
    return;
  }
  if (job !== mine) return;
  mine.stems = stems;
  $("job-status").textContent = sayStatus(view);
  mine.mixer = new Mixer($("players"), stems, (msg) => { $("job-error").textContent = msg; });
  await mine.mixer.ready;
  $("downloads").replaceChildren(...stems.map((s) => {
    const b = el("button", { type: "button", class: "link", "data-stem": s.name }, `Download ${s.file}`);
    b.addEventListener("click", () => download(new Blob([s.bytes], { type: s.type }), s.file));
    return el("li", {}, b);
  }));
  $("job-zip").hidden = false;
}

// ---- wiring --------------------------------------------------------------------

function wire() {
  $("signin-form").addEventListener("submit", signIn);
  $("signout").addEventListener("click", signOut);
  $("job-form").addEventListener("submit", submitJob);
  $("model").addEventListener("change", fillStems);
  $("file").addEventListener("change", () => chooseFile($("file").files[0]));
  const drop = $("drop");
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    if (e.dataTransfer.files.length) {
      $("file").files = e.dataTransfer.files;
      chooseFile(e.dataTransfer.files[0]);
    }
  });
  $("job-cancel").addEventListener("click", () => job && control(job.id, "cancel"));
  $("job-retry").addEventListener("click", () => job && control(job.id, "retry"));
  $("job-zip").addEventListener("click", () => {
    if (!job?.stems) return;
    try {
      const blob = zip(job.stems.map((s) => ({ name: s.file, data: new Uint8Array(s.bytes) })));
      download(blob, `stems-${job.id.slice(0, 12)}.zip`);
    } catch (e) {
      $("job-error").textContent = String(e.message || e);
    }
  });
  window.addEventListener("hashchange", route);
  ops.onReplay = (id) => { location.hash = `#/jobs/${id}`; };
}

start();
