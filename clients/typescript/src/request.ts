// A request's canonical form and its job id, as stemq derives them
// (services/core/src/request/{job,canonical}.rs): needed to publish a request straight
// to the log, where the client names the job itself.
import { createHash } from "node:crypto";

import type { NormalizedRequest } from "./generated/event.js";
import type { JobRequest, Model } from "./generated/job-request.js";
import type { JobStatus } from "./generated/job-view.js";

/** The statuses a job never leaves. */
export const TERMINAL_STATUSES: ReadonlySet<JobStatus> = new Set<JobStatus>([
  "succeeded",
  "failed",
  "dead_lettered",
  "rejected",
  "cancelled",
  "expired",
]);

/** True when a job in `status` has ended. */
export function isTerminal(status: string): boolean {
  return TERMINAL_STATUSES.has(status as JobStatus);
}

/** A request that stemq would refuse, naming the offending field (as its 422 does). */
export class RequestError extends Error {
  override name = "RequestError";
  constructor(
    readonly field: string,
    message: string,
  ) {
    super(`${field}: ${message}`);
  }
}

const MP3_BITRATES = [32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320];
const DEFAULT_MP3_BITRATE = 320;
const DEFAULT_MP3_PRESET = 2;
const MAX_SHIFTS = 20;
const MAX_URI_LEN = 2048;
const SIX_STEMS = ["drums", "bass", "other", "vocals", "guitar", "piano"];
const FOUR_STEMS = ["drums", "bass", "other", "vocals"];

function sources(model: Model): string[] {
  return model === "htdemucs_6s" ? SIX_STEMS : FOUR_STEMS;
}

function maxSegment(model: Model): number | undefined {
  return model === "htdemucs" || model === "htdemucs_ft" || model === "htdemucs_6s" ? 7.8 : undefined;
}

/**
 * The canonical form of `request` for `owner` (`JobRequest::normalize`): every default
 * filled in, what does not change the output (webhook, metadata, priority, deadlines)
 * left out. Throws a {@link RequestError} for what stemq would refuse.
 */
export function normalize(request: JobRequest, owner: string): NormalizedRequest {
  const model: Model = request.model ?? "htdemucs";
  const uri = request.audio_uri;
  if (typeof uri !== "string" || uri.trim() === "") throw new RequestError("audio_uri", "must not be empty");
  if (Buffer.byteLength(uri) > MAX_URI_LEN) throw new RequestError("audio_uri", `longer than ${MAX_URI_LEN} bytes`);
  if (uri.trim() !== uri) throw new RequestError("audio_uri", "must not start or end with whitespace");
  if (!/^[A-Za-z][A-Za-z0-9+.-]*:\S+$/.test(uri)) throw new RequestError("audio_uri", "not an absolute URI");
  const twoStems = request.two_stems ?? undefined;
  if (twoStems !== undefined && !sources(model).includes(twoStems)) {
    throw new RequestError("two_stems", `\`${twoStems}\` is not a source of ${model}; expected one of ${sources(model).join(", ")}`);
  }
  const method = request.other_method ?? undefined;
  if (twoStems === undefined && method !== undefined && method !== "add") {
    throw new RequestError("other_method", "only applies with `two_stems`");
  }
  // `add` is the default and is left out, so ids of requests that never named it hold.
  const otherMethod = twoStems !== undefined && method !== undefined && method !== "add" ? method : undefined;
  let segment = request.segment ?? undefined;
  if (segment !== undefined) {
    if (!Number.isFinite(segment) || segment <= 0) throw new RequestError("segment", "must be a positive number of seconds");
    const max = maxSegment(model);
    if (max !== undefined && segment > max) throw new RequestError("segment", `${segment} s is longer than ${model} was trained on (${max} s)`);
    if (max !== undefined && segment === max) segment = undefined; // an explicit default is the default
  }
  const overlap = request.overlap ?? 0.25;
  if (!(overlap >= 0 && overlap < 1)) throw new RequestError("overlap", "must be in [0, 1)");
  const outputFormat = request.output_format ?? "wav";
  const encoding = request.encoding ?? "s16";
  if (encoding === "f32" && outputFormat === "flac") throw new RequestError("encoding", "FLAC has no float encoding");
  let mp3: { mp3_bitrate: number; mp3_preset: number } | undefined;
  if (outputFormat === "mp3") {
    if (encoding !== "s16") throw new RequestError("encoding", "MP3 has no choice of sample encoding");
    const bitrate = request.mp3_bitrate ?? DEFAULT_MP3_BITRATE;
    if (!MP3_BITRATES.includes(bitrate)) throw new RequestError("mp3_bitrate", `${bitrate} is not one of ${MP3_BITRATES.join(", ")} (kbit/s)`);
    const preset = request.mp3_preset ?? DEFAULT_MP3_PRESET;
    if (!Number.isInteger(preset) || preset < 2 || preset > 7) throw new RequestError("mp3_preset", `must be 2 to 7, not ${preset}`);
    mp3 = { mp3_bitrate: bitrate, mp3_preset: preset };
  } else {
    if ((request.mp3_bitrate ?? DEFAULT_MP3_BITRATE) !== DEFAULT_MP3_BITRATE) throw new RequestError("mp3_bitrate", "only applies with `output_format` mp3");
    if ((request.mp3_preset ?? DEFAULT_MP3_PRESET) !== DEFAULT_MP3_PRESET) throw new RequestError("mp3_preset", "only applies with `output_format` mp3");
  }
  const shifts = request.shifts ?? 0;
  if (!Number.isInteger(shifts) || shifts < 0 || shifts > MAX_SHIFTS) throw new RequestError("shifts", `at most ${MAX_SHIFTS}`);
  if (request.metadata != null && (typeof request.metadata !== "object" || Array.isArray(request.metadata))) {
    throw new RequestError("metadata", "must be a JSON object");
  }
  if (owner === "") throw new RequestError("owner", "must not be empty");
  // Members in no particular order: the canonical JSON sorts them.
  return {
    audio_uri: uri,
    model,
    ...(twoStems !== undefined && { two_stems: twoStems }),
    ...(otherMethod !== undefined && { other_method: otherMethod }),
    output_format: outputFormat,
    ...mp3,
    encoding,
    clip_mode: request.clip_mode ?? "rescale",
    ...(segment !== undefined && { segment }),
    overlap,
    shifts,
    owner,
  };
}

/**
 * RFC 8785 (JCS) canonical JSON of a JSON value: members sorted by their names' UTF-16
 * code units (JavaScript's own string order), no whitespace, strings and numbers as
 * `JSON.stringify` writes them (which is what JCS specifies).
 */
export function canonicalJson(value: unknown): string {
  if (value === null || typeof value !== "object") {
    const s = JSON.stringify(value);
    if (s === undefined) throw new TypeError(`not a JSON value: ${String(value)}`);
    return s;
  }
  if (Array.isArray(value)) return `[${value.map((v) => canonicalJson(v ?? null)).join(",")}]`;
  const entries = Object.entries(value as Record<string, unknown>)
    .filter(([, v]) => v !== undefined)
    .sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  return `{${entries.map(([k, v]) => `${JSON.stringify(k)}:${canonicalJson(v)}`).join(",")}}`;
}

/** The job id of a normalised request: lowercase hex SHA-256 of its canonical JSON. */
export function jobIdOf(normalized: NormalizedRequest): string {
  return createHash("sha256").update(canonicalJson(normalized), "utf8").digest("hex");
}

/**
 * An owner as a subject token (`stemq_core::request::owner_token`): the owner itself
 * when it is 1 to 64 of `A-Za-z0-9-_=` and does not start with `h-`, else `h-` and the
 * hex SHA-256 of its UTF-8 bytes.
 */
export function ownerToken(owner: string): string {
  const plain = owner.length > 0 && owner.length <= 64 && !owner.startsWith("h-") && /^[A-Za-z0-9_=-]+$/.test(owner);
  return plain ? owner : `h-${createHash("sha256").update(owner, "utf8").digest("hex")}`;
}
