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


def test_environment_example_is_served_and_played_through_the_router(example_modules: Path) -> None:
    """The README's environment under a real replica server (in this process) and the router's session."""
    import time

    from envs.api import ActionRejected
    from envs.config import EnvConfig
    from envs.routing import ServiceEnvRouter
    from envs.serving import EnvServer
    from runtime.services import Replica
    from topics.schemas import ServiceBeat

    assert "my_env.py" in examples()

    class OneReplica:  # the directory's part the router uses: this server is the only replica
        def __init__(self, beat: ServiceBeat) -> None:
            self.beat = beat

        async def wait_pick(self, service: str, *, timeout_s: float, exclude=(), hold: bool = True) -> Replica:
            return Replica(self.beat, time.monotonic())

        def mark_lost(self, service: str, replica_id: str) -> None:
            raise AssertionError("the replica was lost")

    async def play() -> list[float]:
        cfg = EnvConfig(name="guess", impl="my_env:GuessEnv", capacity=2)
        server = EnvServer(cfg, replica_id="guess-0")
        await server.start()
        try:
            beat = ServiceBeat(service="guess", replica_id="guess-0", address=server.address, meta=server.meta)
            session = await ServiceEnvRouter(OneReplica(beat), cfg).open("guess")
            assert (await session.reset(seed=3)).text == "Guess a number from 1 to 10."
            with pytest.raises(ActionRejected, match="answer with a number"):
                await session.step("five")
            low, high, rewards = 1, 10, []
            for _ in range(4):  # bisection finds it in at most 4 guesses
                guess = (low + high) // 2
                obs = await session.step(str(guess))
                rewards.append(obs.reward)
                if obs.done:
                    break
                low, high = (guess + 1, high) if obs.text == "Higher." else (low, guess - 1)
            await session.close()
            return rewards
        finally:
            await server.stop()

    rewards = asyncio.run(play())
    assert rewards[-1] == 1.0 and set(rewards[:-1]) <= {0.0}


def test_served_reward_example_scores_a_request_in_a_reward_replica(example_modules: Path) -> None:
    from runtime.context import RoleContext
    from runtime.remote_reward import request_for
    from services.config import RewardServiceConfig
    from services.reward_replica import RewardRole

    assert "my_judge.py" in examples()
    role = RewardRole(RewardServiceConfig(name="judge", impl="my_judge:judge"), RoleContext())
    prompt = Prompt(prompt_id="p", task="addmod10", text="3+4=", answer="7")
    try:
        reply = asyncio.run(role.score(request_for([prompt] * 3, ["7", "it is 7", "8"])))
    finally:
        asyncio.run(role._stop())
    assert list(reply.scores) == [1.0, 1.0, 0.0] and reply.errors == ["", "", ""]
