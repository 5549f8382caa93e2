"""`specfleet up` with prefill/decode roles behind `routing.mode: endpoint-picker` wires the picker's key as the
operator does with its NAME-pd-key Secret: a random key in a file only this user reads, the decode engines'
`--remote-prefill-key-file`, and the fleet's endpoint picker (a real gRPC server, played against as Envoy
would) signing the prefill engine it names with it.

No engine starts here: the decode engine's command line is parsed by the engine's own parser and its key read
by the engine's own start-up code; the engines answering the signed header are
tests/fleet/test_epp_disaggregation.py's. What is not modelled: the engines' readiness (set by hand)."""

from __future__ import annotations

import asyncio
import copy
import json
import stat
from pathlib import Path

import yaml
from envoy_exchange import buffered_exchange
from specfleet.engine.config import EngineConfig
from specfleet.engine.kv_transfer import prefill_signature
from specfleet.engine.server.cli import _remote_prefill, build_parser
from specfleet.fleet.supervisor import LocalFleet, local_engine_command
from specfleet.operator import load_inference_service
from specfleet.router.endpoint_picker import PREFILLER_HEADER, SIGNATURE_HEADER

PD_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2-cpu-pd.yaml"


def fleet_for(tmp_path: Path, mode: str) -> LocalFleet:
    doc = yaml.safe_load(PD_EXAMPLE.read_text())
    doc["spec"]["routing"] = {**doc["spec"].get("routing", {}), "mode": mode}
    return LocalFleet(load_inference_service(copy.deepcopy(doc)), log_dir=tmp_path, say=lambda _: None)


async def signed_pick(fleet: LocalFleet, body: bytes) -> dict[str, str]:
    """The fleet's picker served as `specfleet up` serves it, one ext_proc exchange (BUFFERED bodies): the
    request headers it set, by name."""
    for url, role in (("http://127.0.0.1:18001", "prefill"), ("http://127.0.0.1:18002", "decode")):
        fleet.router.endpoints.set_state(url, ready=True, role=role)
    await fleet._serve_endpoint_picker()
    try:
        return await buffered_exchange(fleet.ext_proc_port, "/v1/completions", body)
    finally:
        await fleet._picker.stop(0)


def test_up_hands_one_key_to_the_picker_and_the_decode_engines(tmp_path: Path) -> None:
    fleet = fleet_for(tmp_path, "endpoint-picker")
    assert fleet.prefill_key is not None and fleet.prefill_key_file is not None
    assert stat.S_IMODE(fleet.prefill_key_file.stat().st_mode) == 0o600  # this user's only
    # the decode engine's command line, as the engine parses it and reads its key at start
    command = local_engine_command(fleet.isvc, 18002, fleet.engine_flags("decode"))
    args = build_parser().parse_args(command[command.index("--model") :])
    assert args.remote_prefill_key_file == str(fleet.prefill_key_file)
    accept = _remote_prefill(
        args.accept_remote_prefill, args.remote_prefill_key_file, EngineConfig(kv_role="decode")
    )
    assert accept is not None and accept.key == fleet.prefill_key
    prefill = local_engine_command(fleet.isvc, 18001, fleet.engine_flags("prefill"))
    assert prefill_signature.KEY_FILE_FLAG not in " ".join(prefill)

    # the picker signs with that key: what the decode engine verifies
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 8}).encode()
    picked = asyncio.run(signed_pick(fleet, body))
    assert picked[PREFILLER_HEADER] == "127.0.0.1:18001"
    prefill_signature.verify(accept.key, picked[SIGNATURE_HEADER], picked[PREFILLER_HEADER], body)


def test_up_without_the_picker_makes_no_key(tmp_path: Path) -> None:
    """Roles behind the fleet's own proxy: the router runs both legs itself, no engine reads a header."""
    fleet = fleet_for(tmp_path, "proxy")
    assert fleet.prefill_key is None and not (tmp_path / "pd-key").exists()
    assert not any(prefill_signature.KEY_FILE_FLAG in flag for flag in fleet.engine_flags("decode"))
