"""The accuracy report on disk: report.json (every number and what produced it), report.md, PNG plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from duoserve.evaluate.accuracy import AccuracyReport, save_json
from duoserve.features.stats import RoutingStats
from duoserve.files import check_output, write_text

HEADLINE = ["examples", "exact_topk", "at_least_half", "recall"]


def markdown_table(df: pd.DataFrame, index_name: str) -> str:
    cols = list(df.columns)
    lines = [f"| {index_name} | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    ints = {c for c in cols if pd.api.types.is_integer_dtype(df[c])}
    for idx, row in zip(df.index, df.itertuples(index=False)):
        cells = [str(v) if c in ints else ("-" if v != v else f"{v:.3f}") if isinstance(v, float) else str(v)
                 for c, v in zip(cols, row)]  # NaN (v != v): a scorer not scored there
        lines.append(f"| {idx} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_layer(report: AccuracyReport, phase: str, metric: str, depth: int = 1) -> pd.DataFrame:
    t = report.at_depth(depth)
    t = t[(t.phase == phase) & (t.dataset == "all") & (t.layer != "all")]
    return t.pivot(index="layer", columns="scorer", values=metric).sort_index(key=lambda s: s.astype(int))


def to_markdown(report: AccuracyReport, extra: str = "") -> str:
    info, k = report.info, report.info["geometry"]["top_k"]
    family = info.get("predictor_config", {}).get("feature_spec", {}).get("family", "paper")
    parts = [
        "# Expert-prediction accuracy report", "",
        f"Predictor `{info['predictor']}` ({family} family) on traces {', '.join(f'`{t}`' for t in info['traces'])}: "
        f"{info['evaluated_requests']} requests it was not trained on ({info['evaluated_tokens']} tokens, "
        f"{info['examples']} token-layer predictions); {info['skipped_trained_requests']} trained-on requests "
        f"skipped. Geometry L={info['geometry']['num_layers']}, E={info['geometry']['num_experts']}, k={k}. "
        "Baselines use the predictor's training requests only.", "",
    ]
    for phase in ("decode", "prefill", "all"):
        overall = report.overall(phase)
        if overall.empty:
            continue
        parts += [f"## {phase} tokens", "", markdown_table(overall[HEADLINE], "scorer"), ""]
    decode = report.overall("decode")
    if not decode.empty and "next-gate" in decode.index:
        mlp, ng = decode.loc["trained MLP", "exact_topk"], decode.loc["next-gate", "exact_topk"]
        verdict = "ahead of" if mlp > ng else "behind"
        parts += [f"On decode tokens the trained MLP is **{verdict}** the next-gate speculation on exact-top-k "
                  f"({mlp:.3f} vs {ng:.3f}).", ""]
    budgets = [c for c in report.table.columns if c.startswith(("recall@", "precision@"))]
    parts += ["## Fetching more than k (decode)", "",
              markdown_table(report.overall("decode" if not decode.empty else "all")[budgets], "scorer"), ""]
    t = report.at_depth(1)
    by_dataset = t[(t.phase == "decode") & (t.layer == "all") & (t.dataset != "all")]
    if not by_dataset.empty:
        parts += ["## Per dataset (decode, exact-top-k)", "",
                  markdown_table(by_dataset.pivot(index="scorer", columns="dataset", values="exact_topk"), "scorer"), ""]
    parts += ["## Per layer (decode, exact-top-k)", "",
              markdown_table(per_layer(report, "decode" if not decode.empty else "all", "exact_topk"), "layer"), ""]
    parts += depth_section(report, "decode" if not decode.empty else "all")
    parts += ["## Scorers", "", *(f"- **{n}**: {d}" for n, d in info["scorers"].items()), "", extra]
    return "\n".join(parts)


def by_depth(report: AccuracyReport, phase: str, metric: str) -> pd.DataFrame:
    """scorer x depth: ``metric`` of every scorer at each look-ahead depth it was scored at."""
    t = report.table
    t = t[(t.phase == phase) & (t.dataset == "all") & (t.layer == "all")]
    return t.pivot(index="scorer", columns="depth", values=metric)


def depth_section(report: AccuracyReport, phase: str) -> list[str]:
    """The look-ahead table and, per depth, which of the trained MLP and next-gate wins; nothing at depth 1 only."""
    if report.depths == [1]:
        return []
    parts = [f"## Look-ahead depth ({phase})", "",
             "Layer t predicted when layer t - d runs (next-gate: layer t's router on layer t - d's input).", ""]
    for metric in ("exact_topk", "at_least_half"):
        table = by_depth(report, phase, metric)
        table.columns = [f"d={d}" for d in table.columns]
        parts += [f"{metric.replace('_', '-')}:", "", markdown_table(table, "scorer"), ""]
    exact = by_depth(report, phase, "exact_topk")
    for d in exact.columns:
        column = exact[d].drop("oracle", errors="ignore").dropna()
        if not column.empty:
            parts.append(f"- d={d}: best is **{column.idxmax()}** ({column.max():.3f} exact-top-k)"
                         + (f"; trained MLP {column['trained MLP']:.3f} vs next-gate {column['next-gate']:.3f}"
                            if {"trained MLP", "next-gate"} <= set(column.index) else ""))
    parts.append("")
    for d in report.depths[1:]:
        parts += [f"Per layer, {d} layers ahead ({phase}, exact-top-k):", "",
                  markdown_table(per_layer(report, phase, "exact_topk", d), "layer"), ""]
    return parts


def plot_all(report: AccuracyReport, stats: RoutingStats | None, out: Path) -> list[Path]:
    """per_layer.png, depth.png (look-ahead depths > 1 only), popularity.png, affinity.png; returns the files
    written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    phase = "decode" if not report.overall("decode").empty else "all"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, metric in zip(axes, ("exact_topk", "at_least_half")):
        data = per_layer(report, phase, metric).drop(columns=["oracle"], errors="ignore")
        for col in data.columns:
            ax.plot(data.index.astype(int), data[col], marker="o", label=col)
        ax.set(xlabel="predicted layer", ylabel=metric.replace("_", "-"), title=f"{metric} per layer ({phase})",
               ylim=(0, 1.02))
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    written.append(out / "per_layer.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    if report.depths != [1]:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        for ax, metric in zip(axes, ("exact_topk", "at_least_half")):
            data = by_depth(report, phase, metric).drop(index=["oracle"], errors="ignore")
            for scorer, row in data.iterrows():
                row = row.dropna()
                ax.plot(row.index.astype(int), row.values, marker="o", label=scorer)
            ax.set(xlabel="look-ahead depth d (layers)", ylabel=metric.replace("_", "-"), ylim=(0, 1.02),
                   title=f"{metric} versus depth ({phase})", xticks=report.depths)
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        written.append(out / "depth.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    if stats is not None:
        from matplotlib.ticker import MaxNLocator

        fig, ax = plt.subplots(figsize=(8, 4))
        im = ax.imshow(stats.popularity, aspect="auto", cmap="viridis")
        ax.set(xlabel="expert", ylabel="MoE layer", title="popularity (training requests)")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(im, label="share of the layer's selections")
        written.append(out / "popularity.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
        pairs = stats.affinity.shape[0]
        shown = np.unique(np.linspace(0, pairs - 1, min(pairs, 8)).round().astype(int))  # every pair, or 8 spread
        cols = min(4, len(shown))
        rows = -(-len(shown) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols + 1, 3.2 * rows), squeeze=False,
                                 layout="constrained")
        for ax in axes.flat[len(shown):]:
            ax.set_axis_off()
        top = float(stats.affinity[shown].max()) or 1.0  # one colour scale for every pair shown
        for i, (l, ax) in enumerate(zip(shown, axes.flat)):
            im = ax.imshow(stats.affinity[l], cmap="magma", vmin=0, vmax=top)
            ax.set(title=f"layer {l} -> {l + 1}", xlabel="expert at l+1", ylabel="expert at l" if i % cols == 0 else "")
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(im, ax=axes, label="P(expert at l+1 | expert at l)")
        fig.suptitle(f"affinity between consecutive layers ({len(shown)} of {pairs} pairs)")
        written.append(out / "affinity.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def check_report_dir(out: Path) -> Path:
    """Refuse, before any work, a report folder that cannot be written or that holds other files than a report."""
    check_output(out, folder=True)
    if out.is_dir() and any(out.iterdir()) and not (out / "report.json").exists():
        raise ValueError(f"{out} holds other files and no report; give a new or empty folder, or a report folder "
                         "to overwrite")
    return out


def write_report(report: AccuracyReport, out: Path, stats: RoutingStats | None = None, extra_md: str = "") -> Path:
    """Write report.json, report.md and the plots into ``out``."""
    check_report_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    report.info["plots"] = [p.name for p in plot_all(report, stats, out)]
    save_json(report, out / "report.json")
    write_text(out / "report.md", to_markdown(report, extra_md))
    return out
