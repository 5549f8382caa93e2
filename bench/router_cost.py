"""`specfleet bench router`: the router's own cost per streamed request, against nginx, in one run.

A fake engine on loopback (bench/proxy_load.py) streams 64 SSE chunks as fast as it can. The same load goes
to it direct (the zero baseline), through Debian's nginx as a reverse proxy (one worker, `proxy_buffering
off`, HTTP/1.1 keep-alive to the upstream, an access log line per request as the router logs one) and
through `specfleet router --endpoint` (its default policy and log level: a line for one ok request in 100,
router/proxy.py). Both proxies run on one core and the
load generator with the fake engine on another, so "one core" is literal.

- Added latency: requests one at a time on a keep-alive connection, the targets interleaved in rounds;
  p50/p99 of each, minus the direct p50/p99.
- Request rate: closed loop at rising concurrency, each level for `--seconds` per target (interleaved);
  the highest completed requests per second of each target. `cpu_us_per_request` is the proxy process's
  own CPU time (user + system, its workers included) per request at that level: a figure that moves less
  than the rates when other work shares the host.

Writes JSON and a PNG next to it; the last stdout line is the JSON summary, with
`added_p50_ratio_vs_nginx` (goal <= 2) and `request_rate_ratio_vs_nginx` (goal >= 0.5).
`specfleet bench router-profile` (bench/router_profile.py) says where the router's CPU goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specfleet.bench import stoppable
from specfleet.bench.proxy_load import (
    CHUNKS,
    Connection,
    closed_loop,
    completion_request,
    sequential,
    start_upstream,
)
from specfleet.engine.python_child import python_command

HOST = "127.0.0.1"
TARGETS = ("direct", "nginx", "router")
ADDED_P50_GOAL = 2.0  # issue 39: the router's added p50 within 2x nginx's
RATE_GOAL = 0.5  # and at least half of nginx's request rate
# The prompt the load sends: a few hundred characters, so the router's prefix hashing does the work of a
# short chat turn (its blocks are block-size x 4 characters without a tokenizer).
PROMPT = "You are a helpful assistant. Answer briefly and cite the handbook. " * 6
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# `--router-src DIR`: `specfleet router` with the package specfleet.router loaded from DIR (another
# checkout's router/ folder, e.g. from `git archive REV router`), so one run compares two versions.
# `specfleet.router` from the folder the first argument names (`--router-src`), instead of the installed one
LOAD_ROUTER_SOURCE = """
import importlib.util, sys
folder = sys.argv.pop(1)
spec = importlib.util.spec_from_file_location(
    "specfleet.router", folder + "/__init__.py", submodule_search_locations=[folder]
)
module = importlib.util.module_from_spec(spec)
sys.modules["specfleet.router"] = module
spec.loader.exec_module(module)
"""
ROUTER_FROM_SOURCE = (
    LOAD_ROUTER_SOURCE
    + """
from specfleet.router.cli import main
sys.exit(main(sys.argv[1:]))
"""
)


def nginx_config(tmp: Path, port: int, upstream_port: int) -> str:
    """A reverse proxy with the router's buffering: the request body read whole before it is sent (the
    router reads it to route), the response streamed as it arrives, keep-alive to the upstream; no limit on
    requests per keep-alive connection (the router has none); an access log line per request."""
    return f"""daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    keepalive_requests 1000000;
    upstream engine {{
        server {HOST}:{upstream_port};
        keepalive 512;
        keepalive_requests 1000000;
    }}
    server {{
        listen {HOST}:{port};
        client_max_body_size 64m;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering on;
        }}
    }}
}}
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children now running (nginx's worker)."""
    total = 0.0
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    pids += [int(c) for c in children]
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (stat fields 14, 15)
    return total


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Target:
    name: str
    port: int
    pid: int | None = None  # the proxy's process (None: direct)


class Proxies:
    """nginx and the router as child processes pinned to `core`, stopped on exit."""

    def __init__(
        self,
        tmp: Path,
        upstream_port: int,
        core: int | None,
        router_src: str | None = None,
        router_args: list[str] | None = None,
    ) -> None:
        self.tmp, self.upstream_port, self.core = tmp, upstream_port, core
        self.router_src = router_src
        self.router_args = router_args or []  # more `specfleet router` flags (--max-resumes)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        core = self.core
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=(self.tmp / f"{name}.log").open("wb"),
            preexec_fn=(lambda: os.sched_setaffinity(0, {core})) if core is not None else None,
        )  # the niceness (--nice) is inherited
        self.procs[name] = proc
        return proc

    def start(self, nginx: str) -> list[Target]:
        nginx_port, router_port = free_port(), free_port()
        conf = self.tmp / "nginx.conf"
        conf.write_text(nginx_config(self.tmp, nginx_port, self.upstream_port))
        nginx_proc = self._spawn(
            "nginx", [nginx, "-p", str(self.tmp), "-e", str(self.tmp / "error.log"), "-c", str(conf)]
        )
        launch = (
            ["-c", ROUTER_FROM_SOURCE, self.router_src] if self.router_src else ["-m", "specfleet.router"]
        )
        router_proc = self._spawn(
            "router",
            python_command(
                *launch,
                "--endpoint",
                f"http://{HOST}:{self.upstream_port}",
                "--host",
                HOST,
                "--port",
                str(router_port),
                *self.router_args,
            ),
        )
        return [Target("nginx", nginx_port, nginx_proc.pid), Target("router", router_port, router_proc.pid)]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def wait_ready(target: Target, proxies: Proxies, timeout_s: float = 60.0) -> None:
    """Until `GET /ready` through the target answers 200 (the router: once its probe saw the engine)."""
    deadline = time.monotonic() + timeout_s
    probe = f"GET /ready HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode()
    while True:
        for name, proc in proxies.procs.items():
            if proc.poll() is not None:
                log = (proxies.tmp / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}: {log}")
        try:
            reader, writer = await asyncio.open_connection(HOST, target.port)
            writer.write(probe)
            status = await reader.readline()
            writer.close()
            if status.startswith(b"HTTP/1.1 200"):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{target.name} on port {target.port} not ready after {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


async def latencies(targets: list[Target], requests: int, rounds: int) -> dict[str, list[float]]:
    """`requests` sequential requests per target, in `rounds` interleaved slices (after a warm-up)."""
    conns = {t.name: Connection(HOST, t.port, completion_request(HOST, t.port, PROMPT)) for t in targets}
    out: dict[str, list[float]] = {t.name: [] for t in targets}
    try:
        for conn in conns.values():
            await sequential(conn, max(5, requests // 10))  # warm-up: connections, caches, upstream pools
        per_round = max(1, requests // rounds)
        for _ in range(rounds):
            for t in targets:
                out[t.name] += await sequential(conns[t.name], per_round)
    finally:
        for conn in conns.values():
            conn.close()
    return out


async def rates(
    targets: list[Target], ladder: list[int], seconds: float, say: Any
) -> dict[str, list[dict[str, float]]]:
    """At each concurrency of the ladder, each target in turn: requests/s and the proxy's CPU per request."""
    out: dict[str, list[dict[str, float]]] = {t.name: [] for t in targets}
    for concurrency in ladder:
        for t in targets:
            request = completion_request(HOST, t.port, PROMPT)
            cpu = cpu_seconds(t.pid) if t.pid else 0.0
            start = time.perf_counter()
            rate = await closed_loop(HOST, t.port, request, concurrency, seconds)
            served = rate * (time.perf_counter() - start)  # approximate: includes the warm-up requests
            used = (cpu_seconds(t.pid) - cpu) if t.pid else 0.0
            row = {"concurrency": concurrency, "rps": round(rate, 1)}
            if t.pid:
                row["cpu_us_per_request"] = round(1e6 * used / max(served, 1.0), 1)
            out[t.name].append(row)
            say(f"[bench router] c={concurrency} {t.name}: {json.dumps(row)}")
    return out


def summarize(lat: dict[str, list[float]], rate_rows: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    ms = {
        name: {"p50_ms": 1000 * percentile(v, 0.5), "p99_ms": 1000 * percentile(v, 0.99)}
        for name, v in lat.items()
    }
    out: dict[str, Any] = {}
    for name in TARGETS:
        best = max(rate_rows[name], key=lambda r: r["rps"])
        entry: dict[str, Any] = {
            "latency_p50_ms": round(ms[name]["p50_ms"], 3),
            "latency_p99_ms": round(ms[name]["p99_ms"], 3),
            "max_rps": best["rps"],
            "max_rps_concurrency": best["concurrency"],
        }
        if name != "direct":
            entry["added_p50_ms"] = round(ms[name]["p50_ms"] - ms["direct"]["p50_ms"], 3)
            entry["added_p99_ms"] = round(ms[name]["p99_ms"] - ms["direct"]["p99_ms"], 3)
            entry["cpu_us_per_request"] = best.get("cpu_us_per_request")
        out[name] = entry
    nginx, router = out["nginx"], out["router"]
    out["added_p50_ratio_vs_nginx"] = round(router["added_p50_ms"] / max(nginx["added_p50_ms"], 1e-3), 3)
    out["request_rate_ratio_vs_nginx"] = round(router["max_rps"] / max(nginx["max_rps"], 1e-9), 3)
    # CPU per request at each proxy's best rate: what the rate ratio tends to on a core with nothing else
    # on it, where both proxies are CPU-bound (on a shared host the rates also measure the scheduler)
    out["cpu_per_request_ratio_vs_nginx"] = round(
        (router["cpu_us_per_request"] or 0.0) / max(nginx["cpu_us_per_request"] or 0.0, 1e-3), 3
    )
    out["goals_met"] = (
        out["added_p50_ratio_vs_nginx"] <= ADDED_P50_GOAL and out["request_rate_ratio_vs_nginx"] >= RATE_GOAL
    )
    # nginx within 10% of the direct rate: the load generator, not nginx, was the limit, and the rate ratio
    # flatters the router (it is then router / load generator, an upper bound on router / nginx)
    out["nginx_rate_capped_by_load_generator"] = nginx["max_rps"] >= 0.9 * out["direct"]["max_rps"]
    return out


def pin_cores() -> tuple[int | None, str]:
    """This process (load generator + upstream) on one core, the proxies on another, when there are two."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, f"one core ({cores[0]}): proxies, load generator and upstream share it"
    os.sched_setaffinity(0, {cores[1]})
    return cores[0], f"proxies on core {cores[0]}, load generator and upstream on core {cores[1]}"


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    def say(line: str) -> None:
        print(line, flush=True)

    if args.nice:
        os.nice(args.nice)  # before the proxies start: they inherit it, the three ends alike
    proxy_core, placement = pin_cores()
    say(f"[bench router] {placement}")
    upstream, upstream_port = await start_upstream(HOST)
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    proxies = Proxies(tmp, upstream_port, proxy_core, args.router_src, router_args(args.max_resumes))
    try:
        targets = [Target("direct", upstream_port), *proxies.start(args.nginx)]
        for t in targets[1:]:
            await wait_ready(t, proxies)
        say(f"[bench router] latency: {args.requests} requests each at concurrency 1, {args.rounds} rounds")
        lat = await latencies(targets, args.requests, args.rounds)
        say(f"[bench router] rate: concurrency {args.ladder}, {args.seconds} s each")
        rate_rows = await rates(targets, args.ladder, args.seconds, say)
    finally:
        proxies.stop()
        upstream.close()
        shutil.rmtree(tmp, ignore_errors=True)
    out = summarize(lat, rate_rows)
    out["rates"] = rate_rows
    out["placement"] = placement
    out["workload"] = {
        "chunks": CHUNKS,
        "requests": args.requests,
        "rounds": args.rounds,
        "ladder": args.ladder,
        "seconds": args.seconds,
        "loop": type(asyncio.get_running_loop()).__module__,
        "router_src": args.router_src or "installed",
        "max_resumes": args.max_resumes,
        "nice": args.nice,
    }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, name in enumerate(TARGETS):
        rows = result["rates"][name]
        left.plot([r["concurrency"] for r in rows], [r["rps"] for r in rows], "o-", color=f"C{i}", label=name)
    left.set_xscale("log", base=2)
    left.set_xlabel("concurrency (closed loop)")
    left.set_ylabel("streamed requests / s")
    left.legend()
    names = ["nginx", "router"]
    right.bar(names, [result[n]["added_p50_ms"] for n in names], color=["C1", "C2"], label="p50")
    right.set_ylabel("added latency p50 (ms)")
    right.set_title(
        f"added p50 ratio {result['added_p50_ratio_vs_nginx']}, rate ratio {result['request_rate_ratio_vs_nginx']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def positive_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--ladder={text!r}: comma-separated concurrencies, each >= 1")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specfleet bench router", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="sequential requests per target for latency")
    p.add_argument("--rounds", type=int, default=10, help="interleaved slices of those requests")
    p.add_argument(
        "--ladder",
        type=positive_ints,
        default=[1, 4, 16, 64],
        help="closed-loop concurrencies for the request rate (comma-separated)",
    )
    p.add_argument("--seconds", type=float, default=3.0, help="per target and concurrency")
    p.add_argument("--nginx", default="/usr/sbin/nginx", help="the nginx binary")
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="niceness for the proxies, the load generator and the fake engine alike (negative needs root): "
        "on a host shared with other work, e.g. -10 keeps that work from sitting between them and the core",
    )
    p.add_argument(
        "--router-src",
        default=None,
        metavar="DIR",
        help="run the router from this router/ folder (another version: `git archive REV router | tar -x "
        "-C DIR/..`) instead of the installed one",
    )
    add_max_resumes(p)
    p.add_argument("--out", default="bench-router.json")
    return p


def add_max_resumes(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-resumes",
        type=int,
        default=None,
        help="the router's --max-resumes (default: its own, 2). The bench's streams can be resumed, so the "
        "router relays their events (router/resume.py); with 0 it passes the engine's bytes through as they "
        "came (router/proxy.py), as nginx does",
    )


def router_args(max_resumes: int | None) -> list[str]:
    """The `specfleet router` flags a run asks for beyond the endpoint and the port."""
    return [] if max_resumes is None else ["--max-resumes", str(max_resumes)]


def use_uvloop() -> None:
    """uvloop for this process's loop when installed (the router's, too: router/cli.py)."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("requests", "rounds"):
        if getattr(args, name) < 1:
            print(f"specfleet bench router: --{name}={getattr(args, name)} must be >= 1", file=sys.stderr)
            return 2
    if args.seconds <= 0:
        print(f"specfleet bench router: --seconds={args.seconds} must be > 0", file=sys.stderr)
        return 2
    if args.max_resumes is not None and args.max_resumes < 0:
        print(f"specfleet bench router: --max-resumes={args.max_resumes} must be >= 0", file=sys.stderr)
        return 2
    if args.router_src and not (Path(args.router_src) / "cli.py").is_file():
        print(
            f"specfleet bench router: --router-src={args.router_src} holds no router (no cli.py)",
            file=sys.stderr,
        )
        return 2
    if shutil.which(args.nginx) is None:
        print(
            f"specfleet bench router: no nginx at {args.nginx} (Debian: apt-get install nginx)",
            file=sys.stderr,
        )
        return 2
    use_uvloop()  # the load generator and the fake engine as cheap as they can be
    result = stoppable.run(bench(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "rates"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
