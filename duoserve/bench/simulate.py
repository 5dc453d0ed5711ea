"""The offload simulator (``duoserve-eval simulate``): routing, a predictor and a policy, timed on a device profile.

Shape legend: T tokens in a forward pass, B sequences, C context length, L MoE layers, E experts, k top-k,
m next-gate width, S cache slots.

It runs the runtime's own schedule (``duoserve.runtime.scheduler.ExpertScheduler``: the cache, its eviction and
pins, prefill grouping, decode prefetch with the predictor's real predictions, re-fetch on a miss, look-ahead)
over stand-ins that do no work but advance clocks by a device profile's costs (``clocks.py``, ``costs.py``):

  streams   one clock per stream and one for the host; an event is the time its stream's work so far ends, a wait
            moves a stream's clock to it (the compute stream's waits for copies, and copies on it, are its
            stalls), work queued at host time h on a stream starts no earlier than h
  stores    a fetched expert costs the host the profile's fetch cost for the cache's size (``fetch_host_us``) and
            its stream bytes / bandwidth at that copy's size (a per-module store: a blocking pageable fetch,
            ``module_copy_ms``); a quantized one lands in one of the staging buffers (the engine's chunks) and is
            then dequantized on the dequant stream, which alone waits for the slots' last readers
  compute   a group of experts with c_i tokens each costs the compute stream base + sum_i per_expert(c_i),
            both fitted from the profile's groups of 1 and k experts, and the host ``group_host_us`` (by the call's
            tokens where the profile has them) for each group past a call's first
  predictor a trained one runs on the host for its real predictions (computed 64 passes at a time in one batched
            call, ``Simulator.predict_ahead``); each call costs the profile's predictor call (host time, then
            device time on the predictor stream, which the prefetch waits for)

and, per forward pass: each decoder layer's non-expert work (``layer_ms``), launched by the host over its wall time
while its kernels run on the compute stream, or, for a decode layer replayed from step graphs (as the profile
says it measured them, version 9 on: the host time before its experts call timed apart), launched at once when
the host's work before that call is done (a graph's replay), the rest of it after the call; the host waiting for
its router (the engine reads every layer's routing), the engine's host time per layer call (``call_host_us``:
its routing read before the call's fetches are queued, the rest after them, while their copies run; a decode call
too large for the cache computes in eager groups as a prefill call does, and its first group costs what a prefill
call of its tokens does), and the pass's own cost (``step_ms``: embedding, head, sampling), the host waiting for
its token. So the simulator's hits, copies and bytes are the engine's on the same routing and predictor (tested
exactly against the engine on the CPU); its times are the profile's model of them (against the engine on the
H200: ``benchmarks/simulate_validation.py``).

Not modelled: padding (a batch's prompts are one pass of all their tokens, at the longest prompt's context), and
host-to-device transfers of two streams contending (an upload on the compute stream that waits for the copy
stream's backlog on the H200: the engine queues none where a copy backlog stands, ``schedule.py``).
"""


from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from duoserve.bench.clocks import SimCompute, SimStore, SimStreams, SimTimers
from duoserve.bench.costs import Costs
from duoserve.bench.drivers import OraclePredictor, RandomRouting, open_routing_trace, oracle_recall
from duoserve.bench.shapes import model_source
from duoserve.discovery import Gate, find_moe_layers, moe_geometry, top_k
from duoserve.loading import model_from_config
from duoserve.predictor.artifact import load_predictor
from duoserve.predictor.fast import TrainedPredictor
from duoserve.runtime.policies import Policy
from duoserve.runtime.scheduler import ROUTING_SECTION, ExpertScheduler
from duoserve.runtime.settings import EngineSettings
from duoserve.runtime.sources import RoutingSource
from duoserve.runtime.store import ExpertLayout, expert_params
from duoserve.runtime.streams import NullTimers


@dataclass(frozen=True)
class ModelShape:
    """What the simulator needs of a model: its geometry, its decoder depth and one expert's packed layout."""

    name: str
    num_layers: int  # L: MoE layers
    num_experts: int
    top_k: int
    decoder_layers: int
    layout: ExpertLayout

    @classmethod
    def of(cls, spec: str, layers: int | None = None, dtype: str = "bfloat16") -> ModelShape:
        """A named shape (``duoserve.bench.shapes``), a config (hub id, local path) or ``embedded``, built on the
        meta device (no memory); ``layers``: keep that many decoder layers."""
        with tempfile.TemporaryDirectory() as folder:
            net = model_from_config(model_source(spec, folder), torch.device("meta"), dtype, layers)
        moe = find_moe_layers(net)
        g = moe_geometry(net, moe)
        params = expert_params(moe[0].experts)
        return cls(spec, g.num_layers, g.num_experts, g.top_k, net.config.get_text_config().num_hidden_layers,
                   ExpertLayout.of(params))

    def check(self, profile: dict) -> None:
        """Refuse a profile measured for another expert size or geometry (its costs would not apply)."""
        g = profile["geometry"]
        ours = (self.num_experts, self.top_k, self.layout.nbytes)
        theirs = (g["experts"], g["top_k"], g["expert_bytes"])
        if ours != theirs:
            raise ValueError(f"the profile was measured for E, k, expert bytes = {theirs} ({profile.get('model')}); "
                             f"shape {self.name} has {ours} (in {self.layout.dtype}): profile it in that dtype with "
                             f"duoserve-run profile --model {self.name} --dtype ...")


class Pass(NamedTuple):
    """One forward pass to simulate: its phase, routing (L x T x k), batch and context, and the next-gate's ids
    and scores of its tokens for predictors that read them (T x (L-1) x m each, or None)."""

    phase: str
    ids: np.ndarray
    batch: int
    context: int
    nextgate: tuple[np.ndarray, np.ndarray | None] | None = None


class _TimedPredictor:
    """A trained predictor run on the host for its real predictions, each call costing what the profile's predictor
    call costs: host time, then device time on the predictor stream (which the prefetch's rank waits for).

    Its scores are a function of the token's routing up to the layer running, the target, the depth and the
    target's next-gate features only, so ``fill`` computes those of many passes in one batched call, and a call of
    the schedule takes their top k from the table (scores equal to one call per layer up to float rounding); a pass
    not filled ahead (``Simulator.forward`` driven without ``run``) is scored per call.

    ``table``: a table shared by the simulations of one predictor at one look-ahead on the same passes
    (``whatif.Study``'s points, which differ only in settings the scores do not depend on): kept across fills, and
    a pass it holds is not scored again. It is keyed by the passes' ids, so its owner keeps those passes alive;
    without one, each fill starts a table of its own."""

    on_host = False

    def __init__(self, predictor: TrainedPredictor, streams: SimStreams, costs: Costs, k: int,
                 table: dict | None = None):
        self.predictor, self.streams, self.costs, self.k = predictor, streams, costs, k
        self.nextgate, self.nextgate_scores = predictor.nextgate, predictor.nextgate_scores
        self.lookahead = predictor.lookahead
        self.shared = table is not None
        # pass key -> the A x B x k best scores of its A asks and their experts (one pair of tensors a pass: a trace's
        # passes are many)
        self.table: dict[int, tuple[torch.Tensor, torch.Tensor]] = {} if table is None else table
        self.rows: dict[tuple[int, int], int] = {}  # (target, depth) -> its ask's row in a pass's entry
        self.key: int | None = None  # the pass being simulated

    def fill(self, passes: list[tuple[int, torch.Tensor, list[tuple]]], asks: list[tuple[int, int]]) -> None:
        """Score the (target, depth) ``asks`` of every pass of ``passes`` ((pass key, B x L x k routing, each ask's
        next-gate features)) in one call (the caller leaves out those a shared table holds)."""
        if not self.shared:
            self.table = {}
        self.rows = {ask: a for a, ask in enumerate(asks)}
        if not passes or not asks:
            return
        A = len(asks)
        sizes = [A * len(h) for _, h, _ in passes]  # each pass's rows: its A asks in turn, B each
        history = torch.cat([h.repeat(A, 1, 1) for _, h, _ in passes])  # N x L x k
        per_ask = torch.tensor(asks)  # A x 2: target, depth
        target = torch.cat([per_ask[:, 0].repeat_interleave(len(h)) for _, h, _ in passes])  # N
        depth = torch.cat([per_ask[:, 1].repeat_interleave(len(h)) for _, h, _ in passes])  # N
        features = [torch.cat(parts) for parts in zip(*(f for *_, each in passes for f in each))]  # N x m (ids, scores)
        scores = self.predictor.logits(history, target, *features, depth=depth).sigmoid()  # N x E
        best, ids = top_k(scores, self.k)  # N x k each
        for (key, h, _), part, part_ids in zip(passes, best.split(sizes), ids.split(sizes)):
            self.table[key] = (part.view(A, len(h), self.k), part_ids.view(A, len(h), self.k))  # A x B x k each

    def top(self, history: torch.Tensor, target: int, k: int, hidden: torch.Tensor | None = None,
            gate: Gate | None = None, depth: int = 1) -> tuple[torch.Tensor, ...]:
        host_ms, device_ms = self.costs.predictor_ms(len(history))
        self.streams.host += host_ms
        self.streams.run(self.streams.predict, device_ms)
        filled, row = self.table.get(self.key), self.rows.get((target, depth))
        if filled is None or row is None or k != self.k:
            return self.predictor.top(history, target, k, hidden, gate, depth=depth)
        return filled[0][row], filled[1][row]  # B x k each

    def history(self, batch: int, device: str | torch.device) -> torch.Tensor:
        return self.predictor.history(batch, device)


class _PassRouting:
    """The routing of the pass being simulated, where an oracle reads it (a ``RoutingSource``'s ``ids``)."""

    def __init__(self):
        self.current: np.ndarray | None = None  # L x T x k

    def ids(self, layer: int) -> np.ndarray:
        return self.current[layer]


class Simulator:
    """``policy`` on a model of ``shape``, timed by ``costs``; ``predictor``: none, oracle[:RECALL] or an artifact
    path (a trained predictor, run on the host CPU on the pass's real routing); ``sections``: also time the engine's
    host sections on the simulated clock (``clocks.SimTimers``: what a bench run's ``host_ms`` holds), at some cost
    in the simulator's own speed; ``scores``: a trained predictor's table of scores shared with other simulations of
    it on the same pass objects (``_TimedPredictor``), which its caller keeps alive."""

    def __init__(self, shape: ModelShape, costs: Costs, policy: Policy, predictor: str = "none",
                 settings: EngineSettings = EngineSettings(), expert_dtype: str = "model", seed: int = 0,
                 sections: bool = False, scores: dict | None = None):
        if policy.resident or policy.accelerate or policy.host_compute:
            raise ValueError(f"policy {policy.name} does not run the engine's schedule; simulate one of the policies "
                             "that offload through the expert cache")
        if expert_dtype != "model" and not policy.quantizable:
            raise ValueError(f"policy {policy.name} copies the model's own parameters; it takes no quantized experts")
        self.shape, self.costs, self.policy = shape, costs, policy
        self.streams = SimStreams()
        self.timers = SimTimers(self.streams) if sections else None  # None: nothing timed on the hot path
        self._routing = _PassRouting()
        self._nextgate: tuple | None = None
        L, E, k = shape.num_layers, shape.num_experts, shape.top_k
        stores = [SimStore(shape.layout, costs, policy.pinned, expert_dtype) for _ in range(L)]
        deployed, next_gate = None, None
        self._trained: _TimedPredictor | None = None  # a trained predictor, whose scores are computed ahead
        self.predictor_seconds = 0.0  # this process's seconds spent computing them (``predict_ahead``)
        if policy.predict and predictor != "none":
            if predictor.startswith("oracle"):
                deployed = OraclePredictor(self._routing, L, E, oracle_recall(predictor), seed)
            else:
                artifact = load_predictor(predictor)
                artifact.check_geometry(L, E, k)
                # its CPU form (the embedding-bag first layer): the same function, 1.5x faster batched
                deployed = self._trained = _TimedPredictor(TrainedPredictor(artifact, "cpu", sparse=True), self.streams,
                                                           costs, k, scores)
                if deployed.nextgate:
                    next_gate = [None] + [self._next_gate_of(t, deployed.nextgate, deployed.nextgate_scores)
                                          for t in range(1, L)]
        self.scheduler = ExpertScheduler((L, E, k), stores, policy, settings, self.streams,
                                         lambda cache, streams, _: SimCompute(cache, streams, self.timers, costs),
                                         deployed, next_gate, self.timers or NullTimers())
        for store in stores:
            store.host_ms = costs.fetch_host_ms(self.scheduler.cache.slots)
        # the engine's decode layers replayed from step graphs, as the profile's layer costs say they were: the
        # scheduler then leaves each decode prefetch to the next layer call, if the settings ask for it
        self.scheduler.layers_replayed = bool(costs.profile.get("step_graphs", False))

    def _next_gate_of(self, target: int, width: int, with_scores: bool):
        """What the engine's next-gate function gives for ``target``: the replayed pass's B x m ids (and scores)."""
        def features(hidden) -> tuple[torch.Tensor, ...]:
            ids, scores = self._nextgate or (None, None)
            if ids is None or (with_scores and scores is None):
                raise ValueError("this predictor reads next-gate features; the routing replayed has none (a trace "
                                 "collected with them, of at least the predictor's width)")
            out = (torch.from_numpy(ids[:, target - 1, :width].astype(np.int64)),)  # B x m
            return out + (torch.from_numpy(scores[:, target - 1, :width].astype(np.float32)),) if with_scores else out

        return features

    def predict_ahead(self, passes: list[Pass]) -> None:
        """Compute a trained predictor's scores for every decode pass of ``passes`` at once, each (target, depth)
        that the decode prefetch asks at some layer (``forward`` then reads them: one batched call, not one per
        layer; nothing for an oracle or no predictor); its seconds are added to ``predictor_seconds``."""
        plan = self.scheduler.prefetch
        if self._trained is None or plan is None:
            return
        started = time.perf_counter()
        asks = [(t, t - l) for l in range(self.shape.num_layers) for t in plan.targets(l)]  # (target, depth)
        todo = []
        for p in passes:
            if p.phase != "decode" or (self._trained.shared and id(p) in self._trained.table):
                continue
            history = torch.from_numpy(p.ids.transpose(1, 0, 2).astype(np.int64))  # B x L x k: reads layers <= l only
            self._nextgate = p.nextgate
            todo.append((id(p), history, [plan.next_gate[t](None) if plan.next_gate else () for t, _ in asks]))
        self._nextgate = None
        self._trained.fill(todo, asks)
        self.predictor_seconds += time.perf_counter() - started

    def forward(self, p: Pass) -> float:
        """Simulate one forward pass; its wall milliseconds (host clock, the pass's token read at its end)."""
        s, costs, sched = self.streams, self.costs, self.scheduler
        start = s.host
        self._routing.current, self._nextgate = p.ids, p.nextgate
        if self._trained is not None:
            self._trained.key = id(p)
        sched.begin_pass(p.phase, p.batch)
        T = p.ids.shape[1]
        hidden, weights = torch.empty(T, 0), torch.empty(T, self.shape.top_k)
        # L x T x k: host arrays, as the engine's routing reads them; tensors where a trained predictor copies each
        # layer's into its history
        layers = p.ids if self._trained is None else torch.from_numpy(p.ids.astype(np.int64, copy=False)).unbind(0)
        wall, device = costs.pass_ms("layer_ms", p.phase, p.batch, p.context)
        host_ms, routing_ms = costs.call_host_ms(p.phase, T), costs.routing_host_ms(p.phase, T)
        # a decode call whose experts do not fit the cache computes in groups, eagerly, as a prefill call does: its
        # first group costs what a prefill call of its tokens does (a one-group decode call is replayed from a graph)
        grouped_ms = costs.call_host_ms("prefill", T) - costs.routing_host_ms("prefill", T)
        dense = self.shape.decoder_layers - self.shape.num_layers
        s.launch(wall * dense, device * dense)
        # a decode layer replayed from step graphs launches its kernels at once, when its host work before its experts
        # call is done, and the router's read waits for all of them; the rest of its host work follows the call. An
        # eager layer's kernels run as the host launches them (and so a replayed one's where the profile did not time
        # the part before the call)
        ahead = costs.layer_before_ms(p.phase, p.batch, p.context) if sched.layers_replayed and p.phase == "decode" \
            else None  # the layer's host ms before its experts call
        for l, layer_idx in enumerate(layers):  # T x k each
            if ahead is None:
                s.launch(wall, device)
            else:
                s.replay(ahead, device)
            sched.queue_deferred()  # where the engine's call starts: before it waits for the routing
            before = s.host
            s.block(s.compute)  # the engine reads the layer's routing
            s.host += routing_ms
            if self.timers is not None:
                self.timers.cpu.add(ROUTING_SECTION, s.host - before)
            sched.compute.begin_call(host_ms - routing_ms, T, grouped_ms)  # the rest of the call's host time, while
            # misses copy
            sched.run_layer(l, hidden, layer_idx, weights)
            if ahead is not None:
                s.host += wall - ahead
        s.launch(*costs.pass_ms("step_ms", p.phase, p.batch, p.context))
        s.block(s.compute)  # the next token is read
        return s.host - start

    def reset_stats(self) -> None:
        """Counters from here on (the cache keeps what it holds), as the bench resets them after its warm-up."""
        self.scheduler.reset_stats()
        self.streams.stall_ms = 0.0

    def stats(self) -> dict:
        out = self.scheduler.stats()
        out["stall_ms"] = self.streams.stall_ms
        return out


def generation_passes(routing: RoutingSource, batch: int, prompt_len: int, new_tokens: int) -> Iterator[Pass]:
    """The forward passes of one generation of N tokens for B prompts of S tokens: a prefill of B x S tokens and N - 1
    decode steps, each routed as ``routing`` draws it when the pass starts (as the engine's routing source does)."""
    yield Pass("prefill", routing.begin(batch * prompt_len).numpy(), batch, prompt_len)
    for i in range(new_tokens - 1):
        yield Pass("decode", routing.begin(batch).numpy(), batch, prompt_len + i + 1)


def random_passes(shape: ModelShape, batch: int, prompt_len: int, new_tokens: int, seed: int = 0) -> Iterator[Pass]:
    """``generation_passes`` routed uniformly at random as ``RandomRouting`` draws it on the host (with the same seed:
    the same routing as an engine's on the host)."""
    routing = RandomRouting(shape.num_layers, shape.num_experts, shape.top_k, seed)
    return generation_passes(routing, batch, prompt_len, new_tokens)


def bench_passes(routing: RoutingSource, batch: int, prompt_len: int, new_tokens: int) -> Iterator[tuple[int, Pass]]:
    """The passes of one ``duoserve-run bench`` run, as ``run`` takes them: its warm-up generation of 2 tokens (index
    -1: simulated, not reported) and then the timed generation (index 0), on one routing source."""
    for index, count in ((-1, 2), (0, new_tokens)):
        for p in generation_passes(routing, batch, prompt_len, count):
            yield index, p


@dataclass
class Request:
    """One traced request: its prompt's and generated tokens' routing (P x L x k, D x L x k) and next-gate
    features (ids, scores: each N x (L-1) x m, or None), in position order."""

    prompt: np.ndarray
    decode: np.ndarray
    nextgate: tuple[np.ndarray | None, np.ndarray | None] = (None, None)


def trace_requests(trace: str | Path, shape: ModelShape, limit: int | None = None) -> list[Request]:
    """The requests of a trace folder of ``shape``'s routing, in request order (``limit``: the first that many)."""
    t = open_routing_trace(trace, shape.num_layers, shape.num_experts, shape.top_k)
    L, k = t.meta.num_layers, t.meta.top_k
    m = t.meta.nextgate_width
    columns = ["dataset", "request_id", "phase", "position", "experts"]
    names = set(t.dataset.schema.names)
    has_gate = "nextgate" in names
    columns += ["nextgate"] + (["nextgate_scores"] if "nextgate_scores" in names else []) if has_gate else []
    table = t.dataset.to_table(columns=columns).to_pandas()
    table = table.sort_values(["dataset", "request_id", "position"], kind="stable")
    requests = []
    for _, rows in table.groupby(["dataset", "request_id"], sort=False):
        experts = np.stack(rows["experts"].to_numpy()).reshape(-1, L, k)  # N x L x k
        prefill = (rows["phase"] == "prefill").to_numpy()
        gate = (None, None)
        if has_gate:
            ids = np.stack(rows["nextgate"].to_numpy()).reshape(-1, L - 1, m)
            scores = np.stack(rows["nextgate_scores"].to_numpy()).reshape(-1, L - 1, m) \
                if "nextgate_scores" in rows else None
            gate = (ids[~prefill], None if scores is None else scores[~prefill])
        requests.append(Request(experts[prefill], experts[~prefill], gate))
        if limit and len(requests) >= limit:
            break
    if not requests:
        raise ValueError(f"trace {trace} holds no requests to simulate")
    return requests


def trace_passes(requests: list[Request], batch: int) -> Iterator[tuple[int, Pass]]:
    """(batch index, pass): each batch of ``batch`` consecutive requests as one prefill of all their prompt tokens
    and a decode step per generated token while any of them still generates."""
    for b, i in enumerate(range(0, len(requests), batch)):
        group = requests[i:i + batch]
        context = max(len(r.prompt) for r in group)
        yield b, Pass("prefill", np.concatenate([r.prompt for r in group]).transpose(1, 0, 2), len(group), context)
        for j in range(max(len(r.decode) for r in group)):
            active = [r for r in group if len(r.decode) > j]
            gate = None
            if active[0].nextgate[0] is not None:
                ids = np.stack([r.nextgate[0][j] for r in active])
                scores = None if active[0].nextgate[1] is None else np.stack([r.nextgate[1][j] for r in active])
                gate = (ids, scores)
            ids = np.stack([r.decode[j] for r in active]).transpose(1, 0, 2)  # L x B x k
            yield b, Pass("decode", ids, len(active), context + j + 1, gate)


def run(sim: Simulator, passes: Iterable[tuple[int, Pass]]) -> dict:
    """Simulate ``passes`` ((batch index, pass) pairs; a negative index: a warm-up pass, simulated but neither timed
    nor counted); TTFT per batch, time per output token per decode step (P50, P95, mean), (prompt tokens, TTFT) of
    each prefill, tokens, token-layers, the engine's counters (with the simulated host milliseconds in each of the
    engine's host sections, ``host_ms``, where the simulator was made with ``sections``), the simulator's own
    seconds and, of those, the seconds a trained predictor spent scoring (its inference on the host,
    ``predictor_seconds``)."""
    ttft, tpot, tokens, warm, prompts = [], [], 0, False, []
    started, scored = time.perf_counter(), sim.predictor_seconds
    for index, p in _predicted_ahead(sim, passes):
        if index >= 0 and warm:  # the timed generation starts on an idle device, its counters from zero
            sim.streams.synchronize()
            sim.reset_stats()
            warm = False
        ms = sim.forward(p)
        if index < 0:
            warm = True
            continue
        (ttft if p.phase == "prefill" else tpot).append(ms)
        if p.phase == "prefill":
            prompts.append((p.ids.shape[1], ms))
        tokens += p.ids.shape[1]
    stats = sim.stats()
    seconds = time.perf_counter() - started
    return {"ttft_ms": _summary(ttft), "tpot_ms": _summary(tpot), "tokens": tokens,
            "token_layers": tokens * sim.shape.num_layers, "decode_steps": len(tpot),
            "sim_seconds": seconds, "predictor_seconds": sim.predictor_seconds - scored,
            "peak_expert_bytes": stats["cache_bytes"], "prefill_points": prompts,
            **{key: stats[key] for key in ("cache_slots", "pinned_experts", "bytes_h2d", "copies", "hit_rate",
                                           "prefetched", "prefetch_precision", "stall_ms", "host_ms")}}


def _predicted_ahead(sim: Simulator, passes: Iterable[tuple[int, Pass]], chunk: int = 64) -> Iterator[tuple[int, Pass]]:
    """``passes`` as they come, a trained predictor's scores computed ``chunk`` passes at a time before they run."""
    it = iter(passes)
    while block := list(itertools.islice(it, chunk)):
        sim.predict_ahead([p for _, p in block])
        yield from block


def _summary(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p95": None, "mean": None}
    return {"p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95)),
            "mean": statistics.fmean(values)}
