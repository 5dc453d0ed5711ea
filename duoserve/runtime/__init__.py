"""Stage 5: model + predictor -> dual-phase expert-offload inference, with latency and memory figures.

Imports nothing from the trace, train or evaluate stages: models come through ``duoserve.discovery``
and ``duoserve.loading``, predictors through the torch-only ``duoserve.predictor`` (no Lightning).
The names below load on first use, so ``duoserve.runtime.policies`` (the CLI's help text) stays light.
"""

from duoserve._lazy import lazy_exports

_EXPORTS = {"EngineSettings": "settings", "ExpertsPlugin": "plugin", "Generation": "generation",
            "OffloadEngine": "engine", "POLICIES": "policies", "Policy": "policies", "cache_for": "generation",
            "generate": "generation", "get_policy": "policies", "kv_cache": "generation", "offload": "generation",
            "offload_plugin": "generation", "parse_budget": "settings", "parse_bytes": "settings",
            "timed_generate": "generation"}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
