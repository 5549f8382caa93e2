"""Admin API for the tuner: GET/PATCH /admin/config, bearer token from the file SPECFLEET_ADMIN_TOKEN_FILE
names (pods: the mounted admin Secret) or else from SPECFLEET_ADMIN_TOKEN (`specfleet up`).

No token configured: 403 (the admin API is off). Missing or wrong token: 401. A value outside the
ceilings fixed at start: 400 naming the field and the limit. The response is the config now in force
(applied by the engine at its next step).
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from specfleet.engine.knobs import KNOBS
from specfleet.engine.sampling_params import ParameterError

from .errors import APIError
from .protocol import AdminConfigPatch
from .state import ServerState, get_state

ADMIN_TOKEN_ENV = "SPECFLEET_ADMIN_TOKEN"
# A file keeps the token out of the process environment, which child processes inherit and
# /proc/PID/environ, crash reports and `env` dumps show (checkov CKV_K8S_35).
ADMIN_TOKEN_FILE_ENV = "SPECFLEET_ADMIN_TOKEN_FILE"
logger = logging.getLogger("specfleet.engine.server")
router = APIRouter(prefix="/admin")


def token_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """The admin token: the file $SPECFLEET_ADMIN_TOKEN_FILE when set, else $SPECFLEET_ADMIN_TOKEN, else None
    (admin API off). Raises ValueError naming the variable when the file cannot be read or is empty."""
    env = os.environ if env is None else env
    path = env.get(ADMIN_TOKEN_FILE_ENV)
    if not path:
        return env.get(ADMIN_TOKEN_ENV) or None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(
            f"{ADMIN_TOKEN_FILE_ENV}={path!r} cannot be read ({exc.strerror}); "
            "mount the admin Secret there or unset the variable"
        ) from None
    if not token:
        raise ValueError(f"{ADMIN_TOKEN_FILE_ENV}={path!r} is empty; it must hold the admin token")
    return token


def _authorize(state: ServerState, request: Request) -> None:
    if not state.admin_token:
        raise APIError(
            403,
            f"the admin API is disabled: set {ADMIN_TOKEN_FILE_ENV} or {ADMIN_TOKEN_ENV} to enable it",
            code="admin_disabled",
        )
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), state.admin_token.encode()
    ):
        raise APIError(
            401,
            "missing or wrong admin token: send 'Authorization: Bearer <token>'",
            code="invalid_admin_token",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def _config(state: ServerState) -> dict[str, Any]:
    return (await state.async_engine.live_config()).as_dict()


@router.get("/config")
async def get_config(request: Request) -> dict[str, Any]:
    state = get_state(request)
    _authorize(state, request)
    return await _config(state)


@router.patch("/config")
async def patch_config(body: AdminConfigPatch, request: Request) -> dict[str, Any]:
    state = get_state(request)
    _authorize(state, request)
    changes = body.changes()
    before = await _config(state)
    try:
        live = await state.async_engine.update_config(**changes)
    except ParameterError as exc:
        raise APIError(400, str(exc), exc.param, exc.code) from exc
    state.metrics.set_live_config(live)
    after = live.as_dict()
    logger.info(
        "event=admin_config_update %s",
        " ".join(f"{k.name}={before.get(k.name)}->{after[k.name]}" for k in KNOBS if k.name in changes),
    )
    return after
