"""Evaluation: every metric and baseline against hand-computed values, and an end-to-end report."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from duoserve.evaluate.accuracy import evaluate_accuracy, load_report
from duoserve.evaluate.report import write_report
from duoserve.predictor import (
    ExpertPredictor,
    FeatureSpec,
    load_predictor,
    save_predictor,
)
from tests.conftest import write_trace

A = [[0, 1], [2, 3], [4, 5]]  # layer-major top-2 sets of a 3-layer, 6-expert toy model
B = [[0, 1], [4, 5], [0, 1]]
A2 = [[0, 1], [2, 3], [0, 4]]
EVAL = [A, A2, B, A]  # one unseen request, 4 tokens, 8 (token, layer) predictions


@pytest.fixture
def toy(tmp_path):
    """Training: requests 0-2 route pattern A (5 tokens each), request 3 pattern B; request 9 is evaluated."""
    ids = [A] * 15 + [B] * 5 + EVAL
    requests = [0] * 5 + [1] * 5 + [2] * 5 + [3] * 5 + [9] * 4
    trace = write_trace(tmp_path / "trace", ids, requests, lookahead=1)
    torch.manual_seed(0)
    predictor = ExpertPredictor(FeatureSpec(3, 6, 2, window=2), widths=(8,)).eval()
    info = {"training_data": {"traces": [str(trace.path)]}}
    artifact = save_predictor(predictor, tmp_path / "predictor", info, [("squad", r) for r in range(4)])
    return trace, artifact


def test_every_baseline_matches_hand_computed_values(toy):
    trace, artifact = toy
    report = evaluate_accuracy([trace.path], artifact)
    assert report.info["evaluated_requests"] == 1 and report.info["skipped_trained_requests"] == 4
    overall = report.overall("decode")
    expected = {  # (exact-top-k, at-least-half, recall) over the 8 predictions, worked out by hand
        "popularity": (5 / 8, 6 / 8, 11 / 16),  # hits 2,2 | 2,1 | 0,0 | 2,2
        "affinity-Markov": (6 / 8, 7 / 8, 13 / 16),  # 2,2 | 2,1 | 0,2 | 2,2
        "previous token": (3 / 8, 5 / 8, 8 / 16),  # first token: popularity; then 2,1 | 0,1 | 0,0
        "activation-matrix": (5 / 8, 6 / 8, 11 / 16),  # best match is pattern A every time
        "next-gate": (1.0, 1.0, 1.0),  # the hand-built trace's next-gate guesses are the routed sets
        "oracle": (1.0, 1.0, 1.0),
    }
    for name, (exact, half, recall) in expected.items():
        row = overall.loc[name]
        assert (row.exact_topk, row.at_least_half, row.recall) == pytest.approx((exact, half, recall)), name
    assert overall.loc["oracle", "recall@3"] == 1.0 and overall.loc["oracle", "precision@3"] == pytest.approx(2 / 3)
    assert report.budgets == [2, 3, 4]
    # the trained predictor's row is its own top-k on the same inputs
    predictor = load_predictor(artifact)
    history = torch.tensor(EVAL).repeat_interleave(2, 0)
    target = torch.tensor([1, 2] * 4)
    pred = predictor.predict(history, target)
    truth = history[torch.arange(8), target]
    hits = [len(set(p.tolist()) & set(t.tolist())) for p, t in zip(pred, truth)]
    assert overall.loc["trained MLP", "exact_topk"] == pytest.approx(np.mean([h == 2 for h in hits]))
    per_layer = report.table[(report.table.phase == "decode") & (report.table.layer == "1")].set_index("scorer")
    assert per_layer.loc["popularity", "exact_topk"] == pytest.approx(3 / 4)  # layer 1: hits 2,2,0,2


def test_refuses_overlap_mismatch_and_unknown_baselines(toy, tmp_path):
    trace, artifact = toy
    trained_only = write_trace(tmp_path / "trained", [A] * 4, [0, 0, 1, 1], lookahead=1)
    with pytest.raises(ValueError, match="trained on every request"):
        evaluate_accuracy([trained_only.path], artifact)
    other = write_trace(tmp_path / "wide", [[[0, 1]] * 3] * 4, [20] * 4, num_experts=8)
    with pytest.raises(ValueError, match="E=6, k=2 does not match the trace's L=3, E=8"):
        evaluate_accuracy([other.path], artifact)
    with pytest.raises(ValueError, match="unknown baseline"):
        evaluate_accuracy([trace.path], artifact, baselines=["magic"])
    (artifact / "config.json").write_text(json.dumps({**json.loads((artifact / "config.json").read_text()),
                                                      "training_data": {"traces": ["/gone"]}}))
    with pytest.raises(FileNotFoundError, match="--train-traces"):
        evaluate_accuracy([trace.path], artifact)


@pytest.fixture(scope="module")
def embedded_report(embedded_trace, tmp_path_factory):
    from duoserve.train.fit import FitSettings, fit

    root = tmp_path_factory.mktemp("eval")
    fitted = fit(FitSettings(traces=[embedded_trace.path], out=root / "predictor", widths=(256, 128, 64), epochs=3,
                             progress=False))
    report = evaluate_accuracy([embedded_trace.path], fitted.out)
    write_report(report, root / "report", report.stats)
    return root / "report", report


def test_embedded_report_ranks_the_mlp_above_statistics_baselines(embedded_report):
    folder, report = embedded_report
    decode = report.overall("decode")
    for baseline in ("popularity", "affinity-Markov", "activation-matrix"):
        for metric in ("exact_topk", "at_least_half"):
            assert decode.loc["trained MLP", metric] > decode.loc[baseline, metric], (baseline, metric)
    assert {"report.json", "report.md", "per_layer.png", "popularity.png", "affinity.png"} <= \
        {p.name for p in folder.iterdir()}
    md = (folder / "report.md").read_text()
    assert "## decode tokens" in md and "next-gate speculation on exact-top-k" in md
    assert "(hybrid family)" in md  # the default family on a trace with next-gate scores, named
    saved = load_report(folder)
    assert saved.overall("decode").loc["trained MLP", "exact_topk"] == decode.loc["trained MLP", "exact_topk"]


def test_report_command_and_notebook_run_headless(embedded_report, embedded_trace, monkeypatch):
    from pathlib import Path

    import nbformat
    from nbclient import NotebookClient
    from typer.testing import CliRunner

    from duoserve.cli.evaluate import app as eval_app

    folder, _ = embedded_report
    result = CliRunner().invoke(eval_app, ["report", str(folder)])
    assert result.exit_code == 0 and "trained MLP" in result.output and "decode tokens" in result.output
    monkeypatch.setenv("DUOSERVE_TRACE", str(embedded_trace.path))
    monkeypatch.setenv("DUOSERVE_REPORT", str(folder))
    path = Path(__file__).resolve().parents[1] / "notebooks" / "analysis.ipynb"
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()  # the kernel inherits the env
    outputs = "".join(str(o.get("data", {}).get("text/plain", "")) + o.get("text", "")
                      for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "trained MLP" in outputs and "experts_used" in outputs


def test_cross_task_and_learning_curve(tmp_path):
    """squad requests route pattern A, orca-math requests pattern B: a squad-trained popularity baseline is
    exact on squad and useless on orca-math; the learning curve grows its training set."""
    from duoserve.evaluate.generalization import cross_task, learning_curve
    from duoserve.train.fit import FitSettings

    ids = [A] * 100 + [B] * 100
    requests = np.arange(200) // 5 % 20
    datasets = ["squad"] * 100 + ["orca-math"] * 100
    trace = write_trace(tmp_path / "t", ids, requests, datasets=datasets, lookahead=1)
    base = FitSettings(traces=[trace.path], widths=(8,), epochs=1, val_fraction=0.3, progress=False)
    ct = cross_task([trace.path], tmp_path / "fits", base).set_index(["train", "test", "scorer"])
    assert ct.loc[("squad", "squad", "popularity"), "exact_topk"] == 1.0
    assert ct.loc[("squad", "orca-math", "popularity"), "exact_topk"] == 0.0
    assert ct.loc[("orca-math", "orca-math", "popularity"), "exact_topk"] == 1.0
    assert ct.loc[("orca-math", "squad", "next-gate"), "exact_topk"] == 1.0  # needs no training
    lc = learning_curve([trace.path], tmp_path / "fits", base, [1.0, 0.5])
    sizes = lc[lc.scorer == "predictor"].set_index("train_fraction")["train_requests"]
    assert sizes[0.5] < sizes[1.0] and sorted(lc.train_fraction.unique()) == [0.5, 1.0]
