"""The one error structured outputs raise for bad input: a ParameterError, so the server answers 400
naming the field."""

from __future__ import annotations

from specfleet.engine.errors import ParameterError


class StructuredOutputError(ParameterError):
    """A structured-output request the engine cannot serve: a malformed field, two constraints at once,
    or a schema / regex / grammar the grammar engine cannot compile. `param` names the request field
    (for the OpenAI error body's `param`), and the message says what was wrong and with which value."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(param or "response_format", message)
