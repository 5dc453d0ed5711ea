"""A device profile's costs as the offload simulator reads them: milliseconds, interpolated between what
``duoserve-run profile`` measured (``profile.py``), and the profiles shipped with the package."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from duoserve.bench.profile import load_profile

PROFILES = Path(__file__).parent / "profiles"  # the device profiles shipped with the package


def builtin_profiles() -> list[str]:
    return sorted(f.stem for f in PROFILES.glob("*.json"))


def resolve_profile(spec: str | Path) -> dict:
    """A device profile from a file, or one shipped with the package by name (``h200-qwen3-30b-a3b``), validated."""
    path = Path(spec)
    if not path.exists() and (PROFILES / f"{spec}.json").exists():
        path = PROFILES / f"{spec}.json"
    elif not path.exists():
        raise FileNotFoundError(f"no device profile {spec}: give a file made by duoserve-run profile or one of the "
                                f"shipped ones: {', '.join(builtin_profiles())}")
    return load_profile(path)


def host_scale(profile: dict, host_op_us: float | None) -> float:
    """How much slower than the profile's host a host of pace ``host_op_us`` is (1 where none is given)."""
    if host_op_us is None:
        return 1.0
    if host_op_us <= 0:
        raise ValueError(f"a host's pace is a positive number of microseconds per op, not {host_op_us}")
    if not profile.get("host_op_us"):
        raise ValueError("this profile did not record its host's pace (host_op_us), so it cannot be rescaled to "
                         "another: measure a new one with duoserve-run profile, or leave the pace out")
    return host_op_us / profile["host_op_us"]["median"]


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through ``points`` (x, y), extended linearly past either end, never below 0."""
    points = sorted(points)
    if len(points) == 1:
        return points[0][1]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if x <= xs[0]:
        (x0, y0), (x1, y1) = points[0], points[1]
    elif x >= xs[-1]:
        (x0, y0), (x1, y1) = points[-2], points[-1]
    else:
        return float(np.interp(x, xs, ys))
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y1, 0.0)


class Costs:
    """A device profile's costs in milliseconds, interpolated between what it measured (each look-up memoised: a
    simulation asks the same few questions millions of times).

    ``host_op_us`` simulates a host of that pace (microseconds per small op, the bench's gauge) rather than the
    profile's own: every host-side cost scales by its ratio to the pace the profile recorded, the device's costs
    stay. The same host drifts by tens of percent between runs, and a host-bound step moves with it."""

    def __init__(self, profile: dict, host_op_us: float | None = None):
        self.profile = profile
        self.host_scale = host_scale(profile, host_op_us)
        h = self.host_scale
        for name in ("copy_ms", "per_expert_ms", "call_host_ms", "routing_host_ms", "pass_ms", "layer_before_ms",
                     "predictor_ms", "fetch_host_ms"):
            setattr(self, name, functools.cache(getattr(self, name)))
        self.expert_bytes = profile["geometry"]["expert_bytes"]
        # a CPU's profile has no pinned copies (the engine's copies there are the host's memcpy): pageable stands in
        self._copy = {kind: [(math.log2(c["bytes"]), c[f"{kind}_gbps"] or c["pageable_gbps"]) for c in profile["copy"]]
                      for kind in ("pinned", "pageable")}
        self.copy_host_ms = profile["copy_host_us"] / 1e3 * h
        self.dequant_ms = profile["dequant_ms"]
        # host ms a quantized fetch's dequantization pass adds, by expert dtype (a dtype missing: not timed, as
        # before version 8)
        self.dequant_host_ms = {fmt: us / 1e3 * h for fmt, us in profile.get("dequant_host_us", {}).items()}
        groups = {}
        for row in profile["expert_ms"]:
            groups.setdefault(row["experts"], []).append((row["tokens"], row["ms"]))
        if len(groups) < 2:
            raise ValueError("the profile's expert_ms needs groups of two sizes (1 and k experts)")
        (g1, one), (gk, many) = sorted(groups.items())[:2]
        tokens = sorted({t for t, _ in one} & {t for t, _ in many})
        # a group of g experts with T tokens each: base + g * per_expert(T)
        self._per_expert = [(t, max((_interp(many, t) - _interp(one, t)) / (gk - g1), 0.0)) for t in tokens]
        self._base = max(_interp(one, tokens[0]) - g1 * self._per_expert[0][1], 0.0)

        def by_phase(key: str) -> dict[str, list[tuple[int, float]]]:
            # a profile before version 4 has no routing_us: the whole call then comes before its fetches
            return {phase: [(r["tokens"], r.get(key, r["us"]) / 1e3 * h) for r in profile["call_host_us"]
                            if r["phase"] == phase] for phase in ("prefill", "decode")}

        self._call_host, self._routing_host = by_phase("us"), by_phase("routing_us")
        self._pass = {name: profile[name] for name in ("layer_ms", "step_ms")}
        self.module_copy_ms = profile["module_copy_ms"]
        self._fetch_host = [(math.log2(r["slots"]), max(r["us"], profile["copy_host_us"]) / 1e3 * h)
                            for r in profile["fetch_host_us"]]
        # (log2 tokens, ms) of a prefill group's host cost; one point (at E/k tokens) before version 6
        by_tokens = profile.get("group_host_by_tokens") or [{"tokens": 1, "us": profile["group_host_us"]}]
        self._group_host = [(math.log2(r["tokens"]), r["us"] / 1e3 * h) for r in by_tokens]
        # the engine's whole launch where the profile timed it, else the bare call; the device's part from the latter
        self._predictor = [(r["batch"], (r.get("launch_host_ms", r["host_ms"]) * h,
                                         max(r["wall_ms"] - r["host_ms"], 0.0))) for r in profile["predictor_ms"]]

    def copy_ms(self, nbytes: int, pinned: bool = True) -> float:
        """One host-to-device copy of ``nbytes``: at the bandwidth measured for that size (clamped to the sizes
        measured)."""
        points = self._copy["pinned" if pinned else "pageable"]
        size = min(max(math.log2(max(nbytes, 1)), points[0][0]), points[-1][0])
        return nbytes / (_interp(points, size) * 1e9) * 1e3

    def fetch_host_ms(self, slots: int) -> float:
        """Host time each expert fetched on a miss adds, in a cache of ``slots`` (between the sizes measured)."""
        points = self._fetch_host
        return _interp(points, min(max(math.log2(slots), points[0][0]), points[-1][0]))

    def per_expert_ms(self, tokens: int) -> float:
        return _interp(self._per_expert, tokens)

    def group_ms(self, counts: Iterable[int]) -> float:
        """Compute-stream time of one group of experts with ``counts`` tokens each."""
        return self._base + sum(map(self.per_expert_ms, counts))

    def group_host_ms(self, tokens: int) -> float:
        """Host time each compute group past a call's first adds, in a call of ``tokens`` (between the sizes
        measured, on a log scale; the nearest outside them)."""
        points = self._group_host
        return _interp(points, min(max(math.log2(max(tokens, 1)), points[0][0]), points[-1][0]))

    def call_host_ms(self, phase: str, tokens: int) -> float:
        """Host time of a layer call of ``tokens`` whose experts are all cached."""
        points = self._call_host[phase] or self._call_host["prefill"]
        return _interp(points, tokens)

    def routing_host_ms(self, phase: str, tokens: int) -> float:
        """The part of ``call_host_ms`` before the call queues any fetch (its routing read), at most all of it."""
        points = self._routing_host[phase] or self._routing_host["prefill"]
        return min(_interp(points, tokens), self.call_host_ms(phase, tokens))

    def pass_ms(self, name: str, phase: str, batch: int, context: int) -> tuple[float, float]:
        """``layer_ms`` (per decoder layer) or ``step_ms`` (per pass) of ``phase`` at (B, C), wall and device: linear
        in C within each measured B, then linear in B. The wall is the host's launching, so it takes the host's pace."""
        wall, device = (self._grid(self._pass[name], f"{phase}{key}", batch, context) for key in ("_ms", "_device_ms"))
        return wall * self.host_scale, device

    def layer_before_ms(self, phase: str, batch: int, context: int) -> float | None:
        """The part of ``layer_ms``' wall of ``phase`` at (B, C) before the layer's experts call, at the host's pace;
        None where the profile did not time it (before version 9)."""
        rows = self._pass["layer_ms"]
        key = f"{phase}_before_ms"
        if not all(key in row for row in rows):
            return None
        return min(self._grid(rows, key, batch, context) * self.host_scale, self.pass_ms("layer_ms", phase, batch,
                                                                                          context)[0])

    @staticmethod
    def _grid(rows: list[dict], key: str, batch: int, context: int) -> float:
        by_batch: dict[int, list[tuple[int, float]]] = {}
        for row in rows:
            by_batch.setdefault(row["batch"], []).append((row["context"], row[key]))
        return _interp([(B, _interp(points, context)) for B, points in by_batch.items()], batch)

    def predictor_ms(self, batch: int) -> tuple[float, float]:
        """One predictor call at ``batch``: host time, then device time after it."""
        return tuple(_interp([(B, cost[i]) for B, cost in self._predictor], batch) for i in range(2))
