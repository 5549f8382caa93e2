"""The API double's watches: a watch stream first replays what is newer than its resourceVersion, then
gets every write's event (ADDED, MODIFIED, DELETED) for objects its namespace and label selector match."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

from aiohttp import web

from kube_double.wire import Key, _selects

Watcher = tuple[str, str, str | None, dict[str, str], asyncio.Queue[dict[str, Any] | None]]


class Watch:
    """Watch streams; FakeKube mixes it in and Store's writes call `_notify`."""

    objects: dict[Key, dict[str, Any]]
    _watchers: list[Watcher]

    def _notify(self, key: Key, kind: str, obj: dict[str, Any]) -> None:
        for prefix, plural, namespace, selector, queue in self._watchers:
            if (prefix, plural) == key[:2] and namespace in (None, key[2]) and _selects(selector, obj):
                queue.put_nowait({"type": kind, "object": copy.deepcopy(obj)})

    async def _watch(
        self, request: web.Request, prefix: str, plural: str, namespace: str | None, selector: dict[str, str]
    ) -> web.StreamResponse:
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        since = int(request.query.get("resourceVersion", "0") or 0)
        for k, obj in self.objects.items():
            if (
                k[:2] == (prefix, plural)
                and namespace in (None, k[2])
                and _selects(selector, obj)
                and int(obj["metadata"]["resourceVersion"]) > since
            ):
                queue.put_nowait({"type": "ADDED", "object": copy.deepcopy(obj)})
        entry = (prefix, plural, namespace, selector, queue)
        self._watchers.append(entry)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        try:
            while (event := await queue.get()) is not None:
                await response.write(json.dumps(event).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.remove(entry)
        return response

    def _close_watches(self) -> None:
        """End every open watch stream (the server is stopping)."""
        for *_, queue in self._watchers:
            queue.put_nowait(None)
