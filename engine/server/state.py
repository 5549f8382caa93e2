"""What the routes share: the engine front end, the served model's facts, readiness and drain state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from specfleet.engine.core.client import EngineCoreClient

from .chat import ChatOptions
from .errors import APIError
from .metrics import ServerMetrics
from .pooler import PoolerConfig
from .remote_prefill import RemotePrefill

DRAIN_RETRY_AFTER_S = 5


@dataclass
class ServerState:
    async_engine: EngineCoreClient
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    tokenizer: Any
    vocab_size: int
    admin_token: str | None = None
    admin_port: int | None = None  # the admin API's own port (None: served beside the OpenAI API)
    chat: ChatOptions = field(default_factory=ChatOptions)  # chat template, tool and reasoning parsers
    pooler: PoolerConfig = field(default_factory=PoolerConfig)  # /v1/embeddings' pooling (--pooler-config)
    ready: bool = False
    stopping: bool = False  # SIGTERM seen: /ready fails (the endpoint goes), requests are still served
    draining: bool = False  # after the shutdown delay: new requests get 503, in-flight ones finish
    started: float = field(default_factory=time.time)
    lora_adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters served: name -> path
    # --scheduling-policy, which /v1/models states: a gateway drops `priority` for an fcfs engine
    scheduling_policy: str = "fcfs"
    # --accept-remote-prefill: a request's x-prefiller-host-port runs its prefill there (remote_prefill.py)
    remote_prefill: RemotePrefill | None = None

    @property
    def engine(self) -> Any:
        """The model's facts and tokenizer (`CoreInfo`); the engine itself runs in the core process."""
        return self.async_engine.info

    def check_accepting(self) -> None:
        """503 + Retry-After while not ready or draining (new work goes to another replica)."""
        if self.draining:
            self.metrics.refuse("draining")
            raise APIError(
                503,
                "server is shutting down (draining); retry on another replica",
                code="draining",
                headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)},
            )
        if not self.ready:
            self.metrics.refuse("not_ready")
            raise APIError(503, "model is not loaded yet", code="not_ready", headers={"Retry-After": "1"})
        if self.async_engine.dead is not None:
            raise APIError(
                503,
                f"the engine is down ({self.async_engine.dead}); retry on another replica",
                code="engine_dead",
                headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)},
            )

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for any other name."""
        if model is None or model == self.model_name:
            return None
        if model in self.lora_adapters:
            return model
        adapters = "".join(f", '{name}'" for name in self.lora_adapters)
        raise APIError(
            404,
            f"model '{model}' does not exist; this server serves '{self.model_name}'{adapters}",
            param="model",
            code="model_not_found",
        )


def get_state(request: Request) -> ServerState:
    return request.app.state.specfleet
