"""Stage 5: model + predictor -> dual-phase expert-offload inference, with latency and memory figures.

Imports only the predictor artifact loader from earlier stages' training side (no Lightning).
The names below load on first use, so ``duoserve.runtime.policies`` (the CLI's help text) stays light.
"""

import importlib

_EXPORTS = {"ExpertsPlugin": "engine", "OffloadEngine": "engine", "offload": "generate", "parse_bytes": "generate",
            "timed_generate": "generate", "POLICIES": "policies", "Policy": "policies", "get_policy": "policies"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'duoserve.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"duoserve.runtime.{_EXPORTS[name]}"), name)
