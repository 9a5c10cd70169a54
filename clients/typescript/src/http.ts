// The HTTP API (docs/api.md): submit, read a job, upload a song, read the webhook
// signing secret. Uses the global fetch.
import type { JobRequest } from "./generated/job-request.js";
import type { JobStatus, JobView } from "./generated/job-view.js";

type BodyInit = NonNullable<RequestInit["body"]>;

/** Absolute URLs of a job's resources. */
export interface JobUrls {
  get: string;
  cancel: string;
  events: string;
  /** Once it has succeeded: each stem's download, by stem name. */
  stems?: Record<string, string>;
}

/** The answer to a submit (HTTP `createSeparation`, or `stemq.api.submit`). */
export interface SubmitResponse {
  job_id: string;
  status: JobStatus;
  /** True when the job already existed (nothing new was queued). */
  cached: boolean;
  status_url: string;
  /** Over HTTP only. */
  urls?: JobUrls;
  /** The HTTP status it was answered with: 202 (new) or 200 (it existed). */
  http_status: number;
}

/** A job as the HTTP API shows it: its view and its links. */
export type Job = JobView & { urls: JobUrls };

/** What `POST /v1/uploads` answers. */
export interface Upload {
  /** `upload:<sha256>.<ext>`: submit it as a request's `audio_uri`. */
  audio_uri: string;
  bytes: number;
  sha256: string;
  duration_ms?: number;
}

/** The body of every error stemq answers (`{"error": {...}}`). */
export interface ErrorDetail {
  code: string;
  message: string;
  field?: string;
  [k: string]: unknown;
}

/** A refusal by stemq (over HTTP or NATS): its HTTP status and stable error `code`. */
export class StemqError extends Error {
  override name = "StemqError";
  readonly code: string;
  readonly field: string | undefined;
  constructor(
    readonly status: number,
    readonly detail: ErrorDetail,
    /** Seconds to wait before trying again, where stemq said so (429, 503). */
    readonly retryAfter?: number,
  ) {
    super(`${status} ${detail.code}: ${detail.message}`);
    this.code = detail.code;
    this.field = detail.field;
  }
}

export interface HttpClientOptions {
  /** The ingress, e.g. `http://127.0.0.1:8080` (a path prefix is kept). */
  baseUrl: string;
  /** An API key, `sk_…`. */
  apiKey: string;
  /** Another fetch (tests, proxies). */
  fetch?: typeof fetch;
}

/** The HTTP API of one stemq, as one API key. */
export class HttpClient {
  readonly baseUrl: string;
  readonly #apiKey: string;
  readonly #fetch: typeof fetch;

  constructor(options: HttpClientOptions) {
    this.baseUrl = options.baseUrl.replace(/\/+$/, "");
    this.#apiKey = options.apiKey;
    this.#fetch = options.fetch ?? globalThis.fetch;
  }

  /** Submits a request (`POST /v1/separations`): 202 for a new job, 200 for one that existed. */
  async submit(request: JobRequest, init?: { signal?: AbortSignal }): Promise<SubmitResponse> {
    const res = await this.#call("POST", "/v1/separations", {
      body: JSON.stringify(request),
      headers: { "content-type": "application/json" },
      signal: init?.signal,
    });
    return { ...((await res.json()) as Omit<SubmitResponse, "http_status">), http_status: res.status };
  }

  /** A job's view and links (`GET /v1/separations/{id}`); with `waitSeconds`, answered when it ends or after that long. */
  async get(jobId: string, init?: { waitSeconds?: number; signal?: AbortSignal }): Promise<Job> {
    const headers: Record<string, string> = {};
    if (init?.waitSeconds) headers.prefer = `wait=${Math.ceil(init.waitSeconds)}`;
    const res = await this.#call("GET", `/v1/separations/${encodeURIComponent(jobId)}`, { headers, signal: init?.signal });
    return (await res.json()) as Job;
  }

  /** Streams a song into the store (`POST /v1/uploads`); its `audio_uri` is what a request names. */
  async upload(body: Uint8Array | Blob, filename: string, init?: { signal?: AbortSignal }): Promise<Upload> {
    const res = await this.#call("POST", `/v1/uploads?filename=${encodeURIComponent(filename)}`, {
      // Any bytes fetch can send (TypeScript's `BodyInit` wants an ArrayBuffer-backed view).
      body: body as unknown as BodyInit,
      headers: { "content-type": "application/octet-stream" },
      signal: init?.signal,
    });
    return (await res.json()) as Upload;
  }

  /** The owner's webhook signing secret (`whsec_…`), for {@link verifyWebhook}. */
  async webhookSecret(): Promise<string> {
    const res = await this.#call("GET", "/v1/webhooks/secret", {});
    return ((await res.json()) as { secret: string }).secret;
  }

  async #call(
    method: string,
    path: string,
    init: { body?: BodyInit; headers?: Record<string, string>; signal?: AbortSignal | undefined },
  ): Promise<Response> {
    const res = await this.#fetch(this.baseUrl + path, {
      method,
      body: init.body ?? null,
      headers: { accept: "application/json", ...init.headers, authorization: `Bearer ${this.#apiKey}` },
      signal: init.signal ?? null,
    });
    if (res.ok) return res;
    let detail: ErrorDetail = { code: "http_error", message: res.statusText };
    try {
      const body = (await res.json()) as { error?: ErrorDetail };
      if (body.error) detail = body.error;
    } catch {
      // not the JSON error shape: keep the status line
    }
    const retry = Number(res.headers.get("retry-after"));
    throw new StemqError(res.status, detail, Number.isFinite(retry) && retry > 0 ? retry : undefined);
  }
}
