"""Answers that `schemas/` does not describe (they are in the live `/openapi.json`):
written by hand, kept to the fields the client reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NotRequired, TypedDict

from .models import JobStatus, JobView

__all__ = ["JobUrls", "Published", "SubmitResponse", "Upload", "WebhookPayload"]


class JobUrls(TypedDict):
    get: str
    cancel: str
    events: str


class SubmitResponse(TypedDict):
    """The submit answer (`SubmitResponse` of /openapi.json); over NATS with
    `http_status` (202 new, 200 existed)."""

    job_id: str
    status: JobStatus
    cached: bool
    status_url: str
    urls: NotRequired[JobUrls]
    http_status: NotRequired[int]


class Upload(TypedDict):
    """`POST /v1/uploads`' answer."""

    audio_uri: str
    bytes: int
    sha256: str
    duration_ms: NotRequired[int]


class WebhookPayload(TypedDict):
    """A job webhook's body (docs/events.md, "Webhooks"): the event type and the job's
    status view."""

    type: str
    timestamp: str
    data: JobView


@dataclass(frozen=True)
class Published:
    """A direct publish's outcome: the job, and whether it was already there (a
    duplicate publish of the same request is the same job, not an error)."""

    job_id: str
    subject: str
    existed: bool
    seq: int | None
