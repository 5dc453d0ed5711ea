"""duoserve-train: routing statistics and the next-layer expert predictor (stages 2-3)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from duoserve.cli.common import (
    PhaseOption,
    console,
    int_list,
    new_app,
    phase_filter,
    progress,
    table,
    user_errors,
)
from duoserve.files import check_output
from duoserve.train.settings import FEATURES, FitSettings

app = new_app("Routing statistics and next-layer expert predictor training (stages 2-3).")
FIT = FitSettings(traces=())


@app.command()
def stats(
    traces: Annotated[list[Path], typer.Argument(help="Trace folders (same geometry); their counts are merged.")],
    out: Annotated[Path, typer.Option(help="Output .safetensors file (counts + JSON metadata).")]
    = Path("stats.safetensors"),
    phase: PhaseOption = "all",
    workers: Annotated[int, typer.Option(min=1, help="Processes counting a folder's part files in parallel "
                                                     "(CPU counting only).")] = 1,
    device: Annotated[str, typer.Option(help="Where to count: cpu (a compiled loop per layer pair), cuda or cuda:N "
                                             "(the read overlaps the GPU's count; the same counts bit for bit).")]
    = "cpu",
) -> None:
    """Per-layer popularity (L x E) and consecutive-layer affinity ((L-1) x E x E) with counts."""
    from duoserve.features.stats import merged_stats

    with user_errors():
        check_output(out)
        with progress("counting", total=len(traces)) as update:
            merged = merged_stats(traces, phase_filter(phase), workers, lambda: update(advance=1), device)
        merged.save(out)
    L, E = merged.geometry
    summary = table(f"statistics -> {out}", "tokens", "layers", "experts", "top expert per layer (share)")
    pop = merged.popularity
    summary.add_row(str(merged.tokens), str(L), str(E),
                    ", ".join(f"{l}:{int(pop[l].argmax())} ({pop[l].max():.2f})" for l in range(min(L, 8)))
                    + (" ..." if L > 8 else ""))
    console.print(summary)


@app.command("fit")
def fit_cmd(
    traces: Annotated[list[Path], typer.Argument(help="Trace folders (same geometry).")],
    out: Annotated[Path, typer.Option(help="Predictor artifact folder.")] = FIT.out,
    phase: Annotated[str, typer.Option(help="Tokens to train on: prefill, decode, or all.")] = "all",
    val_fraction: Annotated[float, typer.Option(help="Share of requests held out for validation.")]
    = FIT.val_fraction,
    seed: Annotated[int, typer.Option(help="Seed of the split, initialisation and shuffling.")] = FIT.seed,
    window: Annotated[Optional[int], typer.Option(help="History window in layers. [default: all previous]")]
    = FIT.window,
    widths: Annotated[str, typer.Option(help="Hidden widths, comma-separated (the paper's by default).")]
    = ",".join(map(str, FIT.widths)),
    feature: Annotated[Optional[list[str]], typer.Option(
        help=f"Features beside the history: {', '.join(FEATURES)}. Repeatable. "
             f"[default: {', '.join(FIT.features)}]")] = None,
    family: Annotated[str, typer.Option(
        help="paper: the DuoServe-MoE MLP (history + statistics); hybrid: its features plus the next-gate's "
             "scores; residual: the next-gate's log-probabilities plus a learned correction. hybrid and residual "
             "need traces recorded with --lookahead >= 1 (duoserve-trace collect records depth 1). auto: hybrid "
             "where the traces carry the next-gate's scores, else paper.")] = FIT.family,
    lookahead: Annotated[int, typer.Option(
        min=1, help="Heads for look-ahead depths 1..D: predict layer l+d's experts when layer l runs (the runtime's "
                    "--lookahead d needs D >= d). Next-gate features at depth d need traces recorded with "
                    "--lookahead >= D.")] = FIT.lookahead,
    epochs: Annotated[int, typer.Option(min=1, help="Maximum epochs (early stopping on validation exact-top-k).")]
    = FIT.epochs,
    patience: Annotated[int, typer.Option(help="Epochs without improvement before stopping.")] = FIT.patience,
    batch_size: Annotated[int, typer.Option(min=1, help="Examples per step.")] = FIT.batch_size,
    lr: Annotated[float, typer.Option(help="AdamW learning rate.")] = FIT.lr,
    loss: Annotated[str, typer.Option(
        help="bce: binary cross-entropy per expert (the paper's); softmax: cross-entropy of a softmax over the "
             "experts, blind to a shift of all logits (for the residual family: it learns ranking only; on FLAME-MoE's "
             "real routing it lifted the paper family's recall from 0.65 to 0.76: docs/benchmarks.md).")]
    = FIT.loss,
    accelerator: Annotated[str, typer.Option(help="Lightning accelerator: auto, cpu, gpu.")] = FIT.accelerator,
    devices: Annotated[str, typer.Option(help="Lightning devices: auto, 1, 2, ...")] = str(FIT.devices),
    strategy: Annotated[str, typer.Option(help="Lightning strategy: auto, ddp, ...")] = FIT.strategy,
    num_nodes: Annotated[int, typer.Option(min=1, help="Machines (Lightning's num_nodes; launch each with torchrun "
                                                       "or your cluster's launcher).")] = FIT.num_nodes,
    onnx: Annotated[bool, typer.Option(
        help="Also write model.onnx into the artifact, checked against PyTorch (needs duoserve[onnx]).")] = False,
    clean: Annotated[bool, typer.Option(
        help="Start afresh (drop the checkpoints of an earlier fit to this --out) and remove the checkpoints and "
             "logs once the artifact is written.")] = FIT.clean,
    verbose: Annotated[bool, typer.Option(help="Show Lightning's own banners and warnings.")] = FIT.verbose,
) -> None:
    """Train the next-layer expert predictor (Lightning) and export it as a self-contained artifact."""
    from duoserve.train.fit import fit

    with user_errors():
        settings = FitSettings(
            traces=traces, out=out, phase=phase_filter(phase), val_fraction=val_fraction, seed=seed, window=window,
            widths=int_list(widths, "--widths"),
            features=tuple(feature) if feature else FIT.features, family=family, lookahead=lookahead, epochs=epochs,
            patience=patience,
            batch_size=batch_size, lr=lr, loss=loss, accelerator=accelerator,
            devices=int(devices) if devices.isdigit() else devices, strategy=strategy, num_nodes=num_nodes,
            clean=clean, verbose=verbose)
        result = fit(settings)
    if result.out is None:
        return
    summary = table(f"validation ({result.val_examples} token-layer examples) -> {result.out}", "predictor",
                    "exact-top-k", "at-least-half", "recall")
    for name, m in result.metrics.items():
        label = name if name != "predictor" else f"[bold]trained MLP ({result.family})[/]"
        summary.add_row(label, f"{m['exact_topk']:.3f}", f"{m['at_least_half']:.3f}", f"{m['recall']:.3f}")
    console.print(summary)
    console.print(f"{result.train_examples} training examples, {result.epochs} epoch(s), {result.seconds:.0f} s"
                  + (" (resumed from a checkpoint: the seconds are this run's; the result is close to, not bit-exact "
                     "with, an uninterrupted fit)" if result.resumed else ""))
    if result.work_dir is not None:
        console.print(f"checkpoints and logs: {result.work_dir} (--clean removes them)")
    if onnx:
        from duoserve.predictor.artifact import load_predictor
        from duoserve.predictor.onnx import export_onnx

        with user_errors():
            path, diff = export_onnx(load_predictor(result.out), result.out)
        console.print(f"ONNX: {path} (onnxruntime vs PyTorch: max |logit difference| {diff:.1e})")


if __name__ == "__main__":
    app()
