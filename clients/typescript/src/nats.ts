// stemq over NATS (docs/events.md): connecting with a stemq credentials file, the
// request-reply submit endpoint, publishing a request straight to the log, and
// following a job's view in the `stemq_jobs` bucket (by plain NATS requests and
// subscriptions: the users that read it may not look at the stream or create consumers).
import { readFile } from "node:fs/promises";

import { JetStreamApiError, jetstream } from "@nats-io/jetstream";
import { connect, headers, nkeyAuthenticator } from "@nats-io/transport-node";
import type { NatsConnection } from "@nats-io/transport-node";

import type { JobRequest, Priority } from "./generated/job-request.js";
import type { JobView } from "./generated/job-view.js";
import type { Requested } from "./generated/event.js";
import type { SubmitReply } from "./generated/submit-reply.js";
import { StemqError } from "./http.js";
import type { SubmitResponse } from "./http.js";
import { isTerminal, jobIdOf, normalize, ownerToken } from "./request.js";

export type { NatsConnection };

/** The status view bucket. */
export const JOBS_BUCKET = "stemq_jobs";
/** The request-reply submit endpoint. */
export const SUBMIT_SUBJECT = "stemq.api.submit";

/** What a stemq credentials file (`<user>.nk`) holds. */
export interface Credentials {
  /** The user's nkey seed (`SU…`). */
  seed: string;
  /** The only inbox the user may subscribe below (`_INBOX_<user>`). */
  inboxPrefix: string;
}

/** Reads a stemq credentials file: the seed line and its `# inbox_prefix:` comment. */
export async function readCredentials(path: string): Promise<Credentials> {
  return parseCredentials(await readFile(path, "ascii"), path);
}

/** Parses the text of a stemq credentials file. */
export function parseCredentials(text: string, name = "credentials"): Credentials {
  let seed: string | undefined;
  let inboxPrefix: string | undefined;
  for (const raw of text.split(/\r?\n/)) {
    const line = raw.trim();
    if (line.startsWith("# inbox_prefix:")) inboxPrefix = line.slice("# inbox_prefix:".length).trim();
    else if (line.startsWith("SU")) seed = line;
  }
  if (!seed || !inboxPrefix) throw new Error(`${name} is not a stemq credentials file (a seed line and \`# inbox_prefix:\`)`);
  return { seed, inboxPrefix };
}

export interface ConnectOptions {
  /** The NATS server(s), e.g. `nats://127.0.0.1:4222`. */
  servers: string | string[];
  /** A credentials file's path, or what it holds. */
  credentials: string | Credentials;
  /** A name the server shows for this connection. */
  name?: string;
}

/** Connects as a stemq NATS user: its nkey and its own inbox prefix. */
export async function connectAs(options: ConnectOptions): Promise<NatsConnection> {
  const creds = typeof options.credentials === "string" ? await readCredentials(options.credentials) : options.credentials;
  return connect({
    servers: options.servers,
    authenticator: nkeyAuthenticator(new TextEncoder().encode(creds.seed)),
    inboxPrefix: creds.inboxPrefix,
    ...(options.name !== undefined && { name: options.name }),
  });
}

const encoder = new TextEncoder();
const decoder = new TextDecoder();

/**
 * Submits a request on `stemq.api.submit` with an API key (the key's owner owns the
 * job, as over HTTP). Answers like the HTTP submit; a refusal throws a
 * {@link StemqError} with the HTTP status and code the HTTP API would answer.
 */
export async function submitNats(
  nc: NatsConnection,
  apiKey: string,
  request: JobRequest,
  options: { timeoutMs?: number } = {},
): Promise<SubmitResponse> {
  const h = headers();
  h.set("Authorization", `Bearer ${apiKey}`);
  const reply = await nc.request(SUBMIT_SUBJECT, encoder.encode(JSON.stringify(request)), {
    timeout: options.timeoutMs ?? 10_000,
    headers: h,
  });
  // The reply of `schemas/submit-reply.json`: the accepted answer or the refusal, each with `http_status`.
  const body = JSON.parse(decoder.decode(reply.data)) as SubmitReply;
  if ("error" in body) throw new StemqError(body.http_status, body.error, body.retry_after);
  return body;
}

export interface PublishOptions {
  /** The owner the request is for: the publisher user's own owner. */
  owner: string;
  /** The CloudEvent's `source`. Default `/stemq-client/typescript`. */
  source?: string;
  /** Milliseconds to wait for the stream's acknowledgement. Default 5000. */
  timeoutMs?: number;
}

/** The outcome of a direct publish. */
export interface Published {
  job_id: string;
  /** The subject the request was recorded on. */
  subject: string;
  /** False when the job already existed (the same request was recorded before). */
  created: boolean;
  /** The request's stream sequence (when it was new). */
  seq?: number;
}

/**
 * Publishes a `io.stemq.job.requested.v1` event straight to the log, as the NATS user
 * `publisher-<owner token>`: the request is normalised and its job id computed here,
 * and recorded at most once (`Nats-Msg-Id` and an expected last subject sequence of 0
 * over the job's request subjects). A job that already exists is not an error
 * (`created: false`). `audio_uri` must be the store URI of one of the owner's uploads
 * (the `upload:` name is resolved by the submit APIs only). A subject the user may
 * not publish on is never acknowledged: the publish times out.
 */
export async function publishRequest(
  nc: NatsConnection,
  request: JobRequest,
  options: PublishOptions,
): Promise<Published> {
  const normalized = normalize(request, options.owner);
  const id = jobIdOf(normalized);
  const token = ownerToken(options.owner);
  const lane: Priority = request.priority ?? "interactive";
  const subject = `stemq.jobs.${id}.requested.${token}.${normalized.model}.${lane}`;
  const data: Requested = {
    request: normalized,
    ...(request.webhook != null && { webhook: { url: request.webhook.url, events: request.webhook.events ?? ["completed"] } }),
    ...(request.metadata != null && { metadata: request.metadata }),
    ...(request.start_before != null && { start_before: request.start_before }),
    ...(request.max_runtime != null && { max_runtime: request.max_runtime }),
    ...(request.priority != null && { priority: request.priority }),
  };
  const event = {
    specversion: "1.0",
    id,
    source: options.source ?? "/stemq-client/typescript",
    subject: id,
    type: "io.stemq.job.requested.v1",
    time: new Date().toISOString(),
    datacontenttype: "application/json",
    data,
  };
  const h = headers();
  h.set("Content-Type", "application/cloudevents+json");
  try {
    const ack = await jetstream(nc, { checkAPI: false }).publish(subject, encoder.encode(JSON.stringify(event)), {
      msgID: id,
      headers: h,
      expect: { lastSubjectSequence: 0, lastSubjectSequenceSubject: `stemq.jobs.${id}.requested.${token}.>` },
      timeout: options.timeoutMs ?? 5_000,
    });
    return ack.duplicate ? { job_id: id, subject, created: false } : { job_id: id, subject, created: true, seq: ack.seq };
  } catch (e) {
    // "wrong last sequence": the job's request is already in the log.
    if (e instanceof JetStreamApiError && e.code === 10071) return { job_id: id, subject, created: false };
    throw e;
  }
}

/**
 * Whose views to read. Views are keyed `<owner token>.<job id>` in the `stemq_jobs`
 * bucket: give the owner (or its token) to read as that owner's `publisher-<token>` or
 * `reader-<token>` user, which may read only its own owner's views. With neither, the
 * key is the bare job id: views written before the bucket was keyed per owner, read
 * as `status-reader`.
 */
export interface ViewOptions {
  owner?: string;
  ownerToken?: string;
}

/** The key of a job's view in the `stemq_jobs` bucket (see {@link ViewOptions}). */
export function viewKey(jobId: string, options: ViewOptions = {}): string {
  const token = options.ownerToken ?? (options.owner !== undefined ? ownerToken(options.owner) : undefined);
  return token === undefined ? jobId : `${token}.${jobId}`;
}

/**
 * A job's current view, or null before it is projected: a direct get of the key's last
 * value (a plain request to `$JS.API.DIRECT.GET.KV_stemq_jobs.$KV.stemq_jobs.<key>`;
 * no stream info, no consumer). A key the user may not read is refused: the request
 * fails (permissions violation) or times out.
 */
export async function getView(
  nc: NatsConnection,
  jobId: string,
  options: ViewOptions & { timeoutMs?: number } = {},
): Promise<JobView | null> {
  const subject = `$KV.${JOBS_BUCKET}.${viewKey(jobId, options)}`;
  const reply = await nc.request(`$JS.API.DIRECT.GET.KV_${JOBS_BUCKET}.${subject}`, new Uint8Array(0), {
    timeout: options.timeoutMs ?? 5_000,
  });
  const code = reply.headers?.code ?? 0;
  if (code === 404) return null;
  if (code >= 300) throw new Error(`direct get of ${subject}: ${code} ${reply.headers?.description ?? ""}`.trim());
  if (reply.data.length === 0) return null; // a delete or purge marker
  return reply.json<JobView>();
}

function newer(view: JobView, than: JobView | undefined): boolean {
  if (!than) return true;
  if (view.last_seq !== than.last_seq) return view.last_seq > than.last_seq;
  return (view.progress_seq ?? 0) > (than.progress_seq ?? 0);
}

/**
 * The views of a job, as they change, until it is terminal (the last one yielded is
 * terminal). Subscribes to the key's subject `$KV.stemq_jobs.<key>` first, then reads
 * the current value by a direct get (an update in between still arrives; older ones
 * are skipped): no consumer is created, so this needs only a user allowed to read the
 * key. Stops when `signal` aborts (the iterator then throws its reason).
 */
export async function* watch(
  nc: NatsConnection,
  jobId: string,
  options: ViewOptions & { signal?: AbortSignal } = {},
): AsyncGenerator<JobView, void, undefined> {
  const { signal } = options;
  signal?.throwIfAborted();
  const sub = nc.subscribe(`$KV.${JOBS_BUCKET}.${viewKey(jobId, options)}`);
  const stop = () => sub.unsubscribe();
  signal?.addEventListener("abort", stop, { once: true });
  try {
    await nc.flush();
    let last: JobView | undefined;
    const first = await getView(nc, jobId, options);
    if (first) {
      last = first;
      yield first;
      if (isTerminal(first.status)) return;
    }
    for await (const msg of sub) {
      if (msg.data.length === 0) continue; // a delete or purge marker
      const view = msg.json<JobView>();
      if (!newer(view, last)) continue;
      last = view;
      yield view;
      if (isTerminal(view.status)) return;
    }
    signal?.throwIfAborted();
    // A subscription the server refused ends with its error.
    await sub.closed.then((e) => {
      if (e) throw e;
    });
    throw new Error(`the subscription to job ${jobId} ended before the job did`);
  } finally {
    signal?.removeEventListener("abort", stop);
    if (!sub.isClosed()) sub.unsubscribe();
  }
}

function viewOptions(o: ViewOptions): ViewOptions {
  return {
    ...(o.owner !== undefined && { owner: o.owner }),
    ...(o.ownerToken !== undefined && { ownerToken: o.ownerToken }),
  };
}

/** A job that did not end in time. */
export class WaitTimeoutError extends Error {
  override name = "WaitTimeoutError";
  constructor(
    readonly jobId: string,
    /** The last view seen, if any. */
    readonly last: JobView | undefined,
  ) {
    super(`job ${jobId} did not end in time (last status: ${last?.status ?? "not projected"})`);
  }
}

/** Waits until the job is terminal and answers its final view; throws {@link WaitTimeoutError} after `timeoutMs`. */
export async function wait(
  nc: NatsConnection,
  jobId: string,
  options: ViewOptions & { timeoutMs: number; onView?: (view: JobView) => void },
): Promise<JobView> {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), options.timeoutMs);
  let last: JobView | undefined;
  try {
    for await (const view of watch(nc, jobId, { ...viewOptions(options), signal: controller.signal })) {
      last = view;
      options.onView?.(view);
    }
    if (!last) throw new Error(`job ${jobId}: no view`);
    return last;
  } catch (e) {
    if (controller.signal.aborted) throw new WaitTimeoutError(jobId, last);
    throw e;
  } finally {
    clearTimeout(timer);
  }
}
