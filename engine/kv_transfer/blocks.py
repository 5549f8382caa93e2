"""Worker side: read and write whole blocks of the paged KV cache, every layer at once.

The cache is one (key, value) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim]
(model_runner.ModelRunner.kv_caches). A transfer carries [num_layers, 2, n, block_size, num_kv_heads,
head_dim]: per token and layer 2 * num_kv_heads * head_dim elements.
"""

from __future__ import annotations

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def read_blocks(kv_caches: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """[num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim], a copy."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=kv_caches[0][0].device)
    return torch.stack(
        [torch.stack((k.index_select(0, index), v.index_select(0, index))) for k, v in kv_caches]
    )


def write_blocks(kv_caches: KVCaches, block_ids: list[int], data: torch.Tensor) -> None:
    """Write `data` (as read_blocks returns it) into `block_ids`; the shapes must agree."""
    key = kv_caches[0][0]
    want = (len(kv_caches), 2, len(block_ids), *key.shape[1:])
    if tuple(data.shape) != want:
        raise ValueError(
            f"KV blocks of shape {tuple(data.shape)} do not fit this cache: expected {want} "
            "(same model, block size and KV heads on both engines)"
        )
    index = torch.tensor(block_ids, dtype=torch.int64, device=key.device)
    data = data.to(device=key.device, dtype=key.dtype)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, index, data[layer, 0])
        v.index_copy_(0, index, data[layer, 1])


def bytes_per_token(kv_caches: KVCaches) -> int:
    """K/V bytes one token occupies across all layers."""
    key = kv_caches[0][0]
    return 2 * len(kv_caches) * key.shape[2] * key.shape[3] * key.element_size()
