"""Fit an expert predictor (one head per look-ahead depth) on traces and export it as a self-contained artifact.

Shape legend: B examples in a batch, L MoE layers, E experts, k top-k, A look-ahead depths.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import lightning as pl
import numpy as np
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from duoserve.features.examples import (
    Examples,
    ExampleSet,
    RoutingTable,
    load_routing,
    make_examples,
    source_experts,
    split_requests,
)
from duoserve.features.stats import stats_from_ids
from duoserve.files import check_output, write_json
from duoserve.metrics import topk_metrics
from duoserve.predictor.artifact import save_predictor
from duoserve.predictor.baselines import affinity_markov_scores, nextgate_rank_scores, popularity_scores
from duoserve.predictor.model import FAMILIES, ExpertPredictor, FeatureSpec
from duoserve.trace.format import open_trace
from duoserve.train.lightning import LOSSES, PredictorModule, RoutingDataModule
from duoserve.train.settings import FEATURES, FitSettings

MONITOR = "val/exact_topk"


@dataclass
class FitResult:
    out: Path | None  # None on non-zero DDP ranks
    metrics: dict[str, dict[str, float]]  # on validation examples: predictor and baselines
    train_examples: int
    val_examples: int
    epochs: int
    seconds: float  # of this run only: a resumed fit does not count the interrupted one
    info: dict = field(default_factory=dict)
    work_dir: Path | None = None  # checkpoints and logs (None once cleaned)
    resumed: bool = False  # continued from a checkpoint: close to, but not bit-exact with, an uninterrupted fit
    family: str = "paper"  # the family trained (``auto`` resolved)


def depth_label(name: str, depth: int) -> str:
    """A scorer's name at a look-ahead depth: itself at depth 1, ``name (d=2)`` deeper."""
    return name if depth == 1 else f"{name} (d={depth})"


@torch.no_grad()
def validation_metrics(predictor: ExpertPredictor, table: RoutingTable, val: Examples,
                       batch_size: int = 8192) -> dict[str, dict[str, float]]:
    """exact-top-k / at-least-half / recall on ``val`` of the predictor and the zero-training baselines, per
    look-ahead depth (``depth_label``)."""
    predictor = predictor.eval().cpu()
    spec = predictor.spec
    metrics = {}
    for d in range(1, spec.lookahead + 1):
        at = np.flatnonzero(val.depth == d)
        data = ExampleSet(table, Examples(val.token[at], val.target[at], val.depth[at]))
        scores: dict[str, list[torch.Tensor]] = {"predictor": [], "popularity": [], "affinity": []}
        if data.nextgate is not None:
            scores["nextgate"] = []
        truth = []
        for i in range(0, len(data), batch_size):
            b = data.__getitems__(list(range(i, min(i + batch_size, len(data)))))
            scores["predictor"].append(predictor(b["history"], b["target"], b.get("nextgate"),
                                                 b.get("nextgate_scores"), b["depth"]))
            scores["popularity"].append(popularity_scores(predictor.popularity, b["target"]))
            scores["affinity"].append(affinity_markov_scores(predictor.affinity, source_experts(b), b["target"],
                                                             b["depth"], d))
            if "nextgate" in scores:
                scores["nextgate"].append(nextgate_rank_scores(b["nextgate"], spec.num_experts))
            truth.append(b["truth"])
        truth_t = torch.cat(truth)
        metrics |= {depth_label(name, d): topk_metrics(torch.cat(s), truth_t, spec.num_experts)
                    for name, s in scores.items()}
    return metrics


def default_family(table: RoutingTable, lookahead: int) -> str:
    """``auto``'s family: hybrid where the traces carry the next-gate's scores to ``lookahead`` layers (it leads the
    other families within a task on both substrates, docs/benchmarks.md), else paper (history and statistics only:
    imported traces, version-1 traces, models without next-gate)."""
    return "hybrid" if table.nextgate_depth >= lookahead and len(table.nextgate_scores) >= lookahead else "paper"


def _work_dir(s: FitSettings) -> Path:
    return s.out.parent / f".{s.out.name}.lightning"


def fit(s: FitSettings) -> FitResult:
    """Train on the traces' training requests, pick the epoch with the best validation exact-top-k, export."""
    start = time.time()
    unknown = set(s.features) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown feature(s) {sorted(unknown)}; choose from {', '.join(FEATURES)}")
    if s.epochs < 1 or s.batch_size < 1 or s.lr <= 0:
        raise ValueError("epochs and batch size must be >= 1 and the learning rate > 0")
    check_output(s.out, folder=True)
    if s.out.exists() and not (s.out / "config.json").exists():
        raise FileExistsError(f"{s.out} exists and is not a predictor folder; give a new --out")
    traces = [open_trace(p) for p in s.traces]
    table = load_routing(traces, s.phase, s.datasets, s.lookahead)
    meta = table.meta
    L, E, k = meta.num_layers, meta.num_experts, meta.top_k
    if L < 2:
        raise ValueError("a next-layer predictor needs at least 2 MoE layers")
    if not 1 <= s.lookahead <= L - 1:
        raise ValueError(f"look-ahead must be in 1..{L - 1} layers for this {L}-layer model, got {s.lookahead}")
    if s.family == "auto":
        s = replace(s, family=default_family(table, s.lookahead))
    if s.family not in FAMILIES:
        raise ValueError(f"unknown predictor family {s.family!r}; choose from auto, {', '.join(FAMILIES)}")
    if s.loss not in LOSSES:
        raise ValueError(f"unknown loss {s.loss!r}; choose from {', '.join(LOSSES)}")
    if ("nextgate" in s.features or s.family != "paper") and table.nextgate_depth < s.lookahead:
        raise ValueError(f"the {'nextgate feature' if s.family == 'paper' else s.family + ' family'} at look-ahead "
                         f"{s.lookahead} needs traces recorded with --lookahead >= {s.lookahead} (these have "
                         f"{table.nextgate_depth})")
    if s.family != "paper" and len(table.nextgate_scores) < s.lookahead:
        raise ValueError(f"the {s.family} family needs the next-gate's scores: traces of format version 2 (trace "
                         "again with this duoserve)")
    spec = FeatureSpec(L, E, k, s.window or L - 1, "popularity" in s.features, "affinity" in s.features,
                       "nextgate" in s.features, s.family, table.nextgate[1].shape[2] if table.nextgate else 0,
                       s.lookahead)

    val_request = split_requests(table.requests, s.val_fraction, s.seed)  # per request
    train_request = ~val_request
    if not 0.0 < s.train_fraction <= 1.0:
        raise ValueError(f"train fraction must be in (0, 1], got {s.train_fraction}")
    if s.train_fraction < 1.0:
        candidates = np.flatnonzero(train_request)
        keep = np.random.default_rng(s.seed).choice(candidates, max(1, round(len(candidates) * s.train_fraction)),
                                                    replace=False)
        train_request = np.zeros_like(train_request)
        train_request[keep] = True
    val_token, train_token = val_request[table.request], train_request[table.request]  # per token
    depths = range(1, s.lookahead + 1)
    train, val = (make_examples(np.flatnonzero(train_token), L, depths),
                  make_examples(np.flatnonzero(val_token), L, depths))
    stats = stats_from_ids(table.ids[train_token], E)  # training requests only: nothing leaks from validation

    work = _work_dir(s)
    pl.seed_everything(s.seed, verbose=False)
    module = PredictorModule(spec.to_dict(), tuple(s.widths), s.dropout, s.lr, s.weight_decay,
                             torch.from_numpy(stats.popularity), torch.from_numpy(stats.affinity), s.loss)
    checkpoint = ModelCheckpoint(dirpath=work / "checkpoints", monitor=MONITOR, mode="max", save_last=True)
    with _quiet(s.verbose):
        try:  # Lightning checks accelerator, devices and strategy here: before anything is written
            trainer = pl.Trainer(
                max_epochs=s.epochs, accelerator=s.accelerator, devices=s.devices, strategy=s.strategy,
                num_nodes=s.num_nodes,
                callbacks=[checkpoint, EarlyStopping(monitor=MONITOR, mode="max", patience=s.patience)],
                logger=CSVLogger(work, name="logs"), default_root_dir=work, enable_progress_bar=s.progress,
                enable_model_summary=False, num_sanity_val_steps=0,
            )
        except MisconfigurationException as err:
            raise ValueError(f"Lightning cannot run accelerator={s.accelerator!r}, devices={s.devices!r}, "
                             f"strategy={s.strategy!r} here: {err}") from err
    # what must match to resume: the data and the model, not where it runs
    run = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items() if k not in _NOT_RUN_IDENTITY}
    run["traces"] = [str(p) for p in s.traces]
    if s.clean and work.exists():
        shutil.rmtree(work)
    run_file, last = work / "run.json", work / "checkpoints" / "last.ckpt"
    resume = str(last) if last.exists() else None
    if resume and json.loads(run_file.read_text()) != json.loads(json.dumps(run)):
        raise FileExistsError(f"{work} holds a fit with other settings; pass --clean to start afresh, or use "
                              "another --out")
    write_json(run_file, run)

    with _quiet(s.verbose):
        trainer.fit(module, datamodule=RoutingDataModule(table, train, val, s.batch_size), ckpt_path=resume)
    result = FitResult(None, {}, len(train.token), len(val.token), trainer.current_epoch, 0.0, work_dir=work,
                       resumed=resume is not None, family=s.family)
    if not trainer.is_global_zero:
        return result

    best = PredictorModule.load_from_checkpoint(checkpoint.best_model_path, map_location="cpu").model
    metrics = validation_metrics(best, table, val)
    train_requests = [r for r, t in zip(table.requests, train_request) if t]
    info = {
        "geometry": {"num_layers": L, "num_experts": E, "top_k": k, "decoder_indices": meta.decoder_indices},
        "training_data": {"traces": [str(Path(p).resolve()) for p in s.traces], "model": meta.model,
                          "revision": meta.revision,
                          "datasets": sorted({d for d, _ in table.requests}), "phase": s.phase or "all",
                          "tokens": int(train_token.sum()), "trace_generation": meta.generation},
        "split": {"rule": "sha1(f'{seed}:{dataset}:{request_id}') / 2**64 < val_fraction is validation",
                  "seed": s.seed, "val_fraction": s.val_fraction, "train_fraction": s.train_fraction,
                  "train_requests": len(train_requests),
                  "val_requests": int(val_request.sum())},
        "training": {"epochs_run": trainer.current_epoch, "best_epoch_checkpoint": Path(checkpoint.best_model_path).name,
                     "lr": s.lr, "weight_decay": s.weight_decay, "loss": s.loss, "seed": s.seed,
                     "batch_size": s.batch_size, "world_size": trainer.world_size,  # global batch: their product
                     "strategy": type(trainer.strategy).__name__},
        "metrics": {"validation": metrics},
    }
    result.out = save_predictor(best, s.out, info, train_requests)
    result.metrics, result.info, result.seconds = metrics, info, time.time() - start
    if s.clean:
        shutil.rmtree(work)
        result.work_dir = None
    return result


_NOT_RUN_IDENTITY = ("progress", "out", "accelerator", "devices", "strategy", "num_nodes", "verbose", "clean")


@contextmanager
def _quiet(verbose: bool) -> Iterator[None]:
    """Lightning's banners, tips and its own deprecation warnings off, unless ``verbose``."""
    if verbose:
        yield
        return
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"lightning\..*|copyreg")
            warnings.filterwarnings("ignore", message=r".*(LeafSpec|log_every_n_steps|num_workers).*")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
