"""`specfleet bench llamacpp`'s assembly of the comparison: the ratios the issue's targets are stated in,
from each server's figures (the real run needs the llama-server build and is not in CI)."""

from __future__ import annotations

import pytest
from specfleet.bench import llamacpp
from specfleet.bench.prompts import grounded_prompts


def _fig(throughput: float, tpot: float | None) -> dict:
    return {
        "throughput_tok_s": throughput,
        "tpot_p50_ms": tpot,
        "ttft_p50_ms": 20.0,
        "completed": 4,
        "failed": 0,
    }


def test_ratios_are_specfleet_over_llama_cpp_per_config() -> None:
    llama = {1: _fig(78.9, 8.9), 8: _fig(136.6, 41.3), 32: _fig(152.4, 124.2)}
    ours = {
        "fp32": {1: _fig(33.7, 27.7), 8: _fig(198.9, 33.6), 32: _fig(262.0, 80.1)},
        "gguf": {1: _fig(90.0, 8.0), 8: _fig(300.0, 20.0), 32: _fig(400.0, 60.0)},
    }
    ratios = llamacpp.compare(llama, ours)
    assert ratios["fp32"] == {
        "tpot_p50_ratio_c1": round(27.7 / 8.9, 3),
        "throughput_ratio_c8": round(198.9 / 136.6, 3),
        "throughput_ratio_c32": round(262.0 / 152.4, 3),
    }
    assert ratios["gguf"]["tpot_p50_ratio_c1"] == 0.899  # below 1.0: specfleet's single stream is faster
    assert ratios["gguf"]["throughput_ratio_c32"] == 2.625


def test_missing_figures_give_no_ratio_rather_than_a_wrong_one() -> None:
    llama = {1: _fig(0.0, None), 32: _fig(152.4, 124.2)}
    ratios = llamacpp.compare(
        llama, {"int8": {1: _fig(55.2, 15.9), 8: _fig(204.2, 33.0), 32: _fig(0.0, None)}}
    )
    assert ratios["int8"] == {"tpot_p50_ratio_c1": None, "throughput_ratio_c32": None}  # no llama.cpp c=8 run


def test_prompts_fill_the_closed_loop() -> None:
    for c in (1, 8, 32):
        full, quick = llamacpp.requests_for(c, quick=False), llamacpp.requests_for(c, quick=True)
        assert len(full) >= max(16, 3 * c) and len(quick) >= max(4, 2 * c) and len(quick) < len(full)
        assert {r.max_tokens for r in full} == {llamacpp.OUTPUT_TOKENS}
    prompts = [r.prompt for r in llamacpp.requests_for(8, quick=False)]
    assert any(p.startswith("Repeat the following text") for p in prompts)  # grounded prompts for n-gram
    assert not all(p.startswith("Repeat the following text") for p in prompts)  # and chat ones
    grounded = {r.prompt for r in llamacpp.requests_for(8, quick=False, prompts="grounded")}
    assert grounded and grounded <= set(grounded_prompts())
    with pytest.raises(ValueError, match="prompts='code' is not one of"):
        llamacpp.requests_for(1, quick=True, prompts="code")


def test_the_comparison_checks_its_flags(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        llamacpp.main(["--configs", "fp32,bf16"])
    assert exit_.value.code == 2
    assert "--configs: ['bf16'] not among" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        llamacpp.main(["--concurrency", "1,64"])
    assert "each must be in 1..32" in capsys.readouterr().err


def test_measure_asks_the_server_for_its_model_and_completes_every_request(server) -> None:
    """Against a real server (uvicorn over a socket): the client sends the id `/v1/models` gives, not the
    model flag (a run that sent `bundled://...` got a 404 for every request and reported throughput 0)."""
    import asyncio

    figures = asyncio.run(llamacpp.measure(server.url, quick=True, concurrency=(2,)))
    assert figures[2]["failed"] == 0 and "errors" not in figures[2], figures
    assert figures[2]["completed"] == len(llamacpp.requests_for(2, quick=True))
    assert figures[2]["throughput_tok_s"] > 0 and figures[2]["tpot_p50_ms"] > 0


def test_a_server_that_refuses_the_warm_up_stops_the_run_with_its_answer(serve_app) -> None:
    """A server that refuses every request is named with its error, not measured as 0 tok/s."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @app.post("/v1/chat/completions")
    def refuse() -> JSONResponse:
        return JSONResponse({"error": {"message": "no capacity", "code": "busy"}}, status_code=503)

    uv, thread, url = serve_app(app)
    try:
        with pytest.raises(RuntimeError, match="refused the warm-up request: .*no capacity"):
            asyncio.run(llamacpp.measure(url, quick=True, concurrency=(1,)))
    finally:
        uv.should_exit = True
        thread.join(15)
