"""One simulated engine: the engine's real `Scheduler` and `BlockManager`, a model runner made of a profile.

`start_step(now)` does what `Engine.step()` does before the model runs (apply pending live settings,
propose, schedule) and returns when the step ends, from the profile; `finish_step()` does what it does
after (the scheduler's `update` with the sampled tokens, stop checks, statistics). A step's end is the
two-stage pipeline of the engine core and the API server (`Profile.period_s`): the core's step, or the
server's work on the previous step's output if that is longer; the step's tokens reach their clients
when the server has sent them, `Profile.server_s` after the step's end. Sampled tokens come
from the workload: a request ends with "length" at its output length; speculative proposals are accepted
position by position with the profile's (or workload's) probabilities.

Fast mode: a step that is pure decode (no prompt chunk, no proposal, nobody admissible, room in the cache
for all) is repeated without the scheduler until the next arrival at this engine, the first finish or the
horizon: each repetition is exactly what the scheduler would have scheduled, so only the per-step Python
is skipped. When every running sequence decodes and nobody can be admitted, the run is planned without
calling the scheduler at all (`_decode_run`). The fleet cuts such a run short at an arrival (`cut`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import NamedTuple

from specfleet.engine.block_manager import BlockManager
from specfleet.engine.knobs import LiveConfig, live_limits, live_refusal
from specfleet.engine.sampling_params import SamplingParams
from specfleet.engine.scheduler import Scheduler, SchedulerOutput
from specfleet.engine.sequence import Sequence
from specfleet.engine.spec_decode.rules import k_room, proposal_length, speculation_off
from specfleet.tuner.policy.params import ModelParams

from .lora import SimAdapters, SimLora, adapter_work
from .metrics import EngineMetrics, LogHistogram
from .profile import Profile
from .request_draws import ClassDeck, request_rng
from .shadow import SimShadow
from .workload import OUTPUT_ID, SimRequest

PRIOR_ACCEPTANCE = ModelParams().prior_acceptance  # the tuner's prior, when neither profile nor workload says


@dataclass
class Record:
    """One request's life, in simulated seconds."""

    index: int
    arrival_s: float  # at the client
    engine: int
    prompt_tokens: int
    output_tokens: int
    engine_arrival_s: float = 0.0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    preemptions: int = 0
    finish_reason: str | None = None
    itl_sum: float = 0.0  # sum and count of the gaps between streamed outputs
    itl_count: int = 0
    itl_max: float = 0.0
    last_emit_s: float = 0.0
    itls: list[float] = field(default_factory=list)  # kept only when the fleet keeps ITLs


@dataclass(frozen=True)
class Limits:
    """What is fixed at start: the context length and each live knob's ceiling (`ceilings`: a `LiveConfig`
    whose every field is that knob's ceiling, the engine's `EngineConfig.<Knob.ceiling>`; `sim/fleet.py`
    builds it from the pod's flags)."""

    max_model_len: int
    ceilings: LiveConfig

    @property
    def max_k(self) -> int:
        return self.ceilings.num_speculative_tokens


@dataclass
class Plan:
    """A step (or, in fast mode, a run of identical decode steps) between start and end."""

    start: float
    sched: SchedulerOutput | None  # None: a fast-mode decode run planned without the scheduler
    durations: list[float]  # one per step (its period, `Profile.period_s`): > 1 only for a fast-mode run
    cores: list[float]  # the core's own seconds of each step (`Profile.core_s`: the step histogram's)
    server_s: float  # the server's work on each step's output (a run's steps all stream the same batch)
    decode_tokens: int
    proposals: int

    @property
    def end(self) -> float:
        return self.start + sum(self.durations)


def _class_speculation(profile: Profile) -> list[_Speculation]:
    """The speculation of each class of request acceptance the profile measured (none: every request
    speculates alike)."""
    return [
        _Speculation(
            c.share, c.proposal_continue, _verified(_conditional(c.accepted_per_pos), c.proposal_continue)
        )
        for c in profile.acceptance_classes
    ]


class SimEngine:
    def __init__(
        self,
        index: int,
        profile: Profile,
        live: LiveConfig,
        limits: Limits,
        *,
        block_size: int,
        prefix_caching: bool,
        rng: random.Random,
        accepted_per_pos: tuple[float, ...] = (),
        fast: bool = False,
        keep_itls: bool = False,
        itl_hist: LogHistogram | None = None,
        adapters: SimAdapters | None = None,
        shadow: bool = False,
        draw_seed: int = 0,
    ) -> None:
        self.index = index
        self.profile = profile
        blocks = max(1, profile.num_kv_blocks * profile.block_size // block_size)
        self.kv = BlockManager(blocks, block_size, prefix_caching, debug=False)
        self.scheduler = Scheduler(
            self.kv, live.max_num_seqs, live.max_num_batched_tokens, limits.max_model_len
        )
        self.adapters = adapters  # LoRA: --max-loras and the adapters' load time (sim/lora.py)
        self.scheduler.max_loras = adapters.max_loras if adapters is not None else None
        self.live = live
        self.pending: dict[str, int] = {}
        self.limits = limits
        self.rng = rng
        self.fast = fast
        self.keep_itls = keep_itls
        self.itl_hist = itl_hist if itl_hist is not None else LogHistogram()
        self.metrics = EngineMetrics()
        acceptance = accepted_per_pos or profile.accepted_per_pos or PRIOR_ACCEPTANCE
        self.conditional = _conditional(acceptance)
        # the same, given that the proposal holds the position (its length drawn in `_propose`): the measured
        # per-position rates count a draft too short for a position as not accepting it
        q = profile.proposal_continue
        self.verified = _verified(self.conditional, q)
        self.default_spec = _Speculation(profile.proposal_share, q, self.verified)
        # speculation per request: each request is dealt its class once (an acceptance given here stands for
        # every request, as before classes were measured)
        self.classes = _class_speculation(profile) if not accepted_per_pos else []
        # each request's class and draws by its index and the fleet's seed, whenever its steps run
        # (sim/request_draws.py)
        self.draw_seed = draw_seed
        self.deck = (
            ClassDeck([c.requests for c in profile.acceptance_classes], draw_seed) if self.classes else None
        )
        self.spec: dict[int, _Speculation] = {}  # seq_id -> its request's class, when classes are drawn
        self.draws: dict[int, random.Random] = {}  # seq_id -> its request's generator, when k can be > 0
        # the engine's shadow drafts, for a method that scores them (its own generator: the draws of
        # verified drafts stay those of a fleet without them), finding a draft at the engine's per-lookup rate
        # and accepted as the engine's shadow drafts were, where measured (a handful of verified drafts must
        # not stand for hundreds of shadow lookups)
        shadow_share = profile.proposal_share if profile.shadow_share is None else profile.shadow_share
        shadow_conditional = (
            _conditional(profile.shadow_accepted_per_pos)
            if profile.shadow_accepted_per_pos
            else self.conditional
        )
        self.shadow = (
            SimShadow(limits.max_k, shadow_conditional, shadow_share, random.Random(rng.random()))
            if shadow and limits.max_k
            else None
        )
        self.records: dict[int, Record] = {}  # seq_id -> its request's record, while in the engine
        self.targets: dict[int, int] = {}  # seq_id -> output length
        self.plan: Plan | None = None
        self.server_free_s = 0.0  # when the API server finishes the last step's output (`Profile.period_s`)
        self.version = 0  # bumps when a planned step's end moves (the fleet's heap entries go stale)
        self.params = SamplingParams(max_tokens=None)
        self.steps = 0
        self.fast_runs = 0  # fast-mode runs of more than one step
        self.done: list[Record] = []  # finished since the fleet last took them

    # -- requests -------------------------------------------------------------------------------------
    def add(self, request: SimRequest, record: Record, now: float) -> None:
        seq = Sequence(
            record.index,
            str(record.index),
            0,
            request.prompt_ids(record.index),
            request.prompt_tokens,
            self.params,
            arrival_time=now,
        )
        seq.lora = SimLora(request.adapter) if request.adapter is not None else None
        record.engine_arrival_s = now
        self.records[seq.seq_id] = record
        if self.deck is not None:
            self.spec[seq.seq_id] = self.classes[self.deck.deal(record.index)]
        if self.limits.max_k:
            self.draws[seq.seq_id] = request_rng(self.draw_seed, record.index)
        self.targets[seq.seq_id] = min(
            request.output_tokens, self.limits.max_model_len - request.prompt_tokens
        )
        self.scheduler.add(seq)

    @property
    def outstanding(self) -> int:
        return len(self.records)

    # -- live settings (the admin API) ----------------------------------------------------------------
    def update_config(self, **changes: int) -> str | None:
        """As `Engine.update_config`, by the same rule (`knobs.live_refusal`): the message for a value
        outside [the knob's minimum, its ceiling], else None (applied at the next step)."""
        ceilings = self.limits.ceilings
        limits = live_limits(lambda knob: getattr(ceilings, knob.name))
        for name, value in changes.items():
            why = live_refusal(limits, name, value)
            if why is not None:
                return why
        self.pending.update(changes)
        return None

    def live_config(self) -> LiveConfig:
        return LiveConfig(**{**self.live.as_dict(), **self.pending})

    # -- the step ---------------------------------------------------------------------------------------
    def start_step(self, now: float, horizon: float = float("inf")) -> Plan | None:
        if self.pending:
            self.live = self.live_config()
            self.pending.clear()
            self.scheduler.max_num_seqs = self.live.max_num_seqs
            self.scheduler.max_num_batched_tokens = self.live.max_num_batched_tokens
        if not self.scheduler.has_unfinished():
            return None
        if self.fast:
            run, cores = self._decode_run(now, horizon)
            if run:
                batch = len(self.scheduler.running)
                self.plan = Plan(now, None, run, cores, self.profile.server_s(batch), batch, 0)
                self.version += 1
                return self.plan
        proposals = self._propose()
        sched = self.scheduler.schedule()
        for seq in sched.finished:  # no room in the cache for its context: "length", as the engine ends it
            self._finish(seq, max(now, self.server_free_s), "length")  # after its tokens the server holds
        if sched.empty:
            return None
        decode = prefill = context = streams = verifying = 0
        for item in sched.scheduled:
            context += item.seq.num_computed_tokens
            streams += item.sample
            if item.sample and item.num_new_tokens == item.num_spec_tokens + 1:
                decode += item.num_new_tokens
                verifying += item.num_spec_tokens > 0
            else:
                prefill += item.num_new_tokens
            if (
                item.seq.first_scheduled_time is not None
                and self.records[item.seq.seq_id].first_scheduled_s is None
            ):
                self.records[item.seq.seq_id].first_scheduled_s = now
        p = self.profile
        core = p.core_s(decode, prefill, context, proposals, verifying)
        if self.adapters is not None:
            core += self.adapters.step_load_s(item.seq.lora for item in sched.scheduled)
            core += p.lora_s(*adapter_work((item.seq.lora, item.num_new_tokens) for item in sched.scheduled))
        d = p.period_s(core, self.server_free_s - now)
        durations, cores = [d], [core]
        server = p.server_s(streams)
        if self.fast and not prefill and not proposals and not sched.num_preemptions:
            more, more_cores = self._run_length(sched, now + d, horizon, server)
            durations += more
            cores += more_cores
        self.plan = Plan(now, sched, durations, cores, server, decode, proposals)
        self.version += 1
        return self.plan

    def cut(self, at: float) -> bool:
        """An arrival at `at`: a fast-mode run ends with the step in progress at `at` (later steps would have
        admitted the newcomer). True if the plan's end moved."""
        plan = self.plan
        if plan is None or len(plan.durations) == 1:
            return False
        t = plan.start
        for i, d in enumerate(plan.durations):
            t += d
            if t >= at:
                if i + 1 < len(plan.durations):
                    del plan.durations[i + 1 :]
                    del plan.cores[i + 1 :]
                    self.version += 1
                    return True
                return False
        return False

    def _decode_run(self, now: float, horizon: float) -> tuple[list[float], list[float]]:
        """Fast mode, before the scheduler: when every running sequence is decoding (one token to compute,
        no proposal), nobody can be admitted and the budget covers the batch, the scheduler's next steps
        are pure decode until the first finish, a full cache or the horizon: their durations and core
        seconds (empty when the scheduler must run)."""
        s = self.scheduler
        running = s.running
        if not running or (s.waiting and len(running) < s.max_num_seqs):
            return [], []
        if len(running) > s.max_num_batched_tokens:
            return [], []
        k = self.live.num_speculative_tokens
        guard = self.live.speculative_disable_by_batch_size
        if k and not speculation_off(len(running), len(s.waiting), s.max_num_seqs, guard):
            return [], []  # `_propose` would draw proposals: the scheduler's path
        targets = self.targets
        steps = None
        context = 0
        for q in running:
            n = len(q.token_ids)
            if q.num_computed_tokens != n - 1 or n <= q.num_prompt_tokens or q.spec_token_ids:
                return [], []
            left = targets[q.seq_id] - (n - q.num_prompt_tokens)
            steps = left if steps is None or left < steps else steps
            context += n - 1
        return self._durations(running, steps or 0, context, now, horizon, 0, self.server_free_s - now)

    def _durations(
        self,
        seqs: list[Sequence],
        steps: int,
        context: int,
        t: float,
        horizon: float,
        ahead: int,
        behind: float,
    ) -> tuple[list[float], list[float]]:
        """Up to `steps` pure-decode steps of `seqs` from `t` (context `context` at the first), as many as
        the cache holds without preempting anyone and as start before `horizon`: their durations and core
        seconds. `ahead`: tokens each sequence already holds beyond its computed ones; `behind`: the
        server's work left on the previous step's output at `t` (`Profile.period_s`)."""
        if steps <= 0:
            return [], []
        kv = self.kv
        free = kv.num_free_blocks
        bs = kv.block_size
        while steps > 0:  # a step allocates slots for every sequence's computed tokens plus one
            need = sum(
                max(0, -(-(q.num_computed_tokens + ahead + steps) // bs) - len(q.block_table)) for q in seqs
            )
            if need <= free:
                break
            steps //= 2
        batch = len(seqs)
        p = self.profile
        server = p.server_s(batch)  # every sequence streams a token in every step of the run
        # step j reads j * batch more context tokens than the first: `core_s` is linear in context, and
        # `core_s(batch) + context_s_per_token * c` is `core_s(batch, 0, c)` to the last bit
        base, per_token, period = p.core_s(batch), p.context_s_per_token, p.period_s
        base += p.lora_s(*adapter_work((q.lora, 1) for q in seqs))  # one token each, on its adapter
        out: list[float] = []
        cores: list[float] = []
        for j in range(steps):
            if t >= horizon:
                break
            core = base + per_token * (context + j * batch)
            d = period(core, behind)
            out.append(d)
            cores.append(core)
            t += d
            behind = server
        return out, cores

    def _run_length(
        self, sched: SchedulerOutput, t: float, horizon: float, server: float
    ) -> tuple[list[float], list[float]]:
        """Durations and core seconds of the identical decode steps that may follow this one (fast mode);
        `server`: the server's work on this step's output."""
        s = self.scheduler
        if len(sched.scheduled) != len(s.running) or (s.waiting and len(s.running) < s.max_num_seqs):
            return [], []
        seqs = [item.seq for item in sched.scheduled]
        # nothing may finish before the run's last step: the first finisher ends the run
        steps = min(self.targets[q.seq_id] - q.num_output_tokens for q in seqs) - 1
        # the scheduled step (not yet applied) adds one token to each sequence and to the context
        context = sum(q.num_computed_tokens for q in seqs) + len(seqs)
        return self._durations(seqs, steps, context, t, horizon, 1, server)

    def take_done(self) -> list[Record]:
        done, self.done = self.done, []
        return done

    def finish_step(self) -> list[Record]:
        """Apply the planned step(s) at their end; returns the records of requests that finished."""
        plan, self.plan = self.plan, None
        assert plan is not None
        sched = plan.sched
        if sched is None:  # a fast-mode decode run planned without the scheduler
            self.fast_runs += 1
            return self._repeat_decode(plan.start, plan.durations, plan.cores, plan.server_s)
        now = plan.start + plan.durations[0]
        sampled: list[list[int]] = []
        accepted_total = drafts = draft_tokens = 0
        per_pos = [0] * self.limits.max_k
        for item in sched.scheduled:
            if not item.sample:
                sampled.append([])
                continue
            n = self._accepted(
                item.num_spec_tokens,
                self.spec.get(item.seq.seq_id, self.default_spec).verified,
                self.draws.get(item.seq.seq_id, self.rng),
            )
            if item.num_spec_tokens:
                drafts += 1
                draft_tokens += item.num_spec_tokens
                accepted_total += n
                for i in range(n):
                    per_pos[i] += 1
            sampled.append([OUTPUT_ID] * (n + 1))
        changed = self.scheduler.update(sched, sampled)
        # the server takes the step's output now and sends its tokens when done with them
        self.server_free_s = sent = now + plan.server_s
        finished = self._emit(changed, sent)
        m = self.metrics
        m.counters["prompt_tokens"] += sched.num_prompt_tokens
        m.counters["generation_tokens"] += sum(n for _, n in changed)
        m.counters["spec_decode_drafts"] += drafts
        m.counters["spec_decode_draft_tokens"] += draft_tokens
        m.counters["spec_decode_accepted_tokens"] += accepted_total
        for i, c in enumerate(per_pos):
            if c:
                m.per_pos[i] += c
        m.histograms["step_duration_seconds"].observe(plan.cores[0])
        m.histograms["batch_size"].observe(len(sched.scheduled))
        if sched.scheduled and not sched.num_prompt_tokens:  # a decode step: apart too, as the engine's
            m.histograms["decode_step_duration_seconds"].observe(plan.cores[0])
            m.counters["decode_step_sequences"] += len(sched.scheduled)
            m.counters["decode_step_draft_tokens"] += draft_tokens
            m.counters["decode_step_drafts"] += drafts
        self.steps += 1
        if len(plan.durations) > 1:
            self.fast_runs += 1
            finished += self._repeat_decode(now, plan.durations[1:], plan.cores[1:], plan.server_s)
        return finished

    def _repeat_decode(
        self, start: float, durations: list[float], cores: list[float], server: float
    ) -> list[Record]:
        """A fast-mode run's further steps, all at once: each running sequence gains one token per step,
        exactly as the scheduler would have given it (room checked by `_durations`); only the last step
        can finish a sequence. Its tokens reach their clients `server` after each step's end; the gaps
        between them are the steps' periods (the first also moves by the change in the server's work from
        the step before the run: left out of `itl_max` and the kept ITLs, as the run's histograms are)."""
        n, end = len(durations), start + sum(durations)
        self.server_free_s = sent = end + server
        longest = max(durations)
        finished = []
        kv, bs, records, targets = self.kv, self.kv.block_size, self.records, self.targets
        tokens = [OUTPUT_ID] * n
        batch = len(self.scheduler.running)
        for seq in list(self.scheduler.running):
            computed = seq.num_computed_tokens
            if -(-(computed + n) // bs) > len(seq.block_table):  # else `allocate` would add no block
                kv.allocate(seq, computed + n)
            seq.token_ids.extend(tokens)
            seq.num_computed_tokens = computed + n
            if (computed + n) // bs > computed // bs:  # else no block filled up for the prefix cache
                kv.cache_full_blocks(seq)
            rec = records[seq.seq_id]
            rec.itl_sum += sent - rec.last_emit_s
            rec.itl_count += n
            if longest > rec.itl_max:
                rec.itl_max = longest
            if self.keep_itls:
                rec.itls.extend(durations)
            rec.last_emit_s = sent
            if len(seq.token_ids) - seq.num_prompt_tokens >= targets[seq.seq_id]:
                finished.append(self._finish(seq, sent, "length"))
        m = self.metrics
        m.counters["generation_tokens"] += batch * n
        # the run's steps differ only by their growing context: observed at their mean (a 1% bucket of the
        # ITL percentiles, a step-duration bucket apart at most)
        mean = (end - start) / n
        # the step histogram holds the core's seconds, as the engine's own does (the same when none waited)
        core = mean if cores == durations else sum(cores) / n
        m.histograms["step_duration_seconds"].observe(core, n)
        m.histograms["decode_step_duration_seconds"].observe(core, n)  # a run's steps are decode steps
        m.counters["decode_step_sequences"] += batch * n
        self.itl_hist.observe(mean, batch * n)
        m.histograms["batch_size"].observe(batch, n)
        self.steps += n
        return finished

    def _emit(self, changed: list[tuple[Sequence, int]], now: float) -> list[Record]:
        finished = []
        for seq, _ in changed:
            rec = self.records[seq.seq_id]
            if rec.first_token_s is None:
                rec.first_token_s = now
                rec.cached_tokens = seq.num_cached_tokens
            else:
                gap = now - rec.last_emit_s
                self.itl_hist.observe(gap)
                rec.itl_sum += gap
                rec.itl_count += 1
                rec.itl_max = max(rec.itl_max, gap)
                if self.keep_itls:
                    rec.itls.append(gap)
            rec.last_emit_s = now
            target = self.targets[seq.seq_id]
            if seq.num_output_tokens >= target:
                del seq.token_ids[seq.num_prompt_tokens + target :]
                finished.append(self._finish(seq, now, "length"))
        return finished

    def _finish(self, seq: Sequence, now: float, reason: str) -> Record:
        self.scheduler.finish(seq, reason)
        rec = self.records.pop(seq.seq_id)
        self.targets.pop(seq.seq_id)
        self.spec.pop(seq.seq_id, None)
        self.draws.pop(seq.seq_id, None)
        rec.finish_s, rec.finish_reason, rec.preemptions = now, reason, seq.num_preemptions
        rec.output_tokens = seq.num_output_tokens
        self.done.append(rec)
        m = self.metrics
        m.requests += 1
        h = m.histograms
        e2e = now - rec.engine_arrival_s
        h["e2e_request_latency_seconds"].observe(e2e)
        if rec.first_scheduled_s is not None:
            h["request_queue_time_seconds"].observe(rec.first_scheduled_s - rec.engine_arrival_s)
        if rec.first_token_s is not None:
            h["time_to_first_token_seconds"].observe(rec.first_token_s - rec.engine_arrival_s)
            if rec.output_tokens > 1:
                h["time_per_output_token_seconds"].observe(
                    (now - rec.first_token_s) / (rec.output_tokens - 1)
                )
        return rec

    # -- speculation ------------------------------------------------------------------------------------
    def _propose(self) -> int:
        """As `Engine._propose`: up to k placeholder proposals per decoding sequence, by the engine's own
        rules (`spec_decode/rules.py`: the batch guard, the k-room rule, the proposal length); the
        profile's proposal share decides which get any."""
        k_live = self.live.num_speculative_tokens
        s = self.scheduler
        guard = self.live.speculative_disable_by_batch_size
        if not k_live or speculation_off(len(s.running), len(s.waiting), s.max_num_seqs, guard):
            self._shadow_look()
            return 0
        total = eligible = 0
        max_len, ceiling, targets = self.limits.max_model_len, self.limits.max_k, self.targets
        spec, default, draws = self.spec, self.default_spec, self.draws
        for seq in s.running:
            if seq.in_prefill:
                continue
            share, q, _ = spec.get(seq.seq_id, default)
            room = k_room(max_len, seq.num_tokens, targets[seq.seq_id] - seq.num_output_tokens)
            k = proposal_length(k_live, room, ceiling)
            eligible += k > 0
            rng = draws.get(seq.seq_id, self.rng)
            if k and (share >= 1.0 or rng.random() < share):
                if q < 1.0:  # the lookup's match has fewer tokens after it than k
                    n = 1
                    while n < k and rng.random() < q:
                        n += 1
                    k = n
                seq.spec_token_ids = [-1] * k
                total += k
        if not eligible:
            self._shadow_look()
        return total

    def _shadow_look(self) -> None:
        """The engine's shadow lookups on a step that verifies no drafts (sim/shadow.py); fast mode's
        planned runs make none (fewer lookups, the same acceptance in distribution)."""
        shadow = self.shadow
        if shadow is None:
            return
        shadow.look(self.scheduler.running)
        c = self.metrics.counters
        c["spec_decode_shadow_lookups"], c["spec_decode_shadow_drafts"] = shadow.lookups, shadow.drafts
        self.metrics.shadow_per_pos.update(enumerate(shadow.accepted_per_pos))

    @staticmethod
    def _accepted(k: int, verified: list[float], rng: random.Random) -> int:
        n = 0
        while n < k and rng.random() < verified[min(n, len(verified) - 1)]:
            n += 1
        return n

    def snapshot(self, now: float):
        s = self.scheduler
        return self.metrics.snapshot(now, len(s.running), len(s.waiting), self.kv.usage(), self.live)


class _Speculation(NamedTuple):
    """How a request speculates: its proposal share, `proposal_continue` and P(position i accepted | it
    holds position i and i - 1 was accepted)."""

    share: float
    proposal_continue: float
    verified: list[float]


def _verified(conditional: list[float], q: float) -> list[float]:
    """The conditional acceptance given that the proposal holds the position (its length drawn in
    `_propose`): the measured per-position rates count a draft too short for a position as not accepting it."""
    return [min(1.0, c / q) if i else c for i, c in enumerate(conditional)]


def _conditional(per_pos: tuple[float, ...]) -> list[float]:
    """P(position i accepted | position i-1 accepted) from P(position i accepted | a draft); positions
    past the measured ones keep the last ratio."""
    out, previous = [], 1.0
    for a in per_pos:
        out.append(min(1.0, a / previous) if previous > 0 else 0.0)
        previous = a
    return out or [0.0]
