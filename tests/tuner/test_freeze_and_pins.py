"""The SRE's brakes on the tuning loop (`ServiceTuner.tick`), over the synthetic fleet of `plant.py`:
frozen, it changes and pushes nothing, even over a config set by hand, and resumes after; a pinned knob never
moves while the others do; entering and leaving a freeze or a metrics outage is reported once each.

The engines are the plant plus a fake of the admin API at its edge (`PlantEngines`: what `PATCH
/admin/config` would set is what the plant runs next); the real admin API is exercised in
test_scrape_actuate.py and test_kopf_timer.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from specfleet.operator import load_inference_service
from specfleet.tuner.actuator import ApplyResult
from specfleet.tuner.loop import ServiceTuner, Tick, params_from_spec, spec_config
from specfleet.tuner.policy import Policy, PolicyParams
from specfleet.tuner.report import event_for, status_patch, transition_events, tuned_condition
from specfleet.tuner.types import SLO, LiveSettings, Observation, TuneBounds, TunedConfig

from .plant import Plant

INTERVAL = 10.0
PARAMS = PolicyParams(
    slo=SLO(ttft_p95_s=2.0, tpot_p95_s=0.2),
    bounds=TuneBounds(k=(0, 8), max_num_seqs=(4, 64), max_num_batched_tokens=(256, 4096)),
    window_s=INTERVAL,
    interval_s=INTERVAL,
)
URL = "http://engine-0:8000"


@dataclass
class PlantEngines:
    """One engine's live config, the admin API's effect on it, and the plant it serves."""

    plant: Plant
    running: TunedConfig
    t: float = 0.0
    pushes: list[TunedConfig] = field(default_factory=list)
    down: bool = False  # the source cannot read the metrics
    ready: bool = True  # the engine pod is ready (False: scaled to zero, or still starting)

    async def observe(self) -> Observation:
        self.t += INTERVAL
        if self.down:
            return Observation(self.t, None, error="Prometheus unreachable")
        return self.plant.observe(self.t, self.running)

    async def endpoints(self) -> list[str]:
        return [URL] if self.ready else []

    async def ensure(self, urls: list[str], settings: TunedConfig | LiveSettings) -> ApplyResult:
        config = settings.config if isinstance(settings, LiveSettings) else settings
        result = ApplyResult(config)
        if config == self.running:
            result.unchanged.append(URL)
        else:
            self.running = config
            self.pushes.append(config)
            result.patched.append(URL)
        return result

    async def close(self) -> None:
        return None


def loop(engines: PlantEngines, params: PolicyParams = PARAMS) -> ServiceTuner:
    return ServiceTuner(
        "ns/svc",
        Policy(params, engines.running),
        engines,
        engines,
        engines.endpoints,
    )


def ticks(tuner: ServiceTuner, n: int, frozen_by: str | None = None) -> list[Tick]:
    return [asyncio.run(tuner.tick(frozen_by)) for _ in range(n)]


def test_frozen_the_loop_changes_and_pushes_nothing_and_resumes_after() -> None:
    # low load, high acceptance: unfrozen, the policy raises k from 0 (test_policy.py)
    engines = PlantEngines(Plant(demand=1), TunedConfig(0, 16, 512))
    tuner = loop(engines)
    frozen = ticks(tuner, 8, frozen_by="annotation specfleet.io/tuner-freeze=true")
    assert engines.pushes == [] and engines.running == TunedConfig(0, 16, 512)
    assert all(t.decision.kind == "frozen" and not t.decision.changed and t.applied is None for t in frozen)
    assert [t.transitions for t in frozen] == [("frozen",)] + [()] * 7
    assert "frozen by annotation specfleet.io/tuner-freeze=true" in frozen[0].decision.reason

    engines.running = hand_set = TunedConfig(1, 8, 512)  # set by hand through the admin API mid-incident
    assert all(t.decision.kind == "frozen" for t in ticks(tuner, 3, frozen_by="spec.autotune.freeze"))
    assert engines.running == hand_set and engines.pushes == []  # the tuner does not fight the SRE

    resumed = ticks(tuner, 12)
    assert resumed[0].transitions == ("resumed",)
    assert all(t.transitions == () for t in resumed[1:])
    assert engines.pushes, "no push after the freeze was lifted"
    assert engines.running.num_speculative_tokens > 1, [t.decision.reason for t in resumed]
    assert any(t.decision.changed for t in resumed)


def test_the_frozen_status_shows_who_froze_it_and_what_runs() -> None:
    engines = PlantEngines(Plant(demand=1), TunedConfig(2, 16, 512))
    tuner = loop(engines)
    (tick,) = ticks(tuner, 1, frozen_by="spec.autotune.freeze")
    cond = tuned_condition(tick)
    assert (cond.status, cond.reason) == ("False", "Frozen")
    status = status_patch(tick, tuner.policy.current, {}, 3, "2026-01-01T00:00:00Z")
    assert (
        status["tuning"]["frozenBy"] == "spec.autotune.freeze"
        and status["tuning"]["numSpeculativeTokens"] == 2
    )
    assert transition_events(tick) == [("Normal", "TuningFrozen", tick.decision.reason)]
    (after,) = ticks(tuner, 1)
    resumed = status_patch(after, tuner.policy.current, status, 3, "2026-01-01T00:00:10Z")
    assert "frozenBy" not in resumed["tuning"]  # left out of the tuner's apply: the field goes
    assert [e[1] for e in transition_events(after)] == ["TuningResumed"]


def test_a_pinned_knob_never_changes_while_the_others_do() -> None:
    doc = {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "p"},
        "spec": {
            "model": {"source": "bundled://smollm2-135m-instruct"},
            "batching": {"maxNumSeqs": 64, "maxNumBatchedTokens": 2048},
            "speculative": {"method": "ngram", "numSpeculativeTokens": 4},
            "slo": {"ttftP95Ms": 2000, "tpotP95Ms": 200},
            "autotune": {
                "enabled": True,
                "intervalSeconds": 10,
                "pins": {"numSpeculativeTokens": 4},
                "bounds": {
                    "numSpeculativeTokens": [0, 8],
                    "maxNumSeqs": [4, 64],
                    "maxNumBatchedTokens": [256, 4096],
                },
            },
        },
    }
    spec = load_inference_service(doc).spec
    params = params_from_spec(spec)
    assert params.bounds.k == (4, 4)
    # high load with poor acceptance: unpinned, the policy turns k off (test_policy.py) and moves the batch
    engines = PlantEngines(Plant(demand=48, per_pos=(0.4, 0.25, 0.15, 0.1)), spec_config(spec))
    tuner = loop(engines, params)
    seen = ticks(tuner, 20)
    assert engines.pushes, [t.decision.reason for t in seen]
    assert {c.num_speculative_tokens for c in engines.pushes} == {4}
    assert {(c.max_num_seqs, c.max_num_batched_tokens) for c in engines.pushes} - {(64, 2048)}, (
        "nothing else moved"
    )

    unpinned = params_from_spec(
        spec.model_copy(
            update={"autotune": spec.autotune.model_copy(update={"pins": type(spec.autotune.pins)()})}
        )
    )
    control = PlantEngines(Plant(demand=48, per_pos=(0.4, 0.25, 0.15, 0.1)), spec_config(spec))
    ticks(loop(control, unpinned), 20)
    assert control.running.num_speculative_tokens != 4  # the pin, not the load, held k


def test_failing_static_and_recovering_are_reported_once_each() -> None:
    engines = PlantEngines(Plant(demand=1), TunedConfig(0, 16, 512))
    tuner = loop(engines)
    first = ticks(tuner, 2)
    engines.down = True
    outage = ticks(tuner, 3)
    engines.down = False
    back = ticks(tuner, 2)
    assert [t.transitions for t in first + outage + back] == [(), (), ("static",), (), (), ("recovered",), ()]
    assert all(t.decision.kind == "missing" for t in outage)
    (static,) = transition_events(outage[0])
    assert static[:2] == ("Warning", "TuningStatic") and "Prometheus unreachable" in static[2]
    assert "fail static" in static[2]
    assert transition_events(back[0])[0][:2] == ("Normal", "TuningRecovered")


def test_no_ready_engine_is_idle_not_failing_static() -> None:
    """Scaled to zero (or pods still starting) there is no engine series: the tuner holds as `Idle` and
    counts no static interval, so SpecfleetTunerFailingStatic (`specfleet_tuner_static_intervals >= 10`)
    does not fire on a service that is meant to run nothing. Engines that run but cannot be observed still
    fail static."""
    engines = PlantEngines(Plant(demand=1), TunedConfig(0, 16, 512))
    tuner = loop(engines)
    ticks(tuner, 2)
    pushed = list(engines.pushes)
    engines.down, engines.ready = True, False  # scaled to zero: Prometheus has no series for the service
    zero = ticks(tuner, 12)
    assert all(t.decision.kind == "idle" and t.transitions == () for t in zero), [t.decision for t in zero]
    assert tuner.static_intervals == 0 and engines.pushes == pushed
    condition = tuned_condition(zero[-1])
    assert (condition.status, condition.reason) == ("True", "Idle")
    assert "no engine is ready" in condition.message
    engines.ready = True  # an engine is back but its series are not (a broken scrape): fail static
    outage = ticks(tuner, 10)
    assert outage[0].transitions == ("static",) and tuner.static_intervals == 10


def test_specfleet_up_freezes_from_the_yaml_or_while_its_freeze_file_exists(tmp_path) -> None:
    from specfleet.fleet.local import build_parser
    from specfleet.fleet.supervisor import LocalFleet

    doc = {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "f"},
        "spec": {"model": {"source": "bundled://smollm2-135m-instruct"}, "autotune": {"enabled": True}},
    }
    fleet = LocalFleet(load_inference_service(doc), log_dir=tmp_path)
    assert fleet.freeze_file == tmp_path / "tuner-freeze" and fleet.frozen_by is None
    fleet.freeze_file.touch()
    assert fleet.frozen_by == f"freeze file {tmp_path / 'tuner-freeze'}"
    fleet.freeze_file.unlink()
    assert fleet.frozen_by is None
    doc["spec"]["autotune"]["freeze"] = True
    assert LocalFleet(load_inference_service(doc), log_dir=tmp_path).frozen_by == "spec.autotune.freeze"
    args = build_parser().parse_args(["-f", "x.yaml", "--freeze-file", str(tmp_path / "ice")])
    assert args.freeze_file == str(tmp_path / "ice")


def test_the_events_of_a_change_say_how_to_stop_the_tuner() -> None:
    """`kubectl describe isvc` shows what the tuner changed and why (the decision's reason), and on every
    change the command that freezes it, whole even when a long reason fills the Event's message."""
    from specfleet.tuner.handlers import EVENT_MESSAGE_MAX, event_message

    engines = PlantEngines(Plant(demand=1), TunedConfig(0, 16, 512))
    tuner = loop(engines)
    change = next(t for t in ticks(tuner, 8) if t.decision.changed)  # low load: k goes up (test_policy.py)
    kind, reason, why = event_for(change.decision) or ("", "", "")
    command = "kubectl annotate isvc -n team-a chat specfleet.io/tuner-freeze=true"
    assert (kind, reason) == ("Normal", "Tuned") and "k=" in why
    assert event_message(reason, why, "team-a", "chat") == f"{why} [to stop tuning: {command}]"
    long = event_message("TuningReverted", "x" * 2000, "team-a", "chat")
    assert len(long) == EVENT_MESSAGE_MAX and long.endswith(f"[to stop tuning: {command}]")
    assert event_message("TuningFrozen", "frozen by ...", "team-a", "chat") == "frozen by ..."
