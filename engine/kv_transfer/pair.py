"""The offline path of disaggregation: one prefill engine and one decode engine driven from one thread.

Every request goes to the prefill engine with max_tokens=1 and `do_remote_decode`; a prefill that ended
on its one token hands its `kv_transfer_params` to the decode engine, which continues the stream. A
prefill that ended otherwise (a stop token first, an abort) is the request's whole answer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from specfleet.engine.outputs import RequestOutput
from specfleet.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specfleet.engine.llm_engine import Engine


def generate_disaggregated(
    prefill: Engine, decode: Engine, prompts: list[list[int]], params: SamplingParams
) -> list[RequestOutput]:
    """One finished output per prompt, in order (the decode engine's, or the prefill's when it ended)."""
    ids = [f"pd-{i}" for i in range(len(prompts))]
    handoff = params.max_tokens is None or params.max_tokens >= 2  # else the prefill's token is the answer
    # The first token only; min_tokens clamped to it, as the router's prefill leg does
    for request_id, prompt in zip(ids, prompts):
        first = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        prefill.add_request(request_id, prompt, first, {"do_remote_decode": True} if handoff else None)
    done: dict[str, RequestOutput] = {}
    while len(done) < len(ids):
        if prefill.has_unfinished_requests():
            outs = prefill.step_or_wait()
        else:
            prefill.poll_kv_transfers()
            outs = []
        for out in outs:
            if not out.finished:
                continue
            if out.kv_transfer_params is None:
                done[out.request_id] = out
            else:
                decode.add_request(
                    out.request_id, out.prompt_token_ids, replace(params), out.kv_transfer_params
                )
        if decode.has_unfinished_requests():
            for out in decode.step_or_wait():
                if out.finished:
                    done[out.request_id] = out
    prefill.poll_kv_transfers()
    return [done[i] for i in ids]
