"""What a fit is told: the settings of ``duoserve.train.fit``, declared once (the CLI takes its defaults from here).

Light to import: no Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from duoserve.predictor.model import PAPER_WIDTHS

FEATURES = ("popularity", "affinity", "nextgate")


@dataclass
class FitSettings:
    traces: Sequence[Path]
    out: Path = Path("predictor")
    phase: str | None = None  # None: prefill and decode tokens
    datasets: Sequence[str] | None = None
    val_fraction: float = 0.1
    train_fraction: float = 1.0  # share of the training requests used (learning curves)
    seed: int = 0
    window: int | None = None  # None: all previous layers
    widths: tuple[int, ...] = PAPER_WIDTHS
    dropout: float = 0.1
    features: Sequence[str] = ("popularity", "affinity")  # plus "nextgate" if wanted
    family: str = "auto"  # duoserve.predictor.model.FAMILIES, or auto: hybrid where the traces carry next-gate scores
    lookahead: int = 1  # A: one head per depth 1..A (predict layer l+d when layer l runs)
    epochs: int = 10
    batch_size: int = 1024
    lr: float = 1e-3
    weight_decay: float = 0.01
    loss: str = "bce"  # duoserve.train.lightning.routing_loss: bce (the paper's) or softmax
    patience: int = 3
    accelerator: str = "auto"
    devices: str | int = "auto"
    strategy: str = "auto"
    num_nodes: int = 1  # machines, for Lightning's multi-node strategies
    progress: bool = True
    verbose: bool = False  # Lightning's own banners and warnings
    clean: bool = False  # start afresh (drop earlier checkpoints), and remove checkpoints and logs once exported
