"""The routing-trace contract: a folder of Parquet part files, one row per routed token.

Columns (docs/design.md): request_id int64, dataset string, phase "prefill" | "decode",
position int32, token_id int32, experts fixed_size_list<int16>[L*k] (layer-major, router order),
scores fixed_size_list<float16>[L*k] (router weights), and optional next-gate columns for each
look-ahead depth d = 1..D: ``nextgate`` / ``nextgate_d{d}``, the top-m ids of layer l+d's router
applied to layer l's MoE input ((L-d)*m int16, the router's own top-k first, then the next best
by its scores), and ``nextgate_scores`` / ``nextgate_scores_d{d}``, their softmax probabilities
over the E experts ((L-d)*m float16). m is the metadata's ``nextgate_width`` (2k by default).

Version 1 traces (m = k, no score columns) still open: their ``nextgate_width`` reads as k.

Every part carries the same JSON metadata under the ``duoserve`` key: format version, model,
geometry, sampling and generation settings. Later stages open a trace only through
:func:`open_trace`, which checks all of it.
"""

from __future__ import annotations

import functools
import json
import operator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

TRACE_VERSION = 2
READABLE_VERSIONS = (1, 2)
META_KEY = b"duoserve"
PHASES = ("prefill", "decode")


def nextgate_column(depth: int) -> str:
    return "nextgate" if depth == 1 else f"nextgate_d{depth}"


def nextgate_scores_column(depth: int) -> str:
    return "nextgate_scores" if depth == 1 else f"nextgate_scores_d{depth}"


@dataclass(frozen=True)
class TraceMeta:
    """What every part file of a trace says about how it was made."""

    model: str
    num_layers: int  # MoE layers only
    num_experts: int
    top_k: int
    decoder_indices: list[int]
    datasets: list[dict]  # [{"name", "source"}]
    lookahead: int = 0  # next-gate depth recorded (0: none)
    nextgate_width: int = 0  # m: next-gate ids (and scores) per token and layer; 0 without next-gate
    revision: str | None = None
    fraction: float | None = None
    count: int | None = None
    seed: int = 0
    generation: dict = field(default_factory=dict)
    package_version: str = ""
    version: int = TRACE_VERSION

    def __post_init__(self):
        if self.lookahead and not self.top_k <= self.nextgate_width <= self.num_experts:
            raise ValueError(f"a trace with next-gate columns needs a width between top-k ({self.top_k}) and the "
                             f"expert count ({self.num_experts}), got {self.nextgate_width}")

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> TraceMeta:
        data = json.loads(raw)
        if data.get("version") not in READABLE_VERSIONS:
            raise ValueError(f"trace format version {data.get('version')} is not supported (this duoserve reads "
                             f"{', '.join(map(str, READABLE_VERSIONS))})")
        if data["version"] == 1 and data.get("lookahead"):
            data["nextgate_width"] = data["top_k"]  # version 1 recorded the router's top-k ids only
        return cls(**data)

    @property
    def nextgate_scores(self) -> bool:
        """Whether the next-gate columns come with their scores (version 2 traces with look-ahead)."""
        return self.version >= 2 and self.lookahead >= 1


def arrow_schema(meta: TraceMeta) -> pa.Schema:
    """The Parquet schema of a trace with ``meta``'s geometry and look-ahead, metadata attached."""
    L, k = meta.num_layers, meta.top_k
    fields = [
        pa.field("request_id", pa.int64(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("phase", pa.string(), nullable=False),
        pa.field("position", pa.int32(), nullable=False),
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("experts", pa.list_(pa.int16(), L * k), nullable=False),
        pa.field("scores", pa.list_(pa.float16(), L * k), nullable=False),
    ]
    m = meta.nextgate_width
    for d in range(1, min(meta.lookahead, L - 1) + 1):
        fields.append(pa.field(nextgate_column(d), pa.list_(pa.int16(), (L - d) * m), nullable=False))
        if meta.nextgate_scores:
            fields.append(pa.field(nextgate_scores_column(d), pa.list_(pa.float16(), (L - d) * m), nullable=False))
    return pa.schema(fields, metadata={META_KEY: meta.to_bytes()})


def row_filter(phase: str | None = None, datasets: list[str] | None = None) -> pc.Expression | None:
    """A pyarrow filter on phase and datasets (None: all rows)."""
    conds = [pc.field("phase") == phase] if phase is not None else []
    conds += [pc.field("dataset").isin(datasets)] if datasets else []
    return functools.reduce(operator.and_, conds) if conds else None


def part_files(path: Path) -> list[Path]:
    return sorted(path.glob("part-*.parquet"))


@dataclass
class Trace:
    """An opened, validated trace folder."""

    path: Path
    meta: TraceMeta
    files: list[Path]

    @property
    def dataset(self) -> pads.Dataset:
        return pads.dataset([str(f) for f in self.files], format="parquet", schema=arrow_schema(self.meta))

    def iter_experts(self, phase: str | None = None, datasets: list[str] | None = None,
                     batch_rows: int = 65_536):
        """Yield the ``experts`` column batch by batch as N x L x k int16 arrays (memory bounded by the readahead:
        a part file per Arrow thread, two batches each)."""
        L, k = self.meta.num_layers, self.meta.top_k
        # one part file per thread: Arrow's default of four files at a time leaves most cores idle
        for batch in self.dataset.to_batches(columns=["experts"], filter=row_filter(phase, datasets),
                                             batch_size=batch_rows, batch_readahead=2,
                                             fragment_readahead=max(pa.cpu_count(), 1)):
            if batch.num_rows:
                yield batch.column("experts").flatten().to_numpy().reshape(-1, L, k)  # N x L x k

    def column(self, name: str) -> pa.ChunkedArray:
        return self.dataset.to_table(columns=[name]).column(name)

    def num_rows(self) -> int:
        return sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)


def open_trace(path: str | Path) -> Trace:
    """Open a trace folder (or one part file), checking that every part has the same metadata and schema."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no trace at {path}")
    files = [path] if path.is_file() else part_files(path)
    if not files:
        raise ValueError(f"{path} holds no trace part files (part-*.parquet)")
    meta, raw0 = None, None
    for f in files:
        try:
            schema = pq.read_schema(f)
        except Exception as err:
            raise ValueError(f"{f} is not a readable Parquet file: {err}") from err
        raw = (schema.metadata or {}).get(META_KEY)
        if raw is None:
            raise ValueError(f"{f} is not a duoserve trace (no '{META_KEY.decode()}' metadata)")
        if meta is None:
            meta, raw0 = TraceMeta.from_bytes(raw), raw
            expected = arrow_schema(meta)
        elif raw != raw0:
            raise ValueError(f"{f} was written by a different run than {files[0]} (metadata differ); "
                             "keep one run per trace folder")
        if not schema.remove_metadata().equals(expected.remove_metadata()):
            raise ValueError(f"{f}: schema does not match the trace contract for L={meta.num_layers}, "
                             f"k={meta.top_k}:\n{schema.remove_metadata()}")
    return Trace(path, meta, files)
