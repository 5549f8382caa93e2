"""The stream relay's byte path (router/resume.py, `StreamRelay._as_they_came`: a run of events passed on
after a few scans over the whole run) against its per-event path, the oracle: on generated streams (compact
and spaced JSON, with and without token ids, aborted, a dead engine, a second choice, finished or cut before
[DONE]) fed in pieces of random sizes, the client gets the same bytes and the relay ends in the same state."""

from __future__ import annotations

import json
import random

import pytest
from specfleet.router.policies import RouteRequest
from specfleet.router.resume import StreamRelay


def stream(rng: random.Random) -> list[bytes]:
    """One engine's answer as SSE events."""
    spaced = rng.random() < 0.2  # an engine whose JSON is not compact
    ids = rng.random() < 0.5  # an engine that sends the token ids the router asked for
    out = []
    count = rng.randint(1, 40)
    for i in range(count):
        choice: dict[str, object] = {
            "index": 0,
            "text": rng.choice([" a", " b", '": x', " [DONE]"]),
            "finish_reason": None,
        }
        if ids:
            choice["token_ids"] = [rng.randint(0, 999) for _ in range(rng.randint(1, 3))]
        last = i == count - 1
        if last:
            choice["finish_reason"] = rng.choice(["length", "stop", "abort", None])
        data: dict[str, object] = {"id": "cmpl-1", "created": 7, "choices": [choice]}
        if rng.random() < 0.02:
            data = {"error": {"message": "gone", "type": "engine_dead", "code": "engine_dead"}}
        elif rng.random() < 0.02:
            data["choices"] = [choice, {**choice, "index": 1}]
        text = json.dumps(data) if spaced else json.dumps(data, separators=(",", ":"))
        out.append(b"data: " + text.encode() + b"\n\n")
    if rng.random() < 0.8:
        out.append(b"data: [DONE]\n\n")
    return out


def relay_all(pieces: list[bytes], fast: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, StreamRelay]:
    with monkeypatch.context() as patch:
        if not fast:
            patch.setattr(StreamRelay, "_as_they_came", lambda self, events: None)
        relay = StreamRelay({"prompt": "p", "stream": True}, (RouteRequest(), set(), {}))
        out = b"".join(relay.feed(piece) for piece in pieces)
    return out, relay


@pytest.mark.parametrize("seed", range(4))
def test_the_byte_path_passes_on_what_the_per_event_path_does(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    for _ in range(100):
        data = b"".join(stream(rng))
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 4))))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        if rng.random() < 0.3:
            pieces = [data]  # the whole answer in one read, as a fast engine on loopback delivers it
        fast, fast_relay = relay_all(pieces, True, monkeypatch)
        slow, slow_relay = relay_all(pieces, False, monkeypatch)
        assert fast == slow
        for name in ("token_ids", "identity", "forwarded", "finished", "done", "cut"):
            assert getattr(fast_relay, name) == getattr(slow_relay, name), name


def test_a_run_with_token_ids_takes_the_byte_path_and_its_ids_are_read_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = [
        b'data: {"id":"c","created":1,"choices":[{"index":0,"text":"%d","finish_reason":null,'
        b'"token_ids":[%d,%d]}]}\n\n' % (i, 2 * i, 2 * i + 1)
        for i in range(20)
    ]
    per_event: list[bytes] = []
    event = StreamRelay._event

    def counted(self: StreamRelay, data: bytes) -> bytes | None:
        per_event.append(data)
        return event(self, data)

    monkeypatch.setattr(StreamRelay, "_event", counted)
    relay = StreamRelay({"prompt": "p", "stream": True}, (RouteRequest(), set(), {}))
    out = relay.feed(b"".join(events) + b"data: [DONE]\n\n")
    assert per_event == []  # the first event too: its identity is read only if a resume needs it
    assert relay._identity is None and relay.identity == {"id": "c", "created": 1}
    assert relay._unread_ids and b"token_ids" not in out and out.count(b"\n\n") == 21
    assert relay.token_ids == list(range(40)) and not relay._unread_ids and relay.done
