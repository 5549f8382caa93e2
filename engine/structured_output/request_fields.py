"""Request fields -> `StructuredOutputSpec`: pure functions for the HTTP server and the offline API.

Spellings accepted (one of them per request):
- OpenAI `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`;
- vLLM's extra body: `guided_json` (a schema, as an object or JSON text), `guided_regex`,
  `guided_choice` (list of strings), `guided_grammar` (EBNF);
- vLLM's newer `structured_outputs`: exactly one of `json`, `regex`, `choice`, `grammar`,
  `json_object: true`.
"""

from __future__ import annotations

from typing import Any

from specfleet.engine.structured_output.errors import StructuredOutputError
from specfleet.engine.structured_output.spec import StructuredOutputSpec, _short

# structured_outputs key -> how its value becomes a spec (the param names the field in errors)
_STRUCTURED_OUTPUTS_KEYS = {
    "json": lambda v, param: StructuredOutputSpec.json_schema(v, param),
    "regex": lambda v, param: StructuredOutputSpec.regex(v, param),
    "choice": lambda v, param: StructuredOutputSpec.choice(v, param),
    "grammar": lambda v, param: StructuredOutputSpec.grammar(v, param),
    "json_object": lambda v, param: _json_object_flag(v, param),
}
_GUIDED_FIELDS = {
    "guided_json": _STRUCTURED_OUTPUTS_KEYS["json"],
    "guided_regex": _STRUCTURED_OUTPUTS_KEYS["regex"],
    "guided_choice": _STRUCTURED_OUTPUTS_KEYS["choice"],
    "guided_grammar": _STRUCTURED_OUTPUTS_KEYS["grammar"],
}
_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def spec_from_request(
    *,
    response_format: Any = None,
    guided_json: Any = None,
    guided_regex: Any = None,
    guided_choice: Any = None,
    guided_grammar: Any = None,
    structured_outputs: Any = None,
) -> StructuredOutputSpec | None:
    """The one constraint a request asks for, or None. Fields left at None (and `response_format`
    `{"type": "text"}`) ask for nothing; two constraints at once are an error naming both fields.
    Pydantic models are accepted wherever a dict is (they are read through `model_dump`)."""
    found: list[tuple[str, StructuredOutputSpec]] = []
    if response_format is not None:
        spec = spec_from_response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    guided = {
        "guided_json": guided_json,
        "guided_regex": guided_regex,
        "guided_choice": guided_choice,
        "guided_grammar": guided_grammar,
    }
    for field, value in guided.items():
        if value is not None:
            found.append((field, _GUIDED_FIELDS[field](_plain(value), field)))
    if structured_outputs is not None:
        spec = spec_from_structured_outputs(structured_outputs)
        if spec is not None:
            found.append(("structured_outputs", spec))
    if len(found) > 1:
        names = [name for name, _ in found]
        raise StructuredOutputError(
            f"only one structured-output constraint may be set per request, got {', '.join(names[:-1])} and "
            f"{names[-1]}; keep one of them",
            names[-1],
        )
    return found[0][1] if found else None


def spec_from_response_format(response_format: Any) -> StructuredOutputSpec | None:
    """OpenAI's `response_format`; None for `{"type": "text"}`."""
    param = "response_format"
    fmt = _plain(response_format)
    if not isinstance(fmt, dict) or "type" not in fmt:
        raise StructuredOutputError(f"{param} must be an object with a `type`, got {_short(fmt)}", param)
    kind = fmt["type"]
    if kind not in _RESPONSE_FORMAT_TYPES:
        raise StructuredOutputError(
            f"{param}.type must be one of {', '.join(_RESPONSE_FORMAT_TYPES)}, got {_short(kind)}",
            f"{param}.type",
        )
    extra = sorted(set(fmt) - {"type", "json_schema"} if kind == "json_schema" else set(fmt) - {"type"})
    if extra:
        raise StructuredOutputError(
            f"{param} of type {kind} does not take {', '.join(extra)}", f"{param}.{extra[0]}"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec.json_object(param)
    return _spec_from_openai_json_schema(fmt.get("json_schema"), f"{param}.json_schema")


def spec_from_structured_outputs(
    value: Any, param: str = "structured_outputs"
) -> StructuredOutputSpec | None:
    """vLLM's `structured_outputs` (also the offline `SamplingParams.structured_outputs` as a dict): one
    of json, regex, choice, grammar, json_object. A `StructuredOutputSpec` passes through unchanged."""
    if isinstance(value, StructuredOutputSpec):
        return value
    fields = _plain(value)
    if not isinstance(fields, dict):
        raise StructuredOutputError(
            f"{param} must be an object with one of {', '.join(_STRUCTURED_OUTPUTS_KEYS)}, got {_short(fields)}",
            param,
        )
    unknown = sorted(set(fields) - set(_STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise StructuredOutputError(
            f"{param} does not support {', '.join(unknown)}; the supported keys are "
            f"{', '.join(_STRUCTURED_OUTPUTS_KEYS)}",
            f"{param}.{unknown[0]}",
        )
    given = [key for key, v in fields.items() if v is not None and v is not False]
    if len(given) > 1:
        raise StructuredOutputError(
            f"{param} takes exactly one of {', '.join(_STRUCTURED_OUTPUTS_KEYS)}, got {' and '.join(given)}",
            param,
        )
    if not given:
        return None
    key = given[0]
    return _STRUCTURED_OUTPUTS_KEYS[key](_plain(fields[key]), f"{param}.{key}")


def _spec_from_openai_json_schema(value: Any, param: str) -> StructuredOutputSpec:
    if not isinstance(value, dict):
        raise StructuredOutputError(
            f'{param} must be an object like {{"name": ..., "schema": {{...}}}}, got {_short(value)}', param
        )
    unknown = sorted(set(value) - {"name", "description", "schema", "strict"})
    if unknown:
        raise StructuredOutputError(f"{param} does not take {', '.join(unknown)}", f"{param}.{unknown[0]}")
    name = value.get("name")
    if name is not None and not isinstance(name, str):
        raise StructuredOutputError(f"{param}.name must be a string, got {_short(name)}", f"{param}.name")
    strict = value.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredOutputError(
            f"{param}.strict must be a boolean, got {_short(strict)}", f"{param}.strict"
        )
    if value.get("schema") is None:
        raise StructuredOutputError(
            f"{param}.schema is required: the JSON Schema the output must follow", f"{param}.schema"
        )
    return StructuredOutputSpec.json_schema(value["schema"], f"{param}.schema")


def _json_object_flag(value: Any, param: str) -> StructuredOutputSpec:
    if value is not True:
        raise StructuredOutputError(f"{param} must be true (or left out), got {_short(value)}", param)
    return StructuredOutputSpec.json_object(param)


def _plain(value: Any) -> Any:
    """Pydantic models (the server's request bodies) as plain dicts, by their field aliases."""
    dump = getattr(value, "model_dump", None)
    return dump(by_alias=True, exclude_none=True) if callable(dump) else value
