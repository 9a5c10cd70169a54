"""Typed documents of stemq, generated from `schemas/` (see `clients/python/generate.sh`).

Every module here but this one is generated, one per schema (`job_request`, `job_view`,
`event`, `submit_response`, `submit_reply`, `upload_response`, `error`, `webhook_job`,
`webhook_batch`): never edit them by hand (`clients/python/check-drift.sh` fails when
they differ from a fresh generation). A definition shared by several schemas (`JobView`,
`JobStatus`, `JobUrls`, ...) is generated in each; this module exports one of them, and
the copies are the same `TypedDict` to mypy (TypedDicts compare by their fields).

They are `TypedDict`s: at run time every document is the plain `dict` that
`json.loads` gives, so a newer server's extra fields or failure codes still read.
"""

from .error import Error, ErrorCode, ErrorDetail
from .event import (
    DeliveryAttempted,
    Event,
    EventIoStemqJobCancelledV1,
    EventIoStemqJobDeadLetteredV1,
    EventIoStemqJobExpiredV1,
    EventIoStemqJobFailedV1,
    EventIoStemqJobProgressV1,
    EventIoStemqJobRejectedV1,
    EventIoStemqJobRequestedV1,
    EventIoStemqJobStartedV1,
    EventIoStemqJobSucceededV1,
    Requested,
)
from .job_request import (
    ClipMode,
    Encoding,
    JobRequest,
    Model,
    OtherMethod,
    OutputFormat,
    Priority,
    Webhook,
    WebhookEvent,
)
from .job_view import (
    ErrorView,
    FailureClass,
    FailureCode,
    JobStatus,
    JobView,
    NormalizedRequest,
    Output,
    ProgressView,
)
from .submit_reply import Accepted, Refused, SubmitReply
from .submit_response import JobUrls, SubmitResponse
from .upload_response import UploadResponse
from .webhook_batch import (
    BatchCounts,
    BatchStatus,
    BatchView,
    BatchWebhook,
    ItemError,
    ItemView,
    ItemViewNotSubmitted,
    ItemViewRefused,
    ItemViewSubmitted,
)
from .webhook_batch import WebhookBodyOfBatchView as BatchWebhookBody
from .webhook_job import WebhookBodyOfJobView as JobWebhookBody

__all__ = [
    "Accepted",
    "BatchCounts",
    "BatchStatus",
    "BatchView",
    "BatchWebhook",
    "BatchWebhookBody",
    "ClipMode",
    "DeliveryAttempted",
    "Encoding",
    "Error",
    "ErrorCode",
    "ErrorDetail",
    "ErrorView",
    "Event",
    "EventIoStemqJobCancelledV1",
    "EventIoStemqJobDeadLetteredV1",
    "EventIoStemqJobExpiredV1",
    "EventIoStemqJobFailedV1",
    "EventIoStemqJobProgressV1",
    "EventIoStemqJobRejectedV1",
    "EventIoStemqJobRequestedV1",
    "EventIoStemqJobStartedV1",
    "EventIoStemqJobSucceededV1",
    "FailureClass",
    "FailureCode",
    "ItemError",
    "ItemView",
    "ItemViewNotSubmitted",
    "ItemViewRefused",
    "ItemViewSubmitted",
    "JobRequest",
    "JobStatus",
    "JobUrls",
    "JobView",
    "JobWebhookBody",
    "Model",
    "NormalizedRequest",
    "OtherMethod",
    "Output",
    "OutputFormat",
    "Priority",
    "ProgressView",
    "Refused",
    "Requested",
    "SubmitReply",
    "SubmitResponse",
    "UploadResponse",
    "Webhook",
    "WebhookEvent",
]
