"""What the API double's parts share on the wire: keys, Status responses, label selectors, merge patch."""

from __future__ import annotations

import copy
import datetime
from typing import Any

from aiohttp import web

Key = tuple[str, str, str | None, str]  # (api prefix, plural, namespace, name)


def _parse_selector(text: str) -> dict[str, str]:
    """Equality selectors (`a=b,c==d`) and existence (`a`, value ``None``-like "")."""
    selector = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.replace("==", "=").partition("=")
        selector[name] = value if "=" in part else "\0exists"
    return selector


def _selects(selector: dict[str, str], obj: dict[str, Any]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(
        name in labels if value == "\0exists" else labels.get(name) == value
        for name, value in selector.items()
    )


def _merge(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    target = target if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = _merge(target.get(key), value)
    return target


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, message: str, reason: str = "") -> web.Response:
    return web.json_response(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": message,
            "reason": reason or web.HTTPException.__name__,
            "code": code,
        },
        status=code,
    )
