"""The client's names for the API's answers, and what no schema describes.

The answers are generated from `schemas/` (`stemq.models`); the names here are the ones
the client's API uses. `Published` is the client's own: a direct publish's outcome."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from .models import Accepted, BatchWebhookBody, JobUrls, JobWebhookBody, SubmitReply, SubmitResponse, UploadResponse

__all__ = [
    "BatchWebhookPayload",
    "JobUrls",
    "Published",
    "SubmitAccepted",
    "SubmitReply",
    "SubmitResponse",
    "Upload",
    "WebhookPayload",
]

#: `POST /v1/uploads`' answer (`schemas/upload-response.json`).
Upload: TypeAlias = UploadResponse

#: The reply of `stemq.api.submit` that `submit_nats` returns: the submit answer with
#: `http_status` 202 (new) or 200 (existed); the other variant of `SubmitReply`, the error
#: body with `http_status` and `retry_after`, raises `StemqError`.
SubmitAccepted: TypeAlias = Accepted

#: A job webhook's body (`schemas/webhook-job.json`; docs/events.md, "Webhooks"): the
#: event type, the attempt's time and the job's status view as `data`.
WebhookPayload: TypeAlias = JobWebhookBody

#: A batch webhook's body (`schemas/webhook-batch.json`, `io.stemq.batch.ended.v1`): the
#: batch's view as `data`.
BatchWebhookPayload: TypeAlias = BatchWebhookBody


@dataclass(frozen=True)
class Published:
    """A direct publish's outcome: the job, and whether it was already there (a
    duplicate publish of the same request is the same job, not an error)."""

    job_id: str
    subject: str
    existed: bool
    seq: int | None
