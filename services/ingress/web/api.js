// The API, as the page uses it: the key in session storage, sent as a bearer header;
// JSON errors turned into ApiError; uploads with progress; Server-Sent Events read
// over fetch (EventSource cannot send a header), resumable with Last-Event-ID.

const KEY = "stemq.key";

export const session = {
  get key() { return sessionStorage.getItem(KEY); },
  set key(k) { if (k) sessionStorage.setItem(KEY, k); else sessionStorage.removeItem(KEY); },
};

export class ApiError extends Error {
  constructor(status, code, message, field, retryAfter) {
    super(message || code || `HTTP ${status}`);
    this.status = status;
    this.code = code || "";
    this.field = field || "";
    this.retryAfter = retryAfter;
  }
}

function headers(extra = {}) {
  const h = { ...extra };
  if (session.key) h.Authorization = `Bearer ${session.key}`;
  return h;
}

async function failure(resp) {
  let code = "", message = "", field = "";
  try {
    const body = await resp.json();
    code = body.error?.code ?? "";
    message = body.error?.message ?? "";
    field = body.error?.field ?? "";
  } catch { /* not JSON: keep the status */ }
  const ra = resp.headers.get("retry-after");
  return new ApiError(resp.status, code, message, field, ra ? Number(ra) : undefined);
}

// Calls the API; the parsed JSON answer, or throws ApiError. `offline` errors (no
// answer at all) become status 0.
export async function api(method, path, body) {
  let resp;
  try {
    resp = await fetch(path, {
      method,
      headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }),
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
    });
  } catch (e) {
    throw new ApiError(0, "offline", String(e));
  }
  if (!resp.ok) throw await failure(resp);
  const text = await resp.text();
  return text ? JSON.parse(text) : null;
}

// The bytes of an authenticated GET (stems), as an ArrayBuffer.
export async function bytes(path) {
  let resp;
  try {
    resp = await fetch(path, { headers: headers(), cache: "no-store" });
  } catch (e) {
    throw new ApiError(0, "offline", String(e));
  }
  if (!resp.ok) throw await failure(resp);
  return resp.arrayBuffer();
}

// Uploads a file with progress (fetch cannot report upload progress; XHR can).
export function upload(file, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", `/v1/uploads?filename=${encodeURIComponent(file.name || "song.wav")}`);
    for (const [k, v] of Object.entries(headers())) xhr.setRequestHeader(k, v);
    if (file.type) xhr.setRequestHeader("Content-Type", file.type);
    xhr.upload.onprogress = (e) => { if (e.lengthComputable) onProgress(e.loaded / e.total); };
    xhr.onerror = () => reject(new ApiError(0, "offline", "the upload did not reach the server"));
    xhr.onload = () => {
      let body = {};
      try { body = JSON.parse(xhr.responseText || "{}"); } catch { /* keep {} */ }
      if (xhr.status >= 200 && xhr.status < 300) { onProgress(1); resolve(body); return; }
      const ra = xhr.getResponseHeader("retry-after");
      reject(new ApiError(xhr.status, body.error?.code, body.error?.message, body.error?.field, ra ? Number(ra) : undefined));
    };
    xhr.send(file);
  });
}

// Follows a job's events until a terminal status, `signal` aborts, or the server ends
// the stream; calls `onEvent({id, event, view})` for each. Reconnects after a dropped
// connection with the last id seen. Returns the last id.
export async function follow(jobId, lastId, onEvent, signal) {
  let last = lastId || "";
  for (let attempt = 0; !signal.aborted; attempt++) {
    let resp;
    try {
      const h = headers({ Accept: "text/event-stream" });
      if (last) h["Last-Event-ID"] = last;
      resp = await fetch(`/v1/separations/${jobId}/events`, { headers: h, signal, cache: "no-store" });
    } catch (e) {
      if (signal.aborted) return last;
      await sleep(Math.min(500 * 2 ** attempt, 5000), signal);
      continue;
    }
    if (!resp.ok) throw await failure(resp);
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "", ended = false;
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value.replace(/\r\n?/g, "\n");
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          const msg = { id: "", event: "message", data: "" };
          for (const line of block.split("\n")) {
            if (!line || line.startsWith(":")) continue;
            const i = line.indexOf(":");
            const field = i < 0 ? line : line.slice(0, i);
            const val = i < 0 ? "" : line.slice(i + 1).replace(/^ /, "");
            if (field === "data") msg.data += (msg.data ? "\n" : "") + val;
            else if (field === "id") msg.id = val;
            else if (field === "event") msg.event = val;
          }
          if (!msg.data) continue;
          if (msg.id) last = msg.id;
          const view = JSON.parse(msg.data);
          onEvent({ id: last, event: msg.event, view });
          if (TERMINAL.has(view.status)) ended = true;
        }
      }
    } catch (e) {
      if (signal.aborted) return last;
    }
    if (ended) return last;
    // The stream ended without a terminal status: the job may have ended while we were
    // away (nothing newer to send), or the server restarted. Look, then resume.
    try {
      const view = await api("GET", `/v1/separations/${jobId}`);
      if (TERMINAL.has(view.status)) { onEvent({ id: last, event: "status", view }); return last; }
    } catch (e) {
      if (e.status === 404 || e.status === 401 || e.status === 403) throw e;
    }
    attempt = 0;
    await sleep(500, signal);
  }
  return last;
}

export const TERMINAL = new Set(["succeeded", "failed", "dead_lettered", "rejected", "cancelled", "expired"]);

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => { clearTimeout(t); resolve(); }, { once: true });
  });
}
