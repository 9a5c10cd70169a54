"""The Python client of stemq: submit separation jobs (over HTTP, NATS request-reply,
or a direct publish to the log), follow their status view, verify their webhooks.

    import stemq
    async with stemq.HttpClient(base, api_key) as api:
        job = await api.submit({"audio_uri": audio_uri, "model": "dsp"})
    reader = await stemq.connect(nats_url, "reader-acme.nk")   # or publisher-acme.nk
    view = await stemq.wait(reader, job["job_id"], owner="acme", timeout=60)
"""

from .bus import TERMINAL, connect, get_view, publish, read_credentials, submit_nats, view_key, wait, watch
from .errors import PublishRefused, StemqError, WebhookVerificationError
from .http import HttpClient
from .jobid import canonical_json, job_id, normalize, owner_token
from .models import BatchView, ErrorCode, JobRequest, JobStatus, JobUrls, JobView, NormalizedRequest
from .types import BatchWebhookPayload, Published, SubmitAccepted, SubmitReply, SubmitResponse, Upload, WebhookPayload
from .webhooks import verify_webhook

__version__ = "0.1.0"

__all__ = [
    "TERMINAL",
    "BatchView",
    "BatchWebhookPayload",
    "ErrorCode",
    "HttpClient",
    "JobRequest",
    "JobStatus",
    "JobUrls",
    "JobView",
    "NormalizedRequest",
    "Published",
    "PublishRefused",
    "StemqError",
    "SubmitAccepted",
    "SubmitReply",
    "SubmitResponse",
    "Upload",
    "WebhookPayload",
    "WebhookVerificationError",
    "canonical_json",
    "connect",
    "get_view",
    "job_id",
    "normalize",
    "owner_token",
    "publish",
    "read_credentials",
    "submit_nats",
    "verify_webhook",
    "view_key",
    "wait",
    "watch",
]
