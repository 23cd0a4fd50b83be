"""Role names -> the ``Service`` classes that implement them, and how each is built from the run config.

The role classes are imported lazily (each pulls heavy dependencies). ``build_role(name, config)`` is where the
app hands a role its own config section and the shared ``RoleContext`` (``runtime/context.py``), never the whole
``RunConfig``; the cross-section values a role needs (the trainer's sampling temperature, the staleness bound)
are passed here by name.
"""

from __future__ import annotations

import importlib
from typing import Any

ROLES: dict[str, str] = {
    "feeder": "producers.feeder:FeederRole",
    "generator": "producers.generator:GeneratorRole",
    "buffer": "buffer.service:BufferRole",
    "trainer": "consumers.trainer:TrainerRole",
    "env": "services.env_replica:EnvRole",
    "reward": "services.reward_replica:RewardRole",
    "evaluator": "producers.evaluator:EvaluatorRole",
}


class RoleNotAvailable(Exception):
    """The role's module or class cannot be imported in this installation."""


def role_class(role: str) -> Any:
    """The class implementing ``role`` (a name from ``ROLES``, a fixed allow-list: never from a message)."""
    if role not in ROLES:
        raise RoleNotAvailable(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    module_name, _, cls_name = ROLES[role].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == module_name or module_name.startswith(exc.name + ".")):
            raise RoleNotAvailable(f"role {role!r} is not built yet ({module_name} does not exist)") from exc
        raise
    try:
        return getattr(module, cls_name)
    except AttributeError as exc:
        raise RoleNotAvailable(f"role {role!r} is not built yet ({ROLES[role]} does not exist)") from exc


def prepare_process(role: str, config: Any) -> None:
    """Process-wide settings that a role's libraries read once, when they load: made by ``streamforge run`` before
    ``build_role`` imports the role. The trainer's OpenMP spin (``trainer.omp_spincount``, runtime/cpus.py)."""
    if role == "trainer":
        from runtime.cpus import omp_spin

        omp_spin(config.trainer.omp_spincount)


def build_role(role: str, config: Any, **kwargs: Any) -> Any:
    """The ``role`` service for the run config ``config`` (``kwargs``: test hooks such as an injected engine)."""
    cls = role_class(role)
    ctx = config.context()
    if role == "feeder":
        return cls(config.feeder, ctx, **kwargs)
    if role == "generator":
        return cls(config.generator, ctx, weightsync=config.weightsync, local_source=config.feeder, env=config.env,
                   **kwargs)
    if role == "buffer":
        return cls(config.buffer, ctx, **kwargs)
    if role == "env":
        return cls(config.env, ctx, **kwargs)
    if role == "reward":
        return cls(config.reward, ctx, **kwargs)
    if role == "evaluator":
        return cls(config.eval, ctx, generator=config.generator, feeder_source=config.feeder.source, **kwargs)
    return cls(config.trainer, ctx, weightsync=config.weightsync.for_engine(config.generator.dtype),
               temperature=config.generator.temperature, max_completion_length=config.generator.max_tokens,
               max_staleness=config.staleness.max_versions if config.staleness.bounded else None, **kwargs)
