"""vLLM's leniency for request bodies: an unknown field is accepted and reported, `null` means the default.

vLLM's `OpenAIBaseModel` takes `extra="allow"` and logs the fields it ignored (at DEBUG, so a misspelt
field fails silently there). specfleet accepts them the same way, and the server logs each ignored field
name once at WARNING and counts it in `specfleet_ignored_request_fields_total{field}` (api.py,
metrics.py). A field vLLM knows and specfleet does not implement is accepted at its default value and
refused otherwise (`REFUSED_UNLESS_DEFAULT`): ignoring `use_beam_search: true` would answer a different
question than the one asked. Bad values of the fields specfleet declares are still a 400 naming the field.
docs/server.md, "Request fields", lists every field of vLLM's protocol and what happens to it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

# A field of vLLM's request protocol that specfleet does not implement: the value accepted (vLLM's
# default, which asks for nothing) and why any other value is refused. Only consulted for fields the
# route's model does not declare.
REFUSED_UNLESS_DEFAULT: dict[str, tuple[Any, str]] = {
    "use_beam_search": (False, "beam search is not implemented"),
    "logits_processors": (None, "custom logits processors are not loaded by this server"),
    "prompt_embeds": (None, "prompt embeddings are not accepted; send text or token ids"),
    "max_repetition_pattern_size": (0, "repetition-pattern stopping is not implemented"),
    "min_repetition_pattern_size": (0, "repetition-pattern stopping is not implemented"),
    "repetition_min_count": (0, "repetition-pattern stopping is not implemented"),
    "return_tokens_as_token_ids": (False, "logprob tokens are always returned as text"),
}


def refusal(name: str, value: Any) -> str | None:
    """The 400's message for an undeclared field set to a value specfleet cannot honour, else None."""
    if name not in REFUSED_UNLESS_DEFAULT or value is None:
        return None
    default, reason = REFUSED_UNLESS_DEFAULT[name]
    if value == default and type(value) is type(default):
        return None
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return f"{name}={shown} is not supported: {reason}; leave it out or send {default!r}"


MAX_FIELD_NAME_SHOWN = 64  # an ignored field's name in a log line or metric label; longer ones are cut


def shown_name(name: str) -> str:
    """A client-chosen field name made safe for one log line and one label: printable, at most 64 chars."""
    cut = name[:MAX_FIELD_NAME_SHOWN]
    return cut if cut.isprintable() and cut.isascii() and " " not in cut else repr(cut)


class LenientModel(BaseModel):
    """A request body (or part of one) as vLLM reads it: unknown fields kept aside, null = the default."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """`"temperature": null` is the default temperature, as in vLLM (some SDKs send every unset field
        as null). A required field sent as null stays null and fails naming the field."""
        if not isinstance(data, dict):
            return data
        optional = {f.alias or name for name, f in cls.model_fields.items() if not f.is_required()}
        optional |= {name for name, f in cls.model_fields.items() if not f.is_required()}
        return {k: v for k, v in data.items() if not (v is None and k in optional)}

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """The unknown fields here and in nested request models, dotted (`messages.foo`, list positions
        left out), sorted."""
        names = {prefix + name for name in self.model_extra or {}}
        for name in type(self).model_fields:
            value = getattr(self, name)
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, LenientModel):
                    names.update(item.ignored_fields(f"{prefix}{name}."))
        return sorted(names)

    def refused_field(self) -> tuple[str, str] | None:
        """(field, message) for the first top-level unknown field that asks for what is not implemented."""
        for name, value in (self.model_extra or {}).items():
            message = refusal(name, value)
            if message is not None:
                return name, message
        return None
