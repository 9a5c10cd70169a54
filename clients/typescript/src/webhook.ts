// Verifying stemq's webhooks (Standard Webhooks, docs/events.md "Webhooks").
import { Webhook } from "standardwebhooks";

import type { WebhookBodyOfBatchView as BatchWebhookBody } from "./generated/webhook-batch.js";
import type { WebhookBodyOfJobView as JobWebhookBody } from "./generated/webhook-job.js";

/**
 * A job webhook's body (`schemas/webhook-job.json`): the event's type
 * (`io.stemq.job.<kind>.v1`: started, progress, or a terminal kind), when it was sent,
 * and the job's view then.
 */
export type WebhookPayload = JobWebhookBody;

/**
 * A batch webhook's body (`schemas/webhook-batch.json`): `io.stemq.batch.ended.v1` with
 * the batch's view as `data`, signed alike (tell it from a job's by its `type`).
 */
export type BatchWebhookPayload = BatchWebhookBody;

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
