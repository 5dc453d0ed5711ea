"""Expert compute over the cache's slots, with the (token, expert) pairs grouped on the host.

transformers' grouped_mm experts function cannot see the routing, so it groups the pairs on the
device: a sort, a histogram, a cumulative sum, masks and a permutation back, about 40 launches per
call with the two GEMMs. The engine has read the routing to the host already (it must, to know
what to copy), so it sorts the pairs there and uploads them with the grouped GEMMs' offsets in one
copy (``Routing.rows``); what is left on the device is two gathers, two grouped GEMMs, the gate, the
weighting and one scatter-add. A decode step is short of host time, not of GPU time: launches count.

The GEMMs are transformers' own ``_grouped_linear`` (grouped_mm, or its fallback where grouped_mm
cannot run), and the gate is the module's own ``_apply_gate``, so an experts class keeps its
layout, activation, biases and post-expert norm.

A decode call computes all of its T*k pairs in one group, so its shapes repeat from step to step; on a
GPU where the grouped GEMM runs without reading the offsets on the host (bf16 on sm90/sm100, where
torch's grouped_mm has its own kernel), ``GraphedSlotExperts`` captures that group once per (layer,
T) as a CUDA graph and replays it: five launches (three input copies, the replay, a copy of the output)
where the group takes some 15, in host time, which a decode step is short of.

A grouped GEMM takes at most ``MAX_GROUPS`` groups (torch's CUDA kernel refuses more), and its groups
are cache slots, so a cache of more slots (a large ``--gpu-expert-budget``) runs each call as one GEMM
pair per window of ``MAX_GROUPS`` consecutive slots that holds pairs: the rows' offsets count from the
window's first pair, and the host, which built them, knows where each window's pairs lie. Such
caches run their decode calls eagerly (no CUDA graph: which windows a call needs changes per call).

Shape legend: T tokens, H hidden size, S cache slots, n (token, expert) pairs of a group, I expert width.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from transformers.integrations.moe import _grouped_linear

from duoserve.runtime.cache import ExpertCache
from duoserve.runtime.streams import EngineTimers, Streams

# groups one grouped GEMM takes: torch's CUDA kernel checks group_count < 1024 (a call over exactly 1,024 slots
# failed on an H100); applied on every device alike
MAX_GROUPS = 1023
Window = tuple[int, int, int, int]  # slots s0..s1-1 and their pairs p0..p1-1 in a call's rows

# pairs (T*k) up to which a call's routing is sorted with plain lists: a decode call's few dozen pairs, where
# numpy's fixed cost per call outweighs the work (docs/benchmarks.md gives the measured crossover)
SMALL_CALL = 128


class Routing:
    """A layer call's routing, read to the host once: which experts, and its (token, expert) pairs by expert."""

    def __init__(self, idx: torch.Tensor | np.ndarray, num_experts: int, small_call: int = SMALL_CALL):
        # T x k; the one wait for the router (a simulator's routing is a host array already)
        self.ids = idx if isinstance(idx, np.ndarray) else idx.cpu().numpy()
        self._flat: list[int] | None = None  # T*k ids of a small call (at most ``small_call`` pairs), as a list
        if self.ids.size <= small_call:
            self._flat = self.ids.reshape(-1).tolist()
            self.needed: list[int] = sorted(set(self._flat))
            return
        # 8- or 16-bit ids: numpy's stable sort is then a radix sort; on int64 it is a merge sort, slow enough at a
        # long prefill that the copy stream would sit it out at every layer boundary
        narrow = self.ids.reshape(-1).astype(np.min_scalar_type(num_experts - 1))  # T*k
        self.counts = np.bincount(narrow, minlength=num_experts)  # E: pairs of each expert
        self.needed = np.flatnonzero(self.counts).tolist()
        self._order = np.argsort(narrow, kind="stable")  # T*k flat positions in expert order
        self._starts = np.concatenate([[0], np.cumsum(self.counts)])  # E + 1: expert e owns _order[starts[e]:starts[e+1]]

    def pair_counts(self, experts) -> list[int]:
        """The (token, expert) pairs of each of ``experts`` in this call."""
        if self._flat is not None:
            flat = self._flat
            if len(self.ids) == 1:  # one token routes to each of its k experts once (a B=1 decode call)
                return [1] * len(experts)
            return [flat.count(e) for e in experts]
        return self.counts[list(experts)].tolist()

    def rows(self, slots: dict[int, int], num_slots: int) -> np.ndarray:
        """int32 [token (n), flat routing position token * k + j (n), slot (n), offsets (S)]: the pairs of ``slots``'
        experts (expert -> cache slot) sorted by slot, and the cumulative pair count of each slot, counted from the
        first pair of its window of ``MAX_GROUPS`` slots (from the first pair of all when S <= MAX_GROUPS)."""
        k = self.ids.shape[1]
        if self._flat is not None:
            pairs = sorted((slots[e], p) for p, e in enumerate(self._flat) if e in slots)  # (slot, flat position)
            flat, slot = [p for _, p in pairs], [s for s, _ in pairs]  # n, n
            if num_slots <= SMALL_CALL:  # one window, and lists beat numpy's fixed cost
                per_slot = [0] * num_slots  # S
                for s in slot:
                    per_slot[s] += 1
                return np.array([p // k for p in flat] + flat + slot + list(itertools.accumulate(per_slot)),
                                dtype=np.int32)
            head = np.array([p // k for p in flat] + flat + slot, dtype=np.int32)  # 3n
            return np.concatenate([head, _window_offsets(head[2 * len(flat):], num_slots)])
        by_slot = sorted(slots.items(), key=lambda item: item[1])
        experts = [e for e, _ in by_slot]
        flat = np.concatenate([self._order[self._starts[e]:self._starts[e + 1]] for e in experts])  # n
        slot = np.repeat([s for _, s in by_slot], self.counts[experts])  # n, in slot order
        return np.concatenate([flat // k, flat, slot, _window_offsets(slot, num_slots)]).astype(np.int32)


def _window_offsets(slot: np.ndarray, num_slots: int) -> np.ndarray:
    """S cumulative pair counts of ``slot`` (the n pairs' slots, sorted), each counted from the first pair of its
    window of ``MAX_GROUPS`` slots: one pass in C, as a cache may hold thousands of slots."""
    upto = np.searchsorted(slot, np.arange(num_slots), side="right")  # S: pairs in slots <= s
    starts = np.arange(0, num_slots, MAX_GROUPS)  # first slot of each window
    before = np.searchsorted(slot, starts, side="left")  # pairs before each window
    return (upto - np.repeat(before, np.diff(np.append(starts, num_slots)))).astype(np.int32)


def slot_windows(rows: np.ndarray, num_slots: int) -> list[Window] | None:
    """Where each window of ``MAX_GROUPS`` slots with pairs lies in ``Routing.rows``; None when one group call takes
    every slot (S <= MAX_GROUPS)."""
    if num_slots <= MAX_GROUPS:
        return None
    offsets = rows[len(rows) - num_slots:]  # S, counted within each window
    windows, start = [], 0
    for s0 in range(0, num_slots, MAX_GROUPS):
        s1 = min(s0 + MAX_GROUPS, num_slots)
        count = int(offsets[s1 - 1])
        if count:
            windows.append((s0, s1, start, start + count))
        start += count
    return windows


def add_slot_experts(experts, hidden: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, num_slots: int,
                     out: torch.Tensor, windows: list[Window] | None = None) -> None:
    """Add to ``out`` (T x H, fp32) the routing-weighted outputs of the pairs in ``rows`` (``Routing.rows`` on the
    device). ``experts``: the experts module as its kernels see it, with the cache's S slots as its experts.
    ``windows`` (``slot_windows``): one call per window of slots, for caches of more than ``MAX_GROUPS`` slots."""
    n = (rows.numel() - num_slots) // 3
    token, flat, slot, offsets = rows[:n], rows[n:2 * n], rows[2 * n:3 * n], rows[3 * n:]  # n, n, n, S
    if windows is None:
        _add_group(experts, hidden, weights, token, flat, slot, offsets, out)
        return
    up = "gate_up_proj" if experts.has_gate else "up_proj"
    for s0, s1, p0, p1 in windows:
        window = SlotView(experts, {name: getattr(experts, name)[s0:s1] for name in (up, "down_proj")}, s1 - s0)
        _add_group(window, hidden, weights, token[p0:p1], flat[p0:p1], slot[p0:p1], offsets[s0:s1], out)


def _add_group(experts, hidden: torch.Tensor, weights: torch.Tensor, token: torch.Tensor, flat: torch.Tensor,
               slot: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor) -> None:
    """One grouped GEMM pair over ``experts``' slots for the n pairs given (``slot``: cache slots, for biases)."""
    up = "gate_up_proj" if experts.has_gate else "up_proj"
    # index_select takes the int32 rows as they are; indexing would convert them to int64 first (two more launches)
    h = _grouped_linear(hidden.index_select(0, token), getattr(experts, up), offsets, bias=_bias(experts, up, slot),
                        is_transposed=experts.is_transposed)  # n x 2I (gated) or n x I
    h = experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)  # n x I
    y = _grouped_linear(h, experts.down_proj, offsets, bias=_bias(experts, "down_proj", slot),
                        is_transposed=experts.is_transposed)  # n x H
    if getattr(experts, "has_post_expert_norm", False):  # transformers >= 5.2x
        y = experts.post_expert_norm(y)
    out.index_add_(0, token, (y * weights.reshape(-1).index_select(0, flat).unsqueeze(-1)).float())  # n x H into T x H


def slot_experts(experts, hidden: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor,
                 num_slots: int, windows: list[Window] | None = None) -> torch.Tensor:
    """The T x H output, in the hidden states' dtype, of the pairs in ``rows`` (``add_slot_experts`` into a fresh
    fp32 sum): a call whose pairs are all in one group (per window of slots, given ``windows``)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # T x H
    add_slot_experts(experts, hidden, weights, rows, num_slots, out, windows)
    return out.to(hidden.dtype)


def _bias(experts, name: str, slot: torch.Tensor) -> torch.Tensor | None:
    return getattr(experts, f"{name}_bias").index_select(0, slot) if experts.has_bias else None  # n x width


def graphs_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``add_slot_experts`` can be captured in a CUDA graph: torch's grouped GEMM has a kernel of its own
    only for bf16 on sm90/sm100; elsewhere it falls back to a loop that reads the offsets on the host."""
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)


class GraphedSlotExperts:
    """``add_slot_experts`` over every pair of a call, replayed from a CUDA graph per (layer, input shapes).

    Inputs are copied into static buffers shared by all graphs (replays run one after another on one stream);
    the pair rows go through a reused pinned buffer. Each graph is one ``slot_experts`` call, and the caller gets
    a copy of its output, which the next replay of that graph overwrites.
    """

    def __init__(self, num_slots: int, device: torch.device):
        self.num_slots, self.device = num_slots, device
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool: the graphs never run at the same time
        self._inputs: dict[tuple, tuple] = {}  # shapes -> (hidden, weights, rows on device, rows pinned, event)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (layer, shapes) -> (graph, out)

    def load(self, hidden: torch.Tensor, weights: torch.Tensor, rows: np.ndarray) -> tuple:
        """Queue the copies of a call's inputs into the static buffers of their shapes (on the current stream)."""
        key = (tuple(hidden.shape), hidden.dtype, tuple(weights.shape), weights.dtype, len(rows))
        if key not in self._inputs:
            self._inputs[key] = (torch.empty_like(hidden), torch.empty_like(weights),
                                 torch.empty(len(rows), dtype=torch.int32, device=self.device),
                                 torch.empty(len(rows), dtype=torch.int32, pin_memory=True), torch.cuda.Event())
        h, w, rows_device, rows_host, uploaded = self._inputs[key]
        uploaded.synchronize()  # the last upload from the pinned buffer has been read (long done: a layer ago)
        rows_host.numpy()[:] = rows
        rows_device.copy_(rows_host, non_blocking=True)
        uploaded.record()
        h.copy_(hidden)
        w.copy_(weights)
        return key

    def run(self, layer: int, experts, key: tuple) -> torch.Tensor:
        """The T x H output (in the hidden states' dtype) of the inputs ``load`` queued under ``key``."""
        if (layer, key) not in self._graphs:
            self._graphs[layer, key] = self._capture(experts, *self._inputs[key][:3])
        graph, out = self._graphs[layer, key]
        graph.replay()
        return out.clone()

    def _capture(self, experts, hidden: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor) -> tuple:
        warm = torch.cuda.Stream(self.device)  # lazy initialisation (cuBLAS handles, ...) stays out of the graph
        warm.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(warm):
            slot_experts(experts, hidden, weights, rows, self.num_slots)
        torch.cuda.current_stream(self.device).wait_stream(warm)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = slot_experts(experts, hidden, weights, rows, self.num_slots)
        return graph, out


class SlotView:
    """An experts module as its kernels see it, with the cache's slots in place of its experts."""

    def __init__(self, module: nn.Module, weights: dict[str, torch.Tensor], count: int):
        self.__dict__.update(_module=module, _weights=weights, num_experts=count)

    def __getattr__(self, name: str):
        weights = self.__dict__["_weights"]
        return weights[name] if name in weights else getattr(self.__dict__["_module"], name)


class PairRows(NamedTuple):
    """A group's pair rows (``Routing.rows``) on the device and where its slot windows lie (``slot_windows``)."""

    rows: torch.Tensor
    windows: list[Window] | None


class SlotCompute:
    """The engine's expert compute: each MoE layer's experts modules (``modules``) run over the cache's slots,
    their pair rows uploaded from the host, a one-group call replayed from a CUDA graph where ``graphs`` allows
    (and the cache has at most ``MAX_GROUPS`` slots)."""

    def __init__(self, modules: list[nn.Module], cache: ExpertCache, streams: Streams, timers: EngineTimers,
                 graphs: bool):
        self.cache, self.streams, self.timers = cache, streams, timers
        self.views = [SlotView(m, cache.views, cache.slots) for m in modules]
        graphs = graphs and cache.slots <= MAX_GROUPS
        self.graphs = GraphedSlotExperts(cache.slots, streams.device) if graphs else None

    def upload(self, rows: np.ndarray, stream=None) -> PairRows:
        """A group's pair rows on the device, queued on ``stream`` (default: the current one) without blocking the
        host, for the compute stream to read."""
        t = torch.from_numpy(rows)
        if self.streams.cuda:
            # no stream switch where none is asked for (the decode step's uploads)
            with self.streams.on(stream) if stream is not None else contextlib.nullcontext():
                t = t.pin_memory().to(self.streams.device, non_blocking=True)
            if stream is not None and stream is not self.streams.compute:  # allocated there, read on compute
                t.record_stream(self.streams.compute)
        return PairRows(t, slot_windows(rows, self.cache.slots))

    def load_all(self, hidden: torch.Tensor, weights: torch.Tensor, routing: Routing,
                 slots: dict[int, int]) -> tuple | PairRows:
        """Queue the upload of a one-group call's pair rows (``slots``: expert -> slot), with the call's other inputs
        where it is replayed from a CUDA graph; what ``compute_all`` takes. Called before the call's prefetch:
        host-to-device copies run in issue order, so rows queued behind layer l+1's copies would hold layer l's
        compute, and the host's next routing read with it, until those copies land."""
        with self.timers.cpu("queue compute"):
            rows = routing.rows(slots, self.cache.slots)
            return self.graphs.load(hidden, weights, rows) if self.graphs is not None else self.upload(rows)

    def compute_all(self, l: int, hidden: torch.Tensor, weights: torch.Tensor, inputs: tuple | PairRows,
                    slots: dict[int, int]) -> torch.Tensor:
        """T x H output of every pair of the call, its experts resident in ``slots`` (expert -> slot) and its inputs
        loaded by ``load_all``: one group, replayed from a CUDA graph where they run."""
        with self.timers.stall.span():
            self.cache.wait_ready(slots.values())
        with self.timers.cpu("queue compute"):
            out = self.graphs.run(l, self.views[l], inputs) if self.graphs is not None \
                else slot_experts(self.views[l], hidden, weights, inputs.rows, self.cache.slots, inputs.windows)
            self.cache.release(list(slots.values()))
        return out

    def add_group(self, l: int, hidden: torch.Tensor, weights: torch.Tensor, rows: PairRows,
                  slots: dict[int, int], out: torch.Tensor) -> None:
        """Add the output of the resident experts ``slots`` (expert -> slot) for their pairs (``rows``) to ``out``."""
        add_slot_experts(self.views[l], hidden, weights, rows.rows, self.cache.slots, out, rows.windows)
        self.cache.release(list(slots.values()))
