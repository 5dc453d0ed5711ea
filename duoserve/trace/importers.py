"""Import routing logs from serving engines into duoserve's trace format, and export traces as long rows.

Formats (shape legend: n rows, T tokens, L MoE layers, E experts, k top-k):
- ``long``: JSON lines, CSV or Parquet with one row per (request, token, layer) and that layer's
  expert ids (a list; in CSV a string such as "[3, 7]" or "3 7"). Column names are options.
  Streams in record batches: memory stays bounded when each token's rows lie close together.
- ``sglang``: SGLang expert-distribution recorder dumps in per_token mode (``.pt`` files holding
  ``records`` with ``topk_ids_of_layer`` shaped [layers, T, k], -1 in unused slots, and
  ``forward_pass_id`` / ``forward_mode``). SGLang records no request id: each forward pass
  becomes one request; decode passes (forward_mode 2) are tagged decode. Physical expert ids are
  mapped to logical ones through ``last_physical_to_logical_map`` when the dump has it. Layers
  that never route (dense layers) are not MoE layers and are left out.
- ``npy``: a ``.npy`` array (one request) or ``.npz`` (one request per array, in key order) shaped
  [L, T, k] (``layout='lt'``) or [T, L, k] (``'tl'``), -1 in unused slots.

The long format streams; a ``.pt`` or ``.npy``/``.npz`` file is read whole. A token missing any
MoE layer is dropped and counted, never silently. Duplicate rows, expert ids
out of range, ragged k and mixed geometry are errors that name the file and row; a failed import of a
new folder leaves nothing. Part files land as the import goes, with ``_import.json`` recording its
progress, so a killed import resumes from the same command without writing any token twice.
Unknown per-token fields get placeholders: token_id -1, scores NaN.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import duoserve
from duoserve.files import atomic_path, write_json
from duoserve.trace.format import PHASES, Trace, TraceMeta, part_files
from duoserve.trace.writer import TraceWriter

FORMATS = ("long", "sglang", "npy")
SGLANG_DECODE = 2  # ForwardMode.DECODE


class ImportFormatError(ValueError):
    """The source does not hold what its format promises; the message names file and row."""


@dataclass
class ImportSettings:
    source: Path
    out: Path
    format: str = "long"
    request: str = "request_id"  # long-format column names
    token: str = "token"
    layer: str = "layer"
    experts: str = "experts"
    scores: str | None = None
    dataset_column: str | None = None
    phase_column: str | None = None
    token_id_column: str | None = None
    dataset: str = "imported"  # constant dataset / phase when no column gives them
    phase: str = "decode"
    layout: str = "lt"  # npy: [L, T, k] or [T, L, k]
    num_layers: int | None = None  # declared geometry (checked); inferred when None
    num_experts: int | None = None
    top_k: int | None = None
    model: str = "imported"
    batch_rows: int = 1 << 20
    rows_per_part: int = 200_000  # a part file at least every this many tokens or seconds: what a crash can lose
    seconds_per_part: float = 60.0


@dataclass
class ImportResult:
    out: Path
    tokens: int
    dropped: int  # tokens missing some layer
    geometry: tuple[int, int, int]
    inferred: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _Tokens:
    """A block of complete tokens ready to write."""

    request: np.ndarray  # T
    position: np.ndarray  # T
    ids: np.ndarray  # T x L x k
    scores: np.ndarray | None = None  # T x L x k
    dataset: np.ndarray | None = None  # T strings
    phase: np.ndarray | None = None  # T strings
    token_id: np.ndarray | None = None  # T


def _line(fmt: str, row: int) -> str:
    return {"jsonl": f"line {row + 1}", "json": f"line {row + 1}", "csv": f"line {row + 2}"}.get(fmt, f"row {row}")


def _long_batches(path: Path, s: ImportSettings) -> Iterator[pa.RecordBatch]:
    import pyarrow.csv as pcsv
    import pyarrow.json as pjson

    suffix = path.suffix.lstrip(".")
    if suffix not in ("jsonl", "json", "csv", "parquet"):
        raise ImportFormatError(f"{path}: long format reads .jsonl, .json, .csv or .parquet, not {path.suffix!r}")
    try:  # a malformed line: pyarrow names the row, not the file
        if suffix == "csv":
            yield from pcsv.open_csv(path, read_options=pcsv.ReadOptions(block_size=64 << 20),
                                     convert_options=pcsv.ConvertOptions(column_types={s.experts: pa.string()}))
        elif suffix == "parquet":
            yield from pq.ParquetFile(path).iter_batches(batch_size=s.batch_rows)
        else:
            yield from pjson.open_json(path, read_options=pjson.ReadOptions(block_size=64 << 20))
    except pa.ArrowInvalid as err:
        raise ImportFormatError(f"{path}: {err}") from err


def _list_column(batch: pa.RecordBatch, name: str, path: Path, value_type: pa.DataType = pa.int64()) -> pa.Array:
    if name not in batch.schema.names:
        raise ImportFormatError(f"{path}: no column {name!r}; columns are {batch.schema.names} "
                                "(map them with --request/--token/--layer/--experts/--scores)")
    col = batch.column(name)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):  # CSV: "[3, 7]" or "3 7"
        col = pc.split_pattern_regex(pc.utf8_trim(pc.replace_substring_regex(col, r"[\[\]]", ""), " ,;"), r"[ ,;]+")
        col = col.cast(pa.list_(value_type), safe=False)
    return col


def _column(batch: pa.RecordBatch, name: str, path: Path) -> np.ndarray:
    if name not in batch.schema.names:
        raise ImportFormatError(f"{path}: no column {name!r}; columns are {batch.schema.names}")
    return batch.column(name).to_numpy(zero_copy_only=False)


def _integers(batch: pa.RecordBatch, name: str, path: Path, fmt: str, offset: int) -> np.ndarray:
    """A column as int64, naming the file, line and value of the first entry that is not an integer."""
    values = _column(batch, name, path)
    try:
        return values.astype(np.int64)
    except (TypeError, ValueError):
        for i, v in enumerate(values):
            try:
                int(v)
            except (TypeError, ValueError):
                raise ImportFormatError(f"{path} {_line(fmt, offset + i)}: {name} {v!r} is not an integer") from None
        raise


def _refuse_out_of_range(values: np.ndarray, limit: int | None, path: Path, fmt: str, offset: int, what: str) -> None:
    """Raise, naming the first offending row, if any of ``values`` (n rows) is negative or >= ``limit``."""
    bad = np.flatnonzero(((values < 0) | (values >= (limit or np.iinfo(np.int64).max))).reshape(len(values), -1).any(1))
    if len(bad):
        allowed = f"out of range 0..{limit - 1}" if limit else "negative"
        raise ImportFormatError(f"{path} {_line(fmt, offset + bad[0])}: {what} {values[bad[0]].tolist()} {allowed}")


def _fixed(col: pa.Array, k: int | None, path: Path, fmt: str, offset: int, what: str) -> np.ndarray:
    """n x k values of a list column, refusing ragged rows."""
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    k = int(lengths[0]) if k is None and len(lengths) else k
    bad = np.flatnonzero(lengths != k)
    if len(bad):
        raise ImportFormatError(f"{path} {_line(fmt, offset + bad[0])}: {what} has {lengths[bad[0]]} values, "
                                f"expected k={k} (ragged top-k)")
    return pc.list_flatten(col).to_numpy(zero_copy_only=False).reshape(len(lengths), k)


class _LongPivot:
    """Turns long rows into complete tokens batch by batch, carrying tokens whose layers are still missing."""

    def __init__(self, s: ImportSettings, L: int, E: int, k: int, path: Path):
        self.s, self.L, self.E, self.k, self.path = s, L, E, k, path
        self.fmt = path.suffix.lstrip(".")
        self.carry: dict[str, np.ndarray] | None = None
        self.emitted: list[np.ndarray] = []  # (dataset code, request, token) of written tokens: late duplicates
        self.codes: dict[str, int] = {}  # dataset name -> code, so requests of two datasets stay apart

    def rows(self, batch: pa.RecordBatch, offset: int) -> dict[str, np.ndarray]:
        s, path = self.s, self.path
        ids = _fixed(_list_column(batch, s.experts, path), self.k, path, self.fmt, offset, "experts")
        layer = _integers(batch, s.layer, path, self.fmt, offset)
        cols = {"row": offset + np.arange(len(layer)), "request": _integers(batch, s.request, path, self.fmt, offset),
                "token": _integers(batch, s.token, path, self.fmt, offset), "layer": layer, "ids": ids}
        _refuse_out_of_range(ids, self.E, path, self.fmt, offset, "expert id")
        _refuse_out_of_range(layer, self.L, path, self.fmt, offset, "layer")
        if s.scores:
            cols["scores"] = _fixed(_list_column(batch, s.scores, path, pa.float64()), self.k, path, self.fmt, offset,
                                    "scores")
        for key, name in (("dataset", s.dataset_column), ("phase", s.phase_column), ("token_id", s.token_id_column)):
            if name:
                cols[key] = _column(batch, name, path)
        names, inverse = np.unique(cols["dataset"], return_inverse=True) if "dataset" in cols else ([""], 0)
        cols["dcode"] = np.array([self.codes.setdefault(str(n), len(self.codes)) for n in names])[inverse] \
            + np.zeros(len(layer), np.int64)
        return cols

    def push(self, cols: dict[str, np.ndarray]) -> _Tokens | None:
        if self.carry is not None:
            cols = {k: np.concatenate([self.carry[k], v]) for k, v in cols.items()}
        order = np.lexsort((cols["layer"], cols["token"], cols["request"], cols["dcode"]))
        cols = {k: v[order] for k, v in cols.items()}
        key = np.stack([cols["dcode"], cols["request"], cols["token"]], axis=1)  # n x 3: one token
        new_token = np.r_[True, (key[1:] != key[:-1]).any(1)]
        same = ~new_token[1:] & (cols["layer"][1:] == cols["layer"][:-1])
        if same.any():
            i = np.flatnonzero(same)[0]
            raise ImportFormatError(
                f"{self.path}: duplicate rows for request {cols['request'][i]}, token {cols['token'][i]}, layer "
                f"{cols['layer'][i]} ({_line(self.fmt, cols['row'][i])} and {_line(self.fmt, cols['row'][i + 1])})")
        starts = np.flatnonzero(new_token)
        counts = np.diff(np.r_[starts, len(key)])
        done = np.repeat(counts == self.L, counts)
        self.carry = {k: v[~done] for k, v in cols.items()}
        if not done.any():
            return None
        cols = {k: v[done] for k, v in cols.items()}
        first = cols["layer"] == 0  # one row per complete token
        self.emitted.append(key[done][first])
        T = int(first.sum())
        return _Tokens(cols["request"][first], cols["token"][first], cols["ids"].reshape(T, self.L, self.k),
                       cols["scores"].reshape(T, self.L, self.k) if "scores" in cols else None,
                       cols["dataset"][first] if "dataset" in cols else None,
                       cols["phase"][first] if "phase" in cols else None,
                       cols["token_id"][first] if "token_id" in cols else None)

    def finish(self) -> int:
        """Tokens still missing layers (dropped); raises if a token was written twice."""
        keys = np.concatenate(self.emitted) if self.emitted else np.zeros((0, 3), np.int64)
        unique, counts = np.unique(keys, axis=0, return_counts=True)
        if (counts > 1).any():
            _, request, token = unique[counts > 1][0]
            raise ImportFormatError(f"{self.path}: request {request}, token {token} appears twice with all "
                                    f"{self.L} layers (duplicate rows)")
        if self.carry is None or not len(self.carry["request"]):
            return 0
        return len(np.unique(np.stack([self.carry["dcode"], self.carry["request"], self.carry["token"]], 1), axis=0))


def _scan_long(path: Path, s: ImportSettings) -> tuple[int, int, int]:
    """L, E, k from a first pass over the layer and experts columns; k is the first row's, checked on all."""
    L = E = -1
    k, offset, fmt = s.top_k, 0, path.suffix.lstrip(".")
    for batch in _long_batches(path, s):
        col = _list_column(batch, s.experts, path)
        if len(col):
            ids = _fixed(col, k, path, fmt, offset, "experts")
            k = ids.shape[1]
            _refuse_out_of_range(ids, s.num_experts, path, fmt, offset, "expert id")
            L = max(L, int(_integers(batch, s.layer, path, fmt, offset).max()))
            E = max(E, int(ids.max()))
        offset += batch.num_rows
    if L < 0:
        raise ImportFormatError(f"{path} holds no rows")
    return L + 1, E + 1, k


def _sglang_tokens(path: Path) -> Iterator[_Tokens | int]:
    import torch

    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ImportFormatError(f"{path}: not a readable SGLang dump ({err})") from err
    records = payload.get("records") if isinstance(payload, dict) else None
    if not records or "topk_ids_of_layer" not in records[0]:
        raise ImportFormatError(f"{path}: no per_token records (need 'records' with 'topk_ids_of_layer'; record "
                                "with SGLang's expert distribution recorder in per_token mode)")
    mapping = payload.get("last_physical_to_logical_map")
    if mapping is not None:
        mapping = torch.as_tensor(mapping).to(torch.int64)  # layers x physical experts
    arrays = []
    for i, r in enumerate(records):
        ids = r["topk_ids_of_layer"].to(torch.int64)  # layers x T x k
        if ids.dim() != 3:
            raise ImportFormatError(f"{path} record {i}: topk_ids_of_layer has shape {tuple(ids.shape)}, "
                                    "expected [layers, tokens, k]")
        if mapping is not None:
            ids = torch.where(ids >= 0, mapping.gather(1, ids.clamp(min=0).flatten(1)).view_as(ids), ids)
        arrays.append((i, r, ids.permute(1, 0, 2).numpy()))  # T x layers x k
    moe = np.zeros(arrays[0][2].shape[1], dtype=bool)
    for _, _, a in arrays:
        if a.shape[1:] != arrays[0][2].shape[1:]:
            raise ImportFormatError(f"{path}: records of different geometry {a.shape[1:]} and "
                                    f"{arrays[0][2].shape[1:]}")
        moe |= (a >= 0).any(axis=(0, 2))
    for i, r, a in arrays:
        a = a[:, moe]
        yield from _complete_tokens(a, np.full(len(a), int(r.get("forward_pass_id", i))), path, f"record {i}",
                                    "decode" if int(r.get("forward_mode", 0)) == SGLANG_DECODE else "prefill")


def _complete_tokens(a: np.ndarray, request: np.ndarray, path: Path, where: str,
                     phase: str | None = None) -> Iterator[_Tokens | int]:
    """Tokens of a T x L x k array with -1 in unused slots: complete ones, then the count of dropped ones."""
    used = a >= 0
    partial = used.any(2) & ~used.all(2)
    if partial.any():
        t, l = np.argwhere(partial)[0]
        raise ImportFormatError(f"{path} {where}, token {t}, layer {l}: {used[t, l].sum()} of {a.shape[2]} slots "
                                "used (ragged top-k)")
    complete = used.all(axis=(1, 2))
    empty = ~used.any(axis=(1, 2))
    if complete.any():
        T = int(complete.sum())
        yield _Tokens(request[complete], np.flatnonzero(complete), a[complete],
                      phase=np.full(T, phase, dtype=object) if phase else None)
    yield int((~complete & ~empty).sum())


def _npy_tokens(path: Path, s: ImportSettings) -> Iterator[_Tokens | int]:
    if s.layout not in ("lt", "tl"):
        raise ValueError(f"layout must be 'lt' ([layers, tokens, k]) or 'tl' ([tokens, layers, k]), not {s.layout!r}")
    loaded = np.load(path, mmap_mode="r") if path.suffix == ".npy" else np.load(path)
    items = [("0", loaded)] if path.suffix == ".npy" else [(key, loaded[key]) for key in loaded.files]
    for request, (key, a) in enumerate(items):
        if a.ndim != 3:
            raise ImportFormatError(f"{path} array {key!r}: shape {a.shape}, expected 3 dimensions")
        a = np.asarray(a, dtype=np.int64)
        if s.layout == "lt":
            a = a.transpose(1, 0, 2)
        yield from _complete_tokens(a, np.full(len(a), request), path, f"array {key!r}")


def _source_files(source: Path, fmt: str) -> list[Path]:
    if not source.exists():
        raise FileNotFoundError(f"no such file or folder: {source}")
    suffixes = {"long": (".jsonl", ".json", ".csv", ".parquet"), "sglang": (".pt",), "npy": (".npy", ".npz")}[fmt]
    files = sorted(f for f in source.iterdir() if f.suffix in suffixes) if source.is_dir() else [source]
    if not files:
        raise ImportFormatError(f"{source}: no {'/'.join(suffixes)} files for format {fmt!r}")
    return files


def _check_geometry(found: tuple[int, int, int], s: ImportSettings, path: Path) -> tuple[tuple[int, int, int], list]:
    declared = (s.num_layers, s.num_experts, s.top_k)
    names = ("num_layers", "num_experts", "top_k")
    for name, d, f in zip(names, declared, found):
        if d is not None and (f > d if name == "num_experts" else f != d):
            raise ImportFormatError(f"{path}: {name} is {f} in the data but declared {d}")
    geometry = tuple(d if d is not None else f for d, f in zip(declared, found))
    return geometry, [n for n, d in zip(names, declared) if d is None]


PROGRESS_FILE = "_import.json"
_IDENTITY = ("format", "request", "token", "layer", "experts", "scores", "dataset_column", "phase_column",
             "token_id_column", "dataset", "phase", "layout", "num_layers", "num_experts", "top_k", "model")


def _identity(s: ImportSettings, files: list[Path]) -> dict:
    """What must match for a rerun to resume an import: the settings and the source files as they were."""
    return {"source": str(s.source.resolve()), **{name: getattr(s, name) for name in _IDENTITY},
            "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]}


def _resume_state(out: Path, identity: dict) -> dict | None:
    """The progress of an earlier run of the same import into ``out``, or None for a fresh one."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a folder")
    progress = out / PROGRESS_FILE
    if progress.exists():
        state = json.loads(progress.read_text())
        if state["identity"] != identity:
            raise FileExistsError(f"{out} holds an import of other sources or settings; give a new --out, or the "
                                  "same command to resume it")
        return state
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out} exists and is not an empty folder")
    return None


def _written_keys(out: Path, first_part: int) -> pd.MultiIndex:
    """(dataset, request_id, position) of the tokens in part files numbered ``first_part`` or later."""
    files = [f for f in part_files(out) if int(f.stem.rsplit("-", 1)[1]) >= first_part]
    if not files:
        return pd.MultiIndex.from_arrays([[], [], []])
    table = pa.concat_tables(pq.read_table(f, columns=["dataset", "request_id", "position"]) for f in files)
    return pd.MultiIndex.from_arrays([table.column(c).to_numpy(zero_copy_only=False)
                                      for c in ("dataset", "request_id", "position")])


def import_trace(s: ImportSettings, progress: Callable[[int], None] | None = None) -> ImportResult:
    """Convert ``s.source`` into a trace folder at ``s.out``; ``progress(tokens)`` reports as it goes.

    Part files land as the import goes (at least every ``rows_per_part`` tokens or ``seconds_per_part``
    seconds), with ``_import.json`` saying which source files are done: the same command after a crash resumes,
    writing no token twice. A bad source leaves nothing behind when the folder was new.
    """
    start = time.time()
    if s.format not in FORMATS:
        raise ValueError(f"unknown format {s.format!r}; choose from {', '.join(FORMATS)}")
    files = _source_files(s.source, s.format)
    identity = _identity(s, files)
    state = _resume_state(s.out, identity)

    if s.format == "long":
        found = tuple(max(v) for v in zip(*(_scan_long(f, s) for f in files))) \
            if None in (s.num_layers, s.num_experts, s.top_k) else (s.num_layers, s.num_experts, s.top_k)
        blocks = {}
    else:
        blocks = {f.name: list(_sglang_tokens(f) if s.format == "sglang" else _npy_tokens(f, s)) for f in files}
        arrays = [b.ids for per_file in blocks.values() for b in per_file if isinstance(b, _Tokens)]
        if not arrays:
            raise ImportFormatError(f"{s.source}: no complete token in the data")
        found = (arrays[0].shape[1], int(max(a.max() for a in arrays)) + 1, arrays[0].shape[2])
    (L, E, k), inferred = _check_geometry(found, s, files[0])
    if L < 2:
        raise ImportFormatError(f"{s.source}: {L} MoE layer(s); a trace needs at least 2")
    if state is not None and state["complete"]:
        return ImportResult(s.out, state["tokens"], state["dropped"], (L, E, k), inferred, time.time() - start)

    meta = TraceMeta(model=s.model, num_layers=L, num_experts=E, top_k=k, decoder_indices=list(range(L)),
                     datasets=[{"name": s.dataset, "source": f"import:{s.format}:{s.source}"}],
                     package_version=duoserve.__version__,
                     generation={"imported_from": s.format, "inferred": inferred})
    fresh = state is None
    if fresh:
        state = {"identity": identity, "done": [], "dropped": 0, "current": None, "first_part": 0, "complete": False}
    try:
        s.out.mkdir(parents=True, exist_ok=True)
        writer = TraceWriter(s.out, meta, rows_per_part=s.rows_per_part, seconds_per_part=s.seconds_per_part)
        tokens = 0
        skip = pd.MultiIndex.from_arrays([[], [], []])  # tokens an interrupted run already wrote for this file

        def write(block: _Tokens) -> None:
            nonlocal tokens
            T = len(block.request)
            phases = set(np.unique(block.phase).tolist()) if block.phase is not None else {s.phase}
            if not phases <= set(PHASES):
                raise ImportFormatError(f"{s.source}: phase values {sorted(phases - set(PHASES))} are not "
                                        f"{' or '.join(PHASES)}")
            cols = {
                "request_id": block.request.astype(np.int64),
                "dataset": block.dataset if block.dataset is not None else np.full(T, s.dataset, dtype=object),
                "phase": block.phase if block.phase is not None else np.full(T, s.phase, dtype=object),
                "position": block.position.astype(np.int32),
                "token_id": (block.token_id if block.token_id is not None else np.full(T, -1)).astype(np.int32),
                "experts": block.ids.reshape(T, -1).astype(np.int16),
                "scores": (block.scores.reshape(T, -1) if block.scores is not None
                           else np.full((T, L * k), np.nan)).astype(np.float16),
            }
            if len(skip):
                new = ~pd.MultiIndex.from_arrays([cols["dataset"], cols["request_id"], cols["position"]]).isin(skip)
                cols = {name: col[new] for name, col in cols.items()}
            if len(cols["request_id"]):
                writer.add(cols)
                tokens += len(cols["request_id"])
            if progress:
                progress(tokens)

        for f in files:
            if f.name in state["done"]:
                continue
            if state["current"] == f.name:  # interrupted in this file: its tokens on disk are not written again
                skip = _written_keys(s.out, state["first_part"])
            else:
                state.update(current=f.name, first_part=writer.next_part)
                skip = pd.MultiIndex.from_arrays([[], [], []])
            write_json(s.out / PROGRESS_FILE, state)
            if s.format == "long":
                pivot, offset = _LongPivot(s, L, E, k, f), 0
                for batch in _long_batches(f, s):
                    block = pivot.push(pivot.rows(batch, offset))
                    offset += batch.num_rows
                    if block is not None:
                        write(block)
                dropped = pivot.finish()
            else:
                dropped = 0
                for b in blocks[f.name]:
                    if isinstance(b, _Tokens):
                        if b.ids.max() >= E:
                            raise ImportFormatError(f"{s.source}: expert id {int(b.ids.max())} >= declared "
                                                    f"num_experts {E}")
                        write(b)
                    else:
                        dropped += b
            writer.flush()
            state["done"].append(f.name)
            state["dropped"] += dropped
        total = sum(pq.ParquetFile(f).metadata.num_rows for f in part_files(s.out))
        if total == 0:
            raise ImportFormatError(f"{s.source}: no complete token (every token misses some layer)")
    except Exception:
        if fresh:  # a new folder that could not be completed: nothing left behind
            shutil.rmtree(s.out, ignore_errors=True)
        raise
    state.update(complete=True, current=None, tokens=total)
    write_json(s.out / PROGRESS_FILE, state)
    return ImportResult(s.out, total, state["dropped"], (L, E, k), inferred, time.time() - start)


def export_long(trace: Trace, path: Path) -> int:
    """Write ``trace`` as long JSON lines, one row per (request, token, layer); returns the rows written."""
    L, k = trace.meta.num_layers, trace.meta.top_k
    rows = 0
    with atomic_path(path) as tmp, tmp.open("w") as f:
        for batch in trace.dataset.to_batches():
            d = batch.to_pydict()
            for i in range(batch.num_rows):
                for l in range(L):
                    f.write(json.dumps({
                        "request_id": d["request_id"][i], "dataset": d["dataset"][i], "phase": d["phase"][i],
                        "token": d["position"][i], "token_id": d["token_id"][i], "layer": l,
                        "experts": d["experts"][i][l * k:(l + 1) * k], "scores": d["scores"][i][l * k:(l + 1) * k],
                    }) + "\n")
                    rows += 1
    return rows
