"""The engine's request phases from the times the core sent back (engine/server/tracing.py `phases`): what
the `llm_request` span's children are for an aggregated request, a prefill engine's one-token request, a
decode engine's pulled request, a pull that fell back to a local prefill, and a request aborted in the queue."""

from __future__ import annotations

from specfleet.engine.outputs import KVTransferMetrics
from specfleet.engine.server.tracing import phases


def spans(result: list) -> list[tuple[str, float, float]]:
    return [(p.name, p.start, p.end) for p in result]


def pull(start: float, end: float, fallback: bool = False) -> KVTransferMetrics:
    return KVTransferMetrics(start, end, 0 if fallback else 3, 1, 0 if fallback else 4096, fallback, "h:1")


def test_an_aggregated_request_queues_prefills_and_decodes() -> None:
    assert spans(phases(10.0, 10.5, 11.0, 13.0, output_tokens=8, kv=None)) == [
        ("queue", 10.0, 10.5),
        ("prefill", 10.5, 11.0),
        ("decode", 11.0, 13.0),
    ]


def test_a_prefill_engine_s_one_token_request_has_no_decode() -> None:
    assert spans(phases(10.0, 10.1, 10.4, 10.4, output_tokens=1, kv=None)) == [
        ("queue", 10.0, 10.1),
        ("prefill", 10.1, 10.4),
    ]


def test_a_decode_engine_s_pulled_request_waits_pulls_and_decodes_without_a_prefill() -> None:
    result = phases(10.0, 10.6, 10.7, 12.0, output_tokens=5, kv=pull(10.2, 10.55))
    assert spans(result) == [("queue", 10.0, 10.2), ("kv_transfer", 10.2, 10.55), ("decode", 10.6, 12.0)]
    assert result[1].attributes["specfleet.kv.blocks_loaded"] == 3
    assert result[1].attributes["specfleet.kv.blocks_skipped"] == 1
    assert result[1].attributes["specfleet.kv.fallback"] is False


def test_a_pull_that_failed_shows_the_local_prefill_that_replaced_it() -> None:
    result = phases(10.0, 11.0, 11.5, 12.0, output_tokens=3, kv=pull(10.2, 10.9, fallback=True))
    assert spans(result) == [
        ("queue", 10.0, 10.2),
        ("kv_transfer", 10.2, 10.9),
        ("prefill", 11.0, 11.5),
        ("decode", 11.5, 12.0),
    ]
    assert result[1].attributes["specfleet.kv.fallback"] is True


def test_a_request_aborted_in_the_queue_has_only_its_wait() -> None:
    assert spans(phases(10.0, None, None, 10.3, output_tokens=0, kv=None)) == [("queue", 10.0, 10.3)]
