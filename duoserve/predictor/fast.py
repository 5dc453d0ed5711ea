"""Low-latency inference for a trained predictor: BatchNorm folded into the linears, CUDA-graph replay.

At batch 1 the predictor is launch-bound: ~20 small kernels for the features and the MLP. Folding
BatchNorm removes a third of them; replaying a captured CUDA graph turns the rest into a single
launch. Shape legend: B examples, L MoE layers, E experts, k top-k.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

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


class GraphedPredictor:
    """One predictor call at a fixed batch size, captured as a CUDA graph and replayed.

    ``__call__(history, target[, nextgate])`` copies the inputs into static buffers, replays the
    graph on the current stream, and returns the static B x budget id tensor (valid until the next call).
    """

    def __init__(self, predictor: ExpertPredictor, batch_size: int = 1, budget: int | None = None,
                 device: str | torch.device = "cuda", dtype: torch.dtype = torch.float32):
        s = predictor.spec
        self.model = fold_batchnorm(predictor).to(device)
        self.model.mlp.to(dtype)  # features stay float32; bfloat16 halves weight memory and reads
        self.history = torch.zeros(batch_size, s.num_layers, s.top_k, dtype=torch.long, device=device)
        self.target = torch.ones(batch_size, dtype=torch.long, device=device)
        self.nextgate = torch.zeros(batch_size, s.top_k, dtype=torch.long, device=device) if s.nextgate else None
        self.budget = budget or s.top_k
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):  # warm up allocations and kernels outside the capture
                self._run()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side), torch.no_grad():  # one side stream: one cuBLAS workspace
            self.out = self._run()

    def _run(self) -> torch.Tensor:
        return self.model.predict(self.history, self.target, self.nextgate, self.budget)

    def __call__(self, history: torch.Tensor, target: torch.Tensor,
                 nextgate: torch.Tensor | None = None) -> torch.Tensor:
        self.history.copy_(history, non_blocking=True)
        self.target.copy_(target, non_blocking=True)
        if self.nextgate is not None:
            self.nextgate.copy_(nextgate, non_blocking=True)
        self.graph.replay()
        return self.out
