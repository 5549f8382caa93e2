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
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
    ) -> Any: ...


def chat_prompt_ids(
    tokenizer: Tokenizer,
    model_name: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
) -> list[int]:
    """Prompt token ids for a conversation, by default ending with the assistant's turn to speak; as vLLM's
    `LLM.chat`, `continue_final_message` leaves the last message open for the model to continue (with
    `add_generation_prompt=False`), and `chat_template` replaces the model's template."""
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message=True continues the last message and add_generation_prompt=True starts a "
            "new one: pass add_generation_prompt=False with it"
        )
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {model_name!r} has no chat template; use completions instead")
    ids = tokenizer.apply_chat_template(
        messages,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=True,
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
