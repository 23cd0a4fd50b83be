"""The policy as a torchtitan model built from a Hugging Face directory, and the way back to HF.

One HF dir (``config.json`` + ``*.safetensors``) is shared by the trainer (torchtitan), the generators (vLLM) and
users (transformers). ``load_policy`` derives a torchtitan ``Decoder.Config`` from ``config.json`` (Llama 3 and
Qwen 3 families), builds the model on the meta device, materialises it (optionally FSDP2-sharded, see
``consumers/parallel.py``) and loads the HF weights through torchtitan's state-dict adapter, which handles the q/k
permutation between HF's rotate-half RoPE and torchtitan's complex RoPE.

Choices that keep parity with vLLM and transformers (measured, see FACTS): no RoPE scaling unless the HF config
asks for it, the HF ``rms_norm_eps`` on every norm, untied unless ``tie_word_embeddings``, and plain causal SDPA
as inner attention (FlexAttention has no CPU backward). Rows are right-padded, so causal attention never lets a
real token see padding; packed rows get a block-diagonal causal mask and per-sequence positions
(``token_logprobs``). QKV projections are not fused, so state-dict keys are exactly the adapter's keys.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from topics.errors import ConfigError

_HF_SIDECARS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja")


@dataclass(slots=True)
class Policy:
    """A built policy: the torchtitan module, its config, the adapter, and the family it came from."""

    model: nn.Module
    family: str  # "llama3" | "qwen3"
    config: Any  # torchtitan Decoder.Config
    adapter: Any  # torchtitan StateDictAdapter
    hf_dir: Path
    hf_config: dict[str, Any]

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise ConfigError("model.path", f"{hf_dir} has no config.json")
    return json.loads(path.read_text())


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(hf: dict[str, Any]) -> dict[str, Any]:
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    return {} if kind == "default" else params


def titan_config_from_hf(hf: dict[str, Any], *, max_seq_len: int = 0) -> tuple[str, Any]:
    """The torchtitan family and ``Decoder.Config`` matching an HF ``config.json`` (Llama or Qwen3)."""
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    model_type = hf.get("model_type", "")
    dim, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    n_kv = int(hf.get("num_key_value_heads") or n_heads)
    head_dim = int(hf.get("head_dim") or dim // n_heads)
    vocab, eps = int(hf["vocab_size"]), float(hf.get("rms_norm_eps", 1e-6))
    seq = int(max_seq_len or hf.get("max_position_embeddings") or 2048)
    tied = bool(hf.get("tie_word_embeddings", False))
    scaling = _rope_scaling(hf)
    rope_kw: dict[str, Any] = {"dim": head_dim, "max_seq_len": seq, "theta": _rope_theta(hf), "scaling": "none"}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        rope_kw.update(scaling="llama", scaling_factor=float(scaling["factor"]),
                       low_freq_factor=float(scaling["low_freq_factor"]),
                       high_freq_factor=float(scaling["high_freq_factor"]),
                       original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    elif scaling:
        raise ConfigError("model.path", f"unsupported rope scaling {scaling}")
    norm_init = {"weight": nn.init.ones_}
    linear_init = {"weight": lambda t: nn.init.trunc_normal_(t, std=0.02), "bias": nn.init.zeros_}

    if model_type == "llama":
        from torchtitan.models.llama3 import Llama3Model
        from torchtitan.models.llama3 import _build_llama3_layers as build_layers

        if head_dim * n_heads != dim:
            raise ConfigError("model.path", "torchtitan's Llama needs head_dim == hidden_size / heads")
        layers = build_layers(n_layers=int(hf["num_hidden_layers"]), dim=dim, n_heads=n_heads, n_kv_heads=n_kv,
                              hidden_dim=int(hf["intermediate_size"]), rope=ComplexRoPE.Config(**rope_kw),
                              fuse_qkv=False, attn_backend="flex")
        family, cls = "llama3", Llama3Model
    elif model_type == "qwen3":
        from torchtitan.models.qwen3 import _build_qwen3_layers as build_layers
        from torchtitan.models.qwen3.model import Qwen3Model

        layers = build_layers(n_layers=int(hf["num_hidden_layers"]), dim=dim, n_heads=n_heads, n_kv_heads=n_kv,
                              head_dim=head_dim, hidden_dim=int(hf["intermediate_size"]), fuse_qkv=False,
                              attn_backend="flex", rope=CosSinRoPE.Config(**rope_kw))
        family, cls = "qwen3", Qwen3Model
    else:
        raise ConfigError("model.path", f"model_type {model_type!r} is not supported (llama, qwen3)")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm.eps = eps
        layer.ffn_norm.eps = eps
        if getattr(layer.attention, "qk_norm", None) is not None:
            layer.attention.qk_norm.eps = eps
    config = cls.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=tied, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init={"weight": lambda t: nn.init.normal_(t, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=norm_init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=linear_init),
    )
    return family, config


def _adapter(family: str, config: Any, hf_dir: Path) -> Any:
    if family == "llama3":
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter as Adapter
    else:
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter as Adapter
    return Adapter(config, str(hf_dir))


def read_hf_weights(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the HF dir's safetensors files, by HF name (CPU)."""
    from safetensors.torch import load_file

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError("model.path", f"{hf_dir} has no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def load_policy(
    hf_dir: str | Path,
    *,
    max_seq_len: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    mesh: Any = None,
) -> Policy:
    """Build the torchtitan model for ``hf_dir`` and load its HF weights.

    With ``mesh`` (a 1-D DeviceMesh) the model is FSDP2-sharded before materialisation and the full weights are
    loaded shard by shard (``consumers.parallel.shard_policy``); every rank reads the same HF files.
    """
    hf_dir = Path(hf_dir)
    hf = read_hf_config(hf_dir)
    family, config = titan_config_from_hf(hf, max_seq_len=max_seq_len)
    device = torch.device(device)
    with torch.device("meta"):
        model = config.build()
    if mesh is not None:
        from consumers.parallel import shard_policy

        shard_policy(model, mesh)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=device)
    adapter = _adapter(family, config, hf_dir)
    state = adapter.from_hf(read_hf_weights(hf_dir))
    load_full_state(model, state)
    if dtype != torch.float32:  # never Module.to(dtype): it would cast the complex RoPE cache to real
        for param in model.parameters():
            param.data = param.data.to(dtype)
    return Policy(model=model, family=family, config=config, adapter=adapter, hf_dir=hf_dir, hf_config=hf)


def load_full_state(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy full (unsharded) tensors into the model's parameters, sharded (DTensor) or not. Strict on names."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    own = model.state_dict()
    missing = sorted(set(own) - set(full))
    unexpected = sorted(set(full) - set(own))
    if missing or unexpected:
        raise ValueError(f"state mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, target in own.items():
            src = full[name].to(dtype=target.dtype)
            if isinstance(target, DTensor):
                src = distribute_tensor(src.to(target.device), target.device_mesh, target.placements)
                target.to_local().copy_(src.to_local())
            else:
                target.copy_(src)


def full_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(torchtitan name, full tensor) for every entry of the model's state dict; gathers DTensor shards."""
    from torch.distributed.tensor import DTensor

    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        yield name, value.detach()


def hf_named_tensors(policy: Policy) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) pairs, as in the HF dir (collective under FSDP: call on every rank)."""
    hf = policy.adapter.to_hf(dict(full_state(policy.model)))
    for name, value in hf.items():
        yield name, value.detach().contiguous()


def export_hf(policy: Policy, out_dir: str | Path, source_dir: str | Path | None = None) -> Path:
    """Write an HF dir (``model.safetensors`` + config and tokenizer files copied from ``source_dir``).

    Collective under FSDP (every rank gathers); only the caller decides which rank writes (``write``-free design:
    call it on rank 0 after gathering with ``hf_named_tensors`` yourself if that matters).
    Writes into a temporary sibling and renames, so a reader never sees a half-written dir.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    source_dir = Path(source_dir or policy.hf_dir)
    tensors = {name: t.to("cpu").contiguous() for name, t in hf_named_tensors(policy)}
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in _HF_SIDECARS:
        if (source_dir / name).exists():
            shutil.copy2(source_dir / name, tmp / name)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def token_logprobs(model: nn.Module, input_ids: torch.Tensor, *, temperature: float = 1.0,
                   with_entropy: bool = False, position_ids: torch.Tensor | None = None,
                   segment_ids: torch.Tensor | None = None,
                   scored: torch.Tensor | None = None,
                   entropy_grad: bool = True, attn_mask: torch.Tensor | None = None,
                   prev: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probabilities aligned with the Batch convention (``topics/schemas.py``).

    ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` for ``t >= 1`` and ``out[b, 0] = 0``: the model's
    ``logits[:, :-1]`` scored against ``input_ids[:, 1:]``, placed at ``[:, 1:]``, so ``out`` lines up with
    ``old_logprobs`` and ``loss_mask``. With ``with_entropy`` also returns the per-token entropy of the
    predictive distribution, aligned the same way (without autograd when ``entropy_grad`` is False).

    Packed rows (``segment_ids`` and ``position_ids``, ``[R, T]``): a token attends only to the earlier tokens of
    its own segment (a block-diagonal causal mask, ``segment_mask``), RoPE uses ``position_ids`` (restarting at 0
    in each segment), and ``out`` is 0 at each segment's first token (nothing of its own before it), so each
    segment scores exactly as it would alone in a padded row.

    ``scored`` (``[B, T]`` bool, e.g. the loss mask): only those positions are needed; the others come back 0. On
    a single-device decoder the vocabulary projection, softmax and entropy then run on those positions only (the
    lm_head over a 49k vocabulary is a large share of a step, and prompt positions need none of it); a sharded
    model (DTensor lm_head) computes every position as without it. Under ``torch.autocast`` (``trainer.autocast``)
    that projection runs in fp32: bf16 logits would move the logprobs, and the importance ratio, by ~0.05 nats.

    Shared-prefix rows (``consumers/prefix.py``): ``attn_mask`` (``[R, 1, T, T]`` bool), ``position_ids``,
    ``scored`` and ``prev`` (``[R, T]``: the column whose hidden state predicts each token); ``out[r, t]`` is then
    the logprob of ``input_ids[r, t]`` from the hidden state at ``prev[r, t]``, at the scored positions only.
    """
    if prev is not None:
        return _prefix_logprobs(model, input_ids, position_ids, attn_mask, prev, scored, temperature=temperature,
                                with_entropy=with_entropy, entropy_grad=entropy_grad)
    args = (input_ids.long(),)
    if segment_ids is not None:
        if position_ids is None:
            raise ValueError("packed rows need position_ids with segment_ids")
        _allow_dense_masks(model)
        args = (input_ids.long(), position_ids.long(), segment_mask(segment_ids))
    head = _local_lm_head(model) if scored is not None else None
    target = input_ids[:, 1:].long()
    if head is None:
        logits = model(*args)[:, :-1].float()
    else:  # position t is scored from the hidden state at t - 1
        model._skip_lm_head = True
        try:
            hidden = model(*args)
        finally:
            model._skip_lm_head = False
        where = scored[:, 1:].bool()
        picked = hidden[:, :-1][where]
        if torch.is_autocast_enabled(picked.device.type):  # trainer.autocast: the logprobs' own projection in fp32
            with torch.autocast(picked.device.type, enabled=False):
                logits = head(picked.float()).float()
        else:
            logits = head(picked).float()
        target = target[where]
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ent = None
    if with_entropy:
        ent = entropy_of(logp_all, grad=torch.is_grad_enabled() and entropy_grad)
    if head is not None:  # back to [B, T - 1], zeros where nothing was scored
        lp = torch.zeros(where.shape, dtype=lp.dtype, device=lp.device).masked_scatter(where, lp)
        if ent is not None:
            ent = torch.zeros(where.shape, dtype=ent.dtype, device=ent.device).masked_scatter(where, ent)
    out = torch.nn.functional.pad(lp, (1, 0))
    ent = torch.nn.functional.pad(ent, (1, 0)) if ent is not None else None
    if segment_ids is not None:  # a segment's first token is scored from another segment's last: not a logprob
        first = torch.ones_like(segment_ids, dtype=torch.bool)
        first[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
        out = out.masked_fill(first, 0.0)
        ent = ent.masked_fill(first, 0.0) if ent is not None else None
    return out, ent


def _prefix_logprobs(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                     attn_mask: torch.Tensor | None, prev: torch.Tensor, scored: torch.Tensor | None, *,
                     temperature: float, with_entropy: bool, entropy_grad: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_logprobs`` of shared-prefix rows: each scored token from the hidden state at ``prev``."""
    if position_ids is None or attn_mask is None or scored is None:
        raise ValueError("shared-prefix rows need position_ids, attn_mask and scored with prev")
    _allow_dense_masks(model)
    args = (input_ids.long(), position_ids.long(), attn_mask)
    where = scored.bool()
    row, col = where.nonzero(as_tuple=True)
    src = prev[row, col]
    head = _local_lm_head(model)
    if head is None:  # a sharded head: every position's logits, then the scored ones
        logits = model(*args)[row, src].float()
    else:
        model._skip_lm_head = True
        try:
            hidden = model(*args)
        finally:
            model._skip_lm_head = False
        picked = hidden[row, src]
        if torch.is_autocast_enabled(picked.device.type):  # the logprobs' own projection in fp32, as above
            with torch.autocast(picked.device.type, enabled=False):
                logits = head(picked.float()).float()
        else:
            logits = head(picked).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = logp_all.gather(-1, input_ids[row, col].long().unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(where.shape, dtype=lp.dtype, device=lp.device).index_put((row, col), lp)
    ent = None
    if with_entropy:
        e = entropy_of(logp_all, grad=torch.is_grad_enabled() and entropy_grad)
        ent = torch.zeros(where.shape, dtype=e.dtype, device=e.device).index_put((row, col), e)
    return out, ent


# elements of one chunk of the entropy metric: on CPU 2 MB that stay in cache (the whole [N, V] product, 200 MB at
# 1,024 positions of a 49k vocabulary, took 114-124 ms against 24-32 ms in chunks; bench/RESULTS.md); elsewhere 1 GB
ENTROPY_CHUNK_ELEMENTS = {"cpu": 1 << 19}
ENTROPY_CHUNK_DEFAULT = 1 << 28


def entropy_of(logp: torch.Tensor, *, grad: bool) -> torch.Tensor:
    """Entropy ``-sum(p log p)`` over the last dim of log-probabilities ``[N, V]``. With ``grad`` (an entropy term
    in the loss) in one autograd expression; as a metric without autograd, in chunks of rows, which on CPU is 4-5x
    faster and allocates no ``[N, V]`` intermediate."""
    if grad:
        return -(logp.exp() * logp).sum(-1)
    with torch.no_grad():
        flat = logp.reshape(-1, logp.shape[-1])
        out = torch.empty(flat.shape[0], dtype=logp.dtype, device=logp.device)
        step = max(1, ENTROPY_CHUNK_ELEMENTS.get(logp.device.type, ENTROPY_CHUNK_DEFAULT) // max(1, flat.shape[1]))
        for i in range(0, flat.shape[0], step):
            part = flat[i:i + step]
            torch.sum(part.exp().mul_(part), dim=-1, out=out[i:i + step]).neg_()
        return out.view(logp.shape[:-1])


def _local_lm_head(model: nn.Module) -> nn.Module | None:
    """The decoder's lm_head when hidden states can be projected at chosen positions (a torchtitan decoder whose
    head is not sharded), else None."""
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(model, "_skip_lm_head"):
        return None
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in head.parameters()):
        return None
    return head


def segment_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[R, 1, T, T]`` boolean attention mask (True = may attend): query ``i`` sees key ``j <= i`` of the same
    segment. Padding (``-1``) is a segment of its own, so no query row is empty (SDPA would give NaN)."""
    t = segment_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    return (same & causal).unsqueeze(1)


def _allow_dense_masks(model: nn.Module) -> None:
    """Let the model's plain causal SDPA inner attentions take a dense boolean mask (``segment_mask``).

    torchtitan's ``ScaledDotProductAttention`` refuses ``attention_masks``; its subclass here passes one to SDPA
    as ``attn_mask`` (and is unchanged without one). Swapped in place once per module: it holds no state.
    """
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for module in model.modules():
        if type(module) is ScaledDotProductAttention:
            module.__class__ = _masked_sdpa_class()


_MASKED_SDPA: type | None = None


def _masked_sdpa_class() -> type:
    global _MASKED_SDPA
    if _MASKED_SDPA is None:
        from torchtitan.models.common.attention import ScaledDotProductAttention

        class MaskedSDPA(ScaledDotProductAttention):
            """Causal SDPA, or SDPA under a dense boolean ``attention_masks`` ``[B, 1, L, L]`` when given."""

            def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                        attention_masks: Any = None, scale: float | None = None, enable_gqa: bool = False,
                        is_causal: bool = True, **kwargs: Any) -> torch.Tensor:
                if attention_masks is None:
                    return super().forward(q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa,
                                           is_causal=is_causal, **kwargs)
                out = torch.nn.functional.scaled_dot_product_attention(
                    q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
                    attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa)
                return out.transpose(1, 2)

        _MASKED_SDPA = MaskedSDPA
    return _MASKED_SDPA


def describe(policy: Policy) -> dict[str, Any]:
    n = sum(p.numel() for p in policy.model.parameters())
    return {"family": policy.family, "params": int(n), "vocab": policy.vocab_size, "dim": int(policy.config.dim)}
