"""The endpoint picker's signature over the prefill engine it names, so that a decode engine runs a prefill
leg only on a host the picker chose (engine/server/remote_prefill.py), never on one a client wrote.

The picker (router/endpoint_picker.py) and the decode engines share a key (`--remote-prefill-key-file`, the
operator's Secret `NAME-pd-key`, a temporary file under `specfleet up`). With the request's
`x-prefiller-host-port` the picker sends `x-specfleet-prefill-signature: v1:<unix seconds>:<hex>`, the hex
being HMAC-SHA256 under the key over

    specfleet-prefill-signature/v1 \\n <unix seconds> \\n <the header's host:port> \\n <SHA-256 hex of the body>

The body is the request's as the picker read it and the gateway sends it on (the picker passes it back
unchanged), so a signature names one request's prompt and one prefill engine: a client that copies a signed
pair can replay only that same request to that same prefill engine, and only within MAX_AGE_S of the
signing. The decode engine recomputes the MAC from what it received and compares in constant time.

Plain Python (hmac, hashlib): the router, which runs without the engine's dependencies, imports it.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from pathlib import Path

HEADER = "x-specfleet-prefill-signature"
KEY_FILE_FLAG = "--remote-prefill-key-file"
VERSION = "v1"
_DOMAIN = b"specfleet-prefill-signature/" + VERSION.encode()
# How old (or, by clock skew, how far ahead) a signature may be: the picker signs as the body's last chunk
# passes and the gateway sends the request on within milliseconds; NTP keeps pods' clocks within a second.
# 30 s covers a slow gateway and a skewed node, and bounds how long a copied signature can be replayed.
MAX_AGE_S = 30
# 16 bytes (128 bits) is HMAC-SHA256's floor for a key that cannot be guessed; the operator's and the local
# fleet's are 32 random bytes, URL-safe base64 (43 characters).
MIN_KEY_BYTES = 16
# Why a decode engine ignored a signature (its metric's `reason` label).
REASONS = ("missing", "malformed", "stale", "mismatch")


class Rejected(Exception):
    """A signature that does not let the header through; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def read_key(path: str | Path) -> bytes:
    """The key in `path` (surrounding whitespace dropped, as a mounted Secret or `echo` leaves a newline);
    a ValueError naming the flag, the file and what is wrong with it."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as error:
        raise ValueError(f"{KEY_FILE_FLAG} {path}: cannot read the key: {error.strerror or error}") from None
    if not key:
        raise ValueError(f"{KEY_FILE_FLAG} {path}: the file is empty; it must hold the shared key")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"{KEY_FILE_FLAG} {path}: the key has {len(key)} bytes, fewer than {MIN_KEY_BYTES}; use a random "
            "key of at least 16 bytes (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return key


def _mac(key: bytes, timestamp: int, prefiller: str, body: bytes) -> str:
    digest = hashlib.sha256(body).hexdigest()
    message = b"\n".join((_DOMAIN, str(timestamp).encode(), prefiller.encode(), digest.encode()))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(key: bytes, prefiller: str, body: bytes, now: float | None = None) -> str:
    """The header's value for a request whose body is `body`, naming `prefiller` (`host:port`)."""
    timestamp = int(time.time() if now is None else now)
    return f"{VERSION}:{timestamp}:{_mac(key, timestamp, prefiller, body)}"


def verify(
    key: bytes,
    value: str | None,
    prefiller: str,
    body: bytes,
    now: float | None = None,
    max_age_s: float = MAX_AGE_S,
) -> None:
    """Return if `value` signs `prefiller` and `body` under `key` within `max_age_s` of `now`; raise
    Rejected otherwise (the comparison of the MACs is constant-time)."""
    if value is None:
        raise Rejected("missing", f"no {HEADER} header")
    version, _, rest = value.strip().partition(":")
    stamp, _, mac = rest.partition(":")
    if version != VERSION or not stamp.isdigit() or len(stamp) > 12 or not mac.isascii():
        raise Rejected("malformed", f"{HEADER} must be {VERSION}:<unix seconds>:<hex HMAC-SHA256>")
    age = (time.time() if now is None else now) - int(stamp)
    if abs(age) > max_age_s:
        raise Rejected(
            "stale", f"{HEADER} is {age:.0f} s old (negative: ahead of this clock), beyond {max_age_s:g} s"
        )
    if not hmac.compare_digest(mac.encode(), _mac(key, int(stamp), prefiller, body).encode()):
        raise Rejected("mismatch", f"{HEADER} does not sign this prefill engine and request body")
