"""The offload simulator: the engine's own decisions on simulated clocks."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from duoserve import load_predictor
from duoserve.bench.drivers import OraclePredictor, RandomRouting
from duoserve.bench.clocks import SimCompute, SimStore, SimStreams
from duoserve.bench.costs import Costs
from duoserve.bench.simulate import ModelShape, Pass, Simulator, random_passes, run, trace_passes, trace_requests
from duoserve.discovery import find_moe_layers
from duoserve.loading import load_model
from duoserve.predictor.artifact import load_predictor, save_predictor
from duoserve.predictor.fast import TrainedPredictor
from duoserve.predictor.model import ExpertPredictor, FeatureSpec
from duoserve.runtime.cache import ExpertCache
from duoserve.runtime.engine import OffloadEngine
from duoserve.runtime.experts import Routing
from duoserve.runtime.generation import offload, timed_generate
from duoserve.runtime.policies import POLICIES
from duoserve.runtime.quant import stage_buffers
from duoserve.runtime.schedule import GroupedFetch
from duoserve.runtime.settings import EngineSettings
from duoserve.runtime.store import put_experts
from duoserve.runtime.streams import NullTimers
from duoserve.trace.format import open_trace
from tests.conftest import load_benchmark, needs_flame_moe, write_trace


def cpu_profile(shape: ModelShape) -> dict:
    """A profile of made-up costs for ``shape``: decisions do not depend on costs, times are not asserted here."""
    grid = [{"batch": B, "context": C, "decode_ms": 0.1 * B, "prefill_ms": 0.01 * B * C, "decode_device_ms": 0.05,
             "prefill_device_ms": 0.01 * B * C} for B in (1, 8) for C in (16, 512)]
    return {"profile_version": 2, "device": "made up", "model": shape.name,
            "geometry": {"moe_layers": shape.num_layers, "experts": shape.num_experts, "top_k": shape.top_k,
                         "hidden_size": 0, "expert_bytes": shape.layout.nbytes},
            "copy": [{"bytes": 1 << 20, "pinned_gbps": 50.0, "pageable_gbps": 6.0},
                     {"bytes": 1 << 26, "pinned_gbps": 55.0, "pageable_gbps": 7.0}],
            "copy_host_us": 5.0, "module_copy_ms": 0.05, "dequant_ms": {"fp8": 0.01, "int4": 0.01},
            "predictor_ms": [{"batch": B, "host_ms": 0.05, "wall_ms": 0.08} for B in (1, 8)],
            "expert_ms": [{"experts": g, "tokens": t, "ms": 0.01 + 0.002 * g * t} for g in (1, shape.top_k)
                          for t in (1, 64)],
            "call_host_us": [{"phase": p, "tokens": t, "us": 50.0 + t} for p in ("decode", "prefill") for t in (1, 64)],
            "fetch_host_us": [{"slots": 8, "us": 10.0}, {"slots": 128, "us": 15.0}], "group_host_us": 40.0,
            "layer_ms": grid, "step_ms": grid}


@pytest.fixture(scope="module")
def embedded():
    return load_model("embedded", device="cpu")


@pytest.fixture(scope="module")
def trained(embedded, tmp_path_factory):
    """A predictor artifact of the embedded model's geometry (random weights: its guesses, not their quality)."""
    model, _ = embedded
    layers = find_moe_layers(model)
    torch.manual_seed(0)
    spec = FeatureSpec(len(layers), layers[0].experts.num_experts, model.config.num_experts_per_tok, window=2)
    return save_predictor(ExpertPredictor(spec, widths=(32, 16)).eval(), tmp_path_factory.mktemp("p") / "p", {}, [])


CASES = [  # (policy, predictor, settings)
    ("duoserve", "oracle", EngineSettings()),
    ("duoserve", "oracle:0.5", EngineSettings()),
    ("duoserve", "none", EngineSettings()),
    ("duoserve", "trained", EngineSettings()),
    ("duoserve", "oracle:0.9", EngineSettings(lookahead=2)),
    ("on-demand", "none", EngineSettings()),
    ("lru", "none", EngineSettings()),
    ("full-layer", "none", EngineSettings()),
    ("per-module", "none", EngineSettings()),
]
COUNTERS = ("cache_slots", "bytes_h2d", "copies", "hit_rate", "prefetched", "prefetch_precision")


def _engine_counts(model, tokenizer, policy, predictor, settings, batch: int, prompt: int, new: int,
                   expert_dtype: str = "model") -> dict:
    L = len(find_moe_layers(model))
    E, k = find_moe_layers(model)[0].experts.num_experts, model.config.num_experts_per_tok
    routing = RandomRouting(L, E, k, seed=0)
    if isinstance(predictor, str) and predictor.startswith("oracle"):
        predictor = OraclePredictor(routing, L, E, float(predictor.partition(":")[2] or 1.0))
    elif predictor == "none":
        predictor = None
    ids = torch.randint(5, len(tokenizer), (batch, prompt), generator=torch.Generator().manual_seed(1))
    stores = offload(model, policy, "cpu", expert_dtype)
    try:
        with OffloadEngine(model, stores, policy, predictor, routing, settings) as engine:
            timed_generate(model, ids, torch.ones_like(ids), new, fixed_length=True)
            stats = engine.stats()
    finally:
        put_experts(find_moe_layers(model), stores, "cpu")
    return {key: stats[key] for key in COUNTERS}


@pytest.mark.parametrize("batch", [1, 3])
def test_simulator_counts_equal_the_engines_on_the_same_routing_and_predictor(embedded, trained, batch):
    model, tokenizer = embedded
    shape = ModelShape.of("embedded", dtype="float32")
    costs = Costs(cpu_profile(shape))
    slots = 3 * shape.top_k + 2  # a budget of a few experts more than the cache's own work takes
    budgeted = EngineSettings(gpu_expert_budget=slots * shape.layout.nbytes, pin=((0, 0), (1, 3)))
    for name, predictor, settings in CASES + [("lru", "none", budgeted), ("duoserve", "oracle:0.5", budgeted)]:
        policy = POLICIES[name]
        spec = str(trained) if predictor == "trained" else predictor
        engine = _engine_counts(model, tokenizer, policy, load_predictor(trained) if predictor == "trained" else
                                predictor, settings, batch, prompt=7, new=6)
        sim = Simulator(shape, costs, policy, spec, settings)
        simulated = run(sim, ((0, p) for p in random_passes(shape, batch, 7, 6)))
        assert {key: simulated[key] for key in COUNTERS} == engine, (name, predictor, settings)
        assert simulated["copies"]["decode"] + simulated["copies"]["prefill"] > 0
        assert simulated["ttft_ms"]["p50"] > 0 and simulated["tpot_ms"]["p50"] > 0
    for name, fmt in (("duoserve", "fp8"), ("lru", "int4")):  # quantized stores: copies move their stored bytes
        engine = _engine_counts(model, tokenizer, POLICIES[name], "oracle:0.5" if name == "duoserve" else "none",
                                EngineSettings(), batch, prompt=7, new=6, expert_dtype=fmt)
        sim = Simulator(shape, costs, POLICIES[name], "oracle:0.5" if name == "duoserve" else "none",
                        expert_dtype=fmt)
        simulated = run(sim, ((0, p) for p in random_passes(shape, batch, 7, 6)))
        assert {key: simulated[key] for key in COUNTERS} == engine, (name, fmt)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_prefetch_left_for_the_next_layer_call_makes_the_same_decisions_in_engine_and_simulator(
        embedded, trained, batch, monkeypatch):
    """Settings that ask for it make decode layers replayed from step graphs leave each prefetch to the next layer
    call's start (on a GPU; forced here on the CPU stand-in), and the simulator do the same on a profile measured
    with step graphs: their counts stay equal, every predicted expert is still copied before its layer's routing is
    looked up (an oracle that is always right finds each decode layer's experts cached at B=1, but for a step's
    first), and as many are copied as when they are queued within the call."""
    model, tokenizer = embedded
    shape = ModelShape.of("embedded", dtype="float32")
    graphed = Costs({**cpu_profile(shape), "step_graphs": True})
    slots = 3 * shape.top_k + 2
    budgeted = EngineSettings(gpu_expert_budget=slots * shape.layout.nbytes, pin=((0, 0), (1, 3)), defer_prefetch=True)
    deferred = EngineSettings(defer_prefetch=True)
    cases = [("oracle", deferred, "model"), ("oracle:0.5", budgeted, "model"), ("trained", deferred, "model"),
             ("oracle:0.9", EngineSettings(lookahead=2, defer_prefetch=True), "model"), ("oracle:0.5", deferred, "fp8")]
    policy = POLICIES["duoserve"]
    # within the call: on a profile of eager layers, or where the settings say so
    assert not Simulator(shape, Costs(cpu_profile(shape)), policy, "oracle", deferred).scheduler.defer_prefetch
    for predictor, settings, fmt in cases:
        spec = str(trained) if predictor == "trained" else predictor
        sim = Simulator(shape, graphed, policy, spec, settings, expert_dtype=fmt)
        assert sim.scheduler.defer_prefetch
        simulated = run(sim, ((0, p) for p in random_passes(shape, batch, 7, 6)))
        within = run(Simulator(shape, graphed, policy, spec, replace(settings, defer_prefetch=False), expert_dtype=fmt),
                     ((0, p) for p in random_passes(shape, batch, 7, 6)))
        with monkeypatch.context() as m:
            m.setattr(OffloadEngine, "layers_replayed", True)  # what replayed step graphs make it
            engine = _engine_counts(model, tokenizer, policy, load_predictor(trained) if predictor == "trained" else
                                    predictor, settings, batch, prompt=7, new=6, expert_dtype=fmt)
        assert {key: simulated[key] for key in COUNTERS} == engine, (predictor, settings, fmt)
        if batch == 1 and settings.gpu_expert_budget is None:
            assert simulated["prefetched"] == within["prefetched"] > 0
            assert simulated["hit_rate"] == within["hit_rate"]
            if predictor == "oracle":  # every layer but a step's first, whose experts nothing predicts
                assert simulated["hit_rate"]["decode"] == (shape.num_layers - 1) / shape.num_layers


def test_a_prefetch_left_for_the_next_layer_call_overlaps_its_host_time_with_the_devices_work():
    """Where queueing a prefetch costs the host more than a decoder layer's launches (a quantized fetch's copies,
    its slot-id upload and its pass), queueing it at the next layer call's start lets the device run this call's
    compute and the next layer's attention meanwhile: a shorter decode step on the same bytes."""
    shape = ModelShape.of("embedded", dtype="float32")
    profile = cpu_profile(shape)
    profile["fetch_host_us"] = [{"slots": s, "us": 100.0} for s in (8, 128)]  # an expert's fetch: 0.1 ms of host
    for row in profile["layer_ms"]:
        row["decode_ms"], row["decode_device_ms"] = 0.01, 0.4  # replayed layers: quick to launch, long to run
    costs = Costs({**profile, "step_graphs": True})
    results = {defer: run(Simulator(shape, costs, POLICIES["duoserve"], "oracle", EngineSettings(defer_prefetch=defer)),
                          ((0, p) for p in random_passes(shape, 1, 16, 8))) for defer in (False, True)}
    assert results[True]["bytes_h2d"] == results[False]["bytes_h2d"]
    saved = results[False]["tpot_ms"]["mean"] - results[True]["tpot_ms"]["mean"]
    # each of the 7 prefetching layers hides up to its k fetches' host time (0.4 ms) behind 0.4 ms of device work
    assert saved > 0.5 * (shape.num_layers - 1) * shape.top_k * 0.1


def test_a_decode_layer_replayed_from_step_graphs_runs_its_kernels_after_its_host_work_before_the_experts():
    """A graph's kernels are launched at its replay, once the layer's host work before its experts call is done
    (version 9 profiles time that part), so the router's read waits for all of them; the rest of the layer's host
    work follows the call. An eager layer's kernels run while the host launches them, and so do a replayed one's
    where the profile did not time the part before the call. Same routing, same bytes."""
    streams = SimStreams()
    streams.launch(1.0, 0.6)
    assert streams.compute.t == pytest.approx(1.0)  # ran under the launches
    streams.replay(1.0, 0.6)
    assert (streams.host, streams.compute.t) == (pytest.approx(2.0), pytest.approx(2.6))

    shape = ModelShape.of("embedded", dtype="float32")
    profile = cpu_profile(shape)
    for row in profile["layer_ms"]:
        row["decode_ms"], row["decode_device_ms"] = 0.3, 0.2  # device time a layer's launches hide when eager
    split = {**profile, "layer_ms": [{**row, "decode_before_ms": 0.25, "prefill_before_ms": 0.0}
                                     for row in profile["layer_ms"]]}
    results = {name: run(Simulator(shape, Costs({**p, "step_graphs": graphed}), POLICIES["lru"]),
                         ((0, p) for p in random_passes(shape, 1, 16, 8)))
               for name, p, graphed in (("eager", split, False), ("unsplit", profile, True), ("replayed", split, True))}
    assert results["replayed"]["bytes_h2d"] == results["eager"]["bytes_h2d"]
    assert results["unsplit"]["tpot_ms"] == results["eager"]["tpot_ms"]
    assert results["replayed"]["ttft_ms"] == results["eager"]["ttft_ms"]  # a prefill is eager in the engine
    longer = results["replayed"]["tpot_ms"]["mean"] - results["eager"]["tpot_ms"]["mean"]
    # each layer's router waits for its whole 0.2 ms of kernels, launched after 0.25 ms of its 0.3 of host work
    assert longer == pytest.approx(shape.num_layers * 0.2, rel=0.25)


def test_a_decode_call_whose_experts_do_not_fit_costs_its_first_group_as_a_prefill_call_does():
    """A decode call computes in one group replayed from a graph where its experts fit the cache, and in eager groups,
    as a prefill call does, where they do not (the profile times an all-cached call of each phase): a slower eager
    call then slows the B=8 steps that take the grouped path, not the B=1 ones that fit."""
    shape = ModelShape.of("embedded", dtype="float32")
    k = shape.top_k
    profile = {**cpu_profile(shape), "profile_version": 4}  # calls timed in two parts: routing read, then the rest
    profile["call_host_us"] = [{**r, "routing_us": 20.0} for r in profile["call_host_us"]]
    slower = {**profile, "call_host_us": [{**r, "us": r["us"] + 1000.0 * (r["phase"] == "prefill")}
                                          for r in profile["call_host_us"]]}
    settings = EngineSettings(gpu_expert_budget=k * shape.layout.nbytes)  # k slots: one token's experts fit
    tpot = {(name, B): run(Simulator(shape, Costs(p), POLICIES["lru"], settings=settings),
                           ((0, p) for p in random_passes(shape, B, 4, 6)))["tpot_ms"]["mean"]
            for name, p in (("fast", profile), ("slow", slower)) for B in (1, 8)}
    assert tpot["slow", 1] == pytest.approx(tpot["fast", 1])
    # each of the L layer calls of a B=8 step is one grouped call: 1 ms more host time for its first group
    assert tpot["slow", 8] - tpot["fast", 8] == pytest.approx(shape.num_layers * 1.0, rel=0.2)


def test_a_trained_predictors_scores_are_computed_ahead_in_batches_equal_to_per_layer_calls(trained, monkeypatch):
    shape = ModelShape.of("embedded", dtype="float32")
    sim = Simulator(shape, Costs(cpu_profile(shape)), POLICIES["duoserve"], str(trained))
    deployed = sim.scheduler.prefetch.predictor
    per_layer = TrainedPredictor(load_predictor(trained), "cpu")
    decode = next(p for p in random_passes(shape, 2, 5, 3) if p.phase == "decode")
    sim.predict_ahead([decode])
    L = shape.num_layers
    assert sorted(deployed.rows) == [(t, 1) for t in range(1, L)]  # what the prefetch asks: (target, depth)
    history = torch.from_numpy(decode.ids.transpose(1, 0, 2).astype(np.int64))  # B x L x k
    best, ids = deployed.table[id(decode)]  # A x B x k each: the pass's asks in turn
    for (t, d), a in deployed.rows.items():
        want = per_layer.scores(history, t, depth=d).topk(shape.top_k)
        torch.testing.assert_close(best[a], want.values, rtol=0, atol=1e-5)
        assert torch.equal(ids[a], want.indices)
    calls = []
    monkeypatch.setattr(deployed.predictor, "scores", lambda *args, **kwargs: calls.append(args))
    result = run(sim, ((0, p) for p in random_passes(shape, 2, 5, 4)))
    assert result["prefetched"] > 0 and not calls  # every layer's prediction came from the batched table
    assert 0 < result["predictor_seconds"] < result["sim_seconds"]  # the batched scoring is timed, within the whole
    oracle = Simulator(shape, Costs(cpu_profile(shape)), POLICIES["duoserve"], "oracle:0.5")
    assert run(oracle, ((0, p) for p in random_passes(shape, 2, 5, 4)))["predictor_seconds"] < 1e-3  # none scored


def test_a_studys_points_score_a_trained_predictor_once_and_simulate_as_a_fresh_simulator_does(
        embedded_trace, embedded_predictor, monkeypatch):
    """Points of one study that differ only in settings (here the prefetch's minimum score) share the predictor's
    scores on the same passes: the second point scores nothing, and its counters equal a standalone simulation's."""
    from duoserve.bench.whatif import SimulateSettings, Study

    study = Study(SimulateSettings(model_shape="embedded", profile="h200-embedded", traces=embedded_trace.path,
                                   requests=3))
    calls = []
    real = TrainedPredictor.logits
    monkeypatch.setattr(TrainedPredictor, "logits", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    first = study.point("duoserve", str(embedded_predictor), 1)
    assert calls and first["prefetched"] > 0
    calls.clear()
    second = study.point("duoserve", str(embedded_predictor), 1, min_score=0.5)
    assert not calls  # every score came from the first point's table
    alone = run(Simulator(study.shape, study.costs, POLICIES["duoserve"], str(embedded_predictor),
                          EngineSettings(prefetch_min_score=0.5)), study.passes(1))
    assert calls  # a simulator of its own scores them again
    for key in ("bytes_h2d", "copies", "hit_rate", "prefetched", "prefetch_precision", "tpot_ms", "ttft_ms"):
        assert second[key] == alone[key], key


def test_a_trace_with_known_reuse_moves_the_hand_counted_bytes(tmp_path):
    shape = ModelShape.of("embedded", dtype="float32")
    L, E, k = shape.num_layers, shape.num_experts, shape.top_k
    assert E >= 2 * k
    # two requests; each token routes to one of two disjoint sets of k experts, A = 0..k-1 or B = k..2k-1, at
    # every layer; request 0: prompt A, A; decode B, A | request 1: prompt B; decode B
    firsts = [0, 0, k, 0, k, k]
    ids = np.array([[list(range(a, a + k))] * L for a in firsts])  # N x L x k
    write_trace(tmp_path / "t", ids, request_ids=[0, 0, 0, 0, 1, 1],
                phases=["prefill", "prefill", "decode", "decode", "prefill", "decode"], num_experts=E)
    requests = trace_requests(tmp_path / "t", shape)
    assert [(len(r.prompt), len(r.decode)) for r in requests] == [(2, 2), (1, 1)]
    costs, nbytes = Costs(cpu_profile(shape)), shape.layout.nbytes
    # on-demand fetches each pass's distinct experts per layer: passes route A, B, A | B, B: k experts each
    sim = Simulator(shape, costs, POLICIES["on-demand"])
    on_demand = run(sim, trace_passes(requests, batch=1))
    assert on_demand["bytes_h2d"] == {"prefill": 2 * k * L * nbytes, "decode": 3 * k * L * nbytes}
    # a cache that holds every expert of every layer fetches each (layer, expert) once, all in the first request:
    # A in its prefill, B in its first decode step; the other decode lookups (A, then B twice) hit
    whole = EngineSettings(gpu_expert_budget=L * E * nbytes)
    lru = run(Simulator(shape, costs, POLICIES["lru"], settings=whole), trace_passes(requests, batch=1))
    assert lru["bytes_h2d"] == {"prefill": k * L * nbytes, "decode": k * L * nbytes}
    assert lru["hit_rate"]["decode"] == pytest.approx(2 / 3)
    # both requests in one batch: one prefill of three tokens (A and B), then decode steps of (B, B) and (A)
    batched = run(Simulator(shape, costs, POLICIES["on-demand"]), trace_passes(requests, batch=2))
    assert batched["decode_steps"] == 2 and batched["tokens"] == 6
    assert batched["bytes_h2d"] == {"prefill": 2 * k * L * nbytes, "decode": 2 * k * L * nbytes}


def test_a_trained_predictor_costs_the_engines_whole_launch_where_the_profile_timed_it(trained):
    """The profile's ``launch_host_ms`` (the engine's history write, call and copies back) stands for the bare call's
    host time: charged once for each layer the decode step predicts, on the host's critical path."""
    shape = ModelShape.of("embedded", dtype="float32")
    profile = cpu_profile(shape)
    extra = 5.0  # ms: far above every other cost, so none of it hides behind the device
    launched = {**profile, "predictor_ms": [{**row, "launch_host_ms": row["host_ms"] + extra}
                                            for row in profile["predictor_ms"]]}
    tpot = {name: run(Simulator(shape, Costs(p), POLICIES["duoserve"], str(trained)),
                      ((0, x) for x in random_passes(shape, 1, 16, 8)))["tpot_ms"]["mean"]
            for name, p in (("bare", profile), ("launch", launched))}
    predicted_layers = shape.num_layers - 1  # look-ahead 1: layers 1 .. L-1, each predicted once a step
    assert tpot["launch"] - tpot["bare"] == pytest.approx(predicted_layers * extra, rel=0.05)


def test_simulated_times_follow_the_profile(embedded):
    shape = ModelShape.of("embedded", dtype="float32")
    profile = cpu_profile(shape)
    slow = json.loads(json.dumps(profile))
    for row in slow["copy"]:
        row["pinned_gbps"] /= 1000  # copies of the tiny model's experts then outlast its layers
    results = {}
    for name, p in (("fast", profile), ("slow", slow)):
        sim = Simulator(shape, Costs(p), POLICIES["on-demand"])
        results[name] = run(sim, ((0, p) for p in random_passes(shape, 1, 16, 8)))
    assert results["slow"]["tpot_ms"]["mean"] > results["fast"]["tpot_ms"]["mean"]
    assert results["slow"]["bytes_h2d"] == results["fast"]["bytes_h2d"]
    # an oracle that is always right hides copies behind compute that the gate's fetches wait for
    stalls = {spec: run(Simulator(shape, Costs(slow), POLICIES["duoserve"], spec),
                        ((0, p) for p in random_passes(shape, 1, 16, 8)))["stall_ms"] for spec in ("none", "oracle")}
    assert stalls["oracle"] < stalls["none"]
    assert results["slow"]["stall_ms"] > results["fast"]["stall_ms"] > 0  # on-demand copies on the compute stream


def test_a_prefill_groups_host_cost_is_taken_at_the_calls_tokens(embedded):
    """A version 6 profile's group cost by tokens: interpolated on a log scale between the sizes measured, the nearest
    outside them; a profile without it charges its one group cost at every size. A host-bound prefill of many groups
    (on-demand's) takes the cost of its own length: longer where the profile's groups cost more."""
    shape = ModelShape.of("embedded", dtype="float32")
    flat = Costs(cpu_profile(shape))
    assert flat.group_host_ms(4) == flat.group_host_ms(512) == pytest.approx(0.040)
    by_tokens = [{"tokens": T, "us": us} for T, us in ((4, 40.0), (64, 400.0), (512, 400.0))]
    costs = Costs({**cpu_profile(shape), "profile_version": 6, "group_host_by_tokens": by_tokens})
    assert [costs.group_host_ms(T) for T in (1, 4, 16, 64, 512, 4096)] == pytest.approx(
        [0.04, 0.04, 0.22, 0.4, 0.4, 0.4])
    ttft = {name: run(Simulator(shape, c, POLICIES["on-demand"]), ((0, p) for p in random_passes(shape, 1, 64, 2)))
            for name, c in (("flat", flat), ("grown", costs))}
    groups = shape.num_layers * shape.num_experts // (shape.top_k // 2) - shape.num_layers  # past each call's first
    extra = ttft["grown"]["ttft_ms"]["mean"] - ttft["flat"]["ttft_ms"]["mean"]
    assert 0 < extra <= groups * (0.4 - 0.04) + 1e-9
    assert ttft["grown"]["bytes_h2d"] == ttft["flat"]["bytes_h2d"]


def test_the_engines_host_sections_are_timed_on_the_simulated_clock_without_changing_it(embedded, trained):
    shape = ModelShape.of("embedded", dtype="float32")
    costs = Costs(cpu_profile(shape))
    for policy, predictor in (("duoserve", str(trained)), ("on-demand", "none")):
        plain, timed = (run(Simulator(shape, costs, POLICIES[policy], predictor, sections=sections),
                            ((0, p) for p in random_passes(shape, 2, 16, 8))) for sections in (False, True))
        assert plain["host_ms"] == {} and timed["tpot_ms"] == plain["tpot_ms"] and timed["ttft_ms"] == plain["ttft_ms"]
        working = {"wait for routing", "queue fetches", "queue compute"} | (
            {"queue predictor", "queue prefetch"} if policy == "duoserve" else set())
        waiting = {"wait for predictor"} if policy == "duoserve" else set()  # the host waits only if it is early
        assert set(timed["host_ms"]) == working | waiting
        assert all(timed["host_ms"][name] > 0 for name in working)
        # sections hold host time only: they sum to less than the passes' wall time
        wall = timed["ttft_ms"]["mean"] + timed["tpot_ms"]["mean"] * timed["decode_steps"]
        assert sum(timed["host_ms"].values()) < wall
    per_call = costs.call_host_ms("decode", 2) - costs.routing_host_ms("decode", 2)
    sim = Simulator(shape, costs, POLICIES["lru"], sections=True, settings=EngineSettings(
        gpu_expert_budget=shape.num_layers * shape.num_experts * shape.layout.nbytes))
    every = np.resize(np.arange(shape.num_experts), (-(-shape.num_experts // shape.top_k), shape.top_k))  # T x k
    sim.forward(Pass("prefill", np.stack([every] * shape.num_layers), 1, len(every)))  # every expert cached
    sim.reset_stats()
    sim.forward(Pass("decode", next(random_passes(shape, 2, 4, 2)).ids[:, :2], 2, 5))  # so its calls all hit
    # a decode call that finds its experts cached spends its host time after the routing read in queue compute
    assert sim.stats()["host_ms"]["queue compute"] == pytest.approx(shape.num_layers * per_call)


def test_a_host_of_another_pace_scales_every_host_cost_and_no_device_cost(embedded):
    """``host_op_us``: a host twice as slow per op as the profile's doubles each host-side cost (copies queued,
    calls, groups, the predictor's launch, the layers' launching) and leaves the device's (bandwidth, kernels); a
    host-bound simulation slows with it, its copies unchanged; a profile that never recorded its pace refuses."""
    shape = ModelShape.of("embedded", dtype="float32")
    profile = {**cpu_profile(shape), "host_op_us": {"median": 10.0, "min": 9.0, "max": 12.0}}
    same, slow = Costs(profile), Costs(profile, 20.0)
    assert Costs(profile, 10.0).host_scale == same.host_scale == 1.0 and slow.host_scale == 2.0
    for host in (lambda c: c.copy_host_ms, lambda c: c.group_host_ms(64), lambda c: c.call_host_ms("decode", 4),
                 lambda c: c.routing_host_ms("prefill", 64), lambda c: c.fetch_host_ms(64),
                 lambda c: c.predictor_ms(1)[0], lambda c: c.pass_ms("layer_ms", "decode", 1, 16)[0]):
        assert host(slow) == pytest.approx(2 * host(same)) and host(same) > 0
    for device in (lambda c: c.copy_ms(1 << 20), lambda c: c.group_ms([1, 4]), lambda c: c.predictor_ms(8)[1],
                   lambda c: c.pass_ms("step_ms", "prefill", 8, 512)[1]):
        assert device(slow) == device(same) > 0
    results = {name: run(Simulator(shape, costs, POLICIES["on-demand"]),
                         ((0, p) for p in random_passes(shape, 1, 16, 8))) for name, costs in (("same", same),
                                                                                              ("slow", slow))}
    assert results["slow"]["tpot_ms"]["mean"] > 1.5 * results["same"]["tpot_ms"]["mean"]  # made-up costs: host-bound
    assert results["slow"]["bytes_h2d"] == results["same"]["bytes_h2d"]
    with pytest.raises(ValueError, match="did not record its host's pace"):
        Costs(cpu_profile(shape), 20.0)


def test_simulate_command_simulates_a_host_of_the_pace_it_is_given(tmp_path):
    """``--host-op-us``: twice the shipped profile's pace gives a host scale of 2, which the table states, and a slower
    step on the tiny model, whose step is host time."""
    from typer.testing import CliRunner

    from duoserve.bench.costs import resolve_profile
    from duoserve.cli.evaluate import app

    pace = resolve_profile("h200-embedded")["host_op_us"]["median"]
    saved = {}
    for name, extra in (("own", []), ("slow", ["--host-op-us", str(2 * pace)])):
        out = tmp_path / name
        result = CliRunner().invoke(app, ["simulate", "--profile", "h200-embedded", "--model-shape", "embedded",
                                          "--policy", "on-demand", "--requests", "1", "--prompt-len", "16",
                                          "--new-tokens", "8", "--no-charts", "--out", str(out), *extra])
        assert result.exit_code == 0, result.output
        saved[name] = json.loads((out / "simulate.json").read_text())
        assert ("2.00x the profile's" in " ".join(result.output.split())) == (name == "slow")
    assert saved["own"]["host_scale"] == 1.0 and saved["slow"]["host_scale"] == pytest.approx(2.0)
    own, slow = saved["own"]["rows"][0], saved["slow"]["rows"][0]
    assert slow["tpot_ms"]["mean"] > 1.5 * own["tpot_ms"]["mean"] and slow["bytes_h2d"] == own["bytes_h2d"]


def test_simulate_command_runs_the_decode_prefetch_at_the_minimum_score_it_is_given(
        tmp_path, embedded_trace, embedded_predictor):
    """``--prefetch-min-score``: the table's trained predictor copies only guesses scored at least that, so fewer ahead
    and at a higher precision; with no predictor nothing changes."""
    from typer.testing import CliRunner

    from duoserve.cli.evaluate import app

    rows = {}
    for score in ("0", "0.5"):
        out = tmp_path / score
        result = CliRunner().invoke(app, [
            "simulate", "--profile", "h200-embedded", "--model-shape", "embedded", "--traces",
            str(embedded_trace.path), "--predictor", str(embedded_predictor), "--predictor", "none", "--policy",
            "duoserve", "--requests", "4", "--prefetch-min-score", score, "--no-charts", "--out", str(out)])
        assert result.exit_code == 0, result.output
        saved = json.loads((out / "simulate.json").read_text())
        assert saved["prefetch_min_score"] == float(score)
        rows[score] = {r["predictor"]: r for r in saved["rows"]}
    low, high = rows["0"][str(embedded_predictor)], rows["0.5"][str(embedded_predictor)]
    assert high["prefetch_min_score"] == 0.5 and 0 < high["prefetched"] < low["prefetched"]
    assert high["prefetch_precision"] > low["prefetch_precision"]
    assert rows["0"]["none"]["bytes_h2d"] == rows["0.5"]["none"]["bytes_h2d"]


def test_a_calls_host_time_after_its_routing_read_overlaps_its_misses_copies(embedded):
    """The engine queues a call's fetches right after reading its routing, then spends the rest of its host time
    (rows, launches) while they copy: a profile that says so (version 4's routing_us) times on-demand's decode,
    whose every call waits for its misses, faster than one that charges the whole call first; a call whose experts
    are all cached waits for nothing, so it costs the same either way."""
    shape = ModelShape.of("embedded", dtype="float32")
    profile = cpu_profile(shape)
    for row in profile["copy"]:
        row["pinned_gbps"] /= 1000  # copies as long as the calls' host time
    for row in profile["call_host_us"]:
        row["us"] = 500.0
    tpot = {}
    for routing_us in (500.0, 50.0):
        costs = Costs({**profile, "profile_version": 4,
                       "call_host_us": [{**row, "routing_us": routing_us} for row in profile["call_host_us"]]})
        assert costs.routing_host_ms("decode", 1) == routing_us / 1e3
        for policy, budget in (("on-demand", None), ("lru", shape.num_layers * shape.num_experts)):
            settings = EngineSettings(gpu_expert_budget=budget and budget * shape.layout.nbytes)
            sim = Simulator(shape, costs, POLICIES[policy], settings=settings)
            result = run(sim, ((0, p) for p in random_passes(shape, 1, 128, 8)))
            tpot[policy, routing_us] = result["tpot_ms"]["mean"]
            if policy == "lru":
                assert result["hit_rate"]["decode"] == 1.0  # every expert cached by the prompt
    assert tpot["on-demand", 50.0] < tpot["on-demand", 500.0]
    assert tpot["lru", 50.0] == pytest.approx(tpot["lru", 500.0])


def test_quantized_copies_run_ahead_of_the_compute_that_frees_their_slots():
    """A 2-slot cache (Mixtral's at the on-demand budget): the next layer's experts can only go into the slots the
    current layer's compute reads. bf16 copies land in the slots, so they wait for that compute; quantized ones land
    in staging first, so only their dequantization into the slots waits, and the copy stream never idles."""
    shape = ModelShape.of("embedded", dtype="float32")
    costs = Costs(cpu_profile(shape))
    compute_ms = 100.0  # far longer than a copy
    ends = {}
    for fmt in ("model", "fp8"):
        streams = SimStreams()
        cache = ExpertCache(shape.layout, 2, streams)
        store = SimStore(shape.layout, costs, True, fmt)
        slots = cache.fetch(0, [0, 1], store, "decode", set())  # layer 0's experts
        cache.wait_ready(slots)
        streams.run(streams.compute, compute_ms)  # layer 0 computes from its slots
        cache.release(slots)
        computed = streams.compute.t
        cache.fetch(1, [2, 3], store, "decode", set())  # layer 1's, into the same slots
        ends[fmt] = streams.copy.t, streams.dequant.t, computed
    copied, _, computed = ends["model"]
    assert copied > computed  # into the slots: after the compute that read them
    copied, dequantized, computed = ends["fp8"]
    assert copied < computed < dequantized  # to staging during that compute; into the slots after it


def test_quantized_copies_run_as_many_chunks_ahead_as_there_are_staging_buffers():
    """A fetch into slots a compute still reads: each chunk's dequantization waits for that compute, so its staging
    buffer stays full until then; the copy stream fills every staging buffer meanwhile (a prefill's look-ahead over
    a large cache), and only the chunk after them waits. Experts of a pass each keep two buffers."""
    shape = ModelShape.of("embedded", dtype="float32")
    buffers = stage_buffers(shape.layout)
    assert buffers == 3 and stage_buffers(ModelShape.of("mixtral-8x7b", layers=1).layout) == 2
    streams = SimStreams()
    cache = ExpertCache(shape.layout, buffers + 1, streams)
    store = SimStore(shape.layout, Costs(cpu_profile(shape)), True, "int4")
    store.chunk = 1  # a pass an expert: one staging buffer a chunk
    slots = cache.fetch(0, list(range(buffers + 1)), store, "prefill", set())
    cache.wait_ready(slots)
    streams.run(streams.compute, 100.0)  # far longer than the copies
    cache.release(slots)
    computed = streams.compute.t
    cache.fetch(1, list(range(buffers)), store, "prefill", set())
    assert streams.copy.t < computed < streams.dequant.t  # every buffer filled during the compute
    cache.fetch(2, [0], store, "prefill", set())
    assert streams.copy.t > computed  # the next chunk waits for a buffer, read after the compute


def test_a_staged_groups_copies_cross_while_its_slots_are_still_read_and_its_fetch_only_dequantizes_them():
    """``stage`` queues a group's first chunks, one per staging buffer, before the slots they will take are free:
    they cross during the compute that reads those slots, and the group's fetch after it copies only the chunk past
    the buffers (once the first pass has read its buffer), with every expert's bytes counted there."""
    shape = ModelShape.of("embedded", dtype="float32")
    costs = Costs(cpu_profile(shape))
    buffers = stage_buffers(shape.layout)
    streams = SimStreams()
    cache = ExpertCache(shape.layout, buffers + 1, streams)
    store = SimStore(shape.layout, costs, True, "int4")
    store.chunk = 1
    slots = cache.fetch(0, list(range(buffers + 1)), store, "prefill", set())
    cache.wait_ready(slots)
    streams.run(streams.compute, 100.0)  # far longer than the copies
    group, before = list(range(buffers + 1)), streams.copy.t
    copy, dequant = costs.copy_ms(store.row_bytes), costs.dequant_ms["int4"]
    cache.stage(group, store)
    assert before + buffers * copy <= streams.copy.t < streams.compute.t  # a chunk a buffer, during the compute
    cache.release(slots)
    computed = streams.compute.t
    cache.fetch(1, group, store, "prefill", set())
    assert streams.copy.t == pytest.approx(computed + dequant + copy)  # one copy, after the first pass
    assert cache.stats.bytes["prefill"] == 2 * len(group) * store.row_bytes


def test_a_quantized_prefill_stages_its_first_group_while_its_cached_experts_compute(monkeypatch):
    """Simulated on the shipped H200 profile (Qwen3-30B-A3B's int4 experts, 8 layers, 32 slots, B=8): the first
    fetched group's copies queued to staging before the call's cached experts compute keep the copy stream busy
    across the host's queueing of that compute: the prefill is shorter, its bytes the same."""
    from duoserve.bench.costs import resolve_profile

    shape = ModelShape.of("qwen3-30b-a3b", layers=8)
    costs = Costs(resolve_profile("h200-qwen3-30b-a3b"))

    def prefill() -> tuple[float, int]:
        settings = EngineSettings(gpu_expert_budget=32 * shape.layout.nbytes)
        sim = Simulator(shape, costs, POLICIES["duoserve"], "oracle:1", settings, expert_dtype="int4")
        result = run(sim, [(0, p) for p in random_passes(shape, 8, 512, 2)])
        return result["ttft_ms"]["p50"], result["bytes_h2d"]["prefill"]

    staged, moved = prefill()
    monkeypatch.setattr(SimStore, "stage", lambda *args: None)  # nothing staged: each fetch copies its own
    unstaged, moved_unstaged = prefill()
    assert moved == moved_unstaged and staged < 0.97 * unstaged


def test_a_quantized_fetchs_slots_are_ready_when_dequantized_and_after_what_its_caller_queued_behind():
    """A quantized fetch's slots are ready when its dequantization ends (which waited for its copies: the seal adds no
    wait, a decode step being short of host time); where its caller queued more on the copy stream behind them (a
    prefill group's pair rows), also after that."""
    shape = ModelShape.of("embedded", dtype="float32")
    costs = Costs(cpu_profile(shape))
    for more in (False, True):
        streams = SimStreams()
        waits, wait = [], streams.wait

        def counted(stream, event, waits=waits, wait=wait):
            if event is not None:
                waits.append(stream)
            wait(stream, event)

        streams.wait = counted
        cache = ExpertCache(shape.layout, 4, streams)
        slots = cache.fetch(0, [0, 2], SimStore(shape.layout, costs, True, "fp8"), "decode", set(), seal=not more)
        if more:
            streams.run(streams.copy, 50.0)  # far longer than the fetch
            cache.seal(slots)
        ready = {cache.ready[s].t for s in slots}
        assert ready == {streams.dequant.t}
        assert streams.dequant.t >= streams.copy.t and (streams.copy.t > 50.0) == more
        assert waits.count(streams.dequant) == 1 + more  # its one staging chunk's copies; and the caller's


def test_a_quantized_prefill_fetches_in_groups_of_the_whole_cache():
    """Quantized copies run ahead into staging, so a call that needs more experts than the cache holds fetches them
    in groups of the whole cache (half as many groups, each costing the host to queue); bf16 copies land in the
    slots, so groups of half the cache alternate. Every expert is computed once either way."""
    shape = ModelShape.of("embedded", dtype="float32")
    costs = Costs(cpu_profile(shape))
    idx = torch.arange(2 * shape.num_experts).remainder(shape.num_experts).reshape(-1, shape.top_k)  # T x k: all E
    groups = {}
    for fmt in ("model", "fp8"):
        streams = SimStreams()
        cache = ExpertCache(shape.layout, 8, streams)
        store = SimStore(shape.layout, costs, True, fmt)
        computed = []
        compute = SimCompute(cache, streams, None, costs)
        compute.add_group = lambda l, hidden, weights, rows, slots, out: computed.append(sorted(slots)) or \
            cache.release(list(slots.values()))
        fetch = GroupedFetch(cache, [store], streams, NullTimers(), compute, overlap=True)
        hidden = torch.zeros(len(idx), 1)  # T x H: the stand-in computes nothing
        fetch.fetch_missing(0, hidden, None, Routing(idx, shape.num_experts), list(range(shape.num_experts)),
                            "prefill", hidden)
        assert sorted(e for group in computed for e in group) == list(range(shape.num_experts))
        groups[fmt] = [len(group) for group in computed]
    assert groups == {"model": [4] * 4, "fp8": [8] * 2}


def test_a_simulation_says_what_an_older_profile_overstates(tmp_path):
    """Version 2 timed one expert dequantized eagerly, and versions before 7 the eager pass (quantized stores
    overstated); before version 4 a call's host time has no routing part (policies that wait for their misses
    overstated); before version 6 a prefill group's host cost was timed at E/k tokens only (long prefills
    understated); before version 8 a quantized fetch's dequantization passes cost the host one copy's queueing
    (quantized decode understated): each simulation says what applies to it."""
    from duoserve.bench.whatif import SimulateSettings, simulate

    shape = ModelShape.of("embedded", dtype="float32")
    notes = {}
    for version in (2, 3, 4, 6, 7, 8):
        path = tmp_path / f"v{version}.json"
        rows = [{**row, "routing_us": row["us"] / 2} for row in cpu_profile(shape)["call_host_us"]]
        by_tokens = {"group_host_by_tokens": [{"tokens": 4, "us": 40.0}, {"tokens": 64, "us": 60.0}]} \
            if version >= 6 else {}
        passes = {"dequant_host_us": {"fp8": 30.0, "int4": 30.0}} if version >= 8 else {}
        path.write_text(json.dumps({**cpu_profile(shape), "profile_version": version, "call_host_us": rows,
                                    **by_tokens, **passes}))
        for policy in ("duoserve", "lru"):
            for fmt in ("model", "fp8"):
                s = SimulateSettings(model_shape="embedded", profile=str(path), dtype="float32", policies=[policy],
                                     predictors=["none"], expert_dtype=fmt, requests=1, prompt_len=4, new_tokens=2)
                notes[version, policy, fmt] = simulate(s)["notes"]
    dequant = [key for key, said in notes.items() if any("dequantized eagerly" in note for note in said)]
    assert dequant == [(2, "duoserve", "fp8"), (2, "lru", "fp8")]
    eager_pass = [key for key, said in notes.items() if any("eager dequantization pass" in note for note in said)]
    assert eager_pass == [(v, p, "fp8") for v in (3, 4, 6) for p in ("duoserve", "lru")]
    routing = [key for key, said in notes.items() if any("no routing_us" in note and "lru" in note for note in said)]
    assert routing == [(v, "lru", fmt) for v in (2, 3) for fmt in ("model", "fp8")]
    groups = [key for key, said in notes.items() if any("E/k tokens only" in note for note in said)]
    assert groups == [key for key in notes if key[0] < 6]
    passes = [key for key, said in notes.items() if any("per dequantization pass" in note for note in said)]
    assert passes == [(v, p, "fp8") for v in (2, 3, 4, 6, 7) for p in ("duoserve", "lru")]
    assert notes[8, "lru", "fp8"] == notes[6, "duoserve", "model"] == []


def test_a_quantized_fetchs_dequantization_pass_costs_the_host_what_the_profile_timed():
    """Each dequantization pass of a quantized fetch costs the host the profile's ``dequant_host_us`` for its
    format, its copies what a plain expert's do; a profile without it charges a pass one copy's queueing."""
    shape = ModelShape.of("embedded", dtype="float32")
    experts = list(range(0, 2 * shape.top_k, 2))  # k experts, none consecutive: a copy each, one pass
    host = {}
    for timed in (None, 250.0):
        profile = cpu_profile(shape) | ({"dequant_host_us": {"fp8": timed}} if timed else {})
        costs = Costs(profile)
        streams = SimStreams()
        store = SimStore(shape.layout, costs, True, "fp8")
        ExpertCache(shape.layout, len(experts), streams).fetch(0, experts, store, "decode", set())
        host[timed] = streams.host
    assert store.chunk >= len(experts)  # one pass
    copy = costs.copy_host_ms
    assert host[None] == pytest.approx((len(experts) + 1) * copy)
    assert host[250.0] == pytest.approx(len(experts) * copy + 0.25)


def test_a_simulation_of_a_trained_predictor_says_when_the_profile_timed_only_its_bare_call(tmp_path, trained):
    from duoserve.bench.whatif import SimulateSettings, simulate

    shape = ModelShape.of("embedded", dtype="float32")
    profile = {**cpu_profile(shape), "profile_version": 4}
    said = {}
    for name, rows in (("bare", profile["predictor_ms"]),
                       ("launch", [{**row, "launch_host_ms": 0.2} for row in profile["predictor_ms"]])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({**profile, "predictor_ms": rows}))
        for predictor in ("oracle", str(trained)):
            s = SimulateSettings(model_shape="embedded", profile=str(path), dtype="float32", policies=["duoserve"],
                                 predictors=[predictor], requests=1, prompt_len=4, new_tokens=2)
            said[name, predictor == "oracle"] = any("bare call" in note for note in simulate(s)["notes"])
    assert said == {("bare", False): True, ("bare", True): False, ("launch", False): False, ("launch", True): False}


def test_simulate_command_replays_a_trace_with_a_trained_predictor_and_draws_the_charts(
        tmp_path, embedded_trace, embedded_predictor, monkeypatch):
    from typer.testing import CliRunner

    from duoserve.bench import whatif
    from duoserve.cli.evaluate import app

    simulated = []  # each configuration the study simulated
    monkeypatch.setattr(whatif, "run", lambda sim, passes: simulated.append(sim) or run(sim, passes))

    out = tmp_path / "sim"
    result = CliRunner().invoke(app, [
        "simulate", "--profile", "h200-embedded", "--model-shape", "embedded", "--traces", str(embedded_trace.path),
        "--predictor", "none", "--predictor", "oracle", "--predictor", str(embedded_predictor), "--batch-size", "1",
        "--batch-size", "2", "--requests", "4", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "simulate.json").read_text())
    assert {"commit", "machine", "command"} <= set(saved["provenance"])  # the file says what made it
    rows = {(r["policy"], r["predictor"], r["batch_size"]): r for r in saved["rows"]}
    assert len(rows) == 2 * (3 + 2)  # duoserve with three predictors, on-demand and lru; two batch sizes
    for B in (1, 2):
        oracle, none = rows["duoserve", "oracle", B], rows["duoserve", "none", B]
        trained = rows["duoserve", str(embedded_predictor), B]
        assert oracle["hit_rate"]["decode"] > none["hit_rate"]["decode"]
        assert trained["prefetched"] > 0 and none["prefetched"] == 0
        assert oracle["tokens"] == none["tokens"] == rows["lru", None, B]["tokens"]
    for name in saved["charts"]:
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert {"tpot_vs_accuracy.png", "tpot_vs_budget.png", "tpot_vs_lookahead.png", "ttft_vs_prompt.png",
            "throughput_vs_batch.png", "tpot_vs_min_score.png"} == set(saved["charts"])
    # the trained predictor at each minimum score: a higher one copies fewer guesses ahead, and the fastest is named
    tried = [r for r in saved["sweeps"]["min_score"] if r["predictor"] == str(embedded_predictor)]
    assert [r["prefetch_min_score"] for r in tried] == list(whatif.MIN_SCORES)
    assert all(a["prefetched"] >= b["prefetched"] for a, b in zip(tried, tried[1:]))
    assert tried[-1]["prefetched"] < tried[0]["prefetched"]
    [best] = saved["best_min_score"]
    assert best["tpot_p50_ms"] == min(r["tpot_ms"]["p50"] for r in tried)
    assert best["min_score"] in whatif.MIN_SCORES and best["lowest_tpot_p50_ms"] == tried[0]["tpot_ms"]["p50"]
    assert best["no_predictor_tpot_p50_ms"] == rows["duoserve", "none", 1]["tpot_ms"]["p50"]
    text = " ".join(result.output.split())
    assert "prefetch minimum score: " + embedded_predictor.name in text
    # the advice follows the figures: the score to pass, or that no predictor is faster still
    pays = best["no_predictor_tpot_p50_ms"] >= best["tpot_p50_ms"]
    assert (f"--prefetch-min-score {best['min_score']:g}" if pays else "its prefetch does not pay") in text
    curve = [r for r in saved["sweeps"]["accuracy"] if (r["predictor"] or "").startswith("oracle")]
    assert curve[0]["prefetch_precision"] < curve[-1]["prefetch_precision"] == 1.0  # recall 0 .. 1
    budgets = [r for r in saved["sweeps"]["budget"] if r["policy"] == "lru"]
    assert budgets[0]["peak_expert_bytes"] < budgets[-1]["peak_expert_bytes"]
    assert sum(budgets[-1]["bytes_h2d"].values()) <= sum(budgets[0]["bytes_h2d"].values())
    assert "simulated" in result.output and "simulate.json" in result.output  # the summary table, the files
    # the shipped H200 profile timed its layers step-graphed: the table says which engine it simulates
    assert saved["step_graphs"] is True and "decode layers step-graphed" in " ".join(result.output.split())
    points = len(saved["rows"]) + sum(map(len, saved["sweeps"].values()))
    configs = {(r["policy"], r["predictor"], r["batch_size"], r["gpu_expert_budget"], r["lookahead"],
                r["prefetch_min_score"])
               for r in saved["rows"] + [r for sweep in saved["sweeps"].values() for r in sweep]}
    assert len(simulated) == len(configs) < points  # a sweep's point that is the grid's is simulated once


def test_accuracy_report_ranks_scorers_by_what_they_buy(tmp_path, embedded_trace, embedded_predictor):
    from typer.testing import CliRunner

    from duoserve.cli.evaluate import app

    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["accuracy", str(embedded_trace.path), "--predictor", str(embedded_predictor),
                                      "--baseline", "popularity", "--baseline", "oracle", "--out", str(out),
                                      "--simulate", "h200-embedded", "--simulate-requests", "3"])
    assert result.exit_code == 0, result.output
    buys = json.loads((out / "whatif.json").read_text())
    rows = {r["scorer"]: r for r in buys["rows"]}
    [tuned] = [name for name in rows if name.startswith("trained MLP, min score ")]
    assert {"trained MLP", tuned, "popularity", "oracle", "(on-demand: no prediction)",
            "(lru: no prediction)"} == set(rows)
    assert rows["trained MLP"]["simulated_as"] == str(embedded_predictor)  # the artifact itself, not an oracle
    # and again at the best of the other minimum scores: the score it ran at is in its name and its row
    assert rows["trained MLP"]["prefetch_min_score"] == 0.0
    assert rows[tuned]["simulated_as"] == str(embedded_predictor) and rows[tuned]["prefetch_min_score"] > 0
    assert tuned == f"trained MLP, min score {rows[tuned]['prefetch_min_score']:g}"
    assert rows["popularity"]["simulated_as"] == f"oracle:{rows['popularity']['recall']:.4f}"
    assert rows["oracle"]["decode_hit_rate"] > rows["popularity"]["decode_hit_rate"]
    assert rows["oracle"]["decode_bytes"] < rows["popularity"]["decode_bytes"]  # a wrong guess costs a copy
    times = [r["tpot_p50_ms"] for r in buys["rows"]]
    assert times == sorted(times)  # ranked by latency


def test_the_validation_replays_each_bench_run_on_the_profile_of_its_folder(tmp_path, embedded_trace,
                                                                            embedded_predictor, monkeypatch):
    """benchmarks/simulate_validation.py on a real CPU bench of the embedded model replaying its trace and a real CPU
    profile in a folder of its own (``--profiles``): a row per policy and batch, the replayed routing's bytes equal
    to the bench's, the measured figures the rounds' medians, the host's pace during both beside them; a next-gate
    predictor's runs skipped, as the engine fed it guesses on other tokens than the trace's."""
    from typer.testing import CliRunner

    from duoserve.cli.run import app as run_app
    from tests.conftest import load_benchmark

    monkeypatch.chdir(tmp_path)  # the script finds the embedded bench's trace at out/traces, as simulate_h200.sh
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "traces").symlink_to(embedded_trace.path)
    results, profiles = tmp_path / "results", tmp_path / "profiles"
    runner = CliRunner()
    assert load_predictor(embedded_predictor).spec.family == "hybrid"  # the default family on this trace
    bench = ["bench", "--model", "embedded", "--routing", "out/traces", "--policy", "on-demand", "--policy", "lru",
             "--policy", "duoserve", "--predictor", str(embedded_predictor),
             "--batch-size", "1", "--batch-size", "2", "--prompt-len", "8", "--new-tokens", "3", "--repeats", "2",
             "--out", str(results / "simulate_bench_embedded_h100.json")]
    profile = ["profile", "--model", "embedded", "--layers", "2", "--batch-size", "1", "--batch-size", "2",
               "--context", "8", "--tokens", "1", "--tokens", "16", "--out", str(profiles / "h100-embedded.json")]
    for args in (bench, profile):
        result = runner.invoke(run_app, args)
        assert result.exit_code == 0, result.output
        assert ("the host's pace over the runs" in " ".join(result.output.split())) == (args is bench)
        assert ("reads the next-gate, computed on this run's prompts" in " ".join(result.output.split())) == \
            (args is bench)  # the bench says its guesses on replayed routing are not the trace's
    measured = json.loads((results / "simulate_bench_embedded_h100.json").read_text())["runs"]
    pace = json.loads((profiles / "h100-embedded.json").read_text())["host_op_us"]["median"]
    out = load_benchmark("simulate_validation").main(["--machine", "h100", "--results", str(results), "--profiles",
                                                      str(profiles), "--out", str(tmp_path / "validation.json")])
    rows = {(r["policy"], r["batch_size"]): r for r in out["rows"]}
    assert set(rows) == {(p, B) for p in ("on-demand", "lru") for B in (1, 2)}
    assert {(r["policy"], r["batch_size"]) for r in out["skipped"]} == {("duoserve", 1), ("duoserve", 2)}
    assert all("reads the next-gate" in r["why"] for r in out["skipped"])
    for (policy, batch), row in rows.items():
        runs = [r for r in measured if (r["policy"], r["batch_size"]) == (policy, batch)]
        assert row["rounds"] == len(runs) == 2
        assert row["measured"]["tpot_ms"] == pytest.approx(np.median([r["tpot_ms"] for r in runs]))
        assert row["ratio"]["ttft_ms"] == pytest.approx(row["simulated"]["ttft_ms"] / row["measured"]["ttft_ms"])
        assert row["bytes_h2d"]["simulated"] == row["bytes_h2d"]["measured"]  # the same rows replayed, the same copies
        assert row["host_op_us"] == {"runs": pytest.approx(np.median([r["host_op_us"] for r in runs])),
                                     "profile": pace}
        # simulated at the runs' pace, and at the profile's beside it: a CPU's steps are host time
        scale = row["host_op_us"]["runs"] / pace
        assert row["paced"] and row["simulated"]["tpot_ms"] != row["unpaced"]["simulated"]["tpot_ms"]
        assert (row["simulated"]["tpot_ms"] > row["unpaced"]["simulated"]["tpot_ms"]) == (scale > 1)
        # the engine's host sections beside the simulation's: the rounds' medians, and the same names simulated
        assert row["host_ms"]["measured"]["queue compute"] == pytest.approx(
            np.median([r["host_ms"]["queue compute"] for r in runs]))
        assert set(row["host_ms"]["simulated"]) <= set(row["host_ms"]["measured"])
        assert all(row["host_ms"]["simulated"][name] > 0 for name in ("wait for routing", "queue fetches"))
    assert out["held"] == sum(r["within"] for r in out["rows"])
    assert out["held_unpaced"] == sum(r["unpaced"]["within"] for r in out["rows"])
    # a predictor that is not here (trained elsewhere, as simulate_h200.sh's are): its runs skipped, saying which
    saved = json.loads((results / "simulate_bench_embedded_h100.json").read_text())
    for r in saved["runs"]:
        r["predictor"] = str(tmp_path / "gone") if r["predictor"] == str(embedded_predictor) else r["predictor"]
    (results / "simulate_bench_embedded_h100.json").write_text(json.dumps(saved))
    again = load_benchmark("simulate_validation").main(["--machine", "h100", "--results", str(results), "--profiles",
                                                        str(profiles), "--out", str(tmp_path / "validation.json")])
    assert [r["why"] for r in again["skipped"]] == [f"no predictor at {tmp_path / 'gone'} (simulate_h200.sh's header "
                                                    "says how it was trained)"] * 2
    assert len(again["rows"]) == len(out["rows"])


def test_a_bench_run_is_replayed_with_the_cache_it_had():
    """A bench run without a budget ran the engine's default cache of its version: the validation replays the
    ``cache_slots`` it recorded (here an int4 run of 11 slots, where today's default over int4 experts is 16), and a
    run that recorded none gets today's default."""
    from duoserve.bench.costs import resolve_profile

    validation = load_benchmark("simulate_validation")
    shape, costs = ModelShape.of("embedded"), Costs(resolve_profile("h200-embedded"))
    bench = {"gpu_expert_budget": None, "lookahead": 1, "prefetch_min_score": 0.0, "defer_prefetch": True}
    run_ = {"policy": "lru", "predictor": None, "expert_dtype": "int4", "batch_size": 1, "prompt_len": 4,
            "new_tokens": 3}
    assert validation.simulate_run(bench, {**run_, "cache_slots": 11}, shape, costs, None)["cache_slots"] == 11
    assert validation.simulate_run(bench, run_, shape, costs, None)["cache_slots"] == 4 * shape.top_k


SUBSTRATE_TRACE = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "substrate" / "traces"


def _replays(shape_name: str, trace: Path) -> None:
    """The replay shape has its trace's geometry (the engine refuses a trace of another) and Qwen3-30B-A3B's
    experts (what its profile and the engine's copies are measured on)."""
    meta = open_trace(trace).meta
    shape = ModelShape.of(shape_name)
    assert (shape.num_layers, shape.num_experts, shape.top_k) == (meta.num_layers, meta.num_experts, meta.top_k)
    assert shape.decoder_layers == meta.num_layers
    assert shape.layout == ModelShape.of("qwen3-30b-a3b").layout


def test_the_substrate_replay_shape_is_the_substrate_traces_geometry_at_qwen_widths():
    _replays("qwen3-30b-a3b-substrate", SUBSTRATE_TRACE)


@needs_flame_moe
def test_the_flame_replay_shape_is_flame_moes_geometry_at_qwen_widths(tmp_path):
    trace = load_benchmark("flame_moe").import_sequences(tmp_path / "flame")
    assert open_trace(trace).dataset.count_rows() == 32 * 64  # the encoder file's sequences, 64 tokens each
    _replays("qwen3-30b-a3b-flame", trace)


def test_the_prefill_boundary_benchmarks_copy_waits_account_for_all_the_copy_streams_idle_time():
    """benchmarks/simulate_prefill_boundary.py on the shipped H200 profile (Qwen3-30B-A3B's int4 experts, 8 layers,
    32 slots, B=8): the waits it finds before each copy, with the pass's start and end, add up to the prefill's time
    less its copies' (its idle time), and the layer boundary's wait for the host is among them."""
    from duoserve.bench.costs import resolve_profile

    boundary = load_benchmark("simulate_prefill_boundary")
    shape, profile = ModelShape.of("qwen3-30b-a3b", layers=8), resolve_profile("h200-qwen3-30b-a3b")
    idle = boundary.prefill(shape, profile, "int4", 32, 8, 512)["copy_idle_ms"]
    waits = boundary.copy_waits(shape, profile, "int4", 32, 8, 512)
    assert sum(waits.values()) == pytest.approx(idle)
    assert waits["the host, before the first fetched group, staged"] > 0
    assert all(ms >= 0 for ms in waits.values())
