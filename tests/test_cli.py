"""The command-line front: typer apps, exit codes, summary tables."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from duoserve.cli.evaluate import app as eval_app
from duoserve.cli.run import app as run_app
from duoserve.cli.trace import app as trace_app
from duoserve.cli.train import app as train_app

runner = CliRunner()


def test_collect_then_info_on_the_embedded_default(tmp_path):
    out = tmp_path / "traces"
    result = runner.invoke(trace_app, ["collect", "--count", "3", "--max-new-tokens", "4", "--batch-size", "2",
                                       "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "requests" in result.output and "8 x 16, 4" in " ".join(result.output.split())
    assert list(out.glob("part-r000-*.parquet"))
    info = runner.invoke(trace_app, ["info", str(out)])
    assert info.exit_code == 0, info.output
    assert "squad-sample" in info.output and "orca-math-sample" in info.output
    assert "expert usage per MoE layer" in info.output
    health = runner.invoke(eval_app, ["health", str(out)])
    assert health.exit_code == 0 and "max load / uniform" in health.output and "random choice" in health.output
    again = runner.invoke(trace_app, ["collect", "--count", "3", "--max-new-tokens", "4", "--batch-size", "2",
                                      "--device", "cpu", "--out", str(out)])
    assert again.exit_code == 0 and "│ 6        │ 6 " in again.output  # all 6 requests resumed, none redone


@pytest.mark.parametrize("args, message", [
    (["collect", "--dataset", "nope"], "unknown dataset 'nope'"),
    (["collect", "--fraction", "2"], "fraction must be in (0, 1]"),
    (["collect", "--model", "/no/such/model", "--count", "1"], "no model at /no/such/model"),
    (["info", "/no/such/trace"], "no trace at /no/such/trace"),
])
def test_user_errors_exit_2_with_a_message(tmp_path, args, message):
    result = runner.invoke(trace_app, [*args, *(["--out", str(tmp_path / "o")] if args[0] == "collect" else [])])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("app", [trace_app, train_app, eval_app, run_app])
def test_every_app_has_help(app):
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "Usage" in result.output


def test_runtime_cli_lists_its_commands():
    result = runner.invoke(run_app, ["--help"])
    assert result.exit_code == 0 and "generate" in result.output and "bench" in result.output
