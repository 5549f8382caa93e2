"""The Secrets the operator generates: the admin token the tuner authenticates to the engines'
/admin/config with, and (spec.disaggregation behind routing.mode endpoint-picker) the key the endpoint
picker signs the prefill engine it names with (engine/kv_transfer/prefill_signature.py).

Each is generated once, when the Secret does not exist yet, and never rotated by the reconcile: the Secret
is immutable, and rendering takes the value as an argument so that this stays pure.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from ..inference_service import InferenceService
from ..resources import ADMIN_TOKEN_KEY, PREFILL_KEY_KEY, admin_secret_name, prefill_key_secret_name
from .common import child_metadata


def new_admin_token() -> str:
    return secrets.token_urlsafe(32)


def render_secret(isvc: InferenceService, token: str) -> dict[str, Any]:
    if len(token) < 16:
        raise ValueError(f"admin token of {len(token)} characters is too short; use new_admin_token()")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(isvc, admin_secret_name(isvc.name)),
        "type": "Opaque",
        "immutable": True,
        "data": {ADMIN_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def render_prefill_key_secret(isvc: InferenceService, key: str) -> dict[str, Any]:
    """`NAME-pd-key`: the endpoint picker's and the decode engines' shared key (a new_admin_token(): 32
    random bytes, URL-safe base64), mounted by the router and decode pods only."""
    if len(key) < 16:
        raise ValueError(f"prefill signing key of {len(key)} characters is too short; use new_admin_token()")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(isvc, prefill_key_secret_name(isvc.name)),
        "type": "Opaque",
        "immutable": True,
        "data": {PREFILL_KEY_KEY: base64.b64encode(key.encode()).decode()},
    }


def read_admin_token(secret: dict[str, Any]) -> str:
    return base64.b64decode(secret["data"][ADMIN_TOKEN_KEY]).decode()
