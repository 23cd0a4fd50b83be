"""Role names -> the ``Service`` classes that implement them (imported lazily: each pulls heavy dependencies)."""

from __future__ import annotations

import importlib
from typing import Any

ROLES: dict[str, str] = {
    "feeder": "producers.feeder:FeederRole",
    "generator": "producers.generator:GeneratorRole",
    "buffer": "buffer.service:BufferRole",
    "trainer": "consumers.trainer:TrainerRole",
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
