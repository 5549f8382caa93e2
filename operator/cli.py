"""`specfleet operator`: run the kopf operator (namespace or cluster scope, liveness endpoint)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import logging
from typing import Any

from .leadership import LeaseElector, LeaseTimings, default_identity, namespace_from_env, run_elected

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
    election = parser.add_argument_group(
        "leader election", "several replicas, one of them active: the holder of a coordination.k8s.io Lease"
    )
    election.add_argument(
        "--leader-elect",
        action="store_true",
        help="run handlers only while holding the Lease; the other replicas wait as standbys",
    )
    election.add_argument(
        "--leader-election-namespace",
        default=None,
        metavar="NS",
        help="namespace of the Lease (default: $POD_NAMESPACE, the operator's own namespace)",
    )
    election.add_argument(
        "--leader-election-id",
        default="specfleet-operator",
        metavar="NAME",
        help="name of the Lease; one per operator installation (default: %(default)s)",
    )
    timings = LeaseTimings()
    election.add_argument(
        "--leader-election-lease-duration",
        type=float,
        default=timings.lease_duration_s,
        metavar="S",
        help="a standby takes over a holder that has not renewed for this long (default: %(default)s)",
    )
    election.add_argument(
        "--leader-election-renew-deadline",
        type=float,
        default=timings.renew_deadline_s,
        metavar="S",
        help="the holder stops its handlers and exits when it could not renew for this long "
        "(default: %(default)s)",
    )
    election.add_argument(
        "--leader-election-retry-period",
        type=float,
        default=timings.retry_period_s,
        metavar="S",
        help="how often the holder renews and a standby looks (default: %(default)s)",
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
    try:
        timings = LeaseTimings(
            args.leader_election_lease_duration,
            args.leader_election_renew_deadline,
            args.leader_election_retry_period,
        )
    except ValueError as error:
        print(f"specfleet operator: {error}")
        return 2
    lease_namespace = args.leader_election_namespace or namespace_from_env()
    if args.leader_elect and not lease_namespace:
        print(
            "specfleet operator: --leader-elect needs the Lease's namespace: "
            "--leader-election-namespace NS or $POD_NAMESPACE"
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

    async def operate() -> None:
        await kopf.operator(
            standalone=args.standalone,
            clusterwide=args.all_namespaces,
            namespaces=args.namespace,
            liveness_endpoint=liveness,
        )

    try:
        if not args.leader_elect:
            asyncio.run(operate())
            return 0

        def connect() -> Any:
            """The operator's login (handlers.login): the in-cluster service account, else the kubeconfig."""
            settings = kopf.OperatorSettings()
            return kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
                settings=settings
            )

        assert lease_namespace is not None
        elector = LeaseElector(connect, lease_namespace, args.leader_election_id, default_identity(), timings)
        return asyncio.run(run_elected(elector, operate, args.liveness_port))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
