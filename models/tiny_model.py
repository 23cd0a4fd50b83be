"""The tiny policy used by tests and the demo: a character-level Llama saved as a Hugging Face directory.

``build_tiny_model(out_dir, seed=0)`` writes, deterministically for a seed, a directory that transformers, vLLM
(CPU) and torchtitan all load:

* ``config.json``: untied fp32 ``LlamaForCausalLM``, hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32,
  intermediate 352, rms_norm_eps 1e-5, rope_theta 1e4 (no rope scaling), vocab 64, 256 positions.
  vLLM's CPU attention needs head_dim >= 32 and float32; torchtitan's RMSNorm defaults to eps 1e-5, and untied
  embeddings avoid vLLM's stale-lm_head bug after a weight reload (see /work/shared/FACTS.md).
* ``model.safetensors``: weights initialised by transformers from ``torch.manual_seed(seed)``.
* ``tokenizer.json`` + ``tokenizer_config.json`` (special tokens inside): a character tokenizer (one token per
  character of ``ALPHABET``; specials ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3) built with
  ``tokenizers`` (a BPE model with no merges, so every character is its own token; text is lower-cased first)
  and saved as a ``PreTrainedTokenizerFast``. Encoding prepends ``<bos>``; decoding concatenates characters
  (``Fuse``), so any text over ``ALPHABET`` round-trips exactly.
* ``generation_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
# 10 digits + 26 letters + 24 punctuation = 60 characters, 64 tokens with the specials.
ALPHABET: str = "0123456789abcdefghijklmnopqrstuvwxyz +-*/=?,.:;!'()[]{}<>#_\n"
VOCAB_SIZE = len(SPECIALS) + len(ALPHABET)
assert VOCAB_SIZE == 64, VOCAB_SIZE

MODEL_CONFIG: dict = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 352,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e4,
    "max_position_embeddings": 256,
    "vocab_size": VOCAB_SIZE,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "attention_bias": False,
    "mlp_bias": False,
}


def _vocab() -> dict[str, int]:
    return {tok: i for i, tok in enumerate((*SPECIALS, *ALPHABET))}


def build_tokenizer():
    """The character tokenizer as a ``PreTrainedTokenizerFast`` (not yet saved)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=_vocab(), merges=[], unk_token="<unk>"))
    tok.add_special_tokens(list(SPECIALS))
    tok.normalizer = normalizers.Lowercase()  # upper-case text (reasoning-gym prompts) maps onto the alphabet
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny model and its tokenizer into ``out_dir`` (created); returns the directory.

    The same seed gives byte-identical weights. An existing directory is overwritten file by file.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(MODEL_CONFIG)
    rope_theta = cfg.pop("rope_theta")
    config = LlamaConfig(
        **cfg,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        architectures=["LlamaForCausalLM"],
    )
    config.dtype = torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    _patch_config(out / "config.json", rope_theta)
    GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=True, temperature=1.0
    ).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    _patch_tokenizer_config(out / "tokenizer_config.json")
    return out


def _patch_tokenizer_config(path: Path) -> None:
    """Name the class every transformers version knows (v5 writes its internal ``TokenizersBackend``)."""
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    data["add_bos_token"] = True
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _patch_config(path: Path, rope_theta: float) -> None:
    """Also write the flat ``rope_theta`` / ``rope_scaling: null`` keys older readers (torchtitan, vLLM) look for."""
    data = json.loads(path.read_text())
    data["rope_theta"] = rope_theta
    data["rope_scaling"] = None
    data["torch_dtype"] = "float32"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def load_tokenizer(path: str | Path):
    """Load the tokenizer of an HF dir (the tiny model's or any other) as a fast tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def ensure_model(model_path: str, run_dir: str | Path, *, seed: int = 0, source: str = "", cache_dir: str = "") -> Path:
    """``model_path`` if set, else the pretrained ``source`` (``models/hf_models.py``, converted once into
    ``cache_dir``), else the tiny model in ``<run_dir>/model`` (built once; safe across processes).

    Concurrent callers each build into a private temporary directory and rename it into place; the loser of the
    rename keeps the winner's (identical, same seed) copy.
    """
    if model_path:
        return Path(model_path)
    if source:
        from models.hf_models import ensure_source_model

        return ensure_source_model(source, cache_dir)
    import os
    import shutil

    target = Path(run_dir) / "model"
    if (target / "tokenizer.json").is_file():
        return target
    tmp = target.with_name(f".model-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(tmp, seed=seed)
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "tokenizer.json").is_file():
            raise
    return target
