"""The engine's error for bad request input, at the bottom of the engine's imports (plain Python): the
sampling parameters, structured outputs and the live-config checks raise it, and the server turns it into
a 400 that names the field. And its error for a checkpoint it cannot run (`UnsupportedModel`)."""

from __future__ import annotations


class ParameterError(ValueError):
    """A request parameter out of its limits: `param` names the field (the server's 400 says which), `code`
    is OpenAI's error code."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a request longer than the context


def context_length_error(param: str, limit: int, detail: str) -> ParameterError:
    """A request that does not fit the model's context of `limit` tokens, worded as OpenAI's and vLLM's 400
    opens ("This model's maximum context length is N tokens. However, ..."): clients tell an overflow from
    other 400s by that sentence, not by the code (LiteLLM raises ContextWindowExceededError, which its
    context-window fallbacks act on, only for it). `detail` says what did not fit and what to shorten."""
    return ParameterError(
        param,
        f"This model's maximum context length is {limit} tokens. However, {detail}",
        CONTEXT_LENGTH_EXCEEDED,
    )


class UnsupportedModel(ValueError):
    """A checkpoint this engine does not run (its config.json `architectures`, a RoPE type): the message
    names the field and what is supported, so the engine core logs it at start without a traceback (the
    stack says nothing the message does not)."""
