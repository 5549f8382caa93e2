"""`--kv-events-config`: vLLM's KVEventsConfig (vllm/config/kv_events.py), its fields and defaults, parsed
from its JSON with an error naming the field. Plain Python: the engine's config (and the operator) import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields and defaults (vllm/config/kv_events.py)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" once enabled; "null" publishes nothing
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZeroMQ high-water mark: a subscriber that falls this far behind loses batches
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; past it a step drops its batch
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_events_config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(raw).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"kv_events_config has unknown fields {unknown}; known: {sorted(known)}")
        config = cls(**raw)
        if config.publisher is None and config.enable_kv_cache_events:
            config = cls(**{**raw, "publisher": "zmq"})
        config.check()
        return config

    def check(self) -> None:
        if self.publisher not in (None, "null", "zmq"):
            raise ValueError(f"kv_events_config.publisher={self.publisher!r} is not one of null, zmq")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config.{name}={value!r} must be an integer >= 1")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                f"kv_events_config.endpoint={self.endpoint!r} must be tcp://, ipc:// or inproc://"
            )

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"
