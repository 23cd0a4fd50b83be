"""User code named in config (``"package.module:attribute"``): rewards, losses. Never from a message."""

from __future__ import annotations

import importlib
from typing import Any

from topics.errors import ConfigError


def load_object(spec: str, *, config_key: str) -> Any:
    """Import ``module`` and return ``attribute`` (dotted) of a ``"module:attribute"`` spec; it must be callable.

    Errors are ``ConfigError``s naming ``config_key``. The one dynamic-import site of the wire code paths for
    user plugins (``tests/unit/test_security_wire.py`` reviews it)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(config_key, f"{spec!r} is not 'module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(config_key, f"cannot import {spec!r}: {exc}") from exc
    if not callable(obj):
        raise ConfigError(config_key, f"{spec!r} is not callable")
    return obj
