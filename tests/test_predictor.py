"""Low-latency predictor inference: BatchNorm folding (CPU) and CUDA-graph replay (GPU only)."""

from __future__ import annotations

import pytest
import torch

from duoserve.bench.shapes import random_predictor
from duoserve.predictor import fast
from duoserve.predictor.fast import (
    CPU_ROWS,
    GraphedPredictor,
    SparseHistoryPredictor,
    TrainedPredictor,
    fold_batchnorm,
)
from duoserve.predictor.model import ExpertPredictor, FeatureSpec

L, E, K = 6, 16, 4


def _trained_like() -> ExpertPredictor:
    torch.manual_seed(0)
    model = ExpertPredictor(FeatureSpec(L, E, K, window=3), widths=(64, 32), popularity=torch.rand(L, E),
                            affinity=torch.rand(L - 1, E, E))
    model.train()
    with torch.no_grad():  # give BatchNorm non-trivial running statistics
        for _ in range(5):
            model(torch.randint(0, E, (64, L, K)), torch.randint(1, L, (64,)))
    return model.eval()


def test_folding_batchnorm_keeps_outputs():
    model = _trained_like()
    folded = fold_batchnorm(model)
    assert not any(isinstance(m, (torch.nn.BatchNorm1d, torch.nn.Dropout)) for m in folded.mlp)
    assert sum(isinstance(m, torch.nn.Linear) for m in folded.mlp) == 3
    history, target = torch.randint(0, E, (32, L, K)), torch.randint(1, L, (32,))
    with torch.no_grad():
        torch.testing.assert_close(folded(history, target), model(history, target), rtol=1e-4, atol=1e-5)
    assert any(isinstance(m, torch.nn.BatchNorm1d) for m in model.mlp)  # the original is untouched


def test_sparse_first_layer_computes_the_same_function():
    model = _trained_like()
    sparse = SparseHistoryPredictor(model)
    history = torch.rand(64, L, E).argsort(-1)[..., :K]  # distinct experts per layer, as a router picks them
    target = torch.randint(1, L, (64,))
    target[:4] = torch.tensor([1, 2, 3, 5])  # windows that start before layer 0, and a full one
    with torch.no_grad():
        torch.testing.assert_close(sparse(history, target), model(history, target), rtol=1e-4, atol=1e-4)
    assert torch.equal(sparse.predict(history, target).sort(1).values, model.predict(history, target).sort(1).values)
    assert not any(isinstance(m, torch.nn.Linear) and m.in_features == model.spec.input_dim for m in sparse.modules())


def test_a_large_cpu_batch_sums_its_history_rows_in_column_blocks_exactly(monkeypatch):
    """The blocked sum reads the table a column block at a time: the same sums, in the same order, as one bag."""
    sparse = SparseHistoryPredictor(_trained_like())
    history = torch.rand(40, L, E).argsort(-1)[..., :K]
    target = torch.randint(1, L, (40,))
    with torch.no_grad():
        whole = sparse(history, target)
        table = sparse.history_rows
        monkeypatch.setattr(fast, "BAG_BLOCK_MIN_ROWS", 32)
        monkeypatch.setattr(fast, "BAG_BLOCK_BYTES", table.nbytes // 3)
        blocked = sparse(history, target)
    widths = [block.shape[1] for block in sparse._blocks[1]]
    assert len(widths) > 1 and sum(widths) == table.shape[1]  # the blocked path ran, over every column
    assert torch.equal(blocked, whole)


def test_the_compiled_sparse_first_layer_computes_the_same_function():
    """Compiled, the history's rows are gathered and summed (Inductor fuses them) instead of bagged."""
    model = _trained_like()
    sparse = SparseHistoryPredictor(model)
    history = torch.rand(16, L, E).argsort(-1)[..., :K]
    target = torch.tensor([1, 2, 3, 5] * 4)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(sparse, fullgraph=True)(history, target), model(history, target),
                                   rtol=1e-4, atol=1e-4)


def test_a_long_batch_is_scored_in_cpu_calls_that_equal_one_call():
    predictor = TrainedPredictor(random_predictor(L, E, K, widths=(64, 32), family="hybrid", lookahead=2), sparse=True)
    n = 2 * CPU_ROWS + 37  # two full calls and a short one
    g = torch.Generator().manual_seed(0)
    history = torch.rand(n, L, E, generator=g).argsort(-1)[..., :K]  # n x L x k
    target = torch.randint(2, L, (n,), generator=g)
    depth = torch.randint(1, 3, (n,), generator=g)
    nextgate = torch.rand(n, E, generator=g).argsort(-1)[:, :2 * K]  # n x 2k ids
    scores = torch.rand(n, 2 * K, generator=g).sort(1, descending=True).values  # n x 2k
    with torch.no_grad():
        whole = predictor.model(history, target, nextgate, scores, depth)  # one call of n rows
    chunked = predictor.logits(history, target, nextgate, scores, depth)
    assert chunked.shape == (n, E)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graphed_predictor_matches_eager():
    model = _trained_like().cuda()
    graphed = GraphedPredictor(model, batch_size=2)
    sparse = GraphedPredictor(model, batch_size=2, sparse=True)
    compiled = GraphedPredictor(model, batch_size=2, compile=True)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        history = torch.rand(2, L, E, generator=g).argsort(-1)[..., :K].cuda()
        target = torch.randint(1, L, (2,), generator=g).cuda()
        expected = model.predict(history, target)
        assert torch.equal(graphed(history, target).sort(1).values, expected.sort(1).values)
        assert torch.equal(sparse(history, target).sort(1).values, expected.sort(1).values)
        assert torch.equal(compiled(history, target).sort(1).values, expected.sort(1).values)


def test_a_graph_of_a_next_gate_family_is_refused_without_the_targets_next_gate():
    """Its features come from the gate inside the graph: without one there is nothing to feed it (refused before any
    CUDA work, so on the CPU too)."""
    model = random_predictor(L, E, K, widths=(64, 32), family="hybrid")
    with pytest.raises(ValueError, match="reads next-gate features"):
        GraphedPredictor(model, batch_size=2, device="cpu")


def test_one_compiled_call_serves_every_target_layers_next_gate():
    """The runtime's graphs share one compiled call; each target's gate (its router's weights) is an input of it, so
    a new target's gate compiles nothing new, and the compiled call (its selections sorted, not topk'd) answers as
    the eager one does."""
    from duoserve.discovery import next_gate_fn
    from duoserve.predictor.fast import graph_call

    H, m = 24, 2 * K
    model = fold_batchnorm(random_predictor(L, E, K, widths=(64, 32), family="hybrid"))
    g = torch.Generator().manual_seed(0)
    history = torch.rand(3, L, E, generator=g).argsort(-1)[..., :K]  # 3 x L x k
    target, depth = torch.full((3,), 4), torch.ones(3, dtype=torch.long)
    eager = graph_call(model, "top", K)
    compiled = torch.compile(eager, fullgraph=True)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            router = torch.nn.Linear(H, E, bias=False)
            torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(seed))
            gate, hidden = next_gate_fn(router, K, m), torch.randn(3, H, generator=g)
            values, ids = compiled(history, target, depth, hidden, gate)
            expected = eager(history, target, depth, hidden, gate)
            torch.testing.assert_close(values, expected[0], rtol=1e-4, atol=1e-5)
            assert torch.equal(ids, expected[1])
