// @stemq/client: submit stemq jobs (HTTP, NATS request-reply, direct publish), follow
// them to their end, verify webhooks. Models are generated from schemas/ (src/generated).
export type { JobRequest, Model, OutputFormat, Encoding, ClipMode, OtherMethod, Priority, Webhook } from "./generated/job-request.js";
export type { JobView, JobStatus, ErrorView, ProgressView, Output, FailureCode, FailureClass } from "./generated/job-view.js";
export type {
  Event,
  NormalizedRequest,
  Requested,
  Started,
  Progress,
  Succeeded,
  Failed,
  DeadLettered,
  Rejected,
  Retried,
  CancelRequested,
  Cancelled,
  Expired,
  DeliveryAttempted,
  DeliveryReplayRequested,
} from "./generated/event.js";
export { TERMINAL_STATUSES, isTerminal, normalize, canonicalJson, jobIdOf, ownerToken, RequestError } from "./request.js";
export { HttpClient, StemqError } from "./http.js";
export type { HttpClientOptions, SubmitResponse, Job, JobUrls, Upload, ErrorDetail, ErrorCode, StemqErrorCode } from "./http.js";
export type { SubmitReply } from "./generated/submit-reply.js";
export {
  JOBS_BUCKET,
  SUBMIT_SUBJECT,
  readCredentials,
  parseCredentials,
  connectAs,
  submitNats,
  publishRequest,
  viewKey,
  getView,
  watch,
  wait,
  WaitTimeoutError,
} from "./nats.js";
export type { Credentials, ConnectOptions, PublishOptions, Published, ViewOptions, NatsConnection } from "./nats.js";
export { verifyWebhook, WebhookVerificationError } from "./webhook.js";
export type { WebhookPayload, BatchWebhookPayload } from "./webhook.js";
export type { BatchView } from "./generated/webhook-batch.js";
