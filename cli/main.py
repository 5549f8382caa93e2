"""The `specfleet` command: one entry point, each subcommand owned by the part that implements it."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, function taking argv, one-line help)
COMMANDS = {
    "serve": ("specfleet.engine.server.cli", "main", "run one engine with the OpenAI-compatible API"),
    "generate": ("specfleet.cli.main", "generate_main", "generate from prompts offline and print the text"),
    "up": ("specfleet.fleet.local", "main", "run an InferenceService YAML as a local fleet"),
    "router": ("specfleet.router.cli", "main", "run the fleet router in front of engines (prefix-aware)"),
    "operator": ("specfleet.operator.cli", "main", "run the Kubernetes operator (kopf)"),
    "simulate": ("specfleet.sim.cli", "main", "simulate an InferenceService's fleet on a workload"),
    "profile": ("specfleet.sim.measure", "main", "measure the engine's step time into a simulator profile"),
    "plan": ("specfleet.sim.plan", "main", "the cheapest fleet config meeting an SLO, by simulation"),
}
BENCHES = {
    "offline": ("specfleet.bench.offline", "engine vs transformers throughput, single stream, KV waste"),
    "serve": ("specfleet.bench.serve", "latency and goodput of any OpenAI-compatible server"),
    "spec": ("specfleet.bench.spec", "speculative decoding speedup by method, k and load"),
    "pd": ("specfleet.bench.pd", "prefill/decode disaggregation against aggregated engines at equal cores"),
    "pp": (
        "specfleet.bench.pipeline",
        "pipeline parallelism: decode throughput with and without micro-batch overlap",
    ),
    "quant": ("specfleet.bench.quant", "quantized weights: perplexity, greedy agreement, c=1 decode TPOT"),
    "llamacpp": (
        "specfleet.bench.llamacpp",
        "llama.cpp's own server against specfleet's configs, same prompts",
    ),
    "route": (
        "specfleet.bench.route",
        "routing policies side by side on a shared-prefix multi-turn workload",
    ),
    "tune": ("specfleet.bench.tune", "the tuner against the best static config on a shifting load"),
    "autoscale": (
        "specfleet.bench.autoscale",
        "joint config + replica tuning against the best static, per replica-s",
    ),
    "sim": ("specfleet.bench.sim", "the simulator against real local fleets on the same workloads"),
    "router": ("specfleet.bench.router_cost", "the router's own cost per streamed request, against nginx"),
    "router-profile": (
        "specfleet.bench.router_profile",
        "where the router's CPU goes per streamed request: cProfile by package and function",
    ),
    "lora": ("specfleet.bench.lora", "many LoRA adapters in one batch vs the base and merged engines"),
    "gemma-kv": ("specfleet.bench.gemma_kv", "KV bytes per token of a Gemma 3 sequence at 8k vs all-global"),
    "architectures": (
        "specfleet.bench.architectures",
        "decode tok/s of every architecture against Llama's at one parameter count, alternated",
    ),
}
DRAFT = {"distill": ("specfleet.engine.spec_decode.distill", "distill a small draft model from the target")}


def _usage() -> str:
    lines = ["usage: specfleet <command> [args]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += [f"  bench {name:<8} {help_}" for name, (_, help_) in BENCHES.items()]
    lines += [f"  draft {name:<8} {help_}" for name, (_, help_) in DRAFT.items()]
    return "\n".join(lines)


def _call(module: str, function: str, argv: list[str]) -> int:
    return int(getattr(importlib.import_module(module), function)(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command in COMMANDS:
        module, function, _ = COMMANDS[command]
        return _call(module, function, rest)
    for group, table in (("bench", BENCHES), ("draft", DRAFT)):
        if command == group:
            if not rest or rest[0] not in table:
                print(f"specfleet {group}: choose one of {', '.join(table)}\n\n{_usage()}", file=sys.stderr)
                return 2
            return _call(table[rest[0]][0], "main", rest[1:])
    print(f"specfleet: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
    return 2


def generate_main(argv: list[str]) -> int:
    from specfleet.engine.args import add_engine_args, engine_config_kwargs

    parser = argparse.ArgumentParser(prog="specfleet generate", description="Generate text offline.")
    parser.add_argument("prompts", nargs="+", help="one or more prompts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--seed",
        dest="sampling_seed",
        metavar="SEED",
        type=int,
        default=None,
        help="every prompt's sampling seed",
    )
    parser.add_argument("--raw", action="store_true", help="plain completion instead of the chat template")
    # `specfleet serve`'s engine flags; `--seed` above is the requests' (the engine's own stays 0).
    add_engine_args(parser, exclude=("seed",))
    args = parser.parse_args(argv)

    from specfleet.engine import LLM, SamplingParams

    try:
        llm = LLM(**engine_config_kwargs(args))
        params = SamplingParams(
            temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed
        )
        if args.raw:
            results = llm.generate(args.prompts, params)
        else:
            results = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    except ValueError as exc:
        print(f"specfleet generate: {exc}", file=sys.stderr)
        return 2
    for prompt, result in zip(args.prompts, results):
        out = result.outputs[0]
        print(f"### {prompt}\n{out.text}\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
