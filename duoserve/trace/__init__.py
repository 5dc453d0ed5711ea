"""Stage 1: model + prompts -> routing traces (Parquet)."""

from duoserve.trace.format import TRACE_VERSION, Trace, TraceMeta, open_trace
from duoserve.trace.hooks import MoEGeometry, RoutingRecorder, UnsupportedModelError, find_moe_layers, moe_geometry

__all__ = ["TRACE_VERSION", "MoEGeometry", "RoutingRecorder", "Trace", "TraceMeta", "UnsupportedModelError",
           "find_moe_layers", "moe_geometry", "open_trace"]
