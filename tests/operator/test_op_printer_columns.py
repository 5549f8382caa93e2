"""`kubectl get isvc -o wide` shows every tuned knob: each field of the tuning status the tuner sets has a
printer column, and every column points at a field the CRD's schema has."""

from __future__ import annotations

import re

from isvc_schema_tools import crd_schema, load_crd
from specfleet.engine.knobs import KNOBS as ENGINE_KNOBS
from specfleet.operator.status import TuningStatus

# the engine's live knobs (their one declaration), each reported in the tuning status: a knob added there
# needs a column; the status's other integers (changesThisLoad) are not knobs
KNOBS = [knob.name for knob in ENGINE_KNOBS]


def columns() -> list[dict]:
    return load_crd()["spec"]["versions"][0]["additionalPrinterColumns"]


def test_every_tuned_knob_has_a_column() -> None:
    paths = {c["jsonPath"] for c in columns()}
    for name in KNOBS:
        alias = TuningStatus.model_fields[name].alias or name
        assert f".status.tuning.{alias}" in paths, f"no printer column for status.tuning.{alias}"
    assert len(KNOBS) >= 4


def test_default_view_stays_narrow_and_wide_adds_the_rest() -> None:
    default = [c["name"] for c in columns() if c.get("priority", 0) == 0]
    wide = [c["name"] for c in columns() if c.get("priority", 0) == 1]
    assert default == ["Model", "Replicas", "Ready", "Reason", "K", "MaxSeqs", "TPOT-p95", "Age"]
    assert {"MaxTokens", "SpecOffAbove", "Tuned", "LastDecision"} <= set(wide)


def test_every_column_points_at_a_schema_field() -> None:
    schema = crd_schema()
    for column in columns():
        path = column["jsonPath"]
        if path.startswith(".metadata."):
            continue
        node = schema
        for part in re.sub(r"\[\?\(@\.(\w+)==\"(\w+)\"\)\]", r".[]", path).strip(".").split("."):
            if part == "[]":
                node = node["items"]
                continue
            assert part in node.get("properties", {}), f"{column['name']}: {path} has no field {part}"
            node = node["properties"][part]
        kind = {"integer": "integer", "number": "number", "string": "string", "date": "string"}[
            column["type"]
        ]
        assert node.get("type") in (kind, "integer" if kind == "number" else kind), (column["name"], node)
