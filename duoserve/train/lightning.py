"""Lightning wrappers: the data module over a routing table, and the training module around the predictor.

Shape legend: B examples in a batch, L MoE layers, E experts, k top-k.
"""

from __future__ import annotations

import lightning as pl
import torch
from torch.utils.data import DataLoader

from duoserve.features.examples import Examples, ExampleSet, RoutingTable
from duoserve.metrics import hit_metrics, multi_hot, overlap
from duoserve.predictor.model import ExpertPredictor, FeatureSpec

LOSSES = ("bce", "softmax")


def _identity(batch):
    return batch


class RoutingDataModule(pl.LightningDataModule):
    def __init__(self, table: RoutingTable, train: Examples, val: Examples, batch_size: int = 1024):
        super().__init__()
        self.table, self.train, self.val, self.batch_size = table, train, val, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(ExampleSet(self.table, self.train), batch_size=self.batch_size, shuffle=True,
                          collate_fn=_identity)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(ExampleSet(self.table, self.val), batch_size=self.batch_size * 4, collate_fn=_identity)


def routing_loss(logits: torch.Tensor, truth: torch.Tensor, loss: str) -> torch.Tensor:
    """The training loss of B x E ``logits`` against the B x k experts chosen (``LOSSES``): ``bce``, binary
    cross-entropy per expert (the paper's); ``softmax``, the cross-entropy of the softmax over the E experts, each
    chosen expert a target of weight 1/k. softmax is blind to a shift of all E logits, so a residual family's
    correction is pulled only by how next-gate ranks the experts, not by how its log-probabilities are calibrated."""
    if loss == "bce":
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, multi_hot(truth, logits.shape[1]))
    return -torch.log_softmax(logits, dim=1).gather(1, truth.long()).mean()


class PredictorModule(pl.LightningModule):
    """``routing_loss`` over the E experts, AdamW; validation exact-top-k / at-least-half / recall."""

    def __init__(self, spec: dict, widths: tuple[int, ...], dropout: float = 0.1, lr: float = 1e-3,
                 weight_decay: float = 0.01, popularity: torch.Tensor | None = None,
                 affinity: torch.Tensor | None = None, loss: str = "bce"):
        super().__init__()
        self.save_hyperparameters(ignore=["popularity", "affinity"])
        self.model = ExpertPredictor(FeatureSpec(**spec), widths, dropout, popularity, affinity)

    def _logits(self, batch: dict) -> torch.Tensor:
        return self.model(batch["history"], batch["target"], batch.get("nextgate"), batch.get("nextgate_scores"),
                          batch["depth"])

    def training_step(self, batch: dict, _: int) -> torch.Tensor:
        loss = routing_loss(self._logits(batch), batch["truth"], self.hparams.loss)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["target"]))
        return loss

    def validation_step(self, batch: dict, _: int) -> None:
        spec = self.model.spec
        logits = self._logits(batch)
        B = len(batch["target"])
        hits = overlap(logits.topk(spec.top_k, dim=1).indices, batch["truth"], spec.num_experts)  # B
        loss = routing_loss(logits, batch["truth"], self.hparams.loss)
        self.log("val/loss", loss, on_epoch=True, batch_size=B, sync_dist=True)
        for name, value in hit_metrics(hits, spec.top_k).items():
            self.log(f"val/{name}", value, on_epoch=True, batch_size=B, sync_dist=True, prog_bar=name != "recall")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
