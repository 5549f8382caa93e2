"""`specfleet router --gateway`: one OpenAI endpoint for many InferenceServices, routed by the body's `model`.

Each service keeps a `Router` of its own (proxy.py: its engines, its policy and prefix index, its retries
and scale-from-zero queue), fed by its own discovery; the gateway only picks the service:

- the request's `model` names a service by its served name (the InferenceService's name) or one of its
  `routing.aliases`; several services sharing a name split its traffic by `routing.weight` (weights.py),
  sticky per session id (the session header, else the body's `user`), preferring services with a ready
  engine;
- an unknown model is a 404 in OpenAI's error shape (`code: model_not_found`) that lists the known ones;
  a body without `model` is a 400 naming the field;
- `GET /v1/models` is the union of every service's names; `GET /v1/models/NAME` one of them;
- every answer a service gave carries `x-specfleet-service: NAMESPACE/NAME`.

Where the services come from is someone else's business: `gateway_discovery.py` in the cluster (the
InferenceServices' list and each one's EndpointSlices), `specfleet up -f a.yaml -f b.yaml` locally (each
local fleet's router as it is).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from .front import Front, FrontRequest, add_response_headers, write_response_headers
from .proxy import MAX_BODY_BYTES, Answer, ClientRequest, Router, serve_behind_front
from .tracing import SERVICE_KEY, RouterTracer
from .weights import Candidate, WeightedSplit

if TYPE_CHECKING:
    from .tenant_gate import TenantGate

logger = logging.getLogger("specfleet.router.gateway")

SERVICE_HEADER = "x-specfleet-service"
_SERVICE_KEY = SERVICE_KEY  # the request's slot for the service that answered (its span reads it too)
# How long the name a service's engines serve (their `/v1/models`) is trusted before it is asked again: a
# model change rolls the engines over minutes, and one GET per service per 30 s costs nothing.
SERVED_NAME_TTL_S = 30.0
# How long one engine's `/v1/models` may take before the next is asked: the request that found the cache
# stale waits for it, and an engine's answer is a lookup in memory; the router's connect timeout is as long.
SERVED_NAME_TIMEOUT_S = 5.0


@dataclass
class Service:
    key: str  # "namespace/name"
    names: tuple[str, ...]  # the served name first, then the aliases
    weight: int
    router: Router
    served: str | None = None  # the name its engines serve, as their /v1/models last said
    served_at: float = 0.0
    # their --scheduling-policy, as the same /v1/models said (None: not said, e.g. no engine answered yet)
    scheduling_policy: str | None = None

    @property
    def takes_priority(self) -> bool:
        """Whether a tenant's `priority` may go to this service's engines: an fcfs engine answers 400 to a
        nonzero one, so it gets none; an engine that did not say is sent it (vLLM's engines do not say)."""
        return self.scheduling_policy != "fcfs"


def _error(status: int, message: str, kind: str, code: str | None, param: str | None = None) -> web.Response:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    headers = {"Retry-After": "1"} if status == 503 else None
    return web.json_response(body, status=status, headers=headers)


class Gateway:
    """The services the gateway may send to, by key; the model table and the weighted split over them."""

    def __init__(
        self, session_header: str | None = "x-session-id", tenants: TenantGate | None = None
    ) -> None:
        self.services: dict[str, Service] = {}
        self.tenants = tenants  # API keys, quotas and priorities (router/tenant_gate.py); None: open to all
        self.session_header = session_header
        self.split = WeightedSplit()
        self.synced = False  # discovery reported at least once
        self._stopping = False
        self._draining = False
        self.started = int(time.time())
        self.tracer: RouterTracer | None = None  # request spans (router/tracing.py), given to every router

    # ---- the set of services (discovery calls these) -------------------------------------------------
    def upsert(self, key: str, names: Iterable[str], weight: int, router: Router) -> Service:
        """Add a service or update its names and weight; a known key keeps its router (its engines, its
        in-flight counts, its prefix index) unless another is given."""
        service = self.services.get(key)
        if service is None or service.router is not router:
            service = Service(key, tuple(names), weight, router)
            router.stopping, router.draining = self._stopping, self._draining
            router.tracer = router.tracer or self.tracer
            self.services[key] = service
        else:
            service.names, service.weight = tuple(names), weight
        return service

    def remove(self, key: str) -> Service | None:
        return self.services.pop(key, None)

    def models(self) -> dict[str, list[Service]]:
        """Model name -> the services that serve it, by key."""
        table: dict[str, list[Service]] = {}
        for key in sorted(self.services):
            service = self.services[key]
            for name in dict.fromkeys(service.names):
                table.setdefault(name, []).append(service)
        return table

    def pick(self, model: str, services: list[Service], session: str | None) -> Service | None:
        """The service for one request: among those with a ready engine when any has one (a canary whose
        engines are down does not take its share), else among all (their routers queue or answer 503)."""
        ready = [s for s in services if s.router.endpoints.routable()]
        pool = ready if any(s.weight > 0 for s in ready) else services
        key = self.split.pick(model, [Candidate(s.key, s.weight) for s in pool], session)
        return None if key is None else self.services[key]

    # ---- draining (router/shutdown.py drives these as on a Router) ----------------------------------
    @property
    def stopping(self) -> bool:
        return self._stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self._stopping = value
        self._set_on_routers("stopping", value)

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        self._set_on_routers("draining", value)

    def _set_on_routers(self, flag: str, value: bool) -> None:
        for service in self.services.values():
            setattr(service.router, flag, value)

    @property
    def in_flight(self) -> int:
        return sum(s.router.in_flight for s in self.services.values())

    # ---- HTTP ---------------------------------------------------------------------------------------
    def known(self, request: ClientRequest) -> str:
        """The model names the caller may see (with tenants, its tenant's only), for an error's message."""
        names = sorted(self.visible(request))
        return ", ".join(names) if names else "none (no InferenceService discovered yet)"

    def model_not_found(self, request: ClientRequest, model: str) -> web.Response:
        """OpenAI's 404 for a model nobody serves, listing the ones the caller may see."""
        return _error(
            404,
            f"The model `{model}` does not exist. Known models: {self.known(request)}.",
            "invalid_request_error",
            "model_not_found",
            "model",
        )

    @overload
    async def forward(self, request: web.Request) -> web.StreamResponse: ...
    @overload
    async def forward(self, request: FrontRequest) -> Answer: ...
    async def forward(self, request: ClientRequest) -> Answer:
        """Every `/v1/...` request, from the raw front or the aiohttp application: the tenant's key first
        (a 401 before anything else, without a span), then the model list or the service's router."""
        if self.tenants is not None:
            refused = self.tenants.identify(request)
            if refused is not None:
                return refused
        if request.method == "GET" and (
            request.path == "/v1/models" or request.path.startswith("/v1/models/")
        ):
            return self.list_models(request) if request.path == "/v1/models" else self.get_model(request)
        if self.tracer is not None:  # the request's SERVER span, which the service's router joins
            return await self.tracer.serve(request, lambda: self._forward(request))
        return await self._forward(request)

    async def _forward(self, request: ClientRequest) -> Answer:
        body = await request.read()  # aiohttp keeps it: the service's router reads the same bytes
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        model = parsed.get("model") if isinstance(parsed, dict) else None
        if self.tracer is not None:
            self.tracer.note_body(parsed)
        if not isinstance(model, str) or not model:
            said = "has no `model`" if isinstance(parsed, dict) else "is not a JSON object"
            return _error(
                400,
                f"the body {said}: the gateway routes by the body's `model`; give one of {self.known(request)}",
                "invalid_request_error",
                "model_required",
                "model",
            )
        table = self.models()
        if model not in table:
            return self.model_not_found(request, model)
        refused = self.tenants.forbidden(request, model) if self.tenants is not None else None
        if refused is not None:  # before the pick: a weight-0 name's 503 would name its services
            return refused
        session = request.headers.get(self.session_header) if self.session_header else None
        if not session and isinstance(parsed, dict) and isinstance(parsed.get("user"), str):
            session = parsed["user"] or None
        service = self.pick(model, table[model], session)
        if service is None:
            return _error(
                503,
                f"every InferenceService serving `{model}` "
                f"({', '.join(s.key for s in table[model])}) has routing.weight 0",
                "service_unavailable",
                None,
            )
        request[_SERVICE_KEY] = service.key
        add_response_headers(request, {SERVICE_HEADER: service.key})
        served = await self.served_name(service)
        if self.tenants is not None and isinstance(parsed, dict):
            body_for_engine = {**parsed, "model": served or model}
            return await self.tenants.forward(
                request, body_for_engine, model, service.router, service.takes_priority
            )
        if served is not None and served != model and isinstance(parsed, dict):
            # the engine answers only to the name it serves
            body = json.dumps({**parsed, "model": served}).encode()
        return await service.router.forward(request, body)

    async def served_name(self, service: Service) -> str | None:
        """The model name the service's engines serve (they refuse any other), from one ready engine's
        `/v1/models`, cached SERVED_NAME_TTL_S; None while no engine answers (the body goes as it is). The
        same card gives the engines' scheduling policy (`Service.takes_priority`)."""
        if service.served is not None and time.monotonic() - service.served_at < SERVED_NAME_TTL_S:
            return service.served
        timeout = aiohttp.ClientTimeout(total=SERVED_NAME_TIMEOUT_S)
        for endpoint in service.router.endpoints.routable():
            try:
                async with service.router.client().get(f"{endpoint.url}/v1/models", timeout=timeout) as r:
                    if r.status != 200:
                        continue
                    card = (await r.json(content_type=None))["data"][0]
                    service.served = str(card["id"])
                    policy = card.get("scheduling_policy")
                    service.scheduling_policy = policy if isinstance(policy, str) else None
                    service.served_at = time.monotonic()
                    return service.served
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError) as error:
                logger.info(
                    "event=served_name_error service=%s engine=%s error=%r", service.key, endpoint.url, error
                )
        return service.served

    def model_card(self, name: str, services: list[Service]) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.started,
            "owned_by": "specfleet",
            "services": [{"service": s.key, "weight": s.weight} for s in services],
        }

    def visible(self, request: ClientRequest) -> dict[str, list[Service]]:
        """The model table as the caller may see it: with tenants, only its models."""
        table = self.models()
        return table if self.tenants is None else self.tenants.visible(request, table)

    def list_models(self, request: ClientRequest) -> web.Response:
        """`GET /v1/models`: the models the caller may call."""
        table = self.visible(request)
        return web.json_response(
            {"object": "list", "data": [self.model_card(n, s) for n, s in sorted(table.items())]}
        )

    def get_model(self, request: ClientRequest) -> web.Response:
        """`GET /v1/models/NAME` (a name may hold slashes: org/model)."""
        name = request.path[len("/v1/models/") :]
        services = self.visible(request).get(name)
        if services is None:
            return self.model_not_found(request, name)
        return web.json_response(self.model_card(name, services))


class _ServicesCollector(Collector):
    """Every service router's metrics under one name each, with a `service` label: one scrape for all."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for key in sorted(self.gateway.services):
            router = self.gateway.services[key].router
            router.metrics.observe_endpoints(router.endpoints)
            for family in router.metrics.registry.collect():
                out = merged.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type, family.unit)
                )
                for s in family.samples:
                    out.add_sample(s.name, {"service": key, **s.labels}, s.value, s.timestamp, s.exemplar)
        yield from merged.values()


def create_gateway_app(gateway: Gateway) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    registry = CollectorRegistry()
    registry.register(_ServicesCollector(gateway))
    if gateway.tenants is not None:
        gateway.tenants.install(app, registry)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(_: web.Request) -> web.Response:
        if gateway.stopping:
            return _error(503, "the gateway is stopping", "service_unavailable", None)
        if not gateway.synced:
            return _error(503, "discovery has not reported yet", "service_unavailable", None)
        if gateway.tenants is not None:  # open to callers without a key: no model names (/v1/models has them)
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "ready", "models": sorted(gateway.models())})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        await write_response_headers(request, response)
        if gateway.stopping:  # as the router does (proxy.py): a keep-alive client reconnects elsewhere
            response.force_close()
            response.headers["Connection"] = "close"

    async def on_cleanup(_: web.Application) -> None:
        for service in gateway.services.values():
            await service.router.close()

    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    # what the raw front hands the gateway itself (serve_gateway); here for an application served alone
    app.router.add_route("*", "/v1/{path:.*}", gateway.forward)
    app.on_response_prepare.append(on_prepare)
    app.on_cleanup.append(on_cleanup)
    return app


async def serve_gateway(gateway: Gateway, host: str, port: int) -> Front:
    """The gateway on host:port (0: a port the kernel picks, `Front.port`): `/v1/...` on the router's raw
    front (router/front.py), /health, /ready and /metrics on its application behind it."""
    return await serve_behind_front(gateway, create_gateway_app(gateway), host, port)
