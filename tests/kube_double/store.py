"""The API double's store: objects with uid, resourceVersion and generation; field managers and
server-side apply (list-maps merged by key, 409 on a conflict unless forced); deletion with finalizers and
garbage collection of objects whose owners are all gone."""

from __future__ import annotations

import copy
import itertools
import uuid
from typing import Any

from aiohttp import web
from kube_admission import list_map_keys

from kube_double.wire import Key, _now, _status

Seg = str | tuple[str, str, Any]  # a field name, or ("k", key field, key value) for an item of a list-map
FieldPath = tuple[Seg, ...]
_MISSING = object()


# ---- field paths (server-side apply) ---------------------------------------------------------------------
def _names(path: FieldPath) -> tuple[str, ...]:
    return tuple(s for s in path if isinstance(s, str))


def flatten(value: Any, keys: dict[tuple[str, ...], str], path: FieldPath = ()) -> dict[FieldPath, Any]:
    """Leaf fields of an object; lists are atomic except list-maps, whose items are keyed."""
    if isinstance(value, dict) and value:
        out: dict[FieldPath, Any] = {}
        for name, child in value.items():
            out.update(flatten(child, keys, (*path, name)))
        return out
    if isinstance(value, list) and _names(path) in keys:
        key = keys[_names(path)]
        out = {}
        for item in value:
            out.update(flatten(item, keys, (*path, ("k", key, item.get(key)))))
        return out
    return {path: copy.deepcopy(value)}


def _item(items: list[Any], seg: tuple[str, str, Any]) -> dict[str, Any] | None:
    return next((item for item in items if isinstance(item, dict) and item.get(seg[1]) == seg[2]), None)


def set_at(obj: dict[str, Any], path: FieldPath, value: Any) -> None:
    node: Any = obj
    for index, seg in enumerate(path):
        last = index == len(path) - 1
        if isinstance(seg, tuple):  # node is a list-map
            item = _item(node, seg)
            if item is None:
                item = {seg[1]: seg[2]}
                node.append(item)
            node = item
            continue
        if last:
            node[seg] = copy.deepcopy(value)
            return
        container: type = list if isinstance(path[index + 1], tuple) else dict
        if not isinstance(node.get(seg), container):
            node[seg] = container()
        node = node[seg]


def del_at(obj: dict[str, Any], path: FieldPath) -> None:
    """Remove one leaf; removing a list-map item's key removes the item."""
    node: Any = obj
    parents: list[Any] = []
    for seg in path[:-1]:
        parents.append(node)
        node = (
            _item(node, seg)
            if isinstance(seg, tuple)
            else (node.get(seg) if isinstance(node, dict) else None)
        )
        if node is None:
            return
    last = path[-1]
    if len(path) >= 2 and isinstance(path[-2], tuple) and path[-2][1] == last:
        parents[-1][:] = [item for item in parents[-1] if item is not node]
    elif isinstance(last, tuple):
        node[:] = [item for item in node if item is not _item(node, last)]
    elif isinstance(node, dict):
        node.pop(last, None)
        # a map left empty by the removal goes too (its manager owned it only through these fields)
        for parent, seg in zip(reversed(parents), reversed(path[:-1]), strict=False):
            if isinstance(seg, str) and isinstance(parent, dict) and parent.get(seg) == {}:
                parent.pop(seg)
            else:
                break


def _render_path(path: FieldPath) -> str:
    return "".join(f"[{s[1]}={s[2]}]" if isinstance(s, tuple) else f".{s}" for s in path)


class Store:
    """Storage and field ownership; FakeKube mixes it in (its `_write` admits, `_notify` tells watchers)."""

    objects: dict[Key, dict[str, Any]]
    managers: dict[Key, dict[str, set[FieldPath]]]  # object -> field manager -> fields it owns
    discovery: dict[str, list[tuple[str, str, bool, list[str]]]]
    crds: dict[tuple[str, str], Any]
    _rv: itertools.count[int]

    def _has_sub(self, prefix: str, plural: str, sub: str) -> bool:
        return any(r[0] == plural and sub in r[3] for r in self.discovery.get(prefix, []))

    def _keys(self, key: Key) -> dict[tuple[str, ...], str]:
        crd = self.crds.get(key[:2])
        found = list_map_keys(crd.schema) if crd else {}
        return {**found, ("metadata", "ownerReferences"): "uid"}

    def _own(self, key: Key, manager: str, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
        """A non-apply write: its manager takes the fields it changed; removed fields lose their owners."""
        keys = self._keys(key)
        before = flatten({k: v for k, v in (old or {}).items() if k != "metadata"}, keys)
        after = flatten({k: v for k, v in new.items() if k != "metadata"}, keys)
        owned = self.managers.setdefault(key, {})
        for path, value in after.items():
            if before.get(path, _MISSING) != value:
                for other in owned.values():
                    other.discard(path)
                owned.setdefault(manager, set()).add(path)
        for path in set(before) - set(after):
            for other in owned.values():
                other.discard(path)

    def _store(self, key: Key, obj: dict[str, Any], kind_event: str | None = None) -> dict[str, Any]:
        old = self.objects.get(key)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("name", key[3])
        if key[2] is not None:
            meta["namespace"] = key[2]
        if old is None:
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
            meta["generation"] = 1
        else:
            meta["uid"] = old["metadata"]["uid"]
            meta["creationTimestamp"] = old["metadata"]["creationTimestamp"]
            if "deletionTimestamp" in old["metadata"]:
                meta["deletionTimestamp"] = old["metadata"]["deletionTimestamp"]
            meta["resourceVersion"] = old["metadata"].get("resourceVersion")
            changed = {k: v for k, v in obj.items() if k not in ("metadata", "status")} != {
                k: v for k, v in old.items() if k not in ("metadata", "status")
            }
            meta["generation"] = old["metadata"].get("generation", 1) + (1 if changed else 0)
            if obj == old:
                return obj  # a no-op write changes nothing, not even resourceVersion
        meta["resourceVersion"] = str(next(self._rv))
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self.objects[key] = obj
            self._delete(key)
            return obj
        self.objects[key] = obj
        self._notify(key, kind_event or ("ADDED" if old is None else "MODIFIED"), obj)
        return obj

    def _delete(self, key: Key) -> dict[str, Any] | None:
        obj = self.objects.get(key)
        if obj is None:
            return None
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                updated = copy.deepcopy(obj)
                updated["metadata"]["deletionTimestamp"] = _now()
                updated["metadata"]["deletionGracePeriodSeconds"] = 0
                updated["metadata"]["resourceVersion"] = str(next(self._rv))
                self.objects[key] = updated
                self._notify(key, "MODIFIED", updated)
            return self.objects[key]
        del self.objects[key]
        self.managers.pop(key, None)
        self._notify(key, "DELETED", obj)
        self._collect_garbage()
        return obj

    def _collect_garbage(self) -> None:
        """Delete every object whose owners are all gone (background propagation, done at once)."""
        alive = {o["metadata"]["uid"] for o in self.objects.values()}
        for key, obj in list(self.objects.items()):
            owners = obj["metadata"].get("ownerReferences") or []
            if owners and not any(o.get("uid") in alive for o in owners) and key in self.objects:
                if not obj["metadata"].get("deletionTimestamp"):
                    self._delete(key)

    def _apply(
        self,
        request: web.Request,
        key: Key,
        existing: dict[str, Any] | None,
        body: dict[str, Any],
        sub: str | None,
    ) -> web.Response:
        manager = request.query.get("fieldManager")
        if not manager:
            return _status(422, "PATCH with application/apply-patch+yaml requires fieldManager", "Invalid")
        force = request.query.get("force") == "true"
        if existing is None and sub is not None:
            return _status(404, f"{key[1]} {key[3]!r} not found", "NotFound")
        keys = self._keys(key)
        has_status = self._has_sub(key[0], key[1], "status")

        def in_scope(path: FieldPath) -> bool:
            if path[0] == "metadata":
                return len(path) > 1 and path[1] in ("labels", "annotations", "ownerReferences", "finalizers")
            if path[0] in ("apiVersion", "kind"):
                return False
            return (path[0] == "status") == (sub == "status") if has_status else True

        applied = {
            p: v for p, v in flatten(body, keys).items() if in_scope(p) and v is not None
        }  # null: not set
        if existing is None:
            new = {
                "apiVersion": body.get("apiVersion"),
                "kind": body.get("kind"),
                "metadata": {"name": key[3]},
            }
            for path, value in applied.items():
                set_at(new, path, value)
            response = self._write(request, key, None, new, None, created=True, manager=manager)
            if response.status == 201:
                self.managers[key] = {manager: set(applied)}
            return response
        owned = self.managers.setdefault(key, {})
        current = flatten(existing, keys)
        conflicts = [
            (path, other)
            for path, value in applied.items()
            for other, paths in owned.items()
            if other != manager and path in paths and current.get(path, _MISSING) != value
        ]
        if conflicts and not force:
            listed = "; ".join(f'conflict with "{other}": {_render_path(path)}' for path, other in conflicts)
            return _status(409, f"Apply failed with {len(conflicts)} conflict(s): {listed}", "Conflict")
        new = copy.deepcopy(existing)
        mine = owned.get(manager, set())
        for path in sorted(mine - set(applied), key=len, reverse=True):
            if not any(path in paths for other, paths in owned.items() if other != manager):
                del_at(new, path)
        for path, value in applied.items():
            set_at(new, path, value)
        saved = {m: set(ps) for m, ps in owned.items()}
        response = self._write(request, key, existing, new, sub, manager=manager)
        if response.status >= 400:
            self.managers[key] = saved
            return response
        for path, other in conflicts:
            owned[other].discard(path)  # forced: the field changes hands
        owned[manager] = set(applied) | {p for p in owned.get(manager, set()) if not in_scope(p)}
        return response
