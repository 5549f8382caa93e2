"""kopf handlers: every cause (create, update, resume, timer) runs the same level-based reconcile.

Extending: a per-service loop (the tuner) registers its own `@kopf.timer` or `@kopf.daemon` on the same
resource in its own module (see `cli.OPERATOR_MODULES`), gated with `when=autotune_enabled`; it reads
`status` and writes only `status.tuning` and the `Tuned` condition, never `spec`.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from .conditions import timestamp
from .config import OperatorConfig
from .kube import ApiError, KubeClient
from .reconcile import Reconciler
from .resources import GROUP, PLURAL, VERSION

CONFIG = OperatorConfig.from_env()
TEMPORARY_DELAY_SECONDS = 10
_credentials: dict[str, Any] = {}


def autotune_enabled(spec: kopf.Spec, **_: Any) -> bool:
    """`when=` filter for per-service tuning timers."""
    return bool((spec.get("autotune") or {}).get("enabled"))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Handler progress and the last-handled spec live in annotations: the CRD's structural schema
    # would prune kopf's default `status.kopf` field.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    memo.config = CONFIG
    memo.client = None


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account first, then the kubeconfig; the reconcile's client reuses these."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    _credentials["info"] = info
    return info


@kopf.on.cleanup()
async def close_client(memo: kopf.Memo, **_: Any) -> None:
    if getattr(memo, "client", None) is not None:
        await memo.client.close()


def kube_client(memo: kopf.Memo) -> KubeClient:
    """The operator's API client, built from kopf's login on first use; other handler modules (the
    tuner's) share it through this function."""
    if getattr(memo, "client", None) is None:
        if "info" not in _credentials:
            raise kopf.TemporaryError("no Kubernetes credentials yet; retrying", delay=TEMPORARY_DELAY_SECONDS)
        memo.client = KubeClient.from_connection_info(_credentials["info"])
    return memo.client


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.timer(GROUP, VERSION, PLURAL, interval=CONFIG.reconcile_interval_seconds,
            initial_delay=min(5.0, CONFIG.reconcile_interval_seconds), sharp=False)
async def reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    try:
        outcome = await Reconciler(kube_client(memo), memo.config).reconcile(body, now=timestamp())
    except ApiError as error:
        if error.status == 401:
            memo.client = None  # credentials rotated: rebuild from kopf's fresh login next time
        if error.retryable or error.status == 401:
            raise kopf.TemporaryError(f"{error}; retrying", delay=TEMPORARY_DELAY_SECONDS) from error
        raise kopf.PermanentError(
            f"{error}. If this is 403, the operator's RBAC lacks a permission: upgrade the Helm chart; "
            "if 422, a rendered child was refused: report it with the InferenceService YAML"
        ) from error
    except OSError as error:  # connection refused/reset: the API server is restarting
        raise kopf.TemporaryError(f"cannot reach the Kubernetes API: {error}", delay=TEMPORARY_DELAY_SECONDS) from error
    patch.status.update(outcome.status)
    for event in outcome.events:
        post = kopf.warn if event.type == "Warning" else kopf.info
        post(body, reason=event.reason, message=event.message)
    if outcome.invalid:
        raise kopf.PermanentError(f"{outcome.invalid}\nFix the spec; the operator retries on the next change.")
    logger.debug("reconciled: %s", {c["type"]: c["status"] for c in outcome.status["conditions"]})
