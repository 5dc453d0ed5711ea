"""A device profile (``duoserve-run profile``): the costs the offload simulator needs, measured here.

Shape legend: T tokens, B sequences, C context (prompt) length, H hidden size, E experts, k top-k, P one packed
expert.

The model is built from its config with random weights and a few decoder layers (timings do not depend on the
weights, and any shape fits any GPU). Fields (``PROFILE_FIELDS``; ``load_profile`` refuses a file without one):
  geometry      the shape measured: MoE layers of the full model, E, k, hidden size, bytes of one expert
  copy          host-to-device GB/s by copy size, pinned and pageable
  copy_host_us  host microseconds to queue one expert copy on the engine's copy path, not waiting for it
                (on the CPU the copy is synchronous, so this is the copy itself)
  module_copy_ms  one expert fetched from per-module (pageable) parameters, a blocking copy per parameter (the
                per-module policies' fetch), timed inside a real generation of a per-module engine
  expert_ms     device time of the engine's grouped expert compute (``experts.slot_experts``) of 1 and of k
                experts with T tokens each, replayed from a CUDA graph where one can be captured (so no host time
                is in it); on the CPU, its wall time
  call_host_us  host microseconds of one engine layer call whose experts are all cached (the routing read and
                grouped, the cache looked up, one compute group queued), by phase and tokens; a decode call's
                timed inside real generations run as the bench runs them (on a static KV cache, the decoder
                layers replayed from step graphs where ``step_graphs`` is on; before version 5, eager ones), the
                host's caches as such a forward pass leaves them (which costs a call more than one timed alone),
                the device waited for before each call; ``routing_us``: the part
                of it before a call queues any fetch (the engine's ``ROUTING_SECTION``): a call with misses
                queues their copies there and spends the rest while they run (profiles before version 4 lack it;
                the simulator then charges the whole call before the copies)
  fetch_host_us what each expert fetched on a miss adds to a call's host time (the cache's victim choice and
                books, the copy queued), by cache size: scanned caches (the default's, and the larger default over
                int4 experts, ``scheduler.default_capacity``) and, where the model has the experts, a heap-ranked
                one; timed inside real generations too, from the engine's own fetch section (version 4:
                the difference of two engines' whole calls). ``dequant_host_us`` (version 8; not required): what
                each dequantization pass of a quantized fetch adds to it, by stored expert dtype (the slot ids'
                upload, the pass's launch or graph replay, its events), from decode calls of an engine over these
                experts stored so, less ``fetch_host_us`` for each expert's copy; before it, the simulator charged a
                pass one copy's queueing
  group_host_us what each compute group beyond a call's first adds (the prefill schedule: rows, upload, launches):
                a prefill of every expert through caches of 4k and k slots, fetched in groups of 2k and k/2, the
                difference in host time over the difference in groups (version 3 and before: one such call
                less a hit call and E fetches, which left a per-expert part in it); a call of E/k tokens, each
                expert routed once. ``group_host_by_tokens`` (version 6; not required): the same by the call's
                tokens, E/k and ``GROUP_TOKENS`` (each expert routed by T*k/E tokens), as a group's host cost grows
                with its pairs; the simulator takes it at the call's tokens
  predictor_ms  one decode-time call of a predictor of the paper's widths for this geometry (scores and top-k),
                by batch size: its host time, and its wall time with the device waited for; and, not required
                (files without it are read, the call's own host time then standing for it), ``launch_host_ms``:
                the host time of the engine's whole decode-time launch of it (the routing written into its
                history, the call, its ids and scores copied back), timed inside real generations of a
                ``duoserve`` engine with a random predictor: several times the bare call's
  dequant_ms    device time per expert of the engine's dequantization, by stored expert dtype: a pass of its
                staging chunk (``quant.stage_chunk`` experts, replayed from a CUDA graph on a GPU) straight into
                cache slots, divided by the chunk (versions 3 to 6 timed the eager pass into scratch rows, then
                copied into the slots; version 2 one expert dequantized eagerly, wall time with its launches)
  layer_ms      everything but the routed experts, per decoder layer: a decode step and a prefill, by batch
                size and context length (the experts answering zeros through the experts interface): host time
                (``decode_ms``, ``prefill_ms``: what the host spends launching it, timed by forward hooks on every
                decoder layer of every timed pass, the median; on a GPU a decode call is replayed from the engine's
                step graphs unless ``step_graphs`` is off, as the file records) and the device's kernel time
                (``decode_device_ms``, ``prefill_device_ms``: torch's profiler, fitted from 1 and ``layers``
                decoder layers; the wall time on the CPU); and, not required (version 9), the part of the host
                time before the layer's experts call (``decode_before_ms``, ``prefill_before_ms``): a layer replayed
                from step graphs launches its kernels there at once, and its router is read right after
  step_ms       what a forward pass costs besides its layers (embedding, head, generate's own work), by the same
                keys: the fit of two depths, 1 and ``layers`` decoder layers
The engine's host costs (``call_host_us``, ``fetch_host_us``, ``group_host_us``, ``module_copy_ms``, and
``predictor_ms``' ``launch_host_ms``) are each the median of ``rounds`` rounds of them, one after another (a
host's speed drifts between minutes, and one round is one sample of it: two single-round profiles of one H100,
minutes apart, read 1.5x apart on a decode call); ``engine_rounds`` (not required) keeps each round's.
Not required (files without it are read): ``host_op_us``, the host's pace while it was measured, in microseconds
per small tensor op (the bench's own gauge, ``harness.host_op_us``, sampled before each section): the median,
least and most, and each sample by the section it preceded (``sections``; ``end``: after the last), so a cost
can be set beside the pace of the section that measured it. A bench run records the same gauge, so a validation
can tell a model error from a host that drifted between the profile and the run, and simulate the run at its own
pace (``costs.Costs``' ``host_op_us``).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from duoserve.bench.drivers import random_ids
from duoserve.bench.harness import copy_bandwidth, device_name, host_op_us, sync
from duoserve.bench.shapes import random_predictor
from duoserve.discovery import find_moe_layers, moe_geometry
from duoserve.loading import model_from_config, resolve_device
from duoserve.predictor.fast import TrainedPredictor
from duoserve.runtime.engine import OffloadEngine
from duoserve.runtime.experts import SlotView, slot_experts
from duoserve.runtime.generation import cache_for, timed_generate
from duoserve.runtime.plugin import ExpertsPlugin
from duoserve.runtime.policies import POLICIES
from duoserve.runtime.quant import QuantizedExperts, dequantizer, make_store, stage_chunk
from duoserve.runtime.schedule import FETCH_SECTION
from duoserve.runtime.scheduler import ROUTING_SECTION, default_capacity
from duoserve.runtime.settings import EngineSettings
from duoserve.runtime.store import HostExperts, expert_params, take_experts
from duoserve.runtime.streams import Streams

# 9: layer_ms rows carry decode_before_ms and prefill_before_ms, a layer's host time before its experts call;
# 8: dequant_host_us, a quantized fetch's host cost per dequantization pass, by expert dtype;
# 7: dequant_ms is the engine's pass straight into cache slots, Triton kernels on a GPU (before: eager, then copied);
# 6: group_host_by_tokens, a prefill group's host cost by the call's tokens (group_host_us: at E/k tokens);
# 5: the engine's host costs timed in generations run as the bench runs them (step graphs on a static KV cache),
# each the median of rounds, a fetch's from the engine's fetch section;
# 4: call_host_us rows carry routing_us, group_host_us from two group sizes; 3: dequant_ms is the engine's own pass
# per expert (2: one expert dequantized eagerly)
PROFILE_VERSION = 9
READABLE_PROFILE_VERSIONS = (2, 3, 4, 5, 6, 7, 8, 9)
PROFILE_FIELDS = ("device", "geometry", "copy", "copy_host_us", "module_copy_ms", "expert_ms", "call_host_us",
                  "fetch_host_us", "group_host_us", "predictor_ms", "dequant_ms", "layer_ms", "step_ms")
MB = 1 << 20
GROUP_TOKENS = (64, 512)  # prefill lengths (besides E/k) whose groups' host cost a profile measures


@dataclass
class ProfileSettings:
    model: str  # a config (hub id, local path, checkpoint folder): only its shape is used
    layers: int = 2  # decoder layers built (at least 2: costs per layer and per pass are told apart)
    dtype: str = "auto"
    device: str = "auto"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    contexts: list[int] = field(default_factory=lambda: [128, 512])
    tokens: list[int] = field(default_factory=lambda: [1, 8, 64, 512])  # routed to one expert
    copy_mb: list[float] = field(default_factory=lambda: [1.0, 4.0, 16.0, 64.0])  # besides one expert's size
    repeats: int = 5
    step_graphs: bool = True  # on a GPU, layers' decode calls replayed from step graphs, as the engine runs them
    rounds: int = 3  # of the engine's host costs, each the median of its rounds

    def __post_init__(self):
        if self.layers < 2 or self.repeats < 1 or self.rounds < 1:
            raise ValueError("a profile builds at least 2 decoder layers (per-layer costs are fitted from two "
                             "depths), repeats at least once and measures the engine's costs in at least one round")
        if min(self.batch_sizes + self.contexts + self.tokens) < 1 or min(self.copy_mb) <= 0:
            raise ValueError("batch sizes, contexts, token counts and copy sizes must be positive")


class _NoExperts(ExpertsPlugin):
    """The model with its routed experts answering zeros: what the rest of a layer costs. ``called``, where set, is
    called as each experts call starts (``_LayerClock`` splits a layer's host time there)."""

    called: Callable[[], None] | None = None

    def run_layer(self, l: int, hidden: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.called is not None:
            self.called()
        return torch.zeros_like(hidden)


def _median_ms(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median wall milliseconds of ``fn`` over ``repeats`` calls after one warm-up, the device synchronised."""
    times = []
    for i in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _host_ms(fn: Callable[[], None], device: torch.device) -> float:
    """Host milliseconds of one call of ``fn`` started on an idle device, its work not waited for."""
    sync(device)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _copy_host_us(store: HostExperts, device: torch.device, copies: int = 32) -> float:
    """Host microseconds per queued expert copy (the engine's ``Streams.copy_to_device``), the copies not waited
    for inside the timed span."""
    streams = Streams(device)
    slot = torch.empty(store.layout.numel, dtype=store.layout.dtype, device=device)  # P
    rows = store.packed.unbind(0)
    streams.copy_to_device(slot, rows[0], streams.copy)
    streams.synchronize()
    start = time.perf_counter()
    for i in range(copies):
        streams.copy_to_device(slot, rows[i % len(rows)], streams.copy)
    elapsed = time.perf_counter() - start
    streams.synchronize()
    return elapsed / copies * 1e6


def device_ms(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Device milliseconds of ``fn``: replayed from a CUDA graph and timed by events where it can be captured (no
    host time in it), else its median wall time, synchronised (the CPU; kernels that read the host)."""
    if device.type == "cuda":
        try:
            warm = torch.cuda.Stream(device)
            warm.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(warm):
                fn()
            torch.cuda.current_stream(device).wait_stream(warm)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError:
            torch.cuda.synchronize(device)
        else:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graph.replay()
            begin.record()
            for _ in range(repeats):
                graph.replay()
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / repeats
    return _median_ms(fn, device, repeats)


def _dequant_ms(quantized: QuantizedExperts, device: torch.device, repeats: int) -> float:
    """Device milliseconds per expert of the engine's dequantization (``QuantizedExperts.copy_group``): a pass of its
    staging chunk of experts (a layer of fewer experts than a chunk, all of them) straight into cache slots, every
    other one (a decode pass's slots are no stretch). Per expert of a pass, as one pass's launches are shared by its
    experts."""
    layout, n = quantized.layout, min(max(quantized.chunk, 1), len(quantized.packed))
    stored = quantized.packed[:n].to(device)  # n x Q
    table = torch.empty(2 * n, layout.numel, dtype=layout.dtype, device=device)  # 2n x P: cache rows
    slots = torch.arange(0, 2 * n, 2, device=device)  # n
    fn = dequantizer(device)
    return device_ms(lambda: fn(stored, slots, quantized.qlayout, layout, table), device, repeats) / n


def _expert_ms(layer, store: HostExperts, s: ProfileSettings, k: int, device: torch.device, H: int) -> list[dict]:
    """Device time of the engine's grouped compute of 1 and of k resident experts with T tokens each."""
    E, dtype = len(store.packed), store.layout.dtype
    view = SlotView(layer.experts, store.layout.views(store.packed.to(device)), E)
    rows = []
    for g in sorted({1, k}):
        for T in s.tokens:
            n = g * T  # pairs: expert j takes tokens j*T .. (j+1)*T - 1
            hidden = torch.randn(n, H, dtype=dtype, device=device)  # n x H
            weights = torch.ones(n, 1, dtype=dtype, device=device)  # n x 1
            slots = np.repeat(np.arange(g), T)  # n
            offsets = np.searchsorted(slots, np.arange(E), side="right")  # E
            pairs = np.concatenate([np.arange(n), np.arange(n), slots, offsets]).astype(np.int32)
            pairs = torch.from_numpy(pairs).to(device)
            ms = device_ms(lambda: slot_experts(view, hidden, weights, pairs, E), device, s.repeats)
            rows.append({"experts": g, "tokens": T, "ms": ms})
    return rows


def _section_ms(engine: OffloadEngine, name: str) -> float:
    """Host milliseconds ``engine`` has spent so far in its section ``name``."""
    return engine.timers.cpu.ms.get(name, 0.0)


class _Call(NamedTuple):
    """One timed layer call: its phase and tokens, its host µs, the experts it fetched, and the host µs of its
    routing read and of its fetch section."""

    phase: str
    tokens: int
    us: float
    fetched: int
    routing_us: float
    fetch_us: float


def _timed_calls(engine: OffloadEngine, model, s: ProfileSettings, batch: int, device: torch.device,
                 launches: list[float] | None = None) -> list[_Call]:
    """Each of ``engine``'s layer calls (``_Call``) in a real generation of ``batch`` prompts (``s.contexts[0]``
    tokens, 8 new) after a warm-up one, run as the bench runs it (on a static KV cache where the engine replays its
    step graphs): the host's caches as such a forward pass leaves them, the device waited for before each call, so
    what is timed is the call's own host work, not a wait for its router. ``launches``: where to add the host µs of
    each of its decode prefetch's predictor launches."""
    calls = []
    run = engine.run_layer
    launch = engine.prefetch.launch if launches is not None else None

    def timed_launch(*args):
        start = time.perf_counter()
        out = launch(*args)
        if out is not None:  # a layer with no target launches nothing
            launches.append((time.perf_counter() - start) * 1e6)
        return out

    def timed(l: int, hidden: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        sync(device)
        copies = sum(engine.cache.stats.copies.values())
        routed, fetching = _section_ms(engine, ROUTING_SECTION), _section_ms(engine, FETCH_SECTION)
        start = time.perf_counter()
        out = run(l, hidden, idx, weights)
        calls.append(_Call(engine.phase, len(idx), (time.perf_counter() - start) * 1e6,
                           sum(engine.cache.stats.copies.values()) - copies,
                           (_section_ms(engine, ROUTING_SECTION) - routed) * 1e3,
                           (_section_ms(engine, FETCH_SECTION) - fetching) * 1e3))
        return out

    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(vocab, (batch, s.contexts[0]), device=device)
    cache = cache_for(engine, model, s.contexts[0] + 8)
    with engine:
        # warm-up: CUDA graphs captured (a step graph at its second decode step)
        timed_generate(model, ids, torch.ones_like(ids), 3, fixed_length=True, cache=cache)
        engine.run_layer = timed  # this engine only: the plugin calls its instance's run_layer
        if launch is not None:
            engine.prefetch.launch = timed_launch
        try:
            timed_generate(model, ids, torch.ones_like(ids), 8, fixed_length=True, cache=cache)
        finally:
            del engine.run_layer
            if launch is not None:
                del engine.prefetch.launch
    return calls


def packed_experts(model, device: torch.device) -> tuple[list[HostExperts], tuple[int, int, int]]:
    """``model``'s routed experts taken into packed host stores (pinned where ``device`` is a GPU), the rest of it moved
    to ``device``: what an engine is made from; and its MoE geometry (L, E, k)."""
    layers = find_moe_layers(model)
    stores = take_experts(layers, lambda params: HostExperts.pack(params, pin=device.type == "cuda"))
    model.to(device)
    g = moe_geometry(model, layers)
    return stores, (len(layers), g.num_experts, g.top_k)


def _engine_host_us(model, s: ProfileSettings, device: torch.device, copy_us: float, calls: int = 20) -> dict:
    """Host microseconds of the engine's layer calls (the device idle when one starts, not waited for at its end):
    ``call``: a call whose experts are all cached (one compute group), by phase and tokens, a decode call's timed
    inside real generations (``_timed_calls``); ``fetch``: what each expert fetched on a miss adds, by cache size (a
    scanned cache and a heap-ranked one, ``cache.py``), also inside real generations; ``dequant_host``: what each
    dequantization pass of a quantized fetch adds, by expert dtype (the same calls over quantized stores);
    ``group``: what each compute group beyond a call's first adds (the prefill schedule's groups); ``launch``: the
    decode prefetch's predictor launch by batch (a ``duoserve`` engine with a random predictor, inside real
    generations); ``module``: the milliseconds of one expert fetched per module (``_module_fetch_ms``, from these
    experts in the per-module policies' pageable stores)."""
    stores, (L, E, k) = packed_experts(model, device)
    H, dtype = model.config.get_text_config().hidden_size, stores[0].layout.dtype
    nbytes = stores[0].layout.nbytes
    rng = np.random.default_rng(0)

    def call(engine, l: int, phase: str, ids: np.ndarray) -> tuple[float, float]:
        """Host µs of one call, and of its routing read."""
        T = len(ids)
        hidden = torch.randn(T, H, dtype=dtype, device=device)  # T x H
        weights = torch.full((T, k), 1.0 / k, dtype=dtype, device=device)  # T x k
        idx = torch.as_tensor(ids, device=device)  # T x k
        engine.phase = phase
        routed = _section_ms(engine, ROUTING_SECTION)
        us = _host_ms(lambda: engine.run_layer(l, hidden, idx, weights), device) * 1e3
        return us, (_section_ms(engine, ROUTING_SECTION) - routed) * 1e3

    def median(times: list[tuple]) -> tuple[float, float]:
        """The median host µs of calls (``call``'s pairs) and of their routing reads."""
        return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)

    def engine(slots: int, held: list[HostExperts] = stores) -> OffloadEngine:
        return OffloadEngine(model, held, POLICIES["lru"], settings=EngineSettings(
            gpu_expert_budget=slots * nbytes, step_graphs=s.step_graphs))

    def misses(held: list[HostExperts], slots: int) -> list[_Call]:
        """The decode calls with misses of a B=1 generation through a cache of ``slots`` over ``held``."""
        with torch.no_grad():
            calls = _timed_calls(engine(slots, held), model, s, 1, device)
        return [c for c in calls if c.phase == "decode" and c.fetched]

    # the same experts stored quantized (pinned on a GPU), each layer quantized on the device
    quantized = {fmt: [make_store(store.params(device), fmt, pin=device.type == "cuda") for store in stores]
                 for fmt in ("fp8", "int4")}
    chunk = max(stage_chunk(stores[0].layout), 1)  # experts a pass dequantizes

    modules = [HostExperts.as_modules(store.params("cpu")) for store in stores]  # the per-module policies' stores

    every = np.resize(np.arange(E), (-(-E // k), k))  # ceil(E/k) x k: each expert once

    def one_round() -> dict:
        """Every cost above, measured once."""
        hit_us = {}
        with torch.no_grad():
            cached = engine(L * E)
            with cached:
                for l in range(L):
                    call(cached, l, "prefill", every)  # every expert of every layer cached from here on
                for T in [*s.tokens, len(every)]:
                    times = [call(cached, 0, "prefill", random_ids(rng, T, 1, E, k)[:, 0]) for _ in range(calls + 2)]
                    hit_us["prefill", T] = median(times[2:])
            decoded = {B: [c for c in _timed_calls(cached, model, s, B, device) if c.phase == "decode"]
                       for B in s.batch_sizes}
        for B, timed in decoded.items():
            hit_us["decode", B] = median([(c.us, c.routing_us) for c in timed])
        entry_us = statistics.median(c.fetch_us for timed in decoded.values() for c in timed)  # nothing to fetch
        rows = [{"phase": phase, "tokens": T, "us": us, "routing_us": routing} for (phase, T), (us, routing)
                in sorted(hit_us.items()) if (phase, T) != ("prefill", len(every)) or T in s.tokens]

        launch_us = {}  # the engine's decode-time predictor launch, by batch
        with torch.no_grad():
            predicted = OffloadEngine(model, stores, POLICIES["duoserve"], random_predictor(L, E, k),
                                      settings=EngineSettings(step_graphs=s.step_graphs))
            for B in s.batch_sizes:
                launches: list[float] = []
                _timed_calls(predicted, model, s, B, device, launches)
                if launches:  # none where one MoE layer was built: nothing to predict
                    launch_us[B] = statistics.median(launches)

        fetch = []
        # a scanned cache (the default's, and the larger one over int4 experts) and a heap-ranked one
        sizes = {2 * k, default_capacity(POLICIES["duoserve"], E, k, 1, quantized["int4"][0]), 128}
        for slots in sorted(sizes & set(range(2 * k, L * E // 2 + 1))):
            timed = misses(stores, slots)
            # the engine's own fetch section of each call with misses, less its time with none: read in one call, not
            # a difference of two engines' whole calls (which read 3.9 and 53.5 us on one H100 minutes apart)
            spent = statistics.median((c.fetch_us - entry_us) / c.fetched for c in timed) if timed else 0.0
            fetch.append({"slots": slots, "us": max(spent, copy_us)})  # at least the copy's own queueing

        # a quantized fetch copies each expert as a plain one does (``fetch``'s cost an expert, the decode cache's)
        # and adds its dequantization passes' host work: what is left of its fetch section, per pass
        per_copy, dequant_host = fetch[0]["us"], {}
        for fmt, held in quantized.items():
            timed = misses(held, 2 * k)
            passes = [(max(c.fetch_us - entry_us - per_copy * c.fetched, 0.0), -(-c.fetched // chunk)) for c in timed]
            dequant_host[fmt] = statistics.median(us / n for us, n in passes) if passes else per_copy

        def group_us(ids: np.ndarray) -> float:
            """One prefill call of ``ids`` (every expert routed, none cached) through caches of 4k and k slots: the
            same E misses in groups of half of each cache (2k and k/2, or 1: fewer groups through the larger cache for
            any k). A group costs the difference over the difference in groups, what each expert costs (its fetch,
            its pair rows) cancelling; one call less a hit call and E decode-time fetches leaves that in (on an H100
            it read 1.0 ms a group where the bench's host sections showed 0.74)."""
            prefill = []
            for slots in (4 * k, k):
                with torch.no_grad(), engine(slots) as e:
                    times = [call(e, i % L, "prefill", ids) for i in range(calls + 2 * L)]
                    prefill.append((median(times[2 * L:])[0], -(-E // e.grouped.group_size(stores[0]))))
            (few_us, few), (many_us, many) = prefill
            return max((many_us - few_us) / (many - few), 0.0)

        # by the call's tokens, each expert routed by T*k/E of them: a group's host cost grows with its pairs (an H100
        # read 0.59 ms a group at E/k tokens and 0.71 at 64, on-demand, benchmarks/group_host_probe.py)
        by_tokens = [{"tokens": T, "us": group_us(np.resize(every, (T, k)))}
                     for T in [len(every), *(t for t in GROUP_TOKENS if t > len(every))]]
        return {"call": rows, "fetch": fetch, "dequant_host": dequant_host, "group": by_tokens[0]["us"],
                "group_by_tokens": by_tokens,
                "launch": launch_us,
                "module": _module_fetch_ms(OffloadEngine(model, modules, POLICIES["per-module"],
                                                         settings=EngineSettings(step_graphs=s.step_graphs)),
                                           modules, model, s, device)}

    rounds = [one_round() for _ in range(s.rounds)]
    return {**_median_of_rounds(rounds), "rounds": rounds}


def _median_of_rounds(rounds: list):
    """The element-wise median of measurements of one structure (dicts by key, lists by position); a value every
    round shares (a row's phase or tokens) is kept as it is."""
    first = rounds[0]
    if isinstance(first, dict):
        return {key: _median_of_rounds([r[key] for r in rounds]) for key in first}
    if isinstance(first, list):
        return [_median_of_rounds(list(items)) for items in zip(*rounds)]
    return first if all(r == first for r in rounds) else statistics.median(rounds)


def _module_fetch_ms(engine: OffloadEngine, stores: list[HostExperts], model, s: ProfileSettings,
                     device: torch.device) -> float:
    """One expert fetched from pageable per-module parameters (a blocking copy per parameter), timed inside a real
    generation of ``engine`` (a per-module policy's): each group of fetches, the device waited for before it and
    after it, per expert, the median. A prefill fetches nearly every expert of each layer in turn, from memory no
    cache holds (on the H200 the bench's per-module runs spent 1.45-1.69 ms per expert fetched where one copy timed
    alone took 1.33)."""
    times = []

    def timed(copy: Callable) -> Callable:
        def run(experts: list[int], *args) -> None:
            sync(device)
            start = time.perf_counter()
            copy(experts, *args)
            sync(device)
            times.append((time.perf_counter() - start) * 1e3 / len(experts))
        return run

    for store in stores:
        store.copy_group = timed(store.copy_group)  # this store only; removed below
    try:
        with torch.no_grad():
            _timed_calls(engine, model, s, 1, device)
    finally:
        for store in stores:
            del store.copy_group
    return statistics.median(times)


def profile(s: ProfileSettings, say: Callable[[str], None] = lambda text: None) -> dict:
    """Measure every field of the profile (module docstring) for ``s``'s model shape on its device."""
    device = resolve_device(s.device)
    meta = model_from_config(s.model, torch.device("meta"), s.dtype)  # the whole model's geometry, no memory
    full = moe_geometry(meta, find_moe_layers(meta))
    model = model_from_config(s.model, device, s.dtype, s.layers)
    layers = find_moe_layers(model)
    params = {n: p.detach() for n, p in expert_params(layers[0].experts).items()}
    store = HostExperts.pack(params, pin=device.type == "cuda")
    nbytes = store.layout.nbytes
    H = model.config.get_text_config().hidden_size
    pace: dict[str, float] = {}  # the host's us per op, sampled before each section (and once at the end)

    def section(text: str) -> None:
        pace[text] = host_op_us(device)
        say(text)

    section("copy bandwidth by size")
    sizes = sorted({int(mb * MB) for mb in s.copy_mb} | {nbytes})
    copy = [{"bytes": n, **copy_bandwidth(device, n)} for n in sizes]
    section("host cost of queueing a copy")
    host_us = _copy_host_us(store, device)
    section("a predictor's decode call")
    predictor_ms = _predictor_ms(full.num_layers, full.num_experts, full.top_k, s, device)

    section("the engine's expert compute by tokens")
    with torch.no_grad():
        expert_ms = _expert_ms(layers[0], store, s, full.top_k, device, H)

    section("dequantizing experts as the engine does")
    dequant_ms = {fmt: _dequant_ms(make_store({n: p.to(device) for n, p in params.items()}, fmt, pin=False),
                                   device, s.repeats) for fmt in ("fp8", "int4")}

    section("the model's passes without their experts")
    shallow = model_from_config(s.model, device, s.dtype, 1)
    passes = {depth: _pass_ms(net, s, say) for depth, net in ((1, shallow), (s.layers, model))}
    del shallow
    layer_ms, step_ms = [], []
    for one, deep in zip(passes[1], passes[s.layers]):
        # host time per layer from the layers' own clocks (a fit of two depths' walls is within their noise on a
        # host-bound pass); device time from the two depths' kernel times
        per_layer = {key: max((deep[key] - one[key]) / (s.layers - 1), 0.0)
                     for key in ("decode_device_ms", "prefill_device_ms")}
        per_layer.update({key: deep[f"layer_{key}"] for key in ("decode_ms", "prefill_ms")})
        step_ms.append({"batch": one["batch"], "context": one["context"],
                        **{key: max(one[key] - per_layer[key], 0.0) for key in per_layer}})
        per_layer.update({key: deep[f"layer_{key}"] for key in ("decode_before_ms", "prefill_before_ms")})
        layer_ms.append({"batch": one["batch"], "context": one["context"], **per_layer})

    section("host cost of the engine's calls")
    engine_us = _engine_host_us(model, s, device, host_us)
    pace["end"] = host_op_us(device)
    measured = {"profile_version": PROFILE_VERSION, "device": device_name(device), "model": s.model,
                "dtype": str(store.layout.dtype), "measured_layers": s.layers,
                "step_graphs": s.step_graphs and device.type == "cuda",
                "geometry": {"moe_layers": full.num_layers, "experts": full.num_experts, "top_k": full.top_k,
                             "hidden_size": H, "expert_bytes": nbytes},
                "copy": copy, "copy_host_us": host_us, "expert_ms": expert_ms, "predictor_ms": predictor_ms,
                "dequant_ms": dequant_ms, "layer_ms": layer_ms, "step_ms": step_ms,
                "host_op_us": {"median": statistics.median(pace.values()), "min": min(pace.values()),
                               "max": max(pace.values()), "sections": pace},
                "engine_rounds": engine_us.pop("rounds")}
    return _with_engine_costs(measured, engine_us)


def _with_engine_costs(profile: dict, engine_us: dict) -> dict:
    """``profile`` with the engine's host costs of ``_engine_host_us`` (or of one of its rounds) in its fields."""
    launch = {int(B): us for B, us in engine_us["launch"].items()}  # a round read back from JSON has string keys
    predictor_ms = [{**row, **({"launch_host_ms": launch[row["batch"]] / 1e3} if row["batch"] in launch else {})}
                    for row in profile["predictor_ms"]]
    optional = {field: engine_us[key] for field, key in (("group_host_by_tokens", "group_by_tokens"),
                                                          ("dequant_host_us", "dequant_host")) if key in engine_us}
    return {**profile, "call_host_us": engine_us["call"], "fetch_host_us": engine_us["fetch"],
            "group_host_us": engine_us["group"], **optional, "module_copy_ms": engine_us["module"],
            "predictor_ms": predictor_ms}


def profile_round(profile: dict, i: int) -> dict:
    """``profile`` with the engine's host costs of its round ``i`` alone, not the rounds' medians: what a single-round
    profile of that moment would have read (``benchmarks/simulate_validation.py --round``)."""
    rounds = profile.get("engine_rounds") or []
    if not 0 <= i < len(rounds):
        raise ValueError(f"this profile kept {len(rounds)} rounds of the engine's costs; there is no round {i}")
    return _with_engine_costs(profile, rounds[i])


def _pass_ms(model, s: ProfileSettings, say: Callable[[str], None]) -> list[dict]:
    """Wall and device milliseconds of a whole decode step and a whole prefill of ``model``, its routed experts
    answering zeros, by batch size and context length; and each decoder layer's host time inside them
    (``layer_decode_ms``, ``layer_prefill_ms``: the median over every layer of every timed pass, from its forward
    hooks: nothing in a layer waits for the device, so this is what the host spends launching it), and the part of
    it before the layer's experts call (``layer_decode_before_ms``, ``layer_prefill_before_ms``)."""
    depth = model.config.get_text_config().num_hidden_layers
    vocab = model.get_input_embeddings().num_embeddings
    device = next(model.parameters()).device
    rows = []
    plugin = _NoExperts(model)
    if s.step_graphs and device.type == "cuda":
        plugin.graph_steps()
    with plugin, _LayerClock(model.get_decoder().layers) as clock:
        plugin.called = clock.split
        for B in s.batch_sizes:
            for C in s.contexts:
                say(f"{depth} layers without experts, B={B} C={C}")
                ids = torch.randint(vocab, (B, C), device=device)
                mask = torch.ones_like(ids)
                cache = cache_for(plugin, model, C + 8)

                def generate(n: int) -> dict:
                    return timed_generate(model, ids, mask, n, fixed_length=True, cache=cache)[1]

                generate(3)  # warm-up: with step graphs, its second decode step captures them
                clock.reset()
                timings = [generate(8) for _ in range(s.repeats)]
                row = {"batch": B, "context": C, "decode_ms": statistics.median(t["tpot_ms"] for t in timings),
                       "prefill_ms": statistics.median(t["ttft_s"] * 1e3 for t in timings),
                       **{f"layer_{phase}_ms": statistics.median(ms) for phase, ms in clock.times.items()},
                       **{f"layer_{phase}_before_ms": statistics.median(ms) for phase, ms in clock.before.items()}}
                if device.type == "cuda":  # kernel time of a prefill alone, and of it with 7 decode steps
                    prefill, both = _kernel_ms(lambda: generate(1)), _kernel_ms(lambda: generate(8))
                    row.update(prefill_device_ms=prefill, decode_device_ms=max(both - prefill, 0.0) / 7)
                else:
                    row.update(prefill_device_ms=row["prefill_ms"], decode_device_ms=row["decode_ms"])
                rows.append(row)
    return rows


class _LayerClock:
    """Forward hooks that time each decoder layer's call on the host, by phase (a pass of more than one token per
    sequence is a prefill), and the part of it before its experts call (``split``, called as that starts: a layer
    replayed from step graphs launches its kernels before it at once); removed on exit."""

    def __init__(self, layers):
        self.layers = layers
        self.reset()

    def reset(self) -> None:
        self.times, self.before = {"prefill": [], "decode": []}, {"prefill": [], "decode": []}
        self._start = self._split = None

    def split(self) -> None:
        self._split = time.perf_counter()

    def __enter__(self):
        def begin(module, args, kwargs):
            self._start, self._split = time.perf_counter(), None

        def end(module, args, kwargs, output):
            hidden = args[0] if args else kwargs["hidden_states"]  # B x S x H
            phase, now = "prefill" if hidden.shape[1] > 1 else "decode", time.perf_counter()
            self.times[phase].append((now - self._start) * 1e3)
            self.before[phase].append(((self._split or now) - self._start) * 1e3)

        self._hooks = [h for layer in self.layers for h in (layer.register_forward_pre_hook(begin, with_kwargs=True),
                                                            layer.register_forward_hook(end, with_kwargs=True))]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()


def _kernel_ms(fn: Callable[[], None]) -> float:
    """Milliseconds the device spent in kernels and copies while ``fn`` ran (torch's profiler)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA) / 1e3


def _predictor_ms(L: int, E: int, k: int, s: ProfileSettings, device: torch.device) -> list[dict]:
    """Host and wall milliseconds of one decode-time predictor call (scores of one target, its top-k), by batch."""
    predictor = TrainedPredictor(random_predictor(L, E, k), device, compile=True)  # as the engine deploys it
    rows = []
    for B in s.batch_sizes:
        history = predictor.history(B, device)  # B x L x k: the buffer its graphs read, as the engine's prefetch
        history.random_(E)

        def call() -> None:
            predictor.top(history, L - 1, k, depth=1)

        host = [_host_ms(call, device) for _ in range(s.repeats + 1)]
        rows.append({"batch": B, "host_ms": statistics.median(host[1:]),
                     "wall_ms": _median_ms(call, device, s.repeats)})
    return rows


def load_profile(path: str | Path) -> dict:
    """A profile file, refused with what is wrong if it is not one this version reads or misses a field (version 2
    is read: its ``dequant_ms`` overstates the engine's, which ``duoserve-eval simulate`` says)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read a device profile from {path}: {err}") from err
    if not isinstance(data, dict) or data.get("profile_version") not in READABLE_PROFILE_VERSIONS:
        found = data.get("profile_version") if isinstance(data, dict) else None
        *older, newest = map(str, READABLE_PROFILE_VERSIONS)
        versions = f"{', '.join(older)} or {newest}"
        raise ValueError(f"{path} is not a device profile of version {versions} (profile_version: {found}); make one "
                         f"with duoserve-run profile")
    missing = [f for f in PROFILE_FIELDS if data.get(f) in (None, [], {})]  # a cost measured as 0 is a cost
    if missing:
        raise ValueError(f"device profile {path} lacks {', '.join(missing)}; make it again with duoserve-run profile")
    return data

