"""`specfleet bench lora` end to end on the tiny llama and tiny settings: every figure of the closing JSON
line is there and sane (the numbers themselves are the benchmark's, not the test's)."""

from __future__ import annotations

import json

from specfleet.bench import lora


def test_bench_lora_prints_its_figures(tiny_llama, tmp_path, capsys):
    out = tmp_path / "lora.json"
    argv = ["--model", tiny_llama, "--concurrency", "4", "--num-requests", "4", "--prompt-len", "8"]
    argv += ["--output-len", "4", "--adapters", "1,2", "--merged-at", "2", "--repeats", "1", "--rank", "4"]
    argv += ["--load-repeats", "2", "--cycles", "3", "--max-model-len", "128", "--out", str(out)]
    assert lora.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result == json.loads(out.read_text())
    for key in (
        "throughput_ratio_2_adapters_vs_base",
        "goodput_per_core_ratio_vs_merged_engines",
        "load_ms_rank16",
    ):
        assert result[key] > 0, key
    assert result["tok_s_1_adapters"] > 0 and result["tok_s_merged_engines"] > 0 and result["tok_s_base"] > 0
    assert result["kernel_us_qkv_native"] > 0 and result["kernel_us_qkv_torch"] > 0
    cycles = result["load_unload"]
    assert cycles["cycles"] == 3 and cycles["rss_before_mb"] > 0 and cycles["rss_after_mb"] > 0
