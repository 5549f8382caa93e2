"""Prefill/decode disaggregation through the KV connector (ZeroMQ over loopback), two in-process engines:
the pair's greedy output equals one aggregated engine's token for token, and no KV block leaks."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from specfleet.engine.kv_transfer.blocks import read_blocks, write_blocks
from specfleet.engine.kv_transfer.pair import generate_disaggregated
from specfleet.engine.llm_engine import Engine
from specfleet.engine.python_child import python_command
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
        python_command(
            "-c",
            DECODER,
            tiny_llama,
            json.dumps(prompt),
            json.dumps(params),
            json.dumps(COMMON),
        ),
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


# -- issue 33: inputs and peers that must not take a decode engine down ------------------------------------


def _good_params(**changes) -> dict:
    """kv_transfer_params for the prompt [5, 6] at block size 4 (2 tokens, 1 block)."""
    return {
        **dict(
            remote_host="127.0.0.1",
            remote_port=1,
            transfer_id="t",
            num_tokens=2,
            num_blocks=1,
            first_token_id=9,
        ),
        **changes,
    }


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"num_tokens": 2.0, "num_blocks": 1.0}, ["num_tokens", "integer", "2.0"]),  # the repro
        ({"num_blocks": True}, ["num_blocks", "integer", "bool"]),
        ({"num_blocks": 0}, ["num_blocks", ">= 1"]),
        ({"remote_port": 0}, ["remote_port", "[1, 65535]"]),
        ({"remote_port": 65536}, ["remote_port", "[1, 65535]"]),
        ({"remote_port": "5555"}, ["remote_port", "integer"]),
        ({"remote_host": ""}, ["remote_host", "non-empty string"]),
        ({"transfer_id": 7}, ["transfer_id", "non-empty string"]),
        ({"first_token_id": -1}, ["first_token_id", ">= 0"]),
        ({"first_token_id": 49152}, ["first_token_id", "[0, 49152)"]),  # the tiny model's vocab
        ({"first_token_id": 1e3}, ["first_token_id", "integer"]),
    ],
)
def test_kv_transfer_params_types_and_ranges_are_parameter_errors_naming_the_field(
    tiny_llama, changes, names
):
    decode = _decode(tiny_llama)
    try:
        with pytest.raises(ParameterError) as caught:
            decode.add_request("v", [5, 6], SamplingParams(max_tokens=4), _good_params(**changes))
        assert caught.value.param == "kv_transfer_params"
        for name in names:
            assert name in str(caught.value), (name, str(caught.value))
        assert not decode.has_unfinished_requests() and decode.kv.num_used_blocks == 0
        decode.step()  # nothing was queued that a step could trip on
    finally:
        decode.close()


def test_scheduler_finish_of_a_sequence_in_no_queue_frees_its_blocks():
    from specfleet.engine.block_manager import BlockManager
    from specfleet.engine.scheduler import Scheduler
    from specfleet.engine.sequence import Sequence, Status

    kv = BlockManager(8, BLOCK, True)
    sched = Scheduler(kv, 4, 64, 64)
    seq = Sequence(0, "r", 0, [1, 2, 3, 4, 5], 4, SamplingParams())
    kv.allocate(seq, seq.num_tokens)  # as a KV connector does for a remote sequence it is loading
    seq.status = Status.WAITING_FOR_REMOTE_KVS
    sched.finish(seq, "abort")
    assert seq.is_finished and kv.num_used_blocks == 0
    sched.finish(seq, "abort")  # twice: a no-op


def _run(engine: Engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def _prefilled(prefill: Engine, request_id: str, prompt: list[int], params: SamplingParams) -> dict:
    """The prefill engine's first token and kv_transfer_params for `prompt`, the router's first leg."""
    first = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    prefill.add_request(request_id, prompt, first, {"do_remote_decode": True})
    (out,) = _run(prefill).values()
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def test_any_connector_error_is_that_requests_fallback_not_a_dead_engine(
    tiny_llama, prefill, reference, monkeypatch
):
    # The crash: an error in the connector other than KVTransferError escaped the step, and the
    # cleanup raised again in Scheduler.finish. Any such error now makes the request recompute its prompt.
    from specfleet.engine.kv_transfer import zmq_transport

    def broken(*args, **kwargs):
        raise TypeError("slice indices must be integers")

    prompt = _prompts()[4]
    params = _prefilled(prefill, "p", prompt, GREEDY)
    monkeypatch.setattr(zmq_transport, "write_blocks", broken)
    decode = _decode(tiny_llama)
    try:
        decode.add_request("p", prompt, GREEDY, params)
        decode.add_request("innocent", _prompts()[1], GREEDY)
        done = _run(decode)
        assert done["p"].outputs[0].token_ids == reference[4]
        assert done["innocent"].outputs[0].token_ids == reference[1]
        assert decode.kv_connector.stats.fallbacks == 1
        assert decode.kv.num_used_blocks == 0
    finally:
        decode.close()


def test_the_pull_runs_off_the_engine_thread_and_a_hung_peer_falls_back(tiny_llama, reference):
    # A prefill peer that takes the request and never answers (a ROUTER socket nobody serves: the
    # process is SIGSTOPped, say). The decode engine keeps stepping its other request at full pace while
    # the remote one waits in WAITING_FOR_REMOTE_KVS, then recomputes the prompt at the timeout.
    import zmq
    from specfleet.engine.sequence import Status

    hung = zmq.Context.instance().socket(zmq.ROUTER)
    hung.setsockopt(zmq.LINGER, 0)
    port = hung.bind_to_random_port("tcp://127.0.0.1")
    timeout_s = 1.5
    decode = _decode(tiny_llama, kv_transfer_timeout_s=timeout_s)
    try:
        prompt = _prompts()[4]
        remote = _good_params(
            remote_port=port,
            num_tokens=len(prompt),
            num_blocks=-(-len(prompt) // BLOCK),
            first_token_id=reference[4][0],
        )
        decode.add_request("local", _prompts()[1], replace(GREEDY, max_tokens=200))
        decode.add_request("remote", prompt, GREEDY, remote)
        start = time.monotonic()
        slowest, steps = 0.0, 0
        remote_seq = decode._requests["remote"].seqs[0]
        while remote_seq.status is not Status.RUNNING and time.monotonic() - start < 3 * timeout_s:
            t0 = time.monotonic()
            decode.step()
            slowest, steps = max(slowest, time.monotonic() - t0), steps + 1
            if steps == 2:
                assert remote_seq.status is Status.WAITING_FOR_REMOTE_KVS
                assert decode.kv_connector.stats.waiting_for_remote_kvs == 1
        waited = time.monotonic() - start
        assert waited >= timeout_s * 0.9, "the remote request left the wait before the timeout"
        # a step that waited on the pull would take the whole timeout (1.5 s); the tiny model's step takes
        # milliseconds: two thirds of the timeout leave a loaded host's pauses 1 s, a third left them 0.5 s
        assert slowest < timeout_s * 2 / 3, f"a step took {slowest:.2f}s: the pull blocked it"
        assert steps > 10
        done = _run(decode)
        assert done["remote"].outputs[0].token_ids == reference[4]
        assert decode.kv_connector.stats.fallbacks == 1
        assert decode.kv.num_used_blocks == 0
    finally:
        decode.close()
        hung.close(linger=0)


def test_abort_during_the_pull_frees_the_blocks_and_ignores_the_answer(tiny_llama, prefill, reference):
    import zmq
    from specfleet.engine.sequence import Status

    hung = zmq.Context.instance().socket(zmq.ROUTER)
    hung.setsockopt(zmq.LINGER, 0)
    port = hung.bind_to_random_port("tcp://127.0.0.1")
    decode = _decode(tiny_llama, kv_transfer_timeout_s=0.5)
    try:
        prompt = _prompts()[1]
        remote = _good_params(
            remote_port=port,
            num_tokens=len(prompt),
            num_blocks=-(-len(prompt) // BLOCK),
            first_token_id=reference[1][0],
        )
        decode.add_request("remote", prompt, GREEDY, remote)
        decode.step()
        assert decode._requests["remote"].seqs[0].status is Status.WAITING_FOR_REMOTE_KVS
        assert decode.kv.num_used_blocks > 0
        decode.abort("remote")
        assert decode.kv.num_used_blocks == 0 and not decode.has_unfinished_requests()
        time.sleep(0.7)  # the worker's pull times out: its answer is dropped
        decode.step()
        assert decode.kv.num_used_blocks == 0 and decode.kv_connector.stats.fallbacks == 0
    finally:
        decode.close()
        hung.close(linger=0)


def _ask(port: int, frames: list[bytes], kind: int | None = None) -> list[bytes] | None:
    import zmq

    sock = zmq.Context.instance().socket(kind if kind is not None else zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(frames)
        return sock.recv_multipart()
    except zmq.Again:
        return None
    finally:
        sock.close(linger=0)


def test_the_kv_server_thread_survives_any_message(tiny_llama, prefill, reference):
    import json
    import socket

    import zmq

    params = _prefilled(prefill, "g", _prompts()[4], GREEDY)
    port = params["remote_port"]
    tid = params["transfer_id"]
    bad = [
        b"\xff\xfe not json",
        b"[1, 2, 3]",
        b'"a string"',
        b'{"transfer_id": 7}',
        b'{"transfer_id": "no-such-hold"}',
        json.dumps({"transfer_id": tid, "first_block": "x"}).encode(),
        json.dumps({"transfer_id": tid, "first_block": -1}).encode(),
        json.dumps({"transfer_id": tid, "first_block": 1.5}).encode(),
        json.dumps({"transfer_id": tid, "first_block": 10**9}).encode(),
    ]
    for body in bad:
        answer = _ask(port, [body])
        assert answer is not None, f"no answer to {body!r}: the server thread is gone"
        header = json.loads(answer[0])
        assert header["ok"] is False and header["error"], (body, header)
    assert _ask(port, [b"a", b"b", b"c"], zmq.DEALER) is not None  # frames no REQ sends
    assert _ask(port, [b"x" * (128 * 1024)]) is None  # too large: ZeroMQ drops the sender, no answer
    with socket.create_connection(("127.0.0.1", port)) as raw:  # not ZeroMQ at all
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 8)
    # Still serving: the real pull of the same hold goes through (no fallback), output as aggregated.
    decode = _decode(tiny_llama)
    try:
        decode.add_request("g", _prompts()[4], GREEDY, params)
        assert _run(decode)["g"].outputs[0].token_ids == reference[4]
        assert decode.kv_connector.stats.transfers == 1 and decode.kv_connector.stats.fallbacks == 0
    finally:
        decode.close()
    _assert_no_leaks(prefill)


class _DeviceTensor(torch.Tensor):
    """A tensor that, like a CUDA tensor, refuses `.numpy()` until it is copied to the host (`.cpu()`)."""

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first.")

    def cpu(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor)


def test_blocks_are_served_through_a_host_copy(tiny_llama, prefill, reference, monkeypatch):
    from specfleet.engine.kv_transfer import zmq_transport

    real_read = zmq_transport.read_blocks
    monkeypatch.setattr(
        zmq_transport, "read_blocks", lambda caches, ids: real_read(caches, ids).as_subclass(_DeviceTensor)
    )
    decode = _decode(tiny_llama)
    try:
        (out,) = generate_disaggregated(prefill, decode, [_prompts()[4]], GREEDY)
        assert out.outputs[0].token_ids == reference[4]
        assert decode.kv_connector.stats.transfers == 1 and decode.kv_connector.stats.fallbacks == 0
    finally:
        decode.close()


def _aggregated(tiny_llama, prompts: list[list[int]], params: SamplingParams) -> list:
    engine = Engine(model=tiny_llama, **COMMON)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"a{i}", prompt, replace(params))
    done = _run(engine)
    return [done[f"a{i}"] for i in range(len(prompts))]


def test_logprobs_through_the_pair_equal_aggregated(tiny_llama, prefill):
    params = replace(GREEDY, logprobs=3)
    want = _aggregated(tiny_llama, _prompts(), params)
    decode = _decode(tiny_llama)
    try:
        got = generate_disaggregated(prefill, decode, _prompts(), params)
        for g, w in zip(got, want):
            g, w = g.outputs[0], w.outputs[0]
            assert g.token_ids == w.token_ids
            assert len(g.logprobs) == len(w.logprobs) == len(w.token_ids)
            for gp, wp in zip(g.logprobs, w.logprobs):
                assert gp.token_id == wp.token_id and list(gp.top) == list(wp.top)
                assert gp.logprob == pytest.approx(wp.logprob, abs=1e-4)
                assert list(gp.top.values()) == pytest.approx(list(wp.top.values()), abs=1e-4)
                assert gp[gp.token_id].rank == wp[wp.token_id].rank
                assert gp[gp.token_id].decoded_token == wp[wp.token_id].decoded_token
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
        _assert_no_leaks(prefill, decode)
    finally:
        decode.close()
    with pytest.raises(ParameterError, match="first_token_logprobs"):  # logprobs the prefill did not send
        d = _decode(tiny_llama)
        try:
            d.add_request("x", [5, 6], params, _good_params())
        finally:
            d.close()


@pytest.mark.parametrize("min_tokens", [2, 3, 6])
def test_min_tokens_through_the_pair_equal_aggregated(tiny_llama, prefill, reference, min_tokens):
    # The second token of the greedy answer as a stop token: aggregated, min_tokens holds it off until
    # min_tokens tokens are out; through the pair the prefill leg keeps min_tokens to its one token and
    # the decode engine counts that token toward the rest.
    stop = reference[4][1]
    params = replace(GREEDY, stop_token_ids=[stop], ignore_eos=False, min_tokens=min_tokens)
    (want,) = _aggregated(tiny_llama, [_prompts()[4]], params)
    assert len(want.outputs[0].token_ids) >= min_tokens
    decode = _decode(tiny_llama)
    try:
        (got,) = generate_disaggregated(prefill, decode, [_prompts()[4]], params)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert decode.kv_connector.stats.transfers == 1
        _assert_no_leaks(prefill, decode)
    finally:
        decode.close()


def test_a_pull_stuck_past_its_deadline_falls_back_and_a_finished_one_is_dropped(
    tiny_llama, reference, monkeypatch
):
    import threading

    from specfleet.engine.kv_transfer.connector import PULL_DEADLINE_MARGIN_S
    from specfleet.engine.sequence import Status

    timeout_s = 0.1
    decode = _decode(tiny_llama, kv_transfer_timeout_s=timeout_s)
    late = threading.Event()
    # Workers stuck outside their sockets' timeouts (whatever the cause) until `late` is set.
    monkeypatch.setattr(decode.kv_connector.consumer, "fetch", lambda *args: late.wait(30) and None)
    try:
        for request_id, i in (("stuck", 4), ("ended", 1)):
            prompt = _prompts()[i]
            remote = _good_params(
                num_tokens=len(prompt), num_blocks=-(-len(prompt) // BLOCK), first_token_id=reference[i][0]
            )
            decode.add_request(request_id, prompt, GREEDY, remote)
        decode.step()
        stuck, ended = (decode._requests[r].seqs[0] for r in ("stuck", "ended"))
        assert stuck.status is ended.status is Status.WAITING_FOR_REMOTE_KVS
        decode.finish_sequence("ended", 0)  # the server matched a stop string in its first token's text
        assert ended.is_finished and "ended" not in decode._requests
        assert decode.kv.num_used_blocks == len(stuck.block_table)
        time.sleep(2 * timeout_s + PULL_DEADLINE_MARGIN_S + 0.1)
        decode.step()
        assert stuck.status is not Status.WAITING_FOR_REMOTE_KVS and decode.kv_connector.stats.fallbacks == 1
        late.set()  # the workers return after all: their answers are dropped
        assert _run(decode)["stuck"].outputs[0].token_ids == reference[4]
        assert decode.kv_connector.stats.fallbacks == 1 and decode.kv.num_used_blocks == 0
    finally:
        late.set()
        decode.close()
