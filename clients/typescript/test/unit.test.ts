// Offline tests: the job id and owner token against the values stemq's Rust tests pin
// (docs/job-id.md), credentials parsing, webhook verification, the generated answer types.
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { test } from "node:test";

import { Webhook } from "standardwebhooks";

import { RequestError, StemqError, canonicalJson, jobIdOf, normalize, ownerToken, parseCredentials, verifyWebhook } from "../src/index.js";
import type { ErrorDetail, JobStatus, JobView, SubmitReply, SubmitResponse, WebhookPayload } from "../src/index.js";

test("the job id of the documented example (docs/job-id.md)", () => {
  const n = normalize({ audio_uri: "file:///a.wav", segment: 5.0 }, "anonymous");
  assert.equal(
    canonicalJson(n),
    '{"audio_uri":"file:///a.wav","clip_mode":"rescale","encoding":"s16","model":"htdemucs","output_format":"wav","overlap":0.25,"owner":"anonymous","segment":5,"shifts":0}',
  );
  assert.equal(jobIdOf(n), "542ebe90ff7f7b97334d77cb5a4d19f44862779d40f2a7724461aa270fbef4d0");
});

test("an MP3 request writes its options out (docs/job-id.md)", () => {
  const n = normalize({ audio_uri: "file:///a.wav", output_format: "mp3" }, "anonymous");
  assert.equal(jobIdOf(n), "aa6a936346a382c894b2a911ccf98916f8f819450885ac82e1154abd577801cd");
});

test("what does not change the output stays out of the id", () => {
  const plain = jobIdOf(normalize({ audio_uri: "file:///a.wav", model: "dsp" }, "alice"));
  const extra = normalize(
    {
      audio_uri: "file:///a.wav",
      model: "dsp",
      webhook: { url: "https://example.com/h" },
      metadata: { a: 1 },
      priority: "batch",
      other_method: "add",
      segment: undefined,
    },
    "alice",
  );
  assert.equal(jobIdOf(extra), plain);
  assert.notEqual(jobIdOf(normalize({ audio_uri: "file:///a.wav", model: "dsp" }, "bob")), plain);
  // The model's own longest segment is its default.
  assert.equal(
    jobIdOf(normalize({ audio_uri: "file:///a.wav", segment: 7.8 }, "alice")),
    jobIdOf(normalize({ audio_uri: "file:///a.wav" }, "alice")),
  );
});

test("invalid requests are refused with their field", () => {
  for (const [request, field] of [
    [{ audio_uri: "" }, "audio_uri"],
    [{ audio_uri: "file:///a.wav", overlap: 1 }, "overlap"],
    [{ audio_uri: "file:///a.wav", shifts: 21 }, "shifts"],
    [{ audio_uri: "file:///a.wav", other_method: "minus" }, "other_method"],
    [{ audio_uri: "file:///a.wav", two_stems: "guitar" }, "two_stems"],
    [{ audio_uri: "file:///a.wav", output_format: "flac", encoding: "f32" }, "encoding"],
    [{ audio_uri: "file:///a.wav", mp3_bitrate: 128 }, "mp3_bitrate"],
    [{ audio_uri: "file:///a.wav", segment: 9 }, "segment"],
  ] as const) {
    assert.throws(() => normalize(request, "a"), (e: unknown) => e instanceof RequestError && e.field === field, field);
  }
});

test("canonical JSON sorts by UTF-16 code units and writes numbers as ECMAScript does", () => {
  // RFC 8785 3.2.3: U+1F600 (surrogates D83D DE00) sorts before U+FB33.
  assert.equal(
    canonicalJson({ b: [1e21, 0.1, -0, "é\n"], a: null, "\ufb33": 3, "\u20ac": 1, "\ud83d\ude00": 2 }),
    '{"a":null,"b":[1e+21,0.1,0,"é\\n"],"\u20ac":1,"\ud83d\ude00":2,"\ufb33":3}',
  );
});

test("owner tokens (stemq_core::request::owner_token)", () => {
  assert.equal(ownerToken("anonymous"), "anonymous");
  assert.equal(ownerToken("acme-2_x="), "acme-2_x=");
  for (const odd of ["a b/c", "acme.eu", "a*", "a>", "", "h-plain", "x".repeat(65)]) {
    const t = ownerToken(odd);
    assert.match(t, /^h-[0-9a-f]{64}$/, odd);
  }
  assert.equal(ownerToken("a.b"), "h-" + createHash("sha256").update("a.b").digest("hex"));
  // A hashed token cannot be claimed by an owner spelling it out.
  assert.notEqual(ownerToken(ownerToken("a b")), ownerToken("a b"));
});

test("credentials files", () => {
  const c = parseCredentials("# stemq NATS user publisher-local\n# inbox_prefix: _INBOX_publisher-local\nSUAFAKE\n");
  assert.deepEqual(c, { seed: "SUAFAKE", inboxPrefix: "_INBOX_publisher-local" });
  assert.throws(() => parseCredentials("SUAFAKE\n"));
});

test("webhooks are verified, a tampered body refused", () => {
  const secret = "whsec_" + Buffer.from("0123456789abcdef0123456789abcdef").toString("base64");
  const body = JSON.stringify({ type: "io.stemq.job.succeeded.v1", timestamp: new Date().toISOString(), data: { job_id: "x", status: "succeeded" } });
  const signature = new Webhook(secret).sign("msg_1", new Date(), body);
  const headers = { "webhook-id": "msg_1", "webhook-timestamp": String(Math.floor(Date.now() / 1000)), "webhook-signature": signature };
  assert.equal(verifyWebhook(secret, body, headers).data.status, "succeeded");
  assert.equal(verifyWebhook(secret, Buffer.from(body), new Headers(headers)).type, "io.stemq.job.succeeded.v1");
  assert.throws(() => verifyWebhook(secret, body + " ", headers));
  const old = { ...headers, "webhook-timestamp": String(Math.floor(Date.now() / 1000) - 3600) };
  assert.throws(() => verifyWebhook(secret, body, old));
});

// True when A and B are the same type (each assignable to the other): checked by tsc.
type Same<A, B> = [A] extends [B] ? ([B] extends [A] ? true : false) : false;

test("the answers' generated types agree with each other (checked when compiled)", () => {
  // A job webhook's data is the job view; the submit answer's status a job status.
  const sameView: Same<WebhookPayload["data"], JobView> = true;
  const sameStatus: Same<SubmitResponse["status"], JobStatus> = true;
  const statuses: Same<SubmitResponse["http_status"], 200 | 202> = true;
  assert.ok(sameView && sameStatus && statuses);
  // A refusal over NATS (schemas/submit-reply.json) is what a StemqError carries.
  const reply: SubmitReply = {
    error: { code: "rate_limited", message: "slow down" },
    http_status: 429,
    retry_after: 3,
  };
  assert.ok("error" in reply);
  const detail: ErrorDetail = reply.error;
  const e = new StemqError(reply.http_status, detail, reply.retry_after);
  assert.equal(e.code, "rate_limited");
  assert.equal(e.field, undefined);
  assert.equal(e.retryAfter, 3);
});
