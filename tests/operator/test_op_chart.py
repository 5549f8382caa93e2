"""The Helm chart renders with a real Helm engine (Helm's Go library via helm-python-sdk), and what it
renders is valid Kubernetes with least-privilege RBAC."""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import pytest
import yaml
from isvc_schema_tools import CRD_PATH, REPO, k8s_validate

CHART = REPO / "charts" / "specfleet"
NS = "specfleet-system"
NON_DEFAULT = {
    "image": {"repository": "registry.local/specfleet-operator", "tag": "dev"},
    "engine": {"image": "registry.local/engine:cuda", "cpuImage": "registry.local/engine:cpu"},
    "watch": {"namespaces": ["team-a", "team-b"]},
    "prometheusURL": "http://prometheus.monitoring:9090",
    "serviceMonitor": {"enabled": False},
    "verbose": True,
    "tolerations": [{"key": "infra", "operator": "Exists"}],
}
CLUSTER_WIDE = {"watch": {"allNamespaces": True}}


def render(values: dict[str, Any] | None) -> tuple[list[dict[str, Any]], str]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values=values, name="sf", namespace=NS, is_install=True)
    notes = rendered.pop("specfleet/templates/NOTES.txt")
    objects = [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]
    return objects, notes


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def watch_roles(objects: list[dict[str, Any]], kind: str = "Role") -> list[dict[str, Any]]:
    """The Roles (or RoleBindings) of the watched namespaces: all but leader election's own."""
    return [o for o in by_kind(objects, kind) if not o["metadata"]["name"].endswith("-leader-election")]


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(objects, "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(
    "values", [None, NON_DEFAULT, CLUSTER_WIDE], ids=["default", "custom", "cluster-wide"]
)
def test_chart_renders_valid_least_privilege_objects(values: dict[str, Any] | None) -> None:
    objects, notes = render(values)
    assert {o["kind"] for o in objects} >= {
        "Deployment",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
    }
    for obj in objects:
        k8s_validate(obj)
    for role in by_kind(objects, "Role") + by_kind(objects, "ClusterRole"):
        for rule in role["rules"]:
            assert (
                "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
            ), rule
            assert "secrets" not in rule["resources"] or not {"list", "watch", "delete"} & set(
                rule["verbs"]
            ), rule
    assert "kubectl" in notes and "smollm2-cpu.yaml" in notes
    pod = by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert operator_container(objects)["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsUser"] >= 10000  # clear of the node's own users (checkov CKV_K8S_40)
    assert operator_container(objects)["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_default_scope_is_the_release_namespace() -> None:
    objects, _ = render(None)
    args = operator_container(objects)["args"]
    assert f"--namespace={NS}" in args and "--all-namespaces" not in args and "--standalone" in args
    assert [r["metadata"]["namespace"] for r in watch_roles(objects)] == [NS]
    (binding,) = watch_roles(objects, "RoleBinding")
    assert binding["subjects"][0] == {"kind": "ServiceAccount", "name": "sf-operator", "namespace": NS}


def test_custom_values_reach_the_operator() -> None:
    objects, _ = render(NON_DEFAULT)
    container = operator_container(objects)
    assert container["image"] == "registry.local/specfleet-operator:dev"
    assert {"--namespace=team-a", "--namespace=team-b", "--verbose"} <= set(container["args"])
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SPECFLEET_ENGINE_IMAGE"] == "registry.local/engine:cuda"
    assert env["SPECFLEET_ENGINE_CPU_IMAGE"] == "registry.local/engine:cpu"
    assert env["SPECFLEET_PROMETHEUS_URL"] == "http://prometheus.monitoring:9090"
    assert sorted(r["metadata"]["namespace"] for r in watch_roles(objects)) == ["team-a", "team-b"]
    # serviceMonitor off: ServiceMonitors are only watched (read-only), never written
    verbs = {
        v
        for role in watch_roles(objects)
        for rule in role["rules"]
        if "monitoring.coreos.com" in rule["apiGroups"]
        for v in rule["verbs"]
    }
    assert verbs == {"list", "watch"}
    assert (
        by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]["tolerations"]
        == NON_DEFAULT["tolerations"]
    )


def test_cluster_wide_uses_a_cluster_role() -> None:
    objects, notes = render(CLUSTER_WIDE)
    assert "--all-namespaces" in operator_container(objects)["args"]
    assert not watch_roles(objects)
    names = {r["metadata"]["name"] for r in by_kind(objects, "ClusterRole")}
    assert names == {"sf-operator", "sf-operator-discovery"}
    assert "all namespaces" in notes


def test_chart_ships_the_crd_as_a_template_that_upgrades_and_lints_clean() -> None:
    """Helm installs a chart's crds/ folder once and never upgrades it: the CRD is a template instead, so
    `helm upgrade` applies a new schema; it is kept on `helm uninstall` (deleting a CRD deletes every
    InferenceService)."""
    with helm.Chart.load(CHART) as chart:
        assert chart.crds == []
    objects, _ = render(None)
    (crd,) = by_kind(objects, "CustomResourceDefinition")
    expected = yaml.safe_load(CRD_PATH.read_text())
    gitops_keep = expected["metadata"].pop("annotations")  # the plain CRD keeps it from GitOps tools alone
    assert crd["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep", **gitops_keep}
    assert crd == expected
    objects, _ = render({"crds": {"keep": False}})
    (crd,) = by_kind(objects, "CustomResourceDefinition")
    assert crd == expected
    objects, _ = render({"crds": {"install": False}})
    assert by_kind(objects, "CustomResourceDefinition") == []
    report = helm.lint(str(CHART), strict=True, kube_version="v1.30.0")
    assert report["errors"] == [] and all(m["severity"] < 2 for m in report["messages"]), report


def test_upgrading_renders_the_new_crd() -> None:
    """`helm upgrade` renders templates with is_upgrade: the CRD is among them (a crds/ file would not be)."""
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values=None, name="sf", namespace=NS, is_install=False, is_upgrade=True)
    rendered.pop("specfleet/templates/NOTES.txt")
    kinds = [doc["kind"] for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]
    assert "CustomResourceDefinition" in kinds


def test_watched_namespaces_that_do_not_exist_yet_are_created_first() -> None:
    """A Role in a namespace that does not exist fails the whole install; the chart creates the namespace
    (kept on uninstall) unless the cluster has it, which `lookup` tells at install time."""
    objects, _ = render(NON_DEFAULT)
    namespaces = by_kind(objects, "Namespace")
    assert sorted(n["metadata"]["name"] for n in namespaces) == ["team-a", "team-b"]
    assert all(n["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for n in namespaces)
    objects, _ = render({**NON_DEFAULT, "watch": {"namespaces": ["team-a", NS], "createNamespaces": False}})
    assert by_kind(objects, "Namespace") == []
    objects, _ = render({"watch": {"namespaces": ["team-a", NS]}})
    assert [n["metadata"]["name"] for n in by_kind(objects, "Namespace")] == ["team-a"]  # never the release's
    objects, _ = render(None)
    assert by_kind(objects, "Namespace") == []


def argocd_sync_options(obj: dict[str, Any]) -> dict[str, str]:
    """An object's `argocd.argoproj.io/sync-options` as Argo CD reads it: comma-separated, white-space
    trimmed, each `Name=value`."""
    value = (obj["metadata"].get("annotations") or {}).get("argocd.argoproj.io/sync-options", "")
    pairs = [item.strip().partition("=") for item in value.split(",") if item.strip()]
    return {name.strip(): setting.strip() for name, _, setting in pairs}


def test_argo_cd_never_prunes_or_deletes_a_watched_namespace() -> None:
    """The shipped Argo CD Application (automated `prune: true`) renders the chart with `helm template`,
    where `lookup` sees no cluster, so every watched namespace is a Namespace of the Application: dropping
    one from `watch.namespaces` would make Argo CD prune it, and deleting the Application would delete
    it, with every InferenceService in it. Each carries Prune=false and Delete=false for Argo CD, and Helm's
    keep policy for `helm uninstall` and Flux's HelmRelease."""
    app = yaml.safe_load((REPO / "deploy" / "gitops-examples" / "argocd-application.yaml").read_text())
    assert app["spec"]["syncPolicy"]["automated"]["prune"] is True  # what makes a rendered Namespace at risk
    source = app["spec"]["source"]
    with helm.Chart.load(REPO / source["path"]) as chart:
        rendered = chart.render(
            values=source["helm"]["valuesObject"],
            name=source["helm"]["releaseName"],
            namespace=app["spec"]["destination"]["namespace"],
            is_install=True,
        )
    rendered.pop("specfleet/templates/NOTES.txt")
    objects = [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]
    namespaces = by_kind(objects, "Namespace")
    assert [n["metadata"]["name"] for n in namespaces] == ["team-a"]  # the release's is Argo CD's own
    for namespace in [*namespaces, *by_kind(render(NON_DEFAULT)[0], "Namespace")]:
        options = argocd_sync_options(namespace)
        assert (options.get("Prune"), options.get("Delete")) == ("false", "false"), namespace["metadata"]
        assert namespace["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


@pytest.mark.parametrize(
    "values",
    [
        {"prometheusUrl": "http://x"},
        {"watch": {"namespace": ["a"]}},
        {"crds": {"upgrade": True}},
        {"image": {"registry": "x"}},
    ],
    ids=["top-level", "watch", "crds", "image"],
)
def test_values_schema_rejects_unknown_keys(values: dict[str, Any]) -> None:
    (key,) = [k for v in values.values() for k in (v if isinstance(v, dict) else {})] or list(values)
    with pytest.raises(helm.HelmError, match=key):
        render(values)


def test_every_operator_setting_is_a_value() -> None:
    """Each SPECFLEET_* variable the operator reads is set by the chart, from a value."""
    read = set()  # the operator's image runs operator/ and tuner/ (the local fleet, fleet/, runs outside)
    for path in [*(REPO / "operator").rglob("*.py"), *(REPO / "tuner").rglob("*.py")]:
        read |= set(re.findall(r"""(?:environ|env)\.get\(\s*["'](SPECFLEET_[A-Z_]+)""", path.read_text()))
        read |= set(re.findall(r"""_seconds\(\s*env,\s*["'](SPECFLEET_[A-Z_]+)""", path.read_text()))
    assert read >= {
        "SPECFLEET_ENGINE_IMAGE",
        "SPECFLEET_PROMETHEUS_SELECTOR",
        "SPECFLEET_MODEL_DOWNLOADER_IMAGE",
        "SPECFLEET_RESYNC_INTERVAL",
    }
    objects, _ = render(
        {
            "prometheusSelector": 'job="engines",ns="{namespace}",svc="{name}"',
            "tunerTickSeconds": 2,
            "modelDownloaderImage": "registry.local/downloader:1",
            "resyncIntervalSeconds": 600,
        }
    )
    env = {e["name"]: e.get("value") for e in operator_container(objects)["env"]}
    assert read <= set(env), read - set(env)
    assert env["SPECFLEET_PROMETHEUS_SELECTOR"] == 'job="engines",ns="{namespace}",svc="{name}"'
    assert env["SPECFLEET_TUNER_TICK_SECONDS"] == "2"
    assert env["SPECFLEET_MODEL_DOWNLOADER_IMAGE"] == "registry.local/downloader:1"
    assert env["SPECFLEET_RESYNC_INTERVAL"] == "600"


@pytest.mark.parametrize("seconds", [0, -5, "often"])
def test_values_schema_refuses_a_resync_interval_that_is_not_a_positive_number(seconds: Any) -> None:
    render({"resyncIntervalSeconds": 0.5})  # a known key: refused below for its value, not its name
    with pytest.raises(helm.HelmError, match="at '/resyncIntervalSeconds': (exclusiveMinimum|got string)"):
        render({"resyncIntervalSeconds": seconds})


@pytest.mark.parametrize(
    "values", [None, NON_DEFAULT, CLUSTER_WIDE], ids=["default", "custom", "cluster-wide"]
)
def test_notes_commands_name_their_namespace(values: dict[str, Any] | None) -> None:
    _, notes = render(values)
    commands = [line.strip() for line in notes.splitlines() if line.strip().startswith("kubectl")]
    assert len(commands) >= 4
    for command in commands:
        assert re.search(r" -n [a-z0-9-]+ ", command), command
    expected = "team-a" if values is NON_DEFAULT else "default" if values is CLUSTER_WIDE else NS
    assert f"kubectl -n {expected} apply -f examples/smollm2-cpu.yaml" in commands


@pytest.mark.parametrize("values", [None, CLUSTER_WIDE], ids=["default", "cluster-wide"])
def test_two_replicas_elect_a_leader_through_a_lease_in_the_release_namespace(
    values: dict[str, Any] | None,
) -> None:
    objects, _ = render(values)
    (deployment,) = by_kind(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    # a rolling update starts the new standby before it stops an old replica
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    args = operator_container(objects)["args"]
    assert {"--leader-elect", "--leader-election-id=sf-operator"} <= set(args)
    env = {e["name"]: e for e in operator_container(objects)["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    (role,) = [r for r in by_kind(objects, "Role") if r not in watch_roles(objects)]
    assert role["metadata"]["namespace"] == NS
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}
    ]
    assert not any(
        "leases" in rule["resources"]
        for r in watch_roles(objects) + by_kind(objects, "ClusterRole")
        for rule in r["rules"]
    )
    anti = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"] == (
        "kubernetes.io/hostname"
    )


def test_without_leader_election_one_replica_and_no_lease() -> None:
    objects, _ = render({"leaderElection": {"enabled": False}, "replicas": 1})
    (deployment,) = by_kind(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert not any(a.startswith("--leader-elect") for a in operator_container(objects)["args"])
    assert watch_roles(objects) == by_kind(objects, "Role")
    with pytest.raises(helm.HelmError, match="replicas=2 needs leaderElection.enabled=true"):
        render({"leaderElection": {"enabled": False}})


def test_bad_values_fail_with_a_message() -> None:
    with pytest.raises(helm.HelmError, match="serviceAccount.name is required"):
        render({"serviceAccount": {"create": False}})


def test_values_schema_names_the_bad_value() -> None:
    with pytest.raises(helm.HelmError, match="livenessPort"):
        render({"livenessPort": 70000})
