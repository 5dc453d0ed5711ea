"""What a predictor buys on a given GPU (``duoserve-eval simulate``): the simulator over policies, predictors and
batch sizes, and the charts of the paper's figures (latency against accuracy, cache budget, look-ahead, prompt
length and batch size), and for each trained predictor the decode prefetch's minimum score that buys the most.

Shape legend: B sequences, L MoE layers, E experts, k top-k, d look-ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from duoserve.bench.drivers import RandomRouting, is_artifact
from duoserve.bench.costs import Costs, resolve_profile
from duoserve.bench.simulate import (ModelShape, Pass, Simulator, generation_passes, run, trace_passes,
                                     trace_requests)
from duoserve.files import atomic_path
from duoserve.runtime.policies import get_policy
from duoserve.runtime.settings import EngineSettings

ORACLE_CURVE = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)  # recalls of the latency-versus-accuracy chart's oracle
CHART_BATCHES = (1, 2, 4, 8, 16)
# prefetch minimum scores tried for each trained predictor: a wrong guess costs a whole copy, which on a copy-bound
# decode step can cost more than the right guesses save (docs/simulator.md, "Tuning the prefetch's minimum score")
MIN_SCORES = (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass
class SimulateSettings:
    """One simulation study: a model shape on a device profile, replaying ``traces`` (or uniform random routing of
    ``requests`` generations of ``prompt_len`` + ``new_tokens``) for each policy x predictor x batch size."""

    model_shape: str
    profile: str
    traces: Path | None = None
    layers: int | None = None  # keep this many decoder layers of the shape
    dtype: str = "bfloat16"
    policies: list[str] = field(default_factory=lambda: ["duoserve", "on-demand", "lru"])
    predictors: list[str] = field(default_factory=lambda: ["none", "oracle"])  # the predicting policies'
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    gpu_expert_budget: int | str | None = None  # bytes, or experts (settings.parse_budget)
    pin: tuple[tuple[int, int], ...] = ()  # (layer, expert) keys kept resident (the grid's points; not the sweeps')
    lookahead: int = 1
    prefetch_min_score: float = EngineSettings.prefetch_min_score  # copy ahead only guesses scored at least this
    defer_prefetch: bool = EngineSettings.defer_prefetch  # decode prefetches left to the next layer call (step graphs)
    expert_dtype: str = "model"
    requests: int | None = None  # the trace's first N requests (random routing: N generations, default 4)
    prompt_len: int = 512
    new_tokens: int = 32
    seed: int = 0
    host_op_us: float | None = None  # simulate a host of this pace (us per small op) rather than the profile's

    def __post_init__(self):
        for name in self.policies:
            get_policy(name)
        if min(self.batch_sizes) < 1 or (self.requests is not None and self.requests < 1):
            raise ValueError("batch sizes and the request count must be positive")
        if self.traces is None and (self.prompt_len < 1 or self.new_tokens < 2):
            raise ValueError("random routing needs a prompt of at least 1 token and at least 2 new tokens")


class Study:
    """The shape, costs and routing of ``s``, loaded once; ``point`` simulates one configuration."""

    def __init__(self, s: SimulateSettings):
        self.s = s
        self.profile = resolve_profile(s.profile)
        self.shape = ModelShape.of(s.model_shape, s.layers, s.dtype)
        self.shape.check(self.profile)
        self.costs = Costs(self.profile, s.host_op_us)
        self.requests = trace_requests(s.traces, self.shape, s.requests) if s.traces is not None else None
        self._done: dict[tuple, dict] = {}  # (policy, predictor, batch, settings) -> its simulation
        self._passes: dict[int, list[tuple[int, Pass]]] = {}  # batch -> its (batch index, pass) pairs, drawn once
        # (trained predictor, batch, look-ahead) -> its scores on those passes, which no other setting and no policy
        # changes
        self._scores: dict[tuple[str, int, int], dict] = {}

    def passes(self, batch: int) -> list[tuple[int, Pass]]:
        """The (batch index, pass) pairs of ``batch``: the same pass objects at every point, so a trained predictor's
        scores, keyed by them, are computed once (``Simulator``'s ``scores``)."""
        if batch not in self._passes:
            self._passes[batch] = list(self._draw(batch))
        return self._passes[batch]

    def _draw(self, batch: int) -> Iterator[tuple[int, Pass]]:
        s = self.s
        if self.requests is not None:
            yield from trace_passes(self.requests, batch)
            return
        routing = RandomRouting(self.shape.num_layers, self.shape.num_experts, self.shape.top_k, s.seed)
        for b in range(s.requests or 4):
            for p in generation_passes(routing, batch, s.prompt_len, s.new_tokens):
                yield b, p

    def point(self, policy: str, predictor: str, batch: int, budget: int | None = None,
              lookahead: int | None = None, min_score: float | None = None) -> dict:
        """One simulated configuration; ``budget``, ``lookahead`` or ``min_score`` given: a sweep's point (no pins)."""
        sweep = budget is not None or lookahead is not None or min_score is not None
        pin = self.s.pin if not sweep and get_policy(policy).reuse and not get_policy(policy).prefetch_layer else ()
        settings = EngineSettings(gpu_expert_budget=budget if budget is not None else self.s.gpu_expert_budget,
                                  lookahead=lookahead or self.s.lookahead, pin=pin,
                                  prefetch_min_score=self.s.prefetch_min_score if min_score is None else min_score,
                                  defer_prefetch=self.s.defer_prefetch)
        predictor = predictor if get_policy(policy).predict else None
        key = (policy, predictor, batch, settings)
        if key not in self._done:  # a sweep's point may be the grid's (or another sweep's): simulated once
            scores = self._scores.setdefault((predictor, batch, settings.lookahead), {}) \
                if predictor and is_artifact(predictor) else None
            sim = Simulator(self.shape, self.costs, get_policy(policy), predictor or "none", settings,
                            self.s.expert_dtype, self.s.seed, scores=scores)
            self._done[key] = run(sim, self.passes(batch))
        return {"policy": policy, "predictor": predictor, "batch_size": batch,
                "gpu_expert_budget": settings.gpu_expert_budget, "lookahead": settings.lookahead,
                "prefetch_min_score": settings.prefetch_min_score, **self._done[key]}


def _grid(s: SimulateSettings) -> list[tuple[str, str, int]]:
    return [(p, q, B) for B in s.batch_sizes for p in s.policies
            for q in (s.predictors if get_policy(p).predict else ["none"])]


def _notes(s: SimulateSettings, profile: dict) -> list[str]:
    """What the reader of a simulation must know about its inputs' limits."""
    version, notes = profile["profile_version"], []
    if s.expert_dtype != "model" and version < 7:
        timed = "one expert dequantized eagerly, launches included" if version < 3 else \
            "the eager dequantization pass, into scratch rows then copied into the slots"
        notes.append(f"this profile (version {version}) timed {timed}, not the engine's kernels straight into "
                     "the slots: quantized stores' dequantization, and so their TTFT, are overstated; measure the "
                     "device again with duoserve-run profile")
    if s.expert_dtype != "model" and s.expert_dtype not in profile.get("dequant_host_us", {}):
        notes.append(f"this profile (version {version}) did not time a quantized fetch's host work per dequantization "
                     "pass (the slot ids' upload, the pass's launch): each pass is charged one copy's queueing, so a "
                     "quantized decode step's host time is understated where the host is the bound; measure the "
                     "device again with duoserve-run profile")
    waiting = [p.name for p in map(get_policy, s.policies) if not (p.predict or p.prefetch_layer)]
    if version < 4 and waiting:
        notes.append(f"this profile (version {version}) has no routing_us: a layer call's whole host time is charged "
                     "before its fetches, where the engine queues them first and spends the rest while they copy, "
                     f"so {', '.join(waiting)}, which wait for every miss, come out slow where the host is the bound "
                     "(up to 1.27x the engine's decode on an H100); measure the device again with duoserve-run "
                     "profile")
    if "group_host_by_tokens" not in profile:
        notes.append("this profile timed a prefill group's host cost on calls of E/k tokens only, where a group of a "
                     "longer prompt costs more (0.59 against 0.71 ms at 64 tokens on an H100): a host-bound prefill "
                     "of many groups (on-demand's) comes out short; measure the device again with duoserve-run "
                     "profile")
    if any(map(is_artifact, s.predictors)) and any("launch_host_ms" not in row for row in profile["predictor_ms"]):
        notes.append("this profile timed the predictor's bare call, not the engine's launch around it (its history "
                     "written, its ids and scores copied back): a trained predictor's time per token is understated "
                     "where the host is the bound; measure the device again with duoserve-run profile")
    return notes


def simulate(s: SimulateSettings, charts: Path | None = None,
             on_point: Callable[[int, int, str], None] = lambda done, total, what: None) -> dict:
    """Every (policy, predictor, batch size) of ``s``; with ``charts``, also the sweeps the charts need, drawn
    there. ``on_point(done, total, description)`` reports progress."""
    study = Study(s)
    grid = _grid(s)
    sweeps = _sweeps(study) if charts is not None else {}
    total = len(grid) + sum(len(points) for points in sweeps.values())
    done = 0

    def measure(policy: str, predictor: str, batch: int, **kw) -> dict:
        nonlocal done
        on_point(done, total, f"{policy} {predictor} B={batch} {' '.join(f'{k}={v}' for k, v in kw.items())}")
        row = study.point(policy, predictor, batch, **kw)
        done += 1
        return row

    rows = [measure(*point) for point in grid]
    result = {"model_shape": s.model_shape, "layers": study.shape.num_layers, "profile": s.profile,
              "device": study.profile["device"], "traces": str(s.traces) if s.traces else None,
              # which engine the profile's layer costs describe: decode layers replayed from step graphs, or eager
              "step_graphs": bool(study.profile.get("step_graphs", False)), "defer_prefetch": s.defer_prefetch,
              "routing": "trace" if s.traces else f"random, prompt {s.prompt_len}, {s.new_tokens} new tokens",
              "expert_dtype": s.expert_dtype, "prefetch_min_score": s.prefetch_min_score,
              "host_scale": study.costs.host_scale, "notes": _notes(s, study.profile), "rows": rows}
    if charts is not None:
        result["sweeps"] = {name: [measure(*point, **kw) for point, kw in points] for name, points in sweeps.items()}
        result["best_min_score"] = best_min_scores(result["sweeps"]["min_score"])
        result["charts"] = draw_charts(result, charts)
    on_point(total, total, "done")
    return result


def _sweeps(study: Study) -> dict[str, list[tuple[tuple[str, str, int], dict]]]:
    """The extra points of the charts, at the first batch size: the oracle at several recalls (and every trained
    predictor asked for), then, with an oracle of recall 0.9 for the predicting policy, cache budgets for the
    caching policies, look-ahead depths and batch sizes; and each trained predictor at each of ``MIN_SCORES``,
    beside duoserve with no predictor (an oracle's guesses all score 1: no minimum changes them)."""
    s, shape = study.s, study.shape
    B = s.batch_sizes[0]
    policies = [p for p in s.policies if get_policy(p).pinned]
    accuracy = [(("duoserve", f"oracle:{p}", B), {}) for p in ORACLE_CURVE]
    accuracy += [(("duoserve", q, B), {}) for q in s.predictors if is_artifact(q)]
    accuracy += [((p, "none", B), {}) for p in policies if not get_policy(p).predict]
    nbytes = shape.layout.nbytes
    slots = sorted({m * shape.top_k for m in (2, 4, 8, 16, 32)} | {shape.num_experts, shape.num_layers *
                                                                    shape.num_experts // 4})
    caching = [p for p in policies if get_policy(p).reuse and not get_policy(p).prefetch_layer]
    budget = [((p, "oracle:0.9" if get_policy(p).predict else "none", B), {"budget": n * nbytes})
              for p in caching for n in slots if n <= shape.num_layers * shape.num_experts]
    depth = [(("duoserve", "oracle:0.9", B), {"lookahead": d}) for d in range(1, min(4, shape.num_layers))]
    batch = [((p, "oracle:0.9" if get_policy(p).predict else "none", b), {}) for p in policies
             for b in CHART_BATCHES]
    trained = [q for q in s.predictors if is_artifact(q)]
    min_score = [(("duoserve", q, B), {"min_score": m}) for q in trained for m in MIN_SCORES]
    min_score += [(("duoserve", "none", B), {})] if trained else []
    return {"accuracy": accuracy, "budget": budget, "lookahead": depth, "batch": batch, "min_score": min_score}


def best_min_scores(points: list[dict]) -> list[dict]:
    """Per trained predictor of the min-score sweep: the minimum score of the lowest time per token (P50), beside its
    time at the lowest minimum tried and the time with no predictor."""
    none = next((r["tpot_ms"]["p50"] for r in points if r["predictor"] == "none"), None)
    best = []
    for predictor, tried in _by_predictor(points).items():
        tried = sorted(tried, key=lambda r: r["prefetch_min_score"])
        top = _fastest(tried)
        best.append({"predictor": predictor, "batch_size": top["batch_size"], "min_score": top["prefetch_min_score"],
                     "tpot_p50_ms": top["tpot_ms"]["p50"], "lowest_min_score": tried[0]["prefetch_min_score"],
                     "lowest_tpot_p50_ms": tried[0]["tpot_ms"]["p50"], "no_predictor_tpot_p50_ms": none})
    return best


def _by_predictor(points: list[dict]) -> dict[str, list[dict]]:
    """The min-score sweep's points of each trained predictor, in their order (duoserve with no predictor left out)."""
    by: dict[str, list[dict]] = {}
    for r in points:
        if r["predictor"] != "none":
            by.setdefault(r["predictor"], []).append(r)
    return by


def _fastest(points: Iterable[dict]) -> dict:
    """The point of the lowest time per token (P50); of equal ones, the lowest minimum score."""
    return min(points, key=lambda r: (r["tpot_ms"]["p50"], r["prefetch_min_score"]))


def draw_charts(result: dict, folder: Path) -> list[str]:
    """The PNG charts of a simulation with sweeps, written into ``folder``; their file names."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    sweeps, title = result["sweeps"], f"{result['model_shape']} on {result['device']} (simulated)"
    written = []

    def save(fig, name: str) -> None:
        with atomic_path(folder / name) as tmp:
            fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(name)

    fig, ax = plt.subplots(figsize=(6, 4))
    oracle = [r for r in sweeps["accuracy"] if (r["predictor"] or "").startswith("oracle")]
    ax.plot([_recall(r) for r in oracle], [r["tpot_ms"]["p50"] for r in oracle], "o-", label="duoserve, oracle")
    styles = iter([("--", "gray"), (":", "black"), ("-.", "tab:red"), ("--", "tab:green")])
    for r in sweeps["accuracy"]:
        if r["predictor"] and not r["predictor"].startswith("oracle"):
            ax.plot(_recall(r), r["tpot_ms"]["p50"], "s", label=f"duoserve, {Path(r['predictor']).name}")
        elif r["predictor"] is None:  # a policy that predicts nothing: a line across
            ls, color = next(styles, ("--", "gray"))
            ax.axhline(r["tpot_ms"]["p50"], ls=ls, lw=1, color=color, label=r["policy"])
    ax.set(xlabel="prefetch precision (share of copies made ahead that the layer used)",
           ylabel="time per output token, P50 (ms)", title=title)
    ax.legend(fontsize=8)
    save(fig, "tpot_vs_accuracy.png")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for policy in sorted({r["policy"] for r in sweeps["budget"]}):
        points = [r for r in sweeps["budget"] if r["policy"] == policy]
        gb = [r["peak_expert_bytes"] / 1e9 for r in points]
        ax1.plot(gb, [r["tpot_ms"]["p50"] for r in points], "o-", label=policy)
        ax2.plot(gb, [sum(r["bytes_h2d"].values()) / 1e9 for r in points], "o-", label=policy)
    ax1.set(xscale="log", xlabel="GPU expert cache (GB)", ylabel="time per output token, P50 (ms)", title=title)
    ax2.set(xscale="log", xlabel="GPU expert cache (GB)", ylabel="bytes moved (GB)")
    for ax in (ax1, ax2):  # plain numbers on a log axis, no crowded minor labels
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax1.legend(fontsize=8)
    save(fig, "tpot_vs_budget.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    points = sweeps["lookahead"]
    ax.plot([r["lookahead"] for r in points], [r["tpot_ms"]["p50"] for r in points], "o-", label="duoserve, oracle:0.9")
    ax.set(xlabel="look-ahead depth d (layers)", ylabel="time per output token, P50 (ms)", title=title)
    ax.legend(fontsize=8)
    save(fig, "tpot_vs_lookahead.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in result["rows"]:
        if r["batch_size"] == result["rows"][0]["batch_size"] and r["prefill_points"]:
            tokens, ms = zip(*r["prefill_points"])
            ax.plot(tokens, ms, ".", label=f"{r['policy']} {r['predictor'] or ''}".strip())
    ax.set(xlabel="prompt tokens of the batch", ylabel="TTFT (ms)", title=title)
    ax.legend(fontsize=8)
    save(fig, "ttft_vs_prompt.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in sorted({r["policy"] for r in sweeps["batch"]}):
        points = [r for r in sweeps["batch"] if r["policy"] == policy]
        ax.plot([r["batch_size"] for r in points], [r["batch_size"] * 1e3 / r["tpot_ms"]["mean"] for r in points],
                "o-", label=policy)
    ax.set(xscale="log", xlabel="batch size", ylabel="decode throughput (tokens/s)", title=title)
    ax.set_xticks(CHART_BATCHES, [str(b) for b in CHART_BATCHES])
    ax.legend(fontsize=8)
    save(fig, "throughput_vs_batch.png")

    if sweeps["min_score"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in sweeps["min_score"]:
            if r["predictor"] == "none":
                ax.axhline(r["tpot_ms"]["p50"], ls="--", lw=1, color="gray", label="duoserve, no predictor")
        for predictor, points in _by_predictor(sweeps["min_score"]).items():
            ax.plot([r["prefetch_min_score"] for r in points], [r["tpot_ms"]["p50"] for r in points], "o-",
                    label=f"duoserve, {Path(predictor).name}")
        ax.set(xlabel="prefetch minimum score (--prefetch-min-score)", ylabel="time per output token, P50 (ms)",
               title=title)
        ax.legend(fontsize=8)
        save(fig, "tpot_vs_min_score.png")
    return written


def _recall(row: dict) -> float:
    return row["prefetch_precision"] if row["prefetch_precision"] is not None else 0.0


def what_it_buys(s: SimulateSettings, recalls: dict[str, float], artifact: str | None = None,
                 trained: str = "trained MLP") -> list[dict]:
    """Simulated decode latency of each scorer of an accuracy report (``recalls``: its decode recall by name):
    the ``trained`` one runs as itself (``artifact``), and again at the best of the other ``MIN_SCORES`` (what it
    buys tuned); a baseline, which the runtime cannot run, as an oracle of its recall (all its guesses score 1);
    beside on-demand and lru. Rows best time per token first."""
    study = Study(s)
    B = s.batch_sizes[0]
    rows = []
    for name, recall in recalls.items():
        predictor = artifact if name == trained and artifact else f"oracle:{min(max(recall, 0.0), 1.0):.4f}"
        row = study.point("duoserve", predictor, B)
        rows.append({"scorer": name, "recall": recall, "simulated_as": predictor, **_latency(row)})
        if predictor == artifact:
            tuned = _fastest(study.point("duoserve", artifact, B, min_score=m) for m in MIN_SCORES if m > 0)
            rows.append({"scorer": f"{name}, min score {tuned['prefetch_min_score']:g}", "recall": recall,
                         "simulated_as": artifact, **_latency(tuned)})
    for policy in ("on-demand", "lru"):
        rows.append({"scorer": f"({policy}: no prediction)", "recall": None, "simulated_as": policy,
                     **_latency(study.point(policy, "none", B))})
    return sorted(rows, key=lambda r: r["tpot_p50_ms"])


def _latency(row: dict) -> dict:
    return {"tpot_p50_ms": row["tpot_ms"]["p50"], "ttft_p50_ms": row["ttft_ms"]["p50"],
            "decode_bytes": row["bytes_h2d"]["decode"], "decode_hit_rate": row["hit_rate"]["decode"],
            "prefetch_min_score": row["prefetch_min_score"]}
