"""Build the configured proposer: none, n-gram, or a draft model checked against the target."""

from __future__ import annotations

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
    draft_config = replace(config, model=config.draft_model, speculative_method="none", num_speculative_tokens=0,
                           draft_model=None, quantization=config.draft_quantization, draft_quantization=None,
                           max_model_len=target.max_model_len)
    draft = load_model(draft_config, device=target.model.device)
    check_same_vocabulary(target.tokenizer, draft.tokenizer, config.draft_model)
    if draft.model.args.vocab_size != target.model.args.vocab_size:
        raise ValueError(
            f"draft_model={config.draft_model!r} has a vocabulary of {draft.model.args.vocab_size} tokens, "
            f"the target {target.model.args.vocab_size}: a draft must share the target's tokenizer"
        )
    return draft


def build_proposer(config: EngineConfig, target: LoadedModel, draft: LoadedModel | None,
                   num_blocks: int) -> Proposer | None:
    if config.speculative_method == "none":
        return None
    if config.speculative_method == "ngram":
        from specfleet.engine.spec_decode.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from specfleet.engine.spec_decode.draft import DraftModelProposer

    assert draft is not None, "load_draft returns the draft model for speculative_method='draft'"
    runner = ModelRunner(draft.model, num_blocks, config.block_size, config.attention_backend,
                         target.eos_token_ids, config.seed + 1)
    return DraftModelProposer(runner, num_blocks, config.block_size)


def check_same_vocabulary(target_tokenizer, draft_tokenizer, source: str) -> None:
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(
            f"draft_model={source!r} uses a different tokenizer from the target: speculative decoding "
            "needs identical vocabularies"
        )
