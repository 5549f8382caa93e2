"""The model's tokenizer in the router pods (routing.kvEvents): an init container copies the tokenizer files
from where the engines read the model into an emptyDir, which the router mounts read-only and reads with
`--tokenizer` (router/cli.py: token blocks hashed as the engine hashes them, chat rendered with the model's
template), as llm-d's endpoint picker reads the model's tokenizer to match the engines' KV events.

Per model source, where the files come from and which image copies them:

- `pvc://CLAIM/PATH`: the engines' claim, mounted read-only; the router's own image copies.
- `hf://ORG/NAME[@REV]`: the tokenizer files alone are downloaded as the engines' init step downloads the
  model (into `model.cache.claimName`'s folder for the revision when set, where the engines' files are
  skipped, else straight into the emptyDir), with `model.hfTokenSecret`; the model downloader image, else
  the router's own (its `tokenizers` brings huggingface_hub).
- `file:///PATH` and `bundled://NAME`: the files are in the engine image, which copies them; a GGUF (every
  bundled model) carries its tokenizer inside, which transformers writes out as the engine's loader does.

The step fails, naming the source, when the model has no tokenizer.json: the router would start without
the tokenizer the engines' events need. The engines' chat flags that change what they prefill for a chat
request go to the router too (`engine_chat_args`); a `--chat-template` file the engines read from their own
pod the router cannot read, so then the step leaves the model's template out and the router matches chat
requests on its estimate (completions stay on the events) rather than on another template's tokens.
"""

from __future__ import annotations

import argparse
from typing import Any

from specfleet.router.chat_template import add_engine_chat_flags

from ..config import OperatorConfig
from ..inference_service import InferenceService
from ..resources import TOKENIZER_DIR
from .deployment import CONTAINER_SECURITY_CONTEXT
from .model_source import (
    HF_CACHE_MOUNT,
    HF_TOKEN_DIR,
    HF_TOKEN_KEY,
    MODELS_ROOT,
    split_hf,
    split_pvc,
)

TOKENIZER_VOLUME = "tokenizer"
TOKENIZER_TMP_VOLUME = "tokenizer-tmp"  # the step's HOME and caches (its root filesystem is read-only)
SOURCE_VOLUME = "tokenizer-source"
TOKEN_VOLUME = "tokenizer-hf-token"
# What the router reads (router/cli.py load_encoder, router/chat_template.py ChatTemplate.load).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
EXTRA_TEMPLATES = "additional_chat_templates"
# Set on the step when the engines run with their own --chat-template: the model's template is left out.
NO_CHAT_TEMPLATE_ENV = "SPECFLEET_NO_CHAT_TEMPLATE"

# argv: MODE ... DEST. copy SRC: the files SRC holds. gguf PATH|bundled://NAME: the tokenizer a GGUF carries.
# hf REPO REV CACHE: the files downloaded into CACHE (skipped where there), then copied.
COPY_SCRIPT = f"""\
import json, os, shutil, sys
FILES, EXTRA, NO_CHAT_TEMPLATE = {TOKENIZER_FILES!r}, {EXTRA_TEMPLATES!r}, {NO_CHAT_TEMPLATE_ENV!r}
from pathlib import Path
mode, *rest, dest = sys.argv[1:]
dest = Path(dest)
if mode == "gguf":
    source = rest[0]
    if source.startswith("bundled://"):
        from specfleet.engine.model_source import _bundled_gguf
        gguf = _bundled_gguf(source.removeprefix("bundled://"))
    else:
        gguf = Path(source)
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dest)
    src = dest
elif mode == "hf":
    repo, revision, cache = rest
    from huggingface_hub import snapshot_download
    patterns = [*FILES, EXTRA + "/*"]
    snapshot_download(repo_id=repo, revision=revision or None, local_dir=cache, allow_patterns=patterns)
    src = Path(cache)
else:
    src = Path(rest[0])
if not (src / "tokenizer.json").is_file():
    sys.exit(f"{{src}} has no tokenizer.json: the router cannot read the engines' KV events without it "
             "(routing.kvEvents: false routes on the router's estimate)")
if src != dest:
    for name in FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dest / name)
    if (src / EXTRA).is_dir():
        shutil.copytree(src / EXTRA, dest / EXTRA, dirs_exist_ok=True)
if NO_CHAT_TEMPLATE in os.environ:  # the engines render another template, which the router cannot read
    (dest / "chat_template.jinja").unlink(missing_ok=True)
    shutil.rmtree(dest / EXTRA, ignore_errors=True)
    config = dest / "tokenizer_config.json"
    if config.is_file():
        kept = {{k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}}
        config.write_text(json.dumps(kept))
print(f"tokenizer from {{src}}: {{sorted(p.name for p in dest.iterdir())}}", flush=True)
"""


def engine_chat_flags(isvc: InferenceService) -> argparse.Namespace:
    """The engines' chat flags among `engine.extraArgs`, read as the engine server reads them."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_engine_chat_flags(parser)
    flags, _ = parser.parse_known_args(list(isvc.spec.engine.extra_args))
    return flags


def engine_chat_args(isvc: InferenceService) -> list[str]:
    """The engines' chat flags the router takes (router/chat_template.py), so that it renders a chat request
    as they do; not --chat-template, a file in the engine pod (the step drops the model's template then)."""
    flags = engine_chat_flags(isvc)
    kwargs = flags.default_chat_template_kwargs
    return [
        *(["--default-chat-template-kwargs", kwargs] if kwargs is not None else []),
        *(["--exclude-tools-when-tool-choice-none"] if flags.exclude_tools_when_tool_choice_none else []),
    ]


def tokenizer_volumes(isvc: InferenceService) -> list[dict[str, Any]]:
    """The router pod's volumes for the step: the emptyDir it fills, its scratch, where it reads from."""
    model = isvc.spec.model
    source: list[dict[str, Any]] = []
    if model.source.startswith("pvc://"):
        claim, _ = split_pvc(model.source)
        source = [{"name": SOURCE_VOLUME, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}]
    elif model.source.startswith("hf://"):
        if model.cache.claim_name:
            source = [{"name": SOURCE_VOLUME, "persistentVolumeClaim": {"claimName": model.cache.claim_name}}]
        if model.hf_token_secret:
            items = [{"key": HF_TOKEN_KEY, "path": HF_TOKEN_KEY}]
            secret = {"secretName": model.hf_token_secret, "defaultMode": 0o440, "items": items}
            source.append({"name": TOKEN_VOLUME, "secret": secret})
    return [
        # a few MB: tokenizer.json is the largest (a 150k vocabulary's is ~10 MB)
        {"name": TOKENIZER_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}},
        {"name": TOKENIZER_TMP_VOLUME, "emptyDir": {}},
        *source,
    ]


TOKENIZER_MOUNT = {"name": TOKENIZER_VOLUME, "mountPath": TOKENIZER_DIR, "readOnly": True}


def tokenizer_init_container(
    isvc: InferenceService, config: OperatorConfig, router_image: str
) -> dict[str, Any]:
    """The step that fills the tokenizer emptyDir, per model source (the module's docstring)."""
    spec = isvc.spec
    source = spec.model.source
    mounts: list[dict[str, Any]] = [
        {"name": TOKENIZER_VOLUME, "mountPath": TOKENIZER_DIR},
        {"name": TOKENIZER_TMP_VOLUME, "mountPath": "/tmp"},
    ]
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        *([{"name": NO_CHAT_TEMPLATE_ENV, "value": "1"}] if engine_chat_flags(isvc).chat_template else []),
    ]
    if source.startswith("pvc://"):
        claim_path = f"{MODELS_ROOT}/model"
        _, path = split_pvc(source)
        image, argv = router_image, ["copy", f"{claim_path}/{path}" if path else claim_path]
        mounts.append({"name": SOURCE_VOLUME, "mountPath": claim_path, "readOnly": True})
    elif source.startswith("hf://"):
        repo, revision = split_hf(source)
        cache = TOKENIZER_DIR
        if spec.model.cache.claim_name:  # the engines' folder for this revision (model_source.py)
            cache = f"{HF_CACHE_MOUNT}/{repo}/{revision or 'main'}"
            mounts.append({"name": SOURCE_VOLUME, "mountPath": HF_CACHE_MOUNT})
        if spec.model.hf_token_secret:
            env.append({"name": "HF_TOKEN_PATH", "value": f"{HF_TOKEN_DIR}/{HF_TOKEN_KEY}"})
            mounts.append({"name": TOKEN_VOLUME, "mountPath": HF_TOKEN_DIR, "readOnly": True})
        image, argv = config.model_downloader_image or router_image, ["hf", repo, revision, cache]
    else:  # file:// or bundled://: in the engine image
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
        env.append({"name": "SPECFLEET_CACHE", "value": "/tmp/specfleet"})
        image = config.image_for(spec.resources.gpus, spec.engine.image)
        path = source.removeprefix("file://")
        if source.startswith("bundled://"):
            argv = ["gguf", source]
        else:
            argv = ["gguf" if path.endswith(".gguf") else "copy", path]
    return {
        "name": "tokenizer",
        "image": image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["python", "-c", COPY_SCRIPT, *argv, TOKENIZER_DIR],
        "env": env,
        # copying a few files; a GGUF's tokenizer is read by transformers in a few seconds on one core
        "resources": {
            "requests": {"cpu": "100m", "memory": "256Mi"},
            "limits": {"cpu": "1", "memory": "2Gi"},
        },
        "securityContext": CONTAINER_SECURITY_CONTEXT,
        "volumeMounts": mounts,
    }
