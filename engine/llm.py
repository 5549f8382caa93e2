"""The offline API: `LLM(model=...).generate(prompts, params)`, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from specfleet.engine.config import EngineConfig
from specfleet.engine.llm_engine import Engine
from specfleet.engine.outputs import RequestOutput
from specfleet.engine.sampling_params import SamplingParams
from tqdm import tqdm


class LLM:
    def __init__(self, model: str = "bundled://smollm2-135m-instruct", **kwargs):
        self.engine = Engine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One result per prompt, in order. A prompt is text or a list of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params_list):
                ids.append(f"offline-{next(self._ids)}")
                self.engine.add_request(ids[-1], prompt, p)
        except ValueError:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Chat through the tokenizer's chat template; one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.engine.apply_chat_template(c) for c in conversations], params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted, done = set(ids), {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
