"""`specfleet serve` / `python -m specfleet.engine`: load the engine, serve it over HTTP, drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import time
from types import FrameType
from typing import Any

import uvicorn
from specfleet.engine import tracing
from specfleet.engine.args import add_engine_args, engine_config_kwargs
from specfleet.engine.config import EngineConfig
from specfleet.engine.kv_transfer import prefill_signature

from . import remote_prefill
from .admin import live_config_from_file, token_from_env
from .app import build_state, create_app
from .chat import ChatOptions
from .lora_api import parse_lora_modules
from .pooler import PoolerConfig
from .state import ServerState

logger = logging.getLogger("specfleet.engine.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specfleet serve",
        description="Serve one model with the specfleet "
        "engine: OpenAI-compatible API, Prometheus /metrics, admin API.",
    )
    add_engine_args(p)
    p.add_argument("--served-model-name", default=None, help="name in the API (default: the model's)")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served from the start (with --enable-lora): name=path, or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; requests name one in `model`',
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--admin-port",
        type=int,
        default=None,
        help="serve the admin API (/admin/config) on this port only, apart from the OpenAI API "
        "(pods: 8001, which their Service does not expose); default: beside the API on --port",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=512,
        help="requests waiting for their first token beyond which new ones get 429",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may take to finish after SIGTERM",
    )
    p.add_argument(
        "--shutdown-delay",
        type=float,
        default=0.0,
        help="seconds after SIGTERM during which /ready already fails but new requests are still "
        "served (clients routed before the endpoint was removed), before they get 503",
    )
    p.add_argument(
        "--live-config-file",
        default=None,
        metavar="PATH",
        help="start on the live knobs in this JSON file (the body of PATCH /admin/config, checked as the "
        "admin API checks it), over their flags; a missing file leaves the flags' values (pods: the "
        "operator's NAME-tuned ConfigMap, the tuner's config in force)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        tracing.ENDPOINT_FLAG,
        default=None,
        metavar="URL",
        help="send each request's spans (queue, prefill, decode, KV transfer) to this OTLP/HTTP collector, "
        "e.g. http://otel-collector:4318 (/v1/traces is added to a bare address); default: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else no traces",
    )
    p.add_argument(
        "--pooler-config",
        "--override-pooler-config",
        default=None,
        help='/v1/embeddings\' pooling as vLLM spells it, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' '
        "(default: LAST, normalised, as vLLM's embed runner for decoder models)",
    )
    add_remote_prefill_args(p)
    add_chat_args(p)
    return p


def add_remote_prefill_args(p: argparse.ArgumentParser) -> None:
    """A decode engine behind a gateway's endpoint picker (docs/server.md, P/D under the endpoint picker)."""
    p.add_argument(
        remote_prefill.FLAG,
        nargs="*",
        default=None,
        metavar="CIDR",
        help="a decode engine (--kv-role decode) behind a gateway's endpoint picker: a request naming a prefill "
        f"engine in {remote_prefill.HEADER} (host:port) runs its prefill there, then decodes here; with CIDRs, "
        "only an IP address inside them is accepted; without the flag the header is ignored",
    )
    p.add_argument(
        prefill_signature.KEY_FILE_FLAG,
        default=None,
        metavar="PATH",
        help=f"a decode engine (--kv-role decode): accept {remote_prefill.HEADER} only with the endpoint "
        f"picker's {prefill_signature.HEADER} made with the key in this file (the picker's own "
        f"{prefill_signature.KEY_FILE_FLAG}); an unsigned or forged header is ignored and the request runs "
        f"aggregated. Implies {remote_prefill.FLAG}; with CIDRs there too, both must hold",
    )


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for chat templates, tool calling and reasoning (docs/server.md, Tools and Reasoning)."""
    from .reasoning import REASONING_PARSERS
    from .tool_parsers import TOOL_PARSERS

    p.add_argument(
        "--chat-template",
        default=None,
        metavar="PATH",
        help="a Jinja chat template file used instead of the model's (e.g. one that renders tools)",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="keyword arguments every chat template render gets, e.g. '{\"enable_thinking\": false}'; a "
        "request's chat_template_kwargs override them",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template (Jinja text) in chat and /tokenize requests; without it such a request "
        "is a 400, as in vLLM: a template is code the server runs on the client's behalf",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='answer tool_choice="auto" (the default when tools are given) by reading the model\'s tool '
        "calls with --tool-call-parser",
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='leave the tools out of the prompt when tool_choice is "none" (by default the template still gets them)',
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the format the model writes tool calls in (with --enable-auto-tool-choice)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split <think>...</think> output into message.reasoning_content; structured outputs and tool "
        "grammars then constrain only what follows the reasoning",
    )


def chat_options(args: argparse.Namespace) -> ChatOptions:
    return ChatOptions.from_flags(
        chat_template=args.chat_template,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        trust_request_chat_template=args.trust_request_chat_template,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM drains, in this order: /ready fails at once; new requests are still served for
    `shutdown_delay` seconds, then get 503; in-flight ones finish within `drain_timeout`; exit 0.

    The listener stays open during the drain (so late clients get a 503, not a refused connection);
    a second signal exits at once. A dead engine core ends the server too, with `core_dead` set, so
    that the process exits non-zero and the pod restarts.
    """

    def __init__(
        self, config: uvicorn.Config, state: ServerState, drain_timeout: float, shutdown_delay: float = 0.0
    ) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self.shutdown_delay = shutdown_delay
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.core_dead: str | None = None
        state.async_engine.on_dead.append(self._core_died)

    def _core_died(self, reason: str) -> None:
        self.core_dead = reason
        self.state.ready = False
        self.should_exit = True

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.stopping or self._loop is None:
            logger.warning("event=forced_exit signal=%s", signal.Signals(sig).name)
            self.should_exit = True
            self.force_exit = True
            return
        self.state.stopping = True  # /ready fails from now on
        self._loop.call_soon_threadsafe(self._begin_drain, sig)

    def _begin_drain(self, sig: int) -> None:
        self._drain_task = asyncio.ensure_future(self.drain(signal.Signals(sig).name))

    async def drain(self, reason: str = "SIGTERM") -> None:
        engine = self.state.async_engine
        self.state.stopping = True
        if self.shutdown_delay > 0:
            logger.info("event=shutdown_delay signal=%s seconds=%.1f", reason, self.shutdown_delay)
            await asyncio.sleep(self.shutdown_delay)
        self.state.draining = True  # new requests get 503 from now on
        logger.info(
            "event=drain_start signal=%s in_flight=%d timeout_s=%.1f",
            reason,
            engine.num_in_flight,
            self.drain_timeout,
        )
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


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )


def _app(state: ServerState, lora_modules: list[str]) -> Any:
    """The app, or None when a --lora-modules value is wrong (said on stderr)."""
    try:
        return create_app(state, parse_lora_modules(lora_modules, state.model_name))
    except ValueError as exc:
        print(f"specfleet serve: {exc}", file=sys.stderr)
        return None


def _remote_prefill(
    networks: list[str] | None, key_file: str | None, config: EngineConfig
) -> remote_prefill.RemotePrefill | None:
    """--accept-remote-prefill's and --remote-prefill-key-file's setting; a ValueError when it is not a
    decode engine's, a CIDR is bad or the key file is missing, empty or short (before the model loads)."""
    if networks is None and key_file is None:
        return None
    if config.kv_role != "decode":
        flag = remote_prefill.FLAG if networks is not None else prefill_signature.KEY_FILE_FLAG
        raise ValueError(
            f"{flag} needs --kv-role decode (the engine loads the prompt's KV from the prefill "
            f"engine), got --kv-role {config.kv_role}"
        )
    return remote_prefill.RemotePrefill(
        remote_prefill.parse_networks(networks or []),
        timeout_s=config.kv_transfer_timeout_s,
        key=None if key_file is None else prefill_signature.read_key(key_file),
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    if args.admin_port is not None and args.admin_port == args.port:
        print(f"specfleet serve: --admin-port {args.admin_port} must differ from --port", file=sys.stderr)
        return 2
    _configure_logging(args.log_level)
    from specfleet.engine.core.client import EngineCoreClient

    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stopped while loading: exit 0
    try:
        try:
            config = EngineConfig(**engine_config_kwargs(args))
            if args.live_config_file:  # before the model loads: a bad value fails the start at once
                config = live_config_from_file(config, args.live_config_file)
            admin_token = token_from_env()  # a bad token file fails now, not after minutes of loading
            chat = chat_options(args)
            pooler = PoolerConfig.from_json(args.pooler_config)
            traces = tracing.traces_endpoint(args.otlp_traces_endpoint)
            if args.lora_modules and not config.enable_lora:
                raise ValueError("--lora-modules needs --enable-lora")
            accept = _remote_prefill(args.accept_remote_prefill, args.remote_prefill_key_file, config)
        except ValueError as exc:
            print(f"specfleet serve: {exc}", file=sys.stderr)
            return 2
        started = time.monotonic()
        try:
            client = EngineCoreClient(config, log_level=args.log_level)
        except RuntimeError as exc:
            logger.error("event=engine_core_start_failed error=%s", exc)
            return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    logger.info(
        "event=model_loaded model=%s load_s=%.1f core_pid=%d",
        client.info.model_name,
        time.monotonic() - started,
        client.pid,
    )
    state = build_state(
        client,
        served_model_name=args.served_model_name,
        max_waiting=args.max_waiting,
        admin_token=admin_token,
        admin_port=args.admin_port,
        chat=chat,
        pooler=pooler,
        otlp_traces_endpoint=traces,
        remote_prefill=accept,
    )
    app = _app(state, args.lora_modules)
    if app is None:
        client.stop()
        return 2
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    server = DrainingServer(uv_config, state, args.drain_timeout, args.shutdown_delay)
    try:  # one server on one or two listening sockets: the drain on SIGTERM covers both
        sockets = [_listen(args.host, port) for port in (args.port, args.admin_port) if port is not None]
    except OSError as exc:
        print(f"specfleet serve: cannot listen on {args.host}: {exc.strerror}", file=sys.stderr)
        client.stop()
        return 1
    try:
        server.run(sockets=sockets)
    finally:
        client.stop()
    if server.core_dead is not None:
        logger.error("event=exit reason=engine_core_dead exit_code=1")
        return 1
    return 0 if server.started else 1


if __name__ == "__main__":
    raise SystemExit(main())
