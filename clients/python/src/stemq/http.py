"""The HTTP API (docs/api.md) with httpx: submit, read a job, upload a song, the
webhook signing secret."""

from __future__ import annotations

import json
from types import TracebackType
from typing import Any, cast

import httpx

from .errors import StemqError
from .models import JobRequest, JobView
from .types import SubmitResponse, Upload

__all__ = ["HttpClient"]


class HttpClient:
    """An API key's view of one stemq ingress.

    >>> async with HttpClient("http://127.0.0.1:8080", api_key) as api:
    ...     job = await api.submit({"audio_uri": upload["audio_uri"], "model": "dsp"})
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 30.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._own = client is None
        self._http = client or httpx.AsyncClient(timeout=timeout)
        self._auth = {"Authorization": f"Bearer {api_key}"}

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own:
            await self._http.aclose()

    async def submit(self, request: JobRequest) -> SubmitResponse:
        """`POST /v1/separations`: 202 for a new job, 200 (`cached`) for one that exists."""
        return cast(SubmitResponse, await self._call("POST", "/v1/separations", json=request))

    async def get(self, job_id: str, *, wait_s: int | None = None) -> JobView:
        """`GET /v1/separations/{id}`; with `wait_s`, held until the job ends or that
        many seconds pass (`Prefer: wait`, at most 60)."""
        headers = {"Prefer": f"wait={wait_s}"} if wait_s else {}
        timeout = httpx.Timeout((self._http.timeout.read or 30.0) + (wait_s or 0))
        return cast(JobView, await self._call("GET", f"/v1/separations/{job_id}", headers=headers, timeout=timeout))

    async def upload(self, data: bytes, filename: str) -> Upload:
        """`POST /v1/uploads?filename=...`: the song into the store; its `audio_uri`
        (`upload:<sha256>.<ext>`) is what a submit takes."""
        return cast(Upload, await self._call("POST", "/v1/uploads", params={"filename": filename}, content=data))

    async def webhook_secret(self) -> str:
        """The owner's webhook signing secret (`whsec_...`), for `verify_webhook`."""
        return str((await self._call("GET", "/v1/webhooks/secret"))["secret"])

    async def _call(self, method: str, path: str, *, headers: dict[str, str] | None = None, **kw: Any) -> Any:
        r = await self._http.request(method, self.base_url + path, headers={**self._auth, **(headers or {})}, **kw)
        try:
            body = r.json()
        except json.JSONDecodeError:
            body = r.text
        if r.is_error:
            retry = r.headers.get("Retry-After")
            raise StemqError.from_body(r.status_code, body, float(retry) if retry and retry.isdigit() else None)
        return body
