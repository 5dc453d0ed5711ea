"""Does a predictor built on next-gate need the router's guesses past its top k? The same trace with its
next-gate guesses cut to the first M (M = k and the trace's own width), each family fitted and scored on the
held-out requests' decode tokens at look-ahead 1, as ``make demo`` fits and scores (4 epochs, default widths).

Why: a trace records next-gate's top M guesses (2k by default); the larger substrate's committed trace keeps
k only, to stay small, and its families stay within a point or two of next-gate there (docs/benchmarks.md). If
the guesses past k carried what they miss, a wider trace would be the fix. About 15 minutes on 2 CPU cores for
the embedded default.

    python benchmarks/nextgate_width.py [TRACES] [--family hybrid residual] [--out FILE.json]
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from duoserve.bench.results import parser, write_result
from duoserve.evaluate.accuracy import evaluate_accuracy
from duoserve.trace.format import arrow_schema, open_trace
from duoserve.train.fit import fit
from duoserve.train.settings import FitSettings


def narrowed(traces: Path, width: int, folder: Path) -> Path:
    """A copy of trace folder ``traces`` keeping the first ``width`` next-gate ids and scores per token and layer."""
    trace = open_trace(traces)
    meta = dataclasses.replace(trace.meta, nextgate_width=width)
    schema, m = arrow_schema(meta), trace.meta.nextgate_width
    folder.mkdir(parents=True)
    for part in trace.files:
        table = pq.read_table(part)
        columns = []
        for f in schema:
            column = table.column(f.name).combine_chunks()
            if f.name.startswith("nextgate"):
                values = column.flatten().to_numpy().reshape(len(table), -1, m)[..., :width]  # N x (L-d) x width
                column = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), f.type.value_type),
                                                           f.type.list_size)
            columns.append(column)
        pq.write_table(pa.Table.from_arrays(columns, schema=schema), folder / part.name)
    return folder


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, geometry=None)
    ap.add_argument("traces", type=Path, nargs="?", default=Path("out/traces"))
    ap.add_argument("--family", nargs="+", default=["hybrid", "residual"])
    ap.add_argument("--epochs", type=int, default=4)
    args = ap.parse_args(argv)
    meta = open_trace(args.traces).meta
    if not meta.lookahead:
        raise SystemExit(f"{args.traces} records no next-gate guesses (duoserve-trace collect --lookahead 1)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for width in sorted({meta.top_k, meta.nextgate_width}):
            traces = args.traces if width == meta.nextgate_width else narrowed(args.traces, width,
                                                                                Path(tmp) / f"m{width}")
            for family in args.family:
                out = Path(tmp) / f"{family}-m{width}"
                fit(FitSettings(traces=[traces], out=out, family=family, epochs=args.epochs, progress=False))
                overall = evaluate_accuracy([traces], out).overall("decode", 1)
                rows.append({"family": family, "width": width, "trained": float(overall.exact_topk["trained MLP"]),
                             "nextgate": float(overall.exact_topk["next-gate"])})
                r = rows[-1]
                print(f"{family:>8}, next-gate width {width:>2}: decode exact-top-k {r['trained']:.3f} "
                      f"(next-gate {r['nextgate']:.3f})")
    result = {"traces": str(args.traces), "top_k": meta.top_k, "epochs": args.epochs, "rows": rows}
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
