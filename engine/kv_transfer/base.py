"""The KV connector's boundary types, in the spirit of vLLM's KVConnector v1.

Pull model (as vLLM's NixlConnector): the prefill engine computes a prompt's KV and its first token, then
*holds* the prompt's blocks (its own references, so nothing reuses them) and returns `KVTransferParams`
naming where they are. The decode engine gets the prompt, the first token and those params; its scheduler
side decides which blocks it must load (everything past its own prefix-cache hits), its worker side pulls
them from the prefill engine and writes them into its paged KV cache, all layers at once. The prefill
engine drops its hold when the decoder has read the blocks, when the decoder releases them, or when
`kv_transfer_timeout_s` passes.

The params arrive from a client (the router, or anyone who can reach a decode engine), so `from_dict`
checks every field's type and range: a wrong one is a ValueError naming `kv_transfer_params.<field>` and
its limit, never a TypeError deep in the connector. Checks that need the model (the first token inside
the vocabulary) are the engine's (`Engine._remote_params`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from specfleet.engine.config import KV_ROLES

__all__ = ["KV_ROLES", "KVTransferError", "KVTransferParams", "encode_logprob", "field_int"]

# Inclusive (low, high) of the integer fields; None: no upper bound the params alone can tell.
_INT_RANGES: dict[str, tuple[int, int | None]] = {
    "remote_port": (1, 65535),
    "num_tokens": (1, None),
    "num_blocks": (1, None),
    "first_token_id": (0, None),  # < vocab: checked by the engine, which knows it
}
_STR_FIELDS = ("remote_host", "transfer_id")
# JSON has no -inf: a logprob below this travels as this (vLLM's clamp of non-finite logprobs).
MIN_LOGPROB = -9999.0


class KVTransferError(RuntimeError):
    """A transfer failed (the peer is gone, timed out, or holds no such blocks)."""


def field_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    """`value` if it is a JSON integer in [low, high], else a ValueError naming `kv_transfer_params.<name>`.
    bool is refused (True is an int to Python, not to a client), and so is 2.0 (a float)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"kv_transfer_params.{name} must be an integer, got {value!r} ({type(value).__name__})"
        )
    if value < low or (high is not None and value > high):
        limit = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"kv_transfer_params.{name} must be {limit}, got {value}")
    return value


def _field_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"kv_transfer_params.{name} must be a number, got {value!r}")
    return max(float(value), MIN_LOGPROB)


def encode_logprob(token_id: int, logprob: float, rank: int | None, top: dict[int, float]) -> dict[str, Any]:
    """The prefill's first token's logprobs as `kv_transfer_params.first_token_logprobs` (JSON: no -inf)."""
    return {
        "token_id": token_id,
        "logprob": max(logprob, MIN_LOGPROB),
        "rank": rank,
        "top": [[t, max(lp, MIN_LOGPROB)] for t, lp in top.items()],
    }


def _check_logprobs(data: Any, first_token_id: int) -> dict[str, Any]:
    name = "first_token_logprobs"
    if not isinstance(data, dict):
        raise ValueError(f"kv_transfer_params.{name} must be an object, got {data!r}")
    token_id = field_int(f"{name}.token_id", data.get("token_id"), first_token_id, first_token_id)
    rank = data.get("rank")
    if rank is not None:
        rank = field_int(f"{name}.rank", rank, 1)
    top = data.get("top", [])
    if not isinstance(top, list) or any(not isinstance(pair, list) or len(pair) != 2 for pair in top):
        raise ValueError(f"kv_transfer_params.{name}.top must be a list of [token_id, logprob] pairs")
    return {
        "token_id": token_id,
        "logprob": _field_float(f"{name}.logprob", data.get("logprob")),
        "rank": rank,
        "top": [[field_int(f"{name}.top", t, 0), _field_float(f"{name}.top", lp)] for t, lp in top],
    }


@dataclass(frozen=True)
class KVTransferParams:
    """Where a prompt's KV blocks wait: returned by the prefill engine, handed to the decode engine."""

    remote_host: str
    remote_port: int
    transfer_id: str  # names the prefill engine's hold on the blocks
    num_tokens: int  # prompt tokens whose K/V the blocks hold
    num_blocks: int
    first_token_id: int  # the token the prefill sampled: the decode engine's first step decodes it
    # The first token's logprobs (encode_logprob's shape) when the request asked for logprobs: the decode
    # engine does not sample that token, so it reports the prefill's.
    first_token_logprobs: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if data["first_token_logprobs"] is None:
            del data["first_token_logprobs"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVTransferParams:
        if not isinstance(data, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {type(data).__name__}")
        required = [name for name in cls.__dataclass_fields__ if name != "first_token_logprobs"]
        missing = sorted(set(required) - set(data))
        if missing:
            raise ValueError(f"kv_transfer_params is missing {missing}")
        for name in _STR_FIELDS:
            if not isinstance(data[name], str) or not data[name]:
                raise ValueError(f"kv_transfer_params.{name} must be a non-empty string, got {data[name]!r}")
        ints = {name: field_int(name, data[name], *_INT_RANGES[name]) for name in _INT_RANGES}
        logprobs = data.get("first_token_logprobs")
        return cls(
            data["remote_host"],
            ints["remote_port"],
            data["transfer_id"],
            ints["num_tokens"],
            ints["num_blocks"],
            ints["first_token_id"],
            None if logprobs is None else _check_logprobs(logprobs, ints["first_token_id"]),
        )
