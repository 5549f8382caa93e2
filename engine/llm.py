"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, cast

from specfleet.engine.config import EngineConfig
from specfleet.engine.llm_engine import Engine
from specfleet.engine.outputs import RequestOutput
from specfleet.engine.sampling_params import SamplingParams
from specfleet.engine.spec_decode.methods import VLLM_DRAFT_MODEL, VLLM_NAMES
from tqdm import tqdm

Prompt = (
    str | list[int] | Mapping[str, Any]
)  # text, token ids, {"prompt": ...} or {"prompt_token_ids": [...]}

# vLLM's speculative_config keys -> EngineConfig fields (the method is read separately).
SPECULATIVE_CONFIG_FIELDS = {
    "num_speculative_tokens": "num_speculative_tokens",
    "model": "draft_model",
    "quantization": "draft_quantization",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "prompt_lookup_max",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
}


def engine_config_from_vllm_kwargs(model: str, kwargs: dict[str, Any]) -> EngineConfig:
    """EngineConfig from `LLM(...)` keyword arguments, accepting vLLM's spellings: gpu_memory_utilization
    (-> kv_cache_memory_fraction) and speculative_config={"method", "num_speculative_tokens", "model", ...}."""
    kwargs = dict(kwargs)
    if "gpu_memory_utilization" in kwargs:
        kwargs["kv_cache_memory_fraction"] = kwargs.pop("gpu_memory_utilization")
    spec = kwargs.pop("speculative_config", None)
    if spec is not None:
        spec = dict(spec)
        unknown = sorted(set(spec) - set(SPECULATIVE_CONFIG_FIELDS) - {"method"})
        if unknown:
            raise ValueError(
                f"speculative_config keys {unknown} are not supported; use "
                f"{sorted(SPECULATIVE_CONFIG_FIELDS) + ['method']}"
            )
        method = spec.pop("method", None) or (VLLM_DRAFT_MODEL if spec.get("model") else None)
        if method not in VLLM_NAMES:
            raise ValueError(
                f"speculative_config method={method!r} is not supported; use one of "
                f"{sorted(VLLM_NAMES)} (a 'model' implies {VLLM_DRAFT_MODEL})"
            )
        kwargs["speculative_method"] = VLLM_NAMES[method]
        kwargs.update({SPECULATIVE_CONFIG_FIELDS[k]: v for k, v in spec.items()})
    return EngineConfig(model=model, **kwargs)


class LLM:
    def __init__(self, model: str = "bundled://smollm2-135m-instruct", **kwargs):
        self.engine = Engine(engine_config_from_vllm_kwargs(model, kwargs))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); the instance is unusable after."""
        self.engine.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams: SamplingParams' defaults, with the
        model's generation_config.json over them under `generation_config="auto"` (as vLLM)."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """One result per prompt, in order. A prompt is text, token ids, or a dict with `prompt` or
        `prompt_token_ids` (vLLM's TextPrompt / TokensPrompt). `priority`, one per prompt (vLLM's), needs
        `scheduling_policy="priority"` unless all are 0: lower runs first. `lora_name`: a loaded LoRA
        adapter for every prompt, or one per prompt (None: the base), with `enable_lora=True`."""
        one = isinstance(prompts, (str, Mapping)) or (bool(prompts) and isinstance(prompts[0], int))
        batch = cast("Sequence[Prompt]", [prompts] if one else prompts)
        prompts = [_prompt(p) for p in batch]
        params = sampling_params
        params_list = (
            params
            if isinstance(params, (list, tuple))
            else [params or self.get_default_sampling_params()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        loras = (
            [lora_name] * len(prompts) if lora_name is None or isinstance(lora_name, str) else list(lora_name)
        )
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora names for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p, rank, lora in zip(prompts, params_list, priorities, loras):
                ids.append(f"offline-{next(self._ids)}")
                self.engine.add_request(ids[-1], prompt, p, priority=rank, lora_name=lora)
        except ValueError:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Chat through the tokenizer's chat template (or `chat_template`, a Jinja string); one conversation
        or a list of them. `continue_final_message=True` (with `add_generation_prompt=False`) continues the
        last message instead of answering it, as vLLM's `LLM.chat`."""
        conversations = cast(
            "list[list[dict]]", [messages] if messages and isinstance(messages[0], dict) else messages
        )
        return self.generate(
            [
                self.engine.apply_chat_template(
                    c,
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                )
                for c in conversations
            ],
            sampling_params,
            use_tqdm,
        )

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while len(done) < len(ids):
            for out in self.engine.step_or_wait():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]


def _prompt(prompt: Prompt) -> str | list[int]:
    if not isinstance(prompt, Mapping):
        return prompt if isinstance(prompt, str) else list(prompt)
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if unknown or len(prompt) != 1:
        raise ValueError(
            f"a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids', got {sorted(prompt)}"
        )
    return prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
