"""The shadow model's commit, with a plain torch module standing in for a vLLM model (no engine, no reload).

What the pause relies on: the shadow is a private copy (changing it leaves the live model alone, the KV cache is
shared, not copied), and ``commit`` copies every parameter and buffer into the live tensors' own storage and
installs the functions processing attached (CPU ``cpu_linear`` closures). The reload into the shadow itself is
vLLM's and runs in ``tests/integration/test_weightsync_vllm.py``.
"""

from __future__ import annotations

import types

import pytest
import torch

from weightsync.staging import ShadowModel, _owned_meta


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3), requires_grad=False)
        self.register_buffer("scale", torch.ones(4))
        packed = self.weight.detach().clone()
        self.cpu_linear = lambda x, packed=packed: x @ packed.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cpu_linear(x) * self.scale


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kv_cache = [torch.zeros(1024)]


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = _Layer()
        self.attn = _Attention()
        self.norm = torch.nn.Parameter(torch.ones(3), requires_grad=False)


def _reprocess(layer: _Layer) -> None:
    """What weight processing does to the shadow: new values and a new closure owning its packed copy."""
    layer.weight.data.add_(1.0)
    layer.scale.mul_(2.0)
    packed = layer.weight.detach().clone()
    layer.cpu_linear = lambda x, packed=packed: x @ packed.t()


def test_commit_copies_into_live_storage_and_installs_processed_functions():
    torch.manual_seed(0)
    live = _Model()
    shadow = ShadowModel(live, model_config=None)
    assert shadow.model.attn.kv_cache is live.attn.kv_cache  # shared, never copied
    assert shadow.model.layer.weight.data_ptr() != live.layer.weight.data_ptr()
    x = torch.randn(2, 3)
    before = live.layer(x).clone()
    ptrs = {n: t.data_ptr() for n, t in [*live.named_parameters(), *live.named_buffers()]}

    _reprocess(shadow.model.layer)
    shadow.model.norm.data.fill_(5.0)
    assert torch.equal(live.layer(x), before)  # staging a version leaves the live model alone
    with pytest.raises(RuntimeError, match="nothing staged"):
        shadow.commit()
    shadow.staged = True
    assert shadow.commit() == 4  # weight, scale, norm, cpu_linear
    assert torch.equal(live.layer.weight, shadow.model.layer.weight)
    assert torch.equal(live.layer.scale, shadow.model.layer.scale) and torch.equal(live.norm, torch.full((3,), 5.0))
    assert {n: t.data_ptr() for n, t in [*live.named_parameters(), *live.named_buffers()]} == ptrs
    assert live.layer.cpu_linear is shadow.model.layer.cpu_linear
    expect = (x @ shadow.model.layer.weight.t()) * shadow.model.layer.scale
    assert torch.allclose(live.layer(x), expect)
    committed = live.layer(x).clone()

    _reprocess(shadow.model.layer)  # the next version, staged: the committed closure keeps its own packed copy
    assert torch.equal(live.layer(x), committed)


def test_commit_refuses_a_shape_change():
    live = _Model()
    shadow = ShadowModel(live, model_config=None)
    shadow.model.norm = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    shadow.staged = True
    with pytest.raises(RuntimeError, match="norm"):
        shadow.commit()


def test_owned_meta_rebinds_loaders_from_the_live_layer_to_the_shadow():
    live, mine = _Layer(), _Layer()

    def loader(self, param, weight):  # a weight loader method, as vLLM binds them to their layer
        param.data.copy_(weight)

    meta = torch.empty(4, 3, device="meta")
    meta.output_dim = 0
    bound = types.MethodType(loader, live)

    def online_process_loader(*args):  # vLLM's layerwise wrapper, left on the live layer's metadata
        return bound(*args)

    online_process_loader.__wrapped__ = bound
    meta.weight_loader = online_process_loader
    own = _owned_meta(meta, live, mine)
    assert own is not meta and own.is_meta and own.shape == meta.shape and own.output_dim == 0
    assert own.weight_loader.__self__ is mine and own.weight_loader.__func__ is loader
    assert meta.weight_loader is online_process_loader  # the live layer's metadata is untouched
