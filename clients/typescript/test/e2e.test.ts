// End-to-end tests against a live `stemq dev` (run by ../run-e2e.sh, which starts it and
// sets the environment below); skipped when STEMQ_HTTP is not set.
//
//   STEMQ_HTTP                 the ingress base URL
//   NATS_URL                   the NATS server
//   STEMQ_API_KEY              an admin API key of STEMQ_OWNER
//   STEMQ_OWNER                that key's owner (`local` in stemq dev)
//   STEMQ_PUBLISHER_CREDS      credentials of `publisher-<owner token>`
//   STEMQ_OTHER_PUBLISHER_CREDS credentials of another owner's publisher
//   STEMQ_READER_CREDS         credentials of `reader-<owner token>` (per-owner views only)
//   STEMQ_STATUS_READER_CREDS  credentials of `status-reader`
//   STEMQ_VIEWS                `per-owner` (views keyed `<owner token>.<job id>`, read as the
//                              owner's publisher and reader) or `job-id` (the older layout,
//                              read as status-reader)
//   STEMQ_AUDIO                a short song (WAV) to upload
import assert from "node:assert/strict";
import { readFile } from "node:fs/promises";
import { createServer } from "node:http";
import type { IncomingHttpHeaders, Server } from "node:http";
import type { AddressInfo } from "node:net";
import { after, before, describe, test } from "node:test";

import {
  HttpClient,
  StemqError,
  connectAs,
  getView,
  jobIdOf,
  normalize,
  ownerToken,
  publishRequest,
  submitNats,
  verifyWebhook,
  viewKey,
  wait,
  watch,
} from "../src/index.js";
import type { JobRequest, JobView, NatsConnection, ViewOptions } from "../src/index.js";

const env = process.env;
const live = Boolean(env.STEMQ_HTTP);

function need(name: string): string {
  const v = env[name];
  if (!v) throw new Error(`${name} is not set`);
  return v;
}

interface Hook {
  headers: IncomingHttpHeaders;
  body: Buffer;
}

describe("against a live stemq", { skip: live ? false : "STEMQ_HTTP is not set (run ./run-e2e.sh)" }, () => {
  const owner = env.STEMQ_OWNER ?? "local";
  const perOwner = env.STEMQ_VIEWS === "per-owner";
  let http: HttpClient;
  let publisher: NatsConnection;
  let other: NatsConnection;
  let viewer: NatsConnection; // who reads the views: the owner's reader, or status-reader
  let viewOpts: ViewOptions;
  let server: Server;
  let hookUrl: string;
  const hooks: Hook[] = [];
  let uploadUri: string;
  let storeUri: string;
  const jobs: Record<string, string> = {};

  before(async () => {
    http = new HttpClient({ baseUrl: need("STEMQ_HTTP"), apiKey: need("STEMQ_API_KEY") });
    const servers = need("NATS_URL");
    publisher = await connectAs({ servers, credentials: need("STEMQ_PUBLISHER_CREDS") });
    other = await connectAs({ servers, credentials: need("STEMQ_OTHER_PUBLISHER_CREDS") });
    viewer = await connectAs({
      servers,
      credentials: perOwner ? need("STEMQ_READER_CREDS") : need("STEMQ_STATUS_READER_CREDS"),
    });
    viewOpts = perOwner ? { owner } : {};
    server = createServer((req, res) => {
      const chunks: Buffer[] = [];
      req.on("data", (c: Buffer) => chunks.push(c));
      req.on("end", () => {
        hooks.push({ headers: req.headers, body: Buffer.concat(chunks) });
        res.writeHead(204).end();
      });
    });
    await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
    hookUrl = `http://127.0.0.1:${(server.address() as AddressInfo).port}/stemq`;
    const song = await readFile(need("STEMQ_AUDIO"));
    uploadUri = (await http.upload(song, "song.wav")).audio_uri;
    assert.match(uploadUri, /^upload:[0-9a-f]{64}\.wav$/);
  });

  after(async () => {
    await Promise.all([publisher, other, viewer].map((nc) => nc?.close()));
    server?.close();
  });

  test("submit over HTTP: 202 new, 200 the second time, then watched to succeeded", { timeout: 60_000 }, async () => {
    const request: JobRequest = { audio_uri: uploadUri, model: "dsp", metadata: { from: "typescript-http" } };
    const first = await http.submit(request);
    assert.equal(first.http_status, 202);
    assert.equal(first.cached, false);
    assert.match(first.job_id, /^[0-9a-f]{64}$/);
    assert.ok(first.urls?.get.endsWith(first.job_id));
    jobs.http = first.job_id;
    const again = await http.submit(request);
    assert.equal(again.http_status, 200);
    assert.equal(again.cached, true);
    assert.equal(again.job_id, first.job_id);

    const seen: string[] = [];
    const view = await wait(viewer, first.job_id, { ...viewOpts, timeoutMs: 45_000, onView: (v) => seen.push(v.status) });
    console.log(`http job ${first.job_id}: ${seen.join(" -> ")}`);
    assert.equal(view.status, "succeeded");
    assert.equal(view.job_id, first.job_id);
    assert.ok((view.outputs ?? []).length > 0);
    // The store URI the upload name resolved to: what a raw request must name.
    storeUri = view.request!.audio_uri;
    assert.ok(!storeUri.startsWith("upload:"), storeUri);
    const job = await http.get(first.job_id);
    assert.equal(job.status, "succeeded");
    assert.ok(Object.keys(job.urls.stems ?? {}).length > 0);
  });

  test("submit over NATS request-reply (stemq.api.submit) as the publisher, watched to succeeded", { timeout: 60_000 }, async () => {
    const request: JobRequest = { audio_uri: uploadUri, model: "dsp", overlap: 0.5 };
    const first = await submitNats(publisher, need("STEMQ_API_KEY"), request);
    assert.equal(first.http_status, 202);
    assert.equal(first.cached, false);
    jobs.nats = first.job_id;
    const again = await submitNats(publisher, need("STEMQ_API_KEY"), request);
    assert.equal(again.http_status, 200);
    assert.equal(again.cached, true);
    assert.equal(again.job_id, first.job_id);
    const view = await wait(viewer, first.job_id, { ...viewOpts, timeoutMs: 45_000 });
    assert.equal(view.status, "succeeded");
  });

  test("an invalid request is refused with its code over HTTP and over NATS", async () => {
    const bad = { audio_uri: uploadUri, model: "dsp", shifts: 99 } as JobRequest;
    await assert.rejects(http.submit(bad), (e: unknown) => {
      assert.ok(e instanceof StemqError, String(e));
      assert.equal(e.status, 422);
      assert.equal(e.code, "invalid_request");
      assert.equal(e.field, "shifts");
      return true;
    });
    await assert.rejects(http.submit({ audio_uri: uploadUri, model: "no-such-model" } as unknown as JobRequest), (e: unknown) =>
      e instanceof StemqError && e.status === 422 && e.field === "model",
    );
    await assert.rejects(submitNats(publisher, need("STEMQ_API_KEY"), bad), (e: unknown) => {
      assert.ok(e instanceof StemqError, String(e));
      assert.equal(e.status, 422);
      assert.equal(e.code, "invalid_request");
      assert.equal(e.field, "shifts");
      return true;
    });
    await assert.rejects(
      submitNats(publisher, "sk_not_a_key", { audio_uri: uploadUri }),
      (e: unknown) => e instanceof StemqError && e.status === 401 && e.code === "unauthorized",
    );
  });

  test("publish straight to the log: watched to succeeded, webhook verified, tampered body refused", { timeout: 60_000 }, async () => {
    const request: JobRequest = {
      audio_uri: storeUri,
      model: "dsp",
      overlap: 0.1,
      webhook: { url: hookUrl, events: ["completed"] },
      metadata: { from: "typescript-publish" },
    };
    const published = await publishRequest(publisher, request, { owner });
    assert.equal(published.created, true);
    assert.ok(published.subject.startsWith(`stemq.jobs.${published.job_id}.requested.${ownerToken(owner)}.dsp.interactive`));
    jobs.publish = published.job_id;
    const again = await publishRequest(publisher, request, { owner });
    assert.equal(again.created, false);
    assert.equal(again.job_id, published.job_id);

    const statuses: string[] = [];
    for await (const v of watch(viewer, published.job_id, viewOpts)) statuses.push(v.status);
    console.log(`published job ${published.job_id}: ${statuses.join(" -> ")}`);
    assert.equal(statuses.at(-1), "succeeded");
    const view = await getView(viewer, published.job_id, viewOpts);
    assert.equal(view?.metadata && (view.metadata as { from?: string }).from, "typescript-publish");

    const secret = await http.webhookSecret();
    for (let i = 0; i < 300 && hooks.length === 0; i++) await new Promise((r) => setTimeout(r, 100));
    const hook = hooks.find((h) => h.body.includes(published.job_id));
    assert.ok(hook, "no webhook within 30 s");
    const headers = hook.headers as Record<string, string>;
    const payload = verifyWebhook(secret, hook.body, headers);
    assert.equal(payload.type, "io.stemq.job.succeeded.v1");
    assert.equal(payload.data.job_id, published.job_id);
    assert.equal(payload.data.status, "succeeded");
    assert.throws(() => verifyWebhook(secret, Buffer.concat([hook.body, Buffer.from(" ")]), headers));
    const tampered = hook.body.toString().replace('"succeeded"', '"failed"');
    assert.throws(() => verifyWebhook(secret, tampered, headers));
  });

  test("the publisher is refused on another owner's subject", { timeout: 20_000 }, async () => {
    const foreign = ownerToken("someone-else");
    await assert.rejects(
      publishRequest(publisher, { audio_uri: storeUri, model: "dsp", overlap: 0.2 }, { owner: "someone-else", timeoutMs: 2_000 }),
      (e: unknown) => {
        // A permissions violation, or (from a server that does not say) no acknowledgement.
        console.log(`publish for ${foreign}: ${(e as Error).message}`);
        return /permissions violation|timeout/i.test(String((e as Error).message));
      },
    );
  });

  test("another owner's publisher reads nothing of this owner's jobs", { skip: perOwner ? false : "views keyed by job id on this server", timeout: 60_000 }, async () => {
    // The owner's own publisher reads its views.
    assert.equal((await getView(publisher, jobs.http!, { owner }))?.status, "succeeded");
    // Another owner's user: a direct get is refused (an error or no answer) ...
    await assert.rejects(getView(other, jobs.http!, { owner, timeoutMs: 2_000 }), (e: unknown) => {
      console.log(`another owner's direct get: ${(e as Error).message}`);
      return /permissions violation|timeout/i.test((e as Error).message);
    });
    // ... and a subscription to a new job's key gets nothing while the job runs to its end.
    const request: JobRequest = { audio_uri: storeUri, model: "dsp", overlap: 0.3 };
    const id = jobIdOf(normalize(request, owner));
    const sub = other.subscribe(`$KV.stemq_jobs.${viewKey(id, { owner })}`);
    let leaked = 0;
    const draining = (async () => {
      try {
        for await (const _ of sub) leaked++;
      } catch {
        // refused by the server
      }
    })();
    await other.flush().catch(() => undefined);
    await publishRequest(publisher, request, { owner });
    assert.equal((await wait(publisher, id, { owner, timeoutMs: 45_000 })).status, "succeeded");
    sub.unsubscribe();
    await draining;
    const refusal = await sub.closed;
    console.log(`another owner's subscription: ${refusal ? refusal.message : "no error"}, ${leaked} messages`);
    assert.equal(leaked, 0);
  });
});
