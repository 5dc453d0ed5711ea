"""Atomic writes: every file or folder duoserve writes appears whole or not at all.

Each writer fills a temporary name beside the target (same file system, so the final rename is
atomic) and renames it into place only when it is complete; a failure removes the temporary.
Missing parent folders are created; ``check_output`` says before any work whether a path can be
written at all, so a long run does not fail at its end.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temp_name(path: Path) -> Path:
    """The hidden temporary name beside ``path`` that ``atomic_path`` writes."""
    return path.with_name(f".{path.name}.tmp")


def check_output(path: str | Path, folder: bool = False) -> Path:
    """Refuse, before any work, an output ``path`` that cannot be written: a folder where a file is wanted (or
    ``folder`` and a file there), a parent that is a file, or a parent folder without write permission."""
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        raise FileExistsError(f"{path} is a {'file' if folder else 'folder'}; give a {'folder' if folder else 'file'} "
                              "path")
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"cannot write {path}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {path}: no write permission in {ancestor}")
    return path


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it is renamed onto ``path``, on failure removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def atomic_dir(path: str | Path, replace: bool = False) -> Iterator[Path]:
    """Yield a new temporary folder beside ``path``; on success it becomes ``path`` (an existing folder there is
    replaced only with ``replace``), on failure it is removed."""
    path = Path(path)
    tmp = temp_name(path)
    if tmp.exists():  # left by a writer that was killed
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if replace and path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path: str | Path, data, **kwargs) -> None:
    """``data`` as indented JSON with a final newline; ``kwargs`` go to ``json.dumps`` (e.g. ``default=str``)."""
    write_text(path, json.dumps(data, indent=2, **kwargs) + "\n")
