"""Look-ahead heads: examples d layers ahead, the chained affinity baseline, fits, reports and exports at depth d."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from duoserve import load_predictor
from duoserve.evaluate.accuracy import evaluate_accuracy
from duoserve.evaluate.report import write_report
from duoserve.features.examples import ExampleSet, load_routing, make_examples, source_experts
from duoserve.predictor.baselines import affinity_markov_scores
from duoserve.predictor.model import ExpertPredictor, FeatureSpec
from duoserve.trace import open_trace
from duoserve.train.fit import FitSettings, fit
from tests.conftest import FLAME_MOE, load_benchmark, needs_flame_moe

SMALL = dict(widths=(64,), epochs=1, batch_size=512, progress=False, clean=True)


def test_a_depth_two_example_predicts_layer_l_plus_2_from_layer_l(embedded_trace):
    table = load_routing([embedded_trace], lookahead=2)
    L = table.meta.num_layers
    assert table.nextgate_depth == 2 and table.nextgate[2].shape[1] == L - 2
    tokens = np.arange(50)
    examples = make_examples(tokens, L, (2,))
    assert set(examples.target) == set(range(2, L)) and (examples.depth == 2).all()
    batch = ExampleSet(table, examples).__getitems__(list(range(len(examples.token))))
    token, target = examples.token, examples.target
    np.testing.assert_array_equal(batch["truth"].numpy(), table.ids[token, target])  # layer l + 2's routing
    np.testing.assert_array_equal(source_experts(batch).numpy(), table.ids[token, target - 2])  # known at l
    np.testing.assert_array_equal(batch["nextgate"].numpy(), table.nextgate[2][token, target - 2])
    np.testing.assert_array_equal(batch["nextgate_scores"].numpy(),
                                  table.nextgate_scores[2][token, target - 2].astype(np.float32))


def test_a_depth_two_head_reads_layers_up_to_l_and_not_l_plus_1():
    L, E, k = 6, 16, 2
    model = ExpertPredictor(FeatureSpec(L, E, k, window=2, lookahead=2), widths=(32,)).eval()
    g = torch.Generator().manual_seed(0)
    history = torch.rand(4, L, E, generator=g).argsort(-1)[..., :k]  # B x L x k
    target, depth = torch.full((4,), 4), torch.full((4,), 2)  # source layer 2

    def logits(h):
        return model(h, target, depth=depth)

    base = logits(history)
    later = history.clone()
    later[:, 3] = (later[:, 3] + 1) % E  # layer l + 1 = 3 is not known yet when layer 2 runs
    torch.testing.assert_close(logits(later), base)
    known = history.clone()
    known[:, 2] = (known[:, 2] + 1) % E  # layer l = 2 is
    assert not torch.allclose(logits(known), base)
    assert not torch.allclose(model(history, target, depth=torch.ones(4, dtype=torch.long)), base)  # its own head


def test_affinity_markov_chains_the_tables_through_the_layers_between():
    L, E, k = 5, 6, 2
    g = torch.Generator().manual_seed(1)
    affinity = torch.rand(L - 1, E, E, generator=g)  # P(j at l+1 | i at l), unnormalised is fine here
    source = torch.tensor([[0, 3], [1, 5]])  # B x k ids at the source layers
    target, depth = torch.tensor([3, 4]), torch.tensor([2, 3])  # sources 1 and 1
    chained = affinity_markov_scores(affinity, source, target, depth, max_depth=3)
    first = affinity[1][source[0]].sum(0) @ affinity[2] / k
    second = affinity[1][source[1]].sum(0) @ affinity[2] / k @ affinity[3] / k
    torch.testing.assert_close(chained, torch.stack([first, second]))
    one = affinity_markov_scores(affinity, source, target)  # depth 1: the rows of layer t-1's table
    torch.testing.assert_close(one, torch.stack([affinity[2][source[0]].sum(0), affinity[3][source[1]].sum(0)]))


def test_fit_report_and_export_at_depth_two(embedded_trace, tmp_path):
    out = tmp_path / "p"
    result = fit(FitSettings(traces=[embedded_trace.path], out=out, family="hybrid", lookahead=2, **SMALL))
    assert {"predictor", "predictor (d=2)", "nextgate (d=2)", "affinity (d=2)"} <= set(result.metrics)
    predictor = load_predictor(out)  # torch alone
    assert predictor.spec.lookahead == 2 and predictor.mlp[-1].out_features == 2 * predictor.spec.num_experts
    report = evaluate_accuracy([embedded_trace.path], out, baselines=("popularity", "affinity", "next-gate",
                                                                     "previous-token"))  # depth 1 only
    assert report.depths == [1, 2]
    deep = report.overall("decode", depth=2)
    assert {"trained MLP", "next-gate", "affinity-Markov", "popularity"} <= set(deep.index)
    # one more layer to guess over loses accuracy for the router's own guess
    assert deep.loc["next-gate", "exact_topk"] < report.overall("decode").loc["next-gate", "exact_topk"]
    folder = write_report(report, tmp_path / "report", report.stats)
    text = (folder / "report.md").read_text()
    assert "## Look-ahead depth (decode)" in text and "- d=2: best is" in text and "Per layer, 2 layers ahead" in text
    assert "nan" not in text
    assert (folder / "depth.png").stat().st_size > 0
    with pytest.raises(ValueError, match="needs traces recorded with --lookahead >= 3"):
        fit(FitSettings(traces=[embedded_trace.path], out=tmp_path / "deep", family="hybrid", lookahead=3, **SMALL))
    assert not (tmp_path / "deep").exists()


def test_lookahead_heads_export_to_onnx_with_a_depth_input(tmp_path):
    pytest.importorskip("onnxruntime", reason="the onnx extra")
    import onnxruntime

    from duoserve.predictor.onnx import export_onnx

    model = ExpertPredictor(FeatureSpec(6, 16, 2, 3, family="residual", nextgate_width=4, lookahead=3),
                            widths=(16,)).eval()
    with torch.no_grad():
        model.mlp[-1].weight.normal_()
    path, diff = export_onnx(model, tmp_path)
    assert diff < 1e-4
    names = [i.name for i in onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs()]
    assert names == ["history", "target", "nextgate", "nextgate_scores", "depth"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the predictor's CUDA graph needs a CUDA device")
def test_lookahead_heads_replay_as_cuda_graphs():
    from duoserve.predictor import TrainedPredictor

    L, E, k, m, B = 8, 16, 4, 8, 3
    model = ExpertPredictor(FeatureSpec(L, E, k, 3, family="hybrid", nextgate_width=m, lookahead=3),
                            widths=(64, 32)).eval()
    g = torch.Generator().manual_seed(0)
    history = torch.rand(B, L, E, generator=g).argsort(-1)[..., :k]  # B x L x k
    nextgate = torch.rand(B, E, generator=g).argsort(-1)[:, :m]  # B x m
    scores = torch.rand(B, m, generator=g).sort(1, descending=True).values
    deployed = TrainedPredictor(model, "cuda")
    features = (nextgate.cuda(), scores.cuda())

    def gate(hidden: None) -> tuple[torch.Tensor, ...]:  # the next-gate's features, whatever the hidden states
        return features

    for _ in range(2):  # captured, then replayed: a graph per depth, its target and depth fixed in it
        for depth in (1, 3, 2):
            replayed = deployed.scores(history.cuda(), 5, None, gate, depth=depth).cpu()
            with torch.no_grad():
                expected = model(history, torch.full((B,), 5), nextgate, scores, torch.full((B,), depth)).sigmoid()
            torch.testing.assert_close(replayed, expected, atol=1e-4, rtol=1e-4)
    assert len(deployed._graphs) == 3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the predictor's CUDA graph needs a CUDA device")])])
def test_a_steps_first_layer_prefetches_each_target_from_its_own_head(device):
    """At a decode step's first layer the prefetch predicts layers 1..d in turn: each target's top k must be its own,
    not the last one's (on CUDA one graph serves every depth and its outputs are overwritten by the next replay)."""
    from duoserve.predictor import TrainedPredictor
    from duoserve.runtime.prefetch import DecodePrefetch
    from duoserve.runtime.streams import EngineTimers, Streams

    L, E, k, B = 8, 16, 4, 3
    model = ExpertPredictor(FeatureSpec(L, E, k, 3, lookahead=3), widths=(64, 32)).eval()
    with torch.no_grad():
        model.mlp[-1].weight.normal_()
    streams = Streams(torch.device(device))
    plan = DecodePrefetch(TrainedPredictor(model, device), None, [], streams, EngineTimers(streams), (L, E, k), 3,
                          0.0, None)
    plan.begin_step(B)
    idx = torch.rand(B, E, generator=torch.Generator().manual_seed(1)).argsort(-1)[:, :k]  # B x k: layer 0's routing
    targets = plan.targets(0)
    assert targets == [1, 2, 3]
    for _ in range(2):  # the second call replays the graphs the first one captured
        ids, vals, done = plan.launch(0, torch.empty(B, 0, device=device), idx.to(device), streams.record(), targets)
        if done is not None:
            done.synchronize()
        history = plan.history.cpu()
        for d, t in enumerate(targets):
            with torch.no_grad():
                expected = model(history, torch.full((B,), t), None, None, torch.full((B,), t)).sigmoid().topk(k)
            torch.testing.assert_close(torch.from_numpy(np.array(vals[d])), expected.values, atol=1e-4, rtol=1e-4)
            assert [set(r) for r in np.array(ids[d]).tolist()] == [set(r) for r in expected.indices.tolist()]
    assert len({tuple(np.array(ids[d]).ravel()) for d in range(3)}) == 3  # the three heads answer differently


@needs_flame_moe
def test_a_real_models_routing_imports_and_trains_history_only_heads(tmp_path):
    flame = load_benchmark("flame_moe")
    traces = flame.import_flame(FLAME_MOE, tmp_path)
    table = load_routing([open_trace(t) for t in traces])
    assert (table.meta.num_layers, table.meta.num_experts, table.meta.top_k) == (25, 64, 6)
    assert len(table.requests) == 32 + 64 and len(table) == 32 * 64 + 64 * 10 and table.nextgate_depth == 0
    encoder = np.load(FLAME_MOE / flame.FILES["flame-encoder"])["topk_indices"]  # L x T x k, sequence-major
    first = [i for i, (d, r) in enumerate(table.requests) if (d, r) == ("flame-encoder", 1)][0]
    rows = np.flatnonzero(table.request == first)
    rows = rows[np.argsort(table.position[rows])]
    np.testing.assert_array_equal(table.ids[rows], encoder[:, 64:128].transpose(1, 0, 2))  # sequence 1, in order
    result = fit(FitSettings(traces=traces, out=tmp_path / "p", lookahead=2, val_fraction=0.2, **SMALL))
    m = result.metrics
    assert m["predictor (d=2)"]["recall"] > m["popularity (d=2)"]["recall"], m  # history carries two layers ahead


def test_a_layer_predictor_without_a_history_buffer_is_fed_the_prefetchs_own():
    """``LayerPredictor.history`` is optional: for a predictor without it the prefetch keeps a zeroed B x L x k
    history of its own, fills it layer by layer and passes it to ``top``."""
    from duoserve.predictor import TrainedPredictor
    from duoserve.runtime.prefetch import DecodePrefetch
    from duoserve.runtime.streams import EngineTimers, Streams

    class NoBuffer:  # the protocol's required part only
        on_host, nextgate, nextgate_scores, lookahead = False, 0, False, 1

        def __init__(self, inner: TrainedPredictor):
            self.inner = inner

        def top(self, *args, **kwargs):
            return self.inner.top(*args, **kwargs)

    L, E, k, B = 6, 16, 4, 3
    model = ExpertPredictor(FeatureSpec(L, E, k, 3), widths=(64, 32)).eval()
    with torch.no_grad():
        model.mlp[-1].weight.normal_()
    streams = Streams(torch.device("cpu"))
    plan = DecodePrefetch(NoBuffer(TrainedPredictor(model)), None, [], streams, EngineTimers(streams), (L, E, k), 1,
                          0.0, None)
    plan.begin_step(B)
    assert plan.history.shape == (B, L, k) and not plan.history.any()
    idx = torch.rand(B, E, generator=torch.Generator().manual_seed(1)).argsort(-1)[:, :k]  # B x k: layer 0's routing
    ids, vals, _ = plan.launch(0, torch.empty(B, 0), idx, streams.record(), [1])
    assert torch.equal(plan.history[:, 0], idx)
    with torch.no_grad():
        expected = model(plan.history, torch.full((B,), 1)).sigmoid().topk(k)
    assert [set(r) for r in np.array(ids[0]).tolist()] == [set(r) for r in expected.indices.tolist()]
