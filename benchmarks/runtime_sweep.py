"""Merge `duoserve-run bench` results of one model, check the targets across them, and draw the sweeps.

A full-depth model fits one pinned host copy per process, so its policies run in separate processes on the same
machine (``runtime_full_depth_h200.sh``); this puts their runs side by side (each run keeps its ``source``
file and the bounds its own process measured), recomputes the targets over all of them (so duoserve is compared
with Accelerate's runs of the other process, same batch size and prompt length), and draws time per output token
against batch size and TTFT against prefill tokens (B x S), one line per policy. With ``--llama-cpp`` it also
tabulates llama.cpp's runs (``llama_cpp_h200.sh``) beside the bench file named by ``--llama-cpp-peer``.

    python benchmarks/runtime_sweep.py benchmarks/results/runtime_full_*qwen3-30b-a3b_h200.json \
        --out benchmarks/results/runtime_full_depth_h200.json --plots benchmarks/results/runtime_full_depth \
        --title Qwen3-30B-A3B \
        --llama-cpp benchmarks/results/llama_cpp_mixtral-8x7b_h200.json \
        --llama-cpp-peer benchmarks/results/runtime_vs_llama_cpp_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from duoserve.bench.results import write_result
from duoserve.bench.targets import check_targets

PEER_POLICIES = ("duoserve", "cpu-experts", "on-demand", "all-resident", "all-resident-compiled")


def merge(files: list[Path]) -> tuple[list[dict], list[dict], int]:
    """Every run of ``files``, each tagged with the file it came from; the policies a bench left out (a resident
    reference that did not fit the GPU: the bounds then lack their compute side); and their model's MoE layers
    (refused if the files are of different depths)."""
    runs, skipped, depths = [], [], set()
    for path in files:
        data = json.loads(path.read_text())
        if not data.get("complete", True):
            print(f"note: {path.name} is partial (its bench was stopped); its runs so far are used")
        for note in data.get("skipped", []):
            print(f"note: {path.name} did not run {note['policy']}: {note['reason']}")
            skipped.append({**note, "source": path.name})
        runs += [{**r, "source": path.name} for r in data["runs"]]
        depths.add(data["geometry"]["moe_layers"])
    if len(depths) != 1:
        raise SystemExit(f"the files have different depths {sorted(depths)}: merge one model's files")
    return runs, skipped, depths.pop()


def plot(runs: list[dict], prefix: Path, title: str) -> list[Path]:
    """TPOT against batch size and TTFT against prefill tokens, a line per policy (markers: prompt length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = {128: "v", 512: "o", 2048: "s"}
    written = []
    for name, x_of, y_key, xlabel, ylabel in (
            ("tpot_vs_batch", lambda r: r["batch_size"], "tpot_ms", "batch size B", "time per output token (ms)"),
            ("ttft_vs_tokens", lambda r: r["batch_size"] * r["prompt_len"], "ttft_s", "prefill tokens (B x S)",
             "time to first token (s)")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        colors = {}
        for policy in sorted({r["policy"] for r in runs}):
            for S in sorted({r["prompt_len"] for r in runs if r["policy"] == policy}):  # a line per prompt length
                mine = sorted((r for r in runs if r["policy"] == policy and r["prompt_len"] == S and r[y_key]),
                              key=x_of)
                line, = ax.plot([x_of(r) for r in mine], [r[y_key] for r in mine], marker=markers.get(S, "x"),
                                color=colors.get(policy), alpha=0.8, label=None if policy in colors else policy)
                colors[policy] = line.get_color()
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
        ax.legend(fontsize=7, title="markers: S 128 v, 512 o, 2048 s", title_fontsize=7)
        fig.tight_layout()
        path = prefix.with_name(f"{prefix.name}_{name}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def llama_table(llama: Path, peer: Path) -> list[dict]:
    """One row per (who, B): llama.cpp's placements and the bench's policies on the same shape."""
    rows = [{"who": f"llama.cpp {r['placement']}", "batch_size": r["batch_size"], "ttft_s": r["ttft_s"],
             "tpot_ms": r["tpot_ms"]} for r in json.loads(llama.read_text())["runs"]]
    rows += [{"who": r["policy"], "batch_size": r["batch_size"], "ttft_s": r["ttft_s"], "tpot_ms": r["tpot_ms"]}
             for r in json.loads(peer.read_text())["runs"] if r["policy"] in PEER_POLICIES]
    return sorted(rows, key=lambda r: (r["batch_size"], r["who"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", type=Path, nargs="+", help="bench result files of one model")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plots", type=Path, help="path prefix of the two PNG files")
    parser.add_argument("--title", default="", help="the plots' title (the model), before the depth")
    parser.add_argument("--llama-cpp", type=Path, help="llama_cpp_h200.sh's llama.cpp result")
    parser.add_argument("--llama-cpp-peer", type=Path, help="the bench result of the same shape")
    args = parser.parse_args()
    runs, skipped, depth = merge(args.files)
    targets = [t for t in check_targets(runs) if t["round"] != "median"]
    report = {"files": [f.name for f in args.files], "runs": runs, "skipped": skipped, "targets": targets}
    for t in targets:
        verdict = "met" if t["met"] else "NOT met"
        print(f"B={t['batch_size']} S={t['prompt_len']} {t['target']}: {t['value']:.2f} {verdict}")
    if args.llama_cpp:
        report["llama_cpp"] = llama_table(args.llama_cpp, args.llama_cpp_peer)
        for r in report["llama_cpp"]:
            print(f"B={r['batch_size']} {r['who']:24s} TTFT {r['ttft_s']:.3f} s  TPOT {r['tpot_ms']:.2f} ms")
    if args.plots:
        report["plots"] = [p.name for p in plot(runs, args.plots, f"{args.title} {depth} MoE layers, H200".strip())]
    write_result(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
