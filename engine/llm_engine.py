"""The engine: requests in, one scheduler step at a time, outputs out.

Not thread-safe except `live_config` / `update_config`: one thread drives add_request, abort and step.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from specfleet.engine.block_manager import BlockManager
from specfleet.engine.config import PRIORITY, EngineConfig, LiveConfig, check_live
from specfleet.engine.detokenizer import IncrementalDetokenizer, TextCursor, TokenText, replay
from specfleet.engine.errors import context_length_error
from specfleet.engine.knobs import KNOBS
from specfleet.engine.kv_events import ZmqEventPublisher
from specfleet.engine.kv_events_config import KVEventsConfig
from specfleet.engine.kv_transfer.base import KVTransferParams, encode_logprob
from specfleet.engine.kv_transfer.connector import KVConnector
from specfleet.engine.loader import LoadedModel, kv_cache_blocks, load_model, sliding_layers
from specfleet.engine.lora.adapter import LoraAdapter, LoraError
from specfleet.engine.lora.manager import LoraManager
from specfleet.engine.model_runner import InFlight, ModelRunner, ModelRunnerOutput, SpecStats
from specfleet.engine.models.llama import LlamaModel
from specfleet.engine.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from specfleet.engine.request_queue import MAX_PRIORITY, MIN_PRIORITY
from specfleet.engine.sampler import sample_seed
from specfleet.engine.sampling_params import ParameterError, SamplingParams
from specfleet.engine.scheduler import Scheduler, SchedulerOutput
from specfleet.engine.sequence import Sequence
from specfleet.engine.spec_decode.factory import build_proposer, load_draft
from specfleet.engine.spec_decode.methods import method
from specfleet.engine.spec_decode.request_classes import RequestClasses
from specfleet.engine.spec_decode.rules import k_room, proposal_length, speculation_off
from specfleet.engine.spec_decode.shadow import ShadowDrafts
from specfleet.engine.stats import EngineStats, StepStats
from specfleet.engine.stop import Finish, StopChecker
from specfleet.engine.structured_output.manager import StructuredOutputManager
from specfleet.engine.tokenizer import chat_prompt_ids

log = logging.getLogger("specfleet.engine")
# After a step that scheduled nothing while a KV pull or a grammar compile is in flight, the caller waits
# this long for something to change before it steps again, rather than spinning: 20 ms, under one decode
# step, so a request that becomes schedulable starts about as soon as it would in a busy loop, at ~50 cheap
# empty steps a second. The offline loops wait on the engine (`wait_for_background`); the engine core's
# loop waits on its input socket for the same time instead (core/proc.py), so a new request is not delayed.
BACKGROUND_WAIT_S = 0.02


class _Request:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        seqs: list[Sequence],
        detoks: list[IncrementalDetokenizer | TextCursor],
    ):
        self.request_id, self.prompt, self.prompt_ids = request_id, prompt, prompt_ids
        self.seqs, self.detoks = seqs, detoks
        self.logprobs: list[list[PositionLogprobs]] = [[] for _ in seqs]
        # Position p holds the logprobs of prompt token p (None for the first); filled as prefill runs.
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.remote_decode = False  # a prefill engine holds the prompt's KV for a decode engine


class Engine:
    """`text_cursor`, when given, replaces each sample's detokenizer (the engine core's: the server
    detokenizes and matches stop strings), and logprobs are then left undecoded."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        text_cursor: Callable[[], TextCursor] | None = None,
        **kwargs,
    ):
        if config is None:
            config = EngineConfig(**kwargs)
        elif kwargs:
            config = replace(config, **kwargs)
        self.config = config
        loaded: LoadedModel = load_model(config)
        self.tokenizer, self.model_name, self.max_model_len = (
            loaded.tokenizer,
            loaded.name,
            loaded.max_model_len,
        )
        self.eos_token_ids = loaded.eos_token_ids
        # the request defaults --generation-config puts in force (vLLM's default sampling params)
        self.sampling_defaults = dict(loaded.sampling_defaults)
        draft = load_draft(config, loaded)
        num_blocks = self._build_core(config, loaded, draft)
        self.lora = self._build_lora(config, loaded)
        self._build_speculation(config, loaded, draft, num_blocks)
        self._build_kv_connector(config)
        self._build_kv_events(config)
        self._build_requests(config, text_cursor)
        self._log_ready(config, num_blocks, draft is not None)

    def _build_core(self, config: EngineConfig, loaded: LoadedModel, draft: LoadedModel | None) -> int:
        """The KV cache sized for the model (and draft), its block manager, the model runner and the
        scheduler; returns the number of KV blocks."""
        models = [loaded.model] + ([draft.model] if draft else [])
        # Sliding-window layers keep only their window in a pool of their own; a disaggregated engine's KV
        # connector moves every layer's blocks by one table, so there they keep the whole sequence.
        sliding = sliding_layers(loaded.model, self.max_model_len) if config.kv_role is None else None
        num_blocks = kv_cache_blocks(config, models, self.max_model_len, loaded.model.device, sliding=sliding)
        self.kv = BlockManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            sliding_window=sliding.window if sliding else None,
            num_sliding_blocks=sliding.num_blocks if sliding else 0,
        )
        self.runner = ModelRunner(
            loaded.model,
            num_blocks,
            config.block_size,
            config.attention_backend,
            self.eos_token_ids,
            config.seed,
            sliding=sliding,
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            config.scheduling_policy,
        )
        return num_blocks

    def _build_lora(self, config: EngineConfig, loaded: LoadedModel) -> LoraManager | None:
        """The adapters' manager of a LoRA engine (None without --enable-lora); the target's runner applies
        them and the scheduler caps the adapters a step mixes."""
        if not config.enable_lora:
            return None
        model = loaded.model
        if not isinstance(model, LlamaModel):
            raise ValueError(f"enable_lora: LoRA is not supported for {type(model).__name__}")
        self.runner.use_lora = True
        self.scheduler.max_loras = config.max_loras
        # the model says which PEFT modules it has and how they lie on its fused projections
        return LoraManager(
            model.lora_shape(), self.model_name, config.max_lora_rank, config.cpu_loras, model.dtype
        )

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> LoraAdapter:
        """Serve adapter `lora_name` from the PEFT folder `lora_path` (again, if loaded: requests in flight
        finish on the weights they started with). Raises LoraError (a ValueError) naming what is wrong."""
        return self._lora_manager().load(lora_name, lora_path)

    def read_lora_adapter(self, lora_name: str, lora_path: str) -> tuple[LoraAdapter, float]:
        """The first half of a load, safe on a worker thread while the engine steps: the files read and
        checked (and the seconds that took); `register_lora_adapter` then serves it, between steps."""
        return self._lora_manager().read(lora_name, lora_path)

    def register_lora_adapter(self, adapter: LoraAdapter, seconds: float) -> LoraAdapter:
        return self._lora_manager().register(adapter, seconds)

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving `lora_name`: new requests for it are refused; those in flight finish on it."""
        self._lora_manager().unload(lora_name)

    def lora_adapters(self) -> dict[str, str]:
        """name -> path of the adapters served (empty without --enable-lora)."""
        return self.lora.names() if self.lora is not None else {}

    def lora_requests_info(self) -> tuple[list[str], list[str]]:
        """(adapters with running requests, adapters with waiting ones): vLLM's lora_requests_info labels."""
        running = {s.lora.name for s in self.scheduler.running if s.lora is not None}
        waiting = {s.lora.name for s in self.scheduler.waiting if s.lora is not None}
        return sorted(running), sorted(waiting)

    def lora_state(self) -> dict[str, Any]:
        """What the server reports: adapters served (name -> path), those with running and waiting
        requests, the load and eviction counts with each load's seconds since the last call, and each
        served adapter's [draft tokens, accepted] totals (speculative decoding)."""
        running, waiting = self.lora_requests_info()
        if self.lora is None:
            return {
                "adapters": {},
                "running": running,
                "waiting": waiting,
                "loads": 0,
                "evictions": 0,
                "load_s": [],
                "drafts": {},
            }
        stats = self.lora.stats
        load_s, stats.load_seconds = stats.load_seconds, []
        return {
            "adapters": self.lora.names(),
            "running": running,
            "waiting": waiting,
            "loads": stats.loads,
            "evictions": stats.evictions,
            "load_s": load_s,
            "drafts": {name: list(counts) for name, counts in stats.drafts.items()},
        }

    def _lora_for(self, lora_name: str | None) -> LoraAdapter | None:
        """The adapter a request names (None: the base); a ParameterError on `model` for an unknown one."""
        if lora_name is None:
            return None
        try:
            return self._lora_manager().get(lora_name)
        except LoraError as exc:
            raise ParameterError("model", str(exc)) from exc

    def _lora_manager(self) -> LoraManager:
        if self.lora is None:
            raise LoraError("LoRA adapters need an engine started with --enable-lora")
        return self.lora

    def _build_speculation(
        self, config: EngineConfig, loaded: LoadedModel, draft: LoadedModel | None, num_blocks: int
    ) -> None:
        """The speculative proposer (None without a method) and the shadow drafts."""
        self.proposer = build_proposer(config, loaded, draft, num_blocks)
        if self.proposer is not None:
            self.scheduler.on_release = self.proposer.release
        # speculation per request, by class of acceptance (spec_decode/request_classes.py): the simulator's
        # per-request acceptance
        self.request_classes = RequestClasses() if self.proposer is not None else None
        # n-gram lookups scored on steps that verify no drafts (spec_decode/shadow.py): the tuner's reading
        # of the traffic's acceptance while speculation is off, for the methods that declare it
        spec = method(config.speculative_method)
        self.shadow = (
            ShadowDrafts(
                config.max_num_speculative_tokens,
                config.prompt_lookup_min,
                config.prompt_lookup_max,
                self.max_model_len,
            )
            if spec is not None and spec.shadow_drafts
            else None
        )

    def _build_kv_events(self, config: EngineConfig) -> None:
        """`--kv-events-config`: the block manager records stored/removed blocks, a publisher thread sends
        them (engine/kv_events.py); None without the flag."""
        self.kv_events: ZmqEventPublisher | None = None
        if config.kv_events_config is not None:
            events = KVEventsConfig.parse(config.kv_events_config)
            if events.publishes:
                self.kv_events = ZmqEventPublisher(events)
                self.kv.events = []
                log.info(
                    "event=kv_events_publishing endpoint=%s replay=%s",
                    self.kv_events.endpoint,
                    self.kv_events.replay_endpoint,
                )

    def _build_kv_connector(self, config: EngineConfig) -> None:
        """The KV transfer connector of a disaggregated prefill or decode engine (None otherwise)."""
        self.kv_connector: KVConnector | None = None
        if config.kv_role is not None:
            self.kv_connector = KVConnector(
                config.kv_role,
                self.kv,
                self.scheduler,
                self.runner.kv_caches,
                config.kv_transfer_host,
                config.kv_transfer_port,
                config.kv_transfer_timeout_s,
            )
            self.scheduler.on_finish = self._on_finish

    def _build_requests(self, config: EngineConfig, text_cursor: Callable[[], TextCursor] | None) -> None:
        """What serves requests around the runner: structured output, stop checks, stats, the live config,
        the request table and the pipeline's in-flight micro-batches."""
        self.structured = StructuredOutputManager(
            self.tokenizer, self.runner.vocab_size, self.eos_token_ids, config.max_num_speculative_tokens
        )
        self.stops = StopChecker(self.eos_token_ids, self.max_model_len, self.structured)
        self.stats = EngineStats()
        self._live = LiveConfig(**{knob.name: getattr(config, knob.name) for knob in KNOBS})
        self._pending: dict[str, int] = {}
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self.text_cursor = text_cursor
        self.token_text = TokenText(self.tokenizer) if text_cursor is None else None
        # Pipeline parallelism: micro-batches launched into the stages and not yet collected, oldest first.
        self._pipeline_depth = self.scheduler.micro_batches = (
            self.runner.pipeline_depth if config.pipeline_overlap else 1
        )
        self._in_flight: deque[tuple[SchedulerOutput, InFlight]] = deque()
        self._grammar_failed: list[Sequence] = []  # ended by a failed compile, reported by _postprocess

    def _log_ready(self, config: EngineConfig, num_blocks: int, has_draft: bool) -> None:
        log.info(
            "event=engine_ready model=%s blocks=%d sliding_blocks=%d draft_blocks=%d block_size=%d "
            "max_model_len=%d backend=%s",
            self.model_name,
            num_blocks,
            self.kv.sliding.num_blocks - 1 if self.kv.sliding is not None else 0,
            num_blocks if has_draft else 0,
            config.block_size,
            self.max_model_len,
            self.runner.attn.name,
        )
        if self.sampling_defaults:  # vLLM warns the same way: a request without them samples otherwise
            log.warning(
                "event=generation_config_defaults generation_config=%s %s Default sampling parameters have "
                "been overridden by the model's generation config; start with --generation-config vllm to "
                "use SamplingParams' own",
                config.generation_config,
                " ".join(f"{k}={v}" for k, v in sorted(self.sampling_defaults.items())),
            )

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the request defaults in force (vLLM's LLM.get_default_sampling_params)."""
        return SamplingParams(**self.sampling_defaults)

    def close(self) -> None:
        """Stop what the engine started beside itself (tensor-parallel workers, the KV connector's server
        thread); idempotent."""
        if self.kv_connector is not None:
            self.kv_connector.close()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        while self._in_flight:  # let the stages finish what they hold before they are told to stop
            sched, flight = self._in_flight.popleft()
            try:
                self.runner.collect(flight.num_tokens)
            except RuntimeError as exc:
                log.warning("event=pipeline_drain_failed error=%s", exc)
                break
        close = getattr(self.runner.model, "close", None)
        if close is not None:
            close()

    def check_health(self) -> None:
        """Raise if a part the engine runs on is gone: a split model's dead worker is `WorkerDied` (a step
        finds it too; this is for an idle engine, which runs no collective that would)."""
        check = getattr(self.runner.model, "check_workers", None)
        if check is not None:
            check()

    # -- requests ------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        kv_transfer_params: dict | None = None,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> None:
        """`lora_name`: run the request on that loaded LoRA adapter (None: the base model).
        `kv_transfer_params` (disaggregation, in vLLM's spelling): {"do_remote_decode": true} on a prefill
        engine holds the prompt's KV for a decode engine and returns where in the output's
        `kv_transfer_params`; those params given to a decode engine load that KV and continue the stream.
        `priority` (vLLM's): lower runs first under `--scheduling-policy priority`; else only 0."""
        params = params or SamplingParams()
        self._check_priority(priority)
        adapter = self._lora_for(lora_name)
        remote = self._remote_params(kv_transfer_params, params)
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = (
            self.tokenizer.encode(prompt, add_special_tokens=True)
            if isinstance(prompt, str)
            else list(prompt)
        )
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens :]
        self._check_request(ids, params)
        if params.pooling is not None and (remote or not hasattr(self.runner.model, "final_norm")):
            raise ParameterError(
                "pooling",
                "pooling needs an engine whose model is not split over workers, without kv_transfer",
            )
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        seqs: list[Sequence] = []
        detoks: list[IncrementalDetokenizer | TextCursor] = []
        resumed = list(params.resume_token_ids or [])  # generated on another engine: output, not prompt
        for index in range(params.n):
            tokens = ids + resumed + ([remote.first_token_id] if isinstance(remote, KVTransferParams) else [])
            seq = Sequence(
                next(self._seq_ids), request_id, index, tokens, len(ids), params, priority=priority
            )
            if params.seed is not None:
                seq.seed = sample_seed(params.seed, index)
            seq.lora = adapter
            seq.parent = seqs[0] if seqs else None
            seqs.append(seq)
            detoks.append(
                self.text_cursor()
                if self.text_cursor is not None
                else IncrementalDetokenizer(
                    self.tokenizer,
                    params.stop,
                    params.include_stop_str_in_output,
                    ids,
                    params.skip_special_tokens,
                )
            )
            replay(detoks[-1], resumed, params.min_tokens)  # the resumed tokens' text, grown as it was
        if params.structured_outputs is not None:  # the prefill's first token must be the grammar's first
            first = "kv_transfer_params.first_token_id" if isinstance(remote, KVTransferParams) else None
            self.structured.attach(seqs, params.structured_outputs, first)
        if isinstance(remote, KVTransferParams):
            assert self.kv_connector is not None, "_remote_params accepts remote KV only with a kv_role"
            try:
                self.kv_connector.add_remote(seqs[0], remote)
            except ValueError as exc:
                raise ParameterError("kv_transfer_params", str(exc)) from exc
            detoks[0].update(seqs[0].output_token_ids, check_stop=False)
        else:
            for seq in seqs:
                self.scheduler.add(seq)
        req = self._requests[request_id] = _Request(request_id, text, ids, seqs, detoks)
        req.remote_decode = remote is True
        if isinstance(remote, KVTransferParams) and params.logprobs is not None:
            req.logprobs[0].append(self._first_token_logprobs(remote, params.logprobs))
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)

    def _remote_params(self, data: dict | None, params: SamplingParams) -> KVTransferParams | bool:
        """True: hold the KV for a decode engine; KVTransferParams: load it; False: neither."""
        if not data:
            return False
        if params.resume_token_ids is not None:
            raise ParameterError(
                "kv_transfer_params", "kv_transfer_params cannot be combined with resume_token_ids"
            )
        role = self.config.kv_role
        if data.get("do_remote_decode"):
            if role != "prefill":
                raise ParameterError(
                    "kv_transfer_params",
                    f"do_remote_decode needs an engine with kv_role='prefill', this one has kv_role={role!r}",
                )
            if params.n != 1 or params.max_tokens != 1:
                raise ParameterError(
                    "kv_transfer_params",
                    "do_remote_decode needs n=1 and max_tokens=1 (the decode "
                    f"engine samples the rest), got n={params.n} max_tokens={params.max_tokens}",
                )
            return True
        if role is None:
            raise ParameterError("kv_transfer_params", "loading remote KV needs an engine with a kv_role")
        try:
            remote = KVTransferParams.from_dict(data)
        except (TypeError, ValueError) as exc:
            raise ParameterError("kv_transfer_params", str(exc)) from exc
        vocab = self.runner.vocab_size
        if remote.first_token_id >= vocab:
            raise ParameterError(
                "kv_transfer_params",
                f"kv_transfer_params.first_token_id must be in [0, {vocab}), got {remote.first_token_id}",
            )
        if params.logprobs is not None:
            lps = remote.first_token_logprobs
            if lps is None or len(lps["top"]) < params.logprobs:
                raise ParameterError(
                    "kv_transfer_params",
                    f"logprobs={params.logprobs} through a remote prefill needs "
                    "kv_transfer_params.first_token_logprobs with at least that many top entries (the "
                    "prefill engine returns them when its request asks for logprobs)",
                )
            if any(t >= vocab for t, _ in lps["top"]):
                raise ParameterError(
                    "kv_transfer_params",
                    f"kv_transfer_params.first_token_logprobs.top ids must be in [0, {vocab})",
                )
        if params.n != 1 or (params.max_tokens is not None and params.max_tokens < 2):
            raise ParameterError(
                "kv_transfer_params",
                "a remote decode continues after the prefill's first token: "
                f"it needs n=1 and max_tokens >= 2, got n={params.n} max_tokens={params.max_tokens}",
            )
        return remote

    def _first_token_logprobs(self, remote: KVTransferParams, num_top: int) -> PositionLogprobs:
        """The prefill's logprobs of the first token (validated by _remote_params), the decode engine's
        first logprobs entry: it does not sample that token itself."""
        data = remote.first_token_logprobs
        assert data is not None, "_remote_params requires them with logprobs"
        top = {t: lp for t, lp in data["top"][:num_top]}
        lp = PositionLogprobs(remote.first_token_id, data["logprob"], top, data["rank"])
        return lp.decode_with(self.token_text) if self.token_text is not None else lp

    def _on_finish(self, seq: Sequence, reason: str) -> None:
        req = self._requests.get(seq.request_id)
        assert self.kv_connector is not None, "registered as the scheduler's on_finish only with a connector"
        self.kv_connector.on_finish(seq, reason, req is not None and req.remote_decode)

    def poll_kv_transfers(self) -> None:
        """Return the blocks of KV holds that ended; an idle server calls this between steps."""
        if self.kv_connector is not None:
            self.kv_connector.poll()

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as written and after a space (vLLM's two variants), without duplicates."""
        variants: list[list[int]] = []
        for word in words:
            for form in (word.strip(), " " + word.strip()):
                ids = self.tokenizer.encode(form, add_special_tokens=False)
                if ids and ids not in variants:
                    variants.append(ids)
        return variants

    def _check_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ParameterError("priority", f"priority={priority!r} must be an integer")
        if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise ParameterError(
                "priority", f"priority={priority} must be between {MIN_PRIORITY} and {MAX_PRIORITY}"
            )
        if priority and self.config.scheduling_policy != PRIORITY:
            # vLLM's words, which clients match on to drop the field and retry
            raise ParameterError(
                "priority",
                f"Got priority {priority} but Priority scheduling is not enabled: this engine schedules "
                f"first come, first served (--scheduling-policy {self.config.scheduling_policy}); start it "
                "with --scheduling-policy priority, or leave priority out or send 0",
            )

    def _check_request(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ParameterError("prompt", "prompt is empty: give at least one token")
        vocab = self.runner.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ParameterError("prompt", f"prompt token ids must be in [0, {vocab})")
        token_fields = {
            "stop_token_ids": params.stop_token_ids,
            "allowed_token_ids": params.allowed_token_ids or [],
            "logit_bias": list(params.logit_bias or {}),
            "resume_token_ids": params.resume_token_ids or [],
        }
        for name, tokens in token_fields.items():
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in tokens):
                raise ParameterError(name, f"{name} must be in [0, {vocab})")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise context_length_error(
                "prompt",
                limit,
                f"your prompt has {len(ids)} tokens, which leaves no room for a generated token. "
                "Please reduce the length of the prompt.",
            )
        resumed = len(params.resume_token_ids or [])
        if len(ids) + resumed >= limit:
            raise context_length_error(
                "resume_token_ids",
                limit,
                f"the prompt's {len(ids)} tokens and resume_token_ids' {resumed} fill it: nothing is left to generate.",
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise context_length_error(
                "max_tokens",
                limit,
                f"you requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                f"max_tokens={params.max_tokens} in the completion). Please reduce the length of the prompt "
                "or max_tokens.",
            )

    def apply_chat_template(self, messages: list[dict], **controls: Any) -> list[int]:
        """Prompt token ids for a conversation (`chat_prompt_ids`' template controls)."""
        return chat_prompt_ids(self.tokenizer, self.model_name, messages, **controls)

    def abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            for seq in req.seqs:
                if self.kv_connector is None or not self.kv_connector.abort(seq):
                    self.scheduler.finish(seq, "abort")

    def finish_sequence(self, request_id: str, index: int, reason: str = "stop") -> None:
        """End one sample of a request (the server matched a stop string in its text)."""
        req = self._requests.get(request_id)
        if req is None:
            return
        self.scheduler.finish(req.seqs[index], reason)
        if all(s.is_finished for s in req.seqs):
            del self._requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_pending_background_work(self) -> bool:
        """Whether something outside the step may make a waiting request schedulable with no new input:
        a KV hold that will end (its blocks return), a remote KV pull queued or in flight, a grammar
        compiling. The engine core polls an engine whose step scheduled nothing at a short interval
        while this holds, and otherwise sleeps until an input arrives (core/proc.py, `_loop`)."""
        connector = self.kv_connector
        if connector is not None and (connector.num_holds or connector.has_remote()):
            return True
        return bool(self.structured.num_compiling)

    def wait_for_background(self, timeout_s: float = BACKGROUND_WAIT_S) -> None:
        """After a step that ran no batch: block until a KV pull or a grammar compile in flight ends, or
        `timeout_s`, so that a loop stepping the engine does not spin. Returns at once when neither is in
        flight."""
        if self.kv_connector is not None and self.kv_connector.has_remote():
            self.kv_connector.wait(timeout_s)
        elif self.structured.num_compiling:
            self.structured.wait(timeout_s)

    def step_or_wait(self) -> list[RequestOutput]:
        """One step, then `wait_for_background` if it ran no batch: what a loop that only steps the engine
        (offline generation, the P/D pair) calls."""
        before = self.stats.num_steps
        outputs = self.step()
        if self.stats.num_steps == before:
            self.wait_for_background()
        return outputs

    def discard(self, request_id: str) -> None:
        """Undo a request whose `add_request` raised part-way (the engine core turns such a failure into
        that request's error): whatever of it reached the scheduler's queues leaves them and returns its
        blocks, so no sequence runs for a request nobody follows."""
        self.abort(request_id)
        sched = self.scheduler
        for seq in [s for s in (*sched.waiting, *sched.running) if s.request_id == request_id]:
            if self.kv_connector is None or not self.kv_connector.abort(seq):
                sched.finish(seq, "abort")

    def kv_blocks_in_use(self) -> int:
        # referenced blocks, of both pools when sliding layers have their own; cached free ones are not in use
        return self.kv.num_used_blocks + self.kv.num_used_sliding_blocks

    # -- live configuration -----------------------------------------------------------------------------
    def live_config(self) -> LiveConfig:
        with self._lock:
            return LiveConfig(**{**self._live.as_dict(), **self._pending})

    def update_config(self, **changes: int) -> LiveConfig:
        check_live(self.config, changes)
        with self._lock:
            self._pending.update(changes)
        return self.live_config()

    def _apply_pending(self) -> None:
        with self._lock:
            if not self._pending:
                return
            self._live = LiveConfig(**{**self._live.as_dict(), **self._pending})
            self._pending.clear()
        self.scheduler.max_num_seqs = self._live.max_num_seqs
        self.scheduler.max_num_batched_tokens = self._live.max_num_batched_tokens

    def set_pipeline_overlap(self, on: bool) -> None:
        """Turn pipeline parallelism's micro-batch overlap on or off between steps (`specfleet bench pp`
        compares the two on one engine: a process holds one process group, so one split engine)."""
        if self._in_flight:
            raise RuntimeError("micro-batches are in flight: change the overlap between generations")
        self._pipeline_depth = self.scheduler.micro_batches = self.runner.pipeline_depth if on else 1

    # -- the step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._pipeline_depth > 1:
            return self._pipelined_step()
        start = time.perf_counter()
        self._apply_pending()
        self._poll_grammars()
        if self.kv_connector is not None:
            self.kv_connector.poll()
            self.kv_connector.admit_remote()
        self._propose()
        sched = self.scheduler.schedule()
        if sched.empty:  # the caller waits (`wait_for_background`) rather than stepping again at once
            return self._postprocess(sched, None, [])
        sched.grammar_bitmask = self.structured.bitmask(sched.scheduled)
        self._track_kv_peak()
        result = self.runner.execute(sched)
        changed = self.scheduler.update(sched, result.sampled, self._stop)
        outputs = self._postprocess(sched, result, changed)
        self._record(sched, changed, result.spec, time.perf_counter() - start)
        return outputs

    def _pipelined_step(self) -> list[RequestOutput]:
        """Pipeline parallelism with overlap (vLLM's virtual engines): keep up to one micro-batch per stage
        in flight, each over sequences no other in-flight micro-batch holds, then collect the oldest, sample
        it and return its outputs. Stage 0 (this process) runs its layers on the next micro-batch while the
        later stages work on the earlier ones. A sequence's tokens, proposals, blocks and preemption are
        only touched while it is not in flight, so each step of a sequence sees exactly what a step without
        overlap would: greedy output is the same, speculation verifies through every stage as before."""
        start = time.perf_counter()
        self._apply_pending()
        self._poll_grammars()
        outputs: list[RequestOutput] = []
        while len(self._in_flight) < self._pipeline_depth:
            busy = frozenset(item.seq.seq_id for sched, _ in self._in_flight for item in sched.scheduled)
            self._propose(busy, keep=bool(self._in_flight))
            sched = self.scheduler.schedule(busy)
            if sched.empty:
                if sched.finished or self._grammar_failed:  # ended for want of room or grammar: report now
                    outputs += self._postprocess(sched, None, [])
                break
            sched.grammar_bitmask = self.structured.bitmask(sched.scheduled)
            self._track_kv_peak()
            self._in_flight.append((sched, self.runner.launch(sched)))
            self.stats.peak_micro_batches_in_flight = max(
                self.stats.peak_micro_batches_in_flight, len(self._in_flight)
            )
        if not self._in_flight:
            return outputs
        sched, flight = self._in_flight.popleft()
        result = self.runner.finish(sched, flight)
        changed = self.scheduler.update(sched, result.sampled, self._stop)
        outputs += self._postprocess(sched, result, changed)
        self._record(sched, changed, result.spec, time.perf_counter() - start)
        return outputs

    def _poll_grammars(self) -> None:
        """Grammars compiled since the last step join their sequences (which the scheduler then admits); a
        compile that failed ends its request with "abort" and a logged error (admission already ran every
        check that makes a 400, on the same grammar: structured_output/admission.py)."""
        for seq, error in self.structured.poll():
            log.warning("event=grammar_compile_failed request_id=%s error=%s", seq.request_id, error)
            if self.kv_connector is None or not self.kv_connector.abort(seq):
                self.scheduler.finish(seq, "abort")
            self._grammar_failed.append(seq)

    def _propose(self, busy: frozenset[int] = frozenset(), keep: bool = False) -> None:
        """Give every decoding sequence up to k proposals to verify in this step (none when k = 0); `busy`:
        sequences in flight in the pipeline, whose proposals are already on their way; `keep`: leave the
        proposals of a sequence an earlier micro-batch of this step did not take (its tokens are unchanged)."""
        if self.proposer is None:
            return
        seqs, ks = [], []
        if not self._speculation_disabled_by_batch():
            for seq in self.scheduler.running:
                if (
                    seq.in_prefill
                    or seq.seq_id in busy
                    or (keep and seq.spec_token_ids)
                    or seq.grammar_pending
                ):
                    continue
                k = self._k_for(seq)
                if k:
                    seqs.append(seq)
                    ks.append(k)
        if not seqs:
            if self.shadow is not None:
                self.shadow.look(self.scheduler.running, busy)
            return
        for seq, proposal in zip(seqs, self.proposer.propose(seqs, ks)):
            seq.spec_token_ids, seq.spec_probs = proposal.token_ids, proposal.probs
            self.structured.filter_proposals(seq)

    def _speculation_disabled_by_batch(self) -> bool:
        """The batch this step will run (running sequences plus the waiting ones max_num_seqs leaves room
        for) is larger than `speculative_disable_by_batch_size`: past the step cost's knee a draft token
        costs as much as a sequence's own, so a load that rose between two tuner intervals gets no drafts
        from its first step."""
        sched = self.scheduler
        return speculation_off(
            len(sched.running),
            len(sched.waiting),
            sched.max_num_seqs,
            self._live.speculative_disable_by_batch_size,
        )

    def _k_for(self, seq: Sequence) -> int:
        params = seq.params
        k = (
            self._live.num_speculative_tokens
            if params.num_speculative_tokens is None
            else params.num_speculative_tokens
        )
        if not k or params.depends_on_history or seq.num_output_tokens < params.min_tokens:
            return 0  # penalties, bad words and min_tokens depend on each earlier token: one at a time
        left = None if params.max_tokens is None else params.max_tokens - seq.num_output_tokens
        room = k_room(self.max_model_len, seq.num_tokens, left)
        return proposal_length(k, room, self.config.max_num_speculative_tokens)

    def _postprocess(
        self, sched: SchedulerOutput, result: ModelRunnerOutput | None, changed: list[tuple[Sequence, int]]
    ) -> list[RequestOutput]:
        if self.kv_events is not None and (events := self.kv.take_events()):
            self.kv_events.publish(events)  # this step's blocks stored and evicted, one batch
        now = time.monotonic()
        decode = self.token_text
        lp_by_seq = {
            item.seq.seq_id: [lp.decode_with(decode) for lp in lps] if decode else lps
            for item, lps in zip(sched.scheduled, result.logprobs if result else [])
            if lps
        }
        touched: dict[str, _Request] = {}
        for item, prompt_lps in zip(sched.scheduled, result.prompt_logprobs if result else []):
            req = self._requests.get(item.seq.request_id)
            if prompt_lps is not None and req is not None and req.prompt_logprobs is not None:
                start, entries = prompt_lps
                for pos, lp in enumerate(entries, start):
                    req.prompt_logprobs[pos] = req.prompt_logprobs[pos] or (
                        lp.decode_with(decode) if decode else lp
                    )
        for seq, _ in changed:
            req = self._requests.get(seq.request_id)
            if req is None:
                continue
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = seq.first_scheduled_time
            if seq.kv_transfer is not None:
                req.metrics.kv_transfer = seq.kv_transfer
            if seq.first_token_time is None:
                seq.first_token_time = now
                req.metrics.first_token_time = req.metrics.first_token_time or now
            if seq.seq_id in lp_by_seq:
                req.logprobs[seq.index].extend(lp_by_seq[seq.seq_id])
            touched[req.request_id] = req
        for seq in self._grammar_failed:  # a grammar that failed to compile: ended with "abort"
            if (req := self._requests.get(seq.request_id)) is not None:
                touched[req.request_id] = req
        self._grammar_failed.clear()
        for seq in sched.finished:  # no room in the cache: ended with "length"
            if (req := self._requests.get(seq.request_id)) is not None:
                log.warning(
                    "event=finished_no_kv_room request_id=%s tokens=%d", seq.request_id, seq.num_tokens
                )
                touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            req.metrics.last_token_time = now
            finished = all(s.is_finished for s in req.seqs)
            if finished:
                req.metrics.finished_time = now
                del self._requests[req.request_id]
            outputs.append(self._output(req, finished))
        return outputs

    def _stop(self, seq: Sequence) -> Finish | None:
        """The scheduler's question after appending each token: does `seq` end there (engine/stop.py)?"""
        req = self._requests.get(seq.request_id)
        return None if req is None else self.stops.check(seq, req.detoks[seq.index])

    def _output(self, req: _Request, finished: bool) -> RequestOutput:
        outs = []
        for seq, detok in zip(req.seqs, req.detoks):
            lps = (
                req.logprobs[seq.index][: seq.num_output_tokens] if seq.params.logprobs is not None else None
            )
            cumulative = sum(lp.logprob for lp in lps) if lps is not None else None
            outs.append(
                CompletionOutput(
                    seq.index,
                    detok.visible_text(seq.is_finished),
                    seq.output_token_ids,
                    seq.finish_reason,
                    seq.stop_reason,
                    lps,
                    cumulative,
                )
            )
        cached = req.seqs[0].num_cached_tokens
        held = (
            self.kv_connector.held.pop(req.seqs[0].seq_id, None) if self.kv_connector and finished else None
        )
        if held is not None and req.seqs[0].params.logprobs is not None and req.logprobs[0]:
            first = req.logprobs[0][0]  # the decode engine reports it: it does not sample this token
            held = replace(
                held,
                first_token_logprobs=encode_logprob(
                    first.token_id, first.logprob, first[first.token_id].rank, first.top
                ),
            )
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_ids,
            outs,
            finished,
            cached,
            req.metrics,
            req.prompt_logprobs,
            held.as_dict() if held else None,
            _embedding(req.seqs[0]) if finished else None,
        )

    # -- statistics -------------------------------------------------------------------------------------
    def _track_kv_peak(self) -> None:
        allocated = self.kv.num_used_blocks * self.kv.block_size
        if allocated <= self.stats.peak_kv_slots_allocated:
            return
        filled: dict[int, int] = {}
        bs = self.kv.block_size
        for seq in self.scheduler.running:
            n = seq.num_tokens_with_spec
            for i, block in enumerate(seq.block_table):
                filled[block] = max(filled.get(block, 0), min(bs, n - i * bs))
        self.stats.peak_kv_slots_allocated = allocated
        self.stats.peak_kv_slots_used = sum(filled.values())

    def _record(
        self, sched: SchedulerOutput, changed: list[tuple[Sequence, int]], spec: SpecStats, duration: float
    ) -> None:
        step = StepStats(
            duration_s=duration,
            batch_size=len(sched.scheduled),
            num_scheduled_tokens=sched.num_batched_tokens,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage(),
            num_preemptions=sched.num_preemptions,
            num_priority_preemptions=sched.num_priority_preemptions,
            prompt_tokens=sched.num_prompt_tokens,
            generation_tokens=sum(n for _, n in changed),
            num_drafts=spec.num_drafts,
            num_draft_tokens=spec.num_draft_tokens,
            num_accepted_tokens=spec.num_accepted_tokens,
            accepted_per_pos=spec.accepted_per_pos,
        )
        if self.lora is not None and spec.per_adapter:
            self.lora.count_drafts(spec.per_adapter)
        self.stats.prefix_cache_queries = self.scheduler.prefix_queries
        self.stats.prefix_cache_hits = self.scheduler.prefix_hits
        if self.request_classes is not None:
            self.request_classes.observe(sched, changed)
            self.stats.request_classes = self.request_classes.classes
        if self.shadow is not None:
            self.shadow.score([seq for seq, _ in changed])
            shadow = self.shadow.stats
            self.stats.shadow_lookups, self.stats.shadow_drafts = shadow.lookups, shadow.drafts
            self.stats.shadow_accepted_per_pos = list(shadow.accepted_per_pos)
        self.stats.add_step(step)


def _embedding(seq: Sequence) -> list[float] | None:
    """A finished pooling request's embedding (None when it ended before its prompt did: an abort)."""
    if seq.params.pooling is None or seq.pooled is None or seq.num_computed_tokens < seq.num_prompt_tokens:
        return None
    return seq.pooled.tolist()
