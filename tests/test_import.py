"""Importing routing logs: long rows (jsonl/csv/parquet), SGLang per-token dumps, NumPy arrays; errors; round trip."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from duoserve.features.stats import compute_stats
from duoserve.trace import open_trace
from duoserve.trace.importers import (
    ImportFormatError,
    ImportSettings,
    export_long,
    import_trace,
)

# 2 requests x 2 tokens x 3 layers, k=2; request 8's token 1 lacks layer 2 (dropped and counted)
LOG = [
    {"problem_id": 5, "token_idx": 0, "layer": 0, "experts": [1, 2], "gating_probs": [0.75, 0.25]},
    {"problem_id": 5, "token_idx": 0, "layer": 1, "experts": [3, 0], "gating_probs": [0.5, 0.5]},
    {"problem_id": 5, "token_idx": 0, "layer": 2, "experts": [2, 3], "gating_probs": [0.625, 0.375]},
    {"problem_id": 5, "token_idx": 1, "layer": 2, "experts": [0, 1], "gating_probs": [0.5, 0.5]},
    {"problem_id": 5, "token_idx": 1, "layer": 0, "experts": [3, 2], "gating_probs": [0.875, 0.125]},
    {"problem_id": 5, "token_idx": 1, "layer": 1, "experts": [1, 0], "gating_probs": [0.5, 0.5]},
    {"problem_id": 8, "token_idx": 0, "layer": 0, "experts": [0, 1], "gating_probs": [0.5, 0.5]},
    {"problem_id": 8, "token_idx": 0, "layer": 1, "experts": [2, 3], "gating_probs": [0.5, 0.5]},
    {"problem_id": 8, "token_idx": 0, "layer": 2, "experts": [3, 1], "gating_probs": [0.5, 0.5]},
    {"problem_id": 8, "token_idx": 1, "layer": 0, "experts": [0, 2], "gating_probs": [0.5, 0.5]},
    {"problem_id": 8, "token_idx": 1, "layer": 1, "experts": [1, 3], "gating_probs": [0.5, 0.5]},
]
MAP = dict(request="problem_id", token="token_idx", layer="layer", experts="experts", scores="gating_probs")


def _write_log(rows, path):
    df = pd.DataFrame(rows)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".csv":
        df.assign(experts=df.experts.map(str), gating_probs=df.gating_probs.map(str)).to_csv(path, index=False)
    else:
        df.to_parquet(path)
    return path


def _rows(trace):
    df = trace.dataset.to_table().to_pandas().sort_values(["request_id", "position"]).reset_index(drop=True)
    return df


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_long_logs_convert_field_by_field(tmp_path, suffix):
    src = _write_log(LOG, tmp_path / f"log{suffix}")
    result = import_trace(ImportSettings(src, tmp_path / "t", **MAP, dataset="my-task", num_experts=6))
    assert (result.tokens, result.dropped, result.geometry) == (3, 1, (3, 6, 2))
    assert result.inferred == ["num_layers", "top_k"]
    trace = open_trace(tmp_path / "t")
    df = _rows(trace)
    assert df.request_id.tolist() == [5, 5, 8] and df.position.tolist() == [0, 1, 0]
    assert df.phase.tolist() == ["decode"] * 3 and df.dataset.tolist() == ["my-task"] * 3
    assert df.token_id.tolist() == [-1] * 3
    assert [list(e) for e in df.experts] == [[1, 2, 3, 0, 2, 3], [3, 2, 1, 0, 0, 1], [0, 1, 2, 3, 3, 1]]
    np.testing.assert_allclose(np.stack(df.scores)[0], [0.75, 0.25, 0.5, 0.5, 0.625, 0.375])
    assert trace.meta.num_experts == 6 and trace.meta.model == "imported"


def test_long_log_errors_name_file_and_line(tmp_path):
    def fails(rows, match, **kw):
        out = tmp_path / f"o{len(list(tmp_path.iterdir()))}"
        with pytest.raises(ImportFormatError, match=match):
            import_trace(ImportSettings(_write_log(rows, tmp_path / f"bad{len(list(tmp_path.iterdir()))}.jsonl"),
                                        out, **{**MAP, **kw}))
        assert not out.exists()

    fails(LOG + [LOG[1]], r"duplicate rows for request 5, token 0, layer 1 \(line 2 and line 12\)")
    fails([*LOG[:4], {**LOG[4], "experts": [3, 2, 1]}, *LOG[5:]], r"line 5: experts has 3 values, expected k=2")
    fails(LOG, r"line 2: expert id \[3, 0\] out of range 0..2", num_experts=3)
    fails(LOG, r"line 2: expert id \[3, 0\] out of range 0..2", num_experts=3, num_layers=3, top_k=2)  # no scan
    fails(LOG, r"no column 'request_id'", request="request_id")
    fails(LOG, r"phase values \['generate'\] are not prefill or decode", phase="generate")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        (tmp_path / "full").mkdir()
        (tmp_path / "full" / "x").write_text("x")
        import_trace(ImportSettings(_write_log(LOG, tmp_path / "ok.jsonl"), tmp_path / "full", **MAP))


def test_sglang_per_token_dump(tmp_path):
    layers, k = 4, 2
    decode = torch.full((layers, 3, k), -1, dtype=torch.int32)  # layer 0 is dense: never routed
    decode[1:, 0] = torch.tensor([[4, 5], [0, 1], [2, 3]])
    decode[1:, 1] = torch.tensor([[1, 2], [3, 4], [5, 0]])  # token 2 is an unused slot (all -1)
    prefill = torch.full((layers, 2, k), -1, dtype=torch.int32)
    prefill[1:, 0] = torch.tensor([[0, 1], [2, 3], [4, 5]])
    prefill[1:3, 1] = torch.tensor([[1, 0], [3, 2]])  # token 1 lacks layer 3: dropped and counted
    physical_to_logical = torch.arange(6).repeat(layers, 1)
    physical_to_logical[:, 5] = 4  # physical expert 5 is a replica of logical expert 4
    torch.save({"records": [{"forward_pass_id": 11, "forward_mode": 2, "rank": 0, "topk_ids_of_layer": decode},
                            {"forward_pass_id": 12, "forward_mode": 1, "rank": 0, "topk_ids_of_layer": prefill}],
                "last_physical_to_logical_map": physical_to_logical}, tmp_path / "dump_0.pt")
    result = import_trace(ImportSettings(tmp_path, tmp_path / "t", format="sglang"))
    assert (result.tokens, result.dropped, result.geometry) == (3, 1, (3, 5, 2))
    df = _rows(open_trace(tmp_path / "t"))
    assert df.request_id.tolist() == [11, 11, 12] and df.phase.tolist() == ["decode", "decode", "prefill"]
    assert [list(e) for e in df.experts] == [[4, 4, 0, 1, 2, 3], [1, 2, 3, 4, 4, 0], [0, 1, 2, 3, 4, 4]]


@pytest.mark.parametrize("layout", ["lt", "tl"])
def test_numpy_arrays_in_both_layouts(tmp_path, layout):
    rng = np.random.default_rng(0)
    a = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(3)]) for _ in range(5)])  # T x L x k
    b = a[:4].copy()
    b[2, 1] = -1  # a token lacking layer 1
    arrays = {"first": a, "second": b} if layout == "tl" else {"first": a.transpose(1, 0, 2), "second": b.transpose(1, 0, 2)}
    np.savez(tmp_path / "routing.npz", **arrays)
    result = import_trace(ImportSettings(tmp_path / "routing.npz", tmp_path / "t", format="npy", layout=layout,
                                         num_experts=8))
    assert (result.tokens, result.dropped, result.geometry) == (8, 1, (3, 8, 2))
    df = _rows(open_trace(tmp_path / "t"))
    assert df.request_id.tolist() == [0] * 5 + [1] * 3 and df.position.tolist() == [0, 1, 2, 3, 4, 0, 1, 3]
    np.testing.assert_array_equal(np.stack(df.experts)[:5], a.reshape(5, -1))
    with pytest.raises(ImportFormatError, match="ragged top-k"):
        c = a.copy()
        c[0, 0, 1] = -1
        np.save(tmp_path / "ragged.npy", c)
        import_trace(ImportSettings(tmp_path / "ragged.npy", tmp_path / "r", format="npy", layout="tl"))


def test_round_trip_reproduces_the_trace(embedded_trace, tmp_path):
    rows = export_long(embedded_trace, tmp_path / "long.jsonl")
    assert rows == embedded_trace.num_rows() * embedded_trace.meta.num_layers
    result = import_trace(ImportSettings(tmp_path / "long.jsonl", tmp_path / "t", token="token", scores="scores",
                                         dataset_column="dataset", phase_column="phase", token_id_column="token_id",
                                         batch_rows=10_000))
    assert result.dropped == 0 and result.tokens == embedded_trace.num_rows()
    imported = open_trace(tmp_path / "t")
    keys = ["dataset", "request_id", "phase", "position"]
    a = embedded_trace.dataset.to_table().to_pandas().sort_values(keys).reset_index(drop=True)
    b = imported.dataset.to_table().to_pandas().sort_values(keys).reset_index(drop=True)
    for col in ("dataset", "request_id", "phase", "position", "token_id", "experts", "scores"):
        assert a[col].map(repr).tolist() == b[col].map(repr).tolist(), col
    np.testing.assert_array_equal(compute_stats(imported).affinity_counts, compute_stats(embedded_trace).affinity_counts)
    from typer.testing import CliRunner

    from duoserve.cli.trace import app as trace_app

    info = CliRunner().invoke(trace_app, ["info", str(tmp_path / "t")])
    text = " ".join(info.output.split())  # the console wraps the first line where the temp path is long
    assert info.exit_code == 0 and "squad-sample" in text and "model imported" in text


def test_a_killed_import_resumes_writing_no_token_twice(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    rng = np.random.default_rng(0)
    T, L = 30_000, 4
    ids = np.argsort(rng.random((T, L, 8)), axis=2)[..., :2]  # distinct top-2 of 8 experts
    log = tmp_path / "log.jsonl"
    log.write_text("".join(f'{{"request_id": {t // 100}, "token": {t % 100}, "layer": {l}, '
                           f'"experts": [{ids[t, l, 0]}, {ids[t, l, 1]}]}}\n' for t in range(T) for l in range(L)))
    command = [sys.executable, "-m", "duoserve.cli.trace", "import", str(log), "--part-rows", "500"]
    proc = subprocess.Popen([*command, "--out", str(tmp_path / "killed")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "killed").glob("part-*.parquet")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)  # poll fast: on a quiet machine the whole file's 60 parts can land within 20 ms
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and list((tmp_path / "killed").glob("part-*.parquet"))
    state = json.loads((tmp_path / "killed" / "_import.json").read_text())
    assert not state["complete"] and state["current"] == "log.jsonl"  # killed mid-file, with parts on disk
    subprocess.run([*command, "--out", str(tmp_path / "killed")], check=True, capture_output=True)
    subprocess.run([*command, "--out", str(tmp_path / "whole")], check=True, capture_output=True)
    resumed, whole = _rows(open_trace(tmp_path / "killed")), _rows(open_trace(tmp_path / "whole"))
    assert len(resumed) == len(whole) == T  # every token, once
    for col in ("request_id", "position", "experts"):
        assert resumed[col].map(repr).tolist() == whole[col].map(repr).tolist(), col
