"""streamforge: CLI, configuration, telemetry and the notebook API (``RLConfig``, ``train``)."""

from __future__ import annotations

from typing import Any

__all__ = ["RLConfig", "train"]


def __getattr__(name: str) -> Any:  # lazy: `import streamforge` stays cheap for the CLI and the roles
    if name in ("RLConfig", "train", "TrainResult"):
        from streamforge import api

        return getattr(api, name)
    raise AttributeError(name)
