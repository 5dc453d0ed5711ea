"""Stage 5: model + predictor -> dual-phase expert-offload inference, with latency and memory figures.

Imports only the predictor artifact loader from earlier stages' training side (no Lightning).
The names below load on first use, so ``duoserve.runtime.policies`` (the CLI's help text) stays light.
"""

from duoserve._lazy import lazy_exports

_EXPORTS = {"ExpertsPlugin": "engine", "OffloadEngine": "engine", "offload": "generate", "parse_bytes": "generate",
            "timed_generate": "generate", "POLICIES": "policies", "Policy": "policies", "get_policy": "policies"}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
