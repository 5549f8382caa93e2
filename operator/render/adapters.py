"""`spec.adapters` -> what the engine pod needs to serve them: the LoRA flags, where each adapter's folder
is in the pod, the volumes that hold them and the step that downloads the hf:// ones.

The pod template does not list the adapters themselves (no `--lora-modules`): the operator loads each into
every ready engine through the admin API (operator/adapters.py), so adding or removing an adapter whose
folder the pod already sees loads or unloads it without a restart. What the pod sees:

- `file:///abs/path`: the path as it is (the image, or a volume of `pod.volumes`).
- `pvc://CLAIM/PATH`: each claim mounted once, read-only, at /models/adapters/pvc/CLAIM; another adapter
  on a claim already mounted changes nothing in the pod.
- `hf://ORG/NAME[@REV]`: downloaded as the model is (the same download step and the same volume:
  `model.cache.claimName`, else a download volume of `model.cache.sizeLimit`) into ORG/NAME/REV under
  /models/adapters/hf, by one init step that lists them: a new hf:// adapter rolls the pods once.
"""

from __future__ import annotations

from typing import Any

from ..spec import AdapterSpec, InferenceServiceSpec
from .model_source import (
    HF_CACHE_MOUNT,
    HF_TOKEN_DIR,
    HF_TOKEN_KEY,
    DownloadSettings,
    ResolvedSource,
    parse_quantity,
    split_hf,
    split_pvc,
)

ADAPTERS_ROOT = "/models/adapters"
HF_VOLUME = "adapters-download"
HF_TOKEN_VOLUME = "adapters-hf-token"

DOWNLOAD_ADAPTERS_SCRIPT = (
    "import sys\n"
    "from huggingface_hub import snapshot_download\n"
    "args = sys.argv[1:]\n"
    "for repo, revision, dest in zip(args[0::3], args[1::3], args[2::3]):\n"
    "    print(f'downloading adapter {repo}@{revision or \"main\"} into {dest}', flush=True)\n"
    "    snapshot_download(repo_id=repo, revision=revision or None, local_dir=dest)\n"
    "print('adapters downloaded', flush=True)\n"
)


def lora_args(spec: InferenceServiceSpec) -> list[str]:
    """The engine's LoRA flags: on when the spec lists an adapter."""
    if not spec.adapters:
        return []
    return [
        "--enable-lora",
        "--max-loras",
        str(spec.lora.max_loras),
        "--max-lora-rank",
        str(spec.lora.max_lora_rank),
    ]


def _hf_folder(source: str) -> str:
    repo, revision = split_hf(source)
    return f"{repo}/{revision or 'main'}"


def _claim_volume(claim: str) -> str:
    return f"adapters-pvc-{claim}"[:63].rstrip("-.")


def adapter_path(adapter: AdapterSpec) -> str:
    """Where the engine in the pod reads the adapter's folder (the admin API's `lora_path`)."""
    source = adapter.source
    if source.startswith("pvc://"):
        claim, path = split_pvc(source)
        return f"{ADAPTERS_ROOT}/pvc/{claim}" + (f"/{path}" if path else "")
    if source.startswith("hf://"):
        return f"{ADAPTERS_ROOT}/hf/{_hf_folder(source)}"
    return source.removeprefix("file://")


def resolve_adapters(spec: InferenceServiceSpec, download: DownloadSettings) -> ResolvedSource:
    """The adapters' volumes, engine mounts and download step (`engine_uri` unused)."""
    claims = sorted({split_pvc(a.source)[0] for a in spec.adapters if a.source.startswith("pvc://")})
    volumes: list[dict[str, Any]] = [
        {"name": _claim_volume(c), "persistentVolumeClaim": {"claimName": c, "readOnly": True}}
        for c in claims
    ]
    mounts: list[dict[str, Any]] = [
        {"name": _claim_volume(c), "mountPath": f"{ADAPTERS_ROOT}/pvc/{c}", "readOnly": True} for c in claims
    ]
    hf = [a for a in spec.adapters if a.source.startswith("hf://")]
    if not hf:
        return ResolvedSource("", volumes=volumes, mounts=mounts)
    hf_root = f"{ADAPTERS_ROOT}/hf"
    if download.cache_claim:  # the model's shared cache: each revision downloaded once for every pod
        volumes.append({"name": HF_VOLUME, "persistentVolumeClaim": {"claimName": download.cache_claim}})
        dest_root, ephemeral = HF_CACHE_MOUNT, None
    else:
        volumes.append({"name": HF_VOLUME, "emptyDir": {"sizeLimit": download.size_limit}})
        dest_root, ephemeral = hf_root, download.size_limit
    if download.hf_token_secret:
        volumes.append(
            {
                "name": HF_TOKEN_VOLUME,
                "secret": {
                    "secretName": download.hf_token_secret,
                    "defaultMode": 0o440,
                    "items": [{"key": HF_TOKEN_KEY, "path": HF_TOKEN_KEY}],
                },
            }
        )
    mounts.append({"name": HF_VOLUME, "mountPath": hf_root, "readOnly": True})
    targets = [x for a in hf for x in (*split_hf(a.source), f"{dest_root}/{_hf_folder(a.source)}")]
    return ResolvedSource(
        "",
        volumes=volumes,
        mounts=mounts,
        init_containers=[_download_container(targets, dest_root, download)],
        ephemeral_storage=ephemeral,
    )


def with_adapters(
    model: ResolvedSource, spec: InferenceServiceSpec, download: DownloadSettings
) -> ResolvedSource:
    """The model's source with the adapters' volumes, mounts and download step added to it."""
    adapters = resolve_adapters(spec, download)
    sizes = [q for q in (model.ephemeral_storage, adapters.ephemeral_storage) if q]
    return ResolvedSource(
        model.engine_uri,
        volumes=[*model.volumes, *adapters.volumes],
        mounts=[*model.mounts, *adapters.mounts],
        init_containers=[*model.init_containers, *adapters.init_containers],
        ephemeral_storage=str(sum(map(parse_quantity, sizes))) if len(sizes) > 1 else next(iter(sizes), None),
    )


def _download_container(targets: list[str], mount_path: str, download: DownloadSettings) -> dict[str, Any]:
    """The model's download step (model_source.py), for every hf:// adapter in turn."""
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/cache/hf"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": HF_VOLUME, "mountPath": mount_path},
        {"name": "cache", "mountPath": "/cache"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if download.hf_token_secret:
        env.append({"name": "HF_TOKEN_PATH", "value": f"{HF_TOKEN_DIR}/{HF_TOKEN_KEY}"})
        mounts.append({"name": HF_TOKEN_VOLUME, "mountPath": HF_TOKEN_DIR, "readOnly": True})
    return {
        "name": "download-adapters",
        "image": download.image,
        "imagePullPolicy": download.image_pull_policy,
        "command": ["python", "-c", DOWNLOAD_ADAPTERS_SCRIPT, *targets],
        "env": env,
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "securityContext": download.security_context,
        "volumeMounts": mounts,
    }
