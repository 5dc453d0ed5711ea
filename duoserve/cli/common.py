"""What every app shares: user errors as one line and exit code 2, progress bars, tables, and option types."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

import duoserve
from duoserve.embedded import EMBEDDED_NAME
from duoserve.runtime.policies import POLICIES
from duoserve.runtime.settings import EngineSettings, parse_budget

console = Console()
err_console = Console(stderr=True)

# what a user can fix by changing the command line or the files it names (OSError: paths, permissions, disk)
_USER_ERRORS = (ValueError, OSError, RuntimeError)


def _version(show: bool) -> None:
    if show:
        console.print(f"duoserve {duoserve.__version__}")
        raise typer.Exit()


def new_app(help: str) -> typer.Typer:
    """A stage's typer app: help without arguments, help text as written (no markup: brackets stay), plain errors
    (no rich tracebacks), and ``--version``."""
    app = typer.Typer(help=help, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None)

    @app.callback()
    def main(version: Annotated[bool, typer.Option("--version", help="Print duoserve's version and exit.",
                                                   callback=_version, is_eager=True)] = False) -> None:
        pass

    main.__doc__ = help
    return app


@contextmanager
def user_errors() -> Iterator[None]:
    """Errors a user can fix by changing the command line: printed plainly, exit code 2."""
    try:
        yield
    except typer.Exit:  # a RuntimeError too, but already the answer
        raise
    except _USER_ERRORS as err:
        err_console.print(f"[bold red]error:[/] {escape(_one_line(err))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from err


def _one_line(err: Exception) -> str:
    """The error as one line: an OSError as 'what: path', anything else its message's first line."""
    if isinstance(err, OSError) and err.strerror:
        paths = " -> ".join(str(p) for p in (err.filename, err.filename2) if p)
        return f"{err.strerror}: {paths}" if paths else err.strerror
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


def table(title: str, *columns: str) -> Table:
    t = Table(title=title)
    for col in columns:
        t.add_column(col, overflow="fold")  # narrow terminals fold figures instead of cutting them
    return t


@contextmanager
def progress(description: str, total: float | None = None) -> Iterator[Callable[..., None]]:
    """A progress bar on stderr, drawn from its first update on (nothing shows before validation has passed);
    yields ``update(**fields)`` (rich's ``Progress.update``: completed, total, advance, description)."""
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn(), console=err_console, transient=False)
    task = None

    def update(**fields) -> None:
        nonlocal task
        if task is None:
            bar.start()
            task = bar.add_task(description, total=total)
        bar.update(task, **fields)

    try:
        yield update
    finally:
        if task is not None:
            bar.stop()


def gb(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.2f}"


def num(value, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


def int_list(text: str, option: str) -> tuple[int, ...]:
    """'2048,1024,64' as integers; refuses anything else naming ``option``."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of integers", param_hint=option) from None
    if not values or min(values) < 1:
        raise typer.BadParameter(f"{text!r}: give positive integers, e.g. 2048,1024,512", param_hint=option)
    return values


def phase_filter(phase: str) -> Optional[str]:
    """None for 'all', else the phase; refuses anything else."""
    if phase not in ("all", "prefill", "decode"):
        raise typer.BadParameter(f"phase must be all, prefill or decode, not {phase!r}")
    return None if phase == "all" else phase


# option types ------------------------------------------------------------------------------------
ENGINE = EngineSettings()  # the engine's defaults, declared once

ModelOption = Annotated[str, typer.Option(help=f"HF model id, local path, or '{EMBEDDED_NAME}' (the bundled tiny MoE).")]
DtypeOption = Annotated[str, typer.Option(help="auto, float32, bfloat16, float16.")]
PhaseOption = Annotated[str, typer.Option(help="prefill, decode, or all.")]
PolicyHelp = f"{', '.join(POLICIES)} (duoserve-run policies says what each does)."
BudgetOption = Annotated[Optional[str], typer.Option(
    help="Device memory for cached experts of the caching policies (duoserve, lru): a size (8GiB), a share of the "
         "model's routed experts (10%) or a multiple of its top-k (2k); at least top-k experts. [default: "
         "(1 + lookahead) x top-k experts; over fp8/int4 experts up to twice that, enough to store 128 MiB of them]")]
LookaheadOption = Annotated[int, typer.Option(
    help="Decode prefetch depth in layers (duoserve): layer l's predictions are for layer l+d. A trained predictor "
         "needs heads that deep (duoserve-train fit --lookahead D, D >= d); oracles take any.")]
EagerOption = Annotated[bool, typer.Option(
    help="Launch every decode call's kernels; no CUDA graph replays (see duoserve/runtime/experts.py), and a trained "
         "predictor's graphs captured without torch.compile.")]
StepGraphsOption = Annotated[bool, typer.Option(
    help="On a GPU, replay each decode step's attention, norms and routers from CUDA graphs around the experts "
         "calls, on a static KV cache (see duoserve/runtime/stepgraph.py).")]
MinScoreOption = Annotated[float, typer.Option(
    help="Decode prefetch (duoserve): copy ahead only predicted experts scored at least this, 0-1 (a trained "
         "predictor's scores are probabilities); 0 copies every expert of the predicted top-k.", min=0.0, max=1.0)]
DeferPrefetchOption = Annotated[bool, typer.Option(
    help="With step graphs: queue each decode prefetch at the next layer call's start, while the device computes, "
         "not within the call (see duoserve/runtime/scheduler.py).")]
PinOption = Annotated[Optional[str], typer.Option(
    help="popularity:STATS (a duoserve-train stats file): keep the most popular experts resident for the whole run "
         "(duoserve, lru), as many as the GPU expert budget holds beyond (1 + lookahead) x top-k; the rest of the "
         "budget is the cache as usual.")]
OutFolder = Annotated[Path, typer.Option(help="Output folder.")]


def pin_keys(spec: Optional[str]) -> tuple[tuple[int, int], ...]:
    """The (layer, expert) keys a --pin spec names, best first; () for none."""
    if not spec:
        return ()
    kind, _, path = spec.partition(":")
    if kind != "popularity" or not path:
        raise ValueError(f"--pin {spec!r}: write popularity:STATS with STATS a duoserve-train stats file")
    if not Path(path).is_file():
        raise FileNotFoundError(f"--pin: no stats file at {path} (make one with duoserve-train stats TRACES --out F)")
    from duoserve.features.stats import RoutingStats
    from duoserve.runtime.cache import popular_keys

    return tuple(popular_keys(RoutingStats.load(path).popularity))


def engine_settings(budget: Optional[str], lookahead: int, eager: bool, min_score: float,
                    pin: Optional[str] = None, step_graphs: bool = ENGINE.step_graphs,
                    defer_prefetch: bool = ENGINE.defer_prefetch) -> EngineSettings:
    """The engine options of a command as one settings object."""
    return EngineSettings(gpu_expert_budget=parse_budget(budget) if budget else None, lookahead=lookahead,
                          eager=eager, step_graphs=step_graphs, prefetch_min_score=min_score, pin=pin_keys(pin),
                          defer_prefetch=defer_prefetch)
