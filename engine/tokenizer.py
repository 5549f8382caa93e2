"""What the engine uses of a tokenizer: the part of transformers' `PreTrainedTokenizerBase` it calls.

A Protocol, so the engine's types say which methods a tokenizer must have without importing transformers
(and so a test can pass a small tokenizer of its own)."""

from __future__ import annotations

from typing import Any, Protocol


class Tokenizer(Protocol):
    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def all_special_ids(self) -> list[int]: ...

    # Keyword-only past the first argument: transformers' tokenizers take more parameters in between.
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str | list[str]: ...

    def get_vocab(self) -> dict[str, int]: ...

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
    ) -> Any: ...


def chat_prompt_ids(tokenizer: Tokenizer, model_name: str, messages: list[dict]) -> list[int]:
    """Prompt token ids for a conversation, ending with the assistant's turn to speak: the offline engine's
    and the API server's (which holds the tokenizer without the engine) one rule."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {model_name!r} has no chat template; use completions instead")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
