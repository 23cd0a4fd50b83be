"""Every built-in loss with a TRL counterpart against TRL's own code: ``GRPOTrainer._compute_loss`` of TRL 1.16.0
(the ``dev`` extra), called on the same tensors, with GRPOConfig's defaults and with each hyperparameter both share.

The trainer is made without ``__init__`` (``object.__new__``): ``_compute_loss`` reads plain attributes that
``__init__`` copies from its ``GRPOConfig`` (set here from a real one, as ``__init__`` does), the accelerator (one
process: gather and reduce are the identity) and the model forward, replaced by one that returns the test's
logprobs and entropies. Everything after the forward is TRL's code: ratios, clipping, KL, masks, aggregation and
the entropy bonus. Single process, no gradient accumulation (``steps_per_generation`` 1): the case every
streamforge step is, data-parallel shares being checked against it in ``test_losses.py``.

Compared: the loss (to 1e-6 in float32), its gradient with respect to the logprobs and the entropies, and the
metrics both log (``kl``, ``entropy``, the clipped fraction). No TRL counterpart: ``reinforce``, ``decoupled_ppo``,
and the options ``is_cap`` and ``ratio_mask_threshold``; TRL's ``luspo`` and ``vespo`` have no streamforge one.
"""

from __future__ import annotations

import collections
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from consumers.losses import PolicyLoss, make_loss

trl = pytest.importorskip("trl", minversion="1.16")  # the dev extra; TRL's own loss code is the reference
GRPOConfig, GRPOTrainer = trl.GRPOConfig, trl.GRPOTrainer

# streamforge built-in -> (GRPOConfig.loss_type, importance_sampling_level)
COUNTERPARTS = {"grpo": ("grpo", "token"), "bnpo": ("bnpo", "token"), "dapo": ("dapo", "token"),
                "dr_grpo": ("dr_grpo", "token"), "gspo": ("grpo", "sequence"), "cispo": ("cispo", "token"),
                "sapo": ("sapo", "token")}
CLIPPED = ("grpo", "bnpo", "dapo", "dr_grpo", "gspo")
# the hyperparameters both take, with GRPOConfig's names ({} = every default); streamforge's `level` is TRL's
# importance_sampling_level
SHARED = [{}, {"epsilon": 0.1, "epsilon_high": 0.3}, {"use_bias_correction_kl": False},
          {"off_policy_mask_threshold": 0.05}, {"entropy_coef": 0.01}]
EXTRA = [("grpo", {"delta": 1.3}), ("dapo", {"epsilon_high": 0.28, "delta": 1.4}), ("gspo", {"delta": 1.05}),
         ("sapo", {"sapo_temperature_pos": 0.7, "sapo_temperature_neg": 1.3}),
         ("dr_grpo", {"max_completion_length": 512}), ("gspo", {"epsilon": 0.02, "epsilon_high": 0.03}),
         ("cispo", {"epsilon_high": 1.1}), ("cispo", {"epsilon_high": 5.0})]
EXTRA += [(n, {**kw, "importance_sampling_level": "sequence"})
          for n, kw in [("bnpo", {}), ("dapo", {"delta": 1.3}), ("dr_grpo", {"max_completion_length": 16}),
                        ("cispo", {"epsilon_high": 1.1}), ("sapo", {})]]
# dr_grpo's normaliser: GRPOConfig's generation length (512 by default), which the trainer always passes as the
# generators' max_tokens; called without it, streamforge's dr_grpo uses the mask's width (no generation length)
LENGTH = {"dr_grpo": {"max_completion_length": 16}}
CASES = [(n, {**LENGTH.get(n, {}), **kw}) for n in COUNTERPARTS for kw in SHARED] + EXTRA


def tensors(seed: int = 0, b: int = 6, t: int = 9):
    """Responses of different lengths (one empty), ratios around 1 +- 0.35 so that clips bind on both sides."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3 - 0.1
    logp = old + torch.randn(b, t, generator=g) * 0.35
    ref = logp + torch.randn(b, t, generator=g) * 0.3
    mask = torch.zeros(b, t)
    for i in range(b - 1):
        mask[i, 1: 2 + i + (i % 3)] = 1
    adv = torch.tensor([1.0, -0.5, 0.25, -1.5, 0.75, -0.25])[:b]
    ent = torch.rand(b, t, generator=g) * 2
    return logp, old, adv, mask, ref, ent


def trl_trainer(loss_type: str, level: str, **kw) -> GRPOTrainer:
    """A GRPOTrainer whose ``_compute_loss`` runs on given tensors; attributes as ``GRPOTrainer.__init__`` sets
    them from ``args``."""
    args = GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", loss_type=loss_type,
                      importance_sampling_level=level, **kw)
    tr = object.__new__(GRPOTrainer)
    tr.args = args
    for name in ("loss_type", "beta", "importance_sampling_level", "off_policy_mask_threshold",
                 "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy", "max_completion_length",
                 "use_vllm", "vllm_importance_sampling_correction"):
        setattr(tr, name, getattr(args, name))
    tr.epsilon_low = args.epsilon
    tr.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    tr._entropy_bonus_enabled = tr.entropy_coef != 0.0 or tr.use_adaptive_entropy
    tr.aux_loss_enabled = False
    tr.current_gradient_accumulation_steps = 1
    tr._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    tr.model = SimpleNamespace(training=True)
    tr.accelerator = SimpleNamespace(num_processes=1, sync_gradients=True, gather=lambda x: x,
                                     gather_for_metrics=lambda x: x, reduce=lambda x, reduction="sum": x)
    return tr


def run_trl(tr: GRPOTrainer, logp, old, adv, mask, ref, ent) -> tuple[torch.Tensor, dict[str, float]]:
    b, t = logp.shape
    tr._get_per_token_logps_and_entropies = lambda *a, **k: (logp, ent, None)  # the model forward, replaced
    inputs = {"prompt_ids": torch.zeros(b, 1, dtype=torch.long), "prompt_mask": torch.ones(b, 1, dtype=torch.long),
              "completion_ids": torch.zeros(b, t, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    loss = tr._compute_loss(None, inputs)
    return loss, {k: v[-1] for k, v in tr._metrics["train"].items()}


# streamforge metric -> TRL metric
METRICS = {"kl": "kl", "entropy": "entropy", "policy_loss": "policy_loss"}
CLIP_METRIC = {"cispo": "cispo_clip_ratio", **{n: "clip_ratio/region_mean" for n in CLIPPED}}


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("name,kw", CASES, ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'defaults'}"
                                                 for n, kw in CASES])
def test_loss_equals_trl_compute_loss(name, kw, beta):
    loss_type, level = COUNTERPARTS[name]
    kw = dict(kw)
    level = kw.pop("importance_sampling_level", level)
    ours_kw = kw if level == COUNTERPARTS[name][1] else {**kw, "level": level}
    logp, old, adv, mask, ref, ent = tensors()
    ours_lp, theirs_lp = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    ours_ent, theirs_ent = ent.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    ours, m = make_loss(name, beta=beta, **ours_kw)(ours_lp, old, adv, mask, ref, entropy=ours_ent)
    theirs, tm = run_trl(trl_trainer(loss_type, level, beta=beta, **kw), theirs_lp, old, adv, mask, ref, theirs_ent)
    assert abs(ours.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item())), (ours.item(), theirs.item())
    ours.backward()
    theirs.backward()
    assert torch.allclose(ours_lp.grad, theirs_lp.grad, rtol=1e-5, atol=1e-7)
    assert (ours_ent.grad is None) == (theirs_ent.grad is None) == (not kw.get("entropy_coef"))
    if ours_ent.grad is not None:  # the entropy bonus: its gradient too
        assert torch.allclose(ours_ent.grad, theirs_ent.grad, rtol=1e-5, atol=1e-7)
    compared = {k: v for k, v in METRICS.items() if v in tm}
    if name in CLIP_METRIC:
        compared["clip_fraction"] = CLIP_METRIC[name]
    assert ("kl" in compared) == (beta > 0) and "entropy" in compared
    for ours_key, trl_key in compared.items():
        assert m[ours_key] == pytest.approx(tm[trl_key], rel=1e-5, abs=1e-7), (ours_key, m[ours_key], tm[trl_key])


def test_the_cases_bind_the_clips_masks_and_kl():
    """The comparison means something: on these tensors the clips bind on both sides, the off-policy mask drops a
    row, delta caps a ratio, and the KL's bias correction changes the loss."""
    logp, old, adv, mask, ref, _ = tensors()
    m = make_loss("grpo")(logp, old, adv, mask)[1]
    assert 0.1 < m["clip_fraction"] < 0.6
    ratio = torch.exp(logp - old)[mask == 1]
    assert (ratio > 1.3).any() and (ratio < 0.8).any()
    assert make_loss("bnpo", off_policy_mask_threshold=0.05)(logp, old, adv, mask)[1]["off_policy_masked"] > 0
    with_corr = make_loss("grpo", beta=0.04)(logp, old, adv, mask, ref)[0]
    without = make_loss("grpo", beta=0.04, use_bias_correction_kl=False)(logp, old, adv, mask, ref)[0]
    assert abs(with_corr.item() - without.item()) > 1e-5  # ten times the comparison's tolerance


def test_defaults_are_grpoconfigs():
    """Every hyperparameter both have defaults to GRPOConfig's value, in every built-in with a counterpart (a
    paper's recommended value is in the built-in's docstring, not its default)."""
    fields = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for name in COUNTERPARTS:
        fn = make_loss(name)
        assert isinstance(fn, PolicyLoss)
        assert fn.epsilon_low == fields["epsilon"], name
        want_high = fields["epsilon"] if fields["epsilon_high"] is None else fields["epsilon_high"]
        assert fn.epsilon_high == want_high, name
        assert fn.beta == fields["beta"] and fn.delta == fields["delta"], name
        assert fn.use_bias_correction_kl is fields["use_bias_correction_kl"], name
        assert fn.off_policy_mask_threshold == fields["off_policy_mask_threshold"], name
        assert fn.entropy_coef == fields["entropy_coef"], name
        assert fn.sapo_temperature_pos == fields["sapo_temperature_pos"], name
        assert fn.sapo_temperature_neg == fields["sapo_temperature_neg"], name
        assert fn.level == ("sequence" if name == "gspo" else fields["importance_sampling_level"]), name


def trl_vllm_is_ratio(trainer_lp: torch.Tensor, sampling_lp: torch.Tensor, mask: torch.Tensor, mode: str,
                      lo: float | None, hi: float | None) -> torch.Tensor:
    """TRL 1.16's ``importance_sampling_ratio`` input, as ``GRPOTrainer._generate_and_score_completions`` computes it
    from the trainer's and vLLM's logprobs (that method generates, so it cannot be called here; these lines follow
    it step by step: the masked difference, summed per row in the ``sequence_*`` modes, exp, then truncated or
    masked)."""
    diff = torch.nan_to_num((trainer_lp - sampling_lp) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(dim=-1, keepdim=True) if mode in ("sequence_mask", "sequence_truncate") else diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    bad = (ratio < (lo if lo is not None else -float("inf"))) | (ratio > (hi if hi is not None else float("inf")))
    return ratio.masked_fill(bad, 0.0)


BEHAVIOUR = [("grpo", {}), ("grpo", {"behaviour_correction": "token_truncate", "behaviour_clip_max": 2.0}),
             ("dapo", {"behaviour_correction": "sequence_truncate", "behaviour_clip_min": 0.5}),
             ("gspo", {"behaviour_correction": "token_mask", "behaviour_clip_min": 0.8, "behaviour_clip_max": 1.3}),
             ("grpo", {"off_policy_mask_threshold": 0.05}), ("bnpo", {"behaviour_clip_max": 1.5})]


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("name,kw", BEHAVIOUR, ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'defaults'}"
                                                    for n, kw in BEHAVIOUR])
def test_behaviour_correction_equals_trl_on_vllm_samples(name, kw, beta):
    """``behaviour_correction`` against TRL's loss on vLLM samples (``use_vllm``, its importance-sampling
    correction on): TRL's old logprobs are its trainer's own (with one step per batch, the current ones), vLLM's
    logprobs (our ``old_logprobs``) enter only through the importance ratio and the off-policy mask."""
    kw = {"behaviour_correction": "sequence_mask", **kw}  # TRL's default mode
    loss_type, level = COUNTERPARTS[name]
    mode, lo, hi = kw["behaviour_correction"], kw.get("behaviour_clip_min"), kw.get("behaviour_clip_max", 3.0)
    logp, vllm_lp, adv, mask, ref, ent = tensors()
    trl_kw = {"vllm_importance_sampling_mode": mode, "vllm_importance_sampling_clip_min": lo,
              "vllm_importance_sampling_clip_max": hi,
              **{k: v for k, v in kw.items() if not k.startswith("behaviour_")}}
    tr = trl_trainer(loss_type, level, beta=beta, use_vllm=True, vllm_importance_sampling_correction=True, **trl_kw)
    ours_lp, theirs_lp = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    ours, m = make_loss(name, beta=beta, **kw)(ours_lp, vllm_lp, adv, mask, ref, entropy=ent)
    b, t = logp.shape
    tr._get_per_token_logps_and_entropies = lambda *a, **k: (theirs_lp, ent, None)
    inputs = {"prompt_ids": torch.zeros(b, 1, dtype=torch.long), "prompt_mask": torch.ones(b, 1, dtype=torch.long),
              "completion_ids": torch.zeros(b, t, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": logp.detach(), "sampling_per_token_logps": vllm_lp,
              "ref_per_token_logps": ref, "num_items_in_batch": mask.sum(),
              "importance_sampling_ratio": trl_vllm_is_ratio(logp, vllm_lp, mask, mode, lo, hi)}
    theirs = tr._compute_loss(None, inputs)
    assert abs(ours.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item())), (ours.item(), theirs.item())
    ours.backward()
    theirs.backward()
    assert torch.allclose(ours_lp.grad, theirs_lp.grad, rtol=1e-5, atol=1e-7)
    assert m["clip_fraction"] == 0.0 and 0.0 < m["behav_weight_mean"]  # the clip anchors on this step's policy
    plain = make_loss(name, beta=beta, **{k: v for k, v in kw.items() if not k.startswith("behaviour_")})
    assert abs(plain(logp, vllm_lp, adv, mask, ref)[0].item() - ours.item()) > 1e-4  # the correction changes it
