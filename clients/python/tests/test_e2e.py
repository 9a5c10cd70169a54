"""The client against a live stemq (`clients/python/run-e2e.sh` starts `stemq dev` and
sets the environment; without it these tests are skipped).

Covers the three ways to submit (HTTP, `stemq.api.submit`, a direct publish of the
`requested` event), following the view to `succeeded`, the publisher refused on another
owner's subject, the view of one owner unreadable by another's NATS users, invalid
requests refused with their code over HTTP and NATS, and the signed webhooks received on
a local HTTP server, verified, and refused once tampered with; the upload, submit and
webhook answers have every field their schema requires. It replaces the checks of
tests/python/foreign_service.py.

Environment:
  STEMQ_HTTP, STEMQ_API_KEY      the ingress and an admin key of the owner
  STEMQ_OWNER                    that owner (`local` under stemq dev)
  NATS_URL                       the NATS server
  STEMQ_PUBLISHER_CREDS          the owner's `publisher-<token>` credentials
  STEMQ_SUBMIT_CREDS             who asks `stemq.api.submit` (default: the publisher)
  STEMQ_READER_CREDS             who follows the views (default: the publisher)
  STEMQ_STATUS_READER_CREDS      `status-reader` (reads every owner's views)
  STEMQ_VIEW_KEYS                `owner` (keys `<token>.<id>`, the default) or `id`
                                 (the keys of a server from before the per-owner keys)
  STEMQ_OTHER_CREDS              another owner's publisher (the isolation check)
  STEMQ_AUDIO_FILE               a short song (WAV)
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client as NATS

import stemq

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif("STEMQ_HTTP" not in os.environ, reason="needs a live stemq: clients/python/run-e2e.sh"),
]
SCHEMAS = Path(__file__).resolve().parents[3] / "schemas"


def required(schema: str, definition: str | None = None) -> set[str]:
    """The fields `schemas/<schema>.json` (or its `$defs` entry) requires: what a live
    answer must have for its generated type to hold. (Not the TypedDicts'
    `__required_keys__`: Python 3.11 counts a `NotRequired` field as required when the
    module has `from __future__ import annotations`, as the generated ones do.)"""
    doc = json.loads((SCHEMAS / f"{schema}.json").read_text())
    return set((doc["$defs"][definition] if definition else doc)["required"])


class Hooks(http.server.BaseHTTPRequestHandler):
    received: list[tuple[str, dict[str, str], bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        Hooks.received.append((self.path, dict(self.headers.items()), body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Ctx:
    api: stemq.HttpClient
    owner: str
    api_key: str
    publisher: NATS
    submitter: NATS
    reader: NATS
    view_owner: str | None  # the owner to key views by, or None for the old keys
    other: NATS | None
    status_reader: NATS
    audio_uri: str  # the `upload:` name
    hook_base: str
    secret: str
    jobs: dict[str, str] = field(default_factory=dict)  # what each test made: path -> job id
    store_uri: str = ""

    async def wait(self, job_id: str) -> stemq.JobView:
        return await stemq.wait(self.reader, job_id, owner=self.view_owner, timeout=30)


@pytest.fixture(scope="module")
async def ctx() -> AsyncIterator[Ctx]:
    env = os.environ
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hooks)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = env["NATS_URL"]
    publisher = await stemq.connect(url, env["STEMQ_PUBLISHER_CREDS"])
    submit_creds = env.get("STEMQ_SUBMIT_CREDS") or env["STEMQ_PUBLISHER_CREDS"]
    reader_creds = env.get("STEMQ_READER_CREDS") or env["STEMQ_PUBLISHER_CREDS"]
    submitter = await stemq.connect(url, submit_creds)
    reader = await stemq.connect(url, reader_creds)
    other = await stemq.connect(url, env["STEMQ_OTHER_CREDS"]) if env.get("STEMQ_OTHER_CREDS") else None
    status_reader = await stemq.connect(url, env["STEMQ_STATUS_READER_CREDS"])
    async with stemq.HttpClient(env["STEMQ_HTTP"], env["STEMQ_API_KEY"]) as api:
        upload = await api.upload(Path(env["STEMQ_AUDIO_FILE"]).read_bytes(), "song.wav")
        assert upload["audio_uri"].startswith("upload:"), upload
        assert required("upload-response") <= upload.keys(), upload
        yield Ctx(
            api=api,
            owner=env.get("STEMQ_OWNER", "local"),
            api_key=env["STEMQ_API_KEY"],
            publisher=publisher,
            submitter=submitter,
            reader=reader,
            view_owner=None if env.get("STEMQ_VIEW_KEYS") == "id" else env.get("STEMQ_OWNER", "local"),
            other=other,
            status_reader=status_reader,
            audio_uri=upload["audio_uri"],
            hook_base=f"http://127.0.0.1:{server.server_address[1]}",
            secret=await api.webhook_secret(),
        )
    for nc in (publisher, submitter, reader, other, status_reader):
        if nc is not None:
            await nc.close()
    server.shutdown()


async def test_http_submit_then_watch_to_succeeded(ctx: Ctx) -> None:
    request: stemq.JobRequest = {
        "audio_uri": ctx.audio_uri,
        "model": "dsp",
        "webhook": {"url": ctx.hook_base + "/http", "events": ["completed"]},
        "metadata": {"from": "python-http"},
    }
    first = await ctx.api.submit(request)
    assert not first["cached"] and first["status"] == "queued", first
    # The live answer has what the generated type requires; over HTTP, the job's URLs.
    assert required("submit-response") <= first.keys(), first
    urls = first.get("urls")
    assert urls and first["job_id"] in urls["get"], first
    again = await ctx.api.submit(request)
    assert again["cached"] and again["job_id"] == first["job_id"], again
    statuses = []
    async for view in stemq.watch(ctx.reader, first["job_id"], owner=ctx.view_owner, idle_timeout=30):
        statuses.append(view["status"])
    assert statuses[-1] == "succeeded", statuses
    assert view["job_id"] == first["job_id"] and view["metadata"] == {"from": "python-http"}
    assert [o["stem"] for o in view.get("outputs") or []], view
    # The id the client computes for the resolved request is the server's.
    resolved = view.get("request")
    assert resolved is not None
    ctx.store_uri = resolved["audio_uri"]
    assert not ctx.store_uri.startswith("upload:")
    mine = stemq.normalize({"audio_uri": ctx.store_uri, "model": "dsp"}, ctx.owner)
    assert mine == resolved and stemq.job_id(mine) == first["job_id"]
    assert (await ctx.api.get(first["job_id"]))["status"] == "succeeded"
    ctx.jobs["/http"] = first["job_id"]


async def test_nats_request_reply_submit(ctx: Ctx) -> None:
    request: stemq.JobRequest = {"audio_uri": ctx.audio_uri, "model": "dsp", "clip_mode": "clamp"}
    answer = await stemq.submit_nats(ctx.submitter, request, ctx.api_key)
    assert answer["http_status"] == 202 and not answer["cached"], answer
    assert required("submit-reply", "SubmitResponse") | {"http_status"} <= answer.keys(), answer
    assert answer.get("urls") is None, answer  # no address to name over NATS
    again = await stemq.submit_nats(ctx.submitter, request, ctx.api_key)
    assert again["http_status"] == 200 and again["job_id"] == answer["job_id"], again
    # Held over HTTP until it ends (`Prefer: wait`), then the same end over NATS.
    assert (await ctx.api.get(answer["job_id"], wait_s=30))["status"] == "succeeded"
    assert (await ctx.wait(answer["job_id"]))["status"] == "succeeded"
    with pytest.raises(stemq.StemqError) as refused:
        await stemq.submit_nats(ctx.submitter, request, "sk_nobody_nothing")
    assert (refused.value.status, refused.value.code) == (401, "unauthorized")


async def test_direct_publish_then_duplicate(ctx: Ctx) -> None:
    assert ctx.store_uri, "needs the HTTP test's resolved audio URI"
    request: stemq.JobRequest = {
        "audio_uri": ctx.store_uri,
        "model": "dsp",
        "encoding": "s24",
        "webhook": {"url": ctx.hook_base + "/publish", "events": ["completed"]},
        "metadata": {"from": "python-publish"},
    }
    expected = stemq.job_id(stemq.normalize(request, ctx.owner))
    spy = None
    if ctx.other is not None and ctx.view_owner is not None:
        # Another owner's user subscribing to this owner's key hears nothing.
        spy = await ctx.other.subscribe(f"$KV.stemq_jobs.{stemq.view_key(expected, ctx.owner)}")
    published = await stemq.publish(ctx.publisher, request, ctx.owner, source="/python/e2e")
    assert published.job_id == expected and not published.existed, published
    view = await ctx.wait(published.job_id)
    assert view["status"] == "succeeded", view
    assert view["metadata"] == {"from": "python-publish"}
    again = await stemq.publish(ctx.publisher, request, ctx.owner)
    assert again.job_id == expected and again.existed, again
    # The HTTP test's job, published: the same job, already there.
    same = await stemq.publish(ctx.publisher, {"audio_uri": ctx.store_uri, "model": "dsp"}, ctx.owner)
    assert same.job_id == ctx.jobs["/http"] and same.existed, same
    ctx.jobs["/publish"] = published.job_id
    if spy is not None:
        with pytest.raises(nats.errors.TimeoutError):
            await spy.next_msg(timeout=0.5)
        await spy.unsubscribe()


async def test_publisher_refused_on_another_owners_subject(ctx: Ctx) -> None:
    request: stemq.JobRequest = {"audio_uri": ctx.store_uri or "file:///x.wav", "model": "dsp"}
    with pytest.raises(stemq.PublishRefused):
        await stemq.publish(ctx.publisher, request, "someone-else", timeout=1)


async def test_another_owner_cannot_read_the_view(ctx: Ctx) -> None:
    if ctx.other is None or ctx.view_owner is None:
        pytest.skip("views are not keyed by owner on this server (STEMQ_VIEW_KEYS=id)")
    job = ctx.jobs["/http"]
    # The owner's reader and publisher read it, and so does status-reader (every owner).
    for nc in (ctx.reader, ctx.publisher, ctx.status_reader):
        view = await stemq.get_view(nc, job, owner=ctx.owner)
        assert view is not None and view["status"] == "succeeded", view
    with pytest.raises(TimeoutError):
        await stemq.get_view(ctx.other, job, owner=ctx.owner, timeout=1)
    # Its own (empty) part of the bucket answers: no view.
    assert await stemq.get_view(ctx.other, job, owner="other") is None


async def test_invalid_requests_are_refused_with_their_code(ctx: Ctx) -> None:
    bad: Any = {"audio_uri": ctx.audio_uri, "model": "spleeter"}
    with pytest.raises(stemq.StemqError) as over_http:
        await ctx.api.submit(bad)
    assert (over_http.value.status, over_http.value.code, over_http.value.field) == (422, "invalid_request", "model")
    with pytest.raises(stemq.StemqError) as over_nats:
        await stemq.submit_nats(ctx.submitter, bad, ctx.api_key)
    assert (over_nats.value.status, over_nats.value.code, over_nats.value.field) == (422, "invalid_request", "model")


async def test_webhooks_verify_and_tampered_ones_do_not(ctx: Ctx) -> None:
    want = {path: job for path, job in ctx.jobs.items()}
    assert want, "no job asked for a webhook"
    deadline = time.monotonic() + 30
    while not all(any(p == path for p, _, _ in Hooks.received) for path in want) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    for path, job in want.items():
        got = [(h, b) for p, h, b in Hooks.received if p == path]
        assert got, f"no webhook on {path} within 30 s"
        headers, body = got[0]
        event = stemq.verify_webhook(ctx.secret, body, headers)
        assert event["type"] == "io.stemq.job.succeeded.v1", event
        assert required("webhook-job") <= event.keys() and required("job-view") <= event["data"].keys(), event
        assert event["data"]["job_id"] == job and event["data"]["status"] == "succeeded"
        with pytest.raises(stemq.WebhookVerificationError):
            stemq.verify_webhook(ctx.secret, body + b" ", headers)
        with pytest.raises(stemq.WebhookVerificationError):
            stemq.verify_webhook(ctx.secret, body.replace(b"succeeded", b"failed"), headers)
