"""`specfleet serve`'s engine flags are generated from EngineConfig's fields: every field has its flag,
default and help; the flags the operator and the docs use keep their names and defaults."""

from __future__ import annotations

from dataclasses import fields

from specfleet.engine.config import EngineConfig
from specfleet.engine.server.cli import build_parser, engine_config_kwargs

# The flags `specfleet serve` had before they were generated: names a pod spec or a script may use.
FLAGS = (
    "--model",
    "--dtype",
    "--device",
    "--max-model-len",
    "--block-size",
    "--num-kv-blocks",
    "--kv-cache-gib",
    "--kv-cache-memory-fraction",
    "--no-prefix-caching",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--max-num-seqs-limit",
    "--max-num-batched-tokens-limit",
    "--attention-backend",
    "--speculative-method",
    "--num-speculative-tokens",
    "--max-num-speculative-tokens",
    "--speculative-disable-by-batch-size",
    "--draft-model",
    "--quantization",
    "--draft-quantization",
    "--seed",
    "--tensor-parallel-size",
    "--served-model-name",
    "--host",
    "--port",
    "--max-waiting",
    "--drain-timeout",
    "--log-level",
)


def test_every_engine_field_has_a_flag_with_help_and_its_default() -> None:
    parser = build_parser()
    by_dest = {a.dest: a for a in parser._actions}
    assert set(FLAGS) <= {s for a in parser._actions for s in a.option_strings}
    for f in fields(EngineConfig):
        action = by_dest[f.name]
        assert action.help, f"--{f.name} has no help text (give the field one in engine/config.py)"
    defaults = engine_config_kwargs(parser.parse_args([]))
    assert EngineConfig(**defaults) == EngineConfig()  # no flag given: EngineConfig's own defaults


def test_flags_keep_their_behaviour() -> None:
    parse = build_parser().parse_args
    assert engine_config_kwargs(parse(["--speculative-method", "ngram"]))["num_speculative_tokens"] == 4
    assert (
        engine_config_kwargs(parse(["--speculative-method", "ngram", "--num-speculative-tokens", "0"]))[
            "num_speculative_tokens"
        ]
        == 0
    )
    assert engine_config_kwargs(parse(["--no-prefix-caching"]))["enable_prefix_caching"] is False
    kwargs = engine_config_kwargs(
        parse(
            [
                "--kv-cache-gib",
                "1.5",
                "--max-num-seqs-limit",
                "300",
                "--quantization",
                "int8",
                "--attention-backend",
                "torch",
            ]
        )
    )
    assert kwargs["kv_cache_gib"] == 1.5 and kwargs["max_num_seqs_limit"] == 300
    assert kwargs["quantization"] == "int8" and kwargs["attention_backend"] == "torch"
    args = parse([])
    assert (args.host, args.port, args.max_waiting, args.drain_timeout, args.log_level) == (
        "127.0.0.1",
        8000,
        512,
        30.0,
        "info",
    )
