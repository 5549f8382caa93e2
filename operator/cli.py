"""`specfleet operator`: run the kopf operator (namespace or cluster scope, liveness endpoint)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import logging

OPERATOR_MODULES = ("specfleet.operator.handlers",)
# Loaded when present, so that the tuner can add its per-service loops without touching this file.
OPTIONAL_MODULES = ("specfleet.tuner.handlers",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specfleet operator",
        description="Reconcile InferenceService resources into engine Deployments, Services and PDBs.",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace (repeatable; glob patterns such as 'team-*' work)",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    parser.add_argument(
        "--liveness-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve kopf's health check at http://0.0.0.0:PORT/healthz",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the operator's Prometheus metrics at http://0.0.0.0:PORT/metrics "
        "(InferenceService conditions and generations, tuner state; docs/sre.md)",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="do not coordinate with other operator instances (no kopf peering objects)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    return parser


def load_handlers() -> list[str]:
    loaded = []
    for name in OPERATOR_MODULES:
        importlib.import_module(name)
        loaded.append(name)
    for name in OPTIONAL_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError as exc:
            # Absent only when its own package is; a dependency missing from the image is an error, not a
            # reason to run without the tuner.
            if not (exc.name and (name == exc.name or name.startswith(exc.name + "."))):
                raise
            found = False
        if found:
            importlib.import_module(name)
            loaded.append(name)
    return loaded


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not args.namespace and not args.all_namespaces:
        print("specfleet operator: choose a scope: --namespace NS (repeatable) or --all-namespaces")
        return 2
    for flag, port in (("--liveness-port", args.liveness_port), ("--metrics-port", args.metrics_port)):
        if port is not None and not 0 < port < 65536:
            print(f"specfleet operator: {flag} {port} is not a TCP port (1-65535)")
            return 2
    if args.metrics_port is not None and args.metrics_port == args.liveness_port:
        print(
            f"specfleet operator: --metrics-port and --liveness-port are both {args.metrics_port}; use two ports"
        )
        return 2
    import kopf  # imported here so that `specfleet --help` stays fast

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    kopf.configure(verbose=args.verbose)
    loaded = load_handlers()
    logging.getLogger("specfleet.operator").info(
        "handlers=%s scope=%s",
        ",".join(loaded),
        "cluster" if args.all_namespaces else ",".join(args.namespace),
    )
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    if args.metrics_port is not None:
        from . import metrics

        metrics.serve(args.metrics_port)
    try:
        asyncio.run(
            kopf.operator(
                standalone=args.standalone,
                clusterwide=args.all_namespaces,
                namespaces=args.namespace,
                liveness_endpoint=liveness,
            )
        )
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
