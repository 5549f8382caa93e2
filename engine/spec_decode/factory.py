"""Build the configured proposer (spec_decode/methods.py names each method's builder here), and load the
draft model of a method that needs one, checked against the target."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import replace

from specfleet.engine.config import EngineConfig
from specfleet.engine.loader import LoadedModel, load_model
from specfleet.engine.model_runner import ModelRunner
from specfleet.engine.spec_decode.methods import method
from specfleet.engine.spec_decode.proposer import Proposer

# What a method's builder gets: the config, the target, the draft model if load_draft loaded one, and the
# number of KV blocks.
Builder = Callable[[EngineConfig, LoadedModel, LoadedModel | None, int], Proposer]


def load_draft(config: EngineConfig, target: LoadedModel) -> LoadedModel | None:
    """The draft model of a method that needs one, loaded before the KV caches are sized so that both
    caches come out of one memory budget; None for other methods."""
    spec = method(config.speculative_method)
    if spec is None or not spec.needs_draft_model:
        return None
    assert config.draft_model is not None, "EngineConfig's checks require draft_model with this method"
    draft_config = replace(
        config,
        model=config.draft_model,
        speculative_method="none",
        num_speculative_tokens=0,
        draft_model=None,
        quantization=config.draft_quantization,
        draft_quantization=None,
        max_model_len=target.max_model_len,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
    )  # the draft runs whole, on rank 0
    draft = load_model(draft_config, device=target.model.device)
    check_same_vocabulary(target.tokenizer, draft.tokenizer, config.draft_model)
    if draft.model.args.vocab_size != target.model.args.vocab_size:
        raise ValueError(
            f"draft_model={config.draft_model!r} has a vocabulary of {draft.model.args.vocab_size} tokens, "
            f"the target {target.model.args.vocab_size}: a draft must share the target's tokenizer"
        )
    return draft


def build_ngram(
    config: EngineConfig, target: LoadedModel, draft: LoadedModel | None, num_blocks: int
) -> Proposer:
    from specfleet.engine.spec_decode.ngram import NgramProposer

    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def build_draft(
    config: EngineConfig, target: LoadedModel, draft: LoadedModel | None, num_blocks: int
) -> Proposer:
    from specfleet.engine.spec_decode.draft import DraftModelProposer

    if draft is None:
        raise ValueError("speculative_method='draft' needs the draft model that load_draft returns")
    runner = ModelRunner(
        draft.model,
        num_blocks,
        config.block_size,
        config.attention_backend,
        target.eos_token_ids,
        config.seed + 1,
    )
    return DraftModelProposer(runner, num_blocks, config.block_size)


def builder(target: str) -> Builder:
    """A method's builder from its "module:function" declaration."""
    module, _, name = target.partition(":")
    found = getattr(importlib.import_module(module), name, None)
    if not callable(found):
        raise ValueError(f"speculative method builder {target!r} names no function")
    return found


def build_proposer(
    config: EngineConfig, target: LoadedModel, draft: LoadedModel | None, num_blocks: int
) -> Proposer | None:
    spec = method(config.speculative_method)  # refuses an unknown name, listing the known ones
    if spec is None:
        return None
    return builder(spec.builder)(config, target, draft, num_blocks)


def check_same_vocabulary(target_tokenizer, draft_tokenizer, source: str) -> None:
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(
            f"draft_model={source!r} uses a different tokenizer from the target: speculative decoding "
            "needs identical vocabularies"
        )
