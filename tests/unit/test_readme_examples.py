"""The README's examples run: each ```python block after an `<!-- example: NAME -->` marker is written to NAME and
used the way the README says (reward by import path through the generator's RewardSet, loss through the
trainer's registry), and the README's override lines parse into a valid config."""

from __future__ import annotations

import asyncio
import re
import shlex
import sys
from pathlib import Path

import pytest

from streamforge.config import load_config
from topics.schemas import Prompt

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def examples() -> dict[str, str]:
    return dict(re.findall(r"<!-- example: (\S+) -->\n```python\n(.*?)```", README, flags=re.DOTALL))


@pytest.fixture
def example_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name, code in examples().items():
        (tmp_path / name).write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in examples():
        sys.modules.pop(Path(name).stem, None)


def test_reward_example_scores_through_the_reward_set(example_modules: Path) -> None:
    from producers.rewards import RewardSet

    assert "my_rewards.py" in examples()
    rewards = RewardSet(["toy", "my_rewards:ends_with_answer"], [1.0, 0.5])
    try:
        prompt = Prompt(prompt_id="p", task="addmod10", text="3+4=", answer="7")
        scored = asyncio.run(rewards.score(prompt, "7"))
        assert scored.reward == pytest.approx(1.5)
        assert scored.components == {"toy": 1.0, "ends_with_answer": 1.0}
    finally:
        rewards.close()


def test_readme_command_lines_parse_into_a_valid_config() -> None:
    lines = re.findall(r"^streamforge run \w+ (.*?)$", README.replace("\\\n", " "), flags=re.MULTILINE)
    assert lines
    for line in lines:
        args = shlex.split(line)
        overrides = [a for a in args if a.startswith("--") and "=" in a and not a.startswith("--config")]
        load_config(ROOT / "configs" / "demo.yaml", overrides, environ={})


def test_loss_example_registers_and_trains_a_step(example_modules: Path) -> None:
    import torch

    from consumers.losses import make_loss

    assert "my_losses.py" in examples()
    by_import = make_loss("my_losses:clipped_pg", epsilon=0.1)
    by_name = make_loss("clipped_pg", epsilon=0.1)  # importing the module registered it
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.5], [-0.6, -0.1]])
    adv, mask = torch.tensor([1.0, -1.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    for fn in (by_import, by_name):
        # the trainer passes keyword extras; a loss with the plain signature never sees them
        loss, metrics = fn(logprobs, old, adv, mask, None, entropy=torch.zeros(2, 2), prox_logprobs=None)
        loss.backward()
        assert torch.isfinite(loss) and "ratio_mean" in metrics
        assert logprobs.grad is not None and logprobs.grad[1, 1] == 0  # masked token gets no gradient
        logprobs.grad = None
