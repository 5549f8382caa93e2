"""The engine's error for bad request input, at the bottom of the engine's imports (plain Python): the
sampling parameters, structured outputs and the live-config checks raise it, and the server turns it into
a 400 that names the field."""

from __future__ import annotations


class ParameterError(ValueError):
    """A request parameter out of its limits: `param` names the field (the server's 400 says which), `code`
    is OpenAI's error code."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code
