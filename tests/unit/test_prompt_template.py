"""The generator's prompt rendering: plain text, or the model's chat template (``generator.chat_template``)."""

from __future__ import annotations

import pytest

from models.tiny_model import build_tokenizer
from producers.config import GeneratorConfig
from producers.prompts import PromptChecker
from topics.errors import ConfigError
from topics.schemas import Prompt

# a ChatML template of the kind SmolLM2-Instruct ships (rendered by transformers' own Jinja path)
CHATML = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
          "{% if add_generation_prompt %}<assistant>{% endif %}")


def _checker(tok, **kw) -> PromptChecker:
    return PromptChecker(tok, max_model_len=128, max_tokens=8, vocab_size=lambda: 0, **kw)


def test_plain_text_is_tokenized_as_it_is():
    tok = build_tokenizer()
    p = Prompt(prompt_id="p", task="t", text="3+4=")
    tokens, why = _checker(tok).check(p)
    assert why == "" and tokens == tok("3+4=")["input_ids"]


def test_chat_template_wraps_the_text_as_a_user_turn_with_the_generation_prompt():
    tok = build_tokenizer()
    tok.chat_template = CHATML
    p = Prompt(prompt_id="p", task="t", text="3+4=")
    tokens, why = _checker(tok, chat_template=True).check(p)
    assert why == ""
    # the template's text is the whole prompt (no special tokens added around it)
    assert tokens == tok("<user>3+4=|<assistant>", add_special_tokens=False)["input_ids"]
    with_system, _ = _checker(tok, chat_template=True, system_prompt="be brief").check(p)
    assert with_system == tok("<system>be brief|<user>3+4=|<assistant>", add_special_tokens=False)["input_ids"]
    # a prompt that brings its own token ids is used as it is
    own = Prompt(prompt_id="q", task="t", text="x", token_ids=[5, 6, 7])
    assert _checker(tok, chat_template=True).check(own)[0] == [5, 6, 7]


def test_chat_template_without_one_in_the_tokenizer_names_the_key():
    with pytest.raises(ConfigError, match="generator.chat_template"):
        _checker(build_tokenizer(), chat_template=True)


def test_a_system_prompt_needs_the_chat_template():
    with pytest.raises(ConfigError, match="generator.system_prompt"):
        GeneratorConfig(system_prompt="hi")
    assert GeneratorConfig(chat_template=True, system_prompt="hi").system_prompt == "hi"
