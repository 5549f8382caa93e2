"""What real clusters add to the engine pods (service account, pull secrets, labels, env, volumes), kept off
the names, variables and paths the operator renders itself."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from ..resources import PREFILL_KEY_DIR, PREFILL_KEY_VOLUME, TUNED_CONFIG_DIR, TUNED_CONFIG_VOLUME
from .fields import OptionalName, _Spec, cel, upstream

# Env variables, volumes and mount paths the operator renders itself: a pod-template entry may not reuse
# them (server-side apply refuses duplicate keys, and the engine depends on them).
RESERVED_ENV = (
    "SPECFLEET_ADMIN_TOKEN_FILE",
    "SPECFLEET_ADMIN_TOKEN",
    "SPECFLEET_CACHE",
    "SPECFLEET_SERVICE_NAME",
    "HOME",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRITON_CACHE_DIR",
    "SPECFLEET_POD_IP",
    "SPECFLEET_NODES",
    "SPECFLEET_NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
RESERVED_VOLUMES = ("tmp", "cache", "admin-token", "dshm", TUNED_CONFIG_VOLUME, PREFILL_KEY_VOLUME)
RESERVED_VOLUME_PREFIXES = ("model-", "draft-")
RESERVED_MOUNT_PATHS = (
    "/tmp",
    "/cache",
    "/dev/shm",
    "/var/run/secrets/specfleet/admin",
    PREFILL_KEY_DIR,
    TUNED_CONFIG_DIR,
    "/models/model",
    "/models/draft",
)


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


class PodTemplateSpec(_Spec):
    """What real clusters add to the engine pods; the operator's own fields keep precedence."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    f"!has(self.env) || self.env.all(e, !(e.name in {_cel_list(RESERVED_ENV)}))",
                    f"pod.env may not set the operator's own variables {', '.join(RESERVED_ENV)}",
                ),
                cel(
                    f"!has(self.volumes) || self.volumes.all(v, !(v.name in {_cel_list(RESERVED_VOLUMES)}) && "
                    + " && ".join(f"!v.name.startsWith('{p}')" for p in RESERVED_VOLUME_PREFIXES)
                    + ")",
                    f"pod.volumes may not use the operator's volume names {', '.join(RESERVED_VOLUMES)} or names "
                    f"starting with {' or '.join(RESERVED_VOLUME_PREFIXES)}",
                ),
                cel(
                    f"!has(self.volumeMounts) || self.volumeMounts.all(m, !(m.mountPath in {_cel_list(RESERVED_MOUNT_PATHS)}))",
                    f"pod.volumeMounts may not mount over the operator's paths {', '.join(RESERVED_MOUNT_PATHS)}",
                ),
            ]
        }
    )
    service_account_name: OptionalName = Field("", description="ServiceAccount of the engine pods.")
    automount_service_account_token: bool = Field(
        False,
        description="Mount the ServiceAccount's token (workload identity); the engine itself never uses it.",
    )
    image_pull_secrets: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra=upstream("io.k8s.api.core.v1.LocalObjectReference"),
    )
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels (the operator's win).")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra pod annotations.")
    env: list[dict[str, Any]] = Field(
        default_factory=list, max_length=128, json_schema_extra=upstream("io.k8s.api.core.v1.EnvVar")
    )
    env_from: list[dict[str, Any]] = Field(
        default_factory=list, max_length=16, json_schema_extra=upstream("io.k8s.api.core.v1.EnvFromSource")
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list, max_length=32, json_schema_extra=upstream("io.k8s.api.core.v1.Volume")
    )
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=32,
        description="Mounts into the engine container.",
        json_schema_extra=upstream("io.k8s.api.core.v1.VolumeMount"),
    )

    @model_validator(mode="after")
    def _not_reserved(self) -> PodTemplateSpec:
        for e in self.env:
            if e.get("name") in RESERVED_ENV:
                raise ValueError(
                    f"pod.env name={e.get('name')!r} is one of the operator's own variables "
                    f"({', '.join(RESERVED_ENV)})"
                )
        for v in self.volumes:
            name = str(v.get("name", ""))
            if name in RESERVED_VOLUMES or name.startswith(RESERVED_VOLUME_PREFIXES):
                raise ValueError(
                    f"pod.volumes name={name!r} is the operator's ({', '.join(RESERVED_VOLUMES)}, "
                    f"{' or '.join(RESERVED_VOLUME_PREFIXES)}*)"
                )
        for m in self.volume_mounts:
            if m.get("mountPath") in RESERVED_MOUNT_PATHS:
                raise ValueError(
                    f"pod.volumeMounts mountPath={m.get('mountPath')!r} is the operator's "
                    f"({', '.join(RESERVED_MOUNT_PATHS)})"
                )
        return self
