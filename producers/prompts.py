"""Prompt validation: which decoded prompts an engine can take, and their tokens (tokenized once).

A prompt no engine can take is dead-lettered by the generator with reason ``invalid`` and the detail returned by
``PromptChecker.check``: empty, text the tokenizer rejects, longer than the engine's ``max_model_len`` together
with ``generator.max_tokens``, or token ids outside the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from topics.schemas import Prompt


class PromptChecker:
    """Tokenizes and checks prompts for one engine. ``vocab_size`` is read lazily (0: no vocabulary check)."""

    def __init__(self, tokenizer: Any, *, max_model_len: int, max_tokens: int,
                 vocab_size: Callable[[], int]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self._vocab_size = vocab_size
        self._vocab: int | None = None

    def tokens(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids: its own ``token_ids`` if it has them, else its text tokenized."""
        if len(prompt.token_ids):
            return [int(t) for t in prompt.token_ids]
        return list(self.tokenizer(prompt.text)["input_ids"])

    def check(self, prompt: Prompt) -> tuple[list[int], str]:
        """``(tokens, "")`` for a prompt the engine can take, else ``([], why not)``."""
        if not prompt.text and not len(prompt.token_ids):
            return [], f"prompt {prompt.prompt_id!r} is empty"
        try:
            tokens = self.tokens(prompt)
        except Exception as exc:  # noqa: BLE001 - hostile text the tokenizer rejects
            return [], f"prompt {prompt.prompt_id!r} does not tokenize: {type(exc).__name__}: {exc}"
        if not tokens:
            return [], f"prompt {prompt.prompt_id!r} is empty"
        if len(tokens) + self.max_tokens > self.max_model_len:
            return [], (f"prompt {prompt.prompt_id!r}: {len(tokens)} tokens + max_tokens {self.max_tokens} "
                        f"exceed max_model_len {self.max_model_len}")
        vocab = self.vocab_size()
        if vocab and (min(tokens) < 0 or max(tokens) >= vocab):
            return [], f"prompt {prompt.prompt_id!r}: token ids outside the vocabulary [0, {vocab})"
        return tokens, ""

    def vocab_size(self) -> int:
        if self._vocab is None:
            try:
                self._vocab = int(self._vocab_size())
            except Exception:  # noqa: BLE001 - an engine without a model config (tests' fakes): no check
                self._vocab = 0
        return self._vocab
