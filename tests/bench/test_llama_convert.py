"""The converter lookup the GGUF oracle tests go through (bench/llama_convert.py, tests/gguf_oracle.py): with
an empty llama.cpp cache and fetching forbidden, the anchor script says what is missing and fetches nothing;
the oracle skips with that reason, and fails with it under CI=true."""

from __future__ import annotations

from pathlib import Path

import gguf_oracle
import pytest
from specfleet.bench.llama_convert import ConverterMissing, converter_source


def test_offline_lookup_in_an_empty_cache_names_the_missing_sdist(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPECFLEET_LLAMA_CACHE", str(tmp_path))
    with pytest.raises(ConverterMissing, match=r"llama_cpp_python-0\.3\.36\.tar\.gz is missing"):
        converter_source(offline=True)
    assert [p.name for p in tmp_path.iterdir()] == []  # nothing fetched or unpacked


@pytest.mark.parametrize("ci", ["", "true"])
def test_the_oracle_skips_without_the_converter_and_fails_under_ci(tmp_path: Path, monkeypatch, ci) -> None:
    monkeypatch.setenv("SPECFLEET_LLAMA_CACHE", str(tmp_path))
    monkeypatch.setenv("CI", ci)
    outcome = pytest.fail.Exception if ci == "true" else pytest.skip.Exception
    with pytest.raises(outcome, match="convert_hf_to_gguf.py is not in the cache"):
        gguf_oracle.converter_source()
