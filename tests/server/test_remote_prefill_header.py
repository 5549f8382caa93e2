"""What a decode engine accepts in `x-prefiller-host-port` before it sends anything (engine/server/
remote_prefill.py), the flag that allows it, and the prefill leg both orchestrators share (engine/kv_transfer/
prefill_leg.py), and the endpoint picker's signature a decode engine given a key requires (engine/kv_transfer/
prefill_signature.py), over real HTTP servers. No engine: the leg's run against real engines is
tests/fleet/test_epp_disaggregation.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from helpers import serve_in_thread
from prometheus_client import CollectorRegistry
from specfleet.engine.kv_transfer import prefill_leg, prefill_signature
from specfleet.engine.server import remote_prefill
from specfleet.engine.server.cli import main
from specfleet.engine.server.errors import APIError
from specfleet.engine.server.remote_prefill import RemotePrefill, parse_networks

GOOD = (
    "10.0.0.5:8000",
    "prefill-0.prefill.default.svc.cluster.local:8000",
    "localhost:1",
    "[::1]:65535",
    "[fd00::5]:8000",
)
BAD = (
    "http://10.0.0.5:8000",  # a scheme
    "10.0.0.5",  # no port
    "10.0.0.5:0",
    "10.0.0.5:65536",
    "10.0.0.5:+80",
    "10.0.0.5:80/v1/completions",  # a path
    "user@10.0.0.5:80",  # userinfo
    "10.0.0.5:80?x=1",
    "host name:80",
    "-prefill:80",  # a label starting with a hyphen
    "a" * 64 + ":80",  # a label over 63 characters
    "::1:80",  # IPv6 unbracketed
    "[not-v6]:80",
    "prefill:８０",  # not ASCII
    "",
    ":80",
)


@pytest.mark.parametrize("value", GOOD)
def test_host_port_values_a_decode_engine_accepts(value: str) -> None:
    assert RemotePrefill().target(value) == value


@pytest.mark.parametrize("value", BAD)
def test_other_values_are_a_400_naming_the_header_and_the_rule(value: str) -> None:
    with pytest.raises(APIError) as refused:
        RemotePrefill().target(value)
    assert refused.value.status == 400 and refused.value.param == "x-prefiller-host-port"
    assert "x-prefiller-host-port must be host:port" in refused.value.message


def test_cidrs_narrow_the_hosts_to_ip_addresses_inside_them() -> None:
    accept = RemotePrefill(parse_networks(["127.0.0.0/8", "fd00::/8"]))
    assert accept.target("127.0.0.1:8000") == "127.0.0.1:8000"
    assert accept.target("[fd00::5]:8000") == "[fd00::5]:8000"
    for value in ("10.0.0.5:8000", "localhost:8000", "[::1]:8000"):  # a name: resolved later, refused now
        with pytest.raises(
            APIError, match=r"inside --accept-remote-prefill's networks \(127.0.0.0/8, fd00::/8\)"
        ):
            accept.target(value)
    with pytest.raises(ValueError, match="--accept-remote-prefill takes CIDRs"):
        parse_networks(["10.0.0.0/33"])


def test_the_flag_needs_a_decode_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--accept-remote-prefill"]) == 2  # before any model loads
    assert "--accept-remote-prefill needs --kv-role decode" in capsys.readouterr().err
    assert main(["--kv-role", "decode", "--accept-remote-prefill", "10.0.0.0/40"]) == 2
    assert "takes CIDRs" in capsys.readouterr().err


def test_the_llm_d_header_name_is_shared_by_picker_and_engine() -> None:
    from specfleet.router.endpoint_picker import PREFILLER_HEADER

    assert PREFILLER_HEADER == remote_prefill.HEADER == "x-prefiller-host-port"


def test_reading_the_prefill_engines_answer() -> None:
    params = {"transfer_id": "t", "remote_host": "10.0.0.5", "remote_port": 5600}
    answer = json.dumps({"choices": [], "kv_transfer_params": params}).encode()
    assert prefill_leg.held_params(200, answer, "application/json") == params
    assert prefill_leg.held_params(200, b'{"choices": []}', None) is None  # it ended on a stop token
    for status in (408, 429, 500, 503):  # not the request's fault: another engine, or aggregated
        assert prefill_leg.held_params(status, b"{}", None) is None
    with pytest.raises(prefill_leg.Refusal) as refused:
        prefill_leg.held_params(400, b'{"error": {"message": "bad"}}', "application/json")
    assert refused.value.status == 400
    assert not prefill_leg.covered({"prompt": "hi", "max_tokens": 8, "resume_token_ids": [5]})
    assert prefill_leg.parse("completions", "POST", b'{"prompt": "hi", "max_tokens": 8}') is not None
    assert prefill_leg.parse("embeddings", "POST", b'{"input": "hi"}') is None


def test_a_refusal_that_is_not_an_openai_error_is_not_echoed() -> None:
    """The host is the header's: whatever else answers there does not reach the client beyond its status."""
    page = prefill_leg.Refusal(403, b"<html>internal admin page</html>", "text/html")
    error = remote_prefill._refused("10.0.0.5:80", page)
    assert error.status == 403 and "internal" not in error.message and "HTTP 403" in error.message
    openai = prefill_leg.Refusal(
        400, b'{"error": {"message": "too long", "param": "prompt", "code": "c"}}', None
    )
    error = remote_prefill._refused("10.0.0.5:80", openai)
    assert (error.message, error.param, error.code) == (
        "the prefill engine 10.0.0.5:80 refused the request: too long",
        "prompt",
        "c",
    )


KEY = b"k" * 32
PREFILLER = "10.0.0.5:8000"
BODY = b'{"prompt": "hi", "max_tokens": 8}'


def test_a_signature_verifies_for_its_key_host_and_body_only() -> None:
    now = 1_800_000_000.0
    value = prefill_signature.sign(KEY, PREFILLER, BODY, now=now)
    assert value.startswith(f"v1:{int(now)}:") and len(value.rsplit(":", 1)[1]) == 64
    prefill_signature.verify(KEY, value, PREFILLER, BODY, now=now + 29)  # within the max age
    prefill_signature.verify(KEY, value, PREFILLER, BODY, now=now - 29)  # a clock behind the picker's

    def reason(value: str | None, prefiller: str = PREFILLER, body: bytes = BODY, key: bytes = KEY) -> str:
        with pytest.raises(prefill_signature.Rejected) as rejected:
            prefill_signature.verify(key, value, prefiller, body, now=now)
        assert prefill_signature.HEADER in str(rejected.value)
        return rejected.value.reason

    assert reason(value, key=b"another key of 32 bytes.........") == "mismatch"
    assert reason(value, prefiller="10.0.0.6:8000") == "mismatch"  # a tampered host
    assert reason(value, prefiller="10.0.0.5:8001") == "mismatch"
    assert reason(value, body=BODY.replace(b"hi", b"ho")) == "mismatch"  # another request's body
    assert reason(prefill_signature.sign(KEY, PREFILLER, BODY, now=now - 31)) == "stale"
    assert reason(prefill_signature.sign(KEY, PREFILLER, BODY, now=now + 31)) == "stale"
    assert reason(None) == "missing"
    for bad in ("", "v1", "v2:1:ab", f"v1:-{int(now)}:ab", "v1:12x:ab", f"v1:{int(now)}:ü"):
        assert reason(bad) == "malformed", bad
    assert reason(value[:-1] + ("0" if value[-1] != "0" else "1")) == "mismatch"  # one hex digit changed


def test_the_key_file_is_read_once_and_refused_clearly(tmp_path) -> None:
    good = tmp_path / "key"
    good.write_text("s3cr3t-key-of-enough-bytes\n")  # a mounted Secret's or echo's newline is dropped
    assert prefill_signature.read_key(good) == b"s3cr3t-key-of-enough-bytes"
    (tmp_path / "empty").write_text(" \n")
    (tmp_path / "short").write_text("short")
    for path, words in (
        (tmp_path / "missing", "cannot read the key"),
        (tmp_path / "empty", "the file is empty"),
        (tmp_path / "short", "fewer than 16"),
    ):
        with pytest.raises(ValueError, match=words) as refused:
            prefill_signature.read_key(path)
        assert str(refused.value).startswith(f"--remote-prefill-key-file {path}")


def test_the_key_file_flag_needs_a_decode_engine_and_a_key(tmp_path, capsys) -> None:
    assert main(["--remote-prefill-key-file", str(tmp_path / "missing")]) == 2  # before any model loads
    assert "--remote-prefill-key-file needs --kv-role decode" in capsys.readouterr().err
    assert main(["--kv-role", "decode", "--remote-prefill-key-file", str(tmp_path / "missing")]) == 2
    assert "--remote-prefill-key-file" in (err := capsys.readouterr().err) and "cannot read the key" in err


@pytest.fixture(scope="module")
def signed_decode_side() -> Iterator[dict[str, Any]]:
    """A real uvicorn server answering as a prefill engine does (a hold's kv_transfer_params), and one whose
    route runs a decode engine's remote_prefill.prefill with a key and returns what it got: the gating the
    engine's completions route goes through, without an engine core (the full path, with engines, is
    tests/fleet/test_epp_disaggregation.py)."""
    prefill, decode = FastAPI(), FastAPI()
    legs: list[dict[str, Any]] = []

    @prefill.post("/v1/completions")
    async def hold(request: Request) -> dict[str, Any]:
        legs.append(await request.json())
        return {"choices": [], "kv_transfer_params": {"transfer_id": f"t-{len(legs)}"}}

    accept = RemotePrefill(parse_networks(["127.0.0.0/8"]), timeout_s=5.0, key=KEY)
    registry = CollectorRegistry()
    accept.register_metrics(registry, "m")

    @decode.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        return {"held": await remote_prefill.prefill(accept, request, "completions")}

    servers = [serve_in_thread(app) for app in (prefill, decode)]
    yield {"prefill": servers[0][2], "decode": servers[1][2], "legs": legs, "registry": registry}
    for server, _, _ in servers:
        server.should_exit = True
    for _, thread, _ in servers:
        thread.join(10)


def test_a_decode_engine_with_a_key_runs_the_leg_only_for_the_pickers_signature(signed_decode_side) -> None:
    side = signed_decode_side
    target = side["prefill"].removeprefix("http://")
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 8}).encode()

    def rejected(reason: str) -> float:
        value = side["registry"].get_sample_value(
            "specfleet_remote_prefill_rejected_total", {"model_name": "m", "reason": reason}
        )
        assert value is not None
        return value

    def send(headers: dict[str, str], content: bytes = body) -> Any:
        sent = httpx.post(
            f"{side['decode']}/v1/completions",
            content=content,
            headers={"content-type": "application/json", remote_prefill.HEADER: target, **headers},
            timeout=10,
        )
        assert sent.status_code == 200, sent.text
        return sent.json()["held"]

    signed = {prefill_signature.HEADER: prefill_signature.sign(KEY, target, body)}
    legs = len(side["legs"])
    assert send(signed) == {"transfer_id": f"t-{legs + 1}"}  # the leg ran on the signed host
    assert side["legs"][-1]["kv_transfer_params"] == {"do_remote_decode": True}

    before = {reason: rejected(reason) for reason in prefill_signature.REASONS}
    forged = prefill_signature.sign(b"a client's own guess at the key", target, body)
    other_body = json.dumps({"prompt": "Another prompt", "max_tokens": 8}).encode()
    cases: tuple[tuple[dict[str, str], bytes, str], ...] = (
        ({}, body, "missing"),
        ({prefill_signature.HEADER: forged}, body, "mismatch"),
        (signed, other_body, "mismatch"),  # a signature copied onto another request
        ({prefill_signature.HEADER: "v1:0:00"}, body, "stale"),
        ({prefill_signature.HEADER: "sig"}, body, "malformed"),
    )
    for headers, content, _ in cases:
        assert send(headers, content) is None  # ignored: the request would run aggregated
    assert len(side["legs"]) == legs + 1  # nothing was sent to the named host
    for reason in prefill_signature.REASONS:
        assert rejected(reason) - before[reason] == sum(case[2] == reason for case in cases)
