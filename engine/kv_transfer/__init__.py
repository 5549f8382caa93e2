"""Prefill/decode disaggregation: a KV connector moves a prompt's paged KV blocks from a prefill engine
to a decode engine (docs/architecture.md, "KV connector")."""

from specfleet.engine.kv_transfer.base import KV_ROLES, KVTransferError, KVTransferParams
from specfleet.engine.kv_transfer.blocks import read_blocks, write_blocks

__all__ = ["KV_ROLES", "KVTransferError", "KVTransferParams", "read_blocks", "write_blocks"]
