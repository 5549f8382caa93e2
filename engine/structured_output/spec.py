"""`StructuredOutputSpec`: what a request's output must match, typed and validated, hashable for the cache."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from specfleet.engine.structured_output.errors import StructuredOutputError

# The kinds of constraint, declared once: the backend compiles each (a test walks this tuple), and the
# request parsers map every request spelling onto one of them.
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputSpec:
    """kind: one of KINDS. value: json_object -> None; json_schema -> the schema as compact JSON text (key
    order kept: it is the order the output's properties follow); regex -> the pattern; choice -> the
    strings, in order; grammar -> EBNF (GBNF) text, xgrammar's dialect."""

    kind: str
    value: str | tuple[str, ...] | None = None
    # the request field it came from, for error messages; not part of equality or the cache key
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(
                f"unknown structured-output kind {self.kind!r}; expected one of {', '.join(KINDS)}"
            )
        check = _CHECKS[self.kind]
        check(self.value)

    @classmethod
    def json_object(cls, param: str = "json_object") -> StructuredOutputSpec:
        return cls("json_object", source=param)

    @classmethod
    def json_schema(cls, schema: dict | bool | str, param: str = "json_schema") -> StructuredOutputSpec:
        """schema: a dict, a bool, or its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise StructuredOutputError(f"{param} is not valid JSON: {e}", param) from None
        if not isinstance(schema, dict | bool):
            raise StructuredOutputError(
                f"{param} must be a JSON object (a JSON Schema), got {type(schema).__name__}: {_short(schema)}",
                param,
            )
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False), param)

    @classmethod
    def regex(cls, pattern: str, param: str = "regex") -> StructuredOutputSpec:
        _require_text(pattern, param, "a regular expression")
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...], param: str = "choice") -> StructuredOutputSpec:
        if not isinstance(choices, list | tuple) or not choices:
            raise StructuredOutputError(
                f"{param} must be a non-empty list of strings, got {_short(choices)}", param
            )
        bad = [c for c in choices if not isinstance(c, str) or not c]
        if bad:
            raise StructuredOutputError(
                f"{param} must hold non-empty strings only, got {_short(bad[0])}", param
            )
        return cls("choice", tuple(choices), param)

    @classmethod
    def grammar(cls, text: str, param: str = "grammar") -> StructuredOutputSpec:
        _require_text(text, param, "an EBNF grammar (GBNF, with a `root` rule)")
        return cls("grammar", text, param)

    @property
    def schema(self) -> dict | bool | None:
        """The JSON schema of a json_schema spec, parsed; None for other kinds."""
        return json.loads(self.value) if self.kind == "json_schema" else None


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _require_text(value: Any, param: str, what: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise StructuredOutputError(
            f"{param} must be {what} as a non-empty string, got {_short(value)}", param
        )


def _check_none(value: Any) -> None:
    if value is not None:
        raise StructuredOutputError(f"a json_object constraint takes no value, got {_short(value)}")


def _check_text(value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise StructuredOutputError(
            f"this structured-output kind needs a non-empty string, got {_short(value)}"
        )


def _check_choice(value: Any) -> None:
    if not isinstance(value, tuple) or not value or not all(isinstance(c, str) and c for c in value):
        raise StructuredOutputError(
            f"a choice constraint needs a non-empty tuple of non-empty strings, got {_short(value)}"
        )


_CHECKS = {
    "json_object": _check_none,
    "json_schema": _check_text,
    "regex": _check_text,
    "choice": _check_choice,
    "grammar": _check_text,
}
