"""ONNX export of a trained predictor, for runtimes outside Python (optional: pip install 'duoserve[onnx]').

The graph is the BatchNorm-folded predictor with the features built inside it, as in PyTorch:
inputs ``history`` (B x L x k int64 expert ids; layers >= target are ignored), ``target`` (B int64
layer ids in 1..L-1) and, for next-gate predictors, ``nextgate`` (B x m int64, the next-gate's ids,
its top-k first) and, for the hybrid and residual families, ``nextgate_scores`` (B x m float32), and for
predictors with look-ahead heads ``depth`` (B int64 in 1..A; the source layer is target - depth); output ``logits``
(B x E). The batch size is dynamic. ``export_onnx`` checks the file with onnxruntime against the
PyTorch module on random inputs before it puts it in place.
"""

from __future__ import annotations

from pathlib import Path

import torch

from duoserve.files import atomic_path
from duoserve.predictor.fast import fold_batchnorm
from duoserve.predictor.model import ExpertPredictor

ONNX_FILE = "model.onnx"


def _random_inputs(predictor: ExpertPredictor, batch: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    s = predictor.spec
    inputs = {"history": torch.randint(0, s.num_experts, (batch, s.num_layers, s.top_k), generator=generator),
              "target": torch.randint(1, s.num_layers, (batch,), generator=generator)}
    if s.uses_nextgate:
        order = torch.rand(batch, s.num_experts, generator=generator).argsort(1)
        inputs["nextgate"] = order[:, :s.width]  # distinct ids, as a router gives them
    if s.uses_scores:
        inputs["nextgate_scores"] = torch.rand(batch, s.width, generator=generator).sort(1, descending=True).values
    if s.lookahead > 1:
        inputs["depth"] = torch.randint(1, s.lookahead + 1, (batch,), generator=generator)
        inputs["target"] = torch.maximum(inputs["target"], inputs["depth"])  # a source layer >= 0
    return inputs


def check_onnx(path: str | Path, predictor: ExpertPredictor, batch: int = 64, atol: float = 1e-4) -> float:
    """Largest |onnxruntime - PyTorch| logit difference on random inputs; raises if above ``atol``."""
    import onnxruntime

    module = fold_batchnorm(predictor).cpu()
    inputs = _random_inputs(predictor, batch, torch.Generator().manual_seed(0))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (ours,) = session.run(["logits"], {name: t.numpy() for name, t in inputs.items()})
    with torch.no_grad():
        theirs = module(**inputs).numpy()
    diff = float(abs(ours - theirs).max())
    if diff > atol:
        raise RuntimeError(f"ONNX export of the predictor differs from PyTorch by {diff:.2e} (> {atol:.0e})")
    return diff


def export_onnx(predictor: ExpertPredictor, folder: str | Path) -> tuple[Path, float]:
    """Write ``folder/model.onnx`` (checked, then renamed into place); the path and the checked difference."""
    try:
        import onnxruntime  # noqa: F401  (fail before the slow export when the extra is missing)
        import onnxscript  # noqa: F401
    except ImportError as err:
        raise RuntimeError("ONNX export needs the onnx extra: pip install 'duoserve[onnx]'") from err
    module = fold_batchnorm(predictor).cpu()
    example = _random_inputs(predictor, 5, torch.Generator().manual_seed(0))
    path = Path(folder) / ONNX_FILE
    with atomic_path(path) as tmp:
        program = torch.onnx.export(module, (), kwargs=example, input_names=list(example),
                                    output_names=["logits"], dynamo=True, verbose=False,
                                    dynamic_shapes={name: {0: "batch"} for name in example})
        program.save(tmp)
        diff = check_onnx(tmp, predictor)
    return path, diff
