"""What the server and the engine core send each other over ZeroMQ, as msgspec structs (msgpack).

Inputs are two frames, a one-byte request type and the encoded struct; outputs are one frame holding one
of `CoreMessage`'s tagged structs. Structs are positional arrays (`array_like`), not GC-tracked, and
omit fields left at their default, as vLLM V1's `EngineCoreOutputs` are: a decode step for 32 sequences
encodes to a few hundred bytes.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec
from specfleet.engine.outputs import KVTransferMetrics
from specfleet.engine.stats import EngineStats


class RequestType(bytes, enum.Enum):
    ADD = b"\x00"  # AddRequest
    ABORT = b"\x01"  # Abort
    UTILITY = b"\x02"  # UtilityCall
    FINISH_SEQ = b"\x03"  # FinishSequence: the server ended one sample (a stop string)


class AddRequest(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    params: bytes  # pickled SamplingParams (its structured-output spec is a plain object, not a schema)
    kv_transfer_params: dict[str, Any] | None = (
        None  # disaggregation (engine/kv_transfer/), as sent by the client
    )
    priority: int = 0  # vLLM's: lower runs first under --scheduling-policy priority
    lora_name: str | None = None  # the LoRA adapter the request's `model` names (None: the base)


class Abort(msgspec.Struct, array_like=True, gc=False):
    request_ids: list[str]


class FinishSequence(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    index: int  # which of the request's n samples
    reason: str = "stop"


class UtilityCall(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    method: str  # a name in `proc.UTILITIES`
    kwargs: dict[str, int | str] = {}


class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """One position's `PositionLogprobs`: the chosen token, its logprob and rank, and the top-N."""

    token_id: int
    logprob: float
    rank: int | None = None
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class SeqDelta(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """What one sample gained in a step. `text_upto` is how many of its output tokens are text: a stop
    token that ends a sample is kept in its tokens but not in its text."""

    request_id: str
    index: int
    new_token_ids: list[int] = []
    text_upto: int = 0
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id that ended it (stop strings are the server's)
    logprobs: list[Logprobs] = []
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() in the core (one clock per host)
    prompt_logprobs: list[Logprobs | None] | None = None  # once, when the prompt is done
    kv_transfer_params: dict[str, Any] | None = (
        None  # a prefill engine's finished request: where its KV waits
    )
    embedding: list[float] | None = None  # a finished pooling request's (SamplingParams.pooling)
    kv_transfer: KVTransferMetrics | None = None  # once, a remote-prefilled request's pull (its trace)


class Ready(msgspec.Struct, tag="ready", array_like=True, gc=False):
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    live: dict[str, int]
    pid: int
    sampling_defaults: dict[str, Any] = {}  # the request defaults in force (--generation-config)
    kv_block_size: int = 0  # tokens per KV block (the model-server protocol's BlockSize)
    num_kv_blocks: int = 0  # KV blocks the cache holds (NumGPUBlocks)
    enable_prefix_caching: bool = True


# AddResult.code of an add_request that raised something else than a ParameterError or ValueError: the
# engine's bug, not the request's; that request fails, the core serves on.
INTERNAL_ERROR = "internal_error"


class AddResult(msgspec.Struct, tag="added", array_like=True, gc=False, omit_defaults=True):
    request_id: str
    error: str | None = None  # None: accepted
    param: str | None = None  # a ParameterError's field
    code: str | None = None  # a ParameterError's code, or INTERNAL_ERROR


class UtilityResult(msgspec.Struct, tag="utility", array_like=True, gc=False, omit_defaults=True):
    call_id: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    error: str | None = None
    param: str | None = None
    code: str | None = None


class StepReport(msgspec.Struct, tag="step", array_like=True, gc=False, omit_defaults=True):
    """Sent after every step, and every `HEARTBEAT_S` while idle (stepped=False): the server's /metrics
    and /ready read the core through these."""

    deltas: list[SeqDelta] = []
    aborted: list[str] = []  # requests the core ended on its own (a failed step, a rejected grammar)
    stats: EngineStats | None = None
    stepped: bool = False
    kv_blocks_in_use: int = 0
    live: dict[str, int] = {}
    error: str | None = None  # a step raised: the requests it held were aborted


class Dead(msgspec.Struct, tag="dead", array_like=True, gc=False):
    """The core's last words before it exits on an error it cannot serve past."""

    reason: str


CoreMessage = Ready | AddResult | UtilityResult | StepReport | Dead

ENCODER = msgspec.msgpack.Encoder()
INPUT_TYPES: dict[bytes, type] = {
    RequestType.ADD.value: AddRequest,
    RequestType.ABORT.value: Abort,
    RequestType.UTILITY.value: UtilityCall,
    RequestType.FINISH_SEQ.value: FinishSequence,
}
INPUT_DECODERS: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
    kind: msgspec.msgpack.Decoder(cls) for kind, cls in INPUT_TYPES.items()
}
OUTPUT_DECODER = msgspec.msgpack.Decoder(CoreMessage)
