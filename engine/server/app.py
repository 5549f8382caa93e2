"""The FastAPI application: OpenAI routes, admin API, health, readiness, metrics, error bodies."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from specfleet.engine.core.client import EngineCoreClient

from . import admin, api, embeddings, lora_api, tokens_api
from .chat import ChatOptions
from .errors import error_response, install_error_handlers
from .lora_metrics import LoraMetrics
from .metrics import CONTENT_TYPE, ServerMetrics
from .pooler import PoolerConfig
from .protocol_metrics import ProtocolMetrics
from .remote_prefill import RemotePrefill
from .request_ids import RequestIdHeader
from .state import ServerState, get_state
from .tracing import RequestTracer

logger = logging.getLogger("specfleet.engine.server")


def build_state(
    client: EngineCoreClient,
    *,
    served_model_name: str | None = None,
    max_waiting: int = 512,
    admin_token: str | None = None,
    admin_port: int | None = None,
    chat: ChatOptions | None = None,
    pooler: PoolerConfig | None = None,
    otlp_traces_endpoint: str | None = None,
    remote_prefill: RemotePrefill | None = None,
) -> ServerState:
    """The routes' state around a started engine core; with `otlp_traces_endpoint` (engine/tracing.py's
    `traces_endpoint`), every request's span tree goes there (engine/server/tracing.py); with
    `remote_prefill` (`--accept-remote-prefill`, a decode engine), a request's `x-prefiller-host-port` runs its
    prefill on that engine (engine/server/remote_prefill.py)."""
    info = client.info
    model_name = served_model_name or info.model_name
    metrics = ServerMetrics(model_name)
    protocol = metrics.protocol = ProtocolMetrics(metrics.registry, model_name)
    protocol.set_cache_config(info.kv_block_size, info.num_kv_blocks, info.enable_prefix_caching)
    token = admin_token if admin_token is not None else admin.token_from_env()
    client.metrics, client.max_waiting = metrics, max_waiting
    if remote_prefill is not None:  # its rejected signatures, counted beside the server's own series
        remote_prefill.register_metrics(metrics.registry, model_name)
    if otlp_traces_endpoint:
        client.tracer = RequestTracer.from_endpoint(otlp_traces_endpoint, model_name, client.config.kv_role)
    return ServerState(
        async_engine=client,
        metrics=metrics,
        model_name=model_name,
        max_model_len=int(info.max_model_len),
        tokenizer=info.tokenizer,
        vocab_size=len(info.tokenizer),
        admin_token=token,
        admin_port=admin_port,
        chat=chat or ChatOptions(),
        pooler=pooler or PoolerConfig(),
        scheduling_policy=client.config.scheduling_policy,
        remote_prefill=remote_prefill,
    )


class AdminPortSplit:
    """With `--admin-port`, one server listens on two ports and this keeps them apart: `/admin/...` only on
    the admin port (which the InferenceService's Service does not expose), everything else only on the
    API port. Plain ASGI, so streamed responses pass through untouched."""

    def __init__(self, app: Any, admin_port: int) -> None:
        self.app = app
        self.admin_port = admin_port

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            on_admin_port = (scope.get("server") or (None, None))[1] == self.admin_port
            admin_path = scope["path"].startswith("/admin") or scope["path"] in lora_api.PATHS
            if admin_path != on_admin_port:
                where = "the API port" if on_admin_port else f"the admin port {self.admin_port}"
                response = error_response(404, f"{scope['path']} is served on {where}", code="wrong_port")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: ServerState, lora_modules: dict[str, str] | None = None) -> FastAPI:
    """An app around a started engine core: its reader starts with the app; the core stops with it.
    `lora_modules` (name -> path, `--lora-modules`) are loaded before the app reports ready."""
    lora_modules = lora_modules or {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.async_engine.start(asyncio.get_running_loop())
        for name, path in lora_modules.items():  # --lora-modules: served from the start, or no start
            await lora_api.load(state, name, path)
        state.ready = True
        logger.info("event=ready model=%s max_model_len=%d", state.model_name, state.max_model_len)
        try:
            yield
        finally:
            state.ready = False
            state.async_engine.abort_all()
            state.async_engine.stop()
            if state.async_engine.tracer is not None:  # the spans of the last requests leave now
                state.async_engine.tracer.shutdown()
            if state.remote_prefill is not None:  # its connections to the prefill engines
                await state.remote_prefill.aclose()

    app = FastAPI(
        title="specfleet engine",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible completions and chat completions, metrics and admin API.",
        # A path with a trailing slash is a 404, not Starlette's 307 to the slashless path: behind the router
        # that redirect names the engine's own address, which a client then calls past the gateway (its
        # keys and quotas) or, outside the cluster, cannot reach
        redirect_slashes=False,
    )
    app.state.specfleet = state
    install_error_handlers(app)
    if state.admin_port is not None:
        app.add_middleware(AdminPortSplit, admin_port=state.admin_port)
    app.add_middleware(RequestIdHeader)
    app.include_router(api.router)
    app.include_router(tokens_api.router)
    app.include_router(embeddings.router)
    app.include_router(admin.router)
    app.include_router(lora_api.router)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        s = get_state(request)
        alive = s.async_engine.alive
        if s.ready and not (s.stopping or s.draining) and alive:
            return JSONResponse({"ready": True, "model": s.model_name})
        reason = "engine_core_dead" if not alive else "draining" if s.stopping or s.draining else "loading"
        return JSONResponse({"ready": False, "reason": reason}, status_code=503, headers={"Retry-After": "5"})

    lora = (
        LoraMetrics(state.metrics.registry, state.model_name, state.async_engine.config.max_loras)
        if state.async_engine.config.enable_lora
        else None
    )
    if lora is not None:
        state.metrics.on_lora_request = lora.observe_request

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        s = get_state(request)
        if lora is not None and s.async_engine.dead is None:
            lora.update(await s.async_engine.call("lora_state"))
        return Response(s.metrics.render(), media_type=CONTENT_TYPE)

    return app
