"""One OpenAI endpoint in front of the local fleet: least outstanding requests, streaming passthrough.

Every `/v1/...` request goes to the ready engine with the fewest requests in flight through this proxy
(ties: the first). Bodies and Server-Sent Events pass through unchanged, so any OpenAI client works.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from . import disaggregation

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host",
               "content-length", "proxy-authorization", "proxy-authenticate"}


@dataclass
class Backends:
    """The engines behind the endpoint; the fleet marks them ready or not."""

    urls: list[str]
    ready: set[str] = field(default_factory=set)
    outstanding: dict[str, int] = field(default_factory=dict)
    draining: bool = False

    def pick(self) -> str | None:
        live = [u for u in self.urls if u in self.ready]
        if not live:
            return None
        return min(live, key=lambda u: self.outstanding.get(u, 0))


def _error(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": None}}
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return JSONResponse(body, status_code=status, headers=headers)


def create_proxy(backends: Backends, timeout_s: float = 600.0,
                 roles: disaggregation.Roles | None = None) -> FastAPI:
    """`roles`: prefill engines for disaggregation (fleet/disaggregation.py); `backends` are then the
    decode engines."""
    app = FastAPI(title="specfleet local fleet", docs_url=None, redoc_url=None, openapi_url=None)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0), limits=httpx.Limits(
        max_connections=512, max_keepalive_connections=64))

    @app.on_event("shutdown")
    async def _close() -> None:
        await client.aclose()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        if backends.draining or not backends.ready:
            return _error(503, "no engine is ready" if not backends.draining else "the fleet is stopping", 1)
        return JSONResponse({"status": "ready", "engines": len(backends.ready)})

    @app.api_route("/v1/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        if backends.draining:
            return _error(503, "the local fleet is stopping; retry against another endpoint", 5)
        url = backends.pick()
        if url is None:
            return _error(503, "no engine is ready yet; retry shortly", 1)
        backends.outstanding[url] = backends.outstanding.get(url, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                backends.outstanding[url] -= 1

        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        content, held = await request.body(), None
        if roles is not None and request.method == "POST" and path in disaggregation.GENERATE_PATHS:
            try:
                body = json.loads(content)
            except ValueError:
                body = None  # the engine answers with the proper 400
            if isinstance(body, dict) and disaggregation.covered(body):
                held, refusal = await disaggregation.prefill(client, roles, path, body, headers)
                if refusal is not None:
                    release()
                    return Response(refusal.content, status_code=refusal.status_code,
                                    media_type=refusal.headers.get("content-type"))
                if held is not None and await request.is_disconnected():
                    release()
                    disaggregation.release(held)
                    return _error(499, "client disconnected")
                if held is not None:
                    content = disaggregation.decode_body(body, held)
                    headers.pop("content-type", None)
                    headers["content-type"] = "application/json"
        upstream = client.build_request(request.method, f"{url}/v1/{path}", params=request.query_params,
                                        headers=headers, content=content)
        try:
            response = await client.send(upstream, stream=True)
        except httpx.HTTPError as error:
            release()
            if held is not None:
                disaggregation.release(held)
            return _error(502, f"engine {url} failed: {type(error).__name__}: {error}", 1)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            except (httpx.HTTPError, asyncio.CancelledError):
                return
            finally:
                release()

        async def close() -> None:
            await response.aclose()
            release()

        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(body(), status_code=response.status_code, headers=out_headers,
                                 background=BackgroundTask(close))

    return app
