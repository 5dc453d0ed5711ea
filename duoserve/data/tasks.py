"""Task datasets: where prompts come from, how they are built and how a share of them is drawn.

Two tasks, as in the DuoServe-MoE paper, each from one of three sources:

- the Hugging Face hub (``squad`` -> ``rajpurkar/squad``, ``orca-math`` ->
  ``microsoft/orca-math-word-problems-200k``), through the ``datasets`` package;
- local files or folders in the same schema (json, jsonl, parquet, csv), via ``data_files``;
- the built-in samples (``squad-sample``, ``orca-math-sample``), generated offline by
  :mod:`duoserve.data.samples`.

A request id is the row's index in its source split, so traces join back to their prompts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from duoserve.data import samples

SAMPLE_SUFFIX = "-sample"
SAMPLE_ROWS = 4000  # rows in each built-in sample split; 2.5% of it is 100 prompts
_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class Task:
    name: str
    hub_id: str
    split: str
    columns: tuple[str, ...]
    prompt: Callable[[dict], str]
    reference: Callable[[dict], str]
    sample: Callable[[int, int], list[dict]]


def _squad_prompt(row: dict) -> str:
    return f"Context: {row['context']}\nQuestion: {row['question']}\nAnswer:"


def _squad_reference(row: dict) -> str:
    return " " + row["answers"]["text"][0]


def _orca_prompt(row: dict) -> str:
    return f"Question: {row['question']}\nAnswer:"


def _orca_reference(row: dict) -> str:
    return " " + row["answer"]


TASKS: dict[str, Task] = {
    "squad": Task("squad", "rajpurkar/squad", "train", ("context", "question"), _squad_prompt, _squad_reference,
                  samples.squad_rows),
    "orca-math": Task("orca-math", "microsoft/orca-math-word-problems-200k", "train", ("question",), _orca_prompt,
                      _orca_reference, samples.orca_math_rows),
}


@dataclass(frozen=True)
class DatasetSpec:
    """One source of prompts: a task name, optionally ``-sample``, optionally local files."""

    name: str
    data_files: str | None = None
    split: str | None = None

    @property
    def task(self) -> Task:
        return TASKS[self.name.removesuffix(SAMPLE_SUFFIX)]

    @property
    def builtin(self) -> bool:
        return self.name.endswith(SAMPLE_SUFFIX)

    @property
    def source(self) -> str:
        if self.builtin:
            return f"builtin:{self.name}"
        return self.data_files or self.task.hub_id


@dataclass(frozen=True)
class Request:
    dataset: str
    request_id: int
    prompt: str


def parse_datasets(names: Sequence[str], data_files: Sequence[str] = (), split: str | None = None) -> list[DatasetSpec]:
    """Validate dataset names and pair each ``data_files`` entry with the dataset at the same position."""
    known = sorted([*TASKS, *(t + SAMPLE_SUFFIX for t in TASKS)])
    for name in names:
        if name not in known:
            raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(known)}")
    if len(set(names)) != len(names):
        raise ValueError(f"dataset given twice: {list(names)}")
    if data_files and len(data_files) != len(names):
        raise ValueError(f"{len(data_files)} --data-files for {len(names)} --dataset: give one path per dataset, "
                         "in the same order")
    specs = []
    for i, name in enumerate(names):
        files = data_files[i] if data_files else None
        if files is not None:
            if name.endswith(SAMPLE_SUFFIX):
                raise ValueError(f"{name} is built in and takes no --data-files; use {name.removesuffix(SAMPLE_SUFFIX)}")
            _local_files(files)  # fail now, before any model is loaded
        specs.append(DatasetSpec(name, files, split))
    return specs


def _local_files(path: str) -> tuple[str, list[str]]:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data files not found: {path}")
    files = sorted(f for f in p.rglob("*") if f.suffix in _LOCAL_BUILDERS) if p.is_dir() else [p]
    if not files:
        raise ValueError(f"no {'/'.join(_LOCAL_BUILDERS)} files in {path}")
    builders = {_LOCAL_BUILDERS.get(f.suffix) for f in files}
    if None in builders or len(builders) != 1:
        raise ValueError(f"{path}: need files of one format among {', '.join(_LOCAL_BUILDERS)}, "
                         f"found {sorted(f.suffix for f in files)}")
    return builders.pop(), [str(f) for f in files]


def load_rows(spec: DatasetSpec):
    """The source split of ``spec`` as a ``datasets.Dataset``, its schema checked."""
    import datasets

    task = spec.task
    if spec.builtin:
        ds = datasets.Dataset.from_list(task.sample(SAMPLE_ROWS, 0))
    elif spec.data_files:
        builder, files = _local_files(spec.data_files)
        if all(Path(f).stat().st_size == 0 for f in files):
            raise ValueError(f"{spec.data_files} is empty: no rows to trace")
        quiet = logging.getLogger("datasets")  # it logs a traceback of its own before raising on a malformed file
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)
        try:
            ds = datasets.load_dataset(builder, data_files=files, split="train")
        except Exception as err:  # the builders raise their own types (DatasetGenerationError, ArrowInvalid, ...)
            cause = err.__cause__ or err
            raise ValueError(f"could not read {spec.data_files} as {builder}: {type(cause).__name__}: "
                             f"{str(cause).splitlines()[0] if str(cause) else 'malformed file'}") from err
        finally:
            quiet.setLevel(level)
    else:
        try:
            ds = datasets.load_dataset(task.hub_id, split=spec.split or task.split)
        except Exception as err:
            raise RuntimeError(
                f"could not load {task.hub_id!r} from the Hugging Face hub ({type(err).__name__}: {err}). "
                f"Offline? Pass --data-files PATH with a local copy in the same schema, or use {task.name}-sample."
            ) from err
    missing = [c for c in task.columns if c not in ds.column_names]
    if missing:
        raise ValueError(f"{spec.source} lacks column(s) {missing} needed for {task.name} prompts; "
                         f"it has {ds.column_names}")
    if len(ds) == 0:
        raise ValueError(f"{spec.source} has no rows")
    return ds


def sample_indices(n: int, fraction: float | None, count: int | None, seed: int) -> np.ndarray:
    """Sorted row indices: a seeded draw of ``fraction`` of ``n`` rows, or of ``count`` rows."""
    if (fraction is None) == (count is None):
        raise ValueError("give exactly one of fraction and count")
    if fraction is not None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        m = max(1, round(n * fraction))
    else:
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        m = min(count, n)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=m, replace=False))


def load_requests(spec: DatasetSpec, fraction: float | None, count: int | None, seed: int) -> list[Request]:
    """The sampled prompts of one dataset, in request-id order."""
    ds = load_rows(spec)
    idx = sample_indices(len(ds), fraction, count, seed)
    rows = ds.select(idx.tolist())
    return [Request(spec.name, int(i), spec.task.prompt(row)) for i, row in zip(idx, rows)]


SAMPLE_DATASETS = ("squad-sample", "orca-math-sample")  # built in: what runs offline by default


def default_prompts(count: int = 2) -> list[str]:
    """The first prompt of each built-in sample dataset (one SQuAD-style, one Orca-Math-style)."""
    return [load_requests(spec, None, 1, seed=0)[0].prompt for spec in parse_datasets(SAMPLE_DATASETS)][:count]
