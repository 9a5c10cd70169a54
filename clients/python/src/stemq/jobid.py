"""A job's identity, computed as stemq computes it (`docs/job-id.md`).

The job id is the lowercase hex SHA-256 of the RFC 8785 (JCS) canonical JSON of the
*normalised* request: every default filled in, the owner included, and what does not
change the output (webhook, metadata, priority, deadlines) left out. This mirrors
`stemq_core::request::JobRequest::normalize`, `canonical` and `owner_token`; a direct
publish needs it, since the worker re-derives the id and drops a request that does not
hash to it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from decimal import Decimal
from typing import Any, cast

from .models import JobRequest, NormalizedRequest

__all__ = ["canonical_json", "job_id", "normalize", "owner_token"]

_TOKEN = re.compile(r"[A-Za-z0-9_=-]{1,64}")
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:\S+")
_SOURCES = ("drums", "bass", "other", "vocals")
_SOURCES_6S = (*_SOURCES, "guitar", "piano")
_HTDEMUCS = ("htdemucs", "htdemucs_ft", "htdemucs_6s")  # trained on 7.8 s segments
_MAX_SEGMENT = 7.8
_MP3_BITRATES = (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)
_MAX_SHIFTS = 20


def owner_token(owner: str) -> str:
    """The owner as a subject token (`stemq_core::request::owner_token`): the owner
    itself when it is 1 to 64 ASCII letters, digits, `-`, `_` or `=` and does not start
    with `h-`, else `h-` and the hex SHA-256 of its UTF-8 bytes."""
    if _TOKEN.fullmatch(owner) and not owner.startswith("h-"):
        return owner
    return "h-" + hashlib.sha256(owner.encode()).hexdigest()


def normalize(request: JobRequest, owner: str) -> NormalizedRequest:
    """The canonical form of `request` for `owner`, as the ingress writes it.

    Raises `ValueError` naming the field for what the server would refuse (the
    server checks everything again; this catches what would change the id)."""
    uri = request["audio_uri"]
    if not uri or len(uri.encode()) > 2048 or not _URI.fullmatch(uri):
        raise ValueError("audio_uri: not an absolute URI without whitespace")
    if not owner:
        raise ValueError("owner: must not be empty")
    model = request.get("model") or "htdemucs"
    two_stems = request.get("two_stems")
    if two_stems is not None and two_stems not in (_SOURCES_6S if model == "htdemucs_6s" else _SOURCES):
        raise ValueError(f"two_stems: `{two_stems}` is not a source of {model}")
    other_method = request.get("other_method")
    if other_method in (None, "add"):
        other_method = None
    elif two_stems is None:
        raise ValueError("other_method: only applies with `two_stems`")
    segment = request.get("segment")
    if segment is not None:
        if not math.isfinite(segment) or segment <= 0:
            raise ValueError("segment: must be a positive number of seconds")
        if model in _HTDEMUCS:
            if segment > _MAX_SEGMENT:
                raise ValueError(f"segment: longer than {model} was trained on ({_MAX_SEGMENT} s)")
            if segment == _MAX_SEGMENT:
                segment = None  # an explicit default is the default
    overlap = request.get("overlap")
    overlap = 0.25 if overlap is None else overlap
    if not 0.0 <= overlap < 1.0:
        raise ValueError("overlap: must be in [0, 1)")
    output_format = request.get("output_format") or "wav"
    encoding = request.get("encoding") or "s16"
    if encoding == "f32" and output_format == "flac":
        raise ValueError("encoding: FLAC has no float encoding")
    bitrate, preset = request.get("mp3_bitrate"), request.get("mp3_preset")
    if output_format == "mp3":
        if encoding != "s16":
            raise ValueError("encoding: MP3 takes only s16")
        bitrate = 320 if bitrate is None else bitrate
        preset = 2 if preset is None else preset
        if bitrate not in _MP3_BITRATES:
            raise ValueError(f"mp3_bitrate: {bitrate} is not an MP3 bit rate")
        if not 2 <= preset <= 7:
            raise ValueError("mp3_preset: must be 2 to 7")
    else:
        if bitrate not in (None, 320) or preset not in (None, 2):
            raise ValueError("mp3_bitrate/mp3_preset: only apply with `output_format` mp3")
        bitrate = preset = None
    shifts = request.get("shifts")
    shifts = 0 if shifts is None else shifts
    if not 0 <= shifts <= _MAX_SHIFTS:
        raise ValueError(f"shifts: must be 0 to {_MAX_SHIFTS}")
    out: dict[str, Any] = {
        "audio_uri": uri,
        "model": model,
        "output_format": output_format,
        "encoding": encoding,
        "clip_mode": request.get("clip_mode") or "rescale",
        "overlap": overlap,
        "shifts": shifts,
        "owner": owner,
    }
    optional = {
        "two_stems": two_stems,
        "other_method": other_method,
        "mp3_bitrate": bitrate,
        "mp3_preset": preset,
        "segment": segment,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    return cast(NormalizedRequest, out)


def job_id(normalized: NormalizedRequest) -> str:
    """The job id of a normalised request: hex SHA-256 of its canonical JSON."""
    return hashlib.sha256(canonical_json(normalized)).hexdigest()


def canonical_json(value: Any) -> bytes:
    """RFC 8785 (JCS) canonical JSON of a JSON value (dicts, lists, strings, numbers,
    booleans, None)."""
    return "".join(_write(value)).encode()


def _write(value: Any) -> list[str]:
    if value is None or isinstance(value, (bool, str)):
        return [json.dumps(value, ensure_ascii=False)]
    if isinstance(value, (int, float)):
        return [_number(float(value))]
    if isinstance(value, dict):
        parts = ["{"]
        for i, key in enumerate(sorted(value, key=lambda k: k.encode("utf-16-be"))):
            parts += [","] if i else []
            parts += [json.dumps(key, ensure_ascii=False), ":", *_write(value[key])]
        return [*parts, "}"]
    if isinstance(value, (list, tuple)):
        parts = ["["]
        for i, item in enumerate(value):
            parts += [","] if i else []
            parts += _write(item)
        return [*parts, "]"]
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def _number(f: float) -> str:
    """A double as ECMAScript's Number.prototype.toString writes it (JCS 3.2.2.3)."""
    if not math.isfinite(f):
        raise ValueError("JSON has no NaN or infinity")
    if f == 0:
        return "0"
    sign = "-" if f < 0 else ""
    # repr gives the shortest digits that round-trip (as ECMAScript's algorithm does).
    _, ds, exp = Decimal(repr(abs(f))).as_tuple()
    digits = "".join(map(str, ds)).lstrip("0")
    exp = int(exp) + (len(digits) - len(digits.rstrip("0")))
    digits = digits.rstrip("0")
    n = len(digits) + exp  # the decimal point's place after the first digit (ECMAScript's n)
    k = len(digits)
    if k <= n <= 21:
        return sign + digits + "0" * (n - k)
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * -n + digits
    e = n - 1
    mant = digits[0] + ("." + digits[1:] if k > 1 else "")
    return f"{sign}{mant}e{'+' if e > 0 else '-'}{abs(e)}"
