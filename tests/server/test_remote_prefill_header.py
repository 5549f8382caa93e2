"""What a decode engine accepts in `x-prefiller-host-port` before it sends anything (engine/server/
remote_prefill.py), the flag that allows it, and the prefill leg both orchestrators share (engine/kv_transfer/
prefill_leg.py). No engine: the leg's run against real engines is tests/fleet/test_epp_disaggregation.py."""

from __future__ import annotations

import json

import pytest
from specfleet.engine.kv_transfer import prefill_leg
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
