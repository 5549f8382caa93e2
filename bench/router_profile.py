"""`specfleet bench router-profile`: where the router's CPU goes per streamed request, at one concurrency.

The router alone (this checkout's, or `--router-src`'s) in front of the fake engine of `specfleet bench
router`, the same 64-event streams, `--requests` requests over `--concurrency` keep-alive connections,
twice:

1. plain: the router's own CPU time per request from /proc (user + system), and the request rate;
2. profiled: the same load with cProfile switched on inside the router for the load only (SIGUSR1 starts
   it after the warm-up, SIGUSR2 stops it and writes the stats; startup and imports are not in them): each
   function's own time per request, summed by package (the router's code, aiohttp, logging, asyncio,
   uvloop's and httptools' C methods, ...), and the functions that cost the most.

`--gateway open|tenants` measures the gateway instead (`specfleet router --gateway`, or `specfleet up` over
several services): one service named `bench` over the same fake engine; `tenants` adds the tenant gate (one
tenant whose rpm and tpm limits are never reached, so every request is admitted, charged and settled, and
each stream asked for its usage and read for it), the requests carrying its key.

The CPU per request at a fixed concurrency moves less with other work on the host than the latencies and
rates of the comparison with nginx do; cProfile's own overhead inflates the profiled figures (about 2x for
code that makes many small calls), so compare profiles with profiles and plain CPU with plain CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import pstats
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specfleet.bench import stoppable
from specfleet.bench.proxy_load import Connection, completion_request, start_upstream
from specfleet.bench.router_cost import (
    CLOCK_TICKS,
    HOST,
    LOAD_ROUTER_SOURCE,
    PROMPT,
    ROUTER_FROM_SOURCE,
    Proxies,
    Target,
    add_max_resumes,
    free_port,
    pin_cores,
    router_args,
    use_uvloop,
    wait_ready,
)
from specfleet.engine.python_child import python_command

# Prepended to the router's launch: a profiler the bench switches on and off by signal, so that the stats
# hold the measured load only. The signal handlers run between two of the loop's callbacks.
PROFILED = """
import cProfile, signal, sys
_profile, _out = cProfile.Profile(), sys.argv.pop(1)
def _toggle(signum, frame):
    if signum == signal.SIGUSR1:
        _profile.enable()
    else:
        _profile.disable()
        _profile.dump_stats(_out + ".part")
        __import__("os").replace(_out + ".part", _out)
signal.signal(signal.SIGUSR1, _toggle)
signal.signal(signal.SIGUSR2, _toggle)
"""
THIS_ROUTER = """
import runpy
runpy.run_module("specfleet.router", run_name="__main__")
"""
# The gateway over the fake engine (`--gateway`): argv endpoint, host, port, and a tenants file or "".
GATEWAY_MAIN = """
import asyncio, logging, signal, sys
from specfleet.router.cli import event_loop_factory
from specfleet.router.endpoints import EndpointSet
from specfleet.router.gateway import Gateway, serve_gateway
from specfleet.router.policies import DEFAULT_POLICY, service_policy
from specfleet.router.prefix import BlockHasher
from specfleet.router.proxy import Router
endpoint, host, port, tenants = sys.argv[1:5]

async def main():
    gate = None
    if tenants:
        from specfleet.router.tenant_gate import TenantGate
        from specfleet.router.tenants import TenantTable, load_tenants_file
        gate = TenantGate(TenantTable(load_tenants_file(tenants)))
    gateway = Gateway(tenants=gate)
    policy = service_policy(DEFAULT_POLICY, True, 125)
    router = Router(EndpointSet([endpoint], ready=True), policy, BlockHasher(16), "x-session-id")
    gateway.upsert("bench/bench", ["bench"], 100, router)
    gateway.synced = True
    server = await serve_gateway(gateway, host, int(port))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.cleanup()

logging.basicConfig(level="INFO")
with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
    runner.run(main())
"""
# The tenant of `--gateway tenants`: limits far above what a run sends, so that every request is admitted
BENCH_KEY = "bench-key-0123456789abcdef"
BENCH_TENANTS = {
    "tenants": [{"name": "bench", "keys": [BENCH_KEY], "models": ["bench"], "rpm": 10**9, "tpm": 10**12}]
}
WARMUP_PER_CONNECTION = 20  # requests on each connection before the measured load: pools, caches, JIT-free
TOP_FUNCTIONS = 25


def user_system_seconds(pid: int) -> tuple[float, float]:
    """A process's user and system CPU seconds so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


async def fixed_load(
    port: int, concurrency: int, requests: int, warm: Callable[[], None], api_key: str | None = None
) -> float:
    """`requests` requests over `concurrency` keep-alive connections (each its share, one after the
    other); the seconds the measured part took, after a warm-up on each connection and then `warm()`."""
    request = completion_request(HOST, port, PROMPT, api_key)
    conns = [Connection(HOST, port, request) for _ in range(concurrency)]
    share = [requests // concurrency + (1 if i < requests % concurrency else 0) for i in range(concurrency)]

    async def run(conn: Connection, count: int) -> None:
        for _ in range(count):
            await conn.request()

    try:
        await asyncio.gather(*(run(c, WARMUP_PER_CONNECTION) for c in conns))
        warm()
        start = time.perf_counter()
        await asyncio.gather(*(run(c, n) for c, n in zip(conns, share, strict=True)))
        return time.perf_counter() - start
    finally:
        for conn in conns:
            conn.close()


def start_router(proxies: Proxies, upstream_port: int, stats: Path | None, gateway: str = "none") -> Target:
    """The router alone (no nginx), profiled when `stats` names where its cProfile stats go; with `gateway`
    open or tenants, the gateway over one service instead."""
    port = free_port()
    if gateway != "none":
        return start_gateway(proxies, upstream_port, port, stats, gateway == "tenants")
    launch = ["-m", "specfleet.router"] if stats is None else []
    if stats is not None:
        launch = ["-c", PROFILED + (ROUTER_FROM_SOURCE if proxies.router_src else THIS_ROUTER), str(stats)]
        if proxies.router_src:
            launch.append(proxies.router_src)
    elif proxies.router_src:
        launch = ["-c", ROUTER_FROM_SOURCE, proxies.router_src]
    argv = [*launch, "--endpoint", f"http://{HOST}:{upstream_port}", "--host", HOST, "--port", str(port)]
    argv += proxies.router_args
    proc = proxies._spawn("router", python_command(*argv))
    return Target("router", port, proc.pid)


def start_gateway(
    proxies: Proxies, upstream_port: int, port: int, stats: Path | None, tenants: bool
) -> Target:
    """GATEWAY_MAIN in a child, from `--router-src` when given, profiled when `stats` is given."""
    code, argv = GATEWAY_MAIN, []
    if proxies.router_src:
        code, argv = LOAD_ROUTER_SOURCE + code, [proxies.router_src]
    if stats is not None:
        code, argv = PROFILED + code, [str(stats), *argv]
    tenants_file = ""
    if tenants:
        path = proxies.tmp / "tenants.json"
        path.write_text(json.dumps(BENCH_TENANTS))
        tenants_file = str(path)
    argv += [f"http://{HOST}:{upstream_port}", HOST, str(port), tenants_file]
    proc = proxies._spawn("router", python_command("-c", code, *argv))
    return Target("router", port, proc.pid)


def router_folder(router_src: str | None) -> str:
    """The folder of the router being profiled: `--router-src`'s, or the installed package's."""
    if router_src:
        return str(Path(router_src).resolve())
    spec = importlib.util.find_spec("specfleet.router")
    assert spec is not None and spec.origin is not None
    return str(Path(spec.origin).resolve().parent)


def package(filename: str, function: str, router_dir: str) -> str:
    """Where a profiled function belongs: `router/<module>` for the router's own code, else its package
    (C functions by their type's module)."""
    if filename == "~":
        for name in ("uvloop", "httptools", "multidict", "yarl", "aiohttp", "json", "_io"):
            if name in function:
                return f"{name} (C)"
        return "builtins (C)"
    path = filename.replace("\\", "/")
    if path.startswith(router_dir.rstrip("/") + "/"):
        return f"router/{path[len(router_dir.rstrip('/')) + 1 :]}"
    if "/site-packages/" in path:
        return path.split("/site-packages/", 1)[1].split("/", 1)[0].removesuffix(".py")
    if "/lib/python3" in path:
        rest = path.split("/lib/python3", 1)[1].split("/", 2)
        return rest[1].removesuffix(".py") if len(rest) > 1 else "stdlib"
    return Path(path).name


def summarize_profile(stats_file: Path, requests: int, router_src: str | None) -> dict[str, Any]:
    stats = pstats.Stats(str(stats_file))
    router_dir = router_folder(router_src)
    by_package: dict[str, float] = {}
    rows = []
    total = 0.0
    for (filename, line, function), (_, calls, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        total += own
        group = package(filename, function, router_dir)
        by_package[group] = by_package.get(group, 0.0) + own
        where = function if filename == "~" else f"{Path(filename).name}:{line}({function})"
        rows.append((own, calls, where, group))
    rows.sort(reverse=True)
    per = 1e6 / requests
    return {
        "profiled_us_per_request": round(total * per, 1),
        "by_package_us_per_request": {
            k: round(v * per, 1) for k, v in sorted(by_package.items(), key=lambda kv: -kv[1])
        },
        "top_functions": [
            {
                "function": where,
                "package": group,
                "us_per_request": round(own * per, 2),
                "calls_per_request": round(calls / requests, 2),
            }
            for own, calls, where, group in rows[:TOP_FUNCTIONS]
        ],
    }


async def profile(args: argparse.Namespace) -> dict[str, Any]:
    def say(line: str) -> None:
        print(line, flush=True)

    proxy_core, placement = pin_cores()
    say(f"[bench router-profile] {placement}")
    upstream, upstream_port = await start_upstream(HOST)
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-profile-"))
    out: dict[str, Any] = {"placement": placement, "concurrency": args.concurrency, "requests": args.requests}
    out["router_src"] = args.router_src or "installed"
    out["max_resumes"] = args.max_resumes
    out["gateway"] = args.gateway
    try:
        for mode in ("plain", "profiled"):
            stats = tmp / "router.prof" if mode == "profiled" else None
            proxies = Proxies(tmp, upstream_port, proxy_core, args.router_src, router_args(args.max_resumes))
            try:
                target = start_router(proxies, upstream_port, stats, args.gateway)
                await wait_ready(target, proxies)
                pid = target.pid
                assert pid is not None
                cpu = [(0.0, 0.0)]

                def warm(
                    pid: int = pid, profiled: bool = stats is not None, cpu: list[tuple[float, float]] = cpu
                ) -> None:
                    if profiled:
                        os.kill(pid, signal.SIGUSR1)
                    cpu[0] = user_system_seconds(pid)

                key = BENCH_KEY if args.gateway == "tenants" else None
                seconds = await fixed_load(target.port, args.concurrency, args.requests, warm, key)
                user, system = (
                    after - before for after, before in zip(user_system_seconds(pid), cpu[0], strict=True)
                )
                used = user + system
                if stats is not None:
                    os.kill(pid, signal.SIGUSR2)
                    await wait_for_file(stats)
            finally:
                proxies.stop()
            row = {
                "rps": round(args.requests / seconds, 1),
                "cpu_us_per_request": round(1e6 * used / args.requests, 1),
                "user_us_per_request": round(
                    1e6 * user / args.requests, 1
                ),  # the router's own code, in C too
                "system_us_per_request": round(
                    1e6 * system / args.requests, 1
                ),  # the kernel: its socket calls
            }
            if stats is not None:
                row.update(summarize_profile(stats, args.requests, args.router_src))
            out[mode] = row
            say(
                f"[bench router-profile] {mode}: rps {row['rps']}, router CPU {row['cpu_us_per_request']} us/request"
            )
    finally:
        upstream.close()
        shutil.rmtree(tmp, ignore_errors=True)
    for name, us in out["profiled"]["by_package_us_per_request"].items():
        say(f"  {name:<28} {us:8.1f} us/request (profiled)")
    for row in out["profiled"]["top_functions"]:
        say(f"  {row['us_per_request']:7.2f} us {row['calls_per_request']:6.2f} calls  {row['function']}")
    return out


async def wait_for_file(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router wrote no profile to {path} within {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specfleet bench router-profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=8, help="keep-alive connections, each a closed loop")
    # 5000 requests: 2-4 s of the router's CPU on the shared VM, far above the profile's start and stop
    p.add_argument("--requests", type=int, default=5000, help="measured requests (after a warm-up)")
    p.add_argument(
        "--router-src",
        default=None,
        metavar="DIR",
        help="profile the router from this router/ folder (`git archive REV router | tar -x -C DIR/..`)",
    )
    add_max_resumes(p)
    p.add_argument(
        "--gateway",
        choices=["none", "open", "tenants"],
        default="none",
        help="measure the gateway over one service instead of the router: open, or with the tenant gate",
    )
    p.add_argument("--out", default="bench-router-profile.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("concurrency", "requests"):
        if getattr(args, name) < 1:
            print(
                f"specfleet bench router-profile: --{name}={getattr(args, name)} must be >= 1",
                file=sys.stderr,
            )
            return 2
    if args.max_resumes is not None and args.max_resumes < 0:
        print(
            f"specfleet bench router-profile: --max-resumes={args.max_resumes} must be >= 0", file=sys.stderr
        )
        return 2
    if args.router_src and not (Path(args.router_src) / "cli.py").is_file():
        print(
            f"specfleet bench router-profile: --router-src={args.router_src} holds no router", file=sys.stderr
        )
        return 2
    use_uvloop()  # the load generator and the fake engine as cheap as they can be
    result = stoppable.run(profile(args))
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    summary = {
        "router_src": result["router_src"],
        "max_resumes": result["max_resumes"],
        "gateway": result["gateway"],
        "concurrency": result["concurrency"],
        "requests": result["requests"],
        "cpu_us_per_request": result["plain"]["cpu_us_per_request"],
        "user_us_per_request": result["plain"]["user_us_per_request"],
        "system_us_per_request": result["plain"]["system_us_per_request"],
        "rps": result["plain"]["rps"],
        "profiled_us_per_request": result["profiled"]["profiled_us_per_request"],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
