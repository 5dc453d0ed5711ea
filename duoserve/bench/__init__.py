"""The benchmark harness: offload policies side by side, the drivers that stand in for trained routing, the bounds
and targets, real model shapes with random weights, and result files that say how they were made.

``duoserve-run bench`` and the scripts in ``benchmarks/`` call it; the runtime never imports it.
"""
