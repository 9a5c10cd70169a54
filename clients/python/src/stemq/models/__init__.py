"""Typed documents of stemq, generated from `schemas/` (see `clients/python/generate.sh`).

`job_request`, `job_view` and `event` are generated: never edit them by hand
(`clients/python/check-drift.sh` fails when they differ from a fresh generation).
They are `TypedDict`s: at run time every document is the plain `dict` that
`json.loads` gives, so a newer server's extra fields or failure codes still read.
"""

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

__all__ = [
    "ClipMode",
    "DeliveryAttempted",
    "Encoding",
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
    "JobRequest",
    "JobStatus",
    "JobView",
    "Model",
    "NormalizedRequest",
    "OtherMethod",
    "Output",
    "OutputFormat",
    "Priority",
    "ProgressView",
    "Requested",
    "Webhook",
    "WebhookEvent",
]
