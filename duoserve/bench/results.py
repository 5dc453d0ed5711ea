"""Benchmark result files that say how they were made: the commit, the machine and the command, inside the file.

``benchmarks/results/`` keeps the latest result of each benchmark under a stable name; git keeps the
older ones. Every script in ``benchmarks/`` writes through ``write_result``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from duoserve.files import write_json

ROOT = Path(__file__).resolve().parents[2]


def _commit() -> str | None:
    """``DUOSERVE_COMMIT`` where set (a copy of the tree on another machine, whose git may be stale), else the
    checkout's commit, with ``-dirty`` for uncommitted changes to the code (the package and the benchmark scripts;
    docs and result files do not count)."""
    if os.environ.get("DUOSERVE_COMMIT"):
        return os.environ["DUOSERVE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "duoserve",
                                ":(glob)benchmarks/*.py", ":(glob)benchmarks/*.sh"], cwd=ROOT,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _command(argv: list[str]) -> str:
    """The command line as a user would type it: package modules as ``python -m``, repo scripts relative."""
    first = Path(argv[0]).resolve()
    if first.name.startswith("duoserve-"):  # a console script
        head = [first.name]
    elif first.is_relative_to(ROOT / "duoserve"):
        head = ["python", "-m", ".".join(first.relative_to(ROOT).with_suffix("").parts)]
    elif first.is_relative_to(ROOT):
        head = ["python", str(first.relative_to(ROOT))]
    else:
        head = [argv[0]]
    return shlex.join(head + list(argv[1:]))


def machine() -> dict:
    """The host and, where present, its GPU."""
    info = {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


def provenance(argv: list[str] | None = None) -> dict:
    """Where a result comes from: commit, machine and the command line that produced it."""
    argv = sys.argv if argv is None else argv
    return {"commit": _commit(), "machine": machine(), "command": _command(argv)}


def write_result(path: Path | None, report: dict) -> None:
    """Write a benchmark's JSON result with its provenance (if a path was given)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"provenance": provenance(), **report})


def parser(doc: str, geometry: tuple[int, int, int] | None = (48, 128, 8)) -> argparse.ArgumentParser:
    """A benchmark's parser with --out (its JSON result) and, unless ``geometry`` is None,
    --layers/--experts/--top-k (default: Qwen3-30B-A3B's MoE geometry)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    if geometry is not None:
        for flag, default in zip(("--layers", "--experts", "--top-k"), geometry):
            ap.add_argument(flag, type=int, default=default)
    return ap
