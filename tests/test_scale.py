"""Scale-out through the engines' own launchers, for real on the CPU: a two-process DDP fit (Lightning, gloo) and a
two-rank collection under torchrun, each against its one-process twin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from duoserve import load_predictor
from duoserve.trace import open_trace

BIN = Path(sys.executable).parent


def _run(command: list[str]) -> None:
    """Run ``command``; where it fails, the failure carries the end of its stderr (a rank that dies takes the others
    down with SIGKILL, and only its own message says why)."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-4000:]}"


def _fit(trace: Path, out: Path, devices: int, batch_size: int) -> dict:
    command = [str(BIN / "duoserve-train"), "fit", str(trace), "--out", str(out), "--phase", "decode", "--epochs", "1",
               "--widths", "64", "--batch-size", str(batch_size), "--accelerator", "cpu", "--devices", str(devices),
               "--clean", *(["--strategy", "ddp", "--onnx"] if devices > 1 else [])]
    _run(command)
    load_predictor(out)  # loads with torch alone
    return json.loads((out / "config.json").read_text())


def test_two_process_ddp_fit_matches_one_process_with_the_same_global_batch(embedded_trace, tmp_path):
    ddp = _fit(embedded_trace.path, tmp_path / "ddp", devices=2, batch_size=512)
    one = _fit(embedded_trace.path, tmp_path / "one", devices=1, batch_size=1024)
    assert ddp["training"]["world_size"] == 2 and ddp["training"]["strategy"] == "DDPStrategy"
    assert (tmp_path / "ddp" / "model.onnx").stat().st_size > 0  # rank 0 alone exports, ONNX too
    assert one["training"]["world_size"] == 1
    a, b = ddp["metrics"]["validation"], one["metrics"]["validation"]
    assert a["popularity"] == b["popularity"]  # the same split and statistics on both
    for metric in ("exact_topk", "at_least_half", "recall"):  # the same model, up to the order it saw examples in
        assert abs(a["predictor"][metric] - b["predictor"][metric]) <= 0.03, (metric, a["predictor"], b["predictor"])


def test_a_two_rank_torchrun_collection_equals_a_one_rank_run(tmp_path):
    args = ["collect", "--count", "4", "--max-new-tokens", "6", "--device", "cpu"]
    _run([str(BIN / "torchrun"), "--nproc-per-node", "2", "-m", "duoserve.cli.trace", *args,
          "--out", str(tmp_path / "two")])
    _run([str(BIN / "duoserve-trace"), *args, "--out", str(tmp_path / "one")])
    assert {f.name.split("-")[1] for f in (tmp_path / "two").glob("part-*.parquet")} == {"r000", "r001"}
    keys = ["dataset", "request_id", "phase", "position"]
    two, one = (open_trace(tmp_path / name).dataset.to_table().to_pandas().sort_values(keys).reset_index(drop=True)
                for name in ("two", "one"))
    assert len(two) == len(one) > 0 and not two.duplicated(keys).any()
    for col in ("dataset", "request_id", "phase", "position", "token_id", "experts"):
        assert two[col].map(repr).tolist() == one[col].map(repr).tolist(), col  # request for request
    # router weights are float16 sums over other batch compositions: equal to rounding
    np.testing.assert_allclose(np.stack(two.scores), np.stack(one.scores), atol=2e-3)
    # the next-gate's top-m of all E, ranked by scores equal to that rounding: the same ids but where two of them
    # tie within it, which the two batch compositions may rank either way
    np.testing.assert_allclose(np.stack(two.nextgate_scores), np.stack(one.nextgate_scores), atol=2e-3)
    ids = np.stack(two.nextgate), np.stack(one.nextgate)  # N x (L-1)*m each
    assert (ids[0] != ids[1]).mean() < 0.01
