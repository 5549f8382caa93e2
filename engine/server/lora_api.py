"""LoRA adapters at run time, as vLLM spells it: `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
`POST /v1/unload_lora_adapter {"lora_name"}`. Admin routes: the admin token guards them and, with
`--admin-port`, they are served on the admin port only (app.AdminPortSplit).

The engine core reads and checks the adapter between two steps (its streams pause for that read only, a
few milliseconds at rank 16 on the bundled model); a bad adapter is a 400 naming what is wrong. Unloading
refuses new requests for the name at once, while the requests in flight finish on the weights they started
with. `--lora-modules` loads the same way when the server starts (`load_static`).
"""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict
from specfleet.engine.sampling_params import ParameterError

from .admin import authorize
from .errors import APIError
from .state import ServerState, get_state

logger = logging.getLogger("specfleet.engine.server")
router = APIRouter()
PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # admin routes outside /admin (vLLM's paths)


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


def parse_lora_modules(values: list[str], base_model_name: str) -> dict[str, str]:
    """`--lora-modules` values, `name=path` or vLLM's JSON `{"name", "path", "base_model_name"}`: name -> path.
    Raises ValueError naming the value that is wrong."""
    modules: dict[str, str] = {}
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"--lora-modules {value!r} is not valid JSON: {exc}") from None
            if not isinstance(spec, dict) or not {"name", "path"} <= set(spec):
                raise ValueError(f"--lora-modules {value!r} needs 'name' and 'path'")
            base = spec.get("base_model_name")
            if base is not None and base != base_model_name:
                raise ValueError(
                    f"--lora-modules {spec['name']!r}: base_model_name={base!r}, this server serves "
                    f"{base_model_name!r}"
                )
            name, path = str(spec["name"]), str(spec["path"])
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r} must be name=path or a JSON object")
        modules[name] = path
    return modules


async def load(state: ServerState, name: str, path: str) -> None:
    if name == state.model_name:  # the served name (--served-model-name); the core checks its own
        raise APIError(
            400, f"lora_name={name!r} shadows the served model's name; pick another name", "lora_name"
        )
    try:
        digest = await state.async_engine.call("load_lora_adapter", lora_name=name, lora_path=path)
    except ParameterError as exc:
        raise APIError(400, str(exc), exc.param, exc.code) from exc
    state.lora_adapters[name] = path
    logger.info("event=lora_adapter_loaded name=%s path=%s digest=%s", name, path, digest)


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapter, request: Request) -> str:
    state = get_state(request)
    authorize(state, request)
    await load(state, body.lora_name, body.lora_path)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapter, request: Request) -> str:
    state = get_state(request)
    authorize(state, request)
    try:
        await state.async_engine.call("unload_lora_adapter", lora_name=body.lora_name)
    except ParameterError as exc:
        raise APIError(400, str(exc), exc.param, exc.code) from exc
    state.lora_adapters.pop(body.lora_name, None)
    logger.info("event=lora_adapter_unloaded name=%s", body.lora_name)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
