"""Predictors on a real model's routing: FLAME-MoE (pretrained, 25 MoE layers, 64 experts, top-6), as a learning curve.

    python benchmarks/flame_moe.py --out benchmarks/results/flame_moe_cpu.json     # about 15 minutes on 2 cores
    python benchmarks/flame_moe.py --import-to DIR     # only write the 64-token sequences as a trace folder

Reads the two routing files in ``../shared/data/flame-moe/`` (see its README; never copied into the
repository): 32 sequences of 64 tokens and 64 sequences of 10 tokens, each sequence one request,
imported with ``duoserve-trace import --format npy`` into two trace folders (datasets
``flame-encoder`` and ``flame-decoder``, phase prefill: pretraining text, nothing generated).
These files hold no hidden states, so no next-gate can be computed: the history-only paper family
(history + popularity + affinity) is fitted with heads for depths 1..D on growing shares of the
training requests and scored, with the popularity and affinity-Markov baselines, on the same
held-out requests (validation share 0.2, seed 0) at every depth.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

from duoserve.bench.results import parser, write_result
from duoserve.evaluate.generalization import learning_curve
from duoserve.trace.importers import ImportSettings, import_trace
from duoserve.train.settings import FitSettings

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "flame-moe"
FILES = {"flame-encoder": "flame_moe_encoder_32seqs_x64tok_25layers.npz",
         "flame-decoder": "flame_moe_decoder_64seqs_pos0-9_25layers.npz"}


def requests_of(path: Path) -> dict[str, np.ndarray]:
    """One [L, T, k] array of expert ids per sequence of a FLAME-MoE routing file, in sequence order."""
    ids = np.load(path)["topk_indices"]
    if ids.ndim == 3:  # L x (sequences * tokens) x k, sequence-major, 64 tokens each
        L, n, k = ids.shape
        return {f"{s:03d}": ids[:, s * 64:(s + 1) * 64] for s in range(n // 64)}
    return {f"{s:03d}": ids[:, :, s].transpose(1, 0, 2) for s in range(ids.shape[2])}  # positions x L x seqs x k


def import_flame(data: Path, work: Path) -> list[Path]:
    """The two files as duoserve trace folders under ``work``; their paths."""
    missing = [name for name in FILES.values() if not (data / name).exists()]
    if missing:
        raise FileNotFoundError(f"FLAME-MoE routing files not found in {data}: {', '.join(missing)}")
    traces = []
    for dataset, name in FILES.items():
        source = work / f"{dataset}.npz"
        np.savez(source, **requests_of(data / name))
        out = work / dataset
        import_trace(ImportSettings(source=source, out=out, format="npy", layout="lt", dataset=dataset,
                                    phase="prefill", model="flame-moe-290m"))
        traces.append(out)
    return traces


def import_sequences(dest: Path, data: Path = DATA) -> Path:
    """The encoder file's 64-token sequences (the decoder file's are 10 tokens long) as one trace folder at ``dest``:
    what the engine replays (``runtime_pinning.py``, ``simulate_h200.sh``)."""
    with tempfile.TemporaryDirectory() as scratch:
        encoder, _ = import_flame(data, Path(scratch))
        shutil.move(encoder, dest)
    return dest


def main() -> None:
    ap = parser(__doc__, geometry=None)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--fractions", default="0.25,0.5,1")
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--widths", default="2048,1024,512,256,128,64")
    ap.add_argument("--loss", default="bce", help="the fit's loss: bce or softmax (duoserve-train fit --loss)")
    ap.add_argument("--import-to", type=Path, default=None,
                    help="write the 64-token sequences as a trace folder here and stop (no fits)")
    args = ap.parse_args()
    if args.import_to:
        print(f"trace: {import_sequences(args.import_to, args.data)}")
        return
    fractions = [float(f) for f in args.fractions.split(",")]
    with tempfile.TemporaryDirectory(prefix="duoserve-flame-") as scratch:
        work = Path(scratch)
        traces = import_flame(args.data, work)
        base = FitSettings(traces=traces, features=("popularity", "affinity"), lookahead=args.lookahead,
                           epochs=args.epochs, widths=tuple(int(w) for w in args.widths.split(",")),
                           val_fraction=0.2, loss=args.loss, progress=False)
        curve = learning_curve(traces, work / "fits", base, fractions, progress=print)
    print(curve.pivot_table(index="scorer", columns="train_requests", values="exact_topk").round(3).to_string())
    print(curve.pivot_table(index="scorer", columns="train_requests", values="recall").round(3).to_string())
    write_result(args.out, {
        "benchmark": "flame_moe", "data": "FLAME-MoE traces (CMU-FLAME/FLAME-MoE-Traces, flame-moe-290m), "
                                          "../shared/data/flame-moe", "geometry": {"L": 25, "E": 64, "k": 6},
        "family": "paper", "features": ["history", "popularity", "affinity"], "lookahead": args.lookahead,
        "loss": args.loss, "epochs": args.epochs, "widths": args.widths, "val_fraction": 0.2,
        "split": "validation: all phases",
        "learning_curve": curve.to_dict("records"),
    })


if __name__ == "__main__":
    main()
