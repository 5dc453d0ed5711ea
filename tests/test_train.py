"""Predictor training on traces of the embedded model, export, torch-only loading, refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from duoserve import load_predictor
from duoserve.features.examples import ExampleSet, load_routing
from duoserve.predictor import trained_requests
from duoserve.train.fit import FitSettings, fit
from tests.conftest import write_trace

SMALL = dict(widths=(256, 128, 64), epochs=3, batch_size=512, progress=False, family="paper")  # its own inputs only


@pytest.fixture(scope="module")
def fitted(embedded_trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("fit") / "predictor"
    return fit(FitSettings(traces=[embedded_trace.path], out=out, **SMALL))


def test_fit_beats_the_popularity_baseline(fitted):
    mlp, popularity = fitted.metrics["predictor"], fitted.metrics["popularity"]
    # measured at writing: trained MLP about 0.37-0.44 exact-top-k, popularity about 0.02
    assert mlp["exact_topk"] > 0.25 and mlp["exact_topk"] > 5 * popularity["exact_topk"], fitted.metrics
    assert mlp["at_least_half"] > popularity["at_least_half"] + 0.2
    assert mlp["exact_topk"] > fitted.metrics["affinity"]["exact_topk"]
    assert fitted.val_examples > 1000 and fitted.train_examples > 5 * fitted.val_examples


def test_export_then_load_gives_identical_outputs(fitted, embedded_trace):
    from duoserve.features.examples import make_examples
    from duoserve.train.lightning import PredictorModule

    config = json.loads((fitted.out / "config.json").read_text())
    ckpt = fitted.out.parent / ".predictor.lightning" / "checkpoints" / config["training"]["best_epoch_checkpoint"]
    trained = PredictorModule.load_from_checkpoint(ckpt, map_location="cpu").model.eval()
    loaded = load_predictor(fitted.out)
    table = load_routing([embedded_trace])
    batch = ExampleSet(table, make_examples(np.arange(50), table.meta.num_layers)).__getitems__(list(range(300)))
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch["history"], batch["target"]), trained(batch["history"], batch["target"]),
                                   rtol=0, atol=0)
    assert config["geometry"]["num_experts"] == 16 and config["training_data"]["model"] == "embedded"
    assert config["metrics"]["validation"]["predictor"] == fitted.metrics["predictor"]
    train = trained_requests(fitted.out)
    assert len(train) == config["split"]["train_requests"] and train < set(table.requests)
    assert loaded.predict(batch["history"][:2], batch["target"][:2]).shape == (2, 4)


def test_onnx_export_computes_what_the_artifact_does(fitted, embedded_trace, tmp_path):
    import onnxruntime

    from duoserve.features.examples import make_examples
    from duoserve.predictor.onnx import export_onnx

    loaded = load_predictor(fitted.out)
    path, diff = export_onnx(loaded, tmp_path)
    assert path == tmp_path / "model.onnx" and diff <= 1e-4 and not list(tmp_path.glob(".model.*"))
    table = load_routing([embedded_trace])
    batch = ExampleSet(table, make_examples(np.arange(50), table.meta.num_layers)).__getitems__(list(range(300)))
    session = onnxruntime.InferenceSession(str(path))
    (logits,) = session.run(["logits"], {"history": batch["history"].long().numpy(),
                                         "target": batch["target"].long().numpy()})
    with torch.no_grad():
        expected = loaded(batch["history"], batch["target"]).numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4)  # real routing, a batch size not seen at export


def test_loading_needs_torch_only(fitted):
    code = ("import sys; from duoserve import load_predictor; p = load_predictor(sys.argv[1]); "
            "assert 'lightning' not in sys.modules and 'pytorch_lightning' not in sys.modules, 'lightning imported'; "
            "print(p.spec.num_experts)")
    out = subprocess.run([sys.executable, "-c", code, str(fitted.out)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "16"


def test_geometry_mismatch_and_bad_inputs_are_refused(fitted, tmp_path):
    predictor = load_predictor(fitted.out)
    predictor.check_geometry(8, 16, 4)
    with pytest.raises(ValueError, match="does not match the trace's L=8, E=32, k=4"):
        predictor.check_geometry(8, 32, 4, "trace")
    ids = np.random.default_rng(0).integers(0, 6, (40, 3, 2))
    no_ng = write_trace(tmp_path / "t", ids, np.arange(40))
    with pytest.raises(ValueError, match="needs traces recorded with --lookahead"):
        fit(FitSettings(traces=[no_ng.path], out=tmp_path / "p", features=("nextgate",), **SMALL))
    with pytest.raises(ValueError, match="unknown feature"):
        fit(FitSettings(traces=[no_ng.path], out=tmp_path / "p", features=("hidden",), **SMALL))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not a predictor folder"):
        fit(FitSettings(traces=[no_ng.path], out=tmp_path / "taken", **SMALL))
    with pytest.raises(FileNotFoundError, match="not a predictor folder"):
        load_predictor(tmp_path / "taken")
    assert not (tmp_path / "p").exists()


def test_a_refused_fit_leaves_nothing_and_clean_removes_the_checkpoints(embedded_trace, embedded_predictor, tmp_path):
    from duoserve.train.fit import FitSettings, fit

    # the shared fixture was fitted with clean=True: the artifact is there, its checkpoints are not
    assert (embedded_predictor / "model.safetensors").exists()
    assert not (embedded_predictor.parent / f".{embedded_predictor.name}.lightning").exists()
    settings = FitSettings(traces=[embedded_trace.path], out=tmp_path / "p", widths=(16,), epochs=1, progress=False)
    with pytest.raises(ValueError, match="devices=0"):
        fit(replace(settings, devices=0))
    assert not list(tmp_path.iterdir())  # nothing written, so nothing blocks the corrected command
    result = fit(settings)
    assert result.out.exists() and result.work_dir == tmp_path / ".p.lightning" and result.work_dir.exists()
    assert not fit(replace(settings, clean=True)).resumed and not result.work_dir.exists()
