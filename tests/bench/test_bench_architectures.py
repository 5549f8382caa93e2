"""bench/architectures.py: the item-5 figures in one run, every ratio from the measured medians."""

from __future__ import annotations

import json
import statistics

import pytest
from specfleet.bench.architectures import AGAINST_LLAMA, ARCHES, checkpoint_args, main, summarize


def test_ratios_are_medians_over_medians_and_goals_are_judged_on_them():
    rates = {
        "llama": {"c1": [10.0, 30.0, 20.0], "c32": [100.0, 300.0, 200.0]},
        "gemma3": {"c1": [18.0, 1.0, 17.0], "c32": [170.0, 900.0, 180.0]},  # medians 17 and 180
        "mixtral": {"c1": [8.0, 9.0, 7.0], "c32": [79.0, 80.0, 81.0]},
        "dense": {"c1": [10.0, 10.0, 10.0], "c32": [100.0, 100.0, 101.0]},
    }
    out = summarize(rates)
    assert out["median_tok_s"]["gemma3"] == {"c1": 17.0, "c32": 180.0}
    assert out["ratio_c1"] == {"gemma3": pytest.approx(17.0 / 20.0)}
    assert out["ratio_c32"] == {"gemma3": pytest.approx(180.0 / 200.0)}
    assert out["moe_c32_ratio_vs_dense_active"] == pytest.approx(80.0 / 100.0)
    assert out["moe_c1_ratio_vs_dense_active"] == pytest.approx(8.0 / 10.0)
    assert out["goal"]["met"] == {"gemma3": True, "mixtral": True}  # 0.85 and 0.90 >= 0.85; 0.8 >= 0.8
    rates["gemma3"]["c1"] = [16.0, 16.0, 16.0]  # 0.80 of llama's c1: the 15% goal missed
    assert summarize(rates)["goal"]["met"]["gemma3"] is False


def test_dense_has_mixtrals_active_parameters():
    from specfleet.bench.random_checkpoint import MOE_TOP_K

    assert checkpoint_args("dense", 512) == ("llama", MOE_TOP_K * 3 * 512)  # two experts of 3 x hidden
    assert checkpoint_args("gemma2", 512) == ("gemma2", None)


def test_bad_settings_are_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["--c1-tokens", "1"])
    assert "--c1-tokens must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--rounds", "0"])
    assert "--rounds must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_one_run_prints_every_architectures_rates_and_ratios(tmp_path, capsys):
    """All seven checkpoints at hidden 128, one layer, one round: the JSON line has a rate per architecture,
    round and concurrency, and its ratios are the printed medians' quotients."""
    argv = ["--hidden", "128", "--layers", "1", "--rounds", "2", "--c1-tokens", "3", "--c32-tokens", "3"]
    assert main([*argv, "--concurrency", "4", "--workdir", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["tok_s"]) == set(ARCHES)
    medians = {}
    for arch, runs in result["tok_s"].items():
        assert set(runs) == {"c1", "c32"} and all(len(v) == 2 and min(v) > 0 for v in runs.values())
        medians[arch] = {c: statistics.median(v) for c, v in runs.items()}
    assert result["median_tok_s"] == medians
    for c in ("c1", "c32"):
        assert set(result[f"ratio_{c}"]) == set(AGAINST_LLAMA)
        for arch, ratio in result[f"ratio_{c}"].items():
            assert ratio == pytest.approx(medians[arch][c] / medians["llama"][c])
        moe = result[f"moe_{c}_ratio_vs_dense_active"]
        assert moe == pytest.approx(medians["mixtral"][c] / medians["dense"][c])
    assert result["params"]["dense"] < result["params"]["mixtral"]  # the same active, not total, parameters
    assert set(result["goal"]["met"]) == {*AGAINST_LLAMA, "mixtral"}


@pytest.mark.slow
def test_int8_runs_every_engine_quantized(tmp_path, capsys, monkeypatch):
    """`--quantization int8` reaches every engine (Mixtral's experts quantized as the dense MLPs) and the JSON
    says so; another name is refused by the parser."""
    from specfleet.engine import llm

    configs = []
    real = llm.engine_config_from_vllm_kwargs

    def recording(model, kwargs):
        configs.append(real(model, kwargs))
        return configs[-1]

    monkeypatch.setattr(llm, "engine_config_from_vllm_kwargs", recording)
    argv = ["--hidden", "128", "--layers", "1", "--rounds", "1", "--c1-tokens", "3", "--c32-tokens", "3"]
    argv += ["--concurrency", "4", "--archs", "mixtral", "dense", "--quantization", "int8"]
    assert main([*argv, "--workdir", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["quantization"] == "int8" and result["moe_c32_ratio_vs_dense_active"] > 0
    assert [c.quantization for c in configs] == ["int8", "int8"]
    with pytest.raises(SystemExit):
        main(["--quantization", "awq"])
    assert "--quantization" in capsys.readouterr().err
