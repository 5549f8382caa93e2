"""The API double's admission: RBAC (the chart's own Roles, rendered by Helm's engine), custom resources
through their CRD's structural schema (defaulting, pruning, validation, CEL), the built-in kinds it
validates (Leases), the status subresource's scope and OwnerReferencesPermissionEnforcement."""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web
from kube_admission import apply_defaults, cel_errors, prune, schema_errors

from kube_double.wire import Key, _status

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "inferenceservice.yaml"
CHART = REPO / "charts" / "specfleet"


# ---- RBAC ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    api_groups: frozenset[str]
    resources: frozenset[str]
    verbs: frozenset[str]

    def allows(self, verb: str, group: str, resource: str) -> bool:
        return (
            (group in self.api_groups or "*" in self.api_groups)
            and (resource in self.resources or "*" in self.resources)
            and (verb in self.verbs or "*" in self.verbs)
        )


class Rbac:
    """The rules bound to one ServiceAccount: ClusterRoles everywhere, Roles in their namespace."""

    def __init__(self, cluster: list[Rule], namespaced: dict[str, list[Rule]]) -> None:
        self.cluster = cluster
        self.namespaced = namespaced

    @classmethod
    def from_objects(cls, objects: Iterable[dict[str, Any]], account: str, account_namespace: str) -> Rbac:
        def rules(role: dict[str, Any]) -> list[Rule]:
            return [
                Rule(
                    frozenset(r.get("apiGroups", [])),
                    frozenset(r.get("resources", [])),
                    frozenset(r.get("verbs", [])),
                )
                for r in role.get("rules") or []
            ]

        objects = list(objects)
        roles = {
            (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
            for o in objects
            if o["kind"] in ("Role", "ClusterRole")
        }
        cluster: list[Rule] = []
        namespaced: dict[str, list[Rule]] = {}
        for binding in objects:
            if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            if not any(
                s.get("kind") == "ServiceAccount"
                and s.get("name") == account
                and s.get("namespace") == account_namespace
                for s in binding.get("subjects") or []
            ):
                continue
            ref = binding["roleRef"]
            namespace = binding["metadata"].get("namespace")
            role = roles.get((ref["kind"], namespace if ref["kind"] == "Role" else None, ref["name"]))
            if role is None:
                continue  # a binding to a role that does not exist grants nothing
            if binding["kind"] == "ClusterRoleBinding":
                cluster += rules(role)
            else:
                namespaced.setdefault(namespace, []).extend(rules(role))
        return cls(cluster, namespaced)

    @classmethod
    def from_chart(
        cls, values: dict[str, Any] | None = None, release: str = "sf", namespace: str = "specfleet-system"
    ) -> Rbac:
        """The operator's permissions as the Helm chart grants them, rendered by Helm's own engine."""
        objects = _render_chart(json.dumps(values or {}, sort_keys=True), release, namespace)
        (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        return cls.from_objects(objects, account, namespace)

    def allows(self, verb: str, group: str, resource: str, namespace: str | None) -> bool:
        rules = self.cluster + (self.namespaced.get(namespace, []) if namespace else [])
        return any(rule.allows(verb, group, resource) for rule in rules)


@functools.cache
def _render_chart(values_json: str, release: str, namespace: str) -> list[dict[str, Any]]:
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(
            values=json.loads(values_json), name=release, namespace=namespace, is_install=True
        )
    return [
        doc
        for name, text in rendered.items()
        if not name.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


# ---- custom resources ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CustomResource:
    """The parts of a CRD the API server applies on writes."""

    prefix: str
    plural: str
    kind: str
    schema: dict[str, Any]
    subresources: tuple[str, ...] = ()

    @classmethod
    def load(cls, path: Path) -> CustomResource:
        # libyaml's loader where PyYAML has it: a whole upstream CRD (~0.4 MB) takes 15 s in pure Python
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        (version,) = crd["spec"]["versions"]
        return cls(
            f"/apis/{crd['spec']['group']}/{version['name']}",
            crd["spec"]["names"]["plural"],
            crd["spec"]["names"]["kind"],
            version["schema"]["openAPIV3Schema"],
            tuple(sorted(version.get("subresources") or {})),
        )

    def admit(
        self, obj: dict[str, Any], only_status: bool, validate: bool = True
    ) -> tuple[dict[str, Any], list[str]]:
        """The object as stored (defaulted, pruned) and what is wrong with it."""
        obj = prune(self.schema, apply_defaults(self.schema, obj))
        if not validate:
            return obj, []
        if only_status:
            status_schema = self.schema["properties"]["status"]
            status = obj.get("status") or {}
            errors = [f"status.{e}" for e in schema_errors(status_schema, status)]
            return obj, errors or cel_errors(status_schema, status, "status")
        body = {k: v for k, v in obj.items() if k != "metadata"}
        schema = {
            **self.schema,
            "properties": {k: v for k, v in self.schema["properties"].items() if k != "metadata"},
        }
        errors = schema_errors(schema, body)
        return obj, errors or cel_errors(self.schema, obj)


# ---- built-in kinds the double validates ------------------------------------------------------------
MICRO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)")


def _admit_any(method: str, key: Key, new: dict[str, Any]) -> web.Response | None:
    return None


def _admit_lease(method: str, key: Key, new: dict[str, Any]) -> web.Response | None:
    """A coordination.k8s.io/v1 Lease as the API server takes it: updates must carry the resourceVersion
    they read (the Lease strategy allows no unconditional update, so a stale one is a 409), MicroTime
    fields have exactly six fractional digits (anything else fails to decode: 400), and the spec's
    numbers are validated (422)."""
    name = f'Lease.coordination.k8s.io "{key[3]}"'
    if method == "PUT" and not (new.get("metadata") or {}).get("resourceVersion"):
        return _status(
            422,
            f"{name} is invalid: metadata.resourceVersion: Invalid value: 0x0: must be specified for an update",
            "Invalid",
        )
    spec = new.get("spec") or {}
    for field_name in ("acquireTime", "renewTime"):
        value = spec.get(field_name)
        if value is not None and not (isinstance(value, str) and MICRO_TIME.fullmatch(value)):
            return _status(
                400,
                f'Lease in version "v1" cannot be handled as a Lease: spec.{field_name}: parsing time '
                f'{json.dumps(value)} as "2006-01-02T15:04:05.000000Z07:00": cannot parse',
                "BadRequest",
            )
    errors = []
    duration, transitions = spec.get("leaseDurationSeconds"), spec.get("leaseTransitions")
    if duration is not None and (not isinstance(duration, int) or duration <= 0):
        errors.append(f"spec.leaseDurationSeconds: Invalid value: {duration}: must be greater than 0")
    if transitions is not None and (not isinstance(transitions, int) or transitions < 0):
        errors.append(
            f"spec.leaseTransitions: Invalid value: {transitions}: must be greater than or equal to 0"
        )
    if spec.get("holderIdentity") is not None and not isinstance(spec["holderIdentity"], str):
        errors.append(f"spec.holderIdentity: Invalid value: {spec['holderIdentity']!r}: must be a string")
    if spec.get("preferredHolder") and not spec.get("strategy"):
        errors.append("spec.preferredHolder: Forbidden: may only be specified if `strategy` is defined")
    if errors:
        return _status(422, f"{name} is invalid: " + "; ".join(errors), "Invalid")
    return None


BUILTIN_ADMISSION = {("/apis/coordination.k8s.io/v1", "leases"): _admit_lease}


class Admission:
    """Every write's checks before it is stored; FakeKube mixes it in (with Store's `_own` and `_store`)."""

    rbac: Rbac | None
    owner_reference_enforcement: bool
    crds: dict[tuple[str, str], CustomResource]
    discovery: dict[str, list[tuple[str, str, bool, list[str]]]]

    def _scoped(
        self, key: Key, existing: dict[str, Any], new: dict[str, Any], sub: str | None
    ) -> dict[str, Any]:
        """Only status through /status; never status through the object (when it has the subresource)."""
        if not self._has_sub(key[0], key[1], "status"):
            return new
        if sub == "status":
            out = copy.deepcopy(existing)
            if "status" in new:
                out["status"] = new["status"]
            else:
                out.pop("status", None)
            return out
        new = copy.deepcopy(new)
        new.pop("status", None)
        if "status" in existing:
            new["status"] = copy.deepcopy(existing["status"])
        return new

    def _write(
        self,
        request: web.Request,
        key: Key,
        existing: dict[str, Any] | None,
        new: dict[str, Any],
        sub: str | None,
        created: bool = False,
        manager: str | None = None,
    ) -> web.Response:
        meta = new.setdefault("metadata", {})
        old_meta = (existing or {}).get("metadata", {})
        if old_meta.get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
            if added:
                return _status(
                    422,
                    f"{key[1]} {key[3]!r} is being deleted: no new finalizers can be added ({sorted(added)})",
                    "Invalid",
                )
        problem = self._owner_reference_problem(key, old_meta, meta)
        if problem:
            return _status(403, problem, "Forbidden")
        refused = BUILTIN_ADMISSION.get(key[:2], _admit_any)(request.method, key, new)
        if refused is not None:
            return refused
        crd = self.crds.get(key[:2])
        if crd is not None:
            # ratcheting (Kubernetes >= 1.30): a write that leaves an invalid spec as it was is not refused for it
            unchanged = (
                existing is not None
                and sub is None
                and crd.admit(copy.deepcopy(existing), False, False)[0].get("spec")
                == crd.admit(copy.deepcopy(new), False, False)[0].get("spec")
            )
            new, errors = crd.admit(new, only_status=sub == "status", validate=not unchanged)
            if errors:
                return _status(
                    422,
                    f'{crd.kind}.{key[0].split("/")[2]} "{key[3]}" is invalid: ' + "; ".join(errors),
                    "Invalid",
                )
        manager = (
            manager
            or request.query.get("fieldManager")
            or request.headers.get("User-Agent", "unknown").split("/")[0]
        )
        self._own(key, manager, existing, new)
        stored = self._store(key, new)
        return web.json_response(stored, status=201 if created else 200)

    def _owner_reference_problem(
        self, key: Key, old_meta: dict[str, Any], meta: dict[str, Any]
    ) -> str | None:
        """OwnerReferencesPermissionEnforcement: blocking an owner's deletion needs update on its finalizers."""
        if self.rbac is None or not self.owner_reference_enforcement:
            return None
        before = {o.get("uid") for o in old_meta.get("ownerReferences") or [] if o.get("blockOwnerDeletion")}
        for ref in meta.get("ownerReferences") or []:
            if not ref.get("blockOwnerDeletion") or ref.get("uid") in before:
                continue
            group = ref["apiVersion"].rpartition("/")[0]
            prefix = f"/apis/{ref['apiVersion']}" if group else "/api/v1"
            plural = next(
                (r[0] for r in self.discovery.get(prefix, []) if r[1] == ref["kind"]), ref["kind"].lower()
            )
            if not self.rbac.allows("update", group, f"{plural}/finalizers", key[2]):
                return (
                    f"{key[1]} {key[3]!r} is forbidden: cannot set blockOwnerDeletion if an ownerReference refers "
                    f'to a resource you can\'t set finalizers on: {plural}/finalizers in API group "{group}"'
                )
        return None
