// stemq's page, tested as a person uses it, in headless Chromium against a live
// `stemq dev`: sign in (a wrong key, then the one-time link), upload the demo song, see
// the progress move, see and play the stem players, download a stem and all stems,
// reload in the middle of a job, look at the operators' view, a bad file's error in
// words; axe-core finds no serious accessibility violation; nothing is requested from
// another origin; nothing is logged as an error.
//
// node page.test.mjs BASE_URL SIGNIN_LINK DATA_DIR SONG LONG_SONG BAD_FILE
// Screenshots go to $STEMQ_ARTIFACTS (default tests/web/artifacts/).

import { chromium } from "playwright-core";
import fs from "node:fs";
import path from "node:path";
import crypto from "node:crypto";
import { execFileSync } from "node:child_process";
import { createRequire } from "node:module";

const [base, link, dataDir, song, longSong, badFile] = process.argv.slice(2);
if (!badFile) {
  console.error("usage: node page.test.mjs BASE_URL SIGNIN_LINK DATA_DIR SONG LONG_SONG BAD_FILE");
  process.exit(2);
}
const require = createRequire(import.meta.url);
const AXE = fs.readFileSync(require.resolve("axe-core/axe.min.js"), "utf8");
const here = path.dirname(new URL(import.meta.url).pathname);
const artifacts = process.env.STEMQ_ARTIFACTS || path.join(here, "artifacts");
fs.mkdirSync(artifacts, { recursive: true });
const origin = new URL(base).origin;

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
    "--no-first-run", "--disable-component-update", "--disable-sync", "--autoplay-policy=no-user-gesture-required"],
});

const problems = [];
let step = "start";
function check(ok, what) {
  if (!ok) throw new Error(`${step}: ${what}`);
}

// A fresh browser context (own session storage) that records console errors and any
// request to another origin.
async function newPage(opts = {}) {
  const ctx = await browser.newContext({ acceptDownloads: true, ...opts });
  const page = await ctx.newPage();
  page.on("console", (m) => {
    if (m.type() !== "error") return;
    // A refused key or a used link is a 401 on purpose; Chromium logs every 4xx.
    if (/status of 401/.test(m.text()) && ["wrong key", "sign-in link"].includes(step)) return;
    problems.push(`console (${step}): ${m.text()}`);
  });
  page.on("pageerror", (e) => problems.push(`page error (${step}): ${e.message}`));
  page.on("request", (r) => {
    const u = new URL(r.url());
    if (!["blob:", "data:"].includes(u.protocol) && u.origin !== origin) problems.push(`third-party request: ${r.url()}`);
  });
  return { ctx, page };
}

async function shot(page, name) {
  await page.screenshot({ path: path.join(artifacts, `${name}.png`), fullPage: true });
}

// axe-core, injected by evaluate (the page's CSP blocks an added script tag).
async function axe(page, name) {
  await page.evaluate(AXE);
  const r = await page.evaluate(() => axe.run(document, { runOnly: ["wcag2a", "wcag2aa", "best-practice"] }));
  const bad = r.violations.filter((v) => v.impact === "serious" || v.impact === "critical");
  for (const v of bad) problems.push(`axe (${name}): ${v.id} (${v.impact}): ${v.help} — ${v.nodes.map((n) => n.target.join(" ")).slice(0, 3).join("; ")}`);
  console.log(`axe ${name}: ${r.violations.length} violation(s), ${bad.length} serious or critical`);
}

const sha256 = (buf) => crypto.createHash("sha256").update(buf).digest("hex");

try {
  // ---- the page itself ----------------------------------------------------------
  step = "headers";
  const resp = await fetch(`${base}/`);
  const csp = resp.headers.get("content-security-policy") || "";
  check(resp.ok && csp.includes("default-src 'none'") && csp.includes("script-src 'self'"), `strict CSP expected, got "${csp}"`);
  check(resp.headers.get("x-content-type-options") === "nosniff", "nosniff");

  // ---- a wrong key --------------------------------------------------------------
  step = "wrong key";
  {
    const { ctx, page } = await newPage();
    await page.goto(`${base}/`);
    await page.waitForSelector("#signin:not([hidden])");
    await axe(page, "sign-in");
    await page.fill("#key", "sk_0000000000000000_wrongwrongwrong");
    await page.click("#signin-go");
    await page.waitForFunction(() => document.getElementById("signin-error").textContent.length > 0);
    const msg = await page.textContent("#signin-error");
    check(/not accepted/.test(msg), `sign-in error in words, got "${msg}"`);
    check(await page.isVisible("#signin"), "still on the sign-in form");
    await shot(page, "01-wrong-key");
    await ctx.close();
  }

  // ---- the one-time link --------------------------------------------------------
  step = "sign-in link";
  const { ctx, page } = await newPage({ viewport: { width: 1100, height: 900 } });
  await page.goto(link);
  await page.waitForSelector("#home:not([hidden])");
  check(!page.url().includes("signin="), `the token must leave the address bar, got ${page.url()}`);
  const who = await page.textContent("#who");
  check(/local · operator/.test(who), `signed in as the operator of local, got "${who}"`);
  const key = await page.evaluate(() => sessionStorage.getItem("stemq.key"));
  check(key && key.startsWith("sk_"), "the key is in session storage");
  // A session key of its own, never the long-lived operator key on the server's disk.
  const operatorKey = fs.readFileSync(path.join(dataDir, "operator.key"), "utf8").trim();
  check(key !== operatorKey, "the link handed out the operator key itself instead of a session key");
  {
    // A link works once.
    const again = await newPage();
    await again.page.goto(link);
    await again.page.waitForSelector("#signin:not([hidden])");
    await again.page.waitForFunction(() => document.getElementById("signin-error").textContent.length > 0);
    check(/did not work/.test(await again.page.textContent("#signin-error")), "a used link says so");
    await again.ctx.close();
  }
  const api = async (p) => (await fetch(`${base}${p}`, { headers: { Authorization: `Bearer ${key}` } })).json();

  // ---- upload the demo song and follow it ---------------------------------------
  step = "upload";
  await page.waitForSelector("#model option", { state: "attached" });
  const models = await page.$$eval("#model option", (os) => os.map((o) => o.value));
  check(models.includes("dsp") && !models.includes("htdemucs_6s"), `only served models are offered, got ${models}`);
  await page.selectOption("#model", "dsp");
  await axe(page, "home");
  await shot(page, "02-home");
  await page.setInputFiles("#file", song);
  // Record every status and progress value the page shows.
  await page.evaluate(() => {
    window.__seen = [];
    const note = () => window.__seen.push([document.getElementById("job-status").dataset.status || "",
      Number(document.getElementById("job-progress").value)]);
    new MutationObserver(note).observe(document.getElementById("job"), { subtree: true, childList: true, attributes: true, characterData: true });
  });
  await page.click("#go");
  await page.waitForURL(/#\/jobs\/[0-9a-f]{64}$/);
  const jobId = page.url().split("/").pop();
  step = "progress";
  await page.waitForSelector("#players .stem", { timeout: 120_000 });
  const seen = await page.evaluate(() => window.__seen);
  const values = [...new Set(seen.map((s) => s[1]))];
  const statuses = [...new Set(seen.map((s) => s[0]).filter(Boolean))];
  console.log(`statuses seen: ${statuses.join(" → ")}; progress values seen: ${values.slice(0, 12).join(", ")}${values.length > 12 ? ", …" : ""}`);
  check(statuses.includes("succeeded"), "the job ends succeeded");
  check(values.some((v) => v > 0 && v < 100), "the progress bar moved through intermediate values");

  // ---- the players --------------------------------------------------------------
  step = "players";
  const stems = await page.$$eval("#players .stem", (ss) => ss.map((s) => s.dataset.stem));
  check(stems.length === 4, `four players, got ${stems}`);
  await axe(page, "job");
  await page.click('.stem[data-stem="vocals"] button.play');
  await page.waitForFunction(() => document.getElementById("players").dataset.playing === "true");
  await page.waitForFunction(() => Number(document.getElementById("players").dataset.position) > 0.3, null, { timeout: 10_000 });
  await page.click('.stem[data-stem="drums"] button.mute');
  await page.click('.stem[data-stem="vocals"] button.solo');
  check(await page.$eval('.stem[data-stem="bass"]', (e) => e.classList.contains("silent")), "solo silences the others");
  await shot(page, "03-players");
  await page.click("#players button.play-all");
  await page.waitForFunction(() => document.getElementById("players").dataset.playing === "false");

  // ---- downloads ----------------------------------------------------------------
  step = "download";
  const view = await api(`/v1/separations/${jobId}`);
  const vocals = view.outputs.find((o) => o.stem === "vocals");
  const [dl] = await Promise.all([page.waitForEvent("download"), page.click('#downloads button[data-stem="vocals"]')]);
  const got = fs.readFileSync(await dl.path());
  const stored = fs.readFileSync(new URL(vocals.uri));
  check(got.equals(stored), `the downloaded stem equals the stored one (${got.length} vs ${stored.length} bytes)`);
  check(sha256(got) === vocals.sha256, "the download's sha256 is the view's");
  const [zdl] = await Promise.all([page.waitForEvent("download"), page.click("#job-zip")]);
  const zipPath = path.join(artifacts, "stems.zip");
  await zdl.saveAs(zipPath);
  const listing = execFileSync("python3", ["-c",
    "import sys,zipfile; z=zipfile.ZipFile(sys.argv[1]); assert z.testzip() is None; print(' '.join(sorted(z.namelist())))", zipPath]).toString().trim();
  check(listing === "bass.wav drums.wav other.wav vocals.wav", `the zip holds the four stems, got "${listing}"`);

  // ---- a reload in the middle of a job resumes its events -----------------------
  step = "reload";
  await page.goto(`${base}/#/`);
  await page.waitForSelector("#home:not([hidden])");
  await page.selectOption("#model", "dsp");
  await page.setInputFiles("#file", longSong);
  const eventRequests = [];
  page.on("request", (r) => { if (r.url().endsWith("/events")) eventRequests.push(r.headers()["last-event-id"] || ""); });
  await page.click("#go");
  await page.waitForURL(/#\/jobs\/[0-9a-f]{64}$/);
  const longId = page.url().split("/").pop();
  // Reload once the page has had an event of the running job.
  await page.waitForFunction((id) => sessionStorage.getItem(`stemq.last-event.${id}`)
    && document.getElementById("job-status").dataset.status === "running", longId);
  await page.reload();
  await page.waitForSelector("#players .stem", { timeout: 180_000 });
  check(page.url().endsWith(longId), "still on the same job after the reload");
  console.log(`event requests (Last-Event-ID): ${JSON.stringify(eventRequests)}`);
  check(eventRequests.length >= 2 && eventRequests.slice(1).some((h) => h !== ""), "the reloaded page resumed with Last-Event-ID");

  // ---- recent jobs, operators' view ---------------------------------------------
  step = "recent";
  await page.goto(`${base}/#/`);
  await page.waitForSelector(`#recent tr[data-job="${jobId}"]`);
  step = "ops";
  await page.goto(`${base}/#/ops`);
  await page.waitForSelector(`#latest tr[data-job="${longId}"]`);
  await page.waitForSelector("#workers tbody tr td");
  check((await page.textContent("#workers")).includes("dsp"), "the worker and what it serves");
  // Both jobs ended within the chart's minutes.
  await page.waitForFunction(() => /^([2-9]|\d\d+) jobs ended/.test(document.querySelector("#throughput svg")?.getAttribute("aria-label") || ""));
  await axe(page, "ops");
  await shot(page, "04-ops");

  // ---- a bad file, in words -----------------------------------------------------
  step = "bad file";
  await page.goto(`${base}/#/`);
  await page.waitForSelector("#home:not([hidden])");
  await page.selectOption("#model", "dsp");
  await page.setInputFiles("#file", badFile);
  await page.click("#go");
  await page.waitForURL(/#\/jobs\/[0-9a-f]{64}$/);
  await page.waitForFunction(() => document.getElementById("job-error").textContent.length > 0, null, { timeout: 60_000 });
  const words = await page.textContent("#job-error");
  check(/not audio stemq can read|damaged|not supported|no sound/.test(words), `a bad file is explained, got "${words}"`);
  check(await page.isVisible("#job-retry"), "a failed job offers retry");
  await shot(page, "05-bad-file");

  // ---- what the page says for refusals it cannot easily provoke here ------------
  step = "words";
  const said = await page.evaluate(async () => {
    const w = await import("/app/words.js");
    return {
      limited: w.sayRequest({ status: 429, code: "rate_limited", retryAfter: 7 }),
      large: w.sayRequest({ status: 413, code: "too_large" }),
      credits: w.sayRequest({ status: 402, code: "insufficient_credits" }),
      long: w.sayJob({ code: "too_long", message: "longer than 3600 s" }),
      unknown: w.sayJob({ code: "something_new", message: "the engine said so" }),
    };
  });
  check(/Too many requests.*Try again in 7 s/.test(said.limited), `rate limited: "${said.limited}"`);
  check(/too large/.test(said.large) && /credits/.test(said.credits) && /too long/.test(said.long), JSON.stringify(said));
  check(said.unknown === "the engine said so", `an unknown code keeps the server's words: ${said.unknown}`);

  // ---- phone width --------------------------------------------------------------
  step = "phone";
  await page.setViewportSize({ width: 375, height: 740 });
  await page.goto(`${base}/#/jobs/${jobId}`);
  await page.waitForSelector("#players .stem");
  const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  check(overflow <= 1, `no sideways scrolling at phone width (${overflow}px too wide)`);
  await shot(page, "06-phone");
  await ctx.close();
} catch (e) {
  problems.unshift(String(e.stack || e));
} finally {
  await browser.close();
}

// A stem URL 404 on `favicon` or similar would show up here too.
if (problems.length) {
  console.error(`page test FAILED:\n- ${problems.join("\n- ")}`);
  process.exit(1);
}
console.log(`page test passed; screenshots in ${artifacts}`);
