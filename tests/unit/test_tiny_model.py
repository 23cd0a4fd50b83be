"""The tiny model directory: tokenizer round-trip, deterministic weights, the config every loader relies on."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from models.tiny_model import ALPHABET, BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, build_tiny_model, load_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_tokenizer_round_trips_every_alphabet_character(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    assert len(tok) == VOCAB_SIZE == 64
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    ids = tok(ALPHABET)["input_ids"]
    assert ids[0] == BOS_ID
    assert len(ids) == len(ALPHABET) + 1  # one token per character
    assert len(set(ids[1:])) == len(ALPHABET)
    assert tok.decode(ids, skip_special_tokens=True) == ALPHABET
    assert tok.decode(tok("7+8=")["input_ids"][1:]) == "7+8="


def test_tokenizer_lowercases_and_maps_unknown_characters(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    assert tok("AbC")["input_ids"] == tok("abc")["input_ids"]
    assert tok("~")["input_ids"] == [BOS_ID, tok.unk_token_id]


def test_model_loads_in_transformers_with_the_agreed_config(tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    c = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (128, 2, 4, 2)
    assert (c.head_dim, c.intermediate_size, c.vocab_size) == (32, 352, 64)
    assert c.rms_norm_eps == 1e-5
    assert c.rope_parameters["rope_theta"] == 1e4 and c.rope_parameters["rope_type"] == "default"
    assert c.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32
    with torch.no_grad():
        logits = model(torch.tensor([[BOS_ID, 5, 6]])).logits
    assert logits.shape == (1, 3, 64) and torch.isfinite(logits).all()


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_same_seed_same_weights_other_seed_different(tiny_dir, tmp_path):
    assert _digest(build_tiny_model(tmp_path / "again", seed=0)) == _digest(tiny_dir)
    assert _digest(build_tiny_model(tmp_path / "other", seed=1)) != _digest(tiny_dir)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tiny_dir / name).is_file()
