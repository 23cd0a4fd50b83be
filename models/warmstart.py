"""A short supervised warm start of a toy-task policy, so that RL starts from a model that reads its prompt.

RL post-training starts from a model that already attends to its prompt. A freshly initialised tiny model does
not: GRPO on it collapses to one answer for every prompt (measured: addmod10 stalls at mean reward 0.1, "4" for all
100 prompts, at lr 3e-4 to 3e-3 over 800 steps). ``warm_start(model_dir, task, ...)`` runs plain cross-entropy
steps on ``(prompt, answer + <eos>)`` pairs of a ``models.tasks`` task's training items, with transformers and AdamW, until the
greedy accuracy on the training batches reaches ``target_accuracy`` (or ``max_steps``), then saves the weights
back into ``model_dir`` (safetensors). Deterministic for a seed. The demo uses it and says so.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch


def warm_start(model_dir: str | Path, task: str, *, target_accuracy: float = 0.3, max_steps: int = 1000,
               batch_size: int = 64, lr: float = 1e-3, seed: int = 0) -> dict[str, float]:
    """Supervised steps until greedy accuracy >= ``target_accuracy``; returns ``{"steps", "accuracy"}``."""
    from transformers import AutoModelForCausalLM

    from models.tasks import get_task
    from models.tiny_model import load_tokenizer

    model_dir = Path(model_dir)
    tok = load_tokenizer(model_dir)
    t = get_task(task)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    eos = int(tok.eos_token_id)
    pad = int(tok.pad_token_id or 0)
    ema, step = 0.0, 0
    for step in range(1, max_steps + 1):
        rows = []
        for _ in range(batch_size):
            text, answer = t.prompt(rng, "train")  # never a held-out item (models/tasks.py)
            p = list(tok(text)["input_ids"])
            a = list(tok(answer, add_special_tokens=False)["input_ids"]) + [eos]
            rows.append((p, a))
        width = max(len(p) + len(a) for p, a in rows)
        ids = torch.full((batch_size, width), pad, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        for i, (p, a) in enumerate(rows):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p): len(p) + len(a)] = torch.tensor(a)
        logits = model(ids).logits[:, :-1]
        target = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():  # greedy accuracy of the whole answer (all its tokens right)
            mask = target != -100
            right = ((logits.argmax(-1) == target) | ~mask).all(-1).float().mean().item()
        ema = right if step == 1 else 0.9 * ema + 0.1 * right
        if step >= 10 and ema >= target_accuracy:
            break
    model.save_pretrained(model_dir, safe_serialization=True)
    return {"steps": float(step), "accuracy": ema}
