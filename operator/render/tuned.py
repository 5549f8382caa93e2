"""The `NAME-tuned` ConfigMap: the tuner's config in force, the file a new engine pod starts on.

Why a ConfigMap: the operator never writes `spec`, and a tuning change must not roll the pods, so the
tuned values cannot enter the pod template. The template instead mounts this ConfigMap (optional, by
name) and passes `--live-config-file` with this spec's key (deployment.py `live_config_file`); the engine
reads the file once at start and checks it as its admin API checks a PATCH. The tuner (tuner/handlers.py)
applies it, under its own field manager, whenever the config the engines accepted changes; the ConfigMap's
content changes, the template does not. Owned by the InferenceService (garbage-collected with it); the
reconcile deletes it when autotune is turned off, so that new pods start on the spec's values again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..inference_service import InferenceService
from ..resources import tuned_config_name
from .common import child_metadata
from .deployment import live_config_file


def render_tuned_config(isvc: InferenceService, values: Mapping[str, int]) -> dict[str, Any]:
    """`values`: the body of `PATCH /admin/config` the engines accepted (`LiveSettings.as_admin()`)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(isvc, tuned_config_name(isvc.name)),
        "data": {live_config_file(isvc.spec): json.dumps(dict(values), sort_keys=True)},
    }
