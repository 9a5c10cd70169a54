// The operators' view: queues per pool and lane, the oldest job, workers and their
// heartbeats, running jobs with progress, recent failures and dead letters (with a
// replay button), and jobs ended per minute. Refreshed every 2 s while it is open.

import { api } from "./api.js";
import { sayRequest, sayJob, sayStatus } from "./words.js";
import { el, ago, short } from "./dom.js";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";

export class Ops {
  constructor() {
    this.timer = null;
    this.onReplay = null;
  }

  start() {
    this.stop();
    const tick = async () => {
      await this.refresh();
      if (this.timer !== null) this.timer = setTimeout(tick, 2000);
    };
    this.timer = 0;
    tick();
  }

  stop() {
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
  }

  async refresh() {
    try {
      const list = (q) => api("GET", `/v1/separations?${q}`).then((r) => r.jobs);
      const [overview, fleet, running, failed, dead, latest] = await Promise.all([
        api("GET", "/v1/overview"), api("GET", "/v1/workers"),
        list("status=running&limit=20"), list("status=failed&limit=10"),
        list("status=dead_lettered&limit=10"), list("limit=10"),
      ]);
      $("ops-error").textContent = "";
      this.summary(overview, fleet);
      this.chart(overview.throughput);
      this.pools(fleet);
      this.workers(fleet.workers);
      body("running", running.map((v) => el("tr", { "data-job": v.job_id },
        el("td", {}, link(v)), el("td", {}, v.request?.owner ?? ""), el("td", {}, v.request?.model ?? ""),
        el("td", {}, v.progress ? [el("progress", { max: "100", value: String(v.progress.percent), "aria-label": `Progress of ${short(v.job_id)}` }),
          ` ${v.progress.stage} ${Math.round(v.progress.percent)} %`] : "starting"),
        el("td", {}, v.worker ?? ""))), 5, "Nothing is running.");
      const failures = [...dead, ...failed].sort((a, b) => Date.parse(b.finished_at || b.updated_at) - Date.parse(a.finished_at || a.updated_at));
      body("failures", failures.map((v) => el("tr", { "data-job": v.job_id },
        el("td", {}, link(v)), el("td", {}, v.request?.owner ?? ""), el("td", {}, sayStatus(v)),
        el("td", {}, v.error ? `${v.error.code}: ${sayJob(v.error)}` : ""), el("td", {}, ago(v.finished_at || v.updated_at)),
        el("td", {}, this.replay(v)))), 6, "No failures.");
      body("latest", latest.map((v) => el("tr", { "data-job": v.job_id },
        el("td", {}, link(v)), el("td", {}, v.request?.owner ?? ""), el("td", {}, v.request?.model ?? ""),
        el("td", {}, sayStatus(v)), el("td", {}, ago(v.created_at)))), 5, "No jobs yet.");
    } catch (e) {
      $("ops-error").textContent = sayRequest(e);
    }
  }

  summary(o, fleet) {
    const c = o.counts;
    const parts = [`${c.queued ?? 0} queued`, `${c.running ?? 0} running`, `${c.succeeded ?? 0} succeeded`,
      `${(c.failed ?? 0) + (c.dead_lettered ?? 0)} failed`, `${fleet.workers.length} worker(s)`];
    if (o.oldest_pending_seconds > 0) parts.push(`oldest unfinished request ${Math.round(o.oldest_pending_seconds)} s old`);
    if (o.projector_lag) parts.push(`status view ${o.projector_lag} event(s) behind`);
    $("ops-summary").textContent = parts.join(" · ");
  }

  chart(minutes) {
    const w = 300, h = 80, n = minutes.length, bw = w / n;
    const max = Math.max(1, ...minutes.map((m) => m.succeeded + m.other));
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("role", "img");
    const total = minutes.reduce((s, m) => s + m.succeeded + m.other, 0);
    svg.setAttribute("aria-label", `${total} jobs ended in the last ${n} minutes; at most ${max} in one minute`);
    minutes.forEach((m, i) => {
      const bar = (value, y0, cls) => {
        const r = document.createElementNS(SVG, "rect");
        const bh = (value / max) * h;
        r.setAttribute("x", String(i * bw + 1));
        r.setAttribute("y", String(y0 - bh));
        r.setAttribute("width", String(Math.max(1, bw - 2)));
        r.setAttribute("height", String(bh));
        r.setAttribute("class", cls);
        const t = document.createElementNS(SVG, "title");
        t.textContent = `${new Date(m.minute * 1000).toLocaleTimeString()}: ${m.succeeded} succeeded, ${m.other} other`;
        r.append(t);
        svg.append(r);
        return y0 - bh;
      };
      const top = bar(m.succeeded, h, "ok");
      bar(m.other, top, "bad");
    });
    const first = new Date(minutes[0].minute * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
    const caption = el("p", { class: "hint" }, `${total} ended since ${first}; the tallest bar is ${max} a minute; green succeeded, red did not.`);
    $("throughput").replaceChildren(svg, caption);
  }

  pools(fleet) {
    const rows = [];
    for (const p of fleet.pools) {
      const busy = p.lanes.some((l) => (l.pending ?? 0) + (l.running ?? 0) > 0);
      if (!busy && p.workers === 0) continue;
      for (const l of p.lanes) {
        rows.push(el("tr", { class: p.waiting ? "warn" : "" },
          el("td", {}, p.model), el("td", {}, l.lane), el("td", {}, l.pending ?? "?"), el("td", {}, l.running ?? "?"),
          el("td", {}, p.waiting ? `${p.workers}: ${p.waiting}` : String(p.workers))));
      }
    }
    body("pools", rows, 5, "No pool has workers or jobs.");
  }

  workers(list) {
    body("workers", list.map((w) => el("tr", {},
      el("td", {}, w.name), el("td", {}, (w.models || []).join(", ")), el("td", {}, w.engine ?? ""),
      el("td", {}, `${w.running ?? 0} / ${w.concurrency ?? "?"}`), el("td", {}, ago(w.heartbeat_at || w.updated_at)))),
      5, "No live worker.");
  }

  replay(v) {
    if (v.retried_by) return el("a", { href: `#/jobs/${v.retried_by}` }, "replayed");
    const b = el("button", { type: "button", class: "small", "aria-label": `Replay job ${short(v.job_id)}` }, "Replay");
    b.addEventListener("click", async () => {
      b.disabled = true;
      try {
        const r = await api("POST", `/v1/separations/${v.job_id}/retry`);
        this.onReplay?.(r.job_id);
      } catch (e) {
        $("ops-error").textContent = sayRequest(e);
        b.disabled = false;
      }
    });
    return b;
  }
}

function link(v) {
  return el("a", { href: `#/jobs/${v.job_id}` }, short(v.job_id));
}

function body(id, rows, cols, empty) {
  $(id).tBodies[0].replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { colspan: String(cols) }, empty))]));
}
