"""Every built-in loss against its documented formula: hand-computed cases, gradient flow, data-parallel shares.

The comparison with TRL's own ``GRPOTrainer._compute_loss`` is ``test_losses_trl.py``."""

from __future__ import annotations

import math

import pytest
import torch

from consumers.losses import k3_kl, loss_names, make_loss, register_loss, sft_loss
from topics.errors import ConfigError

BUILTINS = ["grpo", "bnpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo", "reinforce", "decoupled_ppo"]


def case(seed: int = 0, b: int = 4, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3 - 0.1
    logp = (old + torch.randn(b, t, generator=g) * 0.3).requires_grad_(True)
    ref = old + torch.randn(b, t, generator=g) * 0.2
    mask = torch.zeros(b, t)
    for i in range(b):  # a prompt of 2 tokens, responses of different lengths
        mask[i, 2: 3 + i] = 1
    adv = torch.tensor([1.0, -0.5, 0.25, -1.5])[:b]
    ent = torch.rand(b, t, generator=g)
    return logp, old, adv, mask, ref, ent


def test_grpo_hand_computed_on_policy():
    # On policy (ratio 1) the clip is inactive: L = mean_i(-A_i) over rows, gradient -A_i/|o_i| per token.
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    loss, m = make_loss("grpo")(logp, logp.detach(), adv, mask)
    assert loss.item() == pytest.approx((-2.0 + 1.0) / 2)
    loss.backward()
    expected = torch.tensor([[-2 / 3 / 2] * 3, [1 / 2 / 2, 1 / 2 / 2, 0.0]])
    assert torch.allclose(logp.grad, expected)
    assert m["clip_fraction"] == 0.0 and m["ratio_mean"] == pytest.approx(1.0)


def test_dapo_hand_computed_clip_higher():
    # One token, A = 1, ratio e^0.5 = 1.6487 > 1.28 (the DAPO paper's clip-higher): clipped to 1.28, no gradient.
    logp = torch.tensor([[0.5]], requires_grad=True)
    dapo = make_loss("dapo", epsilon_high=0.28)
    loss, m = dapo(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-1.28)
    loss.backward()
    assert logp.grad.abs().sum() == 0 and m["clip_fraction"] == 1.0
    # A = -1 with the same ratio: min(-r, -1.28) = -r is unclipped, gradient r.
    logp.grad = None
    loss, _ = dapo(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(math.exp(0.5))
    loss.backward()
    assert logp.grad.item() == pytest.approx(math.exp(0.5))
    # GRPOConfig's default epsilon_high = epsilon: the upper clip is 1.2.
    loss, _ = make_loss("dapo")(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-1.2)


def test_dr_grpo_divides_by_constant():
    logp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1.0, 1, 0, 0], [1.0, 1, 1, 1]])
    loss, _ = make_loss("dr_grpo", max_completion_length=10)(logp, logp.detach(), torch.tensor([1.0, 1.0]), mask)
    assert loss.item() == pytest.approx(-6 / (2 * 10))
    loss, _ = make_loss("dr_grpo")(logp, logp.detach(), torch.tensor([1.0, 1.0]), mask)
    assert loss.item() == pytest.approx(-6 / (2 * 4))  # default: mask width


def test_gspo_uses_one_ratio_per_sequence():
    logp = torch.tensor([[0.1, -0.1, 0.3]], requires_grad=True)  # mean log-ratio 0.1 over the 3 tokens
    loss, m = make_loss("gspo", epsilon=0.2, epsilon_high=0.2)(logp, torch.zeros(1, 3), torch.tensor([1.0]),
                                                              torch.ones(1, 3))
    assert loss.item() == pytest.approx(-math.exp(0.1))
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 3), -math.exp(0.1) / 3))
    assert m["ratio_mean"] == pytest.approx(math.exp(0.1))


def test_cispo_weight_is_stop_gradient_and_clipped():
    logp = torch.tensor([[math.log(0.5), math.log(0.5)]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.5)]])  # ratios 2 and 1
    loss, _ = make_loss("cispo", epsilon_high=1.5)(logp, old, torch.tensor([1.0]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-(1.5 * math.log(0.5) + 1.0 * math.log(0.5)) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.5 / 2, -1.0 / 2]]))


def test_sapo_soft_gate():
    logp = torch.tensor([[0.2], [0.2]], requires_grad=True)
    loss, _ = make_loss("sapo")(logp, torch.zeros(2, 1), torch.tensor([1.0, -1.0]), torch.ones(2, 1))
    r = math.exp(0.2)
    pos = -4 * (1 / (1 + math.exp(-(r - 1)))) * 1.0
    neg = -4 / 1.05 * (1 / (1 + math.exp(-1.05 * (r - 1)))) * -1.0
    assert loss.item() == pytest.approx((pos + neg) / 2, rel=1e-6)


def test_reinforce_truncated_is():
    logp = torch.tensor([[math.log(0.9), math.log(0.2)]], requires_grad=True)
    old = torch.tensor([[math.log(0.3), math.log(0.2)]])  # ratios 3 (capped at 2) and 1
    loss, m = make_loss("reinforce", is_cap=2.0)(logp, old, torch.tensor([0.5]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-0.5 * (2 * math.log(0.9) + math.log(0.2)) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.25]]))
    assert m["clip_fraction"] == 0.5


def test_decoupled_ppo_separates_behaviour_and_proximal():
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    behav = torch.tensor([[math.log(0.25)]])
    # Default proximal = current policy (detached): q = 1, weight pi_prox/pi_behav = 2 (under the cap of 5).
    loss, m = make_loss("decoupled_ppo")(logp, behav, torch.tensor([1.0]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-2.0)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-2.0) and m["behav_weight_mean"] == pytest.approx(2.0)
    # An explicit proximal policy 0.4: q = 1.25 is clipped at 1.2, weight 0.4/0.25 = 1.6.
    logp.grad = None
    prox = torch.tensor([[math.log(0.4)]])
    loss, _ = make_loss("decoupled_ppo")(logp, behav, torch.tensor([1.0]), torch.ones(1, 1), prox_logprobs=prox)
    assert loss.item() == pytest.approx(-1.6 * 1.2)
    loss.backward()
    assert logp.grad.item() == 0.0
    # Versus plain PPO against the behaviour policy, where ratio 2 would be clipped at 1.2.
    plain, _ = make_loss("bnpo")(logp, behav, torch.tensor([1.0]), torch.ones(1, 1))
    assert plain.item() == pytest.approx(-1.2)


def test_k3_kl_and_beta():
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    kl = k3_kl(lp, ref)
    assert kl[0, 0].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1) and kl[0, 1].item() == 0.0
    logp = lp.clone().requires_grad_(True)
    base, _ = make_loss("bnpo")(logp, lp, torch.tensor([1.0]), torch.ones(1, 2))
    with_kl, m = make_loss("bnpo", beta=0.5)(logp, lp, torch.tensor([1.0]), torch.ones(1, 2), ref)
    assert (with_kl - base).item() == pytest.approx(0.5 * kl.mean().item())
    assert m["kl"] == pytest.approx(kl.mean().item())
    with pytest.raises(ValueError):
        make_loss("bnpo", beta=0.5)(logp, lp, torch.tensor([1.0]), torch.ones(1, 2))


def test_bias_corrected_kl_is_weighted_by_the_ratio():
    # Off policy, ratio r = 2 on the first token and 1 on the second: TRL's default multiplies k3 by r (with its
    # gradient); use_bias_correction_kl=False leaves it plain.
    old = torch.tensor([[math.log(0.25), math.log(0.5)]])
    lp = torch.tensor([[math.log(0.5), math.log(0.5)]])
    ref = torch.tensor([[math.log(0.4), math.log(0.3)]])
    kl, r = k3_kl(lp, ref), torch.exp(lp - old)
    d_kl = 1 - torch.exp(ref - lp)  # d k3 / d logp
    adv, mask = torch.tensor([0.0]), torch.ones(1, 2)  # A = 0: the loss is the KL term alone
    for corrected, want, grad in ((True, kl * r, d_kl * r + kl * r), (False, kl, d_kl)):
        logp = lp.clone().requires_grad_(True)
        loss, m = make_loss("bnpo", beta=0.5, use_bias_correction_kl=corrected)(logp, old, adv, mask, ref)
        assert loss.item() == pytest.approx(0.5 * want.mean().item())
        assert m["kl"] == pytest.approx(want.mean().item())
        loss.backward()
        assert torch.allclose(logp.grad, 0.5 * grad / 2)


def test_entropy_bonus_subtracts_masked_mean_entropy():
    logp, old, adv, mask, _, ent = case()
    base, _ = make_loss("grpo")(logp, old, adv, mask, entropy=ent)
    bonus, m = make_loss("grpo", entropy_coef=0.1)(logp, old, adv, mask, entropy=ent)
    h = (ent * mask).sum() / mask.sum()
    assert (base - bonus).item() == pytest.approx(0.1 * h.item(), rel=1e-5)
    assert m["entropy"] == pytest.approx(h.item())


def test_off_policy_mask_drops_stale_negative_rows():
    logp = torch.zeros(2, 2, requires_grad=True)
    old = torch.tensor([[1.0, 1.0], [1.0, 1.0]])  # mean old - logp = 1 on both rows
    adv = torch.tensor([1.0, -1.0])
    loss, m = make_loss("bnpo", off_policy_mask_threshold=0.5)(logp, old, adv, torch.ones(2, 2))
    loss.backward()
    assert logp.grad[1].abs().sum() == 0 and logp.grad[0].abs().sum() > 0
    assert m["off_policy_masked"] == 0.5


@pytest.mark.parametrize("name", BUILTINS)
def test_gradient_flows_only_through_masked_tokens(name):
    logp, old, adv, mask, ref, ent = case(seed=3)
    fn = make_loss(name, beta=0.02, entropy_coef=0.0)
    loss, metrics = fn(logp, old, adv, mask, ref, entropy=ent)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert logp.grad is not None
    assert (logp.grad[mask == 0] == 0).all()
    assert logp.grad[mask == 1].abs().sum() > 0
    assert all(isinstance(v, float) for v in metrics.values())
    assert "loss" in metrics and "entropy" in metrics and "kl" in metrics


def test_registry_and_errors():
    assert set(BUILTINS) <= set(loss_names())
    with pytest.raises(ConfigError):
        make_loss("nope")
    with pytest.raises(ConfigError):
        make_loss("grpo", epsilonn=0.1)

    def my_loss(scale: float = 1.0):
        def fn(logprobs, old_logprobs, advantages, mask, ref_logprobs=None, *, entropy=None, prox_logprobs=None):
            loss = -scale * (logprobs * mask).sum() / mask.sum()
            return loss, {"loss": loss.item()}
        return fn

    register_loss("test_mine", my_loss)
    logp, old, adv, mask, _, _ = case()
    loss, m = make_loss("test_mine", scale=2.0)(logp, old, adv, mask)
    assert m["loss"] == pytest.approx(loss.item())


def test_sft_loss_is_mean_nll_of_completion():
    logp = torch.tensor([[-9.0, -1.0, -3.0]])
    loss, _ = sft_loss(logp, torch.tensor([[0.0, 1.0, 1.0]]))
    assert loss.item() == pytest.approx(2.0)


def test_ratio_mask_threshold_drops_far_off_policy_tokens():
    logp = torch.zeros(1, 3, requires_grad=True)
    old = torch.tensor([[0.0, -2.0, 2.0]])  # ratios 1, e^2, e^-2
    loss, m = make_loss("bnpo", ratio_mask_threshold=3.0, epsilon=10.0)(logp, old, torch.tensor([1.0]),
                                                                       torch.ones(1, 3))
    loss.backward()
    assert logp.grad[0, 0] != 0 and logp.grad[0, 1] == 0 and logp.grad[0, 2] == 0
    assert loss.item() == pytest.approx(-1.0 / 3)  # the normaliser still counts all three tokens
    assert m["ratio_masked"] == pytest.approx(2 / 3)
    with pytest.raises(ConfigError):
        make_loss("grpo", ratio_mask_threshold=0.5)


SHARE_KW = {"beta": 0.03, "entropy_coef": 0.01, "off_policy_mask_threshold": 0.2, "ratio_mask_threshold": 2.0}


@pytest.mark.parametrize("name", BUILTINS)
def test_shares_of_rows_sum_to_the_whole_batch(name):
    """Data parallelism: the loss, its gradient and every metric of the whole batch are the sums of the rows'
    shares computed with the whole batch's ``totals`` (rows split 3 + 1, as dp ranks would)."""
    from consumers.losses import BatchTotals, dp_share

    logp, old, adv, mask, ref, ent = case(seed=5)
    fn = make_loss(name, **SHARE_KW)
    whole, whole_m = fn(logp, old, adv, mask, ref, entropy=ent)
    (g_whole,) = torch.autograd.grad(whole, logp)
    totals = BatchTotals(rows=4, tokens=float(mask.sum()), width=mask.shape[1])
    total, metrics, grad = torch.zeros(()), {}, torch.zeros_like(logp)
    for rows in (slice(0, 3), slice(3, 4)):
        part = dp_share(fn, totals, real_rows=rows.stop - rows.start, scale=2.0)
        lp = logp.detach()[rows].clone().requires_grad_(True)
        loss, m = part(lp, old[rows], adv[rows], mask[rows], ref[rows], entropy=ent[rows])
        (g,) = torch.autograd.grad(loss, lp)
        total, grad[rows] = total + loss.detach() / 2.0, g / 2.0  # scale 2 = the dp factor FSDP's mean undoes
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + v
    assert total.item() == pytest.approx(whole.item(), rel=1e-6, abs=1e-7)
    assert torch.allclose(grad, g_whole, rtol=1e-5, atol=1e-7)
    assert set(metrics) == set(whole_m) - {"nonfinite"}
    for k, v in metrics.items():
        assert v == pytest.approx(whole_m[k], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("aggregation", ["seq", "token", "const"])
def test_user_loss_declaring_its_aggregation_is_rescaled_to_its_share(aggregation):
    from consumers.losses import BatchTotals, aggregate, dp_share, splits_rows

    def factory():
        def fn(logprobs, old_logprobs, advantages, mask, ref_logprobs=None):
            per_token = -torch.exp(logprobs - old_logprobs) * advantages[:, None]
            loss = aggregate(per_token, mask, aggregation, max_completion_length=8)
            return loss, {"loss": float(loss)}

        fn.aggregation = aggregation
        return fn

    register_loss("test_declared", factory)
    fn = make_loss("test_declared")
    assert splits_rows(fn)
    logp, old, adv, mask, _, _ = case(seed=6)
    whole, _ = fn(logp, old, adv, mask)
    totals = BatchTotals(rows=4, tokens=float(mask.sum()), width=mask.shape[1])
    shares = [dp_share(fn, totals, real_rows=2)(logp[r], old[r], adv[r], mask[r]) for r in (slice(0, 2), slice(2, 4))]
    assert sum(float(loss) for loss, _ in shares) == pytest.approx(whole.item(), rel=1e-6)
    assert sum(m["loss"] for _, m in shares) == pytest.approx(whole.item(), rel=1e-6)


def test_a_loss_declaring_nothing_does_not_split_rows():
    from consumers.losses import BatchTotals, dp_share, splits_rows

    def plain(logprobs, old_logprobs, advantages, mask, ref_logprobs=None):
        return -(logprobs * mask).mean(), {}

    def keywords(logprobs, old_logprobs, advantages, mask, ref_logprobs=None, **extra):
        return -(logprobs * mask).mean(), {}

    def with_totals(logprobs, old_logprobs, advantages, mask, ref_logprobs=None, *, totals=None):
        return -(logprobs * mask).sum() / totals.tokens, {}

    assert not splits_rows(plain) and not splits_rows(keywords)  # **extra is not a declaration
    assert splits_rows(with_totals) and all(splits_rows(make_loss(n)) for n in BUILTINS)
    register_loss("test_plain", lambda: plain)
    assert not splits_rows(make_loss("test_plain"))
    with pytest.raises(ValueError):
        dp_share(plain, BatchTotals(rows=1, tokens=1.0, width=1), real_rows=1)


def test_sft_loss_share():
    from consumers.losses import BatchTotals

    logp = torch.tensor([[-9.0, -1.0, -3.0], [-1.0, -2.0, -6.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    whole, _ = sft_loss(logp, mask)
    totals = BatchTotals(rows=2, tokens=4.0, width=3)
    parts = [sft_loss(logp[i:i + 1], mask[i:i + 1], totals=totals)[0] for i in range(2)]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item()) == pytest.approx(7 / 4)


def test_behaviour_correction_anchors_the_clip_on_the_proximal_policy() -> None:
    """With ``behaviour_correction`` the trainer passes the proximal logprobs (``wants_proximal``) and the clip
    binds against them, not against the behaviour's: a token the behaviour made less likely than the proximal
    policy is weighed by the ratio, not clipped; a clip-free objective or an unknown mode is refused naming the key."""
    from consumers.losses import wants_proximal

    fn = make_loss("grpo", behaviour_correction="token_truncate", behaviour_clip_max=2.0)
    assert wants_proximal(fn) and not wants_proximal(make_loss("grpo"))
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    behav = torch.tensor([[-1.5, -1.0]])  # first token: prox/behav = e^0.5 = 1.65 (plain grpo clips it: r > 1.2)
    mask, adv = torch.ones(1, 2), torch.tensor([1.0])
    loss, m = fn(logp, behav, adv, mask, prox_logprobs=logp.detach())
    loss.backward()
    assert m["clip_fraction"] == 0.0 and m["behav_weight_mean"] == pytest.approx((math.exp(0.5) + 1) / 2, rel=1e-6)
    assert torch.allclose(logp.grad, -torch.tensor([[math.exp(0.5), 1.0]]) / 2)
    assert make_loss("grpo")(logp, behav, adv, mask)[1]["clip_fraction"] == 0.5
    # several steps: the clip binds against the proximal policy once this step's weights left it
    _, m = fn(logp, behav, adv, mask, prox_logprobs=torch.tensor([[-1.5, -1.5]]))
    assert m["clip_fraction"] == 1.0
    for bad in ({"behaviour_correction": "sequence"}, {"behaviour_correction": "token_mask", "epsilon": 0.1}):
        name = "grpo" if "epsilon" not in bad else "cispo"
        with pytest.raises(ConfigError, match="behaviour_correction"):
            make_loss(name, **bad)


def test_behaviour_truncation_without_bounds_is_refused_at_start() -> None:
    """``*_truncate`` with both bounds open would fail in the first step (``torch.clamp`` needs one); it is refused
    when the loss is built, naming the key. ``*_mask`` with open bounds masks nothing and is allowed."""
    from consumers.losses import wants_proximal

    with pytest.raises(ConfigError, match="behaviour_clip_max"):
        make_loss("grpo", behaviour_correction="sequence_truncate", behaviour_clip_max=None)
    assert wants_proximal(make_loss("grpo", behaviour_correction="token_mask", behaviour_clip_max=None))
