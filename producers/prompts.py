"""Prompt validation: which decoded prompts an engine can take, and their tokens (tokenized once).

A prompt no engine can take is dead-lettered by the generator with reason ``invalid`` and the detail returned by
``PromptChecker.check``: empty, text the tokenizer rejects, longer than the engine's ``max_model_len`` together
with ``generator.max_tokens``, or token ids outside the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from topics.errors import ConfigError
from topics.schemas import Prompt


class PromptChecker:
    """Tokenizes and checks prompts for one engine. ``vocab_size`` is read lazily (0: no vocabulary check).

    With ``chat_template`` the text is one user turn (after a system turn if ``system_prompt``) rendered by the
    tokenizer's chat template with the generation prompt, as an instruct model was tuned on; a tokenizer without a
    chat template is a ``ConfigError`` naming ``generator.chat_template`` at construction (the generator's start).
    """

    def __init__(self, tokenizer: Any, *, max_model_len: int, max_tokens: int,
                 vocab_size: Callable[[], int], chat_template: bool = False, system_prompt: str = "") -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self._vocab_size = vocab_size
        self._vocab: int | None = None
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ConfigError("generator.chat_template", "the model's tokenizer has no chat template")

    def render(self, text: str) -> list[int]:
        """The token ids of a prompt text (through the chat template when it is on)."""
        if not self.chat_template:
            return list(self.tokenizer(text)["input_ids"])
        turns = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        turns.append({"role": "user", "content": text})
        ids = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def tokens(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids: its own ``token_ids`` if it has them (used as they are), else its text
        tokenized (``render``)."""
        if len(prompt.token_ids):
            return [int(t) for t in prompt.token_ids]
        return self.render(prompt.text)

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
