"""The exported predictor: a folder with config.json and model.safetensors, loadable with torch alone.

    predictor/
      config.json        format version, geometry and feature spec (with the predictor family and next-gate
                         width), layer widths, training data,
                         split, metrics at export
      model.safetensors  MLP weights and the popularity / affinity statistics it uses
      split.json         the (dataset, request_id) pairs trained on, so evaluation can refuse overlap
      model.onnx         optional (duoserve-train fit --onnx): the same predictor for ONNX runtimes
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from duoserve.files import atomic_dir
from duoserve.predictor.model import ExpertPredictor, FeatureSpec

ARTIFACT_VERSION = 1


def save_predictor(model: ExpertPredictor, out: str | Path, info: dict, train_requests: list[tuple[str, int]]) -> Path:
    """Write ``model`` as an artifact folder at ``out`` (atomically: a temp folder, then a rename)."""
    out = Path(out)
    if out.exists() and not (out / "config.json").exists():
        raise FileExistsError(f"{out} exists and is not a predictor folder; give a new --out")
    config = {"version": ARTIFACT_VERSION, "feature_spec": model.spec.to_dict(), "widths": list(model.widths),
              "dropout": model.dropout, **info}
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    with atomic_dir(out, replace=True) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "split.json").write_text(json.dumps({"train_requests": sorted(map(list, train_requests))}) + "\n")
        save_file(state, str(tmp / "model.safetensors"))
    return out


def _read_config(path: Path) -> tuple[dict, FeatureSpec, tuple[int, ...], float]:
    """A predictor folder's config.json, checked (format version, geometry against the feature spec), with its
    feature spec, widths and dropout."""
    if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"{path} is not a predictor folder (needs config.json and model.safetensors)")
    try:
        config = json.loads((path / "config.json").read_text())
        spec = FeatureSpec(**config["feature_spec"])
        widths, dropout = tuple(config["widths"]), config["dropout"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path / 'config.json'} is not a predictor config ({type(err).__name__}: {err})") from err
    if config.get("version") != ARTIFACT_VERSION:
        raise ValueError(f"{path}: predictor format version {config.get('version')} is not supported "
                         f"(expected {ARTIFACT_VERSION})")
    geometry = config.get("geometry")
    if geometry and (geometry.get("num_layers"), geometry.get("num_experts"), geometry.get("top_k")) != (
            spec.num_layers, spec.num_experts, spec.top_k):
        raise ValueError(f"{path / 'config.json'}: its geometry block (L={geometry.get('num_layers')}, "
                         f"E={geometry.get('num_experts')}, k={geometry.get('top_k')}) contradicts its feature spec "
                         f"(L={spec.num_layers}, E={spec.num_experts}, k={spec.top_k}); the artifact was edited")
    return config, spec, widths, dropout


def predictor_spec(path: str | Path) -> FeatureSpec:
    """An exported predictor's feature spec (geometry, family, next-gate inputs), read without its weights."""
    return _read_config(Path(path))[1]


def load_predictor(path: str | Path, device: str | torch.device = "cpu") -> ExpertPredictor:
    """Load an exported predictor (eval mode) with torch alone."""
    path = Path(path)
    config, spec, widths, dropout = _read_config(path)
    model = ExpertPredictor(spec, widths, dropout)
    state = load_file(str(path / "model.safetensors"))
    expected = model.state_dict()
    wrong = [f"{name} {tuple(t.shape)} (config says {tuple(expected[name].shape)})" for name, t in state.items()
             if name in expected and t.shape != expected[name].shape]
    missing = sorted(expected.keys() - state.keys())
    if wrong or missing:
        raise ValueError(f"{path}: model.safetensors does not fit config.json: "
                         + (f"{len(wrong)} tensor(s) of another shape, e.g. {wrong[0]}" if wrong
                            else f"missing {', '.join(missing[:3])}"))
    model.load_state_dict(state)
    model.config = config
    return model.to(device).eval()


def trained_requests(path: str | Path) -> set[tuple[str, int]]:
    """The (dataset, request_id) pairs a predictor artifact was trained on."""
    return {(d, int(r)) for d, r in json.loads((Path(path) / "split.json").read_text())["train_requests"]}
