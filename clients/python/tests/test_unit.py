"""What the client computes by itself: job ids (the examples docs/job-id.md pins),
owner tokens, JCS, webhook verification, the answers' types (generated). No server needed."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import cast

import pytest
from standardwebhooks.webhooks import Webhook

import stemq
from stemq.jobid import canonical_json


def test_the_documented_job_id() -> None:
    n = stemq.normalize({"audio_uri": "file:///a.wav", "segment": 5.0}, "anonymous")
    assert canonical_json(n) == (
        b'{"audio_uri":"file:///a.wav","clip_mode":"rescale","encoding":"s16","model":"htdemucs",'
        b'"output_format":"wav","overlap":0.25,"owner":"anonymous","segment":5,"shifts":0}'
    )
    assert stemq.job_id(n) == "542ebe90ff7f7b97334d77cb5a4d19f44862779d40f2a7724461aa270fbef4d0"


def test_the_documented_mp3_job_id() -> None:
    n = stemq.normalize({"audio_uri": "file:///a.wav", "output_format": "mp3"}, "anonymous")
    assert stemq.job_id(n) == "aa6a936346a382c894b2a911ccf98916f8f819450885ac82e1154abd577801cd"


def test_the_documented_batch_id_bytes() -> None:
    item = stemq.job_id(stemq.normalize({"audio_uri": "file:///a.wav", "segment": 5.0}, "anonymous"))
    doc = {"owner": "anonymous", "items": [item, {"invalid": {"audio_uri": "file:///b.wav", "shifts": -1}}]}
    assert stemq.job_id(doc) == "db490f649a5b3ae2f3dd52e8b1e44bed508069ed1867ebf4179fb3265b0ea22a"  # type: ignore[arg-type]


def test_explicit_defaults_and_what_is_not_in_the_id_share_the_id() -> None:
    base = stemq.job_id(stemq.normalize({"audio_uri": "file:///a.wav"}, "o"))
    same = stemq.normalize(
        {
            "audio_uri": "file:///a.wav",
            "model": "htdemucs",
            "segment": 7.8,
            "overlap": 0.25,
            "shifts": 0,
            "encoding": "s16",
            "clip_mode": "rescale",
            "output_format": "wav",
            "other_method": "add",
            "webhook": {"url": "https://example.com/h"},
            "metadata": {"x": 1},
            "priority": "batch",
            "max_runtime": 60,
        },
        "o",
    )
    assert stemq.job_id(same) == base
    assert stemq.job_id(stemq.normalize({"audio_uri": "file:///a.wav", "shifts": 1}, "o")) != base
    assert stemq.job_id(stemq.normalize({"audio_uri": "file:///a.wav"}, "p")) != base


@pytest.mark.parametrize(
    "request_, field",
    [
        ({"audio_uri": "not a uri"}, "audio_uri"),
        ({"audio_uri": "file:///a", "two_stems": "guitar"}, "two_stems"),
        ({"audio_uri": "file:///a", "other_method": "minus"}, "other_method"),
        ({"audio_uri": "file:///a", "segment": 9.0}, "segment"),
        ({"audio_uri": "file:///a", "overlap": 1.0}, "overlap"),
        ({"audio_uri": "file:///a", "shifts": 99}, "shifts"),
        ({"audio_uri": "file:///a", "output_format": "flac", "encoding": "f32"}, "encoding"),
        ({"audio_uri": "file:///a", "mp3_bitrate": 192}, "mp3_bitrate"),
    ],
)
def test_invalid_requests_name_the_field(request_: stemq.JobRequest, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        stemq.normalize(request_, "o")


def test_owner_tokens() -> None:
    assert stemq.owner_token("anonymous") == "anonymous"
    assert stemq.owner_token("acme-2_x=") == "acme-2_x="
    for odd in ["a b/c", "acme.eu", "a*", "a>", "", "h-plain", "x" * 65]:
        token = stemq.owner_token(odd)
        assert token.startswith("h-") and len(token) == 66, (odd, token)
    assert stemq.view_key("abc", "a.b") == stemq.owner_token("a.b") + ".abc"
    assert stemq.view_key("abc") == "abc"


def test_jcs_numbers_strings_and_key_order() -> None:
    values = [0, -0.0, 1, -1, 5.0, 0.25, 0.1, 1e21, 1e-7, 123456789012345680000.0, 1.5e300, -2.5e-300, 1e-6]
    assert canonical_json(values) == (
        b"[0,0,1,-1,5,0.25,0.1,1e+21,1e-7,123456789012345680000,1.5e+300,-2.5e-300,0.000001]"
    )
    doc = {"\ufb01": 1, "\U0001f600": 2, "é": 3, "e": 4, "E": 5, "": 6, "\ue000": 8, "s": 'a"b\\c/\x01\n\u2028'}
    assert canonical_json(doc).decode() == (
        '{"":6,"E":5,"e":4,"s":"a\\"b\\\\c/\\u0001\\n\u2028","é":3,"\U0001f600":2,"\ue000":8,"\ufb01":1}'
    )


def test_credentials_files(tmp_path: Path) -> None:
    creds = tmp_path / "publisher-local.nk"
    creds.write_text("# stemq NATS user publisher-local\n# inbox_prefix: _INBOX_publisher-local\nSUAAAA\n")
    assert stemq.read_credentials(creds) == ("SUAAAA", "_INBOX_publisher-local")
    creds.write_text("SUAAAA\n")
    with pytest.raises(ValueError):
        stemq.read_credentials(creds)


def test_a_signed_webhook_verifies_and_a_tampered_one_does_not() -> None:
    secret = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
    body = json.dumps({"type": "io.stemq.job.succeeded.v1", "timestamp": "t", "data": {"job_id": "x"}})
    now = int(time.time())
    from datetime import datetime, timezone

    sig = Webhook(secret).sign("msg_1", datetime.fromtimestamp(now, tz=timezone.utc), body)
    headers = {"Webhook-Id": "msg_1", "Webhook-Timestamp": str(now), "Webhook-Signature": sig}
    event = stemq.verify_webhook(secret, body.encode(), headers)
    assert event["type"] == "io.stemq.job.succeeded.v1" and event["data"]["job_id"] == "x"
    for bad_body, bad_headers in [
        (body.encode() + b" ", headers),
        (body.encode(), {**headers, "Webhook-Signature": "v1,AAAA"}),
        (body.encode(), {**headers, "Webhook-Timestamp": str(now - 3600)}),
        (body.encode(), {k: v for k, v in headers.items() if k != "Webhook-Signature"}),
        (b"\xff" + body.encode(), headers),
    ]:
        with pytest.raises(stemq.WebhookVerificationError):
            stemq.verify_webhook(secret, bad_body, bad_headers)


def test_the_answers_are_typed_by_the_generated_models() -> None:
    from stemq import models

    assert stemq.SubmitResponse is models.submit_response.SubmitResponse
    assert stemq.JobUrls is models.submit_response.JobUrls
    assert stemq.SubmitAccepted is models.submit_reply.Accepted
    assert stemq.Upload is models.upload_response.UploadResponse
    assert stemq.WebhookPayload is models.webhook_job.WebhookBodyOfJobView
    assert stemq.BatchWebhookPayload is models.webhook_batch.WebhookBodyOfBatchView
    # What mypy checks: documents as the server writes them fit the generated types.
    urls: stemq.JobUrls = {"get": "http://h/v1/separations/a", "cancel": "http://h/c", "events": "http://h/e"}
    answer: stemq.SubmitResponse = {"job_id": "a" * 64, "status": "queued", "cached": False, "status_url": "/v1/separations/a", "urls": urls}
    accepted: stemq.SubmitAccepted = {**answer, "urls": None, "http_status": 202}
    refused: stemq.SubmitReply = {
        "error": {"code": "rate_limited", "message": "slow down"},
        "http_status": 429,
        "retry_after": 3,
    }
    upload: stemq.Upload = {"audio_uri": "upload:" + "b" * 64 + ".wav", "bytes": 44, "sha256": "b" * 64, "duration_ms": None}
    view: stemq.JobView = {"job_id": "a" * 64, "status": "queued", "attempt": 0, "retries": 0, "last_seq": 1, "updated_at": "t"}
    payload: stemq.WebhookPayload = {"type": "io.stemq.job.succeeded.v1", "timestamp": "t", "data": view}
    assert accepted["http_status"] == 202 and refused["http_status"] == 429 and upload["bytes"] == 44
    assert payload["data"]["status"] == "queued"


def test_a_batch_webhook_verifies_and_reads_as_its_type() -> None:
    secret = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
    batch: stemq.BatchView = {
        "batch_id": "c" * 64,
        "owner": "acme",
        "status": "ended",
        "counts": {
            "items": 1, "submitted": 1, "refused": 0, "not_submitted": 0, "queued": 0, "running": 0,
            "succeeded": 1, "failed": 0, "dead_lettered": 0, "rejected": 0, "cancelled": 0, "expired": 0,
        },
        "created_at": "t",
        "updated_at": "t",
        "rounds": 1,
        "items": [{"index": 0, "state": "submitted", "job_id": "a" * 64, "status": "succeeded"}],
    }
    body = json.dumps({"type": "io.stemq.batch.ended.v1", "timestamp": "t", "data": batch})
    from datetime import datetime, timezone

    now = int(time.time())
    sig = Webhook(secret).sign("msg_2", datetime.fromtimestamp(now, tz=timezone.utc), body)
    event = stemq.verify_webhook(secret, body, {"webhook-id": "msg_2", "webhook-timestamp": str(now), "webhook-signature": sig})
    assert event["type"] == "io.stemq.batch.ended.v1"
    ended = cast(stemq.BatchWebhookPayload, event)
    assert ended["data"]["batch_id"] == "c" * 64 and ended["data"]["items"][0]["state"] == "submitted"
