"""The canary split (router/weights.py), without I/O: exact shares per cycle without sessions, sticky and
proportional with sessions, and a weight change that moves only the sessions it must."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from specfleet.router.weights import Candidate, SmoothWeighted, WeightedSplit, session_pick

weights = st.lists(st.integers(0, 50), min_size=1, max_size=5).filter(lambda ws: sum(ws) > 0)


@settings(max_examples=200, deadline=None)
@given(weights, st.integers(1, 3))
def test_every_cycle_gives_each_service_exactly_its_weight(ws: list[int], cycles: int) -> None:
    candidates = [Candidate(f"ns/s{i}", w) for i, w in enumerate(ws)]
    rotation = SmoothWeighted()
    picks = Counter(rotation.pick(candidates) for _ in range(cycles * sum(ws)))
    assert picks == Counter({c.key: cycles * c.weight for c in candidates if c.weight})


def test_smooth_interleaves_rather_than_bursts() -> None:
    rotation = SmoothWeighted()
    candidates = [Candidate("ns/a", 5), Candidate("ns/b", 1), Candidate("ns/c", 1)]
    assert [rotation.pick(candidates) for _ in range(7)] == [
        "ns/a",
        "ns/a",
        "ns/b",
        "ns/a",
        "ns/c",
        "ns/a",
        "ns/a",
    ]


def test_nothing_to_pick_when_every_weight_is_zero() -> None:
    split = WeightedSplit()
    zero = [Candidate("ns/a", 0), Candidate("ns/b", 0)]
    assert split.pick("m", zero) is None and split.pick("m", zero, "session") is None


def test_sessions_stick_and_their_shares_follow_the_weights() -> None:
    candidates = [Candidate("ns/v1", 90), Candidate("ns/v2", 10)]
    picks = {f"user-{i}": session_pick(f"user-{i}", candidates) for i in range(20_000)}
    assert all(
        session_pick(s, candidates) == p for s, p in list(picks.items())[:500]
    )  # the same answer again
    share = Counter(picks.values())["ns/v2"] / len(picks)
    assert 0.09 < share < 0.11, share  # hashes of 20,000 ids: the 10% share within one point


def test_a_weight_change_moves_only_the_sessions_it_must() -> None:
    before = [Candidate("ns/v1", 50), Candidate("ns/v2", 50)]
    after = [Candidate("ns/v1", 50), Candidate("ns/v2", 150)]  # the canary triples
    moved = [(session_pick(s, before), session_pick(s, after)) for s in (f"s{i}" for i in range(5000))]
    changed = Counter((a, b) for a, b in moved if a != b)
    assert set(changed) == {("ns/v1", "ns/v2")}  # nobody leaves the service that gained weight
    share = sum(1 for _, b in moved if b == "ns/v2") / len(moved)
    assert 0.72 < share < 0.78, share  # 150 / 200


def test_each_model_has_its_own_rotation() -> None:
    split = WeightedSplit()
    two = [Candidate("ns/a", 1), Candidate("ns/b", 1)]
    assert [split.pick("x", two), split.pick("y", two), split.pick("x", two)] == ["ns/a", "ns/a", "ns/b"]
