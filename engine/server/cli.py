"""`specfleet serve` / `python -m specfleet.engine`: load the engine, serve it over HTTP, drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from types import FrameType
from typing import Any

import uvicorn

from .admin import token_from_env
from .app import build_state, create_app
from .state import ServerState

logger = logging.getLogger("specfleet.engine.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specfleet serve", description="Serve one model with the specfleet "
                                "engine: OpenAI-compatible API, Prometheus /metrics, admin API.")
    p.add_argument("--model", default="bundled://smollm2-135m-instruct", help="model source URI")
    p.add_argument("--served-model-name", default=None, help="name in the API (default: the model's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=None, help="CPU: KV cache size in GiB")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=0.9, help="CUDA: memory fraction")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs-limit", type=int, default=None, help="ceiling for the live max_num_seqs")
    p.add_argument("--max-num-batched-tokens-limit", type=int, default=None,
                   help="ceiling for the live max_num_batched_tokens")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "native", "triton"])
    p.add_argument("--speculative-method", default="none", choices=["none", "ngram", "draft"])
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="k (default: 4 with a speculative method, else 0)")
    p.add_argument("--max-num-speculative-tokens", type=int, default=8, help="ceiling for the live k")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=0,
                   help="propose nothing in a step whose batch is larger than this (0: never)")
    p.add_argument("--draft-model", default=None, help="draft model source URI (--speculative-method draft)")
    p.add_argument("--quantization", default=None, choices=["int8"], help="weight-only int8 (native CPU kernels)")
    p.add_argument("--draft-quantization", default=None, choices=["int8"],
                   help="quantize the draft's weights to int8: with --draft-model set to the target itself, "
                        "a cheap proposer that agrees with it on most tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per engine (only 1 for now)")
    p.add_argument("--max-waiting", type=int, default=512,
                   help="requests waiting for their first token beyond which new ones get 429")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    k = args.num_speculative_tokens
    if k is None:
        k = 4 if args.speculative_method != "none" else 0
    return {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "kv_cache_gib": args.kv_cache_gib,
        "kv_cache_memory_fraction": args.kv_cache_memory_fraction,
        "enable_prefix_caching": not args.no_prefix_caching,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs_limit": args.max_num_seqs_limit,
        "max_num_batched_tokens_limit": args.max_num_batched_tokens_limit,
        "attention_backend": args.attention_backend,
        "speculative_method": args.speculative_method,
        "num_speculative_tokens": k,
        "max_num_speculative_tokens": args.max_num_speculative_tokens,
        "speculative_disable_by_batch_size": args.speculative_disable_by_batch_size,
        "draft_model": args.draft_model,
        "quantization": args.quantization,
        "draft_quantization": args.draft_quantization,
        "seed": args.seed,
        "tensor_parallel_size": args.tensor_parallel_size,
    }


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM drains: /ready false, new requests 503, in-flight ones finish, then exit 0.

    The listener stays open during the drain (so late clients get a 503, not a refused connection);
    a second signal exits at once.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining or self._loop is None:
            logger.warning("event=forced_exit signal=%s", signal.Signals(sig).name)
            self.should_exit = True
            self.force_exit = True
            return
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._begin_drain, sig)

    def _begin_drain(self, sig: int) -> None:
        self._drain_task = asyncio.ensure_future(self.drain(signal.Signals(sig).name))

    async def drain(self, reason: str = "SIGTERM") -> None:
        engine = self.state.async_engine
        self.state.draining = True
        logger.info("event=drain_start signal=%s in_flight=%d timeout_s=%.1f", reason, engine.num_in_flight,
                    self.drain_timeout)
        deadline = time.monotonic() + self.drain_timeout
        while engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            logger.warning("event=drain_timeout aborted=%d", engine.num_in_flight)
            engine.abort_all()
            await asyncio.sleep(0.5)
        await asyncio.sleep(0.2)  # let the last response bytes leave
        logger.info("event=drain_done")
        self.should_exit = True


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level)
    from specfleet.engine import Engine, EngineConfig

    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stopped while loading: exit 0
    try:
        try:
            config = EngineConfig(**engine_config_kwargs(args))
            admin_token = token_from_env()  # a bad token file fails now, not after minutes of loading
        except ValueError as exc:
            print(f"specfleet serve: {exc}", file=sys.stderr)
            return 2
        started = time.monotonic()
        engine = Engine(config)
    finally:
        signal.signal(signal.SIGTERM, previous)
    logger.info("event=model_loaded model=%s load_s=%.1f", engine.model_name, time.monotonic() - started)
    state = build_state(engine, served_model_name=args.served_model_name, max_waiting=args.max_waiting,
                        admin_token=admin_token)
    app = create_app(state)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                               timeout_graceful_shutdown=5, lifespan="on")
    server = DrainingServer(uv_config, state, args.drain_timeout)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    raise SystemExit(main())
