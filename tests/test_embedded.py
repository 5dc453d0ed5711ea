"""The embedded default: a tiny trained MoE whose routing is healthy, task-dependent and predictable."""

from __future__ import annotations

from math import ceil, comb

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from duoserve.data.tasks import TASKS
from duoserve.embedded import EMBEDDED_MODEL
from duoserve.features.examples import load_routing
from duoserve.features.stats import stats_from_ids
from duoserve.metrics import topk_metrics
from duoserve.predictor.baselines import affinity_markov_scores
from duoserve.trace.info import TraceSummary, expert_usage


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL).eval(), AutoTokenizer.from_pretrained(EMBEDDED_MODEL)


def test_bundled_model_loads_with_plain_transformers(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    cfg = model.config
    assert cfg.model_type == "qwen3_moe"
    assert cfg.num_hidden_layers >= 8 and cfg.num_experts >= 16 and cfg.num_experts_per_tok >= 2
    assert not cfg.mlp_only_layers and cfg.decoder_sparse_step == 1  # every layer is MoE
    size = sum(f.stat().st_size for f in EMBEDDED_MODEL.iterdir())
    assert size < 5 * 2**20, f"bundled model is {size / 2**20:.1f} MiB"
    assert tokenizer.decode(tokenizer("Question: 12 + 7 = 19").input_ids) == "Question: 12 + 7 = 19"


def _complete(model, tokenizer, prompt: str, n: int = 60) -> str:
    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True)


def test_completes_both_tasks_recognisably(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    math = [_complete(model, tokenizer, TASKS["orca-math"].prompt(r)) for r in TASKS["orca-math"].sample(6, 11)]
    squad = [_complete(model, tokenizer, TASKS["squad"].prompt(r), 12) for r in TASKS["squad"].sample(6, 11)]
    assert sum("The answer is" in c and " = " in c for c in math) >= 5, math
    # reading comprehension: a short one-line answer, not another question or a worked solution
    assert sum(0 < len(c.split()) <= 4 and "\n" not in c and "=" not in c for c in squad) >= 5, squad


def test_routing_is_healthy_on_every_layer(embedded_trace):
    usage = expert_usage(embedded_trace)
    E = embedded_trace.meta.num_experts
    for s in TraceSummary({}, {}, usage).layer_stats():
        assert s["experts_used"] >= ceil(0.75 * E), s
        assert s["max_over_uniform"] <= 3.0, s


def test_tasks_route_differently(embedded_trace):
    squad = expert_usage(embedded_trace, dataset="squad-sample").astype(float)
    math = expert_usage(embedded_trace, dataset="orca-math-sample").astype(float)
    tv = 0.5 * np.abs(squad / squad.sum(1, keepdims=True) - math / math.sum(1, keepdims=True)).sum(1)  # per layer
    assert tv.min() > 0.05 and tv.mean() > 0.08, tv


def test_next_layer_is_predictable_above_chance(embedded_trace):
    """Affinity from even requests predicts odd requests' decode routing far above random choice."""
    meta = embedded_trace.meta
    L, E, k = meta.num_layers, meta.num_experts, meta.top_k
    table = load_routing([embedded_trace])
    train = np.array([r % 2 == 0 for _, r in table.requests])[table.request]
    test = ~train & table.decode
    affinity = torch.from_numpy(stats_from_ids(table.ids[train], E).affinity)
    ids = torch.from_numpy(table.ids[test].astype(np.int64))  # N x L x k
    target = torch.arange(1, L).repeat(len(ids))  # N*(L-1): every layer after the first
    previous = ids[:, :-1].reshape(-1, k)  # N*(L-1) x k: the routed experts one layer earlier
    truth = ids[:, 1:].reshape(-1, k)
    m = topk_metrics(affinity_markov_scores(affinity, previous, target), truth, E)
    random_choice = sum(comb(k, i) * comb(E - k, k - i) for i in range(ceil(k / 2), k + 1)) / comb(E, k)
    assert len(ids) > 500
    assert m["at_least_half"] > max(0.45, 1.6 * random_choice), (m, random_choice)


def test_training_script_is_bit_for_bit_reproducible(tmp_path):
    """Two short runs of scripts/train_embedded_moe.py give identical weights and tokenizer."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "train_embedded_moe.py"
    spec = importlib.util.spec_from_file_location("train_embedded_moe", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for run in ("a", "b"):
        module.main(tmp_path / run, steps=6)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (EMBEDDED_MODEL / "tokenizer.json").read_bytes()
