"""Stage 5: model + predictor -> dual-phase expert-offload inference, with latency and memory figures.

Imports only the predictor artifact loader from earlier stages' training side (no Lightning).
"""

from duoserve.runtime.engine import ExpertsPlugin, OffloadEngine
from duoserve.runtime.generate import offload, parse_bytes, timed_generate
from duoserve.runtime.policies import POLICIES, Policy, get_policy

__all__ = ["POLICIES", "ExpertsPlugin", "OffloadEngine", "Policy", "get_policy", "offload", "parse_bytes",
           "timed_generate"]
