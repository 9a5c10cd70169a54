"""A foreign service talking to stemq through its public contracts only.

It publishes a `JobRequested` CloudEvent straight to the JetStream log (no HTTP
ingress) as the NATS user `publisher-<owner token>` (it may publish requests for its
owner only), reads the job's status from the `stemq_jobs` KV bucket and follows
the entry to the end as `status-reader` (a get and a plain subscription: no consumer), and receives the signed webhook and verifies it
with the `standardwebhooks` package. Run by tests/tests/python.rs; configured by
environment variables:

  NATS_URL                  the NATS server
  STEMQ_PUBLISHER_CREDS     credentials file of the publisher (stemq's format: the
                            nkey seed line and `# inbox_prefix:` comment)
  STEMQ_STATUS_READER_CREDS credentials file of the status reader
  STEMQ_HTTP                the ingress base URL (only to read the webhook signing secret)
  STEMQ_API_KEY             an admin API key of the owner (for that secret)
  STEMQ_OWNER               the owner of the job (the key's and the publisher's owner)
  STEMQ_OWNER_TOKEN         that owner as a subject token (stemq_core::request::owner_token)
  STEMQ_AUDIO_URI           an audio URI inside the store the workers read
"""

import asyncio
import datetime
import hashlib
import http.server
import json
import os
import sys
import threading
import urllib.request

import nats
import nats.errors
from nats.js.errors import KeyNotFoundError
from standardwebhooks.webhooks import Webhook

TERMINAL = {"succeeded", "failed", "dead_lettered", "rejected", "cancelled", "expired"}


class Hooks(http.server.BaseHTTPRequestHandler):
    received = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        Hooks.received.append((dict(self.headers.items()), body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def credentials(path):
    """The nkey seed and inbox prefix of a stemq credentials file."""
    seed, inbox = None, None
    for line in open(path, encoding="ascii").read().splitlines():
        line = line.strip()
        if line.startswith("# inbox_prefix:"):
            inbox = line.split(":", 1)[1].strip()
        elif line.startswith("SU"):
            seed = line
    assert seed and inbox, f"{path} is not a stemq credentials file"
    return seed, inbox


async def connect_as(env):
    seed, inbox = credentials(os.environ[env])
    return await nats.connect(os.environ["NATS_URL"], nkeys_seed_str=seed, inbox_prefix=inbox)


def canonical(obj):
    """RFC 8785 (JCS) for the values a request holds: sorted keys, no spaces."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


async def main():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hooks)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hook_url = f"http://127.0.0.1:{server.server_address[1]}/stemq"

    request = {
        "audio_uri": os.environ["STEMQ_AUDIO_URI"],
        "model": "dsp",
        "output_format": "wav",
        "encoding": "s16",
        "clip_mode": "rescale",
        "overlap": 0.25,
        "shifts": 0,
        "owner": os.environ["STEMQ_OWNER"],
    }
    job_id = hashlib.sha256(canonical(request)).hexdigest()
    event = {
        "specversion": "1.0",
        "id": job_id,
        "source": "/python/foreign-service",
        "subject": job_id,
        "type": "io.stemq.job.requested.v1",
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "datacontenttype": "application/json",
        "data": {
            "request": request,
            "webhook": {"url": hook_url, "events": ["completed"]},
            "metadata": {"from": "python", "fake": {"sleep_ms": 300}},
        },
    }

    # Another owner's subject is refused by the server: the publish is never acked.
    nc = await connect_as("STEMQ_PUBLISHER_CREDS")
    js = nc.jetstream()
    try:
        await js.publish(f"stemq.jobs.{job_id}.requested.someone-else", b"{}", timeout=1)
        raise AssertionError("a publish for another owner was accepted")
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        print("publish for another owner refused", flush=True)
    # The request's subject ends with its owner's token: the only one it may publish on.
    ack = await js.publish(
        f"stemq.jobs.{job_id}.requested.{os.environ['STEMQ_OWNER_TOKEN']}",
        json.dumps(event).encode(),
        headers={
            "Nats-Msg-Id": job_id,
            "Nats-Expected-Last-Subject-Sequence": "0",
            "Content-Type": "application/cloudevents+json",
        },
    )
    print(f"published {job_id} at seq {ack.seq}", flush=True)

    reader = await connect_as("STEMQ_STATUS_READER_CREDS")
    kv = await reader.jetstream().key_value("stemq_jobs")
    # Follow the key by a plain subscription to its put subject (the status reader may
    # create no consumer, so no KV watch), then read it once: an update between the two
    # still arrives on the subscription.
    # A view's key is the owner's token and the job id.
    key = f"{os.environ['STEMQ_OWNER_TOKEN']}.{job_id}"
    updates = await reader.subscribe(f"$KV.stemq_jobs.{key}")
    await reader.flush()
    seen = []
    view = None
    try:
        entry = await kv.get(key)
        view = json.loads(entry.value)
        seen.append(view["status"])
        print("status now:", view["status"], flush=True)
    except KeyNotFoundError:
        print("not projected yet", flush=True)
    async def follow():
        nonlocal view
        while view is None or view["status"] not in TERMINAL:
            msg = await updates.next_msg(timeout=30)
            if not msg.data:
                continue
            view = json.loads(msg.data)
            seen.append(view["status"])
    await asyncio.wait_for(follow(), timeout=30)
    await updates.unsubscribe()
    print("statuses seen:", seen, flush=True)
    assert view["status"] == "succeeded", view
    assert view["job_id"] == job_id
    assert view["metadata"]["from"] == "python"

    # The signed webhook.
    base = os.environ["STEMQ_HTTP"].rstrip("/")
    req = urllib.request.Request(
        f"{base}/v1/webhooks/secret", headers={"Authorization": "Bearer " + os.environ["STEMQ_API_KEY"]}
    )
    secret = json.load(urllib.request.urlopen(req))["secret"]
    for _ in range(300):
        if Hooks.received:
            break
        await asyncio.sleep(0.1)
    assert Hooks.received, "no webhook within 30 s"
    headers, body = Hooks.received[0]
    headers = {k.lower(): v for k, v in headers.items()}
    payload = Webhook(secret).verify(body, headers)
    assert payload["type"] == "io.stemq.job.succeeded.v1", payload
    assert payload["data"]["job_id"] == job_id
    assert payload["data"]["status"] == "succeeded"
    try:
        Webhook(secret).verify(body + b" ", headers)
        raise AssertionError("a tampered body verified")
    except AssertionError:
        raise
    except Exception:
        pass
    await nc.close()
    await reader.close()
    server.shutdown()
    print("OK", flush=True)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except Exception as e:  # a readable failure for the Rust test's output
        print(f"FAILED: {e!r}", file=sys.stderr)
        raise
