"""Per-request sampling parameters, validated once at the boundary. Names and defaults are vLLM's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from specfleet.engine.errors import ParameterError

__all__ = [
    "GENERATION_DEFAULT_FIELDS",
    "LOGIT_BIAS_LIMIT",
    "MAX_LOGPROBS",
    "POOLING_TYPES",
    "ParameterError",
    "SamplingParams",
]

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs


LOGIT_BIAS_LIMIT = 100.0  # OpenAI and vLLM clamp a bias to [-100, 100]

# How an embedding request's final hidden states become one vector, as vLLM's pooler types: the last
# prompt token's state (vLLM's default for decoder models) or the mean over the prompt
POOLING_TYPES = ("LAST", "MEAN")

# The request defaults vLLM takes from generation_config.json under `--generation-config auto`
# (ModelConfig.get_diff_sampling_param), all of which SamplingParams has. vLLM reads the file through
# transformers' GenerationConfig.to_diff_dict, which drops a value equal to transformers' own default, so a
# file's `top_k: 50` (transformers' default) is not applied there either; these are those defaults.
GENERATION_DEFAULT_FIELDS: dict[str, float | int | None] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
}


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) keeps the whole vocabulary
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen)
    prompt_logprobs: int | None = None  # top logprobs per prompt token (the first has none)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None  # words never generated (as vLLM: their last token is masked)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens
    # Speculative tokens for this request; None follows the engine's live setting, 0 turns it off.
    num_speculative_tokens: int | None = None
    # bad_words as token ids, with and without a leading space (vLLM's variants); set by the engine.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)
    # A StructuredOutputSpec, or vLLM's dict spelling ({"json": schema} | regex | choice | grammar | json_object)
    structured_outputs: Any = None
    # A reasoning model's end of thinking (`</think>` as token ids): the structured output constrains only
    # the tokens after the output holds these (None: from the first token). Set by the server's reasoning
    # parser (engine/server/reasoning.py), as vLLM's reasoner gates its grammar.
    reasoning_end_token_ids: list[int] | None = None
    # vLLM's per-request prefix-cache salt (one per tenant): the request's first block is hashed with it,
    # so its cached blocks match only requests with the same salt (engine/block_manager.py)
    cache_salt: str | None = None
    # An embedding request (vLLM's pooling runner): the prompt's final hidden states (after the model's
    # last norm) pooled by this POOLING_TYPES name, L2-normalised when `pooling_normalize`; the request
    # runs its prefill and ends there, answering `RequestOutput.embedding` (its one sampled token unused)
    pooling: str | None = None
    pooling_normalize: bool = True
    # Tokens this request already generated on another engine, whose stream the router resumes here
    # (docs/router.md "Streams that survive their engine"): prefilled after the prompt and counted as
    # output, so seeded draws, penalties, stop strings, min_tokens, max_tokens and usage go on from them as
    # if this engine had generated them; they are not streamed again.
    resume_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.top_k == 0:
            self.top_k = -1
        if self.structured_outputs is not None:
            from specfleet.engine.structured_output import spec_from_structured_outputs

            self.structured_outputs = spec_from_structured_outputs(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ParameterError("n", f"n={self.n} must be an integer >= 1")
        if self.temperature < 0:
            raise ParameterError("temperature", f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ParameterError("top_p", f"top_p={self.top_p} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ParameterError("top_k", f"top_k={self.top_k} must be -1 (disabled) or a positive integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ParameterError("max_tokens", f"max_tokens={self.max_tokens} must be an integer >= 1")
        if self.min_tokens < 0:
            raise ParameterError("min_tokens", f"min_tokens={self.min_tokens} must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError(
                "min_tokens", f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ParameterError(name, f"{name}={value} must be between 0 and {MAX_LOGPROBS}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ParameterError(name, f"{name}={value} must be between -2 and 2")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ParameterError(
                "repetition_penalty",
                f"repetition_penalty={self.repetition_penalty} must be > 0 (1 disables it)",
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ParameterError("min_p", f"min_p={self.min_p} must be between 0 and 1")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0 or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ParameterError(
                    "logit_bias",
                    f"logit_bias[{token}]={bias}: token ids must be >= 0 and biases between "
                    f"-{LOGIT_BIAS_LIMIT:g} and {LOGIT_BIAS_LIMIT:g}",
                )
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or min(self.allowed_token_ids) < 0
        ):
            raise ParameterError(
                "allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids >= 0"
            )
        if self.bad_words is not None and any(not w or not w.strip() for w in self.bad_words):
            raise ParameterError("bad_words", "bad_words must not contain empty words")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ParameterError(
                "truncate_prompt_tokens", f"truncate_prompt_tokens={self.truncate_prompt_tokens} must be >= 1"
            )
        end = self.reasoning_end_token_ids
        if end is not None and (not end or min(end) < 0):
            raise ParameterError(
                "reasoning_end_token_ids",
                "reasoning_end_token_ids must be a non-empty list of token ids >= 0",
            )
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ParameterError(
                "num_speculative_tokens", f"num_speculative_tokens={self.num_speculative_tokens} must be >= 0"
            )
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ParameterError(
                "cache_salt", f"cache_salt={self.cache_salt!r} must be a non-empty string if provided"
            )
        if self.pooling is not None:
            if self.pooling not in POOLING_TYPES:
                raise ParameterError(
                    "pooling", f"pooling={self.pooling!r} must be one of {', '.join(POOLING_TYPES)}"
                )
            if self.n != 1 or self.max_tokens != 1:
                raise ParameterError(
                    "pooling",
                    f"pooling needs n=1 and max_tokens=1 (it generates nothing), got n={self.n} "
                    f"max_tokens={self.max_tokens}",
                )
        if any(not s for s in self.stop):
            raise ParameterError("stop", "stop must not contain empty strings")
        self._check_resume()

    def _check_resume(self) -> None:
        """What a resumed request may ask for: one sample, no logprobs (the first engine's are not here),
        no grammar (its state at the resumed tokens is not rebuilt), room left to generate."""
        resumed = self.resume_token_ids
        if resumed is None:
            return
        if any(not isinstance(t, int) or t < 0 for t in resumed):
            raise ParameterError("resume_token_ids", "resume_token_ids must be token ids >= 0")
        refused = {
            "n": self.n != 1,
            "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "structured_outputs": self.structured_outputs is not None,
            "pooling": self.pooling is not None,
        }
        for name, bad in refused.items():
            if bad:
                raise ParameterError(
                    "resume_token_ids",
                    "resume_token_ids needs n=1 and no logprobs, prompt_logprobs, structured output or "
                    f"pooling; this request sets {name}",
                )
        if self.max_tokens is not None and len(resumed) >= self.max_tokens:
            raise ParameterError(
                "resume_token_ids",
                f"resume_token_ids has {len(resumed)} tokens, max_tokens={self.max_tokens} leaves none to "
                "generate",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Presence, frequency or repetition penalties: each token's logits depend on the ones before."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def depends_on_history(self) -> bool:
        """Each token's distribution depends on the tokens just before it, so the engine verifies one
        token at a time (no speculation): penalties and bad words. min_tokens is the engine's to check."""
        return self.uses_penalties or bool(self.bad_words)

    @property
    def reads_every_prompt_row(self) -> bool:
        """Prompt logprobs and MEAN pooling read each prompt position's output: no prefix-cache hits."""
        return self.prompt_logprobs is not None or self.pooling == "MEAN"

    @property
    def uses_bias(self) -> bool:
        """A fixed additive mask on the logits: logit_bias or allowed_token_ids."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None
