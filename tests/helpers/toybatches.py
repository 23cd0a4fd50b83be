"""A local, in-process source of toy-task training batches: sample from the policy itself with torch.

Used by the learning test and for trying a loss without brokers or vLLM. ``ToyBatchMaker.make(model, version)``
draws ``prompts`` prompts of a ``models.tasks`` task, samples ``group_size`` responses of at most
``max_tokens`` tokens each from ``model`` (temperature 1, stopping at ``<eos>``), scores them with the task's
reward, and returns a ``Batch`` in the wire layout (``topics/schemas.py``) with GRPO advantages
``A = (r - mean_group(r)) / (std_group(r) + 1e-4)`` and the behaviour logprobs of the sampled tokens.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

from topics.schemas import Batch


class ToyBatchMaker:
    def __init__(self, task: str, tokenizer: Any, *, prompts: int = 8, group_size: int = 8, max_tokens: int = 3,
                 seed: int = 0, temperature: float = 1.0) -> None:
        from models.tasks import get_task

        self.task = get_task(task)
        self.tok = tokenizer
        self.prompts, self.group_size, self.max_tokens = prompts, group_size, max_tokens
        self.temperature = temperature
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.eos = int(tokenizer.eos_token_id)
        self.pad = int(tokenizer.pad_token_id or 0)
        self.count = 0

    @torch.no_grad()
    def _sample(self, model: torch.nn.Module, prompt_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Continuations of equal-length prompts ``[N, P]``: (tokens ``[N, max_tokens]``, logprobs); positions
        after ``<eos>`` hold ``<pad>`` and logprob 0."""
        n = prompt_ids.shape[0]
        seq = prompt_ids.long()
        toks = torch.full((n, self.max_tokens), self.pad, dtype=torch.long)
        lps = torch.zeros(n, self.max_tokens)
        alive = torch.ones(n, dtype=torch.bool)
        for t in range(self.max_tokens):
            logits = model(seq)[:, -1].float() / self.temperature
            logp = torch.log_softmax(logits, -1)
            nxt = torch.multinomial(logp.exp(), 1, generator=self.gen).squeeze(-1)
            toks[:, t] = torch.where(alive, nxt, self.pad)
            lps[:, t] = torch.where(alive, logp.gather(-1, nxt[:, None]).squeeze(-1), 0.0)
            seq = torch.cat([seq, nxt[:, None]], 1)
            alive &= nxt != self.eos
            if not alive.any():
                break
        return toks, lps

    def make(self, model: torch.nn.Module, version: int = 0, *, filter_zero_variance: bool = False,
             max_draws: int = 8) -> Batch:
        """A batch of ``prompts`` groups; with ``filter_zero_variance`` only groups whose rewards differ (the
        buffer's ``filter_zero_variance``, DAPO's dynamic sampling), drawing ``prompts`` more at a time, at most
        ``max_draws`` times (fewer groups then). ``self.rollout_rewards``: every sampled response's reward, kept or
        not (the demo's ``reward_mean``)."""
        was_training = model.training
        model.eval()
        rows: list[tuple[list[int], list[int], list[float], float, str]] = []
        self.rollout_rewards: list[float] = []
        for _ in range(max_draws if filter_zero_variance else 1):
            for group in self._groups(model):
                self.rollout_rewards += [r[3] for r in group]
                if len(rows) < self.prompts * self.group_size and (
                        not filter_zero_variance or len({r[3] for r in group}) > 1):
                    rows += group
            if len(rows) >= self.prompts * self.group_size:
                break
        model.train(was_training)
        return self._batch(rows, version)

    def _groups(self, model: torch.nn.Module) -> list[list[tuple[list[int], list[int], list[float], float, str]]]:
        prompts = []
        for p in range(self.prompts):
            text, answer = self.task.make_prompt(self.rng)
            prompts.append((list(self.tok(text)["input_ids"]), answer, f"toy{self.count}-{p}"))
        by_len: dict[int, list[int]] = {}
        for i, (ids, _, _) in enumerate(prompts):
            by_len.setdefault(len(ids), []).append(i)
        sampled: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for idx in by_len.values():  # one batched sampling pass per prompt length
            ids = torch.tensor([prompts[i][0] for i in idx]).repeat_interleave(self.group_size, 0)
            toks, lps = self._sample(model, ids)
            for k, i in enumerate(idx):
                sl = slice(k * self.group_size, (k + 1) * self.group_size)
                sampled[i] = (toks[sl], lps[sl])
        groups = []
        for i, (prompt_ids, answer, gid) in enumerate(prompts):
            toks, lps = sampled[i]
            group = []
            for j in range(self.group_size):
                resp = toks[j].tolist()
                n = resp.index(self.eos) + 1 if self.eos in resp else len(resp)
                completion = self.tok.decode(resp[: n - 1 if self.eos in resp else n], skip_special_tokens=True)
                group.append((prompt_ids, resp[:n], lps[j, :n].tolist(), self.task.score(completion, answer), gid))
            groups.append(group)
        self.count += 1  # group ids stay unique across draws
        return groups

    def _batch(self, rows: list, version: int) -> Batch:
        b = len(rows)
        width = max(len(p) + len(r) for p, r, *_ in rows)
        input_ids = np.full((b, width), self.pad, dtype=np.int32)
        mask = np.zeros((b, width), dtype=np.uint8)
        old = np.zeros((b, width), dtype=np.float32)
        versions = np.full((b, width), -1, dtype=np.int32)
        rewards = np.array([r[3] for r in rows], dtype=np.float32)
        groups = [r[4] for r in rows]
        adv = np.zeros(b, dtype=np.float32)
        for gid in dict.fromkeys(groups):
            idx = [i for i, g in enumerate(groups) if g == gid]
            r = rewards[idx]
            adv[idx] = (r - r.mean()) / (r.std(ddof=1) + 1e-4) if len(r) > 1 else 0.0
        for i, (p, resp, lp, _, _) in enumerate(rows):
            input_ids[i, : len(p)] = p
            input_ids[i, len(p): len(p) + len(resp)] = resp
            mask[i, len(p): len(p) + len(resp)] = 1
            old[i, len(p): len(p) + len(resp)] = lp
            versions[i, len(p): len(p) + len(resp)] = version
        ids = [f"{g}/{i}" for i, g in enumerate(groups)]
        return Batch(batch_id=hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()[:32], episode_ids=ids,
                     group_ids=groups, input_ids=input_ids, loss_mask=mask, old_logprobs=old,
                     token_versions=versions, advantages=adv, rewards=rewards,
                     prompt_lens=np.array([len(r[0]) for r in rows], dtype=np.int32),
                     seq_lens=np.array([len(r[0]) + len(r[1]) for r in rows], dtype=np.int32),
                     pad_token_id=self.pad, buffer_id="toy")
