"""Predictor families (paper, hybrid, residual) on the embedded traces, and version-1 traces beside version-2 ones."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from duoserve import load_predictor
from duoserve.features.examples import ExampleSet, load_routing, make_examples
from duoserve.predictor.model import FAMILIES, ExpertPredictor, FeatureSpec
from duoserve.trace import open_trace
from duoserve.trace.format import META_KEY, TraceMeta, arrow_schema, nextgate_column
from duoserve.train.fit import FitSettings, fit

SMALL = dict(widths=(64,), epochs=1, batch_size=512, progress=False, clean=True)


def _examples(trace, rows: int = 400):
    table = load_routing([trace])
    return table, ExampleSet(table, make_examples(np.arange(rows), table.meta.num_layers)).__getitems__(
        list(range(rows * (table.meta.num_layers - 1))))


def test_version_2_traces_carry_next_gate_ids_and_probabilities(embedded_trace):
    meta = embedded_trace.meta
    assert meta.version == 2 and meta.nextgate_width == 2 * meta.top_k and meta.nextgate_scores
    table, _ = _examples(embedded_trace)
    L, k, m = meta.num_layers, meta.top_k, meta.nextgate_width
    assert table.nextgate[1].shape == table.nextgate_scores[1].shape == (len(table), L - 1, m)
    scores = table.nextgate_scores[1].astype(np.float32)
    assert (scores > 0).all() and (scores <= 1).all() and (scores.sum(2) <= 1.01).all()
    # past the router's own top-k, the rest come best first
    assert (np.diff(scores[..., k:], axis=2) <= 1e-3).all()


def test_untrained_residual_is_next_gate_exactly(embedded_trace):
    meta = embedded_trace.meta
    _, batch = _examples(embedded_trace)
    spec = FeatureSpec(meta.num_layers, meta.num_experts, meta.top_k, meta.num_layers - 1, family="residual",
                       nextgate_width=meta.nextgate_width)
    residual = ExpertPredictor(spec, widths=(32,)).eval()  # its correction starts at zero
    predicted = residual.predict(batch["history"], batch["target"], batch["nextgate"], batch["nextgate_scores"])
    k = meta.top_k
    assert torch.equal(predicted, batch["nextgate"][:, :k])  # same ids, same order
    with torch.no_grad():
        residual.mlp[-1].bias[0] = 100.0  # a correction changes the guess
    moved = residual.predict(batch["history"], batch["target"], batch["nextgate"], batch["nextgate_scores"])
    assert (moved == 0).any(1).all() and not torch.equal(moved, predicted)


def test_hybrid_reads_the_next_gate_scores(embedded_trace):
    meta = embedded_trace.meta
    _, batch = _examples(embedded_trace, rows=20)
    spec = FeatureSpec(meta.num_layers, meta.num_experts, meta.top_k, 3, family="hybrid",
                       nextgate_width=meta.nextgate_width)
    hybrid = ExpertPredictor(spec, widths=(32,)).eval()
    args = batch["history"], batch["target"], batch["nextgate"]
    with torch.no_grad():
        base = hybrid(*args, batch["nextgate_scores"])
        assert not torch.allclose(base, hybrid(*args, batch["nextgate_scores"].flip(1)))
    with pytest.raises(ValueError, match="needs the next-gate's scores"):
        hybrid(*args)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_and_loads_with_torch_alone(family, embedded_trace, tmp_path):
    out = tmp_path / family
    result = fit(FitSettings(traces=[embedded_trace.path], out=out, family=family, **SMALL))
    config = json.loads((out / "config.json").read_text())
    assert config["feature_spec"]["family"] == family and result.metrics["predictor"]["recall"] > 0.3
    probe = (f"import sys, torch; sys.modules['lightning'] = None; from duoserve import load_predictor; "
             f"p = load_predictor({str(out)!r}); assert p.spec.family == {family!r}; print(p.spec.width)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == embedded_trace.meta.nextgate_width
    _, batch = _examples(embedded_trace, rows=5)
    logits = load_predictor(out)(batch["history"], batch["target"], batch["nextgate"], batch["nextgate_scores"])
    assert logits.shape == (len(batch["target"]), embedded_trace.meta.num_experts)


def test_the_default_family_is_hybrid_where_the_traces_carry_next_gate_scores(embedded_trace, tmp_path):
    assert embedded_trace.meta.nextgate_scores  # what duoserve-trace collect records by default
    result = fit(FitSettings(traces=[embedded_trace.path], out=tmp_path / "auto", **SMALL))
    assert result.family == "hybrid" == load_predictor(tmp_path / "auto").spec.family
    # next-gate scores recorded to depth 2: heads to depth 3 would lack them, so they take the paper family
    assert embedded_trace.meta.lookahead == 2
    assert fit(FitSettings(traces=[embedded_trace.path], out=tmp_path / "deep", lookahead=3, **SMALL)).family == "paper"


def test_softmax_loss_sees_only_how_the_experts_rank_and_fits_from_the_cli(embedded_trace, tmp_path, monkeypatch):
    from types import SimpleNamespace

    import pandas as pd
    from typer.testing import CliRunner

    from duoserve.cli.train import app
    from duoserve.evaluate import generalization
    from duoserve.train.lightning import routing_loss

    g = torch.Generator().manual_seed(0)
    logits, truth = torch.randn(6, 16, generator=g), torch.rand(6, 16, generator=g).argsort(1)[:, :4]  # B x E, B x k
    for loss in ("bce", "softmax"):
        raised = logits.scatter_add(1, truth, torch.ones(6, 4))  # the chosen experts ranked higher
        assert routing_loss(raised, truth, loss) < routing_loss(logits, truth, loss)
    # a shift of every logit: the softmax loss does not move, the per-expert BCE does
    torch.testing.assert_close(routing_loss(logits + 3, truth, "softmax"), routing_loss(logits, truth, "softmax"))
    assert not torch.isclose(routing_loss(logits + 3, truth, "bce"), routing_loss(logits, truth, "bce"))
    out = tmp_path / "p"
    done = CliRunner().invoke(app, ["fit", str(embedded_trace.path), "--out", str(out), "--family", "residual",
                                    "--loss", "softmax", "--lr", "0.004", "--widths", "64", "--epochs", "1", "--clean",
                                    "--window", "2", "--phase", "decode"])
    assert done.exit_code == 0, done.output
    assert load_predictor(out).spec.family == "residual"
    config = json.loads((out / "config.json").read_text())
    assert config["training"]["loss"] == "softmax"
    # the cross-task refits are fitted as the artifact was: its family, loss, learning rate, window and phase
    refits = []
    monkeypatch.setattr(generalization, "cross_task", lambda traces, work, base, progress=None: refits.append(base)
                        or pd.DataFrame(columns=["train", "test", "scorer", "depth", "exact_topk"]))
    generalization.add_studies(SimpleNamespace(info={"predictor_config": config}), [embedded_trace.path], tmp_path,
                               cross=True)
    assert (refits[0].family, refits[0].loss, refits[0].lr) == ("residual", "softmax", 0.004)
    assert (refits[0].window, refits[0].phase, refits[0].dropout) == (2, "decode", config["dropout"])
    refused = CliRunner().invoke(app, ["fit", str(embedded_trace.path), "--out", str(tmp_path / "q"), "--loss",
                                       "hinge"])
    assert refused.exit_code != 0 and "unknown loss 'hinge'" in refused.output
    assert not (tmp_path / "q").exists()


def _as_version_1(trace, out):
    """``trace`` rewritten as version 1 wrote it: next-gate top-k ids only, no scores."""
    meta = json.loads(pq.read_schema(trace.files[0]).metadata[META_KEY])
    k, L, m = meta["top_k"], meta["num_layers"], meta.pop("nextgate_width")
    meta["version"] = 1
    out.mkdir()
    for f in trace.files:
        table = pq.read_table(f)
        table = table.drop_columns([c for c in table.column_names if c.startswith("nextgate_scores")])
        for d in range(1, meta["lookahead"] + 1):  # every depth's ids cut to the router's top-k
            name = nextgate_column(d)
            ids = table.column(name).combine_chunks().flatten().to_numpy().reshape(-1, L - d, m)[..., :k]
            column = pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), (L - d) * k)
            table = table.set_column(table.schema.get_field_index(name), name, column)
        schema = arrow_schema(TraceMeta.from_bytes(json.dumps(meta).encode()))  # the version-1 schema, non-null
        pq.write_table(table.cast(schema).replace_schema_metadata({META_KEY: json.dumps(meta).encode()}), out / f.name)
    return open_trace(out)


def test_version_1_traces_still_load_and_train_what_they_can(embedded_trace, tmp_path):
    old = _as_version_1(embedded_trace, tmp_path / "v1")
    assert old.meta.version == 1 and old.meta.nextgate_width == old.meta.top_k and not old.meta.nextgate_scores
    table = load_routing([old])
    new = load_routing([embedded_trace])
    assert table.nextgate_scores == {}
    np.testing.assert_array_equal(table.nextgate[1], new.nextgate[1][..., :old.meta.top_k])
    np.testing.assert_array_equal(table.ids, new.ids)
    both = load_routing([old, embedded_trace])  # mixed versions: the common width, no scores
    assert both.nextgate[1].shape[2] == old.meta.top_k and both.nextgate_scores == {}
    # the default family (auto) is paper where the traces carry no next-gate scores
    assert fit(FitSettings(traces=[old.path], out=tmp_path / "paper", features=("popularity", "nextgate"),
                           **SMALL)).family == "paper"
    assert json.loads((tmp_path / "paper" / "config.json").read_text())["feature_spec"]["family"] == "paper"
    with pytest.raises(ValueError, match="needs the next-gate's scores: traces of format version 2"):
        fit(FitSettings(traces=[old.path], out=tmp_path / "hybrid", family="hybrid", **SMALL))
    assert not (tmp_path / "hybrid").exists()


def test_residual_exports_to_onnx_with_its_next_gate_inputs(embedded_trace, tmp_path):
    pytest.importorskip("onnxruntime", reason="the onnx extra")
    import onnxruntime

    from duoserve.predictor.onnx import export_onnx

    meta = embedded_trace.meta
    spec = FeatureSpec(meta.num_layers, meta.num_experts, meta.top_k, 2, family="residual",
                       nextgate_width=meta.nextgate_width)
    model = ExpertPredictor(spec, widths=(16,)).eval()
    with torch.no_grad():
        model.mlp[-1].weight.normal_()  # a correction that is not zero, so both parts of the logits count
    path, diff = export_onnx(model, tmp_path)
    assert diff < 1e-4
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["history", "target", "nextgate", "nextgate_scores"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the predictor's CUDA graph needs a CUDA device")
@pytest.mark.parametrize("compile", [False, True], ids=["plain", "compiled"])
@pytest.mark.parametrize("family", ["hybrid", "residual"])
def test_next_gate_families_replay_as_cuda_graphs(family, compile):
    from duoserve.predictor import TrainedPredictor

    L, E, k, m, B = 8, 16, 4, 8, 3
    model = ExpertPredictor(FeatureSpec(L, E, k, 3, family=family, nextgate_width=m), widths=(64, 32)).eval()
    with torch.no_grad():
        model.mlp[-1].weight.normal_(std=0.1)
    g = torch.Generator().manual_seed(0)
    history = torch.rand(B, L, E, generator=g).argsort(-1)[..., :k]  # B x L x k
    nextgate = torch.rand(B, E, generator=g).argsort(-1)[:, :m]  # B x m
    scores = torch.rand(B, m, generator=g).sort(1, descending=True).values
    deployed = TrainedPredictor(model, "cuda", compile=compile)
    features = (nextgate.cuda(), scores.cuda())

    def gate(hidden: None) -> tuple[torch.Tensor, ...]:  # the next-gate's features, whatever the hidden states
        return features

    deployed.scores(history.cuda(), 3, None, gate)  # captured (compiled first)
    replayed = deployed.scores(history.cuda(), 3, None, gate).cpu()
    with torch.no_grad():
        expected = model(history, torch.full((B,), 3), nextgate, scores).sigmoid()
    torch.testing.assert_close(replayed, expected, atol=1e-4, rtol=1e-4)
    for _ in range(2):  # the runtime's call: the top k selected inside its own graph
        values, ids = deployed.top(history.cuda(), 3, k, None, gate)
    torch.testing.assert_close(values.cpu(), expected.topk(k).values, atol=1e-4, rtol=1e-4)
    assert [set(r) for r in ids.tolist()] == [set(r) for r in expected.topk(k).indices.tolist()]
    assert deployed.nextgate == m


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the predictor's CUDA graph needs a CUDA device")])])
def test_the_prefetch_computes_a_hybrid_predictors_next_gate_from_each_layers_own_hidden_states(device):
    """The runtime's call takes the layer's hidden states and the target's next-gate: the predictor computes the
    next-gate inside its call (on CUDA inside its graph). Each call's scores must be those of that call's hidden states
    through that target's router (a graph replaying stale hidden states, or another target's router, fails)."""
    from duoserve.discovery import next_gate_fn
    from duoserve.predictor import TrainedPredictor
    from duoserve.runtime.prefetch import DecodePrefetch
    from duoserve.runtime.streams import EngineTimers, Streams

    L, E, k, m, B, H = 6, 16, 4, 8, 3, 24
    torch.manual_seed(0)
    model = ExpertPredictor(FeatureSpec(L, E, k, 3, family="hybrid", nextgate_width=m, lookahead=2),
                            widths=(64, 32)).eval()
    with torch.no_grad():
        model.mlp[-1].weight.normal_()
    routers = [torch.nn.Linear(H, E, bias=False).to(device) for _ in range(L)]
    gates = [None] + [next_gate_fn(r, k, m) for r in routers[1:]]
    streams = Streams(torch.device(device))
    plan = DecodePrefetch(TrainedPredictor(model, device), None, [], streams, EngineTimers(streams), (L, E, k), 2,
                          0.0, gates)
    plan.begin_step(B)
    idx = torch.rand(B, E, generator=torch.Generator().manual_seed(1)).argsort(-1)[:, :k].to(device)  # B x k
    for seed in range(3):  # the first call captures the graphs, the others replay them on new hidden states
        hidden = torch.randn(B, H, generator=torch.Generator().manual_seed(10 + seed)).to(device)  # B x H
        ids, vals, done = plan.launch(0, hidden, idx, streams.record(), [1, 2])
        if done is not None:
            done.synchronize()
        history = plan.history.cpu()
        for d, t in enumerate([1, 2]):
            with torch.no_grad():
                features = [f.cpu() for f in gates[t](hidden)]
                expected = model(history, torch.full((B,), t), *features, torch.full((B,), t)).sigmoid().topk(k)
            torch.testing.assert_close(torch.from_numpy(np.array(vals[d])), expected.values, atol=1e-4, rtol=1e-4)
            assert [set(r) for r in np.array(ids[d]).tolist()] == [set(r) for r in expected.indices.tolist()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the predictor's CUDA graph needs a CUDA device")
def test_the_graphs_of_every_target_layer_cost_little_memory_beside_the_first():
    """A graph per target layer: they share one capture stream (cuBLAS keeps a workspace of MBs per stream) and one
    memory pool, so the graphs of all L - 1 targets hold little more than the first one does."""
    from duoserve.predictor import TrainedPredictor

    L, E, k, B = 12, 16, 4, 2
    model = ExpertPredictor(FeatureSpec(L, E, k, 3), widths=(64, 32)).eval()
    history = torch.rand(B, L, E, generator=torch.Generator().manual_seed(0)).argsort(-1)[..., :k].cuda()
    deployed = TrainedPredictor(model, "cuda")
    deployed.top(history, 1, k)
    torch.cuda.synchronize()
    first = torch.cuda.memory_allocated()
    for t in range(2, L):
        deployed.top(history, t, k)
    torch.cuda.synchronize()
    assert len(deployed._graphs) == L - 1
    assert torch.cuda.memory_allocated() - first < (L - 2) * 2**17  # under 128 KB a graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the predictor's CUDA graph needs a CUDA device")
def test_a_predictor_whose_compilation_fails_is_captured_from_its_plain_call(monkeypatch):
    from duoserve.predictor import TrainedPredictor

    def broken(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no compiler here")
        return call

    L, E, k, B = 8, 16, 4, 2
    model = ExpertPredictor(FeatureSpec(L, E, k, 3), widths=(64, 32)).eval()
    history = torch.rand(B, L, E, generator=torch.Generator().manual_seed(0)).argsort(-1)[..., :k]  # B x L x k
    monkeypatch.setattr(torch, "compile", broken)
    deployed = TrainedPredictor(model, "cuda", compile=True)
    with pytest.warns(UserWarning, match="no compiler here"):
        deployed.scores(history.cuda(), 3)
    replayed = deployed.scores(history.cuda(), 3).cpu()
    with torch.no_grad():
        expected = model(history, torch.full((B,), 3), None, None).sigmoid()
    torch.testing.assert_close(replayed, expected, atol=1e-4, rtol=1e-4)


def test_the_cross_task_probes_prior_counts_only_a_requests_earlier_tokens(embedded_trace):
    """benchmarks/cross_task_probes.py's request prior: per token, the routing of its request's earlier tokens
    (prompt included) at each layer, and with weight 0 it is next-gate's own choice."""
    from duoserve.evaluate import scorers as S
    from duoserve.features.examples import load_routing, make_examples
    from tests.conftest import load_benchmark

    probes = load_benchmark("cross_task_probes")
    table = load_routing([embedded_trace], lookahead=1)
    counts = probes.request_counts(table)  # N x L x E
    L, E = table.meta.num_layers, table.meta.num_experts
    for i in np.random.default_rng(0).choice(len(table), 40, replace=False):
        earlier = np.flatnonzero((table.request == table.request[i]) & (table.position < table.position[i]))
        want = np.zeros((L, E))
        for j in earlier:
            np.add.at(want, (np.arange(L)[:, None], table.ids[j].astype(np.int64)), 1.0)
        np.testing.assert_array_equal(counts[i], want)
    decode = np.flatnonzero(table.decode)
    ev = S.EvalSet(table.select(decode), make_examples(np.arange(len(decode)), L))
    assert probes.exact(probes.RequestPrior(counts[decode], 0.0), ev) == probes.exact(S.NextGate(), ev)
    assert probes.exact(probes.RequestPrior(counts[decode], 5.0), ev) != probes.exact(S.NextGate(), ev)
