"""The house's layering: data flows one way, the runtime and the predictor loader stand without the tracer,
the trainer or Lightning, and nothing but the CLI imports the CLI.

Two checks per rule: every import statement in a subpackage's source (lazy ones inside functions too), and
what importing all of its modules in a fresh interpreter really loads (third-party packages included).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import duoserve

PACKAGE = Path(duoserve.__file__).parent

# subpackage or module -> what it must never import (duoserve modules by prefix, and third-party packages)
STAGES = ("trace", "features", "train", "evaluate", "runtime", "bench", "cli")
FORBIDDEN = {
    "discovery": [f"duoserve.{s}" for s in STAGES] + ["lightning"],
    "loading": [f"duoserve.{s}" for s in STAGES] + ["lightning"],
    "files": [f"duoserve.{s}" for s in STAGES] + ["lightning", "torch"],
    "metrics": [f"duoserve.{s}" for s in STAGES] + ["lightning"],
    "predictor": [f"duoserve.{s}" for s in STAGES] + ["lightning"],
    "trace": [f"duoserve.{s}" for s in STAGES if s != "trace"] + ["lightning"],
    "features": [f"duoserve.{s}" for s in ("train", "evaluate", "runtime", "bench", "cli")] + ["lightning"],
    "runtime": [f"duoserve.{s}" for s in ("trace", "features", "train", "evaluate", "bench", "cli")] + ["lightning"],
    "bench": [f"duoserve.{s}" for s in ("train", "evaluate", "cli")] + ["lightning"],
    "train": [f"duoserve.{s}" for s in ("evaluate", "runtime", "bench", "cli")],
    "evaluate": [f"duoserve.{s}" for s in ("runtime", "bench", "cli")],
}
# the one place evaluation may reach the trainer: the studies that fit fresh predictors
MAY_FIT = {"duoserve.evaluate.generalization"}
# imported by the runtime on CUDA devices only, and it needs Triton, which CPU builds of torch lack
CUDA_ONLY = {"duoserve.runtime.quant_kernels"}


def _modules(name: str) -> list[str]:
    """Dotted names of the module ``name`` or of every module of the subpackage ``name``."""
    path = PACKAGE / name
    files = sorted(path.rglob("*.py")) if path.is_dir() else [PACKAGE / f"{name}.py"]
    return [".".join(("duoserve", *f.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
            for f in files]


def _source(module: str) -> Path:
    rel = Path(*module.split(".")[1:])
    return PACKAGE / rel / "__init__.py" if (PACKAGE / rel).is_dir() else PACKAGE / rel.with_suffix(".py")


def _imports(module: str) -> set[str]:
    """Every module an import statement in ``module``'s source names, wherever the statement stands."""
    found = set()
    for node in ast.walk(ast.parse(_source(module).read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _hits(names: set[str], forbidden: list[str]) -> list[str]:
    return sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))


def _probe(code: str) -> subprocess.Popen:
    """A fresh interpreter running ``code``, then printing its sys.modules."""
    return subprocess.Popen([sys.executable, "-c", f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _imports_all(modules: list[str]) -> str:
    return "\n".join(f"import {m}" for m in modules)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict[str, set[str]]:
    """What each probe's fresh interpreter loaded; the probes run side by side (each pays torch's import)."""
    folder = tmp_path_factory.mktemp("predictor") / "p"
    library = [m for name in (*FORBIDDEN, "data", "embedded") for m in _modules(name) if m not in MAY_FIT | CUDA_ONLY]
    # the stages whose freedom from Lightning and later stages matters most at run time; the others' own
    # imports are checked statically above, and a duoserve import chain is only as loose as its weakest rule
    codes = {name: _imports_all([m for m in _modules(name) if m not in CUDA_ONLY]) for name in ("runtime", "bench")}
    codes["evaluate"] = _imports_all([m for m in _modules("evaluate") if m not in MAY_FIT])
    codes["library"] = _imports_all(library)
    codes["load_predictor"] = (
        "from duoserve.predictor import ExpertPredictor, FeatureSpec, save_predictor\n"
        f"save_predictor(ExpertPredictor(FeatureSpec(3, 4, 2, 2), widths=(8,)), {str(folder)!r}, {{}}, [])\n"
        f"import duoserve\nduoserve.load_predictor({str(folder)!r})")
    running = {name: _probe(code) for name, code in codes.items()}
    out = {}
    for name, proc in running.items():
        stdout, stderr = proc.communicate()
        assert proc.returncode == 0, f"{name}: {stderr}"
        out[name] = set(json.loads(stdout.splitlines()[-1]))
    return out


@pytest.mark.parametrize("name", sorted(FORBIDDEN))
def test_no_stage_imports_a_later_one_in_its_source(name):
    for module in _modules(name):
        forbidden = [f for f in FORBIDDEN[name] if not (module in MAY_FIT and f == "duoserve.train")]
        assert not _hits(_imports(module), forbidden), f"{module} imports {_hits(_imports(module), forbidden)}"


@pytest.mark.parametrize("name", ["runtime", "bench"])
def test_importing_a_stage_loads_nothing_it_must_not(loaded, name):
    assert not _hits(loaded[name], FORBIDDEN[name]), _hits(loaded[name], FORBIDDEN[name])


def test_scoring_baselines_needs_no_lightning(loaded):
    assert not _hits(loaded["evaluate"], ["lightning", "duoserve.train"])


def test_loading_a_predictor_needs_torch_alone(loaded):
    assert "duoserve.predictor.artifact" in loaded["load_predictor"]  # the loader ran
    assert not _hits(loaded["load_predictor"], ["lightning", "duoserve.train", "duoserve.trace", "duoserve.evaluate"])


def test_nothing_but_the_cli_imports_the_cli(loaded):
    for module in (m for name in (*FORBIDDEN, "data", "embedded") for m in _modules(name)):
        assert not _hits(_imports(module), ["duoserve.cli"]), module
    assert not _hits(loaded["library"], ["duoserve.cli"])


def test_the_rules_cover_every_module():
    top = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
           if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    covered = set(FORBIDDEN) | {"cli", "data", "embedded", "__init__", "_lazy"}
    assert top <= covered, f"no layering rule for {sorted(top - covered)}"
