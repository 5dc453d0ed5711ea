"""Routing statistics, examples, split and predictor features against brute-force references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from duoserve.cli.train import app as train_app
from duoserve.features.counting import BACKENDS, RoutingCounter, cpu_backend
from duoserve.features.examples import load_routing, make_examples, split_requests
from duoserve.features.stats import RoutingStats, compute_stats, stats_from_ids
from duoserve.metrics import topk_metrics
from duoserve.predictor.model import ExpertPredictor, FeatureSpec
from tests.conftest import write_trace

L, E, K = 4, 6, 2


def _random_ids(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(n)])  # n x L x k


def _brute_force(ids: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    _, layers, _ = ids.shape
    pop, aff = np.zeros((layers, num_experts), int), np.zeros((layers - 1, num_experts, num_experts), int)
    for token in ids:
        for l in range(layers):
            for i in token[l]:
                pop[l, i] += 1
                if l + 1 < layers:
                    for j in token[l + 1]:
                        aff[l, i, j] += 1
    return pop, aff


CPU_BACKENDS = [b for b in BACKENDS if b != "auto"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_every_counting_backend_equals_brute_force(backend):
    if backend == "numba":
        pytest.importorskip("numba", reason="the compiled backend needs numba")
    rng = np.random.default_rng(3)
    ids = np.stack([np.stack([rng.choice(40, 5, replace=False) for _ in range(6)]) for _ in range(3000)])  # 3000 x 6 x 5
    ids[:2700, 2:4] = 7  # one id repeated at layers 2 and 3: bin (7, 7) of pair 2 gains 25 a token, past uint16's range
    counter = RoutingCounter(6, 40, 5, backend=backend)
    counter.add(ids[:2800].astype(np.int16))  # 2700 of those tokens in one call: one bin gains 67,500
    counter.add(ids[2800:].astype(np.int16))
    pop, aff = counter.counts()
    ref_pop, ref_aff = _brute_force(ids, 40)
    np.testing.assert_array_equal(aff, ref_aff)
    np.testing.assert_array_equal(pop, ref_pop)
    assert counter.tokens == 3000 and aff[2, 7, 7] >= 2700 * 25 > 65_535
    single = RoutingCounter(1, 40, 5, backend=backend)  # one MoE layer: no pairs, popularity still counted
    single.add(ids[:, :1])
    np.testing.assert_array_equal(single.counts()[0], ref_pop[:1])
    with pytest.raises(ValueError, match="expected N x 6 x 5"):
        counter.add(ids[:, :5])


def test_counting_backend_choice():
    assert cpu_backend("numpy") == "numpy"
    assert cpu_backend("auto") in CPU_BACKENDS
    with pytest.raises(ValueError, match="unknown counting backend"):
        cpu_backend("fortran")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="counting on the GPU needs a CUDA device")
def test_cuda_counts_equal_cpu_counts_bit_for_bit(tmp_path):
    ids = _random_ids(3000, 4)
    trace = write_trace(tmp_path / "t", ids, np.arange(3000) // 30, parts=2)
    cpu = compute_stats(trace, batch_rows=700)
    gpu = compute_stats(trace, batch_rows=700, device="cuda")
    np.testing.assert_array_equal(gpu.affinity_counts, cpu.affinity_counts)
    np.testing.assert_array_equal(gpu.popularity_counts, cpu.popularity_counts)
    np.testing.assert_array_equal(cpu.affinity_counts, _brute_force(ids, E)[1])
    assert gpu.tokens == cpu.tokens == 3000 and gpu.affinity_counts.dtype == np.int64


def test_stats_of_two_folders_equal_the_stats_of_their_union(tmp_path):
    first, second = _random_ids(200, 5), _random_ids(120, 6)
    write_trace(tmp_path / "a", first, np.arange(200) // 10)
    write_trace(tmp_path / "b", second, np.arange(120) // 10)
    out = tmp_path / "s.safetensors"
    result = CliRunner().invoke(train_app, ["stats", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    merged, union = RoutingStats.load(out), stats_from_ids(np.concatenate([first, second]), E)
    np.testing.assert_array_equal(merged.affinity_counts, union.affinity_counts)
    np.testing.assert_array_equal(merged.popularity_counts, union.popularity_counts)
    assert merged.tokens == 320


def test_stats_equal_brute_force_and_merge(tmp_path):
    ids = _random_ids(300, 0)
    phases = ["prefill"] * 100 + ["decode"] * 200
    trace = write_trace(tmp_path / "t", ids, np.arange(300) // 10, phases=phases)
    stats = compute_stats(trace, batch_rows=7)  # several batches
    pop, aff = _brute_force(ids, E)
    np.testing.assert_array_equal(stats.popularity_counts, pop)
    np.testing.assert_array_equal(stats.affinity_counts, aff)
    assert stats.tokens == 300
    np.testing.assert_allclose(stats.popularity.sum(1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(stats.affinity[0, ids[0, 0, 0]].sum(), 1.0, rtol=1e-6)

    decode = compute_stats(trace, phase="decode")
    prefill = compute_stats(trace, phase="prefill")
    merged = prefill.merge(decode)
    np.testing.assert_array_equal(merged.affinity_counts, aff)
    assert (decode.tokens, prefill.tokens) == (200, 100)
    np.testing.assert_array_equal(stats_from_ids(ids[100:], E).affinity_counts, decode.affinity_counts)

    merged.save(tmp_path / "s.safetensors")
    loaded = RoutingStats.load(tmp_path / "s.safetensors")
    np.testing.assert_array_equal(loaded.affinity_counts, aff)
    assert loaded.tokens == 300
    with pytest.raises(ValueError, match="cannot merge"):
        stats.merge(RoutingStats(np.zeros((3, E), int), np.zeros((2, E, E), int), 0))


def test_stats_counted_in_worker_processes_equal_one_process(tmp_path):
    ids = _random_ids(300, 1)
    trace = write_trace(tmp_path / "t", ids, np.arange(300) // 10, phases=["prefill"] * 150 + ["decode"] * 150,
                        parts=3)
    assert len(trace.files) == 3
    one, many = compute_stats(trace, phase="decode"), compute_stats(trace, phase="decode", workers=2)
    np.testing.assert_array_equal(many.popularity_counts, one.popularity_counts)
    np.testing.assert_array_equal(many.affinity_counts, one.affinity_counts)
    np.testing.assert_array_equal(many.affinity_counts, stats_from_ids(ids[150:], E).affinity_counts)
    assert many.tokens == one.tokens == 150 and many.meta == one.meta
    with pytest.raises(ValueError, match="workers must be at least 1"):
        compute_stats(trace, workers=0)

    out = tmp_path / "s.safetensors"
    result = CliRunner().invoke(train_app, ["stats", str(trace.path), "--out", str(out), "--workers", "2"])
    assert result.exit_code == 0, result.output
    saved = RoutingStats.load(out)
    np.testing.assert_array_equal(saved.affinity_counts, compute_stats(trace).affinity_counts)
    assert saved.tokens == 300
    bad = CliRunner().invoke(train_app, ["stats", str(tmp_path / "none"), "--out", str(tmp_path / "x.safetensors")])
    assert bad.exit_code == 2 and "no trace at" in " ".join(bad.output.split())
    assert not (tmp_path / "x.safetensors").exists()


def test_split_is_by_request_and_deterministic(tmp_path):
    ids = _random_ids(400, 1)
    datasets = ["squad"] * 200 + ["orca-math"] * 200
    trace = write_trace(tmp_path / "t", ids, np.arange(400) % 40, datasets=datasets)
    table = load_routing([trace])
    assert len(table.requests) == 80  # the same request id in two datasets is two requests
    val = split_requests(table.requests, 0.25, seed=3)
    assert val.tolist() == split_requests(table.requests, 0.25, seed=3).tolist()
    assert val.tolist() != split_requests(table.requests, 0.25, seed=4).tolist()
    val_token = val[table.request]
    train_keys = {table.requests[r] for r in table.request[~val_token]}
    val_keys = {table.requests[r] for r in table.request[val_token]}
    assert train_keys and val_keys and not train_keys & val_keys
    ex = make_examples(np.flatnonzero(val_token), L)
    assert len(ex.token) == val_token.sum() * (L - 1) and set(ex.target.tolist()) == {1, 2, 3}
    with pytest.raises(ValueError, match="cannot be split"):
        split_requests([("squad", 1)], 0.1, 0)
    with pytest.raises(ValueError, match="no trace rows match"):
        load_routing([trace], phase="prefill")


def test_predictor_features_by_hand():
    spec = FeatureSpec(L, E, K, window=2)
    pop = torch.rand(L, E)
    aff = torch.rand(L - 1, E, E)
    model = ExpertPredictor(spec, widths=(8,), popularity=pop, affinity=aff)
    history = torch.tensor([[[0, 1], [2, 3], [4, 5], [1, 2]]])  # 1 x L x k
    x = model.features(history, torch.tensor([1]))[0]
    assert x.shape == (spec.input_dim,) == (2 * E + E + E + L,)
    window = x[:2 * E].view(2, E)
    assert window[0].sum() == 0  # layer -1 does not exist
    assert window[1].nonzero().flatten().tolist() == [0, 1]  # layer 0's experts in the last slot
    torch.testing.assert_close(x[2 * E:3 * E], pop[1])
    torch.testing.assert_close(x[3 * E:4 * E], aff[0, 0] + aff[0, 1])
    assert x[4 * E:].tolist() == [0, 1, 0, 0]
    x3 = model.features(history, torch.tensor([3]))[0]
    assert x3[:E].nonzero().flatten().tolist() == [2, 3] and x3[E:2 * E].nonzero().flatten().tolist() == [4, 5]
    torch.testing.assert_close(x3[3 * E:4 * E], aff[2, 4] + aff[2, 5])
    with pytest.raises(ValueError, match="history window"):
        FeatureSpec(L, E, K, window=L)


def test_topk_metrics_by_hand():
    true = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]])
    scores = torch.zeros(3, 8)
    scores[0, [0, 1, 2, 3]] = 1  # exact
    scores[1, [0, 1, 6, 7]] = 1  # half
    scores[2, [0, 5, 6, 7]] = 1  # one of four
    m = topk_metrics(scores, true, 8)
    assert m["exact_topk"] == pytest.approx(1 / 3)
    assert m["at_least_half"] == pytest.approx(2 / 3)
    assert m["recall"] == pytest.approx((4 + 2 + 1) / 12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_counting_refuses_ids_outside_the_expert_range(backend):
    if backend == "numba":
        pytest.importorskip("numba", reason="the compiled backend needs numba")
    counter = RoutingCounter(2, 4, 1, backend=backend)
    for bad, dtype in ((-1, np.int16), (4, np.int16), (-3, np.int64), (70_000, np.int64)):
        ids = np.zeros((3, 2, 1), dtype)
        ids[1, 1, 0] = bad
        with pytest.raises(ValueError, match=f"expert id {bad} is outside 0..3"):
            counter.add(ids)
    assert counter.tokens == 0
