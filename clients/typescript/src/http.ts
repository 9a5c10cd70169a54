// The HTTP API (docs/api.md): submit, read a job, upload a song, read the webhook
// signing secret. Uses the global fetch.
import type { ErrorCode, ErrorDetail } from "./generated/error.js";
import type { JobRequest } from "./generated/job-request.js";
import type { JobView } from "./generated/job-view.js";
import type { Accepted } from "./generated/submit-reply.js";
import type { JobUrls, SubmitResponse as SubmitAnswer } from "./generated/submit-response.js";
import type { UploadResponse } from "./generated/upload-response.js";

type BodyInit = NonNullable<RequestInit["body"]>;

// The answers' types are generated from schemas/ (src/generated/), under the names this
// API uses: a job's absolute URLs (submit-response.json); the `error` of every error body
// stemq answers, `{"error": {...}}`, and its codes (error.json).
export type { JobUrls, ErrorCode, ErrorDetail };

/**
 * The answer to a submit (HTTP `createSeparation`, or `stemq.api.submit`) with the HTTP
 * status it was answered with: 202 (new) or 200 (it existed, `cached`). The accepted
 * reply of `schemas/submit-reply.json`; `urls` only over HTTP.
 */
export type SubmitResponse = Accepted;

/** A job as the HTTP API shows it: its view and its links. */
export type Job = JobView & { urls: JobUrls };

/** What `POST /v1/uploads` answers (`schemas/upload-response.json`, `UploadResponse`). */
export type Upload = UploadResponse;

/**
 * The code of a {@link StemqError}: stemq's ({@link ErrorCode}), or `http_error` for an
 * answer that was not stemq's error body (a proxy's, say), with the status line as message.
 */
export type StemqErrorCode = ErrorCode | "http_error";

/** A refusal by stemq (over HTTP or NATS): its HTTP status and stable error `code`. */
export class StemqError extends Error {
  override name = "StemqError";
  readonly code: StemqErrorCode;
  readonly field: string | undefined;
  constructor(
    readonly status: number,
    readonly detail: Omit<ErrorDetail, "code"> & { code: StemqErrorCode },
    /** Seconds to wait before trying again, where stemq said so (429, 503). */
    readonly retryAfter?: number,
  ) {
    super(`${status} ${detail.code}: ${detail.message}`);
    this.code = detail.code;
    this.field = detail.field ?? undefined;
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
    // The ingress answers 202 (queued) or 200 (it existed); other statuses threw in #call.
    return { ...((await res.json()) as SubmitAnswer), http_status: res.status as SubmitResponse["http_status"] };
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
    let detail: StemqError["detail"] = { code: "http_error", message: res.statusText };
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
