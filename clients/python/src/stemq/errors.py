"""The client's errors."""

from __future__ import annotations

from typing import Any

__all__ = ["PublishRefused", "StemqError", "WebhookVerificationError"]


class StemqError(Exception):
    """An error answer of the API (`{"error": {"code", "message", "field"?}}`, docs/api.md),
    over HTTP or `stemq.api.submit`: `status` is the HTTP status (`http_status` over NATS),
    `code` the stable machine-readable code (`invalid_request`, `unauthorized`, ...),
    `retry_after` the seconds to wait where the server says so (429, 503)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        field: str | None = None,
        retry_after: float | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(f"{status} {code}: {message}" + (f" (field {field})" if field else ""))
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.retry_after = retry_after
        self.body = body

    @classmethod
    def from_body(cls, status: int, body: Any, retry_after: float | None = None) -> StemqError:
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict):
            return cls(status, "unknown", repr(body)[:200], retry_after=retry_after, body=body)
        return cls(
            status,
            str(err.get("code", "unknown")),
            str(err.get("message", "")),
            field=err.get("field"),
            retry_after=retry_after,
            body=body,
        )


class PublishRefused(Exception):
    """A direct publish was not acknowledged in time. The server answers nothing to a
    publish it refuses (another owner's subject, a subject the user may not use), so a
    refusal and an unreachable stream look the same: no PubAck."""


class WebhookVerificationError(Exception):
    """A webhook whose signature, timestamp or body does not verify: refuse it."""
