"""Pure renderers: the fields users rely on, on the examples and on edge cases, all valid for Kubernetes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from isvc_schema_tools import EXAMPLES, REPO, apply_defaults, crd_schema, k8s_validate
from specfleet.engine.server.cli import build_parser, engine_config_kwargs
from specfleet.operator import InferenceService, load_inference_service
from specfleet.operator.config import OperatorConfig
from specfleet.operator.render import (
    new_admin_token,
    read_admin_token,
    render_deployment,
    render_engine_workloads,
    render_engines_service,
    render_pdb,
    render_router_children,
    render_secret,
    render_service,
    render_servicemonitor,
    render_tuned_config,
)
from specfleet.operator.render.deployment import live_config_file
from specfleet.router.cli import build_parser as router_parser

CONFIG = OperatorConfig(
    engine_image="registry.example/engine:cuda", engine_cpu_image="registry.example/engine:cpu"
)


def isvc_from(name: str, uid: str = "uid-1234", **changes: Any) -> InferenceService:
    doc = yaml.safe_load((REPO / "examples" / name).read_text())
    doc["metadata"].update(namespace="team-a", uid=uid, generation=1)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = doc["spec"]
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return load_inference_service(doc)


def engine(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} appears {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_rendered_object_is_valid_kubernetes(path: Any) -> None:
    isvc = load_inference_service(path)
    objects = [
        *render_engine_workloads(isvc, CONFIG),
        render_service(isvc),
        render_secret(isvc, new_admin_token()),
    ]
    objects += [pdb for pdb in [render_pdb(isvc)] if pdb]
    objects += render_router_children(isvc, CONFIG)
    for obj in objects:
        k8s_validate(obj)
        assert obj["metadata"]["namespace"] == isvc.namespace
        assert obj["metadata"]["ownerReferences"][0]["controller"] is True


def test_cpu_example_runs_the_engine_contract() -> None:
    isvc = isvc_from("smollm2-cpu.yaml")
    deployment = render_deployment(isvc, CONFIG)
    c = engine(deployment)
    assert c["image"] == "registry.example/engine:cpu"
    assert c["command"] == ["python", "-m", "specfleet.engine"]
    args = c["args"]
    assert flag(args, "--model") == "bundled://smollm2-135m-instruct"
    assert (flag(args, "--port"), flag(args, "--max-num-seqs"), flag(args, "--max-num-batched-tokens")) == (
        "8000",
        "16",
        "512",
    )
    assert (flag(args, "--block-size"), flag(args, "--max-model-len"), flag(args, "--dtype")) == (
        "16",
        "2048",
        "float32",
    )
    assert (flag(args, "--speculative-method"), flag(args, "--num-speculative-tokens")) == ("none", "0")
    assert "--draft-model" not in args and "--no-prefix-caching" not in args
    assert not any("gpu" in key for key in c["resources"]["requests"])
    assert c["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # the spec's startupTimeoutSeconds
    pod = deployment["spec"]["template"]["spec"]
    # The admin token is a read-only file from the Secret, never an environment variable.
    assert not any(e["name"] == "SPECFLEET_ADMIN_TOKEN" or "valueFrom" in e for e in c["env"])
    token_file = next(e["value"] for e in c["env"] if e["name"] == "SPECFLEET_ADMIN_TOKEN_FILE")
    (mount,) = [m for m in c["volumeMounts"] if token_file.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert mount["readOnly"] is True and volume["secret"]["secretName"] == "smollm2-admin"
    assert volume["secret"]["items"] == [{"key": "token", "path": token_file.rsplit("/", 1)[1]}]
    assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsUser"] >= 10000
    assert pod["terminationGracePeriodSeconds"] > int(flag(args, "--drain-timeout")) == 20
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert render_pdb(isvc) is None  # one replica: a PDB would block every drain


def test_gpu_hf_example_requests_gpus_schedules_and_downloads() -> None:
    isvc = isvc_from("llama3-8b-ngram-gpu.yaml")
    deployment = render_deployment(isvc, CONFIG)
    pod = deployment["spec"]["template"]["spec"]
    c = engine(deployment)
    assert c["image"] == "registry.example/engine:cuda"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert (flag(c["args"], "--speculative-method"), flag(c["args"], "--num-speculative-tokens")) == (
        "ngram",
        "4",
    )
    (init,) = pod["initContainers"]
    assert "meta-llama/Meta-Llama-3.1-8B-Instruct" in init["command"]
    # The HF token reaches only the download step, as a read-only Secret file huggingface_hub reads.
    token_path = next(e["value"] for e in init["env"] if e["name"] == "HF_TOKEN_PATH")
    (mount,) = [m for m in init["volumeMounts"] if token_path == f"{m['mountPath']}/HF_TOKEN"]
    assert mount["readOnly"] is True and not any("valueFrom" in e for e in init["env"])
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "hf-token" and volume["secret"]["items"][0]["key"] == "HF_TOKEN"
    assert mount["name"] not in {m["name"] for m in c["volumeMounts"]}  # the engine never sees it
    model_arg = flag(c["args"], "--model")
    download_dir = init["command"][-1]
    assert model_arg == f"file://{download_dir}"
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == download_dir)
    assert mount["readOnly"] is True
    pdb = render_pdb(isvc)
    assert pdb is not None and pdb["spec"]["maxUnavailable"] == 1


def test_hf_revision_is_passed_to_the_download() -> None:
    isvc = isvc_from("llama3-8b-ngram-gpu.yaml", model__source="hf://org/model@v1.2")
    init = render_deployment(isvc, CONFIG)["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"][-3:-1] == ["org/model", "v1.2"]


def test_draft_model_and_pvc_sources_mount_claims_read_only() -> None:
    isvc = isvc_from("llama3-8b-draft-gpu.yaml")
    deployment = render_deployment(isvc, CONFIG)
    pod = deployment["spec"]["template"]["spec"]
    args = engine(deployment)["args"]
    assert flag(args, "--speculative-method") == "draft"
    assert flag(args, "--model") == "file:///models/model/llama-3.1-8b-instruct"
    assert flag(args, "--draft-model") == "file:///models/draft/llama-3.2-1b-instruct"
    claims = [v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [{"claimName": "models", "readOnly": True}] * 2
    assert "initContainers" not in pod
    assert "--draft-quantization" not in args


def test_int8_copy_of_the_target_as_draft() -> None:
    isvc = isvc_from(
        "smollm2-cpu.yaml",
        speculative__method="draft",
        speculative__draftModel={"source": "bundled://smollm2-135m-instruct", "quantization": "int8"},
    )
    args = engine(render_deployment(isvc, CONFIG))["args"]
    assert flag(args, "--draft-model") == "bundled://smollm2-135m-instruct"
    assert flag(args, "--draft-quantization") == "int8"


@pytest.mark.parametrize("quantization", ["gguf", "awq", "none"])
def test_model_quantization_reaches_the_engine_command_line(quantization: str) -> None:
    from typing import get_args

    from specfleet.engine.config import QUANTIZATIONS
    from specfleet.operator.spec import ModelSpec

    assert set(get_args(ModelSpec.model_fields["quantization"].annotation)) == {
        "none",
        *filter(None, QUANTIZATIONS),
    }
    isvc = isvc_from("smollm2-cpu.yaml", model__quantization=quantization)
    args = engine(render_deployment(isvc, CONFIG))["args"]
    assert (flag(args, "--quantization") if "--quantization" in args else "none") == quantization


@pytest.mark.parametrize(
    ("example", "split", "size"),
    [
        ("llama3-8b-ngram-gpu.yaml", "tensor", 2),
        ("llama3-8b-ngram-gpu.yaml", "pipeline", 4),
        ("smollm2-cpu.yaml", "tensor", 3),
    ],
)
def test_a_split_model_gets_one_gpu_per_rank_and_its_flag(example: str, split: str, size: int) -> None:
    gpus = 0 if "cpu" in example else size
    isvc = isvc_from(example, resources__gpus=gpus, **{f"engine__{split}ParallelSize": size})
    pod = render_deployment(isvc, CONFIG)["spec"]["template"]["spec"]
    c = engine({"spec": {"template": {"spec": pod}}})
    parser = build_parser()
    config = engine_config_kwargs(parser.parse_args(c["args"]))
    assert config[f"{split}_parallel_size"] == size  # the engine's own parser reads what the pod passes
    assert c["resources"]["limits"].get("nvidia.com/gpu", "0") == str(gpus)
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]  # gloo/NCCL need shared memory
    assert [v for v in pod["volumes"] if v["name"] == "dshm"][0]["emptyDir"]["medium"] == "Memory"


def test_disable_by_batch_size_reaches_the_engine_command_line() -> None:
    isvc = isvc_from("smollm2-cpu.yaml", speculative__method="ngram", speculative__disableByBatchSize=8)
    args = engine(render_deployment(isvc, CONFIG))["args"]
    assert flag(args, "--speculative-disable-by-batch-size") == "8"
    assert engine_config_kwargs(build_parser().parse_args(args))["speculative_disable_by_batch_size"] == 8
    off = isvc_from("smollm2-cpu.yaml", speculative__disableByBatchSize=8)  # method none: nothing to disable
    assert "--speculative-disable-by-batch-size" not in engine(render_deployment(off, CONFIG))["args"]


def test_the_scheduling_policy_reaches_the_engine_flags() -> None:
    isvc = isvc_from("smollm2-cpu.yaml", engine__schedulingPolicy="priority")
    args = engine(render_deployment(isvc, CONFIG))["args"]
    assert flag(args, "--scheduling-policy") == "priority"
    assert engine_config_kwargs(build_parser().parse_args(args))["scheduling_policy"] == "priority"
    default = engine(render_deployment(isvc_from("smollm2-cpu.yaml"), CONFIG))["args"]
    assert "--scheduling-policy" not in default  # fcfs, the engine's default: the command line is unchanged
    with pytest.raises(ValueError, match="schedulingPolicy"):
        isvc_from("smollm2-cpu.yaml", engine__schedulingPolicy="lifo")


def test_zero_replicas_and_edge_settings() -> None:
    isvc = isvc_from(
        "smollm2-cpu.yaml", replicas=0, engine__prefixCaching=False, engine__extraArgs=["--seed", "7"]
    )
    deployment = render_deployment(isvc, CONFIG)
    args = engine(deployment)["args"]
    assert deployment["spec"]["replicas"] == 0
    assert "--no-prefix-caching" in args and args[-2:] == ["--seed", "7"]
    assert render_pdb(isvc) is None
    k8s_validate(deployment)


def test_image_override_and_scheduling_extras() -> None:
    isvc = isvc_from(
        "smollm2-cpu.yaml",
        engine__image="mirror.local/specfleet:dev",
        scheduling={
            "priorityClassName": "llm-high",
            "runtimeClassName": "nvidia",
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
                        ]
                    }
                }
            },
        },
    )
    deployment = render_deployment(isvc, CONFIG)
    pod = deployment["spec"]["template"]["spec"]
    assert engine(deployment)["image"] == "mirror.local/specfleet:dev"
    assert (pod["priorityClassName"], pod["runtimeClassName"]) == ("llm-high", "nvidia")
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    k8s_validate(deployment)


def test_rendering_is_deterministic_and_ignores_tuned_status() -> None:
    isvc = isvc_from("llama3-8b-autotune.yaml")
    tuned_doc = copy.deepcopy(isvc.model_dump(by_alias=True))
    tuned_doc["status"] = {"tuning": {"numSpeculativeTokens": 1, "maxNumSeqs": 200}}
    tuned = load_inference_service(tuned_doc)
    assert render_deployment(isvc, CONFIG) == render_deployment(tuned, CONFIG)
    args = engine(render_deployment(isvc, CONFIG))["args"]
    assert (
        flag(args, "--num-speculative-tokens") == "4"
    )  # the spec's value: tuning goes through the admin API


def test_new_pods_start_on_the_tuned_configmap_which_the_template_names_but_does_not_hold() -> None:
    """The pod mounts `NAME-tuned` (optional: absent before the tuner's first push) and passes the file of
    this spec's key to `--live-config-file`; the tuner's ConfigMap holds the values under that same key.
    The key follows the engine's command line (its ceilings), not fields the pods do not see."""
    isvc = isvc_from("llama3-8b-autotune.yaml")
    deployment = render_deployment(isvc, CONFIG)
    c, pod = engine(deployment), deployment["spec"]["template"]["spec"]
    path = flag(c["args"], "--live-config-file")
    assert build_parser().parse_args(c["args"]).live_config_file == path  # the engine's parser takes it
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert mount["readOnly"] is True and volume["configMap"] == {
        "name": "llama3-8b-tuned-tuned",
        "optional": True,
    }
    configmap = render_tuned_config(isvc, {"num_speculative_tokens": 2, "max_num_seqs": 96})
    k8s_validate(configmap)
    assert configmap["metadata"]["name"] == "llama3-8b-tuned-tuned"  # NAME-tuned
    assert configmap["metadata"]["ownerReferences"][0]["uid"] == "uid-1234"
    assert list(configmap["data"]) == [path.rsplit("/", 1)[1]] == [live_config_file(isvc.spec)]
    assert (
        configmap["data"][live_config_file(isvc.spec)] == '{"max_num_seqs": 96, "num_speculative_tokens": 2}'
    )
    # same pods, same file: the SLO, the tuner's interval and the replica count are not on the command line
    same = isvc_from("llama3-8b-autotune.yaml", slo__ttftP95Ms=900, autotune__intervalSeconds=60, replicas=3)
    assert live_config_file(same.spec) == live_config_file(isvc.spec)
    # other ceilings, other file: a rolling-out pod never starts on values tuned for the old command line
    for changes in ({"speculative__method": "none"}, {"batching__maxNumSeqs": 32}):
        assert (
            live_config_file(isvc_from("llama3-8b-autotune.yaml", **changes).spec) != path.rsplit("/", 1)[1]
        )


def test_prefill_engines_keep_the_specs_values_and_decode_engines_start_tuned() -> None:
    isvc = isvc_from("smollm2-cpu-pd.yaml")
    by_role = {d["metadata"]["name"]: engine(d) for d in render_engine_workloads(isvc, CONFIG)}
    assert "--live-config-file" in by_role["smollm2-pd-decode"]["args"]
    prefill = by_role["smollm2-pd-prefill"]
    assert "--live-config-file" not in prefill["args"]
    assert not any(m["name"] == "tuned-config" for m in prefill["volumeMounts"])


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_service_selects_the_deployments_pods_without_the_router() -> None:
    isvc = isvc_from("smollm2-cpu.yaml", routing={"enabled": False})
    service, deployment = render_service(isvc), render_deployment(isvc, CONFIG)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["metadata"]["name"] == "smollm2"
    assert _selects(service["spec"]["selector"], pod_labels)
    assert _selects(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    assert service["spec"]["ports"][0]["port"] == 8000
    monitor = render_servicemonitor(isvc)
    assert _selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    endpoint = monitor["spec"]["endpoints"][0]
    assert {k: endpoint[k] for k in ("port", "path", "interval")} == {
        "port": "http",
        "path": "/metrics",
        "interval": "15s",
    }
    assert render_router_children(isvc, CONFIG) == []


def test_router_stands_between_the_service_and_the_engines() -> None:
    isvc = isvc_from("smollm2-cpu.yaml", routing={"policy": "least-loaded", "loadFactorPercent": 150})
    service, engines = render_service(isvc), render_deployment(isvc, CONFIG)
    children = {o["kind"]: o for o in render_router_children(isvc, CONFIG) if o["kind"] != "Service"}
    (headless,) = [o for o in render_router_children(isvc, CONFIG) if o["kind"] == "Service"]
    router = children["Deployment"]
    router_pods = router["spec"]["template"]["metadata"]["labels"]
    engine_pods = engines["spec"]["template"]["metadata"]["labels"]
    # clients reach the router pods only; the router finds the engines through the headless Service
    assert service["metadata"]["name"] == "smollm2" and service["spec"]["ports"][0]["port"] == 8000
    assert _selects(service["spec"]["selector"], router_pods) and not _selects(
        service["spec"]["selector"], engine_pods
    )
    assert headless["metadata"]["name"] == "smollm2-engines" and headless["spec"]["clusterIP"] == "None"
    assert _selects(headless["spec"]["selector"], engine_pods) and not _selects(
        headless["spec"]["selector"], router_pods
    )
    assert _selects(router["spec"]["selector"]["matchLabels"], router_pods)
    # the engines' ServiceMonitor scrapes the headless Service, not the router, with job = the service's name
    monitor = render_servicemonitor(isvc)
    assert _selects(monitor["spec"]["selector"]["matchLabels"], headless["metadata"]["labels"])
    assert not _selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert headless["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "smollm2"
    # the router's own parser reads back its command line
    container = router["spec"]["template"]["spec"]["containers"][0]
    args = router_parser().parse_args(container["args"])
    assert (args.service, args.namespace, args.policy, args.load_factor, args.block_size, args.port) == (
        "smollm2-engines",
        "team-a",
        "least-loaded",
        1.5,
        16,
        8000,
    )
    assert (
        container["command"] == ["python", "-m", "specfleet.router"]
        and container["image"] == CONFIG.router_image
    )
    # its ServiceAccount may read EndpointSlices in this namespace, and nothing else
    account = router["spec"]["template"]["spec"]["serviceAccountName"]
    assert children["ServiceAccount"]["metadata"]["name"] == account == "smollm2-router"
    assert children["Role"]["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    assert children["RoleBinding"]["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "team-a"}
    ]
    assert children["RoleBinding"]["roleRef"]["name"] == children["Role"]["metadata"]["name"]


@pytest.mark.parametrize(
    ("ttft_ms", "tpot_ms", "ttft", "tpot"),
    [
        (500, 50, "0.5", "0.05"),  # the CRD's defaults: exact bucket bounds
        (1000, 100, "1", "0.1"),  # "1", never "1.0": the rules strip a bucket's trailing ".0"
        (300, 27, "0.25", "0.025"),  # between two bounds: the lower one (stricter, never a missing bucket)
        (1, 1, "0.001", "0.001"),  # the smallest SLO the CRD allows is the smallest bound
        (600000, 60000, "80", "5"),  # above the top bound: the top bound
    ],
)
def test_service_carries_its_slo_as_bucket_bounds_and_the_monitor_copies_them(
    ttft_ms: int, tpot_ms: int, ttft: str, tpot: str
) -> None:
    from specfleet.engine.server.metrics import LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS

    isvc = isvc_from("smollm2-cpu.yaml", slo__ttftP95Ms=ttft_ms, slo__tpotP95Ms=tpot_ms)
    # on the engines' Service: the headless one with the router (the default), the client one without
    labels = render_engines_service(isvc)["metadata"]["labels"]
    plain = render_service(
        isvc_from(
            "smollm2-cpu.yaml", routing={"enabled": False}, slo__ttftP95Ms=ttft_ms, slo__tpotP95Ms=tpot_ms
        )
    )["metadata"]["labels"]
    assert (plain["specfleet.io/slo-ttft-seconds"], plain["specfleet.io/slo-tpot-seconds"]) == (ttft, tpot)
    assert (labels["specfleet.io/slo-ttft-seconds"], labels["specfleet.io/slo-tpot-seconds"]) == (ttft, tpot)
    assert float(ttft) in LATENCY_BUCKETS and float(tpot) in TOKEN_LATENCY_BUCKETS
    relabel = render_servicemonitor(isvc)["spec"]["endpoints"][0]["relabelings"]
    assert {r["targetLabel"]: r["sourceLabels"] for r in relabel if r["targetLabel"].startswith("slo_")} == {
        "slo_ttft_seconds": ["__meta_kubernetes_service_label_specfleet_io_slo_ttft_seconds"],
        "slo_tpot_seconds": ["__meta_kubernetes_service_label_specfleet_io_slo_tpot_seconds"],
    }


def test_secret_holds_the_token_and_is_immutable() -> None:
    isvc = isvc_from("smollm2-cpu.yaml")
    token = new_admin_token()
    secret = render_secret(isvc, token)
    assert read_admin_token(secret) == token and secret["immutable"] is True
    assert secret["metadata"]["name"] == "smollm2-admin"
    assert new_admin_token() != token
    with pytest.raises(ValueError, match="too short"):
        render_secret(isvc, "abc")


def test_autoscaling_replicas_come_from_the_tuners_status_never_from_a_spec_write() -> None:
    scaling = {"enabled": True, "minReplicas": 1, "maxReplicas": 3}
    isvc = isvc_from("smollm2-cpu.yaml", replicas=1, autoscaling=scaling, autotune={"enabled": True})
    assert render_deployment(isvc, CONFIG)["spec"]["replicas"] == 1 and render_pdb(isvc) is None
    doc = isvc.model_dump(by_alias=True)
    doc["status"] = {"autoscaling": {"replicas": 2, "reason": "scale-up 1 -> 2: ..."}}
    scaled = load_inference_service(doc)
    assert scaled.spec.replicas == 1  # the spec stays what the user (or Git) wrote
    assert render_deployment(scaled, CONFIG)["spec"]["replicas"] == 2 and render_pdb(scaled) is not None
    doc["status"]["autoscaling"]["replicas"] = 9  # clamped to maxReplicas
    assert render_deployment(load_inference_service(doc), CONFIG)["spec"]["replicas"] == 3
    doc["spec"]["autoscaling"]["enabled"] = False  # off: spec.replicas again (an HPA/KEDA may drive it)
    assert render_deployment(load_inference_service(doc), CONFIG)["spec"]["replicas"] == 1


# ---- the router as a workload of its own: placement, replicas, disruption, termination -------------------
PLACEMENT = {
    "pod__imagePullSecrets": [{"name": "mirror-pull"}],
    "pod__serviceAccountName": "engines",
    "scheduling__nodeSelector": {"pool": "inference"},
    "scheduling__tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
    ],
    "scheduling__priorityClassName": "llm-high",
    "scheduling__runtimeClassName": "nvidia",
    "scheduling__affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                ]
            }
        }
    },
}


def router_deployment(isvc: InferenceService) -> dict[str, Any]:
    (router,) = [o for o in render_router_children(isvc, CONFIG) if o["kind"] == "Deployment"]
    k8s_validate(router)
    return router


def test_router_pods_take_the_engines_pull_secrets_and_placement_but_keep_their_service_account() -> None:
    isvc = isvc_from("smollm2-cpu.yaml", **PLACEMENT)
    pod = router_deployment(isvc)["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "mirror-pull"}]  # a private mirror serves the router too
    assert pod["nodeSelector"] == {"pool": "inference"} and pod["priorityClassName"] == "llm-high"
    assert pod["tolerations"] == PLACEMENT["scheduling__tolerations"]
    assert pod["affinity"]["nodeAffinity"] == PLACEMENT["scheduling__affinity"]["nodeAffinity"]
    # its own ServiceAccount (EndpointSlice RBAC), no GPU runtime class
    assert pod["serviceAccountName"] == "smollm2-router" and "runtimeClassName" not in pod


def test_routing_pod_replaces_the_passthrough_field_by_field() -> None:
    isvc = isvc_from(
        "smollm2-cpu.yaml",
        **PLACEMENT,
        routing__pod={
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [],
            "imagePullSecrets": [{"name": "r"}],
        },
    )
    pod = router_deployment(isvc)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"} and pod["imagePullSecrets"] == [{"name": "r"}]
    assert "tolerations" not in pod  # set to empty: none for the router, whatever the engines have
    assert pod["priorityClassName"] == "llm-high"  # unset in routing.pod: the engines' value
    # the engines keep theirs
    engines = render_deployment(isvc, CONFIG)["spec"]["template"]["spec"]
    assert engines["nodeSelector"] == {"pool": "inference"} and engines["tolerations"]


def test_two_router_pods_spread_over_nodes_with_a_pdb() -> None:
    isvc = isvc_from("smollm2-cpu.yaml", **PLACEMENT)
    router = router_deployment(isvc)
    assert router["spec"]["replicas"] == 2
    assert router["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    labels = router["spec"]["template"]["metadata"]["labels"]
    anti = router["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert _selects(term["podAffinityTerm"]["labelSelector"]["matchLabels"], labels)
    (pdb,) = [o for o in render_router_children(isvc, CONFIG) if o["kind"] == "PodDisruptionBudget"]
    k8s_validate(pdb)
    assert pdb["metadata"]["name"] == "smollm2-router" and pdb["spec"]["maxUnavailable"] == 1
    assert _selects(pdb["spec"]["selector"]["matchLabels"], labels)
    engine_pods = render_deployment(isvc, CONFIG)["spec"]["template"]["metadata"]["labels"]
    assert not _selects(pdb["spec"]["selector"]["matchLabels"], engine_pods)
    assert isvc_from("smollm2-cpu.yaml", routing__replicas=3).spec.routing.replicas == 3


def test_router_terminates_as_the_engine_does() -> None:
    """preStop sleep, then SIGTERM with the engine's --shutdown-delay and --drain-timeout, and a grace period
    covering all of them: the same numbers as the engine pod's."""
    isvc = isvc_from("smollm2-cpu.yaml", engine__drainTimeoutSeconds=45)
    router, engines = router_deployment(isvc), render_deployment(isvc, CONFIG)
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["lifecycle"] == engine(engines)["lifecycle"]
    grace = router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace == engines["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    args = router_parser().parse_args(container["args"])
    engine_args = build_parser().parse_args(engine(engines)["args"])
    assert (args.shutdown_delay, args.drain_timeout) == (engine_args.shutdown_delay, 45)
    prestop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert grace > prestop + args.shutdown_delay + args.drain_timeout


def test_routing_pod_fields_the_api_server_defaults_stay_unset() -> None:
    """Through the CRD's defaulting (as the API server stores the object) an unset routing.pod field is still
    unset, so the router takes the engines' value: no `priorityClassName: ""` filled in."""
    doc = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    doc["metadata"].update(namespace="team-a", uid="uid-1234", generation=1)
    doc["spec"]["scheduling"] = {"priorityClassName": "llm-high"}
    doc["spec"]["routing"] = {"pod": {"nodeSelector": {"pool": "cpu"}}}
    stored = apply_defaults(crd_schema(), doc)
    assert stored["spec"]["routing"]["pod"] == {"nodeSelector": {"pool": "cpu"}}
    pod = router_deployment(load_inference_service(stored))["spec"]["template"]["spec"]
    assert (pod["priorityClassName"], pod["nodeSelector"]) == ("llm-high", {"pool": "cpu"})
