"""The KV connector's boundary types, in the spirit of vLLM's KVConnector v1.

Pull model (as vLLM's NixlConnector): the prefill engine computes a prompt's KV and its first token, then
*holds* the prompt's blocks (its own references, so nothing reuses them) and returns `KVTransferParams`
naming where they are. The decode engine gets the prompt, the first token and those params; its scheduler
side decides which blocks it must load (everything past its own prefix-cache hits), its worker side pulls
them from the prefill engine and writes them into its paged KV cache, all layers at once. The prefill
engine drops its hold when the decoder has read the blocks, when the decoder releases them, or when
`kv_transfer_timeout_s` passes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from specfleet.engine.config import KV_ROLES

__all__ = ["KV_ROLES", "KVTransferError", "KVTransferParams"]


class KVTransferError(RuntimeError):
    """A transfer failed (the peer is gone, timed out, or holds no such blocks)."""


@dataclass(frozen=True)
class KVTransferParams:
    """Where a prompt's KV blocks wait: returned by the prefill engine, handed to the decode engine."""

    remote_host: str
    remote_port: int
    transfer_id: str  # names the prefill engine's hold on the blocks
    num_tokens: int  # prompt tokens whose K/V the blocks hold
    num_blocks: int
    first_token_id: int  # the token the prefill sampled: the decode engine's first step decodes it

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVTransferParams:
        missing = sorted(set(cls.__dataclass_fields__) - set(data))
        if missing:
            raise ValueError(f"kv_transfer_params is missing {missing}")
        params = cls(**{k: data[k] for k in cls.__dataclass_fields__})
        if params.num_tokens < 1 or params.num_blocks < 1:
            raise ValueError(
                f"kv_transfer_params num_tokens={params.num_tokens} and num_blocks={params.num_blocks} "
                "must be >= 1"
            )
        return params
