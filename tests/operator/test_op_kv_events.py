"""routing.kvEvents: with the prefix policy the operator has the engines publish their KV events (vLLM's
--kv-events-config, ports declared) and the router subscribe to them with the model's tokenizer, which an
init step copies into the router pods. Each rendered flag is read back by the engine's and the router's own
parsers; the init step's script runs here on a real model folder, and the router is built from the flags
on what it wrote.

What the API double does not model: the kubelet (init containers, $(VAR) expansion, emptyDir), the image
pulls, and Hugging Face (the hf:// step's download is only rendered here)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_kube import FakeKube, Rbac
from isvc_schema_tools import REPO, admission_errors, k8s_validate
from specfleet.engine.kv_events_config import KVEventsConfig
from specfleet.engine.python_child import python_command
from specfleet.engine.server.cli import build_parser as engine_parser
from specfleet.engine.server.cli import engine_config_kwargs
from specfleet.operator import load_inference_service
from specfleet.operator.render import render_engine_workloads, render_router_children
from specfleet.operator.render.tokenizer import COPY_SCRIPT, TOKENIZER_VOLUME
from specfleet.operator.resources import KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT, TOKENIZER_DIR
from specfleet.router import cli as router_cli
from specfleet.router.kv_subscriber import event_endpoints
from test_op_reconcile import CONFIG, DEPLOY, ISVC, NS, reconcile

NAME = "smollm2"


def doc(source: str | None = None, **routing: Any) -> dict[str, Any]:
    d = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    d["metadata"] = {"name": NAME, "namespace": NS, "uid": "uid-1", "generation": 1}
    d["spec"]["routing"] = {**d["spec"].get("routing", {}), **routing}
    if source is not None:
        d["spec"]["model"]["source"] = source
    return d


def engine_container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def router_pod(isvc_doc: dict[str, Any]) -> dict[str, Any]:
    children = render_router_children(load_inference_service(isvc_doc), CONFIG)
    (router,) = [c for c in children if c["kind"] == "Deployment"]
    return router["spec"]["template"]["spec"]


def test_prefix_routing_has_the_engines_publish_where_the_router_subscribes() -> None:
    fake = FakeKube(rbac=Rbac.from_chart({"watch": {"namespaces": [NS]}})).start()
    try:
        fake.put(*ISVC, NS, doc())
        reconcile(fake)
        engine = engine_container(fake.get(*DEPLOY, NS, NAME))
        router = fake.get(*DEPLOY, NS, f"{NAME}-router")
    finally:
        fake.stop()
    # the engine's own parser and config read the JSON the operator wrote
    config = engine_config_kwargs(engine_parser().parse_args(engine["args"]))
    events = KVEventsConfig.parse(config["kv_events_config"])
    assert events.publishes and events.topic == ""
    assert (events.endpoint, events.replay_endpoint) == (
        f"tcp://*:{KV_EVENTS_PORT}",
        f"tcp://*:{KV_EVENTS_REPLAY_PORT}",
    )
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
    assert (ports["kv-events"], ports["kv-replay"]) == (KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT)
    # the router's parser: the tokenizer it mounts, and the sockets it derives from a discovered pod's IP
    # are the ones the engine binds on that pod
    pod = router["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = router_cli.build_parser().parse_args(container["args"])
    assert args.policy == "prefix" and args.tokenizer == TOKENIZER_DIR and args.kv_events_topic == ""
    pub, replay = event_endpoints("http://10.1.2.3:8000", args.kv_events_port, args.kv_events_replay_port)
    assert (pub, replay) == (
        events.endpoint.replace("*", "10.1.2.3"),
        (events.replay_endpoint or "").replace("*", "10.1.2.3"),
    )
    # the init step fills the emptyDir the router reads read-only at --tokenizer
    (init,) = pod["initContainers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[TOKENIZER_VOLUME]
    assert {"name": TOKENIZER_VOLUME, "mountPath": TOKENIZER_DIR, "readOnly": True} in container[
        "volumeMounts"
    ]
    assert {"name": TOKENIZER_VOLUME, "mountPath": TOKENIZER_DIR} in init["volumeMounts"]
    assert init["command"][:3] == ["python", "-c", COPY_SCRIPT] and init["command"][-1] == TOKENIZER_DIR
    # a bundled model is in the engine image, its tokenizer inside its GGUF
    assert init["image"] == engine["image"]
    assert init["command"][3:5] == ["gguf", "bundled://smollm2-135m-instruct"]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in init["volumeMounts"]} >= {"/tmp", TOKENIZER_DIR}


@pytest.mark.parametrize(
    "routing",
    [{"kvEvents": False}, {"policy": "least-loaded"}, {"enabled": False}],
    ids=["kvEvents false", "least-loaded", "no router"],
)
def test_without_prefix_routing_on_events_nothing_publishes(routing: dict[str, Any]) -> None:
    isvc = load_inference_service(doc(**routing))
    (engines,) = render_engine_workloads(isvc, CONFIG)
    engine = engine_container(engines)
    assert not any(a.startswith("--kv-events") for a in engine["args"])
    assert not {p["name"] for p in engine["ports"]} & {"kv-events", "kv-replay"}
    if isvc.spec.routing.enabled:
        pod = router_pod(doc(**routing))
        assert "initContainers" not in pod and TOKENIZER_VOLUME not in {
            v["name"] for v in pod.get("volumes", [])
        }
        args = router_cli.build_parser().parse_args(pod["containers"][0]["args"])
        assert (args.tokenizer, args.kv_events_port) == (None, 0)


def test_the_users_extra_args_may_not_move_the_sockets() -> None:
    d = doc()
    d["spec"]["engine"]["extraArgs"] = ["--kv-events-config", '{"enable_kv_cache_events": false}']
    assert any("--kv-events-config" in e for e in admission_errors(d))


def test_each_model_source_is_copied_from_where_the_engines_read_it() -> None:
    pvc = router_pod(doc("pvc://models/llama/8b"))
    (init,) = pvc["initContainers"]
    assert init["image"] == pvc["containers"][0]["image"]  # a copy: the router's own image
    assert init["command"][3:5] == ["copy", "/models/model/llama/8b"]
    claim = {v["name"]: v for v in pvc["volumes"]}["tokenizer-source"]["persistentVolumeClaim"]
    assert claim == {"claimName": "models", "readOnly": True}
    # hf:// with the shared cache claim and a token: the tokenizer files into the engines' folder for the
    # revision, with the token from the Secret file
    d = doc("hf://org/model@abc123")
    d["spec"]["model"].update(cache={"claimName": "hf-cache"}, hfTokenSecret="hf-token")
    hf = router_pod(d)
    (init,) = hf["initContainers"]
    assert init["command"][3:7] == ["hf", "org/model", "abc123", "/hf-cache/org/model/abc123"]
    env = {e["name"]: e["value"] for e in init["env"]}
    assert env["HF_TOKEN_PATH"] == "/var/run/secrets/specfleet/hf-token/HF_TOKEN"
    volumes = {v["name"]: v for v in hf["volumes"]}
    assert volumes["tokenizer-source"]["persistentVolumeClaim"]["claimName"] == "hf-cache"
    assert volumes["tokenizer-hf-token"]["secret"]["secretName"] == "hf-token"
    # without the claim: straight into the emptyDir
    (init,) = router_pod(doc("hf://org/model"))["initContainers"]
    assert init["command"][3:7] == ["hf", "org/model", "", TOKENIZER_DIR]
    (init,) = router_pod(doc("file:///opt/models/llama"))["initContainers"]
    assert init["command"][3:5] == ["copy", "/opt/models/llama"]
    (init,) = router_pod(doc("file:///opt/models/llama.Q4_K_M.gguf"))["initContainers"]
    assert init["command"][3:5] == ["gguf", "/opt/models/llama.Q4_K_M.gguf"]
    for source in ("pvc://models/llama/8b", "hf://org/model@abc123", "bundled://smollm2-135m-instruct"):
        d = doc(source)
        d["spec"]["model"].update(cache={"claimName": "hf-cache"}, hfTokenSecret="hf-token")
        for child in render_router_children(load_inference_service(d), CONFIG):
            k8s_validate(copy.deepcopy(child))


def test_the_init_step_fills_a_folder_the_router_starts_on(bundled_path: str, tmp_path: Path) -> None:
    """The step's script run on a model folder (the copy a pvc:// or file:// source gets), then the router
    built from the rendered flags on what it wrote: its encoder and the model's chat template load. A
    folder without tokenizer.json fails the step with a message naming it."""
    pod = router_pod(doc("pvc://models/smollm2"))
    (init,) = pod["initContainers"]
    dest = tmp_path / "tokenizer"
    dest.mkdir()
    command = [*init["command"][1:]]
    command[3], command[-1] = str(bundled_path), str(dest)  # the claim's folder and the emptyDir, here
    done = subprocess.run(python_command(*command), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (dest / "tokenizer.json").is_file() and not (dest / "config.json").exists()
    args = pod["containers"][0]["args"]
    args = [str(dest) if a == TOKENIZER_DIR else a for a in args]
    args = router_cli.build_parser().parse_args(
        ["--endpoint", "http://127.0.0.1:1", *args[args.index("--port") :]]
    )
    router = router_cli.build_router(args)
    try:
        assert router.kv_feeds is not None and router.kv_feeds.port == KV_EVENTS_PORT
        assert router.hasher.encode is not None and router.hasher.encode("Hello there")
        assert router.chat_template is not None
    finally:
        router.kv_feeds.subscriber.close()
    empty = tmp_path / "empty"
    empty.mkdir()
    command[3] = str(empty)
    failed = subprocess.run(python_command(*command), capture_output=True, text=True, timeout=60)
    assert failed.returncode != 0 and f"{empty} has no tokenizer.json" in failed.stderr


@pytest.mark.slow
def test_a_bundled_models_step_writes_the_tokenizer_its_gguf_carries(
    bundled_path: str, tmp_path: Path
) -> None:
    """The default examples' case: the engine image's step reads the tokenizer out of the bundled GGUF (with
    transformers, as the engine's loader does); the router's encoder on it gives the engine's token ids."""
    from tokenizers import Tokenizer

    (init,) = router_pod(doc())["initContainers"]
    command = [*init["command"][1:]]
    command[-1] = str(tmp_path)
    done = subprocess.run(python_command(*command), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    encode = router_cli.load_encoder(str(tmp_path))
    engines = Tokenizer.from_file(str(Path(bundled_path) / "tokenizer.json"))
    text = "<|im_start|>user\nWhere does the router read the tokenizer from?<|im_end|>"
    assert encode(text) == engines.encode(text, add_special_tokens=False).ids
    assert (tmp_path / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (tmp_path / "tokenizer_config.json").read_text()
    )


def test_the_network_policy_lets_the_services_router_alone_reach_the_event_ports() -> None:
    from specfleet.operator.render.network import render_network_policy

    policy = render_network_policy(load_inference_service(doc()), CONFIG)
    k8s_validate(policy)
    ports = [{"port": KV_EVENTS_PORT, "protocol": "TCP"}, {"port": KV_EVENTS_REPLAY_PORT, "protocol": "TCP"}]
    (rule,) = [r for r in policy["spec"]["ingress"] if r.get("ports") == ports]
    (router,) = [
        c for c in render_router_children(load_inference_service(doc()), CONFIG) if c["kind"] == "Deployment"
    ]
    (source,) = rule["from"]
    assert (
        source["podSelector"]["matchLabels"].items()
        <= router["spec"]["template"]["metadata"]["labels"].items()
    )
    off = render_network_policy(load_inference_service(doc(kvEvents=False)), CONFIG)
    assert not any(r.get("ports") == ports for r in off["spec"]["ingress"])


def test_the_engines_chat_flags_reach_the_router_and_their_own_template_leaves_it_on_the_estimate(
    bundled_path: str, tmp_path: Path
) -> None:
    """The engines' chat flags change what they prefill for a chat request: the router takes them, as
    `specfleet up`'s does. A --chat-template file lives in the engine pod, so the step leaves the model's
    template out and the router, with no template, matches chat on its estimate instead of on tokens the
    engines never prefilled."""
    from specfleet.operator.render.tokenizer import NO_CHAT_TEMPLATE_ENV
    from specfleet.router.chat_template import ChatTemplate

    d = doc("pvc://models/smollm2")
    kwargs = '{"enable_thinking": false}'
    d["spec"]["engine"]["extraArgs"] = [
        "--default-chat-template-kwargs",
        kwargs,
        "--exclude-tools-when-tool-choice-none",
    ]
    pod = router_pod(d)
    args = router_cli.build_parser().parse_args(pod["containers"][0]["args"])
    assert args.default_chat_template_kwargs == kwargs and args.exclude_tools_when_tool_choice_none
    assert args.chat_template is None
    assert NO_CHAT_TEMPLATE_ENV not in {e["name"] for e in pod["initContainers"][0]["env"]}

    d["spec"]["engine"]["extraArgs"] = ["--chat-template", "/etc/templates/mine.jinja"]
    pod = router_pod(d)
    args = router_cli.build_parser().parse_args(pod["containers"][0]["args"])
    assert args.chat_template is None and args.tokenizer == TOKENIZER_DIR
    (init,) = pod["initContainers"]
    env = {e["name"]: e["value"] for e in init["env"]}
    assert env[NO_CHAT_TEMPLATE_ENV] == "1"
    command = [*init["command"][1:]]
    command[3], command[-1] = str(bundled_path), str(tmp_path)
    done = subprocess.run(
        python_command(*command), capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )
    assert done.returncode == 0, done.stderr
    assert ChatTemplate.load(bundled_path) is not None  # the model has one ...
    assert ChatTemplate.load(tmp_path) is None  # ... which the router's copy leaves out
    assert router_cli.load_encoder(str(tmp_path))("Hello")  # the tokenizer itself is there
