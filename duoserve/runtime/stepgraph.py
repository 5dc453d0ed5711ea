"""A decode step's work outside the experts, replayed from CUDA graphs: one graph per stretch between experts calls.

Shape legend: B sequences, H hidden size.

An offloaded decode step at B=1 is bound by the host: a transformers decoder layer run eagerly takes about 1.6 ms of
host time to launch its kernels on the H200, more than the 1.4 ms a Qwen3-30B-A3B layer's expert copies take
(docs/runtime.md). The experts calls must stay on the host (the engine reads the routing and decides the copies), so
the step is graphed piecewise, as vLLM's piecewise CUDA graphs are: a decoder layer's work before, between and after
its experts calls is captured once and replayed, and the experts calls run the engine in between.

A layer is graphed only where its graphs stay valid: in decode, on a static KV cache (transformers' ``StaticCache``,
whose tensors the graphs address; ``generation.kv_cache`` makes one to reuse across generations) with no
sliding-window layer (``graphable``). Its first decode call with a new signature (the shapes of its tensor
arguments, the identity of the others) runs eagerly as a warm-up, the second is captured, later ones replay: a
tensor argument is copied into its captured input unless it is one already (the previous layer's output) or was
copied for an earlier layer of the step (the mask, the rotary tables), each graph is replayed, and each experts
call's output copied into the tensor the next graph reads.

Each decoder layer's ``forward`` is wrapped per instance (as Accelerate's hooks wrap a module's forward); leaving the
``with`` restores it and frees the graphs.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

# experts(module, hidden T x H, top_k_index T x k, top_k_weights T x k) -> T x H: the engine's experts call
Experts = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def decoder_layers(model: nn.Module, moe_name: str, decoder_index: int) -> nn.ModuleList:
    """The module list of ``model``'s decoder layers, found from one MoE layer's experts module path (its decoder
    index is the path's last number, as ``discovery`` reads it)."""
    head = f".{moe_name}.".rpartition(f".{decoder_index}.")[0].lstrip(".")
    layers = model.get_submodule(head)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{head!r} is not a list of decoder layers ({type(layers).__name__})")
    return layers


def graphable(cache: object) -> bool:
    """Whether a layer call on ``cache`` can be replayed: a static KV cache whose every layer keeps its position on
    the device (``StaticLayer``). A sliding-window layer decides on a host-side count whether its window is full,
    which a graph would freeze at the count it was captured at."""
    return isinstance(cache, StaticCache) and all(type(layer) is StaticLayer for layer in cache.layers)


def _flatten(args: tuple, kwargs: dict) -> tuple[list, object]:
    # tuples, lists and dicts opened; anything else (a tensor, the KV cache, a flag) is one leaf
    return tree_flatten((args, kwargs), is_leaf=lambda v: not isinstance(v, (tuple, list, dict)))


def _signature(leaves: list) -> tuple:
    return tuple(("tensor", tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor)
                 else ("value", x) if isinstance(x, (bool, int, float, str, type(None))) else ("object", id(x))
                 for x in leaves)


@dataclass
class _Graphed:
    """One decoder layer's captured decode call: graphs and experts calls in turn, graph first and last."""

    signature: tuple
    inputs: list  # per argument leaf: the tensor the graphs read, or None for a leaf that is not a tensor
    pieces: list = field(default_factory=list)  # CUDA graphs
    calls: list = field(default_factory=list)  # (module, hidden, idx, weights, out) of each experts call
    output: object = None


class StepGraphs:
    """Graph the decode calls of ``layers`` (a model's decoder layers, on CUDA ``device``) piecewise around the
    experts calls, which ``experts`` runs; ``active()`` says whether the forward under way is a decode step.

    ``experts_call`` is what the model's experts interface must call (it splits the graph being captured). The
    counters ``captured`` (layer calls captured) and ``replayed`` (layer calls replayed) say what ran graphed, and
    ``replaying`` whether the layer call under way is a replay.
    """

    def __init__(self, layers: nn.ModuleList, experts: Experts, active: Callable[[], bool],
                 device: torch.device | str):
        self.layers, self.experts, self.active = layers, experts, active
        self.device = torch.device(device)
        self.captured = self.replayed = 0
        self.replaying = False

    def __enter__(self):
        self._pool = self._stream = None  # made at the first capture
        self._graphs: list[_Graphed | None] = [None] * len(self.layers)
        self._warm: list[tuple | None] = [None] * len(self.layers)
        self._capture: _Graphed | None = None
        self._on_stream = None  # the side stream's context while a piece is being captured
        self._cache: tuple[object, bool] = (None, False)  # the last KV cache seen, and whether it is graphable
        self._outputs: dict[int, torch.Tensor] = {}  # id -> a graph's output, read by the next layer's graphs as is
        self._shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(argument) -> (argument, its input)
        self._source: dict[int, torch.Tensor] = {}  # id(input) -> the argument last copied into it
        self._own = [layer.__dict__.get("forward") for layer in self.layers]  # a forward already wrapped (Accelerate)
        for i, layer in enumerate(self.layers):
            layer.forward = functools.partial(self._forward, i, layer.forward)
        return self

    def __exit__(self, *exc) -> None:
        for layer, own in zip(self.layers, self._own):
            if own is None:
                del layer.forward
            else:
                layer.forward = own
        self._graphs = self._warm = []
        self._outputs, self._shared, self._source = {}, {}, {}
        self._pool = self._stream = None
        self._cache = (None, False)

    def experts_call(self, module: nn.Module, hidden: torch.Tensor, idx: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
        """The experts call of ``module``: the engine's, and while a layer is being captured the end of one graph
        and the start of the next."""
        if self._capture is None:
            return self.experts(module, hidden, idx, weights)
        graphed = self._capture
        self._end_piece()  # replayed: hidden, idx and weights now hold this step's values
        out = self.experts(module, hidden, idx, weights).clone()  # T x H, outside the graphs' pool
        graphed.calls.append((module, hidden, idx, weights, out))
        self._begin_piece()
        return out

    def _graphable(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call's arguments hold a KV cache its graphs can address (``graphable``; asked once a cache)."""
        cache = next((x for x in (*args, *kwargs.values()) if isinstance(x, StaticCache)), None)
        if cache is not None and self._cache[0] is not cache:
            self._cache = (cache, graphable(cache))
        return cache is not None and self._cache[1]

    def _forward(self, i: int, forward: Callable, *args, **kwargs):
        if not self.active() or not self._graphable(args, kwargs):
            return forward(*args, **kwargs)
        leaves, spec = _flatten(args, kwargs)
        signature = (spec, _signature(leaves))
        graphed = self._graphs[i]
        if graphed is not None and graphed.signature == signature:
            return self._replay(graphed, leaves)
        if self._warm[i] != signature:  # first call of its kind: eager, so capture finds everything initialised
            self._warm[i] = signature
            return forward(*args, **kwargs)
        return self._capture_layer(i, forward, leaves, spec, signature)

    def _input(self, x):
        """The tensor a captured graph reads for argument ``x``: a graph's output as it is, an argument another
        layer's capture copied already its copy, else a new copy."""
        if not isinstance(x, torch.Tensor):
            return None
        if self._outputs.get(id(x)) is x:
            return x
        shared = self._shared.get(id(x))
        if shared is not None and shared[0] is x:
            return shared[1]
        static = x.clone()
        self._shared[id(x)], self._source[id(static)] = (x, static), x
        return static

    def _capture_layer(self, i: int, forward: Callable, leaves: list, spec, signature: tuple):
        inputs = [self._input(x) for x in leaves]
        args, kwargs = tree_unflatten([x if s is None else s for x, s in zip(leaves, inputs)], spec)
        graphed = self._capture = _Graphed(signature, inputs)
        # no garbage collection while capturing: a collection that destroys another CUDA graph (an engine dropped in a
        # reference cycle holds its step graphs) invalidates the capture ("operation not permitted when stream is
        # capturing"), as pytorch/pytorch#161037 found for torch.cuda.graph
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._begin_piece()
            out = forward(*args, **kwargs)
            self._end_piece()
        except Exception as exc:
            if self._on_stream is None:  # raised by the experts call between two pieces: not the capture's doing
                raise
            with contextlib.suppress(RuntimeError):  # a capture the error invalidated ends with an error of its own
                graphed.pieces[-1].capture_end()
            self._leave_stream()
            raise RuntimeError(f"decoder layer {i}'s decode step could not be captured in a CUDA graph ({exc}); run "
                               "with --no-step-graphs (EngineSettings(step_graphs=False))") from exc
        finally:
            self._capture = None
            if collecting:
                gc.enable()
        graphed.output = out
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                self._outputs[id(x)] = x
        self._graphs[i] = graphed
        self.captured += 1
        return out

    def _begin_piece(self) -> None:
        if self._stream is None:
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._on_stream = torch.cuda.stream(self._stream)  # capture on a side stream, as torch.cuda.graph does
        self._on_stream.__enter__()
        self._capture.pieces.append(graph)
        graph.capture_begin(pool=self._pool)

    def _leave_stream(self) -> None:
        self._on_stream.__exit__(None, None, None)
        self._on_stream = None

    def _end_piece(self) -> None:
        graph = self._capture.pieces[-1]
        graph.capture_end()
        self._leave_stream()
        graph.replay()  # on the caller's stream

    def _replay(self, graphed: _Graphed, leaves: list):
        for static, x in zip(graphed.inputs, leaves):
            if static is None or x.data_ptr() == static.data_ptr() or self._source.get(id(static)) is x:
                continue
            static.copy_(x)
            self._source[id(static)] = x
        self.replaying = True
        try:
            for piece, (module, hidden, idx, weights, out) in zip(graphed.pieces, graphed.calls):
                piece.replay()
                out.copy_(self.experts(module, hidden, idx, weights))
        finally:
            self.replaying = False
        graphed.pieces[-1].replay()
        self.replayed += 1
        return graphed.output
