"""`EngineConfig` on the command line, both ways: the engine flags generated from its fields (as vLLM does
from its config dataclasses), which `specfleet serve` and `specfleet generate` parse, and the flags that
set chosen fields, which whoever starts an engine writes (the operator's Deployment, `specfleet up`).

Plain Python on purpose: the operator imports it, and stays free of torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping
from dataclasses import fields
from typing import Any, get_args, get_type_hints

from specfleet.engine.config import EngineConfig
from specfleet.engine.spec_decode.methods import NONE

DEFAULT_K = 4  # --num-speculative-tokens when a speculative method is given without it
_FIELDS = {f.name: f for f in fields(EngineConfig)}


def flag(name: str) -> str:
    """The flag that sets `EngineConfig.<name>`: `--field-name`, or the spelling its metadata gives."""
    try:
        f = _FIELDS[name]
    except KeyError:
        raise KeyError(f"{name!r} is not an EngineConfig field; use one of {sorted(_FIELDS)}") from None
    return f.metadata.get("flag", "--" + name.replace("_", "-"))


def flag_args(values: Mapping[str, object]) -> list[str]:
    """The command line that sets each of these `EngineConfig` fields to its value, in their order (for
    fields that take a value: a bool field's flag takes none)."""
    return [arg for name, value in values.items() for arg in (flag(name), str(value))]


def add_engine_args(parser: argparse.ArgumentParser, exclude: Collection[str] = ()) -> None:
    """One flag per `EngineConfig` field but those in `exclude`, generated from the field: `--field-name`,
    its type, default and help text, and the `choices`, `flag` or `cli_default` its metadata adds (see
    `config._opt`)."""
    hints = get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine", "EngineConfig's fields (specfleet.engine.config)")
    for f in fields(EngineConfig):
        if f.name in exclude:
            continue
        meta = f.metadata
        if hints[f.name] is bool:  # a flag that flips the default
            group.add_argument(
                flag(f.name),
                dest=f.name,
                action="store_false" if f.default else "store_true",
                help=meta.get("help"),
            )
            continue
        kinds = [t for t in get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        group.add_argument(
            flag(f.name),
            dest=f.name,
            type=kinds[0],  # str for text fields: argparse's identity conversion
            default=meta.get("cli_default", f.default),
            choices=meta.get("choices"),
            help=meta.get("help"),
        )


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`EngineConfig`'s keyword arguments from parsed engine flags; a field the parser left out
    (`add_engine_args`' `exclude`) keeps its default. Resolves the defaults the CLI owns (`cli_default`)."""
    given = vars(args)
    kwargs = {name: given[name] for name in _FIELDS if name in given}
    if kwargs.get("num_speculative_tokens", 0) is None:
        kwargs["num_speculative_tokens"] = DEFAULT_K if kwargs["speculative_method"] != NONE else 0
    return kwargs
