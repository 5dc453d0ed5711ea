"""Writes a trace folder: bounded part files, each written atomically, resumable by request.

Part files hold whole requests only and appear by rename, so after a crash the folder holds
exactly the requests that were finished. A restart with the same arguments reads which
(dataset, request_id) pairs are present and traces only the others: nothing is duplicated or
dropped. Under torchrun / accelerate each rank writes ``part-r{rank}-*`` for its share.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from duoserve.files import atomic_path, write_json
from duoserve.trace.format import TraceMeta, arrow_schema, part_files

RUN_FILE = "_run.json"


def prepare_out_dir(out: Path, run: dict, rank: int = 0, wait_s: float = 600.0) -> None:
    """Create ``out`` for a run, or check that it holds a trace of the same run (to resume).

    Under torchrun only rank 0 creates the folder; the other ranks wait (up to ``wait_s``) for its run file and
    check it. Raises if ``out`` is a non-trace folder with files in it or a trace of other arguments (callers check
    with ``duoserve.files.check_output`` first that it can be a folder at all).
    """
    run_file = out / RUN_FILE
    deadline = time.monotonic() + wait_s
    while rank and not run_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 did not create {run_file} within {wait_s:.0f} s")
        time.sleep(0.1)
    if run_file.exists():
        previous = json.loads(run_file.read_text())
        if previous != run:
            changed = sorted(k for k in run.keys() | previous.keys() if run.get(k) != previous.get(k))
            raise FileExistsError(f"{out} holds a trace made with other arguments ({', '.join(changed)} differ); "
                                  "give a new --out, or the same arguments to resume it")
        return
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty and holds no duoserve trace; give a new or empty --out")
    out.mkdir(parents=True, exist_ok=True)
    write_json(run_file, run, sort_keys=True)


def finished_requests(out: Path) -> set[tuple[str, int]]:
    """(dataset, request_id) pairs present in the folder's part files, of every rank."""
    done: set[tuple[str, int]] = set()
    for f in part_files(out):
        table = pq.read_table(f, columns=["dataset", "request_id"]).group_by(["dataset", "request_id"]).aggregate([])
        done.update(zip(table.column("dataset").to_pylist(), table.column("request_id").to_pylist()))
    return done


class TraceWriter:
    """Buffers row columns and writes a part file whenever ``rows_per_part`` rows, ``requests_per_part`` requests
    or ``seconds_per_part`` seconds of work are buffered, whichever comes first: a crash loses at most that much."""

    def __init__(self, out: Path, meta: TraceMeta, rank: int = 0, rows_per_part: int = 200_000,
                 requests_per_part: int | None = None, seconds_per_part: float | None = None):
        for name, value in (("rows", rows_per_part), ("requests", requests_per_part), ("seconds", seconds_per_part)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} per part file must be positive, got {value}")
        self.out, self.rank, self.rows_per_part = out, rank, rows_per_part
        self.requests_per_part, self.seconds_per_part = requests_per_part, seconds_per_part
        self.schema = arrow_schema(meta)
        for stale in out.glob(f".part-r{rank:03d}-*.tmp"):
            stale.unlink()
        own = part_files(out)
        own = [f for f in own if f.name.startswith(f"part-r{rank:03d}-")]
        self._seq = 1 + max((int(f.stem.rsplit("-", 1)[1]) for f in own), default=-1)
        self._buffer: list[pa.RecordBatch] = []
        self._buffered = self._requests = 0
        self._since = time.monotonic()

    @property
    def next_part(self) -> int:
        """The sequence number the next part file of this rank will get."""
        return self._seq

    def add(self, columns: dict[str, np.ndarray]) -> None:
        """Add rows of whole requests: 1-D arrays for scalar columns, 2-D (rows x width) arrays for list columns."""
        if not self._buffered:
            self._since = time.monotonic()
        arrays = []
        for f in self.schema:
            col = columns[f.name]
            if pa.types.is_fixed_size_list(f.type):
                flat = pa.array(np.ascontiguousarray(col).reshape(-1), type=f.type.value_type)
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, f.type.list_size))
            else:
                arrays.append(pa.array(col, type=f.type))
        batch = pa.RecordBatch.from_arrays(arrays, schema=self.schema)
        self._buffer.append(batch)
        self._buffered += batch.num_rows
        if self.requests_per_part is not None:  # callers add whole requests: count them, not tokens
            self._requests += len(set(zip(columns["dataset"].tolist(), columns["request_id"].tolist())))
        if (self._buffered >= self.rows_per_part
                or (self.requests_per_part is not None and self._requests >= self.requests_per_part)
                or (self.seconds_per_part is not None and time.monotonic() - self._since >= self.seconds_per_part)):
            self.flush()

    def flush(self) -> None:
        if not self._buffered:
            return
        path = self.out / f"part-r{self.rank:03d}-{self._seq:05d}.parquet"
        with atomic_path(path) as tmp:
            pq.write_table(pa.Table.from_batches(self._buffer, schema=self.schema), tmp, compression="zstd")
        self._seq += 1
        self._buffer, self._buffered, self._requests = [], 0, 0
