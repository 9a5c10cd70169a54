"""Verifying the webhooks stemq sends (Standard Webhooks, docs/events.md "Webhooks")."""

from __future__ import annotations

import binascii
from collections.abc import Mapping
from typing import cast

from standardwebhooks.webhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError as _Invalid

from .errors import WebhookVerificationError
from .types import WebhookPayload

__all__ = ["verify_webhook"]


def verify_webhook(secret: str, body: bytes | str, headers: Mapping[str, str]) -> WebhookPayload:
    """The event of a webhook delivery, once its signature (`webhook-signature`, any of
    its `v1,` entries) matches `secret` (the owner's `whsec_...`) over the raw `body`
    and its `webhook-timestamp` is within 5 minutes. Pass the body exactly as received.

    The body is typed as a job's webhook (`data` is the job view); a batch's webhook
    (`type` `io.stemq.batch.ended.v1`) has the batch view as `data`:
    `cast(BatchWebhookPayload, payload)`. De-duplicate on the `webhook-id` header: every
    retry and replay of one delivery carries the same one. Raises
    `WebhookVerificationError` for anything else."""
    try:
        payload = Webhook(secret).verify(body, dict(headers.items()))
    except (_Invalid, ValueError, binascii.Error) as e:  # ValueError: malformed headers or body
        raise WebhookVerificationError(str(e) or type(e).__name__) from e
    if not isinstance(payload, dict) or "type" not in payload or "data" not in payload:
        raise WebhookVerificationError("signed, but not a stemq webhook body")
    return cast(WebhookPayload, payload)
