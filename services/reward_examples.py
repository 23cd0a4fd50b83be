"""An example reward to serve remotely: ``streamforge run reward --reward.impl services.reward_examples:toy_judge``.

``toy_judge(prompt, response_text)`` scores a toy task's response exactly as the built-in ``toy`` reward does
(``models.tasks``), so a run can compare ``generator.rewards: [toy]`` with ``[remote:<name>]``. A real served reward
has the same signature and does what a generator should not: calls an LLM judge, runs code in a sandbox.
"""

from __future__ import annotations

from models.tasks import get_task
from topics.schemas import Prompt


def toy_judge(prompt: Prompt, response_text: str) -> float:
    """1.0 if the response solves the prompt's toy task (``prompt.task``), else 0.0."""
    return get_task(prompt.task).score(response_text, prompt.answer)
