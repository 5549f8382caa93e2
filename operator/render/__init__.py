"""Pure renderers: InferenceService -> Kubernetes manifest dicts. No I/O, deterministic names."""

from .deployment import engine_args, render_deployment
from .model_source import resolve_source
from .network import render_network_policy, render_pdb, render_service, render_servicemonitor, wants_pdb
from .router import (
    render_engines_service,
    render_router_children,
    render_router_deployment,
    render_router_rbac,
)
from .secret import new_admin_token, read_admin_token, render_prefill_key_secret, render_secret
from .tuned import render_tuned_config
from .workloads import render_engine_workloads, render_leader_worker_set

__all__ = [
    "engine_args",
    "new_admin_token",
    "read_admin_token",
    "render_deployment",
    "render_engine_workloads",
    "render_engines_service",
    "render_leader_worker_set",
    "render_network_policy",
    "render_pdb",
    "render_prefill_key_secret",
    "render_router_children",
    "render_router_deployment",
    "render_router_rbac",
    "render_secret",
    "render_service",
    "render_servicemonitor",
    "render_tuned_config",
    "resolve_source",
    "wants_pdb",
]
