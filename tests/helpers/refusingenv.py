"""An environment whose every ``reset`` raises (``--env.impl helpers.refusingenv:RefusingEnv``): a generator's
group against it has no episode, a stated outcome (``env_step_failed``) the audit counts."""

from __future__ import annotations

from typing import Any

from helpers.countenv import CountEnv, CountObservation


class RefusingEnv(CountEnv):
    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> CountObservation:
        raise RuntimeError(f"this environment refuses every reset (episode {episode_id})")
