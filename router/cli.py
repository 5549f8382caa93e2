"""`specfleet router`: the fleet router as a process (the operator runs it per InferenceService)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specfleet.engine.kv_transfer import prefill_signature

from .adapters import AdapterTable
from .chat_template import ChatTemplate, TemplateUnusable, add_engine_chat_flags
from .discovery import EndpointSliceWatch, RoleStates, States, probe_forever
from .endpoints import EndpointSet
from .gateway import Gateway, serve_gateway
from .gateway_discovery import DEFAULT_INTERVAL_S, InferenceServiceDiscovery
from .kv_index import ExactPrefixIndex
from .kv_subscriber import KVEventFeeds, KVEventSubscriber
from .policies import DEFAULT_POLICY, POLICIES, PrefixAffinity, make_policy
from .prefix import BlockHasher, stable_hash
from .proxy import CLEANUP_GRACE_SECONDS, Router, serve
from .shutdown import Drainable, drain
from .tenant_setup import add_tenant_flags, build_gate
from .tracing import RouterTracer, add_trace_flag, traces_endpoint


def add_gateway_flags(p: argparse.ArgumentParser, where: argparse._MutuallyExclusiveGroup) -> None:
    """--gateway (one of the ways to find engines, in `where`) and the flags that go with it."""
    where.add_argument(
        "--gateway",
        action="store_true",
        help="in-cluster: serve every InferenceService of --gateway-namespace (or --all-namespaces) that "
        "matches --selector, routed by the request's model (docs/router.md, 'Gateway')",
    )
    p.add_argument(
        "--gateway-namespace",
        action="append",
        default=None,
        metavar="NS",
        help="with --gateway: a namespace to serve (repeatable; default: the pod's own)",
    )
    p.add_argument(
        "--all-namespaces", action="store_true", help="with --gateway: serve every namespace (a ClusterRole)"
    )
    p.add_argument(
        "--selector", default="", help="with --gateway: label selector of the InferenceServices served"
    )
    p.add_argument(
        "--discovery-interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        help="with --gateway: seconds between two lists of the InferenceServices (a weight change takes "
        "effect within one)",
    )
    add_tenant_flags(p)  # with --gateway: API keys, quotas, priorities (router/tenant_setup.py)


def add_kv_events_flags(p: argparse.ArgumentParser) -> None:
    """The engines' KV events, which give the prefix policy an exact index (router/kv_subscriber.py), and
    the engines' LoRA adapters, which give adapter requests their affinity (router/adapters.py)."""
    p.add_argument(
        "--adapter-affinity",
        action="store_true",
        help="read each engine's LoRA adapters (/v1/models, vllm:lora_requests_info) every second and send "
        "a request naming one to an engine where it is active, else one with a free adapter slot",
    )
    p.add_argument(
        "--kv-events-port",
        type=int,
        default=0,
        help="prefix policy: subscribe to every engine's KV events on this port (the engines' "
        "--kv-events-config endpoint) and route on the exact index they give; needs --tokenizer",
    )
    p.add_argument(
        "--kv-events-replay-port", type=int, default=0, help="the engines' KV events replay port (0: none)"
    )
    p.add_argument("--kv-events-topic", default="", help="the engines' KV events topic (prefix)")


def add_endpoint_picker_flags(p: argparse.ArgumentParser) -> None:
    """The router as a Gateway API InferencePool's endpoint picker (router/endpoint_picker.py)."""
    p.add_argument(
        "--ext-proc-port",
        type=int,
        default=0,
        help="also serve as an InferencePool's endpoint picker: Envoy's ext_proc and gRPC health on this "
        "port (the Gateway API Inference Extension's default: 9002; 0: off; docs/router.md)",
    )
    p.add_argument(
        prefill_signature.KEY_FILE_FLAG,
        default=None,
        metavar="PATH",
        help=f"with --ext-proc-port: sign the prefill engine the picker names ({prefill_signature.HEADER}, "
        "over it and the request body) with the key in this file, which the decode engines get as their "
        f"{prefill_signature.KEY_FILE_FLAG} (docs/router.md, As a Gateway API endpoint picker)",
    )


def add_retry_flags(p: argparse.ArgumentParser) -> None:
    """What the router does when an engine fails: before the first byte (retry), or after it (resume)."""
    p.add_argument(
        "--max-retries", type=int, default=2, help="other engines tried after a failure before the first byte"
    )
    p.add_argument(
        "--max-resumes",
        type=int,
        default=2,
        help="times a stream cut after its first byte goes on from another engine, from the tokens "
        "already sent (router/resume.py; 0: never)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specfleet router",
        description="One OpenAI endpoint in front of engines: "
        "prefix-aware routing, retries before the first byte, SSE passthrough.",
    )
    p.add_argument("--host", default="0.0.0.0", help="listen address")
    p.add_argument("--port", type=int, default=8080, help="listen port")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=list(POLICIES), help="routing policy")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--endpoint",
        action="append",
        default=None,
        metavar="URL",
        help="a static engine URL (repeatable); its /ready is probed every second",
    )
    where.add_argument(
        "--service",
        default=None,
        help="watch the EndpointSlices of this (headless) Service, in --namespace, in-cluster",
    )
    add_gateway_flags(p, where)
    p.add_argument(
        "--prefill-service",
        default=None,
        help="with --service: the prefill engines' (headless) Service; --service then holds the decode "
        "engines, and each request runs its prompt on a prefill engine first",
    )
    p.add_argument("--namespace", default=None, help="the Service's namespace (default: the pod's own)")
    p.add_argument("--port-name", default="http", help="the engine port's name in the EndpointSlices")
    p.add_argument("--model", default="", help="the served model's name: seeds the prefix hashes")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer.json (or a folder with one): hash token blocks "
        "as the engine does, chat requests through the model's chat template found beside it "
        "(chat_template.jinja, tokenizer_config.json); without it, blocks of block-size x 4 characters",
    )
    add_engine_chat_flags(p)
    p.add_argument("--block-size", type=int, default=16, help="the engines' KV block size in tokens")
    add_kv_events_flags(p)
    add_endpoint_picker_flags(p)
    p.add_argument(
        "--load-factor",
        type=float,
        default=1.25,
        help="prefix policy: an engine takes a request only "
        "while its in-flight count stays <= ceil(factor x mean)",
    )
    p.add_argument(
        "--session-header", default="x-session-id", help="session-affinity header ('' turns it off)"
    )
    add_retry_flags(p)
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=0.0,
        help="seconds a request waits for a ready engine (scale from zero); 0 answers 503 at once",
    )
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting at most")
    # the engine's flags, with the engine's meaning (engine/server/cli.py; router/shutdown.py)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests (streams included) may take to finish after SIGTERM",
    )
    p.add_argument(
        "--shutdown-delay",
        type=float,
        default=0.0,
        help="seconds after SIGTERM during which /ready already fails but new requests are still "
        "served (clients routed before the endpoint was removed), before they get 503",
    )
    p.add_argument("--log-level", default="INFO")
    add_trace_flag(p, "each request's spans (routing, the hops to the engines)")
    return p


def build_tracer(args: argparse.Namespace) -> RouterTracer | None:
    """The router's spans when the flag or the OTEL_EXPORTER_OTLP_* variables name a collector, else None."""
    endpoint = traces_endpoint(args.otlp_traces_endpoint)
    return RouterTracer.from_endpoint(endpoint) if endpoint else None


def load_encoder(path: str):  # returns a text -> ids function
    from tokenizers import Tokenizer  # only with --tokenizer: the cluster router needs no tokenizer

    file = Path(path)
    tokenizer = Tokenizer.from_file(str(file / "tokenizer.json" if file.is_dir() else file))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def load_chat_template(args: argparse.Namespace) -> ChatTemplate | None:
    """The model's chat template beside --tokenizer (in its folder, or the tokenizer.json's folder), under
    the engines' chat flags, so that chat requests are hashed as the engines render them; None (chat on the
    estimate) where there is none or it does not compile (logged: the engines' chat endpoint answers 400
    with it too). A bad flag is a ValueError naming it, as the engine refuses it."""
    file = Path(args.tokenizer)
    try:
        return ChatTemplate.load(file if file.is_dir() else file.parent, args)
    except TemplateUnusable as exc:
        logging.getLogger("specfleet.router").warning("event=chat_template_unusable error=%s", exc)
        return None


def build_router(args: argparse.Namespace) -> Router:
    if args.block_size < 1:
        raise ValueError(f"--block-size={args.block_size} must be >= 1")
    if min(args.max_retries, args.max_queue, args.queue_timeout, args.drain_timeout, args.shutdown_delay) < 0:
        raise ValueError(
            "--max-retries, --max-queue, --queue-timeout, --drain-timeout and --shutdown-delay must be >= 0"
        )
    options = {"load_factor": args.load_factor} if args.policy == "prefix" else {}
    encode = load_encoder(args.tokenizer) if args.tokenizer else None
    hasher = BlockHasher(args.block_size, encode, stable_hash(args.model) if args.model else 0)
    policy = make_policy(args.policy, **options)
    router = Router(
        EndpointSet(),
        policy,
        hasher,
        args.session_header or None,
        args.max_retries,
        args.queue_timeout,
        args.max_queue,
    )
    if encode is not None:
        router.chat_template = load_chat_template(args)
    if args.max_resumes < 0:
        raise ValueError(f"--max-resumes={args.max_resumes} must be >= 0")
    router.max_resumes = args.max_resumes
    if args.kv_events_port:
        router.kv_feeds = kv_event_feeds(args, policy, hasher)
    if args.adapter_affinity:
        router.adapters = AdapterTable()
    return router


def kv_event_feeds(args: argparse.Namespace, policy: object, hasher: BlockHasher) -> KVEventFeeds:
    """--kv-events-port: the subscriber whose exact index the prefix policy reads."""
    if not isinstance(policy, PrefixAffinity):
        raise ValueError(f"--kv-events-port needs --policy prefix, not {args.policy!r}")
    if hasher.encode is None:
        raise ValueError("--kv-events-port needs --tokenizer: the engines' events name token blocks")
    for flag, port in (
        ("--kv-events-port", args.kv_events_port),
        ("--kv-events-replay-port", args.kv_events_replay_port),
    ):
        if not 0 <= port <= 65535:
            raise ValueError(f"{flag}={port} must be between 0 and 65535")
    subscriber = KVEventSubscriber(ExactPrefixIndex(hasher.seed), args.kv_events_topic)
    policy.exact = subscriber.match
    return KVEventFeeds(subscriber, args.kv_events_port, args.kv_events_replay_port or None)


async def run_gateway(args: argparse.Namespace) -> int:
    if args.discovery_interval <= 0:
        raise ValueError(f"--discovery-interval={args.discovery_interval} must be > 0")
    if args.all_namespaces and args.gateway_namespace:
        raise ValueError("--all-namespaces and --gateway-namespace exclude each other")
    gate, tenant_jobs = build_gate(args)
    gateway = Gateway(args.session_header or None, gate)
    gateway.tracer = build_tracer(args)
    namespaces = (
        None if args.all_namespaces else args.gateway_namespace or [InferenceServiceDiscovery.own_namespace()]
    )
    discovery = InferenceServiceDiscovery.in_cluster(
        gateway,
        namespaces,
        selector=args.selector,
        port_name=args.port_name,
        interval_s=args.discovery_interval,
        max_retries=args.max_retries,
    )
    tasks = [asyncio.create_task(job) for job in [discovery.run(), *tenant_jobs]]
    runner = await serve_gateway(gateway, args.host, args.port)
    logging.getLogger("specfleet.router").info(
        "event=listening host=%s port=%d gateway=true namespaces=%s selector=%r",
        args.host,
        args.port,
        "*" if namespaces is None else ",".join(namespaces),
        args.selector,
    )
    await _until_signalled(gateway, args)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)  # its watches stop, removed services' routers close
    await runner.cleanup()
    if gateway.tracer is not None:
        gateway.tracer.shutdown()
    return 0


async def _until_signalled(target: Drainable, args: argparse.Namespace) -> None:
    stop, forced = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:  # the first signal drains; a second one skips the drain's waits
        (forced if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    await drain(target, args.shutdown_delay, args.drain_timeout, forced)


def endpoint_picker_key(args: argparse.Namespace) -> bytes | None:
    """--remote-prefill-key-file's key (read before discovery starts); a ValueError without --ext-proc-port
    or for a missing, empty or short file."""
    path = getattr(args, "remote_prefill_key_file", None)
    if path is None:
        return None
    if not args.ext_proc_port:
        raise ValueError(
            f"{prefill_signature.KEY_FILE_FLAG} signs the endpoint picker's prefill header: add --ext-proc-port"
        )
    return prefill_signature.read_key(path)


async def start_endpoint_picker(
    router: Router, args: argparse.Namespace, prefill_key: bytes | None = None
) -> Any:
    """--ext-proc-port: the EPP's gRPC server (imported only then: grpc and Envoy's protos load in seconds)."""
    if not args.ext_proc_port:
        return None
    if not 0 < args.ext_proc_port <= 65535:
        raise ValueError(f"--ext-proc-port={args.ext_proc_port} must be between 1 and 65535")
    from .ext_proc_server import serve_endpoint_picker

    server, _ = await serve_endpoint_picker(router, args.host, args.ext_proc_port, prefill_key)
    return server


async def run(args: argparse.Namespace) -> int:
    if args.gateway:
        return await run_gateway(args)
    if args.tenants or args.tenant_selector or args.redis_url:
        raise ValueError("--tenants, --tenant-selector and --redis-url are the gateway's: add --gateway")
    router = build_router(args)
    router.tracer = build_tracer(args)

    if args.prefill_service and not args.service:
        raise ValueError("--prefill-service needs --service (the decode engines' Service)")
    prefill_key = endpoint_picker_key(args)
    tasks: list[asyncio.Task[None]] = []
    if args.service:
        namespace = (
            args.namespace or Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text()
        )
        roles = RoleStates(router)
        services = [
            (args.service, "decode" if args.prefill_service else None),
            *([(args.prefill_service, "prefill")] if args.prefill_service else []),
        ]
        for service, role in services:
            discovery = EndpointSliceWatch.in_cluster(
                namespace.strip(), service, roles.watcher(role), port_name=args.port_name
            )
            tasks.append(asyncio.create_task(discovery.run()))
    else:

        def on_change(states: States) -> None:
            router.endpoints_changed(router.endpoints.replace(states))

        tasks.append(asyncio.create_task(probe_forever([u.rstrip("/") for u in args.endpoint], on_change)))
    runner = await serve(router, args.host, args.port)
    logging.getLogger("specfleet.router").info(
        "event=listening host=%s port=%d policy=%s", args.host, args.port, args.policy
    )
    picker = await start_endpoint_picker(router, args, prefill_key)
    await _until_signalled(router, args)
    for task in tasks:  # discovery ran through the drain: streams may still have needed a new engine
        task.cancel()
    if picker is not None:
        await picker.stop(CLEANUP_GRACE_SECONDS)
    await runner.cleanup()
    if router.tracer is not None:
        router.tracer.shutdown()
    return 0


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (the operator image has it): its I/O and callbacks run in C,
    where asyncio's own loop was a large part of the router's CPU per streamed request (`specfleet bench
    router`, docs/results/2026-12-03-bench-router.md); None (asyncio's loop) otherwise."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(run(args))
    except (ValueError, OSError, KeyError) as error:
        print(f"specfleet router: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
