"""Policy-gradient losses: one signature for all, a registry users extend.

Every loss is built by ``make_loss(name, **hyperparams)`` and called as::

    loss, metrics = loss_fn(logprobs, old_logprobs, advantages, mask, ref_logprobs=None,
                            *, entropy=None, prox_logprobs=None)

``logprobs`` (current policy, with grad), ``old_logprobs`` (behaviour policy, from the generator), ``ref_logprobs``,
``entropy`` and ``mask`` are ``[B, T]`` float tensors; ``advantages`` is ``[B]``. ``loss`` is a scalar to minimise;
``metrics`` maps names to Python floats. A user adds a loss with ``register_loss("mine", factory)`` where
``factory(**hyperparams)`` returns such a callable. ``entropy`` carries a gradient only for a loss that asks for
it (``wants_entropy_grad``: a non-zero ``entropy_coef`` attribute, or ``entropy_grad = True``); otherwise the
trainer computes it without autograd (a metric: no ``[tokens, vocab]`` tensor kept for the backward pass).
``prox_logprobs`` (``[B, T]``, no grad) is passed only to a loss that asks for it (``wants_proximal``: an attribute
``proximal = True``, as ``decoupled_ppo`` has): the logprobs of the weights before the batch's first optimizer step,
when the trainer takes several (``trainer.ppo_epochs``, ``trainer.minibatches``; ``consumers/ppo.py``).

Notation (TRL GRPOTrainer's, whose hyperparameter names and conventions we follow so results agree numerically):
``m`` the mask, ``A_i`` the advantage of row ``i``, ``r_{i,t} = exp(logprobs - old_logprobs)`` the token ratio,
``eps_lo = epsilon``, ``eps_hi = epsilon_high`` (defaults to ``epsilon``), ``sg`` stop-gradient. Aggregations:

* ``seq``   (grpo, gspo, sapo): ``L = mean_i [ sum_t l_{i,t} m_{i,t} / max(1, sum_t m_{i,t}) ]``
* ``token`` (bnpo, dapo, cispo, reinforce, decoupled_ppo): ``L = sum_{i,t} l m / max(1, sum_{i,t} m)``
* ``const`` (dr_grpo): ``L = sum_{i,t} l m / (B * max_completion_length)``

Defaults are GRPOConfig's (TRL 1.16.0): ``epsilon`` 0.2, ``epsilon_high`` = ``epsilon``, ``beta`` 0,
``use_bias_correction_kl`` True; where a paper recommends another value, the built-in's docstring says so.
``tests/unit/test_losses_trl.py`` calls TRL's own ``GRPOTrainer._compute_loss`` on the same tensors.

Shared options for every built-in: ``beta`` adds the k3 estimator of KL(pi || pi_ref) per token,
``kl = exp(ref - logp) - (ref - logp) - 1``, as ``l += beta * kl`` (needs ``ref_logprobs``); with
``use_bias_correction_kl`` (the default, as TRL's) ``kl`` is multiplied by the importance ratio ``r`` (with its
gradient; the row's ``s_i`` at ``level="sequence"``), which makes its gradient the unbiased reverse-KL gradient on
tokens sampled by the behaviour policy (DeepSeek-V3.2); the ``kl`` metric is that product. ``entropy_coef`` subtracts
``entropy_coef * sum(H m) / max(1, sum m)`` (needs ``entropy``); ``off_policy_mask_threshold`` drops rows with
``A_i < 0`` whose mean ``old - sg(logp)`` over the mask exceeds it (TRL's off-policy sequence mask, for stale
episodes); ``ratio_mask_threshold`` (``c > 1``) zeroes the loss of tokens whose ``sg(r)`` lies outside
``[1/c, c]`` (masked importance sampling: a token the behaviour policy made far likelier or unlikelier than the
current one carries no gradient; the normaliser is unchanged). ``behaviour_correction`` (a clip-objective loss:
grpo, bnpo, dapo, dr_grpo, gspo) computes the loss as TRL's GRPOTrainer does on vLLM samples
(``vllm_importance_sampling_correction``): ``r`` is taken against the proximal policy (``prox_logprobs``; with one
optimizer step per batch ``sg(logp)``, so the clip never binds), and each token's term is weighed by
``behaviour_weight(pi_prox / pi_behav)`` in TRL's mode of the same name (``"sequence_mask"``, TRL's default, with
``behaviour_clip_max`` 3.0 and ``behaviour_clip_min``; ``"token_truncate"``, ...). Without it the clip anchors on the
behaviour logprobs, which drift from the trainer's (bf16, and a stale batch's older weights) and clip tokens whose
ratio is off by rounding or staleness rather than by this step.

Data parallelism: with ``trainer.world_size / trainer.tp > 1`` data-parallel ranks, each rank sees only its share
of the batch's rows, and FSDP averages the ranks' gradients. The trainer keeps the step equal to one process on
the whole batch by asking every rank for its *share* of the whole-batch loss (the shares sum to it), then
multiplying by the dp degree before backward. A loss says how, in one of two ways (``dp_share``):

* it has a keyword parameter ``totals: BatchTotals`` (the whole batch's ``rows``, ``tokens`` = sum of the mask, and
  ``width``) and normalises by those instead of its local counts, returning its share; its metrics must be shares
  too (sums over local rows or tokens divided by the whole batch's count) and are summed over ranks. The built-ins
  do this;
* or it has an attribute ``aggregation``: ``"seq"`` (a mean over rows of per-row values), ``"token"`` (a sum over
  masked tokens divided by the mask's sum) or ``"const"`` (a sum divided by ``rows x`` a fixed length), meaning the
  value it returns for a share of rows is normalised by that share's own counts; the trainer rescales it (and its
  metrics) by ``rows_local / rows`` or ``tokens_local / tokens``. A function gets it with ``fn.aggregation = "token"``.

A loss that declares neither still works: every dp rank then trains the whole batch (correct, but no speed-up from
data parallelism), and the trainer logs a warning once.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from consumers.loss_terms import (
    AGGREGATIONS,
    BEHAVIOUR_MODES,
    BatchTotals,
    aggregate,
    behaviour_weight,
    k3_kl,
    masked_mean,
    off_policy_mask,
)
from topics.errors import ConfigError

Metrics = dict[str, float]


class LossFn(Protocol):
    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                 ref_logprobs: Tensor | None = None, *, entropy: Tensor | None = None,
                 prox_logprobs: Tensor | None = None) -> tuple[Tensor, Metrics]: ...  # (+ totals, optional)


_REGISTRY: dict[str, Callable[..., LossFn]] = {}


def register_loss(name: str, factory: Callable[..., LossFn]) -> None:
    """Make ``make_loss(name, **hyperparams)`` call ``factory(**hyperparams)``. Re-registering replaces."""
    _REGISTRY[name] = factory


def loss_names() -> list[str]:
    return sorted(_REGISTRY)


def make_loss(name: str, **hyperparams: Any) -> LossFn:
    """Build the registered loss ``name`` (or a ``"module:factory"`` from config); an unknown name or
    hyperparameter is a ``ConfigError``.

    A user loss may have the plain public signature ``(logprobs, old_logprobs, advantages, mask,
    ref_logprobs=None)``: keyword extras it does not accept (``entropy``, ``prox_logprobs``) are not passed."""
    if name in _REGISTRY:
        factory = _REGISTRY[name]
    elif ":" in name:
        factory = _import_factory(name)
    else:
        raise ConfigError("trainer.loss", f"unknown loss {name!r}; registered: {loss_names()}")
    try:
        fn = factory(**hyperparams)
    except TypeError as exc:
        raise ConfigError("trainer.loss_args", f"loss {name!r}: {exc}") from exc
    return _accepting_extras(fn)


def _import_factory(spec: str) -> Callable[..., LossFn]:
    """Resolve ``trainer.loss = "package.module:factory"`` (from config only, never from a message)."""
    from runtime.plugins import load_object

    return load_object(spec, config_key="trainer.loss")


def _accepting_extras(fn: Callable[..., Any]) -> LossFn:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn  # type: ignore[return-value]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn  # type: ignore[return-value]
    accepted = {k for k in ("entropy", "prox_logprobs", "totals") if k in params}
    if {"entropy", "prox_logprobs"} <= accepted:
        return fn  # type: ignore[return-value]

    def call(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
             ref_logprobs: Tensor | None = None, **extra: Any) -> tuple[Tensor, Metrics]:
        return fn(logprobs, old_logprobs, advantages, mask, ref_logprobs,
                  **{k: v for k, v in extra.items() if k in accepted})

    call.aggregation = getattr(fn, "aggregation", None)  # type: ignore[attr-defined]
    call.takes_totals = "totals" in accepted  # type: ignore[attr-defined]
    call.entropy_grad = wants_entropy_grad(fn)  # type: ignore[attr-defined]
    call.proximal = wants_proximal(fn) and "prox_logprobs" in accepted  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


def wants_entropy_grad(fn: LossFn) -> bool:
    """Whether ``fn`` differentiates through ``entropy`` (module docstring); seen through ``dp_share`` and the
    extras wrapper, which copy the loss's attributes."""
    return bool(getattr(fn, "entropy_coef", 0.0)) or bool(getattr(fn, "entropy_grad", False))


def wants_proximal(fn: LossFn) -> bool:
    """Whether ``fn`` reads ``prox_logprobs`` (an attribute ``proximal = True``; copied by the wrappers)."""
    return bool(getattr(fn, "proximal", False))


def takes_totals(fn: LossFn) -> bool:
    """Whether ``fn`` has a parameter named ``totals`` (or says so with a ``takes_totals`` attribute)."""
    flag = getattr(fn, "takes_totals", None)
    if flag is not None:
        return bool(flag)
    try:
        return "totals" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def splits_rows(fn: LossFn) -> bool:
    """Whether ``fn`` declares how to be computed on a share of the rows (see "Data parallelism" above)."""
    return takes_totals(fn) or getattr(fn, "aggregation", None) in AGGREGATIONS


def share_weight(aggregation: str, mask: Tensor, totals: BatchTotals, real_rows: int) -> float:
    """The factor that turns a loss normalised by a share's own counts into its share of the whole-batch loss."""
    if aggregation == "token":
        return float(mask.sum().item()) / max(1.0, totals.tokens)
    return real_rows / max(1, totals.rows)


def dp_share(fn: LossFn, totals: BatchTotals, *, real_rows: int, scale: float = 1.0) -> LossFn:
    """``fn`` computed on a share of the batch's rows: returns ``scale x`` its share of the whole-batch loss and
    the share of each metric (summing the metrics over the shares gives the whole batch's). ``scale`` is the dp
    degree (FSDP averages gradients over dp). ``real_rows``: the share's rows that are not padding."""
    if not splits_rows(fn):
        raise ValueError("the loss declares neither `takes_totals` nor `aggregation`")
    takes = takes_totals(fn)

    @functools.wraps(fn)
    def call(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
             ref_logprobs: Tensor | None = None, **extra: Any) -> tuple[Tensor, Metrics]:
        if takes:
            loss, metrics = fn(logprobs, old_logprobs, advantages, mask, ref_logprobs, totals=totals, **extra)
        else:
            loss, metrics = fn(logprobs, old_logprobs, advantages, mask, ref_logprobs, **extra)
            w = share_weight(fn.aggregation, mask, totals, real_rows)  # type: ignore[attr-defined]
            loss = loss * w
            metrics = {k: v * w for k, v in metrics.items()}
        metrics.pop("nonfinite", None)  # a property of the summed loss: the caller decides it
        return loss * scale, metrics

    return call  # type: ignore[return-value]


def _f(x: Tensor) -> float:
    return float(x.detach().item())


class PolicyLoss:
    """The family of clipped / weighted policy-gradient losses; each built-in is one configuration of it.

    ``objective`` picks the per-token term (``c`` = coefficient, ``A`` = advantage broadcast over tokens):

    * ``clip``:    ``l = -min(c A, clip(c, 1-eps_lo, 1+eps_hi) A)`` with ``c = min(r, delta)`` if ``delta`` is set
      in the first term only (TRL's two-sided clipping);
    * ``cispo``:   ``l = -sg(min(r, eps_hi)) A logp``;
    * ``sapo``:    ``l = -(4/tau) sigmoid(tau (r - 1)) A`` with ``tau = sapo_temperature_pos if A > 0 else _neg``;
    * ``tis``:     ``l = -sg(min(r, is_cap)) A logp`` (REINFORCE with truncated importance sampling);
    * ``decoupled``: ``l = -sg(min(pi_prox/pi_behav, is_cap)) min(q A, clip(q, 1-eps_lo, 1+eps_hi) A)`` with
      ``q = pi/pi_prox`` (Hilton et al.; AReaL). ``pi_prox`` comes from ``prox_logprobs`` (default
      ``sg(logprobs)``: the policy just before this step).

    ``level="sequence"`` replaces ``log r`` by its masked mean over the row (GSPO).

    Called with ``totals`` (a data-parallel share, see the module docstring) every normaliser, of the loss and of
    the metrics, is the whole batch's: the loss and each metric are this share's parts of the whole-batch values.
    """


    def __init__(self, *, objective: str, aggregation: str, level: str = "token", epsilon: float = 0.2,
                 epsilon_high: float | None = None, delta: float | None = None, beta: float = 0.0,
                 entropy_coef: float = 0.0, max_completion_length: int | None = None,
                 off_policy_mask_threshold: float | None = None, sapo_temperature_pos: float = 1.0,
                 sapo_temperature_neg: float = 1.05, is_cap: float = 2.0,
                 ratio_mask_threshold: float | None = None, use_bias_correction_kl: bool = True,
                 behaviour_correction: str | None = None, behaviour_clip_min: float | None = None,
                 behaviour_clip_max: float | None = 3.0) -> None:
        if epsilon < 0 or (epsilon_high is not None and epsilon_high < 0):
            raise ConfigError("trainer.loss_args.epsilon", "must be >= 0")
        if delta is not None and delta <= 1.0:
            raise ConfigError("trainer.loss_args.delta", "must be > 1 (upper bound of the ratio)")
        if beta < 0:
            raise ConfigError("trainer.loss_args.beta", "must be >= 0")
        if is_cap <= 0:
            raise ConfigError("trainer.loss_args.is_cap", "must be positive")
        if ratio_mask_threshold is not None and ratio_mask_threshold <= 1:
            raise ConfigError("trainer.loss_args.ratio_mask_threshold", "must be > 1")
        if behaviour_correction is not None and (objective != "clip" or behaviour_correction not in BEHAVIOUR_MODES):
            raise ConfigError("trainer.loss_args.behaviour_correction",
                              f"one of {BEHAVIOUR_MODES}, for a clip-objective loss (got {behaviour_correction!r})")
        if (behaviour_correction or "").endswith("truncate") and behaviour_clip_min is None and behaviour_clip_max is None:
            raise ConfigError("trainer.loss_args.behaviour_clip_max", f"{behaviour_correction} needs a bound")
        self.objective, self.aggregation, self.level = objective, aggregation, level
        self.epsilon_low = epsilon
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        self.delta, self.beta, self.entropy_coef = delta, beta, entropy_coef
        self.max_completion_length = max_completion_length
        self.off_policy_mask_threshold = off_policy_mask_threshold
        self.sapo_temperature_pos, self.sapo_temperature_neg = sapo_temperature_pos, sapo_temperature_neg
        self.is_cap = is_cap
        self.ratio_mask_threshold = ratio_mask_threshold
        self.use_bias_correction_kl = use_bias_correction_kl
        self.behaviour = (behaviour_correction, behaviour_clip_min, behaviour_clip_max)
        # reads prox_logprobs (wants_proximal)
        self.proximal = objective == "decoupled" or behaviour_correction is not None

    def _log_weights(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        if self.level == "token":
            return log_ratio
        if self.level == "sequence":
            return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        raise ValueError(f"unknown importance sampling level {self.level!r}")

    def _clipped(self, coef: Tensor, adv: Tensor) -> tuple[Tensor, Tensor]:
        clipped = torch.clamp(coef, 1 - self.epsilon_low, 1 + self.epsilon_high)
        first = torch.clamp(coef, max=self.delta) if self.delta is not None else coef
        # TRL's clip_ratio/region_mean: the high side is read on the delta-capped ratio (never counted if delta
        # <= 1 + eps_hi)
        region = ((coef < 1 - self.epsilon_low) & (adv < 0)) | ((first > 1 + self.epsilon_high) & (adv > 0))
        return -torch.min(first * adv, clipped * adv), region

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                 ref_logprobs: Tensor | None = None, *, entropy: Tensor | None = None,
                 prox_logprobs: Tensor | None = None, totals: BatchTotals | None = None) -> tuple[Tensor, Metrics]:
        mask = mask.to(logprobs.dtype)
        mean = functools.partial(masked_mean, totals=totals)
        adv = advantages.to(logprobs.dtype).unsqueeze(-1)  # [B, 1]
        correction, sampled = None, old_logprobs
        if self.behaviour[0] is not None:  # the clip anchors on the proximal policy; the behaviour's ratio weighs
            prox = logprobs.detach() if prox_logprobs is None else prox_logprobs.detach()
            correction = behaviour_weight(prox, old_logprobs, mask, *self.behaviour)
            old_logprobs = prox
        coef = torch.exp(self._log_weights(logprobs - old_logprobs, mask))
        region = None
        metrics: Metrics = {}
        if self.objective == "clip":
            per_token, region = self._clipped(coef, adv)
        elif self.objective == "cispo":
            per_token = -torch.clamp(coef, max=self.epsilon_high).detach() * adv * logprobs
            region = (coef > self.epsilon_high) & (adv > 0)  # TRL's cispo_clip_ratio
        elif self.objective == "tis":
            per_token = -torch.clamp(coef, max=self.is_cap).detach() * adv * logprobs
            region = (coef > self.is_cap).expand_as(mask)
        elif self.objective == "sapo":
            tau = torch.where(adv > 0, torch.full_like(adv, self.sapo_temperature_pos),
                              torch.full_like(adv, self.sapo_temperature_neg))
            per_token = -torch.sigmoid(tau * (coef - 1)) * 4 / tau * adv
        elif self.objective == "decoupled":
            prox = logprobs.detach() if prox_logprobs is None else prox_logprobs.detach()
            behav_w = torch.clamp(torch.exp(prox - old_logprobs), max=self.is_cap).detach()
            q = torch.exp(self._log_weights(logprobs - prox, mask))
            clipped, region = self._clipped(q, adv)
            per_token = behav_w * clipped
            metrics["behav_weight_mean"] = _f(mean(behav_w.expand_as(mask), mask))
            metrics["prox_drift"] = _f(mean((logprobs.detach() - prox).abs(), mask))  # |log pi - log pi_prox|
        else:
            raise ValueError(f"unknown objective {self.objective!r}")
        if self.off_policy_mask_threshold is not None:
            keep = off_policy_mask(advantages.unsqueeze(-1), logprobs, sampled, mask, self.off_policy_mask_threshold)
            per_token = per_token * keep
            rows = keep.shape[0] if totals is None else totals.rows
            metrics["off_policy_masked"] = _f((1 - keep).sum() / max(1, rows))
        if self.ratio_mask_threshold is not None:
            r = torch.exp(logprobs.detach() - sampled)
            keep = ((r <= self.ratio_mask_threshold) & (r >= 1 / self.ratio_mask_threshold)).to(mask.dtype)
            per_token = per_token * keep
            metrics["ratio_masked"] = _f(mean(1 - keep, mask))
        if correction is not None:
            per_token = per_token * correction
            metrics["behav_weight_mean"] = _f(mean(correction.expand_as(mask), mask))
        if self.beta != 0.0:
            if ref_logprobs is None:
                raise ValueError("beta > 0 needs ref_logprobs")
            kl = k3_kl(logprobs, ref_logprobs)
            if self.use_bias_correction_kl:
                kl = kl * coef
            per_token = per_token + self.beta * kl
            metrics["kl"] = _f(mean(kl, mask))
        loss = aggregate(per_token, mask, self.aggregation, self.max_completion_length, totals)
        metrics["policy_loss"] = _f(loss)
        if entropy is not None:
            ent = mean(entropy, mask)
            metrics["entropy"] = _f(ent)
            if self.entropy_coef:
                loss = loss - self.entropy_coef * ent
        elif self.entropy_coef:
            raise ValueError("entropy_coef needs the per-token entropy")
        if region is not None:  # of the masked tokens; of the rows at level="sequence" (one ratio per row), as TRL
            if region.shape[-1] == 1:
                rows = mask.shape[0] if totals is None else totals.rows
                metrics["clip_fraction"] = _f(region.to(mask.dtype).sum() / max(1, rows))
            else:
                metrics["clip_fraction"] = _f(mean(region.to(mask.dtype), mask))
        metrics["ratio_mean"] = _f(mean(coef.detach().expand_as(mask), mask))
        metrics["loss"] = _f(loss)
        if not math.isfinite(metrics["loss"]):
            metrics["nonfinite"] = 1.0
        return loss, metrics


# --- built-ins ---------------------------------------------------------------------------------------------------


def grpo(**kw: Any) -> PolicyLoss:
    """GRPO (TRL ``loss_type="grpo"``): clip objective, ``seq`` aggregation (length-normalised per row)."""
    return PolicyLoss(objective="clip", aggregation="seq", **kw)


def bnpo(**kw: Any) -> PolicyLoss:
    """BNPO (TRL ``"bnpo"``): clip objective, ``token`` aggregation over the batch."""
    return PolicyLoss(objective="clip", aggregation="token", **kw)


def dapo(**kw: Any) -> PolicyLoss:
    """DAPO (TRL ``"dapo"``, GRPOConfig's default loss): clip objective, ``token`` mean over the batch.

    ``epsilon_high`` defaults to ``epsilon`` as in GRPOConfig; the DAPO paper's clip-higher uses 0.28."""
    return PolicyLoss(objective="clip", aggregation="token", **kw)


def dr_grpo(*, max_completion_length: int | None = None, **kw: Any) -> PolicyLoss:
    """Dr. GRPO (TRL ``"dr_grpo"``): clip objective, ``const`` aggregation ``/ (B * max_completion_length)``.

    GRPOConfig's ``max_completion_length`` is its generation length (default 512); the trainer passes the
    generators' ``max_tokens``, its counterpart here. Called without it, the mask width ``T`` is used.
    """
    return PolicyLoss(objective="clip", aggregation="const", max_completion_length=max_completion_length, **kw)


def gspo(**kw: Any) -> PolicyLoss:
    """GSPO (TRL ``importance_sampling_level="sequence"`` with ``loss_type="grpo"``): the ratio is
    ``s_i = exp(mean_t m (logp - old))`` per row, clipped to ``[1-eps_lo, 1+eps_hi]``, ``seq`` aggregation.

    ``epsilon`` defaults to GRPOConfig's 0.2; the GSPO paper uses ``epsilon=3e-4, epsilon_high=4e-4``."""
    return PolicyLoss(objective="clip", aggregation="seq", level="sequence", **kw)


def cispo(**kw: Any) -> PolicyLoss:
    """CISPO (TRL ``"cispo"``): ``l = -sg(min(r, epsilon_high)) A logp``, ``token`` aggregation.

    ``epsilon_high`` defaults to ``epsilon`` (0.2) as in GRPOConfig, so by default every weight ``sg(r)`` is capped
    at 0.2; the ScaleRL paper's ``epsilon_max`` is 5.0 (``trainer.loss_args={"epsilon_high": 5.0}``)."""
    return PolicyLoss(objective="cispo", aggregation="token", **kw)


def sapo(**kw: Any) -> PolicyLoss:
    """SAPO (TRL ``"sapo"``): soft gate ``l = -(4/tau) sigmoid(tau (r-1)) A``, ``seq`` aggregation."""
    return PolicyLoss(objective="sapo", aggregation="seq", **kw)


def reinforce(*, is_cap: float = 2.0, **kw: Any) -> PolicyLoss:
    """REINFORCE with truncated importance sampling: ``l = -sg(min(r, is_cap)) A logp``, ``token`` aggregation.
    No TRL counterpart."""
    return PolicyLoss(objective="tis", aggregation="token", is_cap=is_cap, **kw)


def decoupled_ppo(*, is_cap: float = 5.0, **kw: Any) -> PolicyLoss:
    """Decoupled PPO (AReaL): behaviour policy (importance weight, truncated at ``is_cap``) separated from the
    proximal policy (the clip anchor), ``token`` aggregation; see ``PolicyLoss``. No TRL counterpart.

    The proximal policy is the weights before the batch's first optimizer step: with one step per batch it is the
    current policy (the clip never binds and the loss is truncated-IS policy gradient); with ``trainer.ppo_epochs``
    or ``trainer.minibatches`` above 1 the trainer passes its logprobs (``prox_logprobs``) and the clip binds from
    the second step on. Metrics: ``behav_weight_mean`` (mean ``sg(min(pi_prox/pi_behav, is_cap))``),
    ``prox_drift`` (mean ``|log pi - log pi_prox|``)."""
    return PolicyLoss(objective="decoupled", aggregation="token", is_cap=is_cap, **kw)


for _name, _factory in {"grpo": grpo, "bnpo": bnpo, "dapo": dapo, "dr_grpo": dr_grpo, "gspo": gspo,
                        "cispo": cispo, "sapo": sapo, "reinforce": reinforce,
                        "decoupled_ppo": decoupled_ppo}.items():
    register_loss(_name, _factory)


def sft_loss(logprobs: Tensor, mask: Tensor, *, totals: BatchTotals | None = None) -> tuple[Tensor, Metrics]:
    """Supervised fine-tuning: ``L = -sum(logp m) / max(1, sum m)`` (mean NLL of completion tokens); with
    ``totals`` the denominator is the whole batch's token count (a data-parallel share)."""
    mask = mask.to(logprobs.dtype)
    loss = -masked_mean(logprobs, mask, totals)
    return loss, {"loss": _f(loss), "nll": _f(loss)}
