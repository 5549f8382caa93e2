"""Build the configured proposer: none, n-gram, or a draft model checked against the target."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from specfleet.engine.config import EngineConfig
from specfleet.engine.loader import LoadedModel, load_model
from specfleet.engine.model_runner import ModelRunner
from specfleet.engine.spec_decode.proposer import Proposer


def load_draft(config: EngineConfig, target: LoadedModel) -> LoadedModel | None:
    """The draft model of a `draft` proposer, loaded before the KV caches are sized so that both caches
    come out of one memory budget; None for other methods."""
    if config.speculative_method != "draft":
        return None
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


def _ngram(config: EngineConfig, target: LoadedModel, draft: LoadedModel | None, num_blocks: int) -> Proposer:
    from specfleet.engine.spec_decode.ngram import NgramProposer

    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def _draft(config: EngineConfig, target: LoadedModel, draft: LoadedModel | None, num_blocks: int) -> Proposer:
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


# speculative_method -> builder. A new proposer is one entry here (and its name in config.SPECULATIVE_METHODS,
# which a test keeps equal to these keys plus "none").
PROPOSERS: dict[str, Callable[[EngineConfig, LoadedModel, LoadedModel | None, int], Proposer]] = {
    "ngram": _ngram,
    "draft": _draft,
}


def build_proposer(
    config: EngineConfig, target: LoadedModel, draft: LoadedModel | None, num_blocks: int
) -> Proposer | None:
    if config.speculative_method == "none":
        return None
    builder = PROPOSERS.get(config.speculative_method)
    if builder is None:
        raise ValueError(
            f"speculative_method={config.speculative_method!r} has no proposer; known: {sorted(PROPOSERS)}"
        )
    return builder(config, target, draft, num_blocks)


def check_same_vocabulary(target_tokenizer, draft_tokenizer, source: str) -> None:
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(
            f"draft_model={source!r} uses a different tokenizer from the target: speculative decoding "
            "needs identical vocabularies"
        )
