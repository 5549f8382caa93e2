"""Model source URIs -> what the engine pod needs: the URI the engine is given, volumes, init steps.

- `bundled://NAME` and `file:///abs/path` pass through unchanged (the image carries the model).
- `pvc://CLAIM/PATH` mounts the claim read-only at /models/<role> and passes `file:///models/<role>/PATH`.
- `hf://ORG/NAME[@REV]` adds an init container that downloads the snapshot into an emptyDir of
  `model.cache.sizeLimit` (requested as ephemeral-storage), which the engine then mounts read-only and reads
  as `file:///models/<role>`; with `model.cache.claimName` it downloads into that claim instead, under
  `ORG/NAME/REV`, once for every pod (huggingface_hub skips files already there), and the engine mounts
  that folder of the claim read-only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

MODELS_ROOT = "/models"
# model.hfTokenSecret: the Secret key the docs name, mounted read-only for the download step only.
HF_TOKEN_KEY = "HF_TOKEN"
HF_TOKEN_DIR = "/var/run/secrets/specfleet/hf-token"
HF_CACHE_MOUNT = "/hf-cache"  # the shared cache claim, in the download step
Role = Literal["model", "draft"]

DOWNLOAD_SCRIPT = (
    "import sys\n"
    "from huggingface_hub import snapshot_download\n"
    "repo, revision, dest = sys.argv[1:4]\n"
    "print(f'downloading {repo}@{revision or \"main\"} into {dest}', flush=True)\n"
    "snapshot_download(repo_id=repo, revision=revision or None, local_dir=dest)\n"
    "print('download complete', flush=True)\n"
)


@dataclass(frozen=True)
class ResolvedSource:
    engine_uri: str
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)  # on the engine container
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    ephemeral_storage: str | None = None  # node disk the source needs (a download volume), as a quantity


@dataclass(frozen=True)
class DownloadSettings:
    image: str
    image_pull_policy: str
    security_context: dict[str, Any]
    hf_token_secret: str | None = None
    cache_claim: str | None = None  # model.cache.claimName
    size_limit: str = "40Gi"  # model.cache.sizeLimit


_SUFFIX: dict[str, Decimal | int] = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}


def parse_quantity(text: str) -> int:
    """A quantity (already valid for the CRD's pattern) in whole units, rounded up as Kubernetes does."""
    number, suffix = re.fullmatch(r"\+?([0-9.]+)(.*)", text).groups()  # type: ignore[union-attr]
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        value = Decimal(number) * Decimal(10) ** int(suffix[1:])
    else:
        value = Decimal(number) * Decimal(_SUFFIX[suffix])
    return int(value.to_integral_value(rounding="ROUND_CEILING"))


def split_pvc(uri: str) -> tuple[str, str]:
    claim, _, path = uri.removeprefix("pvc://").partition("/")
    return claim, path.strip("/")


def split_hf(uri: str) -> tuple[str, str]:
    repo, _, revision = uri.removeprefix("hf://").partition("@")
    return repo, revision


def resolve_source(uri: str, role: Role, download: DownloadSettings) -> ResolvedSource:
    mount_path = f"{MODELS_ROOT}/{role}"
    if uri.startswith("pvc://"):
        claim, path = split_pvc(uri)
        volume = f"{role}-pvc"
        return ResolvedSource(
            engine_uri=f"file://{mount_path}/{path}" if path else f"file://{mount_path}",
            volumes=[{"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
            mounts=[{"name": volume, "mountPath": mount_path, "readOnly": True}],
        )
    if uri.startswith("hf://"):
        repo, revision = split_hf(uri)
        volume = f"{role}-download"
        token = [
            {
                "name": f"{role}-hf-token",
                "secret": {
                    "secretName": download.hf_token_secret,
                    "defaultMode": 0o440,
                    "items": [{"key": HF_TOKEN_KEY, "path": HF_TOKEN_KEY}],
                },
            }
        ]
        tokens = token if download.hf_token_secret else []
        if download.cache_claim:  # one shared copy per revision, on the user's claim
            folder = f"{repo}/{revision or 'main'}"
            return ResolvedSource(
                engine_uri=f"file://{mount_path}",
                volumes=[
                    {"name": volume, "persistentVolumeClaim": {"claimName": download.cache_claim}},
                    *tokens,
                ],
                mounts=[{"name": volume, "mountPath": mount_path, "subPath": folder, "readOnly": True}],
                init_containers=[
                    _download_container(
                        role, repo, revision, volume, HF_CACHE_MOUNT, f"{HF_CACHE_MOUNT}/{folder}", download
                    )
                ],
            )
        return ResolvedSource(
            engine_uri=f"file://{mount_path}",
            volumes=[{"name": volume, "emptyDir": {"sizeLimit": download.size_limit}}, *tokens],
            mounts=[{"name": volume, "mountPath": mount_path, "readOnly": True}],
            init_containers=[
                _download_container(role, repo, revision, volume, mount_path, mount_path, download)
            ],
            ephemeral_storage=download.size_limit,
        )
    return ResolvedSource(engine_uri=uri)


def _download_container(
    role: Role, repo: str, revision: str, volume: str, mount_path: str, dest: str, download: DownloadSettings
) -> dict[str, Any]:
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/cache/hf"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": volume, "mountPath": mount_path},
        {"name": "cache", "mountPath": "/cache"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if download.hf_token_secret:
        # huggingface_hub reads the token from this file: a Secret file, not an environment variable.
        env.append({"name": "HF_TOKEN_PATH", "value": f"{HF_TOKEN_DIR}/{HF_TOKEN_KEY}"})
        mounts.append({"name": f"{role}-hf-token", "mountPath": HF_TOKEN_DIR, "readOnly": True})
    return {
        "name": f"download-{role}",
        "image": download.image,
        "imagePullPolicy": download.image_pull_policy,
        "command": ["python", "-c", DOWNLOAD_SCRIPT, repo, revision, dest],
        "env": env,
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "securityContext": download.security_context,
        "volumeMounts": mounts,
    }
