"""Trace collection: routing equals a direct reading of the router, token for token, for three architectures."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from duoserve.data.tasks import parse_datasets
from duoserve.discovery import find_moe_layers, moe_geometry
from duoserve.loading import load_model
from duoserve.trace import RoutingRecorder, open_trace
from duoserve.trace.collect import CollectSettings, collect, rows_from_records
from duoserve.trace.format import nextgate_column, nextgate_scores_column
from duoserve.trace.hooks import ForwardRecord
from tests.conftest import ARCHS


def _settings(model, out, **kw) -> CollectSettings:
    base = dict(model=str(model), datasets=parse_datasets(["squad-sample", "orca-math-sample"]), out=out,
                fraction=None, count=3, max_new_tokens=6, batch_size=4, lookahead=2, device="cpu",
                dtype="float32")
    return CollectSettings(**{**base, **kw})


def _request_rows(trace, dataset: str, request_id: int):
    df = trace.dataset.to_table().to_pandas()
    df = df[(df.dataset == dataset) & (df.request_id == request_id)]
    return df.assign(order=(df.phase == "decode").astype(int)).sort_values(["order", "position"])


@torch.no_grad()
def _reference(model, layers, token_ids: torch.Tensor):
    """Routing of an unpadded single-sequence forward: router outputs (via hooks) and output_router_logits."""
    captured = {}

    def keep(l):
        def hook(module, args, output):
            captured[l] = (args[0], output)
        return hook

    handles = [layer.router.register_forward_hook(keep(l)) for l, layer in enumerate(layers)]
    try:
        out = model(input_ids=token_ids[None], output_router_logits=True)
    finally:
        for h in handles:
            h.remove()
    return captured, out.router_logits


@pytest.mark.parametrize("arch", ARCHS)
def test_trace_matches_router_token_for_token(arch, arch_models, tokenizer, tmp_path):
    result = collect(_settings(arch_models[arch], tmp_path / "t"))
    trace = open_trace(tmp_path / "t")
    model, _ = load_model(str(arch_models[arch]), "cpu", "float32")
    layers = find_moe_layers(model)
    L, k = trace.meta.num_layers, trace.meta.top_k
    assert (L, trace.meta.num_experts, k) == (3, 8, 2) and result.requests == 6
    # DeepSeek-V3's first decoder layer is dense: L counts MoE layers only
    assert trace.meta.decoder_indices == ([1, 2, 3] if arch == "deepseek_v3" else [0, 1, 2])
    assert trace.meta.lookahead == 2

    prompt_lengths = []
    for dataset in ("squad-sample", "orca-math-sample"):
        for request_id in sorted(set(trace.column("request_id").to_pylist())):
            rows = _request_rows(trace, dataset, request_id)
            if rows.empty:
                continue
            prefill = rows[rows.phase == "prefill"]
            prompt = next(r.prompt for r in result_requests(dataset) if r.request_id == request_id)
            prompt_ids = tokenizer(prompt)["input_ids"]
            # padding is never recorded: exactly the prompt's own tokens, positions 0..n-1
            assert prefill.token_id.tolist() == prompt_ids
            assert prefill.position.tolist() == list(range(len(prompt_ids)))
            assert tokenizer.pad_token_id not in rows.token_id.tolist()
            prompt_lengths.append(len(prompt_ids))
            tokens = torch.tensor(rows.token_id.tolist())
            assert rows.position.tolist() == list(range(len(tokens)))
            captured, logits = _reference(model, layers, tokens)
            experts = np.stack(rows.experts.to_numpy()).reshape(-1, L, k)
            scores = np.stack(rows.scores.to_numpy()).reshape(-1, L, k).astype(np.float32)
            for l in range(L):
                hidden, (_, weights, ids) = captured[l]
                np.testing.assert_array_equal(experts[:, l], ids.numpy())
                if arch != "deepseek_v3":  # its group-limited, bias-corrected choice is not the logits' top-k
                    np.testing.assert_array_equal(experts[:, l], logits[l].topk(k, dim=-1).indices.numpy())
                np.testing.assert_allclose(scores[:, l], weights.float().numpy(), atol=2e-3)
                for d in (1, 2):
                    if l + d < L:
                        router_logits, _, guess = layers[l + d].router(hidden.reshape(-1, hidden.shape[-1]))
                        m = trace.meta.nextgate_width
                        ng = np.stack(rows[nextgate_column(d)].to_numpy()).reshape(-1, L - d, m)
                        ng_scores = np.stack(rows[nextgate_scores_column(d)].to_numpy()).reshape(-1, L - d, m)
                        np.testing.assert_array_equal(ng[:, l, :k], guess.numpy())  # the router's own pick first
                        probs = router_logits.detach().float().softmax(-1)
                        assert all(len(set(row)) == m for row in ng[:, l].tolist())  # m distinct experts a token
                        np.testing.assert_allclose(ng_scores[:, l].astype(np.float32),
                                                   probs.gather(1, torch.from_numpy(ng[:, l]).long()).numpy(),
                                                   atol=1e-3)
                        if arch != "deepseek_v3":  # the rest: the next best by probability
                            top_m = probs.topk(m, dim=-1).indices.sort(-1).values.numpy()
                            np.testing.assert_array_equal(np.sort(ng[:, l], axis=1), top_m)
    assert len(prompt_lengths) == 6
    assert len(set(prompt_lengths)) > 3, "batches of mixed prompt lengths, so that padding was present"


def result_requests(dataset: str):
    from duoserve.data.tasks import load_requests

    return load_requests(parse_datasets([dataset])[0], None, 3, 0)


def test_decode_rows_stop_at_eos():
    """A sequence that emitted EOS contributes no later decode rows; the others continue."""
    B, S, L, k, C = 2, 3, 2, 2, 4
    eos = 9

    def rec(T, base):
        ids = (torch.arange(T * L * k).reshape(T, L, k) + base).to(torch.int16)
        return ForwardRecord(ids, ids.float(), {1: ids[:, :1].clone()}, {1: ids[:, :1].half()})

    records = [rec(B * S, 0)] + [rec(B, 100 * (c + 1)) for c in range(C)]
    input_ids = torch.tensor([[0, 5, 6], [4, 5, 6]])
    attention_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    generated = torch.tensor([[7, eos, 0, 0, 0], [7, 8, 8, 8, 8]])  # row 0 stops after its first token
    rows = rows_from_records(records, input_ids, attention_mask, generated, [eos], lookahead=1)
    assert rows["batch_index"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    assert rows["phase"].tolist() == ["prefill"] * 2 + ["decode"] + ["prefill"] * 3 + ["decode"] * 4
    assert rows["position"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]
    assert rows["token_id"].tolist() == [5, 6, 7, 4, 5, 6, 7, 8, 8, 8]
    # row 0's first decode row is decode call 1 (records[1]) at batch index 0
    np.testing.assert_array_equal(rows["experts"][2], records[1].ids[0].reshape(-1).numpy())
    np.testing.assert_array_equal(rows["experts"][0], records[0].ids[1].reshape(-1).numpy())
    assert rows["nextgate"].shape == rows["nextgate_scores"].shape == (10, k)


def test_recorder_removes_hooks_and_leaves_model_untouched(arch_models):
    model, tok = load_model(str(arch_models["qwen3_moe"]), "cpu", "float32")
    layers = find_moe_layers(model)
    x = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        before = model(input_ids=x).logits
        with RoutingRecorder(layers, moe_geometry(model, layers).top_k, lookahead=1) as rec:
            during = model(input_ids=x).logits
            assert all(len(layer.experts._forward_pre_hooks) == 1 for layer in layers)
        after = model(input_ids=x).logits
    assert all(len(layer.experts._forward_pre_hooks) == 0 for layer in layers)
    torch.testing.assert_close(before, during)
    torch.testing.assert_close(before, after)
    (record,) = rec.pop()
    assert record.ids.shape == (5, 3, 2) and record.nextgate[1].shape == record.nextgate_scores[1].shape == (5, 2, 4)


def test_resume_after_crash_equals_uninterrupted_run(arch_models, tmp_path):
    model = arch_models["mixtral"]
    collect(_settings(model, tmp_path / "full", batch_size=2, rows_per_part=1))

    class Crash(Exception):
        pass

    def crash_after_two(done, total):
        if done >= 4:
            raise Crash

    with pytest.raises(Crash):
        collect(_settings(model, tmp_path / "resumed", batch_size=2, rows_per_part=1), crash_after_two)
    partial = open_trace(tmp_path / "resumed")
    assert len(partial.files) == 2
    again = collect(_settings(model, tmp_path / "resumed", batch_size=2, rows_per_part=1))
    assert again.resumed == 4 and again.requests == 6
    keys = ["dataset", "request_id", "phase", "position"]
    full = open_trace(tmp_path / "full").dataset.to_table().to_pandas().sort_values(keys).reset_index(drop=True)
    resumed = open_trace(tmp_path / "resumed").dataset.to_table().to_pandas().sort_values(keys).reset_index(drop=True)
    assert len(full) == len(resumed) > 0
    assert not resumed.duplicated(keys).any()
    for col in full.columns:
        assert full[col].map(repr).tolist() == resumed[col].map(repr).tolist(), col
    assert not list((tmp_path / "resumed").glob(".*tmp"))
    # running once more changes nothing
    assert collect(_settings(model, tmp_path / "resumed", batch_size=2, rows_per_part=1)).resumed == 6
    assert len(open_trace(tmp_path / "resumed").files) == len(partial.files) + 1


def test_ranks_share_requests_without_overlap(arch_models, tmp_path, monkeypatch):
    out = tmp_path / "t"
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert collect(_settings(arch_models["olmoe"], out, max_new_tokens=2)).requests == 3
    trace = open_trace(out)
    assert {f.name.split("-")[1] for f in trace.files} == {"r000", "r001"}
    pairs = trace.dataset.to_table(columns=["dataset", "request_id"]).group_by(["dataset", "request_id"]).aggregate([])
    assert pairs.num_rows == 6


def test_bad_inputs_fail_clearly_and_leave_nothing(arch_models, dense_model, tmp_path):
    from duoserve.discovery import UnsupportedModelError
    from duoserve.loading import ModelLoadError

    out = tmp_path / "never"
    with pytest.raises(ModelLoadError, match="no/such/model"):
        collect(_settings(tmp_path / "no/such/model", out))
    with pytest.raises(UnsupportedModelError, match="has no MoE layers"):
        collect(_settings(dense_model, out))
    with pytest.raises(ValueError, match="fraction must be in"):
        collect(_settings(arch_models["mixtral"], out, fraction=1.5, count=None))
    with pytest.raises(ValueError, match="unknown dataset 'sqad'"):
        parse_datasets(["sqad"])
    assert not out.exists()

    a_file = tmp_path / "file"
    a_file.write_text("keep me")
    with pytest.raises(FileExistsError, match="is a file"):
        collect(_settings(arch_models["mixtral"], a_file))
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        collect(_settings(arch_models["mixtral"], other))
    assert a_file.read_text() == "keep me" and [p.name for p in other.iterdir()] == ["notes.txt"]

    collect(_settings(arch_models["mixtral"], tmp_path / "t", max_new_tokens=1))
    with pytest.raises(FileExistsError, match="max_new_tokens|generation"):
        collect(_settings(arch_models["mixtral"], tmp_path / "t", max_new_tokens=2))


def test_unsupported_experts_module_is_refused(arch_models):
    from duoserve.discovery import UnsupportedModelError

    model, _ = load_model(str(arch_models["qwen3_moe"]), "cpu", "float32")
    model.model.layers[1].mlp.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    with pytest.raises(UnsupportedModelError, match=r"model.layers.1.mlp.experts \(ModuleList\)"):
        find_moe_layers(model, "my-model")


def test_open_trace_rejects_foreign_and_mixed_files(arch_models, tmp_path):
    import pyarrow as pa

    pq.write_table(pa.table({"x": [1]}), tmp_path / "part-x.parquet")
    with pytest.raises(ValueError, match="not a duoserve trace"):
        open_trace(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no trace part files"):
        open_trace(tmp_path / "empty")
    a = collect(_settings(arch_models["mixtral"], tmp_path / "a", max_new_tokens=1)).out
    b = collect(_settings(arch_models["mixtral"], tmp_path / "b", max_new_tokens=2)).out
    (b / "part-r000-00000.parquet").rename(a / "part-r009-00000.parquet")
    with pytest.raises(ValueError, match="different run"):
        open_trace(a)


def test_a_killed_collection_at_default_settings_resumes_losing_and_duplicating_nothing(tmp_path, embedded_trace):
    # the embedded default's own command, killed (SIGKILL) once its first part file is in place, then rerun
    import re
    import signal
    import subprocess
    import sys
    import time

    from duoserve.trace.writer import finished_requests

    out = tmp_path / "traces"
    # fewer decode steps than the fixture's: prompts, and so the prefill rows compared below, do not depend on them
    command = [sys.executable, "-m", "duoserve.cli.trace", "collect", "--max-new-tokens", "4", "--device", "cpu",
               "--out", str(out)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list(out.glob("part-*.parquet")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = len(list(out.glob("part-*.parquet")))
    assert written >= 1 and proc.returncode == -signal.SIGKILL  # killed mid-run, with work on disk
    kept = len(finished_requests(out))
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    # the summary row: requests in this rank's share, then how many of them were already on disk
    share, resumed = map(int, re.search(r"│\s*(\d+)\s*│\s*(\d+)\s*│", done.stdout).groups())
    assert 0 < resumed == kept < share

    def requests(path) -> dict:
        table = open_trace(path).dataset.to_table(columns=["dataset", "request_id", "phase", "position"]).to_pandas()
        assert not table.duplicated().any()  # no token twice
        prefill = table[table.phase == "prefill"]
        return prefill.groupby(["dataset", "request_id"]).size().to_dict()  # prompt tokens per request

    # every request of the uninterrupted run, once, with all of its prompt tokens
    assert requests(out) == requests(embedded_trace.path)
    assert len(list(out.glob("part-*.parquet"))) > written and not list(out.glob(".*tmp"))
