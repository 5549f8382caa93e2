"""Prefill/decode disaggregation through the KV connector (ZeroMQ over loopback), two in-process engines:
the pair's greedy output equals one aggregated engine's token for token, and no KV block leaks."""

from __future__ import annotations

import time

import pytest
import torch
from specfleet.engine.kv_transfer.blocks import read_blocks, write_blocks
from specfleet.engine.kv_transfer.pair import generate_disaggregated
from specfleet.engine.llm_engine import Engine
from specfleet.engine.sampling_params import ParameterError, SamplingParams

BLOCK = 4
COMMON = dict(block_size=BLOCK, num_kv_blocks=96, max_model_len=256, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts() -> list[list[int]]:
    # Lengths on and off block boundaries (8 = 2 blocks exactly, so the first decode needs a fresh block),
    # a one-token prompt, and repetitive ones the n-gram proposer finds matches in.
    base = [(7 * i + 3) % 900 + 10 for i in range(40)]
    return [base[:8], base[:13], base[3:4], base[:10] * 3, base[5:29], [11, 12, 13, 14] * 5]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    engine = Engine(model=tiny_llama, **COMMON)
    ids = [f"r{i}" for i in range(len(_prompts()))]
    for request_id, prompt in zip(ids, _prompts()):
        engine.add_request(request_id, prompt, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [done[i] for i in ids]


@pytest.fixture
def prefill(tiny_llama):
    engine = Engine(model=tiny_llama, kv_role="prefill", **COMMON)
    yield engine
    engine.close()


def _decode(tiny_llama, **kwargs) -> Engine:
    return Engine(model=tiny_llama, kv_role="decode", **{**COMMON, **kwargs})


def _assert_no_leaks(*engines: Engine) -> None:
    for engine in engines:
        engine.poll_kv_transfers()
        assert engine.kv.num_used_blocks == 0, f"{engine.config.kv_role} engine leaked blocks"
        assert engine.kv_connector.num_holds == 0
        assert not engine.has_unfinished_requests()


def test_blocks_round_trip_all_layers_and_refuse_another_shape():
    shape = (10, BLOCK, 2, 8)
    src = [(torch.randn(shape), torch.randn(shape)) for _ in range(3)]
    dst = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(3)]
    data = read_blocks(src, [7, 2])
    write_blocks(dst, [0, 5], data)
    for (sk, sv), (dk, dv) in zip(src, dst):
        assert torch.equal(dk[0], sk[7]) and torch.equal(dv[5], sv[2])
        assert not dk[1].any()  # nothing else written
    with pytest.raises(ValueError, match="do not fit this cache"):
        write_blocks(dst[:2], [0, 5], data)


def test_pair_equals_aggregated_and_second_pass_hits_decode_prefix_cache(tiny_llama, prefill, reference):
    decode = _decode(tiny_llama)
    try:
        outs = generate_disaggregated(prefill, decode, _prompts(), GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference
        first = decode.kv_connector.stats
        assert first.transfers == len(reference) and first.blocks_loaded > 0 and first.fallbacks == 0
        loaded, skipped = first.blocks_loaded, first.blocks_skipped
        _assert_no_leaks(prefill, decode)

        again = generate_disaggregated(prefill, decode, _prompts(), GREEDY)
        assert [o.outputs[0].token_ids for o in again] == reference
        stats = decode.kv_connector.stats
        # Every full prompt block is now in the decoder's prefix cache: only partial tail blocks move.
        assert stats.blocks_skipped - skipped >= sum(len(p) // BLOCK for p in _prompts()) - 1
        assert stats.blocks_loaded - loaded < loaded
        assert any(o.num_cached_tokens for o in again)
        _assert_no_leaks(prefill, decode)
    finally:
        decode.close()


def test_ngram_speculation_on_the_decode_side(tiny_llama, prefill, reference):
    decode = _decode(tiny_llama, speculative_method="ngram", num_speculative_tokens=3)
    try:
        outs = generate_disaggregated(prefill, decode, _prompts(), GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert decode.stats.num_draft_tokens > 0  # the proposer did propose
        _assert_no_leaks(prefill, decode)
    finally:
        decode.close()


def test_prefill_engine_dead_after_first_token_decode_recomputes(tiny_llama, prefill, reference):
    prompt = _prompts()[4]
    prefill.add_request(
        "p", prompt, SamplingParams(temperature=0.0, max_tokens=1), {"do_remote_decode": True}
    )
    outs = []
    while prefill.has_unfinished_requests():
        outs += [o for o in prefill.step() if o.finished]
    params = outs[0].kv_transfer_params
    assert params is not None and params["num_blocks"] == -(-len(prompt) // BLOCK)
    assert prefill.kv.num_used_blocks == params["num_blocks"]  # held for the decoder
    prefill.kv_connector.producer.close()  # the prefill engine's server is gone: nothing will answer

    decode = _decode(tiny_llama, kv_transfer_timeout_s=0.3)
    try:
        decode.add_request("p", prompt, GREEDY, params)
        done = []
        while decode.has_unfinished_requests():
            done += [o for o in decode.step() if o.finished]
        assert done[0].outputs[0].token_ids == reference[4]
        assert decode.kv_connector.stats.fallbacks == 1
        assert decode.kv.num_used_blocks == 0
    finally:
        decode.close()


def test_abort_before_the_transfer_releases_both_sides(tiny_llama, prefill):
    decode = _decode(tiny_llama)
    try:
        prefill.add_request("a", _prompts()[4], SamplingParams(max_tokens=1), {"do_remote_decode": True})
        while prefill.has_unfinished_requests():
            (out,) = prefill.step() or [None]
        assert prefill.kv.num_used_blocks > 0
        decode.add_request("a", _prompts()[4], SamplingParams(max_tokens=5), out.kv_transfer_params)
        decode.abort("a")  # the client went away before the decode engine loaded the KV
        assert decode.kv.num_used_blocks == 0 and not decode.has_unfinished_requests()
        deadline = time.monotonic() + 5
        while prefill.kv.num_used_blocks and time.monotonic() < deadline:
            prefill.poll_kv_transfers()
            time.sleep(0.01)
        _assert_no_leaks(prefill, decode)
    finally:
        decode.close()


def test_hold_expires_when_no_decoder_comes(tiny_llama):
    engine = Engine(model=tiny_llama, kv_role="prefill", kv_transfer_timeout_s=0.2, **COMMON)
    try:
        engine.add_request("x", _prompts()[1], SamplingParams(max_tokens=1), {"do_remote_decode": True})
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.kv.num_used_blocks > 0
        time.sleep(0.3)
        _assert_no_leaks(engine)
    finally:
        engine.close()


def test_kv_transfer_params_are_validated(tiny_llama, prefill):
    with pytest.raises(ParameterError, match="max_tokens=1"):
        prefill.add_request("v", [5, 6, 7], SamplingParams(max_tokens=4), {"do_remote_decode": True})
    decode = _decode(tiny_llama)
    try:
        with pytest.raises(ParameterError, match="kv_role='prefill'"):
            decode.add_request("v", [5, 6, 7], SamplingParams(max_tokens=1), {"do_remote_decode": True})
        with pytest.raises(ParameterError, match="missing"):
            decode.add_request("v", [5, 6, 7], SamplingParams(max_tokens=4), {"remote_host": "127.0.0.1"})
        good = dict(
            remote_host="127.0.0.1",
            remote_port=1,
            transfer_id="t",
            num_tokens=3,
            num_blocks=1,
            first_token_id=9,
        )
        with pytest.raises(ValueError, match="do not match the prompt"):
            decode.add_request("v", [5, 6, 7, 8], SamplingParams(max_tokens=4), good)
        assert decode.kv.num_used_blocks == 0
    finally:
        decode.close()
    with pytest.raises(ValueError, match="kv_role='middle'"):
        Engine(model="bundled://smollm2-135m-instruct", kv_role="middle")
    with pytest.raises(ValueError, match="moves one process's cache"):
        Engine(model="bundled://smollm2-135m-instruct", kv_role="decode", tensor_parallel_size=3)


DECODER = """
import json, sys
from specfleet.engine.llm_engine import Engine
from specfleet.engine.sampling_params import SamplingParams
model, prompt, params = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
engine = Engine(model=model, kv_role="decode", **json.loads(sys.argv[4]))
engine.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), params)
print("pulling", flush=True)
while engine.has_unfinished_requests():
    engine.step()
"""


def test_decode_engine_killed_mid_pull_leaks_nothing_on_the_prefill_side(
    tiny_llama, prefill, reference, monkeypatch
):
    # A real decode engine in its own process asks for the blocks; the prefill engine's server thread is
    # held inside the read of the blocks until that process has been killed (SIGKILL), so the answer goes
    # to a peer that is gone. The prefill side must end the hold and give every block back; the request is
    # then retried (a fresh prefill and a decoder in this process) and completes with the aggregated output.
    import json
    import subprocess
    import sys
    import threading

    from specfleet.engine.kv_transfer import zmq_transport

    prompt = _prompts()[4]
    prefill.add_request(
        "p", prompt, SamplingParams(temperature=0.0, max_tokens=1), {"do_remote_decode": True}
    )
    outs = []
    while prefill.has_unfinished_requests():
        outs += [o for o in prefill.step() if o.finished]
    params = outs[0].kv_transfer_params
    assert prefill.kv.num_used_blocks == params["num_blocks"] and prefill.kv_connector.num_holds == 1

    asked, killed, real_read = threading.Event(), threading.Event(), zmq_transport.read_blocks

    def read_after_the_decoder_died(caches, block_ids):
        asked.set()
        assert killed.wait(60), "the decoder was not killed"
        return real_read(caches, block_ids)

    monkeypatch.setattr(zmq_transport, "read_blocks", read_after_the_decoder_died)
    decoder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            DECODER,
            tiny_llama,
            json.dumps(prompt),
            json.dumps(params),
            json.dumps(COMMON),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert asked.wait(120), "the decode engine never asked for the blocks"
        decoder.kill()
        assert decoder.wait(30) == -9
    finally:
        killed.set()
        if decoder.poll() is None:
            decoder.kill()
    monkeypatch.setattr(zmq_transport, "read_blocks", real_read)
    deadline = time.monotonic() + 5
    while prefill.kv_connector.num_holds and time.monotonic() < deadline:
        prefill.poll_kv_transfers()
        time.sleep(0.01)
    _assert_no_leaks(prefill)

    decode = _decode(tiny_llama)  # the retry: another prefill and decode of the same request
    try:
        (out,) = generate_disaggregated(prefill, decode, [prompt], GREEDY)
        assert out.outputs[0].token_ids == reference[4]
        _assert_no_leaks(prefill, decode)
    finally:
        decode.close()
