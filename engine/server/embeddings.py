"""POST /v1/embeddings for the decoder models the engine loads, as vLLM's pooling runner answers it.

Each input is a prefill-only request through the same scheduler as completions (SamplingParams.pooling):
its final hidden states, after the model's last norm, pooled as `--pooler-config` says (LAST by default,
or MEAN) and L2-normalised unless it says otherwise. `input` is a string, a list of strings, a list of
token ids or a list of such lists; `encoding_format` float or base64 (little-endian float32, as OpenAI);
`dimensions` is refused (no model here is trained for shortened embeddings); `user` is accepted.
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field
from specfleet.engine.errors import context_length_error
from specfleet.engine.request_queue import MAX_PRIORITY, MIN_PRIORITY
from specfleet.engine.sampling_params import SamplingParams

from .api import _collect, _submit
from .errors import APIError
from .lenient import LenientModel
from .request_ids import request_id
from .state import ServerState, get_state

router = APIRouter()

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one embeddings request

EmbeddingInput = str | list[int] | list[str] | list[list[int]]


class EmbeddingRequest(LenientModel):
    model: str | None = None
    input: Annotated[EmbeddingInput, Field(union_mode="left_to_right")]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's extra field: BOS before a text input, as completions
    # vLLM's: lower runs first under --scheduling-policy priority; other policies take only 0
    priority: int = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY)


def _prompts(state: ServerState, body: EmbeddingRequest) -> list[list[int]]:
    raw = body.input
    items: list[Any] = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not items:
        raise APIError(400, "input must not be empty", "input", "invalid_value")
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"input has {len(items)} items, at most {MAX_INPUTS}", "input", "invalid_value")
    prompts = []
    for i, item in enumerate(items):
        ids = (
            list(state.tokenizer.encode(item, add_special_tokens=body.add_special_tokens))
            if isinstance(item, str)
            else list(item)
        )
        where = "input" if len(items) == 1 else f"input[{i}]"
        if not ids:
            raise APIError(400, f"{where} is empty: give at least one token", "input", "invalid_value")
        bad = [t for t in ids if not 0 <= t < state.vocab_size]
        if bad:
            raise APIError(
                400, f"{where} holds token id {bad[0]}: ids must be in [0, {state.vocab_size})", "input"
            )
        if len(ids) >= state.max_model_len:
            exc = context_length_error(
                "input",
                state.max_model_len,
                f"{where} has {len(ids)} tokens, and an embedding input may have at most "
                f"{state.max_model_len - 1}. Please reduce the length of the input.",
            )
            raise APIError(400, str(exc), exc.param, exc.code)
        prompts.append(ids)
    return prompts


def _encoded(values: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


@router.post("/v1/embeddings")
async def create_embedding(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    state = get_state(request)
    state.check_accepting()
    if state.check_model(body.model) is not None:
        raise APIError(
            400, f"model={body.model!r} is a LoRA adapter: /v1/embeddings pools the base model only", "model"
        )
    if body.dimensions is not None:
        raise APIError(
            400,
            f"dimensions={body.dimensions} is not supported: {state.model_name} is not a matryoshka model, "
            "its embeddings have one size; leave dimensions out",
            "dimensions",
            "unsupported_value",
        )
    prompts = _prompts(state, body)
    pooler = state.pooler
    params = SamplingParams(max_tokens=1, pooling=pooler.pooling_type, pooling_normalize=pooler.normalize)
    rid = f"embd-{request_id(request, None)}"
    ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    finals = await _collect(request, await _submit(state, ids, prompts, params, "input", None, body.priority))
    data = []
    for i, final in enumerate(finals):
        if final.embedding is None:
            raise APIError(500, f"the engine returned no embedding for input {i}", code="internal_error")
        data.append(
            {"object": "embedding", "index": i, "embedding": _encoded(final.embedding, body.encoding_format)}
        )
    tokens = sum(len(p) for p in prompts)
    return {
        "id": rid,
        "object": "list",
        "created": int(time.time()),
        "model": state.model_name,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
