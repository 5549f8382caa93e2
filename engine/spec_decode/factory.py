"""Build the configured proposer: none, n-gram, or a draft model checked against the target."""

from __future__ import annotations

from dataclasses import replace

from specfleet.engine.config import EngineConfig
from specfleet.engine.model_runner import ModelRunner
from specfleet.engine.spec_decode.proposer import Proposer


def build_proposer(config: EngineConfig, target: ModelRunner, loaded) -> Proposer | None:
    if config.speculative_method == "none":
        return None
    if config.speculative_method == "ngram":
        from specfleet.engine.spec_decode.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from specfleet.engine.loader import load_model
    from specfleet.engine.spec_decode.draft import DraftModelProposer

    draft_config = replace(config, model=config.draft_model, speculative_method="none", num_speculative_tokens=0,
                           draft_model=None, quantization=config.draft_quantization, draft_quantization=None, max_model_len=loaded.max_model_len, num_kv_blocks=loaded.num_kv_blocks)
    draft = load_model(draft_config, device=target.model.device)
    check_same_vocabulary(loaded.tokenizer, draft.tokenizer, config.draft_model)
    if draft.model.args.vocab_size != target.model.args.vocab_size:
        raise ValueError(
            f"draft_model={config.draft_model!r} has a vocabulary of {draft.model.args.vocab_size} tokens, "
            f"the target {target.model.args.vocab_size}: a draft must share the target's tokenizer"
        )
    runner = ModelRunner(draft.model, loaded.num_kv_blocks, config.block_size, config.attention_backend,
                         loaded.eos_token_ids, config.seed + 1)
    return DraftModelProposer(runner, loaded.num_kv_blocks, config.block_size)


def check_same_vocabulary(target_tokenizer, draft_tokenizer, source: str) -> None:
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(
            f"draft_model={source!r} uses a different tokenizer from the target: speculative decoding "
            "needs identical vocabularies"
        )
