"""The server's pooling choice for /v1/embeddings: vLLM's `--pooler-config` JSON (and its older spelling
`--override-pooler-config`), read for the keys that apply to a decoder model's sequence embedding."""

from __future__ import annotations

import json
from dataclasses import dataclass

from specfleet.engine.sampling_params import POOLING_TYPES

# vLLM's keys that choose the pooling of an embedding: the type (or its newer name), and L2 normalisation
# (`normalize`, which vLLM now spells `use_activation`)
_TYPE_KEYS = ("pooling_type", "seq_pooling_type")
_NORMALIZE_KEYS = ("normalize", "use_activation")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"  # vLLM's default for decoder models under the embed task
    normalize: bool = True

    @classmethod
    def from_json(cls, text: str | None) -> PoolerConfig:
        """The flag's JSON; a ValueError naming the flag and the key for anything this engine cannot do."""
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--pooler-config must be a JSON object: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"--pooler-config must be a JSON object, got {text!r}")
        known = (*_TYPE_KEYS, *_NORMALIZE_KEYS)
        unknown = sorted(k for k, v in data.items() if k not in known and v is not None)
        if unknown:
            raise ValueError(
                f"--pooler-config: {', '.join(unknown)} not supported (this engine reads {', '.join(known)})"
            )
        how = next((data[k] for k in _TYPE_KEYS if data.get(k) is not None), "LAST")
        if how not in POOLING_TYPES:
            raise ValueError(
                f"--pooler-config: pooling_type={how!r} must be one of {', '.join(POOLING_TYPES)} for a "
                "decoder model"
            )
        normalize = next((data[k] for k in _NORMALIZE_KEYS if data.get(k) is not None), True)
        if not isinstance(normalize, bool):
            raise ValueError(f"--pooler-config: normalize={normalize!r} must be true or false")
        return cls(how, normalize)
