"""`specfleet up -f FILE.yaml [-f MORE.yaml ...] [--prometheus-url URL]`: run InferenceServices on this machine.

Starts `spec.replicas` engine processes on loopback, the router in front (`spec.routing.policy`, or
`--policy`), the engines publishing their KV events and the router routing on them as routing.kvEvents says
(or `--kv-events`), supervises the engines (an engine that exits is logged and restarted with backoff), the tuner when `spec.autotune.enabled` (or `--tune`), prints every tuner decision, and on
Ctrl-C / SIGTERM drains and stops everything. With several files, each service is such a fleet with its
router on a port of its own, and one gateway (router/gateway.py) on --port routes by the request's model,
as `specfleet router --gateway` does in the cluster; the files' routing.weight and routing.aliases are
read again every --discovery-interval, so editing a canary's weight moves its traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from specfleet.operator.inference_service import (
    InferenceService,
    InvalidInferenceService,
    load_inference_service,
)
from specfleet.router.front import Front
from specfleet.router.gateway import Gateway, serve_gateway
from specfleet.router.gateway_discovery import DEFAULT_INTERVAL_S
from specfleet.router.policies import POLICIES
from specfleet.router.tenant_gate import TenantGate
from specfleet.router.tenant_setup import add_tenant_flags, build_gate
from specfleet.router.tenants import InvalidTenants
from specfleet.router.tracing import add_trace_flag, traces_endpoint
from specfleet.tuner.loop import Tick

from .cores import CorePool
from .supervisor import LocalFleet


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specfleet up",
        description="Run an InferenceService YAML locally: its "
        "replicas as engine processes, one OpenAI endpoint, the same tuner.",
    )
    p.add_argument(
        "-f",
        "--file",
        required=True,
        action="append",
        help="InferenceService YAML (e.g. examples/smollm2-cpu.yaml); repeat it for several services behind "
        "one endpoint, routed by the request's model (the gateway: docs/router.md)",
    )
    p.add_argument(
        "--discovery-interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        help="with several -f: seconds between two reads of the files' routing.weight and routing.aliases",
    )
    add_tenant_flags(p, cluster=False)  # --tenants FILE puts the gateway in front, even of one service
    p.add_argument("--host", default="127.0.0.1", help="address of the OpenAI endpoint")
    p.add_argument("--port", type=int, default=8000, help="port of the OpenAI endpoint (0: any free port)")
    p.add_argument(
        "--prometheus-url",
        default=None,
        help="read metrics from this Prometheus (it must scrape the engines) instead of scraping them",
    )
    p.add_argument(
        "--prometheus-selector",
        default=None,
        help='PromQL label matchers for this service\'s series (default: job="<name>")',
    )
    tune = p.add_mutually_exclusive_group()
    tune.add_argument(
        "--tune", dest="tune", action="store_true", default=None, help="tune even if autotune is off"
    )
    tune.add_argument("--no-tune", dest="tune", action="store_false", help="never tune")
    p.add_argument(
        "--interval", type=float, default=None, help="tuning interval in seconds (default: the spec's)"
    )
    p.add_argument("--window", type=float, default=None, help="metrics rate window in seconds")
    add_routing_flags(p)
    p.add_argument(
        "--freeze-file",
        default=None,
        metavar="PATH",
        help="while this file exists the tuner changes nothing (default: LOG_DIR/tuner-freeze); "
        "spec.autotune.freeze in the YAML freezes it from the start",
    )
    p.add_argument(
        "--cpus-per-engine",
        type=int,
        default=None,
        metavar="N",
        help="pin each engine to N cores of its own and N threads, as the kubelet's static CPU manager "
        "does (default: every engine on every core)",
    )
    add_trace_flag(p, "the router's and the engines' request spans")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra engine argument (repeatable), e.g. --engine-arg=--kv-cache-gib=0.5",
    )
    return p


def add_routing_flags(p: argparse.ArgumentParser) -> None:
    """The flags that override the YAML's spec.routing: its policy, the engines' KV events, the picker's port."""
    p.add_argument(
        "--policy",
        default=None,
        choices=list(POLICIES),
        help="routing policy (default: the spec's routing.policy)",
    )
    p.add_argument(
        "--kv-events",
        default=None,
        choices=["off", "publish", "route"],
        help="the engines' KV events: route (they publish, the prefix policy routes on them), publish (they "
        "publish, the router estimates), off (default: the spec's routing.kvEvents, route with the "
        "prefix policy)",
    )
    p.add_argument(
        "--ext-proc-port",
        type=int,
        default=0,
        metavar="PORT",
        help="with routing.mode endpoint-picker: the endpoint picker's Envoy ext_proc port (default: a free "
        "one, printed; the cluster's is 9002); with several services each gets a free one",
    )


def say_for(label: str | None) -> Callable[[str], None]:
    """How a fleet's lines are printed: as they are for one service; with several, each after its service's
    key, so that their tuner, autoscaler and engine lines can be told apart."""

    def say(line: str) -> None:
        print(line if label is None else f"{label} {line}", flush=True)

    return say


def print_tick(tick: Tick, say: Callable[[str], None] = say_for(None)) -> None:
    d = tick.decision
    for transition in tick.transitions:
        if transition != "frozen":  # the frozen decision below says it
            say(f"[tuner] {transition}")
    if d.kind == "cooldown" or d.kind == "frozen" and "frozen" not in tick.transitions:
        return
    applied = ""
    if tick.applied is not None and (tick.applied.patched or tick.applied.failed):
        guard = "" if tick.guard is None else f" with speculative_disable_by_batch_size={tick.guard}"
        applied = (
            f" [{tick.applied.config.short()}{guard} applied to {len(tick.applied.patched)} engine(s)"
            + (f", failed on {len(tick.applied.failed)}]" if tick.applied.failed else "]")
        )
    say(f"[tuner] {d.kind}: {d.reason}{applied}")


async def serve_fleets(
    fleets: list[LocalFleet],
    on_started: Callable[[], Awaitable[None]],
    on_stopped: Callable[[], Awaitable[None]] | None = None,
    on_stopping: Callable[[], None] | None = None,
) -> int:
    """Start the fleets (a Ctrl-C / SIGTERM during the start stops them), `on_started` once all serve, then
    wait for the signal, `on_stopping` (what is in front of the fleets starts refusing new requests), drain
    and stop them, and `on_stopped`; 0 when every engine exited cleanly. A start that fails (an engine that
    never got ready, a port already taken) cancels the other fleets' start-ups and stops every engine
    started so far."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        for fleet in fleets:
            print(
                f"starting {fleet.isvc.spec.replicas} engine(s) for {fleet.isvc.name}; logs in {fleet.log_dir}",
                flush=True,
            )

        async def start_all() -> None:
            """Every fleet's start at once; the first that fails cancels the others' (a cancelled start
            kills its engines) and is raised as it is."""
            try:
                async with asyncio.TaskGroup() as group:
                    for fleet in fleets:
                        group.create_task(fleet.start())
            except ExceptionGroup as failed:
                raise failed.exceptions[0] from None

        start = asyncio.create_task(start_all())
        waiter = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait({start, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if start in done:
                start.result()
                await on_started()
                await waiter
            else:
                start.cancel()
                await asyncio.wait({start})  # every start-up has ended (and killed its engines)
        finally:
            waiter.cancel()
            await asyncio.wait({waiter})
        if on_stopping is not None:
            on_stopping()
        print("stopping: draining in-flight requests", flush=True)
    except (OSError, RuntimeError, TimeoutError, ValueError) as error:
        print(f"specfleet up: {error}", file=sys.stderr)
        for fleet in fleets:
            await fleet.stop(drain_timeout_s=0)
        if on_stopped is not None:
            await on_stopped()
        return 1
    codes = [code for fleet in fleets for code in await fleet.stop()]
    if on_stopped is not None:
        await on_stopped()
    print(f"stopped; engine exit codes {codes}", flush=True)
    return 0 if all(c == 0 for c in codes) else 1


async def run(fleet: LocalFleet) -> int:
    """One fleet, its router on the endpoint."""

    async def started() -> None:
        print(
            f"serving {fleet.isvc.spec.model.source} at {fleet.url}/v1 over {len(fleet.engine_urls)} engine(s): "
            f"{' '.join(fleet.engine_urls)}; routing: {fleet.router.policy.name} "
            f"({fleet.router.hasher.unit} blocks); router metrics at {fleet.url}/metrics",
            flush=True,
        )
        if fleet.tuner is not None:
            src = f"Prometheus {fleet.prometheus_url}" if fleet.prometheus_url else "direct /metrics scrape"
            print(
                f"tuner on: every {fleet.tuner.policy.params.interval_s:.0f}s from {src}; Ctrl-C stops",
                flush=True,
            )
            print(f"freeze the tuner: touch {fleet.freeze_file}; resume: rm {fleet.freeze_file}", flush=True)

    return await serve_fleets([fleet], started)


def service_key(isvc: InferenceService) -> str:
    """The gateway's name for a local service, as in the cluster: NAMESPACE/NAME (`default` when unset)."""
    return f"{isvc.namespace}/{isvc.name}"


def load_services(files: list[str]) -> list[InferenceService]:
    """Each file's InferenceService; refuses a service without replicas and two files naming one service."""
    services: list[InferenceService] = []
    for file in files:
        isvc = load_inference_service(file)
        if isvc.spec.replicas < 1:
            raise ValueError(f"{file} has spec.replicas={isvc.spec.replicas}; set it to 1 or more")
        if any(service_key(isvc) == service_key(s) for s in services):
            raise ValueError(f"{file}: {service_key(isvc)} is already given by another -f file; rename one")
        services.append(isvc)
    return services


async def follow_files(
    gateway: Gateway, files: list[str], fleets: list[LocalFleet], interval_s: float
) -> None:
    """Every interval: each file's routing.weight and routing.aliases into the gateway (an invalid edit is
    reported and the last valid values stay)."""
    reported: dict[str, str] = {}
    while True:
        for file, fleet in zip(files, fleets, strict=True):
            try:
                routing = load_inference_service(file).spec.routing
            except (InvalidInferenceService, OSError) as error:
                if reported.get(file) != str(error):
                    print(f"[gateway] {file}: {error}; keeping its last routing", file=sys.stderr, flush=True)
                reported[file] = str(error)
                continue
            reported.pop(file, None)
            key = service_key(fleet.isvc)
            before = gateway.services[key]
            names = (fleet.isvc.name, *routing.aliases)
            if (before.names, before.weight) != (names, routing.weight):
                print(f"[gateway] {key}: names {', '.join(names)}, weight {routing.weight}", flush=True)
            gateway.upsert(key, names, routing.weight, fleet.router)
        await asyncio.sleep(interval_s)


async def run_gateway(
    fleets: list[LocalFleet],
    files: list[str],
    host: str,
    port: int,
    interval_s: float,
    tenants: TenantGate | None = None,
    jobs: Sequence[Coroutine[Any, Any, None]] = (),
) -> int:
    """Several fleets (or one, with tenants) behind one gateway on host:port; `jobs` (the tenants file's
    reading, tenant_setup.build_gate) run from the gateway's start to its stop."""
    gateway = Gateway(tenants=tenants)
    # the process's one tracer per collector (RouterTracer.from_endpoint), which the routers share
    gateway.tracer = fleets[0].router.tracer
    runner: Front | None = None
    tasks: list[asyncio.Task[None]] = []

    async def started() -> None:
        nonlocal runner, port
        for fleet in fleets:
            routing = fleet.isvc.spec.routing
            gateway.upsert(
                service_key(fleet.isvc), (fleet.isvc.name, *routing.aliases), routing.weight, fleet.router
            )
        gateway.synced = True
        runner = await serve_gateway(gateway, host, port)
        port = runner.port  # the one asked for, or the kernel's pick for 0 (no race with another socket)
        tasks.append(asyncio.create_task(follow_files(gateway, files, fleets, interval_s)))
        tasks.extend(asyncio.create_task(job) for job in jobs)
        print(
            f"serving {', '.join(sorted(gateway.models()))} at http://{host}:{port}/v1 (gateway over "
            f"{len(fleets)} services: "
            + "; ".join(
                f"{service_key(f.isvc)} weight {f.isvc.spec.routing.weight} at {f.url}" for f in fleets
            )
            + f"); metrics at http://{host}:{port}/metrics",
            flush=True,
        )

    def stopping() -> None:
        """As one service's router on stop (LocalFleet.stop) and the cluster's on SIGTERM (shutdown.py): at
        once /ready fails, new requests get 503 and every response closes its connection, on every
        service's router at the same time, while the fleets drain."""
        gateway.stopping = gateway.draining = True

    async def stopped() -> None:
        for task in tasks:
            task.cancel()
        if runner is not None:
            await runner.cleanup()

    try:
        return await serve_fleets(fleets, started, stopped, stopping)
    finally:
        if runner is None:  # never started: its jobs were never awaited
            for job in jobs:
                job.close()


def build_fleets(args: argparse.Namespace, services: list[InferenceService]) -> list[LocalFleet]:
    """One local fleet per service, from the command line; with several (a gateway in front), each router on
    a port of its own and each fleet's lines labelled with its service."""
    several = len(services) > 1 or bool(args.tenants)  # a gateway in front
    traces = traces_endpoint(args.otlp_traces_endpoint)  # main() has refused a bad one by name already
    fleets = []
    for isvc in services:
        say = say_for(service_key(isvc) if several else None)
        fleets.append(
            LocalFleet(
                isvc,
                # behind a gateway with tenants, a service's router on --host would take calls without a key
                host="127.0.0.1" if args.tenants else args.host,
                port=0 if several else args.port,
                prometheus_url=args.prometheus_url,
                prometheus_selector=args.prometheus_selector,
                tune=args.tune,
                interval_s=args.interval,
                window_s=args.window,
                engine_extra_args=list(args.engine_arg),
                on_tick=functools.partial(print_tick, say=say),
                policy=args.policy,
                kv_events=args.kv_events,
                freeze_file=Path(args.freeze_file) if args.freeze_file else None,
                cpus_per_engine=args.cpus_per_engine,
                say=say,
                otlp_traces_endpoint=traces,
                ext_proc_port=0 if several else args.ext_proc_port,
            )
        )
    return fleets


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        services = load_services(args.file)
    except (InvalidInferenceService, OSError, ValueError) as error:
        print(f"specfleet up: {error}", file=sys.stderr)
        return 2
    if args.discovery_interval <= 0:
        print(f"specfleet up: --discovery-interval={args.discovery_interval} must be > 0", file=sys.stderr)
        return 2
    try:
        CorePool().check(args.cpus_per_engine or 1)
    except ValueError as error:
        print(f"specfleet up: --cpus-per-engine: {error}", file=sys.stderr)
        return 2
    try:
        traces_endpoint(args.otlp_traces_endpoint)  # refused here, by name, before anything starts
    except ValueError as error:
        print(f"specfleet up: {error}", file=sys.stderr)
        return 2
    try:
        gate, jobs = build_gate(args)
    except (InvalidTenants, OSError, ValueError) as error:
        print(f"specfleet up: {error}", file=sys.stderr)
        return 2
    fleets = build_fleets(args, services)
    if len(fleets) > 1 or gate is not None:
        return asyncio.run(
            run_gateway(fleets, args.file, args.host, args.port, args.discovery_interval, gate, jobs)
        )
    return asyncio.run(run(fleets[0]))


if __name__ == "__main__":
    raise SystemExit(main())
