"""SmolLM2-135M converted from its GGUF (models/hf_models.py): one untied fp32 HF dir that transformers and the
trainer's torchtitan model (consumers/model.py) load with the same logits as the original GGUF model.

Measured here (fp32, 2 prompts, the shorter one's length): converted dir vs the GGUF model in transformers
max |dlogit| <= 1e-5 (the same weights; the check's tolerance); torchtitan vs transformers max |dlogit| 4.6e-5 on
logits up to 38 in magnitude, so the tolerance is 1e-3, and the argmax tokens are identical. About 5 min here (one
conversion, three model loads).
"""

from __future__ import annotations

import json

import pytest
import torch

from models.hf_models import SMOLLM2_GGUF, ensure_source_model, smollm2_gguf

pytestmark = [pytest.mark.slow, pytest.mark.bigmodel]

TEXTS = ["What is 12 + 7? Answer with a number.", "Spell 'streamforge' backward:"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory):
    cache = tmp_path_factory.mktemp("models")
    return ensure_source_model("smollm2-135m", cache)


@pytest.fixture(scope="module")
def hf_model(converted):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def batch(converted):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    width = min(len(i) for i in ids)
    return torch.tensor([i[:width] for i in ids])


@pytest.mark.timeout(600)
def test_converted_dir_is_untied_fp32_llama_with_the_source_settings(converted) -> None:
    from safetensors import safe_open

    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is False
    assert "quantization_config" not in cfg
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 1e5 and cfg["rope_scaling"] is None
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["head_dim"]) == (576, 30, 9, 64)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"], cfg["vocab_size"]) == (1, 2, 2, 49152)
    with safe_open(str(converted / "model.safetensors"), "pt") as f:
        head, emb = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
    assert head.dtype == torch.float32 and head.shape == (49152, 576)
    assert torch.equal(head, emb)  # an untied copy: the same values at conversion, trained apart after
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2


@pytest.mark.timeout(600)
def test_conversion_is_idempotent(converted) -> None:
    before = (converted / "model.safetensors").stat().st_mtime_ns
    assert ensure_source_model("smollm2-135m", converted.parent) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == before
    assert not [p for p in converted.parent.iterdir() if p.name.startswith(".")]  # no temporary dir left


@pytest.mark.timeout(600)
def test_tokenizer_and_chat_template_match_the_gguf(converted) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    gguf = smollm2_gguf()
    ref = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=SMOLLM2_GGUF)
    for text in TEXTS:
        assert tok(text)["input_ids"] == ref(text)["input_ids"]
        assert tok.decode(tok(text)["input_ids"]) == text
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == ("<|im_end|>", 2, 2, 1)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"), chat


@pytest.mark.timeout(600)
def test_converted_logits_equal_the_gguf_model(hf_model, batch) -> None:
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()  # the source is tied
    assert hf_model.lm_head.weight.data_ptr() != hf_model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        diff = (hf_model(batch).logits - ref(batch).logits).abs().max().item()
    assert diff <= 1e-5, diff


@pytest.mark.timeout(600)
def test_torchtitan_policy_matches_transformers(converted, hf_model, batch) -> None:
    from consumers.model import load_policy

    policy = load_policy(converted, max_seq_len=128)
    assert policy.family == "llama3" and policy.config.enable_weight_tying is False
    with torch.no_grad():
        titan = policy.model(batch)
        ref = hf_model(batch).logits
    diff = (titan - ref).abs().max().item()
    print(f"torchtitan vs transformers max |dlogit| {diff:.2e} (logit scale {ref.abs().max().item():.1f})")
    assert diff <= 1e-3, diff
    assert torch.equal(titan.argmax(-1), ref.argmax(-1))

