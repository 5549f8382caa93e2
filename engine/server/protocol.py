"""OpenAI request bodies, validated at the HTTP boundary. As in vLLM, an unknown field is accepted and reported
(lenient.py) and null means the default; a bad value is a 400 naming the field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from specfleet.engine.knobs import KNOBS, SERVICE_KNOBS
from specfleet.engine.request_queue import MAX_PRIORITY, MIN_PRIORITY
from specfleet.engine.sampling_params import GENERATION_DEFAULT_FIELDS, ParameterError, SamplingParams
from specfleet.engine.structured_output.request_fields import spec_from_request

from .lenient import LenientModel
from .tool_models import AssistantToolCall, ChatTool, ToolChoice
from .tools import template_tool_calls

# vLLM's VLLM_MAX_N_SEQUENCES default: samples are independent sequences in the scheduler, so n above
# max_num_seqs queues like more requests would.
MAX_N = 16384
MAX_STOP = 16
# Tools per request: OpenAI's own limit (its API refuses more than 128 functions).
MAX_TOOLS = 128
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
MIN_SEED = -(2**63)  # vLLM takes any int64 seed; the sampler mixes it to 64 bits, so negatives are distinct
ALL_LOGPROBS = -1  # vLLM's "the whole vocabulary" for logprobs, top_logprobs and prompt_logprobs
# Shown in logs and echoed in the X-Request-Id response header: visible ASCII only, so it cannot break
# either; 256 covers UUIDs and trace ids with room to spare.
REQUEST_ID_PATTERN = r"^[\x21-\x7e]{1,256}$"

# The sampling fields whose default the engine may set (checkpoint.GENERATION_DEFAULT_FIELDS, from
# generation_config.json): a request that leaves one out samples with the engine's.
DEFAULTED_FIELDS = tuple(GENERATION_DEFAULT_FIELDS)

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(LenientModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(LenientModel):
    """The sampling fields both routes share (DESIGN.md section 5)."""

    model: str | None = Field(default=None, description="Served model name; omitted means the served one")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    # None: the default in force, the model's generation_config.json's under --generation-config auto
    # (as vLLM), else SamplingParams' own (to_sampling_params)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=MAX_STOP)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    include_stop_str_in_output: bool = False
    user: str | None = Field(default=None, description="End-user id (accepted, not used)")
    logit_bias: dict[str, float] | None = Field(default=None, description="Token id (as a string) -> bias")
    # vLLM's extra sampling fields (the openai client sends them in extra_body)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1)
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    prompt_logprobs: int | None = Field(default=None, ge=ALL_LOGPROBS, le=MAX_LOGPROBS)
    request_id: str | None = Field(
        default=None,
        pattern=REQUEST_ID_PATTERN,
        description="vLLM's request id (the X-Request-Id header wins); echoed in the response id and header",
    )
    return_token_ids: bool | None = Field(
        default=None,
        description="vLLM's: the prompt's and each choice's token ids in the (non-streamed) response",
    )
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        description="vLLM's prefix-cache salt: cached blocks are reused only by requests with the same salt",
    )
    priority: int = Field(
        default=0,
        ge=MIN_PRIORITY,
        le=MAX_PRIORITY,
        description="vLLM's: lower runs first under --scheduling-policy priority; other policies take only 0",
    )

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{key}]={bias} must be between -100 and 100")
        return value

    # vLLM's structured-output extra body (docs/structured_outputs.md); checked in to_sampling_params
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's disaggregation field (engine/kv_transfer/): {"do_remote_decode": true} to a prefill engine, or
    # the params its response returned, to a decode engine
    kv_transfer_params: dict[str, Any] | None = None
    resume_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None,
        description="specfleet's: tokens this request already streamed from another engine (the router "
        "resumes a stream whose engine failed); generated on from them, counted as output, not sent again",
    )

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def default_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return None

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The request's SamplingParams; a field it leaves out (or sends as null) takes `defaults` (the
        engine's, from --generation-config), then SamplingParams' own."""
        max_tokens = self.default_max_tokens()
        given = {name: getattr(self, name) for name in DEFAULTED_FIELDS}
        defaulted = {**(defaults or {}), **{k: v for k, v in given.items() if v is not None}}
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise ParameterError(
                "min_tokens", f"min_tokens={self.min_tokens} must be <= max_tokens={max_tokens}"
            )
        return SamplingParams(
            n=self.n,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            cache_salt=self.cache_salt,
            resume_token_ids=self.resume_token_ids,
            prompt_logprobs=self.num_prompt_logprobs(),
            structured_outputs=spec_from_request(
                response_format=getattr(self, "response_format", None),
                guided_json=self.guided_json,
                guided_regex=self.guided_regex,
                guided_choice=self.guided_choice,
                guided_grammar=self.guided_grammar,
                structured_outputs=self.structured_outputs,
            ),
            **{k: v for k, v in defaulted.items() if k in DEFAULTED_FIELDS},
        )

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's extension: usage so far in every chunk (needs include_usage)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    # 0 only with echo: vLLM's scoring, the prompt and its logprobs back with no completion
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=ALL_LOGPROBS, le=MAX_LOGPROBS)
    echo: bool = Field(default=False, description="Return the prompt before the completion")
    best_of: int | None = Field(default=None, ge=1, le=MAX_N, description="Only best_of == n is supported")
    suffix: str | None = Field(default=None, description="Refused: fill-in-the-middle is not implemented")
    add_special_tokens: bool = Field(default=True, description="Whether text prompts get BOS etc.")
    response_format: ResponseFormat | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> None:
        """vLLM refuses it too; typed as a string so the 400 says why, not that a string is not null."""
        if value is not None:
            raise ValueError("suffix is not supported (no fill-in-the-middle here); leave it out")
        return None

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported: only best_of == n={self.n}")
        return self

    @property
    def scoring(self) -> bool:
        """echo with max_tokens 0 (vLLM's): the prompt and its logprobs, nothing generated shown."""
        return self.echo and self.max_tokens == 0

    def default_max_tokens(self) -> int | None:
        if self.scoring:
            return 1  # as vLLM: the engine computes one token, which the response leaves out
        if self.max_tokens == 0:
            raise ParameterError("max_tokens", "max_tokens=0 needs echo=true (scoring the prompt); else >= 1")
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI: null means the default, 16

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, or token ids."""
        prompt: Any = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """echo with logprobs reports the prompt's tokens too, as OpenAI's legacy completions do."""
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs


class TextPart(LenientModel):
    # input_text / output_text: the Responses API's names, which clients replaying a transcript send (vLLM
    # reads them as text too)
    type: Literal["text", "input_text", "output_text"]
    text: str

    @property
    def shown(self) -> str:
        return self.text


class RefusalPart(LenientModel):
    """An assistant turn's refusal, as OpenAI's message params allow it in `content` (vLLM reads it as text)."""

    type: Literal["refusal"]
    refusal: str

    @property
    def shown(self) -> str:
        return self.refusal


ContentPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]
TEXT_PART_TYPES = ("text", "input_text", "output_text", "refusal")


class ChatMessage(LenientModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant turn that called tools
    # an assistant turn's reasoning, sent back for the template (interleaved thinking: Qwen3's and
    # DeepSeek's templates render it); vLLM reads `reasoning`, clients send either name (specfleet answers
    # with both; the Agents SDK and Qwen's clients send `reasoning_content`)
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """A part that is not text (an image, audio, a file) named in the 400, not a union's string error."""
        for part in value if isinstance(value, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PART_TYPES:
                raise ValueError(
                    f"a content part of type {kind!r} is not supported: the models served here read text "
                    f"parts only ({', '.join(TEXT_PART_TYPES)})"
                )
        return value

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.shown for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = template_tool_calls(self.tool_calls)
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if self.role == "assistant" and reasoning is not None:  # under both names, as vLLM hands it over
            message["reasoning"] = message["reasoning_content"] = reasoning
        return message


class JsonSchemaFormat(StrictModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(
        default=None, ge=1, description="Deprecated alias of max_completion_tokens"
    )
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=ALL_LOGPROBS, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    # the chat template controls, as vLLM's (chat.render); continue_final_message needs
    # add_generation_prompt=false, a per-request chat_template needs --trust-request-chat-template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    documents: list[dict[str, str]] | None = None
    add_special_tokens: bool = False  # the template writes the special tokens; true adds BOS etc. on top
    echo: bool = False  # the last message's content before the answer when it is the answering role's
    # tool calling and reasoning (chat.py, tools.py, reasoning.py)
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs not in (None, 0) and not self.logprobs:  # vLLM's default is 0, asking nothing
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def default_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class _ConfigPatch(StrictModel):
    @model_validator(mode="before")
    @classmethod
    def _no_service_knob(cls, body: Any) -> Any:
        """A service knob (replicas) is not an engine's to apply: say where it is set instead."""
        for knob in SERVICE_KNOBS:
            if isinstance(body, dict) and knob.name in body:
                raise ValueError(
                    f"{knob.name} is a service knob, not an engine's: set spec.{knob.spec_path} (or "
                    "spec.autoscaling, where the tuner decides it), or scale the service"
                )
        return body

    def changes(self) -> dict[str, int]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


# The body of PATCH /admin/config: every live knob (specfleet.engine.knobs), optional, at or above its
# minimum; the ceilings fixed at start are the engine's to check.
if TYPE_CHECKING:
    AdminConfigPatch = _ConfigPatch
else:
    AdminConfigPatch = create_model(
        "AdminConfigPatch",
        __base__=_ConfigPatch,
        __doc__="The live knobs the tuner may change; each is checked against the ceilings fixed at start.",
        **{knob.name: (int | None, Field(default=None, ge=knob.minimum)) for knob in KNOBS},
    )
