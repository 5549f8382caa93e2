"""Admin API for the tuner: GET/PATCH /admin/config, bearer token from the file SPECFLEET_ADMIN_TOKEN_FILE
names (pods: the mounted admin Secret) or else from SPECFLEET_ADMIN_TOKEN (`specfleet up`).

No token configured: 403 (the admin API is off). Missing or wrong token: 401. A value outside the
ceilings fixed at start: 400 naming the field and the limit. The response is the config now in force
(applied by the engine at its next step).

`--live-config-file` (`live_config_from_file`) is the same body as a file, read once at start: the
values a new pod should start on (in the cluster the operator's `NAME-tuned` ConfigMap, mounted; in
`specfleet up` a file the fleet writes), checked as a PATCH is, so a bad value stops the start with the
field and the limit named instead of being served.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from specfleet.engine.config import EngineConfig, start_on
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


def live_config_from_file(config: EngineConfig, path: str | Path) -> EngineConfig:
    """`config` starting on the live values in the JSON file `path` (the body of `PATCH /admin/config`),
    checked as the admin API checks a PATCH: the knobs' types and minimums (`AdminConfigPatch`), then the
    ceilings fixed at start (`config.check_live`). A missing file leaves `config` as the flags made
    it (a service not tuned yet). Raises ValueError naming the file, the field and the limit."""
    where = f"--live-config-file {path}"
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        logger.info("event=live_config_file_absent path=%s start=flags", path)
        return config
    except OSError as exc:
        raise ValueError(f"{where} cannot be read ({exc.strerror})") from None
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where} is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError(f'{where} must hold a JSON object of live knobs, e.g. {{"max_num_seqs": 32}}')
    try:
        changes = AdminConfigPatch.model_validate(body).changes()
        live = start_on(config, changes)
    except ValidationError as exc:
        raise ValueError(f"{where}: {'; '.join(map(_problem, exc.errors()))}") from None
    except ParameterError as exc:
        raise ValueError(f"{where}: {exc}") from None
    logger.info(
        "event=live_config_file_applied path=%s %s", path, " ".join(f"{k}={v}" for k, v in changes.items())
    )
    return live


def _problem(error: Any) -> str:
    """One pydantic error as `field=value: why` (the why names the limit: `greater than or equal to 1`)."""
    why = str(error["msg"]).removeprefix("Value error, ")
    field = ".".join(map(str, error["loc"]))
    if error.get("type") == "extra_forbidden":
        return f"{field} is not a live knob; use one of {[k.name for k in KNOBS]}"
    return f"{field}={error.get('input')!r}: {why}" if field else why


def authorize(state: ServerState, request: Request) -> None:
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
    authorize(state, request)
    return await _config(state)


@router.patch("/config")
async def patch_config(body: AdminConfigPatch, request: Request) -> dict[str, Any]:
    state = get_state(request)
    authorize(state, request)
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
