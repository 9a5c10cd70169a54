// Verifying stemq's webhooks (Standard Webhooks, docs/events.md "Webhooks").
import { Webhook } from "standardwebhooks";

import type { JobView } from "./generated/job-view.js";

/** A job webhook's body: the event's type and the job's view when it was sent. */
export interface WebhookPayload {
  /** `io.stemq.job.<kind>.v1`: started, progress, or a terminal kind. */
  type: string;
  timestamp: string;
  data: JobView;
}

/**
 * Verifies a webhook delivery against the owner's signing secret (`whsec_…`, from
 * `GET /v1/webhooks/secret`) and answers its payload: the signature over the raw body
 * (any of the `v1,` entries, during a rotation) and a timestamp within 5 minutes.
 * Throws (standardwebhooks' `WebhookVerificationError`) otherwise.
 * Pass the body exactly as received, and the request's headers.
 */
export function verifyWebhook(
  secret: string,
  body: string | Uint8Array,
  headers: Record<string, string | string[] | undefined> | Headers,
): WebhookPayload {
  const flat: Record<string, string> = {};
  if (typeof (headers as Headers).forEach === "function" && typeof (headers as Headers).get === "function") {
    (headers as Headers).forEach((value, key) => {
      flat[key.toLowerCase()] = value;
    });
  } else {
    for (const [key, value] of Object.entries(headers as Record<string, string | string[] | undefined>)) {
      if (value !== undefined) flat[key.toLowerCase()] = Array.isArray(value) ? value.join(", ") : value;
    }
  }
  const payload = new Webhook(secret).verify(body, flat) as WebhookPayload | undefined;
  if (!payload || typeof payload.type !== "string" || typeof payload.data !== "object") {
    throw new Error("a verified webhook without the stemq payload shape");
  }
  return payload;
}

export { WebhookVerificationError } from "standardwebhooks";
