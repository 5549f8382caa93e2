"""The tenants' pieces without a socket: the tenants file and its refusals, key lookup by digest, the token
buckets (with a hand-driven clock), OpenAI's header math, the token estimate and the usage tap."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from specfleet.router.quota import WINDOW_S, LocalLimiter, Verdict, go_duration
from specfleet.router.tenant_gate import estimate_tokens
from specfleet.router.tenants import (
    PRIORITY_CLASSES,
    InvalidTenants,
    Tenant,
    TenantSpec,
    TenantTable,
    load_tenants_file,
)
from specfleet.router.usage_tap import UsageTap

KEY_A = "sk-team-a-0123456789abcdef"
KEY_B = "sk-team-b-0123456789abcdef"


def tenant(name: str = "team-a", rpm: int = 0, tpm: int = 0, **extra: object) -> Tenant:
    spec = TenantSpec.model_validate({"name": name, "keys": [KEY_A], "rpm": rpm, "tpm": tpm, **extra})
    return Tenant.of(spec)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_tenants_file_is_read_and_keys_are_kept_as_digests(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(
        f"tenants:\n"
        f"  - {{name: team-a, keys: [{KEY_A}], models: [alpha], rpm: 60, tpm: 1000, priority: interactive}}\n"
        f"  - {{name: team-b, keys: [{KEY_B}]}}\n"
    )
    a, b = load_tenants_file(path)
    assert (a.rpm, a.tpm, a.models, a.priority) == (
        60,
        1000,
        frozenset({"alpha"}),
        PRIORITY_CLASSES["interactive"],
    )
    assert (b.rpm, b.tpm, b.models, b.priority) == (0, 0, frozenset(), 0)
    assert KEY_A.encode() not in repr(a).encode() and all(len(d) == 32 for d in a.digests)
    table = TenantTable([a, b])
    assert table.find(KEY_A) is a and table.find(KEY_B) is b
    assert table.find(KEY_A + "x") is None and table.find("") is None
    assert a.allows("alpha") and not a.allows("beta") and b.allows("anything")


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("{name: Team_A, keys: [" + KEY_A + "]}", "tenants[0].name"),
        ("{name: team-a, keys: [short]}", "tenants[0].keys: Value error, a key of 5 characters is too short"),
        ("{name: team-a, keys: [" + KEY_A + "], rpm: -1}", "tenants[0].rpm"),
        ("{name: team-a, keys: [" + KEY_A + "], priority: urgent}", "unknown priority class 'urgent'"),
        ("{name: team-a, keys: [" + KEY_A + "], budget: 5}", "tenants[0].budget"),
        ("{name: team-a}", "tenants[0].keys"),
    ],
)
def test_an_invalid_tenant_is_refused_naming_its_field(tmp_path: Path, entry: str, says: str) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(f"tenants:\n  - {entry}\n")
    with pytest.raises(InvalidTenants) as refused:
        load_tenants_file(path)
    assert says in str(refused.value) and str(path) in str(refused.value)
    assert KEY_A not in str(refused.value)  # the field is named, the key is not echoed


def test_two_tenants_may_not_share_a_name_or_a_key(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(f"tenants:\n  - {{name: a, keys: [{KEY_A}]}}\n  - {{name: b, keys: [{KEY_A}]}}\n")
    with pytest.raises(InvalidTenants, match="tenants 'a' and 'b' share a key"):
        load_tenants_file(path)
    path.write_text(f"tenants:\n  - {{name: a, keys: [{KEY_A}]}}\n  - {{name: a, keys: [{KEY_B}]}}\n")
    with pytest.raises(InvalidTenants, match="tenant 'a' is given twice"):
        load_tenants_file(path)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.02, "20ms"), (0.0001, "1ms"), (1, "1s"), (1.5, "1.5s"), (59.9996, "1m0s"), (360, "6m0s")],
)
def test_reset_durations_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


def test_the_request_bucket_admits_its_limit_then_refills_one_per_interval() -> None:
    clock = Clock()
    limiter = LocalLimiter(clock=clock)
    t = tenant(rpm=3)
    verdicts = [limiter.check(t, 10) for _ in range(4)]
    assert [v.allowed for v in verdicts] == [True, True, True, False]
    assert [v.remaining_requests for v in verdicts] == [2, 1, 0, 0]
    refused = verdicts[-1]
    # one request comes back every 60 s / 3 = 20 s: that is the wait, and the bucket is full after 60 s
    assert refused.retry_after_s == pytest.approx(20.0)
    assert refused.headers() == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
        "Retry-After": "20",
    }
    clock.now += 19.9
    assert not limiter.check(t, 10).allowed
    clock.now += 0.1
    assert limiter.check(t, 10).allowed


def test_an_edit_of_the_limits_keeps_what_the_tenant_used() -> None:
    """The tenants file read again with new limits: what the tenant used of the old ones stays used (an
    edit does not hand out a full minute anew); a limit added where there was none starts full."""
    clock = Clock()
    limiter = LocalLimiter(clock=clock)
    assert all(limiter.check(tenant(rpm=2), 100).allowed for _ in range(2))
    raised = tenant(rpm=3, tpm=1000)
    assert [limiter.check(raised, 100).allowed for _ in range(2)] == [True, False]  # 2 of 3 already used
    assert limiter.check(raised, 0).remaining_tokens == 900
    lowered = tenant(rpm=3, tpm=500)
    verdict = limiter.check(lowered, 450)  # 100 of the tokens used: 400 left of 500
    assert not verdict.allowed and not verdict.too_large
    clock.now += WINDOW_S
    assert limiter.check(lowered, 450).allowed  # refilled to the new limit


def test_the_token_bucket_charges_the_estimate_and_settles_to_the_usage() -> None:
    clock = Clock()
    limiter = LocalLimiter(clock=clock)
    t = tenant(tpm=1000)
    first = limiter.check(t, 600)
    assert first.allowed and first.remaining_tokens == 400
    assert not limiter.check(t, 600).allowed  # 600 > the 400 left
    asyncio.run(limiter.settle(t, None, -500))  # the request used 100, not 600
    second = limiter.check(t, 600)
    assert second.allowed and second.remaining_tokens == 300
    too_large = limiter.check(t, 1001)
    assert not too_large.allowed and too_large.too_large and "Retry-After" not in too_large.headers()
    assert too_large.headers()["x-ratelimit-limit-tokens"] == "1000"


def test_local_buckets_hold_a_share_of_the_limit_per_replica() -> None:
    clock = Clock()
    limiter = LocalLimiter(replicas=2, clock=clock)
    t = tenant(rpm=10)
    admitted = sum(limiter.check(t, 0).allowed for _ in range(10))
    assert admitted == 5  # two replicas, each half of 10 a minute
    clock.now += WINDOW_S  # refilled
    limiter.set_replicas(1)  # the other replica is gone: this one holds the whole limit
    assert sum(limiter.check(t, 0).allowed for _ in range(12)) == 10


def test_verdict_headers_leave_out_limits_a_tenant_does_not_have() -> None:
    v = Verdict(True, 0, 5000, 0, 4200, 0.0, 12.0)
    assert v.headers() == {
        "x-ratelimit-limit-tokens": "5000",
        "x-ratelimit-remaining-tokens": "4200",
        "x-ratelimit-reset-tokens": "12s",
    }


def test_the_estimate_counts_the_prompt_and_max_tokens_per_choice() -> None:
    assert estimate_tokens({"prompt": "abcdefgh", "max_tokens": 5}, None) == 2 + 5  # 8 bytes / 4
    assert estimate_tokens({"prompt": "abcdefghi", "max_tokens": 5, "n": 3}, None) == 3 + 15
    assert estimate_tokens({"prompt": ["abcd", "abcd"]}, None) == 2
    assert estimate_tokens({"prompt": [1, 2, 3], "max_completion_tokens": 4}, None) == 7
    assert estimate_tokens({"prompt": [[1, 2], [3]]}, None) == 3
    assert estimate_tokens({"input": ["abcd", "abcdefgh"]}, None) == 3  # embeddings
    assert estimate_tokens({"input": "abcd"}, None) == 1
    words = estimate_tokens({"prompt": "one two three"}, lambda text: text.split())  # the router's tokenizer
    assert words == 3
    chat = {"messages": [{"role": "user", "content": "héllo"}], "max_tokens": 1}
    assert estimate_tokens(chat, None) == 3 + 1  # "user\nhéllo\n": 12 bytes of UTF-8


def stream_events(usage: bool) -> list[bytes]:
    null = ',"usage":null' if usage else ""
    events = [f'data: {{"choices":[{{"text":"{w}"}}]{null}}}\n\n'.encode() for w in ("a", "b")]
    if usage:
        events.append(
            b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
        )
    return [*events, b"data: [DONE]\n\n"]


def test_the_tap_reads_a_streams_usage_and_strips_it_when_the_client_did_not_ask() -> None:
    raw = b"".join(stream_events(usage=True))
    for cut in range(1, len(raw)):  # any split of the stream into two chunks
        tap = UsageTap(stream=True, strip=True)
        out = tap.feed(raw[:cut]) + tap.feed(raw[cut:]) + tap.flush()
        assert out == b"".join(stream_events(usage=False)) and tap.total_tokens() == 5
    kept = UsageTap(stream=True, strip=False)
    assert kept.feed(raw) + kept.flush() == raw and kept.total_tokens() == 5


def test_the_tap_reads_the_usage_among_tokens_that_spell_it() -> None:
    """A run of events whose every `"usage"` is the engine's null passes without a parse; a token whose text
    is `usage` (or holds `"usage"`) is no usage, and the real usage event after it is still read."""
    words = [b'"usage"', b"usage", b"a"]
    events = [
        b'data: {"choices":[{"text":%s}],"usage":null}\n\n' % json.dumps(w.decode()).encode() for w in words
    ]
    final = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6}}\n\n'
    raw = b"".join([*events, final, b"data: [DONE]\n\n"])
    stripped = b"".join([e.replace(b',"usage":null', b"") for e in events] + [b"data: [DONE]\n\n"])
    for cut in range(1, len(raw)):
        tap = UsageTap(stream=True, strip=True)
        assert tap.feed(raw[:cut]) + tap.feed(raw[cut:]) + tap.flush() == stripped and tap.total_tokens() == 6
        kept = UsageTap(stream=True, strip=False)
        assert kept.feed(raw[:cut]) + kept.feed(raw[cut:]) + kept.flush() == raw and kept.total_tokens() == 6


def test_the_tap_reads_a_whole_answers_usage_and_passes_it_unchanged() -> None:
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 6}}).encode()
    tap = UsageTap(stream=False, strip=False)
    assert tap.feed(body[:10]) + tap.feed(body[10:]) + tap.flush() == body
    assert tap.total_tokens() == 10
    error = UsageTap(stream=True, strip=True)  # a stream refused with a JSON error: passed on at the end
    assert error.feed(b'{"error": {}}') == b"" and error.flush() == b'{"error": {}}'
    assert error.total_tokens() is None
