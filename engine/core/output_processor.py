"""The server's half of a request: the core's token deltas -> text, stop strings, cumulative RequestOutputs.

As in vLLM V1's `OutputProcessor`: the core decides token-level stops (EOS, `stop_token_ids`, max_tokens,
the context); stop strings are matched here, token by token in order, ending after the first `min_tokens`
tokens (as vLLM's detokenizer: a stop string that ends inside token number `min_tokens` does not count). A sample that
a stop string ends here is truncated after that token and handed back in `to_finish`, for the client to
tell the core, which has usually run a step or two further by then (those tokens are dropped).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from specfleet.engine.detokenizer import IncrementalDetokenizer, TokenText
from specfleet.engine.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from specfleet.engine.sampling_params import SamplingParams

from .messages import Logprobs, SeqDelta


def decode_logprobs(lp: Logprobs, text: TokenText) -> PositionLogprobs:
    out = PositionLogprobs(lp.token_id, lp.logprob, dict(zip(lp.top_ids, lp.top_logprobs)), lp.rank)
    return out.decode_with(text)


@dataclass
class _Sample:
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_text = TokenText(tokenizer)
        self.requests: dict[str, RequestState] = {}

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> RequestState:
        samples = [
            _Sample(
                IncrementalDetokenizer(
                    self.tokenizer,
                    params.stop,
                    params.include_stop_str_in_output,
                    prompt_ids,
                    params.skip_special_tokens,
                )
            )
            for _ in range(params.n)
        ]
        req = RequestState(request_id, prompt, prompt_ids, params, samples, RequestMetrics(arrival_time))
        self.requests[request_id] = req
        return req

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, deltas: list[SeqDelta]) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """The outputs of the requests these deltas touch, and the samples a stop string ended here."""
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        to_finish: list[tuple[str, int]] = []
        for d in deltas:
            req = self.requests.get(d.request_id)
            if req is None:  # aborted here, or finished by a stop string while the core ran on
                continue
            sample = req.samples[d.index]
            if sample.finish_reason is not None:
                continue
            touched[req.request_id] = req
            if d.first_scheduled_time is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = d.first_scheduled_time
            if d.kv_transfer is not None:
                req.metrics.kv_transfer = d.kv_transfer
            if d.num_cached_tokens:
                req.num_cached_tokens = d.num_cached_tokens
            if d.prompt_logprobs is not None:
                req.prompt_logprobs = [
                    None if lp is None else decode_logprobs(lp, self.token_text) for lp in d.prompt_logprobs
                ]
            if d.kv_transfer_params is not None:
                req.kv_transfer_params = d.kv_transfer_params
            if d.embedding is not None:
                req.embedding = d.embedding
            if d.new_token_ids and req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if self._append(req, sample, d) and d.finish_reason is None:
                to_finish.append((req.request_id, d.index))
        outputs = []
        for req in touched.values():
            req.metrics.last_token_time = now
            finished = req.finished
            if finished:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
            outputs.append(self._output(req, finished))
        return outputs, to_finish

    def _append(self, req: RequestState, sample: _Sample, d: SeqDelta) -> bool:
        """Take the delta's tokens in order; True when a stop string ended the sample here."""
        params, tokens = req.params, sample.token_ids
        start = len(tokens)
        tokens.extend(d.new_token_ids)
        if d.logprobs:
            sample.logprobs.extend(decode_logprobs(lp, self.token_text) for lp in d.logprobs)
        last = len(tokens) - 1
        for pos in range(start, min(len(tokens), d.text_upto)):
            # The core's own stop token ends a sample without a stop-string check at that token.
            check = pos + 1 > params.min_tokens and not (pos == last and d.finish_reason == "stop")
            matched = sample.detok.update(tokens if pos == last else tokens[: pos + 1], check)
            if matched is not None:
                del tokens[pos + 1 :]
                del sample.logprobs[pos + 1 :]
                sample.finish_reason, sample.stop_reason = "stop", matched
                return True
        if d.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = d.finish_reason, d.stop_reason
        return False

    def _output(self, req: RequestState, finished: bool) -> RequestOutput:
        outs = []
        want_lps = req.params.logprobs is not None
        for index, s in enumerate(req.samples):
            done = s.finish_reason is not None
            lps = list(s.logprobs) if want_lps else None
            cumulative = sum(lp.logprob for lp in lps) if lps is not None else None
            outs.append(
                CompletionOutput(
                    index,
                    s.detok.visible_text(done),
                    list(s.token_ids),
                    s.finish_reason,
                    s.stop_reason,
                    lps,
                    cumulative,
                )
            )
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_ids,
            outs,
            finished,
            req.num_cached_tokens,
            req.metrics,
            req.prompt_logprobs,
            req.kv_transfer_params,
            req.embedding,
        )
