"""Stage 1: model + prompts -> routing traces (Parquet).

The names below load on first use: reading a trace (``duoserve.trace.format``) needs no torch.
"""

from duoserve._lazy import lazy_exports

_EXPORTS = {"TRACE_VERSION": "format", "Trace": "format", "TraceMeta": "format", "open_trace": "format",
            "RoutingRecorder": "hooks"}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
