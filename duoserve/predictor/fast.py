"""Low-latency inference for a trained predictor: BatchNorm folded, a sparse first layer, CUDA-graph replay.

At batch 1 the predictor is launch-bound and its first layer dominates the bytes: a dense
(W*E) x 2048 GEMM over a multi-hot input with only W*k ones. Folding BatchNorm removes a third of
the kernels; reading only the first layer's columns of the active (layer, expert) pairs, as an
embedding bag, removes the multi-hot and most of the weight traffic; replaying a captured CUDA
graph turns what is left into one launch. Shape legend: B examples, W window, E experts, k top-k,
F width of the first hidden layer, D input width, H the model's hidden size, m next-gate width.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable

import torch
from torch import nn

from duoserve.discovery import Gate, top_k
from duoserve.predictor.model import ExpertPredictor


def fold_batchnorm(predictor: ExpertPredictor) -> ExpertPredictor:
    """An eval-mode copy whose MLP is Linear/ReLU only: each BatchNorm's affine map folded into its Linear."""
    folded = copy.deepcopy(predictor).eval()
    layers = []
    for m in folded.mlp:
        if isinstance(m, nn.BatchNorm1d):
            linear = layers[-1]
            scale = m.weight / torch.sqrt(m.running_var + m.eps)  # per output unit
            fused = nn.Linear(linear.in_features, linear.out_features, device=linear.weight.device)
            with torch.no_grad():
                fused.weight.copy_(linear.weight * scale[:, None])
                fused.bias.copy_((linear.bias - m.running_mean) * scale + m.bias)
            layers[-1] = fused
        elif not isinstance(m, nn.Dropout):
            layers.append(m)
    folded.mlp = nn.Sequential(*layers)
    return folded


# a CPU call of at least this many examples sums its history rows in column blocks of the table of at most this many
# bytes (``SparseHistoryPredictor._history_sum``): a block stays in a core's L2 cache (1-2 MB on server cores); below
# that batch the extra bag per block costs more than it saves (docs/simulator.md, Speed)
BAG_BLOCK_MIN_ROWS = 256
BAG_BLOCK_BYTES = 3 << 19  # 1.5 MiB


class SparseHistoryPredictor(nn.Module):
    """The same function as a (BN-folded) predictor, with the history part of the first layer as an embedding bag."""

    def __init__(self, predictor: ExpertPredictor):
        super().__init__()
        self.inner = fold_batchnorm(predictor)
        s, first = self.inner.spec, self.inner.mlp[0]
        self.spec = s
        hist = s.window * s.num_experts
        weight = first.weight.detach()  # F x D
        zero = torch.zeros(1, weight.shape[0], dtype=weight.dtype, device=weight.device)
        self.register_buffer("history_rows", torch.cat([weight[:, :hist].T, zero]))  # (W*E + 1) x F; last: padding
        self.dense = nn.Linear(weight.shape[1] - hist, weight.shape[0], device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.dense.weight.copy_(weight[:, hist:])
            self.dense.bias.copy_(first.bias)
        self.tail = self.inner.mlp[1:]
        self._blocks: tuple[int, list[torch.Tensor]] = (0, [])  # the table's address, its column blocks (CPU)
        self.inner.mlp = nn.Sequential()  # its first layer now lives in history_rows and dense

    def forward(self, history: torch.Tensor, target: torch.Tensor, nextgate: torch.Tensor | None = None,
                nextgate_scores: torch.Tensor | None = None, depth: torch.Tensor | None = None) -> torch.Tensor:
        s = self.spec
        depth = self.inner.depths(target, depth)
        ids, valid = self.inner.window(history, target.long() - depth)  # B x W x k, B x W
        rows = torch.arange(s.window, device=ids.device)[None, :, None] * s.num_experts + ids  # B x W x k
        rows = torch.where(valid[..., None], rows, s.window * s.num_experts)  # missing layers: the zero row
        if torch.compiler.is_compiling():  # Inductor fuses the gather and the sum into one read of the W*k rows
            h = self.history_rows[rows.flatten(1)].sum(1)  # B x F
        else:  # eager: a gather would first write B x W*k x F
            h = self._history_sum(rows.flatten(1))  # B x F
        dense = self.inner.dense_features(ids, target, depth, nextgate, nextgate_scores)
        out = self.tail(h + self.dense(dense.to(self.dense.weight.dtype)))  # B x A*E
        return self.inner.head(out, depth, nextgate, nextgate_scores)

    def _history_sum(self, rows: torch.Tensor) -> torch.Tensor:
        """B x F sums of ``history_rows``' rows ``rows`` (B x W*k). A large batch on the CPU reads the table in column
        blocks that fit a core's L2 cache, one bag each: the same sums in the same order, each table row fetched from
        memory once a block rather than once an example (the paper's widths at Qwen3-30B-A3B's geometry, a 49 MB
        table: 2.5x on the sum at 1,024 examples, 1.47x on the whole call; docs/simulator.md). The blocks are a second
        copy of the table, made at the first such call and kept."""
        table = self.history_rows
        if table.device.type != "cpu" or len(rows) < BAG_BLOCK_MIN_ROWS or table.nbytes <= BAG_BLOCK_BYTES:
            return nn.functional.embedding_bag(rows, table, mode="sum")
        if self._blocks[0] != table.data_ptr():  # first use, or the table moved (another device or dtype)
            width = max(16, 1 << int(math.log2(max(BAG_BLOCK_BYTES // (len(table) * table.element_size()), 1))))
            self._blocks = (table.data_ptr(), [b.contiguous() for b in table.split(width, dim=1)])  # (W*E + 1) x width
        return torch.cat([nn.functional.embedding_bag(rows, block, mode="sum") for block in self._blocks[1]], dim=1)

    predict = ExpertPredictor.predict  # the same top ids, from this forward


def deployable(predictor: ExpertPredictor, sparse: bool, device: str | torch.device,
               dtype: torch.dtype = torch.float32) -> nn.Module:
    """``predictor`` as it is deployed on ``device``: BatchNorm folded, with the sparse first layer or the dense one."""
    return (SparseHistoryPredictor(predictor) if sparse else fold_batchnorm(predictor)).to(device, dtype)


def nextgate_features(gate: Gate | None, hidden: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The next-gate's B x m ids and scores (None where it gives none) from ``gate`` on ``hidden``."""
    return (None, None) if gate is None else (*gate(hidden), None)[:2]


def graph_call(model: nn.Module, output: str, budget: int) -> Callable:
    """What a graph captures: ``(history, target, depth, hidden, gate)`` to the ``output`` (see ``GraphedPredictor``)
    of ``model``, the next-gate features computed by ``gate`` (or None) on ``hidden`` inside the call."""
    def scores(history, target, depth, hidden, gate) -> torch.Tensor:
        return model(history, target, *nextgate_features(gate, hidden), depth).sigmoid()  # B x E

    def ids(history, target, depth, hidden, gate) -> torch.Tensor:
        return model.predict(history, target, *nextgate_features(gate, hidden), budget, depth)  # B x budget

    def top(*inputs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return top_k(scores(*inputs), budget)

    calls = {"ids": ids, "scores": scores, "top": top}
    if output not in calls:
        raise ValueError(f"unknown predictor graph output {output!r}; choose from {', '.join(calls)}")
    return calls[output]


class GraphedPredictor:
    """One predictor call at a fixed batch size, captured as a CUDA graph and replayed.

    ``sparse`` reads the history's part of the first layer as the rows of the active (layer, expert) pairs (an
    embedding bag; compiled, a gather and sum that Inductor fuses into one kernel: the faster form on a GPU when
    compiled, the dense GEMV when not: docs/benchmarks.md); ``dtype`` applies to the weights and statistics;
    ``compile`` runs the call through ``torch.compile`` before capture, so Inductor fuses the feature building,
    the next-gate and the small layers into fewer kernels (the replay is launch-bound: fewer kernels, less time).

    ``output``: what the graph returns: ``ids`` (the top ``budget`` ids, B x budget), ``scores`` (B x E sigmoid
    scores) or ``top`` (the top ``budget`` scores and their ids, B x budget each: what the runtime's prefetch reads,
    so its selection is in the graph, not a launch after it); ``module``: an already BatchNorm-folded copy on
    ``device`` to share between graphs (then ``sparse`` and ``dtype`` are the module's own); ``compiled``: a compiled
    form of ``graph_call(module, output, budget)`` shared between graphs (compiled once; ``compiled_ok`` says whether
    it ran, else the plain call was captured); ``pool``: a graph memory pool to share (graphs replayed one after
    another on one stream may: each keeps its own outputs); ``stream``: the side stream to warm up and capture on,
    to share (cuBLAS keeps a workspace of tens of MB per stream it runs on: one stream, one workspace).

    ``gate``: the target layer's next-gate (``Gate``), run inside the graph on a static copy of the B x H hidden
    states it reads (``hidden``: an example of their shape and dtype, or None for a gate that reads none); a
    predictor that reads next-gate features needs one. ``history``: the caller's own B x L x k routing history
    (long), for the graph to read in place: a replay given that tensor copies nothing (the runtime keeps one per
    batch size); by default the graph keeps a buffer of its own that each call copies into.

    ``__call__(history, target[, depth, hidden])`` copies the inputs into static buffers, replays the graph on the
    current stream, and returns the static output (valid until its next replay); ``replay`` does the same for the
    target layers and depths already in ``where`` (2 x B), as ``TrainedPredictor`` sets them once at capture.
    """

    def __init__(self, predictor: ExpertPredictor, batch_size: int = 1, budget: int | None = None,
                 device: str | torch.device = "cuda", dtype: torch.dtype = torch.float32, sparse: bool = False,
                 compile: bool = False, output: str = "ids", module: nn.Module | None = None,
                 gate: Gate | None = None, hidden: torch.Tensor | None = None, compiled: Callable | None = None,
                 pool: tuple | None = None, stream: torch.cuda.Stream | None = None,
                 history: torch.Tensor | None = None):
        s = predictor.spec
        if s.uses_nextgate and gate is None:
            raise ValueError(f"a {s.family} predictor reads next-gate features: give its graph the target layer's "
                             "next-gate (gate)")
        self.budget = budget or s.top_k
        if module is None:
            module = deployable(predictor, sparse, device, dtype)
        self.model, self.gate = module, gate
        plain = graph_call(module, output, self.budget)
        self.history = history if history is not None else \
            torch.zeros(batch_size, s.num_layers, s.top_k, dtype=torch.long, device=device)  # B x L x k
        self.where = torch.ones(2, batch_size, dtype=torch.long, device=device)  # 2 x B: target layers, depths
        self.target, self.depth = self.where  # B, B: views the graph reads
        self.hidden = None if gate is None or hidden is None else \
            torch.zeros(batch_size, hidden.shape[-1], dtype=hidden.dtype, device=device)  # B x H
        self._call = compiled or (torch.compile(plain, fullgraph=True) if compile else plain)
        self.compiled_ok = self._call is not plain
        side = stream or torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            try:
                self._warm_up()
            except Exception as err:  # compiling is a speed-up only: a machine it fails on still runs the call
                if not self.compiled_ok:
                    raise
                warnings.warn(f"torch.compile of the predictor's call failed ({type(err).__name__}: {err}); its CUDA "
                              "graph captures the plain call", stacklevel=2)
                self._call, self.compiled_ok = plain, False
                self._warm_up()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=side), torch.no_grad():
            self.out = self._run()

    def _warm_up(self) -> None:
        for _ in range(3):  # allocations and kernels (and a compiled call's compilation) outside the capture
            self._run()

    def _run(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._call(self.history, self.target, self.depth, self.hidden, self.gate)

    def __call__(self, history: torch.Tensor, target: torch.Tensor, depth: torch.Tensor | None = None,
                 hidden: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        self.target.copy_(target, non_blocking=True)
        if depth is None:
            self.depth.fill_(1)
        else:
            self.depth.copy_(depth, non_blocking=True)
        return self.replay(history, hidden)

    def replay(self, history: torch.Tensor,
               hidden: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The call for the targets and depths in ``where``, on ``history`` and ``hidden`` (the gate's input)."""
        if history is not self.history:  # else the graph reads it in place
            self.history.copy_(history, non_blocking=True)
        if self.hidden is not None:
            self.hidden.copy_(hidden, non_blocking=True)
        self.graph.replay()
        return self.out


# examples per call on the CPU: a call's activations (2,048 floats an example at the paper's widths) stay in the
# caches; larger calls cost more an example (docs/benchmarks.md)
CPU_ROWS = 1024


class TrainedPredictor:
    """An exported predictor as it is deployed: BatchNorm folded (``sparse``: with the sparse first layer; by default
    where it is the faster form, on the CPU and compiled on CUDA), on ``device``. Evaluation scores it with
    ``logits``; the runtime with ``top``, where on CUDA each (batch size, target layer, depth, gate) gets a CUDA
    graph of the whole call, the next-gate and the selection included, sharing the folded weights, one memory pool
    and one capture stream. A layer's prediction then costs the host the copy of the hidden states and one replay
    (and a copy of the routing history, unless it is the buffer of ``history``, which the graphs read in place),
    where eager work would launch about 30 kernels (and a next-gate run outside the graph 5 more, its features 2
    more copies in). ``compile``: the graphs are captured from ``torch.compile``'s form of the call (fewer, fused
    kernels: a shorter replay; it is compiled once, at the first call, which takes seconds: every target's gate is
    an input of that one compiled call). A graph's target layer and depth are fixed at capture (no copy of them a
    call); a model of L layers and look-ahead A has at most (L - 1) x A of them per batch size, a few KB each
    (measured: docs/benchmarks.md).
    """

    on_host = False  # a ``duoserve.runtime.sources.LayerPredictor``: it scores on the device

    def __init__(self, predictor: ExpertPredictor, device: str | torch.device = "cpu", sparse: bool | None = None,
                 compile: bool = False):
        self.predictor, self.compile = predictor, compile
        if sparse is None:
            sparse = compile or torch.device(device).type == "cpu"
        self.model = deployable(predictor, sparse, device)
        self._graphs: dict[tuple, GraphedPredictor] = {}  # (B, output, k, target, depth, gate) -> captured call
        self._compiled: dict[tuple, Callable | None] = {}  # (output, k) -> the compiled call its graphs share
        self._pool: tuple | None = None  # the graphs' memory pool
        self._stream: torch.cuda.Stream | None = None  # the one they are captured on
        self._history: dict[int, torch.Tensor] = {}  # B -> the B x L x k history its graphs read

    def history(self, batch: int, device: str | torch.device) -> torch.Tensor:
        """A zeroed B x L x k routing-history buffer (long) on ``device`` to fill and pass to ``top``: on CUDA the
        one its graphs of that batch size read in place, so a call copies no history."""
        device = torch.device(device)
        return self._buffer(batch, device).zero_() if device.type == "cuda" else self._zeros(batch, device)

    def _zeros(self, batch: int, device: torch.device) -> torch.Tensor:
        s = self.predictor.spec
        return torch.zeros(batch, s.num_layers, s.top_k, dtype=torch.long, device=device)  # B x L x k

    def _buffer(self, batch: int, device: torch.device) -> torch.Tensor:
        """The B x L x k history the graphs of batch size B read, made at its first use."""
        if batch not in self._history:
            self._history[batch] = self._zeros(batch, device)
        return self._history[batch]

    @property
    def nextgate(self) -> int:
        """How many next-gate ids (and, for hybrid and residual, scores) of its target layer it takes; 0: none."""
        spec = self.predictor.spec
        return spec.width if spec.uses_nextgate else 0

    @property
    def nextgate_scores(self) -> bool:
        """Whether it takes the next-gate's scores beside its ids (hybrid, residual)."""
        return self.predictor.spec.uses_scores

    @property
    def lookahead(self) -> int:
        """A: the deepest look-ahead it has a head for (it predicts layers l+1..l+A when layer l runs)."""
        return self.predictor.spec.lookahead

    @torch.no_grad()
    def logits(self, history: torch.Tensor, target: torch.Tensor, nextgate: torch.Tensor | None = None,
               nextgate_scores: torch.Tensor | None = None, depth: torch.Tensor | None = None) -> torch.Tensor:
        """B x E logits for each example's target layer (``target``: B layer ids; ``depth``: B depths, default 1);
        on the CPU in calls of at most ``CPU_ROWS`` examples."""
        inputs = (history, target, nextgate, nextgate_scores, depth)
        if history.device.type != "cpu" or len(history) <= CPU_ROWS:
            return self.model(*inputs)
        return torch.cat([self.model(*(None if x is None else x[i:i + CPU_ROWS] for x in inputs))
                          for i in range(0, len(history), CPU_ROWS)])  # B x E

    @torch.no_grad()
    def scores(self, history: torch.Tensor, target: int, hidden: torch.Tensor | None = None,
               gate: Gate | None = None, depth: int = 1) -> torch.Tensor:
        """B x E scores in [0, 1] of layer ``target``, predicted ``depth`` layers ahead, for every sequence (on the
        current stream), from the B x L x k routing ``history`` and, for a predictor that reads them, the next-gate
        features ``gate`` (the target's next-gate) gives on ``hidden`` (B x H: the source layer's MoE input). On
        CUDA a gate must be the same object at each call for a target (it is part of the captured graph)."""
        return self._call("scores", history, target, hidden, gate, depth)

    @torch.no_grad()
    def top(self, history: torch.Tensor, target: int, k: int, hidden: torch.Tensor | None = None,
            gate: Gate | None = None, depth: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` best of ``scores`` and their expert ids (B x k each): what the runtime's prefetch reads. On CUDA
        the selection is part of the replayed graph, and its outputs hold until that graph's next replay."""
        return self._call("top", history, target, hidden, gate, depth, k)

    def _call(self, output: str, history: torch.Tensor, target: int, hidden: torch.Tensor | None, gate: Gate | None,
              depth: int, k: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        B, device = len(history), history.device
        if device.type != "cuda":
            layer, ahead = torch.full((B,), target, device=device), torch.full((B,), depth, device=device)  # B, B
            scores = self.model(history, layer, *nextgate_features(gate, hidden), ahead).sigmoid()  # B x E
            return scores if output == "scores" else top_k(scores, k)
        key = (B, output, k, target, depth, gate)
        if key not in self._graphs:
            self._graphs[key] = self._capture(B, output, k, target, depth, gate, hidden, device)
        return self._graphs[key].replay(history, hidden)

    def _capture(self, B: int, output: str, k: int | None, target: int, depth: int, gate: Gate | None,
                 hidden: torch.Tensor | None, device: torch.device) -> GraphedPredictor:
        """The graph of one call, for ``target`` at ``depth``, reading the batch size's ``history`` buffer, its
        compiled form shared with the graphs of the same output (the first one compiles it; dropped where compiling
        failed)."""
        budget = k or self.predictor.spec.top_k
        self._stream = self._stream or torch.cuda.Stream(device)
        if self.compile and (output, budget) not in self._compiled:
            self._compiled[output, budget] = torch.compile(graph_call(self.model, output, budget), fullgraph=True)
        graphed = GraphedPredictor(self.predictor, B, budget, device=device, output=output, module=self.model,
                                   gate=gate, hidden=hidden, compiled=self._compiled.get((output, budget)),
                                   pool=self._pool, stream=self._stream,
                                   history=self._buffer(B, device))
        if self.compile and not graphed.compiled_ok:
            self._compiled[output, budget] = None
        graphed.where.copy_(torch.tensor([[target] * B, [depth] * B]))  # fixed: read at each replay
        self._pool = self._pool or graphed.graph.pool()
        return graphed
