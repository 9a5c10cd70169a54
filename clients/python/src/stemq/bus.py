"""stemq over NATS (docs/events.md) with nats-py: connect with stemq's credentials
files, submit by request-reply (`stemq.api.submit`), publish a request straight to the
log, and follow a job's status view in the `stemq_jobs` bucket."""

from __future__ import annotations

import asyncio
import datetime
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any, Final, cast

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.js.errors import APIError

from .errors import PublishRefused, StemqError
from .jobid import job_id as _job_id
from .jobid import normalize, owner_token
from .models import EventIoStemqJobRequestedV1, JobRequest, JobView
from .types import Published, SubmitAccepted

__all__ = [
    "TERMINAL",
    "connect",
    "get_view",
    "publish",
    "read_credentials",
    "submit_nats",
    "view_key",
    "wait",
    "watch",
]

#: Statuses after which a job's view no longer changes.
TERMINAL = frozenset({"succeeded", "failed", "dead_lettered", "rejected", "cancelled", "expired"})
SUBMIT_SUBJECT = "stemq.api.submit"
BUCKET = "stemq_jobs"
_WRONG_LAST_SEQUENCE = 10071  # JetStream's err_code: the job's request is already there
#: The event `type` of a request, and its part of the id spelled out in `data`.
_REQUESTED: Final = "io.stemq.job.requested.v1"
_NOT_IN_ID = ("webhook", "metadata", "start_before", "max_runtime", "priority")


def read_credentials(path: str | Path) -> tuple[str, str]:
    """The nkey seed (`SU...`) and inbox prefix (`# inbox_prefix: _INBOX_<user>`) of a
    stemq NATS credentials file (`<data-dir>/nats/creds/<user>.nk`)."""
    seed = inbox = None
    for line in Path(path).read_text(encoding="ascii").splitlines():
        line = line.strip()
        if line.startswith("# inbox_prefix:"):
            inbox = line.split(":", 1)[1].strip()
        elif line.startswith("SU"):
            seed = line
    if not (seed and inbox):
        raise ValueError(f"{path} is not a stemq credentials file (an SU... seed and `# inbox_prefix:`)")
    return seed, inbox


async def connect(url: str, credentials: str | Path, **options: Any) -> NATS:
    """A NATS connection as the user of a stemq credentials file, with its inbox prefix
    (each user may subscribe only below its own inbox). `options` go to `nats.connect`."""
    seed, inbox = read_credentials(credentials)
    return await nats.connect(url, nkeys_seed_str=seed, inbox_prefix=inbox, **options)


async def submit_nats(nc: NATS, request: JobRequest, api_key: str, *, timeout: float = 10.0) -> SubmitAccepted:
    """Submits over `stemq.api.submit` with an API key, as `POST /v1/separations` would:
    the answer (`SubmitAccepted`, the `accepted` variant of `schemas/submit-reply.json`)
    has `http_status` 202 (new) or 200 (existed); the `refused` variant raises
    `StemqError` with its `http_status`, code and `retry_after`."""
    try:
        msg = await nc.request(
            SUBMIT_SUBJECT,
            json.dumps(request).encode(),
            timeout=timeout,
            headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
        )
    except nats.errors.NoRespondersError:
        raise StemqError(503, "unavailable", f"no ingress answers {SUBMIT_SUBJECT}") from None
    body = json.loads(msg.data)
    status = int(body.get("http_status", 500)) if isinstance(body, dict) else 500
    if status >= 400:
        retry = body.get("retry_after") if isinstance(body, dict) else None
        raise StemqError.from_body(status, body, float(retry) if retry is not None else None)
    return cast(SubmitAccepted, body)


async def publish(
    nc: NATS,
    request: JobRequest,
    owner: str,
    *,
    source: str = "/stemq-python",
    timeout: float = 2.0,
) -> Published:
    """Publishes a `io.stemq.job.requested.v1` event straight to the log, as the NATS
    user `publisher-<owner token>` (`nc`), for `owner`: the request is normalised and
    its id computed here, as the ingress would (`docs/job-id.md`).

    `request["audio_uri"]` must be the store URI of one of the owner's uploads (a job
    view's `request.audio_uri`), not an `upload:` name (only the submit APIs resolve
    those). Publishing a job that exists is no error: `existed` says so. Raises
    `PublishRefused` when no PubAck comes (the server refuses another owner's subject
    without an answer) and `ValueError` for a request the server would refuse."""
    if request["audio_uri"].startswith("upload:"):
        raise ValueError("audio_uri: a direct publish needs the upload's store URI, not its `upload:` name")
    normalized = normalize(request, owner)
    job = _job_id(normalized)
    token = owner_token(owner)
    lane = request.get("priority") or "interactive"
    data: dict[str, Any] = {"request": normalized}
    data.update({k: request[k] for k in _NOT_IN_ID if request.get(k) is not None})  # type: ignore[literal-required]
    event: EventIoStemqJobRequestedV1 = {
        "specversion": "1.0",
        "id": job,
        "source": source,
        "subject": job,
        "type": _REQUESTED,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "datacontenttype": "application/json",
        "data": cast(Any, data),
    }
    # The routed subject: the pool's consumer takes it without a hop through the router.
    subject = f"stemq.jobs.{job}.requested.{token}.{normalized['model']}.{lane}"
    headers = {
        "Nats-Msg-Id": job,
        "Nats-Expected-Last-Subject-Sequence": "0",
        "Nats-Expected-Last-Subject-Sequence-Subject": f"stemq.jobs.{job}.requested.{token}.>",
        "Content-Type": "application/cloudevents+json",
    }
    try:
        ack = await nc.jetstream().publish(subject, json.dumps(event).encode(), timeout=timeout, headers=headers)
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        raise PublishRefused(f"no PubAck for {subject} within {timeout} s: refused, or no stream") from None
    except APIError as e:
        if e.err_code == _WRONG_LAST_SEQUENCE:
            return Published(job_id=job, subject=subject, existed=True, seq=None)
        raise
    return Published(job_id=job, subject=subject, existed=bool(ack.duplicate), seq=ack.seq)


def view_key(job_id: str, owner: str | None = None) -> str:
    """The job's key in the `stemq_jobs` bucket: `<owner token>.<job id>`, or the bare
    job id of views written before the bucket was keyed by owner (`owner=None`)."""
    return job_id if owner is None else f"{owner_token(owner)}.{job_id}"


async def get_view(nc: NATS, job_id: str, *, owner: str | None = None, timeout: float = 2.0) -> JobView | None:
    """The job's current status view, or None while there is none yet.

    A direct get of the key (a plain request: the owner's `publisher-` or `reader-`
    user may read only its owner's keys and may not open the bucket, so no KV API).
    A user refused the key gets no answer: `TimeoutError`."""
    msg = await nc.request(f"$JS.API.DIRECT.GET.KV_{BUCKET}.$KV.{BUCKET}.{view_key(job_id, owner)}", b"", timeout=timeout)
    headers = msg.headers or {}
    if headers.get("Status") or headers.get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
        return None  # 404: not projected yet (or deleted)
    return cast(JobView, json.loads(msg.data))


async def watch(
    nc: NATS, job_id: str, *, owner: str | None = None, idle_timeout: float | None = None
) -> AsyncGenerator[JobView, None]:
    """The job's status views, oldest first, ending with the terminal one.

    Follows the job's key in the `stemq_jobs` bucket (`view_key`) without a consumer
    (no NATS user of a client may create one): a plain subscription to its put subject
    `$KV.stemq_jobs.<key>`, then a direct get of the current view; a view older than
    one already given is skipped. Pass the job's `owner` (the key is per owner); as
    `status-reader`, `owner=None` reads the old keys. A running job's view changes at
    least every 2 s, a queued one may wait long: `idle_timeout` bounds the wait for
    each change (`nats.errors.TimeoutError`, a `TimeoutError`)."""
    sub = await nc.subscribe(f"$KV.{BUCKET}.{view_key(job_id, owner)}")
    try:
        await nc.flush()
        last: tuple[int, int] | None = None
        view = await get_view(nc, job_id, owner=owner, timeout=idle_timeout or 5.0)
        if view is not None:
            last = _order(view)
            yield view
            if view["status"] in TERMINAL:
                return
        while True:
            msg = await sub.next_msg(timeout=idle_timeout)
            if not msg.data:
                continue  # a delete or purge marker
            view = cast(JobView, json.loads(msg.data))
            if last is not None and _order(view) <= last:
                continue
            last = _order(view)
            yield view
            if view["status"] in TERMINAL:
                return
    finally:
        await sub.unsubscribe()


async def wait(nc: NATS, job_id: str, *, owner: str | None = None, timeout: float = 300.0) -> JobView:
    """The job's terminal view (`watch` to the end); `TimeoutError` after `timeout` s."""
    async with asyncio.timeout(timeout), aclosing(watch(nc, job_id, owner=owner)) as views:
        async for view in views:
            if view["status"] in TERMINAL:
                return view
    raise RuntimeError("the watch ended before a terminal status")  # not reached


def _order(view: JobView) -> tuple[int, int]:
    """Where a view stands in the log: the sequences of the last job and progress
    events folded into it (both only grow)."""
    return (view.get("last_seq", 0), view.get("progress_seq", 0))
