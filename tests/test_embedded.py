"""The embedded default: a tiny trained MoE whose routing is healthy, task-dependent and predictable."""

from __future__ import annotations

from math import ceil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from duoserve.data.tasks import TASKS
from duoserve.embedded import EMBEDDED_MODEL
from duoserve.evaluate.health import routing_health


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


@pytest.fixture(scope="module")
def health(embedded_trace):
    return routing_health(embedded_trace)


def test_routing_is_healthy_on_every_layer(health):
    assert health["min_experts_used"] >= ceil(0.75 * health["num_experts"]), health
    assert health["max_over_uniform"] <= 3.0, health


def test_tasks_route_differently(health):
    tv = np.array(health["task_tv_per_layer"])
    assert len(tv) == 8 and tv.min() > 0.05 and tv.mean() > 0.08, tv


def test_next_layer_is_predictable_above_chance(health):
    """Affinity from even requests predicts odd requests' decode routing far above random choice."""
    assert health["affinity_decode_tokens"] > 500
    assert health["random_at_least_half"] == pytest.approx(0.2445, abs=1e-4)  # E=16, k=4
    assert health["affinity"]["at_least_half"] > max(0.45, 1.6 * health["random_at_least_half"]), health


@pytest.fixture(scope="module")
def training_script():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "train_embedded_moe.py"
    spec = importlib.util.spec_from_file_location("train_embedded_moe", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_script_is_bit_for_bit_reproducible(tmp_path, training_script):
    """Two short runs of scripts/train_embedded_moe.py give identical weights and tokenizer."""
    for run in ("a", "b"):
        training_script.main(tmp_path / run, steps=6)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (EMBEDDED_MODEL / "tokenizer.json").read_bytes()


def test_per_layer_balance_loss_sees_what_the_pooled_loss_misses(training_script):
    """Two layers that each crowd onto their own half of the experts look balanced to transformers' pooled loss
    (pooled over layers every expert gets its share) but not to the per-layer one the substrate trains with."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    T, E, k = 256, 8, 2
    balanced = torch.randn(T, E) * 0.01
    lower = balanced.clone()
    lower[:, : E // 2] += 5.0  # T x E: every token routes to experts 0-3
    upper = balanced.clone()
    upper[:, E // 2:] += 5.0  # and in the next layer to experts 4-7
    per_layer = training_script.per_layer_balance_loss
    assert per_layer((balanced, balanced), E, k).item() == pytest.approx(k, rel=0.02)
    assert load_balancing_loss_func((lower, upper), E, k).item() == pytest.approx(k, rel=0.02)
    assert per_layer((lower, upper), E, k).item() == pytest.approx(2 * k, rel=0.02)
